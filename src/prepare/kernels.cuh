// Preparation kernels (docs/numerics.md sections 1 and 9): BF16/FP16 [B,S,H,D] or packed [total,H,D]
// sequences (cu_seqlens) -> FP8 E4M3 (or INT8 Q/K) codes + descales. "Batch" b below is a sequence:
// batch index, or packed sequence index.
//   quantize_qk_kernel: Q and K, one CTA per (batch, head, 128-token block) of either tensor; it also
//                       zeroes the V amax slot of its (batch, head) and, with the V bias correction, its
//                       residual sums and block count, so no memset launch is needed.
//                       quantize_qk_int8_kernel is its INT8 twin (Q per row, K per key group). With K
//                       smoothing both subtract the channel means of smoothing.cuh's kernels from K.
//   v_amax_kernel:      V, one CTA per (batch, head, 128-token block): block max, then atomicMax on
//                       the float bits (amax >= 0, so unsigned order is float order).
//   v_pack_kernel:      V, one CTA per (batch, head, 128-token block): codes with the per-head scale,
//                       transposed through shared memory to [B,H,D,Sk_pad] in kPackedKeyOrder.
// Packed sequences: the grid covers ceil(max_seqlen/128) blocks of every sequence; a CTA whose block
// starts at or past its sequence's end writes only what the layout needs there (a zero Q/K descale,
// zero packed-V padding) and exits. With cu_seqlens null every block is in range (batched).
// Programmatic launches (common/pdl.cuh): v_amax_kernel and v_pack_kernel may start while the kernel before
// them drains; each reads V (complete before quantize_qk_kernel, launched normally, started) first and waits
// for that grid before touching what it wrote.
// The tile walk they share: tile.cuh.
#pragma once
#include <cstdint>

#include <cuda_fp16.h>

#include "common/pdl.cuh"
#include "prepare/tile.cuh"

namespace openvc::prepare {

// ---- K smoothing on the tile (numerics sections 1 and 9) --------------------------------------------
// This thread's 16 channel means (its chunks are always channels 16 * (tid % kChunksPerToken) .. +15).
template <int D>
__device__ __forceinline__ void load_means(const float* mean, float (&m)[16]) {
  const float4* src = reinterpret_cast<const float4*>(mean + 16 * (threadIdx.x % Tile<D>::kChunksPerToken));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = __ldg(src + i);
    m[4 * i] = f.x, m[4 * i + 1] = f.y, m[4 * i + 2] = f.z, m[4 * i + 3] = f.w;
  }
}
// The 16 smoothed values k' = fl(k - mean_c) of one chunk pair (one FP32 subtraction each).
template <typename T>
__device__ __forceinline__ void smoothed_chunk(const uint4 (&v)[2], const float (&m)[16], float (&f)[16]) {
  const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 e = unpack2<T>(w[i]);  // elements 2i, 2i + 1
    f[2 * i] = __fsub_rn(e.x, m[2 * i]);
    f[2 * i + 1] = __fsub_rn(e.y, m[2 * i + 1]);
  }
}
// max |k'| over one chunk pair; fmaxf leaves NaN out, like the reference's amax.
__device__ __forceinline__ float amax16(const float (&f)[16]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) a = fmaxf(a, fabsf(f[i]));
  return a;
}
// 16 smoothed values -> 16 E4M3 codes of fl(k' * scale_inv).
__device__ __forceinline__ uint4 encode16_e4m3(const float (&f)[16], float s) {
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    c[i] = detail::e4m3_encode4(__fmul_rn(f[4 * i], s), __fmul_rn(f[4 * i + 1], s), __fmul_rn(f[4 * i + 2], s),
                                __fmul_rn(f[4 * i + 3], s));
  return make_uint4(c[0], c[1], c[2], c[3]);
}

// K smoothing shifts each score of query row i by -softmax_scale * (q_i . mean(K)), so the LSE of attention on
// the smoothed keys is the exact one minus that term (numerics section 9). With args.q_dot_k_mean set, the Q
// blocks write q_i . mean(K) for every row of their tile: FP32, this thread's 16 channels in channel order
// (one FMA each) then a butterfly sum over the row's kChunksPerToken lanes. Layout of the LSE: batched
// [B, H, seqlen_q], packed [H, total_q] (rows no sequence covers are not written).
template <typename T, int D>
__device__ __forceinline__ void write_q_dot_k_mean(const QkArgs& args, const SeqSpan& span, const CtaCoord& c, int token0,
                                                   const uint4 (&v)[Tile<D>::kPasses][2]) {
  using TL = Tile<D>;
  constexpr int kC = TL::kChunksPerToken;
  const TokenArgs& q = args.side[0].in;
  float m[16];
  const int g = args.kv_group;   // GQA: query head h takes the means of K/V head h / g
  load_means<D>(args.k_mean + (static_cast<int64_t>(c.b) * (args.heads / g) + c.h / g) * D, m);
  const int t = threadIdx.x / kC, sub = threadIdx.x % kC;
  const int valid = span.len - token0;
  float* out = args.q_dot_k_mean + token0 +
               (q.cu_seqlens != nullptr ? c.h * q.total + span.row0
                                        : (static_cast<int64_t>(c.b) * args.heads + c.h) * q.seqlen);
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    const uint32_t w[8] = {v[p][0].x, v[p][0].y, v[p][0].z, v[p][0].w, v[p][1].x, v[p][1].y, v[p][1].z, v[p][1].w};
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 e = unpack2<T>(w[i]);
      acc = fmaf(e.x, m[2 * i], acc);
      acc = fmaf(e.y, m[2 * i + 1], acc);
    }
#pragma unroll
    for (int o = 1; o < kC; o <<= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
    const int r = t + p * TL::kTokenStep;
    if (sub == 0 && r < valid) out[r] = acc;
  }
}

// What the Q/K grid zeroes for the kernels after it, so that no memset launch is needed: the V amax slot and (with
// the V bias correction) the residual sums and block count of the CTA's (batch, head), by its first block; and
// QkArgs::zero_words, by the first CTA.
template <int D>
__device__ __forceinline__ void zero_slots(const QkArgs& args, const CtaCoord& c) {
  if (c.blk == 0 && threadIdx.x == 0) args.v_amax[c.b * args.heads + c.h] = 0u;
  if (args.v_residual_sums != nullptr && c.blk == 0 && threadIdx.x < D) {
    args.v_residual_sums[(int64_t(c.b) * args.heads + c.h) * D + threadIdx.x] = 0ull;
    if (threadIdx.x == 0) args.v_arrivals[c.b * args.heads + c.h] = 0u;
  }
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    for (int i = threadIdx.x; i < args.zero_count; i += blockDim.x) args.zero_words[i] = 0;
}

// ---- (1) Q and K per-block quantization -----------------------------------------------------------
// Blocks [0, nq) of each (batch, head) are Q's, [nq, nq + nk) K's. kSmooth: K is smoothed with
// args.k_mean (padding tokens are left out of the amax explicitly: 0 - mean is not 0). kCache (never with
// kSmooth): K read in two parts and written with a KV cache's strides (tile.cuh, CacheArgs).
template <typename T, int D, bool kSmooth, bool kCache = false>
__global__ void __launch_bounds__(Tile<D>::kThreads, Tile<D>::kMinCtas)
    quantize_qk_kernel(const __grid_constant__ QkArgs args) {
  static_assert(!(kSmooth && kCache), "a KV cache's preparation has no K smoothing");
  using TL = Tile<D>;
  __shared__ float red[TL::kWarps];
  const CtaCoord c = cta_coord(args.heads, args.side[0].nblocks + args.side[1].nblocks);
  const int which = c.blk >= args.side[0].nblocks ? 1 : 0;
  const QkSide& s = args.side[which];
  const int blk = c.blk - (which ? args.side[0].nblocks : 0);
  const int token0 = blk * kBlockTokens;
  const bool cache_k = kCache && which == 1;   // a CTA-uniform branch of the kCache kernels
  allow_dependent_launch();   // v_amax_kernel may start (it waits for this grid before its atomics)
  zero_slots<D>(args, c);
  const int descale_blocks = cache_k ? args.cache.k_blocks : s.nblocks;
  float* descale = s.descale + (static_cast<int64_t>(c.b) * args.heads + c.h) * descale_blocks + blk;
  const SeqSpan span = seq_span(s.in, c.b);
  if (token0 >= span.len) {  // past a packed sequence's end: no tokens, descale 0
    if (threadIdx.x == 0) *descale = 0.0f;
    return;
  }

  uint4 v[TL::kPasses][2];
  if (cache_k) {
    load_tile_two_part<D, true>(s.in, args.cache.k_prefix, args.cache.prefix_len, span, c.b, c.h, token0, v);
  } else {
    load_tile<D, true>(s.in, span, c.h, token0, v);
  }
  const int t = threadIdx.x / TL::kChunksPerToken;
  const int sub = threadIdx.x % TL::kChunksPerToken;
  const int valid = span.len - token0;
  // codes [total, H, D] contiguous ([B, S, H, D] when batched; a cache's K: [B, k_rows, H, D]): token row
  // stride H*D bytes.
  const int64_t row0 = cache_k ? static_cast<int64_t>(c.b) * args.cache.k_rows : span.row0;
  uint8_t* out = s.codes + ((row0 + token0 + t) * args.heads + c.h) * D + 16 * sub;
  const int64_t row = static_cast<int64_t>(args.heads) * D;
  if (kSmooth && which == 1) {  // smoothed K (a CTA-uniform branch)
    float m[16];
    load_means<D>(args.k_mean + (static_cast<int64_t>(c.b) * args.heads + c.h) * D, m);
    float a = 0.0f;
#pragma unroll
    for (int p = 0; p < TL::kPasses; ++p) {
      if (t + p * TL::kTokenStep < valid) {
        float f[16];
        smoothed_chunk<T>(v[p], m, f);
        a = fmaxf(a, amax16(f));
      }
    }
    const float amax = block_max<D>(a, red);
    const float scale_inv = scale_inv_of(amax);
    if (threadIdx.x == 0) *descale = descale_of(amax);
#pragma unroll
    for (int p = 0; p < TL::kPasses; ++p) {
      if (t + p * TL::kTokenStep < valid) {
        float f[16];
        smoothed_chunk<T>(v[p], m, f);
        *reinterpret_cast<uint4*>(out + p * TL::kTokenStep * row) = encode16_e4m3(f, scale_inv);
      }
    }
    return;
  }
  if constexpr (kSmooth)
    if (which == 0 && args.q_dot_k_mean != nullptr) write_q_dot_k_mean<T, D>(args, span, c, token0, v);
  const float amax = block_max<D>(thread_amax<T, D>(v), red);
  const float scale_inv = scale_inv_of(amax);
  if (threadIdx.x == 0) *descale = descale_of(amax);
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    if (t + p * TL::kTokenStep < valid)
      *reinterpret_cast<uint4*>(out + p * TL::kTokenStep * row) = encode_chunk<T>(v[p], scale_inv);
  }
}

// ---- (1b) INT8 Q per row and K per (block, key group) (numerics section 9) ----------------------------
// Section 9 scales: 127 / amax and amax / 127, the group all zeros where 127 / amax overflows.
__device__ __forceinline__ float int8_scale_inv(float amax) {
  const float s = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  return s == INFINITY ? 0.0f : s;
}
__device__ __forceinline__ float int8_descale(float amax) {
  return amax > 0.0f && __fdiv_rn(127.0f, amax) == INFINITY ? 0.0f : __fdiv_rn(amax, 127.0f);
}
// clamp(rne(x), -127, 127); NaN -> 0 (cvt.rni gives 0 for NaN), as the byte of an int8.
__device__ __forceinline__ uint32_t int8_byte(float x) {
  return static_cast<uint32_t>(min(max(__float2int_rn(x), -127), 127)) & 0xFFu;
}
// 16 elements -> 16 INT8 codes of fl(float(x) * scale_inv).
template <typename T>
__device__ __forceinline__ uint4 encode_chunk_int8(const uint4 (&v)[2], float s) {
  const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 lo = unpack2<T>(w[2 * i]), hi = unpack2<T>(w[2 * i + 1]);
    c[i] = int8_byte(__fmul_rn(lo.x, s)) | int8_byte(__fmul_rn(lo.y, s)) << 8 | int8_byte(__fmul_rn(hi.x, s)) << 16 |
           int8_byte(__fmul_rn(hi.y, s)) << 24;
  }
  return make_uint4(c[0], c[1], c[2], c[3]);
}
// max |x| over one 16-element chunk pair (0 for padding).
template <typename T>
__device__ __forceinline__ float chunk_amax(const uint4 (&v)[2]) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    m = absmax2<T>(m, v[j].x);
    m = absmax2<T>(m, v[j].y);
    m = absmax2<T>(m, v[j].z);
    m = absmax2<T>(m, v[j].w);
  }
  const float2 f = unpack2<T>(m);
  return fmaxf(f.x, f.y);
}
// 16 smoothed values -> 16 INT8 codes of fl(k' * scale_inv).
__device__ __forceinline__ uint4 encode16_int8(const float (&f)[16], float s) {
  uint32_t c[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    c[i] = int8_byte(__fmul_rn(f[4 * i], s)) | int8_byte(__fmul_rn(f[4 * i + 1], s)) << 8 |
           int8_byte(__fmul_rn(f[4 * i + 2], s)) << 16 | int8_byte(__fmul_rn(f[4 * i + 3], s)) << 24;
  return make_uint4(c[0], c[1], c[2], c[3]);
}

inline constexpr int kKeyGroups = 8;  // == kInt8KeyGroups: K descales per 128-key block

// The grid and tile walk of quantize_qk_kernel (batched or packed, key counts, D = 64 or 128).
// Q blocks: each token row's D elements are spread over kChunksPerToken neighbouring lanes, whose
// shuffle max is the row's amax; q descale [G, H, seqlen] (seqlen = max_seqlen_q when packed), row i at
// (b * H + h) * seqlen + i, 0 for rows in [len, seqlen) of a shorter sequence.
// K blocks: one group per (block, key group), g = ((c mod 8) / 2) + 4 * (c / 64) for key c of the block.
// Thread tid holds tokens t + 32 p (t = tid / kChunksPerToken, p = 0..3), so its passes 0, 1 are group
// (t mod 8) / 2 and passes 2, 3 group (t mod 8) / 2 + 4: a shuffle over the lanes of the token pair
// {t, t ^ 1} (same groups), one shared slot per pair, and each group the max of its 4 pairs. k descale
// [G, H, nblocks, 8] (kCache: [B, H, cache.k_blocks, 8]); groups without a valid key (past the end or the key
// count) get 0. kSmooth: K is smoothed with args.k_mean first.
template <typename T, int D, bool kSmooth, bool kCache = false>
__global__ void __launch_bounds__(Tile<D>::kThreads, Tile<D>::kMinCtas)
    quantize_qk_int8_kernel(const __grid_constant__ QkArgs args) {
  static_assert(!(kSmooth && kCache), "a KV cache's preparation has no K smoothing");
  using TL = Tile<D>;
  constexpr int kC = TL::kChunksPerToken;
  static_assert(TL::kPasses == 4 && TL::kTokenStep == 32, "passes 0-1 are keys < 64, passes 2-3 keys >= 64");
  __shared__ float pair_max[2][16];  // [passes 0-1 / 2-3][token pair t / 2]
  const CtaCoord c = cta_coord(args.heads, args.side[0].nblocks + args.side[1].nblocks);
  const int which = c.blk >= args.side[0].nblocks ? 1 : 0;
  const QkSide& s = args.side[which];
  const int blk = c.blk - (which ? args.side[0].nblocks : 0);
  const int token0 = blk * kBlockTokens;
  allow_dependent_launch();   // as in quantize_qk_kernel
  zero_slots<D>(args, c);
  const SeqSpan span = seq_span(s.in, c.b);
  const int t = threadIdx.x / kC;
  const int sub = threadIdx.x % kC;
  const int valid = span.len - token0;
  const int64_t bh = static_cast<int64_t>(c.b) * args.heads + c.h;
  // kCache: K's codes and descales with the cache's strides (CacheArgs), K read in two parts.
  const int64_t row0 = kCache && which == 1 ? static_cast<int64_t>(c.b) * args.cache.k_rows : span.row0;
  uint8_t* out = s.codes + ((row0 + token0 + t) * args.heads + c.h) * D + 16 * sub;
  const int64_t row = static_cast<int64_t>(args.heads) * D;
  if (which == 1) {  // K (a CTA-uniform branch)
    float* descale = s.descale + (bh * (kCache ? args.cache.k_blocks : s.nblocks) + blk) * kKeyGroups;
    if (valid <= 0) {  // past the sequence's end or its key count: no key, descales 0
      if (threadIdx.x < kKeyGroups) descale[threadIdx.x] = 0.0f;
      return;
    }
    uint4 v[TL::kPasses][2];
    if constexpr (kCache) {
      load_tile_two_part<D, true>(s.in, args.cache.k_prefix, args.cache.prefix_len, span, c.b, c.h, token0, v);
    } else {
      load_tile<D, true>(s.in, span, c.h, token0, v);
    }
    float m[16] = {};
    if constexpr (kSmooth) load_means<D>(args.k_mean + bh * D, m);
    float amax[2] = {0.0f, 0.0f};  // groups (t mod 8) / 2 (passes 0, 1) and that + 4 (passes 2, 3)
#pragma unroll
    for (int p = 0; p < TL::kPasses; ++p) {
      if (t + p * TL::kTokenStep < valid) {
        float a;
        if constexpr (kSmooth) {
          float f[16];
          smoothed_chunk<T>(v[p], m, f);
          a = amax16(f);
        } else {
          a = chunk_amax<T>(v[p]);
        }
        amax[p / 2] = fmaxf(amax[p / 2], a);
      }
    }
    // Lanes [2 kC * (t / 2), 2 kC * (t / 2 + 1)) hold the tokens t and t ^ 1 of one pair.
#pragma unroll
    for (int o = 1; o < 2 * kC; o <<= 1) {
      amax[0] = fmaxf(amax[0], __shfl_xor_sync(0xFFFFFFFFu, amax[0], o));
      amax[1] = fmaxf(amax[1], __shfl_xor_sync(0xFFFFFFFFu, amax[1], o));
    }
    if ((threadIdx.x & (2 * kC - 1)) == 0) {
      pair_max[0][t >> 1] = amax[0];
      pair_max[1][t >> 1] = amax[1];
    }
    __syncthreads();
    // Group g (< 4: passes 0-1, >= 4: passes 2-3) is token pairs P with P mod 4 = g mod 4.
    auto group_max = [&](int g) {
      const float* pm = pair_max[g >> 2];
      const int q = g & 3;
      return fmaxf(fmaxf(pm[q], pm[q + 4]), fmaxf(pm[q + 8], pm[q + 12]));
    };
    if (threadIdx.x < kKeyGroups) descale[threadIdx.x] = int8_descale(group_max(threadIdx.x));
    const int g0 = (t & 7) >> 1;
    const float scale_inv[2] = {int8_scale_inv(group_max(g0)), int8_scale_inv(group_max(g0 + 4))};
#pragma unroll
    for (int p = 0; p < TL::kPasses; ++p) {
      if (t + p * TL::kTokenStep < valid) {
        uint4 code;
        if constexpr (kSmooth) {
          float f[16];
          smoothed_chunk<T>(v[p], m, f);
          code = encode16_int8(f, scale_inv[p / 2]);
        } else {
          code = encode_chunk_int8<T>(v[p], scale_inv[p / 2]);
        }
        *reinterpret_cast<uint4*>(out + p * TL::kTokenStep * row) = code;
      }
    }
    return;
  }
  // Q: one group per row.
  uint4 v[TL::kPasses][2];
  load_tile<D, true>(s.in, span, c.h, token0, v);
  if constexpr (kSmooth)
    if (args.q_dot_k_mean != nullptr) write_q_dot_k_mean<T, D>(args, span, c, token0, v);
  float* descale = s.descale + bh * s.in.seqlen;
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    float amax = chunk_amax<T>(v[p]);
#pragma unroll
    for (int o = 1; o < kC; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const int r = token0 + t + p * TL::kTokenStep;  // row of the sequence
    if (t + p * TL::kTokenStep < valid) {
      if (sub == 0 && r < s.in.seqlen) descale[r] = int8_descale(amax);
      *reinterpret_cast<uint4*>(out + p * TL::kTokenStep * row) = encode_chunk_int8<T>(v[p], int8_scale_inv(amax));
    } else if (sub == 0 && r < s.in.seqlen) {
      descale[r] = 0.0f;  // past a shorter packed sequence's end
    }
  }
}

// ---- (2) V amax per (batch, head) -----------------------------------------------------------------
// kCache: V read in two parts (tile.cuh, CacheArgs).
template <typename T, int D, bool kCache = false>
__global__ void __launch_bounds__(Tile<D>::kThreads, Tile<D>::kMinCtas)
    v_amax_kernel(const __grid_constant__ VArgs args) {
  using TL = Tile<D>;
  __shared__ float red[TL::kWarps];
  allow_dependent_launch();   // v_pack_kernel may start (it waits for this grid before reading the maxima)
  const CtaCoord c = cta_coord(args.heads, args.nblocks);
  const SeqSpan span = seq_span(args.in, c.b);
  const int token0 = c.blk * kBlockTokens;
  float amax = 0.0f;   // past a packed sequence's end: nothing to add
  if (token0 < span.len) {
    uint4 v[TL::kPasses][2];
    // Cached loads: the pack kernel reads V again, and the tail of V may still be in L2 then.
    if constexpr (kCache) {
      load_tile_two_part<D, false>(args.in, args.cache.v_prefix, args.cache.prefix_len, span, c.b, c.h, token0, v);
    } else {
      load_tile<D, false>(args.in, span, c.h, token0, v);
    }
    amax = block_max<D>(thread_amax<T, D>(v), red);
  }
  // Launched programmatically after quantize_qk_kernel (prepare.cu): V was complete before that grid started,
  // so the reads above overlap its tail; the slot it zeroes is ours only once it has finished. Every CTA waits,
  // also one without tokens: this grid then ends after quantize_qk_kernel's, and v_pack_kernel and the attention
  // kernel, which wait for the grid before them only, see its codes and zeroed slots too.
  wait_for_prior_grid();
  // The slot starts at 0 (quantize_qk_kernel), so a zero block has nothing to add.
  if (threadIdx.x == 0 && amax > 0.0f) atomicMax(&args.v_amax[c.b * args.heads + c.h], __float_as_uint(amax));
}

// ---- (3) V cast + transpose + key permutation -----------------------------------------------------
// Shared tile: 128 token rows of D code bytes. The 16-byte chunk `sub` of row r is stored at chunk
// sub ^ ((r >> 4) & (kChunksPerToken - 1)): the writes (one row's chunks per quarter warp) and the
// transposed reads (8 key groups x 4 columns per warp) then hit distinct banks for D = 128
// (D = 64: 2-way on the reads, its rows being only 16 words wide).
// kCache: V read in two parts and, with CacheArgs::v_descale_blocks, one V descale per block (the head's, at
// each of the call's blocks: a KV cache's per-block layout); sk_pad is then the cache's slots per row.
// The last of a sequence's blocks to add its residual sums (a count per (batch, head)) writes
// v_bias = (float)(v_descale * R * 2^-16 / keys), in double, for every channel. One thread fences: the barrier
// orders the block's sum atomics before its fence (PTX fences are cumulative), the fence before the count (release),
// and in the last block the count before the fence and the barrier before the sums' reads (acquire).
template <int D>
__device__ __forceinline__ void finish_v_bias(const VArgs& args, int64_t bh, int keys, float amax) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int blocks = (keys + kBlockTokens - 1) / kBlockTokens;
    __threadfence();
    last = atomicAdd(args.v_arrivals + bh, 1u) == static_cast<unsigned>(blocks - 1);
    __threadfence();
  }
  __syncthreads();
  if (!last || threadIdx.x >= D) return;
  const long long r = static_cast<long long>(atomicAdd(args.v_residual_sums + bh * D + threadIdx.x, 0ull));
  args.v_bias[bh * D + threadIdx.x] =
      static_cast<float>(static_cast<double>(descale_of(amax)) * static_cast<double>(r) * (1.0 / 65536.0) /
                         static_cast<double>(keys));
}

// kResidual (VArgs::v_bias, never with kCache): the block's V rounding residual sums per channel (numerics section 4,
// "V rounding bias") are added to the (batch, head)'s int64 sums (exact integer sums: the order of the CTAs' atomics
// does not change them), and the sequence's last block to finish turns them into v_bias.
// (One CTA per SM fewer with it: its 16 sums beside the loaded tile fit the registers without a spill.)
template <typename T, int D, bool kCache = false, bool kResidual = false>
__global__ void __launch_bounds__(Tile<D>::kThreads, kResidual ? Tile<D>::kMinCtas - 1 : Tile<D>::kMinCtas)
    v_pack_kernel(const __grid_constant__ VArgs args) {
  static_assert(!(kCache && kResidual), "a KV cache's preparation writes no V residual sums");
  using TL = Tile<D>;
  constexpr int kC = TL::kChunksPerToken;
  constexpr int kWords = D / 4;  // 32-bit words per tile row
  __shared__ alignas(16) uint32_t tile[kBlockTokens * kWords];
  __shared__ int warp_residuals[kResidual ? TL::kWarps : 1][kResidual ? D : 1];
  allow_dependent_launch();   // the attention kernel may start (it waits for this grid first)
  const CtaCoord c = cta_coord(args.heads, args.nblocks);
  const int token0 = c.blk * kBlockTokens;
  const int64_t bh = static_cast<int64_t>(c.b) * args.heads + c.h;
  // Thread (g, w) stores dims 4w..4w+3 of the 16 packed columns of key group g (phase 2 below).
  const int g = threadIdx.x & 7;
  const int w = threadIdx.x >> 3;
  const SeqSpan span = seq_span(args.in, c.b);
  const bool in_sequence = token0 < span.len;   // else past a packed sequence's end: all zero padding
  uint4 v[TL::kPasses][2];
  // Launched programmatically after v_amax_kernel (prepare.cu): V was complete before the preparation's first
  // kernel started, so this load overlaps that grid's tail; the maxima are final only once it has finished.
  if (in_sequence) {
    if constexpr (kCache) {
      load_tile_two_part<D, true>(args.in, args.cache.v_prefix, args.cache.prefix_len, span, c.b, c.h, token0, v);
    } else {
      load_tile<D, true>(args.in, span, c.h, token0, v);
    }
  }
  wait_for_prior_grid();
  const float amax = __uint_as_float(args.v_amax[bh]);
  // Block 0 always exists, even for an empty packed sequence (amax 0: descale 0).
  if constexpr (kCache) {
    if (threadIdx.x == 0 && args.cache.v_descale_blocks > 0)
      args.v_descale[bh * args.cache.v_descale_blocks + c.blk] = descale_of(amax);
    else if (threadIdx.x == 0 && c.blk == 0)
      args.v_descale[bh] = descale_of(amax);
  } else {
    if (c.blk == 0 && threadIdx.x == 0) args.v_descale[bh] = descale_of(amax);
  }
  if (!in_sequence) {
    if constexpr (kResidual) {   // a sequence without keys: no block adds to its sums, and its bias is 0
      if (span.len == 0 && c.blk == 0 && threadIdx.x < D) args.v_bias[bh * D + threadIdx.x] = 0.0f;
    }
    uint8_t* dst = args.v_packed + (bh * D + 4 * w) * args.sk_pad + token0 + 16 * g;
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<uint4*>(dst + i * args.sk_pad) = make_uint4(0, 0, 0, 0);
    return;
  }
  const float scale_inv = scale_inv_of(amax);

  // Phase 1: codes into the swizzled tile. Padding tokens (loaded as 0) become code 0 (and residual 0).
  {
    const int t = threadIdx.x / kC;
    const int sub = threadIdx.x % kC;
    uint32_t acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0u;
#pragma unroll
    for (int p = 0; p < TL::kPasses; ++p) {
      const int r = t + p * TL::kTokenStep;
      const uint4 codes = encode_chunk<T>(v[p], scale_inv);
      reinterpret_cast<uint4*>(tile)[r * kC + (sub ^ ((r >> 4) & (kC - 1)))] = codes;
      if constexpr (kResidual) add_residuals<T>(v[p], scale_inv, codes, acc);
    }
    if constexpr (kResidual) {
      // The lanes of a warp that share `sub` hold the same 16 channels: sum them, then one lane per sub writes.
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        acc[i] -= TL::kPasses * kResidualMagicBits;
#pragma unroll
        for (int o = kC; o < 32; o <<= 1) acc[i] += __shfl_xor_sync(0xFFFFFFFFu, acc[i], o);
      }
      if ((threadIdx.x & 31) < kC) {
#pragma unroll
        for (int i = 0; i < 16; ++i) warp_residuals[threadIdx.x >> 5][16 * sub + i] = static_cast<int>(acc[i]);
      }
    }
  }
  __syncthreads();
  if constexpr (kResidual) {
    // |sum| <= 128 keys * 2^20 fits int32; the sequence's total over its blocks is int64.
    if (threadIdx.x < D) {
      int sum = 0;
#pragma unroll
      for (int w8 = 0; w8 < TL::kWarps; ++w8) sum += warp_residuals[w8][threadIdx.x];
      atomicAdd(args.v_residual_sums + bh * D + threadIdx.x, static_cast<unsigned long long>(static_cast<long long>(sum)));
    }
    // The keys this grid summed: a packed sequence longer than max_seqlen_k is cut to its blocks (as attention
    // cuts it), so the count of arriving blocks and the divisor match them.
    finish_v_bias<D>(args, bh, min(span.len, args.nblocks * kBlockTokens), amax);
  }

  // Phase 2: thread (g, w) owns dims 4w..4w+3 of the keys of 16-key group g. It gathers the 16 words
  // (4 dims each) of its keys in packed order, transposes them 4x4 bytes at a time, and writes 16
  // packed keys per dim. A warp's 8 groups cover a row's 128 keys: each store fills whole lines.
  const int col = 4 * ((w >> 2) ^ (g & (kC - 1))) + (w & 3);
  uint32_t k[16];
#pragma unroll
  for (int kappa = 0; kappa < 16; ++kappa) k[kappa] = tile[(16 * g + packed_key(kappa)) * kWords + col];
  uint32_t out[4][4];  // [dim i][key quad q]: byte n = packed key 4q + n, dim 4w + i
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t t0 = __byte_perm(k[4 * q], k[4 * q + 1], 0x5140);      // a0 b0 a1 b1
    const uint32_t t1 = __byte_perm(k[4 * q], k[4 * q + 1], 0x7362);      // a2 b2 a3 b3
    const uint32_t t2 = __byte_perm(k[4 * q + 2], k[4 * q + 3], 0x5140);  // c0 d0 c1 d1
    const uint32_t t3 = __byte_perm(k[4 * q + 2], k[4 * q + 3], 0x7362);  // c2 d2 c3 d3
    out[0][q] = __byte_perm(t0, t2, 0x5410);  // a0 b0 c0 d0
    out[1][q] = __byte_perm(t0, t2, 0x7632);  // a1 b1 c1 d1
    out[2][q] = __byte_perm(t1, t3, 0x5410);
    out[3][q] = __byte_perm(t1, t3, 0x7632);
  }
  uint8_t* dst = args.v_packed + (bh * D + 4 * w) * args.sk_pad + token0 + 16 * g;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    *reinterpret_cast<uint4*>(dst + i * args.sk_pad) = make_uint4(out[i][0], out[i][1], out[i][2], out[i][3]);
}

}  // namespace openvc::prepare
