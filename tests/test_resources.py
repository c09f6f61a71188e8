"""`resources.load_model`: each kind of LLM source, and the dtype override on each."""

import numpy as np
import pytest

from pagedjax import model, resources
from pagedjax.config import PRESETS


def test_given_params_are_cast_to_the_dtype_asked_for():
    params = model.init_params(PRESETS["tiny"], seed=3)  # float32 weights
    cfg, cast, _, desc = resources.load_model(params, dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and cast.config == cfg and "cast to bfloat16" in desc
    flat, before = model.params_to_flat(cast), model.params_to_flat(params)
    assert {str(a.dtype) for a in flat.values()} == {"bfloat16"}
    for key, value in before.items():  # the same weights, rounded
        want = np.asarray(value.astype("bfloat16"), np.float32)
        np.testing.assert_array_equal(np.asarray(flat[key], np.float32), want)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 9))
    logits32, logits16 = model.forward(params, tokens), model.forward(cast, tokens)
    err = np.linalg.norm(logits16 - logits32) / np.linalg.norm(logits32)
    assert 0 < err < 3e-2  # computed in bfloat16: close, not equal
    same = resources.load_model(params, dtype="float32")
    assert same[1] is params and same[3] == "given params"
    assert resources.load_model(params)[1] is params


def test_a_bad_dtype_for_given_params_is_named():
    with pytest.raises(ValueError, match="int8"):
        resources.load_model(model.init_params(PRESETS["tiny"], seed=3), dtype="int8")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_size=0), "page_size=0"),  # was a ZeroDivisionError
        (dict(max_num_seqs=0), "max_num_seqs=0"),  # blamed kv_memory_fraction
        (dict(max_model_len=-3), "max_model_len=-3"),
        (dict(page_size=True), "page_size=True"),
        (dict(kv_memory_fraction=1.5), "kv_memory_fraction=1.5"),
    ],
)
def test_plan_num_pages_names_a_bad_size(kwargs, match):
    args = dict(page_size=16, kv_memory_fraction=0.5, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        resources.plan_num_pages(PRESETS["tiny"], **(args | kwargs))
    assert resources.plan_num_pages(PRESETS["tiny"], **args) == 16  # 4 x 64 tokens / 16
