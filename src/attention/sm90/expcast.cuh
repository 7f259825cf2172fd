// ExpCast on the device (numerics section 3): one FMA per score, a round-to-nearest-even conversion to
// f16 in [1024, 2048) where the f16 spacing is exactly 1 (so the rounding IS the integer rounding of
// the code), a packed half max against 1024 for the clip at code 0 (it also maps -inf and NaN to 0),
// and a byte permute that keeps the low byte of each f16 (0x6400 | code). About 2.25 instructions
// per score, no MUFU and no FP32->FP8 conversion.
#pragma once
#include <cstdint>

namespace openvc::sm90 {

// 119.65 + 1024 evaluated in FP32 exactly as the reference does (kCodeBias + kHalfCodeOffset).
inline constexpr float kExpcastBias = 119.65f + 1024.0f;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kCodesPerLog2 = 8.0f * kLog2e;

// Addend of the FMA for a row whose running max (code units) is row_max.
__device__ __forceinline__ float expcast_addend(float row_max) { return kExpcastBias - row_max; }

// Two scores -> f16x2 holding 1024 + code in each half (low half from s0).
__device__ __forceinline__ uint32_t expcast_pair(float s0, float s1, float a, float b) {
  const float x0 = fmaf(s0, a, b);
  const float x1 = fmaf(s1, a, b);
  uint32_t h;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
  asm("max.f16x2 %0, %1, %2;" : "=r"(h) : "r"(h), "r"(0x64006400u));
  return h;
}

// Low bytes of two f16x2 registers -> four codes {lo0, hi0, lo1, hi1} in one 32-bit register.
__device__ __forceinline__ uint32_t pack_codes(uint32_t h01, uint32_t h23) {
  return __byte_perm(h01, h23, 0x6420);
}

// Scalar form, for the bit-exactness test against the CPU reference.
__device__ __forceinline__ uint8_t expcast_code(float acc, float a, float row_max) {
  return static_cast<uint8_t>(pack_codes(expcast_pair(acc, acc, a, expcast_addend(row_max)), 0u) & 0xFFu);
}

}  // namespace openvc::sm90
