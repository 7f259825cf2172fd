"""HunyuanVideo Framepack, Cosmos 3 and JoyImage Edit / Edit Plus (diffusers 0.42.1) under
open_vc_attn.integrations.diffusers.apply on the CPU, as test_integrations_diffusers_models.py checks the other
video transformers: each model is built from a tiny config (random BF16 weights, fresh random inputs) and run
unwrapped, with apply() and conftest.py's recording stand-in for openvc's fast path, and after remove(); checked
are the calls that reach openvc (q and k shapes, key counts, causal, scale), those left on the fallback with
their reasons, and the output against the unwrapped model's.
"""

import pytest

from diffusers_tiny import STAND_IN_REL_L2, build, gen, randn, rel_l2, run_three_ways, small_policy


# ---- HunyuanVideo Framepack: HunyuanVideo's blocks and processor ------------------------------------------

def framepack(torch, batch):
    """2 heads of 128, one dual-stream and one single-stream block; the history the pipeline always passes
    (the forward needs all of it): 4x latents 4 x 16 x 16 -> 4 tokens, 2x 2 x 16 x 16 -> 16, clean 2 x 16 x 16
    -> 128, then the noisy latent 2 x 16 x 16 -> 128 (276 video tokens); 3 image tokens, 8 text tokens of which
    the first sample has 6."""
    model = build(torch, "HunyuanVideoFramepackTransformer3DModel", in_channels=4, out_channels=4,
                  num_attention_heads=2, attention_head_dim=128, num_layers=1, num_single_layers=1,
                  num_refiner_layers=1, mlp_ratio=1.0, patch_size=2, patch_size_t=1, text_embed_dim=32,
                  pooled_projection_dim=16, rope_axes_dim=(16, 56, 56), has_image_proj=True, image_proj_dim=16,
                  has_clean_x_embedder=True)
    g = gen(torch)
    text_mask = torch.ones(batch, 8, dtype=torch.bfloat16)
    text_mask[0, 6:] = 0
    # frame indices as the pipeline's vanilla sampling splits them: [prefix, 4x (4), 2x (2), 1x (1), latents (2)]
    inputs = dict(hidden_states=randn(torch, g, batch, 4, 2, 16, 16), timestep=torch.tensor([500] * batch),
                  encoder_hidden_states=randn(torch, g, batch, 8, 32), encoder_attention_mask=text_mask,
                  pooled_projections=randn(torch, g, batch, 16), image_embeds=randn(torch, g, batch, 3, 16),
                  indices_latents=torch.arange(8, 10), guidance=torch.tensor([3500.0] * batch),
                  latents_clean=randn(torch, g, batch, 4, 2, 16, 16), indices_latents_clean=torch.tensor([0, 7]),
                  latents_history_2x=randn(torch, g, batch, 4, 2, 16, 16),
                  indices_latents_history_2x=torch.arange(5, 7),
                  latents_history_4x=randn(torch, g, batch, 4, 4, 16, 16),
                  indices_latents_history_4x=torch.arange(1, 5))
    return model, inputs


def test_hunyuan_video_framepack_batch_1(torch, ovd, policy, stand_in):
    """Batch 1: the model cuts the text to its valid tokens and passes no mask; joint attention over
    [history; clean; video; image; text], N = 276 + 3 + 6, unmasked, on openvc (the token refiner, text only,
    calls torch SDPA itself: not routed, not counted)."""
    model, inputs = framepack(torch, 1)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 285, 2, 128), (1, 285, 2, 128), None, False, None)] * 2
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_hunyuan_video_framepack_batch_2(torch, ovd, policy, stand_in):
    """Batch 2: the whole padded text and a bool key padding mask [B, 1, 1, N] (the first 276 + 3 + valid
    text keys of each sample), N = 276 + 3 + 8: openvc, the mask as the call's key mask."""
    model, inputs = framepack(torch, 2)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((2, 287, 2, 128), (2, 287, 2, 128), [285, 287], False, None, "mask")] * 2
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


# ---- Cosmos 3: causal text pathway and full generation pathway, GQA ---------------------------------------

def cosmos3(torch, kv_heads, text, heads=2):
    """Cosmos3OmniTransformer, `heads` query heads of 64 and kv_heads key/value heads, 2 layers; the packed sequence as
    the pipeline builds it: `text` prompt tokens (the causal "understanding" prefix), then one video latent
    4 x 2 x 16 x 16 -> 128 tokens whose first frame is the image condition (the second frame is predicted).
    Returns the model in a module whose forward gives the first item's prediction (Cosmos 3's forward returns
    per-item lists), so that run_three_ways can compare it."""
    model = build(torch, "Cosmos3OmniTransformer", head_dim=64, hidden_size=64 * heads, intermediate_size=64,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=2, latent_channel=4,
                  latent_patch_size=2, patch_latent_dim=16, vocab_size=64, rope_axes_dim=(12, 10, 10))

    class FirstItem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, return_dict, **kwargs):
            return (self.inner(**kwargs, return_dict=return_dict)[0][0],)

    g = gen(torch)
    t, h, w = 2, 8, 8
    video = t * h * w
    frames = (torch.arange(t) + text + 15000).repeat_interleave(h * w)     # the pipeline's temporal offset
    positions = torch.stack([frames, torch.arange(h).repeat_interleave(w).repeat(t), torch.arange(w).repeat(t * h)])
    inputs = dict(input_ids=torch.randint(0, 64, (text,), generator=g), text_indexes=torch.arange(text),
                  position_ids=torch.cat([torch.arange(text).expand(3, text), positions], dim=1), und_len=text,
                  sequence_length=text + video, vision_tokens=[randn(torch, g, 1, 4, t, 16, 16)],
                  vision_token_shapes=[(t, h, w)], vision_sequence_indexes=torch.arange(text, text + video),
                  vision_mse_loss_indexes=torch.arange(text + h * w, text + video),
                  vision_timesteps=torch.full((h * w,), 500.0), vision_noisy_frame_indexes=[torch.tensor([1])])
    return FirstItem(), inputs


def test_cosmos3_short_prompt(torch, ovd, policy, stand_in):
    """Per layer: the prompt's causal self-attention (12 queries: short, on the fallback) and the video's
    attention to [prompt; video] keys, 128 queries and 140 keys, unmasked, not causal: openvc."""
    model, inputs = cosmos3(torch, kv_heads=2, text=12)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 128, 2, 64), (1, 140, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "short query (12 < 64 tokens)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_cosmos3_long_prompt_causal(torch, ovd, policy, stand_in):
    """A prompt of 64 tokens: its causal self-attention (Sq == Sk) reaches openvc as a causal call."""
    model, inputs = cosmos3(torch, kv_heads=2, text=64)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 64, 2, 64), (1, 64, 2, 64), None, True, None),
                        ((1, 128, 2, 64), (1, 192, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 4}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_cosmos3_gqa_reaches_openvc(torch, ovd, kv_heads, policy, stand_in):
    """Fewer key/value heads than query heads (the released config: 32 query heads, 8 key/value heads) and
    enable_gqa=True in both calls: openvc takes grouped-query attention (key/value heads dividing the query
    heads) as it is, k and v of kv_heads heads, so both calls of each layer reach it (MQA: 1 of 4 heads; GQA:
    2 of 4)."""
    model, inputs = cosmos3(torch, kv_heads=kv_heads, text=64, heads=4)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 64, 4, 64), (1, 64, kv_heads, 64), None, True, None),
                        ((1, 128, 4, 64), (1, 192, kv_heads, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 4}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_cosmos3_gqa_heads_that_do_not_divide_stay_on_the_fallback(torch, ovd, policy, stand_in):
    """The policy's rule for head counts that do not divide (diffusers' own model config requires that they do,
    so a grouped call of Cosmos 3 always reaches openvc): the fallback, with the reason."""
    q = torch.zeros(1, 128, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 192, 3, 64, dtype=torch.bfloat16)
    assert policy.choose_path(q, k, k, policy=small_policy(policy, 64)) == (
        policy.FALLBACK, "gqa: 3 key/value heads do not divide 4 query heads")


# ---- JoyImage Edit: joint [image / video; text] attention ------------------------------------------------

JOYIMAGE = dict(patch_size=[1, 2, 2], in_channels=4, hidden_size=128, num_attention_heads=2, text_dim=16,
                mlp_width_ratio=1.0, num_layers=2, rope_dim_list=[16, 24, 24])


@pytest.mark.parametrize("items,frames", [(1, 2), (2, 1)])
def test_joyimage_edit(torch, ovd, policy, stand_in, items, frames):
    """JoyImageEditTransformer3DModel with the pipeline's [B, items, C, T, H, W] latents: a 2-frame video
    (1 item) or an edit (reference image + target, 1 frame each), 128 latent tokens either way; per block one
    joint attention over [latent; 12 text tokens], unmasked: openvc."""
    model = build(torch, "JoyImageEditTransformer3DModel", **JOYIMAGE)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, items, 4, frames, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 12, 16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 140, 2, 64), (1, 140, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_joyimage_edit_plus_padding_mask(torch, ovd, policy, stand_in):
    """JoyImageEditPlusTransformer3DModel (multi-image edit, padded patches [B, N, C, 1, 2, 2]): batch 2 with
    different reference sizes and text lengths; the joint attention's bool mask [B, 1, 1, 128 + 12] marks the
    valid patches and the valid text (sample 2 has padding between them): a key padding mask, on openvc."""
    model = build(torch, "JoyImageEditPlusTransformer3DModel", **JOYIMAGE)
    g = gen(torch)
    text_mask = torch.ones(2, 12)
    text_mask[0, 9:] = 0
    inputs = dict(hidden_states=randn(torch, g, 2, 128, 4, 1, 2, 2), timestep=torch.tensor([500, 500]),
                  encoder_hidden_states=randn(torch, g, 2, 12, 16), encoder_hidden_states_mask=text_mask,
                  shape_list=[[(1, 8, 8), (1, 8, 8)], [(1, 8, 8), (1, 4, 4)]])
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((2, 140, 2, 64), (2, 140, 2, 64), [128 + 9, 64 + 16 + 12], False, None, "mask")] * 2
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2
