// Key-block traversal order and diagonal block (numerics section 5).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "openvc/reference.h"

namespace openvc::reference {
namespace {

using V = std::vector<int>;

TEST(Traversal, NaturalOrder) {
  EXPECT_EQ(key_block_order(0, 5, kNaturalOrder), (V{0, 1, 2, 3, 4}));
  EXPECT_EQ(key_block_order(3, 5, kNaturalOrder), (V{0, 1, 2, 3, 4}));
  EXPECT_EQ(key_block_order(0, 1, kNaturalOrder), (V{0}));
}

TEST(Traversal, MidWindowExamples) {
  EXPECT_EQ(key_block_order(2, 10, 4), (V{6, 5, 4, 3, 2, 1, 0, 7, 8, 9}));
  EXPECT_EQ(key_block_order(0, 10, 4), (V{4, 3, 2, 1, 0, 5, 6, 7, 8, 9}));
  EXPECT_EQ(key_block_order(3, 10, 0), (V{3, 2, 1, 0, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(key_block_order(5, 10, 4), (V{9, 8, 7, 6, 5, 4, 3, 2, 1, 0}));   // j0 clamps to n - 1
  EXPECT_EQ(key_block_order(9, 10, 4), (V{9, 8, 7, 6, 5, 4, 3, 2, 1, 0}));
  EXPECT_EQ(key_block_order(0, 5, 100), (V{4, 3, 2, 1, 0}));                 // window past the end
  EXPECT_EQ(key_block_order(0, 5, 2147483647), (V{4, 3, 2, 1, 0}));          // no int overflow
  EXPECT_EQ(key_block_order(0, 1, 4), (V{0}));
  EXPECT_EQ(key_block_order(0, 1, 0), (V{0}));
  EXPECT_EQ(key_block_order(0, 2, 0), (V{0, 1}));
}

TEST(Traversal, EveryBlockExactlyOnce) {
  for (int n = 1; n <= 40; ++n) {
    for (int w = -1; w <= 45; ++w) {
      for (int diag = 0; diag < n; ++diag) {
        V order = key_block_order(diag, n, w);
        ASSERT_EQ(static_cast<int>(order.size()), n) << diag << " " << n << " " << w;
        if (w >= 0) {
          // The first block is min(diag + w, n - 1) and the walk descends from it to 0.
          const int j0 = std::min(diag + w, n - 1);
          ASSERT_EQ(order[0], j0);
          for (int k = 1; k <= j0; ++k) ASSERT_EQ(order[k], order[k - 1] - 1);
        }
        std::sort(order.begin(), order.end());
        for (int j = 0; j < n; ++j) ASSERT_EQ(order[j], j);
      }
    }
  }
}

TEST(Traversal, InvalidArgumentsGiveEmptyOrder) {
  EXPECT_TRUE(key_block_order(0, 0, 4).empty());
  EXPECT_TRUE(key_block_order(-1, 4, 4).empty());
  EXPECT_TRUE(key_block_order(0, 4, -2).empty());
}

// Key block lists (section 5): the mid-window order over list positions, measured from the first listed
// block; out-of-range counts and indices clamped.
TEST(Traversal, ListedBlockOrder) {
  const int consecutive[] = {3, 4, 5, 6, 7, 8, 9};
  // Consecutive blocks 3..9 with diag 5, w 1: start at block 6, as key_block_order(5, 10, 1) would.
  EXPECT_EQ(listed_block_order(consecutive, 7, 7, 5, 10, 1), (V{6, 5, 4, 3, 7, 8, 9}));
  EXPECT_EQ(listed_block_order(consecutive, 7, 7, 5, 10, kNaturalOrder), (V{3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(listed_block_order(consecutive, 7, 7, 1, 10, 0), (V{3, 4, 5, 6, 7, 8, 9}));   // diag before the list
  EXPECT_EQ(listed_block_order(consecutive, 7, 7, 9, 10, 4), (V{9, 8, 7, 6, 5, 4, 3}));   // past its end
  const int gaps[] = {0, 4, 9};   // positions, not block numbers: p0 = min(5 - 0 + 0, 2) = 2
  EXPECT_EQ(listed_block_order(gaps, 3, 3, 5, 10, 0), (V{9, 4, 0}));
  EXPECT_EQ(listed_block_order(gaps, 2, 3, 5, 10, 0), (V{4, 0}));          // count below the capacity
  EXPECT_EQ(listed_block_order(gaps, 9, 3, 5, 10, kNaturalOrder), (V{0, 4, 9}));   // count clamped
  EXPECT_TRUE(listed_block_order(gaps, -2, 3, 5, 10, 4).empty());
  const int bad[] = {-5, 2, 40};   // indices clamped to [0, n_blocks)
  EXPECT_EQ(listed_block_order(bad, 3, 3, 0, 6, kNaturalOrder), (V{0, 2, 5}));
}

TEST(Traversal, DiagonalBlock) {
  EXPECT_EQ(diagonal_block(0, 4096, 4096, 128), 0);
  EXPECT_EQ(diagonal_block(127, 4096, 4096, 128), 0);
  EXPECT_EQ(diagonal_block(128, 4096, 4096, 128), 1);
  EXPECT_EQ(diagonal_block(3968, 4096, 4096, 128), 31);
  EXPECT_EQ(diagonal_block(256, 1024, 4096, 128), 8);    // Sk = 4 Sq
  EXPECT_EQ(diagonal_block(100, 300, 1000, 128), 2);     // floor(333.3 / 128)
  EXPECT_EQ(diagonal_block(384, 4096, 1000, 128), 0);    // floor(93.75 / 128)
  // r0 * Sk overflows 32 bits here: 70000 * 73397 / 73397 / 128 = 546.875.
  EXPECT_EQ(diagonal_block(70000, 73397, 73397, 128), 546);
  EXPECT_EQ(diagonal_block(70000, 73397, 73397, 64), 1093);
  EXPECT_EQ(diagonal_block(-1, 10, 10, 128), -1);
  EXPECT_EQ(diagonal_block(0, 0, 10, 128), -1);
  EXPECT_EQ(diagonal_block(0, 10, 10, 0), -1);
}

}  // namespace
}  // namespace openvc::reference
