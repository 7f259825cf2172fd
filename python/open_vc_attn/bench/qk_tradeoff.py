"""open_vc_attn.bench.qk_tradeoff: error against speed of openvc's Q/K formats and the peers (issue 25).

Methods: openvc with Q/K in E4M3, E4M3 + K smoothing, INT8, INT8 + K smoothing (``attention(q, k, v,
qk_format=..., k_smoothing=...)``, the complete call: preparation + attention), and INT8 + K smoothing with
P = the E4M3 rounding of the exponential (``p_format="exp2"``, method ``openvc-int8+smooth+exp2``), and the INT8 +
smoothing and exp2 methods with the V rounding bias correction (``v_bias_correction=True``, ``...+vbias``);
SageAttention2
(``sageattn(q, k, v, tensor_layout="NHD")``, INT8 Q/K per thread with K smoothing, FP8 PV); FlashAttention-3
FP8 with per-(batch, head) descales (quantization included in the complete call; the kernel alone is timed
too); cuDNN BF16 through torch SDPA. A method whose package is not importable (or an openvc build without
``qk_format``, or without ``p_format`` / ``_openvc_ext.PFormat`` for the exp2 method) is reported as
unavailable with the reason; nothing is substituted for it.

Error: rel L2 of the output against exact attention computed on the GPU in float64 from the same BF16
inputs, at S = 4,096, H = 4, D = 128 (``--seqlen/--heads/--head-dim``), on the five inputs of issue 25
(N(0,1); q, k x4; RMS-normed q, k x3; one key token x300; q x2 with K plus a per-channel offset of
4 N(0,1)) and the project's video-like generator, plain and sharp (q, k x3). Every seed of ``--seeds``
draws fresh inputs; the table shows the mean over seeds (the record keeps every seed).

Speed: the median over interleaved rounds of the complete call of each method at one speed shape
(default S = 32,760, H = 40, D = 128, random normal BF16): CUDA graphs of R calls >= 20 ms, except SA2,
timed eagerly (its launches do not replay from a CUDA graph); openvc is also timed eagerly, for the
like-for-like comparison with SA2.

    python -m open_vc_attn.bench.qk_tradeoff --out qk_tradeoff.json          # + qk_tradeoff.md, .png
    python -m open_vc_attn.bench.qk_tradeoff --seeds 0,1,2 --speed-shape none --out err_only.json

Writes the JSON record (``--out``), a markdown table (``--md``, default: the record's path with .md) and
a PNG (``--png``, default .png; skipped with a message when matplotlib is not installed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

SCHEMA = "open-vc-attn-qk-tradeoff/1"

# name -> (label, family, keyword arguments of open_vc_attn.attention). Order = order of the table.
METHODS = {
    "openvc-e4m3": ("openvc E4M3 Q/K", "openvc", {"qk_format": "e4m3"}),
    "openvc-e4m3+smooth": ("openvc E4M3 Q/K + K smoothing", "openvc", {"qk_format": "e4m3", "k_smoothing": True}),
    "openvc-int8": ("openvc INT8 Q/K", "openvc", {"qk_format": "int8"}),
    "openvc-int8+smooth": ("openvc INT8 Q/K + K smoothing", "openvc", {"qk_format": "int8", "k_smoothing": True}),
    "openvc-int8+smooth+exp2": ("openvc INT8 Q/K + K smoothing, exp2 P", "openvc",
                                {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2"}),
    "openvc-int8+smooth+vbias": ("openvc INT8 Q/K + K smoothing, V bias correction", "openvc",
                                 {"qk_format": "int8", "k_smoothing": True, "v_bias_correction": True}),
    "openvc-int8+smooth+exp2+vbias": ("openvc INT8 Q/K + K smoothing, exp2 P, V bias correction", "openvc",
                                      {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2",
                                       "v_bias_correction": True}),
    "sage2": ("SageAttention2 (INT8 QK + smooth K, FP8 PV)", "sage2", {}),
    "fa3-fp8": ("FA3 FP8, per-head descales", "fa3-fp8", {}),
    "cudnn-bf16": ("cuDNN BF16 (torch SDPA)", "cudnn-bf16", {}),
}
ISSUE_INPUTS = ("N(0,1)", "q,k x4", "RMS-normed q,k x3", "sink key x300", "q x2, K offset")
VIDEO_INPUTS = ("video-like", "video-like sharp x3")
INPUTS = ISSUE_INPUTS + VIDEO_INPUTS
# --inputs takes these short keys (the names hold commas).
INPUT_KEYS = dict(zip(("normal", "qk4", "rms3", "sink300", "koffset", "video", "video-sharp3"), INPUTS))
PNG_SKIP_MESSAGE = "matplotlib is not installed: PNG skipped (pip install 'open-vc-attn[bench]')"


# ---- inputs (numpy; no GPU) -----------------------------------------------------------------------------

def make_inputs(s=4096, h=4, d=128, seed=0, names=INPUTS) -> dict:
    """name -> (q, k, v, description), [S, H, D] float32 arrays holding BF16 values, fresh per seed.
    Issue 25's inputs and the video-like ones come from qk_formats.make_inputs (same draws as the CPU
    study); "q x2, K offset" is drawn here: q ~ 2 N(0,1), k = N(0,1) + 4 N(0,1) per (head, channel)."""
    import numpy as np
    from ..reference import to_bfloat16_values
    from .qk_formats import make_inputs as study_inputs
    out = {}
    have = study_inputs(s, h, d, seed)
    for name in names:
        if name in have:
            out[name] = have[name]
        elif name == "q x2, K offset":
            rng = np.random.default_rng([seed, 5])
            q, k, v = (rng.standard_normal((s, h, d), dtype=np.float32) for _ in range(3))
            offset = 4.0 * rng.standard_normal((1, h, d), dtype=np.float32)
            out[name] = (to_bfloat16_values(2 * q), to_bfloat16_values(k + offset), to_bfloat16_values(v),
                         "q ~ N(0, 2^2); k = N(0,1) + a per-(head, channel) offset of 4 N(0,1); v ~ N(0,1)")
        else:
            raise ValueError(f"inputs: expected names from {INPUTS}, got {name!r}")
    return out


# ---- methods --------------------------------------------------------------------------------------------

def method_status(name, ova=None) -> tuple:
    """("ok", None) or ("missing", why), without running anything."""
    from . import backends as bk
    try:
        family, kw = METHODS[name][1], METHODS[name][2]
        if family == "openvc":
            bk.openvc_runtime()
            if ova is None:
                import open_vc_attn as ova
            from .modes import p_format_support, qk_format_support, v_bias_support
            why = qk_format_support(ova)
            if why is not None and kw != {"qk_format": "e4m3"}:
                raise bk.Missing(why)
            why = p_format_support(ova) if "p_format" in kw else None
            if why is not None:
                raise bk.Missing(why)
            why = v_bias_support(ova) if kw.get("v_bias_correction") else None
            if why is not None:
                raise bk.Missing(why)
        elif family == "sage2":
            bk.sage2_function()
        elif family == "fa3-fp8":
            bk.fa3_module()
        elif family == "cudnn-bf16":
            import torch
            from torch.nn.attention import SDPBackend  # noqa: F401
            if not torch.cuda.is_available():
                raise bk.Missing("torch sees no CUDA device")
    except KeyError:
        return "missing", f"unknown method {name!r}"
    except bk.Missing as exc:
        return "missing", str(exc)
    except Exception as exc:   # a broken install: a reason, never a crash
        return "missing", f"{type(exc).__name__}: {exc}"
    return "ok", None


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def make_calls(name, q, k, v) -> dict:
    """{variant: (fn, eager)} for one method on [B, S, H, D] BF16 CUDA tensors; fn() returns [B, S, H, D].
    Variant "complete" always; openvc adds "eager" (the same call timed eagerly), FA3 FP8 adds "kernel" (on
    inputs quantized beforehand)."""
    import torch
    family, kw = METHODS[name][1], dict(METHODS[name][2])
    if family == "openvc":
        import open_vc_attn as ova
        from .modes import qk_format_support
        if qk_format_support(ova) is not None:
            kw = {}   # a build without qk_format: E4M3 is its only format (method_status checked the others)

        def call():
            return _first(ova.attention(q, k, v, **kw))
        return {"complete": (call, False), "eager": (call, True)}
    if family == "sage2":
        from .backends import sage2_function
        sageattn = sage2_function()
        return {"complete": (lambda: _first(sageattn(q, k, v, tensor_layout="NHD", is_causal=False)), True)}
    if family == "fa3-fp8":
        from .backends import fa3_module, quantize_per_head
        fa3 = fa3_module()

        def fp8(qkv):
            (q8, dq), (k8, dk), (v8, dv) = qkv
            return _first(fa3.flash_attn_func(q8, k8, v8, causal=False, q_descale=dq, k_descale=dk, v_descale=dv))
        pre = [quantize_per_head(x) for x in (q, k, v)]
        return {"complete": (lambda: fp8([quantize_per_head(x) for x in (q, k, v)]), False),
                "kernel": (lambda: fp8(pre), False)}
    if family == "cudnn-bf16":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        def sdpa():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
        return {"complete": (sdpa, False)}
    raise ValueError(f"method: unknown {name!r}")


# ---- accuracy -------------------------------------------------------------------------------------------

def exact_attention_fp64(q, k, v, softmax_scale=None):
    """softmax(q k^T * scale) v in float64 on q's device, per head, for [B, S, H, D] tensors (the BF16
    inputs converted exactly); returns float64 [B, Sq, H, D]."""
    import torch
    b_, sq, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    out = torch.empty((b_, sq, h, d), dtype=torch.float64, device=q.device)
    with torch.no_grad():
        for b in range(b_):
            for hh in range(h):
                s = (q[b, :, hh].double() @ k[b, :, hh].double().T) * scale
                s = torch.softmax(s, dim=-1)
                out[b, :, hh] = s @ v[b, :, hh].double()
                del s
    return out


def rel_l2(out, ref) -> float:
    o = out.double()
    return float(((o - ref).norm() / ref.norm().clamp_min(1e-300)).item())


# ---- the run --------------------------------------------------------------------------------------------

def _environment():
    env = {"python": platform.python_version(), "command_line": " ".join(sys.argv)}
    try:
        import torch
        env.update(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        if torch.cuda.is_available():
            env["gpu_name"] = torch.cuda.get_device_name()
    except Exception as exc:
        env["torch"] = f"not importable ({type(exc).__name__})"
    try:
        import open_vc_attn
        env["open_vc_attn"] = getattr(open_vc_attn, "__version__", None)
    except Exception:
        pass
    return env


def measure_errors(methods, seeds, s, h, d, inputs=INPUTS, log=print, device="cuda") -> tuple:
    """({seed: {input: {method: rel L2 | None}}}, {input: description}, {method: first error text})."""
    import torch
    errors, descriptions, failures = {}, {}, {}
    for seed in seeds:
        per_seed = errors.setdefault(str(seed), {})
        for name, (q, k, v, desc) in make_inputs(s, h, d, seed, inputs).items():
            descriptions[name] = desc
            qt, kt, vt = (torch.from_numpy(x).to(device=device, dtype=torch.bfloat16)[None] for x in (q, k, v))
            ref = exact_attention_fp64(qt, kt, vt)
            row = per_seed.setdefault(name, {})
            for m in methods:
                try:
                    fn, _ = make_calls(m, qt, kt, vt)["complete"]
                    row[m] = rel_l2(fn(), ref)
                except Exception as exc:
                    row[m] = None
                    failures.setdefault(m, f"{name}, seed {seed}: {type(exc).__name__}: {exc}"[:400])
            if qt.is_cuda:
                torch.cuda.synchronize()
            log(f"seed {seed} {name:22s} " + "  ".join(
                f"{m}={100 * e:.2f}%" if e is not None else f"{m}=failed" for m, e in row.items()))
            del qt, kt, vt, ref
    return errors, descriptions, failures


def measure_speed(methods, s, h, d, rounds, seed=0, log=print) -> dict:
    """{method: timing}: median ms of the complete call (and openvc's eager, FA3's kernel-only) over
    interleaved rounds at [1, s, h, d] random normal BF16 inputs."""
    import torch
    from . import harness
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = harness.attention_flops(1, h, s, s, d)
    timers, out = {}, {m: {} for m in methods}
    for m in methods:
        try:
            for variant, (fn, eager) in make_calls(m, q, k, v).items():
                timers[(m, variant)] = harness.Timer(fn, use_graph=not eager)
        except Exception as exc:
            out[m]["error"] = f"{type(exc).__name__}: {exc}"[:400]
    samples, _, failed = harness.run_rounds(timers, rounds, seed)
    for (m, variant), t in timers.items():
        med = harness.median(samples[(m, variant)])
        out[m][variant] = {"median_ms": med, "tflops": harness.tflops(flops, med), "method": t.method,
                           "calls_per_replay": t.calls, "samples_ms": samples[(m, variant)]}
        if (m, variant) in failed:
            out[m][variant]["error"] = failed[(m, variant)][:400]
        t.release()
    for m, r in out.items():
        if "complete" in r:
            log(f"speed {m:20s} {r['complete']['median_ms']:8.3f} ms  {r['complete']['tflops']:6.0f} TF"
                + "".join(f"  {v}: {r[v]['median_ms']:.3f} ms" for v in ("eager", "kernel") if v in r))
        elif "error" in r:
            log(f"speed {m:20s} error: {r['error']}")
    del q, k, v
    torch.cuda.empty_cache()
    return out


def summarize(errors: dict) -> dict:
    """{method: {input: mean rel L2 over the seeds that produced one}}."""
    acc = {}
    for per_seed in errors.values():
        for inp, row in per_seed.items():
            for m, e in row.items():
                if e is not None:
                    acc.setdefault(m, {}).setdefault(inp, []).append(e)
    return {m: {inp: sum(v) / len(v) for inp, v in d.items()} for m, d in acc.items()}


def new_record(settings, methods_info, errors, descriptions, speed, environment=None) -> dict:
    return {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment if environment is not None else _environment(), "settings": settings,
            "methods": methods_info, "inputs": descriptions, "errors": errors, "summary": summarize(errors),
            "speed": speed}


def validate_record(rec) -> list:
    """Every schema violation of a qk_tradeoff record as a string (empty: valid)."""
    errs = []
    if not isinstance(rec, dict):
        return ["record: expected a JSON object"]
    if rec.get("schema") != SCHEMA:
        errs.append(f"record.schema: expected {SCHEMA!r}, got {rec.get('schema')!r}")
    for key, typ in (("created", str), ("environment", dict), ("settings", dict), ("methods", dict),
                     ("inputs", dict), ("errors", dict), ("summary", dict), ("speed", dict)):
        if not isinstance(rec.get(key), typ):
            errs.append(f"record.{key}: expected {typ.__name__}")
    for key in ("seqlen", "heads", "head_dim", "seeds", "speed_shape", "rounds", "reference"):
        if key not in (rec.get("settings") or {}):
            errs.append(f"settings: missing key {key!r}")
    for name, info in (rec.get("methods") or {}).items():
        if not isinstance(info, dict) or info.get("status") not in ("ok", "missing", "error"):
            errs.append(f"methods[{name}].status: expected ok, missing or error")
            continue
        if info["status"] != "ok" and not isinstance(info.get("reason"), str):
            errs.append(f"methods[{name}]: status {info['status']} needs a reason")
        if not isinstance(info.get("label"), str):
            errs.append(f"methods[{name}]: missing label")
    for seed, per_seed in (rec.get("errors") or {}).items():
        for inp, row in (per_seed or {}).items():
            if inp not in (rec.get("inputs") or {}):
                errs.append(f"errors[{seed}][{inp}]: input not described under inputs")
            for m, e in (row or {}).items():
                if m not in (rec.get("methods") or {}):
                    errs.append(f"errors[{seed}][{inp}][{m}]: unknown method")
                if e is not None and not isinstance(e, (int, float)):
                    errs.append(f"errors[{seed}][{inp}][{m}]: expected a number or null")
    for m, r in (rec.get("speed") or {}).items():
        for variant, t in (r or {}).items():
            if variant == "error":
                continue
            if not isinstance(t, dict) or not isinstance(t.get("median_ms"), (int, float)):
                errs.append(f"speed[{m}][{variant}]: expected median_ms")
    return errs


# ---- outputs --------------------------------------------------------------------------------------------

def _pct(x):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def _ms(t):
    return "—" if not t or t.get("median_ms") is None or math.isnan(t["median_ms"]) else f"{t['median_ms']:.3f}"


def _tf(t):
    return "—" if not t or t.get("tflops") is None or math.isnan(t["tflops"]) else f"{t['tflops']:.0f}"


def markdown(rec) -> str:
    st = rec["settings"]
    asked = st.get("inputs") or list(rec["inputs"])
    inputs = [i for i in INPUTS if i in asked] + [i for i in asked if i not in INPUTS]
    shape = st.get("speed_shape")
    lines = [f"# Q/K formats: error against speed ({rec['environment'].get('gpu_name', 'GPU ?')}, "
             f"{rec['created']})", "",
             f"Error: rel L2 vs {st['reference']}; S = {st['seqlen']}, H = {st['heads']}, D = {st['head_dim']}, "
             f"mean over seeds {st['seeds']}. Time: median of {st['rounds']} interleaved rounds of the complete "
             "call" + (f" at S = {shape['seqlen']}, H = {shape['heads']}, D = {shape['head_dim']}"
                       if shape else " (not measured: --speed-shape none)") +
             "; graph = CUDA graph of R calls, eager = CUDA events around back-to-back calls.", ""]
    head = ["method"] + inputs + ["mean (issue 25's five)", "ms", "TFLOP/s", "timing", "eager ms", "kernel ms"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missing = []
    for m, info in rec["methods"].items():
        if info["status"] != "ok":
            missing.append(f"- {info['label']} (`{m}`): {info['status']}: {info.get('reason', '')}")
            continue
        errs = rec["summary"].get(m, {})
        five = [errs[i] for i in ISSUE_INPUTS if i in errs]
        sp = rec["speed"].get(m) or {}
        comp = sp.get("complete")
        row = [info["label"]] + [_pct(errs.get(i)) for i in inputs] + \
              [_pct(sum(five) / len(five)) if five else "—", _ms(comp), _tf(comp),
               (comp or {}).get("method", "—").replace("cuda_graph", "graph"), _ms(sp.get("eager")),
               _ms(sp.get("kernel"))]
        lines.append("| " + " | ".join(row) + " |")
    if missing:
        lines += ["", "Unavailable (not measured, nothing substituted):"] + missing
    fails = [f"- `{m}`: {info['failure']}" for m, info in rec["methods"].items() if info.get("failure")]
    if fails:
        lines += ["", "Failures during the run:"] + fails
    lines += ["", "Inputs:"] + [f"- {i}: {rec['inputs'].get(i, '(not measured)')}" for i in inputs]
    return "\n".join(lines) + "\n"


def write_png(rec, path, log=print) -> bool:
    """Error (mean over issue 25's five inputs, and each input) against TFLOP/s of the complete call, one
    colour per method. False (and the message) when matplotlib is missing or nothing was timed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(PNG_SKIP_MESSAGE)
        return False
    pts = []
    for m, info in rec["methods"].items():
        comp = (rec["speed"].get(m) or {}).get("complete")
        errs = rec["summary"].get(m, {})
        if info["status"] != "ok" or not comp or not errs or comp.get("tflops") is None or math.isnan(comp["tflops"]):
            continue
        pts.append((info["label"], comp["tflops"], errs))
    if not pts:
        log("qk_tradeoff: no method has both an error and a time: PNG skipped")
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = {i: mk for i, mk in zip(INPUTS, "os^vDPX")}
    for idx, (label, tf, errs) in enumerate(pts):
        color = f"C{idx}"
        five = [errs[i] for i in ISSUE_INPUTS if i in errs]
        for i, e in errs.items():
            ax.scatter([tf], [100 * e], color=color, marker=markers.get(i, "."), s=18, alpha=0.45)
        if five:
            ax.scatter([tf], [100 * sum(five) / len(five)], color=color, s=110, edgecolor="black", zorder=3,
                       label=label)
    ax.set_yscale("log")
    ax.set_xlabel("TFLOP/s, complete call" + (" (S = {seqlen}, H = {heads}, D = {head_dim})".format(
                                              **rec["settings"]["speed_shape"])
                                              if rec["settings"].get("speed_shape") else ""))
    ax.set_ylabel("rel L2 vs exact FP64 (%)")
    ax.set_title("Q/K formats: error vs speed (large: mean of issue 25's five inputs; small: each input)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


# ---- command line ---------------------------------------------------------------------------------------

def _int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_speed_shape(text):
    """"S,H" or "S,H,D" -> {seqlen, heads, head_dim}; "none" -> None."""
    if text.strip().lower() in ("none", "off", ""):
        return None
    parts = _int_list(text)
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--speed-shape: expected S,H or S,H,D (or none), got {text!r}")
    return {"seqlen": parts[0], "heads": parts[1], "head_dim": parts[2] if len(parts) == 3 else 128}


def _names(text, known, what):
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--{what}: expected names from {', '.join(known)}, got {text!r}")
    return names


def parser():
    p = argparse.ArgumentParser(prog="python -m open_vc_attn.bench.qk_tradeoff", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", type=lambda t: _names(t, tuple(METHODS), "methods"), default=list(METHODS),
                   help="comma list of " + ", ".join(METHODS))
    p.add_argument("--inputs", type=lambda t: [INPUT_KEYS[x] for x in _names(t, tuple(INPUT_KEYS), "inputs")],
                   default=list(INPUTS), help="comma list of " + ", ".join(f"{k} ({v})" for k, v in INPUT_KEYS.items()))
    p.add_argument("--seqlen", type=int, default=4096, help="tokens of the accuracy inputs")
    p.add_argument("--heads", type=int, default=4, help="heads of the accuracy inputs")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of the accuracy inputs")
    p.add_argument("--seeds", type=_int_list, default=[0], help="comma list of seeds: fresh inputs per seed")
    p.add_argument("--speed-shape", type=parse_speed_shape, default=parse_speed_shape("32760,40"),
                   help="S,H[,D] of the timed complete calls, or none")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--out", default="qk_tradeoff.json", help="JSON record")
    p.add_argument("--md", help="markdown table (default: the record's path with .md)")
    p.add_argument("--png", help="plot (default: the record's path with .png)")
    p.add_argument("--no-png", action="store_true", help="write no plot")
    return p


def write_outputs(rec, out, md=None, png=None, no_png=False, log=print):
    base = os.path.splitext(out)[0]
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    md = md or base + ".md"
    with open(md, "w") as f:
        f.write(markdown(rec))
    log(f"wrote {out}, {md}")
    if not no_png:
        png = png or base + ".png"
        if write_png(rec, png, log):
            log(f"wrote {png}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    t0 = time.time()
    methods_info = {}
    for m in args.methods:
        status, why = method_status(m)
        methods_info[m] = {"label": METHODS[m][0], "status": status, "qk": METHODS[m][2]}
        if why:
            methods_info[m]["reason"] = why
        print(f"{m:20s} {status}" + (f": {why}" if why else ""), flush=True)
    ok = [m for m in args.methods if methods_info[m]["status"] == "ok"]
    settings = {"seqlen": args.seqlen, "heads": args.heads, "head_dim": args.head_dim, "seeds": args.seeds,
                "inputs": args.inputs, "speed_shape": args.speed_shape, "rounds": args.rounds,
                "reference": "exact attention in float64 on the GPU from the BF16 inputs"}
    errors, descriptions, failures, speed = {}, {}, {}, {}
    if ok:
        errors, descriptions, failures = measure_errors(ok, args.seeds, args.seqlen, args.heads, args.head_dim,
                                                        args.inputs)
        if args.speed_shape:
            sh = args.speed_shape
            speed = measure_speed(ok, sh["seqlen"], sh["heads"], sh["head_dim"], args.rounds)
    for m, msg in failures.items():
        methods_info[m]["failure"] = msg
    for m, r in speed.items():
        if "error" in r and not methods_info[m].get("failure"):
            methods_info[m]["failure"] = f"speed shape: {r['error']}"
    rec = new_record(settings, methods_info, errors, descriptions, speed)
    rec["wall_s"] = round(time.time() - t0, 1)
    write_outputs(rec, args.out, args.md, args.png, args.no_png)
    print(markdown(rec))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
