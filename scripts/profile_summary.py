#!/usr/bin/env python3
"""Summary of an Nsight Compute per-instruction export (`scripts/device/check.sh profile` writes
ncu_source.csv): stall reasons over the whole kernel, the instructions with the most warp samples and
the samples by opcode, so a profile can be read on the CPU machine.

Usage: python3 scripts/profile_summary.py ncu_source.csv [--top 30] [--min-exec N]
"""
import argparse
import collections
import csv


def number(row, idx, key):
    try:
        return float(row[idx[key]].replace(",", ""))
    except (KeyError, ValueError):
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30, help="instructions to list")
    ap.add_argument("--min-exec", type=float, default=0,
                    help="only instructions executed at least this often (e.g. the main loop's count)")
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[header_at]
    idx = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[header_at + 1:] if len(r) == len(hdr)]
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(number(r, idx, samples) for r in data) or 1.0

    by_reason = collections.Counter()
    for r in data:
        for k in reasons:
            by_reason[k] += number(r, idx, k)
    reason_total = sum(by_reason.values()) or 1.0
    print("stall reasons (share of the reason samples):")
    for k, c in by_reason.most_common():
        if c:
            print(f"  {k:28s} {100 * c / reason_total:5.1f}%")

    sel = [r for r in data if number(r, idx, "Instructions Executed") >= args.min_exec]
    print(f"\ninstructions with the most samples (share of all samples), top {args.top}:")
    for r in sorted(sel, key=lambda r: -number(r, idx, samples))[:args.top]:
        s = number(r, idx, samples)
        main_reasons = sorted(((number(r, idx, k), k) for k in reasons), reverse=True)[:2]
        why = ", ".join(f"{k[6:]} {100 * v / max(s, 1):.0f}%" for v, k in main_reasons if v)
        print(f"  {r[0][-6:]:>6} {100 * s / total:5.2f}%  {r[1].strip()[:58]:58s} {why}")

    by_op = collections.Counter()
    for r in sel:
        words = r[1].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        by_op[op.split(".")[0]] += number(r, idx, samples)
    print("\nsamples by opcode:")
    for op, s in by_op.most_common(15):
        print(f"  {op:12s} {100 * s / total:5.1f}%")


if __name__ == "__main__":
    main()
