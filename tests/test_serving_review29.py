"""pagedjax.serving, reviewed (29): the engine thread across threads, with a real tiny
engine (`tiny` preset, backend "xla"): a step that fails after some requests finished,
a burst of clients that end their requests every way a client can, requests without
token events, and `call`s whose result the thread reads for outputs.

Every wait has a bound, so that a hang fails in seconds.
"""

import queue
import threading

import numpy as np
import pytest
from engine_helpers import check_clean

from pagedjax import decode
from pagedjax.config import PRESETS
from pagedjax.engine import LLM
from pagedjax.metrics import prometheus_text
from pagedjax.request import RequestOutputKind, SamplingParams
from pagedjax.serving import EngineThread

WAIT = 20.0  # seconds: a bound on every wait (a compile included), never reached when right


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def sync_llm():
    """An engine that applies each step's tokens before it dispatches the next one."""
    return LLM(
        PRESETS["tiny"],
        page_size=8,
        num_pages=32,
        backend="xla",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        async_scheduling=False,
    )


def events(sink):
    """A request's events up to and including its first done/error event."""
    out = []
    while not out or out[-1][0] not in ("done", "error"):
        out.append(sink.get(timeout=WAIT))
    return out


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_request_finished_before_a_step_failed_gets_its_output(sync_llm, monkeypatch):
    """Request "a" (2 tokens) finishes when a step applies the previous step's tokens;
    that step's decode dispatch then fails. The engine keeps "a"'s output for its next
    step (`LLM.step`: requests finished before the failure are not aborted); the thread
    answered it with a 500 all the same, and dropped the output the next step returned.
    "a" gets its done event (its whole output, its tokens streamed once each), "b",
    which the recovery aborted, a 500."""
    llm = sync_llm
    alone = llm.generate([[5, 6, 7]], greedy(2))[0].outputs[0].token_ids
    calls = []
    real = decode.decode_step

    def fail(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise Injected("the second decode step")
        return real(*args, **kw)

    monkeypatch.setattr(decode, "decode_step", fail)
    engine = EngineThread(llm)
    try:
        sinks = {rid: queue.SimpleQueue() for rid in "ab"}
        engine.submit(
            [("a", [5, 6, 7], greedy(2)), ("b", [8, 9, 10, 11], greedy(9))],
            sinks["a"],
            tokens=True,
        )
        evs = events(sinks["a"])
        while len([e for e in evs if e[0] in ("done", "error")]) < 2:
            evs.append(sinks["a"].get(timeout=WAIT))
        ends = {e[1]: e for e in evs if e[0] in ("done", "error")}
        assert ends["b"][:3] == ("error", "b", 500), ends
        assert ends["a"][0] == "done", ends["a"]
        assert ends["a"][2].outputs[0].token_ids == alone
        assert [e[3] for e in evs if e[0] == "token" and e[1] == "a"] == alone
        assert engine.num_failed_steps == 1
        engine.call(check_clean, timeout=WAIT)
        assert engine.call(lambda llm: (engine._sinks, engine._streamed)) == ({}, {})
    finally:
        engine.stop(timeout=WAIT)


@pytest.fixture(scope="module")
def llm():
    """An engine with asynchronous scheduling (the default) and few pages: concurrent
    requests preempt each other."""
    return LLM(
        PRESETS["tiny"],
        page_size=8,
        num_pages=16,
        backend="xla",
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )


class RaisingSink:
    """A sink whose put raises from its `after`-th event on (a client gone)."""

    def __init__(self, after: int):
        self.after, self.got = after, []

    def put(self, event):
        if len(self.got) >= self.after:
            raise ConnectionResetError("client gone")
        self.got.append(event)


def engine_state(engine):
    """What the thread and its engine hold per request (all empty once every request
    ended)."""

    def read(llm):
        return dict(
            sinks=dict(engine._sinks),
            streamed=dict(engine._streamed),
            prompts_due=set(engine._prompts_due),
            broken=list(engine._broken),
            groups=dict(llm.scheduler._groups),
            outputs=dict(llm._outputs),
            collect=set(llm._collect),
            unclaimed=list(llm._unclaimed),
            carried=list(llm.core._carried),
            stranded=list(llm.outputs.stranded),
            used_pages=llm.block_manager.stats().num_used_pages,
        )

    return engine.call(read, timeout=WAIT)


def test_a_burst_from_many_threads_leaves_nothing_behind(llm):
    """Four threads submit seeded requests (token-streamed or not, logprobs, prompt
    logprobs, n of 1 or 2) and end each as a client would: read it to its end, abort it
    at once (before the engine took it, maybe), abort it after some events, or have its
    sink raise after some (a client gone); a fifth reads the metrics all along, a sixth
    aborts ids that finished or never existed. Each read-to-the-end request gets its
    done event, none an error, and nothing comes after an abort; the thread and the
    engine hold nothing of any request afterwards, every page free."""
    rng = np.random.default_rng(29)
    num = 16
    plans = []
    for i in range(num):
        params = SamplingParams(
            n=int(rng.integers(1, 3)),
            max_tokens=int(rng.integers(1, 7)),
            temperature=float(rng.choice([0.0, 0.8])),
            seed=i,
            ignore_eos=True,
            logprobs=1 if rng.random() < 0.3 else None,
            prompt_logprobs=1 if rng.random() < 0.2 else None,
        )
        prompt = rng.integers(3, 256, size=int(rng.integers(2, 20))).tolist()
        how = str(rng.choice(["read", "abort_now", "abort_later", "raise"]))
        plans.append(
            (f"r{i}", prompt, params, bool(rng.random() < 0.7), how, int(rng.integers(1, 4)))
        )
    engine = EngineThread(llm)
    failures, results, stop_metrics = [], {}, threading.Event()
    start = threading.Barrier(6, timeout=WAIT)

    def client(k):
        try:
            start.wait()
            for rid, prompt, params, tokens, how, after in plans[k::4]:
                sink = RaisingSink(after) if how == "raise" else queue.SimpleQueue()
                engine.submit([(rid, prompt, params)], sink, tokens=tokens)
                if how == "raise":
                    results[rid] = (how, sink)
                    continue
                if how == "abort_now":
                    engine.abort([rid])
                    results[rid] = (how, sink)
                    continue
                evs = []
                while not evs or evs[-1][0] not in ("done", "error"):
                    if how == "abort_later" and len(evs) == after:
                        engine.abort([rid])
                        break
                    evs.append(sink.get(timeout=WAIT))
                results[rid] = (how, sink, evs)
        except Exception as e:  # noqa: BLE001  (reported by the main thread)
            failures.append(e)

    def scraper():
        try:
            start.wait()
            while not stop_metrics.wait(0.005):
                assert "pagedjax" in engine.call(lambda llm: prometheus_text(llm, "m"))
        except Exception as e:  # noqa: BLE001
            failures.append(e)

    def aborter():
        try:
            start.wait()
            for i in range(40):
                engine.abort([f"r{i % num}", f"never{i}"])
        except Exception as e:  # noqa: BLE001
            failures.append(e)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    threads += [threading.Thread(target=f, daemon=True) for f in (scraper, aborter)]
    try:
        for t in threads:
            t.start()
        for t in threads[:4]:
            t.join(6 * WAIT)
        stop_metrics.set()
        for t in threads[4:]:
            t.join(WAIT)
        assert not any(t.is_alive() for t in threads) and not failures, failures
        engine.call(lambda llm: None, timeout=WAIT)  # (every abort handled)
        for _ in range(50):  # (the steps after the last aborts: their step in flight)
            state = engine_state(engine)
            if not (state["groups"] or state["used_pages"]):
                break
        assert state == dict(
            sinks={},
            streamed={},
            prompts_due=set(),
            broken=[],
            groups={},
            outputs={},
            collect=set(),
            unclaimed=[],
            carried=[],
            stranded=[],
            used_pages=0,
        )
        engine.call(check_clean, timeout=WAIT)
        assert len(results) == num
        for rid, (how, sink, *evs) in results.items():
            if how == "raise":
                assert all(e[0] != "error" for e in sink.got), sink.got
                continue
            late = []
            while not sink.empty():
                late.append(sink.get_nowait())
            if how == "read" or (how == "abort_later" and evs[0][-1][0] == "done"):
                assert evs[0][-1][0] == "done" and not late, (rid, evs, late)
            else:  # (an abort: events sent before it was handled, never an error)
                assert all(e[0] in ("token", "prompt", "done") for e in late), (rid, late)
    finally:
        stop_metrics.set()
        engine.stop(timeout=WAIT)


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
def test_a_request_without_token_events_gets_its_whole_output(llm, kind):
    """Output kind DELTA, submitted without token events (tokens=False): the thread
    sends no partial output, so its done event is all the caller gets. It held the last
    step's piece alone (the tokens before it were lost); now it holds the whole
    completion, as `LLM.generate` returns whole outputs whatever the kind. (CUMULATIVE,
    whose final output is whole anyway, the same.)"""
    greedy5 = dict(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    engine = EngineThread(llm)
    try:
        (want,) = engine.call(lambda llm: llm.generate([[5, 6, 7]], SamplingParams(**greedy5)))
        params = SamplingParams(**greedy5, output_kind=RequestOutputKind[kind])
        sink = queue.SimpleQueue()
        engine.submit([("r", [5, 6, 7], params)], sink, tokens=False)
        (done,) = events(sink)
        assert done[0] == "done", done
        (got,) = done[2].outputs
        assert got.token_ids == want.outputs[0].token_ids
        assert got.text == want.outputs[0].text
        assert len(got.logprobs) == 5
    finally:
        engine.stop(timeout=WAIT)


@pytest.mark.parametrize("tokens", [False, True])
def test_a_call_returning_a_sequence_group_is_not_taken_for_an_output(llm, tokens):
    """A `call` that inspects a request (`llm.scheduler.get(rid)`: its SequenceGroup)
    while one of its two completions has finished: the group has a `request_id` and a
    truthy `finished` (its finished sequences), and the thread took it for the request's
    final output. Without token events it sent the group as the done event's output and
    forgot the request, which ran on; with them, reading its `outputs` raised, killed
    the thread and left the caller waiting. Now the call answers, and the request goes
    on to its real done event."""
    # (seed 4: completion 0 stops after 1 token, completion 1 runs 8)
    params = SamplingParams(
        n=2, max_tokens=8, temperature=1.0, seed=4, stop_token_ids=list(range(3, 60))
    )
    engine = EngineThread(llm)
    try:
        want = engine.call(lambda llm: llm.generate([[5, 6, 7]], params)[0])
        assert [len(c.token_ids) for c in want.outputs] == [1, 8]
        sink = queue.SimpleQueue()
        engine.submit([("r", [5, 6, 7], params)], sink, tokens=tokens)

        def inspect(llm):  # (steps until one completion finished, then returns the group)
            while (g := llm.scheduler.get("r")) is not None and not g.finished:
                llm.step()
            return g

        group = engine.call(inspect, timeout=WAIT)
        assert group is not None and len(group.finished) == 1
        evs = events(sink)
        assert evs[-1][0] == "done", evs[-1]
        out = evs[-1][2]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        assert engine.alive
    finally:
        engine.stop(timeout=WAIT)
