"""A live sequence's hash chain under a sliding window W <= page_size (review 30).

With W <= page_size a running sequence gives back the top page of its chain (its last
full, cached page) before the next page fills: ``release_before(c - W + 1)`` releases
page k once ``c >= (k + 1) * page_size + W - 1``, page k + 1 is registered at
``c = (k + 2) * page_size``. Evicted in between (a tight cache: the sequence's own next
chunk, other requests), that page had nothing cached under it, so it was dropped, not
kept as a stub, and its stub ancestors with it: the sequence's next page had no parent to
chain from and caching stopped for good. The same prompt again (while the first request
ran or after it) hit only the pages cached before that point, where a model with W >
page_size, full attention, or vLLM's sliding-window manager (which caches every full
block by its hash whatever became of its parent) hits up to the last full page whose
window is cached.

A windowed cache now keeps the content a live sequence's chain ends at as a stub while it
is evicted (``PrefixCache.hold``): the chain goes on, and the stub goes once the sequence
chains past it or lets it go (nothing cached under it).
"""

import dataclasses

import numpy as np
import pytest
import test_window_pages
from params_helpers import random_params
from test_window_pages import dense_greedy
from test_window_prefix_hits import evict

from pagedjax import planner
from pagedjax.blocks import BlockManager
from pagedjax.engine import LLM, SamplingParams

PS = 4
RNG = np.random.default_rng(30)


def decode(bm: BlockManager, sid, tokens, w: int | None) -> None:
    """Appends ``tokens`` one step at a time, releasing below the window first as the
    scheduler does (``Scheduler._release_out_of_window``)."""
    for t in tokens:
        if w is not None and (c := bm.num_computed_tokens(sid)) >= w:
            bm.release_before(sid, c - w + 1)
        bm.append_tokens([sid], [t])
        bm.check_invariants()


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 8, None])
def test_a_running_sequence_caches_on_after_its_chain_top_was_evicted(w):
    """16-token prompt (pages 0-3) decoded to 19 tokens: with W <= 4 page 3, the chain's
    top, is released (page 4 is partial) and evicted; W > 4 holds it (only pages below go).
    Decoding on to 24 tokens caches pages 4 and 5, and the prompt plus output again hits
    all 24 tokens, as without the eviction. (The chain stopped at 4 pages, its stubs were
    pruned: 0 hits.)"""
    bm = BlockManager(16, PS, watermark=0, sliding_window=w)
    prompt = RNG.integers(0, 99, 16).tolist()
    out = RNG.integers(0, 99, 8).tolist()
    bm.admit("a", prompt, window=w)
    bm.mark_computed("a", 16)
    decode(bm, "a", out[:3], w)
    if w is not None:
        bm.release_before("a", 19 - w + 1)
    top = bm._prefix.chain_pages(bm._seqs["a"].chain.node)[0]
    assert (bm.page_table("a")[3] == -1) == (w is not None and w <= PS)
    if w is not None:  # (full attention: nothing released, nothing to evict)
        evict(bm, list(bm._evictable))
        assert (bm._prefix.entries[top] is None) == (w <= PS)
    bm.check_invariants()
    decode(bm, "a", out[3:], w)
    assert bm._seqs["a"].chain.num_pages == 6 and bm._seqs["a"].chain.hash is not None
    assert bm.admit("b", prompt + out + [7], window=w) == 24
    bm.check_invariants()


def top_evicted(w: int = 2) -> tuple[BlockManager, list[int]]:
    """A sequence "a" (16-token prompt, decoded to 18) whose chain's top, page 3, was
    released (W = 2) and evicted; returns the manager and a's tokens."""
    bm = BlockManager(16, PS, watermark=0, sliding_window=w)
    toks = RNG.integers(0, 99, 16).tolist()
    bm.admit("a", toks, window=w)
    bm.mark_computed("a", 16)
    decode(bm, "a", [1, 2, 3], w)  # (the release before the third token gives page 3 back)
    assert bm.page_table("a")[:4] == [-1] * 4
    evict(bm, list(bm._evictable))
    assert bm.stats().num_cached_pages == 0 and bm._prefix.num_stubs == 4
    bm.check_invariants()
    return bm, toks + [1, 2, 3]


def test_the_stub_a_chain_ends_at_goes_with_the_sequence():
    """Nothing is cached under page 3's stub: freeing "a" drops it, and the stubs it kept
    (pages 0-2), as ``stop_caching`` does; a fork's chain keeps it until both are freed."""
    bm, _ = top_evicted()
    bm.free("a")
    assert bm._prefix.num_stubs == 0
    bm.check_invariants()
    bm, _ = top_evicted()
    assert bm.stop_caching() == 1 and bm._prefix.num_stubs == 0
    decode(bm, "a", [4, 5, 6, 7], 2)
    assert bm.stats().num_cached_pages == 0  # stopped for good
    bm, _ = top_evicted()
    bm.fork("a", "b")
    bm.free("a")
    assert bm._prefix.num_stubs == 4
    bm.check_invariants()
    bm.free("b")
    assert bm._prefix.num_stubs == 0
    bm.check_invariants()


def test_a_held_stub_is_computed_again_and_uncached_with_its_parent():
    """Another request computing the evicted top's content takes its registration back
    (a's next page chains onto that page); uncaching the head drops the stubs and the
    pages under it, and a's caching stops there, as before."""
    bm, toks = top_evicted()
    bm.admit("b", toks[:17])  # (no window: computes pages 0-3 again)
    bm.mark_computed("b", 17)
    assert bm._prefix.num_stubs == 0 and bm.stats().num_cached_pages == 4
    decode(bm, "a", [4], 2)  # a's page 4 fills: cached under b's page 3
    assert bm._seqs["a"].chain.num_pages == 5 and bm.stats().num_cached_pages == 5
    bm.check_invariants()
    bm.free("b")
    assert bm.uncache(bm._prefix.chain_pages(bm._seqs["a"].chain.node)[-1:]) == 5
    decode(bm, "a", [5, 6, 7, 8], 2)
    assert bm._seqs["a"].chain.hash is None and bm.stats().num_cached_pages == 0
    bm.free("a")
    assert bm._prefix.num_stubs == 0
    bm.check_invariants()


def prefill_in_chunks(bm: BlockManager, sid, prompt, w: int, budget: int) -> None:
    """Admits and prefills ``prompt`` as the scheduler does with a window: a reservation
    of ``window_pages``, then per chunk the release below the window, ``grow``, and
    ``mark_computed``."""
    peak = min(planner.window_pages(w, PS, budget), -(-len(prompt) // PS))
    c = bm.admit(sid, prompt, peak_pages=peak, window=w)
    while c < len(prompt):
        if c >= w:
            bm.release_before(sid, c - w + 1)
        c = min(c + budget, len(prompt))
        bm.grow(sid, c)
        bm.mark_computed(sid, c)
        bm.check_invariants()


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 6])
def test_a_tight_cache_keeps_caching_a_prompt_prefilled_in_chunks(w):
    """A 40-token prompt prefilled 7 tokens a step in a cache of 4 pages (W <= 3) or 5: a
    chunk ending mid-page releases the chain's top (W <= 4), and the next chunk's pages
    evicted it. The same prompt, admitted while the first still runs, hits 36 tokens (its
    window, page 8, is held), as with W > 4. (It stopped caching at 3 pages and hit 8.)"""
    budget = 7
    num_pages = planner.window_pages(w, PS, budget) + 1
    bm = BlockManager(num_pages, PS, watermark=0, sliding_window=w)
    prompt = RNG.integers(0, 99, 40).tolist()
    prefill_in_chunks(bm, "a", prompt, w, budget)
    assert bm.stats().evictions > 0
    assert bm._seqs["a"].chain.num_pages == 10
    assert bm.admit("b", prompt, window=w) == 36
    bm.check_invariants()


# --------------------------------------------------------------- engine

CFG = dataclasses.replace(test_window_pages.CFG, sliding_window=3)  # (W <= PS)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=30)


def test_engine_the_same_prompt_again_hits_its_window(params):
    """W = 3, pages of 4, 7 tokens a step, a cache of 4 pages: a 40-token prompt
    prefilled and decoded, then the same prompt again (with the first request running,
    then after it finished) hits 36 tokens and decodes the dense model's tokens, as an
    engine without prefix caching does. (The first request stopped caching at 3 pages:
    the same prompt hit 8 tokens.)"""
    prompt = RNG.integers(0, CFG.vocab_size, 40).tolist()
    (want,) = dense_greedy(params, [prompt], 6)
    sp = SamplingParams(temperature=0.0, max_tokens=6)

    def make(**kw):
        return LLM(
            params, page_size=PS, num_pages=4, max_num_seqs=2, max_num_batched_tokens=7,
            backend="xla", **kw,
        )  # fmt: skip

    plain = make(enable_prefix_caching=False)
    assert plain.generate([prompt], sp)[0].outputs[0].token_ids == want
    llm = make()
    bm = llm.block_manager
    (first,) = llm.generate([prompt], sp)
    assert first.outputs[0].token_ids == want and bm.stats().evictions > 0
    (again,) = llm.generate([prompt], sp)
    assert again.num_cached_tokens == 36
    assert again.outputs[0].token_ids == want
    # Admitted while the first one runs (it decodes; the second waits for a seat).
    llm.add_request(prompt, sp, request_id="r1")
    while bm.stats().num_seqs == 0 or llm.scheduler.running[0].seqs[0].num_computed < 40:
        llm.step()
    llm.add_request(prompt, sp, request_id="r2")
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["r2"].num_cached_tokens == 36
    assert [outs[r].outputs[0].token_ids for r in ("r1", "r2")] == [want, want]
    bm.check_invariants()
