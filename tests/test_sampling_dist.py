"""`sampling.sample` draws from the documented distribution, row by row.

An independent float64 numpy oracle of the module docstring (bias, penalties,
temperature, min-p, top-k, top-p; ties at a threshold kept; greedy at temperature 0)
against the empirical frequencies of many seeded draws: rows of many parameter sets
shuffled into one batch, each set's counts compared by a chi-square test (bins with
an expected count under 5 pooled) and its support checked exactly; and hand-computed
distributions where the order of the truncations (vLLM's) matters. Seeds are fixed, so
the tests are deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from test_sampling_review29 import oracle_support

from pagedjax import sampling

MAX_HIST, MAX_BIAS = 12, 4


def oracle(raw, temperature, top_k, top_p, min_p, rep, presence, frequency, prompt, out, bias):
    """The distribution of one row's token, float64 [V]."""
    x = np.asarray(raw, np.float64).copy()
    for t, b in bias.items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(out):
        x[t] -= frequency * out.count(t) + presence
    v = x.size
    if temperature <= 0:
        return np.eye(v)[np.argmax(x)]
    y = x / temperature
    probs = np.exp(y - y.max())
    keep = oracle_support(x, temperature, top_k, top_p, min_p)
    q = np.where(keep, probs, 0)
    return q / q.sum()


def random_config(rng, v):
    n_prompt = int(rng.integers(0, 5))
    hist = rng.integers(0, 6, n_prompt + int(rng.integers(0, MAX_HIST - n_prompt)))
    n_bias = int(rng.integers(0, MAX_BIAS + 1))
    bias = dict(
        zip(rng.choice(v, n_bias, replace=False).tolist(), rng.normal(size=n_bias) * 3, strict=True)
    )
    if bias and rng.random() < 0.5:
        bias[next(iter(bias))] = -np.inf  # a banned token (min_tokens)
    return dict(
        raw=(rng.normal(size=v) * rng.choice([0.5, 1.0, 2.0, 4.0])).astype(np.float32),
        temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5, 3.0])),
        top_k=int(rng.choice([0, 0, 1, 2, 5, v - 1, v, v + 3])),
        top_p=float(rng.choice([1.0, 1.0, 0.95, 0.8, 0.5])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.2])),
        rep=float(rng.choice([1.0, 1.0, 0.7, 1.5])),
        presence=float(rng.choice([0.0, 0.5, -0.5])),
        frequency=float(rng.choice([0.0, 0.3, -0.3])),
        prompt=hist[:n_prompt].tolist(),
        out=hist[n_prompt:].tolist(),
        extra=int(rng.choice([-1, int(rng.integers(0, 6))])),
        bias=bias,
    )


def draw(cfgs, rows, seeds, steps):
    """Samples row i of the batch with `cfgs[rows[i]]` and (seeds[i], steps[i])."""
    b = rows.size

    def col(name, dtype):
        return jnp.asarray(np.array([cfgs[c][name] for c in rows], dtype))

    ids = np.full((b, MAX_HIST), -1, np.int32)
    bias_ids = np.full((b, MAX_BIAS), -1, np.int32)
    bias_values = np.zeros((b, MAX_BIAS), np.float32)
    for i, c in enumerate(rows):
        hist = cfgs[c]["prompt"] + cfgs[c]["out"]
        ids[i, : len(hist)] = hist
        n = len(cfgs[c]["bias"])
        bias_ids[i, :n] = list(cfgs[c]["bias"])
        bias_values[i, :n] = list(cfgs[c]["bias"].values())
    prompt_lens = jnp.asarray([len(cfgs[c]["prompt"]) for c in rows], jnp.int32)
    pen = sampling.Penalties(
        col("rep", np.float32), col("presence", np.float32), col("frequency", np.float32),
        jnp.asarray(ids), prompt_lens,
    )  # fmt: skip
    logits = np.stack([cfgs[c]["raw"] for c in rows])
    tokens, lps = jax.jit(sampling.sample)(
        jnp.asarray(logits), col("temperature", np.float32), col("top_k", np.int32),
        col("top_p", np.float32), jnp.asarray(seeds, jnp.uint32), jnp.asarray(steps, jnp.int32),
        col("min_p", np.float32), pen, col("extra", np.int32),
        sampling.LogitBias(jnp.asarray(bias_ids), jnp.asarray(bias_values)),
    )  # fmt: skip
    tokens = np.asarray(tokens)
    x = logits.astype(np.float64)
    raw_lp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    raw_lp -= x.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(lps), raw_lp[np.arange(b), tokens], atol=1e-5)
    return tokens


def check_against_oracle(v, num_cfgs, n, seed, min_pvalue):
    rng = np.random.default_rng(seed)
    cfgs = [random_config(rng, v) for _ in range(num_cfgs)]
    rows = rng.permutation(np.repeat(np.arange(num_cfgs), n))
    seeds = rng.integers(0, 2**32, rows.size, dtype=np.uint64).astype(np.uint32)
    tokens = draw(cfgs, rows, seeds, rng.integers(0, 2**31 - 1, rows.size))
    tested = 0
    for c, cfg in enumerate(cfgs):
        out = cfg["out"] + ([cfg["extra"]] if cfg["extra"] >= 0 else [])
        keys = ("temperature", "top_k", "top_p", "min_p", "rep", "presence", "frequency")
        q = oracle(cfg["raw"], *(cfg[k] for k in keys), cfg["prompt"], out, cfg["bias"])
        counts = np.bincount(tokens[rows == c], minlength=v)
        outside = np.flatnonzero((counts > 0) & (q == 0))
        assert outside.size == 0, f"set {c} ({cfg}) drew tokens {outside} of zero probability"
        expected = q * n
        big, small = expected >= 5, (expected < 5) & (q > 0)
        obs = np.append(counts[big], counts[small].sum())
        exp = np.append(expected[big], expected[small].sum())
        if (q > 0).sum() < 2:
            continue
        pvalue = stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue
        assert pvalue > min_pvalue, f"set {c} ({cfg}): chi-square p={pvalue:.2g}"
        tested += 1
    return tested


@pytest.mark.parametrize("v", [7, 23, 50])
def test_mixed_batch_matches_the_oracle(v):
    # 10 parameter sets x 4000 draws: a 0.04 shift of mass between two bins is a
    # chi-square p < 1e-5 (each p > 1e-6 here at these fixed seeds).
    assert check_against_oracle(v, 10, 4000, seed=v, min_pvalue=1e-6) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("v", [7, 13, 31, 50, 97])
def test_mixed_batch_matches_the_oracle_sweep(v, seed):
    check_against_oracle(v, 16, 6000, seed=1000 * v + seed, min_pvalue=1e-7)


def _draw_one_setting(row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, n=4000):
    logits = np.tile(np.asarray(row, np.float32), (n, 1))
    tokens, lps = jax.jit(sampling.sample)(
        jnp.asarray(logits), jnp.full(n, temperature), jnp.full(n, top_k, jnp.int32),
        jnp.full(n, top_p), jnp.arange(n, dtype=jnp.uint32), jnp.full(n, 3, jnp.int32),
        jnp.full(n, min_p),
    )  # fmt: skip
    assert np.isfinite(np.asarray(lps)).all()
    return np.bincount(np.asarray(tokens), minlength=len(row))


L2 = np.log(2.0)


@pytest.mark.parametrize(
    "row,kwargs,support",
    [
        # top-p keeps the token at which the mass reaches p (0.5 + 0.25 = 0.75).
        (np.array([3, 2, 1, 1]) * L2, dict(top_p=0.75), [1, 1, 0, 0]),
        (np.array([3, 2, 1, 1]) * L2, dict(top_p=0.5), [1, 0, 0, 0]),
        # ... and every token tied with it.
        ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.5), [1, 1, 1, 1]),
        (np.array([2, 1, 1, -3]) * L2, dict(top_p=0.6), [1, 1, 1, 0]),
        # Ties at the k-th logit are kept.
        ([3.0, 2.0, 2.0, 1.0], dict(top_k=2), [1, 1, 1, 0]),
        ([1.0, 3.0, 3.0, 2.0, 0.5], dict(top_k=1), [0, 1, 1, 0, 0]),
        # min-p keeps a token exactly min_p times as likely as the top one, after the
        # temperature.
        ([0.0, np.log(np.float32(0.5)), -1.0], dict(min_p=0.5), [1, 1, 0]),
        ([0.0, 2 * np.log(np.float32(0.5)), -1.5], dict(min_p=0.5, temperature=2.0), [1, 1, 0]),
        ([0.0, 2 * np.log(np.float32(0.5)), -1.5], dict(min_p=0.5), [1, 0, 0]),
        ([2.0, 2.0, 1.0], dict(min_p=1.0), [1, 1, 0]),
        # top_k 0 or >= V and top_p 1 are off; -inf is never drawn.
        ([0.5, -np.inf, 0.0, 1.0, -np.inf], dict(top_k=0, top_p=1.0), [1, 0, 1, 1, 0]),
        ([0.5, -np.inf, 0.0, 1.0, -np.inf], dict(top_k=5, top_p=0.999), [1, 0, 1, 1, 0]),
        ([0.5, -np.inf, 0.0, 1.0], dict(top_k=3, top_p=1.0, min_p=1e-3), [1, 0, 1, 1]),
        # A tiny temperature is greedy but for exact ties; a vocabulary of one.
        ([2.0, 2.0, 1.9999], dict(temperature=1e-6), [1, 1, 0]),
        ([0.7], dict(top_k=1, top_p=0.1, min_p=1.0), [1]),
    ],
)
def test_boundaries_and_ties(row, kwargs, support):
    counts = _draw_one_setting(row, **kwargs)
    np.testing.assert_array_equal(counts > 0, np.asarray(support, bool))
    # The kept tokens keep their relative probabilities. (Exactly at a boundary the
    # float64 oracle may round the other way, so the support is the one stated.)
    x = np.asarray(row, np.float64) / kwargs.get("temperature", 1.0)
    q = np.where(support, np.exp(x - x.max()), 0.0)
    np.testing.assert_allclose(counts / counts.sum(), q / q.sum(), atol=0.035)  # std <= 0.008


def test_seeded_draws_ignore_batch_position_size_and_neighbours():
    rng = np.random.default_rng(5)
    v = 41
    cfgs = [random_config(rng, v) for _ in range(12)]
    for c in cfgs:
        c["temperature"] = max(c["temperature"], 0.7)  # sampled rows
    # Probes 0 and 1 do not truncate: alone, their batch skips the sort that
    # truncating neighbours switch on.
    for c in cfgs[:2]:
        c.update(top_k=0, top_p=1.0, min_p=0.0)
    probe = np.arange(4)
    seeds = np.array([7, 2**32 - 1, 123456, 99], np.uint32)
    steps = np.array([0, 5, 2**31 - 2, 17], np.int32)
    alone = [draw(cfgs, probe[[i]], seeds[[i]], steps[[i]])[0] for i in probe]
    for b in (5, 37):
        rows = rng.integers(4, len(cfgs), b)
        where = rng.choice(b, probe.size, replace=False)
        rows[where] = probe
        batch_seeds = rng.integers(0, 2**32, b, dtype=np.uint64).astype(np.uint32)
        batch_steps = rng.integers(0, 100, b)
        batch_seeds[where], batch_steps[where] = seeds, steps
        got = draw(cfgs, rows, batch_seeds, batch_steps)[where]
        np.testing.assert_array_equal(got, alone, err_msg=f"batch of {b}")
    # The test can fail: other steps draw other tokens.
    others = draw(cfgs, np.zeros(37, int), np.full(37, seeds[0]), np.arange(37))
    assert len(set(others.tolist())) > 1


LP = np.log(np.array([0.4, 0.3, 0.2, 0.1]))  # one row's logits: those probabilities at T=1


@pytest.mark.parametrize(
    "kwargs,want",
    [
        # min-p, then top-p on what min-p kept, renormalised (4/9 + 3/9 reaches 0.75);
        # top-p first would keep 0.4 + 0.3 + 0.2.
        (dict(min_p=0.3, top_p=0.75), [4, 3, 0, 0]),
        # top-k, then top-p on the top k renormalised; the other order keeps three.
        (dict(top_k=3, top_p=0.75), [4, 3, 0, 0]),
        # The temperature first: at T=2 the probabilities are ~ sqrt(p) (0.325, 0.282,
        # 0.230, 0.163), top-p 0.65 needs three and min-p 0.6 keeps three (> 0.6 * 0.632);
        # at T=1 both would keep two.
        (dict(temperature=2.0, top_p=0.65), np.sqrt([4, 3, 2, 0])),
        (dict(temperature=2.0, min_p=0.6), np.sqrt([4, 3, 2, 0])),
        # All three at T=0.5 (~ p**2: 16, 9, 4, 1): min-p 0.05 keeps all (1/16 > 0.05),
        # top-k 3 drops the last, top-p 0.8 on (16, 9, 4) / 29 stops at the second.
        (dict(temperature=0.5, min_p=0.05, top_k=3, top_p=0.8), [16, 9, 0, 0]),
        # ... and min-p 0.1 drops the last first (1/16 < 0.1): top-k 3 then drops none.
        (dict(temperature=0.5, min_p=0.1, top_k=3, top_p=0.9), [16, 9, 4, 0]),
        # top-k 2 and top-p 0.99 on the two kept: the two, in proportion.
        (dict(top_k=2, top_p=0.99, min_p=0.01), [4, 3, 0, 0]),
    ],
)
def test_truncations_apply_in_vllms_order(kwargs, want):
    """Temperature, then min-p, then top-k, then top-p, each on the distribution the one
    before left (renormalised), as vLLM v1's `Sampler.sample`: hand-computed supports and
    probabilities, most where another order would keep other tokens."""
    counts = _draw_one_setting(LP, n=6000, **kwargs)
    want = np.asarray(want, np.float64) / np.sum(want)
    keep = want > 0
    np.testing.assert_array_equal(counts > 0, keep)
    pvalue = stats.chisquare(counts[keep], want[keep] * counts.sum()).pvalue
    assert pvalue > 1e-6, f"{counts} against {want}: chi-square p={pvalue:.2g}"
