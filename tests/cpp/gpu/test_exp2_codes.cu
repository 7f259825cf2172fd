// The exp2 P format's code sequences on the device (numerics section 10) against the reference's code
// functions, score by score: keys 0-63 (MUFU ex2 + the E4M3 conversion) within one step of exp2_code, keys 64-127
// (the f16x2 polynomial) equal to exp2_poly_code; then the kernel's tile conversion (convert_codes), column by
// column, against exp2_format_code. The format in the kernel: test_attention_sm90_int8_modes.cu.
// Run: openvc_gpu_tests --gtest_filter='Sm90Int8Exp2P.Device*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "attention/sm90/expcast.cuh"
#include "attention/sm90/softmax.cuh"
#include "gpu/gpu_test_util.h"
#include "openvc/reference.h"

namespace {

namespace ref = openvc::reference;
using openvc::testing::DevBuf;
using openvc::testing::download;

// ---- The exp2 conversion on the device against reference::exp2_code ---------------------------------
// out[4i..4i+3] = the packed register of scores {4i, 4i+1, 4i+2, 4i+3} (pairs (4i, 4i+1) and (4i+2, 4i+3),
// exp2_pair + pack_code_pairs as in convert_tile_exp2), so byte k must be score 4i+k's code: this pins
// the PTX operand order of cvt.rn.satfinite.e4m3x2 (second source -> d[7:0]) and the 16-bit join.
__global__ void exp2_codes_kernel(const float* acc, const float* a, const float* m, uint32_t* out, int n4) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  float y[4];
  for (int k = 0; k < 4; ++k)
    y[k] = fmaf(acc[4 * i + k], a[4 * i + k] * 0.125f, 8.0f - m[4 * i + k] * 0.125f);
  out[i] = openvc::sm90::pack_code_pairs(openvc::sm90::exp2_pair(y[0], y[1]), openvc::sm90::exp2_pair(y[2], y[3]));
}

// ex2.approx is at most 2 ulp from exp2: codes equal the reference's except where exp2(x) lies within a
// few ulp of an E4M3 rounding boundary, and then by one code step. Special values exactly.
TEST(Sm90Int8Exp2P, DeviceCodesMatchReferenceWithinOneStep) {
  SKIP_WITHOUT_SM90();
  const int n = 1 << 22;
  std::mt19937 rng(4321);
  std::normal_distribution<float> gauss(0.0f, 3000.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<float> acc(n), a(n), m(n);
  const float inf = INFINITY, nan = NAN;
  for (int i = 0; i < n; ++i) {
    a[i] = std::ldexp(0.5f + uni(rng), -6 - int(uni(rng) * 10));
    acc[i] = std::round(gauss(rng));                 // integer scores, as INT8's
    m[i] = acc[i] * a[i] + uni(rng) * 130.0f - 2.0f;  // x from about -8 to 8.25 (past 8: saturation)
  }
  const float specials[][3] = {{0, 8, 0}, {0, 8, 64}, {-9, 8, 64}, {-10, 8, 64}, {1, 8, 0}, {1e30f, 8, 0},
                               {inf, 8, 0}, {-inf, 8, 0}, {0, 8, inf}, {nan, 8, 0}, {1, nan, 0}, {1, 8, nan}};
  for (int k = 0; k < int(sizeof(specials) / sizeof(specials[0])); ++k)
    acc[k] = specials[k][0], a[k] = specials[k][1], m[k] = specials[k][2];
  const int nspecial = int(sizeof(specials) / sizeof(specials[0]));
  DevBuf dacc(n * 4), da(n * 4), dm(n * 4), dout(n);
  ASSERT_TRUE(openvc::testing::upload(dacc.p, acc) && openvc::testing::upload(da.p, a) &&
              openvc::testing::upload(dm.p, m));
  CUDA_OK(cudaMemset(dout.p, 0xEE, n));
  exp2_codes_kernel<<<(n / 4 + 255) / 256, 256>>>(dacc.as<float>(), da.as<float>(), dm.as<float>(), dout.as<uint32_t>(),
                                                  n / 4);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = download<uint8_t>(dout.p, n);
  ASSERT_EQ(got.size(), size_t(n));
  int64_t off_by_one = 0, worse = 0, nonzero = 0;
  for (int i = 0; i < n; ++i) {
    const uint8_t want = ref::exp2_code(acc[i], a[i], m[i]);
    nonzero += want != 0;
    if (i < nspecial) {
      EXPECT_EQ(int(got[i]), int(want)) << "special " << i << ": acc=" << acc[i] << " a=" << a[i] << " m=" << m[i];
      continue;
    }
    if (got[i] == want) continue;
    if (std::abs(int(got[i]) - int(want)) == 1) ++off_by_one;
    else if (worse++ < 5)
      ADD_FAILURE() << "acc=" << acc[i] << " a=" << a[i] << " m=" << m[i] << " device " << int(got[i])
                    << " reference " << int(want);
  }
  std::printf("  [exp2 codes] %d scores: %lld one step from the reference (%.2e)\n", n, (long long)off_by_one,
              double(off_by_one) / n);
  EXPECT_EQ(worse, 0);
  EXPECT_LE(off_by_one, n / 10000);
  EXPECT_GT(nonzero, n / 2);
}

// ---- The exp2 format's polynomial code (keys 64-127) on the device against reference::exp2_poly_code ----------
// out[i] = pack_codes(exp2_poly_pair(x0, x1), exp2_poly_pair(x2, x3)) of scores 4i..4i+3, x = min(fmaf(acc, a,
// 120 - M), 120) as in the kernel's clipped tiles (unclipped tiles have x below 120.8125, which codes 120 either
// way: the specials 120.25 and 120.75 below, unclipped, check that).
// The f16 operations are deterministic and the reference rounds each one, so every code must be equal: this pins
// the operand order of the f16x2 conversion, the constants and the NaN byte.
__global__ void raw_poly_codes_kernel(const float* x, uint32_t* out) {   // four positions, no clip
  out[0] = openvc::sm90::pack_codes(openvc::sm90::exp2_poly_pair(x[0], x[1]), openvc::sm90::exp2_poly_pair(x[2], x[3]));
}

__global__ void exp2_poly_codes_kernel(const float* acc, const float* a, const float* m, uint32_t* out, int n4) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  float x[4];
  for (int k = 0; k < 4; ++k)
    x[k] = openvc::sm90::poly_clip(fmaf(acc[4 * i + k], a[4 * i + k], 120.0f - m[4 * i + k]));
  out[i] = openvc::sm90::pack_codes(openvc::sm90::exp2_poly_pair(x[0], x[1]), openvc::sm90::exp2_poly_pair(x[2], x[3]));
}

TEST(Sm90Int8Exp2P, DevicePolyCodesEqualReference) {
  SKIP_WITHOUT_SM90();
  const int n = 1 << 22;
  std::mt19937 rng(8765);
  std::normal_distribution<float> gauss(0.0f, 3000.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<float> acc(n), a(n), m(n);
  const float inf = INFINITY, nan = NAN;
  for (int i = 0; i < n; ++i) {
    a[i] = std::ldexp(0.5f + uni(rng), -3 - int(uni(rng) * 10));
    acc[i] = std::round(gauss(rng));                 // integer scores, as INT8's
    m[i] = acc[i] * a[i] + uni(rng) * 140.0f - 4.0f;  // x from about -20 to 124 (past 120: the clip)
  }
  const float specials[][3] = {{0, 1, 0}, {5, 1, 0}, {-8, 1, 0}, {-18, 1, 0}, {-inf, 1, 0}, {-1e30f, 1, 0},
                               {0, 1, inf}, {nan, 1, 0}, {1, nan, 0}, {1, 1, nan}, {1e30f, 1, 0}, {-119.5f, 1, 0}};
  const int nspecial = int(sizeof(specials) / sizeof(specials[0]));
  for (int k = 0; k < nspecial; ++k) acc[k] = specials[k][0], a[k] = specials[k][1], m[k] = specials[k][2];
  DevBuf dacc(n * 4), da(n * 4), dm(n * 4), dout(n);
  ASSERT_TRUE(openvc::testing::upload(dacc.p, acc) && openvc::testing::upload(da.p, a) &&
              openvc::testing::upload(dm.p, m));
  CUDA_OK(cudaMemset(dout.p, 0xEE, n));
  exp2_poly_codes_kernel<<<(n / 4 + 255) / 256, 256>>>(dacc.as<float>(), da.as<float>(), dm.as<float>(),
                                                       dout.as<uint32_t>(), n / 4);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = download<uint8_t>(dout.p, n);
  ASSERT_EQ(got.size(), size_t(n));
  int64_t differ = 0, nonzero = 0;
  for (int i = 0; i < n; ++i) {
    const uint8_t want = ref::exp2_poly_code(acc[i], a[i], m[i]);
    nonzero += want != 0;
    if (got[i] != want && differ++ < 5)
      ADD_FAILURE() << (i < nspecial ? "special " : "") << "acc=" << acc[i] << " a=" << a[i] << " m=" << m[i]
                    << " device " << int(got[i]) << " reference " << int(want);
  }
  EXPECT_EQ(differ, 0);
  EXPECT_GT(nonzero, n / 2);
  // Unclipped tiles: M's own rounding (a quarter code) and that of 120 - M (half a code, for M in (-2^23, -2^23 + 120])
  // can put the row max's x up to 120.75; 120.25 and 120.75 code 120 without the clip (ties to even), 120.8125 121.
  for (const float x : {120.25f, 120.75f}) {
    DevBuf dx(4 * sizeof(float)), dc(sizeof(uint32_t));
    const std::vector<float> xs = {x, x, x, x};
    ASSERT_TRUE(openvc::testing::upload(dx.p, xs));
    raw_poly_codes_kernel<<<1, 1>>>(dx.as<float>(), dc.as<uint32_t>());
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(download<uint32_t>(dc.p, 1).at(0), 0x78787878u) << "x = " << x;
  }
}

// ---- The tile conversion as the kernel calls it: convert_codes of the exp2 mode on one warp's score fragment --------
// The wgmma accumulator layout of a 16-row slice: lane l (g = l / 4, t = l % 4) holds s[4j + 0, 1] = row g, columns
// 8j + 2t + {0, 1} and s[4j + 2, 3] = row g + 8, j = 0..15 (128 key columns); p[4kb + r] holds the codes of
// columns c, c + 1, c + 8, c + 9, c = 32kb + 16 (r >= 2) + 2t, of row g (even r) or g + 8 (odd r). Multipliers
// per row and key half (INT8 K groups: columns 0-63 half 0, 64-127 half 1), maxima per row, in reference units;
// the kernel's scaled domain is 2^-24 of them (exact).
struct TileCase {
  std::vector<int32_t> acc;   // [tiles][16][128]
  std::vector<float> a, m;    // [tiles][16][2], [tiles][16]
};

template <bool kClip>
__global__ void exp2_tile_kernel(const int32_t* acc, const float* a, const float* m, uint32_t* out) {
  const int tile = blockIdx.x, lane = threadIdx.x, g = lane / 4, t = lane % 4;
  const int32_t* rows = acc + tile * 16 * 128;
  float s[64];
  for (int j = 0; j < 16; ++j)
    for (int k = 0; k < 4; ++k) s[4 * j + k] = __int_as_float(rows[(g + 8 * (k / 2)) * 128 + 8 * j + 2 * t + k % 2]);
  const float* am = a + tile * 32;
  const openvc::sm90::QuadMult q{am[2 * g] * 0x1p-24f, am[2 * g + 1] * 0x1p-24f, am[2 * (g + 8)] * 0x1p-24f,
                                 am[2 * (g + 8) + 1] * 0x1p-24f};
  uint32_t p[16];
  const openvc::sm90::BlockMask none{128, 128, false};
  openvc::sm90::convert_codes<0, kClip, true>(m[tile * 16 + g] * 0x1p-24f, m[tile * 16 + g + 8] * 0x1p-24f, s, q,
                                              none, t, false, kClip, p);
  for (int r = 0; r < 16; ++r) out[(tile * 32 + lane) * 16 + r] = p[r];
}

// Codes [tiles][16][128] of the kernel's conversion, decoded from the registers by the layout above.
template <bool kClip>
void device_tile_codes(const TileCase& c, int tiles, std::vector<uint8_t>& codes) {
  DevBuf dacc(c.acc.size() * 4), da(c.a.size() * 4), dm(c.m.size() * 4), dout(size_t(tiles) * 32 * 16 * 4);
  EXPECT_TRUE(openvc::testing::upload(dacc.p, c.acc) && openvc::testing::upload(da.p, c.a) &&
              openvc::testing::upload(dm.p, c.m));
  CUDA_OK(cudaMemset(dout.p, 0xEE, size_t(tiles) * 32 * 16 * 4));
  exp2_tile_kernel<kClip><<<tiles, 32>>>(dacc.as<int32_t>(), da.as<float>(), dm.as<float>(), dout.as<uint32_t>());
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint32_t> regs = download<uint32_t>(dout.p, size_t(tiles) * 32 * 16);
  codes.assign(size_t(tiles) * 16 * 128, 0xEE);
  for (int tile = 0; tile < tiles && regs.size() == size_t(tiles) * 32 * 16; ++tile)
    for (int lane = 0; lane < 32; ++lane)
      for (int r = 0; r < 16; ++r)
        for (int b = 0; b < 4; ++b) {
          const int row = lane / 4 + 8 * (r % 2), kb = r / 4;
          const int col = 32 * kb + 16 * ((r % 4) >= 2) + 8 * (b / 2) + 2 * (lane % 4) + b % 2;
          codes[(size_t(tile) * 16 + row) * 128 + col] = uint8_t(regs[(size_t(tile) * 32 + lane) * 16 + r] >> (8 * b));
        }
}

// Every column at x = 102 code units (acc = 0, M = 18): the MUFU code (0x65, the E4M3 rounding) and the polynomial's
// (0x66) differ there, so the columns must split at kExp2PolyFirstKey exactly as exp2_format_code says.
TEST(Sm90Int8Exp2P, DeviceTileSplitsKeysAtTheReferencesColumn) {
  SKIP_WITHOUT_SM90();
  TileCase c{std::vector<int32_t>(16 * 128, 0), std::vector<float>(32, 1.0f), std::vector<float>(16, 18.0f)};
  ASSERT_NE(ref::exp2_code(0, 1, 18), ref::exp2_poly_code(0, 1, 18));   // the probe must tell the two apart
  std::vector<uint8_t> got;
  ASSERT_NO_FATAL_FAILURE(device_tile_codes<false>(c, 1, got));
  for (int row = 0; row < 16; ++row)
    for (int col = 0; col < 128; ++col) {
      const uint8_t want = col < ref::kExp2PolyFirstKey ? ref::exp2_code(0, 1, 18) : ref::exp2_poly_code(0, 1, 18);
      ASSERT_EQ(int(got[row * 128 + col]), int(want)) << "row " << row << " column " << col;
      ASSERT_EQ(int(want), int(ref::exp2_format_code(0, 1, 18, col)));
    }
}

// Random tiles, unclipped (M = the row's largest acc * a, as the kernel's running max) and clipped (M up to 40
// code units below it: x past 120, the general step's huge-score tiles): each column's code against
// exp2_format_code, the polynomial's columns equal, MUFU's within one step (ex2.approx, as above).
template <bool kClip>
void check_random_tiles(uint32_t seed) {
  const int tiles = 512;
  std::mt19937 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 20000.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  TileCase c{std::vector<int32_t>(size_t(tiles) * 16 * 128), std::vector<float>(size_t(tiles) * 32),
             std::vector<float>(size_t(tiles) * 16)};
  for (auto& v : c.acc) v = int32_t(std::lround(gauss(rng)));
  for (auto& v : c.a) v = std::ldexp(0.5f + uni(rng), -10 - int(uni(rng) * 4));
  for (int r = 0; r < tiles * 16; ++r) {
    float mx = -INFINITY;
    for (int col = 0; col < 128; ++col) mx = std::max(mx, float(c.acc[size_t(r) * 128 + col]) * c.a[2 * r + col / 64]);
    c.m[r] = kClip ? mx - uni(rng) * 40.0f : mx;
  }
  std::vector<uint8_t> got;
  ASSERT_NO_FATAL_FAILURE(device_tile_codes<kClip>(c, tiles, got));
  int64_t off_by_one = 0, worse = 0, poly_nonzero = 0;
  for (int r = 0; r < tiles * 16; ++r)
    for (int col = 0; col < 128; ++col) {
      const float acc = float(c.acc[size_t(r) * 128 + col]), a = c.a[2 * r + col / 64];
      const uint8_t want = ref::exp2_format_code(acc, a, c.m[r], col), dev = got[size_t(r) * 128 + col];
      if (col >= ref::kExp2PolyFirstKey) poly_nonzero += want != 0;
      if (dev == want) continue;
      if (col < ref::kExp2PolyFirstKey && std::abs(int(dev) - int(want)) == 1) ++off_by_one;
      else if (worse++ < 5)
        ADD_FAILURE() << "row " << r % 16 << " column " << col << " acc=" << acc << " a=" << a << " m=" << c.m[r]
                      << " device " << int(dev) << " reference " << int(want);
    }
  EXPECT_EQ(worse, 0);
  EXPECT_LE(off_by_one, int64_t(tiles) * 16 * 64 / 10000);
  EXPECT_GT(poly_nonzero, int64_t(tiles) * 16 * 64 / 20);
}

TEST(Sm90Int8Exp2P, DeviceTileCodesMatchTheFormatByColumn) {
  SKIP_WITHOUT_SM90();
  ASSERT_NO_FATAL_FAILURE(check_random_tiles<false>(2468));
  ASSERT_NO_FATAL_FAILURE(check_random_tiles<true>(1357));
}

}  // namespace
