"""LTX-2 and SANA-WM (diffusers 0.42.1) under open_vc_attn.integrations.diffusers.apply, on the CPU, as in
test_integrations_diffusers_models.py: tiny BF16 configs, fresh random inputs, run unwrapped, with apply() and
the recording stand-in of openvc's fast path, and after remove(). Checked: which calls reach openvc (q and k
shapes) and which stay on the fallback with what reason, the output against the unwrapped model's, and that
apply() leaves the LTX-2 diffusion decoder's flex-only neighborhood attention on flex.
"""

import pytest

from diffusers_tiny import (STAND_IN_REL_L2, build, forward, gen, randn, rel_l2, run_three_ways,
                           small_policy)

# LTX-2's widths shrunk: video 2 heads of 128 (LTX-2: 32 x 128), audio 2 heads of 64 (32 x 64); the a2v and v2a
# cross-attention use the audio heads; text enters through caption_projection (caption_channels 32)
LTX2 = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=128, cross_attention_dim=256,
            audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=64,
            audio_cross_attention_dim=128, num_layers=2, caption_channels=32)


def text_mask(torch, n=12, valid=9):
    mask = torch.zeros(1, n)
    mask[:, :valid] = 1
    return mask


def ltx2_inputs(torch, audio_frames, **extra):
    """Latent 2 x 8 x 8 (128 video tokens), audio_frames audio tokens, 12 text tokens (9 valid) per modality."""
    g = gen(torch)
    return dict(hidden_states=randn(torch, g, 1, 128, 8), audio_hidden_states=randn(torch, g, 1, audio_frames, 8),
                encoder_hidden_states=randn(torch, g, 1, 12, 32),
                audio_encoder_hidden_states=randn(torch, g, 1, 12, 32), timestep=torch.tensor([500]),
                encoder_attention_mask=text_mask(torch), audio_encoder_attention_mask=text_mask(torch), num_frames=2,
                height=8, width=8, audio_num_frames=audio_frames, **extra)


@pytest.mark.parametrize("audio_frames", [80, 40])
def test_ltx2(torch, ovd, policy, stand_in, audio_frames):
    """Per block: video self-attention (D 128), audio self-attention (D 64), video-text and audio-text
    cross-attention (the text mask made additive and repeated per head: [B, H, 1, 12]), audio-to-video (q video,
    k audio) and video-to-audio (q audio, k video) cross-attention (D 64, RoPE of q and k apart, no mask). 40 audio
    tokens stand for LTX-2's real proportion (about 126 audio tokens for 5 s against the policy's 4,096)."""
    model = build(torch, "LTX2VideoTransformer3DModel", **LTX2)
    ref, out, stats = run_three_ways(torch, ovd, model, ltx2_inputs(torch, audio_frames), small_policy(policy, 64))
    video, audio, a = (1, 128, 2, 128), (1, audio_frames, 2, 64), audio_frames
    if a >= 64:     # every call but the text cross-attention on openvc
        assert stand_in == [(video, video, None, False, None), (audio, audio, None, False, None),
                            ((1, 128, 2, 64), audio, None, False, None),
                            (audio, (1, 128, 2, 64), None, False, None)] * 2
        assert stats == {("openvc", ""): 8, ("fallback", "attn_mask per head"): 4}
    else:
        assert stand_in == [(video, video, None, False, None)] * 2
        assert stats == {("openvc", ""): 2, ("fallback", "attn_mask per head"): 4,
                         ("fallback", f"short query ({a} < 64 tokens)"): 4, ("fallback", f"few keys ({a} < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_ltx23_gated_perturbed(torch, ovd, policy, stand_in):
    """LTX-2.3's options (gated attention, prompt modulation with sigma, LTX2PerturbedAttnProcessor) with
    spatio-temporal guidance on block 1, all of the batch perturbed: that block's self-attentions are skipped
    (the values stand for them), its other calls are as LTX-2's."""
    model = build(torch, "LTX2VideoTransformer3DModel", gated_attn=True, cross_attn_mod=True, audio_gated_attn=True,
                  audio_cross_attn_mod=True, perturbed_attn=True, **LTX2)
    assert type(model.transformer_blocks[0].attn1.processor).__name__ == "LTX2PerturbedAttnProcessor"
    inputs = ltx2_inputs(torch, 80, sigma=torch.tensor([0.5]), spatio_temporal_guidance_blocks=[1],
                         perturbation_mask=torch.zeros(1))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    video, audio = (1, 128, 2, 128), (1, 80, 2, 64)
    cross = [((1, 128, 2, 64), audio, None, False, None), (audio, (1, 128, 2, 64), None, False, None)]
    assert stand_in == [(video, video, None, False, None), (audio, audio, None, False, None)] + cross * 2
    assert stats == {("openvc", ""): 6, ("fallback", "attn_mask per head"): 4}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


DECODER = dict(out_channels=3, latent_channels=8, patch_size=2, decoder_head_dim=64,
               decoder_stage_channels=(128,) * 5, decoder_stage_depths=(1,) * 5,
               decoder_stage_kernels=((3, 3, 3),) * 4, decoder_upsample_strides=((1, 1, 1),) * 4,
               decoder_upsample_channel_reductions=(1,) * 4, decoder_stage5_kernel=(3, 3, 3), decoder_t_emb_dim=32,
               spatial_compression_ratio=2, temporal_compression_ratio=1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_ltx2_diffusion_decoder_is_left_on_flex(torch, ovd, policy, stand_in):
    """LTX2VideoDiffusionDecoderModel (models/autoencoders/ltx2_diffusion_decoder.py): 3D neighborhood attention,
    head dim 64, q pre-scaled, the window a FlexAttention BlockMask; its processor raises unless its backend is
    flex (whose element rule the window needs: openvc's block lists would attend each 128-token block whole), so
    apply() leaves it there and, with nothing else to route, raises naming it; the model is untouched."""
    model = build(torch, "LTX2VideoDiffusionDecoderModel", **DECODER)
    z = randn(torch, gen(torch), 1, 8, 3, 4, 4)

    def run():   # the decoder draws its noise from the generator: a fresh one per run
        return forward(torch, model, dict(z=z, generator=torch.Generator().manual_seed(0)))
    ref = run()
    with pytest.raises(ValueError, match=r"^model: LTX2VideoDiffusionDecoderModel's attention processors "
                                         r"\(LTX2VideoVaeNeighborhoodAttnProcessor\) call dispatch_attention_fn "
                                         r"with a backend they name themselves"):
        ovd.apply(model, policy=small_policy(policy, 64))
    assert stand_in == [] and torch.equal(run(), ref)


def test_sana_wm(torch, ovd, policy, stand_in):
    """SANA-WM's self-attention is not a dispatch call: gated delta-net linear attention (block 0) or, every
    softmax_every_n-th block (block 1), torch SDPA called by the block itself (no processor, no replacement);
    only the text cross-attention reaches the dispatcher, with SANA-WM's head dim 112 (hidden 2240 / 20 heads;
    here 224 / 2), which the fast path does not take. No call takes openvc's path. (Not run: the camera branch,
    direct SDPA too; with BF16 camera conditions, as the pipeline passes them, diffusers' create_grid raises on
    the CPU.)"""
    model = build(torch, "SanaWMTransformer3DModel", in_channels=16, num_layers=2, hidden_size=224,
                  num_attention_heads=2, linear_head_dim=112, softmax_every_n=2, caption_channels=16, mlp_ratio=2.0,
                  chunk_plucker_post_attn_blocks=2)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 16, 2, 8, 8), timestep=torch.full((1, 1, 2), 500.0),
                  encoder_hidden_states=randn(torch, g, 1, 1, 12, 16),
                  encoder_attention_mask=text_mask(torch).to(torch.int64))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [] and torch.equal(out, ref)
    assert stats == {("fallback", "head_dim 112/112/112 (takes (128, 64))"): 2}


@pytest.mark.parametrize("kv_cache_mode", [None, "inject"])
def test_sana_wm_refiner(torch, ovd, policy, stand_in, kv_cache_mode):
    """SANA-WM's stage-2 refiner (LTX-2's blocks, video only): self-attention of the active block (2 frames of
    8 x 8) over [sink + history + current] keys from its KV cache ("inject": 1 sink frame captured pre-RoPE, 1
    history frame post-RoPE, as diffusers' SanaWMLTX2Refiner fills it) or the current tokens only (None); the
    video-text cross-attention has LTX-2's per-head text mask."""
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache
    model = build(torch, "SanaWMLTX2RefinerTransformer3DModel", **LTX2)
    g = gen(torch)
    text = randn(torch, g, 1, 12, 32)

    def block(frames, mode, cache):
        n = 64 * len(frames)
        return dict(hidden_states=randn(torch, g, 1, n, 8), encoder_hidden_states=text,
                    timestep=torch.full((1, n), 500.0), encoder_attention_mask=text_mask(torch),
                    video_rotary_emb=model.build_rotary_emb_for_absolute_positions(1, frames, 8, 8, "cpu", 24.0),
                    kv_cache=cache, kv_cache_mode=mode)
    cache = None
    if kv_cache_mode is not None:
        cache = SanaWMRefinerKVCache(2)
        forward(torch, model, block([0], "capture_pre_rope", cache))
        for layer in cache.layer_caches:
            layer.store_sink(*layer.get_captured_pre_rope())
        cache.sink_pe = model.build_rotary_emb_for_absolute_positions(1, [0], 8, 8, "cpu", 24.0)
        forward(torch, model, block([1], "inject_and_capture_post_rope", cache))
        for layer in cache.layer_caches:
            layer.store_history(*layer.get_captured_post_rope())
    ref, out, stats = run_three_ways(torch, ovd, model, block([2, 3], kv_cache_mode, cache), small_policy(policy, 64))
    keys = 128 if kv_cache_mode is None else 64 + 64 + 128
    assert stand_in == [((1, 128, 2, 128), (1, keys, 2, 128), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "attn_mask per head"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2
