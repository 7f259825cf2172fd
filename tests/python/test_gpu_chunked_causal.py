"""attention(..., causal=True, causal_chunk=F): chunked causal (numerics.md section 5; key j visible to query i
iff j < (floor((i + Sk - Sq) / F) + 1) * F) against FP32 SDPA with the element mask, in the call forms that take
causal (batched, Sq != Sk, head dim 64, packed, key counts, INT8 + K smoothing, LSE), chunk 1 as plain causal,
torch.compile; and the argument rules (CPU)."""
import math

import pytest

import open_vc_attn
from open_vc_attn import _checks
from helpers import torch_qkv


def chunk_mask(torch, sq, sk, chunk, device="cuda"):
    """[Sq, Sk] bool: the chunked-causal mask, queries aligned to the end of the keys."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    limit = (torch.div(i, chunk, rounding_mode="floor") + 1) * chunk
    return torch.arange(sk, device=device)[None, :] < limit


def sdpa(torch, q, k, v, mask):
    """FP32 attention of [B, S, H, D] inputs with a [B or 1, 1, Sq, Sk] bool mask: (out, lse); empty rows 0, -inf."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.where(mask.any(-1, keepdim=True), torch.softmax(s, -1), torch.zeros_like(s))
    return (p @ vf).transpose(1, 2), torch.logsumexp(s, -1)


def rel(torch, a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("sq, sk, d, chunk, fmt", [
    (1000, 1000, 128, 300, "e4m3"), (700, 1500, 64, 256, "e4m3"), (1200, 500, 128, 77, "e4m3"),
    (1000, 1000, 128, 1560, "int8"),
])
def test_batched_matches_masked_sdpa(torch, sq, sk, d, chunk, fmt):
    q = torch_qkv(torch, 2, sq, 2, seed=1)[0][..., :d].contiguous()
    k, v = (x[..., :d].contiguous() for x in torch_qkv(torch, 2, sk, 2, seed=2)[1:])
    out, lse = open_vc_attn.attention(q, k, v, causal=True, causal_chunk=chunk, return_lse=True, qk_format=fmt,
                                      k_smoothing=fmt == "int8")
    mask = chunk_mask(torch, sq, sk, chunk)[None, None]
    want, want_lse = sdpa(torch, q, k, v, mask)
    assert rel(torch, out, want) < 0.06
    seen = mask[0, 0].any(-1)
    assert (out[:, ~seen] == 0).all() and torch.isneginf(lse[..., ~seen]).all()
    assert (lse[..., seen] - want_lse[..., seen]).abs().mean().item() < 0.03


@pytest.mark.gpu
def test_chunk_one_is_plain_causal(torch):
    q, k, v = torch_qkv(torch, 1, 900, 2, seed=3)
    assert torch.equal(open_vc_attn.attention(q, k, v, causal=True, causal_chunk=1),
                       open_vc_attn.attention(q, k, v, causal=True))


@pytest.mark.gpu
def test_packed_and_key_counts(torch):
    chunk = 200
    q, k, v = torch_qkv(torch, 1, 1600, 2, seed=4)
    cu = torch.tensor([0, 700, 700, 1600], dtype=torch.int32, device="cuda")   # an empty sequence between
    out = open_vc_attn.attention(q[0], k[0], v[0], causal=True, causal_chunk=chunk, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 max_seqlen_q=900, max_seqlen_k=900)
    for a, b in ((0, 700), (700, 1600)):
        want, _ = sdpa(torch, q[:, a:b], k[:, a:b], v[:, a:b], chunk_mask(torch, b - a, b - a, chunk)[None, None])
        assert rel(torch, out[a:b], want[0]) < 0.06
    counts = torch.tensor([1000, 640], dtype=torch.int32, device="cuda")
    q2, k2, v2 = torch_qkv(torch, 2, 1000, 2, seed=5)
    got = open_vc_attn.attention(q2, k2, v2, causal=True, causal_chunk=chunk, seqused_k=counts)
    for b in range(2):
        n = int(counts[b])
        # a key count shortens Sk: queries align to the end of the n kept keys
        want, _ = sdpa(torch, q2[b:b + 1], k2[b:b + 1, :n], v2[b:b + 1, :n],
                       chunk_mask(torch, 1000, n, chunk)[None, None])
        assert rel(torch, got[b:b + 1], want) < 0.06


@pytest.mark.gpu
def test_torch_compile_fullgraph(torch):
    q, k, v = torch_qkv(torch, 1, 600, 2, seed=6)

    def f(q, k, v):
        return open_vc_attn.attention(q, k, v, causal=True, causal_chunk=150)

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


@pytest.mark.parametrize("value, causal, exc, msg", [
    (0, True, ValueError, "causal_chunk"), (300, False, ValueError, "needs causal=True"),
    (2.5, True, TypeError, "causal_chunk"), (True, True, TypeError, "causal_chunk"),
])
def test_argument_rules(value, causal, exc, msg):
    with pytest.raises(exc, match=msg):
        _checks.causal_chunk(value, causal)


def test_reference_takes_plain_causal_only(torch):
    q = k = v = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="causal_chunk"):
        open_vc_attn.attention(q, k, v, causal=True, causal_chunk=16, version="reference", mode="bf16")
