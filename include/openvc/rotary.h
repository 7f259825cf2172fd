// Rotary position embedding over interleaved pairs, in one pass: the rotation video transformers apply to
// q and k right before attention (diffusers' apply_rotary_emb with use_real_unbind_dim=-1 for CogVideoX,
// EasyAnimate and Flux; Mochi's own rotation). Framework code writes it as eight to ten elementwise
// kernels through FP32 temporaries; this reads x and the tables once and writes out once, with the bits of
// that eager form (docs/api.md, `rotary.rotary_pairs`).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "openvc/attention.h"
#include "openvc/status.h"

namespace openvc {

// For every token (b, s), head h and pair j < head_dim / 2, with a = x[.., 2j], b = x[.., 2j + 1] and the
// table entries T[s, h, j, k] (k = 0 for the pair's first element, 1 for its second):
//   out[.., 2j]     = round(round(a * cos[s,h,j,0]) - round(b * sin[s,h,j,0]))
//   out[.., 2j + 1] = round(round(b * cos[s,h,j,1]) + round(a * sin[s,h,j,1]))
// in FP32, each step rounded to nearest (no fused multiply-add: the rounding of separate elementwise
// kernels), then rounded to x's dtype. `out` may be `x` itself (same pointer and strides); any other
// overlap of the two is not allowed.
struct RotaryPairsParams {
  DType dtype = DType::kBFloat16;           // x and out
  int batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  TokenTensorView x;                        // [B, S, H, D], strides in elements, head dim contiguous
  void* out = nullptr;                      // [B, S, H, D], head dim contiguous
  int64_t out_stride_batch = 0, out_stride_seq = 0, out_stride_head = 0;
  // FP32 tables [S, H, D / 2, 2] with these element strides (0 broadcasts: e.g. one table for every head)
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t table_stride_seq = 0, table_stride_head = 0, table_stride_pair = 0, table_stride_half = 0;
};

// Enqueues the rotation on `stream` (no allocation, no synchronization). InvalidArgument names the
// field: head_dim even and at most 512, x and out 4-byte aligned with even strides, batch * seqlen * heads
// at most 2^31 - 257, pointers set when there is work.
Status rotary_pairs(const RotaryPairsParams& params, cudaStream_t stream);

}  // namespace openvc
