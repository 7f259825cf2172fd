#!/usr/bin/env python3
"""Eager per-call floor and crossover of open_vc_attn.attention against torch SDPA (issue 19's policy).

    python3 scripts/device/dispatch_floor.py [--out OUT.json] [--heads 12,24,40] [--sizes 256,512,...,65536]
        [--rounds 5] [--budget-s 200] [--dry-run]

What the integrations' DispatchPolicy thresholds rest on, measured in one process as a framework calls
attention: eagerly, B = 1, D = 128, BF16, [B, S, H, D] tensors, under torch.no_grad() (diffusers' pipelines).

- Timing: a batch of n back-to-back calls, one synchronize per batch (n so that a batch lasts >= 4 ms),
  wall time per call = batch time / n, which is max(host time, GPU time) as in a model's forward; the
  host time (the loop before the synchronize) is kept beside it. Per point, every backend once per round
  in a shuffled order; medians over rounds; speedups are medians of per-round ratios (paired).
- Backends: openvc (open_vc_attn.attention, quantization included), torch SDPA as diffusers' "native"
  backend calls it (transposed views; torch's own backend choice), and SDPA restricted to cuDNN and to
  flash (sdpa_kernel entered around the batch, not per call). A backend that fails is left out.
- Floor (tiny shapes): the same plus openvc's parts (the api's checks, prepare_fp8, attention_fp8 on a
  preparation, the integrations' choose_path) and the CUDA-graph time per call (GPU work only).
- Profile: torch.profiler over 10 small eager calls: CPU self time per op and call, the kernels and their
  durations, and the GPU idle gaps between the kernels of one call (host-bound launches show up there).
- Grid: (Sq, Sk) over --sizes x --sizes (self-attention is the diagonal) at each head count. Crossover:
  for self-attention the smallest S from which openvc stays faster; for cross-attention, per Sq the
  smallest Sk, per Sk the smallest Sq; and the (min_query_tokens, min_key_tokens) pairs for which every
  grid point at or above both is faster on openvc at every head count (the policy's rectangle).

Writes OUT.json (default $OUT/dispatch_floor.json) and prints a compact table. --dry-run runs the whole
logic on the CPU with tiny shapes and SDPA standing in for openvc (a check of this script, not a
measurement). Stops starting new grid points once --budget-s is spent (what was skipped is listed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

SDPA_VARIANTS = ("sdpa", "sdpa-cudnn", "sdpa-flash")
TARGET_BATCH_MS = 4.0
MAX_CALLS = 2000


# ---- pure logic (no torch): crossover and thresholds ---------------------------------------------------

def stable_from(points):
    """Smallest size from which openvc is faster at every larger measured size: points [(size, speedup)];
    None when the largest size is not a win."""
    best = None
    for size, speedup in sorted(points, reverse=True):
        if speedup is None or not speedup > 1.0:
            break
        best = size
    return best


def crossovers(rows, versus="sdpa"):
    """{heads: {"self_from": S, "cross_keys_from": {Sq: Sk}, "cross_queries_from": {Sk: Sq}}} from grid rows
    (dicts with heads, sq, sk and speedup[versus])."""
    out = {}
    for h in sorted({r["heads"] for r in rows}):
        mine = [r for r in rows if r["heads"] == h]
        sp = lambda r: r["speedup"].get(versus)   # noqa: E731
        diag = [(r["sq"], sp(r)) for r in mine if r["sq"] == r["sk"]]
        by_q, by_k = {}, {}
        for r in mine:
            by_q.setdefault(r["sq"], []).append((r["sk"], sp(r)))
            by_k.setdefault(r["sk"], []).append((r["sq"], sp(r)))
        out[h] = {"self_from": stable_from(diag),
                  "cross_keys_from": {sq: stable_from(p) for sq, p in sorted(by_q.items())},
                  "cross_queries_from": {sk: stable_from(p) for sk, p in sorted(by_k.items())}}
    return out


def policy_rectangles(rows, versus="sdpa"):
    """The (min_query_tokens, min_key_tokens) pairs, not dominated by another, for which every grid point
    with Sq >= min_q and Sk >= min_k is an openvc win at every head count measured there; each with the
    share of the grid's attention work (sum of Sq*Sk*H) it sends to openvc. Sorted by that share."""
    wins = {}
    for r in rows:
        key = (r["sq"], r["sk"])
        s = r["speedup"].get(versus)
        wins[key] = wins.get(key, True) and s is not None and s > 1.0
    if not wins:
        return []
    sqs, sks = sorted({q for q, _ in wins}), sorted({k for _, k in wins})
    total = sum(r["sq"] * r["sk"] * r["heads"] for r in rows) or 1
    found = []
    for mk in sks:
        for mq in sqs:
            cells = [(q, k) for (q, k) in wins if q >= mq and k >= mk]
            if cells and all(wins[c] for c in cells):
                work = sum(r["sq"] * r["sk"] * r["heads"] for r in rows if r["sq"] >= mq and r["sk"] >= mk)
                found.append({"min_query_tokens": mq, "min_key_tokens": mk, "work_share": work / total})
                break
    pareto = [f for f in found if not any(g is not f and g["min_query_tokens"] <= f["min_query_tokens"]
                                          and g["min_key_tokens"] <= f["min_key_tokens"] for g in found)]
    return sorted(pareto, key=lambda f: (-f["work_share"], f["min_key_tokens"]))


def paired_speedup(anchor, this):
    """Median over rounds of anchor / this (> 1: this is faster)."""
    ratios = [a / t for a, t in zip(anchor, this) if a and t]
    return statistics.median(ratios) if ratios else None


# ---- timing ---------------------------------------------------------------------------------------------

class Clock:
    """Batches of eager calls with one synchronize each (sync is a no-op for --dry-run on the CPU)."""

    def __init__(self, sync):
        self.sync = sync

    def batch(self, fn, n, context=None):
        """(wall ms per call, host ms per call) of n calls of fn (inside context() when given)."""
        ctx = context() if context else None
        if ctx is not None:
            ctx.__enter__()
        try:
            self.sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            self.sync()
            t2 = time.perf_counter()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return (t2 - t0) * 1e3 / n, (t1 - t0) * 1e3 / n

    def calls_for(self, fn, context=None):
        """Warms fn up and returns the batch size n (>= 1) that lasts about TARGET_BATCH_MS."""
        self.batch(fn, 2, context)
        est, _ = self.batch(fn, 3, context)
        return int(min(MAX_CALLS, max(1, math.ceil(TARGET_BATCH_MS / max(est, 1e-4)))))


def measure(clock, backends, rounds, rng):
    """{name: {"ms": median wall, "host_ms": median host, "calls": n, "wall": [per round]}} and the names
    that failed ({name: error}). backends: {name: (fn, context factory or None)}."""
    calls, errors = {}, {}
    for name, (fn, ctx) in backends.items():
        try:
            calls[name] = clock.calls_for(fn, ctx)
        except Exception as exc:   # a backend missing here (no cuDNN / flash for this shape, old package)
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    wall = {n: [] for n in calls}
    host = {n: [] for n in calls}
    for _ in range(rounds):
        order = [n for n in calls if n not in errors]
        rng.shuffle(order)
        for name in order:
            fn, ctx = backends[name]
            try:
                w, h = clock.batch(fn, calls[name], ctx)
            except Exception as exc:   # e.g. out of memory at the largest shapes: drop this backend here
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                continue
            wall[name].append(w)
            host[name].append(h)
    calls = {n: c for n, c in calls.items() if n not in errors}
    res = {n: {"ms": statistics.median(wall[n]), "host_ms": statistics.median(host[n]), "calls": calls[n],
               "wall": wall[n]} for n in calls}
    return res, errors


def speedups(res, this="openvc"):
    if this not in res:
        return {}
    return {v: paired_speedup(res[v]["wall"], res[this]["wall"]) for v in SDPA_VARIANTS if v in res}


# ---- backends -------------------------------------------------------------------------------------------

def sdpa_backends(torch, q, k, v, dry):
    """diffusers' native call (transposed views in and out) with torch's choice, cuDNN and flash."""
    F = torch.nn.functional

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    out = {"sdpa": (sdpa, None)}
    if dry:
        return out
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return out
    for name, member in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION")):
        if hasattr(SDPBackend, member):
            out[name] = (sdpa, lambda m=getattr(SDPBackend, member): sdpa_kernel([m]))
    return out


def openvc_backend(torch, q, k, v, dry):
    if dry:   # the script's check on the CPU: SDPA stands in for openvc
        F = torch.nn.functional
        return lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    import open_vc_attn
    return lambda: open_vc_attn.attention(q, k, v)


def openvc_parts(torch, q, k, v):
    """openvc's call in parts."""
    import open_vc_attn
    from open_vc_attn import _checks
    from open_vc_attn.integrations import policy
    everything = policy.DispatchPolicy(min_query_tokens=1, min_key_tokens=1)
    parts = {"openvc": (lambda: open_vc_attn.attention(q, k, v), None),
             "checks": (lambda: _checks.check_tokens(q, k, v, caller="attention"), None),
             # thresholds of 1 token: every rule of the policy runs (the default stops at the thresholds)
             "choose_path": (lambda: policy.choose_path(q, k, v, policy=everything), None),
             "prepare_fp8": (lambda: open_vc_attn.prepare_fp8(q, k, v), None)}
    try:
        prepared = open_vc_attn.prepare_fp8(q, k, v)
        parts["attention_fp8"] = (lambda: open_vc_attn.attention_fp8(prepared), None)
    except Exception as exc:   # reported by the openvc entry, which fails the same way
        print(f"dispatch_floor: prepare_fp8 failed: {type(exc).__name__}: {exc}")
    return parts


def rand_qkv(torch, sq, sk, h, device, gen):
    shape = lambda s: (1, s, h, 128)   # noqa: E731
    return tuple(torch.randn(shape(s), device=device, dtype=torch.bfloat16, generator=gen) for s in (sq, sk, sk))


# ---- sections -------------------------------------------------------------------------------------------

def floor_section(torch, clock, args, rng, device, gen):
    shapes = [(128, 1), (256, 12), (1024, 12)] if not args.dry_run else [(64, 2)]
    rows = []
    for s, h in shapes:
        q, k, v = rand_qkv(torch, s, s, h, device, gen)
        backends = dict(sdpa_backends(torch, q, k, v, args.dry_run))
        if args.dry_run:
            backends["openvc"] = (openvc_backend(torch, q, k, v, True), None)
        else:
            backends.update(openvc_parts(torch, q, k, v))
        res, errors = measure(clock, backends, args.rounds, rng)
        row = {"sq": s, "sk": s, "heads": h, "us_per_call": {n: round(r["ms"] * 1e3, 2) for n, r in res.items()},
               "host_us_per_call": {n: round(r["host_ms"] * 1e3, 2) for n, r in res.items()},
               "speedup": speedups(res), "errors": errors}
        if not args.dry_run:
            row["graph_us_per_call"] = graph_times(torch, {n: backends[n] for n in ("openvc", "sdpa") if n in res})
        rows.append(row)
    return rows


def graph_times(torch, backends):
    """GPU time per call (CUDA graph of many calls: no host overhead), via the benchmark's harness."""
    from open_vc_attn.bench import harness
    out = {}
    for name, (fn, _) in backends.items():
        try:
            timer = harness.Timer(fn, target_ms=5.0)
            out[name] = {"us": round(statistics.median(timer.sample() for _ in range(5)) * 1e3, 2),
                         "method": timer.method}
            timer.release()
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def profile_section(torch, args, device, gen):
    """torch.profiler over 10 eager calls of one small shape, for openvc and SDPA."""
    from torch.profiler import ProfilerActivity, profile
    s, h = (256, 12) if not args.dry_run else (64, 2)
    q, k, v = rand_qkv(torch, s, s, h, device, gen)
    fns = {"openvc": openvc_backend(torch, q, k, v, args.dry_run),
           "sdpa": sdpa_backends(torch, q, k, v, True)["sdpa"][0]}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not args.dry_run else [])
    out = {"sq": s, "sk": s, "heads": h, "calls": 10}
    for name, fn in fns.items():
        try:
            for _ in range(3):
                fn()
            sync(torch, args)
            with profile(activities=activities) as prof:
                for _ in range(10):
                    fn()
                sync(torch, args)
            out[name] = summarize_profile(prof, 10)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def _attr(obj, *names, default=0.0):
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


def summarize_profile(prof, calls):
    """CPU self time per op and call (top 20), the kernels (name, count, mean us) and the GPU idle gaps
    between consecutive kernels (median and total per call), from a torch.profiler run of `calls` calls."""
    ops = []
    for e in prof.key_averages():
        ops.append({"op": e.key[:90], "count_per_call": e.count / calls,
                    "self_cpu_us_per_call": _attr(e, "self_cpu_time_total") / calls,
                    "cpu_us_per_call": _attr(e, "cpu_time_total") / calls,
                    "self_gpu_us_per_call": _attr(e, "self_device_time_total", "self_cuda_time_total") / calls})
    ops.sort(key=lambda o: -o["self_cpu_us_per_call"])
    kernels = []
    for e in prof.events():
        dev_type = str(_attr(e, "device_type", default=""))
        if "CUDA" in dev_type and e.time_range.end > e.time_range.start:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
    kernels.sort()
    gaps = [b[0] - a[1] for a, b in zip(kernels, kernels[1:])]
    by_name = {}
    for start, end, name in kernels:
        by_name.setdefault(name[:90], []).append(end - start)
    per_call = len(kernels) / calls if calls else 0
    return {"cpu_ops": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in o.items()} for o in ops[:20]],
            "cpu_self_us_per_call_total": round(sum(o["self_cpu_us_per_call"] for o in ops), 2),
            "kernels": [{"name": n, "count_per_call": len(d) / calls, "mean_us": round(statistics.mean(d), 2)}
                        for n, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))],
            "kernels_per_call": per_call,
            "gpu_busy_us_per_call": round(sum(e - s for s, e, _ in kernels) / calls, 2) if calls else None,
            "gap_us_median": round(statistics.median(gaps), 2) if gaps else None,
            "gap_us_per_call": round(sum(gaps) / calls, 2) if gaps and calls else None}


def grid_section(torch, clock, args, rng, device, gen, t_start):
    rows, skipped = [], []
    for h in args.heads:
        smax = max(args.sizes)
        big = rand_qkv(torch, smax, smax, h, device, gen)   # views of one buffer per head count (B = 1: contiguous)
        for sq in args.sizes:
            for sk in args.sizes:
                if time.perf_counter() - t_start > args.budget_s:
                    skipped.append({"heads": h, "sq": sq, "sk": sk})
                    continue
                q, k, v = big[0][:, :sq], big[1][:, :sk], big[2][:, :sk]
                backends = dict(sdpa_backends(torch, q, k, v, args.dry_run))
                backends["openvc"] = (openvc_backend(torch, q, k, v, args.dry_run), None)
                res, errors = measure(clock, backends, args.rounds, rng)
                rows.append({"heads": h, "sq": sq, "sk": sk, "kind": "self" if sq == sk else "cross",
                             "ms": {n: round(r["ms"], 5) for n, r in res.items()},
                             "host_ms": {n: round(r["host_ms"], 5) for n, r in res.items()},
                             "calls": {n: r["calls"] for n, r in res.items()},
                             "speedup": speedups(res), "errors": errors})
        del big
        if not args.dry_run:
            torch.cuda.empty_cache()
    return rows, skipped


def sync(torch, args):
    if not args.dry_run:
        torch.cuda.synchronize()


# ---- report ---------------------------------------------------------------------------------------------

def _fmt(x, nd=2):
    return "   -  " if x is None else f"{x:6.{nd}f}"


def print_report(result):
    print("== floor (us per call, eager, wall; host: enqueue time; graph: GPU only)")
    for r in result["floor"]:
        print(f"  Sq=Sk={r['sq']} H={r['heads']}:")
        for name, us in r["us_per_call"].items():
            g = r.get("graph_us_per_call", {}).get(name, {}).get("us")
            print(f"    {name:14s} {us:9.1f} us  host {r['host_us_per_call'][name]:8.1f} us"
                  + (f"  graph {g:8.1f} us" if g is not None else ""))
        if r["errors"]:
            print(f"    missing: {r['errors']}")
    prof = result.get("profile", {})
    for name in ("openvc", "sdpa"):
        p = prof.get(name)
        if not p or "error" in p:
            print(f"== profile {name}: {p.get('error') if p else 'not run'}")
            continue
        print(f"== profile {name} (Sq=Sk={prof['sq']} H={prof['heads']}): CPU self {p['cpu_self_us_per_call_total']} "
              f"us/call, {p['kernels_per_call']:.1f} kernels/call busy {p['gpu_busy_us_per_call']} us, gaps "
              f"{p['gap_us_per_call']} us/call (median {p['gap_us_median']} us)")
        for o in p["cpu_ops"][:6]:
            print(f"    {o['self_cpu_us_per_call']:8.1f} us x{o['count_per_call']:.0f}  {o['op']}")
        for kn in p["kernels"][:5]:
            print(f"    kernel {kn['mean_us']:8.1f} us x{kn['count_per_call']:.0f}  {kn['name'][:70]}")
    rows = result["grid"]
    for h in sorted({r["heads"] for r in rows}):
        mine = {(r["sq"], r["sk"]): r for r in rows if r["heads"] == h}
        sqs, sks = sorted({q for q, _ in mine}), sorted({k for _, k in mine})
        print(f"== H={h}: speedup of openvc over sdpa (torch's choice) [/ best of cudnn, flash]; rows Sq, cols Sk")
        print("  Sq\\Sk " + "".join(f"{k:>13d}" for k in sks))
        for q in sqs:
            cells = []
            for k in sks:
                r = mine.get((q, k))
                if r is None:
                    cells.append(f"{'skip':>13s}")
                    continue
                sp = r["speedup"]
                alt = [sp[v] for v in ("sdpa-cudnn", "sdpa-flash") if sp.get(v)]
                cells.append(f"{_fmt(sp.get('sdpa'))}/{_fmt(min(alt) if alt else None)}")
            print(f"  {q:6d}" + "".join(cells))
    for versus, cross in result["crossover"].items():
        for h, c in cross.items():
            print(f"== crossover vs {versus} H={h}: self-attention from S={c['self_from']}; cross, keys from per Sq "
                  f"{c['cross_keys_from']}; queries from per Sk {c['cross_queries_from']}")
    for versus, rects in result["policy_rectangles"].items():
        print(f"== policy thresholds vs {versus} (every point at or above both a win, all heads): "
              + ("; ".join(f"min_query_tokens={r['min_query_tokens']} min_key_tokens={r['min_key_tokens']} "
                           f"({100 * r['work_share']:.0f}% of the grid's work)" for r in rects[:4]) or "none"))
    if result["skipped"]:
        print(f"== skipped (budget): {len(result['skipped'])} grid points")


# ---- main -----------------------------------------------------------------------------------------------

def ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "dispatch_floor.json"))
    ap.add_argument("--heads", type=ints, default=[12, 24, 40])
    ap.add_argument("--sizes", type=ints, default=[256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=200.0, help="no new grid point after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="the logic on the CPU with tiny shapes (no GPU)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.heads, args.sizes, args.rounds = [2], [32, 64, 128], 2

    import torch
    t_start = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        print("dispatch_floor: no CUDA device (use --dry-run to check the script on a CPU)")
        return 1
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rng = random.Random(args.seed)
    clock = Clock(lambda: sync(torch, args))
    meta = {"torch": torch.__version__, "dry_run": args.dry_run, "rounds": args.rounds, "dtype": "bfloat16",
            "head_dim": 128, "batch": 1, "grad_mode": "no_grad", "target_batch_ms": TARGET_BATCH_MS}
    if not args.dry_run:
        import open_vc_attn
        meta.update(gpu=torch.cuda.get_device_name(0), open_vc_attn=getattr(open_vc_attn, "__version__", "?"),
                    cudnn=torch.backends.cudnn.version())
    with torch.no_grad():
        floor = floor_section(torch, clock, args, rng, device, gen)
        prof = profile_section(torch, args, device, gen)
        grid, skipped = grid_section(torch, clock, args, rng, device, gen, t_start)
    versus = [v for v in SDPA_VARIANTS if any(v in r["speedup"] for r in grid)]
    result = {"meta": meta, "floor": floor, "profile": prof, "grid": grid, "skipped": skipped,
              "crossover": {v: crossovers(grid, v) for v in versus},
              "policy_rectangles": {v: policy_rectangles(grid, v) for v in versus},
              "seconds": round(time.perf_counter() - t_start, 1)}
    print_report(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"dispatch_floor: {len(grid)} grid points, {result['seconds']} s, wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
