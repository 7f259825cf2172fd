// Device capability queries of the public API.
#include <cuda_runtime_api.h>

#include "openvc/attention.h"

namespace openvc {

// The kernels are built for sm_90a only (arch-specific: they load on compute capability 9.0 alone).
bool device_supports_sm90a(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // a bad ordinal or missing driver must not leak into the caller's next call
    return false;
  }
  return major == 9 && minor == 0;
}

}  // namespace openvc
