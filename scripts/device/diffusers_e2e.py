"""End-to-end transformer forwards of diffusers video models with diffusers' native attention (torch SDPA) and
with openvc applied (open_vc_attn.integrations.diffusers.apply): seconds per forward, speedup, and the
attention calls of one forward by path (docs/integrations/diffusers.md, "End to end"; issues 15 and 29).

    python3 scripts/device/diffusers_e2e.py --json out.json               # all models, GPU (sm_90a)
    python3 scripts/device/diffusers_e2e.py --models ltx --layers 28 --runs 5
    python3 scripts/device/diffusers_e2e.py --dry-run                      # CPU, tiny configs (API check)
    bash scripts/device/check.sh diffusers-e2e                             # on the device, carried .whl/

Models (diffusers 0.42.1), each built from its real config (widths, heads, head dim, text widths) with
random BF16 weights created on the GPU, at real token counts; only the NUMBER of transformer blocks is cut
(--layers, spread over the model's block stacks in their real proportions) to keep the step short:
- hunyuan: HunyuanVideoTransformer3DModel (HunyuanVideo 13B: 24 x 128, 20 dual + 40 single blocks), 720p
  x 129 frames -> 33 x 90 x 160 latent -> 118,800 video tokens; 256 text tokens of which 200 are padding
  (diffusers passes a bool key mask [B, 1, 1, N] to the joint attention).
- ltx: LTXVideoTransformer3DModel (LTX-Video 2B: 32 x 64, 28 blocks), 768 x 512 x 121 frames -> 16 x 16 x 24
  latent -> 6,144 tokens; 128 text tokens (the pipeline's max length), a text padding mask.
- motif: MotifVideoTransformer3DModel (Motif-Video 2B, Flux-style joint attention: 12 dual + 16 single + 8
  decoder blocks per the model card; 12 heads x 128, which gives the checkpoint's 2 B parameters — the
  checkpoint's config.json was not at hand; diffusers' class default, 24 heads, gives 8.6 B: --motif-heads),
  1280 x 736 x 121 frames -> 31 x 46 x 80 latent after patching -> 114,080 video tokens; 512 text tokens
  with padding (bool key mask [B, 1, 1, N]); its decoder blocks attend over video + video (228,160 keys).
- cogvideox: CogVideoXTransformer3DModel (CogVideoX-5B: 48 x 64, 42 blocks, RoPE), 720 x 480 x 49 frames ->
  13 x 60 x 90 latent -> 17,550 video tokens + 226 text tokens (no text mask: the processor attends all 226);
  joint attention over [text; video] through openvc's CogVideoX processor (the diffusers one calls torch SDPA
  itself). The RoPE tables are CogVideoXPipeline's.
- cogvideox15: the same class as CogVideoX1.5-5B (patch_size_t 2, no patch bias), 1360 x 768 x 81 frames ->
  21 latent frames, padded to 22 by the pipeline (patch_size_t) -> 11 x 48 x 85 = 44,880 video + 226 text tokens.
- mochi: MochiTransformer3DModel (Mochi-1 10B: 24 x 128, 48 blocks), 848 x 480 x 85 frames -> 15 x 60 x 106
  latent -> 23,850 video tokens + 256 text tokens of which 200 are padding: diffusers runs one SDPA per sample
  over its valid tokens; openvc's processor runs the batch as one call with the padding as key counts.
- cosmos3: Cosmos3OmniTransformer (Cosmos 3; the class defaults, Qwen3-VL-8B's language-model widths: diffusers'
  source gives no others, the checkpoints' config.json was not at hand: 36 layers, each with prompt and video
  weights, 4096 wide, 32 query / 8 key-value heads x 128, MLP 12288, 15.2 B parameters), text-to-video at the
  pipeline's defaults 1280 x 720 x 189 frames -> 48 x 45 x 80 latent (Wan 2.2 VAE: 4x temporal, 16x spatial) ->
  patch 2 (height padded to 46) -> 48 x 23 x 40 = 44,160 video tokens; 256 prompt tokens (a detailed prompt in the
  pipeline's chat template with its duration / resolution sentences). Per layer the prompt's causal self-attention
  and the video's attention to [prompt; video] keys, both enable_gqa=True (k, v: 8 heads); inputs: _e2e_cosmos3.py.

Times: one warm-up forward per backend, then --runs forwards of each, interleaved (native, openvc, ...)
so clock drift hits both alike; the median is reported. The calls by path are those of one forward
(stats(model) of the warm-up). The output difference (rel L2 of openvc's output against native's) is
printed for information (random weights attend almost uniformly: it is not an accuracy figure).
--compare-rope adds a third entry to the interleaved runs: openvc with its processors' rotary embedding in
diffusers' own torch form instead of open_vc_attn.rotary's one pass (the same output bits, checked), so that
the part of the speedup that comes from the rotary embedding is measured in the same run.
--dry-run builds tiny configs on the CPU (BF16) and runs the same code with torch SDPA standing in for
openvc's kernel and the policy's token thresholds scaled down (to 100), so the calls take the paths
they take on the GPU; --shapes-only builds the real configs at the real token counts on the meta device
and runs one forward per backend without computing anything. Neither measures speed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
import warnings

# ---- models ------------------------------------------------------------------------------------------------
# Each entry: the diffusers class, its real config, the config's block stacks (name -> real count), the
# inputs at real token counts, and a tiny variant for --dry-run (same code path, small widths and tokens).

HUNYUAN = {
    "class": "HunyuanVideoTransformer3DModel",
    "config": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                   num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
                   guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
                   rope_axes_dim=(16, 56, 56)),
    "stacks": {"num_layers": 20, "num_single_layers": 40},
    "default_layers": 6,                        # 2 dual + 4 single: ~4 s per native forward on an H200
    "latent": (16, 33, 90, 160),                # 720 x 1280, 129 frames (VAE 4x temporal, 8x spatial)
    "text": (256, 200),                         # text tokens, of which padding
    "tiny": dict(config=dict(num_attention_heads=2, num_refiner_layers=1, mlp_ratio=1.0, text_embed_dim=32,
                             pooled_projection_dim=16, in_channels=4, out_channels=4),
                 latent=(4, 3, 16, 16), text=(12, 3), text_dim=32, pooled=16),
}

LTX = {
    "class": "LTXVideoTransformer3DModel",
    "config": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                   attention_head_dim=64, cross_attention_dim=2048, activation_fn="gelu-approximate",
                   qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                   caption_channels=4096, attention_bias=True, attention_out_bias=True),
    "stacks": {"num_layers": 28},
    "default_layers": 28,                       # the whole model: ~0.1 s per forward
    "latent": (128, 16, 16, 24),                # 512 x 768, 121 frames (VAE 8x temporal, 32x spatial)
    "text": (128, 88),
    "tiny": dict(config=dict(in_channels=8, out_channels=8, num_attention_heads=2, cross_attention_dim=128,
                             caption_channels=32),
                 latent=(8, 3, 8, 8), text=(10, 3), text_dim=32),
}

MOTIF = {
    "class": "MotifVideoTransformer3DModel",
    # 12 x 128: 2.15 B parameters, Motif-Video-2B's size (the class default, 24 x 128, gives 8.6 B)
    "config": dict(in_channels=33, out_channels=16, num_attention_heads=12, attention_head_dim=128, mlp_ratio=4.0,
                   patch_size=2, patch_size_t=1, qk_norm="rms_norm", norm_type="layer_norm", text_embed_dim=4096,
                   rope_theta=256.0, rope_axes_dim=(16, 56, 56), enable_text_cross_attention_dual=True,
                   enable_text_cross_attention_single=True),
    # num_single_layers counts the decoder blocks too: 16 encoder single + 8 decoder = 24
    "stacks": {"num_layers": 12, "single_encoder": 16, "num_decoder_layers": 8},
    "default_layers": 9,                        # 3 dual + 4 single + 2 decoder (a quarter): ~3 s native
    "latent": (33, 31, 92, 160),                # 736 x 1280, 121 frames (Wan VAE 4x temporal, 8x spatial)
    "text": (512, 400),
    "tiny": dict(config=dict(in_channels=4, out_channels=4, num_attention_heads=2, mlp_ratio=1.0, text_embed_dim=32),
                 latent=(4, 3, 16, 16), text=(12, 3), text_dim=32),
}

COGVIDEOX = {
    "class": "CogVideoXTransformer3DModel",
    "config": dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, flip_sin_to_cos=True,
                   freq_shift=0, time_embed_dim=512, text_embed_dim=4096, num_layers=42, dropout=0.0,
                   attention_bias=True, sample_width=90, sample_height=60, sample_frames=49, patch_size=2,
                   temporal_compression_ratio=4, max_text_seq_length=226, activation_fn="gelu-approximate",
                   timestep_activation_fn="silu", norm_elementwise_affine=True, norm_eps=1e-5,
                   spatial_interpolation_scale=1.875, temporal_interpolation_scale=1.0,
                   use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False),
    "stacks": {"num_layers": 42},
    "default_layers": 42,                       # the whole model: ~1 s per native forward on an H200, 11 GiB
    "latent": (16, 13, 60, 90),                 # 480 x 720, 49 frames (VAE 4x temporal, 8x spatial)
    "text": (226, 0),                           # no text mask: padding is attended as the pipeline does
    "tiny": dict(config=dict(num_attention_heads=2, in_channels=4, out_channels=4, time_embed_dim=8, text_embed_dim=32,
                             sample_width=16, sample_height=16, sample_frames=9, max_text_seq_length=12),
                 latent=(4, 3, 16, 16), text=(12, 0), text_dim=32),
}

COGVIDEOX15 = {
    "class": "CogVideoXTransformer3DModel",
    "config": dict(COGVIDEOX["config"], patch_size_t=2, patch_bias=False, sample_width=300, sample_height=300,
                   sample_frames=81),
    "stacks": {"num_layers": 42},
    "default_layers": 21,                       # half: ~2 s per native forward at 45,106 tokens
    "latent": (16, 22, 96, 170),                # 768 x 1360, 81 frames: 21 latent frames + 1 (patch_size_t)
    "text": (226, 0),
    "tiny": dict(config=dict(COGVIDEOX["tiny"]["config"], sample_width=16, sample_height=16),
                 latent=(4, 4, 16, 16), text=(12, 0), text_dim=32),
}

MOCHI = {
    "class": "MochiTransformer3DModel",
    "config": dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, pooled_projection_dim=1536,
                   in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=4096, time_embed_dim=256,
                   activation_fn="swiglu", max_sequence_length=256),
    "stacks": {"num_layers": 48},
    "default_layers": 24,                       # half of the 10B model: ~1 s per native forward, 10 GiB
    "latent": (12, 15, 60, 106),                # 480 x 848, 85 frames (VAE 6x temporal, 8x spatial)
    "text": (256, 200),
    "tiny": dict(config=dict(num_attention_heads=2, pooled_projection_dim=32, in_channels=4, text_embed_dim=32,
                             time_embed_dim=4),
                 latent=(4, 2, 16, 16), text=(12, 3), text_dim=32),
}

COSMOS3 = {
    "class": "Cosmos3OmniTransformer",
    # the class defaults, written out (the mRoPE entries are read by _e2e_cosmos3.positions)
    "config": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, vocab_size=151936, latent_channel=48, latent_patch_size=2, patch_latent_dim=192,
                   rope_theta=5000000.0, rope_axes_dim=(24, 20, 20), base_fps=24, enable_fps_modulation=True,
                   unified_3d_mrope_temporal_modality_margin=15000, unified_3d_mrope_reset_spatial_ids=True),
    "stacks": {"num_hidden_layers": 36},
    "default_layers": 36,                       # the whole model: ~4.5 s per native forward estimated, ~33 GiB
    "latent": (48, 48, 45, 80),                 # 720 x 1280, 189 frames (Wan 2.2 VAE 4x temporal, 16x spatial)
    "text": (256, 0),                           # prompt tokens (the causal prefix), no padding
    # 8 / 2 heads of 128: the real grouping (4 query heads per key-value head); 12 prompt + 192 video tokens
    "tiny": dict(config=dict(hidden_size=1024, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2,
                             vocab_size=64, latent_channel=4, patch_latent_dim=16),
                 latent=(4, 3, 16, 16), text=(12, 0)),
}

MODELS = {"hunyuan": HUNYUAN, "ltx": LTX, "motif": MOTIF, "cogvideox": COGVIDEOX, "cogvideox15": COGVIDEOX15,
          "mochi": MOCHI, "cosmos3": COSMOS3}


def split_layers(stacks, total):
    """``total`` blocks spread over the stacks in their real proportions (largest shortfall first, at least one
    per stack), so that a cut model keeps the real mix of block kinds. total None: the real counts."""
    if total is None:
        return dict(stacks)
    real = sum(stacks.values())
    total = max(len(stacks), min(int(total), real))
    shares = {k: total * n / real for k, n in stacks.items()}
    counts = {k: max(1, int(s)) for k, s in shares.items()}
    for k in sorted(stacks, key=lambda k: counts[k] - shares[k]):   # the largest shortfall first
        if sum(counts.values()) >= total:
            break
        counts[k] += 1
    return counts


def model_config(name, spec, layers, tiny, motif_heads):
    cfg = dict(spec["config"])
    if name == "motif" and motif_heads:
        cfg["num_attention_heads"] = motif_heads
    if tiny:
        cfg.update(spec["tiny"]["config"])
    counts = split_layers(spec["stacks"], layers)
    if name == "motif":                         # diffusers' single count includes the decoder blocks
        cfg["num_layers"] = counts["num_layers"]
        cfg["num_decoder_layers"] = counts["num_decoder_layers"]
        cfg["num_single_layers"] = counts["single_encoder"] + counts["num_decoder_layers"]
    else:
        cfg.update(counts)
    return cfg, counts


@contextlib.contextmanager
def default_dtype(torch, dtype):
    """Parameters are created in ``dtype`` directly (no FP32 copy of the weights on the device first)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build(torch, name, spec, cfg, device, dtype):
    import diffusers
    cls = getattr(diffusers, spec["class"])
    torch.manual_seed(0)
    with torch.device(device), default_dtype(torch, dtype):
        model = cls(**cfg)
    model = model.to(device=device, dtype=dtype).eval()
    keep = getattr(cls, "_keep_in_fp32_modules", None) or ()      # FP32 as from_pretrained keeps them (Cosmos 3's
    for name, module in model.named_modules():                     # time embedder; none in the other models)
        if name.split(".")[-1] in keep:
            module.float()
    return model


def text_inputs(torch, tokens, padding, width, gen, device, dtype):
    """Text states [1, T, width] and a [1, T] mask with the padding at the end (as tokenizers pad)."""
    states = torch.randn(1, tokens, width, generator=gen, device=device).to(dtype)
    mask = torch.ones(1, tokens, device=device, dtype=dtype)
    mask[:, tokens - padding:] = 0
    return states, mask


def cogvideox_rope(torch, cfg, frames, height, width, device, dtype):
    """The RoPE tables CogVideoXPipeline passes ((cos, sin), [video tokens, head dim]), computed on the CPU by
    the pipeline's own method; frames: latent frames, height / width: latent size."""
    import types
    from diffusers import CogVideoXPipeline
    fake = types.SimpleNamespace(vae_scale_factor_spatial=8, transformer=types.SimpleNamespace(
        config=types.SimpleNamespace(**{k: cfg.get(k) for k in ("patch_size", "patch_size_t", "sample_width",
                                                                "sample_height", "attention_head_dim")})))
    cos, sin = CogVideoXPipeline._prepare_rotary_positional_embeddings(fake, height * 8, width * 8, frames, "cpu")
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def helper(name):
    """scripts/device/<name>.py, loaded by path (scripts/ is not a package, and the tests load this file by path)."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).resolve().parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_inputs(torch, name, spec, tiny, device, dtype, cfg=None):
    """(forward kwargs, video tokens, text tokens) at the model's real token counts (tiny: small ones)."""
    src = spec["tiny"] if tiny else spec
    gen = None if device == "meta" else torch.Generator(device=device).manual_seed(1)   # meta: --shapes-only
    c, f, h, w = src["latent"]
    t, pad = src["text"]
    if name == "cosmos3":                       # token ids and the packed [prompt; video] sequence, no text states
        kwargs, video_tokens = helper("_e2e_cosmos3").inputs(torch, cfg, src["latent"], t, gen, device, dtype)
        return kwargs, video_tokens, t
    text_dim = src.get("text_dim", 4096)
    text, mask = text_inputs(torch, t, pad, text_dim, gen, device, dtype)
    step = torch.tensor([500], device=device)
    if name == "ltx":                           # LTX takes patchified tokens [B, F*H*W, C] and the grid size
        latents = torch.randn(1, f * h * w, c, generator=gen, device=device).to(dtype)
        kwargs = dict(hidden_states=latents, encoder_hidden_states=text, timestep=step, encoder_attention_mask=mask,
                      num_frames=f, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32))
        return kwargs, f * h * w, t
    if name.startswith("cogvideox"):          # CogVideoX takes [B, F, C, H, W] and RoPE tables from the pipeline
        latents = torch.randn(1, f, c, h, w, generator=gen, device=device).to(dtype)
        kwargs = dict(hidden_states=latents, encoder_hidden_states=text, timestep=step,
                      image_rotary_emb=cogvideox_rope(torch, cfg, f, h, w, device, dtype))
        return kwargs, f // (cfg.get("patch_size_t") or 1) * (h // 2) * (w // 2), t
    latents = torch.randn(1, c, f, h, w, generator=gen, device=device).to(dtype)
    video_tokens = f * (h // 2) * (w // 2)
    if name == "mochi":                         # MochiPipeline passes the tokenizer's mask as bool
        return dict(hidden_states=latents, encoder_hidden_states=text, timestep=step,
                    encoder_attention_mask=mask.bool()), video_tokens, t
    if name == "hunyuan":
        pooled = torch.randn(1, src.get("pooled", 768), generator=gen, device=device).to(dtype)
        kwargs = dict(hidden_states=latents, timestep=step, encoder_hidden_states=text, encoder_attention_mask=mask,
                      pooled_projections=pooled, guidance=torch.tensor([6000.0], device=device))
    else:
        kwargs = dict(hidden_states=latents, timestep=step, encoder_hidden_states=text, encoder_attention_mask=mask)
    return kwargs, video_tokens, t


# ---- measurement -------------------------------------------------------------------------------------------

def forward(torch, model, inputs):
    with torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
    return out[0] if isinstance(out, list) else out     # Cosmos 3: per-item predictions, one item


def timed(torch, fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def rel_l2(torch, a, b):
    a, b = a.float(), b.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def calls_by_path(stats):
    """stats(model) -> [{path, reason, calls}], openvc first, then by count."""
    rows = [{"path": p, "reason": r, "calls": n} for (p, r), n in stats.items()]
    return sorted(rows, key=lambda x: (x["path"] != "openvc", -x["calls"], x["reason"]))


def describe(name, spec, cfg, counts, video_tokens, text_tokens, tiny, model):
    return {"model": name, "class": spec["class"],
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
            "blocks": counts, "real_blocks": dict(spec["stacks"]), "video_tokens": video_tokens,
            "text_tokens": text_tokens, "text_padding": (spec["tiny"] if tiny else spec)["text"][1],
            "heads": cfg["num_attention_heads"], "kv_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            "head_dim": cfg.get("attention_head_dim", cfg.get("head_dim")),    # Cosmos 3: head_dim
            "params": sum(p.numel() for p in model.parameters())}


def heads_text(r):     # '24 x 128'; grouped-query attention: '32 / 8 kv x 128'
    kv = f" / {r['kv_heads']} kv" if r["kv_heads"] != r["heads"] else ""
    return f"{r['heads']}{kv} x {r['head_dim']}"


def run_model(torch, ovd, name, args, device, dtype, policy):
    spec = MODELS[name]
    tiny = args.dry_run
    layers = args.layers if args.layers is not None else (None if tiny else spec["default_layers"])
    if tiny and args.layers is None:
        layers = len(spec["stacks"])            # one block per stack
    cfg, counts = model_config(name, spec, layers, tiny, args.motif_heads)
    t_build = time.perf_counter()
    model = build(torch, name, spec, cfg, device, dtype)
    inputs, video_tokens, text_tokens = make_inputs(torch, name, spec, tiny, device, dtype, cfg)
    build_s = time.perf_counter() - t_build
    record = describe(name, spec, cfg, counts, video_tokens, text_tokens, tiny, model)
    record["build_s"] = round(build_s, 2)
    cut = "" if counts == dict(spec["stacks"]) else " -- fewer blocks than the real model (per-block cost kept)"
    print(f"[{name}] {spec['class']}: blocks {counts} (real {spec['stacks']}{cut}), {video_tokens} video + "
          f"{text_tokens} text tokens, {heads_text(record)}, "
          f"{record['params'] / 1e9:.2f} B params, built in {build_s:.1f} s", flush=True)

    def native():
        return forward(torch, model, inputs)

    def openvc():
        ovd.apply(model, policy=policy)
        try:
            return forward(torch, model, inputs)
        finally:
            ovd.remove(model)

    def openvc_torch_rope():
        """openvc with the replaced processors' rotary embedding in diffusers' elementwise torch form (what the
        kernel form, open_vc_attn.rotary, saves: --compare-rope)."""
        from open_vc_attn.integrations import _diffusers_processors as procs
        saved = procs._kernel_rope_reason
        procs._kernel_rope_reason = lambda *tensors: "off (--compare-rope)"
        try:
            return openvc()
        finally:
            procs._kernel_rope_reason = saved

    entries = [("native", native), ("openvc", openvc)]
    if args.compare_rope:
        entries.append(("openvc_torch_rope", openvc_torch_rope))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t_native0, out_native = timed(torch, native, device)
        ovd.reset_stats()                        # so that stats(model) below counts one forward
        t_openvc0, out_openvc = timed(torch, openvc, device)
        record["calls_per_forward"] = calls_by_path(ovd.stats(model))
        record["output_shape"] = list(out_openvc.shape)
        if device != "meta":
            record["rel_l2_openvc_vs_native"] = rel_l2(torch, out_openvc, out_native)
            if args.compare_rope:   # the two rotary forms give the same bits, so the same forward
                _, out_torch_rope = timed(torch, openvc_torch_rope, device)
                record["torch_rope_same_output"] = bool(torch.equal(out_torch_rope, out_openvc))
                del out_torch_rope
        del out_native, out_openvc
        times = {key: [] for key, _ in entries}
        for _ in range(args.runs if device != "meta" else 0):
            for key, fn in entries:
                dt, out = timed(torch, fn, device)
                del out
                times[key].append(dt)
        record["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in seen})
    openvc_calls = sum(r["calls"] for r in record["calls_per_forward"] if r["path"] == "openvc")
    total_calls = sum(r["calls"] for r in record["calls_per_forward"])
    if device != "meta":
        record["warmup_s"] = {"native": t_native0, "openvc": t_openvc0}
        record["times_s"] = times
        med = {k: statistics.median(v) for k, v in times.items()}
        record["s_per_forward"] = med
        record["speedup"] = med["native"] / med["openvc"]
        if args.compare_rope:
            record["speedup_torch_rope"] = med["native"] / med["openvc_torch_rope"]
            print(f"[{name}] openvc with diffusers' torch rotary embedding {med['openvc_torch_rope']:.3f} s: "
                  f"{record['speedup_torch_rope']:.2f}x (same output bits: {record['torch_rope_same_output']})")
        print(f"[{name}] native {med['native']:.3f} s, openvc {med['openvc']:.3f} s per forward: "
              f"{record['speedup']:.2f}x; {openvc_calls}/{total_calls} attention calls on openvc; rel L2 "
              f"{record['rel_l2_openvc_vs_native']:.4f}", flush=True)
    else:
        print(f"[{name}] output {record['output_shape']}; {openvc_calls}/{total_calls} attention calls on openvc")
    if device == "cuda":
        record["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        print(f"[{name}] peak memory {record['max_memory_gib']:.1f} GiB")
    for r in record["calls_per_forward"]:
        print(f"[{name}]   {r['path']:8s} {r['calls']:4d}  {r['reason'] or '-'}")
    del model, inputs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return record


def table(records):
    lines = ["| model | blocks (of real) | tokens (video + text, padding) | heads x dim | native s/fwd | "
             "openvc s/fwd | speedup | calls openvc / fallback |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} | | | | | | |")
            continue
        ov = sum(c["calls"] for c in r["calls_per_forward"] if c["path"] == "openvc")
        fb = sum(c["calls"] for c in r["calls_per_forward"] if c["path"] != "openvc")
        blocks = sum(r["blocks"].values())
        sec = r.get("s_per_forward")
        times = (f"{sec['native']:.3f} | {sec['openvc']:.3f} | {r['speedup']:.2f}x" if sec else "- | - | -")
        lines.append(f"| {r['model']}: {r['class']} | {blocks} of {sum(r['real_blocks'].values())} | "
                     f"{r['video_tokens']:,} + "
                     f"{r['text_tokens']} ({r['text_padding']}) | {heads_text(r)} | {times} | "
                     f"{ov} / {fb} |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    p.add_argument("--layers", type=int, default=None,
                   help="transformer blocks per model, spread over its stacks in the real proportions (default: "
                        "per model: " + ", ".join(f"{k} {v['default_layers']}" for k, v in MODELS.items()) +
                        "; --dry-run: one per stack)")
    p.add_argument("--runs", type=int, default=3, help="timed forwards per backend after the warm-up")
    p.add_argument("--motif-heads", type=int, default=None,
                   help="Motif-Video attention heads (default 12: 2.15 B parameters, the 2B checkpoint's size; "
                        "diffusers' class default is 24)")
    p.add_argument("--policy-head-dims", default=None,
                   help="e.g. 64,128: DispatchPolicy(head_dims=...) for apply(); default: the integration's "
                        "default policy (what a user gets)")
    p.add_argument("--qk-format", default=None, choices=("e4m3", "int8"),
                   help="the policy's qk_format (default: the default policy's, e4m3)")
    p.add_argument("--k-smoothing", action="store_true", help="the policy's k_smoothing")
    p.add_argument("--p-format", default=None, choices=("expcast", "exp2"),
                   help="the policy's p_format (default: expcast; exp2 needs --qk-format int8)")
    p.add_argument("--v-bias-correction", action="store_true",
                   help="the policy's v_bias_correction (needs --qk-format int8)")
    p.add_argument("--compare-rope", action="store_true",
                   help="also time openvc with its processors' rotary embedding in diffusers' torch form (interleaved "
                        "with the others) and check that the output bits are the same")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny configs, kernel stand-in (checks the diffusers API and routing)")
    p.add_argument("--shapes-only", action="store_true",
                   help="real configs and token counts on the meta device (no memory, no compute): checks the "
                        "inputs against the models and prints the calls by path a GPU run will make")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    if args.runs < 1:
        p.error("--runs: at least 1")
    if args.dry_run and args.shapes_only:
        p.error("--dry-run and --shapes-only: pick one")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import diffusers
    from diffusers.utils import logging as dlogging
    from open_vc_attn.integrations import diffusers as ovd
    from open_vc_attn.integrations import policy as ovp

    dlogging.set_verbosity_error()
    device = "cpu" if args.dry_run else "meta" if args.shapes_only else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("diffusers_e2e: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    policy = None
    if args.policy_head_dims:
        dims = tuple(int(d) for d in args.policy_head_dims.split(","))
        policy = dataclasses.replace(ovp.DEFAULT_POLICY, head_dims=dims)
    if args.dry_run:
        # tiny calls: 100-token thresholds stand for the defaults, so that joint attention (204 tokens) is taken
        # and text cross-attention (12 keys) is not, as at the real sizes
        policy = dataclasses.replace(policy or ovp.DEFAULT_POLICY, min_query_tokens=100, min_key_tokens=100)
    if args.qk_format or args.k_smoothing or args.p_format or args.v_bias_correction:
        policy = dataclasses.replace(policy or ovp.DEFAULT_POLICY, qk_format=args.qk_format or "e4m3",
                                     k_smoothing=args.k_smoothing, p_format=args.p_format or "expcast",
                                     v_bias_correction=args.v_bias_correction)
    used_policy = policy or ovp.DEFAULT_POLICY
    header = {"diffusers": diffusers.__version__, "torch": torch.__version__, "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "dry_run": args.dry_run,
              "shapes_only": args.shapes_only, "runs": args.runs, "policy": {
                                            "min_query_tokens": used_policy.min_query_tokens,
                                            "min_key_tokens": used_policy.min_key_tokens,
                                            "head_dims": list(used_policy.head_dims),
                                            "qk_format": used_policy.qk_format,
                                            "k_smoothing": used_policy.k_smoothing,
                                            "p_format": used_policy.p_format,
                                            "v_bias_correction": used_policy.v_bias_correction}}
    print("diffusers_e2e:", json.dumps(header), flush=True)
    records, failed = [], False
    standins = helper("_e2e_standins")   # --dry-run / --shapes-only
    t0 = time.perf_counter()
    for name in args.models:
        try:
            with standins.fast_path_stand_in(torch, ovd, ovp) if device != "cuda" else contextlib.nullcontext(), \
                    standins.meta_shims(torch) if device == "meta" else contextlib.nullcontext():
                records.append(run_model(torch, ovd, name, args, device, torch.bfloat16, policy))
        except Exception as exc:   # noqa: BLE001 - one model's failure is reported, the next still runs
            failed = True
            import traceback
            traceback.print_exc()
            records.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    header["wall_s"] = time.perf_counter() - t0
    print(table(records))
    print(f"diffusers_e2e: {header['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**header, "models": records}, fh, indent=1)
        print("diffusers_e2e: wrote", args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
