"""Bad input gets a clear, early error; fallbacks are logged once and still give correct tokens."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

from conftest import build_tiny, copy_model
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.utils import import_utils
from optimum_ipex_spec.utils.import_utils import IPEXNotAvailableError, IPEXStatus


@pytest.fixture
def no_ipex(monkeypatch):
    """Simulate an environment where IPEX cannot be used (torch/IPEX major.minor mismatch)."""
    fake = IPEXStatus(False, "2.7.0", torch.__version__,
                      f"intel_extension_for_pytorch 2.7.0 needs torch 2.7.*, but torch {torch.__version__} is installed")
    monkeypatch.setattr(import_utils, "ipex_status", lambda: fake)
    import optimum_ipex_spec.modeling as modeling

    monkeypatch.setattr(modeling, "ipex_status", lambda: fake)
    import_utils.log_fallback_once.cache_clear()
    yield fake
    import_utils.log_fallback_once.cache_clear()


def test_missing_ipex_falls_back_and_logs_once(no_ipex, tiny_dir, caplog):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec"):
        a = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
        b = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    fallback_lines = [r for r in caplog.records if "falling back to the pure-PyTorch path" in r.getMessage()]
    assert len(fallback_lines) == 1
    assert "needs torch 2.7" in fallback_lines[0].getMessage()
    assert a.backend == b.backend == "torch"
    expected = ref.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(a.generate(ids, max_new_tokens=20, do_sample=False), expected)


def test_explicit_ipex_backend_without_ipex_raises_with_pip_command(no_ipex, tiny_dir):
    with pytest.raises(IPEXNotAvailableError) as err:
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="ipex")
    msg = str(err.value)
    assert "pip install" in msg and "intel-extension-for-pytorch==2.8.0" in msg and "torch==2.8.0" in msg
    assert "needs torch 2.7" in msg


def test_saved_ipex_export_without_ipex_raises(no_ipex, tmp_path):
    import json

    (tmp_path / "config.json").write_text(build_tiny("llama").config.to_json_string())
    (tmp_path / "ipex_export.json").write_text(json.dumps(
        {"backend": "ipex", "torch_dtype": "float32", "ipex_version": "2.8.0", "torch_version": "2.8.0"}))
    with pytest.raises(IPEXNotAvailableError, match="re-export the original checkpoint with backend='torch'"):
        IPEXModelForCausalLM.from_pretrained(tmp_path)


def test_unsupported_architecture_falls_back_with_warning(tiny_dir, caplog):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("gpt2")).eval()
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec"):
        model = IPEXModelForCausalLM.from_pretrained(tiny_dir("gpt2"), export=True)
    assert model.backend == "torch"
    if import_utils.ipex_status().available:
        assert any("GPT2LMHeadModel is not on IPEX's fused path" in r.getMessage() for r in caplog.records)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False),
                       ref.generate(ids, max_new_tokens=16, do_sample=False))


def test_unsupported_architecture_with_explicit_ipex_raises(tiny_dir, ipex_available):
    with pytest.raises(ValueError, match="not on IPEX's fused path"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("gpt2"), export=True, backend="ipex")


@pytest.mark.parametrize("builder", ["bert", "t5"])
def test_non_causal_model_raises(builder, tmp_path):
    if builder == "bert":
        model = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=64))
    else:
        model = T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                                    d_kv=16))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        IPEXModelForCausalLM.from_pretrained(tmp_path, export=True)


def test_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        IPEXModelForCausalLM.from_pretrained(str(tmp_path / "nope"), export=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        IPEXModelForCausalLM.from_pretrained(tmp_path, export=True)


def test_bad_dtype_and_backend_raise(tiny_dir):
    with pytest.raises(ValueError, match="torch_dtype"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtype=torch.float16)
    with pytest.raises(ValueError, match="backend must be one of"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="cuda")


def test_beam_search_on_ipex_raises(tiny_dir, ipex_available):
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    with pytest.raises(ValueError, match="Beam search"):
        model.generate(torch.tensor([[1, 2, 3]]), num_beams=2, max_new_tokens=4)


def test_wrong_cache_type_raises(tiny_dir, ipex_available):
    from transformers import DynamicCache

    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    with pytest.raises(TypeError, match="IPEXFusedCache"):
        model(torch.tensor([[1, 2, 3]]), past_key_values=DynamicCache())


def test_explicit_torch_backend_is_exact(tiny_dir):
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True, backend="torch")
    assert model.backend == "torch"
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False),
                       ref.generate(ids, max_new_tokens=24, do_sample=False))


def test_torch_backend_round_trip(tiny_dir, tmp_path):
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="torch")
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    model.save_pretrained(tmp_path)
    loaded = IPEXModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.backend == "torch"
    assert torch.equal(loaded.generate(ids, max_new_tokens=16, do_sample=False), expected)
