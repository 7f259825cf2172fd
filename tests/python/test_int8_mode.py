"""INT8 Q/K (qk_format="int8") and K smoothing (k_smoothing=True) through open_vc_attn (docs/numerics.md
section 9, docs/api.md).

- CPU, torch alone (CPU, meta and FakeTensorMode tensors; the device is checked last): the argument rules
  (qk_format's values and type, k_smoothing's type, INT8 where it would need the general path, INT8 with
  V repair, the VC baseline and the general-path op), the INT8 layouts of every op's fake implementation
  (batched and packed, head dim 64 and 128, LSE, FP16 out), PreparedFP8.from_quantized with INT8 codes,
  and torch.compile(fullgraph=True) tracing an INT8 call.
The GPU tests of the mode: test_gpu_int8_mode.py.
"""
import dataclasses

import pytest

import open_vc_attn
from open_vc_attn import PreparedFP8
from helpers import cpu_qkv

INT8 = dict(qk_format="int8")
SMOOTH = dict(qk_format="int8", k_smoothing=True)
DENSE = (None, None, 0, 0)   # attention_fp8's offsets and max lengths with a batched preparation


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode()


def int8_tensors(torch, b=1, sq=200, sk=300, h=2, d=128, device="cuda", packed=None):
    """The six tensors of an INT8 preparation (packed: (n, max_q, max_k), q/k codes [total, H, D])."""
    dev = dict(device=device)
    if packed is None:
        nk = -(-sk // 128)
        return (torch.empty(b, sq, h, d, dtype=torch.int8, **dev), torch.empty(b, h, sq, **dev),
                torch.empty(b, sk, h, d, dtype=torch.int8, **dev), torch.empty(b, h, nk, 8, **dev),
                torch.empty(b, h, d, nk * 128, dtype=torch.uint8, **dev), torch.empty(b, h, **dev))
    n, max_q, max_k = packed
    nk = -(-max_k // 128)
    return (torch.empty(sq, h, d, dtype=torch.int8, **dev), torch.empty(n, h, max_q, **dev),
            torch.empty(sk, h, d, dtype=torch.int8, **dev), torch.empty(n, h, nk, 8, **dev),
            torch.empty(n, h, d, nk * 128, dtype=torch.uint8, **dev), torch.empty(n, h, **dev))


def shapes(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


# ---- argument errors (CPU) -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["attention", "prepare_fp8"])
@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(qk_format="INT8"), ValueError, r"^qk_format: expected one of \['e4m3', 'int8'\], got 'INT8'"),
    (dict(qk_format="fp8"), ValueError, "^qk_format: expected one of"),
    (dict(qk_format=""), ValueError, "^qk_format: expected one of"),
    (dict(qk_format=None), ValueError, r"^qk_format: expected one of .*got None \(NoneType\)"),
    (dict(qk_format=8), ValueError, r"^qk_format: expected one of .*got 8 \(int\)"),
    (dict(qk_format=b"int8"), ValueError, "^qk_format: expected one of"),
    (dict(k_smoothing=1), TypeError, "^k_smoothing: expected a bool, got int"),
    (dict(k_smoothing="yes"), TypeError, "^k_smoothing: expected a bool"),
    (dict(k_smoothing=None), TypeError, "^k_smoothing: expected a bool"),
])
def test_format_argument_errors(torch, fn, kwargs, exc, msg):
    q, k, v = cpu_qkv(torch)   # checked before the tensors
    with pytest.raises(exc, match=msg):
        getattr(open_vc_attn, fn)(q, k, v, **kwargs)
    for good in (dict(qk_format="int8"), dict(qk_format="e4m3", k_smoothing=True), SMOOTH):
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):   # everything else is valid
            getattr(open_vc_attn, fn)(q, k, v, **good)


def test_lse_with_k_smoothing_is_taken_by_attention(torch):
    """attention() returns the LSE of the keys as given with K smoothing (the C++ one-call entry adds the
    smoothing term back, numerics section 9): return_lse=True with k_smoothing passes the format checks and
    reaches the device check (CPU tensors here); attention_fp8 on a smoothed preparation still refuses it
    (test_gpu_prepare_once_attend_twice)."""
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    for fmt in ("int8", "e4m3"):
        with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):
            open_vc_attn.attention(q, q, q, return_lse=True, qk_format=fmt, k_smoothing=True)


def test_int8_where_the_general_path_would_run_is_rejected_before_preparing(torch):
    """INT8 runs on the fast path only: a call past its range raises ValueError naming qk_format and the
    reason (E4M3 takes the general path there), from the ops' argument checks, which run before anything is
    prepared and which their fakes run too (FakeTensorMode here)."""
    from open_vc_attn import ops
    msg = r"^qk_format: 'int8' runs on the sm_90a fast path only.*ceil\(Sq/128\) \* ceil\(Sk/128\) \* 128 >= 2\^32"
    with fake_mode():
        big = torch.empty(1, 1 << 20, 1, 128, dtype=torch.bfloat16, device="cuda")   # 2^33: past the range
        for kw in (INT8, SMOOTH, dict(INT8, causal=True)):
            with pytest.raises(ValueError, match=msg):
                open_vc_attn.attention(big, big, big, **kw)
        with pytest.raises(ValueError, match=msg):
            open_vc_attn.prepare_fp8(big, big, big, **INT8)
        flat = big[0]
        cu = torch.empty(2, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=msg):
            open_vc_attn.attention(flat, flat, flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1 << 20,
                                   max_seqlen_k=1 << 20, **INT8)
        with pytest.raises(ValueError, match=msg):
            open_vc_attn.prepare_fp8(flat, flat, flat, cu, cu, 1 << 20, 1 << 20, **INT8)
        # a preparation of those sizes (from elsewhere) is not attended either
        prepared = PreparedFP8.from_quantized(*int8_tensors(torch, 1, 1 << 20, 1 << 20, 1, 128), **INT8)
        with pytest.raises(ValueError, match="^prepared.qk_format: 'int8' runs on the sm_90a fast path only"):
            open_vc_attn.attention_fp8(prepared)
        args = (*prepared.tensors(), *DENSE, 0.0, False, 4, False, None, None, "int8")
        with pytest.raises(ValueError, match="^qk_format: 'int8' runs on the sm_90a fast path only"):
            ops.attention_fp8_op(*args)
        with pytest.raises(ValueError, match=r"^path: 'fast' requires the sm_90a fast path, which cannot take this "
                                             r"call: ceil\(Sq/128\)"):
            ops.attention_fp8_op(*args, path="fast")


def test_general_path_op_rejects_int8(torch):
    from open_vc_attn import ops
    with fake_mode():
        t = int8_tensors(torch)
        with pytest.raises(ValueError, match=r"^qk_format: the general path \(open_vc_attn::attention_fp8 with "
                                             r"path='general'\) takes qk_format='e4m3' only, got 'int8'"):
            ops.attention_fp8_op(*t, *DENSE, 0.0, False, 4, False, None, None, "int8", path="general")
        with pytest.raises(ValueError, match="^qk_format: expected one of"):
            ops.attention_fp8_op(*t, *DENSE, 0.0, False, 4, False, None, None, "int4", path="fast")


def meta_int8_prepared(torch, **kw):
    return PreparedFP8(*int8_tensors(torch, device="meta"), batch=1, seqlen_q=200, seqlen_k=300, heads=2,
                       head_dim=128, input_rank=4, dtype=torch.bfloat16, **kw)


def test_repair_and_vc_reject_int8(torch):
    from open_vc_attn import baselines, repair
    q, k, v = cpu_qkv(torch, (1, 300, 2, 128))
    with pytest.raises(ValueError, match="^qk_format: V residual repair takes qk_format='e4m3' only, got 'int8'"):
        repair.prepare_v_repair(q, k, v, qk_format="int8")
    with pytest.raises(ValueError, match="^qk_format: expected one of"):
        repair.prepare_v_repair(q, k, v, qk_format="fp8")
    p = meta_int8_prepared(torch, qk_format="int8")
    with pytest.raises(ValueError, match="^prepared.qk_format: V residual repair takes qk_format='e4m3' only"):
        repair.prepare_v_repair(q, k, v, prepared=p)
    rep = repair.PreparedRepair(p, 0.01, "energy", 3, None, None, None, None)
    with pytest.raises(ValueError, match="^prepared.qk_format: V residual repair takes qk_format='e4m3' only"):
        repair.attention_v_repair(rep)
    for call in (lambda: baselines.prepare_vc(q, k, v, qk_format="int8"),
                 lambda: baselines.vc_attention(q, k, v, qk_format="int8")):
        with pytest.raises(ValueError, match="^qk_format: the VC baseline takes qk_format='e4m3' only, got 'int8'"):
            call()
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor"):   # E4M3 is taken
        baselines.vc_attention(q, k, v, qk_format="e4m3")


def test_prepared_format_fields_are_checked(torch):
    p = meta_int8_prepared(torch, qk_format="int8", k_smoothing=True)
    with pytest.raises(ValueError, match=r"^prepared\.q_codes: expected a CUDA tensor"):   # valid but for the device
        open_vc_attn.attention_fp8(p)
    cases = [
        (ValueError, r"^prepared\.qk_format: expected one of", dataclasses.replace(p, qk_format="INT8")),
        (TypeError, r"^prepared\.k_smoothing: expected a bool", dataclasses.replace(p, k_smoothing=0)),
        # INT8 tensors recorded as E4M3, and E4M3 tensors recorded as INT8: the layout check names them
        (TypeError, r"^prepared\.q_codes: expected dtype torch\.uint8", dataclasses.replace(p, qk_format="e4m3")),
        (ValueError, r"^prepared\.q_descale: expected shape \(1, 2, 200\)",
         dataclasses.replace(p, q_descale=torch.empty(1, 2, 2, device="meta"))),
        (ValueError, r"^prepared\.k_descale: expected shape \(1, 2, 3, 8\)",
         dataclasses.replace(p, k_descale=torch.empty(1, 2, 3, device="meta"))),
    ]
    for exc, msg, prepared in cases:
        with pytest.raises(exc, match=msg):
            open_vc_attn.attention_fp8(prepared)
    default = PreparedFP8(*[None] * 6, batch=1, seqlen_q=1, seqlen_k=1, heads=1, head_dim=128, input_rank=4,
                          dtype=torch.bfloat16)
    assert (default.qk_format, default.k_smoothing) == ("e4m3", False)


def test_from_quantized_int8(torch):
    names = ("q_codes", "q_descale", "k_codes", "k_descale", "v_packed", "v_descale")
    m = dict(device="meta")

    def args(**over):
        t = dict(zip(names, int8_tensors(torch, device="meta")))
        t.update(over)
        return t
    cases = [
        (TypeError, r"^q_codes: expected dtype torch\.int8 \(INT8 codes, qk_format='int8'\), got torch\.uint8",
         args(q_codes=torch.empty(1, 200, 2, 128, dtype=torch.uint8, **m))),
        (TypeError, r"^v_packed: expected dtype torch\.uint8", args(v_packed=torch.empty(1, 2, 128, 384,
                                                                                          dtype=torch.int8, **m))),
        (ValueError, r"^q_descale: expected shape \(1, 2, 200\) = \[B, H, Sq\]",
         args(q_descale=torch.empty(1, 2, 2, **m))),
        (ValueError, r"^k_descale: expected rank 4 \[B, H, ceil\(Sk/128\), 8\]",
         args(k_descale=torch.empty(1, 2, 3, **m))),
        (ValueError, r"^k_descale: expected shape \(1, 2, 3, 8\)", args(k_descale=torch.empty(1, 2, 3, 4, **m))),
        (ValueError, "^q_codes: expected a CUDA tensor, got device meta", args()),   # everything else is valid
    ]
    for exc, msg, kw in cases:
        with pytest.raises(exc, match=msg):
            PreparedFP8.from_quantized(**kw, qk_format="int8")
    with pytest.raises(ValueError, match="^qk_format: expected one of"):
        PreparedFP8.from_quantized(**args(), qk_format="E4M3")
    with pytest.raises(TypeError, match="^k_smoothing: expected a bool"):
        PreparedFP8.from_quantized(**args(), qk_format="int8", k_smoothing="no")
    with pytest.raises(TypeError, match=r"^q_codes: expected dtype torch\.uint8 or torch\.float8_e4m3fn"):
        PreparedFP8.from_quantized(**args())   # INT8 codes without qk_format="int8"
    with fake_mode():
        p = PreparedFP8.from_quantized(*int8_tensors(torch), qk_format="int8", k_smoothing=True)
        assert (p.qk_format, p.k_smoothing, p.batch, p.seqlen_q, p.seqlen_k) == ("int8", True, 1, 200, 300)
        assert p.q_codes.dtype == torch.int8 and p.k_codes.dtype == torch.int8
        t3 = [x[0] for x in int8_tensors(torch)]
        p3 = PreparedFP8.from_quantized(*t3, input_rank=3, qk_format="int8")
        assert p3.input_rank == 3 and open_vc_attn.attention_fp8(p3).shape == (200, 2, 128)


# ---- the ops' fake implementations with INT8 (FakeTensorMode: CUDA tensors without a GPU) ----------------

@pytest.mark.parametrize("d", [128, 64])
def test_fake_shapes_of_every_op(torch, d):
    from open_vc_attn import ops
    f32, i8, u8 = torch.float32, torch.int8, torch.uint8
    with fake_mode():
        q = torch.empty(2, 300, 3, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 700, 3, d, dtype=torch.bfloat16, device="cuda")
        for smooth in (False, True):
            t = ops.prepare_fp8_op(q, k, k, *DENSE, None, "int8", smooth)
            assert shapes(t) == [((2, 300, 3, d), i8), ((2, 3, 300), f32), ((2, 700, 3, d), i8), ((2, 3, 6, 8), f32),
                                 ((2, 3, d, 768), u8), ((2, 3), f32)]
        e4m3 = ops.prepare_fp8_op(q, k, k, *DENSE, None, "e4m3", True)   # K smoothing with E4M3: the E4M3 layouts
        assert shapes(e4m3)[:4] == [((2, 300, 3, d), u8), ((2, 3, 3), f32), ((2, 700, 3, d), u8), ((2, 3, 6), f32)]
        out, lse = ops.attention_fp8_op(*t, *DENSE, 0.0, False, 4, True, None, None, "int8")
        assert out.shape == (2, 300, 3, d) and out.dtype == torch.bfloat16 and lse.shape == (2, 3, 300)
        out, lse = ops.attention_fp8_op(*t, *DENSE, 0.1, False, -1, False, None, torch.float16, "int8")
        assert out.dtype == torch.float16 and lse.shape == (0,)
        counts = torch.empty(2, dtype=torch.int32, device="cuda")
        out, lse = ops.attention_fp8_op(*t, *DENSE, 0.0, True, 4, True, counts, None, "int8", path="fast")
        assert out.shape == (2, 300, 3, d) and lse.shape == (2, 3, 300)
        # E4M3 tensors given as INT8 (and the reverse) are named by the layout check
        with pytest.raises(TypeError, match=r"^q_codes: expected dtype torch\.int8"):
            ops.attention_fp8_op(*e4m3, *DENSE, 0.0, False, 4, False, None, None, "int8")
        with pytest.raises(TypeError, match=r"^q_codes: expected dtype torch\.uint8"):
            ops.attention_fp8_op(*t, *DENSE, 0.0, False, 4, False)
        # packed sequences
        qp = torch.empty(1301, 3, d, dtype=torch.bfloat16, device="cuda")
        kp = torch.empty(900, 3, d, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        tp = ops.prepare_fp8_op(qp, kp, kp, cu, cu, 1000, 700, None, "int8", True)
        assert shapes(tp) == [((1301, 3, d), i8), ((3, 3, 1000), f32), ((900, 3, d), i8), ((3, 3, 6, 8), f32),
                              ((3, 3, d, 768), u8), ((3, 3), f32)]
        used = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = ops.attention_fp8_op(*tp, cu, cu, 1000, 700, 0.0, True, 4, True, used, torch.float16, "int8",
                                        path="fast")
        assert out.shape == (1301, 3, d) and out.dtype == torch.float16 and lse.shape == (3, 1301)
        with pytest.raises(ValueError, match=r"^q_descale: expected shape \(3, 3, 1100\)"):
            ops.attention_fp8_op(*tp, cu, cu, 1100, 700, 0.0, False, 4, False, None, None, "int8", path="fast")
        with pytest.raises(ValueError, match="^qk_format: expected one of"):
            ops.prepare_fp8_op(qp, kp, kp, cu, cu, 1000, 700, None, "int4", False)


@pytest.mark.parametrize("d", [128, 64])
def test_api_int8_every_call_form_fake(torch, d):
    """attention / prepare_fp8 / attention_fp8 with qk_format="int8" (and K smoothing) in every call form,
    through the ops' fakes: shapes, dtypes, and the preparation's fields."""
    bf = torch.bfloat16
    with fake_mode():
        q = torch.empty(2, 300, 3, d, dtype=bf, device="cuda")
        k = torch.empty(2, 700, 3, d, dtype=bf, device="cuda")
        counts = torch.empty(2, dtype=torch.int32, device="cuda")
        mask = torch.ones(2, 700, dtype=torch.bool, device="cuda")
        for fmt in (INT8, SMOOTH):
            lse_ok = not fmt.get("k_smoothing", False)   # attention_fp8: no LSE on a smoothed preparation
            assert open_vc_attn.attention(q, k, k, **fmt).shape == q.shape
            out, lse = open_vc_attn.attention(q, k, k, causal=True, return_lse=True, **fmt)
            assert out.shape == q.shape and lse.shape == (2, 3, 300)
            assert open_vc_attn.attention(q, k, k, key_padding_mask=mask, **fmt).shape == q.shape
            assert open_vc_attn.attention(q, k, k, seqused_k=counts, causal=True, **fmt).shape == q.shape
            out = open_vc_attn.attention(q[0], k[0], k[0], out_dtype=torch.float16, **fmt)
            assert out.shape == (300, 3, d) and out.dtype == torch.float16
            p = open_vc_attn.prepare_fp8(q, k, k, seqused_k=counts, **fmt)
            assert (p.qk_format, p.k_smoothing) == ("int8", fmt.get("k_smoothing", False))
            assert p.q_codes.dtype == torch.int8 and p.q_descale.shape == (2, 3, 300)
            assert p.k_descale.shape == (2, 3, 6, 8)
            res = open_vc_attn.attention_fp8(p, causal=True, return_lse=lse_ok)
            out, lse = res if lse_ok else (res, torch.empty(2, 3, 300))
            assert out.shape == q.shape and lse.shape == (2, 3, 300)
            flat_q = torch.empty(1301, 3, d, dtype=bf, device="cuda")
            flat_k = torch.empty(900, 3, d, dtype=bf, device="cuda")
            cu = torch.empty(4, dtype=torch.int32, device="cuda")
            out, lse = open_vc_attn.attention(flat_q, flat_k, flat_k, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              max_seqlen_q=1000, max_seqlen_k=700, return_lse=True, **fmt)
            assert out.shape == (1301, 3, d) and lse.shape == (3, 1301)
            pp = open_vc_attn.prepare_fp8(flat_q, flat_k, flat_k, cu, cu, 1000, 700, **fmt)
            assert pp.is_varlen and pp.qk_format == "int8" and pp.q_descale.shape == (3, 3, 1000)
            assert open_vc_attn.attention_fp8(pp, causal=True).shape == (1301, 3, d)
            # the BF16 reference checks the format arguments and ignores them
            assert open_vc_attn.attention(q, k, k, version="reference", mode="bf16", **fmt).shape == q.shape


def test_torch_compile_fullgraph_traces_int8(torch):
    """torch.compile(fullgraph=True) traces an INT8 + K smoothing call: the graph holds the one op of
    attention() with the format arguments (FakeTensorMode inputs: no GPU needed; the GPU test runs it)."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return open_vc_attn.attention(q, k, v, causal=True, **SMOOTH)

    with fake_mode():
        q = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16, device="cuda")
        out = torch.compile(f, backend=backend, fullgraph=True)(q, q, q)
        assert out.shape == q.shape
    calls = {str(n.target): n.args for n in graphs[0].graph.nodes if n.op == "call_function"
             and str(n.target).startswith("open_vc_attn.")}
    assert set(calls) == {"open_vc_attn.attention.default"}
    assert calls["open_vc_attn.attention.default"][13:16] == ("int8", True, "expcast")
    assert calls["open_vc_attn.attention.default"][9] is True   # causal


def test_parameter_structs_carry_the_format(torch, monkeypatch):
    """What the CUDA implementations hand the extension (its enqueue replaced by a recorder, CPU tensors):
    PrepareParams.qk_format / .k_smoothing with the workspace of prepare_workspace_bytes(groups, heads,
    max_seqlen_k, k_smoothing), and Fp8Inputs.qk_format of the dense and the sequence attention."""
    from open_vc_attn import _ext
    from open_vc_attn.ops import device as dev
    from open_vc_attn.ops import fp8
    try:
        ext = _ext.load()
    except ImportError as exc:
        pytest.skip(f"compiled extension not available: {str(exc)[:80]}")
    seen = []
    monkeypatch.setattr(dev, "enqueue", lambda fn, params, device: seen.append(params))
    q = torch.zeros(2, 300, 3, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 700, 3, 64, dtype=torch.bfloat16)
    for fmt, smooth in (("int8", True), ("int8", False), ("e4m3", True), ("e4m3", False)):
        outs = fp8._prepare_outputs(q, k, dev.empty(q.device), fmt)
        fp8.launch_prepare(q, k, k, outs, None, qk_format=fmt, k_smoothing=smooth)
        p = seen[-1]
        assert p.qk_format == getattr(ext.QkFormat, fmt) and p.k_smoothing == smooth
        assert p.workspace_bytes >= ext.prepare_workspace_bytes(2, 3, 700, smooth)
    cu = torch.zeros(4, dtype=torch.int32)
    flat = torch.zeros(1000, 3, 64, dtype=torch.bfloat16)
    outs = fp8._prepare_outputs(flat, flat, dev.empty(q.device), "int8", (3, 600, 900))
    fp8.launch_prepare(flat, flat, flat, outs, dict(num_seqs=3, max_seqlen_q=600, max_seqlen_k=900,
                                                    cu_seqlens_q=cu.data_ptr(), cu_seqlens_k=cu.data_ptr(),
                                                    total_q=1000, total_k=1000), qk_format="int8", k_smoothing=True)
    assert seen[-1].qk_format == ext.QkFormat.int8 and seen[-1].workspace_bytes >= ext.prepare_workspace_bytes(
        3, 3, 900, True)
    t = fp8._prepare_outputs(q, k, dev.empty(q.device), "int8")
    fp8.enqueue_fast(t, (2, 300, 700, 3, 64), q.device, 0.0, 4, False, None, "int8")
    assert seen[-1].in_.qk_format == ext.QkFormat.int8
    fp8.enqueue_sequence(True, t, False, (2, 300, 700, 3, 64), q.device, None, None, 0, 0, 0.0, True, 4, True, None,
                         None, "int8")
    assert seen[-1].in_.qk_format == ext.QkFormat.int8 and seen[-1].causal
    fp8.enqueue_fast(fp8._prepare_outputs(q, k, dev.empty(q.device)), (2, 300, 700, 3, 64), q.device, 0.0, 4, False)
    assert seen[-1].in_.qk_format == ext.QkFormat.e4m3
