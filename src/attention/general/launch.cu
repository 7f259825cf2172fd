// Host side of the general path: validation (host values only: the cu_seqlens arrays are never read
// here) and the launch on the caller's stream, one CTA per (query tile, head, sequence).
#include <cmath>
#include <cstdint>
#include <string>

#include "attention/call_pointers.h"
#include "attention/shared_rules.h"
#include "attention/general/kernel.cuh"
#include "common/alignment.h"
#include "common/cuda_check.h"
#include "openvc/general.h"

namespace openvc {
namespace {

using general::KernelParams;

// The kernel computes kPackedKeyOrder in closed form; keep the two in step.
constexpr bool packed_order_formula_matches() {
  for (int x = 0; x < 16; ++x)
    if ((((x >> 2) << 1) | (x & 1)) + 8 * ((x >> 1) & 1) != kPackedKeyOrder[x]) return false;
  return true;
}
static_assert(packed_order_formula_matches(), "general kernel: kPackedKeyOrder formula out of date");

std::string str(int64_t x) { return std::to_string(x); }


Status validate(const GeneralAttentionParams& p) {
  const Fp8Inputs& in = p.in;
  const bool packed = p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr;
  if (in.head_dim != 64 && in.head_dim != 128)
    return Status::Invalid("in.head_dim: the general path takes 64 or 128, got " + str(in.head_dim));
  if (in.qk_format != QkFormat::kE4M3)
    return Status::Unsupported("in.qk_format: the general path takes E4M3 Q/K codes only (INT8 runs on the sm_90a "
                               "fast path, numerics section 9)");
  if (in.heads <= 0 || in.heads > 65535)
    return Status::Invalid("in.heads: expected 1..65535 (a grid dimension), got " + str(in.heads));
  if (in.v_bias != nullptr)
    return Status::Unsupported("in.v_bias: the general path has no V rounding bias correction (the sm_90a "
                               "fast path applies it)");
  if (kv_heads_or(in.heads, in.kv_heads) != in.heads)
    return Status::Unsupported("in.kv_heads: grouped-query attention (kv_heads " + str(in.kv_heads) + " of " +
                               str(in.heads) + " heads) runs on the sm_90a fast path only");
  if (packed) {
    if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr)
      return Status::Invalid("cu_seqlens_q, cu_seqlens_k: packed sequences need both offset arrays, got only " +
                             std::string(p.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k"));
    if (!aligned(p.cu_seqlens_q, 4) || !aligned(p.cu_seqlens_k, 4))
      return Status::Invalid("cu_seqlens_q, cu_seqlens_k: int32 arrays must be 4-byte aligned");
    if (p.num_seqs <= 0 || p.num_seqs > 65535)
      return Status::Invalid("num_seqs: expected 1..65535 with cu_seqlens (a grid dimension), got " + str(p.num_seqs));
    if (p.max_seqlen_q < 0 || p.max_seqlen_k < 0)
      return Status::Invalid("max_seqlen_q, max_seqlen_k: expected >= 0 (bounds of every sequence's length), got " +
                             str(p.max_seqlen_q) + ", " + str(p.max_seqlen_k));
    if (p.total_q < 0 || p.total_k < 0)
      return Status::Invalid("total_q, total_k: the token rows of q_codes and k_codes are needed with cu_seqlens "
                             "(offsets are clamped to them), got " + str(p.total_q) + ", " + str(p.total_k));
  } else {
    if (p.num_seqs != 0 || p.max_seqlen_q != 0 || p.max_seqlen_k != 0)
      return Status::Invalid("num_seqs, max_seqlen_q, max_seqlen_k: only used with cu_seqlens; must stay 0 for "
                             "batched inputs, got " + str(p.num_seqs) + ", " + str(p.max_seqlen_q) + ", " +
                             str(p.max_seqlen_k));
    if (in.batch < 0 || in.batch > 65535 || in.seqlen_q < 0 || in.seqlen_k < 0)
      return Status::Invalid("in: expected batch in 0..65535 (a grid dimension), seqlen_q >= 0 and seqlen_k >= 0, "
                             "got " + str(in.batch) + ", " + str(in.seqlen_q) + ", " + str(in.seqlen_k));
  }
  const auto ptrs = call_pointers(p);
  for (const auto& x : ptrs)
    if (x.ptr == nullptr) return Status::Invalid(std::string(x.name) + " must not be null");
  for (const auto& x : ptrs)   // 32-bit loads of 4 codes; descales are floats; out holds BF16
    if (!aligned(x.ptr, x.ptr == p.out ? 2 : 4)) return Status::Invalid(std::string(x.name) + " is misaligned");
  if (p.lse != nullptr && !aligned(p.lse, 4)) return Status::Invalid("lse is misaligned (FP32)");
  if (p.seqused_k != nullptr && !aligned(p.seqused_k, 4)) return Status::Invalid("seqused_k is misaligned (int32)");
  // Rows of the output must not overlap: zero (unset) strides would make every row write the same memory.
  const int D = in.head_dim;
  const int64_t rows_q = packed ? p.max_seqlen_q : in.seqlen_q;
  const bool many_seq = packed ? true : rows_q > 1;   // packed: total_q is unknown here, assume > 1
  if ((in.heads > 1 && p.out_stride_head < D) || (many_seq && p.out_stride_seq < D) ||
      (!packed && in.batch > 1 && p.out_stride_batch < D))
    return Status::Invalid("out strides (batch " + str(p.out_stride_batch) + ", seq " + str(p.out_stride_seq) +
                           ", head " + str(p.out_stride_head) + "): each must be at least head_dim (" + str(D) +
                           ") where that dimension is larger than 1" + (packed ? " (seq always, packed)" : ""));
  if (p.lse != nullptr) {
    const int64_t min_head = packed ? 1 : rows_q;
    if ((in.heads > 1 && p.lse_stride_head < min_head) || (!packed && in.batch > 1 && p.lse_stride_batch < rows_q))
      return Status::Invalid("lse strides (batch " + str(p.lse_stride_batch) + ", head " + str(p.lse_stride_head) +
                             "): expected at least " + (packed ? std::string("1 for the head stride of [H, total_q]")
                                                               : "seqlen_q (" + str(rows_q) + ")") +
                             " where that dimension is larger than 1");
  }
  if (!std::isfinite(p.softmax_scale))
    return Status::Invalid("softmax_scale must be finite (<= 0 selects 1/sqrt(D)), got " + std::to_string(p.softmax_scale));
  if (p.mid_window_blocks < kNaturalOrder)
    return Status::Invalid("mid_window_blocks must be >= 0 or kNaturalOrder (-1), got " + str(p.mid_window_blocks));
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat16)
    return Status::Invalid("out_dtype must be kBFloat16 or kFloat16");
  OPENVC_RETURN_IF_ERROR(check_causal_chunk(p.causal_chunk, p.causal));
  if (has_block_list(p.blocks)) {
    if (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr || p.causal)
      return Status::Unsupported("blocks: key block lists take batched calls without causal, cu_seqlens or seqused_k");
    OPENVC_RETURN_IF_ERROR(check_key_block_list(p.blocks, in));
  }
  return Status::Ok();
}

template <int D>
Status launch(const KernelParams& kp, dim3 grid, cudaStream_t stream) {
  constexpr size_t smem = general::Smem<D>::kBytes;
  // A host-side function attribute, not a stream operation: allowed while a graph is being captured.
  OPENVC_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(general::general_attention_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  general::general_attention_kernel<D><<<grid, general::kThreads, smem, stream>>>(kp);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("general_attention_kernel launch");
  return Status::Ok();
}

}  // namespace

Status attention_general(const GeneralAttentionParams& params, cudaStream_t stream) {
  OPENVC_RETURN_IF_ERROR(validate(params));
  const Fp8Inputs& in = params.in;
  const bool packed = params.cu_seqlens_q != nullptr;
  const int seqs = packed ? params.num_seqs : in.batch;
  const int sq = packed ? params.max_seqlen_q : in.seqlen_q;
  const int sk = packed ? params.max_seqlen_k : in.seqlen_k;
  if (seqs == 0 || sq == 0) return Status::Ok();   // no query rows: nothing to write
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (!device_supports_sm90a(device))
    return Status::Unsupported("attention_general: the kernels are built for sm_90a and need a compute capability "
                               "9.0 (Hopper) GPU");

  KernelParams kp{};
  kp.q_codes = in.q_codes, kp.q_descale = in.q_descale;
  kp.k_codes = in.k_codes, kp.k_descale = in.k_descale;
  kp.v_packed = in.v_packed, kp.v_descale = in.v_descale;
  kp.cu_q = params.cu_seqlens_q, kp.cu_k = params.cu_seqlens_k;
  kp.seqused_k = params.seqused_k;
  kp.total_q = params.total_q, kp.total_k = params.total_k;
  kp.heads = in.heads;
  kp.seqlen_q = sq, kp.seqlen_k = sk;
  kp.nq = static_cast<int>(num_quant_blocks(sq));
  kp.nk = static_cast<int>(num_quant_blocks(sk));
  kp.out = static_cast<__nv_bfloat16*>(params.out);
  kp.out_sb = params.out_stride_batch, kp.out_ss = params.out_stride_seq, kp.out_sh = params.out_stride_head;
  kp.lse = params.lse;
  kp.lse_sb = params.lse_stride_batch, kp.lse_sh = params.lse_stride_head;
  // The reference's default, in FP32: 1/sqrt(D).
  kp.tau = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(static_cast<float>(in.head_dim));
  kp.mid_window = params.mid_window_blocks;
  kp.causal = params.causal;
  kp.causal_chunk = params.causal_chunk;
  const KeyBlockList& bl = params.blocks;
  kp.blk_count = bl.num_blocks, kp.blk_index = bl.indices, kp.blk_cap = bl.capacity;
  const KeyBlockStrides bs = key_block_strides(bl);
  kp.blk_sb = bs.batch, kp.blk_sh = bs.head;
  kp.out_fp16 = params.out_dtype == DType::kFloat16;
  const dim3 grid(static_cast<unsigned>(kp.nq), static_cast<unsigned>(in.heads), static_cast<unsigned>(seqs));
  return in.head_dim == 64 ? launch<64>(kp, grid, stream) : launch<128>(kp, grid, stream);
}

}  // namespace openvc
