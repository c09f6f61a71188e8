"""pagedjax.engine_core, reviewed (29): the step loop with asynchronous scheduling.

A step that fails after it applied the previous step's tokens (its commit, its
dispatch, or its bookkeeping once dispatched: a Ctrl-C lands anywhere) must not lose
what that applying built: the outputs of the requests that finished then (they have
left the scheduler, so the recovery aborts nothing of theirs) come from the next step,
as those of a failed apply do; a partial output (output_kind DELTA) built then and
never returned is taken back, so that a request the recovery keeps returns its tokens
later. Geometry of tests/test_engine.py (shared compiled programs).

And a differential test in lockstep: an engine with `async_scheduling=True` and one
without, given the same requests at the same step calls and the same aborts (between
steps and from `on_token`), call `on_token` with the same tokens in the same order and
return the same outputs from each `step()` (but an async engine's last step: one that
computed a token for nothing, returning none), under preemption, chunked prefill,
prefix-cache hits and priority scheduling; no returned output changes afterwards.
(tests/test_engine_fuzz.py holds either engine's final outputs to a roomy synchronous
reference's; this holds every step of the two to each other, the partial outputs and
those of aborted requests whole.)
"""

import copy

import numpy as np
import params_helpers
import pytest
from engine_helpers import GEOMETRY, check_clean, greedy, random_params

from pagedjax import decode
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, RequestOutputKind, SamplingParams, StructuredOutputsParams

_rng = np.random.default_rng(29)
PROMPTS = [_rng.integers(3, 256, size=n).tolist() for n in (5, 7, 11)]


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def params():
    return random_params(0)


@pytest.fixture(scope="module")
def want(params):
    """Greedy outputs of PROMPTS: 2, 8 and 8 tokens."""
    llm = LLM(params, **GEOMETRY)
    outs = llm.generate(PROMPTS, [greedy(2, ignore_eos=True)] + [greedy(8, ignore_eos=True)] * 2)
    return [o.outputs[0].token_ids for o in outs]


def run_all(llm, outs):
    while llm.has_unfinished_requests():
        outs += llm.step()
    return outs


@pytest.mark.parametrize(
    "async_scheduling,where",
    [(False, "dispatch"), (False, "record"), (True, "record")],
    ids=["sync-dispatch", "sync-record", "async-record"],
)
def test_a_request_finished_before_the_step_failed_is_returned_by_the_next_step(
    params, want, monkeypatch, async_scheduling, where
):
    """Request 0 (2 tokens) finishes when the third step call applies the second step's
    tokens; that call then fails (its decode dispatch, or its bookkeeping after it).
    Request 0's output comes from the next step, whole; request 1 is aborted by the
    recovery. (Its output was built, handed to `on_finish`, and dropped: `step()`'s
    caller never saw it, and the request was neither returned nor aborted.)"""
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    a = llm.add_request(PROMPTS[0], greedy(2, ignore_eos=True))
    b = llm.add_request(PROMPTS[1], greedy(8, ignore_eos=True))
    calls = []
    if where == "dispatch":
        real = decode.decode_step

        def fail(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise Injected("the second decode step")
            return real(*args, **kw)

        monkeypatch.setattr(decode, "decode_step", fail)
    else:
        real = llm.metrics.record

        def fail(rec, num_compilations=0):
            calls.append(1)
            if len(calls) == 3:
                raise Injected("the third step's bookkeeping")
            real(rec, num_compilations)

        monkeypatch.setattr(llm.metrics, "record", fail)
    outs = []
    with pytest.raises(Injected) as e:
        run_all(llm, outs)
    assert "the engine recovered: aborted 1 request(s) ['1']" in "\n".join(e.value.__notes__)
    assert outs == [] and llm.abort(b) is None
    monkeypatch.undo()
    assert llm.has_unfinished_requests()  # (an output to return)
    outs = run_all(llm, [])
    assert [(o.request_id, o.finished) for o in outs] == [(a, True)]
    assert outs[0].outputs[0].token_ids == want[0]
    assert outs[0].outputs[0].finish_reason == "length"
    check_clean(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_ctrl_c_in_generate_after_its_step_applied_loses_no_other_requests_output(
    params, want, monkeypatch, async_scheduling
):
    """Requests queued with `add_request` run inside a `generate` call that a Ctrl-C
    interrupts in the step that applied their tokens: request 1, finished there, is
    returned by the next `step()`; request 0 (output_kind DELTA), requeued, returns
    every token in its DELTA outputs (the one built in the failed step is taken back;
    its tokens were missing from the stream)."""
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    delta = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    x = llm.add_request(PROMPTS[1], delta)
    y = llm.add_request(PROMPTS[0], greedy(2, ignore_eos=True))
    real, calls = llm.metrics.record, []

    def fail(rec, num_compilations=0):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(rec, num_compilations)

    monkeypatch.setattr(llm.metrics, "record", fail)
    with pytest.raises(KeyboardInterrupt) as e:
        llm.generate([PROMPTS[2]], greedy(8, ignore_eos=True))
    assert "aborted 1 request(s) ['2']; 1 other(s) still queued" in "\n".join(e.value.__notes__)
    monkeypatch.undo()
    outs = run_all(llm, [])
    (last_y,) = [o for o in outs if o.request_id == y]
    assert last_y.finished and last_y.outputs[0].token_ids == want[0]
    xs = [o for o in outs if o.request_id == x]
    assert [o.finished for o in xs] == [False] * (len(xs) - 1) + [True]
    assert sum((o.outputs[0].token_ids for o in xs), []) == want[1]
    check_clean(llm)


# ------------------------------------------------------------------ sync vs async

FUZZ_PS, FUZZ_LEN = 4, 32  # tests/test_engine_fuzz.py's geometry (shared programs)
FUZZ_BUCKETS = decode.Buckets(min_tokens=64, min_seqs=8, min_pages=8, min_copies=8)


@pytest.fixture(scope="module")
def fuzz_params():
    return params_helpers.random_params(PRESETS["tiny"], 3)


def random_sampling(rng) -> SamplingParams:
    lengths = [1, 2, 5, 12, 20, FUZZ_LEN]
    kw = dict(max_tokens=int(rng.choice(lengths)), ignore_eos=bool(rng.integers(2)))
    kind = rng.choice(["greedy", "sample", "n"])
    if kind == "greedy":
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = float(rng.choice([0.7, 1.0]))
        kw["seed"] = None if rng.integers(3) == 0 else int(rng.integers(2**32))
        kw["top_k"] = int(rng.choice([0, 20]))
        kw["top_p"] = float(rng.choice([1.0, 0.9]))
        kw["n"] = 2 if kind == "n" else 1
    if rng.integers(3) == 0:
        kw["stop_token_ids"] = rng.integers(0, 256, size=int(rng.integers(1, 10))).tolist()
    if rng.integers(3) == 0:
        kw["stop"] = [str(rng.choice(list("aeiou ,.()")))]
        kw["include_stop_str_in_output"] = bool(rng.integers(2))
    if rng.integers(3) == 0:
        kw["min_tokens"] = int(rng.integers(0, kw["max_tokens"] + 1))
    if rng.integers(3) == 0:
        kw |= dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    if rng.integers(4) == 0:
        kw["logprobs"] = 2
    if rng.integers(5) == 0:
        kw["prompt_logprobs"] = 1
    if rng.integers(5) == 0:
        kw["bad_words"] = [str(rng.choice(["ab", "e ", "x"]))]
    if rng.integers(16) == 0:  # (its rows step in sync with the device)
        kw["structured_outputs"] = StructuredOutputsParams(regex="[a-f]{2,9}( [a-f]+)?")
    kinds = [RequestOutputKind.FINAL_ONLY] * 2 + [RequestOutputKind.CUMULATIVE]
    kw["output_kind"] = rng.choice(kinds + [RequestOutputKind.DELTA])
    return SamplingParams(**kw)


def random_workload(rng):
    """(engine config, requests): each request (prompt, params, arrival step, abort: None,
    ("step", s) or ("token", k), priority)."""
    cfg = dict(
        num_pages=18,
        max_num_seqs=int(rng.choice([2, 4, 8])),
        enable_prefix_caching=bool(rng.integers(4) > 0),
        scheduling_policy=str(rng.choice(["fcfs", "priority"])),
    )
    cfg["max_num_batched_tokens"] = int(rng.integers(cfg["max_num_seqs"], 20))
    base = rng.integers(3, 256, size=12).tolist()
    requests = []
    for _ in range(int(rng.integers(3, 9))):
        n = int(rng.integers(1, 24))
        shared = min(int(rng.choice([0, 3, 4, 5, 8, 12])), n)
        prompt = base[:shared] + rng.integers(0, 256, size=n - shared).tolist()
        arrival = int(rng.integers(0, 5))
        abort = [None, None, None, None, ("step", arrival + int(rng.integers(0, 10)))]
        abort.append(("token", int(rng.integers(0, 12))))
        priority = int(rng.integers(-2, 3)) if cfg["scheduling_policy"] == "priority" else 0
        sp = random_sampling(rng)
        requests.append((prompt, sp, arrival, abort[rng.integers(6)], priority))
    return cfg, requests


def summary(o):
    """Everything of a RequestOutput but its times."""
    entries = lambda lps: None if lps is None else [e and dict(e) for e in lps]  # noqa: E731
    comps = [
        (c.index, c.text, c.token_ids, c.cumulative_logprob, c.finish_reason, c.stop_reason)
        + (entries(c.logprobs),)
        for c in o.outputs
    ]
    return (o.request_id, o.finished, o.num_cached_tokens, o.num_preemptions, comps) + (
        entries(o.prompt_logprobs),
    )


def lockstep_log(llm, requests) -> list:
    """Runs `requests` on `llm` step by step; returns what happened, in order."""
    log, added, counts, kept = [], set(), {}, []

    def on_token(rid, index, token):
        log.append(("token", rid, index, token))
        counts[rid] = counts.get(rid, 0) + 1
        a = requests[int(rid)][3]
        if a is not None and a[0] == "token" and counts[rid] == a[1] + 1:
            out = llm.abort(rid)
            log.append(("abort from on_token", rid, out and summary(out)))

    step = 0
    while len(added) < len(requests) or llm.has_unfinished_requests():
        for i, (prompt, sp, arrival, abort, priority) in enumerate(requests):
            if i not in added and arrival <= step:
                added.add(i)
                try:
                    llm.add_request(prompt, sp, request_id=str(i), priority=priority)
                except ValueError as e:  # (n=2 of a long max_tokens in few pages)
                    log.append(("refused", i, str(e)))
            if abort == ("step", step) and i in added:
                out = llm.abort(str(i))
                log.append(("abort", i, out and summary(out)))
        outs = llm.step(on_token=on_token)
        kept += [(o, copy.deepcopy(o)) for o in outs]
        log.append(("step", step, [summary(o) for o in outs]))
        step += 1
        assert step < 500, "the engine does not finish"
    # (an async engine's last step may have computed a token for nothing: it returns none)
    while log[-1][0] == "step" and not log[-1][2]:
        log.pop()
    for out, copied in kept:  # nothing returned changed since
        assert summary(out) == summary(copied), out.request_id
    llm.block_manager.check_invariants()
    stats = llm.block_manager.stats()
    assert stats.num_used_pages == 0 and stats.num_seqs == 0, stats
    return log + [("preemptions", llm.scheduler.num_preemptions)]


def check_lockstep(params, seed):
    cfg, requests = random_workload(np.random.default_rng(seed))
    logs = []
    for async_scheduling in (False, True):
        llm = LLM(
            params,
            page_size=FUZZ_PS,
            backend="xla",
            max_model_len=FUZZ_LEN,
            buckets=FUZZ_BUCKETS,
            seed=0,
            async_scheduling=async_scheduling,
            **cfg,
        )
        logs.append(lockstep_log(llm, requests))
    sync, async_ = logs
    for i, (a, b) in enumerate(zip(sync, async_, strict=False)):
        assert a == b, f"event {i} differs ({cfg})"
    assert len(sync) == len(async_)


# Priority scheduling, a preemption, three aborts from on_token, prefix hits, n = 2,
# stop strings, min_tokens, penalties, bad words, logprobs and prompt logprobs; about
# 8 compiled programs (shared with the fuzz's).
def test_async_scheduling_returns_what_sync_does_at_every_step(fuzz_params):
    check_lockstep(fuzz_params, 4)


# Seed 31: first come first served, a preemption, aborts between steps and from
# on_token, a structured output.
@pytest.mark.slow
@pytest.mark.parametrize("seed", [31, *range(100, 112)])
def test_async_scheduling_returns_what_sync_does_at_every_step_slow(fuzz_params, seed):
    check_lockstep(fuzz_params, seed)
