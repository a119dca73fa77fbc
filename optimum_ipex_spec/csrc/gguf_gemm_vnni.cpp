// GGUF block-quantized weights times activations quantized to int8, with AVX512-VNNI integer dot products: the
// "fast" mode of optimum_ipex_spec.gguf_weights (its outputs are its own, as llama.cpp's are: the activations are
// rounded to 8 bits). Built only where the CPU has AVX512-VNNI (its own extension: the exact kernel never runs an
// instruction this file's flags allow).
//
// Operator (namespace optimum_ipex_spec_gguf_vnni):
//   mm(x fp32 [M, K], blocks uint8 [N, row_bytes], qtype, K) -> fp32 [M, N]
//
// Activations, per row (as llama.cpp quantizes them for these weights, ggml's q8_0 and q8_K):
//   - blocks of 32 values (Q4_0, Q4_1, Q5_0, Q8_0): d = max|x| / 127, q = round(x / d), one d per block
//   - K-quants (Q4_K, Q5_K, Q6_K): one d per 256 values, and the sum of q per 32 (the weights' mins)
// Weights are read as their unsigned codes (0..15, 0..31, 0..63, or int8 + 128) and multiplied by the int8
// activations with vpdpbusd (4 products a lane); zero points and scales are applied to the integer sums, mins to
// the activation sums. Each output is the same sequence of operations whatever M is, so a row gets the same bits
// alone as among others: speculative decoding over a target in this mode returns that target's own greedy tokens.
// K must be a multiple of 64 (and of the block's values); the caller uses the exact kernel otherwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline bool k_quant(int64_t qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }

// one row of x quantized for a block type: q (K int8), the scale per group (32 or 256 values), the sum of q per
// 32 values, and per 64 values the 16 lane sums of 4 q each (what a zero point subtracts)
struct QuantizedRows {
  int64_t K, group;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum32;
  std::vector<__m512i> lanes;
  std::vector<__m512> lane_d;  // blocks of 32 only: per 64 values, lanes 0-7 the first block's d, 8-15 the second's

  QuantizedRows(const float* x, int64_t M, int64_t K_, int64_t group_)
      : K(K_), group(group_), q(M * K_), d(M * (K_ / group_)), sum32(M * (K_ / 32)), lanes(M * (K_ / 64)),
        lane_d(group_ == 32 ? M * (K_ / 64) : 0) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t m = 0; m < M; m++) {
      const float* row = x + m * K;
      for (int64_t g = 0; g < K / group; g++) {
        __m512 amax = _mm512_setzero_ps();
        __mmask16 nan = 0;  // max_ps drops a NaN; a NaN activation must give NaN outputs, as the exact mode does
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
          const __m512 v = _mm512_loadu_ps(row + k);
          nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        }
        const float top = nan ? NAN : _mm512_reduce_max_ps(amax);
        const float scale = top / 127.0f;  // an infinite activation: an infinite scale, 0 codes, NaN outputs
        d[m * (K / group) + g] = scale;
        const __m512 inv = _mm512_set1_ps(top > 0 && std::isfinite(top) ? 127.0f / top : 0.0f);
        for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), inv));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + m * K + k), _mm512_cvtsepi32_epi8(v));
        }
      }
      for (int64_t b = 0; b < K / 32; b++) {
        int32_t s = 0;
        for (int i = 0; i < 32; i++) s += q[m * K + 32 * b + i];
        sum32[m * (K / 32) + b] = s;
      }
      for (int64_t c = 0; c < K / 64; c++) {
        lanes[m * (K / 64) + c] = _mm512_dpbusd_epi32(
            _mm512_setzero_si512(), ones, _mm512_loadu_si512(q.data() + m * K + 64 * c));
        if (group == 32)
          lane_d[m * (K / 64) + c] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[m * (K / 32) + 2 * c]),
                                                          _mm512_set1_ps(d[m * (K / 32) + 2 * c + 1]));
      }
    }
  }
  const int8_t* row(int64_t m) const { return q.data() + m * K; }
};

inline __m512i two_halves(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// the 32 codes of a 32-value block of nibbles (16 bytes: values 0..15 low nibbles, 16..31 high)
inline __m256i nibble_codes(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

// lanes 0-7 = a, 8-15 = b
inline __m512 two_scales(float a, float b) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}
constexpr int kRowsN = 4;

// Software prefetch of the next group of weight rows (the kRowsN rows after these, contiguous in the tensor), a
// share of it per step of this group's loop: the hardware prefetcher alone left a decode step waiting on memory
// (Qwen2.5-0.5B's Q5_0 layers read at 3 GB/s, against 20+ GB/s for a plain sum). A prefetch never faults, so the
// addresses past the tensor's end that the last group asks for are harmless.
inline void prefetch_share(const uint8_t* next, int64_t bytes, int64_t step, int64_t steps) {
  const int64_t share = ((bytes + steps - 1) / steps + 63) / 64 * 64;
  const char* p = reinterpret_cast<const char*>(next) + step * share;
  for (int64_t i = 0; i < share; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}


// blocks of 32: per pair of blocks (64 values), the R rows' codes, weight scales (and mins), then every row of x
template <int64_t QT, int R>
void rows_32(const QuantizedRows& xq, int64_t M, const uint8_t* rows, int64_t row_bytes, int64_t bytes, int64_t K,
             float* out, int64_t ldo) {
  std::vector<__m512> acc(M * R, _mm512_setzero_ps());
  for (int64_t c = 0; c < K / 64; c++) {
    prefetch_share(rows + R * row_bytes, kRowsN * row_bytes, c, K / 64);
    __m512i codes[R];
    __m512 dw[R], mw[R];
    for (int r = 0; r < R; r++) {
      __m256i half_codes[2];
      float d2[2], m2[2] = {0.0f, 0.0f};
      for (int i = 0; i < 2; i++) {
        const uint8_t* b = rows + r * row_bytes + (2 * c + i) * bytes;
        d2[i] = half(b);
        if (QT == Q4_0) {
          half_codes[i] = nibble_codes(b + 2);
        } else if (QT == Q4_1) {
          m2[i] = half(b + 2);
          half_codes[i] = nibble_codes(b + 4);
        } else if (QT == Q5_0) {
          uint32_t qh;
          std::memcpy(&qh, b + 2, 4);
          half_codes[i] = _mm256_or_si256(nibble_codes(b + 6),
                                          _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(0x10)));
        } else {  // Q8_0: int8 + 128
          half_codes[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                                           _mm256_set1_epi8(static_cast<char>(0x80)));
        }
      }
      codes[r] = two_halves(half_codes[0], half_codes[1]);
      dw[r] = two_scales(d2[0], d2[1]);
      mw[r] = two_scales(m2[0], m2[1]);
    }
    constexpr int shift = QT == Q4_0 ? 3 : QT == Q5_0 ? 4 : QT == Q8_0 ? 7 : -1;  // zero point 8, 16, 128
    for (int64_t m = 0; m < M; m++) {
      const __m512i xv = _mm512_loadu_si512(xq.row(m) + 64 * c);
      const __m512 dx = xq.lane_d[m * (K / 64) + c];
      const __m512i xl = xq.lanes[m * (K / 64) + c];
      const __m512i zero_point = shift >= 0 ? _mm512_slli_epi32(xl, shift > 0 ? shift : 0) : _mm512_setzero_si512();
      for (int r = 0; r < R; r++) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[r], xv);
        if (shift >= 0) dot = _mm512_sub_epi32(dot, zero_point);
        __m512 a = acc[m * R + r];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[r], dx), a);
        if (QT == Q4_1) a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(xl), _mm512_mul_ps(mw[r], dx), a);
        acc[m * R + r] = a;
      }
    }
  }
  for (int64_t m = 0; m < M; m++)
    for (int r = 0; r < R; r++) out[m * ldo + r] = _mm512_reduce_add_ps(acc[m * R + r]);
}

// K-quants: per super-block of 256, the R rows' codes (4 chunks of 64) with integer scales per lane, an integer
// accumulator per (row of x, weight row) scaled once by d * dx, and the mins against the activation sums
template <int64_t QT, int R>
void rows_k(const QuantizedRows& xq, int64_t M, const uint8_t* rows, int64_t row_bytes, int64_t bytes, int64_t K,
            float* out, int64_t ldo) {
  std::vector<__m512> acc(M * R, _mm512_setzero_ps());
  std::vector<float> mins(M * R, 0.0f);
  const int64_t supers = K / 256;
  const __m512i repeat4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i pair8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t s = 0; s < supers; s++) {
    prefetch_share(rows + R * row_bytes, kRowsN * row_bytes, s, supers);
    __m512i codes[R][4], scales[R][4];
    float d[R], dmin[R];
    __m256i mn[R];
    for (int r = 0; r < R; r++) {
      const uint8_t* b = rows + r * row_bytes + s * bytes;
      if (QT == Q6_K) {
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        d[r] = half(b + 208);
        dmin[r] = 0.0f;
        const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
          const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
          const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
          auto high = [&](int shift) {
            return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, shift), two), 4);
          };
          const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l0, low4), high(0));
          const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l1, low4), high(2));
          const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), high(4));
          const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), high(6));
          codes[r][2 * h] = two_halves(q0, q1);
          codes[r][2 * h + 1] = two_halves(q2, q3);
        }
        // the 16 scales (one per 16 values), each repeated over the 4 lanes of its values
        const __m512i all = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
        for (int c = 0; c < 4; c++)
          scales[r][c] = _mm512_permutexvar_epi32(_mm512_add_epi32(repeat4, _mm512_set1_epi32(4 * c)), all);
      } else {
        d[r] = half(b);
        dmin[r] = half(b + 2);
        // the 8 six-bit scales and mins from the 12 bytes as three 32-bit words: bytes 0-3 hold the low 6 bits of
        // scales 0-3 (top 2 bits: scales 4-7's), 4-7 of mins 0-3 (likewise), 8-11 the low 4 bits of scales/mins 4-7
        uint32_t w[3];
        std::memcpy(w, b + 4, 12);
        const uint32_t low6 = 0x3f3f3f3f, nib = 0x0f0f0f0f, top2 = 0x03030303;
        const uint64_t sc8 = static_cast<uint64_t>(w[0] & low6) |
                             (static_cast<uint64_t>((w[2] & nib) | (((w[0] >> 6) & top2) << 4)) << 32);
        const uint64_t mn8 = static_cast<uint64_t>(w[1] & low6) |
                             (static_cast<uint64_t>(((w[2] >> 4) & nib) | (((w[1] >> 6) & top2) << 4)) << 32);
        const __m512i sc16 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc8)));
        mn[r] = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn8)));
        const uint8_t* qs = QT == Q5_K ? b + 48 : b + 16;
        const uint8_t* qh = b + 16;
        const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
        const __m256i hb =
            QT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
          __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
          if (QT == Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
          }
          codes[r][c] = two_halves(lo, hi);
          scales[r][c] = _mm512_permutexvar_epi32(_mm512_add_epi32(pair8, _mm512_set1_epi32(2 * c)), sc16);
        }
      }
    }
    for (int64_t m = 0; m < M; m++) {
      const int8_t* xr = xq.row(m) + 256 * s;
      const float dx = xq.d[m * supers + s];
      for (int r = 0; r < R; r++) {
        __m512i total = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
          __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[r][c], _mm512_loadu_si512(xr + 64 * c));
          if (QT == Q6_K)  // zero point 32
            dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(xq.lanes[m * (K / 64) + 4 * s + c], 5));
          total = _mm512_add_epi32(total, _mm512_mullo_epi32(dot, scales[r][c]));
        }
        acc[m * R + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d[r] * dx), acc[m * R + r]);
        if (QT != Q6_K) {
          const int32_t* sub_sums = xq.sum32.data() + m * (K / 32) + 8 * s;
          const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub_sums));
          const int32_t weighted = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(_mm256_mullo_epi32(mn[r], sums)));
          mins[m * R + r] += dmin[r] * dx * static_cast<float>(weighted);
        }
      }
    }
  }
  for (int64_t m = 0; m < M; m++)
    for (int r = 0; r < R; r++) out[m * ldo + r] = _mm512_reduce_add_ps(acc[m * R + r]) - mins[m * R + r];
}

template <int64_t QT>
void mm_rows(const QuantizedRows& xq, int64_t M, const uint8_t* wp, int64_t row_bytes, int64_t bytes, float* op,
             int64_t N, int64_t K) {
  const int64_t groups = (N + kRowsN - 1) / kRowsN;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(M * kRowsN);
    for (int64_t g = begin; g < end; g++) {
      const int64_t n0 = g * kRowsN;
      const int R = static_cast<int>(N - n0 < kRowsN ? N - n0 : kRowsN);
      const uint8_t* rows = wp + n0 * row_bytes;
      float* t = tile.data();
      if (k_quant(QT)) {
        switch (R) {
          case 4: rows_k<QT, 4>(xq, M, rows, row_bytes, bytes, K, t, kRowsN); break;
          case 3: rows_k<QT, 3>(xq, M, rows, row_bytes, bytes, K, t, kRowsN); break;
          case 2: rows_k<QT, 2>(xq, M, rows, row_bytes, bytes, K, t, kRowsN); break;
          default: rows_k<QT, 1>(xq, M, rows, row_bytes, bytes, K, t, kRowsN);
        }
      } else {
        switch (R) {
          case 4: rows_32<QT, 4>(xq, M, rows, row_bytes, bytes, K, t, kRowsN); break;
          case 3: rows_32<QT, 3>(xq, M, rows, row_bytes, bytes, K, t, kRowsN); break;
          case 2: rows_32<QT, 2>(xq, M, rows, row_bytes, bytes, K, t, kRowsN); break;
          default: rows_32<QT, 1>(xq, M, rows, row_bytes, bytes, K, t, kRowsN);
        }
      }
      for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < R; r++) op[m * N + n0 + r] = t[m * kRowsN + r];
    }
  });
}

at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  int64_t values, bytes;
  switch (qtype) {
    case Q4_0: values = 32; bytes = 18; break;
    case Q4_1: values = 32; bytes = 20; break;
    case Q5_0: values = 32; bytes = 22; break;
    case Q8_0: values = 32; bytes = 34; break;
    case Q4_K: values = 256; bytes = 144; break;
    case Q5_K: values = 256; bytes = 176; break;
    case Q6_K: values = 256; bytes = 210; break;
    default: TORCH_CHECK(false, "gguf fast mode: unsupported block type ", qtype);
  }
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf: blocks must be a contiguous uint8 [rows, row_bytes] tensor");
  TORCH_CHECK(K > 0 && K % 64 == 0 && K % values == 0, "gguf fast mode: K=", K, " is not a multiple of 64 and of ",
              values);
  TORCH_CHECK(blocks.size(1) == K / values * bytes, "gguf: a row of ", K, " values is ", K / values * bytes,
              " bytes in this block type, got ", blocks.size(1));
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "gguf: x must be float32, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "gguf: x must end in ", K, " features");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), N = blocks.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, at::kFloat);
  if (M == 0) return out.view(shape);
  const QuantizedRows xq(x.data_ptr<float>(), M, K, k_quant(qtype) ? 256 : 32);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  switch (qtype) {
    case Q4_0: mm_rows<Q4_0>(xq, M, wp, row_bytes, bytes, op, N, K); break;
    case Q4_1: mm_rows<Q4_1>(xq, M, wp, row_bytes, bytes, op, N, K); break;
    case Q5_0: mm_rows<Q5_0>(xq, M, wp, row_bytes, bytes, op, N, K); break;
    case Q8_0: mm_rows<Q8_0>(xq, M, wp, row_bytes, bytes, op, N, K); break;
    case Q4_K: mm_rows<Q4_K>(xq, M, wp, row_bytes, bytes, op, N, K); break;
    case Q5_K: mm_rows<Q5_K>(xq, M, wp, row_bytes, bytes, op, N, K); break;
    default: mm_rows<Q6_K>(xq, M, wp, row_bytes, bytes, op, N, K);
  }
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(optimum_ipex_spec_gguf_vnni, m) { m.def("mm(Tensor x, Tensor blocks, int qtype, int K) -> Tensor"); }
TORCH_LIBRARY_IMPL(optimum_ipex_spec_gguf_vnni, CPU, m) { m.impl("mm", &mm); }
