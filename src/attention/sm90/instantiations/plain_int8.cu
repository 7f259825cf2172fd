// The production kernel in mode kInt8QkMode: INT8 Q/K codes, dense head dim 128 (numerics section 9).
#include "attention/sm90/kernel_launch.cuh"

namespace openvc::sm90 {
template Status launch_mode<kInt8QkMode>(const LaunchPlan&, cudaStream_t);
}  // namespace openvc::sm90
