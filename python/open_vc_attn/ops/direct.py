"""Eager calls of the FP8 ops without torch's dispatcher: what :mod:`open_vc_attn.api` calls.

A ``torch.library.custom_op`` call goes through torch's dispatcher into Python twice (the Autograd kernel
that custom_op registers, then the CUDA kernel, which also compares the storages of every input and output
to rule out aliasing): measured at 25-50 us of host time per op call (tests on the CPU build of torch
2.11; scripts/device/dispatch_floor.py measures it on the GPU machine), which a short call pays in full.
Nothing in a plain eager call needs that hop, so :func:`run` calls the op's CUDA
implementation (:mod:`.fp8`, :mod:`.call`) directly, the same code with the same checks, when :func:`eager`
holds; and the op otherwise (torch.compile and jit tracing, dispatch and function modes such as FakeTensorMode or
FlopCounterMode, functorch transforms, tensor subclasses), where the op is what those machineries handle.
Under the profiler a direct call is a ``record_function`` range with the op's name, so traces read the same.
"""
import contextlib

import torch

_Tensor = torch.Tensor
_C = torch._C
_functorch_stack = getattr(getattr(_C, "_functorch", None), "peek_interpreter_stack", None)
_function_modes = getattr(_C, "_is_torch_function_mode_enabled", lambda: False)


def eager(*tensors) -> bool:
    """True when nothing but the kernels needs to see this call: eager (not compiling or tracing), no
    dispatch or function mode, no functorch transform, no tensor subclass among `tensors` (None and
    non-tensors allowed: the implementation's checks name those, as the op's schema would refuse them)."""
    if (torch.compiler.is_compiling() or _C._is_tracing() or _C._len_torch_dispatch_stack() or _function_modes()
            or (_functorch_stack is not None and _functorch_stack() is not None)):
        return False
    for t in tensors:
        if type(t) is not _Tensor and isinstance(t, _Tensor):
            return False
    return True


def named(op):
    """The op's name as a profiler range while the profiler runs (else no context at all)."""
    return torch.profiler.record_function(op) if _C._autograd._profiler_enabled() else contextlib.nullcontext()


def run(op, impl, tensors, *args):
    """``op(*args)``, an open_vc_attn op (its OpOverload): its implementation ``impl(*args)`` directly when
    :func:`eager` holds for ``tensors`` (the op's tensor arguments), under a profiler range with the op's
    name; else the op."""
    if not eager(*tensors):
        return op(*args)
    with named(op.name()):
        return impl(*args)
