"""`cache.write_layer` and `cache.copy_pages` against a plain numpy page pool, property-based.

Random pools (never zeros, so a stray write shows), random slot mappings with padding
(-1, or under jit any out-of-range drop index the steps use), random copy pairs with
padding, over float32, bfloat16 and FP8 storage; every slot must end bit-for-bit as the
numpy model says. Also: page pools of mismatched layouts are refused by name, not
silently reshaped.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pagedjax import cache as kvcache

FP8 = jnp.float8_e4m3fn
DTYPES = [jnp.float32, jnp.bfloat16, FP8]
PROPERTY = settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
# One jitted program per (pool, token) shape: shapes come from a small grid so that the
# examples share compilations and the module stays fast.
GEOMETRY = st.sampled_from([(1, 3, 2, 4), (2, 4, 4, 8), (2, 2, 1, 4)])  # K, P, S, D


def _pool(rng, shape, dtype):
    x = rng.normal(size=shape).astype(np.float32) * 4
    x[np.abs(x) < 1e-2] = 1.0  # never zero, and no FP8 underflow to zero either
    return jnp.asarray(x).astype(dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _stored(x, dtype):
    """numpy's cast of float32 `x` to the storage dtype (FP8: saturated at +-448)."""
    if dtype == FP8:
        x = np.clip(x, -448, 448)
    return x.astype(np.dtype(dtype))


@seed(20240611)
@PROPERTY
@given(
    geometry=GEOMETRY,
    dtype=st.sampled_from(DTYPES),
    t=st.sampled_from([4, 8]),
    data=st.data(),
    jitted=st.booleans(),
)
def test_write_layer_matches_a_numpy_pool(geometry, dtype, t, data, jitted):
    kh, p, s, d = geometry
    n = p * s
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    real = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=t))
    slots = np.full(t, -1, np.int32)
    where = rng.permutation(t)[: len(real)]
    slots[where] = real
    k_pages, v_pages = _pool(rng, geometry, dtype), _pool(rng, geometry, dtype)
    # K beyond FP8's 448 (saturates), some NaN (kept: a NaN must not be hidden)
    k = (rng.normal(size=(t, kh, d)) * 300).astype(np.float32)
    k[rng.random(k.shape) < 0.05] = np.nan
    v = (rng.normal(size=(t, kh, d)) * 3).astype(np.float32)
    if jitted:
        # traced slots: padding may be any index past the pool, or any negative one
        pad = data.draw(st.sampled_from([-1, -7, n, n + 5, 2**31 - 1]))
        traced = np.where(slots < 0, pad, slots).astype(np.int32)
        got = jax.jit(kvcache.write_layer)(k_pages, v_pages, k, v, traced)
    else:
        got = kvcache.write_layer(k_pages, v_pages, k, v, slots)
    for pages, new, out in zip((k_pages, v_pages), (k, v), got, strict=True):
        want = np.asarray(pages).reshape(kh, n, d).copy()
        written = slots >= 0
        want[:, slots[written]] = _stored(new[written], dtype).transpose(1, 0, 2)
        assert out.shape == pages.shape and out.dtype == pages.dtype
        np.testing.assert_array_equal(_bits(out).reshape(kh, n, d), _bits(want))


@seed(20240612)
@PROPERTY
@given(
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
    jitted=st.booleans(),
)
def test_copy_pages_matches_a_numpy_pool(dtype, data, jitted):
    kh, p, s, d = 2, 6, 2, 4
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    pages = data.draw(st.permutations(range(p)))
    m = data.draw(st.integers(0, p // 2))
    dst = list(pages[:m])
    src = [data.draw(st.sampled_from(pages[m:])) for _ in range(m)]
    pad = 4 - m  # padding pairs (src, -1), interleaved: a fixed [4] shape, one program
    src += [data.draw(st.integers(0, p - 1)) for _ in range(pad)]
    dst += [-1] * pad
    order = rng.permutation(4)
    src, dst = np.asarray(src, np.int32)[order], np.asarray(dst, np.int32)[order]
    pools = [_pool(rng, (kh, p, s, d), dtype) for _ in range(4)]
    cache = kvcache.PagedKVCache(k=tuple(pools[:2]), v=tuple(pools[2:]))
    copy = jax.jit(kvcache.copy_pages) if jitted else kvcache.copy_pages
    out = copy(cache, src, dst)
    for before, after in zip(cache.k + cache.v, out.k + out.v, strict=True):
        want = np.asarray(before).copy()
        real = dst >= 0
        want[:, dst[real]] = np.asarray(before)[:, src[real]]
        np.testing.assert_array_equal(_bits(after), _bits(want))


def test_fp8_storage_is_round_to_nearest_even_and_saturating():
    # every FP8 value, the midpoints between neighbours (ties) and just off them
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mid = (grid[1:] + grid[:-1]) / 2
    up, down = np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)
    x = np.concatenate([grid, mid, up, down, [464.0, 1e30, -np.inf, np.inf]]).astype(np.float32)
    got = kvcache.to_storage(jnp.asarray(x), "fp8")
    np.testing.assert_array_equal(_bits(got), _bits(_stored(x, FP8)))


@pytest.mark.parametrize(
    "v_shape",
    [(2, 2, 8, 8), (2, 4, 4, 4), (1, 4, 4, 8)],  # same size, another layout; other D; other K
)
def test_write_layer_refuses_v_pages_unlike_k_pages(v_shape):
    # A v pool of k's size but another layout was reshaped to k's [K, P, S, D]: the
    # tokens landed in other (page, offset) places and the pool came back reshaped.
    k_pages = jnp.ones((2, 4, 4, 8))
    new = jnp.ones((3, 2, 8))
    with pytest.raises(ValueError, match=r"v_pages must be shaped like k_pages"):
        kvcache.write_layer(k_pages, jnp.ones(v_shape), new, new, np.array([0, 5, -1]))


def test_write_layer_refuses_pages_that_are_not_k_p_s_d():
    pages = jnp.ones((4, 4, 8))  # no kv-head axis
    new = jnp.ones((3, 1, 8))
    with pytest.raises(ValueError, match=r"k_pages must be \[K, P, S, D\], got shape \(4, 4, 8\)"):
        kvcache.write_layer(pages, pages, new, new, np.array([0, 5, -1]))
