// Parameters of the sm_90a ExpCast kernel, resolved on the host (launch.cu) and passed by value.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace openvc::sm90 {

struct KernelParams {
  int batch, heads, seqlen_q, seqlen_k;
  int num_q_tiles, num_k_blocks, num_tiles, mid_window_blocks;
  const float* q_descale;   // [B, H, num_q_tiles]; INT8 Q (kInt8QkMode): [B, H, seqlen_q], one per row
  const float* k_descale;   // [B, Hk, num_k_blocks] (Hk = kv_heads: H, or fewer with GQA)
  const float* v_descale;   // [B, Hk]; kVBlockDescaleMode: [B, Hk, num_k_blocks]
  __nv_bfloat16* out;       // [B, Sq, H, D] with strides
  int64_t out_stride_b, out_stride_s, out_stride_h;
  float* lse;               // optional [B, H, Sq]
  float qk_multiplier;      // 2^-24 * 8 * log2e * softmax_scale (the scaled ExpCast domain)
  // V residual repair (numerics section 6): repair_rows rows per (b, h) in repair_tiles key tiles,
  // visited after every original block; 0 tiles = plain path.
  int repair_rows, repair_tiles;
  const float* repair_k_descale;  // [B, H, repair_tiles * 128], each row's own K block descale
  // VC mode only (kVcMode): per-channel V descales [B, H, D] and block means / descale [B, H, nk, D].
  const float* vc_channel_descale;
  const float* vc_mean_scaled;
  // kVarlenMode only (appended, so the other modes' parameter offsets stay as they were). Sequence s
  // holds query rows [cu_q[s], cu_q[s+1]) of a [total_q, H, D] q_codes (null: batched, rows s*Sq ..),
  // keys likewise; seqused_k[s] (optional) cuts its keys. Offsets are clamped to [0, total].
  const int* cu_q;
  const int* cu_k;
  const int* seqused_k;
  int total_q, total_k;
  int64_t lse_stride_s, lse_stride_h;  // lse + s * lse_stride_s + h * lse_stride_h + output token
  bool out_fp16;                       // out holds FP16 instead of BF16 (same strides; epilogue only)
  // Causal only: tiles in query-tile-major order, heaviest first, dealt to the CTAs in a snake (round m
  // goes CTA 0..G-1 when m is even, G-1..0 when odd), which balances tiles of very different lengths;
  // set by the host where (batch, head)-major order would leave the CTAs unevenly loaded.
  bool causal_snake;
  // kVarlenMode with cu_seqlens and at most kMaxCompactSeqs sequences: the compact tile space
  // (tiles.cuh); num_tiles is then an upper bound and the kernel counts the tiles itself.
  bool compact_tiles;
  // kBlockListMode only: query tile qt of (b, h) visits the blocks blk_index[row * blk_capacity + i],
  // i < clamp(blk_count[row], 0, blk_capacity), row = b * blk_stride_b + h * blk_stride_h + qt (a stride
  // of 0 broadcasts); each index clamped to [0, num_k_blocks).
  const int* blk_count;
  const int* blk_index;
  int64_t blk_stride_b, blk_stride_h;
  int blk_capacity;
  // kChunkedCausalMode: key chunk of the causal mask (F > 1: key j visible to query i iff
  // j < (floor((i + Sk - Sq) / F) + 1) * F, numerics section 5), >= 1.
  int causal_chunk;
  // out, its strides and every row's first column fall on 16 bytes: the epilogue stores 8 outputs of a row
  // per instruction (quad_transpose in kernel.cuh); else two.
  bool out_vec16;
  // kFusedQMode: the Q tile tm_q brings is FP16 (else BF16).
  bool q_fp16;
  // kFusedQMode: Q was written by work that finished before an ordinary (non-programmatic) launch ahead of this one
  // in the stream, so no grid this launch may overlap writes it: the one-call path, whose preparation's first
  // kernel is launched normally (prepare.cu, launch_qk). The CTAs then load and quantize their first tile's Q
  // before they wait for the grid before them (pdl.cuh), under its drain.
  bool q_before_prior_grid;
  // kSplitTilesMode (split.cuh; numerics section 5, "Split tiles"): the first split_head_tiles tiles go round robin
  // whole; CTA c then takes units [c q + min(c, r), ...) of the other tiles' key blocks (q = split_q >= num_k_blocks,
  // r = split_r < grid); a cut tile's two parts meet in split_partials (split_partials_floats(grid) floats) and
  // split_arrivals ([grid][8], zero at launch).
  int split_head_tiles, split_q, split_r;
  float* split_partials;
  int* split_arrivals;
  // Grouped-query attention (Fp8Inputs::kv_heads): K, V and their descales hold kv_heads heads; query head h reads
  // K/V head h / kv_group (kv_group = heads / kv_heads, 1 without it).
  int kv_heads, kv_group;
  // V rounding bias (Fp8Inputs::v_bias, numerics section 4): [B, Hk, D] FP32 added per channel to rows that saw a key
  // (the epilogue); null: none.
  const float* v_bias;
};

// The K/V head of query head h (a uniform branch: no division where the heads are equal).
__device__ __forceinline__ int kv_head(const KernelParams& p, int h) { return p.kv_group == 1 ? h : h / p.kv_group; }

}  // namespace openvc::sm90
