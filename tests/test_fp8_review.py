"""`LLM(kv_cache_dtype=...)` against vLLM's values: which names and model dtypes it takes.

vLLM's `kv_cache_dtype` is "auto" (the model's dtype), "bfloat16", "fp8" or "fp8_e4m3"
(float8_e4m3fn pages; pagedjax stores them unscaled, vLLM's default k_scale = v_scale = 1)
or "fp8_e5m2" and a few backend-specific ones; pagedjax takes "auto", the FP8 names
for float8_e4m3fn, and the model's own dtype by name. Anything else must be refused
while the engine is built, naming the argument, not by every later step.
"""

import dataclasses

import jax.numpy as jnp
import params_helpers
import pytest

from pagedjax.config import PRESETS
from pagedjax.engine import LLM

TINY = dataclasses.replace(PRESETS["tiny"], num_layers=1)  # float32
GEOMETRY = dict(page_size=8, num_pages=16, backend="xla", max_num_seqs=4)


@pytest.fixture(scope="module")
def f32_params():
    return params_helpers.random_params(TINY, 0)


@pytest.mark.parametrize("name", ["bfloat16", "bf16", "float16", "fp16"])
def test_a_cache_dtype_the_model_cannot_read_is_refused_when_built(f32_params, name):
    # It was taken, the cache allocated, and then every step raised TypeError
    # ("a bfloat16 cache for a float32 model"): the engine could serve nothing.
    with pytest.raises(ValueError, match=r"kv_cache_dtype='(bfloat16|float16)'.*float32 model"):
        LLM(f32_params, kv_cache_dtype=name, **GEOMETRY)


def test_a_float32_cache_for_a_bfloat16_model_is_refused():
    bf16 = params_helpers.random_params(dataclasses.replace(TINY, dtype="bfloat16"), 0)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float32'.*bfloat16 model"):
        LLM(bf16, kv_cache_dtype="float32", **GEOMETRY)


def test_the_model_dtype_by_name_and_the_fp8_names_are_taken(f32_params):
    for name, want in (
        ("auto", jnp.float32),
        ("float32", jnp.float32),
        ("fp8", jnp.float8_e4m3fn),
        ("fp8_e4m3", jnp.float8_e4m3fn),
        (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    ):
        assert LLM(f32_params, kv_cache_dtype=name, **GEOMETRY).cache.dtype == want


@pytest.mark.parametrize(
    "bad", ["fp8_e5m2", "fp8_e4m3fnuz", "int8", "fp8_inc", "FP8", "", None, 8, jnp.int8]
)
def test_an_unknown_kv_cache_dtype_is_named_before_loading(monkeypatch, bad):
    # The message said "dtype must be one of [...]": LLM has a `dtype` argument too, and
    # neither "auto" nor "fp8" was in the list; an int or a non-float dtype raised
    # numpy's TypeError.
    def boom(*args, **kwargs):
        raise AssertionError("loaded the model before checking kv_cache_dtype")

    monkeypatch.setattr("pagedjax.engine.load_model", boom)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be 'auto', 'fp8'") as e:
        LLM(TINY, kv_cache_dtype=bad, **GEOMETRY)
    assert str(e.value).endswith(f"got {bad!r}")
