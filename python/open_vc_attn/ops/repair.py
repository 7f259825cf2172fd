"""Custom ops of V residual repair (docs/repair.md): building repair rows, and attention with them.

- ``open_vc_attn::prepare_v_repair(Tensor v, Tensor k_codes, Tensor k_descale, Tensor v_packed, Tensor v_descale,
  float budget) -> (tokens, repair_k_codes, repair_k_descale, repair_v_packed)``: selects round(budget * Sk)
  tokens per (batch, head) by residual energy and builds their rows (layout of repair.PreparedRepair).
- ``open_vc_attn::build_v_repair(v, k_codes, k_descale, v_packed, v_descale, Tensor tokens) -> (repair_k_codes,
  repair_k_descale, repair_v_packed)``: the rows for the caller's int32 [B, H, rows] tokens.
- ``open_vc_attn::attention_fp8_repair(the six tensors of attention_fp8, repair_k_codes, repair_k_descale,
  repair_v_packed, repair_tokens, float softmax_scale, int mid_window_blocks, bool return_lse) -> (out, lse)``:
  attention_fp8 with the repair rows (repair_tokens only gives the row count: the kernel never reads it).
"""
import torch

from .. import _checks_baselines, _ext
from .._layout import FP8_NAMES, repair_expectations
from . import device as dev
from .fp8 import attention_outputs, fast_params

_PREPARE_SCHEMA = ("(Tensor v, Tensor k_codes, Tensor k_descale, Tensor v_packed, Tensor v_descale, float budget) "
                   "-> (Tensor, Tensor, Tensor, Tensor)")
_BUILD_SCHEMA = ("(Tensor v, Tensor k_codes, Tensor k_descale, Tensor v_packed, Tensor v_descale, Tensor tokens) "
                 "-> (Tensor, Tensor, Tensor)")
_ATTENTION_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                     "Tensor v_descale, Tensor repair_k_codes, Tensor repair_k_descale, Tensor repair_v_packed, "
                     "Tensor repair_tokens, float softmax_scale, int mid_window_blocks, bool return_lse) "
                     "-> (Tensor, Tensor)")


def _outputs(b, h, d, rows, alloc):
    """repair_k_codes, repair_k_descale, repair_v_packed (the first three of repair_expectations)."""
    return tuple(alloc(shape, getattr(torch, dtype)) for _, shape, dtype in repair_expectations(b, h, d, rows)[:3])


def _launch(v, fp8, budget, given_rows, tokens, outs):
    """Enqueues openvc::prepare_v_repair: selection by energy (given_rows < 0) or for the given tokens."""
    b, sk, h, d = (int(s) for s in v.shape)
    dev.launch_checks(v.device, (("v", v), ("k_codes", fp8[0]), ("v_packed", fp8[2])))
    ext = _ext.load()
    rows = given_rows if given_rows >= 0 else _checks_baselines.repair_rows(budget, sk)
    if given_rows < 0 and int(ext.repair_row_count(budget, sk)) != rows:   # the outputs were sized by rows
        raise RuntimeError(f"open_vc_attn: repair row count mismatch for budget {budget!r}, Sk {sk}")
    ws = dev.workspace(ext.repair_workspace_bytes(b, h, sk, rows), v.device)
    p = dev.params(ext.RepairPrepareParams, dtype=dev.dtype_of(v), batch=b, seqlen_k=sk, heads=h, head_dim=d,
                   v=dev.token_view(v), **dict(zip(FP8_NAMES[2:], (t.data_ptr() for t in fp8))),
                   tokens=tokens.data_ptr(), repair_k_codes=outs[0].data_ptr(), repair_k_descale=outs[1].data_ptr(),
                   repair_v_packed=outs[2].data_ptr(), workspace=ws.data_ptr(), workspace_bytes=ws.numel())
    if given_rows >= 0:
        p.selection, p.given_rows = ext.RepairSelection.given_tokens, int(given_rows)
    else:
        p.selection, p.budget = ext.RepairSelection.energy, float(budget)
    dev.enqueue(ext.prepare_v_repair, p, v.device)


@torch.library.custom_op("open_vc_attn::prepare_v_repair", mutates_args=(), device_types="cuda",
                         schema=_PREPARE_SCHEMA)
def _prepare_v_repair(v, k_codes, k_descale, v_packed, v_descale, budget):
    b, sk, h, d = _checks_baselines.check_repair_op_inputs(v, k_codes, k_descale, v_packed, v_descale)
    rows = _checks_baselines.repair_rows(budget, int(sk))
    alloc = dev.empty(v.device)
    tokens, outs = alloc((b, h, rows), torch.int32), _outputs(b, h, d, rows, alloc)
    if rows > 0:
        _launch(v, (k_codes, k_descale, v_packed, v_descale), budget, -1, tokens, outs)
    return (tokens, *outs)


@_prepare_v_repair.register_fake
def _prepare_v_repair_fake(v, k_codes, k_descale, v_packed, v_descale, budget):
    b, sk, h, d = _checks_baselines.check_repair_op_inputs(v, k_codes, k_descale, v_packed, v_descale)
    rows = _checks_baselines.repair_rows(budget, int(sk))   # the row count depends on Sk's value: specialize on it
    alloc = dev.like(v)
    return (alloc((b, h, rows), torch.int32), *_outputs(b, h, d, rows, alloc))


@torch.library.custom_op("open_vc_attn::build_v_repair", mutates_args=(), device_types="cuda", schema=_BUILD_SCHEMA)
def _build_v_repair(v, k_codes, k_descale, v_packed, v_descale, tokens):
    b, sk, h, d = _checks_baselines.check_repair_op_inputs(v, k_codes, k_descale, v_packed, v_descale)
    rows = _checks_baselines.check_repair_tokens(tokens, b, h)
    outs = _outputs(b, h, d, rows, dev.empty(v.device))
    if rows > 0:
        _launch(v, (k_codes, k_descale, v_packed, v_descale), 0.0, rows, tokens, outs)
    return outs


@_build_v_repair.register_fake
def _build_v_repair_fake(v, k_codes, k_descale, v_packed, v_descale, tokens):
    b, sk, h, d = _checks_baselines.check_repair_op_inputs(v, k_codes, k_descale, v_packed, v_descale)
    return _outputs(b, h, d, _checks_baselines.check_repair_tokens(tokens, b, h), dev.like(v))


@torch.library.custom_op("open_vc_attn::attention_fp8_repair", mutates_args=(), device_types="cuda",
                         schema=_ATTENTION_SCHEMA)
def _attention_fp8_repair(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, repair_k_codes,
                          repair_k_descale, repair_v_packed, repair_tokens, softmax_scale, mid_window_blocks,
                          return_lse):
    fp8 = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
    repair = (repair_k_codes, repair_k_descale, repair_v_packed, repair_tokens)
    sizes = tuple(int(s) for s in _checks_baselines.check_repair_fp8(fp8, softmax_scale, mid_window_blocks))
    b, _, _, h, d = sizes
    rows = int(repair_tokens.shape[-1]) if repair_tokens.dim() == 3 else -1
    _checks_baselines.check_repair_tensors(repair, b, h, d, rows)
    dev.launch_checks(q_codes.device, zip(("q_codes", "k_codes", "v_packed", "repair_k_codes", "repair_v_packed"),
                                          (q_codes, k_codes, v_packed, repair_k_codes, repair_v_packed)))
    out, lse = attention_outputs(q_codes, return_lse, dev.empty(q_codes.device))
    p = fast_params(fp8, sizes, out, lse if return_lse else None, softmax_scale, mid_window_blocks)
    p.repair = dev.params(_ext.load().RepairInputs, rows=rows, k_codes=repair_k_codes.data_ptr(),
                          k_descale=repair_k_descale.data_ptr(), v_packed=repair_v_packed.data_ptr())
    dev.enqueue(_ext.load().attention_fp8, p, q_codes.device)
    return out, lse


@_attention_fp8_repair.register_fake
def _attention_fp8_repair_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, repair_k_codes,
                               repair_k_descale, repair_v_packed, repair_tokens, softmax_scale, mid_window_blocks,
                               return_lse):
    _checks_baselines.check_repair_fp8((q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), softmax_scale,
                                       mid_window_blocks)
    return attention_outputs(q_codes, return_lse, dev.like(q_codes))
