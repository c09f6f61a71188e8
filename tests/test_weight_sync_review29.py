"""Review of `LLM.update_params`, `sleep` and `wake_up` (`pagedjax.weight_sync`): what a
failure in the middle left behind, and inputs refused without a reason. `sleep(level=1)`
whose copy of the weights to host memory failed had deleted the KV cache already (the
engine asleep by half); `wake_up` whose new KV cache failed half made kept that cache in
device memory while the KV cache counted as asleep (`sleep` then freed nothing, and a
retry needed room for two caches); an `nnx.State` holding plain arrays (`nnx.State(
nnx.to_pure_dict(state))`) failed with an AttributeError, and the nested dict itself
(which Flax has `nnx.State` give way to; a restored checkpoint's) was refused as
parameters missing and unexpected; a dict's `Variable` holding a donated array failed
inside `jax.device_put`; a numpy integer level was refused as not 1 or 2. The tiny
preset, f32, XLA (engine_helpers' geometry)."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import GEOMETRY, check_clean, greedy, greedy_ids
from engine_helpers import UPDATE_PROMPTS as PROMPTS
from flax import nnx

from pagedjax import weight_sync
from pagedjax.engine import LLM


def device_bytes() -> int:
    """Bytes of the live arrays in device memory."""
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays() if x.sharding.memory_kind == "device")


def test_a_sleep_whose_host_copy_fails_changes_nothing(old, want, monkeypatch):
    """The weights' copy to host memory (pinned host memory can run out) is made before
    the KV cache is deleted: if it fails, the engine is as it was, awake."""
    llm = LLM(old, **GEOMETRY)
    assert greedy_ids(llm) == want["old"]
    pools, weights = jax.tree.leaves(llm.cache), jax.tree.leaves(llm.params)

    def fail(params):
        raise MemoryError("out of pinned host memory")

    monkeypatch.setattr(weight_sync, "to_host", fail)
    with pytest.raises(MemoryError, match="pinned host memory"):
        llm.sleep()
    assert not llm.is_sleeping() and llm.cache is not None
    assert not any(x.is_deleted() for x in pools)
    assert all(a is b for a, b in zip(jax.tree.leaves(llm.params), weights, strict=True))
    assert [o.num_cached_tokens for o in llm.generate(PROMPTS, greedy(6))] == [16, 16]  # (kept)
    monkeypatch.undo()
    llm.sleep()
    llm.wake_up()
    assert greedy_ids(llm) == want["old"]
    check_clean(llm)


def test_a_wake_up_whose_kv_cache_fails_keeps_none_of_it(old, want, monkeypatch):
    """The LoRA slots, made after the KV cache, run out of device memory: the KV cache
    made first is freed again (it sleeps, and holds no memory), so that `sleep` or a
    retried `wake_up` needs no room for a second one."""
    llm = LLM(old, enable_lora=True, max_loras=2, max_lora_rank=4, **GEOMETRY)
    assert greedy_ids(llm) == want["old"]
    llm.sleep()
    llm.wake_up()  # (the weights its own: `old`'s arrays are held all along)
    awake = device_bytes()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.params))
    llm.sleep()
    asleep = device_bytes()
    restore = llm.lora.restore_device

    def fail():
        raise RuntimeError("RESOURCE_EXHAUSTED: out of device memory (simulated)")

    monkeypatch.setattr(llm.lora, "restore_device", fail)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        llm.wake_up()
    # The weights woke (their tag first); the KV cache still sleeps, holding nothing.
    assert llm.is_sleeping() and llm.cache is None
    assert device_bytes() - asleep == weight_bytes
    llm.sleep()  # (back to sleep: the device memory the engine held is free again)
    assert device_bytes() == asleep
    monkeypatch.setattr(llm.lora, "restore_device", restore)
    llm.wake_up()
    assert not llm.is_sleeping() and device_bytes() == awake
    assert greedy_ids(llm) == want["old"]
    check_clean(llm)


@pytest.mark.parametrize(
    "kind", ["state of arrays", "nested dict", "nested dict of variables", "restored"]
)
def test_an_nnx_state_of_plain_arrays_or_a_nested_dict_updates_the_engine(old, new, want, kind):
    """`nnx.State(pure_dict)` holds arrays, not `Variable`s, and `nnx.to_pure_dict`'s
    nested dict (what Flax has `nnx.State` give way to, and a restored checkpoint) is
    keyed by names and layer numbers: taken as `nnx.state(model)` is."""

    def given(state):
        return {
            "state of arrays": lambda: nnx.State(nnx.to_pure_dict(state)),
            "nested dict": lambda: nnx.to_pure_dict(state),
            "nested dict of variables": lambda: nnx.to_pure_dict(state, lambda v: v),
            # (a checkpoint restored by orbax: layer numbers as strings)
            "restored": lambda: {
                **(d := nnx.to_pure_dict(state)),
                "layers": {str(i): layer for i, layer in d["layers"].items()},
            },
        }[kind]()

    llm = LLM(old, **GEOMETRY)
    greedy_ids(llm)
    llm.update_params(given(new.state))
    assert greedy_ids(llm) == want["new"]
    # Bad ones are still named, and change nothing.
    bad = nnx.to_pure_dict(new.state)
    del bad["norm"]
    bad["layers"][0]["mlp"]["extra"] = bad["layers"][0]["mlp"]["up_proj"]["kernel"]
    bad["layers"][1]["mlp"]["up_proj"]["kernel"] = bad["layers"][1]["mlp"]["up_proj"]["kernel"][1:]
    match = (
        r"missing: norm.scale; unexpected: layers.0.mlp.extra; bad: "
        r"layers.1.mlp.up_proj.kernel: shape \(63, 128\)"
    )
    with pytest.raises(ValueError, match=match):
        llm.update_params(nnx.State(bad) if kind == "state of arrays" else bad)
    with pytest.raises(TypeError, match="keys must be dotted paths"):
        llm.update_params({0: nnx.to_pure_dict(new.state)["layers"][0]})
    assert greedy_ids(llm) == want["new"]


def test_a_variable_holding_a_donated_array_is_named(old, new):
    """A dict's `Variable`s are taken by their values: one whose array a jitted step
    donated is named as a deleted array is (it failed inside `jax.device_put`)."""
    llm = LLM(old, **GEOMETRY)
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(new.state)}
    key = "layers.0.mlp.up_proj.kernel"
    donated = flat[key].replace(jnp.copy(flat[key].get_value()))
    donated.get_value().delete()
    with pytest.raises(ValueError, match=f"{key}: the array is deleted"):
        llm.update_params(flat | {key: donated})


def test_a_numpy_integer_sleep_level_is_a_level(old, want):
    llm = LLM(old, **GEOMETRY)
    llm.sleep(np.int64(2))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(llm.params))
    llm.update_params(old)
    llm.wake_up()
    llm.sleep(level=np.int32(1))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(llm.params)} == {"pinned_host"}
    llm.wake_up()
    assert greedy_ids(llm) == want["old"]
    for bad in (np.int64(3), np.bool_(True), np.float32(1.0)):
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            llm.sleep(bad)
    assert not llm.is_sleeping()
