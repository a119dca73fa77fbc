// The fast GGUF mode's activations (shared by gguf_gemm_vnni.cpp and gguf_interleaved_vnni.cpp): each row of x
// rounded to int8 codes with one fp32 scale per group of values, as llama.cpp's q8_0 / q8_K do.

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace optimum_ipex_spec_vnni {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// values x[0..n) (n a multiple of 16) rounded to int8 codes q with one scale, returned: d = max|x| / 127,
// q = round(x / d), nearest even; a NaN among them gives a NaN scale (and NaN outputs), an infinity an infinite one
inline float quantize_group(const float* x, int64_t n, int8_t* q) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 nan = 0;  // max_ps drops a NaN; a NaN activation must give NaN outputs, as the exact mode does
  for (int64_t k = 0; k < n; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
  }
  const float top = nan ? NAN : _mm512_reduce_max_ps(amax);
  // a largest |x| below about 4e-37 makes 127 / top infinite: those codes stay 0 (their products are below 1e-36)
  const float ratio = top > 0 && std::isfinite(top) ? 127.0f / top : 0.0f;
  const __m512 inv = _mm512_set1_ps(std::isfinite(ratio) ? ratio : 0.0f);
  for (int64_t k = 0; k < n; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(v));
  }
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

}  // namespace optimum_ipex_spec_vnni
