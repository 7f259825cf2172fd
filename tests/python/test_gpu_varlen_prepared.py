"""Packed variable-length preparation (prepare_fp8 with cu_seqlens) and PreparedFP8.from_quantized.

Tests marked `gpu` need torch and a compute capability 9.0 device (conftest.py skips them otherwise); the
argument-validation tests run with torch alone on CPU / meta tensors (the device is checked last).
On an H200: python3 -m pytest -q -rs tests/python/test_gpu_varlen_prepared.py
"""
import dataclasses

import numpy as np
import pytest

import open_vc_attn
from open_vc_attn import _ext, reference as ref

PACKED_KEY_ORDER = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]   # openvc::kPackedKeyOrder
PreparedFP8 = open_vc_attn.PreparedFP8


def offsets(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def random_tokens(torch, total, h, d, dtype, seed, device="cuda"):
    """[total, H, D] bf16/fp16 normal values (a few outliers) and their exact float32 numpy copy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total, h, d, generator=g)
    x[torch.rand(total, h, d, generator=g) < 1e-3] *= 50.0
    x = x.to(dtype)
    return x.to(device), x.float().numpy()


def unpack_slab(packed, n):
    """One sequence's [H, D, S_pad] packed V -> its [n, H, D] codes, and the padding columns."""
    cols = np.arange(packed.shape[-1])
    keys = (cols // 16) * 16 + np.asarray(PACKED_KEY_ORDER)[cols % 16]
    codes = np.zeros(packed.shape[:2] + (n,), packed.dtype)
    codes[..., keys[keys < n]] = packed[..., keys < n]
    return codes.transpose(2, 0, 1), packed[..., keys >= n]


def bytes_equal(torch, a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


# ---- the extension's packed entry point (no torch): C++ checks run before any CUDA call ------------------

def test_extension_prepare_varlen_checks_arguments():
    ext = _ext.load()

    def params(num_seqs, max_q, max_k, head_dim=128, cu_k=16):
        p = ext.PrepareParams()
        p.num_seqs, p.max_seqlen_q, p.max_seqlen_k, p.heads, p.head_dim = num_seqs, max_q, max_k, 1, head_dim
        p.cu_seqlens_q, p.cu_seqlens_k = 16, cu_k
        p.total_q = p.total_k = 10
        return p

    with pytest.raises(ValueError, match=r"params\.cu_seqlens_k is null but cu_seqlens_q is set"):
        ext.prepare_fp8(params(1, 1, 1, cu_k=0), 0)
    with pytest.raises(ValueError, match=r"params\.num_seqs must be > 0"):
        ext.prepare_fp8(params(0, 1, 1), 0)
    with pytest.raises(ValueError, match=r"params\.max_seqlen_k must be > 0"):
        ext.prepare_fp8(params(2, 5, 0), 0)
    p = params(2, 5, 5)
    p.total_k = -1   # unset: the kernels could not clamp the offsets
    with pytest.raises(ValueError, match=r"params\.total_q and total_k .* are needed with cu_seqlens"):
        ext.prepare_fp8(p, 0)
    p = params(2, 5, 5, head_dim=64)
    p.dtype = ext.DType.float16
    p.q_codes = 16   # Q asked for (all of q, q_codes, q_descale null would be the K-and-V-only preparation)
    with pytest.raises(ValueError, match=r"params\.q\.data is null"):
        ext.prepare_fp8(p, 0)
    assert ext.prepare_workspace_bytes(3, 2, 1000, False) >= 24   # (num_seqs, heads, max_seqlen_k, k_smoothing) packed


# ---- prepare_fp8 with cu_seqlens: argument checks (CPU / meta tensors) --------------------------------

def cpu_varlen(torch, lens=(3, 5, 2), h=2, d=128, device="cpu", **over):
    total = int(sum(lens))
    a = dict(q=torch.zeros(total, h, d, dtype=torch.bfloat16).to(device),
             k=torch.zeros(total, h, d, dtype=torch.bfloat16).to(device),
             v=torch.zeros(total, h, d, dtype=torch.bfloat16).to(device),
             cu_seqlens_q=torch.from_numpy(offsets(lens)).to(device),
             cu_seqlens_k=torch.from_numpy(offsets(lens)).to(device),
             max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    a.update(over)
    return a


def test_varlen_argument_errors(torch):
    z, bf = torch.zeros, torch.bfloat16
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cases = [
        (TypeError, "cu_seqlens_k: expected an int32 CUDA tensor", dict(cu_seqlens_k=None)),
        (TypeError, "cu_seqlens_q: expected an int32 CUDA tensor", dict(cu_seqlens_q=[0, 3, 8, 10])),
        (TypeError, "cu_seqlens_q: expected dtype torch.int32", dict(cu_seqlens_q=cu.long())),
        (ValueError, "cu_seqlens_k: expected a 1-D tensor", dict(cu_seqlens_k=cu.view(2, 2))),
        (ValueError, "cu_seqlens_q: expected a 1-D tensor of N", dict(cu_seqlens_q=cu[:1])),
        (ValueError, "cu_seqlens_q: expected a contiguous tensor",
         dict(cu_seqlens_q=torch.zeros(8, dtype=torch.int32)[::2])),
        (ValueError, "cu_seqlens_k: expected 4 offsets like cu_seqlens_q", dict(cu_seqlens_k=cu[:3])),
        (TypeError, "max_seqlen_q: expected a Python int", dict(max_seqlen_q=None)),
        (TypeError, "max_seqlen_k: expected a Python int", dict(max_seqlen_k=torch.tensor(5))),
        (TypeError, "max_seqlen_k: expected a Python int", dict(max_seqlen_k=5.0)),
        (TypeError, "max_seqlen_q: expected a Python int", dict(max_seqlen_q=True)),
        (ValueError, r"max_seqlen_q: expected an int in \[1, 2\^31\)", dict(max_seqlen_q=0)),
        (ValueError, "max_seqlen_k: expected an int", dict(max_seqlen_k=2**31)),
        (ValueError, r"q: packed sequences \(cu_seqlens\) need rank 3 \[total_q, H, D\]",
         dict(q=z(1, 10, 2, 128, dtype=bf))),
        (ValueError, r"v: packed sequences \(cu_seqlens\) need rank 3 \[total_k, H, D\]",
         dict(v=z(1, 10, 2, 128, dtype=bf))),
        (ValueError, "k: expected 2 heads like q, or a divisor", dict(k=z(10, 3, 128, dtype=bf),
                                                                     v=z(10, 3, 128, dtype=bf))),
        (TypeError, "v: expected dtype torch.bfloat16 like q", dict(v=z(10, 2, 128, dtype=torch.float16))),
        (ValueError, "q: head_dim 96 is not supported", dict(q=z(10, 2, 96, dtype=bf), k=z(10, 2, 96, dtype=bf),
                                                            v=z(10, 2, 96, dtype=bf))),
        (ValueError, "q: expected a CUDA tensor, got device cpu", {}),   # everything else is valid
    ]
    for exc, msg, over in cases:
        with pytest.raises(exc, match=msg):
            open_vc_attn.prepare_fp8(**cpu_varlen(torch, **over))
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got device meta"):
        open_vc_attn.prepare_fp8(**cpu_varlen(torch, device="meta"))
    q = z(10, 2, 128, dtype=bf)
    with pytest.raises(ValueError, match="max_seqlen_q: only used with cu_seqlens_q and cu_seqlens_k"):
        open_vc_attn.prepare_fp8(q, q, q, max_seqlen_q=5)
    with pytest.raises(ValueError, match="max_seqlen_k: only used with cu_seqlens_q and cu_seqlens_k"):
        open_vc_attn.prepare_fp8(q, q, q, max_seqlen_k=5)


def meta_prepared(torch, b=1, sq=200, sk=300, h=2, d=128):
    m = dict(device="meta")
    nq, nk = -(-sq // 128), -(-sk // 128)
    return PreparedFP8(torch.empty(b, sq, h, d, dtype=torch.uint8, **m), torch.empty(b, h, nq, **m),
                       torch.empty(b, sk, h, d, dtype=torch.uint8, **m), torch.empty(b, h, nk, **m),
                       torch.empty(b, h, d, nk * 128, dtype=torch.uint8, **m), torch.empty(b, h, **m),
                       batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, head_dim=d, input_rank=4, dtype=torch.bfloat16)


def test_attention_fp8_checks_varlen_preparation(torch):
    """attention_fp8 takes packed preparations (the fast path's packed mode) and checks their layout."""
    p = meta_prepared(torch)
    assert not p.is_varlen
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    varlen = dataclasses.replace(p, cu_seqlens_q=cu, cu_seqlens_k=cu, input_rank=3)
    assert varlen.is_varlen
    with pytest.raises(ValueError, match=r"q_codes: packed sequences need rank 3 \[total, H, D\]"):
        open_vc_attn.attention_fp8(varlen)


# ---- PreparedFP8.from_quantized: argument checks (CPU / meta tensors) ------------------------------------

def quantized(torch, b=1, sq=200, sk=300, h=2, d=128, device="meta", rank=4):
    """The six tensors of a valid preparation (as a dict of from_quantized's argument names)."""
    t = dict(zip(("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale"),
                 meta_prepared(torch, b, sq, sk, h, d).tensors()))
    t = {n: torch.empty(x.shape, dtype=x.dtype, device=device) for n, x in t.items()}
    return {n: x[0] for n, x in t.items()} if rank == 3 else t


def test_from_quantized_errors(torch):
    u8, f32, m = torch.uint8, torch.float32, dict(device="meta")
    token_major = torch.empty(1, 384, 2, 128, dtype=u8, **m)        # [B, Sk_pad, H, D] buffer ...
    cases = [
        (TypeError, "v_packed: expected a torch.Tensor", dict(v_packed=np.zeros((1, 2, 128, 384), np.uint8))),
        (TypeError, r"q_codes: expected dtype torch\.uint8 or torch\.float8_e4m3fn",
         dict(q_codes=torch.empty(1, 200, 2, 128, dtype=torch.int8, **m))),
        (TypeError, r"k_codes: expected dtype torch\.uint8 or torch\.float8_e4m3fn",
         dict(k_codes=torch.empty(1, 300, 2, 128, dtype=torch.bfloat16, **m))),
        (TypeError, r"q_descale: expected dtype torch\.float32",
         dict(q_descale=torch.empty(1, 2, 2, dtype=torch.float16, **m))),
        (ValueError, r"v_packed: expected shape \(1, 2, 128, 384\) = \[B, H, D, ceil\(Sk/128\)\*128\]",
         dict(v_packed=torch.empty(1, 2, 128, 300, dtype=u8, **m))),
        # token-major V codes [B, Sk, H, D], contiguous: wrong layout
        (ValueError, r"v_packed: expected shape \(1, 2, 128, 384\).*token-major.*got \(1, 300, 2, 128\)",
         dict(v_packed=torch.empty(1, 300, 2, 128, dtype=u8, **m))),
        # ... and a permuted view of a token-major buffer: the right shape, not the packed layout
        (ValueError, "v_packed: expected a contiguous tensor", dict(v_packed=token_major.permute(0, 2, 3, 1))),
        (ValueError, "k_codes: expected 2 heads like q_codes",
         dict(k_codes=torch.empty(1, 300, 3, 128, dtype=u8, **m))),
        (ValueError, "k_codes: expected batch 1 like q_codes",
         dict(k_codes=torch.empty(2, 300, 2, 128, dtype=u8, **m))),
        (ValueError, "k_codes: expected head_dim 128 like q_codes",
         dict(k_codes=torch.empty(1, 300, 2, 64, dtype=u8, **m))),
        (ValueError, r"k_descale: expected shape \(1, 2, 3\)", dict(k_descale=torch.empty(2, 2, 3, dtype=f32, **m))),
        (ValueError, r"v_descale: expected shape \(1, 2\)", dict(v_descale=torch.empty(1, 3, dtype=f32, **m))),
        (ValueError, r"q_descale: expected shape \(1, 2, 2\)", dict(q_descale=torch.empty(1, 2, 1, dtype=f32, **m))),
        (ValueError, r"q_codes: expected rank 4 \[B, Sq, H, D\]",
         dict(q_codes=torch.empty(200, 2, 128, dtype=u8, **m))),
        (ValueError, "q_codes: head_dim 96 is not supported", quantized(torch, d=96)),
        (ValueError, "q_codes: expected non-empty dims", dict(q_codes=torch.empty(1, 0, 2, 128, dtype=u8, **m))),
        (ValueError, "inference-only", dict(v_descale=torch.zeros(1, 2, requires_grad=True))),
        (ValueError, "q_codes: expected a CUDA tensor, got device meta", {}),   # everything else is valid
        (ValueError, "q_codes: expected a CUDA tensor, got device cpu", quantized(torch, device="cpu")),
    ]
    for exc, msg, over in cases:
        args = quantized(torch)
        args.update(over)
        with pytest.raises(exc, match=msg):
            PreparedFP8.from_quantized(**args)
    with pytest.raises(ValueError, match="input_rank: expected 4"):
        PreparedFP8.from_quantized(**quantized(torch), input_rank=2)
    with pytest.raises(ValueError, match="dtype: expected None, torch.bfloat16 or torch.float16"):
        PreparedFP8.from_quantized(**quantized(torch), dtype=torch.float32)
    # input_rank 3: the same tensors without the batch axis.
    with pytest.raises(ValueError, match="q_codes: expected a CUDA tensor"):
        PreparedFP8.from_quantized(**quantized(torch, rank=3), input_rank=3)
    with pytest.raises(ValueError, match=r"q_codes: expected rank 3 \[Sq, H, D\] \(input_rank=3\)"):
        PreparedFP8.from_quantized(**quantized(torch), input_rank=3)
    with pytest.raises(ValueError, match=r"v_packed: expected shape \(2, 128, 384\) = \[H, D, ceil"):
        PreparedFP8.from_quantized(**dict(quantized(torch, rank=3), v_packed=torch.empty(2, 128, 300, dtype=u8, **m)),
                                   input_rank=3)
    if hasattr(torch, "float8_e4m3fn"):   # E4M3 dtypes are accepted for the codes
        fp8 = {n: torch.empty(1, *s, dtype=torch.float8_e4m3fn, device="meta")
               for n, s in (("q_codes", (200, 2, 128)), ("k_codes", (300, 2, 128)), ("v_packed", (2, 128, 384)))}
        with pytest.raises(ValueError, match="q_codes: expected a CUDA tensor, got device meta"):
            PreparedFP8.from_quantized(**dict(quantized(torch), **fp8))


# ---- GPU: packed preparation against the reference --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("lens_q,lens_k", [((1, 300, 1000), (700, 5, 129)), ((128, 129), (128, 129))])
def test_prepare_varlen_matches_reference(torch, dtype, d, lens_q, lens_k):
    tdt = getattr(torch, dtype)
    h = 2
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q, qn = random_tokens(torch, int(cu_q[-1]), h, d, tdt, seed=1)
    k, kn = random_tokens(torch, int(cu_k[-1]), h, d, tdt, seed=2)
    v, vn = random_tokens(torch, int(cu_k[-1]), h, d, tdt, seed=3)
    p = open_vc_attn.prepare_fp8(q, k, v, torch.tensor(cu_q, device="cuda"), torch.tensor(cu_k, device="cuda"),
                                 max(lens_q), max(lens_k))
    n = len(lens_q)
    assert p.is_varlen and (p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim, p.input_rank) == \
        (n, max(lens_q), max(lens_k), h, d, 3)
    for name, x, cu, codes, descale in (("q", qn, cu_q, p.q_codes, p.q_descale),
                                        ("k", kn, cu_k, p.k_codes, p.k_descale)):
        r = ref.quantize_blocks(x, cu_seqlens=cu)
        np.testing.assert_array_equal(codes.cpu().numpy(), r.codes, err_msg=f"{name} codes")
        np.testing.assert_array_equal(descale.cpu().numpy(), r.descale, err_msg=f"{name} descale")
    rv = ref.quantize_heads(vn, cu_seqlens=cu_k)
    np.testing.assert_array_equal(p.v_descale.cpu().numpy(), rv.descale)
    packed = p.v_packed.cpu().numpy()
    assert packed.shape == (n, h, d, -(-max(lens_k) // 128) * 128)
    for s in range(n):
        codes, padding = unpack_slab(packed[s], int(lens_k[s]))
        np.testing.assert_array_equal(codes, rv.codes[cu_k[s]:cu_k[s + 1]], err_msg=f"v codes of sequence {s}")
        assert not padding.any(), f"padding of sequence {s} must be code 0"
    # attention_fp8 takes the packed preparation: the same result as the one-call form.
    cq, ck = torch.tensor(cu_q, device="cuda"), torch.tensor(cu_k, device="cuda")
    want = open_vc_attn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lens_q),
                                  max_seqlen_k=max(lens_k))
    assert torch.equal(open_vc_attn.attention_fp8(p), want)


@pytest.mark.gpu
def test_prepare_varlen_batched_is_equal_lengths(torch):
    """cu = {0, S, 2S} over the flattened batch gives the batched preparation's bytes."""
    b, s, h, d = 2, 1000, 3, 128
    q, k, v = (random_tokens(torch, b * s, h, d, torch.bfloat16, seed=10 + i)[0] for i in range(3))
    batched = open_vc_attn.prepare_fp8(*(x.view(b, s, h, d) for x in (q, k, v)))
    cu = torch.tensor(offsets([s] * b), device="cuda")
    packed = open_vc_attn.prepare_fp8(q, k, v, cu, cu, s, s)
    for name, x, y in zip(("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale"),
                          packed.tensors(), batched.tensors()):
        assert bytes_equal(torch, x, y.reshape(x.shape)), name


@pytest.mark.gpu
def test_prepare_varlen_graph_and_no_sync(torch):
    """No host synchronization; captured in a CUDA graph, new offsets in the same tensors are followed."""
    h, d = 2, 128
    q, _ = random_tokens(torch, 1301, h, d, torch.bfloat16, seed=20)
    k, _ = random_tokens(torch, 1301, h, d, torch.bfloat16, seed=21)
    cu_q = torch.tensor(offsets([300, 1, 1000]), device="cuda")
    cu_k = torch.tensor(offsets([64, 1000, 237]), device="cuda")
    open_vc_attn.prepare_fp8(q, k, k, cu_q, cu_k, 1000, 1000)   # warm-up (module load, first launch)
    torch.cuda.set_sync_debug_mode("error")   # any synchronizing torch call now raises
    try:
        eager = open_vc_attn.prepare_fp8(q, k, k, cu_q, cu_k, 1000, 1000)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = open_vc_attn.prepare_fp8(q, k, k, cu_q, cu_k, 1000, 1000)
    graph.replay()
    torch.cuda.synchronize()
    assert all(bytes_equal(torch, x, y) for x, y in zip(captured.tensors(), eager.tensors()))
    cu_q.copy_(torch.tensor(offsets([1000, 299, 2]), device="cuda"))
    cu_k.copy_(torch.tensor(offsets([1000, 1, 300]), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = open_vc_attn.prepare_fp8(q, k, k, cu_q, cu_k, 1000, 1000)
    assert all(bytes_equal(torch, x, y) for x, y in zip(captured.tensors(), want.tensors()))
    assert not bytes_equal(torch, captured.q_descale, eager.q_descale)


@pytest.mark.gpu
def test_prepare_varlen_opcheck(torch):
    q, _ = random_tokens(torch, 260, 2, 128, torch.bfloat16, seed=30)
    k, _ = random_tokens(torch, 140, 2, 128, torch.bfloat16, seed=31)
    cu_q = torch.tensor(offsets([1, 130, 129]), device="cuda")
    cu_k = torch.tensor(offsets([40, 100, 0]), device="cuda")
    torch.library.opcheck(torch.ops.open_vc_attn.prepare_fp8.default, (q, k, k, cu_q, cu_k, 130, 100, None))


# ---- GPU: from_quantized round trip and rejections ---------------------------------------------------------

@pytest.mark.gpu
def test_from_quantized_round_trip(torch):
    b, s, h, d = 2, 1000, 2, 128
    q, k, v = (random_tokens(torch, b * s, h, d, torch.bfloat16, seed=40 + i)[0].view(b, s, h, d) for i in range(3))
    q = q[:, :300]   # Sq != Sk (a strided view: prepare_fp8 reads it in place)
    p = open_vc_attn.prepare_fp8(q, k, v)
    want, want_lse = open_vc_attn.attention_fp8(p, return_lse=True)
    again = PreparedFP8.from_quantized(*p.tensors())
    assert (again.batch, again.seqlen_q, again.seqlen_k, again.heads, again.head_dim, again.input_rank) == \
        (b, 300, s, h, d, 4)
    assert all(x.data_ptr() == y.data_ptr() for x, y in zip(again.tensors(), p.tensors())), "no copies"
    out, lse = open_vc_attn.attention_fp8(again, return_lse=True)
    assert bytes_equal(torch, out, want) and bytes_equal(torch, lse, want_lse)
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = [x.view(torch.float8_e4m3fn) if x.dtype == torch.uint8 else x for x in p.tensors()]
        assert bytes_equal(torch, open_vc_attn.attention_fp8(PreparedFP8.from_quantized(*fp8)), want)
    # Codes from a different place (a copy, e.g. received from another rank) give the same bytes.
    copied = PreparedFP8.from_quantized(*(x.clone() for x in p.tensors()), dtype=torch.bfloat16)
    assert bytes_equal(torch, open_vc_attn.attention_fp8(copied), want)
    # Rank 3: one sequence without the batch axis.
    p3 = open_vc_attn.prepare_fp8(q[0], k[0], v[0])
    r3 = PreparedFP8.from_quantized(*(x[0] for x in p3.tensors()), input_rank=3)
    out3 = open_vc_attn.attention_fp8(r3)
    assert out3.shape == (300, h, d) and bytes_equal(torch, out3, open_vc_attn.attention_fp8(p3))


@pytest.mark.gpu
def test_from_quantized_rejects_on_gpu(torch):
    q, k, v = (random_tokens(torch, 300, 2, 128, torch.bfloat16, seed=50 + i)[0].view(1, 300, 2, 128)
               for i in range(3))
    p = open_vc_attn.prepare_fp8(q, k, v)
    t = dict(zip(("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale"), p.tensors()))
    token_major, _ = unpack_slab(p.v_packed[0].cpu().numpy(), 300)   # the V codes, [Sk, H, D]
    cases = [
        # the V codes as a contiguous token-major [B, Sk, H, D] tensor instead of the packed layout
        (ValueError, r"v_packed: expected shape \(1, 2, 128, 384\)",
         dict(v_packed=torch.from_numpy(token_major).unsqueeze(0).cuda())),
        (ValueError, "v_packed: expected a contiguous tensor",
         dict(v_packed=p.v_packed.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1))),
        (ValueError, r"v_descale: expected a CUDA tensor on q_codes's device", dict(v_descale=p.v_descale.cpu())),
        (ValueError, "q_codes: expected a CUDA tensor, got device cpu", dict(q_codes=p.q_codes.cpu())),
        (ValueError, "k_codes: expected 2 heads like q_codes, or a divisor",
         dict(k_codes=torch.cat([p.k_codes, p.k_codes[:, :, :1]], dim=2))),
        # one K/V head (MQA) is a valid head count: the K/V tensors of two heads then have the wrong shape
        (ValueError, r"k_descale: expected shape \(1, 1, 3\)", dict(k_codes=p.k_codes[:, :, :1].contiguous())),
        (TypeError, r"k_descale: expected dtype torch\.float32", dict(k_descale=p.k_descale.double())),
    ]
    for exc, msg, over in cases:
        with pytest.raises(exc, match=msg):
            PreparedFP8.from_quantized(**dict(t, **over))
