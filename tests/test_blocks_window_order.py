"""The order in which a freed sequence's cached pages are evicted (`SeqTables.free`).

Knowing the model's window W (`BlockManager.set_sliding_window`), eviction keeps what is
cached under a page, so a page is worth keeping only for a hit point less than W tokens
above it: `free` renews the pages in the window of the prompt's end (the same prompt
again) and of the sequence's end (a continuation), and leaves the others (the prompt's
head, the middle of the output) to be evicted first. Full attention keeps its order: the
whole chain tail first, so a prefix's head is evicted last. A request readmitted after
preemption (its prompt plus its output so far) names its prompt's length on admission
(`num_prompt_tokens`), so its free still renews the original prompt's window.
"""

import re

import numpy as np
import pytest
from block_machine import snapshot

from pagedjax.blocks import BlockManager, InvalidArgument

W, PS = 8, 4
PROMPT = list(range(100, 140))  # 40 tokens: 10 full pages
OUTPUT = list(range(500, 508))  # 8 decoded tokens: 2 more pages


def decoded(bm: BlockManager, window: int | None) -> list[int]:
    """Admits PROMPT as "a" (with ``window``), prefills it, decodes OUTPUT releasing the
    pages below the window as the scheduler does, and frees it; returns its chain's pages."""
    bm.admit("a", PROMPT, window=window)
    bm.mark_computed("a", len(PROMPT))
    for t in OUTPUT:
        if window and (c := bm.num_computed_tokens("a")) >= window:
            bm.release_before("a", c - window + 1)
        bm.append_tokens(["a"], [t])
    pages = bm._prefix.chain_pages(bm._seqs["a"].chain.node)[::-1]
    assert len(pages) == 12  # every page cached, none evicted yet
    bm.free("a")
    bm.check_invariants()
    return pages


def evict(bm: BlockManager, n: int) -> None:
    """Allocates every free page and ``n`` evictable ones (an unrelated prompt), then frees
    them uncached: exactly the ``n`` least recently freed cached pages are evicted."""
    k = len(bm._free) + n
    before = bm.stats().evictions
    bm.admit("x", list(range(5000, 5000 + k * PS)), read_cache=False)
    assert bm.stats().evictions == before + n
    bm.uncache(bm.page_table("x"))
    bm.free("x")
    bm.check_invariants()


def test_windowed_free_evicts_pages_below_the_last_windows_first():
    bm = BlockManager(16, PS, watermark=0, sliding_window=W)
    pages = decoded(bm, W)
    # Prompt's end 40: a hit at 36 reads positions >= 29, pages 7-9. Sequence's end 48: a
    # hit at 44 (or 48) reads positions >= 37, pages 9-11. The decode released pages 0-7,
    # tail first, then 8 and 9; 0-6 are the others, the least recently freed.
    far, prompt_window, end_window = pages[:7], pages[7:10], pages[9:]
    lru = list(bm._evictable)
    assert lru == far[::-1] + prompt_window[1::-1] + end_window[::-1]
    evict(bm, 7)
    assert set(bm._evictable) == {*prompt_window, *end_window}


def test_a_re_request_after_decoding_and_eviction_hits_its_windows():
    """The same prompt again and its continuation, after other requests evicted 7 of the
    12 pages: the far pages went, the windows hit whole (tail-first order: the windows
    went first, leaving 20 and 16 tokens)."""
    bm = BlockManager(16, PS, watermark=0, sliding_window=W)
    decoded(bm, W)
    evict(bm, 7)
    assert bm.admit("b", PROMPT, window=W) == 36  # hit point 36: pages 7, 8
    bm.check_invariants()
    bm.free("b")
    assert bm.admit("c", PROMPT + OUTPUT + [1, 2, 3], window=W) == 48  # pages 10, 11
    bm.check_invariants()


def test_the_prompt_window_survives_a_second_free():
    """Freeing the same prompt again (a second request that hit it and decoded other
    tokens) renews the prompt's window once more: it stays behind the far pages."""
    bm = BlockManager(24, PS, watermark=0, sliding_window=W)
    pages = decoded(bm, W)
    bm.admit("b", PROMPT, window=W)  # hits pages 7, 8; page 9 and on are new
    bm.mark_computed("b", len(PROMPT))
    bm.free("b")
    lru = list(bm._evictable)
    assert lru.index(pages[7]) > max(lru.index(p) for p in pages[:7])
    bm.check_invariants()


def test_full_attention_frees_the_chain_tail_first():
    """No sliding window known (the window only given to admit and release_before): the
    chain is renewed whole, tail first, whatever was released, as before."""
    bm = BlockManager(16, PS, watermark=0)
    pages = decoded(bm, W)
    assert list(bm._evictable) == pages[::-1]
    evict(bm, 7)  # the tail: nothing is cached under it
    assert sorted(bm._evictable) == sorted(pages[:5])
    assert bm.admit("b", PROMPT, window=W) == 20  # hit point 20: pages 3, 4
    bm.free("b")
    # A sequence that released nothing: its pages, tail first.
    bm = BlockManager(16, PS, watermark=0)
    bm.admit("a", PROMPT)
    bm.mark_computed("a", len(PROMPT))
    held = bm.page_table("a")
    bm.free("a")
    assert list(bm._evictable) == held[::-1]


def test_a_sequence_freed_mid_prefill_keeps_the_window_of_its_chain_end():
    """Preempted mid-prefill (8 of its 10 pages computed, none released): the same prompt
    again can hit only the 32 computed tokens, reading positions >= 25 (pages 6, 7), not
    the prompt end's window (pages 7-9). Those two are evicted last: after 6 evictions
    the hit is whole (renewing only page 7 evicted page 6 first, leaving a 4-token hit)."""
    bm = BlockManager(16, PS, watermark=0, sliding_window=W)
    bm.admit("a", PROMPT, window=W)
    bm.mark_computed("a", 32)
    pages = bm._prefix.chain_pages(bm._seqs["a"].chain.node)[::-1]
    bm.free("a")
    assert list(bm._evictable) == pages[5::-1] + [pages[7], pages[6]]
    evict(bm, 6)
    assert bm.admit("b", PROMPT, window=W) == 32
    bm.check_invariants()


def test_a_window_of_one_keeps_the_last_page_a_hit_needs():
    """W = 1: the same prompt again hits 36 tokens and reads none of them, but the hit
    needs its last page (8) cached, as admit keeps it: it is renewed with page 9, and
    survives 8 evictions (renewing page 9 alone evicted page 8 first: a 4-token hit)."""
    bm = BlockManager(16, PS, watermark=0, sliding_window=1)
    bm.admit("a", PROMPT, window=1)
    bm.mark_computed("a", len(PROMPT))
    pages = bm._prefix.chain_pages(bm._seqs["a"].chain.node)[::-1]
    bm.free("a")
    assert list(bm._evictable) == pages[7::-1] + [pages[9], pages[8]]
    evict(bm, 8)
    assert bm.admit("b", PROMPT, window=1) == 36
    bm.check_invariants()


def test_a_readmitted_request_renews_its_original_prompts_window():
    """A request preempted after decoding OUTPUT comes back as PROMPT + OUTPUT (48 tokens)
    and names its prompt (``num_prompt_tokens=40``): freed, it renews the window of the
    prompt's end (pages 7-9) and of its own end (9-11), so after 7 evictions the same
    prompt again hits 36 tokens. Admitted as a 48-token prompt, both windows are pages
    9-11: pages 7 and 8 go first, and the same prompt hits only 8 tokens (pages 0, 1).
    A fork carries the prompt length; ``check_invariants`` holds throughout."""
    hits = {}
    for num_prompt in (len(PROMPT), None):
        bm = BlockManager(16, PS, watermark=0, sliding_window=W)
        bm.admit("a", PROMPT + OUTPUT, window=W, num_prompt_tokens=num_prompt)
        bm.mark_computed("a", len(PROMPT) + len(OUTPUT))
        bm.fork("a", "a2")
        assert bm._seqs["a2"].num_prompt == (num_prompt or len(PROMPT) + len(OUTPUT))
        pages = bm._prefix.chain_pages(bm._seqs["a"].chain.node)[::-1]
        bm.free("a")  # a2 still holds every page: nothing to renew yet
        bm.check_invariants()
        bm.free("a2")
        bm.check_invariants()
        if num_prompt:
            assert list(bm._evictable) == pages[6::-1] + pages[8:6:-1] + pages[:8:-1]
        else:
            assert list(bm._evictable) == pages[8::-1] + pages[:8:-1]
        evict(bm, 7)
        hits[num_prompt] = bm.admit("b", PROMPT, window=W)
        bm.check_invariants()
    assert hits == {len(PROMPT): 36, None: 8}


def test_a_bad_num_prompt_tokens_is_refused_before_anything_changes():
    bm = BlockManager(16, PS, watermark=0, sliding_window=W)
    decoded(bm, W)
    bm.admit("b", PROMPT[:12], window=W, num_prompt_tokens=5)
    before = snapshot(bm), bm._seqs["b"].num_prompt
    for bad in (0, -1, len(PROMPT) + 1, np.int64(0), True, 4.0, "40"):
        error = (
            InvalidArgument if isinstance(bad, (int, np.integer)) and bad is not True else TypeError
        )
        with pytest.raises(error, match=re.escape(f"num_prompt_tokens={bad!r}")):
            bm.admit("c", PROMPT, window=W, num_prompt_tokens=bad)
        assert "c" not in bm and (snapshot(bm), bm._seqs["b"].num_prompt) == before
    bm.check_invariants()
    # In range (numpy ints too), and the default: the admitted length.
    bm.admit("c", PROMPT, window=W, num_prompt_tokens=np.int64(len(PROMPT)))
    bm.admit("d", PROMPT[:3], num_prompt_tokens=1)
    bm.admit("e", PROMPT[:7])
    assert [bm._seqs[s].num_prompt for s in "bcde"] == [5, len(PROMPT), 1, 7]
    bm.check_invariants()


def test_the_scheduler_readmits_a_preempted_request_with_its_prompt_length():
    """A window model's requests preempted mid-decode (two that each grow to 5 pages under
    W = 16 share 8) are readmitted with their prompt and output so far; the block manager
    still knows each one's prompt length, up to the free that ends it."""
    from test_scheduler import reference
    from test_window_admission import WindowSim  # (imports the engine: only here)

    sim = WindowSim(16, num_pages=8, max_num_seqs=2, budget=8)
    bm, admitted, freed = sim.bm, [], []
    admit, free = bm.admit, bm.free

    def spy_admit(seq_id, token_ids, **kw):
        admitted.append(len(token_ids))
        return admit(seq_id, token_ids, **kw)

    def spy_free(seq_id):
        freed.append((bm._seqs[seq_id].num_prompt, bm.num_tokens(seq_id)))
        free(seq_id)

    bm.admit, bm.free = spy_admit, spy_free
    prompts = {"a": list(range(3, 13)), "b": list(range(20, 30))}
    groups = [sim.add(rid, p, 24) for rid, p in prompts.items()]
    sim.run()
    assert sum(g.num_preemptions for g in groups) > 0
    for g, p in zip(groups, prompts.values(), strict=True):
        assert g.finished[0].token_ids == reference(p, 24)
    assert len(admitted) == len(freed) == 2 + sum(g.num_preemptions for g in groups)
    assert max(admitted) > 10  # readmitted with output, and freed again
    assert [n for n, _ in freed] == [10] * len(freed)
    assert max(m for _, m in freed) == 10 + 24 - 1  # (the last token is never fed)
