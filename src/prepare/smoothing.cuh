// K smoothing (docs/numerics.md sections 1 and 9, either Q/K format): the channel means of K per
// (sequence, head), in the exact order of reference::k_smoothing_means, so that the smoothed codes are
// the reference's bit for bit:
//   k_block_sums_kernel: one CTA per (sequence, head, 128-key block), one thread per channel: the double
//                        sum of the block's valid keys (key counts respected) in token order, serially.
//   k_mean_kernel:       one CTA per (sequence, head), one thread per channel: the block sums added in
//                        block order in double, one rounding to FP32, one FP32 division by (float)count
//                        (0 when count = 0).
// quantize_qk_kernel / quantize_qk_int8_kernel then quantize k' = fl(k - mean_c) (one FP32 subtraction).
// Preparation is memory-bound: the serial per-channel loop reads each token row of the block once,
// coalesced across the channels of the CTA, kSumChunk rows in flight.
#pragma once
#include <cstdint>

#include <cuda_fp16.h>

#include "prepare/tile.cuh"

namespace openvc::prepare {

struct SmoothArgs {
  TokenArgs in;          // K (cu_seqlens, seqused as for the quantize kernels)
  int heads, nblocks;    // nblocks = ceil(seqlen / 128) (max_seqlen_k when packed)
  double* block_sums;    // [G, H, nblocks, D] workspace; blocks past the valid keys are not written
  float* mean;           // [G, H, D] workspace
};

// One 16-bit element -> float (exact for both types).
template <typename T>
__device__ __forceinline__ float element_to_float(uint16_t u);
template <>
__device__ __forceinline__ float element_to_float<Bf16>(uint16_t u) {
  return __uint_as_float(static_cast<uint32_t>(u) << 16);
}
template <>
__device__ __forceinline__ float element_to_float<F16>(uint16_t u) {
  return __half2float(__ushort_as_half(u));
}

// Loads issued together ahead of the serial double additions of both kernels.
inline constexpr int kSumChunk = 32;

// The sum of to_double(load(i)) for i = 0 .. n-1 in index order, one double addition each (the reference's order),
// with the loads of kSumChunk terms issued ahead of their additions: the additions are a serial chain, the loads are
// not (with 8 tokens in flight a block-sum CTA waited for memory 16 times a block, and a mean thread once per block).
template <typename V, class Load, class ToDouble>
__device__ __forceinline__ double ordered_sum(int n, Load load, ToDouble to_double) {
  double sum = 0.0;
  int i = 0;
  for (; i + kSumChunk <= n; i += kSumChunk) {
    V v[kSumChunk];
#pragma unroll
    for (int j = 0; j < kSumChunk; ++j) v[j] = load(i + j);
#pragma unroll
    for (int j = 0; j < kSumChunk; ++j) sum += to_double(v[j]);
  }
  for (; i < n; ++i) sum += to_double(load(i));
  return sum;
}

template <typename T, int D>
__global__ void __launch_bounds__(D) k_block_sums_kernel(const __grid_constant__ SmoothArgs a) {
  const CtaCoord c = cta_coord(a.heads, a.nblocks);
  const SeqSpan span = seq_span(a.in, c.b);
  const int token0 = c.blk * kBlockTokens;
  const int n = min(span.len - token0, kBlockTokens);
  if (n <= 0) return;  // no valid key in this block: k_mean_kernel does not read it
  const uint16_t* x = static_cast<const uint16_t*>(a.in.data) + span.in_offset + c.h * a.in.stride_head +
                      static_cast<int64_t>(token0) * a.in.stride_seq + threadIdx.x;
  // the reference's order: token by token, one double addition each
  const double sum = ordered_sum<uint16_t>(
      n, [&](int t) { return __ldg(x + t * a.in.stride_seq); },
      [](uint16_t u) { return static_cast<double>(element_to_float<T>(u)); });
  a.block_sums[((static_cast<int64_t>(c.b) * a.heads + c.h) * a.nblocks + c.blk) * D + threadIdx.x] = sum;
}

template <int D>
__global__ void __launch_bounds__(D) k_mean_kernel(const __grid_constant__ SmoothArgs a) {
  const int64_t bh = blockIdx.x;
  const SeqSpan span = seq_span(a.in, static_cast<int>(bh / a.heads));
  const int count = span.len;
  // Blocks holding a valid key (at most nblocks: a packed sequence longer than max_seqlen_k breaks the
  // contract; its mean is then wrong, but nothing is read out of bounds).
  const int nb = min((count + kBlockTokens - 1) / kBlockTokens, a.nblocks);
  const double* sums = a.block_sums + bh * a.nblocks * D + threadIdx.x;
  // block order, as the reference (one CTA per (sequence, head) walks every block)
  const double total = ordered_sum<double>(
      nb, [&](int b) { return __ldg(sums + static_cast<int64_t>(b) * D); }, [](double v) { return v; });
  a.mean[bh * D + threadIdx.x] =
      count > 0 ? __fdiv_rn(__double2float_rn(total), __int2float_rn(count)) : 0.0f;
}

}  // namespace openvc::prepare
