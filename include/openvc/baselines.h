// GPU API of the VC-Attention baseline (numerics section 7): V-Smooth grouping + ExpCast on the same
// kernel family as the fast path, natural key order. Same conventions as openvc/attention.h:
// caller-owned device memory, the caller's stream, no allocation, no host synchronization.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "openvc/attention.h"
#include "openvc/status.h"

namespace openvc {

// Attention over VC-prepared inputs. `in` describes the PERMUTED keys: in.k_codes / in.k_descale are
// the permuted K quantized per 128-token block (section 1), in.v_packed holds the E4M3 codes of the
// V-Smooth residual (permuted V minus its block mean) with one scale per channel, in the packed layout
// of Fp8Inputs; in.v_descale is not read. Queries are in their original order, so the output is too.
struct VcAttentionParams {
  Fp8Inputs in;
  const float* v_channel_descale = nullptr;  // [B, H, D]; a channel whose residual is all zero holds 1
                                             // (its codes are 0, so any finite value is exact)
  const float* block_mean_scaled = nullptr;  // [B, H, ceil(Sk/128), D] FP32: the BF16 block mean
                                             // mu_bc divided by v_channel_descale[c]
  void* out = nullptr;                       // BF16 [B, Sq, H, D]
  int64_t out_stride_batch = 0, out_stride_seq = 0, out_stride_head = 0;  // elements
  float* lse = nullptr;                      // optional FP32 [B, H, Sq], natural log
  DType out_dtype = DType::kBFloat16;        // of out: BF16 (default) or FP16
  float softmax_scale = 0.0f;                // <= 0: 1/sqrt(D)
};
Status attention_vc_fp8(const VcAttentionParams& params, cudaStream_t stream);

// ---- Grouping: k-means over the value tokens of every (batch, head) (section 7) ---------------------
// kVcClusters clusters (fewer when Sk < 64: one per token), kVcIterations Lloyd iterations, centroid c
// initialised to token floor(c * Sk / K) (no randomness). Distances run on the tensor cores (token
// BF16/FP16 times the FP32 centroid split into two 16-bit halves, FP32 accumulation), centroid sums are
// one-hot tensor-core products; every reduction has a fixed order and the work split depends on Sk only,
// so a head's permutation depends only on its own tokens and Sk (not on timing, the device, the batch
// or head count). Not bit-identical to reference::vc_grouping, which works in double. A stable sort
// by cluster id gives the permutation, the same for K and V:
// permutation[(b * H + h) * Sk + i] = original token index at position i.
inline constexpr int kVcClusters = 64;
inline constexpr int kVcIterations = 4;
struct VcGroupingParams {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen = 0, heads = 0, head_dim = kHeadDim;  // head_dim 128 only
  TokenTensorView v;            // [B, Sk, H, D]; strides multiples of 8 elements, data 16-byte aligned
  int* permutation = nullptr;   // out: int32 [B, H, Sk], 4-byte aligned
  void* workspace = nullptr;    // vc_grouping_workspace_bytes() bytes, 16-byte aligned
  size_t workspace_bytes = 0;
};
size_t vc_grouping_workspace_bytes(int batch, int heads, int seqlen, int head_dim = kHeadDim);
Status vc_grouping(const VcGroupingParams& params, cudaStream_t stream);

// ---- Per-call preparation of VcAttentionParams given a permutation (section 7, V-Smooth) -------------
// Q: quantized per 128-token block in its original order, as prepare_fp8. K: gathered by the
// permutation, then quantized per 128-token block of the permuted order. V: gathered by the same
// permutation; per 128-row block b the mean mu_b = BF16(float(double sequential sum / rows)); the FP32
// residual r = v - mu_b is quantized with one scale per (batch, head, channel) over all Sk rows:
// scale_inv = 448 / amax (0 for amax 0), codes = E4M3(r * scale_inv), packed like Fp8Inputs::v_packed.
// Bit-identical to reference::vc_prepare. Reusing one permutation over several calls (later denoising
// steps) skips the grouping. The permutation is read on the GPU only: an entry outside [0, Sk) reads a
// zero token instead of memory out of bounds, but is not reported (nor are duplicates).
struct VcPrepareParams {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen_q = 0, seqlen_k = 0, heads = 0, head_dim = kHeadDim;  // head_dim 128 only
  TokenTensorView q, k, v;                  // as in PrepareParams (batched)
  const int* permutation = nullptr;         // int32 [B, H, Sk], e.g. from vc_grouping
  // Outputs (nq = ceil(Sq/128), nk = ceil(Sk/128)).
  uint8_t* q_codes = nullptr;               // [B, Sq, H, D] E4M3, 16-byte aligned
  float* q_descale = nullptr;               // [B, H, nq]
  uint8_t* k_codes = nullptr;               // [B, Sk, H, D] permuted K, 16-byte aligned
  float* k_descale = nullptr;               // [B, H, nk]
  uint8_t* v_packed = nullptr;              // [B, H, D, nk*128] residual codes, kPackedKeyOrder, 16-byte aligned
  float* v_channel_descale = nullptr;       // [B, H, D] amax / 448, 1 where amax is 0; 8-byte aligned
  float* block_mean_scaled = nullptr;       // [B, H, nk, D] mu / v_channel_descale, 16-byte aligned
  uint16_t* block_mean = nullptr;           // optional [B, H, nk, D] BF16 bits of mu
  void* workspace = nullptr;                // vc_prepare_workspace_bytes() bytes, 16-byte aligned
  size_t workspace_bytes = 0;
};
size_t vc_prepare_workspace_bytes(int batch, int heads, int head_dim = kHeadDim);
Status vc_prepare(const VcPrepareParams& params, cudaStream_t stream);

}  // namespace openvc
