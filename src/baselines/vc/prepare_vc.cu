// Host side of the VC per-call preparation (openvc/baselines.h): checks and the three stream-ordered
// launches of prepare_vc.cuh. No allocation, no synchronization: a call can be captured in a CUDA graph.
#include <cstdint>
#include <string>

#include "baselines/vc/prepare_vc.cuh"
#include "common/alignment.h"
#include "common/cuda_check.h"
#include "openvc/baselines.h"

namespace openvc {
namespace {

constexpr int kD = 128;


Status invalid(const std::string& what) { return Status::Invalid("vc_prepare: params." + what); }

Status check_input(const char* name, const TokenTensorView& t) {
  const std::string n = name;
  if (t.data == nullptr) return invalid(n + ".data is null");
  if (!aligned(t.data, 16)) return invalid(n + ".data must be 16-byte aligned (the kernels use 16-byte loads)");
  const struct { const char* field; int64_t v; } strides[] = {
      {"stride_batch", t.stride_batch}, {"stride_seq", t.stride_seq}, {"stride_head", t.stride_head}};
  for (const auto& s : strides)
    if (s.v % 8 != 0)
      return invalid(n + "." + s.field + " must be a multiple of 8 elements (16 bytes), got " + std::to_string(s.v));
  return Status::Ok();
}

Status check_output(const char* name, const void* p, uintptr_t align) {
  if (p == nullptr) return invalid(std::string(name) + " is null");
  if (!aligned(p, align)) return invalid(std::string(name) + " must be " + std::to_string(align) + "-byte aligned");
  return Status::Ok();
}

Status validate(const VcPrepareParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return invalid("dtype must be kBFloat16 or kFloat16");
  const struct { const char* name; int v; } sizes[] = {
      {"batch", p.batch}, {"seqlen_q", p.seqlen_q}, {"seqlen_k", p.seqlen_k}, {"heads", p.heads}};
  for (const auto& s : sizes)
    if (s.v <= 0) return invalid(std::string(s.name) + " must be > 0, got " + std::to_string(s.v));
  if (p.head_dim != kD)
    return Status::Unsupported("vc_prepare: params.head_dim must be 128, got " + std::to_string(p.head_dim));
  OPENVC_RETURN_IF_ERROR(check_input("q", p.q));
  OPENVC_RETURN_IF_ERROR(check_input("k", p.k));
  OPENVC_RETURN_IF_ERROR(check_input("v", p.v));
  OPENVC_RETURN_IF_ERROR(check_output("permutation", p.permutation, alignof(int)));
  OPENVC_RETURN_IF_ERROR(check_output("q_codes", p.q_codes, 16));
  OPENVC_RETURN_IF_ERROR(check_output("k_codes", p.k_codes, 16));
  OPENVC_RETURN_IF_ERROR(check_output("v_packed", p.v_packed, 16));
  OPENVC_RETURN_IF_ERROR(check_output("q_descale", p.q_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_output("k_descale", p.k_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_output("v_channel_descale", p.v_channel_descale, 8));
  OPENVC_RETURN_IF_ERROR(check_output("block_mean_scaled", p.block_mean_scaled, 16));
  if (p.block_mean != nullptr && !aligned(p.block_mean, alignof(uint16_t)))
    return invalid("block_mean must be 2-byte aligned (or null)");
  OPENVC_RETURN_IF_ERROR(check_output("workspace", p.workspace, 16));
  const size_t need = vc_prepare_workspace_bytes(p.batch, p.heads, p.head_dim);
  if (p.workspace_bytes < need)
    return invalid("workspace_bytes is " + std::to_string(p.workspace_bytes) +
                   ", vc_prepare_workspace_bytes(batch, heads) = " + std::to_string(need) + " needed");
  const int64_t bh = static_cast<int64_t>(p.batch) * p.heads;
  if (bh * (num_quant_blocks(p.seqlen_q) + num_quant_blocks(p.seqlen_k)) > INT32_MAX)
    return Status::Unsupported("vc_prepare: batch * heads * (ceil(seqlen_q/128) + ceil(seqlen_k/128)) exceeds "
                               "2^31 - 1 thread blocks");
  return Status::Ok();
}

// Batched view; the stride of a size-1 dim is never used, 0 keeps the arithmetic in range.
prepare::TokenArgs token_args(const TokenTensorView& t, int batch, int seqlen, int heads) {
  return {t.data, batch > 1 ? t.stride_batch : 0, seqlen > 1 ? t.stride_seq : 0, heads > 1 ? t.stride_head : 0,
          seqlen, nullptr};
}

template <typename T>
Status launch(const VcPrepareParams& p, cudaStream_t stream) {
  constexpr int kThreads = prepare::Tile<kD>::kThreads;
  auto* amax = static_cast<uint32_t*>(p.workspace);
  const int64_t bh = static_cast<int64_t>(p.batch) * p.heads;
  const int nq = static_cast<int>(num_quant_blocks(p.seqlen_q)), nk = static_cast<int>(num_quant_blocks(p.seqlen_k));

  vcprep::QkArgs qk{};
  qk.q = token_args(p.q, p.batch, p.seqlen_q, p.heads);
  qk.k = token_args(p.k, p.batch, p.seqlen_k, p.heads);
  qk.heads = p.heads, qk.nq = nq, qk.nk = nk;
  qk.q_codes = p.q_codes, qk.q_descale = p.q_descale, qk.k_codes = p.k_codes, qk.k_descale = p.k_descale;
  qk.perm = p.permutation;
  qk.amax = amax;
  vcprep::vc_qk_kernel<T, kD><<<static_cast<unsigned>(bh * (nq + nk)), kThreads, 0, stream>>>(qk);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc_qk_kernel launch");

  vcprep::VArgs va{};
  va.v = token_args(p.v, p.batch, p.seqlen_k, p.heads);
  va.heads = p.heads, va.nk = nk;
  va.perm = p.permutation;
  va.amax = amax;
  va.mean_scaled = p.block_mean_scaled;
  va.mean_bf16 = p.block_mean;
  va.channel_descale = p.v_channel_descale;
  va.v_packed = p.v_packed;
  va.sk_pad = packed_seqlen_k(p.seqlen_k);
  const unsigned v_ctas = static_cast<unsigned>(bh * nk);
  vcprep::vc_vmean_kernel<T, kD><<<v_ctas, kThreads, 0, stream>>>(va);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc_vmean_kernel launch");
  vcprep::vc_vpack_kernel<T, kD><<<v_ctas, kThreads, 0, stream>>>(va);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc_vpack_kernel launch");
  return Status::Ok();
}

}  // namespace

size_t vc_prepare_workspace_bytes(int batch, int heads, int head_dim) {
  if (batch <= 0 || heads <= 0 || head_dim != kD) return 0;
  const size_t bytes = static_cast<size_t>(batch) * static_cast<size_t>(heads) * kD * sizeof(uint32_t);
  return (bytes + 15) / 16 * 16;
}

Status vc_prepare(const VcPrepareParams& params, cudaStream_t stream) {
  OPENVC_RETURN_IF_ERROR(validate(params));
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (!device_supports_sm90a(device))
    return Status::Unsupported("vc_prepare: device " + std::to_string(device) +
                               " is not compute capability 9.0 (the kernels are built for sm_90a only)");
  return params.dtype == DType::kBFloat16 ? launch<prepare::Bf16>(params, stream)
                                          : launch<prepare::F16>(params, stream);
}

}  // namespace openvc
