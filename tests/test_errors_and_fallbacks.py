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
        IPEXModelForCausalLM.from_pretrained(tmp_path, trust_torchscript=True)  # a format-1 folder: an IPEX graph


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


# ----------------------------------------------------------------------------- inputs that would crash IPEX
@pytest.fixture(scope="module")
def ipex_llama(tiny_dir):
    from optimum_ipex_spec.utils.import_utils import ipex_status

    if not ipex_status().available:
        pytest.skip("IPEX not usable in this lane")
    return IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)


@pytest.mark.parametrize("ids, error, match", [
    (torch.ones(1, 0, dtype=torch.long), ValueError, "empty"),  # IPEX: SIGFPE
    (torch.ones(0, 5, dtype=torch.long), ValueError, "empty"),  # IPEX: SIGSEGV
    (torch.ones(5, dtype=torch.long), ValueError, "2-D"),
    (torch.ones(1, 5), TypeError, "integer"),
    (torch.tensor([[1, 2, 10 ** 6]]), ValueError, r"token ids must be in \[0, 49152\)"),
    (torch.tensor([[1, -2, 3]]), ValueError, "token ids"),
])
def test_bad_input_ids_raise_before_the_kernel(ipex_llama, ids, error, match):
    with pytest.raises(error, match=match):
        ipex_llama(ids)
    if ids.dim() == 2 and ids.numel() == 0 and ids.shape[0] == 1:
        with pytest.raises(ValueError, match="empty"):
            ipex_llama.generate(ids, max_new_tokens=3)


def test_cache_of_other_batch_or_depth_raises(ipex_llama):
    from optimum_ipex_spec import IPEXFusedCache

    with pytest.raises(ValueError, match="batch 3"):  # IPEX: SIGABRT
        ipex_llama.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, past_key_values=IPEXFusedCache(2, 3))
    with pytest.raises(ValueError, match="5 layers"):
        ipex_llama(torch.tensor([[1, 2, 3]]), past_key_values=IPEXFusedCache(5, 1))


def test_positions_beyond_max_position_embeddings_raise(tmp_path):
    from optimum_ipex_spec.utils.import_utils import ipex_status

    if not ipex_status().available:
        pytest.skip("IPEX not usable in this lane")
    model = build_tiny("llama", vocab_size=512)
    model.config.max_position_embeddings = 64
    model.save_pretrained(tmp_path)
    ipex_model = IPEXModelForCausalLM.from_pretrained(tmp_path, export=True)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):  # IPEX: all-NaN logits
        ipex_model(torch.ones(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings=64"):  # generate(): before any forward
        ipex_model.generate(torch.ones(1, 64, dtype=torch.long), max_new_tokens=10, do_sample=False)
    # a request past the positions stops at them, with a warning (tests/test_limits.py)
    assert ipex_model.generate(torch.ones(1, 60, dtype=torch.long), max_new_tokens=10, do_sample=False).shape == (1, 64)


def test_attention_mask_length_and_unsupported_outputs(ipex_llama):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"expected \(1, 3\)"):
        ipex_llama(ids, attention_mask=torch.ones(1, 5, dtype=torch.long))
    for flag in ("output_attentions", "output_hidden_states"):
        with pytest.raises(ValueError, match=flag):
            ipex_llama(ids, **{flag: True})


def test_labels_give_the_transformers_loss(ipex_llama, tiny_dir):
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    ids = torch.tensor([[5, 9, 200, 17, 3, 8]])
    labels = ids.clone()
    labels[0, :2] = -100
    with torch.no_grad():
        expected = stock(ids, labels=labels).loss
        got = ipex_llama(ids, labels=labels).loss
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_pure_pytorch_path_gives_the_loss_and_every_hidden_state(tiny_dir):
    """backend="torch": labels give transformers' loss (a labels tensor once raised "Boolean value of Tensor ... is
    ambiguous"), and hidden states cover every position even where logits_to_keep keeps a few on an empty cache
    (such a call is otherwise split into the prompt and the rest, speculative decoding's first round)."""
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="torch")
    ids = torch.tensor([[5, 9, 200, 17, 3, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, labels=ids).loss, stock(ids, labels=ids).loss, atol=1e-5, rtol=1e-5)
        got = model(ids, logits_to_keep=3, output_hidden_states=True)
        want = stock(ids, logits_to_keep=3, output_hidden_states=True)
    assert got.logits.shape == want.logits.shape == (1, 3, stock.config.vocab_size)
    assert [h.shape for h in got.hidden_states] == [h.shape for h in want.hidden_states]
    assert all(h.shape[1] == ids.shape[1] for h in got.hidden_states)


def test_to_dtype_or_device_raises(ipex_llama):
    with pytest.raises(ValueError, match="cannot change dtype"):
        ipex_llama.to(torch.float16)
    with pytest.raises(ValueError, match="CPU only"):
        ipex_llama.to("cuda")
    assert ipex_llama.to("cpu") is ipex_llama


# ----------------------------------------------------------------------------- broken or mismatched folders
def _saved_copy(model, tmp_path, name="export"):
    folder = tmp_path / name
    model.save_pretrained(folder)
    return folder


def test_corrupted_export_files_name_the_file_and_fix(ipex_llama, tmp_path):
    import json

    folder = _saved_copy(ipex_llama, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors has \d+ bytes, its manifest says.*re-export"):
        IPEXModelForCausalLM.from_pretrained(folder)
    weights.unlink()
    with pytest.raises(ValueError, match=r"model.safetensors is listed in the manifest but missing.*re-export"):
        IPEXModelForCausalLM.from_pretrained(folder)
    meta = folder / "ipex_export.json"
    for broken in ("{", json.dumps({"torch_dtype": "float32"}), json.dumps([1, 2]),
                   json.dumps({"backend": "ipex", "torch_dtype": "float16"})):
        meta.write_text(broken)
        with pytest.raises(ValueError, match="ipex_export.json"):
            IPEXModelForCausalLM.from_pretrained(folder)
    meta.write_text(json.dumps({"backend": "ipex", "torch_dtype": "float32", "format_version": 99}))
    with pytest.raises(ValueError, match="newer optimum-ipex-spec"):
        IPEXModelForCausalLM.from_pretrained(folder)


def test_an_export_loads_on_either_backend_and_exports_again(ipex_llama, tiny_dir, tmp_path, tokenizer):
    """A data-only export holds a transformers checkpoint in the export dtype: it loads on the other backend too
    (IPEX's graphs are traced from it, our decoder reads it), and export=True on it is an export of that checkpoint.
    Each gives stock transformers' greedy tokens."""
    inputs = tokenizer("def fib(n):", return_tensors="pt")
    expected = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval().generate(**inputs, max_new_tokens=12,
                                                                                       do_sample=False)
    folder = _saved_copy(ipex_llama, tmp_path)
    torch_folder = _saved_copy(IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="torch"),
                               tmp_path, "torch-export")
    for path, backend in ((folder, "torch"), (torch_folder, "ipex"), (folder, "auto"), (torch_folder, "auto")):
        model = IPEXModelForCausalLM.from_pretrained(path, backend=backend)
        assert model.backend == (backend if backend != "auto" else ("ipex" if path == folder else "torch"))
        assert torch.equal(model.generate(**inputs, max_new_tokens=12, do_sample=False), expected), (path, backend)
    again = IPEXModelForCausalLM.from_pretrained(folder, export=True, backend="torch")
    assert torch.equal(again.generate(**inputs, max_new_tokens=12, do_sample=False), expected)


def test_export_true_on_a_legacy_export_is_refused(ipex_llama, tmp_path):
    from conftest import write_legacy_export

    write_legacy_export(ipex_llama, tmp_path / "legacy")
    with pytest.raises(ValueError, match="already an IPEX export"):
        IPEXModelForCausalLM.from_pretrained(tmp_path / "legacy", export=True)


def test_provisioned_name_is_accepted(monkeypatch, tiny_dir):
    from optimum_ipex_spec.provisioning import provision

    monkeypatch.setattr(provision, "provision", lambda name, cache_dir=None: tiny_dir("llama"))
    model = IPEXModelForCausalLM.from_pretrained("smollm2-135m-instruct", export=True)
    assert model.config.num_hidden_layers == 2


AVX2_REASON = "IPEX's bf16 kernels need a CPU with AVX512-BW/VL/DQ or AVX-NE-CONVERT, and this one offers AVX2"


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    """Simulate an AVX2-only CPU (AMD Zen 3, say), whatever this machine is: IPEX cannot prepack bf16 weights."""
    import optimum_ipex_spec.modeling as modeling

    fake = lambda name: AVX2_REASON if name == "bfloat16" else None  # noqa: E731
    monkeypatch.setattr(import_utils, "ipex_dtype_unsupported", fake)
    monkeypatch.setattr(modeling, "ipex_dtype_unsupported", fake)
    import_utils.log_dtype_fallback_once.cache_clear()
    yield
    import_utils.log_dtype_fallback_once.cache_clear()


def test_bf16_probe_agrees_with_torch_onednn(ipex_available):
    """Our probe (IPEX's oneDNN) and torch's own (its bundled oneDNN) answer the same on this CPU; fp32 always runs."""
    import_utils.ipex_dtype_unsupported.cache_clear()
    assert import_utils.ipex_dtype_unsupported("float32") is None
    reason = import_utils.ipex_dtype_unsupported("bfloat16")
    assert (reason is None) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if reason is not None:
        assert torch.backends.cpu.get_cpu_capability() in reason


def test_bf16_without_cpu_support_falls_back_to_torch_and_logs_once(cpu_without_bf16, ipex_available, tiny_dir,
                                                                     caplog):
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir("llama"), torch_dtype=torch.bfloat16).eval()
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec"):
        a = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtype=torch.bfloat16)
        b = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtype=torch.bfloat16)
        fp32 = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    lines = [r.getMessage() for r in caplog.records if "runs on the pure-PyTorch path instead" in r.getMessage()]
    assert len(lines) == 1 and AVX2_REASON in lines[0]
    assert a.backend == b.backend == "torch" and fp32.backend == "ipex"
    out = a.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out[:, :10], ref.generate(ids, max_new_tokens=12, do_sample=False)[:, :10])


def test_bf16_with_explicit_ipex_without_cpu_support_raises_before_ipex(cpu_without_bf16, ipex_available, tiny_dir):
    from optimum_ipex_spec.backends.ipex.export import export_to_ipex, ipex_converted

    with pytest.raises(ValueError, match="Use torch_dtype=torch.float32, or backend='auto' or 'torch'") as err:
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtype=torch.bfloat16,
                                             backend="ipex")
    assert AVX2_REASON in str(err.value)
    model = build_tiny("llama").to(torch.bfloat16).eval()
    with pytest.raises(ValueError, match="AVX2"):
        export_to_ipex(model, torch.bfloat16)
    assert not ipex_converted(model)  # refused before IPEX touched it: the model can still be used


def test_saved_bf16_ipex_export_on_cpu_without_bf16_raises(cpu_without_bf16, ipex_available, tmp_path):
    import json

    (tmp_path / "config.json").write_text(build_tiny("llama").config.to_json_string())
    status = import_utils.ipex_status()
    (tmp_path / "ipex_export.json").write_text(json.dumps(
        {"backend": "ipex", "torch_dtype": "bfloat16", "ipex_version": status.ipex_version,
         "torch_version": status.torch_version}))
    with pytest.raises(ValueError, match="exported in bfloat16, and IPEX's bf16 kernels need") as err:
        IPEXModelForCausalLM.from_pretrained(tmp_path, trust_torchscript=True)
    assert "torch_dtype=torch.float32 keeps IPEX" in str(err.value)


def test_bf16_self_draft_on_a_cpu_without_native_bf16_warns_once_and_stays_exact(cpu_without_onednn_bf16, tiny_dir,
                                                                                   caplog):
    """Measured on an AVX2-only CPU: the bf16 copy is hardly cheaper than its fp32 target. It still drafts exactly;
    the user is told once why it gains little."""
    import optimum_ipex_spec.modeling as modeling

    modeling._warn_emulated_bf16_draft.cache_clear()
    target = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec"):
        draft, again = target.self_draft(), target.self_draft()
    lines = [r.getMessage() for r in caplog.records if "has no native bf16" in r.getMessage()]
    assert len(lines) == 1 and "Use a smaller draft model" in lines[0]
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=draft, **kwargs), target.generate(ids, **kwargs))
    modeling._warn_emulated_bf16_draft.cache_clear()
