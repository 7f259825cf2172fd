// E4M3 (FN) encoding and decoding, BF16 rounding, and the dot-product kernels of the reference.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "reference/internal.h"

namespace openvc::reference {

// Exact arithmetic throughout: scaling by a power of two and std::nearbyint (default rounding mode,
// round to nearest even) are exact on the float, so the only rounding is the one to 3 mantissa bits.
uint8_t e4m3_encode(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float ax = std::fabs(x);
  // Saturating conversion (cvt ... .satfinite): everything at or above the largest finite value maps
  // to it. Values in (448, 464) would round to 448 anyway; beyond, saturation is the contract.
  if (ax >= kE4M3Max) return sign | 0x7E;
  // Subnormal range (exp field 0): value = m * 2^-9 for m = 0..7. m = 8 after rounding is 2^-6,
  // whose bit pattern (exp 1, mantissa 0) is also 8, so the carry needs no special case.
  if (ax < 0x1p-6f) {
    const float m = std::nearbyint(ax * 0x1p9f);
    return sign | static_cast<uint8_t>(m);
  }
  // Normal: ax = f * 2^e2 with f in [0.5, 1); the significand f*16 in [8, 16) rounds to 3 bits.
  int e2 = 0;
  const float f = std::frexp(ax, &e2);
  int e = e2 - 1;                                  // ax = (f*2) * 2^e, f*2 in [1, 2)
  int m = static_cast<int>(std::nearbyint(f * 16.0f));  // in [8, 16]
  if (m == 16) {                                   // rounded up to the next binade
    m = 8;
    ++e;
  }
  const int field = e + 7;                         // in [1, 15] because 2^-6 <= ax < 448
  return sign | static_cast<uint8_t>((field << 3) | (m - 8));
}

float e4m3_decode(uint8_t code) {
  const bool neg = (code & 0x80) != 0;
  const int field = (code >> 3) & 0xF;
  const int mant = code & 0x7;
  if (field == 0xF && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  const float mag = field == 0 ? std::ldexp(static_cast<float>(mant), -9)
                               : std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, field - 7);
  return neg ? -mag : mag;
}

float round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    bits = (bits | 0x00400000u) & 0xFFFF0000u;  // keep it a (quiet) NaN after truncation
  } else {
    bits += 0x7FFFu + ((bits >> 16) & 1u);       // round half to even; overflow rounds to inf
    bits &= 0xFFFF0000u;
  }
  float y;
  std::memcpy(&y, &bits, sizeof y);
  return y;
}

namespace internal {

std::vector<double> decode_rows(const uint8_t* base, int64_t tokens, int64_t stride, int head_dim) {
  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = e4m3_decode(static_cast<uint8_t>(c));
  std::vector<double> out(static_cast<size_t>(tokens) * head_dim);
  for (int64_t t = 0; t < tokens; ++t) {
    const uint8_t* row = base + t * stride;
    for (int c = 0; c < head_dim; ++c) out[t * head_dim + c] = table[row[c]];
  }
  return out;
}

float ideal_dot(const double* a, const double* b, int n) {
  // Four independent partial sums only for speed: the sum is exact in any order (see internal.h).
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int c = 0;
  for (; c + 4 <= n; c += 4) {
    s0 += a[c] * b[c];
    s1 += a[c + 1] * b[c + 1];
    s2 += a[c + 2] * b[c + 2];
    s3 += a[c + 3] * b[c + 3];
  }
  for (; c < n; ++c) s0 += a[c] * b[c];
  return static_cast<float>((s0 + s1) + (s2 + s3));
}

std::vector<double> key_panels(const double* rows, int64_t tokens, int head_dim) {
  static_assert(kQuantBlock % kPanel == 0, "a key block is a whole number of panels");
  const int64_t nblk = (tokens + kQuantBlock - 1) / kQuantBlock;
  std::vector<double> out(static_cast<size_t>(nblk) * head_dim * kQuantBlock, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    // Panel index t / kPanel (blocks are consecutive panels), lane t % kPanel.
    double* dst = &out[static_cast<size_t>(t / kPanel) * head_dim * kPanel + t % kPanel];
    for (int c = 0; c < head_dim; ++c) dst[static_cast<size_t>(c) * kPanel] = rows[t * head_dim + c];
  }
  return out;
}

void block_dots2(const double* q0, const double* q1, const double* block_panels, int head_dim, double* acc0,
                 double* acc1) {
  static_assert(kPanel == 8, "the kernel below holds a panel in four pairs");
#if defined(__GNUC__)
  // Two-lane vectors (GCC/Clang extension, SSE2/NEON width): at -O3 GCC would otherwise vectorize the
  // loop over c as an in-order reduction and spill, about 2.5x slower. The sums are the same.
  typedef double pair __attribute__((vector_size(16)));
  for (int j0 = 0; j0 < kQuantBlock; j0 += kPanel) {
    const double* kp = block_panels + static_cast<size_t>(j0) * head_dim;
    pair s0[4] = {}, s1[4] = {};
    for (int c = 0; c < head_dim; ++c) {
      const pair a = {q0[c], q0[c]}, b = {q1[c], q1[c]};
      for (int u = 0; u < 4; ++u) {
        pair k;
        std::memcpy(&k, kp + c * kPanel + 2 * u, sizeof k);
        s0[u] += a * k;
        s1[u] += b * k;
      }
    }
    for (int u = 0; u < 4; ++u) {
      for (int e = 0; e < 2; ++e) {
        acc0[j0 + 2 * u + e] = s0[u][e];
        acc1[j0 + 2 * u + e] = s1[u][e];
      }
    }
  }
#else
  for (int j0 = 0; j0 < kQuantBlock; j0 += kPanel) {
    const double* kp = block_panels + static_cast<size_t>(j0) * head_dim;
    double s0[kPanel] = {}, s1[kPanel] = {};
    for (int c = 0; c < head_dim; ++c) {
      for (int u = 0; u < kPanel; ++u) {
        s0[u] += q0[c] * kp[c * kPanel + u];
        s1[u] += q1[c] * kp[c * kPanel + u];
      }
    }
    for (int u = 0; u < kPanel; ++u) {
      acc0[j0 + u] = s0[u];
      acc1[j0 + u] = s1[u];
    }
  }
#endif
}

void axpy4(double* acc, int head_dim, const double p[4], const double* const v[4]) {
  const double p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
  const double *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];
  for (int c = 0; c < head_dim; ++c) acc[c] += (p0 * v0[c] + p1 * v1[c]) + (p2 * v2[c] + p3 * v3[c]);
}

}  // namespace internal
}  // namespace openvc::reference
