"""Host-side block manager: which physical KV page belongs to which sequence.

Plain Python and numpy; never touches a jax array. The device cache is a pool of
``num_pages`` pages of ``page_size`` token slots each (every page id is usable). Token
position ``pos`` of a sequence lives at slot
``page_table[pos // page_size] * page_size + pos % page_size``.

Life of a sequence, as the engine drives it::

    bm = BlockManager(num_pages, page_size, max_model_len=4096)
    if bm.can_admit(len(prompt)):                      # free-page watermark check
        cached = bm.admit(seq, prompt, cache_salt=salt)  # pages for ALL prompt tokens
    # prefill chunk [start, end), start >= cached:
    slots = bm.slot_mapping(seq, start, end)         # [T] int32 device write slots
    bm.mark_computed(seq, end)                       # K/V of tokens < end written or being
                                                     # written this step; full pages get cached
    # decode, one token per running sequence (batched):
    slots, copies = bm.append_tokens(seqs, tokens)   # [B] int32, [(src, dst)] page copies
    tables = bm.page_tables(seqs)                    # [B, max_pages] int32
    bm.fork(seq, child)                              # n > 1 sampling, beam search
    bm.release_before(seq, computed - window + 1)    # sliding window: drop unreachable pages
    # sliding window, pages as prefill reaches them (R pages reserved, at most R held):
    cached = bm.admit(seq, prompt, peak_pages=R, window=W)
    bm.grow(seq, end)                                # before slot_mapping(seq, start, end)
    bm.free(seq)                                     # finished, aborted or preempted

Contract:

- Every mutating call is all-or-nothing: on any exception the state (stats included)
  is exactly as before. Running out of pages raises ``OutOfPages``; preempt and retry.
- ``admit`` allocates pages for the whole prompt and returns how many leading tokens are
  already cached: a multiple of ``page_size`` and always < ``len(token_ids)``. Their K/V is
  on the device; prefill only the rest, then report progress with ``mark_computed``.
- ``admit(..., peak_pages=R)`` allocates only the cached pages (those in the ``window``)
  and the next token's page, and reserves R pages: ``grow`` then allocates out of them as
  prefill reaches further tokens, holding at most R pages at once, until the prompt is
  computed. ``num_reserved_pages`` of the free pages are promised this way; no other
  allocation takes them.
- ``append_token(s)`` feeds the token at position ``num_tokens`` (the token sampled last
  step) and counts it as computed at once: the step that writes it runs before anything
  can attend to it. Appending needs a fully computed sequence. The token's value may
  come later (``-1``: the device feeds it from the step that samples it; asynchronous
  scheduling): ``set_tokens`` gives it, and only then can its page be cached. A sequence
  holds at most one such token.
- Copies ``(src_page, dst_page)`` are copy-on-write page copies the device must execute
  before this step's writes. Page tables change on append (new page, copy-on-write) and
  nowhere else; re-read them after each append.
- ``fork`` needs a fully computed parent; the child shares every page.
- A prefix hit may name pages whose K/V is being written in the current step, so the
  device step must write a layer's new K/V before attention reads it.
- Errors (``pagedjax.errors``, re-exported here): ``OutOfPages``; ``UnknownSequence``
  (``SequenceFreed`` for double free or use after free); ``SequenceExists``;
  ``InvalidArgument`` (a ``ValueError``); ``InvalidState`` (e.g. append mid-prefill); all
  ``BlockManagerError``. A bad salt type, or a count or position that is not an int (a
  bool, a float), is a ``TypeError``.

Prefix cache: full, computed pages are registered in a ``PrefixCache``
(``pagedjax.prefix_cache``, whose docstring has the details: salted SHA-256 hash chains,
every hit verified against the stored token ids, so requests with different salts never
share a page and a colliding hash cannot reuse a wrong page). Freed cached pages stay
findable in an LRU (freed tail-first, so a shared prefix's head lives longest) until
allocation evicts them; evicting a page uncaches the pages cached under it.

Sliding window: ``release_before`` gives back the pages of a live sequence that no later
query can see, as ``free`` would; ``admit(..., window=W)`` does not take the cached pages
below the first token's window. Their entries read ``PAD_PAGE`` (the page-table padding)
in ``page_tables``, a valid page that the window masks; freeing, forking, caching and
``slot_mapping`` skip or refuse them.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import operator
import struct
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from pagedjax.errors import (  # re-exported: callers catch them as blocks.OutOfPages etc.
    BlockManagerError,
    InvalidArgument,
    InvalidState,
    InvariantViolation,
    OutOfPages,
    SequenceExists,
    SequenceFreed,
    UnknownSequence,
)
from pagedjax.prefix_cache import Chain, PrefixCache, salt_bytes

__all__ = [
    "BlockManager",
    "BlockManagerError",
    "BlockStats",
    "InvalidArgument",
    "InvalidState",
    "InvariantViolation",
    "OutOfPages",
    "PAD_PAGE",
    "SequenceExists",
    "SequenceFreed",
    "UnknownSequence",
]


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStats:
    """A snapshot of page usage and prefix-cache counters (tokens, not pages)."""

    num_pages: int
    num_free_pages: int  # unreferenced, holding nothing cached
    num_evictable_pages: int  # unreferenced, cached, reusable until evicted
    num_used_pages: int  # referenced by at least one sequence
    num_cached_pages: int  # registered in the prefix index (used or evictable)
    num_seqs: int
    kv_usage: float  # num_used_pages / num_pages
    prefix_queries: int  # prompt tokens admitted
    prefix_hits: int  # of those, tokens served from the prefix cache
    prefix_hit_rate: float
    evictions: int
    cow_copies: int


PAD_PAGE = 0  # page-table padding (as in the step inputs), also for released entries
_FREED_MEMORY = 4096  # freed ids remembered to tell "double free" from "unknown"
_pack_token = struct.Struct("<q").pack


def _token_array(token_ids, what: str, *, allow_unknown: bool = False) -> np.ndarray:
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


def _int(value, name: str) -> int:
    """``value`` as an int (Python or numpy integer); a bool or a float is a TypeError."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {name}={value!r} (a bool)")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an int, got {name}={value!r} ({type(value).__name__})"
        ) from None


def _ids(seq_ids, name: str = "seq_ids"):
    """Rejects one id (a str or bytes) passed where a batch of ids is expected."""
    if isinstance(seq_ids, (str, bytes)):
        raise InvalidArgument(f"{name} must be a sequence of ids, not the single id {seq_ids!r}")
    return seq_ids


@dataclasses.dataclass(slots=True)
class _Seq:
    pages: list[int]  # logical page -> physical page
    table: np.ndarray  # [capacity] int32, pages mirrored for fast page_tables()
    tokens: bytearray  # every token id, int64 little-endian
    num_tokens: int
    num_computed: int  # tokens whose K/V is on the device (or written this step)
    chain: Chain  # the prefix cache's position in this sequence (salt included)
    unknown: int = -1  # position of the token whose value is not known yet (-1: none)
    released: int = 0  # leading pages given back (window): -1 in pages, PAD_PAGE in table
    peak: int = 0  # admitted with peak_pages, prompt not computed: most pages held (else 0)


class BlockManager:
    """Owns the page pool: free list, refcounts, copy-on-write, prefix cache.

    Args:
        num_pages: physical pages in the device cache (all usable).
        page_size: token slots per page.
        enable_prefix_caching: register full computed pages and reuse them on admit.
        max_model_len: longest sequence (prompt plus output) in tokens; None: unbounded.
        watermark: fraction of pages ``can_admit`` keeps free for running sequences.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        watermark: float = 0.01,
    ):
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{name} must be a positive int, got {name}={value!r}")
        m = max_model_len
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise InvalidArgument(f"max_model_len must be a positive int, got {max_model_len=}")
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise InvalidArgument(
                f"enable_prefix_caching must be a bool, got {enable_prefix_caching=}"
            )
        if num_pages * page_size >= 2**31:
            raise InvalidArgument(f"{num_pages=} * {page_size=} slots overflow int32 slot ids")
        w = watermark
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Real) or not 0 <= w < 1:
            raise InvalidArgument(f"watermark must be in [0, 1), got {watermark=}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.watermark_pages = int(watermark * num_pages)
        self._max_pages_per_seq = None if max_model_len is None else -(-max_model_len // page_size)

        self._seqs: dict[Hashable, _Seq] = {}
        self._reserving: dict[Hashable, _Seq] = {}  # those with a peak (a reservation)
        self._freed: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # stack: pops page 0 first
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self._refcount = [0] * num_pages
        self._prefix = PrefixCache(num_pages, page_size, enabled=bool(enable_prefix_caching))
        self._prefix_queries = self._prefix_hits = self._evictions = self._cow_copies = 0

    # ---------------------------------------------------------------- queries

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full computed pages are cached and reused on admit (fixed at init)."""
        return self._prefix.enabled

    @property
    def num_free_pages(self) -> int:
        """Pages allocatable now: free plus evictable cached pages."""
        return len(self._free) + len(self._evictable)

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
        seqs = [get(sid) or self._get(sid) for sid in _ids(seq_ids)]
        lens = [len(s.pages) for s in seqs]
        longest = max(lens, default=0)
        width = longest if width is None else _int(width, "width")
        if width < longest:
            raise InvalidArgument(f"width={width} is less than the longest page table {longest}")
        if not -(2**31) <= _int(pad, "pad") < 2**31:
            raise InvalidArgument(f"pad={pad} does not fit in int32")
        out = np.full((len(seqs), width), pad, np.int32)
        for row, s, k in zip(out, seqs, lens, strict=True):
            row[:k] = s.table[:k]
        return out

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> np.ndarray:
        """Device slots of positions ``[start, end)``: ``[end - start]`` int32."""
        s, start, end = self._get(seq_id), _int(start, "start"), _int(end, "end")
        if not 0 <= start <= end <= s.num_tokens:
            raise InvalidArgument(
                f"slot range [{start}, {end}) of {seq_id!r} is outside [0, {s.num_tokens}]"
            )
        if start < min(end, s.released * self.page_size):
            raise InvalidArgument(
                f"slot range [{start}, {end}) of {seq_id!r} reaches its released pages "
                f"(positions < {s.released * self.page_size})"
            )
        if end > len(s.pages) * self.page_size:
            raise InvalidArgument(
                f"slot range [{start}, {end}) of {seq_id!r} reaches past its pages (positions "
                f"< {len(s.pages) * self.page_size}); grow it first"
            )
        pos = np.arange(start, end)
        ps = self.page_size
        return (s.table[pos // ps] * ps + pos % ps).astype(np.int32)

    def can_admit(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt fits while leaving the watermark of pages free.

        Conservative: ignores prefix-cache hits, so True also means ``admit`` will not
        raise ``OutOfPages`` (unless other allocations happen in between).
        """
        n = _int(num_prompt_tokens, "num_prompt_tokens")
        self._check_prompt_len(n)
        free = self.num_free_pages - self.num_reserved_pages
        return free - (-(-n // self.page_size)) >= self.watermark_pages

    def num_append_pages(self, seq_ids: Sequence[Hashable]) -> int:
        """Pages that ``append_tokens(seq_ids, ...)`` would allocate (new and copies)."""
        return self._append_plan(seq_ids)[1]

    def stats(self) -> BlockStats:
        """Counters and page usage; see ``BlockStats``."""
        used = self.num_pages - len(self._free) - len(self._evictable)
        q = self._prefix_queries
        return BlockStats(
            num_pages=self.num_pages,
            num_free_pages=len(self._free),
            num_evictable_pages=len(self._evictable),
            num_used_pages=used,
            num_cached_pages=len(self._prefix),
            num_seqs=len(self._seqs),
            kv_usage=used / self.num_pages,
            prefix_queries=q,
            prefix_hits=self._prefix_hits,
            prefix_hit_rate=self._prefix_hits / q if q else 0.0,
            evictions=self._evictions,
            cow_copies=self._cow_copies,
        )

    def check_invariants(self) -> None:
        """Checks all bookkeeping, O(pages + tokens); raises ``InvariantViolation``.

        Free + evictable + referenced pages == all pages, each in exactly one place;
        refcounts equal page-table occurrences; every registered page is indexed under
        the chain hash of its tokens and of a registered parent (same salt); every
        sequence's cached prefix pages hold exactly its tokens; released entries lead the
        page table, hold only computed positions, never the last page, and count nowhere;
        only a reserving sequence (``peak_pages``, prompt not computed) lacks pages, it
        holds at most its peak, and the reservations fit in the free pages.
        """

        def require(ok: bool, msg: str) -> None:
            if not ok:
                raise InvariantViolation(msg)

        ps, rc, cache = self.page_size, self._refcount, self._prefix
        free, lru, entries = set(self._free), self._evictable, cache.entries
        require(len(free) == len(self._free), f"a page is twice in the free list {self._free}")
        holders = [0] * self.num_pages
        for sid, s in self._seqs.items():
            k, r = len(s.pages), s.released
            held = s.pages[r:]
            require(0 <= r < k and r * ps <= s.num_computed, f"{sid!r}: released {r} of {k}")
            require(s.pages[:r] == [-1] * r and min(held) >= 0, f"{sid!r}: released {s.pages}")
            require(len(set(held)) == len(held), f"{sid!r} holds a page twice: {s.pages}")
            lo = -(-s.num_computed // ps) if s.peak else -(-s.num_tokens // ps)
            require(lo <= k <= -(-s.num_tokens // ps), f"{sid!r}: {k} pages, {s.num_tokens} tokens")
            require((sid in self._reserving) == (s.peak > 0), f"{sid!r}: stale reservation")
            require(not s.peak or s.num_computed < s.num_tokens, f"{sid!r}: reserves, computed")
            require(k - r <= s.peak or not s.peak, f"{sid!r} holds {k - r} > {s.peak} pages")
            table = s.table[:k].tolist()
            require(table == [PAD_PAGE] * r + held, f"{sid!r}: table mirror is stale")
            require(len(s.tokens) == 8 * s.num_tokens, f"{sid!r}: token buffer length")
            require(0 <= s.num_computed <= s.num_tokens, f"{sid!r}: num_computed out of range")
            require(-1 <= s.unknown < s.num_tokens, f"{sid!r}: unknown token out of range")
            for p in held:
                holders[p] += 1
            known = s.num_computed if s.unknown < 0 else min(s.num_computed, s.unknown)
            cache.check_chain(repr(sid), s.chain, s.pages, s.tokens, known, require)
        for p in range(self.num_pages):
            e = entries[p]
            where = (p in free) + (p in lru) + (rc[p] > 0)
            require(where == 1, f"page {p} is in {where} of free/evictable/used (rc={rc[p]})")
            require(rc[p] == holders[p], f"page {p}: refcount {rc[p]} != {holders[p]} holders")
            require(p not in free or e is None, f"free page {p} is still cached")
            require(p not in lru or e is not None, f"evictable page {p} is not cached")
            if e is not None:
                cache.check_page(p, require)
        cache.check_index(require)
        reserved = self.num_reserved_pages
        require(self._reserving.keys() <= self._seqs.keys(), "a reserving sequence is not live")
        require(reserved <= self.num_free_pages, f"{reserved} pages reserved, fewer free")

    # --------------------------------------------------------------- mutation

    def admit(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int] | np.ndarray,
        *,
        cache_salt: str | bytes | None = None,
        read_cache: bool = True,
        peak_pages: int | None = None,
        window: int | None = None,
    ) -> int:
        """Allocates pages for the prompt, reusing cached full prefix pages.

        Args:
            seq_id: a new (not live) sequence id; a freed id may be readmitted.
            token_ids: the prompt, ``[T]`` non-negative ints, 1 <= T <= max_model_len.
            cache_salt: requests share cached pages only with requests of equal salt.
            read_cache: reuse cached pages (False: compute the whole prompt; its full
                pages are still registered for later requests).
            peak_pages: None: pages for every prompt token. R: pages for the cached tokens
                and the first one to compute only, and R pages reserved, out of which
                ``grow`` allocates; until its prompt is computed the sequence holds at most
                R pages at once (``release_before`` makes room).
            window: sliding window W: cached pages below the first token's window (all
                their positions < ``cached - W + 1``) are not taken; they read as released.

        Returns:
            Leading prompt tokens whose K/V is already cached (a multiple of
            ``page_size``, < T). Prefill starts there.

        Raises:
            OutOfPages: not enough unreserved pages; nothing changed.
            InvalidArgument: a bad argument, or the admission alone would hold more than
                ``peak_pages``.
        """
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} is already live")
        if not isinstance(read_cache, (bool, np.bool_)):
            raise InvalidArgument(f"read_cache must be a bool, got {read_cache=}")
        for name, v in (("peak_pages", peak_pages), ("window", window)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidArgument(f"{name} must be None or a positive int, got {name}={v!r}")
        toks = _token_array(token_ids, "token_ids")
        n = toks.shape[0]
        self._check_prompt_len(n)
        buf, ps, rc = toks.tobytes(), self.page_size, self._refcount
        # At least one token is left to compute, so the last page is never a hit.
        max_hits = (n - 1) // ps if read_cache else 0
        hits, chain = self._prefix.lookup(buf, salt_bytes(cache_salt), max_hits)
        cached = len(hits) * ps
        r = max(cached - window + 1, 0) // ps if window else 0
        kept = hits[r:]
        reserved, only = self._reservation()
        if peak_pages is None:
            num_new = -(-n // ps) - len(hits)
            # A hit on a page only reserving sequences hold takes it out of their reservations.
            need = num_new + sum(p in only for p in kept)
            available = self.num_free_pages - sum(rc[p] == 0 for p in kept) - reserved
        else:
            num_new, need, available = 1, peak_pages, self.num_free_pages - reserved
            if len(kept) + 1 > peak_pages:
                raise InvalidArgument(
                    f"admitting {seq_id!r} holds {len(kept) + 1} pages, more than {peak_pages=}"
                )
        if need > available:
            what = f"admitting {n} tokens of {seq_id!r}"
            raise OutOfPages(need, available, what, reserved=reserved)
        for p in kept:
            if rc[p] == 0:
                del self._evictable[p]
            rc[p] += 1
        pages = [-1] * r + kept + [self._alloc() for _ in range(num_new)]
        table = np.full(self._max_pages_per_seq or max(4, 2 * len(pages)), PAD_PAGE, np.int32)
        table[r : len(pages)] = pages[r:]
        seq = _Seq(pages, table, bytearray(buf), n, cached, chain, released=r)
        self._seqs[seq_id] = seq
        if peak_pages is not None:
            seq.peak = peak_pages
            self._reserving[seq_id] = seq
        self._freed.pop(seq_id, None)
        self._prefix_queries += n
        self._prefix_hits += cached
        return cached

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
        n = _int(num_tokens, "num_tokens")
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
        s.pages += [self._alloc() for _ in range(need)]
        if k + need > s.table.shape[0]:
            s.table = np.concatenate([s.table, np.zeros(k + need, np.int32)])
        s.table[k : k + need] = s.pages[k:]
        return need

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Records that the K/V of the first ``num_computed_tokens`` tokens is on the device.

        Call it after scheduling (or running) each prefill chunk; pages that become full
        are registered in the prefix cache. Never decreases; at most ``num_tokens``.
        """
        s = self._get(seq_id)
        n = _int(num_computed_tokens, "num_computed_tokens")
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
        toks = _token_array(token_ids, "token_ids", allow_unknown=True)
        if toks.shape[0] != len(_ids(seq_ids)):
            raise InvalidArgument(f"{len(seq_ids)} seq_ids but {toks.shape[0]} token_ids")
        seqs, needed = self._append_plan(seq_ids)
        reserved = self.num_reserved_pages
        available = self.num_free_pages - reserved
        if needed > available:
            what = f"appending to {len(seq_ids)} sequences"
            raise OutOfPages(needed, available, what, reserved=reserved)

        ps, rc, alloc, pack = self.page_size, self._refcount, self._alloc, _pack_token
        register = self._prefix.register
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for s, t in zip(seqs, toks.tolist(), strict=True):
            n, pages = s.num_tokens, s.pages
            off = n % ps
            if off == 0:
                p = alloc()
                pages.append(p)
                if len(pages) > s.table.shape[0]:
                    s.table = np.concatenate([s.table, np.zeros_like(s.table)])
                s.table[len(pages) - 1] = p
            else:
                p = pages[-1]
                if rc[p] > 1:  # shared partial page: copy before writing into it
                    rc[p] -= 1
                    src, p = p, alloc()
                    pages[-1] = p
                    s.table[len(pages) - 1] = p
                    copies.append((src, p))
            s.tokens += pack(t)
            s.num_tokens = s.num_computed = n + 1
            if t < 0:
                s.unknown = n
            elif off == ps - 1 and s.chain.hash is not None:  # the page is full: cache it
                register(s.chain, pages, s.tokens, len(pages))
            slots.append(p * ps + off)
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
        toks = _token_array(token_ids, "token_ids")
        if toks.shape[0] != len(_ids(seq_ids)):
            raise InvalidArgument(f"{len(seq_ids)} seq_ids but {toks.shape[0]} token_ids")
        seqs = [self._get(sid) for sid in seq_ids]
        for sid, s in zip(seq_ids, seqs, strict=True):
            if s.unknown < 0:
                raise InvalidState(f"sequence {sid!r} has no token waiting for its value")
        if len(set(seq_ids)) != len(seq_ids):
            dup = next(k for k, c in collections.Counter(seq_ids).items() if c > 1)
            raise InvalidArgument(f"sequence {dup!r} appears twice in one set_tokens batch")
        ps, register = self.page_size, self._prefix.register
        for s, t in zip(seqs, toks.tolist(), strict=True):
            s.tokens[8 * s.unknown : 8 * s.unknown + 8] = _pack_token(t)
            s.unknown = -1
            full = s.num_computed // ps
            if s.chain.hash is not None and s.chain.num_pages < full:  # a page filled up
                register(s.chain, s.pages, s.tokens, full)

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
        rc = self._refcount
        for p in parent.pages[parent.released :]:
            rc[p] += 1
        self._seqs[child_id] = dataclasses.replace(
            parent,
            pages=list(parent.pages),
            table=parent.table.copy(),
            tokens=parent.tokens[:],
            chain=parent.chain.copy(),
        )
        self._freed.pop(child_id, None)

    def free(self, seq_id: Hashable) -> None:
        """Releases a finished, aborted or preempted sequence's pages.

        Unreferenced cached pages become evictable, tail first (a prefix's head is
        evicted last); the others return to the free list.
        """
        s = self._get(seq_id)
        del self._seqs[seq_id]
        self._reserving.pop(seq_id, None)
        self._decref(reversed(s.pages[s.released :]))
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
        pos = _int(position, "position")
        if not 0 <= pos <= s.num_computed:
            raise InvalidArgument(
                f"position={pos} for sequence {seq_id!r} must be in [0, {s.num_computed}] "
                "(its computed tokens)"
            )
        start, end = s.released, min(pos // self.page_size, len(s.pages) - 1)
        if end <= start:
            return 0
        self._decref(reversed(s.pages[start:end]))
        s.pages[start:end] = [-1] * (end - start)
        s.table[start:end] = PAD_PAGE
        s.released = end
        return end - start

    def free_all(self) -> int:
        """Frees every live sequence (recovery after a failed engine step); returns how
        many. Their cached pages stay cached (evictable), as with ``free``."""
        ids = list(self._seqs)
        for sid in ids:
            self.free(sid)
        return len(ids)

    def uncache(self, pages: Iterable[int] | None = None) -> int:
        """Forgets cached pages whose K/V is not on the device after all: ``pages`` (those
        not cached are skipped) and every page cached under them; None: every cached
        page (the device cache was re-created). Unreferenced ones become plain free pages.

        Returns:
            How many pages were uncached.
        """
        if pages is None:
            todo = range(self.num_pages)
        else:
            if not isinstance(pages, Iterable):
                raise TypeError(f"pages must be an iterable of page ids or None, got {pages!r}")
            todo = [_int(p, f"pages[{i}]") for i, p in enumerate(pages)]
            bad = [p for p in todo if not 0 <= p < self.num_pages]
            if bad:
                raise InvalidArgument(f"pages {bad[:5]} are outside [0, {self.num_pages})")
        entries, rc, n = self._prefix.entries, self._refcount, 0
        for p in todo:
            if entries[p] is None:
                continue
            for q in [p, *self._prefix.uncache(p)]:
                n += 1
                if rc[q] == 0:
                    del self._evictable[q]
                    self._free.append(q)
        return n

    # --------------------------------------------------------------- internals

    def _get(self, seq_id: Hashable) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            if seq_id in self._freed:
                raise SequenceFreed(f"sequence {seq_id!r} was already freed")
            raise UnknownSequence(f"unknown sequence {seq_id!r}")
        return s

    def _check_prompt_len(self, n: int) -> None:
        if n < 1:
            raise InvalidArgument(f"a prompt needs at least one token, got {n}")
        if self.max_model_len is not None and n > self.max_model_len:
            raise InvalidArgument(
                f"prompt of {n} tokens exceeds max_model_len={self.max_model_len}"
            )

    def _append_plan(self, seq_ids: Sequence[Hashable]) -> tuple[list[_Seq], int]:
        """Validates an append batch; returns its sequences and the pages it allocates."""
        ps, rc, limit, get = self.page_size, self._refcount, self.max_model_len, self._seqs.get
        needed = 0
        shared: dict[int, int] = {}  # shared partial last page -> batch members holding it
        seqs = [get(sid) or self._get(sid) for sid in _ids(seq_ids)]
        for sid, s in zip(seq_ids, seqs, strict=True):
            if s.num_computed != s.num_tokens:
                raise InvalidState(
                    f"cannot append to {sid!r} mid-prefill: {s.num_computed} of "
                    f"{s.num_tokens} tokens computed"
                )
            if limit is not None and s.num_tokens >= limit:
                raise InvalidArgument(f"sequence {sid!r} is at max_model_len={limit}")
            if s.unknown >= 0:
                raise InvalidState(
                    f"cannot append to {sid!r}: token {s.unknown} has no value yet (set_tokens)"
                )
            if s.num_tokens % ps == 0:
                needed += 1
            elif rc[s.pages[-1]] > 1:
                shared[s.pages[-1]] = shared.get(s.pages[-1], 0) + 1
        if len(set(seq_ids)) != len(seq_ids):
            dup = next(k for k, c in collections.Counter(seq_ids).items() if c > 1)
            raise InvalidArgument(f"sequence {dup!r} appears twice in one append batch")
        # The last holder of a shared page to write keeps it; every other one copies.
        for p, c in shared.items():
            needed += c - (c == rc[p])
        return seqs, needed

    def _reservation(self) -> tuple[int, set[int]]:
        """``(num_reserved_pages, the pages only reserving sequences hold)``."""
        if not self._reserving:
            return 0, set()
        seqs, rc = self._reserving.values(), self._refcount
        held = collections.Counter(p for s in seqs for p in s.pages[s.released :])
        only = {p for p, c in held.items() if c == rc[p]}
        return sum(s.peak for s in seqs) - len(only), only

    def _decref(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page; unreferenced ones become evictable (cached)
        or free, in the order given."""
        rc, entry = self._refcount, self._prefix.entries
        for p in pages:
            rc[p] -= 1
            if rc[p] == 0:
                if entry[p] is not None:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def _alloc(self) -> int:
        if self._free:
            p = self._free.pop()
        else:  # callers checked num_free_pages, so the LRU is not empty
            p, _ = self._evictable.popitem(last=False)
            for q in self._prefix.uncache(p):
                if self._refcount[q] == 0:  # an orphaned cached page is plain free
                    del self._evictable[q]
                    self._free.append(q)
            self._evictions += 1
        self._refcount[p] = 1
        return p
