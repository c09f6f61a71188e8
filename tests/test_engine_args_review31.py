"""Review 31 of the engine's construction arguments (`pagedjax.engine_args`, the page
planner, `resources`, the scheduler's limits): numpy ints for the scheduler's limits,
`dtype` on the random fallback without a demo model, and `dtype` / `kv_cache_dtype`
checked before any weight loads."""

import numpy as np
import pytest

from pagedjax import demo, engine
from pagedjax.config import PRESETS

TINY = PRESETS["tiny"]  # float32, 512 positions
ENGINE = dict(backend="xla", page_size=8, num_pages=64, max_num_seqs=8)


def _no_load(*args, **kw):
    raise AssertionError("the model was loaded before the arguments were checked")


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens"])
def test_numpy_int_scheduler_limits_are_taken(name):
    """`LLM(max_num_seqs=np.int64(8))` (a value from a numpy sweep) was refused with
    "max_num_seqs must be a positive int, got max_num_seqs=np.int64(8)", though
    page_size, num_pages, max_model_len, seed and tensor_parallel all take numpy ints
    (tests/test_api_validation.py's numpy cases)."""
    kw = ENGINE | {name: np.int64(ENGINE.get(name, 1024))}
    llm = engine.LLM(TINY, **kw)
    assert llm.scheduler.max_num_seqs == 8


def test_dtype_applies_to_the_random_fallback_without_a_demo_model(monkeypatch):
    """Without the demo model, `LLM(dtype="float16")` ran the tiny preset in float32 (its
    own dtype), and `LLM(dtype="garbage")` was accepted: `load_model(None, dtype=...)`
    drops `dtype` on that path, where every other source applies it."""

    def missing():
        raise FileNotFoundError("no demo model (test)")

    monkeypatch.setattr(demo, "demo_model_dir", missing)
    with pytest.warns(UserWarning, match="random weights"):
        llm = engine.LLM(None, dtype="float16", **ENGINE)
    assert llm.config.dtype == "float16"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dtype="garbage"), "got 'garbage'"),
        # The demo model is bfloat16: a float32 cache is refused by model_limits, after
        # every weight of the checkpoint has been read.
        (dict(kv_cache_dtype="float32"), "kv_cache_dtype='float32'"),
    ],
)
def test_dtype_and_kv_dtype_are_named_before_the_model_loads(kwargs, match, monkeypatch):
    monkeypatch.setattr(engine, "load_model", _no_load)
    with pytest.raises(ValueError, match=match):
        engine.LLM(str(demo.demo_model_dir()), **(ENGINE | kwargs))
