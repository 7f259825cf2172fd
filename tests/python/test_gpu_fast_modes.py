"""The sm_90a fast path's causal, packed-sequence and key-padding modes through open_vc_attn, and the
robustness rules of docs/numerics.md ("Non-finite and extreme inputs") on every path.

- Fast vs general path on the SAME preparation (ops.attention_fp8 with path "fast" vs "general"): the
  general path computes the reference arithmetic exactly, the fast path's QK^T accumulates on the FP8
  tensor cores, so outputs agree to the kernel tolerance of the C++ tests and LSEs to 0.03.
- Key padding: a mask or key counts give bit for bit the output of the call on the kept keys alone
  (the same quantization groups, the same tiles and order).
- CUDA graph replay with new inputs, masks and offsets equals eager bit for bit.
- NaN/Inf confined to the (batch, head) that holds them; huge and tiny inputs give finite outputs.
On an H200: python3 -m pytest -q -rs tests/python/test_gpu_fast_modes.py
"""
import warnings

import numpy as np
import pytest

import open_vc_attn
from open_vc_attn import ops
from helpers import torch_qkv

pytestmark = pytest.mark.gpu


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fast_vs_general(torch, prepared, causal, lse_tol=0.03, rel_tol=1.2e-2, **seq):
    """Both kernels on one preparation; returns (fast out, fast lse)."""
    args = (*prepared.tensors(), seq.get("cu_q"), seq.get("cu_k"), seq.get("max_q", 0), seq.get("max_k", 0), 0.0,
            causal, 4, True, seq.get("used"))
    out_f, lse_f = ops.attention_fp8_op(*args, path="fast")
    out_g, lse_g = ops.attention_fp8_op(*args, path="general")
    torch.cuda.synchronize()
    assert torch.isfinite(out_f).all() and torch.isfinite(out_g).all()
    assert rel_l2(out_f, out_g) <= rel_tol, rel_l2(out_f, out_g)
    assert torch.equal(torch.isinf(lse_f), torch.isinf(lse_g))   # rows without keys: -inf on both
    fin = torch.isfinite(lse_g)
    assert float((lse_f[fin] - lse_g[fin]).abs().max()) <= lse_tol
    return out_f, lse_f


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (300, 1000), (1000, 300), (1, 1), (640, 640)])
def test_causal_fast_path_matches_general_path(torch, sq, sk):
    q, _, _ = torch_qkv(torch, 2, sq, 3, seed=sq)
    _, k, v = torch_qkv(torch, 2, sk, 3, seed=sk + 1)
    prepared = open_vc_attn.prepare_fp8(q, k, v)
    out, lse = fast_vs_general(torch, prepared, True)
    if sq > sk:   # the first Sq - Sk rows see no key: output 0, lse -inf
        assert torch.all(out[:, : sq - sk] == 0) and torch.all(torch.isinf(lse[:, :, : sq - sk]))
    # The public call takes the same kernel.
    got = open_vc_attn.attention(q, k, v, causal=True)
    assert torch.equal(got, out)


def test_packed_fast_path_matches_general_path(torch):
    lens_q, lens_k = [1, 300, 0, 1000, 129], [1000, 300, 5, 1, 0]
    h = 2
    q = torch.randn(sum(lens_q), h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), h, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), h, 128, device="cuda", dtype=torch.bfloat16)
    cu = lambda lens: torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    for causal in (False, True):
        prepared = open_vc_attn.prepare_fp8(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
        fast_vs_general(torch, prepared, causal, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), max_k=max(lens_k))
        out = open_vc_attn.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                     max_seqlen_k=max(lens_k), causal=causal)
        # Each sequence alone, batched: the same groups, tiles and order, so the same bits.
        for s in range(len(lens_q)):
            q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            if q1 == q0:
                continue
            if k1 == k0:
                assert torch.all(out[q0:q1] == 0)
                continue
            alone = open_vc_attn.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal)[0]
            assert torch.equal(out[q0:q1], alone), s


def test_packed_rows_outside_every_sequence_are_zero(torch):
    q, k, v = (torch.randn(600, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu_q = torch.tensor([10, 200, 450], dtype=torch.int32, device="cuda")   # rows 0-9 and 450-599: no sequence
    cu_k = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
    out, lse = open_vc_attn.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300,
                                      max_seqlen_k=300, return_lse=True)
    assert torch.all(out[:10] == 0) and torch.all(out[450:] == 0)
    assert torch.all(torch.isinf(lse[:, :10])) and torch.all(torch.isinf(lse[:, 450:]))
    assert torch.isfinite(out[10:450]).all() and (out[10:450] != 0).any()


@pytest.mark.parametrize("bad_q", [[0, 300, 100000], [-50, 200, 100], [0, 700, -1]])
def test_bad_offsets_are_clamped_and_checked_on_request(torch, bad_q):
    q, k, v = (torch.randn(600, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu_q = torch.tensor(bad_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, -7, 100000], dtype=torch.int32, device="cuda")
    out = open_vc_attn.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=400, max_seqlen_k=400)
    torch.cuda.synchronize()   # no fault (compute-sanitizer memcheck runs this on the device)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="^cu_seqlens_(q|k):"):
        open_vc_attn.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=400, max_seqlen_k=400,
                               check_inputs=True)


@pytest.mark.parametrize("causal", [False, True])
def test_key_counts_equal_the_call_on_the_used_keys(torch, causal):
    q, k, v = torch_qkv(torch, 3, 700, 2, seed=3)
    used = [700, 517, 1]
    counts = torch.tensor(used, dtype=torch.int32, device="cuda")
    out = open_vc_attn.attention(q, k, v, seqused_k=counts, causal=causal)
    for b, n in enumerate(used):
        alone = open_vc_attn.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
        assert torch.equal(out[b:b + 1], alone), b
    prepared = open_vc_attn.prepare_fp8(q, k, v, seqused_k=counts)
    fast_vs_general(torch, prepared, causal, used=counts)
    assert torch.equal(open_vc_attn.attention_fp8(prepared, causal=causal), out)


@pytest.mark.parametrize("form", ["bool", "additive", "bool4d", "finfo_min", "ltx_bf16"])
def test_key_padding_mask_equals_the_call_on_the_kept_keys(torch, form):
    b, sq, sk, h = 2, 300, 1000, 2
    q, _, _ = torch_qkv(torch, b, sq, h, seed=5)
    _, k, v = torch_qkv(torch, b, sk, h, seed=6)
    keep = torch.ones(b, sk, dtype=torch.bool, device="cuda")
    keep[0, 744:] = False                # suffix padding (text tokens padded at the end)
    keep[1, 100:300] = False             # a hole
    keep[1, 990:] = False
    mask = {"bool": keep, "bool4d": keep[:, None, None, :],
            "additive": torch.zeros(b, sk, device="cuda").masked_fill(~keep, float("-inf")),
            "finfo_min": torch.zeros(b, 1, 1, sk, device="cuda", dtype=torch.bfloat16).masked_fill(
                ~keep[:, None, None, :], torch.finfo(torch.bfloat16).min),
            # LTX-Video's form: -10000 in BF16, i.e. -9984
            "ltx_bf16": torch.where(keep, 0.0, -10000.0).to(torch.bfloat16)[:, None, :]}[form]
    out = open_vc_attn.attention(q, k, v, key_padding_mask=mask)
    for i in range(b):
        idx = keep[i].nonzero()[:, 0]
        alone = open_vc_attn.attention(q[i:i + 1], k[i:i + 1, idx], v[i:i + 1, idx])
        assert torch.equal(out[i:i + 1], alone), i
    ref = open_vc_attn.attention(q, k, v, key_padding_mask=mask, version="reference", mode="bf16")
    assert rel_l2(out, ref) < 0.05


def test_mask_forms_that_are_not_key_padding_are_rejected(torch):
    q, k, v = torch_qkv(torch, 1, 256, 2, seed=7)
    with pytest.raises(ValueError, match="^key_padding_mask: expected a key mask of shape"):
        open_vc_attn.attention(q, k, v, key_padding_mask=torch.ones(1, 2, 256, 256, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="^key_padding_mask: not taken with causal=True"):
        open_vc_attn.attention(q, k, v, causal=True, key_padding_mask=torch.ones(1, 256, dtype=torch.bool,
                                                                                  device="cuda"))
    bias = torch.full((1, 256), -0.5, device="cuda")
    with pytest.raises(ValueError, match="^key_padding_mask: an additive key padding mask must hold only 0"):
        open_vc_attn.attention(q, k, v, key_padding_mask=bias, check_inputs=True)


def test_graph_replay_with_new_inputs_masks_and_offsets(torch):
    b, s, h = 2, 520, 2
    q, k, v = torch_qkv(torch, b, s, h, seed=8)
    counts = torch.tensor([520, 300], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 200, 520], dtype=torch.int32, device="cuda")
    qp, kp, vp = q[0], k[0], v[0]
    calls = lambda: (open_vc_attn.attention(q, k, v, seqused_k=counts, causal=True),
                     open_vc_attn.attention(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=520,
                                            max_seqlen_k=520))
    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    for seed in (9, 10):
        q2, k2, v2 = torch_qkv(torch, b, s, h, seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2)):
            dst.copy_(src)
        counts.copy_(torch.tensor([seed * 11, 519], dtype=torch.int32))
        cu.copy_(torch.tensor([0, seed * 20, 520], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = calls()
        for got, want in zip(outs, eager):
            assert torch.equal(got, want)


def test_head_dim_64_takes_the_fast_path(torch):
    """D = 64 (LTX-Video) runs the fast path's head-dim-64 mode: no general-path warning, and within the
    kernel tolerance of the general path on the same preparation, dense, causal and packed."""
    q, k, v = (x[..., :64].contiguous() for x in torch_qkv(torch, 2, 700, 3, seed=21))
    for causal in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = open_vc_attn.attention(q, k, v, causal=causal)
        p = open_vc_attn.prepare_fp8(q, k, v)
        general, _ = ops.attention_fp8_op(*p.tensors(), None, None, 0, 0, 0.0, causal, 4, False, path="general")
        assert torch.isfinite(out).all() and rel_l2(out, general) < 1e-2, causal
    cu = torch.tensor([0, 300, 1400], dtype=torch.int32, device="cuda")
    flat = [x.reshape(1400, 3, 64) for x in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = open_vc_attn.attention(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1100, max_seqlen_k=1100)
    for a, b in ((0, 300), (300, 1400)):
        one = open_vc_attn.attention(*(x[a:b][None] for x in flat))[0]
        assert torch.equal(out[a:b], one)   # a packed sequence is computed like the call on it alone


# ---- non-finite and extreme inputs (docs/numerics.md) ------------------------------------------------

def _paths(torch):
    """(name, call(q, k, v)) for every path: dense, causal, packed, key counts and D = 64 on the fast path,
    and the general path (open_vc_attn::attention_fp8 with path="general") on the same preparation."""
    def packed(q, k, v, **kw):
        b, s = q.shape[:2]
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        out = open_vc_attn.attention(q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]),
                                     v.reshape(b * s, *v.shape[2:]), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=s, max_seqlen_k=s, **kw)
        return out.reshape(q.shape)
    counts = lambda q: torch.full((q.shape[0],), q.shape[1], dtype=torch.int32, device="cuda")

    def general(q, k, v, softmax_scale=None):
        p = open_vc_attn.prepare_fp8(q, k, v)
        return ops.attention_fp8_op(*p.tensors(), None, None, 0, 0, softmax_scale or 0.0, False, 4, False,
                                    path="general")[0]
    d64 = lambda x: x[..., :64].contiguous()
    return [("dense", lambda q, k, v, **kw: open_vc_attn.attention(q, k, v, **kw)),
            ("causal", lambda q, k, v, **kw: open_vc_attn.attention(q, k, v, causal=True, **kw)),
            ("packed", packed),
            ("seqused", lambda q, k, v, **kw: open_vc_attn.attention(q, k, v, seqused_k=counts(q), **kw)),
            ("d64", lambda q, k, v, **kw: open_vc_attn.attention(d64(q), d64(k), d64(v), **kw)),
            ("general", general)]


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_one_non_finite_value_stays_in_its_batch_and_head(torch, where, value):
    warnings.simplefilter("ignore", RuntimeWarning)
    q, k, v = torch_qkv(torch, 2, 300, 3, seed=11)
    for name, call in _paths(torch):
        clean = call(q, k, v)
        bad = dict(q=q.clone(), k=k.clone(), v=v.clone())
        bad[where][1, 150, 2, 5] = value
        got = call(bad["q"], bad["k"], bad["v"])
        keep = torch.ones_like(got, dtype=torch.bool)
        keep[1, :, 2] = False          # the (batch, head) that holds the value
        assert torch.equal(got[keep], clean[keep]), name
        if where == "q" and value != value:   # NaN in one query row: only that row
            others = torch.ones(got.shape[1], dtype=torch.bool, device="cuda")
            others[150] = False
            assert torch.equal(got[1, others, 2], clean[1, others, 2]), name


@pytest.mark.parametrize("case", ["q_k_1e4", "fp16_near_max", "scale_1e7"])
def test_huge_score_spreads_give_finite_outputs(torch, case):
    warnings.simplefilter("ignore", RuntimeWarning)
    q, k, v = torch_qkv(torch, 1, 500, 2, seed=12)
    kw = {}
    if case == "q_k_1e4":
        q, k = q * 1e4, k * 1e4
    elif case == "fp16_near_max":
        q, k, v = (x.to(torch.float16) for x in (q, k, v))
        q = (q / q.abs().max() * 65504).to(torch.float16)
        k = (k / k.abs().max() * 65504).to(torch.float16)
    else:
        kw["softmax_scale"] = 1e7
    vmax = float(v.abs().max())
    scale = kw.get("softmax_scale")

    def exact(q, k, v, causal):
        """float64 softmax attention on the same (BF16/FP16) inputs."""
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * (scale or q.shape[-1] ** -0.5)
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())

    for name, call in _paths(torch):
        out = call(q, k, v, **kw)
        assert torch.isfinite(out).all(), name
        assert float(out.abs().max()) <= 1.01 * vmax, name   # a convex combination of V rows
        d = 64 if name == "d64" else 128
        want = exact(q[..., :d], k[..., :d], v[..., :d], name == "causal")
        # Nearly one-hot rows: FP8 Q/K may pick a neighbouring key, so the error is bounded by the
        # spread of V rather than small; it must stay far from garbage (rel L2 2 is the worst case).
        assert rel_l2(out, want) < 1.0, (name, rel_l2(out, want))
        sdpa = open_vc_attn.attention(q[..., :d].contiguous(), k[..., :d].contiguous(), v[..., :d].contiguous(),
                                      causal=name == "causal", version="reference", mode="bf16", **kw)
        if torch.isfinite(sdpa).all():   # torch SDPA in BF16, where it is finite
            assert rel_l2(sdpa, want) < 1.5 and rel_l2(out, want) <= rel_l2(sdpa, want) + 1.0, name


def test_tiny_groups_give_finite_zero_outputs(torch):
    warnings.simplefilter("ignore", RuntimeWarning)
    q, k, v = torch_qkv(torch, 1, 300, 2, seed=13)
    q, k, v = (x.float() * 1e-38 for x in (q, k, v))
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))   # BF16 subnormals and tiny normals
    for name, call in _paths(torch):
        out = call(q, k, v)
        assert torch.isfinite(out).all(), name
        assert float(out.float().abs().max()) <= 1e-36, name   # tiny V groups are zeros (exact: ~1e-38)


# ---- out_dtype: FP16 out without a cast kernel (every path) ------------------------------------------

@pytest.mark.parametrize("path", ["dense", "causal", "packed", "seqused", "d64"])
def test_fp16_output_is_the_bf16_output_in_fp16(torch, path):
    """out_dtype=torch.float16 writes the same FP32 results rounded to FP16: within one BF16 step of the
    BF16 output everywhere, and closer to the FP32 truth than BF16 on average."""
    warnings.simplefilter("ignore", RuntimeWarning)
    q, k, v = (x.to(torch.float16) for x in torch_qkv(torch, 2, 300, 2, seed=14))
    call = dict(_paths(torch))[path]
    bf = call(q, k, v)
    fp = call(q, k, v, out_dtype=torch.float16)
    assert bf.dtype == torch.bfloat16 and fp.dtype == torch.float16 and fp.shape == bf.shape
    diff = (fp.float() - bf.float()).abs()
    assert float((diff - bf.float().abs() / 128).max()) <= 1e-6   # within a BF16 rounding step
    with pytest.raises(TypeError, match="^out_dtype: expected None, torch.bfloat16 or torch.float16"):
        open_vc_attn.attention(q, k, v, out_dtype=torch.float32)


# ---- the repair and VC paths on extreme and non-finite inputs -------------------------------------------

def test_repair_and_vc_paths_on_extreme_and_non_finite_inputs(torch):
    from open_vc_attn import baselines, repair
    q, k, v = torch_qkv(torch, 1, 512, 2, seed=15)
    calls = [("repair", lambda q, k, v: repair.attention_v_repair(repair.prepare_v_repair(q, k, v, budget=0.01))),
             ("vc", lambda q, k, v: baselines.vc_attention(q, k, v))]
    for name, call in calls:
        big = call(q * 1e4, k * 1e4, v)                       # huge score spreads
        assert torch.isfinite(big).all() and float(big.abs().max()) <= 1.01 * float(v.abs().max()), name
        tiny = call(*(x.float().mul(1e-38).to(torch.bfloat16) for x in (q, k, v)))
        assert torch.isfinite(tiny).all(), name               # tiny groups are zeros
        clean = call(q, k, v)
        bad = k.clone()
        bad[0, 100, 1, 3] = float("nan")
        got = call(q, bad, v)
        assert torch.equal(got[:, :, 0], clean[:, :, 0]), name   # head 0 untouched
