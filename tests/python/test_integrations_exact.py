"""open_vc_attn.integrations._exact.attention_with_lse: the exact fallback (with LSE) of the diffusers
context-parallel path and of the yunchang processor. CPU, needs torch only; checked against float64 torch
arithmetic written out here (scores, logsumexp, softmax) and against torch SDPA."""
import math

import pytest


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def exact(torch):
    from open_vc_attn.integrations import _exact
    return _exact


def rand(torch, *shape, seed=0, dtype=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype or torch.bfloat16)


def reference(torch, q, k, v, scale, bias):
    """float64: scores [B, H, Sq, Sk] (+ bias), lse, softmax @ v -> out [B, Sq, H, D]."""
    h, hk = q.shape[2], k.shape[2]
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = (x.repeat_interleave(h // hk, dim=1) for x in (kd, vd))
    s = qd @ kd.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2), lse


def close(a, b, tol):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) < tol


def test_plain_and_sdpa(torch, exact):
    q, k, v = (rand(torch, 2, 70, 3, 64, seed=s) for s in range(3))
    out, lse = exact.attention_with_lse(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.dtype == torch.float32
    assert lse.shape == (2, 3, 70)
    ref_out, ref_lse = reference(torch, q, k, v, 1 / math.sqrt(64), None)
    assert close(out, ref_out, 1e-2) and torch.allclose(lse.double(), ref_lse, atol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)))
    assert close(out, sdpa.transpose(1, 2), 1e-2)


def test_masks_scale_gqa(torch, exact):
    q = rand(torch, 1, 40, 4, 32, seed=1)
    k, v = (rand(torch, 1, 50, 2, 32, seed=s) for s in (2, 3))
    keep = torch.ones(1, 50, dtype=torch.bool)
    keep[:, 37:] = False                                       # key padding, diffusers' [B, Sk] form
    bias = torch.zeros(1, 1, 1, 50).masked_fill(~keep[:, None, None], float("-inf"))
    ltx = torch.where(keep, 0.0, -10000.0)[:, None, None].to(torch.bfloat16)   # LTX's additive form
    for mask in (keep, keep[:, None, None, :], bias, ltx):
        out, lse = exact.attention_with_lse(q, k, v, scale=0.3, attn_mask=mask)
        ref_bias = mask if mask.dtype != torch.bool else torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        ref_bias = ref_bias.double().reshape(1, 1, 1, 50)
        ref_out, ref_lse = reference(torch, q, k, v, 0.3, ref_bias)
        assert close(out, ref_out, 1e-2), mask.dtype
        assert torch.allclose(lse.double(), ref_lse, atol=1e-4)
    # the padded keys are ignored: same as attending to the first 37 keys only
    trunc, _ = exact.attention_with_lse(q, k[:, :37], v[:, :37], scale=0.3)
    padded, _ = exact.attention_with_lse(q, k, v, scale=0.3, attn_mask=keep)
    assert torch.equal(trunc, padded)


def test_causal_conventions_and_empty_rows(torch, exact):
    q = rand(torch, 1, 6, 1, 16, seed=4)
    k, v = (rand(torch, 1, 4, 1, 16, seed=s) for s in (5, 6))
    i, j = torch.arange(6)[:, None], torch.arange(4)[None, :]
    for from_end, visible in ((False, j <= i), (True, j <= i + 4 - 6)):
        out, lse = exact.attention_with_lse(q, k, v, causal=True, causal_from_end=from_end)
        bias = torch.zeros(6, 4, dtype=torch.float64).masked_fill(~visible, float("-inf"))
        ref_out, ref_lse = reference(torch, q, k, v, 0.25, bias)
        assert close(out, ref_out, 1e-2)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert torch.allclose(lse[torch.isfinite(lse)].double(), ref_lse[torch.isfinite(ref_lse)], atol=1e-5)
    # flash-attn's convention with Sq > Sk: rows 0 and 1 see no key -> output 0, LSE -inf
    out, lse = exact.attention_with_lse(q, k, v, causal=True, causal_from_end=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.isinf(lse[0, 0, :2]).all()
    assert not torch.isnan(out).any()


def test_blocked_rows_match_one_block(torch, exact, monkeypatch):
    q, k, v = (rand(torch, 1, 300, 2, 32, seed=s) for s in range(3))
    whole = exact.attention_with_lse(q, k, v, causal=True)
    monkeypatch.setattr(exact, "_BLOCK_BYTES", 4 * 2 * 300 * 7)     # 7 rows a block
    blocked = exact.attention_with_lse(q, k, v, causal=True)
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[1], blocked[1])


def test_bad_heads(torch, exact):
    q = rand(torch, 1, 8, 3, 16)
    k = rand(torch, 1, 8, 2, 16)
    with pytest.raises(ValueError, match="^k, v"):
        exact.attention_with_lse(q, k, k)
