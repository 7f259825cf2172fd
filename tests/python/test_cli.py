"""open-vc-attn-check: the CPU smoke run end to end, its JSON, its failure exit code, --info, the one-line
message without the compiled extension, and the GPU probe."""
import glob
import json
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

import open_vc_attn
from open_vc_attn.cli import check, info

ATTENTION_ROWS = ("expcast mid-window (w=4)", "expcast natural order", "expcast w=4 + repair 0.5%")
SOURCE_TREE = os.path.join(os.path.dirname(__file__), "..", "..", "python")


def gpu_usable():
    """Independent of open_vc_attn's probe: torch with a CUDA device of compute capability 9.0."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) == (9, 0)


def test_smoke_main_passes_and_writes_json(tmp_path, capsys):
    path = tmp_path / "smoke.json"
    assert check.main(["--smoke", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out
    assert "paths this machine can run" not in out          # --smoke alone: no --info section
    report = json.loads(path.read_text())
    assert report["passed"] is True and report["problem"]["heads"] == 2 and report["problem"]["head_dim"] == 128
    assert 1000 <= report["problem"]["seqlen"] <= 2000
    for row in ATTENTION_ROWS:
        m = report["results"][row]
        assert 0 < m["rel_l2"] < report["threshold"] and m["cosine"] > 0.99
        assert row in out
    assert report["gpu"]["ran"] is gpu_usable()
    if not gpu_usable():
        reason = report["gpu"]["skipped_reason"]
        assert reason and f"GPU path skipped: {reason}\n" in out
        assert "\n" not in reason and ("pip install" in reason or "Hopper" in reason)   # says how to get it


def test_threshold_failure_exits_1(capsys):
    assert check.main(["--smoke", "--threshold", "1e-6"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_console_script_subprocess():
    exe = shutil.which("open-vc-attn-check")
    cmd = [exe, "--smoke"] if exe else [sys.executable, "-m", "open_vc_attn.cli.check", "--smoke"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("GPU path ran" if gpu_usable() else "GPU path skipped: ") in res.stdout


def test_info_states_versions_and_paths(tmp_path, capsys):
    path = tmp_path / "info.json"
    assert check.main(["--info", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    facts = json.loads(path.read_text())["info"]
    assert out.startswith(f"open_vc_attn {open_vc_attn.__version__} (")
    assert facts["python"]["version"] == platform.python_version() and facts["numpy"] == np.__version__
    assert facts["extension"] == {"loadable": True, "problem": None}
    assert "  CPU reference (open_vc_attn.reference): yes\n" in out
    gpu_line = [line for line in out.splitlines() if line.startswith("  GPU kernels")]
    assert len(gpu_line) == 1 and gpu_line[0].endswith(": yes") is gpu_usable()
    try:
        import torch
    except ImportError:
        assert facts["torch"]["version"] is None and "torch: not importable" in out
    else:
        assert facts["torch"]["version"] == torch.__version__ and facts["torch"]["cuda"] == torch.version.cuda
        assert f"torch {torch.__version__}, " in out
    assert "expcast" not in out                               # --info alone: no smoke check


def test_no_option_runs_info_and_smoke(capsys):
    assert check.main([]) == 0
    out = capsys.readouterr().out
    assert "paths this machine can run" in out and "PASS" in out


def test_gpu_reason_without_torch_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)          # makes `import torch` raise ImportError
    reason = info.gpu_unavailable_reason()
    assert reason.startswith("torch is not importable (") and "pip install torch" in reason and "\n" not in reason


def test_missing_extension_is_one_line_without_traceback(tmp_path):
    """The source tree has no compiled files: importing the package from it is an install without the
    extension. The check must say so in one line with the fix, and exit 2."""
    if glob.glob(os.path.join(SOURCE_TREE, "open_vc_attn", "_openvc_ext*")):
        pytest.skip("the source tree holds a compiled extension (in-place build)")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(SOURCE_TREE))
    for argv in (["--smoke"], []):
        res = subprocess.run([sys.executable, "-m", "open_vc_attn.cli.check", *argv], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=120)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "Traceback" not in res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "compiled extension" in lines[0] and "pip install ." in lines[0], res.stderr
    assert res.stdout.splitlines()[0].startswith(f"open_vc_attn {open_vc_attn.__version__} (")   # the --info part


@pytest.mark.gpu
def test_gpu_probe_on_hopper():
    """On an sm_90 machine with torch and the extension, nothing stops the GPU branch."""
    assert info.gpu_unavailable_reason() is None
