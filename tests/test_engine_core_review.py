"""pagedjax.engine_core, reviewed: calls made from inside a step, a failure after a
step's dispatch, and a beam search aborted from a callback while its beams are applied.

A step's callbacks (`on_token`, and so an `EngineThread` sink) run while the step is
half done: its plan scheduled, maybe the next one dispatched, its tokens half applied.
Calling back into the engine there with a call that runs or completes steps (`step`,
`generate`, `pause_generation`, `reset_prefix_cache(reset_running_requests=True)`) or
needs an idle engine (`sleep`, `update_params`) is refused with a RuntimeError that
says so, before it changes anything: the callback may catch it, and the step it was
called from goes on whole. (Unguarded, a step inside a step applied the outer one's
plan out of order: the outer step failed with an internal KeyError, or the inner one's
"recovery" aborted every request, the outer step's too.) Requests may still be added
and aborted from a callback. Geometry of tests/test_engine.py (shared compiled programs).
"""

import numpy as np
import pytest
from engine_helpers import GEOMETRY, check_clean, greedy, random_params

from pagedjax.engine import LLM, SamplingParams

_rng = np.random.default_rng(5)
PROMPTS = [_rng.integers(3, 256, size=n).tolist() for n in (5, 11, 20)]

CALLS = {
    "step": lambda llm: llm.step(),
    "generate": lambda llm: llm.generate([PROMPTS[2]], greedy(4)),
    "pause_generation": lambda llm: llm.pause_generation(mode="keep"),
    "reset_prefix_cache": lambda llm: llm.reset_prefix_cache(reset_running_requests=True),
    "sleep": lambda llm: llm.sleep(),
    "update_params": lambda llm: llm.update_params(llm.params),
}


@pytest.fixture(scope="module")
def params():
    return random_params(0)


@pytest.fixture(scope="module")
def want(params):
    llm = LLM(params, **GEOMETRY)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(8))]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_that_steps_from_inside_a_step_is_refused_and_the_step_goes_on(
    params, want, async_scheduling, call
):
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    ids = [llm.add_request(p, greedy(8)) for p in PROMPTS[:2]]
    refused = []

    def on_token(rid, index, token):
        if not refused:
            # A request waiting to be admitted: an inner step would prefill it.
            ids.append(llm.add_request(PROMPTS[2], greedy(8)))
            if call == "sleep":  # (sleep needs no unfinished request: none is left then)
                for i in ids:
                    llm.abort(i)
            with pytest.raises(RuntimeError, match="inside an engine step") as e:
                CALLS[call](llm)
            refused.append(e.value)

    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step(on_token=on_token):
            outs[o.request_id] = o
    assert refused
    assert not llm.is_paused() and not llm.is_sleeping()
    if call == "sleep":
        assert all(o.outputs[0].finish_reason == "abort" for o in outs.values())
    else:
        assert sorted(outs) == sorted(ids)  # the callback's request, none of generate's
        assert [outs[i].outputs[0].token_ids for i in ids] == want
    check_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(8))] == want


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_a_step_failing_after_its_dispatch_is_recovered_from(
    params, want, monkeypatch, async_scheduling, exc
):
    """An exception in the step's bookkeeping once its call is dispatched (here the
    metrics' record; a Ctrl-C may land anywhere) is recovered from as any other: the
    requests are aborted, and the engine goes on. (It escaped unrecovered: the step
    dispatched was never completed, its sequences waited for its tokens for good, and
    every later step raised "scheduler made no progress".)"""
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    ids = [llm.add_request(p, greedy(8)) for p in PROMPTS]
    real, calls = llm.metrics.record, []

    def record(rec, num_compilations=0):
        calls.append(rec)
        if len(calls) == 2:
            raise exc("in the step's bookkeeping")
        real(rec, num_compilations)

    monkeypatch.setattr(llm.metrics, "record", record)
    with pytest.raises(exc, match="bookkeeping") as e:
        while llm.has_unfinished_requests():
            llm.step()
    assert "the engine recovered" in "\n".join(getattr(e.value, "__notes__", []))
    assert all(llm.abort(i) is None for i in ids)  # aborted by the recovery
    check_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(8))] == want
    check_clean(llm)


@pytest.mark.parametrize("max_tokens", [1, 6], ids=["search-ends", "search-goes-on"])
@pytest.mark.parametrize("reuse_id", [False, True], ids=["", "id-reused"])
def test_a_beam_search_aborted_from_on_token_mid_selection_is_gone_whole(
    params, want, max_tokens, reuse_id
):
    """An on_token callback of another request aborts a beam search whose beams' candidates
    the same step applies after it: its abort's output is its last, and it leaves no
    sequence behind; a request the callback then adds under its id runs as any other.
    (The selection still ran on the aborted beams: it forked a beam that nothing freed,
    two pages held for good; where the search ended there, the next step returned a
    second, "finished" output of the aborted request; and where it dropped the last
    beam, it took the new request of that id off the scheduler's books, never run.)"""
    llm = LLM(params, **GEOMETRY)
    beams = SamplingParams(beam_width=2, n=2, max_tokens=max_tokens, temperature=0.0)
    beam_id = llm.add_request(PROMPTS[1], beams)  # (its rows come first in each step)
    other = llm.add_request(PROMPTS[0], greedy(8))
    aborted = []

    def on_token(rid, index, token):
        g = llm.scheduler.get(beam_id)
        if aborted or rid != other or g is None:
            return
        if max_tokens == 1 or g.seqs[0].num_generated:
            aborted.append(llm.abort(beam_id))
            if reuse_id:
                llm.add_request(PROMPTS[2], greedy(8), request_id=beam_id)

    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step(on_token=on_token):
            assert o.request_id not in outs, o
            outs[o.request_id] = o
        if reuse_id and aborted:  # the new request is on the books until it finishes
            assert llm.scheduler.get(beam_id) is not None or beam_id in outs
    (last,) = aborted
    assert last.finished and {c.finish_reason for c in last.outputs} == {"abort"}
    assert sorted(outs) == sorted([other, beam_id] if reuse_id else [other])
    if reuse_id:
        assert outs[beam_id].outputs[0].token_ids == want[2]
    check_clean(llm)
