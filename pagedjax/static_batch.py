"""Checks and page layout shared by `decode.generate` and `scoring.score`: a static
batch of token id lists, each sequence given its own contiguous pages of one cache."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import jax
import numpy as np

from pagedjax.config import CacheConfig, dtype_name
from pagedjax.step_input import bucket_size, is_int

__all__ = [
    "check_chunking",
    "check_lengths",
    "check_untraced",
    "lora_slots",
    "round_pages",
    "static_pages",
    "token_lists",
]


def check_untraced(fn: str, **trees) -> None:
    """TypeError naming the first of `trees` holding a JAX tracer: `fn` is a host loop
    of jitted steps, each read back, so it cannot run under `jax.jit`, `vmap` or `grad`
    (JAX refused only once a whole step had been traced, and not by name)."""
    for name, tree in trees.items():
        # (an iterator is a leaf, not walked: JAX warns, and that would consume it)
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Iterator))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            raise TypeError(
                f"{fn} runs on the host (a loop of jitted steps, each read back): call it "
                f"outside jax.jit, vmap or grad, got traced {name}"
            )


def lora_slots(lora, given, n: int) -> list[int]:
    """The `lora_slots` argument `given`, checked: one int per prompt (sequence) in [0,
    lora.num_slots]; None: all 0 (no adapter)."""
    if given is None:
        return [0] * n
    if lora is None:
        raise ValueError("lora_slots needs lora (the LoRAWeights the slots index)")
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise ValueError(f"lora_slots must be a list of slots, one per prompt, got {given!r:.80}")
    # A jax array's slots (or jax scalars) as numpy's: one transfer, ints that is_int takes.
    slots = list(np.asarray(given)) if isinstance(given, jax.Array) else list(given)
    slots = [np.asarray(x)[()] if isinstance(x, jax.Array) else x for x in slots]
    if len(slots) != n:
        raise ValueError(f"lora_slots must have one slot per prompt ({n}), got {len(slots)}")
    for i, x in enumerate(slots):
        if not is_int(x) or not 0 <= x <= lora.num_slots:
            raise ValueError(f"lora_slots[{i}] must be an int in [0, {lora.num_slots}], got {x!r}")
    return [int(x) for x in slots]


def token_lists(seqs, what: str) -> list[np.ndarray]:
    """A non-empty list of non-empty token id lists (a 2-D array's rows) as arrays."""
    bad = isinstance(seqs, (str, bytes)) or not isinstance(seqs, Iterable)
    if bad or getattr(seqs, "ndim", 1) == 0:  # (a 0-d array is Iterable but not iterable)
        raise ValueError(f"{what}s must be a list of token id lists, got {seqs!r}")
    if isinstance(seqs, jax.Array):  # one transfer, not a device slice per row
        seqs = np.asarray(seqs)
    seqs = list(seqs)
    for i, p in enumerate(seqs):
        try:
            seqs[i] = a = np.asarray(p)
        except ValueError:  # numpy's "inhomogeneous shape"
            raise ValueError(f"{what} {i} must be a 1-D list of token ids, got {p!r:.80}") from None
        if a.dtype == np.uint64:  # as int64 (numpy's float64 for uint64 and int64 rounds)
            if (a >= 2**63).any():
                raise ValueError(
                    f"{what} {i}: token id {a[a >= 2**63][0]} is outside the vocabulary"
                )
            seqs[i] = a.astype(np.int64)
        if a.ndim != 1 or isinstance(p, (np.ndarray, jax.Array)):
            continue
        # A list's ints as numpy reads them: [1, True] as ints (True as token 1), and
        # ints past int64 or a uint64 next to an int ([1, np.uint64(3)]) as floats.
        flag = next((x for x in p if isinstance(x, (bool, np.bool_))), None)
        if flag is not None and a.dtype != bool:  # (bools alone: refused by their dtype)
            raise TypeError(f"{what} {i}: token ids must be ints, got {flag!r}")
        if a.dtype.kind in "fO" and all(map(is_int, p)):
            big = [int(x) for x in p if not -(2**63) <= int(x) < 2**63]
            if big:
                raise ValueError(f"{what} {i}: token id {big[0]} is outside the vocabulary")
            seqs[i] = np.array([int(x) for x in p], np.int64)
    if not seqs or any(p.size == 0 for p in seqs):
        raise ValueError(f"{what}s must be a non-empty list of non-empty token id lists")
    return seqs


def check_lengths(seqs, cfg, what: str, extra: int = 0, why: str = "") -> None:
    """Each of `seqs` 1-D, and with `extra` more tokens within max_position_embeddings."""
    for i, p in enumerate(seqs):
        if p.ndim == 0 and not np.issubdtype(p.dtype, np.number):  # text, None, a generator
            raise ValueError(f"{what} {i} must be a list of token ids, got {p.item()!r:.80}")
        if p.ndim != 1:
            hint = f" (one {what}? pass a list of {what}s: [{what}])" if p.ndim == 0 else ""
            raise ValueError(
                f"{what} {i} must be a 1-D list of token ids, got shape {p.shape}{hint}"
            )
        if len(p) + extra > cfg.max_position_embeddings:
            raise ValueError(
                f"{what} {i} has {len(p)} tokens; {why}it exceeds "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )


def check_chunking(page_size, prefill_chunk) -> None:
    """`page_size` a positive int (`CacheConfig` then wants a power of two) and
    `prefill_chunk` None or a positive int."""
    if prefill_chunk is not None and (not is_int(prefill_chunk) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk=}")
    if not is_int(page_size) or page_size < 1:  # CacheConfig checks it is a power of two
        raise ValueError(f"page_size must be a positive int, got {page_size=}")


def round_pages(need: int) -> int:
    """`need` pages rounded up so that runs with similar batches share compiled programs:
    to a multiple of 16 pages, and past 256 of 1/16 of the next power of two (less than
    1/8 more than needed; the next power of two took up to twice what a large batch
    needs, 256 GB of Llama-3-8B's cache for 128 GB of sequences)."""
    step = max(16, bucket_size(need, 16) // 16)
    return -(-need // step) * step


def static_pages(cfg, n: int, max_len: int, page_size, kv_cache_dtype):
    """Cache config and n page tables: b's own pages for max_len tokens (0: a null page)."""
    if page_size > cfg.max_position_embeddings:  # slots no sequence can reach, 16 pages of them
        raise ValueError(
            f"page_size must be at most max_position_embeddings={cfg.max_position_embeddings} "
            f"(a sequence's longest context), got {page_size=}"
        )
    per_seq = -(-max_len // page_size)
    num_pages = round_pages(1 + n * per_seq)
    auto = kv_cache_dtype is None or (isinstance(kv_cache_dtype, str) and kv_cache_dtype == "auto")
    try:
        dtype = cfg.dtype if auto else dtype_name(kv_cache_dtype, kv=True)
    except (ValueError, TypeError):  # (numpy's TypeError for an int)
        raise ValueError(
            "kv_cache_dtype must be None or 'auto' (the model's dtype), 'fp8' (float8_e4m3fn "
            f"pages) or a dtype name, got {kv_cache_dtype=}"
        ) from None
    cache_cfg = CacheConfig(page_size, num_pages, dtype)
    return cache_cfg, [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(n)]
