// The sm_90a ExpCast attention kernel: one producer warpgroup (TMA, registers handed back) and two
// consumer warpgroups (QK^T and PV on the tensor cores, ExpCast in between), persistent over
// (sequence, head, 128-row query tile), or (kSplitTilesMode) over ranges of their key blocks. Arithmetic:
// docs/numerics.md sections 2-5, 9 (INT8 Q/K) and 10 (exp2 P). Template arguments: the production Mode bits
// (mode.h: plain, repair, VC, causal, varlen, head dim 64, INT8 Q/K, exp2 P, key block lists, Q quantized here,
// few keys, split tiles; the combinations built are kProductionModes) and a timing Probe
// (probes.h, bench only; kNoProbe in the library).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "attention/sm90/config.h"
#include "attention/sm90/descales.cuh"
#include "attention/sm90/expcast.cuh"
#include "attention/sm90/fused_q.cuh"
#include "attention/sm90/gmma.cuh"
#include "attention/sm90/kernel_params.h"
#include "attention/sm90/mode.h"
#include "attention/sm90/pipeline.cuh"
#include "attention/sm90/probe_spare_quantize.cuh"
#include "attention/sm90/probes.h"
#include "attention/sm90/row_max.cuh"
#include "attention/sm90/softmax.cuh"
#include "attention/sm90/split.cuh"
#include "attention/sm90/tiles.cuh"
#include "attention/sm90/traversal.h"
#include "common/pdl.cuh"

namespace openvc::sm90 {

// One lane per consumer warp frees a buffer once the whole warp is past its last read of it.
__device__ __forceinline__ void release(uint64_t* bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) Barrier::arrive(bar);
}

// Flush of the tensor-core partial into the FP32 accumulator, in the kernel's mode.
// dv: kVBlockDescaleMode, the V descale of the tile whose product is flushed (one tile per flush there).
template <int kMode>
__device__ __forceinline__ void flush_partial(ConsumerState<ModeConfig<kMode>::kHeadDim>& st,
                                              const SharedStorage<kMode>& sh, int stage, int t, float dv) {
  if constexpr (has_mode<kMode>(kVcMode)) accumulate_tile_vc(st, sh.vc_mean[stage], t);
  else if constexpr (has_mode<kMode>(kVBlockDescaleMode)) accumulate_tile<false, false, true>(st, dv);
  else accumulate_tile<false, has_mode<kMode>(kCausalMode)>(st);
}

// Two outputs of a row as one 32-bit word, BF16 or FP16.
__device__ __forceinline__ uint32_t pack_pair(bool fp16, float x, float y) {
  if (fp16) {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  const __nv_bfloat162 b = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// One 16-byte global store (a plain uint4 store was split into four 32-bit ones for the first chunk group).
__device__ __forceinline__ void store_16b(void* dst, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// A 4 x 4 transpose of 32-bit words across the four lanes of a quad (two butterfly rounds of two shuffles):
// lane t holds w[k] = the pair t of chunk k (columns 8k + 2t, +1 of four 8-column chunks) and gets chunk t's
// four pairs, its 8 contiguous columns. Every lane of the warp must call it.
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&w)[4], int t) {
  constexpr unsigned kAll = 0xffffffffu;
  uint32_t a0 = w[0], a1 = w[1], a2 = w[2], a3 = w[3];
  const bool up2 = (t & 2) != 0, up1 = (t & 1) != 0;
  // lanes t and t ^ 2 swap the off-diagonal 2 x 2 blocks
  uint32_t r0 = __shfl_xor_sync(kAll, up2 ? a0 : a2, 2), r1 = __shfl_xor_sync(kAll, up2 ? a1 : a3, 2);
  if (up2) a0 = r0, a1 = r1;
  else a2 = r0, a3 = r1;
  // lanes t and t ^ 1 transpose each 2 x 2 block
  r0 = __shfl_xor_sync(kAll, up1 ? a0 : a1, 1), r1 = __shfl_xor_sync(kAll, up1 ? a2 : a3, 1);
  if (up1) a0 = r0, a2 = r1;
  else a1 = r0, a3 = r1;
  return make_uint4(a0, a1, a2, a3);
}

// Output of one tile: O / l in BF16 and the LSE. kNoKeys: the tile has no visible key (output 0,
// lse -inf). Rows past the sequence are never stored.
template <int kMode, bool kNoKeys = false>
__device__ __forceinline__ void store_output(const ConsumerState<ModeConfig<kMode>::kHeadDim>& st,
                                             const KernelParams& p, const TileWork& w, int row_base, int g, int t) {
  using C = ModeConfig<kMode>;
  constexpr int kL = C::kHeadDim / 2;  // the row sum's registers: o[kL..kL+1] row g, o[kL+2..kL+3] row g+8
  constexpr bool kVc = has_mode<kMode>(kVcMode), kVarlen = has_mode<kMode>(kVarlenMode);
  constexpr bool kEmptyRows = has_mode<kMode>(kCausalMode) || kNoKeys;  // rows that saw no key: l = 0
  const TileCoord& c = w.c;
  // Every column of the extra chunk is the row sum, so each thread already holds l for its rows
  // (a shuffle of an accumulator register here serializes the wgmma pipeline in ptxas 13.0).
  const float l_lo = kNoKeys ? 0.0f : st.o[kL], l_hi = kNoKeys ? 0.0f : st.o[kL + 2];
  // VC: per-channel descales, applied per column below (the V descale is then 1).
  // V block descales (kVBlockDescaleMode) were applied as the tiles were accumulated.
  const float dv =
      kVc || kNoKeys || has_mode<kMode>(kVBlockDescaleMode) ? 1.0f : p.v_descale[c.b * p.kv_heads + kv_head(p, c.h)];
  const float* dvc = p.vc_channel_descale + int64_t(c.b * p.heads + c.h) * C::kHeadDim;
  // Fast division and log: an IEEE slow path is a call, which serializes the wgmma pipeline.
  float s_lo = __fdividef(dv, l_lo), s_hi = __fdividef(dv, l_hi);
  if (kEmptyRows) s_lo = l_lo > 0.0f ? s_lo : 0.0f, s_hi = l_hi > 0.0f ? s_hi : 0.0f;
  auto o_val = [&](int i) { return kNoKeys ? 0.0f : st.o[i]; };
  // V rounding bias (kVBiasMode, numerics section 4): v_bias per channel on rows that saw a key. Its own
  // instantiations, so that the other modes keep their epilogue (and -0 outputs stay -0 there).
  constexpr bool bias = has_mode<kMode>(kVBiasMode) && !kVc && !kNoKeys;
  const float* vb = bias ? p.v_bias + (int64_t(c.b) * p.kv_heads + kv_head(p, c.h)) * C::kHeadDim : nullptr;
  const bool b_lo = !kEmptyRows || l_lo > 0.0f, b_hi = !kEmptyRows || l_hi > 0.0f;
  auto bias_pair = [&](int j) { return __ldg(reinterpret_cast<const float2*>(vb + 8 * j + 2 * t)); };
  auto out_val = [&](float o, float wc, float scale, float bv, bool row_bias) {
    return bias && row_bias ? __fmaf_rn(o * wc, scale, bv) : o * wc * scale;
  };
  const int r_lo = c.qt * kBlockM + row_base + g, r_hi = r_lo + 8;
  const int sq = w.sq;
  __nv_bfloat16* base = p.out + c.b * p.out_stride_b + c.h * p.out_stride_h + int64_t(w.q_out0) * p.out_stride_s;
  const bool fp16 = p.out_fp16;   // a uniform epilogue branch: out_dtype
  static_assert(C::kOutChunks % 4 == 0, "the 16-byte stores take the row's chunks four at a time");
  if (p.out_vec16) {
    // 16-byte stores: each quad's lanes trade their pairs so that lane t holds 8 contiguous outputs (chunk
    // 4q + t of the row). Two outputs per store left half of every 32-byte sector to the next store (49% of
    // the L2 sectors excessive in the 512-key cross-attention profile) and throttled the epilogue.
    __nv_bfloat16* row_lo = base + r_lo * p.out_stride_s;
    __nv_bfloat16* row_hi = base + r_hi * p.out_stride_s;
#pragma unroll
    for (int q = 0; q < C::kOutChunks / 4; ++q) {
      uint32_t lo[4], hi[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int j = 4 * q + k;
        const float2 wc = kVc ? __ldg(reinterpret_cast<const float2*>(dvc + 8 * j + 2 * t)) : make_float2(1.0f, 1.0f);
        const float2 bs = bias ? bias_pair(j) : make_float2(0.0f, 0.0f);
        lo[k] = pack_pair(fp16, out_val(o_val(4 * j + 0), wc.x, s_lo, bs.x, b_lo), out_val(o_val(4 * j + 1), wc.y, s_lo, bs.y, b_lo));
        hi[k] = pack_pair(fp16, out_val(o_val(4 * j + 2), wc.x, s_hi, bs.x, b_hi), out_val(o_val(4 * j + 3), wc.y, s_hi, bs.y, b_hi));
      }
      // the shuffles run on every lane (a quad shares its row, so its lanes agree on the bounds below)
      const uint4 vlo = quad_transpose(lo, t), vhi = quad_transpose(hi, t);
      if (r_lo < sq) store_16b(row_lo + 8 * (4 * q + t), vlo);
      if (r_hi < sq) store_16b(row_hi + 8 * (4 * q + t), vhi);
    }
  } else {
    if (r_lo < sq) {
      __nv_bfloat16* row = base + r_lo * p.out_stride_s;
#pragma unroll
      for (int j = 0; j < C::kOutChunks; ++j) {
        const float2 wc = kVc ? __ldg(reinterpret_cast<const float2*>(dvc + 8 * j + 2 * t)) : make_float2(1.0f, 1.0f);
        const float2 bs = bias ? bias_pair(j) : make_float2(0.0f, 0.0f);
        *reinterpret_cast<uint32_t*>(row + 8 * j + 2 * t) =
            pack_pair(fp16, out_val(o_val(4 * j + 0), wc.x, s_lo, bs.x, b_lo), out_val(o_val(4 * j + 1), wc.y, s_lo, bs.y, b_lo));
      }
    }
    if (r_hi < sq) {
      __nv_bfloat16* row = base + r_hi * p.out_stride_s;
#pragma unroll
      for (int j = 0; j < C::kOutChunks; ++j) {
        const float2 wc = kVc ? __ldg(reinterpret_cast<const float2*>(dvc + 8 * j + 2 * t)) : make_float2(1.0f, 1.0f);
        const float2 bs = bias ? bias_pair(j) : make_float2(0.0f, 0.0f);
        *reinterpret_cast<uint32_t*>(row + 8 * j + 2 * t) =
            pack_pair(fp16, out_val(o_val(4 * j + 2), wc.x, s_hi, bs.x, b_hi), out_val(o_val(4 * j + 3), wc.y, s_hi, bs.y, b_hi));
      }
    }
  }
  if (p.lse != nullptr && t == 0) {
    float* lse = kVarlen ? p.lse + c.b * p.lse_stride_s + c.h * p.lse_stride_h + w.q_out0
                         : p.lse + (int64_t(c.b) * p.heads + c.h) * p.seqlen_q;
    constexpr float kLn2 = 0.69314718055994531f;
    // A row that saw no key: mo = -inf and l = 0 give -inf (no NaN: both terms are -inf).
    if (r_lo < sq) lse[r_lo] = kNoKeys ? -INFINITY : kLn2 * (st.mo_lo * kMaxToLog2) + __logf(l_lo * (1.0f / 256.0f));
    if (r_hi < sq) lse[r_hi] = kNoKeys ? -INFINITY : kLn2 * (st.mo_hi * kMaxToLog2) + __logf(l_hi * (1.0f / 256.0f));
  }
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

// Ping-pong: warpgroup wg issues its tensor-core work after the other one has issued its own. The few-keys
// mode's order (tiles of at most kFewKeyBlocks key blocks, kFewKeyBlocksFusedQ with Q quantized here, whose tile
// boundary is a large part of their time: one warpgroup's softmax and epilogue then run under the other's products);
// elsewhere measured 1-3% slower than letting both issue freely once the row max was cheap, so there it is a probe
// (kPingPong).
template <bool kOn>
struct IssueOrder {
  int mine, other;
  static constexpr int kPair = 2 * 128;
  __device__ __forceinline__ explicit IssueOrder(int wg) : mine(1 + wg), other(2 - wg) {
    if (kOn && wg == 1) named_barrier_arrive(1, kPair);  // the first consumer goes first
  }
  __device__ __forceinline__ void before() const {
    if (kOn) named_barrier_sync(mine, kPair);
  }
  __device__ __forceinline__ void after() const {
    if (kOn) named_barrier_arrive(other, kPair);
  }
};

template <int kMode, int kProbe>
__device__ __forceinline__ void consumer_loop(SharedStorage<kMode>& sh, const KernelParams& p, const TileSpace& ts,
                                              int wg) {
  constexpr bool kRepair = has_mode<kMode>(kRepairMode);
  constexpr bool kVc = has_mode<kMode>(kVcMode);
  constexpr bool kCausal = has_mode<kMode>(kCausalMode);
  constexpr bool kChunked = has_mode<kMode>(kChunkedCausalMode);   // causal_chunk > 1
  constexpr bool kInt8 = has_mode<kMode>(kInt8QkMode);
  constexpr bool kExp2 = has_mode<kMode>(kExp2PMode);   // P format exp2 (INT8 only)
  constexpr bool kVScale = has_mode<kMode>(kVBlockDescaleMode);   // V descale per key block
  constexpr bool kFlushEach = kVc;   // every tile's product flushed on its own (VC: each block's mean)
  constexpr bool kFusedQ = has_mode<kMode>(kFusedQMode);   // Q quantized here (fused_q.cuh)
  constexpr bool kFewKeys = has_mode<kMode>(kFewKeysMode);   // consumers in ping-pong (mode.h)
  // Q's codes in registers for the tile (QK^T with A from registers) in the plain and fused-Q plain modes: no Q read
  // from shared memory per key block (0.6-1.6% faster at the power-capped dense shapes, docs/performance.md);
  // probe kQFromSharedMemory: the operand as before.
  // Not with split tiles: there ptxas spilled 252 bytes, in the steady loop too (the parts' exchange at a piece's end
  // needs the registers), where the operand in shared memory leaves 68 bytes outside it.
  constexpr bool kQRegs = (kMode == kPlainMode || kMode == kFusedQMode) && !(kProbe & kQFromSharedMemory);
  const int lane = threadIdx.x & 31;
  const int warp_in_wg = (threadIdx.x / 32) & 3;
  const int g = lane >> 2, t = lane & 3;
  const int row_base = 64 * wg + 16 * warp_in_wg;
  const IssueOrder<kFewKeys || (kProbe & kPingPong) != 0> issue_order(wg);

  using C = ModeConfig<kMode>;
  constexpr int kD = C::kHeadDim;
  const uint64_t desc_q = sw_kmajor_desc<C::kRowBytes>(sh.q + 64 * wg * kD);
  RingState<C::kStages> ring;
  int iter = 0;
  // kSplit: `tile` is a cursor over this CTA's whole head tiles, then its range of tail units (split.cuh).
  constexpr bool kSplit = has_mode<kMode>(kSplitTilesMode);
  const int split_end = kSplit ? split_stop(p) : 0;
  int next_piece = 0;
  for (int tile = kSplit ? split_start(p) : first_work<kMode>(p, ts);
       kSplit ? tile < split_end : tile < ts.count; tile = kSplit ? next_piece : next_work<kMode>(tile, p, ts)) {
    TileSegment seg{};
    if constexpr (kSplit) seg = split_segment(p, tile, split_end), next_piece = seg.next;
    const TileWork w = kSplit ? piece_work<kMode>(seg.tile, seg.first, seg.count, p, ts) : uniform_tile_work<kMode>(tile, p, ts);
    const TileCoord& c = w.c;
    const int n = w.n;
    const int first = kSplit ? w.first : 0;   // the order position of step 0
    // The tile's visiting order of key blocks (block lists: of list positions, which consumer_block maps to
    // blocks). A reference and a pointer, not a lambda capturing the tile: with the lambda, ptxas laid out the
    // modes without lists differently from before the lists existed (same speed, other SASS).
    const KeyOrder& order = w.order;
    // The tile's Q descale(s), loaded here. E4M3 (one per tile) becomes the multiplier only once the first QK^T
    // is issued: multiplied here, every tile's first QK^T waited for the load (Nsight Compute, 256 keys, prepared
    // Q: that multiply held 4% of the stall samples; moved, the kernel is 0.3-1.4% faster at 256-512 keys). INT8
    // (two per-row loads) keeps the multiply here: moved, ptxas scheduled the head-dim-64 exp2 loop 0.9% slower.
    // kFusedQ: the descale comes from the quantization below.
    using QDescale = decltype(q_descales<kMode>(p, c, 0));
    constexpr bool kLateQScale = !kFusedQ && !kInt8;
    const QDescale dq_tile = kFusedQ ? QDescale{} : q_descales<kMode>(p, c, row_base + g);
    QDescale qscale = kFusedQ || kLateQScale ? QDescale{} : q_multiplier(p, dq_tile);
    const float* kd = k_descales<kInt8>(p, c);
    // kVScale: the (b, h)'s V block descales and the one of the block whose codes st.p holds (its PV product
    // is flushed one step later).
    const float* vd = kVScale ? p.v_descale + (int64_t(c.b) * p.kv_heads + kv_head(p, c.h)) * p.num_k_blocks : nullptr;
    float dv_p = 1.0f;
    // Keys that rows g and g+8 see (causal: up to the diagonal), and the fewest any row of the tile
    // sees: a block at or past that one needs the masked path (a CTA-uniform decision).
    int vis_lo = w.sk, vis_hi = w.sk, vis_first = w.sk;
    if constexpr (kChunked) {   // the rows' key limits, non-decreasing in the row
      const int r_lo = c.qt * kBlockM + row_base + g;
      vis_lo = causal_key_limit(r_lo, w.sq, w.sk, p.causal_chunk);
      vis_hi = causal_key_limit(r_lo + 8, w.sq, w.sk, p.causal_chunk);
      vis_first = causal_key_limit(c.qt * kBlockM, w.sq, w.sk, p.causal_chunk);
    } else if constexpr (kCausal) {   // causal_key_limit with chunk 1
      const int shift = w.sk - w.sq + 1, r_lo = c.qt * kBlockM + row_base + g;
      vis_lo = min(r_lo + shift, w.sk), vis_hi = min(r_lo + 8 + shift, w.sk);
      vis_first = min(c.qt * kBlockM + shift, w.sk);
    }
    auto mask_of = [&](int blk) {
      const int k0 = blk * kBlockN;
      return BlockMask{vis_lo - k0, vis_hi - k0, vis_first - k0 < kBlockN};
    };
    ConsumerState<kD> st;
#pragma unroll
    for (int i = 0; i < C::kAccRegs; ++i) st.o[i] = 0.0f;
    st.m_lo = st.m_hi = st.mo_lo = st.mo_hi = -INFINITY;
    float s[64];
    TxBarrier::wait(&sh.q_full, iter & 1);
    ++iter;
    if constexpr (kFusedQ) {
      // Packed: the tile's rows in its sequence (TileWork::n >= 0, so at least one); the rest are another's.
      constexpr bool kMaskRows = has_mode<kMode>(kVarlenMode);
      const int rows = w.sq - c.qt * kBlockM, ct = threadIdx.x - 128;
      const float dq = p.q_fp16 ? quantize_q_tile<kD, prepare::F16, kMaskRows>(sh.q_stage, sh.q, sh.q_amax, ct, rows)
                                : quantize_q_tile<kD, prepare::Bf16, kMaskRows>(sh.q_stage, sh.q, sh.q_amax, ct, rows);
      release(&sh.q_empty);   // the rows are read: the producer may bring the next tile's
      if (iter == 1 && p.q_before_prior_grid) wait_for_prior_grid();   // before the descales (the kernel's start)
      qscale = q_multiplier(p, dq);
    }

    // kQRegs: Q's A fragments, read once; the tile is then free (prepared Q: for the producer's next tile; the fused
    // quantization's barriers already order its next write).
    uint32_t q_regs[kQRegs ? kD / 8 : 1];
    if constexpr (kQRegs) {
      load_q_fragments<kD>(sh.q, row_base + g, t, q_regs);
      if constexpr (!kFusedQ) release(&sh.q_empty);
    }
    // First block: QK^T only (the peeled iteration keeps the steady-state loop free of branches
    // around the asynchronous tensor-core work).
    int blk = consumer_block<kMode>(w.blocks, order(first), p.num_k_blocks);
    TxBarrier::wait(&sh.k_full[ring.stage], ring.phase);
    issue_order.before();
    if constexpr (kQRegs) issue_qk_rs<kD>(q_regs, sw_kmajor_desc<C::kRowBytes>(sh.k[ring.stage]), s);
    else issue_qk<kD, kInt8>(desc_q, sw_kmajor_desc<C::kRowBytes>(sh.k[ring.stage]), s);
    issue_order.after();
    if constexpr (kLateQScale) qscale = q_multiplier(p, dq_tile);
    // Tiles that may hold huge scores (never real data) take the clipped conversion and the general
    // step for every block (measured: an inline guard in the steady state cost 3%). Decided while the
    // first QK^T runs: before it, the wait for the Q descale and the descale scan sat in every tile's start.
    float huge_qscale;   // the same in the warpgroup's four warps (tile_may_be_huge)
    if constexpr (kInt8) huge_qscale = warpgroup_max_q_multiplier<kMode>(p, c, 64 * wg);
    else huge_qscale = qscale;
    const bool clip = !(kProbe & kNoHugeGuard) && tile_may_be_huge<kInt8>(huge_qscale, kd, p.num_k_blocks);
    cute::warpgroup_wait<0>();
    fence_regs(s);
    release(&sh.k_empty[ring.stage]);
    if (n == 1 && !kRepair && !kFusedQ && !kQRegs) release(&sh.q_empty);
    {
      const auto a = qscale * block_k_descale<kInt8>(kd, blk, t);
      const BlockMask mask = mask_of(blk);
      float t_lo, t_hi;
      tile_max<kProbe>(s, a, mask, t, true, t_lo, t_hi);
      update_max<kCausal>(st, t_lo, t_hi, false);
      convert_step<kProbe, true, kExp2>(st, s, a, mask, t, true, clip);
      if constexpr (kVScale) dv_p = __ldg(vd + blk);
    }
    RingState<C::kStages> prev = ring;
    ring.advance();
    bool pv_fresh = true;  // the next PV starts a new tensor-core accumulator
    // Each block's K descale is loaded one iteration ahead, so no load latency sits between the
    // QK^T wait and the conversion.
    // INT8: this thread's two key-group descales (groups t and t + 4) of the block.
    using KDescale = std::conditional_t<kInt8, KGroupPair, float>;
    KDescale kd_next =
        n > 1 ? prefetch_k_descale<kInt8>(kd, consumer_block<kMode>(w.blocks, order(first + 1), p.num_k_blocks), t)
              : KDescale{};

    // Issue of one key block: QK^T of the ring's current K tile and PV of the previous tile's codes,
    // then the wait for QK^T (PV keeps running). Shared by the original and the repair blocks.
    auto issue_block = [&](bool last) {
      TxBarrier::wait(&sh.k_full[ring.stage], ring.phase);
      issue_order.before();
      if constexpr (kQRegs) issue_qk_rs<kD>(q_regs, sw_kmajor_desc<C::kRowBytes>(sh.k[ring.stage]), s);
      else issue_qk<kD, kInt8>(desc_q, sw_kmajor_desc<C::kRowBytes>(sh.k[ring.stage]), s);
      TxBarrier::wait(&sh.v_full[prev.stage], prev.phase);
      issue_pv<kD>(st.p, sw_kmajor_desc(sh.v[prev.stage]), st.pv, pv_fresh);
      issue_order.after();
      cute::warpgroup_wait<1>();
      fence_regs(s);
      release(&sh.k_empty[ring.stage]);
      if (last && !kFusedQ && !kQRegs) release(&sh.q_empty);  // the Q tile is read for the last time
    };
    // One key block of the steady state, specialized so that the common block carries no test for
    // the partial block or the flush period: kMaybePartial (a bool_constant) is false for blocks that
    // need no mask — in natural or mid-window order the partial last block is only ever visited
    // first (the peeled step above) or last (numerics section 5); causal visits its (at most two)
    // masked blocks first — and kFlush is 0 (never), 1 (always) or 2 (decided from i). Branches split
    // the code ptxas schedules: the general step for every block measured 7% slower (kGeneralLoop).
    auto step = [&](int i, auto maybe_partial, auto flush_kind) {
      constexpr bool kMaybePartial = decltype(maybe_partial)::value;
      constexpr int kFlush = decltype(flush_kind)::value;
      // Causal full steps run to the last block, so they test for it (and for the prefetch bound).
      constexpr bool kMaybeLast = kMaybePartial || kCausal;
      blk = consumer_block<kMode>(w.blocks, order(first + i), p.num_k_blocks);
      const float dv_blk = kVScale ? __ldg(vd + blk) : 1.0f;
      const KDescale kd_blk = kd_next;
      if (!kMaybeLast || i + 1 < n)
        kd_next = prefetch_k_descale<kInt8>(kd, consumer_block<kMode>(w.blocks, order(first + i + 1), p.num_k_blocks), t);
      issue_block(kMaybeLast && i == n - 1 && !kRepair);
      // a' = 2^-24 * 8 log2e tau dq dk in the reference's operation order (numerics section 3; INT8:
      // ((qk_multiplier * dq_row) * dk_group), one per row and half, section 9).
      const auto a = qscale * kd_blk;
      const BlockMask mask = kMaybePartial ? mask_of(blk) : BlockMask{kBlockN, kBlockN, false};
      float t_lo, t_hi;
      tile_max<kProbe, kMaybePartial>(s, a, mask, t, false, t_lo, t_hi);
      cute::warpgroup_wait<0>();
      fence_regs(st.pv);
      if constexpr (!kVc) release(&sh.v_empty[prev.stage]);
      // Flush the tensor-core partial every kFlushTiles tiles (uniform over the warpgroup, since the
      // next PV's zero-init flag is a warpgroup-wide operand).
      bool flush =
          kFlush == 2 ? !(kProbe & kSkipAccumulate) && (i % flush_tiles<kFlushEach, kProbe>() == 0) : kFlush == 1;
      // kVScale: a tensor-core partial holds products of one V block descale only, so it is flushed early where
      // this block's descale differs from the previous one's (at the seams of separately quantized pieces;
      // redux.sync keeps the decision visibly uniform, as the next PV's zero-init flag must be).
      if constexpr (kVScale) flush = flush || __reduce_or_sync(0xffffffffu, unsigned(dv_blk != dv_p)) != 0u;
      if (flush) flush_partial<kMode>(st, sh, prev.stage, t, dv_p);
      if constexpr (kVc) release(&sh.v_empty[prev.stage]);  // after the mean is read
      pv_fresh = flush;
      update_max<kCausal>(st, t_lo, t_hi, !flush);
      convert_step<kProbe, kMaybePartial, kExp2>(st, s, a, mask, t, false, clip);
      dv_p = dv_blk;
      prev = ring;
      ring.advance();
    };
    int i = 1;
    // Causal visits its masked blocks (those past the tile's first row's limit: at most two with plain
    // causal, up to about chunk / 128 + 3 where a chunk boundary crosses the tile) first in the order from the
    // diagonal down, last in natural order.
    int last_full = clip ? 0 : n - 2;   // clip: every block through the general step
    if constexpr (kChunked) {
      const int masked = min(n - vis_first / kBlockN, n);   // vis_first >= 0
      if (p.mid_window_blocks >= 0) {
        for (; i < masked; ++i) step(i, std::true_type{}, std::integral_constant<int, 1>{});
        if (!clip) last_full = n - 1;   // every later block is full, the last included
      } else if (!clip) {
        last_full = n - 1 - masked;
      }
    } else if constexpr (kCausal) {   // at most two masked blocks (the diagonal spans two when Sk - Sq is not
                                      // a multiple of 128); c1f7039's schedule: step 1 always masked (flushes)
      if (p.mid_window_blocks >= 0) {
        if (n > 1) step(1, std::true_type{}, std::integral_constant<int, 1>{});
        i = 2;
        if (!clip) last_full = n - 1;
      } else if (!clip) {
        last_full = n - 3;
      }
    }
    // The full blocks (1 .. n-2 without causal) in groups of the flush period (a flush after the
    // group's last), then the remaining ones with the general step.
    if constexpr ((kProbe & kGeneralLoop) == 0) {
      constexpr bool kNeverFlush = (kProbe & kSkipAccumulate) != 0;
      constexpr int kGroup = kNeverFlush ? 1 : flush_tiles<kFlushEach, kProbe>();
      for (; i + kGroup - 1 <= last_full; i += kGroup) step_group<kGroup, kNeverFlush>(step, i);
    }
    for (; i < n; ++i) step(i, std::true_type{}, std::integral_constant<int, 2>{});
    // Repair tiles (numerics section 6): the same pipeline, no max update (a repair key repeats an
    // original key's score, which the max already covers), codes against the final max with each
    // key's own descale, numerator only. The first PV here is the last original tile's.
    const float* kd_rep = p.repair_k_descale + int64_t(c.b * p.heads + c.h) * p.repair_tiles * kBlockN;
    if constexpr (kRepair) for (int r = 0; r < p.repair_tiles; ++r) {
      issue_block(r == p.repair_tiles - 1);
      cute::warpgroup_wait<0>();
      fence_regs(st.pv);
      release(&sh.v_empty[prev.stage]);
      if (r == 0) accumulate_tile(st);
      else accumulate_numerator(st);
      pv_fresh = true;
      convert_repair_tile(s, qscale, kd_rep + r * kBlockN, p.repair_rows - r * kBlockN,
                          clip ? expcast_addend_huge(st.m_lo) : expcast_addend(st.m_lo),
                          clip ? expcast_addend_huge(st.m_hi) : expcast_addend(st.m_hi), clip, t, st.p);
      prev = ring;
      ring.advance();
    }
    // The last tile's PV.
    TxBarrier::wait(&sh.v_full[prev.stage], prev.phase);
    issue_order.before();
    issue_pv<kD>(st.p, sw_kmajor_desc(sh.v[prev.stage]), st.pv, pv_fresh);
    issue_order.after();
    cute::warpgroup_wait<0>();
    fence_regs(st.pv);
    if constexpr (!kVc) release(&sh.v_empty[prev.stage]);
    if constexpr (kRepair) accumulate_numerator(st);
    else flush_partial<kMode>(st, sh, prev.stage, t, dv_p);
    if constexpr (kVc) release(&sh.v_empty[prev.stage]);
    // A part of a cut tile: the second part to end folds both and stores the tile.
    if constexpr (kSplit)
      if (seg.part >= 0 && !split_exchange<kD>(st, p, seg.slot, seg.part, 4 * wg + warp_in_wg, lane)) continue;
    store_output<kMode>(st, p, w, row_base, g, t);
  }
  // Tiles whose rows see no key (causal with Sq > Sk, empty key sequences): output 0, lse -inf. After the
  // main loop, so that their branches stay out of it (next_work).
  for (int tile = blockIdx.x; kTilesMayIdle<kMode> && tile < ts.count; tile = next_tile<kMode>(tile, p)) {
    const TileWork w = uniform_tile_work<kMode>(tile, p, ts);
    if (w.n == 0) store_output<kMode, true>(ConsumerState<kD>{}, p, w, row_base, g, t);
  }
}

template <int kMode, int kProbe>
__global__ void __launch_bounds__(kCtaThreads, 1)
    expcast_attention_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                             const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_krep,
                             const __grid_constant__ CUtensorMap tm_vrep, const __grid_constant__ KernelParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  SharedStorage<kMode>& sh = *reinterpret_cast<SharedStorage<kMode>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  using C = ModeConfig<kMode>;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    TxBarrier::init(&sh.q_full, 1);
    Barrier::init(&sh.q_empty, kConsumerWarps);
    for (int s = 0; s < C::kStages; ++s) {
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
  for (int idx = threadIdx.x; idx < C::kStages * 8 * kBlockN / 4; idx += blockDim.x) {
    const int stage = idx / (8 * kBlockN / 4), word = idx % (8 * kBlockN / 4);
    reinterpret_cast<uint32_t*>(sh.v[stage] + C::kTileBytes)[word] = 0x38383838u;
  }
  // Launched programmatically (kernel_launch.cuh): above, shared memory only; from here on global memory, which
  // the grid before this one (the preparation) may still be writing until it has finished. Q written before that
  // grid started (KernelParams::q_before_prior_grid): the producer and the consumers wait after the first Q tile.
  if (!has_mode<kMode>(kFusedQMode) || !p.q_before_prior_grid) wait_for_prior_grid();
  const bool compact = has_mode<kMode>(kVarlenMode) && p.compact_tiles;
  // Every warp runs the scan (a branch on the warp index around its shuffles made ptxas treat the whole
  // kernel as divergent); warp 0 writes the table.
  if (compact) build_compact_tiles(sh.seq_tile0, p, threadIdx.x < 32);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  // Every lane of every warp is here: the reduction makes the count warp-uniform.
  const TileSpace ts{compact ? __reduce_max_sync(0xffffffffu, p.heads * sh.seq_tile0[p.batch]) : p.num_tiles,
                     compact ? sh.seq_tile0 : nullptr};

  if (warpgroup == 0) {
    // 24 registers also for the varlen producer (its tile work made uniform, pipeline.cuh, it no longer spills):
    // setmaxnreg.inc of the consumers waits until the registers given back cover it (config.h).
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    // Lane 0 of warp 0 alone: producer_loop relies on it (its varlen tile work is made uniform over lane 0 only).
    if (threadIdx.x == 0) producer_loop<kMode, kProbe>(sh, p, ts, &tm_q, &tm_k, &tm_v, &tm_krep, &tm_vrep);
    else if ((kProbe & kSpareWarpsQuantize) && threadIdx.x >= 32)
      spare_quantize_probe(p, threadIdx.x / 32 - 1, threadIdx.x & 31);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    // A warp-uniform warpgroup index (broadcast from lane 0) lets the compiler keep the Q descriptor
    // and the barrier ids in uniform registers instead of recomputing them every tile.
    consumer_loop<kMode, kProbe>(sh, p, ts, __shfl_sync(0xffffffffu, warpgroup - 1, 0));
  }
  // q_before_prior_grid: a thread that had no Q tile has not waited yet; every CTA waits (pdl.cuh), so that this
  // grid ends after the preparation's (a second wait returns at once).
  if (has_mode<kMode>(kFusedQMode) && p.q_before_prior_grid) wait_for_prior_grid();
}

}  // namespace openvc::sm90
