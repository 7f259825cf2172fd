"""open_vc_attn.video_inputs: determinism, shapes, and the planted structure (RMS norm, 3D RoPE, head
kinds, sinks, V outliers)."""
import math

import numpy as np
import pytest

from open_vc_attn import video_inputs as vi
from open_vc_attn.reference import to_bfloat16_values


@pytest.fixture(scope="module")
def smoke():
    return vi.from_preset("smoke")


def softmax_rows(q, k):
    s = q.astype(np.float64) @ k.astype(np.float64).T / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True), s


def test_presets():
    assert {"smoke", "video", "wan480", "wan720"} <= set(vi.PRESETS)
    assert 1000 <= vi.preset_seqlen("smoke") <= 2000
    assert vi.preset_seqlen("video") == 73_397
    assert vi.preset_seqlen("wan480") == 21 * 30 * 52 == 32_760
    assert vi.preset_seqlen("wan720") == 21 * 45 * 80 == 75_600
    assert vi.PRESETS["wan480"]["heads"] == 40
    p = vi.PRESETS["video"]
    assert p["frames"] * p["height"] * p["width"] >= p["seqlen"]


def test_shapes_dtypes_and_bf16_values(smoke):
    assert smoke.q.shape == smoke.k.shape == smoke.v.shape == (1, 1200, 2, 128)
    assert smoke.q.dtype == np.float32 and smoke.seqlen == 1200 and smoke.grid == (5, 12, 20)
    for x in (smoke.q, smoke.k, smoke.v):
        assert np.array_equal(to_bfloat16_values(x), x) and np.isfinite(x).all()
    f16 = vi.generate(frames=2, height=4, width=8, heads=3, head_dim=64, batch=2, dtype="float16")
    assert f16.q.dtype == np.float16 and f16.q.shape == (2, 64, 3, 64)


def test_deterministic_by_seed():
    a = vi.generate(frames=2, height=6, width=8, heads=3, batch=2, seed=5)
    b = vi.generate(frames=2, height=6, width=8, heads=3, batch=2, seed=5)
    c = vi.generate(frames=2, height=6, width=8, heads=3, batch=2, seed=6)
    for name in ("q", "k", "v"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes()
        assert getattr(a, name).tobytes() != getattr(c, name).tobytes()
    assert np.array_equal(a.sink_tokens, b.sink_tokens) and a.head_kinds == b.head_kinds
    # Batch entries differ (own noise), heads differ.
    assert not np.array_equal(a.q[0], a.q[1]) and not np.array_equal(a.q[0, :, 0], a.q[0, :, 1])


def test_seqlen_truncates_the_grid_and_errors():
    x = vi.generate(frames=2, height=4, width=8, seqlen=50, heads=1)
    assert x.q.shape == (1, 50, 1, 128) and x.grid == (2, 4, 8)
    with pytest.raises(ValueError, match="seqlen"):
        vi.generate(frames=2, height=4, width=8, seqlen=65)
    with pytest.raises(ValueError, match="dtype"):
        vi.generate(frames=1, height=2, width=2, dtype="float32")
    with pytest.raises(ValueError, match="name"):
        vi.from_preset("nope")
    with pytest.raises(ValueError, match="head_dim"):
        vi.generate(frames=1, height=2, width=2, head_dim=63)


def test_q_and_k_are_rms_normalized(smoke):
    q = smoke.q[0].astype(np.float64)
    assert np.allclose(np.sqrt((q ** 2).mean(axis=-1)), 1.0, atol=0.01)
    k = smoke.k[0].astype(np.float64) - smoke.k_bias[None]      # bias added after normalization
    rms = np.sqrt((k ** 2).mean(axis=-1))
    ordinary = np.setdiff1d(np.arange(smoke.seqlen), smoke.sink_tokens[0])
    assert np.allclose(rms[ordinary], 1.0, atol=0.02)
    assert np.allclose(rms[smoke.sink_tokens[0]], 1.5, atol=0.03)    # sink_scale default


def test_rope_split_and_rotation():
    assert vi.rope_split(128) == (44, 42, 42)
    for d in (64, 96, 130):
        split = vi.rope_split(d)
        assert sum(split) == d and all(n % 2 == 0 for n in split)
    with pytest.raises(ValueError, match="head_dim"):
        vi.rope_split(127)
    t, y, x = vi.token_positions(3, 4, 5)
    assert (t * 20 + y * 5 + x == np.arange(60)).all()        # frame-major flattening
    ang = vi.rope_angles(t, y, x, 128)
    const = np.tile(np.random.default_rng(0).standard_normal(128).astype(np.float32), (60, 1))
    rot = vi.apply_rope(const, ang)
    assert np.allclose(np.linalg.norm(rot, axis=1), np.linalg.norm(const, axis=1), rtol=1e-5)
    # Channels 0..43 move with t only, 44..85 with y only, 86..127 with x only.
    for sl, pos in ((slice(0, 44), t), (slice(44, 86), y), (slice(86, 128), x)):
        for p in np.unique(pos):
            assert np.allclose(rot[pos == p, sl], rot[pos == p, sl][0], atol=1e-5)
        assert not np.allclose(rot[pos == 0, sl][0], rot[pos == 1, sl][0])
    # Relative position property: <R(p) a, R(p') b> depends on p - p' only.
    a, b = (np.random.default_rng(s).standard_normal((1, 128)).astype(np.float32) for s in (1, 2))
    def dot(i, j):
        return (vi.apply_rope(a, ang[i:i + 1]) @ vi.apply_rope(b, ang[j:j + 1]).T).item()
    assert abs(dot(1 + 26, 1) - dot(2 + 26, 2)) < 1e-3          # same (dt, dy, dx) = (1, 1, 1)


def test_generated_q_k_carry_rope_and_head_kinds():
    """Without noise or a shared direction, un-rotating Q leaves pure content: temporal heads' content is
    the same within a frame, spatial heads' the same at one (y, x) in every frame."""
    x = vi.generate(frames=3, height=4, width=6, heads=4, qk_noise=0.0, q_shared=0.0, num_sink_tokens=0)
    t, y, xx = vi.token_positions(3, 4, 6)
    unrot = lambda h: vi.apply_rope(x.q[0, :, h], -vi.rope_angles(t, y, xx, 128))
    assert sorted(set(x.head_kinds)) == ["spatial", "temporal"]
    for h, kind in enumerate(x.head_kinds):
        c = unrot(h)
        key = t if kind == "temporal" else y * 6 + xx
        for g in np.unique(key):
            assert np.allclose(c[key == g], c[key == g][0], atol=0.02)
        assert not np.allclose(c[key == 0][0], c[key == 1][0], atol=0.02)   # and differs between groups


def test_attention_patterns_of_head_kinds():
    x = vi.from_preset("smoke", num_sink_tokens=0)
    t, y, xx = vi.token_positions(*x.grid)
    same_frame = t[:, None] == t[None, :]
    near_yx = (np.abs(y[:, None] - y[None, :]) <= 1) & (np.abs(xx[:, None] - xx[None, :]) <= 1)
    for h, kind in enumerate(x.head_kinds):
        p, _ = softmax_rows(x.q[0, :, h], x.k[0, :, h])
        frame_mass, near_mass = (p * same_frame).sum(1).mean(), (p * near_yx).sum(1).mean()
        if kind == "temporal":     # content follows t: mass stays in the query's frame
            assert frame_mass > 3 * same_frame.mean()
        else:                      # content follows (y, x): mass near the query's spatial position
            assert near_mass > 5 * near_yx.mean()


def test_sink_tokens_attract_most_queries(smoke):
    sinks = smoke.sink_tokens[0]
    assert len(sinks) == 4
    for h in range(smoke.q.shape[2]):
        k = smoke.k[0, :, h]
        assert np.linalg.norm(k[sinks], axis=1).min() > 1.2 * np.median(np.linalg.norm(k, axis=1))
        p, s = softmax_rows(smoke.q[0, :, h], k)
        top = s[:, sinks].max(axis=1) >= np.quantile(s, 0.99, axis=1)
        assert top.mean() > 0.4                     # a sink is in the top 1% of many rows
        assert p[:, sinks].sum(1).mean() > 20 * 4 / smoke.seqlen   # far above 4 average keys


def test_v_outliers_present(smoke):
    out = smoke.v_outlier_tokens[0]
    assert len(out) >= 1
    norms = np.linalg.norm(smoke.v[0].astype(np.float64), axis=-1)       # [S, H]
    assert (norms[out] > 8 * np.median(norms, axis=0)).all()
    assert not set(out) & set(smoke.sink_tokens[0])
    none = vi.generate(frames=2, height=4, width=8, v_outlier_fraction=0.0)
    assert none.v_outlier_tokens.shape == (1, 0)


def test_video_preset_one_head_is_feasible():
    x = vi.from_preset("video", heads=1)
    assert x.q.shape == (1, 73_397, 1, 128) and x.k.dtype == np.float32
