"""The direct API's one-time performance warnings: a call that runs correctly but where openvc is known to be slow
warns once per process and reason (:class:`PerformanceWarning`), so that no call class loses silently.

- The general path (CUDA cores: sizes past the fast path's 32-bit range): correct but far slower than the fast path.
- Few keys: every sequence has at most :data:`FEW_KEYS_SLOWER` keys. The fast path's tiles then hold one or two
  key blocks, whose pipeline fill and drain per query tile set the time. On the H200, where the GPU and not the host
  set the call's time (host time below 80% of it), dense calls ran at 0.67-0.68x (128 keys) and 0.78-0.83x (256
  keys) torch SDPA's default (BF16), at 384 and 512 keys at 0.89-0.99x and 0.95-1.06x (no warning there), above that
  faster (bench/results/2026-12-04-h200-seventeenth/ and -eighteenth/dispatch_floor.json, 8,192-65,536 queries).
  The integrations' DispatchPolicy leaves calls with fewer than ``min_key_tokens`` keys to the framework.

The warning points at the first caller outside this package (the user's line, also through the package's own
wrappers: Ulysses, repair, the integrations). Pure Python (no torch import): the rules are plain functions of the
call's sizes, tested on any machine.
"""
from __future__ import annotations

import os
import sys
import warnings

__all__ = ["PerformanceWarning", "FEW_KEYS_SLOWER", "few_keys_reason", "warn_once", "warn_general_path",
           "warn_few_keys", "warn_after_call"]

# Key counts per sequence at or below which the fast path measured slower than torch SDPA (two key blocks).
FEW_KEYS_SLOWER = 256

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class PerformanceWarning(RuntimeWarning):
    """A call ran correctly on a path or at a shape where openvc is slower than it could be, or than torch's
    own attention. Warned once per process and reason; filter with
    ``warnings.filterwarnings("ignore", category=open_vc_attn.PerformanceWarning)``. A RuntimeWarning, so
    filters written for the earlier RuntimeWarning keep working."""


_WARNED = set()


def _compiling():
    """True while torch.compile traces the call: dynamo cannot trace warnings.warn (a fullgraph compile would fail),
    so traced calls do not warn; the same call run eagerly does. torch is not imported here (only read if loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _outside_stacklevel():
    """warnings.warn's stacklevel, called from warn_once, of the first frame whose file is not in this package."""
    frame, level = sys._getframe(2), 2   # warn_once's caller; stacklevel 1 would be warn_once itself
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(key, message):
    """One PerformanceWarning per process for `key` (later calls with the same key are silent), pointing at the first
    caller outside the package; none while torch.compile traces (checked first: dynamo then never reads the set)."""
    if _compiling() or key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, PerformanceWarning, stacklevel=_outside_stacklevel())


def warn_general_path(reason):
    """After a call that ran on the general path (reason: _checks.general_path_reason's; None on the fast path)."""
    if reason is None:
        return
    warn_once(("general", reason), f"open_vc_attn: {reason}: this call runs on the general path (CUDA cores, correct "
              "but far slower than the sm_90a fast path); docs/api.md lists which calls take which path")


def few_keys_reason(sk):
    """Why a fast-path call whose sequences have at most `sk` keys (packed: max_seqlen_k) is slow, or None."""
    if sk > FEW_KEYS_SLOWER:
        return None
    keys = "key" if sk == 1 else "keys"
    return (f"at most {sk} {keys} per sequence (<= {FEW_KEYS_SLOWER}): the sm_90a kernel ran dense calls with so few "
            "keys at 0.67-0.83x torch SDPA (BF16) on the H200 where the GPU sets the time (docs/api.md, 'No call class "
            "loses silently'); open_vc_attn.integrations' DispatchPolicy leaves calls with fewer than min_key_tokens "
            "keys to the framework's attention")


def warn_few_keys(sk, general_reason=None):
    """After a fast-path call with at most `sk` keys per sequence (a general-path call has its own warning). Most
    calls leave at the key count; the message is built only for the one warning."""
    if general_reason is not None or sk > FEW_KEYS_SLOWER or _compiling() or "few keys" in _WARNED:
        return
    warn_once("few keys", f"open_vc_attn: {few_keys_reason(sk)}")


def warn_after_call(general_reason, sk):
    """The warnings of one finished call of the direct API: general_reason (_checks.general_path_reason's, None on the
    fast path) and the longest key sequence `sk` (packed: max_seqlen_k)."""
    warn_general_path(general_reason)
    warn_few_keys(sk, general_reason)
