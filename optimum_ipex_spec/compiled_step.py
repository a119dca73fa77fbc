"""A one-token decode step compiled with ``torch.compile`` (Inductor CPU), for bf16 on the pure-PyTorch path.

On this CPU (AVX512-BF16 and AMX), PyTorch's eager bf16 matrix-vector products are no faster than fp32 ones
(42 ms for SmolLM2-135M's 211 projections per token, against 45 ms in fp32, 1 thread): bf16 halves the bytes
but eager does not turn that into time. Inductor with ``freezing`` and ``max_autotune`` packs each bf16
weight once for its AMX micro-kernel (``CppMicroGemmAMX``) and reaches 22 ms for the same projections. In fp32 it
does not pay (41 vs 45 ms) and its rounding differs from the eager chunk forward that verifies draft tokens,
so only bf16 is compiled.

The step is written like pytorch-labs/gpt-fast's: the keys/values of the new token are written in place into
the :class:`~optimum_ipex_spec.torch_cache.PreallocatedKVCache` buffers at the cache's length, and attention
runs over the whole capacity with a mask (``key position <= this position``, and the sliding window when there
is one). The capacity is a dynamic dimension of the graph (``torch._dynamo.mark_dynamic``), so a cache of
another size does not recompile. The projections, norms, rotary tables and activation are the model's own
modules: the step copies no weight (Inductor's frozen graph holds one packed copy of each).

Only what it is built for goes through it: batch 1, one token, no padding. Prefill and verification chunks stay
on :class:`~optimum_ipex_spec.torch_model.TorchCausalLMDecoder`.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.nn.functional as F

from .torch_cache import PreallocatedKVCache
from .torch_model import TorchCausalLMDecoder

logger = logging.getLogger(__name__)

#: Inductor settings the step compiles under (applied around each call, so a recompile uses them too; the
#: process-wide ``torch._inductor.config`` is left as it was): frozen, prepacked weights; GEMM templates chosen
#: by measuring; the autotuner's tables not printed to stderr
INDUCTOR_SETTINGS = {"freezing": True, "max_autotune": True, "autotune_num_choices_displayed": 0,
                     "max_autotune_report_choices_stats": False}


#: the oldest torch whose Inductor has the CPU AMX bf16 GEMM template the step relies on
MIN_TORCH_FOR_COMPILE = "2.6"


def check_torch_compile(backend: str, model: torch.nn.Module, dtype: torch.dtype, weights: str) -> None:
    """Raise early when ``torch_compile=True`` cannot apply.

    Raises:
        ValueError: the IPEX backend (its graphs are fused already); an architecture our decoder does not run;
            a dtype other than bf16 (fp32 decode does not get faster compiled here, and its rounding would differ
            from the verification chunk's: speculative decoding would no longer be exact); int8 weights; a torch
            older than :data:`MIN_TORCH_FOR_COMPILE`.
    """
    from packaging.version import Version

    if backend != "torch":
        raise ValueError("torch_compile=True compiles our pure-PyTorch decoder's step; this model runs on IPEX's "
                         "fused graphs. Pass backend='torch', or drop torch_compile.")
    if not TorchCausalLMDecoder.supports(model):
        raise ValueError(f"torch_compile=True needs an architecture our decoder runs; {type(model).__name__} runs on "
                         "transformers' forward. Drop torch_compile.")
    if dtype != torch.bfloat16:
        raise ValueError(f"torch_compile=True compiles bf16 models only (got {dtype}): in fp32 the compiled step is "
                         "no faster on this CPU and rounds differently from the eager verification of draft tokens, "
                         "which would make speculative decoding inexact. Load with torch_dtype=torch.bfloat16, or "
                         "drop torch_compile.")
    if weights != "dense":
        raise ValueError(f"torch_compile=True runs dense bf16 weights; weights={weights!r} has its own kernel. Drop "
                         "one of the two.")
    if Version(torch.__version__.split("+")[0]) < Version(MIN_TORCH_FOR_COMPILE):
        raise ValueError(f"torch_compile=True needs torch >= {MIN_TORCH_FOR_COMPILE} (Inductor's CPU bf16 GEMM "
                         f"template); this is torch {torch.__version__}. Upgrade torch, or drop torch_compile.")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _DecodeStep(torch.nn.Module):
    """Logits ``[1, 1, vocab]`` for one token, given the model's modules and a cache's per-layer buffers."""

    def __init__(self, model: torch.nn.Module, num_heads: int, kv_heads: int, head_dim: int,
                 sliding_window: Optional[int]):
        super().__init__()
        self.inner = model.model
        self.lm_head = model.lm_head
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.sliding_window = sliding_window

    def forward(self, input_ids, position_ids, write_at, keys, values):
        # input_ids, position_ids: int64 [1, 1]; write_at: int64 [1] (the cache row of this token);
        # keys/values: per layer [1, kv_heads, capacity, head_dim]
        inner, heads, kv_heads, dim = self.inner, self.num_heads, self.kv_heads, self.head_dim
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        key_pos = torch.arange(keys[0].shape[2])
        allowed = key_pos <= write_at
        if self.sliding_window is not None:
            allowed = allowed & (key_pos > write_at - self.sliding_window)
        mask = allowed[None, None, None, :]
        group = heads // kv_heads
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            query = attn.q_proj(x).view(1, 1, heads, dim).transpose(1, 2)
            key = attn.k_proj(x).view(1, 1, kv_heads, dim).transpose(1, 2)
            value = attn.v_proj(x).view(1, 1, kv_heads, dim).transpose(1, 2)
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            keys[index].index_copy_(2, write_at, key)
            values[index].index_copy_(2, write_at, value)
            # the heads that share a key/value head are the rows of one query (grouped-query attention)
            out = F.scaled_dot_product_attention(query.reshape(1, kv_heads, group, dim), keys[index], values[index],
                                                 attn_mask=mask, scale=dim ** -0.5)
            hidden = hidden + attn.o_proj(out.reshape(1, heads, 1, dim).transpose(1, 2).reshape(1, 1, heads * dim))
            mlp = layer.mlp
            x = layer.post_attention_layernorm(hidden)
            hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.lm_head(inner.norm(hidden))


class CompiledDecodeStep:
    """A Llama-family model's one-token decode step on a :class:`PreallocatedKVCache`, compiled by Inductor.

    Args:
        model: the bf16 transformers model our decoder runs (its modules are used, not copied).
        num_heads, kv_heads, head_dim: its attention geometry.
        sliding_window: attention window in tokens, or None.

    :meth:`compile` compiles it (tens of seconds: SmolLM2-135M 35-65 s on 1 thread; Inductor caches the result on
    disk, ``TORCHINDUCTOR_CACHE_DIR``) and returns False, logging why, when this machine cannot (no C++ compiler,
    an Inductor error): the caller then keeps its eager decoder.
    """

    def __init__(self, model: torch.nn.Module, num_heads: int, kv_heads: int, head_dim: int,
                 sliding_window: Optional[int] = None):
        self.module = _DecodeStep(model, num_heads, kv_heads, head_dim, sliding_window).eval()
        self.num_layers = len(model.model.layers)
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, model.dtype
        self._compiled = torch.compile(self.module, fullgraph=True)
        # the settings this torch has (older releases lack the reporting switches)
        self._settings = {k: v for k, v in INDUCTOR_SETTINGS.items() if hasattr(torch._inductor.config, k)}
        #: seconds the first compile took (None before :meth:`compile`)
        self.compile_seconds: Optional[float] = None

    @staticmethod
    def applies(batch: int, q: int, unpadded: bool) -> bool:
        """True for the calls this step serves: batch 1, one token, no padding."""
        return batch == 1 and q == 1 and unpadded

    def compile(self) -> bool:
        """Compile on a small scratch cache; True when it worked (then :attr:`compile_seconds` is set)."""
        cache = PreallocatedKVCache(self.num_layers, 1, self.kv_heads, self.head_dim, self.dtype, capacity=16)
        for buffer in cache.keys + cache.values:
            torch._dynamo.mark_dynamic(buffer, 2)  # any capacity runs the same graph
        start = time.perf_counter()
        try:
            self(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), cache)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds (no compiler, codegen, a backend error)
            logger.warning("torch.compile could not compile the bf16 decode step here (%s: %s); decoding on the "
                           "eager decoder instead.", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        self.compile_seconds = time.perf_counter() - start
        logger.info("Compiled the bf16 decode step with torch.compile in %.1f s.", self.compile_seconds)
        return True

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor,
                 cache: PreallocatedKVCache) -> torch.Tensor:
        """Logits ``[1, 1, vocab]`` (bf16) for ``input_ids`` int64 ``[1, 1]`` at ``position_ids`` int64 ``[1, 1]``;
        writes its key/value at row ``cache.length`` and advances the cache by one."""
        past = cache.length
        cache.reserve(past + 1)
        with torch._inductor.config.patch(self._settings):
            # fresh [1, 1] tensors: generate() passes slices whose strides differ, and a new stride recompiles
            logits = self._compiled(torch.tensor([[int(input_ids)]]), torch.tensor([[int(position_ids)]]),
                                    torch.tensor([past]), cache.keys, cache.values)
        cache.advance(1)
        return logits
