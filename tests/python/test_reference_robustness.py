"""The CPU reference (the tests' oracle) on the inputs of docs/numerics.md "Non-finite and extreme
inputs": huge score spreads and tiny groups give finite outputs with bounded error against exact float64
attention, and a NaN or Inf stays in the (batch, head) that holds it. No GPU and no torch needed."""
import numpy as np
import pytest

from open_vc_attn import reference as ref


def qkv(seed, b=2, s=300, h=3, d=64):
    rng = np.random.default_rng(seed)
    return [ref.to_bfloat16_values(rng.normal(size=(b, s, h, d)).astype(np.float32)) for _ in range(3)]


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("case", ["q_k_1e4", "scale_1e7"])
def test_huge_score_spreads_are_finite_and_bounded(case):
    q, k, v = qkv(1)
    kw = {}
    if case == "q_k_1e4":
        q, k = ref.to_bfloat16_values(q * 1e4), ref.to_bfloat16_values(k * 1e4)
    else:
        kw["softmax_scale"] = 1e7
    out = ref.attention(q, k, v, **kw)
    exact = ref.attention_exact(q, k, v, **kw)
    assert np.isfinite(out).all()
    assert np.abs(out).max() <= 1.0001 * np.abs(v).max()   # a convex combination of V rows
    # Nearly one-hot rows: FP8 Q/K may pick a neighbouring key, so the error is bounded by the spread of V
    # rather than small; it must stay far from garbage.
    assert rel_l2(out, exact) < 1.0, rel_l2(out, exact)


def test_tiny_groups_are_zeros_and_close_to_exact():
    q, k, v = (ref.to_bfloat16_values(x * 1e-38) for x in qkv(2))
    out = ref.attention(q, k, v)
    exact = ref.attention_exact(q, k, v)
    assert np.isfinite(out).all() and np.abs(out - exact).max() <= 1e-36


def test_non_finite_inputs_are_rejected_with_the_argument_named():
    """The Python reference refuses non-finite inputs (its C++ core keeps a NaN or Inf in its
    (sequence, head): tests/cpp/reference/test_attention.cc)."""
    q, k, v = qkv(3)
    q[1, 150, 2, 5] = np.nan
    with pytest.raises(ValueError, match="^q: contains NaN or infinity"):
        ref.attention(q, k, v)
