// GGUF block-quantized weights times activations quantized to int8, with AVX512-VNNI integer dot products: the
// "fast" mode of optimum_ipex_spec.backends.pytorch.gguf_weights (its outputs are its own, as llama.cpp's are: the activations are
// rounded to 8 bits). Built only where the CPU has AVX512-VNNI (its own extension: the exact kernel never runs a
// VNNI instruction).
//
// Operator (namespace optimum_ipex_spec_gguf_vnni):
//   mm(x fp32 [M, K], blocks uint8 [N, row_bytes], qtype, K) -> fp32 [M, N]
//
// Activations, per row (as llama.cpp quantizes them for these weights, ggml's q8_0 and q8_K):
//   - blocks of 32 values (Q4_0, Q4_1, Q5_0, Q8_0): d = max|x| / 127, q = round(x / d), one d per block
//   - K-quants (Q4_K, Q5_K, Q6_K): one d per 256 values, and the sums of q per 32 (the weights' mins) or 16 (Q6_K)
// stored in the order the weights' codes come out of their bytes, so a code vector meets its activations without a
// shuffle. Weights are read as unsigned codes (0..15, 0..31, 0..63, or int8 + 128), one weight row at a time for all
// the rows of x (up to 4, a decode step or a verification, accumulate in registers; more, a prefill, in memory): each
// super-block's (or pair of blocks') codes and scales are decoded once, then multiplied by each row of x with integer
// dot products (vpmaddubsw and vpmaddwd/vpdpwssd by the scales for the K types, vpdpbusd for the others); zero
// points apply to the integer sums,
// mins to the activation sums, and one fp32 multiply-add per super-block (pair of blocks) scales the result. Each
// output is the same sequence of operations whatever M is, so a row gets the same bits alone as among others:
// speculative decoding over a target in this mode returns that target's own greedy tokens. Weight rows are split
// between torch's threads (built with OpenMP), each row computed by one thread. K must be a multiple of 64 (and of
// the block's values); the caller uses the exact kernel otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_formats.h"
#include "gguf_activations.h"

namespace {

using optimum_ipex_spec_gguf_formats::fast_mm_op;

using optimum_ipex_spec_activations::KActivations;
using optimum_ipex_spec_activations::quantize_group;
using optimum_ipex_spec_gguf_formats::half;

using optimum_ipex_spec_gguf_formats::Q4_0;
using optimum_ipex_spec_gguf_formats::Q4_1;
using optimum_ipex_spec_gguf_formats::Q4_K;
using optimum_ipex_spec_gguf_formats::Q5_0;
using optimum_ipex_spec_gguf_formats::Q5_K;
using optimum_ipex_spec_gguf_formats::Q6_K;
using optimum_ipex_spec_gguf_formats::Q8_0;

// a pshufb control: every int16 word of 128-bit lane L takes byte index[L] of that lane, into its low byte with the
// high byte zero (unsigned scales), or into its high byte with the low byte zero (signed: shifted down after)
inline __m512i word_picks(const int (&index)[4], bool high) {
  alignas(64) uint8_t ctl[64];
  for (int lane = 0; lane < 4; lane++)
    for (int w = 0; w < 8; w++) {
      ctl[16 * lane + 2 * w] = high ? 0x80 : static_cast<uint8_t>(index[lane]);
      ctl[16 * lane + 2 * w + 1] = high ? static_cast<uint8_t>(index[lane]) : 0x80;
    }
  return _mm512_load_si512(ctl);
}

// 16-bit shift counts: a for the low 256 bits, b for the high
inline __m512i counts(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(a)), _mm256_set1_epi16(static_cast<int16_t>(b)), 1);
}

// The scale of each int16 word of vpmaddubsw(codes[c], x) (a word per 2 values), by 128-bit lane. Q4_K/Q5_K: codes
// [sub-blocks 0|2], [1|3], [4|6], [5|7] (a sub-block per 256 bits); Q6_K: values 64c..64c+63, a scale per 16 values.
const int kPickQ4[4][4] = {{0, 0, 2, 2}, {1, 1, 3, 3}, {4, 4, 6, 6}, {5, 5, 7, 7}};
const int kPickQ6[4][4] = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}};

// How far ahead of the super-block being read the kernel prefetches (the hardware prefetcher alone left a decode
// step waiting on memory); a prefetch never faults, so the addresses past a tensor's end are harmless
constexpr int64_t kAhead = 4096;

// One weight row of a K type times every row of x: MB of them (1-4, accumulators in registers), or `count` (MB = 0,
// accumulators in memory). Per super-block: the row's 256 codes as 4 vectors in the activations' order and its
// scales as int16 words, once; then per row of x 4 vpmaddubsw (int16 words of 2 products), 4 vpmaddwd/vpdpwssd by
// the scales into 16 int32 lanes, one fp32 multiply-add by d * dx; the mins (Q4_K, Q5_K) or the zero point 32 (Q6_K)
// apply to the code sums. A row of x goes through the same operations whatever the number of rows.
template <int64_t QT, int MB>
void row_k(const KActivations& xa, int64_t count, const uint8_t* row, int64_t bytes, float* out,
           int64_t ldo, __m512* acc_memory, __m128* min_memory) {
  const int64_t K = xa.K, supers = K / 256;
  const int64_t rows_x = MB > 0 ? MB : count;
  __m512 acc_registers[MB > 0 ? MB : 1];
  __m128 min_registers[MB > 0 ? MB : 1];
  __m512* acc = MB > 0 ? acc_registers : acc_memory;
  __m128* minsum = MB > 0 ? min_registers : min_memory;
  for (int64_t m = 0; m < rows_x; m++) {
    acc[m] = _mm512_setzero_ps();
    minsum[m] = _mm_setzero_ps();
  }
  static const __m512i ctl[4] = {word_picks(QT == Q6_K ? kPickQ6[0] : kPickQ4[0], QT == Q6_K),
                                 word_picks(QT == Q6_K ? kPickQ6[1] : kPickQ4[1], QT == Q6_K),
                                 word_picks(QT == Q6_K ? kPickQ6[2] : kPickQ4[2], QT == Q6_K),
                                 word_picks(QT == Q6_K ? kPickQ6[3] : kPickQ4[3], QT == Q6_K)};
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < supers; s++) {
    const uint8_t* b = row + s * bytes;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b) + kAhead + o, _MM_HINT_T0);
    __m512i codes[4], scale[4];
    float d, dmin = 0.0f;
    __m128i mn = _mm_setzero_si128();
    __m256i sc16 = _mm256_setzero_si256();
    if (QT == Q6_K) {
      // ql: 128 bytes, two halves of 64 (values 0-31 | 32-63 low nibbles, 64-95 | 96-127 high nibbles, per half of
      // 128 values); qh: 64 bytes, 2 bits per value (bits 0-1, 2-3, 4-5, 6-7: the four 32-value pieces of a half)
      d = half(b + 208);
      const __m512i top2 = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m512i qh =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
        codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                       _mm512_and_si512(_mm512_sllv_epi16(qh, counts(4, 2)), top2));
        codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                           _mm512_and_si512(_mm512_srlv_epi16(qh, counts(0, 2)), top2));
      }
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m512i all = _mm512_broadcast_i32x4(sc8);
      for (int c = 0; c < 4; c++) scale[c] = _mm512_srai_epi16(_mm512_shuffle_epi8(all, ctl[c]), 8);
      sc16 = _mm256_cvtepi8_epi16(sc8);
    } else {
      d = half(b);
      dmin = half(b + 2);
      // the 8 six-bit scales and mins from 12 bytes read as three 32-bit words: bytes 0-3 hold the low 6 bits of
      // scales 0-3 (top 2 bits: scales 4-7's), 4-7 of mins 0-3 (likewise), 8-11 the low 4 bits of scales/mins 4-7
      uint32_t w[3];
      std::memcpy(w, b + 4, 12);
      const uint32_t low6 = 0x3f3f3f3f, nib = 0x0f0f0f0f, top2 = 0x03030303;
      const uint64_t sc8 = static_cast<uint64_t>(w[0] & low6) |
                           (static_cast<uint64_t>((w[2] & nib) | (((w[0] >> 6) & top2) << 4)) << 32);
      const uint64_t mn8 = static_cast<uint64_t>(w[1] & low6) |
                           (static_cast<uint64_t>(((w[2] >> 4) & nib) | (((w[1] >> 6) & top2) << 4)) << 32);
      const __m512i all = _mm512_set1_epi64(static_cast<int64_t>(sc8));
      for (int c = 0; c < 4; c++) scale[c] = _mm512_shuffle_epi8(all, ctl[c]);
      mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(mn8)));
      const uint8_t* qs = QT == Q5_K ? b + 48 : b + 16;
      for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_loadu_si512(qs + 64 * h);
        codes[2 * h] = _mm512_and_si512(q, low4);
        codes[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
      }
      if (QT == Q5_K) {  // qh: 32 bytes, bit j of byte i the fifth bit of value i of sub-block j
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        codes[0] = _mm512_or_si512(codes[0], _mm512_and_si512(_mm512_sllv_epi16(qh, counts(4, 2)), bit4));
        codes[1] = _mm512_or_si512(codes[1], _mm512_and_si512(_mm512_sllv_epi16(qh, counts(3, 1)), bit4));
        codes[2] = _mm512_or_si512(codes[2], _mm512_and_si512(_mm512_srlv_epi16(qh, counts(0, 2)), bit4));
        codes[3] = _mm512_or_si512(codes[3], _mm512_and_si512(_mm512_srlv_epi16(qh, counts(1, 3)), bit4));
      }
    }
    for (int64_t m = 0; m < rows_x; m++) {
      const int64_t xm = m;
      const int8_t* x = xa.q.data() + xm * K + 256 * s;
      // a word per 2 products (|word| <= 2 * 63 * 127: vpmaddubsw never saturates here), times its scale
      __m512i total = _mm512_madd_epi16(_mm512_maddubs_epi16(codes[0], _mm512_loadu_si512(x)), scale[0]);
      for (int c = 1; c < 4; c++)
        total = _mm512_dpwssd_epi32(total, _mm512_maddubs_epi16(codes[c], _mm512_loadu_si512(x + 64 * c)), scale[c]);
      const float dx = xa.d[xm * supers + s];
      if (QT == Q6_K) {  // codes are q + 32: subtract 32 * sum over 16-value groups of scale * code sum
        const int16_t* sum16 = xa.sums.data() + xm * (K / 16) + 16 * s;
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sum16));
        const __m256i zero_point = _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5);
        total = _mm512_sub_epi32(total, _mm512_zextsi256_si512(zero_point));
      } else {
        const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xa.sums.data() + xm * (K / 32) + 8 * s));
        minsum[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn, sums)), _mm_set1_ps(dmin * dx), minsum[m]);
      }
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d * dx), acc[m]);
    }
  }
  for (int64_t m = 0; m < rows_x; m++) {
    const __m128 pair = _mm_add_ps(minsum[m], _mm_movehl_ps(minsum[m], minsum[m]));
    const float mins = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    out[m * ldo] = _mm512_reduce_add_ps(acc[m]) - mins;
  }
}

template <int64_t QT>
void mm_k(const float* x, int64_t M, const uint8_t* wp, int64_t row_bytes, int64_t bytes, float* op, int64_t N,
          int64_t K) {
  const KActivations xa(x, M, K, QT != Q6_K, QT == Q6_K ? 16 : 32);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<__m512> acc(M > 4 ? M : 0);  // more than 4 rows of x (a prefill): accumulators in memory
    std::vector<__m128> mins(M > 4 ? M : 0);
    for (int64_t n = begin; n < end; n++) {
      const uint8_t* row = wp + n * row_bytes;
      float* o = op + n;
      switch (M) {
        case 1: row_k<QT, 1>(xa, 1, row, bytes, o, N, nullptr, nullptr); break;
        case 2: row_k<QT, 2>(xa, 2, row, bytes, o, N, nullptr, nullptr); break;
        case 3: row_k<QT, 3>(xa, 3, row, bytes, o, N, nullptr, nullptr); break;
        case 4: row_k<QT, 4>(xa, 4, row, bytes, o, N, nullptr, nullptr); break;
        default: row_k<QT, 0>(xa, M, row, bytes, o, N, acc.data(), mins.data());
      }
    }
  });
}

// -------------------------------------------------------------------------------------------- blocks of 32 values
// Activations for the blocks of 32, per row of x: int8 codes (one scale per 32 values) in the order the weights'
// codes come out of two blocks' bytes (Q4_0, Q4_1, Q5_0: each 64 values as [0-15, 32-47, 16-31, 48-63], a nibble
// block's low nibbles then its high ones; Q8_0: natural order), and per 64 values three vectors of 16 lanes, a lane
// per 4 codes: the code sums times the zero point (8, 16, 128; Q4_1 none), each lane's scale dx, and (Q4_1) the code
// sums times dx (what the weights' mins multiply)
struct Activations32 {
  int64_t K;
  std::vector<int8_t> q;
  std::vector<__m512i> zero_point;
  std::vector<__m512> dx, sum_dx;

  Activations32(const float* x, int64_t M, int64_t K_, int64_t qtype)
      : K(K_), q(M * K_), zero_point(M * (K_ / 64)), dx(M * (K_ / 64)), sum_dx(qtype == Q4_1 ? M * (K_ / 64) : 0) {
    const bool nibbles = qtype != Q8_0;
    const int shift = qtype == Q4_0 ? 3 : qtype == Q5_0 ? 4 : 7;
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i nibble_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i natural_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    std::vector<int8_t> natural(K);
    for (int64_t m = 0; m < M; m++) {
      std::vector<float> d(K / 32);
      for (int64_t g = 0; g < K / 32; g++) d[g] = quantize_group(x + m * K + 32 * g, 32, natural.data() + 32 * g);
      int8_t* out = q.data() + m * K;
      for (int64_t c = 0; c < K / 64; c++) {
        for (int piece = 0; piece < 4; piece++) {
          static const int from[4] = {0, 32, 16, 48};
          std::memcpy(out + 64 * c + 16 * piece, natural.data() + 64 * c + (nibbles ? from[piece] : 16 * piece), 16);
        }
        const int64_t i = m * (K / 64) + c;
        const __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(out + 64 * c));
        zero_point[i] = _mm512_slli_epi32(lanes, shift);
        const __m512 pair = _mm512_castps128_ps512(_mm_setr_ps(d[2 * c], d[2 * c + 1], 0.0f, 0.0f));
        dx[i] = _mm512_permutexvar_ps(nibbles ? nibble_lanes : natural_lanes, pair);
        if (qtype == Q4_1) sum_dx[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(lanes), dx[i]);
      }
    }
  }
};

// One weight row of a 32-value type times every row of x (MB of them in registers, or `count` in memory: as row_k).
// Per two blocks (64 values): the row's codes as one vector in the activations' order and its two scales (and mins)
// per lane, once; then per row of x one vpdpbusd, the zero point off the integer sums, and fp32 multiply-adds by
// dw * dx (and the mins by the code sums). A row of x goes through the same operations whatever the number of rows.
template <int64_t QT, int MB>
void row_32(const Activations32& xa, int64_t count, const uint8_t* row, int64_t bytes, float* out, int64_t ldo,
            __m512* acc_memory) {
  const int64_t K = xa.K, chunks = K / 64;
  const int64_t rows_x = MB > 0 ? MB : count;
  const __m512i nibble_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const __m512i natural_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 acc_registers[MB > 0 ? MB : 1];
  __m512* acc = MB > 0 ? acc_registers : acc_memory;
  for (int64_t m = 0; m < rows_x; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; c++) {
    const uint8_t* a = row + 2 * c * bytes;
    const uint8_t* b = a + bytes;
    for (int64_t o = 0; o < 2 * bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(a) + kAhead + o, _MM_HINT_T0);
    __m512i codes;
    if (QT == Q8_0) {  // int8 + 128
      codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2))),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), 1);
      codes = _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
    } else {
      const int64_t at = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : 6;
      const __m256i both = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b + at),
                                               reinterpret_cast<const __m128i*>(a + at));
      codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(both, low4)),
                                 _mm256_and_si256(_mm256_srli_epi16(both, 4), low4), 1);
      if (QT == Q5_0) {  // the fifth bits: 32 per block, bit i for value i
        uint32_t ha, hb;
        std::memcpy(&ha, a + 2, 4);
        std::memcpy(&hb, b + 2, 4);
        const uint64_t bits = static_cast<uint64_t>(ha & 0xFFFF) | static_cast<uint64_t>(hb & 0xFFFF) << 16 |
                              static_cast<uint64_t>(ha >> 16) << 32 | static_cast<uint64_t>(hb >> 16) << 48;
        codes = _mm512_mask_add_epi8(codes, static_cast<__mmask64>(bits), codes, _mm512_set1_epi8(0x10));
      }
    }
    uint16_t h[4];
    std::memcpy(&h[0], a, 2);
    std::memcpy(&h[1], b, 2);
    if (QT == Q4_1) {
      std::memcpy(&h[2], a + 2, 2);
      std::memcpy(&h[3], b + 2, 2);
    } else {
      h[2] = h[3] = 0;
    }
    uint64_t packed;
    std::memcpy(&packed, h, 8);
    const __m512 scales = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(packed))));
    const __m512 dw = _mm512_permutexvar_ps(QT == Q8_0 ? natural_lanes : nibble_lanes, scales);
    const __m512 mw = QT == Q4_1 ? _mm512_permutexvar_ps(_mm512_add_epi32(nibble_lanes, _mm512_set1_epi32(2)), scales)
                                 : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows_x; m++) {
      const int64_t i = m * chunks + c;
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(xa.q.data() + 64 * i));
      if (QT != Q4_1) dot = _mm512_sub_epi32(dot, xa.zero_point[i]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, xa.dx[i]), acc[m]);
      if (QT == Q4_1) acc[m] = _mm512_fmadd_ps(mw, xa.sum_dx[i], acc[m]);
    }
  }
  for (int64_t m = 0; m < rows_x; m++) out[m * ldo] = _mm512_reduce_add_ps(acc[m]);
}

template <int64_t QT>
void mm_32(const float* x, int64_t M, const uint8_t* wp, int64_t row_bytes, int64_t bytes, float* op, int64_t N,
           int64_t K) {
  const Activations32 xa(x, M, K, QT);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<__m512> acc(M > 4 ? M : 0);  // more than 4 rows of x (a prefill): accumulators in memory
    for (int64_t n = begin; n < end; n++) {
      const uint8_t* row = wp + n * row_bytes;
      float* o = op + n;
      switch (M) {
        case 1: row_32<QT, 1>(xa, 1, row, bytes, o, N, nullptr); break;
        case 2: row_32<QT, 2>(xa, 2, row, bytes, o, N, nullptr); break;
        case 3: row_32<QT, 3>(xa, 3, row, bytes, o, N, nullptr); break;
        case 4: row_32<QT, 4>(xa, 4, row, bytes, o, N, nullptr); break;
        default: row_32<QT, 0>(xa, M, row, bytes, o, N, acc.data());
      }
    }
  });
}

// the kernel's rows, for the operator's shell (gguf_formats.h)
struct Rows {
  template <int64_t QT>
  static void mm(const float* x, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t bytes, float* out, int64_t N,
                 int64_t K) {
    if constexpr (QT == Q4_K || QT == Q5_K || QT == Q6_K)
      mm_k<QT>(x, M, w, row_bytes, bytes, out, N, K);
    else
      mm_32<QT>(x, M, w, row_bytes, bytes, out, N, K);
  }
};

}  // namespace

TORCH_LIBRARY(optimum_ipex_spec_gguf_vnni, m) { m.def("mm(Tensor x, Tensor blocks, int qtype, int K) -> Tensor"); }
TORCH_LIBRARY_IMPL(optimum_ipex_spec_gguf_vnni, CPU, m) { m.impl("mm", &fast_mm_op<Rows>); }
