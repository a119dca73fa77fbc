"""Weight-only int4 quantized at load from a real dense checkpoint (``weights="int4"``): Qwen2.5-Coder-0.5B-Instruct
(biases on q/k/v, a head of its own), from its provisioned fp32 folder.

- Quality floor: teacher-forced on a real chat prompt and its fp32 continuation, the int4 model's next token is the
  fp32 model's at most positions (a wrong row order or a broken block gives about none).
- Speculative decoding over the int4 target, exact and fast mode, returns its own greedy tokens: prompt lookup, its
  int8 self-draft (bf16), and SmolLM2-135M's int4 copy as a draft of another tokenizer (universal assisted generation).
"""

import pytest
import torch
import transformers

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.pytorch.gguf_weights import GGUFLinear
from optimum_ipex_spec.provisioning.prompts import chat_prompts

from conftest import provisioned

pytestmark = pytest.mark.slow

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def qwen(qwen05_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen05_dir)
    prompts = [tokenizer(p, return_tensors="pt") for p in chat_prompts(tokenizer, n=2)]
    return {"tokenizer": tokenizer, "prompts": prompts, "folder": qwen05_dir, "targets": {}}


def _target(qwen, mode):
    if mode not in qwen["targets"]:
        target = IPEXModelForCausalLM.from_pretrained(qwen["folder"], export=True, weights="int4", gguf_mode=mode)
        alone = [target.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False) for enc in qwen["prompts"]]
        qwen["targets"][mode] = (target, alone)
    return qwen["targets"][mode]


def test_int4_next_tokens_are_mostly_the_fp32_models(qwen):
    target, _ = _target(qwen, "exact")
    assert sum(isinstance(m, GGUFLinear) for m in target.model.modules()) == 24 * 7 + 2
    dense = transformers.AutoModelForCausalLM.from_pretrained(qwen["folder"], torch_dtype=torch.float32).eval()
    enc = qwen["prompts"][0]
    with torch.no_grad():
        text = dense.generate(**enc, max_new_tokens=96, do_sample=False)
        expected = dense(text).logits[0].argmax(-1)
        got = target(text).logits[0].argmax(-1)
    agree = float((got == expected).float().mean())
    assert agree > 0.75, f"int4 agrees with fp32 on {agree:.0%} of next tokens"


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("kind", ["prompt lookup", "int8 self-draft", "smollm2 int4 (universal)"])
def test_speculation_over_an_int4_qwen_is_lossless(qwen, mode, kind):
    target, alone = _target(qwen, mode)
    if kind == "prompt lookup":
        extra = {"prompt_lookup_num_tokens": 6}
    elif kind == "int8 self-draft":
        extra = {"assistant_model": target.self_draft(weights="int8")}
    else:
        smollm2_dir = provisioned("smollm2-135m-instruct")
        draft = IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True, weights="int4", gguf_mode="fast")
        extra = {"assistant_model": draft, "tokenizer": qwen["tokenizer"],
                 "assistant_tokenizer": transformers.AutoTokenizer.from_pretrained(smollm2_dir)}
    for enc, expected in zip(qwen["prompts"], alone):
        got = target.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, **extra)
        assert torch.equal(got, expected), kind
