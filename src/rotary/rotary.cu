// openvc::rotary_pairs (openvc/rotary.h): the rotary embedding of interleaved pairs in one pass. Memory
// bound: each thread reads one pair of x (4 bytes) and its four table entries, and writes one pair.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <string>

#include "openvc/rotary.h"

namespace openvc {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 2 * kThreads;   // one block holds at least one token-head row of pairs
constexpr int kMaxRows = INT_MAX - kThreads;

template <typename T>
struct PairIo;

template <>
struct PairIo<__nv_bfloat16> {
  using Vec = __nv_bfloat162;
  static __device__ float2 load(const void* p) { return __bfloat1622float2(*static_cast<const Vec*>(p)); }
  static __device__ void store(void* p, float a, float b) { *static_cast<Vec*>(p) = __floats2bfloat162_rn(a, b); }
};

template <>
struct PairIo<__half> {
  using Vec = __half2;
  static __device__ float2 load(const void* p) { return __half22float2(*static_cast<const Vec*>(p)); }
  static __device__ void store(void* p, float a, float b) { *static_cast<Vec*>(p) = __floats2half2_rn(a, b); }
};

// One block: rows_per_block consecutive (b, s, h) rows, pairs_per_row threads each.
template <typename T>
__global__ void __launch_bounds__(kThreads) rotary_pairs_kernel(RotaryPairsParams p, int pairs_per_row,
                                                                int rows_per_block, int rows) {
  const int local_row = threadIdx.x / pairs_per_row;
  const int pair = threadIdx.x - local_row * pairs_per_row;
  const int row = blockIdx.x * rows_per_block + local_row;
  if (local_row >= rows_per_block || row >= rows) return;
  const int h = row % p.heads;
  const int token = row / p.heads;
  const int s = token % p.seqlen;
  const int b = token / p.seqlen;

  const int64_t col = 2 * static_cast<int64_t>(pair);
  const auto* x = static_cast<const T*>(p.x.data) + b * p.x.stride_batch + s * p.x.stride_seq +
                  h * p.x.stride_head + col;
  auto* out = static_cast<T*>(p.out) + b * p.out_stride_batch + s * p.out_stride_seq + h * p.out_stride_head + col;
  const int64_t t = s * p.table_stride_seq + h * p.table_stride_head + pair * p.table_stride_pair;
  const float cos0 = __ldg(p.cos + t), cos1 = __ldg(p.cos + t + p.table_stride_half);
  const float sin0 = __ldg(p.sin + t), sin1 = __ldg(p.sin + t + p.table_stride_half);

  const float2 v = PairIo<T>::load(x);
  // Separate roundings, as the framework's elementwise kernels do (the intrinsics forbid FMA contraction).
  const float first = __fsub_rn(__fmul_rn(v.x, cos0), __fmul_rn(v.y, sin0));
  const float second = __fadd_rn(__fmul_rn(v.y, cos1), __fmul_rn(v.x, sin1));
  PairIo<T>::store(out, first, second);
}

Status check(const RotaryPairsParams& p) {
  if (p.batch < 0 || p.seqlen < 0 || p.heads < 0)
    return Status::Invalid("rotary_pairs: batch, seqlen and heads must be >= 0, got " + std::to_string(p.batch) +
                           ", " + std::to_string(p.seqlen) + ", " + std::to_string(p.heads));
  if (p.head_dim <= 0 || p.head_dim % 2 || p.head_dim > kMaxHeadDim)
    return Status::Invalid("rotary_pairs: head_dim must be even, in [2, " + std::to_string(kMaxHeadDim) +
                           "] (pairs of elements), got " + std::to_string(p.head_dim));
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16)
    return Status::Invalid("rotary_pairs: dtype must be kBFloat16 or kFloat16");
  // Rows and a block's worth more must fit an int: the grid size and each thread's row are 32-bit.
  const int64_t rows = static_cast<int64_t>(p.batch) * p.seqlen * p.heads;
  if (rows > kMaxRows)
    return Status::Invalid("rotary_pairs: batch * seqlen * heads must be at most " + std::to_string(kMaxRows) +
                           ", got " + std::to_string(rows));
  if (rows == 0) return Status::Ok();
  if (!p.x.data) return Status::Invalid("rotary_pairs: x.data is null");
  if (!p.out) return Status::Invalid("rotary_pairs: out is null");
  if (!p.cos || !p.sin) return Status::Invalid(std::string("rotary_pairs: ") + (p.cos ? "sin" : "cos") + " is null");
  // Pairs are loaded and stored as one 4-byte word.
  if (reinterpret_cast<uintptr_t>(p.x.data) % 4 || (p.x.stride_batch | p.x.stride_seq | p.x.stride_head) % 2)
    return Status::Invalid("rotary_pairs: x must be 4-byte aligned with even strides (pairs are loaded as one "
                           "word)");
  if (reinterpret_cast<uintptr_t>(p.out) % 4 || (p.out_stride_batch | p.out_stride_seq | p.out_stride_head) % 2)
    return Status::Invalid("rotary_pairs: out must be 4-byte aligned with even strides (pairs are stored as one "
                           "word)");
  return Status::Ok();
}

}  // namespace

Status rotary_pairs(const RotaryPairsParams& params, cudaStream_t stream) {
  Status st = check(params);
  if (!st.ok()) return st;
  const int rows = params.batch * params.seqlen * params.heads;
  if (rows == 0) return Status::Ok();
  const int pairs_per_row = params.head_dim / 2;
  const int rows_per_block = kThreads / pairs_per_row;
  const int blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int threads = rows_per_block * pairs_per_row;
  if (params.dtype == DType::kBFloat16)
    rotary_pairs_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(params, pairs_per_row, rows_per_block, rows);
  else
    rotary_pairs_kernel<__half><<<blocks, threads, 0, stream>>>(params, pairs_per_row, rows_per_block, rows);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::Cuda(std::string("rotary_pairs: launch failed: ") + cudaGetErrorString(err));
  return Status::Ok();
}

}  // namespace openvc
