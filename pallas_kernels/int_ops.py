"""Integer division of a kernel's index arrays by static sizes, for every kernel.

`lax.div` / `lax.rem` need both operands of one dtype. A static size (page size, tile,
kv heads) is a Python int, which jax converts to int32 by default but to int64 under
`jax_enable_x64`, where the kernels' index arrays (program ids, lengths, page ids) stay
int32: each kernel failed to trace there ("lax.div requires arguments to have the same
dtypes, got int32, int64"). These cast the size to the array's dtype first, so the
program is the same either way. (`lax.div` rounds toward zero, as the kernels want for
their non-negative indices; `//` would add a floor's sign fix.)
"""

from __future__ import annotations

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
