// The exact GGUF product for CPUs with AVX2, FMA and F16C but no AVX-512 (most AMD CPUs before Zen 4, Intel client
// CPUs since Alder Lake): the operators of gguf_gemm.cpp, in namespace optimum_ipex_spec_gguf_avx2, with the same bits.
//
//   dequantize(blocks uint8 [N, row_bytes], qtype, K) -> fp32 [N, K]
//       each value exactly gguf-py's (gguf.quants.dequantize): the same fp32 products and sums, never contracted
//       (built with -ffp-contract=off)
//   mm(x fp32 [M, K], blocks uint8 [N, row_bytes], qtype, K) -> fp32 [M, N]
//       out[m, n] = sum_k x[m, k] * w[n, k] as the AVX-512 kernel computes it: 16 lanes (here two 8-float registers,
//       lanes 0-7 and 8-15), lane l a chain of fused multiply-adds over k = l, l + 16, ... from zero, then the
//       16 lanes summed in gguf_gemm.cpp's fixed order. The lanes' products and sums are the same IEEE operations, so
//       every output has the same bits as the AVX-512 kernel's, whatever M is (a decode step, a verification, a
//       prefill): speculative decoding over a quantized target stays exact, and a model gives the same tokens on an
//       AVX2 machine as on an AVX-512 one.
//
// With 1-4 rows of x (a decode step, a verification of up to 3 draft tokens), each weight row's blocks are dequantized
// 8 values at a time in a register and multiplied into every row's accumulators at once (fused_row). From 48 rows
// where K > 2048 (a prefill's down projection), 16 weight rows are dequantized and transposed so that a vector holds
// one lane of 8 of them, each vector multiplied by 6 rows of x (panel_rows). Otherwise, with more than 4 rows, each
// group of 4 weight rows is dequantized 256 values at a time (one K-quant super-block, or 8 blocks of 32) into a buffer
// in L1, once for all the rows of x, while a share of the next group is prefetched; the accumulators of every row of x
// stay in memory between these pieces (loading and storing a lane's sum does not change it). Every path makes the
// same values and the same chains, so the same bits. Weight rows are split between torch's threads, each computed by
// one thread. Block layouts: gguf_formats.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_formats.h"
#include "gguf_panel.h"

namespace {

using namespace optimum_ipex_spec_gguf_formats;

// the 8 bytes at p, zero-extended (or sign-extended, for int8 codes) to 8 int32 lanes
inline __m256i eight(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i eight_signed(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// the low (high = false) or high nibbles of the 8 bytes at p
inline __m256i nibbles(const uint8_t* p, bool high) {
  const __m256i q = eight(p);
  return high ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(0x0F));
}
// bit `shift` of each of the 8 bytes at p, moved to bit 4 (a 5-bit code's fifth bit)
inline __m256i fifth_bits(const uint8_t* p, int shift) {
  return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(eight(p), shift), _mm256_set1_epi32(1)), 4);
}
// scale * (q + offset) for 8 integer codes: one fp32 product, as gguf-py makes each value
inline __m256 scaled(__m256i q, int offset, __m256 scale) {
  return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_add_epi32(q, _mm256_set1_epi32(offset))));
}

// one block of `QT` at b (a type of 32 or 256 values) -> emit(j, v) for its values 8j..8j+7 in v, j = 0, 1, ... in
// order, each value exactly as gguf-py computes it (the same fp32 products and sums)
template <int64_t QT, class Emit>
__attribute__((always_inline)) inline void block_chunks(const uint8_t* b, Emit&& emit) {
  switch (QT) {
    case Q4_0:    // d * (q - 8)
    case Q4_1: {  // d * q + m
      const __m256 d = _mm256_set1_ps(half(b));
      const uint8_t* qs = b + (QT == Q4_1 ? 4 : 2);
      for (int c = 0; c < 4; c++) {  // values 8c..8c+7: low nibbles of bytes 0-15, then high
        __m256 v = scaled(nibbles(qs + 8 * (c % 2), c >= 2), QT == Q4_0 ? -8 : 0, d);
        if (QT == Q4_1) v = _mm256_add_ps(v, _mm256_set1_ps(half(b + 2)));
        emit(c, v);
      }
      return;
    }
    case Q5_0: {  // d * (q - 16), q = nibble | fifth bit << 4 (bit j of the 32 for value j)
      const __m256 d = _mm256_set1_ps(half(b));
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const __m256i bit = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (int c = 0; c < 4; c++) {
        const __m256i shift = _mm256_add_epi32(bit, _mm256_set1_epi32(8 * c));
        const __m256i fifth = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh)), shift),
                                               _mm256_set1_epi32(1));
        const __m256i q = _mm256_or_si256(nibbles(b + 6 + 8 * (c % 2), c >= 2), _mm256_slli_epi32(fifth, 4));
        emit(c, scaled(q, -16, d));
      }
      return;
    }
    case Q8_0: {  // q * d
      const __m256 d = _mm256_set1_ps(half(b));
      for (int c = 0; c < 4; c++) emit(c, scaled(eight_signed(b + 2 + 8 * c), 0, d));
      return;
    }
    case Q4_K:
    case Q5_K: {  // (d * sc) * q - dmin * mn per sub-block of 32; Q5_K: q = nibble | fifth bit << 4
      const float d = half(b), dmin = half(b + 2);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (QT == Q5_K ? 48 : 16);
      for (int g = 0; g < 8; g++) {
        int sc, mn;
        scale_min_k4(b + 4, g, &sc, &mn);
        const __m256 d1 = _mm256_set1_ps(d * static_cast<float>(sc));
        const __m256 m1 = _mm256_set1_ps(dmin * static_cast<float>(mn));
        for (int c = 0; c < 4; c++) {
          __m256i q = nibbles(qs + 32 * (g / 2) + 8 * c, g % 2);
          if (QT == Q5_K) q = _mm256_or_si256(q, fifth_bits(qh + 8 * c, g));
          emit(4 * g + c, _mm256_sub_ps(scaled(q, 0, d1), m1));
        }
      }
      return;
    }
    case Q6_K: {  // (d * sc) * (q - 32) per 16 values, q = 4 low bits | 2 high bits << 4
      // q - 32 as int8 for the 256 values in order, 32 at a time: half h (128 values), quarter r: the low nibbles
      // of ql bytes 0-31 (r = 0) or 32-63 (r = 1) of the half, then their high nibbles (r = 2, 3); bits 2r, 2r + 1
      // of qh bytes 0-31 of the half
      alignas(32) int8_t codes[256];
      const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
        // a 16-bit shift moves a byte's bits into its neighbour only outside the 0x30 kept
        const __m256i high[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), top),
                                 _mm256_and_si256(_mm256_slli_epi16(qh, 2), top), _mm256_and_si256(qh, top),
                                 _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)};
        const __m256i low[4] = {_mm256_and_si256(ql0, nib), _mm256_and_si256(ql1, nib),
                                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), nib),
                                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), nib)};
        for (int r = 0; r < 4; r++)
          _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 128 * h + 32 * r),
                             _mm256_sub_epi8(_mm256_or_si256(low[r], high[r]), bias));
      }
      const float d = half(b + 208);
      for (int i = 0; i < 16; i++) {  // 16 values each, one scale
        const __m256 scale = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(b[192 + i])));
        for (int c = 0; c < 2; c++)
          emit(2 * i + c, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(eight_signed(
                                                   reinterpret_cast<const uint8_t*>(codes + 16 * i + 8 * c)))));
      }
      return;
    }
  }
}

// one block of `QT` at b -> its Format::values values at y
template <int64_t QT>
__attribute__((always_inline)) inline void dequantize_block(const uint8_t* b, float* y) {
  if (QT == F32) {
    std::memcpy(y, b, 4);
  } else if (QT == F16) {
    y[0] = half(b);
  } else {
    block_chunks<QT>(b, [&](int j, __m256 v) { _mm256_storeu_ps(y + 8 * j, v); });
  }
}

// values of k per piece of a weight row dequantized at a time (a K-quant super-block, 8 blocks of 32)
constexpr int64_t kPiece = 256;
// weight rows dequantized together (the outputs computed side by side)
constexpr int kRows = 4;

// k0..k1 (a multiple of the block's values) of `row` -> y
template <int64_t QT>
inline void dequantize_piece(const uint8_t* row, const Format& f, int64_t k0, int64_t k1, float* y) {
  if (QT == F32) {
    std::memcpy(y, row + 4 * k0, 4 * (k1 - k0));
  } else if (QT == F16) {
    for (int64_t k = k0; k < k1; k += 8)
      _mm256_storeu_ps(y + (k - k0), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
  } else {
    for (int64_t blk = k0 / f.values; blk < k1 / f.values; blk++)
      dequantize_block<QT>(row + blk * f.bytes, y + (blk * f.values - k0));
  }
}

// 16 lanes as the AVX-512 kernel holds them in one register: lanes 0-7, lanes 8-15
struct Lanes {
  __m256 lo, hi;
};

// the 16 lanes summed in gguf_gemm.cpp's order (sum_lanes there): 8-15 + 0-7, upper 4 + lower 4, [0] + [2] and
// [1] + [3], then the two
inline float sum_lanes(const Lanes& a) { return sum8(_mm256_add_ps(a.hi, a.lo)); }

// acc[r] += x[0:n] * w[r][0:n] lane by lane, 16 values a step; w rows kPiece apart
template <int R>
inline void fma_piece(const float* x, const float* w, int64_t n, Lanes* acc) {
  Lanes a[R];
  for (int r = 0; r < R; r++) a[r] = acc[r];
  for (int64_t k = 0; k < n; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < R; r++) {
      a[r].lo = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + r * kPiece + k), a[r].lo);
      a[r].hi = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + r * kPiece + k + 8), a[r].hi);
    }
  }
  for (int r = 0; r < R; r++) acc[r] = a[r];
}

template <int64_t QT, int R>
void row_group(const float* x, int64_t M, const uint8_t* rows, int64_t row_bytes, const Format& f, int64_t K,
               float* w, Lanes* acc, float* out, int64_t ldo) {
  const Lanes zero{_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < M * R; i++) acc[i] = zero;
  const int64_t pieces = (K + kPiece - 1) / kPiece;
  PrefetchShares prefetch(rows + R * row_bytes, kRows * row_bytes, pieces);
  for (int64_t k0 = 0; k0 < K; k0 += kPiece) {
    prefetch.step();
    const int64_t k1 = k0 + kPiece < K ? k0 + kPiece : K;
    for (int r = 0; r < R; r++) dequantize_piece<QT>(rows + r * row_bytes, f, k0, k1, w + r * kPiece);
    for (int64_t m = 0; m < M; m++) fma_piece<R>(x + m * K + k0, w, k1 - k0, acc + m * R);
  }
  for (int64_t m = 0; m < M; m++)
    for (int r = 0; r < R; r++) out[m * ldo + r] = sum_lanes(acc[m * R + r]);
}

// bytes ahead of the block being read that a one-row product prefetches (the hardware prefetcher alone leaves the
// small blocks of a Q5_0 layer waiting on memory: gguf_formats.h, PrefetchShares)
constexpr int64_t kAhead = 4096;

// out[m * ldo] = one weight row (a block type) times rows 0..MB-1 of x, each value dequantized in a register and
// multiplied at once, never stored: the same values, the same chain of fused multiply-adds per lane (k = l, l + 16,
// ... in order, lanes 0-7 even chunks of 8, lanes 8-15 odd ones) and the same lane sum as row_group, so the same bits
template <int64_t QT, int MB>
void fused_row(const float* x, int64_t K, const uint8_t* row, const Format& f, float* out, int64_t ldo) {
  Lanes a[MB];
  for (int m = 0; m < MB; m++) a[m] = Lanes{_mm256_setzero_ps(), _mm256_setzero_ps()};
  const char* fetched = reinterpret_cast<const char*>(row) + kAhead;
  for (int64_t blk = 0, k0 = 0; k0 < K; blk++, k0 += f.values) {
    const uint8_t* b = row + blk * f.bytes;
    for (; fetched < reinterpret_cast<const char*>(b) + f.bytes + kAhead; fetched += 64)
      _mm_prefetch(fetched, _MM_HINT_T0);
    block_chunks<QT>(b, [&](int j, __m256 v) {
      for (int m = 0; m < MB; m++) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k0 + 8 * j);
        if (j % 2 == 0) {
          a[m].lo = _mm256_fmadd_ps(xv, v, a[m].lo);
        } else {
          a[m].hi = _mm256_fmadd_ps(xv, v, a[m].hi);
        }
      }
    });
  }
  for (int m = 0; m < MB; m++) out[m * ldo] = sum_lanes(a[m]);
}

// A prefill's path (panel_path says when), as gguf_gemm.cpp's: the same chains and lane sums, so the same bits, with
// each weight value loaded once per tile of kTileM rows of x. A vector holds lane l of 8 weight rows side by side,
// multiplied by a broadcast value of x: the weights of kPanelN rows are dequantized (dequantize_piece) and transposed
// 8 by 8 (panel_of), x once per call (lanes_of_x, gguf_formats.h).
constexpr int kTileM = 6;    // rows of x per register tile: 6 x 2 accumulators, 2 weight vectors, 1 broadcast
constexpr int kPanelN = 16;  // weight rows per panel: two vectors

// whether mm takes this path for M rows of x of K values: where K > 2048 (a down projection, whose rows row_group
// reads from L2) from 48 rows; elsewhere row_group is as fast or faster (docs/gguf.md)
inline bool panel_path(int64_t M, int64_t K) { return K % 16 == 0 && K > 2048 && M >= 48; }

// 8 vectors transposed in place: lane b of v[a] <-> lane a of v[b]
inline void transpose8(__m256 (&v)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++)
    for (int h = 0; h < 2; h++) {
      u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
    }
  for (int c = 0; c < 4; c++) {
    v[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    v[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// R (<= kPanelN) weight rows -> p, lane l at p + l * (K / 16) * kPanelN: [K / 16][kPanelN], entry [j][r] =
// w[r, 16 j + l] (dequantize_piece's values), rows past R zero. 16 rows' values are made one block (or 16 values,
// whichever is more) at a time into y and transposed 8 by 8.
template <int64_t QT>
void panel_of(const uint8_t* rows, int64_t row_bytes, const Format& f, int R, int64_t K, float* p) {
  constexpr Format fmt = format_for(QT);
  constexpr int64_t step = fmt.values > 16 ? fmt.values : 16;  // values per row made at a time
  const int64_t Kj = K / 16;
  alignas(32) float y[kPanelN][step];
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    for (int r = 0; r < kPanelN; r++) {
      if (r < R)
        dequantize_piece<QT>(rows + r * row_bytes, f, k0, k0 + step, y[r]);
      else
        std::memset(y[r], 0, sizeof(y[r]));
    }
    for (int64_t c = 0; c < step; c += 16)
      for (int rh = 0; rh < 2; rh++)
        for (int lh = 0; lh < 2; lh++) {
          __m256 v[8];
          for (int i = 0; i < 8; i++) v[i] = _mm256_load_ps(y[8 * rh + i] + c + 8 * lh);
          transpose8(v);
          const int64_t j = (k0 + c) / 16;
          for (int q = 0; q < 8; q++) _mm256_store_ps(p + ((8 * lh + q) * Kj + j) * kPanelN + 8 * rh, v[q]);
        }
  }
}

// gguf_panel.h's vector: 8 floats
struct Vec256 {
  using T = __m256;
  static constexpr int width = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, T v) { _mm256_store_ps(p, v); }
  static T set1(float f) { return _mm256_set1_ps(f); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
};

// rows 0..MB-1 of x times every weight row, one row at a time (fused_row), weight rows split between the threads
template <int64_t QT, int MB>
void fused_rows(const float* x, const uint8_t* blocks, int64_t row_bytes, const Format& f, float* out, int64_t N,
                int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) fused_row<QT, MB>(x, K, blocks + n * row_bytes, f, out + n, N);
  });
}

// the kernel's rows, for the operators' shells (gguf_formats.h)
struct Rows {
  template <int64_t QT>
  static void dequantize(const uint8_t* src, int64_t row_bytes, const Format& f, float* dst, int64_t N, int64_t K) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; n++) dequantize_piece<QT>(src + n * row_bytes, f, 0, K, dst + n * K);
    });
  }

  template <int64_t QT>
  static void mm(const float* x, int64_t M, const uint8_t* blocks, int64_t row_bytes, const Format& f, float* out,
                 int64_t N, int64_t K) {
    if constexpr (QT != F32 && QT != F16) {  // 1-4 rows of x (a decode step, a verification): fused
      switch (M) {
        case 1: fused_rows<QT, 1>(x, blocks, row_bytes, f, out, N, K); return;
        case 2: fused_rows<QT, 2>(x, blocks, row_bytes, f, out, N, K); return;
        case 3: fused_rows<QT, 3>(x, blocks, row_bytes, f, out, N, K); return;
        case 4: fused_rows<QT, 4>(x, blocks, row_bytes, f, out, N, K); return;
        default: break;  // more rows: each piece dequantized once into L1 for all of them
      }
    }
    if (panel_path(M, K)) {
      std::vector<float> xt((M + kTileM - 1) / kTileM * kTileM * K);
      lanes_of_x<kTileM>(x, M, K, xt.data());
      panel_rows<Vec256, kTileM, kPanelN>(xt.data(), M, out, N, K, [&](int64_t n0, int R, float* p) {
        panel_of<QT>(blocks + n0 * row_bytes, row_bytes, f, R, K, p);
      });
      return;
    }
    const int64_t groups = (N + kRows - 1) / kRows;
    at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> w(kRows * kPiece);
      std::vector<Lanes> acc(M * kRows);
      std::vector<float> tile(M * kRows);
      for (int64_t g = begin; g < end; g++) {
        const int64_t n0 = g * kRows;
        const int R = static_cast<int>(N - n0 < kRows ? N - n0 : kRows);
        const uint8_t* rows = blocks + n0 * row_bytes;
        switch (R) {
          case 4: row_group<QT, 4>(x, M, rows, row_bytes, f, K, w.data(), acc.data(), tile.data(), kRows); break;
          case 3: row_group<QT, 3>(x, M, rows, row_bytes, f, K, w.data(), acc.data(), tile.data(), kRows); break;
          case 2: row_group<QT, 2>(x, M, rows, row_bytes, f, K, w.data(), acc.data(), tile.data(), kRows); break;
          default: row_group<QT, 1>(x, M, rows, row_bytes, f, K, w.data(), acc.data(), tile.data(), kRows);
        }
        for (int64_t m = 0; m < M; m++)
          for (int r = 0; r < R; r++) out[m * N + n0 + r] = tile[m * kRows + r];
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY(optimum_ipex_spec_gguf_avx2, m) {
  m.def("dequantize(Tensor blocks, int qtype, int K) -> Tensor");
  m.def("mm(Tensor x, Tensor blocks, int qtype, int K) -> Tensor");
}
TORCH_LIBRARY_IMPL(optimum_ipex_spec_gguf_avx2, CPU, m) {
  m.impl("dequantize", &dequantize_op<Rows>);
  m.impl("mm", &mm_op<Rows>);
}
