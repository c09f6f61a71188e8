"""RoPE: inverse frequencies with HF's scaling kinds, and the rotation itself.

`rope_frequencies` and `rope_attention_factor` compute what HF transformers'
`modeling_rope_utils` computes for a `ModelConfig`'s `rope_theta` and `rope_scaling`
(none, "linear", "llama3", "yarn"); `apply_rope` rotates queries or keys (rotate-half,
in float32). `pagedjax.model` uses them and re-exports them.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pagedjax.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies `[D // 2]` float32, scaled by `cfg.rope_scaling` as HF's
    `modeling_rope_utils` scales them (in float64, then rounded): linear divides all by
    `factor`; llama3 keeps high frequencies (wavelength < original context /
    high_freq_factor), divides low ones (wavelength > original / low_freq_factor) by
    `factor` and blends smoothly between; yarn blends by `_yarn_ramp`."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.rope_type == "llama3":
        old = rs.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    elif rs is not None:  # yarn, the last kind RopeScaling takes
        ramp = _yarn_ramp(cfg)  # 0: keep (extrapolate), 1: divide by factor (interpolate)
        inv = (1 - ramp) * inv + ramp * inv / rs.factor
    return inv.astype(np.float32)


def _yarn_ramp(cfg: ModelConfig) -> np.ndarray:
    """YaRN's blend weight `[D // 2]` float64 per frequency pair, HF's rule: pair i
    turns `r` times over the original context (`original_max_position_embeddings`)
    when i = D * log(original / (2 pi r)) / (2 log theta); the range runs from the
    pair turning `beta_fast` times to the one turning `beta_slow` times (rounded out
    to whole pairs with `truncate`; clipped to [0, D - 1], the head dim and not the
    D / 2 pairs, as HF clips it; a range of width 0 widened by 0.001), and the weight
    rises linearly across it."""
    rs, d = cfg.rope_scaling, cfg.head_dim

    def pair_turning(rotations: float) -> float:
        inv_of_inv_freq = rs.original_max_position_embeddings / (2 * math.pi * rotations)
        return d * math.log(inv_of_inv_freq) / (2 * math.log(cfg.rope_theta))

    low, high = pair_turning(rs.beta_fast), pair_turning(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    return np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor HF multiplies RoPE's cos and sin by (so q.k logits by its square):
    1 except with yarn scaling, where it is `attention_factor` if set, else
    m(mscale) / m(mscale_all_dim) when both are set and nonzero, else m(1), with
    m(s) = 0.1 * s * ln(factor) + 1 (and m = 1 for factor <= 1)."""
    rs = cfg.rope_scaling
    if rs is None or rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor

    def m(scale: float) -> float:
        return 1.0 if rs.factor <= 1 else 0.1 * scale * math.log(rs.factor) + 1.0

    if rs.mscale and rs.mscale_all_dim:
        return m(rs.mscale) / m(rs.mscale_all_dim)
    return m(1.0)


def apply_rope(x, positions, inv_freq, scale: float = 1.0):
    """Rotate-half RoPE, with cos and sin multiplied by `scale` (as HF's rotary
    embedding multiplies them by its attention scaling: `rope_attention_factor`).

    Args:
      x: [..., T, N, D] queries or keys (N heads).
      positions: [..., T] int absolute positions.
      inv_freq: [D // 2] float32.
      scale: a Python float; 1.0 leaves the rotation as it is.

    Returns:
      x rotated (and scaled), in x's dtype (computed in float32).
    """
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, D/2]
    cos = jnp.cos(angles)[..., None, :]  # [..., T, 1, D/2]
    sin = jnp.sin(angles)[..., None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
