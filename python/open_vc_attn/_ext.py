"""Loader of the compiled extension ``_openvc_ext``: the CPU reference of docs/numerics.md (used by
:mod:`open_vc_attn.reference`) and the GPU entry points with their parameter structs (used by
:mod:`open_vc_attn.ops`), plus the constants the C++ library owns (:mod:`open_vc_attn._layout` holds copies,
which tests/python/test_package_structure.py checks against these).

Loaded on first use, so that the pure-numpy parts of the package (the input generator, bf16 rounding)
work even where the extension was not built.
"""
from __future__ import annotations

import importlib

_module = None


def load():
    """Return the ``_openvc_ext`` module, or raise ImportError saying how to build it."""
    global _module
    if _module is None:
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
