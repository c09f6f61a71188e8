"""pagedjax.sampling against numpy on random logits, and against a port of vLLM v1's truncation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import decode, sampling
from pagedjax.config import PRESETS, CacheConfig
from pagedjax.request import SamplingParams

TINY = PRESETS["tiny"]


def _logits(b, v, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(size=(b, v)).astype(np.float32) * scale


def _np_mask(row, k, p, min_p=0.0):
    """Reference keep-mask for one row: min-p, then top-k by value, then the top-p nucleus."""
    v = row.size
    keep = np.ones(v, bool)
    if min_p > 0:
        probs = np.exp(row.astype(np.float64) - row.max())
        keep &= probs >= min_p * probs.max()
    if 0 < k < v:
        kth = np.sort(np.where(keep, row, -np.inf))[::-1][k - 1]
        keep &= row >= kth
    if p < 1:
        kept = np.where(keep, row.astype(np.float64), -np.inf)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        n = min(int(np.searchsorted(cum, p, side="left")) + 1, v)
        keep &= probs >= probs[order][n - 1]
    return keep


def _sample(logits, temperature, top_k, top_p, seeds, steps, min_p=None):
    b = logits.shape[0]
    f = jax.jit(sampling.sample)
    return f(
        jnp.asarray(logits),
        jnp.asarray(np.broadcast_to(temperature, (b,)), jnp.float32),
        jnp.asarray(np.broadcast_to(top_k, (b,)), jnp.int32),
        jnp.asarray(np.broadcast_to(top_p, (b,)), jnp.float32),
        jnp.asarray(np.broadcast_to(seeds, (b,)), jnp.uint32),
        jnp.asarray(np.broadcast_to(steps, (b,)), jnp.int32),
        None if min_p is None else jnp.asarray(np.broadcast_to(min_p, (b,)), jnp.float32),
    )


def test_greedy_is_argmax_with_raw_logprobs():
    logits = _logits(8, 101)
    tokens, lp = _sample(logits, 0.0, 0, 1.0, np.arange(8), 0)
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    x = logits.astype(np.float64)
    ref = (x - np.log(np.exp(x).sum(-1, keepdims=True)))[np.arange(8), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(lp), ref, rtol=1e-5, atol=1e-5)
    # Greedy ignores top-k/top-p and seeds.
    tokens2, _ = _sample(logits, 0.0, 3, 0.2, np.arange(8) + 7, 5)
    np.testing.assert_array_equal(np.asarray(tokens2), np.asarray(tokens))


@pytest.mark.parametrize("v", [7, 64, 1000])
def test_top_k_top_p_masks_match_numpy(v):
    rng = np.random.default_rng(v)
    b = 24
    logits = _logits(b, v, seed=v)
    ks = rng.choice([0, 1, 2, 5, v - 1, v, v + 3], size=b).astype(np.int32)
    ps = rng.choice([1.0, 0.9, 0.5, 0.1, 1e-6, 0.999], size=b).astype(np.float32)
    out = np.asarray(jax.jit(sampling.apply_top_k_top_p)(logits, ks, ps))
    for i in range(b):
        keep = _np_mask(logits[i], int(ks[i]), float(ps[i]))
        np.testing.assert_array_equal(np.isfinite(out[i]), keep, err_msg=f"row {i} k={ks[i]}")
        np.testing.assert_array_equal(out[i][keep], logits[i][keep])
        assert keep.sum() >= 1


def test_top_k_keeps_ties():
    logits = np.array([[1.0, 3.0, 3.0, 2.0, 0.5]], np.float32)
    out = np.asarray(sampling.apply_top_k_top_p(logits, np.array([1]), np.array([1.0])))
    np.testing.assert_array_equal(np.isfinite(out[0]), [False, True, True, False, False])


def test_sampled_tokens_stay_inside_the_mask():
    b, v = 64, 50
    logits = _logits(b, v, seed=3)
    ks = np.full(b, 4, np.int32)
    ps = np.full(b, 0.7, np.float32)
    tokens, _ = _sample(logits, 1.5, ks, ps, np.arange(b), 0)
    masked = np.asarray(sampling.apply_top_k_top_p(logits / 1.5, ks, ps))
    assert np.isfinite(masked[np.arange(b), np.asarray(tokens)]).all()
    k1, _ = _sample(logits, 1.0, 1, 1.0, np.arange(b), 0)  # top-k 1 is greedy
    np.testing.assert_array_equal(np.asarray(k1), logits.argmax(-1))


def test_reproducible_per_seed_and_step_and_independent_of_batch():
    v = 500
    row = _logits(1, v, seed=4, scale=0.5)
    logits = np.repeat(row, 6, axis=0)
    seeds = np.array([11, 11, 12, 11, 13, 11])
    steps = np.array([0, 0, 0, 1, 0, 0])
    a, _ = _sample(logits, 1.0, 0, 1.0, seeds, steps)
    b, _ = _sample(logits, 1.0, 0, 1.0, seeds, steps)
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(a, b)
    assert a[0] == a[1] == a[5]  # same (seed, step) in different rows
    # Near-uniform logits over 500 tokens: other seeds/steps give other draws.
    assert len({a[0], a[2], a[3], a[4]}) >= 3
    # The same request alone in a batch of one draws the same token.
    alone, _ = _sample(row, 1.0, 0, 1.0, np.array([12]), np.array([0]))
    assert int(alone[0]) == a[2]


def test_min_p_mask_matches_numpy():
    b, v = 16, 300
    logits = _logits(b, v, seed=12)
    min_p = np.linspace(0.0, 0.9, b).astype(np.float32)  # row 0: off
    got = np.isfinite(np.asarray(sampling.apply_min_p(jnp.asarray(logits), jnp.asarray(min_p))))
    for r in range(b):
        want = _np_mask(logits[r], 0, 1.0, float(min_p[r]))
        ratio = np.exp(logits[r].astype(np.float64) - logits[r].max())
        clear = np.abs(ratio - min_p[r]) > 1e-5  # away from the threshold (float32 rounding)
        np.testing.assert_array_equal(got[r][clear], want[clear])
    assert got[0].all() and got[-1].sum() < got[1].sum() < v
    # Greedy rows ignore it; min_p = 1 keeps only the most likely token; 0 is None.
    greedy, _ = _sample(logits, 0.0, 0, 1.0, np.arange(b), 0, min_p=0.99)
    one, _ = _sample(logits, 2.0, 0, 1.0, np.arange(b), 0, min_p=1.0)
    np.testing.assert_array_equal(np.asarray(greedy), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(one), logits.argmax(-1))
    off, _ = _sample(logits, 1.0, 0, 1.0, np.arange(b), 3, min_p=0.0)
    none, _ = _sample(logits, 1.0, 0, 1.0, np.arange(b), 3)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(none))


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.3),
        (1.5, 0, 0.9, 0.1),
    ],
)
def test_distribution_matches_on_a_tiny_vocab(temperature, top_k, top_p, min_p):
    base = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], np.float32)
    n = 20000
    logits = np.tile(base, (n, 1))
    seeds, steps = np.arange(n) % 97, np.arange(n)
    tokens, _ = _sample(logits, temperature, top_k, top_p, seeds, steps, min_p=min_p)
    freq = np.bincount(np.asarray(tokens), minlength=base.size) / n
    keep = _np_mask(base / temperature, top_k, top_p, min_p)
    expected = np.where(keep, np.exp(base / temperature), 0.0)
    expected /= expected.sum()
    assert freq[~keep].sum() == 0
    # 20k draws: binomial std <= 0.0036; allow ~4 sigma.
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_top_logprobs_match_numpy():
    logits = _logits(5, 40, seed=9)
    ids, lp = jax.jit(sampling.top_logprobs, static_argnums=1)(logits, 4)
    ref_lp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    order = np.argsort(-logits, axis=-1)[:, :4]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_allclose(
        np.asarray(lp), np.take_along_axis(ref_lp, order, -1), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(top_k=1.5), "top_k=1.5"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(seed=-1), "seed=-1"),
        (dict(seed=2**32), f"seed={2**32}"),
        (dict(min_p=-0.1), "min_p=-0.1"),
        (dict(min_p=1.5), "min_p=1.5"),
        # were OverflowError, numpy's TypeError or "cannot convert float NaN to integer"
        (dict(seed=float("inf")), "seed=inf"),
        (dict(seed=float("nan")), "seed=nan"),
        (dict(top_k=float("nan")), "top_k=nan"),
        (dict(top_k=float("inf")), "top_k=inf"),
        (dict(top_k=2**31), f"top_k={2**31}"),
        (dict(top_k=None), "top_k=None"),
        (dict(temperature=None), "temperature=None"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    args = dict(temperature=1.0, top_k=0, top_p=1.0, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        sampling.check_params(**args)


def test_build_step_input_names_a_non_finite_seed():
    # The step's vectorised check sends a bad chunk to check_params, which raised
    # OverflowError ("cannot convert float infinity to integer") for this one.
    cache_cfg = CacheConfig(page_size=8, num_pages=8, dtype=TINY.dtype)
    chunk = decode.SeqChunk([5], 0, [1], temperature=1.0, seed=float("inf"))
    with pytest.raises(ValueError, match="seed=inf"):
        decode.build_step_input([chunk], TINY, cache_cfg)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=True), "temperature=True"),
        (dict(top_p=True), "top_p=True"),
        (dict(seed=True), "seed=True"),
        (dict(ignore_eos="yes"), "ignore_eos='yes'"),
        (dict(ignore_eos=1), "ignore_eos=1"),
        (dict(stop_token_ids=[True]), "[True]"),
        (dict(length_penalty=True), "length_penalty=True"),
        (dict(beam_width=2, top_p=0.9), "top_p=0.9"),
        (dict(beam_width=2, top_k=5), "top_k=5"),
        (dict(beam_width=2, min_p=0.1), "min_p=0.1"),
    ],
)
def test_sampling_params_refuse_bools_and_what_beam_search_would_ignore(kwargs, match):
    # JSON's true is not a number, and beam search ranks by logprob: top-k, top-p and min-p
    # would be silently ignored.
    with pytest.raises(ValueError, match=re.escape(match)):
        SamplingParams(**kwargs)


def test_tiny_temperatures_and_huge_logits_keep_the_distribution():
    # Gumbel noise is added to logits / temperature: at the scale of huge values its
    # float32 ulp swamps the noise (ties always went to the lowest id, near-ties were
    # distorted) and two large logits could both overflow to +inf.
    n = 20000

    def freq(row, temperature, **kw):
        logits = np.tile(np.asarray(row, np.float32), (n, 1))
        tokens, lp = _sample(logits, temperature, 0, 1.0, np.arange(n), 7, **kw)
        assert np.isfinite(np.asarray(lp)).all()
        return np.bincount(np.asarray(tokens), minlength=len(row)) / n

    # 10 / 2e-38 and 20 / 2e-38 both overflow: token 0 was drawn every time.
    np.testing.assert_array_equal(freq([10.0, 20.0, 0.0], 2e-38), [0, 1, 0])
    np.testing.assert_array_equal(freq([10.0, 20.0, 0.0], 2e-38, min_p=0.5), [0, 1, 0])
    # Two tied huge logits are equally likely (was always the first).
    np.testing.assert_allclose(freq([1e30, 0.0, 1e30], 1.0), [0.5, 0, 0.5], atol=0.02)
    # Logits one and two float32 ulps apart at temperature 1e-6: probabilities
    # 0.019, 0.127, 0.854 (were drawn as 0.05, 0.24, 0.71).
    a = np.float32(20.0)
    row = np.array([a, np.nextafter(a, np.inf), np.nextafter(np.nextafter(a, np.inf), np.inf)])
    x = (row.astype(np.float64) - row.max()) / np.float64(np.float32(1e-6))
    want = np.exp(x) / np.exp(x).sum()
    np.testing.assert_allclose(freq(row, 1e-6), want, atol=0.015)  # binomial std <= 0.0036


def test_nan_logits_are_never_drawn_whatever_the_neighbours():
    # argmax picks a NaN: a NaN row drew its NaN token alone, and another token (the
    # NaN masked by the sort) beside a neighbour that truncates.
    n, v = 256, 6
    row = np.array([0.0, 1.0, np.nan, 2.0, 0.5, np.nan], np.float32)
    x = np.tile(row, (n, 1))
    seeds = np.arange(n)
    alone, _ = _sample(x, 1.0, 0, 1.0, seeds, 3)
    # Every other row a neighbour with top-p: the batch runs the truncating sort.
    mixed = x.copy()
    mixed[1::2] = np.linspace(0, 1, v)
    beside, _ = _sample(mixed, 1.0, 0, np.where(np.arange(n) % 2, 0.5, 1.0), seeds, 3)
    alone, beside = np.asarray(alone), np.asarray(beside)
    np.testing.assert_array_equal(beside[::2], alone[::2])
    counts = np.bincount(alone, minlength=v)
    assert counts[[2, 5]].sum() == 0 and (counts[[0, 1, 3, 4]] > 0).all()
    greedy, _ = _sample(x[:2], 0.0, 0, 1.0, 0, 0)
    np.testing.assert_array_equal(np.asarray(greedy), [3, 3])


def test_inf_logits_share_the_mass():
    # inf + noise is inf: the first +inf logit was drawn every time.
    n = 4000
    x = np.tile(np.array([0.0, np.inf, 5.0, np.inf], np.float32), (n, 1))
    for kw in (dict(), dict(top_p=0.5), dict(min_p=0.5)):
        tokens, _ = _sample(x, 1.0, 0, kw.get("top_p", 1.0), np.arange(n), 0, kw.get("min_p"))
        freq = np.bincount(np.asarray(tokens), minlength=4) / n
        np.testing.assert_allclose(freq, [0, 0.5, 0, 0.5], atol=0.04)  # std 0.008
    greedy, _ = _sample(x[:1], 0.0, 0, 1.0, 0, 0)
    assert int(greedy[0]) == 1


def test_gumbel_noise_resolves_the_upper_tail():
    # The winning noise over V flat tokens lies near log(V): uniforms with 2**-23
    # resolution (jax.random.gumbel) put it on a grid of ~2**23 / V values, so with a
    # 150k vocabulary ~1% of draws tied and went to the lowest token id.
    n = 1 << 22
    keys = sampling.row_keys(np.arange(64), np.zeros(64, np.int32))
    g = np.asarray(jax.jit(sampling._gumbel_noise, static_argnums=1)(keys, n // 64)).ravel()
    assert np.isfinite(g).all()
    tail = g[g > 10]
    expected = -n * np.expm1(-np.exp(-10.0))  # 190.6
    assert abs(tail.size - expected) < 5 * np.sqrt(expected)
    assert np.unique(tail).size == tail.size  # jax.random.gumbel: ~50 collisions
    from scipy import stats

    assert stats.kstest(g[::40], stats.gumbel_r.cdf).pvalue > 1e-3


@pytest.mark.parametrize("top_k", [2**31, -2, True])
def test_top_k_must_fit_the_int32_it_is_packed_in(top_k):
    # 2**31 passed and then failed inside LLM.generate (OverflowError packing int32).
    with pytest.raises(
        ValueError, match=f"top_k must be an int in \\[0, 2\\*\\*31\\).*top_k={top_k}"
    ):
        SamplingParams(top_k=top_k)
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1  # (off: >= any vocabulary)


def test_row_keys_fold_the_step_into_the_seed_key():
    # The documented key, fold_in(key(seed), step): a key of key(seed + step) would give
    # (seed 1, step 0) and (seed 0, step 1) one stream of draws.
    seeds = np.array([0, 1, 7, 2**32 - 1, 12345], np.uint32)
    steps = np.array([1, 0, 3, 2**31 - 1, 0], np.int32)
    got = jax.random.key_data(sampling.row_keys(seeds, steps))
    for i, (s, t) in enumerate(zip(seeds.tolist(), steps.tolist(), strict=True)):
        want = jax.random.key_data(jax.random.fold_in(jax.random.key(s), t))
        np.testing.assert_array_equal(got[i], want, err_msg=f"seed {s} step {t}")
    # Shifted (seed, step) pairs draw independently: 64 near-uniform draws over 500 tokens
    # agree about 0.1 times by chance.
    logits = np.tile(_logits(1, 500, seed=4, scale=0.1), (64, 1))
    a, _ = _sample(logits, 1.0, 0, 1.0, np.arange(64) + 1, np.arange(64))
    b, _ = _sample(logits, 1.0, 0, 1.0, np.arange(64), np.arange(64) + 1)
    assert (np.asarray(a) == np.asarray(b)).sum() < 4


@pytest.mark.parametrize("fill", [0, 1, 2**32 - 129, 2**32 - 1])
def test_gumbel_noise_is_finite_at_the_extreme_bits(monkeypatch, fill):
    # Bits 0 (w = 0: +inf noise) and near 2**32 (w rounds to 1: -inf noise) have to give
    # finite noise; -inf noise on a row's only finite token drew token 0 (a banned one).
    def bits(key, shape, dtype):
        return jnp.full(shape, fill, dtype)

    monkeypatch.setattr(jax.random, "bits", bits)
    g = np.asarray(sampling._gumbel_noise(sampling.row_keys(np.zeros(1), np.zeros(1)), 8))
    assert np.isfinite(g).all(), g
    w = (np.float64(fill) + 0.5) * 2.0**-32
    np.testing.assert_allclose(g, -np.log(-np.log1p(-min(w, 1 - 2**-24))), rtol=1e-3)
    x = np.array([[-np.inf, -np.inf, 0.3, -np.inf]], np.float32)
    tokens, _ = sampling.sample(
        x, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1, jnp.uint32),
        jnp.zeros(1, jnp.int32),
    )  # fmt: skip
    assert int(tokens[0]) == 2


def test_min_p_zero_keeps_every_token_however_unlikely():
    # min_p = 0 is off: log(0) must not set a floor (a clamped log(1e-30) floor dropped
    # tokens 69 below the top).
    logits = np.array([[0.0, -50.0, -100.0, -1e30], [5.0, -80.0, 4.0, 3.0]], np.float32)
    min_p = np.array([0.0, 0.0], np.float32)
    got = np.asarray(sampling.apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    np.testing.assert_array_equal(got, logits)
    for r in range(2):
        assert _np_mask(logits[r], 0, 1.0, 0.0).all()


def test_top_k_one_below_the_vocabulary_truncates_in_sample():
    # Every row at top_k = V - 1: the batch must still run the truncation (a skip test
    # of top_k < V - 1 drew the excluded token a quarter of the time here).
    n, row = 2000, np.array([0.0, 0.1, -0.1, -0.2], np.float32)
    logits = np.tile(row, (n, 1))
    tokens, _ = _sample(logits, 1.0, row.size - 1, 1.0, np.arange(n), 0)
    keep = _np_mask(row, row.size - 1, 1.0)
    counts = np.bincount(np.asarray(tokens), minlength=row.size)
    np.testing.assert_array_equal(counts > 0, keep)


def test_check_params_accepts_the_documented_bounds():
    for kw in (
        dict(temperature=0.0, top_k=0, top_p=1.0, seed=0, min_p=0.0),
        dict(temperature=1e-6, top_k=2**31 - 1, top_p=1e-9, seed=2**32 - 1, min_p=1.0),
    ):
        sampling.check_params(**kw)
        cache_cfg = CacheConfig(page_size=8, num_pages=8, dtype=TINY.dtype)
        inp = decode.build_step_input([decode.SeqChunk([5], 0, [1], **kw)], TINY, cache_cfg)
        assert inp.min_p[0] == kw["min_p"] and int(inp.seeds[0]) == kw["seed"]
    assert SamplingParams(min_p=1.0).min_p == 1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_k=2.5), "top_k=2.5"),  # would be packed as top_k 2
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(seed=-1), "seed=-1"),
        (dict(seed=2**32), f"seed={2**32}"),  # would wrap to seed 0 in uint32
        (dict(seed=1.5), "seed=1.5"),
        (dict(min_p=-0.1), "min_p=-0.1"),
        (dict(min_p=1.5), "min_p=1.5"),
        # numpy's float64 packing raised a bare OverflowError ("int too large to convert")
        (dict(seed=10**400), "seed=1000000"),
        (dict(temperature=-(10**400)), "temperature=-1000000"),
    ],
)
def test_build_step_input_rejects_each_bad_sampling_param(kwargs, match):
    cache_cfg = CacheConfig(page_size=8, num_pages=8, dtype=TINY.dtype)
    chunks = [decode.SeqChunk([5], 0, [1]), decode.SeqChunk([6], 0, [2], **kwargs)]
    with pytest.raises(ValueError, match=re.escape(match)):
        decode.build_step_input(chunks, TINY, cache_cfg)


def _vllm_keep(row, temperature, k, p, min_p):
    """Which tokens vLLM v1's sampler can draw from one row: a float64 port of its steps
    after the penalties (`Sampler.sample`: the temperature; `MinPLogitsProcessor.apply`:
    min-p on the probabilities; `apply_top_k_top_p` in ops/topk_topp_sampler.py: top-k,
    then top-p on the same ascending sort, a token dropped where the ascending cumulative
    probability is <= 1 - p, the last one always kept)."""
    x = np.asarray(row, np.float64) / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if min_p > 0:
        x = np.where(probs < min_p * probs.max(), -np.inf, x)
    v = x.size
    order = np.argsort(x, kind="stable")
    xs = x[order]
    if 0 < k < v:
        xs = np.where(xs < xs[v - k], -np.inf, xs)
    if p < 1:
        ps = np.exp(xs - xs.max())
        drop = np.cumsum(ps / ps.sum()) <= 1 - p
        drop[-1] = False
        xs = np.where(drop, -np.inf, xs)
    keep = np.empty(v, bool)
    keep[order] = np.isfinite(xs)
    return keep


def test_truncation_matches_a_port_of_vllms_sampler():
    """min-p, top-k and top-p after the temperature keep the tokens vLLM v1 keeps, and a
    draw stays among them. Random float32 logits have no ties (where the two differ on
    purpose: see the module docstring); rows within 1e-4 of a threshold (where float32
    and float64 may round apart) are skipped."""
    rng = np.random.default_rng(21)
    b, v = 512, 64
    logits = _logits(b, v, seed=21)
    temperature = rng.choice([0.3, 0.7, 1.0, 1.5, 3.0], b).astype(np.float32)
    ks = rng.choice([0, 1, 2, 5, 20, v - 1, v, v + 5], b).astype(np.int32)
    ps = rng.choice([1.0, 0.95, 0.8, 0.5, 0.2, 1e-6], b).astype(np.float32)
    min_ps = rng.choice([0.0, 0.0, 0.01, 0.1, 0.5], b).astype(np.float32)
    scaled = (logits - logits.max(-1, keepdims=True)) / temperature[:, None]  # as `sample`
    ours = jax.jit(lambda x: sampling.apply_top_k_top_p(sampling.apply_min_p(x, min_ps), ks, ps))
    got = np.isfinite(np.asarray(ours(jnp.asarray(scaled))))
    tokens, _ = _sample(logits, temperature, ks, ps, np.arange(b), 3, min_p=min_ps)
    tested = 0
    for i in range(b):
        args = logits[i], float(temperature[i]), int(ks[i])
        p, m = float(ps[i]), float(min_ps[i])
        want = _vllm_keep(*args, p, m)
        assert want[int(tokens[i])], f"row {i}: drew {int(tokens[i])} outside vLLM's support"
        nudged = [  # (1 and 0 are off: they stay off)
            _vllm_keep(*args, p + d if p < 1 else p, m + d if m > 0 else m) for d in (-1e-4, 1e-4)
        ]
        if any((n != want).any() for n in nudged):
            continue
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")
        tested += 1
    assert tested > 0.9 * b
    assert 1 < got.sum(-1).mean() < v  # the masks truncate, and not to one token only
