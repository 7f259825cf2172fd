// Public GPU API of openvc: plain parameter structs over caller-owned device memory, one function per
// step, each enqueued on the caller's stream with no host synchronization and no allocation, so a
// sequence of calls can be captured in a CUDA graph. Numerics: docs/numerics.md.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "openvc/status.h"

namespace openvc {

enum class DType { kFloat16, kBFloat16 };
// Q/K code format: E4M3 (numerics sections 1-2, the default) or INT8 (section 9: one Q descale per query
// row, kInt8KeyGroups K descales per 128-key block, exact integer scores). INT8 takes every fast-path call
// form (batched, causal, packed cu_seqlens, seqused_k, head dim 64 and 128); not repair rows or VC mode.
enum class QkFormat { kE4M3, kInt8 };
// INT8 K key groups per 128-key block (numerics section 9): key j (c = j mod 128) is in group
// ((c mod 8) / 2) + 4 * (c / 64), the keys one thread of a wgmma row quad holds.
inline constexpr int kInt8KeyGroups = 8;
// P format (numerics "P format"): ExpCast's linear codes (section 3, the default) or exp2, the E4M3
// rounding (satfinite) of the exponential, p = e4m3(2^(acc * a/8 + 8 - M/8)) (ex2.approx on the device) for
// keys 0-63 of each 128-key block, a polynomial code within one step of it (97% equal) for keys 64-127.
// kExp2 takes INT8 Q/K only (every fast call form); E4M3 Q/K, repair rows and VC mode: Unsupported.
enum class PFormat { kExpCast, kExp2 };

inline constexpr int kQuantBlock = 128;      // tokens per Q/K descale group, and the key tile
inline constexpr int kHeadDim = 128;         // default head dim (the sm_90a fast path takes 128 and 64)
inline constexpr int kNaturalOrder = -1;     // mid_window_blocks value for natural key order

// Keys inside each 16-key group of the packed V are stored in this order: packed column kappa holds
// key kPackedKeyOrder[kappa]. It puts the QK^T accumulator fragment straight into the PV A-operand
// register order (docs/architecture.md), so the kernel needs no register shuffles.
inline constexpr int kPackedKeyOrder[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};

// A [B, S, H, D] device tensor; strides in elements, the head dim is contiguous.
struct TokenTensorView {
  const void* data = nullptr;
  int64_t stride_batch = 0, stride_seq = 0, stride_head = 0;
};

// Section 1 layout of prepared FP8 inputs (all device pointers, caller-owned, contiguous).
struct Fp8Inputs {
  int batch = 0, seqlen_q = 0, seqlen_k = 0, heads = 0, head_dim = kHeadDim;
  const uint8_t* q_codes = nullptr;   // [B, Sq, H, D] E4M3 (kInt8: INT8 bytes)
  const float* q_descale = nullptr;   // [B, H, ceil(Sq/128)] (kInt8: [B, H, Sq], one per row)
  const uint8_t* k_codes = nullptr;   // [B, Sk, H, D] E4M3 (kInt8: INT8 bytes)
  const float* k_descale = nullptr;   // [B, H, ceil(Sk/128)] (kInt8: [B, H, ceil(Sk/128), kInt8KeyGroups])
  const uint8_t* v_packed = nullptr;  // [B, H, D, packed_seqlen_k(Sk)] E4M3, keys per kPackedKeyOrder
  const float* v_descale = nullptr;   // [B, H]
  // Last, so that positional initializers of the fields above stay valid. Must be the PrepareParams::qk_format
  // the arrays were prepared with: the descale arrays have that format's sizes, and the kernel cannot check
  // them (a mismatch reads past q_descale / k_descale).
  QkFormat qk_format = QkFormat::kE4M3;
  // Grouped-query attention (GQA, MQA): the head count of K and V, 0 meaning `heads`. heads must be a multiple
  // of it; query head h attends K/V head h / (heads / kv_heads). k_codes, k_descale, v_packed and v_descale
  // then hold kv_heads heads where the layouts above say H ([B, Sk, kv_heads, D], [B, kv_heads, ...]; packed
  // likewise; V block descales [B, kv_heads, blocks]), as prepare_fp8 with the same kv_heads writes them: the
  // result is attention on K and V with each head repeated heads / kv_heads times, bit for bit. Not with repair
  // rows or the VC mode (Status::Unsupported naming in.kv_heads). Last, so that positional initializers stay valid.
  int kv_heads = 0;
  // V rounding bias correction (numerics section 4, "V rounding bias"; optional): PrepareParams::v_bias as prepare_fp8
  // wrote it ([B, Hk, D] FP32, 8-byte aligned): every output row that sees a key adds v_bias[c] to channel c, the mean
  // rounding error of V over the sequence's keys. Exact for attention spread evenly over them; it removes the part of
  // V's rounding error that such attention averages to a bias. Built for qk_format kInt8 (ExpCast or exp2 P; the kernel's
  // kVBiasMode); not with E4M3 Q/K, key block lists, repair rows, the VC mode or V block descales (Status::Unsupported
  // naming in.v_bias). Null: none. Last, as above.
  const float* v_bias = nullptr;
};
// The K/V head count of a call: kv_heads, or heads where kv_heads is 0.
inline int kv_heads_or(int heads, int kv_heads) { return kv_heads > 0 ? kv_heads : heads; }
inline int64_t packed_seqlen_k(int64_t sk) { return (sk + kQuantBlock - 1) / kQuantBlock * kQuantBlock; }
inline int64_t num_quant_blocks(int64_t s) { return (s + kQuantBlock - 1) / kQuantBlock; }

// ---- Preparation: BF16/FP16 [B,S,H,D] or packed [total,H,D] sequences -> Fp8Inputs --------------
// Two input modes, each sequence quantized separately (no Q/K block and no V group spans two):
// - Batched (cu_seqlens_q and cu_seqlens_k null, the default): q, k, v are the strided [B, S, H, D]
//   views above; batch, seqlen_q, seqlen_k give the sizes; outputs as in Fp8Inputs. num_seqs and
//   max_seqlen_q/k must stay 0.
// - Packed variable-length sequences (cu_seqlens_q and cu_seqlens_k both set): q is [total_q, H, D]
//   and k, v are [total_k, H, D] (stride_seq and stride_head used, stride_batch ignored); sequence s
//   holds tokens [cu[s], cu[s+1]). batch, seqlen_q and seqlen_k are ignored. The cu_seqlens arrays are
//   device memory, read by the kernels only (never on the host), so their contents may change between
//   replays of a captured graph. The grid comes from num_seqs and max_seqlen_q/k, which must be >= every
//   sequence's length (an upper bound is fine; tokens past ceil(max_seqlen/128)*128 of a longer
//   sequence would be left unwritten, but nothing is written out of bounds); CTAs past a sequence's end
//   only write zero descales / padding. Outputs, with nq = ceil(max_seqlen_q/128), nk = ceil(max_seqlen_k/128):
//     q_codes [total_q, H, D], q_descale [num_seqs, H, nq] (kInt8: [num_seqs, H, max_seqlen_q], one per
//     row, 0 past a sequence's end), k_codes [total_k, H, D], k_descale [num_seqs, H, nk] (kInt8:
//     [num_seqs, H, nk, kInt8KeyGroups]; blocks and key groups past a sequence's end get descale 0),
//     v_packed [num_seqs, H, D, nk*128] (each sequence's keys start at column 0 of its own slab, in
//     kPackedKeyOrder inside each 16-key group, zero padding), v_descale [num_seqs, H].
//   cu = {0, S, 2S, ..., B*S} with max_seqlen = S gives exactly the batched outputs.
// attention_fp8 attends both forms (AttentionParams below).
struct PrepareParams {
  DType dtype = DType::kBFloat16;     // of q, k and v alike
  // kInt8 (every input form, head_dim 64 and 128, with or without seqused_k): INT8 Q codes with one
  // descale per row and INT8 K codes with kInt8KeyGroups descales per 128-key block (numerics section 9);
  // V as for E4M3.
  QkFormat qk_format = QkFormat::kE4M3;
  int batch = 0, seqlen_q = 0, seqlen_k = 0, heads = 0, head_dim = kHeadDim;
  TokenTensorView q, k, v;
  // Packed sequences (optional, see above): int32 device arrays of num_seqs + 1 offsets, cu[0] = 0,
  // non-decreasing, 4-byte aligned.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int max_seqlen_q = 0, max_seqlen_k = 0;  // host values, > 0 when packed
  int num_seqs = 0;                        // > 0 when packed
  // Packed: token rows of q and of k/v (the tensors' first dimension). Required with cu_seqlens: the
  // kernels clamp every offset to [0, total], so no offset makes them read or write out of bounds.
  int64_t total_q = -1, total_k = -1;
  // Optional per-sequence key counts (device int32, one per batch entry or sequence): keys at or past
  // seqused_k[s] are padding, excluded from the K block and V maxima; their K codes are left unwritten
  // (attention never reads them) and their packed V columns are 0 (key padding masks).
  const int* seqused_k = nullptr;
  // Outputs (sizes as in Fp8Inputs, or as above for packed sequences).
  uint8_t* q_codes = nullptr;
  float* q_descale = nullptr;
  uint8_t* k_codes = nullptr;
  float* k_descale = nullptr;
  uint8_t* v_packed = nullptr;
  float* v_descale = nullptr;
  void* workspace = nullptr;          // prepare_workspace_bytes() bytes, 4-byte aligned (16 with k_smoothing)
  size_t workspace_bytes = 0;
  // K smoothing (numerics sections 1 and 9, either qk_format): per (sequence, head, channel) the mean of
  // the valid keys (key counts respected; double block sums in token order, summed in block order, one
  // rounding to FP32, one FP32 division) is subtracted from K (one FP32 subtraction) before its
  // quantization. Needs the larger workspace (prepare_workspace_bytes(..., true)). Last, so that
  // positional initializers of the fields above stay valid.
  bool k_smoothing = false;
  // With k_smoothing: optional FP32 output (4-byte aligned) in the LSE's layout, [B, H, seqlen_q] batched or
  // [H, total_q] packed: q_i . mean(K) per query row (FP32, from the BF16/FP16 q and the smoothing means of
  // its sequence and head; rows no packed sequence covers are not written). Smoothing shifts row i's scores
  // by -softmax_scale * q_i . mean(K), which softmax ignores but the LSE does not: the LSE of attention on
  // the smoothed codes plus softmax_scale times this is the LSE of the keys as given (numerics section 9;
  // openvc::attention in call.h adds it). Must be null without k_smoothing.
  float* q_dot_k_mean = nullptr;
  // A KV cache's preparation (open_vc_attn.kv_cache: a chunk's keys prepared straight into the cache).
  // Batched calls without k_smoothing only; 0 / false keep the default (any field set runs the preparation's
  // KV-cache kernels). Output layout, with k_codes, k_descale, v_packed and v_descale pointing at the chunk's
  // first slot (a 128-key block boundary):
  // k_codes_rows: token rows per batch entry of k_codes ([B, k_codes_rows, H, D], >= seqlen_k).
  // k_descale_blocks: 128-key blocks per (batch, head) row of k_descale ([B, H, k_descale_blocks] or INT8's
  // [B, H, k_descale_blocks, 8]; >= ceil(seqlen_k / 128)) and, with v_descale_per_block, of v_descale.
  // v_packed_columns: columns per (batch, head, channel) row of v_packed ([B, H, D, v_packed_columns],
  // >= packed_seqlen_k(seqlen_k), a multiple of 16). v_descale_per_block: v_descale is [B, H, blocks] with
  // the head's V descale written at each of the call's ceil(seqlen_k / 128) blocks
  // (AttentionParams::v_descale_per_block's layout), instead of [B, H].
  // K and V in two parts: keys [0, kv_prefix_len) of every batch entry are k_prefix / v_prefix's
  // ([B, kv_prefix_len, H, D] views, the rules of k and v), keys [kv_prefix_len, seqlen_k) are k / v's first
  // seqlen_k - kv_prefix_len tokens (a cache's BF16 remainder and the new chunk, without concatenating them).
  int64_t k_codes_rows = 0;
  int k_descale_blocks = 0;
  int64_t v_packed_columns = 0;
  bool v_descale_per_block = false;
  int kv_prefix_len = 0;
  TokenTensorView k_prefix, v_prefix;
  // Grouped-query attention (Fp8Inputs::kv_heads): k and v hold kv_heads heads (0: heads; heads a multiple of
  // it), q holds heads. K and V are prepared per K/V head (codes, descales, V scales and, with k_smoothing, the
  // channel means of each K/V head), Q per query head; q_dot_k_mean of query head h uses the means of K/V head
  // h / (heads / kv_heads). The workspace is prepare_workspace_bytes(groups, heads, ...) as without it. With the
  // KV-cache fields above, their layouts hold kv_heads heads where they say H (k_prefix and v_prefix too). Last,
  // as above.
  int kv_heads = 0;
  // V rounding bias (numerics section 4, "V rounding bias"; optional output, 8-byte aligned): [B, Hk, D] (packed:
  // [num_seqs, Hk, D]) FP32, per (sequence, K/V head, channel) (float)(v_descale * R * 2^-16 / keys) in double, R the
  // exact int64 sum over the sequence's valid keys of rne(2^16 * (x - decode(code))), x = fl(v * scale_inv) the scaled
  // value and code its E4M3 code (a NaN residual counts 0); 0 for a sequence without keys. The same bits on every run.
  // Needs prepare_workspace_bytes(..., v_bias = true). Fp8Inputs::v_bias takes it. Not with the KV-cache fields
  // (Status::Unsupported naming v_bias). Null: not written. Last, as above.
  float* v_bias = nullptr;
};
// Workspace of prepare_fp8 (a multiple of 16 bytes): groups = batch, or num_seqs for packed sequences;
// max_seqlen_k = seqlen_k (batched) or max_seqlen_k (packed), used only with k_smoothing (its per-block
// double channel sums and float means, sized for head dim 128). k_smoothing = false gives the V amax
// slots alone. v_bias: room for the V rounding residual sums and their block counts (PrepareParams::v_bias).
size_t prepare_workspace_bytes(int groups, int heads, int max_seqlen_k, bool k_smoothing, bool v_bias = false);
Status prepare_fp8(const PrepareParams& params, cudaStream_t stream);

// ---- V residual repair rows (numerics section 6) ----------------------------------------------------
// `rows` repair rows per (batch, head), rows = round(budget * Sk) (the same for every head), padded to
// whole 128-key tiles. Row r of head (b, h) repairs token tokens[(b*H + h)*rows + r]: its key codes are
// a copy of that token's K codes, its descale that token's K block descale (so the repair key reproduces
// the original score exactly), its V codes the E4M3 residual code(r_j * scale_inv_V) with the same V
// scale. The attention kernel visits repair tiles after every original block, adds them to the
// numerator only and never raises the running max on them. rows == 0 (the default) is the plain path.
struct RepairInputs {
  int rows = 0;
  const uint8_t* k_codes = nullptr;   // [B, H, repair_padded_rows(rows), D] E4M3, padding rows 0
  const float* k_descale = nullptr;   // [B, H, repair_padded_rows(rows)], 0 for padding rows
  const uint8_t* v_packed = nullptr;  // [B, H, D, repair_padded_rows(rows)] E4M3, kPackedKeyOrder in
                                      // each 16-row group, padding 0
  const int* tokens = nullptr;        // [B, H, rows] selected token indices (energy desc, index asc);
                                      // for callers and tests, not read by attention
};
inline int64_t repair_padded_rows(int64_t rows) { return num_quant_blocks(rows) * kQuantBlock; }

// ---- Attention on prepared inputs -----------------------------------------------------------------
// One kernel family; the parameters pick a compile-time mode of it (plain, repair, causal, packed /
// key lengths, head dim 128 or 64; repair takes 128 only). Three input forms, as prepare_fp8 writes them:
// - Batched (default): in.batch, in.seqlen_q, in.seqlen_k give the sizes.
// - Batched with key lengths (seqused_k set, cu_seqlens null): batch entry b uses its first
//   seqused_k[b] keys (clamped to [0, seqlen_k]); the rest are padding (prepare_fp8 with the same
//   seqused_k leaves them out of the scales). This is how key padding masks run.
// - Packed sequences (cu_seqlens_q/k set, as prepare_fp8 packed): q_codes [total_q, H, D], k_codes
//   [total_k, H, D], descales [num_seqs, H, ceil(max_seqlen/128)] (kInt8: q_descale [num_seqs, H,
//   max_seqlen_q], k_descale [num_seqs, H, ceil(max_seqlen_k/128), kInt8KeyGroups]), v_packed [num_seqs, H, D,
//   ceil(max_seqlen_k/128)*128]; in.batch/seqlen_q/seqlen_k are ignored. Offsets are read on the device
//   only (graph replays may change them) and clamped to [0, total_q/total_k]: whatever they hold, no
//   kernel reads or writes outside the tensors; rows that no sequence covers are not written. Output
//   [total_q, H, D] at out + t*out_stride_seq + h*out_stride_head (out_stride_batch ignored); LSE
//   [H, total_q]. seqused_k may cut each sequence's keys further.
// A query row that sees no key (causal with Sq > Sk, an empty key sequence) gets output 0, lse -inf.
// in.qk_format kInt8 (numerics section 9) takes every one of these forms, causal and head dim 64 too;
// not repair rows (Status::Unsupported naming qk_format).
//
// Key block lists (block-sparse attention, optional; numerics section 5, "Key block lists"): query tile qt
// (rows 128 qt ..) of batch entry b and head h visits only the 128-key blocks
// indices[b', h', qt, 0 .. n-1], n = clamp(num_blocks[b', h', qt], 0, capacity), each index clamped to
// [0, ceil(seqlen_k/128)) (b' = 0 when batch is 1, else b; h' likewise): FlexAttention's kv_num_blocks /
// kv_indices layout. Listed blocks are visited whole, once per listing (a duplicate is visited twice), in
// the mid-window order of list positions. Indices must ascend within a row when seqlen_k is not a multiple of
// 128 (the partial last block is masked where an ascending list puts it; an unordered list then reads the
// padding keys as keys, though never outside the tensors). A tile with n = 0 gives output 0, lse -inf.
// The arrays are device memory read by the kernel only (graph replays may change them). Batched calls on the
// fast path: not with causal, cu_seqlens, seqused_k, repair rows, the VC mode or p_format kExp2
// (Status::Unsupported naming `blocks`).
struct KeyBlockList {
  const int* num_blocks = nullptr;  // int32 [batch, heads, q_tiles], 4-byte aligned
  const int* indices = nullptr;     // int32 [batch, heads, q_tiles, capacity], 4-byte aligned
  int batch = 0, heads = 0;         // 1 (broadcast) or the call's batch / heads
  int q_tiles = 0;                  // ceil(seqlen_q / 128)
  int capacity = 0;                 // indices' last dimension, >= 1
};
inline bool has_block_list(const KeyBlockList& b) { return b.num_blocks != nullptr || b.indices != nullptr; }

struct AttentionParams {
  Fp8Inputs in;
  RepairInputs repair;                 // optional (rows 0: none); plain batched calls only
  void* out = nullptr;                 // out_dtype [B, Sq, H, D] (packed: [total_q, H, D])
  int64_t out_stride_batch = 0, out_stride_seq = 0, out_stride_head = 0;  // elements
  float* lse = nullptr;                // optional FP32 [B, H, Sq] (packed: [H, total_q]), natural log
  DType out_dtype = DType::kBFloat16;  // of out: BF16 (default) or FP16 (FP16 models, no cast kernel)
  float softmax_scale = 0.0f;          // <= 0: 1/sqrt(D)
  int mid_window_blocks = 4;           // kNaturalOrder for natural order
  // Causal, aligned to the end: key j visible to query i iff j <= i + Sk - Sq. Blocks above the
  // diagonal are skipped; traversal from the diagonal down (numerics section 5).
  bool causal = false;
  const int* cu_seqlens_q = nullptr;   // packed: int32 device [num_seqs + 1], 4-byte aligned
  const int* cu_seqlens_k = nullptr;
  int num_seqs = 0, max_seqlen_q = 0, max_seqlen_k = 0;  // packed: host bounds (> 0) of every length
  int64_t total_q = -1, total_k = -1;  // packed: token rows of q_codes / k_codes (required)
  const int* seqused_k = nullptr;      // optional int32 device [batch or num_seqs] key counts
  // P format (see PFormat): kExp2 needs in.qk_format kInt8. Last, so that positional initializers of the
  // fields above stay valid.
  PFormat p_format = PFormat::kExpCast;
  KeyBlockList blocks;                 // optional key block lists (see KeyBlockList); last, as above
  // Chunked causal (with causal; numerics section 5): key j visible to query i iff
  // j < (floor((i + Sk - Sq) / causal_chunk) + 1) * causal_chunk, i.e. every key of the query's own chunk of
  // causal_chunk tokens and of the chunks before it (frame-causal video with causal_chunk = tokens per frame).
  // 1 (the default) is plain causal. >= 1; != 1 needs causal. Last, as above.
  int causal_chunk = 1;
  // V descale per 128-key block (numerics section 4, "V descale per key block"): in.v_descale is
  // [B, Hk, ceil(seqlen_k/128)] (packed: [num_seqs, Hk, ceil(max_seqlen_k/128)]; Hk = in.kv_heads, or H) instead of
  // [B, Hk], and each
  // key block's values are scaled by their own descale. For keys quantized in separate chunks (an FP8 KV
  // cache: each chunk prepared once with its own V scale, its descale repeated over its 128-key blocks,
  // chunks starting at multiples of 128 keys). ExpCast P, E4M3 or INT8 Q/K, head dim 128, with or without
  // cu_seqlens / seqused_k; not causal, repair rows, the VC mode, key block lists or p_format kExp2
  // (Status::Unsupported naming v_descale_per_block). Last, as above.
  bool v_descale_per_block = false;
  // Unquantized Q, quantized inside the kernel, one 128-row tile at a time (numerics section 1: a Q group is one
  // query tile, so codes and descale are those prepare_fp8 writes): when q_unquantized.data is set, in.q_codes
  // and in.q_descale are not read (may be null). E4M3 calls without repair rows, the VC mode, key block lists,
  // chunked causal or V block descales (Status::Unsupported naming q_unquantized); a [B, Sq, H, D] tensor (packed:
  // [total_q, H, D], stride_batch unread; with seqused_k over a batch: stride_batch = seqlen_q * stride_seq, else
  // Status::Unsupported) of q_unquantized_dtype (BF16 or FP16), data 16-byte aligned, strides multiples of 8
  // elements. Last, as above.
  TokenTensorView q_unquantized;
  DType q_unquantized_dtype = DType::kBFloat16;
};
Status attention_fp8(const AttentionParams& params, cudaStream_t stream);

// True when the current device can run the sm_90a kernels (compute capability 9.0).
bool device_supports_sm90a(int device);

}  // namespace openvc
