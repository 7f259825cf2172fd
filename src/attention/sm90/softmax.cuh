// The consumers' per-thread softmax arithmetic of the sm_90a kernel (numerics sections 3-4): the
// accumulator state, row maxima with the zero deadband and the lagging O scale, the ExpCast conversion
// into PV A-operand registers, masks of partial and causal blocks, and the FP32 flush. kernel.cuh
// sequences these per key block.
#pragma once
#include <cstdint>
#include <type_traits>

#include "attention/sm90/config.h"
#include "attention/sm90/expcast.cuh"
#include "attention/sm90/probes.h"
#include "attention/sm90/row_max.cuh"
#include "openvc/attention.h"

namespace openvc::sm90 {

// Per-thread view of the 64-row accumulator fragment: lane 4g+t holds rows g and g+8 of its warp's
// 16 rows; in every 8-column chunk j, columns 8j+2t and 8j+2t+1 (indices 4j..4j+3: lo row pair,
// hi row pair).
template <int kD>
struct ConsumerState {
  static constexpr int kHeadDim = kD;
  static constexpr int kAcc = TileConfig<kD>::kAccRegs;
  float o[kAcc];     // [O | l] in FP32: o[D/2..D/2+1] = l of row g, o[D/2+2..D/2+3] = l of row g+8
  float pv[kAcc];    // the current tile's P [V | 1] from the tensor cores
  uint32_t p[16];    // ExpCast codes of the previous tile, in PV A-operand order
  float m_lo, m_hi;    // running maxima in scaled code units (2^-24 M): the codes' reference
  float mo_lo, mo_hi;  // the max O and l are stored relative to (lags m: rebased only on big growth)
};

// Keys of a key block that rows g (lo) and g+8 (hi) of this thread may see, and whether any row of the
// tile sees fewer than the whole block (uniform over the CTA, so the masked path never diverges).
struct BlockMask {
  int lo, hi;
  bool on;
};

// Masked keys get code 0: clear their bytes after conversion (register p[4kb+r] holds columns
// c, c+1, c+8, c+9 with c = 32kb + 16*(r>=2) + 2t, of row g for even r and row g+8 for odd r).
__device__ __forceinline__ void mask_codes(uint32_t (&p)[16], int valid_lo, int valid_hi, int t) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = 32 * (i / 4) + ((i % 4) >= 2 ? 16 : 0) + 2 * t;
    const int valid = (i % 2) == 0 ? valid_lo : valid_hi;
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

// A row that has seen no key yet (causal: a row whose keys all lie in blocks visited later, or none
// at all) keeps M = -inf, and -inf - -inf is NaN: kGuard maps such a row's factor to 1 (its O, l and
// partial are 0). Elsewhere M >= M_O always, so the clamp changes nothing.
template <bool kGuard>
__device__ __forceinline__ float growth_exp2(float gap_log2) {
  return fast_exp2(kGuard ? fmaxf(gap_log2, 0.0f) : gap_log2);
}
template <bool kGuard>
__device__ __forceinline__ float shrink_exp2(float gap_log2) {
  return fast_exp2(kGuard ? fminf(gap_log2, 0.0f) : gap_log2);
}

// Adds the tensor-core product (at max m) into the FP32 accumulator (at max mo): one FFMA per value
// with beta = 2^((m - mo)/8) <= 2^8. kNumeratorOnly: O only, not l (repair tiles add to the numerator
// only, numerics section 6, so l stays the denominator of the original keys).
// kVScaled (kVBlockDescaleMode): the V columns take beta * dv, dv the tile's own V block descale; the row-sum
// chunk keeps beta (l counts probabilities, not values), so the output's V descale is then 1.
template <bool kNumeratorOnly = false, bool kGuard = false, bool kVScaled = false, int kD>
__device__ __forceinline__ void accumulate_tile(ConsumerState<kD>& st, float dv = 1.0f) {
  constexpr int kChunks = kD / 8 + (kNumeratorOnly ? 0 : 1);
  const float beta_lo = growth_exp2<kGuard>((st.m_lo - st.mo_lo) * kMaxToLog2);
  const float beta_hi = growth_exp2<kGuard>((st.m_hi - st.mo_hi) * kMaxToLog2);
  const float bv_lo = kVScaled ? beta_lo * dv : beta_lo, bv_hi = kVScaled ? beta_hi * dv : beta_hi;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const float b_lo = j < kD / 8 ? bv_lo : beta_lo, b_hi = j < kD / 8 ? bv_hi : beta_hi;
    st.o[4 * j + 0] = fmaf(st.pv[4 * j + 0], b_lo, st.o[4 * j + 0]);
    st.o[4 * j + 1] = fmaf(st.pv[4 * j + 1], b_lo, st.o[4 * j + 1]);
    st.o[4 * j + 2] = fmaf(st.pv[4 * j + 2], b_hi, st.o[4 * j + 2]);
    st.o[4 * j + 3] = fmaf(st.pv[4 * j + 3], b_hi, st.o[4 * j + 3]);
  }
}
template <int kD>
__device__ __forceinline__ void accumulate_numerator(ConsumerState<kD>& st) { accumulate_tile<true>(st); }

// VC mode (numerics section 7): the tile's block mean comes back through its probability row sum,
// O += beta (P Vres + l_tile mu / dv) with mu / dv from shared memory (the same stage as the V tile).
// Head dim 128 only (the VC mode is not built for 64).
__device__ __forceinline__ void accumulate_tile_vc(ConsumerState<128>& st, const float* mean, int t) {
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
// most increases cost two exponentials instead of D + 8 multiplies. A tensor-core partial that is not
// flushed yet holds products at the old m and is rescaled (rescale_pv).
template <bool kGuard, int kD>
__device__ __forceinline__ void update_max(ConsumerState<kD>& st, float tile_lo, float tile_hi, bool rescale_pv) {
  const float new_lo = fmaxf(st.m_lo, tile_lo);
  const float new_hi = fmaxf(st.m_hi, tile_hi);
  const bool grew = new_lo > st.m_lo || new_hi > st.m_hi;
  if (!__any_sync(0xffffffffu, grew)) return;
  if (rescale_pv)  // exp2(-inf) = 0 cannot occur: a partial exists only after the first tile
    scale_rows(st.pv, shrink_exp2<kGuard>((st.m_lo - new_lo) * kMaxToLog2),
               shrink_exp2<kGuard>((st.m_hi - new_hi) * kMaxToLog2));
  st.m_lo = new_lo;
  st.m_hi = new_hi;
  if (st.mo_lo == -INFINITY) st.mo_lo = new_lo;  // first tile: O is still zero
  if (st.mo_hi == -INFINITY) st.mo_hi = new_hi;
  float gap_lo = (st.m_lo - st.mo_lo) * kMaxToLog2, gap_hi = (st.m_hi - st.mo_hi) * kMaxToLog2;
  if (kGuard) gap_lo = fmaxf(gap_lo, 0.0f), gap_hi = fmaxf(gap_hi, 0.0f);
  if (__any_sync(0xffffffffu, gap_lo > 8.0f || gap_hi > 8.0f)) {
    scale_rows(st.o, fast_exp2(-gap_lo), fast_exp2(-gap_hi));
    st.mo_lo = st.m_lo;
    st.mo_hi = st.m_hi;
  }
}

// The ExpCast multiplier of this thread's rows g (lo) and g+8 (hi): one float where the rows share it (an
// E4M3 Q descale per 128-row block), a pair with per-row Q descales (INT8 mode). Same arithmetic.
struct RowMult {
  float lo, hi;
};
__device__ __forceinline__ RowMult operator*(RowMult q, float k) { return {q.lo * k, q.hi * k}; }
__device__ __forceinline__ float mult_lo(float a) { return a; }
__device__ __forceinline__ float mult_hi(float a) { return a; }
__device__ __forceinline__ float mult_lo(RowMult a) { return a.lo; }
__device__ __forceinline__ float mult_hi(RowMult a) { return a.hi; }

// INT8 K (numerics section 9): 8 descales per 128-key block, one per key group. Thread t of a row quad
// holds columns 8m+2t, 8m+2t+1 of chunk m, so its keys are group t in chunks 0..7 (s[0..31], half 0)
// and group t + 4 in chunks 8..15 (s[32..63], half 1): two K descales per block and thread
// (kInt8KeyGroups = 8 of them per block, attention.h).
struct KGroupPair {
  float h0, h1;   // the K descales of groups t (half 0) and t + 4 (half 1)
};
// This thread's K descales of block blk (kd: the (b, h)'s [nk, 8] descales).
__device__ __forceinline__ KGroupPair load_k_groups(const float* kd, int blk, int t) {
  return {__ldg(kd + blk * kInt8KeyGroups + t), __ldg(kd + blk * kInt8KeyGroups + t + 4)};
}
// The multipliers of an INT8 tile: rows g (lo) and g+8 (hi) by halves 0 and 1, each
// ((qk_multiplier * dq_row) * dk_group) in the reference's order (RowMult holds the first product).
struct QuadMult {
  float lo0, lo1, hi0, hi1;
};
__device__ __forceinline__ QuadMult operator*(RowMult q, KGroupPair k) {
  return {q.lo * k.h0, q.lo * k.h1, q.hi * k.h0, q.hi * k.h1};
}
__device__ __forceinline__ QuadMult operator*(QuadMult a, float x) {   // probes (kDoubleConvert)
  return {a.lo0 * x, a.lo1 * x, a.hi0 * x, a.hi1 * x};
}

// The exact FP32 value of an INT8 tile's int32 score (its bits in a float register): I2FP.F32.S32
// (exact: |acc| <= D * 127^2 < 2^22), on the ALU pipe (Nsight Compute: the XU pipe stays at 1% in the
// ExpCast INT8 kernel). Measured on the H200 (bench int8, S = 73,397 H = 7 and S = 32,760 H = 40, paired
// medians of 7): 17.4-23.9% less kernel time than IADD of the bits of 1.5 * 2^23 (0x4B400000) then an FADD
// of -1.5 * 2^23 (the same bytes; probe kInt8ConvertMagic); and within 0.6% (ExpCast) and 3.5% faster
// (exp2) than one LOP3 ((acc & 0x7FFFFF) ^ 0x4B400000 = the bits of 1.5 * 2^23 + acc) with the offset
// folded into the FMA's addend (tried 2026-12-02, not kept).
template <bool kMagic = false>
__device__ __forceinline__ float int8_score(float acc_bits) {
  if constexpr (kMagic) return __int_as_float(__float_as_int(acc_bits) + 0x4B400000) - 12582912.0f;
  else return __int2float_rn(__float_as_int(acc_bits));
}

// Multipliers of the 32-key column group kb (chunks 4kb..4kb+3) for rows g (lo) and g+8 (hi): one per row
// pair (float, RowMult), or INT8's per-half multipliers (QuadMult: chunks 0..7 half 0, 8..15 half 1).
template <typename A>
__device__ __forceinline__ float group_mult_lo(A a, int) { return mult_lo(a); }
template <typename A>
__device__ __forceinline__ float group_mult_hi(A a, int) { return mult_hi(a); }
__device__ __forceinline__ float group_mult_lo(QuadMult a, int kb) { return kb < 2 ? a.lo0 : a.lo1; }
__device__ __forceinline__ float group_mult_hi(QuadMult a, int kb) { return kb < 2 ? a.hi0 : a.hi1; }

// The PV A-operand registers of a score tile, in convert_tile's register order: pair(s0, s1, a, b) codes two
// scores of one row (16 bits of codes in a 32-bit register), pack(x, y) joins two pairs into four codes.
template <typename A, class Pair, class Pack>
__device__ __forceinline__ void fill_pv_operand(const float (&s)[64], A a, float b_lo, float b_hi, Pair pair, Pack pack,
                                                uint32_t (&p)[16]) {
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const float a_lo = group_mult_lo(a, kb), a_hi = group_mult_hi(a, kb);
    const int c0 = 4 * (4 * kb + 0), c1 = 4 * (4 * kb + 1), c2 = 4 * (4 * kb + 2), c3 = 4 * (4 * kb + 3);
    p[4 * kb + 0] = pack(pair(s[c0 + 0], s[c0 + 1], a_lo, b_lo), pair(s[c1 + 0], s[c1 + 1], a_lo, b_lo));
    p[4 * kb + 1] = pack(pair(s[c0 + 2], s[c0 + 3], a_hi, b_hi), pair(s[c1 + 2], s[c1 + 3], a_hi, b_hi));
    p[4 * kb + 2] = pack(pair(s[c2 + 0], s[c2 + 1], a_lo, b_lo), pair(s[c3 + 0], s[c3 + 1], a_lo, b_lo));
    p[4 * kb + 3] = pack(pair(s[c2 + 2], s[c2 + 3], a_hi, b_hi), pair(s[c3 + 2], s[c3 + 3], a_hi, b_hi));
  }
}

// Codes of the tile straight into the PV A-operand registers: for key group kb (32 keys), a0/a2 take
// row g's chunks (4kb, 4kb+1)/(4kb+2, 4kb+3) and a1/a3 row g+8's; V's keys are stored permuted
// (kPackedKeyOrder) so this register order is the key order the tensor core expects.
// INT8 (QuadMult): s holds the int32 sums' bits, converted here as the FMA's input; chunks 0..7 (kb 0, 1)
// take the half-0 multipliers, chunks 8..15 (kb 2, 3) the half-1 ones.
template <bool kClip, bool kMagic = false, bool kCorrected = false, typename A>
__device__ __forceinline__ void convert_tile(const float (&s)[64], A a, float b_lo, float b_hi, uint32_t (&p)[16]) {
  if constexpr (std::is_same_v<A, QuadMult>) {
    fill_pv_operand(
        s, a, b_lo, b_hi,
        [](float s0, float s1, float a_, float b_) {
          const float x0 = int8_score<kMagic>(s0), x1 = int8_score<kMagic>(s1);
          if constexpr (kCorrected) return corrected_pair(x0, x1, a_, b_);
          else return kClip ? expcast_pair_clipped(x0, x1, a_, b_) : expcast_pair(x0, x1, a_, b_);
        },
        [](uint32_t h01, uint32_t h23) { return pack_codes(h01, h23); }, p);
  } else {
    fill_pv_operand(
        s, a, b_lo, b_hi,
        [](float s0, float s1, float a_, float b_) {
          if constexpr (kCorrected) return corrected_pair(s0, s1, a_, b_);
          else return kClip ? expcast_pair_clipped(s0, s1, a_, b_) : expcast_pair(s0, s1, a_, b_);
        },
        [](uint32_t h01, uint32_t h23) { return pack_codes(h01, h23); }, p);
  }
}

// P format exp2 (kExp2PMode, INT8 only; numerics section 10): the same registers and key order as convert_tile.
// Key groups kb < 4 - kPolyGroups (production kPolyGroups = 2: keys 0-63 of the tile, the half-0 multipliers) code
// e4m3(2^(acc * a2 + b2)) on the MUFU unit (exp2_pair; a2 = a' 2^21 per row and half, b2 = 8 - M' 2^21 per row);
// the others (keys 64-127) the polynomial code on the FMA pipe (exp2_poly_pair; unscaled code units: a' 2^24 and
// 120 - M' 2^24, exact scalings). The two pipes share the tile's exponentials: against ExpCast codes, MUFU for
// all 128 keys cost +21.2%, the polynomial for all +17.3%, the half split +10.3% (H200, S = 32,768, H = 7;
// docs/performance.md, bench/results/2026-12-03-h200-sixteenth/). m_lo / m_hi: the rows' maxima (scaled). Both
// codes are 256 (0x78) at the max; MUFU saturates to 448 by itself, the polynomial's input is clipped at 120 in
// tiles that may hold huge scores (kClip).
template <bool kMagic, int kPolyGroups, bool kClip>
__device__ __forceinline__ void convert_tile_exp2(const float (&s)[64], QuadMult a, float m_lo, float m_hi,
                                                  uint32_t (&p)[16]) {
  const QuadMult a2 = a * kMaxToLog2, ac = a * 0x1p24f;
  const float b2_lo = 8.0f - m_lo * kMaxToLog2, b2_hi = 8.0f - m_hi * kMaxToLog2;
  const float bc_lo = 120.0f - m_lo * 0x1p24f, bc_hi = 120.0f - m_hi * 0x1p24f;
  auto x = [](float v) { return int8_score<kMagic>(v); };
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const int c0 = 4 * (4 * kb + 0), c1 = 4 * (4 * kb + 1), c2 = 4 * (4 * kb + 2), c3 = 4 * (4 * kb + 3);
    if (kb < 4 - kPolyGroups) {
      const float a_lo = group_mult_lo(a2, kb), a_hi = group_mult_hi(a2, kb);
      auto e = [&](int c, float a_, float b_) {
        return exp2_pair(fmaf(x(s[c]), a_, b_), fmaf(x(s[c + 1]), a_, b_));
      };
      p[4 * kb + 0] = pack_code_pairs(e(c0 + 0, a_lo, b2_lo), e(c1 + 0, a_lo, b2_lo));
      p[4 * kb + 1] = pack_code_pairs(e(c0 + 2, a_hi, b2_hi), e(c1 + 2, a_hi, b2_hi));
      p[4 * kb + 2] = pack_code_pairs(e(c2 + 0, a_lo, b2_lo), e(c3 + 0, a_lo, b2_lo));
      p[4 * kb + 3] = pack_code_pairs(e(c2 + 2, a_hi, b2_hi), e(c3 + 2, a_hi, b2_hi));
    } else {
      const float a_lo = group_mult_lo(ac, kb), a_hi = group_mult_hi(ac, kb);
      auto y = [&](int c, float a_, float b_) {
        const float v = fmaf(x(s[c]), a_, b_);
        return kClip ? poly_clip(v) : v;
      };
      auto e = [&](int c, float a_, float b_) { return exp2_poly_pair(y(c, a_, b_), y(c + 1, a_, b_)); };
      p[4 * kb + 0] = pack_codes(e(c0 + 0, a_lo, bc_lo), e(c1 + 0, a_lo, bc_lo));
      p[4 * kb + 1] = pack_codes(e(c0 + 2, a_hi, bc_hi), e(c1 + 2, a_hi, bc_hi));
      p[4 * kb + 2] = pack_codes(e(c2 + 0, a_lo, bc_lo), e(c3 + 0, a_lo, bc_lo));
      p[4 * kb + 3] = pack_codes(e(c2 + 2, a_hi, bc_hi), e(c3 + 2, a_hi, bc_hi));
    }
  }
}

// Codes of a repair tile against the final max: the same FMA with each key's own multiplier
// qscale * descale_k (kd: the tile's 128 per-row descales), then padded rows cleared.
__device__ __forceinline__ void convert_repair_tile(const float (&s)[64], float qscale, const float* kd, int valid,
                                                    float b_lo, float b_hi, bool clip, int t, uint32_t (&p)[16]) {
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    uint32_t h[4][2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int j = 4 * kb + q;  // 8-column chunk
      const float2 d = __ldg(reinterpret_cast<const float2*>(kd + 8 * j + 2 * t));
      const float a0 = qscale * d.x, a1 = qscale * d.y;
      h[q][0] = clip ? expcast_pair2_clipped(s[4 * j + 0], s[4 * j + 1], a0, a1, b_lo)
                     : expcast_pair2(s[4 * j + 0], s[4 * j + 1], a0, a1, b_lo);
      h[q][1] = clip ? expcast_pair2_clipped(s[4 * j + 2], s[4 * j + 3], a0, a1, b_hi)
                     : expcast_pair2(s[4 * j + 2], s[4 * j + 3], a0, a1, b_hi);
    }
    p[4 * kb + 0] = pack_codes(h[0][0], h[1][0]);
    p[4 * kb + 1] = pack_codes(h[0][1], h[1][1]);
    p[4 * kb + 2] = pack_codes(h[2][0], h[3][0]);
    p[4 * kb + 3] = pack_codes(h[2][1], h[3][1]);
  }
  if (valid < kBlockN) mask_codes(p, valid, valid, t);
}

// Tile max of S (already waited for) in scaled code units.
template <int kProbe, bool kMaybePartial = true, typename A>
__device__ __forceinline__ void tile_max(const float (&s)[64], A a, const BlockMask& mask, int t, bool first,
                                         float& lo, float& hi) {
  if ((kProbe & kSkipMax) && !first) {
    lo = hi = -INFINITY;
    return;
  }
  if constexpr (std::is_same_v<A, QuadMult>) {
    // INT8: each thread's two halves have their own K multipliers, so the raw int32 maxima (exact for
    // any sign) are scaled per half, maxed, and the quad reduction runs on the scaled values.
    int m[4];   // lo half 0, lo half 1, hi half 0, hi half 1
    if (kMaybePartial && mask.on) thread_row_max_int8<true>(s, mask.lo, mask.hi, t, m);
    else thread_row_max_int8<false>(s, mask.lo, mask.hi, t, m);
    auto scaled = [&](int raw, float a_) {
      const float x = int8_score<(kProbe & kInt8ConvertMagic) != 0>(__int_as_float(raw)) * a_;
      return kMaybePartial && raw == kNoInt8Score ? -INFINITY : x;   // a half with no visible key
    };
    lo = fmaxf(scaled(m[0], a.lo0), scaled(m[1], a.lo1));
    hi = fmaxf(scaled(m[2], a.hi0), scaled(m[3], a.hi1));
    quad_max(lo, hi);
  } else {
    constexpr bool kBits = (kProbe & kFloatMax) == 0;
    if (kMaybePartial && mask.on) row_max<true, kBits>(s, mask.lo, mask.hi, t, lo, hi);
    else row_max<false, kBits>(s, mask.lo, mask.hi, t, lo, hi);
    if (kProbe & kDoubleMax) {
      float lo2, hi2;
      row_max<false, kBits>(s, mask.lo, mask.hi, t, lo2, hi2);
      lo = fmaxf(lo, lo2 * 0.5f);
      hi = fmaxf(hi, hi2 * 0.5f);
    }
    lo *= mult_lo(a);
    hi *= mult_hi(a);
  }
}

// Conversion of the tile against the maxima m_lo / m_hi (the updated ones) into p, then the masked keys' codes
// cleared.
// clip (uniform; only steps that may be partial take it, kMaybePartial): the tile may hold huge scores
// (tile_may_be_huge), so one ulp of slack in the addend and the clip at 120 (numerics section 3).
// Such tiles send every block through the general step, so the steady-state loop has no trace of it.
// kExp2 (kExp2PMode, INT8 only): the exp2 P format (convert_tile_exp2); clip clips the polynomial half's input at
// 120 (the MUFU half saturates by itself).
template <int kProbe, bool kMaybePartial = true, bool kExp2 = false, typename A>
__device__ __forceinline__ void convert_codes(float m_lo, float m_hi, const float (&s)[64], A a, const BlockMask& mask,
                                              int t, bool first, bool clip, uint32_t (&p)[16]) {
  if ((kProbe & kSkipConvert) && !first) return;
  if constexpr (kExp2) {
    static_assert(std::is_same_v<A, QuadMult>, "the exp2 P format takes INT8 Q/K only");
    constexpr bool kMagic = (kProbe & kInt8ConvertMagic) != 0;
    // Key groups on the FMA pipe: 2 of 4 (production); probes: none (kExp2AllMufu), 1 (kExp2PolyQuarter), 3
    // (kExp2PolyThreeQuarters), all (kCorrectedExpCast).
    constexpr int kSplitProbes = kExp2AllMufu | kExp2PolyQuarter | kExp2PolyThreeQuarters | kCorrectedExpCast;
    constexpr int kPoly = (kProbe & kExp2AllMufu) ? 0 : (kProbe & kExp2PolyQuarter) ? 1
                          : (kProbe & kExp2PolyThreeQuarters) ? 3 : (kProbe & kCorrectedExpCast) ? 4 : 2;
    static_assert((kProbe & kSplitProbes) || (4 - kPoly) * 32 == reference::kExp2PolyFirstKey,
                  "the production split must be the reference's (exp2_format_code)");
    if (kMaybePartial && clip) convert_tile_exp2<kMagic, kPoly, true>(s, a, m_lo, m_hi, p);
    else convert_tile_exp2<kMagic, kPoly, false>(s, a, m_lo, m_hi, p);
    if (kMaybePartial && mask.on) mask_codes(p, mask.lo, mask.hi, t);
    return;
  }
  constexpr bool kMagic = (kProbe & kInt8ConvertMagic) != 0;
  if constexpr ((kProbe & kCorrectedExpCast) != 0) {   // probe: codes near the exact exponential's E4M3 rounding
    convert_tile<false, kMagic, true>(s, a, kCorrectBiasScaled - m_lo, kCorrectBiasScaled - m_hi, p);
    if (kMaybePartial && mask.on) mask_codes(p, mask.lo, mask.hi, t);
    return;
  }
  const float b_lo = expcast_addend(m_lo), b_hi = expcast_addend(m_hi);
  if (kMaybePartial && clip)
    convert_tile<true, kMagic>(s, a, expcast_addend_huge(m_lo), expcast_addend_huge(m_hi), p);
  else convert_tile<false, kMagic>(s, a, b_lo, b_hi, p);
  if (kProbe & kDoubleConvert) {
    uint32_t p2[16];
    convert_tile<false>(s, a * 0.5f, b_lo, b_hi, p2);
#pragma unroll
    for (int i = 0; i < 16; ++i) p[i] ^= p2[i] & 0x01010101u;
  }
  if (kMaybePartial && mask.on) mask_codes(p, mask.lo, mask.hi, t);
}
// convert_codes against the state's maxima into the state's PV operand.
template <int kProbe, bool kMaybePartial = true, bool kExp2 = false, int kD, typename A>
__device__ __forceinline__ void convert_step(ConsumerState<kD>& st, const float (&s)[64], A a, const BlockMask& mask,
                                             int t, bool first, bool clip) {
  convert_codes<kProbe, kMaybePartial, kExp2>(st.m_lo, st.m_hi, s, a, mask, t, first, clip, st.p);
}

// Whether a tile can hold scores so large (|M'| >= 0.5, i.e. beyond ~7e5 nats) that the conversion
// needs the clip: |acc| <= 128 * 448^2 for E4M3 codes (128 * 127^2 for INT8), so |M'| <= that bound *
// qscale * max dk over the (b, h)'s key blocks (INT8: over its nk * 8 key-group descales). Never true for
// real data (the bound is ~1e-4 for video inputs). qscale must be the same in the warpgroup's four warps (the
// tile's for E4M3, warpgroup_max_q_multiplier's for INT8), so the vote is too: the clip picks the steps that
// issue the warpgroup's tensor-core work. Each warp reads the descales itself (no barrier); NaN descales give
// false (NaN out anyway). The clip changes no code (numerics section 3), so a bound that says yes too often only
// costs speed.
template <bool kInt8>
__device__ __forceinline__ bool tile_may_be_huge(float qscale, const float* kd, int nk) {
  if constexpr (kInt8) nk *= kInt8KeyGroups;   // INT8: every key group's descale ([nk, 8])
  // A uniform trip count (predicated loads, no divergent loop): divergence here would cost the
  // consumer loop its uniform datapath (measured in the SASS: R2UR moves, WARPSYNC).
  float m = 0.0f;
  const int lane = threadIdx.x & 31;
  for (int j0 = 0; j0 < nk; j0 += 32) m = fmaxf(m, j0 + lane < nk ? __ldg(kd + j0 + lane) : 0.0f);
  constexpr float kMaxAcc = kInt8 ? 128.0f * 127.0f * 127.0f : 128.0f * 448.0f * 448.0f;
  // A vote, not a shuffle reduction: ptxas knows its result is uniform, so the loop bounds that depend
  // on it stay uniform too (a shuffle-reduced flag made the whole consumer loop "divergent").
  return __any_sync(0xffffffffu, kMaxAcc * qscale * m >= kHugeMaxScaled);
}

}  // namespace openvc::sm90
