"""The IPEX export holds its weights once (issue 14): both graphs read the same tensors, the saved archive writes
them once, rotary tables are shared, and IPEX's modules are as they were after an export."""

import os
import zipfile

import pytest
import torch

from conftest import build_tiny, write_legacy_export
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.ipex.export import IPEXGraphs, export_to_ipex, load_ipex_graphs, save_ipex_graphs


def _storages(module) -> dict:
    """data_ptr -> bytes of every parameter, buffer and tensor attribute a TorchScript module tree holds."""
    found = {}
    for sub in module.modules():
        for _, tensor in list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False)):
            if tensor.numel():
                found[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_verify_graphs_share_every_weight(ipex_available, dtype, request):
    if dtype == torch.bfloat16:
        request.getfixturevalue("ipex_bf16")
    graphs = export_to_ipex(build_tiny("qwen2").to(dtype).eval(), dtype)
    decode, verify = _storages(graphs.decode), _storages(graphs.verify)
    assert decode, "the decode graph holds no parameters: it would have been frozen"
    assert decode.keys() == verify.keys()


def test_saved_archive_writes_the_weights_once_and_loads_them_shared(ipex_available, tmp_path):
    model = build_tiny("qwen2", layers=4).eval()
    head_bytes = model.lm_head.weight.numel() * 4
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())  # tied: the embedding once
    graphs = export_to_ipex(model, torch.float32)
    path = str(tmp_path / "graphs.pt")
    save_ipex_graphs(graphs, path)
    with zipfile.ZipFile(path) as archive:
        stored = sum(info.file_size for info in archive.infolist() if "/data/" in info.filename)
    # one copy of every weight, the untied output head's own copy (see _untie_output_head) and small tables
    assert stored < weight_bytes + head_bytes + (1 << 20), (stored, weight_bytes)
    loaded = load_ipex_graphs(path)
    assert _storages(loaded.decode).keys() == _storages(loaded.verify).keys()


def test_layers_share_one_rotary_table_and_ipex_is_restored(ipex_available):
    from intel_extension_for_pytorch.transformers.models.cpu.fusions import mha_fusion as cpu_fusion
    from intel_extension_for_pytorch.transformers.models.reference.fusions import mha_fusion as reference_fusion

    before = (cpu_fusion.RotaryEmbedding, reference_fusion.RotaryEmbedding)
    model = build_tiny("llama", layers=3).eval()
    graphs = export_to_ipex(model, torch.float32)
    assert (cpu_fusion.RotaryEmbedding, reference_fusion.RotaryEmbedding) == before
    positions = model.config.max_position_embeddings
    tables = {table.untyped_storage().data_ptr() for table in _rotary_tables(graphs.decode, positions)}
    assert len(tables) == 1, f"{len(tables)} rotary tables for 3 layers"


def _rotary_tables(graph, max_positions):
    """Tensor constants of the traced graphs shaped like a rotary table ``[max_positions, head_dim]``."""
    for sub in graph.modules():
        for name in sub._c._method_names():
            for node in sub._c._get_method(name).graph.findAllNodes("prim::Constant"):
                value = node.output().toIValue() if node.output().type().kind() == "TensorType" else None
                if isinstance(value, torch.Tensor) and value.dim() == 2 and value.size(0) == max_positions:
                    yield value


def test_export_after_export_keeps_the_first_model_running(ipex_available, tiny_dir, tokenizer):
    """A bf16 export followed by another export: IPEX's BlockedParameter would fail the first model's graph."""
    first = IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True, torch_dtype=torch.bfloat16)
    inputs = tokenizer("def fib(n):", return_tensors="pt")
    expected = first.generate(**inputs, max_new_tokens=8, do_sample=False)
    IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True)
    IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtype=torch.bfloat16)
    assert torch.equal(first.generate(**inputs, max_new_tokens=8, do_sample=False), expected)


def test_old_format_folders_load_only_when_trusted(ipex_available, tiny_dir, tokenizer, tmp_path):
    """Export formats 1 (the verification graph in ipex_verify_model.pt) and 2 (both graphs in ipex_model.pt) hold
    TorchScript programs: refused by default, with the re-export command; loaded with trust_torchscript=True."""
    import json

    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True)
    inputs = tokenizer("def fib(n):", return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    write_legacy_export(model, tmp_path / "v2")
    with pytest.raises(ValueError, match=r"format 2: its ipex_model.pt is a TorchScript program.*from_pretrained\("
                                         r".*export=True.*trust_torchscript=True"):
        IPEXModelForCausalLM.from_pretrained(tmp_path / "v2")
    loaded = IPEXModelForCausalLM.from_pretrained(tmp_path / "v2", trust_torchscript=True)
    assert torch.equal(loaded.generate(**inputs, max_new_tokens=8, do_sample=False), expected)
    folder = tmp_path / "v1"
    write_legacy_export(model, folder, format_version=1)
    os.remove(folder / "ipex_model.pt")
    torch.jit.save(model.model, str(folder / "ipex_model.pt"))
    torch.jit.save(model.verify_model, str(folder / "ipex_verify_model.pt"))
    assert json.loads((folder / "ipex_export.json").read_text())["format_version"] == 1
    with pytest.raises(ValueError, match="format 1"):
        IPEXModelForCausalLM.from_pretrained(folder)
    loaded = IPEXModelForCausalLM.from_pretrained(folder, trust_torchscript=True)
    assert loaded.verify_model is not None
    assert torch.equal(loaded.generate(**inputs, max_new_tokens=8, do_sample=False), expected)
    assert isinstance(load_ipex_graphs(str(folder / "ipex_model.pt")), IPEXGraphs)


def test_model_ipex_leaves_unconverted_is_a_clear_error(ipex_available, monkeypatch):
    """ipex.llm.optimize returns the model unchanged (with a log line) when it cannot convert it."""
    import intel_extension_for_pytorch as ipex

    monkeypatch.setattr(ipex.llm, "optimize", lambda model, **kwargs: model)
    with pytest.raises(RuntimeError, match=r"did not convert this Qwen2ForCausalLM.*backend='torch'"):
        export_to_ipex(build_tiny("qwen2").eval(), torch.float32)
