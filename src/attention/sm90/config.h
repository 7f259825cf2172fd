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

// Timing variants with one stage removed, doubled or done the earlier way, for the cost breakdown in
// docs/performance.md (bench/cpp/bench_attention.cu, built with OPENVC_BENCH_VARIANTS). Only
// kProduction, kVcMode and kWithRepair are built into the library; the skip/double variants compute
// wrong results on purpose, the others (marked) compute the production result.
enum KernelVariant : int {
  kProduction = 0,
  kSkipMax = 1,         // no row max (the running max stays at the first tile's)
  kSkipConvert = 2,     // no ExpCast conversion (P keeps the first tile's codes)
  kSkipAccumulate = 4,  // no FP32 accumulation of PV (the tensor-core accumulator only)
  kDoubleConvert = 8,   // ExpCast conversion twice
  kDoubleMax = 16,      // row max twice
  kFlushEvery1 = 32,    // FP32 accumulation after every tile instead of kFlushTiles
  kFlushEvery4 = 64,    // ... after every 4 tiles (less FP32 work, more tensor-core accumulation)
  kPingPong = 128,      // consumers take turns issuing tensor-core work (named barriers; correct result)
  // Not a timing variant: the VC-Attention baseline (numerics section 7). V holds V-Smooth residual
  // codes with per-channel scales; each tile's block mean comes back through its probability row sum,
  // so the tensor-core partial is flushed after every tile. Natural key order (set by the host).
  kVcMode = 256,
  // Also not a timing variant: the kernel with V residual repair tiles (numerics section 6). A separate
  // instantiation so that the plain kernel carries none of its code.
  kWithRepair = 1024,
  kFloatMax = 2048,     // row max with FMNMX instead of the integer three-input max (correct result)
  kGeneralLoop = 4096,  // every key block through the general step (branches for the partial block
                        // and the flush period in every iteration; correct result)
};
template <int kVariant>
inline constexpr int flush_tiles() {
  return (kVariant & (kFlushEvery1 | kVcMode)) ? 1 : (kVariant & kFlushEvery4) ? 4 : KernelConfig::kFlushTiles;
}
static_assert(KernelConfig::kBlockM == 128 && KernelConfig::kBlockN == 128,
              "tiles must coincide with the 128-token quantization blocks");

}  // namespace openvc::sm90
