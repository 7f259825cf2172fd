// GPU entry points of _openvc_ext for V residual repair (openvc/repair.h), used by open_vc_attn.ops:
// RepairPrepareParams bound by field name (device pointers as ints) and prepare_v_repair(params,
// stream); attention with repair rows is attention_fp8 with AttentionParams.repair set (gpu.cc).
// Argument checks with readable messages live in Python; a non-ok Status becomes ValueError /
// RuntimeError. Registered by register_repair(m), called from module.cc.
#include <nanobind/nanobind.h>

#include <cstdint>

#include "openvc/repair.h"
#include "util.h"

namespace nb = nanobind;

void register_repair(nb::module_& m) {
  using namespace openvc;
  nb::enum_<RepairSelection>(m, "RepairSelection")
      .value("energy", RepairSelection::kEnergy)
      .value("given_tokens", RepairSelection::kGivenTokens);

  auto p = openvc_bindings::params_class<RepairPrepareParams>(m, "RepairPrepareParams", "openvc::RepairPrepareParams.");
  OPENVC_FIELD(p, RepairPrepareParams, dtype);
  OPENVC_FIELD(p, RepairPrepareParams, batch);
  OPENVC_FIELD(p, RepairPrepareParams, seqlen_k);
  OPENVC_FIELD(p, RepairPrepareParams, heads);
  OPENVC_FIELD(p, RepairPrepareParams, head_dim);
  OPENVC_FIELD(p, RepairPrepareParams, v);
  OPENVC_FIELD(p, RepairPrepareParams, cu_seqlens_k);
  OPENVC_FIELD(p, RepairPrepareParams, k_codes);
  OPENVC_FIELD(p, RepairPrepareParams, k_descale);
  OPENVC_FIELD(p, RepairPrepareParams, v_packed);
  OPENVC_FIELD(p, RepairPrepareParams, v_descale);
  OPENVC_FIELD(p, RepairPrepareParams, selection);
  OPENVC_FIELD(p, RepairPrepareParams, budget);
  OPENVC_FIELD(p, RepairPrepareParams, given_rows);
  OPENVC_FIELD(p, RepairPrepareParams, tokens);
  OPENVC_FIELD(p, RepairPrepareParams, repair_k_codes);
  OPENVC_FIELD(p, RepairPrepareParams, repair_k_descale);
  OPENVC_FIELD(p, RepairPrepareParams, repair_v_packed);
  OPENVC_FIELD(p, RepairPrepareParams, workspace);
  OPENVC_FIELD(p, RepairPrepareParams, workspace_bytes);

  m.def(
      "repair_row_count",
      [](double budget, int64_t seqlen_k) {
        int rows = 0;
        openvc_bindings::check(repair_row_count(budget, seqlen_k, &rows));
        return rows;
      },
      nb::arg("budget"), nb::arg("seqlen_k"),
      "round half away from zero of budget * seqlen_k; ValueError naming budget unless it is finite in [0, 1).");
  m.def("repair_workspace_bytes", &repair_workspace_bytes, nb::arg("batch"), nb::arg("heads"), nb::arg("seqlen_k"),
        nb::arg("rows"));
  openvc_bindings::def_enqueue<RepairPrepareParams, &prepare_v_repair>(
      m, "prepare_v_repair",
      "Enqueues openvc::prepare_v_repair on `stream` (selection energy: tokens written; given_tokens: read).");
}
