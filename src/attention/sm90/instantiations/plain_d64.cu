// The production kernel in mode kHeadDim64Mode
// (its own translation unit: the modes compile in parallel).
#include "attention/sm90/kernel_launch.cuh"

namespace openvc::sm90 {
template Status launch_mode<kHeadDim64Mode>(const LaunchPlan&, cudaStream_t);
}  // namespace openvc::sm90
