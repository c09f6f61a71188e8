"""Prefix hits of a sliding-window model need only the cached pages in the window of the
first token to compute, as in vLLM's sliding-window manager: a block manager that knows the
window (`BlockManager(sliding_window=)`, `set_sliding_window`, which the scheduler calls)
keeps the pages cached under an evicted page, and `admit(..., window=)` hits a prompt whose
pages below the window were evicted. Full attention keeps uncaching the subtree.

Block manager unit tests (hits, evictions, re-registration, a colliding hash, errors), the
window state machine of tests/test_window_pages.py on such a manager (every hit's K/V
checked), and the engine: a tiny window model after its prompt's head was evicted gives
the dense tokens, with and without prefix caching.
"""

import hashlib

import numpy as np
import pytest
from block_machine import run_to_floor, snapshot, stateful_settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from params_helpers import random_params
from test_window_pages import CFG, WindowMachine, dense_greedy, engine

from pagedjax import page_hashes
from pagedjax.blocks import BlockManager, InvalidArgument
from pagedjax.engine import SamplingParams
from pagedjax.prefix_cache import salt_bytes

RNG = np.random.default_rng(17)


def chain_of(bm, tokens) -> list[int]:
    """The pages caching ``tokens``' full pages, from the first, while all are cached."""
    buf = np.asarray(tokens, np.int64).tobytes()
    return bm._prefix.lookup(buf, salt_bytes(None), len(tokens) // bm.page_size)[0]


def evict(bm, pages) -> None:
    """Makes ``pages`` (evictable) the least recently freed, then allocates as many pages
    through a new sequence: allocation evicts exactly them (under full attention, the
    first of them uncaches the others)."""
    lru = bm._evictable
    for p in reversed(pages):
        lru.move_to_end(p, last=False)
    free = len(bm._free)
    n = (free + len(pages)) * bm.page_size
    evictions = bm.stats().evictions
    bm.admit("evictor", RNG.integers(1000, 2000, n).tolist(), read_cache=False)
    assert bm.stats().evictions == evictions + (len(pages) if bm.sliding_window else 1)
    bm.free("evictor")


def cached_prompt(bm, n) -> tuple[list[int], list[int]]:
    toks = RNG.integers(0, 99, n).tolist()
    bm.admit("a", toks)
    bm.mark_computed("a", n)
    bm.free("a")
    return toks, chain_of(bm, toks)


@pytest.mark.parametrize("window, want", [(None, 0), (5, 24)])
def test_a_hit_needs_only_the_pages_in_the_window(window, want):
    """24 cached tokens (6 pages of 4), the first 2 pages evicted; the next token (24)
    sees 20..24 under W = 5: page 5 only. Full attention (window unknown) hits nothing."""
    bm = BlockManager(12, 4, watermark=0, sliding_window=window)
    toks, pages = cached_prompt(bm, 24)
    evict(bm, pages[:2])
    assert bm.admit("b", toks + [1, 2], window=5) == want
    if want:
        assert bm.page_table("b")[:6] == [-1] * 5 + pages[5:]
        assert bm.stats().prefix_hits == 24
    bm.check_invariants()


@pytest.mark.parametrize("window, k", [(1, 6), (5, 6), (9, 6), (17, 6), (18, 1), (100, 1)])
def test_the_longest_prefix_whose_window_pages_are_cached(window, k):
    """Pages 0-5 cached, page 1 evicted: a prefix of k pages hits when its pages holding
    positions >= 4k - W + 1 (its last one at least) are cached, so page 1 only below the
    window (W <= 17 for k = 6; no shorter prefix but one page has page 1 below it)."""
    bm = BlockManager(12, 4, watermark=0, sliding_window=window)
    toks, pages = cached_prompt(bm, 24)
    evict(bm, pages[1:2])
    cached = bm.admit("b", toks + [7], window=window)
    assert cached == 4 * k
    r = min(max(cached - window + 1, 0) // 4, k)
    assert bm.page_table("b")[:k] == [-1] * r + pages[r:k]
    bm.check_invariants()


def test_evicting_a_page_below_the_window_keeps_the_window_cached():
    """A running window model's sequence gave its head back; evicting it (other requests'
    allocations) keeps the pages cached under it, held or not: later prompts still hit
    them, and the sequence goes on caching the pages it fills."""
    for window, cached in [(None, 0), (5, 5)]:
        bm = BlockManager(12, 4, watermark=0, sliding_window=window)
        toks = RNG.integers(0, 99, 24).tolist()
        bm.admit("a", toks)
        bm.mark_computed("a", 24)
        head = bm.page_table("a")[:4]
        bm.release_before("a", 20)
        evict(bm, head[:1])  # uncaches a's whole chain under full attention
        assert bm.stats().num_cached_pages == cached
        bm.mark_computed("a", 24)
        for t in range(4):
            bm.append_tokens(["a"], [t])
        bm.check_invariants()
        assert bm._seqs["a"].chain.num_pages == (7 if window else 6)  # page 6 cached (or not)
        hit = bm.admit("b", toks + [0, 1, 2, 3, 9], window=5)
        assert hit == (28 if window else 0)
        bm.check_invariants()


def test_a_page_computing_evicted_content_again_takes_its_registration_back():
    """The evicted head is a stub while pages are cached under it; a full-attention style
    admission (no window) misses it, recomputes it, and the chain is whole again."""
    bm = BlockManager(12, 4, watermark=0, sliding_window=5)
    toks, pages = cached_prompt(bm, 16)
    evict(bm, pages[:2])
    assert bm._prefix.num_stubs == 2 and bm.stats().num_cached_pages == 2
    assert bm.admit("b", toks + [1]) == 0  # (no window: a hit is a run from the first page)
    bm.mark_computed("b", 17)
    assert bm._prefix.num_stubs == 0 and bm.stats().num_cached_pages == 4
    assert chain_of(bm, toks) == bm.page_table("b")[:2] + pages[2:]
    bm.check_invariants()
    bm.free("b")
    assert bm.uncache() == 4 and bm._prefix.num_stubs == 0
    bm.check_invariants()


def test_uncaching_drops_stubs_with_the_pages_under_them():
    bm = BlockManager(12, 4, watermark=0, sliding_window=5)
    toks, pages = cached_prompt(bm, 24)
    evict(bm, pages[1:3])
    assert bm._prefix.num_stubs == 2
    assert bm.uncache([pages[0]]) == 4  # pages 0, 3, 4, 5; stubs 1-2 with them
    assert bm._prefix.num_stubs == 0 and bm.stats().num_cached_pages == 0
    bm.check_invariants()
    toks, pages = cached_prompt(bm, 24)
    evict(bm, pages[1:3])
    assert bm.uncache(pages[3:]) == 3  # nothing left under the stubs: they go too
    assert bm._prefix.num_stubs == 0 and bm.stats().num_cached_pages == 1
    bm.check_invariants()


def test_a_colliding_stub_is_not_trusted(monkeypatch):
    """Hashes of the last token only: a prompt differing from a cached one in its first
    page hashes like it everywhere, but its tokens differ from the stub's: no hit."""
    monkeypatch.setattr(page_hashes, "digest", lambda data: hashlib.sha256(data[-8:]).digest())
    bm = BlockManager(12, 4, watermark=0, sliding_window=5)
    toks = list(range(24))  # (pages ending in equal tokens would collide with each other)
    bm.admit("a", toks)
    bm.mark_computed("a", 24)
    bm.free("a")
    pages = chain_of(bm, toks)
    assert len(pages) == 6
    evict(bm, pages[:1])
    other = [toks[0] + 1, *toks[1:]]
    assert bm.admit("b", other + [1], window=5) == 0
    bm.mark_computed("b", 25)  # its first page collides with the stub: no caching
    assert bm._seqs["b"].chain.hash is None
    bm.check_invariants()
    bm.free("b")
    assert bm.admit("c", toks + [1], window=5) == 24  # the real content still hits
    bm.check_invariants()


def test_set_sliding_window_refuses_dropping_a_window_in_use():
    bm = BlockManager(12, 4, watermark=0)
    with pytest.raises(InvalidArgument, match="window=0"):
        bm.set_sliding_window(0)
    bm.set_sliding_window(5)
    toks, pages = cached_prompt(bm, 16)
    evict(bm, pages[:1])
    before = snapshot(bm)
    with pytest.raises(InvalidArgument, match="1 evicted pages have pages cached under them"):
        bm.set_sliding_window(None)
    assert snapshot(bm) == before and bm.sliding_window == 5
    bm.uncache()
    bm.set_sliding_window(None)
    assert bm.sliding_window is None
    bm.check_invariants()


# --------------------------------------------------------------- state machine


class WindowedMachine(WindowMachine):
    """tests/test_window_pages.py's machine on a manager that knows a window: every
    admission's hits are checked against the simulated device's K/V."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        capacity=st.integers(12, 100),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, page_size, capacity, caching):
        super().setup(page_size, capacity, caching)
        self.bm.set_sliding_window(8)


def test_state_machine_knowing_the_window():
    """Calls that raise are checked to change nothing, the stubs included, while stubs
    are registered (a floor against a run that never evicts into one)."""
    machine = type("Machine", (WindowedMachine,), {})
    run_to_floor(machine, stateful_settings(40, 50), lambda m: m.stub_checks >= 5)
    assert machine.checks - machine.runs >= 1_000
    # (A floor against a run that never evicts into one: the draws differ with the
    # process's history, see run_to_floor, so a run below it is followed by others.)
    assert machine.stub_checks >= 5


# --------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=21)


def test_engine_hits_a_prompt_whose_head_was_evicted(params):
    """W = 6, page size 4: a 24-token prompt is cached, its first 3 pages evicted; the
    same prompt plus 3 tokens hits 24 tokens (pages 4-5 read) and decodes the dense
    tokens, as an engine without prefix caching does."""
    prompt = RNG.integers(0, CFG.vocab_size, 24).tolist()
    again = prompt + RNG.integers(0, CFG.vocab_size, 3).tolist()
    (want,) = dense_greedy(params, [again], 8)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    plain = engine(params, enable_prefix_caching=False)
    assert plain.generate([again], sp)[0].outputs[0].token_ids == want
    llm = engine(params)
    assert llm.block_manager.sliding_window == CFG.sliding_window  # from the scheduler
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    bm = llm.block_manager
    pages = chain_of(bm, prompt)
    assert len(pages) == 6
    evict(bm, pages[:3])
    (out,) = llm.generate([again], sp)
    assert out.num_cached_tokens == 24
    assert out.outputs[0].token_ids == want
    bm.check_invariants()
