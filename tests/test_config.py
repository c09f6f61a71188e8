"""ModelConfig and CacheConfig: presets, validation, immutability."""

import dataclasses

import numpy as np
import pytest

from pagedjax.config import PRESETS, CacheConfig, preset


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads.*num_kv_heads=3"):
        dataclasses.replace(PRESETS["tiny"], num_kv_heads=3)


def test_configs_are_hashable_and_frozen():
    cfg = preset("tiny")
    assert hash(cfg) == hash(dataclasses.replace(cfg))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        preset("gpt5")


@pytest.mark.parametrize("page_size", [0, 3, 12, -4])
def test_cache_config_page_size_power_of_two(page_size):
    with pytest.raises(
        ValueError, match=f"page_size must be a power of two, got page_size={page_size}"
    ):
        CacheConfig(page_size=page_size)


def test_cache_config_validation():
    with pytest.raises(ValueError, match="num_pages must be a positive int, got num_pages=0"):
        CacheConfig(num_pages=0)
    with pytest.raises(ValueError, match="dtype must be one of .*got 'int8'"):
        CacheConfig(dtype="int8")
    assert CacheConfig(page_size=8, num_pages=4, dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="page_size must be a power of two, got page_size=True"):
        CacheConfig(page_size=True)  # not a page of 1 token
    with pytest.raises(ValueError, match="num_pages must be a positive int, got num_pages=True"):
        CacheConfig(num_pages=True)
    # numpy counts are kept as Python ints (a summary holding np.int64 broke json.dumps)
    c = CacheConfig(page_size=np.int32(8), num_pages=np.int64(4))
    assert (type(c.page_size), type(c.num_pages)) == (int, int) and c.num_slots == 32


@pytest.mark.parametrize("window", [0, -4, 2.5, True])
def test_sliding_window_must_be_a_positive_int(window):
    with pytest.raises(
        ValueError,
        match=f"sliding_window must be None or a positive int, got sliding_window={window!r}",
    ):
        dataclasses.replace(PRESETS["tiny"], sliding_window=window)


@pytest.mark.parametrize(
    "name, bad",
    [
        ("rope_theta", 1.0),
        ("rope_theta", 0),
        ("rope_theta", -1e4),
        ("rope_theta", float("nan")),
        ("rope_theta", float("inf")),
        ("rope_theta", "1e4"),
        ("rope_theta", True),
        ("norm_eps", -1e-6),
        ("norm_eps", float("nan")),
        ("norm_eps", None),
    ],
)
def test_rope_theta_and_norm_eps_are_checked(name, bad):
    """theta <= 1 would make RoPE's frequencies rise (and YaRN divide by log 1 = 0)."""
    with pytest.raises(ValueError, match=rf"{name} must be a number .*, got {name}={bad!r}"):
        dataclasses.replace(PRESETS["tiny"], **{name: bad})


def test_rope_theta_and_norm_eps_edges_are_kept_as_floats():
    cfg = dataclasses.replace(PRESETS["tiny"], rope_theta=2, norm_eps=0)
    assert (cfg.rope_theta, cfg.norm_eps) == (2.0, 0.0)
    assert type(cfg.rope_theta) is float and type(cfg.norm_eps) is float


def test_unexpressible_bias_mixes_are_refused_with_the_reason():
    tiny = PRESETS["tiny"]
    with pytest.raises(ValueError, match=r"o_bias needs qkv_bias: .* no family biases o_proj"):
        dataclasses.replace(tiny, o_bias=True)
    with pytest.raises(ValueError, match=r"with qk_norm \(Qwen3\) qkv_bias and o_bias must be"):
        dataclasses.replace(tiny, qk_norm=True, qkv_bias=True)
