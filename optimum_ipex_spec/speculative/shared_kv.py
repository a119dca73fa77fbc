"""A self-draft reads the target's KV cache instead of computing its own prefill and catch-up.

A draft made from the target's own checkpoint (:meth:`~optimum_ipex_spec.modeling.IPEXModelForCausalLM.self_draft`:
the same weights in bf16 or weight-only int8) computes, for every token the target has already verified, keys and
values that differ from the target's only by rounding. So instead of running its prompt prefill (the whole prompt
through the draft) and its catch-up chunks (the tokens it did not see: the last accepted proposal and the target's
own token after a fully accepted round, or everything after rounds without drafting), the draft copies those rows
from the target's cache, converted to its own dtype, and runs only the last token itself. This is the KV sharing of
self-speculative decoding (LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710, section 4.3; QuantSpec, Tiwari et al.
2025, arXiv 2502.10424, a quantized self-draft reading the target's cache).

Losslessness does not depend on it: the draft only proposes, and every proposal is verified by the target. What it
changes is the draft's cost (no prefill: on a CPU without native bf16 the bf16 draft's prefill alone cost seconds,
issue 15) and, marginally, its proposals (its cache holds the target's rounded keys instead of its own).

Row layouts (batch ``b``, ``kv_heads`` ``h``, ``head_dim`` ``d``, positions ``n``):

* :class:`~optimum_ipex_spec.backends.pytorch.cache.PreallocatedKVCache`: ``keys[layer]`` ``[b, h, capacity, d]``;
* :class:`~optimum_ipex_spec.backends.ipex.cache.IPEXFusedCache`: ``ipex_layers[layer][1]`` ``[capacity, b, h, d]`` (the
  rows the exact verify graph writes, :func:`~optimum_ipex_spec.backends.ipex.export.exact_chunk_attention`).

Both hold post-RoPE keys by absolute position, so row ``i`` of one is row ``i`` of the other.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

from ..backends.ipex.cache import IPEXFusedCache
from ..backends.pytorch.cache import PreallocatedKVCache, kv_geometry

#: caches whose rows can be read and written here
SHARABLE_CACHES = (IPEXFusedCache, PreallocatedKVCache)


def _checkpoint(source: str) -> str:
    """``source`` as one spelling: a local folder's real path (a trailing slash, ``./`` or a relative path name the same
    checkpoint), anything else (a hub id) as given."""
    return os.path.realpath(source) if os.path.isdir(source) else source


def _origin(model) -> Tuple[Optional[str], dict]:
    """The checkpoint a model was exported from: our models' ``origin`` (for a loaded export, what it recorded), else
    ``(None, {})``."""
    origin = getattr(model, "origin", None)
    return (origin[0], origin[1] or {}) if isinstance(origin, tuple) else (None, {})


def shares_target_kv(target, draft) -> bool:
    """Whether ``draft`` can fill its cache from ``target``'s: both exported from the same checkpoint (the same
    non-empty ``origin``, a local folder however spelled: only our models have one; the same hub options, a hub id's
    revision and subfolder; for a loaded export, what it recorded), the draft not turned off
    (``draft.share_target_kv = False``), with the same cache geometry (layers, KV heads, head size). Any other pair
    drafts from its own cache."""
    (source, options), (draft_source, draft_options) = _origin(target), _origin(draft)
    if not source or not draft_source or not getattr(draft, "share_target_kv", False):
        return False
    if _checkpoint(str(draft_source)) != _checkpoint(str(source)):
        return False
    if options != draft_options:  # another revision or subfolder
        return False
    geometry = kv_geometry(target.config.get_text_config())
    return geometry is not None and geometry == kv_geometry(draft.config.get_text_config())


def _rows(cache, start: int, end: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(keys, values)`` ``[b, h, end - start, d]`` (views) of positions ``start .. end - 1``."""
    if isinstance(cache, PreallocatedKVCache):
        return [(k[:, :, start:end], v[:, :, start:end]) for k, v in zip(cache.keys, cache.values)]
    return [(layer[1][start:end].permute(1, 2, 0, 3), layer[2][start:end].permute(1, 2, 0, 3))
            for layer in cache.ipex_layers]


def has_buffers(cache) -> bool:
    """Whether rows can be written into ``cache`` now: an IPEX cache gets its buffers from IPEX's kernel on its
    first forward (a draft runs its first token itself)."""
    return not isinstance(cache, IPEXFusedCache) or cache.get_seq_length() > 0


def copy_rows(source, destination, end: int) -> int:
    """Write positions ``destination.get_seq_length() .. end - 1`` of ``source``'s cache into ``destination``
    (converted to its dtype) and make ``destination`` hold ``end`` tokens. Returns the rows copied.

    Raises:
        TypeError: a cache of another kind than :data:`SHARABLE_CACHES`.
        ValueError: ``source`` holds fewer than ``end`` tokens, the two have other layer counts, batch sizes or row
            shapes, or ``destination`` has no buffers yet (an empty IPEX cache: see :func:`has_buffers`).
    """
    for cache in (source, destination):
        if not isinstance(cache, SHARABLE_CACHES):
            raise TypeError(f"rows can be shared between {', '.join(c.__name__ for c in SHARABLE_CACHES)} only, got "
                            f"{type(cache).__name__}")
    start = destination.get_seq_length()
    if end <= start:
        return 0
    if source.get_seq_length() < end:
        raise ValueError(f"the source cache holds {source.get_seq_length()} tokens; {end} were asked for")
    if not has_buffers(destination):
        raise ValueError("an empty IPEX cache has no buffers yet: run the draft's first token before copying rows")
    rows = _rows(source, start, end)
    if len(rows) != len(destination):
        raise ValueError(f"the caches have {len(rows)} and {len(destination)} layers")
    destination.reserve(end)
    target_rows = _rows(destination, start, end)
    for (key, value), (key_out, value_out) in zip(rows, target_rows):
        if key.shape != key_out.shape:
            raise ValueError(f"cache rows of shape {tuple(key.shape)} cannot fill rows of shape {tuple(key_out.shape)} "
                             "[batch, kv_heads, tokens, head_dim]")
        key_out.copy_(key)
        value_out.copy_(value)
    if isinstance(destination, PreallocatedKVCache):
        destination.advance(end - start)
    else:
        destination.hold(end)
    return end - start
