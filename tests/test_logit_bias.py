"""logit_bias, min_tokens and allowed_token_ids against dense logits biased in numpy.

The sampler's `apply_bias` against numpy; then `decode.generate` and the engine
(synchronous and asynchronous steps, chunked prefill) against dense no-cache greedy
decoding of logits with the bias added and, before `min_tokens` new tokens, every stop
token banned; allowed_token_ids against the dense logits masked outside the allowed
tokens, decoded greedily or by the sampler.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
import pytest
from engine_helpers import dense_rows

from pagedjax import decode, sampling, step_input
from pagedjax.config import PRESETS, CacheConfig
from pagedjax.engine import LLM, SamplingParams

TINY = PRESETS["tiny"]  # float32, vocab 256, EOS 2
GEOMETRY = dict(page_size=8, num_pages=64, backend="xla", max_num_seqs=8)


def test_apply_bias_matches_numpy():
    rng = np.random.default_rng(0)
    b, v, k = 5, 40, 8
    logits = rng.normal(size=(b, v)).astype(np.float32)
    ids = np.full((b, k), -1, np.int32)
    values = np.zeros((b, k), np.float32)
    want = logits.astype(np.float64).copy()
    for i in range(b):
        n = int(rng.integers(0, k + 1))
        ids[i, :n] = rng.choice(v, n, replace=False)
        values[i, :n] = rng.normal(size=n) * 5
        if n:
            values[i, 0] = -np.inf
        want[i, ids[i, :n]] += values[i, :n]
    got = jax.jit(sampling.apply_bias)(jnp.asarray(logits), sampling.LogitBias(ids, values))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert np.isneginf(np.asarray(got)).sum() == sum((ids[i] >= 0).any() for i in range(b))


def test_apply_bias_with_conditions_and_allowed_tokens_matches_numpy():
    """Entries that apply only after a given last token (bad words), repeated ids (their
    values add up), and rows that may draw only their allowed tokens."""
    rng = np.random.default_rng(1)
    b, v, k, a = 6, 40, 8, 8
    logits = rng.normal(size=(b, v)).astype(np.float32)
    ids = rng.integers(-1, v, (b, k)).astype(np.int32)
    ids[:, :2] = 5  # a repeated id
    values = rng.normal(size=(b, k)).astype(np.float32) * 5
    values[:, 3] = -np.inf
    last = rng.integers(0, 4, b).astype(np.int32)
    after = rng.integers(-1, 4, (b, k)).astype(np.int32)
    allowed = np.full((b, a), -1, np.int32)
    for i in (1, 3, 4):
        allowed[i, : i + 1] = rng.choice(v, i + 1, replace=False)
    allowed[4, 2] = allowed[4, 0]  # a repeated allowed id
    want = logits.astype(np.float64).copy()
    for i in range(b):
        for j in range(k):
            if ids[i, j] >= 0 and after[i, j] in (-1, last[i]):
                want[i, ids[i, j]] += values[i, j]
        if (allowed[i] >= 0).any():
            out = np.ones(v, bool)
            out[allowed[i][allowed[i] >= 0]] = False
            want[i, out] = -np.inf
    bias = sampling.LogitBias(ids, values, after, allowed)
    got = np.asarray(jax.jit(sampling.apply_bias)(jnp.asarray(logits), bias, last))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    holds, fails = after == last[:, None], (after >= 0) & (after != last[:, None])
    assert (holds & (ids >= 0)).any() and (fails & (ids >= 0)).any()  # both kinds tested
    with pytest.raises(ValueError, match="needs the rows' last_ids"):
        sampling.apply_bias(jnp.asarray(logits), bias)


def test_apply_bias_with_a_bitmask_matches_numpy():
    """Structured outputs' bitmasks (bit t % 32 of word t // 32), alone and with allowed
    tokens: a row draws only what both allow; a row of all ones is unchanged. Packed by
    `pack_bias` beside rows without a mask."""
    rng = np.random.default_rng(2)
    b, v = 5, 70  # 3 words, the last one partly past the vocabulary
    logits = rng.normal(size=(b, v)).astype(np.float32)
    keep = rng.random((b, v)) < 0.4
    allowed = rng.choice(v, 12, replace=False).astype(np.int32)
    rows = []
    for i in (0, 2, 3):  # row 1: allowed tokens only; row 4: nothing
        bits = np.zeros(96, np.uint8)
        bits[:v] = keep[i]
        mask = np.packbits(bits, bitorder="little").view(np.uint32)
        rows.append((i, np.zeros(0, np.int32), np.zeros(0, np.float32), None, None, mask))
    rows[1] = (*rows[1][:4], allowed, rows[1][5])  # row 2: both
    rows.insert(1, (1, np.zeros(0, np.int32), np.zeros(0, np.float32), None, allowed, None))
    bias = step_input.pack_bias(rows, b)
    assert bias.mask.shape == (b, 3) and (bias.mask[[1, 4]] == 0xFFFFFFFF).all()
    want = logits.astype(np.float64).copy()
    only = np.zeros(v, bool)
    only[allowed] = True
    for i, ok in ((0, keep[0]), (1, only), (2, keep[2] & only), (3, keep[3])):
        want[i, ~ok] = -np.inf
    got = np.asarray(jax.jit(sampling.apply_bias)(jnp.asarray(logits), bias))
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(min_tokens=-1), "min_tokens=-1"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens=20, max_tokens=10"),
        (dict(min_tokens=True), "min_tokens=True"),
        (dict(logit_bias={3: 150.0}), r"logit_bias\[3\]=150.0"),
        (dict(logit_bias={3: float("nan")}), r"logit_bias\[3\]=nan"),
        (dict(logit_bias={-1: 1.0}), "got -1"),
        (dict(logit_bias={"7": 1.0}), "got '7'"),
        (dict(logit_bias=[(3, 1.0)]), "must be a mapping"),
        (dict(beam_width=2, min_tokens=2), "not supported with beam search"),
        (dict(beam_width=2, logit_bias={1: 1.0}), "not supported with beam search"),
        (dict(allowed_token_ids=[]), r"non-empty list of token ids.*allowed_token_ids=\[\]"),
        (dict(allowed_token_ids=[3, -2]), r"got -2 in allowed_token_ids=\[3, -2\]"),
        (dict(allowed_token_ids=[3, 4.0]), r"got 4.0 in allowed_token_ids"),
        (dict(allowed_token_ids=["3"]), r"got '3' in allowed_token_ids"),
        (dict(allowed_token_ids=5), "allowed_token_ids=5"),
        (dict(beam_width=2, allowed_token_ids=[3]), r"beam search, got allowed_token_ids=\(3,\)"),
    ],
)
def test_bad_params_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_build_step_input_checks_the_bias():
    cache_cfg = CacheConfig(page_size=8, num_pages=8, dtype=TINY.dtype)
    ok = decode.SeqChunk([5, 6], 0, [1], logit_bias={7: 2.0, 9: float("-inf")})
    inp = decode.build_step_input([ok, decode.SeqChunk([5], 0, [2])], TINY, cache_cfg)
    assert inp.logit_bias.ids[0, :3].tolist() == [7, 9, -1] and inp.logit_bias.ids.shape == (8, 8)
    assert (inp.logit_bias.ids[1] == -1).all()
    assert (
        decode.build_step_input([decode.SeqChunk([5], 0, [2])], TINY, cache_cfg).logit_bias is None
    )
    for bias, match in (
        ({256: 1.0}, "token id 256 is outside"),
        ({3: np.nan}, "got nan"),
        ({3: np.inf}, "got inf"),  # a bias is finite, or -inf (a ban)
    ):
        with pytest.raises(ValueError, match=match):
            decode.build_step_input(
                [decode.SeqChunk([5], 0, [1], logit_bias=bias)], TINY, cache_cfg
            )


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


@pytest.fixture(scope="module")
def dense(params):
    return dense_rows(params)


def dense_greedy(dense, prompts, max_tokens, biases, min_tokens, stops):
    """Greedy continuations of dense logits with each prompt's bias added and, before
    min_tokens[i] new tokens, its stop tokens banned."""
    outs = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        rows = dense([prompts[i] + outs[i] for i in active])
        for i, row in zip(list(active), rows, strict=True):
            row = row.copy()
            for t, value in biases[i].items():
                row[t] += value
            if len(outs[i]) < min_tokens[i]:
                row[list(stops[i])] = -np.inf
            tok = int(np.argmax(row))
            outs[i].append(tok)
            if tok in stops[i] or len(outs[i]) >= max_tokens:
                active.remove(i)
    return outs


def prompts_(seed=4, lens=(3, 9, 17, 24)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lens]


def cases(dense, prompts):
    """Per prompt: a stop token greedy decoding draws early (so min_tokens matters), a
    bias that changes the output, and min_tokens."""
    plain = dense_greedy(dense, prompts, 6, [{}] * 4, [0] * 4, [()] * 4)
    stops = [{p[1]} for p in plain]  # the plain run would stop at its second token
    biases = [{}, {int(plain[1][0]): -100.0}, {7: 8.0, 11: 3.0}, {int(plain[3][2]): -5.0}]
    return stops, biases, [4, 0, 3, 5]


def test_decode_generate_bias_and_min_tokens_equal_dense(params, dense):
    prompts = prompts_()
    stops, biases, mins = cases(dense, prompts)
    for i, p in enumerate(prompts):  # one setting per call (generate shares them)
        out = decode.generate(
            params,
            [p],
            max_new_tokens=8,
            prefill_chunk=5,
            logit_bias=biases[i],
            min_tokens=mins[i],
            stop_token_ids=stops[i],
        )
        assert out.tokens == dense_greedy(dense, [p], 8, [biases[i]], [mins[i]], [stops[i]])
    with pytest.raises(ValueError, match="min_tokens=-2"):
        decode.generate(params, prompts, max_new_tokens=4, min_tokens=-2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_bias_and_min_tokens_equal_dense(params, dense, async_scheduling):
    llm = LLM(params, max_num_batched_tokens=11, async_scheduling=async_scheduling, **GEOMETRY)
    prompts = prompts_()
    stops, biases, mins = cases(dense, prompts)
    sps = [
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            stop_token_ids=tuple(stops[i]),
            logit_bias=biases[i] or None,
            min_tokens=mins[i],
            logprobs=0,
        )
        for i in range(4)
    ]
    outs = llm.generate(prompts, sps)
    want = dense_greedy(dense, prompts, 8, biases, mins, stops)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [len(w) for w in want][::3] != [2, 2]  # min_tokens kept them from stopping early
    assert all(len(w) >= m for w, m in zip(want, mins, strict=True))
    # Raw logprobs: the bias changes the choice, not the reported distribution.
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(dense([prompts[2]]))))[0]
    entry = outs[2].outputs[0].logprobs[0]
    assert want[2][0] in (7, 11) and raw.argmax() != want[2][0]  # the bias chose it
    np.testing.assert_allclose(entry[want[2][0]], raw[want[2][0]], rtol=1e-5)


def dense_allowed(dense, prompts, sps, eos=2):
    """Continuations of dense logits with each request's bias added, every token outside
    its allowed_token_ids at -inf and, before min_tokens, EOS too; greedy, or drawn by
    the sampler with the request's seed."""
    sample = jax.jit(sampling.sample)
    outs = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        rows = dense([prompts[i] + outs[i] for i in active])
        for i, row in zip(list(active), rows, strict=True):
            sp, row = sps[i], row.copy()
            for t, value in (sp.logit_bias or {}).items():
                row[t] += value
            keep = np.zeros(row.size, bool)
            keep[list(sp.allowed_token_ids)] = True
            row[~keep] = -np.inf
            if len(outs[i]) < sp.min_tokens:
                row[eos] = -np.inf
            tok = int(np.argmax(row))
            if sp.temperature > 0:
                drawn, _ = sample(
                    jnp.asarray(row[None], jnp.float32),
                    jnp.full(1, sp.temperature, jnp.float32),
                    jnp.zeros(1, jnp.int32),
                    jnp.ones(1, jnp.float32),
                    jnp.asarray([sp.seed], jnp.uint32),
                    jnp.asarray([len(outs[i])], jnp.int32),
                )
                tok = int(drawn[0])
            outs[i].append(tok)
            if tok == eos or len(outs[i]) >= sp.max_tokens:
                active.remove(i)
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_allowed_token_ids_equal_masked_dense(params, dense, async_scheduling):
    """Greedy and seeded rows draw only their allowed tokens, as the masked dense logits
    decide: an EOS that the bias makes the likeliest but is not allowed never ends a
    row, one allowed token is forced, and min_tokens defers an allowed EOS."""
    llm = LLM(params, max_num_batched_tokens=11, async_scheduling=async_scheduling, **GEOMETRY)
    prompts = prompts_()
    rng = np.random.default_rng(1)
    pick = [rng.choice(np.arange(3, 256), n, replace=False).tolist() for n in (6, 20, 3)]
    eos = {2: 100.0}
    sps = [
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias=eos, allowed_token_ids=pick[0]),
        SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[77]),
        SamplingParams(temperature=1.0, seed=11, max_tokens=8, allowed_token_ids=pick[1]),
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            logit_bias=eos,
            min_tokens=3,
            allowed_token_ids=[2, *pick[2]],
            logprobs=0,
        ),
    ]
    outs = [o.outputs[0] for o in llm.generate(prompts, sps)]
    want = dense_allowed(dense, prompts, sps)
    assert [c.token_ids for c in outs] == want
    for c, sp in zip(outs, sps, strict=True):
        assert set(c.token_ids) <= set(sp.allowed_token_ids)
    assert (outs[0].finish_reason, len(want[0])) == ("length", 8)  # EOS never drawn
    unmasked = dataclasses.replace(sps[0], allowed_token_ids=None)
    assert llm.generate([prompts[0]], unmasked)[0].outputs[0].token_ids == [2]
    assert want[1] == [77] * 8
    assert (outs[3].finish_reason, len(want[3]), want[3][-1]) == ("stop", 4, 2)
    assert len(set(want[2])) > 3  # sampled among the allowed tokens
    # Logprobs stay the raw distribution's.
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(dense([prompts[3]]))))[0]
    assert raw.argmax() != want[3][0]
    np.testing.assert_allclose(outs[3].logprobs[0][want[3][0]], raw[want[3][0]], rtol=1e-5)


def test_engine_checks_allowed_token_ids_against_the_model(params):
    llm = LLM(params, **GEOMETRY)
    before = decode.compile_counts()
    for sp, match in (
        (SamplingParams(allowed_token_ids=[5, 300, 256]), r"allowed_token_ids \[256, 300\] are"),
        (
            SamplingParams(allowed_token_ids=[65, 66], bad_words=["A", "B"]),
            r"allowed_token_ids=\[65, 66\] leave no token to draw: each is a bad word$",
        ),
        (
            SamplingParams(allowed_token_ids=[2, 65], bad_words=["A"], min_tokens=1),
            "before min_tokens=1, a stop token",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            llm.add_request([5, 6], sp)
    assert not llm.has_unfinished_requests() and decode.compile_counts() == before
    llm.add_request([5, 6], SamplingParams(allowed_token_ids=[2, 65], min_tokens=1))
    llm.add_request([5, 6], SamplingParams(allowed_token_ids=[2, 65], bad_words=["A"]))
    assert llm.has_unfinished_requests()


def test_engine_rejects_out_of_vocab_bias_before_queueing(params):
    llm = LLM(params, **GEOMETRY)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[300\] are outside"):
        llm.add_request([5, 6], SamplingParams(logit_bias={300: 1.0}))
    assert not llm.has_unfinished_requests()


def test_min_tokens_defers_stop_strings():
    """A stop string found before min_tokens does not end the completion."""
    llm = LLM(**GEOMETRY)  # the demo model, with its tokenizer
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = llm.generate(["def add(a, b):"], sp)[0].outputs[0]
    first = llm.tokenizer.decode(plain.token_ids[:1])
    assert first, plain.text  # a first piece to stop on
    stop = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(first,))
    early = llm.generate(["def add(a, b):"], stop)[0].outputs[0]
    assert len(early.token_ids) == 1 and early.finish_reason == "stop"
    held = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop=(first,), min_tokens=4
    )
    late = llm.generate(["def add(a, b):"], held)[0].outputs[0]
    assert len(late.token_ids) >= 4 and late.token_ids == plain.token_ids[: len(late.token_ids)]
    # The text is cut where the completion stopped, after the occurrence min_tokens kept.
    assert late.finish_reason == "stop" and late.stop_reason == first, late
    full = llm.tokenizer.decode(late.token_ids)
    assert late.text == full[: full.rindex(first)] and late.text.startswith(first)


def test_min_tokens_bans_eos_even_with_ignore_eos(params):
    """As vLLM, whose min-tokens processor bans `SamplingParams.all_stop_token_ids`, which
    holds the EOS whatever ignore_eos (`update_from_generation_config`): before min_tokens
    no EOS, then ignore_eos lets it be drawn without ending the completion."""
    llm = LLM(params, **GEOMETRY)
    sp = SamplingParams(
        temperature=0.0, max_tokens=6, min_tokens=3, ignore_eos=True, logit_bias={2: 100.0}
    )
    (out,) = llm.generate([[5, 6, 7]], sp)
    ids = out.outputs[0].token_ids
    assert 2 not in ids[:3] and ids[3:] == [2, 2, 2], ids
