"""DispatchPolicy(qk_format="auto") and apply(pipe, bf16_steps=N) of the integrations (CPU).

openvc's fast path is replaced by a stand-in whose error is set per format: exact attention in float64
(written out here, independent of the code under test) times (1 + eps[format]), so its rel L2 against
exact attention is eps on every row set, whatever rows the auto choice samples. So the tests check the
choice (the fastest format within the tolerance, or the framework), that the measured error is the
stand-in's (which needs the module's exact attention of the sampled rows right: causal, key padding masks,
packed sequences), the keying per module and call class, stats(), reset, the capture check, and the BF16
first steps of a diffusers pipeline (routed and counted, against runs with independent routing). No timing.

- Without torch: the policy's arguments.
- With torch: open_vc_attn.integrations._auto_format directly, and the yunchang processor.
- With torch and diffusers (and transformers, for WanPipeline): a small Wan and a Wan2.2-style pipeline; a
  small CogVideoX, whose processors openvc replaces (auto per replaced processor, bf16_steps with a stand-in
  pipeline's scheduler).
- SGLang (not installed here): its impl in a subprocess with stand-ins for the four sglang names it imports.
"""
import json
import math
import subprocess
import sys
import warnings

import pytest

from open_vc_attn.integrations import policy

from helpers import wan22_pipeline

AUTO = policy.DispatchPolicy(qk_format="auto", min_query_tokens=64, min_key_tokens=64)
NAMES = {("e4m3", False, "expcast", False): "e4m3", ("int8", True, "expcast", False): "int8+k_smoothing",
         ("int8", True, "exp2", False): "int8+k_smoothing+exp2", ("int8", False, "expcast", False): "int8",
         ("int8", False, "exp2", False): "int8+exp2", ("int8", True, "exp2", True): "int8+k_smoothing+exp2+v_bias"}
ALL = ["e4m3", "int8+k_smoothing", "int8+k_smoothing+exp2", "int8+k_smoothing+exp2+v_bias"]   # every candidate


# ---- the policy's arguments (no torch) ------------------------------------------------------------------------

def test_auto_policy_arguments():
    auto = policy.DispatchPolicy(qk_format="auto")
    assert auto.auto_tolerance == 0.05 and policy.DEFAULT_POLICY.auto_tolerance == 0.05
    assert auto.format_label == "qk_format=auto"
    with pytest.raises(ValueError, match="^qk_format: 'auto' is chosen per module"):
        auto.openvc_kwargs()
    with pytest.raises(ValueError, match="^k_smoothing: qk_format='auto' chooses it"):
        policy.DispatchPolicy(qk_format="auto", k_smoothing=True)
    with pytest.raises(ValueError, match="^p_format: qk_format='auto' chooses it"):
        policy.DispatchPolicy(qk_format="auto", p_format="exp2")
    with pytest.raises(ValueError, match="^p_format: expected one of"):
        policy.DispatchPolicy(qk_format="auto", p_format="exp")
    with pytest.raises(TypeError, match="^k_smoothing: expected a bool"):
        policy.DispatchPolicy(qk_format="auto", k_smoothing=1)
    with pytest.raises(ValueError, match="^v_bias_correction: qk_format='auto' chooses it"):
        policy.DispatchPolicy(qk_format="auto", v_bias_correction=True)
    with pytest.raises(TypeError, match="^v_bias_correction: expected a bool"):
        policy.DispatchPolicy(qk_format="auto", v_bias_correction=1)
    for bad in (0, -0.1, math.nan, math.inf, True, "0.05", None):
        with pytest.raises(ValueError, match="^auto_tolerance: expected a finite real > 0"):
            policy.DispatchPolicy(qk_format="auto", auto_tolerance=bad)
    assert policy.DispatchPolicy(qk_format="auto", auto_tolerance=1).auto_tolerance == 1
    with pytest.raises(ValueError, match=r"^qk_format: expected one of .*or 'auto'"):
        policy.DispatchPolicy(qk_format="AUTO")


# ---- a stand-in of openvc's fast path with a set error per format -----------------------------------------------

def exact64(torch, q, k, v, scale=None, causal=False, mask=None, cu=None):
    """float64 softmax attention [B, Sq, H, D] (packed [T, H, D] with offsets cu); causal aligned to the end;
    mask: a key padding mask (bool True = keep, or additive), [B, Sk] or [B, 1, 1, Sk]."""
    if cu is not None:
        out = torch.zeros(q.shape, dtype=torch.float64)
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                out[a:b] = exact64(torch, q[None, a:b], k[None, a:b], v[None, a:b], scale, causal)[0]
        return out
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        m = mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])
        s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.double()
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -math.inf)
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


class StandIn:
    """A fast path whose output is exact attention times (1 + eps[name]) (rel L2 eps on any rows), in float32;
    eps: {candidate name: error} (missing: 0.01), or a function (q, name) -> error. Records the names."""

    def __init__(self, torch, eps):
        self.torch, self.eps, self.calls = torch, eps, []

    def error(self, q, name):
        return self.eps(q, name) if callable(self.eps) else self.eps.get(name, 0.01)

    def __call__(self, q, k, v, scale=None, causal=False, mask=None, cu=None, *, qk_format="e4m3",
                 k_smoothing=False, p_format="expcast", v_bias_correction=False):
        name = NAMES[(qk_format, k_smoothing, p_format, v_bias_correction)]
        self.calls.append(name)
        return (exact64(self.torch, q, k, v, scale, causal, mask, cu) * (1 + self.error(q, name))).float()


class Owner:
    """A module whose calls a choice is kept for (held weakly, as the integrations' wrappers are)."""


def rand(torch, *shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def af(torch):
    from open_vc_attn.integrations import _auto_format
    return _auto_format


def choose(af, torch, store, owner, eps, pol=AUTO, shape=(2, 96, 3, 64), return_lse=False, **kw):
    """store.choose for q, k, v of `shape` with the stand-in; returns (choice, result, stand-in)."""
    fast = StandIn(torch, eps)
    q, k, v = (rand(torch, *shape, seed=s) for s in range(3))

    def run(p):
        out = fast(q, k, v, kw.get("scale"), kw.get("causal", False), kw.get("key_padding_mask"),
                   kw.get("cu_seqlens"), **p.openvc_kwargs())
        return (out, "lse") if return_lse else out

    choice, res = store.choose(owner, pol, run, q, k, v, return_lse=return_lse, **kw)
    return choice, res, fast


# ---- the choice (open_vc_attn.integrations._auto_format) ------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_auto_on_the_real_kernels(torch, af):
    """On the H200: the choice runs the real formats through open_vc_attn.attention; its measured errors are
    those of the formats' own outputs on the sampled rows, the result is the chosen format's output bit for
    bit, and sharp q/k (x4: E4M3's error about 17%, INT8 + smoothing's about 5%, docs/performance.md) skip
    E4M3 at a 10% tolerance while flat ones keep it."""
    import dataclasses
    import open_vc_attn as ova
    g = torch.Generator(device="cuda").manual_seed(1)
    pol = dataclasses.replace(AUTO, auto_tolerance=0.10)
    for scale, want in ((1.0, ""), (4.0, "qk_format=int8, k_smoothing")):   # "": E4M3, the defaults
        q, k = (scale * torch.randn(1, 4096, 2, 128, device="cuda", generator=g) for _ in range(2))
        v = torch.randn(1, 4096, 2, 128, device="cuda", generator=g)
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))

        def run(p):
            return ova.attention(q, k, v, **p.openvc_kwargs())

        choice, res = af.AutoChoices().choose(Owner(), pol, run, q, k, v)
        assert choice.policy is not None and choice.policy.format_label == want, (scale, choice.reason)
        assert torch.equal(res, ova.attention(q, k, v, **choice.policy.openvc_kwargs()))
        assert all(err == err and 0.0 < err < 0.3 for _, err in choice.errors), choice.errors


def test_candidates(af):
    """Fastest first; the last, INT8 + K smoothing + exp2 P with the V bias correction, is the most accurate."""
    assert af.CANDIDATES == (("e4m3", "e4m3", False, "expcast", False),
                             ("int8+k_smoothing", "int8", True, "expcast", False),
                             ("int8+k_smoothing+exp2", "int8", True, "exp2", False),
                             ("int8+k_smoothing+exp2+v_bias", "int8", True, "exp2", True))
    assert [c[0] for c in af.CANDIDATES] == ALL
    for _, fmt, smooth, pfmt, vbias in af.CANDIDATES:     # each one a valid fixed-format policy
        pol = policy.DispatchPolicy(qk_format=fmt, k_smoothing=smooth, p_format=pfmt, v_bias_correction=vbias)
        assert pol.openvc_kwargs()["v_bias_correction"] is vbias


def test_sample_rows(af):
    rows = af.sample_rows(2, 4096, 40)
    assert rows == af.sample_rows(2, 4096, 40) and len(rows) == af.SAMPLE_ROWS == 256
    assert {(b, h) for b, _, h in rows} == {(b, h) for b in range(2) for h in range(40)}   # every pair
    assert all(0 <= r < 4096 for _, r, _ in rows) and len({r for _, r, _ in rows}) > 200   # spread positions
    many = af.sample_rows(4, 1000, 128)              # more pairs than samples: each pair at most once
    assert len({(b, h) for b, _, h in many}) == 256
    assert len(af.sample_rows(1, 3, 2)) == 6          # fewer rows than samples: each row once
    assert sorted(af.sample_rows(1, 3, 2)) == [(0, r, h) for r in range(3) for h in range(2)]


@pytest.mark.parametrize("eps, chosen, tried", [
    ({"e4m3": 0.02}, "qk_format=e4m3", ["e4m3"]),
    ({"e4m3": 0.2, "int8+k_smoothing": 0.03}, "qk_format=int8, k_smoothing", ["e4m3", "int8+k_smoothing"]),
    ({"e4m3": 0.2, "int8+k_smoothing": 0.07, "int8+k_smoothing+exp2": 0.04},
     "qk_format=int8, k_smoothing, p_format=exp2", ["e4m3", "int8+k_smoothing", "int8+k_smoothing+exp2"]),
    ({"e4m3": 0.2, "int8+k_smoothing": 0.07, "int8+k_smoothing+exp2": 0.06, "int8+k_smoothing+exp2+v_bias": 0.04},
     "qk_format=int8, k_smoothing, p_format=exp2, v_bias_correction", ALL),
])
def test_fastest_format_within_the_tolerance(torch, af, eps, chosen, tried):
    store = af.AutoChoices()
    owner = Owner()
    choice, res, fast = choose(af, torch, store, owner, eps)
    # every candidate runs once, fastest first, with the call's arguments; the chosen one's output is returned
    assert fast.calls == ALL
    assert [name for name, _ in choice.errors] == tried
    for name, err in choice.errors:
        assert abs(err - eps.get(name, 0.01)) < 1e-4, (name, err)     # the stand-in's error, measured
    assert choice.path == policy.OPENVC and choice.policy.format_label == chosen.replace("qk_format=e4m3", "")
    assert choice.reason == f"{chosen} (auto: rel L2 {eps.get(tried[-1], 0.01):.3f} <= 0.05)"
    q, k, v = (rand(torch, 2, 96, 3, 64, seed=s) for s in range(3))
    expected = (exact64(torch, q, k, v) * (1 + eps.get(tried[-1], 0.01))).float()
    assert torch.equal(res, expected)
    # kept: the next call of the owner runs nothing and returns no result
    again, res2, fast2 = choose(af, torch, store, owner, {"e4m3": 0.9})
    assert again is choice and res2 is None and fast2.calls == []


def test_no_format_within_the_tolerance(torch, af):
    store = af.AutoChoices()
    owner = Owner()
    eps = {"e4m3": 0.2, "int8+k_smoothing": 0.12, "int8+k_smoothing+exp2": 0.08, "int8+k_smoothing+exp2+v_bias": 0.06}
    choice, res, _ = choose(af, torch, store, owner, eps)
    assert choice.policy is None and res is None and choice.path == policy.FALLBACK
    assert choice.reason == ("auto: no format within rel L2 0.05 (e4m3 0.200, int8+k_smoothing 0.120, "
                             "int8+k_smoothing+exp2 0.080, int8+k_smoothing+exp2+v_bias 0.060)")
    # a larger tolerance accepts INT8 + smoothing (a new owner: the choice is per owner)
    loose = policy.DispatchPolicy(qk_format="auto", auto_tolerance=0.15, min_query_tokens=64, min_key_tokens=64)
    choice, _, _ = choose(af, torch, store, Owner(), {"e4m3": 0.2, "int8+k_smoothing": 0.12},
                          pol=loose)
    assert choice.reason == "qk_format=int8, k_smoothing (auto: rel L2 0.120 <= 0.15)"
    # a NaN output is no format's pass
    choice, _, _ = choose(af, torch, store, Owner(), lambda q, name: math.nan if name == "e4m3"
                          else 0.01)
    assert choice.errors[0][0] == "e4m3" and math.isnan(choice.errors[0][1])
    assert choice.policy.format_label == "qk_format=int8, k_smoothing"


def test_lse_calls_try_the_same_formats(torch, af):
    """attention() returns the LSE of the keys as given with K smoothing, so LSE calls (ring merges) try the
    same candidates, smoothing included."""
    choice, res, fast = choose(af, torch, af.AutoChoices(), Owner(),
                               {"e4m3": 0.2, "int8+k_smoothing": 0.3}, return_lse=True)
    assert fast.calls == ALL
    assert choice.reason == "qk_format=int8, k_smoothing, p_format=exp2 (auto: rel L2 0.010 <= 0.05)"
    assert res[1] == "lse" and choice.policy.k_smoothing


def test_int8_is_not_tried_past_the_fast_path_range(torch, af):
    huge = 1 << 20
    choice, _, fast = choose(af, torch, af.AutoChoices(), Owner(), {"e4m3": 0.2},
                             lengths=(huge, huge))
    assert fast.calls == ["e4m3"] and choice.policy is None and choice.reason.endswith("(e4m3 0.200)")


@pytest.mark.parametrize("kind", ["causal", "bool mask", "additive mask", "scale", "packed", "packed causal"])
def test_exact_rows_of_each_call_class(torch, af, kind):
    """The measured error is the stand-in's 0.02 only if the sampled rows' exact attention is right."""
    kw = {}
    shape = (2, 96, 3, 64)
    if kind == "causal":
        kw["causal"] = True
    elif kind.endswith("mask"):
        keep = torch.ones(2, 96, dtype=torch.bool)
        keep[0, 70:] = False
        keep[1, :5] = False
        kw["key_padding_mask"] = (keep if kind == "bool mask" else
                                  torch.zeros(2, 1, 1, 96).masked_fill(~keep[:, None, None], -10000.0)
                                  .to(torch.bfloat16))
    elif kind == "scale":
        kw["scale"] = 0.3
    else:
        shape = (200, 3, 64)       # three sequences of 50, 0 and 90 tokens; rows 140.. are in none
        kw.update(cu_seqlens=torch.tensor([0, 50, 50, 140], dtype=torch.int32), lengths=(90, 90),
                  causal=kind == "packed causal")
    choice, _, _ = choose(af, torch, af.AutoChoices(), Owner(), {"e4m3": 0.02}, shape=shape, **kw)
    assert choice.errors[0][0] == "e4m3" and abs(choice.errors[0][1] - 0.02) < 1e-4, choice.errors


def test_packed_rows_past_the_last_sequence_are_not_compared(torch, af):
    q, k, v = (rand(torch, 200, 3, 64, seed=s) for s in range(3))
    cu = torch.tensor([0, 50, 140], dtype=torch.int32)

    def run(p):
        out = exact64(torch, q, k, v, cu=cu).float() * 1.01
        out[140:] = 1e6            # openvc does not write these rows
        return out

    choice, _ = af.AutoChoices().choose(Owner(), AUTO, run, q, k, v, cu_seqlens=cu)
    assert abs(choice.errors[0][1] - 0.01) < 1e-4


def test_choices_are_per_owner_and_call_class_and_resettable(torch, af):
    store = af.AutoChoices()
    a, b = Owner(), Owner()
    ca, _, _ = choose(af, torch, store, a, {"e4m3": 0.02})
    cb, _, _ = choose(af, torch, store, b, {"e4m3": 0.2})
    cc, _, fast = choose(af, torch, store, a, {"e4m3": 0.2}, causal=True)      # another class of a's calls
    assert fast.calls and ca.policy.qk_format == "e4m3" and cb.policy.qk_format == "int8"
    assert cc.policy.qk_format == "int8"
    assert store.choices(a) == {(False,) * 5: ca, (True, False, False, False, False): cc}
    store.reset(a)
    assert store.choices(a) == {} and store.choices(b) == {(False,) * 5: cb}
    _, _, fast = choose(af, torch, store, a, {"e4m3": 0.2})
    assert fast.calls                                     # chose again
    store.reset()
    assert store.choices(b) == {}
    with pytest.raises(RuntimeError, match="needs the attention module"):
        choose(af, torch, store, None, {})


def test_choosing_while_capturing_raises(torch, af, monkeypatch):
    store = af.AutoChoices()
    owner = Owner()
    chosen, _, _ = choose(af, torch, store, owner, {})
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"^qk_format='auto': this attention module has not chosen .* "
                                           r"CUDA graph capture does not allow: run one eager call"):
        choose(af, torch, store, Owner(), {})
    assert choose(af, torch, store, owner, {})[0] is chosen     # a kept choice needs no host read: capturable


# ---- yunchang's processor ---------------------------------------------------------------------------------------

def test_yunchang_processor_auto(torch, monkeypatch):
    from open_vc_attn.integrations import yunchang as ovy
    def sharp(q, name):      # e4m3 fails on the large q, INT8 + K smoothing passes (its LSE is the keys')
        return {"e4m3": 0.2, "int8+k_smoothing": 0.03}.get(name, 0.01) if q.float().std() > 2 else 0.01

    fast = StandIn(torch, sharp)
    seen = []

    def fast_attention(q, k, v, scale, causal=False, **fmt):
        seen.append(fmt)
        return fast(q, k, v, scale, causal, **fmt), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    monkeypatch.setattr(ovy, "_fast_attention", fast_attention)
    flat, sharp_proc = ovy.OpenVCAttnProcessor(policy=AUTO), ovy.OpenVCAttnProcessor(policy=AUTO)
    q, k, v = (rand(torch, 1, 128, 2, 64, seed=s) for s in range(3))
    qs = rand(torch, 1, 128, 2, 64, seed=5, scale=4.0)
    ovy.reset_stats()
    out, _ = flat(q, k, v, softmax_scale=0.125)
    out_s, _ = sharp_proc(qs, k, v, softmax_scale=0.125)
    flat(q, k, v, softmax_scale=0.125)
    sharp_proc(qs, k, v, softmax_scale=0.125)
    assert any(f["k_smoothing"] for f in seen)   # the ring merges by the LSE, which smoothing keeps right now
    assert ovy.stats() == {("openvc", "qk_format=e4m3 (auto: rel L2 0.010 <= 0.05)"): 2,
                           ("openvc", "qk_format=int8, k_smoothing (auto: rel L2 0.030 <= 0.05)"): 2}
    assert len(seen) == 4 + 4 + 2
    assert torch.equal(out_s, (exact64(torch, qs, k, v, 0.125) * 1.03).float().to(torch.bfloat16))
    ovy.reset_auto(flat)
    flat(q, k, v, softmax_scale=0.125)
    assert len(seen) == 10 + 4
    ovy.reset_auto()


# ---- diffusers ----------------------------------------------------------------------------------------------------

@pytest.fixture
def diffusers_fast(torch, ovd, monkeypatch):
    """Installs a StandIn as the diffusers backend's fast path (CPU tensors let through the device check);
    set .eps before the calls."""
    fast = StandIn(torch, {})

    def fast_attention(q, k, v, scale, return_lse=False, attn_mask=None, causal=False, **fmt):
        out = fast(q, k, v, scale, causal, attn_mask, **fmt)      # float32: the integration casts
        return (out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])) if return_lse else out

    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    monkeypatch.setattr(ovd, "_fast_attention", fast_attention)
    ovd.reset_stats()
    return fast


def sharp_when_q_is_large(q, name):
    """e4m3 fails on a layer whose q is large (its QK norm weights scaled up), INT8 + smoothing passes."""
    return {"e4m3": 0.2, "int8+k_smoothing": 0.03}.get(name, 0.01) if q.float().std() > 2 else 0.01


def tiny_wan(torch, layers=2):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
                                  text_dim=32, freq_dim=32, ffn_dim=64, num_layers=layers,
                                  rope_max_seq_len=64).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16, generator=g).to(torch.bfloat16),
                  timestep=torch.tensor([500]), return_dict=False,
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(torch.bfloat16))
    return model, inputs            # 2 * 8 * 8 = 128 video tokens; 8 text tokens


def forward(torch, model, inputs):
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**inputs)[0]


def test_diffusers_auto_per_module(torch, ovd, diffusers_fast):
    model, inputs = tiny_wan(torch)
    with torch.no_grad():
        model.blocks[1].attn1.norm_q.weight.mul_(4.0)     # a sharp layer
    diffusers_fast.eps = sharp_when_q_is_large
    ovd.apply(model, policy=AUTO)
    try:
        out1 = forward(torch, model, inputs)
        assert diffusers_fast.calls == ALL * 2
        out2 = forward(torch, model, inputs)
        assert diffusers_fast.calls[8:] == ["e4m3", "int8+k_smoothing"]      # the kept choices
        # the choosing forward returned the chosen formats' outputs: the same as the forward after it
        assert torch.equal(out1, out2)
        assert ovd.stats(model) == {("openvc", "qk_format=e4m3 (auto: rel L2 0.010 <= 0.05)"): 2,
                                    ("openvc", "qk_format=int8, k_smoothing (auto: rel L2 0.030 <= 0.05)"): 2,
                                    ("fallback", "few keys (8 < 64)"): 4}
        ovd.reset_auto(model)
        forward(torch, model, inputs)
        assert len(diffusers_fast.calls) == 10 + 8
    finally:
        ovd.remove(model)
    ovd.apply(model, policy=AUTO)          # new wrappers choose again
    try:
        forward(torch, model, inputs)
        assert len(diffusers_fast.calls) == 18 + 8
    finally:
        ovd.remove(model)


def test_diffusers_auto_falls_back_to_the_framework(torch, ovd, diffusers_fast):
    model, inputs = tiny_wan(torch, layers=1)
    native = forward(torch, model, inputs)
    diffusers_fast.eps = dict.fromkeys(ALL, 0.2)
    ovd.apply(model, policy=AUTO)
    try:
        out = forward(torch, model, inputs)
        forward(torch, model, inputs)
    finally:
        ovd.remove(model)
    why = ("auto: no format within rel L2 0.05 (e4m3 0.200, int8+k_smoothing 0.200, int8+k_smoothing+exp2 0.200, "
           "int8+k_smoothing+exp2+v_bias 0.200)")
    assert ovd.stats(model) == {("fallback", why): 2, ("fallback", "few keys (8 < 64)"): 2}
    assert torch.equal(out, native)        # every call on the native backend: the unwrapped model's output
    assert len(diffusers_fast.calls) == 4


def test_diffusers_auto_needs_apply(torch, ovd):
    for fn in (ovd.register, ovd.enable):
        with pytest.raises(ValueError, match=r"^policy: qk_format='auto' chooses a format per attention module"):
            fn(policy=AUTO)
    with pytest.raises(ValueError, match=r"^policy: qk_format='auto'"):
        with ovd.openvc_attention(policy=AUTO):
            pass


def test_bf16_first_steps(torch, ovd, diffusers_fast):
    pipe, run = wan22_pipeline(torch, fallback_warnings_are_errors=True)
    native = run()
    small = policy.DispatchPolicy(min_query_tokens=64, min_key_tokens=64)
    ovd.apply(pipe, policy=small)              # both steps on openvc
    try:
        both = run()
    finally:
        ovd.remove(pipe)
    # the independent reference of one BF16 step: only transformer_2 (step 1) wrapped
    ovd.apply(pipe.transformer_2, policy=small)
    try:
        second_only = run()
    finally:
        ovd.remove(pipe.transformer_2)
    ovd.reset_stats()
    ovd.apply(pipe, policy=small, bf16_steps=1)
    try:
        assert "step" in vars(pipe.scheduler) and "set_timesteps" in vars(pipe.scheduler)
        out = run()
        out_again = run()                      # set_timesteps starts the count again
    finally:
        ovd.remove(pipe)
    assert "step" not in vars(pipe.scheduler) and "set_timesteps" not in vars(pipe.scheduler)
    assert torch.equal(out, second_only) and torch.equal(out_again, second_only)
    assert not torch.equal(second_only, native) and not torch.equal(second_only, both)
    bf16 = ("fallback", "bf16_steps: first 1 denoising steps on the framework's attention")
    few = ("fallback", "few keys (16 < 64)")
    # per run: step 0 on transformer (cond + uncond forwards), step 1 on transformer_2
    assert ovd.stats(pipe.transformer) == {bf16: 4, few: 4}
    assert ovd.stats(pipe.transformer_2) == {("openvc", ""): 4, few: 4}
    # every step in BF16: the native pipeline, bit for bit
    ovd.apply(pipe, policy=small, bf16_steps=1)
    ovd.apply(pipe, bf16_steps=2)              # re-apply: replaces the counter (one wrapper on the scheduler)
    try:
        assert torch.equal(run(), native)
        ovd.apply(pipe, bf16_steps=0)
        assert "step" not in vars(pipe.scheduler)
        assert torch.equal(run(), both)        # off again
    finally:
        ovd.remove(pipe)


def test_bf16_first_steps_with_auto_choose_after_them(torch, ovd, diffusers_fast):
    pipe, run = wan22_pipeline(torch, fallback_warnings_are_errors=True)
    ovd.apply(pipe, policy=AUTO, bf16_steps=1)
    try:
        run()
    finally:
        ovd.remove(pipe)
    # transformer_2 only (step 1): its conditional forward chooses, the unconditional one keeps e4m3
    assert diffusers_fast.calls == ALL + ["e4m3"]
    assert ovd.stats(pipe.transformer_2)[("openvc", "qk_format=e4m3 (auto: rel L2 0.010 <= 0.05)")] == 2


def test_bf16_steps_arguments(torch, ovd):
    pipe, run = wan22_pipeline(torch, fallback_warnings_are_errors=True)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="^bf16_steps: expected None or an int >= 0"):
            ovd.apply(pipe, bf16_steps=bad)
    ovd.remove(pipe)
    with pytest.raises(ValueError, match="^bf16_steps: counts a pipeline's denoising steps .* pass the pipeline"):
        ovd.apply(pipe.transformer, bf16_steps=1)
    ovd.remove(pipe.transformer)
    ovd.apply(pipe, bf16_steps=1)
    try:
        from diffusers import FlowMatchEulerDiscreteScheduler
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
        with pytest.raises(RuntimeError, match=r"^bf16_steps: pipe.scheduler was replaced .* apply\(pipe, "):
            run()
    finally:
        ovd.remove(pipe)


# ---- diffusers models whose processors openvc replaces (_diffusers_processors): auto and bf16_steps too ----------

def tiny_cogvideox(torch):
    """CogVideoX 1.0, 2 layers of 2 heads of 64: one joint attention per layer over 8 text + 192 video tokens."""
    from diffusers import CogVideoXTransformer3DModel
    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
                                        num_layers=2, text_embed_dim=32, time_embed_dim=8, sample_width=16,
                                        sample_height=16, sample_frames=9, patch_size=2,
                                        max_text_seq_length=8).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 3, 4, 16, 16, generator=g).to(torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(torch.bfloat16),
                  timestep=torch.tensor([500]), return_dict=False)
    return model, inputs


class StepPipe:
    """What apply(pipe, bf16_steps=...) needs of a pipeline: components and a scheduler; run() makes the
    denoising loop's calls (set_timesteps, then per step a forward and scheduler.step)."""

    def __init__(self, torch, model, inputs):
        self.torch, self.inputs = torch, inputs
        self.components = {"transformer": model}
        self.scheduler = type("Scheduler", (), {"set_timesteps": lambda self, n: None, "step": lambda self: None})()

    def run(self, steps=2):
        from open_vc_attn.integrations.diffusers import FallbackWarning
        self.scheduler.set_timesteps(steps)
        outs = []
        for _ in range(steps):
            with warnings.catch_warnings():
                warnings.simplefilter("error", FallbackWarning)    # the BF16 step is no "no openvc" forward
                outs.append(forward(self.torch, self.components["transformer"], self.inputs))
            self.scheduler.step()
        return outs


def test_replaced_processors_auto_per_processor_and_bf16_steps(torch, ovd, diffusers_fast):
    model, inputs = tiny_cogvideox(torch)
    with torch.no_grad():
        model.transformer_blocks[1].attn1.norm_q.weight.mul_(4.0)     # a sharp layer
    native = forward(torch, model, inputs)
    diffusers_fast.eps = sharp_when_q_is_large
    pipe = StepPipe(torch, model, inputs)
    ovd.apply(pipe, policy=AUTO, bf16_steps=1)
    try:
        assert all(type(m.processor).__name__ == "CogVideoXProcessor" for m in model.modules()
                   if hasattr(m, "processor"))
        first, second = pipe.run()
        assert torch.equal(first, native)                 # step 0: the original processors' own SDPA calls
        # step 1: each replaced processor chooses its own format (the sharp layer INT8 + K smoothing)
        assert diffusers_fast.calls == ALL * 2
        assert not torch.equal(second, native)
        bf16 = ("fallback", "bf16_steps: first 1 denoising steps on the framework's attention")
        assert ovd.stats(model) == {bf16: 2, ("openvc", "qk_format=e4m3 (auto: rel L2 0.010 <= 0.05)"): 1,
                                    ("openvc", "qk_format=int8, k_smoothing (auto: rel L2 0.030 <= 0.05)"): 1}
        pipe.run()                                        # the kept choices
        assert diffusers_fast.calls[8:] == ["e4m3", "int8+k_smoothing"]
        ovd.reset_auto(pipe)                              # the replaced processors choose again
        pipe.run()
        assert len(diffusers_fast.calls) == 10 + 8
    finally:
        ovd.remove(pipe)
    assert not any(type(m.processor).__name__ == "CogVideoXProcessor" for m in model.modules()
                   if hasattr(m, "processor"))


def test_replaced_processors_auto_falls_back_to_their_own_sdpa(torch, ovd, diffusers_fast):
    model, inputs = tiny_cogvideox(torch)
    native = forward(torch, model, inputs)
    diffusers_fast.eps = dict.fromkeys(ALL, 0.2)
    ovd.apply(model, policy=AUTO)
    try:
        out = forward(torch, model, inputs)
    finally:
        ovd.remove(model)
    why = ("auto: no format within rel L2 0.05 (e4m3 0.200, int8+k_smoothing 0.200, int8+k_smoothing+exp2 0.200, "
           "int8+k_smoothing+exp2+v_bias 0.200)")
    assert ovd.stats(model) == {("fallback", why): 2}
    assert torch.equal(out, native)
    assert len(diffusers_fast.calls) == 8


# ---- SGLang (stand-ins for its base classes, in a subprocess) -----------------------------------------------------

SGLANG_SCRIPT = r'''
import json, sys, types, dataclasses
import torch
base = "sglang.multimodal_gen.runtime.layers.attention.backends"
names = ["sglang", "sglang.multimodal_gen", "sglang.multimodal_gen.runtime", "sglang.multimodal_gen.runtime.layers",
         "sglang.multimodal_gen.runtime.layers.attention", base, base + ".attention_backend", base + ".sdpa",
         "sglang.multimodal_gen.runtime.platforms"]
mods = {n: types.ModuleType(n) for n in names}
sys.modules.update(mods)
ab = mods[base + ".attention_backend"]
class AttentionMetadata: pass
for n in ("AttentionBackend", "AttentionImpl", "AttentionMetadataBuilder"):
    setattr(ab, n, type(n, (), {}))
ab.AttentionMetadata = AttentionMetadata
class SDPAImpl:
    def __init__(self, **kw): pass
    def forward(self, q, k, v, meta):
        return "sdpa"
mods[base + ".sdpa"].SDPAImpl = SDPAImpl
mods[base + ".sdpa"].SDPABackend = type("SDPABackend", (), {})
mods["sglang.multimodal_gen.runtime.platforms"].AttentionBackendEnum = types.SimpleNamespace(TORCH_SDPA="sdpa")
from open_vc_attn.integrations import policy, sglang as m
policy._device_reason = lambda device: None
calls = []
def fast(q, k, v, scale, lse, causal=False, **fmt):
    calls.append(["dense", fmt["qk_format"], fmt["k_smoothing"], fmt["p_format"], fmt["v_bias_correction"]])
    return q * (1.2 if fmt["qk_format"] == "e4m3" else 1.0)      # e4m3 20% off, int8 "exact" for q = v, one key
def fast_varlen(q, k, v, cu, max_seqlen, scale, causal, **fmt):
    calls.append(["packed", fmt["qk_format"], fmt["k_smoothing"], fmt["p_format"], fmt["v_bias_correction"]])
    return q.clone()
m._fast_attention, m._fast_varlen_attention = fast, fast_varlen
auto = policy.DispatchPolicy(qk_format="auto", min_query_tokens=1, min_key_tokens=1)
impl = m.OpenVCAttentionImpl(num_heads=2, head_size=64, softmax_scale=0.125, causal=False, openvc_policy=auto)
x = torch.randn(1, 1, 2, 64).to(torch.bfloat16)     # one query, one key: attention is v
impl.forward(x, x, x); impl.forward(x, x, x)
cu = torch.tensor([0, 1, 2], dtype=torch.int32)
xs = torch.randn(2, 2, 64).to(torch.bfloat16)
impl.forward_varlen(xs, xs, xs, cu_seqlens=cu, max_seqlen=1)
impl.forward_varlen(xs, xs, xs, cu_seqlens=cu, max_seqlen=1)
print(json.dumps({"calls": calls, "stats": [[list(k), n] for k, n in m.stats().items()]}))
'''


def test_sglang_impl_auto(torch, tmp_path):
    script = tmp_path / "sglang_auto.py"
    script.write_text(SGLANG_SCRIPT)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    tried = [["e4m3", False, "expcast", False], ["int8", True, "expcast", False], ["int8", True, "exp2", False],
             ["int8", True, "exp2", True]]
    assert got["calls"] == ([["dense", *c] for c in tried] + [["dense", "int8", True, "expcast", False]]
                            + [["packed", *c] for c in tried] + [["packed", "e4m3", False, "expcast", False]])
    assert dict((tuple(k), n) for k, n in got["stats"]) == {
        ("openvc", "qk_format=int8, k_smoothing (auto: rel L2 0.000 <= 0.05)"): 2,
        ("openvc", "qk_format=e4m3 (auto: rel L2 0.000 <= 0.05)"): 2}
