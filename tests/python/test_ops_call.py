"""open_vc_attn.ops.call: ``open_vc_attn::attention``, the one op of :func:`open_vc_attn.attention` (one C++ call,
openvc::attention). CPU: the op is registered with its fake (shapes and dtypes of every form) and its argument
checks. GPU: the bits of the step-wise path (prepare_fp8 then the attention ops) in every form, the LSE of the
keys as given with K smoothing, CUDA graph replay with new inputs, opcheck, torch.compile."""
import pytest

torch = pytest.importorskip("torch")
call = pytest.importorskip("open_vc_attn.ops.call")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def _op():
    return torch.ops.open_vc_attn.attention.default


@pytest.mark.parametrize("d", [128, 64])
def test_fake_shapes_of_every_form(d):
    bf = torch.bfloat16
    with FakeTensorMode():
        q = torch.empty(2, 300, 3, d, dtype=bf, device="cuda")
        k = torch.empty(2, 700, 3, d, dtype=bf, device="cuda")
        out, lse = _op()(q, k, k, None, None, 0, 0, None, 0.0, True, 4, True, None, "int8", True, "exp2")
        assert out.shape == q.shape and out.dtype == bf and lse.shape == (2, 3, 300) and lse.dtype == torch.float32
        out, lse = _op()(q, k, k, None, None, 0, 0, None, 0.0, False, 4, False, torch.float16, "e4m3", False, "expcast")
        assert out.dtype == torch.float16 and lse.shape == (0,)
        fq, fk = torch.empty(1301, 3, d, dtype=bf, device="cuda"), torch.empty(900, 3, d, dtype=bf, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = _op()(fq, fk, fk, cu, cu, 1000, 700, None, 0.0, False, 4, True, None, "e4m3", True, "expcast")
        assert out.shape == (1301, 3, d) and lse.shape == (3, 1301)


def test_argument_errors_name_the_argument():
    with FakeTensorMode():
        q = torch.empty(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="^qk_format"):
            _op()(q, q, q, None, None, 0, 0, None, 0.0, False, 4, False, None, "int4", False, "expcast")
        with pytest.raises(ValueError, match="^p_format"):
            _op()(q, q, q, None, None, 0, 0, None, 0.0, False, 4, False, None, "e4m3", False, "exp2")
        with pytest.raises(ValueError, match="^q"):
            _op()(q[0], q, q, None, None, 0, 0, None, 0.0, False, 4, False, None, "e4m3", False, "expcast")


def _randn(shape, g):
    return torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)


def _stepwise(q, k, v, causal=False, seqused_k=None, return_lse=True, varlen=None, **fmt):
    """The step-wise path: prepare_fp8, then the attention op (attention_fp8 / _full), through the public API."""
    import open_vc_attn as ova
    pfmt = fmt.pop("p_format", "expcast")
    if varlen is None:
        p = ova.prepare_fp8(q, k, v, seqused_k=seqused_k, **fmt)
    else:
        p = ova.prepare_fp8(q, k, v, *varlen, seqused_k=seqused_k, **fmt)
    return ova.attention_fp8(p, causal=causal, return_lse=return_lse and not fmt.get("k_smoothing"), p_format=pfmt)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_same_bits_as_the_stepwise_path(d):
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = _randn((2, 700, 3, d), g), _randn((2, 900, 3, d), g), _randn((2, 900, 3, d), g)
    counts = torch.tensor([900, 333], dtype=torch.int32, device="cuda")
    int8x = dict(qk_format="int8", k_smoothing=True, p_format="exp2")
    for kw in ({}, {"causal": True}, {"seqused_k": counts}, dict(int8x, causal=True), dict(int8x, seqused_k=counts)):
        smooth = kw.get("k_smoothing", False)
        res = ova.attention(q, k, v, return_lse=True, **kw)
        ref = _stepwise(q, k, v, **kw)
        if smooth:   # the step-wise path has no LSE with smoothing: the outputs
            assert torch.equal(res[0], ref), kw
        else:
            assert torch.equal(res[0], ref[0]) and torch.equal(res[1], ref[1]), kw
    # packed, uneven, with an empty sequence
    fq, fk, fv = _randn((1400, 3, d), g), _randn((1000, 3, d), g), _randn((1000, 3, d), g)
    cu_q = torch.tensor([0, 700, 700, 1400], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 333, 1000, 1000], dtype=torch.int32, device="cuda")
    varlen = (cu_q, cu_k, 700, 667)
    for kw in ({}, {"causal": True}, dict(qk_format="int8")):
        out, lse = ova.attention(fq, fk, fv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=700, max_seqlen_k=667,
                                 return_lse=True, **kw)
        ref_out, ref_lse = _stepwise(fq, fk, fv, varlen=varlen, **kw)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), kw


@pytest.mark.gpu
def test_gpu_lse_with_k_smoothing_is_the_lse_of_the_keys_as_given():
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(9)
    q = _randn((1, 512, 2, 128), g)
    k = _randn((1, 1024, 2, 128), g) + 2.0 * _randn((1, 1, 2, 128), g)   # a per-channel K offset
    v = _randn((1, 1024, 2, 128), g)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 128 ** -0.5
    exact = torch.logsumexp(s, -1)
    for fmt in ("int8", "e4m3"):
        _, lse = ova.attention(q, k, v, return_lse=True, qk_format=fmt, k_smoothing=True)
        _, plain = ova.attention(q, k, v, return_lse=True, qk_format=fmt)
        err, err_plain = (float((x.double() - exact).abs().mean()) for x in (lse, plain))
        assert err <= err_plain * 1.2 + 2e-3, (fmt, err, err_plain)   # no shift of scale * q . mean(K) left


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph_with_new_inputs():
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (_randn((1, 1000, 4, 128), g) for _ in range(3))
    kw = dict(causal=True, qk_format="int8", k_smoothing=True, return_lse=True)
    ova.attention(q, k, v, **kw)   # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = ova.attention(q, k, v, **kw)
    for seed in (11, 12):
        g.manual_seed(seed)
        for x in (q, k, v):
            x.copy_(_randn(x.shape, g))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = ova.attention(q, k, v, **kw)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
def test_gpu_opcheck_and_compile():
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (_randn((1, 300, 2, 128), g) for _ in range(3))
    torch.library.opcheck(_op(), (q, k, v, None, None, 0, 0, None, 0.0, True, 4, True, None, "int8", True, "exp2"))
    fn = torch.compile(lambda a, b, c: ova.attention(a, b, c, causal=True, qk_format="int8", k_smoothing=True),
                       fullgraph=True)
    assert torch.equal(fn(q, k, v), ova.attention(q, k, v, causal=True, qk_format="int8", k_smoothing=True))


def test_v_bias_correction_fake_and_rules():
    """The op takes v_bias_correction (fake shapes as without it); with E4M3 Q/K (no kernel has the correction)
    it raises ValueError naming it; a non-bool raises TypeError naming it."""
    bf = torch.bfloat16
    with FakeTensorMode():
        q = torch.empty(2, 300, 3, 128, dtype=bf, device="cuda")
        out, lse = _op()(q, q, q, None, None, 0, 0, None, 0.0, False, 4, True, None, "int8", True, "expcast", None,
                         None, 1, True)
        assert out.shape == q.shape and lse.shape == (2, 3, 300)
        with pytest.raises(ValueError, match="v_bias_correction.*qk_format='int8'"):
            _op()(q, q, q, None, None, 0, 0, None, 0.0, False, 4, False, None, "e4m3", False, "expcast", None,
                  None, 1, True)
    import open_vc_attn as ova
    with pytest.raises(TypeError, match="v_bias_correction"):
        ova.attention(torch.zeros(1, 8, 1, 128), torch.zeros(1, 8, 1, 128), torch.zeros(1, 8, 1, 128),
                      v_bias_correction="yes")
