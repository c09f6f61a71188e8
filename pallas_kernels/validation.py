"""Host-side checks of attention inputs, run before anything is traced.

Shape and dtype checks always run. Value checks (page ids in range, lengths within
the page table's capacity, monotone `query_start_loc`) run only when the arrays
are concrete: under an outer `jax.jit` they are tracers and the caller (the block
manager and the step builder) is responsible for them. A bad traced value gives a
garbage output, never a load, DMA or store outside an array: the kernels clamp what
they index with (page ids as the XLA reference reads them, `int_ops.page_ids`; lengths
to the page table's capacity; the GPU ragged kernel's `query_start_loc` into the rows).

Page ids are checked only where a call reads them (`read_tokens`): sequence `b`
reads the pages holding its tokens `[lo, hi)`, `hi` its length and `lo` the first
key any of its queries sees (0, or the sliding window's start for its first query).
No backend uses any other entry: the Pallas kernels load or DMA no other page (a
ragged sequence without queries reads none; its pages are checked all the same),
and the XLA path gathers whole rows, where XLA wraps -1 and clamps other
out-of-range ids, then masks every key no query sees. So entries past a sequence's
last page or wholly before its window are padding and may hold any id, -1 included.

Dtypes: q and the page pools share a dtype, except that the pools may be FP8
(`FP8_DTYPES`, an FP8 KV cache) with a bfloat16 or float32 q; K/V tiles are then
upcast to q's dtype inside every backend and the output is in q's dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# KV-cache dtypes accepted with a wider q: the pools are stored in FP8, unscaled
# (the cache clips to the format's range before casting).
FP8_DTYPES = frozenset({jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)})
# Query dtypes that fp8 pools may be read with.
FP8_QUERY_DTYPES = frozenset({jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)})


# Positions and lengths are int32 inside every backend.
_INT32_LIMIT = 2**31
# The kernels fold the options into float32 constants: log2(e) into scale and soft_cap
# (the GPU kernels' softmax is in base 2) and scale / soft_cap into one factor, so each
# product must stay below float32's maximum (else the constant is inf and the output NaN).
_F32_MAX = float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)


def is_int(x) -> bool:
    """A Python int, not a bool (True is an int, but not a count or a knob)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_pow2(x) -> bool:
    """A Python int that is a positive power of two (the kernels' tile sizes)."""
    return is_int(x) and x > 0 and not x & (x - 1)


def static_knobs(**knobs) -> dict:
    """Tuning knobs with numpy and concrete 0-d jax ints and bools as Python ones, the rest
    unchanged: every kernel checks its knobs with `is_int` / `is_pow2` (and `bool`), which
    refused `block_kv=np.int64(32)` with "block_kv must be a power of two >= 16"."""
    out = {}
    for name, value in knobs.items():
        concrete = isinstance(value, np.generic) or (
            isinstance(value, jax.Array)
            and not isinstance(value, jax.core.Tracer)
            and value.ndim == 0
        )
        if concrete and (
            np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.bool_)
        ):
            value = value.item()
        out[name] = value
    return out


def gpu_tile_dim(head_dim: int) -> int:
    """The head dim of the GPU (Triton) kernels' tiles: `head_dim` padded up to a power
    of two of at least 16, as Triton's `dot` tiles need. The padding columns are masked:
    the kernels never load or store them, so any head dim up to `GPU_MAX_HEAD_DIM` (80,
    96, 100, 8) runs, the K/V bytes moved unchanged and only the dots' width padded."""
    return max(16, 1 << (head_dim - 1).bit_length())


# The widest head dim the GPU kernels take: their defaults size tiles for padded widths
# up to 256 (the widest run on a GPU, tests/test_gpu_device.py). Wider tiles overflow
# shared memory (232,448 bytes per program on the H200; pip Triton 3.9 for sm90, compiled
# on a CPU with scripts/triton_ir.py): the ragged kernel at D = 257..512 in float32 takes
# 270,336 bytes, at D = 513..1024 in any dtype 393,216; the decode kernel at
# D = 1025..2048 in float32 262,144.
GPU_MAX_HEAD_DIM = 256


def gpu_head_dim_ok(head_dim: int) -> bool:
    """Whether the GPU (Triton) kernels take this head dim: 1..`GPU_MAX_HEAD_DIM`, any
    value (padded to `gpu_tile_dim` inside them)."""
    return 1 <= head_dim <= GPU_MAX_HEAD_DIM


def check_gpu_head_dim(head_dim: int) -> None:
    """ValueError naming `head_dim` unless `gpu_head_dim_ok` (`backend="auto"` runs XLA
    for such head dims on CUDA instead)."""
    if not gpu_head_dim_ok(head_dim):
        raise ValueError(
            f"the GPU kernels take a head_dim of at most {GPU_MAX_HEAD_DIM} (wider tiles "
            f"overflow shared memory), got {head_dim=} (backend='auto' runs XLA's "
            "attention for it)"
        )


# The GPU (Triton) kernels address a page pool with int32 element offsets (Pallas's
# lowering: `tt.addptr` of an i32 tensor): past 2**31 elements they would wrap.
GPU_MAX_POOL_ELEMENTS = 2**31


def gpu_pool_ok(pool_shape) -> bool:
    """Whether the GPU kernels can address a page pool of this shape (`[K, P, S, D]`)."""
    return math.prod(pool_shape) <= GPU_MAX_POOL_ELEMENTS


def check_gpu_pool(pool_shape) -> None:
    """ValueError naming the pool's shape unless `gpu_pool_ok` (`backend="auto"` runs XLA
    for such pools on CUDA instead)."""
    if not gpu_pool_ok(pool_shape):
        k, _, s, d = pool_shape
        raise ValueError(
            f"the GPU kernels address a page pool with int32 offsets, at most "
            f"{GPU_MAX_POOL_ELEMENTS} elements; k_pages {list(pool_shape)} has "
            f"{math.prod(pool_shape)}: use at most {GPU_MAX_POOL_ELEMENTS // (k * s * d)} "
            "pages (backend='auto' runs XLA's attention for it)"
        )


def _check_arrays(**arrays):
    for name, x in arrays.items():
        if not all(hasattr(x, a) for a in ("shape", "dtype", "ndim")):
            raise TypeError(
                f"{name} must be an array (jax.Array or numpy.ndarray), got {type(x).__name__}"
            )


def _concrete(x):
    """Returns x as a numpy array, or None when it is a tracer."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_rank(name, x, rank, layout):
    if x.ndim != rank:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def _check_int(name, x):
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")


def check_pages(q, k_pages, v_pages):
    """Checks q against the page pools; returns (num_heads, num_kv_heads, head_dim)."""
    _check_rank("k_pages", k_pages, 4, "[K, P, S, D]")
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages shape {tuple(v_pages.shape)} != k_pages shape {tuple(k_pages.shape)}"
        )
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages dtype {v_pages.dtype} != k_pages dtype {k_pages.dtype}")
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads, _, page_size, kv_head_dim = k_pages.shape
    if head_dim != kv_head_dim:
        raise ValueError(f"q head_dim {head_dim} != k_pages head_dim {kv_head_dim}")
    if head_dim == 0:
        raise ValueError(f"head_dim must be positive, got {head_dim=}")
    if num_heads == 0:  # 0 % K == 0 passes the GQA check below; the kernels fail on G = 0
        raise ValueError(f"q must have query heads, got {num_heads=}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"kv heads must divide query heads, got {num_heads=} and {num_kv_heads=}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size=}")
    check_dtypes(q.dtype, k_pages.dtype)
    return num_heads, num_kv_heads, head_dim


def check_dtypes(q_dtype, kv_dtype) -> None:
    """Raises TypeError unless q_dtype may be used with pages of kv_dtype."""
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    if kv_dtype in FP8_DTYPES:
        if q_dtype not in FP8_QUERY_DTYPES:
            raise TypeError(
                f"q dtype {q_dtype} with k_pages dtype {kv_dtype}: fp8 pages need a "
                "bfloat16 or float32 q"
            )
    elif q_dtype != kv_dtype:
        raise TypeError(f"q dtype {q_dtype} != k_pages dtype {kv_dtype}")
    # Same dtype: it must be one attention is computed in.
    if not jnp.issubdtype(q_dtype, jnp.floating):
        raise TypeError(f"q must be a floating array, got dtype {q_dtype}")
    if q_dtype.itemsize < 2:
        raise TypeError(f"q must be 16-bit or wider (only the pages may be fp8), got {q_dtype}")


def _real_number(name, x):
    """x as a numpy scalar, or a TypeError: the options are compile-time constants."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static number, not a traced array: it is a compile-time "
            "constant of the kernels (pass a Python or numpy scalar)"
        )
    if is_int(x):  # exact at any size (numpy makes one past 64 bits an object array)
        return x
    dtype = np.asarray(x).dtype
    real = np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)
    if np.ndim(x) != 0 or not real:
        raise TypeError(f"{name} must be a real number, got {name}={x!r}")
    return np.asarray(x)[()]


def _positive_finite(name, x):
    value = _real_number(name, x)
    if is_int(value):
        try:
            value = float(value)
        except OverflowError:  # past float64's range: infinite, as in float32
            value = math.inf if value > 0 else -math.inf
    with np.errstate(over="ignore"):
        value32 = np.float32(value)  # what the kernels compute with
    if not (value32 > 0 and np.isfinite(value32)):
        note = "" if np.isinf(value32) == np.isinf(value) else f" ({value32} as a float32)"
        raise ValueError(f"{name} must be positive and finite, got {name}={x!r}{note}")
    if float(value) * _LOG2E > _F32_MAX:
        raise ValueError(
            f"{name} must be at most {_F32_MAX / _LOG2E:.4g} (the GPU kernels fold log2(e) "
            f"into it, a float32 constant), got {name}={x!r}"
        )
    return float(value)


def check_options(scale, soft_cap, sliding_window, head_dim=None):
    """Checks the static options: positive finite scale and soft_cap, a positive int window.

    Each may be a Python, numpy or concrete 0-d jax number (not a bool, not a tracer).
    scale, soft_cap (times log2(e)) and scale / soft_cap must be at most float32's
    maximum; `head_dim` gives the default scale, D ** -0.5, for the last check.
    """
    if scale is not None:
        scale = _positive_finite("scale", scale)
    if soft_cap is not None:
        cap = _positive_finite("soft_cap", soft_cap)
        factor = scale if scale is not None else None if head_dim is None else head_dim**-0.5
        if factor is not None and factor / cap > _F32_MAX:
            raise ValueError(
                f"scale / soft_cap must be at most {_F32_MAX:.4g} (the kernels fold it into "
                f"a float32 constant), got scale={factor!r} and {soft_cap=}"
            )
    if sliding_window is not None:
        if isinstance(sliding_window, (bool, np.bool_)):
            raise TypeError(f"sliding_window must be an int, got {sliding_window=}")
        w = _real_number("sliding_window", sliding_window)
        whole = is_int(w) or (np.isfinite(w) and w == np.floor(w))
        if not (whole and w >= 1):
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window=}")
        if w >= _INT32_LIMIT:
            raise ValueError(
                f"sliding_window must be < 2**31 (positions are int32), got {sliding_window=}"
            )


def check_page_table(page_table, batch):
    """Shape and dtype of the page table; its ids are checked by `check_page_ids`."""
    _check_rank("page_table", page_table, 2, "[B, max_pages]")
    _check_int("page_table", page_table)
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table has {page_table.shape[0]} rows for a batch of {batch}")


def read_tokens(lengths, sliding_window, q_lens=1):
    """The tokens `[lo, hi)` whose pages each sequence's queries read, or None if unknown.

    A query at position `p` sees keys `p - W < j <= p`, so with a window sequence `b`
    reads from its first query's window start, `lengths[b] - q_lens[b] - W + 1`; `hi`
    is `lengths[b]`. The kernels read no page outside these tokens' pages (the page
    holding `lo` included, even when `lo` is mid page).

    Args:
      lengths: [B] int tokens in the cache per sequence (already checked), or a tracer.
      sliding_window: None or the (already checked) window W.
      q_lens: query tokens per sequence, [B] or a scalar: 1 for decode; None when
        unknown (a traced `query_start_loc`): then `lo` is 0, the window start of the
        longest possible chunk (q_len = lengths[b]).

    Returns:
      (lo, hi), both [B] int64 numpy arrays; None when `lengths` is traced.
    """
    n = _concrete(lengths)
    if n is None:
        return None
    hi = n.astype(np.int64)
    if sliding_window is None or q_lens is None:
        return np.zeros_like(hi), hi
    w = int(np.asarray(sliding_window))
    return np.maximum(hi - np.asarray(q_lens, np.int64) - w + 1, 0), hi


def check_page_ids(page_table, num_pages, page_size, reads):
    """ValueError naming the first out-of-range page id among the entries a call reads.

    Args:
      page_table: [B, max_pages] int; not checked when traced.
      num_pages: P, ids must be in [0, P).
      page_size: S.
      reads: `read_tokens`'s (lo, hi), or None (unknown: every entry is checked).
    """
    pt = _concrete(page_table)
    if pt is None or not pt.size:
        return
    bad = (pt < 0) | (pt >= num_pages)  # [B, max_pages]
    if not bad.any():  # the common case costs no more than checking every entry
        return
    if reads is not None:
        lo, hi = reads
        first, end = lo // page_size, -(-hi // page_size)  # [B]: pages [first, end)
        idx = np.arange(pt.shape[1])
        bad &= (idx >= first[:, None]) & (idx < end[:, None])
        if not bad.any():
            return
    b, i = map(int, np.argwhere(bad)[0])
    if reads is None:
        why = "every entry is checked: the lengths are traced"
    else:
        why = (
            f"sequence {b} reads pages [{int(first[b])}, {int(end[b])}) of its row "
            f"(tokens [{int(lo[b])}, {int(hi[b])})); entries outside them may hold any id"
        )
    raise ValueError(
        f"page id {int(pt[b, i])} at page_table[{b}, {i}] is out of range [0, {num_pages}) ({why})"
    )


def check_lengths(name, lengths, batch, capacity):
    _check_rank(name, lengths, 1, "[B]")
    _check_int(name, lengths)
    if lengths.shape[0] != batch:
        raise ValueError(f"{name} has {lengths.shape[0]} entries for a batch of {batch}")
    n = _concrete(lengths)
    if n is not None and n.size:
        if (n < 0).any():
            b = int(np.argmax(n < 0))
            raise ValueError(f"{name}[{b}] = {int(n[b])} is negative")
        if (n > capacity).any():
            b = int(np.argmax(n > capacity))
            raise ValueError(
                f"{name}[{b}] = {int(n[b])} exceeds the page table's capacity "
                f"max_pages * page_size = {capacity}"
            )


def check_decode(q, k_pages, v_pages, lengths, page_table, scale, soft_cap, sliding_window):
    """All checks for `paged_decode_attention`."""
    _check_arrays(q=q, k_pages=k_pages, v_pages=v_pages, lengths=lengths, page_table=page_table)
    _check_rank("q", q, 3, "[B, H, D]")
    check_pages(q, k_pages, v_pages)
    check_options(scale, soft_cap, sliding_window, q.shape[-1])
    batch = q.shape[0]
    _, num_pages, page_size, _ = k_pages.shape
    check_page_table(page_table, batch)
    check_lengths("lengths", lengths, batch, page_table.shape[1] * page_size)
    check_page_ids(page_table, num_pages, page_size, read_tokens(lengths, sliding_window))


def check_ragged(
    q, k_pages, v_pages, page_table, context_lens, query_start_loc, scale, soft_cap, sliding_window
):
    """All checks for `ragged_paged_attention`."""
    _check_arrays(
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=page_table,
        context_lens=context_lens,
        query_start_loc=query_start_loc,
    )
    _check_rank("q", q, 3, "[T, H, D]")
    check_pages(q, k_pages, v_pages)
    check_options(scale, soft_cap, sliding_window, q.shape[-1])
    batch = page_table.shape[0] if page_table.ndim == 2 else -1
    _, num_pages, page_size, _ = k_pages.shape
    check_page_table(page_table, batch)
    check_lengths("context_lens", context_lens, batch, page_table.shape[1] * page_size)
    _check_rank("query_start_loc", query_start_loc, 1, "[B + 1]")
    _check_int("query_start_loc", query_start_loc)
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries, expected B + 1 = {batch + 1}"
        )
    loc = _concrete(query_start_loc)
    if loc is not None:
        loc = loc.astype(np.int64)  # np.diff of an unsigned array wraps below 0
        _check_query_start_loc(loc, _concrete(context_lens), q.shape[0])
    q_lens = None if loc is None else np.diff(loc)
    reads = read_tokens(context_lens, sliding_window, q_lens)
    check_page_ids(page_table, num_pages, page_size, reads)


def _check_query_start_loc(loc, ctx, num_rows):
    """Values of a concrete `query_start_loc` (and q_len <= context_len when ctx is concrete)."""
    if loc[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(loc[0])}")
    q_lens = np.diff(loc)
    if (q_lens < 0).any():
        b = int(np.argmax(q_lens < 0))
        raise ValueError(
            f"query_start_loc must be non-decreasing, got {int(loc[b])} then {int(loc[b + 1])} "
            f"at index {b}"
        )
    if loc[-1] > num_rows:
        raise ValueError(
            f"query_start_loc ends at {int(loc[-1])}, beyond the {num_rows} query rows"
        )
    if ctx is not None and (q_lens > ctx).any():
        b = int(np.argmax(q_lens > ctx))
        raise ValueError(f"sequence {b} has q_len {int(q_lens[b])} > context_len {int(ctx[b])}")
