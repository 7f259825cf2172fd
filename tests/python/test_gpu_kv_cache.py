"""open_vc_attn.kv_cache.FP8KVCache (docs/block_sparse.md, "KV cache") and attention_fp8 with V descales per key
block (a rank-3 v_descale): chunks appended once and attended with the current chunk against FP32 attention over
all keys, chunks whose values differ in scale by 64x (so a per-head V scale would fail), remainders of fewer than
128 tokens, E4M3 and INT8, the LSE, CUDA graph replay, memory; and the argument rules (CPU where they come first)."""
import math

import pytest

import open_vc_attn
from open_vc_attn import _layout
from open_vc_attn.kv_cache import FP8KVCache
from helpers import graph_replays_like_eager, torch_qkv


def exact(torch, q, k, v):
    """FP32 attention of [B, S, H, D] inputs, every key visible: (out, lse)."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), torch.logsumexp(s, -1)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def chunks(torch, b, lens, h, seed):
    """Per chunk (k, v) of lens[i] tokens; chunk i's values scaled by 8^(i mod 3 - 1) (per-chunk V scales)."""
    out = []
    for i, n in enumerate(lens):
        _, k, v = torch_qkv(torch, b, n, h, seed=seed + i)
        out.append((k, (v.float() * 8.0 ** (i % 3 - 1)).to(v.dtype)))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
def test_chunks_attend_like_all_keys(torch, fmt):
    b, h, lens = 2, 2, [300, 1000, 77, 450]   # remainders: 300 -> 44 kept, 1300 -> 20, ...
    pieces = chunks(torch, b, lens, h, seed=10)
    cache = FP8KVCache(b, h, 128, capacity=sum(lens) + 600, qk_format=fmt)
    for k, v in pieces[:-1]:
        cache.append(k, v)
    assert cache.length == sum(lens[:-1])
    q = torch_qkv(torch, b, 500, h, seed=3)[0]
    k_cur, v_cur = pieces[-1]
    out, lse = cache.attention(q, k_cur, v_cur, return_lse=True)
    k_all, v_all = (torch.cat([p[i] for p in pieces], 1) for i in (0, 1))
    want, want_lse = exact(torch, q, k_all, v_all)
    full = open_vc_attn.attention(q, k_all, v_all, qk_format=fmt)   # one preparation of every key: one V scale
    err, err_full = rel(out, want), rel(full, want)
    assert err < max(1.2 * err_full, 0.02) and err < 0.08, (err, err_full)
    assert (lse - want_lse).abs().mean().item() < 0.03
    assert cache.length == sum(lens[:-1])   # the current chunk is not stored


@pytest.mark.gpu
def test_cache_without_current_keys_and_append_after(torch):
    b, h = 1, 3
    (k1, v1), (k2, v2) = chunks(torch, b, [512, 200], h, seed=20)
    cache = FP8KVCache(b, h, 128, capacity=1024)
    cache.append(k1, v1)
    q = torch_qkv(torch, b, 300, h, seed=4)[0]
    out = cache.attention(q)   # the cached keys only (512: whole blocks, no remainder)
    assert rel(out, exact(torch, q, k1, v1)[0]) < 0.08
    cache.append(k2, v2)       # 200 more: one block quantized, 72 kept in BF16
    assert cache.length == 712
    out = cache.attention(q)
    assert rel(out, exact(torch, q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))[0]) < 0.08
    cache.reset()
    assert cache.length == 0
    with pytest.raises(ValueError, match="cache is empty"):
        cache.attention(q)


@pytest.mark.gpu
def test_rank3_v_descale_equals_per_head_when_uniform(torch):
    """attention_fp8 with v_descale [B, H, nk] holding the head's descale in every block: the per-head call's
    output up to where the descale is applied (per partial, before the FP32 add, against once at the end)."""
    q, k, v = torch_qkv(torch, 2, 900, 2, seed=5)
    prep = open_vc_attn.prepare_fp8(q, k, v)
    nk = _layout.blocks(900)
    ops = open_vc_attn.ops
    t = prep.tensors()
    per_head = ops.attention_fp8_op(*t, None, None, 0, 0, 0.0, False, 4, False)[0]
    blocks = t[5][:, :, None].expand(-1, -1, nk).contiguous()
    per_block = ops.attention_fp8_op(*t[:5], blocks, None, None, 0, 0, 0.0, False, 4, False)[0]
    assert rel(per_block, per_head) < 5e-3


@pytest.mark.gpu
def test_graph_replay_and_memory(torch):
    b, h = 1, 2
    cache = FP8KVCache(b, h, 128, capacity=2048)
    for k, v in chunks(torch, b, [700, 300], h, seed=30):
        cache.append(k, v)
    new = [torch_qkv(torch, b, 256, h, seed=s) for s in (40, 41)]
    graph_replays_like_eager(torch, lambda q, k, v: cache.attention(q, k, v), new[0], new[1])
    bf16_bytes = 2 * b * 2048 * h * 128 * 2          # K and V of the capacity in BF16
    tail_bytes = 2 * b * (cache.length % 128) * h * 128 * 2   # the remainder, kept in BF16
    assert cache.memory_bytes() < 0.51 * bf16_bytes + tail_bytes


@pytest.mark.gpu
def test_rejected_calls_name_the_argument(torch):
    cache = FP8KVCache(1, 2, 128, capacity=256)
    k, v = torch_qkv(torch, 1, 300, 2, seed=6)[1:]
    with pytest.raises(ValueError, match="capacity"):
        cache.append(k, v)
    with pytest.raises(ValueError, match="H=2"):   # a cache of equal head counts: k of 1 head is refused
        cache.append(k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="k and v"):
        cache.attention(k[:, :10], k[:, :10])
    q, k, v = torch_qkv(torch, 1, 256, 2, seed=7)
    prep = open_vc_attn.prepare_fp8(q, k, v)
    t = prep.tensors()
    blocks = t[5][:, :, None].expand(-1, -1, 2).contiguous()
    ops = open_vc_attn.ops
    with pytest.raises(ValueError, match="v_descale"):
        ops.attention_fp8_op(*t[:5], blocks, None, None, 0, 0, 0.0, False, 4, False, path="general")
    with pytest.raises(ValueError, match="v_descale"):   # the block count is ceil(Sk / 128)
        ops.attention_fp8_op(*t[:5], blocks[:, :, :1].contiguous(), None, None, 0, 0, 0.0, False, 4, False)
    with pytest.raises(ValueError, match="v_descale.*causal"):
        ops.attention_fp8_op(*t[:5], blocks, None, None, 0, 0, 0.0, True, 4, False)
    with pytest.raises(ValueError, match="v: append needs"):
        cache.append(k, None)
    with pytest.raises(TypeError, match="k: expected dtype"):
        cache.append(k.float(), v.float())


@pytest.mark.gpu
def test_block_boundaries_reset_and_fp16(torch):
    """A remainder that a later piece completes to whole blocks (no remainder left), an empty chunk, reuse after
    reset(), FP16 inputs and output, a capacity that is not a multiple of 128 filled to the brim."""
    b, h = 1, 2
    cache = FP8KVCache(b, h, 128, capacity=1000)
    (k1, v1), (k2, v2), (k3, v3) = chunks(torch, b, [300, 84, 616], h, seed=50)   # 300 + 84 = 3 blocks
    q = torch_qkv(torch, b, 200, h, seed=8)[0]
    for k, v in ((k1, v1), (k2, v2)):
        cache.append(k, v)
    assert cache.length == 384 and cache._tail is None
    cache.append(k2[:, :0], v2[:, :0])   # empty: nothing changes
    assert cache.length == 384
    out = cache.attention(q, k3, v3)     # 1000 keys: the capacity exactly
    k_all, v_all = torch.cat([k1, k2, k3], 1), torch.cat([v1, v2, v3], 1)
    assert rel(out, exact(torch, q, k_all, v_all)[0]) < 0.08
    cache.reset()
    cache.append(k3, v3)
    assert rel(cache.attention(q), exact(torch, q, k3, v3)[0]) < 0.08
    half = FP8KVCache(b, h, 128, capacity=1000)
    half.append(k1.half(), v1.half())
    out16 = half.attention(q.half(), k3.half(), v3.half(), out_dtype=torch.float16)
    assert out16.dtype == torch.float16
    assert rel(out16, exact(torch, q, torch.cat([k1, k3], 1), torch.cat([v1, v3], 1))[0]) < 0.08


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
def test_grouped_cache_equals_repeated_heads(torch, fmt):
    """A cache of 8 query / 2 K/V heads (GQA, as MAGI-1's) keeps K and V per K/V head (a quarter of the memory)
    and gives, bit for bit, the cache of 8 heads fed K and V with each head repeated: appends with remainders,
    attention with the current chunk (its remainder and chunk across a block boundary) and without it (the remainder
    prepared with q), the LSE."""
    b, h, hk, lens = 2, 8, 2, [300, 1000, 200]   # the last call's remainder (20) and chunk cross a block boundary
    pieces = chunks(torch, b, lens, hk, seed=60)
    grouped = FP8KVCache(b, h, 128, capacity=2048, qk_format=fmt, kv_heads=hk)
    repeated = FP8KVCache(b, h, 128, capacity=2048, qk_format=fmt)
    rep = lambda x: x.repeat_interleave(h // hk, dim=2)   # noqa: E731
    for k, v in pieces[:-1]:
        grouped.append(k, v)
        repeated.append(rep(k), rep(v))
    q = torch_qkv(torch, b, 500, h, seed=9)[0]
    k_cur, v_cur = pieces[-1]
    out_g, lse_g = grouped.attention(q, k_cur, v_cur, return_lse=True)
    out_r, lse_r = repeated.attention(q, rep(k_cur), rep(v_cur), return_lse=True)
    assert torch.equal(out_g, out_r) and torch.equal(lse_g, lse_r)
    assert torch.equal(grouped.attention(q), repeated.attention(q))   # the cached keys and the remainder
    k_all, v_all = (torch.cat([p[i] for p in pieces], 1) for i in (0, 1))
    assert rel(out_g, exact(torch, q, rep(k_all), rep(v_all))[0]) < 0.08
    assert grouped.memory_bytes() < 0.3 * repeated.memory_bytes()
    with pytest.raises(ValueError, match=r"^k: expected shape \[B=2, n, Hk=2, D=128\]"):
        grouped.append(rep(k_cur), rep(v_cur))


def test_constructor_rules_cpu(torch):
    with pytest.raises(ValueError, match="head_dim"):
        FP8KVCache(1, 2, 64, capacity=256, device="cpu")
    with pytest.raises(ValueError, match="capacity"):
        FP8KVCache(1, 2, 128, capacity=0, device="cpu")
    with pytest.raises(ValueError, match="qk_format"):
        FP8KVCache(1, 2, 128, capacity=256, device="cpu", qk_format="fp16")
    with pytest.raises(TypeError, match="batch"):
        FP8KVCache(1.0, 2, 128, capacity=256, device="cpu")
    with pytest.raises(ValueError, match="device"):
        FP8KVCache(1, 2, 128, capacity=256, device="cpu")
    with pytest.raises(ValueError, match=r"^kv_heads: expected a divisor of heads = 8 .*got 3"):
        FP8KVCache(1, 8, 128, capacity=256, device="cpu", kv_heads=3)
    with pytest.raises(ValueError, match=r"^kv_heads: expected an int >= 1, got 0"):
        FP8KVCache(1, 8, 128, capacity=256, device="cpu", kv_heads=0)
    with pytest.raises(TypeError, match="^kv_heads: expected an int"):
        FP8KVCache(1, 8, 128, capacity=256, device="cpu", kv_heads=2.0)
    with pytest.raises(ValueError, match="device"):   # kv_heads 2 of 8 heads passes the rules
        FP8KVCache(1, 8, 128, capacity=256, device="cpu", kv_heads=2)


def test_bench_case_cpu():
    from open_vc_attn.bench import modes
    assert "kvcache" in modes.CASES and "kvcache" not in modes.DEFAULT_CASES   # asked for by name
    [(_, spec), (_, grouped)] = modes.case_list(modes.parse_cases("kvcache"))
    assert spec == dict(kind="kv", cached=18 * 1560, chunk=3 * 1560, h=12), spec
    assert grouped == dict(spec, h=32, hk=8), grouped


@pytest.mark.gpu
def test_bench_grouped_step_agrees_with_cudnn(torch):
    """The kvcache case's entries at a small grouped shape: the step, the complete call and cuDNN BF16 (on the
    repeated heads) agree within the E4M3 error (check_outputs' rule)."""
    from open_vc_attn.bench import modes
    entries, flops = modes._kv_entries(torch, open_vc_attn, 3 * 1560, 1560, 8, hk=2)
    assert {"openvc", "openvc-full", "cudnn-bf16"} <= set(entries) and set(flops) == set(entries)
    errors = modes.check_outputs(torch, entries)
    for name in ("openvc", "openvc-full"):
        assert isinstance(errors[name], float) and errors[name] < 0.08, (name, errors[name])
