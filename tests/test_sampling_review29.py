"""Review 29 of sampling: the truncations' support on rows full of ties.

`test_sampling_dist` checks the support of normal (nearly tie-free) logits; here the
logits are quantised (many ties at every cutoff) with banned (-inf) tokens among them,
min_p up to 1 and top_k up to the vocabulary, and the tokens min-p, top-k and top-p
keep (ties at each threshold kept, each step on what the one before left) must be
exactly a float64 oracle's; `sample` then draws only inside that support.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import sampling


def oracle_support(raw, temperature, top_k, top_p, min_p):
    """The tokens a row may draw (float64): min-p, top-k, top-p, ties kept."""
    y = np.asarray(raw, np.float64) / temperature
    v = y.size
    probs = np.exp(y - y.max())
    probs /= probs.sum()
    keep = np.isfinite(y)
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    if 0 < top_k < v:
        keep &= y >= np.sort(np.where(keep, y, -np.inf))[::-1][top_k - 1]
    if top_p < 1:
        q = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
        desc = np.sort(q)[::-1]
        n = min(int(np.searchsorted(np.cumsum(desc), top_p, side="left")) + 1, v)
        keep &= q >= desc[n - 1]
    return keep


def tied_rows(rng, v, b):
    """b rows of quantised logits (ties everywhere), about 10% banned, and their params."""
    step = rng.choice([0.25, 0.5, 1.0], size=(b, 1))
    raw = np.round(rng.normal(size=(b, v)) * 3 / step) * step
    raw[rng.random((b, v)) < 0.1] = -np.inf
    raw[np.isneginf(raw).all(axis=1), 0] = 0.0
    temperature = rng.choice([0.3, 1.0, 2.0], size=b)
    top_k = rng.choice([0, 1, 2, 3, 10, v - 1, v], size=b)
    top_p = rng.choice([1.0, 0.99, 0.9, 0.5, 0.2], size=b)
    min_p = rng.choice([0.0, 0.01, 0.1, 0.5, 1.0], size=b)
    return raw.astype(np.float32), temperature, top_k, top_p, min_p


@pytest.mark.parametrize("v", [5, 17, 300])
def test_truncations_keep_exactly_the_oracles_support_on_tied_rows(v):
    rng = np.random.default_rng(v)
    raw, temperature, top_k, top_p, min_p = tied_rows(rng, v, 64)
    x = raw - raw.max(axis=1, keepdims=True)
    scaled = jnp.asarray(x / temperature[:, None].astype(np.float32))
    kept = sampling.apply_top_k_top_p(
        sampling.apply_min_p(scaled, jnp.asarray(min_p, jnp.float32)),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
    )
    got = np.isfinite(np.asarray(kept))
    for i in range(raw.shape[0]):
        want = oracle_support(raw[i], temperature[i], top_k[i], top_p[i], min_p[i])
        assert np.array_equal(got[i], want), (
            f"row {i} (T={temperature[i]}, top_k={top_k[i]}, top_p={top_p[i]}, "
            f"min_p={min_p[i]}): kept {np.flatnonzero(got[i])}, oracle {np.flatnonzero(want)}"
        )


def test_sample_draws_only_inside_the_support_of_tied_rows():
    v, b, draws = 17, 32, 64
    rng = np.random.default_rng(29)
    raw, temperature, top_k, top_p, min_p = tied_rows(rng, v, b)
    support = np.stack(
        [oracle_support(raw[i], temperature[i], top_k[i], top_p[i], min_p[i]) for i in range(b)]
    )
    rows = np.tile(np.arange(b), draws)
    sample = jax.jit(sampling.sample)
    tokens, _ = sample(
        jnp.asarray(raw[rows]),
        jnp.asarray(temperature[rows], jnp.float32),
        jnp.asarray(top_k[rows], jnp.int32),
        jnp.asarray(top_p[rows], jnp.float32),
        jnp.asarray(rng.integers(0, 2**32, rows.size, dtype=np.uint64).astype(np.uint32)),
        jnp.zeros(rows.size, jnp.int32),
        jnp.asarray(min_p[rows], jnp.float32),
    )
    tokens = np.asarray(tokens)
    assert support[rows, tokens].all(), np.flatnonzero(~support[rows, tokens])
    # Every row with several tied tokens at its top draws more than one of them.
    for i in range(b):
        drawn = set(tokens[rows == i].tolist())
        top = np.flatnonzero(raw[i] == raw[i].max())
        if top.size > 1 and support[i].sum() == top.size:
            assert len(drawn) > 1, (i, top, drawn)
