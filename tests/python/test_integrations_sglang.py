"""SGLang diffusion backend (open_vc_attn.integrations.sglang) against the real sglang base classes.

sglang is imported normally when it can be. Where sglang's server dependencies are missing (CI, the device:
``import sglang`` runs its frontend API and ``sglang.multimodal_gen`` imports the whole diffusion runtime,
which needs pydantic, fastapi, openai, zmq, transformers, cache_dit, ...), the test registers four package
objects (sglang, sglang.multimodal_gen, ...runtime.layers, ...layers.attention) without running their
``__init__`` files; every module below them, the attention backends, platforms and their imports, then
loads from the installed sglang's own files (needs torch, numpy, pyyaml, cloudpickle, psutil, pyzmq,
nvidia-ml-py). Skips when sglang or torch is not installed.

- CPU: the interface (subclasses of the real AttentionBackend / AttentionImpl / AttentionMetadata /
  AttentionMetadataBuilder, nothing abstract left, constructed with the arguments SGLang's layers pass),
  the SDPA fallback (bit for bit SGLang's SDPAImpl), the routing with openvc's fast path replaced by the
  CPU reference, install/uninstall on a CUDA platform class, the sglang_cli launcher.
- Marked `gpu`: the impl against open_vc_attn.attention (bit for bit, LSE too) and SDPAImpl.
On an H200 (sglang and pyzmq carried as wheels): python3 -m pytest -q -rs tests/python/test_integrations_sglang.py
"""
import dataclasses
import importlib
import importlib.util
import inspect
import pathlib
import sys
import types

import numpy as np
import pytest

_SHIM_PACKAGES = ("sglang", "sglang.multimodal_gen", "sglang.multimodal_gen.runtime.layers",
                  "sglang.multimodal_gen.runtime.layers.attention")
BASE = "sglang.multimodal_gen.runtime.layers.attention.backends"


def _import_backend_modules():
    """(attention_backend module, sdpa module, how): the real modules, imported normally or through the
    package stand-ins described in the module doc."""
    try:
        ab = importlib.import_module(f"{BASE}.attention_backend")
        return ab, importlib.import_module(f"{BASE}.sdpa"), "full import"
    except Exception as exc:   # noqa: BLE001 - any failure of sglang's import chain
        first_error = exc
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]     # drop what the failed import left half-initialized
    spec = importlib.util.find_spec("sglang")
    root = pathlib.Path(spec.submodule_search_locations[0])
    for name in _SHIM_PACKAGES:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = pkg
    ab = importlib.import_module(f"{BASE}.attention_backend")
    how = f"package __init__ files skipped ({type(first_error).__name__}: {first_error})"
    return ab, importlib.import_module(f"{BASE}.sdpa"), how


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def sgl(torch):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    try:
        ab, sdpa, how = _import_backend_modules()
    except ImportError as exc:
        pytest.skip(f"sglang's attention backend modules are not importable: {exc}")
    print(f"\nsglang attention backends imported ({how})")
    try:
        mod = importlib.import_module("open_vc_attn.integrations.sglang")
    except ImportError as exc:
        if "open_vc_attn.integrations" in str(exc):
            pytest.skip(f"open_vc_attn.integrations is not importable ({exc}): reinstall the package")
        raise
    return types.SimpleNamespace(ab=ab, sdpa=sdpa, mod=mod)


@pytest.fixture
def fast_path(sgl, monkeypatch):
    """openvc's fast path replaced by the CPU reference, and CPU tensors let through the device check."""
    from open_vc_attn import reference as ref
    from open_vc_attn.integrations import policy
    torch = sys.modules["torch"]
    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    calls = []

    def fast(q, k, v, scale, return_lse, causal=False, qk_format="e4m3", k_smoothing=False, p_format="expcast",
             v_bias_correction=False):
        calls.append(tuple(q.shape) if not causal else (tuple(q.shape), "causal"))
        res = ref.attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), softmax_scale=scale,
                            return_lse=return_lse, causal=causal)
        out, lse = res if return_lse else (res, None)
        out = torch.from_numpy(np.ascontiguousarray(out)).to(torch.bfloat16)
        return (out, torch.from_numpy(np.ascontiguousarray(lse)).float()) if return_lse else out

    def fast_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal, qk_format="e4m3", k_smoothing=False,
                    p_format="expcast", v_bias_correction=False):
        calls.append(("packed", tuple(q.shape), tuple(cu_seqlens.tolist()), max_seqlen, causal))
        cu = cu_seqlens.numpy()
        out = ref.attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), softmax_scale=scale,
                            causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        return torch.from_numpy(np.ascontiguousarray(out)).to(torch.bfloat16)

    monkeypatch.setattr(sgl.mod, "_fast_attention", fast)
    monkeypatch.setattr(sgl.mod, "_fast_varlen_attention", fast_varlen)
    sgl.mod.reset_stats()
    return calls


def make_impl(sgl, heads=2, head_size=128, causal=False, kv_heads=None, **extra):
    # The keywords of sglang's LocalAttention / UlyssesAttention / USPAttention (layer.py).
    return sgl.mod.OpenVCAttentionImpl(num_heads=heads, head_size=head_size, causal=causal,
                                       softmax_scale=head_size ** -0.5, num_kv_heads=kv_heads or heads,
                                       prefix="blocks.0.attn1.impl", **extra)


def rand(torch, *shape, dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype or torch.bfloat16)


# ---- interface -----------------------------------------------------------------------------------------------

def test_subclasses_real_base_classes(sgl):
    m, ab = sgl.mod, sgl.ab
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum
    assert issubclass(m.OpenVCAttentionBackend, ab.AttentionBackend)
    assert issubclass(m.OpenVCAttentionImpl, ab.AttentionImpl)
    assert issubclass(m.OpenVCAttentionMetadata, ab.AttentionMetadata)
    assert issubclass(m.OpenVCAttentionMetadataBuilder, ab.AttentionMetadataBuilder)
    for cls in (m.OpenVCAttentionBackend, m.OpenVCAttentionImpl, m.OpenVCAttentionMetadataBuilder):
        assert not inspect.isabstract(cls), (cls, cls.__abstractmethods__)
    be = m.OpenVCAttentionBackend
    assert be.get_enum() is AttentionBackendEnum.TORCH_SDPA
    assert be.get_impl_cls() is m.OpenVCAttentionImpl and be.get_metadata_cls() is m.OpenVCAttentionMetadata
    assert {64, 128} <= set(be.get_supported_head_sizes())
    builder = be.get_builder_cls()()
    builder.prepare()
    meta = builder.build(current_timestep=7, raw_latent_shape=(1, 16, 21, 60, 104))
    assert isinstance(meta, ab.AttentionMetadata) and meta.asdict_zerocopy() == {"current_timestep": 7}
    # SGLang wraps every impl's forward for its kernel-API debug logging
    impl = make_impl(sgl)
    ab.wrap_attention_impl_forward(impl)
    assert isinstance(impl, ab.AttentionImpl) and impl.num_kv_heads == 2


def test_fallback_is_sglang_sdpa(torch, sgl):
    from open_vc_attn.integrations.policy import DispatchPolicy
    # thresholds below the inputs' size, so that the device is the reason for the fallback
    impl = make_impl(sgl, openvc_policy=DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024))
    ref_impl = sgl.sdpa.SDPAImpl(num_heads=2, head_size=128, causal=False, softmax_scale=128 ** -0.5)
    q, k, v = (rand(torch, 1, 1024, 2, 128, seed=s) for s in range(3))
    sgl.mod.reset_stats()
    out = impl.forward(q, k, v, None)
    assert torch.equal(out, ref_impl.forward(q, k, v, None))
    (path, why), = sgl.mod.stats()
    assert path == "fallback" and "not CUDA" in why
    causal = make_impl(sgl, causal=True)
    ref_causal = sgl.sdpa.SDPAImpl(num_heads=2, head_size=128, causal=True, softmax_scale=128 ** -0.5)
    assert torch.equal(causal.forward(q, k, v, None), ref_causal.forward(q, k, v, None))


def test_routing(torch, sgl, fast_path):
    # thresholds of 1024 tokens, so that small CPU shapes reach the (reference) fast path; the defaults
    # are measured crossovers (DispatchPolicy) far above them
    from open_vc_attn.integrations.policy import DispatchPolicy
    policy = DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024)
    q, k, v = (rand(torch, 1, 1024, 2, 128, seed=s) for s in range(3))
    kt, vt = rand(torch, 1, 512, 2, 128, seed=5), rand(torch, 1, 512, 2, 128, seed=6)
    out = make_impl(sgl, openvc_policy=policy).forward(q, k, v, None)
    assert fast_path == [(1, 1024, 2, 128)] and out.dtype == torch.bfloat16 and out.shape == q.shape
    exact = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)))
    assert float((out.float() - exact.transpose(1, 2)).norm() / exact.norm()) < 0.08
    out16 = make_impl(sgl, openvc_policy=policy).forward(q.half(), k.half(), v.half(), None)
    assert out16.dtype == torch.float16
    out, lse = make_impl(sgl, openvc_policy=policy).forward(q, k, v, None, return_softmax_lse=True)
    assert lse.shape == (1, 2, 1024) and lse.dtype == torch.float32
    make_impl(sgl, openvc_policy=policy).forward(q, kt, vt, None)                  # text cross-attention
    make_impl(sgl, causal=True, openvc_policy=policy).forward(q, k, v, None)       # causal self-attention
    assert fast_path[-1] == ((1, 1024, 2, 128), "causal")                          # ... runs causal on openvc
    gqa = make_impl(sgl, kv_heads=1, openvc_policy=policy).forward(q, k[:, :, :1], v[:, :, :1], None)   # MQA
    assert fast_path[-1] == (1, 1024, 2, 128)                                      # ... on openvc, k as given
    mqa = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (
        q, k[:, :, :1].expand(-1, -1, 2, -1), v[:, :, :1].expand(-1, -1, 2, -1))))
    assert float((gqa.float() - mqa.transpose(1, 2)).norm() / mqa.norm()) < 0.08
    make_impl(sgl, head_size=64, openvc_policy=policy).forward(q[..., :64], k[..., :64], v[..., :64], None)
    # openvc: the self-attention call, FP16, LSE, causal self-attention, MQA and head dim 64
    assert sgl.mod.stats() == {("openvc", ""): 6, ("fallback", "few keys (512 < 1024)"): 1}
    with pytest.raises(NotImplementedError, match="return_softmax_lse"):
        make_impl(sgl, openvc_policy=policy).forward(q, kt, vt, None, return_softmax_lse=True)
    small = sgl.mod.OpenVCAttentionImpl(num_heads=2, head_size=128, softmax_scale=0.1,
                                        openvc_policy=DispatchPolicy(min_query_tokens=64, min_key_tokens=64))
    small.forward(q[:, :100], kt, vt, None)
    assert fast_path[-1] == (1, 100, 2, 128)


def test_impl_passes_the_policy_format(torch, sgl, monkeypatch):
    from open_vc_attn.integrations import policy
    from open_vc_attn.integrations.policy import DispatchPolicy
    seen = []
    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    monkeypatch.setattr(sgl.mod, "_fast_attention", lambda q, k, v, scale, lse, causal=False, **fmt: (
        seen.append(fmt), q.clone())[1])
    monkeypatch.setattr(sgl.mod, "_fast_varlen_attention", lambda q, k, v, cu, m, scale, causal, **fmt: (
        seen.append(fmt), q.clone())[1])
    sgl.mod.reset_stats()
    pol = DispatchPolicy(min_query_tokens=64, min_key_tokens=64, qk_format="int8", k_smoothing=True, p_format="exp2")
    q = rand(torch, 1, 128, 2, 128)
    make_impl(sgl, openvc_policy=pol).forward(q, q, q, None)
    make_impl(sgl, openvc_policy=pol).forward_varlen(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 128],
                                                     dtype=torch.int32), max_seqlen=128)
    assert seen == [{"qk_format": "int8", "k_smoothing": True, "p_format": "exp2", "v_bias_correction": False}] * 2
    assert sgl.mod.stats() == {("openvc", "qk_format=int8, k_smoothing, p_format=exp2"): 2}
    best = dataclasses.replace(pol, v_bias_correction=True)
    make_impl(sgl, openvc_policy=best).forward(q, q, q, None)
    make_impl(sgl, openvc_policy=best).forward_varlen(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 128],
                                                      dtype=torch.int32), max_seqlen=128)
    assert seen[2:] == [{"qk_format": "int8", "k_smoothing": True, "p_format": "exp2", "v_bias_correction": True}] * 2
    assert sgl.mod.stats()[("openvc", "qk_format=int8, k_smoothing, p_format=exp2, v_bias_correction")] == 2


# ---- packed sequences (forward_varlen) --------------------------------------------------------------------------

def packed_inputs(torch, lens, h=2, d=128, extra_rows=0, dtype=None):
    total = sum(lens) + extra_rows
    q, k, v = (rand(torch, total, h, d, dtype=dtype, seed=10 + s) for s in range(3))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    return q, k, v, cu


def test_forward_varlen_takes_the_packed_path(torch, sgl, fast_path):
    from open_vc_attn.integrations.policy import DispatchPolicy
    small = DispatchPolicy(min_query_tokens=64, min_key_tokens=64)
    lens = [100, 300, 129]
    q, k, v, cu = packed_inputs(torch, lens)
    for causal in (False, True):
        impl = make_impl(sgl, causal=causal, openvc_policy=small)
        out = impl.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=300)
        # one packed call with the shared offsets; no host offsets were needed
        assert fast_path[-1] == ("packed", (529, 2, 128), (0, 100, 400, 529), 300, causal)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        # each sequence is quantized and attended alone: the packed call equals the per-sequence calls bit for bit
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = impl.forward(q[None, s:e], k[None, s:e], v[None, s:e], None)[0]
            assert torch.equal(out[s:e], alone), (s, e)
    out16 = make_impl(sgl, openvc_policy=small).forward_varlen(q.half(), k.half(), v.half(), cu_seqlens=cu,
                                                               max_seqlen=300)
    assert out16.dtype == torch.float16
    assert sgl.mod.stats()[("openvc", "")] == 2 + 2 * 3 + 1


def test_forward_varlen_falls_back_per_sequence(torch, sgl, fast_path):
    lens = [100, 0, 300, 129]
    q, k, v, cu = packed_inputs(torch, lens, extra_rows=7)   # rows past cu[-1]: no sequence
    impl, sdpa = make_impl(sgl), sgl.sdpa.SDPAImpl(num_heads=2, head_size=128, causal=False,
                                                    softmax_scale=128 ** -0.5)
    bounds = tuple(cu.tolist())
    for host in (bounds, None):
        out = impl.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=300, cu_seqlens_host=host)
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                assert torch.equal(out[s:e], sdpa.forward(q[None, s:e], k[None, s:e], v[None, s:e], None)[0])
        assert torch.all(out[bounds[-1]:] == 0)
    assert fast_path == []
    from open_vc_attn.integrations.policy import DispatchPolicy
    floor = DispatchPolicy().min_query_tokens   # the measured default
    assert sgl.mod.stats() == {("fallback", f"short sequences (max_seqlen_q 300 < {floor})"): 2}


def test_forward_varlen_uses_sglangs_own_varlen_where_present(torch, sgl, fast_path):
    # later SGLang releases give SDPAImpl a forward_varlen (one packed FlashAttention call): the fallback uses it
    seen = []

    class LaterSDPA:
        def forward_varlen(self, query, key, value, *, cu_seqlens, max_seqlen, cu_seqlens_host=None):
            seen.append((tuple(query.shape), max_seqlen, cu_seqlens_host))
            return torch.ones_like(query)

    q, k, v, cu = packed_inputs(torch, [100, 300])
    impl = make_impl(sgl)
    impl.fallback = LaterSDPA()
    out = impl.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=300, cu_seqlens_host=(0, 100, 400))
    assert seen == [((400, 2, 128), 300, (0, 100, 400))] and torch.all(out == 1)


# ---- selection ------------------------------------------------------------------------------------------------

@pytest.fixture
def cuda_platform(sgl):
    """A throwaway subclass of SGLang's CUDA platform (so that install() patches nothing shared)."""
    pytest.importorskip("pynvml", reason="sglang's CUDA platform module imports pynvml (nvidia-ml-py)")
    from sglang.multimodal_gen.runtime.platforms.cuda import NonNvmlCudaPlatform

    class Platform(NonNvmlCudaPlatform):
        pass
    yield Platform
    sgl.mod.uninstall()


def test_install_selects_openvc(torch, sgl, cuda_platform):
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum as E
    from sglang.multimodal_gen.utils import resolve_obj_by_qualname
    m, P = sgl.mod, cuda_platform
    sdpa_name = P.get_attn_backend_cls_str(E.TORCH_SDPA, 128, torch.bfloat16)
    assert sdpa_name.endswith(".SDPABackend")
    m.install(platform=P)
    assert m.is_installed()
    for head_size in (128, 64):   # the backend takes every size: the policy routes per call
        name = P().get_attn_backend_cls_str(E.TORCH_SDPA, head_size, torch.bfloat16)
        assert name == m.BACKEND_QUALNAME
    assert resolve_obj_by_qualname(m.BACKEND_QUALNAME) is m.OpenVCAttentionBackend
    m.install(platform=P, replace="fa")            # re-install: only FlashAttention is replaced now
    assert P.get_attn_backend_cls_str(E.TORCH_SDPA, 128, torch.bfloat16) == sdpa_name
    m.uninstall()
    assert not m.is_installed() and "get_attn_backend_cls_str" not in P.__dict__
    assert P.get_attn_backend_cls_str(E.TORCH_SDPA, 128, torch.bfloat16) == sdpa_name


def test_install_arguments(sgl, cuda_platform):
    with pytest.raises(ValueError, match="^replace"):
        sgl.mod.install(platform=cuda_platform, replace=("sage_attn",))
    with pytest.raises(TypeError, match="^policy"):
        sgl.mod.install(platform=cuda_platform, policy=1024)
    with pytest.raises(TypeError, match="^platform"):
        sgl.mod.install(platform=object())
    assert not sgl.mod.is_installed()


def test_install_version_check(sgl, cuda_platform, monkeypatch):
    m = sgl.mod
    monkeypatch.delenv("OPENVC_SGLANG_UNTESTED", raising=False)
    monkeypatch.setattr(m, "_installed_version", lambda: "0.5.11")
    with pytest.raises(RuntimeError, match=r"sglang 0\.5\.11.*get_attn_backend_cls_str.*OPENVC_SGLANG_UNTESTED=1"):
        m.install(platform=cuda_platform)
    assert not m.is_installed()
    monkeypatch.setenv("OPENVC_SGLANG_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="untested"):
        m.install(platform=cuda_platform)
    m.uninstall()
    monkeypatch.delenv("OPENVC_SGLANG_UNTESTED")
    monkeypatch.setattr(m, "_installed_version", lambda: "0.5.10.post3")    # a post release: accepted
    m.install(platform=cuda_platform)
    m.uninstall()

    class Changed(cuda_platform):             # a hook with another signature is refused on any version
        @classmethod
        def get_attn_backend_cls_str(cls, selected_backend, head_size, dtype, use_mla=False):
            return ""
    with pytest.raises(RuntimeError, match=r"Changed.get_attn_backend_cls_str takes \(selected_backend, "
                                           r"head_size, dtype, use_mla\)"):
        m.install(platform=Changed)
    assert not m.is_installed()


def test_tested_version_is_pinned(sgl):
    pyproject = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"sglang[diffusion]=={sgl.mod.TESTED_VERSION}"' in pyproject
    assert sgl.mod._installed_version() == sgl.mod.TESTED_VERSION, "the tests run against the tested sglang"


def test_cli_installs_at_import(sgl, monkeypatch):
    calls = []
    monkeypatch.setattr(sgl.mod, "install", lambda **kw: calls.append(kw))
    monkeypatch.setenv("OPENVC_SGLANG_REPLACE", "fa, torch_sdpa")
    monkeypatch.delitem(sys.modules, "open_vc_attn.integrations.sglang_cli", raising=False)
    importlib.import_module("open_vc_attn.integrations.sglang_cli")
    assert calls == [{"replace": ("fa", "torch_sdpa")}]


# ---- GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_impl_matches_openvc(torch, sgl):
    import open_vc_attn
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    kt, vt = (torch.randn(1, 512, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    from open_vc_attn.integrations.policy import DispatchPolicy
    impl = make_impl(sgl, heads=12, openvc_policy=DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024))
    sdpa = sgl.sdpa.SDPAImpl(num_heads=12, head_size=128, causal=False, softmax_scale=128 ** -0.5)
    sgl.mod.reset_stats()
    out = impl.forward(q, k, v, None)
    assert torch.equal(out, open_vc_attn.attention(q, k, v, softmax_scale=128 ** -0.5))
    out2, lse = impl.forward(q, k, v, None, return_softmax_lse=True)
    ref_out, ref_lse = open_vc_attn.attention(q, k, v, softmax_scale=128 ** -0.5, return_lse=True)
    assert torch.equal(out2, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(impl.forward(q, kt, vt, None), sdpa.forward(q, kt, vt, None))
    assert impl.forward(q.half(), k.half(), v.half(), None).dtype == torch.float16
    assert sgl.mod.stats() == {("openvc", ""): 3, ("fallback", "few keys (512 < 1024)"): 1}
    native = sdpa.forward(q, k, v, None)
    err = float((out.double() - native.double()).norm() / native.double().norm())
    assert err < 0.08, err


@pytest.mark.gpu
def test_gpu_forward_varlen_matches_per_sequence_calls(torch, sgl):
    import open_vc_attn
    lens = [1500, 4096, 0, 2100, 1, 1030]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 12, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    sdpa = sgl.sdpa.SDPAImpl(num_heads=12, head_size=128, causal=False, softmax_scale=128 ** -0.5)
    from open_vc_attn.integrations.policy import DispatchPolicy
    small = DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024)   # the longest sequence has 4096 tokens
    for causal in (False, True):
        sgl.mod.reset_stats()
        impl = make_impl(sgl, heads=12, causal=causal, openvc_policy=small)
        out = impl.forward_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max(lens))
        assert sgl.mod.stats() == {("openvc", ""): 1}
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e == s:
                continue
            # openvc's call on the sequence alone: the same quantization groups, tiles and order, the same bits
            alone = open_vc_attn.attention(q[None, s:e], k[None, s:e], v[None, s:e], softmax_scale=128 ** -0.5,
                                           causal=causal)[0]
            assert torch.equal(out[s:e], alone), (causal, s, e)
            if not causal and e - s > 1:
                native = sdpa.forward(q[None, s:e], k[None, s:e], v[None, s:e], None)[0]
                err = float((out[s:e].double() - native.double()).norm() / native.double().norm())
                assert err < 0.08, (s, e, err)
    # short windows (a vision encoder's): SGLang's SDPA per sequence, bit for bit
    short = torch.tensor([0, 256, 256, 700], dtype=torch.int32, device="cuda")
    sgl.mod.reset_stats()
    out = make_impl(sgl, heads=12, openvc_policy=small).forward_varlen(q[:700], k[:700], v[:700], cu_seqlens=short,
                                                                      max_seqlen=444)
    assert sgl.mod.stats() == {("fallback", "short sequences (max_seqlen_q 444 < 1024)"): 1}
    for s, e in ((0, 256), (256, 700)):
        assert torch.equal(out[s:e], sdpa.forward(q[None, s:e], k[None, s:e], v[None, s:e], None)[0])


@pytest.mark.gpu
def test_gpu_current_platform_selects_openvc(torch, sgl):
    from sglang.multimodal_gen.runtime import platforms
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum as E
    from sglang.multimodal_gen.runtime.platforms.cuda import CudaPlatform, CudaPlatformBase
    platform = platforms.current_platform
    if not isinstance(platform, CudaPlatformBase):   # SGLang detects CUDA through NVML, absent in some sandboxes
        print(f"\nsglang's current platform is {type(platform).__name__}: testing CudaPlatform instead")
        platform = CudaPlatform
    try:
        sgl.mod.install(platform=platform)
        assert platform.get_attn_backend_cls_str(E.TORCH_SDPA, 128, torch.bfloat16) == sgl.mod.BACKEND_QUALNAME
    finally:
        sgl.mod.uninstall()
    assert platform.get_attn_backend_cls_str(E.TORCH_SDPA, 128, torch.bfloat16).endswith(".SDPABackend")
