// Host side of preparation: argument checks and the launches (kernels.cuh; with K smoothing first the two
// of smoothing.cuh). Stream-ordered,
// no allocation, no host synchronization, so prepare_fp8 can be captured in a CUDA graph.
#include <cstdint>
#include <string>

#include "common/alignment.h"
#include "common/cuda_check.h"
#include "common/pdl.cuh"
#include "openvc/attention.h"
#include "prepare/kernels.cuh"
#include "prepare/prepare_internal.h"
#include "prepare/smoothing.cuh"

namespace openvc {
namespace {

using prepare::kBlockTokens;

constexpr bool packed_order_matches() {
  for (int i = 0; i < 16; ++i)
    if (prepare::packed_key(i) != kPackedKeyOrder[i]) return false;
  return true;
}
static_assert(packed_order_matches(), "packed_key() must reproduce kPackedKeyOrder");
static_assert(kBlockTokens == kQuantBlock, "one CTA tile is one quantization block");
static_assert(prepare::kKeyGroups == kInt8KeyGroups, "INT8 K descales per block");

// Workspace parts, each starting 16-byte aligned: the V amax slots [G, H] (uint32), and with K smoothing
// the double block sums [G, H, nk, 128] and the float means [G, H, 128] (sized for head dim 128; head dim
// 64 uses the first half of each part with its own strides); with the V rounding bias, the int64 residual sums
// [G, H, 128] and the block counts [G, H] (uint32) after them.
struct WorkspaceLayout {
  size_t block_sums = 0, means = 0, residuals = 0, arrivals = 0, total = 0;  // byte offsets of the parts, and the size
};
WorkspaceLayout workspace_layout(int groups, int heads, int max_seqlen_k, bool k_smoothing, bool v_bias = false) {
  auto up16 = [](size_t b) { return (b + 15) / 16 * 16; };
  WorkspaceLayout l;
  if (groups <= 0 || heads <= 0) return l;
  const size_t gh = static_cast<size_t>(groups) * static_cast<size_t>(heads);
  l.block_sums = up16(gh * sizeof(uint32_t));
  l.means = l.total = l.block_sums;
  if (k_smoothing) {
    const size_t nk = max_seqlen_k > 0 ? static_cast<size_t>(num_quant_blocks(max_seqlen_k)) : 0;
    l.means = l.block_sums + up16(gh * nk * kHeadDim * sizeof(double));
    l.total = l.means + up16(gh * kHeadDim * sizeof(float));
  }
  l.residuals = l.arrivals = l.total;
  if (v_bias) {
    l.arrivals = l.residuals + up16(gh * kHeadDim * sizeof(int64_t));
    l.total = l.arrivals + up16(gh * sizeof(uint32_t));
  }
  return l;
}


Status check_positive(const char* name, int64_t v) {
  if (v > 0) return Status::Ok();
  return Status::Invalid(std::string("prepare_fp8: params.") + name + " must be > 0, got " + std::to_string(v));
}

Status check_output(const char* name, const void* p, uintptr_t align, bool optional = false) {
  if (p == nullptr) return optional ? Status::Ok() : Status::Invalid(std::string("prepare_fp8: params.") + name + " is null");
  if (!aligned(p, align))
    return Status::Invalid(std::string("prepare_fp8: params.") + name + " must be " + std::to_string(align) +
                           "-byte aligned");
  return Status::Ok();
}

// The kernels read 16-byte vectors (8 elements) at every (batch, token, head) start. Packed inputs
// have no batch stride (it is ignored).
bool q_is_omitted(const PrepareParams& p) { return p.q.data == nullptr && p.q_codes == nullptr && p.q_descale == nullptr; }

Status check_input(const char* name, const TokenTensorView& t, bool packed) {
  const std::string n = std::string("prepare_fp8: params.") + name;
  if (t.data == nullptr) return Status::Invalid(n + ".data is null");
  if (!aligned(t.data, 16))
    return Status::Invalid(n + ".data must be 16-byte aligned (the kernels use 16-byte loads)");
  const struct { const char* field; int64_t v; } strides[] = {
      {"stride_batch", packed ? 0 : t.stride_batch}, {"stride_seq", t.stride_seq}, {"stride_head", t.stride_head}};
  for (const auto& s : strides) {
    if (s.v % 8 != 0)
      return Status::Invalid(n + "." + s.field + " must be a multiple of 8 elements (16 bytes), got " +
                             std::to_string(s.v));
  }
  return Status::Ok();
}

// Sequence count and (max) lengths of either mode (attention.h): the grid and output sizes.
struct Dims {
  bool packed;
  int nseq, sq, sk;
};
Dims dims_of(const PrepareParams& p) {
  if (p.cu_seqlens_q != nullptr) return {true, p.num_seqs, p.max_seqlen_q, p.max_seqlen_k};
  return {false, p.batch, p.seqlen_q, p.seqlen_k};
}

// The KV-cache fields (attention.h): any of them set selects the kCache kernels.
bool uses_cache_fields(const PrepareParams& p) {
  return p.k_codes_rows != 0 || p.k_descale_blocks != 0 || p.v_packed_columns != 0 || p.v_descale_per_block ||
         p.kv_prefix_len != 0;
}

// Batched, no smoothing; a first part of at most seqlen_k keys; each layout field 0 or at least the call's own
// extent (v_packed_columns a multiple of 16: the kernels store 16-byte vectors).
Status validate_cache_fields(const PrepareParams& p, const Dims& d) {
  if (!uses_cache_fields(p)) return Status::Ok();
  if (d.packed || p.k_smoothing)
    return Status::Invalid(std::string("prepare_fp8: params.k_codes_rows, k_descale_blocks, v_packed_columns, "
                                       "v_descale_per_block and kv_prefix_len (a KV cache's layout) are for batched "
                                       "calls without k_smoothing; got them with ") +
                           (d.packed ? "cu_seqlens" : "k_smoothing"));
  if (p.kv_prefix_len < 0 || p.kv_prefix_len > d.sk)
    return Status::Invalid("prepare_fp8: params.kv_prefix_len must be in [0, seqlen_k = " + std::to_string(d.sk) +
                           "], got " + std::to_string(p.kv_prefix_len));
  if (p.kv_prefix_len > 0) {
    OPENVC_RETURN_IF_ERROR(check_input("k_prefix", p.k_prefix, false));
    OPENVC_RETURN_IF_ERROR(check_input("v_prefix", p.v_prefix, false));
  }
  auto at_least = [](const char* name, int64_t v, int64_t least) {
    if (v == 0 || v >= least) return Status::Ok();
    return Status::Invalid(std::string("prepare_fp8: params.") + name + " must be 0 (the default layout) or >= " +
                           std::to_string(least) + " (the call's own extent), got " + std::to_string(v));
  };
  OPENVC_RETURN_IF_ERROR(at_least("k_codes_rows", p.k_codes_rows, d.sk));
  OPENVC_RETURN_IF_ERROR(at_least("k_descale_blocks", p.k_descale_blocks, num_quant_blocks(d.sk)));
  OPENVC_RETURN_IF_ERROR(at_least("v_packed_columns", p.v_packed_columns, packed_seqlen_k(d.sk)));
  if (p.v_packed_columns % 16 != 0)
    return Status::Invalid("prepare_fp8: params.v_packed_columns must be a multiple of 16 (the kernels store 16-byte "
                           "vectors), got " + std::to_string(p.v_packed_columns));
  return Status::Ok();
}

Status validate_mode(const PrepareParams& p) {
  if ((p.cu_seqlens_q == nullptr) != (p.cu_seqlens_k == nullptr))
    return Status::Invalid(std::string("prepare_fp8: params.") + (p.cu_seqlens_q ? "cu_seqlens_k" : "cu_seqlens_q") +
                           " is null but " + (p.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k") +
                           " is set: packed sequences need both, batched inputs neither");
  if (p.cu_seqlens_q == nullptr) {  // batched
    if (p.num_seqs != 0 || p.max_seqlen_q != 0 || p.max_seqlen_k != 0)
      return Status::Invalid("prepare_fp8: params.num_seqs, max_seqlen_q and max_seqlen_k are for packed sequences "
                             "and must be 0 when cu_seqlens_q/k are null (batched inputs use batch, seqlen_q, "
                             "seqlen_k); got " + std::to_string(p.num_seqs) + ", " + std::to_string(p.max_seqlen_q) +
                             ", " + std::to_string(p.max_seqlen_k));
    OPENVC_RETURN_IF_ERROR(check_positive("batch", p.batch));
    OPENVC_RETURN_IF_ERROR(check_positive("seqlen_q", p.seqlen_q));
    return check_positive("seqlen_k", p.seqlen_k);
  }
  if (!aligned(p.cu_seqlens_q, alignof(int)))
    return Status::Invalid("prepare_fp8: params.cu_seqlens_q must be 4-byte aligned (int32)");
  if (!aligned(p.cu_seqlens_k, alignof(int)))
    return Status::Invalid("prepare_fp8: params.cu_seqlens_k must be 4-byte aligned (int32)");
  OPENVC_RETURN_IF_ERROR(check_positive("num_seqs", p.num_seqs));
  OPENVC_RETURN_IF_ERROR(check_positive("max_seqlen_q", p.max_seqlen_q));
  OPENVC_RETURN_IF_ERROR(check_positive("max_seqlen_k", p.max_seqlen_k));
  if (p.total_q < 0 || p.total_k < 0)
    return Status::Invalid("prepare_fp8: params.total_q and total_k (token rows of q and of k/v) are needed with "
                           "cu_seqlens: offsets are clamped to them; got " + std::to_string(p.total_q) + ", " +
                           std::to_string(p.total_k));
  return Status::Ok();
}

Status validate(const PrepareParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16)
    return Status::Invalid("prepare_fp8: params.dtype must be kBFloat16 or kFloat16");
  OPENVC_RETURN_IF_ERROR(validate_mode(p));
  if (p.qk_format != QkFormat::kE4M3 && p.qk_format != QkFormat::kInt8)
    return Status::Invalid("prepare_fp8: params.qk_format must be kE4M3 or kInt8");
  const Dims d = dims_of(p);
  OPENVC_RETURN_IF_ERROR(check_positive("heads", p.heads));
  if (p.kv_heads < 0 || (p.kv_heads > 0 && p.heads % p.kv_heads != 0))
    return Status::Invalid("prepare_fp8: params.kv_heads must be 0 (the heads of q) or a divisor of heads = " +
                           std::to_string(p.heads) + " (grouped-query attention), got " + std::to_string(p.kv_heads));
  if (p.head_dim != 128 && p.head_dim != 64)
    return Status::Unsupported("prepare_fp8: params.head_dim must be 128 or 64, got " + std::to_string(p.head_dim));
  // Q omitted (q.data, q_codes and q_descale all null): K and V only, for an attention kernel that
  // quantizes Q itself (AttentionParams::q_unquantized).
  const bool q_omitted = q_is_omitted(p);
  if (q_omitted && p.q_dot_k_mean != nullptr)
    return Status::Invalid("prepare_fp8: params.q_dot_k_mean needs Q (params.q, q_codes and q_descale are null)");
  if (!q_omitted) OPENVC_RETURN_IF_ERROR(check_input("q", p.q, d.packed));
  OPENVC_RETURN_IF_ERROR(check_input("k", p.k, d.packed));
  OPENVC_RETURN_IF_ERROR(check_input("v", p.v, d.packed));
  if (!q_omitted) OPENVC_RETURN_IF_ERROR(check_output("q_codes", p.q_codes, 16));
  OPENVC_RETURN_IF_ERROR(check_output("k_codes", p.k_codes, 16));
  OPENVC_RETURN_IF_ERROR(check_output("v_packed", p.v_packed, 16));
  if (!q_omitted) OPENVC_RETURN_IF_ERROR(check_output("q_descale", p.q_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_output("k_descale", p.k_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_output("v_descale", p.v_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_output("workspace", p.workspace, alignof(uint32_t)));
  if (p.seqused_k != nullptr && !aligned(p.seqused_k, alignof(int)))
    return Status::Invalid("prepare_fp8: params.seqused_k must be 4-byte aligned (int32)");
  if ((p.k_smoothing || p.v_bias != nullptr) && !aligned(p.workspace, 16))
    return Status::Invalid("prepare_fp8: params.workspace must be 16-byte aligned with k_smoothing or v_bias");
  if (p.q_dot_k_mean != nullptr && !p.k_smoothing)
    return Status::Invalid("prepare_fp8: params.q_dot_k_mean is written with k_smoothing only (the LSE term of the "
                           "removed K mean); it must be null without it");
  OPENVC_RETURN_IF_ERROR(check_output("q_dot_k_mean", p.q_dot_k_mean, alignof(float), /*optional=*/true));
  OPENVC_RETURN_IF_ERROR(check_output("v_bias", p.v_bias, 8, /*optional=*/true));
  if (p.v_bias != nullptr && uses_cache_fields(p))
    return Status::Unsupported("prepare_fp8: params.v_bias is not written by a KV cache's preparation (its chunks have "
                               "V scales of their own); it must be null with the KV-cache fields");
  OPENVC_RETURN_IF_ERROR(validate_cache_fields(p, d));
  const bool v_bias = p.v_bias != nullptr;
  const size_t need = prepare_workspace_bytes(d.nseq, p.heads, d.sk, p.k_smoothing, v_bias);
  if (p.workspace_bytes < need)
    return Status::Invalid("prepare_fp8: params.workspace_bytes is " + std::to_string(p.workspace_bytes) + ", " +
                           (d.packed ? "prepare_workspace_bytes(num_seqs, heads, max_seqlen_k, k_smoothing, v_bias) = ("
                                     : "prepare_workspace_bytes(batch, heads, seqlen_k, k_smoothing, v_bias) = (") +
                           std::to_string(d.nseq) + ", " + std::to_string(p.heads) + ", " + std::to_string(d.sk) +
                           ", " + (p.k_smoothing ? "true" : "false") + ", " + (v_bias ? "true" : "false") + ") = " +
                           std::to_string(need) + " needed");
  // Flat 1-D grids: sequences * heads * blocks CTAs must fit gridDim.x.
  const int64_t blocks = num_quant_blocks(d.sq) + num_quant_blocks(d.sk);
  if (static_cast<int64_t>(d.nseq) * p.heads * blocks > INT32_MAX)
    return Status::Unsupported(d.packed ? "prepare_fp8: num_seqs * heads * (ceil(max_seqlen_q/128) + "
                                          "ceil(max_seqlen_k/128)) exceeds 2^31 - 1 thread blocks"
                                        : "prepare_fp8: batch * heads * (ceil(seqlen_q/128) + ceil(seqlen_k/128)) "
                                          "exceeds 2^31 - 1 thread blocks");
  return Status::Ok();
}

// Packed inputs: the batch stride is unused (passed as 0), the kernels read the offsets instead.
prepare::TokenArgs token_args(const TokenTensorView& t, int seqlen, const int* cu_seqlens, int64_t total,
                              const int* seqused) {
  return {t.data, cu_seqlens ? 0 : t.stride_batch, t.stride_seq, t.stride_head, seqlen, cu_seqlens, total, seqused};
}

// An ordinary launch, not a programmatic one: the kernels after it (V's, then attention's) may read the caller's
// inputs before they wait for the grid before them, since everything that wrote them finished before this one
// started (call.cu sets KernelParams::q_before_prior_grid on that).
template <typename T, int D, bool kSmooth, bool kCache = false>
void launch_qk(const PrepareParams& p, const prepare::QkArgs& qk, int64_t ctas, cudaStream_t stream) {
  constexpr int kThreads = prepare::Tile<D>::kThreads;
  if (p.qk_format == QkFormat::kInt8) {
    prepare::quantize_qk_int8_kernel<T, D, kSmooth, kCache><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(qk);
  } else {
    prepare::quantize_qk_kernel<T, D, kSmooth, kCache><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(qk);
  }
}

// Programmatic launches: each may start while the kernel before it drains (kernels.cuh).
template <typename T, int D, bool kCache>
cudaError_t launch_v(const prepare::VArgs& va, unsigned ctas, cudaStream_t stream) {
  constexpr int kThreads = prepare::Tile<D>::kThreads;
  const cudaError_t e =
      launch_programmatic(prepare::v_amax_kernel<T, D, kCache>, dim3(ctas), dim3(kThreads), 0, stream, va);
  if (e != cudaSuccess) return e;
  if constexpr (!kCache) {
    if (va.v_bias != nullptr)
      return launch_programmatic(prepare::v_pack_kernel<T, D, false, true>, dim3(ctas), dim3(kThreads), 0, stream, va);
  }
  return launch_programmatic(prepare::v_pack_kernel<T, D, kCache>, dim3(ctas), dim3(kThreads), 0, stream, va);
}

// CacheArgs of the KV-cache fields (validated: batched, no smoothing); nk = ceil(seqlen_k / 128).
prepare::CacheArgs cache_args(const PrepareParams& p, int sk, int nk) {
  prepare::CacheArgs c{};
  c.k_prefix = {p.k_prefix.data, p.k_prefix.stride_batch, p.k_prefix.stride_seq, p.k_prefix.stride_head};
  c.v_prefix = {p.v_prefix.data, p.v_prefix.stride_batch, p.v_prefix.stride_seq, p.v_prefix.stride_head};
  c.prefix_len = p.kv_prefix_len;
  c.k_rows = p.k_codes_rows > 0 ? p.k_codes_rows : sk;
  c.k_blocks = p.k_descale_blocks > 0 ? p.k_descale_blocks : nk;
  c.v_descale_blocks = p.v_descale_per_block ? c.k_blocks : 0;
  return c;
}

template <typename T, int D>
Status launch(const PrepareParams& p, const PrepareExtras& extras, cudaStream_t stream) {
  auto* v_amax = static_cast<uint32_t*>(p.workspace);
  const Dims d = dims_of(p);
  // K and V per K/V head (grouped-query attention: kv_heads < heads), Q per query head.
  const int kv_heads = kv_heads_or(p.heads, p.kv_heads);
  const int64_t bh = static_cast<int64_t>(d.nseq) * kv_heads;
  const WorkspaceLayout ws = workspace_layout(d.nseq, p.heads, d.sk, p.k_smoothing, p.v_bias != nullptr);
  auto* const residuals =
      p.v_bias != nullptr ? reinterpret_cast<unsigned long long*>(static_cast<char*>(p.workspace) + ws.residuals) : nullptr;
  auto* const arrivals =
      p.v_bias != nullptr ? reinterpret_cast<unsigned*>(static_cast<char*>(p.workspace) + ws.arrivals) : nullptr;
  float* k_mean = nullptr;
  if (p.k_smoothing) {  // K channel means (smoothing.cuh) before the Q/K quantization reads them
    prepare::SmoothArgs sa{};
    sa.in = token_args(p.k, d.sk, p.cu_seqlens_k, p.total_k, p.seqused_k);
    sa.heads = kv_heads;
    sa.nblocks = static_cast<int>(num_quant_blocks(d.sk));
    sa.block_sums = reinterpret_cast<double*>(static_cast<char*>(p.workspace) + ws.block_sums);
    sa.mean = k_mean = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + ws.means);
    prepare::k_block_sums_kernel<T, D><<<static_cast<unsigned>(bh * sa.nblocks), D, 0, stream>>>(sa);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("k_block_sums_kernel launch");
    prepare::k_mean_kernel<D><<<static_cast<unsigned>(bh), D, 0, stream>>>(sa);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("k_mean_kernel launch");
  }

  prepare::QkArgs qk{};
  qk.side[0] = {token_args(p.q, d.sq, p.cu_seqlens_q, p.total_q, nullptr),
                q_is_omitted(p) ? 0 : static_cast<int>(num_quant_blocks(d.sq)), p.q_codes, p.q_descale};
  qk.side[1] = {token_args(p.k, d.sk, p.cu_seqlens_k, p.total_k, p.seqused_k), static_cast<int>(num_quant_blocks(d.sk)), p.k_codes,
                p.k_descale};
  qk.heads = p.heads;
  qk.v_amax = v_amax;
  qk.k_mean = k_mean;
  qk.q_dot_k_mean = p.q_dot_k_mean;
  qk.zero_words = extras.zero_words;
  qk.v_residual_sums = residuals, qk.v_arrivals = arrivals;
  qk.zero_count = extras.zero_words != nullptr ? extras.zero_count : 0;
  const bool cache = uses_cache_fields(p);
  if (cache) qk.cache = cache_args(p, d.sk, qk.side[1].nblocks);
  const char* qk_kernel = p.qk_format == QkFormat::kInt8 ? "quantize_qk_int8_kernel launch" : "quantize_qk_kernel launch";
  auto launch_qk_grid = [&](const prepare::QkArgs& args) {
    const int64_t ctas = int64_t(d.nseq) * args.heads * (args.side[0].nblocks + args.side[1].nblocks);
    if (ctas == 0) return;
    if (cache) {
      launch_qk<T, D, false, true>(p, args, ctas, stream);
    } else if (p.k_smoothing) {
      launch_qk<T, D, true>(p, args, ctas, stream);
    } else {
      launch_qk<T, D, false>(p, args, ctas, stream);
    }
  };
  if (kv_heads == p.heads || qk.side[0].nblocks == 0) {
    qk.heads = kv_heads;   // equal head counts, or K alone: one grid over the K/V heads
    launch_qk_grid(qk);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR(qk_kernel);
  } else {
    // Grouped-query attention with Q: one grid walks (sequence, head, block) over a single head count, so Q's blocks
    // (heads) and K's (kv_heads) take a launch each, both ordinary. Q's zeroes the V amax slots of its heads too,
    // which the workspace has (prepare_workspace_bytes is sized with heads); K's, launched after it, zeroes them
    // again before v_amax_kernel, which waits for that grid, adds to them.
    prepare::QkArgs q_only = qk, k_only = qk;
    q_only.side[1].nblocks = 0;
    q_only.kv_group = p.heads / kv_heads;
    q_only.v_residual_sums = nullptr, q_only.v_arrivals = nullptr;   // K's grid zeroes them (per K/V head)
    k_only.side[0].nblocks = 0;
    k_only.heads = kv_heads;
    launch_qk_grid(q_only);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR(qk_kernel);
    launch_qk_grid(k_only);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR(qk_kernel);
  }

  prepare::VArgs va{};
  va.in = token_args(p.v, d.sk, p.cu_seqlens_k, p.total_k, p.seqused_k);
  va.heads = kv_heads;
  va.nblocks = static_cast<int>(num_quant_blocks(d.sk));
  va.v_amax = v_amax;
  va.v_packed = p.v_packed;
  va.v_descale = p.v_descale;
  va.v_residual_sums = residuals, va.v_arrivals = arrivals, va.v_bias = p.v_bias;
  va.sk_pad = cache && p.v_packed_columns > 0 ? p.v_packed_columns : packed_seqlen_k(d.sk);
  if (cache) va.cache = qk.cache;
  const unsigned v_ctas = static_cast<unsigned>(bh * va.nblocks);
  auto* const launch_v_kernels = cache ? &launch_v<T, D, true> : &launch_v<T, D, false>;
  OPENVC_RETURN_IF_ERROR(detail::cuda_status(launch_v_kernels(va, v_ctas, stream), "v_amax_kernel / v_pack_kernel launch",
                                             __FILE__, __LINE__));
  return Status::Ok();
}

}  // namespace

size_t prepare_workspace_bytes(int groups, int heads, int max_seqlen_k, bool k_smoothing, bool v_bias) {
  return workspace_layout(groups, heads, max_seqlen_k, k_smoothing, v_bias).total;
}

Status prepare_fp8(const PrepareParams& params, cudaStream_t stream) {
  return prepare_fp8(params, PrepareExtras{}, stream);
}

Status prepare_fp8(const PrepareParams& params, const PrepareExtras& extras, cudaStream_t stream) {
  OPENVC_RETURN_IF_ERROR(validate(params));
  if (extras.zero_count < 0 || (extras.zero_count > 0 && (extras.zero_words == nullptr || !aligned(extras.zero_words, 4))))
    return Status::Invalid("prepare_fp8: extras.zero_words must be a 4-byte aligned array of zero_count >= 0 words");
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (!device_supports_sm90a(device))
    return Status::Unsupported("prepare_fp8: device " + std::to_string(device) +
                               " is not compute capability 9.0 (the kernels are built for sm_90a only)");
  const bool bf16 = params.dtype == DType::kBFloat16;
  if (params.head_dim == 128)
    return bf16 ? launch<prepare::Bf16, 128>(params, extras, stream) : launch<prepare::F16, 128>(params, extras, stream);
  return bf16 ? launch<prepare::Bf16, 64>(params, extras, stream) : launch<prepare::F16, 64>(params, extras, stream);
}

}  // namespace openvc
