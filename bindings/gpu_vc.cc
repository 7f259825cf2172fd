// GPU entry points of the VC-Attention baseline (openvc/baselines.h) for open_vc_attn.ops: the
// parameter structs bound by field name (device pointers as ints) and one `fn(params, stream)` per API
// call; nothing allocated, nothing synced. Same conventions as gpu.cc.
#include <nanobind/nanobind.h>

#include "openvc/baselines.h"
#include "util.h"

namespace nb = nanobind;

void register_vc(nb::module_& m) {
  using namespace openvc;
  auto g = openvc_bindings::params_class<VcGroupingParams>(m, "VcGroupingParams", "openvc::VcGroupingParams.");
  OPENVC_FIELD(g, VcGroupingParams, dtype);
  OPENVC_FIELD(g, VcGroupingParams, batch);
  OPENVC_FIELD(g, VcGroupingParams, seqlen);
  OPENVC_FIELD(g, VcGroupingParams, heads);
  OPENVC_FIELD(g, VcGroupingParams, head_dim);
  OPENVC_FIELD(g, VcGroupingParams, v);
  OPENVC_FIELD(g, VcGroupingParams, permutation);
  OPENVC_FIELD(g, VcGroupingParams, workspace);
  OPENVC_FIELD(g, VcGroupingParams, workspace_bytes);

  auto p = openvc_bindings::params_class<VcPrepareParams>(m, "VcPrepareParams", "openvc::VcPrepareParams.");
  OPENVC_FIELD(p, VcPrepareParams, dtype);
  OPENVC_FIELD(p, VcPrepareParams, batch);
  OPENVC_FIELD(p, VcPrepareParams, seqlen_q);
  OPENVC_FIELD(p, VcPrepareParams, seqlen_k);
  OPENVC_FIELD(p, VcPrepareParams, heads);
  OPENVC_FIELD(p, VcPrepareParams, head_dim);
  OPENVC_FIELD(p, VcPrepareParams, q);
  OPENVC_FIELD(p, VcPrepareParams, k);
  OPENVC_FIELD(p, VcPrepareParams, v);
  OPENVC_FIELD(p, VcPrepareParams, permutation);
  OPENVC_FIELD(p, VcPrepareParams, q_codes);
  OPENVC_FIELD(p, VcPrepareParams, q_descale);
  OPENVC_FIELD(p, VcPrepareParams, k_codes);
  OPENVC_FIELD(p, VcPrepareParams, k_descale);
  OPENVC_FIELD(p, VcPrepareParams, v_packed);
  OPENVC_FIELD(p, VcPrepareParams, v_channel_descale);
  OPENVC_FIELD(p, VcPrepareParams, block_mean_scaled);
  OPENVC_FIELD(p, VcPrepareParams, block_mean);
  OPENVC_FIELD(p, VcPrepareParams, workspace);
  OPENVC_FIELD(p, VcPrepareParams, workspace_bytes);

  // in.v_descale is not read in VC mode (the per-channel descales replace it). `in` is `in_` in Python.
  auto a = openvc_bindings::params_class<VcAttentionParams>(m, "VcAttentionParams", "openvc::VcAttentionParams.");
  openvc_bindings::field<&VcAttentionParams::in>(a, "in_");
  OPENVC_FIELD(a, VcAttentionParams, v_channel_descale);
  OPENVC_FIELD(a, VcAttentionParams, block_mean_scaled);
  OPENVC_FIELD(a, VcAttentionParams, out);
  OPENVC_FIELD(a, VcAttentionParams, out_stride_batch);
  OPENVC_FIELD(a, VcAttentionParams, out_stride_seq);
  OPENVC_FIELD(a, VcAttentionParams, out_stride_head);
  OPENVC_FIELD(a, VcAttentionParams, lse);
  OPENVC_FIELD(a, VcAttentionParams, softmax_scale);
  OPENVC_FIELD(a, VcAttentionParams, out_dtype);

  m.def("vc_grouping_workspace_bytes", &vc_grouping_workspace_bytes, nb::arg("batch"), nb::arg("heads"),
        nb::arg("seqlen"), nb::arg("head_dim") = kHeadDim);
  m.def("vc_prepare_workspace_bytes", &vc_prepare_workspace_bytes, nb::arg("batch"), nb::arg("heads"),
        nb::arg("head_dim") = kHeadDim);
  openvc_bindings::def_enqueue<VcGroupingParams, &vc_grouping>(m, "vc_grouping", "Enqueues openvc::vc_grouping.");
  openvc_bindings::def_enqueue<VcPrepareParams, &vc_prepare>(
      m, "vc_prepare", "Enqueues openvc::vc_prepare (block_mean = 0 skips the optional BF16 means).");
  openvc_bindings::def_enqueue<VcAttentionParams, &attention_vc_fp8>(m, "attention_vc_fp8",
                                                                     "Enqueues openvc::attention_vc_fp8.");
}
