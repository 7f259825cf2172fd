// The tile walk and the arguments every preparation kernel shares (kernels.cuh, smoothing.cuh): one CTA
// per (sequence, head, 128-token block), the sequence spans (offsets clamped to the tensors), the element
// unpacking, the E4M3 scales of numerics section 1 and the block maxima.
// The kernels share one tile walk: 2*D threads, each loading four 16-element chunks (2 x 16 B each)
// of the block's 128 x D elements, so D=128 and D=64 both issue 8 independent 16-byte loads per
// thread. Flat grids (head fastest) keep CTAs that run together on neighbouring heads of the same
// tokens, so DRAM sees whole [H*D] token rows, and lift the 65535 limit of gridDim.y/z.
#pragma once
#include <cstdint>

#include <cuda_fp16.h>

#include "common/e4m3.cuh"

namespace openvc::prepare {

inline constexpr int kBlockTokens = 128;  // == kQuantBlock
inline constexpr float kE4M3Max = 448.0f;

// Key stored at packed column kappa of a 16-key group (attention.h kPackedKeyOrder, as a formula
// usable in device code; prepare.cu checks that the two agree).
__host__ __device__ constexpr int packed_key(int kappa) {
  return (kappa & 3) < 2 ? 2 * (kappa >> 2) + (kappa & 3) : 8 + 2 * (kappa >> 2) + (kappa & 3) - 2;
}

struct Bf16 {};
struct F16 {};

// Two 16-bit elements of one 32-bit word -> two floats (exact for both types).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t w);
template <>
__device__ __forceinline__ float2 unpack2<Bf16>(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}
template <>
__device__ __forceinline__ float2 unpack2<F16>(uint32_t w) {
  return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu))),
                     __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))));
}

// One input tensor: element strides, head dim contiguous. Batched (cu_seqlens null): sequence b is
// tokens [0, seqlen) at data + b * stride_batch. Packed: sequence b is tokens [cu_seqlens[b],
// cu_seqlens[b + 1]) of a [total, H, D] tensor (stride_batch unused), seqlen the max length.
struct TokenArgs {
  const void* data;
  int64_t stride_batch, stride_seq, stride_head;
  int seqlen;              // batched: every sequence's length; packed: max_seqlen (sizes the grid)
  const int* cu_seqlens;   // device, num_seqs + 1 offsets; null: batched
  int64_t total;           // packed: token rows of the tensor; offsets are clamped to [0, total]
  const int* seqused;      // optional per-sequence used lengths (keys past them are padding); null: all
};

// Where sequence b lies: the token row of its first token in the [total, H, D] code outputs (b * S
// when batched), the element offset of that token in the input, and its length.
struct SeqSpan {
  int64_t row0;
  int64_t in_offset;
  int len;
};
// Offsets are clamped to the tensor, whatever they hold (a bad offset shortens or empties its sequence
// and never reads or writes outside the tensors); seqused shortens a sequence further.
__device__ __forceinline__ SeqSpan seq_span(const TokenArgs& a, int b) {
  SeqSpan sp;
  if (a.cu_seqlens == nullptr) {
    sp = {static_cast<int64_t>(b) * a.seqlen, static_cast<int64_t>(b) * a.stride_batch, a.seqlen};
  } else {
    const int64_t start = min(max(static_cast<int64_t>(__ldg(a.cu_seqlens + b)), int64_t(0)), a.total);
    const int64_t end = min(max(static_cast<int64_t>(__ldg(a.cu_seqlens + b + 1)), start), a.total);
    sp = {start, start * a.stride_seq, static_cast<int>(end - start)};
  }
  if (a.seqused != nullptr) sp.len = min(sp.len, max(__ldg(a.seqused + b), 0));
  return sp;
}

// A KV cache's preparation (the kCache kernels, which prepare.cu launches when PrepareParams sets any of its
// KV-cache fields; batched, no smoothing): K and V read in two parts, the leading keys [0, prefix_len) of
// every batch entry from `prefix` (its own strides), the rest from the K / V input at key - prefix_len; K
// codes, K descales and per-block V descales written with a cache's row strides. Last in QkArgs and VArgs,
// so the other kernels' parameter layout is unchanged.
struct LeadingPart {     // [B, prefix_len, H, D] elements, head dim contiguous
  const void* data;
  int64_t stride_batch, stride_seq, stride_head;
};
struct CacheArgs {
  LeadingPart k_prefix, v_prefix;
  int prefix_len;         // 0: one part
  int64_t k_rows;         // token rows per batch entry of the K codes
  int k_blocks;           // blocks per (batch, head) row of the K descales and of per-block V descales
  int v_descale_blocks;   // > 0: one V descale per block, [B, H, v_descale_blocks]; 0: [B, H]
};

// Q or K side of quantize_qk_kernel.
struct QkSide {
  TokenArgs in;
  int nblocks;        // ceil(seqlen / 128)
  uint8_t* codes;     // [B, S, H, D], or [total, H, D] packed
  float* descale;     // [B, H, nblocks] (INT8: Q [B, H, seqlen], K [B, H, nblocks, kKeyGroups])
};
struct QkArgs {
  QkSide side[2];     // 0: Q, 1: K
  int heads;
  uint32_t* v_amax;   // [B, H] workspace, zeroed here
  const float* k_mean;  // [B, H, D] K smoothing means (smoothing.cuh), read by the kSmooth kernels only
  float* q_dot_k_mean;  // kSmooth: optional q_i . mean(K) per query row in the LSE's layout (null: none)
  CacheArgs cache;      // the K side of the kCache kernels only
  // Words CTA 0 sets to 0 (prepare_internal.h: the one-call path's split-tile counts, zero before the attention
  // kernel that follows the preparation reads them); null: none.
  int* zero_words;
  int zero_count;
  // Grouped-query attention (PrepareParams::kv_heads): query heads per K/V head. The Q blocks' q_dot_k_mean reads
  // the means of K/V head h / kv_group (heads / kv_group of them per sequence). 1 without it.
  int kv_group = 1;
  // V rounding residual sums ([B, heads, D] int64) and block counts ([B, heads]) of VArgs, which the first block of
  // each (batch, head) zeroes before v_pack_kernel adds to them; null: none (and in a launch over the query heads alone).
  unsigned long long* v_residual_sums = nullptr;
  unsigned* v_arrivals = nullptr;
};

struct VArgs {
  TokenArgs in;
  int heads, nblocks;
  uint32_t* v_amax;   // [B, H] float bits of max |v|
  uint8_t* v_packed;  // [B, H, D, sk_pad], each sequence from column 0 of its slab (a cache: its slots)
  float* v_descale;   // [B, H] (a cache: see CacheArgs::v_descale_blocks)
  int64_t sk_pad;
  CacheArgs cache;    // read by the kCache kernels only
  // V rounding bias (numerics section 4), all three set or none: the workspace's int64 residual sums [B, H, D] (two's
  // complement in unsigned words: per channel, the sum over the sequence's keys of rne(2^16 * (x - decode(code)))) and
  // block counts [B, H], both zeroed by the Q/K grid, and the output v_bias [B, H, D], which the sequence's last
  // block to finish writes.
  unsigned long long* v_residual_sums = nullptr;
  unsigned* v_arrivals = nullptr;
  float* v_bias = nullptr;
};

template <int D>
struct Tile {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr int kThreads = 2 * D;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kChunksPerToken = D / 16;                  // 16-element chunks
  static constexpr int kTokenStep = kThreads / kChunksPerToken;   // 32 tokens per pass
  static constexpr int kPasses = kBlockTokens / kTokenStep;       // 4 chunks per thread
  static_assert(kPasses * kTokenStep == kBlockTokens, "tile walk covers the block");
  // Residency: 1024 threads per SM (64 registers) keep 4 x 32 KB (D = 128) of loads in flight per
  // SM, well above what saturates HBM.
  static constexpr int kMinCtas = 1024 / kThreads;
};

// The 128 x D tile of one (sequence, head, block): chunk p of this thread is token
// tid / kChunksPerToken + 32 p, elements 16 * (tid % kChunksPerToken) .. +15. Tokens at or past
// the sequence's end read as zero (partial final block).
template <int D, bool kStreaming>
__device__ __forceinline__ void load_tile(const TokenArgs& a, const SeqSpan& span, int h, int token0,
                                          uint4 (&v)[Tile<D>::kPasses][2]) {
  using TL = Tile<D>;
  const int valid = span.len - token0;
  const int t = threadIdx.x / TL::kChunksPerToken;
  const int sub = threadIdx.x % TL::kChunksPerToken;
  // 2-byte elements; int64 arithmetic: one tensor can exceed 2^31 elements (S=73k, H=56: 5e8).
  const uint16_t* base = static_cast<const uint16_t*>(a.data) + span.in_offset +
                         h * a.stride_head + static_cast<int64_t>(token0 + t) * a.stride_seq + 16 * sub;
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    const int tok = t + p * TL::kTokenStep;
    if (tok < valid) {
      const uint4* src = reinterpret_cast<const uint4*>(base + p * TL::kTokenStep * a.stride_seq);
      v[p][0] = kStreaming ? __ldcs(src) : __ldg(src);
      v[p][1] = kStreaming ? __ldcs(src + 1) : __ldg(src + 1);
    } else {
      v[p][0] = v[p][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// load_tile of a KV cache's two-part K or V (CacheArgs; batched): the same tile, each token read from the
// leading part `prefix` (batch entry b) or from `a` at token - prefix_len. A separate function, so the
// one-part kernels keep their loop.
template <int D, bool kStreaming>
__device__ __forceinline__ void load_tile_two_part(const TokenArgs& a, const LeadingPart& lp, int prefix_len,
                                                   const SeqSpan& span, int b, int h, int token0,
                                                   uint4 (&v)[Tile<D>::kPasses][2]) {
  using TL = Tile<D>;
  const int valid = span.len - token0;
  const int t = threadIdx.x / TL::kChunksPerToken;
  const int sub = threadIdx.x % TL::kChunksPerToken;
  const uint16_t* rest = static_cast<const uint16_t*>(a.data) + span.in_offset + h * a.stride_head + 16 * sub;
  const uint16_t* lead = static_cast<const uint16_t*>(lp.data) + static_cast<int64_t>(b) * lp.stride_batch +
                         h * lp.stride_head + 16 * sub;
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    const int tok = token0 + t + p * TL::kTokenStep;   // the key's position in the joined sequence
    if (tok - token0 < valid) {
      const uint4* src = reinterpret_cast<const uint4*>(
          tok < prefix_len ? lead + static_cast<int64_t>(tok) * lp.stride_seq
                           : rest + static_cast<int64_t>(tok - prefix_len) * a.stride_seq);
      v[p][0] = kStreaming ? __ldcs(src) : __ldg(src);
      v[p][1] = kStreaming ? __ldcs(src + 1) : __ldg(src + 1);
    } else {
      v[p][0] = v[p][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// Packed max(acc, |w|) on two 16-bit elements. max.{bf16,f16}x2 returns the non-NaN operand when
// one is NaN, like fmaxf; the max picks one of its inputs, so the result is exact. Working on the
// raw words keeps the tile at 32 registers (float copies made here would stay live for encoding).
template <typename T>
__device__ __forceinline__ uint32_t absmax2(uint32_t acc, uint32_t w);
template <>
__device__ __forceinline__ uint32_t absmax2<Bf16>(uint32_t acc, uint32_t w) {
  uint32_t r;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(acc), "r"(w & 0x7FFF7FFFu));
  return r;
}
template <>
__device__ __forceinline__ uint32_t absmax2<F16>(uint32_t acc, uint32_t w) {
  uint32_t r;
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(acc), "r"(w & 0x7FFF7FFFu));
  return r;
}

// max |x| over this thread's chunks (0 for padding).
template <typename T, int D>
__device__ __forceinline__ float thread_amax(const uint4 (&v)[Tile<D>::kPasses][2]) {
  uint32_t m = 0;
#pragma unroll
  for (int p = 0; p < Tile<D>::kPasses; ++p) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      m = absmax2<T>(m, v[p][j].x);
      m = absmax2<T>(m, v[p][j].y);
      m = absmax2<T>(m, v[p][j].z);
      m = absmax2<T>(m, v[p][j].w);
    }
  }
  const float2 f = unpack2<T>(m);
  return fmaxf(f.x, f.y);
}

// Max over the CTA; every thread gets the result. `red` holds kWarps floats.
template <int D>
__device__ __forceinline__ float block_max(float m, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int i = 1; i < Tile<D>::kWarps; ++i) m = fmaxf(m, red[i]);
  return m;
}

// Section 1 scales, one FP32 division each (IEEE: this file is never built with fast math). A tiny
// group (448 / amax overflows: amax below ~1.3e-36, BF16 subnormals) is all zeros: scale_inv 0 and
// descale 0, so no code becomes NaN through an infinite scale (0 * inf). A group holding Inf has
// amax Inf: scale_inv 0, descale Inf (its (batch, head) output is non-finite, numerics section 1).
__device__ __forceinline__ bool tiny_group(float amax) { return amax > 0.0f && __fdiv_rn(kE4M3Max, amax) == INFINITY; }
__device__ __forceinline__ float descale_of(float amax) { return tiny_group(amax) ? 0.0f : __fdiv_rn(amax, kE4M3Max); }
__device__ __forceinline__ float scale_inv_of(float amax) {
  return amax > 0.0f && !tiny_group(amax) ? __fdiv_rn(kE4M3Max, amax) : 0.0f;
}

// 16 elements -> 16 codes: E4M3(float(x) * scale_inv), one rounded FP32 multiply per element.
template <typename T>
__device__ __forceinline__ uint4 encode_chunk(const uint4 (&v)[2], float s) {
  const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 lo = unpack2<T>(w[2 * i]), hi = unpack2<T>(w[2 * i + 1]);
    c[i] = detail::e4m3_encode4(__fmul_rn(lo.x, s), __fmul_rn(lo.y, s), __fmul_rn(hi.x, s),
                                __fmul_rn(hi.y, s));
  }
  return make_uint4(c[0], c[1], c[2], c[3]);
}

// V rounding residuals of one 16-element chunk (numerics section 4, "V rounding bias"), added to acc[i] as the bits
// of fmaf(r, 2^16, 1.5 * 2^23): for |r| <= 16 the float's low bits hold rne(2^16 r) + 0x400000 exactly, so a sum of
// n such words minus n * 0x4B400000 (mod 2^32) is the sum of the fixed-point residuals. r = x - decode(code) is
// exact; a NaN residual (a NaN or Inf input) counts 0, as in reference::v_residual_fixed.
inline constexpr uint32_t kResidualMagicBits = 0x4B400000u;   // 1.5 * 2^23
template <typename T>
__device__ __forceinline__ void add_residuals(const uint4 (&v)[2], float s, uint4 codes, uint32_t (&acc)[16]) {
  const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  const uint32_t c[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 x = unpack2<T>(w[i]);
    const float2 q = detail::e4m3_decode2(static_cast<uint16_t>(c[i / 2] >> (16 * (i % 2))));
    float r0 = __fsub_rn(__fmul_rn(x.x, s), q.x), r1 = __fsub_rn(__fmul_rn(x.y, s), q.y);
    r0 = fabsf(r0) <= 16.0f ? r0 : 0.0f;
    r1 = fabsf(r1) <= 16.0f ? r1 : 0.0f;
    acc[2 * i] += __float_as_uint(__fmaf_rn(r0, 65536.0f, 12582912.0f));
    acc[2 * i + 1] += __float_as_uint(__fmaf_rn(r1, 65536.0f, 12582912.0f));
  }
}

// Flat CTA index -> (head, block, batch), head fastest.
struct CtaCoord {
  int h, blk, b;
};
__device__ __forceinline__ CtaCoord cta_coord(int heads, int nblocks) {
  const int x = static_cast<int>(blockIdx.x);
  const int hb = x / heads;
  return {x - hb * heads, hb % nblocks, hb / nblocks};
}

}  // namespace openvc::prepare
