// Q quantization inside the attention kernel (kFusedQMode, mode.h), and the load of a Q tile's codes into QK^T's
// register operand (load_q_fragments). The producer's TMA brings the tile's 128 BF16 / FP16 query rows into
// SharedStorage::q_stage; the 256 threads of the two consumer warpgroups reduce the
// tile's amax, take numerics section 1's scale and write the E4M3 codes into the FP8 Q tile in the swizzle the
// TMA writes for prepared Q, so the QK^T path reads them unchanged. A Q group of section 1 is one 128-row query
// tile, and the arithmetic is the preparation's own (prepare/tile.cuh: scale_inv_of, descale_of, encode_chunk),
// so codes and descale are prepare_fp8's bit for bit. Rows past Sq arrive as zeros (the TMA's out-of-bounds
// fill) and change neither the amax nor any code the kernel keeps. Packed sequences (kVarlenMode): the rows after
// the sequence's end are the next sequence's (or rows no sequence covers), so they are zeroed before the amax.
#pragma once
#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "attention/sm90/config.h"
#include "attention/sm90/gmma.cuh"
#include "prepare/tile.cuh"

namespace openvc::sm90 {

// Named barriers of the 256 consumer threads (1 and 2: the ping-pong probe's).
inline constexpr int kFusedQAmaxBarrier = 3, kFusedQCodesBarrier = 4;

// Byte offset of 16-byte chunk c of row r in an FP8 tile of kRowBytes-byte rows (1024-byte aligned), as the TMA
// writes it with the swizzle of that width: 128 bytes, Swizzle<3,4,3> (chunk ^= row % 8); 64 bytes,
// Swizzle<2,4,3> (chunk ^= (row / 2) % 4). The wgmma descriptors of gmma.cuh read this layout.
template <int kRowBytes>
__device__ __forceinline__ int swizzled_chunk_offset(int r, int c) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "swizzle atoms of 128 or 64 bytes");
  if constexpr (kRowBytes == 128) return r * 128 + ((c ^ (r & 7)) << 4);
  else return r * 64 + ((c ^ ((r >> 1) & 3)) << 4);
}

// Shared-memory accesses by explicit state space: through the generic pointers of SharedStorage the compiler
// emitted generic LD / ST. Volatile, so that they stay after the barrier waits that make the data visible.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_addr(p)));
  return v;
}
__device__ __forceinline__ void sts128(void* p, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr(p)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint32_t lds_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)));
  return v;
}
__device__ __forceinline__ float lds32(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr(p)));
  return v;
}
__device__ __forceinline__ void sts32(float* p, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(smem_addr(p)), "f"(v) : "memory");
}

// The A fragments of QK^T with Q from registers (gmma.cuh, issue_qk_rs) for rows `row` and row + 8 of a Q tile written
// in the TMA's swizzle: register 4s + r holds the 4 bytes of channels 32s + 16 (r / 2) + 4t of row + 8 (r % 2).
template <int kD>
__device__ __forceinline__ void load_q_fragments(const uint8_t* q, int row, int t, uint32_t (&frag)[kD / 8]) {
  static_assert(kD == 128, "E4M3 Q rows of 128 bytes (the 128-byte swizzle); no other head dim takes Q in registers");
#pragma unroll
  for (int i = 0; i < kD / 8; ++i)
    frag[i] = lds_u32(q + swizzled_chunk_offset<kD>(row + 8 * (i & 1), 2 * (i / 4) + ((i & 3) >> 1)) + 4 * t);
}

// ct: this consumer thread (0..255). Thread ct takes half (ct % 2) of row ct / 2: kD / 2 elements, read as
// pairs of 16-byte chunks (16 elements, one 16-byte chunk of codes), the pair order rotated by ct so that a
// quarter warp's reads spread over the banks. kMaskRows: rows at or past `rows` (the tile's rows in its packed
// sequence) count as zeros. Returns the tile's descale; the codes are in q when it returns (both consumer
// warpgroups past the second barrier, the async proxy fenced).
template <int kD, typename T, bool kMaskRows = false>
__device__ __forceinline__ float quantize_q_tile(const uint8_t* stage, uint8_t* q, float* amax_slots, int ct,
                                                 int rows = 0) {
  constexpr int kPairs = kD / 32;   // 16-element pairs of chunks in a half row
  const int r = ct >> 1, half = ct & 1;
  const uint4* src = reinterpret_cast<const uint4*>(stage + (r * kD + half * (kD / 2)) * 2);
  uint4 v[kPairs][2];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int j = (i + ct) % kPairs;
    v[i][0] = lds128(src + 2 * j);
    v[i][1] = lds128(src + 2 * j + 1);
  }
  if constexpr (kMaskRows) {
    if (r >= rows) {
#pragma unroll
      for (int i = 0; i < kPairs; ++i) v[i][0] = v[i][1] = make_uint4(0, 0, 0, 0);
    }
  }
  uint32_t m = 0;   // max |x| on the raw pairs, as the preparation's thread_amax (exact: max picks an input)
#pragma unroll
  for (int i = 0; i < kPairs; ++i)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      m = prepare::absmax2<T>(m, v[i][k].x);
      m = prepare::absmax2<T>(m, v[i][k].y);
      m = prepare::absmax2<T>(m, v[i][k].z);
      m = prepare::absmax2<T>(m, v[i][k].w);
    }
  const float2 mf = prepare::unpack2<T>(m);
  float a = fmaxf(mf.x, mf.y);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
  if ((ct & 31) == 0) sts32(amax_slots + (ct >> 5), a);
  named_barrier_sync(kFusedQAmaxBarrier, 2 * 128);   // also: both warpgroups are past the previous tile's QK^T
  float amax = lds32(amax_slots);
#pragma unroll
  for (int w = 1; w < 2 * 4; ++w) amax = fmaxf(amax, lds32(amax_slots + w));
  // prepare::scale_inv_of(amax) with its one 448 / amax (it and tiny_group would divide twice)
  const float inv = __fdiv_rn(prepare::kE4M3Max, amax);
  const bool tiny = amax > 0.0f && inv == INFINITY;
  const float s = amax > 0.0f && !tiny ? inv : 0.0f;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int j = (i + ct) % kPairs;
    sts128(q + swizzled_chunk_offset<kD>(r, half * kPairs + j), prepare::encode_chunk<T>(v[i], s));
  }
  cutlass::arch::fence_view_async_shared();   // the codes, written by the threads, read by wgmma (async proxy)
  named_barrier_sync(kFusedQCodesBarrier, 2 * 128);
  return tiny ? 0.0f : __fdiv_rn(amax, prepare::kE4M3Max);   // prepare::descale_of(amax)
}

}  // namespace openvc::sm90
