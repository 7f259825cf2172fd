"""open_vc_attn.rotary.rotary_pairs (openvc::rotary_pairs, docs/api.md): the rotary embedding of interleaved
pairs in one pass, bit for bit the values of diffusers 0.42.1's two forms written out in torch here (the
CogVideoX / EasyAnimate / Flux form of apply_rotary_emb, per-element [S, D] tables; Mochi's, per-pair [S, H,
D / 2] tables), in place on strided slices and into a slice of a larger buffer (the elements around it
untouched), BF16 and FP16, head dims 64 and 128, under torch.compile and CUDA graph replay; and the argument
rules (CPU tests: they run before any device work).
On an H200: python3 -m pytest -q -rs tests/python/test_gpu_rotary.py
"""
import pytest

from open_vc_attn.rotary import rotary_pairs


def diffusers_interleaved(torch, x, cos, sin):
    """diffusers 0.42.1 apply_rotary_emb(x [B, H, S, D], (cos, sin) [S, D], use_real=True, unbind dim -1)."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos[None, None] + x_rotated.float() * sin[None, None]).to(x.dtype)


def diffusers_mochi(torch, x, freqs_cos, freqs_sin):
    """diffusers 0.42.1 MochiAttnProcessor2_0's rotation of x [B, S, H, D] by [S, H, D / 2] tables."""
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
    return torch.stack([cos, sin], dim=-1).flatten(-2)


def angles(torch, s, pairs, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(s, pairs, device="cuda", generator=g) * 40.0


def same_bits(torch, a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,d", [("bfloat16", 64), ("float16", 128), ("bfloat16", 128)])
def test_gpu_interleaved_form_in_place_on_a_slice(torch, dtype_name, d):
    """CogVideoX's call: x [B, H, text + S, D] (a LayerNorm output), the video rows rotated in place through
    a [B, S, H, D] view; the text rows keep their bits."""
    dtype = getattr(torch, dtype_name)
    b, h, text, s = 2, 3, 5, 77
    g = torch.Generator(device="cuda").manual_seed(d)
    x = (torch.randn(b, h, text + s, d, device="cuda", generator=g) * 3).to(dtype)
    theta = angles(torch, s, d, d)   # diffusers' [S, D] tables; a pair's two entries differ (table_stride_half)
    cos, sin = theta.cos(), theta.sin()
    want = x.clone()
    want[:, :, text:] = diffusers_interleaved(torch, x[:, :, text:], cos, sin)
    video = x[:, :, text:].transpose(1, 2)
    tables = [t.view(s, 1, d // 2, 2).expand(s, h, d // 2, 2) for t in (cos, sin)]
    assert rotary_pairs(video, *tables, out=video) is video
    assert same_bits(torch, x, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_gpu_pair_form_into_a_slice(torch, dtype_name):
    """Mochi's call: x [B, S, H, 128] rotated by per-pair [S, H, 64] tables into the first S rows of a joint
    [B, S + T, H, 128] buffer poisoned with NaN: those rows equal diffusers' values, the others stay NaN."""
    dtype = getattr(torch, dtype_name)
    b, s, t, h, d = 2, 130, 7, 4, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(b, s, h, d, device="cuda", generator=g) * 2).to(dtype)
    theta = torch.rand(s, h, d // 2, device="cuda", generator=g) * 30.0
    fc, fs = theta.cos(), theta.sin()
    joint = torch.full((b, s + t, h, d), float("nan"), dtype=dtype, device="cuda")
    x_before = x.clone()
    rotary_pairs(x, *(f.unsqueeze(-1).expand(s, h, d // 2, 2) for f in (fc, fs)), out=joint[:, :s])
    assert same_bits(torch, joint[:, :s], diffusers_mochi(torch, x, fc, fs))
    assert torch.isnan(joint[:, s:]).all()
    assert same_bits(torch, x, x_before)


@pytest.mark.gpu
def test_gpu_new_output_empty_input_and_compile(torch):
    """out=None allocates; zero tokens do nothing; torch.compile(fullgraph=True) traces the op and gives the
    eager bits; a CUDA graph replays it on new inputs."""
    s, h, d = 33, 2, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    theta = torch.rand(s, h, d // 2, device="cuda", generator=g) * 10.0
    cos, sin = (f.unsqueeze(-1).expand(s, h, d // 2, 2) for f in (theta.cos(), theta.sin()))
    eager = rotary_pairs(x, cos, sin)
    assert same_bits(torch, eager, diffusers_mochi(torch, x, theta.cos(), theta.sin()))
    empty = x[:, :0]
    assert rotary_pairs(empty, cos[:0], sin[:0]).shape == empty.shape

    def f(a):
        out = torch.empty_like(a)
        rotary_pairs(a, cos, sin, out=out)
        return out * 1
    compiled = torch.compile(f, fullgraph=True)
    assert same_bits(torch, compiled(x), eager)

    def roped_slice(a):   # the processors' form: in place on a transposed slice of an intermediate [B, H, 1 + S, D]
        y = torch.cat([torch.zeros_like(a[:, :1]), a], 1).transpose(1, 2).contiguous()
        v = y[:, :, 1:].transpose(1, 2)
        rotary_pairs(v, cos, sin, out=v)
        return y
    in_place = torch.compile(roped_slice, fullgraph=True)(x)
    assert same_bits(torch, in_place[:, :, 1:].transpose(1, 2), eager) and not in_place[:, :, 0].any()

    static_x, static_out = x.clone(), torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary_pairs(static_x, cos, sin, out=static_out)
    x2 = torch.randn(1, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    static_x.copy_(x2)
    graph.replay()
    assert same_bits(torch, static_out, diffusers_mochi(torch, x2, theta.cos(), theta.sin()))


@pytest.mark.gpu
def test_gpu_separate_roundings_not_a_fused_multiply_add(torch):
    """a = 3, b = 1, cos = fp32(1/3), sin = 1: 3 * fp32(1/3) rounds to 1, so the first output is exactly 0; a fused
    multiply-add would give 3 * fp32(1/3) - 1 = 2.98e-8 (a BF16 value too)."""
    x = torch.tensor([3.0, 1.0], device="cuda").to(torch.bfloat16).view(1, 1, 1, 2)
    cos = torch.full((1, 1, 1, 2), 1.0 / 3.0, device="cuda")
    sin = torch.ones(1, 1, 1, 2, device="cuda")
    out = rotary_pairs(x, cos, sin)
    assert out[0, 0, 0, 0].item() == 0.0


@pytest.mark.gpu
def test_gpu_overlapping_outputs_are_refused(torch):
    """out overlapping x (also an exact alias that is not x itself), or a written tensor whose elements share memory
    (an expanded view), is a ValueError naming it: each element is read once and written once."""
    x = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    cos = torch.ones(7, 2, 32, 2, device="cuda")
    with pytest.raises(ValueError, match="^out: overlaps x's memory"):
        rotary_pairs(x[:, :7], cos, cos, out=x[:, 1:])
    with pytest.raises(ValueError, match="^out: overlaps x's memory"):
        rotary_pairs(x[:, :7], cos, cos, out=x[:, :7].view_as(x[:, :7]))
    wide = torch.zeros(1, 1, 2, 64, dtype=torch.bfloat16, device="cuda").expand(1, 7, 2, 64)
    with pytest.raises(ValueError, match="^out: its elements overlap"):
        rotary_pairs(x[:, :7], cos, cos, out=wide)
    with pytest.raises(ValueError, match="^x: its elements overlap"):
        rotary_pairs(wide, cos, cos, out=wide)


@pytest.mark.gpu
def test_gpu_ops_pass_opcheck(torch):
    """torch.library.opcheck of both ops (schema, fakes, dispatch), as the other ops of open_vc_attn.ops."""
    import open_vc_attn.ops  # noqa: F401
    x = torch.randn(1, 9, 2, 64, device="cuda").to(torch.bfloat16)
    cos, sin = (torch.rand(9, 2, 32, 2, device="cuda") for _ in range(2))
    torch.library.opcheck(torch.ops.open_vc_attn.rotary_pairs_.default, (x.clone(), cos, sin))
    torch.library.opcheck(torch.ops.open_vc_attn.rotary_pairs_out.default, (x, cos, sin, torch.empty_like(x)))


def test_argument_rules_name_the_argument(torch):
    """The rules, on meta tensors (no GPU: x's device is the last rule), and the ops' fakes (FakeTensorMode:
    CUDA tensors without a GPU) run the same rules."""
    m = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device="meta")
    x, cos = m(1, 4, 2, 64, dtype=torch.bfloat16), m(4, 2, 32, 2)
    cases = [
        (TypeError, "^x: expected a torch.Tensor", ([1], cos, cos)),
        (ValueError, "^x: expected rank 4", (x[0], cos, cos)),
        (TypeError, "^x: expected dtype", (x.float(), cos, cos)),
        (ValueError, "^x: head dim must be even", (m(1, 4, 2, 63, dtype=torch.bfloat16), cos, cos)),
        (ValueError, "^x: the head dim must be contiguous", (m(1, 4, 64, 2, dtype=torch.bfloat16).transpose(2, 3),
                                                           cos, cos)),
        (ValueError, "^x: the batch, token and head strides must be even", (m(1, 4, 2, 65, dtype=torch.bfloat16)
                                                                            [..., :64], cos, cos)),
        (ValueError, r"^cos: expected shape \[4, 2, 32, 2\]", (x, m(4, 64), cos)),
        (TypeError, "^sin: expected dtype torch.float32", (x, cos, cos.to(torch.bfloat16))),
        (ValueError, "^sin: expected cos's strides", (x, cos, m(4, 2, 2, 32).transpose(2, 3))),
        (ValueError, "^out: expected x's shape", (x, cos, cos, m(1, 4, 2, 64))),
        (ValueError, "^x: expected a CUDA tensor, got device meta", (x, cos, cos)),   # everything else is valid
    ]
    from open_vc_attn._checks_rotary import check_rotary_args
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            check_rotary_args(*args)
    with pytest.raises(ValueError, match="^x: expected a CUDA tensor"):
        rotary_pairs(torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 2, 32, 2),
                     torch.zeros(4, 2, 32, 2))


def test_op_fakes_check_the_same_rules(torch):
    pytest.importorskip("open_vc_attn._openvc_ext", reason="the extension is not built")
    from torch._subclasses.fake_tensor import FakeTensorMode
    import open_vc_attn.ops  # noqa: F401  (registers the ops)
    with FakeTensorMode():
        x = torch.empty(1, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
        cos = torch.empty(4, 2, 32, 2, device="cuda")
        torch.ops.open_vc_attn.rotary_pairs_(x, cos, cos)
        torch.ops.open_vc_attn.rotary_pairs_out(x, cos, cos, torch.empty_like(x))
        with pytest.raises(ValueError, match="^cos: expected shape"):
            torch.ops.open_vc_attn.rotary_pairs_(x, cos[:3], cos[:3])


def test_diffusers_tables_as_kernel_views(torch):
    """The replaced processors' table views: CogVideoX's per-element [S, D] tables shared by the heads, Mochi's
    per-pair [S, H, D / 2] tables shared by a pair's two elements, as the kernel's [S, H, D / 2, 2]."""
    from open_vc_attn.integrations import _diffusers_processors as procs
    cos = torch.randn(7, 64)
    v = procs.interleaved_table_view(cos, 3)
    assert v.shape == (7, 3, 32, 2) and v.stride()[1] == 0 and torch.equal(v[:, 2].reshape(7, 64), cos)
    fc = torch.randn(7, 3, 32)
    w = procs.pair_table_view(fc)
    assert w.shape == (7, 3, 32, 2) and w.stride()[3] == 0 and torch.equal(w[..., 1], fc)


@pytest.mark.gpu
def test_gpu_processors_take_the_kernel_only_where_its_bits_are_diffusers(torch):
    """FP32 / BF16 tables: the kernel's FP32 views; FP64 tables (diffusers then computes in FP64), tables of another
    shape, an FP32 x, or an expanded (self-overlapping) output: None, so the processor runs diffusers' form."""
    from open_vc_attn.integrations import _diffusers_processors as procs
    x = torch.zeros(1, 7, 3, 64, dtype=torch.bfloat16, device="cuda")
    cos = torch.randn(7, 64, device="cuda")
    view = lambda t: procs.interleaved_table_view(t, 3)
    assert procs._rotary_tables([(x, x)], cos, cos, (7, 64), view) is not None
    assert procs._rotary_tables([(x, x)], cos.bfloat16(), cos.bfloat16(), (7, 64), view)[0].dtype == torch.float32
    assert procs._rotary_tables([(x, x)], cos.double(), cos.double(), (7, 64), view) is None
    assert procs._rotary_tables([(x, x)], cos[:6], cos[:6], (7, 64), view) is None
    assert procs._rotary_tables([(x.float(), x.float())], cos, cos, (7, 64), view) is None
    wide = torch.zeros(1, 1, 3, 64, dtype=torch.bfloat16, device="cuda").expand(1, 7, 3, 64)
    assert procs._rotary_tables([(x, wide)], cos, cos, (7, 64), view) is None
