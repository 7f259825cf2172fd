// GPU entry points of the VC-Attention baseline (openvc/baselines.h) for open_vc_attn.baselines: raw
// device pointers as ints, sizes, element strides and the caller's stream in; nothing allocated, nothing
// synced. Same conventions as gpu.cc: argument checks with readable messages live in Python, the C++
// checks still run and a non-ok Status becomes ValueError (invalid argument) or RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>

#include "openvc/baselines.h"
#include "openvc/status.h"
#include "gpu_util.h"

namespace nb = nanobind;

namespace {

using namespace openvc_bindings;

openvc::DType dtype(bool bf16) { return bf16 ? openvc::DType::kBFloat16 : openvc::DType::kFloat16; }

void vc_grouping(bool bf16, int batch, int seqlen, int heads, int head_dim, const View& v, uintptr_t permutation,
                 uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
  openvc::VcGroupingParams p;
  p.dtype = dtype(bf16);
  p.batch = batch, p.seqlen = seqlen, p.heads = heads, p.head_dim = head_dim;
  p.v = view(v);
  p.permutation = ptr<int>(permutation);
  p.workspace = ptr<void>(workspace), p.workspace_bytes = workspace_bytes;
  enqueue([&] { return openvc::vc_grouping(p, reinterpret_cast<cudaStream_t>(stream)); });
}

void vc_prepare(bool bf16, int batch, int seqlen_q, int seqlen_k, int heads, int head_dim, const View& q,
                const View& k, const View& v, uintptr_t permutation, uintptr_t q_codes, uintptr_t q_descale,
                uintptr_t k_codes, uintptr_t k_descale, uintptr_t v_packed, uintptr_t v_channel_descale,
                uintptr_t block_mean_scaled, uintptr_t block_mean, uintptr_t workspace, size_t workspace_bytes,
                uintptr_t stream) {
  openvc::VcPrepareParams p;
  p.dtype = dtype(bf16);
  p.batch = batch, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k, p.heads = heads, p.head_dim = head_dim;
  p.q = view(q), p.k = view(k), p.v = view(v);
  p.permutation = ptr<const int>(permutation);
  p.q_codes = ptr<uint8_t>(q_codes), p.q_descale = ptr<float>(q_descale);
  p.k_codes = ptr<uint8_t>(k_codes), p.k_descale = ptr<float>(k_descale);
  p.v_packed = ptr<uint8_t>(v_packed), p.v_channel_descale = ptr<float>(v_channel_descale);
  p.block_mean_scaled = ptr<float>(block_mean_scaled);
  p.block_mean = ptr<uint16_t>(block_mean);  // 0: not written
  p.workspace = ptr<void>(workspace), p.workspace_bytes = workspace_bytes;
  enqueue([&] { return openvc::vc_prepare(p, reinterpret_cast<cudaStream_t>(stream)); });
}

void attention_vc_fp8(int batch, int seqlen_q, int seqlen_k, int heads, int head_dim, uintptr_t q_codes,
                      uintptr_t q_descale, uintptr_t k_codes, uintptr_t k_descale, uintptr_t v_packed,
                      uintptr_t v_channel_descale, uintptr_t block_mean_scaled, uintptr_t out,
                      int64_t out_stride_batch, int64_t out_stride_seq, int64_t out_stride_head, uintptr_t lse,
                      float softmax_scale, uintptr_t stream) {
  openvc::VcAttentionParams p;
  // in.v_descale is not read in VC mode (the per-channel descales below replace it).
  p.in = fp8_inputs(batch, seqlen_q, seqlen_k, heads, head_dim, q_codes, q_descale, k_codes, k_descale, v_packed, 0);
  p.v_channel_descale = ptr<const float>(v_channel_descale);
  p.block_mean_scaled = ptr<const float>(block_mean_scaled);
  set_output(p, out, out_stride_batch, out_stride_seq, out_stride_head, lse, softmax_scale);
  enqueue([&] { return openvc::attention_vc_fp8(p, reinterpret_cast<cudaStream_t>(stream)); });
}

}  // namespace

void register_vc(nb::module_& m) {
  m.def("vc_grouping_workspace_bytes", &openvc::vc_grouping_workspace_bytes, nb::arg("batch"), nb::arg("heads"),
        nb::arg("seqlen"), nb::arg("head_dim") = openvc::kHeadDim);
  m.def("vc_grouping", &vc_grouping, nb::arg("bf16"), nb::arg("batch"), nb::arg("seqlen"), nb::arg("heads"),
        nb::arg("head_dim"), nb::arg("v"), nb::arg("permutation"), nb::arg("workspace"),
        nb::arg("workspace_bytes"), nb::arg("stream"),
        "Enqueues openvc::vc_grouping on `stream`; v is a (ptr, stride_b, stride_s, stride_h) tuple, "
        "permutation an int32 [B, H, S] device pointer.");
  m.def("vc_prepare_workspace_bytes", &openvc::vc_prepare_workspace_bytes, nb::arg("batch"), nb::arg("heads"),
        nb::arg("head_dim") = openvc::kHeadDim);
  m.def("vc_prepare", &vc_prepare, nb::arg("bf16"), nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
        nb::arg("heads"), nb::arg("head_dim"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("permutation"),
        nb::arg("q_codes"), nb::arg("q_descale"), nb::arg("k_codes"), nb::arg("k_descale"), nb::arg("v_packed"),
        nb::arg("v_channel_descale"), nb::arg("block_mean_scaled"), nb::arg("block_mean"), nb::arg("workspace"),
        nb::arg("workspace_bytes"), nb::arg("stream"),
        "Enqueues openvc::vc_prepare on `stream`; block_mean = 0 skips the optional BF16 means.");
  m.def("attention_vc_fp8", &attention_vc_fp8, nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
        nb::arg("heads"), nb::arg("head_dim"), nb::arg("q_codes"), nb::arg("q_descale"), nb::arg("k_codes"),
        nb::arg("k_descale"), nb::arg("v_packed"), nb::arg("v_channel_descale"), nb::arg("block_mean_scaled"),
        nb::arg("out"), nb::arg("out_stride_batch"), nb::arg("out_stride_seq"), nb::arg("out_stride_head"),
        nb::arg("lse"), nb::arg("softmax_scale"), nb::arg("stream"),
        "Enqueues openvc::attention_vc_fp8 on `stream`; lse = 0 skips the LSE output.");
}
