"""Bad input to the public attention entry points: a clear error on the host, or a right answer.

Found by probing `paged_decode_attention` and `ragged_paged_attention` as a user
would: each case here either crashed deep inside JAX, or was accepted and gave a
wrong (NaN, truncated, meaningless) result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference as ref


def decode_inputs(seed=0, b=3, h=4, k=2, p=10, s=4, d=16, max_pages=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    kp = rng.standard_normal((k, p, s, d)).astype(np.float32)
    vp = rng.standard_normal((k, p, s, d)).astype(np.float32)
    table = rng.permutation(p)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    lengths = np.array([1, s, max_pages * s][:b], np.int32)
    return q, kp, vp, lengths, table


def ragged_inputs(seed=0):
    q, kp, vp, lengths, table = decode_inputs(seed)
    q = np.random.default_rng(seed + 100).standard_normal((8, 4, 16)).astype(np.float32)
    loc = np.array([0, 1, 3, 7], np.int32)  # q_lens 1, 2, 4 <= context 1, 4, 12
    return q, kp, vp, table, lengths, loc


def decode(*args, **kw):
    return pk.paged_decode_attention(*args, backend="xla", **kw)


def ragged(*args, **kw):
    return pk.ragged_paged_attention(*args, backend="xla", **kw)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_non_float_q_and_pages_are_rejected(dtype):
    q, kp, vp, lengths, table = decode_inputs()
    q, kp, vp = (x.astype(dtype) for x in (q, kp, vp))
    with pytest.raises(TypeError, match=f"q must be a floating array, got dtype {np.dtype(dtype)}"):
        decode(q, kp, vp, lengths, table)
    rq, rkp, rvp, rtable, rlens, loc = ragged_inputs()
    with pytest.raises(TypeError, match="q must be a floating array"):
        ragged(rq.astype(dtype), rkp.astype(dtype), rvp.astype(dtype), rtable, rlens, loc)


def test_one_byte_q_with_same_dtype_pages_is_rejected():
    # fp8 is for the pages (FP8_DTYPES, with a wider q); an fp8 q never is.
    q, kp, vp, lengths, table = decode_inputs()
    fp8 = jnp.float8_e4m3fnuz
    with pytest.raises(TypeError, match="q must be 16-bit or wider"):
        decode(q.astype(fp8), kp.astype(fp8), vp.astype(fp8), lengths, table)


@pytest.mark.parametrize("name", ["q", "k_pages", "lengths", "page_table"])
def test_lists_instead_of_arrays_are_a_type_error(name):
    args = dict(
        zip(["q", "k_pages", "v_pages", "lengths", "page_table"], decode_inputs(), strict=True)
    )
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=f"{name} must be an array .*, got list"):
        decode(*args.values())


def test_ragged_lists_instead_of_arrays_are_a_type_error():
    q, kp, vp, table, lengths, loc = ragged_inputs()
    with pytest.raises(TypeError, match="context_lens must be an array .*, got list"):
        ragged(q, kp, vp, table, lengths.tolist(), loc)
    with pytest.raises(TypeError, match="query_start_loc must be an array .*, got list"):
        ragged(q, kp, vp, table, lengths, loc.tolist())


def test_zero_head_dim_is_rejected():
    q, kp, vp, lengths, table = decode_inputs()
    with pytest.raises(ValueError, match="head_dim must be positive, got head_dim=0"):
        decode(q[..., :0], kp[..., :0], vp[..., :0], lengths, table)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(scale=float("inf")), ValueError, "scale must be positive and finite, got scale=inf"),
        (dict(scale=1e39), ValueError, "scale must be positive and finite"),  # inf in float32
        (dict(soft_cap=float("inf")), ValueError, "soft_cap must be positive and finite"),
        (dict(scale=True), TypeError, "scale must be a real number, got scale=True"),
        (dict(soft_cap=True), TypeError, "soft_cap must be a real number, got soft_cap=True"),
        (dict(scale="0.3"), TypeError, "scale must be a real number, got scale='0.3'"),
        (dict(scale=1j), TypeError, "scale must be a real number"),
        (dict(scale=np.array([0.1, 0.2])), TypeError, "scale must be a real number"),
        (dict(sliding_window=True), TypeError, "sliding_window must be an int"),
        (dict(sliding_window=float("nan")), ValueError, "sliding_window must be a positive int"),
        (dict(sliding_window=float("inf")), ValueError, "sliding_window must be a positive int"),
        (dict(sliding_window=2**31), ValueError, r"sliding_window must be < 2\*\*31"),
    ],
)
def test_bad_options_are_rejected_on_the_host(kwargs, error, match):
    q, kp, vp, lengths, table = decode_inputs()
    with pytest.raises(error, match=match):
        decode(q, kp, vp, lengths, table, **kwargs)
    rq, rkp, rvp, rtable, rlens, loc = ragged_inputs()
    with pytest.raises(error, match=match):
        ragged(rq, rkp, rvp, rtable, rlens, loc, **kwargs)


@pytest.mark.parametrize(
    "kwargs,plain",
    [
        (dict(scale=np.float32(0.3)), dict(scale=0.3)),
        (dict(scale=jnp.float32(0.3)), dict(scale=0.3)),
        (dict(soft_cap=np.float64(2.0)), dict(soft_cap=2.0)),
        (dict(sliding_window=np.int64(3)), dict(sliding_window=3)),
        (dict(sliding_window=3.0), dict(sliding_window=3)),
        (dict(sliding_window=2**31 - 1), {}),
    ],
)
def test_numpy_and_jax_scalar_options_match_plain_python(kwargs, plain):
    q, kp, vp, lengths, table = decode_inputs(1)
    want = ref.paged_attention_xla(q, kp, vp, lengths, table, **plain)
    got = decode(q, kp, vp, lengths, table, **kwargs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_traced_options_under_jit_are_a_clear_type_error():
    q, kp, vp, lengths, table = decode_inputs()
    f = jax.jit(lambda q, scale: decode(q, kp, vp, lengths, table, scale=scale))
    with pytest.raises(TypeError, match="scale must be a static number, not a traced array"):
        f(q, 0.25)
    g = jax.jit(lambda q, w: decode(q, kp, vp, lengths, table, sliding_window=w))
    with pytest.raises(TypeError, match="sliding_window must be a static number"):
        g(q, 2)


def test_empty_batch_and_empty_page_table_give_zeros_on_every_path():
    q, kp, vp, lengths, table = decode_inputs(2)
    zero = np.zeros(q.shape, np.float32)
    no_pages = table[:, :0]
    no_lengths = np.zeros_like(lengths)
    for out in (
        decode(q, kp, vp, no_lengths, no_pages),
        ref.paged_attention_xla(q, kp, vp, no_lengths, no_pages),
        decode(q, kp[:, :0], vp[:, :0], no_lengths, no_pages),  # an empty pool too
    ):
        np.testing.assert_array_equal(np.asarray(out), zero)
    assert decode(q[:0], kp, vp, lengths[:0], table[:0]).shape == (0, 4, 16)

    rq, rkp, rvp, rtable, rlens, _ = ragged_inputs(2)
    rzero = np.zeros(rq.shape, np.float32)
    empty_loc = np.zeros(4, np.int32)
    for out in (
        ragged(rq, rkp, rvp, rtable[:, :0], np.zeros_like(rlens), empty_loc),
        ref.ragged_paged_attention_xla(
            rq, rkp, rvp, rtable[:, :0], np.zeros_like(rlens), empty_loc
        ),
        ragged(rq, rkp, rvp, rtable[:0], rlens[:0], empty_loc[:1]),
        ref.ragged_paged_attention_xla(rq, rkp, rvp, rtable[:0], rlens[:0], empty_loc[:1]),
    ):
        np.testing.assert_array_equal(np.asarray(out), rzero)


def test_ragged_gpu_kernel_with_an_empty_page_table_gives_zeros():
    # max_pages == 0: the GPU ragged kernel answers zeros itself (the dispatcher no longer
    # short-cuts it, so its knobs are checked: see the test below).
    rq, rkp, rvp, rtable, rlens, _ = ragged_inputs(3)
    out = pk.ragged_paged_attention(
        rq,
        rkp,
        rvp,
        rtable[:, :0],
        np.zeros_like(rlens),
        np.zeros(4, np.int32),
        backend="gpu",
        interpret=True,
    )
    np.testing.assert_array_equal(np.asarray(out), np.zeros(rq.shape, np.float32))


def test_zero_query_heads_is_rejected():
    # H = 0 passes "kv heads must divide query heads" (0 % K == 0); the GPU kernels then
    # failed in a gather and the TPU kernels with a ZeroDivisionError.
    q, kp, vp, lengths, table = decode_inputs()
    rq, rkp, rvp, rtable, rlens, loc = ragged_inputs()
    for backend in ("xla", "gpu", "tpu"):
        with pytest.raises(ValueError, match="q must have query heads, got num_heads=0"):
            pk.paged_decode_attention(
                q[:, :0], kp, vp, lengths, table, backend=backend, interpret=True
            )
        with pytest.raises(ValueError, match="q must have query heads, got num_heads=0"):
            pk.ragged_paged_attention(
                rq[:, :0], rkp, rvp, rtable, rlens, loc, backend=backend, interpret=True
            )


@pytest.mark.parametrize(
    "op,backend,knobs",
    [
        ("decode", "gpu", dict(block_kv=np.int64(16), num_splits=np.int32(2))),
        ("decode", "tpu", dict(pages_per_block=np.int64(2), num_cores=jnp.int32(2))),
        ("ragged", "gpu", dict(block_q=np.int64(8), block_kv=np.int32(16))),
    ],
)
def test_numpy_and_jax_int_knobs_are_taken(op, backend, knobs):
    # The kernels check knobs with isinstance(x, int): a numpy or jax int was refused with
    # "block_kv must be a power of two >= 16, got block_kv=np.int64(16)".
    if op == "decode":
        q, kp, vp, lengths, table = decode_inputs(4)
        got = pk.paged_decode_attention(
            q, kp, vp, lengths, table, backend=backend, interpret=True, **knobs
        )
        want = ref.paged_attention_xla(q, kp, vp, lengths, table)
    else:
        q, kp, vp, table, lengths, loc = ragged_inputs(4)
        got = pk.ragged_paged_attention(
            q, kp, vp, table, lengths, loc, backend=backend, interpret=True, **knobs
        )
        want = ref.ragged_paged_attention_xla(q, kp, vp, table, lengths, loc)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_ragged_knobs_are_checked_with_an_empty_page_table(backend):
    # The dispatcher answered zeros for a table with no columns before the kernel saw its
    # knobs, so a misspelt or bad knob passed silently there.
    rq, rkp, rvp, rtable, rlens, _ = ragged_inputs(3)
    args = (rq, rkp, rvp, rtable[:, :0], np.zeros_like(rlens), np.zeros(4, np.int32))
    with pytest.raises(TypeError, match="unexpected keyword argument 'blok_q'"):
        pk.ragged_paged_attention(*args, backend=backend, interpret=True, blok_q=8)
    with pytest.raises(ValueError, match="block_q"):
        pk.ragged_paged_attention(*args, backend=backend, interpret=True, block_q=3)
    # No query rows, or no sequences: the TPU kernel answered zeros before its checks.
    empty_q = (rq[:0], rkp, rvp, rtable, rlens, np.zeros(4, np.int32))
    no_seqs = (rq, rkp, rvp, rtable[:0], rlens[:0], np.zeros(1, np.int32))
    for empty in (empty_q, no_seqs):
        with pytest.raises(ValueError, match="block_q"):
            pk.ragged_paged_attention(*empty, backend=backend, interpret=True, block_q=3)
        out = pk.ragged_paged_attention(*empty, backend=backend, interpret=True)
        assert out.shape == empty[0].shape and not np.asarray(out).any()
