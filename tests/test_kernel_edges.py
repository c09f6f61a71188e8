"""Edge cases of the four Pallas kernels, differentially against the XLA reference.

The kernel tests (test_paged_decode_{gpu,tpu}.py, test_ragged_{gpu,tpu}.py) cover the
shape grid of DESIGN.md; this file aims at what they leave out, in one batch each:
lengths 0, 1, a page multiple and the table's maximum side by side; sliding windows
of 1, equal to the length, longer than it and ending on a page boundary, with a soft
cap; split-K with more splits than live blocks (empty splits, m = -inf partials) and
splits that do not divide the blocks, through both merges; group sizes that are not
powers of two (3, 6, 12), MQA and MHA; page-table padding that is out of range (under
an outer jit, and in eager calls, whose host check skips unread entries) and pools
that are NaN wherever no visible key lives; fp8 pages; ragged batches with empty
sequences, decode rows next to long chunks, fresh prefills and chunks that start and
end mid page.

Every kernel reads NaN-poisoned pools (dead slots, slots before the window, pages
nobody owns); the reference reads the clean pools, in float32. Tolerances are
relative (||out - ref|| / ||ref||): float32 1e-4, bfloat16 and float16 1e-2; NaN
never passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from tpu_interpret import assert_no_race

import pallas_kernels
from pallas_kernels import reference

TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 1e-2}
F32 = jnp.float32
BIG_ID = 1 << 20  # an out-of-range page id for padding entries (never read)

_ref_decode = jax.jit(
    reference.paged_attention_xla, static_argnames=("scale", "soft_cap", "sliding_window")
)
_ref_ragged = jax.jit(
    reference.ragged_paged_attention_xla, static_argnames=("scale", "soft_cap", "sliding_window")
)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _pools(rng, seqs, *, num_kv_heads, head_dim, page_size, max_pages, spare=3):
    """Clean and poisoned page pools and a shuffled page table.

    Args:
      seqs: per sequence (ctx, lo): keys [lo, ctx) are visible to some query; every
        other slot of the pools is NaN in the poisoned copy.

    Returns:
      (k, v, k_nan, v_nan, page_table, nan_page): pools [K, P, S, D] float32 (numpy),
      page_table [B, max_pages] int32 with padding entries naming `nan_page`, a page
      nobody owns.
    """
    need = [-(-ctx // page_size) for ctx, _ in seqs]
    num_pages = sum(need) + spare
    perm = rng.permutation(num_pages)
    nan_page = int(perm[-1])
    table = np.full((len(seqs), max_pages), nan_page, np.int32)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    live = np.zeros((num_pages, page_size), bool)
    off = 0
    for b, ((ctx, lo), n) in enumerate(zip(seqs, need, strict=True)):
        table[b, :n] = perm[off : off + n]
        off += n
        t = np.arange(lo, ctx)
        live[table[b, t // page_size], t % page_size] = True
    dead = ~live[None, :, :, None]
    return k, v, np.where(dead, np.nan, k), np.where(dead, np.nan, v), table, nan_page


def _assert_close(out, ref, dtype, zero_rows=()):
    out = np.asarray(jnp.asarray(out).astype(F32))
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"non-finite rows: {np.argwhere(~np.isfinite(out))[:5]}"
    for r in zero_rows:
        assert not out[r].any(), f"row {r} must be zero"
    if not ref.any():  # every row empty: exact zeros, not a relative error of 0 / 0
        assert not out.any(), "every row has nothing to attend to: the output must be zero"
        return
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[jnp.dtype(dtype)], f"relative error {err:.3g}"


# ---------------------------------------------------------------- decode


def decode_case(
    backend,
    lengths,
    *,
    heads=(4, 2),
    head_dim=32,
    page_size=8,
    max_pages=None,
    dtype=F32,
    kv_dtype=None,
    seed=0,
    scale=None,
    soft_cap=None,
    sliding_window=None,
    out_of_range_padding=False,
    **tuning,
):
    """Runs one decode batch through `backend` (interpreted) and checks it."""
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads = heads
    max_pages = max_pages or max(1, max(-(-n // page_size) for n in lengths))
    w = sliding_window
    seqs = [(n, 0 if w is None else max(n - w, 0)) for n in lengths]
    k, v, k_nan, v_nan, table, _ = _pools(
        rng,
        seqs,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
    )
    q = rng.standard_normal((len(lengths), num_heads, head_dim)).astype(np.float32)
    kv_dtype = kv_dtype or dtype
    q = jnp.asarray(q, dtype)
    k, v, k_nan, v_nan = (jnp.asarray(x, kv_dtype) for x in (k, v, k_nan, v_nan))
    lens = jnp.asarray(lengths, jnp.int32)
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    interpret = True
    kernel_table = table.copy()
    if out_of_range_padding:
        for b, n in enumerate(lengths):
            kernel_table[b, -(-n // page_size) :] = BIG_ID
    run = functools.partial(
        pallas_kernels.paged_decode_attention,
        backend=backend,
        interpret=interpret,
        **opts,
        **tuning,
    )
    if out_of_range_padding:  # values are unchecked under jit: the table reaches the kernel
        run = jax.jit(run)
    out = jax.block_until_ready(run(q, k_nan, v_nan, lens, jnp.asarray(kernel_table)))
    if backend == "tpu":
        assert_no_race()
    assert out.dtype == q.dtype
    ref = _ref_decode(q.astype(F32), k.astype(F32), v.astype(F32), lens, jnp.asarray(table), **opts)
    zero = [b for b, n in enumerate(lengths) if n == 0]
    _assert_close(out, ref, dtype, zero)
    return out


# ---------------------------------------------------------------- ragged


def ragged_case(
    backend,
    q_lens,
    ctx_lens,
    *,
    heads=(4, 2),
    head_dim=32,
    page_size=8,
    max_pages=None,
    pad_rows=0,
    dtype=F32,
    kv_dtype=None,
    seed=0,
    scale=None,
    soft_cap=None,
    sliding_window=None,
    out_of_range_padding=False,
    **tuning,
):
    """Runs one ragged batch through `backend` (interpreted) and checks it."""
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads = heads
    max_pages = max_pages or max(1, max(-(-c // page_size) for c in ctx_lens))
    w = sliding_window
    # Keys visible to some query of sequence b: from the first query's window start.
    seqs = [
        (c, 0 if w is None or q == 0 else max(c - q - w + 1, 0))
        for q, c in zip(q_lens, ctx_lens, strict=True)
    ]
    seqs = [(c, lo) if q else (0, 0) for (c, lo), q in zip(seqs, q_lens, strict=True)]
    k, v, k_nan, v_nan, table, _ = _pools(
        rng,
        [(c, 0) for c in ctx_lens],  # pages for every token; poison from `seqs` below
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
    )
    live = np.zeros(k.shape[1:3], bool)
    for b, (c, lo) in enumerate(seqs):
        t = np.arange(lo, c)
        live[table[b, t // page_size], t % page_size] = True
    dead = ~live[None, :, :, None]
    k_nan, v_nan = np.where(dead, np.nan, k), np.where(dead, np.nan, v)
    num_rows = sum(q_lens) + pad_rows
    q = rng.standard_normal((num_rows, num_heads, head_dim)).astype(np.float32)
    kv_dtype = kv_dtype or dtype
    q = jnp.asarray(q, dtype)
    k, v, k_nan, v_nan = (jnp.asarray(x, kv_dtype) for x in (k, v, k_nan, v_nan))
    ctx = jnp.asarray(ctx_lens, jnp.int32)
    loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    kernel_table = table.copy()
    if out_of_range_padding:
        for b, c in enumerate(ctx_lens):
            kernel_table[b, -(-c // page_size) :] = BIG_ID
    run = functools.partial(
        pallas_kernels.ragged_paged_attention,
        backend=backend,
        interpret=True,
        **opts,
        **tuning,
    )
    if out_of_range_padding:
        run = jax.jit(run)
    out = jax.block_until_ready(run(q, k_nan, v_nan, jnp.asarray(kernel_table), ctx, loc))
    if backend == "tpu":
        assert_no_race()
    assert out.dtype == q.dtype
    ref = _ref_ragged(
        q.astype(F32), k.astype(F32), v.astype(F32), jnp.asarray(table), ctx, loc, **opts
    )
    _assert_close(out, ref, dtype, range(sum(q_lens), num_rows))
    return out


# ---------------------------------------------------------------- default: the key edges

# Page size 8, max_pages 4 (capacity 32): lengths 0 (a zero row), 1, one page, the
# table's maximum, two pages exactly, and one mid page.
LENGTHS = [0, 1, 8, 32, 16, 13]


def test_gpu_decode_empty_splits_group_6_window_on_a_page_boundary():
    # G = 6 (padded to 16 rows); 16-token blocks, so at most 2 live blocks per sequence
    # against 7 splits: most splits are empty (m = -inf, l = 0) and must merge to
    # nothing, and the length-0 row to zeros. W = 16 ends on a page boundary for the
    # lengths that are page multiples; soft cap on top.
    decode_case(
        "gpu",
        LENGTHS,
        heads=(12, 2),
        max_pages=4,
        sliding_window=16,
        soft_cap=3.0,
        num_splits=7,
        block_kv=16,
    )


def test_gpu_decode_wide_merge_with_out_of_range_padding_under_jit():
    # 9 splits: the wide merge, with empty splits; MQA with G = 3; the page-table padding
    # is an out-of-range id that only an outer jit lets through: it must never be read.
    decode_case(
        "gpu",
        [0, 40, 1, 24, 17],
        heads=(3, 1),
        max_pages=5,
        num_splits=9,
        block_kv=16,
        dtype=jnp.bfloat16,
        out_of_range_padding=True,
    )


def test_tpu_decode_group_6_window_and_out_of_range_padding():
    decode_case(
        "tpu",
        LENGTHS,
        heads=(12, 2),
        max_pages=4,
        sliding_window=9,
        soft_cap=3.0,
        pages_per_block=2,
        num_cores=2,
        out_of_range_padding=True,
    )


RAGGED_Q = [0, 1, 19, 12, 0, 5]  # empty, a decode row, a chunk crossing 3 pages, ...
RAGGED_CTX = [7, 32, 30, 12, 0, 40]  # ... a fresh prefill (ctx == q_len), an empty slot


def test_gpu_ragged_empty_sequences_decode_row_fresh_prefill_window_1():
    ragged_case(
        "gpu",
        RAGGED_Q,
        RAGGED_CTX,
        heads=(6, 2),
        max_pages=5,
        pad_rows=3,
        sliding_window=1,
        block_q=4,
        block_kv=16,
        out_of_range_padding=True,
    )


def test_tpu_ragged_empty_sequences_decode_row_fresh_prefill_window_and_cap():
    ragged_case(
        "tpu",
        RAGGED_Q,
        RAGGED_CTX,
        heads=(3, 1),
        max_pages=5,
        pad_rows=3,
        sliding_window=8,
        soft_cap=2.0,
        block_q=8,
        pages_per_block=2,
        out_of_range_padding=True,
    )


def test_tpu_ragged_head_dim_not_a_multiple_of_128():
    # Regression: the running max/sum are lane-replicated [M, 128] and were widened to
    # [M, D] by whole copies, so 128 < D with D % 128 != 0 (160, 192) raised "mul got
    # incompatible shapes for broadcasting: (32, 192), (32, 128)" at trace time (in the
    # interpreter and in the lowering for TPU) while the TPU decode kernel ran.
    ragged_case("tpu", [1, 9, 0], [20, 9, 3], heads=(2, 1), head_dim=192, max_pages=3)


# ------------------------------------------- eager calls with invalid page-table padding

# Page size 8, max_pages 4, window 9. Decode row b reads tokens [max(n - 9, 0), n);
# ragged sequence b from its first query's window start, max(ctx - q_len - 9 + 1, 0).
PAD_LENGTHS = [0, 1, 13, 32, 20, 16]  # 32: pages 0-1 are before the window; 16: lo = 7
PAD_Q = [0, 1, 5, 3, 4, 2]  # ... an empty sequence, a decode row, a fresh prefill
PAD_CTX = [7, 32, 20, 3, 13, 26]  # 26 - 2 - 9 + 1 = 16: the window starts on page 2


def _read_pages(lo, hi, page_size=8):
    """Per sequence, the page-table entries [first, end) covering tokens [lo, hi)."""
    return [(a // page_size, -(-b // page_size)) for a, b in zip(lo, hi, strict=True)]


def _padded_tables(rng, reads, num_pages, max_pages=4):
    """A table with valid ids everywhere, and a copy whose unread entries are invalid."""
    valid = rng.integers(0, num_pages, (len(reads), max_pages)).astype(np.int32)
    bad = valid.copy()
    junk = np.array([-1, BIG_ID, -BIG_ID, num_pages], np.int32)
    for b, (first, end) in enumerate(reads):
        unread = [i for i in range(max_pages) if not first <= i < end]
        bad[b, unread] = junk[np.arange(len(unread)) % len(junk)]
    return valid, bad


# The XLA path with invalid unread entries, eagerly, one entry at a time for each window
# case: tests/test_dispatch.py's test_page_ids_are_checked_where_the_call_reads_them.
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_eager_decode_with_invalid_padding_equals_valid_padding(backend):
    """-1 and out-of-range ids past each length and before each window, called eagerly
    (the page table concrete): the host check used to refuse any of them ("page id -1 at
    page_table[0, 0] is out of range") though no backend reads them and the same call
    under jit ran. Now it runs and equals, bit for bit, the call whose padding names
    valid (other) pages: a backend reading padding would differ or fault."""
    rng = np.random.default_rng(11)
    window, n = 9, np.array(PAD_LENGTHS)
    lo = np.maximum(n - window, 0)
    valid, bad = _padded_tables(rng, _read_pages(lo, n), num_pages=12)
    q = jnp.asarray(rng.standard_normal((len(n), 4, 16)), F32)
    k, v = (jnp.asarray(rng.standard_normal((2, 12, 8, 16)), F32) for _ in range(2))
    kw = dict(sliding_window=window, backend=backend, interpret=True)
    lengths = jnp.asarray(n, jnp.int32)
    out = pallas_kernels.paged_decode_attention(q, k, v, lengths, jnp.asarray(bad), **kw)
    if backend == "tpu":
        assert_no_race()
    want = pallas_kernels.paged_decode_attention(q, k, v, lengths, jnp.asarray(valid), **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    ref = _ref_decode(q, k, v, lengths, jnp.asarray(valid), sliding_window=window)
    _assert_close(out, ref, F32, zero_rows=[0])


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_eager_ragged_with_invalid_padding_equals_valid_padding(backend):
    rng = np.random.default_rng(12)
    window, q_lens, ctx = 9, np.array(PAD_Q), np.array(PAD_CTX)
    lo = np.maximum(ctx - q_lens - window + 1, 0)
    valid, bad = _padded_tables(rng, _read_pages(lo, ctx), num_pages=12)
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()) + 2, 4, 16)), F32)  # 2 pad rows
    k, v = (jnp.asarray(rng.standard_normal((2, 12, 8, 16)), F32) for _ in range(2))
    loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kw = dict(sliding_window=window, backend=backend, interpret=True)
    ctx_j = jnp.asarray(ctx, jnp.int32)
    out = pallas_kernels.ragged_paged_attention(q, k, v, jnp.asarray(bad), ctx_j, loc, **kw)
    if backend == "tpu":
        assert_no_race()
    want = pallas_kernels.ragged_paged_attention(q, k, v, jnp.asarray(valid), ctx_j, loc, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    ref = _ref_ragged(q, k, v, jnp.asarray(valid), ctx_j, loc, sliding_window=window)
    _assert_close(out, ref, F32, zero_rows=range(int(q_lens.sum()), q.shape[0]))


# ---------------------------------------------------------------- slow: more edges


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpu decode", "tpu decode", "gpu ragged", "tpu ragged"])
def test_window_near_int32_max(kind):
    # Positions minus the window must not wrap around in int32 (padding rows included).
    backend, op = kind.split()
    if op == "decode":
        tuning = dict(num_splits=3, block_kv=16) if backend == "gpu" else {}
        decode_case(backend, LENGTHS, max_pages=4, sliding_window=2**31 - 1, **tuning)
    else:
        ragged_case(
            backend, RAGGED_Q, RAGGED_CTX, max_pages=5, pad_rows=3, sliding_window=2**31 - 1
        )


@pytest.mark.slow
def test_gpu_decode_partial_second_head_block():
    # G = 24 in blocks of 16: the second head block has 8 real rows and 8 padding rows.
    decode_case("gpu", [0, 1, 40, 32, 13], heads=(24, 1), block_h=16, num_splits=2, max_pages=5)


@pytest.mark.slow
def test_gpu_ragged_group_12_one_token_query_blocks():
    # G = 12 padded to 16 with block_q = 1: one program per query token.
    ragged_case(
        "gpu", RAGGED_Q, RAGGED_CTX, heads=(24, 2), max_pages=5, pad_rows=3, block_q=1, block_kv=16
    )


@pytest.mark.slow
def test_tpu_decode_three_cores_odd_blocks_fp8():
    decode_case(
        "tpu",
        [0, 1, 40, 32, 13],
        heads=(6, 2),
        max_pages=5,
        num_cores=3,
        pages_per_block=3,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e5m2,
        sliding_window=24,
    )


def _random_case(seed):
    """A seeded random edge case: (function, args, kwargs) for `decode_case` or `ragged_case`.

    Draws lengths from {0, 1, a page multiple, the maximum, anything}, windows from
    {none, 1, a page multiple, anything, longer than the table}, group sizes 1, 3, 4, 6
    and MQA, fp8 pages now and then, out-of-range padding under jit, and per-kernel knobs
    (splits beyond the live blocks, odd pages per block, several simulated cores).
    """
    r = np.random.default_rng(1000 + seed)
    pick = lambda xs: xs[int(r.integers(len(xs)))]  # noqa: E731
    backend = ("gpu", "tpu")[seed % 2]
    page_size = pick([8, 16])
    max_pages = int(r.integers(1, 7))
    cap = page_size * max_pages
    heads = pick([(1, 1), (3, 1), (6, 1), (12, 2), (4, 4), (6, 2), (8, 2)])
    dtype = pick([F32, jnp.bfloat16])
    kw = dict(
        heads=heads,
        head_dim=pick([16, 32]),
        page_size=page_size,
        max_pages=max_pages,
        dtype=dtype,
        kv_dtype=pick([None, None, None, jnp.float8_e4m3fn]),
        seed=seed,
        sliding_window=pick(
            [None, None, 1, int(r.integers(1, cap + 1)), page_size * int(r.integers(1, 4)), cap + 5]
        ),
        soft_cap=pick([None, None, 2.0]),
        out_of_range_padding=bool(r.random() < 0.3),
    )

    def length(top):
        return int(pick([0, 1, page_size, top, r.integers(0, top + 1), r.integers(1, top + 1)]))

    if seed % 4 < 2:  # decode
        lengths = [length(cap) for _ in range(int(r.integers(1, 7)))]
        lengths[0] = max(lengths[0], 1)  # not every row empty
        if backend == "gpu":
            kw.update(num_splits=int(r.integers(1, 13)), block_kv=pick([16, 32]))
        else:
            kw.update(pages_per_block=int(r.integers(1, 4)), num_cores=int(r.integers(1, 4)))
        return decode_case, (backend, lengths), kw
    ctx = [length(cap) for _ in range(int(r.integers(1, 6)))]
    ctx[0] = max(ctx[0], 1)
    q_lens = [min(c, length(c)) if c else 0 for c in ctx]
    q_lens[0] = max(q_lens[0], 1)
    kw["pad_rows"] = int(r.integers(0, 4))
    if backend == "gpu":
        group_pad = 1 << (heads[0] // heads[1] - 1).bit_length()
        kw.update(block_q=max(pick([1, 2, 4, 8]), -(-16 // group_pad)), block_kv=pick([16, 32]))
    else:
        align = 8 if dtype == F32 else 16
        kw.update(block_q=align * int(r.integers(1, 3)), pages_per_block=pick([1, 2, 4]))
    return ragged_case, (backend, q_lens, ctx), kw


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_random_edges(seed):
    fn, args, kwargs = _random_case(seed)
    fn(*args, **kwargs)
