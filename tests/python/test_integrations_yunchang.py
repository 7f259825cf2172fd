"""yunchang / xDiT attn_processor (open_vc_attn.integrations.yunchang).

- Without torch: the torch-free import check runs; the rest skips.
- With torch (CPU): the processor's routing, outputs and LSE layout, openvc's fast path replaced by exact
  attention (the device check bypassed), against float64 arithmetic written out here.
- With yunchang (CPU, pure Python): the hook check against the real select_flash_attn_impl, the version
  check, fallbacks, and yunchang's real LongContextAttention over two CPU processes (gloo): Ulysses
  (degree 2) and ring (degree 2) against single-process attention of the whole sequence, with calls routed
  to openvc (the stand-in) and to the exact fallback. This file, run as a script, is those workers.
- Marked `gpu`: the processor against open_vc_attn.attention (bit for bit, LSE too).
"""
import json
import math
import pathlib
import subprocess
import sys

import pytest

from two_process import finish_rank, free_port, route_counts

HERE = pathlib.Path(__file__).resolve()


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ovy(torch):
    from open_vc_attn.integrations import yunchang as ovy
    return ovy


@pytest.fixture
def exact_fast_path(ovy, monkeypatch):
    """openvc's fast path replaced by exact attention with LSE; CPU tensors let through the device check."""
    from open_vc_attn.integrations import _exact, policy
    calls = []

    def fast(q, k, v, scale, causal=False, qk_format="e4m3", k_smoothing=False, p_format="expcast",
             v_bias_correction=False):
        calls.append(tuple(q.shape) + (("causal",) if causal else ()))
        out, lse = _exact.attention_with_lse(q, k, v, scale=scale, causal=causal, causal_from_end=True)
        return out.to(q.dtype), lse

    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    monkeypatch.setattr(ovy, "_fast_attention", fast)
    return calls


def rand(torch, *shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def reference(torch, q, k, v, scale, causal=False):
    """float64 softmax attention; causal aligned to the last query (flash-attn). out [B,S,H,D], lse [B,H,S]."""
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(1, 2), torch.logsumexp(s, -1)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---- no torch needed -------------------------------------------------------------------------------------

def test_import_needs_neither_torch_nor_yunchang():
    code = ("import sys; import open_vc_attn.integrations.yunchang as y; assert callable(y.OpenVCAttnProcessor); "
            "assert 'torch' not in sys.modules and 'yunchang' not in sys.modules, sorted(sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if "No module named 'open_vc_attn.integrations" in res.stderr:
        pytest.skip("open_vc_attn.integrations is not installed: reinstall the package")
    assert res.returncode == 0, res.stderr


# ---- the processor (torch, CPU) ---------------------------------------------------------------------------

def test_processor_routes_and_lse(torch, ovy, exact_fast_path):
    from open_vc_attn.integrations import policy
    proc = ovy.OpenVCAttnProcessor(policy=policy.DispatchPolicy(min_query_tokens=128, min_key_tokens=128))
    q, k, v = (rand(torch, 1, 256, 2, 128, seed=s) for s in range(3))
    ovy.reset_stats()
    out, lse = proc(q, k, v, dropout_p=0.0, softmax_scale=0.05, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, return_softmax=False)
    ref_out, ref_lse = reference(torch, q, k, v, 0.05)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (1, 2, 256) and lse.dtype == torch.float32
    assert rel(out, ref_out) < 1e-2 and torch.allclose(lse.double(), ref_lse, atol=1e-4)
    assert exact_fast_path == [(1, 256, 2, 128)]
    # calls the fast path does not take: causal (flash-attn's alignment), few keys, windows
    out_c, lse_c = proc(q[:, :200], k, v, softmax_scale=0.05, causal=True)
    ref_c, ref_lse_c = reference(torch, q[:, :200], k, v, 0.05, causal=True)
    assert rel(out_c, ref_c) < 1e-2 and torch.allclose(lse_c.double(), ref_lse_c, atol=1e-4)
    out_s, _ = proc(q, k[:, :64], v[:, :64], softmax_scale=None)
    assert rel(out_s, reference(torch, q, k[:, :64], v[:, :64], 1 / math.sqrt(128))[0]) < 1e-2
    with pytest.raises(NotImplementedError, match="window_size"):
        proc(q, k, v, window_size=(64, 64))
    assert exact_fast_path == [(1, 256, 2, 128)]     # none of those reached openvc
    causal = "causal with Sq != Sk (the framework's causal mask is top-left aligned)"
    assert ovy.stats() == {("openvc", ""): 1, ("fallback", causal): 1, ("fallback", "few keys (64 < 128)"): 1,
                           ("fallback", "window_size"): 1}


def test_processor_causal_self_attention_is_causal_on_openvc(torch, ovy, exact_fast_path):
    """Causal self-attention (Sq == Sk) goes to openvc's path, and causal reaches it (it once did not: the
    call was computed without the mask)."""
    from open_vc_attn.integrations import policy
    proc = ovy.OpenVCAttnProcessor(policy=policy.DispatchPolicy(min_query_tokens=128, min_key_tokens=128))
    q, k, v = (rand(torch, 1, 256, 2, 128, seed=s) for s in range(3))
    out, lse = proc(q, k, v, softmax_scale=0.05, causal=True)
    ref_out, ref_lse = reference(torch, q, k, v, 0.05, causal=True)
    assert exact_fast_path == [(1, 256, 2, 128, "causal")]
    assert rel(out, ref_out) < 1e-2 and torch.allclose(lse.double(), ref_lse, atol=1e-4)


def test_processor_passes_the_policy_format(torch, ovy, monkeypatch):
    from open_vc_attn.integrations import policy
    seen = []

    def fast(q, k, v, scale, causal=False, **fmt):
        seen.append(fmt)
        return q.clone(), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    monkeypatch.setattr(ovy, "_fast_attention", fast)
    q = rand(torch, 1, 256, 2, 128)
    ovy.reset_stats()
    pol = policy.DispatchPolicy(min_query_tokens=128, min_key_tokens=128, qk_format="int8")
    ovy.OpenVCAttnProcessor(policy=pol)(q, q, q, softmax_scale=0.1)
    # K smoothing too: attention() returns the LSE of the keys as given, which the ring merges by
    smooth = policy.DispatchPolicy(min_query_tokens=128, min_key_tokens=128, qk_format="int8", k_smoothing=True)
    ovy.OpenVCAttnProcessor(policy=smooth)(q, q, q, softmax_scale=0.1)
    exp2 = policy.DispatchPolicy(min_query_tokens=128, min_key_tokens=128, qk_format="int8", p_format="exp2")
    ovy.OpenVCAttnProcessor(policy=exp2)(q, q, q, softmax_scale=0.1)
    best = policy.DispatchPolicy(min_query_tokens=128, min_key_tokens=128, qk_format="int8", k_smoothing=True,
                                 p_format="exp2", v_bias_correction=True)
    ovy.OpenVCAttnProcessor(policy=best)(q, q, q, softmax_scale=0.1, causal=True)
    assert seen == [{"qk_format": "int8", "k_smoothing": False, "p_format": "expcast", "v_bias_correction": False},
                    {"qk_format": "int8", "k_smoothing": True, "p_format": "expcast", "v_bias_correction": False},
                    {"qk_format": "int8", "k_smoothing": False, "p_format": "exp2", "v_bias_correction": False},
                    {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2", "v_bias_correction": True}]
    assert ovy.stats() == {("openvc", "qk_format=int8"): 1, ("openvc", "qk_format=int8, k_smoothing"): 1,
                           ("openvc", "qk_format=int8, p_format=exp2"): 1,
                           ("openvc", "qk_format=int8, k_smoothing, p_format=exp2, v_bias_correction"): 1}


def test_processor_fallback_callable_and_errors(torch, ovy):
    seen = []

    def mine(q, k, v, **kwargs):
        seen.append(sorted(kwargs))
        return q, torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    proc = ovy.OpenVCAttnProcessor(fallback=mine)
    q = rand(torch, 1, 16, 2, 64)
    out, _ = proc(q, q, q, softmax_scale=0.1)     # CPU: never the fast path
    assert out is q and seen == [["alibi_slopes", "causal", "dropout_p", "return_softmax", "softcap",
                                  "softmax_scale", "window_size"]]
    with pytest.raises(TypeError, match="^policy"):
        ovy.OpenVCAttnProcessor(policy={"min_query_tokens": 1})


# ---- the real yunchang --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def yunchang(ovy):
    return pytest.importorskip("yunchang", reason="yunchang is not installed")


def test_pinned_version(yunchang, ovy):
    pins = (HERE.parents[2] / "requirements" / "test.txt").read_text().split()
    assert f"yunchang=={ovy.TESTED_VERSION}" in pins
    assert yunchang.__version__ == ovy.TESTED_VERSION, "the tests run against the tested yunchang"


def test_hook_selection(yunchang, ovy):
    from yunchang.kernels import AttnType
    proc = ovy.check_hook()
    assert isinstance(proc, ovy.OpenVCAttnProcessor)
    assert yunchang.kernels.select_flash_attn_impl(ovy.ATTN_TYPE, stage="fwd-only", attn_processor=proc) is proc
    with pytest.raises(RuntimeError, match="not the processor"):
        ovy.check_hook(proc, attn_type=AttnType.FA)   # a yunchang type selects yunchang's own kernel


def test_version_check(yunchang, ovy, monkeypatch):
    monkeypatch.setattr(yunchang, "__version__", "0.7.1")
    monkeypatch.delenv("OPENVC_YUNCHANG_UNTESTED", raising=False)
    with pytest.raises(RuntimeError, match=r"yunchang 0\.7\.1.*OPENVC_YUNCHANG_UNTESTED=1"):
        ovy.check_hook()
    monkeypatch.setenv("OPENVC_YUNCHANG_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="untested"):
        ovy.check_hook()


def test_yunchang_fallbacks(yunchang, ovy):
    from yunchang.kernels import AttnType
    with pytest.raises(ValueError, match="^fallback.*zero LSE"):
        ovy.OpenVCAttnProcessor(fallback=AttnType.TORCH_MATH)
    with pytest.raises(TypeError, match="^fallback"):
        ovy.OpenVCAttnProcessor(fallback="fa")
    proc = ovy.OpenVCAttnProcessor(fallback=AttnType.TORCH_EFFICIENT)
    assert proc.fallback.keywords == {"op_type": "efficient"}      # yunchang's own forward function
    with pytest.raises(ValueError, match="^ring_impl_type"):
        ovy.long_context_attention(ring_impl_type="zigzag")


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)], ids=["ulysses2", "ring2"])
@pytest.mark.parametrize("route", ["openvc", "fallback"])
def test_long_context_attention_two_processes(yunchang, tmp_path, ulysses, ring, route):
    out = tmp_path / "result.json"
    res = subprocess.run([sys.executable, str(HERE), str(ulysses), str(ring), route, str(free_port()), str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    result = json.loads(out.read_text())
    for rank in result["ranks"]:
        assert rank["rel_l2"] < 1e-2, rank           # BF16 output of exact attention vs float64
        # every ring step of every layer call went where the policy sends it
        expected = ({"openvc": ring} if route == "openvc"
                    else {f"fallback: short query ({rank['sq']} < 100000 tokens)": ring})
        assert rank["routes"] == expected, rank


# ---- GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_processor_matches_openvc(torch, ovy):
    import open_vc_attn
    g = torch.Generator(device="cuda").manual_seed(0)
    from open_vc_attn.integrations import policy
    q, k, v = (torch.randn(1, 4096, 6, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    proc = ovy.OpenVCAttnProcessor(policy=policy.DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024))
    ovy.reset_stats()
    out, lse = proc(q, k, v, softmax_scale=0.08)
    ref_out, ref_lse = open_vc_attn.attention(q, k, v, softmax_scale=0.08, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and lse.shape == (1, 6, 4096)
    out16, _ = proc(q.half(), k.half(), v.half(), softmax_scale=0.08)
    assert out16.dtype == torch.float16
    assert ovy.stats() == {("openvc", ""): 2}
    # the default policy keeps a call below its thresholds on the exact fallback (short query)
    n = policy.DEFAULT_POLICY.min_query_tokens // 2
    short = [x[:, :n] for x in (q, k, v)]
    default_out, _ = ovy.OpenVCAttnProcessor()(*short, softmax_scale=0.08)
    (path, why), = [key for key in ovy.stats() if key[0] == "fallback"]
    assert why == f"short query ({n} < {policy.DEFAULT_POLICY.min_query_tokens} tokens)"
    short_ref = open_vc_attn.attention(*short, softmax_scale=0.08)
    assert float((default_out.double() - short_ref.double()).norm() / default_out.double().norm()) < 0.08


# ---- the two-process workers (this file run as a script) ----------------------------------------------------

def _worker(rank, world, ulysses, ring, route, port, out_path):
    import os

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from yunchang import set_seq_parallel_pg

    from open_vc_attn.integrations import _exact, policy
    from open_vc_attn.integrations import yunchang as ovy
    policy._device_reason = lambda device: None           # CPU tensors through the device check
    ovy._fast_attention = lambda q, k, v, scale, causal=False, **fmt: _exact.attention_with_lse(
        q, k, v, scale=scale, causal=causal, causal_from_end=True)
    set_seq_parallel_pg(ulysses, ring, rank, world)
    small = policy.DispatchPolicy(min_query_tokens=1, min_key_tokens=1)
    never = policy.DispatchPolicy(min_query_tokens=100000, min_key_tokens=1)
    layer = ovy.long_context_attention(policy=small if route == "openvc" else never)
    g = torch.Generator().manual_seed(0)
    s, h, d = 256, 4, 128
    q, k, v = (torch.randn(1, s, h, d, generator=g).to(torch.bfloat16) for _ in range(3))
    shard = slice(rank * s // world, (rank + 1) * s // world)      # yunchang's basic layout: contiguous shards
    out = layer(q[:, shard].contiguous(), k[:, shard].contiguous(), v[:, shard].contiguous(), softmax_scale=0.06)
    ref, _ = reference(torch, q, k, v, 0.06)
    routes = route_counts(ovy.stats())
    result = {"rank": rank, "rel_l2": rel(out, ref[:, shard]), "routes": routes,
              "sq": s // ring}    # the query tokens of one local call: the Ulysses-gathered or ring-local shard
    finish_rank(dist, rank, world, result, out_path)


if __name__ == "__main__":
    import torch.multiprocessing as mp
    u, r, route_, port_, out_ = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    mp.spawn(_worker, args=(u * r, u, r, route_, port_, out_), nprocs=u * r)
