"""diffusers integration: openvc as an attention backend of diffusers' attention dispatch (docs/integrations/diffusers.md).

diffusers' transformers (Wan, HunyuanVideo, LTX, ...) compute q, k, v and call
``diffusers.models.attention_dispatch.dispatch_attention_fn``, which runs the function registered for the
active backend. :func:`register` adds openvc's function to that registry under the name ``"openvc"``; it
sends each call that openvc's fast path takes (:func:`open_vc_attn.integrations.policy.choose_path`: long,
unmasked, non-causal self-attention with head dim 128 on Hopper) to :func:`open_vc_attn.attention`, and
every other call (text/image cross-attention with few keys, short sequences, masks, causal, head dim 64,
context parallelism) to a diffusers backend, ``"native"`` (torch SDPA) unless told otherwise.

Three ways to turn it on:
- :func:`apply` (one model): ``apply(pipe.transformer)`` wraps that model's attention processors, so only
  its calls are routed; the rest of the pipeline keeps its backends. :func:`remove` undoes it.
- :func:`openvc_attention` (a block): ``with openvc_attention(): pipe(...)`` makes openvc the active
  backend of every dispatch call without an explicit backend, like diffusers' ``attention_backend``
  context manager (which accepts diffusers' own backend names only).
- :func:`enable` / :func:`disable`: the same, process-wide.

diffusers keys its registry by its ``AttentionBackendName`` enum, which has no member for openvc, so the
backend is reachable only as the *active* backend (the three ways above), not through
``model.set_attention_backend("openvc")``. A processor's explicit backend (``set_attention_backend``) is
kept as the fallback of the modules :func:`apply` wraps.

Importing this module imports neither torch nor diffusers; :func:`register` (called by all of the above)
imports diffusers.
"""
from __future__ import annotations

import collections
import contextlib
import functools

from . import policy as _policy

__all__ = ["BACKEND_NAME", "register", "openvc_attention", "enable", "disable", "apply", "remove", "stats",
           "reset_stats"]

BACKEND_NAME = "openvc"


class _BackendKey(str):
    """The registry key. diffusers reads ``.value`` of the active backend where it expects an enum member
    (e.g. when it lists backends in an error message); a str with a .value stands in for one."""

    @property
    def value(self):
        return str(self)


_KEY = _BackendKey(BACKEND_NAME)


class _State:
    registered = False
    policy = _policy.DEFAULT_POLICY
    fallback = "native"                 # a diffusers AttentionBackendName value
    counts = collections.Counter()      # (path, reason) -> calls, counted in eager mode


_state = _State()


def _fast_attention(q, k, v, scale):
    """openvc's fast path; tests swap it for a CPU reference stand-in."""
    from .. import api
    return api.attention(q, k, v, softmax_scale=scale)


def _dispatch():
    from diffusers.models import attention_dispatch
    return attention_dispatch


def _openvc_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, return_lse=False, _parallel_config=None):
    """The registered backend function: [B, S, H, D] in and out, as every diffusers backend."""
    if _parallel_config is not None:
        path, reason = _policy.FALLBACK, "context parallel"
    elif return_lse:
        path, reason = _policy.FALLBACK, "return_lse"
    else:
        path, reason = _policy.choose_path(query, key, value, attn_mask=attn_mask, causal=is_causal,
                                           dropout_p=dropout_p, policy=_state.policy)
    _state.counts[(path, reason)] += 1
    if path == _policy.OPENVC:
        out = _fast_attention(query, key, value, scale)
        return out if out.dtype == query.dtype else out.to(query.dtype)   # openvc writes BF16
    dispatch = _dispatch()
    return dispatch.dispatch_attention_fn(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, attention_kwargs={"return_lse": True} if return_lse else None,
        backend=dispatch.AttentionBackendName(_state.fallback), parallel_config=_parallel_config)


def _fallback_name(fallback):
    if fallback is None:
        return _state.fallback
    dispatch = _dispatch()
    name = getattr(fallback, "value", fallback)
    if not isinstance(name, str) or name == BACKEND_NAME:
        raise ValueError(f"fallback: expected the name of a diffusers attention backend (e.g. 'native', "
                         f"'_native_cudnn', 'flash'), got {fallback!r}")
    try:
        member = dispatch.AttentionBackendName(name.lower())
    except ValueError:
        names = sorted(m.value for m in dispatch.AttentionBackendName)
        raise ValueError(f"fallback: {fallback!r} is not a diffusers attention backend; expected one of {names}") \
            from None
    if member not in dispatch._AttentionBackendRegistry._backends:
        raise ValueError(f"fallback: diffusers has no function registered for backend {member.value!r}")
    check = getattr(dispatch, "_check_attention_backend_requirements", None)
    if check is not None:
        try:
            check(member)     # the packages the backend needs (what set_attention_backend checks)
        except Exception as exc:
            raise ValueError(f"fallback: diffusers backend {member.value!r} is not usable here: {exc}") from exc
    return member.value


def _check_policy(policy):
    if policy is not None and not isinstance(policy, _policy.DispatchPolicy):
        raise TypeError(f"policy: expected None or an open_vc_attn.integrations.policy.DispatchPolicy, got "
                        f"{type(policy).__name__}")
    return policy


def register(*, policy=None, fallback=None):
    """Registers the ``"openvc"`` backend with diffusers (idempotent) and sets, when given, the dispatch
    policy and the fallback backend (a diffusers backend name, default ``"native"``). Returns the key."""
    _check_policy(policy)
    fallback = _fallback_name(fallback)
    dispatch = _dispatch()
    if not _state.registered or _KEY not in dispatch._AttentionBackendRegistry._backends:
        # No constraints: the function checks its inputs itself and sends what it cannot run onwards.
        dispatch._AttentionBackendRegistry.register(_KEY, constraints=[])(_openvc_backend)
        _state.registered = True
    if policy is not None:
        _state.policy = policy
    _state.fallback = fallback
    return _KEY


@contextlib.contextmanager
def _routed(policy, fallback):
    """Makes openvc the active diffusers backend, with this policy and fallback, for the block."""
    registry = _dispatch()._AttentionBackendRegistry
    saved = registry._active_backend, _state.policy, _state.fallback
    registry._active_backend = _KEY
    _state.policy = policy if policy is not None else _state.policy
    _state.fallback = fallback
    try:
        yield
    finally:
        registry._active_backend, _state.policy, _state.fallback = saved


@contextlib.contextmanager
def openvc_attention(*, policy=None, fallback=None):
    """``with openvc_attention(): ...``: every diffusers dispatch call without an explicit backend goes
    through openvc's policy in the block (calls of processors given a backend with
    ``set_attention_backend`` keep that backend)."""
    _check_policy(policy)
    register()
    with _routed(policy, _fallback_name(fallback)):
        yield


_enabled_saved = []


def enable(*, policy=None, fallback=None):
    """Process-wide :func:`openvc_attention` until :func:`disable`."""
    register(policy=policy, fallback=fallback)
    registry = _dispatch()._AttentionBackendRegistry
    if registry._active_backend is not _KEY:
        _enabled_saved.append(registry._active_backend)
        registry._active_backend = _KEY


def disable():
    """Restores the active backend that :func:`enable` replaced (no-op when not enabled)."""
    if _enabled_saved:
        _dispatch()._AttentionBackendRegistry._active_backend = _enabled_saved.pop()


class _OpenVCProcessor:
    """Wraps one attention processor: its calls run with openvc as the active backend and the processor's
    own backend (if any) as the fallback. ``_attention_backend`` reads and writes that fallback, so a later
    ``set_attention_backend`` on the model changes the general path of the wrapped modules."""

    def __init__(self, inner, policy):
        self._openvc_inner = inner
        self._openvc_policy = policy
        self._openvc_saved_backend = inner._attention_backend
        self._openvc_fallback = getattr(inner._attention_backend, "value", inner._attention_backend)
        inner._attention_backend = None    # so that dispatch reads the active backend

    @property
    def _attention_backend(self):
        return self._openvc_fallback

    @_attention_backend.setter
    def _attention_backend(self, backend):
        self._openvc_fallback = getattr(backend, "value", backend)

    def __getattr__(self, name):           # everything else is the inner processor's
        if name.startswith("_openvc_"):
            raise AttributeError(name)
        return getattr(self._openvc_inner, name)

    def _openvc_call(self, *args, **kwargs):
        fallback = self._openvc_fallback or _state.fallback
        with _routed(self._openvc_policy, fallback):
            return self._openvc_inner(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _wrapper_class(inner_cls):
    """A wrapper class whose __call__ has the inner class's signature: some diffusers attention modules
    filter their kwargs by ``inspect.signature(processor.__call__)``."""
    def __call__(self, *args, **kwargs):
        return self._openvc_call(*args, **kwargs)
    functools.update_wrapper(__call__, inner_cls.__call__)
    return type(f"OpenVC{inner_cls.__name__}", (_OpenVCProcessor,), {"__call__": __call__})


def _attention_modules(model):
    for name, module in model.named_modules():
        proc = getattr(module, "processor", None)
        if proc is not None and hasattr(proc, "_attention_backend") and callable(proc):
            yield name, module, proc


def apply(model, *, policy=None, fallback=None):
    """Routes ``model``'s attention calls through openvc (see the module doc); returns the number of
    processors wrapped. model: a diffusers model (e.g. ``WanTransformer3DModel``) whose attention
    processors call ``dispatch_attention_fn`` (they have an ``_attention_backend`` attribute). Processors
    already wrapped are left as they are."""
    _check_policy(policy)
    register()
    if fallback is not None:
        _fallback_name(fallback)     # validate now, not at the first call
    wrapped = 0
    for _, module, proc in _attention_modules(model):
        if isinstance(proc, _OpenVCProcessor):
            continue
        new = _wrapper_class(type(proc))(proc, policy)
        if fallback is not None:
            new._attention_backend = _fallback_name(fallback)
        module.processor = new
        wrapped += 1
    if not wrapped and not any(isinstance(p, _OpenVCProcessor) for _, _, p in _attention_modules(model)):
        raise ValueError(f"model: found no attention processor that uses diffusers' attention dispatch in "
                         f"{type(model).__name__} (processors need an _attention_backend attribute)")
    return wrapped


def remove(model):
    """Undoes :func:`apply`: puts the original processors (and their explicit backends) back."""
    removed = 0
    for _, module, proc in _attention_modules(model):
        if isinstance(proc, _OpenVCProcessor):
            inner = proc._openvc_inner
            inner._attention_backend = proc._openvc_saved_backend
            module.processor = inner
            removed += 1
    return removed


def stats():
    """``{(path, reason): calls}`` since the last :func:`reset_stats` (eager calls; path is "openvc" or
    "fallback")."""
    return dict(_state.counts)


def reset_stats():
    _state.counts.clear()
