"""Entry points ``open-vc-attn-bench`` (main_bench) and ``open-vc-attn-report`` (main_report), the
presets, and the run loop. torch is imported only once a run starts (``--dry-run`` never imports it).

Inputs. Presets use the deterministic synthetic video-like generator (open_vc_attn.video_inputs). To
keep setup short (~1.5 s per head of 73k tokens on one CPU core), only ``--gen-heads`` distinct heads
(default 7, one Ulysses shard) are generated per sequence shape, once, and tiled along the head axis:
head h is a copy of generated head h % gen_heads (the record says so under source). Timing does not
depend on which values a head holds; accuracy is then that of the distinct heads. ``--gen-heads 0``
generates every head. ``--input FILE`` loads real captures instead (.pt or .npz with q, k, v [B,S,H,D]).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

from .._layout import DEFAULT_MID_WINDOW_BLOCKS
from . import harness, record

# Token grid used by "sweep" (Wan 720p frames): frames = ceil(S / 3600), truncated to S tokens.
SWEEP_FRAME = (45, 80)
SWEEP_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


@dataclasses.dataclass
class CaseSpec:
    name: str
    heads: int
    seqlen: int
    head_dim: int = 128
    batch: int = 1
    generator: dict = None        # video_inputs.generate() keyword arguments except heads/seed/batch
    file: str = None


def _generator_kwargs(gen_preset):
    from .. import video_inputs as vi
    kw = dict(vi.PRESETS[gen_preset])
    kw.pop("heads", None)
    return kw


def preset_cases(preset: str, heads=None, seqlens=None) -> list:
    """The cases of a preset; heads / seqlens (lists) override its head counts / lengths."""
    from .. import video_inputs as vi
    if preset == "sweep":
        out = []
        for s in seqlens or SWEEP_LENGTHS:
            h, w = SWEEP_FRAME
            gen = dict(frames=math.ceil(s / (h * w)), height=h, width=w, seqlen=s, head_dim=128)
            out += [CaseSpec(f"sweep-S{s}-H{hh}", hh, s, generator=gen) for hh in (heads or (7,))]
        return out
    default_heads = {"smoke": (2, 4), "video": (7, 14, 56), "wan480": (40,), "wan720": (40,)}
    if preset not in default_heads:
        raise ValueError(f"preset: expected one of {PRESETS}, got {preset!r}")
    gen = _generator_kwargs(preset)
    lengths = seqlens or (vi.preset_seqlen(preset),)
    out = []
    for s in lengths:
        g = dict(gen)
        grid = g["frames"] * g["height"] * g["width"]
        if s != vi.preset_seqlen(preset):
            g["frames"] = max(g["frames"], math.ceil(s / (g["height"] * g["width"])))
            grid = g["frames"] * g["height"] * g["width"]
        g["seqlen"] = None if s == grid else s
        out += [CaseSpec(f"{preset}-S{s}-H{h}", h, s, head_dim=g["head_dim"], generator=g)
                for h in (heads or default_heads[preset])]
    return out


PRESETS = ("smoke", "video", "wan480", "wan720", "sweep")


def distinct_heads(cases, gen_heads: int) -> dict:
    """Generated heads per generator shape: min(gen_heads, most heads any case of that shape needs);
    gen_heads <= 0 means every head."""
    need = {}
    for c in cases:
        if c.generator is not None:
            key = json.dumps(c.generator, sort_keys=True)
            need[key] = max(need.get(key, 0), c.heads)
    return {k: (n if gen_heads <= 0 else min(n, gen_heads)) for k, n in need.items()}


def load_input_file(path):
    """(q, k, v) from a .pt (dict with q/k/v, or a 3-sequence) or an .npz with q, k, v."""
    if path.endswith(".npz"):
        import numpy as np
        with np.load(path) as z:
            return z["q"], z["k"], z["v"]
    import torch
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict):
        return obj["q"], obj["k"], obj["v"]
    q, k, v = obj
    return q, k, v


# ---- the run --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    q: object
    k: object
    v: object
    softmax_scale: float = None


class _InputCache:
    """Generated distinct heads on the GPU as BF16, per generator shape (generated once per run)."""

    def __init__(self, torch, device, seed, n_distinct):
        self.torch, self.device, self.seed, self.n_distinct = torch, device, seed, n_distinct
        self.cache = {}

    def tensors(self, spec):
        torch = self.torch
        key = json.dumps(spec.generator, sort_keys=True)
        if key not in self.cache:
            from .. import video_inputs as vi
            n = self.n_distinct[key]
            t0 = time.time()
            gen = vi.generate(**spec.generator, heads=n, batch=spec.batch, seed=self.seed)
            # float32 arrays hold bf16 values exactly: the conversion does not round.
            qkv = [torch.from_numpy(x).to(self.device).to(torch.bfloat16) for x in (gen.q, gen.k, gen.v)]
            self.cache = {key: (qkv, n, gen.head_kinds, time.time() - t0)}   # keep one shape at a time
        qkv, n, kinds, gen_s = self.cache[key]
        idx = torch.tensor(harness.head_index_map(spec.heads, n), device=self.device)
        q, k, v = (x.index_select(2, idx).contiguous() for x in qkv)
        source = {"kind": "generator", "generator": "open_vc_attn.video_inputs.generate", "seed": self.seed,
                  "kwargs": spec.generator, "distinct_heads": n, "tiled": spec.heads > n,
                  "head_kinds": [kinds[i] for i in harness.head_index_map(spec.heads, n)],
                  "generate_s": round(gen_s, 2)}
        return q, k, v, source


def _file_tensors(torch, device, path):
    arrays = load_input_file(path)
    out, note = [], None
    for x in arrays:
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(x)
        if t.dtype not in (torch.bfloat16, torch.float16):
            note = f"converted from {t.dtype} to bfloat16 (round to nearest even)"
            t = t.float().to(torch.bfloat16)
        out.append(t.to(device).contiguous())
    q, k, v = out
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"{path}: expected q, k, v of shape [B, S, H, D], got {[tuple(x.shape) for x in out]}")
    source = {"kind": "file", "path": os.path.abspath(path), "dtype": str(q.dtype).replace("torch.", "")}
    if note:
        source["note"] = note
    return q, k, v, source


def _entries(args, status):
    """(backend, scope, params) to run per case; the BF16 references go first so that every later
    output can be compared against one."""
    from . import backends as bk
    out = []
    for name in args.backends:
        if status.get(name, {}).get("status") != "ok":
            continue
        for scope in bk.BACKENDS[name][2]:
            # BF16-only anchors have one scope ("attention"; their complete scope is the same call), so
            # they run whatever scopes were asked for: complete-scope entries are compared against them.
            if scope not in args.scopes and bk.BACKENDS[name][2] != ("attention",):
                continue
            budgets = args.repair_budgets if name == "open-vc-repair" else [None]
            for b in budgets:
                params = {"mid_window_blocks": args.mid_window_blocks} if name.startswith("open-vc") else {}
                if b is not None:
                    params["repair_budget"] = b
                out.append((name, scope, params))
    rank = {n: i for i, n in enumerate(bk.BF16_REFERENCES)}
    return sorted(out, key=lambda e: rank.get(e[0], len(rank)))


def _entry_id(name, scope, params):
    rid = f"{name}:{scope}"
    return rid + (f"@{params['repair_budget']:g}" if "repair_budget" in params else "")


def _short_error(exc):
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:600]


def run_case(torch, device, spec_name, q, k, v, source, args, status, case_index, log):
    from . import backends as bk
    b, s, h, d = q.shape
    sk = k.shape[1]
    flops = harness.attention_flops(b, h, s, sk, d)
    case = {"name": spec_name, "batch": b, "seqlen_q": s, "seqlen_k": sk, "heads": h, "head_dim": d,
            "dtype": str(q.dtype).replace("torch.", ""), "causal": False, "flops": flops,
            "softmax_scale": 1.0 / math.sqrt(d), "source": source, "results": []}
    t_case = time.time()
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    nbytes = harness.input_bytes(q, k, v)
    cold = bool(args.cold_l2 and l2 and nbytes <= l2)
    case["cold_l2"] = {"requested": bool(args.cold_l2), "applied": cold, "input_bytes": nbytes, "l2_bytes": l2,
                       "note": ("not requested" if not args.cold_l2 else
                                "inputs fit in L2: a 256 MB write precedes every timed call" if cold else
                                "does not apply: L2 size unknown" if not l2 else
                                f"does not apply: inputs + output ({nbytes / 2**20:.0f} MiB) exceed L2 "
                                f"({l2 / 2**20:.0f} MiB)")}
    flush = harness.L2Flusher(device) if cold else None
    inp = Inputs(q, k, v)
    exact = None
    # Accuracy on a sample: evenly spaced query rows (--accuracy-rows) of the distinct heads only (tiled
    # heads are copies, so they add cost and nothing else). Exact FP32 attention over all 56 heads of a
    # 73k sequence takes tens of minutes; 4096 rows of 7 heads take seconds.
    rows = None
    n_rows = getattr(args, "accuracy_rows", 0)
    if n_rows and n_rows < s:
        rows = torch.linspace(0, s - 1, n_rows, device=q.device).round().long().unique()
    heads = None
    if isinstance(source, dict) and source.get("tiled") and source.get("distinct_heads"):
        heads = torch.arange(int(source["distinct_heads"]), device=q.device)

    def sample(x, is_query):
        if rows is not None and is_query:
            x = x.index_select(1, rows)
        return x.index_select(2, heads) if heads is not None else x

    if args.accuracy:
        t0 = time.time()
        exact = harness.exact_attention_fp32(sample(q, True), sample(k, False), sample(v, False))
        torch.cuda.synchronize()
        log(f"  exact FP32 attention: {time.time() - t0:.1f} s")
    case["accuracy_reference"] = {"exact": "softmax(QK^T*scale)V in FP32 on the GPU (IEEE matmuls), chunked over "
                                           "query rows, on the BF16 inputs" if exact is not None else None,
                                  "bf16": None,
                                  "query_rows": "all" if rows is None else int(rows.numel()),
                                  "heads": "all" if heads is None else int(heads.numel())}
    bf16_ref, timers, results = None, {}, {}
    for name, scope, params in _entries(args, status):
        rid = _entry_id(name, scope, params)
        res = {"id": rid, "backend": name, "scope": scope, "kind": bk.BACKENDS[name][0], "params": params,
               "status": "ok"}
        results[rid] = res
        case["results"].append(res)
        try:
            built = bk.build(name, inp, scope, repair_budget=params.get("repair_budget"),
                             mid_window_blocks=args.mid_window_blocks)
            res["params"] = {**built.params, **params}
            if built.note:
                res["note"] = built.note
            o = sample(built.to_bshd(built.fn()), True)
            torch.cuda.synchronize()
            acc = {"vs_exact_fp32": harness.error_metrics_torch(o, exact) if exact is not None else None}
            if bf16_ref is None and name in bk.BF16_REFERENCES:
                bf16_ref = o.contiguous()
                case["accuracy_reference"]["bf16"] = rid
            acc["vs_sdpa_bf16"] = harness.error_metrics_torch(o, bf16_ref) if bf16_ref is not None else None
            res["accuracy"] = acc
            del o
            timers[rid] = harness.Timer(built.fn, target_ms=args.target_ms, max_calls=args.max_calls, cold=cold,
                                        use_graph=not built.eager)
            log(f"  {rid:<28} ready: {timers[rid].describe()['method']}, "
                f"{timers[rid].calls} call(s)/replay, ~{timers[rid].call_ms_estimate:.3f} ms/call")
        except bk.Missing as exc:
            res.update(status="missing", reason=str(exc))
        except Exception as exc:
            res.update(status="error", error=_short_error(exc), traceback=traceback.format_exc(limit=4)[-2000:])
            log(f"  {rid}: error: {res['error']}")
            torch.cuda.synchronize()
    del exact, bf16_ref
    samples, orders, errors = harness.run_rounds(timers, args.rounds, args.seed + case_index, flush)
    case["visiting_orders"] = orders
    anchors = [i for i in timers if results[i]["kind"] == "anchor" and i not in errors]
    for rid, timer in timers.items():
        res, smp = results[rid], samples[rid]
        med = harness.median(smp)
        res["timing"] = {**timer.describe(), "samples_ms": smp, "median_ms": med,
                         "min_ms": min((x for x in smp if x is not None), default=None),
                         "tflops": harness.tflops(flops, med)}
        if rid in errors:
            res.update(status="error", error=f"while timing: {errors[rid]}")
            continue
        res["ratios"] = {a: harness.paired_ratios(samples[a], smp) for a in anchors if a != rid}
        timer.release()
        log(f"  {rid:<28} {med:9.3f} ms  {res['timing']['tflops']:7.1f} TF  ({timer.method})")
    timers.clear()
    torch.cuda.synchronize()
    case["wall_s"] = round(time.time() - t_case, 1)
    case["sm_clock_mhz_after_case"] = record.gpu_query().get("sm_clock_mhz")
    return case


def run_ceilings(torch, device, args, log):
    from . import backends as bk
    out, timers, work = {}, {}, {}
    for name, (builder, amount) in bk.ceiling_builders(device).items():
        try:
            timers[name] = harness.Timer(builder(), target_ms=args.target_ms, max_calls=args.max_calls)
            work[name] = amount
        except Exception as exc:
            out[name] = {"status": "error", "error": _short_error(exc)}
    samples, _, errors = harness.run_rounds(timers, args.rounds, args.seed)
    for name, timer in timers.items():
        med = harness.median(samples[name])
        d = {"status": "error" if name in errors else "ok", **timer.describe(), "samples_ms": samples[name],
             "median_ms": med}
        if name == "copy":
            d.update(bytes=bk.COPY_BYTES, gbps=work[name] / (med * 1e-3) / 1e9)
        else:
            d.update(shape=[bk.GEMM_N] * 3, flops=work[name], tflops=harness.tflops(work[name], med))
        if name in errors:
            d["error"] = errors[name]
        out[name] = d
        timer.release()
    timers.clear()
    log("ceilings: " + ", ".join(f"{n} {v.get('tflops', v.get('gbps', float('nan'))):.0f}"
                                 f"{' TF' if 'tflops' in v else ' GB/s' if 'gbps' in v else ''}"
                                 for n, v in out.items()))
    return out


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and appends each option's default, where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        none = default is None or default is False or default == [] or default == argparse.SUPPRESS
        if "%(default)" not in text and not none and action.option_strings:
            text += " (default: %(default)s)"
        return text


BENCH_DESCRIPTION = """\
Time openvc's FP8 attention next to other attention backends (torch SDPA, FlashAttention-3/4, cuDNN
FP8, the VC-Attention baseline) on synthetic video-like inputs or on captured q, k, v, measure each
output's error against exact FP32 attention, and write everything to a JSON record; open-vc-attn-report
turns records into tables and plots. Needs torch and a CUDA GPU (openvc's own backends: an H100/H200);
--dry-run and --list-backends run nothing on the GPU.

presets (--preset):
  smoke    1,200 tokens, 2 and 4 heads (seconds)
  video    73,397 tokens, 7, 14 and 56 heads (the README's table)
  wan480   Wan 2.1 480p latent grid, 32,760 tokens, 40 heads
  wan720   Wan 2.1 720p latent grid, 75,600 tokens, 40 heads
  sweep    4,096 to 131,072 tokens, 7 heads"""

BENCH_EPILOG = """\
examples:
  open-vc-attn-bench --list-backends
  open-vc-attn-bench --preset video --out bench-video.json
  open-vc-attn-bench --preset sweep --seqlens 16384,65536 --backends open-vc,sdpa-cudnn
  open-vc-attn-bench --input capture.pt --no-ceilings --out capture.json
  open-vc-attn-report bench-video.json --out-dir report"""


def _bench_parser():
    from . import backends as bk
    p = argparse.ArgumentParser(prog="open-vc-attn-bench", description=BENCH_DESCRIPTION, epilog=BENCH_EPILOG,
                                formatter_class=_HelpFormatter)
    what = p.add_argument_group("what to run")
    what.add_argument("--preset", choices=PRESETS, default="smoke", help="input set (see presets above)")
    what.add_argument("--input", action="append", default=[], metavar="FILE",
                      help=".pt or .npz file with q, k, v of shape [B, S, H, D] captured from a model "
                           "(repeatable; replaces the preset's cases)")
    what.add_argument("--heads", metavar="LIST", help="comma list of head counts replacing the preset's, e.g. 7,56")
    what.add_argument("--seqlens", metavar="LIST",
                      help="comma list of sequence lengths replacing the preset's, e.g. 16384,32768")
    what.add_argument("--backends", metavar="LIST", default=",".join(bk.BACKENDS),
                      help="comma list of backends to time (see --list-backends)")
    what.add_argument("--scopes", metavar="LIST", default="attention,complete",
                      help="what a timed call covers: 'attention' (the kernel on inputs quantized beforehand) "
                           "and/or 'complete' (BF16 in to BF16 out, every preparation step included)")
    what.add_argument("--repair-budgets", metavar="LIST", default="0.005",
                      help="comma list of V repair budgets (fractions of the tokens) for open-vc-repair")
    what.add_argument("--mid-window-blocks", type=int, default=DEFAULT_MID_WINDOW_BLOCKS, metavar="N",
                      help="openvc's key order: visit keys from N blocks past the diagonal block back to "
                           "the first, then the rest (docs/numerics.md section 5)")
    what.add_argument("--gen-heads", type=int, default=7, metavar="N",
                      help="distinct heads generated per shape and tiled to the head count (generating a "
                           "73k-token head takes about 1.5 s); 0 generates every head")
    timing = p.add_argument_group("timing")
    timing.add_argument("--rounds", type=int, default=12,
                        help="timing rounds; each round times every backend once, in a seeded random order, "
                             "and the record keeps the median")
    timing.add_argument("--seed", type=int, default=0, help="seed of the generated inputs and of the visiting order")
    timing.add_argument("--target-ms", type=float, default=20.0, metavar="MS",
                        help="shortest timed replay: short calls are repeated inside one CUDA graph to reach it")
    timing.add_argument("--max-calls", type=int, default=4096, metavar="N",
                        help="most calls captured in one CUDA graph")
    timing.add_argument("--cold-l2", action="store_true",
                        help="flush the L2 cache before each timed call (applies when the inputs fit in L2)")
    timing.add_argument("--allow-shared", action="store_true",
                        help="run even if another process uses the GPU (the record then says its timings are "
                             "not reliable)")
    timing.add_argument("--time-budget-s", type=float, metavar="S",
                        help="skip the remaining cases once this many seconds have passed")
    timing.add_argument("--no-ceilings", action="store_true",
                        help="skip the FP8/BF16 GEMM and memory-copy ceilings measured before the cases")
    accuracy = p.add_argument_group("accuracy")
    accuracy.add_argument("--no-accuracy", action="store_true",
                          help="skip the error measurement against exact FP32 attention")
    accuracy.add_argument("--accuracy-rows", type=int, default=0, metavar="N",
                          help="measure the error on N evenly spaced query rows (0: all rows; exact attention "
                               "over every row of a long sequence takes minutes)")
    out = p.add_argument_group("output")
    out.add_argument("--out", default="open-vc-bench.json", metavar="PATH",
                     help="JSON record, rewritten after each case")
    out.add_argument("--git-commit", metavar="SHA",
                     help="commit to record when the source tree has no .git (e.g. a copy)")
    out.add_argument("--dry-run", action="store_true",
                     help="print the cases and exit (imports no torch, runs nothing)")
    out.add_argument("--list-backends", action="store_true",
                     help="print which backends this machine can run, with the reason for each missing one, "
                          "and exit")
    return p


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()] if text else None


def main_bench(argv=None) -> int:
    from . import backends as bk
    args = _bench_parser().parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    args.repair_budgets = [float(x) for x in args.repair_budgets.split(",") if x.strip()]
    args.accuracy = not args.no_accuracy
    bad = [b for b in args.backends if b not in bk.BACKENDS] + [s for s in args.scopes if s not in record.SCOPES]
    if bad:
        print(f"open-vc-attn-bench: unknown backend or scope: {', '.join(bad)}", file=sys.stderr)
        return 2
    cases = [] if args.input else preset_cases(args.preset, _ints(args.heads), _ints(args.seqlens))
    if args.dry_run:
        for c in cases:
            tf = harness.attention_flops(c.batch, c.heads, c.seqlen, c.seqlen, c.head_dim) / 1e12
            print(f"{c.name}: B={c.batch} S={c.seqlen} H={c.heads} D={c.head_dim} {tf:.1f} TFLOP/call "
                  f"generator={json.dumps(c.generator, sort_keys=True)}")
        for path in args.input:
            print(f"input {path}")
        print(f"distinct generated heads per shape: {list(distinct_heads(cases, args.gen_heads).values())}")
        return 0
    if args.list_backends:
        for name in bk.BACKENDS:
            st, why = bk.available(name)
            print(f"{name:<16} {st}{': ' + why if why else ''}")
        return 0

    def log(msg):
        print(msg, flush=True)
    t_start = time.time()
    settings = {"preset": "input" if args.input else args.preset, "inputs": args.input,
                "cases": [c.name for c in cases], "rounds": args.rounds, "seed": args.seed,
                "target_replay_ms": args.target_ms, "max_calls": args.max_calls, "cold_l2": args.cold_l2,
                "scopes": args.scopes, "backends": args.backends, "repair_budgets": args.repair_budgets,
                "mid_window_blocks": args.mid_window_blocks, "gen_heads": args.gen_heads,
                "allow_shared": args.allow_shared, "accuracy": args.accuracy}
    rec = record.new_record(settings, record.environment(args.git_commit))
    gpu = record.gpu_query()
    # Before torch initializes CUDA, so this process is not on the GPU yet.
    others = record.other_gpu_processes(record.gpu_processes(gpu.get("uuid")), self_on_gpu=False)
    if others is None:
        rec["warnings"].append("nvidia-smi unavailable: could not check for other processes on the GPU")
    elif others:
        desc = ", ".join(f"pid {p['pid']} {p['name']} ({p['used_memory_mib']} MiB)" for p in others)
        if not args.allow_shared:
            print(f"open-vc-attn-bench: refusing to run: the GPU is in use by {desc} (--allow-shared overrides)",
                  file=sys.stderr)
            return 3
        rec["gpu_shared"] = True
        rec["warnings"].append(f"GPU shared with other processes: {desc}; timings are not reliable")
    import torch
    if not torch.cuda.is_available():
        print("open-vc-attn-bench: torch sees no CUDA device", file=sys.stderr)
        return 2
    with torch.no_grad():   # scoped, not set_grad_enabled: main_bench may run inside a test session
        return _run(torch, args, rec, cases, gpu, t_start, log)


def _run(torch, args, rec, cases, gpu, t_start, log) -> int:
    from . import backends as bk
    device = torch.device("cuda", 0)
    record.add_torch_facts(rec["environment"], torch, device)
    for name in args.backends:
        st, why = bk.available(name)
        rec["backends"][name] = {"status": st, "kind": bk.BACKENDS[name][0], "label": bk.BACKENDS[name][1],
                                 **({"reason": why} if why else {})}
        log(f"backend {name}: {st}{': ' + why if why else ''}")
    record.write_record(rec, args.out)
    if not args.no_ceilings:
        rec["ceilings"] = run_ceilings(torch, device, args, log)
        record.write_record(rec, args.out)
    cache = _InputCache(torch, device, args.seed, distinct_heads(cases, args.gen_heads))
    jobs = [(c.name, lambda c=c: cache.tensors(c)) for c in cases] + \
           [(os.path.splitext(os.path.basename(p))[0], lambda p=p: _file_tensors(torch, device, p)) for p in args.input]
    for index, (name, make) in enumerate(jobs):
        if args.time_budget_s and time.time() - t_start > args.time_budget_s:
            rec["warnings"].append(f"time budget {args.time_budget_s:.0f} s spent: skipped {name} and later cases")
            log(rec["warnings"][-1])
            break
        log(f"case {name}")
        try:
            q, k, v, source = make()
            rec["cases"].append(run_case(torch, device, name, q, k, v, source, args, rec["backends"], index, log))
            del q, k, v
        except Exception as exc:
            rec["warnings"].append(f"case {name} failed: {_short_error(exc)}")
            log(rec["warnings"][-1])
        torch.cuda.empty_cache()
        record.write_record(rec, args.out)
    gpu_after = record.gpu_query()
    rec["environment"]["sm_clock_mhz_after"] = gpu_after.get("sm_clock_mhz")
    rec["environment"]["temperature_c_after"] = gpu_after.get("temperature_c")
    others = record.other_gpu_processes(record.gpu_processes(gpu.get("uuid")), self_on_gpu=True)
    if others:
        rec["gpu_shared"] = True
        rec["warnings"].append("other processes appeared on the GPU during the run: "
                               + ", ".join(f"pid {p['pid']} {p['name']}" for p in others))
    # "partial": a case failed or the time budget skipped some (the warnings say which).
    rec["status"] = "complete" if len(rec["cases"]) == len(jobs) else "partial"
    rec["wall_s"] = round(time.time() - t_start, 1)
    record.write_record(rec, args.out)
    for w in rec["warnings"]:
        log(f"warning: {w}")
    log(f"record: {args.out} ({rec['wall_s']} s)")
    return 0


def main_report(argv=None) -> int:
    from . import report
    p = argparse.ArgumentParser(prog="open-vc-attn-report", formatter_class=_HelpFormatter,
                                description="Markdown tables and PNG plots from open-vc-attn-bench records\n"
                                            "(plots need matplotlib: pip install 'open-vc-attn[bench]').")
    p.add_argument("records", nargs="+", metavar="RECORD", help="JSON record written by open-vc-attn-bench --out")
    p.add_argument("--out-dir", default="bench-report", metavar="DIR",
                   help="folder for README.md (the tables) and the plots")
    p.add_argument("--no-plots", action="store_true", help="write the tables only")
    args = p.parse_args(argv)
    recs = []
    for path in args.records:
        rec = record.load_record(path)
        errors = record.validate_record(rec)
        if errors:
            print(f"open-vc-attn-report: {path}: not a valid record: {'; '.join(errors[:5])}", file=sys.stderr)
            return 2
        rec["_path"] = path
        recs.append(rec)
    md, plots, msg = report.write_report(recs, args.out_dir, plots=not args.no_plots)
    print(f"wrote {md}")
    for path in plots:
        print(f"wrote {path}")
    if msg:
        print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main_bench())
