// Tile configuration of the sm_90a ExpCast attention kernel: the one place both the host launcher and
// the device templates read. One configuration per head dim; the tile shape is the same for both (two
// consumer warpgroups of 64 query rows, 128 keys per tile), because tiles must coincide with the
// 128-token quantization blocks and the key order of numerics section 5 is defined per 128-row tile.
#pragma once

namespace openvc::sm90 {

// The tile shape and the warp roles, the same for both head dims.
inline constexpr int kBlockN = 128;                          // keys per tile == K quantization block
inline constexpr int kConsumerWarpgroups = 2;                // 64 query rows each
inline constexpr int kBlockM = 64 * kConsumerWarpgroups;     // == Q quantization block (one Q descale)
inline constexpr int kCtaThreads = 128 * (1 + kConsumerWarpgroups);
inline constexpr int kProducerRegs = 24;                     // setmaxnreg: the TMA warp needs few registers
inline constexpr int kConsumerRegs = 240;
// Tiles whose PV products share one tensor-core accumulator before it is added into FP32 registers
// (and at every rescale): 2 halves the FP32 adds; 8 k32 steps stay well inside FP8 accumulation.
inline constexpr int kFlushTiles = 2;
// Batched E4M3 calls whose tiles have at most this many key blocks run the few-keys mode (mode.h,
// kFewKeysMode: consumers in ping-pong): there the pipeline's fill and drain per query tile, not the softmax,
// set the time. Measured per key count (kernel, 32,760 queries, H = 40): 1.7-6.4% faster at 2-5 blocks, 0.8-2.1%
// at 6, none at 7-8 (docs/performance.md, fourteenth session).
inline constexpr int kFewKeyBlocks = 6;
// The same with Q quantized in the kernel (the one-call path): there the consumers' quantization at every tile start
// (two barriers of both warpgroups) is part of the boundary, and the turns pay up to 4,096 keys: one-call complete
// call 1.9% faster at 16 key blocks (S = 2,048, H = 66), 1.1% at 24, 0.6-1.0% at 32, at 64 (8,192 keys) the plain
// mode's time (docs/performance.md, twenty-second session); on prepared Q the same range measured -1.5% to +0.5%.
inline constexpr int kFewKeyBlocksFusedQ = 32;

template <int kD>
struct TileConfig {
  static_assert(kD == 128 || kD == 64, "the sm_90a kernel takes head dim 128 or 64");
  static constexpr int kHeadDim = kD;
  static constexpr int kBlockN = sm90::kBlockN;
  static constexpr int kConsumerWarpgroups = sm90::kConsumerWarpgroups;
  static constexpr int kBlockM = sm90::kBlockM;
  // K/V shared-memory ring depth: 5 stages of 33 KiB at D = 128; D = 64 tiles are half as large, so
  // the ring holds more tiles in flight for the same shared memory.
  static constexpr int kStages = kD == 128 ? 5 : 8;
  static constexpr int kThreads = kCtaThreads;
  static constexpr int kProducerRegs = sm90::kProducerRegs;
  static constexpr int kConsumerRegs = sm90::kConsumerRegs;
  // The CTA launches with 65536 / kThreads registers per thread, rounded down to 8 (168 at 384 threads);
  // setmaxnreg.inc of the consumers never returns if the warpgroups ask for more than that in all.
  static_assert(128 * (kProducerRegs + kConsumerWarpgroups * kConsumerRegs) <= (65536 / kThreads / 8 * 8) * kThreads,
                "producer + consumer setmaxnreg counts exceed the registers the CTA is launched with");
  // PV runs with N = D + 8: the V tile carries 8 extra rows of E4M3 1.0, so accumulator columns
  // D..D+7 are the row sum of the same decoded codes that feed PV (numerics section 4), rescaled
  // with the numerator for free.
  static constexpr int kPvN = kHeadDim + 8;
  static constexpr int kAccRegs = kPvN / 2;     // per-thread floats of a 64 x kPvN accumulator
  static constexpr int kOutChunks = kHeadDim / 8;  // 8-column chunks of O (the row sum is chunk kOutChunks)
  static constexpr int kRowBytes = kHeadDim;    // one FP8 Q or K row: its TMA swizzle and wgmma layout
  static constexpr int kTileBytes = kBlockN * kHeadDim;       // one FP8 K or V tile
  static constexpr int kVStageBytes = kPvN * kBlockN;         // V tile + the 8 row-sum rows
  static constexpr int kQBytes = kBlockM * kHeadDim;
  static constexpr int kFlushTiles = sm90::kFlushTiles;
  static_assert(kBlockM == 128 && kBlockN == 128, "tiles must coincide with the 128-token quantization blocks");
};

// Packed calls with at most this many sequences get the compact tile space (tiles.cuh); its table of
// per-sequence tile offsets lives in shared memory (4 KiB).
inline constexpr int kMaxCompactSeqs = 1024;

}  // namespace openvc::sm90
