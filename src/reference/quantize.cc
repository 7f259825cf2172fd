// Section 1: per-block (Q, K) and per-head (V) E4M3 quantization.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "reference/internal.h"

namespace openvc::reference {
namespace {


// Quantizes tokens [t0, t1) of head h as one group; returns its descale and writes scale_inv.
// x and codes are [total_tokens, H, D]. amax ignores NaN (like a GPU fmaxf reduction).
float quantize_group(const float* x, const Sequences& seqs, int h, int64_t t0, int64_t t1, uint8_t* codes,
                     float* scale_inv_out) {
  const int64_t H = seqs.num_heads, D = seqs.head_dim;
  float amax = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = x + (t * H + h) * D;
    for (int64_t c = 0; c < D; ++c) {
      const float a = std::fabs(row[c]);
      if (a > amax) amax = a;
    }
  }
  float scale_inv = amax > 0.0f ? kE4M3Max / amax : 0.0f;  // one FP32 division each
  float descale = amax / kE4M3Max;
  // Tiny group (448 / amax overflows: amax below ~1.3e-36): all zeros, so no code is NaN because of
  // the scale (inf * 0). A group holding Inf keeps scale_inv 0 and descale Inf (numerics section 1).
  if (!std::isfinite(scale_inv)) scale_inv = descale = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t base = (t * H + h) * D;
    for (int64_t c = 0; c < D; ++c) codes[base + c] = e4m3_encode(x[base + c] * scale_inv);
  }
  if (scale_inv_out) *scale_inv_out = scale_inv;
  return descale;
}

}  // namespace

Status quantize_blocks(const float* x, const Sequences& seqs, BlockQuantized* out) {
  OPENVC_RETURN_IF_ERROR(internal::check_quantize_args(x, seqs, out));
  const int H = seqs.num_heads, nseq = seqs.count();
  out->max_blocks = seqs.max_blocks();
  out->codes.assign(static_cast<size_t>(seqs.total_tokens()) * H * seqs.head_dim, 0);
  // Zero-initialized: blocks past a shorter sequence's end keep descale 0.
  out->descale.assign(static_cast<size_t>(nseq) * H * out->max_blocks, 0.0f);
  for (int s = 0; s < nseq; ++s) {
    const int64_t start = seqs.cu_seqlens[s], len = seqs.length(s);
    const int nblk = static_cast<int>((len + kQuantBlock - 1) / kQuantBlock);
    for (int h = 0; h < H; ++h) {
      for (int b = 0; b < nblk; ++b) {
        const int64_t t0 = start + static_cast<int64_t>(b) * kQuantBlock;
        const int64_t t1 = std::min<int64_t>(t0 + kQuantBlock, start + len);  // partial final block
        out->descale[(static_cast<size_t>(s) * H + h) * out->max_blocks + b] =
            quantize_group(x, seqs, h, t0, t1, out->codes.data(), nullptr);
      }
    }
  }
  return Status::Ok();
}

int64_t v_residual_fixed(float x, uint8_t code) {
  const float r = x - e4m3_decode(code);   // exact: the code is x's E4M3 rounding (or 448 for x just past it)
  if (!(std::fabs(r) <= 16.0f)) return 0;  // NaN (a NaN or Inf input); finite x never gets here
  return static_cast<int64_t>(std::nearbyint(static_cast<double>(r) * 65536.0));   // ties to even
}

Status quantize_heads(const float* x, const Sequences& seqs, HeadQuantized* out) {
  OPENVC_RETURN_IF_ERROR(internal::check_quantize_args(x, seqs, out));
  const int H = seqs.num_heads, D = seqs.head_dim, nseq = seqs.count();
  out->codes.assign(static_cast<size_t>(seqs.total_tokens()) * H * D, 0);
  out->descale.assign(static_cast<size_t>(nseq) * H, 0.0f);
  out->scale_inv.assign(static_cast<size_t>(nseq) * H, 0.0f);
  out->residual_sums.assign(static_cast<size_t>(nseq) * H * D, 0);
  out->bias.assign(static_cast<size_t>(nseq) * H * D, 0.0f);
  for (int s = 0; s < nseq; ++s) {
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(s) * H + h;
      out->descale[g] = quantize_group(x, seqs, h, seqs.cu_seqlens[s], seqs.cu_seqlens[s + 1], out->codes.data(),
                                       &out->scale_inv[g]);
      int64_t* sums = &out->residual_sums[g * D];
      for (int64_t t = seqs.cu_seqlens[s]; t < seqs.cu_seqlens[s + 1]; ++t) {
        const int64_t base = (t * H + h) * D;
        for (int c = 0; c < D; ++c) sums[c] += v_residual_fixed(x[base + c] * out->scale_inv[g], out->codes[base + c]);
      }
      const int64_t keys = seqs.length(s);
      if (keys > 0)
        for (int c = 0; c < D; ++c)
          out->bias[g * D + c] = static_cast<float>(static_cast<double>(out->descale[g]) * static_cast<double>(sums[c]) *
                                                    kVResidualUnit / static_cast<double>(keys));
    }
  }
  return Status::Ok();
}

Status k_smoothing_means(const float* x, const Sequences& seqs, const int* key_counts, std::vector<float>* mean) {
  OPENVC_RETURN_IF_ERROR(internal::check_quantize_args(x, seqs, mean));
  const int H = seqs.num_heads, D = seqs.head_dim, nseq = seqs.count();
  mean->assign(static_cast<size_t>(nseq) * H * D, 0.0f);
  std::vector<double> total(D);
  for (int s = 0; s < nseq; ++s) {
    const int64_t start = seqs.cu_seqlens[s];
    const int64_t count = internal::key_count(seqs, s, key_counts);
    if (count == 0) continue;  // mean 0
    for (int h = 0; h < H; ++h) {
      std::fill(total.begin(), total.end(), 0.0);
      for (int64_t t0 = 0; t0 < count; t0 += kQuantBlock) {  // blocks in order
        const int64_t t1 = std::min<int64_t>(t0 + kQuantBlock, count);
        for (int c = 0; c < D; ++c) {
          double block = 0.0;  // the block's valid keys in token order
          for (int64_t t = t0; t < t1; ++t) block += static_cast<double>(x[((start + t) * H + h) * D + c]);
          total[c] += block;
        }
      }
      float* m = &(*mean)[(static_cast<size_t>(s) * H + h) * D];
      for (int c = 0; c < D; ++c) m[c] = static_cast<float>(total[c]) / static_cast<float>(count);
    }
  }
  return Status::Ok();
}

Status quantize_key_blocks(const float* x, const Sequences& seqs, bool smoothing, BlockQuantized* out,
                           const int* key_counts) {
  OPENVC_RETURN_IF_ERROR(internal::check_quantize_args(x, seqs, out));
  const int H = seqs.num_heads, D = seqs.head_dim, nseq = seqs.count();
  out->max_blocks = seqs.max_blocks();
  out->codes.assign(static_cast<size_t>(seqs.total_tokens()) * H * D, 0);  // padding keys stay 0
  out->descale.assign(static_cast<size_t>(nseq) * H * out->max_blocks, 0.0f);
  out->mean.clear();
  if (smoothing) OPENVC_RETURN_IF_ERROR(k_smoothing_means(x, seqs, key_counts, &out->mean));
  for (int s = 0; s < nseq; ++s) {
    const int64_t start = seqs.cu_seqlens[s];
    const int64_t count = internal::key_count(seqs, s, key_counts);
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(s) * H + h;
      const float* mean = smoothing ? &out->mean[g * D] : nullptr;
      for (int64_t t0 = 0; t0 < count; t0 += kQuantBlock) {
        const int64_t t1 = std::min<int64_t>(t0 + kQuantBlock, count);
        float amax = 0.0f;
        for (int64_t t = t0; t < t1; ++t)
          for (int c = 0; c < D; ++c) {
            const float a = std::fabs(internal::smoothed(x, mean, start + t, h, H, D, c));
            if (a > amax) amax = a;
          }
        float scale_inv = amax > 0.0f ? kE4M3Max / amax : 0.0f;
        float descale = amax / kE4M3Max;
        if (!std::isfinite(scale_inv)) scale_inv = descale = 0.0f;  // tiny group, as quantize_group
        out->descale[g * out->max_blocks + t0 / kQuantBlock] = descale;
        for (int64_t t = t0; t < t1; ++t)
          for (int c = 0; c < D; ++c)
            out->codes[((start + t) * H + h) * D + c] =
                e4m3_encode(internal::smoothed(x, mean, start + t, h, H, D, c) * scale_inv);
      }
    }
  }
  return Status::Ok();
}

namespace internal {

Status check_quantize_args(const float* x, const Sequences& seqs, const void* out) {
  OPENVC_RETURN_IF_ERROR(seqs.validate("seqs"));
  if (out == nullptr) return Status::Invalid("out must not be null");
  if (x == nullptr && seqs.total_tokens() > 0) {
    return Status::Invalid("x must not be null (seqs holds " + std::to_string(seqs.total_tokens()) + " tokens)");
  }
  return Status::Ok();
}

}  // namespace internal

}  // namespace openvc::reference
