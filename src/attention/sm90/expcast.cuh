// ExpCast on the device (numerics section 3). The kernel works in a domain scaled by 2^-24: the
// multiplier a' = 2^-24 a, the running max M' = 2^-24 M and the addend b' = 2^-24 (119.65 - M) are all
// exact power-of-two scalings, so one FMA gives x' = 2^-24 x exactly. A round-to-nearest-even
// conversion to f16 then lands on an f16 subnormal (spacing 2^-24): its bits ARE the integer code,
// rounded half to even, and relu clips negative values (and -inf) to code 0. The upper clip is free
// because the running max includes the tile. Per score: FFMA, half an F2FP and a quarter PRMT; no
// MUFU and no FP32->FP8 conversion.
#pragma once
#include <cstdint>

#include "openvc/reference.h"   // kCodeBias (119.65) and kLog2e: one definition for the reference and kernels

namespace openvc::sm90 {

using reference::kLog2e;
inline constexpr float kCodesPerLog2 = 8.0f * kLog2e;
inline constexpr float kDomainScale = 0x1p-24f;     // f16 subnormal spacing
inline constexpr float kCodeBiasScaled = reference::kCodeBias * kDomainScale;
inline constexpr float kMaxToLog2 = 0x1p21f;         // M'/8 in log2 units: 2^24 / 8

// Addend of the FMA for a row whose running max (scaled code units) is row_max.
__device__ __forceinline__ float expcast_addend(float row_max) { return kCodeBiasScaled - row_max; }

// Two scores -> f16x2 whose halves hold the codes (low half from s0); a and b in the scaled domain.
__device__ __forceinline__ uint32_t expcast_pair(float s0, float s1, float a, float b) {
  const float x0 = fmaf(s0, a, b);
  const float x1 = fmaf(s1, a, b);
  uint32_t h;
  asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
  return h;
}

// Probe kCorrectedExpCast: E4M3 codes are linear in log2 only at octave edges (value 2^e (1 + m/8)), so the
// linear code x (scaled domain, bias 120: no beta) is moved by g(d) = (k/8) d^2 - k |d|, d = x minus the
// nearest multiple of 8 codes, k = 0.3431 (8 (2^f - 1 - f) ~ -8k f (1 - f) within 0.03 codes): the rounded
// code then equals the E4M3 rounding of the exact exponential for 98% of scores, relative error RMS 2.66%
// against 2.65% (ExpCast: 79.6%, 3.30%; u uniform over 9.7 nats below the max, normal codes).
inline constexpr float kCorrectK = 0.3431f;
inline constexpr float kCorrectBiasScaled = 120.0f * kDomainScale;
__device__ __forceinline__ float corrected_code(float x) {
  const float t = __fadd_rn(__fadd_rn(x, 6.0f), -6.0f);   // 6.0 has spacing 2^-21 = 8 scaled codes
  const float ad = fabsf(__fadd_rn(x, -t));
  return fmaf(fmaf(ad, kCorrectK * 0.125f * 0x1p24f, -kCorrectK), ad, x);
}
__device__ __forceinline__ uint32_t corrected_pair(float s0, float s1, float a, float b) {
  const float x0 = corrected_code(fmaf(s0, a, b));
  const float x1 = corrected_code(fmaf(s1, a, b));
  uint32_t h;
  asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
  return h;
}

// As expcast_pair with one multiplier per score (repair tiles: every repair key keeps its own block's
// K descale, so a = qscale * descale_k varies along the row).
__device__ __forceinline__ uint32_t expcast_pair2(float s0, float s1, float a0, float a1, float b) {
  const float x0 = fmaf(s0, a0, b);
  const float x1 = fmaf(s1, a1, b);
  uint32_t h;
  asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
  return h;
}

// As expcast_pair with x clipped at code 120 before the conversion, for rows whose running max is so
// large (|M'| >= 0.5, i.e. |score| above ~7e5 nats) that the FP32 addend's rounding could lift x past
// 120.5 (numerics section 3): codes stay in [0, 120], never a NaN byte. Taken on a warp-uniform flag.
inline constexpr float kMaxCodeScaled = 120.0f * kDomainScale;
inline constexpr float kHugeMaxScaled = 0.5f;   // |M'| below this: the addend's rounding error is < 0.5 code
__device__ __forceinline__ uint32_t expcast_pair_clipped(float s0, float s1, float a, float b) {
  const float x0 = fminf(fmaf(s0, a, b), kMaxCodeScaled);
  const float x1 = fminf(fmaf(s1, a, b), kMaxCodeScaled);
  uint32_t h;
  asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
  return h;
}
__device__ __forceinline__ uint32_t expcast_pair2_clipped(float s0, float s1, float a0, float a1, float b) {
  const float x0 = fminf(fmaf(s0, a0, b), kMaxCodeScaled);
  const float x1 = fminf(fmaf(s1, a1, b), kMaxCodeScaled);
  uint32_t h;
  asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
  return h;
}

// Addend of a row in the clipped conversion. A row whose |M'| >= 0.5 (|M| >= 2^23 code units) cannot
// have its scores resolved to a code step in FP32 (one ulp of M is >= 1 code): one ulp of slack makes
// the row's maximum reach code 120 whatever the roundings, so l > 0 and the output is finite; keys
// within about two ulps of the maximum tie at 120 (numerics section 3). Other rows: the plain addend.
__device__ __forceinline__ float expcast_addend_huge(float row_max) {
  const float b = expcast_addend(row_max);
  const float a = fabsf(row_max);
  if (!(a >= kHugeMaxScaled) || a == INFINITY) return b;
  const float ulp = __int_as_float((__float_as_int(a) & 0x7F800000) - (23 << 23));   // 2^(e - 23), a normal
  return b + ulp;
}

// Low bytes of two f16x2 registers -> four codes {lo0, hi0, lo1, hi1} in one 32-bit register.
__device__ __forceinline__ uint32_t pack_codes(uint32_t h01, uint32_t h23) {
  return __byte_perm(h01, h23, 0x6420);
}

// ---- P format exp2 (kExp2PMode, numerics "P format") ------------------------------------------------
// Per score y = acc * a/8 + (8 - M/8) (one FFMA; a/8 = a' * 2^21 and M/8 = M' * 2^21 exactly), then
// p = 2^y on the MUFU unit (ex2.approx.ftz: ~2 ulp, -inf -> +0, NaN -> NaN) and the E4M3 code by
// round-to-nearest-even with saturation to 448 (NaN -> 0x7F). PTX cvt.rn.satfinite.e4m3x2.f32 d, a, b
// puts a's code in d[15:8] and b's in d[7:0]: the second operand is the first score, so the low byte
// holds y0's code, as the low f16 half holds s0's code in expcast_pair.
// Two scores' exponents -> the codes {y0 (low byte), y1} in 16 bits. A 16-bit result: widening it to 32
// bits cost a LOP3 per pair in the SASS (measured: 124 extra LOP3s in the loop), which the join below
// does not need.
__device__ __forceinline__ uint16_t exp2_pair(float y0, float y1) {
  uint16_t c;
  asm("{\n\t.reg .f32 p0, p1;\n\t"
      "ex2.approx.ftz.f32 p0, %1;\n\tex2.approx.ftz.f32 p1, %2;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 %0, p1, p0;\n\t}"
      : "=h"(c) : "f"(y0), "f"(y1));
  return c;
}
// Two exp2_pair results -> four codes {lo0, lo1, hi0, hi1} in one register (pack_codes' byte order).
__device__ __forceinline__ uint32_t pack_code_pairs(uint16_t lo, uint16_t hi) {
  uint32_t r;
  asm("mov.b32 %0, {%1, %2};" : "=r"(r) : "h"(lo), "h"(hi));
  return r;
}

// The exp2 format's polynomial code (keys 64-127 of every tile; numerics section 10), two scores per f16x2
// instruction on the FMA pipe. x0, x1: the score's position in unscaled code units, 8 per octave, 120 at the row
// max (x = acc * a + (120 - M)). ExpCast's code x is linear within an octave; E4M3 values are 2^e (1 + m/8), so
// the code that rounds 2^(x/8) is x + g(d), g(d) = (k/8) d^2 - k |d|, d = x minus the nearest multiple of 8
// (k = kPolyK: 8 (2^f - 1 - f) ~ -8k f (1 - f) within 0.03 codes). Steps: h = f16(x) (satfinite: far keys stay
// finite and code 0; f16 resolves x to 1/16 code, 1/32 below 64), t = the nearest multiple of 8 (12288 has f16
// spacing 8), |d|, then relu(h + |d| (k/8 |d| - k)) rounded to an integer by adding 1024 (f16 spacing 1): the
// low byte of each half is the code, 0..120 for x <= 120. NaN gives the f16 canonical NaN, low byte 0xFF (an
// E4M3 NaN). The reference emulates each f16 rounding (reference::exp2_poly_code).
// The f16 bits of a double that f16 holds exactly (normal range), in both halves: the constants below are the
// reference's (one definition); a value f16 does not hold is a compile error (the throw in a constant expression).
constexpr uint32_t f16x2_splat(double v) {
  const double a = v < 0 ? -v : v;
  if (!(a > 0) || a == a * 2) throw "not an f16 normal";   // 0, NaN, inf: the loops below would not end
  int e = 0;
  double m = a;
  while (m >= 2.0) m /= 2.0, ++e;
  while (m < 1.0) m *= 2.0, --e;
  const double frac = (m - 1.0) * 1024.0;
  if (e < -14 || e > 15 || frac != static_cast<double>(static_cast<uint32_t>(frac))) throw "not an f16 normal";
  const uint32_t h = (v < 0 ? 0x8000u : 0u) | (static_cast<uint32_t>(e + 15) << 10) | static_cast<uint32_t>(frac);
  return h | (h << 16);
}
inline constexpr uint32_t kPolyOctaveF16x2 = f16x2_splat(reference::kPolyOctave);   // 12288 = 0x7200
inline constexpr uint32_t kPolyK8F16x2 = f16x2_splat(reference::kPolyK8);           // k/8 = 0.0428772, 0x297D
inline constexpr uint32_t kPolyNegKF16x2 = f16x2_splat(reference::kPolyNegK);       // -k = -0.343018, 0xB57D
inline constexpr uint32_t kPolyRoundF16x2 = f16x2_splat(1024.0);                    // spacing 1: rounds to integers
static_assert(kPolyOctaveF16x2 == 0x72007200u && kPolyK8F16x2 == 0x297D297Du && kPolyNegKF16x2 == 0xB57DB57Du &&
              kPolyRoundF16x2 == 0x64006400u);
__device__ __forceinline__ uint32_t exp2_poly_pair(float x0, float x1) {
  uint32_t r;
  asm("{\n\t.reg .b32 h, t, d;\n\t"
      "cvt.rn.satfinite.f16x2.f32 h, %2, %1;\n\t"
      "add.rn.f16x2 t, h, %3;\n\t"
      "sub.rn.f16x2 t, t, %3;\n\t"
      "sub.rn.f16x2 d, h, t;\n\t"
      "abs.f16x2 d, d;\n\t"
      "fma.rn.f16x2 t, d, %4, %5;\n\t"
      "fma.rn.relu.f16x2 t, t, d, h;\n\t"
      "add.rn.f16x2 %0, t, %6;\n\t}"
      : "=r"(r)
      : "f"(x0), "f"(x1), "r"(kPolyOctaveF16x2), "r"(kPolyK8F16x2), "r"(kPolyNegKF16x2), "r"(kPolyRoundF16x2));
  return r;
}
// min(x, 120) keeping NaN (fminf would drop it): tiles that may hold huge scores, whose addend's rounding can put
// x well past 120, where the code would leave 0..120: 121-126 are finite E4M3 values above p = 256 (up to 448), 127
// is NaN, larger x wraps the low byte (x = 1000 gives 0xE8), and from about x = 53,232 h + 12288 overflows f16 to
// +inf, which gives 0.
__device__ __forceinline__ float poly_clip(float x) {
  float r;
  asm("min.NaN.f32 %0, %1, 0f42F00000;" : "=f"(r) : "f"(x));
  return r;
}
// Scalar polynomial code in unscaled units (the reference's exp2_poly_code signature), for the tests.
__device__ __forceinline__ uint8_t exp2_poly_code(float acc, float a, float row_max) {
  const float x = poly_clip(fmaf(acc, a, 120.0f - row_max));
  return static_cast<uint8_t>(exp2_poly_pair(x, x) & 0xFFu);
}

// Scalar exp2-format code in unscaled units (the reference's exp2_code signature), for the tests.
__device__ __forceinline__ uint8_t exp2_code(float acc, float a, float row_max) {
  const float y = fmaf(acc, a * 0.125f, 8.0f - row_max * 0.125f);
  return static_cast<uint8_t>(exp2_pair(y, y) & 0xFFu);
}

// Scalar form in unscaled units (the reference's signature), for the bit-exactness test.
// The kernel takes the clipped form when the row max is huge; both give the reference's byte.
__device__ __forceinline__ uint8_t expcast_code(float acc, float a, float row_max) {
  const float m = row_max * kDomainScale;
  const float b = expcast_addend(m);
  const uint32_t h = fabsf(m) >= kHugeMaxScaled
                         ? expcast_pair_clipped(acc, acc, a * kDomainScale, expcast_addend_huge(m))
                         : expcast_pair(acc, acc, a * kDomainScale, b);
  return static_cast<uint8_t>(pack_codes(h, 0u) & 0xFFu);
}

}  // namespace openvc::sm90
