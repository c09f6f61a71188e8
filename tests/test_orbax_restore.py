"""restore_params reads the arrays in groups of bounded size (host memory; BENCHMARKS.md)."""

import jax
import numpy as np
import pytest

from pagedjax import orbax_checkpoint
from pagedjax.config import preset
from pagedjax.model import init_params, param_shapes, params_to_flat


def test_groups_are_bounded_and_keep_the_order():
    target = dict(param_shapes(preset("tiny")))
    sizes = {k: v.size * v.dtype.itemsize for k, v in target.items()}
    limit = max(sizes.values()) // 2  # some arrays are larger: each of those alone
    groups = orbax_checkpoint._restore_groups(target, limit)
    assert [k for g in groups for k in g] == list(target)
    for g in groups:
        assert len(g) == 1 or sum(sizes[k] for k in g) <= limit
    assert len(orbax_checkpoint._restore_groups(target, 1 << 40)) == 1


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_restore_in_small_groups_matches(tmp_path, monkeypatch, dtype):
    params = init_params(preset("tiny"))
    orbax_checkpoint.save_params(params, tmp_path / "ckpt")
    whole = params_to_flat(orbax_checkpoint.restore_params(tmp_path / "ckpt", dtype=dtype))
    monkeypatch.setattr(orbax_checkpoint, "_RESTORE_GROUP_BYTES", 4096)
    calls = []
    real = orbax_checkpoint._restore_groups
    monkeypatch.setattr(
        orbax_checkpoint, "_restore_groups", lambda t, n: calls.append(r := real(t, n)) or r
    )
    flat = params_to_flat(orbax_checkpoint.restore_params(tmp_path / "ckpt", dtype=dtype))
    assert len(calls[0]) > 1
    assert flat.keys() == whole.keys()
    for k, x in flat.items():
        assert x.dtype == whole[k].dtype and x.sharding == whole[k].sharding
        np.testing.assert_array_equal(jax.device_get(x), jax.device_get(whole[k]))


def test_an_orbax_without_partial_restores_reads_the_whole_tree(tmp_path, monkeypatch):
    """`partial_restore` is a newer orbax's; without it (the floor, 0.11.17, may lack
    it) the restore is the one call it was."""
    import orbax.checkpoint as ocp

    params = init_params(preset("tiny"))
    orbax_checkpoint.save_params(params, tmp_path / "ckpt")
    real, given = ocp.args.PyTreeRestore, []

    def old_orbax(item=None, restore_args=None):
        given.append(item)
        return real(item=item, restore_args=restore_args)

    monkeypatch.setattr(ocp.args, "PyTreeRestore", old_orbax)
    monkeypatch.setattr(orbax_checkpoint, "_RESTORE_GROUP_BYTES", 4096)
    flat = params_to_flat(orbax_checkpoint.restore_params(tmp_path / "ckpt"))
    assert len(given) == 1
    for k, x in params_to_flat(params).items():
        np.testing.assert_array_equal(jax.device_get(flat[k]), jax.device_get(x))
