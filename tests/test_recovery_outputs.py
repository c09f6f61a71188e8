"""pagedjax.engine_core / pagedjax.outputs: failures while outputs are built.

Recovery builds the aborted requests' outputs only once the KV cache and the prefix
cache are consistent, so that a decode error or an `on_finish` that raises there
cannot leave pages with no K/V in the prefix cache, or a deleted cache in use. And a
step whose applying raises anywhere after the tokens are set (a beam selection, a
finished output's decode, a partial output) still returns, from the next step, the outputs
of the requests that finished in it. Failures are injected as
tests/test_engine_recovery.py does, in its geometry (shared compiled programs).
"""

import params_helpers
import pytest
from test_engine_recovery import (
    GEOMETRY,
    PROMPTS,
    SPS,
    TINY,
    WARM,
    Injected,
    check_recovered,
    check_reusable,
    fail_on_call,
    tokens,
)

from pagedjax.engine import LLM, SamplingParams
from pagedjax.request import RequestOutputKind


class OutputError(RuntimeError):
    """Raised by an injected decode or `on_finish` (not the step's `Injected`)."""


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


@pytest.fixture(scope="module")
def want(params):
    """A fresh engine's outputs for PROMPTS / SPS and for WARM."""
    llm = LLM(params, **GEOMETRY)
    outs = llm.generate(PROMPTS, SPS)
    (warm,) = llm.generate([WARM], SPS[0])
    return tokens(outs), tokens([warm])


@pytest.mark.parametrize(
    "what,n,mode", [("decode", 1, "before"), ("on_finish", 2, "deleted")], ids=["decode", "hook"]
)
def test_a_failure_building_aborted_outputs_still_recovers_the_caches(
    params, want, monkeypatch, what, n, mode
):
    """The failed step was not dispatched ("before": the pages it registered hold no
    K/V and must leave the prefix cache) or took the cache with it ("deleted": a new one
    is made); every aborted output's decode, or `on_finish`, raises. The step's own
    exception propagates, every aborted request still reaches `on_finish`, and the
    engine then gives a fresh engine's tokens (same seeds)."""
    llm = LLM(params, **GEOMETRY)
    llm.generate([WARM], SPS[0])  # PREFIX's pages cached
    fail_on_call(monkeypatch, "prefill_step", n, mode)
    told = []
    if what == "decode":

        def detokenize(ids, prompt_ids, skip_special_tokens):
            raise OutputError("decode")

        monkeypatch.setattr(llm.outputs, "detokenize", detokenize)
    else:

        def on_finish(out):
            told.append(out.request_id)
            raise OutputError("on_finish")

        monkeypatch.setattr(llm.core, "_on_finish", on_finish)
    with pytest.raises(Injected) as info:
        llm.generate(PROMPTS, SPS)
    notes = "\n".join(info.value.__notes__)
    assert "the engine recovered: aborted 4 request(s)" in notes, notes
    assert ("have no text" if what == "decode" else "were not delivered") in notes, notes
    assert "OutputError" in notes and "not usable" not in notes
    if what == "on_finish":
        assert len(told) == 4  # (one raising does not skip the others)
    monkeypatch.undo()
    check_recovered(llm)
    check_reusable(llm, want, cache_kept=mode == "before")


A_SP = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
B_SP = SamplingParams(beam_width=2, max_tokens=4)
C_SP = SamplingParams(
    temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)
A_PROMPT, B_PROMPT, C_PROMPT = PROMPTS[2], PROMPTS[3][:6], PROMPTS[3]


@pytest.mark.parametrize("where", ["beam", "finish", "partial"])
def test_requests_finished_in_a_step_whose_apply_raises_are_returned(params, monkeypatch, where):
    """Request A finishes in a step that then raises while applying its tokens: in beam
    B's selection, in A's own output's decode (every time: A's output comes without
    text), or in building DELTA request C's partial output. `LLM.step` raises; its next
    call returns A's output, with a fresh engine's tokens; B and C are aborted (named in
    the note); nothing is left running and no page leaks."""
    (fresh,) = LLM(params, **GEOMETRY).generate([A_PROMPT], A_SP)
    llm = LLM(params, **GEOMETRY)
    a = llm.add_request(A_PROMPT, A_SP)
    b = llm.add_request(B_PROMPT, B_SP)
    c = llm.add_request(C_PROMPT, C_SP)
    reported = {}
    raised = []

    def gone(rid):
        return llm.scheduler.get(rid) is None

    if where == "beam":
        real = llm.outputs._beam_step

        def beam_step(req, results):
            if gone(a):
                raised.append(a in reported)
                raise Injected("in the beam selection")
            return real(req, results)

        monkeypatch.setattr(llm.outputs, "_beam_step", beam_step)
    elif where == "finish":
        real = llm.outputs.detokenize

        def detokenize(ids, prompt_ids, skip_special_tokens):
            if list(prompt_ids) == A_PROMPT:
                raised.append(a in reported)
                raise Injected("in a decode")
            return real(ids, prompt_ids, skip_special_tokens)

        monkeypatch.setattr(llm.outputs, "detokenize", detokenize)
    else:
        real = llm.outputs.output

        def output(req, **kwargs):
            if kwargs.get("running") and gone(a):  # (C's partial output reads its detok)
                raised.append(a in reported)
                raise Injected("in a partial output")
            return real(req, **kwargs)

        monkeypatch.setattr(llm.outputs, "output", output)

    def run():
        while llm.has_unfinished_requests():
            for o in llm.step():
                if o.finished:
                    assert o.request_id not in reported
                    reported[o.request_id] = o

    with pytest.raises(Injected) as info:
        run()
    assert raised and not raised[0]  # it raised in the step A finished in
    notes = "\n".join(info.value.__notes__)
    assert f"aborted 2 request(s) [{b!r}, {c!r}]" in notes, notes
    assert ("have no text" in notes) == (where == "finish"), notes
    monkeypatch.undo()
    run()
    assert sorted(reported) == [a]
    assert tokens([reported[a]]) == tokens([fresh])
    assert reported[a].outputs[0].finish_reason == "length"
    assert all(gone(i) for i in (a, b, c))
    check_recovered(llm)
