"""yunchang / xDiT integration: openvc as the attention inside yunchang's Ulysses and ring layers
(docs/integrations/yunchang.md).

yunchang's ``LongContextAttention`` (and xDiT's ``xFuserLongContextAttention``, built on it) runs DeepSpeed-
Ulysses' all-to-all and then a ring loop over the key/value shards of the ring group; each ring step calls
one *forward* function on this process's tensors and merges the partial results by their LSE. The layer
takes that function as its ``attn_processor``: yunchang 0.6's ``select_flash_attn_impl`` returns the
processor when the layer's ``attn_type`` is not one of its own ``AttnType`` members. So::

    from yunchang import LongContextAttention
    from open_vc_attn.integrations import yunchang as openvc_yunchang
    attn = LongContextAttention(attn_type=openvc_yunchang.ATTN_TYPE,
                                attn_processor=openvc_yunchang.OpenVCAttnProcessor())
    # or: attn = openvc_yunchang.long_context_attention()

:class:`OpenVCAttnProcessor` is that function: ``(q, k, v, dropout_p, softmax_scale, causal, window_size,
softcap, alibi_slopes, return_softmax) -> (out, lse)`` with q ``[B, Sq, H, D]`` and lse float32
``[B, H, Sq]`` (flash-attn's layout, what yunchang merges). It sends each call that openvc's fast path
takes (:func:`open_vc_attn.integrations.policy.choose_path`) to ``open_vc_attn.attention(...,
return_lse=True)`` and every other call (short, causal cross-attention, other head dims, windows, softcap,
ALiBi) to a fallback that also returns a correct LSE: by default exact FP32 attention in torch
(:mod:`._exact`), or a yunchang forward function of your choice (``fallback=AttnType.FA``).

Only the ``"basic"`` ring implementation passes the processor on (yunchang 0.6.4's zigzag and stripe rings
and its ``UlyssesAttention`` select their own kernels); :func:`check_hook` verifies the selection on the
installed yunchang. Importing this module imports neither torch nor yunchang.
"""
from __future__ import annotations

import collections

from . import _auto_format
from . import _versions
from . import policy as _policy

__all__ = ["ATTN_TYPE", "TESTED_VERSION", "OpenVCAttnProcessor", "check_hook", "long_context_attention",
           "stats", "reset_stats", "reset_auto"]

# Not a yunchang AttnType member: the value that makes yunchang's selection return the attn_processor.
ATTN_TYPE = "openvc"
TESTED_VERSION = "0.6.4"
_SUPPORTED_SERIES = ((0, 6),)
_UNTESTED_ENV = "OPENVC_YUNCHANG_UNTESTED"
# yunchang 0.6.4's forward functions of these types return a zero LSE: wrong as soon as a ring merges.
_ZERO_LSE_TYPES = ("TORCH_MATH", "TORCH_CUDNN")

_counts = collections.Counter()     # (path, reason) -> calls (eager)
_auto = _auto_format.AutoChoices()  # qk_format="auto": per processor (give each layer its own for per-layer choices)


def _fast_attention(q, k, v, scale, causal=False, qk_format="e4m3", k_smoothing=False, p_format="expcast",
                    v_bias_correction=False):
    """openvc's fast path, (out, lse [B, H, Sq]) in the policy's Q/K and P formats and V bias correction (causal:
    self-attention, Sq == Sk, where flash-attn's alignment is openvc's); tests swap it for a CPU stand-in."""
    import open_vc_attn
    return open_vc_attn.attention(q, k, v, softmax_scale=scale, causal=causal, return_lse=True,
                                  qk_format=qk_format, k_smoothing=k_smoothing, p_format=p_format,
                                  v_bias_correction=v_bias_correction)


def _exact_fallback(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, return_softmax=False, **kwargs):
    """Exact attention with its LSE (causal aligned to the last query, as flash-attn)."""
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError(
            f"open_vc_attn yunchang fallback: dropout_p={dropout_p}, window_size={window_size}, softcap={softcap}, "
            f"alibi_slopes={'set' if alibi_slopes is not None else None}: the exact fallback computes plain "
            f"softmax attention only; pass fallback=AttnType.FA (flash-attn) to OpenVCAttnProcessor")
    from . import _exact
    return _exact.attention_with_lse(q, k, v, scale=softmax_scale, causal=causal, causal_from_end=True)


def _yunchang_kernels():
    """yunchang.kernels after a version check (RuntimeError on an untested version unless
    OPENVC_YUNCHANG_UNTESTED=1)."""
    import yunchang
    from yunchang import kernels
    version = getattr(yunchang, "__version__", "unknown")
    message = (f"yunchang {version}: open_vc_attn.integrations.yunchang uses yunchang's attn_processor hook as "
               f"yunchang {TESTED_VERSION} defines it; install it (pip install 'yunchang=={TESTED_VERSION}') or "
               f"set {_UNTESTED_ENV}=1 to try this version (check_hook() still verifies the selection)")
    _versions.gate_untested(_versions.version_tuple(version) in _SUPPORTED_SERIES, message, _UNTESTED_ENV)
    if not callable(getattr(kernels, "select_flash_attn_impl", None)):
        raise RuntimeError(f"yunchang {version}: yunchang.kernels has no select_flash_attn_impl (the hook this "
                           f"module uses); supported: yunchang {TESTED_VERSION}")
    return kernels


def _resolve_fallback(fallback):
    if fallback is None:
        return _exact_fallback
    if callable(fallback):          # (AttnType members are not callable)
        return fallback
    kernels = _yunchang_kernels()
    if isinstance(fallback, kernels.AttnType):
        if fallback.name in _ZERO_LSE_TYPES:
            raise ValueError(f"fallback: yunchang's {fallback} forward returns a zero LSE, which breaks the ring "
                             f"merge; use None (exact), AttnType.FA, FA3, TORCH_FLASH or TORCH_EFFICIENT")
        return kernels.select_flash_attn_impl(fallback, stage="fwd-only")
    raise TypeError(f"fallback: expected None, a yunchang AttnType or a callable with yunchang's forward "
                    f"signature, got {type(fallback).__name__}")


class OpenVCAttnProcessor:
    """yunchang's ``attn_processor``: openvc for the calls its fast path takes, ``fallback`` for the rest.

    policy: a :class:`~open_vc_attn.integrations.policy.DispatchPolicy` (default thresholds when None).
    fallback: None (exact FP32 attention with its LSE, any device), a yunchang ``AttnType`` (its forward
    function, e.g. ``AttnType.FA``; the math and cuDNN types return a zero LSE and are refused), or any
    callable with the same signature returning ``(out, lse [B, H, Sq])``.
    """

    def __init__(self, *, policy=None, fallback=None):
        if policy is not None and not isinstance(policy, _policy.DispatchPolicy):
            raise TypeError(f"policy: expected None or an open_vc_attn.integrations.policy.DispatchPolicy, got "
                            f"{type(policy).__name__}")
        self.policy = policy
        self.fallback = _resolve_fallback(fallback)

    def _choose(self, q, k, v, dropout_p, causal, window_size, softcap, alibi_slopes):
        if tuple(window_size) != (-1, -1):
            return _policy.FALLBACK, "window_size"
        if softcap:
            return _policy.FALLBACK, "softcap"
        if alibi_slopes is not None:
            return _policy.FALLBACK, "alibi_slopes"
        return _policy.choose_path(q, k, v, causal=causal, dropout_p=dropout_p, policy=self.policy)

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, return_softmax=False, **kwargs):
        """q [B, Sq, H, D], k and v [B, Sk, Hk, D] -> (out [B, Sq, H, D] in q's dtype, lse float32 [B, H, Sq])."""
        path, reason = self._choose(q, k, v, dropout_p, causal, window_size, softcap, alibi_slopes)
        policy = self.policy if self.policy is not None else _policy.DEFAULT_POLICY
        res = None
        if path == _policy.OPENVC and policy.qk_format == _policy.AUTO:
            # the first call of a class (e.g. the first ring step) chooses; the candidates keep the LSE exact
            choice, res = _auto.choose(
                self, policy, lambda pol: _fast_attention(q, k, v, softmax_scale, causal, **pol.openvc_kwargs()),
                q, k, v, scale=softmax_scale, causal=causal, return_lse=True)
            path, reason, policy = choice.path, choice.reason, choice.policy
        _counts[(path, reason)] += 1
        if path == _policy.OPENVC:
            out, lse = res if res is not None else _fast_attention(q, k, v, softmax_scale, causal,
                                                                   **policy.openvc_kwargs())
            return (out if out.dtype == q.dtype else out.to(q.dtype)), lse   # openvc writes BF16
        return self.fallback(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                             return_softmax=return_softmax, **kwargs)


def check_hook(processor=None, attn_type=ATTN_TYPE):
    """Verifies that the installed yunchang hands ``processor`` to its ring steps for ``attn_type``
    (RuntimeError otherwise); returns the processor (a new :class:`OpenVCAttnProcessor` when None)."""
    kernels = _yunchang_kernels()
    processor = OpenVCAttnProcessor() if processor is None else processor
    try:
        chosen = kernels.select_flash_attn_impl(attn_type, stage="fwd-only", attn_processor=processor)
    except Exception as exc:   # noqa: BLE001 - any failure means the hook is not there
        raise RuntimeError(f"yunchang: select_flash_attn_impl({attn_type!r}, attn_processor=...) failed ({exc}); "
                           f"the attn_processor hook of yunchang {TESTED_VERSION} is not available") from exc
    if chosen is not processor:
        raise RuntimeError(f"yunchang: select_flash_attn_impl({attn_type!r}, attn_processor=...) returned "
                           f"{chosen!r}, not the processor: pass attn_type=open_vc_attn.integrations.yunchang."
                           f"ATTN_TYPE (a value that is no yunchang AttnType)")
    return processor


def long_context_attention(*, policy=None, fallback=None, **kwargs):
    """``yunchang.LongContextAttention(attn_type=ATTN_TYPE, attn_processor=OpenVCAttnProcessor(...),
    **kwargs)`` after :func:`check_hook`; needs yunchang's process groups (``set_seq_parallel_pg``) first.
    ring_impl_type, if given, must be "basic" (the only ring that uses the processor)."""
    if kwargs.get("ring_impl_type", "basic") != "basic":
        raise ValueError(f"ring_impl_type: {kwargs['ring_impl_type']!r} does not use attn_processor in yunchang "
                         f"{TESTED_VERSION}; use 'basic'")
    for name in ("attn_type", "attn_processor"):
        if name in kwargs:
            raise TypeError(f"{name}: set by long_context_attention; build LongContextAttention yourself to "
                            f"choose it")
    processor = check_hook(OpenVCAttnProcessor(policy=policy, fallback=fallback))
    from yunchang import LongContextAttention
    return LongContextAttention(attn_type=ATTN_TYPE, attn_processor=processor, **kwargs)


def stats():
    """``{(path, reason): calls}`` of every processor since :func:`reset_stats` (path "openvc"/"fallback")."""
    return dict(_counts)


def reset_stats():
    _counts.clear()


def reset_auto(processor=None):
    """Forgets the formats ``qk_format="auto"`` chose, of one processor or (None) of all: the next openvc
    call of each chooses again (eagerly, before any CUDA graph capture)."""
    _auto.reset(processor)
