"""Review 30 of the page hashes a sequence keeps (`Sequence.page_hashes`, a
`page_hashes.PageHashes`), adversarially: they hold only while the sequence's `token_ids`
list grows by appending, and a stale one is dangerous wherever `BlockManager.admit`'s
check of the hashed tokens (`_check_hashed`) is not reached (a false prefix hit), and
fatal where it is (an InvalidArgument inside a step aborts every request).

The one in-place edit of a live list is the engine's take-back of a token whose stop
checks raised (`OutputProcessor._take_back_token`: `del s.token_ids[n:]`), after which a
request the recovery keeps is recomputed and samples the token again. The tests drive it
with everything that moves a sequence between the queues around it: preemption by
recompute in tight caches, asynchronous commits (tokens appended after the next step was
planned), n > 1 samples forked off a prompt, beams forked and dropped, aborts, sliding
windows, salts, prompt logprobs (no cache reads), through the simulated device of
`test_scheduler` (every K/V slot a query reads is checked) and through `LLM` against a
fresh engine and the dense forward. Before every `schedule()` each kept hash must be the
hash of its list's tokens (`check_kept`): no stale hash ever reaches a lookup.

And memory: a kept copy of the hashed tokens (8 bytes a token) lives as long as its
sequence, which must not outlive its request (`test_no_page_hashes_outlive_their_requests`).
"""

import gc

import numpy as np
import params_helpers
import pytest
import test_scheduler
from engine_helpers import Dense
from test_scheduler import Sim, reference
from test_window_review import DeviceSim, beam_shuffle

from pagedjax import outputs, recovery
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams
from pagedjax.page_hashes import PageHashes, salt_bytes
from pagedjax.scheduler import SeqStatus, Sequence, SequenceGroup


def check_kept(sched) -> int:
    """Asserts that every queued or running sequence's kept page hashes that still claim
    to fit its list (`PageHashes.kept`) hash that list's tokens; returns how many."""
    n = 0
    for g in sched._groups.values():
        for s in g.seqs + g.forks:
            ph = s.page_hashes
            if ph is None or not ph.kept(s.token_ids, salt_bytes(g.cache_salt), ph.page_size):
                continue
            k = len(ph.hashes)
            assert len(ph.tokens) == 8 * k * ph.page_size
            want = np.array(s.token_ids[: k * ph.page_size], "<i8").tobytes()
            assert bytes(ph.tokens) == want, f"stale page hashes kept for {g.request_id!r}"
            fresh = PageHashes(want, ph.salt, ph.page_size)
            assert [h for h, _ in fresh.pages(k)] == ph.hashes
            n += 1
    return n


class TakenBack(Exception):
    """A token's stop checks raised (as a Ctrl-C in the detokenizer)."""


class TakeBack:
    """A `Sim` mixin: applying a token, at random, raises after it is appended and takes
    it back (as `OutputProcessor._accept` does when its stop checks raise), and the step
    recovers as `EngineCore._recover` does on a KeyboardInterrupt that keeps every request:
    the pages the failed step was to write leave the prefix cache (`unwritten_pages`),
    every request is requeued (`Scheduler.recover`) and recomputed, and the token is
    sampled again. Kept hashes are checked before every `schedule()`."""

    rng: np.random.Generator
    p_take_back = 0.02
    taken = recovered = kept = preempted = 0

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
            n = len(s.token_ids)
            s.token_ids.append(t)
            if not r.group.atomic and self.rng.random() < self.p_take_back:
                del s.token_ids[n:]  # (`_take_back_token`)
                self.taken += 1
                raise TakenBack
            if t == self.stop or len(s.token_ids) >= s.max_num_tokens:
                self.sched.finish(r.group, s, "stop" if t == self.stop else "length")
                if r.group.done:
                    self.done[r.group.request_id] = r.group
        if on_apply:
            on_apply(self)

    def step(self, on_apply=None):
        self.kept += check_kept(self.sched)
        real = self.sched.schedule
        plans = []

        def schedule():
            plans.append(real())
            return plans[-1]

        self.sched.schedule = schedule
        try:
            return super().step(on_apply)
        except TakenBack:
            # Not dispatched (the simulated device writes a step after its commit).
            unwritten = recovery.unwritten_pages(plans[-1], self.bm, self.bm.page_size)
            self.sched.recover(lambda g: True)
            self.bm.uncache(unwritten)
            self.inflight = None
            self.recovered += 1
            return plans[-1]
        finally:
            del self.sched.schedule


class TakeBackSim(TakeBack, Sim):
    """Full attention, with the device's write-then-attend order of `DeviceSim` (whose
    window is the whole sequence here): the rows of a request aborted after its step was
    planned write their real tokens (the engine dispatches them; their pages may be
    prefix-cache hits later)."""

    w = 1 << 30

    write_and_check = DeviceSim.write_and_check


class TakeBackWindowSim(TakeBack, DeviceSim):
    pass


def run_trial(seed, monkeypatch, window: bool):
    rng = np.random.default_rng(seed)
    ps = int(rng.choice([1, 2, 4]))
    budget = int(rng.integers(4, 12))
    in_flight = bool(rng.integers(2))
    monkeypatch.setattr(test_scheduler, "PS", ps)
    if window:
        w = int(rng.choice([1, 3, 5, 8]))
        wp = DeviceSim(w, num_pages=64, max_num_seqs=4, budget=budget).sched.window_pages
        pages = int(rng.integers(2 * wp, 2 * wp + 3))
        sim = TakeBackWindowSim(
            w, num_pages=pages, max_num_seqs=4, budget=budget, in_flight=in_flight
        )
    else:
        pages = int(rng.integers(24, 48)) // ps + 4
        sim = TakeBackSim(num_pages=pages, max_num_seqs=4, budget=budget, in_flight=in_flight)
    sim.rng = rng
    real_preempt = sim.sched._preempt

    def preempt(g):  # (not the recoveries, which `num_preemptions` counts too)
        sim.preempted += 1
        real_preempt(g)

    sim.sched._preempt = preempt
    longest = 60 if window else 30  # (a window model holds its window's pages, not more)
    shared = rng.integers(3, 100, int(rng.integers(1, longest - 6))).tolist()
    prompts, beams = {}, set()
    for i in range(int(rng.integers(6, 12))):
        if rng.random() < 0.7:
            k = int(rng.integers(0, len(shared) + 1))
            p = shared[:k] + rng.integers(3, 100, int(rng.integers(0, 6))).tolist()
        else:
            p = rng.integers(3, 100, int(rng.integers(1, longest))).tolist()
        rid, p, max_tokens = f"r{i}", p or [5], int(rng.integers(1, 24))
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
                g = sim.add(rid, p, max_tokens, n=int(rng.integers(1, 4)))
                g.cache_salt = ("a", None)[i % 2]
                g.read_prefix_cache = rng.random() < 0.9  # (prompt logprobs: no reads)
        except ValueError:  # n sequences that do not fit the cache at once
            continue
        prompts[rid] = p

    def on_apply(s):
        live = s.sched.running
        if live and rng.random() < 0.03:
            s.sched.abort(live[rng.integers(len(live))].request_id)
        else:
            beam_shuffle(s, rng)

    sim.run(on_apply=on_apply)  # the block manager's invariants after every step
    for rid, g in sim.done.items():
        for s in g.finished if rid not in beams else ():
            p = prompts[rid]
            assert s.token_ids == reference(p, len(s.token_ids) - len(p)), (seed, rid)
    stats = sim.bm.stats()
    assert (stats.num_used_pages, stats.num_seqs) == (0, 0)
    return sim


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
def test_taking_back_tokens_around_preemption_never_leaves_a_stale_hash(window, monkeypatch):
    """Random workloads where applying a token raises at random after appending it and
    takes it back, and the step recovers keeping every request (preempted, recomputed):
    before every step every kept hash is its list's (`check_kept`), no admission raises,
    no query reads K/V of another token, and every completion is the fake model's."""
    taken = recovered = kept = preempted = hits = 0
    for seed in range(30):
        sim = run_trial(seed, monkeypatch, window)
        taken, recovered, kept = taken + sim.taken, recovered + sim.recovered, kept + sim.kept
        preempted += sim.preempted
        hits += sim.bm.stats().prefix_hits
    assert taken == recovered > 20 and kept > 1000 and preempted > 10 and hits > 50


# ------------------------------------------------------------------------ engine

TINY = PRESETS["tiny"]  # float32, vocab 256, EOS 2
PS = 8
# A tight cache (preemption) and a small budget (chunked prefill).
GEOMETRY = dict(
    page_size=PS, num_pages=10, backend="xla", max_num_seqs=4, max_num_batched_tokens=16
)
RNG = np.random.default_rng(30)
PREFIX = RNG.integers(3, 256, size=2 * PS).tolist()  # two full pages shared
PROMPTS = [PREFIX, PREFIX + RNG.integers(3, 256, size=5).tolist(), PREFIX[:-1]]
GREEDY = dict(temperature=0.0, ignore_eos=True)
KEPT = [  # add_request's: the recovery keeps them
    SamplingParams(max_tokens=12, **GREEDY),
    SamplingParams(max_tokens=10, cache_salt="s", **GREEDY),
    SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=9, ignore_eos=True),
]


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


def completions(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_tokens_taken_back_after_preemptions_give_a_fresh_engines_outputs(
    params, monkeypatch, async_scheduling
):
    """A Ctrl-C in the stop checks of the k-th token of `add_request`'s requests that a
    `generate` call applies (each k in turn) takes the token back; those requests are
    requeued and recomputed (in a cache tight enough to preempt them, so their kept
    hashes are reused on each readmission): no step raises again, every kept hash is its
    list's before every step, and the outputs are a fresh engine's, the greedy ones the
    dense forward's."""
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    want = completions(llm.generate(PROMPTS, KEPT))
    dense = Dense(params)
    for p, sp, (got, *_) in zip(PROMPTS, KEPT, want, strict=True):
        if sp.temperature == 0:
            assert got == dense.greedy([p], sp.max_tokens, stop_ids=())[0]
    real_stop, real_schedule = outputs.OutputProcessor._stop, llm.scheduler.schedule
    kept = []

    def schedule():
        kept.append(check_kept(llm.scheduler))
        return real_schedule()

    monkeypatch.setattr(llm.scheduler, "schedule", schedule)
    preempted, real_preempt = [], llm.scheduler._preempt

    def preempt(g):  # (not the recoveries, which `num_preemptions` counts too)
        preempted.append(g.request_id)
        real_preempt(g)

    monkeypatch.setattr(llm.scheduler, "_preempt", preempt)
    k, taken = 0, []
    while True:
        k += 1
        ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, KEPT, strict=True)]
        calls = []

        def stop(self, req, s, tok, calls=calls, k=k, ids=ids):
            if req.request_id in ids:
                calls.append(req.request_id)
                if len(calls) == k:
                    taken.append(len(s.token_ids))
                    raise KeyboardInterrupt  # (a Ctrl-C in the detokenizer)
            return real_stop(self, req, s, tok)

        monkeypatch.setattr(outputs.OutputProcessor, "_stop", stop)
        try:
            llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, **GREEDY))
        except KeyboardInterrupt:
            pass
        else:
            break  # k is past the run's last token
        monkeypatch.setattr(outputs.OutputProcessor, "_stop", real_stop)
        done = {}
        while llm.has_unfinished_requests():
            done.update((o.request_id, o) for o in llm.step())
        assert completions([done[i] for i in ids]) == want, k
        llm.block_manager.check_invariants()
    while llm.has_unfinished_requests():
        llm.step()
    assert len(taken) > 10 and sum(kept) > 10 and len(preempted) > 10, (taken, preempted)
    assert llm.block_manager.stats().prefix_hits > 0


def live_page_hashes() -> int:
    gc.collect()
    return sum(isinstance(o, PageHashes) for o in gc.get_objects())


def test_no_page_hashes_outlive_their_requests(params):
    """A finished, aborted or beam-dropped sequence's kept hashes (a copy of its hashed
    tokens) go with it: once no step is in flight, none is referenced by the engine."""
    llm = LLM(params, **GEOMETRY)
    before = live_page_hashes()
    llm.generate(
        PROMPTS,
        [
            SamplingParams(max_tokens=4, **GREEDY),
            SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=4),
            SamplingParams(max_tokens=4, beam_width=2, **GREEDY),
        ],
    )
    rid = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=20, **GREEDY))
    llm.step()
    llm.step()
    assert any(s.page_hashes is not None for s in llm.scheduler.get(rid).seqs)
    llm.abort(rid)
    llm.step()  # (the step in flight at the abort names its sequence until it is done)
    assert not llm.has_unfinished_requests() and llm.core.inflight is None
    assert live_page_hashes() == before


def test_a_token_taken_back_drops_its_sequences_kept_hashes(params, monkeypatch):
    """`Sequence.page_hashes`' contract: a list edited in place other than by appending
    resets them. The take-back (`_take_back_token`) is such an edit; its hashes are not
    stale only because every hash is taken in `schedule()` and a token is taken back in
    the `_accept` that appended it (no `schedule()` between): kept, they hang on that
    order, which a change of the output path (a token taken back later) would break
    silently (an admission refusing them: every request aborted)."""
    llm = LLM(params, **GEOMETRY)
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=8, **GREEDY))
    llm.step()
    s = llm.scheduler.get(rid).seqs[0]
    assert s.page_hashes is not None  # (admitted)
    real_stop = outputs.OutputProcessor._stop

    def stop(self, req, seq, tok):
        if seq is s and seq.num_generated == 2:
            raise KeyboardInterrupt  # (a Ctrl-C in the detokenizer)
        return real_stop(self, req, seq, tok)

    monkeypatch.setattr(outputs.OutputProcessor, "_stop", stop)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, **GREEDY))
    assert s.num_generated == 1 and llm.scheduler.get(rid) is not None  # taken back, kept
    assert s.page_hashes is None
