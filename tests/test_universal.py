"""Universal assisted generation (target and draft with different tokenizers) with IPEX models.

The second tokenizer is a real byte-level BPE trained here (seeded data, no download) on HumanEval
code and chatterbot-corpus questions: a different vocabulary (1500 entries) and different merges
from SmolLM2's 49152-entry tokenizer.
"""

import copy

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from conftest import build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM

TEXTS = [
    "def fib(n):\n    return n if n < 2 else",
    "  Whitespace\tand digits 0123456789, ünïcödé and 東京 ✓",
    "Question: what is the capital of France?\nAnswer:",
]


@pytest.fixture(scope="module")
def draft_tokenizer():
    from tokenizers import ByteLevelBPETokenizer

    from optimum_ipex_spec.prompts import chatterbot_questions, humaneval_prompts

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(humaneval_prompts(tuple(range(60))) + chatterbot_questions(per_file=50),
                            vocab_size=1500, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def models(draft_tokenizer):
    target = build_tiny("llama")
    draft = build_tiny("qwen2", vocab_size=len(draft_tokenizer), seed=5)
    return {
        "hf-target": target,
        "hf-draft": draft,
        "ipex-target": IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(target)),
        "ipex-draft": IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(draft)),
    }


def test_tokenizers_really_differ(tokenizer, draft_tokenizer):
    assert len(tokenizer) != len(draft_tokenizer)
    assert tokenizer(TEXTS[0]).input_ids != draft_tokenizer(TEXTS[0]).input_ids


@pytest.mark.parametrize("pairing", ["hf+ipex", "ipex+hf", "ipex+ipex"])
def test_universal_greedy_lossless(pairing, models, tokenizer, draft_tokenizer):
    target_kind, draft_kind = pairing.split("+")
    target, draft = models[f"{target_kind}-target"], models[f"{draft_kind}-draft"]
    for text in TEXTS:
        inputs = tokenizer(text, return_tensors="pt")
        expected = models["hf-target"].generate(**inputs, max_new_tokens=32, do_sample=False)
        got = target.generate(**inputs, max_new_tokens=32, do_sample=False, assistant_model=draft,
                              tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
        assert torch.equal(got, expected), (pairing, text)
