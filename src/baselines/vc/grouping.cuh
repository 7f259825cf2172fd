// Kernels of the VC grouping (numerics section 7): k-means over the value tokens of every
// (batch, head), then a stable counting sort by cluster id. D = 128, K = 64 cluster slots (slots past
// K = min(64, Sk) are unused: norm +inf, never chosen).
//   init_kernel:    centroid c = token floor(c * Sk / K); one CTA per (batch, head).
//   assign_kernel:  one CTA per (batch, head, part of the sequence). Per 128-token tile: distances
//                   ||c||^2 - 2 x.c on the tensor cores (x BF16/FP16 as given, c = hi + lo, two 16-bit
//                   halves of the FP32 centroid), argmin with ties to the lower id; then, when
//                   accumulating, the per-cluster sums as one-hot products OneHot^T X on the tensor cores
//                   (exact 0/1 operands, FP32 accumulators kept in registers over the whole part). Writes
//                   the part's sums and counts (or, in the final pass, the labels).
//   update_kernel:  new centroid = (sum of the parts' sums, in part order, in double) / count; an empty
//                   cluster keeps its centroid. One warp per cluster.
//   scatter_kernel: stable counting sort. Each part's cluster offsets come from the final counts;
//                   inside a part, ranks come from __match_any_sync within a warp and per-warp counts
//                   across warps, so tokens of one cluster keep their original order.
// Every reduction has a fixed order (no float atomics): the result depends on the inputs and the shape
// only; the partition into parts depends on Sk only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "baselines/vc/mma.cuh"

namespace openvc::vc {

inline constexpr int kD = 128;        // head dim
inline constexpr int kK = 64;         // cluster slots
inline constexpr int kTile = 128;     // tokens per tile
inline constexpr int kChunks = kD / 8;  // 16-byte chunks per token row
inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kParts = 16;         // parts per (batch, head) (fewer when Sk < 16 tiles)

// Tiles of one part and parts per (batch, head): a function of Sk only, so a head's permutation depends
// on its own tokens and Sk alone (not on the batch or head count). 16 parts give ~900 CTAs at H = 56.
struct Partition {
  int tiles_per_part, parts;
};
inline Partition partition_of(int64_t seqlen) {
  const int64_t tiles = (seqlen + kTile - 1) / kTile;
  const int64_t tpp = (tiles + kParts - 1) / kParts;
  return {static_cast<int>(tpp), static_cast<int>((tiles + tpp - 1) / tpp)};
}

struct GroupArgs {
  const uint16_t* v;                        // [B, Sk, H, D] 16-bit elements
  int64_t stride_b, stride_s, stride_h;     // elements
  int heads, seqlen, clusters;              // clusters = min(64, Sk)
  int tiles_per_part, parts;
  float* cent32;       // [BH, 64, D] FP32 centroids
  uint16_t* cent16;    // [BH, 2, 64, D] hi and lo 16-bit halves
  float* cnorm;        // [BH, 64] ||c||^2, +inf for unused slots
  float* psum;         // [BH, parts, 64, D]
  int* pcount;         // [BH, parts, 64]
  uint8_t* labels;     // [BH, Sk]
  int* perm;           // [BH, Sk] output
};

// 16-byte chunk `chunk` of row `row` of a [rows][16 chunks] shared tile, XOR-swizzled so that the eight
// rows an ldmatrix reads (same logical chunk) land in eight different bank groups.
__device__ __forceinline__ int swz(int row, int chunk) { return row * kChunks + (chunk ^ (row & 7)); }

template <typename T>
__device__ __forceinline__ uint16_t to16(float x);
template <>
__device__ __forceinline__ uint16_t to16<Bf16>(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
template <>
__device__ __forceinline__ uint16_t to16<F16>(float x) { return __half_as_ushort(__float2half_rn(x)); }
template <typename T>
__device__ __forceinline__ float from16(uint16_t b);
template <>
__device__ __forceinline__ float from16<Bf16>(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
template <>
__device__ __forceinline__ float from16<F16>(uint16_t b) { return __half2float(__ushort_as_half(b)); }

// Lane `lane` of a warp stores dims 4 lane .. 4 lane + 3 of centroid c: FP32, the hi/lo split, and
// (lane 0) its squared norm, +inf for an unused slot. The norm's shuffle tree has a fixed order.
template <typename T>
__device__ __forceinline__ void store_centroid(const GroupArgs& a, int64_t bh, int c, const float (&x)[4],
                                               bool used) {
  const int lane = threadIdx.x & 31;
  const int64_t e = (bh * kK + c) * kD + 4 * lane;
  *reinterpret_cast<float4*>(a.cent32 + e) = make_float4(x[0], x[1], x[2], x[3]);
  uint16_t hi[4], lo[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    hi[i] = to16<T>(x[i]);
    lo[i] = to16<T>(x[i] - from16<T>(hi[i]));
  }
  uint16_t* c16 = a.cent16 + (bh * 2 * kK + c) * kD + 4 * lane;
  *reinterpret_cast<uint2*>(c16) = make_uint2(hi[0] | uint32_t(hi[1]) << 16, hi[2] | uint32_t(hi[3]) << 16);
  *reinterpret_cast<uint2*>(c16 + kK * kD) =
      make_uint2(lo[0] | uint32_t(lo[1]) << 16, lo[2] | uint32_t(lo[3]) << 16);
  float s = fmaf(x[3], x[3], fmaf(x[2], x[2], fmaf(x[1], x[1], x[0] * x[0])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
  if (lane == 0) a.cnorm[bh * kK + c] = used ? s : __int_as_float(0x7F800000);
}

__device__ __forceinline__ const uint16_t* group_base(const GroupArgs& a, int64_t bh) {
  const int64_t b = bh / a.heads, h = bh % a.heads;
  return a.v + b * a.stride_b + h * a.stride_h;
}

// ---- init ---------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) init_kernel(const __grid_constant__ GroupArgs a) {
  const int64_t bh = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint16_t* base = group_base(a, bh);
  for (int c = warp; c < kK; c += kWarps) {
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bool used = c < a.clusters;
    if (used) {
      const int64_t tok = static_cast<int64_t>(c) * a.seqlen / a.clusters;
      const uint2 w = *reinterpret_cast<const uint2*>(base + tok * a.stride_s + 4 * lane);
      x[0] = from16<T>(w.x & 0xFFFFu), x[1] = from16<T>(w.x >> 16);
      x[2] = from16<T>(w.y & 0xFFFFu), x[3] = from16<T>(w.y >> 16);
    }
    store_centroid<T>(a, bh, c, x, used);
  }
}

// ---- update -------------------------------------------------------------------------------------------
// Flat grid: (batch, head) x 8 CTAs of 8 warps, one warp per cluster.
template <typename T>
__global__ void __launch_bounds__(kThreads) update_kernel(const __grid_constant__ GroupArgs a) {
  const int64_t bh = blockIdx.x / (kK / kWarps);
  const int c = (blockIdx.x % (kK / kWarps)) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (c >= a.clusters) return;  // unused slot: stays as initialised
  int64_t count = 0;
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  const int64_t first = bh * a.parts;
#pragma unroll 4
  for (int p = 0; p < a.parts; ++p) {
    count += a.pcount[(first + p) * kK + c];
    const float4 v = *reinterpret_cast<const float4*>(a.psum + ((first + p) * kK + c) * kD + 4 * lane);
    s[0] += v.x, s[1] += v.y, s[2] += v.z, s[3] += v.w;
  }
  float x[4];
  const float4 old = *reinterpret_cast<const float4*>(a.cent32 + (bh * kK + c) * kD + 4 * lane);
  if (count > 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = static_cast<float>(s[i] / static_cast<double>(count));
  } else {  // an empty cluster keeps its centroid
    x[0] = old.x, x[1] = old.y, x[2] = old.z, x[3] = old.w;
  }
  store_centroid<T>(a, bh, c, x, true);
}

// ---- assign (+ accumulate) ----------------------------------------------------------------------------
struct AssignSmem {
  uint4 x[2][kTile * kChunks];   // double-buffered token tile, swizzled
  uint4 cent[2][kK * kChunks];   // centroid hi, lo, swizzled
  float cn[kK];
  float best_d[2][kTile];        // per cluster half: best distance and id of each token
  int best_i[2][kTile];
  int cnt[kK];
  uint8_t lab[kTile];            // this tile's labels, 0xFF past the part's end
};

// cp.async of tile rows [t0, t0 + 128) (zeros past tok_end) into a swizzled stage.
__device__ __forceinline__ void load_tile(const GroupArgs& a, const uint16_t* base, int t0, int tok_end,
                                          uint4* dst) {
  const int ch = threadIdx.x & (kChunks - 1);
#pragma unroll
  for (int p = 0; p < kTile * kChunks / kThreads; ++p) {
    const int r = (threadIdx.x / kChunks) + (kThreads / kChunks) * p;
    const bool ok = t0 + r < tok_end;
    const uint16_t* src = base + static_cast<int64_t>(ok ? t0 + r : t0) * a.stride_s + 8 * ch;
    cp_async16(&dst[swz(r, ch)], src, ok ? 16 : 0);
  }
}

// Warp (tg, ch): tokens 32 tg .. 32 tg + 31 against clusters 32 ch .. 32 ch + 31. Leaves each token's
// best (distance, id) of this cluster half in best_d / best_i. NaN distances count as +inf; ties and
// +inf go to the lower id, so an unused slot (always above the used ones) is never chosen.
template <typename T>
__device__ __forceinline__ void nearest(AssignSmem& sm, const uint4* X) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tg = warp >> 1, ch = warp & 1;
  float acc[2][4][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
#pragma unroll 2
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t af[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int row = 32 * tg + 16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1);
      ldmatrix_x4(af[mt], smem_addr(&X[swz(row, 2 * kk + (lane >> 4))]));
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t bf[4][2];
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int m = lane >> 3;
        const int row = 32 * ch + 8 * (2 * np + (m >> 1)) + (lane & 7);
        uint32_t r[4];
        ldmatrix_x4(r, smem_addr(&sm.cent[half][swz(row, 2 * kk + (m & 1))]));
        bf[2 * np][0] = r[0], bf[2 * np][1] = r[1], bf[2 * np + 1][0] = r[2], bf[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma16816<T>(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
    }
  }
  const int g = lane >> 2, t = lane & 3;
  const float inf = __int_as_float(0x7F800000);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float bd = inf;
      int bi = 1 << 30;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = 32 * ch + 8 * nt + 2 * t + j;
          float d = sm.cn[c] - 2.0f * acc[mt][nt][2 * rr + j];
          if (d != d) d = inf;
          if (d < bd || (d == bd && c < bi)) bd = d, bi = c;
        }
      }
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        const float od = __shfl_xor_sync(0xFFFFFFFFu, bd, o);
        const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
        if (od < bd || (od == bd && oi < bi)) bd = od, bi = oi;
      }
      if (t == 0) {
        const int row = 32 * tg + 16 * mt + 8 * rr + g;
        sm.best_d[ch][row] = bd;
        sm.best_i[ch][row] = bi;
      }
    }
  }
}

// Warp (ch, dq): sums of clusters 32 ch .. 32 ch + 31 over dims 32 dq .. 32 dq + 31 of this tile,
// accS += OneHot^T X, with OneHot built in registers from the labels and X read transposed.
template <typename T>
__device__ __forceinline__ void accumulate(const AssignSmem& sm, const uint4* X, float (&accS)[2][4][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ch = warp & 1, dq = warp >> 1;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t one = one16<T>();
#pragma unroll 2
  for (int kk = 0; kk < kTile / 16; ++kk) {
    const int tb = 16 * kk;
    const uint32_t l0 = sm.lab[tb + 2 * t], l1 = sm.lab[tb + 2 * t + 1];
    const uint32_t l2 = sm.lab[tb + 2 * t + 8], l3 = sm.lab[tb + 2 * t + 9];
    uint32_t af[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint32_t ca = 32 * ch + 16 * mt + g, cb = ca + 8;
      af[mt][0] = (l0 == ca ? one : 0u) | (l1 == ca ? one << 16 : 0u);
      af[mt][1] = (l0 == cb ? one : 0u) | (l1 == cb ? one << 16 : 0u);
      af[mt][2] = (l2 == ca ? one : 0u) | (l3 == ca ? one << 16 : 0u);
      af[mt][3] = (l2 == cb ? one : 0u) | (l3 == cb ? one << 16 : 0u);
    }
    uint32_t bf[4][2];
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const int m = lane >> 3;
      const int row = tb + 8 * (m & 1) + (lane & 7);
      uint32_t r[4];
      ldmatrix_x4_trans(r, smem_addr(&X[swz(row, 4 * dq + 2 * np + (m >> 1))]));
      bf[2 * np][0] = r[0], bf[2 * np][1] = r[1], bf[2 * np + 1][0] = r[2], bf[2 * np + 1][1] = r[3];
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma16816<T>(accS[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
  }
}

// Flat grid: (batch, head) x parts. kAccumulate: an iteration (sums and counts per part); otherwise the
// final assignment (labels and counts).
template <typename T, bool kAccumulate>
__global__ void __launch_bounds__(kThreads, 2) assign_kernel(const __grid_constant__ GroupArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  AssignSmem& sm = *reinterpret_cast<AssignSmem*>(smem_raw);
  const int tid = threadIdx.x;
  const int64_t bh = blockIdx.x / a.parts;
  const int part = blockIdx.x % a.parts;
  const int tok0 = part * a.tiles_per_part * kTile;
  const int tok_end = min(a.seqlen, tok0 + a.tiles_per_part * kTile);
  const int ntiles = (tok_end - tok0 + kTile - 1) / kTile;
  const uint16_t* base = group_base(a, bh);

  const uint4* csrc = reinterpret_cast<const uint4*>(a.cent16 + bh * 2 * kK * kD);
  for (int i = tid; i < 2 * kK * kChunks; i += kThreads) {
    const int half = i / (kK * kChunks), r = (i / kChunks) % kK;
    cp_async16(&sm.cent[half][swz(r, i % kChunks)], csrc + i, 16);
  }
  if (tid < kK) {
    sm.cn[tid] = a.cnorm[bh * kK + tid];
    sm.cnt[tid] = 0;
  }
  load_tile(a, base, tok0, tok_end, sm.x[0]);
  cp_async_commit();

  float accS[2][4][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) accS[mt][nt][i] = 0.0f;

  for (int it = 0; it < ntiles; ++it) {
    const int t0 = tok0 + it * kTile;
    if (it + 1 < ntiles) {  // prefetch the next tile into the other stage
      load_tile(a, base, t0 + kTile, tok_end, sm.x[(it + 1) & 1]);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint4* X = sm.x[it & 1];
    nearest<T>(sm, X);
    __syncthreads();
    if (tid < kTile) {
      const float d0 = sm.best_d[0][tid], d1 = sm.best_d[1][tid];
      const int label = d1 < d0 ? sm.best_i[1][tid] : sm.best_i[0][tid];  // ties: the lower half
      const bool valid = t0 + tid < tok_end;
      sm.lab[tid] = valid ? static_cast<uint8_t>(label) : uint8_t(0xFF);
      if (valid) {
        atomicAdd(&sm.cnt[label], 1);  // integer: order-independent
        if (!kAccumulate) a.labels[bh * a.seqlen + t0 + tid] = static_cast<uint8_t>(label);
      }
    }
    __syncthreads();
    if (kAccumulate) accumulate<T>(sm, X, accS);
    __syncthreads();  // the stage, labels and best arrays are reused by the next tile
  }

  if (kAccumulate) {
    const int lane = tid & 31, warp = tid >> 5;
    const int ch = warp & 1, dq = warp >> 1, g = lane >> 2, t = lane & 3;
    float* dst = a.psum + (bh * a.parts + part) * kK * kD;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int c = 32 * ch + 16 * mt + g, d = 32 * dq + 8 * nt + 2 * t;
        *reinterpret_cast<float2*>(dst + c * kD + d) = make_float2(accS[mt][nt][0], accS[mt][nt][1]);
        *reinterpret_cast<float2*>(dst + (c + 8) * kD + d) = make_float2(accS[mt][nt][2], accS[mt][nt][3]);
      }
  }
  if (tid < kK) a.pcount[(bh * a.parts + part) * kK + tid] = sm.cnt[tid];
}

// ---- stable counting sort -----------------------------------------------------------------------------
// Flat grid: (batch, head) x parts, like the final assign pass whose labels and counts it reads.
__global__ void __launch_bounds__(kThreads) scatter_kernel(const __grid_constant__ GroupArgs a) {
  __shared__ int base[kK], run[kK], total[kK], wcnt[kWarps][kK];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t bh = blockIdx.x / a.parts;
  const int part = blockIdx.x % a.parts;
  const int tok0 = part * a.tiles_per_part * kTile;
  const int tok_end = min(a.seqlen, tok0 + a.tiles_per_part * kTile);
  if (tid < kK) {
    int all = 0, before = 0;  // tokens of cluster tid in every part, and in the parts before this one
    for (int p = 0; p < a.parts; ++p) {
      const int n = a.pcount[(bh * a.parts + p) * kK + tid];
      all += n;
      before += p < part ? n : 0;
    }
    total[tid] = all;
    base[tid] = before;
    run[tid] = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) wcnt[w][tid] = 0;
  }
  __syncthreads();
  if (tid == 0) {  // exclusive scan over cluster ids
    int s = 0;
    for (int c = 0; c < kK; ++c) {
      base[c] += s;
      s += total[c];
    }
  }
  __syncthreads();
  const uint8_t* labels = a.labels + bh * a.seqlen;
  int* perm = a.perm + bh * a.seqlen;
  for (int c0 = tok0; c0 < tok_end; c0 += kThreads) {
    const int tok = c0 + tid;
    const bool valid = tok < tok_end;
    const int l = valid ? labels[tok] : kK + 1;
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, l);
    const int rank = __popc(peers & ((1u << lane) - 1u));  // earlier lanes with the same label
    if (valid && rank == 0 && l < kK) wcnt[warp][l] = __popc(peers);
    __syncthreads();
    if (valid && l < kK) {
      int off = base[l] + run[l] + rank;
      for (int w = 0; w < warp; ++w) off += wcnt[w][l];
      perm[off] = tok;
    }
    __syncthreads();
    if (tid < kK) {
      int s = run[tid];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        s += wcnt[w][tid];
        wcnt[w][tid] = 0;
      }
      run[tid] = s;
    }
    __syncthreads();
  }
}

}  // namespace openvc::vc
