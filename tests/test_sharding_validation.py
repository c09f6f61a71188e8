"""pagedjax.sharding: bad meshes and sizes are clear errors (one device; no subprocess)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from pagedjax import sharding
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
