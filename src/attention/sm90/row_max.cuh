// Row maxima of a 64x128 score tile in the wgmma accumulator layout (lane 4g+t holds rows g and g+8,
// columns 8j+2t and 8j+2t+1 of every 8-column chunk j), for the running max of numerics section 3.
#pragma once
#include <climits>
#include <cmath>

#include "attention/sm90/config.h"

namespace openvc::sm90 {

// This thread's maxima of its rows g (lo) and g+8 (hi) over the raw accumulators; kMasked excludes
// columns at or past `valid_lo` / `valid_hi` keys for rows g / g+8 (the partial last block, or the
// causal diagonal, where the two rows see different keys).
template <bool kMasked>
__device__ __forceinline__ void thread_row_max(const float (&s)[64], int valid_lo, int valid_hi, int t, float& lo,
                                               float& hi) {
  lo = hi = -INFINITY;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = 8 * j + 2 * t;
    const bool v0 = !kMasked || col < valid_lo, v1 = !kMasked || col + 1 < valid_lo;
    const bool w0 = !kMasked || col < valid_hi, w1 = !kMasked || col + 1 < valid_hi;
    lo = fmaxf(lo, fmaxf(v0 ? s[4 * j + 0] : -INFINITY, v1 ? s[4 * j + 1] : -INFINITY));
    hi = fmaxf(hi, fmaxf(w0 ? s[4 * j + 2] : -INFINITY, w1 ? s[4 * j + 3] : -INFINITY));
  }
}

// The same over a full tile as a three-input integer max of the scores' bits (VIMNMX3: half the
// instructions of FMNMX, measured 3-6% faster end to end). For floats >= +0 the signed-integer order
// is the float order and every negative float (and -0) compares below them, so the result is exact
// whenever a row's maximum is >= +0; a warp with a thread whose scores of a row are all negative takes
// the float path instead (rare, and exact as well).
__device__ __forceinline__ void thread_row_max_bits(const float (&s)[64], int t, float& lo, float& hi) {
  // Two chains per row keep the dependent latency short.
  int lo_a = max(__float_as_int(s[0]), __float_as_int(s[1]));
  int lo_b = max(__float_as_int(s[32]), __float_as_int(s[33]));
  int hi_a = max(__float_as_int(s[2]), __float_as_int(s[3]));
  int hi_b = max(__float_as_int(s[34]), __float_as_int(s[35]));
#pragma unroll
  for (int j = 1; j < 8; ++j) {
    lo_a = __vimax3_s32(lo_a, __float_as_int(s[4 * j + 0]), __float_as_int(s[4 * j + 1]));
    lo_b = __vimax3_s32(lo_b, __float_as_int(s[32 + 4 * j + 0]), __float_as_int(s[32 + 4 * j + 1]));
    hi_a = __vimax3_s32(hi_a, __float_as_int(s[4 * j + 2]), __float_as_int(s[4 * j + 3]));
    hi_b = __vimax3_s32(hi_b, __float_as_int(s[32 + 4 * j + 2]), __float_as_int(s[32 + 4 * j + 3]));
  }
  const int lo_i = max(lo_a, lo_b), hi_i = max(hi_a, hi_b);
  // Warp-uniform, so that the common path carries no reconvergence barrier (BSSY/BSYNC).
  if (__any_sync(0xffffffffu, (lo_i | hi_i) < 0)) {
    thread_row_max<false>(s, kBlockN, kBlockN, t, lo, hi);
  } else {
    lo = __int_as_float(lo_i);
    hi = __int_as_float(hi_i);
  }
}

// INT8 tiles (s holds int32 sums' bits): this thread's integer maxima per row and half of the tile,
// m = {row g chunks 0..7, row g chunks 8..15, row g+8 chunks 0..7, row g+8 chunks 8..15} (the halves
// have different K multipliers, so they stay apart). Integer max is exact for any sign: no fallback.
// kMasked: columns at or past valid_lo / valid_hi left out (kNoInt8Score where a half has none).
inline constexpr int kNoInt8Score = INT_MIN;   // below every score (|acc| < 2^22)
template <bool kMasked>
__device__ __forceinline__ void thread_row_max_int8(const float (&s)[64], int valid_lo, int valid_hi, int t,
                                                    int (&m)[4]) {
  auto v = [&](int j, int i, int valid) {   // score i of chunk j, or kNoInt8Score past `valid`
    const int col = 8 * j + 2 * t + (i & 1);
    return !kMasked || col < valid ? __float_as_int(s[4 * j + i]) : kNoInt8Score;
  };
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j0 = 8 * half;
    int lo = max(v(j0, 0, valid_lo), v(j0, 1, valid_lo));
    int hi = max(v(j0, 2, valid_hi), v(j0, 3, valid_hi));
#pragma unroll
    for (int j = j0 + 1; j < j0 + 8; ++j) {
      lo = __vimax3_s32(lo, v(j, 0, valid_lo), v(j, 1, valid_lo));
      hi = __vimax3_s32(hi, v(j, 2, valid_hi), v(j, 3, valid_hi));
    }
    m[half] = lo;
    m[2 + half] = hi;
  }
}

// Maxima of rows g (lo) and g+8 (hi) over the 4 threads of the row quad.
__device__ __forceinline__ void quad_max(float& lo, float& hi) {
  lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
  hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
  lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
  hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
}

// Row maxima of the raw accumulators over the 4 threads of a row (code units follow by multiplying
// with the tile's positive multiplier).
template <bool kMasked, bool kBits>
__device__ __forceinline__ void row_max(const float (&s)[64], int valid_lo, int valid_hi, int t, float& lo,
                                        float& hi) {
  if constexpr (kBits && !kMasked) thread_row_max_bits(s, t, lo, hi);
  else thread_row_max<kMasked>(s, valid_lo, valid_hi, t, lo, hi);
  lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
  hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
  lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
  hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
}

}  // namespace openvc::sm90
