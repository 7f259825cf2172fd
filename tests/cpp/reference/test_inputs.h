// Deterministic inputs for the reference tests: video-like Q/K/V (tokens on a frames x height x width
// grid, a few smooth spatial modes shared by Q and K, plus noise), rounded to BF16.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "openvc/reference.h"

namespace openvc::reference::testing {

// Rounds to an FP16 value (11-bit significand, subnormals below 2^-14, RNE); no overflow handling,
// test data stays far below 65504.
inline float round_to_fp16(float x) {
  if (x == 0.0f || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);                       // |x| in [2^(e-1), 2^e)
  const int lsb = std::max(e - 11, -24);   // exponent of the last significand bit kept
  return std::ldexp(std::nearbyint(std::ldexp(x, -lsb)), lsb);
}

// Packed sequences of the given lengths (cu_seqlens from 0).
inline Sequences packed(const std::vector<int>& lens, int H, int D) {
  Sequences s;
  s.num_heads = H;
  s.head_dim = D;
  s.cu_seqlens = {0};
  for (int L : lens) s.cu_seqlens.push_back(s.cu_seqlens.back() + L);
  return s;
}

struct Qkv {
  std::vector<float> q, k, v;  // [tokens, H, D]
};

// Tokens of every sequence are laid on a grid (frames x side x side, row-major); Q and K of a head
// mix the same `rank` smooth modes, so nearby tokens attend to each other, plus Gaussian noise.
// Q and K rows are RMS-normalized to `qk_rms`; V is smooth plus noise with a per-channel offset.
inline Qkv video_like(const Sequences& qs, const Sequences& ks, uint32_t seed, int side = 16, int rank = 6,
                      float noise = 0.35f, float qk_rms = 1.0f) {
  const int H = qs.num_heads, D = qs.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  // Per head: mode frequencies/phases and D-dimensional mode directions for Q, K and V.
  struct Mode {
    float fx, fy, ft, ph;
    std::vector<float> uq, uk, uv;
  };
  std::vector<std::vector<Mode>> modes(H);
  std::vector<std::vector<float>> voff(H);
  for (int h = 0; h < H; ++h) {
    for (int r = 0; r < rank; ++r) {
      Mode m{0.6f * uni(rng), 0.6f * uni(rng), 0.4f * uni(rng), 6.2831853f * uni(rng), {}, {}, {}};
      for (int c = 0; c < D; ++c) {
        const float u = gauss(rng);
        m.uq.push_back(u);
        m.uk.push_back(u + 0.3f * gauss(rng));  // K's directions are close to Q's
        m.uv.push_back(gauss(rng));
      }
      modes[h].push_back(m);
    }
    for (int c = 0; c < D; ++c) voff[h].push_back(0.2f * gauss(rng));
  }
  auto fill = [&](const Sequences& s, int which, std::vector<float>* out) {
    out->assign(static_cast<size_t>(s.total_tokens()) * H * D, 0.0f);
    for (int b = 0; b < s.count(); ++b) {
      for (int t = 0; t < s.length(b); ++t) {
        const float x = static_cast<float>(t % side), y = static_cast<float>((t / side) % side),
                    f = static_cast<float>(t / (side * side));
        for (int h = 0; h < H; ++h) {
          float* row = out->data() + (static_cast<size_t>(s.cu_seqlens[b] + t) * H + h) * D;
          for (const Mode& m : modes[h]) {
            const float w = std::cos(m.fx * x + m.fy * y + m.ft * f + m.ph + 0.7f * b);
            const std::vector<float>& u = which == 0 ? m.uq : which == 1 ? m.uk : m.uv;
            for (int c = 0; c < D; ++c) row[c] += w * u[c];
          }
          double ss = 0;
          for (int c = 0; c < D; ++c) {
            row[c] += noise * gauss(rng) * (which == 2 ? 2.0f : 1.0f);
            ss += static_cast<double>(row[c]) * row[c];
          }
          const float g = which == 2 ? 1.0f : qk_rms / static_cast<float>(std::sqrt(ss / D) + 1e-12);
          for (int c = 0; c < D; ++c) {
            row[c] = row[c] * g + (which == 2 ? voff[h][c] : 0.0f);
            row[c] = round_to_bf16(row[c]);
          }
        }
      }
    }
  };
  Qkv r;
  fill(qs, 0, &r.q);
  fill(ks, 1, &r.k);
  fill(ks, 2, &r.v);
  return r;
}

}  // namespace openvc::reference::testing
