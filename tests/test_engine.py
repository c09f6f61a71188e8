"""pagedjax.engine: every output equals a dense no-cache recompute with `model.forward`.

Greedy outputs are checked against dense greedy decoding (one request at a time in
effect: each row of the dense batch is its own sequence), under prefix caching on and
off, several token budgets (chunk sizes), mixed prompt lengths and forced preemption;
sampled outputs (n=4) against the same sampler (`sampling.sample`, same seed and token
index) applied to dense logits; beam search against an exhaustive dense beam search
over the whole vocabulary. Every engine shares one geometry (tiny model, f32, XLA,
page size 8, 64 pages, default buckets) so that the tests share compiled programs.
"""

import collections
import dataclasses
from time import perf_counter

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
import pytest
from beam_oracle import whole_vocabulary_search

from pagedjax import decode, demo, model, resources, sampling
from pagedjax.batch import StepBatch
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams
from pagedjax.tokenizer import Tokenizer

TINY = PRESETS["tiny"]  # float32, vocab 256, EOS 2
PS, PAGES, WIDTH = 8, 64, 64  # page size, pages, dense buffer width (>= any sequence)
GEOMETRY = dict(page_size=PS, num_pages=PAGES, backend="xla", max_num_seqs=8)


def random_params(seed: int = 0) -> model.Params:
    """Weights with clear logit gaps (so greedy argmax is stable across f32 paths)."""
    return params_helpers.random_params(TINY, seed)


@pytest.fixture(scope="module")
def params():
    return random_params()


class Dense:
    """Dense no-cache logits at the last position of up to 8 sequences per call."""

    def __init__(self, params):
        self.params = params
        self.fn = jax.jit(model.forward)

    def last_logits(self, seqs) -> np.ndarray:
        out = []
        for i in range(0, len(seqs), 8):
            part = seqs[i : i + 8]
            buf = np.zeros((8, WIDTH), np.int32)
            for j, s in enumerate(part):
                buf[j, : len(s)] = s
            logits = np.asarray(self.fn(self.params, jnp.asarray(buf)))
            out += [logits[j, len(s) - 1] for j, s in enumerate(part)]
        return np.stack(out)

    def greedy(self, prompts, max_tokens, stop_ids=(2,)):
        """Dense greedy continuations; `max_tokens`: an int or one per prompt."""
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        outs = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while active:
            logits = self.last_logits([prompts[i] + outs[i] for i in active])
            for i, row in zip(list(active), logits, strict=True):
                tok = int(np.argmax(row))
                outs[i].append(tok)
                if tok in stop_ids or len(outs[i]) >= max_tokens[i]:
                    active.remove(i)
        return outs


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


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def check_clean(llm):
    llm.block_manager.check_invariants()
    stats = llm.block_manager.stats()
    assert stats.num_used_pages == 0 and stats.num_seqs == 0
    assert not llm.has_unfinished_requests()


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


def dense_beam_search(dense, prompt, width, max_tokens, stop_ids, length_penalty):
    """Exhaustive: every beam's whole-vocabulary log-probabilities, HF-style selection;
    (score, tokens, sum, reason) per hypothesis, best first."""

    def logprobs(prefixes):
        logits = dense.last_logits([prompt + g for g in prefixes]).astype(np.float64)
        m = logits.max(-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))

    return whole_vocabulary_search(logprobs, width, max_tokens, stop_ids, length_penalty)


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


def test_a_beam_search_ends_at_max_model_len(params):
    """With less room under max_model_len than max_tokens, beams end there ("length"), as
    sampled completions do (add_request's docstring)."""
    llm = LLM(params, max_model_len=12, **GEOMETRY)
    sp = SamplingParams(beam_width=2, n=2, max_tokens=100, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8, 9]], sp)[0]
    assert [(len(c.token_ids), c.finish_reason) for c in out.outputs] == [(7, "length")] * 2
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


def test_abort_frees_everything(params, dense):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (12, 20, 7, 15)]
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    ids = [llm.add_request(p, greedy(30, ignore_eos=True)) for p in prompts]
    outs = {ids[3]: llm.abort(ids[3])}  # before it ever ran
    count = {}

    def on_token(rid, index, tok):
        count[rid] = count.get(rid, 0) + 1
        if rid == ids[1] and count[rid] == 5:
            outs[rid] = llm.abort(rid)  # mid-step: between scheduling and committing

    steps = 0
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step(on_token=on_token))
        steps += 1
        if steps == 4:
            outs[ids[0]] = llm.abort(ids[0])  # between steps
    assert llm.abort(ids[0]) is None
    want = dense.greedy(prompts, 30, stop_ids=())
    got = [outs[i].outputs[0] for i in ids]
    assert [c.finish_reason for c in got] == ["abort", "abort", "length", "abort"]
    assert 0 < len(got[0].token_ids) < 30 and got[0].token_ids == want[0][: len(got[0].token_ids)]
    assert got[1].token_ids == want[1][:5]
    assert got[2].token_ids == want[2]
    assert got[3].token_ids == []
    assert [outs[i].finished for i in ids] == [False, False, True, False]
    check_clean(llm)


def test_add_request_outputs_finished_inside_generate_come_from_the_next_step(params, dense):
    """A request queued with add_request that finishes while a generate() runs is not
    lost (it was: generate dropped it, and has_unfinished_requests() said False)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    short, long = [5, 6, 7, 8], [9, 10, 11]
    rid = llm.add_request(short, greedy(2, ignore_eos=True))
    (out,) = llm.generate([long], greedy(12, ignore_eos=True))
    assert out.outputs[0].token_ids == dense.greedy([long], 12, stop_ids=())[0]
    assert llm.has_unfinished_requests()  # an output left for step() to return
    (other,) = llm.step()
    assert other.request_id == rid and other.finished
    assert other.outputs[0].token_ids == dense.greedy([short], 2, stop_ids=())[0]
    assert not llm.has_unfinished_requests() and llm.step() == []
    check_clean(llm)


def test_request_ids_given_and_drawn_never_collide(params):
    """generate()'s own ids skip those add_request was given (the counter's next id was
    refused as "already queued or running"); abort finds an int id as add_request
    stored it, as a str (abort(7) returned None and the request ran on)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    (first,) = llm.generate([[5, 6]], greedy(1))
    nxt = str(int(first.request_id) + 1)
    assert llm.add_request([5, 6, 7], greedy(30), request_id=nxt) == nxt
    (out,) = llm.generate([[5, 6]], greedy(1))
    assert out.request_id != nxt and out.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.add_request([5, 6, 7], greedy(30), request_id=7) == "7"
    assert llm.abort(7).request_id == "7" and llm.abort(int(nxt)).request_id == nxt
    assert llm.abort(7) is None
    assert llm.step() == []  # the step still in flight
    check_clean(llm)


def test_an_id_of_a_running_generate_call_is_refused(params, dense):
    """add_request (here from on_step) with the id of a running generate call's request
    that already finished is refused: it was queued, its output replaced the call's
    (generate returned another prompt's completion) and no step() returned it."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompts = [[5, 6, 7], [9, 10, 11]]
    refused = []

    def on_step(engine):
        if engine.metrics.num_steps == 3:  # prompt 0 ("0", one token) has finished
            try:
                engine.add_request([20, 21, 22, 23], greedy(1), request_id="0")
            except ValueError as e:
                refused.append(str(e))

    outs = llm.generate(prompts, [greedy(1), greedy(8, ignore_eos=True)], on_step=on_step)
    assert [o.request_id for o in outs] == ["0", "1"]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert refused == ["request id '0' belongs to a running generate() call"]
    assert outs[0].outputs[0].token_ids == dense.greedy([prompts[0]], 1)[0]
    assert llm.step() == []
    # Once the call returned, its ids are free again.
    assert llm.add_request([20, 21, 22, 23], greedy(1), request_id="0") == "0"
    (again,) = [o for _ in range(4) for o in llm.step()]
    assert again.request_id == "0" and again.prompt_token_ids == [20, 21, 22, 23]
    check_clean(llm)


def test_a_refused_request_draws_no_seed(params):
    """Requests without a seed draw theirs from the engine's seed in the order they are
    queued; a refused one (too many pages, an id in use, a generate call refused at its
    second prompt) draws none (each did: every later request sampled differently)."""
    sp = SamplingParams(temperature=1.0, max_tokens=3)

    def seeds(llm, n):
        rids = [llm.add_request([5, 6], sp) for _ in range(n)]
        return [llm.scheduler.get(r).seqs[0].seed for r in rids]

    want = seeds(LLM(params, **GEOMETRY), 3)
    assert seeds(LLM(params, seed=1, **GEOMETRY), 3) != want
    llm = LLM(params, **GEOMETRY)
    too_big = SamplingParams(max_tokens=500, n=2)
    with pytest.raises(ValueError, match="KV pages"):
        llm.add_request([5] * 100, too_big)
    rid = llm.add_request([5, 6], sp)
    with pytest.raises(ValueError, match="already queued or running"):
        llm.add_request([5, 6], sp, request_id=rid)
    with pytest.raises(ValueError, match="prompt 1: .*KV pages"):
        llm.generate([[5, 6], [5] * 100], [sp, too_big])
    assert [llm.scheduler.get(rid).seqs[0].seed, *seeds(llm, 2)] == want


def test_the_tokenizers_eos_ids_stop_as_the_models_do(params, dense):
    """A completion stops at any EOS id of the model's config or of the tokenizer (an
    instruct tokenizer often names its end-of-turn id only there); ignore_eos ignores it."""
    prompt = np.random.default_rng(5).integers(3, 256, size=6).tolist()
    free = dense.greedy([prompt], 12, stop_ids=())[0]
    k = next(i for i, t in enumerate(free) if i > 0 and t not in free[:i])
    assert 2 not in free[: k + 1]  # the model's own EOS does not stop it first
    eos = free[k]
    llm = LLM(
        params,
        tokenizer=resources.byte_tokenizer(eos_token_id=eos),
        max_num_batched_tokens=16,
        **GEOMETRY,
    )
    assert llm.eos_ids == {2, eos}
    out = llm.generate([prompt], greedy(12))[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (free[: k + 1], "stop", eos)
    out = llm.generate([prompt], greedy(12, ignore_eos=True))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free, "length")
    check_clean(llm)


def test_an_n_sample_request_aborted_before_it_ran_aborts_every_sample(params):
    """Samples not yet forked from sample 0 (they fork after the prompt's prefill) are
    aborted too: n completions, each "abort", none generated."""
    llm = LLM(params, **GEOMETRY)
    rid = llm.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=4, seed=1))
    out = llm.abort(rid)
    got = [(c.index, c.token_ids, c.finish_reason) for c in out.outputs]
    assert got == [(0, [], "abort"), (1, [], "abort"), (2, [], "abort")]
    assert out.finished is False and llm.abort(rid) is None
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


def test_cache_salt_separates_prefix_caches(params):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompt = np.random.default_rng(3).integers(3, 256, size=33).tolist()
    llm.generate([prompt], greedy(3, cache_salt="alice"))
    pages = {}

    def on_step(engine):
        for g in engine.scheduler.running:
            salt = g.cache_salt
            if g.seqs and g.seqs[0].num_admitted:
                pages[salt] = set(engine.block_manager.page_table(g.seqs[0].seq_id))
        if len(pages) == 2:
            assert not pages["bob"] & pages["alice"]

    bob, alice = llm.generate(
        [prompt, prompt],
        [greedy(3, cache_salt="bob"), greedy(3, cache_salt="alice")],
        on_step=on_step,
    )
    assert set(pages) == {"bob", "alice"}
    assert bob.num_cached_tokens == 0 and alice.num_cached_tokens == 32
    assert bob.outputs[0].token_ids == alice.outputs[0].token_ids
    check_clean(llm)


def test_stop_strings_and_stop_tokens(params, dense):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)  # byte tokenizer
    prompt = "def f(x):"
    ids = llm.tokenizer.encode(prompt)
    free = dense.greedy([ids], 20, stop_ids=())[0]
    j = next(i for i, t in enumerate(free) if 33 <= t < 127)  # an ASCII character
    stop = chr(free[j])
    out = llm.generate([prompt], greedy(20, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free[: free.index(free[j]) + 1]
    assert stop not in out.text
    assert out.text == llm.tokenizer.decode(free[: free.index(free[j])])
    out = llm.generate([prompt], greedy(20, stop_token_ids=[free[3]], ignore_eos=True))[0]
    assert out.outputs[0].token_ids == free[: free.index(free[3]) + 1]
    assert out.outputs[0].stop_reason == free[3]
    check_clean(llm)


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
    assert asyn[11].finished is False  # aborted
    assert sync_sum["num_generated_tokens"] == async_sum["num_generated_tokens"]
    assert async_sum["host_exposed_ms_per_step"] < sync_sum["host_exposed_ms_per_step"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n=0), "n=0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(min_p=1.01), "min_p=1.01"),
        (dict(min_p=True), "min_p=True"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(seed=-3), "seed=-3"),
        (dict(beam_width=2, n=3), "n=3"),
        (dict(stop=[""]), r"stop=\[''\]"),
        (dict(length_penalty=float("nan")), "length_penalty=nan"),
        (dict(logprobs=-1), "logprobs must be None or an int in \\[0, 20\\], got logprobs=-1"),
        (dict(logprobs=21), "got logprobs=21"),
        (dict(logprobs=True), "got logprobs=True"),
        (dict(logprobs=2.0), "got logprobs=2.0"),
        (dict(prompt_logprobs=-2), "got prompt_logprobs=-2"),
        (dict(prompt_logprobs=30), "prompt_logprobs must be None or an int in"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


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


def dense_log_softmax(dense, rows) -> np.ndarray:
    logits = dense.last_logits(rows).astype(np.float64)
    top1 = logits.max(-1, keepdims=True)
    return logits - top1 - np.log(np.exp(logits - top1).sum(-1, keepdims=True))


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


def test_generate_tokenizes_each_text_prompt_once(params, monkeypatch):
    """generate() checks every prompt before queueing any, then queues the ids it checked
    (it encoded each text twice: in the check and again in add_request)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)  # byte tokenizer
    prompts = ["def f(x):", "import os"]
    want = [llm.tokenizer.encode(p) for p in prompts]
    encoded = []
    encode = Tokenizer.encode

    def spy(self, text, *args, **kwargs):
        encoded.append(text)
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    outs = llm.generate([prompts[0], want[1], prompts[1]], greedy(2))
    assert encoded == [prompts[0], prompts[1]]
    assert [o.prompt for o in outs] == [prompts[0], None, prompts[1]]
    assert [o.prompt_token_ids for o in outs] == [want[0], want[1], want[1]]
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    (one,) = llm.generate(prompts[1], greedy(2))  # one text: one prompt, not its characters
    assert one.prompt == prompts[1] and one.outputs[0].token_ids == outs[2].outputs[0].token_ids
    encoded.clear()
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["ok", ""], greedy(2))
    assert encoded == ["ok"] and not llm.has_unfinished_requests()
    check_clean(llm)


def test_bad_requests_fail_before_anything_runs(params):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate([[5, 6], []], greedy(2))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], greedy(2))
    with pytest.raises(ValueError, match="512 tokens"):
        llm.generate([[5] * 512], greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 300]], greedy(2))
    with pytest.raises(ValueError, match="KV pages"):  # could never fit in 64 pages
        llm.generate([[5] * 100], SamplingParams(max_tokens=500, n=2))
    assert not llm.has_unfinished_requests()
    # Refused while queueing, after prompt 0 was queued: all or none, prompt 0 unqueued.
    with pytest.raises(ValueError, match="prompt 1: .*KV pages"):
        llm.generate([[5, 6], [5] * 100], [greedy(2), SamplingParams(max_tokens=500, n=2)])
    assert not llm.has_unfinished_requests() and not llm.step()
    # More seats than max_num_seqs: refused by _add before it builds n sequences (the
    # scheduler's refusal came after them: n=10**6 took 4 s, n=10**9 would take an hour).
    for params_, n in ((SamplingParams(n=10**6), 10**6), (SamplingParams(beam_width=9, n=2), 9)):
        with pytest.raises(ValueError, match=rf"{n} sequences at once \(n=.*max_num_seqs=8"):
            llm.add_request([5, 6], params_)
    assert not llm.has_unfinished_requests()
    with pytest.raises(ValueError, match="backend='gpu'"):
        LLM(params, page_size=PS, num_pages=PAGES, backend="gpu")
    with pytest.raises(ValueError, match="not both"):
        LLM(params, num_pages=8, kv_memory_fraction=0.5)
    for bad in (0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"):  # 0 was silently 0.8
        with pytest.raises(ValueError, match=r"kv_memory_fraction must be in \(0, 1\]"):
            LLM(params, kv_memory_fraction=bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        LLM(params, num_pages=8, backend="cuda")


def test_chat_renders_conversations_and_generates_from_them(params, dense):
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    byte = resources.byte_tokenizer()
    tok = Tokenizer(
        byte.tokenizer, bos_token_id=1, eos_token_ids=[2], add_bos=True, chat_template=template
    )
    llm = LLM(params, tokenizer=tok, max_num_batched_tokens=16, **GEOMETRY)
    convs = [
        [{"role": "user", "content": "def f(x):"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
    ]
    ids = [tok.encode_chat(c) for c in convs]
    assert ids[0] == tok.encode("<user>def f(x):\n<assistant>", add_bos=False)  # no BOS, as HF
    want = dense.greedy(ids, 6)
    outs = llm.chat(convs, greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.prompt_token_ids for o in outs] == ids
    assert outs[1].prompt == "<system>Be brief.\n<user>2+2=\n<assistant>"
    (one,) = llm.chat(convs[0], greedy(6))  # one conversation, not a list of them
    assert one.outputs[0].token_ids == want[0]
    bare = llm.chat(convs[0], greedy(6), add_generation_prompt=False)[0]
    assert bare.prompt == "<user>def f(x):\n"

    with pytest.raises(ValueError, match="conversation 1: messages\\[0\\] has no 'content'"):
        llm.chat([convs[0], [{"role": "user"}]], greedy(2))
    for bad in ("hi", [], None):
        with pytest.raises(TypeError, match="messages must be a conversation"):
            llm.chat(bad, greedy(2))
    with pytest.raises(
        ValueError, match="tokenizer has none .this tokenizer was built without one"
    ):
        LLM(params, max_num_batched_tokens=16, **GEOMETRY).chat(convs[0])
    check_clean(llm)


def test_chat_takes_vllms_chat_template_and_chat_template_kwargs(params):
    # Both fell into **template_vars: a given chat_template was silently ignored (the
    # tokenizer's rendered instead, or "has no chat template"), and so were the variables
    # of chat_template_kwargs; lora_request ran the base model without a word.
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    given = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}{% if x %}x={{ x }}{% endif %}"
    )
    byte = resources.byte_tokenizer()
    conv = [{"role": "user", "content": "def f(x):"}]
    for template in (own, None):
        tok = Tokenizer(byte.tokenizer, bos_token_id=1, eos_token_ids=[2], chat_template=template)
        llm = LLM(params, tokenizer=tok, max_num_batched_tokens=16, **GEOMETRY)
        (out,) = llm.chat(conv, greedy(1), chat_template=given)
        assert out.prompt == "<user>def f(x):<a>"
        assert out.prompt_token_ids == tok.encode_rendered(out.prompt, add_bos=False)
        (out,) = llm.chat(conv, greedy(1), chat_template=given, chat_template_kwargs={"x": 7})
        assert out.prompt == "<user>def f(x):<a>x=7"
        kw = dict(chat_template_kwargs={"x": 7}, x=3)  # a keyword wins, as a later update
        assert llm.chat(conv, greedy(1), chat_template=given, **kw)[0].prompt.endswith("x=3")
    assert llm.chat(conv, greedy(1), chat_template=own)[0].prompt == "[def f(x):]"
    with pytest.raises(TypeError, match="chat.. does not support vLLM's lora_request"):
        llm.chat(conv, greedy(1), chat_template=own, lora_request=object())
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(conv, greedy(1), chat_template=own, chat_template_kwargs=["x"])
    with pytest.raises(TypeError, match="chat_template must be a str, got 5"):
        llm.chat(conv, greedy(1), chat_template=5)
    with pytest.raises(ValueError, match="tokenizer has none"):  # none given, none its own
        llm.chat(conv, greedy(1))
    check_clean(llm)


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


def test_completion_text_reads_after_its_prompt(params):
    """With a SentencePiece-style decoder (it strips a text's leading space), a completion
    is decoded after its prompt: a first token "▁w" reads " w", as prompt + completion
    does (decoded alone it lost the space), in the final text and in the stop-string
    stream alike."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    vocab.update({c: 4 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")})
    vocab["▁w"] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab, [("▁", "w")], unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = Tokenizer(hf, bos_token_id=1, eos_token_ids=[2], add_bos=True)
    llm = LLM(params, tokenizer=tok, **GEOMETRY)
    w = vocab["▁w"]
    prompt = "hello"
    assert tok.decode([w]) == "w"  # alone: the strip
    for stop in ([], ["zz"]):  # the final text; with a stop string, the stream too
        sp = greedy(3, logit_bias={w: 100.0}, stop=stop)
        (out,) = llm.generate([prompt], sp)
        assert out.outputs[0].token_ids == [w] * 3
        assert out.outputs[0].text == " w w w"
        assert tok.decode(out.prompt_token_ids + [w] * 3) == prompt + out.outputs[0].text
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
