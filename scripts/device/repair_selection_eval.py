#!/usr/bin/env python3
"""V residual repair on the GPU: energy vs attention-aware selection at equal budgets, and the cost.

    python3 scripts/device/repair_selection_eval.py OUT.json [--configs 16384x8,32760x4]
        [--budgets 0.0025 0.005 0.01 0.02 0.04 0.08] [--timing 73397x56] [--fp64] [--seed 0]

Accuracy: synthetic video-like q, k, v (open_vc_attn.video_inputs, Wan-480p-like 30 x 52 frames truncated
to S tokens) for each SxH config; rel L2 of attention_fp8 (plain) and of attention_v_repair with
selection="energy" / "attention" against exact attention on the BF16 inputs (torch FP32 with TF32 off, or
FP64 with --fp64, in query chunks). Cost, per config and at the --timing shapes (random normal inputs,
budget 0.5%): median CUDA-event time of the repair preparation (the open_vc_attn::prepare_v_repair op,
and the whole attention-aware selection) and of attention with and without the repair rows. Prints a
table and writes everything to OUT.json.
"""
import argparse
import json
import math
import sys

import numpy as np
import torch

import open_vc_attn
from open_vc_attn import repair, video_inputs
from open_vc_attn.bench import harness

SELECTIONS = ("energy", "attention")


def parse_shapes(text):
    out = []
    for item in filter(None, text.split(",")):
        s, h = item.lower().split("x")
        out.append((int(s), int(h)))
    return out


def video_qkv(s, h, seed):
    frames = -(-s // (30 * 52))
    p = video_inputs.generate(frames=frames, height=30, width=52, seqlen=s, heads=h, head_dim=128, seed=seed)
    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to("cuda", torch.bfloat16) for x in (p.q, p.k, p.v))


def exact_attention(q, k, v, fp64, chunk=2048):
    """Softmax attention on the BF16 values, [B, S, H, D] float32 (or float64)."""
    dt = torch.float64 if fp64 else torch.float32
    b, s, h, d = q.shape
    out = torch.empty(q.shape, dtype=dt, device=q.device)
    scale = 1.0 / math.sqrt(d)
    for bi in range(b):
        for hi in range(h):
            kk, vv = k[bi, :, hi].to(dt), v[bi, :, hi].to(dt)
            for i0 in range(0, s, chunk):
                logits = (q[bi, i0:i0 + chunk, hi].to(dt) @ kk.T) * scale
                out[bi, i0:i0 + chunk, hi] = torch.softmax(logits, dim=-1) @ vv
    return out


def rel_l2(x, ref):
    x, ref = x.double(), ref.double()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def time_ms(fn, iters=10):
    """Median ms per call, timed as the benchmark times it (open_vc_attn.bench.harness)."""
    return harness.median_ms(fn, rounds=iters)


def costs(q, k, v, prepared, budget, iters):
    """Median ms of the repair preparation (energy op; whole attention-aware selection) and attention."""
    from open_vc_attn import ops
    fp8 = (prepared.k_codes, prepared.k_descale, prepared.v_packed, prepared.v_descale)
    pr = repair.prepare_v_repair(q, k, v, budget, prepared=prepared)
    res = dict(rows=pr.rows,
               prep_energy_ms=time_ms(lambda: ops.prepare_v_repair_op(v, *fp8, budget), iters),
               prep_attention_ms=time_ms(lambda: repair.prepare_v_repair(q, k, v, budget, "attention",
                                                                         prepared=prepared), max(2, iters // 3)),
               attention_ms=time_ms(lambda: open_vc_attn.attention_fp8(prepared), max(2, iters // 3)),
               attention_repair_ms=time_ms(lambda: repair.attention_v_repair(pr), max(2, iters // 3)))
    res["repair_overhead_pct"] = 100.0 * (res["prep_energy_ms"] + res["attention_repair_ms"] - res["attention_ms"]) \
        / res["attention_ms"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--configs", default="16384x8,32760x4", help="SxH list for the accuracy sweep")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.0025, 0.005, 0.01, 0.02, 0.04, 0.08])
    ap.add_argument("--timing", default="73397x56", help="SxH list timed at budget 0.5%% on random inputs ('' skips)")
    ap.add_argument("--fp64", action="store_true", help="exact attention in FP64 instead of FP32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args), accuracy=[],
                  timing=[])
    print(f"{'S':>6} {'H':>3} {'budget':>7} {'rows':>5} | {'plain':>8} {'energy':>8} {'attention':>9} "
          f"{'attn/en':>7} | rel L2 vs exact")
    for s, h in parse_shapes(args.configs):
        q, k, v = video_qkv(s, h, args.seed)
        exact = exact_attention(q, k, v, args.fp64)
        prepared = open_vc_attn.prepare_fp8(q, k, v)
        plain = rel_l2(open_vc_attn.attention_fp8(prepared), exact)
        for budget in args.budgets:
            row = dict(seqlen=s, heads=h, budget=budget, rows=repair.repair_rows(budget, s), plain=plain)
            for sel in SELECTIONS:
                pr = repair.prepare_v_repair(q, k, v, budget, sel, prepared=prepared)
                row[sel] = rel_l2(repair.attention_v_repair(pr), exact)
            record["accuracy"].append(row)
            print(f"{s:>6} {h:>3} {budget:>7.4f} {row['rows']:>5} | {plain:>8.5f} {row['energy']:>8.5f} "
                  f"{row['attention']:>9.5f} {row['attention'] / row['energy']:>7.3f}")
        c = costs(q, k, v, prepared, 0.005, args.iters)
        record["timing"].append(dict(seqlen=s, heads=h, budget=0.005, inputs="video", **c))
        del q, k, v, exact, prepared
        torch.cuda.empty_cache()

    for s, h in parse_shapes(args.timing):
        g = torch.Generator(device="cuda").manual_seed(args.seed)
        q, k, v = (torch.randn((1, s, h, 128), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        prepared = open_vc_attn.prepare_fp8(q, k, v)
        record["timing"].append(dict(seqlen=s, heads=h, budget=0.005, inputs="random normal",
                                     **costs(q, k, v, prepared, 0.005, args.iters)))
        del q, k, v, prepared
        torch.cuda.empty_cache()

    print(f"\n{'S':>6} {'H':>3} {'inputs':>13} {'rows':>5} | {'prep energy':>11} {'prep attn':>9} | "
          f"{'attention':>9} {'+repair':>9} {'overhead':>8}   (ms, budget 0.5%)")
    for t in record["timing"]:
        print(f"{t['seqlen']:>6} {t['heads']:>3} {t['inputs']:>13} {t['rows']:>5} | {t['prep_energy_ms']:>11.3f} "
              f"{t['prep_attention_ms']:>9.2f} | {t['attention_ms']:>9.2f} {t['attention_repair_ms']:>9.2f} "
              f"{t['repair_overhead_pct']:>7.2f}%")
    acc = record["accuracy"]
    if acc:
        ratios = [r["attention"] / r["energy"] for r in acc]
        wins = sum(r["attention"] < r["energy"] for r in acc)
        record["summary"] = dict(attention_over_energy_geomean=float(np.exp(np.mean(np.log(ratios)))),
                                 attention_wins=wins, cases=len(acc))
        gm = record["summary"]["attention_over_energy_geomean"]
        print(f"\nattention-aware / energy rel L2: geometric mean {gm:.4f}, lower in {wins} of {len(acc)} cases")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
