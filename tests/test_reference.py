"""The dense references against a naive numpy softmax, and the paged XLA paths against them."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import reference as ref
from pallas_kernels import validation
from pallas_kernels.validation import FP8_DTYPES


def naive_attention(q, k, v, q_pos, k_len, *, scale=None, soft_cap=None, window=None):
    """q [Tq, H, D], k/v [Tk, K, D] float64 numpy; query i at position q_pos[i]."""
    tq, h, d = q.shape
    group = h // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = np.zeros((tq, h, d))
    for i in range(tq):
        js = [
            j for j in range(k_len) if j <= q_pos[i] and (window is None or j > q_pos[i] - window)
        ]
        if not js:
            continue
        for hh in range(h):
            kk = k[js, hh // group].astype(np.float64)
            s = kk @ q[i, hh].astype(np.float64) * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            out[i, hh] = (p / p.sum()) @ v[js, hh // group].astype(np.float64)
    return out


def rel_err(out, want):
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any()
    return np.linalg.norm(out - want) / np.linalg.norm(want)


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# MHA, GQA 4 and MQA (a group of 8): the grouping is one repeat of the K/V heads.
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("opts", [{}, {"soft_cap": 5.0}, {"window": 5}, {"scale": 0.3}])
def test_decode_matches_naive(heads, kv_heads, opts):
    rng = np.random.default_rng(0)
    b, t, d = 4, 19, 16
    q, k, v = randn(rng, b, heads, d), randn(rng, b, t, kv_heads, d), randn(rng, b, t, kv_heads, d)
    lengths = np.array([1, 7, 16, t])
    out = ref.decode(
        q,
        k,
        v,
        lengths,
        scale=opts.get("scale"),
        soft_cap=opts.get("soft_cap"),
        sliding_window=opts.get("window"),
    )
    for i, n in enumerate(lengths):
        want = naive_attention(
            q[i][None],
            k[i],
            v[i],
            [n - 1],
            n,
            scale=opts.get("scale"),
            soft_cap=opts.get("soft_cap"),
            window=opts.get("window"),
        )[0]
        assert rel_err(out[i], want) < 1e-5


def test_decode_zero_length_row_is_zero():
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, 2, 4, 8), randn(rng, 2, 5, 2, 8), randn(rng, 2, 5, 2, 8)
    out = np.asarray(ref.decode(q, k, v, np.array([0, 3])))
    assert (out[0] == 0).all() and np.abs(out[1]).sum() > 0


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("opts", [{}, {"soft_cap": 3.0, "window": 4}])
def test_causal_prefill_matches_naive(heads, kv_heads, opts):
    rng = np.random.default_rng(2)
    b, t, d = 3, 12, 8
    q, k, v = (
        randn(rng, b, t, heads, d),
        randn(rng, b, t, kv_heads, d),
        randn(rng, b, t, kv_heads, d),
    )
    lengths = np.array([1, 9, t])
    out = np.asarray(
        ref.causal_prefill(
            q, k, v, lengths, soft_cap=opts.get("soft_cap"), sliding_window=opts.get("window")
        )
    )
    for i, n in enumerate(lengths):
        want = naive_attention(
            q[i, :n],
            k[i],
            v[i],
            np.arange(n),
            n,
            soft_cap=opts.get("soft_cap"),
            window=opts.get("window"),
        )
        assert rel_err(out[i, :n], want) < 1e-5
        assert (out[i, n:] == 0).all()


@pytest.mark.parametrize("tq,tk", [(1, 1), (1, 9), (4, 9), (9, 9)])
def test_attention_chunk_matches_naive(tq, tk):
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, tq, 8, 16), randn(rng, tk + 3, 2, 16), randn(rng, tk + 3, 2, 16)
    out = ref.attention_chunk(q, k, v, context_len=tk, soft_cap=10.0)
    want = naive_attention(q, k, v, tk - tq + np.arange(tq), tk, soft_cap=10.0)
    assert rel_err(out, want) < 1e-5


def test_bfloat16_within_tolerance():
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, 2, 8, 64), randn(rng, 2, 40, 2, 64), randn(rng, 2, 40, 2, 64)
    lengths = np.array([33, 40])
    want = np.asarray(ref.decode(q, k, v, lengths), np.float64)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    out = ref.decode(*bf, lengths)
    assert out.dtype == jnp.bfloat16
    err = rel_err(np.asarray(out.astype(jnp.float32)), want)
    assert 1e-4 < err < 1e-2


def make_paged(rng, lengths, kv_heads, d, page_size, extra_pages=3, dtype=np.float32):
    """Random page pool with shuffled page tables; returns pool, table and dense K/V."""
    max_pages = max(-(-n // page_size) for n in lengths) + 1
    num_pages = len(lengths) * max_pages + extra_pages
    k_pages = randn(rng, kv_heads, num_pages, page_size, d).astype(dtype)
    v_pages = randn(rng, kv_heads, num_pages, page_size, d).astype(dtype)
    perm = rng.permutation(num_pages)[: len(lengths) * max_pages]
    table = perm.reshape(len(lengths), max_pages).astype(np.int32)
    dense_k = [
        np.concatenate([k_pages[:, p] for p in table[b]], axis=1).transpose(1, 0, 2)
        for b in range(len(lengths))
    ]  # [max_pages * S, K, D] each
    dense_v = [
        np.concatenate([v_pages[:, p] for p in table[b]], axis=1).transpose(1, 0, 2)
        for b in range(len(lengths))
    ]
    return k_pages, v_pages, table, dense_k, dense_v


# Each page size once and each head layout once: the paged path gathers pages, then runs
# `decode` (its heads: test_decode_matches_naive), so the two do not interact.
@pytest.mark.parametrize("page_size,heads,kv_heads", [(1, 4, 4), (4, 8, 2), (8, 8, 1)])
def test_paged_attention_xla_equals_dense_on_gathered(page_size, heads, kv_heads):
    rng = np.random.default_rng(5)
    d = 16
    lengths = np.array([1, page_size, 2 * page_size + 1, 23])
    k_pages, v_pages, table, dk, dv = make_paged(rng, lengths, kv_heads, d, page_size)
    q = randn(rng, len(lengths), heads, d)
    out = np.asarray(ref.paged_attention_xla(q, k_pages, v_pages, lengths, table))
    for b, n in enumerate(lengths):
        want = naive_attention(q[b][None], dk[b], dv[b], [n - 1], n)[0]
        assert rel_err(out[b], want) < 1e-5


def test_ragged_xla_mixed_batch_matches_naive():
    rng = np.random.default_rng(6)
    page_size, heads, kv_heads, d = 4, 8, 2, 16
    context = np.array([9, 1, 17, 6, 12])
    q_lens = np.array([3, 1, 1, 0, 12])  # chunk, decode, decode, empty, whole prompt
    k_pages, v_pages, table, dk, dv = make_paged(rng, context, kv_heads, d, page_size)
    loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(loc[-1]) + 2  # two padding rows
    q = randn(rng, t, heads, d)
    out = np.asarray(
        ref.ragged_paged_attention_xla(q, k_pages, v_pages, table, context, loc, sliding_window=6)
    )
    for b in range(len(context)):
        rows = slice(loc[b], loc[b + 1])
        if q_lens[b] == 0:
            continue
        pos = context[b] - q_lens[b] + np.arange(q_lens[b])
        want = naive_attention(q[rows], dk[b], dv[b], pos, context[b], window=6)
        assert rel_err(out[rows], want) < 1e-5
    assert (out[loc[-1] :] == 0).all()


def _poison_dead_slots(k_pages, v_pages, table, context, page_size):
    """NaN in every slot no sequence owns (stale tails of recycled pages, unused pages)."""
    owned = np.zeros(k_pages.shape[1:3], bool)
    for b, n in enumerate(context):
        for pos in range(n):
            owned[table[b, pos // page_size], pos % page_size] = True
    k_pages, v_pages = k_pages.copy(), v_pages.copy()
    k_pages[:, ~owned] = np.nan
    v_pages[:, ~owned] = np.nan
    return k_pages, v_pages


def test_xla_paths_keep_stale_nan_out():
    """NaN/inf in dead slots, or in another sequence's rows, never reaches a sequence."""
    rng = np.random.default_rng(8)
    page_size, heads, kv_heads, d = 4, 8, 2, 16
    context = np.array([9, 1, 17, 6])
    k_pages, v_pages, table, dk, dv = make_paged(rng, context, kv_heads, d, page_size)
    k_pages, v_pages = _poison_dead_slots(k_pages, v_pages, table, context, page_size)
    # Sequence 3's own K/V went non-finite (a broken request): it must not spread.
    k_pages[:, table[3, 0], 1] = np.inf
    v_pages[:, table[3, 0], 1] = np.nan
    q = randn(rng, len(context), heads, d)
    out = np.asarray(ref.paged_attention_xla(q, k_pages, v_pages, context, table))
    for b in range(3):
        want = naive_attention(q[b][None], dk[b], dv[b], [context[b] - 1], context[b])[0]
        assert rel_err(out[b], want) < 1e-5

    q_lens = np.array([3, 1, 5, 2])
    loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = randn(rng, int(loc[-1]) + 2, heads, d)
    out = np.asarray(ref.ragged_paged_attention_xla(q, k_pages, v_pages, table, context, loc))
    for b in range(3):
        rows = slice(loc[b], loc[b + 1])
        pos = context[b] - q_lens[b] + np.arange(q_lens[b])
        assert rel_err(out[rows], naive_attention(q[rows], dk[b], dv[b], pos, context[b])) < 1e-5
    assert (out[loc[-1] :] == 0).all()


def test_xla_paths_ignore_pages_released_below_the_window():
    """Pages wholly below every query's window may be released: the page table then names
    a padding page, which may hold anything (NaN here); the outputs must not change."""
    rng = np.random.default_rng(9)
    page_size, heads, kv_heads, d, window = 4, 8, 2, 16, 6
    context = np.array([23, 5, 18])
    q_lens = np.array([3, 1, 2])
    k_pages, v_pages, table, dk, dv = make_paged(rng, context, kv_heads, d, page_size)
    pad = max(set(range(k_pages.shape[1])) - set(table.ravel()))  # stands in for padding
    k_pages[:, pad], v_pages[:, pad] = np.nan, np.inf
    released = table.copy()
    for b, (n, q) in enumerate(zip(context, q_lens, strict=True)):
        below = max(0, n - q - window + 1) // page_size  # pages no query of b can see
        released[b, :below] = pad
    loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = randn(rng, int(loc[-1]), heads, d)
    out = np.asarray(
        ref.ragged_paged_attention_xla(
            q, k_pages, v_pages, released, context, loc, sliding_window=window
        )
    )
    assert (released != table).sum() >= 4  # the test releases pages of two sequences
    for b in range(len(context)):
        rows = slice(loc[b], loc[b + 1])
        pos = context[b] - q_lens[b] + np.arange(q_lens[b])
        want = naive_attention(q[rows], dk[b], dv[b], pos, context[b], window=window)
        assert rel_err(out[rows], want) < 1e-5
    last = q[loc[1:] - 1]  # each sequence's last query: the decode path
    out = np.asarray(
        ref.paged_attention_xla(last, k_pages, v_pages, context, released, sliding_window=window)
    )
    for b in range(len(context)):
        want = naive_attention(
            last[b][None], dk[b], dv[b], [context[b] - 1], context[b], window=window
        )
        assert rel_err(out[b], want[0]) < 1e-5


def test_gqa_heads_must_divide():
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError, match="kv heads must divide query heads"):
        ref.decode(randn(rng, 1, 6, 8), randn(rng, 1, 4, 4, 8), randn(rng, 1, 4, 4, 8), [2])


# ---------------------------------------------------------------- fp8 K/V

FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def fp8_round(x, kv_dtype):
    """x rounded to the fp8 format, as float32 numpy (what a kernel sees after the upcast)."""
    return np.asarray(jnp.asarray(x, kv_dtype).astype(jnp.float32))


def test_fp8_dtypes_exported():
    assert jnp.dtype(jnp.float8_e4m3fn) in FP8_DTYPES
    assert jnp.dtype(jnp.float8_e5m2) in FP8_DTYPES
    assert jnp.dtype(jnp.bfloat16) not in FP8_DTYPES


@pytest.mark.parametrize(
    "q_dtype,kv_dtype", [(jnp.float32, jnp.float8_e4m3fn), (jnp.bfloat16, jnp.float8_e5m2)]
)
def test_dense_references_upcast_fp8_kv(q_dtype, kv_dtype):
    """fp8 K/V give exactly what their upcast to q's dtype gives, in q's dtype."""
    rng = np.random.default_rng(9)
    q = jnp.asarray(randn(rng, 2, 8, 16), q_dtype)
    k8, v8 = (jnp.asarray(randn(rng, 2, 12, 2, 16), kv_dtype) for _ in "kv")
    k, v = k8.astype(q_dtype), v8.astype(q_dtype)
    lengths = np.array([5, 12])
    out = ref.decode(q, k8, v8, lengths, soft_cap=4.0)
    assert out.dtype == q_dtype
    np.testing.assert_array_equal(out, ref.decode(q, k, v, lengths, soft_cap=4.0))
    out = ref.attention_chunk(q[0, None], k8[0], v8[0], context_len=7, sliding_window=3)
    want = ref.attention_chunk(q[0, None], k[0], v[0], context_len=7, sliding_window=3)
    assert out.dtype == q_dtype
    np.testing.assert_array_equal(out, want)
    qp = jnp.asarray(randn(rng, 2, 12, 8, 16), q_dtype)
    out = ref.causal_prefill(qp, k8, v8, lengths)
    assert out.dtype == q_dtype
    np.testing.assert_array_equal(out, ref.causal_prefill(qp, k, v, lengths))


@pytest.mark.parametrize("kv_dtype", FP8)
def test_paged_xla_paths_with_fp8_pages_match_naive(kv_dtype):
    """Both XLA paged paths on fp8 pages (f32 q) equal naive attention over the fp8-rounded
    K/V, and fp8 slots no sequence owns may be NaN (e4m3fn has NaN, no inf)."""
    rng = np.random.default_rng(10)
    page_size, heads, kv_heads, d = 4, 8, 2, 16
    context = np.array([9, 1, 17, 6])
    k_pages, v_pages, table, dk, dv = make_paged(rng, context, kv_heads, d, page_size)
    k_pages, v_pages = _poison_dead_slots(k_pages, v_pages, table, context, page_size)
    k8, v8 = jnp.asarray(k_pages, kv_dtype), jnp.asarray(v_pages, kv_dtype)
    dk = [fp8_round(x, kv_dtype) for x in dk]
    dv = [fp8_round(x, kv_dtype) for x in dv]
    q = randn(rng, len(context), heads, d)
    out = np.asarray(ref.paged_attention_xla(q, k8, v8, context, table))
    for b in range(len(context)):
        want = naive_attention(q[b][None], dk[b], dv[b], [context[b] - 1], context[b])[0]
        assert rel_err(out[b], want) < 1e-5

    q_lens = np.array([3, 1, 5, 2])
    loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = randn(rng, int(loc[-1]) + 2, heads, d)
    out = ref.ragged_paged_attention_xla(q, k8, v8, table, context, loc, soft_cap=3.0)
    assert out.dtype == jnp.float32
    out = np.asarray(out)
    for b in range(len(context)):
        rows = slice(loc[b], loc[b + 1])
        pos = context[b] - q_lens[b] + np.arange(q_lens[b])
        want = naive_attention(q[rows], dk[b], dv[b], pos, context[b], soft_cap=3.0)
        assert rel_err(out[rows], want) < 1e-5
    assert (out[loc[-1] :] == 0).all()


def test_paged_xla_bf16_query_fp8_pages():
    """bf16 q with fp8 pages: bf16 out, within bf16's tolerance of the float64 naive result
    on the same fp8 values, and ~3% away from the unquantised K/V (e4m3fn keeps 3 mantissa
    bits; the bound is its unit roundoff 2**-4)."""
    rng = np.random.default_rng(11)
    page_size, heads, kv_heads, d = 8, 8, 2, 64
    context = np.array([1, 8, 30, 17])
    k_pages, v_pages, table, dk, dv = make_paged(rng, context, kv_heads, d, page_size)
    q = jnp.asarray(randn(rng, len(context), heads, d), jnp.bfloat16)
    k8, v8 = (jnp.asarray(x, jnp.float8_e4m3fn) for x in (k_pages, v_pages))
    out = ref.paged_attention_xla(q, k8, v8, context, table)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    qf = np.asarray(q.astype(jnp.float32))
    for b, n in enumerate(context):
        dk8, dv8 = fp8_round(dk[b], jnp.float8_e4m3fn), fp8_round(dv[b], jnp.float8_e4m3fn)
        assert rel_err(out[b], naive_attention(qf[b][None], dk8, dv8, [n - 1], n)[0]) < 1e-2
    exact = np.concatenate(
        [naive_attention(qf[b][None], dk[b], dv[b], [n - 1], n) for b, n in enumerate(context)]
    )
    assert 1e-2 < rel_err(out, exact) < 2**-4


def _validate(q_dtype, k_dtype, v_dtype=None, check=None):
    """Runs both entry points' checks (`check`) or the entry points themselves (None)."""
    rng = np.random.default_rng(12)
    q = jnp.asarray(randn(rng, 2, 4, 16), q_dtype)
    kp = jnp.asarray(randn(rng, 2, 6, 4, 16), k_dtype)
    vp = jnp.asarray(randn(rng, 2, 6, 4, 16), v_dtype or k_dtype)
    lengths, table = np.array([3, 5], np.int32), np.array([[0, 1], [2, 3]], np.int32)
    loc = np.array([0, 1, 2], np.int32)
    if check:
        validation.check_decode(q, kp, vp, lengths, table, None, None, None)
        validation.check_ragged(q, kp, vp, table, lengths, loc, None, None, None)
        return
    pallas_kernels.paged_decode_attention(q, kp, vp, lengths, table, backend="xla")
    pallas_kernels.ragged_paged_attention(q, kp, vp, table, lengths, loc, backend="xla")


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_validation_accepts_fp8_pages(q_dtype, kv_dtype):
    _validate(q_dtype, kv_dtype, check=True)


@pytest.mark.parametrize(
    "q_dtype,k_dtype,v_dtype,match",
    [
        (jnp.int8, jnp.float8_e4m3fn, None, "q dtype int8 with k_pages dtype float8_e4m3fn"),
        (jnp.float16, jnp.float8_e4m3fn, None, "q dtype float16 with k_pages dtype float8_e4m3fn"),
        (jnp.float8_e4m3fn, jnp.float8_e4m3fn, None, "q dtype float8_e4m3fn with k_pages"),
        (jnp.bfloat16, jnp.float8_e4m3fn, jnp.bfloat16, "v_pages dtype bfloat16 != k_pages dtype"),
        (
            jnp.bfloat16,
            jnp.float8_e5m2,
            jnp.float8_e4m3fn,
            "float8_e4m3fn != k_pages dtype float8_e5m2",
        ),
        (jnp.float8_e4m3fn, jnp.bfloat16, None, "q dtype float8_e4m3fn != k_pages dtype bfloat16"),
    ],
)
def test_validation_rejects_other_fp8_mixes(q_dtype, k_dtype, v_dtype, match):
    with pytest.raises(TypeError, match=match):
        _validate(q_dtype, k_dtype, v_dtype)
