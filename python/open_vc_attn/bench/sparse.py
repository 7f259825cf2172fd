"""Case group ``sparse`` of bench.modes (issue 26, item 8): block-sparse openvc against FlexAttention BF16.

Wan 14B 720p shape: S = 75,600 (21 frames x 3,600 tokens), H = 40, D = 128, B = 1, BF16 [B, S, H, D] inputs
(one set per run, seed 0). Cases, in this order:
- ``sparse-dense``: openvc dense (no mask), once per run: the reference of every "visited-block TF/s over
  dense" ratio and of the window's time ratio (FLOPs: the S x S attention);
- the patterns of open_vc_attn.masks: ``temporal_window(21, 3600, 2)``, ``frame_causal(21, 3600)``;
- ``sparse-chunked-causal``: ``attention(causal=True, causal_chunk=3600)`` against FlexAttention with
  ``frame_causal``'s BlockMask (its mask_mod is the element rule: the same attention, element-exact);
- the density sweep: random block lists (``random_block_lists``: every query tile keeps a random subset of its
  key blocks, the same count for every tile, ascending, deterministic per seed) at 10 .. 100%, given to both
  as a BlockMask of FULL blocks (no mask_mod: FlexAttention's fastest form, and exactly openvc's attention);
- ``radial(21, 3600)`` (last: FlexAttention evaluates its mask_mod in most blocks, the slowest peer call).
Entries per case: ``openvc`` (the complete call, preparation and ``masks.block_lists`` included, timed as
bench.modes times every complete call: CUDA graphs of R calls >= 20 ms) and ``flex-bf16``
(``torch.compile(flex_attention, dynamic=False)`` on the case's BlockMask, [B, H, S, D] views; timed eagerly,
CUDA events around back-to-back calls: inductor's code is not captured in a graph here; 70-290 ms calls).
FLOPs: 4 * 128 * 128 * D * visited blocks per head * H (masks.block_lists' counts), the work both do.
rel L2 (before timing): openvc against FlexAttention given the BLOCK-level mask (the case's listed blocks as
full blocks: the attention openvc computes); for chunked causal, against the element-exact frame_causal one.
Each record gets a ``sparse`` dict (``summarize``); the run prints ``acceptance``'s pass / fail lines.
"""
from __future__ import annotations

import math

from . import harness

FRAMES, TOKENS_PER_FRAME, HEADS, HEAD_DIM = 21, 3600, 40, 128
SEQLEN = FRAMES * TOKENS_PER_FRAME   # 75,600
BLOCK = 128
DENSITIES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
MASK_SEED = 0
RECOMPILE_LIMIT = 64   # FlexAttention compiles once per mask_mod (noop, window, frame causal, radial): room to spare
# Acceptance lines of issue 26 (item 8), measured at SEQLEN, HEADS.
MIN_DENSITY_RATIO = 0.9          # visited-block TF/s over dense TF/s, densities 20% .. 100%
MAX_WINDOW_TIME_RATIO = 0.30     # window time over dense time
MIN_WINDOW_VS_FLEX = 2.3
MIN_FRAME_CAUSAL_VS_FLEX = 2.0


def tiles(n: int) -> int:
    return -(-n // BLOCK)


def visited_flops(visited_blocks_per_head: int, heads: int = HEADS, head_dim: int = HEAD_DIM) -> float:
    """FLOPs of the visited blocks: two GEMMs of 2 * 128 * 128 * D per listed block per head."""
    return 4.0 * BLOCK * BLOCK * head_dim * visited_blocks_per_head * heads


def case_list(frames=FRAMES, tokens_per_frame=TOKENS_PER_FRAME, heads=HEADS):
    """[(name, spec)]: the reference, the patterns, chunked causal, the density sweep, radial."""
    shape = dict(kind="sparse", frames=frames, tpf=tokens_per_frame, h=heads)
    out = [("sparse-dense", dict(shape, pattern="dense")),
           ("sparse-window2", dict(shape, pattern="window", radius=2)),
           ("sparse-frame-causal", dict(shape, pattern="frame_causal")),
           ("sparse-chunked-causal", dict(shape, pattern="chunked_causal", chunk=tokens_per_frame))]
    out += [(f"sparse-random-d{round(100 * d)}", dict(shape, pattern="random", density=d, seed=MASK_SEED))
            for d in DENSITIES]
    out.append(("sparse-radial", dict(shape, pattern="radial")))
    return out


def random_block_lists(q_tiles: int, k_tiles: int, density: float, seed: int):
    """(counts [q_tiles], indices [q_tiles, k_tiles]) numpy int32: every query tile keeps the same number of key
    blocks, max(1, round(density * k_tiles)), a uniformly random subset, strictly ascending; entries past the
    count are 0. numpy's default_rng(seed): the same lists on every machine."""
    import numpy as np
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density: expected a number in (0, 1], got {density!r}")
    keep = min(k_tiles, max(1, round(density * k_tiles)))
    rng = np.random.default_rng(seed)
    chosen = np.sort(np.argsort(rng.random((q_tiles, k_tiles)), axis=1)[:, :keep], axis=1)
    indices = np.zeros((q_tiles, k_tiles), dtype=np.int32)
    indices[:, :keep] = chosen
    return np.full(q_tiles, keep, dtype=np.int32), indices


def full_block_mask(torch, counts, indices, seqlen):
    """A BlockMask listing (counts, indices) ([..., Q_tiles], [..., Q_tiles, K_tiles], any leading dims) as FULL
    blocks and no partial ones (mask_mod: none): FlexAttention then computes exactly the listed blocks whole."""
    from torch.nn.attention.flex_attention import BlockMask
    counts = counts.to(torch.int32).reshape(1, 1, *counts.shape[-1:]).contiguous()
    indices = indices.to(torch.int32).reshape(1, 1, *indices.shape[-2:]).contiguous()
    return BlockMask.from_kv_blocks(torch.zeros_like(counts), indices, counts, indices,
                                    BLOCK_SIZE=(BLOCK, BLOCK), seq_lengths=(seqlen, seqlen))


def flex_support():
    """(compiled flex_attention, None) or (None, why not)."""
    try:
        import torch
        from torch.nn.attention.flex_attention import flex_attention
    except Exception as exc:   # ImportError, or a torch without flex_attention
        return None, f"torch.nn.attention.flex_attention not importable ({type(exc).__name__}: {str(exc)[:200]})"
    dyn = getattr(torch, "_dynamo", None)
    for key in ("recompile_limit", "cache_size_limit"):
        if dyn is not None and hasattr(dyn.config, key):
            setattr(dyn.config, key, max(getattr(dyn.config, key), RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False), None


def _mask(masks, spec, state, device):
    """The case's BlockMask (frame_causal's is cached: chunked causal compares against the same one)."""
    f, t, p = spec["frames"], spec["tpf"], spec["pattern"]
    if p in ("frame_causal", "chunked_causal"):
        if "frame_causal" not in state:
            state["frame_causal"] = masks.frame_causal(f, t, device=device)
        return state["frame_causal"]
    if p == "window":
        return masks.temporal_window(f, t, spec["radius"], device=device)
    if p == "radial":
        return masks.radial(f, t, device=device)
    raise ValueError(f"pattern: {p!r}")


def build_case(torch, ova, spec, state, device="cuda"):
    """(entries, flops per entry, skipped {entry: why}, info) of one sparse case; state: a dict kept across the
    run's cases (inputs, the compiled FlexAttention, frame_causal's mask). info: visited blocks, density and rel L2
    (openvc against FlexAttention's block-level attention), computed here, before timing."""
    from .. import masks
    f, t, h, d = spec["frames"], spec["tpf"], spec["h"], spec.get("d", HEAD_DIM)
    s, n = f * t, tiles(f * t)
    key = (s, h, d)
    if state.get("qkv_key") != key:
        state.pop("qkv", None)
        g = torch.Generator(device=device).manual_seed(0)
        state["qkv"] = [torch.randn(1, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3)]
        state["qkv_key"] = key
    q, k, v = state["qkv"]
    if "flex" not in state:
        state["flex"], state["flex_why"] = flex_support()
    flex, skipped = state["flex"], {}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))   # FlexAttention's [B, H, S, D] views
    p = spec["pattern"]
    info = {"total_blocks_per_head": n * n}
    if p == "dense":
        entries = {"openvc": lambda: ova.attention(q, k, v)}
        info.update(visited_blocks_per_head=n * n, density=1.0, reference=True)
        flops = harness.attention_flops(1, h, s, s, d)
        return entries, {"openvc": flops}, {"flex-bf16": "not run: the reference case (openvc dense only)"}, info
    if p == "random":
        c, i = random_block_lists(n, n, spec["density"], spec["seed"])
        bm = full_block_mask(torch, torch.from_numpy(c).to(device), torch.from_numpy(i).to(device), s)
        ref_bm, visited = bm, int(c.sum())
    else:
        bm = _mask(masks, spec, state, device)
        counts, indices = masks.block_lists(bm)
        visited = int(counts.sum().item())
        ref_bm = bm if p == "chunked_causal" else full_block_mask(torch, counts, indices, s)
    if p == "chunked_causal":
        entries = {"openvc": lambda: ova.attention(q, k, v, causal=True, causal_chunk=spec["chunk"])}
        info["rel_l2_reference"] = "flex-bf16 with frame_causal's element mask (the same attention)"
    else:
        entries = {"openvc": lambda: ova.attention(q, k, v, block_mask=bm)}
        info["rel_l2_reference"] = "flex-bf16 with the listed blocks as full blocks (the same attention)"
    info.update(visited_blocks_per_head=visited, density=visited / (n * n))
    if flex is None:
        skipped["flex-bf16"] = state["flex_why"]
    else:
        entries["flex-bf16"] = harness.Eager(lambda: flex(qt, kt, vt, block_mask=bm))
        try:
            ref = flex(qt, kt, vt, block_mask=ref_bm).transpose(1, 2)
            out = entries["openvc"]()
            info["rel_l2_vs_flex"] = harness.error_metrics_torch(out, ref)["rel_l2"]
            del ref, out
        except Exception as exc:   # recorded; the timing still runs (and reports its own errors)
            info["rel_l2_vs_flex"] = f"{type(exc).__name__}: {exc}"[:300]
    flops = visited_flops(visited, h, d)
    return entries, {e: flops for e in entries}, skipped, info


def dense_reference(records):
    """The openvc dense result of the run's ``sparse-dense`` record ({"median_ms", "tflops"}), or None."""
    for r in records:
        if r.get("case") == "sparse-dense" and "openvc" in r.get("results", {}):
            return r["results"]["openvc"]
    return None


def summarize(rec, dense):
    """The ``sparse`` dict of a record: its blocks, openvc's time and visited-block TF/s, their ratios to openvc
    dense (``dense``: dense_reference's dict or None), the paired speedup over FlexAttention, rel L2."""
    res, spec = rec.get("results", {}), rec.get("spec", {})
    o, fx = res.get("openvc"), res.get("flex-bf16")
    nan = float("nan")
    out = {"pattern": spec.get("pattern"), "density": rec.get("density"),
           "visited_blocks_per_head": rec.get("visited_blocks_per_head"),
           "total_blocks_per_head": rec.get("total_blocks_per_head"),
           "openvc_ms": o["median_ms"] if o else nan, "tflops_visited": o["tflops"] if o else nan,
           "flex_ms": fx["median_ms"] if fx else nan,
           "flex_tflops_visited": fx["tflops"] if fx else nan,
           "dense_ms": dense["median_ms"] if dense else nan, "dense_tflops": dense["tflops"] if dense else nan}
    out["tflops_over_dense"] = _div(out["tflops_visited"], out["dense_tflops"])
    out["time_over_dense"] = _div(out["openvc_ms"], out["dense_ms"])
    if o and fx:
        paired = harness.paired_ratios(fx["samples_ms"], o["samples_ms"])
        out["speedup_vs_flex"], out["speedup_vs_flex_per_round"] = paired["median"], paired["per_round"]
    else:
        out["speedup_vs_flex"], out["speedup_vs_flex_per_round"] = nan, []
    out["rel_l2_vs_flex"] = rec.get("rel_l2_vs_flex")
    return out


def _div(a, b):
    try:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")
    except TypeError:
        return float("nan")


def _line(check, case, value, op, threshold):
    ok = None if value is None or (isinstance(value, float) and math.isnan(value)) else \
        (value >= threshold if op == ">=" else value <= threshold)
    return {"check": check, "case": case, "value": value, "op": op, "threshold": threshold, "pass": ok}


def acceptance(records):
    """Issue 26's acceptance lines from the records' ``sparse`` dicts: [{check, case, value, op, threshold, pass}]
    (pass None: not measured, e.g. FlexAttention missing or the case failed). [] when no sparse case ran."""
    by = {r["case"]: r["sparse"] for r in records if "sparse" in r}
    if not by:
        return []
    nan = float("nan")
    rows = []
    for d in DENSITIES:
        if d < 0.2:
            continue
        case = f"sparse-random-d{round(100 * d)}"
        rows.append(_line(f"visited-block TF/s over dense, density {round(100 * d)}%", case,
                          by.get(case, {}).get("tflops_over_dense", nan), ">=", MIN_DENSITY_RATIO))
    w = by.get("sparse-window2", {})
    rows.append(_line("+-2-frame window time over dense", "sparse-window2", w.get("time_over_dense", nan), "<=",
                      MAX_WINDOW_TIME_RATIO))
    rows.append(_line("+-2-frame window speedup over FlexAttention BF16", "sparse-window2",
                      w.get("speedup_vs_flex", nan), ">=", MIN_WINDOW_VS_FLEX))
    for case in ("sparse-frame-causal", "sparse-chunked-causal"):
        rows.append(_line(f"{case[len('sparse-'):]} speedup over FlexAttention BF16", case,
                          by.get(case, {}).get("speedup_vs_flex", nan), ">=", MIN_FRAME_CAUSAL_VS_FLEX))
    return rows


def format_acceptance(rows) -> str:
    lines = ["sparse acceptance (issue 26, S = 75,600, H = 40):"]
    for r in rows:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[r["pass"]]
        value = "not measured" if r["pass"] is None else f"{r['value']:.3f}"
        lines.append(f"  {verdict}  {r['check']}: {value} (needs {r['op']} {r['threshold']})")
    return "\n".join(lines)


def format_case(name, s) -> str:
    """One printed line of a sparse record's ``sparse`` dict."""
    rel = s.get("rel_l2_vs_flex")
    rel = f"{rel:.4f}" if isinstance(rel, float) else str(rel)
    return (f"{name}: {s['density']:.1%} blocks, openvc {s['openvc_ms']:.2f} ms ({s['tflops_visited']:.0f} TF/s "
            f"visited, {s['tflops_over_dense']:.3f}x dense TF/s, {s['time_over_dense']:.3f}x dense time) | "
            f"flex-bf16 {s['flex_ms']:.2f} ms, openvc {s['speedup_vs_flex']:.2f}x faster | rel L2 {rel}")
