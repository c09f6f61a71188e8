"""LoRA adapters in PEFT's format, served per request: several adapters in one batch.

A LoRA adapter adds a low-rank update to some of the model's linear layers:
`y = x @ W + scaling * (x @ A.T) @ B.T`, with PEFT's `A` `[r, in]` and `B` `[out, r]`
and `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). This module
keeps the adapters a batch uses on the device in fixed-size slots (`LoRAWeights`) and
applies them per token inside the paged forward (`LoRAWeights.delta`), so that rows of
different adapters (and rows of none) share one step and one compiled program. Reading
and checking adapters on the host (`LoRARequest`, `load_adapter`, `adapter_from_state`,
`check_adapter`, `LoRAAdapter`) is `pagedjax.lora_adapter`'s, re-exported here.

Layout on the device (`LoRAWeights`): per target module and layer, all slots in two
arrays, side by side along the rank axis, the scaling folded into `b`:

    a[module][layer]  [in, S * R]     slot s (1..S) owns columns [(s-1)*R, s*R) of a
    b[module][layer]  [S * R, out]    and the same rows of b; an adapter of rank r < R
                                      fills its first r and leaves zeros after them

(One array per layer, as the model's kernels are: arrays stacked over the layers made
each step slice them, which XLA's CPU backend does not do for free. With 4 rank-16 adapters on
qwen2.5-0.5b in float32 on the CPU, steps with adapters decoded at 0.68-0.69x the base
model's rate stacked and at 0.93x per layer, the update adding 7% to the bytes a step
reads: `scripts/bench_lora.py`, BENCHMARKS.md "LoRA".)

`R` is `max_lora_rank` and `S` is `max_loras`. Slot 0 means no adapter. A step gets
each token's slot (`StepInput.lora_slots`); per layer and module the update is
`((x @ a) * mask) @ b`, with `mask[t]` the 0/1 columns of token t's slot: two
matmuls over `S * R` columns (64 for four rank-16 slots, next to the thousands of
`W`), no gather of per-token weights, and exact for every row, since a token's
product with another slot's columns is multiplied by 0. A step of an engine with LoRA
enabled runs this path whenever one of its rows has an adapter, whatever their mix (one
program per step shape); a step with none runs the base model's program.

Tensor parallelism: for a column-split projection (`pagedjax.sharding`) `a` is
replicated and `b` split over its outputs; for a row-split one (`o_proj`,
`down_proj`) `a` is split over its inputs and `b` replicated, so the update is
partitioned as the projection it adds to (the `[T, S*R]` product of a row-split one
costs one small all-reduce).

`merge_adapter(params, adapter)` folds an adapter into the weights: the dense
reference the tests check the per-token path against, and a way to serve one adapter
with no LoRA overhead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pagedjax import sharding as sharding_lib
from pagedjax.config import ModelConfig
from pagedjax.lora_adapter import (
    TARGET_MODULES,
    LoRAAdapter,
    LoRARequest,
    adapter_from_state,
    check_adapter,
    load_adapter,
    module_dims,
)

__all__ = [
    "TARGET_MODULES",
    "LoRAAdapter",
    "LoRARequest",
    "LoRAWeights",
    "adapter_from_state",
    "check_adapter",
    "create_lora_weights",
    "load_adapter",
    "merge_adapter",
    "module_dims",
    "write_slot",
]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAWeights:
    """The adapters on the device, `max_loras` slots of rank `max_lora_rank` (see the
    module docstring for the layout). A pytree: steps take it as an argument."""

    a: dict[str, tuple[jax.Array, ...]]  # module -> per layer [in, S * R]
    b: dict[str, tuple[jax.Array, ...]]  # module -> per layer [S * R, out], scaling in
    rank: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_slots(self) -> int:
        return next(iter(self.a.values()))[0].shape[-1] // self.rank

    def stacked(self, module: str) -> tuple[np.ndarray, np.ndarray]:
        """(a [L, in, S*R], b [L, S*R, out]) of `module` on the host (inspection, tests)."""
        return np.stack(jax.device_get(self.a[module])), np.stack(jax.device_get(self.b[module]))

    def mask(self, slots) -> jax.Array:
        """[T, S * R] float32: 1 on the columns of each token's slot (`slots` [T] int,
        0: none, so all 0)."""
        owner = jnp.arange(self.num_slots * self.rank) // self.rank + 1
        return (owner[None, :] == slots[:, None]).astype(jnp.float32)

    def delta(self, layer: int, mask, module: str, x):
        """The update of `layer`'s `module` for input rows x [T, in] ([T, out], x's dtype)."""
        h = jnp.dot(x, self.a[module][layer], preferred_element_type=jnp.float32) * mask
        b = self.b[module][layer]
        return jnp.dot(h.astype(b.dtype), b, preferred_element_type=jnp.float32).astype(x.dtype)


def _specs(cfg: ModelConfig, tp: int) -> dict[str, tuple[P, P]]:
    """Per module, the PartitionSpecs of a layer's a and b (module docstring): as the
    base kernel is split, over its outputs (b's last axis) or its inputs (a's first)."""
    out = {}
    for module, block in TARGET_MODULES.items():
        spec = tuple(sharding_lib.param_spec(f"layers.0.{block}.{module}.kernel", cfg, tp))
        spec += (None,) * (2 - len(spec))
        out[module] = (P(spec[0], None), P(None, spec[1]))
    return out


def create_lora_weights(
    cfg: ModelConfig,
    max_loras: int,
    max_lora_rank: int,
    mesh: Mesh | None = None,
    *,
    device: jax.Device | None = None,
) -> LoRAWeights:
    """Empty slots (zeros) for `max_loras` adapters of rank up to `max_lora_rank`, in
    the model's dtype; placed for tensor parallelism over `mesh` when given, else
    committed to `device` (None: uncommitted; `sharding_lib.create_cache`'s: writing an
    adapter returns committed slots, which uncommitted ones would compile again for)."""
    for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={v!r}")
    cols = max_loras * max_lora_rank
    specs = _specs(cfg, sharding_lib.tensor_parallel_size(mesh)) if mesh is not None else None
    a, b = {}, {}
    for module in TARGET_MODULES:
        n_in, n_out = module_dims(cfg, module)
        for d, shape, i in ((a, (n_in, cols), 0), (b, (cols, n_out), 1)):
            s = NamedSharding(mesh, specs[module][i]) if mesh is not None else device
            d[module] = tuple(
                jnp.zeros(shape, cfg.jnp_dtype, device=s) for _ in range(cfg.num_layers)
            )
    return LoRAWeights(a, b, max_lora_rank)


@partial(jax.jit, static_argnames=("rank",))
def _write(a, b, new_a, new_b, slot, *, rank):
    col = (slot - 1) * rank
    put = jax.lax.dynamic_update_slice
    a = {m: tuple(put(x, y, (0, col)) for x, y in zip(a[m], new_a[m], strict=True)) for m in a}
    b = {m: tuple(put(x, y, (col, 0)) for x, y in zip(b[m], new_b[m], strict=True)) for m in b}
    return a, b


def write_slot(weights: LoRAWeights, slot: int, adapter: LoRAAdapter | None) -> LoRAWeights:
    """`weights` with slot `slot` (1..S) holding `adapter` (None: zeros), every module
    and layer the adapter leaves out zeroed. A new pytree: a step in flight keeps
    reading the old one."""
    if not 1 <= slot <= weights.num_slots:
        raise ValueError(f"LoRA slot must be in [1, {weights.num_slots}], got {slot}")
    r = weights.rank
    if adapter is not None and adapter.rank > r:
        raise ValueError(f"LoRA adapter of rank {adapter.rank} > the slots' rank {r}")
    new_a, new_b = {}, {}
    for module in TARGET_MODULES:
        num_layers, (n_in, _) = len(weights.a[module]), weights.a[module][0].shape
        n_out = weights.b[module][0].shape[-1]
        ha = np.zeros((num_layers, n_in, r), np.float32)
        hb = np.zeros((num_layers, r, n_out), np.float32)
        if adapter is not None:
            for (layer, m), (wa, wb) in adapter.weights.items():
                if m == module:
                    ha[layer, :, : wa.shape[1]] = wa
                    hb[layer, : wb.shape[0]] = wb
        dt = weights.a[module][0].dtype
        new_a[module], new_b[module] = tuple(ha.astype(dt)), tuple(hb.astype(dt))
    a, b = _write(weights.a, weights.b, new_a, new_b, np.int32(slot), rank=r)
    return LoRAWeights(a, b, r)


def merge_adapter(params, adapter: LoRAAdapter):
    """`params` with the adapter folded into its kernels (`W + a @ b`, summed in float32,
    cast back): a model that computes what the adapter's requests compute. Tensor-parallel
    `params` (`Params.mesh`, e.g. an engine's) give merged params on the same mesh, each
    array split as before (`params_from_flat` alone keeps no mesh: the result mixed split
    arrays with merged kernels on one device, and no engine or step could run it).
    ValueError if the adapter does not fit the model (`check_adapter`)."""
    from pagedjax import model as model_lib

    check_adapter(adapter, params.config)
    flat = model_lib.params_to_flat(params)
    for (layer, module), (a, b) in adapter.weights.items():
        key = f"layers.{layer}.{TARGET_MODULES[module]}.{module}.kernel"
        w = np.asarray(jax.device_get(flat[key]), np.float32)
        flat[key] = w + a @ b
    merged = model_lib.params_from_flat(params.config, flat)
    return merged if params.mesh is None else sharding_lib.shard_params(merged, params.mesh)
