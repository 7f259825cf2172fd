"""Grouped-query attention (GQA / MQA) on the GPU: k and v of Hk heads, a divisor of q's H, against the same call
on K and V with each head repeated H // Hk times (k.repeat_interleave(H // Hk, dim=-2)), which is the definition,
bit for bit (torch.equal of outputs and LSE): open_vc_attn.attention in every fast call form (dense, causal and
chunked causal, packed uneven sequences with an empty one, key padding masks and key counts, head dim 64, INT8
with K smoothing, exp2 P, FP16 out, key block lists), prepare_fp8 + attention_fp8 (whose K/V tensors are the
repeated preparation's, one per K/V head), the BF16 reference, CUDA graph capture with replays of new inputs,
torch.compile(fullgraph=True) and opcheck. H / Hk in (8, 2) and (6, 1); fresh random inputs per test, and the
caching allocator's free memory filled with NaN before each call (an output element left unwritten reads NaN,
which torch.equal never accepts). Tests marked `gpu` (conftest.py skips them without an sm_90 device). The
argument rules are test_gqa.py's (CPU). On an H200: python3 -m pytest -q -rs tests/python/test_gpu_gqa.py
"""
import pytest

import open_vc_attn as ova
from helpers import graph_replays_like_eager

pytestmark = pytest.mark.gpu

GROUPS = [(8, 2), (6, 1)]
INT8X = dict(qk_format="int8", k_smoothing=True)


def randn(torch, g, *shape, scale=1.0, dtype=None):
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype or torch.bfloat16)


def inputs(torch, seed, h, hk, b=2, sq=700, sk=900, d=128, dtype=None):
    """q [B, Sq, H, D], k and v [B, Sk, Hk, D]; K with a per-channel offset (what K smoothing removes)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = randn(torch, g, b, sq, h, d, dtype=dtype)
    k = (randn(torch, g, b, sk, hk, d).float() + 2.0 * randn(torch, g, b, 1, hk, d).float()).to(q.dtype)
    return q, k, randn(torch, g, b, sk, hk, d, dtype=dtype)


def rep(x, h):
    """K or V with each head repeated to h heads: the definition of the grouped call."""
    return x.repeat_interleave(h // x.shape[-2], dim=-2)


def poison(torch):
    """Fill the caching allocator's free blocks with NaN (a new output of the next call reads NaN wherever the
    kernels do not write)."""
    torch.cuda.synchronize()
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 26, 1 << 22, 1 << 18, 1 << 14)]
    del blocks
    torch.cuda.synchronize()


def same(torch, got, want, what):
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
        assert torch.equal(a, b), f"{what}: output {i} differs from the call on repeated K/V heads"


def check(torch, call, q, k, v, what, **kw):
    """call(q, k, v, **kw) == call(q, k repeated, v repeated, **kw), each on a poisoned allocator."""
    h = q.shape[-2]
    poison(torch)
    got = call(q, k, v, **kw)
    poison(torch)
    want = call(q, rep(k, h), rep(v, h), **kw)
    same(torch, got, want, what)


# ---- open_vc_attn.attention ----------------------------------------------------------------------------------------

def forms(torch):
    """(name, keyword arguments) of the batched call forms (LSE everywhere: attention() returns the LSE of the
    keys as given with K smoothing too)."""
    counts = torch.tensor([900, 333], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(99)
    keep = torch.rand(2, 900, device="cuda", generator=g) < 0.6
    keep[1, :] = False           # an entry without keys: output 0, lse -inf
    return [
        ("dense", {}),
        ("causal", dict(causal=True)),
        ("chunked causal", dict(causal=True, causal_chunk=96)),
        ("natural order", dict(mid_window_blocks=None, softmax_scale=0.05)),
        ("key counts", dict(seqused_k=counts)),
        ("key counts causal", dict(seqused_k=counts, causal=True)),
        ("key padding mask", dict(key_padding_mask=keep)),
        ("float16 out", dict(out_dtype=torch.float16)),
        ("int8 + k smoothing", INT8X),
        ("int8 + k smoothing causal", dict(INT8X, causal=True)),
        ("int8 + k smoothing + exp2", dict(INT8X, p_format="exp2")),
        ("int8 + exp2 key counts causal", dict(qk_format="int8", p_format="exp2", seqused_k=counts, causal=True)),
        ("e4m3 + k smoothing", dict(k_smoothing=True)),
    ]


@pytest.mark.parametrize("h, hk", GROUPS)
@pytest.mark.parametrize("d", [128, 64])
def test_attention_equals_repeated_heads(torch, h, hk, d):
    q, k, v = inputs(torch, 10 * h + hk + d, h, hk, d=d)
    for what, kw in forms(torch):
        check(torch, ova.attention, q, k, v, f"{what} (d={d})", return_lse=True, **kw)
    # one sequence (rank 3) and FP16 inputs
    check(torch, ova.attention, q[0], k[0], v[0], "rank 3", return_lse=True, causal=True)
    q16, k16, v16 = inputs(torch, 7, h, hk, d=d, dtype=torch.float16)
    check(torch, ova.attention, q16, k16, v16, "float16 inputs", return_lse=True, **INT8X)


@pytest.mark.parametrize("h, hk", GROUPS)
def test_attention_packed_equals_repeated_heads(torch, h, hk):
    """Packed sequences of uneven lengths, one of them empty, causal or not, E4M3 / INT8 / exp2, key counts."""
    g = torch.Generator(device="cuda").manual_seed(h + hk)
    q, k, v = randn(torch, g, 1400, h, 128), randn(torch, g, 1000, hk, 128), randn(torch, g, 1000, hk, 128)
    cu_q = torch.tensor([0, 700, 700, 1131, 1400], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 333, 1000, 1000, 1000], dtype=torch.int32, device="cuda")
    used = torch.tensor([300, 5, 0, 0], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=700, max_seqlen_k=667, return_lse=True)
    for what, kw in (("plain", {}), ("causal", dict(causal=True)), ("int8", INT8X),
                     ("int8 exp2 causal", dict(INT8X, p_format="exp2", causal=True)),
                     ("key counts", dict(seqused_k=used)),
                     ("head dim 64", None)):
        if kw is None:
            check(torch, ova.attention, q[..., :64].contiguous(), k[..., :64].contiguous(), v[..., :64].contiguous(),
                  what, causal=True, **packed)
        else:
            check(torch, ova.attention, q, k, v, f"packed {what}", **packed, **kw)


@pytest.mark.parametrize("h, hk", GROUPS)
def test_key_block_lists_equal_repeated_heads(torch, h, hk):
    q, k, v = inputs(torch, 31 + h, h, hk, b=1, sq=1000, sk=1200)
    g = torch.Generator().manual_seed(h)
    q_tiles, k_tiles = 8, 10
    take = torch.rand(1, h, q_tiles, k_tiles, generator=g) < 0.5
    take[..., 0] = True
    counts = take.sum(-1).to(torch.int32)
    order = torch.argsort((~take).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    idx = torch.full((1, h, q_tiles, k_tiles + 1), -9, dtype=torch.int32)   # unused entries poisoned
    idx[..., :k_tiles] = torch.where(torch.arange(k_tiles) < counts[..., None], order,
                                     torch.tensor(-9, dtype=torch.int32))
    lists = (counts.cuda(), idx.cuda())   # per query head
    check(torch, ova.attention, q, k, v, "block lists", block_mask=lists, return_lse=True)
    check(torch, ova.attention, q, k, v, "block lists int8", block_mask=lists, return_lse=True, **INT8X)


@pytest.mark.parametrize("h, hk", GROUPS)
def test_bf16_reference_repeats_heads(torch, h, hk):
    q, k, v = inputs(torch, 5, h, hk)
    check(torch, ova.attention, q, k, v, "bf16 reference", version="reference", mode="bf16", causal=True,
          return_lse=True)


# ---- prepare_fp8 + attention_fp8 -----------------------------------------------------------------------------------

def kv_of_repeated(prep, g, packed=False):
    """The K/V tensors of a preparation of repeated heads, one head of each group: what the grouped preparation
    holds (each K/V head quantized once, as each of its copies is)."""
    k_axis = 1 if packed else 2
    k_codes = prep.k_codes[(slice(None),) * k_axis + (slice(None, None, g),)]
    return (k_codes, prep.k_descale[:, ::g], prep.v_packed[:, ::g], prep.v_descale[:, ::g])


@pytest.mark.parametrize("h, hk", GROUPS)
@pytest.mark.parametrize("fmt", [dict(), dict(qk_format="int8"), INT8X])
def test_prepared_equals_repeated_heads(torch, h, hk, fmt):
    g = h // hk
    q, k, v = inputs(torch, 50 + h, h, hk)
    counts = torch.tensor([900, 400], dtype=torch.int32, device="cuda")
    for used in (None, counts):
        poison(torch)
        p = ova.prepare_fp8(q, k, v, seqused_k=used, **fmt)
        r = ova.prepare_fp8(q, rep(k, h), rep(v, h), seqused_k=used, **fmt)
        assert (p.heads, p.kv_heads, r.kv_heads) == (h, hk, h)
        assert p.k_codes.shape == (2, 900, hk, 128) and p.v_packed.shape == (2, hk, 128, 1024)
        same(torch, p.tensors()[:2], r.tensors()[:2], "q codes and descales")
        if used is None:   # (codes past a key count are not written: compared through the attention only)
            same(torch, p.tensors()[2:], kv_of_repeated(r, g), "K/V tensors")
        smooth = fmt.get("k_smoothing", False)
        for kw in ({}, dict(causal=True), dict(mid_window_blocks=None)) + ((dict(p_format="exp2"),) if fmt else ()):
            poison(torch)
            got = ova.attention_fp8(p, return_lse=not smooth, **kw)
            poison(torch)
            same(torch, got, ova.attention_fp8(r, return_lse=not smooth, **kw), f"attention_fp8 {fmt} {kw}")
        # wrapped again from its tensors (PreparedFP8.from_quantized takes K/V tensors of Hk heads)
        w = ova.PreparedFP8.from_quantized(*p.tensors(), qk_format=p.qk_format, k_smoothing=smooth)
        if used is None:
            assert w.kv_heads == hk
            same(torch, ova.attention_fp8(w), ova.attention_fp8(r), "from_quantized")


@pytest.mark.parametrize("h, hk", GROUPS)
def test_prepared_packed_equals_repeated_heads(torch, h, hk):
    g = torch.Generator(device="cuda").manual_seed(h * hk)
    q, k, v = randn(torch, g, 1300, h, 64), randn(torch, g, 1000, hk, 64), randn(torch, g, 1000, hk, 64)
    cu_q = torch.tensor([0, 500, 500, 1300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 600, 600, 1000], dtype=torch.int32, device="cuda")
    for fmt in ({}, INT8X):
        p = ova.prepare_fp8(q, k, v, cu_q, cu_k, 800, 600, **fmt)
        r = ova.prepare_fp8(q, rep(k, h), rep(v, h), cu_q, cu_k, 800, 600, **fmt)
        assert p.kv_heads == hk and p.k_codes.shape == (1000, hk, 64)
        same(torch, p.tensors()[2:], kv_of_repeated(r, h // hk, packed=True), f"packed K/V tensors {fmt}")
        for kw in ({}, dict(causal=True)):
            poison(torch)
            got = ova.attention_fp8(p, return_lse=not fmt, **kw)
            poison(torch)
            same(torch, got, ova.attention_fp8(r, return_lse=not fmt, **kw), f"packed attention_fp8 {fmt} {kw}")


# ---- CUDA graphs, torch.compile, opcheck ---------------------------------------------------------------------------

def graph_sets(torch, seed, h, hk):
    return [inputs(torch, seed + i, h, hk, sq=1000, sk=900) for i in range(2)]


@pytest.mark.parametrize("h, hk", GROUPS)
def test_capture_and_replay_with_new_inputs(torch, h, hk):
    """Global-mode capture (no synchronization anywhere, libopenvc included: helpers.graph_replays_like_eager),
    replays with new q, k, v compared byte for byte with eager calls, and the eager calls with repeated heads."""
    counts = torch.tensor([900, 17], dtype=torch.int32, device="cuda")
    calls = {
        "dense lse": lambda q, k, v: ova.attention(q, k, v, return_lse=True),
        "int8 smoothing exp2 causal": lambda q, k, v: ova.attention(q, k, v, causal=True, p_format="exp2",
                                                                    return_lse=True, **INT8X),
        "key counts": lambda q, k, v: ova.attention(q, k, v, seqused_k=counts, return_lse=True),
        "prepared": lambda q, k, v: (lambda p: (*p.tensors(), *ova.attention_fp8(p, return_lse=True)))(
            ova.prepare_fp8(q, k, v)),
    }
    for i, (name, call) in enumerate(calls.items()):
        sets = graph_sets(torch, 100 + 10 * i, h, hk)
        graph_replays_like_eager(torch, call, *sets)
        if name != "prepared":
            q, k, v = sets[1]
            check(torch, call, q, k, v, f"graph form {name}")


@pytest.mark.parametrize("h, hk", GROUPS)
def test_packed_capture(torch, h, hk):
    def call(q, k, v, cq, ck):
        return ova.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=700, max_seqlen_k=600,
                             causal=True, return_lse=True)
    sets = []
    for i, (cq, ck) in enumerate((([0, 1, 300, 1000], [0, 400, 400, 900]), ([0, 500, 500, 1000], [0, 1, 600, 900]))):
        g = torch.Generator(device="cuda").manual_seed(200 + i)
        offsets = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in (cq, ck)]
        sets.append((randn(torch, g, 1000, h, 128), randn(torch, g, 900, hk, 128), randn(torch, g, 900, hk, 128),
                     *offsets))
    graph_replays_like_eager(torch, call, *sets)


@pytest.mark.parametrize("h, hk", GROUPS)
def test_compile_fullgraph_and_opcheck(torch, h, hk):
    q, k, v = inputs(torch, 300 + h, h, hk, b=1, sq=300, sk=500)
    ops = torch.ops.open_vc_attn

    def fn(a, b, c):   # attention(), and the step-wise ops (prepare_fp8's K/V outputs of Hk heads)
        t = ops.prepare_fp8(a, b, c, None, None, 0, 0, None)
        return (ova.attention(a, b, c, causal=True, return_lse=True, **INT8X),
                ops.attention_fp8(*t, None, None, 0, 0, 0.0, True, 4, False)[0])
    compiled = torch.compile(fn, fullgraph=True)
    (out, lse), out_fp8 = compiled(q, k, v)
    (want, want_lse), want_fp8 = fn(q, k, v)
    same(torch, (out, lse, out_fp8), (want, want_lse, want_fp8), "torch.compile")
    (rep_out, rep_lse), _ = fn(q, rep(k, h), rep(v, h))
    same(torch, (out, lse), (rep_out, rep_lse), "compiled vs repeated heads")
    torch.library.opcheck(ops.attention.default, (q, k, v, None, None, 0, 0, None, 0.0, True, 4, True, None, "int8",
                                                  True, "exp2"))
    torch.library.opcheck(ops.prepare_fp8.default, (q, k, v, None, None, 0, 0, None, "int8", True))
    t = ops.prepare_fp8(q, k, v, None, None, 0, 0, None)
    torch.library.opcheck(ops.attention_fp8.default, (*t, None, None, 0, 0, 0.0, False, 4, True))


# ---- what takes equal head counts only -----------------------------------------------------------------------------

def test_equal_head_paths_reject_on_the_gpu(torch):
    from open_vc_attn import baselines, repair
    q, k, v = inputs(torch, 1, 8, 2, b=1, sq=256, sk=256)
    with pytest.raises(ValueError, match="^k: .*prepare_v_repair does not take GQA/MQA"):
        repair.prepare_v_repair(q, k, v)
    with pytest.raises(ValueError, match=r"^prepared\.k_codes: .*V residual repair does not take GQA/MQA"):
        repair.prepare_v_repair(q, rep(k, 8), rep(v, 8), prepared=ova.prepare_fp8(q, k, v))
    with pytest.raises(ValueError, match="^k: .*prepare_vc does not take GQA/MQA"):
        baselines.vc_attention(q, k, v)


def test_v_block_descales_equal_repeated_heads(torch):
    """attention_fp8 with V descales per key block ([B, Hk, nk], the FP8 KV cache's layout) on grouped K/V: the call
    on the repeated heads' preparation with its [B, H, nk] descales, bit for bit (different descales per block)."""
    from open_vc_attn import ops
    q, k, v = inputs(torch, 2, 8, 2, b=2, sq=300, sk=700)

    def per_block(p):
        t = p.tensors()
        scale = torch.arange(1, 7, device="cuda", dtype=torch.float32) / 3   # a different factor per block
        blocks = (t[5][:, :, None] * scale).contiguous()   # [B, heads of K/V, ceil(700/128) = 6]
        return ops.attention_fp8_op(*t[:5], blocks, None, None, 0, 0, 0.0, False, 4, True)

    out_g, lse_g = per_block(ova.prepare_fp8(q, k, v))
    out_r, lse_r = per_block(ova.prepare_fp8(q, rep(k, 8), rep(v, 8)))
    assert torch.equal(out_g, out_r) and torch.equal(lse_g, lse_r)
    assert torch.isfinite(out_g).all()


# ---- bench.modes' gqa case -----------------------------------------------------------------------------------------

def test_bench_gqa_entries_agree_with_cudnn(torch):
    """The gqa case's entries on a small shape: the grouped call equals the call on repeated heads bit for bit and
    every openvc entry is within the E4M3 error of cuDNN BF16 on the repeated heads (check_outputs' rel L2)."""
    from open_vc_attn.bench import modes
    entries, flops = modes._gqa_entries(torch, ova, 1024, 8, 2)
    assert {"openvc", "openvc-repeated", "openvc-kernel", "cudnn-bf16"} <= set(entries) and set(flops) == set(entries)
    assert torch.equal(entries["openvc"](), entries["openvc-repeated"]())
    errors = modes.check_outputs(torch, entries)
    for name in ("openvc", "openvc-repeated", "openvc-kernel"):
        assert isinstance(errors[name], float) and errors[name] < 0.1, (name, errors[name])
