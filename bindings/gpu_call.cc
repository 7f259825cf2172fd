// The one-call entry of _openvc_ext (openvc/call.h) for open_vc_attn.ops.call: AttentionCall as a Python
// class whose fields are set by name (device pointers as ints), the path query, the workspace size and the
// call itself, run with the GIL released. Nothing allocated, nothing synced.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <string>
#include <utility>

#include "openvc/call.h"
#include "openvc/launch.h"
#include "util.h"

namespace nb = nanobind;

void register_gpu_call(nb::module_& m) {
  using namespace openvc;
  auto call = openvc_bindings::params_class<AttentionCall>(m, "AttentionCall", "openvc::AttentionCall.");
  OPENVC_FIELD(call, AttentionCall, dtype);
  OPENVC_FIELD(call, AttentionCall, heads);
  OPENVC_FIELD(call, AttentionCall, kv_heads);
  OPENVC_FIELD(call, AttentionCall, v_bias_correction);
  OPENVC_FIELD(call, AttentionCall, head_dim);
  OPENVC_FIELD(call, AttentionCall, batch);
  OPENVC_FIELD(call, AttentionCall, seqlen_q);
  OPENVC_FIELD(call, AttentionCall, seqlen_k);
  OPENVC_FIELD(call, AttentionCall, q);
  OPENVC_FIELD(call, AttentionCall, k);
  OPENVC_FIELD(call, AttentionCall, v);
  OPENVC_FIELD(call, AttentionCall, cu_seqlens_q);
  OPENVC_FIELD(call, AttentionCall, cu_seqlens_k);
  OPENVC_FIELD(call, AttentionCall, num_seqs);
  OPENVC_FIELD(call, AttentionCall, max_seqlen_q);
  OPENVC_FIELD(call, AttentionCall, max_seqlen_k);
  OPENVC_FIELD(call, AttentionCall, total_q);
  OPENVC_FIELD(call, AttentionCall, total_k);
  OPENVC_FIELD(call, AttentionCall, seqused_k);
  OPENVC_FIELD(call, AttentionCall, causal);
  OPENVC_FIELD(call, AttentionCall, softmax_scale);
  OPENVC_FIELD(call, AttentionCall, mid_window_blocks);
  OPENVC_FIELD(call, AttentionCall, qk_format);
  OPENVC_FIELD(call, AttentionCall, k_smoothing);
  OPENVC_FIELD(call, AttentionCall, p_format);
  OPENVC_FIELD(call, AttentionCall, out);
  OPENVC_FIELD(call, AttentionCall, out_stride_batch);
  OPENVC_FIELD(call, AttentionCall, out_stride_seq);
  OPENVC_FIELD(call, AttentionCall, out_stride_head);
  OPENVC_FIELD(call, AttentionCall, out_dtype);
  OPENVC_FIELD(call, AttentionCall, lse);
  OPENVC_FIELD(call, AttentionCall, blocks);
  OPENVC_FIELD(call, AttentionCall, causal_chunk);

  m.def("attention_workspace_bytes", &attention_workspace_bytes, nb::arg("call"),
        "Workspace bytes of openvc::attention for this call (pointers are not read).");
  m.def(
      "attention_path",
      [](const AttentionCall& c, int device) {
        AttentionPath path = AttentionPath::kFast;
        std::string reason;
        openvc_bindings::check(openvc::attention_path(c, device, &path, &reason));
        return std::make_pair(std::string(path == AttentionPath::kFast ? "fast" : "general"), reason);
      },
      nb::arg("call"), nb::arg("device"),
      "('fast' or 'general', why not fast) for this call on `device`; ValueError for invalid fields, "
      "RuntimeError for a call no path takes (INT8 or exp2 past the fast path).");
  m.def(
      "attention",
      [](const AttentionCall& c, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
        openvc::Status st;
        {
          nb::gil_scoped_release release;
          st = openvc::attention(c, reinterpret_cast<void*>(workspace), workspace_bytes,
                                 reinterpret_cast<cudaStream_t>(stream));
        }
        openvc_bindings::check(st);
      },
      nb::arg("call"), nb::arg("workspace"), nb::arg("workspace_bytes"), nb::arg("stream"),
      "Enqueues openvc::attention (prepare into `workspace`, then attend on the chosen path) on `stream`.");
  m.def("programmatic_launch", &openvc::programmatic_launch,
        "Whether the library's kernels are launched programmatically (include/openvc/launch.h).");
  m.def("set_programmatic_launch", &openvc::set_programmatic_launch, nb::arg("on"),
        "Turns programmatic launches on or off for launches enqueued after the call; returns the previous setting.");
}
