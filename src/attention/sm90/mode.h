// Production modes of the sm_90a ExpCast kernel: compile-time policies of the one pipeline, combined
// as bits. Each combination the library launches is instantiated in its own file under
// instantiations/ (launch.cu picks one from the call's parameters); timing probes are apart
// (probes.h) and never built into the library.
#pragma once

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
};

template <int kMode>
inline constexpr bool has_mode(Mode m) {
  return (kMode & m) != 0;
}

}  // namespace openvc::sm90
