"""Tests for pagedjax.blocks: unit tests per operation, plus runs of the hypothesis state
machine of tests/block_machine.py, which drives a simulated device cache and checks every
computed slot after every step (a wrong prefix hit, a missed copy-on-write or a page reused
while held shows up as a slot holding some other prefix's K/V). The errors, and what a
failed call leaves untouched, are in tests/test_blocks_errors.py."""

import hashlib

import numpy as np
import pytest
from block_machine import BlockMachine, run_stateful, snapshot
from blocks_helpers import computed, prompt

from pagedjax import page_hashes
from pagedjax.blocks import BlockManager, InvalidArgument, InvariantViolation, OutOfPages

# ------------------------------------------------------------------ allocation


def test_admit_reserves_pages_and_slots_follow_the_page_table():
    bm = BlockManager(16, 4)
    assert bm.admit("a", prompt(10)) == 0
    table = bm.page_table("a")
    assert table == [0, 1, 2]  # the free list pops page 0 first
    pos = np.arange(10)
    want = np.asarray(table)[pos // 4] * 4 + pos % 4
    np.testing.assert_array_equal(bm.slot_mapping("a", 0, 10), want)
    np.testing.assert_array_equal(bm.slot_mapping("a", 3, 7), want[3:7])
    assert bm.slot_mapping("a", 0, 10).dtype == np.int32
    assert bm.num_tokens("a") == 10 and bm.num_computed_tokens("a") == 0
    assert bm.stats().num_used_pages == 3 and bm.stats().num_free_pages == 13
    bm.check_invariants()


def test_append_allocates_only_at_page_boundaries():
    bm = BlockManager(8, 4)
    computed(bm, 0, prompt(6))
    slots = [bm.append_token(0, t)[0] for t in prompt(6)]  # positions 6..11
    table = bm.page_table(0)
    assert len(table) == 3
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(6, 12)]
    assert bm.stats().num_used_pages == 3
    bm.check_invariants()


def test_batched_append_matches_single_appends():
    toks = [prompt(n) for n in (5, 8, 3)]
    one, many = BlockManager(32, 4), BlockManager(32, 4)
    for bm in (one, many):
        for i, t in enumerate(toks):
            computed(bm, i, t)
    for step in range(9):
        new = prompt(3)
        want = [one.append_token(i, t)[0] for i, t in enumerate(new)]
        got, copies = many.append_tokens([0, 1, 2], new)
        assert got.tolist() == want and copies == [], step
    assert [many.page_table(i) for i in range(3)] == [one.page_table(i) for i in range(3)]
    many.check_invariants()


def test_page_tables_pads_rows():
    bm = BlockManager(16, 4)
    computed(bm, "a", prompt(9))
    computed(bm, "b", prompt(2))
    out = bm.page_tables(["a", "b"], width=5, pad=7)
    assert out.dtype == np.int32 and out.shape == (2, 5)
    assert out[0].tolist() == bm.page_table("a") + [7, 7]
    assert out[1].tolist() == bm.page_table("b") + [7] * 4
    with pytest.raises(InvalidArgument, match="width=2"):
        bm.page_tables(["a"], width=2)


def test_free_returns_pages_and_ids_can_be_readmitted():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    computed(bm, "a", prompt(12))
    bm.free("a")
    s = bm.stats()
    assert (s.num_free_pages, s.num_used_pages, s.num_cached_pages) == (8, 0, 0)
    assert "a" not in bm
    bm.admit("a", prompt(3))
    assert "a" in bm
    bm.check_invariants()


# --------------------------------------------------------- fork and copy-on-write


def test_fork_shares_pages_and_copies_only_the_partial_last_page():
    bm = BlockManager(16, 4)
    computed(bm, "p", prompt(10))  # pages: full, full, 2/4
    bm.fork("p", "c")
    assert bm.page_table("c") == bm.page_table("p")
    assert bm.stats().num_used_pages == 3
    last = bm.page_table("p")[-1]
    slot, copies = bm.append_token("c", 5)
    new = bm.page_table("c")[-1]
    assert copies == [(last, new)] and new != last and slot == new * 4 + 2
    assert bm.page_table("c")[:2] == bm.page_table("p")[:2]  # full pages stay shared
    slot, copies = bm.append_token("p", 6)  # now the sole holder: writes in place
    assert copies == [] and slot == last * 4 + 2
    assert bm.stats().cow_copies == 1
    bm.check_invariants()


def test_fork_at_a_page_boundary_needs_no_copy():
    bm = BlockManager(16, 4)
    computed(bm, "p", prompt(8))
    bm.fork("p", "c")
    slots, copies = bm.append_tokens(["p", "c"], [1, 2])
    assert copies == [] and slots[0] != slots[1] and bm.stats().num_used_pages == 4
    bm.check_invariants()


def test_beam_fork_and_free_every_step():
    bm = BlockManager(64, 4)
    computed(bm, 0, prompt(7))
    beams, next_id = [0], 1
    for _ in range(30):
        survivors = beams[:2]
        for b in beams[2:]:
            bm.free(b)
        beams = list(survivors)
        for b in survivors:
            bm.fork(b, next_id)
            beams.append(next_id)
            next_id += 1
        slots, copies = bm.append_tokens(beams, prompt(len(beams)))
        assert len(set(slots.tolist())) == len(beams)  # no two beams write one slot
        bm.check_invariants()
    assert bm.stats().cow_copies > 0


def test_copy_count_is_exact_when_every_holder_appends():
    bm = BlockManager(4, 4)
    computed(bm, 0, prompt(6))  # 2 pages, the last one partial
    bm.fork(0, 1)
    bm.fork(0, 2)  # 3 holders of the partial page, 2 pages left: 2 copies suffice
    assert bm.num_append_pages([0, 1, 2]) == 2
    slots, copies = bm.append_tokens([0, 1, 2], [1, 2, 3])
    assert len(copies) == 2 and bm.stats().num_free_pages == 0
    bm.check_invariants()


def test_copy_count_is_exact_when_some_holders_append():
    bm = BlockManager(3, 4)
    computed(bm, 0, prompt(6))
    bm.fork(0, 1)
    bm.fork(0, 2)  # 3 holders, 2 of them append: both must copy, only 1 page is left
    assert bm.num_append_pages([1, 2]) == 2
    before = snapshot(bm)
    with pytest.raises(OutOfPages):
        bm.append_tokens([1, 2], [1, 2])
    assert snapshot(bm) == before
    slot, copies = bm.append_token(1, 1)
    assert len(copies) == 1 and bm.num_append_pages([0, 2]) == 1
    bm.check_invariants()


# ------------------------------------------------------------------ prefix cache


def test_prefix_reuse_three_shared_pages():
    bm = BlockManager(32, 4)
    shared = prompt(12)
    computed(bm, "a", shared + prompt(3))
    table_a, free_before = bm.page_table("a"), bm.stats().num_free_pages
    assert bm.admit("b", shared + prompt(6)) == 12
    assert bm.page_table("b")[:3] == table_a[:3]
    assert free_before - bm.stats().num_free_pages == 2  # only the 6 new tokens' pages
    s = bm.stats()
    assert (s.prefix_queries, s.prefix_hits) == (15 + 18, 12)
    bm.check_invariants()


def test_a_readmission_can_stay_out_of_the_prefix_stats():
    bm = BlockManager(32, 4)
    shared = prompt(12)
    computed(bm, "a", shared + prompt(3))
    assert bm.admit("b", shared + prompt(6), count_stats=False) == 12
    s = bm.stats()
    assert (s.prefix_queries, s.prefix_hits) == (15, 0)
    # Nor is an admission that does not read the cache (prompt logprobs), or any with
    # caching off (vLLM's): its tokens were counted as misses.
    assert bm.admit("d", shared + prompt(5), read_cache=False) == 0
    assert (bm.stats().prefix_queries, bm.stats().prefix_hits) == (15, 0)
    off = BlockManager(32, 4, enable_prefix_caching=False)
    computed(off, "a", shared + prompt(3))
    assert (off.stats().prefix_queries, off.stats().prefix_hit_rate) == (0, 0.0)
    state = bm.stats()
    with pytest.raises(InvalidArgument, match="count_stats must be a bool, got count_stats=1"):
        bm.admit("c", shared, count_stats=1)
    assert bm.stats() == state
    with pytest.raises(KeyError):
        bm.page_table("c")
    bm.check_invariants()


def test_admit_without_reading_the_cache_computes_the_whole_prompt():
    bm = BlockManager(32, 4)
    toks = prompt(13)
    computed(bm, "a", toks)
    assert bm.admit("b", toks, read_cache=False) == 0  # 3 cached pages, not used
    assert not set(bm.page_table("b")) & set(bm.page_table("a"))
    bm.mark_computed("b", 13)  # its full pages duplicate cached content: not re-registered
    table_a = bm.page_table("a")
    bm.free("a")
    assert bm.admit("c", toks) == 12  # a's pages still serve later requests
    assert bm.page_table("c")[:3] == table_a[:3]
    bm.check_invariants()


def test_pages_are_not_found_before_they_are_computed():
    bm = BlockManager(32, 4)
    toks = prompt(16)
    bm.admit("a", toks)
    assert bm.admit("b", toks) == 0
    bm.mark_computed("a", 9)  # two full pages computed, third in flight
    assert bm.admit("c", toks) == 8
    bm.check_invariants()


def test_a_full_hit_still_leaves_one_token_to_compute():
    bm = BlockManager(32, 4)
    toks = prompt(12)
    computed(bm, "a", toks)
    assert bm.admit("b", toks) == 8
    assert bm.admit("c", toks[:9]) == 8
    assert bm.admit("d", toks[:8]) == 4


def test_a_caller_computing_what_follows_takes_every_cached_page():
    """compute_last=False (the token after the prompt is fed as a decode row elsewhere):
    every full page may be a hit; a prompt cached whole comes computed, holding only its
    cached pages, and can fork and append at once."""
    bm = BlockManager(8, 4)
    toks = prompt(12)
    computed(bm, "a", toks)
    table_a = bm.page_table("a")
    bm.free("a")  # 3 cached pages, evictable
    assert bm.admit("b", toks[:8], compute_last=False) == 8
    assert bm.page_table("b") == table_a[:2] and bm.num_computed_tokens("b") == 8
    assert bm.admit("c", toks[:9], compute_last=False) == 8  # as with compute_last=True
    assert bm.admit("d", toks[:4] + prompt(4), compute_last=False) == 4
    assert bm.admit("e", toks[:8], read_cache=False, compute_last=False) == 0
    s = bm.stats()
    assert (s.prefix_queries, s.prefix_hits, bm.num_free_pages) == (
        12 + 8 + 9 + 8,
        20,
        2,
    )  # (not e)
    bm.fork("b", "b2")
    slots, copies = bm.append_tokens(["b", "b2"], toks[8:10])  # a new page each, no copy
    assert copies == [] and len(set(slots.tolist())) == 2 and bm.num_free_pages == 0
    bm.check_invariants()


@pytest.mark.parametrize("window, held", [(1, 1), (5, 1), (6, 2), (9, 2), (10, 3), (None, 3)])
def test_a_prompt_cached_whole_reserves_nothing_and_keeps_its_window(window, held):
    """With peak_pages and a window: no page for a next token and no reservation (the
    prompt is computed); the pages below the next token's window are not taken, but the
    last one is (W = 1 reads none; release_before keeps it too)."""
    bm = BlockManager(8, 4)
    toks = prompt(12)
    computed(bm, "a", toks)
    pages = bm.page_table("a")
    bm.free("a")
    free, before = bm.num_free_pages, snapshot(bm)
    kw = dict(window=window, compute_last=False)
    if held > 1:
        with pytest.raises(InvalidArgument, match=f"{held} pages, more than peak_pages={held - 1}"):
            bm.admit("b", toks, peak_pages=held - 1, **kw)
        assert snapshot(bm) == before
    assert bm.admit("b", toks, peak_pages=held, **kw) == 12
    assert bm.page_table("b") == [-1] * (3 - held) + pages[3 - held :]
    assert bm.num_reserved_pages == 0 and bm.num_free_pages == free - held
    bm.check_invariants()
    assert bm.release_before("b", 12) == held - 1
    bm.append_token("b", 5)
    bm.check_invariants()


def test_salt_isolation():
    bm = BlockManager(64, 4)
    toks = prompt(13)
    computed(bm, "a", toks, salt="tenant-a")
    assert bm.admit("b", toks, cache_salt="tenant-b") == 0
    assert bm.admit("c", toks) == 0
    assert bm.admit("d", toks, cache_salt=b"tenant-a") == 0  # bytes and str never mix
    assert bm.admit("e", toks, cache_salt="tenant-a") == 12
    assert not set(bm.page_table("b")) & set(bm.page_table("a"))
    bm.check_invariants()


def test_cached_pages_survive_free_until_evicted_tail_first():
    bm = BlockManager(6, 4)
    toks = prompt(14)  # 3 full pages + 1 partial
    computed(bm, "a", toks)
    table = bm.page_table("a")
    bm.free("a")
    s = bm.stats()
    assert (s.num_evictable_pages, s.num_free_pages, s.num_cached_pages) == (3, 3, 3)
    bm.admit("x", prompt(16))  # 4 pages: 3 free + 1 eviction, which must take the tail
    assert bm.stats().evictions == 1 and table[2] in bm.page_table("x")
    bm.free("x")
    assert bm.admit("a", toks) == 8
    assert bm.page_table("a")[:2] == table[:2]
    bm.check_invariants()


def test_preempt_then_readmit_reuses_prompt_and_decode_pages():
    bm = BlockManager(32, 4)
    toks = prompt(10)
    computed(bm, "s", toks)
    out = prompt(7)
    for t in out:
        bm.append_token("s", t)
    table = bm.page_table("s")
    bm.free("s")  # preempted: recompute later from everything it has
    assert bm.admit("s", toks + out) == 16  # 17 tokens: 4 full pages, 1 token left
    assert bm.page_table("s")[:4] == table[:4]
    bm.check_invariants()


def test_racing_duplicates_chain_onto_the_registered_copy():
    bm = BlockManager(32, 4)
    toks = prompt(8)
    bm.admit("a", toks)
    bm.admit("b", toks)  # both cold: the same prefix is computed twice
    bm.mark_computed("a", 8)
    bm.mark_computed("b", 8)
    assert bm.stats().num_cached_pages == 2  # one copy registered, b's are duplicates
    tail = prompt(4)
    for t in tail:
        bm.append_token("b", t)  # b's decode page chains onto a's registered pages
    assert bm.stats().num_cached_pages == 3
    assert bm.admit("c", toks + tail + [1]) == 12
    assert bm.page_table("c")[2] == bm.page_table("b")[2]
    bm.check_invariants()


def test_evicting_a_registered_page_moves_its_registration_onto_a_duplicate_in_use():
    """Two requests computed one prefix at once (b's pages duplicate a's registered ones).
    Evicting a's copy once a is done used to forget the content and everything cached
    under it while b still held it (vLLM registers every copy): the registration now moves
    onto b's page, b's chain stays cached, and a later prompt hits it all."""
    bm = BlockManager(8, 4)
    toks = prompt(8)
    bm.admit("a", toks)
    bm.admit("b", toks)
    bm.mark_computed("a", 8)
    bm.mark_computed("b", 8)  # b's two pages duplicate a's registered ones
    tail = prompt(4)
    for t in tail:
        bm.append_token("b", t)  # registered as a child of a's second page
    assert bm.stats().num_cached_pages == 3
    table_b = bm.page_table("b")
    bm.free("a")  # a's pages evictable, b's copies still in use
    bm.admit("x", prompt(16))  # 3 free pages + 1 eviction: a's second page
    assert bm.stats().evictions == 1 and bm.stats().num_cached_pages == 3
    bm.check_invariants()
    bm.free("x")
    assert bm.admit("c", toks + tail + [1]) == 12
    assert bm.page_table("c")[1:3] == table_b[1:3]  # b's copy of the second page, its child
    bm.check_invariants()
    # With no duplicate left, evicting a page uncaches the pages cached under it.
    for sid in ("b", "c"):
        bm.free(sid)
    assert bm.stats().num_evictable_pages == 3  # a's first page, b's second and child
    bm.admit("y", prompt(32))  # every page: all three evicted, none moved
    assert bm.stats().num_cached_pages == 0 and bm.stats().evictions == 1 + 3
    bm.check_invariants()


def test_a_duplicate_is_forgotten_when_freed_or_uncached():
    """A duplicate stops standing in for its content when its holder lets it go (it is
    a plain free page, later reused) or when it is uncached (its K/V not on the device:
    a failed step): evicting the registered copy then forgets the content."""
    for how in ("free", "uncache"):
        bm = BlockManager(6, 4)
        toks = prompt(4)
        bm.admit("a", toks + [1])
        bm.admit("b", toks + [1])
        bm.mark_computed("a", 4)
        bm.mark_computed("b", 4)  # b's page 0 duplicates a's
        dup = bm.page_table("b")[0]
        if how == "free":
            bm.free("b")
        else:
            assert bm.uncache([dup]) == 0  # (not cached itself)
            bm.free("b")
        bm.check_invariants()
        bm.free("a")
        bm.admit("x", prompt(24))  # every page: a's evicted, nothing to move onto
        assert bm.stats().num_cached_pages == 0
        bm.check_invariants()


def test_prefix_caching_disabled():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    toks = prompt(12)
    computed(bm, "a", toks)
    assert bm.admit("b", toks) == 0
    bm.free("a")
    assert bm.stats().num_cached_pages == 0 and bm.stats().num_evictable_pages == 0
    bm.check_invariants()


def constant_digest(data: bytes) -> bytes:
    return b"\x00" * 32


def test_forced_collision_never_reuses_a_wrong_page(monkeypatch):
    monkeypatch.setattr(page_hashes, "digest", constant_digest)
    bm = BlockManager(32, 4)
    x, y = prompt(4), prompt(4)
    computed(bm, "a", x + y + [1])  # page x registered; page y collides and is skipped
    assert bm.admit("b", y + x + [1]) == 0  # page y after nothing is not page y after x
    assert bm.admit("c", x + y + [1], cache_salt="s") == 0  # another salt
    assert bm.admit("d", prompt(4) + [1]) == 0  # other tokens, same hash
    assert bm.admit("e", x + [1]) == 4  # the true match still hits
    bm.check_invariants()


def test_forced_collision_on_page_tokens_only(monkeypatch):
    # A hash that ignores the parent and the salt: equal pages under different prefixes
    # collide; the registration-id check must reject them.
    monkeypatch.setattr(page_hashes, "digest", lambda data: hashlib.sha256(data[-32:]).digest())
    bm = BlockManager(32, 4)
    x, y = prompt(4), prompt(4)
    computed(bm, "a", x + y + [1])
    assert bm.admit("b", y + y + [1]) == 0
    assert bm.admit("c", prompt(4) + y + [1]) == 0
    assert bm.admit("d", x + y + [1], cache_salt="other") == 0
    assert bm.admit("e", x + y + [1]) == 8
    bm.check_invariants()


def test_evictable_hits_are_paid_for_at_admission():
    """Taking a cached hit out of the evictable LRU uses up one of the free pages too."""
    bm = BlockManager(4, 4)
    toks = prompt(9)
    computed(bm, "a", toks)  # pages 0, 1 cached, 2 partial
    bm.free("a")  # 2 free, 2 evictable
    before = snapshot(bm)
    with pytest.raises(OutOfPages) as info:
        bm.admit("b", toks[:8] + prompt(12))  # 2 hits and 3 new pages: 5 > 4
    assert (info.value.needed, info.value.available) == (3, 2)
    assert snapshot(bm) == before
    assert bm.admit("b", toks[:8] + prompt(8)) == 8  # 2 hits and 2 new pages fit exactly
    assert bm.num_free_pages == 0
    bm.check_invariants()


def test_uncache_frees_unreferenced_pages_with_the_pages_cached_under_them():
    bm = BlockManager(4, 4)
    toks = prompt(16)
    computed(bm, "a", toks)  # pages 0-3, one chain
    bm.free("a")
    assert bm.uncache([2, 2]) == 2  # page 2 and page 3 under it; the repeat is skipped
    s = bm.stats()
    assert (s.num_free_pages, s.num_evictable_pages, s.num_cached_pages) == (2, 2, 2)
    bm.check_invariants()
    assert bm.admit("b", toks) == 8  # the rest of the chain is gone
    bm.check_invariants()
    # uncache() forgets every cached page, the last page id included.
    bm = BlockManager(4, 4)
    bm.admit("x", prompt(12))  # pages 0-2, nothing computed
    computed(bm, "y", prompt(4))  # page 3: the root of its own chain
    assert bm.stats().num_cached_pages == 1
    assert bm.uncache() == 1 and bm.stats().num_cached_pages == 0
    bm.check_invariants()


# --------------------------------------------------------------- sliding window


@pytest.mark.parametrize("window, released", [(1, 3), (2, 2), (5, 2), (6, 1), (9, 1), (10, 0)])
def test_admit_takes_exactly_the_cached_pages_in_the_first_tokens_window(window, released):
    """12 cached tokens: the first token to compute (12) sees keys > 12 - window; a page
    is left out only when all four of its positions are below that."""
    bm = BlockManager(16, 4)
    toks = prompt(13)
    computed(bm, "a", toks)
    pages = bm.page_table("a")
    bm.free("a")
    assert bm.admit("b", toks, window=window) == 12
    assert bm.page_table("b")[:3] == [-1] * released + pages[released:3]
    bm.check_invariants()


def test_release_before_gives_back_pages_tail_first():
    """Pages released in one call enter the LRU tail first, as in free: an eviction then
    takes the tail, and the head stays a prefix hit."""
    bm = BlockManager(5, 4)
    toks = prompt(13)
    computed(bm, "a", toks)  # pages 0-2 cached, 3 partial; page 4 free
    assert bm.release_before("a", 12) == 3
    assert bm.slot_mapping("a", 4, 4).shape == (0,)  # an empty range reaches nothing
    computed(bm, "x", prompt(8))  # page 4 and one eviction: the tail, page 2
    assert (bm.stats().evictions, bm.page_table("x")) == (1, [4, 2])
    bm.free("x")
    assert bm.admit("b", toks) == 8
    bm.check_invariants()


# ----------------------------------------------------------- watermark, stats


def test_can_admit_respects_watermark_and_counts_evictable_pages():
    bm = BlockManager(100, 4, watermark=0.1)
    assert bm.watermark_pages == 10
    assert bm.can_admit(90 * 4) and not bm.can_admit(90 * 4 + 1)
    computed(bm, "a", prompt(80 * 4))
    bm.free("a")  # 79 pages cached and evictable
    assert bm.can_admit(90 * 4)
    assert BlockManager(10, 4, watermark=0.0).can_admit(40)


def test_stats_counts():
    bm = BlockManager(8, 4)
    computed(bm, "a", prompt(6))
    bm.fork("a", "b")
    bm.append_tokens(["a", "b"], [1, 2])
    s = bm.stats()
    assert (s.num_pages, s.num_seqs, s.cow_copies, s.num_used_pages) == (8, 2, 1, 3)
    assert s.kv_usage == pytest.approx(3 / 8)
    assert (s.prefix_queries, s.prefix_hits, s.prefix_hit_rate) == (6, 0, 0.0)


def test_check_invariants_catches_corruption():
    bm = BlockManager(8, 4)
    computed(bm, "a", prompt(9))
    bm.check_invariants()
    bm._refcount[bm.page_table("a")[0]] += 1
    with pytest.raises(InvariantViolation, match="refcount"):
        bm.check_invariants()
    bm._refcount[bm.page_table("a")[0]] -= 1
    p = bm.page_table("a")[1]
    bm._prefix.entries[p].tokens = bytes(32)
    with pytest.raises(InvariantViolation, match="tokens"):
        bm.check_invariants()


# --------------------------------------------------------------- state machine


def run_machine(monkeypatch, digest, examples, steps, check_hits=True) -> int:
    """Runs the machine; returns the number of rule steps it took."""
    if digest is not None:
        monkeypatch.setattr(page_hashes, "digest", digest)
    return run_stateful(BlockMachine, examples, steps, check_hits=check_hits)


def page_only_digest(data: bytes) -> bytes:
    return hashlib.sha256(data[-8:]).digest()  # ignores parent, salt, most of the page


DIGESTS = [(None, True), (constant_digest, False), (page_only_digest, False)]


@pytest.mark.parametrize("digest, check_hits", DIGESTS, ids=["sha256", "constant", "page"])
def test_state_machine(monkeypatch, digest, check_hits):
    examples = 60 if digest is None else 15
    steps = run_machine(monkeypatch, digest, examples, 50, check_hits)
    assert steps >= (1500 if digest is None else 300), steps


@pytest.mark.slow
@pytest.mark.parametrize("digest, check_hits", DIGESTS, ids=["sha256", "constant", "page"])
def test_state_machine_long(monkeypatch, digest, check_hits):
    examples = 400 if digest is None else 200  # ~20 s of one CPU core for sha256
    steps = run_machine(monkeypatch, digest, examples, 100, check_hits)
    assert steps >= (25_000 if digest is None else 10_000), steps
