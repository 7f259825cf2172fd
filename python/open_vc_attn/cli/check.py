"""open-vc-attn-check: a quick end-to-end check of an installed open_vc_attn.

``--info`` prints the environment a bug report needs (versions, GPU, capability, which paths this
machine can run); ``--smoke`` runs the smoke check below; with neither it does both.

Smoke check. CPU branch (always): runs the CPU reference end to end on the synthetic "smoke"
video-like problem (quantize, ExpCast attention in mid-window and natural order, with a 0.5% V repair
budget) and compares each with exact FP64 attention. GPU branch (when torch sees a CUDA device of
compute capability 9.0): runs ``open_vc_attn.attention`` on the same problem in both key orders and
reports its rel L2 against exact attention and against the CPU reference on the same inputs and key
order ("vs reference" rows, which must stay below 1%). Exit code 0 when every rel L2 is below its
threshold, 1 otherwise, 2 when the compiled extension is missing (one line with the fix, no traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from . import info

REPAIR_BUDGET = 0.005
# FP8 E4M3 inputs plus ExpCast's 1/8-octave probability codes give ~3-4% rel L2 on the smoke problem;
# 8% leaves room for seed changes while still catching a broken path (those land near or above 100%).
DEFAULT_THRESHOLD = 0.08
# GPU kernel against the CPU reference on the same quantized inputs and key order: only accumulation
# order and BF16 output rounding differ (the GPU tests require 5e-3 on video-like inputs).
REFERENCE_THRESHOLD = 0.01
_VS_REFERENCE = " vs reference"


def _run_gpu(problem, exact):
    """GPU branch: open_vc_attn.attention on the smoke problem, in mid-window and natural order, against
    exact attention and against the CPU reference run on the SAME bf16/fp16 inputs with the same key
    order (so that row measures the kernel, not quantization). Returns (results, times)."""
    import torch

    import open_vc_attn
    from open_vc_attn import reference

    dev = torch.device("cuda")
    dtype = torch.bfloat16 if problem.dtype == "bfloat16" else torch.float16
    # Exact conversions: the arrays hold bf16 values (float32 storage) or are float16 already.
    q, k, v = (torch.from_numpy(x).to(dev, dtype) for x in (problem.q, problem.k, problem.v))
    results, times = {}, {}
    for name, mid in (("gpu expcast mid-window (w=4)", 4), ("gpu expcast natural order", None)):
        open_vc_attn.attention(q, k, v, mid_window_blocks=mid)          # warm-up (module load, first launch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = open_vc_attn.attention(q, k, v, mid_window_blocks=mid)
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - t0
        out = out.float().cpu().numpy()
        results[name] = reference.error_metrics(out, exact)
        # The kernel stores BF16: compare with the reference's output rounded the same way.
        ref_same = reference.to_bfloat16_values(reference.attention(problem.q, problem.k, problem.v,
                                                                    mid_window_blocks=mid))
        results[name + _VS_REFERENCE] = reference.error_metrics(out, ref_same.astype(np.float64))
    return results, times


def _run_cpu(problem, exact):
    from open_vc_attn import reference

    q, k, v = problem.q, problem.k, problem.v
    runs = [
        ("expcast mid-window (w=4)", dict(mid_window_blocks=4)),
        ("expcast natural order", dict(mid_window_blocks=None)),
        (f"expcast w=4 + repair {REPAIR_BUDGET:.1%}", dict(mid_window_blocks=4, repair_budget=REPAIR_BUDGET)),
    ]
    results, times = {}, {}
    # Quantization alone (section 1) as a sanity check of the scales: codes must reproduce the inputs.
    t0 = time.perf_counter()
    qq = reference.quantize_blocks(q)
    per_token = qq.descale[:, :, np.arange(q.shape[1]) // reference.QUANT_BLOCK]   # [B, H, S]
    deq = reference.e4m3_decode(qq.codes) * per_token.transpose(0, 2, 1)[..., None]
    quant = reference.error_metrics(deq, q.astype(np.float64))
    times["quantize q (blocks)"] = time.perf_counter() - t0
    results["quantize q (blocks)"] = quant
    for name, kwargs in runs:
        t0 = time.perf_counter()
        out = reference.attention(q, k, v, **kwargs)
        times[name] = time.perf_counter() - t0
        results[name] = reference.error_metrics(out, exact)
    return results, times


def _print_table(results, times, exact_time):
    head = f"{'configuration':<42} {'rel_l2':>9} {'max_abs':>9} {'rmse':>9} {'cosine':>10} {'time s':>7}"
    print(head)
    print("-" * len(head))
    for name, m in results.items():
        t = times.get(name)
        print(f"{name:<42} {m['rel_l2']:9.4%} {m['max_abs']:9.4f} {m['rmse']:9.5f} {m['cosine']:10.6f} "
              f"{t if t is not None else float('nan'):7.3f}")
    print(f"(reference: exact FP64 softmax attention on the unquantized inputs, {exact_time:.2f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="open-vc-attn-check",
        description="Check an installed open_vc_attn: the environment (--info) and the smoke check (--smoke); "
                    "with neither option, both.")
    parser.add_argument("--info", action="store_true",
                        help="print versions (openvc, Python, numpy, torch, CUDA, driver), the GPUs with their "
                             "compute capability and which paths this machine can run")
    parser.add_argument("--smoke", action="store_true",
                        help="run the smoke check: the CPU reference, and the GPU kernels where torch sees an "
                             "sm_90 GPU, on a small synthetic video-like problem against exact attention")
    parser.add_argument("--json", metavar="PATH", help="also write the results (and --info's facts) to PATH as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic inputs (default 0)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"largest acceptable rel L2 vs exact attention (default {DEFAULT_THRESHOLD})")
    args = parser.parse_args(argv)
    run_info, run_smoke = args.info or not args.smoke, args.smoke or not args.info

    report = {}
    if run_info:
        facts = info.collect()
        print("\n".join(info.format_info(facts)))
        report["info"] = facts
    if not run_smoke:
        _write_json(args.json, report)
        return 0
    problem_line = info.extension_problem()
    if problem_line:   # nothing below runs without the extension: one line with the fix, no traceback
        print(f"open-vc-attn-check: {problem_line}", file=sys.stderr)
        _write_json(args.json, {**report, "passed": False, "error": problem_line})
        return 2
    if run_info:
        print()

    import open_vc_attn
    from open_vc_attn import reference, video_inputs

    problem = video_inputs.from_preset("smoke", seed=args.seed)
    b, s, h, d = problem.q.shape
    print(f"open_vc_attn {open_vc_attn.__version__}: smoke problem (synthetic video-like, seed {args.seed}): "
          f"grid {problem.grid} -> B={b} S={s} H={h} D={d}, {problem.dtype} values, heads {problem.head_kinds}")
    t0 = time.perf_counter()
    exact = reference.attention_exact(problem.q, problem.k, problem.v)
    exact_time = time.perf_counter() - t0

    report.update(version=open_vc_attn.__version__, seed=args.seed, threshold=args.threshold,
                  problem={"preset": "smoke", "grid": list(problem.grid), "batch": b, "seqlen": s, "heads": h,
                           "head_dim": d, "dtype": problem.dtype})
    reason = info.gpu_unavailable_reason()
    gpu_results, gpu_times, gpu_error = {}, {}, None
    if reason is None:
        try:
            gpu_results, gpu_times = _run_gpu(problem, exact)
        except Exception as exc:  # report it as a failed check, after the CPU rows
            gpu_error = f"{type(exc).__name__}: {exc}"
    results, times = _run_cpu(problem, exact)
    results.update(gpu_results)
    times.update(gpu_times)
    _print_table(results, times, exact_time)

    # Quantization is checked loosely (E4M3 has 3 mantissa bits: ~3% rel); attention rows against threshold.
    # GPU rows against the reference on the same inputs: REFERENCE_THRESHOLD.
    def limit(name):
        if name.startswith("quantize"):
            return 0.05
        return REFERENCE_THRESHOLD if name.endswith(_VS_REFERENCE) else args.threshold
    failures = [n for n, m in results.items() if not (m["rel_l2"] < limit(n))]
    if gpu_error is not None:
        print(f"GPU path FAILED: {gpu_error}")
        failures.append("gpu path (raised)")
    elif reason is None:
        print("GPU path ran: " + ", ".join(gpu_results))
    else:
        print(f"GPU path skipped: {reason}")
    report.update(results=results, seconds={**times, "exact": exact_time},
                  gpu={"ran": reason is None and gpu_error is None, "skipped_reason": reason, "error": gpu_error},
                  passed=not failures)
    _write_json(args.json, report)
    if failures:
        print(f"FAIL: rel L2 at or above the threshold for: {', '.join(failures)}")
        return 1
    print(f"PASS: every attention rel L2 below {args.threshold:.2%}"
          + (f" ({REFERENCE_THRESHOLD:.2%} for GPU vs reference)" if gpu_results else ""))
    return 0


def _write_json(path, report):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
