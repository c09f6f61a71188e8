"""The host validation `build_step_input` runs on a step before packing it.

Per sequence, vectorised over the step: token ids inside the vocabulary, positions
inside the model's limit and int32's, page tables long enough and with page ids inside
the pool (`_check_steps`; `CacheConfig` keeps its slot ids within int32); no two tokens
written to one cache slot (`_check_distinct_slots`); no slot written this step that
another page table, or the same one twice, reads in it (`_check_written_slots_unshared`:
a shared page must be copied first); copy-on-write pairs inside the pool, with distinct
destinations that are not sources (`_check_copies`). `_int_array`, `_page_row` and
`is_int` turn the chunks' counts and page tables into int arrays, with a TypeError
naming the sequence otherwise; `_check_real_values` refuses sampling values that are not
numbers (which numpy would convert: "0.5", True, [0.5]). Each error names the sequence
and the bad value.

They are apart from `pagedjax.step_input` (the `StepInput` pytree and the packing of
its arrays) because they are pure numpy functions of the chunks' values, which pack
nothing and hold no state; `pagedjax.step_input` re-exports `is_int`, which the engine
and the steps import from there.
"""

from __future__ import annotations

import functools
import numbers

import jax.numpy as jnp
import numpy as np

from pagedjax.config import is_int  # (re-exported: step_input's users import it)


def _first(mask) -> int:
    return int(np.argmax(mask))


def _check_steps(toks, q_lens, start, n_pages, page_table, model_cfg, cache_cfg):
    """Host validation of a whole step at once (vectorised over sequences)."""
    v, s, p = model_cfg.vocab_size, cache_cfg.page_size, cache_cfg.num_pages
    if (q_lens == 0).any() or any(t.ndim != 1 for t in toks):
        i = _first((q_lens == 0) | np.array([t.ndim != 1 for t in toks]))
        raise ValueError(f"sequence {i}: token_ids must be a non-empty 1-D list, got {toks[i]!r}")
    for i, t in enumerate(toks):
        if not np.issubdtype(t.dtype, np.integer):
            raise TypeError(f"sequence {i}: token ids must be ints, got dtype {t.dtype}")
    flat = np.concatenate(toks)
    bad = (flat < 0) | (flat >= v)
    if bad.any():
        j = _first(bad)
        i = int(np.searchsorted(np.cumsum(q_lens), j, side="right"))
        raise ValueError(
            f"sequence {i}: token id {int(flat[j])} is outside the vocabulary [0, {v})"
        )
    if (start < 0).any():
        i = _first(start < 0)
        raise ValueError(f"sequence {i}: start_pos must be >= 0, got start_pos={int(start[i])}")
    end = start + q_lens
    bad = end > model_cfg.max_position_embeddings
    if bad.any():
        i = _first(bad)
        raise ValueError(
            f"sequence {i}: positions [{int(start[i])}, {int(end[i])}) exceed the model's "
            f"max_position_embeddings={model_cfg.max_position_embeddings}"
        )
    bad = end >= 2**31  # positions and context lengths are packed as int32
    if bad.any():
        i = _first(bad)
        raise ValueError(
            f"sequence {i}: positions [{int(start[i])}, {int(end[i])}) reach past int32 "
            "(a context length is at most 2**31 - 1)"
        )
    bad = n_pages * s < end
    if bad.any():
        i = _first(bad)
        raise ValueError(
            f"sequence {i}: page table of {int(n_pages[i])} pages holds {int(n_pages[i]) * s} "
            f"tokens, needs {int(end[i])}"
        )
    bad = (page_table < 0) | (page_table >= p)
    if bad.any():
        i, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"sequence {i}: page id {int(page_table[i, j])} is out of range [0, {p})")


def _int_array(values, name) -> np.ndarray:
    """One int per sequence as an int array; TypeError (ValueError past int64) naming
    the sequence otherwise."""
    out = np.asarray(values)
    if out.dtype == np.uint64 and (out >= 2**63).any():  # (int64 would make them negative)
        i = _first(out >= 2**63)
        raise ValueError(f"sequence {i}: {name}={int(out[i])} is out of range")
    if np.issubdtype(out.dtype, np.integer):
        return out
    for i, v in enumerate(values):
        if not is_int(v) and not (
            np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.integer)
        ):
            raise TypeError(f"sequence {i}: {name} must be an int, got {name}={v!r}")
    # Every value is an int, but numpy found no integer dtype for them all (one past
    # int64, or uint64 next to a signed int).
    ints = [int(v) for v in values]
    for i, v in enumerate(ints):
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"sequence {i}: {name}={v} is out of range")
    return np.array(ints, np.int64)


def _page_row(page_table, i, num_pages) -> np.ndarray:
    row = np.asarray(page_table)
    if row.ndim != 1:
        raise ValueError(f"sequence {i}: page_table must be 1-D, got shape {row.shape}")
    if row.size and not np.issubdtype(row.dtype, np.integer):
        raise TypeError(f"sequence {i}: page_table must hold int page ids, got dtype {row.dtype}")
    if row.dtype == np.uint64 and (row >= 2**63).any():  # int64 would name it as negative
        bad = int(row[row >= 2**63][0])
        raise ValueError(f"sequence {i}: page id {bad} is out of range [0, {num_pages})")
    return row.astype(np.int64)


@functools.cache
def _real_type(t: type) -> bool:
    return issubclass(t, numbers.Real) and not issubclass(t, (bool, np.bool_))


def _is_real(v) -> bool:
    """A real number: a Python or numpy int or float, or a 0-d int or float array (a jax
    scalar, bfloat16 and fp8 ones too); not a bool, a string or a list, which numpy would
    take as numbers."""
    if _real_type(type(v)):
        return True
    dtype = getattr(v, "dtype", None)
    return dtype is not None and np.ndim(v) == 0 and _real_dtype(np.dtype(dtype))


@functools.cache
def _real_dtype(dtype: np.dtype) -> bool:
    # (ml_dtypes' bfloat16 and float8 are numpy kind "V": a jax bfloat16 scalar was
    # refused as "not a real number")
    return dtype.kind in "iuf" or jnp.issubdtype(dtype, jnp.floating)


def _is_int(v) -> bool:
    """An integer: a Python or numpy int, or a 0-d int array; not a bool, and not a
    float that happens to be whole (2.0 top-k is a caller's mistake, not a count)."""
    if is_int(v):
        return True
    dtype = getattr(v, "dtype", None)
    return dtype is not None and np.ndim(v) == 0 and np.dtype(dtype).kind in "iu"


def _check_int_values(chunks, names) -> None:
    """ValueError naming the sequence and the value unless every chunk's fields `names`
    hold integers (`_is_int`)."""
    for name in names:
        values = [getattr(c, name) for c in chunks]
        if set(map(type, values)) != {int} and not all(map(_is_int, values)):
            i = _first([not _is_int(v) for v in values])
            raise ValueError(f"sequence {i}: {name} must be an int, got {name}={values[i]!r:.80}")


def _all_real(values) -> bool:
    return all(map(_real_type, set(map(type, values)))) or all(map(_is_real, values))


def _check_real_values(chunks, names) -> None:
    """ValueError naming the sequence and the value unless every chunk's fields `names`
    hold real numbers (`_is_real`)."""
    for name in names:
        values = [getattr(c, name) for c in chunks]
        if not _all_real(values):
            i = _first([not _is_real(v) for v in values])
            raise ValueError(
                f"sequence {i}: {name} must be a real number, got {name}={values[i]!r:.80}"
            )


def _scalar(v):
    """A real number `v` (`_is_real`) as itself, or a 0-d array's value."""
    return v if _real_type(type(v)) else np.asarray(v).item()


def _check_distinct_slots(slots, seq, pos):
    """Two tokens of one step written to one slot: the later would silently win."""
    order = np.argsort(slots, kind="stable")
    same = np.flatnonzero(slots[order][1:] == slots[order][:-1])
    if same.size:
        a, b = order[same[0]], order[same[0] + 1]
        raise ValueError(
            f"sequences {int(seq[a])} and {int(seq[b])} both write cache slot {int(slots[a])} "
            f"(positions {int(pos[a])} and {int(pos[b])}): a page this step writes is in "
            "two page tables, or twice in one"
        )


def _check_written_slots_unshared(slots, seq, pos, page_table, start, end, s, num_pages, window):
    """A slot written this step may be read only as the position written there.

    Were a written page also in another page table (or twice in one) within what the
    step attends to, that reader would see the new token in place of its own cached one,
    without a word: a shared page must be copied before it is written (`copies`).
    Vectorised over the page-table entries each sequence reads (positions [lo, end),
    lo = 0, or its first query's window start) that name a written page; each written
    slot must lie in exactly one of them (the writer's own).
    """
    n = len(start)
    lo = np.zeros_like(start) if window is None else np.maximum(start - window + 1, 0)
    written = np.zeros(num_pages, bool)
    written[slots // s] = True
    table = page_table[:n]
    cols = np.arange(table.shape[1])
    read = (cols >= (lo // s)[:, None]) & (cols < (-(-end // s))[:, None])  # pages read
    ent_seq, ent_j = np.nonzero(read & written[table])  # only written pages can conflict
    page = table[ent_seq, ent_j]
    base = page * s - ent_j * s  # slot of position p in entry: base + p
    read_lo = base + np.maximum(lo[ent_seq], ent_j * s)  # read slots [read_lo, read_hi)
    read_hi = base + np.minimum(end[ent_seq], ent_j * s + s)
    covered = np.searchsorted(np.sort(read_lo), slots, "right") - np.searchsorted(
        np.sort(read_hi), slots, "right"
    )  # the writer's own entry covers each written slot once
    if (covered > 1).any():
        w = _first(covered > 1)
        slot, x, p = int(slots[w]), int(seq[w]), int(pos[w])
        other = (read_lo <= slot) & (slot < read_hi) & ((ent_seq != x) | (ent_j != p // s))
        k = _first(other)
        y, q = int(ent_seq[k]), int(slot - base[k])
        raise ValueError(
            f"sequence {x} writes cache slot {slot} (position {p}), which sequence {y} reads "
            f"as its position {q}: a page in two page tables, or twice in one, is written "
            "(copy it first: copies=[(src, dst)])"
        )


def _check_copies(copies, num_pages):
    if len(copies) == 0:  # (a numpy array of pairs has no truth value)
        return
    pairs = np.asarray(copies)
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"copies must be (src_page, dst_page) pairs, got {copies}")
    if not np.issubdtype(pairs.dtype, np.integer):
        raise TypeError(f"copies must be int page ids, got {copies}")
    bad = (pairs < 0) | (pairs >= num_pages)
    if bad.any():
        i = int(np.argwhere(bad)[0][0])
        raise ValueError(
            f"copy pair {tuple(map(int, pairs[i]))} has a page id outside [0, {num_pages})"
        )
    if len(set(pairs[:, 1])) != len(pairs) or set(pairs[:, 0]) & set(pairs[:, 1]):
        raise ValueError(f"copy destinations must be distinct and not sources, got {copies}")
