"""Tests for pagedjax.scheduler: host-only, with a simulated device.

`Sim` plays the engine's side of the protocol (schedule, apply the previous step's
tokens, commit) with a fake model: the token after a sequence is a fixed function of
the sequence so far, so a recomputed (preempted) sequence must reproduce exactly the
tokens it would have produced, and a simulated page pool checks that every computed
slot holds the token it should (a page reused while still held, or a wrong copy-on-write,
shows up as a mismatch).
"""

import numpy as np
import pytest

from pagedjax.blocks import BlockManager
from pagedjax.scheduler import Scheduler, SeqStatus, Sequence, SequenceGroup

PS = 4  # page size


def next_token(tokens) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % 97 + 3


class Sim:
    """Drives a Scheduler like the engine does, one step in flight at a time."""

    def __init__(
        self,
        num_pages=64,
        max_num_seqs=4,
        budget=16,
        caching=True,
        watermark=0.0,
        in_flight=False,
        stop=None,
        max_loras=None,
    ):
        self.bm = BlockManager(
            num_pages, PS, enable_prefix_caching=caching, max_model_len=256, watermark=watermark
        )
        self.sched = Scheduler(
            self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_loras=max_loras
        )
        self.pool = np.full(num_pages * PS, -1, np.int64)  # token id written in each slot
        self.inflight = None
        self.plans = []
        self.ids = iter(range(10**6))
        self.done: dict = {}
        self.in_flight = in_flight  # commit before applying the previous step (async)
        self.stop = stop  # a token that ends a sequence (None: length only)

    def add(self, rid, prompt, max_tokens, n=1):
        p = len(prompt)
        seqs = [Sequence(next(self.ids), list(prompt), p, p + max_tokens, i) for i in range(n)]
        if n > 1 and p > 1:
            g = SequenceGroup(rid, seqs[:1], n, forks=seqs[1:])
        else:
            g = SequenceGroup(rid, seqs, n)
        self.sched.add(g)
        return g

    def write_and_check(self, plan, fed):
        """Executes a committed plan on the simulated pool; returns each row's token.
        `fed`: the previous step's token of each sequence (what the device feeds). As on
        the device, every row's K/V is written before any row attends (a row may read a
        prefix-cache hit that a later row of the step writes)."""
        for src, dst in plan.copies:
            self.pool[dst * PS : (dst + 1) * PS] = self.pool[src * PS : (src + 1) * PS]
        for r in plan.rows:
            if r.seq is None:
                continue
            if r.feed:
                assert r.seq.token_ids[r.start] == fed[id(r.seq)]  # set, then appended
            if r.seq.status is not SeqStatus.RUNNING:  # stopped on the token it feeds
                self.pool[r.slots] = -7  # the device still writes; nothing reads it
            else:
                self.pool[r.slots] = r.seq.token_ids[r.start : r.start + r.num_tokens]
        out = []
        for r in plan.rows:
            if r.seq is None or r.seq.status is not SeqStatus.RUNNING:
                out.append(None)
                continue
            ctx = r.start + r.num_tokens
            pos = np.arange(ctx)
            table = r.page_row if not r.decode else self.bm.page_tables([r.seq.seq_id])[0]
            slots = table[pos // PS] * PS + pos % PS
            assert self.pool[slots].tolist() == r.seq.token_ids[:ctx], "K/V of a wrong token"
            out.append(next_token(r.seq.token_ids[:ctx]))
        return out

    def apply(self, prev, toks, on_apply):
        live = [
            (r, t)
            for r, t in zip(prev.rows, toks, strict=True)
            if r.samples and r.live and r.seq.status is SeqStatus.RUNNING
        ]
        self.sched.set_tokens([r.seq for r, _ in live], [t for _, t in live])
        for r, t in live:
            s = r.seq
            s.pending -= 1
            s.token_ids.append(t)
            if t == self.stop or len(s.token_ids) >= s.max_num_tokens:
                self.sched.finish(r.group, s, "stop" if t == self.stop else "length")
                if r.group.done:
                    self.done[r.group.request_id] = r.group
        if on_apply:
            on_apply(self)

    def step(self, on_apply=None):
        plan = self.sched.schedule()
        self.check_plan(plan)
        starts = [r.start for r in plan.rows]  # the batch is sized with these (StepBatch)
        fed = {}
        if self.inflight is None:
            self.sched.commit(plan)
        else:
            prev, toks = self.inflight
            fed = {id(r.seq): t for r, t in zip(prev.rows, toks, strict=True) if t is not None}
            beams = any(r.decode and r.group.atomic for r in plan.rows)
            if self.in_flight and not beams:
                self.sched.commit(plan, in_flight=True)
                self.apply(prev, toks, on_apply)
            else:
                self.apply(prev, toks, on_apply)
                self.sched.commit(plan)
        self.plans.append(plan)
        for r, start in zip(plan.rows, starts, strict=True):
            assert r.seq is None or r.start == start, "commit moved a row's position"
        if any(not r.decode or r.seq is not None for r in plan.rows):
            self.inflight = (plan, self.write_and_check(plan, fed))
        else:
            self.inflight = None
        return plan

    def run_from(self, plan):
        """Runs a plan a test committed itself (after applying the step before it), then
        everything to the end, as `step` and `run` would have."""
        self.plans.append(plan)
        self.inflight = (plan, self.write_and_check(plan, {}))
        self.run()

    def check_plan(self, plan):
        s = self.sched
        assert len(plan.rows) <= s.max_num_seqs
        assert sum(r.num_tokens for r in plan.rows) <= s.max_num_batched_tokens
        assert all(r.num_tokens > 0 for r in plan.rows), "a row that feeds nothing"
        kinds = [r.decode for r in plan.rows]
        assert kinds == sorted(kinds, reverse=True), "decode rows come first"

    def run(self, max_steps=10_000, on_apply=None):
        for _ in range(max_steps):
            if not self.sched.has_unfinished() and self.inflight is None:
                return
            self.step(on_apply)
            self.bm.check_invariants()
        raise AssertionError("did not finish")


def reference(prompt, max_tokens, stop=None):
    seq = list(prompt)
    while len(seq) < len(prompt) + max_tokens:
        seq.append(next_token(seq))
        if seq[-1] == stop:
            break
    return seq


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_decode_first_then_chunks_of_a_long_prompt(in_flight):
    sim = Sim(budget=8, in_flight=in_flight)
    short = sim.add("short", [5, 6, 7], 20)
    sim.step()  # prefill the short prompt
    long_ = sim.add("long", list(range(3, 30)), 4)  # 27 tokens: over several steps
    chunks = []
    while long_.seqs[0].num_computed < 27 or long_.seqs[0].status is SeqStatus.WAITING:
        plan = sim.step()
        assert plan.rows[0].decode and plan.rows[0].seq is short.seqs[0]
        chunks += [r.num_tokens for r in plan.rows if not r.decode]
    assert chunks == [7, 7, 7, 6]  # the budget minus the decode token, interleaved
    sim.run()
    assert sim.done["short"].finished[0].token_ids == reference([5, 6, 7], 20)
    assert sim.done["long"].finished[0].token_ids == reference(range(3, 30), 4)


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [4, 7, 32])
def test_preemption_recomputes_and_completes_everything(caching, budget, in_flight):
    # 6 requests of up to 40 tokens (10 pages each) in 24 pages: preemption is forced.
    # Token 42 stops a sequence, which the asynchronous commit learns a step late.
    sim = Sim(num_pages=24, max_num_seqs=4, budget=budget, caching=caching, in_flight=in_flight)
    sim.stop = 42
    rng = np.random.default_rng(budget)
    prompts = {f"r{i}": rng.integers(3, 100, size=rng.integers(1, 12)).tolist() for i in range(6)}
    for rid, p in prompts.items():
        sim.add(rid, p, 40 - len(p))
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert set(sim.done) == set(prompts)
    reasons = set()
    for rid, p in prompts.items():
        s = sim.done[rid].finished[0]
        assert s.token_ids == reference(p, 40 - len(p), stop=42)
        reasons.add(s.finish_reason)
    assert reasons == {"stop", "length"}
    assert sim.bm.stats().num_used_pages == 0 and sim.bm.stats().num_seqs == 0
    fed = sum(r.feed for plan in sim.plans for r in plan.rows)
    assert (fed > 0) == in_flight


def test_preempts_the_newest_group_and_requeues_it_first():
    sim = Sim(num_pages=12, max_num_seqs=4, budget=16)
    a = sim.add("a", [1, 2, 3, 4, 5, 6, 7], 20)
    b = sim.add("b", [9, 8, 7, 6, 5, 4, 3], 20)
    while sim.bm.num_free_pages > 1:
        sim.step()
    c = sim.add("c", [4, 4, 4, 4, 4], 2)  # 2 pages: must wait
    while sim.sched.num_preemptions == 0:
        sim.step()
    assert b.status is SeqStatus.WAITING and a.status is SeqStatus.RUNNING
    assert list(sim.sched.waiting)[:2] == [b, c]  # at the front, ahead of c
    assert b.seqs[0].num_admitted == 0 and b.num_preemptions == 1
    assert not any(r.live for p in sim.plans for r in p.rows if r.group is b)  # stale now
    sim.run()
    assert sim.done["b"].finished[0].token_ids == reference([9, 8, 7, 6, 5, 4, 3], 20)
    # The readmission read b's own pages back; the request's hit is its first admission's.
    assert sim.done["b"].finished[0].num_cached_tokens > 0 and b.num_cached_tokens == 0


def test_commit_out_of_pages_preempts_the_newest_decoding_group():
    """Pages taken between `schedule()` and `commit()` (not expected from the engine): the
    commit preempts the newest groups until the appends fit, requeued in order, and every
    request still completes with the reference tokens."""
    sim = Sim(num_pages=16, max_num_seqs=4, budget=16)
    prompts = {r: [3 + i] * PS for i, r in enumerate("abc")}  # a full page: appends need one
    a, b, c = (sim.add(r, p, 6) for r, p in prompts.items())
    sim.step()  # prefill all three
    plan = sim.sched.schedule()
    assert [r.group for r in plan.rows] == [a, b, c]
    prev, toks = sim.inflight
    sim.apply(prev, toks, None)
    sim.bm.admit("thief", list(range(sim.bm.num_free_pages * PS)))  # every free page
    sim.sched.commit(plan)
    assert [r.seq is not None for r in plan.rows] == [True, False, False]
    assert sim.sched.running == [a] and list(sim.sched.waiting) == [b, c]
    assert (b.num_preemptions, c.num_preemptions) == (1, 1)
    sim.bm.free("thief")
    sim.run_from(plan)
    for rid, p in prompts.items():
        assert sim.done[rid].finished[0].token_ids == reference(p, 6)


def test_commit_out_of_pages_spares_the_groups_prefilling_in_the_step():
    """The commit's victims are groups with only decode rows: a group admitted in this step
    (newer than both decoders) keeps its prefill row; the newest decoder goes."""
    sim = Sim(num_pages=16, max_num_seqs=4, budget=16)
    a, b = (sim.add(r, [3 + i] * PS, 6) for i, r in enumerate("ab"))  # appends need pages
    sim.step()
    d = sim.add("d", list(range(3, 11)), 2)
    plan = sim.sched.schedule()
    assert [(r.group, r.decode) for r in plan.rows] == [(a, True), (b, True), (d, False)]
    prev, toks = sim.inflight
    sim.apply(prev, toks, None)
    sim.bm.admit("thief", list(range(sim.bm.num_free_pages * PS)))  # every free page
    sim.sched.commit(plan)
    assert [r.seq is not None for r in plan.rows] == [True, False, True]
    assert sim.sched.running == [a, d] and list(sim.sched.waiting) == [b]
    sim.bm.free("thief")
    sim.run_from(plan)
    for rid, p, k in (("a", [3] * PS, 6), ("b", [4] * PS, 6), ("d", list(range(3, 11)), 2)):
        assert sim.done[rid].finished[0].token_ids == reference(p, k)


def test_admission_leaves_the_pages_decode_appends_need():
    sim = Sim(num_pages=4, budget=16)
    a = sim.add("a", [3, 4, 5, 6], 12)  # a full page: its next token needs a new one
    sim.step()
    # 3 new pages (none a prefix hit on a's): the free ones, one of them a's
    b = sim.add("b", list(range(7, 19)), 1)
    plan = sim.step()
    assert [r.group for r in plan.rows] == [a] and b.status is SeqStatus.WAITING
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert sim.done["a"].finished[0].token_ids == reference([3, 4, 5, 6], 12)
    assert sim.done["b"].finished[0].token_ids == reference(range(7, 19), 1)


def test_admission_keeps_the_watermark():
    sim = Sim(num_pages=20, max_num_seqs=4, budget=64, watermark=0.25)  # 5 pages kept free
    sim.add("a", list(range(3, 40)), 1)  # 37 tokens: 10 pages
    sim.add("b", list(range(50, 69)), 1)  # 19 tokens: 5 pages -> 15 used, 5 free: allowed
    sim.add("c", [3, 4, 5], 1)  # 1 more page would break the watermark
    sim.step()
    states = {g.request_id: g.status for g in sim.sched.running}
    assert states == {"a": SeqStatus.RUNNING, "b": SeqStatus.RUNNING}
    assert sim.bm.num_free_pages >= sim.bm.watermark_pages
    sim.run()
    assert set(sim.done) == {"a", "b", "c"}


def test_seat_cap():
    sim = Sim(max_num_seqs=2, budget=16)
    for i in range(4):
        sim.add(f"r{i}", [3 + i, 4], 6)
    for _ in range(30):
        if not sim.sched.has_unfinished():
            break
        sim.step()
        assert sim.sched.num_running_seqs <= 2
    sim.run()
    assert len(sim.done) == 4


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_lora_slots_cap_the_distinct_adapters_running(in_flight):
    """max_loras=2: at most two distinct adapters run (and share a step) at once; a group
    of a third waits in its place while the base-model groups behind it are admitted
    (not those with an adapter, even a running one, which could keep its slot taken
    forever), and every group completes."""
    sim = Sim(max_num_seqs=5, budget=16, in_flight=in_flight, max_loras=2)
    adapters = [1, 2, 3, 0, 1, 0, 3, 2]
    for i, lora_id in enumerate(adapters):
        sim.add(f"r{i}", [3 + i, 4, 5], 6).lora_id = lora_id
    sim.step()
    # r2's adapter waits for a slot; r3 and r5 need none; r4 (a running adapter) waits.
    assert [g.request_id for g in sim.sched.running] == ["r0", "r1", "r3", "r5"]
    assert [g.request_id for g in sim.sched.waiting] == ["r2", "r4", "r6", "r7"]
    while sim.sched.has_unfinished() or sim.inflight is not None:
        plan = sim.step()
        assert len({g.lora_id for g in sim.sched.running} - {0}) <= 2
        assert len({r.group.lora_id for r in plan.rows} - {0}) <= 2
    assert len(sim.done) == len(adapters) and sim.sched.lora_ids() == set()
    with pytest.raises(ValueError, match="max_loras must be a positive int, got max_loras=0"):
        Scheduler(sim.bm, max_num_seqs=4, max_num_batched_tokens=16, max_loras=0)


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_n_samples_fork_after_the_prompt(in_flight):
    sim = Sim(budget=32, in_flight=in_flight)
    prompt = list(range(3, 13))  # 10 tokens: pages [3..6], [7..10], [11, 12] partial
    g = sim.add("n", prompt, 5, n=3)
    plan = sim.step()
    (row,) = plan.rows
    assert (row.start, row.num_tokens, row.samples) == (0, 9, False)  # prompt[:-1]
    assert len(g.seqs) == 3 and not g.forks
    tables = [sim.bm.page_table(s.seq_id) for s in g.seqs]
    assert tables[0] == tables[1] == tables[2]  # everything shared, partial page included
    plan = sim.step()  # every sample feeds the last prompt token; CoW splits the last page
    assert [r.decode for r in plan.rows] == [True] * 3
    assert len(plan.copies) == 2
    tables = [sim.bm.page_table(s.seq_id) for s in g.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    sim.run()
    assert len(sim.done["n"].finished) == 3


@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_n_samples_take_every_cached_page_of_the_prompt_but_its_last_token(in_flight, window):
    """The samples' parent prefills prompt[:-1] and each sample feeds the last prompt
    token: a decode row computes it, so when prompt[:-1] is whole pages the prefix cache
    holds (here being written by the step in flight), the parent takes every one of them
    (it took one fewer and recomputed it), forks at admission with no prefill row, and the
    samples decode in that same step, as a prompt cached all but its last token samples
    in its admission step; under a sliding window too (W = 1 keeps a page)."""
    from test_window_admission import WindowSim  # (it imports this module)

    kw = dict(budget=32, in_flight=in_flight)
    sim = Sim(**kw) if window is None else WindowSim(window, **kw)
    prompt = list(range(3, 12))  # 9 tokens: prompt[:-1] fills 2 pages
    warm = sim.add("warm", [*prompt[:-1], 50, 51], 3)
    sim.step()  # prefills warm's prompt: its 2 full pages are cached
    g = sim.add("n", prompt, 4, n=3)
    plan = sim.step()
    assert g.num_cached_tokens == 8 and not g.forks and len(g.seqs) == 3
    assert [(r.group is warm, r.decode) for r in plan.rows] == [(True, True)] + [(False, True)] * 3
    assert [r.start for r in plan.rows if r.group is g] == [8] * 3
    assert all(s.num_admitted == s.num_computed == 9 for s in g.seqs)  # fed the last token
    assert sim.bm.num_reserved_pages == 0
    plan = sim.step()
    assert [(r.decode, r.start) for r in plan.rows if r.group is g] == [(True, 9)] * 3
    sim.run()
    assert [s.token_ids for s in sim.done["n"].finished] == [reference(prompt, 4)] * 3
    assert sim.done["warm"].finished[0].token_ids == reference([*prompt[:-1], 50, 51], 3)
    assert sim.bm.stats().num_used_pages == 0 and sim.sched.num_preemptions == 0


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "budget, num_pages, hog, kinds",
    [
        (4, 64, 6, [True, True, False]),  # the hog's last 2 prompt tokens leave budget 2
        (16, 10, 16, [True] * 4),  # the hog's decode page and the samples' 3 fit exactly
        (16, 9, 16, [True]),  # one page short: the group waits (it was admitted, then
        # preempted for its samples' pages at once, and prefilled again)
    ],
)
def test_fully_cached_n_samples_decode_at_admission_within_budget_and_pages(
    in_flight, budget, num_pages, hog, kinds
):
    """The samples forked at admission (prompt[:-1] cached whole) get decode rows in
    that step as far as the token budget goes; the group is admitted only if the pages
    their first appends take fit beside the decode reserve of the running sequences."""
    sim = Sim(num_pages=num_pages, budget=budget, in_flight=in_flight)
    prompt = list(range(3, 12))  # prompt[:-1] fills 2 pages
    sim.add("warm", [*prompt[:-1], 50], 1)
    sim.run()  # its 2 full pages are cached, evictable
    sim.add("hog", list(range(60, 60 + hog)), 3)
    sim.step()  # the hog prefills its first chunk
    g = sim.add("n", prompt, 3, n=3)
    plan = sim.step()
    assert [r.decode for r in plan.rows] == kinds
    if len(kinds) > 1:
        assert not g.forks and len(g.seqs) == 3 and g.num_cached_tokens == 8
    else:
        assert g in sim.sched.waiting
    sim.run()
    assert [s.token_ids for s in sim.done["n"].finished] == [reference(prompt, 3)] * 3
    assert sim.bm.stats().num_used_pages == 0 and sim.sched.num_preemptions == 0


def test_readmitted_beams_take_every_cached_page_but_their_last_token():
    """Readmitted beams (holding generated tokens) prefill all but their last token and
    feed it together: whole pages of it in the prefix cache are all taken, and beams with
    nothing left to prefill decode in their admission step."""
    sim = Sim(budget=32)
    prompt = [3, 4, 5]
    gens = ([7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 11, 13], [7, 8, 9, 10, 14, 15])
    for i, gen in enumerate(gens):  # the beams' first 8 tokens, computed and cached
        sim.add(f"warm{i}", prompt + gen[:5] + [60], 1)
    sim.run()
    seqs = [Sequence(next(sim.ids), prompt + g, 3, 12, i) for i, g in enumerate(gens)]
    beams = SequenceGroup("beams", seqs, 3, atomic=True)
    sim.sched.add(beams)
    plan = sim.step()
    assert [s.num_cached_tokens for s in seqs] == [8] * 3 and beams.num_cached_tokens == 8
    assert [(r.decode, r.start) for r in plan.rows] == [(True, 8)] * 3
    assert sorted(seqs.index(r.seq) for r in plan.rows) == [0, 1, 2]
    assert all(s.num_admitted == s.num_computed == 9 for s in seqs)  # fed the last token
    plan = sim.step()
    assert [(r.decode, r.start) for r in plan.rows] == [(True, 9)] * 3
    sim.run()
    for s, g in zip(sim.done["beams"].finished, gens, strict=True):
        assert s.token_ids == reference(prompt + g, 3)


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "budget, num_pages, hog, kinds",
    [
        (5, 64, 7, [True] * 3 + [False]),  # the hog's last 2 prompt tokens leave budget 3
        (4, 64, 6, [False]),  # its last 2 leave budget 2, short of the 3 rows: none
        (32, 13, 20, [True] * 4),  # the hog's decode page and the beams' 7 fit exactly: the
        # cached page, a page per row, and the 3 the rows' appends keep (position 4 starts a
        # page) beside the next step's rows
        (32, 10, 20, None),  # 3 pages short: the group waits (it was admitted, decoded, then
        # preempted in the next step for its rows' pages; admission counted its prefill only)
        (32, 10, 24, None),  # 4 short: waits (it was admitted without its rows' pages, then
        # preempted in the next step for them)
    ],
)
def test_fully_cached_readmitted_beams_decode_at_admission_within_budget_and_pages(
    in_flight, budget, num_pages, hog, kinds
):
    """Readmitted beams whose admitted tokens are all cached get their `beam_width` decode
    rows (bound to beams in the commit) in their admission step only if the budget has
    room for every one; else none, and they decode from the next step. They are admitted
    only if their first two decode steps' pages fit beside the decode reserve of the
    running sequences (kinds None: they wait), so they are never preempted for them."""
    sim = Sim(num_pages=num_pages, budget=budget, in_flight=in_flight)
    prompt = [3, 4, 5]
    gens = ([7, 8], [7, 9], [7, 10])  # all but their last token: 1 page, shared
    sim.add("warm", [*prompt, 7, 60], 1)
    sim.run()  # the page is cached, evictable
    sim.add("hog", list(range(60, 60 + hog)), 3)
    sim.step()  # the hog prefills its first chunk (with budget 32: all of it, 5 or 6 pages)
    seqs = [Sequence(next(sim.ids), prompt + g, 3, 8, i) for i, g in enumerate(gens)]
    beams = SequenceGroup("beams", seqs, 3, atomic=True)
    sim.sched.add(beams)
    plan = sim.step()
    if kinds is None:
        assert beams in sim.sched.waiting and [r.decode for r in plan.rows] == [True]
    else:
        assert beams.status is SeqStatus.RUNNING and beams.num_cached_tokens == 4
        assert [r.decode for r in plan.rows] == kinds
        decoded = [r.seq for r in plan.rows if r.group is beams]
        assert len(decoded) == len(kinds) - 1  # all 3 or none (the hog has the other row)
        assert sorted(map(seqs.index, decoded)) == [0, 1, 2][: len(decoded)]
        assert [s.num_admitted for s in seqs] == [5 if decoded else 4] * 3
        sim.step()
        assert beams.status is SeqStatus.RUNNING and sim.sched.num_preemptions == 0
    sim.run()
    for s, g in zip(sim.done["beams"].finished, gens, strict=True):
        assert s.token_ids == reference(prompt + g, 3)
    assert sim.done["hog"].finished[0].token_ids == reference(range(60, 60 + hog), 3)
    assert sim.bm.stats().num_used_pages == 0 and sim.sched.num_preemptions == 0


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_abort_anywhere_frees_everything(in_flight):
    rng = np.random.default_rng(0)
    for trial in range(5):
        budget = int(rng.integers(4, 20))
        sim = Sim(num_pages=24, max_num_seqs=4, budget=budget, in_flight=in_flight, stop=42)
        prompts = {
            f"r{i}": rng.integers(3, 100, size=rng.integers(1, 15)).tolist() for i in range(6)
        }
        for rid, p in prompts.items():
            sim.add(rid, p, 30 - len(p), n=int(rng.integers(1, 3)))
        aborted = set()

        def maybe_abort(s, rng=rng, aborted=aborted):
            live = [g.request_id for g in s.sched.running + list(s.sched.waiting)]
            if live and rng.random() < 0.3:
                rid = live[rng.integers(len(live))]
                g = s.sched.abort(rid)
                assert not any(r.live for r in s.plans[-1].rows if r.group is g)  # stale
                aborted.add(rid)

        for _ in range(int(rng.integers(1, 25))):
            sim.step(on_apply=maybe_abort)  # aborts while a step is in flight
            sim.bm.check_invariants()
        for g in list(sim.sched.running) + list(sim.sched.waiting):  # and between steps
            if rng.random() < 0.5:
                sim.sched.abort(g.request_id)
                aborted.add(g.request_id)
        sim.run()
        assert set(sim.done) | aborted == set(prompts), trial
        assert sim.bm.stats().num_used_pages == 0 and sim.bm.stats().num_seqs == 0
        assert sim.sched.abort("r0") is None


def test_frees_wait_for_commit():
    sim = Sim(budget=16)
    g = sim.add("a", [3, 4, 5, 6, 7], 1)
    sim.step()
    plan = sim.sched.schedule()
    used = sim.bm.stats().num_used_pages
    sim.sched.finish(g, g.seqs[0], "length")  # inside the window: deferred
    assert sim.bm.stats().num_used_pages == used
    sim.sched.commit(plan)
    assert sim.bm.stats().num_used_pages == 0


def test_add_rejects_what_can_never_run():
    bm = BlockManager(8, PS, max_model_len=256)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="request 'x' runs 3 sequences.*max_num_seqs=2"):
        sched.add(SequenceGroup("x", [Sequence(0, [1], 1, 4)], 3))
    with pytest.raises(ValueError, match="request 'w' runs 3 sequences.*max_num_seqs=2"):
        sched.add(SequenceGroup("w", [Sequence(9 + i, [1], 1, 4) for i in range(3)], 1))
    with pytest.raises(ValueError, match="request 'y' may need 25 KV pages"):
        sched.add(SequenceGroup("y", [Sequence(1, [1, 2], 2, 100)], 1))
    sched.add(SequenceGroup("z", [Sequence(2, [1, 2], 2, 10)], 1))
    with pytest.raises(ValueError, match="'z' is already"):
        sched.add(SequenceGroup("z", [Sequence(3, [1, 2], 2, 10)], 1))


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("n", [1, 2])
def test_add_admits_exactly_what_fits(in_flight, n):
    """A sequence of `max_num_tokens` tokens never feeds its last one (it ends the
    sequence; an asynchronous step is not planned behind it either), so it holds at most
    ceil((max_num_tokens - 1) / page_size) pages. Requests needing the whole cache are
    admitted and complete, both at once (preempting each other, readmitted with all
    their tokens) and reaching the bound; one page more is refused."""
    sim = Sim(num_pages=10, budget=8, watermark=0.2, in_flight=in_flight)  # 8 to give
    max_len = (8 // n - 1) * PS + 2  # the max_len - 1 fed tokens: 1 in page 8 // n
    for rid in ("a", "b"):
        g = sim.add(rid, [3, 4, 5][: 2 + (rid == "b")], max_len - 2 - (rid == "b"), n=n)
        assert sim.sched.max_pages_needed(g) == 8
    most = 0  # the most distinct pages a request held
    for _ in range(1000):
        if not sim.sched.has_unfinished() and sim.inflight is None:
            break
        sim.step()
        sim.bm.check_invariants()
        for g in sim.sched.running:
            tables = [sim.bm.page_table(s.seq_id) for s in g.seqs if s.num_admitted]
            most = max(most, len({p for t in tables for p in t if p >= 0}))
    assert set(sim.done) == {"a", "b"} and sim.sched.num_preemptions > 0
    assert most == 8
    for rid, p in (("a", [3, 4]), ("b", [3, 4, 5])):
        for s in sim.done[rid].finished:
            assert s.token_ids == reference(p, max_len - len(p))
    with pytest.raises(ValueError, match=f"may need {8 + n} KV pages .* than the 8 the cache"):
        sim.add("c", [3, 4], max_len - 2 + PS, n=n)


def test_beam_groups_need_a_page_per_beam_more():
    """A beam group's decode step reserves a page per beam on top of the beams' pages,
    which hold at most max_num_tokens - 2 slots then (full attention and window)."""
    sched = Scheduler(BlockManager(64, PS), max_num_seqs=4, max_num_batched_tokens=8)
    for max_len, pages in ((17, 3 * 5), (18, 3 * 5), (19, 3 * 6)):
        beams = SequenceGroup("b", [Sequence(0, [3, 4], 2, max_len)], 3, atomic=True)
        assert sched.max_pages_needed(beams) == pages
        assert sched.max_pages_needed(SequenceGroup("n", beams.seqs, 3)) == 3 * (
            -(-(max_len - 1) // PS)
        )
    sched.sliding_window = 6  # window_pages = ceil((6 - 2 + 8) / 4) + 1 = 4
    beams = SequenceGroup("b", [Sequence(0, [3, 4], 2, 100)], 3, atomic=True)
    assert sched.max_pages_needed(beams) == 3 * (4 + 1)


def test_a_new_beam_group_prefills_its_prompt_and_keeps_a_page_per_beam_row():
    """A new beam group prefills its whole prompt in one row that samples; its decode step
    plans a row per beam at the position fed, and reserves a page for each row (bound to
    beams in the commit), which admission leaves free: a prompt that needs those pages
    waits rather than get the beams preempted."""
    sim = Sim(num_pages=8, budget=32)
    prompt = [3, 4, 5, 6]  # a full page: the decode appends need new pages
    beams = SequenceGroup("beams", [Sequence(next(sim.ids), list(prompt), 4, 6)], 2, atomic=True)
    sim.sched.add(beams)
    (row,) = sim.step().rows
    assert (row.start, row.num_tokens, row.samples) == (0, 4, True)
    other = sim.add("other", list(range(3, 31)), 1)  # 7 pages: every free one
    plan = sim.step()
    assert [(r.group, r.decode, r.start) for r in plan.rows] == [(beams, True, 4)] * 2
    assert other.status is SeqStatus.WAITING
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert sim.done["beams"].finished[0].token_ids == reference(prompt, 2)
    assert sim.done["other"].finished[0].token_ids == reference(range(3, 31), 1)


def test_readmitted_beams_prefill_in_order_then_step_together():
    """A beam group readmitted after preemption (its beams hold generated tokens) prefills
    each beam but its last token, beam by beam, a chunk of the budget a step; its beams
    feed their last tokens together, once every one is computed."""
    sim = Sim(budget=4)
    prompt = [3, 4, 5]
    gens = ([7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 11, 13], [7, 8, 9, 10, 14, 15])
    seqs = [Sequence(next(sim.ids), prompt + g, 3, 12, i) for i, g in enumerate(gens)]
    beams = SequenceGroup("beams", seqs, 3, atomic=True)
    sim.sched.add(beams)
    chunks = []
    while not (plan := sim.step()).rows[0].decode:
        chunks += [(seqs.index(r.seq), r.start, r.num_tokens) for r in plan.rows]
    assert chunks == [(i, start, 4) for i in range(3) for start in (0, 4)]
    assert sorted(seqs.index(r.seq) for r in plan.rows) == [0, 1, 2]
    assert [(r.decode, r.start) for r in plan.rows] == [(True, 8)] * 3
    sim.run()
    for s, g in zip(sim.done["beams"].finished, gens, strict=True):
        assert s.token_ids == reference(prompt + g, 3)


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_add_bounds_a_window_sequence_by_the_tokens_it_feeds(in_flight):
    """Under a sliding window: the fewer of ceil((max_num_tokens - 1) / page_size) and
    `window_pages`; requests needing every page run to completion, reaching the bound."""
    from test_window_admission import WindowSim  # (it imports this module)

    sim = WindowSim(6, num_pages=4, budget=7, in_flight=in_flight)
    assert sim.sched.window_pages == 4
    prompt = list(range(3, 40))
    long_ = sim.add("long", prompt, 20)  # 57 tokens, 4 pages at most
    assert sim.sched.max_pages_needed(long_) == 4
    sim.run()
    assert sim.most == 4
    assert sim.done["long"].finished[0].token_ids == reference(prompt, 20)
    sim = WindowSim(6, num_pages=3, budget=7, in_flight=in_flight)
    short = sim.add("short", [3, 4], 11)  # 13 tokens: 12 fed, 3 pages
    assert sim.sched.max_pages_needed(short) == 3
    sim.run()
    assert sim.most == 3
    assert sim.done["short"].finished[0].token_ids == reference([3, 4], 11)
    with pytest.raises(ValueError, match="may need 4 KV pages"):
        sim.add("one_more", [3, 4], 12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_num_seqs=0, max_num_batched_tokens=8), "max_num_seqs=0"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens=4"),
        (dict(max_num_seqs=8, max_num_batched_tokens=7), "max_num_batched_tokens=7"),
        (dict(max_num_seqs=2.5, max_num_batched_tokens=8), "max_num_seqs=2.5"),
    ],
)
def test_bad_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(BlockManager(8, PS), **kwargs)
    Scheduler(BlockManager(8, PS), max_num_seqs=8, max_num_batched_tokens=8)
