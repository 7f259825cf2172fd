"""The rotary position embedding of interleaved pairs in one GPU pass (openvc::rotary_pairs, docs/api.md).

Video transformers rotate q and k right before attention; framework code does it as eight to ten
elementwise kernels through FP32 temporaries (diffusers' ``apply_rotary_emb`` with
``use_real_unbind_dim=-1``: CogVideoX, EasyAnimate, Flux; Mochi's processor). :func:`rotary_pairs` reads x
and the tables once and writes once, with the bits of that eager form: each product and the sum rounded to
FP32 as separate kernels round them, then to x's dtype (torch.compile may fuse the framework's form into
multiply-adds, whose bits differ; FP16 results past its range are inf, as in the framework's form). The
diffusers integration uses it in the processors it replaces. Importing this module does not import torch.
"""
from __future__ import annotations

from ._checks import import_torch
from ._checks_rotary import check_rotary_args

__all__ = ["rotary_pairs"]


def rotary_pairs(x, cos, sin, *, out=None):
    """Rotates every interleaved pair (a, b) = (x[..., 2j], x[..., 2j + 1]) of x [B, S, H, D] (BF16/FP16,
    CUDA, head dim contiguous) by the FP32 tables cos, sin [S, H, D / 2, 2] (expanded views are fine:
    stride 0 shares a table between heads, or between a pair's two elements):
    ``(a * cos[s,h,j,0] - b * sin[s,h,j,0], b * cos[s,h,j,1] + a * sin[s,h,j,1])``.

    out: None (a new tensor like x), x itself (the same tensor object: in place), or a tensor of x's shape
    and dtype that does not overlap x (e.g. a slice of a joint buffer; another view of x's memory raises), no
    element of the written tensor stored twice (an expanded view raises). Returns out. Enqueued on the current
    stream, no synchronization; inference only (no autograd). Needs the package's GPU build and a Hopper GPU,
    like the attention functions.
    """
    torch = import_torch()
    from .ops import rotary as _rotary_ops  # noqa: F401  (registers the ops)
    check_rotary_args(x, cos, sin, out, in_place=out is x)
    if out is None:
        out = torch.empty_like(x)
    if out is x:
        torch.ops.open_vc_attn.rotary_pairs_(x, cos, sin)
    else:
        torch.ops.open_vc_attn.rotary_pairs_out(x, cos, sin, out)
    return out
