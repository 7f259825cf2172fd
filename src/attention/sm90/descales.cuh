// The descales a consumer reads from global memory per tile and per key block (numerics sections 1, 3, 9): the
// tile's Q descale(s) and the Q part of the ExpCast multiplier, the (b, h)'s K descales and a block's. Loads and
// the multiply are separate so that the kernel can issue a load early and use it late (kernel.cuh, consumer_loop).
#pragma once
#include <cstdint>

#include "attention/sm90/config.h"
#include "attention/sm90/kernel_params.h"
#include "attention/sm90/mode.h"
#include "attention/sm90/softmax.cuh"
#include "attention/sm90/tiles.cuh"

namespace openvc::sm90 {

// The tile's Q descales: one per tile for E4M3 Q (one descale per 128-row block), one per row for INT8 Q (rows
// r and r + 8 of this thread). INT8 q_descale is [sequences, H, seqlen_q] batched and packed alike (packed:
// seqlen_q = max_seqlen_q, row i of sequence b at (b * H + h) * max_seqlen_q + i, 0 past the sequence's end).
// Rows past seqlen_q (never stored; batched: Q codes zero) read the last row's descale, so with b < sequences
// and h < H (the tile space) no read leaves the [sequences * H * seqlen_q] array whatever the offsets.
__device__ __forceinline__ float int8_row_q_descale(const KernelParams& p, const TileCoord& c, int row) {
  const float* dq = p.q_descale + (int64_t(c.b) * p.heads + c.h) * p.seqlen_q;
  return __ldg(dq + min(c.qt * kBlockM + row, p.seqlen_q - 1));   // INT8: the tile's row `row`, clamped
}
template <int kMode>
__device__ __forceinline__ auto q_descales(const KernelParams& p, const TileCoord& c, int row) {
  if constexpr (has_mode<kMode>(kInt8QkMode)) {
    return RowMult{int8_row_q_descale(p, c, row), int8_row_q_descale(p, c, row + 8)};
  } else {
    return p.q_descale[(c.b * p.heads + c.h) * p.num_q_tiles + c.qt];
  }
}
// The Q part of the ExpCast multiplier, qk_multiplier * descale_Q (numerics sections 3, 9), of q_descales' loads.
__device__ __forceinline__ float q_multiplier(const KernelParams& p, float dq) { return p.qk_multiplier * dq; }
__device__ __forceinline__ RowMult q_multiplier(const KernelParams& p, RowMult dq) {
  return RowMult{p.qk_multiplier * dq.lo, p.qk_multiplier * dq.hi};
}

// INT8: the largest Q multiplier of the warpgroup's 64 rows (int8_row_q_descale's clamp), the same in its four
// warps: redux.sync gives every warp the lanes' maximum in a uniform register.
// tile_may_be_huge's decision picks the steps that issue the warpgroup's wgmma, so all four warps must take it
// alike; with each warp's own rows one warp could take the general step while the others took the grouped ones
// (an illegal instruction at the wgmma). Descales are >= 0, so their bits order as the floats (NaN and -0 count
// as 0 here; a NaN row's output is NaN anyway).
template <int kMode>
__device__ __forceinline__ float warpgroup_max_q_multiplier(const KernelParams& p, const TileCoord& c, int wg_row0) {
  static_assert(has_mode<kMode>(kInt8QkMode), "E4M3 Q has one descale per tile");
  const int row = wg_row0 + (threadIdx.x & 31);
  float m = fmaxf(int8_row_q_descale(p, c, row), int8_row_q_descale(p, c, row + 32));
  m = m > 0.0f ? m : 0.0f;
  return p.qk_multiplier * __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(m)));
}

// The (b, h)'s K descales: [nk] E4M3 (one per 128-key block), [nk, 8] INT8 (key groups; 64-bit index).
template <bool kInt8>
__device__ __forceinline__ const float* k_descales(const KernelParams& p, const TileCoord& c) {
  const int kvh = kv_head(p, c.h);
  if constexpr (kInt8) return p.k_descale + (int64_t(c.b) * p.kv_heads + kvh) * p.num_k_blocks * kInt8KeyGroups;
  else return p.k_descale + (c.b * p.kv_heads + kvh) * p.num_k_blocks;
}
// The first block's K descale(s) and the one-iteration-ahead prefetch of the next block's.
template <bool kInt8>
__device__ __forceinline__ auto block_k_descale(const float* kd, int blk, int t) {
  if constexpr (kInt8) return load_k_groups(kd, blk, t);
  else return kd[blk];
}
template <bool kInt8>
__device__ __forceinline__ auto prefetch_k_descale(const float* kd, int blk, int t) {
  if constexpr (kInt8) return load_k_groups(kd, blk, t);
  else return __ldg(kd + blk);
}

}  // namespace openvc::sm90
