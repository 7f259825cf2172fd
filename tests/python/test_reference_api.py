"""open_vc_attn.reference end to end: shapes, dtypes, argument errors, and agreement with a plain numpy
float64 softmax attention written here (independent of the C++ oracle)."""
import math
import subprocess
import sys

import numpy as np
import pytest

from open_vc_attn import _ext, reference as ref


def np_attention(q, k, v, scale=None, causal=False):
    """Float64 softmax attention over [B, S, H, D]; causal aligns the last query with the last key."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq), -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(axis=-1, keepdims=True)))[..., 0]          # [B, H, Sq]
    out = np.einsum("bhqk,bkhd->bqhd", p / p.sum(axis=-1, keepdims=True), v)
    return out, lse


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bf16_inputs(shape, seed=0, v_outliers=False):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    if v_outliers:
        v[:, 7] *= 60.0
        v[:, 100] *= 40.0
    return tuple(ref.to_bfloat16_values(x) for x in (q, k, v))


@pytest.fixture(scope="module")
def qkv():
    return bf16_inputs((2, 300, 2, 64))   # 300 tokens: two full 128-blocks and a partial one


# ---- package --------------------------------------------------------------------------------------

def test_import_is_lazy_and_torch_free():
    code = ("import sys, open_vc_attn as p; p.reference; p.video_inputs; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "p.attention; assert 'torch' not in sys.modules, 'torch imported by the GPU API'; "
            "print(p.__version__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0.1.0"


# ---- element-wise pieces ----------------------------------------------------------------------------

def test_e4m3_known_values():
    x = np.array([0.0, 1.0, -1.0, 448.0, 1000.0, -1000.0, 2.0 ** -9, 2.0 ** -10, 1.0625, np.nan], np.float32)
    want = [0x00, 0x38, 0xB8, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x38, 0x7F]   # 1.0625 ties to even -> 1.0
    codes = ref.e4m3_encode(x)
    assert codes.dtype == np.uint8 and codes.tolist() == want
    assert ref.e4m3_decode(np.array([0x38, 0x7E, 0x01, 0x78])).tolist() == [1.0, 448.0, 2.0 ** -9, 256.0]
    assert np.isnan(ref.e4m3_decode(np.array([0x7F, 0xFF]))).all()


def test_e4m3_roundtrip_all_codes_keeps_shape():
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    values = ref.e4m3_decode(codes)
    assert values.shape == (16, 16) and values.dtype == np.float32
    finite = ~np.isnan(values)
    back = ref.e4m3_encode(values)
    # -0 (0x80) encodes back to 0x80; every finite code reproduces itself.
    assert np.array_equal(back[finite], codes[finite])


def test_to_bfloat16_values_rounding():
    one = 1.0
    x = np.array([one + 2 ** -8, one + 3 * 2 ** -8, one + 2 ** -8 + 2 ** -20, -(one + 2 ** -8)], np.float32)
    assert ref.to_bfloat16_values(x).tolist() == [1.0, 1.0 + 2 ** -6, 1.0 + 2 ** -7, -1.0]
    # float64 just above a bf16 tie: rounding via float32 first would tie to even (1.0); this must not.
    assert ref.to_bfloat16_values(np.array([1.0 + 2 ** -8 + 2 ** -40]))[0] == 1.0 + 2 ** -7
    assert ref.to_bfloat16_values(np.array([3.4e38], np.float32))[0] == np.inf
    assert np.isnan(ref.to_bfloat16_values(np.array([np.nan], np.float32))[0])
    # Agreement with the C++ reference's round_to_bf16 on many values.
    rng = np.random.default_rng(3)
    y = (rng.standard_normal(20000) * np.exp2(rng.integers(-30, 30, 20000))).astype(np.float32)
    assert np.array_equal(ref.to_bfloat16_values(y), np.asarray(_ext.load().round_to_bf16(y)))
    assert (ref.to_bfloat16_values(y).view(np.uint32) & 0xFFFF == 0).all()


def test_expcast_code_formula_and_broadcast():
    a = ref.expcast_multiplier(1 / 8, 0.01, 0.02)
    assert a == np.float32(np.float32(np.float32(np.float32(8 * 1.4426950408889634) * np.float32(1 / 8))
                                      * np.float32(0.01)) * np.float32(0.02))
    row_max = np.float32(10.0)
    acc = np.array([10.0, 2.0, -1000.0, np.nan], np.float32)
    codes = ref.expcast_code(acc, np.float32(1.0), row_max)
    # At the max: 119.65 rounds to 120; 8 code units lower (one octave): 111.65 -> 112; far below: 0.
    assert codes.tolist() == [120, 112, 0, 0]
    grid = ref.expcast_code(np.linspace(-20, 0, 5, dtype=np.float32)[:, None], np.float32(1.0),
                            np.zeros((1, 3), np.float32))
    assert grid.shape == (5, 3) and grid.dtype == np.uint8
    # Against the formula in numpy: rne(acc*a + 119.65 - max), clamped.
    rng = np.random.default_rng(0)
    acc = rng.uniform(-200, 200, 10000).astype(np.float32)
    x = acc.astype(np.float64) * 0.37 + (np.float32(119.65) - np.float32(150.0))
    want = np.clip(np.rint(x.astype(np.float32)), 0, 120)
    got = ref.expcast_code(acc, np.float32(0.37), np.float32(150.0)).astype(np.float64)
    assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 1e-3


def test_key_block_order_and_diagonal():
    assert ref.key_block_order(2, 10, 4) == [6, 5, 4, 3, 2, 1, 0, 7, 8, 9]
    assert ref.key_block_order(8, 10, 4) == list(range(9, -1, -1))
    assert ref.key_block_order(2, 10, None) == list(range(10))
    assert ref.key_block_order(3, 10, 0) == [3, 2, 1, 0, 4, 5, 6, 7, 8, 9]
    for diag in range(7):
        assert sorted(ref.key_block_order(diag, 7, 2)) == list(range(7))
    assert ref.diagonal_block(256, 1000, 1000) == 2
    assert ref.diagonal_block(256, 500, 1000) == 4


# ---- quantization -----------------------------------------------------------------------------------

def test_quantize_blocks_scales_and_codes(qkv):
    q = qkv[0]
    res = ref.quantize_blocks(q)
    assert res.codes.shape == q.shape and res.codes.dtype == np.uint8
    assert res.descale.shape == (2, 2, 3) and res.descale.dtype == np.float32
    block = q[1, 128:256, 1]                       # batch 1, head 1, block 1
    amax = np.float32(np.abs(block).max())
    assert res.descale[1, 1, 1] == amax / np.float32(448.0)
    assert np.array_equal(res.codes[1, 128:256, 1], ref.e4m3_encode(block * (np.float32(448.0) / amax)))
    # Rank 3 keeps rank 3 and drops the batch axis of the scales.
    r3 = ref.quantize_blocks(q[0])
    assert r3.descale.shape == (2, 3) and np.array_equal(r3.codes, res.codes[0])
    # Dequantized values are within E4M3's half-ulp (1/16 relative, plus the block's subnormal floor).
    scale = res.descale[:, :, np.arange(300) // 128].transpose(0, 2, 1)[..., None]
    deq = ref.e4m3_decode(res.codes) * scale
    assert np.all(np.abs(deq - q) <= np.abs(q) / 16 + scale * 2.0 ** -9)


def test_quantize_heads(qkv):
    v = qkv[2]
    res = ref.quantize_heads(v)
    assert res.codes.shape == v.shape and res.descale.shape == (2, 2) and res.scale_inv.shape == (2, 2)
    amax = np.abs(v[0, :, 1]).max()
    assert res.descale[0, 1] == np.float32(amax) / np.float32(448.0)
    assert res.scale_inv[0, 1] == np.float32(448.0) / np.float32(amax)
    assert ref.quantize_heads(v[1]).descale.shape == (2,)


def test_select_v_repair_picks_largest_residuals():
    v = bf16_inputs((1, 384, 2, 64), seed=4, v_outliers=True)[2]
    rep = ref.select_v_repair(v, 0.05)
    n = round(0.05 * 384)
    assert rep["tokens_per_head"] == n and rep["count"].shape == (1, 2) and (rep["count"] == n).all()
    assert rep["codes"].shape == (2 * n, 64) and rep["codes"].dtype == np.uint8
    vq = ref.quantize_heads(v)
    resid = v[0, :, 0] - vq.descale[0, 0] * ref.e4m3_decode(vq.codes[0, :, 0])
    energy = (resid.astype(np.float64) ** 2).sum(axis=1)
    chosen = rep["tokens"][rep["offset"][0, 0]:rep["offset"][0, 0] + n]
    assert set(chosen.tolist()) == set(np.argsort(-energy, kind="stable")[:n].tolist())


# ---- attention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mid", [4, None])
def test_attention_matches_numpy_softmax(qkv, causal, mid):
    q, k, v = qkv
    want, want_lse = np_attention(q, k, v, causal=causal)
    out, lse = ref.attention(q, k, v, causal=causal, mid_window_blocks=mid, return_lse=True)
    assert out.shape == q.shape and out.dtype == np.float32
    assert lse.shape == (2, 2, 300)
    assert rel_l2(out, want) < 0.06
    # Rows with few keys (causal) see single-score FP8 errors undamped; the bulk is much tighter.
    assert np.abs(lse - want_lse).max() < 0.15 and np.abs(lse - want_lse).mean() < 0.02
    exact, exact_lse = ref.attention_exact(q, k, v, causal=causal, return_lse=True)
    assert exact.dtype == np.float64 and rel_l2(exact, want) < 1e-12
    assert np.abs(exact_lse - want_lse).max() < 1e-10


def test_wrong_sign_is_detected(qkv):
    """The comparison above can fail: a sign error in the scores is far outside its tolerance."""
    q, k, v = qkv
    out = ref.attention(q, k, v)
    wrong, _ = np_attention(q, k, v, scale=-1.0 / math.sqrt(64))
    assert rel_l2(out, wrong) > 0.5
    assert ref.error_metrics(out, wrong)["rel_l2"] > 0.5


def test_softmax_scale_and_float16_inputs(qkv):
    q, k, v = (x[:1].astype(np.float16) for x in qkv)
    want, _ = np_attention(q, k, v, scale=0.3)
    out = ref.attention(q, k, v, softmax_scale=0.3, query_tile=64)
    assert out.dtype == np.float32
    # Sharper scores amplify FP8 score errors a little; the default scale would be far off.
    assert rel_l2(out, want) < 0.1
    assert rel_l2(out, np_attention(q, k, v)[0]) > 0.3


def test_rank3_and_batch_agree(qkv):
    q, k, v = qkv
    out4, lse4 = ref.attention(q, k, v, return_lse=True)
    out3, lse3 = ref.attention(q[1], k[1], v[1], return_lse=True)
    assert out3.shape == (300, 2, 64) and lse3.shape == (2, 300)
    assert np.array_equal(out3, out4[1]) and np.array_equal(lse3, lse4[1])


def test_packed_sequences_equal_separate_calls():
    q, k, v = bf16_inputs((1, 500, 2, 64), seed=2)
    cu_q, cu_k = np.array([0, 200, 500]), np.array([0, 180, 500])
    out, lse = ref.attention(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert lse.shape == (2, 2, 300)
    for s in range(2):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        o, l = ref.attention(q[0, qs], k[0, ks], v[0, ks], return_lse=True)
        assert np.array_equal(out[qs], o)
        assert np.array_equal(lse[s, :, :o.shape[0]], l)


def test_repair_budget_reduces_error_with_v_outliers():
    q, k, v = bf16_inputs((1, 384, 2, 64), seed=1, v_outliers=True)
    exact = ref.attention_exact(q, k, v)
    plain = ref.error_metrics(ref.attention(q, k, v), exact)["rel_l2"]
    repaired = ref.error_metrics(ref.attention(q, k, v, repair_budget=0.02), exact)["rel_l2"]
    assert repaired < plain


def test_vc_baseline(qkv):
    q, k, v = qkv
    perm = ref.vc_grouping(v)
    assert perm.shape == (2, 2, 300) and perm.dtype == np.int32
    assert (np.sort(perm, axis=-1) == np.arange(300)).all()
    out = ref.attention_vc(q, k, v, perm)
    assert np.array_equal(out, ref.attention_vc(q, k, v))
    assert rel_l2(out, np_attention(q, k, v)[0]) < 0.06
    perm3 = ref.vc_grouping(v[1])
    assert perm3.shape == (2, 300) and np.array_equal(perm3, perm[1])
    assert np.array_equal(ref.attention_vc(q[1], k[1], v[1], perm3), out[1])
    with pytest.raises(ValueError, match="permutation"):
        ref.attention_vc(q, k, v, perm[:, :1])


def test_error_metrics():
    x = np.linspace(-1, 1, 100).reshape(10, 10)
    same = ref.error_metrics(x.astype(np.float32), x)
    assert same["rel_l2"] < 1e-7 and abs(same["cosine"] - 1) < 1e-7
    double = ref.error_metrics(2 * x, x)
    assert abs(double["rel_l2"] - 1) < 1e-7 and abs(double["max_abs"] - 1) < 1e-7
    with pytest.raises(ValueError, match="ref"):
        ref.error_metrics(x, x[:5])


# ---- argument errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("change, exc, words", [
    (dict(q=np.zeros((4, 64), np.float32)), ValueError, ["q", "rank"]),
    (dict(k=np.zeros((2, 300, 3, 64), np.float32)), ValueError, ["k", "heads"]),
    (dict(k=np.zeros((2, 300, 2, 32), np.float32)), ValueError, ["k", "head_dim"]),
    (dict(v=np.zeros((2, 299, 2, 64), np.float32)), ValueError, ["v", "shape"]),
    (dict(k=np.zeros((1, 300, 2, 64), np.float32), v=np.zeros((1, 300, 2, 64), np.float32)), ValueError,
     ["k", "batch"]),
    (dict(q=np.zeros((2, 300, 2, 64), np.float64)), TypeError, ["q", "float16"]),
    (dict(v=[[[0.0]]]), TypeError, ["v", "numpy"]),
    (dict(q=np.full((2, 300, 2, 64), np.nan, np.float32)), ValueError, ["q", "NaN"]),
    (dict(repair_budget=1.0), ValueError, ["repair_budget", "[0, 1)"]),
    (dict(repair_budget=float("nan")), ValueError, ["repair_budget"]),
    (dict(repair_budget="0.1"), TypeError, ["repair_budget"]),
    (dict(mid_window_blocks=-1), ValueError, ["mid_window_blocks", ">= 0"]),
    (dict(mid_window_blocks=True), TypeError, ["mid_window_blocks"]),
    (dict(mid_window_blocks=2.0), TypeError, ["mid_window_blocks"]),
    (dict(softmax_scale=-1.0), ValueError, ["softmax_scale"]),
    (dict(query_tile=0), ValueError, ["query_tile"]),
    (dict(causal=1), TypeError, ["causal"]),
    (dict(cu_seqlens_q=[0, 300]), ValueError, ["cu_seqlens_q", "cu_seqlens_k"]),
])
def test_attention_argument_errors(qkv, change, exc, words):
    args = dict(q=qkv[0], k=qkv[1], v=qkv[2])
    kwargs = {key: val for key, val in change.items() if key not in args}
    args.update({key: val for key, val in change.items() if key in args})
    with pytest.raises(exc) as info:
        ref.attention(args["q"], args["k"], args["v"], **kwargs)
    for word in words:
        assert word in str(info.value)


def test_packed_argument_errors(qkv):
    q = qkv[0][0]
    with pytest.raises(ValueError, match="cu_seqlens_q.*rank 3"):
        ref.attention(qkv[0], qkv[1], qkv[2], cu_seqlens_q=[0, 300], cu_seqlens_k=[0, 300])
    with pytest.raises(ValueError, match="cu_seqlens_k: expected non-decreasing"):
        ref.attention(q, q, q, cu_seqlens_q=[0, 100, 300], cu_seqlens_k=[0, 200, 100])
    with pytest.raises(ValueError, match="cu_seqlens_k: expected 2 sequences"):
        ref.attention(q, q, q, cu_seqlens_q=[0, 100, 300], cu_seqlens_k=[0, 300])
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing offsets from 0 to the token count 300"):
        ref.attention(q, q, q, cu_seqlens_q=[0, 100, 299], cu_seqlens_k=[0, 100, 300])


def test_small_function_errors():
    with pytest.raises(ValueError, match="diag"):
        ref.key_block_order(10, 10, 4)
    with pytest.raises(TypeError, match="n"):
        ref.key_block_order(0, 3.0, 4)
    with pytest.raises(TypeError, match="codes"):
        ref.e4m3_decode(np.array([1.0]))
    with pytest.raises(ValueError, match="codes"):
        ref.e4m3_decode(np.array([256]))
    with pytest.raises(ValueError, match="budget"):
        ref.select_v_repair(np.zeros((4, 1, 8), np.float32), 1.5)
    with pytest.raises(ValueError, match="acc, a, row_max"):
        ref.expcast_code(np.zeros(3), np.zeros(2), 0.0)


def test_cpp_status_becomes_value_error(qkv):
    """Checks the C++ side's own validation through the raw extension (Status -> ValueError)."""
    ext = _ext.load()
    q = qkv[0]
    with pytest.raises(ValueError, match="key_tile"):
        ext.attention_expcast(q, q, q, key_tile=64)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ext.quantize_blocks(q[0], [0, 310, 300])
