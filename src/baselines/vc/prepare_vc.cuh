// Kernels of the VC per-call preparation (numerics section 7, V-Smooth), given a permutation; bit-identical
// to reference::vc_prepare. They reuse the tile walk, amax and encoding helpers of src/prepare/tile.cuh
// (2*D threads, four 16-element chunks per thread); K and V rows are gathered through the permutation.
//   vc_qk_kernel:    Q per 128-token block (original order) and permuted K per 128-row block; it also
//                    zeroes the (batch, head) slots of the per-channel residual amax.
//   vc_vmean_kernel: per 128-row block of the permuted V: mean per channel (double sequential sum /
//                    rows -> float -> BF16), stored unscaled in block_mean_scaled for the next kernel,
//                    and atomicMax of the residual |v - mu| per channel (order-independent).
//   vc_vpack_kernel: per block: channel scales from the amax, block_mean_scaled = mu / descale, residual
//                    codes E4M3((v - mu) * scale_inv_c), transposed to the packed V layout.
#pragma once
#include <cstdint>

#include "common/e4m3.cuh"
#include "prepare/tile.cuh"

namespace openvc::vcprep {

using prepare::kBlockTokens;
using prepare::SeqSpan;
using prepare::Tile;
using prepare::TokenArgs;

struct QkArgs {
  TokenArgs q, k;        // batched views (cu_seqlens null)
  int heads, nq, nk;
  uint8_t* q_codes;
  float* q_descale;      // [B, H, nq]
  uint8_t* k_codes;      // [B, Sk, H, D], permuted
  float* k_descale;      // [B, H, nk]
  const int* perm;       // [B, H, Sk]
  uint32_t* amax;        // [B, H, D] float bits, zeroed here
};

struct VArgs {
  TokenArgs v;
  int heads, nk;
  const int* perm;
  uint32_t* amax;            // [B, H, D]
  float* mean_scaled;        // [B, H, nk, D]
  uint16_t* mean_bf16;       // optional [B, H, nk, D]
  float* channel_descale;    // [B, H, D]
  uint8_t* v_packed;         // [B, H, D, nk * 128]
  int64_t sk_pad;
};

// The tile of rows [token0, token0 + 128) of the permuted sequence of (b, h): row r is original token
// perm[token0 + r]. Rows past the end, and entries outside [0, len), read as zero.
// kStreaming: evict-first loads, for the last read of a tensor (the V means kernel reads V through L2 for
// the packing kernel, as prepare_fp8's V amax kernel does).
template <int D, bool kStreaming>
__device__ __forceinline__ void load_gather(const TokenArgs& a, int b, int h, const int* perm_bh, int token0,
                                            uint4 (&v)[Tile<D>::kPasses][2]) {
  using TL = Tile<D>;
  const int t = threadIdx.x / TL::kChunksPerToken;
  const int sub = threadIdx.x % TL::kChunksPerToken;
  const uint16_t* base = static_cast<const uint16_t*>(a.data) + static_cast<int64_t>(b) * a.stride_batch +
                         static_cast<int64_t>(h) * a.stride_head + 16 * sub;
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    const int pos = token0 + t + p * TL::kTokenStep;
    const int src = pos < a.seqlen ? __ldg(perm_bh + pos) : -1;
    if (src >= 0 && src < a.seqlen) {
      const uint4* s = reinterpret_cast<const uint4*>(base + static_cast<int64_t>(src) * a.stride_seq);
      v[p][0] = kStreaming ? __ldcs(s) : __ldg(s);
      v[p][1] = kStreaming ? __ldcs(s + 1) : __ldg(s + 1);
    } else {
      v[p][0] = v[p][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// ---- (1) Q and permuted K -------------------------------------------------------------------------------
template <typename T, int D>
__global__ void __launch_bounds__(Tile<D>::kThreads, Tile<D>::kMinCtas) vc_qk_kernel(const __grid_constant__ QkArgs a) {
  using TL = Tile<D>;
  __shared__ float red[TL::kWarps];
  const prepare::CtaCoord c = prepare::cta_coord(a.heads, a.nq + a.nk);
  const bool is_k = c.blk >= a.nq;
  const int blk = is_k ? c.blk - a.nq : c.blk;
  const int token0 = blk * kBlockTokens;
  const int64_t bh = static_cast<int64_t>(c.b) * a.heads + c.h;
  if (!is_k && blk == 0 && threadIdx.x < D) a.amax[bh * D + threadIdx.x] = 0u;
  const TokenArgs& in = is_k ? a.k : a.q;

  uint4 v[TL::kPasses][2];
  if (is_k) {
    load_gather<D, true>(in, c.b, c.h, a.perm + bh * in.seqlen, token0, v);
  } else {
    const SeqSpan span = prepare::seq_span(in, c.b);
    prepare::load_tile<D, true>(in, span, c.h, token0, v);
  }
  const float amax = prepare::block_max<D>(prepare::thread_amax<T, D>(v), red);
  const float scale_inv = prepare::scale_inv_of(amax);
  if (threadIdx.x == 0) (is_k ? a.k_descale : a.q_descale)[bh * (is_k ? a.nk : a.nq) + blk] = prepare::descale_of(amax);

  const int t = threadIdx.x / TL::kChunksPerToken;
  const int sub = threadIdx.x % TL::kChunksPerToken;
  const int valid = in.seqlen - token0;
  uint8_t* out = (is_k ? a.k_codes : a.q_codes) +
                 ((static_cast<int64_t>(c.b) * in.seqlen + token0 + t) * a.heads + c.h) * D + 16 * sub;
  const int64_t row = static_cast<int64_t>(a.heads) * D;
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    if (t + p * TL::kTokenStep < valid)
      *reinterpret_cast<uint4*>(out + p * TL::kTokenStep * row) = prepare::encode_chunk<T>(v[p], scale_inv);
  }
}

// Staging of a gathered tile in shared memory: raw 16-bit words, row r at chunk index r * kChunks.
template <int D>
__device__ __forceinline__ void stage_tile(const uint4 (&v)[Tile<D>::kPasses][2], uint4* tile) {
  using TL = Tile<D>;
  constexpr int kC = 2 * TL::kChunksPerToken;  // 16-byte chunks per row
  const int t = threadIdx.x / TL::kChunksPerToken;
  const int sub = threadIdx.x % TL::kChunksPerToken;
#pragma unroll
  for (int p = 0; p < TL::kPasses; ++p) {
    const int r = t + p * TL::kTokenStep;
    tile[r * kC + 2 * sub] = v[p][0];
    tile[r * kC + 2 * sub + 1] = v[p][1];
  }
}

// reference::round_to_bf16 bit for bit (NaN kept quiet with its sign and upper payload).
__device__ __forceinline__ float round_to_bf16(float x) {
  uint32_t bits = __float_as_uint(x);
  if (x != x) {
    bits = (bits | 0x00400000u) & 0xFFFF0000u;
  } else {
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    bits &= 0xFFFF0000u;
  }
  return __uint_as_float(bits);
}

// ---- (2) block means and residual amax ------------------------------------------------------------------
template <typename T, int D>
__global__ void __launch_bounds__(Tile<D>::kThreads, Tile<D>::kMinCtas) vc_vmean_kernel(const __grid_constant__ VArgs a) {
  using TL = Tile<D>;
  __shared__ alignas(16) uint16_t tile[kBlockTokens * D];
  const prepare::CtaCoord c = prepare::cta_coord(a.heads, a.nk);
  const int64_t bh = static_cast<int64_t>(c.b) * a.heads + c.h;
  const int token0 = c.blk * kBlockTokens;
  uint4 v[TL::kPasses][2];
  load_gather<D, false>(a.v, c.b, c.h, a.perm + bh * a.v.seqlen, token0, v);
  stage_tile<D>(v, reinterpret_cast<uint4*>(tile));
  __syncthreads();
  const int rows = min(kBlockTokens, a.v.seqlen - token0);
  const int ch = threadIdx.x;
  if (ch >= D) return;
  // Double, in row order, like the reference: the sum of up to 128 16-bit values is not always exact.
  double sum = 0.0;
  for (int r = 0; r < rows; ++r) sum = __dadd_rn(sum, static_cast<double>(prepare::unpack2<T>(tile[r * D + ch]).x));
  const float mu = round_to_bf16(__double2float_rn(__ddiv_rn(sum, static_cast<double>(rows))));
  float amax = 0.0f;
  for (int r = 0; r < rows; ++r) amax = fmaxf(amax, fabsf(__fsub_rn(prepare::unpack2<T>(tile[r * D + ch]).x, mu)));
  const int64_t m = (bh * a.nk + c.blk) * D + ch;
  a.mean_scaled[m] = mu;  // unscaled until vc_vpack_kernel knows the channel scale
  if (a.mean_bf16 != nullptr) a.mean_bf16[m] = static_cast<uint16_t>(__float_as_uint(mu) >> 16);
  // amax >= 0, so the unsigned order of the bits is the float order; a zero adds nothing.
  if (amax > 0.0f) atomicMax(&a.amax[bh * D + ch], __float_as_uint(amax));
}

// ---- (3) residual codes, packed ----------------------------------------------------------------------------
// Phase 2 is the transpose of prepare::v_pack_kernel (same swizzle, same byte permutes).
template <typename T, int D>
__global__ void __launch_bounds__(Tile<D>::kThreads, Tile<D>::kMinCtas) vc_vpack_kernel(const __grid_constant__ VArgs a) {
  using TL = Tile<D>;
  constexpr int kC = TL::kChunksPerToken;
  constexpr int kWords = D / 4;
  __shared__ alignas(16) uint32_t tile[kBlockTokens * kWords];
  __shared__ float s_mu[D], s_inv[D];
  const prepare::CtaCoord c = prepare::cta_coord(a.heads, a.nk);
  const int64_t bh = static_cast<int64_t>(c.b) * a.heads + c.h;
  const int token0 = c.blk * kBlockTokens;
  if (threadIdx.x < D) {
    const int ch = threadIdx.x;
    const float amax = __uint_as_float(a.amax[bh * D + ch]);
    const float descale = amax > 0.0f && !prepare::tiny_group(amax) ? prepare::descale_of(amax) : 1.0f;  // all-zero (or tiny) residual: codes 0
    const int64_t m = (bh * a.nk + c.blk) * D + ch;
    const float mu = a.mean_scaled[m];
    s_mu[ch] = mu;
    s_inv[ch] = prepare::scale_inv_of(amax);
    a.mean_scaled[m] = __fdiv_rn(mu, descale);
    if (c.blk == 0) a.channel_descale[bh * D + ch] = descale;
  }
  uint4 v[TL::kPasses][2];
  load_gather<D, true>(a.v, c.b, c.h, a.perm + bh * a.v.seqlen, token0, v);
  __syncthreads();

  const int valid = a.v.seqlen - token0;
  {
    const int t = threadIdx.x / kC;
    const int sub = threadIdx.x % kC;
    // The 16 channels' means and scales are read from shared memory per pass: holding all 32 in
    // registers next to the 32 of the tile would spill under the 64-register budget.
    const float* mu = s_mu + 16 * sub;
    const float* inv = s_inv + 16 * sub;
#pragma unroll
    for (int p = 0; p < TL::kPasses; ++p) {
      const int r = t + p * TL::kTokenStep;
      uint4 codes = make_uint4(0, 0, 0, 0);  // padding rows: code 0
      if (r < valid) {
        const uint32_t w[8] = {v[p][0].x, v[p][0].y, v[p][0].z, v[p][0].w, v[p][1].x, v[p][1].y, v[p][1].z, v[p][1].w};
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 lo = prepare::unpack2<T>(w[2 * i]), hi = prepare::unpack2<T>(w[2 * i + 1]);
          const int e = 4 * i;
          out[i] = detail::e4m3_encode4(__fmul_rn(__fsub_rn(lo.x, mu[e]), inv[e]),
                                        __fmul_rn(__fsub_rn(lo.y, mu[e + 1]), inv[e + 1]),
                                        __fmul_rn(__fsub_rn(hi.x, mu[e + 2]), inv[e + 2]),
                                        __fmul_rn(__fsub_rn(hi.y, mu[e + 3]), inv[e + 3]));
        }
        codes = make_uint4(out[0], out[1], out[2], out[3]);
      }
      reinterpret_cast<uint4*>(tile)[r * kC + (sub ^ ((r >> 4) & (kC - 1)))] = codes;
    }
  }
  __syncthreads();

  const int g = threadIdx.x & 7;
  const int w = threadIdx.x >> 3;
  const int col = 4 * ((w >> 2) ^ (g & (kC - 1))) + (w & 3);
  uint32_t k[16];
#pragma unroll
  for (int kappa = 0; kappa < 16; ++kappa) k[kappa] = tile[(16 * g + prepare::packed_key(kappa)) * kWords + col];
  uint32_t out[4][4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t t0 = __byte_perm(k[4 * q], k[4 * q + 1], 0x5140);
    const uint32_t t1 = __byte_perm(k[4 * q], k[4 * q + 1], 0x7362);
    const uint32_t t2 = __byte_perm(k[4 * q + 2], k[4 * q + 3], 0x5140);
    const uint32_t t3 = __byte_perm(k[4 * q + 2], k[4 * q + 3], 0x7362);
    out[0][q] = __byte_perm(t0, t2, 0x5410);
    out[1][q] = __byte_perm(t0, t2, 0x7632);
    out[2][q] = __byte_perm(t1, t3, 0x5410);
    out[3][q] = __byte_perm(t1, t3, 0x7632);
  }
  uint8_t* dst = a.v_packed + (bh * D + 4 * w) * a.sk_pad + token0 + 16 * g;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    *reinterpret_cast<uint4*>(dst + i * a.sk_pad) = make_uint4(out[i][0], out[i][1], out[i][2], out[i][3]);
}

}  // namespace openvc::vcprep
