"""Edge values of `pagedjax.sampling.sample`: extreme temperatures, banned tokens, bfloat16.

Every call has the shape [N, V] and a bias, so the jitted `sample` compiles once per
logits dtype; seeds are fixed, so the tests are deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import sampling

N, V = 128, 6
_sample = jax.jit(sampling.sample)


def _full(x, dtype):
    return jnp.asarray(np.broadcast_to(x, (N,)), dtype)


def _draw(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, banned=-1, seed0=0):
    """(tokens [N], logprobs [N]) of `sample` on `logits` ([V] tiled, or [N, V]), with
    the token `banned` ([N] or one; -1: none) biased by -inf; the parameters broadcast
    to [N] and row i has seed `seed0 + i`."""
    logits = jnp.broadcast_to(jnp.asarray(logits), (N, V))
    bias = sampling.LogitBias(
        ids=_full(banned, jnp.int32)[:, None], values=jnp.full((N, 1), -jnp.inf, jnp.float32)
    )
    tokens, lp = _sample(
        logits,
        _full(temperature, jnp.float32),
        _full(top_k, jnp.int32),
        _full(top_p, jnp.float32),
        _full(seed0 + np.arange(N), jnp.uint32),
        _full(3, jnp.int32),
        _full(min_p, jnp.float32),
        bias=bias,
    )
    return np.asarray(tokens), np.asarray(lp)


def test_huge_temperatures_never_draw_a_banned_token():
    # -inf / T was a NaN for T above ~8.5e37 (XLA multiplies by the reciprocal, which
    # flushes to 0) or T = +inf (a temperature SamplingParams accepts, such as 1e39,
    # packed as float32): the NaN won the argmax, so token 1 (a -inf logit) or token 4
    # (banned by the bias, as min_tokens bans stop tokens) was drawn every time.
    row = np.array([0.5, -np.inf, 1.0, 2.0, 0.0, 1.5], np.float32)
    temps = np.resize(np.float32([1e38, 3e38, np.inf]), N)
    # At these temperatures the finite tokens tie: each is equally likely.
    plain = np.concatenate([_draw(row, temps, banned=4, seed0=s * N)[0] for s in range(4)])
    freq = np.bincount(plain, minlength=V) / plain.size
    np.testing.assert_allclose(freq, [0.25, 0, 0.25, 0.25, 0, 0.25], atol=0.08)  # std 0.02
    for kw in (dict(top_k=2), dict(top_p=0.5), dict(min_p=0.5)):
        tokens, _ = _draw(row, temps, banned=4, **kw)
        assert not np.isin(tokens, [1, 4]).any(), kw
    # Greedy rows beside them keep their argmax.
    mixed, _ = _draw(row, np.where(np.arange(N) % 2, temps, 0.0), banned=4)
    assert (mixed[::2] == 3).all() and not np.isin(mixed, [1, 4]).any()


def test_tiny_and_subnormal_temperatures_draw_only_the_top_tokens():
    # 1e-40 is a float32 subnormal: where denormals are flushed it acts as 0 (greedy,
    # the first top token); elsewhere the tied top tokens share the draws. Either way
    # nothing else is drawn, truncating or not.
    row = np.array([1.0, 3.0, -np.inf, 3.0, 2.999, 0.0], np.float32)
    for t in (1e-6, 1e-30, 1e-40):
        for kw in (dict(), dict(top_k=1), dict(top_p=0.3), dict(min_p=0.9)):
            tokens, lp = _draw(row, t, **kw)
            assert np.isin(tokens, [1, 3]).all(), (t, kw)
            assert np.isfinite(lp).all()


def test_every_token_banned_draws_token_zero_and_one_finite_token_is_always_drawn():
    # All -inf (every token banned): token 0 in greedy and sampled rows alike, with or
    # without truncation, as vLLM's argmax over NaN probabilities does.
    logits = np.full((N, V), -np.inf, np.float32)
    logits[N // 2 :, 3] = 0.7  # the second half: token 3 alone
    temps = np.resize(np.float32([0.0, 1.0, 1e-6, 1e30]), N)
    want = np.where(np.arange(N) < N // 2, 0, 3)
    for kw in (dict(), dict(top_k=1, top_p=0.1, min_p=1.0)):
        tokens, _ = _draw(logits, temps, **kw)
        np.testing.assert_array_equal(tokens, want, err_msg=str(kw))
    # A finite token banned by the bias alone: the same.
    tokens, _ = _draw(np.where(np.arange(V) == 2, 1.0, -np.inf), temps, banned=2)
    assert (tokens == 0).all()


def test_bfloat16_logits_draw_as_their_float32_upcast():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(N, V)) * 3, jnp.bfloat16)
    up = x.astype(jnp.float32)
    for t, kw in ((0.0, dict()), (0.8, dict(top_k=3, top_p=0.9, min_p=0.05))):
        got, want = _draw(x, t, **kw), _draw(up, t, **kw)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    # bfloat16 ties are common: greedy takes the first.
    tied = jnp.asarray(np.eye(V)[1] + np.eye(V)[2], jnp.bfloat16)
    assert (_draw(tied, 0.0)[0] == 1).all()
