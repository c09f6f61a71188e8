"""Automatic prefix caching: an index from page content to the physical page holding it.

Host-side and plain Python, like the ``BlockManager`` (``pagedjax.blocks``) that owns one
``PrefixCache`` and drives it. The index knows which content each cached page holds and
nothing about who holds a page: refcounts, the free list and the LRU of evictable
(unreferenced, still cached) pages are the block manager's.

A full, computed page is registered under a SHA-256 hash chained over the parent page's
hash and the page's token ids (int64 little-endian); the chain's root hashes the request's
``cache_salt``, so requests with different salts never share a page. A hit is trusted only
after comparing the stored token ids, the salt, and the parent's registration id (unique,
never reused), so even a colliding hash cannot reuse a wrong page; a collision met while
registering stops caching for that sequence. A page computed twice (two requests racing on
one prefix) keeps one copy registered and lets the duplicate's later pages chain onto it;
the duplicate is remembered while its sequence holds it, and evicting the registered copy
(``evict``) moves the registration onto it instead of forgetting the content: many
requests computing one shared prefix at once (a batch of prompts with one few-shot head)
keep it cached while any of them runs, as vLLM's block pool, which registers every copy,
does. Uncaching a page (evicting one without a duplicate, or ``uncache``: its K/V is not
on the device) unregisters the pages cached under it, so a chain never outlives its
parent.

Each sequence carries a ``Chain``: how many of its leading full pages were looked up or
registered, and the hash and registration id to chain its next page from::

    hits, chain = cache.lookup(prompt_bytes, salt, max_pages)  # reuse hits[i] for page i
    cache.register(chain, pages, token_bytes, num_full_pages)  # as pages fill up
    orphans = cache.evict(page)                                # to reuse the page
    cache.release(page)                                        # a page's last holder left
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

ROOT = 0  # registration id of the (per-salt) root of every hash chain

Require = Callable[[bool, str], None]  # check_* report through it: require(ok, message)


def _digest(data: bytes) -> bytes:
    """The prefix-cache hash (tests patch this to force collisions)."""
    return hashlib.sha256(data).digest()


def root_hash(salt: bytes) -> bytes:
    """The hash every chain with this (encoded) salt starts from."""
    return _digest(b"pagedjax.prefix.v1\x00" + salt)


def salt_bytes(cache_salt: str | bytes | None) -> bytes:
    """Encodes a request's ``cache_salt``; str and bytes of equal content stay distinct.

    Raises:
        TypeError: ``cache_salt`` is not str, bytes or None.
    """
    if cache_salt is None:
        return b"\x00"
    if isinstance(cache_salt, str):
        # surrogatepass: a lone surrogate (JSON "\ud800") is a valid str; strict UTF-8
        # refuses it. The encoding stays one-to-one (it decodes back the same way).
        return b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
    if isinstance(cache_salt, bytes):
        return b"\x02" + cache_salt
    raise TypeError(f"cache_salt must be str, bytes or None, got {type(cache_salt).__name__}")


@dataclasses.dataclass(slots=True)
class Entry:
    """A page registered in the prefix cache."""

    node: int  # registration id, unique for the cache's life
    hash: bytes  # _digest(parent_hash + tokens)
    parent_node: int  # registration id of the previous page's content (ROOT: none)
    parent_hash: bytes
    tokens: bytes  # the page's token ids, int64 little-endian
    salt: bytes


@dataclasses.dataclass(slots=True)
class Chain:
    """Where one sequence's hash chain stands."""

    salt: bytes  # salt_bytes(cache_salt)
    num_pages: int = 0  # leading full pages whose content was looked up or registered
    hash: bytes | None = None  # chain hash after num_pages pages; None: caching stopped
    node: int = ROOT  # registration id holding that content (ROOT before any page)

    def copy(self) -> Chain:
        """An independent copy, for a forked sequence (faster than dataclasses.replace)."""
        return Chain(self.salt, self.num_pages, self.hash, self.node)


class PrefixCache:
    """Chain hash -> page, for pages of ``page_size`` tokens out of ``num_pages``.

    Args:
        num_pages: physical pages (page ids are ``0 .. num_pages - 1``).
        page_size: token slots per page.
        enabled: False: ``lookup`` finds nothing and returns stopped chains, so nothing
            is ever registered.

    Attributes:
        entries: ``entries[page]`` is the page's registration, None if it is not cached.
            Read-only outside this class.
    """

    def __init__(self, num_pages: int, page_size: int, *, enabled: bool = True):
        self.page_size = page_size
        self.enabled = enabled
        self.entries: list[Entry | None] = [None] * num_pages
        self._page_bytes = page_size * 8
        self._index: dict[bytes, int] = {}  # chain hash -> page
        self._node_page: dict[int, int] = {}  # registration id -> page, while registered
        self._children: dict[int, set[int]] = {}  # registration id -> registered child pages
        # Duplicates: pages in use holding a registered content (computed twice), by its
        # registration id, and back.
        self._dups: dict[int, set[int]] = {}
        self._dup_node: dict[int, int] = {}
        self._next_node = 1

    def __len__(self) -> int:
        """Pages cached now."""
        return len(self._index)

    def lookup(self, tokens: bytes, salt: bytes, max_pages: int) -> tuple[list[int], Chain]:
        """The longest cached prefix of a prompt, verified page by page.

        Args:
            tokens: the prompt's token ids, int64 little-endian.
            salt: ``salt_bytes(cache_salt)`` of the request.
            max_pages: look at most this many leading full pages up.

        Returns:
            ``(pages, chain)``: the cached pages holding the prompt's first ``len(pages)``
            pages, and the prompt's chain positioned after them.
        """
        if not self.enabled:
            return [], Chain(salt)
        psb, index, entries = self._page_bytes, self._index, self.entries
        hits: list[int] = []
        last_hash, last_node = root_hash(salt), ROOT
        for i in range(max_pages):
            tb = tokens[i * psb : (i + 1) * psb]
            h = _digest(last_hash + tb)
            p = index.get(h)
            e = entries[p] if p is not None else None
            if e is None or e.tokens != tb or e.parent_node != last_node or e.salt != salt:
                break  # a miss, or a hash collision that must not be trusted
            hits.append(p)
            last_hash, last_node = h, e.node
        return hits, Chain(salt, len(hits), last_hash, last_node)

    def register(
        self, chain: Chain, pages: list[int], tokens: bytes | bytearray, num_full_pages: int
    ) -> None:
        """Caches a sequence's full pages ``chain.num_pages .. num_full_pages - 1``.

        A page whose content is cached already (computed twice) is not registered again:
        the chain continues from the cached copy. Caching stops for the sequence for good
        (``chain.hash = None``) when the content it chains from was uncached or a hash
        collides with other content.

        Args:
            chain: the sequence's chain, advanced in place.
            pages: the sequence's physical pages, logical order.
            tokens: the sequence's token ids, int64 little-endian.
            num_full_pages: leading pages that are full and computed.
        """
        psb, index, entries = self._page_bytes, self._index, self.entries
        while chain.hash is not None and chain.num_pages < num_full_pages:
            i = chain.num_pages
            if chain.node != ROOT and chain.node not in self._node_page:
                chain.hash = None  # the content we chain from was evicted
                return
            tb = bytes(tokens[i * psb : (i + 1) * psb])
            h = _digest(chain.hash + tb)
            q = index.get(h)
            if q is not None:  # computed twice (two requests raced on one prefix), or a collision
                e = entries[q]
                if e.tokens == tb and e.parent_node == chain.node and e.salt == chain.salt:
                    chain.num_pages, chain.hash, chain.node = i + 1, h, e.node
                    d = pages[i]
                    if d != q and entries[d] is None:  # (a fork's copy of a chain: q)
                        self._dups.setdefault(e.node, set()).add(d)
                        self._dup_node[d] = e.node
                else:  # never trust a collision: stop caching this sequence
                    chain.hash = None
                continue
            p, node = pages[i], self._next_node
            self._next_node += 1
            entries[p] = Entry(node, h, chain.node, chain.hash, tb, chain.salt)
            index[h] = p
            self._node_page[node] = p
            self._children.setdefault(chain.node, set()).add(p)
            chain.num_pages, chain.hash, chain.node = i + 1, h, node

    def chain_pages(self, node: int) -> list[int]:
        """The page registered as ``node`` and the pages its content is chained from,
        deepest first (empty if ``node`` is not registered)."""
        out, p = [], self._node_page.get(node)
        while p is not None:
            out.append(p)
            p = self._node_page.get(self.entries[p].parent_node)
        return out

    def evict(self, page: int) -> list[int]:
        """Takes a cached ``page`` out of the index for reuse: its registration moves onto
        a duplicate in use if there is one, else it is uncached (``uncache``).

        Returns:
            The pages uncached below ``page``.
        """
        dups = self._dups.get(self.entries[page].node)
        if not dups:
            return self.uncache(page)
        d = dups.pop()
        e = self.entries[page]
        if not dups:
            del self._dups[e.node]
        del self._dup_node[d]
        self.entries[d], self.entries[page] = e, None
        self._index[e.hash] = self._node_page[e.node] = d
        siblings = self._children[e.parent_node]
        siblings.discard(page)
        siblings.add(d)
        return []

    def is_duplicate(self, page: int) -> bool:
        """Whether ``page`` is known to duplicate a registered page (``evict``)."""
        return page in self._dup_node

    def release(self, page: int) -> None:
        """Forgets that an uncached ``page`` duplicates a registered one: its last holder
        let it go, or its K/V is not on the device after all."""
        node = self._dup_node.pop(page, None)
        if node is not None:
            dups = self._dups[node]
            dups.discard(page)
            if not dups:
                del self._dups[node]

    def uncache(self, page: int) -> list[int]:
        """Unregisters a cached ``page`` and every page cached under it (and forgets their
        duplicates: evicting the content means it is not wanted, or not on the device).

        Returns:
            The pages uncached below ``page``, in the order they were dropped.
        """
        entries, below = self.entries, []
        stack = [page]
        while stack:
            q = stack.pop()
            e, entries[q] = entries[q], None
            stack.extend(self._children.pop(e.node, ()))
            del self._index[e.hash], self._node_page[e.node]
            for d in self._dups.pop(e.node, ()):
                del self._dup_node[d]
            siblings = self._children.get(e.parent_node)
            if siblings is not None:
                siblings.discard(q)
            if q != page:
                below.append(q)
        return below

    # ------------------------------------------------------------------ checks

    def check_chain(
        self,
        name: str,
        chain: Chain,
        pages: list[int],
        tokens: bytes | bytearray,
        num_computed: int,
        require: Require,
    ) -> None:
        """Checks a sequence's chain: its cached pages hold its tokens, its hash is current.

        Args:
            name: the sequence, as messages should name it.
            chain, pages, tokens: the sequence's chain, physical pages (-1: a page released
                below a sliding window, which checks as uncached) and token bytes.
            num_computed: the sequence's computed tokens.
            require: called as ``require(ok, message)`` for every check.
        """
        ps, psb, entries = self.page_size, self._page_bytes, self.entries
        require(chain.num_pages <= num_computed // ps, f"{name}: hashed uncomputed pages")
        h = root_hash(chain.salt)
        for i, p in enumerate(pages):
            e = entries[p] if p >= 0 else None
            if i >= chain.num_pages:
                require(e is None, f"{name}: page {p} cached past its hashed prefix")
                continue
            tb = bytes(tokens[i * psb : (i + 1) * psb])
            h = _digest(h + tb)
            require(
                e is None or (e.hash == h and e.tokens == tb and e.salt == chain.salt),
                f"{name}: cached page {p} does not hold its tokens {i * ps}..{(i + 1) * ps}",
            )
        if chain.hash is not None:
            require(self.enabled, f"{name} hashes with caching off")
            require(chain.hash == h, f"{name}: stale chain hash")
            require(chain.num_pages == num_computed // ps, f"{name}: full pages unhashed")
            q = self._node_page.get(chain.node)
            require(q is None or entries[q].hash == h, f"{name}: chains from wrong content")

    def check_page(self, p: int, require: Require) -> None:
        """Checks cached page ``p``: indexed, hashed from its tokens and a registered parent."""
        e = self.entries[p]
        require(self._index.get(e.hash) == p, f"cached page {p} is not indexed")
        require(self._node_page.get(e.node) == p, f"page {p}: registration id lost")
        ok = len(e.tokens) == self._page_bytes and _digest(e.parent_hash + e.tokens) == e.hash
        require(ok, f"page {p}: hash does not match its tokens")
        if e.parent_node == ROOT:
            require(e.parent_hash == root_hash(e.salt), f"page {p}: wrong root hash")
        else:
            q = self._node_page.get(e.parent_node)
            require(q is not None, f"cached page {p} outlived its parent")
            pe = self.entries[q]
            require(pe.hash == e.parent_hash and pe.salt == e.salt, f"page {p}: bad parent")
        require(p in self._children.get(e.parent_node, ()), f"page {p} unknown to parent")

    def check_index(self, require: Require) -> None:
        """Checks that the index, registrations and child links count the same pages, and
        that every duplicate is an uncached page of registered content."""
        require(len(self._index) == len(self._node_page), "index and registrations disagree")
        dups = sum(len(d) for d in self._dups.values())
        require(dups == len(self._dup_node), f"{dups} duplicates, {len(self._dup_node)} known")
        for d, node in self._dup_node.items():
            require(d in self._dups.get(node, ()), f"duplicate page {d} unknown to its content")
            require(node in self._node_page, f"duplicate page {d} of uncached content")
            require(self.entries[d] is None, f"duplicate page {d} is cached itself")
        kids = sum(len(c) for c in self._children.values())
        require(kids == len(self._index), f"{kids} child links for {len(self._index)} pages")
        require(self.enabled or not self._index, "pages cached with caching off")
