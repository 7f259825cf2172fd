// Key block lists (block-sparse attention, kBlockListMode; attention.h KeyBlockList, numerics section 5)
// on the sm_90a fast path against the CPU reference visiting the same lists on the same codes: head dim
// 128 and 64, ragged key counts (the partial last block listed last), mid-window and natural order,
// broadcast batch / head lists, empty rows (output 0, lse -inf), out-of-range counts and indices (clamped
// alike), the general path on the same lists, and the calls the mode rejects, naming `blocks`. INT8 Q/K:
// test_attention_sm90_int8_modes.cu.
// Run: openvc_gpu_tests --gtest_filter='Sm90BlockList*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu/attention_case.h"
#include "gpu/block_list_case.h"
#include "gpu/gpu_test_util.h"
#include "openvc/attention.h"
#include "openvc/call.h"

namespace {

using namespace openvc::testing::attention_case;
using openvc::testing::BlockLists;
using openvc::testing::BlockListSpec;
using openvc::testing::DevBuf;
using openvc::testing::make_block_lists;

void run_listed(int B, int sq, int sk, int H, int D, int w, bool video, const BlockListSpec& spec,
                Path path = Path::kFast) {
  const BlockLists lists = make_block_lists(spec, int(openvc::num_quant_blocks(sq)), int(openvc::num_quant_blocks(sk)));
  Case c = batched(B, sq, sk, H, D, false, w, video, path);
  c.blocks = &lists;
  run_case(c);
}

TEST(Sm90BlockList, PerBatchAndHead) {
  SKIP_WITHOUT_SM90();
  BlockListSpec s;
  s.batch = 2, s.heads = 3, s.seed = 11;
  run_listed(2, 1000, 1300, 3, 128, 4, true, s);    // ragged keys: the partial block listed last
  s.density = 0.2, s.seed = 12;
  run_listed(2, 700, 1024, 3, 128, 1, false, s);
}

TEST(Sm90BlockList, BroadcastAndNaturalOrder) {
  SKIP_WITHOUT_SM90();
  BlockListSpec s;   // one list for every batch entry and head
  s.seed = 21;
  run_listed(2, 900, 900, 2, 128, openvc::kNaturalOrder, true, s);
  s.heads = 2, s.seed = 22;   // per head, shared by the batch entries
  run_listed(2, 512, 2000, 2, 128, 4, false, s);
}

// Unordered lists are valid where every key block is full (Sk a multiple of 128): the same blocks in the same
// order of list positions as the reference.
TEST(Sm90BlockList, UnorderedListsWithFullBlocks) {
  SKIP_WITHOUT_SM90();
  BlockListSpec s;
  s.batch = 2, s.heads = 2, s.shuffled = true, s.seed = 71;
  run_listed(2, 900, 1280, 2, 128, 4, true, s);
  run_listed(2, 900, 1280, 2, 128, 4, true, s, Path::kGeneral);
}

TEST(Sm90BlockList, HeadDim64) {
  SKIP_WITHOUT_SM90();
  BlockListSpec s;
  s.batch = 2, s.heads = 2, s.seed = 31;
  run_listed(2, 1000, 1100, 2, 64, 4, true, s);
}

// Counts past the capacity or negative, indices past the last block or negative: clamped by the kernel as
// by the reference (the partial-block rule needs full key blocks here, Sk = 1024).
TEST(Sm90BlockList, OutOfRangeValuesAreClamped) {
  SKIP_WITHOUT_SM90();
  BlockListSpec s;
  s.batch = 1, s.heads = 2, s.out_of_range = true, s.seed = 41;
  run_listed(1, 600, 1024, 2, 128, 4, false, s);
}

// The general path (CUDA cores) visits the same lists in the same order: the reference's codes bit for bit
// (its usual bounds), ragged keys, broadcast heads, clamped values.
TEST(Sm90BlockList, GeneralPathSameLists) {
  SKIP_WITHOUT_SM90();
  BlockListSpec s;
  s.batch = 2, s.heads = 1, s.seed = 61;
  run_listed(2, 700, 1100, 2, 128, 4, true, s, Path::kGeneral);
  s.batch = 1, s.heads = 2, s.out_of_range = true, s.seed = 62;
  run_listed(1, 300, 640, 2, 64, openvc::kNaturalOrder, false, s, Path::kGeneral);
}

TEST(Sm90BlockList, RejectedCallsNameBlocks) {
  SKIP_WITHOUT_SM90();
  DevBuf buf(1 << 20);
  const int* ints = buf.as<int>();
  openvc::AttentionParams p = rule_test_call(buf);
  p.blocks.num_blocks = ints, p.blocks.indices = ints;
  p.blocks.batch = 1, p.blocks.heads = 1, p.blocks.q_tiles = 2, p.blocks.capacity = 2;
  auto expect_named = [](const openvc::AttentionParams& q, const std::string& what) { expect_refused(q, "blocks", what); };
  openvc::AttentionParams q = p;
  q.causal = true;
  expect_named(q, "causal");
  q = p, q.blocks.indices = nullptr;
  expect_named(q, "indices missing");
  q = p, q.blocks.q_tiles = 3;
  expect_named(q, "q_tiles");
  q = p, q.blocks.heads = 2;
  expect_named(q, "heads");
  q = p, q.blocks.capacity = 0;
  expect_named(q, "capacity");
  q = p, q.seqused_k = ints;
  expect_named(q, "seqused_k");
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
