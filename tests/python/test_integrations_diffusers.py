"""diffusers integration (open_vc_attn.integrations.diffusers) against the real diffusers package.

- Without torch: the torch-free import check runs; the rest skips.
- With torch and diffusers (CPU): the version check, registration, the context manager, enable/disable,
  calls with return_lse, apply/remove on a small random Wan transformer and on a tiny Wan2.2-style
  WanPipeline with two transformers (both wrapped; on the CPU every call falls back with its reason and a
  one-time FallbackWarning, the output bit for bit the unwrapped pipeline's; with openvc's fast path
  replaced by the CPU reference of the same arithmetic, open_vc_attn.reference.attention, both transformers'
  self-attention runs on it), and which calls HunyuanVideo and LTX-Video make (the coverage table of
  docs/integrations/diffusers.md; the other video models, CogVideoX and Mochi among them:
  test_integrations_diffusers_models.py). Context parallelism: test_integrations_diffusers_cp.py.
- Marked `gpu` (torch, diffusers and a compute capability 9.0 device): the backend function against
  open_vc_attn.attention (bit for bit, LSE too) and diffusers' native backend, and examples/diffusers_wan.py
  at 32,760 video tokens (output rel L2 < 3% against the native backend, openvc faster).
On an H200 (diffusers carried as a wheel): python3 -m pytest -q -rs tests/python/test_integrations_diffusers.py
"""
import dataclasses
import importlib.util
import inspect
import pathlib
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

from helpers import wan22_pipeline

REPO = pathlib.Path(__file__).resolve().parents[2]

# Output bound of the Wan comparison. Per attention call, openvc differs from exact attention by 3-6% rel L2
# (docs/numerics.md section 8); in the transformer, attention is one residual branch among several, and
# the CPU-reference run below measured 0.3% (uniform random attention) to 0.8% (sharpened q/k norms, as
# the example runs it) at 1-4k tokens. 3% leaves room for the GPU kernel's accumulator differences.
MAX_REL_L2 = 0.03


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def no_device_check(policy, monkeypatch):
    """Lets CPU tensors through the policy's device check (for routing tests on the CPU)."""
    monkeypatch.setattr(policy, "_device_reason", lambda device: None)


@pytest.fixture
def reference_fast_path(ovd, monkeypatch, no_device_check):
    """openvc's fast path replaced by the CPU reference (same quantization and ExpCast arithmetic)."""
    from open_vc_attn import reference as ref
    torch = sys.modules["torch"]
    calls = []

    def fast(q, k, v, scale, return_lse=False, qk_format="e4m3", k_smoothing=False, p_format="expcast",
             v_bias_correction=False):
        calls.append(tuple(q.shape))
        res = ref.attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), softmax_scale=scale,
                            return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        out = torch.from_numpy(np.ascontiguousarray(out)).to(torch.bfloat16)
        return (out, torch.from_numpy(np.ascontiguousarray(lse))) if return_lse else out

    monkeypatch.setattr(ovd, "_fast_attention", fast)
    return calls


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def small_policy(policy, n=64):
    """Thresholds of n tokens, so that small shapes reach openvc (the defaults are measured crossovers far
    above the CPU tests' shapes)."""
    return policy.DispatchPolicy(min_query_tokens=n, min_key_tokens=n)


def is_wrapped(proc):
    return type(proc).__name__.startswith("OpenVC")


# ---- no torch needed ------------------------------------------------------------------------------------

def test_import_needs_neither_torch_nor_diffusers():
    code = ("import sys; import open_vc_attn.integrations as i, open_vc_attn.integrations.diffusers as d, "
            "open_vc_attn.integrations.policy as p; assert callable(d.apply) and callable(p.choose_path); "
            "assert 'torch' not in sys.modules and 'diffusers' not in sys.modules, sorted(sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if "No module named 'open_vc_attn.integrations'" in res.stderr:
        pytest.skip("open_vc_attn.integrations is not installed: reinstall the package")
    assert res.returncode == 0, res.stderr


# ---- helpers ---------------------------------------------------------------------------------------------

def qkv(torch, b=1, sq=2048, sk=None, h=2, d=128, dtype=None):
    dtype = dtype or torch.bfloat16
    sk = sq if sk is None else sk
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype) for s in (sq, sk, sk))


def test_policy_on_cpu_tensors(torch, policy):
    q, k, v = qkv(torch)
    path, why = policy.choose_path(q, k, v, policy=small_policy(policy))
    assert path == policy.FALLBACK and "not CUDA" in why


# ---- version, registration and activation (torch + diffusers, CPU) ------------------------------------------

def test_pinned_version(ovd):
    import diffusers
    assert f"diffusers=={ovd.TESTED_VERSION}" in (REPO / "requirements" / "test.txt").read_text().split()
    assert diffusers.__version__ == ovd.TESTED_VERSION, "the tests run against the tested diffusers"


def test_version_check(ovd, monkeypatch):
    import diffusers
    monkeypatch.setattr(diffusers, "__version__", "0.43.0.dev0")
    monkeypatch.delenv("OPENVC_DIFFUSERS_UNTESTED", raising=False)
    try:
        with pytest.raises(RuntimeError, match=r"diffusers 0\.43\.0\.dev0.*private attention registry.*"
                                               r"OPENVC_DIFFUSERS_UNTESTED=1"):
            ovd.register()
        monkeypatch.setenv("OPENVC_DIFFUSERS_UNTESTED", "1")
        with pytest.warns(RuntimeWarning, match="untested"):
            ovd.register()
    finally:
        ovd._state.checked_version = None      # re-checked against the real version by the next call
    from open_vc_attn.integrations import _versions
    assert _versions.version_tuple("0.42.1") == (0, 42) and _versions.version_tuple("1.0rc1") == (1, 0)
    assert _versions.version_tuple("0.5.10.post1", 3) == (0, 5, 10)


def test_register_and_context(torch, ovd):
    from diffusers.models import attention_dispatch as ad
    reg = ad._AttentionBackendRegistry
    key = ovd.register()
    assert key == "openvc" and ovd.register() is key and reg._backends[key] is ovd._openvc_backend
    assert reg._is_context_parallel_available(key)       # what enable_parallelism asks of the active backend
    before = reg._active_backend
    with ovd.openvc_attention():
        assert reg._active_backend is key
    assert reg._active_backend == before
    ovd.enable()
    try:
        assert reg._active_backend is key
        ovd.enable()                   # idempotent
    finally:
        ovd.disable()
    assert reg._active_backend == before


def test_context_routes_dispatch_calls(torch, ovd, policy, reference_fast_path):
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    q, k, v = qkv(torch, sq=1024)
    _, kt, vt = qkv(torch, sq=1024, sk=512)
    ovd.reset_stats()
    with ovd.openvc_attention(policy=small_policy(policy, 1024)):
        out = dispatch_attention_fn(q, k, v)
        cross = dispatch_attention_fn(q, kt, vt)
    assert reference_fast_path == [tuple(q.shape)]
    assert out.dtype == q.dtype and out.shape == q.shape
    native = dispatch_attention_fn(q, kt, vt, backend="native")
    assert torch.equal(cross, native)
    assert ovd.stats() == {("openvc", ""): 1, ("fallback", "few keys (512 < 1024)"): 1}
    exact = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)))
    err = float((out.float() - exact.transpose(1, 2)).norm() / exact.norm())
    assert err < 0.08, err    # random normal inputs: ExpCast FP8 ~5.6% from exact (docs/numerics.md)


def test_return_lse_calls(torch, ovd, policy, reference_fast_path):
    """return_lse=True (what ring attention asks for): openvc's LSE in diffusers' [B, S, H] layout, and an
    exact LSE for calls on the fallback (diffusers' native backend has none)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from open_vc_attn import reference as ref
    q, k, v = qkv(torch, sq=1024)
    _, kt, vt = qkv(torch, sq=1024, sk=300)
    with ovd.openvc_attention(policy=small_policy(policy, 1024)):
        out, lse = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True})
        out_f, lse_f = dispatch_attention_fn(q, kt, vt, attention_kwargs={"return_lse": True})
    _, ref_lse = ref.attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), return_lse=True)
    assert lse.shape == (1, 1024, 2) and torch.equal(lse, torch.from_numpy(ref_lse).transpose(1, 2))
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, kt, vt))
    s = qd @ kd.transpose(-1, -2) / 128 ** 0.5
    assert torch.allclose(lse_f.double(), torch.logsumexp(s, -1).transpose(1, 2), atol=1e-4)
    exact = (torch.softmax(s, -1) @ vd).transpose(1, 2)
    assert float((out_f.double() - exact).norm() / exact.norm()) < 1e-2


def test_policy_format_reaches_every_openvc_call(torch, ovd, policy, monkeypatch, no_device_check):
    """DispatchPolicy(qk_format, k_smoothing) is passed to each openvc call (plain, masked, causal) and
    stats() show it."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    seen = []

    def fast(q, k, v, scale, return_lse=False, attn_mask=None, causal=False, **fmt):
        seen.append(fmt)
        return q.clone()

    monkeypatch.setattr(ovd, "_fast_attention", fast)
    q, k, v = qkv(torch, sq=1024)
    pol = policy.DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024, qk_format="int8", k_smoothing=True)
    ovd.reset_stats()
    with ovd.openvc_attention(policy=pol):
        dispatch_attention_fn(q, k, v)
        dispatch_attention_fn(q, k, v, is_causal=True)
        dispatch_attention_fn(q, k, v, attn_mask=torch.ones(1, 1024, dtype=torch.bool))
    assert seen == [{"qk_format": "int8", "k_smoothing": True, "p_format": "expcast", "v_bias_correction": False}] * 3
    assert ovd.stats() == {("openvc", "qk_format=int8, k_smoothing"): 3}
    with ovd.openvc_attention(policy=small_policy(policy, 1024)):
        dispatch_attention_fn(q, k, v)
    assert seen[-1] == {"qk_format": "e4m3", "k_smoothing": False, "p_format": "expcast", "v_bias_correction": False}
    exp2 = policy.DispatchPolicy(min_query_tokens=1024, min_key_tokens=1024, qk_format="int8", k_smoothing=True,
                                 p_format="exp2")
    ovd.reset_stats()
    with ovd.openvc_attention(policy=exp2):
        dispatch_attention_fn(q, k, v, is_causal=True)
    assert seen[-1] == {"qk_format": "int8", "k_smoothing": True, "p_format": "exp2", "v_bias_correction": False}
    assert ovd.stats() == {("openvc", "qk_format=int8, k_smoothing, p_format=exp2"): 1}
    best = dataclasses.replace(exp2, v_bias_correction=True)      # the most accurate mode: plain, causal, masked
    ovd.reset_stats()
    with ovd.openvc_attention(policy=best):
        dispatch_attention_fn(q, k, v)
        dispatch_attention_fn(q, k, v, is_causal=True)
        dispatch_attention_fn(q, k, v, attn_mask=torch.ones(1, 1024, dtype=torch.bool))
    assert seen[-3:] == [{"qk_format": "int8", "k_smoothing": True, "p_format": "exp2", "v_bias_correction": True}] * 3
    assert ovd.stats() == {("openvc", "qk_format=int8, k_smoothing, p_format=exp2, v_bias_correction"): 3}


def test_argument_errors(torch, ovd):
    with pytest.raises(ValueError, match="^fallback"):
        ovd.register(fallback="nonexistent")
    with pytest.raises(ValueError, match="^fallback"):
        ovd.register(fallback="openvc")
    with pytest.raises(TypeError, match="^policy"):
        ovd.register(policy={"min_query_tokens": 1})
    with pytest.raises(ValueError, match="^model: Linear has no attention processors"):
        ovd.apply(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="^model"):
        ovd.apply("transformer")
    with pytest.raises(ValueError, match="^model: the pipeline SimpleNamespace has no transformer"):
        ovd.apply(types.SimpleNamespace(components={"vae": torch.nn.Linear(2, 2), "transformer": None}))
    with pytest.raises(ValueError, match="^model: Linear was never wrapped"):
        ovd.stats(torch.nn.Linear(2, 2))


# ---- one Wan transformer -------------------------------------------------------------------------------------

def tiny_wan(torch, heads=2):
    ex = load_example("diffusers_wan")
    model = ex.build_model(heads=heads, layers=2, ffn_dim=512, text_dim=64, device="cpu")
    inputs = ex.make_inputs(frames=4, height=32, width=32, text_tokens=512, text_dim=64, device="cpu")
    return ex, model, inputs    # 4 * 16 * 16 = 1024 video tokens


def test_apply_wan_cpu(torch, ovd, policy, reference_fast_path):
    ex, model, inputs = tiny_wan(torch)
    res, out, ref = ex.compare(model, inputs, timed=False, policy=small_policy(policy, 1024))
    # self-attention (1024 tokens) on openvc, text cross-attention (512 keys) on SDPA, in both layers
    assert res["routes"] == {"openvc": 2, "fallback: few keys (512 < 1024)": 2}, res["routes"]
    assert reference_fast_path == [(1, 1024, 2, 128)] * 2
    assert 0 < res["rel_l2"] < MAX_REL_L2, res
    # remove() restored the original processors: the model is back to its native output
    assert not any(is_wrapped(m.processor) for m in model.modules() if hasattr(m, "processor"))
    assert torch.equal(ex.forward(model, inputs), ref)


def test_apply_keeps_signature_and_explicit_backend(torch, ovd, policy, reference_fast_path):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as reg
    _, model, inputs = tiny_wan(torch)
    active = reg._active_backend
    try:
        model.set_attention_backend("_native_math")   # also sets diffusers' active backend: restored below
    finally:
        reg._active_backend = active
    inner = model.blocks[0].attn1.processor
    assert ovd.apply(model, policy=small_policy(policy, 1024)) == 4 and ovd.apply(model) == 0
    proc = model.blocks[0].attn1.processor
    assert inspect.signature(proc.__call__) == inspect.signature(inner.__call__)
    assert proc._attention_backend == "_native_math" and inner._attention_backend is None
    # enable_parallelism sets _parallel_config on the processors: it must reach the processor that calls dispatch
    marker = object()
    proc._parallel_config = marker
    assert inner._parallel_config is marker and proc._parallel_config is marker
    proc._parallel_config = None
    ovd.reset_stats()
    with torch.inference_mode():
        model(**inputs)
    assert ovd.stats()[("openvc", "")] == 2 and ovd.stats(model) == ovd.stats()
    assert ovd.remove(model) == 4
    assert model.blocks[0].attn1.processor is inner and inner._attention_backend.value == "_native_math"


# ---- a Wan2.2-style pipeline: two transformers -------------------------------------------------------------------

def test_wan22_pipeline_cpu_fallback(torch, ovd, policy):
    pipe, run = wan22_pipeline(torch)
    ref = run()
    assert ovd.apply(pipe, policy=small_policy(policy)) == {"transformer": 2, "transformer_2": 2}
    for name in ("transformer", "transformer_2"):
        procs = [m.processor for m in getattr(pipe, name).modules() if hasattr(m, "processor")]
        assert len(procs) == 2 and all(is_wrapped(p) for p in procs), name
    ovd.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
        run()                          # the warning is one-time per model
    # every call fell back, with its reason, to the native backend: the output is the unwrapped pipeline's
    assert torch.equal(out, ref)
    why = "device cpu is not CUDA"
    for name in ("transformer", "transformer_2"):   # per pipeline run 2 forwards (CFG), each 2 calls
        assert ovd.stats(getattr(pipe, name)) == {("fallback", why): 4, ("fallback", "few keys (16 < 64)"): 4}
    messages = [str(w.message) for w in caught if issubclass(w.category, ovd.FallbackWarning)]
    assert len(messages) == 2, messages
    for name, msg in zip(("transformer", "transformer_2"), messages):
        assert f"none of the 2 attention calls of WanTransformer3DModel ({name})" in msg and why in msg, msg
    assert ovd.remove(pipe) == {"transformer": 2, "transformer_2": 2}
    assert not any(is_wrapped(m.processor) for m in pipe.transformer_2.modules() if hasattr(m, "processor"))
    assert torch.equal(run(), ref)


def test_wan22_pipeline_both_transformers_on_openvc(torch, ovd, policy, reference_fast_path):
    pipe, run = wan22_pipeline(torch)
    ref = run()
    ovd.apply(pipe, policy=small_policy(policy))
    ovd.reset_stats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ovd.FallbackWarning)     # both reach openvc: no warning
            out = run()
    finally:
        ovd.remove(pipe)
    expected = {("openvc", ""): 2, ("fallback", "few keys (16 < 64)"): 2}   # self-attn; 16 text tokens
    assert ovd.stats(pipe.transformer) == expected and ovd.stats(pipe.transformer_2) == expected
    assert reference_fast_path == [(1, 128, 2, 128)] * 4
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert 0 < err < MAX_REL_L2, err


def test_pipeline_with_a_direct_sdpa_model(torch, ovd, policy):
    """A denoiser that cannot be routed is named in a FallbackWarning while the others are wrapped; one
    alone is a ValueError with the reason."""
    pipe, _ = wan22_pipeline(torch)
    allegro = allegro_model(torch)
    mixed = types.SimpleNamespace(components={"transformer": pipe.transformer, "transformer_2": allegro, "vae": None})
    with pytest.warns(ovd.FallbackWarning, match=r"transformer_2: AllegroTransformer3DModel's attention "
                                                  r"processors \(AllegroAttnProcessor2_0\)"):
        assert ovd.apply(mixed) == {"transformer": 2}
    ovd.remove(mixed)
    with pytest.raises(ValueError, match="^model: no denoiser of SimpleNamespace can be routed: transformer: "
                                         "Allegro"):
        ovd.apply(types.SimpleNamespace(components={"transformer": allegro}))


# ---- which calls the video models make (docs/integrations/diffusers.md, "Models") -------------------------------

def allegro_model(torch):
    """Allegro: processors that call torch SDPA themselves, head dim 96 (openvc has no replacement)."""
    from diffusers import AllegroTransformer3DModel
    return AllegroTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                     num_layers=1, cross_attention_dim=16, sample_width=8, sample_height=8,
                                     sample_frames=8, caption_channels=8).eval()


def cogvideox(torch):
    from diffusers import CogVideoXTransformer3DModel
    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
                                       num_layers=1, text_embed_dim=32, time_embed_dim=8, sample_width=16,
                                       sample_height=16, sample_frames=9, patch_size=2,
                                       max_text_seq_length=8).eval()


@pytest.fixture
def calls(ovd, monkeypatch, no_device_check):
    """Records (q shape, k shape, mask dtype and shape or None, causal) of every call the backend sees."""
    seen = []
    local = ovd._local_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args):
        mask = None if attn_mask is None else (str(attn_mask.dtype), tuple(attn_mask.shape))
        seen.append((tuple(query.shape), tuple(key.shape), mask, is_causal))
        return local(query, key, value, attn_mask, dropout_p, is_causal, *args)

    monkeypatch.setattr(ovd, "_local_attention", spy)
    return seen


def run_model(torch, ovd, policy, model, inputs):
    ovd.apply(model, policy=small_policy(policy, 1))
    ovd.reset_stats()
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", ovd.FallbackWarning)
            model(**inputs)
    finally:
        ovd.remove(model)
    return ovd.stats()


@pytest.fixture
def cpu_fast(torch, ovd, monkeypatch):
    """openvc's fast path on the CPU: a stand-in (torch SDPA with the same mask) that records the mask shape
    and causal flag it was given."""
    given = []

    def fast(q, k, v, scale, return_lse=False, attn_mask=None, causal=False, qk_format="e4m3", k_smoothing=False,
             p_format="expcast", v_bias_correction=False):
        given.append((None if attn_mask is None else tuple(attn_mask.shape), causal))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
            attn_mask=attn_mask, scale=scale)
        return out.transpose(1, 2).to(torch.bfloat16)

    monkeypatch.setattr(ovd, "_fast_attention", fast)
    return given


def test_hunyuan_video_calls(torch, ovd, policy, calls, cpu_fast):
    from diffusers import HunyuanVideoTransformer3DModel
    # openvc's fast path takes the key-padding mask
    given = cpu_fast
    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=128, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=1.0, patch_size=2, patch_size_t=1, text_embed_dim=32,
        pooled_projection_dim=16, rope_axes_dim=(16, 56, 56)).to(torch.bfloat16).eval()
    text_mask = torch.zeros(1, 12, dtype=torch.bfloat16)
    text_mask[:, :9] = 1                                       # 9 prompt tokens, 3 padding
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 16, 16, generator=g).to(torch.bfloat16),
                  timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 12, 32).to(torch.bfloat16),
                  encoder_attention_mask=text_mask, pooled_projections=torch.randn(1, 16).to(torch.bfloat16),
                  guidance=torch.tensor([3500.0]))
    stats = run_model(torch, ovd, policy, model, inputs)
    # joint attention over 3 * 8 * 8 video + 12 text tokens, a boolean key-padding mask [B, 1, 1, N]; the token
    # refiner calls torch SDPA itself (not wrapped)
    assert calls == [((1, 204, 2, 128), (1, 204, 2, 128), ("torch.bool", (1, 1, 1, 204)), False)] * 2
    assert stats == {("openvc", ""): 2}           # the text padding mask is a key padding mask
    assert given == [((1, 1, 1, 204), False)] * 2


def test_ltx_video_calls(torch, ovd, policy, calls, cpu_fast):
    from diffusers import LTXVideoTransformer3DModel
    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=64,
                                       cross_attention_dim=128, num_layers=1, caption_channels=32
                                       ).to(torch.bfloat16).eval()
    text_mask = torch.ones(1, 10, dtype=torch.bfloat16)
    text_mask[:, 7:] = 0
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 3 * 8 * 8, 8, generator=g).to(torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, 10, 32).to(torch.bfloat16), timestep=torch.tensor([500]),
                  encoder_attention_mask=text_mask, num_frames=3, height=8, width=8)
    stats = run_model(torch, ovd, policy, model, inputs)
    # self-attention head dim 64, unmasked (the fast path's D = 64 mode); cross-attention to the text with an
    # additive mask [B, H, 1, T]
    assert calls == [((1, 192, 2, 64), (1, 192, 2, 64), None, False),
                     ((1, 192, 2, 64), (1, 10, 2, 64), ("torch.bfloat16", (1, 2, 1, 10)), False)]
    assert stats == {("openvc", ""): 1, ("fallback", "attn_mask per head"): 1}
    assert cpu_fast == [(None, False)]


def test_direct_sdpa_models_are_replaced(torch, ovd):
    """CogVideoX's and Mochi's processors call torch SDPA themselves: apply() replaces them with openvc's
    and remove() puts the originals back (their calls: test_integrations_diffusers_models.py)."""
    from diffusers import MochiTransformer3DModel
    mochi = MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=128, num_layers=1,
                                    pooled_projection_dim=16, in_channels=4, text_embed_dim=32, time_embed_dim=4)
    for model, name in ((cogvideox(torch), "CogVideoXProcessor"), (mochi, "MochiProcessor")):
        inner = model.transformer_blocks[0].attn1.processor
        assert ovd.apply(model) == 1 and ovd.apply(model) == 0
        assert type(model.transformer_blocks[0].attn1.processor).__name__ == name
        assert ovd.remove(model) == 1 and model.transformer_blocks[0].attn1.processor is inner
    with pytest.raises(ValueError, match=r"^model: AllegroTransformer3DModel's attention processors "
                                         r"\(AllegroAttnProcessor2_0\) compute attention themselves "
                                         r"\(torch.nn.functional.scaled_dot_product_attention\)"):
        ovd.apply(allegro_model(torch))


# ---- GPU ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_backend_matches_openvc_and_native(torch, ovd, policy):
    import open_vc_attn
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    kt, vt = (torch.randn(1, 512, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    ovd.reset_stats()
    with ovd.openvc_attention(policy=small_policy(policy, 1024)):   # 4096 tokens: below the default thresholds
        out = dispatch_attention_fn(q, k, v)
        cross = dispatch_attention_fn(q, kt, vt)
        out16 = dispatch_attention_fn(q.half(), k.half(), v.half())
        out_l, lse = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True})
    ref, ref_lse = open_vc_attn.attention(q, k, v, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(out_l, ref) and torch.equal(lse, ref_lse.transpose(1, 2))
    assert torch.equal(cross, dispatch_attention_fn(q, kt, vt, backend="native"))
    assert out16.dtype == torch.float16
    assert ovd.stats() == {("openvc", ""): 3, ("fallback", "few keys (512 < 1024)"): 1}
    native = dispatch_attention_fn(q, k, v, backend="native")
    err = float((out.double() - native.double()).norm() / native.double().norm())
    assert err < 0.08, err


@pytest.mark.gpu
def test_gpu_wan_example(torch, ovd, policy):
    ex = load_example("diffusers_wan")
    model = ex.build_model(heads=12, layers=2)
    inputs = ex.make_inputs(frames=21, height=60, width=104)     # Wan 480p latent: 32,760 tokens
    res, _, _ = ex.compare(model, inputs, timed=False)   # the routes and the error; speed is the benchmark's job
    # the default policy: 32,760-token self-attention on openvc, the 512-token text cross-attention on SDPA
    few = f"fallback: few keys (512 < {policy.DEFAULT_POLICY.min_key_tokens})"
    assert res["routes"] == {"openvc": 2, few: 2}, res["routes"]
    assert res["rel_l2"] < MAX_REL_L2, res
