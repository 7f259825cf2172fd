"""Exact attention with its log-sum-exp, in plain torch: the fallback of integration calls that need an LSE.

Ring attention (diffusers' context parallelism, yunchang/xDiT) merges partial attentions by their LSE, so a
call that does not take openvc's fast path still has to return one. torch's SDPA returns none, and the
framework backends that do are CUDA-only or return a placeholder (yunchang's math/cuDNN paths return zeros).
:func:`attention_with_lse` computes both in FP32 from the given operands, a block of query rows at a time:
correct on any device and for any mask, not fast. Imports torch when called.
"""
from __future__ import annotations

__all__ = ["attention_with_lse"]

# Scores of one block of query rows are materialized in FP32: keep a block under about 256 MiB.
_BLOCK_BYTES = 256 << 20


def _mask_as_bias(attn_mask, dtype):
    """A bool (True = attend) or additive mask as an FP32 additive bias; a 2-D [B, Sk] mask becomes
    [B, 1, 1, Sk] (diffusers' key-padding form). Other ranks must broadcast to [B, H, Sq, Sk]."""
    import torch
    if attn_mask.dim() == 2:
        attn_mask = attn_mask[:, None, None, :]
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask,
                                                                                              float("-inf"))
    return attn_mask.to(dtype)


def attention_with_lse(q, k, v, *, scale=None, causal=False, causal_from_end=False, attn_mask=None):
    """softmax(q k^T * scale + mask) v and its LSE, exactly (FP32 accumulation).

    q: [B, Sq, H, D]; k, v: [B, Sk, Hk, D] with H a multiple of Hk (GQA heads are repeated). scale: None
    for 1/sqrt(D). causal: key j visible to query i iff j <= i (torch SDPA's convention) or, with
    causal_from_end, iff j <= i + Sk - Sq (flash-attn's, aligned to the last query). attn_mask: None, bool
    (True = attend) or additive, [B, Sk] or broadcastable to [B, H, Sq, Sk].

    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] float32, natural log). A row that sees no key
    gives output 0 and LSE -inf (openvc's convention).
    """
    import torch
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if h % hk or v.shape[2] != hk:
        raise ValueError(f"k, v: {hk}/{v.shape[2]} heads do not divide the {h} query heads")
    scale = d ** -0.5 if scale is None else float(scale)
    qf = q.transpose(1, 2).float()                                      # [B, H, Sq, D]
    kf, vf = (x.transpose(1, 2).float().repeat_interleave(h // hk, dim=1) for x in (k, v))
    bias = None if attn_mask is None else _mask_as_bias(attn_mask, torch.float32)
    rows = max(1, _BLOCK_BYTES // max(1, 4 * b * h * sk))
    out = torch.empty(b, h, sq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        s = torch.matmul(qf[:, :, r0:r1], kf.transpose(-1, -2)) * scale      # [B, H, r, Sk]
        if bias is not None:
            s = s + (bias if bias.shape[-2] == 1 else bias[..., r0:r1, :])
        if causal:
            shift = sk - sq if causal_from_end else 0
            i = torch.arange(r0, r1, device=q.device)[:, None]
            j = torch.arange(sk, device=q.device)[None, :]
            s = s.masked_fill(j > i + shift, float("-inf"))
        m = torch.logsumexp(s, dim=-1)                                   # -inf where a row sees nothing
        p = torch.exp(s - m.masked_fill(torch.isinf(m), 0.0)[..., None])  # 0 for such rows, never NaN
        out[:, :, r0:r1] = torch.matmul(p, vf)
        lse[:, :, r0:r1] = m
    return out.transpose(1, 2).to(q.dtype), lse
