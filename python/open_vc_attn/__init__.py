"""open_vc_attn: FP8 ExpCast attention for long-video diffusion (numerics: docs/numerics.md).

Submodules are imported on first use, so ``import open_vc_attn`` is cheap and never imports torch:
- ``open_vc_attn.reference``: the CPU reference (numpy in, numpy out), backed by the C++ oracle.
- ``open_vc_attn.video_inputs``: a deterministic synthetic video-like Q/K/V generator (pure numpy).
- ``open_vc_attn.cli``: command-line tools (``open-vc-attn-check``).
- ``open_vc_attn.masks``: block-sparse video masks (FlexAttention BlockMasks) and their block lists
  (docs/block_sparse.md); imports torch when called.
- ``open_vc_attn.kv_cache``: :class:`~open_vc_attn.kv_cache.FP8KVCache`, keys and values of earlier video chunks
  quantized once (docs/block_sparse.md, "KV cache"); imports torch when constructed.
- ``open_vc_attn.rotary``: :func:`~open_vc_attn.rotary.rotary_pairs`, the rotary embedding of q or k in one
  GPU pass with the framework's bits (docs/api.md); imports torch when called.
- GPU functions on torch CUDA tensors (Hopper, sm_90a), defined in ``open_vc_attn.api``:
  :func:`attention`, :func:`prepare_fp8` (batched, or packed sequences with cu_seqlens),
  :func:`attention_fp8` and :class:`PreparedFP8` (``PreparedFP8.from_quantized`` wraps inputs quantized
  elsewhere). A call that runs where openvc is known to be slow (the general path; at most 256 keys per
  sequence) warns once per process and reason with :class:`PerformanceWarning`. They import torch when called, not
  before; their custom ops live in the package ``open_vc_attn.ops`` (imports torch; importing it registers
  every op). Argument rules: ``open_vc_attn._checks``; sizes, layouts and the C++ library's constants:
  ``open_vc_attn._layout`` (mirrored there, not read from the extension; tests/python/test_package_structure.py
  checks them against it).
"""
from __future__ import annotations

import importlib

from ._perf_warnings import PerformanceWarning
from .api import PreparedFP8, attention, attention_fp8, prepare_fp8  # torch-free until called

# The one version source: pyproject.toml (scikit-build-core regex provider) and CMakeLists.txt read it.
__version__ = "0.1.0"

_SUBMODULES = ("reference", "video_inputs", "cli", "parallel", "masks", "kv_cache", "rotary", "ops")
# Not "ops": a star import must not pull in torch.
__all__ = ["__version__", "attention", "prepare_fp8", "attention_fp8", "PreparedFP8", "PerformanceWarning",
           *_SUBMODULES[:-1]]


def __getattr__(name):
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module  # later lookups skip __getattr__
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
