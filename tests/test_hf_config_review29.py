"""Review 29 of config.json reading and ModelConfig's checks: numbers JSON allows but no
config means (Infinity, NaN) named by key; token ids checked as the Tokenizer checks
them (a float was truncated, a string split into digits); numpy counts kept as Python
ints and bools (a config holding them could not be written as config.json)."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_config_helpers import LLAMA31_8B

from pagedjax.config import PRESETS, ModelConfig
from pagedjax.orbax_checkpoint import config_to_json

MISTRAL = dict(LLAMA31_8B, architectures=["MistralForCausalLM"], model_type="mistral")


@pytest.mark.parametrize(
    "config, key",
    [
        (LLAMA31_8B, "max_position_embeddings"),
        (LLAMA31_8B, "num_hidden_layers"),
        (LLAMA31_8B, "bos_token_id"),
        (LLAMA31_8B, "head_dim"),
        (MISTRAL, "sliding_window"),
    ],
)
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_from_hf_names_a_count_that_is_not_finite(config, key, value):
    """Python's json reads `Infinity` and `NaN`; int() of them was a bare OverflowError
    ("cannot convert float infinity to integer") or ValueError naming no key."""
    with pytest.raises(ValueError, match=f"config.json: {key} must be an int, got {key}={value}"):
        ModelConfig.from_hf(json.loads(json.dumps({**config, key: value})))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(eos_token_ids=(2.7,)), r"eos_token_ids must be token ids \(ints\), got \(2.7,\)"),
        (dict(eos_token_ids="128001"), "eos_token_ids must be token ids .*got '128001'"),
        (dict(eos_token_ids=(True,)), r"got \(True,\)"),
        (dict(eos_token_ids=(2, None)), r"got \(2, None\)"),
        (dict(bos_token_id=1.5), r"bos_token_id must be a token id \(an int\) or None, got 1.5"),
        (dict(bos_token_id="1"), "bos_token_id must be .*, got '1'"),
        (dict(bos_token_id=True), "bos_token_id must be .*, got True"),
    ],
)
def test_token_ids_are_ints_not_truncated_or_split(changes, match):
    """EOS 2.7 was kept as 2, "128001" as (1, 2, 8, 0, 0, 1), True as 1; a BOS was not
    checked at all (1.5 and "1" reached to_hf's config.json as written)."""
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(PRESETS["tiny"], **changes)


def test_token_ids_take_numpy_ints_one_id_or_none():
    tiny = PRESETS["tiny"]
    cfg = dataclasses.replace(tiny, bos_token_id=np.int64(5), eos_token_ids=[np.int32(7), 9])
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (5, (7, 9))
    assert type(cfg.bos_token_id) is int and all(type(t) is int for t in cfg.eos_token_ids)
    # A JAX integer scalar (a token a model picked), as the Tokenizer takes it.
    picked = dataclasses.replace(tiny, eos_token_ids=(jnp.argmax(jnp.arange(4)),))
    assert picked.eos_token_ids == (3,) and type(picked.eos_token_ids[0]) is int
    # One id, as HF's eos_token_id and the Tokenizer take it ("'int' object is not iterable").
    assert dataclasses.replace(tiny, eos_token_ids=np.int64(3)).eos_token_ids == (3,)
    assert dataclasses.replace(tiny, eos_token_ids=None).eos_token_ids == ()


def test_numpy_counts_and_flags_are_kept_as_python_values():
    """A config built from numpy numbers (a sweep over shapes) kept np.int64 / np.bool_,
    which json.dumps refuses: to_hf's config.json (save_hf_checkpoint, after it had
    removed the directory's old weights) and orbax's stored config could not be written."""
    tiny = PRESETS["tiny"]
    ints = {
        f.name: np.int64(getattr(tiny, f.name))
        for f in dataclasses.fields(tiny)
        if type(getattr(tiny, f.name)) is int
    }
    flags = dict(tie_embeddings=np.bool_(True), qkv_bias=np.bool_(True), o_bias=np.bool_(True))
    cfg = dataclasses.replace(tiny, **ints, **flags)
    assert cfg == dataclasses.replace(tiny, tie_embeddings=True, qkv_bias=True, o_bias=True)
    for name in (*ints, *flags):
        assert type(getattr(cfg, name)) in (int, bool), name
    json.dumps(cfg.to_hf())
    json.dumps(config_to_json(cfg))
    assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


@pytest.mark.parametrize("name", ["tie_embeddings", "qkv_bias", "qk_norm"])
@pytest.mark.parametrize("value", ["false", 1, None])
def test_model_flags_must_be_bools(name, value):
    """A string "false" is true to Python: it built a model with the other layout."""
    with pytest.raises(ValueError, match=f"{name} must be a bool, got {name}={value!r}"):
        dataclasses.replace(PRESETS["tiny"], **{name: value})


@pytest.mark.parametrize("name", ["num_layers", "num_kv_heads", "head_dim", "vocab_size"])
def test_a_count_of_true_is_refused(name):
    """JSON's and Python's True is no count (CacheConfig refuses it too); it read as 1."""
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got {name}=True"):
        dataclasses.replace(PRESETS["tiny"], **{name: True})
