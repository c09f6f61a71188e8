"""pagedjax.engine: every output equals a dense no-cache recompute with `model.forward`.

Greedy outputs are checked against dense greedy decoding (one request at a time in
effect: each row of the dense batch is its own sequence), under prefix caching on and
off, several token budgets (chunk sizes), mixed prompt lengths, forced preemption and
async scheduling; sampled outputs (n=4) against the same sampler (`sampling.sample`,
same seed and token index) applied to dense logits; logprobs against the dense
log-softmax. Also: the step inputs, run-time metrics and cache sizing. Beam search is in
tests/test_engine_beam.py, the request API (ids, abort, add_request/step, seeds, bad
requests, stops, chat) in tests/test_engine_requests.py; the shared geometry and dense
reference in tests/engine_helpers.py.
"""

import collections
import dataclasses
from time import perf_counter

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
import pytest
from engine_helpers import (
    GEOMETRY,
    PAGES,
    PS,
    TINY,
    Dense,
    check_clean,
    dense_beam_search,
    dense_log_softmax,
    greedy,
    random_params,
)

from pagedjax import decode, demo, model, sampling
from pagedjax.batch import StepBatch
from pagedjax.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def params():
    return random_params()


@pytest.fixture(scope="module")
def dense(params):
    return Dense(params)


def prompts_with_shared_prefixes(seed=1, lens=(1, 3, 8, 9, 17, 24, 30)):
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 256, size=40).tolist()
    out = []
    for i, n in enumerate(lens):
        p = rng.integers(3, 256, size=n).tolist()
        if i % 2:  # every other prompt starts with the same 16 tokens
            p = base[:16] + p
        out.append(p)
    return out


@pytest.mark.parametrize(
    "caching,budget", [(True, 16), (False, 16), (True, 8), (True, 13), (False, 11)]
)
def test_greedy_equals_dense(params, dense, caching, budget):
    llm = LLM(params, enable_prefix_caching=caching, max_num_batched_tokens=budget, **GEOMETRY)
    prompts = prompts_with_shared_prefixes()
    want = dense.greedy(prompts, 14)
    outs = llm.generate(prompts, greedy(14))
    assert [o.outputs[0].token_ids for o in outs] == want
    for o, w in zip(outs, want, strict=True):
        c = o.outputs[0]
        assert c.finish_reason == ("stop" if w[-1] == 2 else "length")
        assert o.finished and o.ttft_s is not None and o.ttft_s <= o.latency_s
    # Second round: the same prompts again hit the prefix cache (only with caching on).
    again = llm.generate(prompts[::-1], greedy(14))
    assert [o.outputs[0].token_ids for o in again] == want[::-1]
    hits = [o.num_cached_tokens for o in again]
    if caching:
        assert sum(hits) > 0 and llm.summary()["prefix_cache_hit_rate"] > 0
        assert all(h == (len(p) - 1) // PS * PS for h, p in zip(hits, prompts[::-1], strict=True))
    else:
        assert sum(hits) == 0 and llm.block_manager.stats().prefix_hits == 0
    check_clean(llm)
    summary = llm.summary()
    assert summary["num_requests"] == 2 * len(prompts) and summary["preemptions"] == 0
    assert summary["num_compilations"] <= 4  # a handful of buckets, shared across tests


def sample_seed(seed: int, i: int) -> int:
    return (seed + i * 0x9E3779B1) % 2**32  # the engine's documented per-sample seed


def assert_drawn_by_the_sampler(dense, prompt, completions, sp):
    """Every token is what `sampling.sample` draws from dense logits with (seed_i, index)."""
    rows, seeds, steps, want = [], [], [], []
    for c in completions:
        for j, tok in enumerate(c.token_ids):
            rows.append(prompt + c.token_ids[:j])
            seeds.append(sample_seed(sp.seed, c.index))
            steps.append(j)
            want.append(tok)
    n = len(rows)
    drawn, lps = jax.jit(sampling.sample)(
        jnp.asarray(dense.last_logits(rows)),
        jnp.full(n, sp.temperature, jnp.float32),
        jnp.full(n, sp.top_k, jnp.int32),
        jnp.full(n, sp.top_p, jnp.float32),
        jnp.asarray(seeds, jnp.uint32),
        jnp.asarray(steps, jnp.int32),
        jnp.full(n, sp.min_p, jnp.float32),
    )
    assert np.asarray(drawn).tolist() == want
    bounds = np.cumsum([0] + [len(c.token_ids) for c in completions[:-1]])
    cum = np.add.reduceat(np.asarray(lps, np.float64), bounds)
    np.testing.assert_allclose([c.cumulative_logprob for c in completions], cum, rtol=1e-4)


def test_n_samples_share_the_prompt_and_match_the_sampler(params, dense):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompt = np.random.default_rng(7).integers(3, 256, size=20).tolist()  # 2 full pages
    sp = SamplingParams(
        n=4, temperature=0.9, top_k=40, top_p=0.95, min_p=0.1, seed=1234, max_tokens=10
    )
    seen = []

    def on_step(engine):
        for g in engine.scheduler.running:
            if len(g.seqs) != 4 or not all(s.num_admitted for s in g.seqs):
                continue
            bm = engine.block_manager
            tables = [bm.page_table(s.seq_id) for s in g.seqs]
            full = (len(prompt) - 1) // PS
            assert len({tuple(t[:full]) for t in tables}) == 1  # the same physical pages
            seen.append([bm._refcount[p] for p in tables[0][:full]])
            assert bm.stats().num_used_pages == len({p for t in tables for p in t})

    out = llm.generate([prompt], sp, on_step=on_step)[0]
    assert seen and all(rc == [4, 4] for rc in seen)
    samples = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) > 1
    # Reproducible for the same seed (through generate this time).
    again = llm.generate([prompt], sp)[0]
    assert [c.token_ids for c in again.outputs] == samples
    assert_drawn_by_the_sampler(dense, prompt, out.outputs, sp)
    check_clean(llm)


def run_under_preemption(params, dense, beam: bool):
    """14 requests of up to 60 tokens (8 pages each) in 64 pages, 12 sequences at a time:
    greedy ones, and (admitted last in the first wave, so preempted first) an n=2
    sampling request and an n=2 sampling or width-2 beam search request."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(5, 24, 14)]
    budget = [60 - len(p) for p in prompts]
    sps = [greedy(m, ignore_eos=True) for m in budget]
    s, b = 8, 9
    sps[s] = SamplingParams(
        n=2, temperature=0.8, top_p=0.9, seed=99, max_tokens=budget[s], prompt_logprobs=2
    )
    if beam:
        sps[b] = SamplingParams(n=2, beam_width=2, max_tokens=budget[b], ignore_eos=True)
    else:
        sps[b] = SamplingParams(n=2, temperature=1.0, top_k=8, seed=5, max_tokens=budget[b])
    llm = LLM(params, max_num_batched_tokens=16, **(GEOMETRY | dict(max_num_seqs=12)))
    outs = llm.generate(prompts, sps)
    greedy_ids = [i for i in range(14) if i not in (s, b)]
    want = dense.greedy([prompts[i] for i in greedy_ids], [budget[i] for i in greedy_ids], ())
    for i, w in zip(greedy_ids, want, strict=True):
        assert outs[i].outputs[0].token_ids == w and outs[i].outputs[0].finish_reason == "length"
    assert_drawn_by_the_sampler(dense, prompts[s], outs[s].outputs, sps[s])
    p = prompts[s]
    want = dense_log_softmax(dense, [p[:j] for j in range(1, len(p))])
    for j, entry in enumerate(outs[s].prompt_logprobs[1:]):  # kept through the preemption
        np.testing.assert_allclose(entry[p[j + 1]], want[j, p[j + 1]], atol=2e-5)
    if beam:
        beams = dense_beam_search(dense, prompts[b], 2, budget[b], (), 1.0)
        assert [c.token_ids for c in outs[b].outputs] == [h[1] for h in beams]
    else:
        assert_drawn_by_the_sampler(dense, prompts[b], outs[b].outputs, sps[b])
    assert llm.summary()["preemptions"] > 0 and llm.summary()["kv_pages_used"] >= PAGES - 8
    assert outs[s].num_preemptions > 0 and outs[b].num_preemptions > 0
    # Random prompts share no page: no request read any from the cache when first admitted
    # (a preempted one's readmission reads back its own pages; they are not its hit).
    assert [o.num_cached_tokens for o in outs] == [0] * 14
    check_clean(llm)


def test_preemption_keeps_outputs(params, dense):
    run_under_preemption(params, dense, beam=False)


@pytest.mark.slow  # compiles the top-k variants of the 16-row programs
def test_preemption_keeps_beam_search_outputs(params, dense):
    run_under_preemption(params, dense, beam=True)


def test_async_scheduling_gives_the_sync_outputs(params, monkeypatch):
    """Dispatching each step before the previous tokens arrive (the default) changes
    nothing a request sees: stop tokens and strings learnt a step late, n samples, a beam
    search (committed after its selection), logprobs, preemption and aborts."""
    fed = collections.Counter()
    finish = StepBatch.finish

    def counting_finish(self, plan, *args):
        inp, *rest = finish(self, plan, *args)
        fed[inp.token_src is not None and bool((inp.token_src >= 0).any())] += 1
        return inp, *rest

    monkeypatch.setattr(StepBatch, "finish", counting_finish)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(4, 30, 12)]
    sps = [greedy(40 - len(p)) for p in prompts]  # EOS (2) may stop them
    sps[1] = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=25, logprobs=2)
    sps[2] = SamplingParams(beam_width=2, max_tokens=6)
    sps[3] = greedy(20, stop_token_ids=[prompts[3][-1], 7, 11, 13], prompt_logprobs=1)
    sps[4] = SamplingParams(temperature=0.7, seed=8, max_tokens=30, stop=["a", "b", "c"])
    runs = {}
    for mode in (False, True):
        fed.clear()
        llm = LLM(
            params,
            async_scheduling=mode,
            max_num_batched_tokens=16,
            **(GEOMETRY | dict(num_pages=40, max_num_seqs=10)),
        )

        def abort_one(engine, done=[]):  # noqa: B006 - one abort per run
            if engine.metrics.num_steps == 12 and not done:
                done.append(engine.abort("11"))

        outs = llm.generate(prompts, sps, on_step=abort_one)
        runs[mode] = (outs, dict(fed), llm.summary())
        check_clean(llm)
    (sync, sync_fed, sync_sum), (asyn, async_fed, async_sum) = runs[False], runs[True]
    assert sync_fed.get(True, 0) == 0 and async_fed[True] > 0
    assert sync_sum["preemptions"] > 0 and async_sum["preemptions"] > 0
    for a, b in zip(sync, asyn, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs
        got = [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in b.outputs]
        assert got == [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in a.outputs]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert (ca.logprobs is None) == (cb.logprobs is None)
            np.testing.assert_allclose(ca.cumulative_logprob, cb.cumulative_logprob, rtol=1e-5)
    reasons = {c.finish_reason for o in asyn for c in o.outputs}
    assert {"stop", "length"} <= reasons
    assert asyn[11].finished and {c.finish_reason for c in asyn[11].outputs} == {"abort"}
    assert sync_sum["num_generated_tokens"] == async_sum["num_generated_tokens"]
    assert async_sum["host_exposed_ms_per_step"] < sync_sum["host_exposed_ms_per_step"]


def test_logprobs_are_the_dense_models_raw_log_softmax(params, dense):
    """Every entry: the sampled token first, then the k most likely, values from dense logits."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompts = prompts_with_shared_prefixes()[:4]
    sps = [
        SamplingParams(n=2, temperature=0.8, top_k=20, seed=3, max_tokens=7, logprobs=5),
        greedy(6, logprobs=0),
        greedy(6),  # no logprobs, in the same steps as rows that want them
        SamplingParams(temperature=1.2, seed=9, max_tokens=9, logprobs=20),
    ]
    outs = llm.generate(prompts, sps)
    assert outs[2].outputs[0].logprobs is None
    checked = unlikely = 0
    for prompt, o, sp in zip(prompts, outs, sps, strict=True):
        if sp.logprobs is None:
            continue
        for c in o.outputs:
            assert len(c.logprobs) == len(c.token_ids) > 0
            rows = [prompt + c.token_ids[:j] for j in range(len(c.token_ids))]
            logits = dense.last_logits(rows).astype(np.float64)
            top1 = logits.max(-1, keepdims=True)
            lsm = logits - top1 - np.log(np.exp(logits - top1).sum(-1, keepdims=True))
            for tok, entry, want in zip(c.token_ids, c.logprobs, lsm, strict=True):
                keys = list(entry)
                top = np.argsort(-want, kind="stable")[: sp.logprobs].tolist()
                assert keys[0] == tok
                assert keys[1:] == [t for t in top if t != tok]
                np.testing.assert_allclose([entry[t] for t in keys], want[keys], atol=2e-5)
                checked += 1
                unlikely += tok != int(np.argmax(want))
            total = sum(e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True))
            np.testing.assert_allclose(total, c.cumulative_logprob, rtol=1e-5)
    assert checked == sum(len(c.token_ids) for i in (0, 1, 3) for c in outs[i].outputs)
    assert unlikely > 0  # some sampled tokens were not the most likely: sampled-first order
    assert llm.summary()["num_compilations"] <= 6
    check_clean(llm)


def test_prompt_logprobs_score_every_prompt_token(params, dense):
    """Chunked prefill (budget 16 < prompt), n-sample forks and a shared prefix: every
    prompt token's entry is the dense model's, and such requests skip prefix-cache hits."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompts = prompts_with_shared_prefixes(lens=(9, 20, 17, 3))  # 9, 36, 17, 19 tokens
    warm = llm.generate(prompts, greedy(2))  # fills the prefix cache
    assert max(o.num_cached_tokens for o in warm) > 0
    sps = [
        greedy(3, prompt_logprobs=3),
        SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=3, prompt_logprobs=0),
        greedy(3),
        greedy(1, prompt_logprobs=20, logprobs=2),
    ]
    outs = llm.generate(prompts, sps)
    assert outs[2].prompt_logprobs is None and outs[2].num_cached_tokens > 0
    for prompt, o, sp in zip(prompts, outs, sps, strict=True):
        if sp.prompt_logprobs is None:
            continue
        assert o.num_cached_tokens == 0  # computed, not read from the cache
        assert len(o.prompt_logprobs) == len(prompt) and o.prompt_logprobs[0] is None
        want = dense_log_softmax(dense, [prompt[:j] for j in range(1, len(prompt))])
        for tok, entry, w in zip(prompt[1:], o.prompt_logprobs[1:], want, strict=True):
            keys = list(entry)
            top = np.argsort(-w, kind="stable")[: sp.prompt_logprobs].tolist()
            assert keys == [tok] + [t for t in top if t != tok]
            np.testing.assert_allclose([entry[t] for t in keys], w[keys], atol=2e-5)
        # The completions are what they are without prompt logprobs.
        plain = llm.generate([prompt], dataclasses.replace(sp, prompt_logprobs=None))[0]
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in plain.outputs]
    assert outs[3].outputs[0].logprobs is not None  # both kinds in one request
    assert llm.summary()["num_compilations"] <= 8
    check_clean(llm)


def test_prompt_logprobs_bar_the_prefix_cache_only_until_all_are_scored(params):
    """A request with prompt logprobs reads no cached pages until every prompt token but
    the first is scored (a hit would skip them); then its group may read the cache again
    (a readmission after preemption)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompt = list(range(3, 23))  # two prefill chunks
    rid = llm.add_request(prompt, greedy(4, prompt_logprobs=1))
    g = llm.scheduler.get(rid)
    assert g.read_prefix_cache is False and g.request.prompt_logprobs_missing == 19
    (out,) = [o for _ in range(20) for o in llm.step()]
    assert g.request.prompt_logprobs_missing == 0 and g.read_prefix_cache is True
    assert out.prompt_logprobs[0] is None and None not in out.prompt_logprobs[1:]
    check_clean(llm)


def test_every_step_input_carries_the_block_managers_page_tables(params, monkeypatch):
    """After each commit, every live row's page table and slots in the packed step are the
    block manager's, for prefill chunks, decode rows over pages they share copy-on-write
    (n samples, prefix hits) and beams bound in the commit."""
    checked = collections.Counter()
    finish = StepBatch.finish

    def checked_finish(self, plan, *args):
        inp, *top_ks = finish(self, plan, *args)
        for i, r in enumerate(plan.rows):
            if r.seq is None:
                continue
            table = self.bm.page_tables([r.seq.seq_id])[0]
            np.testing.assert_array_equal(inp.page_table[i, : len(table)], table)
            lo, hi = inp.query_start_loc[i], inp.query_start_loc[i + 1]
            pos = np.arange(r.start, r.start + r.num_tokens)
            np.testing.assert_array_equal(inp.positions[lo:hi], pos)
            np.testing.assert_array_equal(inp.slot_mapping[lo:hi], table[pos // PS] * PS + pos % PS)
            checked["beam" if r.group.atomic else "decode" if r.decode else "prefill"] += 1
        return inp, *top_ks

    monkeypatch.setattr(StepBatch, "finish", checked_finish)
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 256, size=19).tolist()  # 2 full pages and a partial one
    prompts = [shared, shared + [7, 8, 9], rng.integers(3, 256, size=13).tolist()]
    params_ = [
        SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12),
        greedy(12),
        SamplingParams(n=2, beam_width=2, max_tokens=9, ignore_eos=True),
    ]
    llm.generate(prompts, params_)
    assert min(checked["beam"], checked["decode"], checked["prefill"]) > 0, checked
    assert llm.block_manager.stats().cow_copies > 0
    check_clean(llm)


def test_a_step_failing_after_its_dispatch_leaves_no_unusable_feed(params, monkeypatch):
    """A step that fails after its call returned (here in on_token) may leave its device
    feed of sampled tokens unusable (a device error poisons it; here it is deleted):
    recovery replaces it, so the next step does not hand it to the device."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    decode_step = decode.decode_step

    def poisoned(*args, **kwargs):
        out, cache = decode_step(*args, **kwargs)
        out.feed.delete()
        return out, cache

    def on_token(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(decode, "decode_step", poisoned)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[5, 6, 7]], greedy(4), on_token=on_token)
    monkeypatch.undo()
    (out,) = llm.generate([[5, 6, 7]], greedy(4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
    check_clean(llm)


def test_step_loops_count_run_time_as_generate_does(params):
    """run_time_s counts the wall time of step() calls (serving.py's engine thread loops
    step(); run_time_s stayed 0 and output_tokens_per_s None) and of generate() calls,
    each once; output_tokens_per_s is the generated tokens over run time less compiles."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (6, 11)]
    for p in prompts:
        llm.add_request(p, greedy(5, ignore_eos=True))
    done, t0 = [], perf_counter()
    while llm.has_unfinished_requests():
        done += llm.step()
    wall = perf_counter() - t0
    s = llm.summary()
    assert len(done) == 2 and s["num_generated_tokens"] == 10
    assert s["compile_time_s"] < s["run_time_s"] <= wall
    net = s["run_time_s"] - s["compile_time_s"]
    assert s["output_tokens_per_s"] == pytest.approx(10 / net)
    t0 = perf_counter()
    llm.generate(prompts, greedy(4, ignore_eos=True))
    wall = perf_counter() - t0
    g = llm.summary()
    assert 0 < g["run_time_s"] - s["run_time_s"] <= wall  # its steps are not counted twice
    net = g["run_time_s"] - g["compile_time_s"]
    assert g["output_tokens_per_s"] == pytest.approx(18 / net)
    # An on_step that steps the engine itself: those steps are part of the generate
    # call's time, not added a second time (they were: about 1.5x the wall time here).
    nested = []
    t0 = perf_counter()
    llm.generate(prompts, greedy(4, ignore_eos=True), on_step=lambda e: nested.append(e.step()))
    wall = perf_counter() - t0
    assert len(nested) >= 2
    assert 0 < llm.summary()["run_time_s"] - g["run_time_s"] <= wall
    check_clean(llm)


def test_kv_bytes_read_under_a_sliding_window_count_only_the_windows():
    """Under a window of W, a row reads its chunk's windows: W - 1 positions before the
    chunk and the chunk, not its whole context (kv_bytes_read was overstated)."""
    windowed = params_helpers.random_params(dataclasses.replace(TINY, sliding_window=4), 0)
    llm = LLM(windowed, max_num_batched_tokens=16, async_scheduling=False, **GEOMETRY)
    rng = np.random.default_rng(3)
    llm.generate([rng.integers(3, 256, size=20).tolist()], greedy(5, ignore_eos=True))
    # Prefill 16 from 0, then 4 from 16 (its 1st token sampled), then 4 decode steps.
    assert [r.context_tokens for r in llm.metrics.steps] == [16, 3 + 4, 4, 4, 4, 4]
    s = llm.summary()
    assert s["kv_bytes_read"] == (16 + 7 + 4 * 4) * llm.metrics.kv_bytes_per_token


def test_kv_memory_fraction_sizes_the_cache(params):
    # CPU: no device stats, so the cap is max_num_seqs full-length sequences beside the
    # watermark's pages (which admission keeps free): 128 pages, plus 1 at 0.01, 31 at 0.2.
    for watermark, extra in ((0.01, 1), (0.2, 31)):
        llm = LLM(
            params,
            kv_memory_fraction=0.5,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            watermark=watermark,
        )
        assert llm.cache_config.num_pages == 4 * TINY.max_position_embeddings // 16 + extra
        assert llm.cache.num_pages == llm.cache_config.num_pages
        bm = llm.block_manager
        assert bm.num_pages - bm.watermark_pages == 4 * TINY.max_position_embeddings // 16


@pytest.mark.slow  # Pallas interpret mode is slow on the CPU
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_kernels_in_interpret_mode(params, dense, backend):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 9, 17, 9)]
    llm = LLM(
        params, interpret=True, max_num_batched_tokens=16, **(GEOMETRY | dict(backend=backend))
    )
    outs = llm.generate(prompts, greedy(5))
    assert [o.outputs[0].token_ids for o in outs] == dense.greedy(prompts, 5)
    check_clean(llm)


DEMO_PROMPTS = ("def ", "import os\n", "class Config:\n    def __init__(self")


def test_demo_model_greedy_equals_dense_recompute():
    """Issue 8's engine-level check: 200+ greedy tokens of the trained demo model through
    the engine (XLA backend, f32: the shipped bf16 weights upcast exactly) equal dense
    no-cache recompute token for token. Causality makes the dense argmax at position i of
    the whole (padded) sequence the dense model's choice for the token after i, so one
    forward per sequence checks every step."""
    llm = LLM(
        demo.demo_model_dir(),
        dtype="float32",
        backend="xla",
        page_size=16,
        num_pages=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    cfg = llm.config
    prompts = [llm.tokenizer.encode(p) for p in DEMO_PROMPTS]
    new = cfg.max_position_embeddings - max(map(len, prompts))
    assert new >= 200, f"the demo model's {cfg.max_position_embeddings} positions are too few"
    new = min(new, 240)
    outs = llm.generate(prompts, greedy(new, ignore_eos=True))
    width = cfg.max_position_embeddings
    batch = np.zeros((len(prompts), width), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        seq = p + o.outputs[0].token_ids
        assert len(o.outputs[0].token_ids) == new
        batch[i, : len(seq)] = seq
    argmax = np.asarray(jnp.argmax(jax.jit(model.forward)(llm.params, batch), axis=-1))
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        got = o.outputs[0].token_ids
        want = argmax[i, len(p) - 1 : len(p) - 1 + new].tolist()
        diff = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        assert diff is None, f"prompt {i}: engine and dense differ first at token {diff}"
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20  # a trained model
    check_clean(llm)
