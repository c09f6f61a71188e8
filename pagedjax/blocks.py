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
  already cached: a multiple of ``page_size`` and < ``len(token_ids)``, so that prefill
  computes the last token. Their K/V is on the device; prefill only the rest, then report
  progress with ``mark_computed``. With ``compute_last=False`` the caller computes what
  follows the prompt elsewhere (its next token fed as a decode row, e.g. by forked
  samples): every full page may be a hit, and a prompt cached whole comes computed
  (``len(token_ids)`` returned; ready to ``fork`` and append at once).
- ``admit(..., peak_pages=R)`` allocates only the cached pages (those in the ``window``)
  and the next token's page, and reserves R pages: ``grow`` then allocates out of them as
  prefill reaches further tokens, holding at most R pages at once, until the prompt is
  computed (a prompt that comes computed reserves nothing). ``num_reserved_pages`` of the
  free pages are promised this way; no other allocation takes them.
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
(``pagedjax.prefix_cache``, whose docstring has the details: salted SHA-256 hash chains
(``pagedjax.page_hashes``, which also keeps a waiting sequence's page hashes),
every hit verified against the stored token ids, so requests with different salts never
share a page and a colliding hash cannot reuse a wrong page). Freed cached pages stay
findable in an LRU (freed tail-first, so a shared prefix's head lives longest; knowing a
sliding window, the pages in the window of the prompt's end and of the sequence's end
live longest: ``free``) until allocation evicts them; evicting a page uncaches the pages
cached under it, unless another page in use holds the same content (computed twice): the
registration moves onto it.

Sliding window: ``release_before`` gives back the pages of a live sequence that no later
query can see, as ``free`` would; ``admit(..., window=W)`` does not take the cached pages
below the first token's window. Their entries read ``PAD_PAGE`` (the page-table padding)
in ``page_tables``, a valid page that the window masks; freeing, forking, caching and
``slot_mapping`` skip or refuse them. A manager that knows the model's window
(``sliding_window``, which the ``Scheduler`` sets) makes prefix hits independent of the
pages below it, as vLLM's sliding-window manager does: evicting a page keeps the pages
cached under it, and ``admit(..., window=W)`` hits the longest cached prefix whose pages
in the first token's window are cached, whether or not those below it still are (the
chain stays verified from the root: ``pagedjax.prefix_cache``); a live sequence's chain
goes on through an evicted page it ends at (with W <= ``page_size`` it gives that page
back before the next one fills), so its later pages are still cached. Without it, and
always for full attention, a hit is a run of cached pages from the first.

Modules: ``BlockManager`` (here: admission with the watermark and reservations,
``uncache``, stats, invariant checks) is a ``SeqTables`` (``pagedjax.seq_tables``: the live
sequences and every other call on their pages: page tables, slot mapping, ``grow``,
``mark_computed``, appends, ``fork``, ``release_before``, ``free``). Beneath them: one
``SeqPages`` record per live sequence (``pagedjax.seq_pages``: its page table, tokens and
progress; the copy-on-write append), the ``PagePool`` (``pagedjax.page_pool``: free list,
evictable LRU, refcounts, allocation and eviction) and the ``PrefixCache``.
"""

from __future__ import annotations

import dataclasses
import numbers
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
from pagedjax.page_hashes import HashedPrompt, PageHashes, salt_bytes
from pagedjax.page_pool import PagePool
from pagedjax.prefix_cache import PrefixCache
from pagedjax.seq_pages import PAD_PAGE, SeqPages  # PAD_PAGE re-exported
from pagedjax.seq_tables import SeqTables, as_int, token_array

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


def _positive_int(value, name: str, allowed: str = "") -> int:
    """``value`` (a Python or numpy integer >= 1) as an int; else InvalidArgument."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgument(f"{name} must be {allowed}a positive int, got {name}={value!r}")
    return int(value)


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


class BlockManager(SeqTables):
    """Owns the page pool: free list, refcounts, copy-on-write, prefix cache.

    Args:
        num_pages: physical pages in the device cache (all usable).
        page_size: token slots per page.
        enable_prefix_caching: register full computed pages and reuse them on admit.
        max_model_len: longest sequence (prompt plus output) in tokens; None: unbounded.
        watermark: fraction of pages ``can_admit`` keeps free for running sequences.
        sliding_window: the model's window W (every layer), or None (full attention);
            see ``set_sliding_window``.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        watermark: float = 0.01,
        sliding_window: int | None = None,
    ):
        num_pages = _positive_int(num_pages, "num_pages")
        page_size = _positive_int(page_size, "page_size")
        if max_model_len is not None:
            max_model_len = _positive_int(max_model_len, "max_model_len")
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise InvalidArgument(
                f"enable_prefix_caching must be a bool, got {enable_prefix_caching=}"
            )
        if num_pages * page_size >= 2**31:
            raise InvalidArgument(f"{num_pages=} * {page_size=} slots overflow int32 slot ids")
        w = watermark
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Real) or not 0 <= w < 1:
            raise InvalidArgument(f"watermark must be in [0, 1), got {watermark=}")
        prefix = PrefixCache(num_pages, page_size, enabled=bool(enable_prefix_caching))
        super().__init__(page_size, max_model_len, prefix, PagePool(num_pages, prefix))
        self.num_pages = num_pages
        self.watermark_pages = int(watermark * num_pages)
        self._max_pages_per_seq = None if max_model_len is None else -(-max_model_len // page_size)
        self._prefix_queries = self._prefix_hits = 0
        self.sliding_window: int | None = None
        self.set_sliding_window(sliding_window)

    # ---------------------------------------------------------------- queries

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full computed pages are cached and reused on admit (fixed at init)."""
        return self._prefix.enabled

    def can_admit(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt fits while leaving the watermark of pages free.

        Conservative: ignores prefix-cache hits, so True also means ``admit`` will not
        raise ``OutOfPages`` (unless other allocations happen in between).

        Raises:
            InvalidArgument: a prompt ``admit`` refuses whatever the free pages (empty,
                or longer than ``max_model_len``), as ``admit`` would.
        """
        n = as_int(num_prompt_tokens, "num_prompt_tokens")
        self._check_prompt_len(n)
        free = self.num_free_pages - self.num_reserved_pages
        return free - (-(-n // self.page_size)) >= self.watermark_pages

    def admit_pages(
        self,
        prompts: list[tuple[Sequence[int] | np.ndarray | HashedPrompt, bool]],
        cache_salt=None,
        *,
        read_cache: bool = True,
    ) -> int:
        """Free pages ``admit`` calls of these prompts, one after another in one step,
        take (no window): ``(token_ids, compute_last)`` each, with one salt. A prompt
        given as a ``HashedPrompt`` (a sequence's ``PageHashes``, kept across calls) is
        not hashed again: a request waiting for pages is counted every step.

        Prompts admitted together share pages only through the prefix cache (none finds
        another's new pages, which are not computed yet): each takes a new page for each
        of its pages that is not a hit, and a hit takes a free page only while no one
        holds it (evictable) or only sequences admitted with ``peak_pages`` hold it (it
        leaves their reservations, as ``admit`` counts it), once however many prompts hit
        it. One prompt's allocations may evict a later one's hit, which then takes a new
        page at the same cost: the count is never short.
        """
        ps, salt, rc = self.page_size, salt_bytes(cache_salt), self._pool.refcount
        only = self._reservation()[1]
        new, taken = 0, set()
        for tokens, compute_last in prompts:
            n = len(tokens)
            max_hits = (n - bool(compute_last)) // ps if read_cache else 0
            if isinstance(tokens, HashedPrompt):
                key = self._hashes(tokens, salt)
            else:
                key = token_array(tokens, "token_ids").tobytes()
            hits, _ = self._prefix.lookup(key, salt, max_hits)
            new += -(-n // ps) - len(hits)
            taken.update(p for p in hits if rc[p] == 0 or p in only)
        return new + len(taken)

    def stats(self) -> BlockStats:
        """Counters and page usage; see ``BlockStats``."""
        pool = self._pool
        used = self.num_pages - len(pool.free) - len(pool.evictable)
        q = self._prefix_queries
        return BlockStats(
            num_pages=self.num_pages,
            num_free_pages=len(pool.free),
            num_evictable_pages=len(pool.evictable),
            num_used_pages=used,
            num_cached_pages=len(self._prefix),
            num_seqs=len(self._seqs),
            kv_usage=used / self.num_pages,
            prefix_queries=q,
            prefix_hits=self._prefix_hits,
            prefix_hit_rate=self._prefix_hits / q if q else 0.0,
            evictions=pool.evictions,
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
        holds at most its peak, and the reservations fit in the free pages; the prefix
        cache holds exactly the live sequences' chains.
        """

        def require(ok: bool, msg: str) -> None:
            if not ok:
                raise InvariantViolation(msg)

        self._pool.check_free_list(require)
        holders = [0] * self.num_pages
        for sid, s in self._seqs.items():
            s.check(sid, self.page_size, sid in self._reserving, self._prefix, require)
            for p in s.pages[s.released :]:
                holders[p] += 1
        self._pool.check_pages(holders, require)
        self._prefix.check_index(require)
        self._prefix.check_held((s.chain for s in self._seqs.values()), require)
        reserved = self.num_reserved_pages
        require(self._reserving.keys() <= self._seqs.keys(), "a reserving sequence is not live")
        require(reserved <= self.num_free_pages, f"{reserved} pages reserved, fewer free")

    # --------------------------------------------------------------- mutation

    def set_sliding_window(self, window: int | None) -> None:
        """Tells the manager the model's sliding window W (None: full attention).

        With a window, evicting a cached page keeps the pages cached under it, and
        ``admit(..., window=W)`` hits a prefix whose pages below the first token's window
        were evicted (module docstring). ``admit`` still takes its window as an argument.

        Raises:
            InvalidArgument: ``window`` is not None or a positive int, or it is None while
                the cache keeps pages under evicted content (they would outlive it).
        """
        if window is not None:
            window = _positive_int(window, "window", "None or ")
        elif self._prefix.num_stubs:
            raise InvalidArgument(
                f"cannot drop the sliding window: {self._prefix.num_stubs} evicted pages "
                "have pages cached under them"
            )
        self.sliding_window = window
        self._prefix.windowed = window is not None

    def admit(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int] | np.ndarray,
        *,
        cache_salt: str | bytes | None = None,
        read_cache: bool = True,
        peak_pages: int | None = None,
        window: int | None = None,
        compute_last: bool = True,
        count_stats: bool = True,
        num_prompt_tokens: int | None = None,
    ) -> int:
        """Allocates pages for the prompt, reusing cached full prefix pages.

        Args:
            seq_id: a new (not live) sequence id; a freed id may be readmitted.
            token_ids: the prompt, ``[T]`` non-negative ints, 1 <= T <= max_model_len; or
                a ``HashedPrompt`` (``pagedjax.page_hashes``): the first T tokens of a
                list with its ``PageHashes``, kept by the caller, so that the pages hashed
                already (``admit_pages`` while it waited) are not hashed again. Its hashed
                tokens must be the prompt's (a list edited in place since is refused).
            cache_salt: requests share cached pages only with requests of equal salt.
            read_cache: reuse cached pages (False: compute the whole prompt; its full
                pages are still registered for later requests).
            peak_pages: None: pages for every prompt token. R: pages for the cached tokens
                and the first one to compute only, and R pages reserved, out of which
                ``grow`` allocates; until its prompt is computed the sequence holds at most
                R pages at once (``release_before`` makes room).
            window: sliding window W: cached pages below the first token's window (all
                their positions < ``cached - W + 1``) are not taken; they read as released
                (a prompt cached whole keeps its last page, as ``release_before`` would).
                With ``sliding_window`` set, the hit needs only the pages in that window
                to be cached (those below may have been evicted).
            compute_last: True: prefill computes at least the last prompt token (whose
                logits sample the next one), so the page holding it is never a hit. False:
                the caller computes the token after the prompt elsewhere (a decode row
                feeds it), so every full page may be a hit; a prompt cached whole comes
                computed, holding its cached pages only and reserving nothing.
            count_stats: count the tokens and hits in ``stats()``'s prefix queries and
                hits (False for a preempted request coming back, as vLLM keeps those
                out of its prefix-cache counters: they would count its own pages). An
                admission that does not read the cache (``read_cache=False``, or
                caching off) is no query either, as in vLLM: its tokens are no misses.
            num_prompt_tokens: the request's prompt length P, 1 <= P <= T (None: T). A
                manager that knows the model's window keeps, when the sequence is freed,
                the cached pages in the window of the prompt's end (``free``): a request
                preempted and readmitted with its output so far names its own prompt here,
                not the readmitted length.

        Returns:
            Leading prompt tokens whose K/V is already cached (a multiple of
            ``page_size``; < T, or <= T with ``compute_last=False``). Prefill starts
            there; T: nothing to prefill.

        Raises:
            OutOfPages: not enough unreserved pages; nothing changed.
            InvalidArgument: a bad argument (page hashes of other tokens or another
                salt), or the admission alone would hold more than ``peak_pages``.
        """
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} is already live")
        if not isinstance(read_cache, (bool, np.bool_)):
            raise InvalidArgument(f"read_cache must be a bool, got {read_cache=}")
        if not isinstance(compute_last, (bool, np.bool_)):
            raise InvalidArgument(f"compute_last must be a bool, got {compute_last=}")
        if not isinstance(count_stats, (bool, np.bool_)):
            raise InvalidArgument(f"count_stats must be a bool, got {count_stats=}")
        if peak_pages is not None:
            peak_pages = _positive_int(peak_pages, "peak_pages", "None or ")
        if window is not None:
            window = _positive_int(window, "window", "None or ")
        hashes = None
        if isinstance(token_ids, HashedPrompt):  # (its tokens checked below)
            hashes = self._hashes(token_ids, salt_bytes(cache_salt))
            token_ids = hashes.source[: token_ids.num_tokens]
        toks = token_array(token_ids, "token_ids")
        n = toks.shape[0]
        self._check_prompt_len(n)
        num_prompt = (
            n if num_prompt_tokens is None else as_int(num_prompt_tokens, "num_prompt_tokens")
        )
        if not 1 <= num_prompt <= n:
            raise InvalidArgument(
                f"num_prompt_tokens must be None or an int in [1, {n}] (the admitted tokens), "
                f"got {num_prompt_tokens=}"
            )
        buf, ps, rc = toks.tobytes(), self.page_size, self._pool.refcount
        # Unless the caller computes what follows, at least the last token is left to
        # compute here, so the page holding it is never a hit.
        max_hits = (n - bool(compute_last)) // ps if read_cache else 0
        if hashes is not None and max_hits:
            _check_hashed(hashes, buf)
        key = buf if hashes is None or not max_hits else hashes
        hits, chain = self._prefix.lookup(key, salt_bytes(cache_salt), max_hits, window=window)
        cached = len(hits) * ps
        done = cached == n  # cached whole (compute_last=False): nothing to prefill
        # Keep the last page, as release_before does, even where no query reads it (W = 1).
        r = min(max(cached - window + 1, 0) // ps, len(hits) - done) if window else 0
        kept = hits[r:]
        reserved, only = self._reservation()
        if peak_pages is None or done:
            num_new = -(-n // ps) - len(hits)
            # A hit on a page only reserving sequences hold takes it out of their reservations.
            need = num_new + sum(p in only for p in kept)
            available = self.num_free_pages - sum(rc[p] == 0 for p in kept) - reserved
        else:
            num_new, need, available = 1, peak_pages, self.num_free_pages - reserved
        if peak_pages is not None and len(kept) + num_new > peak_pages:
            raise InvalidArgument(
                f"admitting {seq_id!r} holds {len(kept) + num_new} pages, more than {peak_pages=}"
            )
        if need > available:
            what = f"admitting {n} tokens of {seq_id!r}"
            raise OutOfPages(need, available, what, reserved=reserved)
        self._pool.take(kept)
        if self.sliding_window is None:
            # The hits below the window stay evictable, but they are the chain's parents:
            # evicting one uncaches what this admission just took. Renewed first (the head
            # last, so it is evicted last), its own allocation evicts others before them.
            # (Knowing the window, eviction keeps what is cached under a page.)
            self._pool.refresh(reversed(hits[:r]))
        pages = [-1] * r + kept + [self._pool.alloc() for _ in range(num_new)]
        capacity = self._max_pages_per_seq or max(4, 2 * len(pages))
        seq = SeqPages.admitted(pages, r, capacity, buf, n, cached, chain, num_prompt)
        self._prefix.hold(chain)
        self._seqs[seq_id] = seq
        if peak_pages is not None and not done:
            seq.peak = peak_pages
            self._reserving[seq_id] = seq
        self._freed.pop(seq_id, None)
        if count_stats and read_cache and self.enable_prefix_caching:
            self._prefix_queries += n
            self._prefix_hits += cached
        return cached

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
            todo = [as_int(p, f"pages[{i}]") for i, p in enumerate(pages)]
            bad = [p for p in todo if not 0 <= p < self.num_pages]
            if bad:
                raise InvalidArgument(f"pages {bad[:5]} are outside [0, {self.num_pages})")
        return self._pool.uncache(todo)

    def stop_caching(self) -> int:
        """Registers no further page of the sequences held now, for good: their K/V was
        computed by weights that are no longer the model's (`LLM.update_params` while
        requests keep their pages), so the pages they fill from here on hold K/V no new
        request may reuse. Pages they already registered stay cached; ``uncache`` them.

        Returns:
            How many sequences would have gone on caching.
        """
        n = 0
        for s in self._seqs.values():
            n += s.chain.hash is not None
            self._prefix.stop(s.chain)
        return n

    # --------------------------------------------------------------- internals

    def _hashes(self, prompt: HashedPrompt, salt: bytes) -> PageHashes:
        """A ``HashedPrompt``'s page hashes, checked against its salt and page size."""
        ph = prompt.hashes
        if not isinstance(ph, PageHashes) or not isinstance(ph.source, list):
            raise InvalidArgument(f"a HashedPrompt needs PageHashes of a list, got {ph!r:.80}")
        if ph.salt != salt or ph.page_size != self.page_size:
            raise InvalidArgument(
                f"page hashes of salt {ph.salt!r:.40} and page size {ph.page_size} given for "
                f"salt {salt!r:.40} and page size {self.page_size}"
            )
        if not 0 <= prompt.num_tokens <= len(ph.source):
            raise InvalidArgument(
                f"a HashedPrompt of {prompt.num_tokens} tokens of a list of {len(ph.source)}"
            )
        return ph

    def _check_prompt_len(self, n: int) -> None:
        if n < 1:
            raise InvalidArgument(f"a prompt needs at least one token, got {n}")
        if self.max_model_len is not None and n > self.max_model_len:
            raise InvalidArgument(
                f"prompt of {n} tokens exceeds max_model_len={self.max_model_len}"
            )


def _check_hashed(ph: PageHashes, buf: bytes) -> None:
    """Refuses page hashes whose hashed tokens are not the prompt's (``buf``, its token
    bytes): kept for a list that was edited in place since, they must never be trusted."""
    m = min(len(buf), len(ph.tokens))
    if buf[:m] != ph.tokens[:m]:
        raise InvalidArgument(
            "page hashes kept for a token list that was changed in place since they were "
            "computed: make new ones (PageHashes) for the new tokens"
        )
