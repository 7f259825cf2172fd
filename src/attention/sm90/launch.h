// Host side of the sm_90a ExpCast kernel: a launch plan (validated parameters, TMA descriptors,
// persistent grid and the mode the call needs) and the launch of a plan on the caller's stream. No
// allocation, no synchronization: graph-capturable. The kernel templates live in kernel_launch.cuh,
// included only by the per-mode translation units (generated from instantiations/mode.cu.in) and the timing tool.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include "attention/sm90/kernel_params.h"
#include "attention/sm90/mode.h"
#include "openvc/attention.h"

namespace openvc::sm90 {

// Whether the kernel's 32-bit key-block indexing covers Sq x Sk (max lengths when packed):
// ceil(Sq/128) * ceil(Sk/128) * 128 < 2^32. Larger calls are the general path's (call.cu).
inline bool fits_fast_path(int64_t sq, int64_t sk) {
  return num_quant_blocks(sq) * packed_seqlen_k(sk) < (int64_t(1) << 32);
}

// Extra inputs of the VC mode, already validated by the caller.
struct VcModeInputs {
  const float* channel_descale = nullptr;  // [B, H, D]
  const float* mean_scaled = nullptr;      // [B, H, nk, D]
};

struct LaunchPlan {
  CUtensorMap tm_q, tm_k, tm_v, tm_krep, tm_vrep;
  KernelParams kp;
  int grid = 0;   // 0: nothing to launch (no query row)
  int mode = kPlainMode;
};

// Validates `params` (every rule of attention.h), picks the mode and builds the plan. vc != nullptr
// selects the VC mode.
Status plan_attention(const AttentionParams& params, const VcModeInputs* vc, LaunchPlan* plan);

// Split tiles (kSplitTilesMode, split.cuh; numerics section 5, "Split tiles"). The workspace of a launch on `grid`
// CTAs, 256-byte aligned: split_tiles_arrival_words(grid) int32 counts at its start, which must be zero when the
// kernel starts (the one-call path's preparation zeroes them: prepare_internal.h; a launch on fewer CTAs reads a
// prefix of them), then the parts' partials from split_tiles_partials_offset(grid).
size_t split_tiles_workspace_bytes(int grid);
size_t split_tiles_partials_offset(int grid);
int split_tiles_arrival_words(int grid);
// Whether the plan can run split tiles: a batched E4M3 head-dim-128 plan with Q quantized in the kernel (kFusedQMode,
// with or without kFewKeysMode), at least a tile per CTA, head tiles + tail units below 2^31 (split.cuh).
bool split_tiles_eligible(const LaunchPlan& plan);
// Makes an eligible plan run split tiles over `workspace` (split_tiles_workspace_bytes(plan->grid) bytes).
Status use_split_tiles(LaunchPlan* plan, void* workspace, size_t workspace_bytes);

// The production kernel of each mode (one generated translation unit per kProductionModes entry) and the
// dispatch over plan.mode (a compile-time search of kProductionModes).
template <int kMode>
Status launch_mode(const LaunchPlan& plan, cudaStream_t stream);
Status launch_plan(const LaunchPlan& plan, cudaStream_t stream);

}  // namespace openvc::sm90
