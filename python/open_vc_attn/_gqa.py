"""Grouped-query attention (GQA, MQA): the one home of its argument rules (torch-free import).

q holds H heads, k and v Hk heads, H a multiple of Hk; query head h attends K/V head h // (H // Hk). The result
is defined as attention on K and V with each head repeated H // Hk times (``k.repeat_interleave(H // Hk,
dim=-2)``), bit for bit: K and V are quantized per K/V head, exactly as each repeated copy would be. The sm_90a
fast path runs it in every call form (C++ ``AttentionCall::kv_heads``, ``PrepareParams::kv_heads``,
``Fp8Inputs::kv_heads``, 0 meaning the query head count) and in the FP8 KV cache (``FP8KVCache(kv_heads=)``); the
general path, V residual repair and the VC baseline take equal head counts only (ValueError naming the argument,
before anything runs).
"""
from __future__ import annotations

REPEAT_HINT = "repeat k and v's heads to q's head count (k.repeat_interleave(H // Hk, dim=-2))"


def check_heads(h, hk, name, shape, like="q", what=None):
    """The K/V head count hk of a call with h query heads: hk == h, or hk a divisor of h (GQA/MQA) where `what`
    is None; `what` names a function that takes equal head counts only. ValueError naming `name` (the K/V
    argument, of shape `shape`; `like`: the query argument) otherwise. hk < 1 passes: the callers' rule of
    non-empty dims names it."""
    if hk == h or hk < 1:
        return
    if what is not None:
        raise ValueError(f"{name}: expected {h} heads like {like}, got shape {shape}: {what} does not take GQA/MQA "
                         f"(fewer K/V heads than query heads); {REPEAT_HINT}")
    if h % hk:
        raise ValueError(f"{name}: expected {h} heads like {like}, or a divisor of {h} (GQA/MQA: query head h "
                         f"attends K/V head h // (H // Hk)), got shape {shape}")


def is_gqa(h, hk) -> bool:
    """Whether a call of h query heads and hk K/V heads is grouped (hk a proper divisor of h)."""
    return 0 < hk < h and h % hk == 0


def require_fast_path(h, hk, reason, name="k"):
    """GQA runs on the sm_90a fast path only: ValueError naming `name` when a grouped call (h query heads, hk
    K/V heads) would need the general path (reason: _checks.general_path_reason's answer, or why the call
    was sent there)."""
    if reason is not None and is_gqa(h, hk):
        raise ValueError(f"{name}: GQA/MQA ({hk} K/V heads for {h} query heads) runs on the sm_90a fast path only, "
                         f"and this call would need the general path: {reason}; {REPEAT_HINT}")
