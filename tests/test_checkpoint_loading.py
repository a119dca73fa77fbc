"""The converting checkpoint load (issue 14): a local safetensors checkpoint read straight into the export dtype
must give exactly transformers' ``from_pretrained(..., torch_dtype=...)`` model: every parameter and buffer
(``torch.equal``, same dtype), the config and the generation config. Cases it does not cover go to transformers,
and those are checked to really take that path."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from optimum_ipex_spec.loading import checkpoint as checkpoint_loading
from optimum_ipex_spec.loading.checkpoint import load_causal_lm
from optimum_ipex_spec.compat import transformers_major

from conftest import build_tiny

DTYPE_KWARG = "dtype" if transformers_major() >= 5 else "torch_dtype"


def stock(folder, dtype):
    return AutoModelForCausalLM.from_pretrained(folder, **{DTYPE_KWARG: dtype})


@pytest.fixture
def conversions(monkeypatch):
    """Counts the loads that took the converting path."""
    calls = []
    real = checkpoint_loading._read_into
    monkeypatch.setattr(checkpoint_loading, "_read_into", lambda model, entries: (calls.append(1), real(model, entries)))
    return calls


def assert_same_model(ours, theirs):
    ours_tensors = {**ours.state_dict(), **{"buffer:" + k: v for k, v in ours.named_buffers()}}
    their_tensors = {**theirs.state_dict(), **{"buffer:" + k: v for k, v in theirs.named_buffers()}}
    assert sorted(ours_tensors) == sorted(their_tensors)
    for name, tensor in their_tensors.items():
        assert ours_tensors[name].dtype == tensor.dtype, name
        assert torch.equal(ours_tensors[name], tensor), name
    assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    assert not ours.training
    # a tied head stays tied
    assert (ours.get_output_embeddings().weight.data_ptr() == ours.get_input_embeddings().weight.data_ptr()) == (
        theirs.get_output_embeddings().weight.data_ptr() == theirs.get_input_embeddings().weight.data_ptr())


def tied_llama():
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.config.architectures = ["LlamaForCausalLM"]
    return model


@pytest.mark.parametrize("arch", ["llama", "llama-mha", "qwen2", "mistral", "gpt2", "tied-llama"])
@pytest.mark.parametrize("shards", [False, True])
def test_fp32_checkpoint_read_into_bf16_equals_transformers(tmp_path, arch, shards, conversions):
    model = tied_llama() if arch == "tied-llama" else build_tiny(arch)
    model.save_pretrained(tmp_path, max_shard_size="200KB" if shards else "5GB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shards
    ours = load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == [1]
    assert_same_model(ours, stock(str(tmp_path), torch.bfloat16))


def test_half_checkpoint_read_into_fp32(tmp_path, conversions):
    build_tiny("qwen2").to(torch.float16).save_pretrained(tmp_path)
    ours = load_causal_lm(str(tmp_path), torch.float32)
    assert conversions == [1]
    assert_same_model(ours, stock(str(tmp_path), torch.float32))


def test_reads_in_pieces(tmp_path, conversions, monkeypatch):
    """Tensors larger than one read buffer are converted piece by piece, including the last partial piece."""
    monkeypatch.setattr(checkpoint_loading, "PIECE_BYTES", 4096 + 12)
    build_tiny("llama").save_pretrained(tmp_path)
    ours = load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == [1]
    assert_same_model(ours, stock(str(tmp_path), torch.bfloat16))


def test_checkpoint_in_the_asked_dtype_goes_to_transformers(tmp_path, conversions):
    build_tiny("llama").save_pretrained(tmp_path)
    ours = load_causal_lm(str(tmp_path), torch.float32)
    assert conversions == []
    assert_same_model(ours, stock(str(tmp_path), torch.float32))


def _rewrite_weights(folder, edit):
    weights = load_file(os.path.join(folder, "model.safetensors"))
    edit(weights)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def test_unverified_architecture_goes_to_transformers(tmp_path, conversions):
    """GPT-J computes its rotary table at construction; under a bf16 build it came out less exact than transformers
    5's load: architectures not tested equal take transformers' path."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(5)
    model = GPTJForCausalLM(GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=256, rotary_dim=8, n_positions=64))
    model.config.architectures = ["GPTJForCausalLM"]
    model.save_pretrained(tmp_path)
    ours = load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == []
    assert_same_model(ours, stock(str(tmp_path), torch.bfloat16))


def test_a_class_outside_the_verified_ones_goes_to_transformers_whatever_architectures_says(tmp_path, conversions):
    """transformers builds the class from model_type; a config.json whose "architectures" names Llama does not
    make a GPT-J one."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(5)
    GPTJForCausalLM(GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=256, rotary_dim=8,
                               n_positions=64)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == []
    assert_same_model(ours, stock(str(tmp_path), torch.bfloat16))


def test_a_byte_range_that_is_not_the_shape_goes_to_transformers(tmp_path, conversions):
    """A header whose byte range is shorter than its shape: transformers refuses the file; the converting path
    must not read it (it would leave uninitialised memory in the weight)."""
    import struct

    build_tiny("llama").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [begin, end - 8]
    encoded = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(encoded) == length
    path.write_bytes(data[:8] + encoded + data[8 + length:])
    with pytest.raises(Exception):  # transformers' (safetensors') own error
        load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == []


def test_without_a_generation_config_file_goes_to_transformers(tmp_path, conversions):
    build_tiny("llama").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    ours = load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == []
    assert_same_model(ours, stock(str(tmp_path), torch.bfloat16))


def test_extra_tensor_goes_to_transformers(tmp_path, conversions):
    build_tiny("llama").save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda w: w.update({"model.unused_extra": torch.ones(3)}))
    ours = load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == []
    assert_same_model(ours, stock(str(tmp_path), torch.bfloat16))


def test_missing_tensor_goes_to_transformers(tmp_path, conversions):
    build_tiny("llama").save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda w: w.pop("model.norm.weight"))
    load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == []


def test_wrong_shape_goes_to_transformers(tmp_path, conversions):
    build_tiny("llama").save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda w: w.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(Exception):  # transformers' own error for a size mismatch
        load_causal_lm(str(tmp_path), torch.bfloat16)
    assert conversions == []


def test_quantized_config_goes_to_transformers(tmp_path, conversions):
    build_tiny("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "not-a-method"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    try:  # transformers 4.51 refuses the unknown method, 5.x loads the weights: either way it is transformers' call
        load_causal_lm(str(tmp_path), torch.bfloat16)
    except ValueError:
        pass
    assert conversions == []


def test_truncated_weights_file_is_an_error(tmp_path):
    build_tiny("llama").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(OSError, match="ends inside"):
        load_causal_lm(str(tmp_path), torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smollm2_dir", "gemma3_dir", "qwen05_dir"])
def test_real_checkpoints_read_into_bf16_equal_transformers(request, fixture, conversions):
    folder = request.getfixturevalue(fixture)
    ours = load_causal_lm(folder, torch.bfloat16)
    assert conversions == [1]
    assert_same_model(ours, stock(folder, torch.bfloat16))
