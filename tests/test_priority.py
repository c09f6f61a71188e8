"""Priority scheduling (`scheduling_policy="priority"`, vLLM's): lower priority first, ties
by arrival. The scheduler with a simulated device (tests/test_scheduler.py's `Sim`):
admission order, the preemption victim, where a preempted group waits, `recover`'s
order, and "fcfs" as before. The engine: outputs under pressure are those of a roomy
first-come-first-served engine, completion order, the checks of `priority` and
`scheduling_policy`; the server: vLLM's `priority` field and `--scheduling-policy`.
"""

import numpy as np
import pytest
import serve_helpers
from engine_helpers import GEOMETRY, check_clean, greedy, random_params
from serve_helpers import ok, request, serve
from test_scheduler import PS, Sim, reference

from pagedjax.blocks import BlockManager
from pagedjax.engine import LLM, SamplingParams
from pagedjax.scheduler import Scheduler, SeqStatus, Sequence, SequenceGroup

# serve_helpers' fixtures, bound here: this module gets its own checkpoint and servers.
ckpt, ref, server = serve_helpers.ckpt, serve_helpers.ref, serve_helpers.server


class PrioritySim(Sim):
    """`Sim` over a scheduler of `policy`; `add` takes each request's priority."""

    def __init__(self, policy="priority", **kw):
        super().__init__(**kw)
        s = self.sched
        self.sched = Scheduler(
            self.bm,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            scheduling_policy=policy,
        )

    def add(self, rid, prompt, max_tokens, priority=0):
        p = len(prompt)
        seq = Sequence(next(self.ids), list(prompt), p, p + max_tokens)
        g = SequenceGroup(rid, [seq], priority=priority)
        self.sched.add(g)
        return g


def waiting(sim) -> list:
    return [g.request_id for g in sim.sched.waiting]


def prompt(i: int, n: int = 7) -> list[int]:
    return [(3 + 5 * i + j) % 97 + 3 for j in range(n)]


# ------------------------------------------------------------------ the scheduler


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_admission_by_priority_then_arrival(policy):
    """One seat: requests run one after the other, best (priority, arrival) first; under
    "fcfs" (every priority 0) in arrival order."""
    prios = [2, 0, 1, 0, -1] if policy == "priority" else [0] * 5
    sim = PrioritySim(policy, max_num_seqs=1, budget=16)
    for i, p in enumerate(prios):
        sim.add(f"r{i}", prompt(i), 3, priority=p)
    want = ["r4", "r1", "r3", "r2", "r0"] if policy == "priority" else [f"r{i}" for i in range(5)]
    assert waiting(sim) == want
    sim.run()
    assert list(sim.done) == want
    for i in range(5):
        assert sim.done[f"r{i}"].finished[0].token_ids == reference(prompt(i), 3)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_takes_the_worst_priority_and_requeues_it_at_its_place(policy):
    """`a` (priority 1) runs, then `b` (priority 0) is admitted after it; when their pages
    run out, the victim is `a`, the worst, not `b`, the last admitted, and it waits behind
    the better `c` and ahead of the worse `d`, not at the front. Under "fcfs": `b`, first."""
    prio = policy == "priority"
    sim = PrioritySim(policy, num_pages=12, max_num_seqs=4, budget=16)
    a = sim.add("a", prompt(0), 20, priority=1 if prio else 0)
    sim.step()
    b = sim.add("b", prompt(1), 20)
    sim.step()
    assert sim.sched.running == [a, b]
    # c needs 10 pages: it waits (and d behind it) until a whole request's pages free up.
    c = sim.add("c", list(range(3, 43)), 1)
    sim.add("d", [4] * 5, 2, priority=2 if prio else 0)
    assert waiting(sim) == ["c", "d"]
    while sim.sched.num_preemptions == 0:
        sim.step()
    victim, kept = (a, b) if prio else (b, a)
    assert victim.status is SeqStatus.WAITING and kept.status is SeqStatus.RUNNING
    assert sim.sched.running == [kept] and victim.num_preemptions == 1
    assert waiting(sim) == (["c", "a", "d"] if prio else ["b", "c", "d"])
    sim.run()
    for g, p, k in ((a, prompt(0), 20), (b, prompt(1), 20), (c, list(range(3, 43)), 1)):
        assert sim.done[g.request_id].finished[0].token_ids == reference(p, k)
    assert sim.done["d"].finished[0].token_ids == reference([4] * 5, 2)
    assert sim.bm.stats().num_used_pages == 0


def test_commit_out_of_pages_preempts_the_worst_priority_first():
    """`commit`'s fallback (pages taken after `schedule()`) takes the worst priority too
    (`a`, admitted first), not the last admitted (`c`)."""
    sim = PrioritySim(num_pages=16, max_num_seqs=4, budget=16)
    prompts = {r: [3 + i] * PS for i, r in enumerate("abc")}  # a full page: appends need one
    a = sim.add("a", prompts["a"], 6, priority=2)
    sim.step()
    b, c = sim.add("b", prompts["b"], 6), sim.add("c", prompts["c"], 6, priority=1)
    sim.step()  # a decodes into a new page; b and c prefill, best first
    assert sim.sched.running == [a, b, c]
    plan = sim.sched.schedule()
    prev, toks = sim.inflight
    sim.apply(prev, toks, None)
    sim.bm.admit("thief", list(range(sim.bm.num_free_pages * PS)))  # every free page
    sim.sched.commit(plan)  # b and c need a page each: a's two
    assert [r.seq is not None for r in plan.rows] == [False, True, True]
    assert sim.sched.running == [b, c] and waiting(sim) == ["a"]
    sim.bm.free("thief")
    sim.run_from(plan)
    for rid, p in prompts.items():
        assert sim.done[rid].finished[0].token_ids == reference(p, 6)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_recover_requeues_by_priority(policy):
    """`recover` keeps requests waiting where preemption would put them: by (priority,
    arrival); under "fcfs", the running ones first (admission order), then the waiting."""
    prio = policy == "priority"
    sim = PrioritySim(policy, max_num_seqs=2, budget=16)
    sim.add("r0", prompt(0), 6, priority=2 if prio else 0)
    sim.add("r1", prompt(1), 6, priority=1 if prio else 0)
    sim.step()
    sim.add("r2", prompt(2), 6)  # better than both running ones, but no seat
    sim.add("r3", prompt(3), 6, priority=3 if prio else 0)
    sim.step()
    assert [g.request_id for g in sim.sched.running] == (["r1", "r0"] if prio else ["r0", "r1"])
    assert sim.sched.recover(lambda g: True) == []
    sim.inflight = None
    assert waiting(sim) == (["r2", "r1", "r0", "r3"] if prio else ["r0", "r1", "r2", "r3"])
    sim.run()
    for i in range(4):
        assert sim.done[f"r{i}"].finished[0].token_ids == reference(prompt(i), 6)


def test_scheduler_checks_policy_and_priority():
    """A policy other than the two, a priority that is no int, and (under "fcfs") one
    other than 0 are refused, the group not queued."""
    bm = BlockManager(8, PS, max_model_len=32)
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'.*lifo"):
        Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=4, scheduling_policy="lifo")
    fcfs = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=4)
    group = SequenceGroup("r", [Sequence(0, [3, 4], 2, 4)], priority=1)
    with pytest.raises(ValueError, match="'r': got priority=1 but priority scheduling is not"):
        fcfs.add(group)
    assert not fcfs.waiting and not fcfs.has_unfinished()
    by_priority = Scheduler(
        bm, max_num_seqs=1, max_num_batched_tokens=4, scheduling_policy="priority"
    )
    for bad in (True, 1.0, "1", None):
        with pytest.raises(ValueError, match="priority must be an int"):
            by_priority.check_priority(bad)
    assert by_priority.check_priority(np.int64(-3)) == -3 and fcfs.check_priority(0) == 0


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def params():
    return random_params()


def test_priority_under_pressure_gives_the_roomy_fcfs_outputs(params):
    """Ten requests of up to 60 tokens (8 pages each) in 64 pages with a seat each, by
    priority: preemption by recompute changes no output (greedy, seeded, n=2) from a
    roomy first-come-first-served engine's, and the best request, admitted last, is
    never the victim (the last admitted is, first come first served)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(5, 24, 10)]
    sps = []
    for i, p in enumerate(prompts):
        if i % 3 == 0:
            sps.append(greedy(60 - len(p), ignore_eos=True))
        else:
            n = 2 if i == 4 else 1
            sp = SamplingParams(
                n=n, temperature=0.9, seed=i, max_tokens=60 - len(p), ignore_eos=True
            )
            sps.append(sp)
    prios = rng.integers(0, 3, 10).tolist()
    prios[-1] = -1  # the best
    roomy = LLM(params, max_num_batched_tokens=16, **(GEOMETRY | dict(max_num_seqs=4)))
    want = roomy.generate(prompts, sps)
    assert roomy.summary()["preemptions"] == 0
    llm = LLM(
        params,
        max_num_batched_tokens=16,
        scheduling_policy="priority",
        **(GEOMETRY | dict(max_num_seqs=11)),
    )
    index = {llm.add_request(prompts[i], sps[i], priority=prios[i]): i for i in range(9)}
    got, steps = {}, 0
    while llm.has_unfinished_requests() or len(index) < 10:
        if len(index) < 10 and steps and not llm.scheduler.waiting:  # the others all run
            index[llm.add_request(prompts[9], sps[9], priority=prios[9])] = 9
        got |= {index[o.request_id]: o for o in llm.step() if o.finished}
        steps += 1
    got = [got[i] for i in range(10)]
    assert llm.summary()["preemptions"] > 0 and got[9].num_preemptions == 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], i
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs], i
    check_clean(llm)
    check_clean(roomy)


@pytest.fixture(scope="module")
def one_seat(params):
    return LLM(
        params,
        max_num_batched_tokens=16,
        scheduling_policy="priority",
        **(GEOMETRY | dict(max_num_seqs=1)),
    )


def test_completion_order_follows_priority(one_seat):
    """One seat: requests queued with `add_request`, or a `generate` call's, run one at a
    time, best first, ties by arrival."""
    llm, prios = one_seat, [2, 0, 1, 0, -1]
    rids = [llm.add_request(prompt(i), greedy(3), priority=p) for i, p in enumerate(prios)]
    done = {}
    while llm.has_unfinished_requests():
        done |= {o.request_id: o for o in llm.step() if o.finished}
    assert list(done) == [rids[i] for i in (4, 1, 3, 2, 0)]
    admitted = []

    def record(engine):
        admitted.extend(
            g.request_id for g in engine.scheduler.running if g.request_id not in admitted
        )

    outs = llm.generate([prompt(i) for i in range(5)], greedy(3), priority=prios, on_step=record)
    index = {o.request_id: i for i, o in enumerate(outs)}
    assert [index[r] for r in admitted] == [4, 1, 3, 2, 0]
    for rid, o in zip(rids, outs, strict=True):
        assert o.outputs[0].token_ids == done[rid].outputs[0].token_ids
    check_clean(llm)


def test_priority_and_policy_are_checked_before_anything_is_queued(params, one_seat):
    # Before the checkpoint is read (there is none at that path).
    with pytest.raises(ValueError, match="scheduling_policy=.lifo."):
        LLM("/nonexistent/checkpoint", scheduling_policy="lifo")
    llm = one_seat
    for bad in (True, 1.5, "0"):
        with pytest.raises(ValueError, match="priority must be an int"):
            llm.add_request([3, 4], greedy(2), priority=bad)
    with pytest.raises(ValueError, match="prompt 1: .*priority must be an int"):
        llm.generate([[3, 4], [5, 6]], greedy(2), priority=[0, None])
    with pytest.raises(ValueError, match="2 prompts but 3 priorities"):
        llm.generate([[3, 4], [5, 6]], greedy(2), priority=[0, 1, 2])
    with pytest.raises(TypeError, match="priority must be a list of ints"):
        llm.generate([[3, 4], [5, 6]], greedy(2), priority=1)
    check_clean(llm)
    fcfs = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    assert fcfs.scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="got priority=1 but priority scheduling is not enabled"):
        fcfs.add_request([3, 4], greedy(2), priority=1)
    with pytest.raises(ValueError, match="prompt 1: got priority=-2 but priority scheduling"):
        fcfs.generate([[3, 4], [5, 6]], greedy(2), priority=[0, -2])
    check_clean(fcfs)
    out = fcfs.generate([[3, 4]], greedy(2), priority=[0])  # 0 is every fcfs request's
    assert len(out[0].outputs[0].token_ids) == 2


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def priority_server(ckpt):
    llm = serve_helpers.make_llm(ckpt, scheduling_policy="priority")
    seen = []  # the priority each request's group got, read on the engine thread
    add = llm.add_request

    def recording_add(*args, **kw):
        rid = add(*args, **kw)
        seen.append(llm.scheduler.get(rid).priority)
        return rid

    llm.add_request = recording_add
    for srv in serve_helpers.serving(llm, "tiny"):
        srv.seen = seen
        yield srv


def test_priority_field_reaches_the_engine(priority_server, ref):
    body = dict(prompt="def add(a, b):", max_tokens=4, temperature=0)
    want = ref.generate(["def add(a, b):"], SamplingParams(max_tokens=4, temperature=0.0))
    got = ok(priority_server, "/v1/completions", {**body, "priority": -3})
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    ok(priority_server, "/v1/completions", dict(prompt=["a", "b"], max_tokens=1, priority=5))
    ok(priority_server, "/v1/completions", dict(prompt="a", max_tokens=1))
    assert priority_server.seen == [-3, 5, 5, 0]
    status, obj = request(priority_server, "/v1/completions", dict(prompt="a", priority="1"))
    assert status == 400 and obj["error"]["param"] == "priority", obj
    assert "priority must be an int, got priority='1'" in obj["error"]["message"]
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(TypeError, match="params\\[, priority\\[, lora_request\\]\\]"):
        priority_server.engine.submit([("r", [1], sp, 0, None, 0)], None, tokens=False)
    with pytest.raises(TypeError, match="the lora_request must be a LoRARequest or None, got 0"):
        priority_server.engine.submit([("r", [1], sp, 0, 0)], None, tokens=False)


def test_a_nonzero_priority_under_fcfs_is_a_400(server):
    status, obj = request(server, "/v1/completions", dict(prompt="a", max_tokens=1, priority=1))
    assert status == 400 and obj["error"]["param"] == "priority", obj
    assert "got priority=1 but priority scheduling is not enabled" in obj["error"]["message"]
    assert "--scheduling-policy priority" in obj["error"]["message"]
    ok(server, "/v1/completions", dict(prompt="a", max_tokens=1, priority=0))


def test_the_cli_flag(ckpt, monkeypatch, capsys):
    started = serve_helpers.capture_start(monkeypatch)
    argv = ["--checkpoint", ckpt, "--port", "0", "--quiet", "--backend", "xla"]
    argv += ["--page-size", "8", "--num-pages", "64", "--compilation-cache", "off"]
    assert serve.main([str(a) for a in argv + ["--scheduling-policy", "priority"]]) == 0
    assert started[0].scheduler.scheduling_policy == "priority"
    capsys.readouterr()
    assert serve.main([str(a) for a in argv + ["--scheduling-policy", "lifo"]]) == 2
    err = capsys.readouterr().err
    assert "--scheduling-policy: invalid choice: 'lifo'" in err and err.count("\n") == 1, err
    assert serve.build_parser().parse_args([]).scheduling_policy == "fcfs"
