// Sections 3 and 5: the ExpCast byte and the key-block traversal order.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "reference/internal.h"

namespace openvc::reference {

float expcast_multiplier(float softmax_scale, float descale_q, float descale_k) {
  // Same FP32 products, same order, as the kernel's per-tile multiplier; 8 * log2e is exact in float
  // (a power-of-two scaling of the float log2e).
  const float k8log2e = 8.0f * kLog2e;
  return ((k8log2e * softmax_scale) * descale_q) * descale_k;
}

uint8_t expcast_code(float acc, float a, float row_max) {
  // One FP32 subtraction forms the row's addend b = 119.65 - row_max (the kernel does it once per
  // row), then one FMA per score, then round half to even to an integer and the clip to [0, 120].
  // The kernel evaluates the same FMA scaled by 2^-24 (exact: a power of two) and lets the
  // round-to-nearest-even conversion to an f16 subnormal (spacing 2^-24) do the integer rounding,
  // with relu for the clip at 0; NaN and -inf give 0 there too.
  float bias = kCodeBias - row_max;
  // A row max of 2^23 code units or more (scores beyond ~7e5 nats) is beyond FP32's resolution of a
  // code step: one ulp of slack lets the row's maximum reach code 120 whatever the roundings, so its
  // denominator is never 0 (numerics section 3, "Huge scores"); the clip below keeps codes <= 120.
  if (std::fabs(row_max) >= kHugeRowMax && std::isfinite(row_max))
    bias += std::ldexp(1.0f, std::ilogb(row_max) - 23);
  const float x = std::fmaf(acc, a, bias);
  if (std::isnan(x) || x <= 0.0f) return 0;
  const float c = std::min(std::nearbyint(x), static_cast<float>(kMaxCode));  // default mode: ties to even
  return static_cast<uint8_t>(c);
}

uint8_t exp2_code(float acc, float a, float row_max) {
  // a * 0.125f and row_max * 0.125f are exact (power-of-two scalings); the addend is one FP32
  // subtraction, then one FMA, as the kernel's (scaled by 2^21 there, exact as well).
  const float x = std::fmaf(acc, a * 0.125f, 8.0f - row_max * 0.125f);
  return e4m3_encode(static_cast<float>(std::exp2(static_cast<double>(x))));
}

namespace {
// v rounded to the nearest f16 value, ties to even, with f16 subnormals; past the largest finite value (65504)
// to +-inf, or with satfinite to +-65504. Every caller passes the exact result of an f16 operation (sums and
// products of f16 values are exact in double here), so this is the operation's single rounding.
double f16_round(double v, bool satfinite = false) {
  if (std::isnan(v)) return v;
  if (std::fabs(v) >= 65520.0) return satfinite ? std::copysign(65504.0, v) : std::copysign(INFINITY, v);
  if (v == 0.0) return v;
  int e = 0;
  std::frexp(v, &e);                                   // |v| in [2^(e-1), 2^e)
  const double quantum = std::ldexp(1.0, std::max(e - 1, -14) - 10);
  return std::nearbyint(v / quantum) * quantum;        // default rounding: half to even
}
}  // namespace

uint8_t exp2_poly_code(float acc, float a, float row_max) {
  // The kernel's f16x2 sequence (sm90/expcast.cuh, exp2_poly_pair), one rounding per instruction.
  float x = std::fmaf(acc, a, static_cast<float>(kMaxCode) - row_max);
  if (x > static_cast<float>(kMaxCode)) x = static_cast<float>(kMaxCode);   // NaN stays NaN
  const double h = f16_round(x, true);
  double t = f16_round(h + kPolyOctave);
  t = f16_round(t - kPolyOctave);
  const double d = std::fabs(f16_round(h - t));
  const double u = f16_round(d * kPolyK8 + kPolyNegK);
  double w = f16_round(u * d + h);
  if (w < 0.0) w = 0.0;                                // relu
  w = f16_round(w + 1024.0);
  if (std::isnan(w)) return 0xFF;                      // the f16 canonical NaN 0x7FFF: low byte 0xFF
  return static_cast<uint8_t>(static_cast<int>(w - 1024.0) & 0xFF);
}

uint8_t exp2_format_code(float acc, float a, float row_max, int key_in_block) {
  return key_in_block % kQuantBlock >= kExp2PolyFirstKey ? exp2_poly_code(acc, a, row_max)
                                                        : exp2_code(acc, a, row_max);
}

// Invalid arguments (n < 1, diag < 0, mid_window_blocks < -1) give an empty order: there is no
// Status to return, and an empty list can never be mistaken for a traversal of n >= 1 blocks.
std::vector<int> key_block_order(int diag, int n, int mid_window_blocks) {
  std::vector<int> order;
  if (n < 1 || diag < 0 || mid_window_blocks < kNaturalOrder) return order;
  order.reserve(n);
  if (mid_window_blocks == kNaturalOrder) {
    for (int j = 0; j < n; ++j) order.push_back(j);
    return order;
  }
  // Start a few blocks past the diagonal and walk down to 0, so the row max is usually found early
  // (fewer rescales, fewer codes converted against a stale max), then finish upwards.
  const int j0 = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(diag) + mid_window_blocks, n - 1));
  for (int j = j0; j >= 0; --j) order.push_back(j);
  for (int j = j0 + 1; j < n; ++j) order.push_back(j);
  return order;
}

std::vector<int> listed_block_order(const int* row, int count, int capacity, int diag, int n_blocks,
                                    int mid_window_blocks) {
  const int n = std::max(0, std::min(count, capacity));
  auto block = [&](int pos) { return std::max(0, std::min(row[pos], n_blocks - 1)); };
  std::vector<int> order;
  if (n == 0 || n_blocks < 1) return order;
  order.reserve(n);
  // Positions measured from the first listed block, so that a list of consecutive blocks starts at
  // diag + w as the dense order does.
  const int64_t p0 = mid_window_blocks < 0 ? -1
                                           : std::min<int64_t>(int64_t(diag) - block(0) + mid_window_blocks, n - 1);
  for (int64_t p = p0; p >= 0; --p) order.push_back(block(int(p)));
  for (int64_t p = std::max<int64_t>(p0 + 1, 0); p < n; ++p) order.push_back(block(int(p)));
  return order;
}

// Invalid arguments (negative row or sk, sq or key_tile <= 0) give -1.
int diagonal_block(int64_t first_query_row, int64_t sq, int64_t sk, int key_tile) {
  if (first_query_row < 0 || sq <= 0 || sk < 0 || key_tile <= 0) return -1;
  // floor(floor(r0 * Sk / Sq) / key_tile) == floor(r0 * Sk / (Sq * key_tile)) for non-negative values.
  return static_cast<int>(first_query_row * sk / sq / key_tile);
}

// Invalid arguments (n < 1, tiles < 1, ctas < 1, tile outside [0, tiles)) give no cut.
std::vector<int> split_cuts(int64_t tile, int n, int64_t tiles, int64_t ctas) {
  std::vector<int> cuts;
  if (n < 1 || tiles < 1 || ctas < 1 || tile < 0 || tile >= tiles) return cuts;
  const int64_t head = tiles < 2 * ctas ? 0 : tiles - (ctas + tiles % ctas);   // whole tiles, round robin
  if (tile < head) return cuts;
  const int64_t units = (tiles - head) * n, q = units / ctas, r = units % ctas;
  const int64_t u0 = (tile - head) * n, u1 = u0 + n;
  for (int64_t c = 1; c < ctas; ++c) {   // every range start inside (u0, u1); few ranges, so a plain scan
    const int64_t begin = c * q + std::min(c, r);
    if (begin > u0 && begin < u1) cuts.push_back(static_cast<int>(begin - u0));
    if (begin >= u1) break;
  }
  return cuts;
}

int64_t causal_key_limit(int64_t row, int64_t sq, int64_t sk, int causal_chunk) {
  const int64_t f = std::max<int64_t>(causal_chunk, 1), p = row + (sk - sq);
  const int64_t chunk = p >= 0 ? p / f : -((-p + f - 1) / f);   // floor(p / F)
  return std::clamp<int64_t>((chunk + 1) * f, 0, std::max<int64_t>(sk, 0));
}

int causal_visible_blocks(int64_t last_query_row, int64_t sq, int64_t sk, int key_tile, int causal_chunk) {
  if (last_query_row < 0 || sq <= 0 || sk <= 0 || key_tile <= 0) return 0;
  const int64_t limit = causal_key_limit(last_query_row, sq, sk, causal_chunk);   // keys the row sees
  return static_cast<int>((limit + key_tile - 1) / key_tile);
}

}  // namespace openvc::reference
