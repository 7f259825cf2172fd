"""Deterministic SYNTHETIC video-like attention inputs (pure numpy, no model weights involved).

The generator imitates the structure that matters to FP8 ExpCast attention in video diffusion
transformers (Wan-style): it is not drawn from a real model, and its numbers are not a claim about one.

- Tokens: a T x h x w latent grid flattened frame-major (n = t*h*w + y*w + x), optionally truncated to
  the first ``seqlen`` tokens (for lengths such as 73,397 that no convenient grid gives exactly).
- Q and K: per-head content, RMS-normalized per token (as a qk-norm does), then 3D RoPE with the head
  dim split in channel pairs between t, h and w (44/42/42 for D = 128, Wan's split; :func:`rope_split`).
- Two kinds of heads. "spatial": Q/K content is a smooth random field over the position (y, x) inside a
  frame, shared by every frame. "temporal": content is a smooth random function of the frame index t,
  shared by all positions of a frame. Both get per-token noise and a per-head shared query direction.
- K: a shared per-channel bias per head (it shifts every score of a row by the same amount, so the
  softmax ignores it, but it widens K's range for quantization) and a few sink tokens: keys with a large
  norm aligned with the head's mean query, so that most queries put a large score on them.
- V: a smooth field over (t, y, x) with per-channel gains plus noise, and a few token-level outliers
  (whole tokens scaled up), which stretch the per-head V scale.

Generation is vectorized per head (peak extra memory ~ a few [S, D] float32 arrays), so the "video"
preset with 56 heads (3 x 2.1 GB outputs) is feasible. Each (batch, head) draws from its own seeded
generator, so results do not depend on loop order.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from .reference import to_bfloat16_values

__all__ = ["PRESETS", "VideoQKV", "generate", "from_preset", "preset_seqlen", "rope_split",
           "rope_angles", "apply_rope", "token_positions"]

# name -> generate() keyword arguments.
PRESETS = {
    # Small enough for the CPU reference: 1,200 tokens = 9 full 128-token blocks + a partial one.
    "smoke": dict(frames=5, height=12, width=20, heads=2, head_dim=128),
    # The benchmark length S = 73,397 (not a product of a convenient grid): 21 x 46 x 76 = 73,416
    # truncated to 73,397 tokens; 56 heads (use heads=7 for one Ulysses shard).
    "video": dict(frames=21, height=46, width=76, seqlen=73_397, heads=56, head_dim=128),
    # Wan 2.1 14B latent grids: 480p 21 x 30 x 52 = 32,760 and 720p 21 x 45 x 80 = 75,600 tokens.
    "wan480": dict(frames=21, height=30, width=52, heads=40, head_dim=128),
    "wan720": dict(frames=21, height=45, width=80, heads=40, head_dim=128),
}


@dataclasses.dataclass
class VideoQKV:
    """Generated inputs plus the ground truth of what was planted in them (for tests and reports)."""
    q: np.ndarray                 # [B, S, H, D] float32 holding bf16 values, or float16
    k: np.ndarray
    v: np.ndarray
    grid: tuple                   # (T, h, w) before truncation
    head_kinds: list              # "spatial" or "temporal", one per head
    rope_split: tuple             # channels of (t, h, w) in RoPE
    k_bias: np.ndarray            # [H, D] float32 per-channel bias added to every key
    sink_tokens: np.ndarray       # [B, n_sink] token indices of the sink keys (all heads)
    v_outlier_tokens: np.ndarray  # [B, n_outlier] token indices of the V outliers (all heads)
    seed: int = 0
    dtype: str = "bfloat16"

    @property
    def seqlen(self) -> int:
        return self.q.shape[1]


def preset_seqlen(name: str) -> int:
    """Token count of a preset without generating it."""
    p = PRESETS[name]
    return p.get("seqlen") or p["frames"] * p["height"] * p["width"]


def rope_split(head_dim: int) -> tuple:
    """Channels given to (t, h, w) in 3D RoPE: Wan's split of the D/2 channel pairs, c - 2*(c//3),
    c//3, c//3 with c = D/2 (44/42/42 for D = 128); all sizes even."""
    if not isinstance(head_dim, int) or head_dim < 6 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even int >= 6 for 3D RoPE, got {head_dim}")
    c = head_dim // 2
    return (2 * (c - 2 * (c // 3)), 2 * (c // 3), 2 * (c // 3))


def token_positions(frames: int, height: int, width: int, seqlen: Optional[int] = None):
    """(t, y, x) int arrays of the first seqlen tokens of the frame-major grid."""
    s = frames * height * width if seqlen is None else seqlen
    n = np.arange(s, dtype=np.int64)
    return n // (height * width), (n // width) % height, n % width


def rope_angles(t, y, x, head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """[S, D/2] float32 rotation angles: each axis has its own inverse frequencies over its channel
    pairs, theta^(-2i/d_axis) as in Wan's rope_params."""
    parts = []
    for pos, dims in zip((t, y, x), rope_split(head_dim)):
        inv_freq = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
        parts.append(np.outer(np.asarray(pos, dtype=np.float64), inv_freq))
    return np.concatenate(parts, axis=1).astype(np.float32)


def apply_rope(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Rotates adjacent channel pairs (2i, 2i+1) of x [S, D] by angles [S, D/2] (norm-preserving)."""
    return _rotate(x, np.cos(angles), np.sin(angles))


def _rotate(x, cos, sin):
    even, odd = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2] = even * cos - odd * sin
    out[:, 1::2] = even * sin + odd * cos
    return out


def _smooth_field(rng, coords: np.ndarray, dim: int, n_features: int, cycles: float) -> np.ndarray:
    """A smooth random vector field over normalized coordinates [N, c] -> [N, dim], per-channel RMS ~1
    (random Fourier features with low frequencies: nearby positions get similar vectors)."""
    freqs = rng.normal(0.0, cycles, size=(coords.shape[1], n_features)) * (2 * np.pi)
    phase = rng.uniform(0.0, 2 * np.pi, size=n_features)
    mix = rng.normal(0.0, math.sqrt(2.0 / n_features), size=(n_features, dim))
    return (np.cos(coords @ freqs + phase) @ mix).astype(np.float32)


def _rms_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-12))


def _unit(x: np.ndarray) -> np.ndarray:
    return x / max(float(np.linalg.norm(x)), 1e-12)


def generate(*, frames: int = 5, height: int = 12, width: int = 20, seqlen: Optional[int] = None,
             batch: int = 1, heads: int = 2, head_dim: int = 128, seed: int = 0, dtype: str = "bfloat16",
             spatial_head_fraction: float = 0.5, rope_theta: float = 10000.0,
             field_features: int = 32, field_cycles: float = 1.5, qk_content: float = 1.0,
             qk_noise: float = 0.6, q_shared: float = 0.5, k_bias_scale: float = 1.0,
             num_sink_tokens: int = 4, sink_scale: float = 1.5, v_noise: float = 0.5,
             v_channel_spread: float = 0.5, v_outlier_fraction: float = 0.001,
             v_outlier_scale: float = 20.0) -> VideoQKV:
    """Generates a synthetic video-like (q, k, v), each [batch, S, heads, head_dim].

    Grid and size: frames, height, width (the latent grid), seqlen (truncate the frame-major grid to its
    first seqlen tokens; None keeps all), batch, heads, head_dim (even).
    seed: everything is a function of it. dtype: "bfloat16" (float32 arrays holding bf16 values) or
    "float16" (float16 arrays).
    spatial_head_fraction: share of "spatial" heads (the rest are "temporal"), shuffled by seed.
    rope_theta: RoPE base. field_features, field_cycles: size and smoothness (cycles across the grid)
    of the random content fields. qk_content, qk_noise: weights of the positional content and of the
    per-token noise in Q/K before normalization. q_shared: weight of a per-head direction shared by all
    queries (what makes sinks attract many queries). k_bias_scale: RMS of the per-channel K bias.
    num_sink_tokens, sink_scale: sink keys per sequence and their RMS relative to ordinary keys.
    v_noise, v_channel_spread: V noise weight and log-normal spread of V's per-channel gains.
    v_outlier_fraction, v_outlier_scale: share of V tokens scaled up (at least one when > 0), and by how
    much.
    """
    grid_tokens = frames * height * width
    if min(frames, height, width, batch, heads) < 1:
        raise ValueError("frames, height, width, batch, heads: expected ints >= 1")
    s = grid_tokens if seqlen is None else int(seqlen)
    if not 1 <= s <= grid_tokens:
        raise ValueError(f"seqlen: expected 1 <= seqlen <= frames*height*width = {grid_tokens}, got {seqlen}")
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype: expected 'bfloat16' or 'float16', got {dtype!r}")
    if not 0.0 <= spatial_head_fraction <= 1.0:
        raise ValueError(f"spatial_head_fraction: expected a value in [0, 1], got {spatial_head_fraction}")
    if not 0 <= num_sink_tokens <= s:
        raise ValueError(f"num_sink_tokens: expected 0 <= num_sink_tokens <= seqlen, got {num_sink_tokens}")
    if not 0.0 <= v_outlier_fraction <= 1.0:
        raise ValueError(f"v_outlier_fraction: expected a value in [0, 1], got {v_outlier_fraction}")
    split = rope_split(head_dim)
    d = head_dim

    t, y, x = token_positions(frames, height, width, s)
    angles = rope_angles(t, y, x, d, rope_theta)
    cos, sin = np.cos(angles), np.sin(angles)   # once: every head uses the same rotation
    # Normalized coordinates of the field domains (spatial: one frame; temporal: the frame axis).
    yy, xx = np.meshgrid(np.arange(height) / height, np.arange(width) / width, indexing="ij")
    spatial_coords = np.stack([yy.ravel(), xx.ravel()], axis=1)
    temporal_coords = (np.arange(frames) / frames)[:, None]
    full_coords = np.stack([t / frames, y / height, x / width], axis=1)
    spatial_index = y * width + x

    n_spatial = int(round(spatial_head_fraction * heads))
    kinds = np.array(["temporal"] * heads, dtype=object)
    kinds[np.random.default_rng([seed, 7]).permutation(heads)[:n_spatial]] = "spatial"

    n_outliers = 0 if v_outlier_fraction == 0 else max(1, int(round(v_outlier_fraction * s)))
    sinks = np.empty((batch, num_sink_tokens), dtype=np.int64)
    outliers = np.empty((batch, n_outliers), dtype=np.int64)
    for b in range(batch):
        rng = np.random.default_rng([seed, 2, b])
        picks = rng.choice(s, size=num_sink_tokens + n_outliers, replace=False)
        sinks[b], outliers[b] = np.sort(picks[:num_sink_tokens]), np.sort(picks[num_sink_tokens:])

    out_dtype = np.float32 if dtype == "bfloat16" else np.float16
    q = np.empty((batch, s, heads, d), dtype=out_dtype)
    k, v = np.empty_like(q), np.empty_like(q)
    k_bias = np.empty((heads, d), dtype=np.float32)

    def store(dst, b, h, x32):
        dst[b, :, h] = to_bfloat16_values(x32) if dtype == "bfloat16" else x32.astype(np.float16)

    for h in range(heads):
        # Per-head "model": fields, shared query direction, K bias, V gains (the same for every batch).
        mrng = np.random.default_rng([seed, 0, h])
        if kinds[h] == "spatial":
            field = _smooth_field(mrng, spatial_coords, d, field_features, field_cycles)[spatial_index]
        else:
            field = _smooth_field(mrng, temporal_coords, d, field_features, field_cycles)[t]
        shared_dir = _unit(mrng.normal(size=d)).astype(np.float32) * math.sqrt(d)
        k_bias[h] = mrng.normal(0.0, k_bias_scale, size=d)
        v_field = _smooth_field(mrng, full_coords, d, field_features, field_cycles)
        v_gain = np.exp(mrng.normal(0.0, v_channel_spread, size=d)).astype(np.float32)
        outlier_gain = mrng.uniform(0.5, 1.5)
        for b in range(batch):
            rng = np.random.default_rng([seed, 1, b, h])
            qh = rng.standard_normal((s, d), dtype=np.float32)
            qh *= qk_noise
            qh += qk_content * field
            qh += q_shared * shared_dir
            kh = rng.standard_normal((s, d), dtype=np.float32)
            kh *= qk_noise
            kh += qk_content * field
            qh = _rotate(_rms_normalize(qh), cos, sin)
            kh = _rotate(_rms_normalize(kh), cos, sin)
            if num_sink_tokens:
                # Sinks: large keys along the head's mean query (after RoPE), so most queries score them high.
                kh[sinks[b]] = _unit(qh.mean(axis=0)) * (sink_scale * math.sqrt(d))
            kh += k_bias[h]
            vh = rng.standard_normal((s, d), dtype=np.float32)
            vh *= v_noise
            vh += v_field
            vh *= v_gain
            vh[outliers[b]] *= v_outlier_scale * outlier_gain
            store(q, b, h, qh)
            store(k, b, h, kh)
            store(v, b, h, vh)

    return VideoQKV(q=q, k=k, v=v, grid=(frames, height, width), head_kinds=list(kinds), rope_split=split,
                    k_bias=k_bias, sink_tokens=sinks, v_outlier_tokens=outliers, seed=seed, dtype=dtype)


def from_preset(name: str, **overrides) -> VideoQKV:
    """generate() with a preset's arguments, any of them overridden by keyword."""
    if name not in PRESETS:
        raise ValueError(f"name: expected one of {sorted(PRESETS)}, got {name!r}")
    return generate(**{**PRESETS[name], **overrides})
