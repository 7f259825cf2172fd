"""Key padding masks and key counts of :func:`open_vc_attn.attention` (imports torch inside the functions).

A key padding mask becomes per-batch key counts with no host synchronization: the kept keys of each
batch entry are moved to the front in their order (a stable sort on the mask, then one gather of k
and v), and the kernels use the first ``seqused_k[b]`` keys of entry b. Softmax attention does not
depend on the order of its keys, so this is exact for non-causal attention; the numerics are those of
the compacted keys (docs/numerics.md, "Key padding"). A mask that is already a suffix padding (the
common case: text tokens padded at the end) is compacted to itself.

Also the opt-in host-side validation (``check_inputs=True``): offsets, key counts and mask values read
back to the host (one synchronization) and checked with a clear error, for debugging.
"""
from __future__ import annotations

from ._checks import import_torch, shape_of

# Additive mask entries at or below this mask their key: a weight below e^-1000 is exactly 0 in FP32,
# and the common padding values (-10000, which BF16 rounds to -9984 as LTX-Video passes it; finfo.min;
# -inf) all lie below it.
PAD_BIAS = -1000.0


def key_mask(mask, batch: int, seqlen_k: int, device):
    """The boolean keep-mask [B, Sk] of a key padding mask: bool (True keeps the key) or an additive float
    mask of shape [B, Sk], [B, 1, Sk] or [B, 1, 1, Sk] whose entries <= PAD_BIAS (-1000, -inf included:
    their softmax weight is below e^-1000, exactly 0 in FP32) mask the key and 0 keeps it. Other values
    are attention biases, which are not applied (check_inputs=True rejects them). Masks of any other shape
    (per query, [B, H, Sq, Sk]) raise."""
    torch = import_torch()
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask: expected a torch.Tensor (bool, or float 0/-inf), got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask: expected a tensor on {device}, got {mask.device}")
    shape = tuple(mask.shape)
    ok = (len(shape) == 2 or (len(shape) == 3 and shape[1] == 1) or (len(shape) == 4 and shape[1] == shape[2] == 1))
    if not ok or shape[0] != batch or shape[-1] != seqlen_k:
        raise ValueError(f"key_padding_mask: expected a key mask of shape [B, Sk], [B, 1, Sk] or [B, 1, 1, Sk] = "
                         f"[{batch}, {seqlen_k}] (one entry per key); got {shape_of(mask)}. Masks that differ per "
                         "query or head are not key padding masks: openvc does not take them")
    flat = mask.reshape(batch, seqlen_k)
    if flat.dtype == torch.bool:
        return flat
    if not flat.dtype.is_floating_point:
        raise TypeError(f"key_padding_mask: expected dtype torch.bool or a float dtype (additive 0 / -inf), got "
                        f"{flat.dtype}")
    return flat > PAD_BIAS


def compact_keys(k, v, keep):
    """k, v [B, Sk, H, D] with the kept keys of each entry moved to the front (in order), and the key
    counts int32 [B]: stable sort on the mask, one gather each, no host synchronization."""
    torch = import_torch()
    counts = keep.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)
    index = order[:, :, None, None].expand(-1, -1, k.shape[2], k.shape[3])
    return torch.gather(k, 1, index), torch.gather(v, 1, index), counts


def validate_on_host(*, cu_seqlens_q=None, cu_seqlens_k=None, total_q=None, total_k=None, max_seqlen_q=None,
                     max_seqlen_k=None, seqused_k=None, slot_k=None, key_padding_mask=None):
    """check_inputs=True: reads the device values (one synchronization) and raises ValueError naming the
    first argument that breaks the rules. Without it, the kernels clamp whatever the values hold (no
    out-of-bounds access) and document what comes out."""
    torch = import_torch()
    for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        if cu is None:
            continue
        off = cu.tolist()
        if off[0] != 0:
            raise ValueError(f"{name}: expected cu[0] == 0, got {off[0]}")
        for i in range(1, len(off)):
            if off[i] < off[i - 1]:
                raise ValueError(f"{name}: offsets must be non-decreasing, got cu[{i - 1}] = {off[i - 1]} > "
                                 f"cu[{i}] = {off[i]}")
        if off[-1] > total:
            raise ValueError(f"{name}: the last offset {off[-1]} is past the tensor's {total} token rows")
        longest = max(b - a for a, b in zip(off[:-1], off[1:]))
        if max_len is not None and longest > max_len:
            raise ValueError(f"{name[:-1].replace('cu_seqlens', 'max_seqlen')}: {max_len} is below the longest "
                             f"sequence ({longest} tokens): its rows past max_seqlen would not be computed")
    if seqused_k is not None:
        used = seqused_k.tolist()
        slots = ([b - a for a, b in zip(cu_seqlens_k.tolist()[:-1], cu_seqlens_k.tolist()[1:])]
                 if cu_seqlens_k is not None else [slot_k] * len(used))
        for i, (u, s) in enumerate(zip(used, slots)):
            if not 0 <= u <= s:
                raise ValueError(f"seqused_k: entry {i} is {u}, expected 0 <= seqused_k <= {s} (its keys)")
    if key_padding_mask is not None and key_padding_mask.dtype.is_floating_point:
        bad = ~((key_padding_mask == 0) | (key_padding_mask <= PAD_BIAS))
        if bool(bad.any()):
            raise ValueError(f"key_padding_mask: an additive key padding mask must hold only 0 (keep) and values "
                             f"<= {PAD_BIAS:g} or -inf (mask); other values are attention biases, which openvc "
                             "does not take")
    torch.cuda.synchronize()
