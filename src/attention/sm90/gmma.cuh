// Thin helpers over CuTe's sm_90a wgmma atoms, mbarriers and TMA copies, so the kernel reads as
// "issue QK^T", "issue PV" with plain register arrays.
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "attention/sm90/config.h"

namespace openvc::sm90 {

namespace gmma = cute::SM90::GMMA;
using QkMma = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;   // S = Q K^T, both K-major from smem
using QkMmaInt8 = gmma::MMA_64x128x32_S32S8S8_SS_TN;      // the same with INT8 codes: exact int32 sums
using QkMmaRs = gmma::MMA_64x128x32_F32E4M3E4M3_RS_TN<>;   // the same with Q from registers (plain modes)
// [O | l] += P [V | 1], P from registers; N = D + 8 (config.h).
template <int kD>
using PvMma = std::conditional_t<kD == 128, gmma::MMA_64x136x32_F32E4M3E4M3_RS_TN<>,
                                 gmma::MMA_64x72x32_F32E4M3E4M3_RS_TN<>>;

// Descriptor of a K-major operand tile written by TMA with a swizzle as wide as its rows (kRowBytes:
// 128 or 64): 8-row atoms 8 * kRowBytes apart (the leading offset is unused for swizzled K-major
// layouts). V tiles have 128-byte rows (128 keys) at every head dim.
template <int kRowBytes = 128>
__device__ __forceinline__ uint64_t sw_kmajor_desc(const void* smem_tile) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "swizzle atoms of 128 or 64 bytes");
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem_tile) >> 4);
  d.bitfield.leading_byte_offset_ = 1;
  d.bitfield.stride_byte_offset_ = (8 * kRowBytes) >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = static_cast<uint8_t>(kRowBytes == 128 ? gmma::LayoutType::B128 : gmma::LayoutType::B64);
  return d.desc_;
}
// Step k of 32 FP8 elements along K inside the swizzled row: the start address moves by 32 bytes
// (the hardware applies the swizzle to absolute addresses, so tiles are 1024-byte aligned).
__device__ __forceinline__ uint64_t desc_k_step(uint64_t desc, int k) { return desc + ((32 * k) >> 4); }

template <bool kInt8, size_t... I>
__device__ __forceinline__ void qk_mma_impl(uint64_t da, uint64_t db, float (&d)[64], gmma::ScaleOut acc,
                                            std::index_sequence<I...>) {
  if constexpr (kInt8) QkMmaInt8::fma(da, db, reinterpret_cast<uint32_t&>(d[I])..., acc);  // int32 bits in d
  else QkMma::fma(da, db, d[I]..., acc);
}
template <size_t... I>
__device__ __forceinline__ void qk_rs_mma_impl(const uint32_t* a, uint64_t db, float (&d)[64], gmma::ScaleOut acc,
                                               std::index_sequence<I...>) {
  QkMmaRs::fma(a[0], a[1], a[2], a[3], db, d[I]..., acc);
}
template <int kD, int N, size_t... I>
__device__ __forceinline__ void pv_mma_impl(const uint32_t* a, uint64_t db, float (&d)[N], gmma::ScaleOut acc,
                                            std::index_sequence<I...>) {
  PvMma<kD>::fma(a[0], a[1], a[2], a[3], db, d[I]..., acc);
}

template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}

// S(64x128) = Q(64xD) K^T: D/32 k32 steps over the head dim, one commit group. kInt8: s holds the int32
// sums' bits (the row max works on them, the conversion converts them at the FMA: softmax.cuh).
template <int kD, bool kInt8 = false>
__device__ __forceinline__ void issue_qk(uint64_t desc_q, uint64_t desc_k, float (&s)[64]) {
  fence_regs(s);
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < kD / 32; ++k)
    qk_mma_impl<kInt8>(desc_k_step(desc_q, k), desc_k_step(desc_k, k), s,
                k == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One, std::make_index_sequence<64>{});
  cute::warpgroup_commit_batch();
  fence_regs(s);
}

// The same with Q's codes in registers: q holds, per k32 step s and register r, the A fragment of rows g + 8 (r % 2)
// and channels 32s + 16 (r / 2) + 4t .. + 3 (kernel.cuh loads it from the tile once per query tile).
template <int kD>
__device__ __forceinline__ void issue_qk_rs(uint32_t (&q)[kD / 8], uint64_t desc_k, float (&s)[64]) {
  fence_regs(q);
  fence_regs(s);
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < kD / 32; ++k)
    qk_rs_mma_impl(&q[4 * k], desc_k_step(desc_k, k), s, k == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One,
                   std::make_index_sequence<64>{});
  cute::warpgroup_commit_batch();
  fence_regs(q);
  fence_regs(s);
}

// [O | l](64 x D+8) (+)= P(64x128 keys) [V | 1](128 keys x D+8): four k32 steps over the keys; `fresh`
// (uniform over the warpgroup) starts a new accumulator. Hopper's FP8 tensor-core accumulator keeps
// about 13 mantissa bits and truncates, so sums over hundreds of tiles drift by percents: the caller
// adds the product into FP32 registers every few tiles.
template <int kD, int N>
__device__ __forceinline__ void issue_pv(uint32_t (&p)[16], uint64_t desc_v, float (&o)[N], bool fresh) {
  static_assert(N == (kD + 8) / 2, "the accumulator fragment of a 64 x (D + 8) product");
  fence_regs(p);
  fence_regs(o);
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < 128 / 32; ++k)
    pv_mma_impl<kD>(&p[4 * k], desc_k_step(desc_v, k), o,
                    (k == 0 && fresh) ? gmma::ScaleOut::Zero : gmma::ScaleOut::One, std::make_index_sequence<N>{});
  cute::warpgroup_commit_batch();
  fence_regs(p);
  fence_regs(o);
}

// Named barriers that order the two consumer warpgroups' tensor-core issue (ping-pong).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace openvc::sm90
