"""New weights for a running engine: the policy update of a reinforcement-learning loop.

An RL loop alternates generating rollouts with the current policy and training it:

    llm = LLM(params)                       # the inference copy (e.g. bfloat16)
    for it in range(steps):
        outs = llm.generate(prompts, sp)    # rollouts
        llm.sleep()                         # the KV cache's memory, for training
        state = train_step(state, outs)     # float32 master weights, sharded as training likes
        llm.wake_up()
        llm.update_params(state.params)     # no reload, no recompile

`LLM.update_params` (`pagedjax.engine`) calls `place_params` here: the new weights must
be the same parameters (dotted paths, `model.params_to_flat`'s) with the same shapes;
floating-point ones are cast to the engine's dtype, as loading a checkpoint casts them,
and every array is placed as the engine's is (its device, or its sharding over the
tensor-parallel mesh), so the jitted steps run them with the programs they compiled
(same tree, shapes, dtypes and shardings). The engine holds `template(params)`, the
shape, dtype and sharding of each array, so that weights it dropped
(`LLM.sleep(level=2)`) can be replaced all the same.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax import model as model_lib

__all__ = ["place_params", "template"]


def template(params: model_lib.Params) -> model_lib.Params:
    """`params` with each array replaced by its `jax.ShapeDtypeStruct` (sharding
    included): what new weights must match, without holding the old ones."""

    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(spec, params)


def _flat(new) -> dict:
    """{dotted path: array} of new weights given as `Params`, an `nnx.State` (a training
    loop's `nnx.state(model)`) or such a dict already."""
    if isinstance(new, model_lib.Params):
        return model_lib.params_to_flat(new)
    if isinstance(new, nnx.State):
        return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(new)}
    if isinstance(new, Mapping):
        bad = [k for k in new if not isinstance(k, str)]
        if bad:
            raise TypeError(f"a weights dict's keys must be dotted paths (str), got {bad[0]!r}")
        return dict(new)
    raise TypeError(
        "new weights must be pagedjax.model.Params, an nnx.State or a {dotted path: array} "
        f"dict (model.params_to_flat's), got {type(new).__name__}"
    )


def place_params(like: model_lib.Params, new) -> model_lib.Params:
    """`new` weights as `Params` shaped, typed and placed as `like` (a `Params` or its
    `template`), with `like`'s structure, config and mesh.

    Arrays already in the engine's dtype and placement are kept, not copied (as
    `LLM(params)` keeps them): a training step that donates them deletes the engine's
    weights too.

    Raises:
      TypeError: `new` is none of the accepted kinds.
      ValueError: a parameter missing, unexpected, of another shape, not floating
        point, or deleted (donated), naming each (all at once).
    """
    flat = _flat(new)
    want = list(nnx.to_flat_state(like.state))
    keys = [".".join(map(str, p)) for p, _ in want]
    missing = [k for k in keys if k not in flat]
    unexpected = sorted(set(flat) - set(keys))
    bad = []
    for key, (_, var) in zip(keys, want, strict=True):
        if key not in flat:
            continue
        x, spec = flat[key], var.get_value()
        shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None)
        if shape != tuple(spec.shape):
            bad.append(f"{key}: shape {shape}, the model's is {tuple(spec.shape)}")
        elif dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            bad.append(f"{key}: dtype {dtype}, not floating point")
        elif isinstance(x, jax.Array) and x.is_deleted():
            bad.append(f"{key}: the array is deleted (donated to a jitted call?)")
    if missing or unexpected or bad:
        parts = [
            f"{what}: {', '.join(items[:5])}" + (f" (+{len(items) - 5} more)" * (len(items) > 5))
            for what, items in (("missing", missing), ("unexpected", unexpected), ("bad", bad))
            if items
        ]
        raise ValueError(f"new weights do not match the engine's model; {'; '.join(parts)}")
    pairs = []
    for key, (path, var) in zip(keys, want, strict=True):
        spec = var.get_value()
        x = flat[key]
        if x.dtype != spec.dtype:  # cast where it lies (a host array on the host), then placed
            x = x.astype(spec.dtype) if isinstance(x, jax.Array) else np.asarray(x, spec.dtype)
        pairs.append((path, var.replace(jax.device_put(x, spec.sharding))))
    return like.replace(state=nnx.from_flat_state(pairs))
