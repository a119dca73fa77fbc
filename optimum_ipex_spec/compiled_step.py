"""A one-token decode step compiled with ``torch.compile`` (Inductor CPU), for bf16 on the pure-PyTorch path.

On this CPU (AVX512-BF16 and AMX), PyTorch's eager bf16 matrix-vector products are no faster than fp32 ones
(42 ms for SmolLM2-135M's 121 projections per token, q/k/v and gate/up fused, against 45 ms in fp32, 1 thread):
bf16 halves the bytes but eager does not turn that into time. Inductor with ``freezing`` and ``max_autotune`` packs
each bf16 weight once for its AMX micro-kernel (``CppMicroGemmAMX``) and reaches 22 ms for the same projections.
In fp32 it does not pay (41 vs 45 ms) and its rounding differs from the eager chunk forward that verifies draft
tokens, so only bf16 is compiled (and int8 weights, with bf16 activations).

The step is written like pytorch-labs/gpt-fast's: the keys/values of the new token are written in place into
the :class:`~optimum_ipex_spec.torch_cache.PreallocatedKVCache` buffers at the cache's length, and attention
runs over the whole capacity with a mask (``key position <= this position``, and the sliding window when there
is one). The capacity is a dynamic dimension of the graph (``torch._dynamo.mark_dynamic``), so a cache of
another size does not recompile. The projections, norms, rotary tables and activation are the model's own
modules: the step copies no weight (Inductor's frozen graph holds one packed copy of each).

With int8 weights (``weights="int8"``, a draft) the projections are the decoder's
:class:`~optimum_ipex_spec.int8_weights.Int8Weight` matrices (fused q/k/v and gate/up), multiplied by
``torch.ops.aten._weight_int8pack_mm``, which Inductor lowers to its own GEMM template with the scales as an epilogue.

Only what it is built for goes through it: batch 1, one token, no padding. Prefill and verification chunks stay
on :class:`~optimum_ipex_spec.torch_model.TorchCausalLMDecoder`.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Optional

import torch
import torch.nn.functional as F

from .dense_weights import onednn_bf16_available
from .int8_weights import KERNEL_K_MULTIPLE, Int8Weight
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


def check_torch_compile_flag(torch_compile) -> None:
    """Raise ValueError unless ``torch_compile`` is a bool (a string such as ``"false"`` would turn compiling on)."""
    if not isinstance(torch_compile, bool):
        raise ValueError(f"torch_compile must be True or False, got {torch_compile!r}")


def dense_bf16_compile_unsupported() -> Optional[str]:
    """Why this CPU cannot run the compiled dense bf16 step, or None. Without oneDNN bf16 (an AVX2-only CPU such as
    AMD EPYC Zen 3: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False) Inductor's compiled bf16 step gave
    logits off by up to half their magnitude against the eager decoder (tests/test_compiled_step.py, measured
    on such a CPU); the int8 step (``weights="int8"``) tracked its eager twin there."""
    if onednn_bf16_available():
        return None
    return (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no oneDNN bf16, and there Inductor's compiled "
            "bf16 step computed wrong logits (off by up to half their magnitude against the eager decoder)")


def check_torch_compile(backend: str, model: torch.nn.Module, dtype: torch.dtype, weights: str) -> None:
    """Raise early when ``torch_compile=True`` cannot apply.

    Raises:
        ValueError: the IPEX backend (its graphs are fused already); an architecture our decoder does not run;
            a dtype other than bf16 (fp32 decode does not get faster compiled here, and its rounding would differ
            from the verification chunk's: speculative decoding would no longer be exact); a torch older than
            :data:`MIN_TORCH_FOR_COMPILE`; dense bf16 weights on a CPU without oneDNN bf16
            (:func:`dense_bf16_compile_unsupported`).
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
                         "which would make speculative decoding inexact. Load the checkpoint with "
                         "torch_dtype=torch.bfloat16 (a saved fp32 export needs a new export in bf16 from its "
                         "checkpoint), or drop torch_compile.")
    if Version(torch.__version__.split("+")[0]) < Version(MIN_TORCH_FOR_COMPILE):
        raise ValueError(f"torch_compile=True needs torch >= {MIN_TORCH_FOR_COMPILE} (Inductor's CPU bf16 GEMM "
                         f"template); this is torch {torch.__version__}. Upgrade torch, or drop torch_compile.")
    unsupported = dense_bf16_compile_unsupported() if weights == "dense" else None
    if unsupported:
        raise ValueError(f"torch_compile=True: {unsupported}. Drop torch_compile (the eager bf16 decoder is exact), "
                         "or for a draft use self_draft(weights='int8', torch_compile=True).")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Int8Projection(torch.nn.Module):
    """An :class:`~optimum_ipex_spec.int8_weights.Int8Weight` (its tensors as buffers, not copied) and a bias, as a
    module Inductor can freeze: ``x [..., in]`` bf16 -> ``[..., out]`` bf16."""

    def __init__(self, weight: Int8Weight, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("bias", bias)
        self.kernel = weight.qweight.shape[1] % KERNEL_K_MULTIPLE == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.kernel:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:  # a width the kernel gets wrong: the dense matrix (folded once by freezing)
            out = rows @ (self.qweight.to(rows.dtype) * self.scales[:, None]).t()
        out = out.reshape(*x.shape[:-1], self.qweight.shape[0])
        return out if self.bias is None else out + self.bias


class _DecodeStep(torch.nn.Module):
    """Logits ``[1, 1, vocab]`` for one token, given the model's modules (and, for int8 weights, the decoder's
    packed matrices) and a cache's per-layer buffers."""

    def __init__(self, model: torch.nn.Module, num_heads: int, kv_heads: int, head_dim: int,
                 sliding_window: Optional[int], int8_layers: Optional[list] = None, int8_head=None):
        super().__init__()
        self.inner = model.model
        self.lm_head = model.lm_head
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.sliding_window = sliding_window
        self.int8 = int8_layers is not None
        if self.int8:  # per layer: fused q/k/v (+ bias), o, fused gate/up, down
            self.int8_layers = torch.nn.ModuleList(
                torch.nn.ModuleList([_Int8Projection(qkv, bias), _Int8Projection(o), _Int8Projection(gate_up),
                                     _Int8Projection(down)]) for qkv, bias, o, gate_up, down in int8_layers)
            self.lm_head = _Int8Projection(int8_head)

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
            if self.int8:
                qkv_m, o_m, gate_up_m, down_m = self.int8_layers[index]
                query, key, value = qkv_m(x).split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            else:
                query, key, value = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            query = query.view(1, 1, heads, dim).transpose(1, 2)
            key = key.view(1, 1, kv_heads, dim).transpose(1, 2)
            value = value.view(1, 1, kv_heads, dim).transpose(1, 2)
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            keys[index].index_copy_(2, write_at, key)
            values[index].index_copy_(2, write_at, value)
            # the heads that share a key/value head are the rows of one query (grouped-query attention)
            out = F.scaled_dot_product_attention(query.reshape(1, kv_heads, group, dim), keys[index], values[index],
                                                 attn_mask=mask, scale=dim ** -0.5)
            out = out.reshape(1, heads, 1, dim).transpose(1, 2).reshape(1, 1, heads * dim)
            mlp = layer.mlp
            if self.int8:
                hidden = hidden + o_m(out)
                gate, up = gate_up_m(layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
                hidden = hidden + down_m(mlp.act_fn(gate) * up)
            else:
                hidden = hidden + attn.o_proj(out)
                x = layer.post_attention_layernorm(hidden)
                hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.lm_head(inner.norm(hidden))


class CompiledDecodeStep:
    """A Llama-family model's one-token decode step on a :class:`PreallocatedKVCache`, compiled by Inductor.

    Args:
        decoder: the :class:`~optimum_ipex_spec.torch_model.TorchCausalLMDecoder` of a bf16 model: its model's
            modules (dense weights) or its int8 matrices are used, not copied; its attention geometry and window.

    :meth:`compile` compiles it (tens of seconds: SmolLM2-135M 35-65 s on 1 thread; the autotuning results are cached
    on disk, ``TORCHINDUCTOR_CACHE_DIR``, the frozen graph is not: a later process compiles again, faster) and
    returns False, logging why, when this machine cannot (no C++ compiler, an Inductor error, e.g. for a dynamic
    rope type): the caller then keeps its eager decoder. Changing ``torch.set_num_threads`` or deterministic
    algorithms between calls recompiles (seconds to a minute).
    """

    def __init__(self, decoder: TorchCausalLMDecoder):
        model, int8 = decoder.model, decoder.weights == "int8"
        self.module = _own_code(_DecodeStep)(model, decoder.num_heads, decoder.kv_heads, decoder.head_dim,
                                             decoder.sliding_window, int8_layers=decoder._layers if int8 else None,
                                             int8_head=decoder._lm_head if int8 else None).eval()
        self.num_layers = decoder.num_layers
        self.kv_heads, self.head_dim, self.dtype = decoder.kv_heads, decoder.head_dim, model.dtype
        self.vocab_size = model.get_input_embeddings().num_embeddings
        #: True once a compiled call failed (e.g. a recompile Inductor could not do): the eager decoder runs instead
        self.failed = False
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
            self._run(0, 0, cache)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds (no compiler, codegen, a backend error)
            logger.warning("torch.compile could not compile the bf16 decode step here (%s: %s); decoding on the "
                           "eager decoder instead.", type(exc).__name__, _first_line(exc))
            self.failed = True
            return False
        self.compile_seconds = time.perf_counter() - start
        logger.info("Compiled the bf16 decode step with torch.compile in %.1f s.", self.compile_seconds)
        return True

    def __call__(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor,
                 cache: PreallocatedKVCache) -> Optional[torch.Tensor]:
        """Logits ``[1, 1, vocab]`` (bf16) for ``input_ids`` int64 ``[1, 1]`` at ``position_ids`` int64 ``[1, 1]``;
        writes its key/value at row ``cache.length`` and advances the cache by one. None (logged once, and
        :attr:`failed` set) when the compiled call fails: the caller runs its eager decoder instead.

        Raises:
            ValueError: ids that are not integers or outside the vocabulary; not one position; a cache built for
                another model (layers, dtype, key/value heads or head size).
        """
        if input_ids.dtype not in (torch.int64, torch.int32) or position_ids.numel() != 1:
            raise ValueError(f"one token needs integer input_ids [1, 1] and one position (position_ids [1, 1]); got "
                             f"input_ids {input_ids.dtype} {tuple(input_ids.shape)}, position_ids "
                             f"{tuple(position_ids.shape)}")
        token = int(input_ids)
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        if (len(cache.keys), cache.dtype, cache.kv_heads, cache.head_dim) != (
                self.num_layers, self.dtype, self.kv_heads, self.head_dim):
            raise ValueError(f"this cache holds {len(cache.keys)} layers of {cache.kv_heads} x {cache.head_dim} "
                             f"{cache.dtype} keys/values; the model needs {self.num_layers} layers of {self.kv_heads} "
                             f"x {self.head_dim} {self.dtype}: build it with model.new_cache(), or let generate()")
        try:
            return self._run(token, int(position_ids), cache)
        except Exception as exc:  # noqa: BLE001 - e.g. a recompile Inductor cannot do, at the recompile limit
            logger.warning("The compiled bf16 decode step failed (%s: %s); decoding on the eager decoder from now on.",
                           type(exc).__name__, _first_line(exc))
            self.failed = True
            return None

    @torch.no_grad()
    def _run(self, token: int, position: int, cache: PreallocatedKVCache) -> torch.Tensor:
        past = cache.length
        cache.reserve(max(past + 1, 2))  # a capacity of 1 would be a graph of its own (Dynamo specializes 0 and 1)
        # autocast off: the step is bf16 already, and an autocast region would be another graph
        with torch._inductor.config.patch(self._settings), torch.autocast("cpu", enabled=False):
            # fresh [1, 1] tensors: generate() passes slices whose strides differ, and a new stride recompiles
            logits = self._compiled(torch.tensor([[token]]), torch.tensor([[position]]), torch.tensor([past]),
                                    cache.keys, cache.values)
        cache.advance(1)
        return logits


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _own_code(cls: type) -> type:
    """A subclass of ``cls`` whose ``forward`` is a copy with its own code object. Dynamo keeps its compiled graphs,
    and its limit of recompiles (8), per code object: without this, every compiled model in a process would share
    one ``forward``'s limit, and the ninth would fail to compile."""
    forward = cls.forward
    code = forward.__code__.replace()
    own = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    return type(cls.__name__, (cls,), {"forward": own, "__doc__": cls.__doc__})
