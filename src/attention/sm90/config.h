// Tile configuration of the sm_90a ExpCast attention kernel: the one place both the host launcher and
// the device templates read.
#pragma once

namespace openvc::sm90 {

struct KernelConfig {
  static constexpr int kHeadDim = 128;
  static constexpr int kBlockN = 128;           // keys per tile == K quantization block (one multiplier)
  static constexpr int kConsumerWarpgroups = 2; // ping-pong pair, 64 query rows each
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;  // == Q quantization block (one Q descale)
  static constexpr int kStages = 5;             // K/V shared-memory ring depth
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kProducerRegs = 24;      // setmaxnreg: the TMA warp needs few registers
  static constexpr int kConsumerRegs = 240;
  // PV runs with N = D + 8: the V tile carries 8 extra rows of E4M3 1.0, so accumulator columns
  // D..D+7 are the row sum of the same decoded codes that feed PV (numerics section 4), rescaled
  // with the numerator for free.
  static constexpr int kPvN = kHeadDim + 8;
  static constexpr int kTileBytes = kBlockN * kHeadDim;       // one FP8 K or V tile, 16 KiB
  static constexpr int kVStageBytes = kPvN * kBlockN;         // V tile + the 8 row-sum rows
  static constexpr int kQBytes = kBlockM * kHeadDim;
  // Tiles whose PV products share one tensor-core accumulator before it is added into FP32 registers
  // (and at every rescale): 2 halves the FP32 adds; 8 k32 steps stay well inside FP8 accumulation.
  static constexpr int kFlushTiles = 2;
};

static_assert(KernelConfig::kBlockM == 128 && KernelConfig::kBlockN == 128,
              "tiles must coincide with the 128-token quantization blocks");

}  // namespace openvc::sm90
