// The fast GGUF mode's activations (shared by gguf_gemm_vnni.cpp, gguf_interleaved_vnni.cpp,
// gguf_interleaved_avx2.cpp and gguf_fast_avx2.cpp): each row of x rounded to int8 codes with one fp32 scale per group
// of values, as llama.cpp's q8_0 / q8_K do. Compiled with AVX-512 or with AVX2 alone: the same codes and scales either
// way (the largest magnitude is exact, the product and its rounding to nearest even the same operation per value).

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_formats.h"

namespace optimum_ipex_spec_activations {

using namespace optimum_ipex_spec_gguf_formats;

// values x[0..n) (n a multiple of 16) rounded to int8 codes q with one scale, returned: d = max|x| / 127,
// q = round(x / d), nearest even; a NaN or an infinity among them gives codes 0 and a NaN scale (NaN outputs)
inline float quantize_group(const float* x, int64_t n, int8_t* q) {
#ifdef __AVX512F__
  __m512 amax = _mm512_setzero_ps();
  __mmask16 nan = 0;  // max_ps drops a NaN; a NaN activation must give NaN outputs, as the exact mode does
  for (int64_t k = 0; k < n; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
  }
  const float top = nan ? NAN : _mm512_reduce_max_ps(amax);
#else
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps();
  int nan = 0;
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float top = lanes[0];
  for (int i = 1; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
  if (nan) top = NAN;
#endif
  if (!std::isfinite(top)) {  // a NaN or an infinity among them: codes 0 and a NaN scale, so NaN outputs
    std::memset(q, 0, static_cast<size_t>(n));
    return NAN;
  }
  // a largest |x| below about 4e-37 makes 127 / top infinite: those codes stay 0 (their products are below 1e-36)
  const float ratio = top > 0 ? 127.0f / top : 0.0f;
  const float inverse = std::isfinite(ratio) ? ratio : 0.0f;
#ifdef __AVX512F__
  const __m512 inv = _mm512_set1_ps(inverse);
  for (int64_t k = 0; k < n; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(v));
  }
#else
  const __m256 inv = _mm256_set1_ps(inverse);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inv));  // |v| <= 127
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(words, words));
  }
#endif
  return top / 127.0f;
}

// ------------------------------------------------------------------------------------------------ the K types
// Activations for the K types, per row of x: the int8 codes in the order the weights' codes come out of their bytes
// (Q4_K, Q5_K: each 128 values as [0-31, 64-95, 32-63, 96-127], since byte j of a 64-value chunk holds values j and
// j + 32 in its two nibbles; Q6_K: natural order), one scale per 256 values, and the int16 sums of the codes per 16
// values (Q6_K: what its zero point subtracts, scale by scale) or per 32 (Q4_K, Q5_K: what the mins subtract)
struct KActivations {
  int64_t K, per;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums;

  KActivations(const float* x, int64_t M, int64_t K_, bool interleave, int64_t per_)
      : K(K_), per(per_), q(M * K_), d(M * (K_ / 256)), sums(M * (K_ / per_)) {
    std::vector<int8_t> natural(K);
    for (int64_t m = 0; m < M; m++) {
      for (int64_t g = 0; g < K / 256; g++)
        d[m * (K / 256) + g] = quantize_group(x + m * K + 256 * g, 256, natural.data() + 256 * g);
      for (int64_t j = 0; j < K / per; j++) {
        int32_t s = 0;  // at most 32 * 127 in magnitude
        for (int64_t i = 0; i < per; i++) s += natural[per * j + i];
        sums[m * (K / per) + j] = static_cast<int16_t>(s);
      }
      int8_t* out = q.data() + m * K;
      for (int64_t c = 0; c < K; c += 128)
        for (int piece = 0; piece < 4; piece++) {
          static const int from[4] = {0, 64, 32, 96};
          std::memcpy(out + c + 32 * piece, natural.data() + c + (interleave ? from[piece] : 32 * piece), 32);
        }
    }
  }
};

// Activations for the blocks of 32, per row of x: int8 codes in natural order, one scale dx per 32 values (as the
// row-major kernel rounds them), and per block the code sum: times the weights' zero point (8, 16, 128; an integer)
// and, for Q4_1, times dx (what the weights' minimums multiply)
struct Activations32 {
  int64_t K;
  std::vector<int8_t> q;
  std::vector<float> dx, sum_dx;
  std::vector<int32_t> zero_point;

  Activations32(const float* x, int64_t M, int64_t K_, int64_t qtype)
      : K(K_), q(M * K_), dx(M * (K_ / 32)), sum_dx(M * (K_ / 32)), zero_point(M * (K_ / 32)) {
    const int shift = qtype == Q4_0 ? 3 : qtype == Q5_0 ? 4 : qtype == Q8_0 ? 7 : 0;
    for (int64_t m = 0; m < M; m++)
      for (int64_t j = 0; j < K / 32; j++) {
        const int64_t i = m * (K / 32) + j;
        dx[i] = quantize_group(x + m * K + 32 * j, 32, q.data() + m * K + 32 * j);
        int32_t sum = 0;
        for (int v = 0; v < 32; v++) sum += q[m * K + 32 * j + v];
        zero_point[i] = qtype == Q4_1 ? 0 : sum * (1 << shift);
        sum_dx[i] = static_cast<float>(sum) * dx[i];
      }
  }
};

}  // namespace optimum_ipex_spec_activations
