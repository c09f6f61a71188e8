"""pagedjax.batch: a request's logit-bias arrays (`request_bias`); pagedjax.step_input:
the bucketing, bounds and padding rows of `build_step_input`, the packing both share."""

import dataclasses
import types

import numpy as np
import pytest
from test_scheduler import PS, Sim
from test_window_admission import WindowSim

from pagedjax import decode
from pagedjax.batch import StepBatch, request_bias
from pagedjax.blocks import BlockManager
from pagedjax.config import PRESETS, CacheConfig
from pagedjax.request import SamplingParams
from pagedjax.scheduler import Scheduler, Sequence, SequenceGroup

TINY = PRESETS["tiny"]  # vocab 256, max_position_embeddings 512


def as_dict(arrays):
    ids, values = arrays
    assert ids.dtype == np.int32 and values.dtype == np.float32
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


@pytest.mark.parametrize("seed", range(5))
def test_bias_and_banned_stop_ids(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(50, 5000))
    bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, 6)}
    # Stop ids past the vocabulary (never sampled) are legal: beyond int32 too.
    stop = {int(t) for t in rng.integers(0, vocab, 4)}
    stop |= {vocab + int(rng.integers(0, 100)), 2**31 + int(rng.integers(0, 2**40))}
    sp = SamplingParams(
        logit_bias=bias or None, min_tokens=int(rng.integers(1, 5)), stop_token_ids=sorted(stop)
    )
    got_bias, banned = request_bias(sp, frozenset(stop), vocab)
    assert as_dict(got_bias) == pytest.approx(bias)
    want = bias | {t: float("-inf") for t in stop if t < vocab}
    assert as_dict(banned) == pytest.approx(want)


def test_min_tokens_alone_bans_only_the_stop_ids_in_the_vocabulary():
    rng = np.random.default_rng(9)
    vocab = int(rng.integers(100, 1000))
    stop = frozenset({2, int(rng.integers(3, vocab)), 2**31, 2**63})
    bias, banned = request_bias(SamplingParams(min_tokens=2), stop, vocab)
    assert bias is None
    assert as_dict(banned) == {t: float("-inf") for t in stop if t < vocab}
    assert request_bias(SamplingParams(), stop, vocab) == (None, None)


def test_min_tokens_bans_a_stop_id_the_bias_raises():
    params = SamplingParams(min_tokens=1, logit_bias={7: 5.0, 8: 1.0})
    bias, banned = request_bias(params, frozenset({7}), 100)
    assert as_dict(bias) == {7: 5.0, 8: 1.0}
    assert as_dict(banned) == {7: float("-inf"), 8: 1.0}  # the ban wins until min_tokens


def test_bias_outside_the_vocabulary_is_a_value_error():
    with pytest.raises(ValueError, match=r"\[300\]"):
        request_bias(SamplingParams(logit_bias={5: 1.0, 300: 2.0}), frozenset(), 300)


def test_bucket_size_is_the_smallest_power_of_two_above_n_and_the_floor():
    for floor in (1, 3, 8, 16):
        for n in range(0, 130):
            want = 1
            while want < max(n, floor):
                want *= 2
            assert decode.bucket_size(n, floor) == want, (n, floor)
    with pytest.raises(ValueError, match="min_tokens must be a positive int, got min_tokens=0"):
        decode.Buckets(min_tokens=0)


def test_build_step_input_takes_the_last_position_and_sample_step():
    cache_cfg = CacheConfig(page_size=64, num_pages=16, dtype="float32")
    pages = list(range(8))  # 512 tokens: max_position_embeddings
    ok = decode.SeqChunk([1, 2], 510, pages, temperature=1.0, sample_step=2**31 - 1)
    inp = decode.build_step_input([ok], TINY, cache_cfg)
    assert inp.context_lens[0] == 512 and inp.sample_steps[0] == 2**31 - 1
    with pytest.raises(ValueError, match=r"positions \[511, 513\) exceed"):
        decode.build_step_input([decode.SeqChunk([1, 2], 511, pages)], TINY, cache_cfg)
    with pytest.raises(ValueError, match=f"sample_step={2**31}"):  # int32 would wrap
        decode.build_step_input([dataclasses.replace(ok, sample_step=2**31)], TINY, cache_cfg)


def test_build_step_input_padding_rows_are_greedy_and_untruncated():
    # Padding rows must not switch on the sampler's Gumbel draw or its sort.
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunk = decode.SeqChunk([5], 3, [1], temperature=0.9, top_k=3, top_p=0.5, min_p=0.1)
    inp = decode.build_step_input([chunk], TINY, cache_cfg)
    assert inp.temperature.shape == (8,)
    assert (inp.temperature[1:] == 0).all() and (inp.top_k[1:] == 0).all()
    assert (inp.top_p[1:] == 1).all() and (inp.min_p[1:] == 0).all()


def test_build_step_input_rejects_a_copy_chain():
    # (3 -> 4, 4 -> 5) depends on the order the device applies the copies in.
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunk = decode.SeqChunk([1], 0, [1])
    with pytest.raises(ValueError, match="distinct and not sources"):
        decode.build_step_input([chunk], TINY, cache_cfg, copies=[(3, 4), (4, 5)])


def test_build_step_input_lets_a_window_drop_the_position_just_below_it():
    # Window 4: sequence 1's query at 12 sees positions 9..12 (p - W < j <= p), so page 5
    # offset 0 (its position 8) may be written by sequence 0 (its position 4).
    cfg = dataclasses.replace(TINY, sliding_window=4)
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunks = [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 12, [0, 0, 5, 6])]
    inp = decode.build_step_input(chunks, cfg, cache_cfg)
    np.testing.assert_array_equal(inp.slot_mapping[:2], [20, 24])
    with pytest.raises(ValueError, match="which sequence 1 reads as its position 8"):
        decode.build_step_input(chunks, dataclasses.replace(cfg, sliding_window=5), cache_cfg)


# ---------------------------------------------------- StepBatch: the engine's packing

EXACT = decode.Buckets(min_tokens=1, min_seqs=1, min_pages=1, min_copies=1)
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


class PackingChecks:
    """For a `test_scheduler.Sim`: packs every plan with `StepBatch` as the engine does
    (sized after `schedule()`, finished after `commit()`) and checks the StepInput against
    `decode.build_step_input` of the same rows: the validating builder, given each row's
    tokens, start, page table (the block manager's after the commit) and sampling values,
    with the buckets at 1 so that every shape is exact."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.cfg = dataclasses.replace(TINY, sliding_window=self.sched.sliding_window)
        self.cache_cfg = CacheConfig(page_size=PS, num_pages=self.bm.num_pages, dtype="float32")
        self.packed = 0
        commit = self.sched.commit

        def commit_and_finish(plan, **kw):
            commit(plan, **kw)
            if not plan.rows:  # (the engine packs no step then)
                return
            prev, toks = self.inflight if self.inflight else (None, [])
            feed = np.array([0 if t is None else t for t in toks] + [0], np.int32)
            self.finished = self.batch.finish(plan, feed, prev) + (feed,)
            self.tables = [  # (a window's released entries read as page 0)
                r.page_row.tolist() if not r.decode else self.bm.page_tables([r.seq.seq_id])[0]
                for r in plan.rows
            ]

        self.sched.commit = commit_and_finish

    def check_plan(self, plan):
        super().check_plan(plan)
        self.batch = plan.rows and StepBatch(plan, EXACT, PS, self.cfg.vocab_size, self.bm)

    def write_and_check(self, plan, fed):
        (inp, k, pk, feed), tables = self.finished, self.tables
        chunks, targets, top, prompt_top = [], [], 0, 0
        for r, table in zip(plan.rows, tables, strict=True):
            s, req = r.seq, r.group.request
            p, end = req.params, r.start + r.num_tokens
            kw = {}
            if r.samples:
                step = end - s.num_prompt_tokens
                bias = req.banned if step < p.min_tokens else req.bias
                kw = dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
                kw |= dict(min_p=p.min_p, seed=s.seed, sample_step=step)
                kw |= dict(logit_bias=None if bias is None else as_dict(bias))
                top = max(top, p.logprobs or 0)
                if p.penalised:  # the history the host has (a fed token: not yet)
                    n = s.num_prompt_tokens
                    kw |= dict(prompt_ids=s.token_ids[:n], output_ids=s.token_ids[n : end - r.feed])
                    kw |= {k: getattr(p, k) for k in PENALTIES}
            chunks.append(decode.SeqChunk(s.token_ids[r.start : end], r.start, table, **kw))
            pos = range(r.start, end)
            wanted = req.prompt_logprobs_missing and not r.decode
            targets += [
                s.token_ids[i + 1] if wanted and i + 1 < s.num_prompt_tokens else -1 for i in pos
            ]
            if wanted and r.start + 1 < s.num_prompt_tokens:
                prompt_top = max(prompt_top, p.prompt_logprobs)
        want = decode.build_step_input(
            chunks, self.cfg, self.cache_cfg, copies=plan.copies, buckets=EXACT
        )
        src = np.asarray(inp.token_src)
        fed_ids = np.where(src >= 0, feed[np.maximum(src, 0)], inp.token_ids)  # as the device
        assert (np.asarray(inp.token_ids)[src >= 0] == 0).all()
        np.testing.assert_array_equal(fed_ids, want.token_ids)
        for name in (
            "positions", "slot_mapping", "page_table", "context_lens", "query_start_loc",
            "logits_indices", "copy_src", "copy_dst", "temperature", "top_k", "top_p",
            "min_p", "seeds", "sample_steps",
        ):  # fmt: skip
            np.testing.assert_array_equal(getattr(inp, name), getattr(want, name), err_msg=name)
        assert inp.decode == want.decode
        for name in ("logit_bias", "penalties"):
            got, ref = getattr(inp, name), getattr(want, name)
            assert (got is None) == (ref is None), name
            for f in dataclasses.fields(ref) if ref is not None else ():
                np.testing.assert_array_equal(getattr(got, f.name), getattr(ref, f.name), f.name)
        if any(t >= 0 for t in targets):
            pad = [-1] * (len(want.token_ids) - len(targets))
            np.testing.assert_array_equal(inp.target_ids, targets + pad)
        else:
            assert inp.target_ids is None
        assert (k, pk) == tuple(
            min(decode.bucket_size(x, 8), 256) if x else 0 for x in (top, prompt_top)
        )
        self.packed += 1
        return super().write_and_check(plan, fed)


class BatchSim(PackingChecks, Sim):
    pass


class WindowBatchSim(PackingChecks, WindowSim):
    pass


def add_request(sim, rid, prompt, max_tokens, rng, **options):
    """A request as the engine records it (`outputs.Request`'s fields StepBatch reads)."""
    params = SamplingParams(max_tokens=max_tokens, **options)
    g = sim.add(rid, prompt, max_tokens, n=params.n)
    stop_ids = frozenset(params.stop_token_ids)
    bias, banned = request_bias(params, stop_ids, TINY.vocab_size)
    missing = len(prompt) - 1 if params.prompt_logprobs is not None else 0
    g.request = types.SimpleNamespace(
        params=params, stop_ids=stop_ids, bias=bias, banned=banned,
        prompt_logprobs_missing=missing, guide=None,
    )  # fmt: skip
    g.read_prefix_cache = not missing  # as the engine: logits at every prompt token
    for s in g.seqs + g.forks:
        s.seed = int(rng.integers(0, 2**32))
    return g


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_step_batch_packs_plans_as_build_step_input_does(in_flight):
    """Chunked prefill, prefix hits, n samples forking copy-on-write, preemption and
    asynchronous feeds, with per-request sampling values, penalties, logprobs, prompt
    logprobs and min_tokens bans: every packed step equals the validating builder's."""
    rng = np.random.default_rng(4)
    sim = BatchSim(num_pages=24, max_num_seqs=6, budget=16, in_flight=in_flight)
    shared = rng.integers(3, 100, 9).tolist()
    options = [
        dict(temperature=0.7, top_k=5, logprobs=9, repetition_penalty=1.2, frequency_penalty=0.5),
        dict(temperature=0.0, prompt_logprobs=9, min_tokens=3, stop_token_ids=(7, 300)),
        dict(temperature=1.3, top_p=0.8, min_p=0.05, logit_bias={5: 2.0, 7: -1.0}, logprobs=2),
        dict(temperature=0.9, prompt_logprobs=1, min_tokens=2, presence_penalty=0.3, n=2),
    ]
    for i in range(10):
        prompt = (shared if i % 3 else []) + rng.integers(3, 100, rng.integers(1, 14)).tolist()
        add_request(sim, i, prompt, int(rng.integers(2, 20)), rng, **options[i % 4])
    sim.run()
    assert sim.packed == sum(bool(p.rows) for p in sim.plans) > 20
    assert sim.sched.num_preemptions > 0
    assert sim.bm.stats().prefix_hits > 0 and sim.bm.stats().cow_copies > 0
    assert any(r.feed for p in sim.plans for r in p.rows) == in_flight


def test_step_batch_asks_for_the_most_prompt_logprobs_of_its_rows():
    sim = BatchSim(budget=16)
    rng = np.random.default_rng(6)
    for rid, k in (("many", 9), ("few", 1)):  # one step prefills both
        add_request(sim, rid, rng.integers(3, 100, 5).tolist(), 2, rng, prompt_logprobs=k)
    plan = sim.step()
    assert [r.num_tokens for r in plan.rows] == [5, 5]
    assert sim.finished[2] == 16  # 9 rounded up to the bucket, not the last row's 1
    sim.run()


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("window,budget", [(1, 4), (3, 7), (8, 4), (16, 7)])
def test_step_batch_packs_window_plans_as_build_step_input_does(window, budget, in_flight):
    """A window model's plans (pages given back below the window, released entries page
    0, reservations, preemption) pack as the validating builder, which also checks that
    no page written in a step is read in it under the window."""
    rng = np.random.default_rng(window)
    pages = 2 * (-(-(max(window, 2) - 2 + budget) // PS) + 2)  # just enough for n=2
    sim = WindowBatchSim(
        window=window, num_pages=pages, max_num_seqs=4, budget=budget, in_flight=in_flight
    )
    options = [
        dict(temperature=0.5, logprobs=3),
        dict(temperature=0.0, n=2, repetition_penalty=1.1),
        dict(temperature=1.0, prompt_logprobs=2),
    ]
    for i in range(8):
        prompt = rng.integers(3, 100, rng.integers(1, 40)).tolist()
        add_request(sim, i, prompt, int(rng.integers(1, 20)), rng, **options[i % 3])
    sim.run()
    assert sim.packed > 20 and sim.sched.num_preemptions > 0


def test_step_batch_packs_beam_rows_bound_in_the_commit():
    """A beam prefill asks for each beam's candidates (num_candidates: 2 * width, or width +
    the stop ids); a beam decode step takes whole page tables after the append, since the
    commit binds its rows to beams (forked meanwhile); a row left without a beam is dead."""
    bm = BlockManager(16, PS)
    bm.admit("other", list(range(8)))  # pages 0 and 1: the beams' tables read no zeros
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    stops = frozenset(range(90, 98))
    params = SamplingParams(beam_width=3, temperature=0.0, max_tokens=6)
    beams = SequenceGroup("b", [Sequence(0, [3, 4, 5, 6, 7], 5, 11)], 3, atomic=True)
    beams.request = types.SimpleNamespace(
        params=params, stop_ids=stops, bias=None, banned=None, prompt_logprobs_missing=0,
        guide=None,
    )  # fmt: skip
    sched.add(beams)
    plan = sched.schedule()
    batch = StepBatch(plan, EXACT, PS, TINY.vocab_size, bm)
    sched.commit(plan)
    assert batch.finish(plan)[1:] == (16, 0)  # 3 + 8 candidates, rounded up to the bucket
    parent = beams.seqs[0]
    parent.pending -= 1
    parent.token_ids.append(8)
    plan = sched.schedule()
    batch = StepBatch(plan, EXACT, PS, TINY.vocab_size, bm)
    child = Sequence(1, list(parent.token_ids), 5, 11, 1)
    sched.fork(beams, parent, child)  # the selection, between schedule() and commit()
    sched.commit(plan)
    inp, k, _ = batch.finish(plan)
    assert [r.seq for r in plan.rows] == [parent, child, None] and k == 16
    tables = bm.page_tables([0, 1])
    assert (tables > 0).all()
    assert len(plan.copies) == 1 and tables[0, 1] != tables[1, 1]  # page 1 copied on write
    np.testing.assert_array_equal(inp.page_table[:2, : tables.shape[1]], tables)
    np.testing.assert_array_equal(inp.positions[:3], [5, 5, 0])
    np.testing.assert_array_equal(inp.slot_mapping[:3], [*(tables[:, 1] * PS + 1), -1])
    np.testing.assert_array_equal(inp.context_lens[:2], [6, 6])
