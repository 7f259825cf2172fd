// Which tiles a CTA of the sm_90a kernel works on and what each one does: the tile space (every
// (sequence, head, 128-row query tile); packed sequences compacted so that no tile slot is empty), the
// persistent CTAs' dealing order, and a tile's query/key ranges and key order (numerics section 5).
// Computed identically by the producer and the consumers.
#pragma once
#include <cstdint>

#include "attention/sm90/config.h"
#include "attention/sm90/kernel_params.h"
#include "attention/sm90/mode.h"
#include "attention/sm90/traversal.h"

namespace openvc::sm90 {

// The launch's tiles. Packed sequences (cu_seqlens, at most kMaxCompactSeqs of them) are compacted:
// seq_tile0[s] (shared memory) is P_s, the query tiles of the sequences before s, so tile slots exist
// only where a sequence has rows. A layout of max_seqlen_q tiles per sequence left empty slots between
// uneven sequences, which the round-robin dealing spread unevenly over the CTAs (modelled: 0.964 of an
// even load for 40,000 + 25,000 + 8,397 tokens at H = 7; compact 0.989).
struct TileSpace {
  int count;                       // tiles of the launch (warp-uniform)
  const int* seq_tile0 = nullptr;  // compact packed sequences: P_0..P_N, else null
};

// P_s of every packed sequence into seq_tile0 (all lanes of a warp; `write` for one warp; offsets clamped
// as in tile_work).
__device__ __forceinline__ void build_compact_tiles(int* seq_tile0, const KernelParams& p, bool write) {
  const int lane = threadIdx.x & 31;
  constexpr unsigned kAll = 0xffffffffu;
  int carry = 0;
  for (int s0 = 0; s0 < p.batch; s0 += 32) {
    const int s = s0 + lane;
    int x = 0;
    if (s < p.batch) {
      const int q0 = min(max(__ldg(p.cu_q + s), 0), p.total_q);
      const int q1 = min(max(__ldg(p.cu_q + s + 1), q0), p.total_q);
      // At most num_q_tiles (max_seqlen_q's): rows past it are not attended (as in the uncompacted
      // layout and the general path), and the Q descales hold only that many blocks per sequence.
      x = min((q1 - q0 + kBlockM - 1) / kBlockM, p.num_q_tiles);
    }
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(kAll, x, d);
      if (lane >= d) x += y;
    }
    if (write && s < p.batch) seq_tile0[s + 1] = carry + x;
    carry += __shfl_sync(kAll, x, 31);
  }
  if (write && lane == 0) seq_tile0[0] = 0;
}

// Modes whose tiles may have no query row or no visible key (causal, packed sequences, key counts).
template <int kMode>
inline constexpr bool kTilesMayIdle =
    has_mode<kMode>(kCausalMode) || has_mode<kMode>(kVarlenMode) || has_mode<kMode>(kBlockListMode);

// The largest power of two below kMaxCompactSeqs: the binary search's first step.
inline constexpr int kCompactSearchSpan = 512;
static_assert(kCompactSearchSpan * 2 >= kMaxCompactSeqs && kCompactSearchSpan < kMaxCompactSeqs);

struct TileCoord {
  int b, h, qt;  // b: batch entry or packed sequence
};
template <int kMode>
__device__ __forceinline__ TileCoord decode_tile(int tile, const KernelParams& p, const TileSpace& ts) {
  // Consecutive tiles share (b, h), so the CTAs running at once read the same K/V from L2. Causal:
  // the heaviest query tiles (most visible keys) of a (b, h) come first, so the last wave is light;
  // with causal_snake, query-tile-major over every (b, h), heaviest first (next_tile deals them); packed
  // causal, query-tile-major within each sequence (below): balance over L2 sharing, as causal_snake.
  TileCoord c;
  int bh;
  if (has_mode<kMode>(kVarlenMode) && p.compact_tiles) {   // a kernel parameter: a uniform branch
    // Compact packed sequences: sequence s holds tiles [H P_s, H P_{s+1}), (h, qt) in order (causal: (qt, h),
    // below); the last s with H P_s <= tile has a tile there (tile < H P_N).
    // A fixed number of halving steps with predicated selects: a loop whose trip count depends on the
    // data would make the consumer loop divergent.
    int lo = 0;
#pragma unroll
    for (int step = kCompactSearchSpan; step > 0; step >>= 1) {
      const int mid = lo + step;
      if (mid < p.batch && p.heads * ts.seq_tile0[mid] <= tile) lo = mid;
    }
    const int first = ts.seq_tile0[lo], nq = ts.seq_tile0[lo + 1] - first, local = tile - p.heads * first;
    c.b = lo;
    if constexpr (has_mode<kMode>(kCausalMode)) {
      // Causal: query-tile-major within the sequence, heaviest first (every head's last query tile, then the
      // ones before): dealt round-robin, the CTAs' loads then stay even (per (h, qt), the busiest CTA carried
      // 1.20x the mean at 2 x 16,384 tokens, H = 24; docs/performance.md, twentieth session).
      const int level = local / p.heads;
      c.h = local - level * p.heads;
      c.qt = nq - 1 - level;
    } else {
      c.h = local / nq;
      c.qt = local - c.h * nq;
    }
    return c;
  }
  if (has_mode<kMode>(kCausalMode) && p.causal_snake) {
    const int groups = p.batch * p.heads;
    c.qt = p.num_q_tiles - 1 - tile / groups;
    bh = tile % groups;
  } else {
    c.qt = tile % p.num_q_tiles;
    if constexpr (has_mode<kMode>(kCausalMode)) c.qt = p.num_q_tiles - 1 - c.qt;
    bh = tile / p.num_q_tiles;
  }
  c.h = bh % p.heads;
  c.b = bh / p.heads;
  return c;
}

// This CTA's next tile: every gridDim.x-th; causal_snake deals round m of gridDim.x tiles in
// alternating directions (the rounds stay in order, so the sequence still increases).
template <int kMode>
__device__ __forceinline__ int next_tile(int tile, const KernelParams& p) {
  if (has_mode<kMode>(kCausalMode) && p.causal_snake) {
    const int g = gridDim.x, m = tile / g + 1;
    return m * g + ((m & 1) ? g - 1 - int(blockIdx.x) : int(blockIdx.x));
  }
  return tile + gridDim.x;
}

// What one query tile does, computed identically by the producer and the consumers.
struct TileWork {
  TileCoord c;
  int q_row;     // TMA row of the tile's first query (plain: in the [B, Sq] map; varlen: of [total_q])
  int k_row0;    // varlen: TMA row of the sequence's first key (plain: 0)
  int sq, sk;    // the sequence's query and key counts
  int q_out0;    // output token of query row 0 (packed: cu_q[s]; batched: 0)
  int n;         // key blocks to visit; 0: no visible key (output 0, lse -inf); < 0: no query row here
  KeyOrder order;   // visiting order of key blocks, or of list positions (kBlockListMode)
  const int* blocks = nullptr;   // kBlockListMode: the tile's row of block indices
  int first = 0;   // kSplitTilesMode: the order position of step 0 (a tail part starts past 0; n is then its count)
};
template <int kMode>
__device__ __forceinline__ TileWork tile_work(int tile, const KernelParams& p, const TileSpace& ts) {
  constexpr bool kVarlen = has_mode<kMode>(kVarlenMode), kCausal = has_mode<kMode>(kCausalMode);
  TileWork w{decode_tile<kMode>(tile, p, ts), 0, 0, p.seqlen_q, p.seqlen_k, 0, p.num_k_blocks, KeyOrder(0, 1, -1)};
  const int r0 = w.c.qt * kBlockM;
  w.q_row = r0;
  if constexpr (kVarlen) {
    int q0 = w.c.b * p.seqlen_q, k0 = w.c.b * p.seqlen_k;
    if (p.cu_q != nullptr) {  // clamped to the tensors: no offset reads or writes out of bounds
      q0 = min(max(__ldg(p.cu_q + w.c.b), 0), p.total_q);
      w.sq = min(max(__ldg(p.cu_q + w.c.b + 1), q0), p.total_q) - q0;
      k0 = min(max(__ldg(p.cu_k + w.c.b), 0), p.total_k);
      w.sk = min(max(__ldg(p.cu_k + w.c.b + 1), k0), p.total_k) - k0;
      w.q_out0 = q0;
    }
    if (p.seqused_k != nullptr) w.sk = min(w.sk, max(__ldg(p.seqused_k + w.c.b), 0));
    w.sk = min(w.sk, p.num_k_blocks * kBlockN);  // keys past the descale / V arrays are never read
    w.q_row = q0 + r0;
    w.k_row0 = k0;
    w.n = (w.sk + kBlockN - 1) / kBlockN;
  }
  if (kTilesMayIdle<kMode> && r0 >= w.sq) {
    w.n = -1;
    return w;
  }
  if constexpr (kCausal) {
    // Blocks the tile's last row sees (numerics section 5; chunked causal too), from the diagonal down.
    if constexpr (has_mode<kMode>(kChunkedCausalMode)) {
      const int limit = causal_key_limit(min(r0 + kBlockM, w.sq) - 1, w.sq, w.sk, p.causal_chunk);
      w.n = min((limit + kBlockN - 1) / kBlockN, w.n);
    } else {   // the same with chunk 1
      const int last_key = min(r0 + kBlockM, w.sq) - 1 + (w.sk - w.sq);
      w.n = last_key < 0 ? 0 : min(last_key / kBlockN + 1, w.n);
    }
    w.order = KeyOrder(w.n - 1, w.n, p.mid_window_blocks < 0 ? -1 : 0);
  } else {
    // floor(r0 Sk / Sq / 128) with r0 = 128 qt is floor(qt Sk / Sq); 32-bit (the host checks the
    // range) because a 64-bit division is a call, and a call serializes the wgmma pipeline.
    const int diag = static_cast<int>((uint32_t(w.c.qt) * uint32_t(w.sk)) / uint32_t(w.sq));
    if constexpr (has_mode<kMode>(kBlockListMode)) {
      // The mid-window order over list positions, measured from the first listed block: for a list of
      // consecutive blocks (windows, frame-causal) it starts at the listed block diag + w (numerics
      // section 5, "Key block lists"). Two loads per tile, no search.
      const int64_t row = w.c.b * p.blk_stride_b + w.c.h * p.blk_stride_h + w.c.qt;
      w.blocks = p.blk_index + row * p.blk_capacity;
      w.n = min(max(__ldg(p.blk_count + row), 0), p.blk_capacity);
      const int first = w.n > 0 ? min(max(__ldg(w.blocks), 0), p.num_k_blocks - 1) : 0;
      w.order = KeyOrder(diag - first, w.n, p.mid_window_blocks);
    } else {
      w.order = KeyOrder(diag, w.n, p.mid_window_blocks);
    }
  }
  return w;
}

// The key block a tile visits at step i: the order's block, or (kBlockListMode) the listed block at the
// order's list position, clamped to [0, nk) so that no index reads outside K, V or the descales.
template <int kMode>
__device__ __forceinline__ int key_block(const TileWork& w, int i, int nk) {
  const int pos = w.order(has_mode<kMode>(kSplitTilesMode) ? w.first + i : i);
  if constexpr (has_mode<kMode>(kBlockListMode)) return min(max(__ldg(w.blocks + pos), 0), nk - 1);
  else return pos;
}

// The consumers' key block at order position pos: pos itself, or (kBlockListMode) the listed block there
// (key_block's clamp) made visibly uniform with redux.sync for the mask branches. blocks: TileWork::blocks.
template <int kMode>
__device__ __forceinline__ int consumer_block(const int* blocks, int pos, int nk) {
  if constexpr (has_mode<kMode>(kBlockListMode))
    return int(__reduce_max_sync(0xffffffffu, min(max(__ldg(blocks + pos), 0), nk - 1)));
  else return pos;
}

// A tile's work with every field made visibly warp-uniform: the consumers' copy, and the varlen producer's. The
// varlen fields come from loads (offsets, key counts), which ptxas cannot prove equal across the warp: loop bounds
// derived from them made it treat the whole consumer loop as divergent (R2UR moves, WARPSYNC), and the producer
// moved its TMA coordinates into uniform registers (R2UR) at every key block and spilled. redux.sync writes a
// uniform register, so its result is known uniform. `lanes`: the calling lanes, every lane of a consumer warp, or
// lane 0 alone for the producer thread.
template <int kMode>
__device__ __forceinline__ TileWork uniform_tile_work(int tile, const KernelParams& p, const TileSpace& ts,
                                                      unsigned lanes = 0xffffffffu) {
  TileWork w = tile_work<kMode>(tile, p, ts);
  if constexpr (has_mode<kMode>(kVarlenMode)) {
    w.c.b = __reduce_max_sync(lanes, w.c.b);
    w.c.h = __reduce_max_sync(lanes, w.c.h);
    w.c.qt = __reduce_max_sync(lanes, w.c.qt);
    w.q_row = __reduce_max_sync(lanes, w.q_row);
    w.k_row0 = __reduce_max_sync(lanes, w.k_row0);
    w.sq = __reduce_max_sync(lanes, w.sq);
    w.sk = __reduce_max_sync(lanes, w.sk);
    w.q_out0 = __reduce_max_sync(lanes, w.q_out0);
    w.n = __reduce_max_sync(lanes, w.n);
    w.order.j0 = __reduce_max_sync(lanes, w.order.j0);
  }
  if constexpr (has_mode<kMode>(kBlockListMode)) {   // loaded counts and first blocks
    w.n = __reduce_max_sync(lanes, w.n);
    w.order.j0 = __reduce_max_sync(lanes, w.order.j0);
  }
  return w;
}

// kSplitTilesMode: the work of a piece of a tile, order positions [first, first + count) (split.cuh, TileSegment).
template <int kMode>
__device__ __forceinline__ TileWork piece_work(int tile, int first, int count, const KernelParams& p, const TileSpace& ts) {
  TileWork w = tile_work<kMode>(tile, p, ts);
  w.first = first;
  w.n = count;
  return w;
}

// The consumers' tiles: this CTA's tiles that have keys to visit. A tile without keys or query rows is
// skipped here, before the body, not by a branch inside it: with the branch ptxas treated the whole
// consumer loop as divergent (WARPSYNC before every wgmma issue, 4x the R2UR moves; packed sequences ran
// 9% below the same tiles batched). Key-less tiles get their zeros after the main loop.
template <int kMode>
__device__ __forceinline__ int next_work(int tile, const KernelParams& p, const TileSpace& ts) {
  do tile = next_tile<kMode>(tile, p);
  while (kTilesMayIdle<kMode> && tile < ts.count &&
         uniform_tile_work<kMode>(tile, p, ts).n <= 0);
  return tile;
}
template <int kMode>
__device__ __forceinline__ int first_work(const KernelParams& p, const TileSpace& ts) {
  const int tile = blockIdx.x;
  if (kTilesMayIdle<kMode> && tile < ts.count &&
      uniform_tile_work<kMode>(tile, p, ts).n <= 0)
    return next_work<kMode>(tile, p, ts);
  return tile;
}


}  // namespace openvc::sm90
