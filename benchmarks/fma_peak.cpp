// The fp32 fused multiply-add rate of one core, the ceiling of a prefill's arithmetic (benchmarks/gguf_prefill.py
// measures it beside the kernels): independent chains of vector fused multiply-adds on registers, no loads or stores,
// enough chains to cover the instruction's latency on two ports. Built at the benchmark's start with the machine's
// own flags (-march=native): AVX-512 where the compiler has it, else AVX2 with FMA.

#include <torch/extension.h>
#include <immintrin.h>

#include <chrono>
#include <cstdint>

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float first(Vec v) { return _mm512_cvtss_f32(v); }
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float first(Vec v) { return _mm256_cvtss_f32(v); }
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#endif

#define START(i) Vec a##i = splat(0.001f * (i));
#define STEP(i) a##i = fma(a##i, b, c);
#define COUNT(i) +1
#define SUM(i) sum += first(a##i);

// billions of fp32 multiply-adds (lanes) per second over `iterations` steps of every chain; `lanes` and `chains` out
double fma_peak(int64_t iterations) {
  const Vec b = splat(0.9999f), c = splat(0.0001f);
  CHAINS(START)
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; i++) {
    CHAINS(STEP)
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sum = 0;
  CHAINS(SUM)
  TORCH_CHECK(sum == sum, "fma_peak: not a number");  // the chains' results are used, so none is optimised away
  constexpr int chains = 0 CHAINS(COUNT);
  return static_cast<double>(iterations) * chains * kLanes / seconds / 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fma_peak", &fma_peak, "fp32 multiply-adds per second, 1e9"); }
