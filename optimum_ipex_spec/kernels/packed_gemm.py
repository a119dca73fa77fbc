"""A product of a few rows by a packed weight, fp32 or bf16, for the compiled graphs of
:mod:`~optimum_ipex_spec.backends.pytorch.compiled_step` (its 1-token decode step and its 4-token verification): the
weight read at the memory's speed, each output the same bits for any number of rows, one packed copy for both graphs.

Speculative decoding verifies :data:`~optimum_ipex_spec.backends.pytorch.compiled_step.CHUNK_ROWS` tokens in one call;
that pays only while 4 rows cost about what 1 does (the weights are read once either way). On an Intel Xeon with AMX (1
thread, about 12 GB/s from memory) Inductor's fp32 GEMM template read SmolLM2-135M's shapes at 14 GB/s for one row but
8.6 GB/s for four (a 1536 x 576 weight: 254 against 411 us), and MKL's at 5.9 GB/s: a 4-token verification cost 1.6
decode steps. The same register blocking with a software prefetch of the weight 16 rows of ``k`` ahead reads four rows
at 12.4 GB/s (285 us; 30 layers of SmolLM2's shapes, compiled: 38.0 ms for 4 rows against Inductor's 49.3, its 1-row
graph 30.9). One row reads two blocks at a time instead, two weight streams without the software prefetch, which the
hardware prefetcher follows at the memory's speed (Qwen2.5-1.5B's shapes: 15.1-15.9 GB/s, MKL's 15.3, Inductor's 13.7).

Every fp32 output element is one chain of fused multiply-adds over ``k`` in order from zero, as in Inductor's
``CppMicroGemmFP32Vec`` (PyTorch, ``torch/_inductor/codegen/cpp_micro_gemm.py``: up to 4 rows x 48 columns of
accumulators), whatever the number of rows: a token verified in a chunk gets the bits the 1-token graph gives it
decoded alone. Both graphs then multiply with the same packed copy of the weights, the only one the process holds:
the runner hands the packed copies to the model
(:meth:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder.adopt_packed_layer`: its prefill and
transformers' forward multiply with them too, fp32 32-512 rows within 5% of ``F.linear``; a tied input embedding reads
the head's rows, :class:`PackedEmbedding`) and releases its own (Inductor's GEMM templates kept one per graph beside the
model's: a 1.5B target held its weights three times). The compiled step still checks the two graphs against each other
on the machine that runs them
(:meth:`~optimum_ipex_spec.backends.pytorch.compiled_step.CompiledDecodeStep.compile_chunk`).

bf16 (with AVX512-BF16) keeps each block's pairs of ``k`` side by side per column, the operand of ``vdpbf16ps``
(16 fp32 sums of two products each), rounded to bf16 once at the end as oneDNN's GEMMs do; one row reads four
blocks at once and 2-4 rows two, each prefetched 8 pairs of ``k`` ahead. 30 layers of SmolLM2's bf16 shapes and
its head, 1 thread (``benchmarks/packed_gemm_rows.py``): 17.7 ms for one row (15.2 GB/s; a plain ``sum`` over the
same bytes 17.0, ``F.linear`` 39.8; two blocks without a prefetch, as fp32 reads one row, gave 12.9 GB/s), 19.6 ms
for four (one block at a time gave 9.1 GB/s). Both bf16 graphs share its copy. A prefill (16 rows or more, ``k``
a multiple of 32) runs on AMX tiles where the CPU has AMX-BF16 and Linux grants the process its tile data
(:func:`packed_amx_available`): a block's 16 pairs of ``k`` x 16 columns is one B tile, and 16-512 rows ran as fast
as oneDNN's ``F.linear`` on the plain weights or faster (512 rows 22.9 against 23.0 ms, 16 rows 2.9 against 4.5;
``vdpbf16ps`` 1.6-6.7x slower), so a bf16 model then holds its weights packed only, as an fp32 one does; elsewhere
it keeps its own for the prefill.

It is a PyTorch operator (``torch.ops.optimum_ipex_spec.packed_mm``, with a fake implementation for tracing), built
from ``csrc/packed_gemm.cpp`` with ``torch.utils.cpp_extension.load`` at the first use (20-40 s; cached in
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``). It needs AVX-512 (and AVX512-BF16 for bf16) and a
C++ compiler with ninja, as Inductor does; where either is missing :func:`packed_gemm_available` says so (logged
once) and the graphs keep Inductor's GEMMs.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

#: compiler and linker flags for our C++ kernels: ATen's ``at::parallel_for`` is inline in its headers and runs the
#: whole range on the calling thread when an extension is built without OpenMP (torch's threads then go unused); the
#: extension links the ``libgomp.so.1`` that torch has already loaded
OPENMP = ["-fopenmp"]

#: output columns per block of the packed weight (three AVX-512 vectors of fp32)
BLOCK_N = 48

_SOURCE = Path(__file__).parent / "csrc" / "packed_gemm.cpp"


@functools.lru_cache(maxsize=None)
def _kernel_built() -> bool:
    """Build and load the operator (once per process; the build is cached on disk); False, logged, where it cannot be
    (needs AVX-512: checked by the caller)."""
    logger.info("Loading the packed kernel (built once per machine and torch, about 20-40 s; cached in "
                "TORCH_EXTENSIONS_DIR)...")
    try:
        from torch.utils.cpp_extension import load

        # the torch version in the name: two torch versions sharing one TORCH_EXTENSIONS_DIR keep a build each
        name = "optimum_ipex_spec_packed_gemm_v5_torch" + re.sub(r"\W", "_", torch.__version__)
        load(name, sources=[str(_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-mavx512f", "-mfma", *OPENMP], extra_ldflags=OPENMP, verbose=False)
        torch.library.register_fake("optimum_ipex_spec::packed_mm")(_packed_mm_shape)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja, a build error: all mean "not here"
        text = str(exc).strip().splitlines()
        logger.warning("Could not build the packed kernel (%s: %s); the compiled fp32 and bf16 graphs keep "
                       "Inductor's GEMMs, which read 4 rows about 1.6x slower than 1 on some CPUs and hold a copy "
                       "of the weights per graph.", type(exc).__name__, text[0] if text else "")
        return False
    return True


@functools.lru_cache(maxsize=None)
def packed_gemm_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when ``torch.ops.optimum_ipex_spec.packed_mm`` runs here for ``dtype`` (torch.float32: an AVX-512 CPU;
    torch.bfloat16: one with AVX512-BF16 too) and the operator is built (once per process; the build is cached on
    disk). False, logged once, where it cannot be, and for any other dtype."""
    what = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype)
    if what is None:
        return False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        logger.info("The packed %s kernel needs AVX-512 (this CPU: %s): the compiled %s graphs keep Inductor's "
                    "GEMMs.", what, capability, what)
        return False
    if dtype == torch.bfloat16 and not _avx512_bf16():
        logger.info("The packed bf16 kernel needs AVX512-BF16 (vdpbf16ps), which this CPU lacks: the compiled bf16 "
                    "graphs keep Inductor's GEMMs.")
        return False
    return _kernel_built()


@functools.lru_cache(maxsize=None)
def packed_amx_available() -> bool:
    """True when bf16 products of 16 rows or more (prefills) run on AMX tiles here (the CPU has AMX-BF16, the kernel
    is built, Linux granted the process AMX tile data): then a bf16 model can hold its weights packed only, its
    prefill as fast as oneDNN's on the plain weights. False, logged once, otherwise."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if not (check and check() and packed_gemm_available(torch.bfloat16)):
        return False
    if not torch.ops.optimum_ipex_spec.packed_mm_enable_amx():
        logger.info("Linux did not grant AMX tile data to this process: bf16 prefills keep the model's own weights.")
        return False
    return True


def _avx512_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def _packed_mm_shape(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight [out, in]`` in blocks of :data:`BLOCK_N` output columns (the last block padded with zero
    columns), each block read along ``k``:

    - fp32: ``[ceil(out / 48), in, 48]`` fp32;
    - bf16: ``[ceil(out / 48), ceil(in / 2), 96]`` bf16, per pair of ``k`` each column's two weights side by side
      (an odd ``in`` padded with a zero weight), the operand layout of AVX512-BF16's ``vdpbf16ps``.

    Raises:
        ValueError: not a 2-D fp32 or bf16 tensor.
    """
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack_weight takes a 2-D float32 or bfloat16 weight [out, in], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out_features, in_features = weight.shape
    weight = weight.detach()
    full, rest = divmod(out_features, BLOCK_N)
    if weight.dtype == torch.float32:
        # written in place: no temporary copy of the weight (a 1.5B model's head is 0.93 GB)
        packed = weight.new_empty(full + (rest > 0), in_features, BLOCK_N)
        packed[:full] = weight[:full * BLOCK_N].view(full, BLOCK_N, in_features).transpose(1, 2)
        if rest:
            packed[full].zero_()
            packed[full, :, :rest] = weight[full * BLOCK_N:].t()
        return packed
    pairs = (in_features + 1) // 2
    packed = weight.new_zeros(full + (rest > 0), pairs, BLOCK_N, 2)
    even = in_features - in_features % 2
    for start in range(0, out_features, BLOCK_N):  # block by block: no temporary copy of the whole weight
        block = weight[start:start + BLOCK_N]  # [columns, in]
        columns = block.shape[0]
        target = packed[start // BLOCK_N]
        target[:even // 2, :columns] = block[:, :even].reshape(columns, even // 2, 2).transpose(0, 1)
        if even < in_features:
            target[pairs - 1, :columns, 0] = block[:, even]
    return packed.view(packed.shape[0], pairs, 2 * BLOCK_N)


def unpack_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_weight`: ``[out_features, in_features]`` (a new tensor)."""
    blocks = packed.shape[0]
    if packed.dtype == torch.float32:
        columns = packed.transpose(1, 2).reshape(blocks * BLOCK_N, packed.shape[1])
    else:  # [blocks, pairs, 96] -> [blocks, 48, pairs * 2]
        pairs = packed.shape[1]
        columns = packed.view(blocks, pairs, BLOCK_N, 2).permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, 2 * pairs)
    weight = columns[:out_features, :in_features]
    # a tensor of its own (a row slice of the padded copy would keep the padding's storage, and make save_pretrained
    # copy it again)
    return weight.clone() if weight.untyped_storage().nbytes() > weight.nbytes else weight.contiguous()


class PackedLinear(torch.nn.Module):
    """``x @ W.T + b`` through ``torch.ops.optimum_ipex_spec.packed_mm`` on a packed copy of ``W`` (a buffer, which
    Inductor's freezing keeps as a constant of the graph): ``x [..., in]`` -> ``[..., out]``, fp32 or bf16 (the
    weight's dtype). Build it only where :func:`packed_gemm_available` is True for that dtype.

    Args:
        weight: ``[out, in]`` fp32 or bf16 (copied into the packed layout; the original is not kept).
        bias: ``[out]`` of the weight's dtype or None, added after the product (as Inductor's epilogue adds it).
    """

    def __init__(self, weight: torch.Tensor, bias=None):
        super().__init__()
        self.register_buffer("packed", pack_weight(weight))
        # a copy: a bias that views a memory-mapped checkpoint would keep the whole mapped file resident once the
        # weights are released (Qwen2.5's q/k/v biases: 1.9 GB of a 0.5B model's fp32 file)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = weight.shape
        #: the dtype the layout was packed for (a later ``.to(dtype)`` casts the buffer, not the layout)
        self.packed_dtype = weight.dtype
        # state_dict() (so a transformers model's save_pretrained) holds the plain ``weight [out, in]``
        self.register_state_dict_post_hook(_weight_in_state_dict)

    @classmethod
    def of(cls, linear: torch.nn.Module) -> "PackedLinear":
        """The packed form of an ``nn.Linear`` (a new copy), or ``linear`` itself when it is one already (a model
        that holds its weights packed: no second copy)."""
        return linear if isinstance(linear, cls) else cls(linear.weight, linear.bias)

    def unpacked_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` as ``nn.Linear`` holds it (a new tensor, e.g. for a checkpoint)."""
        return unpack_weight(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``, the weight's dtype.

        Raises:
            ValueError: ``x`` has another number of features.
            TypeError: the module was cast to another dtype after packing (``model.to(dtype)``).
        """
        _check_layout(self)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"this packed linear layer takes {self.in_features} input features, got x of shape "
                             f"{tuple(x.shape)}")
        out = torch.ops.optimum_ipex_spec.packed_mm(x, self.packed, self.out_features)
        return out if self.bias is None else out + self.bias


class PackedEmbedding(torch.nn.Module):
    """The input embedding of a model whose LM head is tied to it, read from the head's packed copy (the same tensor:
    no weight of its own): ``ids`` int64 ``[...]`` -> ``[..., hidden]`` in the head's dtype, the rows an
    ``nn.Embedding`` of the head's weight gives, bit for bit (one strided gather of ``hidden`` values per token).

    Args:
        head: the :class:`PackedLinear` of the tied head (``[vocab, hidden]``, no bias).
    """

    def __init__(self, head: PackedLinear):
        super().__init__()
        self.register_buffer("packed", head.packed)
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.packed_dtype = head.packed_dtype
        self.register_state_dict_post_hook(_weight_in_state_dict)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` int64 ``[...]`` -> ``[..., hidden]``.

        Raises:
            IndexError: an id outside ``0 .. num_embeddings - 1`` (as ``nn.Embedding``; the packed copy's padding
                columns would otherwise read as zero rows).
            TypeError: the module was cast to another dtype after packing.
        """
        _check_layout(self)
        return torch.ops.optimum_ipex_spec_py.packed_rows(self.packed, ids, self.embedding_dim, self.num_embeddings)


# An operator of its own, opaque to Inductor: traced as plain indexing, the gather let freezing fold a copy of the
# head beside the packed one (+0.4 GiB of RSS for SmolLM2) and the 4-token graph's logits differed from the
# 1-token graph's in their last bits (measured, torch 2.13)
@torch.library.custom_op("optimum_ipex_spec_py::packed_rows", mutates_args=())
def _packed_rows(packed: torch.Tensor, ids: torch.Tensor, width: int, rows: int) -> torch.Tensor:
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
        bad = int(flat.min()) if int(flat.min()) < 0 else int(flat.max())
        raise IndexError(f"token id {bad} is out of range for an embedding of {rows} rows (0..{rows - 1}): a "
                         "tokenizer with tokens the model's vocabulary does not have?")
    block, column = flat // BLOCK_N, flat % BLOCK_N  # 1-D indices: the rows come out as a new tensor
    if packed.dtype == torch.float32:  # [blocks, hidden, 48]
        out = packed[block, :, column]
    else:  # bf16: [blocks, pairs, 48, 2]
        blocks, pairs, _ = packed.shape
        out = packed.view(blocks, pairs, BLOCK_N, 2)[block, :, column].reshape(-1, 2 * pairs)[:, :width]
    return out.reshape(*ids.shape, width).contiguous()


@_packed_rows.register_fake
def _packed_rows_shape(packed: torch.Tensor, ids: torch.Tensor, width: int, rows: int) -> torch.Tensor:
    return packed.new_empty((*ids.shape, width))


def _check_layout(module: torch.nn.Module) -> None:
    if module.packed.dtype != module.packed_dtype:
        raise TypeError(f"this {type(module).__name__} was packed for {module.packed_dtype} and then cast to "
                        f"{module.packed.dtype} (model.to(dtype) after torch_compile=True packed its weights): load the "
                        "model again in the dtype you want instead")


#: per state dict being built (by ``id``, with a weak reference to it): its packed copies unpacked, by (packed copy,
#: shape). A tied head and its embedding read one packed copy, and their ``weight`` entries are then one tensor, as a
#: tied checkpoint holds them (transformers' ``save_pretrained`` writes a tied weight once only when both names share
#: storage). Scoped to one dict, so an address that a freed packed copy leaves to another never maps to its weights
_UNPACKED: dict = {}


def _unpacked_for(state: dict) -> Optional[dict]:
    """The memo of :data:`_UNPACKED` for ``state`` (dropped when ``state`` is), or None where ``state`` takes no weak
    reference (a plain ``dict`` given as ``destination``: no deduplication then)."""
    key = id(state)
    entry = _UNPACKED.get(key)
    if entry is not None and entry[0]() is state:
        return entry[1]
    try:
        ref = weakref.ref(state, lambda _, key=key: _UNPACKED.pop(key, None))
    except TypeError:
        return None
    _UNPACKED[key] = (ref, {})
    return _UNPACKED[key][1]


def _weight_in_state_dict(module: torch.nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """A state-dict post-hook: the packed copy as the ``weight`` an ``nn.Linear`` / ``nn.Embedding`` holds (a new
    tensor, the weight once more in memory while the dict lives; one tensor for the modules that share a packed copy).
    """
    packed = state.pop(prefix + "packed", None)
    if packed is None:
        return
    rows = getattr(module, "out_features", None) or module.num_embeddings
    columns = getattr(module, "in_features", None) or module.embedding_dim
    memo = _unpacked_for(state)
    key = (packed.data_ptr(), packed.dtype, rows, columns)
    weight = memo.get(key) if memo is not None else None
    if weight is None:
        weight = unpack_weight(packed, rows, columns)
        if memo is not None:
            memo[key] = weight
    state[prefix + "weight"] = weight
