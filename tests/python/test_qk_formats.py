"""CPU tests of the Q/K format study (open_vc_attn.bench.qk_formats): numpy only; the comparison with
the reference's E4M3 quantization runs where the compiled extension loads."""
import math

import numpy as np
import pytest

from open_vc_attn.bench import qk_formats as qf


def _all_e4m3_values():
    """(codes 0..126, their float32 values): every non-negative finite E4M3 FN code."""
    c = np.arange(127)
    e, m = c >> 3, c & 7
    vals = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * np.exp2(e - 7.0))
    return c.astype(np.uint8), vals.astype(np.float32)


def _reference_or_skip():
    from open_vc_attn import _ext, reference
    try:
        _ext.load()
    except ImportError as exc:
        pytest.skip(f"compiled extension not available: {str(exc)[:80]}")
    return reference


@pytest.mark.parametrize("group", [1, 64, 128])
def test_int8_round_trip_within_half_a_step(group):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 32)) * np.exp2(rng.uniform(-8, 8, size=(300, 1)))
    x[7] *= 300.0                                   # a sink-like outlier token
    q, scale = qf.quantize_int8(x, group)
    assert q.dtype == np.int8 and np.abs(q.astype(int)).max() <= 127
    step = np.repeat(scale, group)[:300, None]
    err = np.abs(x - q.astype(np.float64) * step)
    assert np.all(err <= step / 2 * (1 + 1e-12))
    # The group's amax maps to +-127 exactly.
    first = np.abs(x[:group]).argmax()
    assert abs(int(q[:group].ravel()[first])) == 127


def test_int8_zero_group_codes_zero():
    q, scale = qf.quantize_int8(np.zeros((130, 8)), 128)
    assert not q.any() and not scale.any()


def test_k_smoothing_leaves_exact_attention_unchanged():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((200, 16)) * 2
    k = rng.standard_normal((150, 16)) * 2 + rng.standard_normal(16) * 5   # a channel bias to remove
    v = rng.standard_normal((150, 16))
    ks = qf.smooth_k(k)
    assert ks.dtype == np.float64 and np.abs(ks.mean(axis=0)).max() < 1e-12
    scale = 1 / math.sqrt(16)
    a = qf.attention_fp64(q, k, [v], scale)[0]
    b = qf.attention_fp64(q, ks, [v], scale)[0]
    assert np.abs(a - b).max() < 1e-12


def test_e4m3_round_every_code_and_ties_to_even():
    codes, vals = _all_e4m3_values()
    assert np.array_equal(qf.e4m3_round(vals), vals)
    assert np.array_equal(qf.e4m3_codes(vals), codes)
    assert np.array_equal(qf.e4m3_codes(-vals), codes | 0x80)
    mid = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)   # exact in float32
    even = np.where(codes[:-1] % 2 == 0, vals[:-1], vals[1:])
    assert np.array_equal(qf.e4m3_round(mid), even)
    assert qf.e4m3_round(np.float32([500.0, -1e30]))[0] == 448 and qf.e4m3_round(np.float32([-1e30]))[0] == -448


def test_e4m3_encode_matches_reference_bit_for_bit():
    reference = _reference_or_skip()
    rng = np.random.default_rng(2)
    y = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-14, 9, 200_000))).astype(np.float32)
    _, vals = _all_e4m3_values()
    mid = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    y = np.concatenate([y, mid, -mid, np.float32([0.0, -0.0, 448.0, 460.0, 470.0, 1e6])])
    assert np.array_equal(qf.e4m3_codes(qf.e4m3_round(y)), reference.e4m3_encode(y))


def test_e4m3_block_quantization_matches_reference_codes():
    reference = _reference_or_skip()
    rng = np.random.default_rng(3)
    x = reference.to_bfloat16_values(rng.standard_normal((300, 3, 64)).astype(np.float32) * 3)
    x[5, 1] *= 300.0
    x[200:, 2] = 0.0                                 # an all-zero block
    ref = reference.quantize_blocks(x)               # codes [S, H, D], descale [H, nblocks]
    for h in range(3):
        vals, descale = qf.quantize_e4m3(x[:, h], qf.QUANT_BLOCK)
        assert np.array_equal(qf.e4m3_codes(vals), ref.codes[:, h])
        assert np.array_equal(descale, ref.descale[h])
