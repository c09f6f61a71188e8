"""Sliding windows against everything else the scheduler does at once: requests sharing
prefixes (prefix-cache hits whose head pages a window released), n > 1 samples (forked
pages, copy-on-write), beams forking and dropping, chunked prefill, aborts, preemption by
recompute in tight caches, and asynchronous commits; windows of 1 to 12 tokens on pages
of 1 to 8.

The simulated device (`test_scheduler`'s fake model, whose next token is a function of
the whole sequence) writes every row of a step before any row attends, as the jitted step
does (a prefix hit may name pages another row of the same step writes), and writes real
tokens for the rows of a request aborted after its step was planned (the engine
dispatches them). Every query's window must hold exactly its tokens; after every step
the block manager's invariants hold, a sequence holds at most `window_pages` pages, and
reservations plus used pages fit; at the end every page is back.
"""

import numpy as np
import pytest
import test_scheduler
from test_scheduler import next_token, reference
from test_window_admission import WindowSim

from pagedjax.scheduler import SeqStatus, Sequence, SequenceGroup


class DeviceSim(WindowSim):
    """`WindowSim` with the device's write-then-attend order (module docstring)."""

    def write_and_check(self, plan, fed):
        ps = self.bm.page_size
        for src, dst in plan.copies:
            self.pool[dst * ps : (dst + 1) * ps] = self.pool[src * ps : (src + 1) * ps]
        for r in plan.rows:
            if r.seq is None:
                continue
            if r.feed and r.seq.status is SeqStatus.RUNNING:
                assert r.seq.token_ids[r.start] == fed[id(r.seq)]
            toks = r.seq.token_ids[r.start : r.start + r.num_tokens]
            self.pool[r.slots] = toks if len(toks) == r.num_tokens else -7
        out = []
        for r in plan.rows:
            if r.seq is None or r.seq.status is not SeqStatus.RUNNING:
                out.append(None)
                continue
            ctx = r.start + r.num_tokens
            pos = np.arange(max(r.start - self.w + 1, 0), ctx)  # what its queries see
            table = r.page_row if not r.decode else self.bm.page_tables([r.seq.seq_id])[0]
            got = self.pool[table[pos // ps] * ps + pos % ps].tolist()
            assert got == r.seq.token_ids[pos[0] : ctx], "K/V of a wrong token"
            out.append(next_token(r.seq.token_ids[:ctx]))
        return out


def beam_shuffle(sim, rng):
    """on_apply: in some beam groups, drops a beam and forks another one with a token of
    its own (as a beam-search selection does between `schedule()` and `commit()`)."""
    for g in list(sim.sched.running):
        ready = [s for s in g.seqs if s._ready()] if g.atomic else []
        if len(ready) >= 2 and rng.random() < 0.4:
            a, b = ready[:2]
            sim.sched.drop(g, a)
            tok = (b.token_ids[-1] + 1) % 97 + 3
            child = Sequence(
                next(sim.ids), [*b.token_ids[:-1], tok], b.num_prompt_tokens, b.max_num_tokens
            )
            sim.sched.fork(g, b, child)


def run_trial(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    w = int(rng.choice([1, 2, 3, 4, 5, 6, 8, 9, 12]))
    ps = int(rng.choice([1, 2, 4, 8]))
    budget = int(rng.integers(4, 10))
    in_flight = bool(rng.integers(2))
    monkeypatch.setattr(test_scheduler, "PS", ps)  # Sim's page size
    probe = DeviceSim(w, num_pages=64, max_num_seqs=4, budget=budget)
    wp = probe.sched.window_pages
    # Just enough for n = 3 alone: preemption is common.
    sim = DeviceSim(
        w, num_pages=int(rng.integers(3 * wp, 3 * wp + 3)), max_num_seqs=4, budget=budget,
        in_flight=in_flight,
    )  # fmt: skip
    shared = rng.integers(3, 100, int(rng.integers(1, 30))).tolist()
    prompts, beams = {}, set()
    for i in range(int(rng.integers(5, 12))):
        if rng.random() < 0.6:
            k = int(rng.integers(0, len(shared) + 1))
            p = shared[:k] + rng.integers(3, 100, int(rng.integers(0, 10))).tolist()
        else:
            p = rng.integers(3, 100, int(rng.integers(1, 60))).tolist()
        rid, p, max_tokens = f"r{i}", p or [5], int(rng.integers(1, 20))
        try:
            if not in_flight and rng.random() < 0.25:  # beam rows commit synchronously
                width = int(rng.integers(2, 4))
                seqs = [
                    Sequence(next(sim.ids), list(p), len(p), len(p) + max_tokens, j)
                    for j in range(width)
                ]
                sim.sched.add(SequenceGroup(rid, seqs, width, atomic=True))
                beams.add(rid)
            else:
                sim.add(rid, p, max_tokens, n=int(rng.integers(1, 4)))
        except ValueError:  # n sequences that do not fit the cache at once
            continue
        prompts[rid] = p

    def on_apply(s):
        live = s.sched.running
        if live and rng.random() < 0.03:
            s.sched.abort(live[rng.integers(len(live))].request_id)
        else:
            beam_shuffle(s, rng)

    sim.run(on_apply=on_apply)  # checks the invariants after every step
    for rid, g in sim.done.items():
        for s in g.finished if rid not in beams else ():
            p = prompts[rid]
            assert s.token_ids == reference(p, len(s.token_ids) - len(p)), (seed, rid)
    assert sim.most <= sim.sched.window_pages
    stats = sim.bm.stats()
    assert (stats.num_used_pages, stats.num_seqs, sim.bm.num_reserved_pages) == (0, 0, 0)
    return sim.sched.num_preemptions, stats.prefix_hits


@pytest.mark.parametrize("block", range(3))
def test_windows_with_prefix_hits_forks_beams_aborts_and_preemption(block, monkeypatch):
    preempted = hits = 0
    for seed in range(40 * block, 40 * block + 40):
        p, h = run_trial(seed, monkeypatch)
        preempted, hits = preempted + p, hits + h
    assert preempted > 0 and hits > 0
