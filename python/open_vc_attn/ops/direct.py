"""Eager calls of the FP8 ops without torch's dispatcher: what :mod:`open_vc_attn.api` calls.

A ``torch.library.custom_op`` call goes through torch's dispatcher into Python twice (the Autograd kernel
that custom_op registers, then the CUDA kernel, which also compares the storages of every input and output
to rule out aliasing): measured at 25-50 us of host time per op call (tests on the CPU build of torch
2.11; scripts/device/dispatch_floor.py measures it on the GPU machine), and one :func:`open_vc_attn.attention`
makes two. Nothing in a plain eager call needs that hop, so each function here runs the op's CUDA
implementation (:mod:`.fp8`) directly, the same code with the same checks, when :func:`eager` holds; and
the op otherwise (torch.compile and jit tracing, dispatch and function modes such as FakeTensorMode or
FlopCounterMode, functorch transforms, tensor subclasses), where the op is what those machineries handle.
Under the profiler a direct call is a ``record_function`` range with the op's name, so traces read the same.
"""
import contextlib

import torch

from . import fp8

_Tensor = torch.Tensor
_C = torch._C
_functorch_stack = getattr(getattr(_C, "_functorch", None), "peek_interpreter_stack", None)
_function_modes = getattr(_C, "_is_torch_function_mode_enabled", lambda: False)


def eager(*tensors) -> bool:
    """True when nothing but the kernels needs to see this call: eager (not compiling or tracing), no
    dispatch or function mode, no functorch transform, every tensor a plain torch.Tensor (None allowed)."""
    if (torch.compiler.is_compiling() or _C._is_tracing() or _C._len_torch_dispatch_stack() or _function_modes()
            or (_functorch_stack is not None and _functorch_stack() is not None)):
        return False
    for t in tensors:
        if t is not None and type(t) is not _Tensor:
            return False
    return True


def named(op):
    """The op's name as a profiler range while the profiler runs (else no context at all)."""
    return torch.profiler.record_function(op) if _C._autograd._profiler_enabled() else contextlib.nullcontext()


def prepare_fp8(q, k, v, seqused_k=None, qk_format="e4m3", k_smoothing=False):
    """``open_vc_attn::prepare_fp8``: the six prepared tensors."""
    if not eager(q, k, v, seqused_k):
        return torch.ops.open_vc_attn.prepare_fp8.default(q, k, v, seqused_k, qk_format, k_smoothing)
    with named("open_vc_attn::prepare_fp8"):
        return fp8.prepare_cuda(q, k, v, seqused_k, qk_format=qk_format, k_smoothing=k_smoothing)


def prepare_fp8_varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=None, qk_format="e4m3", k_smoothing=False):
    """``open_vc_attn::prepare_fp8_varlen``: the six prepared tensors of packed sequences."""
    if not eager(q, k, v, cu_q, cu_k, seqused_k):
        return torch.ops.open_vc_attn.prepare_fp8_varlen.default(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k,
                                                                 qk_format, k_smoothing)
    with named("open_vc_attn::prepare_fp8_varlen"):
        return fp8.prepare_varlen_cuda(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, qk_format=qk_format,
                                       k_smoothing=k_smoothing)


def attention_fp8(tensors, softmax_scale, mid_window_blocks, return_lse, out_dtype=None, qk_format="e4m3",
                  p_format="expcast"):
    """``open_vc_attn::attention_fp8`` on the six prepared tensors: (out, lse)."""
    if not eager(*tensors):
        return torch.ops.open_vc_attn.attention_fp8.default(*tensors, softmax_scale, mid_window_blocks, return_lse,
                                                            out_dtype, qk_format, p_format)
    with named("open_vc_attn::attention_fp8"):
        return fp8.attention_cuda(tensors, softmax_scale, mid_window_blocks, return_lse, out_dtype, qk_format=qk_format,
                                  p_format=p_format)


def attention_sequence(fast, tensors, cu_q, cu_k, max_q, max_k, softmax_scale, causal, mid_window_blocks,
                       return_lse, seqused_k=None, out_dtype=None, qk_format="e4m3", p_format="expcast"):
    """``open_vc_attn::attention_fp8_full`` (fast) or ``attention_general``: (out, lse)."""
    name = "attention_fp8_full" if fast else "attention_general"
    if not eager(*tensors, cu_q, cu_k, seqused_k):
        op = getattr(torch.ops.open_vc_attn, name).default
        return op(*tensors, cu_q, cu_k, max_q, max_k, softmax_scale, causal, mid_window_blocks, return_lse, seqused_k,
                  out_dtype, qk_format, p_format)
    with named("open_vc_attn::" + name):
        return fp8.sequence_cuda(fast, tensors, cu_q, cu_k, max_q, max_k, softmax_scale, causal, mid_window_blocks,
                                 return_lse, seqused_k, out_dtype, qk_format=qk_format, p_format=p_format)
