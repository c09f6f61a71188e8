"""Tests of the Pallas TPU paged decode kernel (pallas_kernels/paged_decode/tpu.py).

On the CPU the kernel runs in the TPU interpreter with race detection on, and
is lowered for TPU (Mosaic) without compiling. Each distinct shape costs ~5 s
of interpreter tracing, so the default set is a representative handful. The
kernel reads pools that are NaN in every slot no visible key lives in (tails of
last pages, slots before the window, pages nobody owns, which page-table padding
may name); the reference reads the clean ones. The full shape grid, on such pools
with shared-prefix page tables, is tests/test_kernel_review29.py's slow
`test_tpu_decode_poisoned_grid`. Through the dispatcher (with the scale, soft cap and
window): tests/test_kernel_edges.py, tests/test_kernel_review29.py and, for the
forwarding every kernel shares, tests/test_paged_decode_gpu.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from tpu_interpret import SHARP, assert_no_race, racy_copy_is_flagged

from pallas_kernels import reference
from pallas_kernels.paged_decode import tpu
from pallas_kernels.paged_decode.tpu import paged_decode_tpu

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
# FP8 pages vs the unquantised K/V they were cast from: the relative error is above
# bf16's whole tolerance (so the kernel really read fp8-rounded pages) and below the
# format's unit roundoff, 2**-4 for e4m3fn and 2**-3 for e5m2 (measured: ~2.8% and ~5.7%).
FP8_BOUNDS = {jnp.float8_e4m3fn: (1e-2, 2**-4), jnp.float8_e5m2: (1e-2, 2**-3)}


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _run(*args, **kwargs):
    """Runs the kernel in the interpreter and asserts the race detector saw no race."""
    out = jax.block_until_ready(paged_decode_tpu(*args, **kwargs))
    assert_no_race()
    return out


def _make_inputs(seed, *, batch, kv_heads, group, head_dim, page_size, max_pages, dtype, lengths):
    """Random pools and queries, a shuffled page table whose padding entries are random ids."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + 3
    q = rng.standard_normal((batch, kv_heads * group, head_dim))
    k = rng.standard_normal((kv_heads, num_pages, page_size, head_dim))
    v = rng.standard_normal((kv_heads, num_pages, page_size, head_dim))
    page_table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    lengths = np.asarray(lengths, np.int32)
    for b, n in enumerate(lengths):
        used = -(-int(n) // page_size)
        page_table[b, used:] = rng.integers(0, num_pages, max_pages - used)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(lengths),
        jnp.asarray(page_table, jnp.int32),
    )


def _ragged_lengths(batch, page_size, max_pages, seed):
    """1, a page boundary, the maximum, then random lengths."""
    capacity = page_size * max_pages
    fixed = [1, page_size, capacity, page_size + 1, capacity - 1]
    rng = np.random.default_rng(seed)
    rest = rng.integers(1, capacity + 1, max(0, batch - len(fixed))).tolist()
    return (fixed + rest)[:batch]


def _check(out, args, dtype, **options):
    q, k, v, lengths, page_table = args
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = reference.paged_attention_xla(*up, lengths, page_table, **options)
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref)
    assert out.shape == ref.shape and not np.isnan(out).any()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"


def _case(
    dtype,
    kv_heads,
    group,
    head_dim,
    page_size,
    *,
    batch=5,
    max_pages=5,
    lengths=None,
    seed=0,
    interpret=SHARP,
    **kwargs,
):
    lengths = lengths or _ragged_lengths(batch, page_size, max_pages, seed)
    args = _make_inputs(
        seed,
        batch=len(lengths),
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
        dtype=dtype,
        lengths=lengths,
    )
    options = {k: kwargs.pop(k) for k in ("scale", "soft_cap", "sliding_window") if k in kwargs}
    q, k, v, lens, page_table = args
    dead = _dead_slots(lens, page_table, k.shape[1], page_size, options.get("sliding_window"))
    k_nan, v_nan = (jnp.where(dead, jnp.nan, x) for x in (k, v))
    out = _run(q, k_nan, v_nan, lens, page_table, interpret=interpret, **options, **kwargs)
    _check(out, args, dtype, **options)


# (dtype, K, G, D, S, tuning): GQA 4 and 8, MHA, MQA; D 64/128/256; S 8..128;
# default and odd pages_per_block; bf16 with half-tile pages (S = 8).
DEFAULT_GRID = [
    (jnp.bfloat16, 2, 4, 128, 16, {}),
    (jnp.float32, 1, 8, 64, 8, {"pages_per_block": 3}),
    (jnp.bfloat16, 3, 1, 256, 32, {"pages_per_block": 2}),
    (jnp.bfloat16, 1, 4, 128, 8, {"pages_per_block": 4}),
    (jnp.float32, 2, 4, 128, 128, {"interpret": True}),
]


@pytest.mark.parametrize("dtype, kv_heads, group, head_dim, page_size, tuning", DEFAULT_GRID)
def test_matches_reference(dtype, kv_heads, group, head_dim, page_size, tuning):
    _case(dtype, kv_heads, group, head_dim, page_size, **tuning)


@pytest.mark.parametrize(
    "dtype, page_size, tuning, options",
    [
        # Window crossing block and page boundaries; the first block starts before it.
        (jnp.float32, 8, {"pages_per_block": 2}, {"soft_cap": 2.0, "sliding_window": 21}),
        (jnp.bfloat16, 16, {}, {"soft_cap": 5.0, "sliding_window": 7, "scale": 0.3}),
    ],
)
def test_soft_cap_and_sliding_window(dtype, page_size, tuning, options):
    _case(dtype, 2, 4, 128, page_size, max_pages=6, batch=6, seed=1, **tuning, **options)


def test_logits_hundreds_apart():
    """Scale 50 puts the logits hundreds apart: each block rescales by the maximum over the
    step's blocks so far, and each step starts afresh, so no exp over- or underflows."""
    _case(jnp.float32, 1, 4, 64, 8, batch=4, max_pages=4, pages_per_block=1, scale=50.0)


def test_zero_length_and_two_cores():
    """Megacore split (2 simulated cores) with a batch that does not divide; one empty row."""
    params = dataclasses.replace(SHARP, num_cores_or_threads=2, random_seed=3)
    args = _make_inputs(
        2,
        batch=3,
        kv_heads=1,
        group=4,
        head_dim=128,
        page_size=16,
        max_pages=4,
        dtype=jnp.float32,
        lengths=[33, 0, 64],
    )
    out = _run(*args, interpret=params, num_cores=2, pages_per_block=1)
    _check(out, args, jnp.float32)
    assert not np.asarray(out[1]).any()


def test_pages_outside_the_visible_range_are_never_copied():
    """Padding entries and pages before the window get out-of-range ids: any DMA of them raises."""
    page_size, max_pages, window = 8, 6, 12
    lengths = [1, 20, 48, 9]
    args = _make_inputs(
        4,
        batch=4,
        kv_heads=2,
        group=2,
        head_dim=64,
        page_size=page_size,
        max_pages=max_pages,
        dtype=jnp.float32,
        lengths=lengths,
    )
    q, k, v, lens, page_table = args
    bad = np.asarray(page_table).copy()
    for b, n in enumerate(lengths):
        first = max(n - window, 0) // page_size
        last = -(-n // page_size)
        bad[b, :first] = 10_000
        bad[b, last:] = 10_000
    out = _run(q, k, v, lens, jnp.asarray(bad), sliding_window=window, interpret=SHARP)
    _check(out, args, jnp.float32, sliding_window=window)


def _dead_slots(lengths, page_table, num_pages, page_size, window=None):
    """[1, P, S, 1] bool: True where no visible key lives (NaN goes there)."""
    live = np.zeros((num_pages, page_size), bool)
    table = np.asarray(page_table)
    for b, n in enumerate(np.asarray(lengths)):
        lo = 0 if window is None else max(int(n) - window, 0)
        for t in range(lo, int(n)):
            live[table[b, t // page_size], t % page_size] = True
    return jnp.asarray(~live)[None, :, :, None]


def _fp8_case(dtype, kv_dtype, kv_heads, group, head_dim, page_size, *, max_pages=5, **kwargs):
    """FP8 pages (NaN in every dead slot) with a `dtype` query: tight against the reference
    on the same fp8 values, loose (FP8_BOUNDS) against the unquantised K/V."""
    lengths = _ragged_lengths(5, page_size, max_pages, 3)
    q, k, v, lens, page_table = _make_inputs(
        3,
        batch=len(lengths),
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
        dtype=jnp.float32,
        lengths=lengths,
    )
    q = q.astype(dtype)
    options = {k: kwargs.pop(k) for k in ("scale", "soft_cap", "sliding_window") if k in kwargs}
    dead = _dead_slots(lens, page_table, k.shape[1], page_size, options.get("sliding_window"))
    k8, v8 = k.astype(kv_dtype), v.astype(kv_dtype)
    k8_nan, v8_nan = (jnp.where(dead, jnp.nan, x).astype(kv_dtype) for x in (k, v))
    out = _run(q, k8_nan, v8_nan, lens, page_table, interpret=SHARP, **options, **kwargs)
    assert out.dtype == dtype
    _check(out, (q, k8, v8, lens, page_table), dtype, **options)
    f32 = jnp.float32
    ref = reference.paged_attention_xla(q.astype(f32), k, v, lens, page_table, **options)
    out, ref = np.asarray(out.astype(f32)), np.asarray(ref)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    low, high = FP8_BOUNDS[kv_dtype]
    assert low < err < high, f"relative error {err} vs unquantised K/V, expected in {low, high}"


@pytest.mark.parametrize(
    "dtype, kv_heads, group, head_dim, page_size, kwargs",
    [
        # Two blocks per sequence: the double buffer cycles through fp8 pages.
        (jnp.bfloat16, 2, 4, 128, 16, {"pages_per_block": 2}),
        # f32 q, MQA, S = 8 (a quarter of an fp8 tile), window and soft cap.
        (jnp.float32, 1, 8, 64, 8, {"soft_cap": 5.0, "sliding_window": 19}),
    ],
)
def test_fp8_pages(dtype, kv_heads, group, head_dim, page_size, kwargs):
    _fp8_case(dtype, jnp.float8_e4m3fn, kv_heads, group, head_dim, page_size, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, kv_dtype, kv_heads, group, head_dim, page_size, kwargs",
    [
        (jnp.bfloat16, jnp.float8_e4m3fn, 2, 1, 64, 32, {"pages_per_block": 3}),
        (jnp.float32, jnp.float8_e4m3fn, 1, 4, 128, 64, {"soft_cap": 2.0}),
        (jnp.bfloat16, jnp.float8_e4m3fn, 2, 8, 256, 16, {"sliding_window": 30}),
        (jnp.bfloat16, jnp.float8_e4m3fn, 1, 4, 128, 128, {}),
        (jnp.float32, jnp.float8_e4m3fn, 3, 1, 256, 8, {"pages_per_block": 1}),
        (jnp.bfloat16, jnp.float8_e5m2, 2, 4, 128, 16, {"soft_cap": 8.0, "sliding_window": 21}),
        (jnp.float32, jnp.float8_e5m2, 1, 8, 64, 32, {"pages_per_block": 2}),
    ],
)
def test_fp8_pages_grid(dtype, kv_dtype, kv_heads, group, head_dim, page_size, kwargs):
    _fp8_case(dtype, kv_dtype, kv_heads, group, head_dim, page_size, max_pages=6, **kwargs)


def test_race_detector_catches_a_racy_copy():
    """The harness can fail: reading a DMA's destination before waiting is reported."""
    racy_copy_is_flagged()


@pytest.mark.parametrize(
    "knobs, error",
    [
        ({"pages_per_block": 0}, ValueError),
        ({"pages_per_block": 2.5}, ValueError),
        ({"num_cores": 0}, ValueError),
        ({"vmem_limit_bytes": -1}, ValueError),
        ({"interpret": "yes"}, TypeError),
        ({"block_size": 4}, TypeError),
    ],
)
def test_bad_tuning_knobs(knobs, error):
    """The error names the knob and, for a bad value, the value."""
    args = _make_inputs(
        0,
        batch=1,
        kv_heads=1,
        group=1,
        head_dim=64,
        page_size=8,
        max_pages=1,
        dtype=jnp.float32,
        lengths=[3],
    )
    ((name, value),) = knobs.items()
    match = "block_size" if name == "block_size" else f"{name}.*{re.escape(repr(value))}"
    with pytest.raises(error, match=match):
        paged_decode_tpu(*args, **knobs)


def test_default_tuning():
    assert tpu.default_pages_per_block(16, 128, jnp.bfloat16, 1000) == 32  # 512 tokens
    assert tpu.default_pages_per_block(16, 256, jnp.float32, 1000) == 8  # 128 tokens
    assert tpu.default_pages_per_block(128, 64, jnp.bfloat16, 1000) == 8  # 1024 tokens
    assert tpu.default_pages_per_block(16, 128, jnp.bfloat16, 3) == 8  # 48 -> 128 tokens
    assert tpu.default_pages_per_block(128, 128, jnp.bfloat16, 3) == 3
    assert tpu.default_num_cores() == 1  # CPU
    # Blocks are sized in the pages' bytes: fp8 pages get twice the tokens (up to 1024).
    assert tpu.default_pages_per_block(16, 128, jnp.float8_e4m3fn, 1000) == 64  # 1024 tokens


def _lower(dtype, kv_heads, group, head_dim, page_size, **kwargs):
    batch, num_pages, max_pages = 7, 64, 33
    pool = jax.ShapeDtypeStruct((kv_heads, num_pages, page_size, head_dim), dtype)
    args = (
        jax.ShapeDtypeStruct((batch, kv_heads * group, head_dim), dtype),
        pool,
        pool,
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
    )
    f = functools.partial(paged_decode_tpu, **kwargs)
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize(
    "dtype, kv_heads, group, head_dim, page_size, kwargs",
    [
        (jnp.bfloat16, 8, 4, 128, 16, {}),
        (jnp.bfloat16, 8, 4, 128, 64, {}),
        (jnp.bfloat16, 2, 4, 128, 16, {"soft_cap": 30.0, "sliding_window": 100}),
        (jnp.bfloat16, 2, 8, 256, 8, {"num_cores": 2}),
        (jnp.float32, 1, 1, 64, 128, {"pages_per_block": 3}),
    ],
)
def test_lowers_for_tpu(dtype, kv_heads, group, head_dim, page_size, kwargs):
    _lower(dtype, kv_heads, group, head_dim, page_size, **kwargs)


@pytest.mark.parametrize(
    "dtype, kv_dtype, page_size, kwargs",
    [
        (jnp.bfloat16, jnp.float8_e4m3fn, 16, {}),
        (jnp.float32, jnp.float8_e4m3fn, 64, {"soft_cap": 30.0, "sliding_window": 100}),
        (jnp.bfloat16, jnp.float8_e5m2, 32, {"num_cores": 2}),
    ],
)
def test_fp8_lowers_for_tpu(dtype, kv_dtype, page_size, kwargs):
    kv_heads, group, head_dim, batch, num_pages, max_pages = 8, 4, 128, 7, 64, 33
    pool = jax.ShapeDtypeStruct((kv_heads, num_pages, page_size, head_dim), kv_dtype)
    args = (
        jax.ShapeDtypeStruct((batch, kv_heads * group, head_dim), dtype),
        pool,
        pool,
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
    )
    f = functools.partial(paged_decode_tpu, **kwargs)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    # The pools reach the kernel as fp8 (DMA'd as such): no upcast copy outside it.
    fp8 = "f8E4M3FN" if kv_dtype == jnp.float8_e4m3fn else "f8E5M2"
    assert f"tensor<8x64x{page_size}x128x{fp8}>" in text


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads, group", [(4, 1), (2, 4), (2, 8), (1, 8)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gqa_ratios_with_window(dtype, kv_heads, group):
    _case(
        dtype,
        kv_heads,
        group,
        128,
        16,
        batch=9,
        max_pages=7,
        seed=group,
        soft_cap=10.0,
        sliding_window=37,
        pages_per_block=3,
    )
