"""Argument rules of the VC-Attention baseline (open_vc_attn.baselines, ops.vc) and of V residual repair
(open_vc_attn.repair, ops.repair): the second half of the one home of argument rules, next to
:mod:`open_vc_attn._checks` (the attention and preparation rules it builds on). torch-free import.
"""
from __future__ import annotations

import math
import numbers

from ._checks import (check_fixed_layouts, check_fp8_tensors, check_one_cuda_device, check_op_scalars,
                      check_rank4_tokens, check_token_strides, check_tokens, import_torch, shape_of)
from ._layout import INT_MAX, KERNEL_HEAD_DIM, VC_NAMES, fp8_expectations, repair_expectations, vc_expectations


# ---- VC-Attention baseline (open_vc_attn.baselines, ops.vc) -------------------------------------------------

def check_vc_v(v, name="v"):
    """v of vc_grouping: rank 4 [B, S, H, 128] or 3 [S, H, 128], BF16/FP16, CUDA; returns (rank-4 view, rank)."""
    torch = import_torch()
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (CUDA, bfloat16 or float16), got {type(v).__name__}")
    if v.dim() not in (3, 4):
        raise ValueError(f"{name}: expected rank 4 [B, S, H, D] or rank 3 [S, H, D], got shape {shape_of(v)}")
    v4 = v.unsqueeze(0) if v.dim() == 3 else v
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got {v.dtype}")
    if v.numel() == 0:
        raise ValueError(f"{name}: expected non-empty dims, got shape {shape_of(v)}")
    if max(v.shape) > INT_MAX:
        raise ValueError(f"{name}: dims must be < 2^31 (C++ ints), got shape {shape_of(v)}")
    if v4.shape[3] != KERNEL_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {v4.shape[3]} is not supported: the VC baseline takes "
                         f"{KERNEL_HEAD_DIM}, got shape {shape_of(v)}")
    if v.requires_grad:
        raise ValueError(f"{name}: requires_grad=True is not supported: openvc is inference-only")
    check_token_strides(name, v4)
    if v.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got device {v.device}")
    return v4, v.dim()


def check_vc_qkv(q, k, v):
    """q, k, v as in prepare_fp8, head_dim 128 only; returns rank-4 views and q's rank."""
    torch = import_torch()
    if isinstance(q, torch.Tensor) and q.dim() in (3, 4) and q.shape[-1] != KERNEL_HEAD_DIM:
        raise ValueError(f"q: head_dim {q.shape[-1]} is not supported: the VC baseline takes "
                         f"{KERNEL_HEAD_DIM}, got shape {shape_of(q)}")
    return check_tokens(q, k, v, head_dims=(KERNEL_HEAD_DIM,), caller="prepare_vc")


def check_vc_tensors(tensors, prefix, sizes=None):
    """The seven VC-prepared tensors against each other (sizes from q_codes and k_codes) or against
    sizes = (B, Sq, Sk, H, D); returns the sizes."""
    torch = import_torch()
    for name, x in zip(VC_NAMES, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{prefix}{name}: expected a torch.Tensor, got {type(x).__name__}")
    if sizes is None:
        qc, kc = tensors[0], tensors[2]
        for name, x in (("q_codes", qc), ("k_codes", kc)):
            if x.dim() != 4:
                raise ValueError(f"{prefix}{name}: expected rank 4 [B, S, H, D], got shape {shape_of(x)}")
        sizes = (qc.shape[0], qc.shape[1], kc.shape[1], qc.shape[2], qc.shape[3])
    b, sq, sk, h, d = sizes
    if min(sizes) < 1 or max(sizes) > INT_MAX:
        raise ValueError(f"{prefix}q_codes: sizes B, Sq, Sk, H, D must be in [1, 2^31), got {tuple(sizes)}")
    if d != KERNEL_HEAD_DIM:
        raise ValueError(f"{prefix}q_codes: the VC baseline supports head_dim {KERNEL_HEAD_DIM} only, got {d}")
    check_fixed_layouts(vc_expectations(b, sq, sk, h, d), tensors, prefix, sizes)
    check_one_cuda_device(VC_NAMES, tensors, prefix)
    return b, sq, sk, h, d


def check_permutation(perm, k, name="permutation"):
    """int32 [B, H, Sk] contiguous on k's device (k rank 4). Values are not read (no synchronization)."""
    torch = import_torch()
    b, sk, h = k.shape[0], k.shape[1], k.shape[2]
    if not isinstance(perm, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 torch.Tensor [B, H, Sk] from vc_grouping, got "
                        f"{type(perm).__name__}")
    if perm.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32 (from vc_grouping), got {perm.dtype}")
    if tuple(perm.shape) != (b, h, sk):
        raise ValueError(f"{name}: expected shape {(b, h, sk)} = [B, H, Sk] for k of shape {shape_of(k)}, got "
                         f"{shape_of(perm)}")
    if not perm.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(perm.stride())}")
    if perm.device != k.device:
        raise ValueError(f"{name}: expected a tensor on k's device {k.device}, got {perm.device}")


def check_vc_grouping_op_args(v):
    torch = import_torch()
    if v.dim() != 4:
        raise ValueError(f"v: open_vc_attn::vc_grouping takes a rank-4 [B, S, H, D] tensor, got {shape_of(v)}")
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"v: expected dtype torch.bfloat16 or torch.float16, got {v.dtype}")
    if v.shape[3] != KERNEL_HEAD_DIM:
        raise ValueError(f"v: the VC grouping supports head_dim {KERNEL_HEAD_DIM} only, got {shape_of(v)}")
    check_token_strides("v", v)


def check_vc_prepare_op_args(q, k, v, permutation):
    check_rank4_tokens("prepare_vc", q, k, v)
    if q.shape[3] != KERNEL_HEAD_DIM:
        raise ValueError(f"q: the VC baseline supports head_dim {KERNEL_HEAD_DIM} only, got shape {shape_of(q)}")
    check_permutation(permutation, k)


def check_vc_attention_op_args(tensors, softmax_scale):
    sizes = check_vc_tensors(tensors, "")
    check_op_scalars(softmax_scale)
    return sizes


# ---- V residual repair (open_vc_attn.repair, ops.repair) -----------------------------------------------------

SELECTIONS = ("energy", "attention")


def budget(x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"budget: expected a float in [0, 1), got {type(x).__name__}")
    x = float(x)
    if not (math.isfinite(x) and 0.0 <= x < 1.0):
        raise ValueError(f"budget: expected a finite float in [0, 1) (the fraction of V tokens per head that get "
                         f"a repair row), got {x}")
    return x


def selection(x) -> str:
    if x not in SELECTIONS:
        raise ValueError(f"selection: expected one of {SELECTIONS}, got {x!r}")
    return x


def sample_rows(x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 1 <= x <= INT_MAX:
        raise ValueError(f"sample_rows: expected an int >= 1 (query rows sampled by selection='attention'), got {x!r}")
    return int(x)


def repair_rows(x, seqlen_k) -> int:
    """Rows per head for budget x: round half away from zero of x * seqlen_k in double, as the C++
    openvc::repair_row_count and the reference compute it."""
    y = budget(x) * int(seqlen_k)
    whole = math.floor(y)
    return int(whole) + (1 if y - whole >= 0.5 else 0)   # y - floor(y) is exact for doubles


def check_repair_fp8(tensors, softmax_scale, mid_window_blocks):
    """The preparation and scalars of open_vc_attn::attention_fp8_repair: batched E4M3, head_dim 128 (the
    fast path's repair variant); returns (B, Sq, Sk, H, D)."""
    b, sq, sk, h, d = check_fp8_tensors(tensors, "", None)
    if d != KERNEL_HEAD_DIM:
        raise ValueError(f"q_codes: open_vc_attn::attention_fp8_repair supports head_dim {KERNEL_HEAD_DIM} only, "
                         f"got {d}")
    check_op_scalars(softmax_scale, mid_window_blocks)
    return b, sq, sk, h, d


def check_repair_tensors(tensors, b, h, d, rows, prefix=""):
    """The four repair tensors (PreparedRepair.tensors() order) against B, H, D and rows."""
    torch = import_torch()
    want = repair_expectations(b, h, d, rows)
    for (name, shape, dtype), x in zip(want, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{prefix}{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != getattr(torch, dtype):
            raise TypeError(f"{prefix}{name}: expected dtype torch.{dtype}, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{prefix}{name}: expected shape {shape} for B={b} H={h} D={d} rows={rows}, got "
                             f"{shape_of(x)}")
        if not x.is_contiguous():
            raise ValueError(f"{prefix}{name}: expected a contiguous tensor, got strides {tuple(x.stride())}")
    dev = tensors[0].device
    for (name, _, _), x in zip(want, tensors):
        if x.device.type != "cuda" or x.device != dev:
            raise ValueError(f"{prefix}{name}: expected a CUDA tensor on {dev}, got {x.device}")


def check_repair_op_inputs(v, k_codes, k_descale, v_packed, v_descale):
    """v and the K/V part of its preparation, as the repair ops take them; returns (B, Sk, H, D) as given
    (symbolic under torch.compile's dynamic shapes)."""
    torch = import_torch()
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"v: expected a rank-4 [B, Sk, H, D] tensor, got {getattr(v, 'shape', type(v).__name__)}")
    b, sk, h, d = v.shape
    check_token_strides("v", v)
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"v: expected dtype torch.bfloat16 or torch.float16, got {v.dtype}")
    if d != KERNEL_HEAD_DIM:
        raise ValueError(f"v: head_dim must be {KERNEL_HEAD_DIM}, got shape {shape_of(v)}")
    expected = fp8_expectations(b, 1, sk, h, d)[2:]
    for (name, shape, dtype), x in zip(expected, (k_codes, k_descale, v_packed, v_descale)):
        dtype = getattr(torch, dtype)
        if x.dtype != dtype or tuple(x.shape) != tuple(shape) or not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {tuple(shape)} (prepare_fp8's "
                             f"layout for v's shape), got {x.dtype} {shape_of(x)} strides {tuple(x.stride())}")
    return b, sk, h, d


def check_repair_tokens(tokens, b, h):
    """The int32 [B, H, rows] token list of build_v_repair; returns rows."""
    torch = import_torch()
    if tokens.dtype != torch.int32 or tokens.dim() != 3 or tuple(tokens.shape[:2]) != (b, h) \
            or not tokens.is_contiguous():
        raise ValueError(f"tokens: expected a contiguous int32 tensor [B, H, rows] with B={b} H={h}, got "
                         f"{tokens.dtype} {shape_of(tokens)}")
    return tokens.shape[2]
