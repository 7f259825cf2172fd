// The general-path attention kernel: one CTA per (sequence, head, 128-row query tile), CUDA cores only.
// It reproduces openvc::reference::attention_expcast (src/reference/attention.cc) step for step:
// - scores: the exact dot product of the decoded E4M3 codes, rounded once to FP32. Products of two
//   E4M3 values are multiples of 2^-18 below 2^18 and a sum of <= 128 of them stays below 2^25, so
//   every partial sum fits FP64's 53 bits: DFMA accumulation is exact in any order;
// - per (row, key block): tile max of fl(acc * a) over the visible keys, folded into the running max
//   before any code is formed (zero deadband); codes clamp(rne(fmaf(acc, a, 119.65f - M)), 0, 120);
//   the tile's sum of decoded codes is exact in FP32 (multiples of 2^-9 summing to <= 2^15), so the
//   codes, maxima and tile sums are bit-identical to the reference;
// - A (numerator) in FP32 registers, l in FP64, both scaled by alpha = exp2((M_old - M_new) / 8) on
//   an increase; output (dv * A) / l in FP64, then FP32, then BF16; lse = ln2 * M / 8 + ln(l / 256).
// The only differences from the reference are A's FP32 rounding (about 1e-7 relative; the reference
// keeps A in double) and alpha's last bit; neither changes a code.
//
// Per key block (traversal order of numerics.md section 5), three phases separated by barriers:
//   1. stage K codes decoded to FP32 in shared memory; S = Q K^T into the score tile (FP64 DFMA);
//   2. stage V (un-permuting kPackedKeyOrder) over K's buffer; one warp per row turns its scores
//      into decoded codes in place and updates the row's M, l and alpha;
//   3. A = alpha * A + P V.
// Causal: key blocks that no row of the tile can see are skipped; partial blocks get per-row masks.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/sm90/traversal.h"   // causal_key_limit: the fast path's chunked-causal rule, shared
#include "openvc/reference.h"   // kCodeBias, kLog2e: one definition for the reference and kernels

namespace openvc::general {

inline constexpr int kTile = 128;                 // query rows per CTA = keys per block = kQuantBlock
inline constexpr int kThreads = 256;              // a 16 x 16 thread grid over each 128 x 128 product
inline constexpr int kScoreStride = kTile + 16;   // score row pitch: rows ty, ty+1 of a warp 16 banks apart
using reference::kCodeBias;                       // 119.65, numerics.md section 3 (openvc/reference.h)
inline constexpr float kCodesPerLog2 = 8.0f * reference::kLog2e;  // 8 * log2e, exact in FP32

// Everything the kernel reads, resolved by the launcher (batched inputs: cu pointers null).
struct KernelParams {
  const uint8_t* q_codes;
  const float* q_descale;
  const uint8_t* k_codes;
  const float* k_descale;
  const uint8_t* v_packed;
  const float* v_descale;
  const int* cu_q;       // packed: num_seqs + 1 offsets; null: batched
  const int* cu_k;
  const int* seqused_k;  // optional per-sequence key counts (keys past them are masked); null: none
  int64_t total_q, total_k;  // packed: rows of q/k codes; offsets are clamped to them
  int heads;
  int seqlen_q, seqlen_k;  // batched: the lengths; packed: max_seqlen_q/k (bounds)
  int nq, nk;              // descale blocks per (sequence, head); v_packed row pitch = nk * 128
  __nv_bfloat16* out;
  int64_t out_sb, out_ss, out_sh;
  float* lse;              // null: none
  int64_t lse_sb, lse_sh;
  float tau;               // resolved softmax scale
  int mid_window;          // -1: natural order
  // Key block lists (null: every block): the tile's row = s * blk_sb + h * blk_sh + tile, its blocks
  // blk_index[row * blk_cap + i], i < clamp(blk_count[row], 0, blk_cap), each clamped to [0, nk).
  const int* blk_count;
  const int* blk_index;
  int64_t blk_sb, blk_sh;
  int blk_cap;
  int causal_chunk;        // causal only: chunked causal (1: plain), numerics section 5
  bool causal;
  bool out_fp16;           // out holds FP16 instead of BF16 (same strides)
};

// Shared memory carve-up (bytes). Q and K/V rows have an odd pitch of D + 1 floats, so reading one
// column of consecutive rows, or writing V transposed, touches 32 different banks.
template <int D>
struct Smem {
  static constexpr int kPitch = D + 1;
  static constexpr size_t kRowL = 0;                                  // double[128]: l
  static constexpr size_t kRowM = kRowL + kTile * sizeof(double);     // float[128]: running max M
  static constexpr size_t kRowAlpha = kRowM + kTile * sizeof(float);  // float[128]: this block's alpha
  static constexpr size_t kQ = kRowAlpha + kTile * sizeof(float);     // float[128][kPitch]
  static constexpr size_t kKV = kQ + size_t(kTile) * kPitch * sizeof(float);   // K, then V, [key][kPitch]
  static constexpr size_t kP = kKV + size_t(kTile) * kPitch * sizeof(float);   // float[128][kScoreStride]
  static constexpr size_t kBytes = kP + size_t(kTile) * kScoreStride * sizeof(float);
};

// Four E4M3 codes (low byte first) -> four exact floats (E4M3 -> f16 is exact, NaN stays NaN).
__device__ __forceinline__ void decode4(uint32_t w, float* f) {
  const float2 lo = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w & 0xFFFFu), __NV_E4M3)));
  const float2 hi = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> 16), __NV_E4M3)));
  f[0] = lo.x, f[1] = lo.y, f[2] = hi.x, f[3] = hi.y;
}

// The decoded E4M3 value of ExpCast code c in [0, 120]: subnormals c * 2^-9, else 2^(e-7) * (1 + m/8).
__device__ __forceinline__ float code_value(int c) {
  if (c < 8) return float(c) * 0.001953125f;
  return __int_as_float((((c >> 3) + 120) << 23) | ((c & 7) << 20));
}

// reference::expcast_code, decoded: x = fmaf(acc, a, bias); NaN and x <= 0 give 0; rne; clip at 120.
__device__ __forceinline__ float expcast_value(float acc, float a, float bias) {
  const float x = __fmaf_rn(acc, a, bias);
  if (!(x > 0.0f)) return 0.0f;
  return code_value(min(__float2int_rn(x), 120));
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) general_attention_kernel(const KernelParams p) {
  using L = Smem<D>;
  constexpr int kPitch = L::kPitch;
  constexpr int kCols = D / 16;   // output columns per thread
  extern __shared__ __align__(16) unsigned char smem[];
  double* row_l = reinterpret_cast<double*>(smem + L::kRowL);
  float* row_m = reinterpret_cast<float*>(smem + L::kRowM);
  float* row_alpha = reinterpret_cast<float*>(smem + L::kRowAlpha);
  float* q_s = reinterpret_cast<float*>(smem + L::kQ);
  float* kv_s = reinterpret_cast<float*>(smem + L::kKV);
  float* p_s = reinterpret_cast<float*>(smem + L::kP);

  const int tile = blockIdx.x, h = blockIdx.y, s = blockIdx.z, H = p.heads;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4, lane = tid & 31, warp = tid >> 5;

  // This sequence's token ranges. Offsets are read here only (device memory, never on the host).
  int64_t q0, k0;
  int sq, sk;
  if (p.cu_q != nullptr) {
    // Clamped to the tensors, whatever the offsets hold: a bad offset never reads or writes outside q,
    // k, v or out (it shortens or empties the sequence instead).
    const int64_t qa = min(max(int64_t(p.cu_q[s]), int64_t(0)), p.total_q);
    const int64_t qb = min(max(int64_t(p.cu_q[s + 1]), qa), p.total_q);
    const int64_t ka = min(max(int64_t(p.cu_k[s]), int64_t(0)), p.total_k);
    const int64_t kb = min(max(int64_t(p.cu_k[s + 1]), ka), p.total_k);
    q0 = qa, k0 = ka;
    sq = int(qb - qa), sk = int(kb - ka);   // rows past nq*128 / keys past nk*128 are never touched
  } else {
    q0 = int64_t(s) * p.seqlen_q, k0 = int64_t(s) * p.seqlen_k;
    sq = p.seqlen_q, sk = p.seqlen_k;
  }
  if (p.seqused_k != nullptr) sk = min(sk, max(p.seqused_k[s], 0));
  const int r0 = tile * kTile;
  if (r0 >= sq) return;   // uniform over the CTA: past this sequence's end (or an empty sequence)
  const int rows = min(kTile, sq - r0);
  // Key blocks; a longer sequence than max_seqlen_k declared is cut at the descale/V arrays' end.
  const int n = min((sk + kTile - 1) / kTile, p.nk);
  const size_t group = size_t(s) * H + h;
  const int64_t tok_stride = int64_t(H) * D;

  // Stage Q (rows past the sequence: zeros) and reset the row states.
  for (int idx = tid; idx < kTile * (D / 4); idx += kThreads) {
    const int r = idx / (D / 4), c = (idx % (D / 4)) * 4;
    uint32_t w = 0;
    if (r < rows) w = *reinterpret_cast<const uint32_t*>(p.q_codes + (q0 + r0 + r) * tok_stride + int64_t(h) * D + c);
    decode4(w, q_s + r * kPitch + c);
  }
  if (tid < kTile) {
    row_l[tid] = 0.0;
    row_m[tid] = -INFINITY;
    row_alpha[tid] = 1.0f;
  }
  // Multiplier in the reference's order: ((8 log2e * tau) * dq) * dk. The query tile is one Q block.
  const float qa = __fmul_rn(kCodesPerLog2 * p.tau, p.q_descale[group * p.nq + tile]);
  const float* dk = p.k_descale + group * p.nk;
  const uint8_t* v_head = p.v_packed + group * D * (int64_t(p.nk) * kTile);

  float A[8][kCols];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int c = 0; c < kCols; ++c) A[i][c] = 0.0f;

  // Traversal (numerics.md section 5): j0 = min(diag + w, n - 1); j0 down to 0, then j0 + 1 up.
  // Causal: only the nv blocks the tile's last row sees, from the diagonal (j0 = nv - 1) down.
  // Causal: the blocks holding a key the tile's last row sees (chunked causal included).
  int nv = !p.causal ? n : min((sm90::causal_key_limit(r0 + rows - 1, sq, sk, p.causal_chunk) + kTile - 1) / kTile, n);
  // Key block lists (section 5, "Key block lists"): the same order over list positions, measured from the
  // first listed block.
  const int* listed = nullptr;
  int first = 0;
  if (p.blk_index != nullptr) {
    const int64_t row = s * p.blk_sb + h * p.blk_sh + tile;
    listed = p.blk_index + row * p.blk_cap;
    nv = n > 0 ? min(max(p.blk_count[row], 0), p.blk_cap) : 0;
    first = nv > 0 ? min(max(listed[0], 0), n - 1) : 0;
  }
  int j0 = nv - 1;
  if (p.mid_window >= 0 && n > 0 && !p.causal) {
    const int64_t diag = int64_t(r0) * sk / sq / kTile;
    j0 = int(min(diag - first + p.mid_window, int64_t(nv - 1)));   // < 0 (lists only): natural order
  }

  for (int t = 0; t < nv; ++t) {
    const int pos = p.mid_window < 0 ? t : (t <= j0 ? j0 - t : t);
    const int b = listed != nullptr ? min(max(listed[pos], 0), n - 1) : pos;
    const int kb = b * kTile;
    const int kcount = min(kTile, sk - kb);
    const float a = __fmul_rn(qa, dk[b]);

    // ---- 1. K tile and scores ---------------------------------------------------------------------
    __syncthreads();   // the previous block's PV is done with kv_s and p_s (and Q is staged)
    for (int idx = tid; idx < kTile * (D / 4); idx += kThreads) {
      const int j = idx / (D / 4), c = (idx % (D / 4)) * 4;
      uint32_t w = 0;
      if (j < kcount) w = *reinterpret_cast<const uint32_t*>(p.k_codes + (k0 + kb + j) * tok_stride + int64_t(h) * D + c);
      decode4(w, kv_s + j * kPitch + c);
    }
    __syncthreads();
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {   // 64 keys at a time keeps 32 FP64 accumulators per thread
      double acc[8][4];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0;
      const float* qrow = q_s + ty * kPitch;
      const float* krow = kv_s + (tx + 64 * half) * kPitch;
#pragma unroll 4
      for (int k = 0; k < D; ++k) {
        double qv[8], kv[4];
#pragma unroll
        for (int i = 0; i < 8; ++i) qv[i] = qrow[16 * i * kPitch + k];
#pragma unroll
        for (int j = 0; j < 4; ++j) kv[j] = krow[16 * j * kPitch + k];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = __fma_rn(qv[i], kv[j], acc[i][j]);   // exact
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          p_s[(ty + 16 * i) * kScoreStride + tx + 16 * j + 64 * half] = __double2float_rn(acc[i][j]);
    }
    __syncthreads();

    // ---- 2. V tile over K's buffer, and the ExpCast codes ------------------------------------------
    // Packed V row d holds this block's keys at columns kb + kappa, key = group16 + kPackedKeyOrder.
    for (int idx = tid; idx < D * (kTile / 4); idx += kThreads) {
      const int d = idx / (kTile / 4), kappa = (idx % (kTile / 4)) * 4;
      const uint32_t w = *reinterpret_cast<const uint32_t*>(v_head + int64_t(d) * p.nk * kTile + kb + kappa);
      float f[4];
      decode4(w, f);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        // kPackedKeyOrder[x] = 8*(x&1) + 2*(x>>2) + ((x>>1)&1) for x in [0, 16): [0,1,8,9,2,3,10,11,...].
        const int x = (kappa + u) & 15;
        const int j = ((kappa + u) & ~15) + (((x >> 2) << 1) | (x & 1)) + 8 * ((x >> 1) & 1);
        kv_s[j * kPitch + d] = j < kcount ? f[u] : 0.0f;   // padding keys are 0 already; be explicit
      }
    }
    for (int rr = 0; rr < kTile / 8; ++rr) {   // one warp per row, each lane 4 keys
      const int r = warp * (kTile / 8) + rr;
      float* prow = p_s + r * kScoreStride;
      int jv = r < rows ? kcount : 0;   // visible keys of this row in the block: [0, jv)
      if (p.causal) jv = max(0, min(jv, sm90::causal_key_limit(r0 + r, sq, sk, p.causal_chunk) - kb));
      if (jv == 0) {   // uniform per warp: no visible key, no max update, all codes 0
#pragma unroll
        for (int u = 0; u < 4; ++u) prow[lane + 32 * u] = 0.0f;
        if (lane == 0) row_alpha[r] = 1.0f;
        continue;
      }
      float sc[4], tmax = -INFINITY;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        sc[u] = prow[lane + 32 * u];
        if (lane + 32 * u < jv) tmax = fmaxf(tmax, __fmul_rn(sc[u], a));   // fmaxf drops NaN like std::max
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, o));
      const float m_old = row_m[r];
      float m = m_old, alpha = 1.0f;
      if (tmax > m_old) {   // zero deadband: raise the max before this block's codes are formed
        // exp2 in FP64 rounded once to FP32; the reference's exp2f may differ in the last bit (it
        // scales l and A only, never a code).
        if (m_old != -INFINITY) alpha = float(exp2(double(__fdiv_rn(__fsub_rn(m_old, tmax), 8.0f))));
        m = tmax;
      }
      float bias = __fsub_rn(kCodeBias, m);
      // Huge row max (numerics section 3): one ulp of slack, as the reference's expcast_code.
      if (fabsf(m) >= 8388608.0f && fabsf(m) < INFINITY)
        bias = __fadd_rn(bias, __int_as_float((__float_as_int(fabsf(m)) & 0x7F800000) - (23 << 23)));
      float psum = 0.0f;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float v = lane + 32 * u < jv ? expcast_value(sc[u], a, bias) : 0.0f;
        prow[lane + 32 * u] = v;
        psum += v;   // multiples of 2^-9 summing to <= 2^15: exact in FP32, in any order
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xFFFFFFFFu, psum, o);
      __syncwarp();
      if (lane == 0) {
        row_m[r] = m;
        row_l[r] = row_l[r] * double(alpha) + double(psum);
        row_alpha[r] = alpha;
      }
    }
    __syncthreads();

    // ---- 3. A = alpha * A + P V ---------------------------------------------------------------------
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float al = row_alpha[ty + 16 * i];
#pragma unroll
      for (int c = 0; c < kCols; ++c) A[i][c] *= al;
    }
    const float* prow = p_s + ty * kScoreStride;
#pragma unroll 2
    for (int j = 0; j < kcount; ++j) {
      float pv[8], vv[kCols];
#pragma unroll
      for (int i = 0; i < 8; ++i) pv[i] = prow[16 * i * kScoreStride + j];
#pragma unroll
      for (int c = 0; c < kCols; ++c) vv[c] = kv_s[j * kPitch + tx + 16 * c];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int c = 0; c < kCols; ++c) A[i][c] = __fmaf_rn(pv[i], vv[c], A[i][c]);
    }
  }
  __syncthreads();   // row states of the last block are visible to every thread

  // ---- Epilogue: O = dv * A / l in BF16; lse --------------------------------------------------------
  const bool packed = p.cu_q != nullptr;
  const double dv = nv > 0 ? double(p.v_descale[group]) : 0.0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = ty + 16 * i;
    if (r >= rows) continue;
    const int64_t tok = (packed ? q0 : 0) + r0 + r;   // token index within out's sequence dimension
    const double l = row_l[r];
    const bool any = row_m[r] != -INFINITY;   // else no visible key: output 0, lse -inf
    __nv_bfloat16* o = p.out + (packed ? 0 : int64_t(s) * p.out_sb) + tok * p.out_ss + int64_t(h) * p.out_sh;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float val = any ? float(__ddiv_rn(__dmul_rn(dv, double(A[i][c])), l)) : 0.0f;
      if (p.out_fp16) reinterpret_cast<__half*>(o)[tx + 16 * c] = __float2half_rn(val);
      else o[tx + 16 * c] = __float2bfloat16_rn(val);
    }
    if (p.lse != nullptr && tx == 0) {
      float* dst = p.lse + (packed ? 0 : int64_t(s) * p.lse_sb) + int64_t(h) * p.lse_sh + tok;
      // m is in code units (8 log2 of the numerator); l is scaled by 2^8 (code 120 = 256).
      *dst = any ? float(0.6931471805599453 * (double(row_m[r]) / 8.0) + log(l / 256.0)) : -INFINITY;
    }
  }
}

}  // namespace openvc::general
