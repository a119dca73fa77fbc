"""Assisted generation (speculative decoding) with the target's own bf16 copy as draft.

The fp32 SmolLM2-135M-Instruct target is exported with IPEX; ``target.self_draft()`` exports the same
checkpoint again in bf16: same tokenizer, ~2x faster per token, and it agrees with the target almost
always. The target verifies every draft token, so greedy output is the target's own.

Run: `$(scripts/ensure-venv.sh ipex28)/bin/python examples/assisted_self_draft.py`
"""

import sys

import torch
from transformers import AutoTokenizer

from _common import chat, compare, setup
from optimum_ipex_spec import IPEXModelForCausalLM


def main():
    setup()
    target = IPEXModelForCausalLM.from_pretrained("smollm2-135m-instruct", export=True, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target.source)
    draft = target.self_draft()  # bf16, up to 8 tokens a round ("cost" schedule)
    print(f"target: {target!r}\ndraft:  {draft!r}\n")
    inputs = chat(tokenizer, "Explain in three sentences what a hash table is.")
    same = compare(target, inputs, tokenizer, "with bf16 draft", max_new_tokens=96,
                   stats=lambda: draft.last_speculation_stats, assistant_model=draft)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
