"""``DispatchPolicy(qk_format="auto")``: each attention module's format, chosen on its first openvc call.

The module (a wrapped or replaced diffusers processor, an SGLang attention impl, a yunchang processor)
whose call the policy first sends to openvc runs that call once per candidate format, fastest first,
through the integration's own openvc call (``open_vc_attn.attention`` with the call's arguments), and compares each
output on :data:`SAMPLE_ROWS` query rows with exact attention of those rows (FP32 scores and softmax over
all of their keys, in torch). The first format whose rel L2 is <= the policy's ``auto_tolerance`` runs the
module's calls from then on (its output of this call is returned, not computed again); when none is, the
module's calls go to the framework's attention, with the errors as the reason.

Candidates, fastest first (complete calls at S = 32,760, H = 40 on the H200, docs/performance.md, fourth
session): E4M3 17.77 ms; INT8 + K smoothing 19.84 ms (0.90x E4M3's speed); INT8 + K smoothing + exp2 P
24.93 ms (0.71x); the same with the V bias correction (``v_bias_correction=True``, docs/numerics.md section 4:
about 0.1% slower at that size, a few % at S = 4,096; the most accurate, N(0,1) inputs 3.79% -> 3.42% rel L2
on an H100, bench/results/2026-12-05-h100-thirtieth/). A call that returns its LSE (ring attention merges by
it) tries the same formats: open_vc_attn.attention returns the LSE of the keys as given with K smoothing
(docs/numerics.md section 9). INT8 is dropped past the fast path's size range (it has no general path), exp2 P
and the V bias correction for a block-sparse call (open_vc_attn.attention does not combine them with block
lists); the exact rows of a block-sparse call see its listed blocks whole, the attention openvc computes.
E4M3 + K smoothing is no candidate: it helps only where K has a channel offset, and there INT8 + K smoothing is
far more accurate (docs/performance.md: 8.11% against 3.80%) at 0.90x the time.

Keying: one choice per (module, call class), the class being (causal, key padding mask, LSE returned,
packed, block mask). A format's error follows the module's q/k statistics (its weights), which its calls at other
lengths and steps share; causal, masked and packed calls are other attention problems, and an LSE call
is kept apart too (its consumer, a ring merge, is another use of the result). Not keyed by shape: a new
resolution does not choose again (choosing costs up to 4 calls and a host read). Reset:
:meth:`AutoChoices.reset` (the integrations' ``reset_auto``).

Cost and synchronization: the choosing call runs up to 4 openvc calls and exact attention of the sampled
rows (their keys and values gathered in FP32, in blocks of about 256 MiB), holds the candidates' outputs
until the choice, and reads the errors back to the host once (``.tolist()``): the only host
synchronization of the integrations. A CUDA graph can therefore capture a module's calls only after its
first eager call: choosing while the current stream captures raises RuntimeError.

Imports torch when a choice is made.
"""
from __future__ import annotations

import dataclasses
import math
import weakref

from .. import _checks
from . import policy as _policy

__all__ = ["SAMPLE_ROWS", "CANDIDATES", "Choice", "AutoChoices", "sample_rows"]

SAMPLE_ROWS = 256        # enough for a stable rel L2 of a module's rows; a small part of a call's work
# (name, qk_format, k_smoothing, p_format, v_bias_correction), fastest first (docs/performance.md, see the module
# doc); the last one is the most accurate
CANDIDATES = (("e4m3", "e4m3", False, "expcast", False), ("int8+k_smoothing", "int8", True, "expcast", False),
              ("int8+k_smoothing+exp2", "int8", True, "exp2", False),
              ("int8+k_smoothing+exp2+v_bias", "int8", True, "exp2", True))

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_BLOCK_BYTES = 256 << 20     # FP32 keys and values of the sampled rows gathered at a time


@dataclasses.dataclass(frozen=True)
class Choice:
    """The format of one module's calls of one class. policy: the fixed-format DispatchPolicy its openvc
    calls use, or None (the framework's attention runs them). errors: ((candidate, rel L2), ...) in the order
    tried. reason: what stats() count the calls under."""
    policy: object
    errors: tuple
    tolerance: float

    @property
    def path(self) -> str:
        return _policy.FALLBACK if self.policy is None else _policy.OPENVC

    @property
    def reason(self) -> str:
        if self.policy is None:
            tried = ", ".join(f"{name} {err:.3f}" for name, err in self.errors)
            return f"auto: no format within rel L2 {self.tolerance:g} ({tried})"
        err = self.errors[-1][1]            # the chosen one is the last tried
        label = self.policy.format_label or "qk_format=e4m3"
        return f"{label} (auto: rel L2 {err:.3f} <= {self.tolerance:g})"


def sample_rows(batch: int, rows: int, heads: int, n: int = SAMPLE_ROWS):
    """The sampled (batch, row, head) triples, deterministic: n = min(n, batch * rows * heads); sample j is in
    (batch, head) pair p = (j * batch * heads) // n (pairs spread evenly; each pair at most once when there
    are more pairs than samples), at row floor(frac((j + 0.5) * 0.618...) * rows): a golden-ratio sequence,
    so that the rows of one pair spread over the positions."""
    n = min(n, batch * rows * heads)
    pairs = batch * heads
    out = []
    for j in range(n):
        p = (j * pairs) // n
        row = min(rows - 1, int(math.modf((j + 0.5) * _GOLDEN)[0] * rows))
        out.append((p // heads, row, p % heads))
    return out


def _capturing(torch) -> bool:
    # is_initialized first: the capture query itself needs a CUDA context (and a driver)
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _key_bias(mask, batch, keys, torch):
    """A key padding mask ([B, Sk], [B, 1, Sk], [B, 1, 1, Sk]; bool True = attend, or additive) as the
    additive FP32 bias [B, Sk] the framework would apply."""
    flat = mask.reshape(batch, keys)
    if flat.dtype == torch.bool:
        return torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).masked_fill(~flat, float("-inf"))
    return flat.float()


def _block_rows(block_mask, b, i, h, keys, torch):
    """The keys each sampled row (b[n], i[n], h[n]) sees under a BlockMask as openvc applies it (every listed
    128-key block of the row's query tile whole, open_vc_attn.masks.block_lists): bool [n, Sk]."""
    from .. import masks
    counts, indices = masks.block_lists(block_mask)
    bb = b if counts.shape[0] > 1 else torch.zeros_like(b)      # dims of 1 broadcast over batch and heads
    hh = h if counts.shape[1] > 1 else torch.zeros_like(h)
    row = (bb, hh, torch.div(i, masks.BLOCK_SIZE, rounding_mode="floor"))
    tiles = indices.shape[-1]
    listed = torch.arange(tiles, device=b.device)[None, :] < counts[row][:, None]
    seen = torch.zeros(b.numel(), tiles + 1, dtype=torch.bool, device=b.device)
    seen.scatter_(1, torch.where(listed, indices[row].long(), tiles), True)
    return seen[:, :tiles].repeat_interleave(masks.BLOCK_SIZE, dim=1)[:, :keys]


def _exact_rows(q, k, v, b, i, h, scale, causal, bias, lo, hi, torch, seen=None):
    """Exact attention of rows (b[n], i[n], h[n]) of q [B, Sq, H, D] over k, v [B, Sk, Hk, D]: [n, Dv] FP32
    (Hk dividing H, GQA / MQA: query head h attends K/V head h // (H // Hk)).
    causal: key j visible iff j <= i + Sk - Sq; bias [B, Sk] additive; lo, hi [n]: each row's key range
    (packed sequences); seen: bool [n, Sk], the keys of each row (block masks). A row that sees no key is 0."""
    n, sq, sk = b.numel(), q.shape[1], k.shape[1]
    qs = q[b, i, h].float()
    h = torch.div(h, q.shape[2] // k.shape[2], rounding_mode="floor")   # the K/V head of each row
    out = torch.empty(n, v.shape[3], dtype=torch.float32, device=q.device)
    per = max(1, _BLOCK_BYTES // (4 * sk * (k.shape[3] + v.shape[3])))
    j = torch.arange(sk, device=q.device)[None, :]
    for c0 in range(0, n, per):
        sl = slice(c0, min(n, c0 + per))
        ks, vs = k[b[sl], :, h[sl]].float(), v[b[sl], :, h[sl]].float()       # [c, Sk, D]
        s = torch.bmm(ks, qs[sl, :, None])[..., 0] * scale                      # [c, Sk]
        if bias is not None:
            s = s + bias[b[sl]]
        if causal:
            s = s.masked_fill(j > i[sl, None] + (sk - sq), float("-inf"))
        if lo is not None:
            s = s.masked_fill((j < lo[sl, None]) | (j >= hi[sl, None]), float("-inf"))
        if seen is not None:
            s = s.masked_fill(~seen[sl], float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - m.masked_fill(torch.isinf(m), 0.0)[:, None])         # rows that see nothing: 0
        out[sl] = torch.bmm(p[:, None, :], vs)[:, 0]
    return out


def _rel_l2(rows, exact, valid, torch):
    diff = rows.float() - exact
    if valid is not None:
        diff, exact = diff * valid[:, None], exact * valid[:, None]
    num, den = diff.norm(), exact.norm()
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.where(num > 0, math.inf, 0.0))


def _choose(policy, run, q, k, v, scale, causal, key_padding_mask, return_lse, cu_seqlens, lengths, block_mask):
    import torch
    if _capturing(torch):
        raise RuntimeError("qk_format='auto': this attention module has not chosen its format yet, and choosing "
                           "reads the candidates' errors back to the host, which CUDA graph capture does not "
                           "allow: run one eager call of every module (e.g. one forward or denoising step) "
                           "before capturing")
    packed = cu_seqlens is not None
    q4, k4, v4 = (x.unsqueeze(0) for x in (q, k, v)) if packed else (q, k, v)
    batch, sq, heads, d = q4.shape
    sk = k4.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    candidates = CANDIDATES
    if not _checks.fast_path_range(*(lengths or (sq, sk))):
        candidates = tuple(c for c in candidates if c[1] != "int8")
    if block_mask is not None:   # block lists combine with neither exp2 P nor the V bias correction (attention())
        candidates = tuple(c for c in candidates if c[3] != "exp2" and not c[4])
    b, i, h = (torch.tensor(col, dtype=torch.long, device=q.device) for col in zip(*sample_rows(batch, sq, heads)))
    bias = None if key_padding_mask is None else _key_bias(key_padding_mask, batch, sk, torch)
    lo = hi = valid = None
    if packed:          # queries and keys share the offsets (self-attention): each row's key range
        cu = cu_seqlens.long()
        seq = (torch.searchsorted(cu, i, right=True) - 1).clamp(0, cu.numel() - 2)
        lo, hi = cu[seq], cu[seq + 1]
        valid = ((i >= lo) & (i < hi)).float()   # rows past the last sequence are no attention rows
    seen = None if block_mask is None else _block_rows(block_mask, b, i, h, sk, torch)
    exact = _exact_rows(q4, k4, v4, b, i, h, scale, causal, bias, lo, hi, torch, seen)
    errors, results, policies = [], [], []
    for _, fmt, smooth, pfmt, vbias in candidates:
        pol = dataclasses.replace(policy, qk_format=fmt, k_smoothing=smooth, p_format=pfmt, v_bias_correction=vbias)
        res = run(pol)
        out = res[0] if return_lse else res
        errors.append(_rel_l2((out.unsqueeze(0) if packed else out)[b, i, h], exact, valid, torch))
        results.append(res)
        policies.append(pol)
    values = torch.stack(errors).tolist()        # the one device-to-host read
    tried = []
    for (name, *_), pol, res, err in zip(candidates, policies, results, values):
        tried.append((name, err))
        if err <= policy.auto_tolerance:
            return Choice(pol, tuple(tried), policy.auto_tolerance), res
    return Choice(None, tuple(tried), policy.auto_tolerance), None


class AutoChoices:
    """The choices of one integration, per owner (the object whose calls they are, held weakly: a new
    wrapper or impl chooses again) and call class."""

    def __init__(self):
        self._by_owner = weakref.WeakKeyDictionary()

    def choices(self, owner) -> dict:
        """{(causal, masked, lse, packed, block_mask): Choice} of one owner."""
        return dict(self._by_owner.get(owner, {}))

    def reset(self, owner=None):
        """Forgets the choices of ``owner`` (all when None): its next openvc call chooses again."""
        if owner is None:
            self._by_owner.clear()
        else:
            self._by_owner.pop(owner, None)

    def choose(self, owner, policy, run, q, k, v, *, scale=None, causal=False, key_padding_mask=None,
               return_lse=False, cu_seqlens=None, lengths=None, block_mask=None):
        """``(choice, result)`` for an openvc call of ``owner`` under the auto ``policy``: the kept choice and
        None, or on the owner's first call of this class the new choice and, when it is a format, ``run``'s
        result in that format for this call (else None: the caller runs the framework's attention).

        run(policy) makes the call in a fixed-format policy's format and returns what the integration
        returns from openvc: the output [B, Sq, H, D] (packed: [T, H, D]), or (output, lse) with
        return_lse. q, k, v: [B, S, H, D] or packed [T, H, D] with cu_seqlens (int32 offsets shared by
        queries and keys); scale None: 1/sqrt(D); key_padding_mask: as choose_path takes it; lengths:
        (Sq, Sk) per sequence for the INT8 range rule (default: q's and k's); block_mask: the FlexAttention
        BlockMask of a block-sparse call (batched), whose listed blocks the exact rows see whole, as openvc does."""
        if owner is None:
            raise RuntimeError("qk_format='auto' needs the attention module of the call (an integration bug)")
        cls = (bool(causal), key_padding_mask is not None, bool(return_lse), cu_seqlens is not None,
               block_mask is not None)
        known = self._by_owner.get(owner)
        if known is not None and cls in known:
            return known[cls], None
        choice, result = _choose(policy, run, q, k, v, scale, causal, key_padding_mask, return_lse, cu_seqlens,
                                 lengths, block_mask)
        self._by_owner.setdefault(owner, {})[cls] = choice
        return choice, result
