"""Tests for pagedjax.prefix_cache on its own: lookup, register, uncache and the checks.

The block manager's tests (tests/test_blocks.py) drive the cache through every operation
and a state machine; these pin the cache's own interface on small random pages.
"""

import hashlib

import numpy as np
import pytest

from pagedjax import page_hashes
from pagedjax.prefix_cache import ROOT, Chain, PrefixCache, root_hash, salt_bytes

PS = 4
RNG = np.random.default_rng(1)
SALT = salt_bytes(None)


def page() -> bytes:
    """One page of random token ids, int64 little-endian."""
    return RNG.integers(0, 32000, PS).astype("<i8").tobytes()


def cached(cache: PrefixCache, pages: list[int], tokens: bytes, salt: bytes = SALT) -> Chain:
    """Looks a sequence up, then registers all its full pages, as the block manager does."""
    hits, chain = cache.lookup(tokens, salt, len(pages))
    cache.register(chain, pages, tokens, len(tokens) // (8 * PS))
    return chain


def check(cache: PrefixCache, chains=()) -> list[str]:
    """Runs every check; returns the messages of those that fail."""
    failed = []

    def require(ok, msg):
        if not ok:
            failed.append(msg)

    for name, chain, pages, tokens, num_computed in chains:
        cache.check_chain(name, chain, pages, tokens, num_computed, require)
    for p, e in enumerate(cache.entries):
        if e is not None:
            cache.check_page(p, require)
    cache.check_index(require)
    return failed


def test_empty_lookup_starts_a_chain_at_the_salted_root():
    cache = PrefixCache(8, PS)
    hits, chain = cache.lookup(page() + page(), salt_bytes("s"), 2)
    assert hits == [] and len(cache) == 0
    assert chain == Chain(salt_bytes("s"), 0, root_hash(salt_bytes("s")), ROOT)
    assert root_hash(salt_bytes("s")) != root_hash(SALT)


def test_register_then_lookup_hits_the_registered_pages_in_order():
    cache = PrefixCache(8, PS)
    toks = page() + page() + page()
    chain = cached(cache, [5, 2, 7], toks)
    assert len(cache) == 3 and chain.num_pages == 3
    assert [e is not None for e in cache.entries] == [i in (5, 2, 7) for i in range(8)]
    hits, again = cache.lookup(toks + page(), SALT, 4)
    assert hits == [5, 2, 7] and again == chain
    assert cache.lookup(toks, SALT, 2)[0] == [5, 2]  # max_pages bounds the walk
    assert cache.lookup(page() + toks, SALT, 4)[0] == []  # same pages, other prefix
    assert check(cache, [("'a'", chain, [5, 2, 7], toks, 3 * PS)]) == []


def test_salts_never_share_pages():
    assert len({salt_bytes(None), salt_bytes("a"), salt_bytes(b"a"), salt_bytes("")}) == 4
    cache = PrefixCache(8, PS)
    toks = page() + page()
    cached(cache, [0, 1], toks, salt_bytes("a"))
    assert cache.lookup(toks, salt_bytes(b"a"), 2)[0] == []
    assert cache.lookup(toks, SALT, 2)[0] == []
    assert cache.lookup(toks, salt_bytes("a"), 2)[0] == [0, 1]
    with pytest.raises(TypeError, match="int"):
        salt_bytes(3)


def test_disabled_cache_finds_and_registers_nothing():
    cache = PrefixCache(8, PS, enabled=False)
    toks = page() + page()
    hits, chain = cache.lookup(toks, SALT, 2)
    assert hits == [] and chain == Chain(SALT)
    cache.register(chain, [0, 1], toks, 2)
    assert len(cache) == 0 and chain.hash is None and cache.entries == [None] * 8
    assert check(cache, [("'a'", chain, [0, 1], toks, 2 * PS)]) == []


def test_content_computed_twice_chains_onto_the_registered_copy():
    cache = PrefixCache(8, PS)
    head, tail = page(), page()
    a = cache.lookup(head + tail, SALT, 2)[1]
    b = cache.lookup(head + tail, SALT, 2)[1]  # both missed: they race on one prefix
    cache.register(a, [0, 1], head, 1)
    cache.register(b, [2, 3], head + tail, 2)
    assert cache.entries[2] is None  # the duplicate of page 0 is not registered again
    assert cache.entries[3].parent_node == cache.entries[0].node
    assert (b.num_pages, b.node) == (2, cache.entries[3].node)
    assert cache.lookup(head + tail + page(), SALT, 3)[0] == [0, 3]


def test_uncache_drops_the_subtree_and_stops_chains_from_it():
    cache = PrefixCache(8, PS)
    stem = page()
    x, y = stem + page() + page(), stem + page()
    cached(cache, [0, 1, 2], x)
    cached(cache, [0, 3], y)  # hits page 0, registers page 3 under it
    late = cache.lookup(x + page(), SALT, 2)[1]  # chains past pages 0 and 1
    assert cache.uncache(1) == [2]
    assert cache.uncache(0) == [3]
    assert len(cache) == 0 and cache.entries == [None] * 8
    assert cache.lookup(x, SALT, 3)[0] == []
    cache.register(late, [0, 1, 4], x + page(), 3)
    assert late.hash is None and len(cache) == 0  # its parent's content is gone
    assert check(cache) == []


@pytest.mark.parametrize(
    "digest",
    [lambda data: b"\x00" * 32, lambda data: hashlib.sha256(data[-8 * PS :]).digest()],
    ids=["constant", "page-only"],
)
def test_colliding_hashes_never_reuse_a_wrong_page(monkeypatch, digest):
    monkeypatch.setattr(page_hashes, "digest", digest)
    cache = PrefixCache(8, PS)
    x, y = page(), page()
    chain = cached(cache, [0, 1], x + y)  # with a constant hash, y collides with x
    assert (chain.hash is None) == (len(cache) == 1)  # a collision stops caching
    assert cache.lookup(y + y, SALT, 2)[0] == []
    assert cache.lookup(x + y, salt_bytes("other"), 2)[0] == []
    assert cache.lookup(page() + y, SALT, 2)[0] == []
    assert cache.lookup(x + y, SALT, 2)[0] == [0, 1][: len(cache)]
    assert check(cache, [("'a'", chain, [0, 1], x + y, 2 * PS)]) == []


def test_checks_name_the_corruption():
    cache = PrefixCache(8, PS)
    toks = page() + page()
    chain = cached(cache, [4, 6], toks)
    seq = ("'a'", chain, [4, 6], toks, 2 * PS)
    assert check(cache, [seq]) == []
    cache.entries[6].tokens = bytes(8 * PS)
    assert check(cache, [seq]) == [
        "'a': cached page 6 does not hold its tokens 4..8",
        "page 6: hash does not match its tokens",
    ]
    cache.entries[6].tokens = toks[8 * PS :]
    chain.num_pages = 1
    assert check(cache, [seq]) == [
        "'a': page 6 cached past its hashed prefix",
        "'a': stale chain hash",
        "'a': full pages unhashed",
        "'a': chains from wrong content",
    ]
    chain.num_pages = 2
    cache._children[cache.entries[6].parent_node].discard(6)
    assert check(cache) == ["page 6 unknown to parent", "1 child links for 2 pages"]


def test_any_str_salt_encodes_and_distinct_salts_stay_distinct():
    # A lone surrogate (JSON's "\ud800" decodes to one) is a valid Python str: str.encode()
    # refused it with a UnicodeEncodeError inside BlockManager.admit, mid-schedule.
    rng = np.random.default_rng(2)
    alphabet = ["a", "\x00", "é", "😀", "\ud800", "\udfff", "\ud83d", "\ude00", "\x01"]
    salts = {"".join(rng.choice(alphabet, rng.integers(0, 5))) for _ in range(300)}
    salts |= {"\ud83d\ude00", "😀", "\ud800"}  # a surrogate pair is not its code point
    encoded = {salt_bytes(s) for s in salts}
    assert len(encoded) == len(salts)
    assert not encoded & {salt_bytes(s.encode("utf-8", "surrogatepass")) for s in salts}
    cache = PrefixCache(8, PS)
    toks = page() + page()
    cached(cache, [0, 1], toks, salt_bytes("\ud800"))
    assert cache.lookup(toks, salt_bytes("\ud800"), 2)[0] == [0, 1]
    assert cache.lookup(toks, salt_bytes("\udfff"), 2)[0] == []
    assert cache.lookup(toks, salt_bytes(b"\xed\xa0\x80"), 2)[0] == []  # its UTF-8 bytes


def test_a_collision_while_registering_stops_caching_the_sequence(monkeypatch):
    # The hash of a page's tokens alone: equal pages collide under any parent and salt.
    monkeypatch.setattr(
        page_hashes, "digest", lambda data: hashlib.sha256(data[-8 * PS :]).digest()
    )
    cache = PrefixCache(8, PS)
    x, y, z = page(), page(), page()
    salt = salt_bytes("a")
    cached(cache, [0, 1], x + y, salt)
    other_parent = cached(cache, [2, 3], z + y, salt)  # y after z is not y after x
    assert other_parent.hash is None and other_parent.num_pages == 1
    other_salt = cached(cache, [4, 5], x + y)  # x under another salt
    assert other_salt.hash is None and other_salt.num_pages == 0
    assert [p for p, e in enumerate(cache.entries) if e is not None] == [0, 1, 2]
    assert cache.lookup(z + y + page(), salt, 2)[0] == [2]
    assert cache.lookup(x + y + page(), SALT, 2)[0] == []
    assert check(cache) == []
