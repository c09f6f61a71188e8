"""pagedjax.sharding: arguments of the wrong kind are clear errors, numpy ints are ints
(one device; no subprocess)."""

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_sharding_validation import CFG

from pagedjax import model, sharding
from pagedjax.config import CacheConfig

CACHE = CacheConfig(page_size=4, num_pages=4, dtype="float32")


def _not_meshes():
    one = sharding.make_mesh(1)
    return [
        4,  # a tp size where the mesh goes
        NamedSharding(one, P()),
        AbstractMesh((1,), ("tp",), axis_types=(AxisType.Auto,)),
    ]


@pytest.mark.parametrize("bad", _not_meshes(), ids=["int", "NamedSharding", "AbstractMesh"])
def test_a_mesh_argument_that_is_not_a_mesh_is_a_type_error(bad):
    """`shard_params(params, 4)` (a tp size for the mesh) failed as "AttributeError:
    'int' object has no attribute 'shape'"; an AbstractMesh as "AbstractMesh does not
    implement devices"."""
    name = type(bad).__name__
    with pytest.raises(TypeError, match=rf"mesh must be a jax.sharding.Mesh .*got {name}"):
        sharding.shard_params(model.init_params(CFG), bad)
    with pytest.raises(TypeError, match=rf"mesh must be a jax.sharding.Mesh .*got {name}"):
        sharding.create_cache(CFG, CACHE, bad)
    with pytest.raises(TypeError, match=rf"mesh must be a jax.sharding.Mesh .*got {name}"):
        sharding.tensor_parallel_size(bad)


def test_shard_params_of_something_not_params_is_a_type_error():
    """An nnx model or a params_to_flat dict failed as "'Llama' object has no
    attribute 'config'"."""
    params = model.init_params(CFG)
    mesh = sharding.make_mesh(1)
    for bad in (params.merge(), model.params_to_flat(params)):
        with pytest.raises(TypeError, match=rf"pagedjax.model.Params.*got {type(bad).__name__}"):
            sharding.shard_params(bad, mesh)


def test_a_model_config_argument_that_is_not_one_is_a_type_error():
    """`make_mesh(1, jax.devices())` (devices given where the model's config goes)
    failed as "'list' object has no attribute 'num_heads'"."""
    for call in (
        lambda: sharding.make_mesh(1, jax.devices()),
        lambda: sharding.check_tensor_parallel("/path/to/ckpt", 1),
        lambda: sharding.device_kv_config({"num_heads": 4}, 1),
    ):
        with pytest.raises(TypeError, match=r"cfg must be a pagedjax.config.ModelConfig, got"):
            call()


@pytest.mark.parametrize("tp", [np.int64(1), np.int32(1)])
def test_a_numpy_int_tensor_parallel_is_an_int(tp):
    """The library's ints are Python or numpy ints (`config.is_int`); tensor_parallel
    refused np.int64(1) as "must be a positive int, got tensor_parallel=np.int64(1)"."""
    mesh = sharding.make_mesh(tp, CFG)
    assert sharding.tensor_parallel_size(mesh) == 1
    sharding.check_tensor_parallel(CFG, np.int64(2), 2)
    share = sharding.device_kv_config(CFG, np.int64(2))
    assert share.num_kv_heads == 1 and type(share.num_kv_heads) is int
    for bad in (np.bool_(True), np.float64(1.0), np.int64(0)):
        with pytest.raises(ValueError, match=r"tensor_parallel must be a positive int"):
            sharding.make_mesh(bad)
