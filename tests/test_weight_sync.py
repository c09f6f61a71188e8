"""New weights and freed memory for a running engine (`LLM.update_params`,
`reset_prefix_cache`, `sleep`, `wake_up`; `pagedjax.weight_sync`): an RL loop's policy
updates. After an update, outputs equal a fresh engine's on the new weights (greedy,
the dense reference too), with no recompilation and no prefix-cache hit on K/V the old
weights computed; bad weights are named and change nothing. The tiny preset, f32, XLA
(tensor parallelism: tests/tp_cases.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import GEOMETRY, check_clean, compiles, greedy, greedy_ids, random_params
from engine_helpers import UPDATE_PROMPTS as PROMPTS
from flax import nnx

from pagedjax import model
from pagedjax.engine import LLM


@pytest.mark.parametrize("kind", ["params", "state", "flat", "numpy"])
def test_update_params_gives_a_fresh_engines_outputs_without_recompiling(old, new, want, kind):
    llm = LLM(old, **GEOMETRY)
    assert greedy_ids(llm) == want["old"]
    assert greedy_ids(llm) == want["old"]  # (every program compiled; the prefix cache warm)
    given = {
        "params": new,
        "state": new.state,
        "flat": model.params_to_flat(new),
        "numpy": {k: np.asarray(v) for k, v in model.params_to_flat(new).items()},
    }[kind]
    before = compiles()
    llm.update_params(given)
    outs = llm.generate(PROMPTS, greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == want["new"]
    # The old weights' K/V left the prefix cache with them.
    assert [o.num_cached_tokens for o in outs] == [0, 16]
    assert compiles() == before
    for a, b in zip(jax.tree.leaves(llm.params), jax.tree.leaves(new), strict=True):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check_clean(llm)


def test_float_weights_are_cast_to_the_engines_dtype(old, new):
    """float32 master weights into a bfloat16 engine: as LLM(new, dtype=bfloat16)."""
    llm = LLM(old, dtype="bfloat16", **GEOMETRY)
    greedy_ids(llm)
    llm.update_params(new)
    assert {x.dtype for x in jax.tree.leaves(llm.params)} == {jnp.dtype(jnp.bfloat16)}
    assert greedy_ids(llm) == greedy_ids(LLM(new, dtype="bfloat16", **GEOMETRY))


def test_bad_weights_are_named_and_change_nothing(old, new, want):
    llm = LLM(old, **GEOMETRY)
    flat = model.params_to_flat(new)
    key = "layers.0.self_attn.q_proj.kernel"
    cases = [
        ({k: v for k, v in flat.items() if k != key}, ValueError, f"missing: {key}"),
        (flat | {"layers.0.extra": flat[key]}, ValueError, "unexpected: layers.0.extra"),
        (flat | {key: flat[key][:, :-1]}, ValueError, rf"{key}: shape \(\d+, \d+\)"),
        (flat | {key: flat[key].astype(jnp.int32)}, ValueError, f"{key}: dtype int32"),
        (flat | {key: flat[key].tolist()}, ValueError, f"{key}: dtype None"),
        ([1, 2], TypeError, "got list"),
        ({1: flat[key]}, TypeError, "keys must be dotted paths"),
    ]
    for given, exc, match in cases:
        with pytest.raises(exc, match=match):
            llm.update_params(given)
    donated = jnp.copy(flat[key])
    donated.delete()
    with pytest.raises(ValueError, match=f"{key}: the array is deleted"):
        llm.update_params(flat | {key: donated})
    assert greedy_ids(llm) == want["old"]


def test_check_finite_refuses_nan_or_inf_weights_and_changes_nothing(old, new, want):
    """A diverged training step's NaN/inf weights: refused with `check_finite=True` (each
    array named with its count), the engine keeps its weights; taken without it."""
    llm = LLM(old, **GEOMETRY)
    flat = model.params_to_flat(new)
    q, down = "layers.0.self_attn.q_proj.kernel", "layers.1.mlp.down_proj.kernel"
    bad = flat | {q: flat[q].at[0, :3].set(jnp.nan), down: flat[down].at[1, 1].set(-jnp.inf)}
    match = (
        rf"NaN or inf: {q}: 3 of {flat[q].size} values NaN or inf, "
        rf"{down}: 1 of {flat[down].size} values NaN or inf; the engine keeps"
    )
    with pytest.raises(ValueError, match=match):
        llm.update_params(bad, check_finite=True)
    assert greedy_ids(llm) == want["old"]
    with pytest.raises(TypeError, match="check_finite must be a bool, got check_finite=1"):
        llm.update_params(flat, check_finite=1)
    llm.update_params(flat, check_finite=True)  # finite: taken
    assert greedy_ids(llm) == want["new"]
    llm.update_params(bad)  # not checked: taken as they are, as vLLM does
    assert any(np.isnan(x).any() for x in jax.tree.leaves(llm.params))


def test_weights_and_memory_calls_refuse_unfinished_requests(old, new, want):
    llm = LLM(old, **GEOMETRY)
    rid = llm.add_request(PROMPTS[0], greedy(6))
    llm.step()
    for call in (lambda: llm.update_params(new), llm.sleep):
        with pytest.raises(RuntimeError, match="1 are queued or running"):
            call()
    assert llm.reset_prefix_cache() is False
    llm.abort(rid)
    while llm.has_unfinished_requests():
        llm.step()
    llm.update_params(new)
    assert greedy_ids(llm) == want["new"]


def test_reset_prefix_cache(old):
    llm = LLM(old, **GEOMETRY)
    greedy_ids(llm)
    assert [o.num_cached_tokens for o in llm.generate(PROMPTS, greedy(2))] == [16, 16]
    assert llm.reset_prefix_cache() is True
    assert llm.block_manager.stats().num_cached_pages == 0
    assert [o.num_cached_tokens for o in llm.generate(PROMPTS, greedy(2))] == [0, 16]
    check_clean(llm)


def test_sleep_frees_the_kv_cache_and_moves_the_weights_to_host_memory(old, new, want):
    llm = LLM(old, **GEOMETRY)
    assert greedy_ids(llm) == want["old"]
    pools = jax.tree.leaves(llm.cache)
    shardings = [x.sharding for x in jax.tree.leaves(llm.params)]
    before = compiles()
    llm.sleep()
    assert llm.cache is None and all(x.is_deleted() for x in pools)
    assert llm.block_manager.stats().num_cached_pages == 0
    assert {x.sharding.memory_kind for x in jax.tree.leaves(llm.params)} == {"pinned_host"}
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, greedy(6))
    with pytest.raises(RuntimeError, match="asleep"):
        llm.add_request(PROMPTS[0], greedy(6))
    llm.sleep()  # (again: nothing more)
    llm.wake_up()
    llm.wake_up()
    assert [x.sharding for x in jax.tree.leaves(llm.params)] == shardings
    outs = llm.generate(PROMPTS, greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == want["old"]
    assert [o.num_cached_tokens for o in outs] == [0, 16]
    assert compiles() == before  # (the weights back where the programs expect them)
    llm.sleep()
    llm.update_params(new)  # (asleep: the new weights are the ones wake_up keeps)
    llm.wake_up()
    assert greedy_ids(llm) == want["new"]
    check_clean(llm)


def test_sleep_level_2_drops_the_weights_until_update_params(new, want):
    llm = LLM(random_params(0), **GEOMETRY)
    weights = jax.tree.leaves(llm.params)
    llm.sleep(level=2)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(llm.params))
    assert not any(x.is_deleted() for x in weights)  # dropped, not deleted: maybe shared
    llm.wake_up()
    with pytest.raises(RuntimeError, match=r"dropped \(sleep\(level=2\)\)"):
        llm.generate(PROMPTS, greedy(6))
    llm.update_params(new)
    assert greedy_ids(llm) == want["new"]
    for bad in (0, 3, True, 1.0, "1"):
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            llm.sleep(bad)


def test_an_nnx_training_loops_state_updates_the_engine(old, want):
    """The weights of a module a training loop updates (`nnx.state(model)`)."""
    module = model.Llama(old.config, rngs=nnx.Rngs(0))
    nnx.update(module, random_params(1).state)
    llm = LLM(old, **GEOMETRY)
    llm.update_params(nnx.state(module))
    assert greedy_ids(llm) == want["new"]
