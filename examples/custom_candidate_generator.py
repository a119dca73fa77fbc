"""A user-written candidate generator driving an IPEX target: reference-document lookup.

Retrieval-style speculation (in the spirit of REST, He et al. 2023, arXiv:2311.08252): the candidates
are copied from a *reference document* that is not part of the prompt (here: the model's earlier
answer to a slightly different request), wherever the last tokens of the text so far also occur in it. transformers'
two-method interface is all it takes:

    get_candidates(input_ids)                      -> (input_ids + proposed tokens, None)
    update_candidate_strategy(input_ids, scores, num_matches)

Pass it with `model.generate(..., candidate_generator=generator)`. The target verifies every
candidate, so the output equals plain greedy decoding whatever the generator proposes.

Run: `$(scripts/ensure-venv.sh ipex28)/bin/python examples/custom_candidate_generator.py`
"""

import sys

import torch
from transformers import AutoTokenizer
from transformers.generation.candidate_generator import CandidateGenerator

from _common import chat, compare, setup
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.provisioning.prompts import humaneval_prompts


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


def main():
    setup()
    model = IPEXModelForCausalLM.from_pretrained("smollm2-135m-instruct", export=True)
    tokenizer = AutoTokenizer.from_pretrained(model.source)
    code = humaneval_prompts((2,))[0]
    # The reference document: yesterday's answer to a slightly different request (a cache of earlier
    # answers, as when a user edits a prompt and regenerates).
    earlier = chat(tokenizer, f"Rewrite this function with a one-line body.\n\n```python\n{code}```")
    earlier_answer = model.generate(**earlier, max_new_tokens=96, do_sample=False)[0, earlier.input_ids.shape[1]:]
    inputs = chat(tokenizer, f"Please rewrite this function with a one-line body.\n\n```python\n{code}```")
    generator = ReferenceLookupCandidateGenerator(earlier_answer)
    same = compare(model, inputs, tokenizer, "reference lookup", max_new_tokens=96, stats=lambda: generator,
                   candidate_generator=generator)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
