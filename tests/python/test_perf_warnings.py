"""The direct API's one-time performance warnings (open_vc_attn._perf_warnings): the general path, and fast-path
calls with at most 256 keys per sequence, where torch SDPA measured faster (issue 28 item 5: no call class loses
silently). CPU tests check the reasons and the once-per-process rule; GPU tests check that attention and
attention_fp8 warn exactly for the calls the rule names, and that the warning changes no result. Every test starts
with no warning spent (conftest.py).
On an H200: python3 -m pytest -q -rs tests/python/test_perf_warnings.py
"""
import warnings

import pytest

import open_vc_attn
from open_vc_attn import _perf_warnings as pw


def test_the_category_is_exported_and_a_runtime_warning():
    assert open_vc_attn.PerformanceWarning is pw.PerformanceWarning
    assert issubclass(pw.PerformanceWarning, RuntimeWarning)   # filters written for RuntimeWarning still apply
    assert "PerformanceWarning" in open_vc_attn.__all__


@pytest.mark.parametrize("sk", [0, 1, 128, 200, 256])
def test_few_keys_reason_up_to_two_key_blocks(sk):
    reason = pw.few_keys_reason(sk)
    keys = "key" if sk == 1 else "keys"
    assert reason is not None and f"at most {sk} {keys} per sequence" in reason
    assert "SDPA" in reason and "docs/api.md" in reason


@pytest.mark.parametrize("sk", [257, 384, 512, 73397])
def test_no_few_keys_reason_from_the_third_block(sk):
    assert pw.few_keys_reason(sk) is None


def test_few_keys_warns_once_per_process():
    with pytest.warns(pw.PerformanceWarning, match=r"at most 100 keys per sequence \(<= 256\)"):
        pw.warn_few_keys(100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pw.warn_few_keys(100)   # already warned: silent, also for another count
        pw.warn_few_keys(7)
        pw.warn_few_keys(4096)   # not slow: silent


def test_few_keys_leaves_general_path_calls_to_their_own_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pw.warn_few_keys(100, general_reason="head_dim 96 (the fast path takes 128 or 64)")
    with pytest.warns(pw.PerformanceWarning):
        pw.warn_few_keys(100)   # the skipped call did not use up the one warning


def test_general_path_warns_once_per_reason():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pw.warn_general_path(None)   # the fast path: nothing
    with pytest.warns(pw.PerformanceWarning, match="runs on the general path"):
        pw.warn_general_path("reason A")
    with pytest.warns(pw.PerformanceWarning, match="reason B"):
        pw.warn_general_path("reason B")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pw.warn_general_path("reason A")


def test_after_a_call_the_general_path_takes_the_place_of_few_keys():
    with pytest.warns(pw.PerformanceWarning) as record:
        pw.warn_after_call("reason A", 100)
    assert len(record) == 1 and "reason A: this call runs on the general path" in str(record[0].message)
    with pytest.warns(pw.PerformanceWarning, match="at most 100 keys"):
        pw.warn_after_call(None, 100)


def test_the_warning_points_at_the_first_caller_outside_the_package():
    """The user's line, also when the call came through the package's own functions (Ulysses, repair, integrations)."""
    with pytest.warns(pw.PerformanceWarning) as record:
        pw.warn_few_keys(64)   # this line: the first frame outside open_vc_attn
    line = test_the_warning_points_at_the_first_caller_outside_the_package.__code__.co_firstlineno + 3
    assert (record[0].filename, record[0].lineno) == (__file__, line)


# ---- on the GPU: the calls that warn, and only those ----------------------------------------------------------

def _qkv(torch, sq, sk, h=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, sq, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, sk, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, sk, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in caught if issubclass(w.category, pw.PerformanceWarning)]


@pytest.mark.gpu
@pytest.mark.parametrize("sk", [128, 256])
def test_gpu_attention_with_few_keys_warns_once_at_the_callers_line(torch, sk):
    q, k, v = _qkv(torch, 1024, sk, seed=sk)
    out, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v))
    assert len(caught) == 1 and f"at most {sk} keys" in str(caught[0].message), [str(w.message) for w in caught]
    assert caught[0].filename == __file__   # the user's line, not the package's
    again, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v))
    assert caught == [] and torch.equal(out, again)   # once per process; the same result with or without it


@pytest.mark.gpu
def test_gpu_attention_from_the_third_key_block_is_silent(torch):
    q, k, v = _qkv(torch, 1024, 257, seed=1)
    _, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v))
    assert caught == []
    _, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v, causal=True))
    assert caught == []


@pytest.mark.gpu
def test_gpu_the_bf16_reference_never_warns(torch):
    q, k, v = _qkv(torch, 512, 64, seed=2)
    _, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v, version="reference", mode="bf16"))
    assert caught == []


@pytest.mark.gpu
def test_gpu_key_padding_warns_by_the_key_slots(torch):
    """Key counts and masks cut keys inside the Sk slots; the rule reads Sk (the tiles' key blocks)."""
    q, k, v = _qkv(torch, 512, 600, seed=3)
    used = torch.tensor([100], dtype=torch.int32, device="cuda")
    _, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v, seqused_k=used))
    assert caught == []   # 600 key slots: five blocks
    q, k, v = _qkv(torch, 512, 200, seed=4)
    mask = torch.ones(1, 200, dtype=torch.bool, device="cuda")
    mask[:, 150:] = False
    _, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v, key_padding_mask=mask))
    assert len(caught) == 1 and "at most 200 keys" in str(caught[0].message) and caught[0].filename == __file__


@pytest.mark.gpu
def test_gpu_packed_and_prepared_calls_warn_on_their_longest_key_sequence(torch):
    h, d = 2, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(600, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 200, 600], dtype=torch.int32, device="cuda")
    # max_seqlen_k 400: the longest sequence has four key blocks, so no warning
    _, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                            max_seqlen_q=400, max_seqlen_k=400))
    assert caught == []
    cu_small = torch.tensor([0, 200, 450], dtype=torch.int32, device="cuda")
    _, caught = _warnings_of(lambda: open_vc_attn.attention(q[:450], k[:450], v[:450], cu_seqlens_q=cu_small,
                                                            cu_seqlens_k=cu_small, max_seqlen_q=250, max_seqlen_k=250))
    assert len(caught) == 1 and "at most 250 keys" in str(caught[0].message) and caught[0].filename == __file__
    pw._WARNED.clear()
    qb, kb, vb = _qkv(torch, 512, 200, seed=6)
    prepared = open_vc_attn.prepare_fp8(qb, kb, vb)
    _, caught = _warnings_of(lambda: open_vc_attn.attention_fp8(prepared))
    assert len(caught) == 1 and "at most 200 keys" in str(caught[0].message) and caught[0].filename == __file__


@pytest.mark.gpu
def test_gpu_compiled_attention_with_few_keys_traces_fullgraph(torch):
    q, k, v = _qkv(torch, 512, 128, seed=7)
    compiled = torch.compile(lambda q, k, v: open_vc_attn.attention(q, k, v), fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pw.PerformanceWarning)
        out = compiled(q, k, v)
    eager, caught = _warnings_of(lambda: open_vc_attn.attention(q, k, v))
    assert len(caught) == 1 and torch.equal(out, eager)


def test_a_compiled_call_traces_without_the_warning(torch):
    """torch.compile(fullgraph=True) cannot trace warnings.warn: a traced call skips the warning (eager ones warn)."""
    def f(x):
        pw.warn_few_keys(int(x.shape[0]))
        return x + 1
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(compiled(torch.zeros(4)), torch.ones(4))
    with pytest.warns(pw.PerformanceWarning):
        f(torch.zeros(4))
