// Key block lists for the GPU tests (openvc::KeyBlockList on the device, reference::KeyBlockLists on the
// host): per (batch, head, query tile) an ascending random subset of the key blocks, some rows empty,
// optionally broadcast over batch or heads and with out-of-range counts and indices (which the kernel and
// the reference clamp alike; such lists are only valid where every key block is full, see attention.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "openvc/attention.h"
#include "openvc/reference.h"

namespace openvc::testing {

struct BlockListSpec {
  int batch = 1, heads = 1;   // 1 broadcasts
  double density = 0.5;       // chance that a key block is listed
  int extra_capacity = 3;     // indices' last dimension beyond the key blocks (entries past a count)
  bool out_of_range = false;  // counts past the capacity or negative, indices past the last block
  bool shuffled = false;      // each row's listed blocks in a random order (valid with full key blocks only)
  uint32_t seed = 1;
};

struct BlockLists {
  int batch = 1, heads = 1, q_tiles = 0, capacity = 0;
  std::vector<int> counts, indices;   // [batch, heads, q_tiles], [batch, heads, q_tiles, capacity]
  reference::KeyBlockLists host() const {
    reference::KeyBlockLists h;
    h.num_blocks = counts.data(), h.indices = indices.data();
    h.batch = batch, h.heads = heads, h.q_tiles = q_tiles, h.capacity = capacity;
    return h;
  }
  // The device struct over device copies of counts and indices.
  KeyBlockList device(const int* d_counts, const int* d_indices) const {
    KeyBlockList d;
    d.num_blocks = d_counts, d.indices = d_indices;
    d.batch = batch, d.heads = heads, d.q_tiles = q_tiles, d.capacity = capacity;
    return d;
  }
};

inline BlockLists make_block_lists(const BlockListSpec& s, int q_tiles, int k_blocks) {
  BlockLists b;
  b.batch = s.batch, b.heads = s.heads, b.q_tiles = q_tiles, b.capacity = k_blocks + s.extra_capacity;
  const size_t rows = size_t(s.batch) * s.heads * q_tiles;
  b.counts.assign(rows, 0);
  b.indices.assign(rows * b.capacity, -7);   // entries past a count are never read: poison them
  std::mt19937 rng(s.seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (size_t r = 0; r < rows; ++r) {
    int* row = &b.indices[r * b.capacity];
    int n = 0;
    if (r % 5 != 3)   // every fifth row (from the fourth) stays empty: output 0, lse -inf
      for (int j = 0; j < k_blocks; ++j)
        if (u(rng) < s.density || (n == 0 && j == k_blocks - 1)) row[n++] = j;
    b.counts[r] = n;
    if (s.shuffled) std::shuffle(row, row + n, rng);
  }
  if (s.out_of_range && rows >= 3) {
    b.counts[0] = b.capacity + 5;            // clamped to the capacity: the poison entries are read...
    for (int i = 0; i < b.capacity; ++i) b.indices[i] = i < k_blocks ? i : k_blocks + 9;   // ...as valid blocks
    b.counts[1] = -4;                        // clamped to 0: an empty row
    b.indices[2 * size_t(b.capacity)] = -3;  // clamped to block 0
  }
  return b;
}

}  // namespace openvc::testing
