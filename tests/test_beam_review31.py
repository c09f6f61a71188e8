"""Review 31 of beam search (pagedjax.beam, pagedjax.beam_search and the engine's beam
paths): what an aborted search returns once some hypotheses finished. In
tests/test_engine.py's geometry (tests/engine_helpers.py)."""

import pytest
from engine_helpers import GEOMETRY, check_clean, random_params
from test_beam_search_api import generate_calls

from pagedjax.beam_search import BeamSearchParams
from pagedjax.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def params():
    return random_params()


def test_a_beam_search_aborted_with_fewer_hypotheses_than_n_fills_up_with_its_beams(params):
    """Aborted once one hypothesis finished, with its beams still running: the output is
    that hypothesis and then the best running beams ("abort"), n completions numbered
    0..n-1, as before any hypothesis finished (`LLM.abort`: running completions end
    "abort" with what they have). The running beams were dropped: one completion."""
    llm = LLM(params, **GEOMETRY)
    # 218: a token these weights like after the prompt's first few, so that one
    # hypothesis ends on it a few steps in while three beams go on.
    sp = SamplingParams(n=3, beam_width=3, max_tokens=12, ignore_eos=True, stop_token_ids=[218])
    rid = llm.add_request([20, 30, 40], sp)
    while not (g := llm.scheduler.get(rid)).request.beam.hyps:
        llm.step()
    (hyp,) = g.request.beam.hyps
    live = sorted(g.seqs, key=lambda s: -s.cumulative_logprob)
    assert len(live) == 3
    want = [(hyp.token_ids, hyp.finish_reason, hyp.cumulative_logprob)] + [
        (s.token_ids[3:], "abort", s.cumulative_logprob) for s in live[:2]
    ]
    out = llm.abort(rid)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in out.outputs] == want
    assert want[0][1] == "stop" and want[0][0][-1] == 218
    while llm.has_unfinished_requests():  # the step in flight
        assert llm.step() == []
    check_clean(llm)


@pytest.fixture(scope="module")
def short_llm(params):
    """Room for 12 tokens a sequence: a prompt of 12 leaves none to generate."""
    return LLM(params, max_model_len=12, **GEOMETRY)


def test_beam_search_in_chunks_refuses_a_bad_prompt_before_running_any(short_llm, monkeypatch):
    """With concurrency_limit, a prompt `generate` would refuse is named by its index in
    the call, before any chunk runs: the earlier chunks ran to completion first (their
    outputs then thrown away), and the error named the prompt's index in its chunk
    ("prompt 0" for prompt 2)."""
    calls = generate_calls(monkeypatch)
    prompts = [[5, 6, 7], [8, 9, 10], list(range(3, 15))]
    with pytest.raises(ValueError, match=r"^prompt 2: prompt has 12 tokens; max_model_len=12"):
        short_llm.beam_search(prompts, BeamSearchParams(2, 3), concurrency_limit=1)
    assert calls == []
    check_clean(short_llm)


def test_beam_search_in_chunks_names_a_prompt_refused_in_its_chunk_by_its_index(short_llm):
    """A refusal only queueing finds (here the length penalty, out of range for the 11
    tokens the one-token prompt 1 may generate, not for prompt 0's 9) names the prompt
    by its index in the call, not in its chunk."""
    params = BeamSearchParams(2, 20, length_penalty=300.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^prompt 1: length_penalty=300.0 is out of range"):
        short_llm.beam_search([[5, 6, 7], [8]], params, concurrency_limit=1)
    with pytest.raises(ValueError, match=r"^prompt 1: length_penalty=300.0 is out of range"):
        short_llm.beam_search([[5, 6, 7], [8]], params)  # (one chunk: as generate names it)
    check_clean(short_llm)
