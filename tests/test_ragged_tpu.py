"""Tests for the Pallas TPU ragged paged attention kernel (`pallas_kernels.ragged.tpu`).

Every kernel run here uses the TPU interpreter with race detection (`interpret=True`) and
asserts that no race was found. Expected outputs come from dense causal attention over each
whole sequence (`reference.causal_prefill`) in float32, never from the paged XLA path. The
page pools are filled with random garbage before the sequences are written through shuffled
page tables; page-table padding points at a page of NaNs and every slot past a sequence's
context is NaN (a recycled page's stale tail), so a kernel that reads a page it must skip,
or lets a dead slot's value through, returns NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from tpu_interpret import assert_no_race, racy_copy_is_flagged

from pallas_kernels import ragged_paged_attention, reference
from pallas_kernels.ragged.tpu import default_tuning, ragged_paged_attention_tpu

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
# FP8 pages vs the unquantised K/V they were cast from: the relative error is above
# bf16's whole tolerance (so the kernel really read fp8-rounded pages) and below the
# format's unit roundoff, 2**-4 for e4m3fn and 2**-3 for e5m2 (measured: ~2.8% and ~5.7%).
FP8_BOUNDS = {jnp.float8_e4m3fn: (1e-2, 2**-4), jnp.float8_e5m2: (1e-2, 2**-3)}


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raises leaves the interpreter's shared state behind; clear it."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [T, H, D] float32 copy of the kernel's (rounded) input
    args: tuple  # kernel positional args, in the kernel dtype
    dense_k: list  # per sequence [ctx, K, D] float32
    dense_v: list
    q_lens: list
    ctx_lens: list


def _cdiv(a, b):
    return -(-a // b)


def build_batch(
    rng,
    q_lens,
    ctx_lens,
    *,
    num_kv_heads=2,
    group=2,
    head_dim=64,
    page_size=8,
    dtype=jnp.float32,
    pad_rows=0,
    max_pages=None,
    poison_before=None,
    kv_dtype=None,
):
    """A ragged batch written into a shuffled page pool.

    `poison_before[b]`, if given, is a key position below which whole pages of sequence b are
    overwritten with NaN after writing (pages the kernel must skip for a sliding window).
    `kv_dtype` (default `dtype`) is the pools' dtype; the random draws do not depend on the
    dtypes, so one seed with two `kv_dtype`s gives the same K/V, rounded or not.
    """
    kv_dtype = kv_dtype or dtype
    kh, d, s = num_kv_heads, head_dim, page_size
    need = [_cdiv(c, s) for c in ctx_lens]
    max_pages = max_pages or max(max(need), 1)
    num_pages = sum(need) + 3
    ids = list(rng.permutation(num_pages))
    nan_page = ids.pop()
    k_pool = rng.standard_normal((kh, num_pages, s, d)).astype(np.float32)
    v_pool = rng.standard_normal((kh, num_pages, s, d)).astype(np.float32)
    k_pool[:, nan_page] = np.nan
    v_pool[:, nan_page] = np.nan
    page_table = np.full((len(q_lens), max_pages), nan_page, np.int32)
    dense_k, dense_v = [], []
    rnd = lambda x, dt=dtype: np.asarray(jnp.asarray(x, dt).astype(jnp.float32))
    for b, ctx in enumerate(ctx_lens):
        kb = rnd(rng.standard_normal((ctx, kh, d)), kv_dtype)
        vb = rnd(rng.standard_normal((ctx, kh, d)), kv_dtype)
        dense_k.append(kb)
        dense_v.append(vb)
        for j in range(need[b]):
            pid = ids.pop()
            page_table[b, j] = pid
            n = min(s, ctx - j * s)
            k_pool[:, pid, :n] = kb[j * s : j * s + n].transpose(1, 0, 2)
            v_pool[:, pid, :n] = vb[j * s : j * s + n].transpose(1, 0, 2)
            k_pool[:, pid, n:] = np.nan  # a recycled page's stale tail
            v_pool[:, pid, n:] = np.nan
            if poison_before is not None and (j + 1) * s <= poison_before[b]:
                k_pool[:, pid] = np.nan
                v_pool[:, pid] = np.nan
    t = sum(q_lens) + pad_rows
    q = rnd(rng.standard_normal((t, kh * group, d)))
    loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k_pool, kv_dtype),
        jnp.asarray(v_pool, kv_dtype),
        jnp.asarray(page_table),
        jnp.asarray(ctx_lens, jnp.int32),
        jnp.asarray(loc),
    )
    return Batch(q, args, dense_k, dense_v, list(q_lens), list(ctx_lens))


_causal_prefill = jax.jit(
    reference.causal_prefill, static_argnames=("scale", "soft_cap", "sliding_window")
)


def expected(batch, **opts):
    """Dense causal attention over each whole sequence (float32); padding rows zero.

    Each sequence is laid out whole (`[ctx, ...]`, its chunk's queries in the last q_len
    rows) and run through `reference.causal_prefill` in one padded batch.
    """
    out = np.zeros(batch.q.shape, np.float32)
    tmax = max(batch.ctx_lens, default=0)
    if tmax == 0:
        return out
    b, (_, h, d), kh = len(batch.q_lens), batch.q.shape, batch.dense_k[0].shape[1]
    qf = np.zeros((b, tmax, h, d), np.float32)
    kf = np.zeros((b, tmax, kh, d), np.float32)
    vf = np.zeros((b, tmax, kh, d), np.float32)
    starts = np.concatenate([[0], np.cumsum(batch.q_lens)])
    for i, (ql, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        qf[i, ctx - ql : ctx] = batch.q[starts[i] : starts[i] + ql]
        kf[i, :ctx] = batch.dense_k[i]
        vf[i, :ctx] = batch.dense_v[i]
    full = np.asarray(_causal_prefill(qf, kf, vf, jnp.asarray(batch.ctx_lens), **opts))
    for i, (ql, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        out[starts[i] : starts[i] + ql] = full[i, ctx - ql : ctx]
    return out


def run(batch, interpret=True, **kw):
    out = ragged_paged_attention_tpu(*batch.args, interpret=interpret, **kw)
    out = np.asarray(jax.block_until_ready(out).astype(jnp.float32))
    assert_no_race()
    return out


def assert_close(out, ref, dtype):
    assert np.isfinite(out).all(), "NaN/inf in kernel output"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


def check(batch, dtype, *, opts=None, interpret=True, **tuning):
    opts = opts or {}
    out = run(batch, interpret=interpret, **opts, **tuning)
    ref = expected(batch, **opts)
    assert_close(out, ref, dtype)
    total = sum(batch.q_lens)
    np.testing.assert_array_equal(out[total:], 0.0)
    return out


def grid_case(rng, *, num_kv_heads, group, head_dim, page_size, dtype, opts=None, max_pages=3):
    """Lengths 1, a page boundary, the maximum and random; decode rows, chunks, full prefills."""
    cap = max_pages * page_size
    ctx_lens = [1, page_size, cap, int(rng.integers(2, cap)), page_size + 1, cap]
    q_lens = [1, page_size, int(rng.integers(1, 12)), 1, page_size + 1, 0]
    batch = build_batch(
        rng,
        q_lens,
        ctx_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        pad_rows=3,
        max_pages=max_pages,
    )
    check(batch, dtype, opts=opts, pages_per_block=2 if page_size < 64 else 1)


# (num_kv_heads, group, head_dim, page_size, dtype): group 1/4/8 and MQA (K=1); D 64/128/256;
# pages 8..128; both dtypes. The default run takes a representative few.
GRID_FAST = [
    (2, 4, 64, 8, jnp.float32),
    (1, 8, 128, 16, jnp.bfloat16),
    (2, 1, 256, 32, jnp.bfloat16),
]
# (K, G, D) combos covering MQA, group 1/4/8 and D 64/128/256; two per (page size, dtype).
_HEADS = [(2, 1, 64), (1, 4, 128), (2, 8, 256), (1, 8, 64), (4, 1, 128), (2, 4, 256)]
_PAGES = [(s, dt) for s in (8, 16, 32, 64, 128) for dt in (jnp.float32, jnp.bfloat16)]
_OPTS = [{}, {"sliding_window": 13}, {"soft_cap": 8.0, "scale": 0.2}]
GRID_SLOW = [
    (*_HEADS[(i + j) % len(_HEADS)], s, dt, _OPTS[(i + j) % len(_OPTS)])
    for i, (s, dt) in enumerate(_PAGES)
    for j in (0, 1)
]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,page_size,dtype", GRID_FAST)
def test_matches_dense_reference(num_kv_heads, group, head_dim, page_size, dtype):
    grid_case(
        np.random.default_rng(page_size + head_dim),
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )


@pytest.mark.slow
@pytest.mark.parametrize("num_kv_heads,group,head_dim,page_size,dtype,opts", GRID_SLOW)
def test_matches_dense_reference_grid(num_kv_heads, group, head_dim, page_size, dtype, opts):
    grid_case(
        np.random.default_rng(7 * page_size + head_dim + group),
        opts=opts,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )


def fp8_case(seed, *, dtype, kv_dtype, opts=None, **shape):
    """FP8 pages (NaN tails and padding page) with a `dtype` query: tight against dense
    attention on the same fp8 values, loose (FP8_BOUNDS) against the unquantised K/V."""
    q_lens, ctx_lens = [1, 13, 0, 1, 6], [30, 25, 3, 1, 40]
    kw = dict(dtype=dtype, pad_rows=3, **shape)
    batch = build_batch(np.random.default_rng(seed), q_lens, ctx_lens, kv_dtype=kv_dtype, **kw)
    assert batch.args[1].dtype == kv_dtype and batch.args[2].dtype == kv_dtype
    unquantised = build_batch(
        np.random.default_rng(seed), q_lens, ctx_lens, kv_dtype=jnp.float32, **kw
    )
    out = check(batch, dtype, opts=opts, block_q=16, pages_per_block=2)
    ref = expected(unquantised, **(opts or {}))
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    low, high = FP8_BOUNDS[kv_dtype]
    assert low < err < high, f"relative error {err} vs unquantised K/V, expected in {low, high}"


@pytest.mark.parametrize(
    "dtype,shape,opts",
    [
        (jnp.bfloat16, dict(num_kv_heads=2, group=4, head_dim=128, page_size=16), None),
        (
            jnp.float32,
            dict(num_kv_heads=1, group=2, head_dim=64, page_size=8),
            dict(sliding_window=9, soft_cap=5.0),
        ),
    ],
)
def test_fp8_pages(dtype, shape, opts):
    fp8_case(30, dtype=dtype, kv_dtype=jnp.float8_e4m3fn, opts=opts, **shape)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,kv_dtype,shape,opts",
    [
        (
            jnp.bfloat16,
            jnp.float8_e4m3fn,
            dict(num_kv_heads=2, group=1, head_dim=64, page_size=32),
            {},
        ),
        (
            jnp.float32,
            jnp.float8_e4m3fn,
            dict(num_kv_heads=1, group=8, head_dim=256, page_size=16),
            dict(soft_cap=3.0),
        ),
        (
            jnp.bfloat16,
            jnp.float8_e4m3fn,
            dict(num_kv_heads=4, group=1, head_dim=128, page_size=64),
            dict(sliding_window=13),
        ),
        (
            jnp.bfloat16,
            jnp.float8_e4m3fn,
            dict(num_kv_heads=1, group=4, head_dim=128, page_size=128),
            {},
        ),
        (
            jnp.float32,
            jnp.float8_e5m2,
            dict(num_kv_heads=2, group=4, head_dim=128, page_size=8),
            dict(sliding_window=7),
        ),
        (
            jnp.bfloat16,
            jnp.float8_e5m2,
            dict(num_kv_heads=2, group=8, head_dim=64, page_size=16),
            dict(soft_cap=8.0, scale=0.2),
        ),
    ],
)
def test_fp8_pages_grid(dtype, kv_dtype, shape, opts):
    fp8_case(31, dtype=dtype, kv_dtype=kv_dtype, opts=opts, **shape)


def _prefill_sequence(rng, length, page_size=8, num_kv_heads=2, group=2, head_dim=64):
    """One sequence: its dense q/k/v and a pool holding all of its pages."""
    return build_batch(
        rng,
        [length],
        [length],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
    )


def test_chunked_prefill_matches_one_go():
    """A fresh prefill in one go against dense causal attention, then in chunks of random
    sizes, each attending to the pages earlier chunks wrote."""
    rng = np.random.default_rng(2)
    length, bucket, s = 45, 16, 8
    full = _prefill_sequence(rng, length, page_size=s)
    one_go = run(full, block_q=16, pages_per_block=2)
    assert_close(one_go, expected(full), jnp.float32)
    q, k_pool, v_pool, page_table, _, _ = full.args
    # Only what earlier chunks wrote is in the pool: positions from `end` on are NaN.
    clean_k, clean_v = np.asarray(k_pool), np.asarray(v_pool)
    garbage = np.full(clean_k.shape, np.nan, np.float32)
    pages = np.asarray(page_table)[0]
    outs, start = [], 0
    while start < length:
        end = min(length, start + int(rng.integers(1, bucket + 1)))
        kp, vp = garbage.copy(), garbage.copy()
        for j, pid in enumerate(pages[: _cdiv(end, s)]):
            n = min(s, end - j * s)
            kp[:, pid, :n] = clean_k[:, pid, :n]
            vp[:, pid, :n] = clean_v[:, pid, :n]
        qc = jnp.zeros((bucket, *q.shape[1:]), q.dtype).at[: end - start].set(q[start:end])
        chunk = dataclasses.replace(
            full,
            args=(
                qc,
                jnp.asarray(kp),
                jnp.asarray(vp),
                page_table,
                jnp.asarray([end], jnp.int32),
                jnp.asarray([0, end - start], jnp.int32),
            ),
        )
        out = run(chunk, block_q=16, pages_per_block=2)
        np.testing.assert_array_equal(out[end - start :], 0.0)
        outs.append(out[: end - start])
        start = end
    chunked = np.concatenate(outs)
    np.testing.assert_allclose(chunked, one_go, rtol=1e-5, atol=1e-5)
    assert_close(chunked, expected(full), jnp.float32)


def test_mixed_decode_and_prefill_batch():
    """3 decode rows and 2 prefill chunks, interleaved, with shuffled page tables; the
    13-token chunk starts and ends mid page (positions 12..24 over pages of 8).

    Interpreted on two simulated cores: both grid axes are "parallel", so grid steps must not
    share DMA or scratch state.
    """
    rng = np.random.default_rng(3)
    q_lens = [1, 13, 1, 1, 20]
    ctx_lens = [30, 25, 1, 16, 52]
    batch = build_batch(rng, q_lens, ctx_lens, group=4, page_size=8, pad_rows=5)
    two_cores = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    check(batch, jnp.float32, interpret=two_cores, block_q=16, pages_per_block=2)


def test_chunk_starts_and_ends_mid_page():
    rng = np.random.default_rng(4)
    # Prefix of 21 cached tokens (page 1 of 16 half full), a chunk of 19: positions 21..39;
    # one page per KV block.
    batch = build_batch(rng, [19], [40], page_size=16, group=2, pad_rows=2)
    check(batch, jnp.float32, block_q=8, pages_per_block=1)


def test_zero_length_queries_and_padding_rows():
    rng = np.random.default_rng(5)
    q_lens = [0, 3, 0, 0, 1, 0]
    ctx_lens = [0, 9, 4, 0, 17, 8]
    batch = build_batch(rng, q_lens, ctx_lens, page_size=8, pad_rows=20)
    check(batch, jnp.float32, block_q=8, pages_per_block=2)
    # Same shapes, every sequence empty: all rows are padding.
    empty = dataclasses.replace(
        batch, args=(*batch.args[:5], jnp.zeros_like(batch.args[5])), q_lens=[0] * 6
    )
    np.testing.assert_array_equal(run(empty, block_q=8, pages_per_block=2), 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_sliding_window_skips_pages_before_the_window(dtype):
    rng = np.random.default_rng(7)
    window, s = 10, 8
    q_lens = [1, 12, 1]
    ctx_lens = [50, 44, 9]
    # Pages wholly before every query's window are NaN: reading them would poison the output.
    lowest = [c - q - window + 1 for q, c in zip(q_lens, ctx_lens, strict=True)]
    batch = build_batch(
        rng, q_lens, ctx_lens, page_size=s, dtype=dtype, pad_rows=3, poison_before=lowest
    )
    check(batch, dtype, opts=dict(sliding_window=window), block_q=16, pages_per_block=2)


def test_default_tuning_and_dispatch():
    """The dispatcher's backend="tpu" reaches this kernel (per-shape defaults, inside jit)
    with the scale, soft cap and window it was given."""
    rng = np.random.default_rng(9)
    batch = build_batch(rng, [1, 6, 1], [7, 30, 12], page_size=16, group=4, dtype=jnp.bfloat16)
    opts = dict(scale=0.3, soft_cap=5.0, sliding_window=9)
    # Under an outer jit, as the engine calls it: lengths and locations are tracers.
    f = jax.jit(functools.partial(ragged_paged_attention, backend="tpu", interpret=True, **opts))
    out = jax.block_until_ready(f(*batch.args))
    assert_no_race()
    assert_close(np.asarray(out.astype(jnp.float32)), expected(batch, **opts), jnp.bfloat16)


@pytest.mark.parametrize(
    "shape", [(1, 8, 64, 8, 3), (200, 4, 128, 16, 500), (7, 32, 256, 128, 1), (64, 1, 64, 64, 9)]
)
def test_default_tuning_satisfies_constraints(shape):
    t, group, d, s, max_pages = shape
    for dtype in (jnp.float32, jnp.bfloat16):
        tune = default_tuning(t, 2 * group, 2, d, s, max_pages, dtype)
        assert tune["block_q"] % (16 if dtype == jnp.bfloat16 else 8) == 0
        ppb = tune["pages_per_block"]
        assert ppb & (ppb - 1) == 0
        block_kv = ppb * s
        assert block_kv >= 128 and block_kv % 128 == 0


@pytest.mark.parametrize(
    "knobs,match",
    [
        (dict(block_q=12), "block_q=12"),
        (dict(block_q=8), "block_q=8"),  # bf16 needs multiples of 16
        (dict(pages_per_block=3), "pages_per_block=3"),
        (dict(pages_per_block=0), "pages_per_block=0"),
        (dict(vmem_limit_bytes=-1), "vmem_limit_bytes=-1"),
        # Bools, floats and non-numbers, as the other kernels refuse them: True ran as 1
        # page per block (or a 1-byte VMEM limit), 16.0 was taken, a numpy float was
        # numpy's "ufunc 'bitwise_and' not supported", a list int()'s TypeError.
        (dict(pages_per_block=True), "pages_per_block=True"),
        (dict(vmem_limit_bytes=True), "vmem_limit_bytes=True"),
        (dict(block_q=16.0), "block_q=16.0"),
        (dict(pages_per_block=np.float64(2.0)), r"pages_per_block=np.float64\(2.0\)"),
        (dict(block_q=[16]), r"block_q=\[16\]"),
    ],
)
def test_bad_tuning_knobs(knobs, match):
    batch = build_batch(np.random.default_rng(0), [1], [3], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_tpu(*batch.args, **knobs)


def test_unknown_tuning_knob_is_a_type_error():
    batch = build_batch(np.random.default_rng(0), [1], [3])
    with pytest.raises(TypeError, match="block_k"):
        ragged_paged_attention_tpu(*batch.args, block_k=4)


@pytest.mark.parametrize(
    "page_size,dtype,head_dim,group",
    [
        (16, jnp.bfloat16, 128, 4),
        (64, jnp.bfloat16, 128, 4),
        (8, jnp.bfloat16, 64, 1),
        (128, jnp.float32, 256, 8),
    ],
)
def test_lowers_for_tpu(page_size, dtype, head_dim, group):
    kh, num_pages, batch, max_pages, t = 2, 64, 5, 16, 100
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, kh * group, head_dim), dtype),
        sds((kh, num_pages, page_size, head_dim), dtype),
        sds((kh, num_pages, page_size, head_dim), dtype),
        sds((batch, max_pages), jnp.int32),
        sds((batch,), jnp.int32),
        sds((batch + 1,), jnp.int32),
    )
    f = functools.partial(ragged_paged_attention_tpu, sliding_window=64, soft_cap=30.0)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize(
    "dtype,kv_dtype,page_size",
    [(jnp.bfloat16, jnp.float8_e4m3fn, 16), (jnp.float32, jnp.float8_e5m2, 64)],
)
def test_fp8_lowers_for_tpu(dtype, kv_dtype, page_size):
    kh, group, head_dim, num_pages, batch, max_pages, t = 2, 4, 128, 64, 5, 16, 100
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, kh * group, head_dim), dtype),
        sds((kh, num_pages, page_size, head_dim), kv_dtype),
        sds((kh, num_pages, page_size, head_dim), kv_dtype),
        sds((batch, max_pages), jnp.int32),
        sds((batch,), jnp.int32),
        sds((batch + 1,), jnp.int32),
    )
    f = functools.partial(ragged_paged_attention_tpu, sliding_window=64, soft_cap=30.0)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    # The pools reach the kernel as fp8 (DMA'd as such): no upcast copy outside it.
    fp8 = "f8E4M3FN" if kv_dtype == jnp.float8_e4m3fn else "f8E5M2"
    assert f"tensor<2x64x{page_size}x128x{fp8}>" in text


def test_race_detector_is_live():
    """Guards the no-race assertions above: a DMA read before its wait must be flagged."""
    racy_copy_is_flagged()


@pytest.mark.parametrize("dtype,highest", [(jnp.float32, 2), (jnp.bfloat16, 0)])
def test_float32_matmuls_run_at_highest_precision(dtype, highest):
    """Both float32 dots ask for HIGHEST (multi-pass on the MXU), as the decode kernel's:
    without it Mosaic's default may run one bf16 pass, which the interpreter (exact f32)
    cannot show. bf16 dots keep the default."""
    sds = jax.ShapeDtypeStruct
    args = (
        sds((100, 8, 128), dtype),
        sds((2, 64, 16, 128), dtype),
        sds((2, 64, 16, 128), dtype),
        sds((5, 16), jnp.int32),
        sds((5,), jnp.int32),
        sds((6,), jnp.int32),
    )
    text = str(jax.make_jaxpr(ragged_paged_attention_tpu)(*args))
    assert text.count("dot_general") == 2
    assert text.count("precision=(Precision.HIGHEST") == highest
