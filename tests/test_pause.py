"""Pausing generation to change the weights mid-request (`LLM.pause_generation`,
`resume_generation`, `is_paused`; `pagedjax.weight_sync`): an asynchronous RL loop's
in-flight policy update, as vLLM's pause modes.

Requests kept by a pause with `clear_cache=True` are recomputed: their continuation is
the new weights' dense greedy continuation of the prompt and the tokens they had. With
`clear_cache=False` they keep their K/V, and none of their later pages enters the
prefix cache. The tiny preset, f32, XLA (engine_helpers' geometry, page size 8).
"""

import numpy as np
import pytest
from engine_helpers import GEOMETRY, PS, Dense, check_clean, compiles, greedy

from pagedjax.engine import LLM

RNG = np.random.default_rng(5)
# 5 and 11 tokens: the first fills no page before the pause, the second one.
PROMPTS = [RNG.integers(3, 256, size=n).tolist() for n in (5, 11)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def dense(old, new):
    return {"old": Dense(old), "new": Dense(new)}


def start(llm, steps: int) -> list[str]:
    """Queues PROMPTS and runs `steps` steps."""
    ids = [llm.add_request(p, greedy(MAX_TOKENS)) for p in PROMPTS]
    for _ in range(steps):
        assert llm.step() == []
    return ids


def generated(llm, request_id) -> list[int]:
    s = llm.scheduler.get(request_id).seqs[0]
    return s.token_ids[s.num_prompt_tokens :]


def finish(llm) -> dict[str, list[int]]:
    outs = {}
    while llm.has_unfinished_requests():
        outs |= {o.request_id: o.outputs[0].token_ids for o in llm.step()}
    return outs


def continuation(dense, prompt, had) -> list[int]:
    return had + dense.greedy([prompt + had], MAX_TOKENS - len(had))[0]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_keep_recomputes_kept_requests_with_the_new_weights(old, new, dense, async_scheduling):
    llm = LLM(old, async_scheduling=async_scheduling, **GEOMETRY)
    ids = start(llm, 4)
    assert llm.pause_generation(mode="keep") == []
    assert llm.is_paused()
    had = [generated(llm, i) for i in ids]
    assert all(had) and all(len(h) < MAX_TOKENS for h in had)
    for h, want in zip(had, dense["old"].greedy(PROMPTS, MAX_TOKENS), strict=True):
        assert h == want[: len(h)]
    assert llm.block_manager.stats().num_seqs == 0  # their K/V is gone: recomputed
    llm.update_params(new)
    llm.resume_generation()
    assert not llm.is_paused()
    outs = finish(llm)
    for i, p, h in zip(ids, PROMPTS, had, strict=True):
        assert outs[i] == continuation(dense["new"], p, h)
    check_clean(llm)


def test_keep_without_clearing_the_cache_goes_on_where_it_was(old, dense):
    llm = LLM(old, **GEOMETRY)
    ids = start(llm, 4)
    assert llm.pause_generation(mode="keep", clear_cache=False) == []
    assert llm.block_manager.stats().num_seqs == 2  # their K/V stays
    preemptions = llm.scheduler.num_preemptions
    assert llm.step() == [] and llm.step() == []  # paused: nothing moves
    llm.resume_generation()
    outs = finish(llm)
    assert [outs[i] for i in ids] == dense["old"].greedy(PROMPTS, MAX_TOKENS)
    assert llm.scheduler.num_preemptions == preemptions
    check_clean(llm)


def test_kept_k_v_of_the_old_weights_never_enters_the_prefix_cache(old, new):
    """A request that kept its K/V across `update_params` fills its first page after
    it: a later prompt with that page's tokens must not hit it."""
    llm = LLM(old, **GEOMETRY)
    (i, _) = start(llm, 2)
    llm.pause_generation(mode="keep", clear_cache=False)
    assert len(PROMPTS[0]) + len(generated(llm, i)) < PS  # no full page yet
    llm.update_params(new)
    llm.resume_generation()
    outs = finish(llm)
    first_page = (PROMPTS[0] + outs[i])[:PS]
    probe = llm.generate([first_page + [7, 7]], greedy(1))[0]
    assert probe.num_cached_tokens == 0
    # Pages the new weights compute whole are cached as usual.
    assert llm.generate([first_page + [7, 7]], greedy(1))[0].num_cached_tokens == PS
    check_clean(llm)


def test_abort_returns_the_partial_outputs(old, dense):
    llm = LLM(old, **GEOMETRY)
    ids = start(llm, 3)
    outs = llm.pause_generation()  # mode="abort", vLLM's default
    assert [o.request_id for o in outs] == ids
    wants = dense["old"].greedy(PROMPTS, MAX_TOKENS)
    for o, want in zip(outs, wants, strict=True):
        got = o.outputs[0]
        assert o.finished and got.finish_reason == "abort"
        assert got.token_ids and got.token_ids == want[: len(got.token_ids)]
    assert llm.is_paused()
    check_clean(llm)
    llm.resume_generation()
    assert llm.generate(PROMPTS, greedy(MAX_TOKENS))[0].outputs[0].token_ids == wants[0]


def test_wait_finishes_every_request_first(old, dense):
    llm = LLM(old, **GEOMETRY)
    ids = start(llm, 2)
    outs = llm.pause_generation(mode="wait")
    assert sorted(o.request_id for o in outs) == sorted(ids)
    got = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert [got[i] for i in ids] == dense["old"].greedy(PROMPTS, MAX_TOKENS)
    assert llm.is_paused()
    check_clean(llm)


def test_a_paused_engine_queues_requests_and_steps_nothing(old, dense):
    llm = LLM(old, **GEOMETRY)
    llm.generate(PROMPTS, greedy(2))  # (compiled)
    assert llm.pause_generation() == []
    i = llm.add_request(PROMPTS[0], greedy(MAX_TOKENS))
    before = compiles()
    for _ in range(3):
        assert llm.step() == []
    assert llm.block_manager.stats().num_seqs == 0
    assert compiles() == before
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate(PROMPTS, greedy(2))
    assert [g.request_id for g in llm.scheduler.waiting] == [i]  # (nothing queued by it)
    llm.resume_generation()
    llm.resume_generation()  # (not paused: nothing)
    assert finish(llm) == {i: dense["old"].greedy(PROMPTS[:1], MAX_TOKENS)[0]}


def test_pause_sleep_update_wake_resume(old, new, dense):
    """The RL loop of vLLM's docs: pause keeping the rollouts, free the device for
    training, load the new policy, go on."""
    llm = LLM(old, **GEOMETRY)
    ids = start(llm, 4)
    llm.pause_generation(mode="keep")
    had = [generated(llm, i) for i in ids]
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.resume_generation()
    with pytest.raises(RuntimeError, match="asleep"):
        llm.pause_generation(mode="wait")  # (its requests cannot run)
    assert llm.is_paused() and len(llm.scheduler.waiting) == 2
    llm.update_params(new)
    llm.wake_up()
    llm.resume_generation()
    outs = finish(llm)
    for i, p, h in zip(ids, PROMPTS, had, strict=True):
        assert outs[i] == continuation(dense["new"], p, h)
    check_clean(llm)


def test_sleep_refuses_requests_that_kept_their_k_v(old, dense):
    llm = LLM(old, **GEOMETRY)
    ids = start(llm, 3)
    llm.pause_generation(mode="keep", clear_cache=False)
    with pytest.raises(RuntimeError, match="clear_cache=True"):
        llm.sleep()
    assert llm.cache is not None and llm.block_manager.stats().num_seqs == 2
    llm.resume_generation()
    outs = finish(llm)
    assert [outs[i] for i in ids] == dense["old"].greedy(PROMPTS, MAX_TOKENS)


def test_weights_calls_still_refuse_unfinished_requests_unless_paused(old, new):
    llm = LLM(old, **GEOMETRY)
    start(llm, 1)
    for call in (lambda: llm.update_params(new), llm.sleep):
        with pytest.raises(RuntimeError, match="pause_generation"):
            call()
    llm.pause_generation()
    check_clean(llm)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(mode="drain"), ValueError, "'drain'"),
        (dict(mode=None), ValueError, "None"),
        (dict(clear_cache=1), TypeError, "clear_cache must be a bool, got 1"),
    ],
)
def test_bad_arguments_change_nothing(old, kwargs, error, match):
    llm = LLM(old, **GEOMETRY)
    ids = start(llm, 2)
    with pytest.raises(error, match=match):
        llm.pause_generation(**kwargs)
    assert not llm.is_paused()
    assert {g.request_id for g in llm.scheduler.running} == set(ids)
    finish(llm)
    check_clean(llm)


def test_pausing_inside_generate_aborts_its_requests(old):
    llm = LLM(old, **GEOMETRY)
    with pytest.raises(RuntimeError, match="inside generate"):
        llm.generate(PROMPTS, greedy(MAX_TOKENS), on_step=lambda e: e.pause_generation("keep"))
    assert llm.is_paused()
    check_clean(llm)


def test_on_token_streams_the_tokens_the_pause_applies(old, dense):
    """With async scheduling a step is in flight at the pause: its tokens reach the
    pause's `on_token`, so a stream misses none."""
    llm = LLM(old, async_scheduling=True, **GEOMETRY)
    streamed: dict[str, list[int]] = {}

    def on_token(rid, _index, token):
        streamed.setdefault(rid, []).append(token)

    ids = [llm.add_request(p, greedy(MAX_TOKENS)) for p in PROMPTS]
    for _ in range(4):
        llm.step(on_token=on_token)
    assert llm.core.inflight is not None
    llm.pause_generation(mode="keep", on_token=on_token)
    assert [streamed[i] for i in ids] == [generated(llm, i) for i in ids]
    llm.resume_generation()
    while llm.has_unfinished_requests():
        llm.step(on_token=on_token)
    assert [streamed[i] for i in ids] == dense["old"].greedy(PROMPTS, MAX_TOKENS)


class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_a_pause_whose_step_in_flight_fails_is_paused_and_recovered(old, dense, mode):
    """The completion of the step in flight raises (here in `on_token`): the exception
    propagates once the engine recovered as `step` does (every request aborted), and the
    engine is paused all the same, as vLLM's pause, which sets its flag first. (It was
    left unpaused: half a pause, its prefix cache kept.)"""
    llm = LLM(old, **GEOMETRY)
    ids = start(llm, 3)
    assert llm.core.inflight is not None

    def on_token(rid, index, token):
        raise Injected("on_token")

    with pytest.raises(Injected) as e:
        llm.pause_generation(mode=mode, on_token=on_token)
    assert llm.is_paused()
    notes = "\n".join(e.value.__notes__)
    assert "the engine recovered" in notes and "paused all the same" in notes, notes
    assert all(llm.abort(i) is None for i in ids)  # the recovery aborted them
    assert llm.block_manager.stats().num_cached_pages == 0  # (clear_cache)
    check_clean(llm)
    llm.resume_generation()
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == dense["old"].greedy(PROMPTS, MAX_TOKENS)


def test_a_wait_that_fails_returns_what_it_collected_from_the_next_step(old, dense):
    """A step of "wait" raises after a request finished in an earlier one: the engine is
    paused, and the next step() returns that request's output, which the pause had
    collected. (It was lost with the pause's return value.)"""
    llm = LLM(old, **GEOMETRY)
    short = llm.add_request(PROMPTS[0], greedy(3))
    long = llm.add_request(PROMPTS[1], greedy(MAX_TOKENS))
    llm.step()

    def on_token(rid, index, token):
        if rid == long and len(generated(llm, long)) == 6:  # (short ended at 3)
            raise Injected("on_token")

    with pytest.raises(Injected):
        llm.pause_generation(mode="wait", on_token=on_token)
    assert llm.is_paused()
    (out,) = llm.step()
    assert out.request_id == short and out.finished
    assert out.outputs[0].token_ids == dense["old"].greedy(PROMPTS[:1], 3)[0]
    assert llm.abort(long) is None and llm.step() == []
    check_clean(llm)
