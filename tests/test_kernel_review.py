"""Kernel inputs at the edge of what the host checks take (an adversarial review of the
entry points): scale and soft_cap whose folded float32 constants would overflow, a pool
of no pages, unsigned query offsets, and float16, on every backend (GPU and TPU kernels
interpreted). Shapes and helpers are tests/test_kernel_edges.py's."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernel_edges import F32, LENGTHS, RAGGED_CTX, RAGGED_Q, decode_case, ragged_case

import pallas_kernels


def _backend_kw(backend):
    return dict(backend=backend) if backend == "xla" else dict(backend=backend, interpret=True)


@pytest.mark.parametrize("name", ["scale", "soft_cap"])
@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_scale_or_soft_cap_too_large_for_log2e_is_rejected(op, name):
    """The GPU kernels fold log2(e) into scale and soft_cap (exp2 softmax): above
    float32 max / log2(e) ~ 2.36e38 the constant overflowed to inf and the output was
    NaN (soft_cap=2.5e38 passed the host check; XLA and the TPU kernels were finite)."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), F32)
    k, v = (jnp.asarray(rng.standard_normal((2, 3, 8, 16)), F32) for _ in range(2))
    table, n = jnp.asarray([[0, 1], [2, 0]], jnp.int32), jnp.asarray([9, 5], jnp.int32)
    loc = jnp.asarray([0, 1, 2], jnp.int32)
    for backend in ("gpu", "tpu", "xla"):
        with pytest.raises(ValueError, match=rf"{name} must be at most 2.35.*got {name}=2.5e\+38"):
            if op == "decode":
                pallas_kernels.paged_decode_attention(
                    q, k, v, n, table, **{name: 2.5e38}, **_backend_kw(backend)
                )
            else:
                pallas_kernels.ragged_paged_attention(
                    q, k, v, table, n, loc, **{name: 2.5e38}, **_backend_kw(backend)
                )


@pytest.mark.parametrize(
    "opts,got",
    [
        (dict(scale=1e38, soft_cap=1e-3), "scale=1e+38 and soft_cap=0.001"),
        (dict(soft_cap=1e-45), "scale=0.25 and soft_cap=1e-45"),  # the default scale, D ** -0.5
    ],
)
def test_scale_over_soft_cap_too_large_is_rejected(opts, got):
    # The GPU ragged and TPU decode kernels multiply the logits by scale / soft_cap, one
    # constant: inf here, so a zero logit became NaN (XLA's was 0).
    q, pool = jnp.zeros((2, 4, 16), F32), jnp.ones((2, 3, 8, 16), F32)
    table, n = jnp.asarray([[0, 1], [2, 0]], jnp.int32), jnp.asarray([9, 5], jnp.int32)
    for backend in ("gpu", "tpu", "xla"):
        with pytest.raises(
            ValueError, match=f"scale / soft_cap must be at most .*got {re.escape(got)}"
        ):
            pallas_kernels.paged_decode_attention(
                q, pool, pool, n, table, **opts, **_backend_kw(backend)
            )
        with pytest.raises(
            ValueError, match=f"scale / soft_cap must be at most .*got {re.escape(got)}"
        ):
            pallas_kernels.ragged_paged_attention(
                q, pool, pool, table, n, jnp.asarray([0, 1, 2]), **opts, **_backend_kw(backend)
            )


def test_largest_soft_cap_taken_is_finite_on_the_gpu_kernels():
    decode_case("gpu", LENGTHS, max_pages=4, soft_cap=2.35e38, num_splits=2, block_kv=16)
    ragged_case("gpu", RAGGED_Q, RAGGED_CTX, max_pages=5, soft_cap=2.35e38, block_q=8)


@pytest.mark.parametrize("backend", ["gpu", "tpu", "xla"])
def test_empty_pool_with_empty_sequences_gives_zeros(backend):
    """A pool of no pages (P = 0) passes the host check when no sequence has a token
    (no page id is read), as an empty table does; it failed in every backend instead
    ("Slice size at index 1 in gather op is out of range", a ZeroDivisionError)."""
    q = jnp.ones((2, 4, 16), F32)
    pool = jnp.zeros((2, 0, 8, 16), F32)
    table, zero = jnp.full((2, 3), -1, jnp.int32), jnp.zeros((2,), jnp.int32)
    kw = _backend_kw(backend)
    out = pallas_kernels.paged_decode_attention(q, pool, pool, zero, table, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.zeros(q.shape))
    loc = jnp.zeros((3,), jnp.int32)
    out = pallas_kernels.ragged_paged_attention(q, pool, pool, table, zero, loc, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.zeros(q.shape))


def test_unsigned_query_start_loc_must_be_non_decreasing():
    # np.diff of a uint32 [0, 5, 3] wrapped to q_len 4294967294: the error blamed the
    # context length, and with traced context_lens the decreasing offsets passed.
    q = jnp.ones((5, 4, 16), F32)
    pool = jnp.ones((2, 4, 8, 16), F32)
    table = jnp.zeros((2, 2), jnp.int32)
    loc = np.array([0, 5, 3], np.uint32)
    with pytest.raises(ValueError, match="non-decreasing, got 5 then 3 at index 1"):
        pallas_kernels.ragged_paged_attention(q, pool, pool, table, np.array([5, 9]), loc)
    traced = jax.jit(
        lambda ctx: pallas_kernels.ragged_paged_attention(q, pool, pool, table, ctx, loc)
    )
    with pytest.raises(ValueError, match="non-decreasing, got 5 then 3 at index 1"):
        traced(jnp.asarray([5, 9], jnp.int32))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_float16(backend):
    # The model runs in float16 too (ModelConfig dtype="float16"); the shape grids do not.
    f16 = jnp.float16
    decode_case(backend, LENGTHS, max_pages=4, dtype=f16, sliding_window=9, soft_cap=3.0)
    ragged_case(backend, RAGGED_Q, RAGGED_CTX, max_pages=5, pad_rows=2, dtype=f16)


def test_a_pool_past_the_gpu_kernels_int32_offsets_is_refused_or_runs_xla(monkeypatch):
    """The GPU kernels' Triton code addresses a pool with int32 element offsets
    (`scripts/triton_ir.py`: `tt.addptr` of i32 tensors): a pool over 2**31 elements
    passed the checks and would have read the wrong pages on a GPU."""
    from pallas_kernels import dispatch, validation

    big = (2, 2**21, 16, 64)  # 2**32 elements: one layer's K pool
    assert not validation.gpu_pool_ok(big) and validation.gpu_pool_ok((1, 2**21, 16, 64))
    sds = jax.ShapeDtypeStruct
    q, pool = sds((2, 4, 64), jnp.bfloat16), sds(big, jnp.bfloat16)
    table, n = sds((2, 4), jnp.int32), sds((2,), jnp.int32)
    loc = sds((3,), jnp.int32)
    kw = dict(backend="gpu", interpret=True)
    with pytest.raises(
        ValueError, match=r"int32 offsets.*k_pages \[2, 2097152, 16, 64\].*at most 1048576 pages"
    ):
        jax.eval_shape(
            lambda *a: pallas_kernels.paged_decode_attention(*a, **kw), q, pool, pool, n, table
        )
    with pytest.raises(ValueError, match="int32 offsets"):
        jax.eval_shape(
            lambda *a: pallas_kernels.ragged_paged_attention(*a, **kw), q, pool, pool, table, n, loc
        )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # "auto" on CUDA
    assert dispatch._kernel_backend("auto", big) == "xla"
    assert dispatch._kernel_backend("auto", (1, 2**21, 16, 64)) == "gpu"
    with pytest.raises(TypeError, match=r"chose it for k_pages \[2, 2097152, 16, 64\], too large"):
        dispatch._no_xla_knobs("auto", dict(block_kv=32), big)
