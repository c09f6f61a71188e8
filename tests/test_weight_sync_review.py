"""Review of `LLM.update_params` (`pagedjax.weight_sync.place_params`): weights it used to
take that broke a promise, and weights it refused without saying why. A weak-typed
array (`jnp.full`'s) compiled new programs; finite values that float16 makes inf went
into a float16 engine (loading a checkpoint refuses them); a dropped engine's
`ShapeDtypeStruct`s failed inside `jax.device_put`, naming no parameter; HF tensor
names were refused without saying what they are. A refused update keeps the old
weights and the prefix cache. The tiny preset, XLA (engine_helpers' geometry)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import GEOMETRY, compiles, greedy, greedy_ids
from engine_helpers import UPDATE_PROMPTS as PROMPTS

from pagedjax import model, weights
from pagedjax.engine import LLM

KEY = "layers.0.mlp.up_proj.kernel"


def test_weak_typed_weights_compile_no_new_programs(old, new, want):
    llm = LLM(old, **GEOMETRY)
    greedy_ids(llm)
    # `jnp.full(shape, 0.0)` is weak-typed float32, and so is what `.at[].set` makes of it.
    weak = {k: jnp.full(v.shape, 0.0).at[...].set(v) for k, v in model.params_to_flat(new).items()}
    assert all(x.weak_type for x in weak.values())
    before = compiles()
    llm.update_params(weak)
    assert not any(x.weak_type for x in jax.tree.leaves(llm.params))
    assert greedy_ids(llm) == want["new"]
    assert compiles() == before


def refused(llm, given, match):
    """`update_params(given)` raises ValueError(`match`) and keeps the weights (the same
    arrays) and the prefix cache."""
    leaves, cached = jax.tree.leaves(llm.params), llm.block_manager.stats().num_cached_pages
    with pytest.raises(ValueError, match=match):
        llm.update_params(given)
    assert all(a is b for a, b in zip(jax.tree.leaves(llm.params), leaves, strict=True))
    assert llm.block_manager.stats().num_cached_pages == cached


def test_values_float16_cannot_hold_are_refused_by_name(old, new):
    llm = LLM(old, dtype="float16", **GEOMETRY)
    # All float16 but KEY (an array of another dtype is checked, by a program per shape).
    flat = {k: v.astype(jnp.float16) for k, v in model.params_to_flat(new).items()}
    # Two values float16 cannot hold, exact in bfloat16 too.
    big = model.params_to_flat(new)[KEY].at[0, :2].set(jnp.array([2.0**17, -(2.0**16)]))
    on_host = jax.device_put(big, big.sharding.with_memory_kind("pinned_host"))
    for x in (big, on_host, np.asarray(big), np.asarray(big, jnp.bfloat16)):
        match = rf"{KEY}: 2 values beyond float16's range, up to \|x\| = 1.311e\+05"
        refused(llm, flat | {KEY: x}, match)
    # Infinities stay infinities (as a checkpoint's), and float16's largest value fits.
    llm.update_params(flat | {KEY: big.at[0, :2].set(jnp.array([jnp.inf, 65504.0]))})
    kernel = np.asarray(model.params_to_flat(llm.params)[KEY], np.float32)
    assert kernel[0, 0] == np.inf and kernel[0, 1] == 65504.0


def test_a_dropped_engines_shapes_are_refused_by_name(old):
    llm = LLM(old, **GEOMETRY)
    llm.sleep(level=2)
    refused(llm, llm.params, r"embed_tokens.embedding: a ShapeDtypeStruct, which holds no values")
    llm.wake_up()
    with pytest.raises(RuntimeError, match=r"dropped \(sleep\(level=2\)\)"):
        llm.generate(PROMPTS, greedy(2))


def test_hf_tensor_names_are_said_to_be_hf_names(old, new, want):
    llm = LLM(old, **GEOMETRY)
    assert greedy_ids(llm) == want["old"]
    hf = {}
    for path, x in model.params_to_flat(new).items():
        name, transpose = weights.path_to_hf(path)
        hf[name] = x.T if transpose else x
    refused(llm, hf, r"'lm_head.weight' is an HF tensor name: .*weights.hf_to_path")
    # Mapped as the hint says, they are the new weights.
    ours = {}
    for name, x in hf.items():
        path, transpose = weights.hf_to_path(name)
        ours[path] = x.T if transpose else x
    llm.update_params(ours)
    assert greedy_ids(llm) == want["new"]


def test_an_aborted_last_requests_step_in_flight_does_not_block_sleep_or_updates(old, new, want):
    """`abort` of the last request left its dispatched step in flight (async scheduling):
    `sleep` and `update_params` refused with "0 are queued or running". That step holds
    nothing anyone waits for; it is completed instead, and the engine serves after."""
    from pagedjax.engine import SamplingParams

    llm = LLM(old, **GEOMETRY)
    for call in (lambda: llm.sleep(), lambda: llm.update_params(new)):
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=20), request_id="r")
        llm.step()
        llm.step()
        assert llm.core.inflight is not None  # (the case: a step dispatched, not applied)
        llm.abort("r")
        call()
        if llm.is_sleeping():
            llm.wake_up()
        assert not llm.has_unfinished_requests()
    assert greedy_ids(llm, PROMPTS, 6) == want["new"]
