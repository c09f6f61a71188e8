"""Tensor parallelism: a one-axis device `Mesh` ("tp"), parameter and cache layouts.

Everything is JAX's own sharding: parameters are placed with `NamedSharding`s
(`shard_params`), XLA partitions the matmuls and inserts the collectives, and the
two things XLA must not partition on its own, the per-layer cache write and the
attention kernel, run per shard under `jax.shard_map` (`shard_attention`).

Layout over `tp` devices, with `H` query heads, `K` kv heads, `I` the MLP width and
`V` the vocabulary (`tp` must divide `H` and `I`, and `K % tp == 0` or `tp % K == 0`):

    q_proj [E, H*D] column-split     device j owns query heads [j*H/tp, (j+1)*H/tp)
    k_proj, v_proj [E, K*D]          column-split when K >= tp, else replicated
    o_proj [H*D, E] row-split        partial sums -> one all-reduce per layer
    o_proj bias [E] (o_bias)         replicated: added once, to the reduced sum
    gate_proj, up_proj [E, I]        column-split (Megatron)
    down_proj [I, E] row-split       partial sums -> one all-reduce per layer
    embed_tokens [V, E]              split over V (vocab-parallel lookup: one all-reduce)
    lm_head [E, V]                   split over V; the [B, V] logits are all-gathered
                                     once so that sampling sees whole rows
    norms                            replicated; the residual stream [T, E] is replicated
    q_norm, k_norm [D] (Qwen3)       replicated: they normalise within a head, and heads
                                     are never split across devices

(V falls back to replicated when tp does not divide it.)

KV cache: each pool is `[Kc, P, S, D]` with `Kc = max(K, tp)`, split over its first
axis, so device j holds `[Kc / tp, P, S, D]`: its heads' slice of every page; page
ids stay global and the host `BlockManager` is unchanged. When `K >= tp`, `Kc = K`
and device j holds kv heads `[j*K/tp, (j+1)*K/tp)`: 1/tp of the cache. When
`K < tp`, each device holds exactly the one kv head its query heads read (kv head
`j // (tp/K)`), so every kv head is stored on `tp/K` devices: a device's share is
1/K of the single-device cache, and the global array has `tp` rows (kv head `i` is
row `i * tp/K` ... `(i + 1) * tp/K - 1`). Each device computes the K replicated kv
projections (cheap: `K*D` columns) and writes only its own head.

Multi-host: after `jax.distributed.initialize()`, `jax.devices()` lists every
host's devices and `make_mesh` spans them; nothing else changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pagedjax import cache as cache_lib
from pagedjax.config import CacheConfig, ModelConfig, is_int

if TYPE_CHECKING:
    from pagedjax.model import Params

AXIS = "tp"

__all__ = [
    "AXIS",
    "cache_kv_heads",
    "cache_sharding",
    "check_mesh",
    "check_tensor_parallel",
    "create_cache",
    "default_device",
    "device_kv_config",
    "gather_logits",
    "host_staging",
    "make_mesh",
    "param_spec",
    "shard_attention",
    "shard_params",
    "tensor_parallel_size",
]


def default_device() -> jax.Device:
    """Where arrays without a mesh land (a loaded model's, the cache's):
    `jax.default_device`'s device if one is set, else the first of `jax.devices()`."""
    dev = jax.config.jax_default_device
    if isinstance(dev, str):  # a platform name
        return jax.devices(dev)[0]
    return dev if dev is not None else jax.devices()[0]


def home_device(params) -> jax.Device:
    """The device a model without a mesh computes on: its arrays' (the first one on a
    single device; `default_device()` if none is, as a dropped engine's template).

    What the steps make lies there committed (their outputs), so the engine commits its
    weights, cache, feed and LoRA slots there too (`create_cache(device=)`,
    `replicate(device=)`): XLA compiles another program for an input committed where it
    was not, so a cache made uncommitted compiled every step program twice, once for it
    and once for the steps' committed outputs."""
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.Array) and len(x.devices()) == 1:
            return next(iter(x.devices()))
    return default_device()


def _check_size(tp, num_devices: int | None, where: str = "") -> None:
    """`where`: which devices were counted (default: every host's `jax.devices()`).
    A numpy int is an int, as everywhere in the library (`config.is_int`)."""
    if not is_int(tp) or tp < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got tensor_parallel={tp!r}")
    if num_devices is None:
        num_devices, where = len(jax.devices()), f"{jax.default_backend()}: jax.devices()"
    if tp > num_devices:
        raise ValueError(
            f"tensor_parallel={tp} needs {tp} devices, but only {num_devices} are present "
            f"({where or 'the devices given'})"
        )


def check_tensor_parallel(
    cfg: ModelConfig, tensor_parallel: int, num_devices: int | None = None
) -> None:
    """Raises ValueError unless `cfg` can be split `tensor_parallel` ways (TypeError if
    `cfg` is not a `ModelConfig`).

    Args:
      cfg: the model.
      tensor_parallel: devices on the "tp" axis.
      num_devices: devices available (default: `len(jax.devices())`, every host's).
    """
    _check_size(tensor_parallel, num_devices)
    _check_split(cfg, tensor_parallel)


def _check_split(cfg: ModelConfig, tp: int) -> None:
    if not isinstance(cfg, ModelConfig):  # (devices given where the config goes, a path)
        raise TypeError(
            f"cfg must be a pagedjax.config.ModelConfig, got {type(cfg).__name__}: {cfg!r:.80}"
        )
    if cfg.num_heads % tp:
        raise ValueError(
            f"tensor_parallel={tp} must divide the number of query heads, num_heads={cfg.num_heads}"
        )
    k = cfg.num_kv_heads
    if k % tp and tp % k:
        raise ValueError(
            f"tensor_parallel={tp} must divide num_kv_heads={k} or be a multiple of it "
            "(fewer kv heads than devices: each kv head is replicated on tp / K devices)"
        )
    if cfg.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel={tp} must divide intermediate_size={cfg.intermediate_size}"
        )


def make_mesh(
    tensor_parallel: int, cfg: ModelConfig | None = None, *, devices: Sequence | None = None
) -> Mesh:
    """A one-axis mesh ("tp",) over the first `tensor_parallel` devices.

    Args:
      tensor_parallel: devices on the axis.
      cfg: when given, also checks that the model splits this many ways.
      devices: devices to use (default `jax.devices()`, which spans every host after
        `jax.distributed.initialize()`).

    Raises:
      TypeError: cfg is neither None nor a `ModelConfig`.
      ValueError: tensor_parallel is not a positive int, exceeds the devices present,
        names a device twice, or (with cfg) does not divide the model's heads or MLP
        width.
    """
    given = None if devices is None else len(devices := list(devices))
    if cfg is None:
        _check_size(tensor_parallel, given)
    else:
        check_tensor_parallel(cfg, tensor_parallel, given)
    devices = list(jax.devices()) if devices is None else devices
    tensor_parallel = int(tensor_parallel)  # (a numpy int)
    _check_distinct(devices[:tensor_parallel])
    # Auto axes: XLA propagates shardings from the parameters (no sharding-in-types).
    return jax.make_mesh((tensor_parallel,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def _check_distinct(devices) -> None:
    # jax builds a mesh that names a device twice; jit then fails on it, a bare AssertionError.
    if len(set(devices)) < len(devices):
        raise ValueError(f"the mesh's devices must be distinct, got {list(devices)}")


def check_mesh(mesh: Mesh) -> int:
    """Raises ValueError unless `mesh` can carry a model (TypeError unless it is a
    `jax.sharding.Mesh`); returns its tp size.

    The mesh needs a "tp" axis, distinct devices and only `AxisType.Auto` axes: the
    steps let XLA propagate shardings from the parameters, and under Explicit axes
    (`jax.make_mesh`'s default) or Manual ones they fail inside tracing instead.
    `make_mesh` builds such a mesh; other axes, replicated over, are allowed.
    """
    tp = tensor_parallel_size(mesh)
    if any(t != AxisType.Auto for t in mesh.axis_types):
        types = dict(zip(mesh.axis_names, (t.name for t in mesh.axis_types), strict=True))
        raise ValueError(
            f"the mesh's axes must all be AxisType.Auto, got {types}: build it with "
            "sharding.make_mesh (jax.make_mesh makes Explicit axes unless given axis_types)"
        )
    _check_distinct(list(mesh.devices.flat))
    return tp


def tensor_parallel_size(mesh: Mesh | None) -> int:
    """Devices on the "tp" axis (1 without a mesh).

    Raises:
      TypeError: `mesh` is not a `jax.sharding.Mesh` (a tp size, a sharding, an
        `AbstractMesh`: the steps need its devices).
      ValueError: `mesh` has no "tp" axis (`make_mesh` builds one).
    """
    if mesh is None:
        return 1
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "mesh must be a jax.sharding.Mesh (sharding.make_mesh(tensor_parallel, cfg)), "
            f"got {type(mesh).__name__}: {mesh!r:.80}"
        )
    if AXIS not in mesh.shape:
        raise ValueError(
            f"the mesh needs a {AXIS!r} axis (sharding.make_mesh), got axes {tuple(mesh.shape)}"
        )
    return mesh.shape[AXIS]


def cache_kv_heads(cfg: ModelConfig, tensor_parallel: int) -> int:
    """Rows of the cache's kv-head axis: K, or tp when kv heads are replicated (K < tp)."""
    return max(cfg.num_kv_heads, tensor_parallel)


# (dotted-path pattern, spec when the split dimension divides, dimension that must divide)
_RULES: tuple[tuple[str, P, str | None], ...] = (
    (r"embed_tokens\.embedding", P(AXIS, None), "vocab"),
    (r".*\.self_attn\.q_proj\.kernel", P(None, AXIS), None),
    (r".*\.self_attn\.q_proj\.bias", P(AXIS), None),
    (r".*\.self_attn\.[kv]_proj\.kernel", P(None, AXIS), "kv"),
    (r".*\.self_attn\.[kv]_proj\.bias", P(AXIS), "kv"),
    (r".*\.self_attn\.o_proj\.kernel", P(AXIS, None), None),
    (r".*\.self_attn\.o_proj\.bias", P(), None),  # after the all-reduce, not per shard
    (r".*\.mlp\.(gate|up)_proj\.kernel", P(None, AXIS), None),
    (r".*\.mlp\.down_proj\.kernel", P(AXIS, None), None),
    (r"lm_head\.kernel", P(None, AXIS), "vocab"),
    (r".*\.scale", P(), None),
)


def param_spec(path: str, cfg: ModelConfig, tensor_parallel: int) -> P:
    """The PartitionSpec of the parameter at dotted `path` (see the module docstring)."""
    for pattern, spec, needs in _RULES:
        if re.fullmatch(pattern, path):
            if needs == "vocab" and cfg.vocab_size % tensor_parallel:
                return P()
            if needs == "kv" and cfg.num_kv_heads % tensor_parallel:
                return P()
            return spec
    raise ValueError(f"no tensor-parallel rule for parameter {path!r}")


def shard_params(params: Params, mesh: Mesh) -> Params:
    """Places every parameter on `mesh` by `param_spec` and attaches the mesh.

    The returned `Params` carries the mesh (a static field), so the jitted steps in
    `pagedjax.decode` run the tensor-parallel forward with no other change.

    Raises:
      TypeError: `params` is not a `Params` (`model.split_model`), or `mesh` not a `Mesh`.
      ValueError: the model does not split `mesh`'s tp size ways, or `check_mesh`
        refuses the mesh.
    """
    from pagedjax.model import Params  # (pagedjax.model imports this module)

    if not isinstance(params, Params):
        raise TypeError(
            "params must be a split model, pagedjax.model.Params (model.split_model(m), "
            f"model.init_params, weights.load_checkpoint), got {type(params).__name__}"
        )
    cfg = params.config
    tp = check_mesh(mesh)
    check_tensor_parallel(cfg, tp, mesh.devices.size)

    pairs = []
    for path, var in nnx.to_flat_state(params.state):
        spec = param_spec(".".join(str(p) for p in path), cfg, tp)
        pairs.append(
            (path, var.replace(jax.device_put(var.get_value(), NamedSharding(mesh, spec))))
        )
    return params.replace(state=nnx.from_flat_state(pairs), mesh=mesh)


def device_kv_config(cfg: ModelConfig, tensor_parallel: int) -> ModelConfig:
    """`cfg` with one device's kv heads (`max(K, tp) / tp`): sizes the cache per device.

    Raises:
      TypeError: `cfg` is not a `ModelConfig`.
      ValueError: the model does not split `tensor_parallel` ways (`check_tensor_parallel`;
        the devices present are not counted).
    """
    _check_size(tensor_parallel, tensor_parallel)
    _check_split(cfg, tensor_parallel)
    if tensor_parallel == 1:
        return cfg
    per_device = int(cache_kv_heads(cfg, tensor_parallel) // tensor_parallel)
    return dataclasses.replace(cfg, num_kv_heads=per_device)


def host_staging():
    """A context in which new arrays land in host memory (JAX's CPU device), if present.

    Load weights inside it before `shard_params`, so that a model too big for one
    accelerator is never gathered on one.
    """
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return contextlib.nullcontext()
    return jax.default_device(cpu)


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """Every pool `[Kc, P, S, D]` split over its kv-head axis."""
    return NamedSharding(mesh, P(AXIS))


def create_cache(
    model_cfg: ModelConfig,
    cache_cfg: CacheConfig,
    mesh: Mesh | None = None,
    *,
    device: jax.Device | None = None,
) -> cache_lib.PagedKVCache:
    """A zeroed cache; with a mesh, split over kv heads (`Kc = max(K, tp)` rows).

    Without a mesh: committed to `device` (`home_device(params)`: the steps then compile
    one program per bucket, where an uncommitted cache's first step compiled another for
    the committed cache it returns); None: uncommitted, following the params.

    Raises:
      TypeError: `mesh` is neither None nor a `jax.sharding.Mesh`.
      ValueError: the model does not split `mesh`'s tp size ways, or `check_mesh`
        refuses the mesh.
    """
    if mesh is None:
        where = None if device is None else jax.sharding.SingleDeviceSharding(device)
        return cache_lib.create(model_cfg, cache_cfg, sharding=where)
    tp = check_mesh(mesh)
    check_tensor_parallel(model_cfg, tp, mesh.devices.size)
    kc = cache_kv_heads(model_cfg, tp)
    shape_cfg = dataclasses.replace(model_cfg, num_kv_heads=kc)
    return cache_lib.create(shape_cfg, cache_cfg, sharding=cache_sharding(mesh))


def replicate(x, mesh: Mesh | None = None, *, device: jax.Device | None = None) -> jax.Array:
    """`x` on the device (every device of `mesh`, whole), placed as a step's outputs are:
    without a mesh, committed to `device` (None: uncommitted, `create_cache`'s)."""
    if mesh is not None:
        return jax.device_put(x, NamedSharding(mesh, P()))
    return jax.device_put(x) if device is None else jax.device_put(x, device)


def shard_attention(fn: Callable, mesh: Mesh, num_kv_heads: int) -> Callable:
    """Runs one layer's cache write + attention per shard.

    Args:
      fn: `fn(q, k, v, k_pages, v_pages, slot_mapping, page_table, context_lens,
        query_start_loc) -> (o, k_pages, v_pages)` on one device's shard: q and o
        `[T, H/tp, D]`, k and v `[T, Kc/tp, D]`, pools `[Kc/tp, P, S, D]`.
      mesh: the tp mesh.
      num_kv_heads: the model's K.

    Returns:
      The same function on global arrays: q `[T, H, D]` and k, v `[T, K, D]`
      (head-split or, when K < tp, replicated), pools `[Kc, P, S, D]` split over kv
      heads, the metadata replicated.
    """
    rep = max(1, tensor_parallel_size(mesh) // num_kv_heads)
    heads, pools, meta = P(None, AXIS, None), P(AXIS), P()
    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(heads, heads, heads, pools, pools, meta, meta, meta, meta),
        out_specs=(heads, pools, pools),
        # Pallas outputs carry no varying-axes type; every output here is per-shard.
        check_vma=False,
    )

    def run(q, k, v, k_pages, v_pages, *metadata):
        if rep > 1:  # kv head i -> rows i*rep .. (i+1)*rep-1: the devices that read it
            k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        return mapped(q, k, v, k_pages, v_pages, *metadata)

    return run


def gather_logits(logits, mesh: Mesh):
    """Whole `[B, V]` logits on every device, from the vocab-split LM head.

    Pinning the LM head's output to the vocab split first makes XLA all-gather the
    small logits rather than the `[E, V]` weight (which it otherwise prefers).
    """
    tp = tensor_parallel_size(mesh)
    if logits.shape[-1] % tp == 0:
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, AXIS)))
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
