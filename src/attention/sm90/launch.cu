// Public entry point of the sm_90a fast path and its launch plan: validation (the argument rules of
// attention.h, host values only: offsets and key counts are device data, read by the kernel alone),
// TMA descriptors, the persistent grid and the mode the call needs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attention/call_pointers.h"
#include "attention/shared_rules.h"
#include "attention/sm90/config.h"
#include "attention/sm90/expcast.cuh"
#include "attention/sm90/launch.h"
#include "attention/sm90/split.cuh"
#include "attention/sm90/traversal.h"
#include "common/alignment.h"
#include "common/cuda_check.h"

namespace openvc::sm90 {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver entry point is looked up through the runtime so the library needs no libcuda at link
// time (CI machines have no driver).
Status get_encode_fn(EncodeTiledFn* fn) {
  static EncodeTiledFn cached = nullptr;
  if (cached == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult qres;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &qres);
    if (err != cudaSuccess || qres != cudaDriverEntryPointSuccess || ptr == nullptr)
      return Status::Cuda("cuTensorMapEncodeTiled is not available from the CUDA driver");
    cached = reinterpret_cast<EncodeTiledFn>(ptr);
  }
  *fn = cached;
  return Status::Ok();
}

// BF16 / FP16 Q tile map (kFusedQMode), box D x 128 rows, no swizzle (the consumers read the staging tile as
// dense rows); rows past the map read as zeros. Batched: [B, Sq, H, D] with the caller's strides. Varlen (packed
// sequences, or key counts over a batch whose sequences follow each other in memory): the 3D map over [rows_q, H,
// D] the kernel's varlen tiles index, whose rows past a tile's sequence the consumers zero (fused_q.cuh).
Status make_q16_map(CUtensorMap* map, const TokenTensorView& q, DType dtype, int64_t d, int64_t sq, int64_t h,
                    int64_t b, bool varlen, int64_t rows_q) {
  EncodeTiledFn encode;
  OPENVC_RETURN_IF_ERROR(get_encode_fn(&encode));
  // A dimension of size 1 is only ever read at coordinate 0: its stride (0 from the Python views) becomes the
  // dense one, so the descriptor never sees a zero stride.
  const int64_t rows = varlen ? rows_q : sq;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(rows > 0 ? rows : 1), cuuint64_t(h), cuuint64_t(b)};
  const cuuint64_t strides[3] = {cuuint64_t((rows > 1 ? q.stride_seq : h * d) * 2),
                                 cuuint64_t((h > 1 ? q.stride_head : d) * 2),
                                 cuuint64_t((b > 1 ? q.stride_batch : sq * h * d) * 2)};
  const cuuint32_t box[4] = {cuuint32_t(d), kBlockM, 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            varlen ? 3 : 4, const_cast<void*>(q.data), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status::Invalid("q_unquantized: cannot build a TMA descriptor (CUresult " + std::to_string(int(r)) + ")");
  return Status::Ok();
}

// FP8 tile map whose swizzle is as wide as the box's rows (128 or 64 bytes: the kernel's wgmma
// layouts, gmma.cuh); dims innermost first, strides in bytes for dims 1.. .
template <int Rank>
Status make_fp8_map(CUtensorMap* map, const void* base, const cuuint64_t (&dims)[Rank],
                    const cuuint64_t (&strides)[Rank - 1], const cuuint32_t (&box)[Rank], const char* what) {
  const CUtensorMapSwizzle swizzle = box[0] == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  EncodeTiledFn encode;
  OPENVC_RETURN_IF_ERROR(get_encode_fn(&encode));
  cuuint32_t elem_strides[Rank];
  for (int i = 0; i < Rank; ++i) elem_strides[i] = 1;
  CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, Rank, const_cast<void*>(base), dims, strides, box,
                      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status::Invalid(std::string(what) + ": cannot build a TMA descriptor (CUresult " + std::to_string(int(r)) +
                           "); the pointer must be 16-byte aligned");
  return Status::Ok();
}

std::string str(int64_t x) { return std::to_string(x); }

// Sequence count and (maximum) lengths of the call's form (attention.h).
struct Shape {
  bool packed;
  int seqs, sq, sk;
};
Shape shape_of(const AttentionParams& p) {
  if (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr)
    return {true, p.num_seqs, p.max_seqlen_q, p.max_seqlen_k};
  return {false, p.in.batch, p.in.seqlen_q, p.in.seqlen_k};
}

// Key block lists on the fast path: batched calls of the modes that have a block-list instantiation; the lists'
// own fields as on the general path (shared_rules.h).
Status validate_block_list(const AttentionParams& p, bool vc) {
  if (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.seqused_k != nullptr || p.causal ||
      p.repair.rows > 0 || vc || p.p_format == PFormat::kExp2)
    return Status::Unsupported("blocks: key block lists take batched calls without causal, cu_seqlens, seqused_k, "
                               "repair rows, the VC mode or p_format kExp2");
  return check_key_block_list(p.blocks, p.in);
}

// AttentionParams::q_unquantized: the calls the kernel quantizes Q for (kFusedQMode) and its tensor's layout.
Status validate_unquantized_q(const AttentionParams& p, bool vc) {
  const TokenTensorView& q = p.q_unquantized;
  if (p.repair.rows > 0 || vc || has_block_list(p.blocks) || p.causal_chunk > 1 || p.v_descale_per_block ||
      p.in.qk_format != QkFormat::kE4M3)
    return Status::Unsupported("q_unquantized: the kernel quantizes Q for E4M3 calls (plain or causal, batched or "
                               "packed) only; prepare Q with prepare_fp8 for repair rows, the VC mode, key block "
                               "lists, chunked causal, V block descales or INT8");
  if (p.q_unquantized_dtype != DType::kBFloat16 && p.q_unquantized_dtype != DType::kFloat16)
    return Status::Invalid("q_unquantized_dtype must be kBFloat16 or kFloat16");
  const Fp8Inputs& in = p.in;
  const Shape sh = shape_of(p);
  const Q16Layout layout = q16_call_layout(q, sh.packed, p.seqused_k != nullptr, p.total_q, in.batch, in.seqlen_q,
                                           in.heads, in.head_dim);
  // Key counts over a batch run the varlen tiles, which index Q's rows flat (b * Sq + row).
  if (layout == Q16Layout::kRowsNotFlat)
    return Status::Unsupported("q_unquantized.stride_batch: with seqused_k the kernel reads Q's rows as one "
                               "sequence, so stride_batch must be seqlen_q * stride_seq (" +
                               str(int64_t(in.seqlen_q) * q.stride_seq) + ") when batch > 1 and seqlen_q > 1, got " +
                               str(q.stride_batch));
  if (layout == Q16Layout::kMisaligned)
    return Status::Invalid("q_unquantized: data must be 16-byte aligned and its strides multiples of 8 elements "
                           "(a TMA tensor map), got strides " + str(q.stride_batch) + ", " + str(q.stride_seq) +
                           ", " + str(q.stride_head));
  if (layout == Q16Layout::kStrideBelowHeadDim)
    return Status::Invalid("q_unquantized strides (" + (sh.packed ? std::string() : "batch " + str(q.stride_batch) + ", ") +
                           "seq " + str(q.stride_seq) + ", head " + str(q.stride_head) +
                           "): each must be at least head_dim (" + str(in.head_dim) + ")");
  return Status::Ok();
}

Status validate_form(const AttentionParams& p, bool vc) {
  const Fp8Inputs& in = p.in;
  const Shape sh = shape_of(p);
  if (sh.packed) {
    if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr)
      return Status::Invalid(std::string("cu_seqlens_q, cu_seqlens_k: packed sequences need both offset arrays, got "
                                         "only ") + (p.cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k"));
    if (!aligned(p.cu_seqlens_q, 4) || !aligned(p.cu_seqlens_k, 4))
      return Status::Invalid("cu_seqlens_q, cu_seqlens_k: int32 arrays must be 4-byte aligned");
    if (p.num_seqs <= 0 || p.max_seqlen_q <= 0 || p.max_seqlen_k <= 0)
      return Status::Invalid("num_seqs, max_seqlen_q, max_seqlen_k: must be > 0 with cu_seqlens, got " +
                             str(p.num_seqs) + ", " + str(p.max_seqlen_q) + ", " + str(p.max_seqlen_k));
    if (p.total_q < 0 || p.total_k < 0)
      return Status::Invalid("total_q, total_k: the token rows of q_codes and k_codes are needed with cu_seqlens "
                             "(offsets are clamped to them), got " + str(p.total_q) + ", " + str(p.total_k));
    if (p.total_q > INT32_MAX - 2 * kBlockM || p.total_k > INT32_MAX - 2 * kBlockN)
      return Status::Unsupported("total_q, total_k: must stay below 2^31 - 256 token rows (TMA coordinates)");
  } else {
    if (p.num_seqs != 0 || p.max_seqlen_q != 0 || p.max_seqlen_k != 0)
      return Status::Invalid("num_seqs, max_seqlen_q, max_seqlen_k: only used with cu_seqlens; must stay 0 for "
                             "batched inputs, got " + str(p.num_seqs) + ", " + str(p.max_seqlen_q) + ", " +
                             str(p.max_seqlen_k));
    if (in.batch <= 0 || in.seqlen_q <= 0 || in.seqlen_k <= 0)
      return Status::Invalid("in: batch, seqlen_q and seqlen_k must be > 0, got " + str(in.batch) + ", " +
                             str(in.seqlen_q) + ", " + str(in.seqlen_k));
    if (int64_t(in.batch) * in.seqlen_q > INT32_MAX - kBlockM ||
        int64_t(in.batch) * in.seqlen_k > INT32_MAX - kBlockN)
      return Status::Unsupported("in: batch * seqlen_q and batch * seqlen_k must stay below 2^31 - 128 token rows");
  }
  if (p.seqused_k != nullptr && !aligned(p.seqused_k, 4))
    return Status::Invalid("seqused_k: an int32 array must be 4-byte aligned");
  if (in.heads <= 0) return Status::Invalid("in.heads must be > 0, got " + str(in.heads));
  if (in.kv_heads < 0 || (in.kv_heads > 0 && in.heads % in.kv_heads != 0))
    return Status::Invalid("in.kv_heads must be 0 (in.heads) or a divisor of in.heads = " + str(in.heads) +
                           " (grouped-query attention), got " + str(in.kv_heads));
  if (kv_heads_or(in.heads, in.kv_heads) != in.heads && (p.repair.rows > 0 || vc))
    return Status::Unsupported(std::string("in.kv_heads: ") + (vc ? "the VC mode" : "repair rows") +
                               " take K and V with the heads of Q only (kv_heads 0 or heads)");
  const bool varlen = sh.packed || p.seqused_k != nullptr;
  if (in.qk_format != QkFormat::kE4M3 && in.qk_format != QkFormat::kInt8)
    return Status::Invalid("in.qk_format must be kE4M3 or kInt8");
  if (p.p_format != PFormat::kExpCast && p.p_format != PFormat::kExp2)
    return Status::Invalid("p_format must be kExpCast or kExp2, got " + str(int(p.p_format)));
  if (p.p_format == PFormat::kExp2 && (p.repair.rows > 0 || vc))
    return Status::Unsupported(std::string("p_format kExp2: ") + (vc ? "the VC mode" : "repair rows") +
                               " take the ExpCast P format only");
  if (p.p_format == PFormat::kExp2 && in.qk_format != QkFormat::kInt8)
    return Status::Unsupported("p_format kExp2 needs in.qk_format kInt8 (E4M3 Q/K take the ExpCast P format only)");
  if (in.qk_format == QkFormat::kInt8 && (p.repair.rows > 0 || vc))
    return Status::Unsupported(std::string("in.qk_format kInt8: ") + (vc ? "the VC mode" : "repair rows") +
                               " take E4M3 Q/K only (kInt8 runs dense, causal, cu_seqlens and seqused_k calls)");
  if (has_block_list(p.blocks)) OPENVC_RETURN_IF_ERROR(validate_block_list(p, vc));
  if (p.v_descale_per_block && (p.causal || p.repair.rows > 0 || vc || has_block_list(p.blocks) ||
                                p.p_format == PFormat::kExp2 || in.head_dim != 128))
    return Status::Unsupported("v_descale_per_block: V block descales take head_dim 128 and ExpCast P, without "
                               "causal, repair rows, the VC mode or key block lists");
  if (in.v_bias != nullptr && (p.repair.rows > 0 || vc || p.v_descale_per_block || has_block_list(p.blocks)))
    return Status::Unsupported(std::string("in.v_bias: the V rounding bias correction does not combine with ") +
                               (vc                    ? "the VC mode"
                                : p.repair.rows > 0   ? "repair rows"
                                : p.v_descale_per_block ? "V block descales"
                                                      : "key block lists"));
  // kVBiasMode's instantiations (mode.h)
  if (in.v_bias != nullptr && in.qk_format != QkFormat::kInt8)
    return Status::Unsupported("in.v_bias: the V rounding bias correction is built for in.qk_format kInt8 (ExpCast "
                               "or exp2 P; plain, causal, cu_seqlens, seqused_k, head dim 64), got kE4M3");
  if (in.v_bias != nullptr && !aligned(in.v_bias, 8))
    return Status::Invalid("in.v_bias must be 8-byte aligned (the epilogue reads channel pairs)");
  if ((varlen || p.causal) && (p.repair.rows > 0 || vc))
    return Status::Unsupported(std::string(vc ? "VC mode" : "repair rows") +
                               " take plain batched, non-causal calls only (no cu_seqlens, seqused_k or causal)");
  if (p.q_unquantized.data != nullptr) OPENVC_RETURN_IF_ERROR(validate_unquantized_q(p, vc));
  return Status::Ok();
}

Status validate(const AttentionParams& p, bool vc) {
  const Fp8Inputs& in = p.in;
  OPENVC_RETURN_IF_ERROR(validate_form(p, vc));
  if (in.head_dim != 128 && in.head_dim != 64)
    return Status::Invalid("in.head_dim: the sm_90a kernel takes 128 or 64, got " + str(in.head_dim));
  if (in.head_dim == 64 && (p.repair.rows > 0 || vc))
    return Status::Unsupported(std::string(vc ? "VC mode" : "repair rows") + " take head_dim 128 only, got 64");
  const auto ptrs = call_pointers(p);
  for (const auto& x : ptrs)
    if (x.ptr == nullptr) return Status::Invalid(std::string(x.name) + " must not be null");
  for (const auto& x : ptrs)
    if (x.ptr != p.out && !aligned(x.ptr, 16)) return Status::Invalid(std::string(x.name) + " must be 16-byte aligned");
  if (!aligned(p.out, 4) || p.out_stride_seq % 2 != 0 || p.out_stride_head % 2 != 0 || p.out_stride_batch % 2 != 0)
    return Status::Invalid("out: BF16 rows are stored as pairs; pointer must be 4-byte aligned and strides even");
  if (p.lse != nullptr && !aligned(p.lse, 4)) return Status::Invalid("lse must be 4-byte aligned (FP32)");
  // Rows of the output must not overlap: a zero (default) stride would make every row write the same
  // memory. The stride of a dimension of size 1 is never used.
  const Shape sh = shape_of(p);
  if ((in.heads > 1 && p.out_stride_head < in.head_dim) || ((sh.packed || sh.sq > 1) && p.out_stride_seq < in.head_dim) ||
      (!sh.packed && in.batch > 1 && p.out_stride_batch < in.head_dim))
    return Status::Invalid("out strides (batch " + str(p.out_stride_batch) + ", seq " + str(p.out_stride_seq) +
                           ", head " + str(p.out_stride_head) + "): each must be at least head_dim (" +
                           str(in.head_dim) + ") where that dimension is larger than 1" +
                           (sh.packed ? " (seq always, packed)" : ""));
  if (!std::isfinite(p.softmax_scale))
    return Status::Invalid("softmax_scale must be finite, got " + std::to_string(p.softmax_scale));
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat16)
    return Status::Invalid("out_dtype must be kBFloat16 or kFloat16");
  const RepairInputs& r = p.repair;
  if (r.rows < 0) return Status::Invalid("repair.rows must be >= 0, got " + str(r.rows));
  if (r.rows > 0) {
    const struct { const void* ptr; const char* name; } rptrs[] = {
        {r.k_codes, "repair.k_codes"}, {r.k_descale, "repair.k_descale"}, {r.v_packed, "repair.v_packed"}};
    for (const auto& x : rptrs) {
      if (x.ptr == nullptr) return Status::Invalid(std::string(x.name) + " must not be null when repair.rows > 0");
      if (!aligned(x.ptr, 16)) return Status::Invalid(std::string(x.name) + " must be 16-byte aligned");
    }
    if (r.rows > in.seqlen_k)
      return Status::Invalid("repair.rows (" + str(r.rows) + ") must not exceed seqlen_k (" + str(in.seqlen_k) + ")");
  }
  OPENVC_RETURN_IF_ERROR(check_causal_chunk(p.causal_chunk, p.causal));
  if (p.mid_window_blocks < kNaturalOrder)
    return Status::Invalid("mid_window_blocks must be >= 0 or kNaturalOrder (-1), got " + str(p.mid_window_blocks));
  return Status::Ok();
}

// Causal tiles see very different numbers of keys. The default (batch, head)-major order, heaviest
// query tile of each (b, h) first, dealt round robin, can load the persistent CTAs unevenly when few
// (b, h) share the grid (S = 32,768, H = 7: the busiest CTA gets 1.33x the mean). This predicts the
// load balance of that order from the tiles' visible key blocks (host arithmetic, no device data)
// and picks the query-tile-major snake order (busiest 1.002x) where the default leaves more than 3%
// on the table. Packed sequences keep the default (their lengths are device data).
bool causal_snake_pays(int64_t seqs, int64_t heads, int64_t sq, int64_t sk, int chunk, int grid) {
  const int64_t nq = num_quant_blocks(sq), nk = num_quant_blocks(sk), tiles = seqs * heads * nq;
  if (grid <= 1 || tiles > 200000) return false;   // many tiles per CTA: balanced either way
  constexpr double kTileOverheadBlocks = 2.0;       // prologue and epilogue, in key-block times
  std::vector<double> load(size_t(grid), 0.0);
  double total = 0.0;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t qt = nq - 1 - i % nq;             // the default order: qt descending per (b, h)
    const int64_t limit = causal_key_limit(std::min(qt * kBlockM + kBlockM, sq) - 1, sq, sk, chunk);
    const int64_t blocks = std::min((limit + kBlockN - 1) / kBlockN, nk);
    const double w = double(blocks) + kTileOverheadBlocks;
    load[size_t(i % grid)] += w;
    total += w;
  }
  const double busiest = *std::max_element(load.begin(), load.end());
  return busiest > 0.0 && total / double(grid) / busiest < 0.97;
}

}  // namespace

Status plan_attention(const AttentionParams& params, const VcModeInputs* vc, LaunchPlan* plan) {
  OPENVC_RETURN_IF_ERROR(validate(params, vc != nullptr));
  if (vc != nullptr && (vc->channel_descale == nullptr || vc->mean_scaled == nullptr))
    return Status::Invalid("VC mode needs v_channel_descale and block_mean_scaled");
  const Fp8Inputs& in = params.in;
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (!device_supports_sm90a(device))
    return Status::Unsupported("attention_fp8: the FP8 ExpCast kernel needs an sm_90 (Hopper) GPU");

  const Shape sh = shape_of(params);
  // V block descales are built into the varlen mode only (its 3D maps take batched calls too).
  const bool varlen = sh.packed || params.seqused_k != nullptr || params.v_descale_per_block;
  const bool fused_q = params.q_unquantized.data != nullptr;   // validated (validate_unquantized_q)
  const int64_t d = in.head_dim, h = in.heads, seqs = sh.seqs, sq = sh.sq, sk = sh.sk;
  const int64_t hk = kv_heads_or(in.heads, in.kv_heads);   // K and V heads (grouped-query attention: fewer)
  const int64_t nq = num_quant_blocks(sq), nk = num_quant_blocks(sk), sk_pad = nk * kBlockN;
  // Token rows of the code tensors: packed, the caller's totals; batched, B * S (the 3D maps of the
  // varlen mode index them flat; a zero-row map cannot be built, and nothing reads it then).
  const int64_t rows_q = sh.packed ? params.total_q : seqs * sq, rows_k = sh.packed ? params.total_k : seqs * sk;
  LaunchPlan& pl = *plan;
  pl = LaunchPlan{};
  if (fused_q) {
    // Key counts over a batch: the rows read flat, one row per entry at stride_batch when Sq = 1 (q16_row_stride).
    TokenTensorView q16 = params.q_unquantized;
    if (varlen && !sh.packed) q16.stride_seq = q16_row_stride(q16, in.batch, in.seqlen_q);
    OPENVC_RETURN_IF_ERROR(make_q16_map(&pl.tm_q, q16, params.q_unquantized_dtype, d, sq, h, seqs, varlen, rows_q));
  }
  if (varlen) {
    if (!fused_q)
      OPENVC_RETURN_IF_ERROR(make_fp8_map<3>(&pl.tm_q, in.q_codes,
                                             {cuuint64_t(d), cuuint64_t(rows_q > 0 ? rows_q : 1), cuuint64_t(h)},
                                             {cuuint64_t(h * d), cuuint64_t(d)}, {cuuint32_t(d), kBlockM, 1},
                                             "in.q_codes"));
    OPENVC_RETURN_IF_ERROR(make_fp8_map<3>(&pl.tm_k, in.k_codes, {cuuint64_t(d), cuuint64_t(rows_k > 0 ? rows_k : 1), cuuint64_t(hk)},
                                           {cuuint64_t(hk * d), cuuint64_t(d)},
                                           {cuuint32_t(d), kBlockN, 1}, "in.k_codes"));
  } else {
    if (!fused_q)
      OPENVC_RETURN_IF_ERROR(make_fp8_map<4>(&pl.tm_q, in.q_codes, {cuuint64_t(d), cuuint64_t(sq), cuuint64_t(h), cuuint64_t(seqs)},
                                             {cuuint64_t(h * d), cuuint64_t(d), cuuint64_t(sq * h * d)},
                                             {cuuint32_t(d), kBlockM, 1, 1}, "in.q_codes"));
    OPENVC_RETURN_IF_ERROR(make_fp8_map<4>(&pl.tm_k, in.k_codes, {cuuint64_t(d), cuuint64_t(sk), cuuint64_t(hk), cuuint64_t(seqs)},
                                           {cuuint64_t(hk * d), cuuint64_t(d), cuuint64_t(sk * hk * d)},
                                           {cuuint32_t(d), kBlockN, 1, 1}, "in.k_codes"));
  }
  OPENVC_RETURN_IF_ERROR(make_fp8_map<3>(&pl.tm_v, in.v_packed, {cuuint64_t(sk_pad), cuuint64_t(d), cuuint64_t(seqs * hk)},
                                         {cuuint64_t(sk_pad), cuuint64_t(d * sk_pad)},
                                         {kBlockN, cuuint32_t(d), 1}, "in.v_packed"));

  // Repair maps over [B, H, R, D] key copies and [B*H, D, R] residual V; without repair the plain
  // maps stand in (never read).
  pl.tm_krep = pl.tm_k;
  pl.tm_vrep = pl.tm_v;
  const RepairInputs& rep = params.repair;
  const int64_t r_pad = repair_padded_rows(rep.rows);
  if (rep.rows > 0) {
    OPENVC_RETURN_IF_ERROR(make_fp8_map<4>(&pl.tm_krep, rep.k_codes, {cuuint64_t(d), cuuint64_t(r_pad), cuuint64_t(h), cuuint64_t(seqs)},
                                           {cuuint64_t(d), cuuint64_t(r_pad * d), cuuint64_t(h * r_pad * d)},
                                           {cuuint32_t(d), kBlockN, 1, 1}, "repair.k_codes"));
    OPENVC_RETURN_IF_ERROR(make_fp8_map<3>(&pl.tm_vrep, rep.v_packed, {cuuint64_t(r_pad), cuuint64_t(d), cuuint64_t(seqs * h)},
                                           {cuuint64_t(r_pad), cuuint64_t(d * r_pad)},
                                           {kBlockN, cuuint32_t(d), 1}, "repair.v_packed"));
  }

  KernelParams& kp = pl.kp;
  kp.repair_rows = rep.rows;
  kp.repair_tiles = static_cast<int>(r_pad / kBlockN);
  kp.repair_k_descale = rep.k_descale;
  kp.vc_channel_descale = vc ? vc->channel_descale : nullptr;
  kp.vc_mean_scaled = vc ? vc->mean_scaled : nullptr;
  kp.batch = sh.seqs;
  kp.heads = in.heads;
  kp.kv_heads = static_cast<int>(hk);
  kp.kv_group = static_cast<int>(h / hk);
  kp.seqlen_q = sh.sq;
  kp.seqlen_k = sh.sk;
  kp.num_q_tiles = static_cast<int>(nq);
  kp.num_k_blocks = static_cast<int>(nk);
  const int64_t tiles = nq * h * seqs;
  if (tiles > INT32_MAX) return Status::Invalid("in: sequences * heads * ceil(seqlen_q/128) exceeds 2^31");
  kp.num_tiles = static_cast<int>(tiles);
  if (!fits_fast_path(sq, sk))
    return Status::Unsupported("in: ceil(seqlen_q/128) * seqlen_k must be < 2^32 for the sm_90a kernel");
  if (seqs * h * nk > INT32_MAX || seqs * h * nq > INT32_MAX)
    return Status::Unsupported("in: sequences * heads * key or query blocks must be < 2^31 (descale indices)");
  kp.mid_window_blocks = params.mid_window_blocks;
  kp.q_descale = in.q_descale;
  kp.k_descale = in.k_descale;
  kp.v_descale = in.v_descale;
  kp.v_bias = in.v_bias;
  kp.out = static_cast<__nv_bfloat16*>(params.out);
  kp.out_stride_b = sh.packed ? 0 : params.out_stride_batch;
  kp.out_stride_s = params.out_stride_seq;
  kp.out_stride_h = params.out_stride_head;
  kp.out_vec16 = aligned(params.out, 16) && params.out_stride_seq % 8 == 0 && params.out_stride_head % 8 == 0 &&
                 kp.out_stride_b % 8 == 0;
  kp.lse = params.lse;
  const float tau = params.softmax_scale > 0.0f ? params.softmax_scale : 1.0f / std::sqrt(float(in.head_dim));
  // ((8 log2e) * tau) * 2^-24, then * dq, * dk in the kernel: 2^-24 times the reference's multiplier.
  kp.qk_multiplier = (kCodesPerLog2 * tau) * kDomainScale;
  kp.cu_q = params.cu_seqlens_q;
  kp.cu_k = params.cu_seqlens_k;
  kp.seqused_k = params.seqused_k;
  kp.total_q = static_cast<int>(sh.packed ? params.total_q : rows_q);
  kp.total_k = static_cast<int>(sh.packed ? params.total_k : rows_k);
  kp.lse_stride_s = sh.packed ? 0 : h * sq;   // LSE [H, total_q] packed, [B, H, Sq] batched
  kp.lse_stride_h = sh.packed ? params.total_q : sq;
  kp.out_fp16 = params.out_dtype == DType::kFloat16;
  kp.q_fp16 = fused_q && params.q_unquantized_dtype == DType::kFloat16;

  pl.mode = vc ? kVcMode
           : rep.rows > 0 ? kRepairMode
           : (varlen ? kVarlenMode : kPlainMode) | (params.causal ? kCausalMode : kPlainMode) |
                 (params.causal && params.causal_chunk > 1 ? kChunkedCausalMode : kPlainMode) |
                 (d == 64 ? kHeadDim64Mode : kPlainMode) |
                 (in.qk_format == QkFormat::kInt8 ? kInt8QkMode : kPlainMode) |
                 (params.p_format == PFormat::kExp2 ? kExp2PMode : kPlainMode) |
                 (has_block_list(params.blocks) ? kBlockListMode : kPlainMode) |
                 (params.v_descale_per_block ? kVBlockDescaleMode : kPlainMode) |
                 (fused_q ? kFusedQMode : kPlainMode) | (in.v_bias != nullptr ? kVBiasMode : kPlainMode);
  // Few key blocks per tile (config.h, kFewKeyBlocks / kFewKeyBlocksFusedQ): the plain and fused-Q modes' ping-pong
  // twin.
  if ((pl.mode == kPlainMode && nk <= kFewKeyBlocks) || (pl.mode == kFusedQMode && nk <= kFewKeyBlocksFusedQ))
    pl.mode |= kFewKeysMode;
  const KeyBlockList& bl = params.blocks;
  kp.blk_count = bl.num_blocks;
  kp.blk_index = bl.indices;
  const KeyBlockStrides bs = key_block_strides(bl);
  kp.blk_stride_b = bs.batch, kp.blk_stride_h = bs.head;
  kp.blk_capacity = bl.capacity;
  int sms = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  pl.grid = static_cast<int>(tiles < sms ? tiles : sms);
  kp.causal_chunk = params.causal_chunk;
  kp.causal_snake = params.causal && !varlen && causal_snake_pays(seqs, h, sq, sk, params.causal_chunk, pl.grid);
  kp.compact_tiles = sh.packed && seqs <= kMaxCompactSeqs;   // tiles.cuh
  if (sh.packed && params.total_q == 0) pl.grid = 0;   // no query row at all
  return Status::Ok();
}

namespace {
int64_t round_up_256(int64_t x) { return (x + 255) / 256 * 256; }
// Split tiles' dealing (split.cuh): the tiles of whole waves before the last one to two go round robin, whole.
int64_t split_head_tiles(int64_t tiles, int64_t grid) { return tiles < 2 * grid ? 0 : tiles - (grid + tiles % grid); }
}  // namespace

int split_tiles_arrival_words(int grid) { return grid * 4 * kConsumerWarpgroups; }
size_t split_tiles_partials_offset(int grid) { return size_t(round_up_256(int64_t(split_tiles_arrival_words(grid)) * 4)); }
size_t split_tiles_workspace_bytes(int grid) {
  return split_tiles_partials_offset(grid) + size_t(round_up_256(split_partials_floats<128>(grid) * int64_t(sizeof(float))));
}

bool split_tiles_eligible(const LaunchPlan& plan) {
  const int64_t tiles = plan.kp.num_tiles, n = plan.kp.num_k_blocks, grid = plan.grid;
  const int64_t head = split_head_tiles(tiles, grid);
  // tail >= grid tiles, so every range holds at least n units; cursors (head tiles + tail units) in 32 bits
  return (plan.mode == kFusedQMode || plan.mode == (kFusedQMode | kFewKeysMode)) && grid > 1 && tiles >= grid &&
         head + (tiles - head) * n < INT32_MAX;
}

Status use_split_tiles(LaunchPlan* plan, void* workspace, size_t workspace_bytes) {
  if (plan == nullptr || !split_tiles_eligible(*plan))
    return Status::Invalid("use_split_tiles: the plan cannot run split tiles (split_tiles_eligible)");
  if (workspace == nullptr || !aligned(workspace, 256) || workspace_bytes < split_tiles_workspace_bytes(plan->grid))
    return Status::Invalid("use_split_tiles: workspace must be 256-byte aligned and hold split_tiles_workspace_bytes(" +
                           str(plan->grid) + ") = " + str(int64_t(split_tiles_workspace_bytes(plan->grid))) + " bytes");
  KernelParams& kp = plan->kp;
  const int64_t head = split_head_tiles(kp.num_tiles, plan->grid);
  const int64_t units = (kp.num_tiles - head) * kp.num_k_blocks;
  kp.split_head_tiles = int(head);
  kp.split_q = int(units / plan->grid);
  kp.split_r = int(units % plan->grid);
  // The counts first: a plan on fewer CTAs than the workspace was sized for reads a prefix of the zeroed ones.
  kp.split_arrivals = static_cast<int*>(workspace);
  kp.split_partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + split_tiles_partials_offset(plan->grid));
  plan->mode |= kSplitTilesMode;
  return Status::Ok();
}

namespace {
// The dispatch over kProductionModes (mode.h): a compile-time search, one comparison per table entry,
// that launches the entry equal to the plan's mode (instantiated in its generated translation unit).
template <size_t... I>
Status launch_production_mode(const LaunchPlan& plan, cudaStream_t stream, std::index_sequence<I...>) {
  Status st;
  const bool found = ((plan.mode == kProductionModes[I] && (st = launch_mode<kProductionModes[I]>(plan, stream), true)) ||
                      ...);
  if (!found)
    return Status::Unsupported("attention_fp8: no kernel for mode " + str(plan.mode) + " (" + mode_name(plan.mode) +
                               "): not in kProductionModes");
  return st;
}
}  // namespace

Status launch_plan(const LaunchPlan& plan, cudaStream_t stream) {
  return launch_production_mode(plan, stream, std::make_index_sequence<kNumProductionModes>{});
}

}  // namespace openvc::sm90

namespace openvc {

Status attention_fp8(const AttentionParams& params, cudaStream_t stream) {
  sm90::LaunchPlan plan;
  OPENVC_RETURN_IF_ERROR(sm90::plan_attention(params, nullptr, &plan));
  return sm90::launch_plan(plan, stream);
}

}  // namespace openvc
