"""The decode and verification steps compiled with ``torch.compile`` (Inductor CPU), fp32 or bf16, on the
pure-PyTorch path.

PyTorch's eager matrix-vector products read weights far below the memory bandwidth on one thread: on an AMD EPYC
Zen 4 (AVX512, no AMX), SmolLM2-135M's 120 fp32 decoder projections ran at 11.7 GB/s (``F.linear``, as stock
transformers; ``torch.mv`` 11.5) while a plain ``sum`` read 24 GB/s. Inductor with ``freezing`` and ``max_autotune``
packs each weight once for its C++ GEMM template (``CppMicroGemmFP32Vec``; in bf16 the AVX512-BF16 or AMX
micro-kernel) and read the same projections at 23.5 GB/s: SmolLM2 decoded x1.87 faster than stock in fp32 (then on a
padded 4-token graph), x3.70 in bf16 (docs/benchmarks-torch-compile.md). From torch 2.13 only the C++ templates are
offered to the autotuner (``max_autotune_gemm_backends="CPP"``, :data:`CPP_ONLY_FROM_TORCH`).

Single tokens run on a 1-token graph. A graph of :data:`CHUNK_ROWS` tokens, compiled at the first chunk (or ahead,
``compile_chunk_step()``), serves the target's verification of draft tokens (and a draft's catch-up); a longer chunk
runs in pieces, the last one padded (its last token repeated at the next rows, which the cache does not count). Each
graph is compiled for its own static row count. In fp32 a token's logits must be the same bits whether it is decoded
alone or verified in a chunk, so that speculative decoding and prompt lookup return exactly the target's own greedy
tokens (tests/test_compiled_step.py): with Inductor's C++ GEMM templates alone (torch >= 2.13) the two graphs reduce
each row alike (every row of chunks of 1-4 tokens equal bit for bit, where the kernel needs it with the 1-token
graph handing SDPA's kernel query rows in fours, :data:`ATTENTION_ROW_MULTIPLE`), and the chunk
graph is checked against the 1-token graph when it compiles (:meth:`CompiledDecodeStep.compile_chunk`; where they
differ, chunks run one token at a time on the 1-token graph, logged). Where the autotuner also offers ATen's kernels
(MKL's one-row and few-row products round differently) a single fp32 token runs padded on the chunk graph instead, one
graph for both. The 1-token graph pays: on an Intel Xeon with AMX (1 thread, about 12 GB/s from memory) Inductor's fp32
GEMMs read 4 rows 1.6x slower than 1, and SmolLM2's fp32 step went from 75 ms padded to 48.6 (stock: 63); on an AMD
EPYC Zen 4 the padding cost 12%. For the same reason both fp32 graphs multiply with
:mod:`~optimum_ipex_spec.kernels.packed_gemm`'s kernel where it builds (AVX-512): Inductor's register blocking, each
output one chain of fused multiply-adds in order whatever the row count (so a row's bits do not depend on the graph),
the weight prefetched for 4 rows and read as two streams for 1, from one packed copy that both graphs share (Inductor's
GEMM templates kept one per graph: a 1.5B target held its weights three times), and in fp32 the model's own weights are
released for it (:meth:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder.adopt_packed_layer`: each
weight held once). SmolLM2's 4-token verification costs 45.7 ms against a 42.0 ms step (Inductor's GEMMs: 71 ms), and
the graphs compile faster (no GEMM to autotune). bf16 graphs multiply with the kernel's bf16 form where the CPU has
AVX512-BF16 (one packed copy for both graphs, which replaces the model's own too where the kernel's prefills run on AMX
tiles; elsewhere the model keeps its weights for its prefill). Attention must round alike in every call a token can come
in too, so its length (the cache rows it reads, masked past the token) is the capacity but one row while that is at most
:data:`ATTENTION_BLOCK` rows (generate() then allocates the whole generation's rows and the last call's padding at once,
so the capacity never grows inside it), else the filled rows rounded up to a multiple of it, the kernel's block, where
any multiple gives the same bits (:func:`exact_attention_length`): a longer generation's cache starts past that capacity
and grows with the tokens (:meth:`CompiledDecodeStep.generation_capacities`). bf16 targets are not bit-exact anyway
(docs/assisted-generation.md). Against the eager decoder both agree to rounding. The prefill stays on the eager decoder,
as stock's.

The step is written like pytorch-labs/gpt-fast's: the keys/values of the new token are written in place into
the :class:`~optimum_ipex_spec.backends.pytorch.cache.PreallocatedKVCache` buffers at the cache's length, and attention
runs under a mask (``key position <= this position``, and the sliding window when there is one) over the filled rows
(and padding rows) in bf16 and int8, over the lengths above in the exact fp32 graph: it then costs what the context
does (5 us a row for SmolLM2's 30 layers in bf16, 9 in fp32), not what ``max_new_tokens`` reserved. The capacity and
that length are dynamic dimensions of the graph (``torch._dynamo.mark_dynamic``), so neither recompiles; the length
is always below the capacity (a graph traced on part of the buffers would recompile on the whole of them: a
contiguity guard). The projections, norms, rotary tables and activation are the model's own
modules: the step copies no weight (the frozen graphs hold one packed copy of each: the packed kernel's, shared, or
Inductor's, one per graph; in fp32 the packed copy then replaces the model's).

With int8 weights (``weights="int8"``, a draft) the projections are the decoder's
:class:`~optimum_ipex_spec.backends.pytorch.int8_weights.Int8Weight` matrices (fused q/k/v and gate/up), multiplied by
``torch.ops.aten._weight_int8pack_mm``, which Inductor lowers to its own GEMM template with the scales as an epilogue.

Only what it is built for goes through it: batch 1, no padding, one token or a chunk on a non-empty cache.
Everything else runs :class:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder`.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ...compat import torch_at_least
from ..dense_weights import onednn_bf16_available
from ...facts import dtype_name
from .gguf_weights import GGUFLinear
from .int8_weights import KERNEL_K_MULTIPLE, Int8Weight
from ...kernels.packed_gemm import PackedLinear, packed_gemm_available
from .cache import PreallocatedKVCache
from .decoder import TorchCausalLMDecoder, layer_projections
from ...utils.memory import return_freed_memory

logger = logging.getLogger(__name__)

#: Inductor settings the step compiles under (applied around each call, so a recompile uses them too; the
#: process-wide ``torch._inductor.config`` is left as it was): frozen, prepacked weights; Inductor's C++ GEMM
#: templates, their blockings chosen by measuring; the autotuner's tables not printed to stderr
INDUCTOR_SETTINGS = {"freezing": True, "max_autotune": True, "autotune_num_choices_displayed": 0,
                     "max_autotune_report_choices_stats": False}


#: tokens per call of the verification graph: a chunk of draft tokens runs in pieces of this many rows, the last one
#: padded. Measured on SmolLM2-135M's 120 fp32 decoder projections alone (1 thread, AMD EPYC Zen 4, C++ templates):
#: 1 row 21 ms, 4 rows 18, 6 rows 40, 8 rows 51 (the template's row block is 4). The whole step on a 300-token cache,
#: 1-token graph against a token padded to 4 rows: fp32 28.9 vs 32.5 ms, bf16 20.3 vs 28.5 ms.
CHUNK_ROWS = 4

#: from this torch on (where it was measured), only Inductor's C++ GEMM templates are offered to the autotuner:
#: SmolLM2's fp32 projections on 4 rows ran in 18 ms so against 25 ms with ATen's kernels also offered (one family
#: for every row count, and compiles take a fraction of the time)
CPP_ONLY_FROM_TORCH = "2.13"

#: from this torch on (where it was measured), the graphs run under Inductor's C++ wrapper (``cpp_wrapper``): the
#: 1-token step's ~240 kernel calls are made from C++, not from Python (~8 us each). SmolLM2, 1 thread, 128 greedy
#: tokens, both models in one process, 5 interleaved rounds: bf16 25.6 against 27.1 ms a token, fp32 47.4 against 50.6,
#: the same tokens; the wrapper's C++ costs 25-40 s more at the first compile of a model's shapes (then cached)
CPP_WRAPPER_FROM_TORCH = "2.13"

#: the GEMM backends offered to the autotuner before :data:`CPP_ONLY_FROM_TORCH`. torch 2.8 with both: SmolLM2 fp32
#: decodes at 28 tok/s (stock 16; ATen's kernels alone 13, slower than our eager decoder's 16), but for some tiny
#: models its C++ template emits a kernel that does not compile (an unclosed function, seen as errors in the headers
#: that follow it); the step then falls back to the eager decoder, logged. The tests offer ATen's alone there.
GEMM_BACKENDS_BEFORE_CPP_ONLY = "ATEN,CPP"

#: rows per block of keys of SDPA's CPU kernel (flash attention, torch 2.8 and 2.13) from this many keys on; below it,
#: all the keys are one block. Rows of a block that is wholly masked change no bit of the output, so an attention
#: length that is a multiple of this gives the same bits whatever multiple it is: measured, 0 of 1,089 (length,
#: position) pairs differed in each of five cases (key/value heads x query heads per key/value head: 3 x 3, 2 x 6
#: with head size 128, 2 x 7 and 8 x 4 in fp32, 3 x 3 in bf16; torch 2.13 on 1 thread, torch 2.8 on 2), while below it
#: 24 of 79 multiples of 64 differed
ATTENTION_BLOCK = 512

#: the exact fp32 graphs hand SDPA's CPU kernel a multiple of this many query rows per key/value head. The kernel
#: multiplies blocks of query rows (one per head of a key/value group and token) with a BLAS GEMM, and a BLAS may round
#: a product of a few rows otherwise than the same rows among more (or split few rows between threads otherwise): a
#: 1-token graph with 1-3 query heads per key/value head would then differ from the 4-token graph, whose blocks hold
#: 4 rows per head, and the chunk check would turn verification off. Rows padded to a multiple of 4 (copies of the
#: last one, :func:`attention_query_rows`) round alike in both graphs; the exact graphs pad where
#: :func:`attention_rows_round_alike` finds at load that the kernel needs it. Where and why this was seen, and what
#: it costs: docs/assisted-generation.md ("Attention's query rows"), benchmarks/chunk_exactness.py
ATTENTION_ROW_MULTIPLE = 4

#: the exact graphs' own Inductor kernels (norms, rotary, softmax's neighbours; the GEMMs, our GGUF kernels and SDPA
#: keep their threads) never split a loop between threads (``cpp.min_chunk_size``, the work each thread must get first,
#: set beyond any tensor's size). With 2 or more threads Inductor splits a reduction whose outer loops have fewer rows
#: than threads (a 1-token graph's RMSNorm over a hidden size of 1024 or more) between the threads, which sum their
#: parts in another order than the 4-token graph, whose rows it splits instead; the check at the chunk graph's compile
#: then turned verification off (docs/assisted-generation.md, "Inductor's parallel reductions")
SERIAL_KERNELS_MIN_CHUNK = 2 ** 62

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
            a dtype other than fp32 and bf16; a torch older than
            :data:`MIN_TORCH_FOR_COMPILE`; dense bf16 weights on a CPU without oneDNN bf16
            (:func:`dense_bf16_compile_unsupported`).
    """
    if backend != "torch":
        raise ValueError("torch_compile=True compiles our pure-PyTorch decoder's step; this model runs on IPEX's "
                         "fused graphs. Pass backend='torch', or drop torch_compile.")
    if not TorchCausalLMDecoder.supports(model):
        raise ValueError(f"torch_compile=True needs an architecture our decoder runs; {type(model).__name__} runs on "
                         "transformers' forward. Drop torch_compile.")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"torch_compile=True compiles fp32 and bf16 models (got {dtype}): load the checkpoint with "
                         "torch_dtype=torch.float32 or torch.bfloat16, or drop torch_compile.")
    if not torch_at_least(MIN_TORCH_FOR_COMPILE):
        raise ValueError(f"torch_compile=True needs torch >= {MIN_TORCH_FOR_COMPILE} (Inductor's CPU bf16 GEMM "
                         f"template); this is torch {torch.__version__}. Upgrade torch, or drop torch_compile.")
    unsupported = dense_bf16_compile_unsupported() if weights == "dense" and dtype == torch.bfloat16 else None
    if unsupported:
        raise ValueError(f"torch_compile=True: {unsupported}. Drop torch_compile (the eager bf16 decoder is exact), "
                         "or for a draft use self_draft(weights='int8', torch_compile=True).")


def exact_attention_length(needed: int, capacity: int) -> int:
    """The rows attention reads in the exact fp32 graph, for a call that needs ``needed`` rows (the cached ones, its
    own and its padding) on a cache of ``capacity`` rows: ``capacity - 1`` while that is at most
    :data:`ATTENTION_BLOCK` (the row left free keeps the length below the capacity; generate() sizes the capacity for
    the whole generation, so the length is the same in every call), else ``needed`` rounded up to a multiple of
    :data:`ATTENTION_BLOCK` (the kernel's blocks: any such length gives the same bits). Either way a token's
    logits do not depend on the call it comes in, and attention over a long capacity costs what the context does.

    Raises:
        ValueError: ``needed`` above ``capacity - 1`` (reserve the rows first)."""
    if needed > capacity - 1:
        raise ValueError(f"{needed} rows needed on a cache of {capacity}: reserve {needed + 1} first")
    if capacity - 1 <= ATTENTION_BLOCK:
        return capacity - 1
    return _whole_blocks(needed)


def attention_query_rows(rows: int) -> int:
    """The query rows per key/value head the exact fp32 graphs hand SDPA for ``rows`` (query heads per key/value head
    x tokens): ``rows`` rounded up to a multiple of :data:`ATTENTION_ROW_MULTIPLE` (the rows past ``rows`` are copies
    of the last one, their outputs dropped). The 4-token graph's rows are one already; a 1-token graph with 1-3 query
    heads per key/value head pays for 4, one with 5-7 for 8."""
    return -(-rows // ATTENTION_ROW_MULTIPLE) * ATTENTION_ROW_MULTIPLE


@torch.no_grad()
def attention_rows_round_alike(kv_heads: int, group: int, head_dim: int) -> bool:
    """Whether SDPA's CPU kernel, here and at the current thread count, gives a token's ``group`` query rows per
    key/value head the same bits alone (the 1-token graph's call, unpadded) as among :data:`CHUNK_ROWS` tokens' (the
    4-token graph's): the exact fp32 graphs pad their rows (:func:`attention_query_rows`) only where it does not. The
    kernel's rounding is a matter of its code path (MKL's for a few rows, its split between threads), not of the
    values: seeded random ones at the model's geometry. The 4-token graph's compile still checks
    the whole graphs (:meth:`CompiledDecodeStep.compile_chunk`)."""
    gen = torch.Generator().manual_seed(0)
    tokens, keys = CHUNK_ROWS, 15
    query = torch.randn(1, kv_heads, group, tokens, head_dim, generator=gen)  # [.., head of a group, token, ..]
    cache = torch.randn(2, 1, kv_heads, keys + 1, head_dim, generator=gen)  # the graphs read a part of their cache
    key, value = cache[0].narrow(2, 0, keys), cache[1].narrow(2, 0, keys)
    allowed = torch.arange(keys)[None, :] <= torch.arange(tokens)[:, None] + keys - tokens  # [token, key]
    chunk = F.scaled_dot_product_attention(
        query.reshape(1, kv_heads, group * tokens, head_dim), key, value,
        attn_mask=allowed[None].expand(group, -1, -1).reshape(1, 1, group * tokens, keys), scale=head_dim ** -0.5)
    chunk = chunk.reshape(1, kv_heads, group, tokens, head_dim)
    for token in range(tokens):
        alone = F.scaled_dot_product_attention(query[:, :, :, token].contiguous(), key, value,
                                               attn_mask=allowed[token].expand(1, 1, group, keys),
                                               scale=head_dim ** -0.5)
        if not torch.equal(alone, chunk[:, :, :, token]):
            return False
    return True


def _whole_blocks(rows: int) -> int:
    """``rows`` rounded up to a multiple of :data:`ATTENTION_BLOCK`."""
    return -(-rows // ATTENTION_BLOCK) * ATTENTION_BLOCK


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T + b`` on a projection's own weight and bias: Inductor picks the kernel (a head that
    :class:`~optimum_ipex_spec.backends.dense_weights.DenseLinear` serves in eager mode is multiplied the same way); a
    GGUF layer's own kernel, an operator Inductor calls as it is."""
    if isinstance(module, GGUFLinear):
        return module(x)
    return F.linear(x, module.weight, module.bias)


class _Int8Projection(torch.nn.Module):
    """An :class:`~optimum_ipex_spec.backends.pytorch.int8_weights.Int8Weight` (its tensors as buffers, not copied) and
    a bias, as a module Inductor can freeze: ``x [..., in]`` bf16 -> ``[..., out]`` bf16."""

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
    """Logits ``[1, q, vocab]`` for ``q`` tokens (q static per graph: 1 or :data:`CHUNK_ROWS`), given the model's
    modules (and, for int8 weights, the decoder's packed matrices) and a cache's per-layer buffers."""

    def __init__(self, model: torch.nn.Module, num_heads: int, kv_heads: int, head_dim: int,
                 sliding_window: Optional[int], int8_layers: Optional[list] = None, int8_head=None):
        super().__init__()
        self.inner = model.model
        self.lm_head = model.lm_head
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.sliding_window = sliding_window
        #: SDPA's query rows padded (:func:`attention_query_rows`): set by CompiledDecodeStep, in the exact fp32 graphs
        #: where the kernel rounds the 1-token graph's rows otherwise (:func:`attention_rows_round_alike`)
        self.pad_query_rows = False
        self.int8 = int8_layers is not None
        if self.int8:  # per layer: fused q/k/v (+ bias), o, fused gate/up, down
            self.int8_layers = torch.nn.ModuleList(
                torch.nn.ModuleList([_Int8Projection(qkv, bias), _Int8Projection(o), _Int8Projection(gate_up),
                                     _Int8Projection(down)]) for qkv, bias, o, gate_up, down in int8_layers)
            self.lm_head = _Int8Projection(int8_head)
        #: dense fp32 or bf16 only, from :meth:`pack`: per layer the packed q, k, v, o, gate, up, down projections, and
        #: the head, which every graph traced after it multiplies with (:mod:`~optimum_ipex_spec.kernels.packed_gemm`)
        self.packed: Optional[torch.nn.ModuleList] = None
        self.packed_head: Optional[PackedLinear] = None

    def pack(self, adopt=None) -> None:
        """Packed copies of the fp32 or bf16 projections and head
        (:class:`~optimum_ipex_spec.kernels.packed_gemm.PackedLinear`: one
        more copy of the weights, as Inductor's own GEMMs would hold, shared by every graph traced after this). With
        ``adopt`` (a :class:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder`) each layer's copies
        replace the model's own as soon as they are made (``adopt.adopt_packed_layer``, then ``adopt_packed_head``): the
        weights are never all held twice."""
        packed = []
        for index, layer in enumerate(self.inner.layers):
            packed.append(torch.nn.ModuleList(PackedLinear.of(m) for m in layer_projections(layer)))
            if adopt is not None:
                adopt.adopt_packed_layer(index, packed[-1])
        self.packed = torch.nn.ModuleList(packed)
        self.packed_head = PackedLinear.of(self.lm_head)
        self.lm_head = self.packed_head  # not the model's head module, which a model holding its weights once drops
        if adopt is not None:
            adopt.adopt_packed_head(self.packed_head)

    def forward(self, input_ids, position_ids, write_at, key_pos, keys, values):
        # input_ids, position_ids: int64 [1, q]; write_at: int64 [q] (the cache rows of these tokens); key_pos: int64
        # [n], 0 .. n - 1, the cache rows attention reads (n <= capacity); keys/values: per layer
        # [1, kv_heads, capacity, head_dim]
        inner, heads, kv_heads, dim = self.inner, self.num_heads, self.kv_heads, self.head_dim
        q = input_ids.shape[1]
        group = heads // kv_heads
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        n = key_pos.shape[0]
        allowed = key_pos[None, :] <= write_at[:, None]  # [q, n]: causal over the cache rows
        if self.sliding_window is not None:
            allowed = allowed & (key_pos[None, :] > write_at[:, None] - self.sliding_window)
        # one query row per (head of a key/value group, token): the mask repeats per head of the group
        mask = allowed[None].expand(group, q, -1).reshape(1, 1, group * q, -1)
        rows = group * q
        # exact fp32: SDPA's query rows in fours (its GEMMs round a piece of 1-3 rows otherwise): copies of the last
        # row, with its mask, fill them up, and their outputs are dropped (attention_query_rows)
        pad = attention_query_rows(rows) - rows if self.pad_query_rows else 0
        if pad:
            mask = torch.cat([mask, mask[:, :, -1:].expand(1, 1, pad, -1)], dim=2)
        # the packed weights where there are some (Inductor's GEMMs on the model's weights otherwise)
        packed = self.packed is not None
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            if self.int8:
                qkv_m, o_m, gate_up_m, down_m = self.int8_layers[index]
                query, key, value = qkv_m(x).split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            elif packed:
                q_p, k_p, v_p, o_p, gate_p, up_p, down_p = self.packed[index]
                query, key, value = q_p(x), k_p(x), v_p(x)
            else:
                query, key, value = _linear(attn.q_proj, x), _linear(attn.k_proj, x), _linear(attn.v_proj, x)
            query = query.view(1, q, heads, dim).transpose(1, 2)
            key = key.view(1, q, kv_heads, dim).transpose(1, 2)
            value = value.view(1, q, kv_heads, dim).transpose(1, 2)
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            keys[index].index_copy_(2, write_at, key)
            values[index].index_copy_(2, write_at, value)
            # the heads that share a key/value head are rows of one query (grouped-query attention): SDPA's own
            # GQA path falls back to its slow math kernel on CPU
            query = query.reshape(1, kv_heads, rows, dim)
            if pad:
                query = torch.cat([query, query[:, :, -1:].expand(1, kv_heads, pad, dim)], dim=2)
            out = F.scaled_dot_product_attention(query, keys[index].narrow(2, 0, n), values[index].narrow(2, 0, n),
                                                 attn_mask=mask, scale=dim ** -0.5)
            if pad:
                out = out[:, :, :rows]
            # [1, kv_heads, group, q, dim] -> [1, q, heads * dim] (query head = key/value head * group + g)
            out = out.reshape(1, kv_heads, group, q, dim).permute(0, 3, 1, 2, 4).reshape(1, q, heads * dim)
            mlp = layer.mlp
            if self.int8:
                hidden = hidden + o_m(out)
                gate, up = gate_up_m(layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
                hidden = hidden + down_m(mlp.act_fn(gate) * up)
            elif packed:
                hidden = hidden + o_p(out)
                x = layer.post_attention_layernorm(hidden)
                hidden = hidden + down_p(mlp.act_fn(gate_p(x)) * up_p(x))
            else:
                hidden = hidden + _linear(attn.o_proj, out)
                x = layer.post_attention_layernorm(hidden)
                hidden = hidden + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))
        hidden = inner.norm(hidden)
        if packed:
            return self.packed_head(hidden)
        return self.lm_head(hidden) if self.int8 else _linear(self.lm_head, hidden)


class CompiledDecodeStep:
    """A Llama-family model's decode step (one token) and verification step (:data:`CHUNK_ROWS` tokens) on a
    :class:`PreallocatedKVCache`, compiled by Inductor.

    Args:
        decoder: the :class:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder` of an fp32 or bf16 model:
            its model's modules (dense weights) or its int8 matrices are used, not copied; its attention geometry and
            window.

    :meth:`compile` compiles the one-token graph (tens of seconds: SmolLM2-135M about a minute on 1 thread, half that
    in fp32 on the packed kernel; the verification graph, at the first chunk or :meth:`compile_chunk`, 14 s in fp32 on
    the packed kernel, as long in bf16; the autotuning results are cached on disk, ``TORCHINDUCTOR_CACHE_DIR``, the
    frozen graph is not: a later process compiles again, faster) and returns False, logging why, when this machine
    cannot (no C++ compiler, an Inductor error, e.g. for a dynamic rope type): the caller then keeps its eager decoder.
    Changing ``torch.set_num_threads`` or deterministic algorithms between calls recompiles (seconds to a minute).
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
        self._compiled = torch.compile(self.module, fullgraph=True, options=_guard_options())
        # the settings this torch has (older releases lack the reporting switches)
        self._settings = {k: v for k, v in INDUCTOR_SETTINGS.items() if hasattr(torch._inductor.config, k)}
        self._settings["max_autotune_gemm_backends"] = (
            "CPP" if torch_at_least(CPP_ONLY_FROM_TORCH) else GEMM_BACKENDS_BEFORE_CPP_ONLY)
        if torch_at_least(CPP_WRAPPER_FROM_TORCH) and hasattr(torch._inductor.config, "cpp_wrapper"):
            self._settings["cpp_wrapper"] = True
        #: seconds the first compile took (None before :meth:`compile`)
        self.compile_seconds: Optional[float] = None
        #: whether attention reads the lengths of :func:`exact_attention_length` (the exact fp32 graphs: a token's
        #: logits then do not depend on the call it comes in, as the kernel's rounding depends on the rows it reads,
        #: masked ones included) rather than the filled rows (bf16 and int8)
        self.exact = self.dtype == torch.float32 and not int8
        cpp = getattr(torch._inductor.config, "cpp", None)
        if self.exact and hasattr(cpp, "min_chunk_size"):
            self._settings["cpp.min_chunk_size"] = SERIAL_KERNELS_MIN_CHUNK
            if hasattr(cpp, "dynamic_threads"):  # else one loop is split whatever the chunk size
                self._settings["cpp.dynamic_threads"] = False
        # SDPA's query rows in fours where the kernel rounds the 1-token graph's otherwise (attention_query_rows)
        self.module.pad_query_rows = self.exact and not attention_rows_round_alike(
            decoder.kv_heads, decoder.num_heads // decoder.kv_heads, decoder.head_dim)
        #: dense weights (fp32 or bf16, not int8 or GGUF blocks): the graphs can multiply with the packed kernel
        self.dense = decoder.weights == "dense"
        #: rows of the graph a single token runs on: 1, its own static graph (Inductor picks each GEMM's blocking for
        #: one row), except in the exact fp32 step where ATen's kernels are offered to the autotuner too (before
        #: CPP_ONLY_FROM_TORCH): MKL's one-row and few-row products round differently, so a token runs padded on the
        #: CHUNK_ROWS-token graph, one graph for both (its logits the same bits decoded alone or verified)
        self.step_rows = CHUNK_ROWS if self.exact and self._settings["max_autotune_gemm_backends"] != "CPP" else 1
        #: seconds the CHUNK_ROWS-token graph took to compile (None until the first chunk)
        self.chunk_compile_seconds: Optional[float] = None
        #: exact fp32 only: whether the chunk graph gives each row the same bits as the graph single tokens run on
        #: (checked when it compiles, :meth:`_chunk_matches_steps`; True when that is the same graph); False: chunks run
        #: one token at a time on the 1-token graph
        self.chunk_exact: Optional[bool] = True if self.step_rows == CHUNK_ROWS else None
        #: what multiplies the graphs' weights: "inductor" (its GEMM templates, each graph its own packed copy), or
        #: "packed" (fp32 or bf16 dense weights with single tokens on a graph of their own, where
        #: :func:`~optimum_ipex_spec.kernels.packed_gemm.packed_gemm_available` for the dtype: one packed copy for both
        #: graphs, read as fast for 4 rows as for 1, and each row the same bits in either graph by construction)
        self.kernel = "inductor"

    def generation_capacity(self, tokens: int) -> int:
        """The cache capacity a generation of ``tokens`` tokens in all (prompt and new tokens) needs, so that it never
        grows inside the generation: room for the last call's padding rows and the row kept free, and in the exact
        fp32 graph above :data:`ATTENTION_BLOCK` rows for the last call's rounded-up length
        (:func:`exact_attention_length`)."""
        rows = tokens + CHUNK_ROWS - 1
        if not self.exact or rows <= ATTENTION_BLOCK:
            return rows + 1
        return _whole_blocks(rows) + 1

    def generation_capacities(self, first: int, tokens: int) -> Tuple[int, int]:
        """``(capacity, growth limit)`` of the cache of a generation of ``tokens`` tokens in all (prompt and new
        tokens) whose cache would start at ``first`` rows
        (:func:`~optimum_ipex_spec.backends.pytorch.cache.first_capacity`);
        the limit is :meth:`generation_capacity`. In the exact fp32 graph, while that is at most
        :data:`ATTENTION_BLOCK` + 1 rows, attention reads the whole capacity (bar one row) in every call: the cache
        gets all of it at once and never grows (a growth would change the last bits of the tokens after it, and
        at another token in plain decoding than in a verification chunk). Past that, attention reads the filled
        rows in whole blocks whatever the capacity: the cache starts above :data:`ATTENTION_BLOCK` + 1 rows (so
        that it reads whole blocks from the first call) and grows with the tokens, as bf16 and int8 caches do
        from ``first``; memory then does not depend on ``max_new_tokens``."""
        whole = self.generation_capacity(tokens)
        if self.exact and whole - 1 <= ATTENTION_BLOCK:
            return whole, whole
        return (max(first, ATTENTION_BLOCK + 2) if self.exact else first), whole

    @staticmethod
    def applies(batch: int, q: int, past: int, unpadded: bool) -> bool:
        """True for the calls this step serves: batch 1, no padding, and one token or a chunk on a non-empty cache
        (speculative decoding's verification, a draft's catch-up). A prefill (empty cache) stays on the eager
        decoder, as plain generation's does."""
        return batch == 1 and unpadded and (q == 1 or past > 0)

    def _scratch_cache(self) -> PreallocatedKVCache:
        """A small cache of this model's geometry (16 rows) for compiling and checking the graphs."""
        return PreallocatedKVCache(self.num_layers, 1, self.kv_heads, self.head_dim, self.dtype, capacity=16)

    def _scratch_run(self, rows: int) -> None:
        """Compile the graph of ``rows`` tokens on a small scratch cache whose capacity is marked dynamic."""
        cache = self._scratch_cache()
        for buffer in cache.keys + cache.values:
            torch._dynamo.mark_dynamic(buffer, 2)  # any capacity runs the same graph
        self._run([0] * rows, 0, cache, rows, scratch=True)

    def pack(self, adopt=None) -> bool:
        """Pack the dense weights for :mod:`~optimum_ipex_spec.kernels.packed_gemm`'s kernel (once; fp32 or bf16 with
        single tokens on a graph of their own, where the kernel builds for the dtype): True when the graphs will
        multiply with it (:attr:`kernel` ``"packed"``). :meth:`compile` does it first; call it ahead with ``adopt`` (the
        model's :class:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder`) to hand the packed copies to
        the model, layer by layer, before the graphs are traced (the runner does in fp32)."""
        if self.kernel != "packed" and self.dense and self.step_rows == 1 and packed_gemm_available(self.dtype):
            self.module.pack(adopt)
            self.kernel = "packed"
        return self.kernel == "packed"

    def compile(self) -> bool:
        """Compile the graph single tokens run on (:attr:`step_rows` tokens) on a small scratch cache; True when it
        worked (then :attr:`compile_seconds` is set). Where that is not the :data:`CHUNK_ROWS`-token graph, that one
        compiles at the first chunk (:meth:`compile_chunk`). The graphs multiply with
        :mod:`~optimum_ipex_spec.kernels.packed_gemm`'s kernel where it builds (:meth:`pack`, :attr:`kernel`); if the
        compile fails the step drops its packed copies."""
        self.pack()
        self.compile_seconds = self._compile_graph(self.step_rows, "decode step")
        if self.compile_seconds is None:
            self.module.packed = self.module.packed_head = None  # the eager decoder runs: no packed copy held
            self.kernel = "inductor"
            return_freed_memory()
            return False
        logger.info("Compiled the %s decode step with torch.compile in %.1f s.", dtype_name(self.dtype),
                    self.compile_seconds)
        return True

    def compile_chunk(self) -> bool:
        """Compile the :data:`CHUNK_ROWS`-token graph (once; tens of seconds, logged); True when it is there. False,
        logged, with :attr:`failed` set, when it cannot be compiled (the caller then runs its eager decoder).
        :meth:`__call__` does this at the first chunk; call it ahead to keep that time out of a generation.

        In the exact fp32 step the new graph is then checked against the 1-token one (:meth:`_chunk_matches_steps`):
        where a row's logits differ in any bit, chunks run one token at a time on the 1-token graph from then on
        (:attr:`chunk_exact` False, logged): still the target's own greedy tokens, but a verification then costs a
        step per token, so drafting does not pay."""
        if self.chunk_compile_seconds is not None:
            return True
        if self.step_rows == CHUNK_ROWS:  # one graph serves both
            self.chunk_compile_seconds = 0.0
            return True
        logger.info("Compiling the %d-token chunk step with torch.compile (once per model; "
                    "model.compile_chunk_step() does it ahead)...", CHUNK_ROWS)
        self.chunk_compile_seconds = self._compile_graph(CHUNK_ROWS, f"{CHUNK_ROWS}-token chunk step")
        if self.chunk_compile_seconds is None:
            return False
        logger.info("Compiled the %d-token verification step in %.1f s.", CHUNK_ROWS, self.chunk_compile_seconds)
        if self.exact:
            self.chunk_exact = self._chunk_matches_steps()
            if not self.chunk_exact:
                logger.warning(
                    "The compiled %d-token graph rounds differently from the 1-token graph here (torch %s, %s): "
                    "verification runs one token per call instead, so that speculative decoding still returns the "
                    "target's own greedy tokens; drafting will not pay (the cost model will stop proposing). "
                    "Load the target without torch_compile for speculative decoding.", CHUNK_ROWS,
                    torch.__version__, torch.backends.cpu.get_cpu_capability())
        return True

    def _chunk_matches_steps(self) -> bool:
        """Whether the :data:`CHUNK_ROWS`-token graph gives every row the same logits, bit for bit, as the 1-token
        graph gives that token decoded alone: both run on two scratch caches, the chunk graph on a full chunk and on
        a padded one. Inductor compiles each graph for its own row count (a static shape: its GEMM blockings, its
        fusions); with torch 2.13 on AVX512 the kernels reduce each row alike (SDPA's where the 1-token graph's query
        rows are padded as :func:`attention_rows_round_alike` found needed), which this checks on the machine that
        runs them."""
        vocab = self.vocab_size
        tokens = [(7919 * i + 13) % vocab for i in range(1 + CHUNK_ROWS + 2)]
        caches = [self._scratch_cache() for _ in range(2)]
        steps = torch.cat([self._run([token], i, caches[0], 1) for i, token in enumerate(tokens)], dim=1)
        first = self._run(tokens[:1], 0, caches[1], 1)
        full = self._run(tokens[1:1 + CHUNK_ROWS], 1, caches[1], CHUNK_ROWS)
        padded = self._run(tokens[1 + CHUNK_ROWS:], 1 + CHUNK_ROWS, caches[1], CHUNK_ROWS)
        return torch.equal(torch.cat([first, full, padded], dim=1), steps)

    def _compile_graph(self, rows: int, what: str) -> Optional[float]:
        """Compile the ``rows``-token graph on a scratch cache; the seconds it took, or None when Inductor could not
        (logged as the ``what`` that falls back to the eager decoder; :attr:`failed` set)."""
        start = time.perf_counter()
        try:
            self._scratch_run(rows)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds (no compiler, codegen, a backend error)
            logger.warning("torch.compile could not compile the %s here (%s: %s); decoding on the eager decoder "
                           "instead.", what, type(exc).__name__, _first_line(exc))
            self.failed = True
            return None
        seconds = time.perf_counter() - start
        return_freed_memory()  # compiling frees 0.1-0.25 GiB of temporaries (SmolLM2) that the heap would keep
        return seconds

    def __call__(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor,
                 cache: PreallocatedKVCache) -> Optional[torch.Tensor]:
        """Logits ``[1, q, vocab]`` (the model's dtype) for ``input_ids`` int64 ``[1, q]`` at ``position_ids``
        int64 ``[1, q]``; writes their keys/values at rows ``cache.length ..`` and advances the cache by ``q``.
        One token runs the :attr:`step_rows`-token graph; a chunk runs the :data:`CHUNK_ROWS`-token graph in pieces,
        a short piece padded (its last token repeated at the next rows, which the cache then does not count and later
        tokens overwrite), or, in the exact fp32 step where that graph rounds otherwise (:attr:`chunk_exact` False),
        one token at a time on the 1-token graph.
        None (logged once, and :attr:`failed` set) when a compiled call fails: the caller runs its eager decoder.

        Raises:
            ValueError: ids that are not integers or outside the vocabulary; position_ids of another shape; a
                cache built for another model (layers, dtype, key/value heads or head size).
        """
        if input_ids.dtype not in (torch.int64, torch.int32) or input_ids.dim() != 2 or input_ids.shape[0] != 1 \
                or tuple(position_ids.shape) != tuple(input_ids.shape):
            raise ValueError(f"the compiled step takes integer input_ids [1, q] and position_ids of the same shape; "
                             f"got input_ids {input_ids.dtype} {tuple(input_ids.shape)}, position_ids "
                             f"{tuple(position_ids.shape)}")
        tokens = input_ids[0].tolist()
        if not all(0 <= token < self.vocab_size for token in tokens):
            raise ValueError(f"token ids {tokens} are outside the vocabulary (0 .. {self.vocab_size - 1})")
        if (len(cache.keys), cache.dtype, cache.kv_heads, cache.head_dim) != (
                self.num_layers, self.dtype, self.kv_heads, self.head_dim):
            raise ValueError(f"this cache holds {len(cache.keys)} layers of {cache.kv_heads} x {cache.head_dim} "
                             f"{cache.dtype} keys/values; the model needs {self.num_layers} layers of {self.kv_heads} "
                             f"x {self.head_dim} {self.dtype}: build it with model.new_cache(), or let generate()")
        first = int(position_ids[0, 0])
        try:
            if len(tokens) == 1:
                return self._run(tokens, first, cache, self.step_rows)
            if not self.compile_chunk():  # logged; failed is set
                return None
            rows = 1 if self.chunk_exact is False else CHUNK_ROWS  # a chunk graph that rounds otherwise: token by token
            pieces = [self._run(tokens[i:i + rows], first + i, cache, rows) for i in range(0, len(tokens), rows)]
            return torch.cat(pieces, dim=1)
        except Exception as exc:  # noqa: BLE001 - e.g. a recompile Inductor cannot do, at the recompile limit
            logger.warning("The compiled decode step failed (%s: %s); decoding on the eager decoder from now on.",
                           type(exc).__name__, _first_line(exc))
            self.failed = True
            return None

    @torch.no_grad()
    def _run(self, tokens: list, position: int, cache: PreallocatedKVCache, rows: int,
             scratch: bool = False) -> torch.Tensor:
        """Logits ``[1, len(tokens), vocab]`` of the ``rows``-token graph for ``tokens`` (at most ``rows``; padded
        with the last one) at positions ``position ..``; the cache advances by ``len(tokens)``. ``scratch``: the
        compiling run, whose attention length is marked dynamic."""
        q, past = len(tokens), cache.length
        # room for the padding rows too; an attention length of 1 would be a graph of its own (Dynamo specializes 0
        # and 1). The length stays below the capacity: the graph was traced on a strict part of the buffers, and the
        # whole of them would recompile it (a contiguity guard)
        length = max(past + rows, 2)
        cache.reserve(length + 1)
        if self.exact:
            length = exact_attention_length(length, cache.capacity)
            cache.reserve(length + 1)
        key_pos = torch.arange(length)
        if scratch:
            torch._dynamo.mark_dynamic(key_pos, 0)  # any length runs the same graph
        padded = tokens + tokens[-1:] * (rows - q)
        # autocast off: the step is in the model's dtype already, and an autocast region would be another graph.
        # Static row counts: Dynamo would otherwise compile the second graph (another row count of the same code) with
        # a symbolic one, whose kernels round rows otherwise and run slower; the capacity and attention length are
        # dynamic by their marks, as before
        with torch._inductor.config.patch(self._settings), torch._dynamo.config.patch(automatic_dynamic_shapes=False), \
                torch.autocast("cpu", enabled=False):
            # fresh tensors: generate() passes slices whose strides differ, and a new stride recompiles
            logits = self._compiled(torch.tensor([padded]), torch.arange(position, position + rows)[None],
                                    torch.arange(past, past + rows), key_pos, cache.keys, cache.values)
        cache.advance(q)
        return logits if q == rows else logits[:, :q]


def _guard_options() -> Optional[dict]:
    """``torch.compile`` options that drop Dynamo's guards on the step's modules (their attributes and weights), kept
    on its inputs (shapes, strides, dtypes: what picks the 1-token or the chunk graph) and on global state. The guards
    cost about 1 ms a call (SmolLM2, 30 layers: 4% of a bf16 draft step) and protect nothing here: the modules are
    ours and never change, and freezing has folded the weights into the graph anyway (a weight changed in place
    would not reach it either way). Nor can another model's graph be picked without them: each step's ``forward`` is a
    code object of its own (:func:`_own_code`), and Dynamo keeps graphs per code object. None where this torch lacks
    the filter."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    return {"guard_filter_fn": skip} if skip is not None else None


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
