"""Grouped-query attention (GQA / MQA: k and v with Hk heads, a divisor of q's H) without a GPU: the argument
rules of every function (divisibility, the call forms that take equal head counts only, the general path),
each a ValueError naming the argument before anything runs; the custom ops' fake implementations (K/V outputs
of prepare_fp8 with Hk heads, attention outputs of q's shape) under FakeTensorMode; the CPU reference and the
BF16 baseline against K/V heads repeated; Ulysses over simulated ranks; the integrations' auto format. The GPU
side (bit equality with repeated heads, graph capture, torch.compile) is test_gpu_gqa.py."""
import math

import numpy as np
import pytest

import open_vc_attn
from open_vc_attn import reference as ref

BIG = 1 << 20   # Sq = Sk = 2^20: ceil(Sq/128) * ceil(Sk/128) * 128 = 2^33, past the fast path's range


@pytest.fixture(scope="module")
def fake(torch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    import open_vc_attn.ops  # noqa: F401  (registers the ops)
    return FakeTensorMode


def zeros(torch, *shape, dtype=None, device="cpu"):
    return torch.zeros(shape, dtype=dtype or torch.bfloat16, device=device)


def qkv(torch, h=8, hk=2, s=256, d=128, device="cpu", sk=None):
    return (zeros(torch, 1, s, h, d, device=device), zeros(torch, 1, sk or s, hk, d, device=device),
            zeros(torch, 1, sk or s, hk, d, device=device))


# ---- argument rules --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["attention", "prepare_fp8"])
def test_heads_must_divide(torch, fn):
    f = getattr(open_vc_attn, fn)
    for h, hk in ((8, 3), (6, 4), (2, 4)):
        with pytest.raises(ValueError, match=rf"^k: expected {h} heads like q, or a divisor of {h} \(GQA/MQA"):
            f(*qkv(torch, h, hk))
    for h, hk in ((8, 2), (6, 1), (4, 4)):   # valid: only the device is left
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor, got device cpu"):
            f(*qkv(torch, h, hk))
    with pytest.raises(ValueError, match="^v: expected the shape of k"):   # v keeps k's head count
        f(*qkv(torch, 8, 2)[:2], zeros(torch, 1, 256, 8, 128))
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
    q, k, v = (x[0] for x in qkv(torch, 8, 3))
    with pytest.raises(ValueError, match=r"^k: expected 8 heads like q, or a divisor of 8"):
        f(q, k, v, **packed) if fn == "attention" else f(q, k, v, cu, cu, 156, 156)


def test_reference_version_checks_heads_too(torch):
    for version, mode in (("open-vc", "expcast"), ("reference", "bf16")):
        with pytest.raises(ValueError, match=r"^k: expected 8 heads like q, or a divisor of 8"):
            open_vc_attn.attention(*qkv(torch, 8, 3), version=version, mode=mode)
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):
            open_vc_attn.attention(*qkv(torch, 8, 2), version=version, mode=mode)


def test_grouped_calls_past_the_fast_path_name_k(torch, fake):
    """The general path takes equal head counts only: a grouped call past the fast path's range raises
    ValueError naming k (attention), k_codes (the attention_fp8 op) or prepared.k_codes, before anything runs."""
    msg = r"^k: GQA/MQA \(2 K/V heads for 8 query heads\) runs on the sm_90a fast path only.*32-bit range"
    with pytest.raises(ValueError, match=msg):   # api.attention, before any kernel (meta tensors: no memory)
        open_vc_attn.attention(*qkv(torch, 8, 2, BIG, device="meta"))
    ops = torch.ops.open_vc_attn
    with fake():
        q, k, v = qkv(torch, 8, 2, BIG, device="cuda")
        with pytest.raises(ValueError, match=msg):   # the padding mask's gather does not run first
            open_vc_attn.attention(q, k, v, key_padding_mask=torch.ones(1, BIG, dtype=torch.bool, device="cuda"))
        with pytest.raises(ValueError, match=msg):
            ops.attention(q, k, v, None, None, 0, 0, None, 0.0, False, 4, True)
        with pytest.raises(ValueError, match=msg):   # prepare_fp8: a preparation attention_fp8 could not attend
            ops.prepare_fp8(q, k, v, None, None, 0, 0, None)
        with pytest.raises(ValueError, match=msg):
            ops.attention(q[0], k[0], v[0], *[torch.tensor([0, BIG], dtype=torch.int32, device="cuda")] * 2,
                          BIG, BIG, None, 0.0, False, 4, False)
        q, k, v = qkv(torch, 8, 2, 1000, device="cuda")
        tensors = ops.prepare_fp8(q, k, v, None, None, 0, 0, None)
        with pytest.raises(ValueError, match=r"^k_codes: GQA/MQA \(2 K/V heads for 8 query heads\).*"
                                             r"path='general' asks for it"):
            ops.attention_fp8(*tensors, None, None, 0, 0, 0.0, False, 4, False, path="general")
        blocks = torch.ones(1, 8, 8, dtype=torch.float32, device="cuda")   # V descales per key block
        out, _ = ops.attention_fp8(*tensors[:5], blocks[:, :2], None, None, 0, 0, 0.0, False, 4, False)   # [B, Hk, nk]
        assert out.shape == q.shape
        with pytest.raises(ValueError, match=r"^v_descale: expected shape \(1, 2, 8\)"):   # Hk heads, not H
            ops.attention_fp8(*tensors[:5], blocks, None, None, 0, 0, 0.0, False, 4, False)
    with fake():   # attention_fp8 on a PreparedFP8 past the range (quantized elsewhere: from_quantized)
        from open_vc_attn import _layout
        big = [torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
               for _, shape, dtype in _layout.fp8_expectations(1, BIG, BIG, 8, 128, hk=2)]
        p = open_vc_attn.PreparedFP8.from_quantized(*big)
        assert (p.heads, p.kv_heads, p.seqlen_k) == (8, 2, BIG)
        with pytest.raises(ValueError, match=msg.replace("^k:", r"^prepared\.k_codes:")):
            open_vc_attn.attention_fp8(p)


def test_from_quantized_heads(torch, fake):
    with fake():
        q, k, v = qkv(torch, 6, 3, 300, device="cuda")
        p = open_vc_attn.prepare_fp8(q, k, v)
        assert (p.heads, p.kv_heads) == (6, 3)
        w = open_vc_attn.PreparedFP8.from_quantized(*p.tensors())
        assert (w.heads, w.kv_heads) == (6, 3) and w.k_codes.shape == (1, 300, 3, 128)
        w3 = open_vc_attn.PreparedFP8.from_quantized(*(x[0] for x in p.tensors()), input_rank=3)
        assert (w3.heads, w3.kv_heads, w3.input_rank) == (6, 3, 3)
        t = dict(zip(("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale"), p.tensors()))
        bad = dict(t, k_codes=torch.empty(1, 300, 4, 128, dtype=torch.uint8, device="cuda"))
        with pytest.raises(ValueError, match=r"^k_codes: expected 6 heads like q_codes, or a divisor of 6"):
            open_vc_attn.PreparedFP8.from_quantized(**bad)
        bad = dict(t, v_descale=torch.empty(1, 6, device="cuda"))
        with pytest.raises(ValueError, match=r"^v_descale: expected shape \(1, 3\) = \[B, Hk\] for B=1 Sq=300 "
                                             r"Sk=300 H=6 Hk=3 D=128"):
            open_vc_attn.PreparedFP8.from_quantized(**bad)


def test_equal_head_functions_name_the_argument(torch):
    """V residual repair and the VC baseline take equal head counts only; the FP8 KV cache takes its kv_heads."""
    from open_vc_attn import baselines, kv_cache, repair
    q, k, v = qkv(torch, 8, 2)
    with pytest.raises(ValueError, match=r"^k: expected 8 heads like q, got shape \(1, 256, 2, 128\): "
                                         r"prepare_v_repair does not take GQA/MQA.*repeat_interleave"):
        repair.prepare_v_repair(q, k, v)
    for fn in (baselines.prepare_vc, baselines.vc_attention):
        with pytest.raises(ValueError, match="^k: expected 8 heads like q, .*prepare_vc does not take GQA/MQA"):
            fn(q, k, v)
    meta = lambda *shape, dtype=torch.uint8: torch.empty(shape, dtype=dtype, device="meta")   # noqa: E731
    f32 = torch.float32
    prep = open_vc_attn.PreparedFP8(meta(1, 256, 8, 128), meta(1, 8, 2, dtype=f32), meta(1, 256, 2, 128),
                                    meta(1, 2, 2, dtype=f32), meta(1, 2, 128, 256), meta(1, 2, dtype=f32), batch=1,
                                    seqlen_q=256, seqlen_k=256, heads=8, head_dim=128, input_rank=4,
                                    dtype=torch.bfloat16)
    assert prep.kv_heads == 2
    pr = repair.PreparedRepair(prep, 0.01, "energy", 3, *[meta(1)] * 4)
    with pytest.raises(ValueError, match=r"^prepared\.k_codes: expected 8 heads like prepared\.q_codes, .*V residual "
                                         "repair does not take GQA/MQA"):
        repair.attention_v_repair(pr)
    cache = object.__new__(kv_cache.FP8KVCache)   # the argument rules of a cache of 8 heads (no CUDA buffers)
    cache.batch, cache.heads, cache.kv_heads, cache.head_dim, cache.device = 1, 8, 8, 128, torch.device("cpu")
    for name in ("k", "v"):
        with pytest.raises(ValueError, match=rf"^{name}: expected shape \[B=1, n, H=8, D=128\] \(the cache's\), got "
                                             r"\(1, 256, 2, 128\)"):
            cache._check_tokens(name, k, "n")
    cache._check_tokens("q", q, "Sq")   # q of the cache's heads passes
    cache.kv_heads = 2                   # a grouped cache: k and v of its K/V heads, q of its query heads
    for name in ("k", "v"):
        cache._check_tokens(name, k, "n")
    with pytest.raises(ValueError, match=r"^k: expected shape \[B=1, n, Hk=2, D=128\]"):
        cache._check_tokens("k", q, "n")
    with pytest.raises(ValueError, match=r"^q: expected shape \[B=1, Sq, H=8, D=128\]"):
        cache._check_tokens("q", k, "Sq")


# ---- fake implementations: shapes under torch.compile / FakeTensorMode ---------------------------------------------

@pytest.mark.parametrize("h, hk", [(8, 2), (6, 1)])
@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
def test_fake_shapes(torch, fake, h, hk, fmt):
    ops = torch.ops.open_vc_attn
    with fake():
        q, k, v = qkv(torch, h, hk, 300, device="cuda", sk=700)
        t = ops.prepare_fp8(q, k, v, None, None, 0, 0, None, fmt, True)
        kd = (1, hk, 6, 8) if fmt == "int8" else (1, hk, 6)
        qd = (1, h, 300) if fmt == "int8" else (1, h, 3)
        assert [tuple(x.shape) for x in t] == [(1, 300, h, 128), qd, (1, 700, hk, 128), kd, (1, hk, 128, 768),
                                               (1, hk)]
        out, lse = ops.attention_fp8(*t, None, None, 0, 0, 0.0, True, 4, True, qk_format=fmt)
        assert out.shape == q.shape and lse.shape == (1, h, 300)
        out, lse = ops.attention(q, k, v, None, None, 0, 0, None, 0.0, True, 4, True, None, fmt, True)
        assert out.shape == q.shape and lse.shape == (1, h, 300)
        p = open_vc_attn.prepare_fp8(q[0], k[0], v[0], qk_format=fmt)   # rank 3 through the API
        assert (p.heads, p.kv_heads) == (h, hk) and p.v_packed.shape == (1, hk, 128, 768)
        out, lse = open_vc_attn.attention_fp8(p, return_lse=True)
        assert out.shape == (300, h, 128) and lse.shape == (h, 300)
        # packed sequences: K/V [total_k, Hk, D]
        fq, fk = zeros(torch, 1000, h, 128, device="cuda"), zeros(torch, 900, hk, 128, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        t = ops.prepare_fp8(fq, fk, fk, cu, cu, 700, 600, None, fmt, False)
        kd = (3, hk, 5, 8) if fmt == "int8" else (3, hk, 5)
        assert [tuple(x.shape) for x in t][2:] == [(900, hk, 128), kd, (3, hk, 128, 640), (3, hk)]
        out, lse = ops.attention_fp8(*t, cu, cu, 700, 600, 0.0, True, 4, True, qk_format=fmt)
        assert out.shape == (1000, h, 128) and lse.shape == (h, 1000)
        out, lse = ops.attention(fq, fk, fk, cu, cu, 700, 600, None, 0.0, False, 4, True, None, fmt)
        assert out.shape == (1000, h, 128) and lse.shape == (h, 1000)
        out = open_vc_attn.attention(fq, fk, fk, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700,
                                     max_seqlen_k=600, qk_format=fmt)
        assert out.shape == (1000, h, 128)


# ---- the references: K/V heads repeated ----------------------------------------------------------------------------

@pytest.mark.parametrize("h, hk", [(4, 2), (3, 1)])
def test_cpu_reference_is_repeated_heads(h, hk):
    rng = np.random.default_rng(h * 10 + hk)
    q = ref.to_bfloat16_values(rng.standard_normal((2, 200, h, 64)))
    k, v = (ref.to_bfloat16_values(rng.standard_normal((2, 300, hk, 64))) for _ in range(2))
    kr, vr = (np.repeat(x, h // hk, axis=-2) for x in (k, v))
    for kw in ({}, {"causal": True}, {"mid_window_blocks": None, "repair_budget": 0.01}):
        out, lse = ref.attention(q, k, v, return_lse=True, **kw)
        want, want_lse = ref.attention(q, kr, vr, return_lse=True, **kw)
        assert np.array_equal(out, want) and np.array_equal(lse, want_lse), kw
    out = ref.attention_exact(q, k, v, causal=True)
    assert np.array_equal(out, ref.attention_exact(q, kr, vr, causal=True))
    # an independent check of the head mapping: query head i attends K/V head i // (H // Hk)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kr.astype(np.float64)) / 8.0
    p = np.exp(s - s.max(-1, keepdims=True))
    exact = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vr)
    assert np.abs(ref.attention_exact(q, k, v) - exact).max() < 1e-10
    cu = [0, 120, 200]
    out = ref.attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=[0, 100, 300])
    assert np.array_equal(out, ref.attention(q[0], kr[0], vr[0], cu_seqlens_q=cu, cu_seqlens_k=[0, 100, 300]))
    with pytest.raises(ValueError, match=rf"^k: expected {h} heads like q, or a divisor"):
        ref.attention(q, k[:, :, :1].repeat(h + 1, axis=2), v[:, :, :1].repeat(h + 1, axis=2))
    with pytest.raises(ValueError, match=r"^k: .*the VC baseline \(attention_vc\) does not take GQA/MQA"):
        ref.attention_vc(q, k, v)


def test_bf16_baseline_is_repeated_heads(torch):
    """The BF16 reference (attention(..., version="reference")) behind its checks: torch SDPA on K/V heads
    repeated, with key counts, a key mask, causal and the LSE; packed sequences too."""
    from open_vc_attn import _sdpa
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 100, 6, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 150, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    kr, vr = (x.repeat_interleave(3, dim=2) for x in (k, v))
    keep = torch.rand(2, 150, generator=g) < 0.7
    counts = torch.tensor([150, 77], dtype=torch.int32)
    for kw in (dict(causal=False), dict(causal=True), dict(causal=True, counts=counts), dict(causal=False, keep=keep)):
        causal = kw.pop("causal")
        got = _sdpa.attention_bf16(q, k, v, 0.0, causal, True, 4, **kw)
        want = _sdpa.attention_bf16(q, kr, vr, 0.0, causal, True, 4, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cq, ck = torch.tensor([0, 40, 100], dtype=torch.int32), torch.tensor([0, 150, 150], dtype=torch.int32)
    got = _sdpa.attention_bf16_varlen(q[0], k[0], v[0], cq, ck, 0.0, True, True)
    want = _sdpa.attention_bf16_varlen(q[0], kr[0], vr[0], cq, ck, 0.0, True, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- Ulysses: K/V heads split across ranks with their query heads ---------------------------------------------------

def test_ulysses_rules(torch, monkeypatch):
    from open_vc_attn import parallel
    monkeypatch.setattr(parallel, "_group_info", lambda group: (4, 0))
    with pytest.raises(ValueError, match=r"^k: the K/V head count Hk = 2 must be divisible by the world size N = 4"):
        parallel.ulysses_attention(*qkv(torch, 8, 2))
    with pytest.raises(ValueError, match=r"^k: expected 8 heads like q, or a divisor of 8"):
        parallel.ulysses_attention(*qkv(torch, 8, 3))
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):   # Hk = 4 splits: only the device is left
        parallel.ulysses_attention(*qkv(torch, 8, 4))


@pytest.mark.parametrize("n, h, hk", [(2, 8, 2), (2, 4, 4), (4, 8, 4)])
def test_ulysses_gqa_equals_one_call(torch, monkeypatch, n, h, hk):
    """N simulated ranks (threads for all_to_all_single): rank r's H/N query heads meet their own Hk/N K/V heads
    (query head i attends K/V head i // (H // Hk) globally), so the gathered output is the single call's. The
    attention is a float64 stand-in taking K/V heads as openvc does."""
    from open_vc_attn import parallel
    from test_parallel import FakeWorld
    world = FakeWorld(torch, n)
    monkeypatch.setattr(parallel, "_all_to_all", world.all_to_all)
    monkeypatch.setattr(parallel, "_group_info", lambda group: (n, world.local.rank))
    monkeypatch.setattr(parallel._checks, "check_tokens", lambda *a, **kw: None)   # CPU tensors: no device check

    def attention(q, k, v, **kw):
        kr, vr = (x.double().repeat_interleave(q.shape[2] // x.shape[2], dim=2).transpose(1, 2) for x in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(1, 2), kr, vr)
        return out.transpose(1, 2)
    monkeypatch.setattr(parallel.api, "attention", attention)
    g = torch.Generator().manual_seed(n * 100 + h + hk)
    s = 64 * n
    q = torch.randn(2, s, h, 64, generator=g)
    k, v = (torch.randn(2, s // 2, hk, 64, generator=g) for _ in range(2))   # cross lengths
    sl, kl = s // n, s // 2 // n
    outs = world.run(lambda r: parallel.ulysses_attention(q[:, r * sl:(r + 1) * sl], k[:, r * kl:(r + 1) * kl],
                                                          v[:, r * kl:(r + 1) * kl]))
    assert torch.allclose(torch.cat(outs, dim=1), attention(q, k, v), rtol=0, atol=1e-10)


# ---- the integrations' auto format: exact rows of grouped calls ----------------------------------------------------

def test_auto_format_exact_rows_of_grouped_calls(torch):
    """qk_format="auto" measures each candidate against exact attention of sampled rows, which maps each query
    head to its K/V head: a stand-in whose output is exact attention x (1 + eps) measures eps."""
    from open_vc_attn.integrations import _auto_format, policy

    class Owner:
        pass
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 96, 6, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 96, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    kr, vr = (x.double().repeat_interleave(3, dim=2).transpose(1, 2) for x in (k, v))
    exact = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(1, 2), kr, vr, is_causal=True)
    eps = {"e4m3": 0.2, "int8": 0.03}

    def run(pol):
        return (exact.transpose(1, 2) * (1 + eps[pol.qk_format])).float()
    auto = policy.DispatchPolicy(qk_format="auto", min_query_tokens=64, min_key_tokens=64)
    choice, res = _auto_format.AutoChoices().choose(Owner(), auto, run, q, k, v, causal=True)
    assert choice.policy.qk_format == "int8"
    assert [name for name, _ in choice.errors] == ["e4m3", "int8+k_smoothing"]
    assert all(math.isclose(err, want, abs_tol=1e-4) for (_, err), want in zip(choice.errors, (0.2, 0.03)))
    assert math.isclose(float((res.double() - exact.transpose(1, 2)).norm() / exact.norm()), 0.03, rel_tol=1e-5)

