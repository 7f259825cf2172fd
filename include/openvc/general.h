// General attention path: a CUDA-core kernel with the same numerics contract (docs/numerics.md) for the
// E4M3 calls the sm_90a fast path (attention_fp8) does not take: sizes past the fast path's 32-bit range
// (ceil(Sq/128) * ceil(Sk/128) * 128 >= 2^32) and batched inputs with seqlen_q or seqlen_k 0. It takes
// every form the fast path takes too (dense, causal, packed cu_seqlens, seqused_k, head_dim 64 and 128),
// but E4M3 Q/K and ExpCast P only: in.qk_format kInt8 is rejected (Status::Unsupported naming
// in.qk_format). It consumes prepare_fp8's outputs, batched or packed, and
// computes the reference arithmetic: exact FP8 dot products (FP64 accumulation), the same ExpCast
// codes, tile maxima, traversal and rescale as openvc::reference::attention_expcast. Plain CUDA cores,
// simple and exact rather than fast. Same rules as attention.h: caller-owned device memory, the
// caller's stream, no allocation, no host synchronization, no device-to-host read.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "openvc/attention.h"
#include "openvc/status.h"

namespace openvc {

// Head dims of the general path.
inline constexpr int kGeneralHeadDims[2] = {64, 128};

// Two input modes, exactly as PrepareParams (attention.h) produced them:
// - Batched (cu_seqlens_q and cu_seqlens_k null): in.batch, in.seqlen_q, in.seqlen_k give the sizes and
//   the arrays are those of Fp8Inputs. num_seqs and max_seqlen_q/k must stay 0. seqlen_q or seqlen_k
//   may be 0 (a key-less row gives output 0 and lse -inf; no query rows: nothing is launched).
// - Packed (cu_seqlens_q and cu_seqlens_k both set; int32 device arrays of num_seqs + 1 non-decreasing
//   offsets, read by the kernel only, so their values may change between graph replays): q_codes
//   [total_q, H, D], k_codes [total_k, H, D], descales [num_seqs, H, ceil(max_seqlen/128)], v_packed
//   [num_seqs, H, D, ceil(max_seqlen_k/128)*128], v_descale [num_seqs, H]; in.batch/seqlen_q/seqlen_k
//   are ignored. max_seqlen_q/k (host ints >= 0) must be >= every sequence's length: the grid is
//   sized from them, and query rows past ceil(max_seqlen_q/128)*128 of a longer sequence, or keys past
//   ceil(max_seqlen_k/128)*128, would be ignored (never read or written out of bounds).
// Causal: key j of a sequence is visible to its query i iff j <= i + (Sk - Sq) (aligned to the end).
struct GeneralAttentionParams {
  Fp8Inputs in;                        // head_dim 64 or 128
  bool causal = false;
  const int* cu_seqlens_q = nullptr;   // packed sequences only
  const int* cu_seqlens_k = nullptr;
  int num_seqs = 0, max_seqlen_q = 0, max_seqlen_k = 0;
  // Packed: the token rows of q_codes / k_codes (and of out). Required with cu_seqlens: the kernel
  // clamps every offset to [0, total], so offsets past the end or negative never read or write outside
  // the tensors (they shorten or empty the sequence). -1: not given.
  int64_t total_q = -1, total_k = -1;
  // Optional per-sequence key counts (device int32 [num_seqs] or [batch]): keys at or past
  // seqused_k[s] of sequence s are masked (code 0). Batched or packed; null: every key is used.
  const int* seqused_k = nullptr;
  // Output of out_dtype (below). Batched: [B, Sq, H, D] at out + b*stride_batch + i*stride_seq + h*stride_head.
  // Packed: [total_q, H, D] at out + t*stride_seq + h*stride_head (t = cu_seqlens_q[s] + i;
  // stride_batch ignored). Elements; the head dim is contiguous.
  void* out = nullptr;
  int64_t out_stride_batch = 0, out_stride_seq = 0, out_stride_head = 0;
  // Optional FP32 natural-log LSE (nullptr: none). Batched [B, H, Sq]: lse + b*stride_batch +
  // h*stride_head + i (contiguous: H*Sq, Sq). Packed [H, total_q] (the flash-attn varlen layout):
  // lse + h*stride_head + t (contiguous: stride_head = total_q; stride_batch ignored).
  float* lse = nullptr;
  int64_t lse_stride_batch = 0, lse_stride_head = 0;
  DType out_dtype = DType::kBFloat16;  // of out: BF16 (default) or FP16
  float softmax_scale = 0.0f;          // <= 0: 1/sqrt(D)
  int mid_window_blocks = 4;           // kNaturalOrder for natural order
  // Optional key block lists (attention.h, KeyBlockList; the same blocks and order as the fast path, codes
  // bit-identical to the reference; every key masked per row past Sk, so no ascending rule here). Batched,
  // non-causal calls without seqused_k (Status::Unsupported naming `blocks` otherwise). Last, as above.
  KeyBlockList blocks;
  int causal_chunk = 1;                // chunked causal (attention.h, AttentionParams::causal_chunk); with causal
};

Status attention_general(const GeneralAttentionParams& params, cudaStream_t stream);

}  // namespace openvc
