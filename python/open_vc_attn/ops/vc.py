"""Custom ops of the VC-Attention baseline (docs/baselines.md, numerics section 7).

- ``open_vc_attn::vc_grouping(Tensor v) -> Tensor``: rank-4 BF16/FP16 v [B, S, H, 128]; int32
  permutation [B, H, S] (k-means grouping).
- ``open_vc_attn::prepare_vc(Tensor q, Tensor k, Tensor v, Tensor permutation) -> (q_codes, q_descale,
  k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled)``: see baselines.PreparedVC.
- ``open_vc_attn::attention_vc_fp8(the seven tensors, float softmax_scale, bool return_lse) -> (out, lse)``:
  out BF16 [B, Sq, H, D]; lse float32 [B, H, Sq], or an empty [0] tensor when return_lse is False.
"""
import torch

from .. import _ext
from .. import _checks_baselines
from .._layout import VC_NAMES, vc_expectations
from . import device as dev
from .fp8 import attention_outputs

_GROUPING_SCHEMA = "(Tensor v) -> Tensor"
_PREPARE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor permutation) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_ATTENTION_SCHEMA = ("(Tensor q_codes, Tensor q_descale, Tensor k_codes, Tensor k_descale, Tensor v_packed, "
                     "Tensor v_channel_descale, Tensor block_mean_scaled, float softmax_scale, bool return_lse) "
                     "-> (Tensor, Tensor)")


# ---- vc_grouping --------------------------------------------------------------------------------------

@torch.library.custom_op("open_vc_attn::vc_grouping", mutates_args=(), device_types="cuda", schema=_GROUPING_SCHEMA)
def _vc_grouping(v):
    _checks_baselines.check_vc_grouping_op_args(v)
    dev.launch_checks(v.device, (("v", v),))
    b, s, h, d = (int(n) for n in v.shape)
    perm = torch.empty((b, h, s), dtype=torch.int32, device=v.device)
    ext = _ext.load()
    ws = dev.workspace(ext.vc_grouping_workspace_bytes(b, h, s), v.device)
    p = dev.params(ext.VcGroupingParams, dtype=dev.dtype_of(v), batch=b, seqlen=s, heads=h, head_dim=d,
                   v=dev.token_view(v), permutation=perm.data_ptr(), workspace=ws.data_ptr(),
                   workspace_bytes=ws.numel())
    dev.enqueue(ext.vc_grouping, p, v.device)
    return perm


@_vc_grouping.register_fake
def _vc_grouping_fake(v):
    _checks_baselines.check_vc_grouping_op_args(v)
    b, s, h, _ = v.shape
    return v.new_empty((b, h, s), dtype=torch.int32)


# ---- prepare_vc -----------------------------------------------------------------------------------------

def _prepare_outputs(q, k, alloc):
    b, sq, h, d = q.shape
    return tuple(alloc(shape, getattr(torch, dtype)) for _, shape, dtype in vc_expectations(b, sq, k.shape[1], h, d))


@torch.library.custom_op("open_vc_attn::prepare_vc", mutates_args=(), device_types="cuda", schema=_PREPARE_SCHEMA)
def _prepare_vc(q, k, v, permutation):
    _checks_baselines.check_vc_prepare_op_args(q, k, v, permutation)
    dev.launch_checks(q.device, (("q", q), ("k", k), ("v", v)))
    outs = _prepare_outputs(q, k, dev.empty(q.device))
    b, sq, h, d = (int(n) for n in q.shape)
    ext = _ext.load()
    ws = dev.workspace(ext.vc_prepare_workspace_bytes(b, h), q.device)   # per-channel amax scratch
    p = dev.params(ext.VcPrepareParams, dtype=dev.dtype_of(q), batch=b, seqlen_q=sq, seqlen_k=int(k.shape[1]),
                   heads=h, head_dim=d, q=dev.token_view(q), k=dev.token_view(k), v=dev.token_view(v),
                   permutation=permutation.data_ptr(), **dict(zip(VC_NAMES, (t.data_ptr() for t in outs))),
                   workspace=ws.data_ptr(), workspace_bytes=ws.numel())   # block_mean stays 0: not written
    dev.enqueue(ext.vc_prepare, p, q.device)
    return outs


@_prepare_vc.register_fake
def _prepare_vc_fake(q, k, v, permutation):
    _checks_baselines.check_vc_prepare_op_args(q, k, v, permutation)
    return _prepare_outputs(q, k, dev.like(q))


# ---- attention_vc_fp8 -------------------------------------------------------------------------------------

@torch.library.custom_op("open_vc_attn::attention_vc_fp8", mutates_args=(), device_types="cuda",
                         schema=_ATTENTION_SCHEMA)
def _attention_vc_fp8(q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled,
                      softmax_scale, return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled)
    sizes = tuple(int(n) for n in _checks_baselines.check_vc_attention_op_args(tensors, softmax_scale))
    dev.launch_checks(q_codes.device, zip(VC_NAMES, tensors))
    out, lse = attention_outputs(q_codes, return_lse, dev.empty(q_codes.device))
    # in.v_descale is not read in VC mode (the per-channel descales replace it).
    p = dev.params(_ext.load().VcAttentionParams, in_=dev.fp8_inputs((*tensors[:5], None), *sizes),
                   v_channel_descale=v_channel_descale.data_ptr(), block_mean_scaled=block_mean_scaled.data_ptr())
    dev.set_output(p, out, lse if return_lse else None, softmax_scale)
    dev.enqueue(_ext.load().attention_vc_fp8, p, q_codes.device)
    return out, lse


@_attention_vc_fp8.register_fake
def _attention_vc_fp8_fake(q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled,
                           softmax_scale, return_lse):
    tensors = (q_codes, q_descale, k_codes, k_descale, v_packed, v_channel_descale, block_mean_scaled)
    _checks_baselines.check_vc_attention_op_args(tensors, softmax_scale)
    return attention_outputs(q_codes, return_lse, dev.like(q_codes))
