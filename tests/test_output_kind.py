"""`SamplingParams.output_kind` (vLLM's `RequestOutputKind`) through `LLM.step`.

The tiny preset with random weights and the byte tokenizer, in tests/test_engine.py's
geometry. A request's partial outputs are checked against its final output and against
the same request run whole by `generate` (equal seeds: equal tokens): CUMULATIVE
outputs grow by prefixes, DELTA pieces add up to the whole, FINAL_ONLY (the default)
gives the final output only.
"""

import dataclasses
import queue

import pytest
from engine_helpers import GEOMETRY, check_clean, random_params

from pagedjax.engine import LLM, RequestOutputKind, SamplingParams
from pagedjax.serving import EngineThread

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)
PROMPTS = ["def f(x):", "import os\n", "class A:"]


@pytest.fixture(scope="module")
def llm():
    return LLM(random_params(), max_num_batched_tokens=16, **GEOMETRY)


def params(kind, **kw) -> SamplingParams:
    kw = dict(temperature=1.0, seed=5, n=2, max_tokens=12, logprobs=1) | kw
    return SamplingParams(output_kind=kind, **kw)


def run(llm, kinds, **kw) -> dict[str, list]:
    """Every output `step()` returns, per request id, for PROMPTS[i] under kinds[i]."""
    for i, kind in enumerate(kinds):
        llm.add_request(PROMPTS[i], params(kind, **kw), request_id=str(i))
    outs = {str(i): [] for i in range(len(kinds))}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id].append(o)
    check_clean(llm)
    return outs


def summary(c) -> tuple:
    """A completion's tokens, text, end and logprobs (rounded: the same tokens in other
    batches differ in the last bits)."""
    lps = [{t: round(float(x), 4) for t, x in e.items()} for e in c.logprobs]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason, lps


def stops(llm) -> list[str]:
    """Stop strings one completion meets: two characters from the middle of its text
    without them, and a longer one that never comes (more text held back)."""
    text = whole(llm)[0].outputs[0].text
    i = next(i for i in range(4, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    return [text[i : i + 2], "\x00never\x00"]


def whole(llm, **kw):
    """PROMPTS run by `generate` (which returns whole outputs whatever the kind)."""
    return llm.generate(PROMPTS, params(DELTA, **kw))


@pytest.mark.parametrize("with_stop", [False, True], ids=["plain", "stop_strings"])
def test_cumulative_outputs_grow_by_prefixes_to_the_final_one(llm, with_stop):
    stop = stops(llm) if with_stop else ()
    want = whole(llm, stop=stop)
    outs = run(llm, [CUMULATIVE, FINAL_ONLY, CUMULATIVE], stop=stop)
    assert [o.finished for o in outs["1"]] == [True]  # FINAL_ONLY: the final output only
    for rid in ("0", "2"):
        *partial, final = outs[rid]
        assert len(partial) >= 3 and not any(o.finished for o in partial) and final.finished
        assert list(map(summary, final.outputs)) == list(map(summary, want[int(rid)].outputs))
        for a, b in zip(partial, partial[1:] + [final], strict=True):  # a prefix of the next
            for ca, cb in zip(a.outputs, b.outputs, strict=True):
                assert cb.token_ids[: len(ca.token_ids)] == ca.token_ids
                assert cb.text.startswith(ca.text), (ca.text, cb.text)
                assert cb.logprobs[: len(ca.logprobs)] == ca.logprobs
        for o in partial:
            assert all(c.finish_reason in (None, "stop", "length") for c in o.outputs)
            assert any(c.finish_reason is None for c in o.outputs)
    if stop:  # the held-back text: never a piece of a stop string the final text cuts
        assert any(c.stop_reason == stop[0] for o in want for c in o.outputs)


@pytest.mark.parametrize("with_stop", [False, True], ids=["plain", "stop_strings"])
def test_delta_pieces_add_up_to_the_whole_output(llm, with_stop):
    stop = stops(llm) if with_stop else ()
    want = whole(llm, stop=stop)
    outs = run(llm, [DELTA, DELTA, FINAL_ONLY], stop=stop)
    for rid in ("0", "1"):
        got = {}
        for o in outs[rid]:
            for c in o.outputs:
                ids, text, lps = got.get(c.index, ([], "", []))
                got[c.index] = (ids + c.token_ids, text + c.text, lps + c.logprobs)
        final = outs[rid][-1]
        assert final.finished and not any(o.finished for o in outs[rid][:-1])
        for c in want[int(rid)].outputs:
            ids, text, lps = got[c.index]
            assert summary(
                dataclasses.replace(c, token_ids=ids, text=text, logprobs=lps)
            ) == summary(c)
        reasons = {c.index: c.finish_reason for c in final.outputs}
        assert reasons == {c.index: c.finish_reason for c in want[int(rid)].outputs}


def test_no_partial_output_follows_an_abort_from_on_token(llm):
    """A callback that aborts a request while its step's tokens are applied: the abort
    returns its last output, and the step none after it (a partial output of a sample
    applied before the abort came after the request's end)."""
    llm.add_request(PROMPTS[0], params(DELTA, max_tokens=30, n=2), request_id="x")
    events, calls = [], []

    def on_token(rid, index, tok):
        calls.append(index)
        if len(calls) >= 4 and index == 1 and not events:
            # (sample 0's token of this step was applied before)
            events.append(("abort", llm.abort(rid)))

    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step(on_token=on_token)
        if events:
            events += [("step", o) for o in outs]
        outs = []
    kinds = [k for k, _ in events]
    assert "abort" in kinds and kinds[kinds.index("abort") + 1 :] == []
    assert events[kinds.index("abort")][1].finished
    check_clean(llm)


def test_partial_texts_come_from_an_incremental_detokenizer(llm, monkeypatch):
    """A running completion's partial text is its tokens' decode after the prompt, less
    an incomplete last character, read from its incremental detokenizer: the whole text
    is decoded only for the final output, not at every step (which grew with the text)."""
    tok = llm.tokenizer
    real = tok.decode
    calls = []

    def decode(ids, **kw):
        calls.append(1)
        return real(ids, **kw)

    monkeypatch.setattr(tok, "decode", decode)
    outs = run(llm, [CUMULATIVE, CUMULATIVE], max_tokens=24, logprobs=None)
    monkeypatch.undo()
    checked = 0
    for *partial, _ in outs.values():
        for o in partial:
            for c in o.outputs:
                if c.finish_reason is None:
                    want = real(c.token_ids, context=o.prompt_token_ids).rstrip("\ufffd")
                    assert c.text == want
                    checked += 1
    assert checked >= 40
    assert len(calls) <= 2 * 2  # the final outputs' completions, once each


def test_an_aborted_delta_request_returns_the_rest(llm):
    llm.add_request(PROMPTS[0], params(DELTA, max_tokens=30, n=1), request_id="d")
    pieces = []
    while sum(len(o.outputs[0].token_ids) for o in pieces) < 4:
        pieces += llm.step()
    rest = llm.abort("d")
    while llm.has_unfinished_requests():
        assert not llm.step()
    (c,) = rest.outputs
    assert rest.finished and c.finish_reason == "abort"
    ids = [t for o in pieces for t in o.outputs[0].token_ids] + c.token_ids
    (want,) = llm.generate([PROMPTS[0]], params(FINAL_ONLY, max_tokens=30, n=1))
    assert ids == want.outputs[0].token_ids[: len(ids)] and len(ids) >= 4


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_an_abort_after_a_generate_call_is_the_last_output(llm, kind):
    """A generate call keeps other requests' outputs for the next step(), partial ones
    too: an abort after it returned, finished, and then the next step() gave the held
    partial outputs, unfinished (and DELTA's abort left out their tokens)."""
    llm.add_request(PROMPTS[0], params(kind, max_tokens=30, n=1), request_id="g")
    pieces = []
    while not pieces:
        pieces += llm.step()
    llm.generate([PROMPTS[1]], params(FINAL_ONLY, max_tokens=3, n=1))
    pieces.append(llm.abort("g"))
    while llm.has_unfinished_requests():
        pieces += llm.step()
    assert [o.finished for o in pieces] == [False] * (len(pieces) - 1) + [True]
    if kind == DELTA:
        ids = [t for o in pieces for t in o.outputs[0].token_ids]
    else:
        ids = pieces[-1].outputs[0].token_ids
    (want,) = llm.generate([PROMPTS[0]], params(FINAL_ONLY, max_tokens=30, n=1))
    assert ids == want.outputs[0].token_ids[: len(ids)] and len(ids) >= 4
    check_clean(llm)


def test_output_kind_values():
    assert params(1).output_kind is DELTA and params(FINAL_ONLY).output_kind is FINAL_ONLY
    assert SamplingParams().output_kind is FINAL_ONLY
    for bad in (3, -1, "DELTA", 1.0):
        with pytest.raises(ValueError, match="output_kind"):
            SamplingParams(output_kind=bad)
    with pytest.raises(ValueError, match="beam search returns final outputs only"):
        SamplingParams(beam_width=2, temperature=0.0, output_kind=CUMULATIVE)


def test_the_engine_thread_sends_only_the_final_output(llm):
    """`EngineThread` streams "token" events; a CUMULATIVE request's partial outputs
    are not "done" events (the first one would have ended its stream)."""
    engine = EngineThread(llm)
    try:
        sink = queue.SimpleQueue()
        ids = engine.call(lambda e: e.tokenizer.encode(PROMPTS[0]))
        sp = params(CUMULATIVE, n=1, max_tokens=6, ignore_eos=True)
        engine.submit([("t", ids, sp)], sink, tokens=True)
        events = [sink.get(timeout=60)]
        while events[-1][0] == "token":
            events.append(sink.get(timeout=60))
    finally:
        engine.stop()
    assert [e[0] for e in events] == ["token"] * 6 + ["done"]
    out = events[-1][2]
    assert out.finished and out.outputs[0].token_ids == [e[3] for e in events[:-1]]
