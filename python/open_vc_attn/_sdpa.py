"""The BF16 baseline behind ``attention(..., version="reference", mode="bf16")``: torch's
scaled_dot_product_attention on BF16 copies of q, k, v, with the conventions of the FP8 path (layouts,
causal mask aligned to the end, a row without visible keys gives 0 and lse -inf, GQA / MQA as K/V heads
repeated), for A/B comparisons.

Arguments arrive checked by api.attention. Imports torch: import lazily.
"""
import math

import torch

_LSE_CHUNK_ELEMS = 1 << 27   # FP32 scores per LSE chunk (512 MiB)


def _visible(rows, sq, sk, device):
    """[len(rows), sk] bool: key j visible to query i iff j <= i + (sk - sq)."""
    return torch.arange(sk, device=device)[None, :] <= rows[:, None] + (sk - sq)


def _key_mask(rows, sq, sk, causal, counts, device):
    """[B or 1, 1, Sq, Sk] bool visibility: causal aligned to the end of the used keys (counts [B], the
    key counts, or all Sk keys), keys at or past the count masked; None when every key is visible."""
    if counts is None:
        return _visible(rows, sq, sk, device)[None, None] if causal else None
    j = torch.arange(sk, device=device)[None, None, :]          # [1, 1, Sk]
    used = counts.to(torch.int64).clamp(0, sk)[:, None, None]     # [B, 1, 1]
    vis = j < used
    if causal:
        vis = vis & (j <= rows[None, :, None] + (used - sq))
    return vis[:, None]                                           # [B, 1, Sq, Sk]


def _one(q, k, v, scale, causal, want_lse, counts=None, keep=None):
    """q [B, Sq, H, D], k and v [B, Sk, Hk, D] -> out bf16 [B, Sq, H, D] and lse fp32 [B, H, Sq] (or None).
    counts: optional key counts [B]; keep: optional bool key mask [B, Sk] (non-causal). Hk < H (GQA / MQA): each
    K/V head repeated H // Hk times, the definition of the grouped call."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if k.shape[2] != h:
        k, v = (x.repeat_interleave(h // k.shape[2], dim=2) for x in (k, v))
    if sk == 0:   # no keys at all (an empty packed sequence)
        lse = torch.full((b, h, sq), float("-inf"), device=q.device) if want_lse else None
        return q.new_zeros((b, sq, h, d), dtype=torch.bfloat16), lse
    qt, kt, vt = (x.to(torch.bfloat16).transpose(1, 2) for x in (q, k, v))   # [B, H, S, D]
    rows = torch.arange(sq, device=q.device)
    # Causal: always an explicit end-aligned mask, never SDPA's is_causal: under torch.compile with
    # dynamic shapes `sq == sk` is a SymBool, which is_causal rejects (seen on torch 2.11), and for this
    # A/B baseline the mask's cost does not matter.
    mask = _key_mask(rows, sq, sk, causal, counts, q.device)
    if keep is not None:
        mask = keep[:, None, None, :] if mask is None else mask & keep[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    if mask is not None:   # rows that see no key: 0, as in the FP8 path (SDPA gives NaN)
        out = torch.where(mask.any(dim=-1, keepdim=True), out, out.new_zeros(()))
    out = out.transpose(1, 2).contiguous()
    if not want_lse:
        return out, None
    # Natural-log LSE of the scaled scores, in FP32 from the BF16 operands, a chunk of query rows at a time.
    step = max(1, _LSE_CHUNK_ELEMS // max(1, b * h * sk))
    kf = kt.float().transpose(-1, -2)
    parts = []
    for i0 in range(0, sq, step):
        s = torch.matmul(qt[:, :, i0:i0 + step].float(), kf) * scale
        if mask is not None:
            s = s.masked_fill(~mask[:, :, i0:i0 + step] if mask.shape[2] > 1 else ~mask, float("-inf"))
        parts.append(torch.logsumexp(s, dim=-1))
    return out, torch.cat(parts, dim=-1)


def _scale(scale, d):
    return scale if scale > 0 else 1.0 / math.sqrt(d)


def attention_bf16(q4, k4, v4, scale, causal, want_lse, rank, counts=None, keep=None):
    """Batched: q4 [B, Sq, H, D], k4 and v4 [B, Sk, H, D]; outputs of api.attention's shapes. counts: key
    counts [B] (seqused_k); keep: bool key padding mask [B, Sk]."""
    out, lse = _one(q4, k4, v4, _scale(scale, q4.shape[-1]), causal, want_lse, counts, keep)
    if rank == 3:
        out, lse = out[0], (lse[0] if want_lse else None)
    return (out, lse) if want_lse else out


def attention_bf16_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, want_lse):
    """Packed: q [total_q, H, D], k and v [total_k, H, D]; one SDPA call per sequence. The offsets are
    copied to the host (a synchronization): acceptable for a baseline. Rows outside every sequence stay 0
    (lse -inf)."""
    total_q, h, d = q.shape
    scale = _scale(scale, d)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = q.new_zeros((total_q, h, d), dtype=torch.bfloat16)
    lse = torch.full((h, total_q), float("-inf"), device=q.device) if want_lse else None
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if q1 <= q0:
            continue
        o, l = _one(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], scale, causal, want_lse)
        out[q0:q1] = o[0]
        if want_lse:
            lse[:, q0:q1] = l[0]
    return (out, lse) if want_lse else out
