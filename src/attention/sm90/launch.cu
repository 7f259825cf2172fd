// Public entry point of the sm_90a fast path: the production kernel variant.
#include "attention/sm90/launch.cuh"

namespace openvc {

Status attention_fp8(const AttentionParams& params, cudaStream_t stream) {
  return sm90::launch_expcast_attention<sm90::kProduction>(params, stream);
}

}  // namespace openvc
