// Sections 2-6 and 9: prepared FP8 (or INT8 Q/K) inputs and the ExpCast online-softmax attention
// (the kernel's oracle).
//
// Oracle choices, where the kernel's arithmetic is the hardware's rather than the contract's:
// - Q8.K8 uses the ideal accumulator: the exact sum of the FP8 products (exact in double whatever
//   the order, see internal::ideal_dot) rounded once to FP32. With INT8 Q/K (section 9) the same
//   code computes the exact integer dot product, which FP32 holds exactly (|acc| < 2^24 for D <= 1040).
// - The numerator A and the denominator l are kept in double, so the reference's own summation
//   error is far below the kernel's FP32 accumulation error that tests bound.
// Everything that decides a byte (multiplier, tile max, bias, FMA, rounding, rescale factor) is FP32
// in the kernel's order.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "reference/internal.h"

namespace openvc::reference {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Status check_size(const char* what, size_t got, size_t expected) {
  if (got == expected) return Status::Ok();
  return Status::Invalid(std::string(what) + ": expected " + std::to_string(expected) + " elements, got " +
                         std::to_string(got));
}

// INT8 operands (section 9): group layout, sizes, and codes in [-127, 127] (the score bound needs it).
Status check_int8(const char* name, const Int8Quantized& x, int group_tokens, int groups, size_t codes,
                  size_t heads) {
  const std::string n = name;
  if (x.group_tokens != group_tokens) {
    return Status::Invalid(n + ".group_tokens: expected " + std::to_string(group_tokens) + ", got " +
                           std::to_string(x.group_tokens));
  }
  if (x.groups != groups) {
    return Status::Invalid(n + ".groups: expected " + std::to_string(groups) + ", got " + std::to_string(x.groups));
  }
  OPENVC_RETURN_IF_ERROR(check_size((n + ".codes").c_str(), x.codes.size(), codes));
  OPENVC_RETURN_IF_ERROR(check_size((n + ".descale").c_str(), x.descale.size(), heads * groups));
  for (size_t i = 0; i < x.codes.size(); ++i) {
    if (x.codes[i] < -127) return Status::Invalid(n + ".codes[" + std::to_string(i) + "]: -128 is not a code");
  }
  return Status::Ok();
}

Status check_prepared(const PreparedInputs& in) {
  OPENVC_RETURN_IF_ERROR(internal::check_sequence_pair(in.q_seqs, in.k_seqs));
  const size_t nseq = in.q_seqs.count(), H = in.q_seqs.num_heads, D = in.q_seqs.head_dim;
  const size_t tq = in.q_seqs.total_tokens(), tk = in.k_seqs.total_tokens();
  if (in.qk_format == QkFormat::kInt8) {
    OPENVC_RETURN_IF_ERROR(check_int8("in.q8", in.q8, 1, in.q_seqs.max_length(), tq * H * D, nseq * H));
    OPENVC_RETURN_IF_ERROR(
        check_int8("in.k8", in.k8, kQuantBlock, in.k_seqs.max_blocks() * kInt8KeyGroups, tk * H * D, nseq * H));
  } else if (in.qk_format == QkFormat::kE4M3) {
    if (in.q.max_blocks != in.q_seqs.max_blocks()) {
      return Status::Invalid("in.q.max_blocks: expected " + std::to_string(in.q_seqs.max_blocks()) +
                             " (q_seqs.max_blocks()), got " + std::to_string(in.q.max_blocks));
    }
    if (in.k.max_blocks != in.k_seqs.max_blocks()) {
      return Status::Invalid("in.k.max_blocks: expected " + std::to_string(in.k_seqs.max_blocks()) +
                             " (k_seqs.max_blocks()), got " + std::to_string(in.k.max_blocks));
    }
    OPENVC_RETURN_IF_ERROR(check_size("in.q.codes", in.q.codes.size(), tq * H * D));
    OPENVC_RETURN_IF_ERROR(check_size("in.k.codes", in.k.codes.size(), tk * H * D));
    OPENVC_RETURN_IF_ERROR(check_size("in.q.descale", in.q.descale.size(), nseq * H * in.q.max_blocks));
    OPENVC_RETURN_IF_ERROR(check_size("in.k.descale", in.k.descale.size(), nseq * H * in.k.max_blocks));
  } else {
    return Status::Invalid("in.qk_format: expected QkFormat::kE4M3 or QkFormat::kInt8, got " +
                           std::to_string(static_cast<int>(in.qk_format)));
  }
  OPENVC_RETURN_IF_ERROR(check_size("in.v.codes", in.v.codes.size(), tk * H * D));
  OPENVC_RETURN_IF_ERROR(check_size("in.v.descale", in.v.descale.size(), nseq * H));
  if (const VRepair* r = in.repair) {
    OPENVC_RETURN_IF_ERROR(check_size("in.repair->count", r->count.size(), nseq * H));
    OPENVC_RETURN_IF_ERROR(check_size("in.repair->offset", r->offset.size(), nseq * H));
    OPENVC_RETURN_IF_ERROR(check_size("in.repair->codes", r->codes.size(), r->tokens.size() * D));
    for (size_t g = 0; g < nseq * H; ++g) {
      const int64_t cnt = r->count[g], off = r->offset[g];
      if (cnt < 0 || off < 0 || off + cnt > static_cast<int64_t>(r->tokens.size())) {
        return Status::Invalid("in.repair: group " + std::to_string(g) + " has offset " + std::to_string(off) +
                               " and count " + std::to_string(cnt) + ", expected a range inside tokens (size " +
                               std::to_string(r->tokens.size()) + ")");
      }
      const int sk = in.k_seqs.length(static_cast<int>(g / H));
      for (int64_t k = off; k < off + cnt; ++k) {
        if (r->tokens[k] < 0 || r->tokens[k] >= sk) {
          return Status::Invalid("in.repair->tokens[" + std::to_string(k) + "]: expected a token in [0, " +
                                 std::to_string(sk) + "), got " + std::to_string(r->tokens[k]));
        }
      }
    }
  }
  return Status::Ok();
}

Status check_options(const AttentionOptions& opt) {
  if (opt.key_tile != kQuantBlock) {
    return Status::Invalid("opt.key_tile: must equal kQuantBlock (" + std::to_string(kQuantBlock) +
                           ") in this version, got " + std::to_string(opt.key_tile));
  }
  if (opt.query_tile <= 0) return Status::Invalid("opt.query_tile: must be > 0, got " + std::to_string(opt.query_tile));
  if (opt.mid_window_blocks < kNaturalOrder) {
    return Status::Invalid("opt.mid_window_blocks: must be >= 0 or kNaturalOrder (-1), got " +
                           std::to_string(opt.mid_window_blocks));
  }
  if (opt.p_format != PFormat::kExpCast && opt.p_format != PFormat::kExp2) {
    return Status::Invalid("opt.p_format: expected PFormat::kExpCast or PFormat::kExp2, got " +
                           std::to_string(static_cast<int>(opt.p_format)));
  }
  if (opt.key_blocks != nullptr) {
    const KeyBlockLists& kb = *opt.key_blocks;
    if (kb.num_blocks == nullptr || kb.indices == nullptr)
      return Status::Invalid("opt.key_blocks: num_blocks and indices must both be set");
    if (opt.causal) return Status::Unsupported("opt.key_blocks: key block lists do not combine with causal");
    if (opt.query_tile != kQuantBlock)
      return Status::Invalid("opt.key_blocks: query_tile must be " + std::to_string(kQuantBlock) + " with key block lists");
    if (kb.batch < 1 || kb.heads < 1 || kb.q_tiles < 1 || kb.capacity < 1)
      return Status::Invalid("opt.key_blocks: batch, heads, q_tiles and capacity must be >= 1");
  }
  if (opt.causal_chunk < 1 || (opt.causal_chunk != 1 && !opt.causal))
    return Status::Invalid("opt.causal_chunk: must be >= 1, and != 1 only with causal, got " +
                           std::to_string(opt.causal_chunk));
  if (opt.split_ctas < 0) return Status::Invalid("opt.split_ctas: must be >= 0, got " + std::to_string(opt.split_ctas));
  if (opt.split_ctas > 0 && (opt.causal || opt.key_blocks != nullptr || opt.v_block_descale != nullptr ||
                             opt.query_tile != kQuantBlock))
    return Status::Unsupported("opt.split_ctas: split tiles take non-causal calls with query_tile 128, without key "
                               "block lists or V block descales");
  if (!std::isfinite(opt.softmax_scale)) {
    return Status::Invalid("opt.softmax_scale: must be finite (<= 0 selects 1/sqrt(D)), got " +
                           std::to_string(opt.softmax_scale));
  }
  return Status::Ok();
}

// Row of a key block list for (sequence s, head h, query tile qt) (broadcast where batch / heads are 1).
int64_t listed_row(const KeyBlockLists& kb, int s, int h, int qt) {
  return (int64_t(kb.batch == 1 ? 0 : s) * kb.heads + (kb.heads == 1 ? 0 : h)) * kb.q_tiles + qt;
}

// Online-softmax state of one query row.
struct RowState {
  float m = kNegInf;  // running max in code units: max over visited keys of fl(acc * a)
  double l = 0.0;     // sum of decoded codes
  double* A = nullptr;  // [D] sum of decoded code * decoded V8 (descale_V applied at the end)
};

// Split tiles (numerics section 5): row state `part` (one part of a tile's key order) folded into `into`, the
// parts before it: both brought to the larger max with the kernel's FP32 factors, sums in double.
void fold_part(RowState& into, const RowState& part, int D) {
  if (!std::isfinite(part.m)) return;   // the part saw no key of this row
  if (!std::isfinite(into.m)) {
    into.m = part.m, into.l = part.l;
    for (int c = 0; c < D; ++c) into.A[c] = part.A[c];
    return;
  }
  const float m = std::max(into.m, part.m);
  const double a = std::exp2((into.m - m) / 8.0f), b = std::exp2((part.m - m) / 8.0f);
  into.m = m;
  into.l = into.l * a + part.l * b;
  for (int c = 0; c < D; ++c) into.A[c] = into.A[c] * a + part.A[c] * b;
}

// One (sequence, head) group: all of its query tiles, key blocks and repair rows.
int64_t run_group(const PreparedInputs& in, const AttentionOptions& opt, int s, int h, float tau,
                  AttentionResult* res) {
  const int H = in.q_seqs.num_heads, D = in.q_seqs.head_dim;
  const int64_t q0 = in.q_seqs.cu_seqlens[s], k0 = in.k_seqs.cu_seqlens[s];
  const int64_t sq = in.q_seqs.length(s), sk = in.k_seqs.length(s);
  const int64_t stride = static_cast<int64_t>(H) * D;
  const int bt = opt.key_tile;
  const size_t g = static_cast<size_t>(s) * H + h;
  // The one difference between the formats: the operands (E4M3 decoded, or INT8 integers) and the
  // scale groups: Q per 128-row block or per row (Q descale of row i: dq[i / q_group]); K per 128-key
  // block, or per (block, key group) (K descale of key j: dk[k_index(j)]).
  const bool int8 = in.qk_format == QkFormat::kInt8;
  const int q_group = int8 ? 1 : kQuantBlock;
  const float* dq = int8 ? &in.q8.descale[g * in.q8.groups] : &in.q.descale[g * in.q.max_blocks];
  const float* dk = int8 ? &in.k8.descale[g * in.k8.groups] : &in.k.descale[g * in.k.max_blocks];
  auto k_index = [int8](int64_t j) { return int8 ? int8_key_descale_index(j) : j / kQuantBlock; };
  const int key_groups = int8 ? kInt8KeyGroups : 1;  // K descales (multipliers) per key block
  // V block descales (opt.v_block_descale): applied to each key's decoded values, the head descale then 1.
  const float* dvb = opt.v_block_descale ? opt.v_block_descale + g * in.k_seqs.max_blocks() : nullptr;
  const double dv = dvb ? 1.0 : in.v.descale[g];
  // V rounding bias (numerics section 4): the mean rounding residual of the sequence's keys, per channel.
  std::vector<double> v_bias(D, 0.0);
  if (opt.v_bias_correction)
    for (int c = 0; c < D; ++c) v_bias[c] = in.v.bias[g * D + c];
  const int max_q = in.q_seqs.max_length();
  float* lse = res->lse.data() + g * max_q;

  // Decode once per group and reuse for every tile (the dot products dominate the run time).
  const std::vector<double> Q =
      int8 ? internal::int8_rows(in.q8.codes.data() + q0 * stride + h * D, sq, stride, D)
           : internal::decode_rows(in.q.codes.data() + q0 * stride + h * D, sq, stride, D);
  const std::vector<double> K =
      int8 ? internal::int8_rows(in.k8.codes.data() + k0 * stride + h * D, sk, stride, D)
           : internal::decode_rows(in.k.codes.data() + k0 * stride + h * D, sk, stride, D);
  std::vector<double> V = internal::decode_rows(in.v.codes.data() + k0 * stride + h * D, sk, stride, D);
  if (dvb != nullptr)
    for (int64_t j = 0; j < sk; ++j)
      for (int c = 0; c < D; ++c) V[j * D + c] *= dvb[j / kQuantBlock];
  const std::vector<double> KP = internal::key_panels(K.data(), sk, D);
  const VRepair* rep = in.repair;
  const int rcount = rep ? rep->count[g] : 0;
  std::vector<double> R;
  if (rcount > 0) R = internal::decode_rows(&rep->codes[static_cast<size_t>(rep->offset[g]) * D], rcount, D, D);

  float decode_table[256];
  for (int c = 0; c < 256; ++c) decode_table[c] = e4m3_decode(static_cast<uint8_t>(c));
  // The P format's code of a score (section "P format"): ExpCast, or exp2 (its code depends on the key's
  // position in its 128-key block).
  const bool exp2_p = opt.p_format == PFormat::kExp2;
  auto code_of = [exp2_p](float acc, float a, float m, int64_t key_in_block) {
    return exp2_p ? exp2_format_code(acc, a, m, static_cast<int>(key_in_block)) : expcast_code(acc, a, m);
  };

  const int n = static_cast<int>((sk + bt - 1) / bt);
  int64_t rescales = 0;
  const int tile_rows = static_cast<int>(std::min<int64_t>(opt.query_tile, sq));  // storage only
  std::vector<double> A_buf(static_cast<size_t>(tile_rows) * D);
  std::vector<RowState> rows(tile_rows);
  // Split tiles: the parts before the current one, folded (fold_part).
  const int64_t nq_tiles = (sq + opt.query_tile - 1) / opt.query_tile;
  std::vector<double> folded_A(opt.split_ctas > 0 ? A_buf.size() : 0);
  std::vector<RowState> folded(opt.split_ctas > 0 ? tile_rows : 0);
  std::vector<double> sums0(bt), sums1(bt);
  std::vector<float> acc(bt);
  std::vector<double> pv_p;           // nonzero decoded codes of one row and block ...
  std::vector<const double*> pv_v;    // ... and the decoded V rows they weight

  for (int64_t r0 = 0; r0 < sq; r0 += opt.query_tile) {
    const int nrows = static_cast<int>(std::min<int64_t>(opt.query_tile, sq - r0));
    std::fill(A_buf.begin(), A_buf.end(), 0.0);
    for (int r = 0; r < nrows; ++r) rows[r] = RowState{kNegInf, 0.0, &A_buf[static_cast<size_t>(r) * D]};
    // Causal: only the blocks the tile's last row sees, from the diagonal down (numerics section 5).
    const int nv = opt.causal ? causal_visible_blocks(r0 + nrows - 1, sq, sk, bt, opt.causal_chunk) : n;
    const KeyBlockLists* kb = opt.key_blocks;
    const std::vector<int> order =
        kb != nullptr ? listed_block_order(kb->indices + listed_row(*kb, s, h, r0 / bt) * kb->capacity,
                                           kb->num_blocks[listed_row(*kb, s, h, r0 / bt)], kb->capacity,
                                           diagonal_block(r0, sq, sk, bt), n, opt.mid_window_blocks)
        : nv <= 0    ? std::vector<int>()
        : opt.causal ? key_block_order(nv - 1, nv, opt.mid_window_blocks)
                     : key_block_order(diagonal_block(r0, sq, sk, bt), n, opt.mid_window_blocks);

    // Split tiles: the order positions where a new part starts (its rows' state from scratch).
    const std::vector<int> cuts =
        opt.split_ctas > 0 ? split_cuts((int64_t(s) * H + h) * nq_tiles + r0 / opt.query_tile, n,
                                        int64_t(in.q_seqs.count()) * H * nq_tiles, opt.split_ctas)
                           : std::vector<int>();
    for (int r = 0; r < static_cast<int>(folded.size()); ++r)
      folded[r] = RowState{kNegInf, 0.0, &folded_A[static_cast<size_t>(r) * D]};
    auto fold_rows = [&] {
      for (int r = 0; r < nrows; ++r) {
        fold_part(folded[r], rows[r], D);
        rows[r].m = kNegInf, rows[r].l = 0.0;
        std::fill(rows[r].A, rows[r].A + D, 0.0);
      }
    };
    size_t next_cut = 0;
    for (size_t pos = 0; pos < order.size(); ++pos) {
      if (next_cut < cuts.size() && int(pos) == cuts[next_cut]) fold_rows(), ++next_cut;
      const int b = order[pos];
      const int64_t j0 = static_cast<int64_t>(b) * bt, j1 = std::min<int64_t>(j0 + bt, sk);
      // One row's step of the online softmax on block b, given its exact dot products.
      auto row_step = [&](int r, const std::vector<double>& sums) {
        const int64_t i = r0 + r;
        // Causal: keys j <= i + (sk - sq) are visible; everything from jv on is masked.
        const int64_t jv = opt.causal ? std::min<int64_t>(j1, causal_key_limit(i, sq, sk, opt.causal_chunk)) : j1;
        if (jv <= j0) return;  // whole block masked for this row: no max update, all codes 0
        RowState& st = rows[r];
        // One multiplier per K descale of the block (section 9's key groups for INT8): a_blk[key group].
        float a_blk[kInt8KeyGroups];
        for (int kg = 0; kg < key_groups; ++kg)
          a_blk[kg] = expcast_multiplier(tau, dq[i / q_group], dk[static_cast<int64_t>(b) * key_groups + kg]);
        auto a_of = [&](int64_t j) { return a_blk[int8 ? int8_key_group(j) : 0]; };
        float tile_max = kNegInf;
        for (int64_t j = j0; j < jv; ++j) {
          acc[j - j0] = static_cast<float>(sums[j - j0]);  // the ideal accumulator: one rounding
          tile_max = std::max(tile_max, acc[j - j0] * a_of(j));  // FP32 product, as in the kernel
        }
        // Zero deadband: the max is raised before this tile's codes are formed.
        if (tile_max > st.m) {
          if (std::isfinite(st.m)) {
            const float alpha = std::exp2((st.m - tile_max) / 8.0f);
            st.l *= alpha;
            for (int c = 0; c < D; ++c) st.A[c] *= alpha;
            ++rescales;
          }
          st.m = tile_max;
        }
        pv_p.clear();
        pv_v.clear();
        for (int64_t j = j0; j < jv; ++j) {
          const float p = decode_table[code_of(acc[j - j0], a_of(j), st.m, j - j0)];
          if (p == 0.0f) continue;
          st.l += p;  // the same decoded value that weights V below
          pv_p.push_back(p);
          pv_v.push_back(&V[j * D]);
        }
        while (pv_p.size() % 4 != 0) {  // pad to groups of four with zero weights
          pv_p.push_back(0.0);
          pv_v.push_back(pv_v.back());
        }
        for (size_t k = 0; k < pv_p.size(); k += 4) internal::axpy4(st.A, D, &pv_p[k], &pv_v[k]);
      };
      const double* panels = &KP[static_cast<size_t>(b) * D * bt];
      for (int r = 0; r < nrows; r += 2) {  // two rows per pass over the key block
        const int r1 = std::min(r + 1, nrows - 1);
        internal::block_dots2(&Q[(r0 + r) * D], &Q[(r0 + r1) * D], panels, D, sums0.data(), sums1.data());
        row_step(r, sums0);
        if (r1 != r) row_step(r1, sums1);
      }
    }

    if (!cuts.empty()) {   // the last part folded too; the tile's rows are the folded states
      fold_rows();
      for (int r = 0; r < nrows; ++r) {
        rows[r].m = folded[r].m, rows[r].l = folded[r].l;
        std::copy(folded[r].A, folded[r].A + D, rows[r].A);
      }
    }

    // Repair rows (section 6) come after every original block. They reproduce the original token's
    // score exactly (same K8 and block descale), are coded against the final max (which they cannot
    // raise) and add to the numerator only: l stays the denominator of the original keys.
    for (int k = 0; k < rcount; ++k) {
      const int64_t t = rep->tokens[rep->offset[g] + k];
      for (int r = 0; r < nrows; ++r) {
        const int64_t i = r0 + r;
        if (internal::key_masked(i, t, sq, sk, opt.causal, opt.causal_chunk)) continue;
        RowState& st = rows[r];
        const float a = expcast_multiplier(tau, dq[i / q_group], dk[k_index(t)]);
        const float p = decode_table[code_of(internal::ideal_dot(&Q[i * D], &K[t * D], D), a, st.m, t)];
        if (p == 0.0f) continue;
        const double* rt = &R[static_cast<size_t>(k) * D];
        for (int c = 0; c < D; ++c) st.A[c] += p * rt[c];
      }
    }

    for (int r = 0; r < nrows; ++r) {
      const int64_t i = r0 + r;
      const RowState& st = rows[r];
      float* o = res->out.data() + (q0 + i) * stride + h * D;
      if (!std::isfinite(st.m)) {  // no visible key (causal corner, or an empty key sequence)
        std::fill(o, o + D, 0.0f);
        lse[i] = kNegInf;
        continue;
      }
      for (int c = 0; c < D; ++c) o[c] = static_cast<float>(dv * st.A[c] / st.l + v_bias[c]);
      // m is in code units (8 * log2 of the numerator); l is scaled by 2^8 (code 120 = 256).
      lse[i] = static_cast<float>(std::log(2.0) * (static_cast<double>(st.m) / 8.0) + std::log(st.l / 256.0));
    }
  }
  return rescales;
}

}  // namespace

Status prepare_inputs(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                      const Sequences& k_seqs, PreparedInputs* out) {
  return prepare_inputs(q, k, v, q_seqs, k_seqs, PrepareOptions{}, out);
}

Status prepare_inputs(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                      const Sequences& k_seqs, const PrepareOptions& opt, PreparedInputs* out) {
  OPENVC_RETURN_IF_ERROR(internal::check_sequence_pair(q_seqs, k_seqs));
  if (opt.qk_format != QkFormat::kE4M3 && opt.qk_format != QkFormat::kInt8) {
    return Status::Invalid("opt.qk_format: expected QkFormat::kE4M3 or QkFormat::kInt8, got " +
                           std::to_string(static_cast<int>(opt.qk_format)));
  }
  if (out == nullptr) return Status::Invalid("out must not be null");
  if (q == nullptr && q_seqs.total_tokens() > 0) return Status::Invalid("q must not be null");
  if (k == nullptr && k_seqs.total_tokens() > 0) return Status::Invalid("k must not be null");
  if (v == nullptr && k_seqs.total_tokens() > 0) return Status::Invalid("v must not be null");
  out->q_seqs = q_seqs;
  out->k_seqs = k_seqs;
  out->repair = nullptr;
  out->qk_format = opt.qk_format;
  out->q = out->k = BlockQuantized{};
  out->q8 = out->k8 = Int8Quantized{};
  if (opt.qk_format == QkFormat::kInt8) {
    OPENVC_RETURN_IF_ERROR(quantize_int8_rows(q, q_seqs, &out->q8));
    OPENVC_RETURN_IF_ERROR(quantize_int8_blocks(k, k_seqs, opt.k_smoothing, &out->k8));
  } else {
    OPENVC_RETURN_IF_ERROR(quantize_blocks(q, q_seqs, &out->q));
    OPENVC_RETURN_IF_ERROR(quantize_key_blocks(k, k_seqs, opt.k_smoothing, &out->k));
  }
  OPENVC_RETURN_IF_ERROR(quantize_heads(v, k_seqs, &out->v));
  return Status::Ok();
}

Status attention_expcast(const PreparedInputs& in, const AttentionOptions& opt, AttentionResult* res) {
  if (res == nullptr) return Status::Invalid("res must not be null");
  OPENVC_RETURN_IF_ERROR(check_options(opt));
  OPENVC_RETURN_IF_ERROR(check_prepared(in));
  const int nseq = in.q_seqs.count(), H = in.q_seqs.num_heads, D = in.q_seqs.head_dim;
  const float tau = internal::resolve_softmax_scale(opt.softmax_scale, D);
  if (opt.v_block_descale != nullptr && in.repair != nullptr)
    return Status::Unsupported("opt.v_block_descale: V block descales do not combine with repair rows");
  if (opt.v_bias_correction) {
    if (in.repair != nullptr || opt.v_block_descale != nullptr)
      return Status::Unsupported("opt.v_bias_correction: not with repair rows or V block descales");
    if (in.v.bias.size() != static_cast<size_t>(nseq) * H * D)
      return Status::Invalid("opt.v_bias_correction: in.v.bias must hold nseq * H * D values (quantize_heads)");
  }
  if (opt.key_blocks != nullptr) {
    const KeyBlockLists& kb = *opt.key_blocks;
    const int64_t q_tiles = (in.q_seqs.max_length() + kQuantBlock - 1) / kQuantBlock;
    if ((kb.batch != 1 && kb.batch != nseq) || (kb.heads != 1 && kb.heads != H) || kb.q_tiles < q_tiles)
      return Status::Invalid("opt.key_blocks: batch must be 1 or " + std::to_string(nseq) + ", heads 1 or " +
                             std::to_string(H) + ", q_tiles >= " + std::to_string(q_tiles));
    if (in.repair != nullptr) return Status::Unsupported("opt.key_blocks: key block lists do not take repair rows");
  }
  if (opt.split_ctas > 0) {   // the plan numbers tiles as a batch of equal sequences does
    if (in.repair != nullptr) return Status::Unsupported("opt.split_ctas: split tiles do not take repair rows");
    for (int s = 1; s < nseq; ++s)
      if (in.q_seqs.length(s) != in.q_seqs.length(0) || in.k_seqs.length(s) != in.k_seqs.length(0))
        return Status::Unsupported("opt.split_ctas: split tiles take batched calls (every sequence the same "
                                   "query and key lengths)");
  }
  res->out.assign(static_cast<size_t>(in.q_seqs.total_tokens()) * H * D, 0.0f);
  // Rows past a shorter sequence's end have no softmax: -inf like an empty log-sum-exp.
  res->lse.assign(static_cast<size_t>(nseq) * H * in.q_seqs.max_length(), kNegInf);
  res->rescales = 0;

  // (sequence, head) groups are independent and write disjoint outputs.
  std::vector<int64_t> rescales(static_cast<size_t>(nseq) * H, 0);
  internal::parallel_for(nseq * H, [&](int g) { rescales[g] = run_group(in, opt, g / H, g % H, tau, res); });
  for (int64_t r : rescales) res->rescales += r;
  return Status::Ok();
}

}  // namespace openvc::reference
