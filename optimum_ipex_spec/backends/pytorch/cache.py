"""A preallocated KV cache with exact multi-token crop, for the pure-PyTorch path.

Per decoder layer, keys and values live in ``[batch, kv_heads, capacity, head_dim]`` buffers (model
dtype) written in place at rows ``length .. length + q - 1``; a forward reads rows ``0 .. length + q - 1``.
Cropping to ``n`` tokens only sets ``length = n``: rows past ``n`` are overwritten by the next forward
before anything reads them, so a rollback after rejected draft tokens costs nothing and is exact.
Capacity grows when a forward needs more rows (one copy each time, amortized): a cache of ``generate()`` starts at
its prompt and :data:`GROWTH_ROWS` rows, whatever ``max_new_tokens`` is, and each growth adds twice the rows of the
one before, never past the rows the generation can hold (its growth limit); a cache made otherwise doubles.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from transformers.cache_utils import DynamicCache

from ...compat import crop_keep_length

#: rows past the prompt that a cache of ``generate()`` starts with, and what its first growth adds (each later growth
#: adds twice the rows of the one before): its memory follows the tokens generated, not ``max_new_tokens``
GROWTH_ROWS = 16


def first_capacity(prompt_tokens: Optional[int]) -> int:
    """The rows ``generate()`` allocates for a prompt of ``prompt_tokens`` tokens: the prompt's and
    :data:`GROWTH_ROWS` more (independent of ``max_new_tokens``); :data:`GROWTH_ROWS` when the prompt's length is
    unknown (the prefill then grows the cache to it)."""
    return max(int(prompt_tokens or 0), 0) + GROWTH_ROWS


def kv_geometry(config) -> Optional[Tuple[int, int, int]]:
    """``(layers, kv_heads, head_dim)`` of a decoder's KV cache, from its transformers (text) config; None when the
    config lacks the layer or head count."""
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(layers), int(kv_heads), int(head_dim)


class PreallocatedKVCache(DynamicCache):
    """KV cache of :class:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder`.

    A ``DynamicCache`` subclass because transformers' assisted generation rolls back ``DynamicCache``
    instances through :meth:`crop` (transformers <= 4.53; later releases call ``Cache.crop``); the
    inherited per-layer lists are not used.

    Args:
        num_layers: decoder layers.
        batch_size: sequences in the batch.
        kv_heads: key/value heads per layer.
        head_dim: size of one head.
        dtype: dtype of keys/values (the model's).
        capacity: rows (tokens) to allocate up front; grows on demand (:meth:`reserve`). ``generate()`` passes
            :func:`first_capacity` (the prompt and :data:`GROWTH_ROWS`), not prompt + ``max_new_tokens``.
        growth_rows: rows the first growth adds at least (each later one adds twice the rows of the one before);
            None: ``capacity`` (the cache doubles).
        growth_limit: rows a growth adds no more than it needs past (e.g. the most rows a generation can hold:
            prompt + ``max_new_tokens`` - 1); None: no limit. A :meth:`reserve` of more rows still gets them.

    Memory: ``2 * num_layers`` buffers of ``batch_size * kv_heads * capacity * head_dim`` elements of ``dtype``.
    """

    is_compileable = False

    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, capacity: int = 256, growth_rows: Optional[int] = None,
                 growth_limit: Optional[int] = None):
        super().__init__()
        self.num_layers = num_layers
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.length = 0
        capacity = max(int(capacity), 1)
        #: rows the next growth adds at least (doubles after each growth)
        self.growth_rows = max(int(growth_rows), 1) if growth_rows is not None else capacity
        #: rows past which a growth adds only what a reserve needs (None: no limit)
        self.growth_limit = growth_limit
        shape = (batch_size, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    # -- what the decoder calls -------------------------------------------------------------------
    def reserve(self, total: int) -> None:
        """Make room for ``total`` rows, keeping the first :attr:`length` rows: the capacity grows by
        :attr:`growth_rows` (then doubled for the next growth), at least to ``total``; below :attr:`growth_limit` at
        most to it, past it (a cache continued by a later call) by :attr:`growth_rows` again, so that one row at a
        time never copies the cache per token."""
        if total <= self.capacity:
            return
        step = self.capacity + self.growth_rows
        if self.growth_limit is not None and self.capacity < self.growth_limit:
            step = min(step, self.growth_limit)
        new_capacity = max(total, step)
        self.growth_rows *= 2
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
                grown[:, :, : self.length] = old[:, :, : self.length]
                buffers[i] = grown

    def resize_batch(self, batch_size: int) -> None:
        """Reallocate an empty cache for ``batch_size`` sequences (generate() creates the cache before it expands
        the batch for beams or ``num_return_sequences``).

        Raises:
            ValueError: the cache already holds tokens.
        """
        if self.length:
            raise ValueError(f"the cache holds {self.length} tokens for batch {self.batch_size}; cannot resize it")
        shape = (batch_size,) + tuple(self.keys[0].shape[1:])
        self.keys = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ``[batch, kv_heads, q, head_dim]`` after the cached rows and return views of
        all ``length + q`` rows. :meth:`advance` commits the step once every layer has written."""
        end = self.length + key.shape[2]
        self.keys[layer][:, :, self.length:end] = key
        self.values[layer][:, :, self.length:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, q: int) -> None:
        self.length += q

    # -- transformers Cache API (4.4x-5.x) --------------------------------------------------------
    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        """Number of cached tokens (int)."""
        return self.length

    def get_max_cache_shape(self) -> Optional[int]:
        return None

    def get_max_length(self) -> Optional[int]:
        return None

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens; a negative value drops ``-max_length`` tokens (5.x's convention:
        ``crop(-n)`` removes ``n``, ``crop(0)`` removes none).

        Raises:
            ValueError: more tokens to drop than cached.
        """
        self.length = crop_keep_length(self.length, max_length)

    def activate_past_recording(self) -> None:
        """5.x marks assistant caches for rollback; every state here can be rolled back."""

    def deactivate_past_recording(self) -> None:
        """See :meth:`activate_past_recording`."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: select rows of the batch (``beam_idx`` int64 ``[batch]``)."""
        self.keys = [k.index_select(0, beam_idx) for k in self.keys]
        self.values = [v.index_select(0, beam_idx) for v in self.values]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys = [k.repeat_interleave(repeats, 0) for k in self.keys]
        self.values = [v.repeat_interleave(repeats, 0) for v in self.values]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys = [k[indices] for k in self.keys]
        self.values = [v[indices] for v in self.values]

    def to_legacy_cache(self):
        return tuple((k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values))
