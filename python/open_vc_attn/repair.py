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
and ``open_vc_attn::attention_fp8_repair`` (fake implementations registered, so torch.compile traces
them). torch is imported inside the functions only. Bad arguments raise TypeError / ValueError whose
message starts with the argument's name.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from . import api as _api

__all__ = ["PreparedRepair", "prepare_v_repair", "attention_v_repair", "repair_rows", "SELECTIONS"]

SELECTIONS = ("energy", "attention")
_PACKED_COLUMN = (0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)   # inverse of PACKED_KEY_ORDER
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
    x = _budget(budget) * int(seqlen_k)
    whole = math.floor(x)
    return int(whole) + (1 if x - whole >= 0.5 else 0)   # x - floor(x) is exact for doubles


def _budget(x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"budget: expected a float in [0, 1), got {type(x).__name__}")
    x = float(x)
    if not (math.isfinite(x) and 0.0 <= x < 1.0):
        raise ValueError(f"budget: expected a finite float in [0, 1) (the fraction of V tokens per head that get "
                         f"a repair row), got {x}")
    return x


def _selection(x) -> str:
    if x not in SELECTIONS:
        raise ValueError(f"selection: expected one of {SELECTIONS}, got {x!r}")
    return x


def _sample_rows(x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 1 <= x <= _api._INT_MAX:
        raise ValueError(f"sample_rows: expected an int >= 1 (query rows sampled by selection='attention'), got {x!r}")
    return int(x)


def _padded(rows: int) -> int:
    return (rows + _api.QUANT_BLOCK - 1) // _api.QUANT_BLOCK * _api.QUANT_BLOCK


def _check_prepared_kind(prepared):
    """Before the tensor checks: a given preparation must be a batched PreparedFP8."""
    if not isinstance(prepared, _api.PreparedFP8):
        raise TypeError(f"prepared: expected None or a PreparedFP8 from open_vc_attn.prepare_fp8, got "
                        f"{type(prepared).__name__}")
    if prepared.is_varlen:
        raise ValueError("prepared: packed variable-length sequences (cu_seqlens) are not supported by "
                         "prepare_v_repair yet: prepare the sequences batched [B, S, H, D]")


def _check_prepared_matches(prepared, v4):
    """A given PreparedFP8 must be a preparation of these tokens (same sizes and device)."""
    meta = _api._check_prepared(prepared)
    b, sk, h, d = (int(s) for s in v4.shape)
    if (meta["batch"], meta["seqlen_k"], meta["heads"], meta["head_dim"]) != (b, sk, h, d):
        raise ValueError(f"prepared: expected a preparation of k and v with B={b} Sk={sk} H={h} D={d}, got B="
                         f"{meta['batch']} Sk={meta['seqlen_k']} H={meta['heads']} D={meta['head_dim']}")
    if prepared.device != v4.device:
        raise ValueError(f"prepared: expected tensors on v's device {v4.device}, got {prepared.device}")


def prepare_v_repair(q, k, v, budget=0.005, selection="energy", *, prepared=None, sample_rows=64) -> PreparedRepair:
    """Quantizes ``q, k, v`` (:func:`open_vc_attn.prepare_fp8`, unless ``prepared`` is given) and builds V
    residual repair rows for ``round(budget * Sk)`` tokens per (batch, head).

    q, k, v: as for :func:`open_vc_attn.attention` (batched [B, S, H, D] or one sequence [S, H, D], bfloat16
    or float16 CUDA tensors, head_dim 128). budget: float in [0, 1); one that selects zero tokens gives the
    plain path. selection: "energy" (GPU, the reference's order) or "attention" (energy x estimated column
    mass over ``sample_rows`` query rows). prepared: an existing batched PreparedFP8 of exactly these q, k, v
    (skips re-quantizing; packed cu_seqlens preparations are rejected).
    """
    budget = _budget(budget)
    selection = _selection(selection)
    sample_rows = _sample_rows(sample_rows)
    if prepared is not None:
        _check_prepared_kind(prepared)
    q4, k4, v4, _ = _api._check_tokens(q, k, v, head_dims=(_api.KERNEL_HEAD_DIM,),
                                       caller="prepare_v_repair")
    if prepared is None:
        prepared = _api.prepare_fp8(q, k, v)
    else:
        _check_prepared_matches(prepared, v4)
    b, sk, h, d = (int(s) for s in v4.shape)
    rows = repair_rows(budget, sk)
    ops = _ops()
    fp8 = (prepared.k_codes, prepared.k_descale, prepared.v_packed, prepared.v_descale)
    if selection == "energy" or rows == 0:
        tokens, rk, rkd, rv = ops.prepare_v_repair(v4, *fp8, budget)
    else:
        tokens = _attention_tokens(q4, k4, v4, prepared, rows, sample_rows)
        rk, rkd, rv = ops.build_v_repair(v4, *fp8, tokens)
    return PreparedRepair(prepared, budget, selection, rows, tokens, rk, rkd, rv)


def attention_v_repair(prepared, *, mid_window_blocks=4, softmax_scale=None, return_lse=False):
    """ExpCast FP8 attention with V residual repair (sections 2-6): the original keys as in
    :func:`open_vc_attn.attention_fp8`, then the repair rows, which add to the numerator only.

    prepared: a :class:`PreparedRepair`. Same arguments and results as :func:`open_vc_attn.attention_fp8`;
    with rows == 0 this is exactly that function.
    """
    scale, mid = _api._softmax_scale(softmax_scale), _api._mid_window(mid_window_blocks)
    want_lse = _api._return_lse(return_lse)
    if not isinstance(prepared, PreparedRepair):
        raise TypeError(f"prepared: expected a PreparedRepair from open_vc_attn.repair.prepare_v_repair, got "
                        f"{type(prepared).__name__}")
    meta = _api._check_prepared(prepared.prepared)
    rows = prepared.rows
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or not 0 <= rows <= meta["seqlen_k"]:
        raise ValueError(f"prepared.rows: expected an int in [0, Sk = {meta['seqlen_k']}], got {rows!r}")
    if rows == 0:
        return _api.attention_fp8(prepared.prepared, softmax_scale=softmax_scale,
                                  mid_window_blocks=mid_window_blocks, return_lse=return_lse)
    _check_repair_tensors(prepared.tensors(), meta["batch"], meta["heads"], meta["head_dim"], rows, "prepared.")
    out, lse = _ops().attention_fp8_repair(*prepared.prepared.tensors(), *prepared.tensors(), scale, mid, want_lse)
    if meta["input_rank"] == 3:
        out, lse = out[0], (lse[0] if want_lse else lse)
    return (out, lse) if want_lse else out


def _check_repair_tensors(tensors, b, h, d, rows, prefix=""):
    """The four repair tensors (PreparedRepair.tensors() order) against B, H, D and rows."""
    torch = _api._torch()
    rp = _padded(rows)
    want = (("k_codes", (b, h, rp, d), torch.uint8), ("k_descale", (b, h, rp), torch.float32),
            ("v_packed", (b, h, d, rp), torch.uint8), ("tokens", (b, h, rows), torch.int32))
    for (name, shape, dtype), x in zip(want, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{prefix}{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != dtype:
            raise TypeError(f"{prefix}{name}: expected dtype {dtype}, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{prefix}{name}: expected shape {shape} for B={b} H={h} D={d} rows={rows}, got "
                             f"{tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError(f"{prefix}{name}: expected a contiguous tensor, got strides {tuple(x.stride())}")
    dev = tensors[0].device
    for (name, _, _), x in zip(want, tensors):
        if x.device.type != "cuda" or x.device != dev:
            raise ValueError(f"{prefix}{name}: expected a CUDA tensor on {dev}, got {x.device}")


# ---- attention-aware selection (torch, FP32) --------------------------------------------------------

def _attention_tokens(q4, k4, v4, prepared, rows, sample_rows):
    """Per (batch, head) the `rows` tokens of largest residual energy x column mass, int32 [B, H, rows].
    The mass of key j is the mean over sampled query rows of softmax(q k^T / sqrt(D))_j, computed from the
    original q and k; the energy uses the stored V codes, like the GPU selection (summed in torch's order)."""
    torch = _api._torch()
    b, sq, h, d = (int(s) for s in q4.shape)
    sk = int(k4.shape[1])
    dev = q4.device
    n = min(sample_rows, sq)
    qi = torch.linspace(0, sq - 1, n, device=dev).round().long()   # spacing >= 1: distinct rows
    j = torch.arange(sk, device=dev)
    cols = (j // 16) * 16 + torch.tensor(_PACKED_COLUMN, device=dev)[j % 16]
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


# ---- custom ops (registered on first use: they import torch) ------------------------------------------

_OPS = None


def _ops():
    global _OPS
    if _OPS is None:
        _OPS = _register_ops()
    return _OPS


def _register_ops():
    import types

    import torch

    from . import _ext
    from . import ops as base   # registers the base ops; its run-time checks are shared

    def check_inputs(v, k_codes, k_descale, v_packed, v_descale):
        """Returns (B, Sk, H, D) as given (symbolic under torch.compile's dynamic shapes)."""
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            raise ValueError(f"v: expected a rank-4 [B, Sk, H, D] tensor, got {getattr(v, 'shape', type(v).__name__)}")
        b, sk, h, d = v.shape
        _api._check_token_strides("v", v)
        if v.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"v: expected dtype torch.bfloat16 or torch.float16, got {v.dtype}")
        if d != _api.KERNEL_HEAD_DIM:
            raise ValueError(f"v: head_dim must be {_api.KERNEL_HEAD_DIM}, got shape {tuple(v.shape)}")
        nk = (sk + 127) // 128
        want = (("k_codes", k_codes, (b, sk, h, d), torch.uint8),
                ("k_descale", k_descale, (b, h, nk), torch.float32),
                ("v_packed", v_packed, (b, h, d, nk * 128), torch.uint8),
                ("v_descale", v_descale, (b, h), torch.float32))
        for name, x, shape, dtype in want:
            if x.dtype != dtype or tuple(x.shape) != tuple(shape) or not x.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {tuple(shape)} (prepare_fp8's "
                                 f"layout for v's shape), got {x.dtype} {tuple(x.shape)} strides {tuple(x.stride())}")
        return b, sk, h, d

    def outputs(b, h, d, rows, alloc):
        rp = _padded(rows)
        return alloc((b, h, rp, d), torch.uint8), alloc((b, h, rp), torch.float32), alloc((b, h, d, rp), torch.uint8)

    def launch(v, fp8, budget, given_rows, tokens, outs):
        b, sk, h, d = (int(s) for s in v.shape)
        base._check_device(v.device)
        base._check_aligned((("v", v), ("k_codes", fp8[0]), ("v_packed", fp8[2])))
        ext = _ext.load()
        rows = given_rows if given_rows >= 0 else repair_rows(budget, sk)
        if given_rows < 0 and int(ext.repair_row_count(budget, sk)) != rows:   # the outputs were sized by rows
            raise RuntimeError(f"open_vc_attn: repair row count mismatch for budget {budget!r}, Sk {sk}")
        ws = torch.empty(max(int(ext.repair_workspace_bytes(b, h, sk, rows)), 16), dtype=torch.uint8, device=v.device)
        with torch.cuda.device(v.device):
            ext.prepare_v_repair(v.dtype == torch.bfloat16, b, sk, h, d, base._view(v), *(t.data_ptr() for t in fp8),
                                 float(budget), int(given_rows), tokens.data_ptr(), *(t.data_ptr() for t in outs),
                                 ws.data_ptr(), ws.numel(), base._stream(v.device))

    @torch.library.custom_op("open_vc_attn::prepare_v_repair", mutates_args=(), device_types="cuda",
                             schema="(Tensor v, Tensor k_codes, Tensor k_descale, Tensor v_packed, Tensor v_descale, "
                                    "float budget) -> (Tensor, Tensor, Tensor, Tensor)")
    def prepare_op(v, k_codes, k_descale, v_packed, v_descale, budget):
        b, sk, h, d = check_inputs(v, k_codes, k_descale, v_packed, v_descale)
        rows = repair_rows(budget, int(sk))
        alloc = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=v.device)  # noqa: E731
        tokens, outs = alloc((b, h, rows), torch.int32), outputs(b, h, d, rows, alloc)
        if rows > 0:
            launch(v, (k_codes, k_descale, v_packed, v_descale), budget, -1, tokens, outs)
        return (tokens, *outs)

    @prepare_op.register_fake
    def _(v, k_codes, k_descale, v_packed, v_descale, budget):
        b, sk, h, d = check_inputs(v, k_codes, k_descale, v_packed, v_descale)
        rows = repair_rows(budget, int(sk))   # the row count depends on Sk's value: specialize on it
        alloc = lambda shape, dtype: v.new_empty(shape, dtype=dtype)  # noqa: E731
        return (alloc((b, h, rows), torch.int32), *outputs(b, h, d, rows, alloc))

    def check_tokens(tokens, b, h):
        if tokens.dtype != torch.int32 or tokens.dim() != 3 or tuple(tokens.shape[:2]) != (b, h) \
                or not tokens.is_contiguous():
            raise ValueError(f"tokens: expected a contiguous int32 tensor [B, H, rows] with B={b} H={h}, got "
                             f"{tokens.dtype} {tuple(tokens.shape)}")
        return tokens.shape[2]

    @torch.library.custom_op("open_vc_attn::build_v_repair", mutates_args=(), device_types="cuda",
                             schema="(Tensor v, Tensor k_codes, Tensor k_descale, Tensor v_packed, Tensor v_descale, "
                                    "Tensor tokens) -> (Tensor, Tensor, Tensor)")
    def build_op(v, k_codes, k_descale, v_packed, v_descale, tokens):
        b, sk, h, d = check_inputs(v, k_codes, k_descale, v_packed, v_descale)
        rows = check_tokens(tokens, b, h)
        outs = outputs(b, h, d, rows, lambda shape, dtype: torch.empty(shape, dtype=dtype, device=v.device))
        if rows > 0:
            launch(v, (k_codes, k_descale, v_packed, v_descale), 0.0, rows, tokens, outs)
        return outs

    @build_op.register_fake
    def _(v, k_codes, k_descale, v_packed, v_descale, tokens):
        b, sk, h, d = check_inputs(v, k_codes, k_descale, v_packed, v_descale)
        return outputs(b, h, d, check_tokens(tokens, b, h), lambda shape, dtype: v.new_empty(shape, dtype=dtype))

    @torch.library.custom_op("open_vc_attn::attention_fp8_repair", mutates_args=(), device_types="cuda",
                             schema="(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, "
                                    "Tensor v_packed, Tensor v_descale, Tensor repair_k_codes, "
                                    "Tensor repair_k_descale, Tensor repair_v_packed, Tensor repair_tokens, "
                                    "float softmax_scale, int mid_window_blocks, bool return_lse) -> (Tensor, Tensor)")
    def attention_op(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, rk, rkd, rv, rt, softmax_scale,
                     mid_window_blocks, return_lse):
        fp8 = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
        b, sq, sk, h, d = (int(s) for s in base._check_attention_args(fp8, softmax_scale, mid_window_blocks))
        rows = int(rt.shape[-1]) if rt.dim() == 3 else -1
        _check_repair_tensors((rk, rkd, rv, rt), b, h, d, rows)
        base._check_device(q_codes.device)
        base._check_aligned(zip(("q_codes", "k_codes", "v_packed", "repair_k_codes", "repair_v_packed"),
                                (q_codes, k_codes, v_packed, rk, rv)))
        out, lse = base._attention_outputs(q_codes, return_lse,
                                           lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q_codes.device))
        with torch.cuda.device(q_codes.device):
            _ext.load().attention_fp8_repair(b, sq, sk, h, d, *(t.data_ptr() for t in fp8), rows, rk.data_ptr(),
                                             rkd.data_ptr(), rv.data_ptr(), rt.data_ptr(), out.data_ptr(),
                                             *out.stride()[:3], lse.data_ptr() if return_lse else 0,
                                             float(softmax_scale), int(mid_window_blocks), base._stream(q_codes.device))
        return out, lse

    @attention_op.register_fake
    def _(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, rk, rkd, rv, rt, softmax_scale,
          mid_window_blocks, return_lse):
        base._check_attention_args((q_codes, q_descale, k_codes, k_descale, v_packed, v_descale), softmax_scale,
                                   mid_window_blocks)
        return base._attention_outputs(q_codes, return_lse, lambda shape, dtype: q_codes.new_empty(shape, dtype=dtype))

    return types.SimpleNamespace(prepare_v_repair=torch.ops.open_vc_attn.prepare_v_repair.default,
                                 build_v_repair=torch.ops.open_vc_attn.build_v_repair.default,
                                 attention_fp8_repair=torch.ops.open_vc_attn.attention_fp8_repair.default)
