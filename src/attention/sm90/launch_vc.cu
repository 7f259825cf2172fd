// Entry point of the VC-Attention baseline (numerics section 7) on the sm_90a kernel family: the same
// kernel in VC mode (per-channel V descales, block means restored through each tile's row sum,
// natural key order). The kernel instantiation is kProductionModes' kVcMode entry (mode.h).
#include "attention/sm90/launch.h"
#include "openvc/baselines.h"

namespace openvc {

Status attention_vc_fp8(const VcAttentionParams& params, cudaStream_t stream) {
  if (params.v_channel_descale == nullptr) return Status::Invalid("v_channel_descale must not be null");
  if (params.block_mean_scaled == nullptr) return Status::Invalid("block_mean_scaled must not be null");
  if ((reinterpret_cast<uintptr_t>(params.v_channel_descale) & 7) != 0)
    return Status::Invalid("v_channel_descale must be 8-byte aligned");
  if ((reinterpret_cast<uintptr_t>(params.block_mean_scaled) & 15) != 0)
    return Status::Invalid("block_mean_scaled must be 16-byte aligned (bulk copies)");
  AttentionParams ap;
  ap.in = params.in;
  // The per-head V descale is not used in VC mode; validation wants a pointer, and this one is valid.
  ap.in.v_descale = params.v_channel_descale;
  ap.out = params.out;
  ap.out_stride_batch = params.out_stride_batch;
  ap.out_stride_seq = params.out_stride_seq;
  ap.out_stride_head = params.out_stride_head;
  ap.lse = params.lse;
  ap.out_dtype = params.out_dtype;
  ap.softmax_scale = params.softmax_scale;
  ap.mid_window_blocks = kNaturalOrder;
  sm90::VcModeInputs vc;
  vc.channel_descale = params.v_channel_descale;
  vc.mean_scaled = params.block_mean_scaled;
  sm90::LaunchPlan plan;
  OPENVC_RETURN_IF_ERROR(sm90::plan_attention(ap, &vc, &plan));
  return sm90::launch_plan(plan, stream);
}

}  // namespace openvc
