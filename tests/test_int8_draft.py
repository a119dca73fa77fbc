"""Weight-only int8 weights (optimum_ipex_spec.backends.pytorch.int8_weights) and the int8 self-draft: the matrix
product against the dense one it stands for, the decoder against its dense bf16 twin, losslessness as a draft, and clear
errors."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.pytorch.int8_weights import KERNEL_K_MULTIPLE, KERNEL_MAX_ROWS, Int8Weight
from optimum_ipex_spec.backends import make_runner


@pytest.mark.parametrize("width", [64, 72])  # the kernel's widths (multiples of 16), and one it gets wrong
@pytest.mark.parametrize("rows", [1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40])  # the kernel, and dequantising
def test_int8_product_matches_the_dense_product_of_its_values(rows, width):
    torch.manual_seed(0)
    weight = torch.randn(100, width)
    packed = Int8Weight(weight)
    x = torch.randn(2, rows, width).bfloat16()
    got = packed(x)
    assert got.shape == (2, rows, 100) and got.dtype == torch.bfloat16
    expected = x.float() @ packed.dequantized().float().t()
    assert torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    # and the int8 values are a close copy of the weight: per channel, at most half a step off
    steps = weight.abs().amax(1, keepdim=True) / 127
    assert ((packed.qweight.float() * steps - weight).abs() <= steps * 0.5 + 1e-6).all()
    assert packed.nbytes() == 100 * width + 100 * 2


def test_int8_weight_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="bf16 activations"):
        Int8Weight(torch.randn(4, 4), torch.float32)
    with pytest.raises(ValueError, match="2-D"):
        Int8Weight(torch.randn(4))


def test_int8_decoder_tracks_its_dense_bf16_twin(tiny_dir):
    path = tiny_dir("qwen2")  # q/k/v biases and grouped-query attention
    dense = IPEXModelForCausalLM.from_transformers_model(
        AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16), backend="torch")
    int8 = IPEXModelForCausalLM.from_transformers_model(
        AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16), backend="torch", weights="int8")
    torch.manual_seed(0)
    ids = torch.randint(0, dense.config.vocab_size, (1, 24))
    want, got = dense(ids).logits.float(), int8(ids).logits.float()  # prefill: dequantised rows
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    assert (want - got).abs().max() <= 0.1 * want.abs().max()
    cache_dense, cache_int8 = dense.runner.new_cache(1, 64), int8.runner.new_cache(1, 64)
    dense(ids, past_key_values=cache_dense)
    int8(ids, past_key_values=cache_int8)
    token = ids[:, -1:]
    for _ in range(6):  # decode steps: the int8 kernel
        want, got = dense(token, past_key_values=cache_dense).logits.float(), int8(
            token, past_key_values=cache_int8).logits.float()
        assert (want - got).abs().max() <= 0.1 * want.abs().max()
        token = want.argmax(-1)
    # the weights are held once: the transformers model's projections were released
    layer = int8.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.numel() == 0 and layer.mlp.down_proj.weight.numel() == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_self_draft_is_lossless(tiny_dir, arch):
    path = tiny_dir(arch)
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    target = IPEXModelForCausalLM.from_pretrained(path, export=True)
    draft = target.self_draft(weights="int8")
    assert draft.weights == "int8" and draft.backend == "torch" and draft.dtype == torch.bfloat16
    for ids in (torch.tensor([[5, 17, 99, 3, 250, 7, 5, 17]]), torch.tensor([[1, 2, 3]])):
        expected = stock.generate(ids, max_new_tokens=40, do_sample=False)
        for schedule in ("cost", "constant"):
            got = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=draft,
                                  num_assistant_tokens_schedule=schedule)
            assert torch.equal(got, expected), (arch, schedule)
            assert target.last_strategy == "draft"
    assert draft.last_speculation_stats.proposed > 0


def test_int8_refusals_are_clear(tiny_dir, tmp_path):
    path = tiny_dir("llama")
    target = IPEXModelForCausalLM.from_pretrained(path, export=True)
    with pytest.raises(ValueError, match="bf16 activations"):
        target.self_draft(torch_dtype=torch.float32, weights="int8")
    with pytest.raises(ValueError, match="backend='auto' or 'torch'"):
        target.self_draft(weights="int8", backend="ipex")
    with pytest.raises(ValueError, match="weights must be one of"):
        target.self_draft(weights="int3")
    draft = target.self_draft(weights="int8")
    with pytest.raises(ValueError, match="not saved"):
        draft.save_pretrained(tmp_path / "int8")
    with pytest.raises(ValueError, match="transformers' own forward"):
        draft(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    with pytest.raises(ValueError, match="pure-PyTorch decoder"):
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        make_runner("ipex", model, model.config, torch.bfloat16, weights="int8")
    with pytest.raises(ValueError, match="bf16 activations"):
        IPEXModelForCausalLM.from_transformers_model(AutoModelForCausalLM.from_pretrained(path), backend="torch",
                                                     weights="int8")
    with pytest.raises(ValueError, match="pure-PyTorch decoder"):  # not silently another backend
        IPEXModelForCausalLM.from_transformers_model(
            AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16), backend="ipex", weights="int8")
