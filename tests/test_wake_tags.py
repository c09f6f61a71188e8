"""Waking part of a sleeping engine, and resetting the prefix cache under running
requests (`LLM.wake_up(tags)`, `is_sleeping`, `reset_prefix_cache(reset_running_requests)`;
`pagedjax.weight_sync`), as vLLM's and as RL frameworks drive them (verl: the weights,
new weights, then the KV cache). After a full cycle, outputs equal a fresh engine's and
the dense reference's; while part of the engine sleeps, requests are refused naming it;
bad arguments change nothing. The tiny preset, f32, XLA (engine_helpers' geometry)."""

import jax
import pytest
from engine_helpers import GEOMETRY, Dense, check_clean, compiles, greedy, greedy_ids, random_params
from engine_helpers import UPDATE_PROMPTS as PROMPTS

from pagedjax.engine import LLM, RequestOutputKind

MAX_TOKENS = 12


def memory_kinds(llm) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(llm.params)}


def finish(llm, on_token=None) -> dict[str, list[int]]:
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step(on_token=on_token):
            assert o.request_id not in outs  # (each once)
            outs[o.request_id] = o.outputs[0].token_ids
    return outs


def refused(llm, match):
    """Every way to run a request raises `match`; `step()` has nothing to run."""
    with pytest.raises(RuntimeError, match=match):
        llm.generate(PROMPTS, greedy(6))
    with pytest.raises(RuntimeError, match=match):
        llm.add_request(PROMPTS[0], greedy(6))
    assert llm.step() == [] and not llm.has_unfinished_requests()


@pytest.mark.parametrize("level", [1, 2])
def test_weights_then_new_weights_then_kv_cache_as_verl(old, new, want, level):
    llm = LLM(old, **GEOMETRY)
    assert not llm.is_sleeping()
    assert greedy_ids(llm) == want["old"]
    before = compiles()
    llm.sleep(level=level)
    assert llm.is_sleeping()
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and llm.cache is None  # (no KV cache while the weights change)
    if level == 1:
        assert memory_kinds(llm) == {"device"}
    refused(llm, r"KV cache is still asleep.*wake_up\(tags=\['kv_cache'\]\)")
    llm.update_params(new)
    assert llm.is_sleeping() and llm.cache is None
    refused(llm, "KV cache is still asleep")
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    outs = llm.generate(PROMPTS, greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == want["new"]
    assert [o.num_cached_tokens for o in outs] == [0, 16]  # (a new, empty cache)
    assert compiles() == before
    assert greedy_ids(llm) == greedy_ids(LLM(new, **GEOMETRY))
    check_clean(llm)


def test_kv_cache_first_then_the_weights(old, want):
    llm = LLM(old, **GEOMETRY)
    greedy_ids(llm)
    llm.sleep()
    llm.wake_up(["kv_cache"])
    assert llm.cache is not None and memory_kinds(llm) == {"pinned_host"}
    assert llm.is_sleeping()
    refused(llm, r"weights are still asleep, in host memory.*wake_up\(tags=\['weights'\]\)")
    llm.wake_up(["weights"])
    assert not llm.is_sleeping() and memory_kinds(llm) == {"device"}
    assert greedy_ids(llm) == want["old"]
    check_clean(llm)


def test_after_level_2_the_weights_come_from_update_params_only(new, want):
    llm = LLM(random_params(0), **GEOMETRY)
    llm.sleep(level=2)
    llm.wake_up(tags=["kv_cache"])
    refused(llm, r"dropped \(sleep\(level=2\)\)")
    llm.wake_up(tags=["weights"])  # (none to bring back)
    assert not llm.is_sleeping()
    refused(llm, r"dropped \(sleep\(level=2\)\)")
    llm.update_params(new)
    assert greedy_ids(llm) == want["new"]
    # New weights while everything sleeps: they are awake, the KV cache is not.
    llm.sleep(level=2)
    llm.update_params(new)
    assert llm.is_sleeping() and memory_kinds(llm) == {"device"}
    refused(llm, "KV cache is still asleep")
    llm.wake_up(tags=["weights", "kv_cache"])
    assert not llm.is_sleeping()
    assert greedy_ids(llm) == want["new"]
    check_clean(llm)


@pytest.mark.parametrize(
    "tags, error, match",
    [
        (["weights", "weight"], ValueError, r"unknown wake_up tag 'weight': the tags are"),
        (["kv", "kv_cache", "all"], ValueError, "unknown wake_up tag 'kv', 'all'"),
        (["scheduling"], ValueError, r"'scheduling'.*resume_generation\(\)"),
        ([None], ValueError, "unknown wake_up tag None"),
        ("weights", TypeError, "tags must be a list of 'weights' and/or 'kv_cache'"),
        (1, TypeError, "got 1"),
    ],
)
def test_bad_tags_are_named_and_wake_nothing(old, want, tags, error, match):
    llm = LLM(old, **GEOMETRY)
    llm.sleep()
    with pytest.raises(error, match=match):
        llm.wake_up(tags)
    assert llm.is_sleeping() and llm.cache is None and memory_kinds(llm) == {"pinned_host"}
    refused(llm, r"asleep \(sleep\(\)\)")
    llm.wake_up()
    assert greedy_ids(llm) == want["old"]


def test_tags_already_awake_are_skipped(old, want):
    llm = LLM(old, **GEOMETRY)
    llm.wake_up(["weights", "kv_cache"])  # (not asleep: nothing)
    llm.wake_up([])
    assert not llm.is_sleeping()
    pools = jax.tree.leaves(llm.cache)
    llm.wake_up(["kv_cache"])
    assert all(a is b for a, b in zip(jax.tree.leaves(llm.cache), pools, strict=True))
    llm.sleep()
    llm.wake_up([])
    assert llm.is_sleeping() and llm.cache is None
    llm.wake_up(["weights"])
    weights = jax.tree.leaves(llm.params)
    llm.wake_up(t for t in ("weights", "kv_cache"))  # (any iterable; the weights skipped)
    assert all(a is b for a, b in zip(jax.tree.leaves(llm.params), weights, strict=True))
    assert not llm.is_sleeping()
    assert greedy_ids(llm) == want["old"]


def test_sleep_after_a_partial_wake_up_sleeps_again(old, want):
    llm = LLM(old, **GEOMETRY)
    greedy_ids(llm)
    llm.sleep()
    llm.wake_up(tags=["weights"])
    llm.sleep()
    assert memory_kinds(llm) == {"pinned_host"} and llm.cache is None
    llm.wake_up(tags=["kv_cache"])
    pools = jax.tree.leaves(llm.cache)
    llm.sleep(level=2)
    assert all(x.is_deleted() for x in pools) and llm.cache is None
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(llm.params))
    llm.update_params(old)
    llm.wake_up()
    assert greedy_ids(llm) == want["old"]
    check_clean(llm)


def test_a_paused_rollout_waits_until_everything_is_awake(old, new):
    llm = LLM(old, **GEOMETRY)
    ids = [llm.add_request(p, greedy(MAX_TOKENS)) for p in PROMPTS]
    for _ in range(4):
        llm.step()
    llm.pause_generation(mode="keep")
    seqs = [llm.scheduler.get(i).seqs[0] for i in ids]
    had = {i: s.token_ids[s.num_prompt_tokens :] for i, s in zip(ids, seqs, strict=True)}
    llm.sleep()
    llm.wake_up(tags=["weights"])
    llm.update_params(new)
    with pytest.raises(RuntimeError, match="KV cache is still asleep"):
        llm.resume_generation()
    with pytest.raises(RuntimeError, match="KV cache is still asleep"):
        llm.pause_generation(mode="wait")
    assert llm.is_paused() and len(llm.scheduler.waiting) == 2
    llm.wake_up(tags=["kv_cache"])
    llm.resume_generation()
    outs = finish(llm)
    dense = Dense(new)
    for i, p in zip(ids, PROMPTS, strict=True):
        h = had[i]
        assert outs[i] == h + dense.greedy([p + h], MAX_TOKENS - len(h))[0]
    check_clean(llm)


# ----------------------------------------------- reset_prefix_cache(reset_running_requests)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_reset_running_requests_preempts_them_and_they_finish_the_same(old, async_scheduling):
    llm = LLM(old, async_scheduling=async_scheduling, **GEOMETRY)
    llm.generate(PROMPTS, greedy(2))  # (their prompt pages cached)
    streamed: dict[str, list[int]] = {}

    def on_token(rid, _index, token):
        streamed.setdefault(rid, []).append(token)

    # The second finishes (3 tokens) in the step in flight that the reset completes: the
    # next step() returns it.
    ids = [llm.add_request(p, greedy(n)) for p, n in zip(PROMPTS, (MAX_TOKENS, 3), strict=True)]
    for _ in range(3):
        assert llm.step(on_token=on_token) == []
    assert llm.reset_prefix_cache() is False  # (their pages stay theirs)
    assert llm.block_manager.stats().num_cached_pages > 0
    preemptions = llm.scheduler.num_preemptions
    assert llm.reset_prefix_cache(reset_running_requests=True, on_token=on_token) is True
    stats = llm.block_manager.stats()
    assert stats.num_cached_pages == 0 and stats.num_seqs == 0 and llm.core.inflight is None
    assert llm.scheduler.num_preemptions == preemptions + 1  # (the first; the second finished)
    assert [g.request_id for g in llm.scheduler.waiting] == ids[:1]
    first = llm.step(on_token=on_token)
    assert [o.request_id for o in first] == ids[1:]
    outs = finish(llm, on_token) | {o.request_id: o.outputs[0].token_ids for o in first}
    dense = Dense(old)
    assert [outs[i] for i in ids] == dense.greedy(PROMPTS, [MAX_TOKENS, 3])
    assert [streamed[i] for i in ids] == [outs[i] for i in ids]  # (a stream misses none)
    check_clean(llm)


def test_reset_prefix_cache_with_queued_requests_holding_no_pages(old):
    """vLLM resets while no request holds pages: here a pause's kept requests."""
    llm = LLM(old, **GEOMETRY)
    llm.generate(PROMPTS, greedy(2))
    ids = [llm.add_request(p, greedy(MAX_TOKENS)) for p in PROMPTS]
    for _ in range(3):
        llm.step()
    llm.pause_generation(mode="keep", clear_cache=False)
    assert llm.reset_prefix_cache() is False
    assert llm.reset_prefix_cache(True) is True  # (recomputed after the pause)
    assert llm.block_manager.stats().num_seqs == 0 and len(llm.scheduler.waiting) == 2
    assert llm.reset_prefix_cache() is True
    assert llm.reset_prefix_cache(reset_connector=True) is True  # (no connector: no-op)
    llm.resume_generation()
    outs = finish(llm)
    assert [outs[i] for i in ids] == Dense(old).greedy(PROMPTS, MAX_TOKENS)
    check_clean(llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(reset_running_requests=1), "reset_running_requests must be a bool, got 1"),
        (dict(reset_running_requests=True, reset_connector=None), "reset_connector must be"),
    ],
)
def test_reset_prefix_cache_refuses_flags_that_are_not_bools(old, kwargs, match):
    llm = LLM(old, **GEOMETRY)
    llm.generate(PROMPTS, greedy(2))
    ids = [llm.add_request(p, greedy(MAX_TOKENS)) for p in PROMPTS]
    llm.step()
    cached = llm.block_manager.stats().num_cached_pages
    with pytest.raises(TypeError, match=match):
        llm.reset_prefix_cache(**kwargs)
    assert llm.block_manager.stats().num_cached_pages == cached
    assert {g.request_id for g in llm.scheduler.running} == set(ids)
    outs = finish(llm)
    assert [outs[i] for i in ids] == Dense(old).greedy(PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
@pytest.mark.parametrize("abort", [None, "between steps", "from on_token"])
def test_partial_outputs_of_the_step_a_reset_completes_come_after_it(old, kind, abort):
    """The step that `reset_running_requests=True` completes gave a streamed request a
    token: its next output holds it (DELTA outputs add up to the stream), and an abort
    right after the reset is its last output (the partial output the reset held for the
    next step() once came after it, unfinished)."""
    llm = LLM(old, **GEOMETRY)
    rid = llm.add_request(PROMPTS[0], greedy(MAX_TOKENS, ignore_eos=True, output_kind=kind))
    streamed, outs = [], []  # (outputs as the caller gets them)

    def stream(_rid, _index, token):
        streamed.append(token)

    def on_token(_rid, _index, token):  # (the first token after the reset aborts)
        stream(_rid, _index, token)
        if abort == "from on_token" and not any(o.finished for o in outs):
            outs.append(llm.abort(rid))

    for _ in range(3):
        outs += llm.step(on_token=stream)
    assert llm.reset_prefix_cache(reset_running_requests=True, on_token=stream) is True
    if abort == "between steps":
        outs.append(llm.abort(rid))
    while llm.has_unfinished_requests():
        outs += llm.step(on_token=on_token)
    assert all(o.request_id == rid for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    if kind == RequestOutputKind.DELTA:
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
    else:
        tokens = outs[-1].outputs[0].token_ids
    assert tokens == streamed == Dense(old).greedy(PROMPTS[:1], MAX_TOKENS, ())[0][: len(tokens)]
    assert len(tokens) == {None: MAX_TOKENS, "between steps": 3, "from on_token": 4}[abort]
    check_clean(llm)
