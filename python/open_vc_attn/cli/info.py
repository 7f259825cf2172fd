"""What this machine can run, for ``open-vc-attn-check`` (its smoke check and ``--info``).

Every probe returns a reason with the fix instead of raising, so the check prints one line where a
piece is missing. torch is imported only inside :func:`gpu_unavailable_reason` and :func:`collect`.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

BUILD_FIX = "run `pip install .` in the openvc repository (needs the CUDA toolkit 12.8 or newer)"
TORCH_FIX = "pip install torch (a CUDA build, 2.4 or newer), or pip install 'open-vc-attn[torch]'"
HOPPER = "an NVIDIA Hopper GPU (H100/H200, compute capability 9.0)"
# Installed versions a bug report states when present (frameworks the integrations hook into).
OPTIONAL_PACKAGES = ("diffusers", "sglang", "yunchang", "xfuser", "flash-attn", "flash-attn-3", "triton")


def _first_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def extension_problem():
    """None when the compiled extension loads, else why not and how to build it (one line)."""
    from .. import _ext
    try:
        _ext.load()
    except ImportError as exc:
        cause = exc.__cause__ or exc
        return f"the compiled extension is not loadable ({_first_line(cause)}): {BUILD_FIX}"
    return None


def gpu_unavailable_reason():
    """None when the GPU functions can run here, else why not and what the GPU path needs (one line)."""
    problem = extension_problem()
    if problem:
        return problem
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"torch is not importable ({_first_line(exc)}); the GPU path needs torch with CUDA: {TORCH_FIX}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; the GPU path needs a CUDA build: {TORCH_FIX}"
    try:
        if not torch.cuda.is_available():
            return f"torch sees no CUDA device; the GPU path needs {HOPPER}"
        cap = torch.cuda.get_device_capability()
    except Exception as exc:
        return f"CUDA query failed ({_first_line(exc)}); the GPU path needs {HOPPER}"
    if tuple(cap) != (9, 0):
        return f"device compute capability {cap[0]}.{cap[1]}; the kernels (sm_90a) need {HOPPER}"
    return None


def _nvidia_smi():
    """[{name, driver, compute_capability, memory_mib}] per GPU from nvidia-smi; None without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,compute_cap,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    gpus = []
    for line in out.stdout.strip().splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) == 4:
            gpus.append(dict(zip(("name", "driver", "compute_capability", "memory_mib"), vals)))
    return gpus


def _nvcc_version():
    exe = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(exe):
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if "release" in line:
            return line.split("release", 1)[1].split(",")[0].strip()
    return None


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_facts():
    try:
        import torch
    except Exception as exc:
        return {"version": None, "error": _first_line(exc)}
    facts = {"version": torch.__version__, "cuda": torch.version.cuda, "devices": []}
    try:
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            p = torch.cuda.get_device_properties(i)
            facts["devices"].append({"name": p.name, "compute_capability": f"{p.major}.{p.minor}",
                                     "memory_mib": p.total_memory // 2**20})
    except Exception as exc:
        facts["error"] = _first_line(exc)
    return facts


def collect() -> dict:
    """The facts a bug report needs, as a JSON-ready dict."""
    import numpy as np

    import open_vc_attn
    ext_problem = extension_problem()
    gpu_reason = gpu_unavailable_reason()
    return {
        "open_vc_attn": open_vc_attn.__version__,
        "package_dir": os.path.dirname(os.path.abspath(open_vc_attn.__file__)),
        "extension": {"loadable": ext_problem is None, "problem": ext_problem},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "numpy": np.__version__,
        "torch": _torch_facts(),
        "nvidia_smi": _nvidia_smi(),
        "nvcc": _nvcc_version(),
        "packages": {n: v for n in OPTIONAL_PACKAGES if (v := _dist_version(n)) is not None},
        "paths": {"cpu reference": ext_problem, "gpu kernels": gpu_reason},
    }


def format_info(facts: dict) -> list:
    """The lines ``open-vc-attn-check --info`` prints."""
    t = facts["torch"]
    smi = facts["nvidia_smi"]
    lines = [f"open_vc_attn {facts['open_vc_attn']} ({facts['package_dir']})",
             "extension: " + ("loaded" if facts["extension"]["loadable"] else facts["extension"]["problem"]),
             f"python {facts['python']['version']} ({facts['python']['executable']}), {facts['platform']}",
             f"numpy {facts['numpy']}"]
    if t["version"] is None:
        lines.append(f"torch: not importable ({t['error']})")
    else:
        lines.append(f"torch {t['version']}, CUDA build {t['cuda'] or 'none (CPU-only)'}, "
                     f"{len(t['devices'])} CUDA device(s) visible"
                     + (f" ({t['error']})" if t.get("error") else ""))
    for i, d in enumerate(t.get("devices", [])):
        lines.append(f"  cuda:{i} {d['name']}, compute capability {d['compute_capability']}, {d['memory_mib']} MiB")
    if smi is None:
        lines.append("nvidia-smi: not available (no NVIDIA driver here)")
    else:
        gpus = ", ".join(f"{g['name']} (capability {g['compute_capability']})" for g in smi)
        lines.append(f"NVIDIA driver {smi[0]['driver'] if smi else '?'}: {gpus or 'no GPU'}")
    lines.append(f"nvcc (CUDA toolkit on PATH): {facts['nvcc'] or 'not found'}")
    if facts["packages"]:
        lines.append("related packages: " + ", ".join(f"{n} {v}" for n, v in facts["packages"].items()))
    lines.append("paths this machine can run:")
    names = {"cpu reference": "CPU reference (open_vc_attn.reference)",
             "gpu kernels": "GPU kernels (attention, prepare_fp8, repair, baselines, integrations)"}
    for key, why in facts["paths"].items():
        if why is not None and why == facts["extension"]["problem"]:
            why = "the compiled extension is not loadable (above)"
        lines.append(f"  {names[key]}: " + ("yes" if why is None else f"no: {why}"))
    return lines
