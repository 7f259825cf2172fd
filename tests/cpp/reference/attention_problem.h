// A prepared video-like problem for the reference's attention tests, and its operands dequantized (exact
// attention on the same FP8 operands isolates ExpCast). Shared by test_attention.cc and test_attention_masks.cc.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "openvc/reference.h"
#include "test_inputs.h"

namespace openvc::reference {

struct Problem {
  Sequences qs, ks;
  testing::Qkv x;
  PreparedInputs in;
};

inline Problem make_problem(std::vector<int> q_lens, std::vector<int> k_lens, int H, int D, uint32_t seed) {
  Problem p;
  p.qs.num_heads = p.ks.num_heads = H;
  p.qs.head_dim = p.ks.head_dim = D;
  p.qs.cu_seqlens = {0};
  p.ks.cu_seqlens = {0};
  for (int L : q_lens) p.qs.cu_seqlens.push_back(p.qs.cu_seqlens.back() + L);
  for (int L : k_lens) p.ks.cu_seqlens.push_back(p.ks.cu_seqlens.back() + L);
  p.x = testing::video_like(p.qs, p.ks, seed);
  EXPECT_TRUE(prepare_inputs(p.x.q.data(), p.x.k.data(), p.x.v.data(), p.qs, p.ks, &p.in).ok());
  return p;
}

// The prepared inputs dequantized back to float (descale * decode), for exact attention on the SAME
// quantized operands: its distance to the ExpCast result is ExpCast's alone.
inline testing::Qkv dequantized(const PreparedInputs& in) {
  const int H = in.q_seqs.num_heads, D = in.q_seqs.head_dim;
  auto blocks = [&](const BlockQuantized& x, const Sequences& s) {
    std::vector<float> out(x.codes.size());
    for (int b = 0; b < s.count(); ++b)
      for (int t = 0; t < s.length(b); ++t)
        for (int h = 0; h < H; ++h)
          for (int c = 0; c < D; ++c) {
            const size_t i = (static_cast<size_t>(s.cu_seqlens[b] + t) * H + h) * D + c;
            out[i] = x.descale[(static_cast<size_t>(b) * H + h) * x.max_blocks + t / 128] * e4m3_decode(x.codes[i]);
          }
    return out;
  };
  testing::Qkv r;
  r.q = blocks(in.q, in.q_seqs);
  r.k = blocks(in.k, in.k_seqs);
  r.v.resize(in.v.codes.size());
  for (int b = 0; b < in.k_seqs.count(); ++b)
    for (int t = in.k_seqs.cu_seqlens[b]; t < in.k_seqs.cu_seqlens[b + 1]; ++t)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < D; ++c) {
          const size_t i = (static_cast<size_t>(t) * H + h) * D + c;
          r.v[i] = in.v.descale[static_cast<size_t>(b) * H + h] * e4m3_decode(in.v.codes[i]);
        }
  return r;
}

}  // namespace openvc::reference
