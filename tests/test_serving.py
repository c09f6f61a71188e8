"""pagedjax.serving: the engine thread's contract with its callers under concurrency.

Most tests drive `EngineThread` with `FakeLLM`, a stand-in with the engine's interface
and its failure rule (anything raised in a step, `on_token` included, aborts every
request and propagates), so they run in milliseconds and each interleaving is forced
with events rather than left to timing. One test runs a real tiny `LLM`.
"""

import contextlib
import queue
import threading
import time
import types

import numpy as np
import pytest

from pagedjax.config import PRESETS
from pagedjax.engine import LLM
from pagedjax.request import SamplingParams
from pagedjax.serving import EngineStopped, EngineThread

WAIT = 10.0  # seconds: a bound on every wait, never reached when the code is right


class FakeLLM:
    """One token per running request per step; a request ends after `max_tokens`."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.running: dict[str, list] = {}  # rid -> [params, tokens]
        self.aborted: list[str] = []
        self.arrivals: dict[str, float | None] = {}  # rid -> its arrival_time

    def add_request(self, ids, params, *, request_id, priority=0, arrival_time=None):
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already queued or running")
        if not ids:
            raise ValueError("empty prompt")
        self.running[str(request_id)] = [params, []]
        self.arrivals[str(request_id)] = arrival_time
        return str(request_id)

    def abort(self, rid):
        if self.running.pop(rid, None) is not None:
            self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self, *, on_token=None):
        finished = []
        try:
            for rid, (params, toks) in list(self.running.items()):
                toks.append(int(self.rng.integers(3, 256)))
                if on_token is not None:
                    on_token(rid, 0, toks[-1])
                if len(toks) >= params.max_tokens:
                    del self.running[rid]
                    finished.append(output(rid, toks, "length"))
        except BaseException:
            self.running.clear()  # LLM.step's recovery: every request is aborted
            raise
        return finished


def output(rid: str, tokens: list[int], reason: str) -> types.SimpleNamespace:
    """A finished `RequestOutput`'s fields that `EngineThread` reads (one completion)."""
    done = types.SimpleNamespace(
        index=0, token_ids=list(tokens), logprobs=None, finish_reason=reason
    )
    return types.SimpleNamespace(
        request_id=rid, tokens=list(tokens), finished=True, outputs=[done], prompt_logprobs=None
    )


def events(sink, stop_kinds=("done", "error")):
    """A request's events up to and including its first done/error event."""
    out = []
    while True:
        out.append(sink.get(timeout=WAIT))
        if out[-1][0] in stop_kinds:
            return out


def blocked(engine):
    """Holds the engine thread inside a `call` until the returned event is set."""
    entered, release = threading.Event(), threading.Event()

    def hold(_):
        entered.set()
        release.wait(WAIT)

    threading.Thread(target=engine.call, args=(hold,), daemon=True).start()
    assert entered.wait(WAIT)
    return release


def test_commands_queued_behind_stop_are_answered():
    """A submit and a call that reach the queue after stop() but before the thread
    reads it are answered (503, EngineStopped), not dropped with their callers waiting
    forever."""
    engine = EngineThread(FakeLLM())
    release = blocked(engine)
    engine.stop(timeout=0)  # queued while the thread is busy
    sink = queue.SimpleQueue()
    engine.submit([("r0", [5, 6], SamplingParams(max_tokens=3))], sink, tokens=True)
    result = queue.SimpleQueue()

    def call():
        try:
            result.put(engine.call(lambda llm: 1, timeout=WAIT))
        except Exception as e:  # noqa: BLE001
            result.put(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    release.set()
    assert sink.get(timeout=WAIT)[:3] == ("error", None, 503)
    assert isinstance(result.get(timeout=2 * WAIT), EngineStopped)
    engine.stop()
    assert not engine.alive


def test_calls_from_the_engine_thread_do_not_deadlock():
    """call() on the engine thread would wait for itself: a RuntimeError; stop() there
    ends the thread after the current command instead of joining itself."""
    engine = EngineThread(FakeLLM())
    with pytest.raises(RuntimeError, match="engine thread itself"):
        engine.call(lambda llm: engine.call(lambda llm: 1), timeout=WAIT)
    assert engine.call(lambda llm: 2, timeout=WAIT) == 2  # still serving
    engine.call(lambda llm: engine.stop(), timeout=WAIT)
    engine._thread.join(WAIT)
    assert not engine.alive
    with pytest.raises(EngineStopped, match="it was stopped"):
        engine.call(lambda llm: 3)


def test_a_call_raising_system_exit_reaches_its_caller_and_the_thread_goes_on():
    engine = EngineThread(FakeLLM())

    def leave(_):
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        engine.call(leave, timeout=WAIT)  # it waited the whole timeout before
    assert engine.call(lambda llm: 4, timeout=WAIT) == 4
    engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_after_the_thread_died_commands_say_why():
    engine = EngineThread(FakeLLM())
    engine.llm.has_unfinished_requests = lambda: 1 / 0  # the loop itself fails
    with contextlib.suppress(EngineStopped):  # wake it, unless it died already
        engine._put(("call", lambda llm: None, queue.SimpleQueue()))
    engine._thread.join(WAIT)
    assert not engine.alive
    with pytest.raises(EngineStopped, match="died: ZeroDivisionError"):
        engine.submit([("r", [1], SamplingParams(max_tokens=2))], queue.SimpleQueue(), tokens=False)


class Broken:
    """A sink whose put raises once it sees a token (a client gone mid-stream)."""

    def __init__(self):
        self.seen = []

    def put(self, event):
        self.seen.append(event)
        if event[0] == "token":
            raise ConnectionResetError("client gone")


def test_a_sink_that_raises_fails_only_its_own_request(capsys):
    """One caller's sink raising mid-stream aborts that request alone: the others
    stream to the end and the thread keeps serving."""
    llm = FakeLLM()
    engine = EngineThread(llm)
    rng = np.random.default_rng(0)
    lens = rng.integers(4, 9, size=3).tolist()
    sinks = [queue.SimpleQueue() for _ in lens]
    release = blocked(engine)  # all submitted before the first step
    for i, n in enumerate(lens):
        engine.submit([(f"ok{i}", [1, 2], SamplingParams(max_tokens=n))], sinks[i], tokens=True)
    bad = Broken()
    engine.submit([("bad", [1, 2], SamplingParams(max_tokens=8))], bad, tokens=True)
    release.set()
    for sink, n in zip(sinks, lens, strict=True):
        evs = events(sink)
        assert [e[0] for e in evs] == ["token"] * n + ["done"], evs[-1]
    assert engine.call(lambda llm: llm.aborted) == ["bad"]
    assert engine.alive
    assert [e[0] for e in bad.seen] == ["token"]  # nothing after the put that raised
    sink = queue.SimpleQueue()
    engine.submit([("after", [1], SamplingParams(max_tokens=2))], sink, tokens=False)
    assert events(sink)[-1][:2] == ("done", "after")
    engine.stop()
    assert "client gone" in capsys.readouterr().err


def test_a_sink_that_raises_on_error_events_does_not_stop_the_thread():
    """A refused request's sink raising on its 400 event leaves the thread running,
    and a raising sink does not keep the others from their 503 at stop."""

    class Raising:
        def put(self, event):
            raise RuntimeError("closed")

    engine = EngineThread(FakeLLM())
    engine.submit([("r", [], SamplingParams(max_tokens=2))], Raising(), tokens=False)  # 400
    assert engine.call(lambda llm: 7) == 7
    release = blocked(engine)
    engine.submit([("a", [1], SamplingParams(max_tokens=99))], Raising(), tokens=False)
    sink = queue.SimpleQueue()
    engine.submit([("b", [1], SamplingParams(max_tokens=99))], sink, tokens=False)
    engine.stop(timeout=0)
    release.set()
    assert sink.get(timeout=WAIT)[:3] == ("error", "b", 503)


@pytest.mark.parametrize("bad", ["r0", b"r0", None, 5, [["r0"]]])
def test_abort_refuses_anything_but_an_iterable_of_str_ids(bad):
    """abort("r0") used to abort requests "r" and "0"; an unhashable id killed the
    engine thread. Both are a TypeError in the caller, and the engine runs on."""
    llm = FakeLLM()
    engine = EngineThread(llm)
    with pytest.raises(TypeError, match="request_ids"):
        engine.abort(bad)
    assert engine.alive and engine.call(lambda llm: 1) == 1
    engine.stop()


def test_submit_refuses_bad_request_ids_and_sinks():
    """A request id that is not a str (the engine keys it by str(id), so its events
    never reached the sink) and a sink without put() are TypeErrors in the caller."""
    engine = EngineThread(FakeLLM())
    params = SamplingParams(max_tokens=2)
    with pytest.raises(TypeError, match="request id"):
        engine.submit([(5, [1, 2], params)], queue.SimpleQueue(), tokens=False)
    with pytest.raises(TypeError, match="sink"):
        engine.submit([("r", [1, 2], params)], None, tokens=False)
    with pytest.raises(TypeError, match="requests"):
        engine.submit([("r", [1, 2])], queue.SimpleQueue(), tokens=False)
    with pytest.raises(TypeError, match="requests"):
        engine.submit("r", queue.SimpleQueue(), tokens=False)
    sink = queue.SimpleQueue()
    engine.submit([("r", [1, 2], params)], sink, tokens=False)
    assert events(sink)[-1][:2] == ("done", "r")
    engine.stop()


def test_a_refused_batch_adds_none_of_its_requests():
    """The engine refusing a request of a batch (a ValueError: a 400) takes back those
    of the batch it had added; anything else it raises is a 500. The thread goes on."""
    llm = FakeLLM()
    engine = EngineThread(llm)
    params, sink = SamplingParams(max_tokens=2), queue.SimpleQueue()
    engine.submit([("a", [1], params), ("b", [], params)], sink, tokens=True)
    assert sink.get(timeout=WAIT) == ("error", None, 400, "empty prompt")
    assert engine.call(lambda llm: (llm.running, llm.aborted)) == ({}, ["a"])

    def add_request(ids, params, *, request_id, priority=0, arrival_time=None):
        raise RuntimeError("device lost")

    engine.call(lambda llm: setattr(llm, "add_request", add_request))
    engine.submit([("c", [1], params)], sink, tokens=True)
    assert sink.get(timeout=WAIT) == ("error", None, 500, "device lost")
    engine.stop()
    assert sink.empty()  # no event of "a", nor a 503 at the stop


def test_without_tokens_a_request_gets_its_done_event_only():
    engine = EngineThread(FakeLLM())
    sink = queue.SimpleQueue()
    engine.submit([("r", [1, 2], SamplingParams(max_tokens=3))], sink, tokens=False)
    kind, rid, out = sink.get(timeout=WAIT)
    assert (kind, rid, len(out.tokens)) == ("done", "r", 3)
    engine.stop()
    assert sink.empty()


def test_abort_counts_the_requests_it_aborts_and_ignores_the_rest():
    """Unknown and finished ids are neither counted in num_aborted nor passed to the
    engine; an aborted request gets no further event (not even the 503 of a stop)."""
    engine = EngineThread(FakeLLM())
    release = blocked(engine)
    sink, done = queue.SimpleQueue(), queue.SimpleQueue()
    engine.submit([("r", [1], SamplingParams(max_tokens=99))], sink, tokens=True)
    engine.submit([("f", [1], SamplingParams(max_tokens=1))], done, tokens=False)
    engine.abort(["r", "unknown"])
    release.set()
    assert done.get(timeout=WAIT)[:2] == ("done", "f")
    engine.abort(["f", "r"])  # finished, aborted already
    assert engine.call(lambda llm: llm.aborted) == ["r"] and engine.num_aborted == 1
    engine.stop()
    assert sink.empty()


class FailingOnce(FakeLLM):
    """Its first step fails (after aborting every request, as `LLM.step` recovers)."""

    failed = False

    def step(self, *, on_token=None):
        if not self.failed:
            self.failed = True
            self.running.clear()
            raise RuntimeError("injected")
        return super().step(on_token=on_token)


def test_a_failed_step_fails_its_requests_once_and_the_thread_goes_on(capsys):
    engine = EngineThread(FailingOnce())
    sink, later = queue.SimpleQueue(), queue.SimpleQueue()
    engine.submit([("r", [1], SamplingParams(max_tokens=4))], sink, tokens=True)
    assert sink.get(timeout=WAIT) == (
        "error",
        "r",
        500,
        "the engine step failed: RuntimeError: injected",
    )
    engine.submit([("s", [1], SamplingParams(max_tokens=2))], later, tokens=False)
    assert later.get(timeout=WAIT)[:2] == ("done", "s")
    assert engine.num_failed_steps == 1
    engine.stop()
    assert sink.empty() and later.empty()  # "r" got its error once (no 503 at the stop)
    assert "RuntimeError: injected" in capsys.readouterr().err


def test_real_engine_one_broken_stream_leaves_the_other_intact():
    """The same isolation with a real tiny LLM: the good request's tokens equal a run
    on its own (greedy)."""
    llm = LLM(PRESETS["tiny"], page_size=8, num_pages=32, backend="xla", max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = np.random.default_rng(1).integers(3, 256, size=5).tolist()
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    engine = EngineThread(llm)
    release = blocked(engine)
    sink, bad = queue.SimpleQueue(), Broken()
    engine.submit([("good", prompt, params)], sink, tokens=True)
    engine.submit([("bad", prompt[::-1], params)], bad, tokens=True)
    release.set()
    evs = events(sink)
    assert evs[-1][0] == "done", evs[-1]
    assert [e[3] for e in evs[:-1]] == list(alone)
    assert list(evs[-1][2].outputs[0].token_ids) == list(alone)
    engine.stop()


def test_a_request_arrives_when_submitted_not_when_the_engine_takes_it():
    """Its arrival time is stamped in `submit` and given to `LLM.add_request`: the engine
    thread took it after the command it was busy with, and the request's timings began
    there."""
    engine = EngineThread(FakeLLM())
    release = blocked(engine)  # busy, as in a step or a compile
    sink = queue.SimpleQueue()
    before = time.time()
    engine.submit([("r", [1], SamplingParams(max_tokens=1))], sink, tokens=False)
    after = time.time()
    time.sleep(0.05)
    release.set()
    assert sink.get(timeout=WAIT)[:2] == ("done", "r")
    arrival = engine.call(lambda llm: llm.arrivals["r"])
    assert arrival is not None and before <= arrival <= after
    engine.stop()


def test_real_engine_times_a_request_from_its_submit_while_a_step_runs():
    """A request submitted while the engine is inside a step (or its compile): its time to
    first token and latency count from the submit. They counted from when the engine
    thread took it, after that step: too low by as long as the step had left (vLLM stamps
    a request's arrival where it reaches its front end)."""
    llm = LLM(PRESETS["tiny"], page_size=8, num_pages=32, backend="xla", max_num_seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    step, inside, release = llm.step, threading.Event(), threading.Event()

    def held_step(**kw):  # the first step of each round waits for `release`
        if not release.is_set():
            inside.set()
            release.wait(WAIT)
        return step(**kw)

    llm.step = held_step
    engine = EngineThread(llm)
    for hold in (0.0, 1.0):  # the first round compiles what the second runs
        inside.clear()
        release.clear()
        first, second = queue.SimpleQueue(), queue.SimpleQueue()
        engine.submit([("a", [5, 6, 7], params)], first, tokens=False)
        assert inside.wait(WAIT)
        t0 = time.perf_counter()
        engine.submit([("b", [8, 9, 10], params)], second, tokens=False)
        time.sleep(hold)
        held = time.perf_counter() - t0
        release.set()
        kind, _, out = second.get(timeout=WAIT)
        assert kind == "done" and first.get(timeout=WAIT)[0] == "done"
    assert out.ttft_s >= held and out.latency_s >= held, (out.ttft_s, out.latency_s, held)
    assert out.ttft_s in engine.call(lambda llm: list(llm.metrics.ttfts))  # (the same)
    engine.stop()


def test_real_engine_sends_the_prompt_logprobs_before_the_first_token():
    """With tokens=True and prompt_logprobs, one "prompt" event comes just before the
    request's first token event (its prefill, over several steps here, is done then),
    equal to its finished output's; none for a request that does not ask for them, nor
    without tokens=True."""
    llm = LLM(
        PRESETS["tiny"],
        page_size=8,
        num_pages=32,
        backend="xla",
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    prompt = np.random.default_rng(2).integers(3, 256, size=40).tolist()  # 3 prefill steps
    params = SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=5, prompt_logprobs=2)
    engine = EngineThread(llm)
    sinks = {rid: queue.SimpleQueue() for rid in ("scored", "plain", "quiet")}
    engine.submit([("scored", prompt, params)], sinks["scored"], tokens=True)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    engine.submit([("plain", prompt[::-1], plain)], sinks["plain"], tokens=True)
    engine.submit([("quiet", prompt[1:], params)], sinks["quiet"], tokens=False)
    evs = {rid: events(sink) for rid, sink in sinks.items()}
    engine.stop()
    kinds = [e[0] for e in evs["scored"]]
    assert kinds == ["prompt", *["token"] * 8, "done"], kinds
    entries, out = evs["scored"][0][2], evs["scored"][-1][2]
    assert len(entries) == len(prompt) and entries[0] is None and None not in entries[1:]
    assert entries == out.prompt_logprobs
    assert [e[0] for e in evs["plain"]] == ["token"] * 4 + ["done"]
    assert [e[0] for e in evs["quiet"]] == ["done"]
