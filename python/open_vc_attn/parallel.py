"""Sequence parallelism for openvc attention (docs/integrations/ulysses.md).

- :func:`ulysses_attention`: DeepSpeed-Ulysses attention over a ``torch.distributed`` group. Each rank holds
  a sequence shard ``[B, S/N, H, D]``; an all-to-all gives every rank the whole sequence for H/N heads,
  openvc attends those heads, and the reverse all-to-all returns ``[B, S/N, H, D]``. With
  ``fp8_all_to_all=True`` the inputs are quantized before the all-to-all (half the bytes) into exactly the
  codes and descales that :func:`open_vc_attn.prepare_fp8` gives on one GPU.
- :func:`attention_with_lse` and :func:`merge_attention_states`: the pieces of a ring-attention style
  merge of partial attentions over disjoint key sets (the merge is plain torch and runs on CPU).

torch is imported inside the functions only: ``import open_vc_attn.parallel`` does not import torch.

Exactness (why ``ulysses_attention`` equals ``open_vc_attn.attention`` on the gathered inputs, bit for bit):
the all-to-alls move bytes without arithmetic; openvc computes each (batch, head) independently of the
others and of the input strides, so attending H/N heads of the full sequence gives those heads' bytes of
the single-GPU call. In the FP8 path, Q/K descales are per 128-token block (INT8: Q per row, K per 16-key
group of a 128-key block), so a shard whose length is a multiple of 128 quantizes to the same groups; the
V scale is one per (sequence, head), computed from the exact MAX all-reduce of the shards' amax, with the
same FP32 arithmetic as the prepare kernel
(``448 / amax`` and ``amax / 448`` correctly rounded, one FP32 multiply, E4M3 round-to-nearest-even with
saturation to +-448, NaN -> 0x7F).
"""
from __future__ import annotations

import contextlib

from . import _checks, _gqa, api
from ._layout import DEFAULT_MID_WINDOW_BLOCKS, FAST_HEAD_DIMS, PACKED_KEY_ORDER, QUANT_BLOCK

__all__ = ["ulysses_attention", "attention_with_lse", "merge_attention_states"]

E4M3_MAX = 448.0


_torch = _checks.import_torch


def _dist():
    import torch.distributed as dist
    return dist


# ---- argument checks (before any collective: every rank fails the same way, nothing hangs) ------------

def _check_args(q, k, v, world_size, fp8_all_to_all):
    """Checks ulysses_attention's tensors for a group of world_size ranks; returns rank-4 views of q, k, v
    and q's rank. Shape checks come first and the device last (as in _checks.check_tokens), so that everything
    but the device can be exercised with CPU tensors."""
    _checks.require_tensors(q, k, v)
    rank = q.dim()
    if rank not in (3, 4):
        raise ValueError(f"q: expected this rank's sequence shard [B, S/N, H, D] or [S/N, H, D], got shape "
                         f"{_checks.shape_of(q)}")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != rank:
            raise ValueError(f"{name}: expected rank {rank} like q, got shape {_checks.shape_of(x)}")
    q4, k4, v4 = (x.unsqueeze(0) if rank == 3 else x for x in (q, k, v))
    if v4.shape != k4.shape:
        raise ValueError(f"v: expected the shape of k {_checks.shape_of(k)}, got {_checks.shape_of(v)}")
    if k4.shape[0] != q4.shape[0] or k4.shape[3] != q4.shape[3]:
        raise ValueError(f"k: expected the batch and head_dim of q {_checks.shape_of(q)}, "
                         f"got {_checks.shape_of(k)}")
    heads, kv_heads = int(q4.shape[2]), int(k4.shape[2])
    _gqa.check_heads(heads, kv_heads, "k", _checks.shape_of(k))   # Hk = H, or a divisor of H (GQA / MQA)
    if heads % world_size != 0:
        raise ValueError(f"q: the head count H = {heads} must be divisible by the world size N = {world_size} of "
                         f"group (Ulysses gives each rank H/N whole heads), got shape {_checks.shape_of(q)}")
    if kv_heads % world_size != 0:
        raise ValueError(f"k: the K/V head count Hk = {kv_heads} must be divisible by the world size N = {world_size} "
                         f"of group (GQA / MQA: each rank takes Hk/N whole K/V heads, those of its H/N query heads), "
                         f"got shape {_checks.shape_of(k)}; repeat k and v's heads to a multiple of N "
                         f"(k.repeat_interleave(r, dim=-2) with r dividing H / Hk)")
    if fp8_all_to_all:
        for name, x in (("q", q4), ("k", k4)):
            if x.shape[1] % QUANT_BLOCK != 0:
                raise ValueError(
                    f"fp8_all_to_all: needs every rank's sequence shard to be a multiple of {QUANT_BLOCK} "
                    f"tokens (Q/K descales are per {QUANT_BLOCK}-token block of the full sequence), got "
                    f"{name} shard length S/N = {x.shape[1]} ({name} shape {_checks.shape_of(x)}); pad the sequence "
                    f"to a multiple of {QUANT_BLOCK * world_size} tokens, or use fp8_all_to_all=False")
    # dtype, empty dims, head dim 128 or 64, requires_grad, strides, device (last)
    _checks.check_tokens(q4, k4, v4, head_dims=FAST_HEAD_DIMS, caller="attention", gqa=True)
    return q4, k4, v4, rank


def _group_info(group):
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized: call torch.distributed."
                           "init_process_group (e.g. under torchrun) before ulysses_attention")
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if me < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return world, me


# ---- all-to-all layouts ---------------------------------------------------------------------------------

def _all_to_all(send, group):
    torch, dist = _torch(), _dist()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)   # contiguous buffers, current stream, dim 0 = ranks
    return recv


def _seq_to_heads(x, world, group):
    """[B, S/N, H, D] shard -> [B, S, H/N, D]: heads rank*H/N .. of the whole sequence, tokens in global
    order (rank 0's shard first). The send buffer is [N, S/N, B, H/N, D], so the received [S, B, H/N, D]
    buffer is returned as a strided view (strides multiples of D: what the kernels accept), no copy."""
    b, sl, h, d = (int(n) for n in x.shape)
    hl = h // world
    send = x.reshape(b, sl, world, hl, d).permute(2, 1, 0, 3, 4).contiguous()
    recv = _all_to_all(send, group)
    return recv.view(world * sl, b, hl, d).permute(1, 0, 2, 3)


def _heads_to_seq(out, world, group):
    """[B, S, H/N, D] (this rank's heads) -> [B, S/N, H, D] (this rank's tokens, all heads), contiguous."""
    b, s, hl, d = (int(n) for n in out.shape)
    sl = s // world
    send = out.reshape(b, world, sl, hl, d).permute(1, 0, 2, 3, 4).contiguous()   # [N, B, S/N, H/N, D]
    recv = _all_to_all(send, group)                                                  # [N (head group), ...]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, sl, world * hl, d)


def _k_descale_to_heads(descale, world, group):
    """K descales -> this rank's heads, blocks in global order: E4M3 [B, H, S/N/128] as _blocks_to_heads;
    INT8 [B, H, S/N/128, 8] (8 key groups per block) as the same exchange of the flattened groups."""
    if descale.dim() == 3:
        return _blocks_to_heads(descale, world, group)
    b, h, nl, g = (int(n) for n in descale.shape)
    return _blocks_to_heads(descale.reshape(b, h, nl * g), world, group).reshape(b, h // world, world * nl, g)


def _blocks_to_heads(descale, world, group):
    """Per-block descales [B, H, S/N/128] -> [B, H/N, S/128] (blocks in global order), contiguous."""
    b, h, nl = (int(n) for n in descale.shape)
    hl = h // world
    send = descale.reshape(b, world, hl, nl).permute(1, 0, 2, 3).contiguous()      # [N, B, H/N, nl]
    recv = _all_to_all(send, group)                                                 # [N (source), B, H/N, nl]
    return recv.permute(1, 2, 0, 3).reshape(b, hl, world * nl)


# ---- FP8 pieces ------------------------------------------------------------------------------------------

def _v_amax(v):
    """max |v| per (batch, head) of a [B, S, H, D] tensor, float32 [B, H]. NaN is skipped (as the prepare
    kernel's max.f16x2 / max.bf16x2 does), infinities are kept. Exact: a max of exact values."""
    torch = _torch()
    a = torch.nan_to_num(v.abs(), nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    return a.amax(dim=(1, 3)).float()


def _v_scales(amax):
    """(scale_inv, descale) of docs/numerics.md section 1: 448/amax (0 for amax 0) and amax/448, each the
    correctly rounded FP32 quotient (float64 division rounded once more to float32 is correctly rounded for
    float32 operands; tensor / tensor, so torch never turns it into a multiply by a reciprocal)."""
    torch = _torch()
    a64 = amax.double()
    c64 = torch.full_like(a64, E4M3_MAX)
    scale_inv = torch.where(a64 > 0, c64 / torch.where(a64 > 0, a64, c64), torch.zeros_like(a64)).float()
    descale = (a64 / c64).float()
    return scale_inv, descale


def _e4m3_codes(x32):
    """float32 -> E4M3 codes (uint8) as in src/common/e4m3.cuh: round to nearest even, saturate to +-448,
    sign kept on underflow, NaN -> 0x7F. torch's float32 -> float8_e4m3fn conversion is RNE, but not
    saturating on every path (c10 maps |x| >= 480 to NaN), hence the clamp first; and its NaN keeps the
    sign, hence the rewrite of 0xFF (no finite input gives low bits 0x7F after the clamp)."""
    torch = _torch()
    codes = x32.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.masked_fill_((codes & 0x7F) == 0x7F, 0x7F)


def _quantize_v(v, amax):
    """V shard [B, S/N, H, D] -> (E4M3 codes uint8 [B, S/N, H, D], descale float32 [B, H]) with the scales of
    the given per-(batch, head) amax: code = E4M3(fl(float(v) * scale_inv)), one FP32 multiply."""
    scale_inv, descale = _v_scales(amax)
    return _e4m3_codes(v.float() * scale_inv[:, None, :, None]), descale


_ORDER_CACHE = {}


def _packed_key_order(device):
    torch = _torch()
    key = str(device)
    if key not in _ORDER_CACHE:
        _ORDER_CACHE[key] = torch.tensor(PACKED_KEY_ORDER, dtype=torch.long, device=device)
    return _ORDER_CACHE[key]


def _pack_v(codes):
    """Token-major V codes [B, S, H, D] (uint8, any strides) -> the packed layout of prepare_fp8,
    [B, H, D, ceil(S/128)*128] contiguous: keys contiguous, padding keys 0, packed column c of each 16-key
    group holding key PACKED_KEY_ORDER[c]."""
    torch = _torch()
    b, s, h, d = (int(n) for n in codes.shape)
    s_pad = -(-s // QUANT_BLOCK) * QUANT_BLOCK
    x = codes.permute(0, 2, 3, 1)                           # [B, H, D, S] view
    if s_pad != s:
        x = torch.nn.functional.pad(x, (0, s_pad - s))      # code 0 for the padding keys
    x = x.unflatten(3, (s_pad // 16, 16))
    return x.index_select(4, _packed_key_order(codes.device)).reshape(b, h, d, s_pad)


# ---- Ulysses -----------------------------------------------------------------------------------------------

def _no_timer(name):
    return contextlib.nullcontext()


def _ulysses(q, k, v, group, softmax_scale, mid_window_blocks, return_lse, fp8_all_to_all, timer=None,
             qk_format="e4m3", k_smoothing=False, p_format="expcast"):
    """ulysses_attention; ``timer(name)`` (a context manager, e.g. one recording CUDA events) brackets the
    phases "quantize", "all_to_all", "pack" and "attention" (scripts/device/ulysses_multi_gpu.py)."""
    dist = _dist()
    timer = timer or _no_timer
    scale = _checks.softmax_scale(softmax_scale)   # validated before any collective
    _checks.mid_window(mid_window_blocks)
    _checks.return_lse(return_lse)
    fmt, smooth = _checks.qk_format(qk_format), _checks.k_smoothing(k_smoothing)
    pfmt = _checks.p_format(p_format, fmt)
    if not isinstance(fp8_all_to_all, bool):
        raise TypeError(f"fp8_all_to_all: expected a bool, got {type(fp8_all_to_all).__name__}")
    if fp8_all_to_all and smooth:
        raise ValueError("k_smoothing: not taken with fp8_all_to_all=True (K's channel means span the whole "
                         "sequence, which no rank holds before the all-to-all); use fp8_all_to_all=False")
    world, me = _group_info(group)
    q4, k4, v4, rank = _check_args(q, k, v, world, fp8_all_to_all)
    opts = dict(softmax_scale=None if scale == 0.0 else scale, mid_window_blocks=mid_window_blocks,
                return_lse=return_lse, p_format=pfmt)

    if not fp8_all_to_all:
        with timer("all_to_all"):
            qh, kh, vh = (_seq_to_heads(x, world, group) for x in (q4, k4, v4))
        with timer("attention"):
            res = api.attention(qh, kh, vh, qk_format=fmt, k_smoothing=smooth, **opts)
    else:
        hl = int(k4.shape[2]) // world   # this rank's K/V heads (H/N query heads: the same with equal head counts)
        with timer("quantize"):
            prep = api.prepare_fp8(q4, k4, v4, qk_format=fmt)   # Q/K: the single-GPU groups; its V is unused
            amax = _v_amax(v4)                    # [B, Hk] over this shard
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)   # exact: the whole sequence's amax
            v_codes, v_descale = _quantize_v(v4, amax)
        with timer("all_to_all"):
            qc = _seq_to_heads(prep.q_codes, world, group).contiguous()
            kc = _seq_to_heads(prep.k_codes, world, group).contiguous()
            vc = _seq_to_heads(v_codes, world, group)
            qd = _blocks_to_heads(prep.q_descale, world, group)   # INT8: per row, in token order the same way
            kd = _k_descale_to_heads(prep.k_descale, world, group)
        with timer("pack"):
            v_packed = _pack_v(vc)
            vd = v_descale[:, me * hl:(me + 1) * hl].contiguous()
            prepared = api.PreparedFP8.from_quantized(qc, qd, kc, kd, v_packed, vd, input_rank=4, dtype=q.dtype,
                                                      qk_format=fmt)
        with timer("attention"):
            res = api.attention_fp8(prepared, **opts)
    out, lse = res if return_lse else (res, None)
    with timer("all_to_all"):
        out = _heads_to_seq(out, world, group)
    if rank == 3:
        out, lse = out[0], (lse[0] if return_lse else None)
    return (out, lse) if return_lse else out


def ulysses_attention(q, k, v, *, group=None, softmax_scale=None, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS,
                      return_lse=False, fp8_all_to_all=False, qk_format="e4m3", k_smoothing=False, p_format="expcast"):
    """Ulysses sequence-parallel openvc attention over the ``torch.distributed`` group ``group``
    (None: the default group) of N ranks; every rank of the group must call it with the same shapes.

    q, k, v: this rank's sequence shard, ``[B, S/N, H, D]`` (or ``[S/N, H, D]``), rank r holding global
    tokens ``r*S/N .. (r+1)*S/N - 1``; bfloat16 or float16 CUDA tensors, D = 128 or 64, H divisible by N (else
    ValueError naming q). k and v may have another length than q (cross-attention), same B and D, and Hk heads:
    H, or a divisor of H (GQA / MQA) that N divides too (else ValueError naming k): rank r then gets K/V heads
    ``r*Hk/N .. (r+1)*Hk/N - 1``, exactly the K/V heads of its query heads.

    Steps: all-to-all (``torch.distributed.all_to_all_single`` on contiguous buffers, current stream) from
    ``[B, S/N, H, D]`` to ``[B, S, H/N, D]`` (rank r gets heads ``r*H/N .. (r+1)*H/N - 1``, tokens in global
    order), :func:`open_vc_attn.attention` on those heads, reverse all-to-all. The output equals, bit for
    bit, this rank's token rows of ``open_vc_attn.attention`` on the full inputs (module docstring).

    fp8_all_to_all=True quantizes before the all-to-all (E4M3 codes: half the bytes of BF16/FP16; the
    output all-to-all stays BF16) and gives the same bytes as the single-GPU path: Q and K with
    :func:`open_vc_attn.prepare_fp8` on the shard (their per-block descales travel in their own
    all-to-alls), V with the whole sequence's per-(batch, head) amax (a MAX all-reduce of [B, H] floats)
    and torch ops; V is packed after the all-to-all. Needs every shard length (S/N of q and of k) to be a
    multiple of 128 (else ValueError suggesting fp8_all_to_all=False).

    qk_format, k_smoothing: as for :func:`open_vc_attn.attention` (the default "e4m3", False). Without
    fp8_all_to_all both go to the attention on the gathered heads (exact as above: the K channel means are
    per (sequence, head), over the whole sequence). With fp8_all_to_all=True, qk_format="int8" quantizes
    Q and K to INT8 on the shard (per-row Q descales and per-16-key-group K descales travel in their own
    all-to-alls, the same bytes as on one GPU); k_smoothing=True is not taken there (the channel means span
    the whole sequence): ValueError naming k_smoothing, before any collective. p_format: as for
    :func:`open_vc_attn.attention` ("exp2" needs qk_format="int8"; checked before any collective), passed to the
    attention on the gathered heads either way.

    Returns out, bfloat16 ``[B, S/N, H, D]`` (q's shape), or with return_lse ``(out, lse)`` where lse is
    the float32 natural-log LSE of this rank's heads over the whole query sequence, ``[B, H/N, S]``
    (``[H/N, S]`` for rank-3 inputs), as computed on this rank (no second all-to-all): heads
    ``r*H/N ..`` of ``open_vc_attn.attention(..., return_lse=True)`` on the full inputs.
    """
    return _ulysses(q, k, v, group, softmax_scale, mid_window_blocks, return_lse, fp8_all_to_all,
                    qk_format=qk_format, k_smoothing=k_smoothing, p_format=p_format)


# ---- partial attentions and their merge ------------------------------------------------------------------

def attention_with_lse(q, k, v, *, softmax_scale=None, mid_window_blocks=DEFAULT_MID_WINDOW_BLOCKS,
                       qk_format="e4m3", k_smoothing=False, p_format="expcast"):
    """:func:`open_vc_attn.attention` with ``return_lse=True``: ``(out, lse)``, out bfloat16 in q's shape,
    lse float32 ``[B, H, Sq]`` (``[H, Sq]`` for a rank-3 q), natural log. k, v may be any subset of the keys
    (Sq != Sk is supported); merge partial results with :func:`merge_attention_states`. qk_format and
    k_smoothing as for :func:`open_vc_attn.attention` (K smoothing then uses each part's own key means), and
    p_format too."""
    return api.attention(q, k, v, softmax_scale=softmax_scale, mid_window_blocks=mid_window_blocks,
                          return_lse=True, qk_format=qk_format, k_smoothing=k_smoothing, p_format=p_format)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Merges two attentions of the same queries over disjoint key sets A and B into the attention over
    A and B: with m = max(lse_a, lse_b), w_x = exp(lse_x - m),

        lse = m + log(w_a + w_b)        out = (w_a * out_a + w_b * out_b) / (w_a + w_b)

    in float32. out_a, out_b: ``[B, S, H, D]`` or ``[S, H, D]`` (any float dtype); lse_a, lse_b: float
    ``[B, H, S]`` or ``[H, S]`` (natural log, as :func:`attention_with_lse` returns). Returns
    ``(out, lse)``: out bfloat16 in out_a's shape, lse float32. A row with lse = -inf on one side takes
    the other side (both -inf: out 0, lse -inf). Plain torch: runs on any device, CPU included.

    With openvc outputs the merge is close to, not equal to, one attention over all keys: ExpCast codes
    depend on the running row maximum, which differs between a part and the whole (docs/numerics.md §3).
    """
    torch = _torch()
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if out_a.dim() not in (3, 4):
        raise ValueError(f"out_a: expected [B, S, H, D] or [S, H, D], got shape {_checks.shape_of(out_a)}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b: expected the shape of out_a {_checks.shape_of(out_a)}, got {_checks.shape_of(out_b)}")
    want = (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3])   # [B, H, S] or [H, S]
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"{name}: expected shape {tuple(int(n) for n in want)} ([B, H, S] for out "
                             f"[B, S, H, D]), got {_checks.shape_of(x)}")
    for name, x in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if x.device != out_a.device:
            raise ValueError(f"{name}: expected device {out_a.device} like out_a, got {x.device}")
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # both -inf: weights 0, not NaN
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    den = wa + wb
    lse = m_safe + torch.log(den)
    lse = torch.where(den > 0, lse, torch.full_like(lse, float("-inf")))
    inv = torch.where(den > 0, 1.0 / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))
    ca, cb = (wa * inv).transpose(-1, -2).unsqueeze(-1), (wb * inv).transpose(-1, -2).unsqueeze(-1)   # [.., S, H, 1]
    out = ca * out_a.float() + cb * out_b.float()
    return out.to(torch.bfloat16), lse
