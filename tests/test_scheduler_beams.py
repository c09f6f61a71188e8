"""pagedjax.scheduler: how many pages a beam group (`atomic`) is admitted with.

With the simulated device of tests/test_scheduler.py (`Sim`): readmitted beams count a
page they share in the prefix cache once, so they are not kept waiting for pages they
will not take; a beam group is admitted only with the pages of its first two decode
steps free (each reserves a page per beam row), so it is never admitted only to be
preempted at once and prefilled again; and the prefill count bounds what the block
manager's admissions really take, exactly unless one beam's allocations evict another's
hits.
"""

import numpy as np
import pytest
from test_scheduler import PS, Sim, reference

from pagedjax.blocks import BlockManager
from pagedjax.scheduler import Scheduler, SeqStatus, Sequence, SequenceGroup


def _readmitted(sim, prompt, gens, max_num_tokens):
    seqs = [
        Sequence(next(sim.ids), prompt + g, len(prompt), max_num_tokens, i)
        for i, g in enumerate(gens)
    ]
    beams = SequenceGroup("beams", seqs, len(seqs), atomic=True)
    sim.sched.add(beams)
    return beams


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_pages, admitted", [(25, True), (24, False)])
def test_readmitted_beams_count_their_shared_cached_pages_once(in_flight, num_pages, admitted):
    """3 beams of 25 admitted tokens (7 pages each) share 5 cached pages and hit 3 more of
    their own: they take 11 pages, and their decode steps reserve 3. With the hog's decode
    page, 25 pages fit them beside the hog's 10 (they were counted 21 pages each beam's
    own, and waited for the hog to finish); 24 do not."""
    sim = Sim(num_pages=num_pages, budget=48, in_flight=in_flight)
    prompt = [3, 4, 5]
    common = list(range(20, 40))  # generated positions 3..22
    gens = [[*common, 40 + i, 50 + i, 60 + i] for i in range(3)]  # 26 tokens each
    for i, g in enumerate(gens):  # caches each beam's first 6 pages
        sim.add(f"warm{i}", (prompt + g)[:24] + [60], 1)
    sim.run()
    sim.add("hog", list(range(60, 100)), 12)  # 10 pages and its decode page
    sim.step()
    beams = _readmitted(sim, prompt, gens, 28)
    plan = sim.step()
    if admitted:
        assert beams.status is SeqStatus.RUNNING and beams.num_cached_tokens == 24
        assert [(r.decode, r.start) for r in plan.rows] == [(True, 40)] + [(False, 24)] * 3
        pages = {p for s in beams.seqs for p in sim.bm.page_table(s.seq_id)}
        assert len(pages) == 11
    else:
        assert beams in sim.sched.waiting
    sim.run()
    assert sim.sched.num_preemptions == 0 and sim.bm.stats().num_used_pages == 0
    for s, g in zip(sim.done["beams"].finished, gens, strict=True):
        assert s.token_ids == reference(prompt + g, 2)
    assert sim.done["hog"].finished[0].token_ids == reference(range(60, 100), 12)


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_readmitted_beams_wait_for_their_decode_pages(in_flight):
    """Without the prefix cache, 3 readmitted beams of 4 admitted tokens take 3 pages, and
    their first decode step 3 more: 4 pages beside the hog's 6 are short (they were
    admitted, prefilled, preempted at once for their rows' pages and prefilled again:
    1 preemption, 48 prefill tokens); they wait for the hog instead (none, 36)."""
    sim = Sim(num_pages=10, budget=32, in_flight=in_flight, caching=False)
    prompt = [3, 4, 5]
    gens = ([7, 8], [7, 9], [7, 10])
    sim.add("hog", list(range(60, 84)), 3)
    sim.step()
    beams = _readmitted(sim, prompt, gens, 8)
    sim.step()
    assert beams in sim.sched.waiting
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert sum(p.num_prefill_tokens for p in sim.plans) == 24 + 3 * 4
    for s, g in zip(sim.done["beams"].finished, gens, strict=True):
        assert s.token_ids == reference(prompt + g, 3)


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_pages, admitted", [(11, True), (10, False), (8, False)])
def test_a_new_beam_group_waits_for_its_first_decode_pages(in_flight, num_pages, admitted):
    """A new group of beam width 2 prefills its page-long prompt, then decodes: a page per
    row each step, the first step's appends kept in the second (2 new pages: the fed
    position starts a page). 5 pages beside the hog's 5 and its decode page; with 8 it was
    admitted (its prompt's page fit), then preempted at its first decode step."""
    sim = Sim(num_pages=num_pages, budget=32, in_flight=in_flight)
    sim.add("hog", list(range(60, 80)), 3)
    sim.step()
    prompt = [3, 4, 5, 6]
    beams = SequenceGroup("beams", [Sequence(next(sim.ids), list(prompt), 4, 8)], 2, atomic=True)
    sim.sched.add(beams)
    sim.step()
    assert (beams.status is SeqStatus.RUNNING) == admitted
    sim.run()
    assert sim.sched.num_preemptions == 0 and sim.bm.stats().num_used_pages == 0
    assert sim.done["beams"].finished[0].token_ids == reference(prompt, 4)


@pytest.mark.parametrize("seed", range(40))
def test_beam_prefill_pages_bound_what_the_admissions_take(seed):
    """Over random cache states (cached chains, some held, some partly evicted, a full
    free list or none), the count is what the beams' `admit` calls take from the free
    pages, or more when one beam's allocations evicted pages another would hit."""
    rng = np.random.default_rng(seed)
    num_pages = int(rng.integers(12, 40))
    bm = BlockManager(num_pages, PS, max_model_len=256, watermark=0.0)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    stem = rng.integers(3, 6, size=30).tolist()

    def variant():  # a prefix of the stem, then a few tokens of its own
        k = int(rng.integers(0, 30))
        return stem[:k] + rng.integers(3, 6, size=int(rng.integers(1, 12))).tolist()

    ids = iter(range(10**6))
    for _ in range(int(rng.integers(1, 8))):  # computed, registered; some kept, most freed
        toks = variant()
        sid = next(ids)
        if -(-len(toks) // PS) > bm.num_free_pages:
            continue
        bm.admit(sid, toks)
        bm.mark_computed(sid, len(toks))
        if rng.random() < 0.7:
            bm.free(sid)
    width = int(rng.integers(2, 5))
    common = variant()
    tails = [rng.integers(3, 6, size=int(rng.integers(1, 6))).tolist() for _ in range(width)]
    seqs = [Sequence(next(ids), common + t + [7], len(common), 300, i) for i, t in enumerate(tails)]
    g = SequenceGroup("beams", seqs, width, atomic=True)
    lens = [sched._admit_len(g, s) for s in seqs]
    predicted = sched._prefill_pages(g, lens)
    if predicted > bm.num_free_pages:
        return
    free, evictions = bm.num_free_pages, bm.stats().evictions
    for s, n in zip(seqs, lens, strict=True):
        bm.admit(s.seq_id, s.token_ids[:n], compute_last=False)
    taken = free - bm.num_free_pages
    assert taken <= predicted
    if bm.stats().evictions == evictions:
        assert taken == predicted
