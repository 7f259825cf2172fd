// GPU entry points of _openvc_ext for V residual repair (openvc/repair.h) and attention with repair
// rows, used by open_vc_attn.repair: raw device pointers as ints, sizes, element strides and the
// caller's stream handle in; nothing allocated, nothing synced. Argument checks with readable messages
// live in Python; the C++ checks still run and a non-ok Status becomes ValueError / RuntimeError.
// Registered by register_repair(m), called from module.cc.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>

#include "openvc/attention.h"
#include "openvc/repair.h"
#include "openvc/status.h"
#include "gpu_util.h"

namespace nb = nanobind;

namespace {

using namespace openvc_bindings;

int repair_row_count(double budget, int64_t seqlen_k) {
  int rows = 0;
  check(openvc::repair_row_count(budget, seqlen_k, &rows));
  return rows;
}

// given_rows < 0: select by energy with `budget`; else build rows for the given_rows tokens per head
// already in `tokens`.
void prepare_v_repair(bool bf16, int batch, int seqlen_k, int heads, int head_dim, const View& v, uintptr_t k_codes,
                      uintptr_t k_descale, uintptr_t v_packed, uintptr_t v_descale, double budget, int given_rows,
                      uintptr_t tokens, uintptr_t repair_k_codes, uintptr_t repair_k_descale,
                      uintptr_t repair_v_packed, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
  openvc::RepairPrepareParams p;
  p.dtype = bf16 ? openvc::DType::kBFloat16 : openvc::DType::kFloat16;
  p.batch = batch, p.seqlen_k = seqlen_k, p.heads = heads, p.head_dim = head_dim;
  p.v.data = ptr<const void>(std::get<0>(v));
  p.v.stride_batch = std::get<1>(v), p.v.stride_seq = std::get<2>(v), p.v.stride_head = std::get<3>(v);
  p.k_codes = ptr<const uint8_t>(k_codes), p.k_descale = ptr<const float>(k_descale);
  p.v_packed = ptr<const uint8_t>(v_packed), p.v_descale = ptr<const float>(v_descale);
  if (given_rows >= 0) {
    p.selection = openvc::RepairSelection::kGivenTokens;
    p.given_rows = given_rows;
  } else {
    p.selection = openvc::RepairSelection::kEnergy;
    p.budget = budget;
  }
  p.tokens = ptr<int>(tokens);
  p.repair_k_codes = ptr<uint8_t>(repair_k_codes), p.repair_k_descale = ptr<float>(repair_k_descale);
  p.repair_v_packed = ptr<uint8_t>(repair_v_packed);
  p.workspace = ptr<void>(workspace), p.workspace_bytes = workspace_bytes;
  enqueue([&] { return openvc::prepare_v_repair(p, reinterpret_cast<cudaStream_t>(stream)); });
}

void attention_fp8_repair(int batch, int seqlen_q, int seqlen_k, int heads, int head_dim, uintptr_t q_codes,
                          uintptr_t q_descale, uintptr_t k_codes, uintptr_t k_descale, uintptr_t v_packed,
                          uintptr_t v_descale, int repair_rows, uintptr_t repair_k_codes, uintptr_t repair_k_descale,
                          uintptr_t repair_v_packed, uintptr_t repair_tokens, uintptr_t out, int64_t out_stride_batch,
                          int64_t out_stride_seq, int64_t out_stride_head, uintptr_t lse, float softmax_scale,
                          int mid_window_blocks, uintptr_t stream) {
  openvc::AttentionParams p;
  p.in = fp8_inputs(batch, seqlen_q, seqlen_k, heads, head_dim, q_codes, q_descale, k_codes, k_descale, v_packed,
                    v_descale);
  p.repair.rows = repair_rows;
  p.repair.k_codes = ptr<const uint8_t>(repair_k_codes);
  p.repair.k_descale = ptr<const float>(repair_k_descale);
  p.repair.v_packed = ptr<const uint8_t>(repair_v_packed);
  p.repair.tokens = ptr<const int>(repair_tokens);
  set_output(p, out, out_stride_batch, out_stride_seq, out_stride_head, lse, softmax_scale);
  p.mid_window_blocks = mid_window_blocks;
  enqueue([&] { return openvc::attention_fp8(p, reinterpret_cast<cudaStream_t>(stream)); });
}

}  // namespace

void register_repair(nb::module_& m) {
  m.def("repair_row_count", &repair_row_count, nb::arg("budget"), nb::arg("seqlen_k"),
        "round half away from zero of budget * seqlen_k; ValueError naming budget unless it is finite in [0, 1).");
  m.def("repair_workspace_bytes", &openvc::repair_workspace_bytes, nb::arg("batch"), nb::arg("heads"),
        nb::arg("seqlen_k"), nb::arg("rows"));
  m.def("prepare_v_repair", &prepare_v_repair, nb::arg("bf16"), nb::arg("batch"), nb::arg("seqlen_k"),
        nb::arg("heads"), nb::arg("head_dim"), nb::arg("v"), nb::arg("k_codes"), nb::arg("k_descale"),
        nb::arg("v_packed"), nb::arg("v_descale"), nb::arg("budget"), nb::arg("given_rows"), nb::arg("tokens"),
        nb::arg("repair_k_codes"), nb::arg("repair_k_descale"), nb::arg("repair_v_packed"), nb::arg("workspace"),
        nb::arg("workspace_bytes"), nb::arg("stream"),
        "Enqueues openvc::prepare_v_repair on `stream`; v is a (ptr, stride_b, stride_s, stride_h) tuple. "
        "given_rows < 0 selects by energy with `budget`, else `tokens` holds given_rows tokens per head.");
  m.def("attention_fp8_repair", &attention_fp8_repair, nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
        nb::arg("heads"), nb::arg("head_dim"), nb::arg("q_codes"), nb::arg("q_descale"), nb::arg("k_codes"),
        nb::arg("k_descale"), nb::arg("v_packed"), nb::arg("v_descale"), nb::arg("repair_rows"),
        nb::arg("repair_k_codes"), nb::arg("repair_k_descale"), nb::arg("repair_v_packed"), nb::arg("repair_tokens"),
        nb::arg("out"), nb::arg("out_stride_batch"), nb::arg("out_stride_seq"), nb::arg("out_stride_head"),
        nb::arg("lse"), nb::arg("softmax_scale"), nb::arg("mid_window_blocks"), nb::arg("stream"),
        "Enqueues openvc::attention_fp8 with AttentionParams::repair on `stream`; lse = 0 skips the LSE output.");
}
