"""The page pool: where each physical KV page is, how many sequences hold it, allocation.

Host-side plain Python, owned by the ``BlockManager`` (``pagedjax.blocks``), which knows
the sequences; the pool knows only pages. Each of the ``num_pages`` pages is in exactly one
place: the free list (unreferenced, holding nothing cached), the evictable LRU
(unreferenced but still registered in the ``PrefixCache``, so a later prompt can reuse its
K/V) or in use (``refcount`` > 0: that many page tables hold it).

Allocation pops the free list (page 0 first) and only when it is empty evicts the least
recently freed cached page; evicting a page uncaches the pages cached under it (unless a
duplicate in use takes its registration over, or the cache is a sliding-window model's,
which keeps them: ``PrefixCache.evict``), and those no one holds become plain free pages.
Freed cached pages enter the LRU in the order given (the manager frees a sequence tail
first, so a shared prefix's head lives longest; ``refresh`` moves the head a sliding window
gave back early behind the tail; a windowed manager renews only the pages in the window of
the prompt's end and of the sequence's end: ``SeqTables.free``). Callers check
``num_free`` before they allocate: nothing here raises ``OutOfPages``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from pagedjax.prefix_cache import PrefixCache, Require

__all__ = ["PagePool"]


class PagePool:
    """Free list, evictable LRU and refcounts of ``num_pages`` pages.

    Args:
        num_pages: physical pages in the device cache (all usable).
        prefix: the prefix cache whose registered pages are kept evictable when freed.

    Attributes:
        free: unreferenced, uncached pages; a stack (pops page 0 first).
        evictable: unreferenced cached pages, least recently freed first.
        refcount: ``[num_pages]`` page tables holding each page.
        evictions: cached pages evicted to allocate, over the pool's life.
    """

    def __init__(self, num_pages: int, prefix: PrefixCache):
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # stack: pops page 0 first
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.refcount = [0] * num_pages
        self.evictions = 0
        self._prefix = prefix

    @property
    def num_free(self) -> int:
        """Pages allocatable now: free plus evictable cached pages."""
        return len(self.free) + len(self.evictable)

    def alloc(self) -> int:
        """Takes a page (refcount 1): a free one, else the least recently freed cached one."""
        if self.free:
            p = self.free.pop()
        else:  # callers checked num_free, so the LRU is not empty
            p, _ = self.evictable.popitem(last=False)
            for q in self._prefix.evict(p):
                if self.refcount[q] == 0:  # an orphaned cached page is plain free
                    del self.evictable[q]
                    self.free.append(q)
            self.evictions += 1
        self.refcount[p] = 1
        return p

    def take(self, pages: Iterable[int]) -> None:
        """Adds one reference to each of these cached pages (prefix hits); an evictable one
        leaves the LRU."""
        rc = self.refcount
        for p in pages:
            if rc[p] == 0:
                del self.evictable[p]
            rc[p] += 1

    def share(self, pages: Iterable[int]) -> None:
        """Adds one reference to each of these pages in use (a fork)."""
        rc = self.refcount
        for p in pages:
            rc[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page; unreferenced ones become evictable (cached)
        or free, in the order given."""
        rc, entry = self.refcount, self._prefix.entries
        for p in pages:
            rc[p] -= 1
            if rc[p] == 0:
                if entry[p] is not None:
                    self.evictable[p] = None
                else:
                    self._prefix.release(p)  # (a duplicate of cached content no more)
                    self.free.append(p)

    def refresh(self, pages: Iterable[int]) -> None:
        """Moves the evictable ones of these pages to the most recently freed end of the
        LRU, in the order given."""
        lru = self.evictable
        for p in pages:
            if p in lru:
                lru.move_to_end(p)

    def uncache(self, pages: Iterable[int]) -> int:
        """Uncaches these pages (those not cached are skipped) and every page cached under
        them; unreferenced ones become plain free pages. Returns how many were uncached."""
        entries, rc, n = self._prefix.entries, self.refcount, 0
        for p in pages:
            if entries[p] is None:
                self._prefix.release(p)  # a duplicate's K/V is not there either
                continue
            for q in [p, *self._prefix.uncache(p)]:
                n += 1
                if rc[q] == 0:
                    del self.evictable[q]
                    self.free.append(q)
        return n

    def check_free_list(self, require: Require) -> None:
        """No page is twice in the free list."""
        require(
            len(set(self.free)) == len(self.free), f"a page is twice in the free list {self.free}"
        )

    def check_pages(self, holders: list[int], require: Require) -> None:
        """Every page is in exactly one of free/evictable/used, its refcount equals its
        ``holders`` (page-table occurrences), free pages are uncached, evictable ones
        cached, and every cached page is consistent in the prefix cache."""
        free, lru, rc, cache = set(self.free), self.evictable, self.refcount, self._prefix
        entries = cache.entries
        for p in range(self.num_pages):
            e = entries[p]
            where = (p in free) + (p in lru) + (rc[p] > 0)
            require(where == 1, f"page {p} is in {where} of free/evictable/used (rc={rc[p]})")
            require(rc[p] == holders[p], f"page {p}: refcount {rc[p]} != {holders[p]} holders")
            require(p not in free or e is None, f"free page {p} is still cached")
            require(p not in free or not cache.is_duplicate(p), f"free page {p} is a duplicate")
            require(p not in lru or e is not None, f"evictable page {p} is not cached")
            if e is not None:
                cache.check_page(p, require)
