"""pagedjax.hf_config's RoPE: rope_theta and the rope_scaling / rope_parameters dicts of
config.json (each form transformers 4 and 5 write), llama3, linear and yarn scaling read
as HF reads them, bad values refused by name, and round trips through to_hf and orbax
checkpoints' configs. The rest of config.json is tests/test_hf_config.py's.
"""

import dataclasses
import json
import math

import pytest
from hf_config_helpers import LLAMA31_8B, QWEN25_7B

from pagedjax.config import PRESETS, ModelConfig, RopeScaling


def test_from_hf_rope_parameters_form():
    d = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    d["rope_parameters"] = dict(LLAMA31_8B["rope_scaling"], rope_theta=500000.0)
    d["eos_token_id"] = 128001
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(
        "llama3",
        8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert cfg.eos_token_ids == (128001,)


def test_from_hf_default_rope_parameters_means_no_scaling():
    d = dict(LLAMA31_8B, rope_scaling=None)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    del d["rope_theta"]
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_unsupported_rope_scaling():
    d = dict(LLAMA31_8B, rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        ModelConfig.from_hf(d)


# --- rope scaling: linear and yarn (the math: tests/test_model.py) ------------------------


QWEN_YARN = RopeScaling("yarn", 4.0, original_max_position_embeddings=32768)


def yarn_config(max_pos=32768, **rope_scaling):
    return dict(QWEN25_7B, max_position_embeddings=max_pos, rope_scaling=rope_scaling)


def test_from_hf_reads_qwens_yarn():
    """The Qwen2.5 and Qwen3 cards' yarn: factor 4 over 32768 positions, HF's defaults for
    the rest, and 4 * 32768 positions served (vLLM's rule; max_position_embeddings is
    32768 in Qwen2.5's config.json and 40960 in Qwen3's)."""
    cfg = ModelConfig.from_hf(QWEN25_7B)
    assert cfg.rope_scaling == QWEN_YARN
    assert (cfg.rope_scaling.beta_fast, cfg.rope_scaling.beta_slow) == (32.0, 1.0)
    assert cfg.rope_scaling.truncate is True and cfg.rope_scaling.attention_factor is None
    assert cfg.max_position_embeddings == 131072
    # The factor is used as written, not max_position_embeddings / original (40960 /
    # 32768 = 1.25 for Qwen3; 1, no scaling at all, for Qwen2.5), as transformers 4.x
    # did until its PR #40320.
    qwen3 = yarn_config(40960, rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
    cfg3 = ModelConfig.from_hf(qwen3)
    assert cfg3.rope_scaling == QWEN_YARN and cfg3.max_position_embeddings == 131072
    # transformers 5's rope_parameters form (theta inside) reads the same.
    v5 = {k: v for k, v in qwen3.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = dict(qwen3["rope_scaling"], rope_theta=1e6)
    assert ModelConfig.from_hf(v5) == cfg3
    for c in (cfg, cfg3):
        assert ModelConfig.from_hf(c.to_hf()) == c


def test_from_hf_yarn_keys_and_defaults_as_hf_reads_them():
    # DeepSeek-V3's keys (mscale, mscale_all_dim, "type"); 4096 * 40 = 163840 positions.
    deepseek = yarn_config(
        163840, type="yarn", factor=40, original_max_position_embeddings=4096,
        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
    )  # fmt: skip
    cfg = ModelConfig.from_hf(deepseek)
    assert cfg.rope_scaling == RopeScaling(
        "yarn", 40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    assert cfg.max_position_embeddings == 163840
    # No original_max_position_embeddings: max_position_embeddings (HF standardizes it so);
    # a null factor: max_position_embeddings / original (transformers 5).
    no_original = ModelConfig.from_hf(yarn_config(8192, rope_type="yarn", factor=2.0))
    assert no_original.rope_scaling.original_max_position_embeddings == 8192
    assert no_original.max_position_embeddings == 16384
    null_factor = yarn_config(
        163840, rope_type="yarn", factor=None, original_max_position_embeddings=4096
    )
    assert ModelConfig.from_hf(null_factor).rope_scaling.factor == 40.0
    # gpt-oss's truncate: false, and an explicit attention_factor.
    explicit = yarn_config(
        rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
        truncate=False, attention_factor=1.2, beta_fast=16, beta_slow=2,
    )  # fmt: skip
    rs = ModelConfig.from_hf(explicit).rope_scaling
    assert (rs.truncate, rs.attention_factor, rs.beta_fast, rs.beta_slow) == (False, 1.2, 16, 2)


def test_from_hf_top_level_original_max_position_embeddings_wins_as_in_transformers_5():
    """transformers 5 (`standardize_rope_params`; 5.24 checked with
    scripts/check_hf_parity.py) gives a top-level original_max_position_embeddings (where
    Phi-3 keeps it) priority over rope_scaling's, for llama3 and yarn. It was ignored:
    another RoPE than HF's (logits 15% off on a tiny llama3 model over 256 positions)."""
    from_hf = ModelConfig.from_hf
    cfg = from_hf(dict(LLAMA31_8B, original_max_position_embeddings=4096))
    want = dataclasses.replace(
        PRESETS["llama3-8b"].rope_scaling, original_max_position_embeddings=4096
    )
    assert cfg.rope_scaling == want
    # Only at the top level: HF 5 reads it there.
    only_top = dict(LLAMA31_8B, original_max_position_embeddings=8192)
    only_top["rope_scaling"] = dict(LLAMA31_8B["rope_scaling"])
    del only_top["rope_scaling"]["original_max_position_embeddings"]
    assert from_hf(only_top) == from_hf(LLAMA31_8B)
    # yarn: it sets the ramp and the length served (16384 * 4).
    yarn = from_hf(dict(QWEN25_7B, original_max_position_embeddings=16384))
    assert yarn.rope_scaling == dataclasses.replace(
        QWEN_YARN, original_max_position_embeddings=16384
    )
    assert yarn.max_position_embeddings == 65536
    # null is absent; linear scaling reads no length.
    assert from_hf(dict(QWEN25_7B, original_max_position_embeddings=None)) == from_hf(QWEN25_7B)
    linear = dict(LLAMA31_8B, rope_scaling={"type": "linear", "factor": 2.0})
    assert from_hf(dict(linear, original_max_position_embeddings=4096)) == from_hf(linear)
    with pytest.raises(ValueError, match="original_max_position_embeddings must be a positive int"):
        from_hf(dict(QWEN25_7B, original_max_position_embeddings=0))


def test_yarn_mscale_counts_only_beside_mscale_all_dim():
    """HF's `_compute_yarn_parameters`: m(mscale) / m(mscale_all_dim) only when both are
    set and nonzero; an mscale alone leaves m(1) = 0.1 ln(factor) + 1 (the mscale=1 of
    tests/test_model.py's cases hides which is read)."""
    from pagedjax.rope import rope_attention_factor

    m1 = 0.1 * math.log(4.0) + 1
    for extra in ({"mscale": 2.0}, {"mscale": 2.0, "mscale_all_dim": 0}, {"mscale_all_dim": 2.0}):
        cfg = ModelConfig.from_hf(dict(QWEN25_7B, rope_scaling={**_YARN, **extra}))
        assert rope_attention_factor(cfg) == pytest.approx(m1, rel=1e-12), extra
    both = ModelConfig.from_hf(
        dict(QWEN25_7B, rope_scaling={**_YARN, "mscale": 2.0, "mscale_all_dim": 1.0})
    )
    assert rope_attention_factor(both) == pytest.approx((0.2 * math.log(4.0) + 1) / m1)


def test_from_hf_reads_linear_scaling():
    d = dict(LLAMA31_8B, max_position_embeddings=4096)
    d["rope_scaling"] = {"type": "linear", "factor": 4.0}  # e.g. vicuna-13b-v1.5-16k
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_scaling == RopeScaling("linear", 4.0)
    assert cfg.max_position_embeddings == 4096  # as written: HF reads no length from it
    assert cfg.to_hf()["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize(
    "rope_scaling, match",
    [
        ({"rope_type": "yarn"}, r"rope scaling 'yarn' needs \['factor'\]"),
        ({"type": "linear"}, r"rope scaling 'linear' needs \['factor'\]"),
        (
            dict(_YARN, original_max_position_embeddings=None),
            r"needs \['original_max_position_embeddings'\]",
        ),
        (dict(_YARN, factor=0), "factor must be a positive number, got factor=0"),
        ({"type": "linear", "factor": -2.0}, "got factor=-2.0"),
        (dict(_YARN, factor="4"), "factor must be a positive number, got factor='4'"),
        (dict(_YARN, factor=True), "got factor=True"),
        (dict(_YARN, factor=10**400), "factor must be a positive number"),  # OverflowError
        (
            dict(_YARN, original_max_position_embeddings=0),
            "original_max_position_embeddings must be a positive int, got "
            "original_max_position_embeddings=0",
        ),
        (
            dict(_YARN, beta_fast=1, beta_slow=32),
            "beta_fast must be at least beta_slow, got beta_fast=1.0, beta_slow=32.0",
        ),
        (dict(_YARN, beta_slow=0), "beta_slow must be a positive number, got beta_slow=0"),
        (dict(_YARN, truncate="false"), "truncate must be a bool, got truncate='false'"),
        (dict(_YARN, attention_factor=0.0), "got attention_factor=0.0"),
        (dict(_YARN, mscale=-1), "mscale must be a number >= 0, got mscale=-1"),
        (dict(_YARN, rope_type="dynamic"), "unsupported rope scaling type 'dynamic'"),
    ],
)
def test_from_hf_refuses_bad_rope_scaling_by_name(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(dict(QWEN25_7B, rope_scaling=rope_scaling))


@pytest.mark.parametrize(
    "rope_scaling, extra",
    [
        (_YARN, dict(finetuned=True, low_freq_factor=1.0)),  # NousResearch Yarn-Llama's
        ({"type": "linear", "factor": 2.0}, dict(original_max_position_embeddings=4096)),
    ],
)
def test_from_hf_ignores_rope_keys_the_kind_does_not_read(rope_scaling, extra):
    """HF warns and ignores them, so its model is the one without them: so is ours."""
    plain = ModelConfig.from_hf(dict(QWEN25_7B, rope_scaling=rope_scaling))
    more = ModelConfig.from_hf(dict(QWEN25_7B, rope_scaling={**rope_scaling, **extra}))
    assert more == plain and plain.rope_scaling is not None


_ROUND_TRIP = {
    "llama3": PRESETS["llama3-8b"].rope_scaling,
    "linear": RopeScaling("linear", 2.0),
    "yarn": RopeScaling("yarn", 4.0, original_max_position_embeddings=128),
    "yarn_every_option": RopeScaling(
        "yarn", 8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2,
        mscale=1.0, mscale_all_dim=0.5, attention_factor=1.3, truncate=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_ROUND_TRIP))
def test_rope_scaling_round_trips_through_hf_and_orbax_configs(name):
    from pagedjax.orbax_checkpoint import config_from_json, config_to_json

    cfg = dataclasses.replace(PRESETS["tiny"], rope_scaling=_ROUND_TRIP[name])
    hf = json.loads(json.dumps(cfg.to_hf()))
    assert hf["rope_scaling"]["rope_type"] == name.split("_")[0]
    assert None not in hf["rope_scaling"].values()  # only the kind's own parameters
    assert ModelConfig.from_hf(hf) == cfg
    assert config_from_json(json.loads(json.dumps(config_to_json(cfg)))) == cfg


def test_orbax_configs_saved_before_other_kinds_load_as_llama3():
    from pagedjax.orbax_checkpoint import config_from_json, config_to_json

    cfg = PRESETS["llama3-8b"]
    old = config_to_json(cfg)
    old["rope_scaling"] = {  # what version 1 stored: RopeScaling's four llama3 fields
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config_from_json(old) == cfg
    old["rope_scaling"]["smooth"] = 1.0
    with pytest.raises(ValueError, match=r"unknown RopeScaling fields \['smooth'\]"):
        config_from_json(old)


def test_rope_scaling_fields_are_checked_per_kind():
    assert RopeScaling("yarn", 4, original_max_position_embeddings=64) == RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
        truncate=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"'linear' takes only \['factor'\], got beta_fast=32"):
        RopeScaling("linear", 2.0, beta_fast=32)
    with pytest.raises(ValueError, match=r"'llama3' needs \['original_max_position_embeddings'"):
        RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match="high_freq_factor must exceed low_freq_factor"):
        RopeScaling(
            "llama3", 8.0, low_freq_factor=4.0, high_freq_factor=1.0,
            original_max_position_embeddings=8192,
        )  # fmt: skip
    with pytest.raises(ValueError, match="rope_type must be one of .*got rope_type='ntk'"):
        RopeScaling("ntk", 2.0)
    with pytest.raises(ValueError, match="rope_scaling must be a RopeScaling or None"):
        dataclasses.replace(PRESETS["tiny"], rope_scaling={"rope_type": "linear", "factor": 2})


# --- what transformers 5 reads, checked with transformers 5.24's config classes -----------


def test_from_hf_reads_one_rope_dict_as_transformers_5_does():
    """HF 5 (`convert_rope_params_to_dict`) takes `rope_scaling` if set, else
    `rope_parameters`, and that dict's rope_theta wins over the top-level key. Configs
    saved by some transformers 4.x releases keep theta only there: Qwen3's
    `"rope_scaling": {"rope_theta": 1e6, "rope_type": "default"}` ran at theta 10000."""
    base = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    nested = dict(base, rope_scaling={"rope_theta": 1e6, "rope_type": "default"})
    assert ModelConfig.from_hf(nested).rope_theta == 1e6
    assert ModelConfig.from_hf(dict(nested, rope_theta=500.0)).rope_theta == 1e6
    # A null top-level theta beside the dict's (how such configs often write it).
    v5 = dict(base, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert ModelConfig.from_hf(v5).rope_theta == 1e6
    # Both dicts: rope_scaling replaces rope_parameters whole, its theta included.
    both = dict(
        base,
        rope_theta=5e5,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
    )
    cfg = ModelConfig.from_hf(both)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, RopeScaling("linear", 2.0))
    default_over = dict(both, rope_scaling={"rope_type": "default"})
    cfg = ModelConfig.from_hf(default_over)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, None)
    # HF's rope_type wins over the older type key where a dict has both.
    both_types = {"rope_type": "linear", "type": "dynamic", "factor": 2.0}
    assert ModelConfig.from_hf(dict(base, rope_scaling=both_types)).rope_scaling.factor == 2.0
    # partial_rotary_factor is read from that dict too, so refused there.
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        ModelConfig.from_hf(
            dict(nested, rope_scaling={**nested["rope_scaling"], "partial_rotary_factor": 0.5})
        )
    with pytest.raises(ValueError, match="rope_scaling must be an object, got rope_scaling='yarn'"):
        ModelConfig.from_hf(dict(base, rope_scaling="yarn"))
