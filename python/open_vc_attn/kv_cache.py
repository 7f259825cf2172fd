"""An FP8 key/value cache for chunk-by-chunk video generation (docs/block_sparse.md, "KV cache").

Autoregressive and diffusion-forcing video models (Self-Forcing, CausVid, MAGI-1, SkyReels-V2) generate a
video chunk by chunk: while a chunk denoises, the keys and values of the chunks before it are fixed. An
:class:`FP8KVCache` quantizes them once, when they are appended, and keeps them in the fast path's FP8
layouts (half the memory of a BF16 cache); each denoising step then prepares only its queries and the
current chunk's keys and values, and attends the cache and the chunk in one kernel call.

Each appended piece keeps its own scales: K per 128-key block (as always) and V per piece, which the kernel
applies per 128-key block (``attention_fp8`` with a rank-3 ``v_descale``, C++
``AttentionParams::v_descale_per_block``; docs/numerics.md section 4). Pieces start at multiples of 128 keys:
``append`` quantizes whole 128-key blocks only and keeps the remainder (fewer than 128 tokens) in BF16/FP16,
re-quantized with the next call's keys, so nothing quantized is ever quantized again.

    cache = FP8KVCache(batch=1, heads=12, head_dim=128, capacity=21 * 1560, device="cuda")
    for chunk in chunks:
        for step in steps:
            q, k, v = ...                              # the chunk's tokens at this step: q [B, n, H, D], k, v [B, n, Hk, D]
            out = cache.attention(q, k, v)             # cached keys, then this chunk's own (all visible)
        cache.append(k_clean, v_clean)                 # the finished chunk's keys and values, once

Every call is enqueued on the current CUDA stream without a host synchronization (the cache's length lives
on the host and in one device int32 per batch entry); a CUDA graph captured around ``attention`` replays
with new q, k and v of the same shapes while the cache does not change. A graph captured before an
``append`` must not be replayed after it: it writes the current chunk where the appended keys now are (and
reads a remainder that no longer exists), so it corrupts the cache; capture again after each append. The cache
is eager Python state (its length): it is not meant to be compiled (torch.compile would break its graph at the
kernel launches and recompile as the length changes); compile the model around it, or capture a CUDA graph.
Head dim 128, E4M3 or INT8 Q/K, ExpCast P; no causal mask inside the call (a chunk sees itself and
everything cached), no K smoothing (each piece's own mean would shift its scores). Grouped-query attention
(GQA / MQA, as MAGI-1's): ``kv_heads`` K/V heads, a divisor of ``heads``; the cache keeps K and V per K/V head
(``heads / kv_heads`` times less memory than repeating them), q has ``heads`` heads and query head h attends K/V
head h // (heads / kv_heads), bit for bit the cache of K and V with each head repeated.
"""
from __future__ import annotations

import numbers

from . import _checks
from ._layout import QUANT_BLOCK

__all__ = ["FP8KVCache"]


def _blocks(n: int) -> int:
    return -(-n // QUANT_BLOCK)


class FP8KVCache:
    """Keys and values of earlier chunks in FP8, for :meth:`attention` with the current chunk.

    batch, heads, head_dim: the attention's B, H (query heads) and D (head_dim 128). capacity: the most tokens
    per batch entry that the cache and one call's current keys hold together (memory: about 2 bytes per token,
    K/V head and channel, plus the scales). kv_heads: the K/V head count (GQA / MQA), a divisor of heads; None:
    heads. qk_format: "e4m3" or "int8" (the preparation's Q/K format). Buffers are allocated once, on
    ``device``.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, capacity: int, *, device=None, qk_format="e4m3",
                 kv_heads=None):
        torch = _checks.import_torch()
        kv_heads = heads if kv_heads is None else kv_heads
        for name, x in (("batch", batch), ("heads", heads), ("head_dim", head_dim), ("capacity", capacity),
                        ("kv_heads", kv_heads)):
            if not isinstance(x, numbers.Integral) or isinstance(x, bool):
                raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
            if x < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {x!r}")
        if heads % kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads = {heads} (GQA/MQA: query head h attends K/V "
                             f"head h // (heads // kv_heads)), got {kv_heads}")
        if head_dim != 128:
            raise ValueError(f"head_dim: the FP8 KV cache takes 128 (the fast path's V block descales), "
                             f"got {head_dim!r}")
        self.qk_format = _checks.qk_format(qk_format)
        self.batch, self.heads, self.head_dim, self.capacity = int(batch), int(heads), int(head_dim), int(capacity)
        self.kv_heads = int(kv_heads)
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type != "cuda":
            raise ValueError(f"device: the FP8 KV cache lives on a CUDA device, got {self.device}")
        if self.device.index is None:   # tensors report their device's index
            self.device = torch.device("cuda", torch.cuda.current_device())
        nk = _blocks(capacity)
        slots, codes = nk * QUANT_BLOCK, torch.int8 if self.qk_format == "int8" else torch.uint8
        hk = self.kv_heads   # K and V per K/V head
        kd_shape = (batch, hk, nk, 8) if self.qk_format == "int8" else (batch, hk, nk)
        self._k = torch.zeros(batch, slots, hk, head_dim, dtype=codes, device=self.device)
        self._k_descale = torch.zeros(kd_shape, dtype=torch.float32, device=self.device)
        self._v = torch.zeros(batch, hk, head_dim, slots, dtype=torch.uint8, device=self.device)
        self._v_descale = torch.zeros(batch, hk, nk, dtype=torch.float32, device=self.device)
        self._used = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self._committed = 0            # tokens quantized into the cache (a multiple of 128)
        self._tail = None              # (k, v) of the last < 128 appended tokens, not quantized yet

    @property
    def length(self) -> int:
        """Tokens appended so far (quantized ones and the BF16 remainder)."""
        return self._committed + (0 if self._tail is None else int(self._tail[0].shape[1]))

    def memory_bytes(self) -> int:
        """Bytes of the cache's device buffers (the BF16 remainder included)."""
        bufs = [self._k, self._k_descale, self._v, self._v_descale, self._used]
        if self._tail is not None:
            bufs += list(self._tail)
        return sum(x.numel() * x.element_size() for x in bufs)

    def reset(self) -> None:
        """Forgets every appended token (the buffers stay allocated)."""
        self._committed, self._tail = 0, None

    def _check_tokens(self, name, x, n_name):
        """x: [B, n, H, D] (q) or [B, n, Hk, D] (k, v) BF16 or FP16 on the cache's device (checked here, so that
        errors name x, not the preparation's q, k or v that it becomes)."""
        torch = _checks.import_torch()
        grouped_kv = name != "q" and self.kv_heads != self.heads
        heads, h_name = (self.kv_heads, "Hk") if grouped_kv else (self.heads, "H")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor [B, {n_name}, {h_name}, D], got {type(x).__name__}")
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got {x.dtype}")
        want = (self.batch, heads, self.head_dim)
        if x.dim() != 4 or (x.shape[0], x.shape[2], x.shape[3]) != want:
            raise ValueError(f"{name}: expected shape [B={want[0]}, {n_name}, {h_name}={want[1]}, D={want[2]}] (the "
                             f"cache's), got {tuple(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{name}: expected a tensor on the cache's device {self.device}, got {x.device}")
        if x.requires_grad:
            raise ValueError(f"{name}: requires_grad=True is not supported: openvc is inference-only")

    def _chunk(self, k, v):
        """The checked current keys k, v, or None when absent or empty (capacity counted with the remainder)."""
        if k is None and v is None:
            return None
        if k is None or v is None:
            raise ValueError(f"{'k' if k is None else 'v'}: k and v come together (both tensors or both None)")
        self._check_tokens("k", k, "n")
        self._check_tokens("v", v, "n")
        if v.shape != k.shape or v.dtype != k.dtype:
            raise ValueError(f"v: expected k's shape {tuple(k.shape)} and dtype {k.dtype}, "
                             f"got {tuple(v.shape)}, {v.dtype}")
        if k.shape[1] == 0:   # an empty chunk: nothing to add
            return None
        if self.length + k.shape[1] > self.capacity:
            raise ValueError(f"k: {self.length} cached tokens and {k.shape[1]} more exceed the cache's capacity of "
                             f"{self.capacity}")
        if self._tail is not None and self._tail[0].dtype != k.dtype:
            raise TypeError(f"k: expected the dtype of the keys appended before ({self._tail[0].dtype}), got {k.dtype}")
        return k, v

    def _write(self, q, k, v, prefix=None):
        """Prepares q with the keys prefix (the remainder, or None) followed by k, v, as one sequence, writing
        the keys' codes and scales straight into the cache from its end (its first uncommitted slot, a multiple
        of 128): no concatenation, no copy. Returns q's codes and descales. _chunk checked the capacity, so the
        call's blocks end within the buffers."""
        from .ops import direct, fp8
        t0, b0, slots = self._committed, self._committed // QUANT_BLOCK, int(self._k.shape[1])
        slot_views = (self._k[:, t0], self._k_descale[:, :, b0], self._v[:, :, :, t0], self._v_descale[:, :, b0])
        layout = dict(k_codes_rows=slots, k_descale_blocks=slots // QUANT_BLOCK, v_packed_columns=slots,
                      v_descale_per_block=True)
        with direct.named("open_vc_attn::prepare_fp8"):   # the preparation's profiler range, as for the op
            return fp8.prepare_into_slots(q, k, v, self.qk_format, slot_views, layout, kv_prefix=prefix)

    def append(self, k, v) -> None:
        """Appends the keys and values k, v [B, n, Hk, D] (BF16 or FP16, on the cache's device): the remainder
        kept from earlier calls followed by k, v is quantized in whole 128-key blocks, once, with its own scales;
        its last (remainder + n) mod 128 tokens stay in k's dtype until the next append."""
        if k is None or v is None:
            raise ValueError(f"{'k' if k is None else 'v'}: append needs the keys and values to add, got None")
        chunk = self._chunk(k, v)
        if chunk is None:   # an empty chunk
            return
        torch = _checks.import_torch()
        kk, vv = chunk if self._tail is None else (torch.cat([t, x], dim=1) for t, x in zip(self._tail, chunk))
        full = (int(kk.shape[1]) // QUANT_BLOCK) * QUANT_BLOCK
        if full > 0:
            self._write(kk[:, :1], kk[:, :full], vv[:, :full])   # one query row: only the keys are kept
            self._committed += full
        # contiguous copies: the remainder is the next preparation's leading part (16-byte aligned rows)
        self._tail = tuple(x[:, full:].clone(memory_format=torch.contiguous_format) for x in (kk, vv)) \
            if kk.shape[1] > full else None

    def attention(self, q, k=None, v=None, *, softmax_scale=None, return_lse=False, out_dtype=None,
                  mid_window_blocks=None):
        """Attention of q [B, Sq, H, D] over the cached keys, the remainder and k, v [B, n, Hk, D] (the
        current chunk's, not stored; optional), every key visible to every query. Returns out [B, Sq, H, D]
        (BF16, or out_dtype), with return_lse (out, lse float32 [B, H, Sq]). softmax_scale None: 1/sqrt(D);
        mid_window_blocks None: natural order (the cache's keys need not line up with q's positions)."""
        from . import ops
        from .api import prepare_fp8
        self._check_tokens("q", q, "Sq")
        scale, want_lse = _checks.softmax_scale(softmax_scale), _checks.return_lse(return_lse)
        mid = _checks.mid_window(mid_window_blocks)
        chunk = self._chunk(k, v)
        total = self.length + (0 if chunk is None else int(chunk[0].shape[1]))
        if chunk is not None:   # the remainder (if any) and the chunk, prepared as one sequence
            q_codes, q_descale = self._write(q, *chunk, prefix=self._tail)
        elif self._tail is not None:
            q_codes, q_descale = self._write(q, *self._tail)
        elif self._committed > 0:
            prep = prepare_fp8(q, q[:, :1], q[:, :1], qk_format=self.qk_format)   # q's codes only
            q_codes, q_descale = prep.q_codes, prep.q_descale
        else:
            raise ValueError("k: the cache is empty and no keys were given")
        self._used.fill_(total)   # a device fill on the stream: no synchronization
        tensors = (q_codes, q_descale, self._k, self._k_descale, self._v, self._v_descale)
        out, lse = ops.direct.run(ops.attention_fp8_op, ops.fp8.attention_cuda, (*tensors, None, None, self._used),
                                  *tensors, None, None, 0, 0, scale, False, mid, want_lse, self._used, out_dtype,
                                  self.qk_format, "expcast")
        return (out, lse) if want_lse else out
