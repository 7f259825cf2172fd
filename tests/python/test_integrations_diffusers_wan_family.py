"""The Wan-derived video transformers of diffusers 0.42.1 (Wan VACE, ChronoEdit, Wan-Animate, Wan-Animate-2) under
open_vc_attn.integrations.diffusers.apply on the CPU, as test_integrations_diffusers_models.py does for the others:
each is built from a tiny config (2 layers, 2 heads of 64, BF16, fresh random inputs) and run unwrapped, with
apply() and conftest.py's recording stand-in for openvc's kernel, and after remove(); checked are the calls that
reach openvc (q and k shapes, mask, causal, scale), the fallbacks with their reasons (stats), the output against
the unwrapped model's, and that remove() restores the processors. With the tests' 64-token thresholds the 512
text keys of the image-conditioned models reach openvc; the default policy (4,096) keeps them on SDPA.
"""

import pytest

from diffusers_tiny import (STAND_IN_REL_L2, applied_forward, build, forward, gen, randn, rel_l2, run_three_ways,
                           small_policy)

WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, text_dim=16, freq_dim=32, ffn_dim=32,
           num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def call(sq, sk, b=1):
    """A stand-in record: q [b, sq, 2, 64], k [b, sk, 2, 64], no mask, not causal, SDPA's default scale."""
    return ((b, sq, 2, 64), (b, sk, 2, 64), None, False, None)


def test_wan_vace(torch, ovd, policy, stand_in):
    """The VACE blocks (control branch, run first) and the Wan blocks: self-attention over the 2 * 8 * 8 video
    tokens (the control tokens in the VACE blocks) on openvc, text cross-attention (12 keys) on the fallback."""
    model = build(torch, "WanVACETransformer3DModel", in_channels=4, out_channels=4, vace_layers=[0, 1],
                  vace_in_channels=8, **WAN)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 12, 16),
                  control_hidden_states=randn(torch, g, 1, 8, 2, 16, 16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [call(128, 128)] * 4     # 2 VACE blocks, then 2 Wan blocks
    assert stats == {("openvc", ""): 4, ("fallback", "few keys (12 < 64)"): 4}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


@pytest.mark.parametrize("frames", [2, 3])
def test_chronoedit(torch, ovd, policy, stand_in, frames):
    """Wan I2V-style (what ChronoEditPipeline passes: CLIP image tokens before 512 text tokens, added K/V
    projections); 2 latent frames (image editing: its RoPE puts the second frame at temporal_skip_len - 1) or 3.
    Per block: self-attention on openvc, image cross-attention (4 keys) on the fallback, text cross-attention
    (512 keys, split from the image tokens by the processor) on openvc at the tests' thresholds."""
    model = build(torch, "ChronoEditTransformer3DModel", in_channels=12, out_channels=4, image_dim=16,
                  added_kv_proj_dim=128, **WAN)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 12, frames, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 512, 16),
                  encoder_hidden_states_image=randn(torch, g, 1, 4, 16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    s = frames * 64
    assert stand_in == [call(s, s), call(s, 512)] * 2
    assert stats == {("openvc", ""): 4, ("fallback", "few keys (4 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_wan_animate(torch, ovd, policy, stand_in):
    """Wan-Animate: Wan I2V blocks (as ChronoEdit: self, image 4 keys, text 512 keys) and after each (here:
    inject_face_latents_blocks=1) a face adapter: the video tokens of each of the 3 latent frames attend the
    face_encoder_num_heads + 1 = 5 motion tokens of that frame ([B * 3, 64, H, D] against [B * 3, 5, H, D]),
    few keys: on the fallback."""
    model = build(torch, "WanAnimateTransformer3DModel", in_channels=12, latent_channels=4, out_channels=4,
                  image_dim=16, added_kv_proj_dim=128, motion_encoder_channel_sizes={"8": 8, "4": 8},
                  motion_encoder_size=8, motion_style_dim=16, motion_dim=4, motion_encoder_dim=16,
                  face_encoder_hidden_dim=16, face_encoder_num_heads=4, inject_face_latents_blocks=1, **WAN)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 12, 3, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 512, 16),
                  encoder_hidden_states_image=randn(torch, g, 1, 4, 16),
                  pose_hidden_states=randn(torch, g, 1, 4, 2, 16, 16),
                  face_pixel_values=randn(torch, g, 1, 3, 5, 8, 8))    # 5 face frames -> 2 motion frames + 1 pad
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [call(192, 192), call(192, 512)] * 2
    assert stats == {("openvc", ""): 4, ("fallback", "few keys (4 < 64)"): 2, ("fallback", "few keys (5 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


# ---- Wan-Animate-2: a reference pass (kv_cache_mode="extract") and generation passes ("cached") ------------

def animate2(torch, monkeypatch):
    """WanAnimate2Transformer3DModel (dim 128 = 2 heads of 64, 12 text tokens, 4 CLIP tokens of 1280), its KV
    cache, and the inputs of the reference pass (2 latent frames of 8 x 8 tokens: 128) and of a generation pass
    (3 frames: 192 tokens; a 5-frame, 128 x 128 segment: the block mask's 2 frames of 64 tokens). Its block
    mask is built eagerly: create_mask's _compile=True runs inductor on the CPU (minutes), for the same mask."""
    from diffusers.models.transformers import transformer_wan_animate_2 as wa2
    create = wa2.create_block_mask
    monkeypatch.setattr(wa2, "create_block_mask", lambda *a, _compile=True, **kw: create(*a, **kw))
    model = build(torch, "WanAnimate2Transformer3DModel", patch_size=(1, 2, 2), text_len=12, in_dim=8, dim=128,
                  ffn_dim=32, freq_dim=32, text_dim=16, out_dim=4, num_heads=2, num_layers=2)
    g = gen(torch)
    grid = torch.tensor([[2, 8, 8]])
    shared = dict(encoder_hidden_states=[randn(torch, g, 12, 16)], timestep=torch.tensor([500]),
                  encoder_hidden_states_image=randn(torch, g, 1, 4, 1280), kv_cache=wa2.WanAnimate2KVCache(2))
    extract = dict(hidden_states=[randn(torch, g, 4, 2, 16, 16)], condition_latents=[randn(torch, g, 4, 2, 16, 16)],
                   kv_cache_mode="extract", seq_len=128, offset_grid_sizes=grid, **shared)
    cached = dict(hidden_states=[randn(torch, g, 4, 3, 16, 16)], condition_latents=[randn(torch, g, 4, 3, 16, 16)],
                  kv_cache_mode="cached", seq_len=192, reference_grid_sizes=grid, origin_len=5,
                  origin_area=[128, 128], **shared)
    return model, extract, cached


def three_ways_first(torch, ovd, model, inputs, pol):
    """run_three_ways for a model whose forward returns a list of samples: (reference, openvc output, stats) of
    the first sample."""
    ref = forward(torch, model, inputs)[0]
    originals = [m.processor for m in model.modules() if hasattr(m, "processor")]
    out = applied_forward(torch, ovd, model, inputs, pol)[0]
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == originals
    assert torch.equal(forward(torch, model, inputs)[0], ref)
    return ref, out, ovd.stats(model)


def test_wan_animate_2_reference_pass(torch, ovd, policy, stand_in, monkeypatch):
    """The reference pass (once per segment): dense self-attention over the reference tokens on openvc; text
    (12 keys) and CLIP image (4 keys) cross-attention on the fallback."""
    model, extract, _ = animate2(torch, monkeypatch)
    ref, out, stats = three_ways_first(torch, ovd, model, extract, small_policy(policy, 64))
    assert stand_in == [call(128, 128)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "few keys (12 < 64)"): 2, ("fallback", "few keys (4 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_wan_animate_2_generation_pass_names_flex(torch, ovd, policy, stand_in, monkeypatch):
    """A generation pass (every denoising step): the self-attention over [generation | cached reference] (q 192
    tokens packed into 256, k 256 + 128) with the model's BlockMask names diffusers' flex backend itself, so
    apply()'s routing never sees it (not in stats); openvc's policy would take it (block-sparse: the mask is
    BLOCK_SIZE 128, built for (256, 384)). Only the cross-attention calls are routed, to the fallback."""
    from diffusers.models import attention_dispatch as ad
    model, extract, cached = animate2(torch, monkeypatch)
    forward(torch, model, extract)       # fills the KV cache
    backends, flex = ad._AttentionBackendRegistry._backends, ad.AttentionBackendName.FLEX
    flex_fn, flex_calls = backends[flex], []
    monkeypatch.setitem(backends, flex, lambda **kw: flex_calls.append(kw) or flex_fn(**kw))
    pol = small_policy(policy, 64)
    ref, out, stats = three_ways_first(torch, ovd, model, cached, pol)
    assert stand_in == [] and torch.equal(out, ref)
    assert stats == {("fallback", "few keys (12 < 64)"): 2, ("fallback", "few keys (4 < 64)"): 2}
    # 2 layers in each of the 3 forwards (unwrapped, under apply, after remove)
    assert [(tuple(kw["query"].shape), tuple(kw["key"].shape)) for kw in flex_calls] == \
        [((1, 256, 2, 64), (1, 384, 2, 64))] * 6
    kw = flex_calls[2]                   # the first call under apply
    assert policy.choose_path(kw["query"], kw["key"], kw["value"], attn_mask=kw["attn_mask"], policy=pol) == \
        ("openvc", "")
