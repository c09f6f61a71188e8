"""Kernel bounds review: traced values the host cannot check never move a kernel's
loads, DMAs or stores outside its arrays.

Under an outer `jax.jit` (or `lax.scan`, `vmap`: the step API's documented
compositions) the page table, lengths and `query_start_loc` are tracers, so the host
checks (`pallas_kernels.validation`) let any int32 through. On a GPU an out-of-bounds
load is undefined behaviour (garbage, or an illegal-address fault that kills the
process); on a TPU an out-of-range DMA faults. The output for such inputs is garbage
by contract; the memory accesses must stay inside the arrays, and the kernels read bad
values the way these tests pin down:

* page ids: as the XLA reference's gather does (a negative id wraps once by P, then
  ids clamp to [0, P)), so every backend gives the reference's output;
* ragged `context_lens`: clamped to [0, max_pages * page_size], as the decode kernels
  already clamp `lengths` from above;
* ragged `query_start_loc` (GPU kernel): made non-decreasing and clamped to [0, T].

How a missing clamp is seen without a GPU: the TPU interpreter raises on an
out-of-bounds DMA or SMEM read ("Out-of-bounds read of ..."), so the TPU kernels
would fail with that error; the GPU interpreter gathers with clamped indices instead,
row by row rather than page by page, so the GPU kernels' output would differ from
the policy's (checked: every test here but the two guards failed before the kernels
clamped; on the old kernels the slow random test's wild lengths ran for minutes: an
unclamped context of ~2**30 tokens is a loop over millions of KV blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from pallas_kernels import reference

I32_MAX = 2**31 - 1
I32_MIN = -(2**31)
NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE, HEAD_DIM, NUM_HEADS = 1, 6, 8, 16, 2
MAX_PAGES = 2
CAPACITY = MAX_PAGES * PAGE_SIZE  # 16 tokens per page-table row
TOKENS = 7  # ragged query rows


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _pools(seed=0):
    rng = np.random.default_rng(seed)
    shape = (NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return rng, k, v


def _close(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


@functools.cache
def _decode(backend, window=None):
    # Through the dispatcher under jit: the lengths and page table are tracers.
    return jax.jit(
        functools.partial(
            pallas_kernels.paged_decode_attention,
            backend=backend,
            interpret=True,
            sliding_window=window,
        )
    )


@functools.cache
def _ragged(backend):
    return jax.jit(
        functools.partial(pallas_kernels.ragged_paged_attention, backend=backend, interpret=True)
    )


def _ref_ragged(q, k, v, table, ctx, qsl):
    return reference.ragged_paged_attention_xla(q, k, v, table, ctx, qsl)


# Page ids past the pool (P, 2P + 3, int32 max) and below 0 (-1, -P - 2, int32 min) in
# entries the queries read: the reference reads them as pages 5, 5, 5, 5, 0 and 0.
BAD_TABLE = [[NUM_PAGES, -1], [2 * NUM_PAGES + 3, I32_MIN], [-NUM_PAGES - 2, I32_MAX]]


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_decode_reads_out_of_range_page_ids_as_the_reference_does(backend):
    rng, k, v = _pools()
    q = jnp.asarray(rng.standard_normal((3, NUM_HEADS, HEAD_DIM)), jnp.float32)
    lengths = jnp.array([13, 16, 9], jnp.int32)  # every entry of the table is read
    table = jnp.array(BAD_TABLE, jnp.int32)
    out = _decode(backend)(q, k, v, lengths, table)
    _close(out, reference.paged_attention_xla(q, k, v, lengths, table))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_ragged_reads_out_of_range_page_ids_as_the_reference_does(backend):
    rng, k, v = _pools(1)
    q = jnp.asarray(rng.standard_normal((TOKENS, NUM_HEADS, HEAD_DIM)), jnp.float32)
    ctx = jnp.array([13, 16, 9], jnp.int32)
    qsl = jnp.array([0, 3, 4, 6], jnp.int32)  # a chunk, a decode row, a chunk, a padding row
    table = jnp.array(BAD_TABLE, jnp.int32)
    out = _ragged(backend)(q, k, v, table, ctx, qsl)
    _close(out, _ref_ragged(q, k, v, table, ctx, qsl))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_ragged_clamps_context_lens_to_the_page_table(backend):
    # Past the capacity the kernels walked pages past the row (the last sequence's past
    # the table); int32 min wrapped the TPU kernel's causal limit around to int32 max.
    rng, k, v = _pools(2)
    q = jnp.asarray(rng.standard_normal((TOKENS, NUM_HEADS, HEAD_DIM)), jnp.float32)
    table = jnp.array([[1, 2], [3, 4], [5, 0]], jnp.int32)
    qsl = jnp.array([0, 3, 4, 6], jnp.int32)
    for ctx in ([CAPACITY + 9, I32_MIN, I32_MAX], [-5, I32_MAX, CAPACITY + 1]):
        ctx = jnp.array(ctx, jnp.int32)
        out = _ragged(backend)(q, k, v, table, ctx, qsl)
        _close(out, _ref_ragged(q, k, v, table, jnp.clip(ctx, 0, CAPACITY), qsl))


BAD_QSL = (
    [-3, 3, 4, 6],  # starts below 0
    [0, 3, 9, 6],  # past T, then back
    [0, I32_MAX, I32_MIN, 5],
    [I32_MIN, 3, I32_MAX, I32_MAX],
    [0, 7, 0, 7],  # a drop of T
)


def test_gpu_ragged_reads_query_start_loc_non_decreasing_within_the_rows():
    # Rows outside [0, T) were loaded and stored (q and the output are whole-array refs).
    rng, k, v = _pools(3)
    q = jnp.asarray(rng.standard_normal((TOKENS, NUM_HEADS, HEAD_DIM)), jnp.float32)
    table = jnp.array([[1, 2], [3, 4], [5, 0]], jnp.int32)
    ctx = jnp.array([12, 13, 14], jnp.int32)  # >= any q_len the clamped locs give
    for loc in BAD_QSL:
        qsl = jnp.array(loc, jnp.int32)
        policy = jnp.clip(jax.lax.cummax(qsl), 0, TOKENS)
        out = _ragged("gpu")(q, k, v, table, ctx, qsl)
        _close(out, _ref_ragged(q, k, v, table, ctx, policy))


def test_tpu_ragged_any_query_start_loc_stays_in_bounds():
    # Guard (passed before the review too): the TPU kernel's q and output move through
    # BlockSpecs, and with context_lens clamped its page walk is bounded by them alone,
    # so no query_start_loc makes the interpreter report an out-of-bounds read.
    rng, k, v = _pools(3)
    q = jnp.asarray(rng.standard_normal((TOKENS, NUM_HEADS, HEAD_DIM)), jnp.float32)
    table = jnp.array([[1, 2], [3, 4], [5, 0]], jnp.int32)
    ctx = jnp.array([12, 13, 14], jnp.int32)
    for loc in BAD_QSL:
        out = _ragged("tpu")(q, k, v, table, ctx, jnp.array(loc, jnp.int32))
        assert out.shape == q.shape


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("window", [None, 3])
def test_decode_lengths_at_the_int32_extremes(backend, window):
    # Guard (passed before the review too): lengths clamp to the capacity from above, and
    # a negative one (int32 min included, whose window start wraps) reads nothing.
    rng, k, v = _pools(4)
    q = jnp.asarray(rng.standard_normal((3, NUM_HEADS, HEAD_DIM)), jnp.float32)
    table = jnp.array([[1, 2], [3, 4], [5, 0]], jnp.int32)
    lengths = jnp.array([I32_MIN, I32_MAX, -5], jnp.int32)
    out = _decode(backend, window)(q, k, v, lengths, table)
    clamped = jnp.clip(lengths, 0, CAPACITY)
    ref = reference.paged_attention_xla(q, k, v, clamped, table, sliding_window=window)
    _close(out, ref)


def _policy_pages(table):
    table = np.asarray(table, np.int64)
    return np.clip(np.where(table < 0, table + NUM_PAGES, table), 0, NUM_PAGES - 1)


def _wild(rng, shape, lo, hi):
    """int32 values: mostly in [lo, hi), some at or past the int32 extremes' edges."""
    x = rng.integers(lo, hi, size=shape, dtype=np.int64)
    wild = rng.integers(I32_MIN, I32_MAX, size=shape, dtype=np.int64, endpoint=True)
    near = rng.integers(-3, 3, size=shape) + rng.choice([lo, hi, I32_MIN + 3, I32_MAX - 3], shape)
    pick = rng.integers(0, 4, size=shape)
    out = np.where(pick == 0, x, np.where(pick == 1, wild, np.where(pick == 2, near, x)))
    return jnp.asarray(np.clip(out, I32_MIN, I32_MAX), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_random_wild_values_read_as_the_policy(seed):
    # Every kernel, on random int32 page tables, lengths and query_start_loc: its output
    # is its output on the values the policy makes of them (NaN-equal: rows no program
    # writes are the same rows), and the TPU interpreter reports no out-of-bounds read.
    rng, k, v = _pools(seed)
    batch = 3
    table = _wild(rng, (batch, MAX_PAGES), 0, NUM_PAGES)
    fixed = jnp.asarray(_policy_pages(table), jnp.int32)

    q = jnp.asarray(rng.standard_normal((batch, NUM_HEADS, HEAD_DIM)), jnp.float32)
    lengths = _wild(rng, (batch,), 0, CAPACITY + 1)
    lengths_fixed = jnp.clip(lengths, 0, CAPACITY)
    for backend in ("gpu", "tpu"):
        out = _decode(backend)(q, k, v, lengths, table)
        want = _decode(backend)(q, k, v, lengths_fixed, fixed)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))

    q = jnp.asarray(rng.standard_normal((TOKENS, NUM_HEADS, HEAD_DIM)), jnp.float32)
    ctx = _wild(rng, (batch,), 0, CAPACITY + 1)
    ctx_fixed = jnp.clip(ctx, 0, CAPACITY)
    qsl = _wild(rng, (batch + 1,), 0, TOKENS + 1)
    qsl_fixed = jnp.clip(jax.lax.cummax(qsl), 0, TOKENS)
    for backend, loc_fixed in (("gpu", qsl_fixed), ("tpu", qsl)):
        out = _ragged(backend)(q, k, v, table, ctx, qsl)
        want = _ragged(backend)(q, k, v, fixed, ctx_fixed, loc_fixed)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
