"""Shared pytest set-up: the `gpu` marker (declared in pyproject.toml) skips, with the reason shown in
the summary (`pytest -rs`), when torch, a CUDA device or compute capability 9.0 is missing; the `torch`
fixture (the module, or a skip where torch is not installed) and the integrations' `policy` and `ovd`
(open_vc_attn.integrations.diffusers) fixtures. Input builders: helpers.py."""
import pytest


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
