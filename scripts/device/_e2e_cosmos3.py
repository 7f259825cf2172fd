"""Cosmos 3's transformer inputs for scripts/device/diffusers_e2e.py: the packed sequence of one text-to-video
denoising pass as Cosmos3OmniPipeline (diffusers 0.42.1) builds it (_prepare_text_segment, _prepare_vision_segment
and the transformer call of its denoising loop): the prompt's token ids (the causal prefix), then the video latent's
patches, every latent frame noisy (no image condition). Built here rather than with the pipeline module's own
position functions: that module imports transformers (its tokenizer) and PIL, which the forward does not need.
"""


def positions(torch, config, prompt_tokens, frames, rows, cols, fps=24.0, temporal_compression=4):
    """[3, prompt + video] 3D mRoPE position ids (get_3d_mrope_ids_text_tokens, then get_3d_mrope_ids_vae_tokens at
    the text's end + the modality margin): the prompt counts 0 .. T-1 on all three axes; the video's time axis is
    its latent frame scaled by base_fps / fps (fps modulation; 1 at the pipeline's 24 fps), its height and width
    the patch row and column (reset per frame). Float with fps modulation, as the pipeline passes them."""
    modulated = config["enable_fps_modulation"]
    dtype = torch.float32 if modulated else torch.long
    text = torch.arange(prompt_tokens, dtype=dtype).expand(3, -1)
    offset = prompt_tokens + config["unified_3d_mrope_temporal_modality_margin"]
    frame = torch.arange(frames, dtype=dtype)
    if modulated and frames > 1:
        frame = frame / (fps / temporal_compression) * (config["base_fps"] / temporal_compression)
    t = (frame + offset).repeat_interleave(rows * cols)
    h = torch.arange(rows).repeat_interleave(cols).repeat(frames)
    w = torch.arange(cols).repeat(frames * rows)
    if not config["unified_3d_mrope_reset_spatial_ids"]:
        h, w = h + int(offset), w + int(offset)
    return torch.cat([text, torch.stack([t, h.to(dtype), w.to(dtype)])], dim=1)


def inputs(torch, config, latent, prompt_tokens, gen, device, dtype, step=500.0):
    """(forward kwargs, video tokens) for a latent (C, T, H, W) and ``prompt_tokens`` prompt tokens: the video is
    patched into T x ceil(H / p) x ceil(W / p) tokens (the model pads H and W to the patch size)."""
    c, f, h, w = latent
    p = config["latent_patch_size"]
    rows, cols = -(-h // p), -(-w // p)
    video = f * rows * cols
    ids = torch.randint(0, config["vocab_size"], (prompt_tokens,), generator=gen, device=device)
    latents = torch.randn(1, c, f, h, w, generator=gen, device=device).to(dtype)
    video_indexes = torch.arange(prompt_tokens, prompt_tokens + video, device=device)
    kwargs = dict(input_ids=ids, text_indexes=torch.arange(prompt_tokens, device=device),
                  position_ids=positions(torch, config, prompt_tokens, f, rows, cols).to(device),
                  und_len=prompt_tokens, sequence_length=prompt_tokens + video, vision_tokens=[latents],
                  vision_token_shapes=[(f, rows, cols)], vision_sequence_indexes=video_indexes,
                  vision_mse_loss_indexes=video_indexes,            # every frame noisy: every video token predicted
                  vision_timesteps=torch.full((video,), step, device=device),
                  vision_noisy_frame_indexes=[torch.arange(f, device=device)])
    return kwargs, video
