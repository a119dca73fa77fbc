"""The pure-PyTorch decoder's dense weights: the model's own, held once, multiplied with the kernel picked by row
count (the same products as ``F.linear``), the mapped checkpoint released in bf16, and transformers'
``logits_to_keep``."""

import pytest
import torch
import torch.nn.functional as F

from conftest import build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.dense_weights import (
    CHUNK_MAX_ROWS,
    FP32_ONEDNN_MIN_ROWS,
    WIDE_MIN_OUT,
    WIDE_TRANSPOSED_MAX_ROWS,
    DenseLinear,
    DenseProjection,
    onednn_available,
    use_dense_kernels,
)
from optimum_ipex_spec.backends.base import kept_positions
from optimum_ipex_spec.backends.pytorch.decoder import TorchCausalLMDecoder


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, FP32_ONEDNN_MIN_ROWS, 9, CHUNK_MAX_ROWS, CHUNK_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_linear_for_every_kernel(dtype, tolerance, rows, bias):
    """Each row count's kernel (mv / addmv for one fp32 row, oneDNN on the plain weight in fp32, F.linear)
    against fp32 F.linear, with batch 2."""
    generator = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(64, 96, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=generator) * 0.1)
        if bias:
            linear.bias.copy_(torch.randn(96, generator=generator))
    linear = linear.to(dtype)
    x = torch.randn(2 if rows > 1 else 1, rows, 64, generator=generator).to(dtype)
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float() if bias else None)
    projection = DenseProjection.of(linear)
    got = projection(x)
    assert got.shape == (x.shape[0], rows, 96) and got.dtype == dtype
    assert (got.float() - expected).abs().max().item() < tolerance * max(1.0, expected.abs().max().item())
    assert projection.shape == (96, 64)
    assert projection.weight.data_ptr() == linear.weight.data_ptr()  # the layer's own weight, not a copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_holds_the_weights_once_and_the_model_still_runs(dtype):
    """Every projection (q/k/v with biases, the untied head) multiplies the model's own parameters: in fp32 each
    layer's, in bf16 a fused q/k/v (gate/up) matrix whose row slices the layers now hold. The model's own forward
    gives the logits it gave before."""
    model = build_tiny("qwen2").to(dtype)  # q/k/v biases, untied head
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    decoder = TorchCausalLMDecoder(model)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    qkv, bias, o, gate_up, down = decoder._layers[0]
    assert bias is None
    if dtype == torch.float32:
        assert [p.weight.data_ptr() for p in qkv] == [attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr(),
                                                      attn.v_proj.weight.data_ptr()]
        assert qkv[0].bias.data_ptr() == attn.q_proj.bias.data_ptr()
    else:
        assert attn.q_proj.weight.data_ptr() == qkv.weight.data_ptr()  # row slices of the fused matrix
        assert attn.k_proj.weight.untyped_storage().data_ptr() == qkv.weight.untyped_storage().data_ptr()
        assert attn.v_proj.bias.untyped_storage().data_ptr() == qkv.bias.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.weight.untyped_storage().data_ptr()
    assert o.weight.data_ptr() == attn.o_proj.weight.data_ptr() and down.weight.data_ptr() == mlp.down_proj.weight.data_ptr()
    assert decoder._lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    with torch.no_grad():
        assert (model(ids).logits.float() - before.float()).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_torch_export_holds_each_weight_on_its_own(tmp_path, dtype):
    """save_pretrained of the torch backend writes every weight (the bf16 layers' fused slices copied apart), and
    loading it gives exactly the same tensors (buffers included) and logits."""
    build_tiny("qwen2").save_pretrained(tmp_path / "checkpoint")  # fp32, as the real checkpoints here
    model = IPEXModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint"), export=True, torch_dtype=dtype,
                                                 backend="torch")
    model.save_pretrained(tmp_path / "export")
    loaded = IPEXModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(4))
    tensors = {**model.model.state_dict(), **dict(model.model.named_buffers())}
    loaded_tensors = {**loaded.model.state_dict(), **dict(loaded.model.named_buffers())}
    assert sorted(loaded_tensors) == sorted(tensors)
    assert all(loaded_tensors[name].dtype == t.dtype and torch.equal(loaded_tensors[name], t)
               for name, t in tensors.items())
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("rows", [1, 2, WIDE_TRANSPOSED_MAX_ROWS, WIDE_TRANSPOSED_MAX_ROWS + 1])
def test_an_fp32_output_head_takes_the_transposed_product_for_a_few_rows(rows, monkeypatch):
    """A vocabulary-sized fp32 weight: 2 to WIDE_TRANSPOSED_MAX_ROWS rows are ``(W @ x.T).T`` (F.linear repacks the
    whole weight per call there), the same products as F.linear."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(WIDE_MIN_OUT, 32, generator=generator)
    x = torch.randn(1, rows, 32, generator=generator)
    calls = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *args: calls.append(args[0].shape) or mm(*args))
    got = DenseProjection(weight)(x)
    assert (got - F.linear(x, weight)).abs().max().item() < 1e-4
    assert bool(calls) == (1 < rows <= WIDE_TRANSPOSED_MAX_ROWS)
    calls.clear()
    DenseProjection(weight[:1024])(x)  # a decoder matrix of the same rows: not a head
    assert not calls


def test_use_dense_kernels_keeps_the_heads_parameters_and_tying():
    """The eager runner's model: its nn.Linear head becomes a DenseLinear in place, the same Parameter (tied to the
    embedding when it was), the same state dict, the same logits."""
    model = build_tiny("llama").eval()
    model.lm_head.weight = model.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        expected = model(ids).logits
        keys = list(model.state_dict())
        use_dense_kernels(model)
        got = model(ids).logits
    assert type(model.lm_head) is DenseLinear and model.lm_head.weight is model.model.embed_tokens.weight
    assert list(model.state_dict()) == keys
    assert (got - expected).abs().max().item() < 1e-5


def test_a_tied_head_multiplies_the_embedding():
    model = build_tiny("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight
    decoder = TorchCausalLMDecoder(model)
    assert model.model.embed_tokens.weight is embedding and model.lm_head.weight is embedding
    assert decoder._lm_head.weight.data_ptr() == embedding.data_ptr()


@pytest.mark.parametrize("available", [True, False])
def test_fp32_and_bf16_decoders_match_transformers_with_or_without_onednn(monkeypatch, available):
    """A prefill longer than CHUNK_MAX_ROWS (F.linear), a decode step (mv in fp32), a 9-token chunk (oneDNN in fp32,
    F.linear in bf16); without oneDNN (monkeypatched) F.linear serves the fp32 chunk."""
    if available and not onednn_available():
        pytest.skip("this torch build has no oneDNN matmul")
    monkeypatch.setattr("optimum_ipex_spec.backends.dense_weights.onednn_available", lambda: available)
    length = CHUNK_MAX_ROWS + 20
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
        model = build_tiny("llama").to(dtype)
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            reference = model(ids).logits.float()
        decoder = TorchCausalLMDecoder(model)
        assert decoder._layers[0][2]._onednn is (available and dtype == torch.float32)
        cache = decoder.new_cache(1, length, dtype)
        pieces = []
        for start, stop in ((0, length - 10), (length - 10, length - 9), (length - 9, length)):
            positions = torch.arange(start, stop)[None]
            pieces.append(decoder(ids[:, start:stop], positions, torch.ones(1, stop, dtype=torch.long), cache, True))
        got = torch.cat(pieces, 1).float()
        assert (got - reference).abs().max().item() < tolerance, dtype


def test_kept_positions_follows_transformers():
    x = torch.arange(2 * 5).reshape(2, 5, 1)
    assert torch.equal(kept_positions(x, 0), x)
    assert torch.equal(kept_positions(x, 1), x[:, -1:])
    assert torch.equal(kept_positions(x, 3), x[:, 2:])
    assert torch.equal(kept_positions(x, torch.tensor([0, 4])), x[:, [0, 4]])
    for bad in (-1, 1.5, True, torch.ones(2, 2, dtype=torch.long), torch.tensor([0.5])):
        with pytest.raises(ValueError, match="logits_to_keep"):
            kept_positions(x, bad)


@pytest.mark.parametrize("backend", ["torch", "ipex"])
def test_logits_to_keep_in_forward_and_generate(backend, tokenizer, request):
    """model(..., logits_to_keep=n) returns the last n positions' logits; generate() asks for one on the prompt,
    and the pure-PyTorch decoder then runs its LM head on one row."""
    if backend == "ipex":
        request.getfixturevalue("ipex_available")
    stock = build_tiny("llama")
    model = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama"), backend=backend)
    ids = torch.randint(0, stock.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits
        assert full.shape[1] == 12
        # the head over fewer rows may take another kernel (fp32 rounding only)
        assert torch.allclose(model(ids, logits_to_keep=1).logits, full[:, -1:], atol=1e-5)
        assert model(ids, logits_to_keep=1).logits.shape[1] == 1
        assert torch.allclose(model(ids, logits_to_keep=torch.tensor([2, 5])).logits, full[:, [2, 5]], atol=1e-5)
    rows = []
    if backend == "torch":
        head = model.runner.decoder._lm_head
        model.runner.decoder._lm_head = lambda x: (rows.append(x.shape[-2]), head(x))[1]
    inputs = tokenizer(["def add(a, b):\n    return a"], return_tensors="pt")
    got = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, stock.generate(**inputs, max_new_tokens=6, do_sample=False))
    if backend == "torch":
        assert rows and all(r == 1 for r in rows), rows  # the prompt's head ran on its last position only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_parameter_points_into_a_released_checkpoint(tmp_path, dtype):
    """Loaded in the checkpoint's dtype, transformers' parameters are views of the mapped safetensors file. fp32
    keeps them there (they are the weights, held once); bf16 gives them memory of their own (a faster decode step),
    and then no parameter may still point into the file (the whole file would stay resident)."""
    import gc

    build_tiny("llama").to(dtype).save_pretrained(tmp_path)
    checkpoint = str(next(tmp_path.glob("*.safetensors")).resolve())
    model = IPEXModelForCausalLM.from_pretrained(str(tmp_path), export=True, torch_dtype=dtype, backend="torch")
    gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if checkpoint in line]
    if dtype == torch.bfloat16:
        assert not mapped, mapped
    # either way the weights are the model's and the output is transformers'
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    stock = build_tiny("llama").to(dtype)
    with torch.no_grad():
        assert (model(ids).logits.float() - stock(ids).logits.float()).abs().max().item() < (
            1e-5 if dtype == torch.float32 else 0.05)


def test_paged_out_pages_of_a_file_mapping_keep_their_content(tmp_path):
    """page_out takes a mapped tensor's whole pages out of the RSS; reading it again faults clean pages back in from
    the file, and a page written since it was mapped (a private mapping's copy-on-write page) keeps what was
    written (MADV_DONTNEED would revert it to the file's content)."""
    import mmap

    from optimum_ipex_spec.utils.memory import page_out

    values = torch.arange(4 * mmap.PAGESIZE, dtype=torch.float32)
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32)
    assert torch.equal(mapped, values)  # resident now
    mapped[mmap.PAGESIZE] = -1.0  # written: a private copy of that page
    expected = values.clone()
    expected[mmap.PAGESIZE] = -1.0
    asked = page_out(mapped.data_ptr() + 5, mapped.numel() * 4 - 5)  # not page-aligned: whole pages only
    assert asked in (0, (mapped.numel() * 4 // mmap.PAGESIZE - 1) * mmap.PAGESIZE)  # 0: a kernel before 5.4
    assert torch.equal(mapped, expected)


def test_an_export_leaves_other_views_of_an_edited_mapped_checkpoint_alone(tmp_path):
    """A bf16 checkpoint loaded mapped, a weight edited in place (a LoRA merge) while another tensor (an earlier
    state_dict) views it: the export copies the parameters, and the other view still shows the edit."""
    from transformers import AutoModelForCausalLM

    build_tiny("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
    earlier = model.state_dict()
    edited = earlier["model.layers.0.mlp.down_proj.weight"].clone()
    IPEXModelForCausalLM.from_transformers_model(model, backend="torch")
    assert torch.equal(earlier["model.layers.0.mlp.down_proj.weight"], edited)


def test_an_export_leaves_shared_memory_parameters_where_they_are():
    """share_memory() puts parameters in MAP_SHARED memory (other processes may read it): not a checkpoint
    mapping, so the export does not copy them away (only bf16's fused q/k/v and gate/up get new memory)."""
    model = build_tiny("llama").to(torch.bfloat16)
    model.share_memory()
    kept = {name: p.data_ptr() for name, p in model.named_parameters() if "o_proj" in name or "down_proj" in name}
    IPEXModelForCausalLM.from_transformers_model(model, backend="torch")
    parameters = dict(model.named_parameters())
    assert kept and all(parameters[name].data_ptr() == ptr and parameters[name].is_shared() for name, ptr in kept.items())


def test_a_bf16_export_keeps_the_parameters_trainable_flags():
    model = build_tiny("qwen2").to(torch.bfloat16)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    IPEXModelForCausalLM.from_transformers_model(model, backend="torch")
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags


@pytest.mark.parametrize("backend", ["torch", "ipex"])
def test_a_bf16_export_keeps_the_buffers_transformers_loaded(tmp_path, backend, request):
    """from_pretrained(export=True, torch_dtype=bf16) exports the model transformers loaded as it is: its rotary
    inv_freq stays fp32, as in a stock bf16 load (a .to(bf16) of the whole model rounded it)."""
    from transformers import AutoModelForCausalLM

    if backend == "ipex":
        request.getfixturevalue("ipex_bf16")
    build_tiny("llama").save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.bfloat16)
    IPEXModelForCausalLM.from_transformers_model(loaded, backend=backend)
    want = stock.model.rotary_emb.inv_freq
    assert want.dtype == torch.float32 and torch.equal(loaded.model.rotary_emb.inv_freq, want)
