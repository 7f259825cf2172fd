// Host side of the VC grouping (openvc/baselines.h): checks, workspace layout and the launches of
// grouping.cuh: init, kVcIterations x (assign + accumulate, update), final assign, scatter. All on the
// caller's stream, no allocation, no synchronization.
#include <cstdint>
#include <string>

#include "baselines/vc/grouping.cuh"
#include "common/alignment.h"
#include "common/cuda_check.h"
#include "openvc/baselines.h"

namespace openvc {
namespace {

static_assert(vc::kK == kVcClusters, "cluster slots");
static_assert(vc::kTile == kQuantBlock, "tile");

constexpr size_t kAlign = 256;
size_t round_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of the workspace regions (each 256-byte aligned).
struct Layout {
  vc::Partition part;
  size_t cent32, cent16, cnorm, psum, pcount, labels, total;
};
Layout layout_of(int batch, int heads, int seqlen) {
  const size_t bh = static_cast<size_t>(batch) * heads;
  Layout l;
  l.part = vc::partition_of(seqlen);
  const size_t parts = static_cast<size_t>(l.part.parts);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += round_up(bytes);
    return here;
  };
  l.cent32 = take(bh * vc::kK * vc::kD * sizeof(float));
  l.cent16 = take(bh * 2 * vc::kK * vc::kD * sizeof(uint16_t));
  l.cnorm = take(bh * vc::kK * sizeof(float));
  l.psum = take(bh * parts * vc::kK * vc::kD * sizeof(float));
  l.pcount = take(bh * parts * vc::kK * sizeof(int));
  l.labels = take(bh * static_cast<size_t>(seqlen));
  l.total = at;
  return l;
}


Status invalid(const std::string& what) { return Status::Invalid("vc_grouping: params." + what); }

Status validate(const VcGroupingParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16)
    return invalid("dtype must be kBFloat16 or kFloat16");
  const struct { const char* name; int v; } sizes[] = {{"batch", p.batch}, {"seqlen", p.seqlen}, {"heads", p.heads}};
  for (const auto& s : sizes)
    if (s.v <= 0) return invalid(std::string(s.name) + " must be > 0, got " + std::to_string(s.v));
  if (p.head_dim != vc::kD)
    return Status::Unsupported("vc_grouping: params.head_dim must be 128, got " + std::to_string(p.head_dim));
  if (p.v.data == nullptr) return invalid("v.data is null");
  if (!aligned(p.v.data, 16)) return invalid("v.data must be 16-byte aligned (the kernels use 16-byte loads)");
  const struct { const char* name; int64_t v; } strides[] = {
      {"stride_batch", p.v.stride_batch}, {"stride_seq", p.v.stride_seq}, {"stride_head", p.v.stride_head}};
  for (const auto& s : strides)
    if (s.v % 8 != 0)
      return invalid(std::string("v.") + s.name + " must be a multiple of 8 elements (16 bytes), got " +
                     std::to_string(s.v));
  if (p.permutation == nullptr) return invalid("permutation is null");
  if (!aligned(p.permutation, alignof(int))) return invalid("permutation must be 4-byte aligned (int32)");
  if (p.workspace == nullptr) return invalid("workspace is null");
  if (!aligned(p.workspace, 16)) return invalid("workspace must be 16-byte aligned");
  const size_t need = vc_grouping_workspace_bytes(p.batch, p.heads, p.seqlen, p.head_dim);
  if (p.workspace_bytes < need)
    return invalid("workspace_bytes is " + std::to_string(p.workspace_bytes) +
                   ", vc_grouping_workspace_bytes(batch, heads, seqlen) = " + std::to_string(need) + " needed");
  const Layout l = layout_of(p.batch, p.heads, p.seqlen);
  if (static_cast<int64_t>(p.batch) * p.heads * l.part.parts > INT32_MAX ||
      static_cast<int64_t>(p.batch) * p.heads * (vc::kK / vc::kWarps) > INT32_MAX)
    return Status::Unsupported("vc_grouping: batch * heads is too large for one grid");
  return Status::Ok();
}

template <typename T>
Status launch(const VcGroupingParams& p, cudaStream_t stream) {
  const Layout l = layout_of(p.batch, p.heads, p.seqlen);
  auto* ws = static_cast<unsigned char*>(p.workspace);
  vc::GroupArgs a{};
  a.v = static_cast<const uint16_t*>(p.v.data);
  // A size-1 dim's stride is never used; 0 keeps the arithmetic in range whatever the caller passed.
  a.stride_b = p.batch > 1 ? p.v.stride_batch : 0;
  a.stride_s = p.seqlen > 1 ? p.v.stride_seq : 0;
  a.stride_h = p.heads > 1 ? p.v.stride_head : 0;
  a.heads = p.heads;
  a.seqlen = p.seqlen;
  a.clusters = p.seqlen < vc::kK ? p.seqlen : vc::kK;
  a.tiles_per_part = l.part.tiles_per_part;
  a.parts = l.part.parts;
  a.cent32 = reinterpret_cast<float*>(ws + l.cent32);
  a.cent16 = reinterpret_cast<uint16_t*>(ws + l.cent16);
  a.cnorm = reinterpret_cast<float*>(ws + l.cnorm);
  a.psum = reinterpret_cast<float*>(ws + l.psum);
  a.pcount = reinterpret_cast<int*>(ws + l.pcount);
  a.labels = ws + l.labels;
  a.perm = p.permutation;

  const unsigned bh = static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.heads);
  const unsigned parts_grid = bh * static_cast<unsigned>(l.part.parts);
  constexpr int smem = static_cast<int>(sizeof(vc::AssignSmem));
  // Host-side attribute calls: no stream work, so they are fine inside a graph capture.
  OPENVC_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(vc::assign_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  OPENVC_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(vc::assign_kernel<T, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  vc::init_kernel<T><<<bh, vc::kThreads, 0, stream>>>(a);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc init_kernel launch");
  for (int it = 0; it < kVcIterations; ++it) {
    vc::assign_kernel<T, true><<<parts_grid, vc::kThreads, smem, stream>>>(a);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc assign_kernel launch");
    vc::update_kernel<T><<<bh * (vc::kK / vc::kWarps), vc::kThreads, 0, stream>>>(a);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc update_kernel launch");
  }
  vc::assign_kernel<T, false><<<parts_grid, vc::kThreads, smem, stream>>>(a);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc assign_kernel (final) launch");
  vc::scatter_kernel<<<parts_grid, vc::kThreads, 0, stream>>>(a);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("vc scatter_kernel launch");
  return Status::Ok();
}

}  // namespace

size_t vc_grouping_workspace_bytes(int batch, int heads, int seqlen, int head_dim) {
  if (batch <= 0 || heads <= 0 || seqlen <= 0 || head_dim != vc::kD) return 0;
  return layout_of(batch, heads, seqlen).total;
}

Status vc_grouping(const VcGroupingParams& params, cudaStream_t stream) {
  OPENVC_RETURN_IF_ERROR(validate(params));
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (!device_supports_sm90a(device))
    return Status::Unsupported("vc_grouping: device " + std::to_string(device) +
                               " is not compute capability 9.0 (the kernels are built for sm_90a only)");
  return params.dtype == DType::kBFloat16 ? launch<vc::Bf16>(params, stream) : launch<vc::F16>(params, stream);
}

}  // namespace openvc
