"""V residual repair on the GPU (docs/numerics.md section 6, docs/repair.md).

- :func:`prepare_v_repair` quantizes ``q, k, v`` (or takes an existing :class:`~open_vc_attn.PreparedFP8`)
  and builds repair rows for the ``round(budget * Sk)`` tokens per (batch, head) whose per-head E4M3 V
  quantization lost the most: their residual ``v - descale_V * decode(V8)`` in E4M3 with the same V scale,
  paired with copies of their K codes (which keep their block descale). Returns a :class:`PreparedRepair`.
- :func:`attention_v_repair` runs the ExpCast kernel with those rows added to the numerator.

``selection="energy"`` (default) ranks tokens by residual energy on the GPU, exactly as the CPU reference
(``open_vc_attn.reference.select_v_repair``). ``selection="attention"`` ranks by energy times the key's
column mass, estimated in FP32 torch from ``sample_rows`` evenly spaced query rows (softmax over all keys,
scale 1/sqrt(D)), and builds the rows for those tokens on the GPU; scripts/device/repair_selection_eval.py
measures whether it lowers the error at equal budgets.

Everything is enqueued on the current stream of the tensors' device with no host synchronization; the
GPU work goes through the custom ops ``open_vc_attn::prepare_v_repair``, ``open_vc_attn::build_v_repair``
and ``open_vc_attn::attention_fp8_repair`` (:mod:`open_vc_attn.ops.repair`, registered with fake
implementations at import of :mod:`open_vc_attn.ops`, so torch.compile traces them even as the first
call). torch is imported inside the functions only. Bad arguments raise TypeError / ValueError whose
message starts with the argument's name.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from . import _checks
from . import _checks_baselines
from ._checks_baselines import SELECTIONS
from ._layout import DEFAULT_MID_WINDOW_BLOCKS, KERNEL_HEAD_DIM, packed_columns
from .api import PreparedFP8, attention_fp8, prepare_fp8

__all__ = ["PreparedRepair", "prepare_v_repair", "attention_v_repair", "repair_rows", "SELECTIONS"]

_CHUNK_ELEMS = 1 << 25   # elements per head chunk of the attention-aware scoring (bounds its memory)


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedRepair:
    """A :class:`PreparedFP8` plus its repair rows (layout of C++ ``openvc::RepairInputs``).

    tokens int32 [B, H, rows] (selected tokens; for "energy" in the order energy desc, token asc),
    k_codes uint8 [B, H, Rpad, D] (copies of the tokens' K codes), k_descale float32 [B, H, Rpad] (their K
    block descales), v_packed uint8 [B, H, D, Rpad] (E4M3 residual codes, rows permuted inside each
    16-row group like the packed V), Rpad = ceil(rows / 128) * 128, padding rows zero. rows == 0 means the
    plain path (the tensors are empty).
    """
    prepared: Any
    budget: float
    selection: str
    rows: int
    tokens: Any
    k_codes: Any
    k_descale: Any
    v_packed: Any

    def tensors(self) -> tuple:
        """The four repair tensors in the argument order of ``open_vc_attn::attention_fp8_repair``."""
        return (self.k_codes, self.k_descale, self.v_packed, self.tokens)


def repair_rows(budget, seqlen_k: int) -> int:
    """Rows per head for ``budget``: round half away from zero of ``budget * seqlen_k`` (double), as the
    C++ ``openvc::repair_row_count`` and the reference compute it."""
    return _checks_baselines.repair_rows(budget, seqlen_k)


def _check_prepared_kind(prepared):
    """Before the tensor checks: a given preparation must be a batched E4M3 PreparedFP8."""
    _checks.require_instance(prepared, PreparedFP8, "prepared", "None or a PreparedFP8 from open_vc_attn.prepare_fp8")
    _checks.require_e4m3(_checks.qk_format(prepared.qk_format, "prepared.qk_format"), "V residual repair",
                         "prepared.qk_format")
    if prepared.is_varlen:
        raise ValueError("prepared: packed variable-length sequences (cu_seqlens) are not supported by "
                         "prepare_v_repair yet: prepare the sequences batched [B, S, H, D]")


def _check_prepared_matches(prepared, v4):
    """A given PreparedFP8 must be a preparation of these tokens (same sizes and device)."""
    meta = _checks.check_prepared_fp8(prepared, what="V residual repair", e4m3_only=True)
    b, sk, h, d = (int(s) for s in v4.shape)
    if (meta["batch"], meta["seqlen_k"], meta["heads"], meta["head_dim"]) != (b, sk, h, d):
        raise ValueError(f"prepared: expected a preparation of k and v with B={b} Sk={sk} H={h} D={d}, got B="
                         f"{meta['batch']} Sk={meta['seqlen_k']} H={meta['heads']} D={meta['head_dim']}")
    if prepared.device != v4.device:
        raise ValueError(f"prepared: expected tensors on v's device {v4.device}, got {prepared.device}")


def prepare_v_repair(q, k, v, budget=0.005, selection="energy", *, prepared=None, sample_rows=64,
                     qk_format="e4m3") -> PreparedRepair:
    """Quantizes ``q, k, v`` (:func:`open_vc_attn.prepare_fp8`, unless ``prepared`` is given) and builds V
    residual repair rows for ``round(budget * Sk)`` tokens per (batch, head).

    q, k, v: as for :func:`open_vc_attn.attention` (batched [B, S, H, D] or one sequence [S, H, D], bfloat16 or
    float16 CUDA tensors, head_dim 128), with equal head counts: the repair rows are built per query head, so GQA /
    MQA (k and v of fewer heads) raises ValueError naming k (a grouped ``prepared``: prepared.k_codes). budget:
    float in [0, 1); one that selects zero tokens gives the plain path. selection: "energy" (GPU, the reference's
    order) or "attention" (energy x estimated column mass over ``sample_rows`` query rows). prepared: an existing
    batched PreparedFP8 of exactly these q, k, v (skips re-quantizing; packed cu_seqlens preparations are rejected).
    qk_format: "e4m3" only: the repair rows copy E4M3 K codes and their block descales, so qk_format="int8" (or an
    INT8 ``prepared``) raises ValueError naming qk_format (prepared.qk_format).
    """
    _checks.require_e4m3(_checks.qk_format(qk_format), "V residual repair")
    budget = _checks_baselines.budget(budget)
    selection = _checks_baselines.selection(selection)
    sample_rows = _checks_baselines.sample_rows(sample_rows)
    if prepared is not None:
        _check_prepared_kind(prepared)
    q4, k4, v4, _ = _checks.check_tokens(q, k, v, head_dims=(KERNEL_HEAD_DIM,), caller="prepare_v_repair")
    if prepared is None:
        prepared = prepare_fp8(q, k, v)
    else:
        _check_prepared_matches(prepared, v4)
    b, sk, h, d = (int(s) for s in v4.shape)
    rows = repair_rows(budget, sk)
    from . import ops   # imports torch and registers every custom op, on first use
    fp8 = (prepared.k_codes, prepared.k_descale, prepared.v_packed, prepared.v_descale)
    if selection == "energy" or rows == 0:
        tokens, rk, rkd, rv = ops.prepare_v_repair_op(v4, *fp8, budget)
    else:
        tokens = _attention_tokens(q4, k4, v4, prepared, rows, sample_rows)
        rk, rkd, rv = ops.build_v_repair_op(v4, *fp8, tokens)
    return PreparedRepair(prepared, budget, selection, rows, tokens, rk, rkd, rv)


def attention_v_repair(prepared, *, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS, softmax_scale=None, return_lse=False,
                       p_format="expcast"):
    """ExpCast FP8 attention with V residual repair (sections 2-6): the original keys as in
    :func:`open_vc_attn.attention_fp8`, then the repair rows, which add to the numerator only.

    prepared: a :class:`PreparedRepair` (of an E4M3 preparation: INT8 raises ValueError naming
    prepared.qk_format; a GQA / MQA preparation ValueError naming prepared.k_codes). Same arguments and results as
    :func:`open_vc_attn.attention_fp8`; with rows == 0
    this is exactly that function. p_format: "expcast" only (the repair path computes P with ExpCast): "exp2"
    raises ValueError naming p_format.
    """
    _checks.require_expcast(_checks.p_format(p_format), "V residual repair")
    scale, mid = _checks.softmax_scale(softmax_scale), _checks.mid_window(mid_window_blocks)
    want_lse = _checks.return_lse(return_lse)
    _checks.require_instance(prepared, PreparedRepair, "prepared",
                             "a PreparedRepair from open_vc_attn.repair.prepare_v_repair")
    meta = _checks.check_prepared_fp8(prepared.prepared, what="V residual repair", e4m3_only=True)
    rows = prepared.rows
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or not 0 <= rows <= meta["seqlen_k"]:
        raise ValueError(f"prepared.rows: expected an int in [0, Sk = {meta['seqlen_k']}], got {rows!r}")
    if rows == 0:
        return attention_fp8(prepared.prepared, softmax_scale=softmax_scale,
                                  mid_window_blocks=mid_window_blocks, return_lse=return_lse)
    _checks_baselines.check_repair_tensors(prepared.tensors(), meta["batch"], meta["heads"], meta["head_dim"], rows,
                                 "prepared.")
    from . import ops
    out, lse = ops.attention_fp8_repair_op(*prepared.prepared.tensors(), *prepared.tensors(), scale, mid, want_lse)
    if meta["input_rank"] == 3:
        out, lse = out[0], (lse[0] if want_lse else lse)
    return (out, lse) if want_lse else out


# ---- attention-aware selection (torch, FP32) --------------------------------------------------------

def _attention_tokens(q4, k4, v4, prepared, rows, sample_rows):
    """Per (batch, head) the `rows` tokens of largest residual energy x column mass, int32 [B, H, rows].
    The mass of key j is the mean over sampled query rows of softmax(q k^T / sqrt(D))_j, computed from the
    original q and k; the energy uses the stored V codes, like the GPU selection (summed in torch's order)."""
    torch = _checks.import_torch()
    b, sq, h, d = (int(s) for s in q4.shape)
    sk = int(k4.shape[1])
    dev = q4.device
    n = min(sample_rows, sq)
    qi = torch.linspace(0, sq - 1, n, device=dev).round().long()   # spacing >= 1: distinct rows
    j = torch.arange(sk, device=dev)
    cols = (j // 16) * 16 + torch.tensor(packed_columns(), device=dev)[j % 16]
    tokens = torch.empty((b, h, rows), dtype=torch.int32, device=dev)
    heads_per_chunk = max(1, _CHUNK_ELEMS // max(1, b * sk * max(d, n)))
    for h0 in range(0, h, heads_per_chunk):
        h1 = min(h, h0 + heads_per_chunk)
        codes = prepared.v_packed[:, h0:h1].index_select(3, cols)                    # [B, h, D, Sk]
        recon = prepared.v_descale[:, h0:h1, None, None] * codes.view(torch.float8_e4m3fn).float()
        r = v4[:, :, h0:h1, :].permute(0, 2, 3, 1).float() - recon
        energy = r.double().square().sum(dim=2)                                       # [B, h, Sk]
        energy = torch.nan_to_num(energy, nan=math.inf)
        logits = torch.einsum("bnhd,bshd->bhns", q4[:, qi, h0:h1].float(), k4[:, :, h0:h1].float())
        mass = torch.softmax(logits * (1.0 / math.sqrt(d)), dim=-1).mean(dim=2)       # [B, h, Sk]
        score = energy * mass.double()
        tokens[:, h0:h1] = torch.topk(score, rows, dim=-1).indices.to(torch.int32)
    return tokens
