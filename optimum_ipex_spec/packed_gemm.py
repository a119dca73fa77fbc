"""An fp32 product of a few rows by a packed weight, for the compiled graphs of an fp32 target
(:mod:`~optimum_ipex_spec.compiled_step`: its 1-token decode step and its 4-token verification): the weight read at
the memory's speed, each output the same bits for any number of rows.

Speculative decoding verifies :data:`~optimum_ipex_spec.compiled_step.CHUNK_ROWS` tokens in one call; that pays
only while 4 rows cost about what 1 does (the weights are read once either way). On an Intel Xeon with AMX (1
thread, about 12 GB/s from memory) Inductor's fp32 GEMM template read SmolLM2-135M's shapes at 14 GB/s for one row
but 8.6 GB/s for four (a 1536 x 576 weight: 254 against 411 us), and MKL's at 5.9 GB/s: a 4-token verification
cost 1.6 decode steps. The same register blocking with a software prefetch of the weight 16 rows of ``k`` ahead
reads four rows at 12.4 GB/s (285 us; 30 layers of SmolLM2's shapes, compiled: 38.0 ms for 4 rows against Inductor's
49.3, its 1-row graph 30.9). One row reads two blocks at a time instead, two weight streams without the software
prefetch, which the hardware prefetcher follows at the memory's speed (Qwen2.5-1.5B's shapes: 15.1-15.9 GB/s, MKL's
15.3, Inductor's 13.7).

Every output element is one chain of fused multiply-adds over ``k`` in order from zero, as in Inductor's
``CppMicroGemmFP32Vec`` (PyTorch, ``torch/_inductor/codegen/cpp_micro_gemm.py``: up to 4 rows x 48 columns of
accumulators), whatever the number of rows: a token verified in a chunk gets the bits the 1-token graph gives it
decoded alone. Both graphs then multiply with the same packed copy of the weights, the only one the process holds
besides the model's own (Inductor's GEMM templates would keep one per graph). The compiled step still checks the
two graphs against each other on the machine that runs them
(:meth:`~optimum_ipex_spec.compiled_step.CompiledDecodeStep.compile_chunk`).

It is a PyTorch operator (``torch.ops.optimum_ipex_spec.packed_mm``, with a fake implementation for tracing), built
from the C++ below with ``torch.utils.cpp_extension.load_inline`` at the first use (20-40 s; cached in
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``). It needs AVX-512 and a C++ compiler with
ninja, as Inductor does; where either is missing :func:`packed_gemm_available` says so (logged once) and the graphs
keep Inductor's GEMMs.
"""

from __future__ import annotations

import functools
import logging
import re

import torch

logger = logging.getLogger(__name__)

#: output columns per block of the packed weight (three AVX-512 vectors of fp32)
BLOCK_N = 48

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>

namespace {

constexpr int64_t kBlockN = 48;
constexpr int64_t kPrefetchK = 16;

// C[0:M, 0:ncols] = A[0:M, :] @ B, B one packed block [K, 48]; each output a chain of fused multiply-adds over k
// in order, from zero
template <int M>
void rows_block(const float* A, int64_t lda, const float* B, float* C, int64_t ldc, int64_t K, int64_t ncols) {
  __m512 acc[M][3];
  for (int m = 0; m < M; m++)
    for (int c = 0; c < 3; c++) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const float* b = B + k * kBlockN;
    const char* ahead = reinterpret_cast<const char*>(b + kPrefetchK * kBlockN);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32);
    for (int m = 0; m < M; m++) {
      const __m512 a = _mm512_set1_ps(A[m * lda + k]);
      acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(a, b2, acc[m][2]);
    }
  }
  for (int m = 0; m < M; m++)
    for (int c = 0; c < 3; c++) {
      const int64_t left = ncols - c * 16;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(C + m * ldc + c * 16, mask, acc[m][c]);
    }
}

// C[0, 0:48] and C[0, 48:48 + ncols1] = A[0, :] @ [B0 B1], two packed blocks [K, 48] of one row: two weight streams,
// which the hardware prefetcher follows at the memory's speed without a software prefetch; the same chain of fused
// multiply-adds per output as rows_block's
void one_row_two_blocks(const float* A, const float* B0, const float* B1, float* C, int64_t K, int64_t ncols1) {
  __m512 acc[2][3];
  for (int j = 0; j < 2; j++)
    for (int c = 0; c < 3; c++) acc[j][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const __m512 a = _mm512_set1_ps(A[k]);
    const float* b0 = B0 + k * kBlockN;
    const float* b1 = B1 + k * kBlockN;
    acc[0][0] = _mm512_fmadd_ps(a, _mm512_loadu_ps(b0), acc[0][0]);
    acc[0][1] = _mm512_fmadd_ps(a, _mm512_loadu_ps(b0 + 16), acc[0][1]);
    acc[0][2] = _mm512_fmadd_ps(a, _mm512_loadu_ps(b0 + 32), acc[0][2]);
    acc[1][0] = _mm512_fmadd_ps(a, _mm512_loadu_ps(b1), acc[1][0]);
    acc[1][1] = _mm512_fmadd_ps(a, _mm512_loadu_ps(b1 + 16), acc[1][1]);
    acc[1][2] = _mm512_fmadd_ps(a, _mm512_loadu_ps(b1 + 32), acc[1][2]);
  }
  for (int c = 0; c < 3; c++) _mm512_storeu_ps(C + c * 16, acc[0][c]);
  for (int c = 0; c < 3; c++) {
    const int64_t left = ncols1 - c * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(C + kBlockN + c * 16, mask, acc[1][c]);
  }
}

at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_mm multiplies float32 tensors, got ", x.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.is_contiguous(),
              "packed_mm takes a weight packed by optimum_ipex_spec.packed_gemm.pack_weight");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == packed.size(1), "packed_mm: x has ", x.size(-1),
              " features, the weight ", packed.size(1));
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlockN && n <= packed.size(0) * kBlockN,
              "packed_mm: ", n, " output features do not match the packed weight's ", packed.size(0), " blocks");
  const at::Tensor a = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = a.size(0), K = a.size(1), blocks = packed.size(0);
  at::Tensor out = at::empty({M, n}, a.options());
  const float* A = a.data_ptr<float>();
  const float* B = packed.data_ptr<float>();
  float* C = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    if (M == 1) {  // one row: two blocks at a time
      int64_t block = begin;
      for (; block + 1 < end; block += 2)
        one_row_two_blocks(A, B + block * K * kBlockN, B + (block + 1) * K * kBlockN, C + block * kBlockN, K,
                           std::min<int64_t>(kBlockN, n - (block + 1) * kBlockN));
      if (block < end)
        rows_block<1>(A, K, B + block * K * kBlockN, C + block * kBlockN, n, K,
                      std::min<int64_t>(kBlockN, n - block * kBlockN));
      return;
    }
    for (int64_t block = begin; block < end; block++) {
      const float* Bb = B + block * K * kBlockN;
      const int64_t ncols = std::min<int64_t>(kBlockN, n - block * kBlockN);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* Am = A + m0 * K;
        float* Cm = C + m0 * n + block * kBlockN;
        switch (std::min<int64_t>(4, M - m0)) {
          case 4: rows_block<4>(Am, K, Bb, Cm, n, K, ncols); break;
          case 3: rows_block<3>(Am, K, Bb, Cm, n, K, ncols); break;
          case 2: rows_block<2>(Am, K, Bb, Cm, n, K, ncols); break;
          default: rows_block<1>(Am, K, Bb, Cm, n, K, ncols);
        }
      }
    }
  });
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(optimum_ipex_spec, m) { m.def("packed_mm(Tensor x, Tensor packed, int n) -> Tensor"); }
TORCH_LIBRARY_IMPL(optimum_ipex_spec, CPU, m) { m.impl("packed_mm", &packed_mm); }
"""


@functools.lru_cache(maxsize=None)
def packed_gemm_available() -> bool:
    """True when ``torch.ops.optimum_ipex_spec.packed_mm`` runs here: an AVX-512 CPU, and the operator built (once
    per process; the build is cached on disk). False, logged once, where it cannot be."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        logger.info("The packed fp32 kernel needs AVX-512 (this CPU: %s): the compiled fp32 graphs keep Inductor's "
                    "GEMMs.", capability)
        return False
    logger.info("Loading the packed fp32 kernel (built once per machine and torch, about 20-40 s; cached in "
                "TORCH_EXTENSIONS_DIR)...")
    try:
        from torch.utils.cpp_extension import load_inline

        # the torch version in the name: two torch versions sharing one TORCH_EXTENSIONS_DIR keep a build each
        name = "optimum_ipex_spec_packed_gemm_torch" + re.sub(r"\W", "_", torch.__version__)
        load_inline(name, cpp_sources=[_SOURCE], is_python_module=False,
                    extra_cflags=["-O3", "-mavx512f", "-mfma"], verbose=False)
        torch.library.register_fake("optimum_ipex_spec::packed_mm")(_packed_mm_shape)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja, a build error: all mean "not here"
        text = str(exc).strip().splitlines()
        logger.warning("Could not build the packed fp32 kernel (%s: %s); the compiled fp32 graphs keep Inductor's "
                       "GEMMs, which read 4 rows about 1.6x slower than 1 on some CPUs.",
                       type(exc).__name__, text[0] if text else "")
        return False
    return True


def _packed_mm_shape(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` fp32 -> ``[ceil(out / 48), in, 48]`` fp32 (a copy: blocks of :data:`BLOCK_N` output
    columns, each read row by row of ``k``; the last block padded with zero columns).

    Raises:
        ValueError: not a 2-D fp32 tensor.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"pack_weight takes a 2-D float32 weight [out, in], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out_features, in_features = weight.shape
    weight = weight.detach()
    full, rest = divmod(out_features, BLOCK_N)
    # written in place: no temporary copy of the weight (a 1.5B model's head is 0.93 GB)
    packed = weight.new_empty(full + (rest > 0), in_features, BLOCK_N)
    packed[:full] = weight[:full * BLOCK_N].view(full, BLOCK_N, in_features).transpose(1, 2)
    if rest:
        packed[full].zero_()
        packed[full, :, :rest] = weight[full * BLOCK_N:].t()
    return packed


class PackedLinear(torch.nn.Module):
    """``x @ W.T + b`` through ``torch.ops.optimum_ipex_spec.packed_mm`` on a packed copy of ``W`` (a buffer, which
    Inductor's freezing keeps as a constant of the graph): ``x [..., in]`` fp32 -> ``[..., out]`` fp32. Build it only
    where :func:`packed_gemm_available` is True.

    Args:
        weight: ``[out, in]`` fp32 (copied into the packed layout; the original is not kept).
        bias: ``[out]`` fp32 or None, added after the product (as Inductor's epilogue adds it).
    """

    def __init__(self, weight: torch.Tensor, bias=None):
        super().__init__()
        self.register_buffer("packed", pack_weight(weight))
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.optimum_ipex_spec.packed_mm(x, self.packed, self.out_features)
        return out if self.bias is None else out + self.bias
