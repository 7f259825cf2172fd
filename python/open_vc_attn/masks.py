"""Block-sparse video masks for ``open_vc_attn.attention(q, k, v, block_mask=...)`` (docs/block_sparse.md).

Mask builders (each returns a torch FlexAttention ``BlockMask`` with ``BLOCK_SIZE == (128, 128)`` over
``Q_LEN == KV_LEN == frames * tokens_per_frame``; query token i, key token j, ``frame(x) = x // tokens_per_frame``):
- :func:`frame_causal`: j visible to i iff ``frame(j) <= frame(i)``.
- :func:`temporal_window`: iff ``|frame(i) - frame(j)| <= radius``.
- :func:`radial`: Radial Attention's rule (Li et al. 2025), see its docstring.

Each BlockMask carries its element-level ``mask_mod``, so FlexAttention given the same BlockMask computes the
exact element mask. openvc does not evaluate ``mask_mod``: it visits every listed block whole, partial ones
included, so an element-level edge inside a 128x128 block (a frame boundary off a multiple of 128) is
approximated at block granularity.

Block lists (the kernel's layout, FlexAttention's too): ``kv_num_blocks`` int32 ``[B, H, Q_tiles]`` and
``kv_indices`` int32 ``[B, H, Q_tiles, K_tiles]``; row (b, h, q_tile) visits the first ``kv_num_blocks`` entries
of its ``kv_indices`` row, strictly ascending; B and H may be 1 (broadcast).
- :func:`block_lists`: a BlockMask's partial and full lists merged into that layout (on the device, no sync).
- :func:`check_block_lists`: shape / dtype / device checks, and with ``check_inputs=True`` the values.

torch is imported inside the functions only: ``import open_vc_attn.masks`` does not import torch. The mask
builders need torch >= 2.6 (``BlockMask.from_kv_blocks(seq_lengths=...)``).
"""
from __future__ import annotations

import math
import operator

from . import _checks
from ._layout import QUANT_BLOCK

__all__ = ["BLOCK_SIZE", "frame_causal", "temporal_window", "radial", "block_lists", "check_block_lists"]

BLOCK_SIZE = QUANT_BLOCK   # the kernel's query tile and key block: one descale group (openvc::kQuantBlock)
# Elements of one chunk when a mask is classified into blocks: bounds the temporaries (a few int32 tensors of
# this many elements) while keeping the number of chunks (Python iterations, a few kernels each) small.
_CHUNK_ELEMENTS = 1 << 25
# Radial Attention's block size: the narrowest spatial window, and the density below which whole frame pairs
# are dropped (their code's ``threshold``/``block_size``, 128 for Wan 2.1 and HunyuanVideo).
_RADIAL_MIN_WIDTH = 128


def _tiles(n):
    return (n + BLOCK_SIZE - 1) // BLOCK_SIZE


def _positive_int(value, name, minimum=1):
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _video_args(frames, tokens_per_frame, batch, heads):
    frames = _positive_int(frames, "frames")
    tokens_per_frame = _positive_int(tokens_per_frame, "tokens_per_frame")
    batch = _positive_int(batch, "batch")
    heads = _positive_int(heads, "heads")
    if frames * tokens_per_frame > 2**31 - 1:   # the kernel's token indices are 32-bit
        raise ValueError(f"frames * tokens_per_frame: expected at most 2**31 - 1 tokens, got "
                         f"{frames} * {tokens_per_frame}")
    return frames, tokens_per_frame, batch, heads


def _device(device):
    torch = _checks.import_torch()
    if device is None:   # create_block_mask's default, but only a usable accelerator (torch.accelerator: >= 2.6)
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            device = accelerator.current_accelerator()
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def _ordered(dense):
    """(counts, indices) of a 0/1 block matrix [..., Q_tiles, K_tiles]: each row's set columns first, ascending
    (a stable descending sort, as create_block_mask orders them, so the two give identical tensors)."""
    torch = _checks.import_torch()
    dense = dense.to(torch.int32)
    counts = dense.sum(dim=-1).to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.contiguous(), indices.contiguous()


def _block_mask(mask_mod, seqlen, batch, heads, device):
    """The BlockMask of an element rule ``mask_mod(b, h, q_idx, kv_idx)`` that does not depend on b and h, with
    the classification create_block_mask makes (full: all 128x128 elements visible; partial: some), computed
    over row chunks. create_block_mask materializes the whole [B, H, Q, KV] mask (and int64 temporaries of that
    size): tens of GB at 21 frames of 3600 tokens."""
    torch = _checks.import_torch()
    from torch.nn.attention.flex_attention import BlockMask
    n = _tiles(seqlen)
    rows = max(1, _CHUNK_ELEMENTS // (n * BLOCK_SIZE * BLOCK_SIZE)) * BLOCK_SIZE
    counts = torch.empty(n, n, dtype=torch.int32, device=device)
    # int32 indices (FlexAttention's, and half the traffic of int64): sequences are below 2**31 tokens.
    kv = torch.arange(seqlen, dtype=torch.int32, device=device).unsqueeze(0)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    for r0 in range(0, seqlen, rows):
        r1 = min(r0 + rows, seqlen)
        q = torch.arange(r0, r1, dtype=torch.int32, device=device).unsqueeze(1)
        visible = torch.broadcast_to(mask_mod(zero, zero, q, kv), (r1 - r0, seqlen))
        # Out-of-range rows and columns are not visible, as create_block_mask pads them: an edge block is partial.
        tile_rows = _tiles(r1 - r0)
        visible = torch.nn.functional.pad(visible, (0, n * BLOCK_SIZE - seqlen, 0, tile_rows * BLOCK_SIZE - (r1 - r0)))
        counts[r0 // BLOCK_SIZE:r0 // BLOCK_SIZE + tile_rows] = \
            visible.reshape(tile_rows, BLOCK_SIZE, n, BLOCK_SIZE).sum(dim=(1, 3), dtype=torch.int32)
    whole = BLOCK_SIZE * BLOCK_SIZE
    lists = [_ordered(blocks) for blocks in ((counts > 0) & (counts < whole), counts == whole)]
    # Broadcast dims expand to real copies: create_block_mask's layout, which FlexAttention's kernels take.
    lists = [x.expand(batch, heads, *x.shape).contiguous() for pair in lists for x in pair]
    return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=(BLOCK_SIZE, BLOCK_SIZE), mask_mod=mask_mod,
                                    seq_lengths=(seqlen, seqlen))


# ---- masks ----------------------------------------------------------------------------------------------

def frame_causal(frames, tokens_per_frame, *, batch=1, heads=1, device=None):
    """Frame-causal attention: key token j is visible to query token i iff ``frame(j) <= frame(i)``, with
    ``frame(x) = x // tokens_per_frame`` (every token sees its whole frame and all earlier frames).

    Returns a FlexAttention ``BlockMask`` (BLOCK_SIZE 128) over ``frames * tokens_per_frame`` queries and keys,
    with ``[batch, heads, ...]`` block tensors (1, 1: broadcast over any batch and heads) on ``device``
    (default: torch's current accelerator where one is usable, else CPU). Its ``mask_mod`` is the element
    rule (FlexAttention applies it; openvc visits the listed blocks whole)."""
    frames, t, batch, heads = _video_args(frames, tokens_per_frame, batch, heads)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx // t <= q_idx // t

    return _block_mask(mask_mod, frames * t, batch, heads, _device(device))


def temporal_window(frames, tokens_per_frame, radius, *, batch=1, heads=1, device=None):
    """Temporal window: key token j is visible to query token i iff ``|frame(i) - frame(j)| <= radius``
    (``radius=0``: each frame attends to itself only). Returns a BlockMask as :func:`frame_causal` does."""
    frames, t, batch, heads = _video_args(frames, tokens_per_frame, batch, heads)
    radius = _positive_int(radius, "radius", minimum=0)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // t - kv_idx // t).abs() <= radius

    return _block_mask(mask_mod, frames * t, batch, heads, _device(device))


def _radial_widths(frames, t, decay_factor):
    """Radial Attention's spatial half-width W(d) per temporal distance d = 0 .. frames-1 (ints): t (the whole
    frame pair) at d <= 1, -1 where the frame pair is dropped, else the window (see :func:`radial`). Powers of
    two are kept as exponents: D(d) = 2**(log_span - bit_length(d)) can fall below 1 token for far frames."""
    if not (isinstance(decay_factor, (int, float)) and not isinstance(decay_factor, bool)
            and math.isfinite(decay_factor) and decay_factor > 0):
        raise ValueError(f"decay_factor: expected a finite number > 0, got {decay_factor!r}")
    log_span = t.bit_length()                       # S = 2**log_span, the smallest power of two above t
    log_min = _RADIAL_MIN_WIDTH.bit_length() - 1    # 128 = 2**7
    widths = []
    for d in range(frames):
        log_decay = log_span - d.bit_length()       # D(d) = S / 2**bit_length(d)
        if log_decay < log_min and d % (1 << (log_min - log_decay)) != 0:
            widths.append(-1)   # diagonal under one block wide: only every (128/D)-th distance keeps it
        elif d <= 1:
            widths.append(t)
        else:
            widths.append(max(math.floor(2.0 ** log_decay * decay_factor), _RADIAL_MIN_WIDTH))
    return widths


def radial(frames, tokens_per_frame, *, decay_factor=1.0, attention_sink=True, batch=1, heads=1, device=None):
    """Radial Attention's static mask (Li et al. 2025, "Radial Attention: O(n log n) Sparse Attention with
    Energy Decay for Long Video Generation", arXiv 2506.19852; the rule of ``gen_log_mask_shrinked``,
    ``get_window_width`` and ``get_diagonal_split_mask`` in github.com/mit-han-lab/radial-attention,
    radial_attn/attn_mask.py): the spatial window shrinks by powers of two with temporal distance.

    Query token i, key token j; ``f = frame(x) = x // tokens_per_frame``, ``p = pos(x) = x % tokens_per_frame``,
    ``d = |f(i) - f(j)|``, ``S = 2**bit_length(tokens_per_frame)`` (the smallest power of two above
    tokens_per_frame: 2048 for 1560 tokens, 4096 for 3600) and, for d >= 1, ``D(d) = S / 2**bit_length(d)``
    (= S / 2**(floor(log2 d) + 1): S/2 at d = 1, S/4 at d = 2..3, S/8 at d = 4..7, ...). j is visible to i iff
    ``attention_sink and f(j) == 0``, or both:
    - the frame pair is kept: d == 0, or D(d) >= 128, or ``d % (128 / D(d)) == 0`` (once the diagonal is
      narrower than a 128-token block, only every (128/D)-th frame distance keeps its diagonal);
    - the position is within the window: ``|p(i) - p(j)| <= W(d)``, ``W = tokens_per_frame`` (the whole frame)
      at d = 0 and d = 1, else ``W(d) = max(floor(D(d) * decay_factor), 128)``.
    So distance 0 (the same frame) is always dense, and distance 1 is dense too wherever tokens_per_frame >= 128
    (D(1) = S/2 >= 128); with fewer than 128 tokens a frame, D(1) < 128 and the keep rule applies at d = 1 too,
    as in their code.

    Keywords (their defaults): ``decay_factor=1.0`` scales the window (the --decay_factor of their Wan 2.1 and
    HunyuanVideo scripts; the keep rule ignores it, as theirs does). ``attention_sink=True``: every query sees
    the whole first frame (their Wan path, and the paper's mask; their HunyuanVideo path passes False).

    Block level: this BlockMask lists every 128x128 block where the rule above has a visible element (partial or
    full, exactly as create_block_mask classifies its mask_mod). Their implementation instead shrinks the
    element mask with a density heuristic (``shrinkMaskStrict``: keep a block where over 60% of its non-empty
    key columns are more than 1/3 visible), which drops the thin edges of the diagonal bands: their block set
    is a subset of this one. Text tokens appended to the video (their HunyuanVideo path) are not part of this
    mask. Returns a BlockMask as :func:`frame_causal` does."""
    frames, t, batch, heads = _video_args(frames, tokens_per_frame, batch, heads)
    torch = _checks.import_torch()
    device = _device(device)
    widths = torch.tensor(_radial_widths(frames, t, decay_factor), dtype=torch.int32, device=device)
    sink = bool(attention_sink)
    last = frames - 1

    def mask_mod(b, h, q_idx, kv_idx):
        fk = kv_idx // t
        # Clamped: FlexAttention may call the rule on the padding past the last frame of a partial tile.
        d = (q_idx // t - fk).abs().clamp(max=last)
        visible = (q_idx % t - kv_idx % t).abs() <= widths[d]
        return visible | (fk == 0) if sink else visible

    return _block_mask(mask_mod, frames * t, batch, heads, device)


# ---- block lists ----------------------------------------------------------------------------------------

def block_lists(block_mask):
    """The block lists of a FlexAttention BlockMask in openvc's layout: ``(kv_num_blocks, kv_indices)``, int32,
    contiguous, on the mask's device, ``[B, H, Q_tiles]`` and ``[B, H, Q_tiles, K_tiles]`` with ``K_tiles =
    ceil(KV_LEN / 128)``. Row (b, h, q_tile) lists the union of the mask's partial (``kv_num_blocks``,
    ``kv_indices``) and full (``full_kv_num_blocks``, ``full_kv_indices``) blocks, ascending, each once; entries
    past the count are 0. ``mask_mod`` is not evaluated: a partial block is visited whole. Listed indices outside
    [0, K_tiles) are dropped (a BlockMask for another KV_LEN is the caller's problem: check_block_lists).

    A few tensor ops on the device, without host synchronization (CUDA graph capture, torch.compile)."""
    torch = _checks.import_torch()
    from torch.nn.attention.flex_attention import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}")
    size = tuple(block_mask.BLOCK_SIZE) if isinstance(block_mask.BLOCK_SIZE, (tuple, list)) \
        else (block_mask.BLOCK_SIZE,) * 2
    if size != (BLOCK_SIZE, BLOCK_SIZE):
        raise ValueError(f"block_mask: expected BLOCK_SIZE ({BLOCK_SIZE}, {BLOCK_SIZE}) (openvc's 128-query tile "
                         f"and 128-key block), got {size}")
    pairs = [(block_mask.kv_num_blocks, block_mask.kv_indices)]
    if block_mask.full_kv_num_blocks is not None:
        pairs.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    for counts, indices in pairs:
        if counts.dim() != 3 or indices.dim() != 4:
            raise ValueError(f"block_mask: expected [B, H, Q_tiles] counts and [B, H, Q_tiles, K] indices, got "
                             f"{_checks.shape_of(counts)} and {_checks.shape_of(indices)}")
    k_tiles = _tiles(block_mask.seq_lengths[1])
    rows = torch.broadcast_shapes(*(indices.shape[:3] for _, indices in pairs))
    device = block_mask.kv_indices.device
    # Block occupancy [B, H, Q_tiles, K_tiles + 1]; the extra column catches unlisted and out-of-range entries.
    occupied = torch.zeros(*rows, k_tiles + 1, dtype=torch.int32, device=device)
    for counts, indices in pairs:
        slot = torch.arange(indices.shape[-1], device=device)
        indices = indices.to(torch.int64)
        listed = (slot < counts.unsqueeze(-1)) & (indices >= 0) & (indices < k_tiles)
        target = torch.where(listed, indices, k_tiles).expand(*rows, indices.shape[-1])
        occupied.scatter_(-1, target, 1)   # a block in both lists is set twice: kept once
    occupied = occupied[..., :k_tiles]
    # Compaction without a sort: the c-th occupied column of a row goes to slot c (cumsum - 1); the others go to
    # the extra slot, cut off after.
    slots = torch.where(occupied.bool(), occupied.cumsum(dim=-1) - 1, k_tiles)
    columns = torch.arange(k_tiles, dtype=torch.int32, device=device).expand_as(slots)
    kv_indices = torch.zeros(*rows, k_tiles + 1, dtype=torch.int32, device=device)
    kv_indices.scatter_(-1, slots, columns)
    kv_num_blocks = occupied.sum(dim=-1, dtype=torch.int32)
    return kv_num_blocks.contiguous(), kv_indices[..., :k_tiles].contiguous()


def check_block_lists(kv_num_blocks, kv_indices, *, batch, heads, seqlen_q, seqlen_k, check_inputs=False):
    """Checks block lists for a call of ``batch`` x ``heads`` with ``seqlen_q`` queries and ``seqlen_k`` keys:
    int32 ``kv_num_blocks [B, H, Q_tiles]`` and ``kv_indices [B, H, Q_tiles, K_tiles]`` on one device, B in
    {1, batch}, H in {1, heads}, ``Q_tiles == ceil(seqlen_q / 128)``, K_tiles >= 1, the indices' first three dims
    those of the counts (TypeError / ValueError naming the argument and the expected shape). No sync.

    ``check_inputs=True`` also reads the values on the host (a sync): every count in [0, min(K_tiles,
    ceil(seqlen_k / 128))], and each row's listed indices in [0, ceil(seqlen_k / 128)) and strictly ascending;
    the message names the first offending (b, h, q_tile) in row-major order."""
    torch = _checks.import_torch()
    q_tiles, kv_tiles = _tiles(seqlen_q), _tiles(seqlen_k)
    counts_layout = (f"[B, H, Q_tiles] with B in (1, {batch}), H in (1, {heads}), "
                     f"Q_tiles = ceil({seqlen_q}/128) = {q_tiles}")
    for name, x, rank in (("kv_num_blocks", kv_num_blocks, 3), ("kv_indices", kv_indices, 4)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor (int32), got {type(x).__name__}")
        if x.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {x.dtype}")
        if x.dim() != rank:
            layout = counts_layout if rank == 3 else counts_layout.replace("Q_tiles]", "Q_tiles, K_tiles]")
            raise ValueError(f"{name}: expected rank {rank}, {layout}; got shape {_checks.shape_of(x)}")
    b, h, q = _checks.shape_of(kv_num_blocks)
    if b not in (1, batch) or h not in (1, heads) or q != q_tiles:
        raise ValueError(f"kv_num_blocks: expected {counts_layout}; got shape {(b, h, q)}")
    if _checks.shape_of(kv_indices)[:3] != (b, h, q) or kv_indices.shape[3] < 1:
        raise ValueError(f"kv_indices: expected [B, H, Q_tiles, K_tiles] = [{b}, {h}, {q}, K_tiles >= 1] (the dims of "
                         f"kv_num_blocks, then K_tiles), got shape {_checks.shape_of(kv_indices)}")
    if kv_indices.device != kv_num_blocks.device:
        raise ValueError(f"kv_indices: expected the device of kv_num_blocks ({kv_num_blocks.device}), got "
                         f"{kv_indices.device}")
    if check_inputs:
        _check_values(torch, kv_num_blocks.cpu(), kv_indices.cpu(), kv_tiles)


def _check_values(torch, counts, indices, kv_tiles):
    limit = min(indices.shape[-1], kv_tiles)
    slot = torch.arange(indices.shape[-1])
    listed = slot < counts.clamp(0, limit).unsqueeze(-1)
    rising = torch.ones_like(listed)
    rising[..., 1:] = indices[..., 1:] > indices[..., :-1]
    problems = (  # (bad entry [B, H, Q_tiles, K], what is wrong with its row), checked in this order
        ((counts < 0) | (counts > limit)).unsqueeze(-1) & (slot == 0),
        listed & ((indices < 0) | (indices >= kv_tiles)),
        listed & ~rising,
    )
    bad_rows = torch.stack([p.any(dim=-1) for p in problems]).any(dim=0)
    if not bad_rows.any():
        return
    row = tuple(int(i) for i in bad_rows.nonzero()[0])
    which = next(k for k, p in enumerate(problems) if p[row].any())
    where = f"block lists of (b, h, q_tile) = {row}"
    if which == 0:
        raise ValueError(f"kv_num_blocks: {where}: count {int(counts[row])} is outside [0, {limit}] "
                         f"(min(K_tiles = {indices.shape[-1]}, ceil(seqlen_k/128) = {kv_tiles}))")
    slot_at = int(problems[which][row].nonzero()[0])
    if which == 1:
        raise ValueError(f"kv_indices: {where}: entry {slot_at} is {int(indices[row][slot_at])}, outside "
                         f"[0, ceil(seqlen_k/128) = {kv_tiles})")
    raise ValueError(f"kv_indices: {where}: the listed indices are not strictly ascending (entry {slot_at - 1} is "
                     f"{int(indices[row][slot_at - 1])}, entry {slot_at} is {int(indices[row][slot_at])})")
