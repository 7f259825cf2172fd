// Repair rows in the RepairInputs layout (openvc/attention.h), one CTA per (batch, head, 128-row
// tile), 4 warps; a warp builds one row at a time, lane l owning dims 4l..4l+3:
//   k_codes[row]   = K8 of the token (a copy, 128 bytes)    k_descale[row] = its K block descale
//   v_packed[:,col] = code(r * scale_inv_V), r = v - descale_V * decode(V8) as in energy.cuh,
//                    col = the row's packed column (kPackedKeyOrder inside each 16-row group)
// Rows past `rows` (padding) and rows whose token is out of range are all zero. scale_inv_V is
// recomputed from the block maxima exactly as prepare_fp8 computes it (448 / amax, one FP32 division).
#pragma once
#include <cstdint>

#include "common/e4m3.cuh"
#include "repair/energy.cuh"

namespace openvc::repair {

inline constexpr int kBuildThreads = 128;

struct BuildArgs {
  prepare::TokenArgs v;      // batched [B, Sk, H, D], seqlen = Sk
  const uint8_t* k_codes;    // [B, Sk, H, D]
  const float* k_descale;    // [B, H, nblocks]
  const uint8_t* v_packed;   // [B, H, D, sk_pad]
  const float* v_descale;    // [B, H]
  const float* blk_amax;     // [B*H, nblocks] from energy_kernel
  const int* tokens;         // [B*H, rows]
  int heads, nblocks, rows, row_tiles;
  int64_t sk_pad, rpad;      // rpad = row_tiles * 128
  uint8_t* out_k;            // [B, H, rpad, D]
  float* out_k_descale;      // [B, H, rpad]
  uint8_t* out_v;            // [B, H, D, rpad]
};

template <typename T>
__global__ void __launch_bounds__(kBuildThreads) build_rows_kernel(const __grid_constant__ BuildArgs a) {
  // Transposed V codes of the tile: [dim][32 words of 4 packed columns]. Word w of dim d is stored at
  // w ^ ((d >> 2) & 31): the 32 lanes writing one row's byte (dims 4l + dd) then hit 32 banks, and a
  // warp reading one dim's 32 words does too.
  __shared__ uint32_t vt[kD * 32];
  __shared__ float red[kBuildThreads / 32];
  const int tile = static_cast<int>(blockIdx.x % a.row_tiles);
  const int64_t g = blockIdx.x / a.row_tiles;
  const int b = static_cast<int>(g / a.heads), h = static_cast<int>(g % a.heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int S = a.v.seqlen;

  float m = 0.0f;  // max of the block maxima: exact, order-free
  for (int i = threadIdx.x; i < a.nblocks; i += kBuildThreads) m = fmaxf(m, __ldg(a.blk_amax + g * a.nblocks + i));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  const float amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  const float scale_inv = prepare::scale_inv_of(amax);
  const float descale = __ldg(a.v_descale + g);

  uint8_t* vt_bytes = reinterpret_cast<uint8_t*>(vt);
  for (int i = warp; i < kTile; i += kBuildThreads / 32) {
    const int64_t row = static_cast<int64_t>(tile) * kTile + i;
    int j = -1;
    if (row < a.rows) {
      j = __ldg(a.tokens + g * a.rows + row);
      if (j < 0 || j >= S) j = -1;
    }
    uint32_t kw = 0, vw = 0;
    float kd = 0.0f;
    if (j >= 0) {
      kw = __ldg(reinterpret_cast<const uint32_t*>(a.k_codes + ((static_cast<int64_t>(b) * S + j) * a.heads + h) * kD) + lane);
      const uint2 xv = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.v.data) + b * a.v.stride_batch +
                                                            j * a.v.stride_seq + h * a.v.stride_head) + lane);
      const float2 x01 = prepare::unpack2<T>(xv.x), x23 = prepare::unpack2<T>(xv.y);
      const uint8_t* cp = a.v_packed + (g * kD + 4 * lane) * a.sk_pad + packed_column_of(j);
      const float r0 = residual(x01.x, descale, __ldg(cp));
      const float r1 = residual(x01.y, descale, __ldg(cp + a.sk_pad));
      const float r2 = residual(x23.x, descale, __ldg(cp + 2 * a.sk_pad));
      const float r3 = residual(x23.y, descale, __ldg(cp + 3 * a.sk_pad));
      vw = detail::e4m3_encode4(__fmul_rn(r0, scale_inv), __fmul_rn(r1, scale_inv), __fmul_rn(r2, scale_inv),
                                __fmul_rn(r3, scale_inv));
      if (lane == 0) kd = __ldg(a.k_descale + g * a.nblocks + j / kTile);
    }
    reinterpret_cast<uint32_t*>(a.out_k + (g * a.rpad + row) * kD)[lane] = kw;
    if (lane == 0) a.out_k_descale[g * a.rpad + row] = kd;
    const int col = static_cast<int>(packed_column_of(i));
#pragma unroll
    for (int dd = 0; dd < 4; ++dd) {
      const int d = 4 * lane + dd;  // (d >> 2) & 31 == lane
      vt_bytes[(d * 32 + ((col >> 2) ^ lane)) * 4 + (col & 3)] = static_cast<uint8_t>(vw >> (8 * dd));
    }
  }
  __syncthreads();
  uint8_t* out = a.out_v + g * kD * a.rpad + static_cast<int64_t>(tile) * kTile;
  for (int d = warp; d < kD; d += kBuildThreads / 32)
    reinterpret_cast<uint32_t*>(out + d * a.rpad)[lane] = vt[d * 32 + (lane ^ ((d >> 2) & 31))];
}

}  // namespace openvc::repair
