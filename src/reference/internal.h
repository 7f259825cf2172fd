// Helpers shared by the CPU reference translation units (not part of the public API).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "openvc/reference.h"

namespace openvc::reference::internal {

// softmax_scale <= 0 selects the default 1/sqrt(D), computed in FP32 like the host launcher.
inline float resolve_softmax_scale(float softmax_scale, int head_dim) {
  return softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

// Key j is masked for query i when it lies past the sequence or, in causal mode, past the row's limit
// (causal_key_limit: after the query, or after its chunk; queries aligned to the end when Sq != Sk).
inline bool key_masked(int64_t i, int64_t j, int64_t sq, int64_t sk, bool causal, int causal_chunk = 1) {
  return j >= sk || (causal && j >= causal_key_limit(i, sq, sk, causal_chunk));
}

// Decodes the E4M3 rows of one (sequence, head): codes of token t start at base + t * stride.
// Result is [tokens, head_dim] in double, the operand type of ideal_dot.
std::vector<double> decode_rows(const uint8_t* base, int64_t tokens, int64_t stride, int head_dim);

// The INT8 rows of one (sequence, head) as doubles (section 9): every product of two codes is an
// integer below 2^14 in magnitude, so dot products (ideal_dot, block_dots2) are exact integers too.
std::vector<double> int8_rows(const int8_t* base, int64_t tokens, int64_t stride, int head_dim);

// The "ideal accumulator" of an FP8 x FP8 dot product: every E4M3 value is a multiple of 2^-9 below
// 2^9, so each product is a multiple of 2^-18 below 2^18 and any sum of fewer than 2^17 of them is
// exact in double whatever the order. Rounding that exact sum once to float gives the correctly
// rounded dot product, the best an FP32 accumulator (the tensor core's) could produce.
float ideal_dot(const double* a, const double* b, int n);

// Fast kernels for the O(S^2 D) loops; the results are those of the plain loops they replace.
// Keys are stored in panels of kPanel keys, [nblk][kQuantBlock / kPanel][D][kPanel], zero past the
// last token, so that eight accumulators per row stay in registers over the whole head dimension.
inline constexpr int kPanel = 8;
std::vector<double> key_panels(const double* rows, int64_t tokens, int head_dim);
// acc_r[j] = sum_c q_r[c] * key_j[c] for the kQuantBlock keys of one block (panels of block b start at
// panels + b * head_dim * kQuantBlock), for two query rows at once (q1 may equal q0). On decoded FP8
// operands each sum is exact (see ideal_dot), whatever the order.
void block_dots2(const double* q0, const double* q1, const double* block_panels, int head_dim, double* acc0,
                 double* acc1);
// acc[c] += (p[0] * v[0][c] + p[1] * v[1][c]) + (p[2] * v[2][c] + p[3] * v[3][c]) for c < head_dim.
void axpy4(double* acc, int head_dim, const double p[4], const double* const v[4]);

// Runs f(0) .. f(n - 1) over the hardware threads (each index once, any order). Used for the
// independent (sequence, head) groups, so results never depend on the thread count. If a thread
// cannot be started the calling thread does the remaining work: no exception leaves the library.
void parallel_for(int n, const std::function<void(int)>& f);

// The quantizers' common argument rules: valid sequences, an output, and input for every token.
Status check_quantize_args(const float* x, const Sequences& seqs, const void* out);

// Valid keys of sequence s: key_counts[s] clamped to [0, length], or the length without counts.
inline int64_t key_count(const Sequences& seqs, int s, const int* key_counts) {
  const int64_t len = seqs.length(s);
  return key_counts ? std::min<int64_t>(std::max<int64_t>(key_counts[s], 0), len) : len;
}

// Element c of token t (absolute), head h of a [total, H, D] tensor, minus the channel mean when
// smoothing (mean non-null): k' = fl(k - mean_c), one FP32 subtraction.
inline float smoothed(const float* x, const float* mean, int64_t t, int h, int64_t H, int64_t D, int c) {
  const float v = x[(t * H + h) * D + c];
  return mean ? v - mean[c] : v;
}

// Validates both sequence descriptions and that they agree on count, heads and head_dim.
Status check_sequence_pair(const Sequences& q_seqs, const Sequences& k_seqs);

}  // namespace openvc::reference::internal
