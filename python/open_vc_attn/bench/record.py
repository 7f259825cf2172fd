"""The JSON record of one benchmark run: schema, validation, environment capture, GPU-sharing check.

A record (``SCHEMA`` = "open-vc-attn-bench/1") is a JSON object:

    schema, created (ISO 8601 UTC), status ("partial" while cases remain or when one failed or was
    skipped, "complete"), gpu_shared (bool), warnings [str], wall_s,
    environment: {gpu_name, gpu_uuid, compute_capability, sm_count, l2_bytes, driver, cuda, cudnn,
                  torch, python, numpy, open_vc_attn, packages {dist: version|None},
                  sm_clock_mhz_before, sm_clock_mhz_after, sm_clock_max_mhz, git_commit, git_dirty,
                  command_line, hostname}
    settings:    {preset, inputs [path], rounds, seed, target_replay_ms, max_calls, cold_l2, scopes,
                  backends [requested], repair_budgets, mid_window_blocks, gen_heads, allow_shared,
                  accuracy (bool)}
    backends:    {name: {status: "ok"|"missing"|"error", kind: "ours"|"baseline"|"anchor", label,
                         reason?: str}}
    ceilings:    {gemm_fp8|gemm_bf16: {status, shape, flops, samples_ms, median_ms, tflops, method},
                  copy: {status, bytes, samples_ms, median_ms, gbps (read + write bytes / time)}}
    cases: [{name, batch, seqlen_q, seqlen_k, heads, head_dim, dtype, causal, flops, softmax_scale,
             source {kind: "generator"|"file", ...}, cold_l2 {requested, applied, note},
             sm_clock_mhz_after_case, wall_s, visiting_orders [[id]], accuracy_reference {exact, bf16 (id)},
             results: [{id ("backend:scope", "@budget" for repair), backend, scope, kind, status,
                        params {}, note?, error?|reason?, traceback?,
                        timing? {method: "cuda_graph"|"eager", capture_error?, calls_per_replay,
                                 cold_reps, call_ms_estimate, samples_ms [one per round], median_ms,
                                 min_ms, tflops},
                        ratios? {anchor_id: {median, per_round [t_anchor / t_this]}},
                        accuracy? {vs_exact_fp32: METRICS, vs_sdpa_bf16: METRICS|None}}]}]

METRICS = {rel_l2, rmse, max_abs, cosine} (numerics.md section 8). Times are milliseconds per call.
A ratio above 1 means this entry is faster than the anchor (paired within each round).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys

SCHEMA = "open-vc-attn-bench/1"
STATUSES = ("ok", "missing", "error")
SCOPES = ("attention", "complete")
METRIC_KEYS = ("rel_l2", "rmse", "max_abs", "cosine")
# Distributions whose versions a record states (None when not installed).
PACKAGES = ("torch", "numpy", "open-vc-attn", "flash-attn", "flash-attn-3", "flash_attn_3",
            "flash-attn-4", "flash-attn-cute", "nvidia-cudnn-frontend", "nvidia-cudnn-cu13",
            "nvidia-cudnn-cu12", "triton", "matplotlib", "sageattention")


# ---- validation -----------------------------------------------------------------------------------------

def _need(obj, key, types, where, errors):
    if not isinstance(obj, dict) or key not in obj:
        errors.append(f"{where}: missing key {key!r}")
        return None
    val = obj[key]
    if types is not None and not isinstance(val, types):
        errors.append(f"{where}.{key}: expected {types}, got {type(val).__name__}")
        return None
    return val


_NUM = (int, float)


def _metrics_errors(m, where, errors):
    if m is None:
        return
    if not isinstance(m, dict):
        errors.append(f"{where}: expected a metrics object or null")
        return
    for key in METRIC_KEYS:
        _need(m, key, _NUM, where, errors)


def validate_record(rec) -> list:
    """Every schema violation of ``rec`` as a readable string (empty list: valid). Checks structure and
    types, and that sample counts agree with the median (hand-written: no jsonschema dependency)."""
    errors = []
    if not isinstance(rec, dict):
        return ["record: expected a JSON object"]
    if rec.get("schema") != SCHEMA:
        errors.append(f"record.schema: expected {SCHEMA!r}, got {rec.get('schema')!r}")
    _need(rec, "created", str, "record", errors)
    status = _need(rec, "status", str, "record", errors)
    if status is not None and status not in ("partial", "complete"):
        errors.append(f"record.status: unknown value {status!r}")
    _need(rec, "gpu_shared", bool, "record", errors)
    _need(rec, "warnings", list, "record", errors)
    env = _need(rec, "environment", dict, "record", errors) or {}
    for key in ("gpu_name", "driver", "torch", "git_commit", "command_line", "sm_clock_mhz_before",
                "sm_clock_mhz_after", "packages"):
        if key not in env:
            errors.append(f"environment: missing key {key!r}")
    settings = _need(rec, "settings", dict, "record", errors) or {}
    for key in ("rounds", "seed", "scopes", "cold_l2"):
        if key not in settings:
            errors.append(f"settings: missing key {key!r}")
    backends = _need(rec, "backends", dict, "record", errors) or {}
    for name, info in backends.items():
        st = _need(info, "status", str, f"backends[{name}]", errors)
        if st is not None and st not in STATUSES:
            errors.append(f"backends[{name}].status: unknown value {st!r}")
        if st in ("missing", "error"):
            _need(info, "reason", str, f"backends[{name}]", errors)
    _need(rec, "ceilings", dict, "record", errors)
    cases = _need(rec, "cases", list, "record", errors) or []
    for i, case in enumerate(cases):
        where = f"cases[{i}]"
        for key, types in (("name", str), ("batch", int), ("seqlen_q", int), ("seqlen_k", int),
                           ("heads", int), ("head_dim", int), ("flops", _NUM), ("source", dict),
                           ("cold_l2", dict), ("results", list)):
            _need(case, key, types, where, errors)
        for j, res in enumerate(case.get("results", []) if isinstance(case, dict) else []):
            rw = f"{where}.results[{j}]"
            for key in ("id", "backend", "scope", "status"):
                _need(res, key, str, rw, errors)
            if res.get("scope") not in SCOPES:
                errors.append(f"{rw}.scope: expected one of {SCOPES}, got {res.get('scope')!r}")
            if res.get("status") not in STATUSES:
                errors.append(f"{rw}.status: expected one of {STATUSES}, got {res.get('status')!r}")
            if res.get("status") != "ok":
                if not isinstance(res.get("error") or res.get("reason"), str):
                    errors.append(f"{rw}: a result that is not ok needs an 'error' or 'reason' string")
                continue
            timing = _need(res, "timing", dict, rw, errors) or {}
            samples = _need(timing, "samples_ms", list, f"{rw}.timing", errors) or []
            med = _need(timing, "median_ms", _NUM, f"{rw}.timing", errors)
            _need(timing, "tflops", _NUM, f"{rw}.timing", errors)
            method = _need(timing, "method", str, f"{rw}.timing", errors)
            if method is not None and method not in ("cuda_graph", "eager"):
                errors.append(f"{rw}.timing.method: unknown value {method!r}")
            if samples and med is not None and not min(samples) <= med <= max(samples):
                errors.append(f"{rw}.timing.median_ms: {med} lies outside its samples")
            for aid, ratio in (_need(res, "ratios", dict, rw, errors) or {}).items():
                _need(ratio, "median", _NUM, f"{rw}.ratios[{aid}]", errors)
                _need(ratio, "per_round", list, f"{rw}.ratios[{aid}]", errors)
            acc = res.get("accuracy")
            if acc is not None:
                _metrics_errors(acc.get("vs_exact_fp32"), f"{rw}.accuracy.vs_exact_fp32", errors)
                _metrics_errors(acc.get("vs_sdpa_bf16"), f"{rw}.accuracy.vs_sdpa_bf16", errors)
    return errors


def new_record(settings: dict, environment: dict) -> dict:
    return {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "status": "partial", "gpu_shared": False, "warnings": [], "environment": environment,
            "settings": settings, "backends": {}, "ceilings": {}, "cases": []}


def write_record(rec: dict, path: str) -> None:
    """Writes atomically (temp file + rename), so a run killed mid-write leaves the previous version."""
    tmp = f"{path}.tmp{os.getpid()}"
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)


def load_record(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# ---- environment ----------------------------------------------------------------------------------------

def _run(cmd, cwd=None, timeout=20):
    """stdout of cmd, or None when it is missing or fails (the record then says null, not a guess)."""
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _num(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def target_gpu_index() -> str:
    """nvidia-smi's id of the GPU that cuda:0 maps to (first entry of CUDA_VISIBLE_DEVICES, else 0)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def gpu_query(index=None) -> dict:
    """Name, uuid, driver and clocks of one GPU from nvidia-smi ({} when nvidia-smi is unavailable)."""
    fields = ("name", "uuid", "driver_version", "clocks.sm", "clocks.max.sm", "temperature.gpu",
              "power.draw")
    out = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                "-i", index or target_gpu_index()])
    if not out:
        return {}
    vals = [v.strip() for v in out.splitlines()[0].split(",")]
    if len(vals) != len(fields):
        return {}
    d = dict(zip(fields, vals))
    return {"name": d["name"], "uuid": d["uuid"], "driver": d["driver_version"],
            "sm_clock_mhz": _num(d["clocks.sm"]), "sm_clock_max_mhz": _num(d["clocks.max.sm"]),
            "temperature_c": _num(d["temperature.gpu"]), "power_w": _num(d["power.draw"])}


def gpu_processes(gpu_uuid=None) -> list:
    """Compute processes on the GPU (all GPUs when gpu_uuid is None) as dicts, this one included when
    listed; None when nvidia-smi cannot tell."""
    out = _run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                "--format=csv,noheader,nounits"])
    if out is None:
        return None
    procs = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit() or (gpu_uuid and parts[3] != gpu_uuid):
            continue
        procs.append({"pid": int(parts[0]), "name": parts[1], "used_memory_mib": _num(parts[2]),
                      "gpu_uuid": parts[3]})
    return procs


def other_gpu_processes(procs, self_on_gpu: bool) -> list:
    """The processes of `procs` that are not this one. In a container nvidia-smi shows host PIDs, so
    when this process uses the GPU but its PID is not listed, one entry is taken to be this one: the GPU
    counts as shared only if there are more (and then all are returned, as they cannot be told apart)."""
    if procs is None:
        return None
    mine = [p for p in procs if p["pid"] == os.getpid()]
    if mine or not self_on_gpu:
        return [p for p in procs if p["pid"] != os.getpid()]
    return procs if len(procs) > 1 else []


def git_info(paths=()) -> tuple:
    """(commit, dirty) of the first git work tree among paths (cwd first); (None, None) when none."""
    for path in (os.getcwd(), *paths):
        commit = _run(["git", "-C", path, "rev-parse", "HEAD"])
        if commit:
            status = _run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"])
            return commit, (None if status is None else bool(status))
    return None, None


def package_versions(names=PACKAGES) -> dict:
    from importlib import metadata
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return {k: v for k, v in out.items() if v is not None or k in ("torch", "open-vc-attn")}


def environment(git_commit=None, argv=None) -> dict:
    """What a record states about where it ran. torch facts are filled in by :func:`add_torch_facts`
    once torch is imported (kept apart so this part works without torch)."""
    import numpy as np
    import open_vc_attn
    gpu = gpu_query()
    commit, dirty = git_info([os.path.dirname(os.path.abspath(open_vc_attn.__file__))])
    if git_commit:
        commit, dirty = git_commit, None
    argv = sys.argv if argv is None else argv
    return {"gpu_name": gpu.get("name"), "gpu_uuid": gpu.get("uuid"), "driver": gpu.get("driver"),
            "compute_capability": None, "sm_count": None, "l2_bytes": None, "cuda": None, "cudnn": None,
            "torch": None, "python": platform.python_version(), "numpy": np.__version__,
            "open_vc_attn": getattr(open_vc_attn, "__version__", None), "packages": package_versions(),
            "sm_clock_mhz_before": gpu.get("sm_clock_mhz"), "sm_clock_mhz_after": None,
            "sm_clock_max_mhz": gpu.get("sm_clock_max_mhz"), "temperature_c_before": gpu.get("temperature_c"),
            "git_commit": commit, "git_dirty": dirty,
            "command_line": " ".join(shlex.quote(a) for a in argv), "hostname": socket.gethostname()}


def add_torch_facts(env: dict, torch, device) -> None:
    props = torch.cuda.get_device_properties(device)
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda
    env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env["compute_capability"] = f"{props.major}.{props.minor}"
    env["sm_count"] = props.multi_processor_count
    env["l2_bytes"] = getattr(props, "L2_cache_size", None)
    env["gpu_name"] = env.get("gpu_name") or props.name
    env["gpu_memory_bytes"] = props.total_memory
