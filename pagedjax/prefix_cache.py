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

A cache for a sliding-window model (``windowed``) keeps the pages cached under an evicted
page: a hit needs only the pages in the window of the first token to compute, not those
below it. The evicted content stays registered as a stub (its registration id, hash and
tokens, no page) while pages are cached under it, so every hit is still verified from the
root, and a page computing it again takes the registration back. ``lookup(...,
window=W)`` walks the chain through stubs and returns the longest prefix whose pages in
the window are cached, the pages below it as -1, as vLLM's sliding-window manager does
(``find_longest_cache_hit``). ``uncache`` still drops a page's whole subtree, stubs
included; a stub goes when nothing is cached under it any more and no held chain (a live
sequence's: ``hold``) ends at it. Under a window W <= page_size a running sequence gives
back its chain's top page before the next page fills; evicted then, with nothing cached
under it yet, that page's content stays a stub for the next page to chain from (dropped,
it stopped the sequence's caching for good, where vLLM caches every full block by its
hash whatever became of the one before).

Each sequence carries a ``Chain``: how many of its leading full pages were looked up or
registered, and the hash and registration id to chain its next page from::

    hits, chain = cache.lookup(prompt_bytes, salt, max_pages)  # reuse hits[i] for page i
    hits, chain = cache.lookup(prompt_bytes, salt, max_pages, window=W)  # windowed: -1s
    hashes = PageHashes(token_ids, salt, page_size)  # a sequence's, kept: hashed once
    hits, chain = cache.lookup(hashes, salt, max_pages)    # as lookup(prompt_bytes, ...)
    cache.hold(chain)                                          # a live sequence's chain
    cache.register(chain, pages, token_bytes, num_full_pages)  # as pages fill up
    cache.let_go(chain)                                        # the sequence is freed
    orphans = cache.evict(page)                                # to reuse the page
    cache.release(page)                                        # a page's last holder left
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from pagedjax import page_hashes
from pagedjax.page_hashes import (  # noqa: F401  (the hash chain's names, re-exported)
    HashedPrompt,
    PageHashes,
    root_hash,
    salt_bytes,
)

ROOT = 0  # registration id of the (per-salt) root of every hash chain

Require = Callable[[bool, str], None]  # check_* report through it: require(ok, message)


@dataclasses.dataclass(slots=True)
class Entry:
    """A page registered in the prefix cache."""

    node: int  # registration id, unique for the cache's life
    hash: bytes  # page_hashes.digest(parent_hash + tokens)
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
    held: bool = False  # a live sequence's (PrefixCache.hold): its content is kept

    def copy(self) -> Chain:
        """An independent copy, not held, for a forked sequence (which ``hold``s it;
        faster than dataclasses.replace)."""
        return Chain(self.salt, self.num_pages, self.hash, self.node)


class PrefixCache:
    """Chain hash -> page, for pages of ``page_size`` tokens out of ``num_pages``.

    Args:
        num_pages: physical pages (page ids are ``0 .. num_pages - 1``).
        page_size: token slots per page.
        enabled: False: ``lookup`` finds nothing and returns stopped chains, so nothing
            is ever registered.
        windowed: evicting a page keeps the pages cached under it (a sliding-window
            model's cache; module docstring). False: it uncaches them.

    Attributes:
        entries: ``entries[page]`` is the page's registration, None if it is not cached.
            Read-only outside this class.
        windowed: as the argument; may be turned on at any time, off only while no stub
            is registered (``num_stubs``).
    """

    def __init__(
        self, num_pages: int, page_size: int, *, enabled: bool = True, windowed: bool = False
    ):
        self.page_size = page_size
        self.enabled = enabled
        self.windowed = windowed
        self.entries: list[Entry | None] = [None] * num_pages
        self._page_bytes = page_size * 8
        self._index: dict[bytes, int] = {}  # chain hash -> page
        self._node_page: dict[int, int] = {}  # registration id -> page, while registered
        self._children: dict[int, set[int]] = {}  # registration id -> registered child pages
        # Duplicates: pages in use holding a registered content (computed twice), by its
        # registration id, and back.
        self._dups: dict[int, set[int]] = {}
        self._dup_node: dict[int, int] = {}
        # Stubs (windowed): evicted content with pages cached under it, by chain hash and by
        # registration id, and the stubs registered under each registration id.
        self._stubs: dict[bytes, Entry] = {}
        self._stub_node: dict[int, Entry] = {}
        self._stub_children: dict[int, set[int]] = {}
        # Held chains (live sequences') ending at each registration id (hold): evicted,
        # its content stays a stub while one does. Ids uncached since may stay here.
        self._held: dict[int, int] = {}
        self._next_node = 1

    @property
    def num_stubs(self) -> int:
        """Evicted contents kept registered because pages are cached under them."""
        return len(self._stubs)

    def __len__(self) -> int:
        """Pages cached now."""
        return len(self._index)

    def lookup(
        self,
        tokens: bytes | PageHashes,
        salt: bytes,
        max_pages: int,
        *,
        window: int | None = None,
    ) -> tuple[list[int], Chain]:
        """The longest cached prefix of a prompt, verified page by page.

        Args:
            tokens: the prompt's token ids, int64 little-endian, or its ``PageHashes``
                (of salt ``salt``), whose page hashes are used and kept, not computed again.
            salt: ``salt_bytes(cache_salt)`` of the request.
            max_pages: look at most this many leading full pages up (at most the prompt's).
            window: sliding window W of a ``windowed`` cache (ignored otherwise): a prefix
                of ``k`` pages is a hit when its pages holding positions
                ``>= k * page_size - W + 1`` (the last one at least) are cached; those
                below may be stubs.

        Returns:
            ``(pages, chain)``: the cached pages holding the prompt's first ``len(pages)``
            pages (-1: a stub, below the window), and the prompt's chain positioned after
            them.

        Raises:
            ValueError: ``tokens`` is a ``PageHashes`` of another salt or page size.
        """
        if not self.enabled:
            return [], Chain(salt)
        if not isinstance(tokens, PageHashes):
            ph = PageHashes(tokens, salt, self.page_size)
        elif tokens.salt != salt or tokens.page_size != self.page_size:
            raise ValueError(
                f"page hashes of salt {tokens.salt!r:.40} and page size {tokens.page_size} "
                f"looked up with salt {salt!r:.40} and page size {self.page_size}"
            )
        else:
            ph = tokens
        if window is not None and self.windowed:
            return self._lookup_window(ph, max_pages, window)
        index, entries = self._index, self.entries
        hits: list[int] = []
        last_hash, last_node = None, ROOT
        for h, tb in ph.pages(max_pages):
            p = index.get(h)
            e = entries[p] if p is not None else None
            # The stored tokens, parent and salt are checked, never the hash alone.
            if e is None or e.tokens != tb or e.parent_node != last_node or e.salt != salt:
                break  # a miss, or a hash collision that must not be trusted
            hits.append(p)
            last_hash, last_node = h, e.node
        return hits, Chain(salt, len(hits), last_hash or ph.root(), last_node)

    def _lookup_window(
        self, ph: PageHashes, max_pages: int, window: int
    ) -> tuple[list[int], Chain]:
        """``lookup`` with a window: the chain is walked through stubs (verified as pages
        are), then cut back to the longest prefix whose window pages are all cached."""
        ps, index, entries, stubs, salt = (
            self.page_size,
            self._index,
            self.entries,
            self._stubs,
            ph.salt,
        )
        found: list[tuple[int, bytes, int]] = []  # (page or -1, chain hash, registration id)
        run: list[int] = []  # run[i]: cached pages ending at page i, consecutive
        last_node = ROOT
        for h, tb in ph.pages(max_pages):
            p = index.get(h)
            e = entries[p] if p is not None else stubs.get(h)
            if e is None or e.tokens != tb or e.parent_node != last_node or e.salt != salt:
                break  # a miss, or a hash collision that must not be trusted
            p = -1 if p is None else p
            found.append((p, h, e.node))
            run.append(0 if p < 0 else (run[-1] if run else 0) + 1)
            last_node = e.node
        k = len(found)
        # The first token to compute (k * ps) sees positions >= k * ps - window + 1.
        while k and run[k - 1] < k - min(max(k * ps - window + 1, 0) // ps, k - 1):
            k -= 1
        if not k:
            return [], Chain(salt, 0, ph.root(), ROOT)
        _, h, node = found[k - 1]
        return [p for p, _, _ in found[:k]], Chain(salt, k, h, node)

    def hold(self, chain: Chain) -> None:
        """Marks ``chain`` (not held yet) as a live sequence's until ``let_go``: a windowed
        cache keeps the content it ends at as a stub while that content's page is evicted,
        so the sequence's next page still has a parent to chain from (module docstring).
        ``register`` moves the hold along as the chain grows; ``stop`` ends it."""
        chain.held = True
        self._pin(chain)

    def let_go(self, chain: Chain) -> None:
        """Ends ``hold`` (a freed sequence); the stub it kept goes if nothing is cached
        under it."""
        if chain.held:
            chain.held = False
            self._unpin(chain.node if chain.hash is not None else ROOT)

    def stop(self, chain: Chain) -> None:
        """Stops caching for ``chain``'s sequence for good (``chain.hash = None``)."""
        if chain.held:
            self._unpin(chain.node if chain.hash is not None else ROOT)
        chain.hash = None

    def _pin(self, chain: Chain) -> None:
        if chain.hash is not None and chain.node != ROOT:
            self._held[chain.node] = self._held.get(chain.node, 0) + 1

    def _unpin(self, node: int) -> None:
        if node == ROOT:
            return
        n = self._held[node] - 1
        if n:
            self._held[node] = n
        else:
            del self._held[node]
            if node in self._stub_node:
                self._prune(node)

    def register(
        self, chain: Chain, pages: list[int], tokens: bytes | bytearray, num_full_pages: int
    ) -> None:
        """Caches a sequence's full pages ``chain.num_pages .. num_full_pages - 1``.

        A page whose content is cached already (computed twice) is not registered again:
        the chain continues from the cached copy. Caching stops for the sequence for good
        (``chain.hash = None``) when the content it chains from was uncached or a hash
        collides with other content.

        Args:
            chain: the sequence's chain, advanced in place (a held one's hold with it).
            pages: the sequence's physical pages, logical order.
            tokens: the sequence's token ids, int64 little-endian.
            num_full_pages: leading pages that are full and computed.
        """
        if chain.hash is None or chain.num_pages >= num_full_pages:
            return
        if not chain.held:
            self._register(chain, pages, tokens, num_full_pages)
            return
        node = chain.node
        self._register(chain, pages, tokens, num_full_pages)
        if chain.hash is None or chain.node != node:  # held on where it ends now
            self._pin(chain)
            self._unpin(node)

    def _register(
        self, chain: Chain, pages: list[int], tokens: bytes | bytearray, num_full_pages: int
    ) -> None:
        psb, index, entries = self._page_bytes, self._index, self.entries
        while chain.hash is not None and chain.num_pages < num_full_pages:
            i = chain.num_pages
            node = chain.node
            if node != ROOT and node not in self._node_page and node not in self._stub_node:
                chain.hash = None  # the content we chain from was evicted
                return
            tb = bytes(tokens[i * psb : (i + 1) * psb])
            h = page_hashes.digest(chain.hash + tb)
            q = index.get(h)
            if q is None and h in self._stubs:  # (windowed) computed again after eviction
                e = self._stubs[h]
                if e.tokens == tb and e.parent_node == chain.node and e.salt == chain.salt:
                    self._unstub(e, pages[i])
                    chain.num_pages, chain.hash, chain.node = i + 1, h, e.node
                else:
                    chain.hash = None
                continue
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
        deepest first, up to the first stub (empty if ``node`` is not a cached page)."""
        out, p = [], self._node_page.get(node)
        while p is not None:
            out.append(p)
            p = self._node_page.get(self.entries[p].parent_node)
        return out

    def chain_tail(self, node: int, num_pages: int) -> list[int]:
        """The pages holding the last ``num_pages`` contents of the chain that ends at
        registration ``node``, deepest first, through stubs (-1); shorter where the chain
        is not registered so far up (empty if ``node`` is neither cached nor a stub)."""
        out: list[int] = []
        while len(out) < num_pages and node != ROOT:
            p = self._node_page.get(node)
            e = self._stub_node.get(node) if p is None else self.entries[p]
            if e is None:
                break
            out.append(-1 if p is None else p)
            node = e.parent_node
        return out

    def evict(self, page: int) -> list[int]:
        """Takes a cached ``page`` out of the index for reuse: its registration moves onto
        a duplicate in use if there is one, else it is uncached (``uncache``); in a
        ``windowed`` cache, the pages cached under it stay (it becomes a stub).

        Returns:
            The pages uncached below ``page``.
        """
        dups = self._dups.get(self.entries[page].node)
        if not dups:
            if self.windowed:
                self._stub(page)
                return []
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
        """Unregisters a cached ``page`` and every page and stub cached under it (and
        forgets their duplicates: evicting the content means it is not wanted, or not on
        the device).

        Returns:
            The pages uncached below ``page``, in the order they were dropped.
        """
        entries, below = self.entries, []
        parent = entries[page].parent_node
        stack = [page]  # pages, and stubs as ~registration id
        while stack:
            q = stack.pop()
            if q < 0:  # a stub: its parent, dropped before it, forgot it
                e = self._stub_node.pop(~q)
                del self._stubs[e.hash]
            else:
                e, entries[q] = entries[q], None
                del self._index[e.hash], self._node_page[e.node]
                for d in self._dups.pop(e.node, ()):
                    del self._dup_node[d]
                siblings = self._children.get(e.parent_node)
                if siblings is not None:
                    siblings.discard(q)
                if q != page:
                    below.append(q)
            stack.extend(self._children.pop(e.node, ()))
            if self._stub_children:
                stack.extend(~n for n in self._stub_children.pop(e.node, ()))
        if self._stub_node:
            self._prune(parent)
        return below

    def _stub(self, page: int) -> None:
        """Evicts cached ``page`` (no duplicate) in a windowed cache: its content stays a
        stub while pages are cached under it or a held chain ends at it."""
        e, self.entries[page] = self.entries[page], None
        del self._index[e.hash], self._node_page[e.node]
        self._children[e.parent_node].discard(page)
        if self._children.get(e.node) or self._stub_children.get(e.node) or e.node in self._held:
            self._stubs[e.hash] = self._stub_node[e.node] = e
            self._stub_children.setdefault(e.parent_node, set()).add(e.node)
        else:
            self._children.pop(e.node, None)
            self._prune(e.parent_node)

    def _unstub(self, e: Entry, page: int) -> None:
        """Registers stub ``e`` again on ``page``, which computed its content anew."""
        del self._stubs[e.hash], self._stub_node[e.node]
        self._drop_stub_link(e)
        self.entries[page] = e
        self._index[e.hash] = self._node_page[e.node] = page
        self._children.setdefault(e.parent_node, set()).add(page)

    def _drop_stub_link(self, e: Entry) -> None:
        kids = self._stub_children[e.parent_node]
        kids.discard(e.node)
        if not kids:
            del self._stub_children[e.parent_node]

    def _prune(self, node: int) -> None:
        """Drops stub ``node`` if nothing is cached under it any more and no held chain
        ends at it, then its parent's."""
        while (e := self._stub_node.get(node)) is not None:
            if self._children.get(node) or self._stub_children.get(node) or node in self._held:
                return
            del self._stubs[e.hash], self._stub_node[node]
            self._children.pop(node, None)
            self._drop_stub_link(e)
            node = e.parent_node

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
            h = page_hashes.digest(h + tb)
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
            stub = self._stub_node.get(chain.node)
            require(stub is None or stub.hash == h, f"{name}: chains from a wrong stub")

    def check_held(self, chains: Iterable[Chain], require: Require) -> None:
        """Checks that ``chains`` (the live sequences') are held, and are the held chains,
        each counted at the content it ends at."""
        want: dict[int, int] = {}
        for c in chains:
            require(c.held, f"a live sequence's chain is not held: {c}")
            if c.hash is not None and c.node != ROOT:
                want[c.node] = want.get(c.node, 0) + 1
        require(want == self._held, f"held chains end at {self._held}, the live ones at {want}")

    def check_page(self, p: int, require: Require) -> None:
        """Checks cached page ``p``: indexed, hashed from its tokens and a registered parent."""
        e = self.entries[p]
        require(self._index.get(e.hash) == p, f"cached page {p} is not indexed")
        require(self._node_page.get(e.node) == p, f"page {p}: registration id lost")
        ok = (
            len(e.tokens) == self._page_bytes
            and page_hashes.digest(e.parent_hash + e.tokens) == e.hash
        )
        require(ok, f"page {p}: hash does not match its tokens")
        if e.parent_node == ROOT:
            require(e.parent_hash == root_hash(e.salt), f"page {p}: wrong root hash")
        else:
            q = self._node_page.get(e.parent_node)
            pe = self._stub_node.get(e.parent_node) if q is None else self.entries[q]
            require(pe is not None, f"cached page {p} outlived its parent")
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
        self._check_stubs(require)

    def _check_stubs(self, require: Require) -> None:
        """Every stub is indexed, hashed from its tokens and a registered parent, and has
        something cached under it; only a windowed cache has stubs."""
        stubs, nodes = self._stubs, self._stub_node
        require(self.windowed or not stubs, "stubs in a cache that is not windowed")
        require(len(stubs) == len(nodes), "stub index and registrations disagree")
        links = sum(len(c) for c in self._stub_children.values())
        require(links == len(nodes), f"{links} stub links for {len(nodes)} stubs")
        for node, e in nodes.items():
            require(stubs.get(e.hash) is e and e.node == node, f"stub {node} is not indexed")
            require(
                e.hash not in self._index and node not in self._node_page, f"stub {node} is cached"
            )
            require(
                page_hashes.digest(e.parent_hash + e.tokens) == e.hash, f"stub {node}: bad hash"
            )
            require(
                node in self._stub_children.get(e.parent_node, ()), f"stub {node} unknown to parent"
            )
            q = self._node_page.get(e.parent_node)
            pe = nodes.get(e.parent_node) if q is None else self.entries[q]
            if e.parent_node == ROOT:
                require(e.parent_hash == root_hash(e.salt), f"stub {node}: wrong root hash")
            else:
                require(pe is not None and pe.hash == e.parent_hash, f"stub {node}: bad parent")
            below = self._children.get(node) or self._stub_children.get(node)
            require(bool(below) or node in self._held, f"stub {node} has nothing cached under it")
