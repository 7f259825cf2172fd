// One call from BF16/FP16 q, k, v to the attention output: openvc::attention prepares into a caller-owned
// workspace and attends on the fast path (the sm_90a kernel) or, for what it does not take, the general
// path (general.h), choosing once (attention_path says which and why). The step-wise prepare_fp8 /
// attention_fp8 (attention.h) stay for callers that prepare once and attend several times.
// Same rules as attention.h: device pointers owned by the caller, the caller's stream, no allocation, no
// host synchronization, no device-to-host read, so a call can be captured in a CUDA graph and replayed
// with new contents of the same buffers (offsets and key counts included: they are read on the device).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "openvc/attention.h"
#include "openvc/status.h"

namespace openvc {

// Split tiles (numerics section 5, "Split tiles"): batched E4M3 head-dim-128 calls without causal, key counts, key
// block lists, K smoothing or chunks, whose Q the kernel quantizes, may deal the launch's key blocks to the SMs in
// contiguous ranges instead of whole tiles, so that the last wave leaves no SM idle (a cut tile's two parts are
// folded; their codes are against each part's own max). kOn: wherever the call allows it; kOff and kAuto: whole
// tiles. Measured on the H200 (docs/performance.md, twenty-fifth session) split tiles were no faster at any shape
// tried (0.95x at S = 4,096 H = 7, 0.98-1.01x elsewhere), so kAuto does not choose them.
enum class TileSplit { kAuto, kOff, kOn };

struct AttentionCall {
  DType dtype = DType::kBFloat16;   // of q, k and v alike
  int heads = 0, head_dim = kHeadDim;
  // Batched (cu_seqlens null): q [B, Sq, H, D], k and v [B, Sk, H, D] strided views (head dim contiguous).
  int batch = 0, seqlen_q = 0, seqlen_k = 0;
  TokenTensorView q, k, v;
  // Packed sequences (both offsets set; int32 device arrays of num_seqs + 1): q [total_q, H, D], k and v
  // [total_k, H, D]; max_seqlen_q/k host bounds of every length; batch, seqlen_q, seqlen_k ignored.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int num_seqs = 0, max_seqlen_q = 0, max_seqlen_k = 0;
  int64_t total_q = -1, total_k = -1;
  const int* seqused_k = nullptr;   // optional int32 device key counts, one per batch entry or sequence
  bool causal = false;              // aligned to the end: key j visible to query i iff j <= i + Sk - Sq
  float softmax_scale = 0.0f;       // <= 0: 1/sqrt(D)
  int mid_window_blocks = 4;        // key traversal (numerics section 5); kNaturalOrder for natural order
  QkFormat qk_format = QkFormat::kE4M3;
  bool k_smoothing = false;
  PFormat p_format = PFormat::kExpCast;
  // Outputs: out [B, Sq, H, D] (packed [total_q, H, D]) at the given element strides, out_dtype; optional
  // lse FP32 natural log, contiguous [B, H, Sq] (packed [H, total_q]). With k_smoothing the LSE is that of
  // the keys as given (the smoothing term added back, numerics section 9). Packed rows no sequence covers
  // are not written.
  void* out = nullptr;
  int64_t out_stride_batch = 0, out_stride_seq = 0, out_stride_head = 0;
  DType out_dtype = DType::kBFloat16;
  float* lse = nullptr;
  // Optional key block lists (block-sparse attention; attention.h, KeyBlockList): batched calls without
  // causal or seqused_k, on either path (the same blocks and order).
  KeyBlockList blocks;
  int causal_chunk = 1;             // chunked causal (attention.h, AttentionParams::causal_chunk); with causal
  // Split tiles (above). Where a call may split, the workspace holds the parts' partials (about 19 MB at 132 SMs:
  // the current device's SM count sizes it). Last, so that positional initializers stay valid.
  TileSplit tile_split = TileSplit::kAuto;
  // Grouped-query attention (attention.h, Fp8Inputs::kv_heads): k and v hold kv_heads heads ([B, Sk, kv_heads, D],
  // packed [total_k, kv_heads, D]), 0 meaning heads; heads must be a multiple of it. The fast path only (a call the
  // general path would take is Status::Unsupported naming kv_heads). Last, as above.
  int kv_heads = 0;
  // V rounding bias correction (attention.h, PrepareParams::v_bias and Fp8Inputs::v_bias; numerics section 4, "V rounding
  // bias"): the preparation sums V's rounding residuals per channel and the kernel adds their mean to every row that
  // sees a key. With qk_format kInt8 only, without key block lists (Status::Unsupported naming v_bias_correction).
  // Last, as above.
  bool v_bias_correction = false;
};

enum class AttentionPath { kFast, kGeneral };

// Which path openvc::attention takes for this call on `device` (its compute capability and the call's
// sizes; no pointer is read), and why when it is not the fast path. INT8 Q/K and the exp2 P format run on
// the fast path only: a call of either that the fast path does not take is Status::Unsupported naming
// qk_format or p_format, with the reason.
Status attention_path(const AttentionCall& call, int device, AttentionPath* path, std::string* reason = nullptr);

// Workspace bytes of openvc::attention for this call (the prepared Q/K/V codes and descales, preparation's
// scratch, with k_smoothing and an LSE the LSE term, and where the call may split tiles their partials, sized for
// the current device); pointers are not read.
size_t attention_workspace_bytes(const AttentionCall& call);

// Prepares q, k, v into `workspace` (256-byte aligned, attention_workspace_bytes(call) bytes) and attends,
// on the current device (the stream's). Invalid arguments give Status::Invalid naming the field.
Status attention(const AttentionCall& call, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace openvc
