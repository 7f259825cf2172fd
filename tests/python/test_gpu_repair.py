"""V residual repair on the GPU (open_vc_attn.repair: prepare_v_repair / attention_v_repair and the
open_vc_attn::prepare_v_repair, build_v_repair, attention_fp8_repair custom ops).

Tests marked `gpu` need torch and a compute capability 9.0 device (conftest.py skips them otherwise); the
argument checks run on CPU with torch alone. On an H200: python3 -m pytest -q -rs tests/python/test_gpu_repair.py
"""
import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

import open_vc_attn
from open_vc_attn import reference as ref
from open_vc_attn import repair
from helpers import cpu_qkv, to_cuda, video_qkv

PACKED_KEY_ORDER = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]   # openvc::kPackedKeyOrder


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def unpack_rows(packed):
    """[B, H, D, Rpad] packed repair V -> [B, H, Rpad, D] rows (inverse of the kPackedKeyOrder permutation)."""
    cols = np.arange(packed.shape[-1])
    rows = (cols // 16) * 16 + np.asarray(PACKED_KEY_ORDER)[cols % 16]
    out = np.zeros_like(packed)
    out[..., rows] = packed
    return out.transpose(0, 1, 3, 2)


# ---- no GPU needed ----------------------------------------------------------------------------------

def test_import_does_not_import_torch():
    code = ("import sys, open_vc_attn.repair as r; f = (r.prepare_v_repair, r.attention_v_repair); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


@pytest.mark.parametrize("budget,s,rows", [(0.005, 73397, 367), (0.5, 1, 1), (0.25, 2, 1), (0.25, 6, 2),
                                           (0.0, 5, 0), (0.004, 100, 0), (0.999, 10, 10), (0.1, 4096, 410)])
def test_repair_rows_round_half_away_from_zero(budget, s, rows):
    assert repair.repair_rows(budget, s) == rows
    assert rows == int(ref.select_v_repair(np.zeros((s, 1, 8), np.float32), budget)["tokens_per_head"])


def test_extension_repair_bindings():
    """gpu_repair.cc (registered by module.cc): C++ row count equals repair_rows, Status -> ValueError."""
    from open_vc_attn import _ext
    ext = _ext.load()
    assert hasattr(ext, "prepare_v_repair"), "module.cc must call register_repair(m) (bindings/gpu_repair.cc)"
    rng = np.random.default_rng(0)
    for _ in range(2000):
        s = int(rng.integers(1, 200_000))
        b = float(rng.random()) if rng.random() < 0.5 else (int(rng.integers(0, 2 * s)) + 1) / (2 * s)
        if b < 1:
            assert ext.repair_row_count(b, s) == repair.repair_rows(b, s), (b, s)
    with pytest.raises(ValueError, match="^budget must be finite"):
        ext.repair_row_count(float("nan"), 10)
    p = ext.RepairPrepareParams()
    p.batch, p.seqlen_k, p.heads, p.budget = 1, 100, 2, 2.0
    assert p.selection == ext.RepairSelection.energy and p.head_dim == 128
    with pytest.raises(ValueError, match=r"params\.budget"):
        ext.prepare_v_repair(p, 0)
    p.budget = 0.5
    with pytest.raises(ValueError, match=r"params\.v\.data is null"):
        ext.prepare_v_repair(p, 0)
    assert not hasattr(ext.RepairInputs(), "tokens")   # attention never reads RepairInputs::tokens
    assert ext.repair_workspace_bytes(1, 2, 100, 500) > 0   # given tokens past Sk: block maxima only


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(budget=-0.01), ValueError, r"^budget: expected a finite float in \[0, 1\)"),
    (dict(budget=1.0), ValueError, "^budget"),
    (dict(budget=float("nan")), ValueError, "^budget"),
    (dict(budget=float("inf")), ValueError, "^budget"),
    (dict(budget="0.1"), TypeError, "^budget"),
    (dict(budget=True), TypeError, "^budget"),
    (dict(selection="random"), ValueError, "^selection: expected one of"),
    (dict(sample_rows=0), ValueError, "^sample_rows"),
])
def test_errors_scalars(torch, kwargs, exc, msg):
    q, k, v = cpu_qkv(torch)   # scalars are checked before the tensors
    with pytest.raises(exc, match=msg):
        repair.prepare_v_repair(q, k, v, **kwargs)


def test_errors_tensors(torch):
    bf = torch.bfloat16
    with pytest.raises(TypeError, match="^q: expected a torch.Tensor"):
        repair.prepare_v_repair(np.zeros((1, 8, 2, 128)), *cpu_qkv(torch)[1:])
    with pytest.raises(ValueError, match="^q: head_dim 64 is not supported: prepare_v_repair takes 128"):
        repair.prepare_v_repair(*cpu_qkv(torch, (1, 8, 2, 64)))
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):
        repair.prepare_v_repair(*cpu_qkv(torch))
    x = torch.zeros(1, 8, 2, 128, dtype=bf, device="meta")
    with pytest.raises(TypeError, match="^prepared: expected None or a PreparedFP8"):
        repair.prepare_v_repair(x, x, x, prepared=object())


def test_errors_packed_sequences_are_rejected(torch):
    m = dict(device="meta")
    p = open_vc_attn.PreparedFP8(
        torch.empty(8, 2, 128, dtype=torch.uint8, **m), torch.empty(1, 2, 1, **m),
        torch.empty(8, 2, 128, dtype=torch.uint8, **m), torch.empty(1, 2, 1, **m),
        torch.empty(1, 2, 128, 128, dtype=torch.uint8, **m), torch.empty(1, 2, **m), batch=1, seqlen_q=8, seqlen_k=8,
        heads=2, head_dim=128, input_rank=3, dtype=torch.bfloat16, cu_seqlens_q=torch.zeros(2, dtype=torch.int32),
        cu_seqlens_k=torch.zeros(2, dtype=torch.int32))
    x = torch.zeros(8, 2, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"^prepared: packed variable-length sequences \(cu_seqlens\) are not "
                                         "supported by prepare_v_repair"):
        repair.prepare_v_repair(x, x, x, prepared=p)


def test_errors_attention_v_repair(torch):
    with pytest.raises(TypeError, match="^prepared: expected a PreparedRepair"):
        repair.attention_v_repair(object())
    with pytest.raises(ValueError, match="^mid_window_blocks"):
        repair.attention_v_repair(object(), mid_window_blocks=-2)


def test_fake_implementations_give_output_shapes(torch):
    """The ops' fake kernels (torch.compile's view of them) on meta tensors: shapes and dtypes only."""
    from open_vc_attn import ops
    m = dict(device="meta")
    b, s, h, d, nk = 2, 1000, 3, 128, 8
    v = torch.empty(b, s, h, d, dtype=torch.bfloat16, **m)
    fp8 = (torch.empty(b, s, h, d, dtype=torch.uint8, **m), torch.empty(b, h, nk, **m),
           torch.empty(b, h, d, nk * 128, dtype=torch.uint8, **m), torch.empty(b, h, **m))
    tokens, rk, rkd, rv = ops.prepare_v_repair_op(v, *fp8, 0.05)
    assert (tokens.shape, rk.shape, rkd.shape, rv.shape) == ((b, h, 50), (b, h, 128, d), (b, h, 128), (b, h, d, 128))
    assert (tokens.dtype, rk.dtype, rkd.dtype, rv.dtype) == (torch.int32, torch.uint8, torch.float32, torch.uint8)
    rk, rkd, rv = ops.build_v_repair_op(v, *fp8, torch.empty(b, h, 129, dtype=torch.int32, **m))
    assert (rk.shape, rkd.shape, rv.shape) == ((b, h, 256, d), (b, h, 256), (b, h, d, 256))
    with pytest.raises(ValueError, match="^v_packed: expected a contiguous torch.uint8 tensor of shape"):
        ops.prepare_v_repair_op(v, *fp8[:2], fp8[2][..., :1000], fp8[3], 0.05)


# ---- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,budget", [(1, 2000, 2, 0.05), (2, 1000, 3, 0.005), (1, 9000, 1, 0.02)])
def test_energy_rows_equal_reference(torch, b, s, h, budget):
    q, k, v = video_qkv(b, s, h, seed=s)
    qt, kt, vt = to_cuda(torch, (q, k, v))
    pr = repair.prepare_v_repair(qt, kt, vt, budget)
    rows = repair.repair_rows(budget, s)
    assert pr.rows == rows and pr.selection == "energy"
    want = ref.select_v_repair(v, budget)
    np.testing.assert_array_equal(pr.tokens.cpu().numpy().reshape(-1), want["tokens"])
    rv = unpack_rows(pr.v_packed.cpu().numpy())
    np.testing.assert_array_equal(rv[:, :, :rows].reshape(-1, 128), want["codes"])
    tok = pr.tokens.cpu().numpy().astype(np.int64)
    kc, kd = pr.prepared.k_codes.cpu().numpy(), pr.prepared.k_descale.cpu().numpy()
    for bi in range(b):
        for hi in range(h):
            np.testing.assert_array_equal(pr.k_codes[bi, hi, :rows].cpu().numpy(), kc[bi, tok[bi, hi], hi])
            np.testing.assert_array_equal(pr.k_descale[bi, hi, :rows].cpu().numpy(), kd[bi, hi, tok[bi, hi] // 128])
    assert not rv[:, :, rows:].any() and not pr.k_codes[:, :, rows:].any() and not pr.k_descale[:, :, rows:].any()


@pytest.mark.gpu
def test_attention_matches_reference_and_lowers_error(torch):
    q, k, v = video_qkv(1, 2000, 2, seed=3)
    budget = 0.05
    pr = repair.prepare_v_repair(*to_cuda(torch, (q, k, v)), budget)
    out, lse = repair.attention_v_repair(pr, return_lse=True)
    want, want_lse = ref.attention(q, k, v, repair_budget=budget, return_lse=True)
    plain, _ = ref.attention(q, k, v, return_lse=True)
    exact = ref.attention_exact(q, k, v)
    got = out.float().cpu().numpy()
    assert rel_l2(got, want) <= 5e-3
    assert np.abs(lse.cpu().numpy() - want_lse).max() <= 0.03
    assert rel_l2(want, exact) < rel_l2(plain, exact)
    assert rel_l2(got, exact) < rel_l2(plain, exact) + 1e-4


@pytest.mark.gpu
def test_zero_rows_is_the_plain_path(torch):
    qt, kt, vt = to_cuda(torch, video_qkv(1, 300, 2, seed=4))
    pr = repair.prepare_v_repair(qt, kt, vt, 0.001)   # 0.3 rows -> 0
    assert pr.rows == 0 and pr.tokens.shape == (1, 2, 0) and pr.v_packed.shape == (1, 2, 128, 0)
    plain = open_vc_attn.attention_fp8(pr.prepared)
    assert torch.equal(repair.attention_v_repair(pr), plain)


@pytest.mark.gpu
def test_zero_residual_changes_nothing(torch):
    """Integer V with amax 448: every value is an exact E4M3 code, every residual 0: the repaired output is
    the plain output, bit for bit."""
    q, k, _ = video_qkv(1, 1000, 2, seed=5)
    v = np.random.default_rng(0).integers(-8, 9, size=q.shape).astype(np.float32)
    v[0, 3, :, 7] = 448.0
    qt, kt, vt = to_cuda(torch, (q, k, v))
    pr = repair.prepare_v_repair(qt, kt, vt, 0.1)
    assert pr.rows == 100 and not pr.v_packed.any()
    np.testing.assert_array_equal(pr.tokens[0, 0].cpu().numpy(), np.arange(100))   # all ties: lowest tokens
    assert torch.equal(repair.attention_v_repair(pr), open_vc_attn.attention_fp8(pr.prepared))


@pytest.mark.gpu
def test_attention_selection(torch):
    q, k, v = video_qkv(1, 3000, 2, seed=6)
    qt, kt, vt = to_cuda(torch, (q, k, v))
    prepared = open_vc_attn.prepare_fp8(qt, kt, vt)
    pr = repair.prepare_v_repair(qt, kt, vt, 0.02, selection="attention", prepared=prepared)
    tok = pr.tokens.cpu().numpy()
    assert tok.shape == (1, 2, 60) and pr.prepared is prepared
    assert all(len(set(t.tolist())) == 60 for t in tok[0]) and tok.min() >= 0 and tok.max() < 3000
    exact = ref.attention_exact(q, k, v)
    plain = open_vc_attn.attention_fp8(prepared).float().cpu().numpy()
    got = repair.attention_v_repair(pr).float().cpu().numpy()
    assert rel_l2(got, exact) < rel_l2(plain, exact)


@pytest.mark.gpu
def test_rank3_and_prepared_reuse(torch):
    qt, kt, vt = to_cuda(torch, video_qkv(1, 700, 2, seed=7))
    pr4 = repair.prepare_v_repair(qt, kt, vt, 0.05)
    pr3 = repair.prepare_v_repair(qt[0], kt[0], vt[0], 0.05)
    assert torch.equal(pr3.tokens, pr4.tokens)
    out3, lse3 = repair.attention_v_repair(pr3, return_lse=True)
    out4, lse4 = repair.attention_v_repair(pr4, return_lse=True)
    assert out3.shape == (700, 2, 128) and lse3.shape == (2, 700)
    assert torch.equal(out3, out4[0]) and torch.equal(lse3, lse4[0])
    with pytest.raises(ValueError, match="^prepared: expected a preparation of k and v with B=1 Sk=699"):
        repair.prepare_v_repair(qt[:, :699], kt[:, :699], vt[:, :699], prepared=pr4.prepared)


@pytest.mark.gpu
def test_ops_opcheck_and_cuda_graph(torch):
    qt, kt, vt = to_cuda(torch, video_qkv(1, 1000, 2, seed=8))
    prepared = open_vc_attn.prepare_fp8(qt, kt, vt)
    pr = repair.prepare_v_repair(qt, kt, vt, 0.05, prepared=prepared)
    fp8 = (prepared.k_codes, prepared.k_descale, prepared.v_packed, prepared.v_descale)
    ops = torch.ops.open_vc_attn
    torch.library.opcheck(ops.prepare_v_repair.default, (vt, *fp8, 0.05))
    torch.library.opcheck(ops.build_v_repair.default, (vt, *fp8, pr.tokens))
    torch.library.opcheck(ops.attention_fp8_repair.default, (*prepared.tensors(), *pr.tensors(), 0.0, 4, True))
    # No host synchronization: the preparation captures into a CUDA graph and replays to the same rows.
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = ops.prepare_v_repair.default(vt, *fp8, 0.05)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, (pr.tokens, pr.k_codes, pr.k_descale, pr.v_packed)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_torch_compile_fullgraph(torch):
    qt, kt, vt = to_cuda(torch, video_qkv(1, 500, 2, seed=9))

    def f(q, k, v):
        return repair.attention_v_repair(repair.prepare_v_repair(q, k, v, 0.05))

    eager = f(qt, kt, vt)
    compiled = torch.compile(f, fullgraph=True)(qt, kt, vt)
    assert torch.equal(eager, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["repair", "vc", "attention"])
def test_torch_compile_fullgraph_as_the_first_call(first):
    """A fresh process whose first openvc call is a compiled one (issue 16 item 4): every op is registered
    at import of open_vc_attn.ops, so the trace never runs a registration. Compared with eager after."""
    calls = {"repair": "r.attention_v_repair(r.prepare_v_repair(q, k, v, 0.05))",
             "vc": "b.vc_attention(q, k, v)", "attention": "p.attention(q, k, v, causal=True)"}
    code = ("import torch, open_vc_attn as p, open_vc_attn.repair as r, open_vc_attn.baselines as b\n"
            "g = torch.Generator(device='cuda').manual_seed(0)\n"
            "q, k, v = (torch.randn(1, 500, 2, 128, device='cuda', generator=g).bfloat16() for _ in range(3))\n"
            f"f = lambda q, k, v: {calls[first]}\n"
            "compiled = torch.compile(f, fullgraph=True)(q, k, v)\n"
            "assert torch.equal(compiled, f(q, k, v))\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip().endswith("ok")


def test_prepared_repair_is_frozen(torch):
    pr = repair.PreparedRepair(None, 0.0, "energy", 0, None, None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pr.rows = 3
    assert math.isclose(pr.budget, 0.0)
