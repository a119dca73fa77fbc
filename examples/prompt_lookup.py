"""Prompt lookup decoding: no draft model, candidates copied from the prompt.

When the answer repeats parts of the prompt (editing code, restating a document), the n-gram that
ends the text so far often occurs in the prompt, and what followed it there is a good guess for what
comes next. ``generate(prompt_lookup_num_tokens=k)`` proposes up to ``k`` such tokens per step; the
target verifies them. Ours never exceeds ``max_new_tokens`` and pauses itself when its proposals are
rejected (see docs/assisted-generation.md).

Run: `$(scripts/ensure-venv.sh ipex28)/bin/python examples/prompt_lookup.py`
"""

import sys

from transformers import AutoTokenizer

from _common import chat, compare, setup
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.provisioning.prompts import humaneval_prompts


def main():
    setup()
    model = IPEXModelForCausalLM.from_pretrained("smollm2-135m-instruct", export=True)
    tokenizer = AutoTokenizer.from_pretrained(model.source)
    code = humaneval_prompts((2,))[0]  # a real HumanEval function signature and docstring
    inputs = chat(tokenizer, f"Add type hints and a docstring example to this function.\n\n```python\n{code}```")
    same = compare(model, inputs, tokenizer, "prompt lookup", max_new_tokens=96,
                   stats=lambda: model.last_speculation_stats, prompt_lookup_num_tokens=10)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
