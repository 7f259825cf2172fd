// Top-`rows` selection per (batch, head) on the GPU, with no host synchronization.
//
// Every token gets a unique 96-bit key X = (energy bits << 32) | ~token: a non-negative double's
// bits order like its value, and ~token puts the lower index first among equal energies, so "the
// `rows` largest X" is exactly the reference's (energy desc, index asc) prefix. An MSD radix select
// finds the threshold T (the rows-th largest X, low bits zeroed below the digits it needed) in at
// most 8 passes of 12-bit digits; a pass stops mattering for a head once its threshold digit's bin
// holds exactly the rows still needed (typically after 2-3 passes; ties need all 8). Each pass is one
// launch: CTAs histogram the candidates (keys whose higher digits equal T's so far) of a chunk in
// shared memory and add it to the head's global histogram; the last CTA of the head to arrive picks
// the digit and resets the histogram for the next pass.
// Then X >= T selects exactly `rows` tokens per head; cub::DeviceSelect keeps them in index order,
// and a stable segmented radix sort on the energy (descending) gives the final order.
#pragma once
#include <cstdint>

#include <cub/block/block_scan.cuh>

namespace openvc::repair {

using u128 = unsigned __int128;

inline constexpr int kDigitBits = 12;
inline constexpr int kBins = 1 << kDigitBits;
inline constexpr int kSelectPasses = 96 / kDigitBits;
inline constexpr int kSelectThreads = 256;
inline constexpr int kSelectChunk = 8192;   // keys per CTA
inline constexpr int kBinsPerThread = kBins / kSelectThreads;

// Per (batch, head), zeroed before the first pass.
struct SelectState {
  unsigned long long prefix_hi;  // T = (prefix_hi << 32) | prefix_lo: the digits fixed so far
  unsigned int prefix_lo;
  unsigned int taken;            // tokens known to be above T's prefix
  unsigned int done;             // 1 once X >= T selects exactly `rows`
  unsigned int pad;
};

__host__ __device__ __forceinline__ u128 composite_key(uint64_t energy_bits, int token) {
  return (static_cast<u128>(energy_bits) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(token));
}
__host__ __device__ __forceinline__ u128 threshold(const SelectState& s) {
  return (static_cast<u128>(s.prefix_hi) << 32) | s.prefix_lo;
}

struct SelectArgs {
  const uint64_t* keys;   // [G, seqlen] energy bits
  int seqlen, rows, chunks;
  SelectState* state;     // [G]
  uint32_t* hist;         // [G, kBins], zero at the start of every pass
  uint32_t* arrive;       // [G] CTAs of the current pass that finished their chunk
};

// Digit `pass` covers bits [shift, shift + 12) of X, shift = 84 - 12 * pass (bit 95 is the energy's
// sign bit, always 0).
__global__ void __launch_bounds__(kSelectThreads) select_pass_kernel(const __grid_constant__ SelectArgs a, int pass) {
  using Scan = cub::BlockScan<uint32_t, kSelectThreads>;
  __shared__ uint32_t sh[kBins];
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int is_last;
  __shared__ uint32_t pick_bin, pick_above, pick_count;

  const int g = blockIdx.x / a.chunks, chunk = blockIdx.x % a.chunks;
  const SelectState st = a.state[g];
  if (st.done) return;  // this head's threshold is final
  const int shift = 84 - kDigitBits * pass;
  const u128 want = threshold(st) >> (shift + kDigitBits);

  for (int b = threadIdx.x; b < kBins; b += kSelectThreads) sh[b] = 0;
  __syncthreads();
  const uint64_t* keys = a.keys + static_cast<int64_t>(g) * a.seqlen;
  const int j0 = chunk * kSelectChunk, j1 = min(j0 + kSelectChunk, a.seqlen);
  for (int base = j0; base < j1; base += kSelectThreads) {  // same trip count for every lane
    const int j = base + threadIdx.x;
    int digit = kBins;  // not a candidate
    if (j < j1) {
      const u128 x = composite_key(keys[j], j);
      if ((x >> (shift + kDigitBits)) == want) digit = static_cast<int>(x >> shift) & (kBins - 1);
    }
    // One shared atomic per distinct digit in the warp: heavy ties (e.g. many zero residuals) would
    // otherwise serialize on one bank.
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, digit);
    if (digit < kBins && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&sh[digit], __popc(peers));
  }
  __syncthreads();
  uint32_t* hist = a.hist + static_cast<int64_t>(g) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kSelectThreads)
    if (sh[b]) atomicAdd(&hist[b], sh[b]);
  __threadfence();  // our histogram adds are visible before our arrival is
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&a.arrive[g], 1u) == static_cast<unsigned>(a.chunks - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  // The last CTA of the head: find the bin holding the needed-th largest candidate. Thread i owns
  // bins kBins-1-16i down to kBins-16-16i, so an exclusive scan over threads counts the keys above.
  const uint32_t needed = static_cast<uint32_t>(a.rows) - st.taken;
  uint32_t cnt[kBinsPerThread], sum = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    cnt[i] = __ldcg(&hist[kBins - 1 - (kBinsPerThread * threadIdx.x + i)]);
    sum += cnt[i];
  }
  uint32_t above;
  Scan(scan_tmp).ExclusiveSum(sum, above);
  if (above < needed && needed <= above + sum) {  // exactly one thread: the candidates cover `needed`
    uint32_t acc = above;
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) {
      if (acc + cnt[i] >= needed) {
        pick_bin = kBins - 1 - (kBinsPerThread * threadIdx.x + i);
        pick_above = acc;
        pick_count = cnt[i];
        break;
      }
      acc += cnt[i];
    }
  }
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) hist[kBins - 1 - (kBinsPerThread * threadIdx.x + i)] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    const u128 t = threshold(st) | (static_cast<u128>(pick_bin) << shift);
    SelectState out = st;
    out.prefix_hi = static_cast<unsigned long long>(t >> 32);
    out.prefix_lo = static_cast<unsigned int>(t);
    out.taken = st.taken + pick_above;
    // Keys are unique, so the last pass always ends here with pick_count == 1 == needed - above.
    out.done = (pick_count == needed - pick_above) || pass == kSelectPasses - 1;
    a.state[g] = out;
    a.arrive[g] = 0;
  }
}

// cub::DeviceSelect predicate over flat indices i = g * seqlen + j: X >= T of head g.
struct AtOrAboveThreshold {
  const uint64_t* keys;
  const SelectState* state;
  int seqlen;
  __device__ __forceinline__ bool operator()(int i) const {
    const int g = i / seqlen;
    return composite_key(keys[i], i - g * seqlen) >= threshold(state[g]);
  }
};

// Selected flat indices (rows per head, heads in order, tokens ascending) -> sort keys and token
// values, plus the G + 1 segment offsets of the sort.
__global__ void gather_selected_kernel(const int* sel, const uint64_t* keys, int seqlen, int rows, int64_t total,
                                       int groups, uint64_t* keys_out, int* tokens_out, int* offsets) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i <= groups) offsets[i] = static_cast<int>(i) * rows;
  if (i < total) {
    const int s = sel[i];
    keys_out[i] = keys[s];
    tokens_out[i] = s % seqlen;
  }
}

}  // namespace openvc::repair
