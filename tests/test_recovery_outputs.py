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
    # A finished and is counted so, with or without its text (the fallback skipped it).
    assert llm.metrics.request_success["length"] == 1 and len(llm.metrics.latencies) == 1
    assert all(gone(i) for i in (a, b, c))
    check_recovered(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("detok", ["stop-strings", "streamed"])
def test_ctrl_c_while_a_kept_requests_last_token_is_detokenized(params, async_scheduling, detok):
    """A Ctrl-C inside `generate` lands while the detokenizer of a request queued with
    `add_request` takes its last token (a real Ctrl-C's likeliest place in applying a
    token: the tokenizer's decode), before the stop checks decide. The request is kept
    (recomputed): it takes the token again, ends "length" there, and gives a clean run's
    tokens and logprobs. (The token stayed appended, unchecked: the requeued request ran
    one token past max_tokens, its logprobs one entry more.)"""
    kind = (
        dict(stop=["\n@@\n"])
        if detok == "stop-strings"
        else dict(output_kind=RequestOutputKind.DELTA)
    )
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1, **kind)
    (fresh,) = LLM(params, **GEOMETRY).generate([C_PROMPT], sp)
    assert fresh.outputs[0].finish_reason == "length"
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    kept = llm.add_request(C_PROMPT, sp)
    seq = llm.scheduler.get(kept).seqs[0]
    real, interrupted = seq.detok.add, []

    def add(tok):
        if seq.num_generated == sp.max_tokens and not interrupted:
            interrupted.append(tok)
            raise KeyboardInterrupt
        return real(tok)

    seq.detok.add = add
    with pytest.raises(KeyboardInterrupt):
        llm.generate([A_PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert interrupted
    assert [g.request_id for g in llm.scheduler.waiting] == [kept]
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    got = [o for o in outs if o.finished]
    assert [o.request_id for o in got] == [kept]
    if detok == "streamed":  # (DELTA: the pieces add up)
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        lps = [e for o in outs for e in o.outputs[0].logprobs]
    else:
        ids, lps = got[0].outputs[0].token_ids, got[0].outputs[0].logprobs
    assert ids == fresh.outputs[0].token_ids
    assert [sorted(e) for e in lps] == [sorted(e) for e in fresh.outputs[0].logprobs]
    assert got[0].outputs[0].finish_reason == "length"
    check_recovered(llm)


ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def carry_output_of(llm, rid: str) -> None:
    """Request `rid` (A_PROMPT) finishes in a step whose `on_token` raises on its token:
    the step raises, and its output is carried to the next step's return value."""
    llm.add_request(A_PROMPT, ONE, request_id=rid)

    def on_token(request_id, index, token):
        if request_id == rid:
            raise Injected("on_token")

    with pytest.raises(Injected):
        while llm.has_unfinished_requests():
            llm.step(on_token=on_token)
    assert llm.has_unfinished_requests() and llm.scheduler.get(rid) is None


def test_generate_draws_no_id_whose_output_a_failed_step_carried(params):
    """A `generate` call right after draws its request ids past the carried output's
    (here "0", its counter's first): it drew that one, and its first step dropped the
    carried output as one of its own (which it is not): no step() ever returned it."""
    llm = LLM(params, **GEOMETRY)
    carry_output_of(llm, "0")
    (mine,) = llm.generate([C_PROMPT], A_SP)
    assert mine.request_id != "0" and mine.prompt_token_ids == C_PROMPT
    (old,) = llm.step()
    assert old.request_id == "0" and old.prompt_token_ids == A_PROMPT and old.finished
    check_recovered(llm)


def test_an_id_with_partial_outputs_a_generate_call_held_is_in_use(params):
    """A DELTA request of `add_request` runs and finishes inside a `generate` call: its
    partial outputs wait for the next step(). Until then `add_request` refuses its id
    (ValueError naming it): it took it, and aborting the new request then took the old
    one's partial outputs for its own (KeyError: the new one had sent none), the abort
    half done. (A held finished output alone does not hold its id:
    tests/test_prompts_review.py.)"""
    llm = LLM(params, **GEOMETRY)
    llm.add_request(C_PROMPT, C_SP, request_id="d")
    llm.generate([A_PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert llm.scheduler.get("d") is None
    with pytest.raises(ValueError, match="request id 'd' is in use"):
        llm.add_request(A_PROMPT, C_SP, request_id="d")
    held = llm.step()
    assert {o.request_id for o in held} == {"d"} and held[-1].finished
    llm.add_request(A_PROMPT, C_SP, request_id="d")
    last = llm.abort("d")
    assert last.finished and last.outputs[0].finish_reason == "abort"
    check_recovered(llm)
