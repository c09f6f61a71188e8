"""pagedjax.serving: the engine thread around a `call` that pauses, aborts or sleeps.

An RL framework pauses the engine through `EngineThread.call` (`pause_generation`,
`update_params`, `resume_generation`) while HTTP handlers' requests run. The thread
must then wait for a command instead of spinning on a paused engine's empty steps,
queue new submits until the resume, and give each submitter what the call's function
did to its request: the tokens it applied, and the output it finished (or a 500 when
the function kept it). `PausingLLM` has the real engine's pause rules; one test runs
a real tiny `LLM`.
"""

import queue
import threading
import time
import types

import pytest
from test_serving import WAIT, FakeLLM, blocked, events, output

from pagedjax.config import PRESETS
from pagedjax.engine import LLM
from pagedjax.request import SamplingParams
from pagedjax.serving import EngineThread


class PausingLLM(FakeLLM):
    """`FakeLLM` with `LLM`'s pause calls: a pause first completes "the step in flight"
    (one step whose tokens no `on_token` sees), and a paused engine's step does nothing
    (counted in `paused_steps`)."""

    def __init__(self):
        super().__init__()
        self.paused = False
        self.paused_steps = 0
        self.scheduler = types.SimpleNamespace(get=self._group)

    def _group(self, rid):
        if rid not in self.running:
            return None
        seq = types.SimpleNamespace(
            index=0, token_ids=list(self.running[rid][1]), num_prompt_tokens=0, logprobs=None
        )
        return types.SimpleNamespace(seqs=[seq])

    def is_paused(self):
        return self.paused

    def step(self, *, on_token=None):
        if self.paused:
            self.paused_steps += 1
            return []
        return super().step(on_token=on_token)

    def abort(self, rid):
        entry = self.running.get(rid)
        super().abort(rid)
        return None if entry is None else output(rid, entry[1], "abort")

    def pause_generation(self, mode="abort"):
        self.paused = False
        outs = super().step()  # the step in flight, applied without on_token
        if mode == "wait":
            while self.running:
                outs += super().step()
        elif mode == "abort":
            outs += [self.abort(rid) for rid in list(self.running)]
        self.paused = True
        return outs

    def resume_generation(self):
        self.paused = False


def paused(engine, rids, mode: str, max_tokens: int = 99):
    """Submits one token-streamed request per id and pauses the engine by `mode` in a
    `call` queued behind them, so that the thread takes them all before any step and
    the pause's first step is theirs (none has a token event yet). Returns their sinks
    and what the call returned."""
    release = blocked(engine)
    sinks = {rid: queue.SimpleQueue() for rid in rids}
    for rid, sink in sinks.items():
        engine.submit([(rid, [1, 2], SamplingParams(max_tokens=max_tokens))], sink, tokens=True)
    queued, result = engine._commands.qsize(), queue.SimpleQueue()

    def pause():
        result.put(engine.call(lambda llm: llm.pause_generation(mode=mode), timeout=WAIT))

    threading.Thread(target=pause, daemon=True).start()
    deadline = time.monotonic() + WAIT
    while engine._commands.qsize() == queued and time.monotonic() < deadline:
        time.sleep(0.001)  # (until the call is queued; the thread is held meanwhile)
    release.set()
    return sinks, result.get(timeout=WAIT)


def streamed(sink):
    """A token-streamed request's token ids and its last event."""
    evs = events(sink)
    assert all(e[0] == "token" for e in evs[:-1]), evs
    return [e[3] for e in evs[:-1]], evs[-1]


def test_a_paused_engine_thread_waits_instead_of_stepping():
    """After a pause with requests kept, the thread stepped the paused engine in a busy
    loop (each step returns at once). It waits for a command now; a submit is queued
    and runs, with the kept request, after the resume, whose stream lacks no token
    (its first was applied by the pause, without `on_token`)."""
    engine = EngineThread(PausingLLM())
    sinks, outs = paused(engine, ["kept"], "keep", max_tokens=8)
    assert outs == []
    later = queue.SimpleQueue()
    engine.submit([("later", [3], SamplingParams(max_tokens=2))], later, tokens=False)
    state = engine.call(lambda llm: (llm.paused_steps, sorted(llm.running)))
    assert state == (0, ["kept", "later"]) and later.empty()
    engine.call(lambda llm: llm.resume_generation())
    assert later.get(timeout=WAIT)[:2] == ("done", "later")
    tokens, last = streamed(sinks["kept"])
    assert last[:2] == ("done", "kept") and tokens == last[2].tokens and len(tokens) == 8
    assert engine.call(lambda llm: llm.paused_steps) == 0
    engine.stop()


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_a_pause_in_a_call_answers_the_requests_it_ends(mode):
    """The outputs a pause returns went to the caller of `call` alone: their submitters
    waited forever. Each gets its "done" event now (finish reason "abort" with "abort"),
    after the tokens the pause applied, and the caller gets them too."""
    engine = EngineThread(PausingLLM())
    sinks, outs = paused(engine, ["a", "b"], mode)
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    reason = "abort" if mode == "abort" else "length"
    for rid, sink in sinks.items():
        tokens, last = streamed(sink)
        assert last[:2] == ("done", rid) and last[2].outputs[0].finish_reason == reason
        assert tokens == last[2].tokens and len(tokens) == (1 if mode == "abort" else 99)
    assert engine.call(lambda llm: llm.paused_steps) == 0
    engine.stop()
    assert all(sink.empty() for sink in sinks.values())  # (no 503 at the stop)


def test_a_call_that_aborts_a_request_answers_its_submitter():
    """A request aborted inside a call gets its output when the call returns it, and a
    500 when the function keeps it (rather than no event ever)."""
    engine = EngineThread(PausingLLM())
    sinks, _ = paused(engine, ["returned", "kept"], "keep")
    out = engine.call(lambda llm: llm.abort("returned"))
    assert out.outputs[0].finish_reason == "abort"
    assert streamed(sinks["returned"]) == ([out.tokens[0]], ("done", "returned", out))
    assert engine.call(lambda llm: llm.abort("kept") and None) is None
    assert streamed(sinks["kept"])[1][:3] == ("error", "kept", 500)
    engine.stop()


def test_real_engine_pause_keep_resume_streams_every_token():
    """With a real tiny LLM and asynchronous scheduling: a pause completes the step in
    flight without `on_token`; its tokens still reach the stream, which equals the
    finished output's tokens after the resume; "abort" ends the other request."""
    llm = LLM(PRESETS["tiny"], page_size=8, num_pages=32, backend="xla", max_num_seqs=4)
    # Long enough that the request cannot finish between its first token and the pause
    # (with 4 it sometimes did, and the pause returned its output: a race, not a defect).
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = EngineThread(llm)
    sink = queue.SimpleQueue()
    engine.submit([("r", [5, 6, 7], params)], sink, tokens=True)
    first = sink.get(timeout=WAIT)
    assert engine.call(lambda llm: llm.pause_generation(mode="keep")) == []
    engine.call(lambda llm: llm.resume_generation())
    evs = [first, *events(sink)]
    assert [e[0] for e in evs] == ["token"] * 24 + ["done"], evs
    assert [e[3] for e in evs[:-1]] == list(evs[-1][2].outputs[0].token_ids)
    other = queue.SimpleQueue()
    engine.submit([("s", [8, 9], params)], other, tokens=True)
    first = other.get(timeout=WAIT)
    engine.call(lambda llm: llm.pause_generation(mode="abort"))
    evs = [first, *events(other)]
    out = evs[-1][2]
    assert evs[-1][0] == "done" and out.outputs[0].finish_reason == "abort"
    assert [e[3] for e in evs[:-1]] == list(out.outputs[0].token_ids)
    engine.stop()
