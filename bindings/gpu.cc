// GPU entry points of _openvc_ext (openvc/attention.h, openvc/general.h) for open_vc_attn.ops: the C++
// parameter structs bound as Python classes whose fields are set by name (device pointers as ints,
// element strides), and one `fn(params, stream)` per API call; nothing allocated, nothing synced.
// Tensors, their allocation and the argument checks with readable messages live in Python
// (open_vc_attn._checks, open_vc_attn.ops); the C++ checks still run and a non-ok Status becomes
// ValueError / RuntimeError.
#include <nanobind/nanobind.h>

#include "openvc/attention.h"
#include "openvc/general.h"
#include "util.h"

namespace nb = nanobind;

void register_gpu(nb::module_& m) {
  using namespace openvc;
  m.attr("KERNEL_HEAD_DIM") = kHeadDim;
  m.attr("DEFAULT_MID_WINDOW_BLOCKS") = AttentionParams{}.mid_window_blocks;  // the Python default too
  nb::list order;  // packed V column c holds key PACKED_KEY_ORDER[c] of its 16-key group
  for (int key : kPackedKeyOrder) order.append(key);
  m.attr("PACKED_KEY_ORDER") = nb::tuple(order);

  nb::enum_<DType>(m, "DType").value("float16", DType::kFloat16).value("bfloat16", DType::kBFloat16);
  nb::enum_<QkFormat>(m, "QkFormat").value("e4m3", QkFormat::kE4M3).value("int8", QkFormat::kInt8);
  nb::enum_<PFormat>(m, "PFormat").value("expcast", PFormat::kExpCast).value("exp2", PFormat::kExp2);
  m.attr("INT8_KEY_GROUPS") = kInt8KeyGroups;  // INT8 K descales per 128-key block (numerics section 9)

  auto view = openvc_bindings::params_class<TokenTensorView>(
      m, "TokenTensorView", "A strided [B, S, H, D] device tensor (strides in elements).");
  OPENVC_FIELD(view, TokenTensorView, data);
  OPENVC_FIELD(view, TokenTensorView, stride_batch);
  OPENVC_FIELD(view, TokenTensorView, stride_seq);
  OPENVC_FIELD(view, TokenTensorView, stride_head);

  auto blocks = openvc_bindings::params_class<KeyBlockList>(
      m, "KeyBlockList", "openvc::KeyBlockList (key block lists of block-sparse attention; device int32 arrays).");
  OPENVC_FIELD(blocks, KeyBlockList, num_blocks);
  OPENVC_FIELD(blocks, KeyBlockList, indices);
  OPENVC_FIELD(blocks, KeyBlockList, batch);
  OPENVC_FIELD(blocks, KeyBlockList, heads);
  OPENVC_FIELD(blocks, KeyBlockList, q_tiles);
  OPENVC_FIELD(blocks, KeyBlockList, capacity);

  auto inputs = openvc_bindings::params_class<Fp8Inputs>(m, "Fp8Inputs", "openvc::Fp8Inputs (prepared FP8 inputs).");
  OPENVC_FIELD(inputs, Fp8Inputs, batch);
  OPENVC_FIELD(inputs, Fp8Inputs, seqlen_q);
  OPENVC_FIELD(inputs, Fp8Inputs, seqlen_k);
  OPENVC_FIELD(inputs, Fp8Inputs, heads);
  OPENVC_FIELD(inputs, Fp8Inputs, head_dim);
  OPENVC_FIELD(inputs, Fp8Inputs, q_codes);
  OPENVC_FIELD(inputs, Fp8Inputs, q_descale);
  OPENVC_FIELD(inputs, Fp8Inputs, k_codes);
  OPENVC_FIELD(inputs, Fp8Inputs, k_descale);
  OPENVC_FIELD(inputs, Fp8Inputs, v_packed);
  OPENVC_FIELD(inputs, Fp8Inputs, v_descale);
  OPENVC_FIELD(inputs, Fp8Inputs, qk_format);
  OPENVC_FIELD(inputs, Fp8Inputs, kv_heads);
  OPENVC_FIELD(inputs, Fp8Inputs, v_bias);

  auto prep = openvc_bindings::params_class<PrepareParams>(m, "PrepareParams", "openvc::PrepareParams.");
  OPENVC_FIELD(prep, PrepareParams, dtype);
  OPENVC_FIELD(prep, PrepareParams, qk_format);
  OPENVC_FIELD(prep, PrepareParams, batch);
  OPENVC_FIELD(prep, PrepareParams, seqlen_q);
  OPENVC_FIELD(prep, PrepareParams, seqlen_k);
  OPENVC_FIELD(prep, PrepareParams, heads);
  OPENVC_FIELD(prep, PrepareParams, kv_heads);
  OPENVC_FIELD(prep, PrepareParams, v_bias);
  OPENVC_FIELD(prep, PrepareParams, head_dim);
  OPENVC_FIELD(prep, PrepareParams, q);
  OPENVC_FIELD(prep, PrepareParams, k);
  OPENVC_FIELD(prep, PrepareParams, v);
  OPENVC_FIELD(prep, PrepareParams, cu_seqlens_q);
  OPENVC_FIELD(prep, PrepareParams, cu_seqlens_k);
  OPENVC_FIELD(prep, PrepareParams, max_seqlen_q);
  OPENVC_FIELD(prep, PrepareParams, max_seqlen_k);
  OPENVC_FIELD(prep, PrepareParams, num_seqs);
  OPENVC_FIELD(prep, PrepareParams, total_q);
  OPENVC_FIELD(prep, PrepareParams, total_k);
  OPENVC_FIELD(prep, PrepareParams, seqused_k);
  OPENVC_FIELD(prep, PrepareParams, q_codes);
  OPENVC_FIELD(prep, PrepareParams, q_descale);
  OPENVC_FIELD(prep, PrepareParams, k_codes);
  OPENVC_FIELD(prep, PrepareParams, k_descale);
  OPENVC_FIELD(prep, PrepareParams, v_packed);
  OPENVC_FIELD(prep, PrepareParams, v_descale);
  OPENVC_FIELD(prep, PrepareParams, workspace);
  OPENVC_FIELD(prep, PrepareParams, workspace_bytes);
  OPENVC_FIELD(prep, PrepareParams, k_smoothing);
  OPENVC_FIELD(prep, PrepareParams, k_codes_rows);
  OPENVC_FIELD(prep, PrepareParams, k_descale_blocks);
  OPENVC_FIELD(prep, PrepareParams, v_packed_columns);
  OPENVC_FIELD(prep, PrepareParams, v_descale_per_block);
  OPENVC_FIELD(prep, PrepareParams, kv_prefix_len);
  OPENVC_FIELD(prep, PrepareParams, k_prefix);
  OPENVC_FIELD(prep, PrepareParams, v_prefix);

  // RepairInputs::tokens is not bound: attention never reads it.
  auto repair = openvc_bindings::params_class<RepairInputs>(m, "RepairInputs", "openvc::RepairInputs (repair rows).");
  OPENVC_FIELD(repair, RepairInputs, rows);
  OPENVC_FIELD(repair, RepairInputs, k_codes);
  OPENVC_FIELD(repair, RepairInputs, k_descale);
  OPENVC_FIELD(repair, RepairInputs, v_packed);

  // `in` is a Python keyword: the field is `in_` in Python.
  auto attn = openvc_bindings::params_class<AttentionParams>(m, "AttentionParams", "openvc::AttentionParams.");
  openvc_bindings::field<&AttentionParams::in>(attn, "in_");
  OPENVC_FIELD(attn, AttentionParams, repair);
  OPENVC_FIELD(attn, AttentionParams, out);
  OPENVC_FIELD(attn, AttentionParams, out_stride_batch);
  OPENVC_FIELD(attn, AttentionParams, out_stride_seq);
  OPENVC_FIELD(attn, AttentionParams, out_stride_head);
  OPENVC_FIELD(attn, AttentionParams, lse);
  OPENVC_FIELD(attn, AttentionParams, softmax_scale);
  OPENVC_FIELD(attn, AttentionParams, mid_window_blocks);
  OPENVC_FIELD(attn, AttentionParams, causal);
  OPENVC_FIELD(attn, AttentionParams, cu_seqlens_q);
  OPENVC_FIELD(attn, AttentionParams, cu_seqlens_k);
  OPENVC_FIELD(attn, AttentionParams, num_seqs);
  OPENVC_FIELD(attn, AttentionParams, max_seqlen_q);
  OPENVC_FIELD(attn, AttentionParams, max_seqlen_k);
  OPENVC_FIELD(attn, AttentionParams, total_q);
  OPENVC_FIELD(attn, AttentionParams, total_k);
  OPENVC_FIELD(attn, AttentionParams, seqused_k);
  OPENVC_FIELD(attn, AttentionParams, p_format);
  OPENVC_FIELD(attn, AttentionParams, out_dtype);
  OPENVC_FIELD(attn, AttentionParams, blocks);
  OPENVC_FIELD(attn, AttentionParams, causal_chunk);
  OPENVC_FIELD(attn, AttentionParams, v_descale_per_block);

  auto general = openvc_bindings::params_class<GeneralAttentionParams>(m, "GeneralAttentionParams",
                                                                      "openvc::GeneralAttentionParams.");
  openvc_bindings::field<&GeneralAttentionParams::in>(general, "in_");
  OPENVC_FIELD(general, GeneralAttentionParams, causal);
  OPENVC_FIELD(general, GeneralAttentionParams, cu_seqlens_q);
  OPENVC_FIELD(general, GeneralAttentionParams, cu_seqlens_k);
  OPENVC_FIELD(general, GeneralAttentionParams, num_seqs);
  OPENVC_FIELD(general, GeneralAttentionParams, max_seqlen_q);
  OPENVC_FIELD(general, GeneralAttentionParams, max_seqlen_k);
  OPENVC_FIELD(general, GeneralAttentionParams, total_q);
  OPENVC_FIELD(general, GeneralAttentionParams, total_k);
  OPENVC_FIELD(general, GeneralAttentionParams, seqused_k);
  OPENVC_FIELD(general, GeneralAttentionParams, out_dtype);
  OPENVC_FIELD(general, GeneralAttentionParams, out);
  OPENVC_FIELD(general, GeneralAttentionParams, out_stride_batch);
  OPENVC_FIELD(general, GeneralAttentionParams, out_stride_seq);
  OPENVC_FIELD(general, GeneralAttentionParams, out_stride_head);
  OPENVC_FIELD(general, GeneralAttentionParams, lse);
  OPENVC_FIELD(general, GeneralAttentionParams, lse_stride_batch);
  OPENVC_FIELD(general, GeneralAttentionParams, lse_stride_head);
  OPENVC_FIELD(general, GeneralAttentionParams, softmax_scale);
  OPENVC_FIELD(general, GeneralAttentionParams, mid_window_blocks);
  OPENVC_FIELD(general, GeneralAttentionParams, blocks);
  OPENVC_FIELD(general, GeneralAttentionParams, causal_chunk);

  m.def("prepare_workspace_bytes", &prepare_workspace_bytes, nb::arg("groups"), nb::arg("heads"),
        nb::arg("max_seqlen_k"), nb::arg("k_smoothing"), nb::arg("v_bias") = false,
        "Workspace of prepare_fp8: (batch, heads, seqlen_k, k_smoothing, v_bias), or (num_seqs, heads, max_seqlen_k, "
        "k_smoothing, v_bias) for packed sequences; max_seqlen_k is used only with k_smoothing.");
  openvc_bindings::def_enqueue<PrepareParams, &prepare_fp8>(
      m, "prepare_fp8", "Enqueues openvc::prepare_fp8 (batched, or packed sequences with cu_seqlens_q/k) on `stream`.");
  openvc_bindings::def_enqueue<AttentionParams, &attention_fp8>(
      m, "attention_fp8", "Enqueues openvc::attention_fp8 (with repair rows when repair.rows > 0) on `stream`.");
  openvc_bindings::def_enqueue<GeneralAttentionParams, &attention_general>(
      m, "attention_general", "Enqueues openvc::attention_general (causal, packed sequences, head_dim 64/128).");
}
