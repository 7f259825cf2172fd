"""torch.library custom ops over the GPU entry points of ``_openvc_ext`` (imports torch: import lazily).

- ``open_vc_attn::prepare_fp8(Tensor q, Tensor k, Tensor v) -> (q_codes, q_descale, k_codes, k_descale,
  v_packed, v_descale)``: rank-4 BF16/FP16 CUDA inputs, new contiguous outputs (see api.PreparedFP8).
- ``open_vc_attn::prepare_fp8_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
  int max_seqlen_q, int max_seqlen_k) -> (six tensors)``: packed sequences, q [total_q, H, D], k and v
  [total_k, H, D], int32 offsets (read on the GPU only); outputs as described in api.PreparedFP8.
- ``open_vc_attn::attention_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale,
  float softmax_scale, int mid_window_blocks, bool return_lse) -> (out, lse)``: out BF16 [B, Sq, H, D];
  lse float32 [B, H, Sq], or an empty [0] tensor when return_lse is False (an op returns a fixed number
  of tensors). softmax_scale <= 0 means 1/sqrt(D); mid_window_blocks -1 means natural order.

Both ops allocate their outputs (so mutates_args=()), enqueue on ``torch.cuda.current_stream(device)``
and never synchronize; their fake implementations give the same shapes, dtypes and strides, which is
what torch.compile and torch.library.opcheck need. Most users want :mod:`open_vc_attn.api` instead.
"""
import functools
import math

import torch

from . import _ext
from . import api as _api

__all__ = ["prepare_fp8_op", "prepare_fp8_varlen_op", "attention_fp8_op"]

_PREPARE_SCHEMA = "(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
_PREPARE_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                          "int max_seqlen_k) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                     "Tensor v_descale, float softmax_scale, int mid_window_blocks, bool return_lse) "
                     "-> (Tensor, Tensor)")


# ---- run-time checks that need real tensors (pointers, the device): never traced ----------------------

@functools.lru_cache(maxsize=None)
def _unsupported_device(index: int):
    """None when device `index` is compute capability 9.0, else why it cannot run the kernels."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) == (9, 0):
        return None
    return (f"open_vc_attn: device cuda:{index} ({torch.cuda.get_device_name(index)}) is compute capability "
            f"{major}.{minor}; the FP8 kernels are built for sm_90a and need 9.0 (Hopper)")


def _check_device(device):
    reason = _unsupported_device(device.index if device.index is not None else torch.cuda.current_device())
    if reason:
        raise RuntimeError(reason)


def _check_aligned(named):
    for name, x in named:
        if x.data_ptr() % 16:
            raise ValueError(f"{name}: the data pointer must be 16-byte aligned for the kernels' vector loads, "
                             f"got address % 16 = {x.data_ptr() % 16} (storage_offset {x.storage_offset()}); "
                             "call .contiguous() or slice at a multiple of 8 elements")


def _view(x):
    """(pointer, stride_batch, stride_seq, stride_head) of a [B, S, H, D] tensor. The stride of a size-1
    dim is never used, and torch leaves it arbitrary, so it is passed as 0 (always a valid multiple of 8)."""
    strides = [st if n > 1 else 0 for n, st in zip(x.shape[:3], x.stride()[:3])]
    return (x.data_ptr(), *strides)


def _stream(device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# ---- prepare_fp8 ----------------------------------------------------------------------------------------

def _prepare_outputs(q, k, alloc):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    nq, nk = (sq + 127) // 128, (sk + 127) // 128
    u8, f32 = torch.uint8, torch.float32
    return (alloc((b, sq, h, d), u8), alloc((b, h, nq), f32), alloc((b, sk, h, d), u8),
            alloc((b, h, nk), f32), alloc((b, h, d, nk * 128), u8), alloc((b, h), f32))


def _check_prepare_args(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name}: open_vc_attn::prepare_fp8 takes rank-4 [B, S, H, D] tensors, got shape "
                             f"{tuple(x.shape)}")
    _api._check_tokens(q, k, v)


@torch.library.custom_op("open_vc_attn::prepare_fp8", mutates_args=(), device_types="cuda", schema=_PREPARE_SCHEMA)
def _prepare_fp8(q, k, v):
    _check_prepare_args(q, k, v)
    _check_device(q.device)
    _check_aligned((("q", q), ("k", k), ("v", v)))
    outs = _prepare_outputs(q, k, lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device))
    b, sq, h, d = (int(s) for s in q.shape)
    ext = _ext.load()
    # v_amax scratch; zeroed by the first kernel, so torch.empty is enough.
    ws = torch.empty(max(int(ext.prepare_workspace_bytes(b, h)), 16), dtype=torch.uint8, device=q.device)
    with torch.cuda.device(q.device):  # the C++ side launches on the current device
        ext.prepare_fp8(q.dtype == torch.bfloat16, b, sq, int(k.shape[1]), h, d, _view(q), _view(k), _view(v),
                        *(t.data_ptr() for t in outs), ws.data_ptr(), ws.numel(), _stream(q.device))
    return outs


@_prepare_fp8.register_fake
def _prepare_fp8_fake(q, k, v):
    _check_prepare_args(q, k, v)
    return _prepare_outputs(q, k, lambda shape, dtype: q.new_empty(shape, dtype=dtype))


# ---- prepare_fp8_varlen (packed sequences) ----------------------------------------------------------------

def _prepare_varlen_outputs(q, k, nseq, max_seqlen_q, max_seqlen_k, alloc):
    total_q, h, d = q.shape
    total_k = k.shape[0]
    nq, nk = (max_seqlen_q + 127) // 128, (max_seqlen_k + 127) // 128
    u8, f32 = torch.uint8, torch.float32
    return (alloc((total_q, h, d), u8), alloc((nseq, h, nq), f32), alloc((total_k, h, d), u8),
            alloc((nseq, h, nk), f32), alloc((nseq, h, d, nk * 128), u8), alloc((nseq, h), f32))


def _view_packed(x):
    """(pointer, 0, stride_seq, stride_head) of a [total, H, D] tensor (no batch stride; size-1 dims: 0)."""
    strides = [st if n > 1 else 0 for n, st in zip(x.shape[:2], x.stride()[:2])]
    return (x.data_ptr(), 0, *strides)


@torch.library.custom_op("open_vc_attn::prepare_fp8_varlen", mutates_args=(), device_types="cuda",
                         schema=_PREPARE_VARLEN_SCHEMA)
def _prepare_fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    nseq = _api._check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_device(q.device)
    _check_aligned((("q", q), ("k", k), ("v", v)))
    outs = _prepare_varlen_outputs(q, k, nseq, max_seqlen_q, max_seqlen_k,
                                   lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q.device))
    h, d = int(q.shape[1]), int(q.shape[2])
    ext = _ext.load()
    ws = torch.empty(max(int(ext.prepare_workspace_bytes(nseq, h)), 16), dtype=torch.uint8, device=q.device)
    with torch.cuda.device(q.device):
        ext.prepare_fp8_varlen(q.dtype == torch.bfloat16, nseq, int(max_seqlen_q), int(max_seqlen_k), h, d,
                               _view_packed(q), _view_packed(k), _view_packed(v), cu_seqlens_q.data_ptr(),
                               cu_seqlens_k.data_ptr(), *(t.data_ptr() for t in outs), ws.data_ptr(), ws.numel(),
                               _stream(q.device))
    return outs


@_prepare_fp8_varlen.register_fake
def _prepare_fp8_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    nseq = _api._check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _prepare_varlen_outputs(q, k, nseq, max_seqlen_q, max_seqlen_k,
                                   lambda shape, dtype: q.new_empty(shape, dtype=dtype))


# ---- attention_fp8 --------------------------------------------------------------------------------------

def _attention_outputs(q_codes, return_lse, alloc):
    b, sq, h, d = q_codes.shape
    return alloc((b, sq, h, d), torch.bfloat16), alloc((b, h, sq) if return_lse else (0,), torch.float32)


def _check_attention_args(tensors, softmax_scale, mid_window_blocks):
    b, sq, sk, h, d = _api._check_fp8_tensors(tensors, "")
    if d != _api.KERNEL_HEAD_DIM:
        raise ValueError(f"q_codes: open_vc_attn::attention_fp8 supports head_dim {_api.KERNEL_HEAD_DIM} only, "
                         f"got {d}")
    # The op's own scalar conventions: <= 0 scale means 1/sqrt(D), -1 the natural key order.
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float (<= 0: 1/sqrt(D)), got {softmax_scale}")
    if not _api.NATURAL_ORDER <= mid_window_blocks <= _api._INT_MAX:
        raise ValueError(f"mid_window_blocks: expected -1 (natural order) or an int in [0, 2^31), got "
                         f"{mid_window_blocks}")
    return b, sq, sk, h, d


@torch.library.custom_op("open_vc_attn::attention_fp8", mutates_args=(), device_types="cuda",
                         schema=_ATTENTION_SCHEMA)
def _attention_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, softmax_scale,
                     mid_window_blocks, return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
    b, sq, sk, h, d = (int(s) for s in _check_attention_args(tensors, softmax_scale, mid_window_blocks))
    _check_device(q_codes.device)
    _check_aligned(zip(("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale"), tensors))
    out, lse = _attention_outputs(q_codes, return_lse,
                                  lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q_codes.device))
    with torch.cuda.device(q_codes.device):
        _ext.load().attention_fp8(b, sq, sk, h, d, *(t.data_ptr() for t in tensors), out.data_ptr(),
                                  *out.stride()[:3], lse.data_ptr() if return_lse else 0,
                                  float(softmax_scale), int(mid_window_blocks), _stream(q_codes.device))
    return out, lse


@_attention_fp8.register_fake
def _attention_fp8_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, softmax_scale,
                        mid_window_blocks, return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
    _check_attention_args(tensors, softmax_scale, mid_window_blocks)
    return _attention_outputs(q_codes, return_lse, lambda shape, dtype: q_codes.new_empty(shape, dtype=dtype))


# What api.py calls: the registered operator overloads, which torch.compile puts in its graph as they are.
prepare_fp8_op = torch.ops.open_vc_attn.prepare_fp8.default
prepare_fp8_varlen_op = torch.ops.open_vc_attn.prepare_fp8_varlen.default
attention_fp8_op = torch.ops.open_vc_attn.attention_fp8.default
