"""Kernel coverage review: the grid points and input layouts the kernel tests left out.

The shape grids (tests/test_paged_decode_{gpu,tpu}.py, tests/test_ragged_{gpu,tpu}.py)
and the edge cases (tests/test_kernel_edges.py) build their page tables from
permutations, so no two sequences share a page (only the eager-padding tests' random
tables may repeat an id, on clean pools). What this file adds, on all four kernels
(interpreted; the TPU ones with race detection), plus lowering for float16:

* page tables as the block manager makes them: prefix pages shared between sequences
  (a page one sequence reads whole and another only in part, whose tail then holds the
  other's finite, wrong-for-it keys), an id repeated in one row, ids out of order,
  padding that names other sequences' live pages;
* NaN-poisoned pools (every slot no query sees) on full shape grids (slow): the TPU
  decode kernel's whole grid, the GPU ragged kernel's (dtype x D x S) product, and the
  GPU decode kernel's grid with split-K (its grid runs unsplit);
* batch 1, lengths of a page plus one, and the GPU kernels' per-shape defaults in the
  branches no interpreted test reached (split-K chosen by `default_tuning`, the ragged
  kernel's decode-batch and mostly-prefill tiles).

Every kernel reads the poisoned pools; the reference (`pallas_kernels.reference`, in
float32) reads the clean ones. Relative error ||out - ref|| / ||ref||: float32 under
1e-4, bfloat16 under 1e-2; NaN never passes.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from tpu_interpret import assert_no_race

import pallas_kernels
from pallas_kernels import reference
from pallas_kernels.paged_decode import gpu as decode_gpu
from pallas_kernels.ragged import gpu as ragged_gpu

F32 = jnp.float32
TOL = {jnp.dtype(F32): 1e-4, jnp.dtype(jnp.bfloat16): 1e-2}
OPTS = ("scale", "soft_cap", "sliding_window")

_ref_decode = jax.jit(reference.paged_attention_xla, static_argnames=OPTS)
_ref_ragged = jax.jit(reference.ragged_paged_attention_xla, static_argnames=OPTS)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _visible(ctx_lens, q_lens, window):
    """Per sequence, the tokens [lo, hi) some query sees (q_lens None: decode)."""
    out = []
    for b, c in enumerate(ctx_lens):
        q = 1 if q_lens is None else q_lens[b]
        if q == 0 or c == 0:
            out.append((0, 0))
        else:
            out.append((0 if window is None else max(c - q - window + 1, 0), c))
    return out


def _poisoned(rng, tables, ctx_lens, q_lens, *, num_pages, heads, head_dim, page_size, window):
    """Clean pools and copies NaN wherever no query of any sequence looks.

    Args:
      tables: [B, max_pages] page ids (padding included, all in range).

    Returns:
      (q [T or B, H, D], k, v, k_nan, v_nan) float32 numpy.
    """
    num_heads, num_kv_heads = heads
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    live = np.zeros((num_pages, page_size), bool)
    for b, (lo, hi) in enumerate(_visible(ctx_lens, q_lens, window)):
        t = np.arange(lo, hi)
        live[tables[b, t // page_size], t % page_size] = True
    dead = ~live[None, :, :, None]
    rows = len(ctx_lens) if q_lens is None else sum(q_lens)
    return (
        rng.standard_normal((rows, num_heads, head_dim)).astype(np.float32),
        k,
        v,
        np.where(dead, np.nan, k),
        np.where(dead, np.nan, v),
    )


def _assert_close(out, ref, dtype, zero_rows=()):
    out = np.asarray(jnp.asarray(out).astype(F32))
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"non-finite rows: {np.argwhere(~np.isfinite(out))[:5]}"
    for r in zero_rows:
        assert not out[r].any(), f"row {r} must be zero"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[jnp.dtype(dtype)], f"relative error {err:.3g}"


def _kw(backend, tuning):
    return dict(backend=backend, interpret=True, **tuning)


def run_decode(
    backend,
    tables,
    lengths,
    *,
    seed=0,
    heads=(8, 2),
    head_dim=32,
    page_size=8,
    num_pages=None,
    dtype=F32,
    kv_dtype=None,
    opts=None,
    tuning=None,
):
    """Decode attention through `backend` on poisoned pools vs the reference on clean ones."""
    opts, tuning = opts or {}, tuning or {}
    tables = np.asarray(tables, np.int32)
    num_pages = num_pages or int(tables.max()) + 2
    q, k, v, k_nan, v_nan = _poisoned(
        np.random.default_rng(seed),
        tables,
        lengths,
        None,
        num_pages=num_pages,
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        window=opts.get("sliding_window"),
    )
    kv_dtype = kv_dtype or dtype
    q = jnp.asarray(q, dtype)
    k, v, k_nan, v_nan = (jnp.asarray(x, kv_dtype) for x in (k, v, k_nan, v_nan))
    lens, table = jnp.asarray(lengths, jnp.int32), jnp.asarray(tables)
    out = pallas_kernels.paged_decode_attention(
        q, k_nan, v_nan, lens, table, **opts, **_kw(backend, tuning)
    )
    out = jax.block_until_ready(out)
    if backend == "tpu":
        assert_no_race()
    assert out.dtype == q.dtype
    ref = _ref_decode(q.astype(F32), k.astype(F32), v.astype(F32), lens, table, **opts)
    _assert_close(out, ref, dtype, [b for b, n in enumerate(lengths) if n == 0])
    return out


def run_ragged(
    backend,
    tables,
    q_lens,
    ctx_lens,
    *,
    seed=0,
    heads=(8, 2),
    head_dim=32,
    page_size=8,
    num_pages=None,
    pad_rows=0,
    dtype=F32,
    kv_dtype=None,
    opts=None,
    tuning=None,
):
    """Ragged attention through `backend` on poisoned pools vs the reference on clean ones."""
    opts, tuning = opts or {}, tuning or {}
    tables = np.asarray(tables, np.int32)
    num_pages = num_pages or int(tables.max()) + 2
    rng = np.random.default_rng(seed)
    q, k, v, k_nan, v_nan = _poisoned(
        rng,
        tables,
        ctx_lens,
        q_lens,
        num_pages=num_pages,
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        window=opts.get("sliding_window"),
    )
    q = np.concatenate([q, rng.standard_normal((pad_rows, *q.shape[1:])).astype(np.float32)])
    kv_dtype = kv_dtype or dtype
    q = jnp.asarray(q, dtype)
    k, v, k_nan, v_nan = (jnp.asarray(x, kv_dtype) for x in (k, v, k_nan, v_nan))
    ctx, table = jnp.asarray(ctx_lens, jnp.int32), jnp.asarray(tables)
    loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    out = pallas_kernels.ragged_paged_attention(
        q, k_nan, v_nan, table, ctx, loc, **opts, **_kw(backend, tuning)
    )
    out = jax.block_until_ready(out)
    if backend == "tpu":
        assert_no_race()
    assert out.dtype == q.dtype
    ref = _ref_ragged(q.astype(F32), k.astype(F32), v.astype(F32), table, ctx, loc, **opts)
    _assert_close(out, ref, dtype, range(sum(q_lens), q.shape[0]))
    return out


# ------------------------------------------------- page tables the block manager makes

# Page size 8, max_pages 5 (capacity 40). Physical pages 0..12.
#   0: a prefix of pages 3, 7 (16 tokens) and its own page 1, 20 tokens: reads 4 of page 1;
#   1: the same two prefix pages, then 9, 2: 25 tokens, three pages plus one token;
#   2: pages 3, 7, 1 whole (24 tokens): slots 4..7 of page 1 are live for it and finite,
#      so a kernel reading them for sequence 0 is wrong without any NaN;
#   3: page 11 twice in one row, then 5: 17 tokens (two pages plus one);
#   4: one token of page 7, a page every other sequence reads whole;
#   5: the table's maximum, 40 tokens, ids out of order.
# Padding entries name live pages of other sequences (finite, and wrong for this one).
SHARED = [
    [3, 7, 1, 5, 0],
    [3, 7, 9, 2, 4],
    [3, 7, 1, 12, 2],
    [11, 11, 5, 3, 1],
    [7, 0, 8, 6, 10],
    [10, 0, 8, 4, 6],
]
SHARED_LENGTHS = [20, 25, 24, 17, 1, 40]
# Ragged: a decode row, a chunk crossing the shared prefix's end, a chunk reading page 1
# whole, a chunk inside the repeated page, an empty sequence, a prefill of the whole table.
SHARED_Q = [1, 9, 2, 3, 0, 40]

BACKENDS = ["gpu", "tpu", "xla"]


# float32; and bfloat16 q with fp8 pages under a window and a soft cap.
VARIANTS = {
    "f32": dict(dtype=F32, opts={}),
    "fp8-window-cap": dict(
        dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, opts=dict(sliding_window=10, soft_cap=4.0)
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_shared_repeated_and_out_of_order_pages(backend, variant):
    tuning = {"gpu": dict(num_splits=3, block_kv=16), "tpu": dict(pages_per_block=2)}
    run_decode(backend, SHARED, SHARED_LENGTHS, tuning=tuning.get(backend), **VARIANTS[variant])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ragged_shared_repeated_and_out_of_order_pages(backend, variant):
    tuning = {"gpu": dict(block_q=4, block_kv=16), "tpu": dict(block_q=16, pages_per_block=2)}
    run_ragged(
        backend,
        SHARED,
        SHARED_Q,
        SHARED_LENGTHS,
        pad_rows=3,
        tuning=tuning.get(backend),
        **VARIANTS[variant],
    )


# ------------------------------------------------- random tables with shared prefixes


def random_tables(rng, ctx_lens, page_size, max_pages):
    """Shuffled page tables in which each odd sequence shares its first pages (up to half
    of the shorter one's) with the sequence before it, as prefix-cache hits do; padding
    entries are random in-range ids (often other sequences' live pages).

    Returns:
      (tables [B, max_pages] int32, num_pages).
    """
    need = [-(-c // page_size) for c in ctx_lens]
    num_pages = sum(need) + 3
    perm, off = rng.permutation(num_pages), 0
    tables = rng.integers(0, num_pages, (len(ctx_lens), max_pages)).astype(np.int32)
    for b, n in enumerate(need):
        tables[b, :n] = perm[off : off + n]
        off += n
        if b % 2:
            shared = min(n, need[b - 1]) // 2
            tables[b, :shared] = tables[b - 1, :shared]
    return tables, num_pages


def edge_lengths(page_size, max_pages, batch, rng):
    """1, a page, a page plus one, the maximum, the maximum minus one, then random."""
    cap = page_size * max_pages
    fixed = [1, page_size, page_size + 1, cap, cap - 1]
    rest = rng.integers(1, cap + 1, max(0, batch - len(fixed))).tolist()
    return (fixed + rest)[:batch]


def decode_grid_case(
    backend,
    *,
    seed,
    heads,
    head_dim,
    page_size,
    dtype,
    max_pages=5,
    batch=5,
    opts=None,
    tuning=None,
):
    rng = np.random.default_rng(seed)
    lengths = edge_lengths(page_size, max_pages, batch, rng)
    tables, num_pages = random_tables(rng, lengths, page_size, max_pages)
    run_decode(
        backend,
        tables,
        lengths,
        seed=seed,
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=num_pages,
        dtype=dtype,
        opts=opts,
        tuning=tuning,
    )


def ragged_grid_case(
    backend, *, seed, heads, head_dim, page_size, dtype, max_pages=4, opts=None, tuning=None
):
    """Decode rows, chunks, an empty sequence, a fresh prefill and padding rows; contexts
    of 1, a page, a page plus one and the maximum."""
    rng = np.random.default_rng(seed)
    cap = page_size * max_pages
    ctx_lens = [1, page_size, page_size + 1, cap, cap - 3, 2 * page_size + 1]
    q_lens = [1, 3, page_size + 1, 0, 7, 1]
    tables, num_pages = random_tables(rng, ctx_lens, page_size, max_pages)
    run_ragged(
        backend,
        tables,
        q_lens,
        ctx_lens,
        seed=seed,
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=num_pages,
        pad_rows=3,
        dtype=dtype,
        opts=opts,
        tuning=tuning,
    )


# --------------------------------- the TPU decode kernel's grid on poisoned pools

# The kernel's full shape grid (tests/test_paged_decode_tpu.py runs a representative
# handful by default, on poisoned pools too), with options and shared-prefix tables.
_HEADS = [(4, 4), (8, 2), (16, 2), (4, 1)]  # MHA, GQA 4, GQA 8, MQA
_OPTIONS = [{}, dict(sliding_window=13), dict(soft_cap=5.0), dict(sliding_window=21, soft_cap=2.0)]
_GRID = list(itertools.product([F32, jnp.bfloat16], [64, 128, 256], [8, 16, 32, 64, 128]))


def _grid_id(value):
    return getattr(value, "__name__", str(value))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,head_dim,page_size", _GRID, ids=_grid_id)
def test_tpu_decode_poisoned_grid(dtype, head_dim, page_size):
    i = _GRID.index((dtype, head_dim, page_size))
    decode_grid_case(
        "tpu",
        seed=i,
        heads=_HEADS[i % 4],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        batch=7,
        opts=_OPTIONS[(i // 4) % 4],
        tuning=dict(pages_per_block=i % 3 + 1) if i % 2 else {},
    )


# ------------------------------------- the GPU decode kernel's grid, split

# Its full grid (tests/test_paged_decode_gpu.py) leaves the knobs to `default_tuning`,
# which never splits contexts of at most 256 tokens: split-K ran at D = 64 (and the
# padded or fp8 cases) only. Here every grid point splits 3 ways (one split often empty).


@pytest.mark.slow
@pytest.mark.parametrize("dtype,head_dim,page_size", _GRID, ids=_grid_id)
def test_gpu_decode_split_poisoned_grid(dtype, head_dim, page_size):
    i = _GRID.index((dtype, head_dim, page_size))
    decode_grid_case(
        "gpu",
        seed=i,
        heads=_HEADS[i % 4],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        batch=7,
        opts=_OPTIONS[(i // 4) % 4],
        tuning=dict(num_splits=3, block_kv=16 if i % 2 else 32),
    )


# --------------------------------- the GPU ragged kernel's grid on poisoned pools


# Its default grid (tests/test_ragged_gpu.py `_grid_case`) reads poisoned pools too; this
# is the (dtype, D, S) product with options, which its slow grids (heads x D x dtype)
# leave out.
@pytest.mark.slow
@pytest.mark.parametrize("dtype,head_dim,page_size", _GRID, ids=_grid_id)
def test_gpu_ragged_poisoned_grid(dtype, head_dim, page_size):
    i = _GRID.index((dtype, head_dim, page_size))
    ragged_grid_case(
        "gpu",
        seed=i,
        heads=_HEADS[i % 4],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        opts=_OPTIONS[(i // 4) % 4],
    )


# ------------------------------------- batch 1, and the GPU kernels' per-shape defaults


@pytest.mark.parametrize(
    "max_pages,length,opts",
    [
        (64, 1017, {}),  # 2 splits: the unrolled merge
        (320, 5113, dict(sliding_window=3000, soft_cap=4.0)),  # 10: the wide merge
    ],
)
def test_gpu_decode_batch_1_long_context_default_split(max_pages, length, opts):
    """One long sequence, every knob left to `default_tuning`, which splits the context
    (flash-decoding) as it would on the H200: the interpreted tests so far set
    num_splits themselves, and their default-knob runs were all too short to split."""
    page_size, heads, head_dim = 16, (8, 2), 64
    knobs = decode_gpu.default_tuning(1, *heads, head_dim, page_size, max_pages, F32)
    assert knobs["num_splits"] == max_pages * page_size // 512
    rng = np.random.default_rng(max_pages)
    tables, num_pages = random_tables(rng, [length], page_size, max_pages)
    run_decode(
        "gpu",
        tables,
        [length],
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=num_pages,
        opts=opts,
    )


def test_tpu_decode_batch_1_on_two_cores():
    """B = 1 with K = 1 on two cores: the work list is padded with a length-0 sequence
    whose step must neither copy nor write into the real one."""
    rng = np.random.default_rng(3)
    tables, num_pages = random_tables(rng, [41], 8, 7)
    run_decode(
        "tpu",
        tables,
        [41],
        heads=(4, 1),
        head_dim=64,
        num_pages=num_pages,
        opts=dict(sliding_window=17),
        tuning=dict(num_cores=2, pages_per_block=2),
    )


@pytest.mark.parametrize("batch", [1, 5])
def test_gpu_ragged_decode_batch_default_tiles(batch):
    """T <= B (a decode batch): the defaults' 16-row tiles, batch 1 and odd."""
    heads, head_dim = (8, 2), 64
    assert ragged_gpu.default_tuning(batch, batch, *heads, head_dim, F32)["block_q"] == 4
    rng = np.random.default_rng(batch)
    ctx = edge_lengths(8, 5, 5, rng)[::-1][:batch]  # batch 1: the maximum minus one
    tables, num_pages = random_tables(rng, ctx, 8, 5)
    run_ragged(
        "gpu",
        tables,
        [1] * batch,
        ctx,
        heads=heads,
        head_dim=head_dim,
        num_pages=num_pages,
        opts=dict(sliding_window=9, soft_cap=3.0),
    )


def test_gpu_ragged_mostly_prefill_default_tiles():
    """T >= 128 B (mostly prefill): the defaults' 128-row tiles with 128-token KV blocks,
    which no interpreted test reached (they set smaller knobs or had short batches):
    a 260-token chunk after 40 cached tokens, ending mid page, and a decode row."""
    heads, head_dim, dtype = (8, 2), 64, jnp.bfloat16
    q_lens, ctx = [260, 1], [300, 17]
    knobs = ragged_gpu.default_tuning(sum(q_lens) + 2, 2, *heads, head_dim, dtype)
    assert knobs == dict(block_q=32, block_kv=128, num_warps=8, num_stages=3)
    rng = np.random.default_rng(4)
    tables, num_pages = random_tables(rng, ctx, 16, 19)
    run_ragged(
        "gpu",
        tables,
        q_lens,
        ctx,
        heads=heads,
        head_dim=head_dim,
        page_size=16,
        num_pages=num_pages,
        pad_rows=2,
        dtype=dtype,
        opts=dict(sliding_window=100),
    )


def test_tpu_ragged_batch_1_decode_row():
    rng = np.random.default_rng(5)
    tables, num_pages = random_tables(rng, [33], 8, 5)
    run_ragged(
        "tpu",
        tables,
        [1],
        [33],
        heads=(8, 2),
        head_dim=64,
        num_pages=num_pages,
        pad_rows=1,
        opts=dict(sliding_window=9, soft_cap=3.0),
    )


# ------------------------------------------------------------------ lowering

_LOWER_KERNELS = {
    "gpu decode": ("cuda", "paged_decode", "triton"),
    "tpu decode": ("tpu", "paged_decode", "tpu_custom_call"),
    "gpu ragged": ("cuda", "ragged", "triton"),
    "tpu ragged": ("tpu", "ragged", "tpu_custom_call"),
}


@pytest.mark.parametrize(
    "kernel,dtype",
    [(k, jnp.float16) for k in sorted(_LOWER_KERNELS)] + [("gpu ragged", jnp.bfloat16)],
)
def test_lowers_with_window_and_cap(kernel, dtype):
    """float16 (which the model runs in, and the kernels interpret: test_kernel_review.py)
    was never lowered for a real target; nor were the GPU ragged kernel's mostly-prefill
    defaults (T = 2048 over B = 4: 128-row tiles, 128-token KV blocks, 3 stages)."""
    platform, op, marker = _LOWER_KERNELS[kernel]
    backend = kernel.split()[0]
    sds = jax.ShapeDtypeStruct
    (h, kh, d, s), b = (32, 8, 128, 16), 4
    pool = sds((kh, 700, s, d), dtype)
    opts = dict(soft_cap=30.0, sliding_window=100, backend=backend)
    if op == "paged_decode":
        args = (sds((b, h, d), dtype), pool, pool, sds((b,), jnp.int32), sds((b, 64), jnp.int32))
        f = functools.partial(pallas_kernels.paged_decode_attention, **opts)
    else:
        t = 2048
        if backend == "gpu" and dtype == jnp.bfloat16:
            assert ragged_gpu.default_tuning(t, b, h, kh, d, dtype)["block_kv"] == 128
        args = (
            sds((t, h, d), dtype),
            pool,
            pool,
            sds((b, 160), jnp.int32),
            sds((b,), jnp.int32),
            sds((b + 1,), jnp.int32),
        )
        f = functools.partial(pallas_kernels.ragged_paged_attention, **opts)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
