// A product of a few rows by a packed weight, fp32 or bf16, for the compiled graphs of optimum_ipex_spec: the
// operator torch.ops.optimum_ipex_spec.packed_mm(x, packed, n), built by optimum_ipex_spec.kernels.packed_gemm at the first
// use (its module docstring says how the weight is packed, why, and what each output's chain of operations is).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
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

// bf16: a block holds, per pair of k, the 48 columns' two weights side by side ([K / 2, 48, 2]), which one
// vdpbf16ps multiplies by the pair of x broadcast (AVX512-BF16): 16 fp32 sums of two products each, rounded to bf16
// once at the end (as oneDNN's bf16 GEMMs do)
constexpr int64_t kPairRow = 2 * kBlockN;
#define OIS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

OIS_BF16_TARGET inline void store_bf16(at::BFloat16* C, __m512 acc, int64_t left) {
  if (left <= 0) return;
  const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  const __m256bh rounded = _mm512_cvtneps_pbh(acc);
  _mm256_mask_storeu_epi16(reinterpret_cast<void*>(C), mask, reinterpret_cast<const __m256i&>(rounded));
}

// C[0:M, columns of NB blocks] = A[0:M, :] @ NB packed bf16 blocks (block_stride apart); the last block's columns
// ncols_last; each block's weights prefetched kAhead pairs of k ahead (0: none). One row reads four blocks at once,
// 8 pairs ahead (SmolLM2's bf16 shapes, 1 thread, benchmarks/packed_gemm_rows.py: 15.2 GB/s, a plain sum's 15.8;
// two blocks without a prefetch, as the fp32 kernel reads them, about 12-13), 2-4 rows two blocks, 8 pairs ahead
// (4 rows 13.7 GB/s; one block 16 pairs ahead: about 9-10)
constexpr int kOneRowPairsAhead = 8;
constexpr int kRowsPairsAhead = 8;
template <int M, int NB, int kAhead>
OIS_BF16_TARGET void rows_blocks_bf16(const at::BFloat16* A, int64_t lda, const at::BFloat16* B, int64_t block_stride,
                                      at::BFloat16* C, int64_t ldc, int64_t K2, int64_t ncols_last) {
  __m512 acc[M][NB][3];
  for (int m = 0; m < M; m++)
    for (int j = 0; j < NB; j++)
      for (int c = 0; c < 3; c++) acc[m][j][c] = _mm512_setzero_ps();
  const int32_t* pairs = reinterpret_cast<const int32_t*>(A);  // x's k pairs as one 32-bit word each
  for (int64_t kk = 0; kk < K2; kk++) {
    __m512bh b[NB][3];
    for (int j = 0; j < NB; j++) {
      const at::BFloat16* bp = B + j * block_stride + kk * kPairRow;
      if (kAhead) {
        const char* ahead = reinterpret_cast<const char*>(bp + kAhead * kPairRow);
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + 128, _MM_HINT_T0);
      }
      for (int c = 0; c < 3; c++) b[j][c] = (__m512bh)_mm512_loadu_si512(bp + c * 32);
    }
    for (int m = 0; m < M; m++) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pairs[m * (lda / 2) + kk]);
      for (int j = 0; j < NB; j++)
        for (int c = 0; c < 3; c++) acc[m][j][c] = _mm512_dpbf16_ps(acc[m][j][c], a, b[j][c]);
    }
  }
  for (int m = 0; m < M; m++)
    for (int j = 0; j < NB; j++) {
      const int64_t ncols = j == NB - 1 ? ncols_last : kBlockN;
      for (int c = 0; c < 3; c++) store_bf16(C + m * ldc + j * kBlockN + c * 16, acc[m][j][c], ncols - c * 16);
    }
}

// rows_blocks_bf16 for 1-4 rows (a run-time count) of NB blocks, prefetched kRowsPairsAhead pairs ahead
template <int NB>
OIS_BF16_TARGET void up_to_4_rows_bf16(int64_t rows, const at::BFloat16* A, int64_t lda, const at::BFloat16* B,
                                       int64_t block_stride, at::BFloat16* C, int64_t ldc, int64_t K2,
                                       int64_t ncols_last) {
  switch (rows) {
    case 4: rows_blocks_bf16<4, NB, kRowsPairsAhead>(A, lda, B, block_stride, C, ldc, K2, ncols_last); break;
    case 3: rows_blocks_bf16<3, NB, kRowsPairsAhead>(A, lda, B, block_stride, C, ldc, K2, ncols_last); break;
    case 2: rows_blocks_bf16<2, NB, kRowsPairsAhead>(A, lda, B, block_stride, C, ldc, K2, ncols_last); break;
    default: rows_blocks_bf16<1, NB, kRowsPairsAhead>(A, lda, B, block_stride, C, ldc, K2, ncols_last);
  }
}

// AMX (prefills): a block's 16 pairs of k x 16 columns are one B tile (rows 192 bytes apart), so 3 C tiles, one A
// tile (16 rows x 32 k) and 3 B tiles multiply 16 rows by a block per 32 k. Measured (SmolLM2's bf16 shapes, 1
// thread): 16-512 rows as fast as oneDNN's F.linear on the plain weight or faster (512 rows 22.9 vs 23.0 ms, 16 rows
// 2.9 vs 4.5), where vdpbf16ps took 1.6-6.7x as long
constexpr int64_t kAmxRows = 16;
bool amx_enabled = false;

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool enable_amx() {  // the kernel's permission to use AMX tile data (Linux >= 5.16), asked once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  amx_enabled = ok;
  return ok;
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void amx_blocks(const at::BFloat16* A, int64_t Mp, int64_t M, int64_t K, const at::BFloat16* B, int64_t K2,
                at::BFloat16* C, int64_t n, int64_t begin, int64_t end) {
  TileConfig config;
  for (int t = 0; t < 7; t++) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) float tile_out[kAmxRows * kBlockN];
  for (int64_t block = begin; block < end; block++) {
    const at::BFloat16* Bb = B + block * K2 * kPairRow;
    const int64_t ncols = std::min<int64_t>(kBlockN, n - block * kBlockN);
    for (int64_t m0 = 0; m0 < Mp; m0 += kAmxRows) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        _tile_loadd(3, A + m0 * K + k0, K * 2);
        const at::BFloat16* bp = Bb + (k0 / 2) * kPairRow;
        _tile_loadd(4, bp, kPairRow * 2);
        _tile_loadd(5, bp + 32, kPairRow * 2);
        _tile_loadd(6, bp + 64, kPairRow * 2);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
      }
      _tile_stored(0, tile_out, kBlockN * 4);
      _tile_stored(1, tile_out + 16, kBlockN * 4);
      _tile_stored(2, tile_out + 32, kBlockN * 4);
      const int64_t rows = std::min<int64_t>(kAmxRows, M - m0);
      for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < 3; c++)
          store_bf16(C + (m0 + r) * n + block * kBlockN + c * 16, _mm512_loadu_ps(tile_out + r * kBlockN + c * 16),
                     ncols - c * 16);
    }
  }
  _tile_release();
}

at::Tensor packed_mm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPairRow && packed.is_contiguous(),
              "packed_mm takes a weight packed by optimum_ipex_spec.kernels.packed_gemm.pack_weight");
  TORCH_CHECK((x.size(-1) + 1) / 2 == packed.size(1), "packed_mm: x has ", x.size(-1),
              " features, the weight ", 2 * packed.size(1) - 1, " or ", 2 * packed.size(1));
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlockN && n <= packed.size(0) * kBlockN,
              "packed_mm: ", n, " output features do not match the packed weight's ", packed.size(0), " blocks");
  at::Tensor a = x.reshape({-1, x.size(-1)}).contiguous();
  if (amx_enabled && a.size(0) >= kAmxRows && a.size(1) % 32 == 0) {  // a prefill: AMX tiles
    const int64_t M = a.size(0), Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
    const at::Tensor padded = Mp == M ? a : at::constant_pad_nd(a, {0, 0, 0, Mp - M});
    at::Tensor out = at::empty({M, n}, a.options());
    const at::BFloat16* A = padded.data_ptr<at::BFloat16>();
    const at::BFloat16* B = packed.data_ptr<at::BFloat16>();
    at::BFloat16* C = out.data_ptr<at::BFloat16>();
    const int64_t K = a.size(1), K2 = packed.size(1);
    at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
      amx_blocks(A, Mp, M, K, B, K2, C, n, begin, end);
    });
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n;
    return out.view(shape);
  }
  if (a.size(1) % 2) a = at::constant_pad_nd(a, {0, 1});  // an odd k: its pair's second weight is a zero
  const int64_t M = a.size(0), K = a.size(1), blocks = packed.size(0), K2 = packed.size(1);
  const int64_t stride = K2 * kPairRow;
  at::Tensor out = at::empty({M, n}, a.options());
  const at::BFloat16* A = a.data_ptr<at::BFloat16>();
  const at::BFloat16* B = packed.data_ptr<at::BFloat16>();
  at::BFloat16* C = out.data_ptr<at::BFloat16>();
  auto columns = [&](int64_t block) { return std::min<int64_t>(kBlockN, n - block * kBlockN); };
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    if (M == 1) {
      int64_t block = begin;
      for (; block + 3 < end; block += 4)
        rows_blocks_bf16<1, 4, kOneRowPairsAhead>(A, K, B + block * stride, stride, C + block * kBlockN, n, K2,
                                                  columns(block + 3));
      for (; block + 1 < end; block += 2)
        rows_blocks_bf16<1, 2, kOneRowPairsAhead>(A, K, B + block * stride, stride, C + block * kBlockN, n, K2,
                                                  columns(block + 1));
      if (block < end)
        rows_blocks_bf16<1, 1, kOneRowPairsAhead>(A, K, B + block * stride, stride, C + block * kBlockN, n, K2,
                                                  columns(block));
      return;
    }
    for (int64_t block = begin; block < end; block += 2) {
      const bool two = block + 1 < end;  // two blocks at once: 24 accumulators for 4 rows
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m0);
        const at::BFloat16* Am = A + m0 * K;
        const at::BFloat16* Bb = B + block * stride;
        at::BFloat16* Cm = C + m0 * n + block * kBlockN;
        if (two)
          up_to_4_rows_bf16<2>(rows, Am, K, Bb, stride, Cm, n, K2, columns(block + 1));
        else
          up_to_4_rows_bf16<1>(rows, Am, K, Bb, stride, Cm, n, K2, columns(block));
      }
    }
  });
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "packed_mm multiplies float32 or bfloat16 tensors of one dtype, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "packed_mm: x needs a last dimension of features, got a 0-D tensor");
  if (x.scalar_type() == at::kBFloat16) return packed_mm_bf16(x, packed, n);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.is_contiguous(),
              "packed_mm takes a weight packed by optimum_ipex_spec.kernels.packed_gemm.pack_weight");
  TORCH_CHECK(x.size(-1) == packed.size(1), "packed_mm: x has ", x.size(-1),
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

bool packed_mm_enable_amx() { return enable_amx(); }

TORCH_LIBRARY(optimum_ipex_spec, m) {
  m.def("packed_mm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("packed_mm_enable_amx() -> bool", &packed_mm_enable_amx);
}
TORCH_LIBRARY_IMPL(optimum_ipex_spec, CPU, m) { m.impl("packed_mm", &packed_mm); }
