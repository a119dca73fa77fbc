"""GGUF weights as the file ships them: the block-quantized tensors of a ``.gguf`` file, memory-mapped and multiplied
without ever being dequantized in memory, as a weight format of the pure-PyTorch decoder (``weights="gguf"``).

A CPU decode step reads every weight once, so its speed is the bytes it reads: Qwen2.5-Coder-1.5B's Q4_K_M file
holds 0.98 GB per token where its fp32 dequantization holds 6.2 GB. The kernel (``csrc/gguf_gemm.cpp``, built at the
first use with ``torch.utils.cpp_extension``, cached in ``TORCH_EXTENSIONS_DIR``) dequantizes each weight row once per
call into registers and L1, for all the rows of the call, and multiplies in fp32:

* "exact" mode: it computes the dequantized model's own function (each weight exactly the fp32 value gguf-py's
  ``gguf.quants.dequantize`` gives, so exactly the provisioned fp32 folder's weight; the sums in another order);
* every output row is the same chain of fused multiply-adds whatever the number of rows, so a token gets the same
  logits decoded alone as verified among draft tokens: speculative decoding over a GGUF target returns that target's
  own greedy tokens.

Block types: ggml's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, and F16 / F32 (:data:`BLOCK_TYPES`). Architectures: the
decoder's Llama family (GGUF ``llama``: SmolLM2; ``qwen2``: Qwen2.5). llama.cpp's converter permutes the rows of
``attn_q`` / ``attn_k`` of ``llama`` models for its rotary layout; whole rows move, so :func:`load_gguf_model` undoes it
on the quantized rows (as transformers' ``LlamaTensorProcessor`` does on dequantized ones).

The exact kernel has an AVX-512 build and an AVX2 one (``csrc/gguf_gemm_avx2.cpp``: the same bits, see
:func:`exact_kernel`). Where neither runs (no AVX2, no C++ compiler), :class:`GGUFLinear` multiplies through the PyTorch
reference (:func:`reference_mm`: gguf-py's dequantization, a bounded number of rows at a time, then ``torch.mv`` per
row; slow, logged once). The file is untrusted data: its header is parsed as data
(:mod:`~optimum_ipex_spec.kernels.gguf_header`; no code runs), every tensor's type, shape and byte range is checked
before use (:func:`read_gguf`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch

from ...kernels import CSRC
from ...kernels.gguf_header import GGUFError, read_header
from ...kernels.packed_gemm import OPENMP
from ...utils.memory import page_out

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockType:
    """A ggml tensor type: ``values`` weights per block, stored in ``bytes`` bytes."""

    name: str
    qtype: int  # gguf.GGMLQuantizationType
    values: int
    bytes: int


#: the block types the kernel multiplies, by ggml type id
BLOCK_TYPES: Dict[int, BlockType] = {t.qtype: t for t in (
    BlockType("F32", 0, 1, 4), BlockType("F16", 1, 1, 2), BlockType("Q4_0", 2, 32, 18), BlockType("Q4_1", 3, 32, 20),
    BlockType("Q5_0", 6, 32, 22), BlockType("Q8_0", 8, 32, 34), BlockType("Q4_K", 12, 256, 144),
    BlockType("Q5_K", 13, 256, 176), BlockType("Q6_K", 14, 256, 210),
)}

#: weight rows the reference path dequantizes at a time (bounds its temporary fp32 copy)
REFERENCE_ROWS = 1024

#: how a :class:`GGUFLinear` multiplies: "exact" (fp32 activations times the exact dequantized weights) or "fast"
#: (activations rounded to int8 per block, integer dot products, as llama.cpp does: its own outputs)
MODES = ("exact", "fast")
#: block types the fast kernel runs (F16 / F32 tensors, and rows not a multiple of 64 values, stay exact)
FAST_TYPES = (2, 3, 6, 8, 12, 13, 14)
#: block types the fast mode holds with 16 weight rows interleaved (``csrc/gguf_interleaved_layout.h``, multiplied by
#: ``gguf_interleaved_vnni.cpp`` or ``gguf_interleaved_avx2.cpp``), in layers of a multiple of 16 rows: every fast
#: type but Q5_K; a row of x, and the extra rows of a verification or a prefill, cost fewer instructions
INTERLEAVED_TYPES = (2, 3, 6, 8, 12, 14)


def ggml_type_name(type_id: int) -> str:
    """gguf-py's name of ggml type ``type_id`` ("Q2_K"), or the number where gguf-py knows no such type."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"{type_id} (unknown to gguf-py)"


def row_bytes(block: BlockType, k: int) -> int:
    """Bytes of one row of ``k`` values in ``block``'s type.

    Raises:
        GGUFError: ``k`` is not a multiple of the block's values (or of 16, which the kernel needs)."""
    if k % block.values or k % 16:
        raise GGUFError(f"a row of {k} values cannot be held in {block.name} blocks of {block.values} (and the "
                        "kernel needs a multiple of 16)")
    return k // block.values * block.bytes


# ----------------------------------------------------------------------------------------------- the kernel


def _mm_shape(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


def _mm_interleaved_shape(x: torch.Tensor, groups: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], 16 * groups.shape[0]))


def _deinterleave_shape(groups: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    return groups.new_empty((16 * groups.shape[0], row_bytes(BLOCK_TYPES[qtype], k)))


def _dequantize_shape(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    return blocks.new_empty((blocks.shape[0], k), dtype=torch.float32)


_CSRC = CSRC


@dataclass(frozen=True)
class Build:
    """One C++ extension of the GGUF kernels: its sources, the headers they include (not in torch's build hash, so
    their hash goes in the extension's name), the operator namespace it registers, compiler flags, the CPU flags (as
    /proc/cpuinfo names them) it needs, and the operators' shape functions for torch.compile."""

    sources: tuple
    headers: tuple
    namespace: str
    cflags: tuple
    cpu_flags: frozenset
    fakes: tuple  # (operator, shape function)


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
#: the exact kernel's builds, best first, by instruction set
EXACT_KERNELS = {
    "avx512": Build(("gguf_gemm.cpp",), ("gguf_formats.h", "gguf_panel.h"), "optimum_ipex_spec_gguf",
                    ("-mavx512f", "-mavx512bw", "-mfma", "-mf16c"), frozenset({"avx512f", "avx512bw", "fma", "f16c"}),
                    (("mm", _mm_shape), ("dequantize", _dequantize_shape))),
    "avx2": Build(("gguf_gemm_avx2.cpp",), ("gguf_formats.h", "gguf_panel.h"), "optimum_ipex_spec_gguf_avx2",
                  _AVX2_FLAGS, frozenset({"avx2", "fma", "f16c"}),
                  (("mm", _mm_shape), ("dequantize", _dequantize_shape))),
}
_LAYOUT_FAKES = (("mm_interleaved", _mm_interleaved_shape), ("deinterleave", _deinterleave_shape))
#: the fast mode's builds, best first, by instruction set, each with its kernel for the interleaved layout
FAST_KERNELS = {
    "avx512": Build(("gguf_gemm_vnni.cpp", "gguf_interleaved_vnni.cpp"),
                    ("gguf_formats.h", "gguf_activations.h", "gguf_interleaved_layout.h"),
                    "optimum_ipex_spec_gguf_vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma",
                                                    "-mf16c"),
                    frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"}),
                    (("mm", _mm_shape), *_LAYOUT_FAKES)),
    "avx2": Build(("gguf_fast_avx2.cpp", "gguf_interleaved_avx2.cpp"),
                  ("gguf_formats.h", "gguf_activations.h", "gguf_interleaved_layout.h"),
                  "optimum_ipex_spec_gguf_fast_avx2", _AVX2_FLAGS, frozenset({"avx2", "fma", "f16c"}),
                  (("mm", _mm_shape), *_LAYOUT_FAKES)),
}
#: the environment variable that picks the kernels: "auto" (the default: the best ones this CPU runs), "avx512",
#: "avx2" (the exact kernel, and the fast mode's, of that instruction set), or "reference" (the PyTorch reference, no
#: fast mode); tests use it to run each path on one machine
KERNEL_VARIABLE = "OPTIMUM_IPEX_SPEC_GGUF_KERNEL"


@functools.lru_cache(maxsize=None)
def _built(build: Build) -> bool:
    """Builds (once per machine and torch: cached in TORCH_EXTENSIONS_DIR) and loads ``build``; False, logged, where
    it cannot (no compiler or ninja, a build error)."""
    logger.info("Loading the GGUF kernel %s (built once per machine and torch, about 20-40 s; cached in "
                "TORCH_EXTENSIONS_DIR)...", build.namespace)
    try:
        from torch.utils.cpp_extension import load

        # the headers' hash and the torch version (two versions sharing one TORCH_EXTENSIONS_DIR keep a build each)
        # go in the name
        header = hashlib.sha256(b"".join((_CSRC / name).read_bytes() for name in build.headers)).hexdigest()[:12]
        name = f"{build.namespace}_v2_{header}_torch" + re.sub(r"\W", "_", torch.__version__)
        load(name, sources=[str(_CSRC / source) for source in build.sources], is_python_module=False, verbose=False,
             extra_cflags=["-O3", *build.cflags, "-ffp-contract=off", *OPENMP], extra_ldflags=OPENMP)
        for operator, shape in build.fakes:
            torch.library.register_fake(f"{build.namespace}::{operator}")(shape)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja, a build error: all mean "not here"
        text = str(exc).strip().splitlines()
        logger.warning("Could not build the GGUF kernel %s (%s: %s). Install a C++ compiler and ninja (pip install "
                       "ninja).", build.namespace, type(exc).__name__, text[0] if text else "")
        return False
    return True


def _wanted_kernel() -> str:
    wanted = os.environ.get(KERNEL_VARIABLE, "auto").strip().lower() or "auto"
    choices = ("auto", *EXACT_KERNELS, "reference")
    if wanted not in choices:
        raise ValueError(f"{KERNEL_VARIABLE}={wanted!r} is not one of {', '.join(choices)}: unset it to let the "
                         "package pick the fastest kernel this CPU runs")
    return wanted


@functools.lru_cache(maxsize=None)
def exact_kernel() -> Optional[str]:
    """The exact kernel that multiplies here: "avx512" (``torch.ops.optimum_ipex_spec_gguf``), "avx2"
    (``torch.ops.optimum_ipex_spec_gguf_avx2``: the same bits, slower), or None, logged once, where neither runs (no
    AVX2, no C++ compiler): :class:`GGUFLinear` then multiplies through :func:`reference_mm`. Decided once per
    process (the build cached on disk); :data:`KERNEL_VARIABLE` overrides the choice.

    Raises:
        ValueError: :data:`KERNEL_VARIABLE` holds an unknown name.
        RuntimeError: it names a kernel this CPU or build cannot run.
    """
    wanted = _wanted_kernel()
    if wanted == "reference":
        logger.warning("%s=reference: GGUF weights multiply through the PyTorch reference, many times slower.",
                       KERNEL_VARIABLE)
        return None
    flags = _cpu_flags()
    for isa, build in EXACT_KERNELS.items():
        if wanted not in ("auto", isa):
            continue
        missing = build.cpu_flags - flags
        if not missing and _built(build):
            return isa
        if wanted == isa:
            why = f"this CPU lacks {', '.join(sorted(missing))}" if missing else "it did not build (see the log)"
            raise RuntimeError(f"{KERNEL_VARIABLE}={isa}, but {why}: unset it, or set it to 'reference'")
    logger.warning("The GGUF kernel needs AVX2, FMA and F16C and a C++ compiler, which this machine lacks: GGUF "
                   "weights multiply through the PyTorch reference, many times slower.")
    return None


def gguf_kernel_available() -> bool:
    """True when an exact kernel runs here (:func:`exact_kernel`), False (logged once) where GGUF weights multiply
    through the PyTorch reference."""
    return exact_kernel() is not None


@functools.lru_cache(maxsize=None)
def fast_kernel() -> Optional[str]:
    """The fast mode's kernel here: "avx512" (AVX512-VNNI, ``torch.ops.optimum_ipex_spec_gguf_vnni``), "avx2"
    (``torch.ops.optimum_ipex_spec_gguf_fast_avx2``: the same integer sums), or None, logged once: the fast mode then
    multiplies as the exact one does. Both hold layers of :data:`INTERLEAVED_TYPES` in the interleaved layout, where
    the two give the same bits; on the file's rows (Q5_K, row counts not a multiple of 16) their fp32 sums run in
    another order. Decided once per process; :data:`KERNEL_VARIABLE` overrides it ("reference": None).

    Raises:
        ValueError: :data:`KERNEL_VARIABLE` holds an unknown name.
    """
    wanted = _wanted_kernel()
    if wanted == "reference":
        return None
    flags = _cpu_flags()
    for isa, build in FAST_KERNELS.items():
        if wanted in ("auto", isa) and build.cpu_flags <= flags and _built(build):
            return isa
    missing = FAST_KERNELS[wanted if wanted != "auto" else "avx2"].cpu_flags - flags
    why = (f"needs {', '.join(sorted(missing))}, which this CPU lacks" if missing
           else "kernel did not build (see the log)")
    logger.warning("The fast GGUF mode %s: GGUF weights multiply in the exact mode.", why)
    return None


def gguf_fast_available() -> bool:
    """True when the fast mode has a kernel here (:func:`fast_kernel`)."""
    return fast_kernel() is not None


#: where /proc/cpuinfo is not there (not Linux): the flags that torch's own CPU capability implies (no VNNI)
_CAPABILITY_FLAGS = {"AVX2": {"avx2", "fma", "f16c"}, "AVX512": {"avx2", "fma", "f16c", "avx512f", "avx512bw"}}


def _cpu_flags() -> set:
    """The CPU's flags as /proc/cpuinfo names them; elsewhere those torch's CPU capability implies."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set(_CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ()))


# ----------------------------------------------------------------------------------------------- the reference


def reference_dequantize(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``blocks`` uint8 ``[rows, row_bytes]`` -> fp32 ``[rows, k]``, by gguf-py's own dequantization
    (``gguf.quants.dequantize``, NumPy)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = blocks.contiguous().numpy()
    if qtype == 0:
        values = data.view(np.float32)
    elif qtype == 1:
        values = data.view(np.float16).astype(np.float32)
    else:
        values = dequantize(data, GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(blocks.shape[0], k))


def reference_mm(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``x [..., k]`` fp32 times the dequantized weight ``[rows, k]`` transposed -> ``[..., rows]``: the PyTorch
    reference of the kernel's ``mm``. :data:`REFERENCE_ROWS` weight rows are dequantized at a time, and each row of
    ``x`` is multiplied alone (``torch.mv``), so a row's bits do not depend on the other rows either."""
    flat = x.reshape(-1, k)
    out = x.new_empty((flat.shape[0], blocks.shape[0]))
    for start in range(0, blocks.shape[0], REFERENCE_ROWS):
        weight = reference_dequantize(blocks[start:start + REFERENCE_ROWS], qtype, k)
        for m in range(flat.shape[0]):
            out[m, start:start + weight.shape[0]] = torch.mv(weight, flat[m])
    return out.view(*x.shape[:-1], blocks.shape[0])


def exact_mm(kernel: Optional[str], x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``x [..., k]`` fp32 times the dequantized ``blocks`` (uint8 ``[rows, row_bytes]``) transposed -> ``[..., rows]``,
    by the exact ``kernel`` (:func:`exact_kernel`'s names), or :func:`reference_mm` for None."""
    if kernel == "avx512":
        return torch.ops.optimum_ipex_spec_gguf.mm(x, blocks, qtype, k)
    if kernel == "avx2":
        return torch.ops.optimum_ipex_spec_gguf_avx2.mm(x, blocks, qtype, k)
    return reference_mm(x, blocks, qtype, k)


def exact_dequantize(kernel: Optional[str], blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``blocks`` uint8 ``[rows, row_bytes]`` -> fp32 ``[rows, k]`` by the exact ``kernel``, or
    :func:`reference_dequantize` for None: the same values either way."""
    if kernel == "avx512":
        return torch.ops.optimum_ipex_spec_gguf.dequantize(blocks, qtype, k)
    if kernel == "avx2":
        return torch.ops.optimum_ipex_spec_gguf_avx2.dequantize(blocks, qtype, k)
    return reference_dequantize(blocks, qtype, k)


# ----------------------------------------------------------------------------------------------- modules


class GGUFLinear(torch.nn.Module):
    """``x @ W.T + b`` with ``W`` held as GGUF blocks: ``x [..., in]`` fp32 -> ``[..., out]`` fp32. The exact kernel
    :func:`exact_kernel` picks (AVX-512 or AVX2), else :func:`reference_mm`.

    In the fast mode a layer of :data:`INTERLEAVED_TYPES` with a multiple of 16 rows is held once, in the fast
    kernel's interleaved layout (16 rows per vector, the same bytes rearranged; a few percent more for Q4_K and
    Q6_K): the rows of a verification or a prefill then cost fewer instructions each. Any other layer holds the
    blocks as given (a view of the memory-mapped file, or the caller's tensor).

    Args:
        blocks: uint8 ``[out, row_bytes]``, each row ``in_features`` values in ``block``'s type.
        block: the :class:`BlockType`.
        in_features: values per row.
        bias: fp32 ``[out]`` or None.
        mode: "exact" or "fast" (:data:`MODES`); "fast" multiplies exactly where the fast kernel cannot run this
            layer (:data:`FAST_TYPES`, rows of a multiple of 64 values, :func:`fast_kernel`).

    Raises:
        GGUFError: ``blocks`` is not uint8 ``[out, row_bytes(block, in_features)]``.
        ValueError: an unknown ``mode``.
    """

    def __init__(self, blocks: torch.Tensor, block: BlockType, in_features: int, bias: Optional[torch.Tensor] = None,
                 mode: str = "exact"):
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(block, in_features):
            raise GGUFError(f"{block.name} blocks of rows of {in_features} values must be uint8 "
                            f"[out, {row_bytes(block, in_features)}], got {blocks.dtype} {tuple(blocks.shape)}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.register_buffer("bias", bias, persistent=False)
        self.block = block
        self.qtype = block.qtype
        self.in_features, self.out_features = in_features, blocks.shape[0]
        #: the exact kernel that multiplies ("avx512", "avx2") or None (the reference): decided once, a plain
        #: attribute, which torch.compile reads as a constant
        self.kernel = exact_kernel()
        #: the fast kernel that multiplies ("avx512", "avx2": mode "fast" where one runs this layer) or None
        self.fast_kernel = (fast_kernel() if mode == "fast" and block.qtype in FAST_TYPES and in_features % 64 == 0
                            else None)
        #: whether a fast kernel multiplies
        self.fast = self.fast_kernel is not None
        #: whether the layer is held in the interleaved layout (``groups``) instead of row-major ``blocks``
        self.interleaved = self.fast and block.qtype in INTERLEAVED_TYPES and self.out_features % 16 == 0
        if self.interleaved:
            groups = self._ops.interleave(blocks.contiguous(), self.qtype, in_features)
            self.register_buffer("row_major", None, persistent=False)
            self.register_buffer("groups", groups, persistent=False)
        else:
            self.register_buffer("row_major", blocks, persistent=False)
            self.register_buffer("groups", None, persistent=False)

    @property
    def _ops(self):
        """The fast kernel's operators (``mm``, ``interleave``, ``deinterleave``, ``mm_interleaved``)."""
        return getattr(torch.ops, FAST_KERNELS[self.fast_kernel].namespace)

    @property
    def blocks(self) -> torch.Tensor:
        """uint8 ``[out, row_bytes]``: the GGUF rows (of an interleaved layer: put back, a new tensor, byte for byte
        the rows it was given)."""
        if self.row_major is not None:
            return self.row_major
        return self._ops.deinterleave(self.groups, self.qtype, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 ``[len(ids), row_bytes]``: the GGUF rows ``ids`` (int64 ``[n]``), e.g. an embedding's lookups (of an
        interleaved layer: the group of 16 rows that holds each id put back, per id; shapes fixed by ``ids``'s, as
        torch.compile needs: no ``torch.unique``).

        Raises:
            IndexError: an id outside ``[0, out_features)``.
        """
        if self.row_major is not None:
            return self.row_major.index_select(0, ids)
        groups = self.groups.index_select(0, torch.div(ids, 16, rounding_mode="floor"))
        rows = self._ops.deinterleave(groups, self.qtype, self.in_features)
        return rows.index_select(0, torch.arange(ids.numel()) * 16 + ids % 16)

    def extra_repr(self) -> str:
        layout = ", interleaved" if self.interleaved else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.block.name}{layout}"

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` fp32 (a new tensor: what the blocks stand for)."""
        return exact_dequantize(self.kernel, self.blocks, self.qtype, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Raises:
            TypeError: ``x`` is not fp32 (GGUF weights run with fp32 activations).
            ValueError: ``x`` does not end in ``in_features``."""
        if x.dtype != torch.float32:
            raise TypeError(f"GGUF weights multiply fp32 activations, got {x.dtype}: load the model with "
                            "torch_dtype=torch.float32")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"this GGUF layer takes {self.in_features} input features, got x of shape "
                             f"{tuple(x.shape)}")
        if self.interleaved:
            out = self._ops.mm_interleaved(x, self.groups, self.qtype, self.in_features)
        elif self.fast:
            out = self._ops.mm(x, self.row_major, self.qtype, self.in_features)
        else:
            out = exact_mm(self.kernel, x, self.row_major, self.qtype, self.in_features)
        return out if self.bias is None else out + self.bias


class GGUFEmbedding(torch.nn.Module):
    """An input embedding held as GGUF blocks: ``ids`` int64 ``[...]`` -> ``[..., hidden]`` fp32, each row dequantized
    as it is looked up (the rows ``nn.Embedding`` of the dequantized table gives, bit for bit).

    Args:
        table: the :class:`GGUFLinear` of the table (``[vocab, hidden]``); a tied LM head is the same module.
    """

    def __init__(self, table: GGUFLinear):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(ids.reshape(-1))
        values = exact_dequantize(self.table.kernel, rows, self.table.qtype, self.embedding_dim)
        return values.view(*ids.shape, self.embedding_dim)


# ----------------------------------------------------------------------------------------------- the file


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``rows`` x ``k`` values (ggml lists the dimensions the other way round) in
    ``block``'s type, ``nbytes`` bytes from ``offset`` in the file."""

    name: str
    block: BlockType
    rows: int
    k: int
    offset: int
    nbytes: int


@dataclass
class GGUFFile:
    """A GGUF file's architecture, metadata fields this package reads, and tensors (:func:`read_gguf`)."""

    path: str
    architecture: str
    fields: dict
    tensors: Dict[str, GGUFTensor]
    size: int
    #: metadata key -> element count of each array, the tokenizer's too (``tokenizer.ggml.tokens``: the vocabulary)
    array_lengths: Dict[str, int] = field(default_factory=dict)
    _mapped: Optional[torch.Tensor] = None

    def mapped(self) -> torch.Tensor:
        """The whole file as a uint8 tensor on a private memory map (pages read from the file as they are touched,
        shared with the page cache; nothing copied; a write would stay private to this process, and nothing here
        writes)."""
        if self._mapped is None:
            self._mapped = torch.from_file(self.path, shared=False, size=self.size, dtype=torch.uint8)
        return self._mapped

    def blocks(self, name: str) -> torch.Tensor:
        """uint8 ``[rows, row_bytes]``, a view of the mapped file."""
        t = self.tensors[name]
        return self.mapped()[t.offset:t.offset + t.nbytes].view(t.rows, t.nbytes // t.rows)

    def release(self, name: str) -> None:
        """Let the pages of tensor ``name`` leave this process's memory (a tensor a layer holds in another form now:
        interleaved, or rows reordered): :func:`~optimum_ipex_spec.utils.memory.page_out` on its whole pages of the
        map; reading them again reads the file, and a written page keeps its content. Where the OS cannot, the
        pages stay until the kernel reclaims them.

        Raises:
            KeyError: no tensor ``name`` in the file.
        """
        t = self.tensors[name]
        if self._mapped is not None:
            page_out(self._mapped.data_ptr() + t.offset, t.nbytes)

    def values(self, name: str) -> torch.Tensor:
        """A small tensor (a norm, a bias) dequantized to fp32 ``[rows * k]`` (a copy of its own)."""
        t = self.tensors[name]
        return reference_dequantize(self.blocks(name), t.block.qtype, t.k).reshape(-1).clone()


def read_gguf(path: os.PathLike) -> GGUFFile:
    """Parse ``path``'s header (:func:`~optimum_ipex_spec.kernels.gguf_header.read_header`: data only, nothing in the
    file is executed) and check every tensor: a supported block type, at most 2 dimensions, a byte range inside the
    file's data section, aligned, of the size its shape needs, shared with no other tensor.

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a GGUF file, or a tensor that fails a check (named).
    """
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    header = read_header(path)
    fields = dict(header.fields)  # the tokenizer's scalars too (special token ids); its arrays are stepped over
    architecture = str(fields.get("general.architecture", ""))
    start, size, alignment = header.data_offset, header.size, header.alignment
    tensors = {}
    for t in header.tensors:
        block = BLOCK_TYPES.get(t.ggml_type)
        if block is None:
            raise GGUFError(f"{path}: tensor {t.name} is of ggml type {ggml_type_name(t.ggml_type)}, which the GGUF "
                            f"kernel does not run (supported: {', '.join(b.name for b in BLOCK_TYPES.values())})")
        dims = list(t.dims)
        if not 1 <= len(dims) <= 2:
            raise GGUFError(f"{path}: tensor {t.name} has {len(dims)} dimensions; a decoder's weights have 1 or 2")
        k, rows = dims[0], (dims[1] if len(dims) == 2 else 1)
        if k < 1 or rows < 1:
            raise GGUFError(f"{path}: tensor {t.name} has an empty dimension ({dims}): a damaged file")
        if k % block.values:
            raise GGUFError(f"{path}: tensor {t.name} has rows of {k} values, not whole {block.name} blocks")
        nbytes = rows * (k // block.values) * block.bytes
        offset = t.offset
        if offset < start or offset + nbytes > size or (offset - start) % alignment:
            raise GGUFError(f"{path}: tensor {t.name} needs {nbytes} bytes at offset {offset}, which the file's data "
                            f"section ({start} to {size}, aligned to {alignment}) does not hold: a truncated or "
                            "damaged file")
        tensors[t.name] = GGUFTensor(t.name, block, rows, k, offset, nbytes)
    ranges = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end, name), (begin, _, other) in zip(ranges, ranges[1:]):
        if begin < end:  # a header's offsets may not make two tensors share bytes
            raise GGUFError(f"{path}: tensors {name} and {other} overlap in the file: a damaged file")
    return GGUFFile(path, architecture, fields, tensors, size, dict(header.array_lengths))


# ----------------------------------------------------------------------------------------------- the model

#: GGUF architectures whose tensors map onto the decoder's Llama-family modules, and their transformers class
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

#: GGUF name in block i -> the decoder layer's module path of that projection (the Llama family's seven)
LAYER_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of ``attn_q`` / ``attn_k`` (``heads`` of them): row
    ``i`` of the result is row ``order[i]`` of the file (transformers' ``_reverse_permute_weights`` on indices)."""
    if rows % (2 * heads):
        raise GGUFError(f"{rows} rows of attn_q/attn_k cannot be {heads} heads of an even size: the config does not "
                        "describe this file")
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def _check_metadata(gguf: GGUFFile, config) -> None:
    """The config's layer and head counts against the file's own metadata (where the file records them), and no
    layer in the file beyond the config's: tensor shapes alone cannot tell 8 heads of 64 from 4 of 128."""
    arch = gguf.architecture
    recorded = {"block_count": config.num_hidden_layers, "attention.head_count": config.num_attention_heads,
                "attention.head_count_kv": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                "embedding_length": config.hidden_size}
    for key, value in recorded.items():
        found = gguf.fields.get(f"{arch}.{key}")
        if found is not None and not isinstance(found, (list, str)) and int(found) != int(value):
            raise GGUFError(f"{gguf.path} records {arch}.{key} = {found}, the config has {value}: the config does not "
                            "describe this file")
    rope = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    for key, value in (("rope.freq_base", rope), ("attention.layer_norm_rms_epsilon", getattr(config, "rms_norm_eps",
                                                                                                None))):
        found = gguf.fields.get(f"{arch}.{key}")
        if (found is not None and value is not None and not isinstance(found, (list, str))
                and abs(float(found) - float(value)) > 1e-6 * abs(float(value))):  # the file holds fp32
            raise GGUFError(f"{gguf.path} records {arch}.{key} = {found}, the config has {value}: the config does not "
                            "describe this file")
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is not None and embedding.rows != config.vocab_size:
        raise GGUFError(f"{gguf.path}: token_embd.weight has {embedding.rows} rows, the config's vocab_size is "
                        f"{config.vocab_size}: the config does not describe this file")
    layers = {int(name.split(".")[1]) for name in gguf.tensors
              if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if layers and max(layers) >= config.num_hidden_layers:
        raise GGUFError(f"{gguf.path} has {max(layers) + 1} layers, the config {config.num_hidden_layers}: the config "
                        "does not describe this file")


def _check_shape(gguf: GGUFFile, name: str, rows: int, k: int) -> GGUFTensor:
    t = gguf.tensors.get(name)
    if t is None:
        raise GGUFError(f"{gguf.path} has no tensor {name}: not a complete {gguf.architecture} model")
    if (t.rows, t.k) != (rows, k):
        raise GGUFError(f"{gguf.path}: tensor {name} is [{t.rows}, {t.k}], the config needs [{rows}, {k}]: the "
                        "config does not describe this file")
    return t


@functools.lru_cache(maxsize=None)
def _log_exact_layers_once(path: str, what: str) -> None:
    logger.warning("%s: the fast mode runs block types Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K with rows of a "
                   "multiple of 64 values; its layers of %s multiply in the exact mode.", path, what)


def load_gguf_model(gguf: GGUFFile, config, mode: str = "exact") -> torch.nn.Module:
    """A transformers causal LM of ``config`` (fp32, eval mode) whose projections, LM head and input embedding are
    :class:`GGUFLinear` / :class:`GGUFEmbedding` modules on ``gguf``'s mapped blocks (never dequantized in memory),
    norms and biases fp32 copies of the file's (small). ``mode``: how the layers multiply (:data:`MODES`).

    Raises:
        GGUFError: an architecture other than :data:`ARCHITECTURES`; a tensor missing, or whose shape is not the
            config's.
    """
    from transformers import AutoModelForCausalLM

    expected = ARCHITECTURES.get(gguf.architecture)
    if expected is None:
        raise GGUFError(f"{gguf.path} is a {gguf.architecture!r} model; weights='gguf' runs "
                        f"{', '.join(ARCHITECTURES)} (the decoder's Llama family)")
    architectures = getattr(config, "architectures", None) or [expected]
    if architectures[0] != expected:
        raise GGUFError(f"{gguf.path} holds a {gguf.architecture} model but the config is {architectures[0]}")
    config.architectures = [expected]
    _check_metadata(gguf, config)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # the default dtype, fp32: a meta skeleton, no memory
    inner = model.model

    def linear(name: str, rows: int, k: int, bias_name: Optional[str] = None, heads_permuted: int = 0,
               layer_mode: str = mode):
        t = _check_shape(gguf, name, rows, k)
        blocks = gguf.blocks(name)
        bias = None
        if bias_name is not None and bias_name in gguf.tensors:
            b = _check_shape(gguf, bias_name, 1, rows)
            bias = gguf.values(b.name)
        if heads_permuted:
            order = _unpermute_rows(rows, heads_permuted)
            blocks = blocks.index_select(0, order)  # q and k only: a small copy, rows whole
            bias = bias[order] if bias is not None else None
        module = GGUFLinear(blocks, t.block, k, bias, mode=layer_mode)
        if module.interleaved or heads_permuted:
            gguf.release(name)  # the layer holds its own copy
        return module

    def norm(module, name: str, size: int):
        _check_shape(gguf, name, 1, size)
        module.weight = torch.nn.Parameter(gguf.values(name), requires_grad=False)

    llama = gguf.architecture == "llama"
    sizes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
             "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
             "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    for index, layer in enumerate(inner.layers):
        for short, path in LAYER_PROJECTIONS.items():
            rows, k = sizes[short]
            permuted = {"attn_q": heads, "attn_k": kv_heads}.get(short, 0) if llama else 0
            module = linear(f"blk.{index}.{short}.weight", rows, k, f"blk.{index}.{short}.bias", permuted)
            parent, attr = path.split(".")
            setattr(getattr(layer, parent), attr, module)
        norm(layer.input_layernorm, f"blk.{index}.attn_norm.weight", hidden)
        norm(layer.post_attention_layernorm, f"blk.{index}.ffn_norm.weight", hidden)
    norm(inner.norm, "output_norm.weight", hidden)
    tied = "output.weight" not in gguf.tensors
    # an untied table is only looked up, never multiplied: kept as the file's rows
    table = linear("token_embd.weight", config.vocab_size, hidden, layer_mode=mode if tied else "exact")
    inner.embed_tokens = GGUFEmbedding(table)
    if not tied:
        model.lm_head = linear("output.weight", config.vocab_size, hidden)
        config.tie_word_embeddings = False
    else:  # tied: the head multiplies the embedding's blocks
        model.lm_head = table
        config.tie_word_embeddings = True
    with torch.device("cpu"):
        inner.rotary_emb = type(inner.rotary_emb)(config=config)
    if mode == "fast" and gguf_fast_available():
        exact = {f"{m.block.name} x {m.in_features}" for m in model.modules()
                 if isinstance(m, GGUFLinear) and not m.fast and (tied or m is not table)}
        if exact:
            _log_exact_layers_once(gguf.path, ", ".join(sorted(exact)))
    left = [name for name, tensor in list(model.named_parameters()) + list(model.named_buffers()) if tensor.is_meta]
    if left:
        raise GGUFError(f"{gguf.path}: no GGUF tensor for {', '.join(left[:4])}: this model's layout is not the "
                        "Llama family's")
    return model.eval()
