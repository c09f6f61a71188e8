"""Review 30 of prefix-cache admission: a sequence's page hashes are computed once.

A request blocked at the head of the waiting queue (too few free pages) is counted by
`Scheduler._admit_pages` every step, and each count looked its prompt up in the prefix
cache, hashing every cached page of it again (and `admit` hashed it once more): about a
millisecond a step for a 32k-token prompt. The hashes are now kept on the sequence
(`Sequence.page_hashes`, a `page_hashes.PageHashes`) and extended as it grows, as vLLM
keeps a request's block hashes; a token list that is replaced gets new ones, so old hashes
never make a hit.
"""

import collections

import numpy as np
import pytest
from test_scheduler import PS, Sim, reference

from pagedjax import page_hashes
from pagedjax.blocks import BlockManager, InvalidArgument
from pagedjax.prefix_cache import PageHashes, salt_bytes
from pagedjax.scheduler import SeqStatus

BIG = list(range(1000, 1000 + 12 * PS)) + [7]  # 12 full pages and 1 token
HOG = list(range(2000, 2000 + 20 * PS))  # 20 full pages


def page_bytes(tokens, i):
    return np.array(tokens[i * PS : (i + 1) * PS], "<i8").tobytes()


@pytest.fixture
def digests(monkeypatch):
    """Counts the prefix-cache digests of each of BIG's pages (by the page's tokens)."""
    pages = {page_bytes(BIG, i): i for i in range(len(BIG) // PS)}
    counts = collections.Counter()
    digest = page_hashes.digest

    def counting(data):
        i = pages.get(bytes(data[32:]))
        if i is not None:
            counts[i] += 1
        return digest(data)

    monkeypatch.setattr(page_hashes, "digest", counting)
    return counts


def blocked_big(in_flight=False):
    """32 pages: BIG's 12 full pages cached (evictable), then `hog` holds the other 20 and
    grows into them; `big` (13 pages) waits for it at the head of the queue."""
    sim = Sim(num_pages=32, max_num_seqs=4, budget=64, in_flight=in_flight)
    sim.add("warm", [*BIG[:-1], 9], 1)
    sim.run()
    assert sim.bm.stats().num_evictable_pages == 12
    sim.add("hog", HOG, 12)
    sim.step()
    return sim, sim.add("big", BIG, 3)


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_a_blocked_head_of_line_prompt_is_hashed_once(digests, in_flight):
    """Each step `big` waited, its cached pages were hashed again (12 steps, ~11 pages
    each); now each page is hashed once while it waits and its admission hashes none
    again (only the pages it computes are hashed once more, when they are registered)."""
    sim, big = blocked_big(in_flight)
    digests.clear()
    steps = 0
    while big.status is SeqStatus.WAITING:
        sim.step()
        steps += 1
    assert steps >= 10 and "hog" in sim.done
    hits = big.seqs[0].num_cached_tokens // PS
    assert 0 < hits < 12  # (hog's growth evicted its tail)
    while sim.sched.has_unfinished() or sim.inflight is not None:
        sim.step()  # (not sim.run(): check_invariants hashes every cached page)
    assert [digests[i] for i in range(hits)] == [1] * hits, digests
    assert all(digests[i] <= 2 for i in range(hits, 12)), digests
    sim.bm.check_invariants()
    assert sim.done["big"].finished[0].token_ids == reference(BIG, 3)
    assert sim.sched.num_preemptions == 0


def test_hashes_are_kept_across_steps_and_extended_as_the_sequence_grows():
    """The waiting sequence's hashes are the same object step after step; preempted with
    its output, it is readmitted hashing on from where its hashes stopped."""
    sim, big = blocked_big()
    sim.step()
    s = big.seqs[0]
    kept = s.page_hashes
    assert kept is not None and kept.source is s.token_ids and len(kept.hashes) == 12
    sim.step()
    assert s.page_hashes is kept
    kept.hashes[0] = b"\0" * 32  # (a hash it would compute again would not be this)
    sim.step()
    assert s.page_hashes is kept and kept.hashes[0] == b"\0" * 32


def test_a_replaced_token_list_never_hits_with_its_old_hashes():
    """`big` waits with BIG hashed, 12 of its pages cached; then its token list is
    replaced (as a beam taking another beam's tokens would): the new tokens share no page
    with BIG, and the old hashes would hit BIG's cached pages for them. It is admitted
    with no hit and computes its own tokens (the simulated pool checks every slot)."""
    sim, big = blocked_big()
    sim.step()
    s = big.seqs[0]
    old = s.page_hashes
    assert len(old.hashes) == 12
    other = list(range(5000, 5000 + len(BIG)))
    s.token_ids = list(other)
    sim.run()
    assert s.page_hashes is not old and s.num_cached_tokens == 0
    assert sim.done["big"].finished[0].token_ids == reference(other, 3)


def test_a_salt_change_gets_new_hashes():
    """A group whose salt changes while it waits (a LoRA adapter's salt) is hashed anew:
    BIG's pages cached under no salt are no hit for it."""
    sim, big = blocked_big()
    sim.step()
    s = big.seqs[0]
    old = s.page_hashes
    big.cache_salt = "other"
    sim.run()
    assert s.page_hashes is not old and s.num_cached_tokens == 0
    assert sim.done["big"].finished[0].token_ids == reference(BIG, 3)


def test_admit_refuses_hashes_of_a_list_edited_in_place():
    """Hashes kept for a list whose tokens were overwritten in place (the same list, as
    long) cannot be told stale by the list; `admit` checks the hashed tokens against the
    prompt and refuses them, changing nothing, rather than hit with them."""
    bm = BlockManager(16, PS)
    bm.admit("a", BIG)
    bm.mark_computed("a", len(BIG))
    bm.free("a")
    tokens = list(BIG)
    ph = PageHashes(tokens, salt_bytes(None), PS)
    assert bm.admit_pages([(ph.prefix(len(tokens)), True)]) == 13  # (12 evictable hits)
    assert len(ph.hashes) == 12
    tokens[:] = range(5000, 5000 + len(BIG))
    before = bm.stats()
    with pytest.raises(InvalidArgument, match="changed in place"):
        bm.admit("b", ph.prefix(len(tokens)))
    assert bm.stats() == before and "b" not in bm
    bm.check_invariants()
    assert bm.admit("b", PageHashes(tokens, salt_bytes(None), PS).prefix(len(tokens))) == 0


@pytest.mark.parametrize("window", [None, 6])
def test_hashed_prompts_count_and_hit_as_token_lists_do(window):
    """`admit_pages` and `admit` given a growing list's kept hashes agree with the same
    calls given the tokens, at every length, on a cache where pages come and go."""
    rng = np.random.default_rng(0)
    a, b = (BlockManager(24, PS, sliding_window=window) for _ in range(2))
    base = [int(t) for t in rng.integers(0, 3, 10 * PS)]
    tokens = list(base[:PS])
    ph = PageHashes(tokens, salt_bytes("s"), PS)
    for step in range(60):
        sid = f"r{step}"
        prompt = [*base[: int(rng.integers(1, len(base)))], int(rng.integers(3, 5))]
        done = int(rng.integers(0, len(prompt) + 1)) if step % 3 else 0
        for bm in (a, b):  # the same history of cached pages on both
            cached = bm.admit(sid, prompt, cache_salt="s")
            bm.mark_computed(sid, max(done, cached))
            bm.free(sid)
        if len(tokens) < len(base):
            tokens.append(base[len(tokens)])
        n = len(tokens) - step % 2
        last = n == len(tokens)
        assert a.admit_pages([(tokens[:n], last)], "s") == b.admit_pages(
            [(ph.prefix(n), last)], "s"
        )
        got = [
            bm.admit("q", t, cache_salt="s", compute_last=last, window=window)
            for bm, t in ((a, tokens[:n]), (b, ph.prefix(n)))
        ]
        assert got[0] == got[1]
        assert a.page_table("q") == b.page_table("q")
        for bm in (a, b):
            bm.free("q")
            bm.check_invariants()
    # Hashed as far as lookups reached, in growing steps: as all at once.
    whole = PageHashes(np.array(tokens, "<i8").tobytes(), salt_bytes("s"), PS)
    assert ph.hashes == [h for h, _ in whole.pages(len(ph.hashes))] and len(ph.hashes) > 4


def test_hashed_prompts_refuse_another_salt_or_page_size():
    bm = BlockManager(8, PS)
    tokens = list(BIG[: 2 * PS])
    with pytest.raises(InvalidArgument, match="salt"):
        bm.admit_pages([(PageHashes(tokens, salt_bytes("x"), PS).prefix(4), True)], "y")
    with pytest.raises(InvalidArgument, match="page size"):
        bm.admit("a", PageHashes(tokens, salt_bytes(None), PS + 1).prefix(4))
    with pytest.raises(InvalidArgument, match="tokens of a list"):
        bm.admit("a", PageHashes(tokens, salt_bytes(None), PS).prefix(len(tokens) + 1))
    assert "a" not in bm
