// The GGUF block formats every kernel reads (exact: gguf_gemm.cpp for AVX-512, gguf_gemm_avx2.cpp for AVX2; fast:
// gguf_gemm_vnni.cpp, gguf_fast_avx2.cpp): ggml's type ids, the size of a block, the scalar pieces of its layout,
// the checks every operator makes on its arguments, and the operators' shells. Needs F16C (the fp16 scales are
// converted with it, exactly: every fp16 is an fp32). Each instruction set's kernels are their own extension.
//
// Block layouts (ggml's, llama.cpp ggml/src/ggml-common.h; values in gguf-py's order):
//   Q4_0 32 values, 18 bytes: fp16 d, 16 bytes of nibbles         w = d * (q - 8)
//   Q4_1 32 values, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m
//   Q5_0 32 values, 22 bytes: fp16 d, uint32 high bits, nibbles   w = d * (q - 16)
//   Q8_0 32 values, 34 bytes: fp16 d, 32 int8                     w = q * d
//   Q4_K 256 values, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
//        w = (d * sc) * q - (dmin * mn), per sub-block of 32
//   Q5_K 256 values, 176 bytes: as Q4_K plus 32 bytes of fifth bits before the nibbles
//   Q6_K 256 values, 210 bytes: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, fp16 d
//        w = (d * sc) * (q - 32), per 16 values
//   F32 / F16: one value per block.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace optimum_ipex_spec_gguf_formats {

// ggml's type ids (gguf.GGMLQuantizationType)
enum QType : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
  int64_t values;  // per block
  int64_t bytes;   // per block
};

constexpr bool format_of(int64_t qtype, Format* f) {
  switch (qtype) {
    case F32: *f = {1, 4}; return true;
    case F16: *f = {1, 2}; return true;
    case Q4_0: *f = {32, 18}; return true;
    case Q4_1: *f = {32, 20}; return true;
    case Q5_0: *f = {32, 22}; return true;
    case Q8_0: *f = {32, 34}; return true;
    case Q4_K: *f = {256, 144}; return true;
    case Q5_K: *f = {256, 176}; return true;
    case Q6_K: *f = {256, 210}; return true;
    default: return false;
  }
}

// the format of a type fixed when compiling (a kernel's template argument): its divisions become shifts
constexpr Format format_for(int64_t qtype) {
  Format f{1, 1};
  format_of(qtype, &f);
  return f;
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact: every fp16 is an fp32
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7)
inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Software prefetch of the next group of weight rows (the rows after these, contiguous in the tensor), a
// share of it per step of this group's loop: the hardware prefetcher alone left a decode step waiting on memory
// (Qwen2.5-0.5B's Q5_0 layers read at 3 GB/s, against 20+ GB/s for a plain sum). A prefetch never faults, so the
// addresses past the tensor's end that the last group asks for are harmless.
// The shares are computed once, then taken one per step (no division in a kernel's loop).
class PrefetchShares {
 public:
  PrefetchShares(const uint8_t* next, int64_t bytes, int64_t steps)
      : p_(reinterpret_cast<const char*>(next)), share_(((bytes + steps - 1) / steps + 63) / 64 * 64) {}
  // prefetches the next share
  void step() {
    for (int64_t i = 0; i < share_; i += 64) _mm_prefetch(p_ + i, _MM_HINT_T0);
    p_ += share_;
  }

 private:
  const char* p_;
  int64_t share_;
};

// 8 fp32 lanes summed in one fixed order: lanes 4-7 + 0-3, then [0] + [2] and [1] + [3], then the two. The exact
// kernels sum their 16 lanes as sum8(lanes 8-15 + lanes 0-7), so both give the same bits; the AVX2 fast kernel sums
// its 8 lanes with it too.
inline float sum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}

// the format of `qtype`, after checking that `blocks` holds rows of K values in it (an error naming the problem
// otherwise, raised in Python as a RuntimeError before anything is read)
inline Format checked_format(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  Format f;
  TORCH_CHECK(format_of(qtype, &f), "gguf: unsupported block type ", qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf: blocks must be a contiguous uint8 [rows, row_bytes] tensor");
  TORCH_CHECK(K > 0 && K % 16 == 0 && K % f.values == 0, "gguf: K=", K, " is not a multiple of 16 and of the block's ",
              f.values, " values");
  TORCH_CHECK(blocks.size(1) == K / f.values * f.bytes, "gguf: a row of ", K, " values is ", K / f.values * f.bytes,
              " bytes in this block type, got ", blocks.size(1));
  return f;
}

}  // namespace optimum_ipex_spec_gguf_formats

// calls BODY<QT> for the runtime type id: one instantiation per block type
#define GGUF_DISPATCH(qtype, BODY, ...)                      \
  switch (qtype) {                                            \
    case F32: BODY<F32>(__VA_ARGS__); break;                  \
    case F16: BODY<F16>(__VA_ARGS__); break;                  \
    case Q4_0: BODY<Q4_0>(__VA_ARGS__); break;                \
    case Q4_1: BODY<Q4_1>(__VA_ARGS__); break;                \
    case Q5_0: BODY<Q5_0>(__VA_ARGS__); break;                \
    case Q8_0: BODY<Q8_0>(__VA_ARGS__); break;                \
    case Q4_K: BODY<Q4_K>(__VA_ARGS__); break;                \
    case Q5_K: BODY<Q5_K>(__VA_ARGS__); break;                \
    case Q6_K: BODY<Q6_K>(__VA_ARGS__); break;                \
    default: TORCH_CHECK(false, "gguf: unsupported block type ", qtype); \
  }

namespace optimum_ipex_spec_gguf_formats {

// The exact kernels' prefill path (panel_path in each): x [M, K] (K a multiple of 16) -> xt, the rows in tiles of
// TileM and the values of each tile by lane: tile t's lane l at xt + (16 t + l) * (K / 16) * TileM holds
// [K / 16][TileM], entry [j][i] = x[TileM t + i, 16 j + l]; rows past M zero. xt holds ceil(M / TileM) * TileM * K.
// (static: each kernel's build keeps its own copy, compiled with its own instruction set)
template <int TileM>
static void lanes_of_x(const float* x, int64_t M, int64_t K, float* xt) {
  const int64_t Kj = K / 16, tiles = (M + TileM - 1) / TileM;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int rows = static_cast<int>(M - TileM * t < TileM ? M - TileM * t : TileM);
      for (int l = 0; l < 16; l++) {
        float* out = xt + (16 * t + l) * Kj * TileM;
        const float* in = x + TileM * t * K + l;
        for (int64_t j = 0; j < Kj; j++)
          for (int i = 0; i < TileM; i++) out[TileM * j + i] = i < rows ? in[i * K + 16 * j] : 0.0f;
      }
    }
  });
}

// The exact kernels' two operator shells: the arguments checked, the output made, then the rows computed by the
// kernel's Rows::dequantize<QT>(src, row_bytes, f, dst, N, K) and Rows::mm<QT>(x, M, blocks, row_bytes, f, out, N, K)
// (x [M, K] and out [M, N] contiguous fp32).
template <class Rows>
at::Tensor dequantize_op(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  const Format f = checked_format(blocks, qtype, K);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor out = at::empty({N, K}, at::kFloat);
  GGUF_DISPATCH(qtype, Rows::template dequantize, blocks.data_ptr<uint8_t>(), row_bytes, f, out.data_ptr<float>(),
                N, K);
  return out;
}

// x [..., K] fp32 checked and flattened to a contiguous [M, K], the output [M, N] made, and the shape to view it as
struct MmCall {
  at::Tensor x, out;
  std::vector<int64_t> shape;

  MmCall(const at::Tensor& x_in, const at::Tensor& blocks, int64_t K) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat, "gguf: x must be float32, got ", x_in.scalar_type());
    TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "gguf: x must end in ", K, " features");
    x = x_in.reshape({-1, K}).contiguous();
    shape.assign(x_in.sizes().begin(), x_in.sizes().end());
    shape.back() = blocks.size(0);
    out = at::empty({x.size(0), blocks.size(0)}, at::kFloat);
  }
};

template <class Rows>
at::Tensor mm_op(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  const Format f = checked_format(blocks, qtype, K);
  MmCall call(x_in, blocks, K);
  if (call.x.size(0) > 0)
    GGUF_DISPATCH(qtype, Rows::template mm, call.x.data_ptr<float>(), call.x.size(0), blocks.data_ptr<uint8_t>(),
                  blocks.size(1), f, call.out.data_ptr<float>(), blocks.size(0), K);
  return call.out.view(call.shape);
}

// The fast kernels' operator shell: the block types with integer codes only, K a multiple of 64, then
// Rows::mm<QT>(x, M, blocks, row_bytes, block_bytes, out, N, K)
template <class Rows>
at::Tensor fast_mm_op(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0 || qtype == Q4_K || qtype == Q5_K ||
                  qtype == Q6_K, "gguf fast mode: unsupported block type ", qtype);
  const Format f = checked_format(blocks, qtype, K);
  TORCH_CHECK(K % 64 == 0, "gguf fast mode: K=", K, " is not a multiple of 64");
  MmCall call(x_in, blocks, K);
  const int64_t M = call.x.size(0), N = blocks.size(0), row_bytes = blocks.size(1);
  const float* x = call.x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* out = call.out.data_ptr<float>();
  if (M > 0) {
    switch (qtype) {
      case Q4_0: Rows::template mm<Q4_0>(x, M, w, row_bytes, f.bytes, out, N, K); break;
      case Q4_1: Rows::template mm<Q4_1>(x, M, w, row_bytes, f.bytes, out, N, K); break;
      case Q5_0: Rows::template mm<Q5_0>(x, M, w, row_bytes, f.bytes, out, N, K); break;
      case Q8_0: Rows::template mm<Q8_0>(x, M, w, row_bytes, f.bytes, out, N, K); break;
      case Q4_K: Rows::template mm<Q4_K>(x, M, w, row_bytes, f.bytes, out, N, K); break;
      case Q5_K: Rows::template mm<Q5_K>(x, M, w, row_bytes, f.bytes, out, N, K); break;
      default: Rows::template mm<Q6_K>(x, M, w, row_bytes, f.bytes, out, N, K);
    }
  }
  return call.out.view(call.shape);
}

}  // namespace optimum_ipex_spec_gguf_formats
