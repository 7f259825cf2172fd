"""diffusers' context parallelism (Ulysses, ring, both) around openvc's diffusers backend.

``model.enable_parallelism(config=ContextParallelConfig(...))`` gives every attention processor a
``_parallel_config``, which reaches the backend function. diffusers' own backends then call
``_templated_context_parallel_attention`` with a *forward op*: the attention on one process's tensors. The
template does the rest: Ulysses' all-to-all (sequence shards to head shards and back), the ring loop over
the other ranks' key/value shards, merging the partial results by their LSE. openvc's forward op is the
backend's local routing (openvc or the fallback, per call), so each local attention is decided by the
same policy as without parallelism; a ring step needs the LSE, which openvc returns and the fallback
computes exactly (:mod:`._exact`). Inference only: the backward op raises.
"""
from __future__ import annotations

__all__ = ["context_parallel_attention"]


def _backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("the openvc diffusers backend is inference-only: no backward under context "
                              "parallelism (run the model under torch.inference_mode() or torch.no_grad())")


def context_parallel_attention(dispatch, local_attention, query, key, value, attn_mask, dropout_p, scale,
                               return_lse, parallel_config):
    """diffusers' templated context-parallel attention with ``local_attention(q, k, v, attn_mask, dropout_p,
    is_causal, scale, enable_gqa, return_lse)`` as the per-process attention. Non-causal, no GQA (the
    template takes neither; the caller sends those calls elsewhere)."""

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        # _save_ctx asks for what a backward would need: there is no backward.
        return local_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)

    return dispatch._templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, False, scale, False, return_lse,
        forward_op=forward_op, backward_op=_backward_op, _parallel_config=parallel_config)
