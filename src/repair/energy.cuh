// Residual energy of every V token (numerics section 6) and the per-block V amax, one CTA per
// (batch, head, 128-token block), 128 threads: thread t owns token t of the block.
//   r_c = fl(v_c - fl(descale_V * decode(V8_c)))      E = sum_{c=0..D-1} double(r_c)^2, in order
// The sum is sequential per token (the reference's order), so one thread walks a token's whole row;
// the row and the block's packed V codes are staged in shared memory with cp.async (coalesced).
// The V codes come from prepare_fp8's packed layout, i.e. exactly the bytes the attention uses.
// The block amax lets the row builder recompute scale_inv_V = 448 / amax bit-identically to
// prepare_fp8 (descale alone does not determine it).
#pragma once
#include <cstdint>

#include <cuda_fp8.h>

#include "prepare/tile.cuh"

namespace openvc::repair {

inline constexpr int kD = 128;             // head dim (the attention's)
inline constexpr int kTile = 128;          // tokens per CTA == kQuantBlock, and repair rows per tile
inline constexpr int kEnergyThreads = 128;
inline constexpr uint64_t kInfBits = 0x7FF0000000000000ull;  // +inf: the rank of a NaN energy

// Packed column of key i (0..15) inside its 16-key group: the inverse of kPackedKeyOrder
// (repair.cu checks the two agree).
__host__ __device__ constexpr int packed_column(int i) {
  return i < 8 ? 4 * (i >> 1) + (i & 1) : 4 * ((i - 8) >> 1) + 2 + (i & 1);
}
// Column of key j in a packed row (16-key groups, keys permuted inside each).
__host__ __device__ constexpr int64_t packed_column_of(int64_t j) { return (j & ~int64_t(15)) | packed_column(int(j & 15)); }

__device__ __forceinline__ float decode_e4m3(uint8_t c) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3)));
}

// r = v - descale * decode(code) with two FP32 roundings (no FMA contraction).
__device__ __forceinline__ float residual(float v, float descale, uint8_t code) {
  return __fsub_rn(v, __fmul_rn(descale, decode_e4m3(code)));
}

// 16 bytes global -> shared, zero-filled when !valid (tokens past Sk).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

struct EnergyArgs {
  prepare::TokenArgs v;     // batched [B, Sk, H, D] (cu_seqlens null), seqlen = Sk
  const uint8_t* v_packed;  // [B, H, D, sk_pad]
  const float* v_descale;   // [B, H]
  int heads, nblocks;
  int64_t sk_pad;
  uint64_t* keys;           // [B*H, Sk] bits of the (non-negative) energy, NaN -> +inf; unused if !kEnergy
  float* blk_amax;          // [B*H, nblocks] max |v| of each block (NaN ignored, like prepare_fp8)
};

// kEnergy false: block amax only (rows built for caller-given tokens need scale_inv_V and nothing else).
template <typename T, bool kEnergy>
__global__ void __launch_bounds__(kEnergyThreads) energy_kernel(const __grid_constant__ EnergyArgs a) {
  // Token rows of 256 bytes; 16-byte chunk ch of row t sits at chunk ch ^ (t & 15), so the eight
  // threads of a quarter warp (consecutive tokens, same ch) hit distinct banks. 32 + 16 KiB: the
  // static limit exactly, 4 CTAs per SM.
  __shared__ alignas(16) uint8_t vs[kTile * kD * 2];
  __shared__ alignas(16) uint8_t cs[kD * kTile];  // [dim][packed column] codes of this block
  const prepare::CtaCoord c = prepare::cta_coord(a.heads, a.nblocks);
  const int64_t g = static_cast<int64_t>(c.b) * a.heads + c.h;
  const int token0 = c.blk * kTile;
  const int valid = min(kTile, a.v.seqlen - token0);
  const int t = threadIdx.x;

  const uint16_t* vbase = static_cast<const uint16_t*>(a.v.data) + c.b * a.v.stride_batch +
                          c.h * a.v.stride_head + static_cast<int64_t>(token0) * a.v.stride_seq;
#pragma unroll
  for (int n = 0; n < kTile * kD * 2 / 16 / kEnergyThreads; ++n) {
    const int i = t + kEnergyThreads * n;  // chunk i: row i / 16, chunk i % 16 (one warp: 2 rows)
    const int row = i >> 4, ch = i & 15;
    const bool ok = row < valid;
    cp_async16(vs + row * 256 + ((ch ^ (row & 15)) << 4), vbase + (ok ? row * a.v.stride_seq + ch * 8 : 0), ok);
  }
  if (kEnergy) {
    const uint8_t* cbase = a.v_packed + g * kD * a.sk_pad + token0;  // padding columns hold code 0
#pragma unroll
    for (int n = 0; n < kD * kTile / 16 / kEnergyThreads; ++n) {
      const int i = t + kEnergyThreads * n;  // dim i / 8, chunk i % 8
      cp_async16(cs + (i >> 3) * kTile + (i & 7) * 16, cbase + (i >> 3) * a.sk_pad + (i & 7) * 16, true);
    }
  }
  cp_async_wait_all();
  __syncthreads();

  float m = 0.0f;
  if (t < valid) {
    const float descale = kEnergy ? __ldg(a.v_descale + g) : 0.0f;
    const int col = static_cast<int>(packed_column_of(t));
    double e = 0.0;
#pragma unroll 2
    for (int ch = 0; ch < 16; ++ch) {
      const uint4 w = *reinterpret_cast<const uint4*>(vs + t * 256 + ((ch ^ (t & 15)) << 4));
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 x = prepare::unpack2<T>(words[p]);
        m = fmaxf(m, fmaxf(fabsf(x.x), fabsf(x.y)));  // fmaxf drops NaN, as prepare's amax does
        if (kEnergy) {
          const int d = ch * 8 + 2 * p;
          const float r0 = residual(x.x, descale, cs[d * kTile + col]);
          const float r1 = residual(x.y, descale, cs[(d + 1) * kTile + col]);
          // The products are exact in double; the adds round in the reference's order.
          e = __dadd_rn(e, __dmul_rn(static_cast<double>(r0), static_cast<double>(r0)));
          e = __dadd_rn(e, __dmul_rn(static_cast<double>(r1), static_cast<double>(r1)));
        }
      }
    }
    if (kEnergy)
      a.keys[g * a.v.seqlen + token0 + t] = isnan(e) ? kInfBits : static_cast<uint64_t>(__double_as_longlong(e));
  }

#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  __syncthreads();  // every thread is done with cs: reuse it for the four warp maxima
  float* red = reinterpret_cast<float*>(cs);
  if ((t & 31) == 0) red[t >> 5] = m;
  __syncthreads();
  if (t == 0) a.blk_amax[g * a.nblocks + c.blk] = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
}

}  // namespace openvc::repair
