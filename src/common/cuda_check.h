// Turning CUDA runtime errors into openvc::Status (docs: include/openvc/status.h). Host code only.
#pragma once
#include <string>

#include <cuda_runtime_api.h>

#include "openvc/status.h"

namespace openvc::detail {

// Status::Cuda naming the failed expression and where it was called, or Ok for cudaSuccess.
inline Status cuda_status(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed: " +
                      cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace openvc::detail

// Early return of Status::Cuda when a CUDA runtime call fails.
#define OPENVC_CUDA_RETURN_IF_ERROR(expr) \
  OPENVC_RETURN_IF_ERROR(::openvc::detail::cuda_status((expr), #expr, __FILE__, __LINE__))

// After a kernel launch: a bad configuration surfaces here (cudaGetLastError also clears it, so
// the error is reported once and does not leak into the caller's next CUDA call).
#define OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR(what) \
  OPENVC_RETURN_IF_ERROR(::openvc::detail::cuda_status(cudaGetLastError(), what, __FILE__, __LINE__))
