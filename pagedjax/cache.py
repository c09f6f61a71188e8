"""The paged KV cache: a pytree of per-layer page pools, and pure functions that update it.

Layout: `k` and `v` are each a tuple of `L` arrays `[K, P, S, D]` (per layer: kv
heads, pages, page size, head dim), the layout every kernel in `pallas_kernels`
takes, because:

* a page of one kv head is one contiguous `[S, D]` tile: a single DMA on TPU
  (HBM -> VMEM) and a single coalesced block load on GPU, with no stride over
  heads; a kernel program that owns one kv head reads only its bytes;
* tensor parallelism splits the `K` axis, so each device holds its heads' slice of
  every page and page ids stay global;
* it is the layout of JAX's bundled paged-attention kernels, so the benchmark can
  hand them our cache without a transpose.

One array per layer rather than one `[L, K, P, S, D]` array: a kernel call
(a custom call to XLA) needs its operand as a whole buffer, so slicing layer `l`
out of a stacked pool would copy that layer's entire pool on every step. With one
buffer per layer, the per-layer scatter updates the donated buffer in place and
the kernel reads it with no copy.

The price of the `[K, P, S, D]` layout is that writing one token touches `K`
separate `[D]` rows instead of one `[K, D]` row; a step writes a handful of tokens
per layer, so the scatter is negligible next to the attention read.

Storage dtype: the model's, or FP8 (`CacheConfig(dtype="fp8")`, `float8_e4m3fn`: half
of bf16's bytes, so twice the tokens per byte and half the K/V traffic of a decode
step). FP8 pages are written without scales: values are clipped to the format's
largest finite value (448; an out-of-range cast would be NaN) and rounded to nearest
(`to_storage`); the kernels upcast each tile to the query's dtype.

Slots: token position `pos` of a sequence lives in slot
`page_table[pos // S] * S + pos % S`; a slot of -1 means padding and is dropped.
Every function here is pure and works under `jax.jit` with the cache donated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import CacheConfig, ModelConfig, dtype_name


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """K and V page pools, one array per layer."""

    k: tuple[jax.Array, ...]  # L x [K, P, S, D]
    v: tuple[jax.Array, ...]  # L x [K, P, S, D]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[3]

    @property
    def dtype(self):
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k + self.v)

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """One layer's (k_pages, v_pages), each [K, P, S, D]."""
        return self.k[i], self.v[i]


def create(model_cfg: ModelConfig, cache_cfg: CacheConfig, *, sharding=None) -> PagedKVCache:
    """Allocates a zeroed cache for `model_cfg` with `cache_cfg`'s geometry.

    Args:
      model_cfg: gives L, K and D.
      cache_cfg: gives P, S and the storage dtype.
      sharding: optional `jax.sharding.Sharding` for every pool (e.g. split over K).
    """
    shape = (
        model_cfg.num_kv_heads,
        cache_cfg.num_pages,
        cache_cfg.page_size,
        model_cfg.head_dim,
    )
    make = jax.jit(lambda: jnp.zeros(shape, cache_cfg.jnp_dtype), out_shardings=sharding)
    num_layers = model_cfg.num_layers
    return PagedKVCache(
        k=tuple(make() for _ in range(num_layers)), v=tuple(make() for _ in range(num_layers))
    )


def _slot_index(slots, num_slots):
    # Padding slots (-1) go out of bounds so that mode="drop" discards them
    # (a negative index would wrap around and overwrite the last slot).
    slots = jnp.asarray(slots, jnp.int32)
    return jnp.where(slots < 0, num_slots, slots)


def _check_pages(k_pages, v_pages):
    # Both pools are flattened with k_pages' [K, P, S, D]: a v pool of the same size in
    # another layout would take its tokens at other (page, offset) places and come back
    # reshaped.
    if np.ndim(k_pages) != 4:
        raise ValueError(f"k_pages must be [K, P, S, D], got shape {np.shape(k_pages)}")
    if np.shape(v_pages) != np.shape(k_pages):
        raise ValueError(
            f"v_pages must be shaped like k_pages {np.shape(k_pages)}, got {np.shape(v_pages)}"
        )


def _check_new_tokens(k, v, slots, num_kv_heads, head_dim):
    t = np.shape(slots)[0] if np.ndim(slots) == 1 else None
    if t is None:
        raise ValueError(f"slots must be [T], got shape {np.shape(slots)}")
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (t, num_kv_heads, head_dim):
            raise ValueError(
                f"new {name} must be [T, K, D] = {(t, num_kv_heads, head_dim)}, "
                f"got {tuple(x.shape)}"
            )


def _check_int_ids(name, ids):
    """ids as a numpy array when concrete (None for a tracer); TypeError unless integer."""
    traced = isinstance(ids, jax.core.Tracer)
    arr = ids if traced else np.asarray(ids)
    if not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):  # [] is float64
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    return None if traced else arr


def _check_slots(slots, num_slots):
    # A slot past the pool (or below -1) would be dropped by the scatter without a word.
    s = _check_int_ids("slots", slots)
    if s is None:
        return
    bad = (s < -1) | (s >= num_slots)
    if bad.any():
        i = _first(bad)
        raise ValueError(
            f"slot {int(s[i])} at index {i} is out of range [0, {num_slots}) (-1: padding)"
        )
    real = np.sort(s[s >= 0])  # a scatter to one slot twice keeps either write
    same = real[1:][real[1:] == real[:-1]]
    if same.size:
        raise ValueError(f"slot {int(same[0])} is written twice in one call")


def _first(mask) -> int:
    return int(np.argmax(mask))


def _check_layer(cache: PagedKVCache, layer) -> None:
    # Python would take -1 as the last layer and True as layer 1.
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an int, got layer={layer!r}")
    if not 0 <= layer < cache.num_layers:
        raise ValueError(f"layer {layer} is out of range [0, {cache.num_layers})")


def _dtype(dtype):
    # A name may be one of CacheConfig's aliases ("fp8", "bf16"), which jnp.dtype refuses.
    return jnp.dtype(dtype_name(dtype, kv=True) if isinstance(dtype, str) else dtype)


def is_fp8(dtype) -> bool:
    """Whether `dtype` is an FP8 storage dtype (the kernels upcast its tiles).

    `dtype`: a dtype, or a name as `CacheConfig` takes it ("fp8", "float8_e4m3fn", ...).
    """
    dtype = _dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


def to_storage(x, dtype):
    """`x` in the cache's storage dtype: a plain cast, or for FP8 a cast of `x` clipped
    to the format's finite range (scale-free quantisation).

    `dtype`: a dtype, or a name as `CacheConfig` takes it ("fp8", "bf16", ...; ValueError
    naming an unknown one).
    """
    dtype = _dtype(dtype)
    if is_fp8(dtype):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def write_layer(k_pages, v_pages, k, v, slots):
    """Scatters new tokens' K/V into one layer's pages.

    Args:
      k_pages: [K, P, S, D]
      v_pages: [K, P, S, D], shaped like k_pages (ValueError otherwise).
      k: [T, K, D] new keys.
      v: [T, K, D] new values.
      slots: [T] int32 destination slots in [0, P * S), or -1 to drop the token
        (anything else, or a slot twice, raises when slots are concrete).

    Returns:
      The updated (k_pages, v_pages).
    """
    _check_pages(k_pages, v_pages)
    kh, p, s, d = k_pages.shape
    _check_new_tokens(k, v, slots, kh, d)
    _check_slots(slots, p * s)
    idx = _slot_index(slots, p * s)

    def put(pages, new):
        flat = pages.reshape(kh, p * s, d)
        new = to_storage(new, pages.dtype).transpose(1, 0, 2)
        flat = flat.at[:, idx].set(new, mode="drop")
        return flat.reshape(kh, p, s, d)

    return put(k_pages, k), put(v_pages, v)


def write(cache: PagedKVCache, layer: int, k, v, slots) -> PagedKVCache:
    """Writes new tokens' K/V ([T, K, D] each) for `layer` through `slots` ([T])."""
    _check_layer(cache, layer)
    k_pages, v_pages = write_layer(cache.k[layer], cache.v[layer], k, v, slots)
    return PagedKVCache(
        k=cache.k[:layer] + (k_pages,) + cache.k[layer + 1 :],
        v=cache.v[:layer] + (v_pages,) + cache.v[layer + 1 :],
    )


def check_copy_pairs(src: np.ndarray, dst: np.ndarray, prefix: str = "") -> None:
    """ValueError (its message after `prefix`) unless the copy pairs' outcome does not
    hang on the order they are applied in: distinct destinations that are not sources
    (dst -1: a padding pair, which copies nothing)."""
    real = dst >= 0
    d = dst[real]
    if np.unique(d).size != d.size:
        raise ValueError(f"{prefix}copy destinations must be distinct, got dst {dst}")
    both = np.intersect1d(src[real], d)
    if both.size:
        raise ValueError(
            f"{prefix}page {int(both[0])} is both a source and a destination: copies would "
            "depend on their order"
        )


def copy_pages(cache: PagedKVCache, src, dst) -> PagedKVCache:
    """Copies whole pages src[i] -> dst[i] in every layer (copy-on-write).

    Args:
      src: [N] int32 source page ids.
      dst: [N] int32 destination page ids; -1 marks a padding pair (skipped).
        Destinations must be distinct and disjoint from the sources (checked, like
        the id ranges, when src and dst are concrete).
    """
    p = cache.num_pages
    if np.shape(src) != np.shape(dst) or np.ndim(src) != 1:
        raise ValueError(f"src and dst must be [N] alike, got {np.shape(src)} and {np.shape(dst)}")
    for name, ids in (("src", src), ("dst", dst)):
        ids = _check_int_ids(name, ids)
        if ids is not None:
            bad = (ids >= p) | (ids < (0 if name == "src" else -1))
            if bad.any():
                raise ValueError(f"{name} page id {int(ids[bad][0])} is out of range [0, {p})")
    if not isinstance(src, jax.core.Tracer) and not isinstance(dst, jax.core.Tracer):
        check_copy_pairs(np.asarray(src), np.asarray(dst))
    src = jnp.asarray(src, jnp.int32)
    dst = jnp.asarray(dst, jnp.int32)
    dst = jnp.where(dst < 0, p, dst)
    src = jnp.clip(src, 0, p - 1)

    def cp(pool):  # [K, P, S, D]
        return pool.at[:, dst].set(pool[:, src], mode="drop")

    return PagedKVCache(k=tuple(map(cp, cache.k)), v=tuple(map(cp, cache.v)))


def slots_for(page_table_row, start: int, end: int, page_size: int) -> np.ndarray:
    """Host helper: slots of positions [start, end) of one sequence ([end - start] int32)."""
    if not 0 <= start <= end:
        raise ValueError(f"start must be in [0, end], got {start=}, {end=}")
    pos = np.arange(start, end)
    row = _check_int_ids("page_table_row", page_table_row)
    if row.ndim != 1:
        raise ValueError(f"page_table_row must be 1-D, got shape {row.shape}")
    if end > len(row) * page_size:
        raise ValueError(
            f"position {end - 1} is beyond the page table's capacity {len(row) * page_size}"
        )
    pages = row[pos // page_size]
    if (pages < 0).any():  # -1 would make a padding slot, dropped by `write`
        raise ValueError(f"page id {int(pages[pages < 0][0])} is negative")
    return (pages * page_size + pos % page_size).astype(np.int32)


def gather_sequence(cache: PagedKVCache, layer: int, page_table_row, length: int):
    """Reads one sequence's K/V back to dense (for tests and debugging).

    Returns:
      (k, v), each [length, K, D].
    """
    _check_layer(cache, layer)
    s = cache.page_size
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length=}")
    row = _check_int_ids("page_table_row", page_table_row)
    if row is None or row.ndim != 1:
        raise ValueError(f"page_table_row must be a concrete 1-D array, got {page_table_row!r}")
    if length > len(row) * s:
        raise ValueError(f"length {length} exceeds the page table's capacity {len(row) * s}")
    used = row[: -(-max(length, 0) // s)]  # a gather would clamp or wrap a bad id silently
    bad = (used < 0) | (used >= cache.num_pages)
    if bad.any():
        raise ValueError(
            f"page id {int(used[bad][0])} is out of range [0, {cache.num_pages}) "
            f"(page_table_row index {_first(bad)})"
        )
    slots = slots_for(row, 0, length, s)
    out = []
    for pool in (cache.k[layer], cache.v[layer]):
        kh, p, _, d = pool.shape
        out.append(pool.reshape(kh, p * s, d)[:, slots].transpose(1, 0, 2))
    return tuple(out)
