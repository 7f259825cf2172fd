"""Argument rules of the rotary embedding (open_vc_attn.rotary_pairs, ops.rotary): a third part of the one
home of argument rules, next to :mod:`open_vc_attn._checks`. torch-free import.
"""
from __future__ import annotations

from ._checks import import_torch, shape_of
from ._layout import INT_MAX

MAX_HEAD_DIM = 512              # openvc::rotary_pairs: one block of 256 threads holds a row's pairs
MAX_ROWS = INT_MAX - 256        # its 32-bit grid and row arithmetic


def check_rotary_args(x, cos, sin, out=None, in_place=False):
    """x [B, S, H, D] BF16/FP16 on CUDA (head dim contiguous, even strides, D even and <= 512); cos, sin float32
    [S, H, D / 2, 2] with one set of strides between them (0 broadcasts); out None or a tensor of x's shape
    and dtype on its device (head dim contiguous, even strides); the tensor written (out, or x in place) with
    no element stored twice. Everything a fake tensor can show."""
    torch = import_torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor [B, S, H, D] (bfloat16 or float16), got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x: expected rank 4 [B, S, H, D], got shape {shape_of(x)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x: expected dtype torch.bfloat16 or torch.float16, got {x.dtype}")
    b, s, h, d = (int(n) for n in x.shape)
    if d % 2 or not 2 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"x: head dim must be even, in [2, {MAX_HEAD_DIM}] (interleaved pairs), got shape "
                         f"{shape_of(x)}")
    if b * s * h > MAX_ROWS:
        raise ValueError(f"x: B * S * H must be at most {MAX_ROWS}, got shape {shape_of(x)}")
    _check_pair_strides("x", x)
    want = (s, h, d // 2, 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a float32 torch.Tensor {list(want)} [S, H, D / 2, 2], got "
                            f"{type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {list(want)} [S, H, D / 2, 2] for x of shape {shape_of(x)} "
                             f"(expand a table shared by heads or pairs: stride 0), got {shape_of(t)}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype torch.float32 (the rotation is computed in FP32; .float() of "
                            f"a lower-precision table is exact), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: expected x's device {x.device}, got {t.device}")
    if any(a != b for a, b, n in zip(cos.stride(), sin.stride(), cos.shape) if n > 1):
        raise ValueError(f"sin: expected cos's strides {tuple(cos.stride())} (one set of table strides), got "
                         f"{tuple(sin.stride())}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor like x or None, got {type(out).__name__}")
        if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out: expected x's shape {shape_of(x)}, dtype {x.dtype} and device {x.device}, got "
                             f"{shape_of(out)}, {out.dtype}, {out.device}")
        _check_pair_strides("out", out)
    written = ("x", x) if in_place else ("out", out) if out is not None else None
    if written is not None and _self_overlapping(written[1]):
        raise ValueError(f"{written[0]}: its elements overlap (strides {tuple(written[1].stride())} for shape "
                         f"{shape_of(written[1])}, e.g. an expanded view): each is written once, so each needs its own "
                         "memory")
    if x.requires_grad or (cos.requires_grad or sin.requires_grad):
        raise ValueError("x, cos, sin: requires_grad=True is not supported: openvc's rotary embedding is "
                         "inference-only (no backward)")
    if x.device.type != "cuda":   # last, so that every other rule can be checked on CPU or meta tensors
        raise ValueError(f"x: expected a CUDA tensor, got device {x.device}")


def _check_pair_strides(name, t):
    """Head dim contiguous and the other strides even: a pair is loaded and stored as one 4-byte word."""
    stride = t.stride()
    if stride[3] != 1:
        raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {tuple(stride)}")
    if any(st % 2 for st, n in zip(stride[:3], t.shape[:3]) if n > 1):
        raise ValueError(f"{name}: the batch, token and head strides must be even (a pair is one 4-byte word), got "
                         f"strides {tuple(stride)}")


def _self_overlapping(t):
    """True when two elements of t share memory (a dim of size > 1 whose stride does not step over the dims
    inside it, as with expand)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return True
        span = st * n
    return False


def check_rotary_pointers(x, out=None):
    """What needs real tensors: 4-byte aligned data, and out (when given) not overlapping x at all: rotary_pairs_out
    reads x as it writes out, so even an exact alias goes to the in-place op (rotary.rotary_pairs with out=x)."""
    for name, t in (("x", x), ("out", out)):
        if t is not None and t.data_ptr() % 4:
            raise ValueError(f"{name}: the data pointer must be 4-byte aligned (a pair is one word), got address "
                             f"% 4 = {t.data_ptr() % 4}")
    if out is None or x.numel() == 0:
        return
    lo_x, hi_x = _extent(x)
    lo_o, hi_o = _extent(out)
    if lo_x < hi_o and lo_o < hi_x:
        raise ValueError("out: overlaps x's memory; pass out=x (the same tensor object) for the rotation in place, "
                         "or a tensor of its own")


def _extent(t):
    """[first byte, one past the last byte] of t's elements."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
