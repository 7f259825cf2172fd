"""Framework integrations of openvc attention. Each submodule is imported on its own, on first use:

- :mod:`open_vc_attn.integrations.policy`: which attention calls go to openvc (one function, shared).
- :mod:`open_vc_attn.integrations.diffusers`: an attention backend for diffusers' dispatch
  (docs/integrations/diffusers.md). Imports diffusers only when a function is called.
- :mod:`open_vc_attn.integrations.yunchang`: an ``attn_processor`` for yunchang's (and xDiT's) Ulysses/ring
  layers (docs/integrations/yunchang.md). Imports yunchang only when a function is called.
- :mod:`open_vc_attn.integrations.sglang`: an attention backend for SGLang diffusion
  (``sglang.multimodal_gen``; docs/integrations/sglang.md). Imports sglang when imported.

``import open_vc_attn.integrations`` imports none of them (and not torch).
"""
from __future__ import annotations

import importlib

_SUBMODULES = ("policy", "diffusers", "yunchang", "sglang")
__all__ = ["policy", "diffusers", "yunchang"]   # not "sglang": importing it imports sglang


def __getattr__(name):
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
