"""pagedjax.scheduler under review: preemption, admission order and budgets.

With the simulated device of tests/test_scheduler.py (`Sim`): a prompt that ends on a
page boundary is not admitted only to be preempted for its own first token; a LoRA
group that waits for an adapter slot blocks none of the base-model groups behind it on
seats it could not use anyway; and a randomized run of both policies (priorities,
`n` samples, adapter slots, staggered arrivals, aborts, asynchronous commits) holds
every plan to the step's limits and the scheduler's order: decode rows for every
sequence ready for one, before any prefill; admissions in queue order (but groups
waiting for an adapter slot); victims the newest (fcfs) or the worst (priority); every
request not aborted completes with the reference tokens, nothing leaked.
"""

import numpy as np
import pytest
from test_scheduler import PS, Sim, reference

from pagedjax.scheduler import Scheduler, SeqStatus, Sequence, SequenceGroup, _will_decode


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_a_prompt_ending_on_a_page_waits_for_its_first_token_page(in_flight):
    """`b`'s 3 whole pages are free, but its first decode token needs a 4th: admitted, it
    would be preempted at once (the newest) and prefilled again; it waits for `a`."""
    sim = Sim(num_pages=4, budget=16, in_flight=in_flight)
    a = sim.add("a", [3], 3)  # one page, which all its tokens fit in
    sim.step()
    b = sim.add("b", list(range(3, 3 + 3 * PS)), 4)
    plan = sim.step()
    assert [r.group for r in plan.rows] == [a] and b.status is SeqStatus.WAITING
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert sim.done["a"].finished[0].token_ids == reference([3], 3)
    assert sim.done["b"].finished[0].token_ids == reference(range(3, 3 + 3 * PS), 4)
    # A prompt whose last sample ends it needs no page beyond its own: admitted.
    sim = Sim(num_pages=4, budget=16, in_flight=in_flight)
    a = sim.add("a", [3], 3)
    sim.step()
    c = sim.add("c", list(range(3, 3 + 3 * PS)), 1)
    assert [r.group for r in sim.step().rows] == [a, c]
    sim.run()
    assert sim.sched.num_preemptions == 0 and set(sim.done) == {"a", "c"}


def test_a_lora_group_waiting_for_a_slot_blocks_no_base_group_on_seats():
    """One adapter slot, 3 seats: `l2` waits for a slot; `l3` (3 samples, more seats than
    are left) waits behind it as every adapter group does; `base` behind both is
    admitted, `l3`'s seats notwithstanding."""
    sim = Sim(max_num_seqs=3, budget=16, max_loras=1)
    groups = [
        sim.add("r1", [3, 4, 5], 4),
        sim.add("l2", [4, 5, 6], 4),
        sim.add("l3", [5, 6, 7], 4, n=3),
        sim.add("base", [6, 7, 8], 4),
    ]
    for g, lora_id in zip(groups, (1, 2, 3, 0), strict=True):
        g.lora_id = lora_id
    sim.step()
    assert [g.request_id for g in sim.sched.running] == ["r1", "base"]
    assert [g.request_id for g in sim.sched.waiting] == ["l2", "l3"]
    sim.run()
    assert set(sim.done) == {"r1", "l2", "l3", "base"}
    for rid, prompt in (("r1", [3, 4, 5]), ("l3", [5, 6, 7]), ("base", [6, 7, 8])):
        for s in sim.done[rid].finished:
            assert s.token_ids == reference(prompt, 4)


# ---------------------------------------------------------------- randomized


def _rank(g):
    return g.priority, g.arrival


class ReviewSim(Sim):
    """`Sim` under either policy with adapter slots; each plan is checked against the
    scheduler's state just before `schedule()` (`step`)."""

    def __init__(self, policy, max_loras, **kw):
        super().__init__(max_loras=max_loras, **kw)
        s = self.sched
        self.sched = Scheduler(
            self.bm,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            scheduling_policy=policy,
            max_loras=max_loras,
        )
        self.prompts = {}

    def add_request(self, rid, prompt, max_tokens, n, priority, lora_id):
        p = len(prompt)
        seqs = [Sequence(next(self.ids), list(prompt), p, p + max_tokens, i) for i in range(n)]
        if n > 1 and p > 1:
            g = SequenceGroup(rid, seqs[:1], n, forks=seqs[1:], priority=priority)
        else:
            g = SequenceGroup(rid, seqs, n, priority=priority)
        g.lora_id = lora_id
        try:
            self.sched.add(g)
        except ValueError:
            return None  # could never run in this cache
        self.prompts[rid] = (list(prompt), max_tokens)
        return g

    def step(self, on_apply=None):
        s = self.sched
        self.pre_waiting = list(s.waiting)
        self.pre_running = list(s.running)
        self.pre_order = {id(g): g.admit_order for g in s.running}
        self.pre_ready = [
            (g, q) for g in s.running if not g.atomic for q in g.seqs if _will_decode(q)
        ]
        return super().step(on_apply)

    def check_plan(self, plan):
        super().check_plan(plan)
        s = self.sched
        seqs = [r.seq for r in plan.rows if r.seq is not None]
        assert len({id(q) for q in seqs}) == len(seqs), "a sequence with two rows"
        assert sum(g.seats for g in s.running) <= s.max_num_seqs
        if s.max_loras is not None:
            assert len({g.lora_id for g in s.running} - {0}) <= s.max_loras
        if s.scheduling_policy == "priority":
            assert [_rank(g) for g in s.waiting] == sorted(_rank(g) for g in s.waiting)
        # Victims: running before and after would have gone first.
        running = {id(g) for g in s.running}
        kept = [g for g in self.pre_running if id(g) in running]
        victims = [g for g in self.pre_running if g.status is SeqStatus.WAITING]
        for v in victims:
            for g in kept:
                if s.scheduling_policy == "priority":
                    assert _rank(v) > _rank(g), "a better group was preempted"
                else:
                    assert self.pre_order[id(v)] > self.pre_order[id(g)], "an older was"
        # Every sequence ready to decode (group not preempted) has a decode row.
        decoded = {id(r.seq) for r in plan.rows if r.decode}
        for g, q in self.pre_ready:
            if id(g) in running and q.status is SeqStatus.RUNNING:
                assert id(q) in decoded, "a sequence ready to decode got no row"
        # Admissions in queue order: only groups waiting for an adapter slot are passed,
        # and only by base-model groups; none in a step that preempted under "fcfs".
        passed = False
        for g in self.pre_waiting:
            if g.status is SeqStatus.RUNNING:
                assert not passed or g.lora_id == 0, "a group admitted out of order"
                assert not (victims and s.scheduling_policy == "fcfs")
            elif g.status is SeqStatus.WAITING:
                assert g.lora_id != 0 or not any(
                    h.status is SeqStatus.RUNNING
                    for h in self.pre_waiting[self.pre_waiting.index(g) + 1 :]
                ), "a base group passed by one behind it"
                passed = passed or g.lora_id != 0


@pytest.mark.parametrize("seed", range(12))
def test_randomized_plans_keep_the_limits_and_the_order(seed):
    rng = np.random.default_rng(seed)
    policy = ("fcfs", "priority")[seed % 2]
    max_loras = (None, 1, 2)[seed % 3]
    max_num_seqs = int(rng.integers(1, 6))
    sim = ReviewSim(
        policy,
        max_loras,
        num_pages=int(rng.integers(8, 20)),
        max_num_seqs=max_num_seqs,
        budget=int(rng.integers(max_num_seqs, 20)),
        caching=bool(rng.integers(2)),
        in_flight=bool(rng.integers(2)),
        stop=42,
    )
    ids = iter(range(1000))
    aborted = set()

    def add():
        rid = f"r{next(ids)}"
        prompt = rng.integers(3, 100, size=int(rng.integers(1, 14))).tolist()
        if rng.random() < 0.3:  # a shared prefix: prefix-cache hits
            prompt = [5, 6, 7, 8, 9][: len(prompt)] + prompt[5:]
        sim.add_request(
            rid,
            prompt,
            int(rng.integers(1, 16)),
            n=int(rng.integers(1, min(3, max_num_seqs) + 1)),
            priority=int(rng.integers(-1, 3)) if policy == "priority" else 0,
            lora_id=int(rng.choice([0, 0, 1, 2, 3])) if max_loras else 0,
        )

    def on_apply(s):
        live = [g.request_id for g in s.sched.running + list(s.sched.waiting)]
        if live and rng.random() < 0.05:
            rid = live[int(rng.integers(len(live)))]
            s.sched.abort(rid)
            aborted.add(rid)

    for _ in range(6):
        add()
    for _ in range(40):
        if rng.random() < 0.3:
            add()
        sim.step(on_apply)
        sim.bm.check_invariants()
    sim.run(max_steps=2000, on_apply=None)
    assert set(sim.done) | aborted == set(sim.prompts)
    for rid, g in sim.done.items():
        prompt, max_tokens = sim.prompts[rid]
        for q in g.finished:
            assert q.token_ids == reference(prompt, max_tokens, stop=42)
    assert sim.bm.stats().num_used_pages == 0 and sim.bm.stats().num_seqs == 0
