"""An eager :func:`open_vc_attn.attention` call on the fast path in two launches of the extension, with its
FP8 intermediates in one scratch allocation.

Host time, not GPU time, is what a short call costs (scripts/device/host_breakdown.py on the H200: SDPA
41 us, openvc 215 us eager at Sq = Sk = 256, H = 12): each torch tensor the call creates costs about 6 us
(torch.empty with its argument parsing), and the two-step path created nine (six prepared tensors, the
v_amax scratch, out, an empty LSE) and built every parameter struct from them. The prepared tensors are
never seen by the caller here, so they are slices of one uint8 buffer, addressed by pointer: one
allocation instead of seven. The buffer is freed on return; torch's caching allocator hands it out again
only to work queued after these kernels on the same stream, as it does for any temporary.

Used by :func:`open_vc_attn.api.attention` for batched calls the fast path takes (dense, causal, key
counts), when :func:`.direct.eager` holds; everything else (torch.compile, packed sequences, the general
path) goes through the ops as before. Same kernels, same parameters, the same bits.
"""
import functools

import torch

from .. import _ext
from .._layout import fp8_expectations
from . import device as dev
from . import fp8

_ALIGN = 256   # every slice starts 256-byte aligned (TMA needs 16; vector loads like 128)
_ITEM = {"uint8": 1, "int8": 1, "float32": 4}


class _Slice:
    """One prepared tensor inside the scratch buffer: what the parameter builders read of a tensor."""
    __slots__ = ("_ptr", "shape")

    def __init__(self, ptr, shape):
        self._ptr, self.shape = ptr, shape

    def data_ptr(self):
        return self._ptr


@functools.lru_cache(maxsize=256)
def _layout(b, sq, sk, h, d, qk_format="e4m3", k_smoothing=False):
    """(shapes, byte offsets of the six prepared tensors and of the preparation's workspace, workspace
    bytes, total bytes) for one batched call in the layouts of qk_format (the workspace grows with
    k_smoothing); cached: a model repeats a few shapes."""
    shapes, offsets, total = [], [], 0
    for _, shape, dtype in fp8_expectations(b, sq, sk, h, d, qk_format):
        n = _ITEM[dtype]
        for x in shape:
            n *= x
        shapes.append(shape)
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    ws_bytes = max(int(_ext.load().prepare_workspace_bytes(b, h, sk, k_smoothing)), 16)
    offsets.append(total)
    total += -(-ws_bytes // _ALIGN) * _ALIGN
    return tuple(shapes), tuple(offsets), ws_bytes, total


def attention(q, k, v, seqused_k, softmax_scale, causal, mid_window_blocks, return_lse, out_dtype=None,
              qk_format="e4m3", k_smoothing=False, p_format="expcast"):
    """(out, lse) of checked rank-4 batched q, k, v (and key counts) on the fast path; qk_format, k_smoothing
    and p_format checked by the caller (p_format sets AttentionParams.p_format)."""
    b, sq, h, d = (int(x) for x in q.shape)
    sk = int(k.shape[1])
    dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v)))
    shapes, offsets, ws_bytes, total = _layout(b, sq, sk, h, d, qk_format, bool(k_smoothing))
    scratch = torch.empty(total, dtype=torch.uint8, device=q.device)
    base = scratch.data_ptr()
    prepared = tuple(_Slice(base + off, shape) for off, shape in zip(offsets, shapes))
    fp8.launch_prepare(q, k, v, prepared, None, seqused_k, workspace=(base + offsets[6], ws_bytes),
                       qk_format=qk_format, k_smoothing=k_smoothing)
    sizes = (b, sq, sk, h, d)
    if not causal and seqused_k is None:
        return fp8.enqueue_fast(prepared, sizes, q.device, softmax_scale, mid_window_blocks, return_lse, out_dtype,
                                qk_format, p_format)
    return fp8.enqueue_sequence(True, prepared, False, sizes, q.device, None, None, 0, 0, softmax_scale, causal,
                                mid_window_blocks, return_lse, seqused_k, out_dtype, qk_format, p_format)
