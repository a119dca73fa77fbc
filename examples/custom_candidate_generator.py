"""A user-written candidate generator driving an IPEX target: reference-document lookup.

Retrieval-style speculation (in the spirit of REST, He et al. 2023, arXiv:2311.08252): the candidates
are copied from a *reference document* that is not part of the prompt (here: the model's earlier
answer to a slightly different request), wherever the last tokens of the text so far also occur in it. transformers' two-method interface is all it takes:

    get_candidates(input_ids)                      -> (input_ids + proposed tokens, None)
    update_candidate_strategy(input_ids, scores, num_matches)

Pass it with `model.generate(..., candidate_generator=generator)`. The target verifies every
candidate, so the output equals plain greedy decoding whatever the generator proposes.

Run: `$(scripts/ensure-venv.sh ipex28)/bin/python examples/custom_candidate_generator.py`
"""

import time

import torch
from transformers import AutoTokenizer
from transformers.generation.candidate_generator import CandidateGenerator

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.prompts import humaneval_prompts
from optimum_ipex_spec.provision import provision


class ReferenceLookupCandidateGenerator(CandidateGenerator):
    """Propose up to ``num_tokens`` tokens that follow the longest suffix match (``min_ngram`` to
    ``ngram`` tokens; single tokens match everywhere and mostly propose noise) in a tokenized
    reference document."""

    def __init__(self, reference_ids: torch.LongTensor, num_tokens: int = 8, ngram: int = 4, min_ngram: int = 2):
        self.reference = reference_ids.flatten()
        self.num_tokens = num_tokens
        self.ngram = ngram
        self.min_ngram = min_ngram
        self.proposed = self.accepted = 0

    def get_candidates(self, input_ids):
        for n in range(self.ngram, self.min_ngram - 1, -1):
            suffix = input_ids[0, -n:]
            windows = self.reference.unfold(0, n, 1)
            hits = (windows == suffix).all(dim=1).nonzero().flatten()
            for start in hits.tolist():
                follow = self.reference[start + n : start + n + self.num_tokens]
                if follow.numel():
                    return torch.cat([input_ids, follow.unsqueeze(0)], dim=1), None
        return input_ids, None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.proposed += scores.shape[1] - 1
        self.accepted += int(num_matches)


def _chat(tokenizer, message):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                           add_generation_prompt=True)
    return tokenizer(prompt, return_tensors="pt")


def main():
    torch.set_num_threads(1)
    path = provision("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = IPEXModelForCausalLM.from_pretrained(path, export=True)
    code = humaneval_prompts((2,))[0]
    # The reference document: yesterday's answer to a slightly different request (a cache of earlier
    # answers, as when a user edits a prompt and regenerates).
    earlier = _chat(tokenizer, f"Rewrite this function with a one-line body.\n\n```python\n{code}```")
    earlier_answer = model.generate(**earlier, max_new_tokens=96, do_sample=False)[0, earlier.input_ids.shape[1]:]
    inputs = _chat(tokenizer, f"Please rewrite this function with a one-line body.\n\n```python\n{code}```")
    generator = ReferenceLookupCandidateGenerator(earlier_answer)

    start = time.perf_counter()
    plain = model.generate(**inputs, max_new_tokens=96, do_sample=False)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    assisted = model.generate(**inputs, max_new_tokens=96, do_sample=False, candidate_generator=generator)
    assisted_s = time.perf_counter() - start

    print(tokenizer.decode(assisted[0, inputs.input_ids.shape[1]:], skip_special_tokens=True))
    print(f"\nplain greedy {plain_s:.2f} s, with reference lookup {assisted_s:.2f} s (x{plain_s / assisted_s:.2f}); "
          f"proposed {generator.proposed}, accepted {generator.accepted}; "
          f"{'token-identical' if torch.equal(plain, assisted) else 'DIFFERENT (bug)'}")


if __name__ == "__main__":
    main()
