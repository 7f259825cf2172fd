"""The video transformers of diffusers 0.42.1 under open_vc_attn.integrations.diffusers.apply, on the CPU.

Each model is built from a tiny config (random BF16 weights, fresh random inputs) and run three ways: unwrapped
(diffusers' own attention, the reference), with apply() and openvc's fast path replaced by a recording CPU
stand-in (torch SDPA in FP32 with the mask it is given), and after remove(). Checked: the calls that reach
openvc (q and k shapes, head dim, key counts of the key padding mask, causal, scale) and those that stay on
the fallback with their reasons; the output against the unwrapped model's (the stand-in differs from BF16
SDPA by rounding only, so rel L2 < STAND_IN_REL_L2); remove() restores the original processors (bit for bit
the reference). Without the stand-in (the CPU fails the policy's device check) every call of the replaced
processors runs the original's own SDPA call: bit for bit the reference.

- CogVideoX 1.0 / 1.5 (also fused QKV), ConsisID, Mochi, EasyAnimate: their processors call torch SDPA
  themselves; apply() replaces them (open_vc_attn/integrations/_diffusers_processors.py).
- SkyReels-V2, Wan 2.2 TI2V-5B-style Wan, HunyuanVideo 1.5, Cosmos, SANA-Video: through diffusers' dispatcher (the
  existing backend).
- Allegro (head dim 96) and Latte (head dim 72, generic processors): apply() raises, naming the processors.
Wan, HunyuanVideo, LTX-Video: test_integrations_diffusers.py; Motif-Video: test_diffusers_e2e_script.py; the other
classes: the test_integrations_diffusers_*.py files beside this one (Wan family, LTX-2 and SANA-WM, Kandinsky,
AnyFlow and Helios, Framepack / Cosmos 3 / JoyImage, UNet-era). On the GPU (one test): the replaced processors'
rotary embedding through openvc's kernel gives the unwrapped model's output bit for bit.
"""

import pytest

from diffusers_tiny import (STAND_IN_REL_L2, applied_forward, build, forward, gen, randn, rel_l2,
                           run_three_ways, small_policy)


# ---- models whose processors call torch SDPA themselves: replaced by openvc's -----------------------------

def cogvideox(torch, version="1.0", batch=1):
    """CogVideoX 1.0 (sincos positions, no RoPE) or 1.5 (RoPE given by the pipeline, patch_size_t 2): 2 heads
    of 64, text 8 tokens; latent 4 x 16 x 16 (1.5: frames in pairs) -> 3 * 8 * 8 = 192 / 2 * 8 * 8 = 128."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    v15 = version == "1.5"
    model = build(torch, "CogVideoXTransformer3DModel", num_attention_heads=2, attention_head_dim=64, in_channels=4,
                  out_channels=4, num_layers=2, text_embed_dim=32, time_embed_dim=8, sample_width=16, sample_height=16,
                  sample_frames=9, patch_size=2, patch_size_t=2 if v15 else None, max_text_seq_length=8,
                  use_rotary_positional_embeddings=v15)
    frames = 4 if v15 else 3
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, batch, frames, 4, 16, 16),
                  encoder_hidden_states=randn(torch, g, batch, 8, 32), timestep=torch.tensor([500] * batch))
    if v15:   # what CogVideoXPipeline passes: cos and sin [video tokens, head dim]
        cos, sin = get_3d_rotary_pos_embed(64, ((0, 0), (8, 8)), (8, 8), frames // 2, use_real=True)
        inputs["image_rotary_emb"] = (cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    return model, inputs, (frames // (2 if v15 else 1)) * 64


@pytest.mark.parametrize("version,fused", [("1.0", False), ("1.5", False), ("1.5", True)])
def test_cogvideox(torch, ovd, policy, stand_in, version, fused):
    model, inputs, video = cogvideox(torch, version, batch=2)
    if fused:
        model.fuse_qkv_projections()
        assert type(model.transformer_blocks[0].attn1.processor).__name__ == "FusedCogVideoXAttnProcessor2_0"
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    n = 8 + video     # joint attention over [text; video], head dim 64, unmasked, SDPA's default scale
    assert stand_in == [((2, n, 2, 64), (2, n, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_consisid(torch, ovd, policy, stand_in):
    model = build(torch, "ConsisIDTransformer3DModel", num_attention_heads=2, attention_head_dim=64, in_channels=4,
                  out_channels=4, time_embed_dim=2, text_embed_dim=8, num_layers=2, sample_width=16, sample_height=16,
                  sample_frames=8, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8,
                  cross_attn_interval=1, is_kps=False, is_train_face=True, cross_attn_dim_head=1,
                  cross_attn_num_heads=1, LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=5, LFE_dim_head=8, LFE_num_heads=2,
                  LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=85, LFE_ff_mult=1, LFE_num_scale=1)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 2, 4, 16, 16), encoder_hidden_states=randn(torch, g, 1, 8, 8),
                  timestep=torch.tensor([500]), id_vit_hidden=[torch.ones(1, 2, 2, dtype=torch.bfloat16)],
                  id_cond=torch.ones(1, 2, dtype=torch.bfloat16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 136, 2, 64), (1, 136, 2, 64), None, False, None)] * 2    # 8 text + 2 * 8 * 8
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def mochi(torch, valid):
    """Mochi, 2 heads of 128, latent 2 x 16 x 16 (patch 2: 128 video tokens), 8 text tokens; valid: per sample,
    the text mask (1 = a prompt token)."""
    model = build(torch, "MochiTransformer3DModel", patch_size=2, num_attention_heads=2, attention_head_dim=128,
                  num_layers=2, pooled_projection_dim=32, in_channels=4, text_embed_dim=16, time_embed_dim=4)
    g = gen(torch)
    b = len(valid)
    inputs = dict(hidden_states=randn(torch, g, b, 4, 2, 16, 16), encoder_hidden_states=randn(torch, g, b, 8, 16),
                  timestep=torch.tensor([500] * b), encoder_attention_mask=torch.tensor(valid, dtype=torch.bool))
    return model, inputs


def test_mochi_key_counts_not_a_loop(torch, ovd, policy, stand_in):
    """One openvc call for the whole batch, the padded text keys masked (key counts = video + valid text
    tokens per sample), and the text outputs where diffusers' per-sample loop puts them: valid tokens first,
    then zeros (the second sample's mask has holes)."""
    valid = [[1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0, 1, 0]]
    model, inputs = mochi(torch, valid)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((2, 136, 2, 128), (2, 136, 2, 128), [128 + 5, 128 + 4], False, None, "counts")] * 2
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2
    # the text rows of one block's attention, against diffusers' processor on the same inputs
    attn = model.transformer_blocks[0].attn1
    g = gen(torch)
    hs, ehs = randn(torch, g, 2, 128, 256), randn(torch, g, 2, 8, 32)
    mask = torch.tensor(valid, dtype=torch.bool)
    with torch.inference_mode():
        want = attn.processor(attn, hs, ehs, mask)
        ovd.apply(model, policy=small_policy(policy, 64))
        try:
            got = attn.processor(attn, hs, ehs, mask)
        finally:
            ovd.remove(model)
    for w, o in zip(want, got):
        assert rel_l2(o, w) < STAND_IN_REL_L2
    assert torch.equal(got[1][1, 4:], want[1][1, 4:])      # the rows after the valid ones: diffusers' exactly


def test_mochi_with_autograd_goes_to_the_original(torch, ovd, policy, stand_in):
    """A forward with autograd on (weights that require grad, no no_grad): the processor builds its joint
    buffers without out= (which autograd refuses) and the policy sends the call to the original processor:
    the output is the unwrapped model's bit for bit, and it backpropagates."""
    model, inputs = mochi(torch, [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8])
    ref = model(**inputs, return_dict=False)[0]
    ovd.apply(model, policy=small_policy(policy, 64))
    ovd.reset_stats()
    try:
        out = model(**inputs, return_dict=False)[0]
        out.float().sum().backward()
    finally:
        ovd.remove(model)
    assert torch.equal(out, ref) and stand_in == []
    assert ovd.stats(model) == {("fallback", "requires_grad (openvc is inference-only)"): 2}
    assert model.transformer_blocks[0].attn1.to_q.weight.grad is not None


def test_mochi_mask_on_another_device_goes_to_the_original(torch, ovd, policy, stand_in, monkeypatch):
    """A text mask on another device than the activations (diffusers' pipeline moves it; a direct caller may
    not): the original processor runs the call, counted with the reason, rather than a host copy in the call."""
    model, _ = mochi(torch, [[1] * 8])
    attn = model.transformer_blocks[0].attn1
    g = gen(torch)
    hs, ehs = randn(torch, g, 1, 128, 256), randn(torch, g, 1, 8, 32)
    mask = torch.ones(1, 8, dtype=torch.bool, device="meta")
    ovd.apply(model, policy=small_policy(policy, 64))
    ovd.reset_stats()
    calls = []
    monkeypatch.setattr(attn.processor, "_openvc_inner", lambda *a: calls.append(a[3].device) or "original")
    try:
        with torch.inference_mode():
            assert attn.processor(attn, hs, ehs, mask) == "original"
    finally:
        ovd.remove(model)
    assert calls == [mask.device] and stand_in == []
    assert ovd.stats(model) == {("fallback", "Mochi attention_mask on meta, hidden states on cpu"): 1}


def test_mochi_mask_shape_goes_to_the_original(torch, ovd, policy, stand_in):
    """A text mask that is not one entry per text token: the original processor runs the call (diffusers
    reads a [1, 4] mask as "the first 4 tokens"), counted with the reason."""
    model, _ = mochi(torch, [[1] * 8])
    attn = model.transformer_blocks[0].attn1
    g = gen(torch)
    hs, ehs = randn(torch, g, 1, 128, 256), randn(torch, g, 1, 8, 32)
    mask = torch.ones(1, 4, dtype=torch.bool)
    with torch.inference_mode():
        want = attn.processor(attn, hs, ehs, mask)
        ovd.apply(model, policy=small_policy(policy, 64))
        ovd.reset_stats()
        try:
            got = attn.processor(attn, hs, ehs, mask)
        finally:
            ovd.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and stand_in == []
    assert ovd.stats(model) == {("fallback", "Mochi attention_mask (1, 4) (takes a text mask [B, T] = [1, 8])"): 1}


def easyanimate(torch):
    model = build(torch, "EasyAnimateTransformer3DModel", attention_head_dim=64, num_attention_heads=2, in_channels=4,
                  mmdit_layers=2, num_layers=2, out_channels=4, patch_size=2, sample_height=60, sample_width=90,
                  text_embed_dim=16, time_embed_dim=8, time_position_encoding_type="3d_rope",
                  timestep_activation_fn="silu")
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 4, 2, 16, 16), timestep=torch.tensor([500]), timestep_cond=None,
                  encoder_hidden_states=randn(torch, g, 1, 16, 16), encoder_hidden_states_t5=None,
                  inpaint_latents=None, control_latents=None)
    return model, inputs


def test_easyanimate(torch, ovd, policy, stand_in):
    model, inputs = easyanimate(torch)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 144, 2, 64), (1, 144, 2, 64), None, False, None)] * 2     # 16 text + 2 * 8 * 8
    assert stats == {("openvc", ""): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


@pytest.mark.parametrize("name", ["cogvideox", "mochi", "easyanimate"])
def test_fallback_is_the_original_bit_for_bit(torch, ovd, policy, name):
    """On the CPU (no stand-in) the policy sends every call to the fallback: the replaced processors run the
    original's SDPA call on the same tensors, so the output is the unwrapped model's exactly; reasons counted,
    one FallbackWarning."""
    model, inputs = (cogvideox(torch, "1.5")[:2] if name == "cogvideox" else
                     mochi(torch, [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]) if name == "mochi" else easyanimate(torch))
    ref = forward(torch, model, inputs)
    assert ovd.apply(model, policy=small_policy(policy, 64)) == 2     # one per block
    ovd.reset_stats()
    try:
        with pytest.warns(ovd.FallbackWarning, match="device cpu is not CUDA"):
            out = forward(torch, model, inputs)
    finally:
        ovd.remove(model)
    assert torch.equal(out, ref)
    assert ovd.stats(model) == {("fallback", "device cpu is not CUDA"): 2}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cogvideox", "mochi", "easyanimate"])
def test_gpu_fallback_with_the_rotary_kernel_is_the_original_bit_for_bit(torch, ovd, policy, name, monkeypatch):
    """On the GPU the replaced processors rotate q and k with openvc's one-pass kernel (open_vc_attn.rotary) in
    place of diffusers' elementwise form; with a policy that sends every call to the fallback, the output is the
    unwrapped model's exactly, so the kernel's bits are diffusers' (CogVideoX 1.5's and EasyAnimate's
    apply_rotary_emb, Mochi's own rotation)."""
    model, inputs = (cogvideox(torch, "1.5")[:2] if name == "cogvideox" else
                     mochi(torch, [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]) if name == "mochi" else easyanimate(torch))
    cuda = lambda x: (x.cuda() if isinstance(x, torch.Tensor) else
                      type(x)(cuda(t) for t in x) if isinstance(x, (tuple, list)) else x)
    model, inputs = model.cuda(), {k: cuda(v) for k, v in inputs.items()}
    ref = forward(torch, model, inputs)
    import open_vc_attn.rotary as rotary
    kernel, calls = rotary.rotary_pairs, []
    monkeypatch.setattr(rotary, "rotary_pairs", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    out = applied_forward(torch, ovd, model, inputs, small_policy(policy, 10 ** 9))
    assert len(calls) == 4      # q and k of each of the 2 blocks went through the kernel
    assert torch.equal(out, ref)
    assert all(path == "fallback" for path, _ in ovd.stats(model))


def test_policy_reasons_and_formats(torch, ovd, policy, stand_in):
    """The shared policy decides for the replaced processors too: its formats reach openvc and name the
    calls; a call below the thresholds stays on the original's SDPA with its reason."""
    model, inputs, _ = cogvideox(torch, "1.0")
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 4096))
    assert stand_in == [] and torch.equal(out, ref)
    assert stats == {("fallback", "short query (200 < 4096 tokens)"): 2}
    pol = policy.DispatchPolicy(min_query_tokens=64, min_key_tokens=64, qk_format="int8", k_smoothing=True)
    _, _, stats = run_three_ways(torch, ovd, model, inputs, pol)
    assert stats == {("openvc", "qk_format=int8, k_smoothing"): 2}
    fp32 = model.float()
    ref, out, stats = run_three_ways(torch, ovd, fp32, {k: (v.float() if v.is_floating_point() else v)
                                                        for k, v in inputs.items()}, small_policy(policy, 64))
    assert torch.equal(out, ref) and stats == {("fallback", "dtype torch.float32/torch.float32/torch.float32 "
                                                            "(needs one of bfloat16, float16)"): 2}


# ---- models through diffusers' dispatcher (the existing backend) ------------------------------------------

def wan_like(torch, cls, in_channels=4, **extra):
    model = build(torch, cls, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64,
                  in_channels=in_channels, out_channels=in_channels, text_dim=16, freq_dim=32, ffn_dim=32,
                  num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, in_channels, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 12, 16))
    return model, inputs


def test_skyreels_v2(torch, ovd, policy, stand_in):
    model, inputs = wan_like(torch, "SkyReelsV2Transformer3DModel")
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    # self-attention over 2 * 8 * 8 video tokens on openvc; text cross-attention (12 keys) on the fallback
    assert stand_in == [((1, 128, 2, 64), (1, 128, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "few keys (12 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_wan22_ti2v_style(torch, ovd, policy, stand_in):
    """Wan 2.2 TI2V-5B is WanTransformer3DModel with 48 latent channels (its VAE's); the calls are Wan's."""
    model, inputs = wan_like(torch, "WanTransformer3DModel", in_channels=48)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 128, 2, 64), (1, 128, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "few keys (12 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_hunyuan_video_15(torch, ovd, policy, stand_in):
    model = build(torch, "HunyuanVideo15Transformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=64, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1,
                  patch_size_t=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12,
                  rope_axes_dim=(16, 24, 24), target_size=16, task_type="t2v")
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 4, 2, 8, 8), timestep=torch.tensor([500.0], dtype=torch.bfloat16),
                  encoder_hidden_states=randn(torch, g, 1, 6, 16), encoder_attention_mask=torch.ones(1, 6),
                  encoder_hidden_states_2=randn(torch, g, 1, 4, 8), encoder_attention_mask_2=torch.ones(1, 4),
                  image_embeds=torch.zeros(1, 3, 12, dtype=torch.bfloat16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    # joint attention with a mask [B, 1, N, N] (valid query and valid key): a per-query mask, on the fallback
    assert stand_in == [] and torch.equal(out, ref)
    assert set(stats) == {("fallback", "attn_mask per query (not a key padding mask)")}


def test_cosmos(torch, ovd, policy, stand_in):
    model = build(torch, "CosmosTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=64, num_layers=2, mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4,
                  max_size=(4, 32, 32), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False,
                  extra_pos_embed_type="learnable")
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 12, 16), attention_mask=torch.ones(1, 12),
                  fps=30)     # (no padding mask: resizing it needs torchvision)
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 128, 2, 64), (1, 128, 2, 64), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "few keys (12 < 64)"): 2}     # text cross-attention
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_sana_video(torch, ovd, policy, stand_in):
    """SANA-Video's self-attention is linear attention (no softmax, not a dispatch call): only the text
    cross-attention reaches the dispatcher, and it has few keys. No call takes openvc's path."""
    model = build(torch, "SanaVideoTransformer3DModel", in_channels=16, out_channels=16, num_attention_heads=2,
                  attention_head_dim=64, num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=64,
                  cross_attention_dim=128, caption_channels=16, mlp_ratio=2.5, dropout=0.0, attention_bias=False,
                  sample_size=8, patch_size=(1, 2, 2), norm_elementwise_affine=False, norm_eps=1e-6,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 16, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 12, 16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [] and torch.equal(out, ref)
    assert stats == {("fallback", "few keys (12 < 64)"): 2}


def test_unsupported_models_get_a_clear_error(torch, ovd):
    allegro = build(torch, "AllegroTransformer3DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4,
                    out_channels=4, num_layers=1, cross_attention_dim=16, sample_width=8, sample_height=8,
                    sample_frames=8, caption_channels=8)
    with pytest.raises(ValueError, match=r"^model: AllegroTransformer3DModel's attention processors "
                                         r"\(AllegroAttnProcessor2_0\) compute attention themselves.*no replacement"):
        ovd.apply(allegro)
    latte = build(torch, "LatteTransformer3DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4,
                  out_channels=8, num_layers=1, sample_size=8, patch_size=2, caption_channels=8, video_length=1)
    with pytest.raises(ValueError, match=r"^model: LatteTransformer3DModel's attention processors "
                                         r"\(AttnProcessor2_0\)"):
        ovd.apply(latte)


def test_direct_route_key_counts_need_the_mask(torch, ovd):
    """The processors' route takes key counts only with the key mask they stand for (the policy and the auto
    format read the mask): counts alone are an error naming the argument."""
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="key_counts: given with key_mask=None"):
        ovd._direct_attention(None, None, None, q, q, q, lambda: q, key_counts=torch.tensor([8], dtype=torch.int32))
