// Section 7: the VC-Attention baseline. Value tokens are grouped by k-means so that each 128-row block
// of the permuted V is nearly constant; the block mean is removed (V-Smooth) and only the small
// residual is quantized, per channel. The scores use ExpCast exactly as sections 3-4, in natural order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "reference/internal.h"

namespace openvc::reference {
namespace {

Status check_tokens(const float* x, const char* name, const Sequences& seqs) {
  if (x == nullptr && seqs.total_tokens() > 0) {
    return Status::Invalid(std::string(name) + " must not be null (" + std::to_string(seqs.total_tokens()) +
                           " tokens)");
  }
  return Status::Ok();
}

// Squared L2 distance in double between a token (float) and a centroid (double).
double distance2(const float* x, const double* c, int D) {
  double d = 0.0;
  for (int i = 0; i < D; ++i) {
    const double t = static_cast<double>(x[i]) - c[i];
    d += t * t;
  }
  return d;
}

// Nearest centroid of every token of one group; ties (and NaN distances) keep the lower cluster id.
void assign(const float* v, int64_t start, int len, int H, int h, int D, const std::vector<double>& centroids,
            int K, std::vector<int>* cluster) {
  for (int j = 0; j < len; ++j) {
    const float* x = v + ((start + j) * H + h) * static_cast<int64_t>(D);
    int best = 0;
    double best_d = distance2(x, centroids.data(), D);
    for (int c = 1; c < K; ++c) {
      const double d = distance2(x, centroids.data() + static_cast<size_t>(c) * D, D);
      if (d < best_d) {
        best_d = d;
        best = c;
      }
    }
    (*cluster)[j] = best;
  }
}

// Checks that every (sequence, head) slot of `permutation` is a permutation of [0, len) followed by -1.
Status check_permutation(const std::vector<int>& perm, const Sequences& seqs) {
  const int H = seqs.num_heads, nseq = seqs.count(), max_len = seqs.max_length();
  const size_t want = static_cast<size_t>(nseq) * H * max_len;
  if (perm.size() != want) {
    return Status::Invalid("permutation must hold nseq * H * max_len = " + std::to_string(want) +
                           " entries, got " + std::to_string(perm.size()));
  }
  std::vector<char> seen;
  for (int s = 0; s < nseq; ++s) {
    const int len = seqs.length(s);
    for (int h = 0; h < H; ++h) {
      const int* p = perm.data() + (static_cast<size_t>(s) * H + h) * max_len;
      seen.assign(len, 0);
      for (int i = 0; i < max_len; ++i) {
        const bool ok = i < len ? (p[i] >= 0 && p[i] < len && !seen[p[i]]) : p[i] == -1;
        if (!ok) {
          return Status::Invalid("permutation of sequence " + std::to_string(s) + ", head " + std::to_string(h) +
                                 " is not a permutation of [0, " + std::to_string(len) +
                                 ") padded with -1: position " + std::to_string(i) + " holds " +
                                 std::to_string(p[i]));
        }
        if (i < len) seen[p[i]] = 1;
      }
    }
  }
  return Status::Ok();
}

// Gathers x [total, H, D] so that position i of head h in sequence s holds token perm[i] of that head.
std::vector<float> apply_permutation(const float* x, const Sequences& seqs, const std::vector<int>& perm) {
  const int H = seqs.num_heads, D = seqs.head_dim, max_len = seqs.max_length();
  std::vector<float> out(static_cast<size_t>(seqs.total_tokens()) * H * D);
  for (int s = 0; s < seqs.count(); ++s) {
    const int64_t start = seqs.cu_seqlens[s];
    for (int h = 0; h < H; ++h) {
      const int* p = perm.data() + (static_cast<size_t>(s) * H + h) * max_len;
      for (int i = 0; i < seqs.length(s); ++i) {
        const float* src = x + ((start + p[i]) * H + h) * static_cast<int64_t>(D);
        std::copy(src, src + D, out.data() + ((start + i) * H + h) * static_cast<int64_t>(D));
      }
    }
  }
  return out;
}

// V-Smooth of one (sequence, head) of the permuted V: per 128-row block the BF16-rounded mean
// (mean[b * D + c]), the residual codes (rows of the [total, H, D] array `codes`) with one E4M3 scale per
// channel over the whole group, and the channel's descale (1 when its residual is all zero) and scale_inv.
void v_smooth(const float* vp, int64_t start, int len, int H, int h, int D, float* mean, uint8_t* codes,
              float* descale, float* scale_inv) {
  const int nblk = (len + kQuantBlock - 1) / kQuantBlock;
  auto at = [&](int j) { return vp + ((start + j) * H + h) * static_cast<int64_t>(D); };
  for (int b = 0; b < nblk; ++b) {
    const int j0 = b * kQuantBlock, j1 = std::min(len, j0 + kQuantBlock);  // partial block: valid rows
    for (int c = 0; c < D; ++c) {
      double sum = 0.0;
      for (int j = j0; j < j1; ++j) sum += at(j)[c];
      // Mean in double, then FP32, then BF16: the kernel stores it as a 16-bit vector.
      mean[static_cast<size_t>(b) * D + c] = round_to_bf16(static_cast<float>(sum / (j1 - j0)));
    }
  }
  std::vector<float> resid(static_cast<size_t>(len) * D);
  std::vector<float> amax(D, 0.0f);
  for (int j = 0; j < len; ++j) {
    const float* m = mean + static_cast<size_t>(j / kQuantBlock) * D;
    for (int c = 0; c < D; ++c) {
      const float r = at(j)[c] - m[c];  // FP32 subtraction
      resid[static_cast<size_t>(j) * D + c] = r;
      amax[c] = std::max(amax[c], std::fabs(r));
    }
  }
  for (int c = 0; c < D; ++c) {
    // Same scale formulas as section 1, one group per channel.
    scale_inv[c] = amax[c] > 0.0f ? kE4M3Max / amax[c] : 0.0f;
    descale[c] = amax[c] > 0.0f ? amax[c] / kE4M3Max : 1.0f;
    if (!std::isfinite(scale_inv[c])) scale_inv[c] = 0.0f, descale[c] = 1.0f;  // tiny residual: zeros
    for (int j = 0; j < len; ++j) {
      codes[((start + j) * H + h) * static_cast<int64_t>(D) + c] =
          e4m3_encode(resid[static_cast<size_t>(j) * D + c] * scale_inv[c]);
    }
  }
}

struct GroupInputs {
  const Sequences& q_seqs;
  const Sequences& k_seqs;
  const VcPrepared& p;       // Q, permuted K, V-Smooth of the permuted V
  float scale;               // resolved softmax scale
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One (sequence, head): the ExpCast online softmax of sections 3-4 in natural key order, with the
// V-Smooth numerator. Returns the number of rescales. Same oracle choices as attention_expcast
// (ideal FP32 accumulator for Q8.K8, A and l in double, every byte-deciding step in FP32).
int64_t run_group(const GroupInputs& in, int s, int h, AttentionResult* res) {
  const int H = in.q_seqs.num_heads, D = in.q_seqs.head_dim;
  const int64_t qs = in.q_seqs.cu_seqlens[s], ks = in.k_seqs.cu_seqlens[s];
  const int sq = in.q_seqs.length(s), sk = in.k_seqs.length(s);
  const int nkb = (sk + kQuantBlock - 1) / kQuantBlock;
  const int64_t stride = static_cast<int64_t>(H) * D;
  const size_t g = static_cast<size_t>(s) * H + h;
  const VcPrepared& p = in.p;
  const std::vector<double> q8 = internal::decode_rows(p.q.codes.data() + qs * stride + h * D, sq, stride, D);
  const std::vector<double> k8 = internal::decode_rows(p.k.codes.data() + ks * stride + h * D, sk, stride, D);
  const float* mu = p.block_mean.data() + g * p.k.max_blocks * D;
  const float* vdesc = p.channel_descale.data() + g * D;
  std::vector<float> deq(static_cast<size_t>(sk) * D);  // dequantized residual, descale_c * decode(code)
  for (int j = 0; j < sk; ++j) {
    for (int c = 0; c < D; ++c) {
      deq[static_cast<size_t>(j) * D + c] = vdesc[c] * e4m3_decode(p.v_codes[(ks + j) * stride + h * D + c]);
    }
  }
  const float* qdesc = p.q.descale.data() + g * p.q.max_blocks;
  const float* kdesc = p.k.descale.data() + g * p.k.max_blocks;
  float* lse = res->lse.data() + g * in.q_seqs.max_length();

  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = e4m3_decode(static_cast<uint8_t>(c));
  int64_t rescales = 0;
  std::vector<float> x(kQuantBlock);
  std::vector<double> A(D);
  for (int i = 0; i < sq; ++i) {
    float M = kNegInf;  // running max in code units: max over visited keys of fl(acc * a)
    double l = 0.0;
    std::fill(A.begin(), A.end(), 0.0);
    const double* qi = q8.data() + static_cast<size_t>(i) * D;
    for (int b = 0; b < nkb; ++b) {  // natural order
      const int j0 = b * kQuantBlock, j1 = std::min(sk, j0 + kQuantBlock);
      const float a = expcast_multiplier(in.scale, qdesc[i / kQuantBlock], kdesc[b]);
      float T = kNegInf;  // tile max of fl(acc * a)
      for (int j = j0; j < j1; ++j) {
        x[j - j0] = internal::ideal_dot(qi, k8.data() + static_cast<size_t>(j) * D, D);
        T = std::max(T, x[j - j0] * a);  // FP32 product, as in the kernel
      }
      // Zero deadband: the max is raised before this tile's codes are formed.
      if (T > M) {
        if (std::isfinite(M)) {
          const float alpha = std::exp2((M - T) / 8.0f);  // 8 codes per power of two
          l *= alpha;
          for (double& e : A) e *= alpha;
          ++rescales;
        }
        M = T;
      }
      double psum = 0.0;
      for (int j = j0; j < j1; ++j) {
        const float pj = table[expcast_code(x[j - j0], a, M)];
        if (pj == 0.0f) continue;
        psum += pj;
        const float* r = deq.data() + static_cast<size_t>(j) * D;
        for (int c = 0; c < D; ++c) A[c] += static_cast<double>(pj) * r[c];
      }
      // The block mean comes back through the block's probability row sum.
      const float* m = mu + static_cast<size_t>(b) * D;
      for (int c = 0; c < D; ++c) A[c] += psum * m[c];
      l += psum;
    }
    float* o = res->out.data() + (qs + i) * stride + h * D;
    if (!std::isfinite(M)) continue;  // no key at all: output 0, lse -inf (already set)
    // Per-channel descales are already inside A, so there is no V descale here.
    for (int c = 0; c < D; ++c) o[c] = static_cast<float>(A[c] / l);
    lse[i] = static_cast<float>(std::log(2.0) * (static_cast<double>(M) / 8.0) + std::log(l / 256.0));
  }
  return rescales;
}

}  // namespace

// Deterministic k-means: K = min(kVcClusters, length) clusters, centroid c initialised to token
// floor(c * length / K) (evenly spread, no randomness, so every run and every device agrees).
Status vc_grouping(const float* v, const Sequences& seqs, std::vector<int>* permutation) {
  OPENVC_RETURN_IF_ERROR(seqs.validate("seqs"));
  OPENVC_RETURN_IF_ERROR(check_tokens(v, "v", seqs));
  if (permutation == nullptr) return Status::Invalid("permutation must not be null");
  const int H = seqs.num_heads, D = seqs.head_dim, nseq = seqs.count(), max_len = seqs.max_length();
  permutation->assign(static_cast<size_t>(nseq) * H * max_len, -1);
  std::vector<double> centroids, sums;
  std::vector<int> cluster, members;
  for (int s = 0; s < nseq; ++s) {
    const int64_t start = seqs.cu_seqlens[s];
    const int len = seqs.length(s);
    if (len == 0) continue;
    const int K = std::min(kVcClusters, len);
    for (int h = 0; h < H; ++h) {
      centroids.assign(static_cast<size_t>(K) * D, 0.0);
      for (int c = 0; c < K; ++c) {
        const int j = static_cast<int>(static_cast<int64_t>(c) * len / K);
        const float* x = v + ((start + j) * H + h) * static_cast<int64_t>(D);
        std::copy(x, x + D, centroids.begin() + static_cast<size_t>(c) * D);
      }
      cluster.assign(len, 0);
      for (int it = 0; it < kVcIterations; ++it) {
        assign(v, start, len, H, h, D, centroids, K, &cluster);
        sums.assign(static_cast<size_t>(K) * D, 0.0);
        members.assign(K, 0);
        for (int j = 0; j < len; ++j) {
          const float* x = v + ((start + j) * H + h) * static_cast<int64_t>(D);
          double* acc = sums.data() + static_cast<size_t>(cluster[j]) * D;
          for (int c = 0; c < D; ++c) acc[c] += x[c];
          ++members[cluster[j]];
        }
        for (int c = 0; c < K; ++c) {
          if (members[c] == 0) continue;  // an empty cluster keeps its centroid
          for (int d = 0; d < D; ++d) {
            centroids[static_cast<size_t>(c) * D + d] = sums[static_cast<size_t>(c) * D + d] / members[c];
          }
        }
      }
      assign(v, start, len, H, h, D, centroids, K, &cluster);  // final assignment defines the order
      // Counting sort by cluster id: stable, so tokens of one cluster keep their original order.
      std::vector<int> first(K + 1, 0);
      for (int j = 0; j < len; ++j) ++first[cluster[j] + 1];
      for (int c = 0; c < K; ++c) first[c + 1] += first[c];
      int* p = permutation->data() + (static_cast<size_t>(s) * H + h) * max_len;
      for (int j = 0; j < len; ++j) p[first[cluster[j]]++] = j;
    }
  }
  return Status::Ok();
}

Status vc_prepare(const float* q, const float* k, const float* v, const Sequences& q_seqs, const Sequences& k_seqs,
                  const std::vector<int>& permutation, VcPrepared* out) {
  OPENVC_RETURN_IF_ERROR(internal::check_sequence_pair(q_seqs, k_seqs));
  OPENVC_RETURN_IF_ERROR(check_tokens(q, "q", q_seqs));
  OPENVC_RETURN_IF_ERROR(check_tokens(k, "k", k_seqs));
  OPENVC_RETURN_IF_ERROR(check_tokens(v, "v", k_seqs));
  if (out == nullptr) return Status::Invalid("out must not be null");
  OPENVC_RETURN_IF_ERROR(check_permutation(permutation, k_seqs));
  // Permuting K and V together is exact for non-causal softmax attention; quantization then sees the
  // permuted token order, so K's 128-token blocks are blocks of the permuted sequence.
  const std::vector<float> kp = apply_permutation(k, k_seqs, permutation);
  const std::vector<float> vp = apply_permutation(v, k_seqs, permutation);
  OPENVC_RETURN_IF_ERROR(quantize_blocks(q, q_seqs, &out->q));
  OPENVC_RETURN_IF_ERROR(quantize_blocks(kp.data(), k_seqs, &out->k));
  const int H = k_seqs.num_heads, D = k_seqs.head_dim, nseq = k_seqs.count(), nblk = out->k.max_blocks;
  out->v_codes.assign(static_cast<size_t>(k_seqs.total_tokens()) * H * D, 0);
  out->channel_descale.assign(static_cast<size_t>(nseq) * H * D, 1.0f);
  out->channel_scale_inv.assign(static_cast<size_t>(nseq) * H * D, 0.0f);
  out->block_mean.assign(static_cast<size_t>(nseq) * H * nblk * D, 0.0f);
  for (int s = 0; s < nseq; ++s) {
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(s) * H + h;
      v_smooth(vp.data(), k_seqs.cu_seqlens[s], k_seqs.length(s), H, h, D, out->block_mean.data() + g * nblk * D,
               out->v_codes.data(), out->channel_descale.data() + g * D, out->channel_scale_inv.data() + g * D);
    }
  }
  return Status::Ok();
}

// Natural key order only (opt.mid_window_blocks is ignored: the baseline has no mid-window), and no
// causal mask (the permutation would break it). Rows of a sequence with no keys get output 0 and
// lse -inf.
Status attention_vc(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                    const Sequences& k_seqs, const std::vector<int>& permutation,
                    const AttentionOptions& opt, AttentionResult* res) {
  OPENVC_RETURN_IF_ERROR(internal::check_sequence_pair(q_seqs, k_seqs));
  OPENVC_RETURN_IF_ERROR(check_tokens(q, "q", q_seqs));
  OPENVC_RETURN_IF_ERROR(check_tokens(k, "k", k_seqs));
  OPENVC_RETURN_IF_ERROR(check_tokens(v, "v", k_seqs));
  if (res == nullptr) return Status::Invalid("res must not be null");
  if (opt.causal) {
    return Status::Invalid("opt.causal must be false: the VC baseline permutes keys, which breaks a causal mask");
  }
  if (opt.key_tile != kQuantBlock) {
    return Status::Invalid("opt.key_tile must equal kQuantBlock (" + std::to_string(kQuantBlock) + "), got " +
                           std::to_string(opt.key_tile));
  }
  if (opt.query_tile <= 0) return Status::Invalid("opt.query_tile must be > 0, got " + std::to_string(opt.query_tile));
  if (!std::isfinite(opt.softmax_scale)) {
    return Status::Invalid("opt.softmax_scale must be finite (<= 0 selects 1/sqrt(D)), got " +
                           std::to_string(opt.softmax_scale));
  }

  const int H = q_seqs.num_heads, D = q_seqs.head_dim, nseq = q_seqs.count();
  const float scale = internal::resolve_softmax_scale(opt.softmax_scale, D);

  VcPrepared prepared;
  OPENVC_RETURN_IF_ERROR(vc_prepare(q, k, v, q_seqs, k_seqs, permutation, &prepared));

  res->out.assign(static_cast<size_t>(q_seqs.total_tokens()) * H * D, 0.0f);
  res->lse.assign(static_cast<size_t>(nseq) * H * q_seqs.max_length(), -std::numeric_limits<float>::infinity());
  res->rescales = 0;

  // (sequence, head) groups are independent and write disjoint outputs: spread them over the
  // hardware threads like attention_expcast. Results do not depend on the thread count.
  const GroupInputs in{q_seqs, k_seqs, prepared, scale};
  const int groups = nseq * H;
  const int nthreads = std::max(1, std::min<int>(groups, static_cast<int>(std::thread::hardware_concurrency())));
  std::vector<int64_t> rescales(groups, 0);
  auto worker = [&](int first) {
    for (int g = first; g < groups; g += nthreads) rescales[g] = run_group(in, g / H, g % H, res);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < nthreads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& th : pool) th.join();
  for (int64_t r : rescales) res->rescales += r;
  return Status::Ok();
}

}  // namespace openvc::reference
