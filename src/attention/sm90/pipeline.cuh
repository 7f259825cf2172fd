// The pipeline's shared state and its producer (kernel.cuh runs both): a mode's shared storage (Q tile, the K/V
// stage rings, their barriers), the ring position that producer and consumers advance alike, and the producer
// thread's TMA loads (a tile's Q, then K and V of every key block into the ring; repair tiles after them).
#pragma once
#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "attention/sm90/config.h"
#include "attention/sm90/kernel_params.h"
#include "attention/sm90/mode.h"
#include "attention/sm90/split.cuh"
#include "attention/sm90/tiles.cuh"
#include "common/pdl.cuh"

namespace openvc::sm90 {

// Shared storage of a mode: only VC mode holds the block means.
template <int kMode>
struct alignas(1024) SharedStorage {
  using C = ModeConfig<kMode>;
  static constexpr int kMeanStages = has_mode<kMode>(kVcMode) ? C::kStages : 0;
  uint8_t q[C::kQBytes];
  uint8_t k[C::kStages][C::kTileBytes];
  uint8_t v[C::kStages][C::kVStageBytes];
  uint64_t q_full, q_empty;
  uint64_t k_full[C::kStages], k_empty[C::kStages];
  uint64_t v_full[C::kStages], v_empty[C::kStages];
  float vc_mean[kMeanStages > 0 ? kMeanStages : 1][C::kHeadDim];  // VC: the V tile's block mean / descale
  int seq_tile0[has_mode<kMode>(kVarlenMode) ? kMaxCompactSeqs + 1 : 1];  // varlen: the compact tile space
  static_assert(C::kQBytes % 1024 == 0 && C::kTileBytes % 1024 == 0 && C::kVStageBytes % 1024 == 0,
                "swizzled operand tiles must stay 1024-byte aligned");
  static_assert(!has_mode<kMode>(kInt8QkMode) || !has_mode<kMode>(Mode(kVcMode | kRepairMode)),
                "INT8 Q/K combines with causal, varlen and head dim 64, not with repair or VC");
  static_assert(!has_mode<kMode>(kHeadDim64Mode) || !has_mode<kMode>(Mode(kVcMode | kRepairMode)),
                "repair and VC modes are built for head dim 128 only");
  static_assert(!has_mode<kMode>(kExp2PMode) || has_mode<kMode>(kInt8QkMode),
                "the exp2 P format is built for INT8 Q/K only (not with repair or VC)");
  static_assert(!has_mode<kMode>(kVBlockDescaleMode) ||
                    (has_mode<kMode>(kVarlenMode) &&
                     !has_mode<kMode>(Mode(kVcMode | kRepairMode | kBlockListMode | kHeadDim64Mode | kExp2PMode))),
                "V block descales are built with varlen, head dim 128 (not repair, VC, block lists or exp2)");
  static_assert(!has_mode<kMode>(kBlockListMode) ||
                    !has_mode<kMode>(Mode(kVcMode | kRepairMode | kCausalMode | kVarlenMode | kExp2PMode)),
                "key block lists are built for batched calls (not causal, varlen, repair, VC or exp2)");
  static_assert(!has_mode<kMode>(kChunkedCausalMode) || has_mode<kMode>(kCausalMode),
                "chunked causal is a variant of the causal mode");
  static_assert(!has_mode<kMode>(kFusedQMode) ||
                    !has_mode<kMode>(Mode(kVcMode | kRepairMode | kInt8QkMode | kExp2PMode | kBlockListMode |
                                          kVBlockDescaleMode | kChunkedCausalMode)),
                "Q is quantized in the kernel for E4M3 calls, plain or causal, batched or packed, only");
  static_assert(!has_mode<kMode>(kFewKeysMode) || (kMode & ~(kFewKeysMode | kFusedQMode | kSplitTilesMode)) == 0,
                "the few-keys mode is built for batched E4M3 head dim 128 calls, plain or with Q quantized here");
  static_assert(!has_mode<kMode>(kSplitTilesMode) ||
                    (has_mode<kMode>(kFusedQMode) && (kMode & ~(kFewKeysMode | kFusedQMode | kSplitTilesMode)) == 0),
                "split tiles are built for batched E4M3 head dim 128 calls with Q quantized here (the one-call path)");
  // kFusedQMode (last, so that the other modes' members keep their offsets): the tile's 128 BF16 / FP16 query
  // rows as the TMA brings them (dense rows), and the consumer warps' partial maxima of the tile.
  static constexpr int kQStageBytes = has_mode<kMode>(kFusedQMode) ? C::kBlockM * C::kHeadDim * 2 : 16;
  alignas(has_mode<kMode>(kFusedQMode) ? 1024 : 16) uint8_t q_stage[kQStageBytes];
  float q_amax[4 * kConsumerWarpgroups];
};

using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
using Barrier = cutlass::arch::ClusterBarrier;
constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;  // arrivals that free a buffer

// Ring position shared by the producer and both consumers: every key block takes one stage.
template <int kStages>
struct RingState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <int kMode, int kProbe>
__device__ __forceinline__ void producer_loop(SharedStorage<kMode>& sh, const KernelParams& p, const TileSpace& ts,
                                              const CUtensorMap* tm_q,
                                              const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                              const CUtensorMap* tm_krep, const CUtensorMap* tm_vrep) {
  using C = ModeConfig<kMode>;
  constexpr bool kVarlen = has_mode<kMode>(kVarlenMode);
  RingState<C::kStages> ring;
  int iter = 0;  // Q tiles loaded (tiles without keys load none)
  // kSplit: `tile` is a cursor over this CTA's whole head tiles, then its range of tail units (split.cuh).
  constexpr bool kSplit = has_mode<kMode>(kSplitTilesMode);
  const int split_end = kSplit ? split_stop(p) : 0;
  int next_piece = 0;
  for (int tile = kSplit ? split_start(p) : int(blockIdx.x); kSplit ? tile < split_end : tile < ts.count;
       tile = kSplit ? next_piece : next_tile<kMode>(tile, p)) {
    TileSegment seg{};
    if constexpr (kSplit) seg = split_segment(p, tile, split_end), next_piece = seg.next;
    // Varlen: the tile's sequence ranges come from global loads; made visibly uniform (this thread is lane 0
    // alone), the TMA coordinates derived from them stay in uniform registers instead of moving there per block.
    const TileWork w = kSplit    ? piece_work<kMode>(seg.tile, seg.first, seg.count, p, ts)
                       : kVarlen ? uniform_tile_work<kMode>(tile, p, ts, 1u)
                                 : tile_work<kMode>(tile, p, ts);
    const TileCoord& c = w.c;
    if (w.n <= 0) continue;  // the consumers write zeros (or nothing) for it
    Barrier::wait(&sh.q_empty, (iter & 1) ^ 1);
    ++iter;
    if constexpr (has_mode<kMode>(kFusedQMode)) {   // the unquantized rows, for the consumers to quantize
      TxBarrier::arrive_and_expect_tx(&sh.q_full, SharedStorage<kMode>::kQStageBytes);
      if constexpr (kVarlen) cute::SM90_TMA_LOAD_3D::copy(tm_q, &sh.q_full, 0, sh.q_stage, 0, w.q_row, c.h);
      else cute::SM90_TMA_LOAD_4D::copy(tm_q, &sh.q_full, 0, sh.q_stage, 0, w.q_row, c.h, c.b);
      if (iter == 1 && p.q_before_prior_grid) wait_for_prior_grid();   // before K and V (the kernel's start)
    } else {
      TxBarrier::arrive_and_expect_tx(&sh.q_full, C::kQBytes);
      if constexpr (kVarlen) cute::SM90_TMA_LOAD_3D::copy(tm_q, &sh.q_full, 0, sh.q, 0, w.q_row, c.h);
      else cute::SM90_TMA_LOAD_4D::copy(tm_q, &sh.q_full, 0, sh.q, 0, w.q_row, c.h, c.b);
    }
    const int kvh = kv_head(p, c.h);   // K and V of the query head's group (grouped-query attention)
    for (int i = 0; i < w.n; ++i, ring.advance()) {
      const int blk = key_block<kMode>(w, i, p.num_k_blocks);
      Barrier::wait(&sh.k_empty[ring.stage], ring.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&sh.k_full[ring.stage], C::kTileBytes);
      if constexpr (kVarlen)
        cute::SM90_TMA_LOAD_3D::copy(tm_k, &sh.k_full[ring.stage], 0, sh.k[ring.stage], 0,
                                     w.k_row0 + blk * kBlockN, kvh);
      else
        cute::SM90_TMA_LOAD_4D::copy(tm_k, &sh.k_full[ring.stage], 0, sh.k[ring.stage], 0, blk * kBlockN,
                                     kvh, c.b);
      Barrier::wait(&sh.v_empty[ring.stage], ring.phase ^ 1);
      constexpr int kMeanBytes = has_mode<kMode>(kVcMode) ? C::kHeadDim * 4 : 0;
      TxBarrier::arrive_and_expect_tx(&sh.v_full[ring.stage], C::kTileBytes + kMeanBytes);
      cute::SM90_TMA_LOAD_3D::copy(tm_v, &sh.v_full[ring.stage], 0, sh.v[ring.stage], blk * kBlockN, 0,
                                   c.b * p.kv_heads + kvh);
      if constexpr (kMeanBytes > 0)
        cute::SM90_BULK_COPY_G2S::copy(
            p.vc_mean_scaled + (int64_t(c.b * p.heads + c.h) * p.num_k_blocks + blk) * C::kHeadDim,
            &sh.v_full[ring.stage], sh.vc_mean[ring.stage], kMeanBytes);
    }
    // Repair tiles: K copies [B, H, R, D] and residual V [B*H, D, R], after every original block.
    for (int r = 0; has_mode<kMode>(kRepairMode) && r < p.repair_tiles; ++r, ring.advance()) {
      Barrier::wait(&sh.k_empty[ring.stage], ring.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&sh.k_full[ring.stage], C::kTileBytes);
      cute::SM90_TMA_LOAD_4D::copy(tm_krep, &sh.k_full[ring.stage], 0, sh.k[ring.stage], 0, r * kBlockN, c.h,
                                   c.b);
      Barrier::wait(&sh.v_empty[ring.stage], ring.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&sh.v_full[ring.stage], C::kTileBytes);
      cute::SM90_TMA_LOAD_3D::copy(tm_vrep, &sh.v_full[ring.stage], 0, sh.v[ring.stage], r * kBlockN, 0,
                                   c.b * p.heads + c.h);
    }
  }
}

}  // namespace openvc::sm90
