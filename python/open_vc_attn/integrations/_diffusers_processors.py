"""openvc processors for the diffusers video models whose attention processors call torch SDPA themselves
instead of diffusers' ``dispatch_attention_fn`` (diffusers 0.42.1: CogVideoX 1.0 / 1.5 and ConsisID, Mochi,
EasyAnimate), so that no diffusers attention backend, openvc's included, sees their calls.

:func:`open_vc_attn.integrations.diffusers.apply` puts one of these in place of each such processor (the
original is kept in ``_openvc_inner`` and put back by ``remove``). A processor computes q, k and v with the
same module calls, in the same order, as the diffusers processor it replaces (the code below follows
diffusers 0.42.1's), then hands them, in openvc's ``[B, S, H, D]`` layout, to ``route``:
``route(processor, q, k, v, native, key_mask=None, key_counts=None) -> (out [B, S, H, D], on_openvc)``, which is the
integration's (:func:`open_vc_attn.integrations.diffusers._direct_attention`: the shared policy, the first
BF16 steps, the stats, the openvc call, and with ``qk_format="auto"`` the format chosen for this processor
object). ``native`` is the original's own torch SDPA call on the same tensors: it runs when the policy
does not take the call, so the output is then the original processor's bit for bit. Arguments a
processor here does not handle (an ``attention_mask`` where the model passes none, a Mochi mask that is
not ``[B, T]``) send the call to the original processor whole, its reason counted through ``skip``.

The functions at the end find a model's attention processors for ``apply``: those that call diffusers'
dispatch (:func:`dispatch_modules`, wrapped by the integration), those replaced here
(:func:`direct_modules`, :func:`install`, :func:`uninstall`), and why a model has neither
(:func:`no_route_reason`).

Importing this module imports neither torch nor diffusers.
"""
from __future__ import annotations

__all__ = ["DirectProcessor", "CogVideoXProcessor", "MochiProcessor", "EasyAnimateProcessor", "replacement",
           "processors", "dispatch_modules", "direct_modules", "install", "uninstall", "no_route_reason"]


class DirectProcessor:
    """Base: one replaced processor. route/skip come from the integration (bound to the model's policy and
    counts; route takes the processor first: the owner of its auto format choice); every attribute other
    than ``_openvc_*`` reads from the original processor."""

    replaces = ()          # the names of the diffusers processor classes this class stands in for

    def __init__(self, inner, route, skip):
        self._openvc_inner = inner
        self._openvc_route = route
        self._openvc_skip = skip

    def __getattr__(self, name):
        if name.startswith("_openvc_"):
            raise AttributeError(name)
        return getattr(self._openvc_inner, name)

    def _original(self, reason, *args, **kwargs):
        """The whole call on the original processor (counted as a fallback with its reason)."""
        self._openvc_skip(reason)
        return self._openvc_inner(*args, **kwargs)

    def _route_unmasked(self, query, key, value):
        """[B, H, S, D] q, k, v of an unmasked, non-causal joint attention through the route: the output
        [B, S, H, D], the original's own SDPA call when the policy does not take it."""
        import torch.nn.functional as F

        def native():
            return F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                                  is_causal=False).transpose(1, 2)

        out, _ = self._openvc_route(self, *_bhsd_to_bshd(query, key, value), native)
        return out


def _rope_after_text(attn, query, key, text_len, image_rotary_emb):
    """The rotary embedding of the video tokens (those after the first text_len), in place as diffusers'
    CogVideoX and EasyAnimate processors apply it: queries, and keys unless the attention is cross-attention.
    Where openvc's kernel runs (:func:`_kernel_rope_reason`), one pass per tensor with diffusers' bits
    (open_vc_attn.rotary) instead of apply_rotary_emb's eight elementwise kernels through FP32 temporaries."""
    tensors = (query,) if attn.is_cross_attention else (query, key)
    videos = [x[:, :, text_len:].transpose(1, 2) for x in tensors]   # [B, S, H, D] views of the video rows
    tables = None
    if isinstance(image_rotary_emb, (tuple, list)) and len(image_rotary_emb) == 2:
        _, s, h, d = videos[0].shape
        tables = _rotary_tables([(v, v) for v in videos], *image_rotary_emb, (s, d),
                                lambda t: interleaved_table_view(t, h))
    if tables is None:
        from diffusers.models.embeddings import apply_rotary_emb
        for x in tensors:
            x[:, :, text_len:] = apply_rotary_emb(x[:, :, text_len:], image_rotary_emb)
        return
    from ..rotary import rotary_pairs
    for video in videos:
        rotary_pairs(video, *tables, out=video)


def _kernel_rope_reason(*tensors):
    """None when openvc's rotary kernel runs here for these tensors (CUDA tensors on a Hopper GPU, no autograd, an
    extension with the kernel), else why not. The call's own rules (dtype, strides, alignment, overlap) are
    open_vc_attn._checks_rotary's, which :func:`_rotary_tables` runs."""
    import torch
    from .policy import device_reason
    for t in tensors:
        if t.device.type != "cuda":
            return f"device {t.device}"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd"
    return device_reason(tensors[0].device) or _extension_reason()


_extension_has_rotary = None


def _extension_reason():
    """None when the installed extension has the rotary kernel (an older build does not), else why not."""
    global _extension_has_rotary
    if _extension_has_rotary is None:
        from .. import _ext
        try:
            _extension_has_rotary = hasattr(_ext.load(), "RotaryPairsParams")
        except ImportError:
            _extension_has_rotary = False
    return None if _extension_has_rotary else "the extension has no rotary kernel (built before it, or not built)"


def interleaved_table_view(t, heads):
    """diffusers' per-element [S, D] table (apply_rotary_emb, unbind dim -1) as the kernel's [S, H, D / 2, 2] view
    (shared by the heads)."""
    s, d = t.shape
    return t.view(s, 1, d // 2, 2).expand(s, heads, d // 2, 2)


def pair_table_view(t):
    """Mochi's per-pair [S, H, D / 2] table as the kernel's [S, H, D / 2, 2] view (shared by a pair's two elements)."""
    return t.unsqueeze(-1).expand(*t.shape, 2)


def _rotary_tables(tensors, cos, sin, table_shape, as_pairs):
    """The kernel's FP32 [S, H, D / 2, 2] views of (cos, sin) for the tensors, given as (x, out) pairs (x [B, S, H,
    D]; out is x in place); as_pairs maps one table to them. None where the kernel would refuse a call or the
    tables are of another form (the processors then run diffusers' own form)."""
    import torch
    from .._checks_rotary import check_rotary_args, check_rotary_pointers
    if not all(isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(table_shape) and not t.requires_grad
               and t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in (cos, sin)):
        return None   # (a float64 table: diffusers computes in float64, which the kernel does not)
    flat = [t for pair in tensors for t in pair]
    if _kernel_rope_reason(*flat) is not None:
        return None
    tables = tuple(as_pairs(t.to(device=flat[0].device, dtype=torch.float32)) for t in (cos, sin))
    try:   # the rules the call itself would apply: diffusers' form instead of an error inside the forward
        for x, out in tensors:
            check_rotary_args(x, *tables, out, in_place=out is x)
            check_rotary_pointers(x, None if out is x else out)
    except (TypeError, ValueError):
        return None
    return tables


def _bhsd_to_bshd(*tensors):
    """[B, H, S, D] -> [B, S, H, D] views (openvc takes these strides without a copy: head dim contiguous)."""
    return tuple(t.transpose(1, 2) for t in tensors)


class CogVideoXProcessor(DirectProcessor):
    """CogVideoX 1.0 / 1.5 and ConsisID (``CogVideoXAttnProcessor2_0``, ``FusedCogVideoXAttnProcessor2_0``):
    joint attention over ``[text; video]`` (226 + S tokens), head dim 64, no mask, not causal, SDPA's
    default scale."""

    replaces = ("CogVideoXAttnProcessor2_0", "FusedCogVideoXAttnProcessor2_0")

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            # diffusers' CogVideoX models pass none; the processor would expand one per head and query
            return self._original("attn_mask given to CogVideoX's processor (expanded per head and query)", attn,
                                  hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        import torch
        text_seq_length = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch_size = hidden_states.shape[0]
        if type(self._openvc_inner).__name__.startswith("Fused"):
            qkv = attn.to_qkv(hidden_states)
            query, key, value = torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (x.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for x in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:
            _rope_after_text(attn, query, key, text_seq_length, image_rotary_emb)
        out = self._route_unmasked(query, key, value)
        hidden_states = out.reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1)
        return hidden_states, encoder_hidden_states


class EasyAnimateProcessor(DirectProcessor):
    """EasyAnimate (``EasyAnimateAttnProcessor2_0``): joint attention over ``[text; video]``, head dim 64, no
    mask (the model passes none), not causal."""

    replaces = ("EasyAnimateAttnProcessor2_0",)

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            return self._original("attn_mask given to EasyAnimate's processor", attn, hidden_states,
                                  encoder_hidden_states, attention_mask, image_rotary_emb)
        import torch
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = (torch.cat([eq, query], dim=2), torch.cat([ek, key], dim=2),
                                 torch.cat([ev, value], dim=2))
        if image_rotary_emb is not None:
            _rope_after_text(attn, query, key, encoder_hidden_states.shape[1], image_rotary_emb)
        out = self._route_unmasked(query, key, value)
        hidden_states = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            t = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states[:, :t], hidden_states[:, t:]
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        elif getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states, encoder_hidden_states


class MochiProcessor(DirectProcessor):
    """Mochi (``MochiAttnProcessor2_0``): joint attention of each sample over its video tokens and its
    prompt's valid text tokens (``attention_mask`` [B, T], nonzero = valid), head dim 128. diffusers runs one
    SDPA per sample on the gathered valid tokens; here the whole batch is one openvc call over
    ``[video; text]`` with each sample's valid text tokens moved first (a stable sort of its T text rows), so
    that the kept keys are a prefix: key counts (video + valid text), no gather of the keys. The text outputs
    are then where diffusers puts them (the valid tokens' first, in order, then zeros). q and k are roped
    straight into the joint buffers, so the video rows of q and k are not copied again."""

    replaces = ("MochiAttnProcessor2_0",)

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb=None):
        import torch
        batch, text_len = hidden_states.shape[0], encoder_hidden_states.shape[1]
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape[0] != batch \
                or attention_mask.numel() != batch * text_len:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            return self._original(f"Mochi attention_mask {shape} (takes a text mask [B, T] = [{batch}, {text_len}])",
                                  attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if attention_mask.device != hidden_states.device:
            # the text rows are reordered with the mask on the activations' device (no host copy in the call)
            return self._original(f"Mochi attention_mask on {attention_mask.device}, hidden states on "
                                  f"{hidden_states.device}", attn, hidden_states, encoder_hidden_states, attention_mask,
                                  image_rotary_emb)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        eq = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        ek = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        ev = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        video_len = query.shape[1]
        q_all, k_all = (x.new_empty(batch, video_len + text_len, *x.shape[2:]) for x in (query, key))
        if image_rotary_emb is not None:
            query = _mochi_rope(torch, query, *image_rotary_emb, out=q_all[:, :video_len])
            key = _mochi_rope(torch, key, *image_rotary_emb, out=k_all[:, :video_len])
        else:
            q_all[:, :video_len], k_all[:, :video_len] = query, key
        valid = attention_mask.reshape(batch, text_len) != 0

        def native():
            return _mochi_per_sample(torch, query, key, value, eq, ek, ev, valid).transpose(1, 2)

        # each sample's valid text rows first (in order): its kept keys are then the first video + n of them
        order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)[:, :, None, None].expand_as(ek)
        n_valid = valid.sum(dim=1, dtype=torch.int32)
        q_all[:, video_len:], k_all[:, video_len:] = torch.gather(eq, 1, order), torch.gather(ek, 1, order)
        v_all = torch.cat([value, torch.gather(ev, 1, order)], dim=1)
        counts = n_valid + video_len
        keep = torch.arange(video_len + text_len, device=valid.device)[None, :] < counts[:, None]
        out, on_openvc = self._openvc_route(self, q_all, k_all, v_all, native, key_mask=keep, key_counts=counts)
        if on_openvc:   # the rows of padded text tokens (the keys past the counts): zeros, as diffusers leaves them
            out[:, video_len:].masked_fill_(~keep[:, video_len:, None, None], 0)
        hidden_states = out.flatten(2, 3)
        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes((video_len, text_len), dim=1)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def _mochi_rope(torch, x, freqs_cos, freqs_sin, out):
    """diffusers 0.42.1 MochiAttnProcessor2_0's rotary embedding (interleaved pairs, FP32 math), the same values
    written into ``out`` ([B, S, H, D], a slice of a joint buffer) and returned: with openvc's kernel where it
    runs (one pass, the same bits: open_vc_attn.rotary), else with diffusers' elementwise math."""
    s, h, d = x.shape[1], x.shape[2], x.shape[3]
    tables = _rotary_tables([(x, out)], freqs_cos, freqs_sin, (s, h, d // 2), pair_table_view)
    if tables is not None:
        from ..rotary import rotary_pairs
        return rotary_pairs(x, *tables, out=out)
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        # autograd takes no out= (such a call goes to the original processor: openvc is inference-only)
        out.copy_(torch.stack([cos, sin], dim=-1).flatten(-2))
        return out
    for b in range(out.shape[0]):
        # sample by sample: each sample's rows are contiguous in out (into the strided batch view, torch would
        # write the two halves as two copies of every other element)
        torch.stack([cos[b], sin[b]], dim=-1, out=out[b].unflatten(-1, (-1, 2)))
    return out


def _mochi_per_sample(torch, query, key, value, eq, ek, ev, valid):
    """diffusers 0.42.1 MochiAttnProcessor2_0's attention (the fallback): per sample, SDPA over the video and
    the valid text tokens, zero rows after them. Inputs [B, S, H, D]; output [B, H, S + T, D]."""
    import torch.nn.functional as F
    q, k, v, eq, ek, ev = (t.transpose(1, 2) for t in (query, key, value, eq, ek, ev))
    total = q.size(2) + eq.size(2)
    outs = []
    for idx in range(q.shape[0]):
        ids = torch.nonzero(valid[idx].flatten(), as_tuple=False).flatten()
        out = F.scaled_dot_product_attention(torch.cat([q[idx:idx + 1], eq[idx:idx + 1, :, ids, :]], dim=2),
                                             torch.cat([k[idx:idx + 1], ek[idx:idx + 1, :, ids, :]], dim=2),
                                             torch.cat([v[idx:idx + 1], ev[idx:idx + 1, :, ids, :]], dim=2),
                                             dropout_p=0.0, is_causal=False)
        outs.append(F.pad(out, (0, 0, 0, total - out.size(2))))
    return torch.cat(outs, dim=0)


_CLASSES = (CogVideoXProcessor, MochiProcessor, EasyAnimateProcessor)
_BY_NAME = {name: cls for cls in _CLASSES for name in cls.replaces}


def replacement(proc):
    """The openvc class for a diffusers processor that calls torch SDPA itself, or None. Matched by class
    name and defining module (diffusers'), so that a user's own subclass is left alone."""
    cls = type(proc)
    if not cls.__module__.startswith("diffusers."):
        return None
    return _BY_NAME.get(cls.__name__)


# ---- a model's attention processors (for the integration's apply / remove) -------------------------------

def processors(model):
    """(module, processor) of every module of ``model`` with a callable ``processor``."""
    for _, module in model.named_modules():
        proc = getattr(module, "processor", None)
        if proc is not None and callable(proc):
            yield module, proc


# Processors that call dispatch_attention_fn without an _attention_backend attribute (diffusers 0.42.1): their
# calls run on the active backend, so the integration's wrapper routes them like the others.
DISPATCH_WITHOUT_BACKEND_ATTR = ("CosmosAttnProcessor2_0", "CosmosAttnProcessor2_5")

# Processors that call dispatch_attention_fn with a backend of their own, which the active backend does not
# override (diffusers 0.42.1): AnyFlow-FAR's causal self-attention and the LTX-2 diffusion decoder's neighborhood
# attention (each raises unless its _attention_backend is flex, whose BlockMask element rule it builds for) and
# Kandinsky 6 SR's (names flex in each call, 64-token NABLA blocks). apply() leaves them as they are: their calls
# run there, outside openvc's routing and counts.
KEEP_OWN_BACKEND = ("AnyFlowCausalAttnProcessor", "LTX2VideoVaeNeighborhoodAttnProcessor", "Kandinsky6SRAttnProcessor")


def _diffusers_class_in(proc, names):
    return type(proc).__name__ in names and type(proc).__module__.startswith("diffusers.")


def dispatch_modules(model):
    """(module, processor) of the processors that call diffusers' dispatch (they have _attention_backend, or
    are of the classes above), but those that keep their own backend."""
    return [(m, p) for m, p in processors(model) if not _diffusers_class_in(p, KEEP_OWN_BACKEND)
            and (hasattr(p, "_attention_backend") or _diffusers_class_in(p, DISPATCH_WITHOUT_BACKEND_ATTR))]


def direct_modules(model):
    """(module, processor, openvc class) of the processors that call torch SDPA themselves and have an
    openvc replacement (CogVideoX, ConsisID, Mochi, EasyAnimate)."""
    found = []
    for module, proc in processors(model):
        cls = replacement(proc)
        if cls is not None:
            found.append((module, proc, cls))
    return found


def install(model, route, skip):
    """Replaces the processors of :func:`direct_modules` with openvc's (route, skip: see the module doc).
    Returns the number replaced."""
    found = direct_modules(model)
    for module, proc, cls in found:
        module.processor = cls(proc, route, skip)
    return len(found)


def uninstall(model):
    """Puts the originals of the replaced processors back. Returns the number restored."""
    restored = 0
    for module, proc in processors(model):
        if isinstance(proc, DirectProcessor):
            module.processor = proc._openvc_inner
            restored += 1
    return restored


def no_route_reason(model, tested_version):
    """Why openvc can route none of ``model``'s attention calls (neither dispatch nor replaced processors)."""
    names = sorted({type(p).__name__ for _, p in processors(model)})
    if not names:
        return f"{type(model).__name__} has no attention processors"
    own = [n for n in names if n in KEEP_OWN_BACKEND]
    direct = [n for n in names if n not in KEEP_OWN_BACKEND]
    parts = []
    if direct:
        parts.append(f"{type(model).__name__}'s attention processors ({', '.join(direct)}) compute attention "
                     f"themselves (torch.nn.functional.scaled_dot_product_attention) instead of calling diffusers' "
                     f"dispatch_attention_fn, so no diffusers attention backend, openvc included, sees their calls, "
                     f"and openvc has no replacement for them")
    if own:
        parts.append(f"{'its' if direct else type(model).__name__ + chr(39) + 's'} attention processors "
                     f"({', '.join(own)}) call dispatch_attention_fn with a backend they name themselves (flex), which "
                     f"no active backend, openvc included, overrides")
    return "; ".join(parts) + f" (diffusers {tested_version}; docs/integrations/diffusers.md has a row per model)"
