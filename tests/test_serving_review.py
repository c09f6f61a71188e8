"""pagedjax.serving under concurrency, with a real tiny engine: what callers on many
threads get while others submit, abort, pause and stop.

The tests share one `LLM` (and so its compiled programs); each leaves it idle. A
request's stream is checked against the same request run alone: greedy and seeded
sampling give the same tokens whatever else runs in the batch, across preemptions and
pauses. Every wait has a bound, so that a hang fails in seconds.
"""

import dataclasses
import queue
import threading

import numpy as np
import pytest
from engine_helpers import check_clean

from pagedjax.config import PRESETS
from pagedjax.engine import LLM
from pagedjax.request import RequestOutputKind, SamplingParams
from pagedjax.serving import EngineStopped, EngineThread

WAIT = 20.0  # seconds: a bound on every wait (a compile included), never reached when right
DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def llm():
    # Few pages: concurrent requests preempt each other.
    return LLM(
        PRESETS["tiny"],
        page_size=8,
        num_pages=12,
        backend="xla",
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )


@pytest.fixture
def engine(llm):
    """An `EngineThread` over the shared engine; stopped after the test, and the engine
    resumed and emptied, so that a failed test leaves the next ones a usable one."""
    thread = EngineThread(llm)
    yield thread
    thread.stop(timeout=WAIT)
    assert not thread.alive
    if llm.is_paused():
        llm.resume_generation()
    for g in [*llm.scheduler.running, *llm.scheduler.waiting]:
        llm.abort(g.request_id)
    for _ in range(8):  # (the step in flight, and outputs held for the next)
        if llm.has_unfinished_requests():
            llm.step()
    assert not llm.has_unfinished_requests()


def events(sink):
    """A request's events up to and including its first done/error event."""
    out = []
    while not out or out[-1][0] not in ("done", "error"):
        out.append(sink.get(timeout=WAIT))
    return out


def streamed(evs, index=0) -> list[int]:
    return [e[3] for e in evs if e[0] == "token" and e[2] == index]


def test_a_delta_stream_keeps_the_tokens_a_pause_applies(llm, engine):
    """A pause ("wait") inside a `call` runs the request to its end without `on_token`;
    its stream lacked the tokens between its last token event and its final output,
    which with output_kind DELTA holds only the last ones. It has them all now, in
    order, before its done event."""
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = engine.call(
        lambda llm: llm.generate([[5, 6, 7]], SamplingParams(**greedy))[0].outputs[0].token_ids
    )
    sink = queue.SimpleQueue()
    engine.submit(
        [("r", [5, 6, 7], SamplingParams(**greedy, output_kind=DELTA))], sink, tokens=True
    )
    first = sink.get(timeout=WAIT)
    assert first[0] == "token"
    outs = engine.call(lambda llm: llm.pause_generation(mode="wait"), timeout=WAIT)
    assert [o.request_id for o in outs if o.finished] == ["r"]
    evs = [first, *events(sink)]
    assert [e[0] for e in evs] == ["token"] * 8 + ["done"], evs
    assert streamed(evs) == list(alone)
    engine.call(lambda llm: llm.resume_generation(), timeout=WAIT)
    engine.call(check_clean, timeout=WAIT)


def test_a_stop_leaves_the_engine_idle(llm, engine):
    """A stop while requests stream answers each with a 503 and refuses later submits;
    the engine it leaves behind had a step in flight (`has_unfinished_requests`, and
    `sleep` refusing "0 queued or running" requests). It is idle now."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sinks = [queue.SimpleQueue() for _ in range(2)]
    for i, sink in enumerate(sinks):
        engine.submit([(f"r{i}", [5, 6, 7 + i], params)], sink, tokens=True)
    for sink in sinks:
        assert sink.get(timeout=WAIT)[0] == "token"  # running, a step in flight
    engine.stop(timeout=WAIT)
    assert not engine.alive
    for i, sink in enumerate(sinks):
        assert events(sink)[-1][:3] == ("error", f"r{i}", 503)
    with pytest.raises(EngineStopped):
        engine.submit([("late", [5], params)], queue.SimpleQueue(), tokens=True)
    check_clean(llm)
    llm.sleep()
    llm.wake_up()


def test_many_threads_submit_abort_and_pause_at_once(llm, engine):
    """Seeded random requests (greedy and seeded sampling, n of 1 or 2, output kinds
    FINAL_ONLY and DELTA, logprobs) from four threads, some aborted after a random
    number of events, while a fifth pauses the engine ("keep", then "wait") and resumes
    it. Each stream holds its completions' tokens once each, in order, as the request
    run alone has them (all of them unless aborted); an aborted request gets no event
    after its abort; the engine is clean afterwards."""
    rng = np.random.default_rng(0)
    num = 12
    prompts = [rng.integers(3, 256, size=int(rng.integers(3, 20))).tolist() for _ in range(num)]
    params = [
        SamplingParams(
            n=int(rng.integers(1, 3)),
            max_tokens=int(rng.integers(2, 9)),
            temperature=float(rng.choice([0.0, 0.9])),
            seed=int(rng.integers(1000)),
            ignore_eos=True,
            logprobs=1 if rng.random() < 0.3 else None,
            output_kind=DELTA if rng.random() < 0.5 else FINAL,
        )
        for _ in range(num)
    ]
    finals = [dataclasses.replace(sp, output_kind=FINAL) for sp in params]
    alone = engine.call(
        lambda llm: [llm.generate([p], sp)[0] for p, sp in zip(prompts, finals, strict=True)],
        timeout=4 * WAIT,
    )
    abort_after = [int(rng.integers(1, 6)) if rng.random() < 0.3 else None for _ in range(num)]
    got: dict[int, tuple] = {}  # request -> (events read, its sink)
    started, failures = threading.Event(), []

    def client(ids):
        try:
            for i in ids:
                rid, sink, evs = f"r{i}", queue.SimpleQueue(), []
                engine.submit([(rid, prompts[i], params[i])], sink, tokens=True)
                while not evs or evs[-1][0] not in ("done", "error"):
                    if abort_after[i] is not None and len(evs) == abort_after[i]:
                        engine.abort([rid])
                        engine.call(lambda llm: None, timeout=WAIT)  # the abort is handled
                        while not sink.empty():  # (events sent before it)
                            evs.append(sink.get_nowait())
                        break
                    evs.append(sink.get(timeout=WAIT))
                    started.set()
                got[i] = (evs, sink)
        except Exception as e:  # noqa: BLE001  (reported by the main thread)
            failures.append(e)

    def pauser():
        try:
            assert started.wait(WAIT)
            for mode in ("keep", "wait"):
                engine.call(lambda llm, mode=mode: llm.pause_generation(mode=mode), timeout=WAIT)
                engine.call(lambda llm: llm.resume_generation(), timeout=WAIT)
        except Exception as e:  # noqa: BLE001
            failures.append(e)

    threads = [threading.Thread(target=client, args=(range(k, num, 4),)) for k in range(4)]
    threads.append(threading.Thread(target=pauser))
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * WAIT)
    assert not any(t.is_alive() for t in threads) and not failures, failures
    engine.call(check_clean, timeout=WAIT)
    state = engine.call(lambda llm: (engine._sinks, engine._streamed, engine._prompts_due))
    assert state == ({}, {}, set())
    for i in range(num):
        evs, sink = got[i]
        assert sink.empty(), (i, sink.get_nowait())  # nothing after the end or the abort
        assert evs[-1][0] != "error", evs[-1]
        whole = evs[-1][0] == "done"
        assert whole or abort_after[i] is not None
        for c in alone[i].outputs:
            tokens = streamed(evs, c.index)
            assert tokens == list(c.token_ids if whole else c.token_ids[: len(tokens)]), (i, c)
            if params[i].logprobs is not None:
                entries = [list(e[4]) for e in evs if e[0] == "token" and e[2] == c.index]
                assert entries == [list(d) for d in c.logprobs[: len(tokens)]], i
        if whole and params[i].output_kind == FINAL:
            assert [c.token_ids for c in evs[-1][2].outputs] == [
                c.token_ids for c in alone[i].outputs
            ]


def test_a_request_without_params_runs_with_the_engines_defaults(llm, engine):
    """Params None, as `LLM.add_request` takes them: the engine's defaults. (The thread
    read the flags of its events off None: the request was queued, then aborted with a
    500 "'NoneType' object has no attribute 'logprobs'".)"""
    sink = queue.SimpleQueue()
    engine.submit([("defaults", [3, 4, 5, 6], None)], sink, tokens=True)
    evs = events(sink)
    assert evs[-1][0] == "done", evs[-1]
    (completion,) = evs[-1][2].outputs
    assert completion.finish_reason in ("stop", "length") and completion.token_ids
    assert streamed(evs) == completion.token_ids  # token events of 4 elements: no logprobs
    assert all(len(e) == 4 for e in evs if e[0] == "token")
