"""pagedjax.sharding: bad meshes and sizes are clear errors (one device; no subprocess)."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from pagedjax import model, sharding
from pagedjax.config import CacheConfig, ModelConfig

CFG = ModelConfig(
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    hidden_size=32,
    intermediate_size=64,
    vocab_size=64,
    dtype="float32",
)


@pytest.mark.parametrize("axis", ["model", "x", "TP"])
def test_a_mesh_without_a_tp_axis_is_a_value_error(axis):
    """A mesh whose axis is not named "tp" was a bare KeyError: 'tp'."""
    mesh = Mesh(np.array(jax.devices()[:1]), (axis,))
    with pytest.raises(ValueError, match=rf"'tp'.*{axis}"):
        sharding.tensor_parallel_size(mesh)
    with pytest.raises(ValueError, match="'tp'"):
        sharding.create_cache(CFG, CacheConfig(page_size=4, num_pages=4, dtype="float32"), mesh)


def test_tp_mesh_still_sized():
    assert sharding.tensor_parallel_size(None) == 1
    assert sharding.tensor_parallel_size(sharding.make_mesh(1)) == 1


def test_too_few_devices_names_which_devices_were_counted():
    one = jax.devices()[:1]
    with pytest.raises(ValueError, match=r"only 1 are present \(the devices given\)"):
        sharding.make_mesh(2, devices=one)
    with pytest.raises(ValueError, match=r"only 1 are present \(the devices given\)"):
        sharding.make_mesh(2, CFG, devices=one)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"only {n} are present \(cpu: jax.devices\(\)\)"):
        sharding.make_mesh(n + 1)
    assert sharding.tensor_parallel_size(sharding.make_mesh(1, CFG, devices=one)) == 1


def test_make_mesh_checks_the_model_before_building_the_mesh():
    three = jax.devices()[:1] * 3  # enough devices counted: the model's split is what fails
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide .* num_heads=4"):
        sharding.make_mesh(3, CFG, devices=three)


def test_a_mesh_with_explicit_axes_is_refused_before_tracing():
    """jax.make_mesh makes Explicit axes unless told otherwise; the steps (which let XLA
    propagate shardings) then failed inside tracing with a ShardingTypeError."""
    cache_cfg = CacheConfig(page_size=4, num_pages=4, dtype="float32")
    for mesh in (
        jax.make_mesh((1,), ("tp",)),
        jax.make_mesh((1,), ("tp",), axis_types=(AxisType.Manual,)),
    ):
        with pytest.raises(ValueError, match=r"must all be AxisType.Auto, got \{'tp': "):
            sharding.create_cache(CFG, cache_cfg, mesh)
        with pytest.raises(ValueError, match=r"must all be AxisType.Auto"):
            sharding.shard_params(model.init_params(CFG), mesh)
    auto = Mesh(np.array(jax.devices()[:1]), ("tp",))  # Mesh's own default: Auto
    assert sharding.check_mesh(auto) == 1


def test_a_device_named_twice_is_refused():
    """A mesh listing one device twice was built, then failed in jit as a bare
    AssertionError."""
    one = jax.devices()[0]
    with pytest.raises(ValueError, match=r"devices must be distinct, got \[.*, .*\]"):
        sharding.make_mesh(2, CFG, devices=[one, one])
    twice = Mesh(np.array([one, one]), ("tp",))
    with pytest.raises(ValueError, match=r"devices must be distinct"):
        sharding.create_cache(CFG, CacheConfig(page_size=4, num_pages=4, dtype="float32"), twice)


@pytest.mark.parametrize(
    "tp,match",
    [
        (3, r"tensor_parallel=3 must divide the number of query heads, num_heads=4"),
        (0, r"tensor_parallel must be a positive int, got tensor_parallel=0"),
    ],
)
def test_device_kv_config_refuses_a_split_the_model_does_not_allow(tp, match):
    """It sized a tp = 3 share of 4 query heads and 2 kv heads as 1 kv head."""
    with pytest.raises(ValueError, match=match):
        sharding.device_kv_config(CFG, tp)
    assert sharding.device_kv_config(CFG, 4).num_kv_heads == 1  # > the devices present: fine
