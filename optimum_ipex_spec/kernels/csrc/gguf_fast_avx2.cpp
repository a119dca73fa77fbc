// The fast GGUF mode for CPUs with AVX2, FMA and F16C but no AVX512-VNNI: activations rounded to int8 per block (as
// llama.cpp's q8_0 / q8_K round them, and as gguf_gemm_vnni.cpp does), multiplied by the weights' integer codes with
// vpmaddubsw / vpmaddwd; its outputs are its own, like the VNNI kernel's (the same integer sums; the fp32 sums in
// another order).
//
// Operator (namespace optimum_ipex_spec_gguf_fast_avx2):
//   mm(x fp32 [M, K], blocks uint8 [N, row_bytes], qtype, K) -> fp32 [M, N]   (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K,
//       Q6_K; K a multiple of 64 and of the block's values)
//
// Activations, per row of x: d = max|x| / 127 per 32 values (per 256 for the K types), codes round(x / d) to nearest
// even, in natural order, and the code sums per 32 (what Q4_1's and the K types' mins multiply).
// Weights, one row at a time for every row of x: a block's (super-block's) codes are decoded once into vectors of 32
// bytes in natural order, then per row of x
//   - signed codes (Q4_0: q - 8, Q5_0: q - 16, Q8_0: q, Q6_K: q - 32): vpmaddubsw(|w|, x with w's sign) gives int16
//     words of 2 products (|word| <= 2 * 128 * 127: never saturates), vpmaddwd sums pairs into 8 int32 lanes (by the
//     sub-block scales for Q6_K);
//   - unsigned codes (Q4_1: q; Q4_K, Q5_K: q, by the 6-bit sub-block scales): vpmaddubsw(w, x), then vpmaddwd;
//   then one fp32 multiply-add of the 8 lanes by d_w * d_x per block (super-block); the mins (Q4_1: m * d_x * code
//   sum; Q4_K, Q5_K: dmin * d_x * sum of mn * code sums) go to a second fp32 sum. Each output is 8 lanes summed in a
//   fixed order plus that sum: the same operations whatever M is, so a row gets the same bits alone as among others
//   (speculative decoding over a target in this mode returns that target's own greedy tokens). Weight rows are split
//   between torch's threads, each row computed by one thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_activations.h"
#include "gguf_formats.h"

namespace {

using namespace optimum_ipex_spec_gguf_formats;
using optimum_ipex_spec_activations::quantize_group;

// how far ahead of the block being read a row prefetches (bytes; a prefetch never faults past a tensor's end)
constexpr int64_t kAhead = 2048;

// Every row of x as int8 codes in natural order, a scale per `group` values and the code sums per 32
struct Activations {
  int64_t K, group;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums;  // |sum| <= 32 * 127

  Activations(const float* x, int64_t M, int64_t K_, int64_t group_)
      : K(K_), group(group_), q(M * K_), d(M * (K_ / group_)), sums(M * (K_ / 32)) {
    for (int64_t m = 0; m < M; m++) {
      for (int64_t g = 0; g < K / group; g++)
        d[m * (K / group) + g] = quantize_group(x + m * K + group * g, group, q.data() + m * K + group * g);
      for (int64_t j = 0; j < K / 32; j++) {
        int32_t s = 0;
        for (int i = 0; i < 32; i++) s += q[m * K + 32 * j + i];
        sums[m * (K / 32) + j] = static_cast<int16_t>(s);
      }
    }
  }
};

// 8 int32 lanes: sums of 4 products of signed codes w by x, through vpmaddubsw(|w|, x * sign(w))
inline __m256i dot_signed(__m256i w, __m256i x) {
  const __m256i words = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(words, _mm256_set1_epi16(1));
}

// the 32 codes of a 16-byte nibble block in natural order (byte j: value j low, value j + 16 high)
inline __m256i nibble_codes(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
}

// 0x10 in byte j where bit j of the 32-bit word at p is set (Q5_0's fifth bits)
inline __m256i fifth_bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  // byte j takes byte j / 8 of the word (each 128-bit lane holds the whole word), then tests its bit j % 8
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), pick);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// the fp32 sums of a weight row with each row of x: 8 lanes and the mins' sum apiece, zeroed; in registers for
// MB = 1-4 rows of x, in the caller's memory for `count` of them (MB = 0)
template <int MB>
struct Sums {
  __m256 acc_registers[MB > 0 ? MB : 1];
  float min_registers[MB > 0 ? MB : 1];
  int64_t rows;
  __m256* acc;
  float* mins;

  Sums(int64_t count, __m256* acc_memory, float* min_memory)
      : rows(MB > 0 ? MB : count), acc(MB > 0 ? acc_registers : acc_memory),
        mins(MB > 0 ? min_registers : min_memory) {
    for (int64_t m = 0; m < rows; m++) {
      acc[m] = _mm256_setzero_ps();
      mins[m] = 0.0f;
    }
  }
};

// One weight row of a 32-value type times every row of x: MB of them (1-4, accumulators in registers), or `count`
// (MB = 0, accumulators in memory)
template <int64_t QT, int MB>
void row_32(const Activations& xa, int64_t count, const uint8_t* row, int64_t bytes, float* out, int64_t ldo,
            __m256* acc_memory, float* min_memory) {
  const int64_t K = xa.K, blocks = K / 32;
  Sums<MB> sums(count, acc_memory, min_memory);
  const int64_t rows_x = sums.rows;
  __m256* acc = sums.acc;
  float* mins = sums.mins;
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t* b = row + blk * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(b) + kAhead, _MM_HINT_T0);
    __m256i w;
    if (QT == Q8_0) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    } else if (QT == Q5_0) {
      w = _mm256_sub_epi8(_mm256_or_si256(nibble_codes(b + 6), fifth_bits32(b + 2)), _mm256_set1_epi8(16));
    } else if (QT == Q4_0) {
      w = _mm256_sub_epi8(nibble_codes(b + 2), _mm256_set1_epi8(8));
    } else {  // Q4_1: unsigned codes
      w = nibble_codes(b + 4);
    }
    const float dw = half(b);
    const float mw = QT == Q4_1 ? half(b + 2) : 0.0f;
    for (int64_t m = 0; m < rows_x; m++) {
      const int64_t i = m * blocks + blk;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.q.data() + 32 * i));
      const __m256i dot = QT == Q4_1 ? _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
                                     : dot_signed(w, x);
      const float dx = xa.d[i];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx), acc[m]);
      if (QT == Q4_1) mins[m] += mw * dx * static_cast<float>(xa.sums[i]);
    }
  }
  for (int64_t m = 0; m < rows_x; m++) out[m * ldo] = sum8(acc[m]) + mins[m];
}

// One weight row of a K type times every row of x (MB / count as row_32)
template <int64_t QT, int MB>
void row_k(const Activations& xa, int64_t count, const uint8_t* row, int64_t bytes, float* out, int64_t ldo,
           __m256* acc_memory, float* min_memory) {
  const int64_t K = xa.K, supers = K / 256;
  Sums<MB> sums(count, acc_memory, min_memory);
  const int64_t rows_x = sums.rows;
  __m256* acc = sums.acc;
  float* mins = sums.mins;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < supers; s++) {
    const uint8_t* b = row + s * bytes;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b) + kAhead + o, _MM_HINT_T0);
    __m256i codes[8], scale[8];  // per 32 values: the codes (natural order), the int16 scale of each word
    __m128i mins16 = _mm_setzero_si128();  // Q4_K, Q5_K: the 8 mins as int16
    float d, dmin = 0.0f;
    if (QT == Q6_K) {  // (q - 32) signed; a scale per 16 values (words 0-7 | 8-15 of a 32-value piece)
      d = half(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++) {
          const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (r % 2)));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
          const __m256i low = _mm256_and_si256(r < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
          const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), _mm256_set1_epi8(3));
          const int p = 4 * h + r;  // values 32p..32p+31
          codes[p] = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
          scale[p] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * p + 1]), _mm_set1_epi16(sc[2 * p]));
        }
    } else {  // Q4_K, Q5_K: unsigned q, a 6-bit scale and min per 32 values
      d = half(b);
      dmin = half(b + 2);
      // the 12 bytes of scales and mins as three 32-bit words: bytes 0-3 hold the low 6 bits of scales 0-3 (their top
      // 2 bits: the high bits of scales 4-7), bytes 4-7 those of mins 0-3 (likewise mins 4-7), bytes 8-11 the low 4
      // bits of scales 4-7 (low nibbles) and of mins 4-7 (high nibbles): all 8 of each, a byte apiece, at once
      uint32_t w[3];
      std::memcpy(w, b + 4, 12);
      const uint32_t low6 = 0x3F3F3F3Fu, low4n = 0x0F0F0F0Fu, top2 = 0x03030303u;
      const uint64_t sc8 = static_cast<uint64_t>(w[0] & low6) |
                           static_cast<uint64_t>((w[2] & low4n) | (((w[0] >> 6) & top2) << 4)) << 32;
      const uint64_t mn8 = static_cast<uint64_t>(w[1] & low6) |
                           static_cast<uint64_t>(((w[2] >> 4) & low4n) | (((w[1] >> 6) & top2) << 4)) << 32;
      mins16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(mn8)));
      const uint8_t* qs = b + (QT == Q5_K ? 48 : 16);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      for (int g = 0; g < 8; g++) {
        const int sc = static_cast<int>((sc8 >> (8 * g)) & 0xFF);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (g / 2)));
        codes[g] = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
        if (QT == Q5_K)
          codes[g] = _mm256_or_si256(codes[g], _mm256_slli_epi16(
              _mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(1)), 4));
        scale[g] = _mm256_set1_epi16(static_cast<int16_t>(sc));
      }
    }
    for (int64_t m = 0; m < rows_x; m++) {
      const int8_t* xq = xa.q.data() + m * K + 256 * s;
      __m256i total = _mm256_setzero_si256();
      for (int p = 0; p < 8; p++) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * p));
        const __m256i words = QT == Q6_K
                                  ? _mm256_maddubs_epi16(_mm256_sign_epi8(codes[p], codes[p]),
                                                         _mm256_sign_epi8(x, codes[p]))
                                  : _mm256_maddubs_epi16(codes[p], x);
        total = _mm256_add_epi32(total, _mm256_madd_epi16(words, scale[p]));
      }
      const float dx = xa.d[m * supers + s];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * dx), acc[m]);
      if (QT != Q6_K) {  // sum over the 8 sub-blocks of min * code sum (|sum| <= 63 * 32 * 127 * 8: int32)
        const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xa.sums.data() + m * (K / 32) + 8 * s));
        const __m128i four = _mm_madd_epi16(mins16, sums);
        const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
        const int32_t weighted = _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
        mins[m] += dmin * dx * static_cast<float>(weighted);
      }
    }
  }
  for (int64_t m = 0; m < rows_x; m++) out[m * ldo] = sum8(acc[m]) - mins[m];
}

// one weight row of QT times every row of x: row_k for the K types, row_32 for the others (only the one that fits
// QT is instantiated)
template <int64_t QT, int MB>
inline void weight_row(const Activations& xa, int64_t count, const uint8_t* w, int64_t bytes, float* out, int64_t ldo,
                __m256* acc_memory, float* min_memory) {
  if constexpr (QT == Q4_K || QT == Q5_K || QT == Q6_K)
    row_k<QT, MB>(xa, count, w, bytes, out, ldo, acc_memory, min_memory);
  else
    row_32<QT, MB>(xa, count, w, bytes, out, ldo, acc_memory, min_memory);
}

template <int64_t QT>
void mm_rows(const float* x, int64_t M, const uint8_t* wp, int64_t row_bytes, int64_t bytes, float* op, int64_t N,
             int64_t K) {
  const Activations xa(x, M, K, QT == Q4_K || QT == Q5_K || QT == Q6_K ? 256 : 32);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<__m256> acc(M > 4 ? M : 0);  // more than 4 rows of x (a prefill): accumulators in memory
    std::vector<float> mins(M > 4 ? M : 0);
    for (int64_t n = begin; n < end; n++) {
      const uint8_t* w = wp + n * row_bytes;
      float* o = op + n;
      switch (M) {
        case 1: weight_row<QT, 1>(xa, 1, w, bytes, o, N, nullptr, nullptr); break;
        case 2: weight_row<QT, 2>(xa, 2, w, bytes, o, N, nullptr, nullptr); break;
        case 3: weight_row<QT, 3>(xa, 3, w, bytes, o, N, nullptr, nullptr); break;
        case 4: weight_row<QT, 4>(xa, 4, w, bytes, o, N, nullptr, nullptr); break;
        default: weight_row<QT, 0>(xa, M, w, bytes, o, N, acc.data(), mins.data());
      }
    }
  });
}

// the kernel's rows, for the operator's shell (gguf_formats.h)
struct Rows {
  template <int64_t QT>
  static void mm(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t bytes, float* out, int64_t N,
                 int64_t K) {
    mm_rows<QT>(x, M, w, row_bytes, bytes, out, N, K);
  }
};

}  // namespace

TORCH_LIBRARY(optimum_ipex_spec_gguf_fast_avx2, m) { m.def("mm(Tensor x, Tensor blocks, int qtype, int K) -> Tensor"); }
TORCH_LIBRARY_IMPL(optimum_ipex_spec_gguf_fast_avx2, CPU, m) { m.impl("mm", &fast_mm_op<Rows>); }
