// The launch of one kernel instantiation (mode, probe) for a plan. Included by the per-mode files under
// translation units generated from instantiations/mode.cu.in (the library) and by the timing tool (probes).
#pragma once
#include "attention/sm90/kernel.cuh"
#include "attention/sm90/launch.h"
#include "common/cuda_check.h"
#include "common/pdl.cuh"

namespace openvc::sm90 {

template <int kMode, int kProbe>
Status launch_kernel(const LaunchPlan& pl, cudaStream_t stream) {
  if (pl.grid == 0) return Status::Ok();
  const size_t smem = sizeof(SharedStorage<kMode>) + 1024;
  auto kernel = expcast_attention_kernel<kMode, kProbe>;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  // Programmatic (common/pdl.cuh): the CTAs may start while the kernel before it drains (the preparation's last);
  // the kernel waits for that grid before it reads global memory.
  OPENVC_CUDA_RETURN_IF_ERROR(launch_programmatic(kernel, dim3(pl.grid), dim3(kCtaThreads), smem, stream, pl.tm_q,
                                                  pl.tm_k, pl.tm_v, pl.tm_krep, pl.tm_vrep, pl.kp));
  return Status::Ok();
}

template <int kMode>
Status launch_mode(const LaunchPlan& plan, cudaStream_t stream) {
  return launch_kernel<kMode, kNoProbe>(plan, stream);
}

}  // namespace openvc::sm90
