"""diffusers integration: openvc as an attention backend of diffusers' attention dispatch
(docs/integrations/diffusers.md).

diffusers' transformers (Wan, HunyuanVideo, LTX, ...) compute q, k, v and call
``diffusers.models.attention_dispatch.dispatch_attention_fn``, which runs the function registered for the
active backend. :func:`register` adds openvc's function to that registry under the name ``"openvc"``; it
sends each call that openvc's fast path takes (:func:`open_vc_attn.integrations.policy.choose_path`: long,
self-attention with head dim 128 or 64 on Hopper, unmasked or with a key padding mask, causal too, or with a
FlexAttention BlockMask as attn_mask; grouped-query calls, ``enable_gqa=True`` with key/value heads dividing the
query heads, as they are) to :func:`open_vc_attn.attention`, and every other call (text/image cross-attention
with few keys, short sequences, per-query or per-head masks, other head dims) to a diffusers backend,
``"native"`` (torch SDPA) unless told otherwise (a BlockMask: ``"flex"``).

Three ways to turn it on:
- :func:`apply` (a pipeline or one model): ``apply(pipe)`` wraps the attention processors of every
  denoiser of the pipeline (``transformer`` and ``transformer_2`` of Wan2.2 A14B, ...), ``apply(model)``
  those of one model; the rest keeps its backends. :func:`remove` undoes it. A wrapped model none of whose
  calls reach openvc gets one :class:`FallbackWarning` with the reasons. The processors of CogVideoX,
  ConsisID, Mochi and EasyAnimate call torch SDPA themselves, so no backend sees their calls: :func:`apply`
  replaces them with openvc's (:mod:`._diffusers_processors`), which route each call by the same policy
  and counts, running the original's own SDPA call when the policy does not take it.
- :func:`openvc_attention` (a block): ``with openvc_attention(): pipe(...)`` makes openvc the active
  backend of every dispatch call without an explicit backend, like diffusers' ``attention_backend``
  context manager (which accepts diffusers' own backend names only).
- :func:`enable` / :func:`disable`: the same, process-wide.

``apply(..., policy=DispatchPolicy(qk_format="auto"))`` lets each wrapped or replaced attention processor
choose its format on its first openvc call (:mod:`._auto_format`; :func:`reset_auto` forgets the choices),
and ``apply(pipe, bf16_steps=N)`` runs the pipeline's first N denoising steps on the fallback backend (a
replaced processor: its original's SDPA call) (:mod:`._diffusers_steps`). Both decide in :func:`_decide`,
which the backend function and the replaced processors share. ``apply(pipe, block_mask=mask)`` makes the
model's calls of the mask's lengths block-sparse; :mod:`._diffusers_masks` has the rules of both mask forms.

Context parallelism (``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=...,
ring_degree=...))``): the backend is registered as supporting it; diffusers' own Ulysses all-to-all and
ring loop run around openvc (:mod:`._diffusers_cp`), ring steps merging by openvc's LSE.

diffusers 0.42 has no public way to add a named backend: its registry (``_AttentionBackendRegistry``) is
private and keyed by the ``AttentionBackendName`` enum, which has no member for openvc. So the backend is
reachable only as the *active* backend (the three ways above), not through
``model.set_attention_backend("openvc")``, and this module checks the diffusers version before touching the
registry (:data:`TESTED_VERSION`; other versions raise unless ``OPENVC_DIFFUSERS_UNTESTED=1``). A
processor's explicit backend (``set_attention_backend``) is kept as the fallback of the modules
:func:`apply` wraps.

Importing this module imports neither torch nor diffusers; :func:`register` (called by all of the above)
imports diffusers.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import warnings
import weakref

from .._block_sparse import is_block_mask as _is_block_mask
from . import _auto_format
from . import _diffusers_cp
from . import _diffusers_masks
from . import _diffusers_processors
from . import _diffusers_steps
from ._diffusers_wrap import NO_BACKEND_ATTR as _NO_BACKEND_ATTR, OpenVCProcessor as _OpenVCProcessor
from ._diffusers_wrap import wrapper_class as _wrapper_class
from . import _versions
from . import policy as _policy

__all__ = ["BACKEND_NAME", "TESTED_VERSION", "FallbackWarning", "register", "openvc_attention", "enable",
           "disable", "apply", "remove", "stats", "reset_stats", "reset_auto"]

BACKEND_NAME = "openvc"
TESTED_VERSION = "0.42.1"            # the diffusers this module was tested with
_SUPPORTED_SERIES = ((0, 42),)       # releases with the same private registry, accepted without the variable
_UNTESTED_ENV = "OPENVC_DIFFUSERS_UNTESTED"
_REGISTRY_ATTRS = ("_backends", "_active_backend", "_supported_arg_names", "_supports_context_parallel",
                   "register")


class FallbackWarning(UserWarning):
    """A model that :func:`apply` wrapped ran a forward in which no attention call took openvc's fast path."""


class _BackendKey(str):
    """The registry key. diffusers reads ``.value`` of the active backend where it expects an enum member
    (e.g. when it lists backends in an error message, or checks context-parallel support); a str with a
    .value stands in for one."""

    @property
    def value(self):
        return str(self)


_KEY = _BackendKey(BACKEND_NAME)


class _State:
    registered = False
    checked_version = None
    policy = _policy.DEFAULT_POLICY
    fallback = "native"                 # a diffusers AttentionBackendName value
    counts = collections.Counter()      # (path, reason) -> calls, counted in eager mode
    routes = None                       # the _ModelRoutes of the wrapped model whose processor is running
    module = None                       # the wrapped processor that is running: the key of its auto choice


_state = _State()
_auto = _auto_format.AutoChoices()      # qk_format="auto": per wrapped processor


# ---- diffusers and its version -------------------------------------------------------------------------

def _check_version(diffusers, dispatch):
    """Raises RuntimeError when this diffusers' private attention registry is not the one this module
    was written against (or, with OPENVC_DIFFUSERS_UNTESTED=1, warns once and goes on)."""
    version = getattr(diffusers, "__version__", "unknown")
    missing = [a for a in ("_AttentionBackendRegistry", "AttentionBackendName", "dispatch_attention_fn",
                           "_templated_context_parallel_attention") if not hasattr(dispatch, a)]
    if not missing:
        missing = [f"_AttentionBackendRegistry.{a}" for a in _REGISTRY_ATTRS
                   if not hasattr(dispatch._AttentionBackendRegistry, a)]
    if missing:
        raise RuntimeError(f"diffusers {version}: diffusers.models.attention_dispatch has no {', '.join(missing)}; "
                           f"open_vc_attn.integrations.diffusers supports diffusers {TESTED_VERSION} (pip install "
                           f"'diffusers=={TESTED_VERSION}')")
    message = (f"diffusers {version}: open_vc_attn.integrations.diffusers registers openvc in diffusers' "
               f"private attention registry (diffusers has no public way to add a backend) and was tested "
               f"with diffusers {TESTED_VERSION}; install it (pip install 'diffusers=={TESTED_VERSION}') or "
               f"set {_UNTESTED_ENV}=1 to try this version")
    _versions.gate_untested(_versions.version_tuple(version) in _SUPPORTED_SERIES, message, _UNTESTED_ENV)
    _state.checked_version = version


def _dispatch():
    import diffusers
    from diffusers.models import attention_dispatch
    if _state.checked_version != getattr(diffusers, "__version__", None):
        _check_version(diffusers, attention_dispatch)
    return attention_dispatch


# ---- the backend function ------------------------------------------------------------------------------

def _fast_attention(q, k, v, scale, return_lse=False, attn_mask=None, causal=False, qk_format="e4m3",
                    k_smoothing=False, p_format="expcast", block_mask=None, seqused_k=None, v_bias_correction=False):
    """openvc's fast path (lse [B, H, Sq] with return_lse); a key padding mask or key counts (seqused_k), causal
    or a BlockMask as the policy took them, the policy's Q/K and P formats and V bias correction. Tests swap it
    for a CPU stand-in."""
    import open_vc_attn
    return open_vc_attn.attention(q, k, v, softmax_scale=scale, return_lse=return_lse, key_padding_mask=attn_mask,
                                  causal=causal, qk_format=qk_format, k_smoothing=k_smoothing, p_format=p_format,
                                  block_mask=block_mask, seqused_k=seqused_k, v_bias_correction=v_bias_correction)


def _record(path, reason, routes=None):
    """Counts one call: in every call's counts and in those of the wrapped model running (``routes``, or the
    one whose processor is running)."""
    _state.counts[(path, reason)] += 1
    routes = routes if routes is not None else _state.routes
    if routes is not None:
        routes.counts[(path, reason)] += 1


def _fallback_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                   parallel_config):
    dispatch = _dispatch()
    return dispatch.dispatch_attention_fn(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, attention_kwargs={"return_lse": True} if return_lse else None,
        backend=dispatch.AttentionBackendName(_diffusers_masks.fallback_backend(attn_mask, _state.fallback)),
        parallel_config=parallel_config)


def _openvc_call(query, key, value, scale, return_lse, attn_mask, is_causal, policy, block_mask=None):
    fmt = policy.openvc_kwargs()
    if block_mask is not None:          # the call's attn_mask (then not a key mask) or the model's attached one
        return _fast_attention(query, key, value, scale, return_lse, block_mask=block_mask, **fmt)
    if attn_mask is not None or is_causal:
        return _fast_attention(query, key, value, scale, return_lse, attn_mask, is_causal, **fmt)
    return _fast_attention(query, key, value, scale, return_lse, **fmt)


def _decide(policy, routes, owner, run, query, key, value, attn_mask=None, is_causal=False, dropout_p=0.0,
            scale=None, return_lse=False):
    """The decision every routed call shares: the policy's path, the first BF16 steps of ``routes``' pipeline
    (bf16_steps), and with ``qk_format="auto"`` the format ``owner`` (the wrapped or replaced processor)
    chose for this call class. Counts the call (a block-sparse one under its own path). Returns
    ``run(format policy, block mask or None)``'s result (the openvc call), or None when the call goes to the
    fallback."""
    blocks = _diffusers_masks.mask_of(routes.block_mask if routes is not None else None, query, key, attn_mask,
                                      is_causal)
    path, reason = _policy.choose_path(query, key, value, attn_mask=attn_mask if blocks is None else blocks,
                                       causal=is_causal, dropout_p=dropout_p, policy=policy)
    steps = routes.steps if routes is not None else None
    if path == _policy.OPENVC and steps is not None and steps.bf16_now():
        path, reason = _policy.FALLBACK, steps.reason        # apply(pipe, bf16_steps=N)
    res = None
    if path == _policy.OPENVC and policy.qk_format == _policy.AUTO:
        choice, res = _auto.choose(owner, policy, lambda pol: run(pol, blocks), query, key, value, scale=scale,
                                   causal=is_causal, key_padding_mask=attn_mask if blocks is None else None,
                                   return_lse=return_lse, block_mask=blocks)
        path, reason, policy = choice.path, choice.reason, choice.policy
    sparse = path == _policy.OPENVC and blocks is not None
    _record(_diffusers_masks.BLOCK_SPARSE if sparse else path, reason, routes)
    if path != _policy.OPENVC:
        return None
    return res if res is not None else run(policy, blocks)


def _local_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, return_lse=False):
    """One attention on this process's tensors ([B, S, H, D]): openvc when the policy takes it, else the
    fallback backend. With return_lse, (out, lse [B, Sq, H] float32): diffusers' layout."""
    res = _decide(_state.policy, _state.routes, _state.module,
                  lambda pol, blocks: _openvc_call(query, key, value, scale, return_lse, attn_mask, is_causal, pol,
                                                   blocks),
                  query, key, value, attn_mask, is_causal, dropout_p, scale, return_lse)
    if res is not None:
        out, lse = res if return_lse else (res, None)
        out = out if out.dtype == query.dtype else out.to(query.dtype)   # openvc writes BF16
        return (out, lse.transpose(1, 2).contiguous()) if return_lse else out
    if return_lse:
        # diffusers' native backends return no LSE (and its cuDNN path needs a parallel config for one):
        # compute the call exactly, with its LSE.
        if dropout_p:
            raise ValueError(f"dropout_p: {dropout_p} with return_lse is not supported by the openvc backend "
                             f"(inference only)")
        if attn_mask is not None and _is_block_mask(attn_mask):    # flex applies it (with mask_mod)
            out, lse = _diffusers_masks.flex_with_lse(query, key, value, attn_mask, scale)
            return out, lse.transpose(1, 2).contiguous()
        from . import _exact
        out, lse = _exact.attention_with_lse(query, key, value, scale=scale, causal=is_causal,
                                             attn_mask=attn_mask)
        return out, lse.transpose(1, 2).contiguous()
    return _fallback_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False, None)


def _direct_attention(policy, routes, owner, query, key, value, native, key_mask=None, key_counts=None):
    """``route`` of the processors of :mod:`._diffusers_processors` (models that call torch SDPA
    themselves; ``owner``: the processor, the key of its auto choice): q, k, v [B, S, H, D], key_mask None
    or a bool key padding mask [B, Sk]; not causal, SDPA's default scale. key_counts (int32 [B], with a
    key_mask that keeps exactly the first key_counts[b] keys of each entry, which the caller guarantees): the
    openvc call takes the counts (no gather of the kept keys), the policy and the auto format's check the mask.
    Returns (out [B, S, H, D] in q's dtype, True) from openvc when :func:`_decide` takes the call, else
    (``native()``, False): the original processor's own SDPA call. Counted like every call."""
    if key_counts is not None and key_mask is None:
        raise ValueError("key_counts: given with key_mask=None (the policy and the auto format read the mask)")

    def run(pol, blocks):
        if key_counts is not None:
            if blocks is not None:   # (a bool key mask never gives one: kept so, not dropped silently)
                raise ValueError("key_counts: given with a BlockMask; pass the block mask without key counts")
            return _fast_attention(query, key, value, None, seqused_k=key_counts, **pol.openvc_kwargs())
        return _openvc_call(query, key, value, None, False, key_mask, False, pol, blocks)

    out = _decide(policy if policy is not None else _state.policy, routes, owner, run, query, key, value, key_mask)
    if out is None:
        return native(), False
    return (out if out.dtype == query.dtype else out.to(query.dtype)), True


def _openvc_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, return_lse=False, _parallel_config=None):
    """The registered backend function: [B, S, H, D] in and out, as every diffusers backend."""
    if _parallel_config is None:
        return _local_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                return_lse)
    if attn_mask is not None and _is_block_mask(attn_mask):
        # A shard's keys are not the mask's, and diffusers has no backend for this either (flex has no context
        # parallelism): an error, rather than a fallback that would attend one shard only.
        raise ValueError("attn_mask: a FlexAttention BlockMask is not supported under context parallelism (nor by "
                         "diffusers' flex backend); attach it with apply(model, block_mask=...), which applies it "
                         "to Ulysses calls of the mask's lengths")
    if is_causal or enable_gqa:
        # diffusers' context-parallel templates take neither: the fallback backend runs the whole call.
        _record(_policy.FALLBACK, "context parallel with " + ("causal" if is_causal else "enable_gqa"))
        return _fallback_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                              _parallel_config)
    return _diffusers_cp.context_parallel_attention(
        _dispatch(), _local_attention, query, key, value, attn_mask, dropout_p, scale, return_lse,
        _parallel_config)


# ---- registration and activation -----------------------------------------------------------------------

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


def _check_policy(policy, per_module=False):
    if policy is not None and not isinstance(policy, _policy.DispatchPolicy):
        raise TypeError(f"policy: expected None or an open_vc_attn.integrations.policy.DispatchPolicy, got "
                        f"{type(policy).__name__}")
    if policy is not None and policy.qk_format == _policy.AUTO and not per_module:
        # the backend function does not know which module calls it: only apply()'s wrappers do
        raise ValueError("policy: qk_format='auto' chooses a format per attention module; pass it to "
                         "apply(pipe or model, policy=...), which wraps each module")
    return policy


def register(*, policy=None, fallback=None):
    """Registers the ``"openvc"`` backend with diffusers (idempotent) and sets, when given, the dispatch
    policy and the fallback backend (a diffusers backend name, default ``"native"``). Returns the key.
    RuntimeError when the installed diffusers is not a tested version (see the module doc)."""
    _check_policy(policy)
    fallback = _fallback_name(fallback)
    dispatch = _dispatch()
    if not _state.registered or _KEY not in dispatch._AttentionBackendRegistry._backends:
        # No constraints: the function checks its inputs itself and sends what it cannot run onwards.
        dispatch._AttentionBackendRegistry.register(_KEY, constraints=[], supports_context_parallel=True)(
            _openvc_backend)
        _state.registered = True
    if policy is not None:
        _state.policy = policy
    _state.fallback = fallback
    return _KEY


@contextlib.contextmanager
def _routed(policy, fallback, routes=None, module=None):
    """Makes openvc the active diffusers backend, with this policy and fallback, for the block."""
    registry = _dispatch()._AttentionBackendRegistry
    saved = registry._active_backend, _state.policy, _state.fallback, _state.routes, _state.module
    registry._active_backend = _KEY
    _state.policy = policy if policy is not None else _state.policy
    _state.fallback = fallback
    _state.routes = routes
    _state.module = module
    try:
        yield
    finally:
        registry._active_backend, _state.policy, _state.fallback, _state.routes, _state.module = saved


@contextlib.contextmanager
def openvc_attention(*, policy=None, fallback=None):
    """``with openvc_attention(): ...``: every diffusers dispatch call without an explicit backend goes
    through openvc's policy in the block (calls of processors given a backend with
    ``set_attention_backend`` keep that backend)."""
    _check_policy(policy)
    register()
    with _routed(policy, _fallback_name(fallback), _state.routes, _state.module):
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


# ---- wrapping models and pipelines ---------------------------------------------------------------------

class _ModelRoutes:
    """The calls of one wrapped model: its counts (``stats(model)``) and the one-time FallbackWarning,
    decided after the first forward in which its processors made calls."""

    def __init__(self, name):
        self.name = name
        self.counts = collections.Counter()
        self.decided = False
        self.hook = None
        self.steps = None                   # the pipeline's _diffusers_steps.StepCounter (bf16_steps)
        self.block_mask = None              # apply(..., block_mask=): a BlockMask for calls of its lengths

    def after_forward(self, module, args, output):
        if self.decided or not self.counts:
            return                          # no call seen yet (or traced by torch.compile, uncounted)
        if self.steps is not None and self.steps.bf16_now():
            return                          # a BF16 first step: openvc was not to be used
        self.decided = True
        if any(path != _policy.FALLBACK for path, _ in self.counts):     # openvc, dense or block-sparse
            return
        total = sum(self.counts.values())
        reasons = "; ".join(f"{why} ({n})" for (_, why), n in self.counts.most_common())
        warnings.warn(f"open_vc_attn: none of the {total} attention calls of {self.name} took openvc's fast "
                      f"path; all ran on the fallback backend. Reasons: {reasons}. stats(model) has the counts; "
                      f"docs/integrations/diffusers.md lists what each model needs.", FallbackWarning,
                      stacklevel=2)


_routes_of = weakref.WeakKeyDictionary()     # wrapped model -> its _ModelRoutes
def _enter(proc):
    """The routing a wrapped processor's call runs in: openvc active, the wrapper's policy and routes, its own
    backend (or the default fallback) as the fallback."""
    return _routed(proc._openvc_policy, proc._openvc_fallback or _state.fallback, proc._openvc_routes, proc)


def _is_pipeline(obj):
    return not hasattr(obj, "named_modules") and isinstance(getattr(obj, "components", None), dict)


def _denoisers(pipe):
    """(name, model) of the pipeline's denoisers: components named transformer, transformer_2, unet, ...
    (the VAE and the text encoders are left alone)."""
    return [(name, comp) for name, comp in pipe.components.items()
            if comp is not None and hasattr(comp, "named_modules")
            and (name.split("_")[0] in ("transformer", "unet"))]


def _apply_model(model, policy, fallback, name, block_mask=None):
    modules, direct = _diffusers_processors.dispatch_modules(model), _diffusers_processors.direct_modules(model)
    replaced = any(isinstance(p, _diffusers_processors.DirectProcessor)
                   for _, p in _diffusers_processors.processors(model))
    if not modules and not direct and not replaced:
        raise ValueError(f"model: {_diffusers_processors.no_route_reason(model, TESTED_VERSION)}")
    routes = _routes_of.get(model)
    if routes is None:                 # kept after remove(): stats(model) and the one-time warning persist
        routes = _routes_of[model] = _ModelRoutes(name)
    if routes.hook is None:
        routes.hook = model.register_forward_hook(routes.after_forward)
    if block_mask is not None:
        routes.block_mask = block_mask
    wrapped = 0
    for module, proc in modules:
        if isinstance(proc, _OpenVCProcessor):
            continue
        new = _wrapper_class(type(proc))(proc, policy, routes, _enter)
        if fallback is not None:
            new._attention_backend = fallback
        module.processor = new
        wrapped += 1
    # their fallback is the original's SDPA call, not `fallback`
    return wrapped + _diffusers_processors.install(model, functools.partial(_direct_attention, policy, routes),
                                                   functools.partial(_skip, routes))


def _skip(routes, reason):
    """A call that an openvc processor hands to the original processor whole: counted as a fallback."""
    _record(_policy.FALLBACK, reason, routes)


def _set_bf16_steps(pipe, denoisers, steps):
    """Installs a StepCounter on the pipeline's scheduler, shared by its denoisers' routes (0: none),
    in place of the one an earlier apply installed."""
    routes = [r for r in (_routes_of.get(comp) for _, comp in denoisers) if r is not None]
    for old in {id(r.steps): r.steps for r in routes if r.steps is not None}.values():
        old.remove()
    counter = _diffusers_steps.StepCounter(pipe, steps) if steps else None
    for r in routes:
        r.steps = counter


def apply(model, *, policy=None, fallback=None, bf16_steps=None, block_mask=None):
    """Routes the attention calls of ``model`` through openvc (see the module doc).

    model: a diffusers pipeline (``pipe``: every denoiser component, ``transformer``, ``transformer_2``,
    ``unet``..., is wrapped) or a diffusers model (e.g. ``WanTransformer3DModel``) whose attention processors
    call ``dispatch_attention_fn`` (they have an ``_attention_backend`` attribute) or are among those that
    openvc replaces (CogVideoX, ConsisID, Mochi, EasyAnimate: :mod:`._diffusers_processors`; ``fallback``
    does not apply to those, which fall back to their original's torch SDPA call). Processors already
    wrapped are left as they are. Returns the number of processors wrapped or replaced; for a pipeline a
    dict ``{component name: number}``. ValueError naming the reason when nothing can be routed (e.g.
    Allegro, whose processors call torch SDPA directly with head dim 96); a pipeline denoiser that cannot be
    routed while another can gets a FallbackWarning with the reason.

    policy: a DispatchPolicy; with ``qk_format="auto"`` each wrapped or replaced processor chooses its
    format on its first openvc call (docs/integrations/diffusers.md). bf16_steps (pipelines only): an int
    N >= 0 runs the calls openvc would take in the first N denoising steps of every run on the fallback
    (the fallback backend, or a replaced processor's own SDPA call) instead, counted by the pipeline's
    scheduler (:mod:`._diffusers_steps`) and shown in stats() under their own reason; 0 turns it off, None
    (default) leaves it as an earlier apply set it (off at first).

    block_mask: a FlexAttention BlockMask (BLOCK_SIZE 128, e.g. ``open_vc_attn.masks.frame_causal(frames,
    tokens_per_frame)``) that openvc applies to the model's (every denoiser's) calls without attn_mask, not
    causal, whose (Sq, Sk) are the mask's lengths: block-sparse, each listed block whole, counted in stats()
    under path "openvc-block-sparse" (:mod:`._diffusers_masks`). A call that falls back runs without it. None
    (default) leaves the mask an earlier apply set (none at first); remove() drops it. TypeError / ValueError
    naming block_mask for anything else."""
    _check_policy(policy, per_module=True)
    block_mask = _diffusers_masks.check_option(block_mask)
    if bf16_steps is not None and (isinstance(bf16_steps, bool) or not isinstance(bf16_steps, int) or bf16_steps < 0):
        raise ValueError(f"bf16_steps: expected None or an int >= 0 (denoising steps run on the fallback backend), "
                         f"got {bf16_steps!r}")
    register()
    fallback = _fallback_name(fallback) if fallback is not None else None   # validated now, not at a call
    if not _is_pipeline(model):
        if not hasattr(model, "named_modules"):
            raise TypeError(f"model: expected a diffusers model (torch.nn.Module) or pipeline, got "
                            f"{type(model).__name__}")
        if bf16_steps is not None:
            raise ValueError(f"bf16_steps: counts a pipeline's denoising steps (by its scheduler); got the model "
                             f"{type(model).__name__}: pass the pipeline")
        return _apply_model(model, policy, fallback, type(model).__name__, block_mask)
    denoisers = _denoisers(model)
    if not denoisers:
        raise ValueError(f"model: the pipeline {type(model).__name__} has no transformer or unet component "
                         f"(components: {sorted(model.components)})")
    wrapped, skipped = {}, []
    for name, comp in denoisers:
        try:
            wrapped[name] = _apply_model(comp, policy, fallback, f"{type(comp).__name__} ({name})", block_mask)
        except ValueError as exc:
            skipped.append(f"{name}: {str(exc).removeprefix('model: ')}")
    if not wrapped:
        raise ValueError(f"model: no denoiser of {type(model).__name__} can be routed: " + " | ".join(skipped))
    for why in skipped:
        warnings.warn(f"open_vc_attn: {type(model).__name__}.{why}", FallbackWarning, stacklevel=2)
    if bf16_steps is not None:
        _set_bf16_steps(model, [(n, c) for n, c in denoisers if n in wrapped], bf16_steps)
    return wrapped


def _remove_model(model):
    removed = 0
    for module, proc in _diffusers_processors.dispatch_modules(model):
        if isinstance(proc, _OpenVCProcessor):
            inner = proc._openvc_inner
            if proc._openvc_saved_backend is _NO_BACKEND_ATTR:
                del inner._attention_backend
            else:
                inner._attention_backend = proc._openvc_saved_backend
            module.processor = inner
            removed += 1
    removed += _diffusers_processors.uninstall(model)
    routes = _routes_of.get(model)
    if routes is not None:
        routes.block_mask = None
    if routes is not None and routes.hook is not None:
        routes.hook.remove()
        routes.hook = None
    if routes is not None and routes.steps is not None:
        routes.steps.remove()           # (shared by the pipeline's denoisers: removing twice is harmless)
        routes.steps = None
    return removed


def remove(model):
    """Undoes :func:`apply`: puts the original processors (and their explicit backends) back. Returns the
    number restored (a dict per denoiser for a pipeline)."""
    if _is_pipeline(model):
        return {name: _remove_model(comp) for name, comp in _denoisers(model)}
    return _remove_model(model)


def stats(model=None):
    """``{(path, reason): calls}`` since the last :func:`reset_stats` (eager calls; path is "openvc",
    "openvc-block-sparse" (a call with a block mask) or "fallback"): of every call, or of the calls of one
    model that :func:`apply` wrapped (kept after :func:`remove`)."""
    if model is None:
        return dict(_state.counts)
    routes = _routes_of.get(model)
    if routes is None:
        raise ValueError(f"model: {type(model).__name__} was never wrapped by apply()")
    return dict(routes.counts)


def reset_stats():
    """Clears the counts (all of them, per model too; the one-time warning is not re-armed)."""
    _state.counts.clear()
    for routes in list(_routes_of.values()):
        routes.counts.clear()


def reset_auto(model=None):
    """Forgets the formats that ``qk_format="auto"`` chose, of every module (model None) or of the wrapped
    modules of one model or pipeline: each chooses again on its next openvc call (eagerly: see
    :mod:`._auto_format`). remove() and apply() again does the same."""
    if model is None:
        _auto.reset()
        return
    models = [comp for _, comp in _denoisers(model)] if _is_pipeline(model) else [model]
    for m in models:
        for _, proc in _diffusers_processors.processors(m):
            if isinstance(proc, (_OpenVCProcessor, _diffusers_processors.DirectProcessor)):
                _auto.reset(proc)
