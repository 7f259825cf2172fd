// Programmatic dependent launch (include/openvc/launch.h). A kernel enqueued with launch_programmatic may start
// while the grid before it on the stream drains: it calls wait_for_prior_grid() before it reads or writes global
// memory that grid (or an earlier one) wrote or reads. allow_dependent_launch() in every CTA of a kernel lets the
// next programmatic launch start once all of its CTAs have reached it (or exited). Without a programmatic launch
// both are no-ops.
#pragma once
#include <cuda_runtime.h>

#include "openvc/launch.h"

namespace openvc {

__device__ __forceinline__ void wait_for_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// kernel<<<grid, block, smem, stream>>>(args...), programmatic when the setting is on.
template <typename... Params, typename... Args>
cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                const Args&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = programmatic_launch() ? 1 : 0;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess) (void)cudaGetLastError();   // returned here: not left for the caller's next check
  return e;
}

}  // namespace openvc
