"""SGLang diffusion integration: an attention backend of ``sglang.multimodal_gen`` that runs openvc
(docs/integrations/sglang.md).

SGLang diffusion builds every attention layer (``LocalAttention``, ``UlyssesAttention``, ``USPAttention``)
from an ``AttentionBackend`` class chosen by its selector; the layer calls the backend's ``AttentionImpl``
with ``[B, S, H, D]`` q, k, v after its own sequence-parallel all-to-all. :class:`OpenVCAttentionBackend`
is such a class: its impl sends each call that openvc's fast path takes
(:func:`open_vc_attn.integrations.policy.choose_path`: long self-attention, causal included, GQA with key/value
heads dividing the query heads) to :func:`open_vc_attn.attention` and every other call (cross-attention to text
tokens, short sequences, head counts that do not divide, head dims the policy leaves out) to SGLang's own
``SDPAImpl``. Packed sequences (``forward_varlen``: ``[T, H, D]`` with ``cu_seqlens``, which later SGLang releases
call from their varlen attention layers) go by :func:`~open_vc_attn.integrations.policy.choose_varlen_path` to
openvc's packed path in one call, or to SGLang's varlen SDPA (per sequence on releases without one).

SGLang chooses backends from a fixed enum (``AttentionBackendEnum``) with no entry for out-of-tree
backends, so :func:`install` wraps the platform's ``get_attn_backend_cls_str``: where SGLang would pick a
dense full-attention backend (torch SDPA, FlashAttention 3/4, FlashAttention 2) it returns this module's
backend instead; sparse and sliding-window backends, and ring attention (which needs FA or Sage), are left
alone. The backend reports the enum ``TORCH_SDPA``, the kind of backend it is to SGLang: dense, no
metadata, no ring merge. Call :func:`install` in every process that builds models; with SGLang's spawned
workers that means at the top level of the launching script, or run ``python -m
open_vc_attn.integrations.sglang_cli`` in place of ``sglang``.

The selection hook is private to SGLang, so :func:`install` first checks the installed sglang: release
:data:`TESTED_VERSION` (0.5.10 and its post releases) and the hook's signature; other releases raise
RuntimeError unless ``OPENVC_SGLANG_UNTESTED=1`` (a warning then; the signature is still checked).

Importing this module imports torch and sglang (it subclasses sglang's base classes).
"""
from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import inspect
import sys
from typing import Any

from sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from sglang.multimodal_gen.runtime.layers.attention.backends.sdpa import SDPABackend, SDPAImpl
from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum

from . import _auto_format
from . import _versions
from . import policy as _policy

__all__ = ["OpenVCAttentionBackend", "OpenVCAttentionImpl", "OpenVCAttentionMetadata",
           "OpenVCAttentionMetadataBuilder", "install", "uninstall", "is_installed", "stats", "reset_stats",
           "reset_auto", "BACKEND_QUALNAME", "TESTED_VERSION"]

BACKEND_QUALNAME = f"{__name__}.OpenVCAttentionBackend"
TESTED_VERSION = "0.5.10.post1"      # the sglang this module was tested with
_SUPPORTED_RELEASE = (0, 5, 10)      # its post releases (0.5.10.postN) are accepted too
_UNTESTED_ENV = "OPENVC_SGLANG_UNTESTED"
_HOOK_PARAMS = ["selected_backend", "head_size", "dtype"]

# Class names (last component of the selector's qualname) of the dense backends install() replaces.
_REPLACEABLE = {
    "torch_sdpa": "SDPABackend",
    "fa": "FlashAttentionBackend",
    "fa2": "FlashAttention2Backend",
}

_counts = collections.Counter()     # (path, reason) -> calls (eager)
_default_policy = [_policy.DEFAULT_POLICY]
_auto = _auto_format.AutoChoices()   # qk_format="auto": per impl (one per attention layer)


def _fast_attention(q, k, v, scale, return_lse, causal=False, qk_format="e4m3", k_smoothing=False,
                    p_format="expcast", v_bias_correction=False):
    """openvc's fast path (the policy's Q/K and P formats and V bias correction); tests swap it for a CPU
    reference stand-in."""
    from .. import api
    return api.attention(q, k, v, softmax_scale=scale, return_lse=return_lse, causal=causal, qk_format=qk_format,
                         k_smoothing=k_smoothing, p_format=p_format, v_bias_correction=v_bias_correction)


def _fast_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal, qk_format="e4m3", k_smoothing=False,
                           p_format="expcast", v_bias_correction=False):
    """openvc's packed path: one call over every sequence (each quantized and attended alone), the offsets
    read on the GPU only. Tests swap it for a CPU stand-in."""
    from .. import api
    return api.attention(q, k, v, softmax_scale=scale, causal=causal, cu_seqlens_q=cu_seqlens,
                         cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                         qk_format=qk_format, k_smoothing=k_smoothing, p_format=p_format,
                         v_bias_correction=v_bias_correction)


@dataclasses.dataclass
class OpenVCAttentionMetadata(AttentionMetadata):
    """openvc needs no per-step metadata: the current timestep only, as the base class."""
    current_timestep: int = 0


class OpenVCAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self) -> None:
        pass

    def prepare(self) -> None:
        pass

    def build(self, current_timestep: int = 0, **kwargs: Any) -> OpenVCAttentionMetadata:
        return OpenVCAttentionMetadata(current_timestep=current_timestep)


class OpenVCAttentionImpl(AttentionImpl):
    """openvc for the calls the policy gives it, SGLang's SDPAImpl for the rest (same arguments)."""

    def __init__(self, num_heads: int, head_size: int, softmax_scale: float, causal: bool = False,
                 num_kv_heads: int | None = None, prefix: str = "", **extra_impl_args) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.head_size = head_size
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.prefix = prefix
        self.dropout_p = extra_impl_args.get("dropout_p", 0.0)
        self.policy = extra_impl_args.pop("openvc_policy", None) or _default_policy[0]
        self.fallback = SDPAImpl(num_heads=num_heads, head_size=head_size, causal=causal,
                                 softmax_scale=softmax_scale, num_kv_heads=num_kv_heads, prefix=prefix,
                                 **extra_impl_args)

    def forward(self, query, key, value, attn_metadata: AttentionMetadata | None = None, *,
                return_softmax_lse: bool = False):
        """q [B, Sq, H, D], k and v [B, Sk, Hk, D] -> [B, Sq, H, D] in q's dtype; with
        return_softmax_lse, (out, lse) with lse float32 [B, H, Sq] (natural log, FlashAttention's layout)."""
        path, reason = _policy.choose_path(query, key, value, causal=self.causal, dropout_p=self.dropout_p,
                                           policy=self.policy)
        policy, res = self.policy, None
        if path == _policy.OPENVC and policy.qk_format == _policy.AUTO:
            choice, res = _auto.choose(
                self, policy, lambda pol: _fast_attention(query, key, value, self.softmax_scale, return_softmax_lse,
                                                          self.causal, **pol.openvc_kwargs()),
                query, key, value, scale=self.softmax_scale, causal=self.causal, return_lse=return_softmax_lse)
            path, reason, policy = choice.path, choice.reason, choice.policy
        _counts[(path, reason)] += 1
        if path == _policy.OPENVC:
            if res is None:
                res = _fast_attention(query, key, value, self.softmax_scale, return_softmax_lse, self.causal,
                                      **policy.openvc_kwargs())
            out, lse = res if return_softmax_lse else (res, None)
            out = out if out.dtype == query.dtype else out.to(query.dtype)   # openvc writes BF16
            return (out, lse) if return_softmax_lse else out
        if return_softmax_lse:
            raise NotImplementedError(
                f"return_softmax_lse=True: the SDPA fallback of the openvc backend returns no LSE, and this call "
                f"does not take openvc's fast path ({reason}); ring attention needs the fa or sage_attn backend")
        return self.fallback.forward(query, key, value, attn_metadata)

    def forward_varlen(self, query, key, value, *, cu_seqlens, max_seqlen: int,
                       cu_seqlens_host: tuple[int, ...] | None = None):
        """Packed sequences, as later SGLang releases call it (varlen USPAttention, packed-window DiTs):
        q, k, v [T, H, D] (keys and values of the same token layout), cu_seqlens int32 [N + 1] offsets
        shared by queries and keys, max_seqlen the longest sequence -> [T, H, D] in q's dtype. openvc's
        packed path when :func:`~open_vc_attn.integrations.policy.choose_varlen_path` takes the call (no
        synchronization: the offsets stay on the GPU), else SGLang's own varlen SDPA where the installed
        release has one, else SDPAImpl per sequence (which needs the host offsets: cu_seqlens_host, or
        one read of cu_seqlens). Rows past cu_seqlens[-1] are 0."""
        path, reason = _policy.choose_varlen_path(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                  causal=self.causal, dropout_p=self.dropout_p, policy=self.policy)
        policy, out = self.policy, None
        if path == _policy.OPENVC and policy.qk_format == _policy.AUTO:
            choice, out = _auto.choose(
                self, policy, lambda pol: _fast_varlen_attention(query, key, value, cu_seqlens, max_seqlen,
                                                                 self.softmax_scale, self.causal,
                                                                 **pol.openvc_kwargs()),
                query, key, value, scale=self.softmax_scale, causal=self.causal, cu_seqlens=cu_seqlens,
                lengths=(max_seqlen, max_seqlen))
            path, reason, policy = choice.path, choice.reason, choice.policy
        _counts[(path, reason)] += 1
        if path == _policy.OPENVC:
            if out is None:
                out = _fast_varlen_attention(query, key, value, cu_seqlens, max_seqlen, self.softmax_scale,
                                             self.causal, **policy.openvc_kwargs())
            return out if out.dtype == query.dtype else out.to(query.dtype)   # openvc writes BF16
        own = getattr(self.fallback, "forward_varlen", None)
        if own is not None:          # SGLang releases with packed varlen attention
            return own(query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                       cu_seqlens_host=cu_seqlens_host)
        return _per_sequence(self.fallback, query, key, value, cu_seqlens, cu_seqlens_host)


def _per_sequence(impl, query, key, value, cu_seqlens, cu_seqlens_host):
    """SDPAImpl.forward on each packed sequence (releases whose SDPAImpl has no forward_varlen)."""
    import torch
    bounds = cu_seqlens_host if cu_seqlens_host is not None else tuple(int(x) for x in cu_seqlens.tolist())
    out = torch.zeros_like(query)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            out[start:stop] = impl.forward(query[None, start:stop], key[None, start:stop], value[None, start:stop],
                                           None)[0]
    return out


class OpenVCAttentionBackend(AttentionBackend):
    """openvc FP8 attention for long dense self-attention, SGLang's SDPA for everything else."""

    accept_output_buffer: bool = False   # forward returns a new tensor

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return SDPABackend.get_supported_head_sizes()   # every size reaches at least the SDPA fallback

    @staticmethod
    def get_enum() -> AttentionBackendEnum:
        return AttentionBackendEnum.TORCH_SDPA

    @staticmethod
    def get_impl_cls() -> type[OpenVCAttentionImpl]:
        return OpenVCAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[OpenVCAttentionMetadata]:
        return OpenVCAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[OpenVCAttentionMetadataBuilder]:
        return OpenVCAttentionMetadataBuilder


# ---- selection --------------------------------------------------------------------------------------------

_installed = {}   # platform class -> (its own attribute or None, the original bound selection)


def _ring_world_size() -> int:
    """SGLang's ring-attention degree, 1 when its distributed state is not set up (or not importable)."""
    try:
        from sglang.multimodal_gen.runtime.distributed.parallel_state import get_ring_parallel_world_size
        return int(get_ring_parallel_world_size())
    except Exception:   # not initialized yet, or a partial sglang install: no ring attention either way
        return 1


def _clear_selector_cache():
    selector = sys.modules.get("sglang.multimodal_gen.runtime.layers.attention.selector")
    if selector is not None:
        selector._cached_get_attn_backend.cache_clear()


def _platform_class(platform):
    if platform is None:
        from sglang.multimodal_gen.runtime import platforms
        platform = platforms.current_platform
    cls = platform if isinstance(platform, type) else type(platform)
    if not callable(getattr(cls, "get_attn_backend_cls_str", None)):
        raise TypeError(f"platform: expected an SGLang diffusion Platform (class or instance), got {cls.__name__}")
    return cls


def _installed_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _check_hook(cls) -> None:
    """RuntimeError unless the installed sglang is the tested release (or OPENVC_SGLANG_UNTESTED=1) and
    ``cls.get_attn_backend_cls_str`` takes (selected_backend, head_size, dtype), what install() wraps."""
    version = _installed_version()
    message = (f"sglang {version}: open_vc_attn.integrations.sglang wraps SGLang's private backend selection "
               f"(Platform.get_attn_backend_cls_str) as sglang {TESTED_VERSION} defines it; install that "
               f"version (pip install 'sglang[diffusion]=={TESTED_VERSION}') or set {_UNTESTED_ENV}=1 to try "
               f"this one")
    _versions.gate_untested(_versions.version_tuple(version, 3) == _SUPPORTED_RELEASE, message, _UNTESTED_ENV)
    params = list(inspect.signature(cls.get_attn_backend_cls_str).parameters)
    if params != _HOOK_PARAMS:
        raise RuntimeError(f"sglang {version}: {cls.__name__}.get_attn_backend_cls_str takes ({', '.join(params)}), "
                           f"not ({', '.join(_HOOK_PARAMS)}) as in sglang {TESTED_VERSION}: install() cannot wrap it")
    selector = sys.modules.get("sglang.multimodal_gen.runtime.layers.attention.selector")
    if selector is not None and not hasattr(getattr(selector, "_cached_get_attn_backend", None), "cache_clear"):
        raise RuntimeError(f"sglang {version}: the attention selector has no cached _cached_get_attn_backend, "
                           f"which install() clears; supported: sglang {TESTED_VERSION}")


def install(*, replace=("torch_sdpa", "fa", "fa2"), policy=None, platform=None) -> None:
    """Makes SGLang diffusion select :class:`OpenVCAttentionBackend` wherever it would select one of the
    ``replace`` backends (names as in ``--attention-backend``: "torch_sdpa", "fa", "fa2"). policy: the
    :class:`~open_vc_attn.integrations.policy.DispatchPolicy` of impls built from now on. platform: the
    SGLang platform whose selection is wrapped (default ``current_platform``). Idempotent; call before the
    pipeline builds its models. RuntimeError on an untested sglang (see the module doc)."""
    if isinstance(replace, str):
        replace = (replace,)
    names = []
    for r in replace:
        if r not in _REPLACEABLE:
            raise ValueError(f"replace: expected names among {sorted(_REPLACEABLE)}, got {r!r}")
        names.append(_REPLACEABLE[r])
    if policy is not None and not isinstance(policy, _policy.DispatchPolicy):
        raise TypeError(f"policy: expected None or an open_vc_attn.integrations.policy.DispatchPolicy, got "
                        f"{type(policy).__name__}")
    if policy is not None:
        _default_policy[0] = policy
    cls = _platform_class(platform)
    if cls not in _installed:
        _check_hook(cls)
        # (the class's own attribute, None when inherited; the selection it made before install)
        _installed[cls] = (cls.__dict__.get("get_attn_backend_cls_str"), cls.get_attn_backend_cls_str)
    original = _installed[cls][1]
    replaced = frozenset(names)

    def get_attn_backend_cls_str(klass, selected_backend, head_size, dtype):
        chosen = original(selected_backend, head_size, dtype)
        if chosen.rsplit(".", 1)[-1] in replaced and _ring_world_size() == 1:
            return BACKEND_QUALNAME
        return chosen

    cls.get_attn_backend_cls_str = classmethod(get_attn_backend_cls_str)
    _clear_selector_cache()


def uninstall() -> None:
    """Restores the platform's own backend selection (no-op when not installed)."""
    for cls, (own, _) in list(_installed.items()):
        if own is None:
            del cls.get_attn_backend_cls_str
        else:
            cls.get_attn_backend_cls_str = own
        del _installed[cls]
    _clear_selector_cache()


def is_installed() -> bool:
    return bool(_installed)


def stats():
    """``{(path, reason): calls}`` since the last :func:`reset_stats` (path "openvc" or "fallback")."""
    return dict(_counts)


def reset_stats():
    _counts.clear()


def reset_auto(impl=None):
    """Forgets the formats ``qk_format="auto"`` chose, of one impl or (None) of all: the next openvc call of
    each chooses again (eagerly, before any CUDA graph capture)."""
    _auto.reset(impl)
