// The sm_90a ExpCast attention kernel: one producer warpgroup (TMA, registers handed back) and two
// consumer warpgroups in ping-pong (QK^T and PV on the tensor cores, ExpCast in between), persistent
// over (batch, head, 128-row query tile). Arithmetic: docs/numerics.md sections 2-5.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "attention/sm90/config.h"
#include "attention/sm90/expcast.cuh"
#include "attention/sm90/gmma.cuh"
#include "attention/sm90/row_max.cuh"
#include "attention/sm90/traversal.h"

namespace openvc::sm90 {

using Cfg = KernelConfig;

struct KernelParams {
  int batch, heads, seqlen_q, seqlen_k;
  int num_q_tiles, num_k_blocks, num_tiles, mid_window_blocks;
  const float* q_descale;   // [B, H, num_q_tiles]
  const float* k_descale;   // [B, H, num_k_blocks]
  const float* v_descale;   // [B, H]
  __nv_bfloat16* out;       // [B, Sq, H, D] with strides
  int64_t out_stride_b, out_stride_s, out_stride_h;
  float* lse;               // optional [B, H, Sq]
  float qk_multiplier;      // 2^-24 * 8 * log2e * softmax_scale (the scaled ExpCast domain)
  // V residual repair (numerics section 6): repair_rows rows per (b, h) in repair_tiles key tiles,
  // visited after every original block; 0 tiles = plain path.
  int repair_rows, repair_tiles;
  const float* repair_k_descale;  // [B, H, repair_tiles * 128], each row's own K block descale
  // VC mode only (kVcMode): per-channel V descales [B, H, D] and block means / descale [B, H, nk, D].
  const float* vc_channel_descale;
  const float* vc_mean_scaled;
};

struct alignas(1024) SharedStorage {
  uint8_t q[Cfg::kQBytes];
  uint8_t k[Cfg::kStages][Cfg::kTileBytes];
  uint8_t v[Cfg::kStages][Cfg::kVStageBytes];
  float vc_mean[Cfg::kStages][Cfg::kHeadDim];  // VC mode: the V tile's block mean (scaled), same barrier
  uint64_t q_full, q_empty;
  uint64_t k_full[Cfg::kStages], k_empty[Cfg::kStages];
  uint64_t v_full[Cfg::kStages], v_empty[Cfg::kStages];
};
static_assert(Cfg::kQBytes % 1024 == 0 && Cfg::kTileBytes % 1024 == 0 && Cfg::kVStageBytes % 1024 == 0,
              "swizzled operand tiles must stay 1024-byte aligned");

using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
using Barrier = cutlass::arch::ClusterBarrier;
constexpr int kConsumerWarps = 4 * Cfg::kConsumerWarpgroups;  // arrivals that free a buffer

struct TileCoord {
  int b, h, qt;
};
__device__ __forceinline__ TileCoord decode_tile(int tile, const KernelParams& p) {
  // Consecutive tiles share (b, h), so the CTAs running at once read the same K/V from L2.
  TileCoord c;
  c.qt = tile % p.num_q_tiles;
  const int bh = tile / p.num_q_tiles;
  c.h = bh % p.heads;
  c.b = bh / p.heads;
  return c;
}
__device__ __forceinline__ KeyOrder tile_key_order(const TileCoord& c, const KernelParams& p) {
  // floor(r0 Sk / Sq / 128) with r0 = 128 qt is floor(qt Sk / Sq); 32-bit (the host checks the range)
  // because a 64-bit division is a call, and a call serializes the wgmma pipeline.
  const int diag = static_cast<int>((uint32_t(c.qt) * uint32_t(p.seqlen_k)) / uint32_t(p.seqlen_q));
  return KeyOrder(diag, p.num_k_blocks, p.mid_window_blocks);
}

// Ring position shared by the producer and both consumers: every key block takes one stage.
struct RingState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == Cfg::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <int kVariant>
__device__ __forceinline__ void producer_loop(SharedStorage& sh, const KernelParams& p, const CUtensorMap* tm_q,
                                              const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                              const CUtensorMap* tm_krep, const CUtensorMap* tm_vrep) {
  RingState ring;
  int iter = 0;
  for (int tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x, ++iter) {
    const TileCoord c = decode_tile(tile, p);
    const KeyOrder order = tile_key_order(c, p);
    Barrier::wait(&sh.q_empty, (iter & 1) ^ 1);
    TxBarrier::arrive_and_expect_tx(&sh.q_full, Cfg::kQBytes);
    cute::SM90_TMA_LOAD_4D::copy(tm_q, &sh.q_full, 0, sh.q, 0, c.qt * Cfg::kBlockM, c.h, c.b);
    for (int i = 0; i < p.num_k_blocks; ++i, ring.advance()) {
      const int blk = order(i);
      Barrier::wait(&sh.k_empty[ring.stage], ring.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&sh.k_full[ring.stage], Cfg::kTileBytes);
      cute::SM90_TMA_LOAD_4D::copy(tm_k, &sh.k_full[ring.stage], 0, sh.k[ring.stage], 0, blk * Cfg::kBlockN,
                                   c.h, c.b);
      Barrier::wait(&sh.v_empty[ring.stage], ring.phase ^ 1);
      constexpr int kMeanBytes = (kVariant & kVcMode) ? Cfg::kHeadDim * 4 : 0;
      TxBarrier::arrive_and_expect_tx(&sh.v_full[ring.stage], Cfg::kTileBytes + kMeanBytes);
      cute::SM90_TMA_LOAD_3D::copy(tm_v, &sh.v_full[ring.stage], 0, sh.v[ring.stage], blk * Cfg::kBlockN, 0,
                                   c.b * p.heads + c.h);
      if constexpr (kMeanBytes > 0)
        cute::SM90_BULK_COPY_G2S::copy(
            p.vc_mean_scaled + (int64_t(c.b * p.heads + c.h) * p.num_k_blocks + blk) * Cfg::kHeadDim,
            &sh.v_full[ring.stage], sh.vc_mean[ring.stage], kMeanBytes);
    }
    // Repair tiles: K copies [B, H, R, D] and residual V [B*H, D, R], after every original block.
    for (int r = 0; (kVariant & kWithRepair) && r < p.repair_tiles; ++r, ring.advance()) {
      Barrier::wait(&sh.k_empty[ring.stage], ring.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&sh.k_full[ring.stage], Cfg::kTileBytes);
      cute::SM90_TMA_LOAD_4D::copy(tm_krep, &sh.k_full[ring.stage], 0, sh.k[ring.stage], 0, r * Cfg::kBlockN, c.h,
                                   c.b);
      Barrier::wait(&sh.v_empty[ring.stage], ring.phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&sh.v_full[ring.stage], Cfg::kTileBytes);
      cute::SM90_TMA_LOAD_3D::copy(tm_vrep, &sh.v_full[ring.stage], 0, sh.v[ring.stage], r * Cfg::kBlockN, 0,
                                   c.b * p.heads + c.h);
    }
  }
}

// One lane per consumer warp frees a buffer once the whole warp is past its last read of it.
__device__ __forceinline__ void release(uint64_t* bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) Barrier::arrive(bar);
}

// Per-thread view of the 64-row accumulator fragment: lane 4g+t holds rows g and g+8 of its warp's
// 16 rows; in every 8-column chunk j, columns 8j+2t and 8j+2t+1 (indices 4j..4j+3: lo row pair,
// hi row pair).
struct ConsumerState {
  float o[68];       // [O | l] in FP32: o[64..65] = l of row g, o[66..67] = l of row g+8
  float pv[68];      // the current tile's P [V | 1] from the tensor cores
  uint32_t p[16];    // ExpCast codes of the previous tile, in PV A-operand order
  float m_lo, m_hi;    // running maxima in scaled code units (2^-24 M): the codes' reference
  float mo_lo, mo_hi;  // the max O and l are stored relative to (lags m: rebased only on big growth)
};

// Masked keys get code 0: clear their bytes after conversion (register p[4kb+r] holds columns
// c, c+1, c+8, c+9 with c = 32kb + 16*(r>=2) + 2t).
__device__ __forceinline__ void mask_codes(uint32_t (&p)[16], int valid, int t) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = 32 * (i / 4) + ((i % 4) >= 2 ? 16 : 0) + 2 * t;
    uint32_t keep = 0;
    keep |= c < valid ? 0x000000FFu : 0u;
    keep |= c + 1 < valid ? 0x0000FF00u : 0u;
    keep |= c + 8 < valid ? 0x00FF0000u : 0u;
    keep |= c + 9 < valid ? 0xFF000000u : 0u;
    p[i] &= keep;
  }
}

// 2^x on the MUFU unit (ex2.approx, ~2 ulp): the rescale factors need no more, and the accurate
// exp2f adds range handling to every call.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Adds the tensor-core product (at max m) into the FP32 accumulator (at max mo): one FFMA per value
// with beta = 2^((m - mo)/8) <= 2^8. kChunks 17: O and l; 16: O only (repair tiles add to the
// numerator only, numerics section 6, so l stays the denominator of the original keys).
template <int kChunks = 17>
__device__ __forceinline__ void accumulate_tile(ConsumerState& st) {
  const float beta_lo = fast_exp2((st.m_lo - st.mo_lo) * kMaxToLog2);
  const float beta_hi = fast_exp2((st.m_hi - st.mo_hi) * kMaxToLog2);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    st.o[4 * j + 0] = fmaf(st.pv[4 * j + 0], beta_lo, st.o[4 * j + 0]);
    st.o[4 * j + 1] = fmaf(st.pv[4 * j + 1], beta_lo, st.o[4 * j + 1]);
    st.o[4 * j + 2] = fmaf(st.pv[4 * j + 2], beta_hi, st.o[4 * j + 2]);
    st.o[4 * j + 3] = fmaf(st.pv[4 * j + 3], beta_hi, st.o[4 * j + 3]);
  }
}
__device__ __forceinline__ void accumulate_numerator(ConsumerState& st) { accumulate_tile<16>(st); }

// VC mode (numerics section 7): the tile's block mean comes back through its probability row sum,
// O += beta (P Vres + l_tile mu / dv) with mu / dv from shared memory (the same stage as the V tile).
__device__ __forceinline__ void accumulate_tile_vc(ConsumerState& st, const float* mean, int t) {
  const float beta_lo = fast_exp2((st.m_lo - st.mo_lo) * kMaxToLog2);
  const float beta_hi = fast_exp2((st.m_hi - st.mo_hi) * kMaxToLog2);
  const float l_lo = st.pv[64], l_hi = st.pv[66];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 mu = *reinterpret_cast<const float2*>(mean + 8 * j + 2 * t);
    st.o[4 * j + 0] = fmaf(fmaf(l_lo, mu.x, st.pv[4 * j + 0]), beta_lo, st.o[4 * j + 0]);
    st.o[4 * j + 1] = fmaf(fmaf(l_lo, mu.y, st.pv[4 * j + 1]), beta_lo, st.o[4 * j + 1]);
    st.o[4 * j + 2] = fmaf(fmaf(l_hi, mu.x, st.pv[4 * j + 2]), beta_hi, st.o[4 * j + 2]);
    st.o[4 * j + 3] = fmaf(fmaf(l_hi, mu.y, st.pv[4 * j + 3]), beta_hi, st.o[4 * j + 3]);
  }
#pragma unroll
  for (int i = 64; i < 68; ++i) st.o[i] = fmaf(st.pv[i], i < 66 ? beta_lo : beta_hi, st.o[i]);
}

// Flush of the tensor-core partial into the FP32 accumulator, in the kernel's mode.
template <int kVariant>
__device__ __forceinline__ void flush_partial(ConsumerState& st, const SharedStorage& sh, int stage, int t) {
  if constexpr ((kVariant & kVcMode) != 0) accumulate_tile_vc(st, sh.vc_mean[stage], t);
  else accumulate_tile(st);
}

template <int N>
__device__ __forceinline__ void scale_rows(float (&x)[N], float lo, float hi) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    x[4 * j + 0] *= lo;
    x[4 * j + 1] *= lo;
    x[4 * j + 2] *= hi;
    x[4 * j + 3] *= hi;
  }
}

// Zero deadband: every increase of the max is applied before conversion (the codes' reference m).
// O and l need not follow m at once: they stay at a lagging max mo, and each PV product is brought to
// that scale when it is added (beta), which is exact arithmetic for the same result as rescaling O
// and l at every increase (numerics section 4). O is rebased only when m runs 2^8 ahead of mo, so
// most increases cost two exponentials instead of 136 multiplies. A tensor-core partial that is not
// flushed yet holds products at the old m and is rescaled (rescale_pv).
__device__ __forceinline__ void update_max(ConsumerState& st, float tile_lo, float tile_hi, bool rescale_pv) {
  const float new_lo = fmaxf(st.m_lo, tile_lo);
  const float new_hi = fmaxf(st.m_hi, tile_hi);
  const bool grew = new_lo > st.m_lo || new_hi > st.m_hi;
  if (!__any_sync(0xffffffffu, grew)) return;
  if (rescale_pv)  // exp2(-inf) = 0 cannot occur: a partial exists only after the first tile
    scale_rows(st.pv, fast_exp2((st.m_lo - new_lo) * kMaxToLog2), fast_exp2((st.m_hi - new_hi) * kMaxToLog2));
  st.m_lo = new_lo;
  st.m_hi = new_hi;
  if (st.mo_lo == -INFINITY) st.mo_lo = new_lo;  // first tile: O is still zero
  if (st.mo_hi == -INFINITY) st.mo_hi = new_hi;
  const float gap_lo = (st.m_lo - st.mo_lo) * kMaxToLog2, gap_hi = (st.m_hi - st.mo_hi) * kMaxToLog2;
  if (__any_sync(0xffffffffu, gap_lo > 8.0f || gap_hi > 8.0f)) {
    scale_rows(st.o, fast_exp2(-gap_lo), fast_exp2(-gap_hi));
    st.mo_lo = st.m_lo;
    st.mo_hi = st.m_hi;
  }
}

// Codes of the tile straight into the PV A-operand registers: for key group kb (32 keys), a0/a2 take
// row g's chunks (4kb, 4kb+1)/(4kb+2, 4kb+3) and a1/a3 row g+8's; V's keys are stored permuted
// (kPackedKeyOrder) so this register order is the key order the tensor core expects.
__device__ __forceinline__ void convert_tile(const float (&s)[64], float a, float b_lo, float b_hi, uint32_t (&p)[16]) {
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const int c0 = 4 * (4 * kb + 0), c1 = 4 * (4 * kb + 1), c2 = 4 * (4 * kb + 2), c3 = 4 * (4 * kb + 3);
    p[4 * kb + 0] = pack_codes(expcast_pair(s[c0 + 0], s[c0 + 1], a, b_lo), expcast_pair(s[c1 + 0], s[c1 + 1], a, b_lo));
    p[4 * kb + 1] = pack_codes(expcast_pair(s[c0 + 2], s[c0 + 3], a, b_hi), expcast_pair(s[c1 + 2], s[c1 + 3], a, b_hi));
    p[4 * kb + 2] = pack_codes(expcast_pair(s[c2 + 0], s[c2 + 1], a, b_lo), expcast_pair(s[c3 + 0], s[c3 + 1], a, b_lo));
    p[4 * kb + 3] = pack_codes(expcast_pair(s[c2 + 2], s[c2 + 3], a, b_hi), expcast_pair(s[c3 + 2], s[c3 + 3], a, b_hi));
  }
}

// Codes of a repair tile against the final max: the same FMA with each key's own multiplier
// qscale * descale_k (kd: the tile's 128 per-row descales), then padded rows cleared.
__device__ __forceinline__ void convert_repair_tile(const float (&s)[64], float qscale, const float* kd, int valid,
                                                    float b_lo, float b_hi, int t, uint32_t (&p)[16]) {
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    uint32_t h[4][2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int j = 4 * kb + q;  // 8-column chunk
      const float2 d = __ldg(reinterpret_cast<const float2*>(kd + 8 * j + 2 * t));
      const float a0 = qscale * d.x, a1 = qscale * d.y;
      h[q][0] = expcast_pair2(s[4 * j + 0], s[4 * j + 1], a0, a1, b_lo);
      h[q][1] = expcast_pair2(s[4 * j + 2], s[4 * j + 3], a0, a1, b_hi);
    }
    p[4 * kb + 0] = pack_codes(h[0][0], h[1][0]);
    p[4 * kb + 1] = pack_codes(h[0][1], h[1][1]);
    p[4 * kb + 2] = pack_codes(h[2][0], h[3][0]);
    p[4 * kb + 3] = pack_codes(h[2][1], h[3][1]);
  }
  if (valid < Cfg::kBlockN) mask_codes(p, valid, t);
}

template <int kVariant>
__device__ __forceinline__ void store_output(const ConsumerState& st, const KernelParams& p, const TileCoord& c,
                                             int row_base, int g, int t) {
  constexpr bool kVc = (kVariant & kVcMode) != 0;
  // Every column of the extra chunk is the row sum, so each thread already holds l for its rows
  // (a shuffle of an accumulator register here serializes the wgmma pipeline in ptxas 13.0).
  const float l_lo = st.o[64], l_hi = st.o[66];
  // VC: per-channel descales, applied per column below (the V descale is then 1).
  const float dv = kVc ? 1.0f : p.v_descale[c.b * p.heads + c.h];
  const float* dvc = p.vc_channel_descale + int64_t(c.b * p.heads + c.h) * Cfg::kHeadDim;
  // Fast division and log: an IEEE slow path is a call, which serializes the wgmma pipeline.
  const float s_lo = __fdividef(dv, l_lo), s_hi = __fdividef(dv, l_hi);
  const int r_lo = c.qt * Cfg::kBlockM + row_base + g, r_hi = r_lo + 8;
  __nv_bfloat16* base = p.out + c.b * p.out_stride_b + c.h * p.out_stride_h;
  if (r_lo < p.seqlen_q) {
    __nv_bfloat16* row = base + r_lo * p.out_stride_s;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 w = kVc ? __ldg(reinterpret_cast<const float2*>(dvc + 8 * j + 2 * t)) : make_float2(1.0f, 1.0f);
      *reinterpret_cast<__nv_bfloat162*>(row + 8 * j + 2 * t) =
          __floats2bfloat162_rn(st.o[4 * j + 0] * w.x * s_lo, st.o[4 * j + 1] * w.y * s_lo);
    }
  }
  if (r_hi < p.seqlen_q) {
    __nv_bfloat16* row = base + r_hi * p.out_stride_s;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 w = kVc ? __ldg(reinterpret_cast<const float2*>(dvc + 8 * j + 2 * t)) : make_float2(1.0f, 1.0f);
      *reinterpret_cast<__nv_bfloat162*>(row + 8 * j + 2 * t) =
          __floats2bfloat162_rn(st.o[4 * j + 2] * w.x * s_hi, st.o[4 * j + 3] * w.y * s_hi);
    }
  }
  if (p.lse != nullptr && t == 0) {
    float* lse = p.lse + (int64_t(c.b) * p.heads + c.h) * p.seqlen_q;
    constexpr float kLn2 = 0.69314718055994531f;
    if (r_lo < p.seqlen_q) lse[r_lo] = kLn2 * (st.mo_lo * kMaxToLog2) + __logf(l_lo * (1.0f / 256.0f));
    if (r_hi < p.seqlen_q) lse[r_hi] = kLn2 * (st.mo_hi * kMaxToLog2) + __logf(l_hi * (1.0f / 256.0f));
  }
}

// Tile max of S (already waited for) in scaled code units.
template <int kVariant, bool kMaybePartial = true>
__device__ __forceinline__ void tile_max(const float (&s)[64], float a, int valid, int t, bool first, float& lo,
                                         float& hi) {
  if ((kVariant & kSkipMax) && !first) {
    lo = hi = -INFINITY;
    return;
  }
  constexpr bool kBits = (kVariant & kFloatMax) == 0;
  if (kMaybePartial && valid < Cfg::kBlockN) row_max<true, kBits>(s, valid, t, lo, hi);
  else row_max<false, kBits>(s, valid, t, lo, hi);
  if (kVariant & kDoubleMax) {
    float lo2, hi2;
    row_max<false, kBits>(s, valid, t, lo2, hi2);
    lo = fmaxf(lo, lo2 * 0.5f);
    hi = fmaxf(hi, hi2 * 0.5f);
  }
  lo *= a;
  hi *= a;
}

// Conversion of the tile against the updated maxima, then the masked keys' codes cleared.
template <int kVariant, bool kMaybePartial = true>
__device__ __forceinline__ void convert_step(ConsumerState& st, const float (&s)[64], float a, int valid, int t,
                                             bool first) {
  if ((kVariant & kSkipConvert) && !first) return;
  convert_tile(s, a, expcast_addend(st.m_lo), expcast_addend(st.m_hi), st.p);
  if (kVariant & kDoubleConvert) {
    uint32_t p2[16];
    convert_tile(s, a * 0.5f, expcast_addend(st.m_lo), expcast_addend(st.m_hi), p2);
#pragma unroll
    for (int i = 0; i < 16; ++i) st.p[i] ^= p2[i] & 0x01010101u;
  }
  if (kMaybePartial && valid < Cfg::kBlockN) mask_codes(st.p, valid, t);
}

// kGroup consecutive full blocks through the consumer's step (kernel.cuh, consumer_loop): none may be
// the partial block, and only the group's last one flushes (unless kNeverFlush).
template <int kGroup, bool kNeverFlush, class Step, size_t... J>
__device__ __forceinline__ void step_group_impl(Step& step, int i, std::index_sequence<J...>) {
  (step(i + int(J), std::false_type{},
        std::integral_constant<int, (!kNeverFlush && int(J) + 1 == kGroup) ? 1 : 0>{}),
   ...);
}
template <int kGroup, bool kNeverFlush, class Step>
__device__ __forceinline__ void step_group(Step& step, int i) {
  step_group_impl<kGroup, kNeverFlush>(step, i, std::make_index_sequence<kGroup>{});
}

template <int kVariant>
__device__ __forceinline__ void consumer_loop(SharedStorage& sh, const KernelParams& p, int wg) {
  constexpr bool kRepair = (kVariant & kWithRepair) != 0;
  const int lane = threadIdx.x & 31;
  const int warp_in_wg = (threadIdx.x / 32) & 3;
  const int g = lane >> 2, t = lane & 3;
  const int row_base = 64 * wg + 16 * warp_in_wg;
  // Ping-pong: warpgroup wg issues its tensor-core work after the other one has issued its own.
  // Measured 1-3% slower than letting both issue freely once the row max was cheap, so it is a variant.
  const int my_bar = 1 + wg, other_bar = 2 - wg;
  constexpr int kPair = 2 * 128;
  constexpr bool kOrdered = (kVariant & kPingPong) != 0;
  if (wg == 1 && kOrdered) named_barrier_arrive(1, kPair);  // the first consumer goes first

  const uint64_t desc_q = sw128_kmajor_desc(sh.q + 64 * wg * Cfg::kHeadDim);
  RingState ring;
  int iter = 0;
  for (int tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x, ++iter) {
    const TileCoord c = decode_tile(tile, p);
    const KeyOrder order = tile_key_order(c, p);
    const float qscale = p.qk_multiplier * p.q_descale[(c.b * p.heads + c.h) * p.num_q_tiles + c.qt];
    const float* kd = p.k_descale + (c.b * p.heads + c.h) * p.num_k_blocks;
    ConsumerState st;
#pragma unroll
    for (int i = 0; i < 68; ++i) st.o[i] = 0.0f;
    st.m_lo = st.m_hi = st.mo_lo = st.mo_hi = -INFINITY;
    float s[64];
    TxBarrier::wait(&sh.q_full, iter & 1);

    const int n = p.num_k_blocks;
    // First block: QK^T only (the peeled iteration keeps the steady-state loop free of branches
    // around the asynchronous tensor-core work).
    int blk = order(0);
    TxBarrier::wait(&sh.k_full[ring.stage], ring.phase);
    if (kOrdered) named_barrier_sync(my_bar, kPair);
    issue_qk(desc_q, sw128_kmajor_desc(sh.k[ring.stage]), s);
    if (kOrdered) named_barrier_arrive(other_bar, kPair);
    cute::warpgroup_wait<0>();
    fence_regs(s);
    release(&sh.k_empty[ring.stage]);
    if (n == 1 && !kRepair) release(&sh.q_empty);
    {
      const float a = qscale * kd[blk];
      const int valid = p.seqlen_k - blk * Cfg::kBlockN;
      float t_lo, t_hi;
      tile_max<kVariant>(s, a, valid, t, true, t_lo, t_hi);
      update_max(st, t_lo, t_hi, false);
      convert_step<kVariant>(st, s, a, valid, t, true);
    }
    RingState prev = ring;
    ring.advance();
    bool pv_fresh = true;  // the next PV starts a new tensor-core accumulator
    // Each block's K descale is loaded one iteration ahead, so no load latency sits between the
    // QK^T wait and the conversion.
    float kd_next = n > 1 ? __ldg(kd + order(1)) : 0.0f;

    // Issue of one key block: QK^T of the ring's current K tile and PV of the previous tile's codes,
    // then the wait for QK^T (PV keeps running). Shared by the original and the repair blocks.
    auto issue_block = [&](bool last) {
      TxBarrier::wait(&sh.k_full[ring.stage], ring.phase);
      if (kOrdered) named_barrier_sync(my_bar, kPair);
      issue_qk(desc_q, sw128_kmajor_desc(sh.k[ring.stage]), s);
      TxBarrier::wait(&sh.v_full[prev.stage], prev.phase);
      issue_pv(st.p, sw128_kmajor_desc(sh.v[prev.stage]), st.pv, pv_fresh);
      if (kOrdered) named_barrier_arrive(other_bar, kPair);
      cute::warpgroup_wait<1>();
      fence_regs(s);
      release(&sh.k_empty[ring.stage]);
      if (last) release(&sh.q_empty);  // the Q tile is read for the last time
    };
    // One key block of the steady state, specialized so that the common block carries no test for
    // the partial block or the flush period: kMaybePartial (a bool_constant) is false for blocks that
    // cannot be the partial last one, which is only ever visited first (the peeled step above) or last
    // (numerics section 5); kFlush is 0 (never), 1 (always) or 2 (decided from i). Branches split the
    // code ptxas schedules: the general step for every block measured 7% slower (kGeneralLoop).
    auto step = [&](int i, auto maybe_partial, auto flush_kind) {
      constexpr bool kMaybePartial = decltype(maybe_partial)::value;
      constexpr int kFlush = decltype(flush_kind)::value;
      blk = order(i);
      const float kd_blk = kd_next;
      if (!kMaybePartial || i + 1 < n) kd_next = __ldg(kd + order(i + 1));
      issue_block(kMaybePartial && i == n - 1 && !kRepair);
      // a' = 2^-24 * 8 log2e tau dq dk in the reference's operation order (numerics section 3).
      const float a = qscale * kd_blk;
      const int valid = kMaybePartial ? p.seqlen_k - blk * Cfg::kBlockN : Cfg::kBlockN;
      float t_lo, t_hi;
      tile_max<kVariant, kMaybePartial>(s, a, valid, t, false, t_lo, t_hi);
      cute::warpgroup_wait<0>();
      fence_regs(st.pv);
      if constexpr (!(kVariant & kVcMode)) release(&sh.v_empty[prev.stage]);
      // Flush the tensor-core partial every kFlushTiles tiles (uniform over the warpgroup, since the
      // next PV's zero-init flag is a warpgroup-wide operand).
      const bool flush = kFlush == 2 ? !(kVariant & kSkipAccumulate) && (i % flush_tiles<kVariant>() == 0) : kFlush == 1;
      if (flush) flush_partial<kVariant>(st, sh, prev.stage, t);
      if constexpr ((kVariant & kVcMode) != 0) release(&sh.v_empty[prev.stage]);  // after the mean is read
      pv_fresh = flush;
      update_max(st, t_lo, t_hi, !flush);
      convert_step<kVariant, kMaybePartial>(st, s, a, valid, t, false);
      prev = ring;
      ring.advance();
    };
    int i = 1;
    // Blocks 1 .. n-2 in groups of the flush period (a flush after the tile whose index is a multiple
    // of it, i.e. the group's last), then the remaining ones and the last block with the general step.
    if constexpr ((kVariant & kGeneralLoop) == 0) {
      constexpr bool kNeverFlush = (kVariant & kSkipAccumulate) != 0;
      constexpr int kGroup = kNeverFlush ? 1 : flush_tiles<kVariant>();
      for (; i + kGroup - 1 <= n - 2; i += kGroup) step_group<kGroup, kNeverFlush>(step, i);
    }
    for (; i < n; ++i) step(i, std::true_type{}, std::integral_constant<int, 2>{});
    // Repair tiles (numerics section 6): the same pipeline, no max update (a repair key repeats an
    // original key's score, which the max already covers), codes against the final max with each
    // key's own descale, numerator only. The first PV here is the last original tile's.
    const float* kd_rep = p.repair_k_descale + int64_t(c.b * p.heads + c.h) * p.repair_tiles * Cfg::kBlockN;
    for (int r = 0; kRepair && r < p.repair_tiles; ++r) {
      issue_block(r == p.repair_tiles - 1);
      cute::warpgroup_wait<0>();
      fence_regs(st.pv);
      release(&sh.v_empty[prev.stage]);
      if (r == 0) accumulate_tile(st);
      else accumulate_numerator(st);
      pv_fresh = true;
      convert_repair_tile(s, qscale, kd_rep + r * Cfg::kBlockN, p.repair_rows - r * Cfg::kBlockN,
                          expcast_addend(st.m_lo), expcast_addend(st.m_hi), t, st.p);
      prev = ring;
      ring.advance();
    }
    // The last tile's PV.
    TxBarrier::wait(&sh.v_full[prev.stage], prev.phase);
    if (kOrdered) named_barrier_sync(my_bar, kPair);
    issue_pv(st.p, sw128_kmajor_desc(sh.v[prev.stage]), st.pv, pv_fresh);
    if (kOrdered) named_barrier_arrive(other_bar, kPair);
    cute::warpgroup_wait<0>();
    fence_regs(st.pv);
    if constexpr (!(kVariant & kVcMode)) release(&sh.v_empty[prev.stage]);
    if constexpr (kRepair) accumulate_numerator(st);
    else flush_partial<kVariant>(st, sh, prev.stage, t);
    if constexpr ((kVariant & kVcMode) != 0) release(&sh.v_empty[prev.stage]);
    store_output<kVariant>(st, p, c, row_base, g, t);
  }
}

template <int kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    expcast_attention_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                             const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_krep,
                             const __grid_constant__ CUtensorMap tm_vrep, const __grid_constant__ KernelParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  SharedStorage& sh = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    TxBarrier::init(&sh.q_full, 1);
    Barrier::init(&sh.q_empty, kConsumerWarps);
    for (int s = 0; s < Cfg::kStages; ++s) {
      TxBarrier::init(&sh.k_full[s], 1);
      Barrier::init(&sh.k_empty[s], kConsumerWarps);
      TxBarrier::init(&sh.v_full[s], 1);
      Barrier::init(&sh.v_empty[s], kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  // The 8 row-sum rows under every V stage, all E4M3 1.0 (0x38): every column of the extra accumulator
  // chunk is then the row sum. Uniform rows are invariant under the 128-byte swizzle, so plain stores
  // give the layout the tensor core reads.
  for (int idx = threadIdx.x; idx < Cfg::kStages * 8 * Cfg::kBlockN / 4; idx += blockDim.x) {
    const int stage = idx / (8 * Cfg::kBlockN / 4), word = idx % (8 * Cfg::kBlockN / 4);
    reinterpret_cast<uint32_t*>(sh.v[stage] + Cfg::kTileBytes)[word] = 0x38383838u;
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) producer_loop<kVariant>(sh, p, &tm_q, &tm_k, &tm_v, &tm_krep, &tm_vrep);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    // A warp-uniform warpgroup index (broadcast from lane 0) lets the compiler keep the Q descriptor
    // and the barrier ids in uniform registers instead of recomputing them every tile.
    consumer_loop<kVariant>(sh, p, __shfl_sync(0xffffffffu, warpgroup - 1, 0));
  }
}

}  // namespace openvc::sm90
