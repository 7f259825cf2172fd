"""Custom ops of the rotary embedding over interleaved pairs (openvc::rotary_pairs, docs/api.md):

- ``open_vc_attn::rotary_pairs_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()``: x rotated in place.
- ``open_vc_attn::rotary_pairs_out(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()``: into out, which
  does not overlap x (a slice of a larger buffer, say).

Unlike the attention ops these write into a caller's tensor (``mutates_args``): their use is to put q and k
where the attention call reads them without another copy.
"""
import torch

from .. import _ext
from .._checks_rotary import check_rotary_args, check_rotary_pointers
from . import device as dev

_INPLACE_SCHEMA = "(Tensor(a!) x, Tensor cos, Tensor sin) -> ()"
_OUT_SCHEMA = "(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()"


def _launch(x, cos, sin, out):
    dev.launch_checks(x.device, ())
    check_rotary_pointers(x, None if out is x else out)
    b, s, h, d = (int(n) for n in x.shape)
    ext = _ext.load()
    o = dev.token_view(out)   # (its strides, size-1 dims' as 0, as x's)
    ts = [st if n > 1 else 0 for n, st in zip(cos.shape, cos.stride())]
    p = dev.params(ext.RotaryPairsParams, dtype=dev.dtype_of(x), batch=b, seqlen=s, heads=h, head_dim=d,
                   x=dev.token_view(x), out=o.data, out_stride_batch=o.stride_batch, out_stride_seq=o.stride_seq,
                   out_stride_head=o.stride_head, cos=cos.data_ptr(), sin=sin.data_ptr(), table_stride_seq=ts[0],
                   table_stride_head=ts[1], table_stride_pair=ts[2], table_stride_half=ts[3])
    dev.enqueue(ext.rotary_pairs, p, x.device)


@torch.library.custom_op("open_vc_attn::rotary_pairs_", mutates_args=("x",), device_types="cuda",
                         schema=_INPLACE_SCHEMA)
def _rotary_pairs_(x, cos, sin):
    check_rotary_args(x, cos, sin, in_place=True)
    _launch(x, cos, sin, x)


@_rotary_pairs_.register_fake
def _rotary_pairs_fake_(x, cos, sin):
    check_rotary_args(x, cos, sin, in_place=True)


@torch.library.custom_op("open_vc_attn::rotary_pairs_out", mutates_args=("out",), device_types="cuda",
                         schema=_OUT_SCHEMA)
def _rotary_pairs_out(x, cos, sin, out):
    check_rotary_args(x, cos, sin, out)
    _launch(x, cos, sin, out)


@_rotary_pairs_out.register_fake
def _rotary_pairs_out_fake(x, cos, sin, out):
    check_rotary_args(x, cos, sin, out)
