// Key-block traversal of numerics section 5, shared by the producer, the consumers and the host.
#pragma once
#include <cstdint>

namespace openvc::sm90 {

// Causal with chunks of `chunk` keys (numerics section 5; chunk 1 is plain causal): the keys query row i
// sees, (floor((i + Sk - Sq) / F) + 1) * F clamped to [0, Sk], F = min(chunk, max(Sk, 1)) (a larger chunk
// changes nothing). Every row sees a prefix of the keys, non-decreasing in i. One 32-bit division.
__host__ __device__ inline int causal_key_limit(int64_t i, int64_t sq, int64_t sk, int chunk) {
  const int64_t p = i + sk - sq;
  const int64_t f = chunk < 1 ? 1 : (chunk < sk ? chunk : (sk > 1 ? sk : 1));
  const int64_t q = f == 1 ? p : p >= 0 ? int64_t(uint32_t(p) / uint32_t(f)) : -int64_t((uint32_t(f - 1 - p)) / uint32_t(f));
  const int64_t lim = (q + 1) * f;
  return int(lim < 0 ? 0 : lim > sk ? sk : lim);
}

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
