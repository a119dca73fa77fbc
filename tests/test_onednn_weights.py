"""oneDNN-reordered weights on the pure-PyTorch decoder: the same products as ``F.linear``, one copy of the
weights with the model's layers as views of it, and transformers' ``logits_to_keep``."""

import pytest
import torch
import torch.nn.functional as F

from conftest import build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.onednn_weights import FP32_REORDERED_MAX_ROWS, FewRowsSplit, OneDNNWeight, onednn_available
from optimum_ipex_spec.torch_model import TorchCausalLMDecoder, kept_positions

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build cannot reorder weights for oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, 9, FP32_REORDERED_MAX_ROWS + 1, 100])
def test_reordered_products_match_linear(dtype, tolerance, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 64, generator=generator) * 0.1).to(dtype)
    x = torch.randn(2, rows, 64, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight.float())
    matrix = OneDNNWeight(weight) if dtype == torch.bfloat16 else FewRowsSplit(weight.t().contiguous(),
                                                                               OneDNNWeight(weight))
    got = matrix(x)
    assert got.shape == (2, rows, 96) and got.dtype == dtype
    assert (got.float() - expected).abs().max().item() < tolerance
    assert matrix.shape == (96, 64)


def test_reordered_weight_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="2-D fp32 or bf16"):
        OneDNNWeight(torch.ones(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D fp32 or bf16"):
        OneDNNWeight(torch.ones(4))


@needs_onednn
def test_fp32_decoder_holds_the_weights_once_and_the_model_still_runs():
    """The fp32 decoder's transposed copies become the model's weights (views), the oneDNN copy is the only other
    one; the model's own forward gives the logits it gave before."""
    model = build_tiny("qwen2")  # q/k/v biases, untied head
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    decoder = TorchCausalLMDecoder(model)
    assert decoder.layout == "onednn"
    qkv = decoder._layers[0][0]
    attn = model.model.layers[0].self_attn
    assert isinstance(qkv, FewRowsSplit)
    assert attn.q_proj.weight.data_ptr() == qkv.transposed.data_ptr()  # a view, not a copy
    assert attn.k_proj.weight.untyped_storage().data_ptr() == qkv.transposed.untyped_storage().data_ptr()
    assert model.lm_head.weight.untyped_storage().data_ptr() == decoder._lm_head.transposed.untyped_storage().data_ptr()
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max().item() < 1e-5


@needs_onednn
def test_a_tied_head_leaves_the_embedding_alone():
    model = build_tiny("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight
    decoder = TorchCausalLMDecoder(model)
    assert model.model.embed_tokens.weight is embedding and model.lm_head.weight is embedding
    assert decoder._lm_head.transposed.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()


@pytest.mark.parametrize("available", [True, False])
def test_fp32_and_bf16_decoders_match_transformers_with_either_layout(monkeypatch, available):
    """Prefill longer than FP32_REORDERED_MAX_ROWS (transposed copy), decode (transposed), a chunk (reordered);
    without oneDNN (monkeypatched) the transposed layout serves all."""
    if available and not onednn_available():
        pytest.skip("this torch build cannot reorder weights for oneDNN")
    monkeypatch.setattr("optimum_ipex_spec.torch_model.onednn_available", lambda: available)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
        model = build_tiny("llama").to(dtype)
        ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            reference = model(ids).logits.float()
        decoder = TorchCausalLMDecoder(model)
        assert decoder.layout == ("onednn" if available else "transposed")
        cache = decoder.new_cache(1, 70, dtype)
        pieces = []
        for start, stop in ((0, FP32_REORDERED_MAX_ROWS + 12), (60, 61), (61, 70)):
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


@needs_onednn
def test_fp32_export_releases_the_memory_mapped_checkpoint(tmp_path):
    """Loaded in fp32 from fp32 safetensors, transformers' parameters are views of the mapped file; once the decoder
    has its copies, no parameter may still point into it (the whole file would stay resident)."""
    import gc

    build_tiny("llama").save_pretrained(tmp_path)
    checkpoint = str(next(tmp_path.glob("*.safetensors")).resolve())
    model = IPEXModelForCausalLM.from_pretrained(str(tmp_path), export=True, torch_dtype=torch.float32,
                                                 backend="torch")
    gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if checkpoint in line]
    assert model.runner.decoder.layout == "onednn"
    assert not mapped, mapped
