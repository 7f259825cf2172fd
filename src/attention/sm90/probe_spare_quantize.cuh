// Probe kSpareWarpsQuantize (probes.h; bench only, never in the library): warps 1-3 of the producer warpgroup,
// idle in every mode, quantize BF16 K and V as the preparation does while the consumers run the call: whether
// preparation work placed inside the attention kernel would slow its tensor-core loop. Each 32-row slab of 128
// channels (4,096 elements) takes an amax pass and an encode pass (two reads, one write of E4M3 codes), as K's
// block and V's amax + pack kernels read V twice; the slabs are dealt over the CTAs' three warps. The probe's
// arrays ride in fields the plain mode never reads: vc_mean_scaled (K) and repair_k_descale (V), BF16;
// vc_channel_descale, the codes (one byte per element of K, then of V); repair_rows, the slabs of each array.
#pragma once
#include <cstdint>

#include "attention/sm90/kernel_params.h"
#include "prepare/tile.cuh"

namespace openvc::sm90 {

__device__ __forceinline__ void spare_quantize_probe(const KernelParams& p, int warp, int lane) {
  constexpr int kChunksPerSlab = 32 * 128 / 8;   // uint4 chunks of 8 BF16
  const int64_t slabs = p.repair_rows;
  uint4* codes = reinterpret_cast<uint4*>(const_cast<float*>(p.vc_channel_descale));
  for (int which = 0; which < 2; ++which) {
    const uint4* src = reinterpret_cast<const uint4*>(which == 0 ? p.vc_mean_scaled : p.repair_k_descale);
    for (int64_t s = int64_t(blockIdx.x) * 3 + warp; s < slabs; s += int64_t(gridDim.x) * 3) {
      const uint4* in = src + s * kChunksPerSlab;
      uint32_t m = 0;
      for (int i = lane; i < kChunksPerSlab; i += 32) {
        const uint4 v = in[i];
        m = prepare::absmax2<prepare::Bf16>(m, v.x);
        m = prepare::absmax2<prepare::Bf16>(m, v.y);
        m = prepare::absmax2<prepare::Bf16>(m, v.z);
        m = prepare::absmax2<prepare::Bf16>(m, v.w);
      }
      const float2 mf = prepare::unpack2<prepare::Bf16>(m);
      float a = fmaxf(mf.x, mf.y);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
      const float scale = a > 0.0f ? __fdiv_rn(prepare::kE4M3Max, a) : 0.0f;
      uint4* out = codes + (which * slabs + s) * (kChunksPerSlab / 2);
      for (int i = lane; i < kChunksPerSlab / 2; i += 32) {
        const uint4 v[2] = {in[2 * i], in[2 * i + 1]};
        out[i] = prepare::encode_chunk<prepare::Bf16>(v, scale);
      }
    }
  }
}

}  // namespace openvc::sm90
