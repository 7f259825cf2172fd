"""The wrapper :func:`open_vc_attn.integrations.diffusers.apply` puts around each attention processor that calls
diffusers' dispatch: the processor's calls run inside the routing the integration gives (``enter``: openvc as
the active backend, the wrapper's policy, routes and fallback), and its attributes stay the inner processor's.
Imports neither torch nor diffusers.
"""
from __future__ import annotations

import functools

__all__ = ["NO_BACKEND_ATTR", "OpenVCProcessor", "wrapper_class"]

NO_BACKEND_ATTR = object()     # what OpenVCProcessor saves for processors without _attention_backend


class OpenVCProcessor:
    """Wraps one attention processor: its calls run with openvc as the active backend and the processor's
    own backend (if any) as the fallback. ``_attention_backend`` reads and writes that fallback, so a later
    ``set_attention_backend`` on the model changes the general path of the wrapped modules; every other
    attribute (``_parallel_config``, which ``enable_parallelism`` sets, ...) is the inner processor's.
    ``enter(wrapper)``: the context manager a call runs in (the integration's routing)."""

    def __init__(self, inner, policy, routes, enter):
        object.__setattr__(self, "_openvc_inner", inner)
        object.__setattr__(self, "_openvc_policy", policy)
        object.__setattr__(self, "_openvc_routes", routes)
        object.__setattr__(self, "_openvc_enter", enter)
        saved = getattr(inner, "_attention_backend", NO_BACKEND_ATTR)
        object.__setattr__(self, "_openvc_saved_backend", saved)
        object.__setattr__(self, "_openvc_fallback",
                           None if saved is NO_BACKEND_ATTR else getattr(saved, "value", saved))
        inner._attention_backend = None    # so that dispatch reads the active backend

    @property
    def _attention_backend(self):
        return self._openvc_fallback

    def __setattr__(self, name, value):
        if name == "_attention_backend":
            object.__setattr__(self, "_openvc_fallback", getattr(value, "value", value))
        elif name.startswith("_openvc_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._openvc_inner, name, value)

    def __getattr__(self, name):           # everything else is the inner processor's
        if name.startswith("_openvc_"):
            raise AttributeError(name)
        return getattr(self._openvc_inner, name)

    def _openvc_call(self, *args, **kwargs):
        with self._openvc_enter(self):
            return self._openvc_inner(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def wrapper_class(inner_cls):
    """A wrapper class whose __call__ has the inner class's signature: some diffusers attention modules
    filter their kwargs by ``inspect.signature(processor.__call__)``."""
    def __call__(self, *args, **kwargs):
        return self._openvc_call(*args, **kwargs)
    functools.update_wrapper(__call__, inner_cls.__call__)
    return type(f"OpenVC{inner_cls.__name__}", (OpenVCProcessor,), {"__call__": __call__})
