// Host side of the V residual repair preparation (openvc/repair.h): argument checks, the workspace
// layout and the launches, all stream-ordered (no allocation, no host synchronization):
//   kEnergy:      memset(select state) -> energy_kernel -> 8 x select_pass_kernel -> cub::DeviceSelect
//                 -> gather_selected_kernel -> cub::DeviceSegmentedRadixSort -> build_rows_kernel
//   kGivenTokens: energy_kernel<amax only> -> build_rows_kernel
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include "common/alignment.h"
#include "common/cuda_check.h"
#include "openvc/repair.h"
#include "repair/build_rows.cuh"
#include "repair/energy.cuh"
#include "repair/select.cuh"

namespace openvc {
namespace {

using repair::kD;
using repair::kTile;

constexpr bool packed_columns_match() {
  for (int i = 0; i < 16; ++i)
    if (repair::packed_column(kPackedKeyOrder[i]) != i) return false;
  return true;
}
static_assert(packed_columns_match(), "packed_column() must invert kPackedKeyOrder");
static_assert(repair::kTile == kQuantBlock && repair::kD == kHeadDim, "one CTA tile is one quantization block");
static_assert(repair::kSelectPasses * repair::kDigitBits == 96, "the digits cover the 96-bit key");

// snprintf, not an ostringstream: with torch loaded in the same process, formatting a double through
// iostreams from this library crashed (segfault in the error path, found on the device); printf-style
// formatting has no locale facets to resolve.
std::string format_double(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", x);
  return buf;
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// ---- workspace ------------------------------------------------------------------------------------

// Byte offsets inside the workspace. [zero_begin, zero_end) is cleared by one memset per call.
struct Layout {
  size_t blk_amax, hist, arrive, state, zero_begin, zero_end, keys, sel, num_sel, keys2, keys_sorted, tokens2,
      offsets, temp, temp_bytes, energy_total, given_total;
};

using CountingIt = thrust::counting_iterator<int>;

// The two CUB calls, shared by the size query (temp == nullptr) and the run.
cudaError_t cub_select(void* temp, size_t& bytes, const repair::AtOrAboveThreshold& pred, int* sel, int* num_sel,
                       int64_t items, cudaStream_t stream) {
  return cub::DeviceSelect::If(temp, bytes, CountingIt(0), sel, num_sel, items, pred, stream);
}
cudaError_t cub_sort(void* temp, size_t& bytes, const uint64_t* keys_in, uint64_t* keys_out, const int* vals_in,
                     int* vals_out, int items, int groups, const int* offsets, cudaStream_t stream) {
  // Bit 63 (the energy's sign) is always 0. The sort is stable and its input is in token order, so
  // equal energies keep the lower token first.
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(temp, bytes, keys_in, keys_out, vals_in, vals_out, items,
                                                            groups, offsets, offsets + 1, 0, 63, stream);
}

// Offsets of everything but the CUB temp storage (pure arithmetic). Requires batch, heads,
// seqlen_k > 0, 0 <= rows <= seqlen_k and batch * heads * seqlen_k < 2^31 (checked by the callers).
Layout layout_of(int batch, int heads, int seqlen_k, int rows) {
  const size_t G = static_cast<size_t>(batch) * heads, S = static_cast<size_t>(seqlen_k);
  const size_t nblocks = static_cast<size_t>(num_quant_blocks(seqlen_k)), sel = G * rows;
  Layout l{};
  size_t o = 0;
  auto take = [&o](size_t bytes) {
    const size_t at = o;
    o += align_up(bytes);
    return at;
  };
  l.blk_amax = take(G * nblocks * sizeof(float));
  l.given_total = o;  // kGivenTokens needs the block maxima only
  l.zero_begin = o;
  l.hist = take(G * repair::kBins * sizeof(uint32_t));
  l.arrive = take(G * sizeof(uint32_t));
  l.state = take(G * sizeof(repair::SelectState));
  l.zero_end = o;
  l.keys = take(G * S * sizeof(uint64_t));
  l.sel = take(sel * sizeof(int));
  l.num_sel = take(sizeof(int));
  l.keys2 = take(sel * sizeof(uint64_t));
  l.keys_sorted = take(sel * sizeof(uint64_t));
  l.tokens2 = take(sel * sizeof(int));
  l.offsets = take((G + 1) * sizeof(int));
  l.temp = o;
  return l;
}

// Adds the CUB temp storage of the kEnergy path (a host-side query; it needs a CUDA device).
cudaError_t add_cub_temp(int batch, int heads, int seqlen_k, int rows, Layout* l) {
  const int64_t G = static_cast<int64_t>(batch) * heads;
  size_t select_bytes = 0, sort_bytes = 0;
  cudaError_t err = cub_select(nullptr, select_bytes, {}, nullptr, nullptr, G * seqlen_k, nullptr);
  if (err == cudaSuccess)
    err = cub_sort(nullptr, sort_bytes, nullptr, nullptr, nullptr, nullptr, static_cast<int>(G * rows),
                   static_cast<int>(G), nullptr, nullptr);
  if (err != cudaSuccess) {
    cudaGetLastError();  // do not leak the failed query into the caller's next CUDA call
    return err;
  }
  l->temp_bytes = select_bytes > sort_bytes ? select_bytes : sort_bytes;
  l->energy_total = l->temp + align_up(l->temp_bytes);
  return cudaSuccess;
}

// ---- argument checks ------------------------------------------------------------------------------

Status invalid(const std::string& what) { return Status::Invalid("prepare_v_repair: params." + what); }

Status check_ptr(const char* name, const void* p, uintptr_t align) {
  if (p == nullptr) return invalid(std::string(name) + " is null");
  if (!aligned(p, align)) return invalid(std::string(name) + " must be " + std::to_string(align) + "-byte aligned");
  return Status::Ok();
}

Status check_sizes(const RepairPrepareParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return invalid("dtype must be kBFloat16 or kFloat16");
  if (p.cu_seqlens_k != nullptr)
    return invalid("cu_seqlens_k is set, but packed variable-length sequences are not supported by "
                   "prepare_v_repair yet: pass batched [B, Sk, H, D] inputs (cu_seqlens_k null)");
  const struct { const char* name; int v; } sizes[] = {{"batch", p.batch}, {"seqlen_k", p.seqlen_k}, {"heads", p.heads}};
  for (const auto& s : sizes)
    if (s.v <= 0) return invalid(std::string(s.name) + " must be > 0, got " + std::to_string(s.v));
  if (p.head_dim != kHeadDim)
    return Status::Unsupported("prepare_v_repair: params.head_dim must be " + std::to_string(kHeadDim) + " (the "
                               "attention kernel's), got " + std::to_string(p.head_dim));
  const int64_t G = static_cast<int64_t>(p.batch) * p.heads;
  if (G * p.seqlen_k > INT32_MAX)
    return Status::Unsupported("prepare_v_repair: batch * heads * seqlen_k must be < 2^31, got " +
                               std::to_string(G * p.seqlen_k));
  return Status::Ok();
}

Status check_rows(const RepairPrepareParams& p, int* rows) {
  if (p.selection == RepairSelection::kEnergy) {
    const Status st = repair_row_count(p.budget, p.seqlen_k, rows);
    if (!st.ok()) return Status::Invalid("prepare_v_repair: params." + st.message());
    return Status::Ok();
  }
  if (p.selection != RepairSelection::kGivenTokens) return invalid("selection must be kEnergy or kGivenTokens");
  if (p.given_rows < 0) return invalid("given_rows must be >= 0, got " + std::to_string(p.given_rows));
  const int64_t tiles = static_cast<int64_t>(p.batch) * p.heads * num_quant_blocks(p.given_rows);
  if (tiles > INT32_MAX)
    return Status::Unsupported("prepare_v_repair: batch * heads * ceil(given_rows/128) exceeds 2^31 - 1 thread blocks");
  *rows = p.given_rows;
  return Status::Ok();
}

Status check_pointers(const RepairPrepareParams& p) {
  const TokenTensorView& v = p.v;
  if (v.data == nullptr) return invalid("v.data is null");
  if (!aligned(v.data, 16)) return invalid("v.data must be 16-byte aligned (the kernels use 16-byte loads)");
  const struct { const char* field; int64_t s; } strides[] = {
      {"stride_batch", v.stride_batch}, {"stride_seq", v.stride_seq}, {"stride_head", v.stride_head}};
  for (const auto& s : strides)
    if (s.s % 8 != 0)
      return invalid(std::string("v.") + s.field + " must be a multiple of 8 elements (16 bytes), got " +
                     std::to_string(s.s));
  OPENVC_RETURN_IF_ERROR(check_ptr("k_codes", p.k_codes, 16));
  OPENVC_RETURN_IF_ERROR(check_ptr("k_descale", p.k_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_ptr("v_packed", p.v_packed, 16));
  OPENVC_RETURN_IF_ERROR(check_ptr("v_descale", p.v_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_ptr("tokens", p.tokens, alignof(int)));
  OPENVC_RETURN_IF_ERROR(check_ptr("repair_k_codes", p.repair_k_codes, 16));
  OPENVC_RETURN_IF_ERROR(check_ptr("repair_k_descale", p.repair_k_descale, alignof(float)));
  OPENVC_RETURN_IF_ERROR(check_ptr("repair_v_packed", p.repair_v_packed, 16));
  return check_ptr("workspace", p.workspace, 16);
}

// ---- launches -------------------------------------------------------------------------------------

template <typename T>
Status launch(const RepairPrepareParams& p, int rows, const Layout& l, cudaStream_t stream) {
  auto* ws = static_cast<uint8_t*>(p.workspace);
  const int G = p.batch * p.heads, S = p.seqlen_k;
  const int nblocks = static_cast<int>(num_quant_blocks(S));
  const bool energy = p.selection == RepairSelection::kEnergy;
  const prepare::TokenArgs vargs{p.v.data, p.v.stride_batch, p.v.stride_seq, p.v.stride_head, S, nullptr};
  auto* blk_amax = reinterpret_cast<float*>(ws + l.blk_amax);
  auto* keys = reinterpret_cast<uint64_t*>(ws + l.keys);

  repair::EnergyArgs ea{vargs, p.v_packed, p.v_descale, p.heads, nblocks, packed_seqlen_k(S), keys, blk_amax};
  const unsigned energy_ctas = static_cast<unsigned>(static_cast<int64_t>(G) * nblocks);
  const int* tokens = p.tokens;
  if (energy) {
    OPENVC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ws + l.zero_begin, 0, l.zero_end - l.zero_begin, stream));
    repair::energy_kernel<T, true><<<energy_ctas, repair::kEnergyThreads, 0, stream>>>(ea);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("repair energy_kernel launch");

    auto* state = reinterpret_cast<repair::SelectState*>(ws + l.state);
    const int chunks = (S + repair::kSelectChunk - 1) / repair::kSelectChunk;
    const repair::SelectArgs sa{keys, S, rows, chunks, state, reinterpret_cast<uint32_t*>(ws + l.hist),
                                reinterpret_cast<uint32_t*>(ws + l.arrive)};
    for (int pass = 0; pass < repair::kSelectPasses; ++pass) {
      repair::select_pass_kernel<<<static_cast<unsigned>(G * chunks), repair::kSelectThreads, 0, stream>>>(sa, pass);
      OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("repair select_pass_kernel launch");
    }

    auto* sel = reinterpret_cast<int*>(ws + l.sel);
    auto* keys2 = reinterpret_cast<uint64_t*>(ws + l.keys2);
    auto* tokens2 = reinterpret_cast<int*>(ws + l.tokens2);
    auto* offsets = reinterpret_cast<int*>(ws + l.offsets);
    size_t temp_bytes = l.temp_bytes;
    OPENVC_CUDA_RETURN_IF_ERROR(cub_select(ws + l.temp, temp_bytes, repair::AtOrAboveThreshold{keys, state, S}, sel,
                                           reinterpret_cast<int*>(ws + l.num_sel), static_cast<int64_t>(G) * S, stream));
    const int64_t total = static_cast<int64_t>(G) * rows;
    const int64_t threads = total > G ? total : G + 1;
    repair::gather_selected_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
        sel, keys, S, rows, total, G, keys2, tokens2, offsets);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("repair gather_selected_kernel launch");
    temp_bytes = l.temp_bytes;
    OPENVC_CUDA_RETURN_IF_ERROR(cub_sort(ws + l.temp, temp_bytes, keys2, reinterpret_cast<uint64_t*>(ws + l.keys_sorted),
                                         tokens2, p.tokens, static_cast<int>(total), G, offsets, stream));
  } else {
    repair::energy_kernel<T, false><<<energy_ctas, repair::kEnergyThreads, 0, stream>>>(ea);
    OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("repair energy_kernel (amax) launch");
  }

  const int row_tiles = static_cast<int>(num_quant_blocks(rows));
  repair::BuildArgs ba{vargs, p.k_codes, p.k_descale, p.v_packed, p.v_descale, blk_amax, tokens, p.heads, nblocks,
                       rows, row_tiles, packed_seqlen_k(S), repair_padded_rows(rows), p.repair_k_codes,
                       p.repair_k_descale, p.repair_v_packed};
  repair::build_rows_kernel<T><<<static_cast<unsigned>(static_cast<int64_t>(G) * row_tiles), repair::kBuildThreads, 0,
                                 stream>>>(ba);
  OPENVC_CUDA_RETURN_IF_LAUNCH_ERROR("repair build_rows_kernel launch");
  return Status::Ok();
}

}  // namespace

Status repair_row_count(double budget, int64_t seqlen_k, int* rows) {
  // The budget comes first: it is the argument users get wrong, and its message must name it.
  if (!std::isfinite(budget) || budget < 0.0 || budget >= 1.0)
    return Status::Invalid("budget must be finite and in [0, 1), got " + format_double(budget));
  if (seqlen_k < 0 || seqlen_k > INT32_MAX)
    return Status::Invalid("seqlen_k must be in [0, 2^31), got " + std::to_string(seqlen_k));
  if (rows == nullptr) return Status::Invalid("rows must not be null");
  // Round half away from zero on the double product, as the reference does (budget < 1: rows <= Sk).
  *rows = static_cast<int>(std::llround(budget * static_cast<double>(seqlen_k)));
  return Status::Ok();
}

size_t repair_workspace_bytes(int batch, int heads, int seqlen_k, int rows) {
  if (batch <= 0 || heads <= 0 || seqlen_k <= 0 || rows < 0) return 0;
  if (static_cast<int64_t>(batch) * heads * seqlen_k > INT32_MAX) return 0;
  // More rows than tokens: only a kGivenTokens call can ask for that, and it needs the block maxima only.
  if (rows > seqlen_k) return layout_of(batch, heads, seqlen_k, 0).given_total;
  Layout l = layout_of(batch, heads, seqlen_k, rows);
  return add_cub_temp(batch, heads, seqlen_k, rows, &l) == cudaSuccess ? l.energy_total : 0;
}

int repair_rows_of(const RepairPrepareParams& p) {
  if (p.selection == RepairSelection::kGivenTokens) return p.given_rows > 0 ? p.given_rows : 0;
  int rows = 0;
  return repair_row_count(p.budget, p.seqlen_k, &rows).ok() ? rows : 0;
}

RepairInputs repair_inputs(const RepairPrepareParams& p) {
  RepairInputs r;
  r.rows = repair_rows_of(p);
  r.k_codes = p.repair_k_codes;
  r.k_descale = p.repair_k_descale;
  r.v_packed = p.repair_v_packed;
  r.tokens = p.tokens;
  return r;
}

Status prepare_v_repair(const RepairPrepareParams& params, cudaStream_t stream) {
  int rows = 0;
  OPENVC_RETURN_IF_ERROR(check_rows(params, &rows));  // the budget first, like the reference
  OPENVC_RETURN_IF_ERROR(check_sizes(params));
  if (rows == 0) return Status::Ok();  // nothing to repair: the plain path
  OPENVC_RETURN_IF_ERROR(check_pointers(params));
  const bool energy = params.selection == RepairSelection::kEnergy;
  Layout l = layout_of(params.batch, params.heads, params.seqlen_k, energy ? rows : 0);
  if (energy) OPENVC_CUDA_RETURN_IF_ERROR(add_cub_temp(params.batch, params.heads, params.seqlen_k, rows, &l));
  const size_t need = energy ? l.energy_total : l.given_total;
  if (params.workspace_bytes < need)
    return invalid("workspace_bytes is " + std::to_string(params.workspace_bytes) + ", repair_workspace_bytes(batch, "
                   "heads, seqlen_k, " + std::to_string(rows) + ") = " + std::to_string(need) + " needed");
  int device = 0;
  OPENVC_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (!device_supports_sm90a(device))
    return Status::Unsupported("prepare_v_repair: device " + std::to_string(device) +
                               " is not compute capability 9.0 (the kernels are built for sm_90a only)");
  return params.dtype == DType::kBFloat16 ? launch<prepare::Bf16>(params, rows, l, stream)
                                          : launch<prepare::F16>(params, rows, l, stream);
}

}  // namespace openvc
