"""Backend resolution and the host-side input checks of the attention entry points."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference as ref


def inputs(rng, b=3, h=8, k=2, p=10, s=4, d=16, max_pages=3, dtype=np.float32):
    q = rng.standard_normal((b, h, d)).astype(dtype)
    kp = rng.standard_normal((k, p, s, d)).astype(dtype)
    vp = rng.standard_normal((k, p, s, d)).astype(dtype)
    table = rng.permutation(p)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    lengths = np.array([1, s, max_pages * s][:b] + [2] * max(0, b - 3), np.int32)
    return q, kp, vp, lengths, table


def test_resolve_backend():
    assert pk.resolve_backend("auto", "cpu") == "xla"
    assert pk.resolve_backend("auto", "gpu") == "gpu"
    assert pk.resolve_backend("auto", "cuda") == "gpu"
    assert pk.resolve_backend("auto", "tpu") == "tpu"
    assert pk.resolve_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend must be one of"):
        pk.resolve_backend("triton")


@pytest.mark.parametrize("head_dim", [96, 32])
def test_auto_on_cuda_runs_the_gpu_kernels_for_any_head_dim(monkeypatch, head_dim):
    """A CUDA platform (faked): "auto" runs the GPU kernels for every head dim, a power of
    two >= 16 or not (padded inside them, `validation.gpu_tile_dim`), with the reference's
    result; XLA's attention, the fallback before, held [B, H, S] logits per step. (The
    kernels at the other padded head dims, 8, 80 and 100: their own tests'
    test_head_dims_padded_inside_the_kernel.)"""
    from pallas_kernels import dispatch

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cuda")
    ran = []
    for name in ("_decode_impl", "_ragged_impl"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda b, real=real: ran.append(b) or real(b))
    rng = np.random.default_rng(head_dim)
    q, kp, vp, lengths, table = inputs(rng, d=head_dim)
    out = pk.paged_decode_attention(q, kp, vp, lengths, table, interpret=True)
    want = ref.paged_attention_xla(q, kp, vp, lengths, table)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    loc = np.array([0, 1, 3, 3], np.int32)
    out = pk.ragged_paged_attention(q, kp, vp, table, lengths, loc, interpret=True)
    want = ref.ragged_paged_attention_xla(q, kp, vp, table, lengths, loc)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert ran == ["gpu"] * 2


@pytest.mark.parametrize("head_dim", [257])
def test_auto_on_cuda_runs_xla_for_a_head_dim_too_wide_for_the_gpu_kernels(monkeypatch, head_dim):
    """Past `validation.GPU_MAX_HEAD_DIM` (256) the GPU kernels' tiles (512 or 1024 wide)
    overflow shared memory, so "auto" on CUDA (faked) runs XLA's attention, as it did
    before head dims were padded; knobs then say why, and "gpu" refuses the head dim (at
    1000 too: both kernels' test_head_dims_past_the_widest_tile_are_refused)."""
    from pallas_kernels import dispatch

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cuda")
    ran = []
    for name in ("_decode_impl", "_ragged_impl"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda b, real=real: ran.append(b) or real(b))
    q, kp, vp, lengths, table = inputs(np.random.default_rng(head_dim), d=head_dim)
    out = pk.paged_decode_attention(q, kp, vp, lengths, table)
    want = ref.paged_attention_xla(q, kp, vp, lengths, table)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    loc = np.array([0, 1, 3, 3], np.int32)
    out = pk.ragged_paged_attention(q, kp, vp, table, lengths, loc)
    want = ref.ragged_paged_attention_xla(q, kp, vp, table, lengths, loc)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert ran == ["xla"] * 2
    why = f"backend='auto' chose it for head_dim={head_dim}, wider than"
    with pytest.raises(TypeError, match=why):
        pk.paged_decode_attention(q, kp, vp, lengths, table, block_kv=16)
    with pytest.raises(TypeError, match=why):
        pk.ragged_paged_attention(q, kp, vp, table, lengths, loc, block_q=4)
    refused = rf"head_dim of at most 256 .*got head_dim={head_dim}"
    with pytest.raises(ValueError, match=refused):
        pk.paged_decode_attention(q, kp, vp, lengths, table, backend="gpu", interpret=True)
    with pytest.raises(ValueError, match=refused):
        pk.ragged_paged_attention(q, kp, vp, table, lengths, loc, backend="gpu", interpret=True)


def test_xla_backend_is_the_reference():
    q, kp, vp, lengths, table = inputs(np.random.default_rng(0))
    out = pk.paged_decode_attention(q, kp, vp, lengths, table, backend="xla")
    want = ref.paged_attention_xla(q, kp, vp, lengths, table)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    loc = np.arange(4, dtype=np.int32)
    out2 = pk.ragged_paged_attention(q, kp, vp, table, lengths, loc, backend="xla")
    np.testing.assert_allclose(np.asarray(out2), np.asarray(want), atol=1e-6)


def test_works_under_jit_with_traced_values():
    q, kp, vp, lengths, table = inputs(np.random.default_rng(1))
    f = jax.jit(lambda *a: pk.paged_decode_attention(*a, backend="xla"))
    np.testing.assert_allclose(
        np.asarray(f(q, kp, vp, lengths, table)),
        np.asarray(ref.paged_attention_xla(q, kp, vp, lengths, table)),
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "mutate,message",
    [
        (
            lambda a: a.update(table=a["table"].at[2, 2].set(10)),  # length 12 reads it
            r"page id 10 at page_table\[2, 2\] is out of range \[0, 10\)",
        ),
        (lambda a: a.update(table=a["table"].at[0, 0].set(-1)), "page id -1"),
        (lambda a: a.update(lengths=a["lengths"].at[2].set(13)), r"lengths\[2\] = 13 exceeds"),
        (lambda a: a.update(lengths=a["lengths"].at[0].set(-1)), r"lengths\[0\] = -1 is negative"),
        (lambda a: a.update(q=a["q"][:, :5]), "kv heads must divide query heads"),
        (lambda a: a.update(q=a["q"][..., :8]), "q head_dim 8 != k_pages head_dim 16"),
        (lambda a: a.update(vp=a["vp"][:, :5]), "v_pages shape"),
        (lambda a: a.update(q=a["q"][None]), r"q must be \[B, H, D\]"),
        (lambda a: a.update(lengths=a["lengths"][:2]), "lengths has 2 entries for a batch of 3"),
        (
            lambda a: a.update(kp=a["kp"][:, :, :3], vp=a["vp"][:, :, :3]),
            "page_size must be a power of two, got page_size=3",
        ),
    ],
)
def test_decode_bad_input(mutate, message):
    q, kp, vp, lengths, table = inputs(np.random.default_rng(2))
    a = dict(
        q=jnp.asarray(q),
        kp=jnp.asarray(kp),
        vp=jnp.asarray(vp),
        lengths=jnp.asarray(lengths),
        table=jnp.asarray(table),
    )
    mutate(a)
    with pytest.raises(ValueError, match=message):
        pk.paged_decode_attention(a["q"], a["kp"], a["vp"], a["lengths"], a["table"])


# Page size 4, lengths [1, 4, 12]: sequence 2 fills pages 0-2. Decode reads tokens
# [max(n - W, 0), n); ragged (q_lens [1, 2, 3]) from its first query's window start,
# max(ctx - q_len - W + 1, 0): for sequence 2 with W = 6, token 4 (page 1's first).
READS = {
    ("decode", None): "pages [0, 3) of its row (tokens [0, 12))",
    ("decode", 6): "pages [1, 3) of its row (tokens [6, 12))",  # the window starts mid page 1
    ("decode", 8): "pages [1, 3) of its row (tokens [4, 12))",  # ... on page 1's first token
    ("ragged", None): "pages [0, 3) of its row (tokens [0, 12))",
    ("ragged", 6): "pages [1, 3) of its row (tokens [4, 12))",
    ("ragged", 7): "pages [0, 3) of its row (tokens [3, 12))",  # decode's W = 7 skips page 0
}


def _call(op, table, window):
    q, kp, vp, lengths, _ = inputs(np.random.default_rng(7))
    kw = dict(sliding_window=window, backend="xla")
    if op == "decode":
        return pk.paged_decode_attention(q, kp, vp, lengths, table, **kw)
    q = np.concatenate([q, q])  # rows for q_lens [1, 2, 3]
    loc = np.array([0, 1, 3, 6], np.int32)
    return pk.ragged_paged_attention(q, kp, vp, table, lengths, loc, **kw)


@pytest.mark.parametrize(
    "op, window, entry, bad_id, read",
    [
        ("decode", None, (2, 2), -1, True),
        ("decode", None, (1, 1), -1, False),  # past length 4
        ("decode", None, (0, 2), 1 << 20, False),
        ("decode", 6, (2, 1), 10, True),  # the window's first page, read from token 6
        ("decode", 6, (2, 0), -1, False),  # wholly before the window
        ("decode", 8, (2, 1), -1, True),
        ("decode", 8, (2, 0), 10, False),
        ("decode", 7, (2, 0), -1, False),
        ("ragged", None, (2, 0), -1, True),
        ("ragged", None, (1, 2), -1, False),
        ("ragged", 6, (2, 1), -1, True),  # the window starts on this page's first token
        ("ragged", 6, (2, 0), -(1 << 20), False),
        ("ragged", 7, (2, 0), 10, True),  # the first query (position 9) sees token 3
    ],
)
def test_page_ids_are_checked_where_the_call_reads_them(op, window, entry, bad_id, read):
    """Out-of-range ids were refused anywhere in a concrete page table, padding included
    ("page id -1 at page_table[1, 1] is out of range" for a row of length 4 that reads
    only entry 0), though no backend reads padding and the same call ran under jit. Now
    only the entries covering a sequence's visible tokens are checked: a bad one is still
    refused, naming the id, its position, the range and the pages the sequence reads; a
    bad one elsewhere runs, with the result of valid padding."""
    _, _, _, _, table = inputs(np.random.default_rng(7))
    bad = table.copy()
    bad[entry] = bad_id
    if read:
        b, i = entry
        message = re.escape(
            f"page id {bad_id} at page_table[{b}, {i}] is out of range [0, 10) "
            f"(sequence {b} reads {READS[op, window]}"
        )
        with pytest.raises(ValueError, match=message):
            _call(op, bad, window)
    else:
        np.testing.assert_array_equal(
            np.asarray(_call(op, bad, window)), np.asarray(_call(op, table, window))
        )


def test_page_ids_with_traced_lengths_are_all_checked():
    """A concrete table with traced lengths: which entries are read is unknown, so every
    entry is checked; with a traced query_start_loc, every entry up to each length."""
    q, kp, vp, lengths, table = inputs(np.random.default_rng(8))
    table[1, 2] = -1  # padding for length 4, but the lengths are not known on the host
    f = jax.jit(lambda n: pk.paged_decode_attention(q, kp, vp, n, table, backend="xla"))
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] .* the lengths are traced"):
        f(lengths)
    # Traced query_start_loc with a window: q_len may be up to the context, so the
    # window may start at token 0 and every page up to the length is checked.
    table[1, 2], table[2, 0] = 0, -1  # decode's W = 6 would not read page 0 of row 2
    q = np.concatenate([q, q])
    g = jax.jit(
        lambda loc: pk.ragged_paged_attention(
            q, kp, vp, table, lengths, loc, sliding_window=6, backend="xla"
        )
    )
    with pytest.raises(
        ValueError,
        match=re.escape("page_table[2, 0] is out of range [0, 10) (sequence 2 reads pages [0, 3)"),
    ):
        g(np.array([0, 1, 3, 6], np.int32))


def test_decode_bad_dtypes():
    q, kp, vp, lengths, table = inputs(np.random.default_rng(3))
    with pytest.raises(TypeError, match="q dtype bfloat16 != k_pages dtype float32"):
        pk.paged_decode_attention(jnp.asarray(q, jnp.bfloat16), kp, vp, lengths, table)
    with pytest.raises(TypeError, match="page_table must be an integer array"):
        pk.paged_decode_attention(q, kp, vp, lengths, table.astype(np.float32))
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        pk.paged_decode_attention(q, kp, vp, lengths, table, sliding_window=0)
    with pytest.raises(TypeError, match="no tuning knobs"):
        pk.paged_decode_attention(q, kp, vp, lengths, table, backend="xla", block_kv=4)


@pytest.mark.parametrize(
    "loc,message",
    [
        ([0, 2, 1, 3], "must be non-decreasing, got 2 then 1 at index 1"),
        ([1, 2, 3, 4], "must start at 0"),
        ([0, 1, 2, 9], "ends at 9, beyond the 8 query rows"),
        ([0, 2, 3, 4], "sequence 0 has q_len 2 > context_len 1"),
        ([0, 1, 2], r"expected B \+ 1 = 4"),
    ],
)
def test_ragged_bad_query_start_loc(loc, message):
    rng = np.random.default_rng(4)
    _, kp, vp, lengths, table = inputs(rng)
    q = rng.standard_normal((8, 8, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=message):
        pk.ragged_paged_attention(q, kp, vp, table, lengths, np.array(loc, np.int32))


def test_ragged_context_beyond_capacity():
    rng = np.random.default_rng(5)
    _, kp, vp, lengths, table = inputs(rng)
    q = rng.standard_normal((3, 8, 16)).astype(np.float32)
    lengths[1] = 100
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 100 exceeds"):
        pk.ragged_paged_attention(q, kp, vp, table, lengths, np.arange(4, dtype=np.int32))


def test_knobs_on_auto_xla_say_why_auto_chose_xla():
    q, kp, vp, lengths, table = inputs(np.random.default_rng(6))
    with pytest.raises(TypeError, match="backend='auto' chose it on platform 'cpu'"):
        pk.paged_decode_attention(q, kp, vp, lengths, table, block_kv=16)
    loc = np.arange(4, dtype=np.int32)
    with pytest.raises(TypeError, match="backend='auto' chose it on platform 'cpu'"):
        pk.ragged_paged_attention(q, kp, vp, table, lengths, loc, block_q=4)
    # (On CUDA "auto" chooses XLA only for a pool past the GPU kernels' int32 offsets:
    # tests/test_kernel_review.py names that reason.)
    with pytest.raises(TypeError, match=r"no tuning knobs, got \['block_kv'\]$"):
        pk.paged_decode_attention(q, kp, vp, lengths, table, backend="xla", block_kv=16)
