// The interleaved layout of the fast GGUF mode (shared by gguf_interleaved_vnni.cpp, AVX512-VNNI, and
// gguf_interleaved_avx2.cpp, AVX2): 16 weight rows of a tensor rearranged so that each 32-bit lane of a vector holds
// 4 codes of one row, every row's block scales side by side. Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K rows of K values,
// a multiple of the block's values; a tensor of a multiple of 16 rows. Both kernels read the same bytes, so one
// layout serves whichever the CPU runs; interleave and deinterleave are plain byte moves (no instruction set).
//
// Operators (each kernel's namespace registers them, with register_layout()), U = 256 values per unit for the K
// types, 32 for the others:
//   interleave(blocks uint8 [N, row_bytes], qtype, K) -> uint8 [N / 16, K / U * group_bytes]
//   deinterleave(groups uint8 [G, K / U * group_bytes], qtype, K) -> uint8 [16 G, row_bytes] (the GGUF rows back,
//       byte for byte)
//   mm_interleaved(x fp32 [M, K], groups, qtype, K) -> fp32 [M, 16 G], through mm_interleaved_op<Groups<Kernel>>
//
// Layout of 16 rows x one unit (group_bytes: Q4_K 2368 = 16 x 148, Q6_K 3392 = 16 x 212, the others 16 times a
// row's block), in the order the kernel reads it:
//   Q4_K: d fp16 [16] @0, dmin fp16 [16] @32, scales uint8 [8 sub-blocks][16 rows] @64, mins uint8
//         [4 pairs][16 rows][2] @192, codes @320: [8 sub-blocks of 32][4][16 rows][4 bytes], byte b of piece t holds
//         value 8t + b in its low nibble and 8t + 4 + b in its high one.
//   Q6_K: codes @0: [8 blocks of 32] x (low 4 bits [4][16 rows][4 bytes] as Q4_K's codes, then top 2 bits
//         [2][16 rows][4 bytes]: bits 2k..2k+1 of byte b of piece h those of value 16h + 4k + b of the block),
//         scales int8 [8 pairs][16 rows][2] @3072, d fp16 [16] @3328, 32 bytes of padding (whole cache lines). A
//         scale per 16 values; the codes are q + 32.
//   Q4_0, Q4_1, Q5_0: codes as Q4_K's 32 values @0 (256 bytes; q + 8, q, q + 16), Q5_0's fifth bits @256 ([16 rows]
//         [4 bytes], bit v of byte i that of value 4v + i), then d fp16 [16] (Q4_1: and m fp16 [16]).
//   Q8_0: codes + 128 as [8][16 rows][4 bytes] @0 (512 bytes), d fp16 [16] @512.
// Q4_K's 12 bytes of packed 6-bit scales and minimums become 16 single bytes (4 more bytes per row: 2.8%); Q6_K
// gains 2 bytes per row (1%) of padding; the blocks of 32 keep their bytes.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_activations.h"
#include "gguf_formats.h"

namespace optimum_ipex_spec_gguf_layout {

using namespace optimum_ipex_spec_gguf_formats;

constexpr int64_t kQ4KRow = 144, kQ6KRow = 210;        // bytes of one row's super-block in the GGUF file
constexpr int64_t kQ4KGroup = 2368, kQ6KGroup = 3392;  // bytes of 16 rows' super-blocks here (whole cache lines)
// where a Q6_K group's scales and d start
constexpr int64_t kQ6Scales = 3072, kQ6D = 3328;
// bytes per 32 values of 16 rows: Q4_K's codes; Q6_K's low bits then top bits, read in the order they are stored
constexpr int64_t kQ4KBlock = 256, kQ6KBlock = 384;

constexpr bool k_type(int64_t qtype) { return qtype == Q4_K || qtype == Q6_K; }
// values per unit: a super-block (K types) or a block (the others)
constexpr int64_t unit_values(int64_t qtype) { return k_type(qtype) ? 256 : 32; }
// bytes of one row's unit in the GGUF file
constexpr int64_t row_unit_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return kQ4KRow;
    default: return kQ6KRow;
  }
}
// bytes of 16 rows' unit here (the blocks of 32: 16 times a row's, rearranged)
constexpr int64_t group_bytes(int64_t qtype) {
  return qtype == Q4_K ? kQ4KGroup : qtype == Q6_K ? kQ6KGroup : 16 * row_unit_bytes(qtype);
}
// bytes of a block of 32's codes for 16 rows (the blocks of 32), before their scales
constexpr int64_t code_bytes32(int64_t qtype) { return qtype == Q8_0 ? 512 : qtype == Q5_0 ? 320 : 256; }

// ------------------------------------------------------------------------------------------------ the layout
// One row's super-block as 256 unsigned codes and its scales (Q4_K: 8 scales, 8 minimums; Q6_K: 16 int8 scales),
// and back. Q4_K: a 64-value chunk c is bytes 32c..32c+31 of qs, values 64c + l (low nibble) and 64c + 32 + l
// (high); the 6-bit scales and minimums as ggml packs them. Q6_K: ggml's ql / qh / scales / d.
inline void split_q4k(const uint8_t* b, uint8_t* codes, uint8_t* sc, uint8_t* mn) {
  const uint8_t* q = b + 4;
  for (int j = 0; j < 8; j++) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
  const uint8_t* qs = b + 16;
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      codes[64 * c + l] = qs[32 * c + l] & 0xF;
      codes[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
}

inline void join_q4k(const uint8_t* codes, const uint8_t* sc, const uint8_t* mn, uint8_t* b) {
  uint8_t* q = b + 4;
  for (int j = 0; j < 4; j++) {
    q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
    q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
    q[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
  }
  uint8_t* qs = b + 16;
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) qs[32 * c + l] = codes[64 * c + l] | (codes[64 * c + 32 + l] << 4);
}

inline void split_q6k(const uint8_t* b, uint8_t* codes) {
  for (int half = 0; half < 2; half++) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    uint8_t* y = codes + 128 * half;
    for (int l = 0; l < 32; l++) {
      y[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
      y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
      y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
  }
}

inline void join_q6k(const uint8_t* codes, uint8_t* b) {
  for (int half = 0; half < 2; half++) {
    uint8_t* ql = b + 64 * half;
    uint8_t* qh = b + 128 + 32 * half;
    const uint8_t* y = codes + 128 * half;
    for (int l = 0; l < 32; l++) {
      ql[l] = (y[l] & 0xF) | ((y[l + 64] & 0xF) << 4);
      ql[l + 32] = (y[l + 32] & 0xF) | ((y[l + 96] & 0xF) << 4);
      qh[l] = (y[l] >> 4) | ((y[l + 32] >> 4) << 2) | ((y[l + 64] >> 4) << 4) | ((y[l + 96] >> 4) << 6);
    }
  }
}

// codes[256] of row r into the blocks of 32 values at p, `stride` bytes each: the 4-bit pieces (Q4_K's codes, Q6_K's
// low bits) and, with `high` (Q6_K), the top bits after them
inline void place_codes(const uint8_t* codes, int r, uint8_t* p, int64_t stride, bool high) {
  for (int j = 0; j < 8; j++)
    for (int t = 0; t < 4; t++)
      for (int b = 0; b < 4; b++) {
        const uint8_t lo = codes[32 * j + 8 * t + b], hi = codes[32 * j + 8 * t + 4 + b];
        p[stride * j + 64 * t + 4 * r + b] = (lo & 0xF) | ((hi & 0xF) << 4);
      }
  if (!high) return;
  for (int j = 0; j < 8; j++)
    for (int piece = 0; piece < 2; piece++)
      for (int b = 0; b < 4; b++) {
        uint8_t v = 0;
        for (int k = 0; k < 4; k++) v |= (codes[32 * j + 16 * piece + 4 * k + b] >> 4) << (2 * k);
        p[stride * j + 256 + 64 * piece + 4 * r + b] = v;
      }
}

inline void take_codes(const uint8_t* p, int64_t stride, bool high, int r, uint8_t* codes) {
  for (int j = 0; j < 8; j++)
    for (int t = 0; t < 4; t++)
      for (int b = 0; b < 4; b++) {
        const uint8_t byte = p[stride * j + 64 * t + 4 * r + b];
        codes[32 * j + 8 * t + b] = byte & 0xF;
        codes[32 * j + 8 * t + 4 + b] = byte >> 4;
      }
  if (!high) return;
  for (int j = 0; j < 8; j++)
    for (int piece = 0; piece < 2; piece++)
      for (int b = 0; b < 4; b++) {
        const uint8_t v = p[stride * j + 256 + 64 * piece + 4 * r + b];
        for (int k = 0; k < 4; k++) codes[32 * j + 16 * piece + 4 * k + b] |= ((v >> (2 * k)) & 3) << 4;
      }
}

// One row's super-block b (GGUF bytes) into slot r of a group's super-block g, or back (to_group false)
inline void move_row(int64_t qtype, uint8_t* b, int r, uint8_t* g, bool to_group) {
  uint8_t codes[256], sc[16], mn[8];
  if (qtype == Q4_K) {
    if (to_group) {
      split_q4k(b, codes, sc, mn);
      std::memcpy(g + 2 * r, b, 2);
      std::memcpy(g + 32 + 2 * r, b + 2, 2);
      for (int j = 0; j < 8; j++) g[64 + 16 * j + r] = sc[j];
      for (int pair = 0; pair < 4; pair++) {
        g[192 + 32 * pair + 2 * r] = mn[2 * pair];
        g[192 + 32 * pair + 2 * r + 1] = mn[2 * pair + 1];
      }
      place_codes(codes, r, g + 320, kQ4KBlock, false);
    } else {
      take_codes(g + 320, kQ4KBlock, false, r, codes);
      std::memcpy(b, g + 2 * r, 2);
      std::memcpy(b + 2, g + 32 + 2 * r, 2);
      for (int j = 0; j < 8; j++) sc[j] = g[64 + 16 * j + r];
      for (int pair = 0; pair < 4; pair++) {
        mn[2 * pair] = g[192 + 32 * pair + 2 * r];
        mn[2 * pair + 1] = g[192 + 32 * pair + 2 * r + 1];
      }
      join_q4k(codes, sc, mn, b);
    }
  } else {
    if (to_group) {
      split_q6k(b, codes);
      std::memcpy(g + kQ6D + 2 * r, b + 208, 2);
      for (int pair = 0; pair < 8; pair++) {
        g[kQ6Scales + 32 * pair + 2 * r] = b[192 + 2 * pair];
        g[kQ6Scales + 32 * pair + 2 * r + 1] = b[192 + 2 * pair + 1];
      }
      place_codes(codes, r, g, kQ6KBlock, true);
    } else {
      take_codes(g, kQ6KBlock, true, r, codes);
      std::memcpy(b + 208, g + kQ6D + 2 * r, 2);
      for (int pair = 0; pair < 8; pair++) {
        b[192 + 2 * pair] = g[kQ6Scales + 32 * pair + 2 * r];
        b[192 + 2 * pair + 1] = g[kQ6Scales + 32 * pair + 2 * r + 1];
      }
      join_q6k(codes, b);
    }
  }
}

// One row's block of 32 values (GGUF bytes b) into slot r of a group's block g, or back (to_group false): codes as
// Q4_K's 32 values (4-bit types), Q5_0's fifth bits at 256, Q8_0's codes + 128 as [8][16 rows][4 bytes]; then d
// fp16 [16] (and Q4_1's m fp16 [16]).
inline void move_row32(int64_t qtype, uint8_t* b, int r, uint8_t* g, bool to_group) {
  uint8_t* d = g + code_bytes32(qtype);
  if (to_group) {
    std::memcpy(d + 2 * r, b, 2);
    if (qtype == Q4_1) std::memcpy(d + 32 + 2 * r, b + 2, 2);
  } else {
    std::memcpy(b, d + 2 * r, 2);
    if (qtype == Q4_1) std::memcpy(b + 2, d + 32 + 2 * r, 2);
  }
  if (qtype == Q8_0) {
    for (int v = 0; v < 8; v++)
      for (int i = 0; i < 4; i++) {
        uint8_t& here = g[64 * v + 4 * r + i];
        uint8_t& there = b[2 + 4 * v + i];
        if (to_group) here = there ^ 0x80;
        else there = here ^ 0x80;
      }
    return;
  }
  const int64_t at = qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : 6;  // where the nibbles start
  uint8_t codes[32];
  uint32_t high = 0;
  if (to_group) {
    for (int l = 0; l < 16; l++) {
      codes[l] = b[at + l] & 0xF;
      codes[l + 16] = b[at + l] >> 4;
    }
    if (qtype == Q5_0) std::memcpy(&high, b + 2, 4);
    for (int t = 0; t < 4; t++)
      for (int i = 0; i < 4; i++) g[64 * t + 4 * r + i] = codes[8 * t + i] | (codes[8 * t + 4 + i] << 4);
    if (qtype == Q5_0)
      for (int i = 0; i < 4; i++) {
        uint8_t bits = 0;  // bit v: the fifth bit of value 4v + i
        for (int v = 0; v < 8; v++) bits |= ((high >> (4 * v + i)) & 1) << v;
        g[256 + 4 * r + i] = bits;
      }
  } else {
    for (int t = 0; t < 4; t++)
      for (int i = 0; i < 4; i++) {
        codes[8 * t + i] = g[64 * t + 4 * r + i] & 0xF;
        codes[8 * t + 4 + i] = g[64 * t + 4 * r + i] >> 4;
      }
    for (int l = 0; l < 16; l++) b[at + l] = codes[l] | (codes[l + 16] << 4);
    if (qtype == Q5_0) {
      for (int i = 0; i < 4; i++)
        for (int v = 0; v < 8; v++) high |= static_cast<uint32_t>((g[256 + 4 * r + i] >> v) & 1) << (4 * v + i);
      std::memcpy(b + 2, &high, 4);
    }
  }
}

inline void check_type(int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0 || k_type(qtype),
              "gguf interleaved layout: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K, got ", qtype);
  TORCH_CHECK(K > 0 && K % unit_values(qtype) == 0 && K <= (int64_t{1} << 24), "gguf interleaved layout: K=", K,
              " is not a positive multiple of ", unit_values(qtype), " up to 2^24");
}

inline void move_unit(int64_t qtype, uint8_t* b, int r, uint8_t* g, bool to_group) {
  if (k_type(qtype)) move_row(qtype, b, r, g, to_group);
  else move_row32(qtype, b, r, g, to_group);
}

inline at::Tensor interleave(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  check_type(qtype, K);
  const int64_t supers = K / unit_values(qtype), ub = row_unit_bytes(qtype), rb = supers * ub, gb = group_bytes(qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == rb && blocks.size(0) % 16 == 0,
              "gguf interleave: blocks must be a contiguous uint8 [16 n, ", rb, "] tensor");
  const int64_t groups = blocks.size(0) / 16;
  at::Tensor out = at::zeros({groups, supers * gb}, at::kByte);  // Q6_K's padding zero
  uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    uint8_t row[kQ6KRow];
    for (int64_t g = begin; g < end; g++)
      for (int64_t s = 0; s < supers; s++)
        for (int r = 0; r < 16; r++) {
          std::memcpy(row, src + (16 * g + r) * rb + s * ub, ub);
          move_unit(qtype, row, r, dst + g * supers * gb + s * gb, true);
        }
  });
  return out;
}

inline at::Tensor deinterleave(const at::Tensor& groups_in, int64_t qtype, int64_t K) {
  check_type(qtype, K);
  const int64_t supers = K / unit_values(qtype), ub = row_unit_bytes(qtype), rb = supers * ub, gb = group_bytes(qtype);
  TORCH_CHECK(groups_in.scalar_type() == at::kByte && groups_in.dim() == 2 && groups_in.size(1) == supers * gb,
              "gguf deinterleave: groups must be uint8 [n, ", supers * gb, "]");
  const at::Tensor groups = groups_in.contiguous();
  const int64_t G = groups.size(0);
  at::Tensor out = at::empty({16 * G, rb}, at::kByte);
  uint8_t* src = groups.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> group(gb);
    for (int64_t g = begin; g < end; g++)
      for (int64_t s = 0; s < supers; s++) {
        std::memcpy(group.data(), src + g * supers * gb + s * gb, gb);
        for (int r = 0; r < 16; r++)
          move_unit(qtype, dst + (16 * g + r) * rb + s * ub, r, group.data(), false);
      }
  });
  return out;
}

// x [..., K] times the groups of 16 rows: arguments checked, then Kernel::mm<QT>(x, M, groups, group bytes, out, G,
// K) for the block type (x [M, K], out [M, 16 G] contiguous fp32)
template <class Kernel>
at::Tensor mm_interleaved_op(const at::Tensor& x_in, const at::Tensor& groups, int64_t qtype, int64_t K) {
  check_type(qtype, K);
  const int64_t gb = K / unit_values(qtype) * group_bytes(qtype);
  TORCH_CHECK(groups.scalar_type() == at::kByte && groups.dim() == 2 && groups.is_contiguous() &&
                  groups.size(1) == gb,
              "gguf interleaved: groups must be a contiguous uint8 [n, ", gb, "] tensor (from interleave)");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "gguf: x must be float32, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "gguf: x must end in ", K, " features");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), G = groups.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = 16 * G;
  at::Tensor out = at::empty({M, 16 * G}, at::kFloat);
  if (M == 0) return out.view(shape);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = groups.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (qtype) {
    case Q4_0: Kernel::template mm<Q4_0>(xp, M, wp, gb, op, G, K); break;
    case Q4_1: Kernel::template mm<Q4_1>(xp, M, wp, gb, op, G, K); break;
    case Q5_0: Kernel::template mm<Q5_0>(xp, M, wp, gb, op, G, K); break;
    case Q8_0: Kernel::template mm<Q8_0>(xp, M, wp, gb, op, G, K); break;
    case Q4_K: Kernel::template mm<Q4_K>(xp, M, wp, gb, op, G, K); break;
    default: Kernel::template mm<Q6_K>(xp, M, wp, gb, op, G, K);
  }
  return out.view(shape);
}

// The driver both kernels share, for mm_interleaved_op: x's rows rounded for the block type (gguf_activations.h),
// then every group of 16 weight rows times every row of x (groups split between torch's threads, each group on one)
// through Kernel::group<QT, MB>(activations, count, group, out, ldo, memory): 1-4 rows of x with MB = their count
// (accumulators in registers), more with MB = 0 and Kernel::kMemoryPerRow values of Kernel::Memory per row of x (the
// same operations per row either way).
template <class Kernel>
struct Groups {
  template <int64_t QT, class Activations>
  static void run(const Activations& xa, int64_t M, const uint8_t* wp, int64_t gb, float* op, int64_t G) {
    const int64_t N = 16 * G;
    at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
      std::vector<typename Kernel::Memory> memory(M > 4 ? Kernel::kMemoryPerRow * M : 0);
      for (int64_t g = begin; g < end; g++) {
        const uint8_t* grp = wp + g * gb;
        float* o = op + 16 * g;
        switch (M) {
          case 1: Kernel::template group<QT, 1>(xa, 1, grp, o, N, nullptr); break;
          case 2: Kernel::template group<QT, 2>(xa, 2, grp, o, N, nullptr); break;
          case 3: Kernel::template group<QT, 3>(xa, 3, grp, o, N, nullptr); break;
          case 4: Kernel::template group<QT, 4>(xa, 4, grp, o, N, nullptr); break;
          default: Kernel::template group<QT, 0>(xa, M, grp, o, N, memory.data());
        }
      }
    });
  }

  template <int64_t QT>
  static void mm(const float* x, int64_t M, const uint8_t* wp, int64_t gb, float* op, int64_t G, int64_t K) {
    using optimum_ipex_spec_activations::Activations32;
    using optimum_ipex_spec_activations::KActivations;
    if constexpr (QT == Q4_K || QT == Q6_K)
      run<QT>(KActivations(x, M, K, false, QT == Q4_K ? 32 : 16), M, wp, gb, op, G);
    else
      run<QT>(Activations32(x, M, K, QT), M, wp, gb, op, G);
  }
};

// the three operators of the layout, in namespace `m` (a TORCH_LIBRARY_FRAGMENT's)
inline void define_layout(torch::Library& m) {
  m.def("interleave(Tensor blocks, int qtype, int K) -> Tensor");
  m.def("deinterleave(Tensor groups, int qtype, int K) -> Tensor");
  m.def("mm_interleaved(Tensor x, Tensor groups, int qtype, int K) -> Tensor");
}

// their CPU implementations, multiplying through Kernel (see Groups)
template <class Kernel>
void implement_layout(torch::Library& m) {
  m.impl("interleave", &interleave);
  m.impl("deinterleave", &deinterleave);
  m.impl("mm_interleaved", &mm_interleaved_op<Groups<Kernel>>);
}

}  // namespace optimum_ipex_spec_gguf_layout
