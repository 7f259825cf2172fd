"""The direct API's one-time performance warnings: a call that runs correctly but where openvc is known to be slow
warns once per process and reason (:class:`PerformanceWarning`), so that no call class loses silently.

- The general path (CUDA cores: sizes past the fast path's 32-bit range): correct but far slower than the fast path.
- Few keys: every sequence has at most :data:`FEW_KEYS_SLOWER` keys. The fast path's tiles then hold one or two
  key blocks, whose pipeline fill and drain per query tile set the time; on the H200 such calls ran at 0.41-0.68x
  (128 keys) and 0.77-0.83x (256 keys) torch SDPA (BF16) wherever the GPU, not the host, set the time
  (:data:`FEW_KEYS_RECORDS`: 8,192-65,536 queries at H = 24 and 40). At 384 and 512 keys openvc is within about
  10% of SDPA either way (0.89-1.06x; no warning), above that faster. The integrations' DispatchPolicy leaves
  calls with fewer than ``min_key_tokens`` keys to the framework.

Pure Python (no torch): the reasons are plain functions of the call's sizes, tested on any machine.
"""
from __future__ import annotations

import sys
import warnings

__all__ = ["PerformanceWarning", "FEW_KEYS_SLOWER", "FEW_KEYS_RECORDS", "few_keys_reason", "warn_once",
           "warn_general_path", "warn_few_keys"]

# Key counts per sequence at or below which the fast path measured slower than torch SDPA (two key blocks).
FEW_KEYS_SLOWER = 256
FEW_KEYS_RECORDS = ("bench/results/2026-12-04-h200-seventeenth/dispatch_floor.json",   # 256 and 512 keys
                    "bench/results/2026-12-04-h200-eighteenth/dispatch_floor.json")     # 128, 384 and 512 keys


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


def warn_once(key, message, stacklevel=4):
    """One PerformanceWarning per process for `key` (later calls with the same key are silent); none while
    torch.compile traces."""
    if key in _WARNED or _compiling():
        return
    _WARNED.add(key)
    warnings.warn(message, PerformanceWarning, stacklevel=stacklevel)


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
    return (f"at most {sk} keys per sequence (<= {FEW_KEYS_SLOWER}): the sm_90a kernel ran such calls at 0.41-0.83x "
            "torch SDPA (BF16) on the H200 where the GPU sets the time (docs/api.md, 'No call class loses silently'); "
            "torch's attention is faster here, and open_vc_attn.integrations' DispatchPolicy leaves calls with fewer "
            "than min_key_tokens keys to it")


def warn_few_keys(sk, general_reason=None):
    """After a fast-path call with at most `sk` keys per sequence (a general-path call has its own warning)."""
    if general_reason is not None:
        return
    reason = few_keys_reason(sk)
    if reason is not None:
        warn_once("few keys", f"open_vc_attn: {reason}")
