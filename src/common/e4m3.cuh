// Device-side FP8 E4M3 ("FN": no infinities, 0x7F/0xFF NaN, max finite 448) encoding that is
// bit-identical to openvc::reference::e4m3_encode (docs/numerics.md section 1):
// round to nearest even, saturate to +-448, NaN -> 0x7F, sign kept on values that round to zero.
#pragma once
#include <cstdint>

namespace openvc::detail {

// Four floats -> four E4M3 codes, x0 in the low byte.
// cvt.rn.satfinite.e4m3x2.f32 is the hardware RNE conversion with saturation to +-448. It turns
// a NaN into an E4M3 NaN whose sign is not specified, so every code whose low 7 bits are all set
// (0x7F or 0xFF, which no finite input can produce: satfinite stops at 0x7E / 0xFE) is rewritten
// to the contract's 0x7F: three integer ops per four codes.
__device__ __forceinline__ uint32_t e4m3_encode4(float x0, float x1, float x2, float x3) {
  uint32_t w;
  // cvt d, a, b puts a in the upper byte of d and b in the lower one.
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}"
      : "=r"(w)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  const uint32_t nan = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;  // 0x80 where low7 == 0x7F
  return w & ~nan;
}

__device__ __forceinline__ uint8_t e4m3_encode(float x) {
  return static_cast<uint8_t>(e4m3_encode4(x, 0.0f, 0.0f, 0.0f) & 0xFFu);
}

// Two E4M3 codes (the low byte first) -> their values, exactly (every E4M3 value is an FP16 value; NaN codes give
// NaN): one cvt.rn.f16x2.e4m3x2 and two FP16 -> FP32 conversions.
__device__ __forceinline__ float2 e4m3_decode2(uint16_t codes) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(codes));
  float lo, hi;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi)
      : "r"(h2));
  return make_float2(lo, hi);
}

}  // namespace openvc::detail
