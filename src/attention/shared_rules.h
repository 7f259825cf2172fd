// Host rules and derived values that the fast path (sm90/launch.cu) and the general path (general/launch.cu)
// share for key block lists and chunked causal, so that the two launchers cannot drift apart. Which call
// forms take block lists stays each path's own rule. Also the layout rule of the fast path's unquantized Q,
// which the one-call entry (call.cu) applies before it chooses that form.
#pragma once
#include <cstdint>
#include <string>

#include "common/alignment.h"
#include "openvc/attention.h"
#include "openvc/status.h"

namespace openvc {

// AttentionParams::q_unquantized's layout (a TMA tensor map over the caller's [B, Sq, H, D] Q, or a packed
// [total_q, H, D] one checked as batch 1 with stride_batch 0): 16-byte aligned
// data and strides of multiples of 8 elements, each dimension larger than 1 strided by at least head_dim.
// sm90/launch.cu names the broken rule; call.cu quantizes Q in the kernel only for a Q that keeps both.
// kRowsNotFlat: key counts over a batch whose Q rows do not follow each other (q16_call_layout).
enum class Q16Layout { kOk, kMisaligned, kStrideBelowHeadDim, kRowsNotFlat };
inline Q16Layout q16_layout(const TokenTensorView& q, int batch, int seqlen_q, int heads, int head_dim) {
  if (!aligned(q.data, 16) || q.stride_seq % 8 != 0 || q.stride_head % 8 != 0 || q.stride_batch % 8 != 0)
    return Q16Layout::kMisaligned;
  if ((heads > 1 && q.stride_head < head_dim) || (seqlen_q > 1 && q.stride_seq < head_dim) ||
      (batch > 1 && q.stride_batch < head_dim))
    return Q16Layout::kStrideBelowHeadDim;
  return Q16Layout::kOk;
}

// Whether Q's rows of all batch entries follow each other at one stride (row b * seqlen_q + i of one [B * Sq, H, D]
// tensor), as the varlen tiles of a batched call with key counts index them: stride_seq, or stride_batch when
// each entry has one row (q16_row_stride).
inline bool q16_rows_flat(const TokenTensorView& q, int batch, int seqlen_q) {
  return batch == 1 || seqlen_q == 1 || q.stride_batch == int64_t(seqlen_q) * q.stride_seq;
}
inline int64_t q16_row_stride(const TokenTensorView& q, int batch, int seqlen_q) {
  return seqlen_q == 1 && batch > 1 ? q.stride_batch : q.stride_seq;
}

// q_unquantized's layout for a call's form, the one rule of launch.cu (which names what is broken) and call.cu
// (which quantizes Q in the kernel only for kOk): packed, a [total_q, H, D] tensor (stride_batch not read); key
// counts over a batch, rows read flat first; else q16_layout.
inline Q16Layout q16_call_layout(const TokenTensorView& q, bool packed, bool key_counts, int64_t total_q, int batch,
                                 int seqlen_q, int heads, int head_dim) {
  if (packed)
    return q16_layout({q.data, 0, q.stride_seq, q.stride_head}, 1, total_q > 1 ? 2 : int(total_q), heads, head_dim);
  if (key_counts && !q16_rows_flat(q, batch, seqlen_q)) return Q16Layout::kRowsNotFlat;
  return q16_layout(q, batch, seqlen_q, heads, head_dim);
}

// The lists' own fields against the call's batched inputs (attention.h, KeyBlockList). Counts and indices are
// device data, clamped by the kernels.
inline Status check_key_block_list(const KeyBlockList& b, const Fp8Inputs& in) {
  auto str = [](int64_t x) { return std::to_string(x); };
  if (b.num_blocks == nullptr || b.indices == nullptr)
    return Status::Invalid(std::string("blocks: key block lists need both num_blocks and indices, got only ") +
                           (b.num_blocks ? "blocks.num_blocks" : "blocks.indices"));
  if (!aligned(b.num_blocks, 4) || !aligned(b.indices, 4))
    return Status::Invalid("blocks.num_blocks, blocks.indices: int32 arrays must be 4-byte aligned");
  if ((b.batch != 1 && b.batch != in.batch) || (b.heads != 1 && b.heads != in.heads))
    return Status::Invalid("blocks.batch, blocks.heads: must be 1 (broadcast) or the call's batch (" + str(in.batch) +
                           ") and heads (" + str(in.heads) + "), got " + str(b.batch) + ", " + str(b.heads));
  if (b.q_tiles != num_quant_blocks(in.seqlen_q))
    return Status::Invalid("blocks.q_tiles: must be ceil(seqlen_q / 128) = " + str(num_quant_blocks(in.seqlen_q)) +
                           ", got " + str(b.q_tiles));
  if (b.capacity < 1) return Status::Invalid("blocks.capacity: must be >= 1, got " + str(b.capacity));
  if (int64_t(b.batch) * b.heads * b.q_tiles * b.capacity > INT32_MAX)
    return Status::Unsupported("blocks: batch * heads * q_tiles * capacity must be < 2^31 (int32 indices)");
  return Status::Ok();
}

// Row strides of the lists' [batch, heads, q_tiles] rows: 0 where a dimension of 1 broadcasts.
struct KeyBlockStrides {
  int64_t batch, head;
};
inline KeyBlockStrides key_block_strides(const KeyBlockList& b) {
  return {b.batch == 1 ? 0 : int64_t(b.heads) * b.q_tiles, b.heads == 1 ? 0 : int64_t(b.q_tiles)};
}

// causal_chunk (attention.h): >= 1, and != 1 only with causal.
inline Status check_causal_chunk(int chunk, bool causal) {
  if (chunk < 1) return Status::Invalid("causal_chunk must be >= 1 (1: plain causal), got " + std::to_string(chunk));
  if (chunk != 1 && !causal)
    return Status::Invalid("causal_chunk: only used with causal (chunked causal); causal is false");
  return Status::Ok();
}

}  // namespace openvc
