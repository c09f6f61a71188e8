"""PagedKVCache writes, page copies and gathers against a numpy model of a page pool."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import cache as kvcache
from pagedjax.config import CacheConfig, preset


def tiny_cache(page_size=4, num_pages=8, dtype="float32"):
    cfg = dataclasses.replace(preset("tiny"), num_layers=2, num_kv_heads=2, head_dim=8)
    return cfg, kvcache.create(cfg, CacheConfig(page_size, num_pages, dtype))


def test_create_shapes_and_layout():
    cfg, c = tiny_cache()
    assert len(c.k) == len(c.v) == 2
    assert all(x.shape == (2, 8, 4, 8) for x in c.k + c.v)  # per layer [K, P, S, D]
    assert len({id(x) for x in c.k + c.v}) == 4  # separate buffers, donated one by one
    assert (c.num_layers, c.num_kv_heads, c.num_pages, c.page_size, c.head_dim) == (2, 2, 8, 4, 8)
    assert c.nbytes == 2 * 2 * 2 * 8 * 4 * 8 * 4
    leaves, treedef = jax.tree_util.tree_flatten(c)
    assert len(leaves) == 4
    assert jax.tree_util.tree_unflatten(treedef, leaves) == c


def test_textbook_slot():
    # page size 4, the sequence owns physical pages [a, b] = [6, 2]: token 5 -> page 2, offset 1.
    table = np.array([6, 2])
    assert kvcache.slots_for(table, 5, 6, 4).tolist() == [2 * 4 + 1]
    _, c = tiny_cache()
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 8)).astype(np.float32)
    c = kvcache.write(c, 1, k, -k, kvcache.slots_for(table, 5, 6, 4))
    np.testing.assert_array_equal(np.asarray(c.k[1][:, 2, 1]), k[0])
    np.testing.assert_array_equal(np.asarray(c.v[1][:, 2, 1]), -k[0])
    assert np.count_nonzero(np.stack(c.k)) == k.size  # nothing else touched
    assert np.count_nonzero(np.stack(c.v)) == k.size


def test_write_gather_roundtrip_against_numpy_pool():
    rng = np.random.default_rng(1)
    _, c = tiny_cache(page_size=4, num_pages=8)
    model_k = np.zeros((2, *c.k[0].shape), np.float32)  # [L, K, P, S, D]
    model_v = np.zeros_like(model_k)
    step = jax.jit(kvcache.write, static_argnums=1, donate_argnums=0)
    tables = {0: [3, 0, 5], 1: [7, 1]}  # shuffled physical pages
    lengths = {0: 0, 1: 0}
    for chunk in ([5, 3], [1, 1], [4, 2], [1, 0], [0, 1]):
        for layer in range(2):
            ks, vs, slots = [], [], []
            for seq, n in enumerate(chunk):
                if n == 0:
                    continue
                slots.append(kvcache.slots_for(tables[seq], lengths[seq], lengths[seq] + n, 4))
                ks.append(rng.standard_normal((n, 2, 8)).astype(np.float32))
                vs.append(rng.standard_normal((n, 2, 8)).astype(np.float32))
            k, v, s = np.concatenate(ks), np.concatenate(vs), np.concatenate(slots)
            s = np.concatenate([s, [-1, -1]]).astype(np.int32)  # padding rows are dropped
            k = np.concatenate([k, np.full((2, 2, 8), 99.0, np.float32)])
            v = np.concatenate([v, np.full((2, 2, 8), 99.0, np.float32)])
            c = step(c, layer, k, v, s)
            for i, slot in enumerate(s[:-2]):
                model_k[layer, :, slot // 4, slot % 4] = k[i]
                model_v[layer, :, slot // 4, slot % 4] = v[i]
        for seq, n in enumerate(chunk):
            lengths[seq] += n
    np.testing.assert_array_equal(np.stack(c.k), model_k)
    np.testing.assert_array_equal(np.stack(c.v), model_v)
    assert not (np.stack(c.k) == 99.0).any() and not (np.stack(c.v) == 99.0).any()
    for layer, seq in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        gk, gv = kvcache.gather_sequence(c, layer, tables[seq], lengths[seq])
        assert gk.shape == gv.shape == (lengths[seq], 2, 8)
        where = [(tables[seq][i // 4], i % 4) for i in range(lengths[seq])]
        want_k = np.stack([model_k[layer, :, p, o] for p, o in where])
        want_v = np.stack([model_v[layer, :, p, o] for p, o in where])
        np.testing.assert_array_equal(np.asarray(gk), want_k)
        np.testing.assert_array_equal(np.asarray(gv), want_v)


def test_write_layer_matches_write():
    rng = np.random.default_rng(2)
    _, c = tiny_cache()
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    v = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([30, 4, -1], np.int32)
    full = kvcache.write(c, 1, k, v, slots)
    kp, vp = kvcache.write_layer(c.k[1], c.v[1], k, v, slots)
    np.testing.assert_array_equal(np.asarray(full.k[1]), np.asarray(kp))
    np.testing.assert_array_equal(np.asarray(full.v[1]), np.asarray(vp))
    # slot -1 must not wrap around onto the last slot
    assert (np.asarray(kp[:, -1, -1]) == 0).all()


def test_bf16_write_casts():
    _, c = tiny_cache(dtype="bfloat16")
    k = np.full((1, 2, 8), 1.5, np.float32)
    c = kvcache.write(c, 0, k, k, np.array([0], np.int32))
    assert c.dtype == jnp.bfloat16 and float(c.k[0][0, 0, 0, 0]) == 1.5


def test_copy_pages_copies_every_layer_and_skips_padding():
    rng = np.random.default_rng(3)
    _, c = tiny_cache()
    c = kvcache.PagedKVCache(
        k=tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in c.k),
        v=tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in c.v),
    )
    before_k, before_v = np.stack(c.k), np.stack(c.v)
    out = jax.jit(kvcache.copy_pages, donate_argnums=0)(
        c, np.array([2, 5, 0], np.int32), np.array([6, 3, -1], np.int32)
    )
    want_k, want_v = before_k.copy(), before_v.copy()
    want_k[:, :, [6, 3]] = before_k[:, :, [2, 5]]
    want_v[:, :, [6, 3]] = before_v[:, :, [2, 5]]
    np.testing.assert_array_equal(np.stack(out.k), want_k)
    np.testing.assert_array_equal(np.stack(out.v), want_v)


def test_bad_inputs():
    _, c = tiny_cache()
    with pytest.raises(ValueError, match=r"new k must be \[T, K, D\]"):
        kvcache.write(c, 0, np.zeros((2, 3, 8)), np.zeros((2, 3, 8)), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"layer 2 is out of range \[0, 2\)"):
        kvcache.write(c, 2, np.zeros((1, 2, 8)), np.zeros((1, 2, 8)), np.array([0]))
    with pytest.raises(ValueError, match="dst page id 8 is out of range"):
        kvcache.copy_pages(c, np.array([1]), np.array([8]))
    with pytest.raises(ValueError, match="src page id -2 is out of range"):
        kvcache.copy_pages(c, np.array([-2]), np.array([1]))
    with pytest.raises(ValueError, match="beyond the page table's capacity 8"):
        kvcache.slots_for([1, 2], 0, 9, 4)
    with pytest.raises(ValueError, match="exceeds the page table's capacity"):
        kvcache.gather_sequence(c, 0, [1], 5)


@pytest.mark.parametrize(
    "slots,error,match",
    [
        (
            [3, 8 * 4 + 1],
            ValueError,
            r"slot 33 at index 1 is out of range \[0, 32\) \(-1: padding\)",
        ),
        ([-2, 5], ValueError, r"slot -2 at index 0 is out of range"),
        (np.array([4.7, 5.2]), TypeError, "slots must be an integer array, got dtype float64"),
    ],
)
def test_write_rejects_slots_it_would_drop_or_truncate(slots, error, match):
    # mode="drop" used to discard an out-of-range slot silently, and float slots were
    # truncated to the wrong slot.
    _, c = tiny_cache()
    k = np.ones((2, 2, 8), np.float32)
    with pytest.raises(error, match=match):
        kvcache.write(c, 0, k, k, slots)


def test_copy_pages_names_the_bad_id_and_checks_its_contract():
    _, c = tiny_cache()
    with pytest.raises(ValueError, match="dst page id -2 is out of range"):  # not the -1 pad
        kvcache.copy_pages(c, np.array([1, 2]), np.array([-1, -2]))
    with pytest.raises(TypeError, match="src must be an integer array, got dtype float64"):
        kvcache.copy_pages(c, np.array([1.6]), np.array([2]))
    with pytest.raises(ValueError, match=r"copy destinations must be distinct, got dst \[3 3\]"):
        kvcache.copy_pages(c, np.array([1, 2]), np.array([3, 3]))
    with pytest.raises(ValueError, match="page 2 is both a source and a destination"):
        kvcache.copy_pages(c, np.array([1, 2]), np.array([2, 3]))
    # Padding pairs may repeat, and a padding source may be any valid id.
    kvcache.copy_pages(c, np.array([0, 0, 1]), np.array([-1, -1, 0]))


def test_slots_for_rejects_a_bad_range():
    with pytest.raises(ValueError, match=r"start must be in \[0, end\], got start=-1, end=2"):
        kvcache.slots_for([3, 4], -1, 2, 8)  # used to wrap around to the last page
    with pytest.raises(ValueError, match="got start=5, end=2"):
        kvcache.slots_for([3, 4], 5, 2, 8)


@pytest.mark.parametrize(
    "table,match",
    [
        ([1, 8], "page id 8"),  # past the pool: the gather clamped it to another page
        ([1, 20], "page id 20"),
        ([1, -1], "page id -1"),  # negative: wrapped around to the pool's end
        ([1.0, 2.0], "integer"),  # float ids were truncated
    ],
)
def test_gather_sequence_rejects_page_ids_it_would_misread(table, match):
    """gather_sequence read a page id outside [0, P) (or a float one) from some other
    page without a word; the ids the length covers are checked."""
    _, c = tiny_cache()
    with pytest.raises((ValueError, TypeError), match=match):
        kvcache.gather_sequence(c, 0, table, 6)
    kvcache.gather_sequence(c, 0, [1, 8], 4)  # an unused entry past the length is fine


@pytest.mark.parametrize("layer", [-1, 2, True, 1.0])
def test_gather_and_write_reject_a_bad_layer(layer):
    """gather_sequence(layer=-1) read the last layer, layer=2 was an IndexError, and
    write(layer=True) wrote layer 1."""
    _, c = tiny_cache()
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 2, 8)).astype(np.float32)
    with pytest.raises((ValueError, TypeError), match="layer"):
        kvcache.gather_sequence(c, layer, [1, 2], 3)
    with pytest.raises((ValueError, TypeError), match="layer"):
        kvcache.write(c, layer, k, k, np.array([5], np.int32))


def test_write_rejects_a_slot_written_twice():
    """Two tokens scattered to one slot kept either one (which one is the backend's
    choice); -1 padding may repeat."""
    _, c = tiny_cache()
    k = np.ones((3, 2, 8), np.float32)
    with pytest.raises(ValueError, match="slot 5 is written twice in one call"):
        kvcache.write(c, 0, k, k, np.array([5, 6, 5]))
    kvcache.write(c, 0, k, k, np.array([-1, 6, -1]))


def test_slots_for_and_gather_reject_tables_and_lengths_they_would_misuse():
    _, c = tiny_cache()
    # A negative page id made slot -1, which write then dropped as padding.
    with pytest.raises(ValueError, match="page id -1 is negative"):
        kvcache.slots_for([-1, 2], 3, 5, 4)
    assert kvcache.slots_for([-1, 2], 4, 6, 4).tolist() == [8, 9]  # the -1 is not used
    # A 2-D row was 'exceeds the capacity 4'; a scalar was len() of unsized object.
    for row in ([[1, 2]], 3):
        with pytest.raises(ValueError, match="page_table_row must be a concrete 1-D array"):
            kvcache.gather_sequence(c, 0, row, 2)
    # A float length was a slice TypeError, a negative one a start/end error, True was 1.
    for length in (5.0, -1, True):
        with pytest.raises(ValueError, match=r"length must be an int >= 0, got length="):
            kvcache.gather_sequence(c, 0, [1, 2], length)
    assert kvcache.gather_sequence(c, 0, [1, 2], np.int64(5))[0].shape == (5, 2, 8)


def test_bounds_at_the_pool_and_table_edges():
    _, c = tiny_cache()  # 8 pages of 4: slots [0, 32)
    k = np.ones((2, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"slot 32 at index 1 is out of range \[0, 32\)"):
        kvcache.write(c, 0, k, k, np.array([31, 32]))
    # A source page -1 is no padding (only a destination is); clipped, it would copy page 0.
    with pytest.raises(ValueError, match="src page id -1 is out of range"):
        kvcache.copy_pages(c, np.array([-1]), np.array([3]))
    # A page table filled to its last slot.
    table = np.array([6, 2])
    np.testing.assert_array_equal(kvcache.slots_for(table, 0, 8, 4), [24, 25, 26, 27, 8, 9, 10, 11])
    c = kvcache.write(c, 1, k * 3, -k, kvcache.slots_for(table, 6, 8, 4))
    gk, gv = kvcache.gather_sequence(c, 1, table, 8)
    np.testing.assert_array_equal(np.asarray(gk)[6:], k * 3)
    np.testing.assert_array_equal(np.asarray(gv)[6:], -k)
    assert not np.asarray(gk)[:6].any()


def test_fp8_helpers_take_the_dtype_names_cache_config_takes():
    # CacheConfig(dtype="fp8") is documented; to_storage and is_fp8 passed the name to
    # jnp.dtype, which refused it, so model.forward(..., kv_dtype="fp8") failed.
    x = jnp.array([1000.0, -0.3], jnp.float32)
    for name in ("fp8", "float8_e4m3fn", jnp.float8_e4m3fn):
        got = kvcache.to_storage(x, name)
        assert kvcache.is_fp8(name) and got.dtype == jnp.float8_e4m3fn
        assert float(got[0]) == 448.0  # clipped, not NaN
    assert kvcache.to_storage(x, "bf16").dtype == jnp.bfloat16 and not kvcache.is_fp8("bf16")
    with pytest.raises(ValueError, match="got 'int3'"):
        kvcache.to_storage(x, "int3")
