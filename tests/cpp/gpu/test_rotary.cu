// openvc::rotary_pairs (openvc/rotary.h) against the same arithmetic on the CPU, bit for bit: each product
// and the sum rounded to FP32 separately, then to the output dtype; strided x, broadcast tables, in place and
// into a poisoned buffer whose other elements stay; and the argument errors naming the field.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "openvc/rotary.h"

namespace openvc {
namespace {

using testing::DevBuf;

// Round-to-nearest-even FP32 -> BF16 / FP16 bits on the host (finite inputs).
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t to_bits(float f, DType t) {
  if (t == DType::kBFloat16) return to_bf16(f);
  const __half h = __float2half_rn(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float from_bits(uint16_t b, DType t) {
  if (t == DType::kBFloat16) return from_bf16(b);
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}

// volatile: each product rounded on its own, never contracted into a fused multiply-add.
float mul(float a, float b) {
  volatile float p = a * b;
  return p;
}

struct Case {
  DType dtype;
  int batch, seqlen, heads, head_dim;
  bool per_pair_tables;   // Mochi's [S, H, D/2] (shared by a pair's two elements) or [S, D] shared by heads
  bool in_place;
};

class RotaryPairs : public ::testing::TestWithParam<Case> {};

TEST_P(RotaryPairs, SameBitsAsSeparatelyRoundedFp32) {
  SKIP_WITHOUT_SM90();
  const Case c = GetParam();
  const int pairs = c.head_dim / 2;
  // x lives in a [B, H, S + 3, D] buffer (rows 0..2 of each head are not part of x): x is the strided view
  // [B, S, H, D] of rows 3.., as diffusers' CogVideoX processor rotates the rows after its text.
  const int rows_total = c.seqlen + 3;
  const size_t n = static_cast<size_t>(c.batch) * c.heads * rows_total * c.head_dim;
  std::mt19937 rng(c.head_dim * 31 + c.seqlen);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_real_distribution<float> angle(0.f, 40.f);
  std::vector<uint16_t> host(n);
  for (auto& v : host) v = to_bits(normal(rng), c.dtype);
  const size_t table_n = c.per_pair_tables ? static_cast<size_t>(c.seqlen) * c.heads * pairs
                                           : static_cast<size_t>(c.seqlen) * c.head_dim;
  std::vector<float> cos_t(table_n), sin_t(table_n);
  for (size_t i = 0; i < table_n; ++i) {
    const float a = angle(rng);
    cos_t[i] = std::cos(a);
    sin_t[i] = std::sin(a);
  }

  DevBuf x(n * 2), out(n * 2), dcos(table_n * 4), dsin(table_n * 4);
  ASSERT_TRUE(x.p && out.p && dcos.p && dsin.p);
  ASSERT_TRUE(testing::upload(x.p, host) && testing::upload(dcos.p, cos_t) && testing::upload(dsin.p, sin_t));
  CUDA_OK(cudaMemset(out.p, 0xFF, n * 2));   // NaN in both dtypes: every element not written stays so

  RotaryPairsParams p;
  p.dtype = c.dtype;
  p.batch = c.batch, p.seqlen = c.seqlen, p.heads = c.heads, p.head_dim = c.head_dim;
  const int64_t sb = static_cast<int64_t>(c.heads) * rows_total * c.head_dim, ss = c.head_dim,
                sh = static_cast<int64_t>(rows_total) * c.head_dim, offset = 3 * c.head_dim;
  p.x = {x.as<uint16_t>() + offset, sb, ss, sh};
  p.out = (c.in_place ? x.as<uint16_t>() : out.as<uint16_t>()) + offset;
  p.out_stride_batch = sb, p.out_stride_seq = ss, p.out_stride_head = sh;
  p.cos = dcos.as<float>(), p.sin = dsin.as<float>();
  if (c.per_pair_tables) {
    p.table_stride_seq = static_cast<int64_t>(c.heads) * pairs, p.table_stride_head = pairs;
    p.table_stride_pair = 1, p.table_stride_half = 0;
  } else {
    p.table_stride_seq = c.head_dim, p.table_stride_head = 0, p.table_stride_pair = 2, p.table_stride_half = 1;
  }
  ASSERT_TRUE(rotary_pairs(p, nullptr).ok());
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = testing::download<uint16_t>(c.in_place ? x.p : out.p, n);
  ASSERT_EQ(got.size(), n);

  size_t mismatches = 0;
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.heads; ++h)
      for (int r = 0; r < rows_total; ++r)
        for (int j = 0; j < pairs; ++j) {
          const size_t i = ((static_cast<size_t>(b) * c.heads + h) * rows_total + r) * c.head_dim + 2 * j;
          uint16_t want0, want1;
          if (r < 3) {   // not part of x: untouched (in place: the input; else the poison)
            want0 = c.in_place ? host[i] : uint16_t{0xFFFF};
            want1 = c.in_place ? host[i + 1] : uint16_t{0xFFFF};
          } else {
            const int s = r - 3;
            const size_t t = c.per_pair_tables ? (static_cast<size_t>(s) * c.heads + h) * pairs + j
                                               : static_cast<size_t>(s) * c.head_dim + 2 * j;
            const size_t t1 = c.per_pair_tables ? t : t + 1;
            const float a = from_bits(host[i], c.dtype), bb = from_bits(host[i + 1], c.dtype);
            want0 = to_bits(mul(a, cos_t[t]) - mul(bb, sin_t[t]), c.dtype);
            want1 = to_bits(mul(bb, cos_t[t1]) + mul(a, sin_t[t1]), c.dtype);
          }
          mismatches += (got[i] != want0) + (got[i + 1] != want1);
        }
  EXPECT_EQ(mismatches, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Forms, RotaryPairs,
    ::testing::Values(Case{DType::kBFloat16, 2, 75, 3, 64, false, true}, Case{DType::kBFloat16, 1, 130, 4, 128, true, false},
                      Case{DType::kFloat16, 2, 17, 5, 128, false, false}, Case{DType::kFloat16, 1, 9, 2, 512, true, true},
                      Case{DType::kBFloat16, 3, 11, 7, 6, true, false}));

TEST(RotaryPairsArguments, ErrorsNameTheField) {
  RotaryPairsParams p;
  p.batch = 1, p.seqlen = 4, p.heads = 2, p.head_dim = 63;
  EXPECT_NE(rotary_pairs(p, nullptr).message().find("head_dim must be even"), std::string::npos);
  p.head_dim = 64;
  EXPECT_NE(rotary_pairs(p, nullptr).message().find("x.data is null"), std::string::npos);
  alignas(16) static uint16_t buf[1024];
  static float table[256];
  p.x = {buf + 1, 0, 128, 64};
  p.out = buf;
  p.cos = table, p.sin = table;
  EXPECT_NE(rotary_pairs(p, nullptr).message().find("x must be 4-byte aligned"), std::string::npos);
  p.x = {buf, 0, 128, 64};
  p.out_stride_seq = 127;
  EXPECT_NE(rotary_pairs(p, nullptr).message().find("out must be 4-byte aligned with even strides"),
            std::string::npos);
  p.sin = nullptr;
  EXPECT_NE(rotary_pairs(p, nullptr).message().find("sin is null"), std::string::npos);
  p.seqlen = 0;   // nothing to do: no pointer is read
  EXPECT_TRUE(rotary_pairs(p, nullptr).ok());
}

}  // namespace
}  // namespace openvc
