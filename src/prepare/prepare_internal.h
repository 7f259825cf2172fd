// The library's own entry to the preparation: prepare_fp8 (attention.h) with what only openvc's one-call path
// (call.cu) asks of it.
#pragma once
#include <cuda_runtime.h>

#include "openvc/attention.h"

namespace openvc {

struct PrepareExtras {
  // Words the preparation's first kernel sets to 0 before any later kernel on the stream reads them: the split
  // tiles' arrival counts of the attention kernel that follows (sm90/split.cuh), so that a workspace with any
  // contents serves, a CUDA graph's replays included.
  int* zero_words = nullptr;
  int zero_count = 0;
};

Status prepare_fp8(const PrepareParams& params, const PrepareExtras& extras, cudaStream_t stream);

}  // namespace openvc
