"""pagedjax.rope against HF transformers' `modeling_rope_utils` over random configs, and at
long positions; and what `from_hf` refuses in a RoPE dict. The oracle below is written
from HF's formulas (`_compute_default_rope_parameters`, `_compute_linear_scaling_...`,
`_compute_llama3_parameters`, `_compute_yarn_parameters` with `truncate`, `mscale`,
`mscale_all_dim` and `attention_factor`) on HF's own dict, in float64. `rope_frequencies`
rounds those values to float32; HF computes them in float32 arithmetic, a few ulps away
on real configs (at most 3 for Llama 3.1's llama3 and Qwen2.5's yarn), which moves the
angle p * inv_freq less than the angle's own float32 rounding (HF's and ours) does at
long positions. numpy only, besides one small eager `apply_rope`: no model compiles.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
from hf_config_helpers import LLAMA31_8B, QWEN25_7B

from pagedjax.config import PRESETS, ModelConfig, RopeScaling
from pagedjax.rope import apply_rope, rope_attention_factor, rope_frequencies


def hf_rope(theta: float, d: int, rope: dict | None) -> tuple[np.ndarray, float]:
    """(inv_freq [d // 2], attention factor) as HF computes them from a standardized RoPE
    dict (`rope_type` set, llama3 / yarn with `original_max_position_embeddings`)."""
    pos_freqs = theta ** (np.arange(0, d, 2) / d)
    inv = 1 / pos_freqs
    kind = None if rope is None else rope["rope_type"]
    if kind is None:
        return inv, 1.0
    factor = rope["factor"]
    if kind == "linear":
        return inv / factor, 1.0
    old = rope["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        llama = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, llama), 1.0
    assert kind == "yarn"

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(rope.get("beta_fast") or 32)
    high = correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    extrapolation = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    interpolation = 1 / (factor * pos_freqs)
    return interpolation * (1 - extrapolation) + inv * extrapolation, attention


def random_rope(rng: np.random.Generator) -> dict | None:
    """A random HF RoPE dict of a kind we support (or None), over wide parameter ranges."""
    kind = rng.choice(["none", "linear", "llama3", "yarn"])
    factor = float(10 ** rng.uniform(-1, 2))
    old = int(10 ** rng.uniform(0, 6))
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "llama3":
        low = float(rng.uniform(0.1, 4))
        return {
            "rope_type": "llama3", "factor": factor, "original_max_position_embeddings": old,
            "low_freq_factor": low, "high_freq_factor": low + float(rng.uniform(0.01, 8)),
        }  # fmt: skip
    slow = float(rng.uniform(0.1, 4))
    rope = {
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": old,
        "beta_slow": slow, "beta_fast": slow + float(rng.uniform(0, 64)),
        "truncate": bool(rng.integers(2)),
    }  # fmt: skip
    which = rng.integers(4)  # none, attention_factor, mscale, both mscales (0 included)
    if which == 1:
        rope["attention_factor"] = float(rng.uniform(0.1, 3))
    if which >= 2:
        rope["mscale"] = float(rng.choice([0.0, rng.uniform(0.1, 2)]))
    if which == 3:
        rope["mscale_all_dim"] = float(rng.choice([0.0, rng.uniform(0.1, 2)]))
    return rope


def test_rope_matches_hf_formulas_over_random_configs():
    """500 configs: head dims powers of two and not, theta 1.3 to 3e7, factors 0.1 to 100,
    original lengths 1 to 1e6 (so yarn's range clipped at either end, or empty)."""
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(500):
        d = int(rng.choice([2, 8, 16, 64, 80, 96, 128, 192, 256]))
        theta = float(10 ** rng.uniform(0.1, 7.5))
        rope = random_rope(rng)
        rs = None
        if rope is not None:
            params = {k: v for k, v in rope.items() if k != "rope_type"}
            rs = RopeScaling(rope["rope_type"], **params)
        cfg = dataclasses.replace(PRESETS["tiny"], head_dim=d, rope_theta=theta, rope_scaling=rs)
        want, attention = hf_rope(theta, d, rope)
        got = rope_frequencies(cfg)
        assert got.dtype == np.float32 and got.shape == (d // 2,)
        # float32 rounding of the float64 value: half an ulp, 2**-24 relative.
        np.testing.assert_allclose(got, want, rtol=7e-8, atol=0, err_msg=f"{d=} {theta=} {rope}")
        assert rope_attention_factor(cfg) == pytest.approx(attention, rel=1e-12), rope
        seen.add(rope and rope["rope_type"])
    assert seen == {None, "linear", "llama3", "yarn"}


@pytest.mark.parametrize("config", [LLAMA31_8B, QWEN25_7B], ids=["llama3", "yarn"])
def test_from_hf_rope_matches_hf_with_head_dim_not_hidden_over_heads(config):
    """A head_dim key unlike hidden_size // heads (128 here) sets the rotated dims, as in
    HF (`getattr(config, "head_dim")`)."""
    config = dict(config, head_dim=96)
    rope = dict(config["rope_scaling"])
    rope["rope_type"] = rope.pop("type", rope.get("rope_type"))
    cfg = ModelConfig.from_hf(config)
    want, attention = hf_rope(config["rope_theta"], 96, rope)
    np.testing.assert_allclose(rope_frequencies(cfg), want, rtol=7e-8, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(attention, rel=1e-12)


def test_apply_rope_at_long_positions_matches_hfs_float32_angles():
    """HF rotates by cos and sin (float32) of the float32 product inv_freq * position; so
    does `apply_rope`, and XLA's float32 cos / sin stay accurate for the large angles
    (to 1.6e7 rad) that positions up to 2**24 - 1, the last float32 represents exactly,
    give. The angle's float32 rounding itself (up to 1 rad at 2**24) is HF's too."""
    cfg = ModelConfig.from_hf(LLAMA31_8B)
    inv = rope_frequencies(cfg)  # [64]
    positions = np.array([0, 8191, 131071, 1_000_000, 4_194_305, 2**24 - 1], np.int32)
    x = np.random.default_rng(1).normal(size=(len(positions), 2, 128)).astype(np.float32)
    angles = (positions.astype(np.float32)[:, None] * inv).astype(np.float64)  # float32 product
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # [T, 1, D/2]
    x1, x2 = x[..., :64].astype(np.float64), x[..., 64:].astype(np.float64)
    want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv, 1.25))
    np.testing.assert_allclose(got, 1.25 * want, rtol=0, atol=3e-6)


@pytest.mark.parametrize(
    "rope_scaling, match",
    [
        # Kinds we do not implement, by either key, refused by name (never read as none).
        ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope scaling type 'dynamic'"),
        ({"type": "su", "short_factor": [1.0], "long_factor": [1.0]}, "type 'su'"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "'longrope'"),
        ({"rope_type": "YaRN", "factor": 4.0}, "unsupported rope scaling type 'YaRN'"),
        ({"rope_type": None, "factor": 4.0}, "unsupported rope scaling type None"),
        ({"rope_type": ["yarn"], "factor": 4.0}, r"unsupported rope scaling type \['yarn'\]"),
        # Bad values, named.
        (dict(LLAMA31_8B["rope_scaling"], factor=0), "factor must be a positive number, got"),
        (dict(LLAMA31_8B["rope_scaling"], factor=float("nan")), "got factor=nan"),
        (dict(LLAMA31_8B["rope_scaling"], low_freq_factor=0), "got low_freq_factor=0"),
        (
            dict(LLAMA31_8B["rope_scaling"], high_freq_factor=1.0),
            "high_freq_factor must exceed low_freq_factor, got high_freq_factor=1.0, "
            "low_freq_factor=1.0",
        ),
        (
            dict(LLAMA31_8B["rope_scaling"], original_max_position_embeddings=None),
            r"'llama3' needs \['original_max_position_embeddings'\]",
        ),
        (
            {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 0},
            "original_max_position_embeddings must be a positive int, got "
            "original_max_position_embeddings=0",
        ),
    ],
)
def test_from_hf_refuses_unsupported_or_bad_rope_by_name(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(dict(LLAMA31_8B, rope_scaling=rope_scaling))


def test_from_hf_yarn_null_factor_with_a_float_original_length():
    """HF 5 takes a null yarn factor as max_position_embeddings / original, whatever
    number type JSON gave the original; 4096.0 was refused as "needs ['factor']"."""
    rope = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096.0}
    cfg = ModelConfig.from_hf(dict(QWEN25_7B, max_position_embeddings=163840, rope_scaling=rope))
    assert cfg.rope_scaling == RopeScaling("yarn", 40.0, original_max_position_embeddings=4096)


def test_from_hf_refuses_partial_rotary_wherever_hf_reads_it():
    for where in ("top", "dict"):
        config = dict(LLAMA31_8B, rope_scaling=dict(LLAMA31_8B["rope_scaling"]))
        target = config if where == "top" else config["rope_scaling"]
        target["partial_rotary_factor"] = 0.25
        with pytest.raises(ValueError, match="unsupported partial_rotary_factor=0.25"):
            ModelConfig.from_hf(config)
