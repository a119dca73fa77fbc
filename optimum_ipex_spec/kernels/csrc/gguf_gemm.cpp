// Products of fp32 activations by GGUF block-quantized weights, held as the file ships them, for
// optimum_ipex_spec.kernels.gguf (which builds this file at the first use and holds the PyTorch reference).
//
// Operators (namespace optimum_ipex_spec_gguf):
//   dequantize(blocks uint8 [N, row_bytes], qtype, K) -> fp32 [N, K]
//       each value exactly as gguf-py's gguf.quants.dequantize computes it (fp32 products and sums in its order,
//       never contracted into a fused multiply-add: built with -ffp-contract=off)
//   mm(x fp32 [M, K], blocks uint8 [N, row_bytes], qtype, K) -> fp32 [M, N]
//       out[m, n] = sum_k x[m, k] * w[n, k], w the dequantized weight. Every output is the same chain of fused
//       multiply-adds whatever M is: 16 lanes over k in steps of 16 from zero, then one fixed reduction of the 16
//       lanes. So a row gets the same bits alone (a decode step) as among others (a verification of draft tokens,
//       a prefill): speculative decoding over a quantized target returns the target's own greedy tokens.
//       Each weight row is dequantized once per call, for all the rows of x: for up to 4 rows (a decode step, a
//       verification) 16 values at a time in registers, multiplied as they are made; for more, whole rows into a
//       buffer first; for a prefill (panel_path), 32 rows at a time, transposed so that a vector holds one lane of 16
//       rows, each value then multiplied by 12 rows of x. Weight rows are split between torch's threads, each computed
//       by one thread.
//
// Block layouts: gguf_formats.h. gguf_gemm_avx2.cpp computes the same operators, the same bits, with AVX2.

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

// 16 floats at y: table[v[i]] for the 16 bytes at v (their low 4 bits, or bits 4..7 with high), one permute
inline void nibbles_through(const uint8_t* v, bool high, __m512 table, float* y) {
  __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  if (high) idx = _mm512_srli_epi32(idx, 4);
  _mm512_storeu_ps(y, _mm512_permutexvar_ps(idx, table));  // the permute reads each index's low 4 bits
}

// the 16 values d * (i + offset) (and + m when with_min) for i = 0..15: a block's dequantized values for each nibble,
// each computed as gguf-py computes a value (fp32 product, then sum)
inline __m512 nibble_table(float d, int offset) {
  const __m512 i = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_add_ps(i, _mm512_set1_ps(static_cast<float>(offset))));
}

// Q4_K / Q5_K: a block's 8 sub-block scales d * sc (lane 2g for sub-block g) and mins dmin * mn (lane 2g + 1), each
// the one fp32 product that scale_min_k4's integers make with d or dmin. The lanes gather the bytes scale_min_k4
// reads from the 16 loaded at b + 4 (the 12 scale bytes, then 4 code bytes that nothing uses), and the block's fp16
// pair (d, dmin) converted 8 times over gives each lane its factor.
inline __m512 k_scales(const uint8_t* b) {
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
  // g < 4: s[g] & 63 and s[g + 4] & 63; g >= 4: s[g + 4] & 15 and s[g + 4] >> 4 ...
  const __m512i low = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(s, _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7,
                                                                                 8, 8, 9, 9, 10, 10, 11, 11)));
  // ... with bits 4-5 from bits 6-7 of s[g - 4] and s[g]
  const __m512i top = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(s, _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7,
                                                                                 0, 4, 1, 5, 2, 6, 3, 7)));
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 4, 0, 4, 0, 4);
  const __m512i keep = _mm512_setr_epi32(63, 63, 63, 63, 63, 63, 63, 63, 15, 15, 15, 15, 15, 15, 15, 15);
  const __m512i high = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x30, 0x30, 0x30, 0x30, 0x30, 0x30, 0x30, 0x30);
  const __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(low, shift), keep),
                                    _mm512_and_si512(_mm512_srli_epi32(top, 2), high));  // bits 6-7 to 4-5
  uint32_t pair;  // d, dmin
  std::memcpy(&pair, b, 4);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(pair))), _mm512_cvtepi32_ps(q));
}

// the 16 values (d * sc) * (i + offset) - dmin * mn, i = 0..15, of sub-block g from k_scales' lanes at s: the values
// of its nibbles (offset 0) or 5-bit codes 16..31 (offset 16), bit for bit dequantize_block's. d * sc holds at most
// 11 + 6 significant bits, so its product by a 5-bit integer is exact and one fused multiply-subtract rounds as the
// product and difference do.
inline __m512 k_table(const float* s, int g, int offset) {
  const __m512 i = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmsub_ps(_mm512_set1_ps(s[2 * g]), _mm512_add_ps(i, _mm512_set1_ps(static_cast<float>(offset))),
                         _mm512_set1_ps(s[2 * g + 1]));
}

// one block of `qtype` at b -> its values at y (Format::values of them), bit for bit gguf-py's: each value a table
// entry computed in gguf-py's order, or an integer converted and scaled in it
// (a template on the type: the switch folds away, and the block's code inlines into the loops that call it)
template <int64_t QT>
__attribute__((always_inline)) inline void dequantize_block(const uint8_t* b, float* y) {
  switch (QT) {
    case F32:
      std::memcpy(y, b, 4);
      return;
    case F16:
      y[0] = half(b);
      return;
    case Q4_0: {  // d * (q - 8)
      const __m512 table = nibble_table(half(b), -8);
      nibbles_through(b + 2, false, table, y);
      nibbles_through(b + 2, true, table, y + 16);
      return;
    }
    case Q4_1: {  // d * q + m
      const __m512 table = _mm512_add_ps(nibble_table(half(b), 0), _mm512_set1_ps(half(b + 2)));
      nibbles_through(b + 4, false, table, y);
      nibbles_through(b + 4, true, table, y + 16);
      return;
    }
    case Q5_0: {  // d * (q - 16), q = nibble | fifth bit << 4
      const float d = half(b);
      const __m512 lo = nibble_table(d, -16), hi = nibble_table(d, 0);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const __m512i bit = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6)));
      const __m512i mask = _mm512_set1_epi32(0x0F);
      for (int half_ = 0; half_ < 2; half_++) {
        __m512i idx = half_ ? _mm512_srli_epi32(nib, 4) : _mm512_and_si512(nib, mask);
        const __m512i fifth = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(qh >> (16 * half_))), bit), _mm512_set1_epi32(1));
        idx = _mm512_or_si512(idx, _mm512_slli_epi32(fifth, 4));
        _mm512_storeu_ps(y + 16 * half_, _mm512_permutex2var_ps(lo, idx, hi));  // index bit 4 picks the table
      }
      return;
    }
    case Q8_0: {  // q * d
      const __m512 d = _mm512_set1_ps(half(b));
      for (int c = 0; c < 2; c++) {
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * c)));
        _mm512_storeu_ps(y + 16 * c, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
      }
      return;
    }
    case Q4_K: {  // (d * sc) * q - dmin * mn per sub-block of 32
      alignas(64) float scales[16];
      _mm512_store_ps(scales, k_scales(b));
      const uint8_t* qs = b + 16;
      for (int g = 0; g < 8; g++) {
        const __m512 table = k_table(scales, g, 0);
        const uint8_t* q = qs + 32 * (g / 2);
        nibbles_through(q, g % 2, table, y + 32 * g);
        nibbles_through(q + 16, g % 2, table, y + 32 * g + 16);
      }
      return;
    }
    case Q5_K: {  // (d * sc) * q - dmin * mn, q = nibble | fifth bit << 4
      alignas(64) float scales[16];
      _mm512_store_ps(scales, k_scales(b));
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + 48;
      const __m512i low4 = _mm512_set1_epi32(0x0F), one = _mm512_set1_epi32(1);
      for (int g = 0; g < 8; g++) {
        const __m512 lo = k_table(scales, g, 0), hi = k_table(scales, g, 16);
        for (int c = 0; c < 2; c++) {
          const uint8_t* q = qs + 32 * (g / 2) + 16 * c;
          __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
          idx = _mm512_and_si512(g % 2 ? _mm512_srli_epi32(idx, 4) : idx, low4);
          const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * c)));
          idx = _mm512_or_si512(idx, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, g), one), 4));
          _mm512_storeu_ps(y + 32 * g + 16 * c, _mm512_permutex2var_ps(lo, idx, hi));
        }
      }
      return;
    }
    case Q6_K: {  // (d * sc) * (q - 32) per 16 values, q = 4 low bits | 2 high bits << 4
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half(b + 208);
      const __m512i low4 = _mm512_set1_epi32(0x0F), two = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
      for (int i = 0; i < 16; i++) {  // 16 values each: half h, quarter r, 16 of its 32
        const int h = i / 8, r = (i % 8) / 2, part = i % 2;
        __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 64 * h + 32 * (r % 2) + 16 * part)));
        q = _mm512_and_si512(r < 2 ? q : _mm512_srli_epi32(q, 4), low4);
        const uint8_t* high = qh + 32 * h + 16 * part;
        const __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high)));
        q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2 * r), two), 4));
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, bias));
        const __m512 scale = _mm512_set1_ps(d * static_cast<float>(scales[i]));
        _mm512_storeu_ps(y + 16 * i, _mm512_mul_ps(scale, v));
      }
      return;
    }
  }
}

template <int64_t QT>
inline void dequantize_row(const Format& f, const uint8_t* row, float* y, int64_t K) {
  const int64_t blocks = K / f.values;
  for (int64_t i = 0; i < blocks; i++) dequantize_block<QT>(row + i * f.bytes, y + i * f.values);
}

// rows of weights dequantized together, and so dots that run side by side
constexpr int kRowsN = 4;

// rows of x that share one pass over the dequantized weights
constexpr int kRowsM = 4;
// values of k per software prefetch share while every row of x fits one pass (a decode step, a verification)
constexpr int64_t kChunkK = 256;

// acc[m][r] += x[m, k0:k1] * w[r, k0:k1], 16 lanes over k in steps of 16; x rows ldx apart, w rows ldw apart
template <int M, int R>
inline void fma_chain(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k0, int64_t k1,
                      __m512 (&acc)[kRowsM][kRowsN]) {
  for (int64_t k = k0; k < k1; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(w + r * ldw + (k - k0));
    for (int m = 0; m < M; m++) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; r++) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
}

// the sum of the 16 lanes in one fixed order, written out (not left to a compiler's _mm512_reduce_add_ps):
// lanes 8-15 + lanes 0-7, then the upper 4 of those + the lower 4, then [0] + [2] and [1] + [3], then the two;
// gguf_gemm_avx2.cpp sums its two 8-lane halves in the same order
inline float sum_lanes(__m512 v) {
  return sum8(_mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                            _mm512_castps512_ps256(v)));
}

template <int M, int R>
inline void store(const __m512 (&acc)[kRowsM][kRowsN], float* out, int64_t ldo) {
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) out[m * ldo + r] = sum_lanes(acc[m][r]);
}

inline void zero(__m512 (&acc)[kRowsM][kRowsN]) {
  for (int m = 0; m < kRowsM; m++)
    for (int r = 0; r < kRowsN; r++) acc[m][r] = _mm512_setzero_ps();
}

// 16-bit shift counts: a for the low 256 bits of a vector, b for the high
inline __m512i shifts(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(a)), _mm256_set1_epi16(static_cast<int16_t>(b)), 1);
}

// acc[m][r] += x[m, 0:16] * w[r] (x rows ldx apart): one step of fma_chain with the 16 weight values in registers
template <int M, int R>
__attribute__((always_inline)) inline void fma_step(const float* x, int64_t ldx, const __m512 (&w)[R],
                                                    __m512 (&acc)[kRowsM][kRowsN]) {
  for (int m = 0; m < M; m++) {
    const __m512 xv = _mm512_loadu_ps(x + m * ldx);
    for (int r = 0; r < R; r++) acc[m][r] = _mm512_fmadd_ps(xv, w[r], acc[m][r]);
  }
}

// all M (<= kRowsM) rows of x against R weight rows, the weights' values made 16 at a time in registers and
// multiplied as they are made (a decode step, a verification): each value dequantize_block's (the K types' made here
// the same way, in the same fp32 operations), each output one chain of fused multiply-adds over k in steps of 16
template <int64_t QT, int M, int R>
void few_rows(const float* x, int64_t ldx, const uint8_t* rows, int64_t row_bytes, const Format& f, int64_t K,
                    float* out, int64_t ldo) {
  constexpr Format fmt = format_for(QT);  // f, known when compiling
  __m512 acc[kRowsM][kRowsN];
  zero(acc);
  const int64_t chunk = fmt.values > kChunkK ? fmt.values : kChunkK;
  const int64_t steps = (K + chunk - 1) / chunk;
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  PrefetchShares prefetch(rows + R * row_bytes, kRowsN * row_bytes, steps);
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    prefetch.step();
    const int64_t k1 = k0 + chunk < K ? k0 + chunk : K;
    if (QT == F32 || QT == F16) {  // 16 values read (F16: converted, exactly) at a time
      for (int64_t k = k0; k < k1; k += 16) {
        __m512 w[R];
        for (int r = 0; r < R; r++) {
          const uint8_t* p = rows + r * row_bytes + k * fmt.bytes;
          w[r] = QT == F32 ? _mm512_loadu_ps(reinterpret_cast<const float*>(p))
                           : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        }
        fma_step<M, R>(x + k, ldx, w, acc);
      }
      continue;
    }
    for (int64_t blk = k0 / fmt.values; blk < k1 / fmt.values; blk++) {
      const float* xb = x + blk * fmt.values;
      const uint8_t* b[R];
      for (int r = 0; r < R; r++) b[r] = rows + r * row_bytes + blk * fmt.bytes;
      if (QT == Q6_K) {  // (d * sc) * (q - 32) per 16 values, as dequantize_block makes them
        // q - 32 as int8 for the super-block's 256 values, 64 to a vector (values 64c..64c+63): low nibbles from
        // ql (bytes 0-31 | 32-63 of a half: values 0-31 | 32-63 low, 64-95 | 96-127 high), 2 high bits from qh
        alignas(64) int8_t q8[R][256];
        for (int r = 0; r < R; r++)
          for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(b[r] + 64 * h);
            const __m512i qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[r] + 128 + 32 * h)));
            const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
            const __m512i up = _mm512_and_si512(_mm512_sllv_epi16(qh, shifts(4, 2)), top);
            const __m512i down = _mm512_and_si512(_mm512_srlv_epi16(qh, shifts(0, 2)), top);
            _mm512_store_si512(q8[r] + 128 * h, _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(ql, nib), up), bias));
            _mm512_store_si512(q8[r] + 128 * h + 64, _mm512_sub_epi8(
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nib), down), bias));
          }
        // the 16 scales d * sc, each the one fp32 product dequantize_block makes
        alignas(64) float dsc[R][16];
        for (int r = 0; r < R; r++) {
          const __m512 sc = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r] + 192))));
          _mm512_store_ps(dsc[r], _mm512_mul_ps(_mm512_set1_ps(half(b[r] + 208)), sc));
        }
        __asm__ volatile("" ::: "memory");  // the scales broadcast from memory (a load), as Q4_K's below
        for (int i = 0; i < 16; i++) {
          __m512 w[R];
          for (int r = 0; r < R; r++) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q8[r] + 16 * i)));
            w[r] = _mm512_mul_ps(_mm512_set1_ps(dsc[r][i]), _mm512_cvtepi32_ps(q));
          }
          fma_step<M, R>(xb + 16 * i, ldx, w, acc);
        }
      } else if (QT == Q4_K) {  // (d * sc) * q - dmin * mn per sub-block of 32
        // sub-blocks 2j and 2j + 1 share 32 bytes of codes (low nibbles, high nibbles): each 16 bytes widened once,
        // the index of both; each sub-block's 16 values one table, k_table's
        alignas(64) float scales[R][16];
        for (int r = 0; r < R; r++) _mm512_store_ps(scales[r], k_scales(b[r]));
        // read back from memory: a broadcast from memory is a load, while one from a register takes the shuffle
        // port that the widening and the permutes already fill
        __asm__ volatile("" ::: "memory");
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
          __m512i idx[R][2];
          __m512 lo[R], hi[R];
          for (int r = 0; r < R; r++) {
            for (int part = 0; part < 2; part++)
              idx[r][part] = _mm512_cvtepu8_epi32(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r] + 16 + 32 * j + 16 * part)));
            lo[r] = k_table(scales[r], 2 * j, 0);
            hi[r] = k_table(scales[r], 2 * j + 1, 0);
          }
          for (int v = 0; v < 4; v++) {  // values 64j + 16v ..: low nibbles of each 16 bytes, then high
            __m512 w[R];
            for (int r = 0; r < R; r++)  // the permute reads each index's low 4 bits
              w[r] = v < 2 ? _mm512_permutexvar_ps(idx[r][v], lo[r])
                           : _mm512_permutexvar_ps(_mm512_srli_epi32(idx[r][v - 2], 4), hi[r]);
            fma_step<M, R>(xb + 64 * j + 16 * v, ldx, w, acc);
          }
        }
      } else if (QT == Q5_K) {  // (d * sc) * q - dmin * mn per sub-block of 32, q = nibble | fifth bit << 4
        alignas(64) float scales[R][16];
        for (int r = 0; r < R; r++) _mm512_store_ps(scales[r], k_scales(b[r]));
        for (int g = 0; g < 8; g++) {
          __m512 lo[R], hi[R];
          for (int r = 0; r < R; r++) {
            lo[r] = k_table(scales[r], g, 0);
            hi[r] = k_table(scales[r], g, 16);
          }
          for (int part = 0; part < 2; part++) {
            __m512 w[R];
            for (int r = 0; r < R; r++) {
              const uint8_t* qs = b[r] + 48 + 32 * (g / 2) + 16 * part;
              __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
              if (g % 2) idx = _mm512_srli_epi32(idx, 4);
              const __m512i h = _mm512_cvtepu8_epi32(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r] + 16 + 16 * part)));
              idx = _mm512_or_si512(_mm512_and_si512(idx, low4), _mm512_slli_epi32(
                  _mm512_and_si512(_mm512_srli_epi32(h, g), _mm512_set1_epi32(1)), 4));
              w[r] = _mm512_permutex2var_ps(lo[r], idx, hi[r]);  // index bit 4 picks the table
            }
            fma_step<M, R>(xb + 32 * g + 16 * part, ldx, w, acc);
          }
        }
      } else {  // a 32-value type: dequantize_block's two halves of 16
        alignas(64) float y[R][32];
        for (int r = 0; r < R; r++) dequantize_block<QT>(b[r], y[r]);
        for (int part = 0; part < 2; part++) {
          __m512 w[R];
          for (int r = 0; r < R; r++) w[r] = _mm512_load_ps(y[r] + 16 * part);
          fma_step<M, R>(xb + 16 * part, ldx, w, acc);
        }
      }
    }
  }
  store<M, R>(acc, out, ldo);
}

// M rows of x in groups of kRowsM against R weight rows dequantized whole first (more rows than a verification, fewer
// than panel_path's): each output the same chain as few_rows gives it
template <int64_t QT, int R>
void many_rows(const float* x, int64_t M, int64_t ldx, const uint8_t* rows, int64_t row_bytes,
               const Format& f, int64_t K, float* buf, float* out, int64_t ldo) {
  PrefetchShares prefetch(rows + R * row_bytes, kRowsN * row_bytes, R);
  for (int r = 0; r < R; r++) {
    prefetch.step();
    dequantize_row<QT>(f, rows + r * row_bytes, buf + r * K, K);
  }
  __m512 acc[kRowsM][kRowsN];
  int64_t m = 0;
  for (; m + kRowsM <= M; m += kRowsM) {
    zero(acc);
    fma_chain<kRowsM, R>(x + m * ldx, ldx, buf, K, 0, K, acc);
    store<kRowsM, R>(acc, out + m * ldo, ldo);
  }
  const int64_t left = M - m;
  zero(acc);
  if (left == 1) { fma_chain<1, R>(x + m * ldx, ldx, buf, K, 0, K, acc); store<1, R>(acc, out + m * ldo, ldo); }
  if (left == 2) { fma_chain<2, R>(x + m * ldx, ldx, buf, K, 0, K, acc); store<2, R>(acc, out + m * ldo, ldo); }
  if (left == 3) { fma_chain<3, R>(x + m * ldx, ldx, buf, K, 0, K, acc); store<3, R>(acc, out + m * ldo, ldo); }
}

// A prefill's path (panel_path says when): the same chains as few_rows, each weight value loaded once per
// tile of kTileM rows of x rather than once per 4. The chain of output (m, n) in lane l is the sum over j of
// x[m, 16 j + l] * w[n, 16 j + l], fused multiply-adds in order of j from zero, then sum_lanes' sum of the 16 lanes.
// Here a vector holds lane l of 16 weight rows n side by side, multiplied by a broadcast value of x: the weights of
// kPanelN rows are dequantized (dequantize_block) and transposed lane by lane (panel_of), x once per call
// (lanes_of_x, gguf_formats.h).
constexpr int kTileM = 12;          // rows of x per register tile: 12 x 2 accumulators, 2 weight vectors, 1 broadcast
constexpr int kPanelN = 32;         // weight rows per panel: two vectors

// whether mm takes this path for M rows of x of K values: from 96 rows on (below, many_rows' dots of 4 rows of x by 4
// weight rows are as fast where those 8 rows stay near L1: docs/gguf.md), from 48 where K > 2048 (a down projection:
// its 8 rows of K values are read from L2)
inline bool panel_path(int64_t M, int64_t K) { return K % 16 == 0 && M >= (K > 2048 ? 48 : 96); }

// 16 vectors transposed in place: lane b of v[a] <-> lane a of v[b]
inline void transpose16(__m512 (&v)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++)
    for (int h = 0; h < 2; h++) {
      const __m512d a = _mm512_castps_pd(t[4 * i + h]), b = _mm512_castps_pd(t[4 * i + 2 + h]);
      v[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      v[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 2; i++)
    for (int c = 0; c < 4; c++) {
      t[8 * i + c] = _mm512_shuffle_f32x4(v[8 * i + c], v[8 * i + 4 + c], 0x88);
      t[8 * i + 4 + c] = _mm512_shuffle_f32x4(v[8 * i + c], v[8 * i + 4 + c], 0xDD);
    }
  for (int c = 0; c < 8; c++) {
    v[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    v[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
  }
}

// R (<= kPanelN) weight rows -> p, lane l at p + l * (K / 16) * kPanelN: [K / 16][kPanelN], entry [j][r] =
// w[r, 16 j + l] (dequantize_block's values), rows past R zero. 16 rows' values are made one block (or 16 values,
// whichever is more) at a time into y and transposed 16 by 16.
template <int64_t QT>
void panel_of(const uint8_t* rows, int64_t row_bytes, int R, int64_t K, float* p) {
  constexpr Format fmt = format_for(QT);
  constexpr int64_t step = fmt.values > 16 ? fmt.values : 16;  // values per row made at a time
  constexpr int64_t blocks = step / fmt.values;
  const int64_t Kj = K / 16;
  alignas(64) float y[16][step];
  for (int h = 0; h < kPanelN / 16; h++)
    for (int64_t k0 = 0; k0 < K; k0 += step) {
      for (int r = 0; r < 16; r++) {
        if (16 * h + r >= R) {
          std::memset(y[r], 0, sizeof(y[r]));
          continue;
        }
        const uint8_t* b = rows + (16 * h + r) * row_bytes + k0 / fmt.values * fmt.bytes;
        for (int64_t i = 0; i < blocks; i++) dequantize_block<QT>(b + i * fmt.bytes, y[r] + i * fmt.values);
      }
      for (int64_t c = 0; c < step; c += 16) {
        __m512 v[16];
        for (int r = 0; r < 16; r++) v[r] = _mm512_load_ps(y[r] + c);
        transpose16(v);
        const int64_t j = (k0 + c) / 16;
        for (int l = 0; l < 16; l++) _mm512_store_ps(p + (l * Kj + j) * kPanelN + 16 * h, v[l]);
      }
    }
}

// gguf_panel.h's vector: 16 floats
struct Vec512 {
  using T = __m512;
  static constexpr int width = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, T v) { _mm512_store_ps(p, v); }
  static T set1(float f) { return _mm512_set1_ps(f); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
};

template <int64_t QT, int R>
void row_group(const float* x, int64_t M, int64_t ldx, const uint8_t* rows, int64_t row_bytes,
               const Format& f, int64_t K, float* buf, float* out, int64_t ldo) {
  switch (M) {
    case 1: few_rows<QT, 1, R>(x, ldx, rows, row_bytes, f, K, out, ldo); return;
    case 2: few_rows<QT, 2, R>(x, ldx, rows, row_bytes, f, K, out, ldo); return;
    case 3: few_rows<QT, 3, R>(x, ldx, rows, row_bytes, f, K, out, ldo); return;
    case 4: few_rows<QT, 4, R>(x, ldx, rows, row_bytes, f, K, out, ldo); return;
    default: many_rows<QT, R>(x, M, ldx, rows, row_bytes, f, K, buf, out, ldo);
  }
}

template <int64_t QT>
void dequantize_rows(const uint8_t* src, int64_t row_bytes, const Format& f, float* dst, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) dequantize_row<QT>(f, src + n * row_bytes, dst + n * K, K);
  });
}

template <int64_t QT>
void mm_rows(const float* xp, int64_t M, const uint8_t* wp, int64_t row_bytes, const Format& f, float* op, int64_t N,
             int64_t K) {
  if (panel_path(M, K)) {
    std::vector<float> xt((M + kTileM - 1) / kTileM * kTileM * K);
    lanes_of_x<kTileM>(xp, M, K, xt.data());
    panel_rows<Vec512, kTileM, kPanelN>(xt.data(), M, op, N, K, [&](int64_t n0, int R, float* p) {
      panel_of<QT>(wp + n0 * row_bytes, row_bytes, R, K, p);
    });
    return;
  }
  const int64_t groups = (N + kRowsN - 1) / kRowsN;
  const int64_t buf_values = M <= kRowsM ? 0 : kRowsN * K;  // many_rows' dequantized rows
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    // 64-byte aligned: the block values are stored and read again as whole cache lines
    std::vector<__m512> storage((buf_values + 15) / 16);
    float* buf = reinterpret_cast<float*>(storage.data());
    std::vector<float> tile(M * kRowsN);
    for (int64_t g = begin; g < end; g++) {
      const int64_t n0 = g * kRowsN;
      const int R = static_cast<int>(N - n0 < kRowsN ? N - n0 : kRowsN);
      const uint8_t* rows = wp + n0 * row_bytes;
      float* t = tile.data();
      switch (R) {
        case 4: row_group<QT, 4>(xp, M, K, rows, row_bytes, f, K, buf, t, kRowsN); break;
        case 3: row_group<QT, 3>(xp, M, K, rows, row_bytes, f, K, buf, t, kRowsN); break;
        case 2: row_group<QT, 2>(xp, M, K, rows, row_bytes, f, K, buf, t, kRowsN); break;
        default: row_group<QT, 1>(xp, M, K, rows, row_bytes, f, K, buf, t, kRowsN);
      }
      for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < R; r++) op[m * N + n0 + r] = t[m * kRowsN + r];
    }
  });
}

// the kernel's rows, for the operators' shells (gguf_formats.h)
struct Rows {
  template <int64_t QT>
  static void dequantize(const uint8_t* src, int64_t row_bytes, const Format& f, float* dst, int64_t N, int64_t K) {
    dequantize_rows<QT>(src, row_bytes, f, dst, N, K);
  }
  template <int64_t QT>
  static void mm(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, const Format& f, float* out,
                 int64_t N, int64_t K) {
    mm_rows<QT>(x, M, w, row_bytes, f, out, N, K);
  }
};

}  // namespace

TORCH_LIBRARY(optimum_ipex_spec_gguf, m) {
  m.def("dequantize(Tensor blocks, int qtype, int K) -> Tensor");
  m.def("mm(Tensor x, Tensor blocks, int qtype, int K) -> Tensor");
}
TORCH_LIBRARY_IMPL(optimum_ipex_spec_gguf, CPU, m) {
  m.impl("dequantize", &dequantize_op<Rows>);
  m.impl("mm", &mm_op<Rows>);
}
