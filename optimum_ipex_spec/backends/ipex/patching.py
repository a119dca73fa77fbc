"""The one place where this package changes attributes of other libraries: scoped, exception-safe,
thread-safe, reference-counted, and restored to the very same objects.

Two users:

* ``generation_patches()``: the cache-crop hooks transformers needs to roll back IPEX's KV cache
  after rejected draft tokens. transformers <= 4.53 crops through the module-level
  ``_crop_past_key_values`` (imported by name into ``generation/utils.py``), which handles
  ``DynamicCache`` subclasses through ``.crop()``; from 4.54 (and in 5.x) cropping is ``Cache.crop``.
  :class:`~optimum_ipex_spec.backends.ipex.cache.IPEXFusedCache` subclasses ``DynamicCache`` and implements
  ``crop``, so for every transformers release we support the list of needed hooks is empty and
  nothing is installed; :func:`required_crop_hooks` documents (and tests pin) that decision.
* ``exact_chunk_attention_patch()``: swaps IPEX's fused attention function for an exact one while
  the verification graph is traced (see :mod:`optimum_ipex_spec.backends.ipex.export`).
* ``shared_rotary_tables_patch()``: while ``ipex.llm.optimize`` converts a model, makes its decoder layers share
  one rotary-embedding table instead of building one per layer.

One permanent registration, made once on import of :mod:`optimum_ipex_spec.modeling`:
``register_for_pipelines()`` adds one entry, under a key of our own, to the name table transformers'
text-generation pipeline checks models against. It replaces nothing transformers had.

Gate: assisted generation with an IPEX model needs IPEX >= 2.4 (the fused cache layout this package
crops); older versions raise :class:`UnsupportedIPEXVersionError` before generation starts.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, List, Sequence

from ...compat import ipex_older_than, needs_module_crop_hook
from ...facts import MIN_IPEX_FOR_ASSISTED
from ...utils import import_utils
from .cache import IPEXFusedCache

_INHERITED = object()


class UnsupportedIPEXVersionError(RuntimeError):
    """An IPEX model takes part in assisted generation but the installed IPEX is older than 2.4."""


@dataclass(frozen=True)
class Patch:
    """Set ``owner.name = replacement`` while active. ``owner`` is a module or class."""

    owner: Any
    name: str
    replacement: Any

    @property
    def key(self):
        return (id(self.owner), self.name)


class PatchManager:
    """Reference-counted installation of a set of patches.

    The first ``activate`` installs the patches (remembering the exact original objects), nested or
    concurrent ``activate`` calls only count, and the last exit restores the originals, also when
    the body raised. A re-entrant lock makes install/restore atomic with respect to other threads.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._count = 0
        self._saved: List[tuple] = []

    @property
    def active(self) -> bool:
        return self._count > 0

    @contextlib.contextmanager
    def activate(self, patches: Sequence[Patch]) -> Iterator[None]:
        with self._lock:
            if self._count == 0:
                self._install(patches)
            elif patches and {p.key for p in patches} != {(id(o), n) for o, n, _ in self._saved}:
                raise RuntimeError("PatchManager.activate called with a different patch set while active")
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                if self._count == 0:
                    self._restore()

    def _install(self, patches: Sequence[Patch]) -> None:
        saved = []
        try:
            for patch in patches:
                # vars() keeps descriptors (classmethod objects) as they are; an attribute that was
                # inherited rather than owned is deleted again on restore.
                original = vars(patch.owner).get(patch.name, _INHERITED)
                if original is _INHERITED and not hasattr(patch.owner, patch.name):
                    raise AttributeError(f"{patch.owner!r} has no attribute {patch.name!r} to patch")
                setattr(patch.owner, patch.name, patch.replacement)
                saved.append((patch.owner, patch.name, original))
        except Exception:
            self._saved = saved
            self._restore()
            raise
        self._saved = saved

    def _restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved = []


_GENERATION = PatchManager()
_TRACING = PatchManager()
_OPTIMIZING = PatchManager()


def required_crop_hooks(transformers_version: str, cache_cls: type) -> List[Patch]:
    """The hooks transformers ``transformers_version`` needs to crop ``cache_cls`` during assisted generation.

    <= 4.53: ``_crop_past_key_values`` crops ``DynamicCache`` instances with ``.crop(n)``; any other
    object is treated as a tuple of ``(key, value)`` tensors and rebuilt, which would destroy IPEX's
    4-tuples. >= 4.54: transformers calls ``Cache.crop`` directly. ``IPEXFusedCache`` is a
    ``DynamicCache`` with its own ``crop``, so the answer is "none" for every supported release.
    """
    from transformers.cache_utils import DynamicCache

    if issubclass(cache_cls, DynamicCache) and hasattr(cache_cls, "crop"):
        return []
    if needs_module_crop_hook(transformers_version):
        return _module_crop_hooks(cache_cls)
    return []


def _module_crop_hooks(cache_cls: type) -> List[Patch]:
    import transformers.generation.candidate_generator as candidate_generator
    import transformers.generation.utils as generation_utils

    if not hasattr(candidate_generator, "_crop_past_key_values"):
        # asked for a release <= 4.53 while a later one is installed (simulated versions in tests): nothing to hook
        return []
    original = candidate_generator._crop_past_key_values

    def _crop_past_key_values(model, past_key_values, max_length):
        if isinstance(past_key_values, cache_cls):
            past_key_values.crop(max_length)
            return past_key_values
        return original(model, past_key_values, max_length)

    return [
        Patch(module, "_crop_past_key_values", _crop_past_key_values)
        for module in (candidate_generator, generation_utils)
        if hasattr(module, "_crop_past_key_values")
    ]


def check_ipex_version_for_assisted(ipex_version: str) -> None:
    """Raise :class:`UnsupportedIPEXVersionError` for IPEX older than 2.4."""
    if ipex_older_than(ipex_version, MIN_IPEX_FOR_ASSISTED):
        raise UnsupportedIPEXVersionError(
            f"assisted generation with an IPEX model needs intel-extension-for-pytorch >= {MIN_IPEX_FOR_ASSISTED} "
            f"(installed: {ipex_version}); upgrade it together with torch, e.g. "
            'pip install "torch==2.8.0" "intel-extension-for-pytorch==2.8.0" "transformers==4.51.3"'
        )


@contextlib.contextmanager
def generation_patches(assisted: bool) -> Iterator[None]:
    """Scope of one ``generate()`` call in which an IPEX model takes part (target or assistant)."""
    import transformers

    status = import_utils.ipex_status()  # looked up at each call (tests stand in a fake IPEX)
    if assisted and status.ipex_version:
        check_ipex_version_for_assisted(status.ipex_version)
    patches = required_crop_hooks(transformers.__version__, IPEXFusedCache) if assisted else []
    with _GENERATION.activate(patches):
        yield


def exact_chunk_attention_patch(replacement) -> contextlib.AbstractContextManager:
    """Swap IPEX's fused scaled-dot-product function for ``replacement`` while tracing."""
    from intel_extension_for_pytorch.transformers.models.cpu.fusions import mha_fusion

    return _TRACING.activate([Patch(mha_fusion._IPEXScaleDotProductCPU, "apply_function", replacement)])


def shared_rotary_tables_patch() -> contextlib.AbstractContextManager:
    """While ``ipex.llm.optimize`` runs: build one IPEX ``RotaryEmbedding`` per distinct configuration.

    IPEX creates a ``RotaryEmbedding`` in every decoder layer's attention, once for its reference module and
    once for the CPU module that replaces it, each with four fp32 ``[max_position_embeddings, head_dim]`` tables
    computed from the same arguments: 3.6 GB built (1.8 GB kept) for Qwen2.5-1.5B's 28 layers of 32k positions,
    where one set is 64 MB. The tables are read-only on the fused path, so layers can share one instance;
    instances are shared only within one ``activate`` (one export).
    """
    from intel_extension_for_pytorch.transformers.models.cpu.fusions import mha_fusion as cpu_fusion
    from intel_extension_for_pytorch.transformers.models.reference.fusions import mha_fusion as reference_fusion

    original = reference_fusion.RotaryEmbedding
    instances = {}

    def shared_rotary_embedding(max_position_embeddings, dim, backbone, base=10000, kwargs=None):
        key = (max_position_embeddings, dim, str(backbone), base, repr(kwargs))
        if key not in instances:
            instances[key] = original(max_position_embeddings, dim, backbone, base, kwargs)
        return instances[key]

    return _OPTIMIZING.activate([
        Patch(cpu_fusion, "RotaryEmbedding", shared_rotary_embedding),
        Patch(reference_fusion, "RotaryEmbedding", shared_rotary_embedding),
    ])


#: the key under which :func:`register_for_pipelines` lists our model class among the causal LMs
PIPELINE_REGISTRATION_KEY = "optimum-ipex-spec"


def register_for_pipelines(class_name: str) -> None:
    """List ``class_name`` among the text-generation models that transformers' pipelines accept.

    ``pipeline("text-generation", model=...)`` checks ``type(model).__name__`` against the values of
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (4.4x-5.x; the ``AutoModelForCausalLM.register`` entries of a config class
    are not consulted there) and otherwise logs an error-level "is not supported for text-generation" line with a
    hundred names on every construction, although generation works. The entry is added under our own key, which no
    config's ``model_type`` uses, so the auto classes (keyed by ``model_type``) are unaffected; nothing transformers
    had is replaced. Idempotent.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(PIPELINE_REGISTRATION_KEY, class_name)
