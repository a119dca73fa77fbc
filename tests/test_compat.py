"""The version differences the package handles, each a named function of optimum_ipex_spec.compat."""

import pytest

from optimum_ipex_spec import compat


@pytest.mark.parametrize("current,max_length,zero_removes_nothing,kept", [
    (10, 4, False, 4), (10, 4, True, 4),  # keep the first 4
    (10, -3, False, 7), (10, -3, True, 7),  # drop 3
    (10, 0, True, 10),  # transformers 5: crop(0) removes nothing
    (10, 0, False, 0),  # transformers 4: keep 0
    (10, 12, False, 10),  # keeping more than is held changes nothing
])
def test_crop_keep_length(monkeypatch, current, max_length, zero_removes_nothing, kept):
    monkeypatch.setattr(compat, "crop_zero_removes_nothing", lambda: zero_removes_nothing)
    assert compat.crop_keep_length(current, max_length) == kept


def test_crop_more_than_cached_is_an_error():
    with pytest.raises(ValueError, match="cannot crop a cache of 3 tokens by -4"):
        compat.crop_keep_length(3, -4)


def test_versions():
    assert compat.major_minor("2.8.0+cpu") == (2, 8)
    assert compat.ipex_matches_torch("2.8.10+cpu", "2.8.0") and not compat.ipex_matches_torch("2.7.0", "2.8.0")
    assert compat.same_ipex_release("2.8.0", "2.8.10+cpu") and not compat.same_ipex_release("2.7.0", "2.8.0")
    assert compat.ipex_older_than("2.3.1", "2.4") and not compat.ipex_older_than("2.4.0", "2.4")
    assert compat.needs_module_crop_hook("4.53.2") and not compat.needs_module_crop_hook("4.54.0")
    major = compat.transformers_major()
    assert compat.cache_kwarg() == ("cache" if major >= 5 else "past_key_values")
    assert compat.zero_proposals_add_nothing() is (major < 5)
    assert compat.static_caches_refuse_assisted() is (major < 5)


def test_logits_to_keep_is_spelled_as_the_installed_transformers_spells_it():
    """The eager runner renames our ``logits_to_keep`` to this before transformers' forward (a draft's catch-up
    asks for the last position only): the installed causal LMs must take it by that name."""
    import inspect

    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    for model in (LlamaForCausalLM, Qwen2ForCausalLM):
        assert compat.logits_to_keep_kwarg() in inspect.signature(model.forward).parameters, model


def test_torch_at_least_reads_the_release_without_its_local_part(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.8.0+cpu")
    assert compat.torch_at_least("2.8")
    assert compat.torch_at_least("2.7.1")
    assert not compat.torch_at_least("2.8.1")
    assert not compat.torch_at_least("2.10")
