"""open_vc_attn.bench: the benchmark harness (``open-vc-attn-bench``) and its report (``open-vc-attn-report``).

Modules (none imports torch at import time, so the record/report/preset parts run without torch):
- ``harness``: timing (CUDA graphs, paired rounds in a seeded random order, medians, cold L2), FLOP
  counting, paired-ratio math, and accuracy against exact FP32 attention.
- ``backends``: our kernels, the baselines, the anchors (torch SDPA cuDNN/flash, FlashAttention-3/4,
  cuDNN FP8) and the ceilings (FP8/BF16 GEMM, device copy); missing ones are reported, never faked.
- ``record``: the JSON record (schema, validation, environment capture, GPU-sharing check).
- ``report``: markdown tables and matplotlib plots from one or more records.
- ``cli``: presets, input preparation, the run loop, and the two entry points.
"""
from __future__ import annotations

__all__ = ["harness", "backends", "record", "report", "cli"]
