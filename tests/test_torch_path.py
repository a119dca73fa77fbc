"""The pure-PyTorch path: TorchCausalLMDecoder over a PreallocatedKVCache, exact against transformers.

Runs in every lane: it is what IPEXModelForCausalLM uses without IPEX (and with backend="torch").
"""

import copy

import pytest
import torch
import transformers

from conftest import build_tiny
from optimum_ipex_spec.compat import transformers_major
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.pytorch.cache import PreallocatedKVCache
from optimum_ipex_spec.backends.pytorch.decoder import TorchCausalLMDecoder

TRANSFORMERS_MAJOR = transformers_major()


def _decoder_or_skip(model):
    if not TorchCausalLMDecoder.supports(model):
        pytest.skip(f"transformers {transformers.__version__} keeps {type(model).__name__}'s rotary tables per layer; "
                    "IPEXModelForCausalLM runs transformers' forward for it there")
    return TorchCausalLMDecoder(model)


def _run(decoder, ids, start, stop, cache, mask=None):
    batch = ids.shape[0]
    mask = torch.ones(batch, stop, dtype=torch.long) if mask is None else mask[:, :stop]
    positions = torch.arange(start, stop).unsqueeze(0).expand(batch, -1)
    return decoder(ids[:, start:stop], positions, mask, cache, bool(mask.all()))


@pytest.mark.parametrize("arch", ["llama", "llama-mha", "qwen2", "mistral"])
def test_prefill_decode_and_chunk_after_crop_match_transformers(arch):
    model = build_tiny(arch)
    decoder = _decoder_or_skip(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
    cache = decoder.new_cache(1, capacity=4, dtype=torch.float32)  # forces growth on the way
    prefill = _run(decoder, ids, 0, 10, cache)
    decode = _run(decoder, ids, 10, 11, cache)
    rejected = _run(decoder, ids, 11, 17, cache)  # a 6-token chunk, then 4 of them rolled back
    cache.crop(13)
    verify = _run(decoder, ids, 13, 24, cache)
    got = torch.cat([prefill, decode, rejected[:, :2], verify], 1)
    assert cache.get_seq_length() == 24 and cache.capacity >= 24
    assert (got - reference).abs().max().item() < 1e-5


def test_left_padded_batch_matches_transformers():
    model = build_tiny("llama")
    decoder = TorchCausalLMDecoder(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    got = decoder(ids, positions, mask, decoder.new_cache(2, 12, torch.float32), False)
    assert (got - reference)[mask.bool()].abs().max().item() < 1e-5
    assert not got.isnan().any()


def test_sliding_window_is_applied():
    config_model = build_tiny("mistral")
    config_model.config.sliding_window = 6
    config_model.config._attn_implementation = "eager"  # the reference that implements the window
    decoder = _decoder_or_skip(config_model)
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = config_model(ids).logits
    cache = decoder.new_cache(1, 16, torch.float32)
    got = torch.cat([_run(decoder, ids, 0, 9, cache), _run(decoder, ids, 9, 10, cache),
                     _run(decoder, ids, 10, 16, cache)], 1)
    assert (got - reference).abs().max().item() < 1e-5


def test_unsupported_architecture_is_refused_and_runs_eager(caplog):
    with pytest.raises(ValueError, match="not supported by the pure-PyTorch decoder"):
        TorchCausalLMDecoder(build_tiny("gpt2"))
    model = IPEXModelForCausalLM.from_transformers_model(build_tiny("gpt2"), backend="torch")
    assert model.decoder is None
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                       build_tiny("gpt2").generate(ids, max_new_tokens=5, do_sample=False))


def test_cache_crop_conventions():
    cache = PreallocatedKVCache(num_layers=2, batch_size=1, kv_heads=2, head_dim=4, capacity=8)
    cache.advance(6)
    cache.crop(-2)  # 5.x: drop 2
    assert cache.get_seq_length() == 4
    cache.crop(3)  # 4.x: keep 3
    assert cache.get_seq_length() == 3
    cache.crop(0)
    assert cache.get_seq_length() == (3 if TRANSFORMERS_MAJOR >= 5 else 0)  # 5.x: crop(0) removes nothing
    cache.crop(7)  # more than held: unchanged, as DynamicCache (transformers 4.53's universal generator asks this)
    assert cache.get_seq_length() == (3 if TRANSFORMERS_MAJOR >= 5 else 0)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-10)
    assert cache.is_croppable and len(cache) == 2


def test_cache_growth_keeps_rows_and_reorder_selects_beams():
    cache = PreallocatedKVCache(num_layers=1, batch_size=2, kv_heads=1, head_dim=2, capacity=2)
    key = torch.arange(8.0).view(2, 1, 2, 2)
    cache.write(0, key, -key)
    cache.advance(2)
    cache.reserve(5)
    assert cache.capacity >= 5 and torch.equal(cache.keys[0][:, :, :2], key)
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache.keys[0][0, :, :2], key[1]) and torch.equal(cache.values[0][1, :, :2], -key[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_torch_backend_generate_matches_stock(arch, tokenizer):
    stock = build_tiny(arch)
    model = IPEXModelForCausalLM.from_transformers_model(build_tiny(arch), backend="torch")
    assert model.decoder is not None
    inputs = tokenizer(["def add(a, b):\n    return", "Hello"], return_tensors="pt", padding=True, padding_side="left")
    for kwargs in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}):
        expected = stock.generate(**inputs, max_new_tokens=24, **kwargs)
        got = model.generate(**inputs, max_new_tokens=24, **kwargs)
        assert torch.equal(got, expected), kwargs


def test_bf16_decoder_close_to_transformers_bf16():
    model = build_tiny("llama").to(torch.bfloat16)
    decoder = TorchCausalLMDecoder(model)
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = model(ids).logits.float()
    cache = decoder.new_cache(1, 12, torch.bfloat16)
    got = torch.cat([_run(decoder, ids, 0, 8, cache), _run(decoder, ids, 8, 12, cache)], 1).float()
    assert got.dtype == torch.float32 and (got - reference).abs().max().item() < 0.05


def test_a_qwen2_that_slides_only_some_layers_runs_on_transformers_forward():
    """Qwen2 with use_sliding_window slides layers >= max_window_layers only; our decoder has one window for all
    layers, so such a model is not ours to run: transformers' forward gives its logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from optimum_ipex_spec.backends import EagerRunner
    from optimum_ipex_spec.backends.pytorch.decoder import TorchCausalLMDecoder, layer_windows

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                         max_window_layers=1)
    model = Qwen2ForCausalLM(config).eval()
    model.config.architectures = ["Qwen2ForCausalLM"]
    assert layer_windows(model) == [None, 4] and not TorchCausalLMDecoder.supports(model)
    ours = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(model), backend="torch")
    assert isinstance(ours.runner, EagerRunner)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, model(ids).logits, atol=1e-5)
