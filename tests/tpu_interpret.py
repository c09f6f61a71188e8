"""The TPU interpreter's race detector, shared by the TPU kernel tests.

The detector's findings live in private jax state whose home has moved between
jax versions. `races_found()` looks in each known home; `assert_no_race()` is
what every kernel run calls; `test_race_detector_is_live` in each TPU test file
runs `racy_copy_is_flagged()`, so if a jax release moves the state again those
tests skip loudly instead of every no-race assertion passing unseen.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# interpret=True means the interpreter's defaults: DMAs land when waited on, and
# DMAs share 1 vector-clock entry, which hides some races. These settings land
# each DMA when it starts and give DMAs 63 entries, so a read of a buffer that
# was not waited for is reported as a race (checked by mutating the kernels).
SHARP = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager", vector_clock_size=64)

_HOMES = (
    "jax._src.pallas.mosaic.interpret.interpret_pallas_call",  # jax 0.10
    "jax._src.pallas.mosaic.interpret",
)


def _state():
    for name in _HOMES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "races"):
            return module
    return None


def races_found() -> bool | None:
    """Whether the last interpreted kernel raced; None where this jax keeps the flag elsewhere.

    Raises:
      AssertionError: the state exists but holds no detector, i.e. the last kernel
        ran without race detection.
    """
    state = _state()
    if state is None:
        return None
    assert state.races is not None, "the interpreter did not run with race detection"
    return bool(state.races.races_found)


def assert_no_race() -> None:
    assert races_found() is not True, "the TPU interpreter detected a data race"


def racy_copy_is_flagged() -> None:
    """Runs a kernel that reads a DMA's destination before waiting; asserts it is flagged."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    call = pl.pallas_call(
        racy,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
    )
    jax.block_until_ready(call(x))
    found = races_found()
    if found is None:
        pytest.skip("this jax keeps the interpreter's race state elsewhere: races are unchecked")
    assert found, "a racy copy was not flagged: the no-race assertions prove nothing"
