"""pagedjax.engine's beam search: the hypotheses, their scores, finish and stop reasons
and logprobs equal an exhaustive dense beam search over the whole vocabulary
(tests/beam_oracle.py); beams end at max_model_len, and an aborted search returns its
best beams. In tests/test_engine.py's geometry (tests/engine_helpers.py); beam search
under preemption is tested there.
"""

import numpy as np
import pytest
from engine_helpers import (
    GEOMETRY,
    Dense,
    check_clean,
    dense_beam_search,
    dense_log_softmax,
    random_params,
)

from pagedjax.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def params():
    return random_params()


@pytest.fixture(scope="module")
def dense(params):
    return Dense(params)


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (3, 0.5)])
def test_beam_search_equals_exhaustive_dense_search(params, dense, width, length_penalty):
    rng = np.random.default_rng(width)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (6, 11)]
    # Stop on tokens the model likes, so that hypotheses also end early.
    stops = {t for g in dense.greedy(prompts, 4, stop_ids=()) for t in g[1:3]}
    sp = SamplingParams(
        n=width,
        beam_width=width,
        length_penalty=length_penalty,
        max_tokens=7,
        stop_token_ids=sorted(stops),
        ignore_eos=True,
        logprobs=3,
    )
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    outs = llm.generate(prompts, sp)
    reasons = set()
    for p, o in zip(prompts, outs, strict=True):
        want = dense_beam_search(dense, p, width, 7, stops, length_penalty)
        got = [(c.token_ids, c.finish_reason) for c in o.outputs]
        assert got == [(h[1], h[3]) for h in want]
        np.testing.assert_allclose(
            [c.cumulative_logprob for c in o.outputs], [h[2] for h in want], rtol=1e-4
        )
        reasons |= {c.finish_reason for c in o.outputs}
        for c in o.outputs:  # each hypothesis's own tokens, through its forks
            lsm = dense_log_softmax(dense, [p + c.token_ids[:j] for j in range(len(c.token_ids))])
            assert len(c.logprobs) == len(c.token_ids)
            for tok, entry, w in zip(c.token_ids, c.logprobs, lsm, strict=True):
                top = np.argsort(-w, kind="stable")[:3].tolist()
                assert list(entry) == [tok] + [t for t in top if t != tok]
                np.testing.assert_allclose([entry[t] for t in entry], w[list(entry)], atol=2e-5)
            total = sum(e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True))
            np.testing.assert_allclose(total, c.cumulative_logprob, rtol=1e-5)
    assert reasons == {"stop", "length"}, reasons
    assert llm.block_manager.stats().cow_copies > 0  # beams forked and split pages
    check_clean(llm)


def test_beam_search_reports_the_stop_token_it_ended_on(params):
    """A beam hypothesis ending on a stop token gives it as stop_reason, as sampling does
    (they reported None)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    sp = SamplingParams(
        n=2,
        beam_width=2,
        max_tokens=6,
        ignore_eos=True,
        stop_token_ids=[158, 32],
        length_penalty=-1.0,  # favours short hypotheses: these random weights stop at once
    )
    outs = llm.generate([[5, 6, 7, 8, 9]], sp)[0].outputs
    assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in outs] == [
        ([158], "stop", 158),
        ([32], "stop", 32),
    ]
    greedy = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[158, 32])
    out = llm.generate([[5, 6, 7, 8, 9]], greedy)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([158], "stop", 158)
    check_clean(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pruned_beams_free_their_pages_at_once(params, async_scheduling):
    """After every step the block manager holds exactly the live beams: their sequences,
    and the union of their pages (a beam that lost, or ended on a stop token, frees what
    it alone held in that step's selection, not at the request's end); once the search
    ends, every page is free again (no prefix cache: nothing stays evictable)."""
    llm = LLM(
        params,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        **GEOMETRY,
    )
    bm = llm.block_manager
    free = bm.stats().num_free_pages
    sp = SamplingParams(
        beam_width=4, n=4, max_tokens=14, ignore_eos=True, stop_token_ids=[7, 9, 11, 13]
    )
    rid = llm.add_request(list(range(20, 41)), sp)
    beams = set()
    while llm.has_unfinished_requests():
        llm.step()
        g = llm.scheduler.get(rid)
        live = [] if g is None else g.seqs
        beams |= {s.seq_id for s in live}
        stats = bm.stats()
        assert stats.num_seqs == len(live)
        held = {p for s in live for p in bm.page_table(s.seq_id)}
        assert stats.num_used_pages == len(held)
    assert len(beams) > 4  # beams forked and were dropped
    check_clean(llm)
    assert bm.stats().num_free_pages == free


def test_a_beam_search_ends_at_max_model_len(params):
    """With less room under max_model_len than max_tokens, beams end there ("length"), as
    sampled completions do (add_request's docstring)."""
    llm = LLM(params, max_model_len=12, **GEOMETRY)
    sp = SamplingParams(beam_width=2, n=2, max_tokens=100, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8, 9]], sp)[0]
    assert [(len(c.token_ids), c.finish_reason) for c in out.outputs] == [(7, "length")] * 2
    check_clean(llm)


def test_a_beam_search_aborted_before_any_hypothesis_returns_its_n_best_beams(params):
    """Aborted with no finished hypothesis, the output lists the running beams best first,
    numbered 0..n-1 (they all had index 0, in the group's order)."""
    llm = LLM(params, **GEOMETRY)
    sp = SamplingParams(beam_width=3, n=2, max_tokens=20, ignore_eos=True, temperature=0.0)
    rid = llm.add_request([5, 6, 7], sp)
    for _ in range(5):
        llm.step()
    out = llm.abort(rid)
    assert [c.index for c in out.outputs] == [0, 1]
    sums = [c.cumulative_logprob for c in out.outputs]
    assert sums == sorted(sums, reverse=True) and all(
        c.finish_reason == "abort" for c in out.outputs
    )
    assert all(len(c.token_ids) >= 3 for c in out.outputs)
    while llm.has_unfinished_requests():  # the step in flight
        assert llm.step() == []
    check_clean(llm)
