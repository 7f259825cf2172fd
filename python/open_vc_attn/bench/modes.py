"""open-vc-attn-bench-modes: the fast path's call forms against the peers, in one process.

Cases (issue 15's acceptance shapes): dense D = 128 at S = 73,397; packed sequences totalling 73,397
tokens (against the dense call of the same total, same run); HunyuanVideo-like joint attention with
text padding (key padding mask and key counts; FLOPs counted on the valid tokens); causal (FLOPs
counted as half); head dim 64. Peers where importable: FlashAttention-3 BF16 and FP8 (flash_attn_interface
on PYTHONPATH, built as shared/tools/fa3-anchor.md says; FP8 on inputs pre-cast per (batch, head)) and
cuDNN BF16 through torch SDPA. Every entry of a case is timed as the product benchmark does (harness.Timer:
CUDA graphs of R calls >= 20 ms), in rounds whose entry order is shuffled; ratios are paired per round.

SageAttention2 (`sage2`, sageattention on PYTHONPATH, built as shared/tools/sage2-anchor.md says) runs next
to FA3 in the dense, causal and head-dim-64 cases: sageattn(q, k, v, tensor_layout="NHD", is_causal=causal),
quantization inside the call, timed EAGERLY (CUDA events around back-to-back calls; its launches do not
replay from a CUDA graph). Case `int8` (issue 25's acceptance shapes: dense S = 73,397 at H = 7 and 56,
S = 32,760 H = 40, causal S = 32,768 H = 7, D = 64 S = 24,576 H = 32) times openvc with Q/K in E4M3, INT8,
INT8 + K smoothing and INT8 + K smoothing with P = the E4M3 rounding of the exponential (``int8+smooth+exp2``:
p_format="exp2"; complete calls, CUDA graph and eager, and the kernel on a prepared input), SA2,
the FA3 FP8 kernel, FA3 BF16 and cuDNN BF16, and checks every output against cuDNN BF16 (rel L2) before
timing. The record holds the per-round samples and paired ratios (median and per round) of every openvc
entry against every peer, of each INT8 entry against its E4M3 counterpart, and of the exp2 entries against
their ExpCast twins (int8+smooth). Formats the installed build does not take (no qk_format, or no p_format /
no ``_openvc_ext.PFormat``) are left out with the reason under ``skipped``.

Case `kvcache` (issue 26, item 7): one denoising step of chunk-by-chunk video generation at Wan 1.3B 480p widths,
a 3-frame chunk (4,680 tokens, H = 12) after 18 cached frames of 1,560 tokens (32,760 keys in all): ``openvc``
is the step with open_vc_attn.kv_cache.FP8KVCache (the chunk's queries, keys and values prepared, the cached
ones quantized once before timing), ``openvc-full`` the complete call preparing every key again, against FA3
FP8 (pre-cast) and BF16 and cuDNN BF16 on the same shapes, each output checked against cuDNN BF16; and the same
step with 32 query / 8 K/V heads (a grouped cache, ``FP8KVCache(kv_heads=8)``; cuDNN on the repeated heads).

Case `cross` (issue 28's text cross-attention: 32,760 and 75,600 queries against 512 keys, H = 40): the
complete call, ``openvc-stepwise`` (prepare_fp8 of Q, K and V, then attention_fp8: the complete call without the
kernel's own Q quantization; also in the dense cases), the kernel on a prepared input (the preparation's share)
and FA3 BF16 / FP8 and cuDNN BF16 on the same inputs, each output checked against cuDNN BF16.

Case `short` (issue 28's short shapes): S = 4,096 H = 7, S = 8,192 H = 40, causal S = 16,384 H = 24, batch 2
S = 32,760 H = 12 as the dense case times them, and 8 packed sequences of 9,000 tokens at H = 24 with the peers
on the same tokens as a batch of 8 (equal lengths need no varlen call).

Case `gqa` (grouped-query attention: 32 query heads on 8 K/V heads, Cosmos 3's, at S = 32,760 dense and 32,768
causal; MQA, 24 on 1, at S = 16,384): the complete call, the same call on K/V with each head repeated (a caller
without GQA), the kernel on a prepared input, FA3 BF16 / FP8 and SA2 on the grouped K/V and cuDNN BF16 on the
repeated heads, each output checked against cuDNN BF16.

Case `sparse` (issue 26, item 8; bench/sparse.py says what it times): at S = 75,600 (21 x 3,600), H = 40, openvc
dense once, then openvc with block masks (temporal window +-2, frame causal, random densities 10 .. 100%,
radial) and chunked causal against torch.compile(flex_attention) BF16 on the same BlockMask; each record gets
a ``sparse`` dict (visited blocks, TF/s on them, ratios to dense, paired speedup over FlexAttention, rel L2)
and the JSON a ``sparse_acceptance`` list (issue 26's acceptance lines, printed pass / fail at the end).

    python -m open_vc_attn.bench.modes --cases dense,packed,padded,causal,d64 --rounds 5 --out modes.json
    python -m open_vc_attn.bench.modes --cases int8 --rounds 7 --out modes-int8.json
    python -m open_vc_attn.bench.modes --cases sparse --rounds 7 --out modes-sparse.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import time

from . import harness, sparse
from .harness import Eager

CASES = ("dense", "packed", "padded", "causal", "d64", "int8", "sparse", "kvcache", "cross", "short", "gqa")
# int8 needs issue 25's API, sparse issue 26's (and minutes of torch.compile): asked for by name
DEFAULT_CASES = ("dense", "packed", "padded", "causal", "d64")
# Formats of the int8 case: label -> keyword arguments of attention (docs: SPEC of issue 25). qk_format and
# k_smoothing are also prepare_fp8's; p_format is an attention option (attention, attention_fp8) only.
QK_FORMATS = {"e4m3": {"qk_format": "e4m3"}, "int8": {"qk_format": "int8"},
              "int8+smooth": {"qk_format": "int8", "k_smoothing": True},
              "int8+smooth+exp2": {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2"},
              "int8+smooth+exp2+vbias": {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2",
                                         "v_bias_correction": True}}
ATTENTION_ONLY = ("p_format",)   # keyword arguments of QK_FORMATS that prepare_fp8 does not take
CALL_ONLY = ("v_bias_correction",)   # options of the complete call alone (no kernel-on-a-prepared-input entry)
PEERS = ("sage2", "fa3-fp8", "fa3-bf16", "cudnn-bf16")


def _sage2():
    from .backends import Missing, sage2_function
    try:
        return sage2_function()
    except Missing:
        return None


def qk_format_support(ova) -> str:
    """None when open_vc_attn.attention and prepare_fp8 take qk_format and k_smoothing, else why not."""
    for name in ("attention", "prepare_fp8"):
        try:
            params = inspect.signature(getattr(ova, name)).parameters
        except (TypeError, ValueError, AttributeError) as exc:
            return f"open_vc_attn.{name}: signature not readable ({exc})"
        missing = [p for p in ("qk_format", "k_smoothing") if p not in params]
        if missing:
            return f"open_vc_attn.{name} takes no {', '.join(missing)} (issue 25's API is not in this build)"
    return None


def p_format_support(ova) -> str:
    """None when open_vc_attn.attention and attention_fp8 take p_format and the compiled extension has
    openvc::PFormat (``_openvc_ext.PFormat``), else why not (a build from before the P format: its exp2 entries
    are reported unavailable, never run as ExpCast)."""
    for name in ("attention", "attention_fp8"):
        try:
            params = inspect.signature(getattr(ova, name)).parameters
        except (TypeError, ValueError, AttributeError) as exc:
            return f"open_vc_attn.{name}: signature not readable ({exc})"
        if "p_format" not in params:
            return f"open_vc_attn.{name} takes no p_format (the P format is not in this build)"
    try:
        from .. import _ext
        ext = _ext.load()
    except ImportError as exc:
        return f"open_vc_attn._openvc_ext not loadable ({str(exc)[:200]})"
    if not hasattr(ext, "PFormat"):
        return "open_vc_attn._openvc_ext has no PFormat (an extension built before the P format; rebuild it)"
    return None


def v_bias_support(ova) -> str:
    """None when open_vc_attn.attention takes v_bias_correction, else why not (a build before the correction)."""
    try:
        params = inspect.signature(ova.attention).parameters
    except (TypeError, ValueError, AttributeError) as exc:
        return f"open_vc_attn.attention: signature not readable ({exc})"
    if "v_bias_correction" not in params:
        return "open_vc_attn.attention takes no v_bias_correction (not in this build)"
    return None


def _without_pdl(fn):
    """fn with the library's programmatic launches off (include/openvc/launch.h), the launch form before them,
    for a paired comparison in one process; None where the extension has no such setting."""
    try:
        from .. import _ext
        ext = _ext.load()
    except ImportError:
        return None
    if not hasattr(ext, "set_programmatic_launch"):
        return None

    def call():
        previous = ext.set_programmatic_launch(False)
        try:
            return fn()
        finally:
            ext.set_programmatic_launch(previous)
    return call


def _add_without_pdl(entries, name, fn):
    off = _without_pdl(fn)
    if off is not None:
        entries[name] = off


def _fa3():
    try:
        import flash_attn_interface as fa3
        return fa3
    except ImportError:
        return None


def _qkv(torch, b, s, h, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _sdpa(torch, q, k, v, causal=False, mask=None):
    """cuDNN BF16 attention through torch SDPA on [B, H, S, D]-contiguous copies (made once)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal)
    return call


def _fa3_entries(torch, q, k, v, causal):
    fa3 = _fa3()
    if fa3 is None:
        return {}
    from .backends import quantize_per_head
    # GQA / MQA (k with fewer heads): FA3 takes Q's descale per (batch, K/V head)
    (q8, dq), (k8, dk), (v8, dv) = quantize_per_head(q, k.shape[2]), quantize_per_head(k), quantize_per_head(v)
    return {"fa3-bf16": lambda: fa3.flash_attn_func(q, k, v, causal=causal),
            "fa3-fp8": lambda: fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=dq, k_descale=dk,
                                                  v_descale=dv)}


def _sage2_entries(q, k, v, causal):
    sageattn = _sage2()
    if sageattn is None:
        return {}
    return {"sage2": Eager(lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=causal))}


def _peer_entries(torch, q, k, v, causal):
    entries = _fa3_entries(torch, q, k, v, causal)
    entries.update(_sage2_entries(q, k, v, causal))
    return entries


def _dense_entries(torch, ova, b, s, h, d=128, causal=False, seed=0):
    q, k, v = _qkv(torch, b, s, h, d, seed)
    prepared = ova.prepare_fp8(q, k, v)
    entries = {"openvc": lambda: ova.attention(q, k, v, causal=causal),
               # the preparation of Q, K and V, then the kernel on it: the complete call without the fused Q
               "openvc-stepwise": lambda: ova.attention_fp8(ova.prepare_fp8(q, k, v), causal=causal),
               "openvc-kernel": lambda: ova.attention_fp8(prepared, causal=causal),
               "cudnn-bf16": _sdpa(torch, q, k, v, causal=causal)}
    _add_without_pdl(entries, "openvc-nopdl", entries["openvc"])
    entries.update(_peer_entries(torch, q, k, v, causal))
    flops = harness.attention_flops(b, h, s, s, d) * (0.5 if causal else 1.0)
    return entries, {e: flops for e in entries}


def _kv_entries(torch, ova, cached, chunk, h, d=128, hk=None):
    """The kvcache case: one step against an FP8 KV cache of `cached` tokens (appended in 1,560-token frames
    before timing), the complete call on every key, and the peers on the same q [1, chunk] and keys. hk: K/V heads
    (GQA: the cache keeps hk; FA3 takes the grouped keys, cuDNN the repeated ones)."""
    from ..kv_cache import FP8KVCache
    hk = h if hk is None else hk
    q, k_cur, v_cur = _qkv(torch, 1, chunk, h, d, 5)
    if hk != h:   # K/V of hk heads (the equal-head case keeps its inputs)
        _, k_cur, v_cur = _qkv(torch, 1, chunk, hk, d, 5)
    _, k_old, v_old = _qkv(torch, 1, cached, hk, d, 6)
    cache = FP8KVCache(1, h, d, capacity=cached + chunk, kv_heads=hk)
    for t in range(0, cached, 1560):
        cache.append(k_old[:, t:t + 1560], v_old[:, t:t + 1560])
    k_all, v_all = torch.cat([k_old, k_cur], 1), torch.cat([v_old, v_cur], 1)
    kr, vr = (k_all, v_all) if hk == h else (x.repeat_interleave(h // hk, dim=2) for x in (k_all, v_all))
    entries = {"openvc": lambda: cache.attention(q, k_cur, v_cur),
               "openvc-full": lambda: ova.attention(q, k_all, v_all),
               "cudnn-bf16": _sdpa(torch, q, kr, vr)}
    entries.update(_fa3_entries(torch, q, k_all, v_all, False))
    flops = harness.attention_flops(1, h, chunk, cached + chunk, d)
    return entries, {e: flops for e in entries}


def _cross_entries(torch, ova, sq, sk, h, d=128):
    """The cross case: Sq queries against Sk (few) keys, e.g. text cross-attention; the complete call, the
    kernel on a prepared input (so the preparation's share shows) and the peers on the same inputs."""
    q = _qkv(torch, 1, sq, h, d, 7)[0]
    _, k, v = _qkv(torch, 1, sk, h, d, 8)
    prepared = ova.prepare_fp8(q, k, v)
    entries = {"openvc": lambda: ova.attention(q, k, v),
               "openvc-stepwise": lambda: ova.attention_fp8(ova.prepare_fp8(q, k, v)),
               "openvc-kernel": lambda: ova.attention_fp8(prepared),
               "cudnn-bf16": _sdpa(torch, q, k, v)}
    _add_without_pdl(entries, "openvc-nopdl", entries["openvc"])
    entries.update(_fa3_entries(torch, q, k, v, False))
    flops = harness.attention_flops(1, h, sq, sk, d)
    return entries, {e: flops for e in entries}


def _gqa_entries(torch, ova, s, h, hk, d=128, causal=False):
    """The gqa case: h query heads on hk K/V heads in one call, the same call on K/V with each head repeated (what
    a caller runs without GQA), the kernel on a prepared input, the peers on the grouped K/V (FA3 and SA2 take
    GQA) and cuDNN BF16 on the repeated heads (the outputs' reference)."""
    q = _qkv(torch, 1, s, h, d, 9)[0]
    _, k, v = _qkv(torch, 1, s, hk, d, 10)
    kr, vr = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
    prepared = ova.prepare_fp8(q, k, v)
    entries = {"openvc": lambda: ova.attention(q, k, v, causal=causal),
               "openvc-repeated": lambda: ova.attention(q, kr, vr, causal=causal),
               "openvc-kernel": lambda: ova.attention_fp8(prepared, causal=causal),
               "cudnn-bf16": _sdpa(torch, q, kr, vr, causal=causal)}
    entries.update(_peer_entries(torch, q, k, v, causal))
    flops = harness.attention_flops(1, h, s, s, d) * (0.5 if causal else 1.0)
    return entries, {e: flops for e in entries}


def _qk_entries(torch, ova, b, s, h, d=128, causal=False, seed=0):
    """The int8 case: openvc with each Q/K format (complete call in a CUDA graph and eager, and the kernel on
    a prepared input) against the peers. Entries of a format the build does not take are left out; the
    returned skipped dict says why."""
    q, k, v = _qkv(torch, b, s, h, d, seed)
    entries, skipped = {}, {}
    why, p_why = qk_format_support(ova), p_format_support(ova)
    for label, kw in QK_FORMATS.items():
        if why is not None:
            if label != "e4m3":
                skipped[f"openvc-{label}"] = why
                continue
            kw = {}   # the E4M3 default of a build without qk_format
        if p_why is not None and any(a in kw for a in ATTENTION_ONLY):
            skipped[f"openvc-{label}"] = p_why
            continue
        v_why = v_bias_support(ova) if "v_bias_correction" in kw else None
        if v_why is not None:
            skipped[f"openvc-{label}"] = v_why
            continue
        prep_kw = {a: x for a, x in kw.items() if a not in ATTENTION_ONLY + CALL_ONLY}
        attn_kw = {a: x for a, x in kw.items() if a in ATTENTION_ONLY}

        def call(kw=kw):
            return ova.attention(q, k, v, causal=causal, **kw)
        entries[f"openvc-{label}"] = call
        entries[f"openvc-{label}-eager"] = Eager(call)
        if any(a in kw for a in CALL_ONLY):
            skipped[f"openvc-{label}-kernel"] = "the V bias correction is an option of the complete call only"
            continue
        try:
            prepared = ova.prepare_fp8(q, k, v, **prep_kw)
            entries[f"openvc-{label}-kernel"] = (lambda p=prepared, a=attn_kw: ova.attention_fp8(p, causal=causal,
                                                                                                  **a))
        except Exception as exc:   # recorded; the complete-call entries still run (and report their own error)
            skipped[f"openvc-{label}-kernel"] = f"prepare_fp8: {type(exc).__name__}: {exc}"[:300]
    entries["cudnn-bf16"] = _sdpa(torch, q, k, v, causal=causal)
    entries.update(_peer_entries(torch, q, k, v, causal))
    for peer, missing in (("fa3-fp8", _fa3() is None), ("fa3-bf16", _fa3() is None), ("sage2", _sage2() is None)):
        if missing:
            skipped[peer] = "not importable (flash_attn_interface / sageattention on PYTHONPATH?)"
    flops = harness.attention_flops(b, h, s, s, d) * (0.5 if causal else 1.0)
    return entries, {e: flops for e in entries}, skipped


def case_list(names):
    out = []
    for name in names:
        if name == "dense":
            out += [("dense-S73397-H%d" % h, dict(kind="dense", s=73397, h=h)) for h in (7, 14, 56)]
        elif name == "packed":
            for h in (7, 56):
                out.append(("packed-2x36698-H%d" % h, dict(kind="packed", lens=(36698, 36699), h=h)))
                out.append(("packed-3uneven-H%d" % h, dict(kind="packed", lens=(40000, 25000, 8397), h=h)))
        elif name == "padded":
            out.append(("padded-hunyuan-H24", dict(kind="padded", video=118800, text=256, pad=200, h=24)))
        elif name == "causal":
            out += [("causal-S32768-H7", dict(kind="dense", s=32768, h=7, causal=True)),
                    ("causal-S75600-H40", dict(kind="dense", s=75600, h=40, causal=True))]
        elif name == "d64":
            out += [("d64-S24576-H32", dict(kind="dense", s=24576, h=32, d=64)),
                    ("d64-S32760-H24", dict(kind="dense", s=32760, h=24, d=64))]
        elif name == "int8":   # issue 25's acceptance shapes
            out += [("int8-dense-S73397-H7", dict(kind="qk", s=73397, h=7)),
                    ("int8-dense-S73397-H56", dict(kind="qk", s=73397, h=56)),
                    ("int8-wan480-S32760-H40", dict(kind="qk", s=32760, h=40)),
                    ("int8-causal-S32768-H7", dict(kind="qk", s=32768, h=7, causal=True)),
                    ("int8-d64-S24576-H32", dict(kind="qk", s=24576, h=32, d=64))]
        elif name == "cross":   # issue 28's text cross-attention shapes (Wan: 512 umT5 text keys)
            out += [("cross-Sq32760-Sk512-H40", dict(kind="cross", sq=32760, sk=512, h=40)),
                    ("cross-Sq75600-Sk512-H40", dict(kind="cross", sq=75600, sk=512, h=40))]
        elif name == "short":   # issue 28's short shapes (Ulysses shards, 480p clips, packed short clips)
            out += [("short-S4096-H7", dict(kind="dense", s=4096, h=7)),
                    ("short-S8192-H40", dict(kind="dense", s=8192, h=40)),
                    ("short-causal-S16384-H24", dict(kind="dense", s=16384, h=24, causal=True)),
                    ("short-packed-8x9000-H24", dict(kind="packed", lens=(9000,) * 8, h=24, peers=True)),
                    ("short-B2-S32760-H12", dict(kind="dense", s=32760, h=12, b=2))]
        elif name == "gqa":   # grouped-query attention (Cosmos 3: 32 query / 8 K/V heads), MQA
            out += [("gqa-S32760-H32-Hk8", dict(kind="gqa", s=32760, h=32, hk=8)),
                    ("gqa-causal-S32768-H32-Hk8", dict(kind="gqa", s=32768, h=32, hk=8, causal=True)),
                    ("mqa-S16384-H24-Hk1", dict(kind="gqa", s=16384, h=24, hk=1))]
        elif name == "kvcache":   # issue 26's KV-cache acceptance shape; the same step with 32 / 8 heads (GQA)
            out += [("kv-step-18+3x1560-H12", dict(kind="kv", cached=18 * 1560, chunk=3 * 1560, h=12)),
                    ("kv-step-18+3x1560-H32-Hk8", dict(kind="kv", cached=18 * 1560, chunk=3 * 1560, h=32, hk=8))]
        elif name == "sparse":   # issue 26's acceptance shape (Wan 14B 720p)
            out += sparse.case_list()
        else:
            raise ValueError(f"--cases: expected names from {CASES}, got {name!r}")
    return out


def build_case(torch, ova, spec):
    """(entries, flops per entry, skipped {entry: why})."""
    kind = spec["kind"]
    if kind == "qk":
        return _qk_entries(torch, ova, 1, spec["s"], spec["h"], spec.get("d", 128), spec.get("causal", False))
    entries, flops = _build_case(torch, ova, spec)
    return entries, flops, {}


def _build_case(torch, ova, spec):
    kind = spec["kind"]
    if kind == "dense":
        return _dense_entries(torch, ova, spec.get("b", 1), spec["s"], spec["h"], spec.get("d", 128),
                              spec.get("causal", False))
    if kind == "kv":
        return _kv_entries(torch, ova, spec["cached"], spec["chunk"], spec["h"], hk=spec.get("hk"))
    if kind == "gqa":
        return _gqa_entries(torch, ova, spec["s"], spec["h"], spec["hk"], causal=spec.get("causal", False))
    if kind == "cross":
        return _cross_entries(torch, ova, spec["sq"], spec["sk"], spec["h"])
    if kind == "packed":
        lens, h, d = spec["lens"], spec["h"], 128
        total = sum(lens)
        q, k, v = (x[0] for x in _qkv(torch, 1, total, h, d, 1))
        cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), dtype=torch.int32, device="cuda")
        prepared = ova.prepare_fp8(q, k, v, cu, cu, max(lens), max(lens))
        dense = ova.prepare_fp8(q[None], k[None], v[None])
        entries = {"openvc-packed": lambda: ova.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                          max_seqlen_q=max(lens), max_seqlen_k=max(lens)),
                   "openvc-packed-kernel": lambda: ova.attention_fp8(prepared),
                   "openvc-dense-kernel": lambda: ova.attention_fp8(dense)}
        _add_without_pdl(entries, "openvc-packed-nopdl", entries["openvc-packed"])
        packed_flops = sum(harness.attention_flops(1, h, n, n, d) for n in lens)
        flops = {"openvc-packed": packed_flops, "openvc-packed-kernel": packed_flops,
                 "openvc-packed-nopdl": packed_flops,
                 "openvc-dense-kernel": harness.attention_flops(1, h, total, total, d)}
        if max(lens) - min(lens) <= 1:
            # The same tiles without the varlen mode: B = len(lens) batched sequences of the shortest length,
            # which separates the cost of shorter tiles from the cost of reading lengths on the device.
            n = min(lens)
            qb, kb, vb = (x[:len(lens) * n].reshape(len(lens), n, h, d) for x in (q, k, v))
            batched = ova.prepare_fp8(qb, kb, vb)
            entries["openvc-batched-kernel"] = lambda: ova.attention_fp8(batched)
            flops["openvc-batched-kernel"] = harness.attention_flops(len(lens), h, n, n, d)
            if spec.get("peers"):   # equal lengths: the peers on the same tokens as a batch (no varlen needed)
                peers = {"cudnn-bf16": _sdpa(torch, qb, kb, vb), **_fa3_entries(torch, qb, kb, vb, False)}
                entries.update(peers)
                flops.update({e: packed_flops for e in peers})
        return entries, flops
    if kind == "padded":
        s, h, d = spec["video"] + spec["text"], spec["h"], 128
        valid = s - spec["pad"]
        q, k, v = _qkv(torch, 1, s, h, d, 2)
        keep = torch.ones(1, s, dtype=torch.bool, device="cuda")
        keep[:, valid:] = False   # the text padding at the end of the joint sequence
        counts = torch.tensor([valid], dtype=torch.int32, device="cuda")
        prepared = ova.prepare_fp8(q, k, v, seqused_k=counts)
        entries = {"openvc-mask": lambda: ova.attention(q, k, v, key_padding_mask=keep),
                   "openvc-seqused": lambda: ova.attention(q, k, v, seqused_k=counts),
                   "openvc-kernel": lambda: ova.attention_fp8(prepared),
                   "cudnn-bf16-mask": _sdpa(torch, q, k, v, mask=keep[:, None, None, :])}
        flops = harness.attention_flops(1, h, valid, valid, d)   # counted on the valid tokens
        return entries, {e: flops for e in entries}
    raise ValueError(kind)


def counterpart(entry):
    """The E4M3 entry an INT8 openvc entry is paired with (same call form), or None."""
    for label in ("int8+smooth+exp2+vbias", "int8+smooth+exp2", "int8+smooth", "int8"):
        if entry.startswith(f"openvc-{label}"):
            return "openvc-e4m3" + entry[len(f"openvc-{label}"):]
    return None


def expcast_counterpart(entry):
    """The entry an exp2 openvc entry is also paired with (same formats and call form): its ExpCast twin, or for a
    V-bias-corrected entry its uncorrected twin; else None."""
    if entry.startswith("openvc-int8+smooth+exp2+vbias"):
        return "openvc-int8+smooth+exp2" + entry[len("openvc-int8+smooth+exp2+vbias"):]
    if entry.startswith("openvc-int8+smooth+exp2"):
        return "openvc-int8+smooth" + entry[len("openvc-int8+smooth+exp2"):]
    return None


def paired_table(samples) -> dict:
    """Paired speedups per round of every openvc entry against every peer present (and of each INT8 entry
    against its E4M3 counterpart, each exp2 entry also against its ExpCast twin): {"<entry>_vs_<peer>":
    {"median", "per_round"}}, > 1 = the openvc entry is faster. samples: {entry: [ms per round]} in the same
    round order."""
    out = {}
    for e in samples:
        if not e.startswith("openvc"):
            continue
        others = [a for a in PEERS if a in samples]
        for c in (counterpart(e), expcast_counterpart(e)):
            if c in samples:
                others.append(c)
        for a in others:
            out[f"{e}_vs_{a}"] = harness.paired_ratios(samples[a], samples[e])
    return out


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def check_outputs(torch, entries) -> dict:
    """rel L2 of every entry's output against cuDNN BF16's on the same inputs (one call each; eager twins of
    timed entries are the same call and skipped). A failing entry gets its error text instead."""
    ref_fn = entries.get("cudnn-bf16")
    if ref_fn is None:
        return {}
    ref = ref_fn().transpose(1, 2)   # [B, H, S, D] -> [B, S, H, D]
    out = {}
    for e, fn in entries.items():
        if e == "cudnn-bf16" or e.endswith("-eager"):
            continue
        try:
            o = _first((fn.fn if isinstance(fn, Eager) else fn)())
            out[e] = harness.error_metrics_torch(o, ref)["rel_l2"]
            del o
        except Exception as exc:
            out[e] = f"{type(exc).__name__}: {exc}"[:300]
    del ref
    torch.cuda.synchronize()
    return out


def run(case_names, rounds, seed=0, on_record=None):
    """Times every case; on_record(records) after each one (main writes the JSON then, so that a run cut
    short keeps the cases done)."""
    import torch
    import open_vc_attn as ova
    records, state = [], {}   # state: what sparse cases share (inputs, compiled FlexAttention)
    for index, (name, spec) in enumerate(case_list(case_names)):
        t0 = time.time()
        info = {}
        try:
            if spec["kind"] == "sparse":
                entries, flops, skipped, info = sparse.build_case(torch, ova, spec, state)
            else:
                entries, flops, skipped = build_case(torch, ova, spec)
        except Exception as exc:   # e.g. out of memory building the inputs: the case is recorded as failed
            records.append({"case": name, "spec": spec, "error": f"{type(exc).__name__}: {exc}"[:600]})
            print(f"{name}: FAILED to build: {records[-1]['error']}", flush=True)
            torch.cuda.empty_cache()
            if on_record:
                on_record(records)
            continue
        checks = check_outputs(torch, entries) if spec["kind"] in ("qk", "kv", "cross") else {}
        timers, errors = {}, {}
        for e, fn in entries.items():
            eager = isinstance(fn, Eager)
            try:
                timers[e] = harness.Timer(fn.fn if eager else fn, use_graph=not eager)
            except Exception as exc:   # a peer that cannot run this case: recorded, not fatal
                errors[e] = f"{type(exc).__name__}: {exc}"[:300]
        samples = {e: [] for e in timers}
        orders = harness.visiting_orders(sorted(timers), rounds, seed + index)
        for order in orders:
            for e in order:
                samples[e].append(timers[e].sample())
        for t in timers.values():
            t.release()
        res = {e: {"median_ms": harness.median(v), "tflops": harness.tflops(flops[e], harness.median(v)),
                   "samples_ms": v, "method": timers[e].method, "calls_per_replay": timers[e].calls}
               for e, v in samples.items()}
        base = next((b for b in ("openvc", "openvc-e4m3") if b in res), next(iter(res), None))
        ratios = {f"{base}_vs_{e}": harness.paired_ratios(samples[e], samples[base])["median"]
                  for e in res if e != base}
        if "openvc-packed-kernel" in res:
            # TFLOP/s of the packed kernel over the dense kernel's on the same total (the acceptance ratio).
            ratios["packed_tflops_over_dense"] = (res["openvc-packed-kernel"]["tflops"]
                                                  / res["openvc-dense-kernel"]["tflops"])
        paired = paired_table(samples)
        rec = {"case": name, "spec": spec, "results": res, "ratios": ratios, "paired": paired, "errors": errors,
               "skipped": skipped, "visiting_orders": orders, "seconds": round(time.time() - t0, 1)}
        if checks:
            rec["rel_l2_vs_cudnn_bf16"] = checks
        rec.update(info)
        if spec["kind"] == "sparse":
            rec["sparse"] = sparse.summarize(rec, sparse.dense_reference(records + [rec]))
        records.append(rec)
        line = " | ".join(f"{e} {r['tflops']:.0f} TF" for e, r in res.items())
        print(f"{name}: {line}", flush=True)
        if spec["kind"] == "qk":
            for peer in ("sage2", "fa3-fp8"):
                row = ", ".join(f"{k.split('_vs_')[0]} {v['median']:.3f}" for k, v in paired.items()
                                if k.endswith(f"_vs_{peer}") and not math.isnan(v["median"]))
                if row:
                    print(f"    vs {peer}: {row}", flush=True)
        elif spec["kind"] == "sparse":
            print("    " + sparse.format_case(name, rec["sparse"]), flush=True)
        else:
            print("    " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items() if not math.isnan(v)), flush=True)
        if checks:   # the qk and kv cases: every output against cuDNN BF16's
            print("    rel L2 vs cuDNN BF16: " + ", ".join(
                f"{e} {v:.4f}" if isinstance(v, float) else f"{e} {v}" for e, v in checks.items()), flush=True)
        if errors or skipped:
            print(f"    errors: {errors}  skipped: {skipped}", flush=True)
        del entries, timers
        torch.cuda.empty_cache()
        if on_record:
            on_record(records)
    state.clear()
    rows = sparse.acceptance(records)
    if rows:
        print(sparse.format_acceptance(rows), flush=True)
    return records


def parser():
    p = argparse.ArgumentParser(prog="open-vc-attn-bench-modes", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of " + ", ".join(CASES))
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    p.add_argument("--seed", type=int, default=0, help="seed of the visiting orders (case i uses seed + i)")
    p.add_argument("--out", help="write the records as JSON here")
    return p


def parse_cases(text):
    """The comma list of --cases, checked against CASES (ValueError naming the bad one)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CASES]
    if bad or not names:
        raise ValueError(f"--cases: expected names from {', '.join(CASES)}, got {text!r}")
    return names


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    names = parse_cases(args.cases)
    import torch
    import open_vc_attn as ova
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "fa3": _fa3() is not None, "sage2": _sage2() is not None,
            "qk_format": qk_format_support(ova) or "ok", "p_format": p_format_support(ova) or "ok",
            "rounds": args.rounds, "seed": args.seed,
            "timing": "CUDA graphs of R calls >= 20 ms per replay; entries marked eager (SA2, openvc *-eager, "
                      "flex-bf16): "
                      "CUDA events around R back-to-back calls; ratios: t_peer / t_entry per round, median"}

    def write(records):
        if args.out:
            doc = {"meta": meta, "records": records}
            rows = sparse.acceptance(records)
            if rows:
                doc["sparse_acceptance"] = rows
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    write(run(names, args.rounds, args.seed, on_record=write))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
