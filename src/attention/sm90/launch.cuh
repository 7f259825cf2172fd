// Host launcher of the sm_90a ExpCast attention kernel: validation, TMA descriptors, persistent grid.
// No allocation, no synchronization: graph-capturable on the caller's stream. A template over the
// kernel variant so the timing tool (bench/cpp/bench_variants.cu) can launch the breakdown variants.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "attention/sm90/kernel.cuh"
#include "common/cuda_check.h"
#include "openvc/attention.h"

namespace openvc::sm90 {
namespace launch_detail {


using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver entry point is looked up through the runtime so the library needs no libcuda at link
// time (CI machines have no driver).
inline Status get_encode_fn(EncodeTiledFn* fn) {
  static EncodeTiledFn cached = nullptr;
  if (cached == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult qres;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &qres);
    if (err != cudaSuccess || qres != cudaDriverEntryPointSuccess || ptr == nullptr)
      return Status::Cuda("cuTensorMapEncodeTiled is not available from the CUDA driver");
    cached = reinterpret_cast<EncodeTiledFn>(ptr);
  }
  *fn = cached;
  return Status::Ok();
}

// FP8 tile map with 128-byte swizzle; dims innermost first, strides in bytes for dims 1.. .
template <int Rank>
Status make_fp8_map(CUtensorMap* map, const void* base, const cuuint64_t (&dims)[Rank],
                    const cuuint64_t (&strides)[Rank - 1], const cuuint32_t (&box)[Rank], const char* what) {
  EncodeTiledFn encode;
  OPENVC_RETURN_IF_ERROR(get_encode_fn(&encode));
  cuuint32_t elem_strides[Rank];
  for (int i = 0; i < Rank; ++i) elem_strides[i] = 1;
  CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, Rank, const_cast<void*>(base), dims, strides, box,
                      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status::Invalid(std::string(what) + ": cannot build a TMA descriptor (CUresult " + std::to_string(int(r)) +
                           "); the pointer must be 16-byte aligned");
  return Status::Ok();
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline Status validate(const AttentionParams& p) {
  const Fp8Inputs& in = p.in;
  if (in.batch <= 0 || in.heads <= 0 || in.seqlen_q <= 0 || in.seqlen_k <= 0)
    return Status::Invalid("in: batch, heads, seqlen_q and seqlen_k must be > 0, got " + std::to_string(in.batch) +
                           ", " + std::to_string(in.heads) + ", " + std::to_string(in.seqlen_q) + ", " +
                           std::to_string(in.seqlen_k));
  if (in.head_dim != KernelConfig::kHeadDim)
    return Status::Invalid("in.head_dim: the sm_90a kernel takes 128, got " + std::to_string(in.head_dim));
  const struct { const void* ptr; const char* name; } ptrs[] = {
      {in.q_codes, "in.q_codes"}, {in.k_codes, "in.k_codes"}, {in.v_packed, "in.v_packed"},
      {in.q_descale, "in.q_descale"}, {in.k_descale, "in.k_descale"}, {in.v_descale, "in.v_descale"},
      {p.out, "out"}};
  for (const auto& x : ptrs)
    if (x.ptr == nullptr) return Status::Invalid(std::string(x.name) + " must not be null");
  for (const auto& x : ptrs)
    if (x.ptr != p.out && !aligned16(x.ptr)) return Status::Invalid(std::string(x.name) + " must be 16-byte aligned");
  if ((reinterpret_cast<uintptr_t>(p.out) & 3) != 0 || p.out_stride_seq % 2 != 0 || p.out_stride_head % 2 != 0 ||
      p.out_stride_batch % 2 != 0)
    return Status::Invalid("out: BF16 rows are stored as pairs; pointer must be 4-byte aligned and strides even");
  // Rows of the output must not overlap: a zero (default) stride would make every row write the same
  // memory. The stride of a dimension of size 1 is never used.
  if ((in.heads > 1 && p.out_stride_head < in.head_dim) || (in.seqlen_q > 1 && p.out_stride_seq < in.head_dim) ||
      (in.batch > 1 && p.out_stride_batch < in.head_dim))
    return Status::Invalid("out strides (batch " + std::to_string(p.out_stride_batch) + ", seq " +
                           std::to_string(p.out_stride_seq) + ", head " + std::to_string(p.out_stride_head) +
                           "): each must be at least head_dim (" + std::to_string(in.head_dim) +
                           ") where that dimension is larger than 1");
  if (!std::isfinite(p.softmax_scale))
    return Status::Invalid("softmax_scale must be finite, got " + std::to_string(p.softmax_scale));
  const RepairInputs& r = p.repair;
  if (r.rows < 0) return Status::Invalid("repair.rows must be >= 0, got " + std::to_string(r.rows));
  if (r.rows > 0) {
    const struct { const void* ptr; const char* name; } rptrs[] = {
        {r.k_codes, "repair.k_codes"}, {r.k_descale, "repair.k_descale"}, {r.v_packed, "repair.v_packed"}};
    for (const auto& x : rptrs) {
      if (x.ptr == nullptr) return Status::Invalid(std::string(x.name) + " must not be null when repair.rows > 0");
      if (!aligned16(x.ptr)) return Status::Invalid(std::string(x.name) + " must be 16-byte aligned");
    }
    if (r.rows > in.seqlen_k)
      return Status::Invalid("repair.rows (" + std::to_string(r.rows) + ") must not exceed seqlen_k (" +
                             std::to_string(in.seqlen_k) + ")");
  }
  if (p.mid_window_blocks < kNaturalOrder)
    return Status::Invalid("mid_window_blocks must be >= 0 or kNaturalOrder (-1), got " +
                           std::to_string(p.mid_window_blocks));
  return Status::Ok();
}

template <int kKernel>
Status launch_kernel(int grid, cudaStream_t stream, const CUtensorMap& tm_q, const CUtensorMap& tm_k,
                     const CUtensorMap& tm_v, const CUtensorMap& tm_krep, const CUtensorMap& tm_vrep,
                     const KernelParams& kp) {
  const size_t smem = sizeof(SharedStorage) + 1024;
  OPENVC_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(expcast_attention_kernel<kKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  expcast_attention_kernel<kKernel><<<grid, KernelConfig::kThreads, smem, stream>>>(tm_q, tm_k, tm_v, tm_krep, tm_vrep, kp);
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace launch_detail

// Extra inputs of the VC mode (kVcMode), already validated by the caller.
struct VcModeInputs {
  const float* channel_descale = nullptr;  // [B, H, D]
  const float* mean_scaled = nullptr;      // [B, H, nk, D]
};

template <int kVariant>
Status launch_expcast_attention(const AttentionParams& params, cudaStream_t stream, const VcModeInputs& vc = {}) {
  using namespace launch_detail;
  OPENVC_RETURN_IF_ERROR(validate(params));
  if ((kVariant & kVcMode) && (vc.channel_descale == nullptr || vc.mean_scaled == nullptr))
    return Status::Invalid("VC mode needs v_channel_descale and block_mean_scaled");
  const Fp8Inputs& in = params.in;
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (!device_supports_sm90a(device))
    return Status::Unsupported("attention_fp8: the FP8 ExpCast kernel needs an sm_90 (Hopper) GPU");

  const int64_t d = KernelConfig::kHeadDim, h = in.heads, sq = in.seqlen_q, sk = in.seqlen_k;
  const int64_t sk_pad = packed_seqlen_k(sk);
  CUtensorMap tm_q, tm_k, tm_v;
  OPENVC_RETURN_IF_ERROR(make_fp8_map<4>(&tm_q, in.q_codes, {cuuint64_t(d), cuuint64_t(sq), cuuint64_t(h), cuuint64_t(in.batch)},
                                         {cuuint64_t(h * d), cuuint64_t(d), cuuint64_t(sq * h * d)},
                                         {KernelConfig::kHeadDim, KernelConfig::kBlockM, 1, 1}, "in.q_codes"));
  OPENVC_RETURN_IF_ERROR(make_fp8_map<4>(&tm_k, in.k_codes, {cuuint64_t(d), cuuint64_t(sk), cuuint64_t(h), cuuint64_t(in.batch)},
                                         {cuuint64_t(h * d), cuuint64_t(d), cuuint64_t(sk * h * d)},
                                         {KernelConfig::kHeadDim, KernelConfig::kBlockN, 1, 1}, "in.k_codes"));
  OPENVC_RETURN_IF_ERROR(make_fp8_map<3>(&tm_v, in.v_packed, {cuuint64_t(sk_pad), cuuint64_t(d), cuuint64_t(in.batch * h)},
                                         {cuuint64_t(sk_pad), cuuint64_t(d * sk_pad)},
                                         {KernelConfig::kBlockN, KernelConfig::kHeadDim, 1}, "in.v_packed"));

  // Repair maps over [B, H, R, D] key copies and [B*H, D, R] residual V; without repair the plain
  // maps stand in (never read).
  CUtensorMap tm_krep = tm_k, tm_vrep = tm_v;
  const RepairInputs& rep = params.repair;
  const int64_t r_pad = repair_padded_rows(rep.rows);
  if (rep.rows > 0) {
    OPENVC_RETURN_IF_ERROR(make_fp8_map<4>(&tm_krep, rep.k_codes, {cuuint64_t(d), cuuint64_t(r_pad), cuuint64_t(h), cuuint64_t(in.batch)},
                                           {cuuint64_t(d), cuuint64_t(r_pad * d), cuuint64_t(h * r_pad * d)},
                                           {KernelConfig::kHeadDim, KernelConfig::kBlockN, 1, 1}, "repair.k_codes"));
    OPENVC_RETURN_IF_ERROR(make_fp8_map<3>(&tm_vrep, rep.v_packed, {cuuint64_t(r_pad), cuuint64_t(d), cuuint64_t(in.batch * h)},
                                           {cuuint64_t(r_pad), cuuint64_t(d * r_pad)},
                                           {KernelConfig::kBlockN, KernelConfig::kHeadDim, 1}, "repair.v_packed"));
  }

  KernelParams kp{};
  kp.repair_rows = rep.rows;
  kp.repair_tiles = static_cast<int>(r_pad / KernelConfig::kBlockN);
  kp.repair_k_descale = rep.k_descale;
  kp.vc_channel_descale = vc.channel_descale;
  kp.vc_mean_scaled = vc.mean_scaled;
  kp.batch = in.batch;
  kp.heads = in.heads;
  kp.seqlen_q = in.seqlen_q;
  kp.seqlen_k = in.seqlen_k;
  kp.num_q_tiles = static_cast<int>(num_quant_blocks(sq));
  kp.num_k_blocks = static_cast<int>(num_quant_blocks(sk));
  const int64_t tiles = int64_t(kp.num_q_tiles) * in.heads * in.batch;
  if (tiles > INT32_MAX) return Status::Invalid("in: batch * heads * ceil(seqlen_q/128) exceeds 2^31");
  kp.num_tiles = static_cast<int>(tiles);
  if (int64_t(kp.num_q_tiles) * sk >= (int64_t(1) << 32))
    return Status::Unsupported("in: ceil(seqlen_q/128) * seqlen_k must be < 2^32 for the sm_90a kernel");
  kp.mid_window_blocks = params.mid_window_blocks;
  kp.q_descale = in.q_descale;
  kp.k_descale = in.k_descale;
  kp.v_descale = in.v_descale;
  kp.out = static_cast<__nv_bfloat16*>(params.out);
  kp.out_stride_b = params.out_stride_batch;
  kp.out_stride_s = params.out_stride_seq;
  kp.out_stride_h = params.out_stride_head;
  kp.lse = params.lse;
  const float tau = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(float(in.head_dim));
  // ((8 log2e) * tau) * 2^-24, then * dq, * dk in the kernel: 2^-24 times the reference's multiplier.
  kp.qk_multiplier = (kCodesPerLog2 * tau) * kDomainScale;

  int sms = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int grid = static_cast<int>(tiles < sms ? tiles : sms);
  // Repair tiles run in their own instantiation of the production kernel (the plain one has no
  // repair code at all); the timing variants and the VC mode take none.
  if constexpr (kVariant == kProduction) {
    if (rep.rows > 0) return launch_kernel<kProduction | kWithRepair>(grid, stream, tm_q, tm_k, tm_v, tm_krep, tm_vrep, kp);
  } else {
    if (rep.rows > 0) return Status::Unsupported("repair rows are supported by the production kernel only");
  }
  return launch_kernel<kVariant>(grid, stream, tm_q, tm_k, tm_v, tm_krep, tm_vrep, kp);
}

}  // namespace openvc::sm90
