"""The real pair for universal assisted generation: Gemma 3 270M target, SmolLM2-135M-Instruct draft.

Two real, unrelated tokenizers (Gemma's 262,144-entry SentencePiece-style BPE with <bos>; SmolLM2's
49,152-entry byte-level BPE without BOS). Greedy output must be the Gemma 3 target's own.
"""

import pytest
import torch
import transformers

from optimum_ipex_spec.compat import transformers_major
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.provisioning.prompts import chatterbot_questions, humaneval_prompts, news_articles

pytestmark = pytest.mark.slow

TRANSFORMERS_MAJOR = transformers_major()
NEW_TOKENS = 24


def real_text_prompts():
    """Plain-text continuations for a base model: code, news, a question."""
    return [humaneval_prompts((2,))[0], news_articles((1,), max_words=60)[0] + "\n\nIn short,",
            f"Question: {chatterbot_questions()[0]}\nAnswer:"]


@pytest.fixture(scope="module")
def pair(gemma3_dir, smollm2_dir):
    dtype = {"dtype": torch.float32} if TRANSFORMERS_MAJOR >= 5 else {"torch_dtype": torch.float32}
    return {
        "reference": transformers.AutoModelForCausalLM.from_pretrained(gemma3_dir, **dtype).eval(),
        "target": IPEXModelForCausalLM.from_pretrained(gemma3_dir, export=True, torch_dtype=torch.float32),
        "draft": IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True, torch_dtype=torch.float32),
        "target_tok": transformers.AutoTokenizer.from_pretrained(gemma3_dir),
        "draft_tok": transformers.AutoTokenizer.from_pretrained(smollm2_dir),
    }


def test_tokenizers_really_differ(pair):
    text = real_text_prompts()[0]
    assert len(pair["target_tok"]) != len(pair["draft_tok"])
    assert pair["target_tok"](text).input_ids[0] == pair["target_tok"].bos_token_id
    assert pair["draft_tok"](text).input_ids[0] != pair["draft_tok"].bos_token_id


@pytest.mark.parametrize("index", range(3))
def test_gemma3_target_smollm2_draft_greedy_lossless(pair, index):
    enc = pair["target_tok"](real_text_prompts()[index], return_tensors="pt")
    n = enc.input_ids.shape[1]
    # One token more than compared: transformers 4.51's HybridCache drops <bos> from the sliding layers at its
    # last slot (huggingface/transformers#37574), which can change the reference's final token in that lane.
    with torch.inference_mode():
        expected = pair["reference"].generate(**enc, max_new_tokens=NEW_TOKENS + 1, do_sample=False)
    got = pair["target"].generate(**enc, max_new_tokens=NEW_TOKENS + 1, do_sample=False,
                                  assistant_model=pair["draft"], tokenizer=pair["target_tok"],
                                  assistant_tokenizer=pair["draft_tok"])
    assert got.shape[1] == expected.shape[1]
    assert got[0, : n + NEW_TOKENS].tolist() == expected[0, : n + NEW_TOKENS].tolist()


@pytest.mark.skipif(TRANSFORMERS_MAJOR >= 5, reason="transformers >= 5 crops sliding-window caches itself")
def test_beyond_sliding_window_is_refused_clearly_in_4x(pair):
    """4.x cannot crop Gemma 3's hybrid cache; our DynamicCache route is exact only inside the 512-token window."""
    enc = pair["target_tok"]("word " * 500, return_tensors="pt")
    with pytest.raises(ValueError, match="sliding window"):
        pair["target"].generate(**enc, max_new_tokens=40, assistant_model=pair["draft"],
                                tokenizer=pair["target_tok"], assistant_tokenizer=pair["draft_tok"])
