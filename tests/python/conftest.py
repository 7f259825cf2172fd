"""Shared pytest set-up: the `gpu` marker (declared in pyproject.toml) skips, with the reason shown in
the summary (`pytest -rs`), when torch, a CUDA device or compute capability 9.0 is missing; the `torch`
fixture (the module, or a skip where torch is not installed), the integrations' `policy` and `ovd`
(open_vc_attn.integrations.diffusers) fixtures, and `stand_in` (openvc's fast path replaced by a recording CPU
computation, for the diffusers model tests); every test starts with no one-time PerformanceWarning spent. Input
builders: helpers.py."""
import pytest


@pytest.fixture(autouse=True)
def _no_performance_warning_spent(monkeypatch):
    """Every test starts as a fresh process would: no one-time PerformanceWarning spent, so that the order of the
    tests can neither hide a warning from a test that forbids it nor take one from a test that expects it."""
    from open_vc_attn import _perf_warnings
    monkeypatch.setattr(_perf_warnings, "_WARNED", set())


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def policy(torch):
    """open_vc_attn.integrations.policy (the integrations' DispatchPolicy)."""
    try:
        from open_vc_attn.integrations import policy
    except ImportError as exc:   # an installed copy older than the integrations package
        pytest.skip(f"open_vc_attn.integrations is not importable ({exc}): reinstall the package")
    return policy


@pytest.fixture(scope="module")
def ovd(policy):
    """open_vc_attn.integrations.diffusers, or a skip where diffusers is not installed."""
    pytest.importorskip("diffusers", reason="diffusers is not installed")
    from open_vc_attn.integrations import diffusers as ovd
    return ovd

@pytest.fixture
def stand_in(torch, ovd, policy, monkeypatch):
    """openvc's fast path on the CPU: records (q shape, k shape, key counts or None, causal, scale) of each
    call, with "mask" or "counts" appended where it had keys cut (a key mask or key counts, seqused_k), and
    computes torch SDPA in FP32 with them (k and v of fewer heads: GQA / MQA, as openvc takes them)."""
    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    seen = []

    def fast(q, k, v, scale, return_lse=False, attn_mask=None, causal=False, seqused_k=None, **fmt):
        assert attn_mask is None or seqused_k is None
        if seqused_k is not None:   # the first seqused_k[b] keys of entry b
            attn_mask = torch.arange(k.shape[1])[None, :] < seqused_k[:, None].long()
        counts = None if attn_mask is None else attn_mask.reshape(q.shape[0], -1).bool().sum(-1).tolist()
        seen.append((tuple(q.shape), tuple(k.shape), counts, causal, scale))
        if counts is not None:
            seen[-1] += ("counts" if seqused_k is not None else "mask",)
        mask = None if attn_mask is None else attn_mask.reshape(q.shape[0], 1, 1, k.shape[1])
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2).float() for x in (q, k, v)), attn_mask=mask, scale=scale, is_causal=causal,
            enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2).to(torch.bfloat16)

    monkeypatch.setattr(ovd, "_fast_attention", fast)
    return seen


_gpu_reason = None  # computed once, and only when a gpu test was collected (torch imports are slow)


def gpu_skip_reason():
    """None when torch with an sm_90 CUDA device is usable, else why not."""
    global _gpu_reason
    if _gpu_reason is None:
        try:
            import torch
        except Exception as exc:
            _gpu_reason = f"gpu test: torch is not importable ({type(exc).__name__})"
        else:
            if not torch.cuda.is_available():
                _gpu_reason = "gpu test: torch sees no CUDA device"
            elif tuple(torch.cuda.get_device_capability()) != (9, 0):
                _gpu_reason = "gpu test: needs compute capability 9.0 (sm_90a), found %d.%d" % \
                    torch.cuda.get_device_capability()
            else:
                _gpu_reason = ""
    return _gpu_reason or None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    # Make the skip visible even without -rs.
    if _gpu_reason:
        terminalreporter.write_line(f"open_vc_attn: gpu-marked tests skipped: {_gpu_reason}")
