"""IPEXModelForCausalLM on tiny seeded models with a real tokenizer: token-exact against stock transformers."""

import pytest
import os

import torch
from parameterized import parameterized
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList, TextStreamer

from conftest import build_tiny, copy_model
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.utils.import_utils import ipex_status

FUSED_ARCHS = ["llama", "llama-mha", "qwen2", "mistral"]
EXPECTED_BACKEND = "ipex" if ipex_status().available else "torch"
TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "  Whitespace   and\ttabs, digits 0123456789 and ünïcödé — 東京 ✓",
    "The quick brown fox jumps over the lazy dog.",
]


def _ids(tokenizer, text):
    return tokenizer(text, return_tensors="pt")


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_greedy_token_identical_fp32(arch, tiny_dir, tokenizer):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir(arch)).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir(arch), export=True, torch_dtype=torch.float32)
    assert model.backend == EXPECTED_BACKEND
    for text in TEXTS:
        inputs = _ids(tokenizer, text)
        expected = ref.generate(**inputs, max_new_tokens=40, do_sample=False)
        got = model.generate(**inputs, max_new_tokens=40, do_sample=False)
        assert got.shape[1] == inputs.input_ids.shape[1] + 40
        assert torch.equal(got, expected), text


def test_forward_returns_logits_like_transformers(tiny_dir, tokenizer):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    inputs = _ids(tokenizer, TEXTS[0])
    with torch.no_grad():
        out = model(**inputs)
        expected = ref(**inputs).logits
    assert out.logits.shape == expected.shape == (1, inputs.input_ids.shape[1], ref.config.vocab_size)
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=1e-5)
    # one more token on top of the returned cache
    nxt = expected[:, -1:].argmax(-1)
    with torch.no_grad():
        step = model(nxt, past_key_values=out.past_key_values)
        full = ref(torch.cat([inputs.input_ids, nxt], 1)).logits[:, -1:]
    torch.testing.assert_close(step.logits, full, atol=1e-5, rtol=1e-5)
    assert out.past_key_values.get_seq_length() == inputs.input_ids.shape[1] + 1


@parameterized.expand([(0,), (1,), (7,)])
def test_sampling_seeded_matches_stock(seed):
    ref = build_tiny("llama", vocab_size=512)
    model = IPEXModelForCausalLM.from_transformers_model(copy_model(ref))
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    kwargs = dict(max_new_tokens=24, do_sample=True, top_k=50, temperature=0.9)
    torch.manual_seed(seed)
    expected = ref.generate(ids, **kwargs)
    torch.manual_seed(seed)
    got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)


def test_batch_with_left_padding(tiny_dir, tokenizer):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    tokenizer.padding_side = "left"
    inputs = tokenizer(TEXTS[:2], return_tensors="pt", padding=True)
    expected = ref.generate(**inputs, max_new_tokens=16, do_sample=False)
    got = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, expected)


def test_eos_stops_generation(tiny_dir, tokenizer):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    inputs = _ids(tokenizer, TEXTS[2])
    plain = ref.generate(**inputs, max_new_tokens=20, do_sample=False)[0, inputs.input_ids.shape[1]:]
    eos = int(plain[5])  # the 6th generated token becomes "EOS"
    got = model.generate(**inputs, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = got[0, inputs.input_ids.shape[1]:]
    first = int((plain == eos).nonzero()[0])
    assert new.tolist() == plain[: first + 1].tolist()


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_custom_stopping_criteria(tiny_dir, tokenizer):
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    inputs = _ids(tokenizer, TEXTS[0])
    stop_at = inputs.input_ids.shape[1] + 7
    got = model.generate(**inputs, max_new_tokens=30, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([_StopAfter(stop_at)]))
    assert got.shape[1] == stop_at


class _Collect(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.tokens = []

    def put(self, value):
        if self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        pass


def test_streamer_receives_generated_tokens(tiny_dir, tokenizer):
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    inputs = _ids(tokenizer, TEXTS[1])
    streamer = _Collect(tokenizer)
    got = model.generate(**inputs, max_new_tokens=12, do_sample=False, streamer=streamer)
    assert streamer.tokens == got[0, inputs.input_ids.shape[1]:].tolist()


def test_pipeline_text_generation(tiny_dir, tokenizer):
    from transformers import pipeline

    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe(TEXTS[2], max_new_tokens=10, do_sample=False)[0]["generated_text"]
    expected = tokenizer.decode(ref.generate(**_ids(tokenizer, TEXTS[2]), max_new_tokens=10, do_sample=False)[0],
                                skip_special_tokens=True)
    assert out == expected


def test_save_load_round_trip_reads_no_archive(tiny_dir, tokenizer, tmp_path, monkeypatch):
    """A saved export loads without export=True's path and without reading a TorchScript archive (format 3 holds
    none: IPEX's graphs are traced again from the saved weights), and generates the same tokens."""
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True)
    inputs = _ids(tokenizer, TEXTS[0])
    expected = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    model.save_pretrained(tmp_path)
    assert not [name for name in os.listdir(tmp_path) if name.endswith((".pt", ".bin", ".pkl"))]

    def _refused(*a, **k):
        raise AssertionError("loading a saved export must neither export from a checkpoint nor load an archive")

    monkeypatch.setattr(IPEXModelForCausalLM, "_export", classmethod(_refused))
    monkeypatch.setattr(torch.jit, "load", _refused)
    monkeypatch.setattr(torch, "load", _refused)
    loaded = IPEXModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.backend == model.backend
    assert torch.equal(loaded.generate(**inputs, max_new_tokens=32, do_sample=False), expected)


def test_bf16_close_to_fp32(tiny_dir, tokenizer):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    inputs = _ids(tokenizer, TEXTS[0])
    with torch.no_grad():
        logits = model(**inputs).logits.float()
        expected = ref(**inputs).logits
    # bf16 has an 8-bit mantissa: logits agree to about 1e-2 relative on this tiny model
    torch.testing.assert_close(logits, expected, atol=3e-2, rtol=3e-2)


def test_use_cache_false_still_exact(tiny_dir, tokenizer):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    inputs = _ids(tokenizer, TEXTS[2])
    expected = ref.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False, use_cache=False), expected)
