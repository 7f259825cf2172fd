// The exp2 P format's code sequences on the device (numerics section 10) against the reference's code
// functions, score by score: keys 0-63 (MUFU ex2 + the E4M3 conversion) within one step of exp2_code, keys 64-127
// (the f16x2 polynomial) equal to exp2_poly_code. The format in the kernel: test_attention_sm90_int8_modes.cu.
// Run: openvc_gpu_tests --gtest_filter='Sm90Int8Exp2P.Device*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "attention/sm90/expcast.cuh"
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
// 120 - M), 120) as in the kernel's clipped tiles (unclipped tiles have x <= 120.25, which codes 120 either way).
// The f16 operations are deterministic and the reference rounds each one, so every code must be equal: this pins
// the operand order of the f16x2 conversion, the constants and the NaN byte.
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
}

}  // namespace
