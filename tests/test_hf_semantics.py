"""config.json read as HuggingFace transformers (5.x) reads it, in the cases a review of
`pagedjax.hf_config` against HF's source found read differently. Each expectation comes
from that source (`modeling_rope_utils`, the Mistral / Qwen2 / Qwen3 modules); the RoPE
numbers are computed here in numpy from HF's formulas and the raw config dict, not from
our RopeScaling."""

import math

import numpy as np
import pytest
from hf_config_helpers import LLAMA31_8B, QWEN25_7B

from pagedjax.config import ModelConfig
from pagedjax.rope import rope_frequencies

MISTRAL = dict(
    LLAMA31_8B, architectures=["MistralForCausalLM"], model_type="mistral", rope_scaling=None,
    rope_theta=10000.0, max_position_embeddings=32768, sliding_window=4096,
)  # fmt: skip
QWEN2 = dict(QWEN25_7B, model_type="qwen2", rope_scaling=None)
QWEN3 = dict(QWEN2, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128)


def hf_yarn_inv_freq(config: dict) -> np.ndarray:
    """HF's `_compute_yarn_parameters` on a config.json dict, in float64."""
    rope = config["rope_scaling"]
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base, factor = config["rope_theta"], rope["factor"]
    original = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    truncate = rope.get("truncate", True)

    def correction_dim(rotations):
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, d, 2) / d)
    return (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


def hf_llama3_inv_freq(config: dict) -> np.ndarray:
    """HF's `_compute_llama3_parameters` after `standardize_rope_params`, which sets an
    absent `original_max_position_embeddings` to `max_position_embeddings`."""
    rope = config["rope_scaling"]
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv = 1 / config["rope_theta"] ** (np.arange(0, d, 2) / d)
    factor, low_f, high_f = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    llama = np.where(wavelen > old / low_f, inv / factor, inv)
    smooth = (old / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < old / high_f) & ~(wavelen > old / low_f)
    return np.where(medium, smoothed, llama)


def test_mistral_slides_whatever_use_sliding_window_says():
    """HF's MistralConfig has no `use_sliding_window` and MistralAttention passes
    `config.sliding_window` on every layer; a Mistral config.json carrying
    `use_sliding_window: false` (as Qwen-derived exports write it) still slides in HF.
    It loaded with no window: full attention past 4096 tokens."""
    off = dict(MISTRAL, use_sliding_window=False)
    assert ModelConfig.from_hf(off).sliding_window == 4096
    assert ModelConfig.from_hf(off) == ModelConfig.from_hf(MISTRAL)
    # The Qwen families read the flag, and a Llama slides nowhere in HF either way.
    qwen = dict(QWEN2, sliding_window=4096, max_window_layers=0)
    assert ModelConfig.from_hf(dict(qwen, use_sliding_window=True)).sliding_window == 4096
    assert ModelConfig.from_hf(dict(qwen, use_sliding_window=False)).sliding_window is None


def test_yarn_null_truncate_does_not_truncate():
    """HF reads `rope_parameters.get("truncate", True)`: an explicit null is falsy, so the
    correction range is not rounded out to whole pairs (it was read as True)."""
    config = dict(
        QWEN25_7B, head_dim=64, rope_theta=150000.0, max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 32.0,
                      "original_max_position_embeddings": 4096, "truncate": None},
    )  # fmt: skip
    cfg = ModelConfig.from_hf(config)
    assert cfg.rope_scaling.truncate is False
    want = hf_yarn_inv_freq(config)
    rounded = hf_yarn_inv_freq(dict(config, rope_scaling={**config["rope_scaling"], "truncate": 1}))
    assert not np.allclose(want, rounded, rtol=1e-4)  # the case tells the two apart
    np.testing.assert_allclose(rope_frequencies(cfg), want, rtol=1e-6)
    # Absent is True, as before.
    absent = dict(config, rope_scaling={k: v for k, v in config["rope_scaling"].items()
                                        if k != "truncate"})  # fmt: skip
    cfg_absent = ModelConfig.from_hf(absent)
    assert cfg_absent.rope_scaling.truncate is True
    np.testing.assert_allclose(rope_frequencies(cfg_absent), rounded, rtol=1e-6)


def test_llama3_without_original_max_position_embeddings_reads_max_position_embeddings():
    """transformers 5's `standardize_rope_params` sets an absent
    `original_max_position_embeddings` to `max_position_embeddings` for llama3 as for
    yarn; it was refused for llama3 only."""
    rope = {k: v for k, v in LLAMA31_8B["rope_scaling"].items()}
    del rope["original_max_position_embeddings"]
    config = dict(LLAMA31_8B, max_position_embeddings=16384, rope_scaling=rope)
    cfg = ModelConfig.from_hf(config)
    assert cfg.rope_scaling.original_max_position_embeddings == 16384
    assert cfg.max_position_embeddings == 16384
    np.testing.assert_allclose(rope_frequencies(cfg), hf_llama3_inv_freq(config), rtol=1e-6)
    # A null is not absent: HF keeps it (and fails); refused by name here.
    with pytest.raises(ValueError, match=r"needs \['original_max_position_embeddings'\]"):
        ModelConfig.from_hf(
            dict(config, rope_scaling={**rope, "original_max_position_embeddings": None})
        )


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_per_layer_type_rope_dicts_are_refused(key):
    """transformers 5 keys RoPE parameters by layer type for hybrid models
    (`{"full_attention": {...}, "sliding_attention": {...}}`). None of the supported
    families implements that (HF's Qwen2/Qwen3 fail on it); it was read as no scaling at
    the top-level (or default) theta: another model, silently."""
    base = {k: v for k, v in QWEN3.items() if k not in ("rope_scaling", "rope_theta")}
    per_layer = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    with pytest.raises(ValueError, match=rf"{key}.*per layer type.*'full_attention'"):
        ModelConfig.from_hf(dict(base, **{key: per_layer}))


@pytest.mark.parametrize(
    "family, arch",
    [
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("mistral", "MistralForCausalLM"),
    ],
)
def test_mlp_bias_is_unread_where_hf_hard_codes_no_bias(family, arch):
    """Qwen2MLP, Qwen3MLP and MistralMLP build their projections with bias=False whatever
    `mlp_bias` says (as their attention ignores `attention_bias`); only LlamaMLP reads it.
    A checkpoint that does carry MLP biases still fails to load (unexpected tensors)."""
    config = dict(LLAMA31_8B, architectures=[arch], model_type=family)
    assert ModelConfig.from_hf(dict(config, mlp_bias=True)) == ModelConfig.from_hf(config)
    with pytest.raises(ValueError, match="mlp_bias=True"):
        ModelConfig.from_hf(dict(LLAMA31_8B, mlp_bias=True))
