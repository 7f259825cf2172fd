// Production modes of the sm_90a ExpCast kernel: compile-time policies of the one pipeline, combined
// as bits. Each combination the library launches is instantiated in its own file under
// instantiations/ (launch.cu picks one from the call's parameters); timing probes are apart
// (probes.h) and never built into the library.
#pragma once

#include "attention/sm90/config.h"

namespace openvc::sm90 {

enum Mode : int {
  kPlainMode = 0,
  // The VC-Attention baseline (numerics section 7): V holds V-Smooth residual codes with per-channel
  // scales; each tile's block mean comes back through its probability row sum, so the tensor-core
  // partial is flushed after every tile. Natural key order (set by the host).
  kVcMode = 1,
  // V residual repair tiles after every original block (numerics section 6).
  kRepairMode = 2,
  // Causal, aligned to the end (key j visible to query i iff j <= i + Sk - Sq): blocks above the
  // diagonal are skipped, the diagonal ones masked per row, traversal from the diagonal down.
  kCausalMode = 4,
  // Per-sequence lengths read on the device: packed sequences (cu_seqlens_q/k) and/or per-sequence key
  // counts (seqused_k, key padding masks); offsets are clamped to the tensors.
  kVarlenMode = 8,
  // Head dim 64 (LTX-Video): the same tiles and arithmetic with half-width Q/K rows (64-byte swizzle)
  // and a 64 x 72 PV accumulator; combines with causal and varlen (not with repair or VC).
  kHeadDim64Mode = 16,
  // INT8 Q and K (qk_format int8, numerics section 9): QK^T on the s8 tensor cores with exact int32
  // accumulators, converted to FP32 before the same ExpCast arithmetic; one Q descale per query row,
  // so each thread carries a multiplier for each of its two rows. Dense head dim 128 for now.
  kInt8QkMode = 32,
};

template <int kMode>
inline constexpr bool has_mode(Mode m) {
  return (kMode & m) != 0;
}

// The tile configuration of a mode.
template <int kMode>
using ModeConfig = TileConfig<has_mode<kMode>(kHeadDim64Mode) ? 64 : 128>;

}  // namespace openvc::sm90
