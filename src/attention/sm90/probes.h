// Timing probes of the sm_90a kernel: one stage removed, doubled or done the earlier way, for the cost
// breakdown in docs/performance.md (bench/cpp/bench_attention.cu, built with OPENVC_BENCH_VARIANTS).
// Never built into the library. The skip/double probes compute wrong results on purpose; the others
// (marked) compute the production result. Probes apply to the plain mode only (kInt8ConvertMagic: to the
// INT8 mode; kExp2AllMufu, kCorrectedExpCast, kExp2PolyQuarter and kExp2PolyThreeQuarters: to the exp2 mode too).
#pragma once

#include "attention/sm90/config.h"

namespace openvc::sm90 {

enum Probe : int {
  kNoProbe = 0,
  kSkipMax = 1,         // no row max (the running max stays at the first tile's)
  kSkipConvert = 2,     // no ExpCast conversion (P keeps the first tile's codes)
  kSkipAccumulate = 4,  // no FP32 accumulation of PV (the tensor-core accumulator only)
  kDoubleConvert = 8,   // ExpCast conversion twice
  kDoubleMax = 16,      // row max twice
  kFlushEvery1 = 32,    // FP32 accumulation after every tile instead of kFlushTiles
  kFlushEvery4 = 64,    // ... after every 4 tiles (less FP32 work, more tensor-core accumulation)
  kPingPong = 128,      // consumers take turns issuing tensor-core work (named barriers; correct result)
  kFloatMax = 2048,     // row max with FMNMX instead of the integer three-input max (correct result)
  kGeneralLoop = 4096,  // every key block through the general step (branches for the partial block
                        // and the flush period in every iteration; correct result)
  kNoHugeGuard = 8192,  // no huge-max flag and clipped conversion (the kernel before it; correct on
                        // scores below ~7e5 nats)
  kInt8ConvertMagic = 16384,  // INT8 mode: int32 scores to FP32 by the exact IADD + FADD instead of
                              // I2FP.F32.S32 (softmax.cuh, int8_score; the same result)
  kCorrectedExpCast = 32768,  // ExpCast codes moved onto the E4M3 rounding of the exact exponential: the
                              // linear code plus a quadratic in its position within the octave (expcast.cuh,
                              // corrected_code; 5 FP32 operations more per score; a different result)
  kExp2AllMufu = 65536,       // exp2 mode: every key group on MUFU ex2 (the exp2 format before the split of
                              // the exponentials between MUFU and the FMA pipe; a different result). In the exp2
                              // mode kCorrectedExpCast takes every key group to the polynomial code (no MUFU)
  kExp2PolyQuarter = 131072,        // exp2 mode: key group 3 (keys 96-127) on the polynomial, 0-2 on MUFU (a
                                    // different result: the split's balance, bench "split")
  kExp2PolyThreeQuarters = 262144,  // exp2 mode: key groups 1-3 (keys 32-127) on the polynomial, 0 on MUFU
  kQFromSharedMemory = 524288,  // plain and fused-Q plain modes: QK^T reads Q's codes from shared memory every key
                                // block (the form before Q in registers, kernel.cuh; the same result)
  kSpareWarpsQuantize = 1048576,  // plain mode: the producer warpgroup's idle warps 1-3 quantize K and V meanwhile
                                  // (probe_spare_quantize.cuh; the same attention result)
};

// Tiles whose PV products share one tensor-core accumulator before the FP32 add, for a mode/probe.
template <bool kFlushEveryTile, int kProbe>
inline constexpr int flush_tiles() {
  return (kFlushEveryTile || (kProbe & kFlushEvery1)) ? 1 : (kProbe & kFlushEvery4) ? 4 : kFlushTiles;
}

}  // namespace openvc::sm90
