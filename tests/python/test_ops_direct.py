"""open_vc_attn.ops.direct: api's eager calls run the ops' CUDA implementations without the dispatcher,
and anything that must see the op (torch.compile, dispatch modes, tensor subclasses) still gets it.

CPU only (torch, no GPU): a TorchDispatchMode records the op calls instead of running them, and the
CUDA implementations are replaced by recorders, so that both ways of direct.run are checked with their
arguments, and what api hands them.
"""
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

direct = pytest.importorskip("open_vc_attn.ops.direct")
from open_vc_attn.ops import fp8  # noqa: E402


class RecordOps(TorchDispatchMode):
    """Records open_vc_attn op calls (name, args) and returns placeholders instead of running them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        if name.startswith("open_vc_attn::"):
            self.calls.append((name, args))
            return tuple(torch.zeros(1) for _ in func._schema.returns)
        return func(*args, **(kwargs or {}))


def tensors(n=6):
    return tuple(torch.zeros(2) for _ in range(n))


def test_eager_holds_for_plain_tensors_only():
    t = torch.zeros(2)
    assert direct.eager(t, None, t)
    assert direct.eager(t, [0, 1])                                   # not a tensor: the implementation names it
    assert not direct.eager(t, torch.nn.Parameter(torch.zeros(2)))   # a subclass: the op handles it
    with RecordOps():
        assert not direct.eager(t)                                   # a dispatch mode is active


def test_eager_is_false_under_torch_compile():
    def f(x):
        return x + 1 if direct.eager(x) else x - 1
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.zeros(3)
    assert torch.equal(f(x), x + 1) and torch.equal(compiled(x), x - 1)


def _same(got, want):
    """Tensors by identity, the rest by value."""
    return len(got) == len(want) and all(g is w if isinstance(w, torch.Tensor) else g == w for g, w in zip(got, want))


def test_run_calls_the_op_under_a_mode_with_its_schema_arguments():
    """direct.run: the registered op when something must see it (here a dispatch mode), with the arguments as
    given (the schema's order; torch may leave trailing defaults out)."""
    from open_vc_attn import ops
    q, k, v = tensors(3)
    cu = torch.zeros(2, dtype=torch.int32)
    six = tensors()
    prepare = (q, k, v, cu, cu, 5, 7, None, "int8", True)
    attend = (*six, cu, cu, 5, 7, 0.5, True, 4, False, None, torch.float16, "int8", "exp2", "general")
    impl = lambda *a: pytest.fail("the implementation ran under a dispatch mode")
    with RecordOps() as mode:
        direct.run(ops.prepare_fp8_op, impl, (q, k, v, cu, cu, None), *prepare)
        direct.run(ops.attention_fp8_op, impl, (*six, cu, cu, None), *attend)
        direct.run(ops.attention_fp8_op, impl, six, *six, None, None, 0, 0, 0.0, False, -1, True)
    assert [name for name, _ in mode.calls] == ["open_vc_attn::prepare_fp8"] + ["open_vc_attn::attention_fp8"] * 2
    args = [a for _, a in mode.calls]
    assert _same(args[0], prepare) and _same(args[1], attend)
    assert _same(args[2][:14], (*six, None, None, 0, 0, 0.0, False, -1, True))


def test_run_calls_the_implementation_when_eager():
    from open_vc_attn import ops
    calls = []
    impl = lambda *a: calls.append(a) or "impl"
    q, k, v = tensors(3)
    args = (q, k, v, None, None, 0, 0, None, "e4m3", False)
    assert direct.run(ops.prepare_fp8_op, impl, (q, k, v, None), *args) == "impl" and _same(calls[0], args)
    # under the profiler a direct call keeps the op's name
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        direct.run(ops.attention_fp8_op, impl, tensors(), *tensors(), None, None, 0, 0, 0.5, False, 4, False)
    assert "open_vc_attn::attention_fp8" in {e.key for e in prof.key_averages()}


def test_api_runs_the_step_wise_implementations(monkeypatch):
    """open_vc_attn.prepare_fp8 / attention_fp8 eagerly: the ops' CUDA implementations (fp8.prepare_cuda,
    fp8.attention_cuda) with the schemas' arguments, route left to the op (path "auto")."""
    import open_vc_attn
    calls = []

    def recorder(name, result):
        def impl(*args):
            calls.append((name, args))
            return result
        return impl
    monkeypatch.setattr(fp8, "prepare_cuda", recorder("prepare_cuda", tensors()))
    monkeypatch.setattr(fp8, "attention_cuda", recorder("attention_cuda", (torch.zeros(1, 8, 2, 128), None)))
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    p = open_vc_attn.prepare_fp8(q[0], q[0], q[0], qk_format="int8", k_smoothing=True)
    name, args = calls[0]
    assert name == "prepare_cuda" and args[3:] == (None, None, 0, 0, None, "int8", True)
    assert all(a.shape == (1, 8, 2, 128) for a in args[:3])   # rank 3 reaches the op as a batch of one
    assert (p.input_rank, p.batch, p.seqlen_q, p.qk_format, p.k_smoothing) == (3, 1, 8, "int8", True)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    open_vc_attn.prepare_fp8(q[0], q[0], q[0], cu, cu, 8, 8)
    assert calls[1][1][3:] == (cu, cu, 8, 8, None, "e4m3", False)
    # attention_fp8 (its own checks of the preparation bypassed: the tensors here are placeholders)
    from open_vc_attn import _checks
    monkeypatch.setattr(_checks, "check_prepared_fp8", lambda prepared, **kw: dict(
        batch=1, seqlen_q=8, seqlen_k=8, heads=2, kv_heads=2, head_dim=128, input_rank=4))
    prepared = open_vc_attn.PreparedFP8(*tensors(), batch=1, seqlen_q=8, seqlen_k=8, heads=2, head_dim=128,
                                        input_rank=4, dtype=torch.bfloat16, qk_format="int8")
    out = open_vc_attn.attention_fp8(prepared, causal=True, mid_window_blocks=None, p_format="exp2")
    name, args = calls[2]
    assert name == "attention_cuda" and out.shape == (1, 8, 2, 128)
    assert _same(args, (*prepared.tensors(), None, None, 0, 0, 0.0, True, -1, False, None, None, "int8", "exp2"))


def test_attention_runs_the_one_op_or_its_implementation(monkeypatch):
    """open_vc_attn.ops.call.attention (api.attention's one call): the op under a dispatch mode, with the
    schema's arguments in order; its CUDA implementation directly when eager."""
    from open_vc_attn.ops import call
    q, k, v = tensors(3)
    args = (q, k, v, None, None, 0, 0, None, 0.5, True, 4, True, None, "int8", True, "exp2", None, None, 1, False)
    with RecordOps() as mode:
        call.attention(*args)
    assert [n for n, _ in mode.calls] == ["open_vc_attn::attention"]
    got = mode.calls[0][1]
    # The dispatcher drops trailing arguments equal to their defaults (the key block lists' None).
    assert all(g is w if isinstance(w, torch.Tensor) else g == w for g, w in zip(got, args)) and len(got) == 16
    seen = []
    monkeypatch.setattr(call, "attention_cuda", lambda *a: seen.append(a) or "attention_cuda")
    assert (call.attention(*args) == "attention_cuda" and len(seen[0]) == len(args)
            and all(a is b for a, b in zip(seen[0], args)))
