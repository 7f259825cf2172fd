// openvc::attention (call.h): one call from BF16/FP16 q, k, v. The path is chosen once (attention_path);
// the workspace holds the prepared arrays, preparation's scratch, the smoothing LSE term and split tiles' partials,
// carved in one fixed order that attention_workspace_bytes sizes; then prepare_fp8 and the chosen attention entry run on
// the caller's stream, and with k_smoothing and an LSE one small kernel adds softmax_scale * q . mean(K).
#include <cmath>
#include <cstdint>
#include <string>

#include "attention/shared_rules.h"
#include "attention/sm90/config.h"
#include "attention/sm90/launch.h"
#include "common/alignment.h"
#include "common/cuda_check.h"
#include "openvc/call.h"
#include "openvc/general.h"
#include "prepare/prepare_internal.h"

namespace openvc {
namespace {

constexpr size_t kPartAlign = 256;   // every workspace part (TMA needs 16; 256 keeps parts on their own lines)
size_t up(size_t x) { return (x + kPartAlign - 1) / kPartAlign * kPartAlign; }

bool packed(const AttentionCall& c) { return c.cu_seqlens_q != nullptr || c.cu_seqlens_k != nullptr; }

// Sizes of the call: groups (batch entries or sequences), query/key rows of the token tensors, and the
// per-sequence lengths the grids use (seqlen or max_seqlen).
struct Shape {
  int64_t groups, rows_q, rows_k, sq, sk;
};
Shape shape_of(const AttentionCall& c) {
  if (packed(c)) return {c.num_seqs, c.total_q, c.total_k, c.max_seqlen_q, c.max_seqlen_k};
  return {c.batch, int64_t(c.batch) * c.seqlen_q, int64_t(c.batch) * c.seqlen_k, c.seqlen_q, c.seqlen_k};
}

// Byte offsets of the workspace parts (prepared arrays as attention.h lays them out, then prepare's
// scratch, then the LSE term), and the total.
struct Layout {
  size_t q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, v_bias, prep, q_dot_k_mean, split, total;
  size_t prep_bytes, split_bytes;
  int split_grid;   // > 0: the call may split tiles (split_grid CTAs at most: the device's SMs)
};
bool wants_lse_term(const AttentionCall& c) { return c.k_smoothing && c.lse != nullptr; }

// The calls whose Q the fast path's kernel quantizes (kFusedQMode), given a TMA-readable q (tma_readable_q): E4M3
// without smoothing, chunks or key block lists (the preparation then writes K and V only).
bool kernel_may_quantize_q(const AttentionCall& c) {
  return c.qk_format == QkFormat::kE4M3 && !c.k_smoothing && c.causal_chunk <= 1 && !has_block_list(c.blocks);
}

// The calls that run split tiles (call.h, TileSplit::kOn; sm90::split_tiles_eligible decides on the plan): the
// one-call path's fused-Q batched head-dim-128 plain calls. The current device's SM count, or 0.
int split_tiles_grid(const AttentionCall& c) {
  if (c.tile_split != TileSplit::kOn || !kernel_may_quantize_q(c) || c.p_format != PFormat::kExpCast || packed(c) ||
      c.seqused_k != nullptr || c.causal || c.head_dim != 128)
    return 0;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();   // no device here: no split (the call itself reports the missing device)
    return 0;
  }
  return sms;
}
Layout layout_of(const AttentionCall& c) {
  const Shape s = shape_of(c);
  const int64_t gh = s.groups * c.heads, nq = num_quant_blocks(s.sq), nk = num_quant_blocks(s.sk);
  const int64_t kv = kv_heads_or(c.heads, c.kv_heads), ghk = s.groups * kv;   // K/V heads (grouped-query)
  const bool int8 = c.qk_format == QkFormat::kInt8;
  Layout l{};
  size_t at = 0;
  auto part = [&](size_t bytes) {
    const size_t off = at;
    at += up(bytes);
    return off;
  };
  l.q_codes = part(size_t(s.rows_q) * c.heads * c.head_dim);
  l.q_descale = part(size_t(gh) * (int8 ? s.sq : nq) * sizeof(float));
  l.k_codes = part(size_t(s.rows_k) * kv * c.head_dim);
  l.k_descale = part(size_t(ghk) * nk * (int8 ? kInt8KeyGroups : 1) * sizeof(float));
  l.v_packed = part(size_t(ghk) * c.head_dim * packed_seqlen_k(s.sk));
  l.v_descale = part(size_t(ghk) * sizeof(float));
  l.v_bias = part(c.v_bias_correction ? size_t(ghk) * c.head_dim * sizeof(float) : 0);
  l.prep_bytes = prepare_workspace_bytes(int(s.groups), c.heads, int(s.sk), c.k_smoothing, c.v_bias_correction);
  l.prep = part(l.prep_bytes);
  // The LSE's layout: [B, H, Sq] batched, [H, total_q] packed.
  l.q_dot_k_mean = part(wants_lse_term(c) ? size_t(c.heads) * (packed(c) ? s.rows_q : s.groups * s.sq) * sizeof(float)
                                          : 0);
  l.split_grid = split_tiles_grid(c);
  l.split_bytes = l.split_grid > 0 ? sm90::split_tiles_workspace_bytes(l.split_grid) : 0;
  l.split = part(l.split_bytes);
  l.total = at;
  return l;
}

Status invalid(const std::string& field, const std::string& what) {
  return Status::Invalid("attention: call." + field + " " + what);
}

// What the sizes and the workspace depend on; the step entries check the rest (pointers, strides, offsets),
// naming their own params fields.
Status validate_sizes(const AttentionCall& c) {
  if (c.heads <= 0) return invalid("heads", "must be > 0, got " + std::to_string(c.heads));
  if (c.kv_heads < 0 || (c.kv_heads > 0 && c.heads % c.kv_heads != 0))
    return invalid("kv_heads", "must be 0 (heads) or a divisor of heads = " + std::to_string(c.heads) +
                                   " (grouped-query attention), got " + std::to_string(c.kv_heads));
  if (c.head_dim != 64 && c.head_dim != 128)
    return Status::Unsupported("attention: call.head_dim must be 128 or 64, got " + std::to_string(c.head_dim));
  if (packed(c)) {
    if (c.cu_seqlens_q == nullptr || c.cu_seqlens_k == nullptr)
      return invalid(c.cu_seqlens_q == nullptr ? "cu_seqlens_q" : "cu_seqlens_k",
                     "is null: packed sequences need both offset arrays");
    if (c.num_seqs <= 0) return invalid("num_seqs", "must be > 0 with cu_seqlens, got " + std::to_string(c.num_seqs));
    if (c.max_seqlen_q <= 0 || c.max_seqlen_k <= 0)
      return invalid(c.max_seqlen_q <= 0 ? "max_seqlen_q" : "max_seqlen_k", "must be > 0 with cu_seqlens");
    if (c.total_q < 0 || c.total_k < 0)
      return invalid(c.total_q < 0 ? "total_q" : "total_k", "(token rows of the tensor) is needed with cu_seqlens");
  } else {
    if (c.batch <= 0) return invalid("batch", "must be > 0, got " + std::to_string(c.batch));
    if (c.seqlen_q <= 0 || c.seqlen_k <= 0)
      return invalid(c.seqlen_q <= 0 ? "seqlen_q" : "seqlen_k", "must be > 0");
  }
  if (c.qk_format != QkFormat::kE4M3 && c.qk_format != QkFormat::kInt8)
    return invalid("qk_format", "must be kE4M3 or kInt8");
  if (c.p_format != PFormat::kExpCast && c.p_format != PFormat::kExp2)
    return invalid("p_format", "must be kExpCast or kExp2");
  if (c.p_format == PFormat::kExp2 && c.qk_format != QkFormat::kInt8)
    return invalid("p_format", "kExp2 needs qk_format kInt8");
  // kVBiasMode's instantiations (src/attention/sm90/mode.h)
  if (c.v_bias_correction && c.qk_format != QkFormat::kInt8)
    return Status::Unsupported("attention: call.v_bias_correction is built for qk_format kInt8 calls (ExpCast or exp2 "
                               "P), got kE4M3");
  if (c.v_bias_correction && has_block_list(c.blocks))
    return Status::Unsupported("attention: call.v_bias_correction does not combine with key block lists (call.blocks)");
  return Status::Ok();
}

// lse[i] += scale * term[i]: the smoothing term of section 9. -inf rows (no key; packed rows no sequence
// covers, whose term is never written) stay -inf.
__global__ void add_lse_term_kernel(float* lse, const float* term, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float l = lse[i];
    if (l != -INFINITY) lse[i] = fmaf(scale, term[i], l);
  }
}

template <typename T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// Whether the kernel can read call.q through a TMA tensor map (AttentionParams::q_unquantized's rules): else Q
// goes through the preparation, which checks it and names it in its errors (a null or misaligned q, rows that
// overlap such as a broadcast head).
bool tma_readable_q(const AttentionCall& c) {
  return c.q.data != nullptr && q16_call_layout(c.q, packed(c), c.seqused_k != nullptr, c.total_q, c.batch,
                                                c.seqlen_q, c.heads, c.head_dim) == Q16Layout::kOk;
}

}  // namespace

Status attention_path(const AttentionCall& c, int device, AttentionPath* path, std::string* reason) {
  OPENVC_RETURN_IF_ERROR(validate_sizes(c));
  if (path == nullptr) return invalid("(path)", "is null");
  const Shape s = shape_of(c);
  std::string why;
  if (!device_supports_sm90a(device)) why = "device " + std::to_string(device) + " is not compute capability 9.0";
  else if (!sm90::fits_fast_path(s.sq, s.sk))
    why = "ceil(Sq/128) * ceil(Sk/128) * 128 >= 2^32 (past the fast path's 32-bit range)";
  *path = why.empty() ? AttentionPath::kFast : AttentionPath::kGeneral;
  if (reason != nullptr) *reason = why;
  if (!why.empty() && kv_heads_or(c.heads, c.kv_heads) != c.heads)
    return Status::Unsupported("attention: call.kv_heads (grouped-query attention) runs on the sm_90a fast path only, "
                               "which does not take this call: " + why);
  if (!why.empty() && c.qk_format == QkFormat::kInt8)
    return Status::Unsupported("attention: call.qk_format kInt8 runs on the sm_90a fast path only, which does not "
                               "take this call: " + why);
  if (!why.empty() && c.p_format == PFormat::kExp2)
    return Status::Unsupported("attention: call.p_format kExp2 runs on the sm_90a fast path only: " + why);
  return Status::Ok();
}

size_t attention_workspace_bytes(const AttentionCall& c) { return layout_of(c).total; }

Status attention(const AttentionCall& c, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  AttentionPath path;
  OPENVC_RETURN_IF_ERROR(attention_path(c, device, &path));
  if (workspace == nullptr) return invalid("(workspace)", "is null");
  if (!aligned(workspace, kPartAlign)) return invalid("(workspace)", "must be 256-byte aligned");
  const Layout l = layout_of(c);
  if (workspace_bytes < l.total)
    return invalid("(workspace_bytes)", "is " + std::to_string(workspace_bytes) + ", attention_workspace_bytes(call) = " +
                                            std::to_string(l.total) + " needed");
  const Shape s = shape_of(c);

  PrepareParams p;
  p.dtype = c.dtype, p.qk_format = c.qk_format;
  p.batch = c.batch, p.seqlen_q = c.seqlen_q, p.seqlen_k = c.seqlen_k, p.heads = c.heads, p.head_dim = c.head_dim;
  p.q = c.q, p.k = c.k, p.v = c.v;
  p.cu_seqlens_q = c.cu_seqlens_q, p.cu_seqlens_k = c.cu_seqlens_k;
  p.max_seqlen_q = c.max_seqlen_q, p.max_seqlen_k = c.max_seqlen_k, p.num_seqs = c.num_seqs;
  p.total_q = c.total_q, p.total_k = c.total_k, p.seqused_k = c.seqused_k;
  if (!packed(c)) p.max_seqlen_q = p.max_seqlen_k = p.num_seqs = 0, p.total_q = p.total_k = -1;
  p.q_codes = at<uint8_t>(workspace, l.q_codes), p.q_descale = at<float>(workspace, l.q_descale);
  p.k_codes = at<uint8_t>(workspace, l.k_codes), p.k_descale = at<float>(workspace, l.k_descale);
  p.v_packed = at<uint8_t>(workspace, l.v_packed), p.v_descale = at<float>(workspace, l.v_descale);
  p.workspace = at<void>(workspace, l.prep), p.workspace_bytes = l.prep_bytes;
  p.k_smoothing = c.k_smoothing;
  p.kv_heads = c.kv_heads;
  if (c.v_bias_correction) p.v_bias = at<float>(workspace, l.v_bias);
  float* term = wants_lse_term(c) ? at<float>(workspace, l.q_dot_k_mean) : nullptr;
  p.q_dot_k_mean = term;
  // E4M3 calls, plain or causal, batched or packed: the kernel quantizes Q per tile (kFusedQMode), so the
  // preparation writes K and V only (the same codes and descales, one pass over Q fewer).
  const bool fused_q = path == AttentionPath::kFast && kernel_may_quantize_q(c) && tma_readable_q(c);
  if (fused_q) p.q = {}, p.q_codes = nullptr, p.q_descale = nullptr;
  PrepareExtras extras;   // split tiles' arrival counts, zero before the kernel (sm90/split.cuh)
  if (l.split_grid > 0) {
    extras.zero_words = at<int>(workspace, l.split);   // the counts lead the split part (sm90/launch.h)
    extras.zero_count = sm90::split_tiles_arrival_words(l.split_grid);
  }
  OPENVC_RETURN_IF_ERROR(prepare_fp8(p, extras, stream));

  Fp8Inputs in;
  in.batch = c.batch, in.seqlen_q = c.seqlen_q, in.seqlen_k = c.seqlen_k, in.heads = c.heads, in.head_dim = c.head_dim;
  in.q_codes = p.q_codes, in.q_descale = p.q_descale, in.k_codes = p.k_codes, in.k_descale = p.k_descale;
  in.v_packed = p.v_packed, in.v_descale = p.v_descale, in.qk_format = c.qk_format, in.kv_heads = c.kv_heads;
  in.v_bias = p.v_bias;
  if (path == AttentionPath::kFast) {
    AttentionParams a;
    a.in = in;
    a.out = c.out, a.out_stride_batch = c.out_stride_batch, a.out_stride_seq = c.out_stride_seq;
    a.out_stride_head = c.out_stride_head, a.lse = c.lse, a.out_dtype = c.out_dtype;
    a.softmax_scale = c.softmax_scale, a.mid_window_blocks = c.mid_window_blocks, a.causal = c.causal;
    a.cu_seqlens_q = p.cu_seqlens_q, a.cu_seqlens_k = p.cu_seqlens_k, a.num_seqs = p.num_seqs;
    a.max_seqlen_q = p.max_seqlen_q, a.max_seqlen_k = p.max_seqlen_k, a.total_q = p.total_q, a.total_k = p.total_k;
    a.seqused_k = c.seqused_k, a.p_format = c.p_format, a.blocks = c.blocks, a.causal_chunk = c.causal_chunk;
    if (fused_q) a.q_unquantized = c.q, a.q_unquantized_dtype = c.dtype;
    sm90::LaunchPlan plan;
    OPENVC_RETURN_IF_ERROR(sm90::plan_attention(a, nullptr, &plan));
    // The preparation launched just before (its first kernel normally, after whatever wrote Q): the kernel may
    // quantize its first Q tile before it waits for the preparation's last grid.
    plan.kp.q_before_prior_grid = fused_q;
    // The plan's grid is at most the SM count the workspace was sized for.
    if (l.split_grid > 0 && plan.grid <= l.split_grid && sm90::split_tiles_eligible(plan))
      OPENVC_RETURN_IF_ERROR(sm90::use_split_tiles(&plan, at<void>(workspace, l.split), l.split_bytes));
    OPENVC_RETURN_IF_ERROR(sm90::launch_plan(plan, stream));
  } else {
    GeneralAttentionParams g;
    g.in = in, g.causal = c.causal;
    g.cu_seqlens_q = p.cu_seqlens_q, g.cu_seqlens_k = p.cu_seqlens_k, g.num_seqs = p.num_seqs;
    g.max_seqlen_q = p.max_seqlen_q, g.max_seqlen_k = p.max_seqlen_k, g.total_q = p.total_q, g.total_k = p.total_k;
    g.seqused_k = c.seqused_k;
    g.out = c.out, g.out_stride_batch = c.out_stride_batch, g.out_stride_seq = c.out_stride_seq;
    g.out_stride_head = c.out_stride_head, g.lse = c.lse, g.out_dtype = c.out_dtype;
    if (packed(c)) g.lse_stride_head = c.total_q;
    else g.lse_stride_head = c.seqlen_q, g.lse_stride_batch = int64_t(c.heads) * c.seqlen_q;
    g.softmax_scale = c.softmax_scale, g.mid_window_blocks = c.mid_window_blocks, g.blocks = c.blocks;
    g.causal_chunk = c.causal_chunk;
    OPENVC_RETURN_IF_ERROR(attention_general(g, stream));
  }
  if (term != nullptr) {
    const int64_t n = int64_t(c.heads) * (packed(c) ? s.rows_q : s.groups * s.sq);
    const float scale = c.softmax_scale > 0.0f ? c.softmax_scale : 1.0f / std::sqrt(float(c.head_dim));
    const int blocks = int(std::min<int64_t>((n + 255) / 256, 4096));
    if (blocks > 0) {
      add_lse_term_kernel<<<blocks, 256, 0, stream>>>(c.lse, term, n, scale);
      OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("add_lse_term_kernel launch");
    }
  }
  return Status::Ok();
}

}  // namespace openvc
