"""Loader of the compiled extension ``_openvc_ext``: the CPU reference of docs/numerics.md (used by
:mod:`open_vc_attn.reference`) and the GPU entry points with their parameter structs (used by
:mod:`open_vc_attn.ops`), plus the constants the C++ library owns (read by :mod:`open_vc_attn._layout`).

Loaded on first use, so that the pure-numpy parts of the package (the input generator, bf16 rounding)
work even where the extension was not built.
"""
from __future__ import annotations

import importlib
import importlib.util

_module = None


def load():
    """Return the ``_openvc_ext`` module, or raise ImportError saying how to build it."""
    global _module
    if _module is None:
        # torch first, when it is installed: on the H200 (torch 2.11+cu130), importing torch after the
        # extension had loaded libopenvc segfaulted inside torch's import (its operator registry), while
        # the other order works. The extension itself never needs torch.
        if importlib.util.find_spec("torch") is not None:
            importlib.import_module("torch")
        try:
            _module = importlib.import_module("open_vc_attn._openvc_ext")
        except ImportError as exc:
            raise ImportError(
                "open_vc_attn: the compiled extension '_openvc_ext' could not be loaded "
                f"({exc}). It is built by CMake when the package is installed: run "
                "`pip install --no-build-isolation -v .` from the repository root (needs the CUDA "
                "toolkit, since libopenvc.so links the CUDA runtime). Importing from the source tree "
                "(python/ on sys.path) does not work: it has no compiled files."
            ) from exc
    return _module
