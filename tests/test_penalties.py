"""Repetition, presence and frequency penalties against a numpy reference.

The sampler's `apply_penalties` against numpy on random logits and histories; then
every path that carries histories to the device (`build_step_input` through
`decode.generate`, the engine's `StepBatch` in synchronous and asynchronous steps,
where the fed token is added on the device) against dense no-cache logits penalised
in numpy and decoded greedily, or sampled by the same sampler.
"""

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
import pytest

from pagedjax import decode, sampling
from pagedjax.batch import TokenHistory
from pagedjax.config import PRESETS, CacheConfig
from pagedjax.engine import LLM, SamplingParams

TINY = PRESETS["tiny"]  # float32, vocab 256, EOS 2
GEOMETRY = dict(page_size=8, num_pages=64, backend="xla", max_num_seqs=8)
PEN = dict(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4)


def np_penalise(row, prompt, out, repetition=1.0, presence=0.0, frequency=0.0):
    """One row of logits penalised as vLLM and the OpenAI API define it."""
    return _np_penalise(row, prompt, out, repetition, presence, frequency)


def np_penalise_kw(row, prompt, out, repetition_penalty=1.0, presence_penalty=0.0,
                   frequency_penalty=0.0):  # fmt: skip
    return _np_penalise(row, prompt, out, repetition_penalty, presence_penalty, frequency_penalty)


def _np_penalise(row, prompt, out, repetition, presence, frequency):
    x = np.asarray(row, np.float64).copy()
    for t in set(prompt) | set(out):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(out):
        x[t] -= frequency * out.count(t) + presence
    return x


def test_apply_penalties_matches_numpy():
    rng = np.random.default_rng(0)
    b, v, p = 6, 50, 24
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    rep = np.array([1.0, 1.5, 0.7, 1.3, 1.0, 2.0], np.float32)
    presence = np.array([0.0, 0.5, -0.4, 0.0, 1.5, 0.3], np.float32)
    frequency = np.array([0.0, 0.3, 0.2, -0.5, 0.0, 1.1], np.float32)
    ids = np.full((b, p), -1, np.int32)
    prompt_lens = rng.integers(0, 10, b).astype(np.int32)
    extra = np.where(rng.random(b) < 0.5, rng.integers(0, v, b), -1).astype(np.int32)
    want = []
    for i in range(b):
        n_out = int(rng.integers(0, p - prompt_lens[i]))
        hist = rng.integers(0, 12, prompt_lens[i] + n_out)  # small ids: many repeats
        ids[i, : hist.size] = hist
        prompt, out = hist[: prompt_lens[i]].tolist(), hist[prompt_lens[i] :].tolist()
        out += [int(extra[i])] if extra[i] >= 0 else []
        want.append(np_penalise(logits[i], prompt, out, rep[i], presence[i], frequency[i]))
    pen = sampling.Penalties(*map(jnp.asarray, (rep, presence, frequency, ids, prompt_lens)))
    got = jax.jit(sampling.apply_penalties)(jnp.asarray(logits), pen, jnp.asarray(extra))
    np.testing.assert_allclose(np.asarray(got), np.stack(want), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(got), logits)  # the test can fail
    unchanged = jax.jit(sampling.apply_penalties)(
        jnp.asarray(logits), sampling.Penalties(*map(jnp.asarray, (rep * 0 + 1, presence * 0,
        frequency * 0, ids, prompt_lens)))
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(unchanged), logits)


def test_greedy_rows_take_the_penalised_argmax_and_logprobs_stay_raw():
    rng = np.random.default_rng(1)
    b, v = 4, 32
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    top = logits.argmax(-1)
    ids = np.full((b, 8), -1, np.int32)
    ids[:, 0] = top  # each row's favourite was generated once
    pen = sampling.Penalties(
        jnp.ones(b), jnp.full(b, 2.0), jnp.zeros(b), jnp.asarray(ids), jnp.zeros(b, jnp.int32)
    )
    zeros = jnp.zeros(b)
    tokens, lps = jax.jit(sampling.sample)(
        jnp.asarray(logits),
        zeros,
        jnp.zeros(b, jnp.int32),
        jnp.ones(b),
        jnp.zeros(b, jnp.uint32),
        jnp.zeros(b, jnp.int32),
        penalties=pen,
    )
    penalised = logits.astype(np.float64)
    penalised[np.arange(b), top] -= 2.0
    np.testing.assert_array_equal(np.asarray(tokens), penalised.argmax(-1))
    raw = jax.nn.log_softmax(jnp.asarray(logits))
    np.testing.assert_allclose(lps, np.asarray(raw)[np.arange(b), np.asarray(tokens)], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty=inf"),
        (dict(presence_penalty=2.5), "presence_penalty=2.5"),
        (dict(frequency_penalty=-3), "frequency_penalty=-3"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
        (dict(presence_penalty=True), "presence_penalty=True"),
        # ints past a float (JSON carries them): a ValueError, not numpy's TypeError
        (dict(repetition_penalty=10**400), "repetition_penalty=1000000"),
        (dict(frequency_penalty=-(10**400)), "frequency_penalty=-1000000"),
        (dict(repetition_penalty=np.complex64(1.2 + 1j)), "repetition_penalty=np.complex64"),
        (dict(presence_penalty=np.complex128(0.5)), "presence_penalty=np.complex128"),
        (dict(beam_width=2, repetition_penalty=1.2), "not supported with beam search"),
    ],
)
def test_bad_penalties_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        SamplingParams(**kwargs)
    assert len(str(err.value)) < 200  # a 400-digit value is cut


def test_numpy_real_penalties_are_accepted():
    p = SamplingParams(
        repetition_penalty=np.float32(1.25), presence_penalty=np.int8(1), frequency_penalty=-1
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.25, 1, -1)


def test_build_step_input_checks_penalty_histories():
    cache_cfg = CacheConfig(page_size=8, num_pages=8, dtype=TINY.dtype)
    ok = decode.SeqChunk([5, 6], 0, [1], repetition_penalty=1.2, prompt_ids=[5, 6])
    inp = decode.build_step_input([ok], TINY, cache_cfg)
    assert inp.penalties.ids.shape == (8, 64) and inp.penalties.ids[0, :3].tolist() == [5, 6, -1]
    plain = decode.build_step_input([decode.SeqChunk([5, 6], 0, [1])], TINY, cache_cfg)
    assert plain.penalties is None  # no penalty, no extra program input
    bad = decode.SeqChunk([5, 6], 0, [1], presence_penalty=0.5, output_ids=[7, 999])
    with pytest.raises(ValueError, match="sequence 0: output_ids holds token id 999"):
        decode.build_step_input([bad], TINY, cache_cfg)
    bad = decode.SeqChunk([5, 6], 0, [1], frequency_penalty=0.5, output_ids=[7, 256])
    with pytest.raises(ValueError, match="sequence 0: output_ids holds token id 256"):
        decode.build_step_input([bad], TINY, cache_cfg)  # id V: the scatter drops it
    bad = decode.SeqChunk([5, 6], 0, [1], repetition_penalty=-1.0)
    with pytest.raises(ValueError, match="repetition_penalty=-1.0"):
        decode.build_step_input([bad], TINY, cache_cfg)


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


@pytest.fixture(scope="module")
def dense(params):
    return params_helpers.dense_last_logits(params, dtype=np.float32)


def dense_greedy(dense, prompts, max_tokens, pens, stop_ids=(2,)):
    """Greedy continuations of dense logits penalised in numpy; pens: one dict per prompt."""
    outs = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        rows = dense([prompts[i] + outs[i] for i in active])
        for i, row in zip(list(active), rows, strict=True):
            tok = int(np.argmax(np_penalise_kw(row, prompts[i], outs[i], **pens[i])))
            outs[i].append(tok)
            if tok in stop_ids or len(outs[i]) >= max_tokens:
                active.remove(i)
    return outs


def prompts_(seed=3, lens=(5, 12, 19, 26)):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 40, size=16).tolist()  # small ids: the prompts repeat tokens
    return [(shared if n > 16 else [])[: n - 8] + rng.integers(3, 40, 8).tolist() for n in lens]


def test_decode_generate_penalised_greedy_equals_dense(params, dense):
    prompts = prompts_()
    out = decode.generate(params, prompts, max_new_tokens=10, prefill_chunk=7, **PEN)
    want = dense_greedy(dense, prompts, 10, [PEN] * len(prompts), stop_ids=(2,))
    assert out.tokens == want
    plain = decode.generate(params, prompts, max_new_tokens=10, prefill_chunk=7)
    assert plain.tokens != want  # the penalties change the outputs here


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_penalised_greedy_equals_dense(params, dense, async_scheduling):
    """Penalised and plain requests in one batch, chunked prefill and prefix-cache hits."""
    llm = LLM(
        params,
        max_num_batched_tokens=13,
        async_scheduling=async_scheduling,
        enable_prefix_caching=True,
        **GEOMETRY,
    )
    prompts = prompts_() * 2  # the second copy hits the prefix cache
    pens = [PEN, {}, dict(presence_penalty=1.5), dict(frequency_penalty=0.9)]
    pens += [dict(repetition_penalty=1.4), PEN, {}, dict(repetition_penalty=0.8)]
    sps = [SamplingParams(temperature=0.0, max_tokens=12, **p) for p in pens]
    outs = llm.generate(prompts, sps)
    want = dense_greedy(dense, prompts, 12, pens)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.num_cached_tokens for o in outs) > 0
    no_pen = dense_greedy(dense, prompts, 12, [{}] * len(prompts))
    changed = [w != n for w, n, p in zip(want, no_pen, pens, strict=True) if p]
    assert sum(changed) >= 4, changed  # the penalties matter on most rows


def test_engine_penalised_samples_match_the_sampler(params, dense):
    """n=3 samples (forked after the prompt) drawn by the sampler from penalised logits."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompt = prompts_()[2]
    sp = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=42, max_tokens=8, **PEN)
    out = llm.generate([prompt], sp)[0]
    rows, hist, seeds, steps, want = [], [], [], [], []
    for c in out.outputs:
        for j, tok in enumerate(c.token_ids):
            rows.append(prompt + c.token_ids[:j])
            hist.append((prompt, c.token_ids[:j]))
            seeds.append((sp.seed + c.index * 0x9E3779B1) % 2**32)
            steps.append(j)
            want.append(tok)
    n = len(rows)
    logits = dense(rows)
    penalised = np.stack(
        [np_penalise_kw(r, p, o, **PEN) for r, (p, o) in zip(logits, hist, strict=True)]
    )
    drawn, lps = jax.jit(sampling.sample)(
        jnp.asarray(penalised, jnp.float32),
        jnp.full(n, sp.temperature, jnp.float32),
        jnp.zeros(n, jnp.int32),
        jnp.full(n, sp.top_p, jnp.float32),
        jnp.asarray(seeds, jnp.uint32),
        jnp.asarray(steps, jnp.int32),
    )
    assert np.asarray(drawn).tolist() == want
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))[np.arange(n), want]
    bounds = np.cumsum([0] + [len(c.token_ids) for c in out.outputs[:-1]])
    np.testing.assert_allclose(
        [c.cumulative_logprob for c in out.outputs], np.add.reduceat(raw, bounds), rtol=1e-4
    )


def test_token_history_follows_appends():
    h, ids = TokenHistory(), []
    rng = np.random.default_rng(2)
    for n in (0, 1, 63, 64, 65, 200, 1000):  # across the buffer's doublings
        ids += rng.integers(0, 256, n - len(ids)).tolist()
        np.testing.assert_array_equal(h.sync(ids), ids)
    shorter = ids[:10] + [7]  # not an append: copied whole
    np.testing.assert_array_equal(h.sync(shorter), shorter)


def test_check_penalties_accepts_the_bounds():
    # [-2, 2] as in the OpenAI API, bounds included; any repetition penalty > 0.
    for rep, presence, frequency in ((1e-3, 2.0, -2.0), (100.0, -2.0, 2.0)):
        sampling.check_penalties(rep, presence, frequency)
        SamplingParams(
            repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency
        )


@pytest.mark.parametrize(
    "pen", [dict(repetition_penalty=1.5), dict(presence_penalty=0.8),
            dict(frequency_penalty=0.6), PEN],
)  # fmt: skip
def test_build_step_input_packs_each_penalty_alone(pen):
    # Each penalty alone turns the row's penalties on, and the packed history keeps the
    # prompt (repetition only) apart from the output (all three): against numpy.
    cache_cfg = CacheConfig(page_size=8, num_pages=8, dtype=TINY.dtype)
    prompt, out = [5, 6, 9, 6], [9, 7, 7, 3]
    chunks = [
        decode.SeqChunk([3], 8, [1, 2], prompt_ids=prompt, output_ids=out, **pen),
        decode.SeqChunk([4], 0, [3], prompt_ids=prompt, output_ids=out),  # no penalty
    ]
    inp = decode.build_step_input(chunks, TINY, cache_cfg)
    assert inp.penalties is not None, pen
    logits = np.random.default_rng(4).normal(size=(8, TINY.vocab_size)).astype(np.float32) * 3
    got = np.asarray(jax.jit(sampling.apply_penalties)(jnp.asarray(logits), inp.penalties))
    want = np_penalise_kw(logits[0], prompt, out, **pen)
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1:], logits[1:])
