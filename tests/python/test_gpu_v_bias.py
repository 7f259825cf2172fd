"""The V rounding bias correction on the GPU (open_vc_attn.attention(..., v_bias_correction=True); numerics section 4,
"V rounding bias"; INT8 Q/K calls): with uniform attention (q = 0) the corrected output is the mean of V's keys,
which the uncorrected one misses; in every fast call form (dense, causal, chunked causal, packed uneven with an empty
sequence, key counts, head dim 64, K smoothing, exp2 P, GQA) it moves each output by V's mean rounding error per
channel and keeps rows without keys at 0; E4M3 and block lists refused; the error against exact FP64 attention of N(0,1) inputs goes down; CUDA graph replay
and torch.compile(fullgraph=True). Tests marked `gpu` (conftest.py skips them without an sm_90 device). On an H200:
python3 -m pytest -q -rs tests/python/test_gpu_v_bias.py
"""
import pytest

import open_vc_attn as ova
from helpers import graph_replays_like_eager

pytestmark = pytest.mark.gpu


def randn(torch, g, *shape, scale=1.0):
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


def exact(torch, q, k, v, causal=False):
    """softmax(q k^T / sqrt(D)) v in float64, [B, S, H, D] (k, v repeated to q's heads)."""
    h = q.shape[-2]
    k, v = (x.repeat_interleave(h // x.shape[-2], dim=-2) for x in (k, v))
    qt, kt, vt = (x.double().transpose(1, 2) for x in (q, k, v))
    s = qt @ kt.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vt).transpose(1, 2)


def expected_bias(torch, v, keys):
    """The bias per (batch entry, K/V head, channel) from its definition (numerics section 4): the mean over the first
    `keys[b]` keys of (x - e4m3(x)) / scale_inv, x = fl(v * scale_inv), scale_inv = fl(448 / max |v|) of the entry and
    head, e4m3 the library's round-to-nearest-even codes (open_vc_attn.reference; torch's float8 cast breaks exact
    ties differently, and the constants below make ties). float64 [B, Hk, D]."""
    import numpy as np
    from open_vc_attn.reference import e4m3_decode, e4m3_encode
    vf = v.float().cpu().numpy()
    b, sk, hk, d = vf.shape
    out = np.zeros((b, hk, d))
    for i in range(b):
        vv = vf[i, :keys[i]]
        scale = (np.float32(448.0) / np.abs(vv).max(axis=(0, 2), keepdims=True)).astype(np.float32)
        x = (vv * scale).astype(np.float32)
        r = (x - e4m3_decode(e4m3_encode(x))).astype(np.float64)
        out[i] = r.mean(0) / scale[0].astype(np.float64)
    return torch.from_numpy(out).to(v.device)


def test_uniform_attention_gives_the_mean_of_v():
    import torch
    g = torch.Generator(device="cuda").manual_seed(1)
    b, s, h, d = 1, 1000, 2, 128
    q = torch.zeros(b, 200, h, d, device="cuda", dtype=torch.bfloat16)
    k = randn(torch, g, b, s, h, d)
    # A per-channel constant off the E4M3 grid plus a little noise: V's rounding errors share a sign per channel.
    v = (1.0 + 0.0123 * torch.arange(d, device="cuda") + 0.002 * torch.randn(b, s, h, d, device="cuda",
                                                                               generator=g)).to(torch.bfloat16)
    mean = v.double().mean(1, keepdim=True).expand(b, 200, h, d)
    plain = ova.attention(q, k, v, qk_format="int8").double()
    fixed = ova.attention(q, k, v, qk_format="int8", v_bias_correction=True).double()
    err_plain = ((plain - mean).norm() / mean.norm()).item()
    err_fixed = ((fixed - mean).norm() / mean.norm()).item()
    assert err_fixed < 4e-3, err_fixed          # BF16 output rounding and the FP8 tensor-core sums
    assert err_fixed < 0.25 * err_plain, (err_fixed, err_plain)


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, causal_chunk=64, p_format="exp2"),
    dict(d=64),
    dict(d=64, p_format="exp2", causal=True),
    dict(k_smoothing=True),
    dict(k_smoothing=True, p_format="exp2"),
    dict(hk=2),
    dict(key_counts=True, p_format="exp2"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "dense")
def test_every_form_moves_outputs_by_the_bias_only(case):
    import torch
    case = dict(case)
    d, hk, counts = case.pop("d", 128), case.pop("hk", 4), case.pop("key_counts", False)
    g = torch.Generator(device="cuda").manual_seed(7)
    b, sq, sk, h = 2, 300, 900, 4
    q, k = randn(torch, g, b, sq, h, d), randn(torch, g, b, sk, hk, d)
    # V: a constant per (batch entry, K/V head, channel) off the E4M3 grid plus a little noise: a bias of several BF16
    # steps, different for every entry and head.
    base = (1.0 + 0.0123 * torch.arange(d, device="cuda") + 0.37 * torch.arange(hk, device="cuda")[:, None]
            + 0.11 * torch.arange(b, device="cuda")[:, None, None])
    v = (base[:, None] + 0.002 * torch.randn(b, sk, hk, d, device="cuda", generator=g)).to(torch.bfloat16)
    kw = dict(case, qk_format="int8")
    keys = [sk, 333] if counts else [sk, sk]
    if counts:
        kw["seqused_k"] = torch.tensor(keys, dtype=torch.int32, device="cuda")
    plain = ova.attention(q, k, v, **kw).float()
    fixed = ova.attention(q, k, v, v_bias_correction=True, **kw).float()
    diff = fixed - plain
    assert torch.isfinite(fixed).all()
    # The bias is one value per (batch entry, head, channel), the same for every row.
    spread = (diff - diff.mean(1, keepdim=True)).abs().max().item()
    assert spread <= 0.02 * plain.abs().max().item(), spread   # BF16 roundings of the two outputs only
    want = expected_bias(torch, v, keys).repeat_interleave(h // hk, dim=1)     # [B, H, D]
    got = diff.double().mean(1)                                                # [B, H, D]: row means
    # Every row's output is nearly the same here, so the two BF16 roundings do not average out: one BF16 step of the
    # largest output (plus 10%) bounds the difference; the bias itself reaches several steps.
    step = 2.0 ** (int(torch.log2(plain.abs().max()).floor().item()) - 7)
    assert (got - want).abs().max().item() <= 1.1 * step, ((got - want).abs().max().item(), step)
    assert want.abs().max().item() > 2.0 * step


def test_error_against_exact_attention_goes_down():
    import torch
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (randn(torch, g, 1, 4096, 4, 128) for _ in range(3))
    ref = exact(torch, q, k, v)
    for kw in (dict(qk_format="int8"), dict(qk_format="int8", k_smoothing=True, p_format="exp2")):
        e_plain = ((ova.attention(q, k, v, **kw).double() - ref).norm() / ref.norm()).item()
        e_fixed = ((ova.attention(q, k, v, v_bias_correction=True, **kw).double() - ref).norm() / ref.norm()).item()
        assert e_fixed < 0.97 * e_plain, (kw, e_fixed, e_plain)


def test_packed_rows_without_keys_stay_zero():
    import torch
    g = torch.Generator(device="cuda").manual_seed(5)
    cu = torch.tensor([0, 260, 260, 1153], dtype=torch.int32, device="cuda")
    q, k, v = (randn(torch, g, 1153, 4, 128) for _ in range(3))
    cu_k = torch.tensor([0, 0, 0, 1153], dtype=torch.int32, device="cuda")   # the first sequence has no keys
    out = ova.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=893, max_seqlen_k=1153,
                        qk_format="int8", v_bias_correction=True)
    assert torch.equal(out[:260].float(), torch.zeros_like(out[:260].float()))
    assert torch.isfinite(out).all()


def test_causal_rows_without_keys_stay_zero():
    """Causal with more queries than keys (aligned to the end): rows 0..Sq-Sk-1 see no key and stay exactly 0 with the
    correction, in the same tiles as rows that see keys and move by the bias."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(11)
    sq, sk = 700, 300
    q = randn(torch, g, 1, sq, 2, 128)
    k = randn(torch, g, 1, sk, 2, 128)
    v = (1.0 + 0.0123 * torch.arange(128, device="cuda") + 0.002 * torch.randn(1, sk, 2, 128, device="cuda",
                                                                                generator=g)).to(torch.bfloat16)
    for kw in (dict(), dict(p_format="exp2", k_smoothing=True)):
        plain = ova.attention(q, k, v, causal=True, qk_format="int8", **kw).float()
        fixed = ova.attention(q, k, v, causal=True, qk_format="int8", v_bias_correction=True, **kw).float()
        assert torch.equal(fixed[:, :sq - sk], torch.zeros_like(fixed[:, :sq - sk])), kw
        assert torch.isfinite(fixed).all()
        assert (fixed[:, sq - sk:] - plain[:, sq - sk:]).abs().mean() > 0, kw   # the rows with keys moved


def test_graph_replay_and_compile():
    import torch
    g = torch.Generator(device="cuda").manual_seed(9)

    def make():
        return tuple(randn(torch, g, 1, 1024, 4, 128) for _ in range(3))

    def fn(q, k, v):
        return ova.attention(q, k, v, qk_format="int8", k_smoothing=True, v_bias_correction=True)
    graph_replays_like_eager(torch, fn, make(), make(), make())
    q, k, v = make()
    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(q, k, v), fn(q, k, v))


def test_e4m3_and_block_lists_are_refused_naming_it():
    """The correction's kernels are INT8 modes without key block lists (mode.h): E4M3 Q/K and key block lists raise
    ValueError naming v_bias_correction."""
    import torch
    q = torch.zeros(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="v_bias_correction.*qk_format='int8'"):
        ova.attention(q, q, q, v_bias_correction=True)
    counts = torch.ones(1, 2, 2, dtype=torch.int32, device="cuda")
    indices = torch.zeros(1, 2, 2, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="v_bias_correction.*block"):
        ova.ops.call.attention(q, q, q, None, None, 0, 0, None, 0.0, False, 4, False, None, "int8", False, "expcast",
                               counts, indices, 1, True)
