// The fast GGUF mode on weights rearranged so that 16 weight rows share each vector (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
// Q6_K): one 32-bit lane per weight row, so an AVX512-VNNI vpdpbusd multiplies 4 codes of 16 rows by the same 4
// activation codes (broadcast), and a block's scale (a K type's sub-block scale, with one integer multiply) applies
// once per 16 rows and row of x. The per-value work of a row of x is then one vpdpbusd per 64 products, where the
// row-major kernel (gguf_gemm_vnni.cpp) spends a vpmaddubsw and a vpmaddwd (K types) or a vpdpbusd and a conversion
// and multiply-add per 64 values (the others): the rows of a verification or a prefill cost less beside the weight
// reads they share. The same arithmetic as that kernel: activations rounded to int8 per 256 values (K types) or 32
// (gguf_activations.h), integer sums per (sub-)block, exact; fp32 multiply-adds by the scales per super-block
// (K types) or block; only where those fp32 operations round differs.
//
// Operators (namespace optimum_ipex_spec_gguf_vnni): interleave, deinterleave and mm_interleaved, the layout and its
// shapes as gguf_interleaved_layout.h describes them.
//
// Each output is the same sequence of operations whatever the number of rows of x (1-4 accumulate in registers,
// more in memory), so speculative verification over this layout returns the target's own greedy tokens. Groups of
// 16 weight rows are split between torch's threads (built with OpenMP), each group on one thread.

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

// How far ahead of the bytes being read the K types' kernel prefetches, spread over the reads (one prefetch per 64
// bytes): one group's super-block for Q4_K, two of Q4_K's for Q6_K (chosen by timing on one CPU: docs/gguf.md)
template <int64_t QT>
constexpr int64_t kAhead = QT == Q4_K ? kQ4KGroup : 2 * kQ4KGroup;

template <int64_t QT>
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p) + kAhead<QT>, _MM_HINT_T0); }

// 4 activation codes, as one 32-bit word broadcast to every lane (compiled to one broadcast from memory)
inline __m512i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm512_set1_epi32(word);
}

// ------------------------------------------------------------------------------------------------ the kernel
// 16 weight rows (one group) times every row of x: MB of them (1-4, accumulators in registers) or `count` (MB = 0,
// accumulators in memory). Per super-block and 32 values: the 16 rows' codes as 8 vectors (4 values per lane) once;
// then per row of x 8 vpdpbusd against its broadcast codes (Q6_K: 4 per sub-block of 16), each sub-block's integer
// sum times its scale (vpmulld), and, per super-block, the minimums (Q4_K) or the zero point 32 (Q6_K) from the
// activations' code sums (vpdpwssd), then one fp32 multiply-add by d * dx per lane (and one by dmin * dx).
template <int64_t QT, int MB>
void group_rows(const KActivations& xa, int64_t count, const uint8_t* grp, float* out, int64_t ldo,
                __m512i* memory) {
  const int64_t K = xa.K, supers = K / 256, per = QT == Q4_K ? 32 : 16;
  const int64_t rows_x = MB > 0 ? MB : count;
  __m512 accf_registers[MB > 0 ? MB : 1];
  __m512i acci_registers[MB > 0 ? MB : 1], side_registers[MB > 0 ? MB : 1];
  __m512* accf = MB > 0 ? accf_registers : reinterpret_cast<__m512*>(memory);
  __m512i* acci = MB > 0 ? acci_registers : memory + rows_x;
  __m512i* side = MB > 0 ? side_registers : memory + 2 * rows_x;  // Q4_K: minimums; Q6_K: zero point
  for (int64_t m = 0; m < rows_x; m++) accf[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  for (int64_t s = 0; s < supers; s++) {
    const uint8_t* p = grp + s * group_bytes(QT);
    const uint8_t* codes = QT == Q4_K ? p + 320 : p;
    constexpr int64_t stride = QT == Q4_K ? kQ4KBlock : kQ6KBlock;
    const uint8_t* header = QT == Q4_K ? p : p + kQ6Scales;  // d, scales (and Q4_K's minimums)
    for (int64_t o = 0; o < 320; o += 64) prefetch<QT>(header + o);
    for (int64_t m = 0; m < rows_x; m++) {
      acci[m] = _mm512_setzero_si512();
      side[m] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; j++) {
      __m512i c[8];
      for (int t = 0; t < 4; t++) {
        prefetch<QT>(codes + stride * j + 64 * t);
        const __m512i w = _mm512_loadu_si512(codes + stride * j + 64 * t);
        c[2 * t] = _mm512_and_si512(w, low4);
        c[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      }
      if (QT == Q4_K) {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 64 + 16 * j)));
        for (int64_t m = 0; m < rows_x; m++) {
          const int8_t* xq = xa.q.data() + m * K + 256 * s + 32 * j;
          __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], broadcast4(xq));
          for (int v = 1; v < 8; v++) sum = _mm512_dpbusd_epi32(sum, c[v], broadcast4(xq + 4 * v));
          acci[m] = _mm512_add_epi32(acci[m], _mm512_mullo_epi32(sum, sc));
        }
      } else {
        // the top 2 bits: value 4k + b of a half (16 values) in bits 2k..2k+1 of byte b; c[v] holds values 4v..4v+3
        const uint8_t* high = codes + stride * j + 256;
        for (int piece = 0; piece < 2; piece++) {
          prefetch<QT>(high + 64 * piece);
          const __m512i h = _mm512_loadu_si512(high + 64 * piece);
          const int v = 4 * piece;
          c[v] = _mm512_or_si512(c[v], _mm512_and_si512(_mm512_slli_epi16(h, 4), top2));
          c[v + 1] = _mm512_or_si512(c[v + 1], _mm512_and_si512(_mm512_slli_epi16(h, 2), top2));
          c[v + 2] = _mm512_or_si512(c[v + 2], _mm512_and_si512(h, top2));
          c[v + 3] = _mm512_or_si512(c[v + 3], _mm512_and_si512(_mm512_srli_epi16(h, 2), top2));
        }
        // scales 2j and 2j + 1 as int16 words per lane, and each as int32
        const __m256i pair8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kQ6Scales + 32 * j));
        const __m512i pair = _mm512_cvtepi8_epi16(pair8);
        const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), sc1 = _mm512_srai_epi32(pair, 16);
        for (int64_t m = 0; m < rows_x; m++) {
          const int8_t* xq = xa.q.data() + m * K + 256 * s + 32 * j;
          __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], broadcast4(xq));
          for (int v = 1; v < 4; v++) s0 = _mm512_dpbusd_epi32(s0, c[v], broadcast4(xq + 4 * v));
          __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[4], broadcast4(xq + 16));
          for (int v = 5; v < 8; v++) s1 = _mm512_dpbusd_epi32(s1, c[v], broadcast4(xq + 4 * v));
          acci[m] = _mm512_add_epi32(acci[m], _mm512_mullo_epi32(s0, sc0));
          acci[m] = _mm512_add_epi32(acci[m], _mm512_mullo_epi32(s1, sc1));
          int32_t sums;  // the activations' code sums of the two sub-blocks, as two int16
          std::memcpy(&sums, xa.sums.data() + m * (K / per) + 16 * s + 2 * j, 4);
          side[m] = _mm512_dpwssd_epi32(side[m], pair, _mm512_set1_epi32(sums));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(QT == Q4_K ? p : p + kQ6D)));
    if (QT == Q4_K) {  // minimums: sum over sub-blocks of min * code sum, two sub-blocks per vpdpwssd
      for (int pair = 0; pair < 4; pair++) {
        const __m512i mins =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 192 + 32 * pair)));
        for (int64_t m = 0; m < rows_x; m++) {
          int32_t sums;
          std::memcpy(&sums, xa.sums.data() + m * (K / per) + 8 * s + 2 * pair, 4);
          side[m] = _mm512_dpwssd_epi32(side[m], mins, _mm512_set1_epi32(sums));
        }
      }
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      for (int64_t m = 0; m < rows_x; m++) {
        const __m512 dx = _mm512_set1_ps(xa.d[m * supers + s]);
        accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acci[m]), _mm512_mul_ps(d, dx), accf[m]);
        accf[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(side[m]), _mm512_mul_ps(dmin, dx), accf[m]);
      }
    } else {  // codes are q + 32: take 32 * sum over sub-blocks of scale * code sum
      for (int64_t m = 0; m < rows_x; m++) {
        const __m512 dx = _mm512_set1_ps(xa.d[m * supers + s]);
        const __m512i total = _mm512_sub_epi32(acci[m], _mm512_slli_epi32(side[m], 5));
        accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, dx), accf[m]);
      }
    }
  }
  for (int64_t m = 0; m < rows_x; m++) _mm512_storeu_ps(out + m * ldo, accf[m]);
}

// 16 weight rows (one group) of a 32-value type times every row of x (MB in registers or `count` in memory, as
// group_rows). Per block: the 16 rows' 32 codes as 8 vectors (4 values per lane) and their scales, once; then per row
// of x 8 vpdpbusd against its broadcast codes, the zero point off the integer sum, one fp32 multiply-add by dw * dx
// (and Q4_1's minimums by dx times the code sum).
template <int64_t QT, int MB>
void group_rows32(const Activations32& xa, int64_t count, const uint8_t* grp, float* out, int64_t ldo,
                  __m512* memory) {
  const int64_t K = xa.K, blocks = K / 32;
  constexpr int64_t code_bytes = code_bytes32(QT), bytes = group_bytes(QT);
  const int64_t rows_x = MB > 0 ? MB : count;
  __m512 acc_registers[MB > 0 ? MB : 1];
  __m512* acc = MB > 0 ? acc_registers : memory;
  for (int64_t m = 0; m < rows_x; m++) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  for (int64_t j = 0; j < blocks; j++) {
    const uint8_t* p = grp + j * bytes;
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p) + 8 * bytes + o, _MM_HINT_T0);  // 8 blocks ahead
    __m512i c[8];
    if (QT == Q8_0) {
      for (int v = 0; v < 8; v++) c[v] = _mm512_loadu_si512(p + 64 * v);
    } else {
      for (int t = 0; t < 4; t++) {
        const __m512i w = _mm512_loadu_si512(p + 64 * t);
        c[2 * t] = _mm512_and_si512(w, low4);
        c[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      }
      if (QT == Q5_0) {  // byte (row, i) of the fifth bits: bit v for value 4v + i
        const __m512i high = _mm512_loadu_si512(p + 256);
        for (int v = 0; v < 8; v++)
          c[v] = _mm512_mask_add_epi8(c[v], _mm512_test_epi8_mask(high, _mm512_set1_epi8(static_cast<char>(1 << v))),
                                      c[v], bit4);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + code_bytes)));
    const uint8_t* mins = p + code_bytes + 32;  // Q4_1's m
    const __m512 mw = QT == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins)))
                                 : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows_x; m++) {
      const int64_t i = m * blocks + j;
      const int8_t* xq = xa.q.data() + m * K + 32 * j;
      __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], broadcast4(xq));
      for (int v = 1; v < 8; v++) sum = _mm512_dpbusd_epi32(sum, c[v], broadcast4(xq + 4 * v));
      if (QT != Q4_1) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(xa.zero_point[i]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(xa.dx[i])), acc[m]);
      if (QT == Q4_1) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xa.sum_dx[i]), acc[m]);
    }
  }
  for (int64_t m = 0; m < rows_x; m++) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

// the kernel, for the layout's driver (gguf_interleaved_layout.h: Groups)
struct Kernel {
  using Memory = __m512i;
  static constexpr int64_t kMemoryPerRow = 3;

  template <int64_t QT, int MB, class Activations>
  static void group(const Activations& xa, int64_t count, const uint8_t* grp, float* out, int64_t ldo,
                    Memory* memory) {
    if constexpr (QT == Q4_K || QT == Q6_K)
      group_rows<QT, MB>(xa, count, grp, out, ldo, memory);
    else
      group_rows32<QT, MB>(xa, count, grp, out, ldo, reinterpret_cast<__m512*>(memory));
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_ipex_spec_gguf_vnni, m) { optimum_ipex_spec_gguf_layout::define_layout(m); }
TORCH_LIBRARY_IMPL(optimum_ipex_spec_gguf_vnni, CPU, m) { optimum_ipex_spec_gguf_layout::implement_layout<Kernel>(m); }
