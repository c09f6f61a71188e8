"""Tests of the Pallas GPU paged decode kernel: interpret mode vs the reference, cuda lowering.

Every kernel input pool is poisoned with NaN wherever no live token lives
(pages past a sequence's length, slots past the length in its last page, keys
before a sliding window, pages nobody owns, which page-table padding points
at), while the reference sees the clean pool: a single read of a dead slot
under a live mask shows up as NaN.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import reference
from pallas_kernels.paged_decode import gpu_merge
from pallas_kernels.paged_decode.gpu import TUNING_KNOBS, default_tuning, paged_decode_gpu
from pallas_kernels.paged_decode.gpu_merge import merge_splits, merge_splits_gpu, merge_splits_wide

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
# FP8 pages vs the unquantised K/V they were cast from: the relative error is above
# bf16's whole tolerance (so the kernel really read fp8-rounded pages) and below the
# format's unit roundoff, 2**-4 for e4m3fn and 2**-3 for e5m2 (measured: ~2.8% and ~5.7%).
FP8_BOUNDS = {jnp.float8_e4m3fn: (1e-2, 2**-4), jnp.float8_e5m2: (1e-2, 2**-3)}
ref_decode = jax.jit(
    reference.paged_attention_xla, static_argnames=("scale", "soft_cap", "sliding_window")
)


def make_case(
    seed,
    batch,
    num_heads,
    num_kv_heads,
    head_dim,
    page_size,
    max_pages,
    dtype,
    lengths=None,
    sliding_window=None,
):
    """Random inputs with shuffled page tables.

    Returns:
      (q, k_clean, v_clean, k_poisoned, v_poisoned, lengths, page_table).
    """
    rng = np.random.default_rng(seed)
    if lengths is None:
        capacity = max_pages * page_size
        # 1, exactly a page boundary, the maximum, then random lengths.
        pool = [1, page_size, capacity, min(2 * page_size, capacity)]
        lengths = [
            pool[i] if i < len(pool) else int(rng.integers(1, capacity + 1)) for i in range(batch)
        ]
    lengths = np.asarray(lengths, np.int32)
    num_pages = batch * max_pages + 3  # a few pages nobody owns
    owned = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    page_table = owned.copy()
    live = np.zeros((num_pages, page_size), bool)
    for b, n in enumerate(lengths):
        used = -(-int(n) // page_size)
        # Padding entries: any in-range id, here random (often a dead page).
        page_table[b, used:] = rng.integers(0, num_pages, max_pages - used)
        lo = 0 if sliding_window is None else max(int(n) - sliding_window, 0)
        for t in range(lo, int(n)):
            live[owned[b, t // page_size], t % page_size] = True
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    q = rng.standard_normal((batch, num_heads, head_dim), np.float32)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    dead = ~live[None, :, :, None]
    k_bad = np.where(dead, np.nan, k)
    v_bad = np.where(dead, np.nan, v)
    q, k, v, k_bad, v_bad = (jnp.asarray(x, dtype) for x in (q, k, v, k_bad, v_bad))
    return q, k, v, k_bad, v_bad, jnp.asarray(lengths), jnp.asarray(page_table, jnp.int32)


def check(
    seed=0,
    batch=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    max_pages=4,
    dtype=jnp.float32,
    lengths=None,
    scale=None,
    soft_cap=None,
    sliding_window=None,
    **tuning,
):
    q, k, v, k_bad, v_bad, lengths, page_table = make_case(
        seed,
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        max_pages,
        dtype,
        lengths,
        sliding_window,
    )
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    out = paged_decode_gpu(q, k_bad, v_bad, lengths, page_table, interpret=True, **opts, **tuning)
    f32 = jnp.float32
    ref = ref_decode(q.astype(f32), k.astype(f32), v.astype(f32), lengths, page_table, **opts)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(f32))
    assert not np.isnan(out).any()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], f"relative error {err}"
    return out


def check_fp8(
    kv_dtype=jnp.float8_e4m3fn,
    dtype=jnp.bfloat16,
    seed=0,
    batch=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    max_pages=4,
    lengths=None,
    scale=None,
    soft_cap=None,
    sliding_window=None,
    **tuning,
):
    """FP8 pages with a `dtype` query: tight against the reference on the same fp8 values,
    loose (FP8_BOUNDS) against the unquantised K/V they were rounded from."""
    q, k, v, k_bad, v_bad, lengths, page_table = make_case(
        seed,
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        max_pages,
        jnp.float32,
        lengths,
        sliding_window,
    )
    q = q.astype(dtype)
    k8, v8, k8_bad, v8_bad = (x.astype(kv_dtype) for x in (k, v, k_bad, v_bad))
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    out = paged_decode_gpu(q, k8_bad, v8_bad, lengths, page_table, interpret=True, **opts, **tuning)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any()
    f32 = jnp.float32
    same = ref_decode(q.astype(f32), k8.astype(f32), v8.astype(f32), lengths, page_table, **opts)
    err = np.linalg.norm(out - same) / np.linalg.norm(same)
    assert err < TOL[dtype], f"relative error {err} vs the same fp8 values"
    unquantised = ref_decode(q.astype(f32), k, v, lengths, page_table, **opts)
    err = np.linalg.norm(out - unquantised) / np.linalg.norm(unquantised)
    low, high = FP8_BOUNDS[kv_dtype]
    assert low < err < high, f"relative error {err} vs unquantised K/V, expected in {low, high}"


# ---------------------------------------------------------------- default grid

RATIOS = [(8, 8), (8, 2), (16, 2), (4, 1)]  # MHA, GQA 4, GQA 8, MQA


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype"),
    [(8, 8, jnp.float32), (8, 2, jnp.bfloat16), (16, 2, jnp.float32), (4, 1, jnp.bfloat16)],
)
def test_gqa_ratios(num_heads, num_kv_heads, dtype):
    check(batch=5, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize(
    ("head_dim", "page_size", "max_pages", "dtype"),
    [
        (64, 8, 7, jnp.float32),
        (128, 16, 5, jnp.bfloat16),
        (128, 64, 3, jnp.float32),
        (256, 32, 3, jnp.bfloat16),
        (128, 128, 2, jnp.bfloat16),
    ],
)
def test_head_dims_and_page_sizes(head_dim, page_size, max_pages, dtype):
    check(head_dim=head_dim, page_size=page_size, max_pages=max_pages, dtype=dtype, batch=4)


@pytest.mark.parametrize(
    ("head_dim", "dtype", "options"),
    [
        (80, jnp.bfloat16, {}),
        (100, jnp.float32, dict(num_splits=3, sliding_window=21)),  # the unrolled merge
        (96, jnp.bfloat16, dict(num_splits=12, soft_cap=20.0)),  # the wide merge
        (8, jnp.float32, dict(num_splits=2)),  # below the smallest dot
    ],
)
def test_head_dims_padded_inside_the_kernel(head_dim, dtype, options):
    """A head dim that is not a power of two >= 16 runs on the kernel, its tiles padded to
    one with the padding masked on every load and store: an unmasked padding column reads
    the next row (the next head's q, the next slot's K/V, often a NaN-poisoned dead one)."""
    check(head_dim=head_dim, dtype=dtype, batch=4, page_size=8, max_pages=5, **options)


@pytest.mark.parametrize("head_dim", [257, 1000])
def test_head_dims_past_the_widest_tile_are_refused(head_dim):
    """Past 256 the tiles (512 or 1024 wide) overflow shared memory with the defaults
    (the ragged kernel's from 257 in float32, the decode kernel's past 1024): a ValueError
    naming head_dim, where a GPU would fail to compile; 256 itself runs
    (test_head_dims_and_page_sizes)."""
    q, _, _, k, v, lengths, page_table = make_case(0, 2, 4, 2, head_dim, 8, 2, jnp.float32)
    with pytest.raises(ValueError, match=rf"at most 256 .*got head_dim={head_dim}\b"):
        paged_decode_gpu(q, k, v, lengths, page_table, interpret=True)


# 12: more than 8, the wide merge. Fewer splits: 2 (test_block_kv_below_page_size,
# test_several_head_blocks), 3 (the padded head dim 100), and 7 and 9 with zero rows and
# empty splits (tests/test_kernel_edges.py).
@pytest.mark.parametrize("num_splits", [12])
def test_split_k(num_splits):
    # 7 sequences: lengths 0 (a zero row), 1, page boundaries, max, odd.
    lengths = [0, 1, 16, 64, 37, 48, 3]
    out = check(batch=7, max_pages=4, lengths=lengths, num_splits=num_splits, block_kv=16)
    assert (out[0] == 0).all()


# A window of one token, split. Wider windows, unsplit and split: test_dispatcher_gpu_backend
# (7), test_head_dims_padded_inside_the_kernel (21 over 3 splits), test_fp8_pages (20).
@pytest.mark.parametrize(
    ("sliding_window", "num_splits", "page_size"),
    [(1, 2, 16)],
)
def test_sliding_window(sliding_window, num_splits, page_size):
    check(
        sliding_window=sliding_window,
        num_splits=num_splits,
        page_size=page_size,
        max_pages=6,
        batch=4,
        block_kv=16,
        seed=2,
    )


def test_logits_hundreds_apart():
    """Scale 50 puts the logits hundreds apart: each block rescales by the running maximum,
    so no 2^(m_old - m_new) factor overflows (the maximum of one block alone would)."""
    check(scale=50.0, batch=4, block_kv=16, lengths=[64, 50, 33, 17])


def test_block_kv_below_page_size():
    # One page spans several inner iterations.
    check(batch=4, page_size=64, max_pages=2, block_kv=16, num_splits=2, lengths=[1, 64, 100, 128])


def test_several_head_blocks():
    # G = 32 split into two head blocks of 16 (each re-reads K/V, still correct).
    check(num_heads=32, num_kv_heads=1, block_h=16, num_splits=2)


def test_padding_page_table_and_wide_table():
    # Short sequences in a wide page table: most entries are padding.
    check(batch=3, max_pages=20, page_size=8, lengths=[3, 9, 8], num_splits=4)


def test_dispatcher_gpu_backend():
    """The dispatcher forwards scale, soft cap and window to the kernel (lengths 1, 16, 48)."""
    q, k, v, _, _, lengths, page_table = make_case(3, 3, 8, 2, 64, 16, 3, jnp.float32)
    opts = dict(scale=0.3, soft_cap=5.0, sliding_window=7)
    out = pallas_kernels.paged_decode_attention(
        q, k, v, lengths, page_table, backend="gpu", interpret=True, **opts
    )
    ref = ref_decode(q, k, v, lengths, page_table, **opts)
    assert np.isfinite(np.asarray(out)).all()  # assert_allclose lets NaN equal NaN
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_empty_batch_and_empty_page_table():
    q, k, v, _, _, lengths, page_table = make_case(0, 2, 4, 2, 64, 8, 2, jnp.float32)
    out = paged_decode_gpu(q[:0], k, v, lengths[:0], page_table[:0], interpret=True)
    assert out.shape == (0, 4, 64)
    out = paged_decode_gpu(q, k, v, lengths * 0, page_table[:, :0], interpret=True)
    assert out.shape == q.shape and not out.any()


@pytest.mark.parametrize(
    ("dtype", "shape", "options"),
    [
        # Llama-like GQA 4, D=128, split-K, with the default (fp8-sized) tiles.
        (jnp.bfloat16, dict(num_heads=8, num_kv_heads=2, head_dim=128), {}),
        # f32 q, MQA, small pages, a window and a soft cap.
        (
            jnp.float32,
            dict(num_heads=4, num_kv_heads=1, page_size=8, max_pages=6),
            dict(soft_cap=5.0, sliding_window=20, block_kv=16, num_splits=2),
        ),
    ],
)
def test_fp8_pages(dtype, shape, options):
    check_fp8(dtype=dtype, batch=4, **shape, **options)


@pytest.mark.slow
def test_fp8_pages_through_dispatcher_e5m2():
    q, k, v, _, _, lengths, page_table = make_case(5, 3, 8, 2, 64, 16, 3, jnp.float32)
    k8, v8 = k.astype(jnp.float8_e5m2), v.astype(jnp.float8_e5m2)
    q = q.astype(jnp.bfloat16)
    out = pallas_kernels.paged_decode_attention(
        q, k8, v8, lengths, page_table, backend="gpu", interpret=True
    )
    f32 = jnp.float32
    ref = ref_decode(q.astype(f32), k8.astype(f32), v8.astype(f32), lengths, page_table)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)


def test_default_tuning_sizes_tiles_by_the_pages_itemsize():
    bf16 = default_tuning(4, 32, 8, 256, 16, 256, jnp.bfloat16, sms=132)
    fp8 = default_tuning(4, 32, 8, 256, 16, 256, jnp.float8_e4m3fn, sms=132)
    assert fp8["block_kv"] == 2 * bf16["block_kv"] == 64  # the same 16 KiB K tile
    assert fp8["num_stages"] == bf16["num_stages"] == 3
    # At D=128 fp8 hits the 128-token cap.
    assert default_tuning(4, 32, 8, 128, 16, 256, jnp.float8_e4m3fn)["block_kv"] == 128


# ---------------------------------------------------------------- split merge


def random_partials(seed, splits, batch, heads, head_dim):
    """Random split partials (o, m, denom) with empty splits: the last split of
    sequence 0 and, for head 0 of the last sequence, every split (zeros out)."""
    ko, km, kl = jax.random.split(jax.random.key(seed), 3)
    o = jax.random.normal(ko, (splits, batch, heads, head_dim), jnp.float32)
    m = 4 * jax.random.normal(km, (splits, batch, heads), jnp.float32)
    denom = jax.random.uniform(kl, (splits, batch, heads), jnp.float32, 0.5, 2.0)
    empty = np.zeros((splits, batch, heads), bool)
    empty[-1, 0, :] = True
    empty[:, batch - 1, 0] = True
    return (
        jnp.where(empty[..., None], 0.0, o),
        jnp.where(empty, -jnp.inf, m),
        jnp.where(empty, 0.0, denom),
    )


def assert_merged(out, ref, dtype):
    """A merge's output vs the reference's, for `random_partials`' empty rows."""
    assert out.shape == ref.shape and out.dtype == dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    assert (out[-1, 0] == 0).all()  # all splits empty: zeros, not NaN
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(out, np.asarray(ref), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("splits", "batch", "num_kv_heads", "group", "block_h", "dtype"),
    [
        (4, 3, 2, 4, 16, jnp.float32),  # GQA group padded to 16 rows
        (3, 2, 1, 40, 16, jnp.bfloat16),  # a group over 3 head blocks, the last partial
        (1, 2, 3, 1, 16, jnp.float32),  # one split, MHA
        (10, 2, 1, 2, 16, jnp.float32),  # more than UNROLLED_SPLITS: the fori_loop walk
    ],
)
def test_merge_kernel_matches_jnp_merge(splits, batch, num_kv_heads, group, block_h, dtype):
    """The Pallas merge equals the jnp reference merge on random partials, with empty
    splits (m = -inf) and rows whose every split is empty (zeros out)."""
    heads, head_dim = num_kv_heads * group, 32
    o, m, denom = random_partials(splits * 7 + group, splits, batch, heads, head_dim)
    ref = merge_splits(o, m, denom, jnp.float32)
    out = merge_splits_gpu(o, m, denom, dtype=dtype, group=group, block_h=block_h, interpret=True)
    assert_merged(out, ref, dtype)


@pytest.mark.parametrize(
    ("splits", "head_dim", "wide_tile", "dtype"),
    [
        (64, 128, 8192, jnp.bfloat16),  # B = 1, S = 32768's split count: one 64 x 128 tile
        (12, 64, 8192, jnp.float32),  # a tile of 16 splits, 4 of them padding
        (40, 32, 256, jnp.float32),  # tiles of 8: a fori_loop over 5 tiles
        (21, 32, 256, jnp.bfloat16),  # 3 tiles, the last one 5 splits and 3 padding
    ],
)
def test_wide_merge_matches_jnp_merge(monkeypatch, splits, head_dim, wide_tile, dtype):
    """The many-split merge equals the jnp reference on random partials, in one tile
    and walked a tile at a time (a smaller WIDE_TILE forces the walk)."""
    monkeypatch.setattr(gpu_merge, "WIDE_TILE", wide_tile)
    batch, heads = 2, 3
    o, m, denom = random_partials(splits + head_dim, splits, batch, heads, head_dim)
    # Sequence 1, head 1: its maximum sits in the last tile, every earlier split empty.
    first = np.arange(splits) < splits - 1
    m = m.at[:, 1, 1].set(jnp.where(first, -jnp.inf, 30.0))
    denom = denom.at[:, 1, 1].set(jnp.where(first, 0.0, denom[:, 1, 1]))
    ref = merge_splits(o, m, denom, jnp.float32)
    out = merge_splits_wide(o, m, denom, dtype=dtype, interpret=True)
    assert_merged(out, ref, dtype)


def test_wide_merge_walks_past_empty_tiles(monkeypatch):
    """A short sequence split many ways: only its first splits hold tokens, so every later
    tile of the walk is empty (m = -inf); the running maximum carries through them."""
    monkeypatch.setattr(gpu_merge, "WIDE_TILE", 256)  # D = 32: tiles of 8 splits, 5 tiles
    splits = 40
    o, m, denom = random_partials(6, splits, 2, 3, 32)
    live = (np.arange(splits) < 3)[:, None, None]
    o, m, denom = o * live[..., None], jnp.where(live, m, -jnp.inf), denom * live
    ref = merge_splits(o, m, denom, jnp.float32)
    out = merge_splits_wide(o, m, denom, dtype=jnp.float32, interpret=True)
    assert_merged(out, ref, jnp.float32)


def test_wide_tile_is_a_power_of_two_within_the_budget():
    assert gpu_merge.wide_tile(64, 128) == 64  # B = 1, S = 32768 at D = 128: one tile
    assert gpu_merge.wide_tile(16, 128) == 16
    assert gpu_merge.wide_tile(12, 64) == 16
    assert gpu_merge.wide_tile(200, 64) == 128  # capped at WIDE_TILE // D
    assert gpu_merge.wide_tile(100, 256) == 32
    assert gpu_merge.wide_tile(3, 16384) == 1


# ---------------------------------------------------------------- tuning


def test_default_tuning():
    small = default_tuning(1, 32, 8, 128, 16, 2048, jnp.bfloat16, sms=132)
    large = default_tuning(256, 32, 8, 128, 16, 32, jnp.bfloat16, sms=132)
    assert set(small) == set(TUNING_KNOBS)
    assert small["block_kv"] == 64 and small["block_h"] == 16
    # (B, S) = (32, 4096): 256 programs fill 132 SMs with 4 splits; 16 KiB tiles, 3 stages.
    mid = default_tuning(32, 32, 8, 128, 16, 256, jnp.bfloat16, sms=132)
    assert mid == dict(block_kv=64, block_h=16, num_splits=4, num_warps=4, num_stages=3)
    # B * K >= 8 programs per SM: no split.
    assert large == dict(block_kv=64, block_h=16, num_splits=1, num_warps=4, num_stages=3)
    # Splits keep >= 512 tokens each: a 32k context at B=1 gets 64, not 132.
    assert small["num_splits"] == 32768 // 512
    # Tiny contexts are not split into slivers; big heads and f32 get smaller tiles.
    assert default_tuning(1, 8, 8, 64, 8, 2, jnp.float32, sms=132)["num_splits"] == 1
    assert default_tuning(1, 8, 8, 256, 8, 64, jnp.float32, sms=132)["block_kv"] == 16
    assert default_tuning(1, 128, 1, 64, 8, 64, jnp.bfloat16)["block_h"] == 64
    # Caller-chosen big tiles get fewer stages, to bound shared memory.
    assert default_tuning(1, 8, 8, 256, 8, 64, jnp.float32, block_kv=128)["num_stages"] == 1
    assert default_tuning(1, 8, 8, 256, 8, 64, jnp.bfloat16, block_kv=128)["num_stages"] == 2
    assert default_tuning(1, 8, 8, 128, 8, 64, jnp.bfloat16, block_kv=128)["num_stages"] == 3


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        (dict(block_kv=24), "block_kv=24"),
        (dict(block_kv=8), "block_kv=8"),
        (dict(block_h=8), "block_h=8"),
        (dict(num_splits=0), "num_splits=0"),
        (dict(num_warps=3), "num_warps.*got 3"),
        (dict(num_stages=0), "num_stages=0"),
        (dict(num_splits=True), "num_splits=True"),  # a bool is an int, not a count
        (dict(num_warps=True), "num_warps.*got True"),
    ],
)
def test_bad_tuning(knobs, match):
    q, k, v, _, _, lengths, page_table = make_case(0, 2, 4, 2, 64, 8, 2, jnp.float32)
    with pytest.raises(ValueError, match=match):
        paged_decode_gpu(q, k, v, lengths, page_table, interpret=True, **knobs)


def test_unknown_knob_and_bad_interpret():
    q, k, v, _, _, lengths, page_table = make_case(0, 2, 4, 2, 64, 8, 2, jnp.float32)
    with pytest.raises(TypeError, match="pages_per_compute_block"):
        paged_decode_gpu(q, k, v, lengths, page_table, pages_per_compute_block=2)
    with pytest.raises(TypeError, match="interpret='no'"):  # was bool('no'): interpreted
        paged_decode_gpu(q, k, v, lengths, page_table, interpret="no")


# ---------------------------------------------------------------- cuda lowering


@pytest.mark.parametrize(
    ("shape", "dtype", "options"),
    [
        ((4, 32, 8, 128, 16, 64), jnp.bfloat16, {}),  # Llama-3-8B layer, split-K
        ((64, 32, 8, 128, 16, 8), jnp.bfloat16, dict(soft_cap=30.0)),  # no split
        ((2, 8, 8, 256, 64, 4), jnp.bfloat16, dict(sliding_window=100)),
        ((3, 4, 1, 64, 8, 16), jnp.float32, {}),  # MQA, f32 (exact dots)
        ((1, 32, 8, 128, 16, 64), jnp.bfloat16, dict(num_splits=16)),  # the wide merge
        ((4, 32, 32, 80, 16, 64), jnp.bfloat16, {}),  # padded head dims: 80 (tiles of 128)
        ((1, 32, 32, 100, 16, 64), jnp.bfloat16, dict(num_splits=16)),  # 100, wide merge
        ((2, 4, 2, 8, 8, 16), jnp.float32, dict(num_splits=2)),  # 8 (tiles of 16)
    ],
)
def test_lowers_for_cuda(shape, dtype, options):
    batch, num_heads, num_kv_heads, head_dim, page_size, max_pages = shape
    q = jax.ShapeDtypeStruct((batch, num_heads, head_dim), dtype)
    pages = jax.ShapeDtypeStruct((num_kv_heads, 2 * batch * max_pages, page_size, head_dim), dtype)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    page_table = jax.ShapeDtypeStruct((batch, max_pages), jnp.int32)

    def f(q, k, v, lengths, page_table):
        return paged_decode_gpu(q, k, v, lengths, page_table, **options)

    lowered = jax.jit(f).trace(q, pages, pages, lengths, page_table)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    splits = options.get("num_splits", 0)
    assert ("paged_decode_merge_wide" in text) == (splits > gpu_merge.UNROLLED_SPLITS)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "options"),
    [
        (jnp.bfloat16, jnp.float8_e4m3fn, {}),  # Llama-3-8B layer, split-K
        (jnp.float32, jnp.float8_e4m3fn, dict(soft_cap=30.0, sliding_window=100)),
        (jnp.bfloat16, jnp.float8_e5m2, {}),
    ],
)
def test_fp8_lowers_for_cuda(dtype, kv_dtype, options):
    # The Triton lowering assumes an sm90 GPU on a CPU-only machine (fp8 casts need sm89+).
    batch, num_heads, num_kv_heads, head_dim, page_size, max_pages = 4, 32, 8, 128, 16, 64
    q = jax.ShapeDtypeStruct((batch, num_heads, head_dim), dtype)
    pages = jax.ShapeDtypeStruct((num_kv_heads, 256, page_size, head_dim), kv_dtype)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    page_table = jax.ShapeDtypeStruct((batch, max_pages), jnp.int32)

    def f(q, k, v, lengths, page_table):
        return paged_decode_gpu(q, k, v, lengths, page_table, **options)

    text = jax.jit(f).trace(q, pages, pages, lengths, page_table)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    # The pages reach the kernel as fp8: no upcast copy of the cache outside it.
    fp8 = "f8E4M3FN" if kv_dtype == jnp.float8_e4m3fn else "f8E5M2"
    assert f"tensor<8x4096x128x{fp8}>" in text


# ---------------------------------------------------------------- slow: full grid


def _grid_id(value):
    if isinstance(value, tuple):
        return f"H{value[0]}K{value[1]}"
    return getattr(value, "__name__", str(value))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ratio", "head_dim", "page_size", "dtype"),
    list(
        itertools.product(RATIOS, [64, 128, 256], [8, 16, 32, 64, 128], [jnp.float32, jnp.bfloat16])
    ),
    ids=_grid_id,
)
def test_full_grid(ratio, head_dim, page_size, dtype):
    num_heads, num_kv_heads = ratio
    max_pages = max(2, 256 // page_size)
    check(
        seed=head_dim + page_size,
        batch=5,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
        dtype=dtype,
    )


@pytest.mark.slow
@pytest.mark.parametrize("sliding_window", [None, 7, 64, 200])
@pytest.mark.parametrize("soft_cap", [None, 1.5])
@pytest.mark.parametrize(
    ("dtype", "num_splits"), [(jnp.float32, 1), (jnp.bfloat16, 3)], ids=_grid_id
)
def test_options_grid(sliding_window, soft_cap, dtype, num_splits):
    check(
        seed=11,
        batch=6,
        num_heads=16,
        num_kv_heads=4,
        page_size=16,
        max_pages=12,
        dtype=dtype,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        num_splits=num_splits,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ratio", "head_dim", "page_size", "dtype", "kv_dtype", "options"),
    [
        ((8, 8), 64, 8, jnp.float32, jnp.float8_e4m3fn, {}),
        ((8, 2), 128, 16, jnp.bfloat16, jnp.float8_e4m3fn, dict(soft_cap=2.0)),
        ((16, 2), 256, 32, jnp.bfloat16, jnp.float8_e4m3fn, dict(sliding_window=40)),
        ((4, 1), 128, 64, jnp.float32, jnp.float8_e4m3fn, dict(num_splits=3)),
        ((4, 1), 64, 128, jnp.bfloat16, jnp.float8_e4m3fn, dict(sliding_window=7, soft_cap=1.5)),
        ((8, 2), 256, 8, jnp.float32, jnp.float8_e5m2, dict(sliding_window=33)),
        ((16, 2), 64, 16, jnp.bfloat16, jnp.float8_e5m2, dict(soft_cap=3.0, num_splits=2)),
    ],
    ids=_grid_id,
)
def test_fp8_grid(ratio, head_dim, page_size, dtype, kv_dtype, options):
    num_heads, num_kv_heads = ratio
    check_fp8(
        kv_dtype=kv_dtype,
        dtype=dtype,
        seed=head_dim + page_size,
        batch=5,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max(2, 256 // page_size),
        **options,
    )
