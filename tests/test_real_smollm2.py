"""Integration: the real SmolLM2-135M-Instruct on real prompts (HumanEval + chatterbot questions)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_ipex_spec import IPEXModelForCausalLM

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
#: IPEX bf16 greedy output equals stock output for at least this many tokens on the 5 real prompts
#: (measured: >= 37 tokens vs stock fp32, >= 27 vs stock bf16; see docs/benchmarks.md).
BF16_EXACT_PREFIX = 16


@pytest.fixture(scope="module")
def stock_fp32(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_outputs(stock_fp32, tokenizer, real_prompts):
    outs = []
    for prompt in real_prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        outs.append(stock_fp32.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False))
    return outs


def test_fp32_greedy_token_identical(smollm2_dir, tokenizer, real_prompts, reference_outputs, tmp_path):
    model = IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True, torch_dtype=torch.float32)
    assert len(real_prompts) >= 5
    for prompt, expected in zip(real_prompts, reference_outputs):
        inputs = tokenizer(prompt, return_tensors="pt")
        got = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert got.shape[1] - inputs.input_ids.shape[1] == NEW_TOKENS
        assert torch.equal(got, expected), prompt
    # round trip of the real export: identical tokens without re-tracing
    model.save_pretrained(tmp_path)
    loaded = IPEXModelForCausalLM.from_pretrained(tmp_path)
    inputs = tokenizer(real_prompts[0], return_tensors="pt")
    assert torch.equal(loaded.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False), reference_outputs[0])


def test_bf16_documented_prefix(smollm2_dir, tokenizer, real_prompts, reference_outputs):
    model = IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True, torch_dtype=torch.bfloat16)
    for prompt, expected in zip(real_prompts, reference_outputs):
        inputs = tokenizer(prompt, return_tensors="pt")
        n = inputs.input_ids.shape[1]
        got = model.generate(**inputs, max_new_tokens=BF16_EXACT_PREFIX, do_sample=False)
        assert got[0, n:].tolist() == expected[0, n : n + BF16_EXACT_PREFIX].tolist(), prompt


def test_assisted_with_bf16_self_draft_token_identical(smollm2_dir, tokenizer, real_prompts, reference_outputs):
    """The real same-tokenizer pair: fp32 target + its bf16 copy as draft == target alone (greedy); the draft copies
    the prompt's KV rows from the target's cache (shared_kv.py) instead of running its own prefill."""
    target = IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True, torch_dtype=torch.float32)
    draft = target.self_draft()
    assert draft.dtype == torch.bfloat16
    for prompt, expected in zip(real_prompts, reference_outputs):
        inputs = tokenizer(prompt, return_tensors="pt")
        got = target.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft)
        assert torch.equal(got, expected), prompt
        stats = draft.last_speculation_stats
        assert stats.rounds > 0 and stats.accepted > 0
        assert stats.shared_rows >= inputs["input_ids"].shape[1] - 1
