"""The P format (p_format="expcast" | "exp2") through open_vc_attn (docs/numerics.md "P format", docs/api.md).

- CPU, torch alone (CPU, meta and FakeTensorMode tensors; the device is checked last): the argument rules
  (p_format's values, "exp2" only with qk_format "int8", an attention option that prepare_fp8 does not take,
  the general-path op, V repair and the VC baseline rejecting exp2), the ops' fakes with p_format (shapes
  unchanged), torch.compile(fullgraph=True) tracing an exp2 call (the graph carries p_format), the parameter
  structs the eager paths hand the extension (AttentionParams.p_format from _openvc_ext.PFormat; an
  extension without PFormat runs "expcast" as before and refuses "exp2").
- Marked `gpu` (a compute capability 9.0 device with an extension that has PFormat): INT8 + K smoothing with
  exp2 more accurate than with ExpCast against float64 exact attention on N(0,1) and "q x2, K offset" inputs
  at S = 4096 (CPU emulation: 4.15% -> 3.82%, 3.91% -> 3.72%), every call class (dense, causal, key padding
  mask and counts, packed = per-sequence, D = 64, LSE, rank 3), one preparation attended with either P
  format, CUDA graph replay, torch.compile = eager, opcheck of the attention ops with "exp2".
On an H200: python3 -m pytest -q -rs tests/python/test_p_format.py
"""
import types
import warnings

import pytest

import open_vc_attn
from open_vc_attn import PreparedFP8
from helpers import cpu_qkv
from test_gpu_int8_mode import (_every_call_class, compile_matches_eager, exact, randn_qkv, rel_l2,
                                replay_matches_eager)
from test_int8_mode import DENSE, fake_mode, int8_tensors

SMOOTH = dict(qk_format="int8", k_smoothing=True)
EXP2 = dict(qk_format="int8", k_smoothing=True, p_format="exp2")
EXP2_PLAIN = dict(qk_format="int8", p_format="exp2")
RULE = r"^p_format: 'exp2' \(P as the E4M3 rounding of the exponential\) is implemented for INT8 Q/K only"


def e4m3_tensors(torch, b=1, sq=200, sk=300, h=2, d=128, device="meta"):
    nq, nk = -(-sq // 128), -(-sk // 128)
    dev = dict(device=device)
    return (torch.empty(b, sq, h, d, dtype=torch.uint8, **dev), torch.empty(b, h, nq, **dev),
            torch.empty(b, sk, h, d, dtype=torch.uint8, **dev), torch.empty(b, h, nk, **dev),
            torch.empty(b, h, d, nk * 128, dtype=torch.uint8, **dev), torch.empty(b, h, **dev))


def prepared_of(torch, fmt):
    tensors = int8_tensors(torch, device="meta") if fmt == "int8" else e4m3_tensors(torch)
    return PreparedFP8(*tensors, batch=1, seqlen_q=200, seqlen_k=300, heads=2, head_dim=128, input_rank=4,
                       dtype=torch.bfloat16, qk_format=fmt)


# ---- argument errors (CPU) -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["EXP2", "exp", "", "e4m3", None, 2, b"exp2"])
def test_p_format_values(torch, bad):
    q, k, v = cpu_qkv(torch)
    with pytest.raises(ValueError, match=r"^p_format: expected one of \['expcast', 'exp2'\]"):
        open_vc_attn.attention(q, k, v, qk_format="int8", p_format=bad)
    with pytest.raises(ValueError, match=r"^p_format: expected one of \['expcast', 'exp2'\]"):
        open_vc_attn.attention_fp8(prepared_of(torch, "int8"), p_format=bad)


def test_exp2_needs_int8(torch):
    """"exp2" with E4M3 Q/K raises ValueError naming p_format and why, before anything runs; with INT8 every
    argument is valid (the CPU tensors are what is refused)."""
    q, k, v = cpu_qkv(torch)
    for kw in (dict(p_format="exp2"), dict(p_format="exp2", k_smoothing=True),
               dict(p_format="exp2", qk_format="e4m3", version="reference", mode="bf16")):
        with pytest.raises(ValueError, match=RULE + r".*got qk_format='e4m3'; use p_format='expcast' or "
                                                    r"qk_format='int8'"):
            open_vc_attn.attention(q, k, v, **kw)
    for good in (EXP2, EXP2_PLAIN, dict(qk_format="int8", p_format="expcast"), dict(p_format="expcast")):
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):
            open_vc_attn.attention(q, k, v, **good)
    with pytest.raises(ValueError, match=RULE + r".*got prepared\.qk_format='e4m3'"):
        open_vc_attn.attention_fp8(prepared_of(torch, "e4m3"), p_format="exp2")
    for pf in ("exp2", "expcast"):
        with pytest.raises(ValueError, match=r"^prepared\.q_codes: expected a CUDA tensor"):
            open_vc_attn.attention_fp8(prepared_of(torch, "int8"), p_format=pf)


def test_p_format_is_an_attention_option(torch):
    """prepare_fp8 takes no p_format (one preparation may be attended with either)."""
    q, k, v = cpu_qkv(torch)
    with pytest.raises(TypeError, match="p_format"):
        open_vc_attn.prepare_fp8(q, k, v, qk_format="int8", p_format="exp2")
    assert "p_format" not in PreparedFP8.__dataclass_fields__


def test_ops_p_format_rules(torch):
    from open_vc_attn import ops
    with fake_mode():
        t8 = int8_tensors(torch)
        te = e4m3_tensors(torch, device="cuda")
        with pytest.raises(ValueError, match=r"^p_format: the general path \(open_vc_attn::attention_fp8 with "
                                             r"path='general'\) takes p_format='expcast' only, got 'exp2'"):
            ops.attention_fp8_op(*te, *DENSE, 0.0, False, 4, False, None, None, "e4m3", "exp2", path="general")
        with pytest.raises(ValueError, match="^qk_format: the general path"):   # INT8 is refused first
            ops.attention_fp8_op(*t8, *DENSE, 0.0, False, 4, False, None, None, "int8", "exp2", path="general")
        with pytest.raises(ValueError, match="^p_format: expected one of"):
            ops.attention_fp8_op(*te, *DENSE, 0.0, False, 4, False, None, None, "e4m3", "exp3", path="general")
        with pytest.raises(ValueError, match=RULE):
            ops.attention_fp8_op(*te, *DENSE, 0.0, False, 4, False, None, None, "e4m3", "exp2")
        with pytest.raises(ValueError, match=RULE):
            ops.attention_fp8_op(*te, *DENSE, 0.0, True, 4, False, None, None, "e4m3", "exp2", path="fast")
        with pytest.raises(ValueError, match="^p_format: expected one of"):
            ops.attention_fp8_op(*t8, *DENSE, 0.0, False, 4, False, None, None, "int8", "EXP2")
        with pytest.raises(ValueError, match="^p_format: expected one of"):
            ops.attention_fp8_op(*t8, *DENSE, 0.0, True, 4, False, None, None, "int8", "Exp2", path="fast")


def test_repair_and_vc_reject_exp2(torch):
    from open_vc_attn import baselines, repair
    q, k, v = cpu_qkv(torch, (1, 300, 2, 128))
    rep = repair.PreparedRepair(prepared_of(torch, "e4m3"), 0.01, "energy", 3, None, None, None, None)
    with pytest.raises(ValueError, match="^p_format: V residual repair takes p_format='expcast' only, got 'exp2'"):
        repair.attention_v_repair(rep, p_format="exp2")
    with pytest.raises(ValueError, match="^p_format: expected one of"):
        repair.attention_v_repair(rep, p_format="exp")
    with pytest.raises(ValueError, match="^p_format: the VC baseline takes p_format='expcast' only, got 'exp2'"):
        baselines.vc_attention(q, k, v, p_format="exp2")
    with pytest.raises(ValueError, match="^p_format: the VC baseline takes p_format='expcast' only"):
        baselines.attention_vc(object(), p_format="exp2")
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):   # expcast is taken
        baselines.vc_attention(q, k, v, p_format="expcast")


def test_p_format_rule_lives_in_checks():
    """One home: _checks.p_format (values, and exp2 only with INT8), used by api, ops and the policy."""
    from open_vc_attn import _checks, _layout
    assert _layout.P_FORMATS == ("expcast", "exp2")
    assert _checks.p_format("exp2", "int8") == "exp2" and _checks.p_format("expcast", "e4m3") == "expcast"
    assert _checks.p_format("exp2") == "exp2"   # the value alone
    with pytest.raises(ValueError, match=RULE + r".*got qk_format='e4m3'"):
        _checks.p_format("exp2", "e4m3")


# ---- fakes and tracing (FakeTensorMode: CUDA tensors without a GPU) --------------------------------------

@pytest.mark.parametrize("d", [128, 64])
def test_fakes_with_exp2(torch, d):
    """The attention ops' fakes take p_format; the shapes are those of ExpCast."""
    from open_vc_attn import ops
    with fake_mode():
        q = torch.empty(2, 300, 3, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 700, 3, d, dtype=torch.bfloat16, device="cuda")
        t = ops.prepare_fp8_op(q, k, k, *DENSE, None, "int8", True)
        for pf in ("expcast", "exp2"):
            out, lse = ops.attention_fp8_op(*t, *DENSE, 0.0, False, 4, True, None, None, "int8", pf)
            assert out.shape == (2, 300, 3, d) and out.dtype == torch.bfloat16 and lse.shape == (2, 3, 300)
            out, lse = ops.attention_fp8_op(*t, *DENSE, 0.1, False, -1, False, None, torch.float16, "int8", pf)
            assert out.dtype == torch.float16 and lse.shape == (0,)
            counts = torch.empty(2, dtype=torch.int32, device="cuda")
            out, lse = ops.attention_fp8_op(*t, *DENSE, 0.0, True, 4, True, counts, None, "int8", pf, path="fast")
            assert out.shape == (2, 300, 3, d) and lse.shape == (2, 3, 300)
            qp = torch.empty(1301, 3, d, dtype=torch.bfloat16, device="cuda")
            kp = torch.empty(900, 3, d, dtype=torch.bfloat16, device="cuda")
            cu = torch.empty(4, dtype=torch.int32, device="cuda")
            tp = ops.prepare_fp8_op(qp, kp, kp, cu, cu, 1000, 700, None, "int8", True)
            out, lse = ops.attention_fp8_op(*tp, cu, cu, 1000, 700, 0.0, True, 4, True, None, torch.float16, "int8", pf,
                                            path="fast")
            assert out.shape == (1301, 3, d) and out.dtype == torch.float16 and lse.shape == (3, 1301)


@pytest.mark.parametrize("d", [128, 64])
def test_api_exp2_every_call_form_fake(torch, d):
    bf = torch.bfloat16
    with fake_mode():
        q = torch.empty(2, 300, 3, d, dtype=bf, device="cuda")
        k = torch.empty(2, 700, 3, d, dtype=bf, device="cuda")
        counts = torch.empty(2, dtype=torch.int32, device="cuda")
        mask = torch.ones(2, 700, dtype=torch.bool, device="cuda")
        for fmt in (EXP2, EXP2_PLAIN):
            assert open_vc_attn.attention(q, k, k, **fmt).shape == q.shape
            out, lse = open_vc_attn.attention(q, k, k, causal=True, return_lse=True, **EXP2_PLAIN)
            assert out.shape == q.shape and lse.shape == (2, 3, 300)
            assert open_vc_attn.attention(q, k, k, key_padding_mask=mask, **fmt).shape == q.shape
            assert open_vc_attn.attention(q, k, k, seqused_k=counts, causal=True, **fmt).shape == q.shape
            out = open_vc_attn.attention(q[0], k[0], k[0], out_dtype=torch.float16, **fmt)
            assert out.shape == (300, 3, d) and out.dtype == torch.float16
            p = open_vc_attn.prepare_fp8(q, k, k, seqused_k=counts, qk_format="int8")
            out, lse = open_vc_attn.attention_fp8(p, causal=True, return_lse=True, p_format="exp2")
            assert out.shape == q.shape and lse.shape == (2, 3, 300)
            flat_q = torch.empty(1301, 3, d, dtype=bf, device="cuda")
            flat_k = torch.empty(900, 3, d, dtype=bf, device="cuda")
            cu = torch.empty(4, dtype=torch.int32, device="cuda")
            out, lse = open_vc_attn.attention(flat_q, flat_k, flat_k, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              max_seqlen_q=1000, max_seqlen_k=700, return_lse=True, **EXP2_PLAIN)
            assert out.shape == (1301, 3, d) and lse.shape == (3, 1301)
            pp = open_vc_attn.prepare_fp8(flat_q, flat_k, flat_k, cu, cu, 1000, 700, qk_format="int8")
            assert open_vc_attn.attention_fp8(pp, causal=True, p_format="exp2").shape == (1301, 3, d)


def test_torch_compile_fullgraph_carries_p_format(torch):
    """torch.compile(fullgraph=True) traces exp2 calls: the graph's one op (open_vc_attn::attention) carries
    p_format with the Q/K format, dense and causal."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def dense(q, k, v):
        return open_vc_attn.attention(q, k, v, **EXP2)

    def causal(q, k, v):
        return open_vc_attn.attention(q, k, v, causal=True, **EXP2_PLAIN)

    def default(q, k, v):
        return open_vc_attn.attention(q, k, v, qk_format="int8")

    with fake_mode():
        q = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16, device="cuda")
        for f in (dense, causal, default):
            torch.compile(f, backend=backend, fullgraph=True)(q, q, q)
    calls = [{str(n.target): n.args for n in gm.graph.nodes if n.op == "call_function"
              and str(n.target).startswith("open_vc_attn.")} for gm in graphs]
    op = "open_vc_attn.attention.default"   # attention() is one op; arguments 13..15 are the formats
    assert all(set(c) == {op} for c in calls)
    assert calls[0][op][13:16] == ("int8", True, "exp2")
    assert calls[1][op][13:16] == ("int8", False, "exp2") and calls[1][op][9] is True
    assert calls[2][op][13:16] == ("int8", False, "expcast")


# ---- what the eager paths hand the extension --------------------------------------------------------------

def _fake_ext(with_pformat=True):
    """A stand-in for _openvc_ext whose structs accept any field: what the parameter builders set."""
    struct = lambda: types.SimpleNamespace()
    ext = types.SimpleNamespace(AttentionParams=struct, GeneralAttentionParams=struct, Fp8Inputs=struct,
                                QkFormat=types.SimpleNamespace(e4m3="QK_E4M3", int8="QK_INT8"),
                                DType=types.SimpleNamespace(bfloat16="BF16", float16="FP16"),
                                attention_fp8="attention_fp8", attention_general="attention_general")
    if with_pformat:
        ext.PFormat = types.SimpleNamespace(expcast="P_EXPCAST", exp2="P_EXP2")
    return ext


def _launch_all(torch, fp8, dev, pf):
    """enqueue_fast, enqueue_sequence (fast, batched and packed) and the general path with p_format pf."""
    q = torch.zeros(2, 300, 3, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 700, 3, 64, dtype=torch.bfloat16)
    t = fp8._prepare_outputs(q, k, dev.empty(q.device), "int8")
    sizes = (2, 300, 700, 3, 64)
    fp8.enqueue_fast(t, sizes, q.device, 0.0, 4, False, None, "int8", pf)
    fp8.enqueue_sequence(True, t, False, sizes, q.device, None, None, 0, 0, 0.0, True, 4, True, None, None, "int8", pf)
    cu = torch.zeros(3, dtype=torch.int32)
    fp8.enqueue_sequence(True, t, True, (2, 300, 700, 3, 64), q.device, cu, cu, 200, 400, 0.0, False, 4, False, None,
                         None, "int8", pf)


def test_eager_paths_set_p_format_through_the_enum(torch, monkeypatch):
    """AttentionParams.p_format = _openvc_ext.PFormat.<name> on every fast-path launch; the general path's
    struct gets none (it computes ExpCast and never sees exp2)."""
    from open_vc_attn import _ext
    from open_vc_attn.ops import device as dev
    from open_vc_attn.ops import fp8
    seen = []
    monkeypatch.setattr(_ext, "load", _fake_ext)
    monkeypatch.setattr(dev, "enqueue", lambda fn, params, device: seen.append((fn, params)))
    for pf, code in (("exp2", "P_EXP2"), ("expcast", "P_EXPCAST")):
        seen.clear()
        _launch_all(torch, fp8, dev, pf)
        assert [fn for fn, _ in seen] == ["attention_fp8"] * 3
        assert all(p.p_format == code and p.in_.qk_format == "QK_INT8" for _, p in seen)
    seen.clear()
    t = fp8._prepare_outputs(torch.zeros(1, 200, 2, 128, dtype=torch.bfloat16),
                             torch.zeros(1, 300, 2, 128, dtype=torch.bfloat16), dev.empty("cpu"))
    fp8.enqueue_sequence(False, t, False, (1, 200, 300, 2, 128), torch.device("cpu"), None, None, 0, 0, 0.0, True, 4,
                         False, None)
    assert seen[-1][0] == "attention_general" and not hasattr(seen[-1][1], "p_format")


def test_extension_without_pformat(torch, monkeypatch):
    """An extension built before openvc::PFormat: "expcast" runs as before (the struct left as it is), "exp2"
    raises RuntimeError naming p_format instead of running ExpCast."""
    from open_vc_attn import _ext
    from open_vc_attn.ops import device as dev
    from open_vc_attn.ops import fp8
    seen = []
    monkeypatch.setattr(_ext, "load", lambda: _fake_ext(with_pformat=False))
    monkeypatch.setattr(dev, "enqueue", lambda fn, params, device: seen.append(params))
    _launch_all(torch, fp8, dev, "expcast")
    assert len(seen) == 3 and not any(hasattr(p, "p_format") for p in seen)
    with pytest.raises(RuntimeError, match="^p_format: 'exp2' needs an _openvc_ext built with openvc::PFormat"):
        _launch_all(torch, fp8, dev, "exp2")


def test_parameter_structs_of_the_real_extension(torch, monkeypatch):
    """The compiled extension: with PFormat, AttentionParams.p_format is the enum member of the string (default
    expcast); without (built before the P format), exp2 is refused. Skips where the extension is not built."""
    from open_vc_attn import _ext
    from open_vc_attn.ops import device as dev
    from open_vc_attn.ops import fp8
    try:
        ext = _ext.load()
    except ImportError as exc:
        pytest.skip(f"compiled extension not available: {str(exc)[:80]}")
    seen = []
    monkeypatch.setattr(dev, "enqueue", lambda fn, params, device: seen.append(params))
    if not hasattr(ext, "PFormat"):
        _launch_all(torch, fp8, dev, "expcast")
        with pytest.raises(RuntimeError, match="^p_format: 'exp2' needs"):
            _launch_all(torch, fp8, dev, "exp2")
        pytest.skip("_openvc_ext has no PFormat (built before the P format): exp2 refused, checked; the struct "
                    "fields need the pformat build")
    assert ext.AttentionParams().p_format == ext.PFormat.expcast
    for pf in ("exp2", "expcast"):
        seen.clear()
        _launch_all(torch, fp8, dev, pf)
        assert len(seen) == 3 and all(p.p_format == getattr(ext.PFormat, pf) for p in seen)


# ---- GPU -----------------------------------------------------------------------------------------------------

def _require_pformat():
    from open_vc_attn import _ext
    if not hasattr(_ext.load(), "PFormat"):
        pytest.skip("_openvc_ext has no PFormat (an extension built before the P format)")


@pytest.mark.gpu
def test_gpu_exp2_more_accurate_than_expcast(torch):
    """INT8 + K smoothing at S = 4096, H = 4, D = 128 against float64 exact attention on the bench's inputs
    (bench.qk_tradeoff.make_inputs, seed 0). CPU emulation (validated against the GPU): N(0,1) 4.15% (ExpCast)
    -> 3.82% (exp2); q x2, K offset 3.91% -> 3.72%."""
    _require_pformat()
    from open_vc_attn.bench import qk_tradeoff as qt
    err = {}
    for name, bound in (("N(0,1)", 0.040), ("q x2, K offset", 0.039)):
        q, k, v, _ = qt.make_inputs(4096, 4, 128, seed=0, names=(name,))[name]
        q, k, v = (torch.from_numpy(x).to(device="cuda", dtype=torch.bfloat16)[None] for x in (q, k, v))
        want = qt.exact_attention_fp64(q, k, v)
        expcast = rel_l2(open_vc_attn.attention(q, k, v, **SMOOTH), want)
        exp2 = rel_l2(open_vc_attn.attention(q, k, v, **EXP2), want)
        err[name] = (expcast, exp2)
        assert exp2 < 0.98 * expcast and exp2 < bound, err
    print("rel L2 (ExpCast, exp2):", err)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [EXP2, EXP2_PLAIN], ids=["int8+smooth+exp2", "int8+exp2"])
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_every_call_class_exp2(torch, fmt, d):
    """test_gpu_int8_mode's call classes with P = exp2: dense, causal, key padding mask and counts (= the calls on
    the kept keys, bit for bit), packed = each sequence alone, LSE, rank 3 and FP16 out, D = 64; no call falls
    to the general path."""
    _require_pformat()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*general path", category=RuntimeWarning)   # no general path
        _every_call_class(torch, fmt, d)


@pytest.mark.gpu
def test_gpu_one_preparation_either_p_format(torch):
    """p_format is an attention option: one INT8 preparation attended with exp2 gives attention(...,
    p_format="exp2"), with the default gives the ExpCast call, and the two differ (the option reaches the
    kernel)."""
    _require_pformat()
    q, k, v = randn_qkv(torch, 2, 700, 900, 3, seed=14)
    counts = torch.tensor([900, 333], dtype=torch.int32, device="cuda")
    p = open_vc_attn.prepare_fp8(q, k, v, seqused_k=counts, **SMOOTH)
    exp2 = open_vc_attn.attention_fp8(p, p_format="exp2")
    expcast = open_vc_attn.attention_fp8(p)
    assert torch.equal(exp2, open_vc_attn.attention(q, k, v, seqused_k=counts, **EXP2))
    assert torch.equal(expcast, open_vc_attn.attention(q, k, v, seqused_k=counts, **SMOOTH))
    with pytest.raises(ValueError, match="^prepared.k_smoothing: return_lse=True is not taken"):
        open_vc_attn.attention_fp8(p, return_lse=True, p_format="exp2")
    plain = open_vc_attn.prepare_fp8(q, k, v, seqused_k=counts, qk_format="int8")
    lse2 = open_vc_attn.attention_fp8(plain, return_lse=True, p_format="exp2")[1]
    lse1 = open_vc_attn.attention_fp8(plain, return_lse=True)[1]   # ExpCast's LSE of the same preparation
    want_lse = open_vc_attn.attention(q, k, v, seqused_k=counts, return_lse=True, **EXP2_PLAIN)[1]
    assert torch.equal(lse2, want_lse)
    assert not torch.equal(exp2, expcast)
    assert torch.equal(open_vc_attn.attention_fp8(p, causal=True, p_format="exp2"),
                       open_vc_attn.attention(q, k, v, seqused_k=counts, causal=True, **EXP2))
    assert float((lse2.double() - lse1.double()).abs().max()) < 0.1


@pytest.mark.gpu
def test_gpu_opcheck_exp2(torch):
    _require_pformat()
    ops = torch.ops.open_vc_attn
    q, k, v = randn_qkv(torch, 1, 130, 300, 2, seed=15)
    p = open_vc_attn.prepare_fp8(q, k, v, **SMOOTH)
    torch.library.opcheck(ops.attention_fp8.default, (*p.tensors(), *DENSE, 0.0, False, 4, True, None, None, "int8",
                                                      "exp2"))
    torch.library.opcheck(ops.attention_fp8.default, (*p.tensors(), *DENSE, 0.1, True, -1, True, None, None, "int8",
                                                      "exp2", "fast"))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_exp2(torch):
    _require_pformat()
    replay_matches_eager(torch, EXP2, EXP2_PLAIN, seeds=(16, 17, 18))


@pytest.mark.gpu
def test_gpu_torch_compile_equals_eager_exp2(torch):
    _require_pformat()
    compile_matches_eager(torch, 19, lse_fmt=EXP2_PLAIN, causal_fmt=EXP2_PLAIN, natural_fmt=EXP2)
