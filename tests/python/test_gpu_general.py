"""The general attention path through open_vc_attn.attention / attention_fp8 and the custom op
open_vc_attn::attention_fp8 with path="general": causal (Sq == Sk and Sq != Sk), cross-attention, packed sequences
(cu_seqlens), head_dim 64, LSE, the BF16 SDPA baseline (version="reference"), errors, opcheck,
torch.compile, CUDA graphs, streams, no host synchronization.

The general kernel computes the reference arithmetic (exact FP8 dot products, the same ExpCast codes,
maxima and tile sums; only the FP32 numerator differs from the reference's double), so it is held to
the CPU reference rounded to BF16 almost bit for bit. Tests marked `gpu` need an sm_90 device; the
argument checks run on CPU/meta tensors with torch alone. On an H200:
python3 -m pytest -q -rs tests/python/test_gpu_general.py
"""
import functools

import numpy as np
import pytest

import open_vc_attn
from open_vc_attn import _ext, reference as ref, video_inputs
from helpers import cpu_qkv


# ---- helpers ----------------------------------------------------------------------------------------

def video_seq(s, h, d, seed, dtype="bfloat16"):
    """One sequence of video-like numpy q, k, v [s, h, d] (float32 holding bf16 values, or float16)."""
    small = s < 16
    p = video_inputs.generate(frames=max(1, -(-s // 128)), height=8, width=16, seqlen=s, batch=1, heads=h,
                              head_dim=d, seed=seed, dtype=dtype, num_sink_tokens=0 if small else 4,
                              v_outlier_fraction=0.0 if small else 0.001)
    return p.q[0], p.k[0], p.v[0]


def batched_qkv(b, sq, sk, h, d, seed):
    """[B, Sq, H, D] q and [B, Sk, H, D] k, v (fresh video-like sequences, cross lengths allowed)."""
    qs = [video_seq(sq, h, d, seed + 10 * i)[0] for i in range(b)]
    kv = [video_seq(sk, h, d, seed + 10 * i + 5) for i in range(b)]
    return np.stack(qs), np.stack([x[1] for x in kv]), np.stack([x[2] for x in kv])


def packed_qkv(lens_q, lens_k, h, d, seed):
    """Packed [total, H, D] numpy q, k, v and int32 offsets for sequences of the given lengths."""
    qs, ks, vs = [], [], []
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs.append(video_seq(lq, h, d, seed + 10 * i)[0])
        _, k, v = video_seq(lk, h, d, seed + 10 * i + 5)
        ks.append(k), vs.append(v)
    cu = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return np.concatenate(qs), np.concatenate(ks), np.concatenate(vs), cu(lens_q), cu(lens_k)


def cuda(torch, *arrays, dtype=None):
    dtype = dtype or torch.bfloat16
    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to("cuda", dtype) for x in arrays)   # exact


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def packed_lse(lse_ref, cu_q, h):
    """Reference packed LSE [N, H, max_len] -> the GPU layout [H, total_q]."""
    out = np.full((h, int(cu_q[-1])), -np.inf)
    for s in range(len(cu_q) - 1):
        n = int(cu_q[s + 1] - cu_q[s])
        out[:, cu_q[s]:cu_q[s + 1]] = lse_ref[s, :, :n]
    return out


def expect_matches_reference(out, lse, want, want_lse, fast=False):
    """The general path against the reference on the same inputs: same arithmetic up to the FP32
    numerator, so BF16 outputs equal the reference's rounded ones except for rare one-step moves.
    fast: the output came from the sm_90a fast path, whose FP8 tensor-core QK^T moves a few codes across a
    rounding boundary: the kernel tolerances of the C++ tests, with the single-value bound at 6% of the
    largest output (one code step, 12.5% of a dominant probability, measured up to 4.8% at head_dim 64,
    whose larger softmax scale makes rows sharper)."""
    got = out.float().cpu().numpy()
    want_bf16 = ref.to_bfloat16_values(want)
    assert np.isfinite(got).all()
    err = rel_l2(got, want_bf16)
    differ = float(np.mean(got != want_bf16))
    if fast:
        assert err <= 5e-3, f"rel L2 {err:.2e}"
        assert np.abs(got - want_bf16).max() <= 0.06 * np.abs(want_bf16).max() + 1e-3
    else:
        assert err <= 1e-3 and differ <= 0.01, f"rel L2 {err:.2e}, {differ:.2%} of BF16 values differ"
        assert np.abs(got - want_bf16).max() <= np.abs(want_bf16).max() / 128 + 1e-6
    if lse is not None:
        g = lse.cpu().numpy().astype(np.float64)
        none = np.isneginf(want_lse)   # rows without a visible key
        assert np.array_equal(np.isneginf(g), none), "lse -inf exactly where no key is visible"
        assert np.abs(g[~none] - want_lse[~none]).max() <= (0.03 if fast else 1e-4)


def expect_lse_close_to_exact(lse, want_lse, exact_lse, fast=False):
    """The LSE against the exact log-sum-exp: as close as the reference's (same arithmetic)."""
    g = lse.cpu().numpy().astype(np.float64)
    fin = np.isfinite(exact_lse)
    assert np.array_equal(np.isneginf(g), ~fin)
    gpu_err, ref_err = np.abs(g[fin] - exact_lse[fin]).mean(), np.abs(want_lse[fin] - exact_lse[fin]).mean()
    slack = 5e-3 if fast else 1e-5
    assert gpu_err <= 1.1 * ref_err + slack and gpu_err <= 0.1, f"lse vs exact {gpu_err:.4f} (reference {ref_err:.4f})"


# ---- argument checks without a GPU (CPU / meta tensors) -------------------------------------------------


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(version="flash"), ValueError, r"^version: expected one of \['open-vc', 'reference'\]"),
    (dict(version=None), TypeError, "^version: expected a str"),
    (dict(mode="fp8"), ValueError, r"^mode: expected one of \['bf16', 'expcast'\]"),
    (dict(mode=1), TypeError, "^mode: expected a str"),
    (dict(mode="bf16"), ValueError, "^mode: version='open-vc' runs mode='expcast' only"),
    (dict(version="reference"), ValueError, "^mode: version='reference' runs mode='bf16' only"),
    (dict(causal=1), TypeError, "^causal: expected a bool"),
    (dict(causal=None), TypeError, "^causal: expected a bool"),
    (dict(max_seqlen_q=10), ValueError, "^max_seqlen_q: only used with cu_seqlens_q and cu_seqlens_k"),
    (dict(max_seqlen_k=10), ValueError, "^max_seqlen_k: only used with cu_seqlens_q and cu_seqlens_k"),
])
def test_errors_options(torch, kwargs, exc, msg):
    q, k, v = cpu_qkv(torch)
    with pytest.raises(exc, match=msg):
        open_vc_attn.attention(q, k, v, **kwargs)


def test_errors_attention_fp8_causal_option(torch):
    with pytest.raises(TypeError, match="^causal: expected a bool"):
        open_vc_attn.attention_fp8(object(), causal="yes")


def test_errors_shapes_reach_every_version(torch):
    """Both versions share the tensor checks: K/V head counts, head dims, dtypes, grad, empty dims, layout, device."""
    z, bf = torch.zeros, torch.bfloat16
    q, k, v = cpu_qkv(torch)
    for version, mode in (("open-vc", "expcast"), ("reference", "bf16")):
        f = lambda *a, **kw: open_vc_attn.attention(*a, version=version, mode=mode, **kw)
        with pytest.raises(ValueError, match=r"^k: expected 2 heads like q, or a divisor of 2 \(GQA/MQA"):
            f(q, z(1, 8, 3, 128, dtype=bf), z(1, 8, 3, 128, dtype=bf))
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):   # GQA / MQA passes the shape checks
            f(q, z(1, 8, 1, 128, dtype=bf), z(1, 8, 1, 128, dtype=bf))
        with pytest.raises(ValueError, match="^q: head_dim 96 is not supported: attention takes 128 or 64"):
            f(*cpu_qkv(torch, (1, 8, 2, 96)))
        with pytest.raises(TypeError, match="^k: expected dtype torch.bfloat16 like q"):
            f(q, k.half(), v)
        with pytest.raises(ValueError, match="^v: requires_grad=True is not supported"):
            f(q, k, z(1, 8, 2, 128, dtype=bf, requires_grad=True))
        with pytest.raises(ValueError, match="^q: expected non-empty"):
            f(z(1, 0, 2, 128, dtype=bf), k, v)
        with pytest.raises(ValueError, match="^q: the head dim must be contiguous"):
            f(z(1, 8, 2, 256, dtype=bf)[..., ::2], k, v)
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor, got device cpu"):
            f(q, k, v, causal=True)
        cu = torch.tensor([0, 8], dtype=torch.int32)
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):   # cu_seqlens values are fine
            f(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_errors_cu_seqlens(torch):
    q, k, v = (x[0] for x in cpu_qkv(torch))   # [8, 2, 128]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    cases = [
        (TypeError, "^cu_seqlens_k: expected an int32 CUDA tensor", dict(cu_seqlens_q=cu)),
        (TypeError, "^cu_seqlens_q: expected an int32 CUDA tensor", dict(cu_seqlens_k=cu)),
        (TypeError, "^cu_seqlens_q: expected dtype torch.int32", dict(cu_seqlens_q=cu.long(), cu_seqlens_k=cu)),
        (ValueError, "^cu_seqlens_q: expected a 1-D tensor of N", dict(cu_seqlens_q=cu[:1], cu_seqlens_k=cu)),
        (ValueError, "^cu_seqlens_k: expected 3 offsets like cu_seqlens_q",
         dict(cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32))),
        (ValueError, r"^max_seqlen_q: expected an int in \[1, 2\^31\)",
         dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0)),
        (TypeError, "^max_seqlen_k: expected a Python int",
         dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=5.0)),
    ]
    for exc, msg, kwargs in cases:
        with pytest.raises(exc, match=msg):
            open_vc_attn.attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=r"^q: packed sequences \(cu_seqlens\) need rank 3"):
        open_vc_attn.attention(q[None], k[None], v[None], cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):   # everything else is valid
        open_vc_attn.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)


def fake_general_args(torch, n=3, total_q=1301, total_k=1301, h=2, d=128, max_q=1000, max_k=1000, dev="cuda"):
    """Packed-layout prepared tensors and offsets; create CUDA ones under FakeTensorMode (no GPU needed)."""
    nq, nk = -(-max_q // 128), -(-max_k // 128)
    u8 = torch.uint8
    tensors = (torch.empty(total_q, h, d, dtype=u8, device=dev), torch.empty(n, h, nq, device=dev),
               torch.empty(total_k, h, d, dtype=u8, device=dev), torch.empty(n, h, nk, device=dev),
               torch.empty(n, h, d, nk * 128, dtype=u8, device=dev), torch.empty(n, h, device=dev))
    return tensors, torch.empty(n + 1, dtype=torch.int32, device=dev)


def test_general_op_fake_shapes_and_errors(torch):
    """The op's fake implementation (FakeTensorMode: CUDA tensors without a GPU): output shapes, and the
    checks it shares with the CUDA implementation."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from open_vc_attn import ops
    op = functools.partial(ops.attention_fp8_op, path="general")
    with FakeTensorMode():
        tensors, cu = fake_general_args(torch)
        out, lse = op(*tensors, cu, cu, 1000, 1000, 0.0, True, 4, True)
        assert out.shape == (1301, 2, 128) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        assert lse.shape == (2, 1301) and lse.dtype == torch.float32
        out, lse = op(*tensors, cu, cu, 1000, 1000, 0.0, False, -1, False)
        assert lse.shape == (0,)
        dev = dict(device="cuda")
        b = (torch.empty(2, 300, 3, 64, dtype=torch.uint8, **dev), torch.empty(2, 3, 3, **dev),
             torch.empty(2, 700, 3, 64, dtype=torch.uint8, **dev), torch.empty(2, 3, 6, **dev),
             torch.empty(2, 3, 64, 768, dtype=torch.uint8, **dev), torch.empty(2, 3, **dev))
        out, lse = op(*b, None, None, 0, 0, 0.1, True, 4, True)
        assert out.shape == (2, 300, 3, 64) and lse.shape == (2, 3, 300)
        bad_v = torch.empty(3, 2, 128, 1000, dtype=torch.uint8, **dev)
        k5 = torch.empty(5, dtype=torch.int32, **dev)
        cases = [
            (ValueError, r"^v_packed: expected shape \(3, 2, 128, 1024\)", (*tensors[:4], bad_v, tensors[5]), cu, cu,
             1000),
            (ValueError, r"^q_descale: expected shape \(3, 2, 9\)", tensors, cu, cu, 1100),
            (ValueError, r"^max_seqlen_q: expected an int in \[1, 2\^31\)", tensors, cu, cu, 0),
            (TypeError, "^cu_seqlens_q: expected dtype torch.int32", tensors, cu.long(), cu, 1000),
            (ValueError, "^cu_seqlens_k: expected 4 offsets", tensors, cu, k5, 1000),
            (TypeError, "^cu_seqlens_k: expected an int32 tensor", tensors, cu, None, 1000),
            (ValueError, "^q_codes: head_dim 96 is not supported", fake_general_args(torch, d=96)[0], cu, cu, 1000),
            (ValueError, r"^k_codes: expected shape \(1301, 2, 128\)",
             (*tensors[:2], torch.empty(1301, 2, 64, dtype=torch.uint8, **dev), *tensors[3:]), cu, cu, 1000),
        ]
        for exc, msg, ts, cq, ck, max_q in cases:
            with pytest.raises(exc, match=msg):
                op(*ts, cq, ck, max_q, 1000, 0.0, False, 4, False)
        with pytest.raises(ValueError, match="^softmax_scale: expected a finite float"):
            op(*tensors, cu, cu, 1000, 1000, float("nan"), False, 4, False)
        with pytest.raises(ValueError, match="^mid_window_blocks: expected -1"):
            op(*tensors, cu, cu, 1000, 1000, 0.0, False, -2, False)
    tensors, cu = fake_general_args(torch, dev="meta")   # everything else valid: the device is checked last
    with pytest.raises(ValueError, match="^q_codes: expected a CUDA tensor"):
        op(*tensors, cu, cu, 1000, 1000, 0.0, False, 4, False)


def test_general_path_grid_limits_name_the_argument(torch):
    """batch, heads and the sequence count are grid dimensions of the general path (at most 65535): checked
    in Python, naming the argument (FakeTensorMode: CUDA tensors without a GPU or memory). attention() takes
    every head dim and form on the fast path, which has no such limit."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from open_vc_attn import ops
    with FakeTensorMode():
        dev = dict(device="cuda", dtype=torch.bfloat16)
        many_b = torch.empty(65536, 1, 1, 64, **dev)
        prepared = open_vc_attn.prepare_fp8(many_b, many_b, many_b)
        with pytest.raises(ValueError, match="^q_codes: the general path .* at most 65535 batches"):
            ops.attention_fp8_op(*prepared.tensors(), None, None, 0, 0, 0.0, False, 4, False, path="general")
        many_h = torch.empty(1, 1, 65536, 64, **dev)
        prepared = open_vc_attn.prepare_fp8(many_h, many_h, many_h)
        with pytest.raises(ValueError, match="^q_codes: the general path .* at most 65535 heads"):
            ops.attention_fp8_op(*prepared.tensors(), None, None, 0, 0, 0.0, True, 4, False, path="general")
        packed = torch.empty(65536, 1, 64, **dev)
        cu = torch.arange(65537, dtype=torch.int32, device="cuda")
        prepared = open_vc_attn.prepare_fp8(packed, packed, packed, cu, cu, 1, 1)
        with pytest.raises(ValueError, match="^cu_seqlens_q: the general path .* at most 65535 sequences"):
            ops.attention_fp8_op(*prepared.tensors(), cu, cu, 1, 1, 0.0, False, 4, False, path="general")
        # The fast path (both head dims, causal and packed too) has no such limit.
        for d in (64, 128):
            x = torch.empty(65536, 1, 1, d, **dev)
            assert open_vc_attn.attention(x, x, x).shape == (65536, 1, 1, d)
            x = torch.empty(1, 1, 65536, d, **dev)
            assert open_vc_attn.attention(x, x, x, causal=True).shape == (1, 1, 65536, d)
        out = open_vc_attn.attention(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
                                     max_seqlen_k=1)
        assert out.shape == packed.shape


def test_extension_maps_general_status_to_value_error():
    ext = _ext.load()
    p = ext.GeneralAttentionParams()
    for name, value in dict(batch=1, seqlen_q=1, seqlen_k=1, heads=1, head_dim=96, q_codes=16, q_descale=16,
                            k_codes=16, k_descale=16, v_packed=16, v_descale=16).items():
        setattr(p.in_, name, value)
    p.causal, p.out = True, 16
    p.out_stride_batch = p.out_stride_seq = p.out_stride_head = 128
    with pytest.raises(ValueError, match="in.head_dim: the general path takes 64 or 128, got 96"):
        ext.attention_general(p, 0)
    p.in_.head_dim, p.cu_seqlens_q = 64, 16
    with pytest.raises(ValueError, match="packed sequences need both offset arrays"):
        ext.attention_general(p, 0)


# ---- GPU: against the CPU reference ---------------------------------------------------------------------

BATCHED_CASES = [  # (b, sq, sk, h, d, causal, mid_window)
    (1, 1000, 1000, 2, 128, True, 4),      # causal self-attention
    (2, 1000, 1000, 1, 64, True, None),    # causal, D = 64, natural order
    (1, 300, 1000, 2, 128, True, 4),       # causal, Sq < Sk (aligned to the end)
    (2, 1000, 300, 1, 64, True, 4),        # causal, Sq > Sk: the first 700 rows see no key
    (2, 200, 1000, 2, 64, False, None),    # cross-attention, D = 64
    (1, 1000, 200, 2, 64, False, 0),
    (2, 127, 127, 2, 64, False, 4),
    (1, 128, 128, 1, 64, True, 4),
    (1, 1, 1, 2, 128, True, 4),
    (2, 1, 1000, 1, 64, True, 4),          # one query row sees every key
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,sq,sk,h,d,causal,w", BATCHED_CASES)
def test_batched_matches_reference(torch, b, sq, sk, h, d, causal, w):
    qn, kn, vn = batched_qkv(b, sq, sk, h, d, seed=sq + 3 * sk + d)
    q, k, v = cuda(torch, qn, kn, vn)
    out, lse = open_vc_attn.attention(q, k, v, causal=causal, mid_window_blocks=w, return_lse=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    want, want_lse = ref.attention(qn, kn, vn, causal=causal, mid_window_blocks=w, return_lse=True)
    fast = True   # both head dims run on the fast path (test_general_op_matches_reference: the general path)
    expect_matches_reference(out, lse, want, want_lse, fast)
    exact, exact_lse = ref.attention_exact(qn, kn, vn, causal=causal, return_lse=True)
    got = out.float().cpu().numpy()
    assert rel_l2(got, exact) <= 1.1 * rel_l2(want, exact) + (1e-3 if fast else 1e-4)
    expect_lse_close_to_exact(lse, want_lse, exact_lse, fast)
    if causal and sq > sk:
        assert not out[:, :sq - sk].any() and torch.isneginf(lse[:, :, :sq - sk]).all()


PACKED_CASES = [  # (lens_q, lens_k, h, d, causal)
    ((1, 300, 1000), (1000, 300, 1), 2, 128, False),
    ((1, 300, 1000), (1, 300, 1000), 2, 128, True),
    ((1, 300, 1000), (700, 129, 1000), 2, 64, True),
    ((300, 1, 1000), (1000, 300, 1), 1, 64, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens_q,lens_k,h,d,causal", PACKED_CASES)
@pytest.mark.parametrize("give_max", [True, False])
def test_packed_matches_reference(torch, lens_q, lens_k, h, d, causal, give_max):
    qn, kn, vn, cu_q, cu_k = packed_qkv(lens_q, lens_k, h, d, seed=sum(lens_q) + d)
    q, k, v = cuda(torch, qn, kn, vn)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    extra = dict(max_seqlen_q=max(lens_q) + 100, max_seqlen_k=max(lens_k) + 1) if give_max else {}   # bounds
    out, lse = open_vc_attn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal, return_lse=True,
                                      **extra)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    want, want_lse = ref.attention(qn, kn, vn, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, return_lse=True)
    want_lse = packed_lse(want_lse, cu_q, h)
    fast = True   # both head dims run on the fast path (packed mode)
    expect_matches_reference(out, lse, want, want_lse, fast)
    exact, exact_lse = ref.attention_exact(qn, kn, vn, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal,
                                           return_lse=True)
    assert rel_l2(out.float().cpu().numpy(), exact) <= 1.1 * rel_l2(want, exact) + (1e-3 if fast else 1e-4)
    expect_lse_close_to_exact(lse, want_lse, packed_lse(exact_lse, cu_q, h), fast)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_general_op_matches_reference(torch, d, causal):
    """The general path (open_vc_attn::attention_fp8 with path="general", what attention() takes only past the
    fast path's range) on batched and packed preparations of both head dims, against the reference arithmetic."""
    from open_vc_attn import ops
    qn, kn, vn = batched_qkv(2, 300, 700, 2, d, seed=5 + d)
    p = open_vc_attn.prepare_fp8(*cuda(torch, qn, kn, vn))
    out, lse = ops.attention_fp8_op(*p.tensors(), None, None, 0, 0, 0.0, causal, 4, True, path="general")
    want, want_lse = ref.attention(qn, kn, vn, causal=causal, return_lse=True)
    expect_matches_reference(out, lse, want, want_lse, False)
    qn, kn, vn, cu_q, cu_k = packed_qkv((1, 300, 1000), (700, 129, 1000), 2, d, seed=6 + d)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    p = open_vc_attn.prepare_fp8(*cuda(torch, qn, kn, vn), cq, ck, 1000, 1000)
    out, lse = ops.attention_fp8_op(*p.tensors(), cq, ck, 1000, 1000, 0.0, causal, 4, True, path="general")
    want, want_lse = ref.attention(qn, kn, vn, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, return_lse=True)
    expect_matches_reference(out, lse, want, packed_lse(want_lse, cu_q, 2), False)


@pytest.mark.gpu
def test_packed_sequences_are_independent(torch):
    """Each packed sequence is quantized and attended on its own: bit-identical to attending it alone."""
    lens_q, lens_k = (1, 300, 1000), (1000, 300, 5)
    qn, kn, vn, cu_q, cu_k = packed_qkv(lens_q, lens_k, 2, 128, seed=5)
    q, k, v = cuda(torch, qn, kn, vn)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    out, lse = open_vc_attn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=1000,
                                      max_seqlen_k=1000, causal=True, return_lse=True)
    for s in range(3):
        sl_q, sl_k = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        o, l = open_vc_attn.attention(q[sl_q], k[sl_k], v[sl_k], causal=True, return_lse=True)
        assert torch.equal(out[sl_q], o) and torch.equal(lse[:, sl_q], l)


@pytest.mark.gpu
def test_float16_scale_and_attention_fp8_general(torch):
    """float16 inputs, an explicit scale; attention_fp8 takes causal and D = 64 preparations too (the fast
    path's head-dim-64 mode)."""
    qn, kn, vn = batched_qkv(2, 300, 700, 2, 64, seed=3)
    qn, kn, vn = (x.astype(np.float16) for x in (qn, kn, vn))
    q, k, v = cuda(torch, qn, kn, vn, dtype=torch.float16)
    out, lse = open_vc_attn.attention(q, k, v, softmax_scale=0.07, causal=True, return_lse=True)
    want, want_lse = ref.attention(qn, kn, vn, softmax_scale=0.07, causal=True, return_lse=True)
    expect_matches_reference(out, lse, want, want_lse, True)
    p = open_vc_attn.prepare_fp8(q, k, v)
    o2, l2 = open_vc_attn.attention_fp8(p, softmax_scale=0.07, causal=True, return_lse=True)
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    assert torch.equal(open_vc_attn.attention_fp8(p), open_vc_attn.attention(q, k, v))   # D = 64, non-causal
    o3 = open_vc_attn.attention(q[0], k[0], v[0], causal=True)                              # rank 3
    assert o3.shape == (300, 2, 64) and torch.equal(o3, open_vc_attn.attention(q[:1], k[:1], v[:1], causal=True)[0])


@pytest.mark.gpu
def test_fast_path_unchanged(torch):
    """D = 128, non-causal, batched still runs the sm_90a kernel: the same bytes as attention_fp8."""
    qn, kn, vn = batched_qkv(1, 500, 500, 2, 128, seed=1)
    q, k, v = cuda(torch, qn, kn, vn)
    assert torch.equal(open_vc_attn.attention(q, k, v), open_vc_attn.attention_fp8(open_vc_attn.prepare_fp8(q, k, v)))


# ---- GPU: the BF16 SDPA baseline ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,causal", [(500, 500, False), (500, 500, True), (300, 700, True), (700, 300, True)])
def test_reference_version_is_bf16_sdpa(torch, sq, sk, causal):
    qn, kn, vn = batched_qkv(2, sq, sk, 2, 64, seed=sq + sk)
    q, k, v = cuda(torch, qn, kn, vn)
    out, lse = open_vc_attn.attention(q, k, v, causal=causal, return_lse=True, version="reference", mode="bf16")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 2, sq)
    exact, exact_lse = ref.attention_exact(qn, kn, vn, causal=causal, return_lse=True)
    assert rel_l2(out.float().cpu().numpy(), exact) <= 1.5e-2   # BF16 attention
    fin = np.isfinite(exact_lse)
    g = lse.cpu().numpy()
    assert np.array_equal(np.isneginf(g), ~fin) and np.abs(g[fin] - exact_lse[fin]).max() <= 1e-2
    assert torch.isfinite(out).all()
    if not causal:
        want = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                                scale=64 ** -0.5)
        assert torch.equal(out, want.transpose(1, 2).contiguous())


@pytest.mark.gpu
def test_reference_version_packed(torch):
    lens_q, lens_k = (1, 300, 700), (700, 300, 1)
    qn, kn, vn, cu_q, cu_k = packed_qkv(lens_q, lens_k, 2, 128, seed=9)
    q, k, v = cuda(torch, qn, kn, vn)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    out, lse = open_vc_attn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, return_lse=True,
                                      version="reference", mode="bf16")
    exact, exact_lse = ref.attention_exact(qn, kn, vn, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                           return_lse=True)
    assert rel_l2(out.float().cpu().numpy(), exact) <= 1.5e-2
    e = packed_lse(exact_lse, cu_q, 2)
    fin = np.isfinite(e)
    assert np.abs(lse.cpu().numpy()[fin] - e[fin]).max() <= 2e-2


# ---- GPU: errors that need CUDA tensors ----------------------------------------------------------------------

@pytest.mark.gpu
def test_errors_on_gpu(torch):
    qn, kn, vn, cu_q, cu_k = packed_qkv((10, 20), (10, 20), 2, 64, seed=2)
    q, k, v = cuda(torch, qn, kn, vn)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    with pytest.raises(ValueError, match="^cu_seqlens_k: expected a CUDA tensor on q's device"):
        open_vc_attn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck.cpu(), max_seqlen_q=20, max_seqlen_k=20)
    with pytest.raises(ValueError, match="^k: expected a CUDA tensor, got device cpu"):
        open_vc_attn.attention(q, k.cpu(), v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=20, max_seqlen_k=20)
    # A packed preparation is attended like the one-call form (head_dim 64: the fast path's packed mode).
    prepared = open_vc_attn.prepare_fp8(q, k, v, cq, ck, 20, 20)
    want = open_vc_attn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=20, max_seqlen_k=20,
                                  causal=True)
    assert torch.equal(open_vc_attn.attention_fp8(prepared, causal=True), want)


# ---- GPU: torch.library, torch.compile, CUDA graphs, streams, synchronization ----------------------------------

@pytest.mark.gpu
def test_opcheck_general(torch):
    qn, kn, vn = batched_qkv(1, 130, 200, 2, 64, seed=8)
    p = open_vc_attn.prepare_fp8(*cuda(torch, qn, kn, vn))
    op, general = torch.ops.open_vc_attn.attention_fp8.default, dict(path="general")
    for scalars in ((0.0, True, 4, True), (0.1, False, -1, False)):
        torch.library.opcheck(op, (*p.tensors(), None, None, 0, 0, *scalars), general)
    qn, kn, vn, cu_q, cu_k = packed_qkv((1, 129, 60), (70, 1, 200), 2, 128, seed=4)
    q, k, v = cuda(torch, qn, kn, vn)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    torch.library.opcheck(torch.ops.open_vc_attn.prepare_fp8.default, (q, k, v, cq, ck, 129, 200, None))
    pv = open_vc_attn.prepare_fp8(q, k, v, cq, ck, 129, 200)
    for scalars in ((0.0, True, 4, True), (0.2, False, -1, False)):
        torch.library.opcheck(op, (*pv.tensors(), cq, ck, 129, 200, *scalars), general)


@pytest.mark.gpu
def test_torch_compile_fullgraph(torch):
    class Attn(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.kwargs = kwargs

        def forward(self, q, k, v, *extra):
            kw = dict(self.kwargs)
            if extra:
                kw.update(cu_seqlens_q=extra[0], cu_seqlens_k=extra[1])
            return open_vc_attn.attention(q, k, v, **kw)

    qb, kb, vb = cuda(torch, *batched_qkv(2, 300, 700, 2, 64, seed=6))
    qn, kn, vn, cu_q, cu_k = packed_qkv((1, 300, 700), (700, 300, 1), 2, 128, seed=7)
    qp, kp, vp = cuda(torch, qn, kn, vn)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    runs = [(Attn(causal=True, return_lse=True), (qb, kb, vb)),
            (Attn(causal=True, mid_window_blocks=None, softmax_scale=0.1), (qb[0], kb[0], vb[0])),
            (Attn(max_seqlen_q=700, max_seqlen_k=700, causal=True, return_lse=True), (qp, kp, vp, cq, ck)),
            (Attn(causal=True, version="reference", mode="bf16"), (qb, kb, vb))]
    for module, args in runs:
        eager = module(*args)
        compiled = torch.compile(module, fullgraph=True)(*args)
        eager, compiled = ((x,) if torch.is_tensor(x) else x for x in (eager, compiled))
        for e, c in zip(eager, compiled):
            assert c.shape == e.shape and c.dtype == e.dtype
            if module.kwargs.get("version") == "reference":
                torch.testing.assert_close(c, e)   # compiled SDPA may pick another kernel
            else:
                assert torch.equal(c, e)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_inputs(torch):
    """A captured graph of the general path replays with new q, k, v values and new offsets (same sequence
    count, lengths within the max_seqlen bounds given at capture)."""
    lens = [((1, 300, 700), (700, 300, 1)), ((200, 100, 701), (5, 696, 300))]   # same totals
    inputs = []
    for i, (lq, lk) in enumerate(lens):
        qn, kn, vn, cu_q, cu_k = packed_qkv(lq, lk, 2, 64, seed=20 + i)
        inputs.append((*cuda(torch, qn, kn, vn), *(torch.from_numpy(c).cuda() for c in (cu_q, cu_k))))
    static = [x.clone() for x in inputs[0]]
    opts = dict(max_seqlen_q=1000, max_seqlen_k=1000, causal=True, return_lse=True)
    call = lambda s: open_vc_attn.attention(s[0], s[1], s[2], cu_seqlens_q=s[3], cu_seqlens_k=s[4], **opts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(static)   # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call(static)
    for new in (inputs[1], inputs[0]):
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = call(new)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # Batched causal, D = 128.
    q1, k1, v1 = cuda(torch, *batched_qkv(1, 500, 500, 2, 128, seed=30))
    q2, k2, v2 = cuda(torch, *batched_qkv(1, 500, 500, 2, 128, seed=31))
    sq_, sk_, sv_ = q1.clone(), k1.clone(), v1.clone()
    open_vc_attn.attention(sq_, sk_, sv_, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = open_vc_attn.attention(sq_, sk_, sv_, causal=True)
    sq_.copy_(q2), sk_.copy_(k2), sv_.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, open_vc_attn.attention(q2, k2, v2, causal=True))


@pytest.mark.gpu
def test_non_default_stream(torch):
    q, k, v = cuda(torch, *batched_qkv(2, 1000, 1000, 2, 64, seed=12))
    want = open_vc_attn.attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = open_vc_attn.attention(q, k, v, causal=True)
        p = open_vc_attn.prepare_fp8(q, k, v)
        out2 = open_vc_attn.attention_fp8(p, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(out2, want)


@pytest.mark.gpu
def test_no_host_synchronization(torch):
    """Sees torch's synchronizing calls only; those inside libopenvc: test_gpu_capture.py (global capture)."""
    qb, kb, vb = cuda(torch, *batched_qkv(1, 500, 500, 2, 64, seed=13))
    qn, kn, vn, cu_q, cu_k = packed_qkv((1, 300, 700), (700, 300, 1), 2, 128, seed=14)
    qp, kp, vp = cuda(torch, qn, kn, vn)
    cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
    packed = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=700, max_seqlen_k=700, return_lse=True)
    open_vc_attn.attention(qb, kb, vb, causal=True)            # first calls outside the check
    open_vc_attn.attention(qp, kp, vp, **packed)
    torch.cuda.set_sync_debug_mode("error")   # any synchronizing torch call now raises
    try:
        open_vc_attn.attention(qb, kb, vb, causal=True, return_lse=True)
        open_vc_attn.attention(qp, kp, vp, causal=True, **packed)
    finally:
        torch.cuda.set_sync_debug_mode(0)
