"""torch.library custom ops over the GPU entry points of ``_openvc_ext`` (imports torch: import lazily).

- ``open_vc_attn::prepare_fp8(Tensor q, Tensor k, Tensor v) -> (q_codes, q_descale, k_codes, k_descale,
  v_packed, v_descale)``: rank-4 BF16/FP16 CUDA inputs, new contiguous outputs (see api.PreparedFP8).
- ``open_vc_attn::prepare_fp8_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
  int max_seqlen_q, int max_seqlen_k) -> (six tensors)``: packed sequences, q [total_q, H, D], k and v
  [total_k, H, D], int32 offsets (read on the GPU only); outputs as described in api.PreparedFP8.
- ``open_vc_attn::attention_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale,
  float softmax_scale, int mid_window_blocks, bool return_lse) -> (out, lse)``: out BF16 [B, Sq, H, D];
  lse float32 [B, H, Sq], or an empty [0] tensor when return_lse is False (an op returns a fixed number
  of tensors). softmax_scale <= 0 means 1/sqrt(D); mid_window_blocks -1 means natural order. The sm_90a
  fast path: head_dim 128, non-causal, batched.
- ``open_vc_attn::attention_general(six tensors, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q,
  int max_seqlen_k, float softmax_scale, bool causal, int mid_window_blocks, bool return_lse) -> (out, lse)``:
  the general path (causal, packed sequences, head_dim 64 or 128). Without offsets the six tensors are a
  batched preparation and the outputs are those of attention_fp8 (max_seqlen_q/k ignored); with them, the
  packed layout of api.PreparedFP8 for max_seqlen_q/k, out BF16 [total_q, H, D] and lse float32
  [H, total_q] (the flash-attn varlen layout).

The ops allocate their outputs (so mutates_args=()), enqueue on ``torch.cuda.current_stream(device)``
and never synchronize; their fake implementations give the same shapes, dtypes and strides, which is
what torch.compile and torch.library.opcheck need. Most users want :mod:`open_vc_attn.api` instead.
"""
import functools
import math

import torch

from . import _ext
from . import api as _api

__all__ = ["prepare_fp8_op", "prepare_fp8_varlen_op", "attention_fp8_op", "attention_general_op"]

_PREPARE_SCHEMA = "(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
_PREPARE_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                          "int max_seqlen_k) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                     "Tensor v_descale, float softmax_scale, int mid_window_blocks, bool return_lse) "
                     "-> (Tensor, Tensor)")
_GENERAL_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                   "Tensor v_descale, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
                   "float softmax_scale, bool causal, int mid_window_blocks, bool return_lse) -> (Tensor, Tensor)")
_FP8_NAMES = ("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale")


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
                         f"got {d} (open_vc_attn::attention_general takes 64)")
    _check_op_scalars(softmax_scale, mid_window_blocks)
    return b, sq, sk, h, d


def _check_op_scalars(softmax_scale, mid_window_blocks):
    # The ops' own scalar conventions: <= 0 scale means 1/sqrt(D), -1 the natural key order.
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite float (<= 0: 1/sqrt(D)), got {softmax_scale}")
    if not _api.NATURAL_ORDER <= mid_window_blocks <= _api._INT_MAX:
        raise ValueError(f"mid_window_blocks: expected -1 (natural order) or an int in [0, 2^31), got "
                         f"{mid_window_blocks}")


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


# ---- attention_general (causal, packed sequences, head_dim 64) -------------------------------------------

def _check_varlen_fp8(tensors, cu_q, cu_k, max_q, max_k):
    """Packed preparations (layout of api.PreparedFP8 for max_seqlen_q/k); returns (N, total_q, total_k, H, D).
    Device checks last, as everywhere."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name}: expected an int32 tensor of N + 1 offsets (packed sequences need both), got "
                            f"{type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2 or not cu.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous 1-D tensor of N + 1 >= 2 offsets, got shape "
                             f"{tuple(cu.shape)}")
    if cu_k.shape[0] != cu_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_q.shape[0]} offsets like cu_seqlens_q, got {cu_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not 1 <= m <= _api._INT_MAX:
            raise ValueError(f"{name}: expected an int in [1, 2^31) with cu_seqlens, got {m}")
    for name, x in zip(_FP8_NAMES, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    for name in ("q_codes", "k_codes"):
        x = tensors[_FP8_NAMES.index(name)]
        if x.dim() != 3:
            raise ValueError(f"{name}: packed sequences need rank 3 [total, H, D], got shape {tuple(x.shape)}")
    n = cu_q.shape[0] - 1
    total_q, h, d = tensors[0].shape
    total_k = tensors[2].shape[0]
    nq, nk = (max_q + 127) // 128, (max_k + 127) // 128
    want = ((total_q, h, d), (n, h, nq), (total_k, h, d), (n, h, nk), (n, h, d, nk * 128), (n, h))
    for name, x, shape in zip(_FP8_NAMES, tensors, want):
        dtype = torch.float32 if name.endswith("descale") else torch.uint8
        if x.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {x.dtype}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)} for N={n} H={h} D={d} max_seqlen_q={max_q} "
                             f"max_seqlen_k={max_k}, got {tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(x.stride())}")
        if x.requires_grad:
            raise ValueError(f"{name}: requires_grad=True is not supported: openvc is inference-only")
    if d not in _api.PREPARE_HEAD_DIMS:
        raise ValueError(f"q_codes: head_dim {d} is not supported: expected 128 or 64, got shape {tuple(tensors[0].shape)}")
    if min(total_q, total_k, h) < 1:
        raise ValueError(f"q_codes, k_codes: expected non-empty dims, got total_q={total_q} total_k={total_k} H={h}")
    dev = tensors[0].device
    for name, x in (*zip(_FP8_NAMES, tensors), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if x.device.type != "cuda" or x.device != dev:
            raise ValueError(f"{name}: expected a CUDA tensor on q_codes's device {dev}, got {x.device}")
    return n, total_q, total_k, h, d


def _check_general_args(tensors, cu_q, cu_k, max_q, max_k, softmax_scale, mid_window_blocks):
    """(packed, sizes): sizes (B, Sq, Sk, H, D) batched, (N, total_q, total_k, H, D) packed."""
    _check_op_scalars(softmax_scale, mid_window_blocks)
    if cu_q is None and cu_k is None:
        b, sq, sk, h, d = _api._check_fp8_tensors(tensors, "")
        if d not in _api.PREPARE_HEAD_DIMS:
            raise ValueError(f"q_codes: head_dim {d} is not supported: expected 128 or 64")
        return False, (b, sq, sk, h, d)
    return True, _check_varlen_fp8(tensors, cu_q, cu_k, max_q, max_k)


def _general_outputs(packed, sizes, return_lse, alloc):
    n, sq, _, h, d = sizes
    if packed:   # out [total_q, H, D], lse [H, total_q]
        return alloc((sq, h, d), torch.bfloat16), alloc((h, sq) if return_lse else (0,), torch.float32)
    return alloc((n, sq, h, d), torch.bfloat16), alloc((n, h, sq) if return_lse else (0,), torch.float32)


@torch.library.custom_op("open_vc_attn::attention_general", mutates_args=(), device_types="cuda",
                         schema=_GENERAL_SCHEMA)
def _attention_general(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks, return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
    packed, sizes = _check_general_args(tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, mid_window_blocks)
    n, sq, sk, h, d = (int(x) for x in sizes)
    _check_device(q_codes.device)
    _check_aligned(zip(_FP8_NAMES, tensors))
    out, lse = _general_outputs(packed, sizes, return_lse,
                                lambda shape, dtype: torch.empty(shape, dtype=dtype, device=q_codes.device))
    if packed:   # C++: batch sizes ignored; out [total_q, H, D] and lse [H, total_q] strides
        dims = (0, 0, 0, h, d, cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), n, int(max_seqlen_q),
                int(max_seqlen_k))
        out_strides, lse_strides = (0, *out.stride()[:2]), (0, sq)
    else:
        dims = (n, sq, sk, h, d, 0, 0, 0, 0, 0)
        out_strides, lse_strides = out.stride()[:3], (h * sq, sq)
    with torch.cuda.device(q_codes.device):
        _ext.load().attention_general(*dims, *(t.data_ptr() for t in tensors), bool(causal), out.data_ptr(),
                                      *out_strides, lse.data_ptr() if return_lse else 0, *lse_strides,
                                      float(softmax_scale), int(mid_window_blocks), _stream(q_codes.device))
    return out, lse


@_attention_general.register_fake
def _attention_general_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_descale, cu_seqlens_q,
                            cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, mid_window_blocks,
                            return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_descale)
    packed, sizes = _check_general_args(tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, mid_window_blocks)
    return _general_outputs(packed, sizes, return_lse, lambda shape, dtype: q_codes.new_empty(shape, dtype=dtype))


# What api.py calls: the registered operator overloads, which torch.compile puts in its graph as they are.
prepare_fp8_op = torch.ops.open_vc_attn.prepare_fp8.default
prepare_fp8_varlen_op = torch.ops.open_vc_attn.prepare_fp8_varlen.default
attention_fp8_op = torch.ops.open_vc_attn.attention_fp8.default
attention_general_op = torch.ops.open_vc_attn.attention_general.default
