"""Block-sparse masks through the diffusers integration (docs/integrations/diffusers.md, "Block-sparse masks").

A torch FlexAttention BlockMask reaches open_vc_attn.attention(..., block_mask=) as a dispatch call's attn_mask
(diffusers' flex backend form) or attached with apply(model, block_mask=mask).

- With torch and diffusers (CPU): the policy's reasons (open_vc_attn.integrations.policy.block_mask_reason), a
  BlockMask attn_mask reaching openvc's call (a CPU stand-in that records its block_mask and attends the listed
  blocks whole), the calls it does not take running on diffusers' flex backend (bit for bit its own call, an
  LSE too), the context-parallel error, stats() under "openvc-block-sparse", apply's block_mask on a small Wan
  (its self-attention only; kept by a later apply, dropped by remove), its argument errors, and
  qk_format="auto" measuring a block-sparse call against the block-level mask.
- Marked `gpu` (an sm_90 device): a small Wan with masks.frame_causal / masks.temporal_window through the real
  kernel, both forms, against diffusers' native backend (torch SDPA) given the same block-level mask as a bool
  attn_mask.
"""
import importlib.util
import math
import pathlib
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BLOCK_SPARSE = "openvc-block-sparse"
# The Wan output bound of test_integrations_diffusers.py (MAX_REL_L2): openvc's per-call FP8 error (3-6% rel L2)
# is one residual branch among several in the transformer.
MAX_REL_L2 = 0.03


@pytest.fixture(scope="module")
def masks(torch):
    pytest.importorskip("torch.nn.attention.flex_attention", reason="FlexAttention needs torch >= 2.5")
    from open_vc_attn import masks
    return masks


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():   # flex_attention without torch.compile warns that it is unfused
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


@pytest.fixture
def no_device_check(policy, monkeypatch):
    monkeypatch.setattr(policy, "_device_reason", lambda device: None)


def block_level(torch, mask):
    """The keys each query sees when every listed block (partial or full) is attended whole: bool [Sq, Sk], from
    the BlockMask's own to_dense() (batch and head dims of 1)."""
    sq, sk = mask.seq_lengths
    blocks = mask.to_dense()[0, 0].bool()
    return blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)[:sq, :sk]


def attend(torch, q, k, v, keep=None, scale=None):
    """float64 attention of [B, S, H, D] tensors with a bool [Sq, Sk] mask: (out [B, Sq, H, D], lse [B, H, Sq])."""
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return (torch.softmax(s, -1) @ vd).transpose(1, 2), torch.logsumexp(s, -1)


@pytest.fixture
def sparse_fast(torch, ovd, monkeypatch, no_device_check):
    """openvc's fast path replaced by exact attention over the listed blocks (whole), in float64 then BF16;
    records (block_mask, attn_mask, causal, q shape) of each call."""
    given = []

    def fast(q, k, v, scale, return_lse=False, attn_mask=None, causal=False, qk_format="e4m3", k_smoothing=False,
             p_format="expcast", block_mask=None, v_bias_correction=False):
        given.append((block_mask, attn_mask, causal, tuple(q.shape)))
        out, lse = attend(torch, q, k, v, None if block_mask is None else block_level(torch, block_mask), scale)
        out = out.to(torch.bfloat16)
        return (out, lse.float()) if return_lse else out

    monkeypatch.setattr(ovd, "_fast_attention", fast)
    return given


def qkv(torch, s=1024, h=2, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, s, h, d, generator=g).to(torch.bfloat16) for _ in range(3))


def small_policy(policy, n, **kw):
    return policy.DispatchPolicy(min_query_tokens=n, min_key_tokens=n, **kw)


# ---- the policy ------------------------------------------------------------------------------------------------

def test_policy_block_mask_reasons(torch, policy, masks, no_device_check):
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v = qkv(torch)
    fc = masks.frame_causal(4, 256, device="cpu")                         # 1024 tokens
    pol = small_policy(policy, 1024)
    assert policy.choose_path(q, k, v, attn_mask=fc, policy=pol) == (policy.OPENVC, "")
    int8 = small_policy(policy, 1024, qk_format="int8")
    assert policy.choose_path(q, k, v, attn_mask=fc, policy=int8) == (policy.OPENVC, "qk_format=int8")
    b64 = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 1024, 1024, device="cpu", BLOCK_SIZE=64)
    q96, k96, v96 = qkv(torch, d=96)
    cases = [
        (dict(attn_mask=b64), "block_mask BLOCK_SIZE (64, 64) (takes (128, 128): openvc's query tile and key block)"),
        (dict(attn_mask=fc, causal=True), "block_mask with causal"),
        (dict(attn_mask=masks.frame_causal(4, 200, device="cpu")),
         "block_mask built for (Q_LEN, KV_LEN) = (800, 800), the call has (1024, 1024)"),
        (dict(attn_mask=masks.frame_causal(4, 256, heads=3, device="cpu")),
         "block_mask batch and heads (1, 3) (takes 1 or the call's 1 and 2)"),
        (dict(attn_mask=fc, policy=small_policy(policy, 1024, qk_format="int8", p_format="exp2")),
         "block_mask with p_format='exp2'"),
        (dict(attn_mask=fc, policy=small_policy(policy, 1024, qk_format="int8", v_bias_correction=True)),
         "block_mask with v_bias_correction"),
        (dict(attn_mask=fc, policy=small_policy(policy, 2048)), "short query (1024 < 2048 tokens)"),
    ]
    for kw, reason in cases:
        kw.setdefault("policy", pol)
        assert policy.choose_path(q, k, v, **kw) == (policy.FALLBACK, reason), kw
    assert policy.choose_path(q96, k96, v96, attn_mask=fc, policy=pol) == (
        policy.FALLBACK, "head_dim 96/96/96 (takes (128, 64))")
    assert policy.choose_path(q, k, v, attn_mask=masks.frame_causal(4, 256, heads=2, device="cpu"),
                              policy=pol) == (policy.OPENVC, "")


# ---- a BlockMask as a dispatch call's attn_mask -------------------------------------------------------------------

def test_attn_mask_block_mask_reaches_openvc(torch, ovd, policy, masks, sparse_fast):
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    q, k, v = qkv(torch, s=1000)
    fc = masks.frame_causal(5, 200, device="cpu")          # 1000 tokens: frame edges inside blocks
    ovd.reset_stats()
    with ovd.openvc_attention(policy=small_policy(policy, 1000)):
        out = dispatch_attention_fn(q, k, v, attn_mask=fc)
        out_l, lse = dispatch_attention_fn(q, k, v, attn_mask=fc, attention_kwargs={"return_lse": True})
    assert [(m is fc, a, c, s) for m, a, c, s in sparse_fast] == [(True, None, False, (1, 1000, 2, 128))] * 2
    assert ovd.stats() == {(BLOCK_SPARSE, ""): 2}
    ref, ref_lse = attend(torch, q, k, v, block_level(torch, fc))
    assert torch.equal(out, ref.to(torch.bfloat16)) and torch.equal(out_l, out)
    assert lse.shape == (1, 1000, 2) and torch.allclose(lse.double(), ref_lse.transpose(1, 2), atol=1e-5)
    # the block-level mask is not the element mask: query 0 (frame 0) sees keys 200-255 (frame 1) too
    assert block_level(torch, fc)[0, 255] and not block_level(torch, fc)[0, 256]


def test_block_masks_openvc_does_not_take_run_on_flex(torch, ovd, policy, masks, sparse_fast):
    """Each goes to diffusers' flex backend (the default fallback, native SDPA, cannot take a BlockMask), bit for
    bit flex's own call, with its reason counted; none reaches openvc."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v = qkv(torch, s=512)
    q96, k96, v96 = qkv(torch, s=512, d=96)
    fc = masks.frame_causal(4, 128, device="cpu")
    b64 = create_block_mask(lambda b, h, i, j: j // 128 <= i // 128, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64)
    cases = [((q, k, v), dict(attn_mask=b64), "block_mask BLOCK_SIZE (64, 64) (takes (128, 128): openvc's query "
                                              "tile and key block)"),
             ((q, k, v), dict(attn_mask=fc, is_causal=True), "block_mask with causal"),
             ((q96, k96, v96), dict(attn_mask=fc), "head_dim 96/96/96 (takes (128, 64))")]
    for args, kw, reason in cases:
        ovd.reset_stats()
        with ovd.openvc_attention(policy=small_policy(policy, 512)):
            out = dispatch_attention_fn(*args, **kw)
        assert ovd.stats() == {("fallback", reason): 1}, reason
        assert torch.equal(out, dispatch_attention_fn(*args, **kw, backend="flex")), reason
    ovd.reset_stats()
    with ovd.openvc_attention(policy=small_policy(policy, 1024)):
        out = dispatch_attention_fn(q, k, v, attn_mask=fc)
        out_l, lse = dispatch_attention_fn(q, k, v, attn_mask=fc, attention_kwargs={"return_lse": True})
    assert ovd.stats() == {("fallback", "short query (512 < 1024 tokens)"): 2} and sparse_fast == []
    assert torch.equal(out, dispatch_attention_fn(q, k, v, attn_mask=fc, backend="flex"))
    # with the LSE (diffusers' flex backend returns none): flex's, element-exact (frame-causal at 128 tokens)
    i = torch.arange(512)
    ref, ref_lse = attend(torch, q, k, v, (i[None, :] // 128) <= (i[:, None] // 128))
    assert float((out_l.double() - ref).norm() / ref.norm()) < 1e-2
    assert lse.shape == (1, 512, 2) and torch.allclose(lse.double(), ref_lse.transpose(1, 2), atol=1e-3)


def test_block_mask_under_context_parallelism_raises(torch, ovd, masks):
    q, k, v = qkv(torch)
    with pytest.raises(ValueError, match="^attn_mask: a FlexAttention BlockMask is not supported under context "
                                         "parallelism"):
        ovd._openvc_backend(q, k, v, attn_mask=masks.frame_causal(4, 256, device="cpu"), _parallel_config=object())


# ---- apply(model, block_mask=...) on a small Wan -------------------------------------------------------------------

def load_example(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def masked_processor_class():
    """Wan's processor passing a mask as the self-attention's attention_mask (Wan passes none): the form a user
    of diffusers' flex backend writes. Its calls then reach the dispatch with attn_mask=mask."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class MaskedWanAttnProcessor(WanAttnProcessor):
        def __init__(self, mask):
            super().__init__()
            self.mask = mask

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            if encoder_hidden_states is None:          # self-attention (attn1)
                attention_mask = self.mask
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    return MaskedWanAttnProcessor


def set_self_attention(model, proc_of):
    for block in model.blocks:
        block.attn1.processor = proc_of()


def wan(torch, frames, height, width, device="cpu"):
    """A random 2-layer Wan (2 heads of 128) and inputs of frames x height x width latents: frames *
    (height/2) * (width/2) video tokens (patch 1 x 2 x 2), 512 text tokens."""
    ex = load_example("diffusers_wan")
    model = ex.build_model(heads=2, layers=2, ffn_dim=512, text_dim=64, device=device)
    inputs = ex.make_inputs(frames=frames, height=height, width=width, text_tokens=512, text_dim=64, device=device)
    return ex, model, inputs


def test_apply_block_mask_wan(torch, ovd, policy, masks, sparse_fast):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    ex, model, inputs = wan(torch, 4, 30, 40)             # 4 frames of 15 x 20 = 300 tokens: 1200
    fc = masks.frame_causal(4, 300, device="cpu")
    masked = masked_processor_class()
    set_self_attention(model, lambda: masked(block_level(torch, fc)[None, None]))   # native SDPA, block-level mask
    ref = ex.forward(model, inputs)
    set_self_attention(model, WanAttnProcessor)
    dense = ex.forward(model, inputs)
    pol = small_policy(policy, 1024)
    assert ovd.apply(model, policy=pol, block_mask=fc) == 4
    ovd.reset_stats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ovd.FallbackWarning)
            out = ex.forward(model, inputs)
            assert ovd.apply(model) == 0                  # already wrapped; the mask stays
            again = ex.forward(model, inputs)
    finally:
        assert ovd.remove(model) == 4
    expected = {(BLOCK_SPARSE, ""): 4, ("fallback", "few keys (512 < 1024)"): 4}   # 2 layers x 2 forwards
    assert ovd.stats(model) == expected and ovd.stats() == expected
    assert [(m is fc, a, c, s) for m, a, c, s in sparse_fast] == [(True, None, False, (1, 1200, 2, 128))] * 4
    assert torch.equal(out, again)
    err, moved = ex.rel_l2(out, ref), ex.rel_l2(dense, ref)
    assert err < 1e-2 < moved, (err, moved)               # the stand-in is exact: only BF16 rounding differs
    # the attn_mask form (flex's): the same calls, the same output
    set_self_attention(model, lambda: masked(fc))
    sparse_fast.clear()
    ovd.apply(model, policy=pol)
    ovd.reset_stats()
    try:
        assert torch.equal(ex.forward(model, inputs), out)
    finally:
        ovd.remove(model)
    assert ovd.stats(model) == {(BLOCK_SPARSE, ""): 2, ("fallback", "few keys (512 < 1024)"): 2}
    assert [m is fc for m, *_ in sparse_fast] == [True] * 2
    # remove() dropped the attached mask; a mask of other lengths leaves the calls dense
    set_self_attention(model, WanAttnProcessor)
    for kw in ({}, {"block_mask": masks.frame_causal(5, 300, device="cpu")}):
        ovd.apply(model, policy=pol, **kw)
        ovd.reset_stats()
        try:
            ex.forward(model, inputs)
        finally:
            ovd.remove(model)
        assert ovd.stats(model) == {("openvc", ""): 2, ("fallback", "few keys (512 < 1024)"): 2}, kw


def test_apply_block_mask_arguments(torch, ovd, masks):
    from torch.nn.attention.flex_attention import create_block_mask
    _, model, _ = wan(torch, 1, 8, 8)
    fc = masks.frame_causal(4, 256, device="cpu")
    for bad in ("frame_causal", masks.block_lists(fc)):
        with pytest.raises(TypeError, match="^block_mask: expected None or a torch.nn.attention.flex_attention"):
            ovd.apply(model, block_mask=bad)
    b64 = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    with pytest.raises(ValueError, match=r"^block_mask: expected BLOCK_SIZE \(128, 128\).*got \(64, 64\)"):
        ovd.apply(model, block_mask=b64)
    assert not any(type(m.processor).__name__.startswith("OpenVC") for m in model.modules() if hasattr(m, "processor"))


def test_auto_measures_against_the_block_level_mask(torch, masks):
    """qk_format="auto" on a block-sparse call: the exact rows see the listed blocks whole (a stand-in exact over
    them measures its own error, 0 here; dense exact rows would measure the mask's effect), exp2 P and the V bias
    correction are not tried (open_vc_attn.attention does not combine them with block lists), and the choice is its
    own call class."""
    from open_vc_attn.integrations import _auto_format as af
    from open_vc_attn.integrations import policy

    class Owner:
        pass

    q, k, v = qkv(torch, s=1000)
    fc = masks.frame_causal(5, 200, device="cpu")
    tried = []

    def run(pol, eps):
        tried.append(pol.format_label)
        return (attend(torch, q, k, v, block_level(torch, fc))[0] * (1 + eps)).float()

    auto = policy.DispatchPolicy(qk_format="auto", min_query_tokens=64, min_key_tokens=64)
    store, owner = af.AutoChoices(), Owner()
    choice, res = store.choose(owner, auto, lambda pol: run(pol, 0.0), q, k, v, block_mask=fc)
    assert choice.policy.qk_format == "e4m3" and choice.errors[0][1] < 1e-6 and res is not None
    assert list(store.choices(owner)) == [(False, False, False, False, True)]
    tried.clear()
    choice, res = af.AutoChoices().choose(owner, auto, lambda pol: run(pol, 0.2), q, k, v, block_mask=fc)
    assert choice.policy is None and res is None
    assert (tried == ["", "qk_format=int8, k_smoothing"]
            and [n for n, _ in choice.errors] == ["e4m3", "int8+k_smoothing"])
    assert all(abs(err - 0.2) < 1e-3 for _, err in choice.errors), choice.errors


# ---- GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["frame_causal", "temporal_window"])
def test_gpu_wan_block_mask(torch, ovd, policy, masks, kind):
    """A small Wan (2 layers, 2 heads of 128) at 7 latent frames of 15 x 20 (300 tokens a frame: frame edges
    inside 128-token blocks), 2,100 video tokens, through the sm_90a kernel with the mask attached by apply
    and as the processors' attn_mask: the same calls (bit for bit the same output), counted block-sparse, within
    MAX_REL_L2 of diffusers' native backend (torch SDPA, BF16) given the block-level mask as a bool attn_mask,
    and nearer to it than the dense forward is (the mask was applied)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    ex, model, inputs = wan(torch, 7, 30, 40, device="cuda")
    mask = masks.frame_causal(7, 300) if kind == "frame_causal" else masks.temporal_window(7, 300, 1)
    masked = masked_processor_class()
    set_self_attention(model, lambda: masked(block_level(torch, mask)[None, None]))
    ref = ex.forward(model, inputs)
    set_self_attention(model, WanAttnProcessor)
    dense = ex.forward(model, inputs)
    pol = small_policy(policy, 1024)          # 2,100 tokens: below the default thresholds
    expected = {(BLOCK_SPARSE, ""): 2, ("fallback", "few keys (512 < 1024)"): 2}
    outs = []
    for proc_of, kw in ((WanAttnProcessor, {"block_mask": mask}), (lambda: masked(mask), {})):
        set_self_attention(model, proc_of)
        ovd.apply(model, policy=pol, **kw)
        ovd.reset_stats()
        try:
            outs.append(ex.forward(model, inputs))
        finally:
            ovd.remove(model)
        assert ovd.stats(model) == expected, kw
    assert torch.equal(outs[0], outs[1])
    err, moved = ex.rel_l2(outs[0], ref), ex.rel_l2(dense, ref)
    assert err < MAX_REL_L2 and err < 0.5 * moved, (err, moved)
