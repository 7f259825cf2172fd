"""Which attention calls of a framework go to openvc: the one dispatch policy of every integration.

:func:`choose_path` looks at a call's tensors and options (never at tensor values: no device-to-host read, no
synchronization) and answers ``(OPENVC, "")`` (with the default format) when :func:`open_vc_attn.attention` computes
exactly this call (with ``key_padding_mask=attn_mask, causal=causal``; a BlockMask attn_mask as
``block_mask=attn_mask``, block-level: below), or ``(FALLBACK, reason)`` when the framework's own attention should
run it. openvc's fast path is the sm_90a kernel: head dim 128 or 64, equal head counts or grouped-query attention
(GQA / MQA: key/value heads Hk dividing the query heads H, e.g. diffusers' ``enable_gqa=True`` calls, Cosmos 3's 32
query / 8 key-value heads), BF16/FP16 CUDA tensors on a compute capability 9.0 device, unmasked or with a key
padding mask (bool, or additive 0 / <= -1000, shaped [B, Sk], [B, 1, Sk] or [B, 1, 1, Sk]: text padding of joint
attention), causal self-attention (Sq == Sk, where the framework's top-left causal mask is openvc's), or a torch
FlexAttention ``BlockMask`` as ``attn_mask`` (BLOCK_SIZE 128, built for the call's (Sq, Sk): openvc's
``block_mask=``, which attends its partial and full blocks whole; :func:`block_mask_reason`). Per-query or per-head
masks, biases and dropout stay on the framework. Short calls and cross-attention to a few keys (text or image
tokens) stay there too: quantization and the fixed per-call cost do not pay, and those calls are a small part of a
video model's time. This function is the one place that changes.

The policy also carries the formats of openvc's calls (``qk_format``, ``k_smoothing``, ``p_format``,
``v_bias_correction``): every integration passes them to each :func:`open_vc_attn.attention` call it makes, and
reports them as the reason of its openvc calls (``(OPENVC, "qk_format=int8, k_smoothing, p_format=exp2")``; "" for
the defaults), so the integrations' ``stats()`` show the format. ``qk_format="auto"`` leaves the format to each
attention module's first openvc call (:mod:`._auto_format`: the fastest format whose error on a sample of rows is
within ``auto_tolerance``, else the framework's attention); :func:`choose_path` then answers
``(OPENVC, "qk_format=auto")`` and the integration replaces the label with the module's choice.

Imports nothing heavy: the arguments are duck-typed tensors, torch is imported only for the capability
query of CUDA devices.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from .. import _block_sparse
from .. import _checks
from .._layout import QUANT_BLOCK   # openvc's query tile and key block: a BlockMask's BLOCK_SIZE

__all__ = ["OPENVC", "FALLBACK", "AUTO", "DispatchPolicy", "DEFAULT_POLICY", "choose_path", "choose_varlen_path",
           "block_mask_reason", "device_reason"]

OPENVC = "openvc"
FALLBACK = "fallback"
AUTO = "auto"               # qk_format of a policy that lets each module's first call choose (_auto_format)

# The measurement DispatchPolicy's defaults come from (repository path; a test checks the two agree).
CROSSOVER_RECORD = "bench/results/2026-12-04-h200-seventeenth/dispatch_floor.json"

_DTYPES = ("torch.bfloat16", "torch.float16")
_MASK_DTYPES = ("torch.bool", "torch.bfloat16", "torch.float16", "torch.float32")


@dataclasses.dataclass(frozen=True)
class DispatchPolicy:
    """Thresholds of :func:`choose_path`.

    min_query_tokens / min_key_tokens: calls with fewer query tokens or fewer keys (per sequence) go to the
    framework. The defaults are the measured crossover against torch SDPA in BF16 on an H200 (D = 128, eager
    calls as a framework makes them; `scripts/device/check.sh dispatch-floor`, record
    bench/results/2026-12-04-h200-seventeenth/dispatch_floor.json): over the (Sq, Sk) grid from 256 to
    65,536 at 12, 24 and 40 heads, every call with at least 4,096 queries and 4,096 keys ran faster on
    openvc (self-attention at 4,096 tokens: 1.33x / 1.33x / 1.40x at 12 / 24 / 40 heads; 2,048: 0.52-0.72x),
    the rectangle that holds the most of the grid's work (94%). Below, quantization and openvc's fixed
    per-call host cost (0.13 ms eager in that run, SDPA's 0.04 ms) do not pay. Text cross-attention (Wan: 512
    text tokens, 257 image tokens) stays on the framework: at 512 keys openvc wins from 32,768 queries at 24
    and 40 heads (1.01-1.06x), at 12 heads only at parity at 65,536 queries (0.89-0.93x at 16,384 and 32,768),
    and those calls are about 1% of a video model's attention work.
    head_dims: head dims openvc takes (the fast path: 128 and 64).
    qk_format, k_smoothing: passed to every openvc call (:func:`open_vc_attn.attention`'s arguments): "e4m3"
    (default) or "int8" Q/K codes, and K smoothing (False by default). Checked here: ValueError naming
    qk_format for anything but the two strings, TypeError naming k_smoothing for a non-bool. With "int8",
    calls past the fast path's size range (which INT8 does not take) go to the framework.
    p_format: P's code in every openvc call (:func:`open_vc_attn.attention`'s argument): "expcast" (default) or
    "exp2" (the E4M3 rounding of the exponential, more accurate), which needs qk_format "int8": ValueError naming
    p_format otherwise, or for anything but the two strings.
    v_bias_correction (default False): every openvc call adds V's mean E4M3 rounding error back per channel
    (:func:`open_vc_attn.attention`'s argument; docs/numerics.md section 4, "V rounding bias"). qk_format "int8"
    only (ValueError naming v_bias_correction otherwise; TypeError for a non-bool); a BlockMask call goes to the
    framework (block lists do not take it). It costs about 0.1% of the call at S = 32,760 and a few % at
    S = 4,096; rel L2 on N(0,1) inputs 3.79% -> 3.42% with INT8 + K smoothing + exp2 P, below SageAttention2's
    3.77% (H100, bench/results/2026-12-05-h100-thirtieth/): the most accurate mode.
    qk_format="auto": each attention module's first openvc call runs the candidate formats, fastest first
    (E4M3; INT8 + K smoothing; INT8 + K smoothing + exp2 P; the same with the V bias correction; the same where
    the call returns its LSE, which attention() gives for the keys as given with K smoothing), measures each
    one's rel L2 against exact FP32 attention on 256 sampled query rows, and keeps the first within
    auto_tolerance for that module's calls, or sends them to the framework's attention when none is
    (:mod:`open_vc_attn.integrations._auto_format`; docs/integrations/diffusers.md). k_smoothing, p_format and
    v_bias_correction are then part of the choice: ValueError naming them unless they keep their defaults.
    auto_tolerance (default 0.05): the largest rel L2 of the sampled rows a format may have; a finite
    real > 0, else ValueError naming it. Why 0.05: SageAttention2, the quantized attention video users pick
    for quality, measured 3.73-5.75% on issue 25's five inputs (docs/performance.md, fourth session), so
    0.05 accepts a format whose error on the module's own rows is at that level. On the measured inputs
    E4M3 passes on video-like ones (2.20%) and fails on sharp ones (13-21%), where INT8 + K smoothing
    (3.80-5.36%) passes on most; flat N(0,1) rows take INT8 (E4M3 5.52%, INT8 + smoothing 4.11%). Read only
    with qk_format="auto".
    """
    min_query_tokens: int = 4096
    min_key_tokens: int = 4096
    head_dims: tuple = (128, 64)
    qk_format: str = "e4m3"
    k_smoothing: bool = False
    p_format: str = "expcast"
    auto_tolerance: float = 0.05
    v_bias_correction: bool = False   # last, so that positional arguments of earlier fields keep their place

    def __post_init__(self):
        _checks.k_smoothing(self.k_smoothing)
        if self.qk_format == AUTO:
            _checks.p_format(self.p_format)
            _checks.v_bias_correction(self.v_bias_correction)
            for name, default in (("k_smoothing", False), ("p_format", "expcast"), ("v_bias_correction", False)):
                if getattr(self, name) != default:
                    raise ValueError(f"{name}: qk_format='auto' chooses it with the format (got {name}="
                                     f"{getattr(self, name)!r}); leave it at {default!r}, or pass a fixed qk_format")
        else:
            try:
                _checks.qk_format(self.qk_format)
            except ValueError as exc:
                raise ValueError(f"{exc} (or 'auto': chosen per module, auto_tolerance)") from None
            _checks.p_format(self.p_format, self.qk_format)
            _checks.v_bias_correction(self.v_bias_correction, self.qk_format)
        tol = self.auto_tolerance
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not math.isfinite(tol) or tol <= 0:
            raise ValueError(f"auto_tolerance: expected a finite real > 0 (the largest rel L2 against exact "
                             f"attention a format may have on the sampled rows, e.g. 0.05), got {tol!r}")
        for name in ("min_query_tokens", "min_key_tokens"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if not self.head_dims or any(d not in (64, 128) for d in self.head_dims):
            raise ValueError(f"head_dims: expected a non-empty tuple of 64 and/or 128, got {self.head_dims!r}")

    @property
    def format_label(self) -> str:
        """The reason choose_path gives with OPENVC: "" for E4M3 without K smoothing with ExpCast P (the
        defaults), else "qk_format=int8", "qk_format=int8, k_smoothing", "qk_format=e4m3, k_smoothing", with
        ", p_format=exp2" appended when p_format is not the default and ", v_bias_correction" when it is on;
        "qk_format=auto" for an auto policy (the integrations replace it with the module's choice)."""
        if self.qk_format == "e4m3" and not self.k_smoothing and self.p_format == "expcast":
            return ""   # v_bias_correction is int8-only (__post_init__)
        if self.qk_format == AUTO:
            return "qk_format=auto"
        return (f"qk_format={self.qk_format}" + (", k_smoothing" if self.k_smoothing else "")
                + (f", p_format={self.p_format}" if self.p_format != "expcast" else "")
                + (", v_bias_correction" if self.v_bias_correction else ""))

    def openvc_kwargs(self) -> dict:
        """The format arguments of :func:`open_vc_attn.attention` (what the integrations pass). An auto
        policy has none until a module chose (ValueError)."""
        if self.qk_format == AUTO:
            raise ValueError("qk_format: 'auto' is chosen per module on its first call (integrations._auto_format); "
                             "it has no fixed format arguments")
        return {"qk_format": self.qk_format, "k_smoothing": self.k_smoothing, "p_format": self.p_format,
                "v_bias_correction": self.v_bias_correction}


DEFAULT_POLICY = DispatchPolicy()

_capability_cache = {}


def _device_reason(device):
    """None when ``device`` can run openvc's kernels, else why not. The capability is a host-side query,
    cached per device index (no synchronization)."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    index = device.index
    if index is None:
        import torch
        index = torch.cuda.current_device()
    if index not in _capability_cache:
        import torch
        _capability_cache[index] = tuple(torch.cuda.get_device_capability(index))
    cap = _capability_cache[index]
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the fast path needs 9.0, sm_90a)"
    return None


def device_reason(device):
    """None when ``device`` can run openvc's kernels, else why not (for the integrations' other kernels, such as
    the replaced processors' rotary embedding; the same cached query as the attention calls' policy)."""
    return _device_reason(device)


def _layout_ok(x) -> bool:
    """What openvc accepts without a copy: head dim contiguous, other strides multiples of 8 elements,
    data 16-byte aligned (checked as the storage offset; torch's allocations are aligned)."""
    strides = x.stride()
    if x.shape[3] > 1 and strides[3] != 1:
        return False
    if any(x.shape[i] > 1 and strides[i] % 8 for i in range(3)):
        return False
    return x.storage_offset() % 8 == 0


def _key_mask_reason(mask, q, k):
    """None when ``mask`` is a key padding mask openvc takes (its shape and dtype only: values are never
    read), else why not."""
    shape = tuple(mask.shape)
    b, sk = q.shape[0], k.shape[1]
    if len(shape) == 4 and shape[1] != 1:
        return "attn_mask per head"
    if len(shape) >= 3 and shape[-2] != 1:
        return "attn_mask per query (not a key padding mask)"
    if len(shape) not in (2, 3, 4) or shape[0] != b or shape[-1] != sk:
        return f"attn_mask shape {shape} (takes key padding masks [B, Sk], [B, 1, Sk], [B, 1, 1, Sk])"
    if str(mask.dtype) not in _MASK_DTYPES:
        return f"attn_mask dtype {mask.dtype} (takes bool or an additive float mask)"
    if mask.device != q.device:
        return "attn_mask device"
    return None


def block_mask_reason(mask, q, k, *, causal=False, policy=None):
    """None when openvc's ``block_mask=`` takes the FlexAttention BlockMask ``mask`` for a call of q [B, Sq, H, D]
    and k [B, Sk, H, D] (its attributes only: no tensor value is read), else why not. The rest of the call
    (head dim, thresholds, device, ...) is :func:`choose_path`'s."""
    size = mask.BLOCK_SIZE
    size = tuple(int(x) for x in size) if isinstance(size, (tuple, list)) else (int(size),) * 2
    if size != (QUANT_BLOCK, QUANT_BLOCK):
        return f"block_mask BLOCK_SIZE {size} (takes (128, 128): openvc's query tile and key block)"
    if causal:
        return "block_mask with causal"
    b, sq, h, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    lengths = tuple(int(x) for x in getattr(mask, "seq_lengths", ()))
    if lengths != (sq, sk):
        return f"block_mask built for (Q_LEN, KV_LEN) = {lengths}, the call has ({sq}, {sk})"
    pairs = [(mask.kv_num_blocks, mask.kv_indices)]
    if getattr(mask, "full_kv_num_blocks", None) is not None:
        pairs.append((mask.full_kv_num_blocks, mask.full_kv_indices))
    for counts, indices in pairs:
        if counts.dim() != 3 or indices.dim() != 4 or counts.shape[2] != -(-sq // QUANT_BLOCK):
            return f"block_mask block tensors {tuple(counts.shape)}, {tuple(indices.shape)} (takes [B, H, Q_tiles])"
        if counts.shape[0] not in (1, b) or counts.shape[1] not in (1, h):
            return f"block_mask batch and heads {tuple(counts.shape[:2])} (takes 1 or the call's {b} and {h})"
        if counts.device != q.device or indices.device != q.device:
            return "block_mask device"
    policy = DEFAULT_POLICY if policy is None else policy
    if policy.p_format == "exp2":
        return "block_mask with p_format='exp2'"
    if policy.v_bias_correction:
        return "block_mask with v_bias_correction"
    if not _checks.fast_path_range(sq, sk):   # block lists run on the sm_90a fast path only
        return "block_mask past the fast path's size range (ceil(Sq/128) * ceil(Sk/128) * 128 >= 2^32)"
    return None


def choose_path(q, k, v, *, attn_mask=None, causal=False, dropout_p=0.0, policy=None):
    """``(OPENVC, policy.format_label)`` when openvc should run this attention call (``(OPENVC, "")`` with
    the default E4M3 policy), else ``(FALLBACK, reason)``.

    q: [B, Sq, H, D], k and v: [B, Sk, Hk, D] (the layout of diffusers' dispatch and of SGLang's attention
    backends); Hk == H, or Hk dividing H (GQA / MQA, openvc's ``attention`` on k and v as given). attn_mask, causal
    and dropout_p are the call's options as the framework gives them. A FlexAttention BlockMask as attn_mask
    (duck-typed) is taken as openvc's ``block_mask=`` where :func:`block_mask_reason` finds none (the caller passes
    it so, not as a key padding mask).
    """
    policy = DEFAULT_POLICY if policy is None else policy
    return _choose(q, k, v, attn_mask, causal, dropout_p, policy, None)


def _choose(q, k, v, attn_mask, causal, dropout_p, policy, lengths):
    """choose_path; lengths: (Sq, Sk) per sequence for the INT8 range rule, None: q's and k's."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return FALLBACK, "rank: expected [B, S, H, D] tensors"
    if str(q.dtype) not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return FALLBACK, f"dtype {q.dtype}/{k.dtype}/{v.dtype} (needs one of bfloat16, float16)"
    if attn_mask is not None and _block_sparse.is_block_mask(attn_mask):
        reason = block_mask_reason(attn_mask, q, k, causal=causal, policy=policy)
        if reason:
            return FALLBACK, reason
    elif attn_mask is not None:
        reason = _key_mask_reason(attn_mask, q, k)
        if reason:
            return FALLBACK, reason
        if causal:
            return FALLBACK, "attn_mask with causal"
    if causal and q.shape[1] != k.shape[1]:
        return FALLBACK, "causal with Sq != Sk (the framework's causal mask is top-left aligned)"
    if dropout_p:
        return FALLBACK, "dropout"
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return FALLBACK, "requires_grad (openvc is inference-only)"
    d = q.shape[3]
    if d not in policy.head_dims or k.shape[3] != d or v.shape[3] != d:
        return FALLBACK, f"head_dim {d}/{k.shape[3]}/{v.shape[3]} (takes {policy.head_dims})"
    h, hk = q.shape[2], k.shape[2]
    if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3]:
        return FALLBACK, "shape mismatch"
    if hk != h and (hk < 1 or h % hk):   # GQA / MQA takes Hk dividing H (query head i attends K/V head i // (H // Hk))
        return FALLBACK, f"gqa: {hk} key/value heads do not divide {h} query heads"
    if q.shape[1] < policy.min_query_tokens:
        return FALLBACK, f"short query ({q.shape[1]} < {policy.min_query_tokens} tokens)"
    if k.shape[1] < policy.min_key_tokens:
        return FALLBACK, f"few keys ({k.shape[1]} < {policy.min_key_tokens})"
    if not (_layout_ok(q) and _layout_ok(k) and _layout_ok(v)):
        return FALLBACK, "layout (strides or alignment)"
    if k.device != q.device or v.device != q.device:
        return FALLBACK, "devices differ"
    sq, sk = lengths if lengths is not None else (q.shape[1], k.shape[1])
    if (policy.qk_format == "int8" or hk != h) and not _checks.fast_path_range(sq, sk):
        what = "int8" if policy.qk_format == "int8" else "gqa"   # both run on the fast path only
        return FALLBACK, f"{what} past the fast path's size range (ceil(Sq/128) * ceil(Sk/128) * 128 >= 2^32)"
    reason = _device_reason(q.device)
    if reason:
        return FALLBACK, reason
    return OPENVC, policy.format_label


def _offsets_reason(name, cu, q):
    if cu is None or cu.dim() != 1 or cu.shape[0] < 2:
        return f"{name}: expected 1-D offsets [N + 1]"
    if str(cu.dtype) != "torch.int32" or not cu.is_contiguous():
        return f"{name}: dtype {cu.dtype} or strides (takes contiguous int32)"
    if cu.device != q.device:
        return f"{name} device"
    return None


def choose_varlen_path(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                       dropout_p=0.0, policy=None):
    """:func:`choose_path` for packed sequences: ``(OPENVC, label)`` when :func:`open_vc_attn.attention` with
    ``cu_seqlens_q/k, max_seqlen_q/k`` (and ``causal``) computes the call, else ``(FALLBACK, reason)``.

    q: [total_q, H, D], k and v: [total_k, Hk, D]; cu_seqlens_q/k: int32 offsets [N + 1] on q's device;
    max_seqlen_q/k: Python ints, the longest sequence (or an upper bound). The token thresholds apply per
    sequence, to max_seqlen_q / max_seqlen_k (the offsets are never read: no synchronization), so packed
    short windows (vision encoders, windowed attention) stay on the framework. Causal is taken only when
    queries and keys share one offsets tensor (self-attention: equal lengths per sequence, where the
    framework's top-left causal mask is openvc's end-aligned one). The rest is :func:`choose_path`'s.
    """
    policy = DEFAULT_POLICY if policy is None else policy
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return FALLBACK, "rank: expected packed [T, H, D] tensors"
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        reason = _offsets_reason(name, cu, q)
        if reason:
            return FALLBACK, reason
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        return FALLBACK, "cu_seqlens_q and cu_seqlens_k count different sequences"
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m < 2 ** 31:
            return FALLBACK, f"{name} {m!r} (takes a Python int >= 1)"
    if causal and cu_seqlens_q is not cu_seqlens_k:
        return FALLBACK, "causal with separate query and key offsets"
    if max_seqlen_q < policy.min_query_tokens:
        return FALLBACK, f"short sequences (max_seqlen_q {max_seqlen_q} < {policy.min_query_tokens})"
    if max_seqlen_k < policy.min_key_tokens:
        return FALLBACK, f"few keys per sequence (max_seqlen_k {max_seqlen_k} < {policy.min_key_tokens})"
    # every other rule is choose_path's, on the packed tokens as one batch entry (a view, no copy); its
    # token thresholds were applied per sequence above, and its causal rule (Sq == Sk) per sequence too
    # (shared offsets), so it sees causal only where the totals agree (they may not: rows past cu[N])
    per_token = dataclasses.replace(policy, min_query_tokens=1, min_key_tokens=1)
    return _choose(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, causal and q.shape[0] == k.shape[0],
                   dropout_p, per_token, (max_seqlen_q, max_seqlen_k))
