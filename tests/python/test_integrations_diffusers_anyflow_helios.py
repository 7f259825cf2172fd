"""AnyFlow, AnyFlow-FAR, Helios and MiniMax-H3 (diffusers 0.42.1) under open_vc_attn.integrations.diffusers.apply,
on the CPU, as test_integrations_diffusers_models.py checks the other video transformers: a tiny BF16 config with
fresh random inputs, run unwrapped, with apply() and the recording stand-in of openvc's fast path, and after
remove(); checked are the calls that reach openvc, the fallback reasons of the others, and the output against the
unwrapped model's. AnyFlow-FAR's causal self-attention processor requires the "flex" backend: apply() leaves it
there, and routes the cross-attention only.
"""

import pytest

from diffusers_tiny import (STAND_IN_REL_L2, applied_forward, build, forward, gen, randn, rel_l2,
                           run_three_ways, small_policy)

# Wan 2.1's backbone, as AnyFlow and AnyFlow-FAR have it: 2 heads of 128, latent 4 channels, patch (1, 2, 2)
ANYFLOW = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)


def processors(model):
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


def test_anyflow(torch, ovd, policy, stand_in):
    """Wan's calls (the flow-map timestep embedding aside): self-attention over 2 * 8 * 8 video tokens (RoPE, no
    mask), text cross-attention with 12 keys. Timesteps per frame [B, F], as AnyFlowPipeline passes them."""
    model = build(torch, "AnyFlowTransformer3DModel", **ANYFLOW)
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, 2, 4, 16, 16), timestep=torch.tensor([[500.0, 500.0]]),
                  r_timestep=torch.tensor([[250.0, 250.0]]), encoder_hidden_states=randn(torch, g, 1, 12, 16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 128, 2, 128), (1, 128, 2, 128), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "few keys (12 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def anyflow_far(torch):
    return build(torch, "AnyFlowFARTransformer3DModel", compressed_patch_size=(1, 4, 4), full_chunk_limit=3,
                 chunk_partition=(1, 2), **ANYFLOW)


def anyflow_far_inputs(torch, path):
    """"denoise": AnyFlowFARPipeline's denoising step of the first chunk (2 frames), the KV-cache read path with
    an empty cache: self-attention over the chunk's 128 tokens (the processor pads to a multiple of 128: none
    here), no mask, flex backend. "train": the training rollout over chunks [1, 2] (3 frames, 192 tokens padded
    to 256) with the causal BlockMask the forward builds."""
    g = gen(torch)
    frames = 2 if path == "denoise" else 3
    inputs = dict(hidden_states=randn(torch, g, 1, frames, 4, 16, 16), timestep=torch.full((1, frames), 500.0),
                  r_timestep=torch.full((1, frames), 250.0), encoder_hidden_states=randn(torch, g, 1, 12, 16))
    if path == "train":
        return dict(inputs, chunk_partition=[1, 2])
    cache = [{"full_cache": torch.zeros(2, 1, 2, 3 * 2 * 64, 128, dtype=torch.bfloat16),   # the pipeline's sizes
              "compressed_cache": torch.zeros(2, 1, 2, 2 * 16, 128, dtype=torch.bfloat16)} for _ in range(2)]
    return dict(inputs, chunk_partition=[2], kv_cache=cache,
                kv_cache_flag={"num_cached_chunks": 0, "is_cache_step": False})


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("path", ["denoise", "train"])
def test_anyflow_far_forward_under_apply(torch, ovd, policy, stand_in, path):
    """AnyFlowCausalAttnProcessor (self-attention) raises unless its own backend is "flex" (its BlockMask is built
    for flex's element rule): apply() leaves it as it is (KEEP_OWN_BACKEND), so its calls run on flex, outside
    openvc's routing and counts; the text cross-attention (12 keys) is routed and stays on the fallback, so the
    output is the unwrapped model's bit for bit; remove() restores the model."""
    model = anyflow_far(torch)
    assert [type(p).__name__ for p in processors(model)] == ["AnyFlowCausalAttnProcessor",
                                                             "AnyFlowCrossAttnProcessor"] * 2
    inputs = anyflow_far_inputs(torch, path)
    ref = forward(torch, model, inputs)            # unwrapped: diffusers' flex backend runs on the CPU
    originals = processors(model)
    out = applied_forward(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [] and ovd.stats(model) == {("fallback", "few keys (12 < 64)"): 2}
    assert torch.equal(out, ref)
    assert processors(model) == originals and torch.equal(forward(torch, model, inputs), ref)


def test_anyflow_far_block_mask_policy(torch, policy, monkeypatch):
    """The causal BlockMask of the training rollout and of the KV-cache prefill (chunks [1, 2]: 64 + 128 tokens,
    padded to 256) has every block partial (chunk 0 and the padding end inside the tiles); the policy would take
    it for openvc's block_mask= (a device it accepts), which visits listed blocks whole (mask_mod is not
    evaluated): this mask would run as dense attention over all 256 tokens. It never reaches the policy: apply()
    leaves that processor on flex (see the test above)."""
    monkeypatch.setattr(policy, "_device_reason", lambda device: None)
    model = anyflow_far(torch)
    q = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
    for mode in ("train", "cache"):
        mask = model.build_attention_mask(chunk_partition=[1, 2], height=16, width=16, mode=mode,
                                          device=torch.device("cpu"))
        assert tuple(mask.seq_lengths) == (256, 256) and tuple(mask.BLOCK_SIZE) == (128, 128)
        assert mask.kv_num_blocks.tolist() == [[[2, 2]]] and mask.full_kv_num_blocks.tolist() == [[[0, 0]]]
        assert policy.choose_path(q, q, q, attn_mask=mask, policy=small_policy(policy, 64)) == ("openvc", "")


@pytest.mark.parametrize("amplify", [False, True])
def test_helios(torch, ovd, policy, stand_in, amplify):
    """Self-attention over [long; mid; short history; current] = 4 + 16 + 128 + 128 tokens, no mask (the pipeline
    passes all three histories; is_amplify_history scales the history keys); text cross-attention (12 keys) from
    the current 128 tokens only (guidance_cross_attn)."""
    model = build(torch, "HeliosTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2,
                  attention_head_dim=128, in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32,
                  num_layers=2, rope_dim=(44, 42, 42), is_amplify_history=amplify)
    g = gen(torch)
    idx = torch.arange(10)[None]     # prefix, long 4, mid 2, short 1x 1, current 2 (HeliosPipeline's split)
    inputs = dict(hidden_states=randn(torch, g, 1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=randn(torch, g, 1, 12, 16), indices_hidden_states=idx[:, 8:],
                  indices_latents_history_short=torch.cat([idx[:, :1], idx[:, 7:8]], 1),
                  indices_latents_history_mid=idx[:, 5:7], indices_latents_history_long=idx[:, 1:5],
                  latents_history_short=randn(torch, g, 1, 4, 2, 16, 16),
                  latents_history_mid=randn(torch, g, 1, 4, 2, 16, 16),
                  latents_history_long=randn(torch, g, 1, 4, 4, 16, 16))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, 276, 2, 128), (1, 276, 2, 128), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "few keys (12 < 64)"): 2}
    assert rel_l2(out, ref) < STAND_IN_REL_L2


def test_minimax_h3(torch, ovd, policy, stand_in):
    """No cross-attention: each block's self-attention over one packed sequence [text; audio; video] = 8 + 8 +
    2 * 8 * 8 rows, no mask; the token refiner's self-attention over the 8 text tokens: short query."""
    model = build(torch, "MiniMaxH3Transformer3DModel", num_attention_heads=2, attention_head_dim=128,
                  hidden_size=256, num_layers=2, num_refiner_layers=1, ffn_dim=64, in_channels=4,
                  audio_in_channels=8, patch_size=(1, 2, 2), text_dim=16, freq_dim=32, time_embed_hidden_dim=32,
                  time_embed_dim=32)
    text, audio, video = 8, 8, 128
    rows = text + audio + video
    f, y, x = torch.meshgrid(torch.arange(2), torch.arange(8), torch.arange(8), indexing="ij")
    position_ids = torch.cat([torch.stack([torch.arange(text + audio), torch.zeros(text + audio, dtype=torch.long),
                                           torch.zeros(text + audio, dtype=torch.long)], 1),
                              torch.stack([text + f.flatten(), y.flatten(), x.flatten()], 1)]).float()
    g = gen(torch)
    inputs = dict(hidden_states=randn(torch, g, 1, video, 16), audio_hidden_states=randn(torch, g, 1, audio, 8),
                  encoder_hidden_states=randn(torch, g, 1, text, 16), timestep=torch.tensor([0.5]),
                  timestep_indices=torch.zeros(rows, dtype=torch.long),
                  token_tags=torch.tensor([1] * text + [2] * audio + [0] * video), position_ids=position_ids,
                  video_indices=torch.arange(text + audio, rows), audio_indices=torch.arange(text, text + audio),
                  text_indices=torch.arange(text))
    ref, out, stats = run_three_ways(torch, ovd, model, inputs, small_policy(policy, 64))
    assert stand_in == [((1, rows, 2, 128), (1, rows, 2, 128), None, False, None)] * 2
    assert stats == {("openvc", ""): 2, ("fallback", "short query (8 < 64 tokens)"): 1}
    assert rel_l2(out, ref) < STAND_IN_REL_L2
