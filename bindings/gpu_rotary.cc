// GPU entry point of the rotary embedding (openvc/rotary.h) for open_vc_attn.ops.rotary: the parameter
// struct bound by field name (device pointers as ints) and `rotary_pairs(params, stream)`; nothing
// allocated, nothing synced. Same conventions as gpu.cc.
#include <nanobind/nanobind.h>

#include "openvc/rotary.h"
#include "util.h"

namespace nb = nanobind;

void register_rotary(nb::module_& m) {
  using namespace openvc;
  auto r = openvc_bindings::params_class<RotaryPairsParams>(m, "RotaryPairsParams", "openvc::RotaryPairsParams.");
  OPENVC_FIELD(r, RotaryPairsParams, dtype);
  OPENVC_FIELD(r, RotaryPairsParams, batch);
  OPENVC_FIELD(r, RotaryPairsParams, seqlen);
  OPENVC_FIELD(r, RotaryPairsParams, heads);
  OPENVC_FIELD(r, RotaryPairsParams, head_dim);
  OPENVC_FIELD(r, RotaryPairsParams, x);
  OPENVC_FIELD(r, RotaryPairsParams, out);
  OPENVC_FIELD(r, RotaryPairsParams, out_stride_batch);
  OPENVC_FIELD(r, RotaryPairsParams, out_stride_seq);
  OPENVC_FIELD(r, RotaryPairsParams, out_stride_head);
  OPENVC_FIELD(r, RotaryPairsParams, cos);
  OPENVC_FIELD(r, RotaryPairsParams, sin);
  OPENVC_FIELD(r, RotaryPairsParams, table_stride_seq);
  OPENVC_FIELD(r, RotaryPairsParams, table_stride_head);
  OPENVC_FIELD(r, RotaryPairsParams, table_stride_pair);
  OPENVC_FIELD(r, RotaryPairsParams, table_stride_half);
  openvc_bindings::def_enqueue<RotaryPairsParams, &rotary_pairs>(m, "rotary_pairs", "Enqueues openvc::rotary_pairs.");
}
