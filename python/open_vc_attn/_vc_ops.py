"""torch.library custom ops of the VC-Attention baseline (imports torch: import lazily, as
:mod:`open_vc_attn.baselines` does). Same conventions as :mod:`open_vc_attn.ops`: the ops allocate their
outputs (``mutates_args=()``), enqueue on ``torch.cuda.current_stream(device)``, never synchronize, and
have fake implementations for torch.compile and opcheck.

- ``open_vc_attn::vc_grouping(Tensor v) -> Tensor``: rank-4 BF16/FP16 v [B, S, H, 128]; int32
  permutation [B, H, S] (k-means grouping, numerics section 7).
- ``open_vc_attn::prepare_vc(Tensor q, Tensor k, Tensor v, Tensor permutation) -> (q_codes, q_descale,
  k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled)``: see baselines.PreparedVC.
- ``open_vc_attn::attention_vc_fp8(the seven tensors, float softmax_scale, bool return_lse) -> (out, lse)``:
  out BF16 [B, Sq, H, D]; lse float32 [B, H, Sq], or an empty [0] tensor when return_lse is False.
"""
import math

import torch

from . import _ext
from . import api as _api
from . import ops as _ops   # the device, alignment, view and stream helpers of the fast path's ops

__all__ = ["vc_grouping_op", "prepare_vc_op", "attention_vc_fp8_op"]

QUANT_BLOCK = _api.QUANT_BLOCK
VC_TENSOR_NAMES = ("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_channel_descale",
                   "block_mean_scaled")

_GROUPING_SCHEMA = "(Tensor v) -> Tensor"
_PREPARE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor permutation) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                     "Tensor v_channel_descale, Tensor block_mean_scaled, float softmax_scale, bool return_lse) "
                     "-> (Tensor, Tensor)")


def vc_expectations(b, sq, sk, h, d):
    """(name, shape, dtype name) of the seven prepared tensors, in op order."""
    nq, nk = -(-sq // QUANT_BLOCK), -(-sk // QUANT_BLOCK)
    return (("q_codes", (b, sq, h, d), "uint8"), ("q_descale", (b, h, nq), "float32"),
            ("k_codes", (b, sk, h, d), "uint8"), ("k_descale", (b, h, nk), "float32"),
            ("v_packed", (b, h, d, nk * QUANT_BLOCK), "uint8"), ("v_channel_descale", (b, h, d), "float32"),
            ("block_mean_scaled", (b, h, nk, d), "float32"))


def check_vc_tensors(tensors, prefix, sizes=None):
    """Checks the seven prepared tensors against each other (sizes from q_codes and k_codes) or against
    sizes = (B, Sq, Sk, H, D); returns the sizes. Plain metadata checks, traceable by torch.compile."""
    for name, x in zip(VC_TENSOR_NAMES, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{prefix}{name}: expected a torch.Tensor, got {type(x).__name__}")
    if sizes is None:
        qc, kc = tensors[0], tensors[2]
        for name, x in (("q_codes", qc), ("k_codes", kc)):
            if x.dim() != 4:
                raise ValueError(f"{prefix}{name}: expected rank 4 [B, S, H, D], got shape {tuple(x.shape)}")
        sizes = (qc.shape[0], qc.shape[1], kc.shape[1], qc.shape[2], qc.shape[3])
    b, sq, sk, h, d = sizes
    if min(sizes) < 1 or max(sizes) > _api._INT_MAX:
        raise ValueError(f"{prefix}q_codes: sizes B, Sq, Sk, H, D must be in [1, 2^31), got {tuple(sizes)}")
    if d != _api.KERNEL_HEAD_DIM:
        raise ValueError(f"{prefix}q_codes: the VC baseline supports head_dim {_api.KERNEL_HEAD_DIM} only, got {d}")
    _api._check_fixed_layouts(vc_expectations(b, sq, sk, h, d), tensors, prefix, sizes)
    _api._check_one_cuda_device(VC_TENSOR_NAMES, tensors, prefix)
    return b, sq, sk, h, d


def check_permutation(perm, k, name="permutation"):
    """int32 [B, H, Sk] contiguous on k's device (k rank 4). Values are not read (no synchronization)."""
    b, sk, h = k.shape[0], k.shape[1], k.shape[2]
    if not isinstance(perm, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 torch.Tensor [B, H, Sk] from vc_grouping, got "
                        f"{type(perm).__name__}")
    if perm.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32 (from vc_grouping), got {perm.dtype}")
    if tuple(perm.shape) != (b, h, sk):
        raise ValueError(f"{name}: expected shape {(b, h, sk)} = [B, H, Sk] for k of shape {tuple(k.shape)}, got "
                         f"{tuple(perm.shape)}")
    if not perm.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(perm.stride())}")
    if perm.device != k.device:
        raise ValueError(f"{name}: expected a tensor on k's device {k.device}, got {perm.device}")


def _empty(device):
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


# ---- vc_grouping --------------------------------------------------------------------------------------

def _check_grouping_args(v):
    if v.dim() != 4:
        raise ValueError(f"v: open_vc_attn::vc_grouping takes a rank-4 [B, S, H, D] tensor, got {tuple(v.shape)}")
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"v: expected dtype torch.bfloat16 or torch.float16, got {v.dtype}")
    if v.shape[3] != _api.KERNEL_HEAD_DIM:
        raise ValueError(f"v: the VC grouping supports head_dim {_api.KERNEL_HEAD_DIM} only, got {tuple(v.shape)}")
    _api._check_token_strides("v", v)


@torch.library.custom_op("open_vc_attn::vc_grouping", mutates_args=(), device_types="cuda", schema=_GROUPING_SCHEMA)
def _vc_grouping(v):
    _check_grouping_args(v)
    _ops._check_device(v.device)
    _ops._check_aligned((("v", v),))
    b, s, h, d = (int(n) for n in v.shape)
    perm = torch.empty((b, h, s), dtype=torch.int32, device=v.device)
    ext = _ext.load()
    ws = torch.empty(max(int(ext.vc_grouping_workspace_bytes(b, h, s)), 16), dtype=torch.uint8, device=v.device)
    with torch.cuda.device(v.device):
        ext.vc_grouping(v.dtype == torch.bfloat16, b, s, h, d, _ops._view(v), perm.data_ptr(), ws.data_ptr(),
                        ws.numel(), _ops._stream(v.device))
    return perm


@_vc_grouping.register_fake
def _vc_grouping_fake(v):
    _check_grouping_args(v)
    b, s, h, _ = v.shape
    return v.new_empty((b, h, s), dtype=torch.int32)


# ---- prepare_vc -----------------------------------------------------------------------------------------

def _prepare_outputs(q, k, alloc):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    return tuple(alloc(shape, getattr(torch, dtype)) for _, shape, dtype in vc_expectations(b, sq, sk, h, d))


def _check_prepare_args(q, k, v, permutation):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name}: open_vc_attn::prepare_vc takes rank-4 [B, S, H, D] tensors, got shape "
                             f"{tuple(x.shape)}")
    _api._check_tokens(q, k, v)
    if q.shape[3] != _api.KERNEL_HEAD_DIM:
        raise ValueError(f"q: the VC baseline supports head_dim {_api.KERNEL_HEAD_DIM} only, got shape {tuple(q.shape)}")
    check_permutation(permutation, k)


@torch.library.custom_op("open_vc_attn::prepare_vc", mutates_args=(), device_types="cuda", schema=_PREPARE_SCHEMA)
def _prepare_vc(q, k, v, permutation):
    _check_prepare_args(q, k, v, permutation)
    _ops._check_device(q.device)
    _ops._check_aligned((("q", q), ("k", k), ("v", v)))
    outs = _prepare_outputs(q, k, _empty(q.device))
    b, sq, h, d = (int(n) for n in q.shape)
    ext = _ext.load()
    # Per-channel amax scratch; zeroed by the first kernel, so torch.empty is enough.
    ws = torch.empty(max(int(ext.vc_prepare_workspace_bytes(b, h)), 16), dtype=torch.uint8, device=q.device)
    with torch.cuda.device(q.device):
        ext.vc_prepare(q.dtype == torch.bfloat16, b, sq, int(k.shape[1]), h, d, _ops._view(q), _ops._view(k),
                       _ops._view(v), permutation.data_ptr(), *(t.data_ptr() for t in outs), 0, ws.data_ptr(),
                       ws.numel(), _ops._stream(q.device))
    return outs


@_prepare_vc.register_fake
def _prepare_vc_fake(q, k, v, permutation):
    _check_prepare_args(q, k, v, permutation)
    return _prepare_outputs(q, k, lambda shape, dtype: q.new_empty(shape, dtype=dtype))


# ---- attention_vc_fp8 -------------------------------------------------------------------------------------

def _check_attention_args(tensors, softmax_scale):
    sizes = check_vc_tensors(tensors, "")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float (<= 0: 1/sqrt(D)), got {softmax_scale}")
    return sizes


def _attention_outputs(q_codes, return_lse, alloc):
    b, sq, h, d = q_codes.shape
    return alloc((b, sq, h, d), torch.bfloat16), alloc((b, h, sq) if return_lse else (0,), torch.float32)


@torch.library.custom_op("open_vc_attn::attention_vc_fp8", mutates_args=(), device_types="cuda",
                         schema=_ATTENTION_SCHEMA)
def _attention_vc_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled,
                      softmax_scale, return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled)
    b, sq, sk, h, d = (int(n) for n in _check_attention_args(tensors, softmax_scale))
    _ops._check_device(q_codes.device)
    _ops._check_aligned(zip(VC_TENSOR_NAMES, tensors))
    out, lse = _attention_outputs(q_codes, return_lse, _empty(q_codes.device))
    with torch.cuda.device(q_codes.device):
        _ext.load().attention_vc_fp8(b, sq, sk, h, d, *(t.data_ptr() for t in tensors), out.data_ptr(),
                                     *out.stride()[:3], lse.data_ptr() if return_lse else 0, float(softmax_scale),
                                     _ops._stream(q_codes.device))
    return out, lse


@_attention_vc_fp8.register_fake
def _attention_vc_fp8_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled,
                           softmax_scale, return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled)
    _check_attention_args(tensors, softmax_scale)
    return _attention_outputs(q_codes, return_lse, lambda shape, dtype: q_codes.new_empty(shape, dtype=dtype))


vc_grouping_op = torch.ops.open_vc_attn.vc_grouping.default
prepare_vc_op = torch.ops.open_vc_attn.prepare_vc.default
attention_vc_fp8_op = torch.ops.open_vc_attn.attention_vc_fp8.default
