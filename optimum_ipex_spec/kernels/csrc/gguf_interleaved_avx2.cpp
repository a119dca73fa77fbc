// The fast GGUF mode on the interleaved layout (gguf_interleaved_layout.h: 16 weight rows per 64 bytes, 4 codes of
// one row per 32-bit lane) for CPUs with AVX2 but no AVX512-VNNI. A 256-bit vector holds 8 of a group's 16 rows (its
// first or second half: the first or last 32 bytes of each 64); per row of x, 4 activation codes broadcast to every
// lane multiply 4 codes of 8 rows in one vpmaddubsw, and the int16 words of several of them are added before one
// vpmaddwd widens them to int32 (by the sub-block's scale, for the K types): about half the instructions per product
// of the row-major AVX2 kernel (gguf_fast_avx2.cpp), whose vpmaddubsw/vpmaddwd pair serves one weight row, and a
// block's scales applied once per 8 rows. So the extra rows of x of a verification or a prefill cost less, and one
// row of x too.
//
// The integers are the VNNI kernel's (gguf_interleaved_vnni.cpp), exactly: the same activations (gguf_activations.h),
// the same integer sums per (sub-)block (no int16 word can saturate: 8 words of 4-bit codes, 2 of Q6_K's 6-bit ones,
// 4 of the 5-bit ones sum below 2^15; Q8_0 multiplies its signed codes through vpsignb, as the row-major kernel
// does), and the same fp32 operations per lane in the same order. So its outputs are the VNNI kernel's, bit for bit,
// on either CPU; and, like it, each output is the same sequence of operations whatever the number of rows of x, so
// speculative verification over this layout returns the target's own greedy tokens.
//
// Operators (namespace optimum_ipex_spec_gguf_fast_avx2, beside the row-major mm of gguf_fast_avx2.cpp): interleave,
// deinterleave and mm_interleaved, as gguf_interleaved_layout.h describes them. Groups of 16 weight rows are split
// between torch's threads, each group on one thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_activations.h"
#include "gguf_interleaved_layout.h"

namespace {

using optimum_ipex_spec_activations::Activations32;
using optimum_ipex_spec_activations::KActivations;
using namespace optimum_ipex_spec_gguf_layout;

// how far ahead of the bytes being read a group prefetches (one prefetch per 64 bytes read)
template <int64_t QT>
constexpr int64_t kAhead = QT == Q4_K ? kQ4KGroup : QT == Q6_K ? 2 * kQ4KGroup : 8 * group_bytes(QT);

template <int64_t QT>
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p) + kAhead<QT>, _MM_HINT_T0); }

// 4 activation codes, as one 32-bit word broadcast to every lane
inline __m256i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}

// the 8 fp16 values of a half group (rows 8h..8h+7) at p, as fp32
inline __m256 halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// int16 words of n products' pairs, summed: c[v] (unsigned codes, 4 per lane) times the 4 codes xq[4v..4v+3]
template <int N>
inline __m256i words(const __m256i* c, const int8_t* xq) {
  __m256i w = _mm256_maddubs_epi16(c[0], broadcast4(xq));
  for (int v = 1; v < N; v++) w = _mm256_add_epi16(w, _mm256_maddubs_epi16(c[v], broadcast4(xq + 4 * v)));
  return w;
}

// The accumulators of one row of x: fp32 for the two halves of a group, and an integer sum
struct Acc {
  __m256 f[2];
  __m256i sum;  // a K type's integer sum of the super-block and half being read
};

// 16 weight rows (one group) of a K type times every row of x: MB of them (1-4, accumulators on the stack) or `count`
// (MB = 0, accumulators in `memory`). Per super-block and half (8 rows), per sub-block of 32 values: the 8 rows'
// codes as 8 vectors (4 values per lane), once; then per row of x 8 vpmaddubsw against its broadcast codes, their
// words added (Q6_K: in pairs), one vpmaddwd by the sub-block's scale (Q6_K: per 16 values), summed in int32 over
// the super-block; then the minimums (Q4_K) or the zero point 32 (Q6_K) from the activations' code sums (vpmaddwd),
// and one fp32 multiply-add by d * dx per lane (and one by dmin * dx). The half is the outer loop so that a row of
// x's integer sums stay in registers.
template <int64_t QT, int MB>
void group_k(const KActivations& xa, int64_t count, const uint8_t* grp, float* out, int64_t ldo, Acc* memory) {
  const int64_t K = xa.K, supers = K / 256, per = QT == Q4_K ? 32 : 16;
  Acc registers[MB > 0 ? MB : 1];
  Acc* acc = MB > 0 ? registers : memory;
  const int64_t rows_x = MB > 0 ? MB : count;
  for (int64_t m = 0; m < rows_x; m++) acc[m].f[0] = acc[m].f[1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  // per 32-bit lane: its low int16 word in both halves, or its high one
  const __m256i low_word = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i high_word = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                             2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
  constexpr int64_t stride = QT == Q4_K ? kQ4KBlock : kQ6KBlock;
  for (int64_t s = 0; s < supers; s++) {
    const uint8_t* p = grp + s * group_bytes(QT);
    const uint8_t* codes = QT == Q4_K ? p + 320 : p;
    const uint8_t* header = QT == Q4_K ? p : p + kQ6Scales;  // d, scales (and Q4_K's minimums)
    for (int64_t o = 0; o < 320; o += 64) prefetch<QT>(header + o);
    for (int h = 0; h < 2; h++) {
      for (int64_t m = 0; m < rows_x; m++) acc[m].sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; j++) {
        if (h == 0) {
          for (int t = 0; t < 4; t++) prefetch<QT>(codes + stride * j + 64 * t);
          if (QT == Q6_K)
            for (int piece = 0; piece < 2; piece++) prefetch<QT>(codes + stride * j + 256 + 64 * piece);
        }
        __m256i c[8];
        for (int t = 0; t < 4; t++) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + stride * j + 64 * t + 32 * h));
          c[2 * t] = _mm256_and_si256(w, low4);
          c[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        }
        if (QT == Q4_K) {
          const __m256i sc32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64 + 16 * j +
                                                                                                     8 * h)));
          const __m256i sc = _mm256_or_si256(sc32, _mm256_slli_epi32(sc32, 16));  // the scale in both words
          for (int64_t m = 0; m < rows_x; m++) {
            const int8_t* xq = xa.q.data() + m * K + 256 * s + 32 * j;
            acc[m].sum = _mm256_add_epi32(acc[m].sum, _mm256_madd_epi16(words<8>(c, xq), sc));
          }
        } else {
          // the top 2 bits: value 4k + b of a half (16 values) in bits 2k..2k+1 of byte b; c[v] holds values 4v..4v+3
          const uint8_t* high = codes + stride * j + 256;
          for (int piece = 0; piece < 2; piece++) {
            const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + 64 * piece + 32 * h));
            const int v = 4 * piece;
            c[v] = _mm256_or_si256(c[v], _mm256_and_si256(_mm256_slli_epi16(top, 4), top2));
            c[v + 1] = _mm256_or_si256(c[v + 1], _mm256_and_si256(_mm256_slli_epi16(top, 2), top2));
            c[v + 2] = _mm256_or_si256(c[v + 2], _mm256_and_si256(top, top2));
            c[v + 3] = _mm256_or_si256(c[v + 3], _mm256_and_si256(_mm256_srli_epi16(top, 2), top2));
          }
          // scales 2j and 2j + 1 of the 8 rows, each in both int16 words of its row's lane
          const __m256i pair = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kQ6Scales + 32 * j + 16 * h)));
          const __m256i sc0 = _mm256_shuffle_epi8(pair, low_word), sc1 = _mm256_shuffle_epi8(pair, high_word);
          for (int64_t m = 0; m < rows_x; m++) {
            const int8_t* xq = xa.q.data() + m * K + 256 * s + 32 * j;
            __m256i t = _mm256_add_epi32(_mm256_madd_epi16(words<2>(c, xq), sc0),
                                         _mm256_madd_epi16(words<2>(c + 2, xq + 8), sc0));
            t = _mm256_add_epi32(t, _mm256_madd_epi16(words<2>(c + 4, xq + 16), sc1));
            t = _mm256_add_epi32(t, _mm256_madd_epi16(words<2>(c + 6, xq + 24), sc1));
            acc[m].sum = _mm256_add_epi32(acc[m].sum, t);
          }
        }
      }
      const __m256 d = halves((QT == Q4_K ? p : p + kQ6D) + 16 * h);
      for (int64_t m = 0; m < rows_x; m++) {
        // Q4_K: the minimums times the code sums per sub-block; Q6_K: the scales times the code sums per 16 values
        __m256i side = _mm256_setzero_si256();
        for (int pair = 0; pair < (QT == Q4_K ? 4 : 8); pair++) {
          const uint8_t* at = QT == Q4_K ? p + 192 + 32 * pair + 16 * h : p + kQ6Scales + 32 * pair + 16 * h;
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
          const __m256i weights = QT == Q4_K ? _mm256_cvtepu8_epi16(bytes) : _mm256_cvtepi8_epi16(bytes);
          int32_t sums;  // the activations' code sums of two sub-blocks (Q4_K) or 16-value pieces (Q6_K), as int16
          std::memcpy(&sums, xa.sums.data() + m * (K / per) + (QT == Q4_K ? 8 : 16) * s + 2 * pair, 4);
          side = _mm256_add_epi32(side, _mm256_madd_epi16(weights, _mm256_set1_epi32(sums)));
        }
        const __m256 dx = _mm256_set1_ps(xa.d[m * supers + s]);
        if (QT == Q4_K) {
          const __m256 dmin = halves(p + 32 + 16 * h);
          acc[m].f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m].sum), _mm256_mul_ps(d, dx), acc[m].f[h]);
          acc[m].f[h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(side), _mm256_mul_ps(dmin, dx), acc[m].f[h]);
        } else {  // codes are q + 32: take 32 * sum over the pieces of scale * code sum
          const __m256i total = _mm256_sub_epi32(acc[m].sum, _mm256_slli_epi32(side, 5));
          acc[m].f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[m].f[h]);
        }
      }
    }
  }
  for (int64_t m = 0; m < rows_x; m++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + m * ldo + 8 * h, acc[m].f[h]);
}

// 16 weight rows (one group) of a 32-value type times every row of x (as group_k). Per block and half: the 8 rows'
// 32 codes as 8 vectors (4 values per lane) and their scales, once; then per row of x 8 vpmaddubsw against its
// broadcast codes, their words added by 8 (Q5_0: by 4; Q8_0: signed, each widened), widened by vpmaddwd, the zero
// point off the integer sum, one fp32 multiply-add by dw * dx (and Q4_1's minimums by dx times the code sum).
template <int64_t QT, int MB>
void group_32(const Activations32& xa, int64_t count, const uint8_t* grp, float* out, int64_t ldo, Acc* memory) {
  const int64_t K = xa.K, blocks = K / 32;
  Acc registers[MB > 0 ? MB : 1];
  Acc* acc = MB > 0 ? registers : memory;
  const int64_t rows_x = MB > 0 ? MB : count;
  constexpr int64_t code_bytes = code_bytes32(QT), bytes = group_bytes(QT);
  for (int64_t m = 0; m < rows_x; m++) acc[m].f[0] = acc[m].f[1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t j = 0; j < blocks; j++) {
    const uint8_t* p = grp + j * bytes;
    for (int64_t o = 0; o < bytes; o += 64) prefetch<QT>(p + o);
    for (int h = 0; h < 2; h++) {
      __m256i c[8];
      if (QT == Q8_0) {  // the signed codes back (q + 128 flipped), to multiply through vpsignb
        for (int v = 0; v < 8; v++)
          c[v] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * v + 32 * h)), flip);
      } else {
        for (int t = 0; t < 4; t++) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * t + 32 * h));
          c[2 * t] = _mm256_and_si256(w, low4);
          c[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        }
        if (QT == Q5_0) {  // byte (row, i) of the fifth bits: bit v for value 4v + i
          const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 + 32 * h));
          for (int v = 0; v < 8; v++) {
            const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << v));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
            c[v] = _mm256_or_si256(c[v], _mm256_and_si256(set, bit4));
          }
        }
      }
      const __m256 dw = halves(p + code_bytes + 16 * h);
      const __m256 mw = QT == Q4_1 ? halves(p + code_bytes + 32 + 16 * h) : _mm256_setzero_ps();
      for (int64_t m = 0; m < rows_x; m++) {
        const int64_t i = m * blocks + j;
        const int8_t* xq = xa.q.data() + m * K + 32 * j;
        __m256i sum;
        if (QT == Q8_0) {  // sum of q * x, the VNNI kernel's sum of (q + 128) * x less its zero point 128 * sum(x)
          sum = _mm256_setzero_si256();
          for (int v = 0; v < 8; v++) {
            const __m256i x = broadcast4(xq + 4 * v);
            const __m256i w = _mm256_maddubs_epi16(_mm256_sign_epi8(c[v], c[v]), _mm256_sign_epi8(x, c[v]));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(w, ones));
          }
        } else {
          if constexpr (QT == Q5_0)  // 5-bit codes: 4 words at most before widening
            sum = _mm256_add_epi32(_mm256_madd_epi16(words<4>(c, xq), ones),
                                   _mm256_madd_epi16(words<4>(c + 4, xq + 16), ones));
          else  // 4-bit codes: all 8
            sum = _mm256_madd_epi16(words<8>(c, xq), ones);
          if (QT != Q4_1) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(xa.zero_point[i]));
        }
        acc[m].f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(xa.dx[i])),
                                      acc[m].f[h]);
        if (QT == Q4_1) acc[m].f[h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xa.sum_dx[i]), acc[m].f[h]);
      }
    }
  }
  for (int64_t m = 0; m < rows_x; m++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + m * ldo + 8 * h, acc[m].f[h]);
}

// the kernel, for the layout's driver (gguf_interleaved_layout.h: Groups)
struct Kernel {
  using Memory = Acc;
  static constexpr int64_t kMemoryPerRow = 1;

  template <int64_t QT, int MB, class Activations>
  static void group(const Activations& xa, int64_t count, const uint8_t* grp, float* out, int64_t ldo,
                    Memory* memory) {
    if constexpr (QT == Q4_K || QT == Q6_K)
      group_k<QT, MB>(xa, count, grp, out, ldo, memory);
    else
      group_32<QT, MB>(xa, count, grp, out, ldo, memory);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_ipex_spec_gguf_fast_avx2, m) { optimum_ipex_spec_gguf_layout::define_layout(m); }
TORCH_LIBRARY_IMPL(optimum_ipex_spec_gguf_fast_avx2, CPU, m) {
  optimum_ipex_spec_gguf_layout::implement_layout<Kernel>(m);
}
