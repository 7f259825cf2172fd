"""attention()'s ``block_mask`` argument: key block lists for the sm_90a kernel (docs/block_sparse.md,
docs/numerics.md section 5 "Key block lists").

A torch FlexAttention BlockMask (BLOCK_SIZE 128; its partial and full blocks are both visited whole, its
mask_mod is not evaluated) or a (kv_num_blocks, kv_indices) pair of int32 CUDA tensors in its layout
becomes the (counts, indices) pair the op takes, checked once here; torch is imported by the caller.
"""


def is_block_mask(x) -> bool:
    """A FlexAttention BlockMask (duck-typed: torch.nn.attention.flex_attention is imported lazily)."""
    return hasattr(x, "kv_num_blocks") and hasattr(x, "kv_indices") and hasattr(x, "BLOCK_SIZE")


def lists_of(block_mask, *, seqlen_q, seqlen_k, check_inputs=False, batch=None, heads=None):
    """(kv_num_blocks, kv_indices) of attention()'s block_mask argument: a BlockMask's lists (union of its partial
    and full blocks, ascending; open_vc_attn.masks.block_lists) or the pair as given. The op checks the lists;
    with check_inputs their values are also read back and validated here (one synchronization)."""
    from . import masks

    if is_block_mask(block_mask):
        lengths = tuple(int(x) for x in getattr(block_mask, "seq_lengths", (seqlen_q, seqlen_k)))
        if lengths != (seqlen_q, seqlen_k):
            raise ValueError(f"block_mask: built for (Q_LEN, KV_LEN) = {lengths}, the call has (Sq, Sk) = "
                             f"({seqlen_q}, {seqlen_k})")
        counts, indices = masks.block_lists(block_mask)
    elif isinstance(block_mask, (tuple, list)) and len(block_mask) == 2:
        counts, indices = block_mask
    else:
        raise TypeError("block_mask: expected a torch.nn.attention.flex_attention.BlockMask (BLOCK_SIZE 128) or a "
                        f"(kv_num_blocks, kv_indices) pair of int32 tensors, got {type(block_mask).__name__}")
    if check_inputs:
        masks.check_block_lists(counts, indices, batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                check_inputs=True)
    return counts, indices


def check_op_lists(counts, indices, q, k, *, packed, causal, key_counts, p_format):
    """The attention op's rules for its kv_num_blocks / kv_indices arguments (batched q [B, Sq, H, D]): the
    call forms they combine with, the lists' layout (masks.check_block_lists), contiguity, device. Either
    path takes them (the general path visits the same blocks in the same order)."""
    from . import masks

    if counts is None or indices is None:
        raise ValueError("kv_num_blocks, kv_indices: pass both (key block lists) or neither")
    reject_with(**{"cu_seqlens (packed sequences)": packed, "causal": causal,
                   "seqused_k or key_padding_mask (key counts)": key_counts, "p_format='exp2'": p_format == "exp2"})
    masks.check_block_lists(counts, indices, batch=int(q.shape[0]), heads=int(q.shape[2]), seqlen_q=int(q.shape[1]),
                            seqlen_k=int(k.shape[1]))
    for name, x in (("kv_num_blocks", counts), ("kv_indices", indices)):
        if not x.is_contiguous():   # the kernel reads rows at fixed strides: no silent copy
            raise ValueError(f"{name}: expected a contiguous tensor (the kernel's layout), got strides {x.stride()}")
    if counts.device != q.device:   # check_block_lists put both lists on one device
        raise ValueError(f"kv_num_blocks, kv_indices: expected q's device ({q.device}), got {counts.device}")


def reject_with(**given):
    """ValueError naming block_mask when a call form it does not combine with is given (truthy values)."""
    named = [name for name, value in given.items() if value]
    if named:
        raise ValueError(f"block_mask: key block lists take batched calls without {', '.join(named)} (the sm_90a "
                         "kernel's block-list mode does not combine with them yet)")
