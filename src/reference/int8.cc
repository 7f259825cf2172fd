// Section 9: INT8 Q/K quantization (per-row Q, per-block K with optional channel-mean smoothing).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "reference/internal.h"

namespace openvc::reference {
namespace {

// Quantizes the tokens t of [t0, t1) of head h with in_group(t) as one group; returns its descale.
// src(t, c) gives the value to quantize (the input, or the smoothed input). amax ignores NaN, like the
// E4M3 groups.
template <typename Src, typename InGroup>
float quantize_group(const Src& src, const InGroup& in_group, const Sequences& seqs, int h, int64_t t0, int64_t t1,
                     int8_t* codes) {
  const int64_t H = seqs.num_heads, D = seqs.head_dim;
  float amax = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    if (!in_group(t)) continue;
    for (int64_t c = 0; c < D; ++c) {
      const float a = std::fabs(src(t, c));
      if (a > amax) amax = a;
    }
  }
  float scale_inv = amax > 0.0f ? kInt8Max / amax : 0.0f;  // one FP32 division each
  float descale = amax / kInt8Max;
  // Tiny group (127 / amax overflows: amax below ~3.7e-37): all zeros. A group holding Inf keeps
  // scale_inv 0 and descale Inf, as in section 1.
  if (!std::isfinite(scale_inv)) scale_inv = descale = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    if (!in_group(t)) continue;
    for (int64_t c = 0; c < D; ++c) codes[(t * H + h) * D + c] = int8_encode(src(t, c) * scale_inv);
  }
  return descale;
}

}  // namespace

int8_t int8_encode(float x) {
  if (std::isnan(x)) return 0;  // there is no NaN code
  const float r = std::nearbyint(std::min(std::max(x, -kInt8Max), kInt8Max));  // default mode: ties to even
  return static_cast<int8_t>(r);
}

Status quantize_int8_rows(const float* x, const Sequences& seqs, Int8Quantized* out) {
  OPENVC_RETURN_IF_ERROR(internal::check_quantize_args(x, seqs, out));
  const int H = seqs.num_heads, D = seqs.head_dim, nseq = seqs.count();
  out->groups = seqs.max_length();
  out->group_tokens = 1;
  out->codes.assign(static_cast<size_t>(seqs.total_tokens()) * H * D, 0);
  out->descale.assign(static_cast<size_t>(nseq) * H * out->groups, 0.0f);  // 0 past a sequence's end
  out->mean.clear();
  auto all = [](int64_t) { return true; };
  for (int s = 0; s < nseq; ++s)
    for (int h = 0; h < H; ++h) {
      auto src = [&](int64_t t, int64_t c) { return x[(t * H + h) * D + c]; };
      for (int i = 0; i < seqs.length(s); ++i) {
        const int64_t t = seqs.cu_seqlens[s] + i;
        out->descale[(static_cast<size_t>(s) * H + h) * out->groups + i] =
            quantize_group(src, all, seqs, h, t, t + 1, out->codes.data());
      }
    }
  return Status::Ok();
}

Status quantize_int8_blocks(const float* x, const Sequences& seqs, bool smoothing, Int8Quantized* out,
                            const int* key_counts) {
  OPENVC_RETURN_IF_ERROR(internal::check_quantize_args(x, seqs, out));
  const int H = seqs.num_heads, D = seqs.head_dim, nseq = seqs.count();
  out->groups = seqs.max_blocks() * kInt8KeyGroups;
  out->group_tokens = kQuantBlock;
  out->codes.assign(static_cast<size_t>(seqs.total_tokens()) * H * D, 0);  // padding keys stay 0
  out->descale.assign(static_cast<size_t>(nseq) * H * out->groups, 0.0f);  // groups without a valid key: 0
  out->mean.clear();
  if (smoothing) OPENVC_RETURN_IF_ERROR(k_smoothing_means(x, seqs, key_counts, &out->mean));
  for (int s = 0; s < nseq; ++s) {
    const int64_t start = seqs.cu_seqlens[s];
    const int64_t count = internal::key_count(seqs, s, key_counts);
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(s) * H + h;
      const float* mean = smoothing ? &out->mean[g * D] : nullptr;
      auto src = [&](int64_t t, int64_t c) { return internal::smoothed(x, mean, t, h, H, D, static_cast<int>(c)); };
      for (int64_t j0 = 0; j0 < count; j0 += kQuantBlock) {
        const int64_t t0 = start + j0, t1 = start + std::min<int64_t>(j0 + kQuantBlock, count);  // partial block
        for (int kg = 0; kg < kInt8KeyGroups; ++kg) {
          auto in_group = [&](int64_t t) { return int8_key_group(t - start) == kg; };
          out->descale[g * out->groups + int8_key_descale_index(j0) + kg] =
              quantize_group(src, in_group, seqs, h, t0, t1, out->codes.data());
        }
      }
    }
  }
  return Status::Ok();
}

namespace internal {

std::vector<double> int8_rows(const int8_t* base, int64_t tokens, int64_t stride, int head_dim) {
  std::vector<double> out(static_cast<size_t>(tokens) * head_dim);
  for (int64_t t = 0; t < tokens; ++t)
    for (int c = 0; c < head_dim; ++c) out[t * head_dim + c] = base[t * stride + c];
  return out;
}

}  // namespace internal
}  // namespace openvc::reference
