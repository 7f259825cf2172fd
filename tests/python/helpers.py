"""Input builders shared by the Python tests (imported as `helpers`: pytest puts this folder on sys.path).
The `torch` fixture is in conftest.py."""
import numpy as np

from open_vc_attn import video_inputs


def video_qkv(b, s, h, dtype="bfloat16", seed=0, d=128, sinks=True):
    """Synthetic video-like numpy q, k, v [B, S, H, D] (float32 holding bf16 values, or float16), with sink
    keys (unless sinks=False) and V outliers; fewer than 16 tokens get neither (too few for them)."""
    small = s < 16
    p = video_inputs.generate(frames=max(1, -(-s // 128)), height=8, width=16, seqlen=s, batch=b, heads=h,
                              head_dim=d, seed=seed, dtype=dtype, num_sink_tokens=0 if small or not sinks else 4,
                              v_outlier_fraction=0.0 if small else 0.001)
    return p.q, p.k, p.v


def to_cuda(torch, arrays, dtype="bfloat16", device="cuda"):
    """numpy arrays -> torch tensors of `dtype` on `device` (exact: the values already are bf16 / fp16)."""
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to(device, tdt) for x in arrays)


def torch_qkv(torch, b, s, h, dtype="bfloat16", seed=0, device="cuda"):
    """video_qkv as torch tensors on `device`."""
    return to_cuda(torch, video_qkv(b, s, h, dtype, seed), dtype, device)


def cpu_qkv(torch, shape=(1, 8, 2, 128), dtype=None, **over):
    """Zero CPU q, k, v of `shape` (bfloat16 unless dtype), any of them replaced by keyword (q=..., k=...):
    for the argument checks, which run before the device check."""
    dtype = dtype or torch.bfloat16
    t = {n: torch.zeros(shape, dtype=dtype) for n in "qkv"}
    t.update(over)
    return t["q"], t["k"], t["v"]
