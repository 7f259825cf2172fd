"""Run-time helpers of the CUDA implementations of the custom ops: what needs real tensors (pointers,
the device, the stream), never traced. Imports torch."""
import functools

import torch

from .. import _ext


@functools.lru_cache(maxsize=None)
def unsupported_device(index: int):
    """None when device `index` is compute capability 9.0, else why it cannot run the kernels."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) == (9, 0):
        return None
    return (f"open_vc_attn: device cuda:{index} ({torch.cuda.get_device_name(index)}) is compute capability "
            f"{major}.{minor}; the FP8 kernels are built for sm_90a and need 9.0 (Hopper)")


def check_device(device):
    reason = unsupported_device(device.index if device.index is not None else torch.cuda.current_device())
    if reason:
        raise RuntimeError(reason)


def check_aligned(named):
    """Every (name, tensor) 16-byte aligned: the kernels load 16-byte vectors."""
    for name, x in named:
        if x.data_ptr() % 16:
            raise ValueError(f"{name}: the data pointer must be 16-byte aligned for the kernels' vector loads, "
                             f"got address % 16 = {x.data_ptr() % 16} (storage_offset {x.storage_offset()}); "
                             "call .contiguous() or slice at a multiple of 8 elements")


def launch_checks(device, named):
    """The device, then the alignment of the named tensors: the checks that need a real CUDA tensor."""
    check_device(device)
    check_aligned(named)


def token_view(x, packed=False):
    """openvc::TokenTensorView of a [B, S, H, D] tensor, or of a packed [total, H, D] one (no batch
    stride). The stride of a size-1 dim is never used and torch leaves it arbitrary, so it is passed as 0
    (always a valid multiple of 8)."""
    dims = x.shape[:2] if packed else x.shape[:3]
    strides = [st if n > 1 else 0 for n, st in zip(dims, x.stride())]
    view = _ext.load().TokenTensorView()
    view.data = x.data_ptr()
    view.stride_batch, view.stride_seq, view.stride_head = (0, *strides) if packed else strides
    return view


def dtype_of(x):
    """The openvc::DType of a bfloat16 / float16 tensor."""
    dtype = _ext.load().DType
    return dtype.bfloat16 if x.dtype == torch.bfloat16 else dtype.float16


def params(cls, **fields):
    """An extension parameter struct with the given fields set by name (an unknown name raises)."""
    p = cls()
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def qk_format(name):
    """The openvc::QkFormat of a qk_format string ("e4m3" or "int8", checked by the caller)."""
    return getattr(_ext.load().QkFormat, name)


def set_p_format(p, name):
    """AttentionParams.p_format from a p_format string ("expcast" or "exp2", checked by the caller), through the
    extension's PFormat enum. An extension built before openvc::PFormat has no such field and computes P with
    ExpCast only: "expcast" leaves its struct as it is, "exp2" raises RuntimeError naming p_format (never
    run as ExpCast in its place)."""
    enum = getattr(_ext.load(), "PFormat", None)
    if enum is None:
        if name != "expcast":
            raise RuntimeError(f"p_format: {name!r} needs an _openvc_ext built with openvc::PFormat; this build has "
                               "none (ExpCast only): rebuild and reinstall the package")
        return p
    p.p_format = getattr(enum, name)
    return p


def fp8_inputs(tensors, batch, seqlen_q, seqlen_k, heads, head_dim, fmt=None, kv_heads=None):
    """openvc::Fp8Inputs over six prepared tensors (PreparedFP8.tensors() order; a VC preparation's
    first five, v_descale then being unused, may pass None for it). fmt: the qk_format string, or None to
    leave the struct's default (E4M3; the repair and VC paths, which take E4M3 only). kv_heads: the K/V head
    count of a GQA/MQA preparation (Fp8Inputs::kv_heads), set only where it differs from heads (None or
    heads: the struct's 0, equal head counts)."""
    names = ("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale")
    pointers = {n: (0 if t is None else t.data_ptr()) for n, t in zip(names, tensors)}
    p = params(_ext.load().Fp8Inputs, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=heads,
               head_dim=head_dim, **pointers)
    if fmt is not None:
        p.qk_format = qk_format(fmt)
    if kv_heads is not None and int(kv_heads) != int(heads):
        p.kv_heads = int(kv_heads)
    return p


def set_output(p, out, lse, softmax_scale, out_strides=None):
    """The output fields every attention parameter struct shares (lse None: no LSE output)."""
    p.out = out.data_ptr()
    p.out_dtype = dtype_of(out)   # BF16 or FP16 (the ops allocate one of the two)
    p.out_stride_batch, p.out_stride_seq, p.out_stride_head = out_strides or out.stride()[:3]
    p.lse = 0 if lse is None else lse.data_ptr()
    p.softmax_scale = float(softmax_scale)
    return p


def workspace(nbytes, device):
    """Scratch the kernels zero themselves, so torch.empty is enough (at least 16 bytes: never null)."""
    return torch.empty(max(int(nbytes), 16), dtype=torch.uint8, device=device)


# torch's own raw-stream getter (what inductor's generated code calls): an int, no torch.cuda.Stream object.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def enqueue(fn, params, device):
    """fn(params, stream) with `device` current (the C++ side launches on the current device) on its current
    stream: what ``with torch.cuda.device(device)`` around ``fn(params, torch.cuda.current_stream(device)
    .cuda_stream)`` does, without building a torch.cuda.device and a torch.cuda.Stream object on every call
    (a few microseconds of host time each, per launch)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    prev = torch.cuda._exchange_device(index)
    try:
        fn(params, _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream)
    finally:
        torch.cuda._maybe_exchange_device(prev)


def empty(device):
    """An allocator (shape, dtype) -> new tensor on `device`, as the CUDA implementations use it."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


def full(device):
    """An allocator (shape, dtype, value) -> new tensor filled with value on `device`."""
    return lambda shape, dtype, value: torch.full(shape, value, dtype=dtype, device=device)


def like(x):
    """An allocator (shape, dtype) -> new tensor like `x` (fake or meta), as the fake implementations use it."""
    return lambda shape, dtype: x.new_empty(shape, dtype=dtype)


def like_full(x):
    """:func:`full`'s signature for the fake implementations: (shape, dtype, value) -> new tensor like `x` (the
    value does not matter to a fake)."""
    return lambda shape, dtype, _value: x.new_empty(shape, dtype=dtype)
