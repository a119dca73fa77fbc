"""The GGUF kernels: which builds this CPU runs, building and loading them (C++ in ``csrc/``, built at the first use
with ``torch.utils.cpp_extension``, cached in ``TORCH_EXTENSIONS_DIR``), and the PyTorch reference they are compared
with.

* The exact kernel (``csrc/gguf_gemm.cpp`` for AVX-512, ``csrc/gguf_gemm_avx2.cpp`` for AVX2: the same bits) computes
  the dequantized weights' product with fp32 activations, each weight exactly the fp32 value gguf-py's
  ``gguf.quants.dequantize`` gives; every output row is the same chain of fused multiply-adds whatever the number of
  rows (:func:`exact_mm`, :func:`exact_kernel`).
* The fast mode (``csrc/gguf_gemm_vnni.cpp``, ``csrc/gguf_fast_avx2.cpp`` and the interleaved layout) rounds the
  activations to int8 per block, as llama.cpp does (:func:`fast_kernel`).
* Where neither builds (no AVX2, no C++ compiler), the PyTorch reference (:func:`reference_mm`: gguf-py's
  dequantization, a bounded number of rows at a time, then ``torch.mv`` per row; slow, logged once by the caller).

Block types: ggml's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, and F16 / F32 (:data:`BLOCK_TYPES`). The modules that
hold a file's blocks and multiply with these kernels: :mod:`~optimum_ipex_spec.backends.pytorch.gguf_weights`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch

from . import CSRC
from .gguf_header import GGUFError
from .packed_gemm import OPENMP

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

#: how a :class:`~optimum_ipex_spec.backends.pytorch.gguf_weights.GGUFLinear` multiplies: "exact" (fp32 activations times the exact dequantized weights) or "fast"
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


_CSRC = CSRC  # the C++ sources


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
    AVX2, no C++ compiler): :class:`~optimum_ipex_spec.backends.pytorch.gguf_weights.GGUFLinear` then multiplies through :func:`reference_mm`. Decided once per
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
