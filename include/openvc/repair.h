// GPU preparation of V residual repair rows (docs/numerics.md section 6): picks, per (batch, head),
// the tokens whose per-head E4M3 V quantization lost the most energy and writes the RepairInputs of
// openvc/attention.h for them. Same conventions as prepare_fp8: caller-owned device memory and
// workspace, the caller's stream, no allocation, no host synchronization, no device-to-host read, so a
// call can be captured in a CUDA graph. Batched [B, Sk, H, D] inputs only, head_dim 128.
//
// Typical use, after prepare_fp8 (pf) of q, k, v:
//   int rows;  repair_row_count(budget, Sk, &rows);                 // validates budget
//   allocate tokens [B,H,rows], k_codes [B,H,Rpad,D], k_descale [B,H,Rpad], v_packed [B,H,D,Rpad]
//   (Rpad = repair_padded_rows(rows)) and repair_workspace_bytes(B, H, Sk, rows) bytes of workspace;
//   prepare_v_repair(params, stream);  attention.repair = repair_inputs(params);  attention_fp8(...)
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "openvc/attention.h"
#include "openvc/status.h"

namespace openvc {

enum class RepairSelection {
  // Select on the GPU: per (batch, head) the rows = repair_row_count(budget, Sk) tokens of largest
  // residual energy E_j = sum_c r_jc^2 (double, c = 0..D-1 in order), r_j = v_j - descale_V *
  // decode(V8_j) in FP32; NaN energy ranks as +inf; order (energy desc, token asc). `tokens` is an output.
  kEnergy,
  // Build rows for the caller's token list (`tokens` is an input of given_rows indices per head, any
  // order, read on the GPU only). An index outside [0, Sk) yields an all-zero row, which adds nothing.
  kGivenTokens,
};

// rows = round half away from zero of (budget * seqlen_k) in double. budget must be finite and in
// [0, 1): anything else is an InvalidArgument naming `budget`. rows == 0 means the plain path.
Status repair_row_count(double budget, int64_t seqlen_k, int* rows);

struct RepairPrepareParams {
  DType dtype = DType::kBFloat16;      // of v
  int batch = 0, seqlen_k = 0, heads = 0, head_dim = kHeadDim;
  TokenTensorView v;                   // the original V, [B, Sk, H, D] strided as in PrepareParams
  const int* cu_seqlens_k = nullptr;   // packed sequences are not supported yet: must stay null

  // Outputs of prepare_fp8 for this K and V (batched layout of Fp8Inputs).
  const uint8_t* k_codes = nullptr;    // [B, Sk, H, D]
  const float* k_descale = nullptr;    // [B, H, ceil(Sk/128)]
  const uint8_t* v_packed = nullptr;   // [B, H, D, packed_seqlen_k(Sk)], kPackedKeyOrder
  const float* v_descale = nullptr;    // [B, H]

  RepairSelection selection = RepairSelection::kEnergy;
  double budget = 0.005;               // kEnergy: rows = repair_row_count(budget, seqlen_k)
  int given_rows = 0;                  // kGivenTokens: rows per head in `tokens`

  // Outputs, Rpad = repair_padded_rows(rows) (layout of RepairInputs). Not touched when rows == 0.
  int* tokens = nullptr;               // [B, H, rows]: written (kEnergy) or read (kGivenTokens)
  uint8_t* repair_k_codes = nullptr;   // [B, H, Rpad, D], 16-byte aligned
  float* repair_k_descale = nullptr;   // [B, H, Rpad]
  uint8_t* repair_v_packed = nullptr;  // [B, H, D, Rpad], 16-byte aligned
  void* workspace = nullptr;           // repair_workspace_bytes(...) bytes, 16-byte aligned
  size_t workspace_bytes = 0;
};

// Workspace of prepare_v_repair for `rows` rows per head (either selection). 0 for non-positive sizes
// or when the CUB temp-storage query fails (e.g. no usable CUDA device).
size_t repair_workspace_bytes(int batch, int heads, int seqlen_k, int rows);

Status prepare_v_repair(const RepairPrepareParams& params, cudaStream_t stream);

// The rows per head that `params` describes (0 for an invalid budget), and the RepairInputs view of
// its outputs for AttentionParams::repair.
int repair_rows_of(const RepairPrepareParams& params);
RepairInputs repair_inputs(const RepairPrepareParams& params);

}  // namespace openvc
