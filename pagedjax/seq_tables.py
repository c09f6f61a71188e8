"""The live sequences' page tables, from admission to free: the block manager's sequence side.

Host-side plain Python and numpy. ``SeqTables`` keeps one ``SeqPages`` record
(``pagedjax.seq_pages``) per live sequence and every call that reads or changes a live
sequence's pages: page tables and slot mapping, prefill progress (``grow``,
``mark_computed``), decode appends with copy-on-write, forks, sliding-window releases,
frees, and the accounting of ``peak_pages`` reservations. Pages come from a ``PagePool``
(``pagedjax.page_pool``) and go back to it; full computed pages are registered in the
``PrefixCache``. It is the base of ``BlockManager`` (``pagedjax.blocks``), which adds
admission, uncaching, stats and invariant checks, and whose module docstring states the
contract every call here keeps: each one is all-or-nothing (checks first, then changes).
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Hashable, Sequence

import numpy as np

from pagedjax.errors import (
    InvalidArgument,
    InvalidState,
    OutOfPages,
    SequenceExists,
    SequenceFreed,
    UnknownSequence,
)
from pagedjax.page_pool import PagePool
from pagedjax.prefix_cache import PrefixCache
from pagedjax.seq_pages import PAD_PAGE, SeqPages, append, append_pages_needed, set_values

__all__ = ["SeqTables", "as_int", "id_batch", "token_array"]

_FREED_MEMORY = 4096  # freed ids remembered to tell "double free" from "unknown"


def token_array(token_ids, what: str, *, allow_unknown: bool = False) -> np.ndarray:
    """``token_ids`` as a ``[T]`` int64 array (little-endian, as ``SeqPages`` stores them);
    ids must be >= 0, or >= -1 (not known yet) with ``allow_unknown``."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {arr.shape}")
    lowest = "-1 (not known yet)" if allow_unknown else "0"
    if arr.size and arr.dtype.kind not in "iu":
        if isinstance(token_ids, (list, tuple)):  # Python ints past int64 turn float or object
            big = [t for t in token_ids if type(t) is int and not -(2**63) <= t < 2**63]
            if big:
                bound = f">= {lowest}" if big[0] < 0 else "< 2**63 (int64)"
                raise InvalidArgument(f"{what} must be {bound}, got {big[0]}")
        raise InvalidArgument(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < -int(allow_unknown):
        raise InvalidArgument(f"{what} must be >= {lowest}, got {int(arr.min())}")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) >= 2**63:  # would wrap negative
        raise InvalidArgument(f"{what} must be < 2**63 (int64), got {int(arr.max())}")
    return arr.astype("<i8", copy=False)


def as_int(value, name: str) -> int:
    """``value`` as an int (Python or numpy integer); a bool or a float is a TypeError."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {name}={value!r} (a bool)")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an int, got {name}={value!r} ({type(value).__name__})"
        ) from None


def id_batch(seq_ids, name: str = "seq_ids"):
    """Rejects one id (a str or bytes) passed where a batch of ids is expected."""
    if isinstance(seq_ids, (str, bytes)):
        raise InvalidArgument(f"{name} must be a sequence of ids, not the single id {seq_ids!r}")
    return seq_ids


class SeqTables:
    """The live sequences and their pages; the base of ``BlockManager``, which admits them.

    Args:
        page_size: token slots per page.
        max_model_len: longest sequence (prompt plus output) in tokens; None: unbounded.
        prefix: where full computed pages are registered.
        pool: the pages (sharing ``prefix``).
    """

    def __init__(
        self, page_size: int, max_model_len: int | None, prefix: PrefixCache, pool: PagePool
    ):
        self.page_size = page_size
        self.max_model_len = max_model_len
        self._seqs: dict[Hashable, SeqPages] = {}
        self._reserving: dict[Hashable, SeqPages] = {}  # those with a peak (a reservation)
        self._freed: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.sliding_window: int | None = None  # the model's window (BlockManager sets it)
        self._prefix = prefix
        self._pool = pool
        self._cow_copies = 0

    # ---------------------------------------------------------------- queries

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def num_free_pages(self) -> int:
        """Pages allocatable now: free plus evictable cached pages."""
        return self._pool.num_free

    @property
    def num_reserved_pages(self) -> int:
        """Free pages promised to sequences admitted with ``peak_pages`` (``admit``).

        Each such sequence reserves its peak; a page it holds counts as taken out of the
        reservations while only reserving sequences hold it (one they share with another
        sequence may stay in use after they let it go). Always <= ``num_free_pages``.
        """
        return self._reservation()[0]

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence that have a slot (prompt plus appended)."""
        return self._get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence whose K/V is on the device."""
        return self._get(seq_id).num_computed

    def page_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's physical pages, logical order (a copy); -1 where released."""
        return list(self._get(seq_id).pages)

    def page_tables(
        self, seq_ids: Sequence[Hashable], *, width: int | None = None, pad: int = PAD_PAGE
    ) -> np.ndarray:
        """Page tables of many sequences as one ``[B, width]`` int32 array.

        Args:
            seq_ids: the sequences, one row each.
            width: columns; default the longest table. Must fit every table.
            pad: value for columns past a sequence's last page (a valid page id by default,
                so a kernel that reads past the context length stays in bounds). Released
                entries (``release_before``) read ``PAD_PAGE`` whatever ``pad`` is.
        """
        get = self._seqs.get
        seqs = [get(sid) or self._get(sid) for sid in id_batch(seq_ids)]
        lens = [len(s.pages) for s in seqs]
        longest = max(lens, default=0)
        width = longest if width is None else as_int(width, "width")
        if width < longest:
            raise InvalidArgument(f"width={width} is less than the longest page table {longest}")
        if not -(2**31) <= as_int(pad, "pad") < 2**31:
            raise InvalidArgument(f"pad={pad} does not fit in int32")
        tables = [s.table for s in seqs]
        if (
            pad == PAD_PAGE
            and len(set(map(len, tables))) == 1
            and width <= len(tables[0]) <= 2 * width
        ):
            # Each mirror holds PAD_PAGE past its pages (`SeqPages`), and all are as long
            # (the usual case: max_model_len's pages): one copy of them all, not a store
            # per row (a third of the time at B=256); only while the mirrors are at most
            # twice the width, as the copy takes them whole (a 128k-token model's 8192
            # pages, for a width of 128, took 10x the per-row stores).
            out = np.concatenate(tables).reshape(len(seqs), -1)[:, :width]
            return np.ascontiguousarray(out)
        out = np.full((len(seqs), width), pad, np.int32)
        for row, t, k in zip(out, tables, lens, strict=True):
            row[:k] = t[:k]
        return out

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> np.ndarray:
        """Device slots of positions ``[start, end)``: ``[end - start]`` int32."""
        s, start, end = self._get(seq_id), as_int(start, "start"), as_int(end, "end")
        return s.slots(seq_id, start, end, self.page_size)

    def num_append_pages(self, seq_ids: Sequence[Hashable]) -> int:
        """Pages that ``append_tokens(seq_ids, ...)`` would allocate (new and copies)."""
        return self._append_plan(seq_ids)[1]

    # --------------------------------------------------------------- mutation

    def grow(self, seq_id: Hashable, num_tokens: int) -> int:
        """Allocates the pages a sequence admitted with ``peak_pages`` lacks for its tokens
        below ``num_tokens``, out of its reservation (before a prefill chunk's slots).

        Returns:
            Pages allocated (0: it had them).

        Raises:
            InvalidArgument: ``num_tokens`` is outside ``[0, num_tokens(seq_id)]``.
            InvalidState: it would hold more than its ``peak_pages`` (release first).
            OutOfPages: not enough free pages (never while reservations hold).
            Nothing changes on any error.
        """
        s = self._get(seq_id)
        n = as_int(num_tokens, "num_tokens")
        if not 0 <= n <= s.num_tokens:
            raise InvalidArgument(
                f"num_tokens={n} for sequence {seq_id!r} must be in [0, {s.num_tokens}]"
            )
        k = len(s.pages)
        need = -(-n // self.page_size) - k
        if need <= 0:
            return 0
        if k - s.released + need > s.peak:
            raise InvalidState(
                f"growing {seq_id!r} to {n} tokens would hold {k - s.released + need} pages, "
                f"more than its peak_pages={s.peak} (release_before first)"
            )
        if need > self.num_free_pages:
            raise OutOfPages(need, self.num_free_pages, f"growing {seq_id!r} to {n} tokens")
        s.extend([self._pool.alloc() for _ in range(need)])
        return need

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Records that the K/V of the first ``num_computed_tokens`` tokens is on the device.

        Call it after scheduling (or running) each prefill chunk; pages that become full
        are registered in the prefix cache. Never decreases; at most ``num_tokens``.
        """
        s = self._get(seq_id)
        n = as_int(num_computed_tokens, "num_computed_tokens")
        top = min(s.num_tokens, len(s.pages) * self.page_size)
        if not s.num_computed <= n <= top:
            raise InvalidArgument(
                f"num_computed_tokens={n} for sequence {seq_id!r} must be in "
                f"[{s.num_computed}, {top}]" + ("" if top == s.num_tokens else " (grow it first)")
            )
        s.num_computed = n
        if n == s.num_tokens and s.peak:  # prefilled: an ordinary sequence from now on
            s.peak = 0
            del self._reserving[seq_id]
        known = n if s.unknown < 0 else min(n, s.unknown)  # cache only known content
        self._prefix.register(s.chain, s.pages, s.tokens, known // self.page_size)

    def append_token(self, seq_id: Hashable, token_id: int) -> tuple[int, list[tuple[int, int]]]:
        """One-sequence ``append_tokens``: returns ``(slot, copies)``."""
        slots, copies = self.append_tokens([seq_id], [token_id])
        return int(slots[0]), copies

    def append_tokens(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Gives each sequence a slot for one more token (the decode step's input).

        Args:
            seq_ids: distinct, fully computed live sequences.
            token_ids: ``[B]`` the token each sequence feeds at position ``num_tokens``;
                -1: not known yet (``set_tokens`` gives it later).

        Returns:
            ``(slots, copies)``: ``[B]`` int32 write slots, and ``(src_page, dst_page)``
            copy-on-write copies to run before the writes.

        Raises:
            OutOfPages: the batch needs more pages than are left; nothing changed.
        """
        toks = token_array(token_ids, "token_ids", allow_unknown=True)
        if toks.shape[0] != len(id_batch(seq_ids)):
            raise InvalidArgument(f"{len(seq_ids)} seq_ids but {toks.shape[0]} token_ids")
        seqs, needed = self._append_plan(seq_ids)
        reserved = self.num_reserved_pages
        available = self.num_free_pages - reserved
        if needed > available:
            what = f"appending to {len(seq_ids)} sequences"
            raise OutOfPages(needed, available, what, reserved=reserved)
        slots, copies = append(
            seqs, toks.tolist(), self.page_size, self._pool, self._prefix.register
        )
        self._cow_copies += len(copies)
        return np.array(slots, np.int32), copies

    def set_tokens(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[int] | np.ndarray
    ) -> None:
        """Gives the values of tokens appended as unknown (-1); full pages get cached.

        Args:
            seq_ids: distinct live sequences, each holding an unknown token.
            token_ids: ``[B]`` their values.
        """
        toks = token_array(token_ids, "token_ids")
        if toks.shape[0] != len(id_batch(seq_ids)):
            raise InvalidArgument(f"{len(seq_ids)} seq_ids but {toks.shape[0]} token_ids")
        seqs = [self._get(sid) for sid in seq_ids]
        for sid, s in zip(seq_ids, seqs, strict=True):
            if s.unknown < 0:
                raise InvalidState(f"sequence {sid!r} has no token waiting for its value")
        if len(set(seq_ids)) != len(seq_ids):
            dup = next(k for k, c in collections.Counter(seq_ids).items() if c > 1)
            raise InvalidArgument(f"sequence {dup!r} appears twice in one set_tokens batch")
        set_values(seqs, toks.tolist(), self.page_size, self._prefix.register)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Makes ``child_id`` share every page of ``parent_id`` (refcounts + 1)."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise SequenceExists(f"cannot fork into {child_id!r}: it is already live")
        if parent.num_computed != parent.num_tokens:
            raise InvalidState(
                f"cannot fork {parent_id!r} mid-prefill: {parent.num_computed} of "
                f"{parent.num_tokens} tokens computed"
            )
        if parent.unknown >= 0:
            raise InvalidState(
                f"cannot fork {parent_id!r}: token {parent.unknown} has no value yet"
            )
        self._pool.share(parent.pages[parent.released :])
        child = self._seqs[child_id] = parent.forked()
        self._prefix.hold(child.chain)
        self._freed.pop(child_id, None)

    def free(self, seq_id: Hashable) -> None:
        """Releases a finished, aborted or preempted sequence's pages.

        Unreferenced cached pages become evictable, the others return to the free list.
        Under full attention (no ``sliding_window``) the cached ones are freed tail first,
        so a prefix's head is evicted last (evicting a page uncaches the pages under it);
        pages ``release_before`` gave back, still cached, move behind them.

        Knowing the model's window W, eviction keeps what is cached under a page, and a
        page is only worth keeping for a hit point less than W tokens above it. The ones
        a re-request needs are evicted last: the pages holding positions
        ``>= q - W + 1`` (and the page before ``q``, which a hit needs even if W = 1),
        where ``q`` is the first position of the page holding the last token, or the end
        of the sequence's cached chain if that is lower (where a hit stops: freed
        mid-prefill, or caching stopped), for the end of its request's prompt (the same
        prompt again; ``admit``'s ``num_prompt_tokens``, which a request readmitted after
        preemption gives) and for its own end (a continuation).
        Those of the prompt's end become the most recently freed, tail first, then those
        of the sequence's end behind them; the sequence's other pages stay where they are
        in the LRU (released ones as ``release_before`` left them; held ones freed tail
        first, before them).
        """
        s = self._get(seq_id)
        del self._seqs[seq_id]
        self._reserving.pop(seq_id, None)
        self._pool.decref(reversed(s.pages[s.released :]))
        if self.sliding_window is not None:
            self._pool.refresh(self._last_windows(s))
        elif s.released:
            # release_before freed the head first: evicting it would uncache the whole
            # chain, so the chain's pages are freed again, tail first, as a full one is.
            self._pool.refresh(self._prefix.chain_pages(s.chain.node))
        self._prefix.let_go(s.chain)
        self._freed[seq_id] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)

    def release_before(self, seq_id: Hashable, position: int) -> int:
        """Gives back the sequence's pages that hold only positions below ``position``.

        For sliding-window attention: once ``num_computed_tokens`` is ``c``, every later
        query sits at ``>= c`` and sees keys ``> c - W``, so the engine calls this with
        ``c - W + 1``. Pages go as in ``free`` (refcount down; shared pages stay with their
        other holders, cached ones become evictable); their entries then read -1 in
        ``page_table`` and ``PAD_PAGE`` in ``page_tables``. The last page is always kept.

        Args:
            seq_id: a live sequence.
            position: the lowest position still read, in ``[0, num_computed_tokens]``.

        Returns:
            Pages released by this call (tail first, as in ``free``); 0 if none.

        Raises:
            InvalidArgument: ``position`` is out of range; nothing changed.
        """
        s = self._get(seq_id)
        pos = as_int(position, "position")
        if not 0 <= pos <= s.num_computed:
            raise InvalidArgument(
                f"position={pos} for sequence {seq_id!r} must be in [0, {s.num_computed}] "
                "(its computed tokens)"
            )
        start, end = s.released, min(pos // self.page_size, len(s.pages) - 1)
        if end <= start:
            return 0
        self._pool.decref(reversed(s.pages[start:end]))
        s.release(end)
        return end - start

    def free_all(self) -> int:
        """Frees every live sequence (recovery after a failed engine step); returns how
        many. Their cached pages stay cached (evictable), as with ``free``."""
        ids = list(self._seqs)
        for sid in ids:
            self.free(sid)
        return len(ids)

    # --------------------------------------------------------------- internals

    def _get(self, seq_id: Hashable) -> SeqPages:
        s = self._seqs.get(seq_id)
        if s is None:
            if seq_id in self._freed:
                raise SequenceFreed(f"sequence {seq_id!r} was already freed")
            raise UnknownSequence(f"unknown sequence {seq_id!r}")
        return s

    def _last_windows(self, s: SeqPages) -> list[int]:
        """The cached pages ``free`` renews for a windowed sequence: those in the window of
        its prompt's end, then those in the window of its own end, each tail first."""
        ps, w, k, num_prompt = self.page_size, self.sliding_window, s.chain.num_pages, s.num_prompt

        def first(end: int) -> int:  # lowest page a hit at the end reads
            # The hit stops at the chain's end where that is lower (freed mid-prefill,
            # caching stopped); it needs its last page even where W = 1 reads none of it
            # (PrefixCache.lookup).
            h = min((end - 1) // ps, k)
            return min(max(h * ps - w + 1, 0) // ps, max(h - 1, 0))

        lo_prompt, lo_end = first(num_prompt), first(s.num_tokens)  # lo_prompt <= lo_end
        # tail[j] holds logical page k - 1 - j (-1: a stub, not cached).
        tail = self._prefix.chain_tail(s.chain.node, max(k - lo_prompt, 0))
        prompt = tail[max(k - 1 - (num_prompt - 1) // ps, 0) :]
        return [p for p in prompt + tail[: max(k - lo_end, 0)] if p >= 0]

    def _append_plan(self, seq_ids: Sequence[Hashable]) -> tuple[list[SeqPages], int]:
        """Validates an append batch; returns its sequences and the pages it allocates."""
        get = self._seqs.get
        seqs = [get(sid) or self._get(sid) for sid in id_batch(seq_ids)]
        rc = self._pool.refcount
        return seqs, append_pages_needed(seq_ids, seqs, self.page_size, rc, self.max_model_len)

    def _reservation(self) -> tuple[int, set[int]]:
        """``(num_reserved_pages, the pages only reserving sequences hold)``."""
        if not self._reserving:
            return 0, set()
        seqs, rc = self._reserving.values(), self._pool.refcount
        held = collections.Counter(p for s in seqs for p in s.pages[s.released :])
        only = {p for p, c in held.items() if c == rc[p]}
        return sum(s.peak for s in seqs) - len(only), only

    # The pool's state under the names tests and debugging sessions read (and poke).
    @property
    def _free(self) -> list[int]:
        return self._pool.free

    @property
    def _evictable(self) -> collections.OrderedDict[int, None]:
        return self._pool.evictable

    @property
    def _refcount(self) -> list[int]:
        return self._pool.refcount
