"""IPEXFusedCache: cropping rolls IPEX's fused cache back exactly (token-at-a-time decode after crop)."""

import pytest
import torch

from conftest import build_tiny, copy_model
from optimum_ipex_spec import IPEXFusedCache, IPEXModelForCausalLM


def test_crop_semantics_without_model():
    cache = IPEXFusedCache(num_layers=3, batch_size=1, dtype=torch.float32)
    assert cache.get_seq_length() == 0 and len(cache) == 3
    info = torch.empty(1, 10, 10, 1, dtype=torch.long)
    cache.replace(tuple((info, torch.zeros(1), torch.zeros(1), torch.zeros(1)) for _ in range(3)))
    assert cache.get_seq_length() == 10
    cache.crop(12)  # longer than held: no-op
    assert cache.get_seq_length() == 10
    cache.crop(-3)  # transformers 5.x style: drop 3
    assert cache.get_seq_length() == 7
    cache.crop(4)
    assert cache.get_seq_length() == 4
    with pytest.raises(ValueError):
        cache.crop(-5)


@pytest.mark.parametrize("keep", [1, 5, 9])
def test_crop_then_decode_matches_fresh(keep, ipex_available):
    ref = build_tiny("llama", vocab_size=512)
    model = IPEXModelForCausalLM.from_transformers_model(copy_model(ref))
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(keep))
    other = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(100 + keep))
    with torch.no_grad():
        cache = model(ids).past_key_values
        cache.crop(keep)
        assert cache.get_seq_length() == keep
        # feed different tokens one at a time on the cropped cache: rows past `keep` get overwritten
        for i in range(keep, 12):
            step = model(other[:, i : i + 1], past_key_values=cache)
        expected = ref(torch.cat([ids[:, :keep], other[:, keep:]], 1)).logits[:, -1:]
    torch.testing.assert_close(step.logits, expected, atol=1e-5, rtol=1e-5)


def test_repr_and_unsupported_ops():
    cache = IPEXFusedCache(num_layers=2, batch_size=1)
    assert "seq_length=0" in repr(cache)
    with pytest.raises(NotImplementedError, match="Beam search"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(NotImplementedError):
        cache.update(None, None, 0)


@pytest.mark.parametrize("past, chunk", [(2045, 6), (2040, 8), (30, 9)])
def test_verify_chunk_across_the_buffer_end_then_decode(past, chunk, ipex_available):
    """The verify graph writes a chunk's keys/values itself; the cache grows first when the chunk passes IPEX's
    2048 preallocated rows (IPEXFusedCache.reserve). The chunk's logits and the decode steps after it match the
    stock model."""
    ref = build_tiny("llama", vocab_size=512)
    model = IPEXModelForCausalLM.from_transformers_model(copy_model(ref))
    ids = torch.randint(3, 512, (1, past + chunk + 3), generator=torch.Generator().manual_seed(past))
    with torch.no_grad():
        expected = ref(ids).logits
        cache = model(ids[:, :past]).past_key_values
        capacity = cache.ipex_layers[0][1].size(0)
        got = model(ids[:, past: past + chunk], past_key_values=cache).logits
        assert cache.get_seq_length() == past + chunk
        if past + chunk > capacity:
            assert cache.ipex_layers[0][1].size(0) >= past + chunk  # grown before the chunk was written
        steps = [model(ids[:, i: i + 1], past_key_values=cache).logits for i in range(past + chunk, ids.shape[1])]
    torch.testing.assert_close(got, expected[:, past: past + chunk], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), expected[:, past + chunk:], atol=1e-5, rtol=1e-5)
