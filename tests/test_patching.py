"""The patch manager: version gate, scope, exception safety, nesting and threads leave transformers'
module globals (and every patched attribute) exactly as found: the same objects."""

import threading

import pytest
import torch
import transformers
import transformers.generation.candidate_generator as candidate_generator
import transformers.generation.utils as generation_utils
from transformers import AutoModelForCausalLM, DynamicCache, StoppingCriteria, StoppingCriteriaList

from optimum_ipex_spec import IPEXFusedCache, IPEXModelForCausalLM

from optimum_ipex_spec.backends.ipex import patching
from optimum_ipex_spec.backends.ipex.patching import Patch, PatchManager, UnsupportedIPEXVersionError


def _snapshot():
    mods = (candidate_generator, generation_utils)
    return [dict(vars(m)) for m in mods] + [dict(vars(generation_utils.GenerationMixin))]


def _assert_same(before, after):
    for b, a in zip(before, after):
        assert b.keys() == a.keys()
        for key in b:
            assert a[key] is b[key], key


class _Box:
    def method(self):
        return "original"


def test_patch_manager_scopes_nests_and_restores_same_objects():
    manager = PatchManager()
    original = vars(_Box)["method"]
    patch = [Patch(_Box, "method", lambda self: "patched")]
    with manager.activate(patch):
        assert _Box().method() == "patched"
        with manager.activate(patch):  # nested: counted, not re-installed
            assert _Box().method() == "patched"
        assert _Box().method() == "patched"
    assert vars(_Box)["method"] is original


def test_patch_manager_restores_when_body_raises():
    manager = PatchManager()
    original = vars(_Box)["method"]
    with pytest.raises(RuntimeError, match="boom"):
        with manager.activate([Patch(_Box, "method", lambda self: "patched")]):
            raise RuntimeError("boom")
    assert vars(_Box)["method"] is original and not manager.active


def test_patch_manager_inherited_attribute_is_deleted_again():
    class Child(_Box):
        pass

    manager = PatchManager()
    with manager.activate([Patch(Child, "method", lambda self: "patched")]):
        assert Child().method() == "patched"
    assert "method" not in vars(Child) and Child().method() == "original"


def test_patch_manager_threads_reference_count():
    manager = PatchManager()
    original = vars(_Box)["method"]
    barrier = threading.Barrier(8)
    seen = []

    def worker():
        with manager.activate([Patch(_Box, "method", lambda self: "patched")]):
            barrier.wait()
            seen.append(_Box().method())
            barrier.wait()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["patched"] * 8 and vars(_Box)["method"] is original and not manager.active


def test_required_hooks_per_transformers_version():
    # IPEXFusedCache is a DynamicCache with its own crop: no hook in any release
    for version in ("4.48.0", "4.51.3", "4.53.3", "4.54.0", "5.24.0"):
        assert patching.required_crop_hooks(version, IPEXFusedCache) == []

    class TupleCache:  # a cache that is not a DynamicCache needs the module-level hook up to 4.53
        def crop(self, n):
            self.cropped = n

    hooks = patching.required_crop_hooks("4.53.3", TupleCache)
    if hasattr(candidate_generator, "_crop_past_key_values"):
        assert {(h.owner.__name__, h.name) for h in hooks} >= {
            ("transformers.generation.candidate_generator", "_crop_past_key_values")}
        before = _snapshot()
        with PatchManager().activate(hooks):
            cache = TupleCache()
            assert candidate_generator._crop_past_key_values(None, cache, 3) is cache and cache.cropped == 3
            dyn = DynamicCache()
            assert candidate_generator._crop_past_key_values(
                type("M", (), {"config": transformers.PretrainedConfig()})(), dyn, 0) is dyn
        _assert_same(before, _snapshot())
    assert patching.required_crop_hooks("4.54.0", TupleCache) == []


@pytest.mark.parametrize("version", ["2.3.0", "2.1.100"])
def test_ipex_older_than_2_4_is_refused_for_assisted(version, monkeypatch):
    from optimum_ipex_spec.utils import import_utils

    real = import_utils.ipex_status()
    fake = import_utils.IPEXStatus(True, version, real.torch_version, None)
    monkeypatch.setattr(import_utils, "ipex_status", lambda: fake)
    with pytest.raises(UnsupportedIPEXVersionError, match=r"needs intel-extension-for-pytorch >= 2.4.*pip install"):
        patching.check_ipex_version_for_assisted(version)
    with pytest.raises(UnsupportedIPEXVersionError):
        with patching.generation_patches(assisted=True):
            pass
    patching.check_ipex_version_for_assisted("2.4.0")  # the boundary passes


class _Explode(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise RuntimeError("stopping criteria exploded")


def test_generate_leaves_transformers_globals_unchanged_also_on_error(tiny_dir, tokenizer):
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    target = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    draft = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtype=torch.bfloat16)
    ids = tokenizer("def add(a, b):", return_tensors="pt")
    before = _snapshot()
    for model, kwargs in [(target, {}), (target, {"assistant_model": draft}), (stock, {"assistant_model": draft}),
                          (target, {"assistant_model": stock})]:
        model.generate(**ids, max_new_tokens=8, do_sample=False, **kwargs)
        _assert_same(before, _snapshot())
        with pytest.raises(RuntimeError, match="exploded"):
            model.generate(**ids, max_new_tokens=8, do_sample=False,
                           stopping_criteria=StoppingCriteriaList([_Explode()]), **kwargs)
        _assert_same(before, _snapshot())
    assert not patching._GENERATION.active


def test_eight_threads_mixing_ipex_and_plain_models(tiny_dir, tokenizer):
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2")).eval()
    target = IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True)
    draft = IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True, torch_dtype=torch.bfloat16)
    texts = ["def add(a, b):", "Hello there, how", "1 2 3 4", "ünïcödé and 東京"]
    jobs = []
    for i in range(8):
        model, kwargs = [(target, {}), (target, {"assistant_model": draft}), (stock, {"assistant_model": draft}),
                         (stock, {})][i % 4]
        jobs.append((model, kwargs, texts[i % len(texts)]))
    serial = [m.generate(**tokenizer(t, return_tensors="pt"), max_new_tokens=12, do_sample=False, **k)
              for m, k, t in jobs]
    before = _snapshot()
    results = [[] for _ in jobs]
    errors = []

    def run(idx):
        model, kwargs, text = jobs[idx]
        try:
            for _ in range(3):
                results[idx].append(model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=12,
                                                   do_sample=False, **kwargs))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for expected, outs in zip(serial, results):
        assert all(torch.equal(o, expected) for o in outs)
    _assert_same(before, _snapshot())
    assert not patching._GENERATION.active
