// Split tiles (kSplitTilesMode; numerics section 5, "Split tiles"): the persistent CTAs take the last one to two
// waves of tiles as contiguous ranges of their key blocks instead of whole tiles, so no SM idles through the last wave.
// A tile that a range boundary cuts is computed in two parts, each an online softmax of its own; each part's
// consumer warps store their [O | l] registers and lagging maxima in a slot of the call's workspace, and the
// second warp to arrive (an atomic count per slot and warp) folds the two and stores the output.
#pragma once
#include <cstdint>

#include "attention/sm90/config.h"
#include "attention/sm90/expcast.cuh"
#include "attention/sm90/kernel_params.h"
#include "attention/sm90/softmax.cuh"

namespace openvc::sm90 {

// The launch's tiles in the dealing order: the first split_head_tiles (a multiple of the grid) go round robin, whole,
// as in the other modes (the CTAs running at once share a head's K/V in L2); the rest, the tail (the last one to two
// waves), are dealt as units: unit u is order position u % nk of tail tile u / nk (nk = num_k_blocks), and CTA c
// takes units [split_begin(c), split_begin(c + 1)). The host keeps the tail at least a grid of tiles (so every range
// holds at least nk units and a boundary cuts a tile at most once: into a head part, the end of one CTA's range, and a
// tail part, the start of the next one's) and head tiles + tail units below 2^31.
__device__ __forceinline__ int split_begin(const KernelParams& p, int cta) {
  return cta * p.split_q + min(cta, p.split_r);
}

// A CTA's walk: a cursor x below split_head_tiles is a whole head tile; x = split_head_tiles + u is tail unit u.
__device__ __forceinline__ int split_start(const KernelParams& p) {
  return int(blockIdx.x) < p.split_head_tiles ? int(blockIdx.x) : p.split_head_tiles + split_begin(p, blockIdx.x);
}
__device__ __forceinline__ int split_stop(const KernelParams& p) {
  return p.split_head_tiles + split_begin(p, blockIdx.x + 1);
}

// The piece of a tile at cursor x: order positions [first, first + count) of `tile`. part: -1 the whole tile, 0 a
// cut tile's head part, 1 its tail part; slot: the CTA whose range starts at the cut (the parts' exchange slot);
// next: the cursor after it.
struct TileSegment {
  int tile, first, count, part, slot, next;
};
__device__ __forceinline__ TileSegment split_segment(const KernelParams& p, int x, int stop) {
  const int nk = p.num_k_blocks, head = p.split_head_tiles;
  TileSegment s;
  if (x < head) {   // a whole tile of the round-robin head
    s.tile = x, s.first = 0, s.count = nk, s.part = -1, s.slot = 0;
    s.next = x + int(gridDim.x) < head ? x + int(gridDim.x) : head + split_begin(p, blockIdx.x);
    return s;
  }
  const int u = x - head, t = u / nk;
  s.tile = head + t;
  s.first = u - t * nk;
  s.count = min(nk - s.first, stop - x);
  s.part = s.first > 0 ? 1 : s.count < nk ? 0 : -1;
  s.slot = s.first > 0 ? int(blockIdx.x) : int(blockIdx.x) + 1;
  s.next = x + s.count;
  return s;
}

// Floats of one consumer warp's partial: its [O | l] registers and the two lagging maxima, lane-interleaved.
template <int kD>
inline constexpr int kSplitWarpFloats = (TileConfig<kD>::kAccRegs + 2) * 32;
// Partials of a launch on `grid` CTAs: [grid slots][2 parts][consumer warps] (launch.h: after [grid][warps] counts).
template <int kD>
__host__ __device__ constexpr int64_t split_partials_floats(int grid) {
  return int64_t(grid) * 2 * (4 * kConsumerWarpgroups) * kSplitWarpFloats<kD>;
}

// A part's end (consumer warp `warp` of the CTA, every lane): stores this warp's partial, counts its arrival, and
// returns false if the other part has not arrived yet (it will fold both). The second folds: the maxima of the two
// become their larger, each [O | l] register is scaled by 2^((M_part - M) / 8) and the two are summed, head part
// first whichever arrives last (the same bits every run), and its count goes back to 0; true: st holds the tile.
template <int kD>
__device__ __forceinline__ bool split_exchange(ConsumerState<kD>& st, const KernelParams& p, int slot, int part,
                                               int warp, int lane) {
  constexpr int kAcc = TileConfig<kD>::kAccRegs, kWarps = 4 * kConsumerWarpgroups;
  float* mine = p.split_partials + (int64_t(slot * 2 + part) * kWarps + warp) * kSplitWarpFloats<kD> + lane;
  const float* theirs = p.split_partials + (int64_t(slot * 2 + (part ^ 1)) * kWarps + warp) * kSplitWarpFloats<kD> + lane;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) __stcg(mine + 32 * i, st.o[i]);
  __stcg(mine + 32 * kAcc, st.mo_lo);
  __stcg(mine + 32 * (kAcc + 1), st.mo_hi);
  __threadfence();   // the partial before the count (the other part reads it after seeing the count)
  __syncwarp();
  int* count = p.split_arrivals + slot * kWarps + warp;
  int before = 0;
  if (lane == 0) before = atomicAdd(count, 1);
  before = __shfl_sync(0xffffffffu, before, 0);
  if (before == 0) return false;
  __threadfence();
  if (lane == 0) *count = 0;   // both parts are in: ready for the next launch on this workspace
  const float other_lo = __ldcg(theirs + 32 * kAcc), other_hi = __ldcg(theirs + 32 * (kAcc + 1));
  const float head_lo = part == 0 ? st.mo_lo : other_lo, tail_lo = part == 0 ? other_lo : st.mo_lo;
  const float head_hi = part == 0 ? st.mo_hi : other_hi, tail_hi = part == 0 ? other_hi : st.mo_hi;
  const float m_lo = fmaxf(head_lo, tail_lo), m_hi = fmaxf(head_hi, tail_hi);
  const float x_lo = fast_exp2((head_lo - m_lo) * kMaxToLog2), y_lo = fast_exp2((tail_lo - m_lo) * kMaxToLog2);
  const float x_hi = fast_exp2((head_hi - m_hi) * kMaxToLog2), y_hi = fast_exp2((tail_hi - m_hi) * kMaxToLog2);
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const float other = __ldcg(theirs + 32 * i);
    const float head = part == 0 ? st.o[i] : other, tail = part == 0 ? other : st.o[i];
    const bool lo = (i % 4) < 2;   // registers 4j, 4j+1: row g; 4j+2, 4j+3: row g + 8 (the row sums too)
    st.o[i] = __fmaf_rn(head, lo ? x_lo : x_hi, __fmul_rn(tail, lo ? y_lo : y_hi));
  }
  st.mo_lo = m_lo;
  st.mo_hi = m_hi;
  return true;
}

}  // namespace openvc::sm90
