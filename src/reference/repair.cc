// Section 6: V residual repair. Picks, per (sequence, head), the tokens whose per-head E4M3 V
// quantization lost the most energy and stores their residuals as E4M3 rows with the same V scale,
// so the kernel can add them back to the numerator.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "reference/internal.h"

namespace openvc::reference {
namespace {

std::string format_double(double x) {
  std::ostringstream os;
  os.precision(17);
  os << x;
  return os.str();
}

Status check_args(const float* v, const Sequences& seqs, const HeadQuantized& vq, double budget,
                  const VRepair* out) {
  // The budget is checked first: it is the argument users get wrong, and its message must name it.
  if (!std::isfinite(budget) || budget < 0.0 || budget >= 1.0) {
    return Status::Invalid("budget must be finite and in [0, 1), got " + format_double(budget));
  }
  OPENVC_RETURN_IF_ERROR(seqs.validate("seqs"));
  if (out == nullptr) return Status::Invalid("out must not be null");
  if (v == nullptr && seqs.total_tokens() > 0) {
    return Status::Invalid("v must not be null (seqs holds " + std::to_string(seqs.total_tokens()) + " tokens)");
  }
  const size_t elems = static_cast<size_t>(seqs.total_tokens()) * seqs.num_heads * seqs.head_dim;
  const size_t groups = static_cast<size_t>(seqs.count()) * seqs.num_heads;
  if (vq.codes.size() != elems) {
    return Status::Invalid("vq.codes must hold total_tokens * H * D = " + std::to_string(elems) + " codes, got " +
                           std::to_string(vq.codes.size()));
  }
  if (vq.descale.size() != groups || vq.scale_inv.size() != groups) {
    return Status::Invalid("vq.descale and vq.scale_inv must hold nseq * H = " + std::to_string(groups) +
                           " values, got " + std::to_string(vq.descale.size()) + " and " +
                           std::to_string(vq.scale_inv.size()));
  }
  return Status::Ok();
}

}  // namespace

// Layout: groups in (sequence, head) order, each group's rows contiguous, ordered by (energy desc,
// index asc). tokens_per_head is round(budget * length) of the longest sequence, i.e. the largest
// count; shorter sequences select round(budget * their length) rows.
Status select_v_repair(const float* v, const Sequences& seqs, const HeadQuantized& vq, double budget,
                       VRepair* out) {
  OPENVC_RETURN_IF_ERROR(check_args(v, seqs, vq, budget, out));
  const int H = seqs.num_heads, D = seqs.head_dim, nseq = seqs.count();
  // Round half away from zero on the double product, as documented in the contract.
  auto rows_for = [budget](int len) { return static_cast<int>(std::llround(budget * static_cast<double>(len))); };

  out->tokens_per_head = rows_for(seqs.max_length());
  out->count.assign(static_cast<size_t>(nseq) * H, 0);
  out->offset.assign(static_cast<size_t>(nseq) * H, 0);
  out->tokens.clear();
  out->codes.clear();

  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = e4m3_decode(static_cast<uint8_t>(c));

  std::vector<float> resid;       // [len, D] FP32 residuals of one group
  std::vector<double> energy;     // [len]
  std::vector<int> order;
  for (int s = 0; s < nseq; ++s) {
    const int64_t start = seqs.cu_seqlens[s];
    const int len = seqs.length(s);
    const int k = rows_for(len);
    for (int h = 0; h < H; ++h) {
      const size_t g = static_cast<size_t>(s) * H + h;
      out->offset[g] = static_cast<int>(out->tokens.size());
      out->count[g] = k;
      if (k == 0) continue;
      const float descale = vq.descale[g], scale_inv = vq.scale_inv[g];
      resid.assign(static_cast<size_t>(len) * D, 0.0f);
      energy.assign(len, 0.0);
      for (int j = 0; j < len; ++j) {
        const int64_t base = ((start + j) * H + h) * static_cast<int64_t>(D);
        double e = 0.0;
        for (int c = 0; c < D; ++c) {
          // Two FP32 roundings, exactly as a GPU prepass would compute them.
          const float recon = descale * table[vq.codes[base + c]];
          const float r = v[base + c] - recon;
          resid[static_cast<size_t>(j) * D + c] = r;
          e += static_cast<double>(r) * static_cast<double>(r);
        }
        // A NaN input would break the strict weak order below; rank it as the worst-quantized token.
        energy[j] = std::isnan(e) ? HUGE_VAL : e;
      }
      order.resize(len);
      for (int j = 0; j < len; ++j) order[j] = j;
      // Strict weak order (energy desc, index asc): the selected set and its storage order are unique.
      auto before = [&energy](int a, int b) { return energy[a] != energy[b] ? energy[a] > energy[b] : a < b; };
      std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
      for (int r = 0; r < k; ++r) {
        const int j = order[r];
        out->tokens.push_back(j);
        const float* row = resid.data() + static_cast<size_t>(j) * D;
        // One FP32 multiply by the V scale of this (sequence, head), then the saturating encode.
        for (int c = 0; c < D; ++c) out->codes.push_back(e4m3_encode(row[c] * scale_inv));
      }
    }
  }
  return Status::Ok();
}

}  // namespace openvc::reference
