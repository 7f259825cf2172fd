// Exact softmax attention in FP64 on the original (unquantized) inputs: the end-to-end oracle.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "reference/internal.h"

namespace openvc::reference {
namespace {

// [tokens, D] double copy of head h of a packed [total, H, D] float tensor.
std::vector<double> head_rows(const float* x, int64_t t0, int64_t tokens, int H, int D, int h) {
  std::vector<double> out(static_cast<size_t>(tokens) * D);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = x + ((t0 + t) * H + h) * D;
    for (int c = 0; c < D; ++c) out[t * D + c] = row[c];
  }
  return out;
}

void exact_group(const float* q, const float* k, const float* v, const Sequences& qs, const Sequences& ks, int s,
                 int h, double tau, bool causal, int chunk, std::vector<double>* out, std::vector<double>* lse) {
  const int H = qs.num_heads, D = qs.head_dim;
  const int64_t q0 = qs.cu_seqlens[s], k0 = ks.cu_seqlens[s], sq = qs.length(s), sk = ks.length(s);
  const std::vector<double> Q = head_rows(q, q0, sq, H, D, h);
  const std::vector<double> K = head_rows(k, k0, sk, H, D, h);
  const std::vector<double> V = head_rows(v, k0, sk, H, D, h);
  const std::vector<double> KP = internal::key_panels(K.data(), sk, D);
  const int64_t nblk = (sk + kQuantBlock - 1) / kQuantBlock;
  // Rows go in tiles so that each key block and each V row is reused from cache by every row of
  // the tile (streaming all of V once per row would be memory bound).
  constexpr int kRows = 16;
  const int64_t stride = nblk * kQuantBlock;
  std::vector<double> w(kRows * stride), o(kRows * D);
  for (int64_t i0 = 0; i0 < sq; i0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, sq - i0));
    for (int64_t b = 0; b < nblk; ++b) {
      for (int r = 0; r < rows; r += 2) {  // two query rows per pass over the key block
        const int r1 = std::min(r + 1, rows - 1);
        internal::block_dots2(&Q[(i0 + r) * D], &Q[(i0 + r1) * D], &KP[b * D * kQuantBlock], D,
                              &w[r * stride + b * kQuantBlock], &w[r1 * stride + b * kQuantBlock]);
      }
    }
    // Softmax weights in place: exp(tau * dot - max) on visible keys [0, jv), 0 elsewhere.
    double l[kRows], m[kRows];
    int64_t jmax = 0;
    for (int r = 0; r < rows; ++r) {
      const int64_t i = i0 + r, jv = causal ? causal_key_limit(i, sq, sk, chunk) : sk;
      double* wr = w.data() + r * stride;
      m[r] = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < jv; ++j) {
        wr[j] *= tau;
        m[r] = std::max(m[r], wr[j]);
      }
      l[r] = 0.0;
      for (int64_t j = 0; j < jv; ++j) l[r] += (wr[j] = std::exp(wr[j] - m[r]));
      std::fill(wr + jv, wr + stride, 0.0);
      jmax = std::max(jmax, jv);
    }
    std::fill(o.begin(), o.end(), 0.0);
    for (int64_t j0 = 0; j0 < jmax; j0 += 4) {  // four keys per pass over an output row
      const double* vr[4];
      for (int u = 0; u < 4; ++u) vr[u] = &V[std::min(j0 + u, sk - 1) * D];  // past sk the weight is 0
      for (int r = 0; r < rows; ++r) internal::axpy4(&o[r * D], D, &w[r * stride + j0], vr);
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      double* dst = out->data() + ((q0 + i) * H + h) * D;
      for (int c = 0; c < D; ++c) dst[c] = l[r] > 0 ? o[r * D + c] / l[r] : 0.0;  // no visible key: output 0
      if (lse) (*lse)[(static_cast<size_t>(s) * H + h) * qs.max_length() + i] = m[r] + std::log(l[r]);  // -inf if none
    }
  }
}

}  // namespace

Status attention_exact(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                       const Sequences& k_seqs, float softmax_scale, bool causal, std::vector<double>* out,
                       std::vector<double>* lse, int causal_chunk) {
  OPENVC_RETURN_IF_ERROR(internal::check_sequence_pair(q_seqs, k_seqs));
  if (out == nullptr) return Status::Invalid("out must not be null");
  if (q == nullptr && q_seqs.total_tokens() > 0) return Status::Invalid("q must not be null");
  if (k == nullptr && k_seqs.total_tokens() > 0) return Status::Invalid("k must not be null");
  if (v == nullptr && k_seqs.total_tokens() > 0) return Status::Invalid("v must not be null");
  if (causal_chunk < 1) return Status::Invalid("causal_chunk: must be >= 1, got " + std::to_string(causal_chunk));
  if (!std::isfinite(softmax_scale)) {
    return Status::Invalid("softmax_scale: must be finite (<= 0 selects 1/sqrt(D)), got " +
                           std::to_string(softmax_scale));
  }
  const int nseq = q_seqs.count(), H = q_seqs.num_heads, D = q_seqs.head_dim;
  const double tau = internal::resolve_softmax_scale(softmax_scale, D);
  out->assign(static_cast<size_t>(q_seqs.total_tokens()) * H * D, 0.0);
  if (lse) lse->assign(static_cast<size_t>(nseq) * H * q_seqs.max_length(), -std::numeric_limits<double>::infinity());

  internal::parallel_for(nseq * H, [&](int g) {
    exact_group(q, k, v, q_seqs, k_seqs, g / H, g % H, tau, causal, causal_chunk, out, lse);
  });
  return Status::Ok();
}

}  // namespace openvc::reference
