"""open_vc_attn.ops.direct: api's eager calls run the ops' CUDA implementations without the dispatcher,
and anything that must see the op (torch.compile, dispatch modes, tensor subclasses) still gets it.

CPU only (torch, no GPU): a TorchDispatchMode records the op calls instead of running them, and the
CUDA implementations are replaced by recorders, so that both routes are checked with their arguments.
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
    assert not direct.eager(t, torch.nn.Parameter(torch.zeros(2)))   # a subclass: the op handles it
    with RecordOps():
        assert not direct.eager(t)                                   # a dispatch mode is active


def test_eager_is_false_under_torch_compile():
    def f(x):
        return x + 1 if direct.eager(x) else x - 1
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.zeros(3)
    assert torch.equal(f(x), x + 1) and torch.equal(compiled(x), x - 1)


def test_modes_get_the_ops_with_their_schema_arguments():
    q, k, v = tensors(3)
    cu = torch.zeros(2, dtype=torch.int32)
    six = tensors()
    with RecordOps() as mode:
        direct.prepare_fp8(q, k, v, None)
        direct.prepare_fp8_varlen(q, k, v, cu, cu, 5, 7, None)
        direct.attention_fp8(six, 0.5, 4, True, None)
        direct.attention_sequence(True, six, cu, cu, 5, 7, 0.5, True, 4, False, None, torch.float16)
        direct.attention_sequence(False, six, None, None, 0, 0, 0.0, False, -1, True, None, None)
        direct.prepare_fp8(q, k, v, None, qk_format="int8", k_smoothing=True)
        direct.prepare_fp8_varlen(q, k, v, cu, cu, 5, 7, None, qk_format="int8", k_smoothing=True)
        direct.attention_fp8(six, 0.5, 4, True, None, qk_format="int8")
        direct.attention_sequence(True, six, cu, cu, 5, 7, 0.5, True, 4, False, None, None, qk_format="int8")
        direct.attention_fp8(six, 0.5, 4, True, None, qk_format="int8", p_format="exp2")
        direct.attention_sequence(True, six, cu, cu, 5, 7, 0.5, True, 4, False, None, None, qk_format="int8",
                                  p_format="exp2")
    names = [name for name, _ in mode.calls][:5]
    assert names == ["open_vc_attn::prepare_fp8", "open_vc_attn::prepare_fp8_varlen", "open_vc_attn::attention_fp8",
                     "open_vc_attn::attention_fp8_full", "open_vc_attn::attention_general"]
    def same(got, want):   # tensors by identity, the rest by value
        return len(got) == len(want) and all(g is w if isinstance(w, torch.Tensor) else g == w
                                             for g, w in zip(got, want))
    args = [a for _, a in mode.calls]
    assert same(args[0], (q, k, v, None)) or same(args[0], (q, k, v))
    assert same(args[1][:7], (q, k, v, cu, cu, 5, 7))
    assert same(args[2][:6], six) and same(args[2][6:9], (0.5, 4, True))
    assert same(args[3], (*six, cu, cu, 5, 7, 0.5, True, 4, False, None, torch.float16))
    assert same(args[4][:14], (*six, None, None, 0, 0, 0.0, False, -1, True))
    # the format arguments travel as the schemas' trailing arguments
    assert same(args[5], (q, k, v, None, "int8", True))
    assert same(args[6], (q, k, v, cu, cu, 5, 7, None, "int8", True))
    assert same(args[7], (*six, 0.5, 4, True, None, "int8"))
    assert same(args[8], (*six, cu, cu, 5, 7, 0.5, True, 4, False, None, None, "int8"))
    assert same(args[9], (*six, 0.5, 4, True, None, "int8", "exp2"))      # (the default "expcast" is left out)
    assert same(args[10], (*six, cu, cu, 5, 7, 0.5, True, 4, False, None, None, "int8", "exp2"))


def test_eager_calls_run_the_implementations(monkeypatch):
    calls = []

    def recorder(name):
        def impl(*args, **kwargs):
            calls.append((name, args, kwargs))
            return name
        return impl
    for name in ("prepare_cuda", "prepare_varlen_cuda", "attention_cuda", "sequence_cuda"):
        monkeypatch.setattr(fp8, name, recorder(name))
    q, k, v = tensors(3)
    six = tensors()
    assert direct.prepare_fp8(q, k, v, None) == "prepare_cuda"
    assert direct.attention_fp8(six, 0.5, 4, False) == "attention_cuda"
    assert direct.attention_sequence(False, six, None, None, 0, 0, 0.0, True, 4, False) == "sequence_cuda"
    e4m3 = {"qk_format": "e4m3", "k_smoothing": False}
    assert calls[0] == ("prepare_cuda", (q, k, v, None), e4m3)
    default = {"qk_format": "e4m3", "p_format": "expcast"}
    assert calls[1] == ("attention_cuda", (six, 0.5, 4, False, None), default)
    assert calls[2][1][:2] == (False, six) and calls[2][2] == default
    # the Q/K format reaches the implementations
    cu = torch.zeros(2, dtype=torch.int32)
    direct.prepare_fp8(q, k, v, None, qk_format="int8", k_smoothing=True)
    direct.prepare_fp8_varlen(q, k, v, cu, cu, 5, 7, None, qk_format="int8", k_smoothing=True)
    direct.attention_fp8(six, 0.5, 4, False, qk_format="int8")
    direct.attention_sequence(True, six, cu, cu, 5, 7, 0.0, True, 4, False, qk_format="int8")
    int8 = {"qk_format": "int8", "k_smoothing": True}
    assert calls[3][2] == int8 and calls[4][2] == int8
    assert calls[5][2]["qk_format"] == "int8" and calls[6][2]["qk_format"] == "int8"
    # and the P format
    direct.attention_fp8(six, 0.5, 4, False, qk_format="int8", p_format="exp2")
    direct.attention_sequence(True, six, cu, cu, 5, 7, 0.0, True, 4, False, qk_format="int8", p_format="exp2")
    assert calls[7][2]["p_format"] == "exp2" and calls[8][2]["p_format"] == "exp2"
    # under the profiler a direct call keeps the op's name
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        direct.attention_fp8(six, 0.5, 4, False)
    assert "open_vc_attn::attention_fp8" in {e.key for e in prof.key_averages()}


def test_attention_runs_the_one_op_or_its_implementation(monkeypatch):
    """open_vc_attn.ops.call.attention (api.attention's one call): the op under a dispatch mode, with the
    schema's arguments in order; its CUDA implementation directly when eager."""
    from open_vc_attn.ops import call
    q, k, v = tensors(3)
    args = (q, k, v, None, None, 0, 0, None, 0.5, True, 4, True, None, "int8", True, "exp2")
    with RecordOps() as mode:
        call.attention(*args)
    assert [n for n, _ in mode.calls] == ["open_vc_attn::attention"]
    got = mode.calls[0][1]
    assert all(g is w if isinstance(w, torch.Tensor) else g == w for g, w in zip(got, args)) and len(got) == len(args)
    seen = []
    monkeypatch.setattr(call, "attention_cuda", lambda *a: seen.append(a) or "attention_cuda")
    assert call.attention(*args) == "attention_cuda" and seen[0] == args
