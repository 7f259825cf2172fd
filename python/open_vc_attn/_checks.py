"""Argument rules of open_vc_attn's GPU functions and custom ops, in one place (torch-free import).

Plain Python over tensor metadata, so torch.compile traces them into guards, and the ops' fake
implementations run the same checks as the CUDA ones. A bad argument raises TypeError (wrong kind) or
ValueError (wrong value) whose message starts with the argument's name. The device is checked last, so
every other rule can be exercised with CPU or meta tensors. Sizes and layouts come from
:mod:`open_vc_attn._layout`. Used by api, ops, repair, baselines and parallel; the rules of the VC
baseline and of V repair are in :mod:`open_vc_attn._checks_baselines`, which builds on these.
"""
from __future__ import annotations

import math
import numbers

from . import _gqa
from ._layout import (ATTENTION_PATHS, FAST_HEAD_DIMS, FP8_NAMES, GRID_LIMIT, INT_MAX, NATURAL_ORDER, P_FORMATS,
                      PREPARE_HEAD_DIMS, QK_FORMATS, QUANT_BLOCK, VERSIONS, fp8_expectations, layouts,
                      varlen_expectations)


# ---- inputs of the public functions -----------------------------------------------------------------------

def import_torch():
    import torch
    return torch


def shape_of(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def require_instance(x, cls, name, what):
    """x must be a `cls` (for the prepared objects, whose classes live with the functions that make them)."""
    if not isinstance(x, cls):
        raise TypeError(f"{name}: expected {what}, got {type(x).__name__}")


# ---- Q/K code format (qk_format, k_smoothing): the one home of the format rules --------------------------------

def qk_format(x, name="qk_format") -> str:
    """qk_format: "e4m3" or "int8"; anything else (another string, or not a string) raises ValueError."""
    if not isinstance(x, str) or x not in QK_FORMATS:
        got = repr(x) if isinstance(x, str) else f"{x!r} ({type(x).__name__})"
        raise ValueError(f"{name}: expected one of {list(QK_FORMATS)}, got {got}")
    return x


def k_smoothing(x, name="k_smoothing") -> bool:
    return bool_arg(x, name)


def v_bias_correction(x, fmt=None, blocks=False, name="v_bias_correction") -> bool:
    """The correction's kernels are INT8 Q/K modes (ExpCast or exp2 P) without key block lists: fmt, the call's
    checked Q/K format (None: the value only); blocks, whether the call has a block list."""
    on = bool_arg(x, name)
    if on and fmt is not None and fmt != "int8":
        raise ValueError(f"{name}: the V rounding bias correction is built for qk_format='int8' calls (ExpCast or "
                         f"exp2 P), got qk_format={fmt!r}")
    if on and blocks:
        raise ValueError(f"{name}: the V rounding bias correction does not combine with key block lists (block_mask)")
    return on


def lse_with_smoothing(return_lse, smoothing, name="k_smoothing"):
    """K smoothing subtracts K's channel mean m, so the kernel's row LSE is the exact one minus
    softmax_scale * q_i . m (the output is unchanged: softmax ignores a per-row shift). attention() adds that
    term back (the C++ one-call entry); attention_fp8 on a smoothed preparation cannot (the preparation holds
    no q . m), so it does not return an LSE (ValueError naming it)."""
    if return_lse and smoothing:
        raise ValueError(f"{name}: return_lse=True is not taken with K smoothing: the LSE of attention on the smoothed "
                         "keys is shifted by softmax_scale * (q . mean of K) per row (docs/numerics.md section 9); "
                         "open_vc_attn.attention(..., k_smoothing=True, return_lse=True) returns the LSE of the keys "
                         "as given, or prepare with k_smoothing=False where the LSE is needed")


# ---- P format (p_format): the one home of its rules ----------------------------------------------------------

def p_format(x, fmt=None, qk_name="qk_format", name="p_format") -> str:
    """p_format: "expcast" (ExpCast's linear code, the default) or "exp2" (the E4M3 rounding of the exponential,
    docs/numerics.md "P format"); anything else raises ValueError naming it. fmt: the call's Q/K format (checked),
    or None to check the value only: "exp2" is implemented for INT8 Q/K only, so with fmt != "int8" it raises
    ValueError naming p_format and the Q/K format (qk_name: the argument that holds it)."""
    if not isinstance(x, str) or x not in P_FORMATS:
        got = repr(x) if isinstance(x, str) else f"{x!r} ({type(x).__name__})"
        raise ValueError(f"{name}: expected one of {list(P_FORMATS)}, got {got}")
    if fmt is not None and x == "exp2" and fmt != "int8":
        raise ValueError(f"{name}: 'exp2' (P as the E4M3 rounding of the exponential) is implemented for INT8 Q/K only "
                         f"(every fast-path call with qk_format='int8'), got {qk_name}={fmt!r}; use "
                         f"p_format='expcast' or qk_format='int8'")
    return x


def require_expcast(p_fmt, what, name="p_format"):
    """Paths that compute P with ExpCast only (the general path, V residual repair, the VC baseline):
    ValueError naming `name` for any other P format."""
    if p_fmt != "expcast":
        raise ValueError(f"{name}: {what} takes p_format='expcast' only, got {p_fmt!r}")


def general_path_reason(d, sq, sk):
    """None when the sm_90a fast path takes a call of head dim d and Sq x Sk (max lengths, packed), else why
    it runs on the general path."""
    if d not in FAST_HEAD_DIMS:
        return f"head_dim {d} (the fast path takes 128 or 64)"
    if not fast_path_range(sq, sk):
        return "ceil(Sq/128) * ceil(Sk/128) * 128 >= 2^32 (past the fast path's 32-bit range)"
    return None


def require_fast_path(fmt, reason, name="qk_format"):
    """INT8 Q/K runs on the sm_90a fast path only: ValueError naming `name` when a call of format fmt would
    need the general path (reason: general_path_reason's answer)."""
    if fmt == "int8" and reason is not None:
        raise ValueError(f"{name}: 'int8' runs on the sm_90a fast path only, and this call would need the general "
                         f"path: {reason}; use qk_format='e4m3'")


def require_e4m3(fmt, what, name="qk_format"):
    """Paths that take E4M3 Q/K codes only (the general path, V residual repair, the VC baseline): ValueError
    naming `name` for any other format."""
    if fmt != "e4m3":
        raise ValueError(f"{name}: {what} takes qk_format='e4m3' only, got {fmt!r}")


def require_tensors(q, k, v):
    torch = import_torch()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor (CUDA, bfloat16 or float16), got {type(x).__name__}")


def token_views(q, k, v):
    """The rank rules of prepare_fp8 / attention (rank 4, or a rank-3 q: one sequence, whose k and v may
    be rank 3 or a batch of one); returns rank-4 views and q's rank. Never copies. The rest of the tensor
    rules are :func:`check_tokens`' (the ops run them on the views)."""
    require_tensors(q, k, v)
    rank = q.dim()
    if rank not in (3, 4):
        raise ValueError(f"q: expected rank 4 [B, Sq, H, D] or rank 3 [Sq, H, D], got shape {shape_of(q)}")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != rank and not (rank == 3 and x.dim() == 4):
            raise ValueError(f"{name}: expected rank {rank} like q ([B, Sk, H, D]"
                             f"{' or [Sk, H, D]' if rank == 3 else ''}), got shape {shape_of(x)}")
    q4 = q.unsqueeze(0) if rank == 3 else q
    k4 = k.unsqueeze(0) if k.dim() == 3 else k
    v4 = v.unsqueeze(0) if v.dim() == 3 else v
    if rank == 3 and k4.shape[0] != 1:
        raise ValueError(f"k: expected batch 1 like q (rank-3 q is one sequence), got shape {shape_of(k)}")
    return q4, k4, v4, rank


def check_tokens(q, k, v, head_dims=PREPARE_HEAD_DIMS, caller="prepare_fp8", gqa=False):
    """Checks q, k, v of prepare_fp8 / attention; returns rank-4 views and q's rank. Never copies.
    gqa: k and v may hold Hk heads, a divisor of q's H (GQA/MQA, :mod:`._gqa`); else equal head counts only
    (the message names `caller`). The device comes last, so that every other check can be exercised with CPU
    tensors."""
    torch = import_torch()
    q4, k4, v4, rank = token_views(q, k, v)
    if k4.shape[0] != q4.shape[0]:
        raise ValueError(f"k: expected batch {q4.shape[0]} like q, got shape {shape_of(k)}")
    _gqa.check_heads(int(q4.shape[2]), int(k4.shape[2]), "k", shape_of(k), what=None if gqa else caller)
    if k4.shape[3] != q4.shape[3]:
        raise ValueError(f"k: expected head_dim {q4.shape[3]} like q, got shape {shape_of(k)}")
    if v4.shape != k4.shape:
        raise ValueError(f"v: expected the shape of k {shape_of(k)}, got {shape_of(v)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q: expected dtype torch.bfloat16 or torch.float16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} like q (mixed dtypes are not supported), got {x.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.numel() == 0:
            raise ValueError(f"{name}: expected non-empty dims (at least one batch, token and head), got shape "
                             f"{shape_of(x)}")
        for size in x.shape:
            if size > INT_MAX:
                raise ValueError(f"{name}: dims must be < 2^31 (C++ ints), got shape {shape_of(x)}")
    if q4.shape[3] not in head_dims:
        raise ValueError(f"q: head_dim {q4.shape[3]} is not supported: {caller} takes "
                         f"{' or '.join(str(d) for d in head_dims)}, got shape {shape_of(q)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.requires_grad:
            raise ValueError(f"{name}: requires_grad=True is not supported: openvc is inference-only "
                             "(detach it, or call under torch.no_grad() / torch.inference_mode())")
    for name, x in (("q", q4), ("k", k4), ("v", v4)):
        check_token_strides(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got device {x.device}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} like q, got {x.device}")
    return q4, k4, v4, rank


def check_token_strides(name, x):
    """Head dim contiguous; the other strides are free but must be multiples of 8 elements (16 bytes),
    as the kernels load 16-byte vectors. Strides of size-1 dims never matter and are not checked."""
    strides = x.stride()
    if x.shape[3] > 1 and strides[3] != 1:
        raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {tuple(strides)}; "
                         "call .contiguous() first (openvc never copies silently)")
    for axis, what in ((0, "batch"), (1, "sequence"), (2, "head")):
        if x.shape[axis] > 1 and strides[axis] % 8 != 0:
            raise ValueError(f"{name}: the {what} stride must be a multiple of 8 elements (16 bytes) for the "
                             f"kernels' vector loads, got strides {tuple(strides)}; call .contiguous() first")


def check_fp8_tensors(tensors, prefix, sizes=None, fmt="e4m3", v_blocks=False, gqa=None):
    """Checks the six prepared tensors (order of PreparedFP8.tensors()) against each other, or against
    sizes = (B, Sq, Sk, H, D) when given, in the layouts of qk_format fmt (v_blocks: v_descale per key block);
    returns (B, Sq, Sk, H, D). prefix names them in messages. gqa: None for equal head counts only (a
    mismatch is a shape error), True to take K/V tensors of Hk heads (a divisor of H, read from k_codes), or
    the name of the function that takes equal head counts only (its GQA message names it)."""
    torch = import_torch()
    names = FP8_NAMES
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{prefix}{name}: expected a torch.Tensor, got {type(x).__name__}")
    kc = tensors[2]
    if sizes is None:
        qc = tensors[0]
        if qc.dim() != 4 or kc.dim() != 4:
            bad = ("q_codes", qc) if qc.dim() != 4 else ("k_codes", kc)
            raise ValueError(f"{prefix}{bad[0]}: expected rank 4 [B, S, H, D], got shape {shape_of(bad[1])}")
        sizes = (qc.shape[0], qc.shape[1], kc.shape[1], qc.shape[2], qc.shape[3])
    b, sq, sk, h, d = sizes
    hk = h
    if gqa is not None and kc.dim() == 4:
        hk = int(kc.shape[2])
        _gqa.check_heads(int(h), hk, f"{prefix}k_codes", shape_of(kc), f"{prefix}q_codes",
                         None if gqa is True else gqa)
    check_fixed_layouts(fp8_expectations(b, sq, sk, h, d, fmt, v_blocks, hk), tensors, prefix, sizes)
    if min(sizes) < 1 or max(sizes) > INT_MAX:
        raise ValueError(f"{prefix}q_codes: sizes B, Sq, Sk, H, D must be in [1, 2^31), got {tuple(sizes)}")
    check_one_cuda_device(names, tensors, prefix)
    return b, sq, sk, h, d


def sizes_description(sizes):
    """(B, Sq, Sk, H, D) as the shape messages name them."""
    b, sq, sk, h, d = sizes
    return f"B={b} Sq={sq} Sk={sk} H={h} D={d}"


def check_fixed_layouts(expectations, tensors, prefix, sizes):
    """Each tensor against its (name, shape, dtype) expectation: dtype, shape, contiguity (the kernels'
    fixed layouts), no grad. sizes only names the shapes in messages: (B, Sq, Sk, H, D) or a string."""
    torch = import_torch()
    where = sizes if isinstance(sizes, str) else sizes_description(sizes)
    for (name, shape, dtype), x in zip(expectations, tensors):
        if x.dtype != getattr(torch, dtype):
            raise TypeError(f"{prefix}{name}: expected dtype torch.{dtype}, got {x.dtype}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{prefix}{name}: expected shape {tuple(shape)} for {where}, got {shape_of(x)}")
        if not x.is_contiguous():
            raise ValueError(f"{prefix}{name}: expected a contiguous tensor (the kernel's fixed layout), got "
                             f"strides {tuple(x.stride())} for shape {shape_of(x)}")
        if x.requires_grad:
            raise ValueError(f"{prefix}{name}: requires_grad=True is not supported: openvc is inference-only")


def check_one_cuda_device(names, tensors, prefix):
    """Every tensor on the first one's CUDA device. Checked last, so the other checks also work on CPU
    and meta tensors (fake implementations, error tests)."""
    dev = tensors[0].device
    for name, x in zip(names, tensors):
        if x.device.type != "cuda" or x.device != dev:
            raise ValueError(f"{prefix}{name}: expected a CUDA tensor on {prefix}q_codes's device {dev}, "
                             f"got {x.device}")


def prepared_meta(prepared, varlen=False) -> dict:
    """Sizes, input rank and dtype of a prepared object (PreparedFP8, PreparedVC), checked: the ints
    batch, seqlen_q, seqlen_k, heads, head_dim and input_rank as a dict (varlen: a packed preparation,
    rank 3 with N sequences)."""
    torch = import_torch()
    meta = {}
    for field in ("batch", "seqlen_q", "seqlen_k", "heads", "head_dim", "input_rank"):
        val = getattr(prepared, field)
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
            raise ValueError(f"prepared.{field}: expected an int >= 1, got {val!r}")
        meta[field] = int(val)
    if meta["input_rank"] not in (3, 4) or (meta["input_rank"] == 3 and meta["batch"] != 1 and not varlen):
        raise ValueError(f"prepared.input_rank: expected 4, or 3 with batch 1, got {meta['input_rank']} "
                         f"(batch {meta['batch']})")
    if prepared.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"prepared.dtype: expected torch.bfloat16 or torch.float16, got {prepared.dtype}")
    return meta


def check_prepared_fp8(prepared, allow_varlen=False, what="this function", e4m3_only=False, gqa=False):
    """A batched PreparedFP8 (its class is checked by the caller, which owns it): sizes, dtype, format and
    the six tensors; returns prepared_meta's dict plus "qk_format", "k_smoothing" and "kv_heads" (k_codes'
    head count). e4m3_only: `what` takes E4M3 preparations only (INT8 raises ValueError naming
    prepared.qk_format). gqa: K/V tensors of fewer heads (GQA/MQA) are taken, else ValueError naming
    prepared.k_codes and `what`."""
    if prepared.is_varlen and not allow_varlen:
        raise ValueError(f"prepared: packed variable-length sequences (cu_seqlens) are not supported by {what}, which "
                         "takes batched [B, S, H, D] preparations only")
    fmt = qk_format(prepared.qk_format, "prepared.qk_format")
    smooth = k_smoothing(prepared.k_smoothing, "prepared.k_smoothing")
    if e4m3_only:
        require_e4m3(fmt, what, "prepared.qk_format")
    meta = prepared_meta(prepared, varlen=prepared.is_varlen)
    meta.update(qk_format=fmt, k_smoothing=smooth)
    if prepared.is_varlen:
        check_varlen_fp8(prepared.tensors(), prepared.cu_seqlens_q, prepared.cu_seqlens_k, meta["seqlen_q"],
                         meta["seqlen_k"], fmt, gqa=True if gqa else what)
        meta["kv_heads"] = int(prepared.k_codes.shape[-2])
        return meta
    if meta["head_dim"] not in PREPARE_HEAD_DIMS:
        raise ValueError(f"prepared.head_dim: attention_fp8 supports head_dim 128 or 64, got {meta['head_dim']}")
    sizes = (meta["batch"], meta["seqlen_q"], meta["seqlen_k"], meta["heads"], meta["head_dim"])
    check_fp8_tensors(prepared.tensors(), "prepared.", sizes, fmt, gqa=True if gqa else what)
    meta["kv_heads"] = int(prepared.k_codes.shape[-2])
    return meta


def check_quantized(tensors, input_rank, dtype, fmt="e4m3", smooth=False):
    """PreparedFP8.from_quantized: returns (rank-4 views, PreparedFP8's other fields): E4M3 codes as uint8
    views, INT8 codes as they are (torch.int8). Checks in the order format, kind, dtype, rank, sizes, layout,
    device (last, as in check_tokens, so that every other check can be exercised with CPU or meta tensors)."""
    torch = import_torch()
    fmt, smooth = qk_format(fmt), k_smoothing(smooth)
    names = FP8_NAMES
    if isinstance(input_rank, bool) or not isinstance(input_rank, numbers.Integral) or input_rank not in (3, 4):
        raise ValueError(f"input_rank: expected 4 ([B, S, H, D] tensors) or 3 (one sequence: the same without "
                         f"the batch axis), got {input_rank!r}")
    input_rank = int(input_rank)
    if dtype is None:
        dtype = torch.bfloat16
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected None, torch.bfloat16 or torch.float16 (the dtype of the inputs before "
                         f"quantization), got {dtype!r}")
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for name, x in zip(names, tensors):
        if name.endswith("descale"):
            if x.dtype != torch.float32:
                raise TypeError(f"{name}: expected dtype torch.float32, got {x.dtype}")
        elif fmt == "int8" and name in ("q_codes", "k_codes"):
            if x.dtype != torch.int8:
                raise TypeError(f"{name}: expected dtype torch.int8 (INT8 codes, qk_format='int8'), got {x.dtype}")
        elif x.dtype != torch.uint8 and (fp8 is None or x.dtype != fp8):
            raise TypeError(f"{name}: expected dtype torch.uint8 or torch.float8_e4m3fn (E4M3 codes), got {x.dtype}")
    drop = 4 - input_rank   # rank 3: no batch axis
    lays = [lay.replace("B, ", "") if drop else lay for lay in layouts(fmt)]
    for name, x, lay in zip(names, tensors, lays):
        want = lay.count(",") + 1
        if x.dim() != want:
            raise ValueError(f"{name}: expected rank {want} {lay} (input_rank={input_rank}), got shape {shape_of(x)}")
    t4 = [x.unsqueeze(0) if drop else x for x in tensors]
    qc, kc = t4[0], t4[2]
    b, sq, h, d = (int(n) for n in qc.shape)
    bk, sk, hk, dk = (int(n) for n in kc.shape)
    if min(b, sq, h, d) < 1 or min(sk, hk, dk) < 1:
        bad = ("q_codes", tensors[0]) if min(b, sq, h, d) < 1 else ("k_codes", tensors[2])
        raise ValueError(f"{bad[0]}: expected non-empty dims, got shape {shape_of(bad[1])}")
    if max(b, sq, sk, h, d) > INT_MAX:
        raise ValueError(f"q_codes: sizes B, Sq, Sk, H, D must be < 2^31, got {(b, sq, sk, h, d)}")
    if bk != b:
        raise ValueError(f"k_codes: expected batch {b} like q_codes, got shape {shape_of(tensors[2])}")
    _gqa.check_heads(h, hk, "k_codes", shape_of(tensors[2]), "q_codes")
    if dk != d:
        raise ValueError(f"k_codes: expected head_dim {d} like q_codes, got shape {shape_of(tensors[2])}")
    if d not in PREPARE_HEAD_DIMS:
        raise ValueError(f"q_codes: head_dim {d} is not supported: expected 128 or 64, got shape "
                         f"{shape_of(tensors[0])}")
    sizes_txt = f"{'' if drop else f'B={b} '}Sq={sq} Sk={sk} H={h}{'' if hk == h else f' Hk={hk}'} D={d}"
    if hk != h:   # GQA / MQA: the K/V side's layouts hold Hk heads
        lays = lays[:2] + [lay.replace(" H,", " Hk,").replace(" H]", " Hk]") for lay in lays[2:]]
    for (name, shape, _), x, lay in zip(fp8_expectations(b, sq, sk, h, d, fmt, hk=hk), tensors, lays):
        want = tuple(shape[drop:])
        if shape_of(x) != want:
            hint = (" (the packed V layout of prepare_fp8; token-major [B, Sk, H, D] V codes are not accepted)"
                    if name == "v_packed" else "")
            raise ValueError(f"{name}: expected shape {want} = {lay} for {sizes_txt}{hint}, got {shape_of(x)}")
    for name, x in zip(names, tensors):
        if not x.is_contiguous():
            hint = (" (a permuted view of token-major V codes is not the packed layout)" if name == "v_packed"
                    else "")
            raise ValueError(f"{name}: expected a contiguous tensor (the kernel's fixed layout){hint}, got strides "
                             f"{tuple(x.stride())} for shape {shape_of(x)}")
        if x.requires_grad:
            raise ValueError(f"{name}: requires_grad=True is not supported: openvc is inference-only")
    dev = tensors[0].device
    if dev.type != "cuda":
        raise ValueError(f"q_codes: expected a CUDA tensor, got device {dev}")
    for name, x in zip(names[1:], tensors[1:]):
        if x.device != dev:
            raise ValueError(f"{name}: expected a CUDA tensor on q_codes's device {dev}, got {x.device}")
    t4 = [x.view(torch.uint8) if fp8 is not None and x.dtype == fp8 else x for x in t4]
    check_fp8_tensors(t4, "", (b, sq, sk, h, d), fmt, gqa=True)   # the layout attention_fp8 checks again
    return t4, dict(batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, head_dim=d, input_rank=input_rank, dtype=dtype,
                    qk_format=fmt, k_smoothing=smooth)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Checks the packed-sequence arguments of prepare_fp8 / attention (q [total_q, H, D], k and v
    [total_k, Hk, D], Hk == H or a divisor of it: GQA/MQA) and returns the sequence count. The offsets are
    never read: no device-to-host copy, so the call stays graph-capturable."""
    torch = import_torch()
    cus = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, cu in cus:
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name}: expected an int32 CUDA tensor of N + 1 offsets (packed sequences need both "
                            f"cu_seqlens_q and cu_seqlens_k), got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name}: expected a 1-D tensor of N + 1 >= 2 offsets, got shape {shape_of(cu)}")
        if not cu.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got stride {tuple(cu.stride())}")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} offsets like cu_seqlens_q (one per "
                         f"sequence, plus one), got {cu_seqlens_k.shape[0]}")
    nseq = int(cu_seqlens_q.shape[0]) - 1
    if nseq > INT_MAX:
        raise ValueError(f"cu_seqlens_q: at most 2^31 - 1 sequences, got {nseq}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # torch.SymInt: the fake implementation of the op under torch.compile with dynamic shapes.
        if m is None or isinstance(m, bool) or not isinstance(m, (numbers.Integral, torch.SymInt)):
            raise TypeError(f"{name}: expected a Python int >= 1 with cu_seqlens (the longest sequence, or an "
                            f"upper bound; it is never computed from the device offsets), got {type(m).__name__}")
        if not 1 <= m <= INT_MAX:
            raise ValueError(f"{name}: expected an int in [1, 2^31), got {m}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, torch.Tensor) and x.dim() != 3:
            total = "total_q" if name == "q" else "total_k"
            raise ValueError(f"{name}: packed sequences (cu_seqlens) need rank 3 [{total}, H, D], got shape "
                             f"{shape_of(x)}")
    check_tokens(q, k, v, gqa=True)     # dtypes, heads, head dim, strides, q's device
    for name, cu in cus:
        if cu.device != q.device:
            raise ValueError(f"{name}: expected a CUDA tensor on q's device {q.device}, got {cu.device}")
    return nseq


def softmax_scale(x) -> float:
    if x is None:
        return 0.0   # the C++ default: 1/sqrt(D)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"softmax_scale: expected None or a float > 0, got {type(x).__name__}")
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"softmax_scale: expected None or a finite float > 0, got {x}")
    return x


def mid_window(x) -> int:
    if x is None:
        return NATURAL_ORDER
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"mid_window_blocks: expected None (natural order) or an int >= 0, got {type(x).__name__}")
    if not 0 <= x <= INT_MAX:
        raise ValueError(f"mid_window_blocks: expected None (natural order) or an int in [0, 2^31), got {x}")
    return int(x)


def causal_chunk(x, causal) -> int:
    """causal_chunk: an int >= 1 (1: plain causal); another value needs causal=True (numerics section 5)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"causal_chunk: expected an int >= 1 (keys per chunk; 1 is plain causal), "
                        f"got {type(x).__name__}")
    if not 1 <= x <= INT_MAX:
        raise ValueError(f"causal_chunk: expected an int in [1, 2^31), got {x}")
    if x != 1 and not causal:
        raise ValueError(f"causal_chunk: {x} makes a chunked causal mask, which needs causal=True")
    return int(x)


def bool_arg(x, name) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return x


def out_dtype(x):
    """out_dtype: None (BF16, the default), torch.bfloat16 or torch.float16; returns the torch dtype."""
    torch = import_torch()
    if x is None:
        return torch.bfloat16
    if x not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype: expected None, torch.bfloat16 or torch.float16, got {x!r}")
    return x


def return_lse(x) -> bool:
    return bool_arg(x, "return_lse")


def version(version, mode) -> str:
    """Checks version and mode; returns the version ("open-vc" or "reference")."""
    modes = sorted(set(VERSIONS.values()))
    for name, x, allowed in (("version", version, sorted(VERSIONS)), ("mode", mode, modes)):
        if not isinstance(x, str):
            raise TypeError(f"{name}: expected a str, one of {allowed}, got {type(x).__name__}")
        if x not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {x!r}")
    if VERSIONS[version] != mode:
        raise ValueError(f"mode: version={version!r} runs mode={VERSIONS[version]!r} only, got mode={mode!r} "
                         "(FP8 ExpCast is version='open-vc', mode='expcast'; the BF16 SDPA baseline is "
                         "version='reference', mode='bf16')")
    return version


def check_general_grid(batch, heads, names, packed=False):
    """The general path's grid: batch (or the sequence count, packed) and heads are CUDA grid dimensions
    y/z, at most 65535 each. names: (what names the batch, what names the heads) in the message."""
    what = "sequences" if packed else "batches"
    for name, n, kind in ((names[0], batch, what), (names[1], heads, "heads")):
        if n > GRID_LIMIT:
            raise ValueError(f"{name}: the general path (CUDA cores) takes at most "
                             f"{GRID_LIMIT} {kind} (a CUDA grid dimension), got {n}; split the call along {kind}")


# ---- the custom ops' own arguments (open_vc_attn.ops; checked in the CUDA and the fake implementation) -------

def check_op_scalars(softmax_scale, mid_window_blocks=NATURAL_ORDER):
    """The ops' scalar conventions: softmax_scale <= 0 means 1/sqrt(D), mid_window_blocks -1 natural order."""
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float (<= 0: 1/sqrt(D)), got {softmax_scale}")
    if not NATURAL_ORDER <= mid_window_blocks <= INT_MAX:
        raise ValueError(f"mid_window_blocks: expected -1 (natural order) or an int in [0, 2^31), got "
                         f"{mid_window_blocks}")


def check_rank4_tokens(op, q, k, v, caller="prepare_fp8", gqa=False):
    """q, k, v of a preparing op: rank-4 [B, S, H, D], then the rules of check_tokens (caller: the function
    that the head-dim message names; gqa: K/V heads may divide q's)."""
    require_tensors(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name}: open_vc_attn::{op} takes rank-4 [B, S, H, D] tensors, got shape {shape_of(x)}")
    check_tokens(q, k, v, caller=caller, gqa=gqa)


def check_varlen_fp8(tensors, cu_q, cu_k, max_q, max_k, fmt="e4m3", v_blocks=False, gqa=True):
    """A packed preparation (layout of PreparedFP8 for max_seqlen_q/k and qk_format fmt; K/V tensors of Hk heads,
    a divisor of H, unless gqa names a function that takes equal head counts only); returns (N, total_q,
    total_k, H, D)."""
    torch = import_torch()
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name}: expected an int32 tensor of N + 1 offsets (packed sequences need both), got "
                            f"{type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2 or not cu.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous 1-D tensor of N + 1 >= 2 offsets, got shape "
                             f"{shape_of(cu)}")
    if cu_k.shape[0] != cu_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_q.shape[0]} offsets like cu_seqlens_q, got {cu_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not 1 <= m <= INT_MAX:
            raise ValueError(f"{name}: expected an int in [1, 2^31) with cu_seqlens, got {m}")
    for name, x in zip(FP8_NAMES, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    for name, x in (("q_codes", tensors[0]), ("k_codes", tensors[2])):
        if x.dim() != 3:
            raise ValueError(f"{name}: packed sequences need rank 3 [total, H, D], got shape {shape_of(x)}")
    n = cu_q.shape[0] - 1
    total_q, h, d = tensors[0].shape
    total_k, hk = tensors[2].shape[0], int(tensors[2].shape[1])
    _gqa.check_heads(int(h), hk, "k_codes", shape_of(tensors[2]), "q_codes", None if gqa is True else gqa)
    check_fixed_layouts(varlen_expectations(n, total_q, total_k, h, d, max_q, max_k, fmt, v_blocks, hk), tensors, "",
                        f"N={n} H={h}{'' if hk == h else f' Hk={hk}'} D={d} max_seqlen_q={max_q} "
                        f"max_seqlen_k={max_k}")
    if d not in PREPARE_HEAD_DIMS:
        raise ValueError(f"q_codes: head_dim {d} is not supported: expected 128 or 64, got shape "
                         f"{shape_of(tensors[0])}")
    if min(total_q, total_k, h) < 1:
        raise ValueError(f"q_codes, k_codes: expected non-empty dims, got total_q={total_q} total_k={total_k} H={h}")
    check_one_cuda_device((*FP8_NAMES, "cu_seqlens_q", "cu_seqlens_k"), (*tensors, cu_q, cu_k), "")
    return n, total_q, total_k, h, d


GENERAL_PATH = "the general path (open_vc_attn::attention_fp8 with path='general')"


def attention_path(x, name="path") -> str:
    """path of open_vc_attn::attention_fp8: "auto", "fast" or "general"; anything else raises ValueError."""
    if not isinstance(x, str) or x not in ATTENTION_PATHS:
        got = repr(x) if isinstance(x, str) else f"{x!r} ({type(x).__name__})"
        raise ValueError(f"{name}: expected one of {list(ATTENTION_PATHS)}, got {got}")
    return x


def check_attention_op_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale, mid_window_blocks, fmt="e4m3",
                            p_fmt="expcast", path="auto", v_blocks=False):
    """open_vc_attn::attention_fp8's arguments up to its route: the formats (path "general": E4M3 and ExpCast
    only), the scalars and a batched (offsets None) or packed preparation in the layouts of qk_format fmt
    (v_blocks: v_descale per key block; K/V tensors of Hk heads, a divisor of H: GQA/MQA); returns (packed,
    sizes): sizes (B, Sq, Sk, H, D) batched, (N, total_q, total_k, H, D) packed."""
    fmt = qk_format(fmt)
    p_format(p_fmt)
    if attention_path(path) == "general":   # before the P format's own rule: the path is what refuses them
        require_e4m3(fmt, GENERAL_PATH)
        require_expcast(p_fmt, GENERAL_PATH)
    p_format(p_fmt, fmt)
    check_op_scalars(softmax_scale, mid_window_blocks)
    if cu_q is not None or cu_k is not None:
        return True, check_varlen_fp8(tensors, cu_q, cu_k, max_q, max_k, fmt, v_blocks)
    sizes = check_fp8_tensors(tensors, "", None, fmt, v_blocks, gqa=True)
    if sizes[4] not in PREPARE_HEAD_DIMS:
        raise ValueError(f"q_codes: head_dim {sizes[4]} is not supported: expected 128 or 64")
    return False, sizes


def fast_path_range(sq, sk) -> bool:
    """The fast path's 32-bit diagonal arithmetic: ceil(Sq/128) * ceil(Sk/128) * 128 < 2^32."""
    return -(-sq // QUANT_BLOCK) * (-(-sk // QUANT_BLOCK) * QUANT_BLOCK) < 2**32


def check_seqused_k(seqused_k, n, device, what):
    """Optional key counts: None, or a contiguous int32 tensor of n entries (one per batch entry or packed
    sequence) on `device`. The values are read on the GPU only (clamped to [0, keys]), never here."""
    if seqused_k is None:
        return
    torch = import_torch()
    if not isinstance(seqused_k, torch.Tensor):
        raise TypeError(f"seqused_k: expected an int32 tensor of key counts or None, got {type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32:
        raise TypeError(f"seqused_k: expected dtype torch.int32, got {seqused_k.dtype}")
    if seqused_k.dim() != 1 or seqused_k.shape[0] != n or not seqused_k.is_contiguous():
        raise ValueError(f"seqused_k: expected a contiguous 1-D tensor of {n} key counts (one per {what[:-1]}), got "
                         f"shape {shape_of(seqused_k)}")
    if seqused_k.device != device:
        raise ValueError(f"seqused_k: expected a tensor on {device}, got {seqused_k.device}")
