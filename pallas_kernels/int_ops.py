"""Integer division of a kernel's index arrays by static sizes, for every kernel.

`lax.div` / `lax.rem` need both operands of one dtype. A static size (page size, tile,
kv heads) is a Python int, which jax converts to int32 by default but to int64 under
`jax_enable_x64`, where the kernels' index arrays (program ids, lengths, page ids) stay
int32: each kernel failed to trace there ("lax.div requires arguments to have the same
dtypes, got int32, int64"). These cast the size to the array's dtype first, so the
program is the same either way. (`lax.div` rounds toward zero, as the kernels want for
their non-negative indices; `//` would add a floor's sign fix.)

`page_ids` is the one clamp every kernel applies to the page ids it loads: under an
outer jit the page table is a tracer the host never checked, and an id outside the pool
must not move a gathered load (GPU) or a DMA (TPU) outside it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def div(x, d: int):
    """`lax.div(x, d)` with the static int `d` in `x`'s dtype."""
    return lax.div(x, _like(x, d))


def rem(x, d: int):
    """`lax.rem(x, d)` with the static int `d` in `x`'s dtype."""
    return lax.rem(x, _like(x, d))


def _like(x, d: int):
    dtype = getattr(x, "dtype", None)
    return d if dtype is None else np.asarray(d, dtype)


def page_ids(page, num_pages: int):
    """Page ids as every kernel reads them: in [0, num_pages) whatever the table holds.

    An id is read as the XLA reference's gather (`pages[:, page_table]`) reads it: a
    negative id wraps once (`id + num_pages`, as numpy indexing does), then ids clamp to
    [0, num_pages). Valid ids are unchanged, so valid inputs give the same output as
    without the clamp; an id the host checks would refuse (possible only when the table
    is traced) reads a page of the pool, the reference's page, never memory past it.
    """
    n = _like(page, num_pages)
    return jnp.clip(jnp.where(page < 0, page + n, page), 0, n - 1)
