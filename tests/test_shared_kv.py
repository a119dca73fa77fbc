"""A self-draft fills its KV cache from the target's (optimum_ipex_spec/speculative/shared_kv.py): the rows it copies
give the logits its own prefill gives, every pairing stays token-identical to the target alone, and only drafts of the
target's own checkpoint share."""

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.ipex.cache import IPEXFusedCache
from optimum_ipex_spec.speculative.shared_kv import copy_rows, has_buffers, shares_target_kv
from optimum_ipex_spec.backends.pytorch.cache import PreallocatedKVCache

#: backend="auto" is IPEX's graphs where IPEX runs (the ipex28 lane) and the pure-PyTorch path elsewhere
BACKENDS = ["auto", "torch"]
_EXPORTS = {}


def _export(path, dtype=torch.float32, backend="auto"):
    key = (path, dtype, backend)
    if key not in _EXPORTS:
        _EXPORTS[key] = IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=dtype, backend=backend)
    model = _EXPORTS[key]
    model.generation_config = copy.deepcopy(_EXPORTS.setdefault((key, "gc"), copy.deepcopy(model.generation_config)))
    model.share_target_kv = True
    return model


def _draft_cache_from(target, draft, ids):
    """The draft's cache for ``ids[:, :-1]`` filled from the target's (as the draft generator does)."""
    target_cache = target.new_cache(1)
    target(ids[:, :-1], past_key_values=target_cache)
    cache = draft.new_cache(1)
    if not has_buffers(cache):
        draft(ids[:, :1], past_key_values=cache)
    copied = copy_rows(target_cache, cache, ids.shape[1] - 1)
    assert copied == ids.shape[1] - 1 - (1 if isinstance(cache, IPEXFusedCache) else 0)
    assert cache.get_seq_length() == ids.shape[1] - 1
    return cache


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_backend", BACKENDS)
@pytest.mark.parametrize("target_backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_copied_rows_give_the_logits_of_the_drafts_own_prefill(arch, target_backend, draft_backend, draft_dtype,
                                                               tiny_dir):
    """Rows copied from an fp32 target's cache (either layout) into a draft's cache (either layout): the next five
    decode steps give the logits the draft's own prefill gives; exactly in fp32 (same weights, same values), within
    bf16 rounding in bf16."""
    path = tiny_dir(arch)
    target = _export(path, torch.float32, target_backend)
    draft = _export(path, draft_dtype, draft_backend)
    ids = torch.randint(3, 1000, (1, 29), generator=torch.Generator().manual_seed(1))
    own = draft.new_cache(1)
    logits_own = draft(ids, past_key_values=own).logits[:, -1].float()
    shared = _draft_cache_from(target, draft, ids)
    logits_shared = draft(ids[:, -1:], past_key_values=shared).logits[:, -1].float()
    tolerance = dict(atol=2e-5, rtol=1e-4) if draft_dtype == torch.float32 else dict(atol=3e-2, rtol=0)
    torch.testing.assert_close(logits_shared, logits_own, **tolerance)
    token = logits_own.argmax(-1, keepdim=True)
    for _ in range(5):
        a = draft(token, past_key_values=own).logits[:, -1].float()
        b = draft(token, past_key_values=shared).logits[:, -1].float()
        torch.testing.assert_close(b, a, **tolerance)
        token = a.argmax(-1, keepdim=True)


TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "  Whitespace   and\ttabs, digits 0123456789 and ünïcödé — 東京 ✓",
]


def _drafts(path, backend):
    """The self-drafts of an fp32 target of ``backend``: its bf16 copy (same backend) and, on the pure-PyTorch
    decoder, its weight-only int8 copy; both share the target's cache."""
    target = _export(path, torch.float32, backend)
    return target, {"bf16": _export(path, torch.bfloat16, backend), "int8": target.self_draft(weights="int8")}


@pytest.mark.parametrize("schedule", ["cost", "constant"])
@pytest.mark.parametrize("draft_kind", ["bf16", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_self_draft_sharing_the_target_cache_is_lossless(arch, backend, draft_kind, schedule, tiny_dir, tokenizer):
    """Greedy fp32: token-identical to transformers' greedy output, with the cache shared and without; sharing, the
    draft copies the whole prompt instead of running it (the cost model starts it after the target's prefill; under
    transformers' constant schedule its first round proposes nothing and lets the target prefill alone)."""
    path = tiny_dir(arch)
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    target, drafts = _drafts(path, backend)
    draft = drafts[draft_kind]
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = schedule
    draft.generation_config.assistant_confidence_threshold = 0.0
    for text in TEXTS:
        inputs = tokenizer(text, return_tensors="pt")
        prompt = inputs["input_ids"].shape[1]
        expected = stock.generate(**inputs, max_new_tokens=40, do_sample=False)
        runs = {}
        for share in (True, False):
            draft.share_target_kv = share
            got = target.generate(**inputs, max_new_tokens=40, do_sample=False, assistant_model=draft)
            assert torch.equal(got, expected), (share, text)
            runs[share] = draft.last_speculation_stats
        assert runs[False].shared_rows == 0
        assert runs[True].shared_rows > 0
        assert runs[True].draft_forward_tokens < runs[False].draft_forward_tokens
        assert runs[True].shared_rows >= prompt - 1, "the draft ran its prompt instead of copying it"
        assert runs[False].draft_forward_tokens >= prompt
    draft.share_target_kv = True


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sharing_draft_holds_the_whole_context_from_the_start(backend, tiny_dir, monkeypatch):
    """The cost model's context window is for drafts that compute their own cache: a sharing draft copies the
    whole prompt on its first round (no window, nothing to restart when the model chooses to draft, which is forced
    here). Output is stock greedy's."""
    from optimum_ipex_spec.speculative.cost_model import PROBE_CONTEXT, CostModel

    monkeypatch.setattr(CostModel, "best_k", lambda self: 4)
    path = tiny_dir("llama")
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    target, drafts = _drafts(path, backend)
    draft = drafts["bf16"]
    ids = torch.randint(3, 200, (1, 2 * PROBE_CONTEXT), generator=torch.Generator().manual_seed(0))
    got = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert torch.equal(got, stock.generate(ids, max_new_tokens=24, do_sample=False))
    assert draft.last_speculation_stats.shared_rows >= ids.shape[1]
    assert target.last_cost_model.full_context_round is None and target.last_cost_model.drafting_chosen


def test_only_a_draft_of_the_targets_checkpoint_with_its_geometry_shares(tiny_dir, tmp_path):
    path = tiny_dir("llama")
    target = _export(path, torch.float32, "torch")
    draft = _export(path, torch.bfloat16, "torch")
    assert shares_target_kv(target, draft)
    draft.share_target_kv = False
    assert not shares_target_kv(target, draft)
    draft.share_target_kv = True
    for spelling in (path + "/", os.path.join(path, "."), os.path.relpath(path)):  # one folder, other spellings
        draft.source = spelling
        assert shares_target_kv(target, draft), spelling
    draft.source = path
    other = tmp_path / "other"
    build_tiny("llama", seed=1).save_pretrained(other)  # another checkpoint of the same geometry
    assert not shares_target_kv(target, _export(str(other), torch.bfloat16, "torch"))
    deeper = tmp_path / "deeper"
    build_tiny("llama", layers=3).save_pretrained(deeper)
    deeper_model = _export(str(deeper), torch.bfloat16, "torch")
    deeper_model.source = target.source  # the same name, another geometry
    assert not shares_target_kv(target, deeper_model)
    stock = AutoModelForCausalLM.from_pretrained(path)
    assert not shares_target_kv(target, stock)
    anonymous = IPEXModelForCausalLM(target.model, target.config, backend="torch", dtype=torch.float32, warmup=False)
    assert not shares_target_kv(anonymous, anonymous)  # no source: nothing says the checkpoints are the same
    for options in ({"revision": "v2"}, {"subfolder": "base"}):  # the same hub id, another revision or subfolder
        draft.source_options = options
        assert not shares_target_kv(target, draft), options
    draft.source_options = {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_draft_of_a_checkpoint_in_a_subfolder_loads_it_and_shares(backend, tiny_dir, tmp_path, tokenizer):
    """``from_pretrained(parent, subfolder=..., export=True)``: the export's source is the subfolder's path, so
    self_draft() reloads that checkpoint (the parent holds none) and its draft shares the target's cache; greedy output
    is transformers'."""
    import shutil

    shutil.copytree(tiny_dir("llama"), tmp_path / "repo" / "base")
    target = IPEXModelForCausalLM.from_pretrained(str(tmp_path / "repo"), subfolder="base", export=True,
                                                  backend=backend)
    assert target.source == str(tmp_path / "repo" / "base") and target.source_options == {}
    draft = target.self_draft()
    assert shares_target_kv(target, draft)
    inputs = tokenizer(TEXTS[0], return_tensors="pt")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "repo" / "base").eval().generate(
        **inputs, max_new_tokens=20, do_sample=False)
    got = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert torch.equal(got, expected)
    assert draft.last_speculation_stats.shared_rows > 0


def test_a_hub_ids_revision_and_subfolder_survive_save_and_load(tiny_dir, tmp_path):
    """An export of a hub id keeps the revision and subfolder it was loaded with: save_pretrained records them and the
    re-export hint names them; the loaded export reads its weights (self_draft() too) from its own folder."""
    import json

    from optimum_ipex_spec.loading.export_folder import read_export_meta, reexport_hint

    options = {"revision": "v2", "subfolder": "base"}
    model = IPEXModelForCausalLM.from_transformers_model(AutoModelForCausalLM.from_pretrained(tiny_dir("llama")),
                                                         backend="torch", source="org/model", source_options=options)
    model.save_pretrained(tmp_path / "saved")
    meta = read_export_meta(str(tmp_path / "saved"), "saved")
    assert (meta["source"], meta["source_options"]) == ("org/model", options)
    loaded = IPEXModelForCausalLM.from_pretrained(tmp_path / "saved")  # its weights are in the folder: its source
    assert (loaded.source, loaded.source_options) == (str(tmp_path / "saved"), {})
    assert reexport_hint(meta) == ("re-export it with IPEXModelForCausalLM.from_pretrained('org/model', "
                                   "revision='v2', subfolder='base', export=True)")
    path = tmp_path / "saved" / "ipex_export.json"
    json.dump({**meta, "source_options": ["v2"]}, open(path, "w"))
    with pytest.raises(ValueError, match="source_options"):
        IPEXModelForCausalLM.from_pretrained(tmp_path / "saved")


def test_copy_rows_refuses_what_it_cannot_fill():
    source = PreallocatedKVCache(2, 1, 2, 8, capacity=4)
    source.advance(3)
    with pytest.raises(ValueError, match="holds 3 tokens; 5 were asked"):
        copy_rows(source, PreallocatedKVCache(2, 1, 2, 8), 5)
    with pytest.raises(ValueError, match="2 and 3 layers"):
        copy_rows(source, PreallocatedKVCache(3, 1, 2, 8), 3)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        copy_rows(source, PreallocatedKVCache(2, 1, 4, 8), 3)
    with pytest.raises(ValueError, match="no buffers yet"):
        copy_rows(source, IPEXFusedCache(2, 1), 3)
    with pytest.raises(TypeError, match="got DynamicCache"):
        from transformers import DynamicCache

        copy_rows(source, DynamicCache(), 3)
    destination = PreallocatedKVCache(2, 1, 2, 8, dtype=torch.bfloat16, capacity=1)
    assert copy_rows(source, destination, 3) == 3 and destination.get_seq_length() == 3
    assert destination.capacity >= 3 and copy_rows(source, destination, 2) == 0
