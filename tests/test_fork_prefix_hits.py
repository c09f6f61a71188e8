"""Engine: sequences admitted without their last token, which a decode row feeds (an
n-sample request's parent, readmitted beams), take every whole page of what they admit
from the prefix cache (none recomputed) and give exactly the outputs they give without
the hit; a sliding-window model takes those in its window.

The scheduler's side (no prefill row, forks and decode rows at admission) is in
tests/test_scheduler.py; the block manager's (`admit(compute_last=False)`) in
tests/test_blocks.py. Full attention uses tests/test_engine.py's geometry (tiny model, f32,
XLA, page size 8), the window model tests/test_window_pages.py's, so the programs are the
ones those tests compile.
"""

import numpy as np
import params_helpers
import pytest
import test_window_pages as wp

from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams

PS = 8
GEOMETRY = dict(page_size=PS, num_pages=64, backend="xla", max_num_seqs=8)


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(PRESETS["tiny"], 0)


@pytest.fixture(scope="module")
def window_params():
    return params_helpers.random_params(wp.CFG, seed=21)


def completions(out):
    return [(c.index, c.token_ids, c.finish_reason) for c in out.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_n_samples_read_every_cached_page_and_sample_the_same(params, async_scheduling):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, size=p).tolist() for p in (2 * PS + 1, PS + 1)]
    sps = [
        SamplingParams(n=3, temperature=0.9, top_k=40, seed=1234, max_tokens=6),
        SamplingParams(n=2, temperature=0.0, max_tokens=5),
    ]
    llm = LLM(params, max_num_batched_tokens=16, async_scheduling=async_scheduling, **GEOMETRY)
    cold = llm.generate(prompts, sps)
    assert [o.num_cached_tokens for o in cold] == [0, 0]
    warm = llm.generate(prompts, sps)  # prompt[:-1] of each is in the cache, whole pages
    assert [o.num_cached_tokens for o in warm] == [2 * PS, PS]
    for c, w in zip(cold, warm, strict=True):
        assert completions(w) == completions(c)
        np.testing.assert_allclose(
            [x.cumulative_logprob for x in w.outputs],
            [x.cumulative_logprob for x in c.outputs],
            rtol=1e-5,
        )
    assert len({tuple(x.token_ids) for x in warm[0].outputs}) > 1  # the samples differ
    stats = llm.block_manager.stats()
    assert stats.prefix_hits == 3 * PS and stats.num_used_pages == 0
    llm.block_manager.check_invariants()


def test_a_fully_cached_n_sample_request_after_idle_steps(params):
    """Such a request's admission step had no row (its samples forked at once and
    decoded from the next step; now they decode in it when their pages fit, as readmitted
    beams cached whole do); after steps with nothing to do it read as the third step in a
    row without progress, and `step()` raised "scheduler made no progress with requests
    queued (a bug)" (the engine fuzz's find)."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 256, size=2 * PS + 1).tolist()
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=4)
    llm = LLM(params, max_num_batched_tokens=16, async_scheduling=False, **GEOMETRY)
    (cold,) = llm.generate([prompt], sp)
    for _ in range(4):
        assert llm.step() == []  # (nothing to do)
    rid = llm.add_request(prompt, sp)
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    (warm,) = outs
    assert warm.request_id == rid and warm.num_cached_tokens == 2 * PS
    assert completions(warm) == completions(cold)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_readmitted_beams_read_every_cached_page_and_search_the_same(params, async_scheduling):
    """Beams preempted when all but their last token fill whole pages: on readmission
    they read those pages back from the cache (none recomputed) and feed their last
    tokens together, in their admission step; the search ends as it does without the
    preemption."""
    prompt = np.random.default_rng(12).integers(3, 256, size=PS + 5).tolist()
    sp = SamplingParams(n=2, beam_width=2, max_tokens=8, ignore_eos=True)
    want = LLM(params, max_num_batched_tokens=16, **GEOMETRY).generate([prompt], sp)[0]
    seen = []

    def on_step(engine):
        for g in engine.scheduler.running:
            lens = {len(s.token_ids) for s in g.seqs}
            if not g.num_preemptions and lens == {2 * PS + 1}:
                engine.scheduler._preempt(g)  # as a step's schedule() would, under pressure
            elif g.num_preemptions and not seen:
                # (after the readmission step: its decode rows appended the fed tokens)
                seen.append(
                    [(s.num_cached_tokens, s.num_admitted - len(s.token_ids)) for s in g.seqs]
                )

    llm = LLM(params, max_num_batched_tokens=16, async_scheduling=async_scheduling, **GEOMETRY)
    out = llm.generate([prompt], sp, on_step=on_step)[0]
    assert out.num_preemptions == 1 and seen == [[(2 * PS, 0)] * 2]
    assert completions(out) == completions(want)
    llm.block_manager.check_invariants()


def test_a_window_model_takes_the_cached_pages_in_the_first_tokens_window(window_params):
    """Sliding window (W = 6, page size 4): the parent of n = 2 greedy samples, its
    prompt[:-1] cached whole, takes the cached pages the samples' first tokens can see
    and reserves nothing; the samples are the dense model's greedy tokens either way."""
    prompt = np.random.default_rng(13).integers(0, wp.CFG.vocab_size, 3 * wp.PS + 1).tolist()
    (want,) = wp.dense_greedy(window_params, [prompt], 6)
    llm = wp.engine(window_params)
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=6)
    for hit in (0, 3 * wp.PS):
        out = llm.generate([prompt], sp)[0]
        assert out.num_cached_tokens == hit
        assert [c.token_ids for c in out.outputs] == [want, want]
    llm.block_manager.check_invariants()
    assert llm.block_manager.stats().num_used_pages == 0
