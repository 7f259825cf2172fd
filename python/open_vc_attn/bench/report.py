"""Markdown tables and PNG plots from one or more benchmark records (no torch; matplotlib optional).

Tables: per run (GPU, commit, clocks, ceilings, backends not available) and per case: backend, scope,
timing method, median ms, TFLOP/s, share of the FP8 GEMM ceiling, paired speedups against cuDNN BF16,
FA3 BF16 and FA3 FP8, and accuracy against exact FP32 attention and against the BF16 SDPA output.
Plots (only where the records hold the points): throughput vs head count (same S), throughput vs
sequence length (same H), error vs V-repair budget.
"""
from __future__ import annotations

import math
import os
import re

PLOT_SKIP_MESSAGE = "matplotlib is not installed: plots skipped (pip install 'open-vc-attn[bench]')"
# Speedup columns: (header, anchor backend). FP8 anchors are matched in the row's own scope first.
SPEEDUP_COLUMNS = (("vs cuDNN BF16", "sdpa-cudnn"), ("vs FA3 BF16", "fa3-bf16"), ("vs FA3 FP8", "fa3-fp8"),
                    ("vs SA2", "sage2"))


def _fmt(x, spec):
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "—"
    return format(x, spec)


def _ratio(res, anchor):
    ratios = res.get("ratios") or {}
    for aid in (f"{anchor}:{res['scope']}", f"{anchor}:attention"):
        if aid in ratios:
            return f"{_fmt(ratios[aid]['median'], '.2f')}x"
    return "—"


def _acc(res, which, key, spec=".3g"):
    m = (res.get("accuracy") or {}).get(which)
    return _fmt(m.get(key) if m else None, spec)


def _label(res):
    p = res.get("params") or {}
    extra = f" ρ={p['repair_budget']:g}" if p.get("repair_budget") is not None else ""
    return f"{res['backend']}{extra}"


def _esc(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _case_table(case, fp8_ceiling):
    head = ["backend", "scope", "timing", "median ms", "TFLOP/s", "% FP8 GEMM",
            *[h for h, _ in SPEEDUP_COLUMNS], "rel L2 vs exact", "rel L2 vs BF16 SDPA", "cosine", "max abs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for res in case["results"]:
        if res["status"] != "ok":
            why = res.get("error") or res.get("reason") or ""
            lines.append(f"| {_esc(_label(res))} | {res['scope']} | {res['status']}: {_esc(why)[:160]} |"
                         + " |" * (len(head) - 3))
            continue
        t = res["timing"]
        # eager* marks a failed graph capture; a backend timed eagerly on purpose (SageAttention2) is plain eager
        method = "graph" if t["method"] == "cuda_graph" else ("eager*" if t.get("capture_error") else "eager")
        if t.get("calls_per_replay"):
            method += f" ×{t['calls_per_replay']}"
        share = t["tflops"] / fp8_ceiling * 100 if fp8_ceiling else None
        row = [_esc(_label(res)), res["scope"], method, _fmt(t["median_ms"], ".3f"), _fmt(t["tflops"], ".1f"),
               _fmt(share, ".0f"), *[_ratio(res, a) for _, a in SPEEDUP_COLUMNS],
               _acc(res, "vs_exact_fp32", "rel_l2"), _acc(res, "vs_sdpa_bf16", "rel_l2"),
               _acc(res, "vs_exact_fp32", "cosine", ".6f"), _acc(res, "vs_exact_fp32", "max_abs")]
        lines.append("| " + " | ".join(row) + " |")
        if t["method"] == "eager" and t.get("capture_error"):
            notes.append(f"`{res['id']}`: CUDA graph capture failed, timed eagerly "
                         f"({_esc(t.get('capture_error', ''))})")
        elif t["method"] == "eager":
            notes.append(f"`{res['id']}`: timed eagerly by design (CUDA events around back-to-back calls)")
        if res.get("note"):
            notes.append(f"`{res['id']}`: {_esc(res['note'])}")
    return lines, notes


def _source_text(src):
    if src.get("kind") == "file":
        return f"input file `{os.path.basename(src.get('path', '?'))}`"
    kinds = src.get("head_kinds") or []
    tiled = f", {src.get('distinct_heads')} distinct heads tiled" if src.get("tiled") else ""
    return (f"synthetic video-like generator (seed {src.get('seed')}{tiled}; "
            f"{kinds.count('spatial')} spatial / {kinds.count('temporal')} temporal heads)")


def render_markdown(records, plot_paths=(), plot_message=None) -> str:
    out = ["# openvc attention benchmark", ""]
    out.append("TFLOP/s = 4·B·H·Sq·Sk·D / median time. Speedups are medians of per-round paired ratios "
               "(anchor time / this time; > 1 is faster). Timing `graph ×R`: R calls per CUDA-graph "
               "replay; `eager*`: capture failed, timed eagerly. Accuracy: relative L2, cosine and max "
               "abs error against exact attention in FP32 on the BF16 inputs; rel L2 also against the "
               "BF16 SDPA output.")
    out.append("")
    for rec in records:
        env, st = rec["environment"], rec["settings"]
        commit = env.get("git_commit") or "unknown"
        dirty = " (uncommitted changes)" if env.get("git_dirty") else ""
        out.append(f"## {env.get('gpu_name') or 'unknown GPU'} — commit `{commit[:12]}`{dirty}")
        out.append("")
        out.append(f"- run: {rec.get('created', '?')}, status {rec.get('status')}, preset `{st.get('preset')}`, "
                   f"{st.get('rounds')} rounds, seed {st.get('seed')}, cold L2 {'on' if st.get('cold_l2') else 'off'}")
        out.append(f"- software: torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
                   f"driver {env.get('driver')}, open_vc_attn {env.get('open_vc_attn')}")
        out.append(f"- SM clock (MHz): before {_fmt(env.get('sm_clock_mhz_before'), '.0f')}, after "
                   f"{_fmt(env.get('sm_clock_mhz_after'), '.0f')}, max {_fmt(env.get('sm_clock_max_mhz'), '.0f')}")
        out.append(f"- command: `{env.get('command_line', '')}`")
        if rec.get("gpu_shared"):
            out.append("- **WARNING: the GPU was shared with another process during this run; timings are "
                       "not reliable.**")
        for w in rec.get("warnings", []):
            out.append(f"- warning: {_esc(w)}")
        out.append("")
        ceil = rec.get("ceilings") or {}
        if ceil:
            out.append("| ceiling (same run) | median ms | rate |")
            out.append("|---|---|---|")
            for name, c in ceil.items():
                if c.get("status") != "ok":
                    out.append(f"| {name} | {c.get('status')}: {_esc(c.get('error', ''))} | |")
                elif "gbps" in c:
                    out.append(f"| device copy {c['bytes'] / 2**30:.0f} GiB | {_fmt(c['median_ms'], '.3f')} | "
                               f"{_fmt(c['gbps'], '.0f')} GB/s (read + write) |")
                else:
                    dims = "x".join(str(n) for n in c.get("shape", []))
                    label = {"gemm_fp8": "FP8 GEMM (torch._scaled_mm e4m3)",
                             "gemm_bf16": "BF16 GEMM (torch.matmul)"}.get(name, name)
                    out.append(f"| {label} {dims} | {_fmt(c['median_ms'], '.3f')} | "
                               f"{_fmt(c['tflops'], '.0f')} TFLOP/s |")
            out.append("")
        missing = {n: b for n, b in rec.get("backends", {}).items() if b.get("status") != "ok"}
        if missing:
            out.append("Not available in this run:")
            for n, b in missing.items():
                label = f" ({b['label']})" if b.get("label") else ""
                out.append(f"- `{n}`{label}: {b['status']}: {_esc(b.get('reason', ''))}")
            out.append("")
        fp8_ceiling = (ceil.get("gemm_fp8") or {}).get("tflops")
        for case in rec.get("cases", []):
            out.append(f"### {case['name']}: B={case['batch']}, Sq={case['seqlen_q']:,}, Sk={case['seqlen_k']:,}, "
                       f"H={case['heads']}, D={case['head_dim']}, {case.get('dtype', '')}")
            out.append("")
            out.append(f"Inputs: {_source_text(case.get('source', {}))}. Cold L2: {case['cold_l2'].get('note')}.")
            out.append("")
            lines, notes = _case_table(case, fp8_ceiling)
            out += lines
            out.append("")
            out += [f"- {n}" for n in notes]
            if notes:
                out.append("")
    if plot_paths or plot_message:
        out.append("## Plots")
        out.append("")
        for p in plot_paths:
            out.append(f"![{os.path.basename(p)}]({os.path.basename(p)})")
        if plot_message:
            out.append(plot_message)
        out.append("")
    return "\n".join(out)


# ---- plots ----------------------------------------------------------------------------------------------

def _points(records):
    """(gpu, case, result) for every ok result; a later record overrides the same (gpu, case, id)."""
    seen = {}
    for rec in records:
        gpu = rec["environment"].get("gpu_name") or "GPU"
        for case in rec.get("cases", []):
            for res in case["results"]:
                if res["status"] == "ok":
                    seen[(gpu, case["name"], res["id"])] = (gpu, case, res)
    return list(seen.values())


def _series_plot(plt, groups, xkey, xlabel, title_fmt, fname_fmt, out_dir, logx=False):
    paths = []
    for key, pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if len({p[1][xkey] for p in pts}) < 2:
            continue
        series = {}
        for gpu, case, res in pts:
            series.setdefault((_label(res), res["scope"], res.get("kind")), []).append(
                (case[xkey], res["timing"]["tflops"]))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (label, scope, kind), xy in sorted(series.items()):
            xy.sort()
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o",
                    linestyle="--" if kind == "anchor" else "-", label=f"{label} ({scope})")
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(title_fmt.format(*key))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", fname_fmt.format(*key)))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _repair_plot(plt, points, out_dir):
    curves = {}
    for gpu, case, res in points:
        budget = (res.get("params") or {}).get("repair_budget")
        if res["backend"] == "open-vc":
            budget = 0.0
        m = (res.get("accuracy") or {}).get("vs_exact_fp32")
        if budget is None or not m:
            continue
        curves.setdefault((gpu, case["name"], res["scope"]), []).append((budget, m["rel_l2"]))
    curves = {k: v for k, v in curves.items() if any(b > 0 for b, _ in v)}
    if not curves:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (gpu, name, scope), pts in sorted(curves.items()):
        pts.sort()
        ax.plot([100 * b for b, _ in pts], [e for _, e in pts], marker="o", label=f"{name} ({scope})")
    ax.set_xlabel("V repair budget (% of key tokens)")
    ax.set_ylabel("rel L2 vs exact FP32")
    ax.set_title("Error vs repair budget")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "error_vs_repair_budget.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def make_plots(records, out_dir) -> tuple:
    """(paths, message): message is set when plotting was skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], PLOT_SKIP_MESSAGE
    points = _points(records)
    by_s, by_h = {}, {}
    for p in points:
        gpu, case, _ = p
        by_s.setdefault((gpu, case["seqlen_q"], case["head_dim"], case["batch"]), []).append(p)
        by_h.setdefault((gpu, case["heads"], case["head_dim"], case["batch"]), []).append(p)
    paths = _series_plot(plt, by_s, "heads", "heads", "{0}: throughput vs heads (S={1}, D={2}, B={3})",
                         "tflops_vs_heads_S{1}_D{2}_B{3}.png", out_dir)
    paths += _series_plot(plt, by_h, "seqlen_q", "sequence length", "{0}: throughput vs length (H={1}, D={2}, B={3})",
                          "tflops_vs_seqlen_H{1}_D{2}_B{3}.png", out_dir, logx=True)
    paths += _repair_plot(plt, points, out_dir)
    return paths, (None if paths else "no plot applies: the records hold no series of 2+ head counts, "
                                      "lengths or repair budgets")


def write_report(records, out_dir, plots=True) -> tuple:
    """Writes out_dir/README.md (+ PNGs). Returns (markdown path, plot paths, message or None)."""
    os.makedirs(out_dir, exist_ok=True)
    paths, msg = make_plots(records, out_dir) if plots else ([], None)
    md_path = os.path.join(out_dir, "README.md")
    with open(md_path, "w") as f:
        f.write(render_markdown(records, paths, msg))
    return md_path, paths, msg
