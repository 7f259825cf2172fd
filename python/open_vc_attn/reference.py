"""CPU reference of the openvc numerics contract (docs/numerics.md): numpy in, numpy out.

Every function here runs the C++ oracle (``src/reference``) that the GPU kernels are tested against; it
favours clarity over speed, so keep problems small (a few thousand tokens).

Inputs. Token tensors are ``[B, S, H, D]`` or ``[S, H, D]`` (one sequence; results then keep rank 3),
or packed ``[T, H, D]`` with ``cu_seqlens`` offsets. Accepted dtypes are float16 and float32; float32
values are taken as given. numpy has no bfloat16, so BF16 inputs are passed as float32 arrays holding
bf16-representable values: round with :func:`to_bfloat16_values` first (an ``ml_dtypes.bfloat16`` array
is also accepted and widened exactly). Outputs of the attention functions are float32 before the final
BF16 rounding of the contract (apply :func:`to_bfloat16_values` to get the kernel's stored values).

Arguments are checked here, before the C++ call, and a bad one raises ``TypeError`` (wrong kind) or
``ValueError`` (wrong value) whose message starts with the argument's name.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import numpy as np

from . import _ext, _gqa
from ._layout import DEFAULT_MID_WINDOW_BLOCKS

QUANT_BLOCK = 128      # tokens per Q/K scale group, also the key tile
E4M3_MAX = 448.0
MAX_CODE = 120         # ExpCast code of exp(0) = 256.0

__all__ = [
    "QUANT_BLOCK", "E4M3_MAX", "MAX_CODE", "BlockQuantized", "HeadQuantized",
    "to_bfloat16_values", "e4m3_encode", "e4m3_decode", "expcast_multiplier", "expcast_code",
    "key_block_order", "diagonal_block", "quantize_blocks", "quantize_heads", "select_v_repair",
    "attention", "attention_exact", "vc_grouping", "attention_vc", "error_metrics",
]


class BlockQuantized(NamedTuple):
    """Q/K quantization: E4M3 codes (input's shape) and descale [B, H, nblocks] ([H, nblocks] for rank 3)."""
    codes: np.ndarray
    descale: np.ndarray


class HeadQuantized(NamedTuple):
    """V quantization: E4M3 codes (input's shape), descale and scale_inv [B, H] ([H] for rank 3)."""
    codes: np.ndarray
    descale: np.ndarray
    scale_inv: np.ndarray


# ---- argument checking -------------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _int_arg(x, name: str, minimum: int) -> int:
    if not _is_int(x):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x}")
    return int(x)


def _bool_arg(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def _mid_window(x) -> int:
    if x is None:
        return _ext.load().NATURAL_ORDER
    if not _is_int(x):
        raise TypeError(f"mid_window_blocks: expected None (natural order) or an int >= 0, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"mid_window_blocks: expected None (natural order) or an int >= 0, got {x}")
    return int(x)


def _softmax_scale(x) -> float:
    if x is None:
        return 0.0   # the C++ default: 1/sqrt(D)
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        raise TypeError(f"softmax_scale: expected None or a positive float, got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"softmax_scale: expected None or a finite float > 0, got {x}")
    return float(x)


def _budget(x) -> float:
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        raise TypeError(f"repair_budget: expected a float in [0, 1), got {type(x).__name__}")
    if not (math.isfinite(x) and 0.0 <= x < 1.0):
        raise ValueError(f"repair_budget: expected a finite float in [0, 1), got {x}")
    return float(x)


def _tokens(x, name: str) -> np.ndarray:
    """A token tensor as C-contiguous float32 (exact for float16 and bfloat16), rank 3 or 4, finite."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray of float16 or float32, got {type(x).__name__}")
    if x.dtype not in (np.float16, np.float32) and x.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected dtype float16 or float32 (bf16 values held in float32), "
                        f"got {x.dtype}")
    if x.ndim not in (3, 4):
        raise ValueError(f"{name}: expected rank 4 [B, S, H, D] or rank 3 [S, H, D], got shape {x.shape}")
    if x.shape[-1] < 1 or x.shape[-2] < 1:
        raise ValueError(f"{name}: expected heads >= 1 and head_dim >= 1, got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: contains NaN or infinity")
    return x


def _cu_seqlens(cu, name: str, total: int) -> list:
    if not isinstance(cu, (np.ndarray, list, tuple)):
        raise TypeError(f"{name}: expected a 1-D integer array of offsets, got {type(cu).__name__}")
    arr = np.asarray(cu)
    if arr.ndim != 1 or arr.size < 2 or not (np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name}: expected a 1-D integer array of at least 2 offsets, got {arr.dtype} "
                         f"shape {arr.shape}")
    if arr[0] != 0 or np.any(np.diff(arr) < 0) or arr[-1] != total:
        raise ValueError(f"{name}: expected non-decreasing offsets from 0 to the token count {total}, "
                         f"got {arr.tolist()}")
    return [int(c) for c in arr]


class _Layout(NamedTuple):
    rank: int
    packed: bool
    cu_q: Optional[list]
    cu_k: Optional[list]


def _qkv(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, gqa=None):
    """Checks q, k, v (and packed offsets) together; returns float32 arrays and their layout. k and v of Hk
    heads, a divisor of q's H (GQA / MQA), come back with each head repeated H // Hk times (np.repeat: torch's
    repeat_interleave), the definition of the grouped call; gqa names a function that takes equal head counts
    only (its message)."""
    q, k, v = _tokens(q, "q"), _tokens(k, "k"), _tokens(v, "v")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(f"{name}: expected rank {q.ndim} like q, got shape {x.shape}")
    _gqa.check_heads(q.shape[-2], k.shape[-2], "k", k.shape, what=gqa)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected head_dim {q.shape[-1]} like q, got shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    if k.shape[-2] != q.shape[-2]:
        k, v = (np.ascontiguousarray(np.repeat(x, q.shape[-2] // x.shape[-2], axis=-2)) for x in (k, v))
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} like q, got shape {k.shape}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q, cu_seqlens_k: give both (packed sequences) or neither")
    packed = cu_seqlens_q is not None
    cu_q = cu_k = None
    if packed:
        if q.ndim != 3:
            raise ValueError(f"cu_seqlens_q: packed sequences need rank 3 [T, H, D] inputs, got q shape {q.shape}")
        cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
        cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
        if len(cu_q) != len(cu_k):
            raise ValueError(f"cu_seqlens_k: expected {len(cu_q) - 1} sequences like cu_seqlens_q, got {len(cu_k) - 1}")
        if min(np.diff(cu_k)) < 1:
            raise ValueError(f"cu_seqlens_k: every sequence needs at least one key, got {cu_k}")
    else:
        seq_axis = q.ndim - 3
        if q.shape[seq_axis] < 1:
            raise ValueError(f"q: expected at least one query token, got shape {q.shape}")
        if k.shape[seq_axis] < 1:
            raise ValueError(f"k: expected at least one key token, got shape {k.shape}")
    return q, k, v, _Layout(q.ndim, packed, cu_q, cu_k)


def _per_group(x: np.ndarray, layout: _Layout) -> np.ndarray:
    """[nseq, H, ...] results lose the sequence axis for a plain rank-3 input."""
    return x[0] if (layout.rank == 3 and not layout.packed) else x


def _single(x, name: str, cu_seqlens=None):
    x = _tokens(x, name)
    cu = None
    if cu_seqlens is not None:
        if x.ndim != 3:
            raise ValueError(f"cu_seqlens: packed sequences need a rank 3 [T, H, D] {name}, got shape {x.shape}")
        cu = _cu_seqlens(cu_seqlens, "cu_seqlens", x.shape[0])
    return x, _Layout(x.ndim, cu is not None, cu, cu)


# ---- element-wise pieces -------------------------------------------------------------------------------

def to_bfloat16_values(x) -> np.ndarray:
    """Rounds to the nearest bfloat16 (ties to even) and returns float32 holding those values.

    float16/float32 inputs round once. float64 inputs go to float32 with round-to-odd first, which makes
    the two-step rounding equal to one direct rounding. NaN stays NaN, overflow gives +-inf.
    Pure numpy: works without the compiled extension.
    """
    x = np.asarray(x)
    if x.dtype == np.float64:
        f = x.astype(np.float32)
        inexact = f.astype(np.float64) != x
        # Truncate toward zero, then set the lowest bit where rounding lost something (round to odd).
        over = np.abs(f.astype(np.float64)) > np.abs(x)
        f = np.where(over & np.isfinite(x), np.nextafter(f, np.float32(0)), f)
        bits = f.view(np.uint32) | (inexact & np.isfinite(x)).astype(np.uint32)
        x = bits.view(np.float32)
    elif x.dtype in (np.float16, np.float32) or x.dtype.name == "bfloat16":
        x = x.astype(np.float32)
    else:
        raise TypeError(f"x: expected a float16, float32 or float64 array, got {x.dtype}")
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = u >> np.uint32(16)
    out &= np.uint32(1)
    out += np.uint32(0x7FFF)
    out += u                      # wraps only for negative NaNs, which are replaced below
    out &= np.uint32(0xFFFF0000)
    nan = np.isnan(x)
    if nan.any():
        # Keep NaN a (quiet) NaN even when its payload sits only in the dropped bits.
        out[nan] = (u[nan] | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
    return out.view(np.float32).reshape(x.shape)


def e4m3_encode(x) -> np.ndarray:
    """E4M3 (FN) codes, uint8, of float values: round to nearest even, saturate to +-448, NaN -> 0x7F."""
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"):
        raise TypeError(f"x: expected a float array, got {x.dtype}")
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    return np.asarray(_ext.load().e4m3_encode(flat)).reshape(x.shape)


def e4m3_decode(codes) -> np.ndarray:
    """float32 values of E4M3 (FN) codes; 0x7F and 0xFF are NaN, subnormals are mantissa * 2^-9."""
    c = np.asarray(codes)
    if not np.issubdtype(c.dtype, np.integer):
        raise TypeError(f"codes: expected an integer (uint8) array, got {c.dtype}")
    if c.size and (c.min() < 0 or c.max() > 255):
        raise ValueError("codes: expected values in [0, 255]")
    flat = np.ascontiguousarray(c, dtype=np.uint8).reshape(-1)
    return np.asarray(_ext.load().e4m3_decode(flat)).reshape(c.shape)


def expcast_multiplier(softmax_scale, descale_q, descale_k) -> np.float32:
    """a = ((8 * log2e) * softmax_scale) * descale_q) * descale_k in FP32, the kernel's operation order."""
    for name, val in (("softmax_scale", softmax_scale), ("descale_q", descale_q), ("descale_k", descale_k)):
        if not isinstance(val, numbers.Real) or isinstance(val, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a float, got {type(val).__name__}")
    return np.float32(_ext.load().expcast_multiplier(float(softmax_scale), float(descale_q), float(descale_k)))


def expcast_code(acc, a, row_max) -> np.ndarray:
    """ExpCast codes (uint8 0..120) of accumulators ``acc`` with multipliers ``a`` while the row's running
    maximum in code units is ``row_max``; the three broadcast together (float32 arithmetic)."""
    arrs = []
    for name, val in (("acc", acc), ("a", a), ("row_max", row_max)):
        arr = np.asarray(val)
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"{name}: expected float values, got {arr.dtype}")
        arrs.append(arr.astype(np.float32))
    try:
        acc_b, a_b, m_b = np.broadcast_arrays(*arrs)
    except ValueError as exc:
        raise ValueError(f"acc, a, row_max: shapes do not broadcast ({exc})") from None
    shape = acc_b.shape
    flat = [np.ascontiguousarray(t).reshape(-1) for t in (acc_b, a_b, m_b)]
    return np.asarray(_ext.load().expcast_code(*flat)).reshape(shape)


def key_block_order(diag, n, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS) -> list:
    """Key blocks in visiting order (section 5): j0 = min(diag + w, n - 1); j0 down to 0, then j0 + 1 up;
    ``mid_window_blocks=None`` gives 0..n-1."""
    n = _int_arg(n, "n", 1)
    diag = _int_arg(diag, "diag", 0)
    if diag >= n:
        raise ValueError(f"diag: expected an int in [0, n={n}), got {diag}")
    return list(_ext.load().key_block_order(diag, n, _mid_window(mid_window_blocks)))


def diagonal_block(first_query_row, sq, sk, key_tile=QUANT_BLOCK) -> int:
    """floor(first_query_row * sk / sq / key_tile) in integer arithmetic."""
    return int(_ext.load().diagonal_block(_int_arg(first_query_row, "first_query_row", 0),
                                          _int_arg(sq, "sq", 1), _int_arg(sk, "sk", 1),
                                          _int_arg(key_tile, "key_tile", 1)))


# ---- quantization --------------------------------------------------------------------------------------

def quantize_blocks(x, cu_seqlens=None) -> BlockQuantized:
    """Q/K quantization (section 1): one E4M3 scale per (sequence, head, 128-token block)."""
    x, layout = _single(x, "x", cu_seqlens)
    codes, descale = _ext.load().quantize_blocks(x, layout.cu_q)
    return BlockQuantized(np.asarray(codes), _per_group(np.asarray(descale), layout))


def quantize_heads(v, cu_seqlens=None) -> HeadQuantized:
    """V quantization (section 1): one E4M3 scale per (sequence, head) over all its tokens."""
    v, layout = _single(v, "v", cu_seqlens)
    codes, descale, scale_inv = _ext.load().quantize_heads(v, layout.cu_q)
    return HeadQuantized(np.asarray(codes), _per_group(np.asarray(descale), layout),
                         _per_group(np.asarray(scale_inv), layout))


def select_v_repair(v, budget, cu_seqlens=None) -> dict:
    """V residual repair rows (section 6) for budget in [0, 1).

    Returns a dict: ``tokens_per_head`` (int), ``count`` and ``offset`` ([nseq, H]: rows per group and
    their start), ``tokens`` (selected token indices relative to the sequence start, largest residual
    energy first) and ``codes`` ([rows, D] E4M3 residual codes with the V scale).
    """
    v, layout = _single(v, "v", cu_seqlens)
    try:
        budget = _budget(budget)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("repair_budget", "budget", 1)) from None
    return dict(_ext.load().select_v_repair(v, budget, layout.cu_q))


# ---- attention -----------------------------------------------------------------------------------------

def attention(q, k, v, *, softmax_scale=None, causal=False, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS,
              query_tile=128, repair_budget=0.0, return_lse=False, cu_seqlens_q=None, cu_seqlens_k=None):
    """ExpCast FP8 attention as the kernel computes it (sections 1-6), output float32 of q's shape.

    softmax_scale None means 1/sqrt(D). mid_window_blocks None visits key blocks in natural order.
    query_tile is the number of query rows sharing one traversal order (the kernel's CTA tile).
    repair_budget in [0, 1) is the fraction of V tokens per head that get a residual repair row.
    k and v may hold Hk heads, a divisor of q's H (GQA / MQA): computed on each K/V head repeated H // Hk times,
    which is the definition (and the GPU kernels' result, bit for bit).
    With return_lse, returns (out, lse): lse (natural log, float32) is [B, H, S], [H, S] for a rank-3
    input, or [nseq, H, max_len] for packed input (rows past a sequence's length are unspecified).
    """
    q, k, v, layout = _qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    out, lse, _ = _ext.load().attention_expcast(
        q, k, v, layout.cu_q, layout.cu_k, softmax_scale=_softmax_scale(softmax_scale),
        query_tile=_int_arg(query_tile, "query_tile", 1), key_tile=QUANT_BLOCK,
        mid_window_blocks=_mid_window(mid_window_blocks), causal=_bool_arg(causal, "causal"),
        repair_budget=_budget(repair_budget))
    out = np.asarray(out)
    return (out, _per_group(np.asarray(lse), layout)) if return_lse else out


def attention_exact(q, k, v, *, softmax_scale=None, causal=False, return_lse=False, cu_seqlens_q=None,
                    cu_seqlens_k=None):
    """Exact softmax attention in FP64 on the unquantized inputs; out float64 of q's shape (lse as in
    :func:`attention`, float64). Causal masking aligns the last query with the last key. GQA / MQA as in
    :func:`attention` (K/V heads repeated)."""
    q, k, v, layout = _qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    out, lse = _ext.load().attention_exact(q, k, v, layout.cu_q, layout.cu_k,
                                           softmax_scale=_softmax_scale(softmax_scale),
                                           causal=_bool_arg(causal, "causal"))
    out = np.asarray(out)
    return (out, _per_group(np.asarray(lse), layout)) if return_lse else out


def vc_grouping(v, cu_seqlens=None) -> np.ndarray:
    """VC-Attention token grouping (section 7): int32 permutation [B, H, S] ([H, S] for rank 3, packed:
    [nseq, H, max_len]); entry i of a row is the original index of the token placed at position i."""
    v, layout = _single(v, "v", cu_seqlens)
    return _per_group(np.asarray(_ext.load().vc_grouping(v, layout.cu_q)), layout)


def attention_vc(q, k, v, permutation=None, *, softmax_scale=None, query_tile=128, return_lse=False,
                 cu_seqlens_q=None, cu_seqlens_k=None):
    """VC-Attention baseline (section 7: V-Smooth + ExpCast, natural key order, non-causal).

    permutation: the output of :func:`vc_grouping` on this v (reusable across denoising steps), or None
    to compute it. Returns out float32 of q's shape, and lse like :func:`attention` with return_lse. Equal
    head counts only (like the GPU baseline: ValueError naming k for GQA / MQA).
    """
    q, k, v, layout = _qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, gqa="the VC baseline (attention_vc)")
    perm = None
    if permutation is not None:
        if not isinstance(permutation, np.ndarray) or not np.issubdtype(permutation.dtype, np.integer):
            raise TypeError("permutation: expected an integer numpy.ndarray from vc_grouping(v), got "
                            f"{type(permutation).__name__}")
        nseq = len(layout.cu_k) - 1 if layout.packed else (k.shape[0] if k.ndim == 4 else 1)
        max_len = int(max(np.diff(layout.cu_k))) if layout.packed else k.shape[-3]
        want = (nseq, k.shape[-2], max_len)
        want = want[1:] if (layout.rank == 3 and not layout.packed) else want
        if permutation.shape != want:
            raise ValueError(f"permutation: expected shape {want} (from vc_grouping(v)), got {permutation.shape}")
        if permutation.size and (permutation.min() < 0 or permutation.max() >= max_len):
            raise ValueError(f"permutation: expected token indices in [0, {max_len})")
        perm = np.ascontiguousarray(permutation, dtype=np.int32).reshape(-1)
    out, lse, _ = _ext.load().attention_vc(q, k, v, perm, layout.cu_q, layout.cu_k,
                                           softmax_scale=_softmax_scale(softmax_scale),
                                           query_tile=_int_arg(query_tile, "query_tile", 1),
                                           key_tile=QUANT_BLOCK, causal=False)
    out = np.asarray(out)
    return (out, _per_group(np.asarray(lse), layout)) if return_lse else out


def error_metrics(out, ref) -> dict:
    """Section 8 metrics of ``out`` (taken as float32) against ``ref`` (float64): rel_l2, max_abs, rmse,
    cosine, as a dict of floats."""
    out, ref = np.asarray(out), np.asarray(ref)
    for name, x in (("out", out), ("ref", ref)):
        if not (np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"):
            raise TypeError(f"{name}: expected a float array, got {x.dtype}")
    if out.shape != ref.shape:
        raise ValueError(f"ref: expected the shape of out {out.shape}, got {ref.shape}")
    res = _ext.load().compare(np.ascontiguousarray(out, dtype=np.float32).reshape(-1),
                              np.ascontiguousarray(ref, dtype=np.float64).reshape(-1))
    return {key: float(res[key]) for key in ("rel_l2", "max_abs", "rmse", "cosine")}
