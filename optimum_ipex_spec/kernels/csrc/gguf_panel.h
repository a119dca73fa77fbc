// The exact kernels' prefill path, written once over a vector type: gguf_gemm.cpp runs it with 16-float AVX-512
// vectors, gguf_gemm_avx2.cpp with 8-float AVX2 ones, each built with its own instruction set (everything here is in
// an unnamed namespace, so each build keeps its own copy).
//
// The chain of output (m, n) in lane l is the sum over j of x[m, 16 j + l] * w[n, 16 j + l], fused multiply-adds in
// order of j from zero, then the 16 lanes summed as sum_lanes sums them (8-15 + 0-7, the upper 4 + the lower 4,
// [0] + [2] and [1] + [3], then the two): the chains of every other path of the kernels, so the same bits. Here a
// vector holds lane l of V::width weight rows side by side, multiplied by a broadcast value of x. A panel of PanelN
// (two vectors of) weight rows is laid out lane by lane by the kernel's own panel_of: lane l at p + l * (K / 16) *
// PanelN holds [K / 16][PanelN], entry [j][r] = w[r, 16 j + l]; x by lanes_of_x<TileM> (gguf_formats.h).

#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>

namespace {

// V (a vector type of the kernel): T, width (floats), zero(), load(p), store(p, v), set1(f), fmadd(a, b, c) (a * b + c,
// rounded once), add(a, b)

// lane l of MT rows of a tile (xt: [K / 16][TileM] of that lane) against a panel's lane l (p: [K / 16][PanelN]):
// lanes [MT][PanelN] <- the chains over j of xt[j][i] * p[j][n]
template <class V, int TileM, int PanelN, int MT>
void panel_lane(const float* xt, const float* p, int64_t Kj, float* lanes) {
  static_assert(PanelN == 2 * V::width, "a panel is two vectors of weight rows");
  typename V::T acc[MT][2];
  for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = V::zero();
  for (int64_t j = 0; j < Kj; j++) {
    const typename V::T w0 = V::load(p + PanelN * j), w1 = V::load(p + PanelN * j + V::width);
    for (int i = 0; i < MT; i++) {
      const typename V::T xv = V::set1(xt[TileM * j + i]);
      acc[i][0] = V::fmadd(xv, w0, acc[i][0]);
      acc[i][1] = V::fmadd(xv, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < MT; i++) {
    V::store(lanes + PanelN * i, acc[i][0]);
    V::store(lanes + PanelN * i + V::width, acc[i][1]);
  }
}

// panel_lane for mt (1..MT) rows, MT a compile-time bound
template <class V, int TileM, int PanelN, int MT = TileM>
inline void panel_lane_of(int mt, const float* xt, const float* p, int64_t Kj, float* lanes) {
  if constexpr (MT > 1) {
    if (mt < MT) return panel_lane_of<V, TileM, PanelN, MT - 1>(mt, xt, p, Kj, lanes);
  }
  panel_lane<V, TileM, PanelN, MT>(xt, p, Kj, lanes);
}

// the 16 lanes v[l] = at + l * stride (V::width outputs each) summed as sum_lanes sums one output's lanes
template <class V>
inline typename V::T sum_lane_vectors(const float* at, int64_t stride) {
  typename V::T s[8];
  for (int l = 0; l < 8; l++) s[l] = V::add(V::load(at + (l + 8) * stride), V::load(at + l * stride));
  for (int l = 0; l < 4; l++) s[l] = V::add(s[l + 4], s[l]);
  return V::add(V::add(s[0], s[2]), V::add(s[1], s[3]));
}

// out [M, N] <- xt (lanes_of_x<TileM> of x [M, K]) times the N weight rows, panels of PanelN rows split between
// torch's threads; panel_of(n0, R, p) lays out weight rows n0..n0+R-1 at p (rows past R zero)
template <class V, int TileM, int PanelN, class PanelOf>
void panel_rows(const float* xt, int64_t M, float* out, int64_t N, int64_t K, const PanelOf& panel_of) {
  const int64_t Kj = K / 16, tiles = (M + TileM - 1) / TileM, panels = (N + PanelN - 1) / PanelN;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // aligned as a vector: the panel and the lanes are read as whole vectors
    std::vector<typename V::T> storage((PanelN * K + 16 * TileM * PanelN) / V::width);
    float* p = reinterpret_cast<float*>(storage.data());
    float* lanes = p + PanelN * K;  // [16][TileM][PanelN]
    alignas(64) float sums[V::width];
    for (int64_t panel = begin; panel < end; panel++) {
      const int64_t n0 = PanelN * panel;
      const int R = static_cast<int>(N - n0 < PanelN ? N - n0 : PanelN);
      panel_of(n0, R, p);
      for (int64_t t = 0; t < tiles; t++) {
        const int MT = static_cast<int>(M - TileM * t < TileM ? M - TileM * t : TileM);
        for (int l = 0; l < 16; l++)
          panel_lane_of<V, TileM, PanelN>(MT, xt + (16 * t + l) * Kj * TileM, p + l * Kj * PanelN, Kj,
                                          lanes + l * TileM * PanelN);
        for (int i = 0; i < MT; i++)
          for (int h = 0; h < 2 && V::width * h < R; h++) {
            V::store(sums, sum_lane_vectors<V>(lanes + PanelN * i + V::width * h, TileM * PanelN));
            for (int n = V::width * h; n < R && n < V::width * (h + 1); n++)
              out[(TileM * t + i) * N + n0 + n] = sums[n - V::width * h];
          }
      }
    }
  });
}

}  // namespace
