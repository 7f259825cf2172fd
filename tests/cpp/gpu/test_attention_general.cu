// The general attention path (openvc::attention_general) against the CPU reference fed the SAME
// quantized inputs and order. The kernel implements the reference arithmetic (exact FP8 dot products,
// the same codes, maxima and tile sums), so it must match the reference's output rounded to BF16
// almost everywhere; only A's FP32 accumulation (the reference keeps double) can move an element by
// one BF16 step. Also against exact FP64 attention: as accurate as the reference. Inputs are prepared
// on the host by the reference and packed here, so these tests do not depend on prepare_fp8.
// Run: openvc_gpu_tests --gtest_filter='GeneralAttention*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention_case.h"
#include "gpu/attention_test_util.h"
#include "gpu/gpu_test_util.h"
#include "openvc/general.h"
#include "openvc/reference.h"
#include "reference/test_inputs.h"

namespace {

namespace ref = openvc::reference;
using namespace openvc::testing::attention_case;

TEST(GeneralAttention, BatchedNonCausalShapes) {
  SKIP_WITHOUT_SM90();
  for (int s : {1, 127, 128, 1000}) run_case(batched(2, s, s, 2, 128, false, 4, true));
  run_case(batched(1, 1000, 1000, 1, 128, false, ref::kNaturalOrder, false));
}

TEST(GeneralAttention, CausalSelf) {
  SKIP_WITHOUT_SM90();
  for (int d : {128, 64}) {
    run_case(batched(1, 1000, 1000, 2, d, true, 4, true));
    run_case(batched(2, 127, 127, 1, d, true, ref::kNaturalOrder, false));
  }
  run_case(batched(1, 1, 1, 1, 128, true, 4, false));
}

TEST(GeneralAttention, CausalCross) {
  SKIP_WITHOUT_SM90();
  run_case(batched(1, 300, 1000, 2, 128, true, 4, true));    // Sq < Sk: every row sees Sk - Sq + i + 1 keys
  run_case(batched(2, 1000, 300, 1, 64, true, 4, false));    // Sq > Sk: the first 700 rows see no key
  run_case(batched(1, 1000, 128, 1, 128, true, ref::kNaturalOrder, true));
}

TEST(GeneralAttention, CrossNonCausal) {
  SKIP_WITHOUT_SM90();
  run_case(batched(2, 200, 1000, 2, 64, false, ref::kNaturalOrder, true));
  run_case(batched(1, 1000, 200, 2, 64, false, 0, false));
  Case scaled = batched(1, 300, 700, 2, 128, false, 4, true);
  scaled.softmax_scale = 0.05f;
  scaled.padded_out = true;
  run_case(scaled);
}

TEST(GeneralAttention, PackedThreeSequences) {
  SKIP_WITHOUT_SM90();
  run_case(Case{{1, 300, 1000}, {1000, 300, 1}, true, 2, 128, false, 4, true});
  run_case(Case{{1, 300, 1000}, {1, 300, 1000}, true, 2, 64, true, 4, true});
  run_case(Case{{1, 300, 1000}, {700, 129, 1000}, true, 1, 128, true, ref::kNaturalOrder, false});
  // max_seqlen given above the true maximum (an upper bound is allowed), padded output rows.
  Case bound{{300, 1, 1000}, {1000, 300, 1}, true, 2, 64, false, 4, false};
  bound.extra_max = 200;
  bound.padded_out = true;
  run_case(bound);
}

TEST(GeneralAttention, PackedEmptySequences) {
  SKIP_WITHOUT_SM90();
  // An empty key sequence gives output 0 and lse -inf; an empty query sequence writes nothing.
  run_case(Case{{5, 0, 200, 130}, {0, 100, 130, 300}, true, 2, 128, false, 4, false});
  run_case(Case{{5, 0, 200, 130}, {0, 100, 130, 300}, true, 2, 64, true, 4, true});
}

// ---- argument checks (no device needed) ----------------------------------------------------------

void expect_invalid(const openvc::GeneralAttentionParams& p, const std::string& needle) {
  const openvc::Status st = openvc::attention_general(p, nullptr);
  EXPECT_EQ(st.code(), openvc::StatusCode::kInvalidArgument) << needle << ": " << st.message();
  EXPECT_NE(st.message().find(needle), std::string::npos) << "expected '" << needle << "' in: " << st.message();
}

TEST(GeneralAttention, RejectsBadArguments) {
  alignas(16) static uint8_t fake[256];
  const float* f = reinterpret_cast<const float*>(fake);
  openvc::GeneralAttentionParams good;
  good.in = {1, 200, 300, 2, 128, fake, f, fake, f, fake, f};
  good.out = fake;
  good.out_stride_batch = 200 * 256, good.out_stride_seq = 256, good.out_stride_head = 128;
  auto p = good;
  p.in.head_dim = 96;
  expect_invalid(p, "in.head_dim: the general path takes 64 or 128, got 96");
  p = good, p.in.qk_format = openvc::QkFormat::kInt8;   // INT8 codes run on the fast path only
  {
    const openvc::Status st = openvc::attention_general(p, nullptr);
    EXPECT_EQ(st.code(), openvc::StatusCode::kUnsupported) << st.message();
    EXPECT_NE(st.message().find("in.qk_format"), std::string::npos) << st.message();
  }
  p = good, p.in.heads = 0;
  expect_invalid(p, "in.heads");
  p = good, p.in.seqlen_k = -1;
  expect_invalid(p, "seqlen_k >= 0");
  p = good, p.num_seqs = 2;
  expect_invalid(p, "only used with cu_seqlens");
  p = good, p.cu_seqlens_q = reinterpret_cast<const int*>(fake);
  expect_invalid(p, "packed sequences need both offset arrays");
  p.cu_seqlens_k = reinterpret_cast<const int*>(fake + 1);
  expect_invalid(p, "4-byte aligned");
  p.cu_seqlens_k = reinterpret_cast<const int*>(fake);
  expect_invalid(p, "num_seqs: expected 1..65535");
  p.num_seqs = 2, p.max_seqlen_q = -1;
  expect_invalid(p, "max_seqlen_q, max_seqlen_k: expected >= 0");
  p.max_seqlen_q = 10;   // total_q/total_k unset: offsets could not be clamped
  expect_invalid(p, "total_q, total_k: the token rows");
  p = good, p.in.v_packed = nullptr;
  expect_invalid(p, "in.v_packed must not be null");
  p = good, p.in.k_descale = reinterpret_cast<const float*>(fake + 2);
  expect_invalid(p, "in.k_descale is misaligned");
  p = good, p.out_stride_seq = 0;
  expect_invalid(p, "out strides");
  p = good, p.lse = reinterpret_cast<float*>(fake);   // lse strides left unset
  expect_invalid(p, "lse strides");
  p = good, p.softmax_scale = NAN;
  expect_invalid(p, "softmax_scale must be finite");
  p = good, p.mid_window_blocks = -2;
  expect_invalid(p, "mid_window_blocks must be >= 0 or kNaturalOrder");
  // No query rows: nothing to do, and nothing touches the device.
  p = good, p.in.seqlen_q = 0;
  EXPECT_TRUE(openvc::attention_general(p, nullptr).ok());
}

}  // namespace
