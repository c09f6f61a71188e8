"""Tests for the Pallas GPU ragged paged attention kernel (interpret mode + cuda lowering).

Every test writes dense per-sequence K/V into a page pool through a shuffled page
table and compares with dense attention over the whole sequence
(`reference.attention_chunk`, `reference.causal_prefill`). Pool slots that no query
may see (past each context, padding pages, before a sliding window) hold NaN in
the tests that check the kernel never reads them (the shape grid among them).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, reference
from pallas_kernels.ragged.gpu import default_tuning, ragged_paged_attention_gpu

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
# FP8 pages vs the unquantised K/V they were cast from: the relative error is above
# bf16's whole tolerance (so the kernel really read fp8-rounded pages) and below the
# format's unit roundoff, 2**-4 for e4m3fn and 2**-3 for e5m2 (measured: ~2.8% and ~5.7%).
FP8_BOUNDS = {jnp.float8_e4m3fn: (1e-2, 2**-4), jnp.float8_e5m2: (1e-2, 2**-3)}


def _batch(
    rng,
    q_lens,
    ctx_lens,
    *,
    heads=(4, 2),
    head_dim=64,
    page_size=8,
    max_pages=None,
    num_pages=None,
    dtype=jnp.float32,
    pad_rows=0,
    num_rows=None,
    poison=False,
    window=None,
    kv_dtype=None,
):
    """Random sequences written into a page pool with shuffled page tables.

    Returns (kernel args, dense per-sequence (q, k, v) in float32). `num_rows`
    (default: the real rows plus `pad_rows`) and `num_pages` fix the shapes so that
    tests can share one compiled kernel. With `poison`, every pool slot no query
    can see is NaN and page-table padding points at NaN pages. `kv_dtype` (default
    `dtype`) is the pools' dtype; the dense K/V hold the same values in float32. The
    random draws do not depend on the dtypes, so one seed with two `kv_dtype`s gives
    the same K/V, rounded or not.
    """
    kv_dtype = kv_dtype or dtype
    num_heads, num_kv_heads = heads
    b = len(q_lens)
    max_pages = max_pages or max(1, max(-(-c // page_size) for c in ctx_lens))
    used = sum(-(-c // page_size) for c in ctx_lens)
    num_pages = num_pages or used + 3
    assert num_pages > used
    pad_rows = pad_rows if num_rows is None else num_rows - sum(q_lens)
    fill = np.nan if poison else 0.0

    def rnd(*shape, dtype=dtype):  # values as the kernel will see them (rounded to dtype)
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
        return np.array(x.astype(jnp.float32))

    pools = [np.full((num_kv_heads, num_pages, page_size, head_dim), fill, np.float32)]
    pools.append(pools[0].copy())
    if not poison:
        pools = [rnd(*p.shape) for p in pools]
    # Page 0 is never owned: the kernel clamps the indices of masked lanes to row 0,
    # so a dropped load mask shows up as NaN in the poisoned tests.
    perm = np.concatenate([1 + rng.permutation(num_pages - 1), [0]])
    spare = perm[used:]  # pages nobody owns: page-table padding points there
    table = rng.choice(spare, size=(b, max_pages)).astype(np.int32)
    dense, qs, off = [], [], 0
    for q_len, ctx in zip(q_lens, ctx_lens, strict=True):
        n = -(-ctx // page_size)
        pages = perm[off : off + n]
        off += n
        table[len(dense), :n] = pages
        k = rnd(ctx, num_kv_heads, head_dim, dtype=kv_dtype)
        v = rnd(ctx, num_kv_heads, head_dim, dtype=kv_dtype)
        lo = 0 if window is None or not poison else max(0, ctx - q_len - window + 1)
        for pool, x in zip(pools, (k, v), strict=True):
            t = np.arange(lo, ctx)
            pool[:, pages[t // page_size], t % page_size] = x[lo:].transpose(1, 0, 2)
        q = rnd(q_len, num_heads, head_dim)
        dense.append((q, k, v))
        qs.append(q)
    qs.append(rnd(pad_rows, num_heads, head_dim))
    args = (
        jnp.asarray(np.concatenate(qs), dtype),
        jnp.asarray(pools[0], kv_dtype),
        jnp.asarray(pools[1], kv_dtype),
        jnp.asarray(table),
        jnp.asarray(ctx_lens, jnp.int32),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    )
    return args, dense


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def _dense_padded(q, k, v, ctx, scale=None, soft_cap=None, sliding_window=None):
    def one(q, k, v, c):
        return reference.attention_chunk(
            q, k, v, context_len=c, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window
        )

    return jax.vmap(one)(q, k, v, ctx)


def _dense_ref(dense, num_rows, **opts):
    """[T, H, D] float32: each sequence's chunk against its dense K/V; padding rows zero.

    Sequences are padded to power-of-two buckets (queries on the left, so that the
    real ones keep their positions; keys on the right, masked by context_len) and
    run as one jitted batch.
    """
    h, d = dense[0][0].shape[1:]
    kh = dense[0][1].shape[1]
    tq = 1 << max(q.shape[0] for q, _, _ in dense).bit_length()
    tk = 1 << max(k.shape[0] for _, k, _ in dense).bit_length()
    qs = np.zeros((len(dense), tq, h, d), np.float32)
    ks = np.zeros((len(dense), tk, kh, d), np.float32)
    vs = np.zeros_like(ks)
    for i, (q, k, v) in enumerate(dense):
        qs[i, tq - q.shape[0] :] = q
        ks[i, : k.shape[0]] = k
        vs[i, : v.shape[0]] = v
    ctx = np.array([k.shape[0] for _, k, _ in dense], np.int32)
    out = np.asarray(_dense_padded(qs, ks, vs, ctx, **opts))
    rows = [out[i, tq - q.shape[0] :] for i, (q, _, _) in enumerate(dense)]
    rows.append(np.zeros((num_rows - sum(r.shape[0] for r in rows), h, d), np.float32))
    return np.concatenate(rows)


def _check(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert not np.isnan(out).any(), "NaN in kernel output"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"


def _run(args, **kw):
    return ragged_paged_attention_gpu(*args, interpret=True, **kw)


# (H, K): MHA, GQA 4, GQA 8, MQA, and a group of 3 (padded to 4 inside the kernel).
HEADS = {"g1": (4, 4), "g4": (8, 2), "g8": (8, 1), "mqa": (4, 1), "g3": (6, 2)}


def _grid_case(rng, heads, head_dim, page_size, dtype, tuning=None, **opts):
    """A batch mixing decode rows, chunks, q_len 0 and padding rows, on poisoned pools.

    Context lengths include 1, exactly a page boundary and the table's maximum.
    `tuning` (knobs) goes to the kernel only, `opts` to the reference too.
    """
    max_pages = 4
    cap = max_pages * page_size
    q_lens = [1, 3, 0, 1, 7, 2]
    ctx_lens = [1, 2 * page_size, 5, cap, cap - 3, page_size + 2]
    args, dense = _batch(
        rng,
        q_lens,
        ctx_lens,
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
        dtype=dtype,
        pad_rows=3,
        poison=True,
        window=opts.get("sliding_window"),
    )
    out = _run(args, **opts, **(tuning or {}))
    _check(out, _dense_ref(dense, args[0].shape[0], **opts), dtype)


@pytest.mark.parametrize(
    "heads,head_dim,page_size,dtype",
    [
        ("g1", 64, 8, jnp.float32),
        ("g4", 128, 16, jnp.bfloat16),
        ("g8", 256, 32, jnp.float32),
        ("mqa", 128, 128, jnp.bfloat16),
        ("g3", 64, 64, jnp.bfloat16),
    ],
)
def test_matches_dense_reference(heads, head_dim, page_size, dtype):
    _grid_case(np.random.default_rng(0), HEADS[heads], head_dim, page_size, dtype)


PAGE_SIZES = (8, 16, 32, 64, 128)


def _fp8_case(seed, heads, head_dim, page_size, dtype, kv_dtype, tuning=None, **opts):
    """FP8 pages with a `dtype` query (dead slots NaN): tight against dense attention on the
    same fp8 values, loose (FP8_BOUNDS) against the unquantised K/V."""
    max_pages = 4
    cap = max_pages * page_size
    q_lens = [1, 3, 0, 1, 7, 2]
    ctx_lens = [1, 2 * page_size, 5, cap, cap - 3, page_size + 2]
    shape = dict(
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
        dtype=dtype,
        pad_rows=3,
        poison=True,
        window=opts.get("sliding_window"),
    )
    args, dense = _batch(np.random.default_rng(seed), q_lens, ctx_lens, kv_dtype=kv_dtype, **shape)
    assert args[1].dtype == kv_dtype and args[2].dtype == kv_dtype
    _, unquantised = _batch(
        np.random.default_rng(seed), q_lens, ctx_lens, kv_dtype=jnp.float32, **shape
    )
    out = _run(args, **opts, **(tuning or {}))
    assert out.dtype == dtype
    _check(out, _dense_ref(dense, args[0].shape[0], **opts), dtype)
    ref = _dense_ref(unquantised, args[0].shape[0], **opts)
    out = np.asarray(out.astype(jnp.float32))
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    low, high = FP8_BOUNDS[kv_dtype]
    assert low < err < high, f"relative error {err} vs unquantised K/V, expected in {low, high}"


@pytest.mark.parametrize(
    "heads,head_dim,page_size,dtype,opts",
    [
        ("g4", 128, 16, jnp.bfloat16, {}),
        ("mqa", 64, 8, jnp.float32, dict(soft_cap=4.0, sliding_window=11)),
    ],
)
def test_fp8_pages(heads, head_dim, page_size, dtype, opts):
    _fp8_case(20, HEADS[heads], head_dim, page_size, dtype, jnp.float8_e4m3fn, **opts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "heads,head_dim,page_size,dtype,kv_dtype,opts",
    [
        ("g1", 64, 8, jnp.bfloat16, jnp.float8_e4m3fn, dict(sliding_window=5)),
        ("g4", 128, 32, jnp.float32, jnp.float8_e4m3fn, dict(soft_cap=5.0)),
        ("g8", 256, 64, jnp.bfloat16, jnp.float8_e4m3fn, {}),
        ("mqa", 128, 128, jnp.bfloat16, jnp.float8_e4m3fn, dict(soft_cap=3.0, sliding_window=9)),
        ("g3", 64, 16, jnp.float32, jnp.float8_e4m3fn, {}),
        ("g4", 256, 8, jnp.float32, jnp.float8_e5m2, dict(sliding_window=13)),
        ("g8", 64, 32, jnp.bfloat16, jnp.float8_e5m2, dict(soft_cap=2.0)),
    ],
)
def test_fp8_pages_grid(heads, head_dim, page_size, dtype, kv_dtype, opts):
    _fp8_case(21, HEADS[heads], head_dim, page_size, dtype, kv_dtype, **opts)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_matches_dense_reference_heads_x_dims(heads, head_dim, dtype):
    # Every (heads, head_dim, dtype); the page size cycles through 8..128. Every
    # (dtype, head_dim, page_size) on poisoned pools, with options and shared-prefix
    # page tables: tests/test_kernel_review29.py's slow test_gpu_ragged_poisoned_grid.
    page_size = PAGE_SIZES[(sorted(HEADS).index(heads) + head_dim // 64) % len(PAGE_SIZES)]
    _grid_case(np.random.default_rng(1), HEADS[heads], head_dim, page_size, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["g1", "g8", "mqa"])
@pytest.mark.parametrize("opts", [dict(soft_cap=5.0), dict(sliding_window=3)])
def test_soft_cap_and_sliding_window_heads(heads, opts):
    _grid_case(np.random.default_rng(12), HEADS[heads], 128, 16, jnp.bfloat16, **opts)


# (A soft cap alone: test_fp8_pages, tests/test_kernel_review29.py's shared-page cases.)
@pytest.mark.parametrize("opts", [dict(sliding_window=19, soft_cap=4.0, scale=0.3)])
def test_soft_cap_and_sliding_window(opts):
    _grid_case(np.random.default_rng(2), HEADS["g4"], 64, 8, jnp.float32, **opts)


@pytest.mark.parametrize("page_size,block_kv,window", [(8, 32, None)])
def test_matches_xla_path_with_small_blocks(page_size, block_kv, window):
    """Several query and KV blocks per sequence, KV blocks spanning pages (KV blocks that
    split pages: the default 64-token blocks of the S = 128 grid case)."""
    rng = np.random.default_rng(3)
    args, _ = _batch(
        rng, [1, 30, 0, 13], [40, 61, 9, 13], heads=(8, 2), page_size=page_size, pad_rows=5
    )
    out = _run(args, sliding_window=window, block_q=4, block_kv=block_kv)
    ref = reference.ragged_paged_attention_xla(*args, sliding_window=window)
    _check(out, ref, jnp.float32)


def test_prefill_in_one_go_and_in_chunks():
    """Chunks of random sizes, each attending to the pages the earlier chunks wrote."""
    rng = np.random.default_rng(4)
    n, page_size, (h, kh), d = 77, 8, (8, 2), 64
    max_pages = -(-n // page_size)
    q = rng.standard_normal((n, h, d)).astype(np.float32)
    k = rng.standard_normal((n, kh, d)).astype(np.float32)
    v = rng.standard_normal((n, kh, d)).astype(np.float32)
    dense = reference.causal_prefill(q[None], k[None], v[None])[0]
    table = rng.permutation(max_pages + 2)[:max_pages].astype(np.int32)
    # Slots not yet written are NaN, as a stronger stand-in for stale cache contents.
    pools = [np.full((kh, max_pages + 2, page_size, d), np.nan, np.float32) for _ in "kv"]

    bucket = n + 3  # every call pads to the same T, so one compiled kernel serves all

    def call(start, end):
        pad_rows = bucket - (end - start)
        for pool, x in zip(pools, (k, v), strict=True):
            t = np.arange(start, end)
            pool[:, table[t // page_size], t % page_size] = x[start:end].transpose(1, 0, 2)
        rows = np.concatenate([q[start:end], rng.standard_normal((pad_rows, h, d))])
        args = (
            jnp.asarray(rows, jnp.float32),
            jnp.asarray(pools[0]),
            jnp.asarray(pools[1]),
            jnp.asarray(table[None]),
            jnp.asarray([end], jnp.int32),
            jnp.asarray([0, end - start], jnp.int32),
        )
        out = _run(args, block_q=4, block_kv=16)
        assert not np.asarray(out[end - start :]).any(), "padding rows must be zero"
        return out[: end - start]

    one_go = call(0, n)
    _check(one_go, dense, jnp.float32)
    cuts = np.sort(rng.choice(np.arange(1, n), size=5, replace=False))
    bounds = [0, *cuts.tolist(), n]
    pools = [np.full_like(p, np.nan) for p in pools]
    chunks = [call(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    chunked = jnp.concatenate(chunks)
    _check(chunked, dense, jnp.float32)
    _check(chunked, one_go, jnp.float32)


# One shape for the batch tests below, so they share a compiled kernel: B = 5,
# T = 32, 8 pages of 8 per sequence, G = 4 with block_q = 4 (M = 16) and 16-token
# KV blocks, so sequences span several query and KV blocks.
STD = dict(heads=(8, 2), head_dim=64, page_size=8, max_pages=8, num_pages=48, num_rows=32)
STD_KNOBS = dict(block_q=4, block_kv=16)


def _std_case(seed, q_lens, ctx_lens, window=None):
    args, dense = _batch(
        np.random.default_rng(seed), q_lens, ctx_lens, poison=True, window=window, **STD
    )
    ref = _dense_ref(dense, args[0].shape[0], sliding_window=window)
    return args, ref


def test_three_decode_rows_and_two_prefill_chunks():
    args, ref = _std_case(5, [1, 12, 1, 9, 1], [33, 40, 9, 9, 64])
    _check(_run(args, **STD_KNOBS), ref, jnp.float32)


def test_chunk_starting_and_ending_mid_page():
    # Sequence 0: 21 cached tokens (mid page 2), a chunk of 17 ending at 38 (mid page 4).
    args, ref = _std_case(6, [17, 1, 0, 2, 0], [38, 20, 5, 8, 0])
    assert 21 % 8 and 38 % 8
    _check(_run(args, **STD_KNOBS), ref, jnp.float32)


def test_q_len_zero_and_padding_rows():
    args, ref = _std_case(7, [0, 3, 0, 1, 0], [4, 9, 1, 16, 0])
    out = _run(args, **STD_KNOBS)
    _check(out, ref, jnp.float32)
    assert not np.asarray(out[4:]).any(), "padding rows must be zero"
    # Only padding: every row is zero.
    zero = _run((*args[:5], jnp.zeros_like(args[5])), **STD_KNOBS)
    assert not np.asarray(zero).any()


@pytest.mark.parametrize("window", [None, 6])
def test_never_reads_past_context_or_before_window(window):
    """NaN everywhere no query may look (tails of last pages, padding pages, pre-window).

    A V value read there would turn the output NaN (0 * NaN); a K value read at a
    masked position is hidden by the logit mask, so only V loads are checked this way.
    """
    args, ref = _std_case(8, [1, 9, 1, 4, 0], [13, 29, 40, 4, 0], window=window)
    _check(_run(args, sliding_window=window, **STD_KNOBS), ref, jnp.float32)


@pytest.mark.parametrize(
    "head_dim,heads,dtype,opts",
    [
        (80, (8, 2), jnp.bfloat16, {}),
        (100, (6, 2), jnp.float32, dict(sliding_window=6, soft_cap=20.0)),
        (8, (4, 1), jnp.float32, {}),  # below the smallest dot
    ],
)
def test_head_dims_padded_inside_the_kernel(head_dim, heads, dtype, opts):
    """A head dim that is not a power of two >= 16 runs on the kernel, its tiles padded to
    one with the padding masked on every load and store: an unmasked padding column reads
    the next row (the next query head's q, the next slot's K/V, NaN where no query looks)."""
    window = opts.get("sliding_window")
    args, dense = _batch(
        np.random.default_rng(head_dim),
        [1, 9, 1, 4, 0],
        [13, 29, 40, 4, 0],
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        pad_rows=2,
        poison=True,
        window=window,
    )
    assert args[0].shape[-1] == head_dim
    _check(_run(args, **opts), _dense_ref(dense, args[0].shape[0], **opts), dtype)


@pytest.mark.parametrize("head_dim", [257, 1000])
def test_head_dims_past_the_widest_tile_are_refused(head_dim):
    """Past 256 the tiles (512 or 1024 wide) overflow shared memory with the defaults
    (393,216 bytes at 1024, 270,336 at 512 in float32; the H200 has 232,448): a
    ValueError naming head_dim, where a GPU would fail to compile."""
    args, _ = _batch(np.random.default_rng(0), [1, 2], [3, 5], head_dim=head_dim)
    with pytest.raises(ValueError, match=rf"at most 256 .*got head_dim={head_dim}\b"):
        _run(args)


def test_through_dispatcher():
    """The dispatcher forwards scale, soft cap and window to the kernel."""
    opts = dict(scale=0.3, soft_cap=4.0, sliding_window=6)
    args, dense = _batch(
        np.random.default_rng(9), [2, 1, 5, 1, 1], [7, 30, 5, 64, 1], poison=True, window=6, **STD
    )
    out = ragged_paged_attention(*args, backend="gpu", interpret=True, **opts, **STD_KNOBS)
    _check(out, _dense_ref(dense, args[0].shape[0], **opts), jnp.float32)


def test_window_longer_than_a_kv_block():
    """A window (19) longer than a KV block (16): the KV blocks that every row of a query
    block sees whole start at its last row's window, not its first (the rows at positions
    32..35 of sequence 0: key 16 is in the window of 32 but not of 35)."""
    args, ref = _std_case(10, [24, 1, 0, 3, 1], [40, 30, 0, 50, 64], window=19)
    _check(_run(args, sliding_window=19, **STD_KNOBS), ref, jnp.float32)


@pytest.mark.parametrize(
    "seed,q_lens,ctx_lens,window",
    [
        (8, [1, 9, 1, 4, 0], [13, 29, 40, 4, 0], 6),  # all three loops: window, full, causal
        (5, [1, 12, 1, 9, 1], [33, 40, 9, 9, 64], None),
        (6, [17, 1, 0, 2, 0], [38, 20, 5, 8, 0], 50),  # a window wider than every context
    ],
)
def test_prefetch_rows_gives_the_same_output(seed, q_lens, ctx_lens, window):
    """Page ids carried one block ahead through the loops: exactly the default's output
    (same arithmetic, other load order), on poisoned pools."""
    args, ref = _std_case(seed, q_lens, ctx_lens, window=window)
    out = _run(args, sliding_window=window, prefetch_rows=True, **STD_KNOBS)
    _check(out, ref, jnp.float32)
    same = _run(args, sliding_window=window, **STD_KNOBS)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


@pytest.mark.slow
@pytest.mark.parametrize("heads,opts", [("g1", {}), ("g3", dict(soft_cap=5.0, sliding_window=3))])
def test_prefetch_rows_grid(heads, opts):
    prefetch = dict(prefetch_rows=True)
    _grid_case(np.random.default_rng(13), HEADS[heads], 64, 8, jnp.bfloat16, prefetch, **opts)
    _fp8_case(14, HEADS[heads], 64, 16, jnp.bfloat16, jnp.float8_e4m3fn, prefetch, **opts)


@pytest.mark.parametrize(
    "knob,value",
    [
        ("block_q", 3),
        ("block_q", 2),
        ("block_kv", 8),
        ("block_kv", 48),
        ("num_warps", 3),
        ("num_warps", 64),  # past Triton's 32 warps (1,024 threads) per program
        ("num_stages", True),  # a bool is an int, not a count
        ("prefetch_rows", 1),
    ],
)
def test_bad_tuning_knobs(knob, value):
    args, _ = _batch(np.random.default_rng(10), [1], [3], heads=(4, 1))  # G = 4
    with pytest.raises(ValueError, match=f"{knob}={value}"):
        _run(args, **{knob: value})
    with pytest.raises(TypeError, match="interpret='no'"):
        ragged_paged_attention_gpu(*args, interpret="no")


def test_a_page_table_without_pages_gives_zeros():
    """max_pages = 0 (every context empty): zeros, as the reference, not a gather error."""
    args, _ = _batch(np.random.default_rng(11), [1, 2], [0, 0], heads=(4, 1))
    q, k, v, table, ctx, qsl = args
    out = _run((q, k, v, table[:, :0], ctx, qsl))
    assert out.shape == q.shape and not np.asarray(out).any()


def test_default_tuning_tiles():
    for t, b, h, kh, d in [(640, 129, 32, 8, 128), (128, 128, 32, 8, 128), (64, 2, 4, 4, 256)]:
        knobs = default_tuning(t, b, h, kh, d, jnp.bfloat16)
        m = knobs["block_q"] * 2 ** math.ceil(math.log2(h // kh))
        assert 16 <= m <= 128 and knobs["block_kv"] >= 16
    # Rows of M per shape: decode 16, mixed 64, mostly prefill 128 (the H200 sweep's best).
    rows = lambda t, b, dtype=jnp.bfloat16, d=128: (
        default_tuning(t, b, 32, 8, d, dtype)["block_q"] * 4
    )  # noqa: E731
    assert (rows(128, 128), rows(640, 129), rows(4096, 8), rows(8192, 4)) == (16, 64, 128, 128)
    assert default_tuning(4096, 8, 32, 8, 128, jnp.bfloat16) == dict(
        block_q=32, block_kv=128, num_warps=8, num_stages=3
    )
    # float32 and D = 256 keep M = 64 even for prefill (registers).
    assert rows(4096, 8, jnp.float32) == rows(4096, 8, d=256) == 64


@pytest.mark.parametrize(
    "heads,head_dim,page_size,dtype,opts",
    [
        ((32, 8), 128, 16, jnp.bfloat16, {}),
        ((8, 8), 64, 8, jnp.float32, dict(soft_cap=30.0, sliding_window=100)),
        ((6, 2), 256, 128, jnp.bfloat16, {}),
        ((8, 1), 128, 32, jnp.bfloat16, dict(block_q=2, block_kv=128)),
        ((32, 8), 128, 16, jnp.bfloat16, dict(prefetch_rows=True, sliding_window=100)),
        ((32, 32), 80, 16, jnp.bfloat16, {}),  # padded head dims: 80 (tiles of 128)
        ((4, 1), 8, 8, jnp.float32, {}),  # 8 (tiles of 16)
    ],
)
def test_lowers_for_cuda(heads, head_dim, page_size, dtype, opts):
    num_heads, num_kv_heads = heads
    t, b, num_pages, max_pages = 37, 5, 40, 7
    args = (
        jax.ShapeDtypeStruct((t, num_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), dtype),
        jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), dtype),
        jax.ShapeDtypeStruct((b, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b + 1,), jnp.int32),
    )
    f = functools.partial(ragged_paged_attention_gpu, **opts)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


@pytest.mark.parametrize(
    "dtype,kv_dtype", [(jnp.bfloat16, jnp.float8_e4m3fn), (jnp.float32, jnp.float8_e5m2)]
)
def test_fp8_lowers_for_cuda(dtype, kv_dtype):
    # The Triton lowering assumes an sm90 GPU on a CPU-only machine (fp8 casts need sm89+).
    t, b, num_pages, max_pages, (h, kh), d, s = 37, 5, 40, 7, (32, 8), 128, 16
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, h, d), dtype),
        sds((kh, num_pages, s, d), kv_dtype),
        sds((kh, num_pages, s, d), kv_dtype),
        sds((b, max_pages), jnp.int32),
        sds((b,), jnp.int32),
        sds((b + 1,), jnp.int32),
    )
    f = functools.partial(ragged_paged_attention_gpu, sliding_window=100)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    # The pages reach the kernel as fp8: no upcast copy of the cache outside it.
    fp8 = "f8E4M3FN" if kv_dtype == jnp.float8_e4m3fn else "f8E5M2"
    assert f"tensor<8x640x128x{fp8}>" in text
