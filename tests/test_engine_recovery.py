"""pagedjax.engine: a step that raises leaves the engine consistent and reusable.

Failures are injected into the jitted step call (`decode.prefill_step` /
`decode.decode_step`, as `EngineCore._dispatch` calls them): before the call (nothing donated),
after the real call (its donated cache is gone, the new one is lost), or after deleting
the cache's arrays (a donation that failed); and while applying results (`on_token`,
`jax.device_get`). After each: the exception propagates unchanged, no page is held, the
block manager's invariants hold, and the next `generate` equals a fresh engine's
(greedy and seeded sampling), with prefix-cache hits from before the failure only when
the cache survived. One geometry (tiny model, f32, XLA, page size 8) for every engine,
so that the tests share compiled programs.
"""

import jax
import numpy as np
import params_helpers
import pytest

from pagedjax import decode
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams

TINY = PRESETS["tiny"]
PS = 8
GEOMETRY = dict(
    page_size=PS, num_pages=48, backend="xla", max_num_seqs=4, max_num_batched_tokens=16
)
RNG = np.random.default_rng(7)
PREFIX = RNG.integers(3, 256, size=2 * PS).tolist()  # two full pages shared by prompts
WARM = PREFIX + RNG.integers(3, 256, size=3).tolist()
PROMPTS = [PREFIX + RNG.integers(3, 256, size=n).tolist() for n in (2, 9)] + [
    RNG.integers(3, 256, size=n).tolist() for n in (5, 12)
]
SPS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, max_tokens=6, seed=11, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True),
]


class Injected(RuntimeError):
    pass


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


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def fail_on_call(monkeypatch, which: str, n: int, mode: str) -> list:
    """Makes the n-th call (1-based) of `decode.<which>` raise `Injected`; `mode`:
    "before" the call, "after" the real call (which consumed the donated cache), or
    "deleted" (the cache's arrays deleted, then raise). Returns the call log."""
    real = getattr(decode, which)
    calls = []

    def step(params, cache, inp, **kw):
        calls.append(which)
        if len(calls) == n:
            if mode == "before":
                raise Injected(f"{which} call {n}")
            if mode == "deleted":
                for x in jax.tree.leaves(cache):
                    x.delete()
                raise Injected(f"{which} call {n}")
            real(params, cache, inp, **kw)
            raise Injected(f"{which} call {n} after it ran")
        return real(params, cache, inp, **kw)

    monkeypatch.setattr(decode, which, step)
    return calls


def check_recovered(llm, *, queued=0):
    bm = llm.block_manager
    bm.check_invariants()
    st = bm.stats()
    assert st.num_used_pages == 0 and st.num_seqs == 0, st
    # Every page is free, or cached and evictable (the prefix cache's only).
    assert st.num_free_pages + st.num_evictable_pages == st.num_pages
    assert st.num_evictable_pages == st.num_cached_pages
    assert llm.has_unfinished_requests() == bool(queued)
    assert len(llm.scheduler.waiting) == queued and not llm.scheduler.running
    assert all(not x.is_deleted() for x in jax.tree.leaves(llm.cache))


def check_reusable(llm, want, *, cache_kept: bool):
    """WARM hits the prefix cache from before the failure iff it was kept; then PROMPTS
    give a fresh engine's outputs."""
    want_outs, want_warm = want
    (warm,) = llm.generate([WARM], SPS[0])
    assert tokens([warm]) == want_warm
    assert warm.num_cached_tokens == (2 * PS if cache_kept else 0)
    assert tokens(llm.generate(PROMPTS, SPS)) == want_outs
    check_recovered(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "which,n,mode",
    [
        ("prefill_step", 1, "before"),
        ("prefill_step", 2, "deleted"),
        ("decode_step", 3, "before"),
        ("decode_step", 2, "after"),
    ],
)
def test_a_failed_step_call_aborts_everything_and_the_engine_goes_on(
    params, want, monkeypatch, async_scheduling, which, n, mode
):
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    llm.generate([WARM], SPS[0])  # PREFIX's pages cached
    calls = fail_on_call(monkeypatch, which, n, mode)
    other = llm.add_request(PROMPTS[2], SPS[2])  # not generate()'s: aborted too
    with pytest.raises(Injected) as info:
        llm.generate(PROMPTS, SPS)
    assert calls.count(which) == n
    assert any("the engine recovered" in note for note in info.value.__notes__)
    assert llm.scheduler.get(other) is None
    check_recovered(llm)
    monkeypatch.undo()
    lost = mode != "before"
    assert (llm.block_manager.stats().num_cached_pages == 0) == lost
    check_reusable(llm, want, cache_kept=not lost)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_commit_interrupted_after_its_append_uncaches_the_page_it_filled(
    params, monkeypatch, async_scheduling
):
    """The commit's append fills (and caches) a page, then fails before the row gets its
    slot: the step never runs, so recovery uncaches that page (the decode row's last)."""
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    bm, prompt = llm.block_manager, PREFIX[: PS - 1]  # the first decode token fills a page
    real = bm.append_tokens

    def append_tokens(seq_ids, token_ids):
        out = real(seq_ids, token_ids)
        if len(seq_ids):
            raise Injected("in commit, after the append")
        return out

    monkeypatch.setattr(bm, "append_tokens", append_tokens)
    with pytest.raises(Injected):
        llm.generate([prompt], SPS[0])
    check_recovered(llm)
    assert bm.stats().num_cached_pages == 0
    monkeypatch.undo()
    fresh = LLM(params, **GEOMETRY)
    (full,) = fresh.generate([prompt], SPS[0])
    longer = prompt + full.outputs[0].token_ids[:3]  # would hit the unwritten page
    (got,) = llm.generate([longer], SPS[0])
    assert got.num_cached_tokens == 0
    assert tokens([got]) == tokens(fresh.generate([longer], SPS[0]))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("exc", [Injected, KeyboardInterrupt])
def test_step_that_raises_in_on_token_aborts_all_its_requests(params, want, async_scheduling, exc):
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    llm.generate([WARM], SPS[0])
    for p, sp in zip(PROMPTS, SPS, strict=True):
        llm.add_request(p, sp)
    seen = []

    def on_token(rid, index, tok):
        seen.append(tok)
        if len(seen) == 5:
            raise exc("from on_token")

    with pytest.raises(exc):
        while llm.has_unfinished_requests():
            llm.step(on_token=on_token)
    check_recovered(llm)  # step() aborts every request, whatever the exception
    check_reusable(llm, want, cache_kept=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ctrl_c_in_generate_aborts_its_requests_and_requeues_the_others(
    params, want, monkeypatch, async_scheduling
):
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    others = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[2:], SPS[2:], strict=True)]
    n = 0
    real = jax.device_get

    def device_get(x):  # Ctrl-C while waiting for the device, mid-generation
        nonlocal n
        n += 1
        if n == 4:
            raise KeyboardInterrupt
        return real(x)

    monkeypatch.setattr(jax, "device_get", device_get)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], SPS[:2])
    monkeypatch.undo()
    check_recovered(llm, queued=2)
    assert [g.request_id for g in llm.scheduler.waiting] == others
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step())
    assert tokens([done[i] for i in others]) == want[0][2:]  # recomputed, same outputs
    check_recovered(llm)
    check_reusable(llm, want, cache_kept=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ctrl_c_in_on_token_keeps_the_other_requests_whole(params, async_scheduling):
    """A Ctrl-C raised from generate's `on_token` at each of a run's tokens in turn: the
    requests of `add_request` that were running end as they would have (the token it
    raised on still counts for their length and stop checks; it used to be appended
    unchecked, and the requeued request ran past its end), and those that finished
    in the step before it (or with the token it raised on) are returned by the next
    step (their outputs were lost with the step)."""
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    greedy = dict(temperature=0.0, ignore_eos=True)
    free = llm.generate(PROMPTS[1:], SamplingParams(max_tokens=7, **greedy))
    stop = free[1].outputs[0].token_ids[3]  # the second request stops on its 4th token
    kept = [
        SamplingParams(max_tokens=2, **greedy),
        SamplingParams(max_tokens=7, stop_token_ids=[stop], **greedy),
        SamplingParams(max_tokens=5, **greedy),
    ]
    want = tokens(llm.generate(PROMPTS[1:], kept))
    assert [len(t) for (t,) in want] == [2, want[1][0].index(stop) + 1, 5]
    k = 0
    while True:
        k += 1
        ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[1:], kept, strict=True)]
        calls = []

        def on_token(rid, index, tok, calls=calls, k=k):
            calls.append(rid)
            if len(calls) == k:
                raise KeyboardInterrupt

        try:
            llm.generate(PROMPTS[:1], SPS[0], on_token=on_token)
        except KeyboardInterrupt:
            pass
        else:
            break  # k is past the run's last token
        done = {}
        while llm.has_unfinished_requests():
            for o in llm.step():
                assert o.request_id not in done and o.finished
                done[o.request_id] = o
        assert sorted(done) == sorted(ids), k
        assert tokens([done[i] for i in ids]) == want, k
        check_recovered(llm)
    assert k > 10
    while llm.has_unfinished_requests():  # the last run's, finished inside its generate
        llm.step()
    check_recovered(llm)


def test_ctrl_c_between_steps_aborts_only_generates_requests(params, want):
    llm = LLM(params, **GEOMETRY)
    llm.generate([WARM], SPS[0])
    other = llm.add_request(PROMPTS[3], SPS[3])

    def on_step(engine, steps=[]):  # noqa: B006 - one run
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:3], SPS[:3], on_step=on_step)
    # Between steps nothing is half done: the other request keeps running.
    assert [g.request_id for g in llm.scheduler.running] == [other]
    llm.block_manager.check_invariants()
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step())
    assert tokens([done[other]]) == want[0][3:]
    check_reusable(llm, want, cache_kept=True)


def test_a_failed_step_with_n_samples_and_beams(params, monkeypatch):
    """Forked samples and beam groups are aborted cleanly too (their shared pages)."""
    llm = LLM(params, **GEOMETRY)
    sps = [
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5),
        SamplingParams(beam_width=2, max_tokens=4),
    ]
    fresh = tokens(llm.generate(PROMPTS[:2], sps))
    fail_on_call(monkeypatch, "decode_step", 3, "deleted")
    with pytest.raises(Injected):
        llm.generate(PROMPTS[:2], sps)
    check_recovered(llm)
    monkeypatch.undo()
    assert tokens(llm.generate(PROMPTS[:2], sps)) == fresh
    check_recovered(llm)


def test_block_manager_free_all_and_uncache():
    from pagedjax.blocks import BlockManager, InvalidArgument

    bm = BlockManager(16, 4)
    prompt = list(range(3, 16))  # 13 tokens: 3 full pages and one partial
    bm.admit("a", prompt)
    bm.mark_computed("a", 13)
    bm.fork("a", "b")
    bm.admit("c", prompt[:9])  # hits 2 pages
    bm.mark_computed("c", 9)
    assert bm.stats().num_cached_pages == 3
    pages = bm.page_table("a")
    assert bm.uncache([pages[1], 15]) == 2  # the page and the one cached under it; 15: none
    assert bm.stats().num_cached_pages == 1 and bm.stats().num_used_pages == 5
    bm.check_invariants()  # referenced pages stay with their holders
    assert bm.free_all() == 3
    st = bm.stats()
    assert (st.num_seqs, st.num_used_pages, st.num_evictable_pages) == (0, 0, 1)
    bm.check_invariants()
    with pytest.raises(InvalidArgument, match=r"\[16\]"):
        bm.uncache([16])
    assert bm.uncache() == 1 and bm.stats().num_free_pages == 16
    assert bm.admit("d", prompt) == 0  # nothing cached is found
    bm.check_invariants()


def test_a_recovery_that_fails_says_so_on_the_original_exception(params, monkeypatch):
    from pagedjax import sharding

    llm = LLM(params, **GEOMETRY)
    fail_on_call(monkeypatch, "prefill_step", 1, "deleted")

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for a new cache")

    monkeypatch.setattr(sharding, "create_cache", no_memory)
    with pytest.raises(Injected) as info:
        llm.generate(PROMPTS[:1], SPS[:1])
    (note,) = info.value.__notes__
    assert "MemoryError('no room for a new cache')" in note and "create a new LLM" in note


def test_a_failed_schedule_uncaches_every_page(params, want, monkeypatch):
    """`schedule()` registers the prefill pages it plans before failing: without a plan
    recovery cannot tell which, so the whole prefix cache goes (the step's full page of
    PROMPTS[1] holds no K/V and must not be hit)."""
    llm = LLM(params, **GEOMETRY)
    llm.generate([WARM], SPS[0])
    real = llm.scheduler.schedule

    def schedule():
        real()
        raise Injected("in schedule, after planning")

    monkeypatch.setattr(llm.scheduler, "schedule", schedule)
    with pytest.raises(Injected):
        llm.generate(PROMPTS, SPS)
    monkeypatch.undo()
    check_recovered(llm)
    assert llm.block_manager.stats().num_cached_pages == 0
    check_reusable(llm, want, cache_kept=False)


def test_unwritten_pages_are_the_rows_pages_and_each_decode_rows_last():
    from types import SimpleNamespace

    from pagedjax.blocks import BlockManager
    from pagedjax.recovery import unwritten_pages
    from pagedjax.sequence import ScheduledRow, StepPlan

    assert unwritten_pages(None, BlockManager(8, 4), 4) is None  # schedule() failed: all
    bm = BlockManager(16, 4)
    bm.admit("a", list(range(3, 13)))  # 10 tokens: 3 pages
    last = bm.page_table("a")[-1]

    def row(slots=None, seq_id=None, decode=False):
        seq = None if seq_id is None else SimpleNamespace(seq_id=seq_id)
        slots = None if slots is None else np.asarray(slots, np.int32)
        return ScheduledRow(None, seq, 0, 0, 1, decode, False, slots=slots)

    plan = StepPlan(
        rows=[
            row([0]),  # page 0: slot 0 is a slot
            row([-1, 21, 22, 23, 24, -1]),  # pages 5 and 6; -1 (dropped tokens) is none
            row(seq_id="a", decode=True),  # before commit gave it a slot: its last page
            row(decode=True),  # dead decode row
            row(seq_id="gone", decode=True),  # its sequence was freed meanwhile
            row([63], seq_id="a"),  # a prefill row: its slots only
        ]
    )
    assert unwritten_pages(plan, bm, 4) == sorted({0, 5, 6, 15, last})


def test_cache_lost_when_a_leaf_is_deleted_or_fails_on_the_device():
    from pagedjax.recovery import cache_lost

    class FailedOutput:  # the output of a step that failed on the device
        def is_deleted(self):
            return False

        def block_until_ready(self):
            raise RuntimeError("device error")

    cache = [jax.numpy.zeros(3), jax.numpy.ones(2)]
    assert not cache_lost(cache)
    assert cache_lost([*cache, FailedOutput()])
    cache[1].delete()
    assert cache_lost(cache)


def test_the_note_says_what_recovery_did():
    from pagedjax.recovery import note

    ids = [f"r{i}" for i in range(10)]
    n = note(ids, 3, True)
    assert "aborted 10 request(s)" in n and "'r7']..." in n and "r8" not in n
    assert "3 other(s) still queued" in n and "KV cache was re-created" in n
    n = note(["a"], 0, False)
    assert n.endswith("aborted 1 request(s) ['a']")
