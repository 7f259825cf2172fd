"""Block-sparse masks in openvc's diffusers backend (docs/integrations/diffusers.md, "Block-sparse masks").

A torch FlexAttention ``BlockMask`` reaches ``open_vc_attn.attention(..., block_mask=)`` in two ways:

- as a dispatch call's ``attn_mask``: the form diffusers' ``"flex"`` backend takes (a processor that passes
  one, e.g. a user's subclass of a model's processor). The policy (:func:`.policy.block_mask_reason`) takes it
  for a batched, non-causal call with the mask built for the call's (Sq, Sk), BLOCK_SIZE 128, batch and head
  dims of 1 or the call's; the call is otherwise routed as any other. One it does not take goes to diffusers'
  ``"flex"`` backend, the only one that takes a BlockMask, whatever the fallback backend is.
- attached to a wrapped model: ``apply(pipe or model, block_mask=mask)`` makes openvc use ``mask`` for that
  model's calls that have no ``attn_mask``, are not causal and whose (Sq, Sk) are the mask's lengths (Wan's
  self-attention; its text cross-attention has 512 keys, so it is left as it is). It is an openvc option: a
  call that falls back runs as the model made it, without the mask.

Either way openvc visits the mask's partial and full blocks whole (mask_mod is not evaluated), and stats()
count the call under :data:`BLOCK_SPARSE`. Imports torch only in :func:`flex_with_lse`.
"""
from __future__ import annotations

from .. import _block_sparse

__all__ = ["BLOCK_SPARSE", "FLEX", "check_option", "mask_of", "fallback_backend", "flex_with_lse"]

BLOCK_SPARSE = "openvc-block-sparse"    # stats() path of the calls openvc runs with a block mask
FLEX = "flex"                           # diffusers' backend for a BlockMask the policy does not take


def _block_size(mask):
    size = mask.BLOCK_SIZE
    return tuple(int(x) for x in size) if isinstance(size, (tuple, list)) else (int(size),) * 2


def check_option(block_mask):
    """apply()'s block_mask: None or a FlexAttention BlockMask with BLOCK_SIZE 128 (TypeError / ValueError naming
    block_mask). Raised at apply: unlike a call's attn_mask, an attached mask has no framework attention to fall
    back on that would apply it, so one openvc cannot take is a mistake to report, not a call to reroute."""
    if block_mask is None:
        return None
    if not _block_sparse.is_block_mask(block_mask) or not hasattr(block_mask, "seq_lengths"):
        raise TypeError(f"block_mask: expected None or a torch.nn.attention.flex_attention.BlockMask (e.g. "
                        f"open_vc_attn.masks.frame_causal(...)), got {type(block_mask).__name__}")
    if _block_size(block_mask) != (128, 128):
        raise ValueError(f"block_mask: expected BLOCK_SIZE (128, 128) (openvc's query tile and key block), got "
                         f"{_block_size(block_mask)}")
    return block_mask


def mask_of(attached, query, key, attn_mask, is_causal):
    """The BlockMask of this call: its own attn_mask when that is one; else ``attached`` (apply's block_mask of
    the model running, or None) when the call has no attn_mask, is not causal and its (Sq, Sk) are the mask's
    lengths; else None (a dense call)."""
    if attn_mask is not None:
        return attn_mask if _block_sparse.is_block_mask(attn_mask) else None
    if attached is None or is_causal:
        return None
    lengths = tuple(int(x) for x in attached.seq_lengths)
    return attached if lengths == (int(query.shape[1]), int(key.shape[1])) else None


def fallback_backend(attn_mask, fallback):
    """The diffusers backend of a fallback call: "flex" for a BlockMask attn_mask (diffusers' native and other
    backends cannot take one), else ``fallback``."""
    return FLEX if attn_mask is not None and _block_sparse.is_block_mask(attn_mask) else fallback


def flex_with_lse(query, key, value, block_mask, scale):
    """A fallback call with a BlockMask that asks for the LSE: torch's flex_attention (which applies mask_mod)
    with its natural-log LSE. diffusers' flex backend cannot return one (it permutes the (out, lse) tuple).
    q [B, S, H, D], k, v [B, S, Hk, D] (Hk dividing H); returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq]
    float32)."""
    from torch.nn.attention import flex_attention as fa
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}   # fewer key/value heads (GQA / MQA)
    if hasattr(fa, "AuxRequest"):        # torch >= 2.9: return_lse is deprecated there
        out, aux = fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                     return_aux=fa.AuxRequest(lse=True), **gqa)
        lse = aux.lse
    else:
        out, lse = fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_lse=True, **gqa)
    return out.transpose(1, 2).to(query.dtype), lse.float()
