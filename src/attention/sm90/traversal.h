// Key-block traversal of numerics section 5, shared by the producer, the consumers and the host.
#pragma once
#include <cstdint>

namespace openvc::sm90 {

// Diagonal key block of a query tile starting at row r0: floor(r0 * Sk / Sq / key_tile).
__host__ __device__ inline int diagonal_key_block(int64_t r0, int64_t sq, int64_t sk, int key_tile) {
  return static_cast<int>((r0 * sk) / (sq * key_tile));
}

// The block visited at step i: j0, j0-1, ..., 0, then j0+1, ..., n-1 with j0 = min(diag + w, n - 1);
// w < 0 visits 0..n-1. A closed form, so no order table is needed in shared memory.
struct KeyOrder {
  int j0;  // -1 for natural order
  __host__ __device__ KeyOrder(int diag, int n, int w) : j0(w < 0 ? -1 : (diag + w < n - 1 ? diag + w : n - 1)) {}
  __host__ __device__ int operator()(int i) const { return i <= j0 ? j0 - i : i; }
};

}  // namespace openvc::sm90
