"""attention(..., block_mask=): key block lists on the sm_90a kernel (docs/block_sparse.md, numerics section
5 "Key block lists") against torch SDPA with the same block-level mask in FP32, and the call forms around it:
lists from open_vc_attn.masks BlockMasks, broadcast lists, empty rows, LSE, INT8 + K smoothing, head dim 64,
every block listed (the dense call bit for bit), CUDA graph replay with new lists, torch.compile, and the
argument errors (CPU tests: they run before the device check)."""
import math

import numpy as np
import pytest

import open_vc_attn
from helpers import cpu_qkv, graph_replays_like_eager, torch_qkv

BLOCK = 128


def random_lists(torch, b, h, q_tiles, k_tiles, density, seed, empty_every=5, device="cuda"):
    """Ascending random key block lists [b, h, q_tiles] / [b, h, q_tiles, k_tiles + 2], every
    empty_every-th row (from the third) empty; unused entries poisoned with -9 (never read)."""
    g = torch.Generator().manual_seed(seed)
    take = torch.rand(b, h, q_tiles, k_tiles, generator=g) < density
    take[..., -1] |= ~take.any(-1)                        # at least one block per row ...
    rows = torch.arange(b * h * q_tiles).view(b, h, q_tiles)
    take[(rows % empty_every) == 2] = False               # ... except the empty ones
    counts = take.sum(-1).to(torch.int32)
    order = torch.argsort((~take).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    idx = torch.full((b, h, q_tiles, k_tiles + 2), -9, dtype=torch.int32)
    idx[..., :k_tiles] = torch.where(torch.arange(k_tiles) < counts[..., None], order,
                                     torch.tensor(-9, dtype=torch.int32))
    return counts.to(device), idx.to(device)


def dense_block_mask(torch, counts, idx, b, h, sq, sk):
    """[b, h, sq, sk] bool: key j visible to query i iff j's block is listed for i's tile."""
    q_tiles, k_tiles = counts.shape[-1], -(-sk // BLOCK)
    occ = torch.zeros(*counts.shape, k_tiles + 1, dtype=torch.bool, device=counts.device)
    pos = torch.arange(idx.shape[-1], device=idx.device)
    listed = pos < counts[..., None]
    occ.scatter_(-1, torch.where(listed, idx.long().clamp(0, k_tiles - 1), k_tiles), listed)
    occ = occ[..., :k_tiles].expand(b, h, q_tiles, k_tiles)
    m = occ.repeat_interleave(BLOCK, dim=-2)[..., :sq, :].repeat_interleave(BLOCK, dim=-1)[..., :sk]
    return m


def sdpa_masked(torch, q, k, v, mask, scale=None):
    """FP32 attention with a bool mask [B, H, Sq, Sk]; rows with no key give 0 and lse -inf."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(mask.any(-1, keepdim=True), torch.softmax(s, dim=-1), torch.zeros_like(s))
    return (p @ vf).transpose(1, 2), lse


def rel_l2(torch, a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("d, fmt", [(128, "e4m3"), (64, "e4m3"), (128, "int8")])
def test_lists_match_masked_sdpa(torch, d, fmt):
    b, sq, sk, h = 2, 1000, 1300, 3
    q, k, v = torch_qkv(torch, b, sq, h, seed=1)[0], *torch_qkv(torch, b, sk, h, seed=2)[1:]
    if d == 64:
        q, k, v = (x[..., :64].contiguous() for x in (q, k, v))
    counts, idx = random_lists(torch, b, h, -(-sq // BLOCK), -(-sk // BLOCK), 0.4, seed=3)
    out, lse = open_vc_attn.attention(q, k, v, block_mask=(counts, idx), return_lse=True, qk_format=fmt,
                                      k_smoothing=fmt == "int8")
    want, want_lse = sdpa_masked(torch, q, k, v, dense_block_mask(torch, counts, idx, b, h, sq, sk))
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_l2(torch, out, want) < 0.06     # FP8 Q/K/V and P (video-like inputs: ~2-3%)
    empty = ~dense_block_mask(torch, counts, idx, b, h, sq, sk).any(-1)   # [b, h, sq]
    assert empty.any()
    assert (out.transpose(1, 2)[empty] == 0).all()
    assert torch.isneginf(lse[empty]).all()
    lse_err = (lse[~empty] - want_lse[~empty]).abs()   # FP8 Q/K move the scores (E4M3 max ~0.13 here)
    assert lse_err.mean().item() < 0.03 and lse_err.max().item() < 0.3


@pytest.mark.gpu
def test_every_block_listed_is_the_dense_call(torch):
    b, s, h = 1, 900, 2
    q, k, v = torch_qkv(torch, b, s, h, seed=4)
    n = -(-s // BLOCK)
    counts = torch.full((1, 1, n), n, dtype=torch.int32, device="cuda")
    idx = torch.arange(n, dtype=torch.int32, device="cuda").expand(1, 1, n, n).contiguous()
    assert torch.equal(open_vc_attn.attention(q, k, v, block_mask=(counts, idx)), open_vc_attn.attention(q, k, v))


@pytest.mark.gpu
def test_masks_module_block_masks(torch):
    from open_vc_attn import masks
    frames, tpf, h = 4, 300, 2
    s = frames * tpf
    q, k, v = torch_qkv(torch, 1, s, h, seed=5)
    for bm in (masks.frame_causal(frames, tpf, device="cuda"), masks.temporal_window(frames, tpf, 1, device="cuda")):
        counts, idx = masks.block_lists(bm)
        got = open_vc_attn.attention(q, k, v, block_mask=bm)
        assert torch.equal(got, open_vc_attn.attention(q, k, v, block_mask=(counts, idx)))
        want, _ = sdpa_masked(torch, q, k, v, dense_block_mask(torch, counts, idx, 1, h, s, s))
        assert rel_l2(torch, got, want) < 0.06


@pytest.mark.gpu
def test_graph_replay_with_new_lists(torch):
    b, s, h = 1, 700, 2
    q, k, v = torch_qkv(torch, b, s, h, seed=6)
    n = -(-s // BLOCK)
    c1, i1 = random_lists(torch, 1, h, n, n, 0.5, seed=7)
    c2, i2 = random_lists(torch, 1, h, n, n, 0.3, seed=8, empty_every=3)
    q2 = torch_qkv(torch, b, s, h, seed=9)[0]

    def call(q, k, v, counts, idx):
        return open_vc_attn.attention(q, k, v, block_mask=(counts, idx), return_lse=True)

    graph_replays_like_eager(torch, call, (q, k, v, c1, i1), (q2, k, v, c2, i2))


@pytest.mark.gpu
def test_torch_compile_fullgraph(torch):
    b, s, h = 1, 600, 2
    q, k, v = torch_qkv(torch, b, s, h, seed=10)
    n = -(-s // BLOCK)
    counts, idx = random_lists(torch, 1, 1, n, n, 0.5, seed=11)

    def f(q, k, v, counts, idx):
        return open_vc_attn.attention(q, k, v, block_mask=(counts, idx))

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v, counts, idx), f(q, k, v, counts, idx))


# ---- argument errors --------------------------------------------------------------------------------------

def _lists(torch, b=1, h=1, q_tiles=1, k_tiles=1, dtype=None, device="cpu"):
    dtype = dtype or torch.int32
    return (torch.zeros(b, h, q_tiles, dtype=dtype, device=device),
            torch.zeros(b, h, q_tiles, k_tiles, dtype=dtype, device=device))


ERROR_CASES = [
    ("causal", {"causal": True}, ValueError, "block_mask.*causal"),
    ("seqused_k", {"seqused_k": [100]}, ValueError, "block_mask.*seqused_k"),
    ("exp2", {"qk_format": "int8", "p_format": "exp2"}, ValueError, "block_mask.*exp2"),
    ("wrong_q_tiles", {"q_tiles": 3}, ValueError, "kv_num_blocks"),
    ("int64", {"dtype": "int64"}, TypeError, "int32"),
    ("not_contiguous", {"strided": True}, ValueError, "contiguous"),
]


def _error_call(torch, case, device):
    """attention()'s arguments for an error case: q, k, v [1, 200, 2, 128] and the case's lists / options."""
    q = k = v = torch.zeros(1, 200, 2, 128, dtype=torch.bfloat16, device=device)
    over = dict(case[1])
    dtype = torch.int64 if over.pop("dtype", None) == "int64" else None
    counts, idx = _lists(torch, q_tiles=over.pop("q_tiles", 2), k_tiles=2, dtype=dtype, device=device)
    if over.pop("strided", False):
        idx = torch.zeros(1, 1, 2, 4, dtype=torch.int32, device=device)[..., ::2]
    if "seqused_k" in over:
        over["seqused_k"] = torch.tensor(over["seqused_k"], dtype=torch.int32, device=device)
    return (q, k, v), dict(over, block_mask=(counts, idx))


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_op_rules_name_the_argument(torch, case):
    """The op's block-list rules (open_vc_attn._block_sparse.check_op_lists), on CPU tensors."""
    from open_vc_attn import _block_sparse
    (q, k, _), kw = _error_call(torch, case, "cpu")
    counts, idx = kw["block_mask"]
    with pytest.raises(case[2], match=case[3]):
        _block_sparse.check_op_lists(counts, idx, q, k, packed=False, causal=kw.get("causal", False),
                                     key_counts="seqused_k" in kw, p_format=kw.get("p_format", "expcast"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_attention_errors_name_the_argument(torch, case):
    args, kw = _error_call(torch, case, "cuda")
    with pytest.raises(case[2], match=case[3]):
        open_vc_attn.attention(*args, **kw)


@pytest.mark.parametrize("kwargs, msg", [
    ({"version": "reference", "mode": "bf16"}, "block_mask.*reference"),
    ({"key_padding_mask": "mask"}, "block_mask.*key_padding_mask"),
    ({"cu_seqlens": True}, "block_mask.*cu_seqlens"),
    ({"bad": True}, "block_mask: expected a torch.nn.attention.flex_attention.BlockMask"),
])
def test_api_rejects_before_the_op(torch, kwargs, msg):
    """What api.attention rejects itself (the op never sees these forms), before any device check."""
    q, k, v = cpu_qkv(torch, (1, 200, 2, 128))
    kw = {"block_mask": _lists(torch, q_tiles=2, k_tiles=2)}
    if kwargs.pop("key_padding_mask", None):
        kw["key_padding_mask"] = torch.ones(1, 200, dtype=torch.bool)
    if kwargs.pop("cu_seqlens", None):
        q, k, v = (x[0] for x in (q, k, v))
        kw.update(cu_seqlens_q=torch.tensor([0, 200], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 200], dtype=torch.int32), max_seqlen_q=200, max_seqlen_k=200)
    if kwargs.pop("bad", None):
        kw["block_mask"] = np.zeros(3)
    with pytest.raises((ValueError, TypeError), match=msg):
        open_vc_attn.attention(q, k, v, **kw, **kwargs)
