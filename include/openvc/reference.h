// CPU reference of the openvc numerics contract (docs/numerics.md). Plain C++, host memory only.
// It is the oracle of every GPU test, so it favours clarity over speed.
//
// Token tensors are host arrays of float holding FP16/BF16 values exactly (both convert to FP32
// without rounding), laid out [total_tokens, H, D] with sequences packed back to back; a batch
// [B, S, H, D] is the packed case with cu_seqlens = {0, S, 2S, ..., B*S}. Every quantization group
// lies inside one sequence.
#pragma once
#include <cstdint>
#include <vector>

#include "openvc/status.h"

namespace openvc::reference {

inline constexpr int kQuantBlock = 128;   // tokens per Q/K scale group
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kCodeBias = 119.65f;     // 8*8 + 56 + beta, beta = -0.35
inline constexpr uint8_t kMaxCode = 120;        // 0x78 = 256.0 = 2^8 * exp(0)
inline constexpr float kHugeRowMax = 8388608.0f;  // 2^23 code units: rows at or past it get one ulp of slack

// ---- E4M3 (FN variant: no infinities, 0x7F/0xFF are NaN, max finite 448) -------------------------
uint8_t e4m3_encode(float x);  // round to nearest even, saturate to +-448, NaN -> 0x7F
float e4m3_decode(uint8_t code);  // subnormals decode as mantissa * 2^-9

// ---- Sequences ----------------------------------------------------------------------------------
struct Sequences {
  std::vector<int> cu_seqlens;  // nseq + 1 offsets into the token dimension, cu_seqlens[0] == 0
  int num_heads = 0;
  int head_dim = 0;
  int count() const { return static_cast<int>(cu_seqlens.size()) - 1; }
  int length(int s) const { return cu_seqlens[s + 1] - cu_seqlens[s]; }
  int total_tokens() const { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
  int max_length() const;
  int max_blocks() const { return (max_length() + kQuantBlock - 1) / kQuantBlock; }
  static Sequences Batched(int batch, int seqlen, int num_heads, int head_dim);
  Status validate(const char* name) const;  // offsets non-decreasing, heads and head_dim > 0
};

// ---- Section 1: quantization --------------------------------------------------------------------
// Q or K: one group per (sequence, head, 128-token block). descale[(s * H + h) * max_blocks + blk],
// 0 for all-zero groups and for blocks past a shorter sequence's end.
struct BlockQuantized {
  std::vector<uint8_t> codes;   // [total_tokens, H, D]
  std::vector<float> descale;   // [nseq, H, max_blocks]
  int max_blocks = 0;
  std::vector<float> mean;      // K with smoothing (quantize_key_blocks): [nseq, H, D] channel means; else empty
};
// V: one group per (sequence, head) over all its tokens.
struct HeadQuantized {
  std::vector<uint8_t> codes;     // [total_tokens, H, D]
  std::vector<float> descale;     // [nseq, H] = amax / 448
  std::vector<float> scale_inv;   // [nseq, H] = 448 / amax, 0 for an all-zero group
  // [nseq, H, D] the rounding residuals' fixed-point sums (numerics section 4, "V rounding bias"): per channel c,
  // sum over the sequence's tokens j of v_residual_fixed(x_jc, code_jc), x_jc = fl(v_jc * scale_inv).
  std::vector<int64_t> residual_sums;
  // [nseq, H, D] the bias: (float)((double)descale * (double)residual_sums * 2^-16 / (double)tokens), 0 for an empty
  // sequence (prepare_fp8's PrepareParams::v_bias, bit for bit).
  std::vector<float> bias;
};
// One V element's rounding residual in units of 2^-16 (scaled domain): rne(2^16 * (x - decode(code))), the
// residual exact in FP32; 0 where it is not finite or |residual| > 16 (NaN input). |result| <= 2^20.
int64_t v_residual_fixed(float x, uint8_t code);
inline constexpr double kVResidualUnit = 1.0 / 65536.0;   // 2^-16: the fixed point of residual_sums
Status quantize_blocks(const float* x, const Sequences& seqs, BlockQuantized* out);
Status quantize_heads(const float* x, const Sequences& seqs, HeadQuantized* out);

// ---- K smoothing (sections 1 and 9, either Q/K format) ---------------------------------------------
// Channel means of K per (sequence, head, channel c), mean[(s * H + h) * D + c], over the sequence's
// valid keys (key_counts: optional, one per sequence, clamped to [0, length]; keys at or past it are
// padding), in this exact order (the GPU's k_block_sums and k_mean kernels reproduce it bit for bit):
//   blocksum_{b,c} = sum of (double)k_jc over the valid keys of 128-key block b, in token order;
//   mean_c = (float)(sum over blocks b in block order of blocksum_{b,c}, in double) / (float)count
// (one rounding of the double sum to FP32, then one FP32 division; 0 when count = 0).
Status k_smoothing_means(const float* x, const Sequences& seqs, const int* key_counts, std::vector<float>* mean);
// E4M3 K per (sequence, head, 128-key block), with optional smoothing: k'_jc = fl(k_jc - mean_c) (one FP32
// subtraction) is quantized instead of k (out->mean holds the means). key_counts (optional, clamped to
// [0, length]): keys at or past the count are padding, left out of the means and maxima, coded 0; blocks
// with no valid key get descale 0. smoothing = false and no counts is quantize_blocks.
Status quantize_key_blocks(const float* x, const Sequences& seqs, bool smoothing, BlockQuantized* out,
                           const int* key_counts = nullptr);

// ---- Section 9: INT8 Q/K mode ----------------------------------------------------------------------
// Q/K score format. kE4M3 is sections 1-2; kInt8 is section 9 (V, P and the softmax are unchanged).
enum class QkFormat { kE4M3, kInt8 };
inline constexpr float kInt8Max = 127.0f;
// K key groups per 128-key block (section 9): key j of a sequence (c = j mod 128) is in group
// ((c mod 8) / 2) + 4 * (c / 64), the keys that one thread of a wgmma row quad holds (columns 8m + 2t,
// 8m + 2t + 1 of the 128-key tile: group t for m < 8, t + 4 for m >= 8). 16 keys per full group.
inline constexpr int kInt8KeyGroups = 8;
inline int int8_key_group(int64_t j) {
  const int c = static_cast<int>(j % kQuantBlock);
  return (c % 8) / 2 + 4 * (c / 64);
}
int8_t int8_encode(float x);  // clamp(rne(x), -127, 127) (rne: ties to even), NaN -> 0, -0 -> 0
// Symmetric INT8 groups: scale_inv = amax > 0 ? 127 / amax : 0, descale = amax / 127 (both 0 where
// 127 / amax is not finite), code = clamp(rne(fl(x * scale_inv)), -127, 127), NaN -> 0.
struct Int8Quantized {
  std::vector<int8_t> codes;   // [total_tokens, H, D], each in [-127, 127]; padding tokens 0
  // Q: [nseq, H, max_length] (row i of sequence s, head h at (s * H + h) * max_length + i).
  // K: [nseq, H, max_blocks, kInt8KeyGroups] (key j at ((s * H + h) * max_blocks + j / 128) * 8 +
  //    int8_key_group(j)). 0 for all-zero or tiny groups, groups without a valid key (past a sequence's
  //    end or its key count).
  std::vector<float> descale;
  int groups = 0;              // descales per (sequence, head): max_length() (Q) or max_blocks() * 8 (K)
  int group_tokens = 0;        // 1 (Q: one group per row) or kQuantBlock (K: per 128-key block, 8 key groups)
  std::vector<float> mean;     // K with smoothing: [nseq, H, D] channel means subtracted; else empty
};
// Index of key j's descale within its (sequence, head)'s K descales.
inline int64_t int8_key_descale_index(int64_t j) {
  return j / kQuantBlock * kInt8KeyGroups + int8_key_group(j);
}
// Q: one group per (sequence, head, token row) over its D channels (packed or batched sequences).
Status quantize_int8_rows(const float* x, const Sequences& seqs, Int8Quantized* out);
// K: one group per (sequence, head, 128-key block, key group); a final partial block's groups hold their
// valid keys. smoothing: k' = fl(k - mean_c) with k_smoothing_means' means is quantized instead.
// key_counts (optional, one per sequence, clamped to [0, length]): keys at or past the count are
// padding, left out of the means and maxima, coded 0.
Status quantize_int8_blocks(const float* x, const Sequences& seqs, bool smoothing, Int8Quantized* out,
                            const int* key_counts = nullptr);

// ---- Section 3: ExpCast codes -------------------------------------------------------------------
// Multiplier of one (query block, key block) pair, in the kernel's operation order:
//   a = ((8 * log2e) * softmax_scale) * descale_q) * descale_k      (FP32 products, left to right)
float expcast_multiplier(float softmax_scale, float descale_q, float descale_k);
// The byte the kernel writes for accumulator `acc` with multiplier `a` while the row's running max
// in code units (max over visited keys of fl(acc * a)) is `row_max`:
//   x = fmaf(acc, a, 119.65f - row_max);  code = clamp(rne(x), 0, 120)   (rne: ties to even)
// (|row_max| >= 2^23: the addend is (119.65f - row_max) + ulp(row_max), numerics section 3.)
// A NaN or -inf x gives code 0 (the kernel's relu conversion does the same).
uint8_t expcast_code(float acc, float a, float row_max);

// ---- P format (numerics "P format") ---------------------------------------------------------------
// kExpCast: expcast_code above (the default). kExp2: the E4M3 rounding of the exponential, exact for keys 0-63
// of each 128-key block and a polynomial code within one step of it for keys 64-127 (below):
//   exp2_code: x = fmaf(acc, a * 0.125f, 8.0f - row_max * 0.125f);  code = e4m3_encode((float)exp2((double)x))
// (a/8 and row_max/8 exact; 8 - row_max/8 one FP32 rounding; e4m3_encode saturates to 448: huge x and
// +inf give 0x7E, -inf gives 0, NaN gives 0x7F). At the row max x = 8 (p = 256 = 0x78, as ExpCast's
// code 120), so l, rescale and LSE are unchanged. The GPU kernel runs kExp2 with INT8 Q/K only and
// evaluates 2^x with ex2.approx (at most one code apart near an E4M3 rounding boundary).
// exp2 codes keys 0-63 of every 128-key block with exp2_code and keys 64-127 with exp2_poly_code, a polynomial
// that the kernel evaluates on the FMA pipe while the MUFU unit takes the other half (exp2_format_code):
//   x = min(fmaf(acc, a, 120 - row_max), 120)   (NaN stays NaN; the position in ExpCast's code units)
//   then, each step rounded to f16 (round half to even; the first step saturating to +-65504):
//   h = f16(x); t = (h + 12288) - 12288 (the nearest multiple of 8); d = |h - t|;
//   u = d * k/8 - k (one rounding); w = relu(u * d + h) (one rounding); code = (w + 1024) - 1024
//   with k/8 = kPolyK8, -k = kPolyNegK (f16 values); NaN gives 0xFF. It equals the E4M3 rounding of
//   2^((x - 120) / 8) * 256 for about 97% of x in the normal codes and is one step away otherwise.
enum class PFormat { kExpCast, kExp2 };
uint8_t exp2_code(float acc, float a, float row_max);
inline constexpr int kExp2PolyFirstKey = 64;        // keys at or past it, within their 128-key block
inline constexpr double kPolyOctave = 12288.0;      // f16 spacing 8: rounds to the nearest octave edge
inline constexpr double kPolyK8 = 0x1.5f4p-5;       // f16 0x297D, 0.0428772
inline constexpr double kPolyNegK = -0x1.5f4p-2;    // f16 0xB57D, -0.343018
uint8_t exp2_poly_code(float acc, float a, float row_max);
uint8_t exp2_format_code(float acc, float a, float row_max, int key_in_block);

// ---- Section 5: traversal -----------------------------------------------------------------------
inline constexpr int kNaturalOrder = -1;  // mid_window_blocks value meaning "visit 0..n-1"
// Key blocks in visiting order for a query tile whose diagonal block is `diag` among `n` blocks.
std::vector<int> key_block_order(int diag, int n, int mid_window_blocks);
// diag = floor(r0 * Sk / Sq / key_tile) in 64-bit integer arithmetic.
int diagonal_block(int64_t first_query_row, int64_t sq, int64_t sk, int key_tile);
// Causal (aligned to the end): the number of key blocks that the last row of a query tile sees,
// clamp(floor((last_query_row + Sk - Sq) / key_tile) + 1, 0, ceil(Sk / key_tile)). The causal order
// visits those blocks from the diagonal down: key_block_order(nv - 1, nv, w) = nv-1, ..., 0 for any
// w >= 0, 0..nv-1 for natural order; the blocks after them are invisible to every row of the tile.
int causal_visible_blocks(int64_t last_query_row, int64_t sq, int64_t sk, int key_tile, int causal_chunk = 1);
// Chunked causal (causal_chunk = F >= 1; F = 1 is plain causal): query row i sees the keys
// [0, causal_key_limit), (floor((i + Sk - Sq) / F) + 1) * F clamped to [0, Sk]: its own chunk of F keys
// and every chunk before it (aligned to the end when Sq != Sk). causal_visible_blocks takes the same F.
int64_t causal_key_limit(int64_t row, int64_t sq, int64_t sk, int causal_chunk);

// Key block lists (section 5, "Key block lists"; the kernel's KeyBlockList, in host memory): query tile qt
// of (sequence s, head h) visits the blocks indices[row * capacity + i], i < clamp(num_blocks[row], 0,
// capacity), row = (s' * heads + h') * q_tiles + qt (s' = 0 when batch is 1, else s; h' likewise), each
// clamped to [0, ceil(Sk/128)), in the order of list positions p0, p0-1, ..., 0, p0+1, ..., n-1 with
// p0 = min(diag - first + w, n - 1), first the clamped first listed block (natural order when w < 0 or
// p0 < 0). query_tile must be 128; not with causal or repair rows.
struct KeyBlockLists {
  const int* num_blocks = nullptr;   // [batch, heads, q_tiles]
  const int* indices = nullptr;      // [batch, heads, q_tiles, capacity]
  int batch = 1, heads = 1, q_tiles = 0, capacity = 0;
};
// The blocks of one tile in visiting order (the rule above; diag = diagonal_block of the tile, n_blocks =
// ceil(Sk/128)).
std::vector<int> listed_block_order(const int* row, int count, int capacity, int diag, int n_blocks,
                                    int mid_window_blocks);

// ---- Sections 2-6: attention ----------------------------------------------------------------------
struct AttentionOptions {
  float softmax_scale = 0.0f;   // <= 0 means 1/sqrt(D)
  int query_tile = 128;         // rows sharing one traversal order (the kernel's CTA query tile)
  int key_tile = 128;           // must equal kQuantBlock in this version
  int mid_window_blocks = 4;    // kNaturalOrder for natural order
  bool causal = false;          // key j > query i (aligned to the end when Sq != Sk) is masked
  // P format of every code (original and repair keys): expcast_code or exp2_code (section "P format");
  // either Q/K format (the GPU kernel takes kExp2 with INT8 only). Last, so that positional
  // initializers of the fields above stay valid.
  PFormat p_format = PFormat::kExpCast;
  const KeyBlockLists* key_blocks = nullptr;   // optional block-sparse lists (above); last, as above
  int causal_chunk = 1;         // with causal: chunked causal (causal_key_limit); last, as above
  // Optional V descale per key block ([nseq, H, max_blocks of in.k], the kernel's v_descale_per_block):
  // key j of (s, h) weighs decode(V8_j) * v_block_descale[(s * H + h) * max_blocks + j / 128] and the output
  // takes no head descale (numerics section 4). Not with repair rows. Last, as above.
  const float* v_block_descale = nullptr;
  // Split tiles (numerics section 5, "Split tiles"; the kernel's kSplitTilesMode): > 0 deals the key blocks of
  // the last query tiles ((sequence, head, query tile) order; split_cuts says which) to this many CTAs in
  // contiguous ranges, and computes a tile cut by a range boundary in parts (each with its own running max from
  // -inf), combined at the end. Batched calls (every sequence the same lengths), not causal, without key block lists,
  // repair rows or V block descales; query_tile 128. 0: no split. Last, as above.
  int split_ctas = 0;
  // V rounding bias correction (numerics section 4, "V rounding bias"): every output row that sees a key adds
  // in.v.bias[c] to channel c. Not with repair rows or V block descales. Last, as above.
  bool v_bias_correction = false;
};
// Order positions at which split_ctas CTA ranges cut tile `tile` of `n` key blocks (ascending, each in (0, n);
// numerics section 5, "Split tiles"): the first head = tiles - (ctas + tiles mod ctas) tiles (0 when tiles < 2
// ctas) are whole; the others' (tile, position) pairs are units numbered (tile - head) * n + position, and CTA c
// takes units [c q + min(c, r), (c + 1) q + min(c + 1, r)) with q = units / ctas, r = units % ctas.
std::vector<int> split_cuts(int64_t tile, int n, int64_t tiles, int64_t ctas);

// Repair rows of section 6, per (sequence, head): the selected token indices (largest residual
// energy first, ties by lower index) and their E4M3 residual codes with the V scale.
struct VRepair {
  int tokens_per_head = 0;          // per sequence: round(budget * length); stored per (seq, head)
  std::vector<int> count;           // [nseq, H] rows selected (<= tokens_per_head of that sequence)
  std::vector<int> offset;          // [nseq, H] start of this group's rows in tokens/codes
  std::vector<int> tokens;          // concatenated token indices (relative to the sequence start)
  std::vector<uint8_t> codes;       // concatenated [rows, D] residual codes
};
// budget in [0, 1): anything else (negative, >= 1, NaN, inf) is an InvalidArgument naming `budget`.
Status select_v_repair(const float* v, const Sequences& seqs, const HeadQuantized& vq, double budget,
                       VRepair* out);

struct PreparedInputs {
  Sequences q_seqs, k_seqs;     // same count and head configuration
  QkFormat qk_format = QkFormat::kE4M3;
  BlockQuantized q, k;          // qk_format == kE4M3 (left empty for kInt8)
  Int8Quantized q8, k8;         // qk_format == kInt8: per-row Q, per-(block, key group) K (section 9)
  HeadQuantized v;
  const VRepair* repair = nullptr;   // optional, visited after every original block
};

struct PrepareOptions {
  QkFormat qk_format = QkFormat::kE4M3;
  bool k_smoothing = false;     // K smoothing (k_smoothing_means), either format
};

struct AttentionResult {
  std::vector<float> out;   // [total_q, H, D], FP32 before the final BF16 rounding
  std::vector<float> lse;   // [nseq, H, max_q_len] natural log (only rows < that sequence's length)
  // Statistics that tests use to check traversal and rescale behaviour.
  int64_t rescales = 0;     // number of (row, tile) pairs where the running max grew after the first
};

Status prepare_inputs(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                      const Sequences& k_seqs, PreparedInputs* out);   // E4M3 Q/K (PrepareOptions{})
Status prepare_inputs(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                      const Sequences& k_seqs, const PrepareOptions& opt, PreparedInputs* out);
// attention_expcast runs sections 2-6 on either format: with kInt8 the scores are the exact integer
// dot products of the INT8 codes and the multiplier of (row i, key j) is
// expcast_multiplier(tau, q8.descale[row i], k8.descale[int8_key_descale_index(j)]) (one per key group
// of a block); everything else is shared.
Status attention_expcast(const PreparedInputs& in, const AttentionOptions& opt, AttentionResult* res);

// Exact softmax attention in FP64 on the original (unquantized) inputs, output [total_q, H, D].
Status attention_exact(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                       const Sequences& k_seqs, float softmax_scale, bool causal,
                       std::vector<double>* out, std::vector<double>* lse = nullptr, int causal_chunk = 1);

// ---- Section 7: VC-Attention baseline (V-Smooth + ExpCast, natural order) -----------------------
inline constexpr int kVcClusters = 64;
inline constexpr int kVcIterations = 4;
// permutation[(s * H + h) * max_len + i] = original token index of position i of that group.
Status vc_grouping(const float* v, const Sequences& seqs, std::vector<int>* permutation);
Status attention_vc(const float* q, const float* k, const float* v, const Sequences& q_seqs,
                    const Sequences& k_seqs, const std::vector<int>& permutation,
                    const AttentionOptions& opt, AttentionResult* res);
// The V-Smooth preparation that attention_vc attends (and openvc::vc_prepare writes on the GPU), for a
// permutation laid out as vc_grouping's. Per 128-row block b of the permuted V of a (sequence, head):
// mu_b = round_to_bf16(float(double sequential sum of the block's valid rows / rows)); residual
// r = v - mu_b in FP32; per channel over the whole group amax = max |r| (NaN ignored),
// scale_inv = amax > 0 ? 448 / amax : 0, code = e4m3_encode(r * scale_inv).
struct VcPrepared {
  BlockQuantized q;                      // Q per 128-token block, original order
  BlockQuantized k;                      // the permuted K per 128-token block (rows in permuted order)
  std::vector<uint8_t> v_codes;          // [total_k, H, D] residual codes of the permuted V, token-major
  std::vector<float> channel_descale;    // [nseq, H, D] amax / 448; 1 where amax is 0 (its codes are 0)
  std::vector<float> channel_scale_inv;  // [nseq, H, D] 448 / amax; 0 where amax is 0
  std::vector<float> block_mean;         // [nseq, H, k.max_blocks, D] BF16 values; 0 past a sequence's end
};
Status vc_prepare(const float* q, const float* k, const float* v, const Sequences& q_seqs, const Sequences& k_seqs,
                  const std::vector<int>& permutation, VcPrepared* out);

// ---- Section 8: error metrics ---------------------------------------------------------------------
struct ErrorMetrics {
  double rel_l2 = 0, max_abs = 0, rmse = 0, cosine = 0;
};
ErrorMetrics compare(const float* out, const double* ref, int64_t n);
float round_to_bf16(float x);   // round to nearest even, NaN preserved

}  // namespace openvc::reference
