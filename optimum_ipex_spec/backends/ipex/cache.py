"""IPEX's fused ("indirect access") KV cache behind a transformers ``Cache``.

IPEX's ``masked_multihead_self_attention`` keeps, per decoder layer, a 4-tuple

* ``seq_info``  int64 ``[1, L, L, 1]``: only its shape is read; ``L = size(-2)`` is the cached length;
* ``key``       ``[max_positions, batch, kv_heads, head_dim]`` in the model dtype, preallocated;
* ``value``     same as ``key``;
* ``beam_idx``  int64 ``[max_positions + 2, batch]``: per position the beam it came from (0 for us: no beam search);
  its last two rows hold the prompt's length and batch size (read by the kernel at row ``max_positions``).

The kernel writes new keys/values in place at rows ``L .. L+q-1``. Cropping to ``n`` tokens
therefore only needs a new ``seq_info`` of shape ``[1, n, n, 1]``: rows past ``n`` are overwritten
by the next forward. This class hides the tuple format from user code and gives transformers the
``Cache`` methods it calls (``get_seq_length``, ``crop``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from transformers.cache_utils import DynamicCache

from ...compat import crop_keep_length

#: Rows IPEX preallocates for keys/values on the first forward (IPEX 2.7/2.8, CPU).
IPEX_PREALLOCATED_POSITIONS = 2048


class IPEXFusedCache(DynamicCache):
    """KV cache in IPEX's fused layout, for one batch of sequences.

    It subclasses ``DynamicCache`` only so that transformers' assisted generation rolls it back
    with :meth:`crop` (transformers <= 4.53 crops ``DynamicCache`` instances through ``.crop`` and
    would rebuild anything else as a tuple of 2-tuples); none of ``DynamicCache``'s per-layer
    tensor lists are used, and the methods that would read them raise ``NotImplementedError``.

    Args:
        num_layers: number of decoder layers of the model.
        batch_size: number of sequences (beam search is not supported: 1 beam each).
        dtype: dtype of keys/values (``torch.float32`` or ``torch.bfloat16``).

    The tuple consumed and produced by the traced IPEX graph is :attr:`ipex_layers`; only the model
    wrapper touches it.
    """

    is_compileable = False

    def __init__(self, num_layers: int, batch_size: int, dtype: torch.dtype = torch.float32):
        # DynamicCache's constructor differs across transformers releases and sets up per-layer
        # tensor lists we never use; set only what its inherited helpers read.
        self.key_cache, self.value_cache, self._seen_tokens = [], [], 0
        self.num_layers = num_layers
        self._batch_size = batch_size
        self.dtype = dtype
        empty_info = torch.zeros(1, 0, 0, 1, dtype=torch.long)
        beam_idx = torch.zeros(IPEX_PREALLOCATED_POSITIONS, batch_size, dtype=torch.long)
        self.ipex_layers: Tuple[Tuple[torch.Tensor, ...], ...] = tuple(
            (empty_info, torch.zeros(1, 1, 1, 1, dtype=dtype), torch.zeros(1, 1, 1, 1, dtype=dtype), beam_idx)
            for _ in range(num_layers)
        )

    @property
    def batch_size(self) -> int:  # a read-only property of Cache in transformers >= 5
        return self._batch_size

    # -- what the model wrapper calls --------------------------------------------------------------
    def replace(self, layers: Tuple[Tuple[torch.Tensor, ...], ...]) -> None:
        """Adopt the per-layer tuples returned by the traced graph after a forward."""
        self.ipex_layers = layers

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` tokens in every layer's key/value buffers, as IPEX's kernel does when a
        forward would pass their end: capacity doubles (or becomes ``positions``), held rows are copied, new
        ``beam_idx`` rows repeat row 0 and its two bookkeeping rows move to the new end. The exact verify graph writes a
        chunk's keys/values itself and calls no kernel that could grow the buffers, so the runner reserves before it
        runs.

        Args:
            positions: tokens the next forward will hold (cached + new).
        """
        info, key = self.ipex_layers[0][0], self.ipex_layers[0][1]
        if info.size(-2) == 0 or key.size(0) >= positions:
            return  # nothing held yet (IPEX allocates the buffers on prefill), or room enough
        size = max(2 * key.size(0), positions)
        grown = []
        for info, key, value, beam_idx in self.ipex_layers:
            held = key.size(0)
            new_key = key.new_empty((size,) + tuple(key.shape[1:]))
            new_value = value.new_empty((size,) + tuple(value.shape[1:]))
            new_key[:held].copy_(key)
            new_value[:held].copy_(value)
            # IPEX keeps two rows after the capacity (the prompt's length and batch size): they move to the end
            extra = max(beam_idx.size(0) - held, 0)
            new_beam = beam_idx.new_empty((size + extra,) + tuple(beam_idx.shape[1:]))
            new_beam[:held].copy_(beam_idx[:held])
            new_beam[held:size] = beam_idx[:1]
            new_beam[size:].copy_(beam_idx[held:])
            grown.append((info, new_key, new_value, new_beam))
        self.ipex_layers = tuple(grown)

    # -- transformers Cache API --------------------------------------------------------------------
    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        """Number of tokens held (int)."""
        return self.ipex_layers[layer_idx or 0][0].size(-2)

    def get_max_cache_shape(self) -> Optional[int]:
        """No fixed maximum: IPEX grows its buffers on demand."""
        return None

    def get_max_length(self) -> Optional[int]:  # transformers < 4.48 name
        return None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (a negative value drops ``-max_length`` tokens; ``crop(0)`` as
        :func:`~optimum_ipex_spec.compat.crop_keep_length` says, the same for both our caches).

        Raises:
            ValueError: if the result would be negative.
        """
        current = self.get_seq_length()
        keep = crop_keep_length(current, max_length)
        if keep < current:
            self.hold(keep)

    def hold(self, length: int) -> None:
        """Set the number of tokens held to ``length`` (IPEX reads it off ``seq_info``'s shape only): fewer rolls the
        cache back; more adopts rows written into the buffers directly (the verify graph's chunk,
        :func:`~optimum_ipex_spec.speculative.shared_kv.copy_rows`), which must be there."""
        info = torch.empty(1, length, length, 1, dtype=torch.long)
        self.ipex_layers = tuple((info,) + tuple(layer[1:]) for layer in self.ipex_layers)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        raise NotImplementedError(
            "IPEXFusedCache is written by IPEX's fused attention kernel inside the traced graph; "
            "it cannot be updated by eager attention layers."
        )

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("Beam search is not supported by IPEXModelForCausalLM; use greedy or sampling.")

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer_idx):
        raise TypeError("IPEXFusedCache holds IPEX's fused per-layer buffers; it is not indexable as (key, value)")

    def __iter__(self):
        raise TypeError("IPEXFusedCache holds IPEX's fused per-layer buffers; it is not iterable as (key, value)")

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "this DynamicCache operation is not supported by IPEXFusedCache (IPEX's fused KV cache): "
            "supported are get_seq_length and crop"
        )

    to_legacy_cache = batch_repeat_interleave = batch_select_indices = batch_split = _unsupported

    def __repr__(self) -> str:
        return (
            f"IPEXFusedCache(layers={self.num_layers}, batch={self.batch_size}, dtype={self.dtype}, "
            f"seq_length={self.get_seq_length()})"
        )
