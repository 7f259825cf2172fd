// V descales per 128-key block (AttentionParams::v_descale_per_block, kVBlockDescaleMode; numerics section 4,
// "V descale per key block") on the sm_90a fast path against the CPU reference weighing the same codes by the
// same block descales (AttentionOptions::v_block_descale): batched, key counts with NaN codes in the unused
// keys, packed uneven and empty sequences, natural order; and the calls the mode rejects, naming
// v_descale_per_block. INT8 Q/K: test_attention_sm90_int8_modes.cu (Sm90Int8Modes.VBlockDescales).
// Run: openvc_gpu_tests --gtest_filter='Sm90VBlockDescale*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu/attention_case.h"
#include "gpu/gpu_test_util.h"
#include "openvc/attention.h"

namespace {

using namespace openvc::testing::attention_case;
using openvc::testing::DevBuf;

Case with_v_blocks(Case c) {
  c.path = Path::kFast;
  c.v_block_descale = true;
  return c;
}

TEST(Sm90VBlockDescale, Batched) {
  SKIP_WITHOUT_SM90();
  run_case(with_v_blocks(batched(2, 1000, 1300, 3, 128, false, 4, true)));   // partial last key block
  run_case(with_v_blocks(batched(1, 640, 2048, 2, 128, false, openvc::kNaturalOrder, false)));
  run_case(with_v_blocks(batched(1, 100, 100, 1, 128, false, 4, false)));   // one block
}

TEST(Sm90VBlockDescale, KeyCountsAndPacked) {
  SKIP_WITHOUT_SM90();
  Case c = with_v_blocks(batched(3, 700, 0, 2, 128, false, 4, true));
  c.lens_k = {1000, 517, 0};   // the unused keys hold NaN codes; one entry without keys
  c.slot_k = 1000;
  run_case(c);
  Case p{{1, 300, 1000}, {1000, 300, 1}, true, 2, 128, false, 4, true};
  run_case(with_v_blocks(p));
  Case e{{5, 0, 200, 130}, {0, 100, 130, 300}, true, 2, 128, false, 4, false};
  e.extra_max = 70;   // max_seqlen above the true maximum: the descale arrays laid out for it
  run_case(with_v_blocks(e));
}

TEST(Sm90VBlockDescale, RejectedCallsNameTheField) {
  SKIP_WITHOUT_SM90();
  DevBuf buf(1 << 20);
  openvc::AttentionParams p = rule_test_call(buf);
  p.v_descale_per_block = true;
  auto expect_named = [](const openvc::AttentionParams& q, const std::string& what) {
    expect_refused(q, "v_descale_per_block", what);
  };
  auto* b = buf.as<uint8_t>();
  openvc::AttentionParams q = p;
  q.causal = true;
  expect_named(q, "causal");
  q = p, q.in.head_dim = 64;
  expect_named(q, "head dim 64");
  q = p, q.in.qk_format = openvc::QkFormat::kInt8, q.p_format = openvc::PFormat::kExp2;
  expect_named(q, "p_format exp2");
  q = p, q.repair.rows = 4, q.repair.k_codes = b, q.repair.k_descale = buf.as<float>(), q.repair.v_packed = b;
  expect_named(q, "repair rows");
  const int* ints = buf.as<int>();
  q = p, q.blocks.num_blocks = ints, q.blocks.indices = ints;
  q.blocks.batch = 1, q.blocks.heads = 1, q.blocks.q_tiles = 2, q.blocks.capacity = 2;
  expect_named(q, "key block lists");
}

}  // namespace
