"""The extension and torch load in either order (issue 27): on the H200, loading libopenvc before torch
once made torch's own import segfault. libopenvc now exports its API only (src/openvc.map; the C++ test
LibraryExports.OpenvcApiOnly checks the symbol table), so nothing of its static CUDA runtime or its
CUB/libcu++ instances can bind to torch's copies. Each order runs in a fresh interpreter, and on a GPU
machine both libraries then launch work on the device."""
import subprocess
import sys

import pytest

_EXT_FIRST = """
import open_vc_attn._openvc_ext as ext   # the extension module itself, loaded before torch
import torch
print("ok", ext.KERNEL_HEAD_DIM, torch.__version__)
"""
_TORCH_FIRST = """
import torch
import open_vc_attn._openvc_ext as ext
print("ok", ext.KERNEL_HEAD_DIM, torch.__version__)
"""
_GPU_WORK = """
import open_vc_attn
x = torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16)
out = open_vc_attn.attention(x, x, x)
ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (x, x, x))).transpose(1, 2)
torch.cuda.synchronize()
err = float((out.float() - ref.float()).norm() / ref.float().norm())
assert err < 0.05, err
print("gpu ok", err)
"""


def _run(code):
    pytest.importorskip("torch")
    try:
        import open_vc_attn._openvc_ext  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"extension not built: {exc}")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.parametrize("code", [_EXT_FIRST, _TORCH_FIRST], ids=["extension-first", "torch-first"])
def test_imports_in_either_order(code):
    assert "ok" in _run(code)


@pytest.mark.gpu
@pytest.mark.parametrize("code", [_EXT_FIRST, _TORCH_FIRST], ids=["extension-first", "torch-first"])
def test_gpu_work_in_either_order(code):
    assert "gpu ok" in _run(code + _GPU_WORK)
