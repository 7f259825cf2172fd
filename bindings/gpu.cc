// GPU entry points of _openvc_ext (openvc/attention.h) for open_vc_attn.ops: raw device pointers as
// ints, sizes, element strides and the caller's stream handle in; nothing allocated, nothing synced.
// Tensors, their allocation and the argument checks with readable messages live in Python (ops.py,
// api.py); the C++ checks still run and a non-ok Status becomes ValueError / RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>

#include "openvc/attention.h"
#include "openvc/general.h"
#include "openvc/status.h"
#include "gpu_util.h"

namespace nb = nanobind;

namespace {

using namespace openvc_bindings;

void prepare_fp8(bool bf16, int batch, int seqlen_q, int seqlen_k, int heads, int head_dim, const View& q,
                 const View& k, const View& v, uintptr_t q_codes, uintptr_t q_descale, uintptr_t k_codes,
                 uintptr_t k_descale, uintptr_t v_packed, uintptr_t v_descale, uintptr_t workspace,
                 size_t workspace_bytes, uintptr_t stream) {
  openvc::PrepareParams p;
  p.dtype = bf16 ? openvc::DType::kBFloat16 : openvc::DType::kFloat16;
  p.batch = batch, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k, p.heads = heads, p.head_dim = head_dim;
  p.q = view(q), p.k = view(k), p.v = view(v);
  p.q_codes = ptr<uint8_t>(q_codes), p.q_descale = ptr<float>(q_descale);
  p.k_codes = ptr<uint8_t>(k_codes), p.k_descale = ptr<float>(k_descale);
  p.v_packed = ptr<uint8_t>(v_packed), p.v_descale = ptr<float>(v_descale);
  p.workspace = ptr<void>(workspace), p.workspace_bytes = workspace_bytes;
  enqueue([&] { return openvc::prepare_fp8(p, reinterpret_cast<cudaStream_t>(stream)); });
}

// Packed sequences (attention.h): q/k/v views over [total, H, D] (their stride_batch is ignored),
// cu_seqlens_q/k int32 device pointers of num_seqs + 1 offsets; never read on the host.
void prepare_fp8_varlen(bool bf16, int num_seqs, int max_seqlen_q, int max_seqlen_k, int heads, int head_dim,
                        const View& q, const View& k, const View& v, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k,
                        uintptr_t q_codes, uintptr_t q_descale, uintptr_t k_codes, uintptr_t k_descale,
                        uintptr_t v_packed, uintptr_t v_descale, uintptr_t workspace, size_t workspace_bytes,
                        uintptr_t stream) {
  openvc::PrepareParams p;
  p.dtype = bf16 ? openvc::DType::kBFloat16 : openvc::DType::kFloat16;
  p.num_seqs = num_seqs, p.max_seqlen_q = max_seqlen_q, p.max_seqlen_k = max_seqlen_k;
  p.heads = heads, p.head_dim = head_dim;
  p.q = view(q), p.k = view(k), p.v = view(v);
  p.cu_seqlens_q = ptr<const int>(cu_seqlens_q), p.cu_seqlens_k = ptr<const int>(cu_seqlens_k);
  p.q_codes = ptr<uint8_t>(q_codes), p.q_descale = ptr<float>(q_descale);
  p.k_codes = ptr<uint8_t>(k_codes), p.k_descale = ptr<float>(k_descale);
  p.v_packed = ptr<uint8_t>(v_packed), p.v_descale = ptr<float>(v_descale);
  p.workspace = ptr<void>(workspace), p.workspace_bytes = workspace_bytes;
  enqueue([&] { return openvc::prepare_fp8(p, reinterpret_cast<cudaStream_t>(stream)); });
}

void attention_fp8(int batch, int seqlen_q, int seqlen_k, int heads, int head_dim, uintptr_t q_codes,
                   uintptr_t q_descale, uintptr_t k_codes, uintptr_t k_descale, uintptr_t v_packed,
                   uintptr_t v_descale, uintptr_t out, int64_t out_stride_batch, int64_t out_stride_seq,
                   int64_t out_stride_head, uintptr_t lse, float softmax_scale, int mid_window_blocks,
                   uintptr_t stream) {
  openvc::AttentionParams p;
  p.in = fp8_inputs(batch, seqlen_q, seqlen_k, heads, head_dim, q_codes, q_descale, k_codes, k_descale, v_packed,
                    v_descale);
  set_output(p, out, out_stride_batch, out_stride_seq, out_stride_head, lse, softmax_scale);
  p.mid_window_blocks = mid_window_blocks;
  enqueue([&] { return openvc::attention_fp8(p, reinterpret_cast<cudaStream_t>(stream)); });
}

// The general path (openvc/general.h). Batched: cu_seqlens_q/k = 0 and num_seqs = max_seqlen_q/k = 0.
// Packed: batch/seqlen_q/seqlen_k ignored, out [total_q, H, D] (stride_batch ignored), lse [H, total_q].
void attention_general(int batch, int seqlen_q, int seqlen_k, int heads, int head_dim, uintptr_t cu_seqlens_q,
                       uintptr_t cu_seqlens_k, int num_seqs, int max_seqlen_q, int max_seqlen_k, uintptr_t q_codes,
                       uintptr_t q_descale, uintptr_t k_codes, uintptr_t k_descale, uintptr_t v_packed,
                       uintptr_t v_descale, bool causal, uintptr_t out, int64_t out_stride_batch,
                       int64_t out_stride_seq, int64_t out_stride_head, uintptr_t lse, int64_t lse_stride_batch,
                       int64_t lse_stride_head, float softmax_scale, int mid_window_blocks, uintptr_t stream) {
  openvc::GeneralAttentionParams p;
  p.in = fp8_inputs(batch, seqlen_q, seqlen_k, heads, head_dim, q_codes, q_descale, k_codes, k_descale, v_packed,
                    v_descale);
  p.cu_seqlens_q = ptr<const int>(cu_seqlens_q), p.cu_seqlens_k = ptr<const int>(cu_seqlens_k);
  p.num_seqs = num_seqs, p.max_seqlen_q = max_seqlen_q, p.max_seqlen_k = max_seqlen_k;
  p.causal = causal;
  set_output(p, out, out_stride_batch, out_stride_seq, out_stride_head, lse, softmax_scale);
  p.lse_stride_batch = lse_stride_batch, p.lse_stride_head = lse_stride_head;
  p.mid_window_blocks = mid_window_blocks;
  enqueue([&] { return openvc::attention_general(p, reinterpret_cast<cudaStream_t>(stream)); });
}

}  // namespace

void register_gpu(nb::module_& m) {
  m.attr("KERNEL_HEAD_DIM") = openvc::kHeadDim;
  nb::list order;  // packed V column c holds key PACKED_KEY_ORDER[c] of its 16-key group
  for (int key : openvc::kPackedKeyOrder) order.append(key);
  m.attr("PACKED_KEY_ORDER") = nb::tuple(order);
  m.def("prepare_workspace_bytes", &openvc::prepare_workspace_bytes, nb::arg("batch"), nb::arg("heads"));
  m.def("prepare_fp8", &prepare_fp8, nb::arg("bf16"), nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
        nb::arg("heads"), nb::arg("head_dim"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("q_codes"),
        nb::arg("q_descale"), nb::arg("k_codes"), nb::arg("k_descale"), nb::arg("v_packed"),
        nb::arg("v_descale"), nb::arg("workspace"), nb::arg("workspace_bytes"), nb::arg("stream"),
        "Enqueues openvc::prepare_fp8 on `stream`; q/k/v are (ptr, stride_b, stride_s, stride_h) tuples.");
  m.def("prepare_fp8_varlen", &prepare_fp8_varlen, nb::arg("bf16"), nb::arg("num_seqs"), nb::arg("max_seqlen_q"),
        nb::arg("max_seqlen_k"), nb::arg("heads"), nb::arg("head_dim"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("q_codes"), nb::arg("q_descale"),
        nb::arg("k_codes"), nb::arg("k_descale"), nb::arg("v_packed"), nb::arg("v_descale"), nb::arg("workspace"),
        nb::arg("workspace_bytes"), nb::arg("stream"),
        "Enqueues openvc::prepare_fp8 on packed sequences: q/k/v are [total, H, D] (ptr, 0, stride_s, stride_h) "
        "tuples, cu_seqlens_q/k int32 device pointers (num_seqs + 1 offsets).");
  m.def("attention_fp8", &attention_fp8, nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
        nb::arg("heads"), nb::arg("head_dim"), nb::arg("q_codes"), nb::arg("q_descale"), nb::arg("k_codes"),
        nb::arg("k_descale"), nb::arg("v_packed"), nb::arg("v_descale"), nb::arg("out"),
        nb::arg("out_stride_batch"), nb::arg("out_stride_seq"), nb::arg("out_stride_head"), nb::arg("lse"),
        nb::arg("softmax_scale"), nb::arg("mid_window_blocks"), nb::arg("stream"),
        "Enqueues openvc::attention_fp8 on `stream`; lse = 0 skips the LSE output.");
  m.def("attention_general", &attention_general, nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"),
        nb::arg("heads"), nb::arg("head_dim"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("num_seqs"),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("q_codes"), nb::arg("q_descale"),
        nb::arg("k_codes"), nb::arg("k_descale"), nb::arg("v_packed"), nb::arg("v_descale"), nb::arg("causal"),
        nb::arg("out"), nb::arg("out_stride_batch"), nb::arg("out_stride_seq"), nb::arg("out_stride_head"),
        nb::arg("lse"), nb::arg("lse_stride_batch"), nb::arg("lse_stride_head"), nb::arg("softmax_scale"),
        nb::arg("mid_window_blocks"), nb::arg("stream"),
        "Enqueues openvc::attention_general (causal, packed sequences, head_dim 64/128) on `stream`; cu_seqlens "
        "= 0 for batched inputs; lse = 0 skips the LSE output.");
}
