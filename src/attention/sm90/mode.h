// Production modes of the sm_90a ExpCast kernel: compile-time policies of the one pipeline, combined
// as bits. kProductionModes below is the one list of the combinations the library launches: the
// build instantiates each entry in its own translation unit (src/CMakeLists.txt writes one file per
// entry from instantiations/mode.cu.in) and launch.cu's dispatch searches it at compile time.
// Timing probes are apart (probes.h) and never built into the library.
#pragma once

#include <cstddef>
#include <string>

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
  // accumulators, converted to FP32 at the ExpCast FMA; one Q descale per query row and 8 K descales
  // per key block (key groups), so each thread carries a multiplier per row and per half of the tile.
  // Combines with causal, varlen and head dim 64 (not with repair or VC).
  kInt8QkMode = 32,
  // P format exp2 (p_format exp2, numerics "P format"): codes are E4M3 roundings of the exponential instead
  // of ExpCast's linear code: keys 0-63 of each tile p = e4m3_satfinite(2^(acc * a/8 + 8 - M/8)) (FFMA,
  // MUFU.EX2, half an F2FP per score), keys 64-127 a polynomial code in f16x2 on the FMA pipe (within one
  // step). The same registers, key order, max, masks, rescale and [V|1] row sums.
  // INT8 only (with causal, varlen and head dim 64; not with repair or VC).
  kExp2PMode = 64,
  // Block-sparse (numerics section 5, "Key block lists"): each query tile visits the 128-key blocks of its
  // row of a device list (FlexAttention's kv_num_blocks / kv_indices layout; counts clamped to the row's
  // capacity, indices to [0, nk)), in the mid-window order of list positions. Batched calls (no causal,
  // varlen, repair or VC); E4M3 or INT8 Q/K, head dim 128 or 64.
  kBlockListMode = 128,
  // V descale per 128-key block (AttentionParams::v_descale_per_block; numerics section 4, "V descale per
  // key block"): v_descale is [sequences, kv_heads, nk] and each tile's PV product is scaled by its block's descale
  // as it is added to the FP32 accumulator (a partial is flushed early where the descale changes), so K/V
  // chunks quantized separately
  // (an FP8 KV cache) attend as one key sequence. Built with varlen (batched calls run the varlen mode's
  // 3D maps; seqused_k marks the cache's length), E4M3 or INT8 Q/K, head dim 128 (not causal, repair, VC,
  // block lists or exp2).
  kVBlockDescaleMode = 256,
  // Chunked causal (AttentionParams::causal_chunk > 1, numerics section 5, "Chunked causal"), with kCausalMode:
  // each row's key limit from causal_key_limit, tiles sized by the last row's limit, the masked blocks counted
  // per tile (up to about chunk / 128 + 3). Its own instantiations, so that plain causal (chunk 1) keeps its
  // code: one per causal mode (a static_assert below checks every causal mode has its twin).
  kChunkedCausalMode = 512,
  // Q quantized inside the kernel (AttentionParams::q_unquantized; fused_q.cuh): the producer brings each
  // tile's 128 BF16 / FP16 query rows, the consumers quantize them (a Q group of numerics section 1 is one
  // query tile: prepare_fp8's codes and descale) into the FP8 Q tile the QK^T path reads. E4M3 calls, plain or
  // causal, head dim 128 or 64, batched or packed (with kVarlenMode: rows past the tile's sequence are left out).
  kFusedQMode = 1024,
  // Few key blocks (chosen on the host for batched E4M3 head dim 128 calls with at most kFewKeyBlocks key blocks per
  // tile, kFewKeyBlocksFusedQ with kFusedQMode; config.h): the consumers take turns issuing tensor-core work (named
  // barriers; IssueOrder in kernel.cuh), so that one warpgroup's softmax and tile boundary run under the other's
  // products: with a few blocks the tile boundary is a large part of a tile's time. The plain mode's arithmetic and
  // order, so its bits (the varlen, block-list and repair modes give the same bits for the same keys, which a
  // flush every tile, 3% faster at 512 keys, would break).
  kFewKeysMode = 2048,
  // Split tiles (the one-call path's batched E4M3 head dim 128 calls, with kFusedQMode; split.cuh, numerics
  // section 5, "Split tiles"): the last one to two waves of tiles are dealt as contiguous ranges of their key blocks
  // instead of whole tiles, a cut tile's two parts folded through the call's workspace, so that the call ends with
  // every SM busy (S = 4,096, H = 7: 224 tiles on 132 SMs left 40 SMs idle through the second wave).
  kSplitTilesMode = 4096,
  // V rounding bias correction (Fp8Inputs::v_bias, numerics section 4, "V rounding bias"): the epilogue adds the
  // sequence's per-channel mean V rounding residual to every row that saw a key. Its own instantiations so that the
  // other modes keep their epilogue: INT8 Q/K (ExpCast or exp2 P), plain, causal, chunked causal, varlen, head dim 64.
  kVBiasMode = 8192,
};

// The one list of production modes (every Mode combination the library builds and launches). Adding
// a mode: docs/architecture.md, "Adding a mode".
inline constexpr int kProductionModes[] = {
    kPlainMode,
    kVcMode,
    kRepairMode,
    kCausalMode,
    kVarlenMode,
    kVarlenMode | kCausalMode,
    kHeadDim64Mode,
    kHeadDim64Mode | kCausalMode,
    kHeadDim64Mode | kVarlenMode,
    kHeadDim64Mode | kVarlenMode | kCausalMode,
    kInt8QkMode,
    kInt8QkMode | kCausalMode,
    kInt8QkMode | kVarlenMode,
    kInt8QkMode | kVarlenMode | kCausalMode,
    kInt8QkMode | kHeadDim64Mode,
    kInt8QkMode | kHeadDim64Mode | kCausalMode,
    kInt8QkMode | kHeadDim64Mode | kVarlenMode,
    kInt8QkMode | kHeadDim64Mode | kVarlenMode | kCausalMode,
    kExp2PMode | kInt8QkMode,
    kExp2PMode | kInt8QkMode | kCausalMode,
    kExp2PMode | kInt8QkMode | kVarlenMode,
    kExp2PMode | kInt8QkMode | kVarlenMode | kCausalMode,
    kExp2PMode | kInt8QkMode | kHeadDim64Mode,
    kExp2PMode | kInt8QkMode | kHeadDim64Mode | kCausalMode,
    kExp2PMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode,
    kExp2PMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode | kCausalMode,
    kBlockListMode,
    kBlockListMode | kHeadDim64Mode,
    kBlockListMode | kInt8QkMode,
    kBlockListMode | kInt8QkMode | kHeadDim64Mode,
    kVBlockDescaleMode | kVarlenMode,
    kVBlockDescaleMode | kVarlenMode | kInt8QkMode,
    kChunkedCausalMode | kCausalMode,
    kChunkedCausalMode | kCausalMode | kVarlenMode,
    kChunkedCausalMode | kCausalMode | kHeadDim64Mode,
    kChunkedCausalMode | kCausalMode | kHeadDim64Mode | kVarlenMode,
    kChunkedCausalMode | kCausalMode | kInt8QkMode,
    kChunkedCausalMode | kCausalMode | kInt8QkMode | kVarlenMode,
    kChunkedCausalMode | kCausalMode | kInt8QkMode | kHeadDim64Mode,
    kChunkedCausalMode | kCausalMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode,
    kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode,
    kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode | kVarlenMode,
    kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode,
    kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode,
    kFusedQMode,
    kFusedQMode | kCausalMode,
    kFusedQMode | kHeadDim64Mode,
    kFusedQMode | kHeadDim64Mode | kCausalMode,
    kFewKeysMode,
    kFewKeysMode | kFusedQMode,
    kFusedQMode | kVarlenMode,
    kFusedQMode | kVarlenMode | kCausalMode,
    kFusedQMode | kVarlenMode | kHeadDim64Mode,
    kFusedQMode | kVarlenMode | kHeadDim64Mode | kCausalMode,
    kSplitTilesMode | kFusedQMode,
    kSplitTilesMode | kFewKeysMode | kFusedQMode,
    kVBiasMode | kInt8QkMode,
    kVBiasMode | kInt8QkMode | kCausalMode,
    kVBiasMode | kInt8QkMode | kVarlenMode,
    kVBiasMode | kInt8QkMode | kVarlenMode | kCausalMode,
    kVBiasMode | kInt8QkMode | kHeadDim64Mode,
    kVBiasMode | kInt8QkMode | kHeadDim64Mode | kCausalMode,
    kVBiasMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode,
    kVBiasMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode | kCausalMode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kInt8QkMode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kInt8QkMode | kVarlenMode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kInt8QkMode | kHeadDim64Mode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode,
    kVBiasMode | kExp2PMode | kInt8QkMode,
    kVBiasMode | kExp2PMode | kInt8QkMode | kCausalMode,
    kVBiasMode | kExp2PMode | kInt8QkMode | kVarlenMode,
    kVBiasMode | kExp2PMode | kInt8QkMode | kVarlenMode | kCausalMode,
    kVBiasMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode,
    kVBiasMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode | kCausalMode,
    kVBiasMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode,
    kVBiasMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode | kCausalMode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode | kVarlenMode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode,
    kVBiasMode | kChunkedCausalMode | kCausalMode | kExp2PMode | kInt8QkMode | kHeadDim64Mode | kVarlenMode,
};
inline constexpr int kNumProductionModes = int(sizeof(kProductionModes) / sizeof(kProductionModes[0]));

constexpr bool is_production_mode(int mode) {
  for (int m : kProductionModes)
    if (m == mode) return true;
  return false;
}
constexpr bool production_modes_unique() {
  for (int i = 0; i < kNumProductionModes; ++i)
    for (int j = i + 1; j < kNumProductionModes; ++j)
      if (kProductionModes[i] == kProductionModes[j]) return false;
  return true;
}
static_assert(production_modes_unique(), "kProductionModes lists a mode twice");
constexpr bool causal_modes_have_chunked_twins() {
  for (int m : kProductionModes)
    if ((m & kCausalMode) && !(m & (kChunkedCausalMode | kFusedQMode)) && !is_production_mode(m | kChunkedCausalMode))
      return false;
  return true;
}
static_assert(causal_modes_have_chunked_twins(),
              "every causal mode of kProductionModes needs its kChunkedCausalMode twin (causal_chunk > 1; the fused-Q "
              "modes take plain causal only, host-checked)");

// The bits of a mode by name, for messages: "causal|varlen|int8" ("plain" for 0; unknown bits in hex).
inline std::string mode_name(int mode) {
  // Automatic, not static: a function-local static of an inline function is an STB_GNU_UNIQUE object,
  // which libopenvc.so would export (LibraryExports test).
  constexpr struct { int bit; const char* name; } kBits[] = {
      {kVcMode, "vc"}, {kRepairMode, "repair"}, {kCausalMode, "causal"}, {kVarlenMode, "varlen"},
      {kHeadDim64Mode, "head_dim64"}, {kInt8QkMode, "int8"},
      {kExp2PMode, "exp2"}, {kBlockListMode, "block_list"}, {kVBlockDescaleMode, "v_block_descale"},
      {kChunkedCausalMode, "chunked"}, {kFusedQMode, "fused_q"},
      {kFewKeysMode, "few_keys"}, {kSplitTilesMode, "split"}, {kVBiasMode, "v_bias"}};
  std::string s;
  for (const auto& b : kBits)
    if (mode & b.bit) s += (s.empty() ? "" : "|") + std::string(b.name), mode &= ~b.bit;
  if (mode != 0) {
    constexpr const char* kHex = "0123456789abcdef";
    std::string hex;
    for (unsigned u = unsigned(mode); u != 0; u >>= 4) hex.insert(hex.begin(), kHex[u & 15]);
    s += (s.empty() ? "0x" : "|0x") + hex;
  }
  return s.empty() ? "plain" : s;
}

template <int kMode>
inline constexpr bool has_mode(Mode m) {
  return (kMode & m) != 0;
}

// The tile configuration of a mode.
template <int kMode>
using ModeConfig = TileConfig<has_mode<kMode>(kHeadDim64Mode) ? 64 : 128>;

}  // namespace openvc::sm90
