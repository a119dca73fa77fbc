"""A real-size target: Qwen2.5-Coder-0.5B-Instruct (494M parameters, untied 151,936-entry head) in fp32.

Greedy output of our export must be stock transformers' own, and stay so with every kind of draft: its own bf16
copy (same tokenizer), SmolLM2-135M (a different tokenizer: universal assisted generation) and prompt lookup.
Sampling with top_k=1 goes through the sampling verification path and must give the greedy tokens.
The 1.5B target with this model as its draft is measured by `make bench-pair` (benchmarks/pair.py).
"""

import pytest
import torch
import transformers

from optimum_ipex_spec.compat import transformers_major
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.provisioning.prompts import chat_prompts

pytestmark = pytest.mark.slow

NEW_TOKENS = 20
TRANSFORMERS_MAJOR = transformers_major()


@pytest.fixture(scope="module")
def qwen(qwen05_dir):
    dtype = {"dtype": torch.float32} if TRANSFORMERS_MAJOR >= 5 else {"torch_dtype": torch.float32}
    target = IPEXModelForCausalLM.from_pretrained(qwen05_dir, export=True, torch_dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen05_dir)
    prompts = chat_prompts(tokenizer, n=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(qwen05_dir, **dtype).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt")
            expected.append(reference.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False))
    del reference
    return {"target": target, "tokenizer": tokenizer, "prompts": prompts, "expected": expected}


def _generate(qwen, index, **kwargs):
    enc = qwen["tokenizer"](qwen["prompts"][index], return_tensors="pt")
    return qwen["target"].generate(**enc, max_new_tokens=NEW_TOKENS, **kwargs)


@pytest.mark.parametrize("index", range(2))
def test_export_greedy_matches_stock(qwen, index):
    assert _generate(qwen, index, do_sample=False).tolist() == qwen["expected"][index].tolist()


@pytest.mark.parametrize("index", range(2))
def test_bf16_self_draft_lossless(qwen, index):
    draft = qwen.setdefault("bf16_draft", qwen["target"].self_draft(torch_dtype=torch.bfloat16))
    got = _generate(qwen, index, do_sample=False, assistant_model=draft)
    assert got.tolist() == qwen["expected"][index].tolist()
    stats = draft.last_speculation_stats
    assert stats is not None and stats.proposed > 0, "the draft never proposed: speculation did not run"


@pytest.mark.parametrize("index", range(2))
def test_smollm2_draft_universal_lossless(qwen, smollm2_dir, index):
    draft = qwen.setdefault("smollm2", IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True))
    draft_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(draft_tokenizer) != len(qwen["tokenizer"])
    got = _generate(qwen, index, do_sample=False, assistant_model=draft, tokenizer=qwen["tokenizer"],
                    assistant_tokenizer=draft_tokenizer)
    assert got.tolist() == qwen["expected"][index].tolist()


def test_prompt_lookup_lossless(qwen):
    got = _generate(qwen, 0, do_sample=False, prompt_lookup_num_tokens=5)
    assert got.tolist() == qwen["expected"][0].tolist()


def test_sampling_with_draft_top_k_1_gives_the_greedy_tokens(qwen):
    draft = qwen.setdefault("bf16_draft", qwen["target"].self_draft(torch_dtype=torch.bfloat16))
    torch.manual_seed(0)
    got = _generate(qwen, 1, do_sample=True, top_k=1, assistant_model=draft)
    assert got.tolist() == qwen["expected"][1].tolist()
