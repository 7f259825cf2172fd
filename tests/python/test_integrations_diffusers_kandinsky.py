"""Kandinsky 5, Kandinsky 6 and Kandinsky 6 SR (diffusers 0.42.1) under open_vc_attn.integrations.diffusers.apply on
the CPU, as test_integrations_diffusers_models.py checks the other video models: tiny BF16 configs (FP32 where
from_pretrained keeps it), fresh random inputs, run unwrapped, with apply() and the recording stand-in, and after
remove(); checked: the calls that reach openvc, the fallback reasons, the output. NABLA's 64-token block masks run
on torch's flex_attention (eager on the CPU); Kandinsky 6 SR names flex itself, so apply() has nothing to route.
"""
from diffusers_tiny import STAND_IN_REL_L2, build, forward, gen, randn, rel_l2, run_three_ways, small_policy

BLOCK_64 = "block_mask BLOCK_SIZE (64, 64) (takes (128, 128): openvc's query tile and key block)"


def keep_fp32(torch, model):
    """The model's _keep_in_fp32_modules back in FP32, as from_pretrained(torch_dtype=torch.bfloat16) leaves
    them (Kandinsky 5's time embedding feeds FP32 into its Linear layers)."""
    keep = set(model._keep_in_fp32_modules)
    for name, p in model.named_parameters():
        if keep & set(name.split(".")):
            p.data = p.data.float()
    return model


# ---- Kandinsky 5 ------------------------------------------------------------------------------------------

def kandinsky5(torch, **attention):
    """2 heads of 64 (axes 16 + 24 + 24), 1 text block, 2 visual blocks; latent 2 x 16 x 16 (patch 2: 128
    video tokens), 8 text tokens."""
    model = keep_fp32(torch, build(torch, "Kandinsky5Transformer3DModel", in_visual_dim=4, in_text_dim=16,
                                   in_text_dim2=8, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
                                   model_dim=128, ff_dim=64, num_text_blocks=1, num_visual_blocks=2,
                                   axes_dims=(16, 24, 24), **attention))
    for name, p in model.named_parameters():    # diffusers zero-initializes the modulations: gates 0, no attention
        if "modulation" in name:
            p.data.normal_(0.0, 0.2)
    g = gen(torch)
    # return_dict=False returns the sample itself (no tuple): batch 1, so forward()'s [0] is the whole sample
    inputs = dict(hidden_states=randn(torch, g, 1, 2, 16, 16, 4), encoder_hidden_states=randn(torch, g, 1, 8, 16),
                  timestep=torch.tensor([500.0], dtype=torch.bfloat16), pooled_projections=randn(torch, g, 1, 8),
                  visual_rope_pos=[torch.arange(2), torch.arange(8), torch.arange(8)], text_rope_pos=torch.arange(8))
    return model, inputs


def test_kandinsky5(torch, ovd, policy, stand_in):
    """Text self-attention (8 tokens); per block visual self-attention (128, no mask), cross-attention to text."""
    model, inputs = kandinsky5(torch)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 128, 2, 64), (1, 128, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "short query (8 < 64 tokens)"): 1,
                     ("fallback", "few keys (8 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_kandinsky5_nabla(torch, ovd, policy, stand_in):
    """NABLA (the pipeline's sparse_params): visual self-attention with a BlockMask of 64-token blocks: on flex."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as reg
    model, inputs = kandinsky5(torch, attention_type="nabla", attention_P=0.9, attention_wT=1, attention_wH=1,
                               attention_wW=1, attention_add_sta=True, attention_method="topcdf")
    # the pipeline's fast_sta_nabla(2, 1, 1, 1, 1, 1): a grid of 2 x 1 x 1 blocks of 8 x 8 tokens, each itself
    inputs["sparse_params"] = dict(sta_mask=torch.eye(2, dtype=torch.bool)[None, None], attention_type="nabla",
                                   to_fractal=True, P=0.9, wT=1, wW=1, wH=1, add_sta=True, visual_shape=(2, 8, 8),
                                   method="topcdf")
    active = reg._active_backend
    try:
        model.set_attention_backend("flex")     # native SDPA takes no BlockMask (sets the active backend too)
    finally:
        reg._active_backend = active
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [] and torch.equal(out, ref)
    assert stats == {("fallback", BLOCK_64): 2,
                     ("fallback", "short query (8 < 64 tokens)"): 1, ("fallback", "few keys (8 < 64)"): 2}


# ---- Kandinsky 6 ------------------------------------------------------------------------------------------

def kandinsky6(torch, audio, valid):
    """2 heads of 64 in both branches, 1 text block per branch, 2 fused blocks; latent 2 x 16 x 16 (patch 2: 128
    video tokens; 9 channels: visual_cond), audio latent [B, audio, 4] (None: video only); the text mask
    [B, len(valid[0])], True = a prompt token (the pipeline's bool prompt_attention_mask)."""
    model = keep_fp32(torch, build(torch, "Kandinsky6Transformer3DModel", in_visual_dim=4, out_visual_dim=4,
                                   in_text_dim=16, in_text_dim2=8, time_dim=16, patch_size=(1, 2, 2), model_dim=128,
                                   ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(16, 24, 24),
                                   visual_cond=True, in_audio_dim=4, out_audio_dim=4, text_token_padding=True,
                                   ca_rope=True, cross_gates=True, fix_modulation=True))
    g = gen(torch)
    b, t = len(valid), len(valid[0])
    inputs = dict(hidden_states=randn(torch, g, b, 2, 16, 16, 9), encoder_hidden_states=randn(torch, g, b, t, 16),
                  pooled_projections=randn(torch, g, b, 8), timestep=torch.tensor([500.0] * b),
                  audio_hidden_states=randn(torch, g, b, audio, 4) if audio else None,
                  encoder_attention_mask=torch.tensor(valid, dtype=torch.bool))
    return model, inputs


def test_kandinsky6_video_and_audio(torch, ovd, policy, stand_in):
    """Text self (2 branches); per block video / audio self, each to its text, video-to-audio, audio-to-video."""
    model, inputs = kandinsky6(torch, audio=96, valid=[[True] * 6 + [False] * 2])
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    video, audio = (1, 128, 2, 64), (1, 96, 2, 64)
    assert stand_in == [(video, video, None, False, None), (audio, audio, None, False, None),
                        (video, audio, None, False, None), (audio, video, None, False, None)] * 2
    assert stats == {("openvc", ""): 8, ("fallback", "short query (8 < 64 tokens)"): 2,
                     ("fallback", "few keys (8 < 64)"): 4}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_kandinsky6_text_key_mask(torch, ovd, policy, stand_in):
    """Video only, 64 text tokens (40 / 64 valid): the bool text mask [B, T] reaches openvc as a key mask."""
    model, inputs = kandinsky6(torch, audio=None, valid=[[True] * 40 + [False] * 24, [True] * 64])
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    text, video = (2, 64, 2, 64), (2, 128, 2, 64)
    assert stand_in == [(text, text, [40, 64], False, None, "mask")] * 2 + [
        (video, video, None, False, None), (video, text, [40, 64], False, None, "mask")] * 2
    assert stats == {("openvc", ""): 6}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


# ---- Kandinsky 6 SR ---------------------------------------------------------------------------------------

def test_kandinsky6_sr_names_flex_itself(torch, ovd, policy, stand_in, monkeypatch):
    """NABLA self-attention with backend=FLEX named in every call (64-token blocks), which no active backend
    overrides: apply() leaves the processors alone, and with nothing else to route raises, naming them; were the
    calls routed, the policy would still send them to the fallback (64-token blocks)."""
    import pytest
    from diffusers.models.transformers import transformer_kandinsky6_sr as sr
    model = keep_fp32(torch, build(torch, "Kandinsky6SRTransformer3DModel", in_visual_dim=4, out_visual_dim=4,
                                   time_dim=16, patch_size=(1, 1, 1), model_dim=128, ff_dim=64, num_visual_blocks=2,
                                   axes_dims=(16, 24, 24), nabla_window=(3, 3, 3)))
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 2, 16, 16, 9), timestep=torch.tensor([500.0]))
    calls, dispatch = [], sr.dispatch_attention_fn

    def record(query, key, value, attn_mask=None, backend=None, **kwargs):
        calls.append((query, key, value, attn_mask, backend))
        return dispatch(query, key, value, attn_mask=attn_mask, backend=backend, **kwargs)

    monkeypatch.setattr(sr, "dispatch_attention_fn", record)
    ref = forward(torch, model, inputs)
    with pytest.raises(ValueError, match=r"^model: Kandinsky6SRTransformer3DModel's attention processors "
                                         r"\(Kandinsky6SRAttnProcessor\) call dispatch_attention_fn with a backend "
                                         r"they name themselves \(flex\)"):
        ovd.apply(model, policy=small_policy(policy, 64))
    assert torch.equal(forward(torch, model, inputs), ref) and stand_in == []
    assert [(tuple(q.shape), tuple(k.shape), tuple(m.BLOCK_SIZE), b.value) for q, k, _, m, b in calls] == \
        [((1, 512, 2, 64), (1, 512, 2, 64), (64, 64), "flex")] * 4      # 2 blocks, 2 forwards
    q, k, v, mask, _ = calls[-1]
    assert policy.choose_path(q, k, v, attn_mask=mask, policy=small_policy(policy, 64)) == ("fallback", BLOCK_64)
