"""Universal assisted generation: target and draft with different tokenizers.

Target: Gemma 3 270M (262,144-entry vocabulary). Draft: SmolLM2-135M-Instruct exported with IPEX
(49,152-entry vocabulary). Passing ``tokenizer=`` and ``assistant_tokenizer=`` makes transformers
re-encode the text between the two vocabularies each round; the target verifies every proposal.

Gemma 3 is not on IPEX's fused path, so its ``IPEXModelForCausalLM`` runs the pure-PyTorch backend
(one log line says so); the draft runs IPEX's fused graph. The pair is a real one, not a fast one: the
draft is half the target's size and every round re-encodes text, so expect a ratio below 1.

With transformers 4.x (the IPEX 2.8 lane) the target runs assisted generation on a dynamic cache (4.x
cannot crop Gemma 3's hybrid cache): exact within Gemma's 512-token sliding window, a clear error past
it. Needs the Gemma 3 folder: `make provision-gemma3`.

Run: `$(scripts/ensure-venv.sh ipex28)/bin/python examples/universal_assisted.py`
"""

import sys

import torch
from transformers import AutoTokenizer

from _common import compare, setup
from optimum_ipex_spec import IPEXModelForCausalLM


def main():
    setup()
    target = IPEXModelForCausalLM.from_pretrained("gemma3-270m", export=True, torch_dtype=torch.float32)
    draft = IPEXModelForCausalLM.from_pretrained("smollm2-135m-instruct", export=True, torch_dtype=torch.float32)
    target_tokenizer = AutoTokenizer.from_pretrained(target.source)
    draft_tokenizer = AutoTokenizer.from_pretrained(draft.source)
    draft.generation_config.num_assistant_tokens = 5
    print(f"target: {target!r}, vocabulary {len(target_tokenizer)}\n"
          f"draft:  {draft!r}, vocabulary {len(draft_tokenizer)}\n")
    inputs = target_tokenizer("The capital of France is Paris. The capital of Germany is", return_tensors="pt")
    same = compare(target, inputs, target_tokenizer, "with SmolLM2", max_new_tokens=32, stats=None,
                   assistant_model=draft, tokenizer=target_tokenizer, assistant_tokenizer=draft_tokenizer)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
