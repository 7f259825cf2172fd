"""open_vc_attn: FP8 ExpCast attention for long-video diffusion (numerics: docs/numerics.md).

Submodules are imported on first use, so ``import open_vc_attn`` is cheap and never imports torch:
- ``open_vc_attn.reference``: the CPU reference (numpy in, numpy out), backed by the C++ oracle.
- ``open_vc_attn.video_inputs``: a deterministic synthetic video-like Q/K/V generator (pure numpy).
- ``open_vc_attn.cli``: command-line tools (``open-vc-attn-check``).
GPU functions (torch tensors in, torch imported lazily) are not part of this version yet.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("reference", "video_inputs", "cli")
__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name):
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module  # later lookups skip __getattr__
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
