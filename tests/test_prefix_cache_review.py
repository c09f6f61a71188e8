"""Prefix caching against vLLM v1's KV cache manager: what a page's key is, the eviction
order of freed cached pages, eviction under pressure, whole-page prompts, and weights
that change under live sequences. Drives the block manager directly (no model)."""

import hashlib
import os
import subprocess
import sys

import numpy as np

from pagedjax.blocks import BlockManager
from pagedjax.prefix_cache import root_hash, salt_bytes

RNG = np.random.default_rng(7)


def prompt(n: int) -> list[int]:
    return RNG.integers(0, 32000, n).tolist()


def computed(bm: BlockManager, seq, tokens, salt=None) -> int:
    cached = bm.admit(seq, tokens, cache_salt=salt)
    bm.mark_computed(seq, len(tokens))
    return cached


def test_a_page_key_is_a_sha256_chain_the_same_in_every_process():
    """Not Python's hash() (64 bits, randomized per process): a 256-bit chain from the
    salted root over each page's int64 token bytes."""
    bm = BlockManager(8, 4)
    toks = prompt(9)
    computed(bm, "a", toks, salt="s")
    h = root_hash(salt_bytes("s"))
    for i, p in enumerate(bm.page_table("a")[:2]):
        h = hashlib.sha256(h + np.array(toks[4 * i : 4 * i + 4], "<i8").tobytes()).digest()
        assert bm._prefix.entries[p].hash == h and len(h) == 32
    code = "from pagedjax.prefix_cache import *; print(root_hash(salt_bytes('s')).hex())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == root_hash(salt_bytes("s")).hex(), out.stderr


def test_the_least_recently_freed_pages_go_first_and_a_hit_renews_them():
    """As vLLM's free queue: a page hit and freed again is the most recently freed."""
    bm = BlockManager(7, 4)
    x, y = prompt(9), prompt(9)
    computed(bm, "a", x)
    computed(bm, "b", y)
    bm.free("a")
    bm.free("b")  # LRU: a's pages, then b's (each tail first)
    assert bm.admit("c", x) == 8  # a's pages leave the LRU ...
    bm.free("c")  # ... and come back behind b's
    assert bm.stats().num_evictable_pages == 4
    bm.admit("x", prompt(20))  # 5 pages: 3 free, then b's two are evicted, tail first
    s = bm.stats()
    assert (s.evictions, s.num_cached_pages, s.num_evictable_pages) == (2, 2, 2)
    bm.free("x")
    assert bm.admit("d", x) == 8 and bm.admit("e", y) == 0
    bm.check_invariants()


def test_an_evicted_page_leaves_the_index_before_its_new_owner_writes_it():
    bm = BlockManager(3, 4)
    toks = prompt(9)
    computed(bm, "a", toks)
    table = bm.page_table("a")
    bm.free("a")  # pages 0, 1 cached (evictable), page 2 free
    bm.admit("x", prompt(8))  # the free page, then a's tail (page 1) evicted
    assert bm.page_table("x") == [table[2], table[1]] and bm.stats().evictions == 1
    # x has not computed page 1 yet: a later prompt must not find a's old content there.
    buf = np.array(toks, "<i8").tobytes()
    assert bm._prefix.lookup(buf, salt_bytes(None), 2)[0] == [table[0]]
    assert bm._prefix.entries[table[1]] is None
    bm.check_invariants()


def test_a_whole_page_prompt_cached_whole_recomputes_its_last_page():
    """vLLM computes at least one token: the last page is recomputed into a new page;
    under pressure the new page is the cached copy of that same last page (the tail is
    evicted first), and the prompt is cached whole again once computed."""
    bm = BlockManager(2, 4)
    toks = prompt(8)
    computed(bm, "a", toks)
    bm.free("a")
    assert bm.admit("b", toks) == 4
    assert bm.stats().evictions == 1 and bm.stats().num_cached_pages == 1
    bm.mark_computed("b", 8)
    bm.free("b")
    assert bm.admit("c", toks, compute_last=False) == 8
    s = bm.stats()
    assert (s.prefix_queries, s.prefix_hits) == (24, 12)
    bm.check_invariants()


def test_new_weights_stop_caching_even_before_a_sequence_fills_its_first_page():
    """update_params's uncache() + stop_caching(): no page computed with the old weights
    is found afterwards, even one filled later by a sequence whose chain was still at the
    root (it had registered nothing, so no uncached parent stops it)."""
    bm = BlockManager(16, 4)
    short, long = prompt(3), prompt(6)
    computed(bm, "a", short)
    computed(bm, "b", long)
    assert bm.stats().num_cached_pages == 1
    assert bm.uncache() == 1 and bm.stop_caching() == 2
    bm.append_tokens(["a", "b"], [7, 7])  # a's first page fills
    bm.append_tokens(["b"], [7])  # b's second page fills
    assert bm.stats().num_cached_pages == 0
    assert bm.admit("c", short + [7, 1]) == 0 and bm.admit("d", long + [7, 7, 1]) == 0
    bm.check_invariants()
    computed(bm, "e", prompt(5))  # sequences admitted after the update cache again
    assert bm.stats().num_cached_pages == 1
    bm.check_invariants()
