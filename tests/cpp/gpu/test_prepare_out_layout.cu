// prepare_fp8 writing K and V inside larger buffers (PrepareParams::k_codes_rows, k_descale_blocks,
// v_packed_columns, v_descale_per_block: an FP8 KV cache's slots), with K and V optionally in two parts
// (kv_prefix_len, k_prefix, v_prefix: the cache's remainder and the new chunk). The same call runs twice, once into
// buffers of its own size (the default layout, which test_prepare*.cu check against the CPU reference) and
// once into poisoned larger buffers at a block offset: every byte written there must equal the default
// call's, per block descale included, and every byte around it must keep its poison.
// Run: openvc_gpu_tests --gtest_filter='*PrepareOutLayout*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/prepare_test_util.h"
#include "openvc/attention.h"

namespace {

using openvc::DType;
using openvc::PrepareParams;
using openvc::QkFormat;
using namespace openvc::testing;  // DevBuf, download, Tensor, DevTensor, expect_codes, ...

constexpr int kB = 2, kSq = 200, kSk = 300, kH = 3, kD = 128;
constexpr int kSlots = 1024, kSlotBlocks = kSlots / 128;  // the larger buffers: 8 blocks per (batch, head)
constexpr int kFirstBlock = 2;                            // the call writes from slot 256 on
constexpr uint8_t kPoison = 0xAB;

struct SlotOutputs {
  std::vector<uint8_t> k_codes, v_packed, q_codes;
  std::vector<float> k_descale, v_descale, q_descale;
};

// Tokens [from, to) of x as a tensor of its own.
Tensor token_range(const Tensor& x, int from, int to) {
  Tensor y{x.B, to - from, x.H, x.D, {}, {}};
  for (int b = 0; b < x.B; ++b) {
    const auto first = x.index(b, from, 0, 0), last = x.index(b, to - 1, x.H - 1, x.D - 1) + 1;
    y.bits.insert(y.bits.end(), x.bits.begin() + first, x.bits.begin() + last);
    y.values.insert(y.values.end(), x.values.begin() + first, x.values.begin() + last);
  }
  return y;
}

// One preparation of (q, k, v) with `fmt`; `cache` selects the larger buffers and the layout fields; with
// `prefix`, K and V are given in two parts (k, v then hold the keys from prefix->first on).
struct Prefix {
  const DevTensor &k, &v;
  int len;
};
SlotOutputs prepare(QkFormat fmt, bool cache, const DevTensor& q, const DevTensor& k, const DevTensor& v,
                    const Prefix* prefix = nullptr) {
  const int nq = int(openvc::num_quant_blocks(kSq)), nk = int(openvc::num_quant_blocks(kSk));
  const int64_t sk_pad = openvc::packed_seqlen_k(kSk);
  const int groups = fmt == QkFormat::kInt8 ? openvc::kInt8KeyGroups : 1;
  const int64_t rows = cache ? kSlots : kSk, blocks = cache ? kSlotBlocks : nk, cols = cache ? kSlots : sk_pad;
  DevBuf q_codes(size_t(kB) * kSq * kH * kD), q_descale(size_t(kB) * kH * (fmt == QkFormat::kInt8 ? kSq : nq) * 4);
  DevBuf k_codes(size_t(kB) * rows * kH * kD), k_descale(size_t(kB) * kH * blocks * groups * 4);
  DevBuf v_packed(size_t(kB) * kH * kD * cols), v_descale(size_t(kB) * kH * (cache ? blocks : 1) * 4);
  DevBuf ws(openvc::prepare_workspace_bytes(kB, kH, kSk, false));
  for (const DevBuf* b : {&q_codes, &q_descale, &k_codes, &k_descale, &v_packed, &v_descale, &ws})
    EXPECT_EQ(cudaMemset(b->p, kPoison, b->bytes), cudaSuccess);
  PrepareParams p;
  p.dtype = DType::kBFloat16;
  p.qk_format = fmt;
  p.batch = kB;
  p.seqlen_q = kSq;
  p.seqlen_k = kSk;
  p.heads = kH;
  p.head_dim = kD;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  const int64_t t0 = cache ? kFirstBlock * 128 : 0, b0 = cache ? kFirstBlock : 0;
  p.q_codes = q_codes.as<uint8_t>();
  p.q_descale = q_descale.as<float>();
  p.k_codes = k_codes.as<uint8_t>() + t0 * kH * kD;
  p.k_descale = k_descale.as<float>() + b0 * groups;
  p.v_packed = v_packed.as<uint8_t>() + t0;
  p.v_descale = v_descale.as<float>() + b0;
  p.workspace = ws.p;
  p.workspace_bytes = ws.bytes;
  if (prefix != nullptr) {
    p.kv_prefix_len = prefix->len;
    p.k_prefix = prefix->k.view();
    p.v_prefix = prefix->v.view();
  }
  if (cache) {
    p.k_codes_rows = kSlots;
    p.k_descale_blocks = kSlotBlocks;
    p.v_packed_columns = kSlots;
    p.v_descale_per_block = true;
  }
  const openvc::Status st = openvc::prepare_fp8(p, nullptr);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {download<uint8_t>(k_codes.p, k_codes.bytes),     download<uint8_t>(v_packed.p, v_packed.bytes),
          download<uint8_t>(q_codes.p, q_codes.bytes),     download<float>(k_descale.p, k_descale.bytes / 4),
          download<float>(v_descale.p, v_descale.bytes / 4), download<float>(q_descale.p, q_descale.bytes / 4)};
}

// The K and V inputs split at `split` keys: the first part contiguous, the rest strided (padded). A first part
// of every key (split = kSk) leaves k and v unread: they get one token of their own.
struct TwoParts {
  DevTensor k0, v0, k1, v1;
  TwoParts(const Tensor& k, const Tensor& v, int split)
      : k0(DType::kBFloat16, token_range(k, 0, split), strides_of(Layout::kContiguous, split, kH, kD)),
        v0(DType::kBFloat16, token_range(v, 0, split), strides_of(Layout::kContiguous, split, kH, kD)),
        k1(DType::kBFloat16, token_range(k, rest_from(split), kSk), strides_of(Layout::kPadded, kSk - rest_from(split), kH, kD)),
        v1(DType::kBFloat16, token_range(v, rest_from(split), kSk), strides_of(Layout::kPadded, kSk - rest_from(split), kH, kD)) {}
  static int rest_from(int split) { return split < kSk ? split : kSk - 1; }
};

// One call's random BF16 q, k, v and their contiguous device copies.
struct CallInputs {
  std::mt19937 rng;
  Tensor q, k, v;
  DevTensor dq, dk, dv;
  explicit CallInputs(uint32_t seed)
      : rng(seed),
        q(random_tensor(DType::kBFloat16, kB, kSq, kH, kD, rng)),
        k(random_tensor(DType::kBFloat16, kB, kSk, kH, kD, rng)),
        v(random_tensor(DType::kBFloat16, kB, kSk, kH, kD, rng)),
        dq(DType::kBFloat16, q, strides_of(Layout::kContiguous, kSq, kH, kD)),
        dk(DType::kBFloat16, k, strides_of(Layout::kContiguous, kSk, kH, kD)),
        dv(DType::kBFloat16, v, strides_of(Layout::kContiguous, kSk, kH, kD)) {}
};

// Q (never in two parts, never in a cache's layout) must come out the same in every run.
void expect_same_q(const SlotOutputs& a, const SlotOutputs& b) {
  EXPECT_TRUE(a.q_codes == b.q_codes) << "Q codes differ from the one-part, default-layout run";
  EXPECT_EQ(a.q_descale.size(), b.q_descale.size());
  EXPECT_EQ(std::memcmp(a.q_descale.data(), b.q_descale.data(), 4 * std::min(a.q_descale.size(), b.q_descale.size())), 0)
      << "Q descales differ from the one-part, default-layout run";
}

bool poison_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u == 0xABABABABu;
}

// (format, keys in the first part: 0 = one part). 200: block 0 and 72 keys of block 1 from the first part;
// 128: exactly block 0; kSk: every key.
class PrepareOutLayout : public ::testing::TestWithParam<std::tuple<QkFormat, int>> {};

TEST_P(PrepareOutLayout, CacheSlotsHoldTheDefaultLayoutsBytes) {
  SKIP_WITHOUT_SM90();
  const QkFormat fmt = std::get<0>(GetParam());
  const int split = std::get<1>(GetParam());
  const CallInputs in((fmt == QkFormat::kInt8 ? 71u : 17u) + uint32_t(split));
  const Tensor &k = in.k, &v = in.v;
  const DevTensor &dq = in.dq, &dk = in.dk, &dv = in.dv;
  const SlotOutputs own = prepare(fmt, false, dq, dk, dv);
  // The second run: into the slots, with K and V in two parts when split > 0.
  auto two_parts = [&] {
    const TwoParts tp(k, v, split);
    const Prefix parts{tp.k0, tp.v0, split};
    return prepare(fmt, true, dq, tp.k1, tp.v1, &parts);
  };
  const SlotOutputs slots = split > 0 ? two_parts() : prepare(fmt, true, dq, dk, dv);
  expect_same_q(own, slots);
  const int nk = int(openvc::num_quant_blocks(kSk));
  const int64_t sk_pad = openvc::packed_seqlen_k(kSk), t0 = kFirstBlock * 128;
  const int groups = fmt == QkFormat::kInt8 ? openvc::kInt8KeyGroups : 1;
  ASSERT_FALSE(own.k_codes.empty() || slots.k_codes.empty() || own.v_packed.empty() || slots.v_packed.empty());
  int64_t code_diff = 0, k_poison_lost = 0;
  for (int b = 0; b < kB; ++b)
    for (int s = 0; s < kSlots; ++s)
      for (int e = 0; e < kH * kD; ++e) {
        const uint8_t got = slots.k_codes[(int64_t(b) * kSlots + s) * kH * kD + e];
        if (s >= t0 && s < t0 + kSk) {  // the call's keys (padding keys' codes are never written)
          code_diff += got != own.k_codes[(int64_t(b) * kSk + (s - t0)) * kH * kD + e];
        } else if (s < t0 || s >= t0 + nk * 128) {
          k_poison_lost += got != kPoison;
        }
      }
  EXPECT_EQ(code_diff, 0) << "K codes in the slots differ from the default layout's";
  EXPECT_EQ(k_poison_lost, 0) << "K code bytes outside the call's blocks were written";
  int64_t v_diff = 0, v_poison_lost = 0;
  for (int64_t r = 0; r < int64_t(kB) * kH * kD; ++r)
    for (int64_t c = 0; c < kSlots; ++c) {
      const uint8_t got = slots.v_packed[r * kSlots + c];
      if (c >= t0 && c < t0 + sk_pad) {  // the call's blocks, zero padding included
        v_diff += got != own.v_packed[r * sk_pad + (c - t0)];
      } else {
        v_poison_lost += got != kPoison;
      }
    }
  EXPECT_EQ(v_diff, 0) << "packed V in the slots differs from the default layout's";
  EXPECT_EQ(v_poison_lost, 0) << "packed V columns outside the call's blocks were written";
  for (int bh = 0; bh < kB * kH; ++bh)
    for (int blk = 0; blk < kSlotBlocks; ++blk) {
      const bool mine = blk >= kFirstBlock && blk < kFirstBlock + nk;
      const float vd = slots.v_descale[bh * kSlotBlocks + blk];
      if (mine) {
        EXPECT_EQ(std::memcmp(&vd, &own.v_descale[bh], 4), 0) << "v_descale of (batch, head) " << bh << " block " << blk;
      } else {
        EXPECT_TRUE(poison_float(vd)) << "v_descale outside the call's blocks written: " << bh << ", " << blk;
      }
      for (int g = 0; g < groups; ++g) {
        const float kd = slots.k_descale[(bh * kSlotBlocks + blk) * groups + g];
        if (mine) {
          const float want = own.k_descale[(bh * nk + blk - kFirstBlock) * groups + g];
          EXPECT_EQ(std::memcmp(&kd, &want, 4), 0) << "k_descale of (batch, head) " << bh << " block " << blk;
        } else {
          EXPECT_TRUE(poison_float(kd)) << "k_descale outside the call's blocks written: " << bh << ", " << blk;
        }
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Prepare, PrepareOutLayout,
                         ::testing::Combine(::testing::Values(QkFormat::kE4M3, QkFormat::kInt8),
                                            ::testing::Values(0, 200, 1, 128, kSk)),
                         [](const ::testing::TestParamInfo<std::tuple<QkFormat, int>>& i) {
                           return std::string(std::get<0>(i.param) == QkFormat::kInt8 ? "int8" : "e4m3") +
                                  (std::get<1>(i.param) ? "_first_part_" + std::to_string(std::get<1>(i.param))
                                                        : "_one_part");
                         });

// K and V in two parts with the default output layout (kv_prefix_len alone: the KV-cache kernels with one V
// descale per head) give the one-part call's bytes.
class PrepareTwoParts : public ::testing::TestWithParam<QkFormat> {};

TEST_P(PrepareTwoParts, DefaultLayoutEqualsOnePart) {
  SKIP_WITHOUT_SM90();
  const QkFormat fmt = GetParam();
  const CallInputs in(fmt == QkFormat::kInt8 ? 5u : 6u);
  const SlotOutputs own = prepare(fmt, false, in.dq, in.dk, in.dv);
  const TwoParts tp(in.k, in.v, 200);
  const Prefix parts{tp.k0, tp.v0, 200};
  const SlotOutputs two = prepare(fmt, false, in.dq, tp.k1, tp.v1, &parts);
  expect_same_q(own, two);
  ASSERT_EQ(own.k_codes.size(), two.k_codes.size());
  int64_t code_diff = 0;   // the valid keys' codes (padding keys' are never written)
  for (int64_t i = 0; i < int64_t(own.k_codes.size()); ++i) code_diff += own.k_codes[i] != two.k_codes[i];
  EXPECT_EQ(code_diff, 0) << "K codes of the two-part call differ from the one-part call's";
  EXPECT_TRUE(own.v_packed == two.v_packed) << "packed V of the two-part call differs";
  EXPECT_EQ(own.k_descale.size(), two.k_descale.size());
  EXPECT_EQ(std::memcmp(own.k_descale.data(), two.k_descale.data(), 4 * own.k_descale.size()), 0) << "k_descale differs";
  EXPECT_EQ(own.v_descale.size(), two.v_descale.size());
  EXPECT_EQ(std::memcmp(own.v_descale.data(), two.v_descale.data(), 4 * own.v_descale.size()), 0) << "v_descale differs";
}

INSTANTIATE_TEST_SUITE_P(Prepare, PrepareTwoParts, ::testing::Values(QkFormat::kE4M3, QkFormat::kInt8),
                         [](const ::testing::TestParamInfo<QkFormat>& i) {
                           return std::string(i.param == QkFormat::kInt8 ? "int8" : "e4m3");
                         });

// Argument rules (no device needed: they fail before any CUDA call).
PrepareParams valid_cache_params() {
  PrepareParams p;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = 300;
  p.heads = 2;
  p.q = {fake_address(0x10000), 300 * 256, 256, 128};
  p.k = p.v = p.q;
  bind_fake_outputs(p);
  p.workspace_bytes = openvc::prepare_workspace_bytes(1, 2, 300, false);
  p.k_codes_rows = 1024;
  p.k_descale_blocks = 8;
  p.v_packed_columns = 1024;
  p.v_descale_per_block = true;
  return p;
}

TEST(PrepareOutLayoutArgs, RejectsTooSmallOrPackedLayouts) {
  PrepareParams p = valid_cache_params();
  p.k_codes_rows = 299;  // fewer rows than the call's keys
  expect_invalid(p, "k_codes_rows");
  p = valid_cache_params();
  p.k_descale_blocks = 2;  // 300 keys need 3 blocks
  expect_invalid(p, "k_descale_blocks");
  p = valid_cache_params();
  p.v_packed_columns = 300;  // less than the 384 packed columns of 3 blocks
  expect_invalid(p, "v_packed_columns");
  p = valid_cache_params();
  p.v_packed_columns = 1032;  // not a multiple of 16
  expect_invalid(p, "v_packed_columns");
  // Packed sequences keep the default layout.
  p = valid_cache_params();
  static const int offsets[2] = {0, 300};
  p.cu_seqlens_q = p.cu_seqlens_k = offsets;
  p.batch = p.seqlen_q = p.seqlen_k = 0;
  p.num_seqs = 1;
  p.max_seqlen_q = p.max_seqlen_k = 300;
  p.total_q = p.total_k = 300;
  p.q.stride_batch = p.k.stride_batch = p.v.stride_batch = 0;
  expect_invalid(p, "v_descale_per_block");
  // Two parts: at most seqlen_k keys in the first, a valid view, batched and unsmoothed.
  p = valid_cache_params();
  p.kv_prefix_len = 301;
  p.k_prefix = p.v_prefix = p.k;
  expect_invalid(p, "kv_prefix_len");
  p.kv_prefix_len = 100;
  p.v_prefix.data = nullptr;
  expect_invalid(p, "v_prefix.data");
  p = valid_cache_params();
  p.kv_prefix_len = 100;
  p.k_prefix = p.v_prefix = p.k;
  p.k_prefix.stride_seq = 260;
  expect_invalid(p, "k_prefix.stride_seq");
  p.k_prefix = p.k;
  p.k_smoothing = true;
  p.workspace_bytes = openvc::prepare_workspace_bytes(1, 2, 300, true);
  expect_invalid(p, "k_smoothing");
  p.kv_prefix_len = 0;  // the layout fields alone: also no smoothing
  expect_invalid(p, "k_smoothing");
}

}  // namespace
