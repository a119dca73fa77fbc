"""`optimum-cli export ipex`: export, validate, reload; clear errors with no partial output."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.cli.export import ExportError, main_export

CLI = [str(Path(sys.executable).with_name("optimum-cli")), "export", "ipex"]


def _run(args, **kw):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=900, **kw)


def _siblings(path: Path):
    return sorted(p.name for p in path.parent.iterdir())


def test_help_is_fast_and_lists_options():
    start = time.perf_counter()
    res = subprocess.run(CLI + ["--help"], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert res.returncode == 0, res.stderr
    for option in ("--model", "--task", "--torch_dtype", "--trust_remote_code", "--revision", "--cache_dir",
                   "--local_files_only", "--with_draft", "--atol", "--overwrite"):
        assert option in res.stdout
    assert elapsed < 10, f"`optimum-cli export ipex --help` took {elapsed:.1f} s"
    # registration must not import torch
    probe = subprocess.run([sys.executable, "-c", "import sys, optimum.commands.register.ipex; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


def test_cli_export_tiny_model_reloads_and_matches_in_process(tiny_dir, tmp_path):
    out = tmp_path / "export"
    res = _run(["--model", tiny_dir("llama"), out])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Validation: max |logit diff|" in res.stdout and "PASS" in res.stdout
    meta = json.loads((out / "ipex_export.json").read_text())
    assert meta["torch_dtype"] == "float32"
    loaded = IPEXModelForCausalLM.from_pretrained(out)  # no export=True: the saved graph is used
    in_process = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    assert torch.equal(loaded.generate(ids, max_new_tokens=24, do_sample=False),
                       in_process.generate(ids, max_new_tokens=24, do_sample=False))


def test_validation_failure_exits_non_zero(tiny_dir, tmp_path):
    res = _run(["--model", tiny_dir("llama"), tmp_path / "out", "--torch_dtype", "bfloat16", "--atol", "1e-9"])
    assert res.returncode == 1 and "FAIL" in res.stdout


def test_missing_model_path(tmp_path):
    res = _run(["--model", tmp_path / "does-not-exist", tmp_path / "out"])
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert list(tmp_path.iterdir()) == []  # nothing created, no staging folder left


def test_non_causal_model(tmp_path):
    BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(tmp_path / "bert")
    res = _run(["--model", tmp_path / "bert", tmp_path / "out"])
    assert res.returncode == 2 and "not a causal language model" in res.stderr
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "bert") == ["bert"]


def test_unsupported_task(tiny_dir, tmp_path):
    res = _run(["--model", tiny_dir("llama"), tmp_path / "out", "--task", "fill-mask"])
    assert res.returncode != 0 and "invalid choice" in res.stderr
    with pytest.raises(ExportError, match="not supported by the IPEX exporter"):
        main_export(tiny_dir("llama"), str(tmp_path / "out"), task="fill-mask")
    assert not (tmp_path / "out").exists()


def test_non_empty_output_refused_unless_overwrite(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    res = _run(["--model", tiny_dir("llama"), out])
    assert res.returncode == 2 and "not empty" in res.stderr and "--overwrite" in res.stderr
    assert sorted(os.listdir(out)) == ["keep.txt"]
    res = _run(["--model", tiny_dir("llama"), out, "--overwrite"])  # not an export: --overwrite does not delete it
    assert res.returncode == 2 and "holds no export of ours" in res.stderr, res.stderr
    assert sorted(os.listdir(out)) == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert _run(["--model", tiny_dir("llama"), out]).returncode == 0  # an empty folder
    first = (out / "manifest.json").read_text()
    res = _run(["--model", tiny_dir("llama"), out, "--overwrite", "--torch_dtype", "bfloat16"])  # an earlier export
    assert res.returncode == 0, res.stderr
    assert (out / "manifest.json").read_text() != first and (out / "ipex_export.json").is_file()
    assert _siblings(out) == ["out"]  # no staging folder left behind


def test_ipex_absent_explicit_backend_is_a_clear_error(tiny_dir, tmp_path, monkeypatch):
    from optimum_ipex_spec.utils import import_utils

    fake = import_utils.IPEXStatus(False, None, torch.__version__, "intel_extension_for_pytorch is not installed")
    monkeypatch.setattr(import_utils, "ipex_status", lambda: fake)
    import optimum_ipex_spec.modeling as modeling

    monkeypatch.setattr(modeling, "ipex_status", lambda: fake)
    with pytest.raises(ExportError, match="pip install"):
        main_export(tiny_dir("llama"), str(tmp_path / "out"), backend="ipex")
    assert not (tmp_path / "out").exists() and [p for p in tmp_path.iterdir()] == []
    # backend auto: the documented pure-PyTorch export
    report = main_export(tiny_dir("llama"), str(tmp_path / "out"))
    assert report.passed and report.backend == "torch"


@pytest.mark.slow
def test_cli_export_real_smollm2(smollm2_dir, tokenizer, tmp_path):
    out = tmp_path / "smollm2-ipex"
    res = _run(["--model", smollm2_dir, out])
    assert res.returncode == 0 and "PASS" in res.stdout, res.stdout + res.stderr
    loaded = IPEXModelForCausalLM.from_pretrained(out)
    in_process = IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True)
    inputs = tokenizer("def add(a, b):", return_tensors="pt")
    assert torch.equal(loaded.generate(**inputs, max_new_tokens=32, do_sample=False),
                       in_process.generate(**inputs, max_new_tokens=32, do_sample=False))
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_output_equal_to_model_folder_is_refused_and_checkpoint_kept(tiny_dir, tmp_path):
    source = tmp_path / "ckpt"
    shutil.copytree(tiny_dir("llama"), source)
    before = sorted(os.listdir(source))
    for output in (source, tmp_path):  # the folder itself, or a folder that contains it
        res = _run(["--model", source, output, "--overwrite"])
        assert res.returncode == 2 and "would delete the checkpoint" in res.stderr
        assert sorted(os.listdir(source)) == before


def test_torch_path_export_validates(tiny_dir, tmp_path):
    """GPT-2 is not on IPEX's fused path: the pure-PyTorch export must validate too."""
    report = main_export(tiny_dir("gpt2"), str(tmp_path / "out"))
    assert report.passed and report.backend == "torch", report.checks


def test_bf16_checkpoint_with_auto_dtype_uses_bf16_tolerance(tiny_dir, tmp_path):
    from conftest import build_tiny

    model = build_tiny("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    report = main_export(str(tmp_path / "bf16"), str(tmp_path / "out"), torch_dtype="auto")
    assert report.dtype == "bfloat16" and report.atol == 1.5 and report.passed


def test_bad_atol_and_unwritable_output(tiny_dir, tmp_path):
    with pytest.raises(ExportError, match="non-negative"):
        main_export(tiny_dir("llama"), str(tmp_path / "out"), atol=float("nan"))
    with pytest.raises(ExportError, match="cannot write"):
        main_export(tiny_dir("llama"), "/proc/nope/out")
