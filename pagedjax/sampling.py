"""On-device sampling from logits with per-row parameters.

Each row `b` of a batch has its own temperature, top-k, top-p and PRNG key, so one
jitted step serves requests with different sampling settings:

* `temperature[b] <= 0`: greedy (argmax of the logits after bias and penalties);
* otherwise the logits are divided by the temperature; tokens less likely than
  `min_p[b]` times the most likely one are dropped (`min_p <= 0`: off); then the rest
  is truncated to the top `top_k[b]` tokens (`top_k <= 0` or `>= V`: off), then to the
  smallest set of the remaining tokens whose probability reaches `top_p[b]`
  (`top_p >= 1`: off), and a token is drawn from what is left (Gumbel-max). Ties at a
  threshold are kept.
* A NaN logit is never drawn (it counts as -inf, greedy rows included); a row with
  +inf logits draws among them only, each equally likely (greedy: the first). A -inf
  logit (a banned token) is never drawn at any temperature, a huge one (or one that
  overflowed float32 to +inf: all finite tokens equally likely) included, unless every
  token of the row is -inf: then the row draws token 0 (as vLLM's argmax does).
* The key of row `b` is `fold_in(key(seeds[b]), steps[b])`: a request's i-th token
  depends only on (its seed, i), not on which other requests share the batch.
* A logit bias (`LogitBias`, optional) is added to the logits first, greedy rows
  included: per row, a few token ids and the values added to their logits (-inf bans
  a token; the engine's `min_tokens` bans the stop tokens this way), each value
  optionally only where the row's last token (the one fed before the drawn token) is
  a given one (the engine's multi-token bad words); and optionally the only tokens a
  row may draw (allowed_token_ids: every other logit -inf).
* Penalties (`Penalties`, optional), on the logits before everything above but the
  bias, greedy rows included, with the conventions of vLLM and the OpenAI API: a token
  seen in the row's prompt or output has its logit divided by `repetition[b]` when
  positive and multiplied by it otherwise (1: off); a token generated c times loses
  `frequency[b] * c + presence[b] * (c > 0)` (0: off); a token of the prompt only, the
  repetition penalty alone.

Returned log-probabilities are those of the model's raw distribution
(`log_softmax(logits)`, temperature 1, no penalties, no truncation), which is what
beam search and cumulative logprobs need.

Against vLLM v1 (`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`,
`ops/penalties.py`, its min-p, logit-bias and min-tokens logits processors): the same
steps in the same order (allowed tokens, bad words, min_tokens and logit bias; the
penalties; greedy's argmax; the temperature; min-p, top-k, then top-p, each on what the
one before left, renormalised), the same conventions (top-k keeps the ties of the k-th
logit; top-p keeps the token at which the mass reaches p, so at least one; min-p drops
only tokens strictly less likely than min_p times the top one) and the raw logprobs of
vLLM's default `logprobs_mode="raw_logprobs"` (its processed modes are not offered).
Deliberate differences:

* Ties at the top-p threshold are all kept; vLLM keeps the ones its (unstable) sort
  happens to put first.
* A temperature in (0, 0.01) is used as given (the shift by the row's maximum keeps it
  finite); vLLM's `SamplingParams` raises it to 0.01, with a warning, so its sampler's
  greedy threshold (`_SAMPLING_EPS`, 1e-5) only ever sees 0. A positive temperature
  below float32's smallest normal (~1.2e-38) may act as 0 where denormals are flushed.
* The noise is Gumbel-max on per-(seed, step) keys: a seed draws the same tokens here
  in any batch, not the tokens vLLM's generators draw for that seed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import is_int

_NEG_INF = float("-inf")
MAX_PENALTY = 2.0  # bound on |presence| and |frequency| penalties (as in the OpenAI API)
MAX_LOGIT_BIAS = 100.0  # bound on |logit_bias| values (as in the OpenAI API)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Penalties:
    """Per-row repetition, presence and frequency penalties and the tokens they count.

    `ids[b]` lists row b's history: its first `prompt_lens[b]` entries are prompt
    tokens (they count for the repetition penalty only), the rest generated tokens
    (they count for all three), -1 is padding. Rows without penalties have
    repetition 1, presence 0, frequency 0 and may leave `ids` empty.
    """

    repetition: jax.Array  # [B] float32 (1: off)
    presence: jax.Array  # [B] float32 (0: off)
    frequency: jax.Array  # [B] float32 (0: off)
    ids: jax.Array  # [B, P] int32 prompt then generated tokens (-1: padding)
    prompt_lens: jax.Array  # [B] int32 leading prompt entries of each row of `ids`


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitBias:
    """Per-row sparse additions to the logits, and per-row allowed tokens.

    `values[b, j]` is added to token `ids[b, j]` (-1: padding; an id repeated in a row
    gets the sum), where `after[b, j]` is -1 or the row's last token (`after` None:
    everywhere). Rows of `allowed` holding an id >= 0 may draw only those tokens (-1:
    padding; a row of -1 only: any token). `mask` is a bitmask of the tokens each row
    may draw (structured outputs: bit `t % 32` of word `t // 32` for token t; a row of
    all ones: any token); a row must draw a token both allow.
    """

    ids: jax.Array  # [B, K] int32
    values: jax.Array  # [B, K] float32 (-inf bans)
    after: jax.Array | None = None  # [B, K] int32 (-1: always)
    allowed: jax.Array | None = None  # [B, A] int32
    mask: jax.Array | None = None  # [B, ceil(V / 32)] uint32


def apply_bias(logits, bias: LogitBias, last_ids=None):
    """The biased logits.

    Args:
      logits: [B, V] float.
      bias: the rows' biases.
      last_ids: [B] int32 each row's last token, which `bias.after` is compared with
        (needed when `bias.after` is given).

    Returns:
      [B, V] float32: the logits with the bias added, and -inf outside each row's
      allowed tokens.
    """
    x = logits.astype(jnp.float32)
    b, v = x.shape
    rows = jnp.arange(b)[:, None]
    values = bias.values
    if bias.after is not None:
        if last_ids is None:
            raise ValueError("a LogitBias with `after` needs the rows' last_ids")
        applies = (bias.after < 0) | (bias.after == last_ids[:, None])
        values = jnp.where(applies, values, 0.0)
    ids = jnp.where(bias.ids >= 0, bias.ids, v)  # padding scatters out of range: dropped
    x = x.at[rows, ids].add(values, mode="drop")
    if bias.allowed is not None:
        allowed = bias.allowed
        keep = (
            jnp.zeros((b, v), bool)
            .at[rows, jnp.where(allowed >= 0, allowed, v)]
            .set(True, mode="drop")
        )
        keep = keep | (allowed < 0).all(axis=1)[:, None]
        x = jnp.where(keep, x, _NEG_INF)
    if bias.mask is not None:
        t = jnp.arange(v)
        words = bias.mask[:, t // 32]  # [B, V]
        keep = (words >> (t % 32).astype(jnp.uint32)) & jnp.uint32(1)
        x = jnp.where(keep.astype(bool), x, _NEG_INF)
    return x


def apply_penalties(logits, pen: Penalties, extra_ids=None):
    """Penalised logits (see the module docstring).

    Args:
      logits: [B, V] float.
      pen: the rows' penalties and histories.
      extra_ids: [B] int32 one more generated token per row (-1: none); the engine's
        asynchronous steps pass the fed token, which the host does not know yet.

    Returns:
      [B, V] float32.
    """
    x = logits.astype(jnp.float32)
    b, v = x.shape
    ids = pen.ids
    generated = jnp.arange(ids.shape[1])[None, :] >= pen.prompt_lens[:, None]  # [B, P]
    if extra_ids is not None:
        ids = jnp.concatenate([ids, extra_ids[:, None]], axis=1)
        generated = jnp.concatenate([generated, jnp.ones((b, 1), bool)], axis=1)
    ids = jnp.where(ids >= 0, ids, v)  # padding scatters out of range: dropped
    rows = jnp.arange(b)[:, None]
    counts = (
        jnp.zeros((b, v), jnp.int32).at[rows, ids].add(generated.astype(jnp.int32), mode="drop")
    )
    seen = jnp.zeros((b, v), bool).at[rows, ids].set(True, mode="drop")
    rep = pen.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0)


def row_keys(seeds, steps):
    """Per-row PRNG keys: seeds [B] uint32/int32, steps [B] int32 -> keys [B]."""
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    steps = jnp.asarray(steps).astype(jnp.uint32)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)


def _gumbel_noise(keys, v: int):
    """Standard Gumbel noise: keys [B] -> [B, v] float32.

    `-log(E)` with `E = -log1p(-w)` exponential and `w` uniform on 32 bits: the winning
    noise sits where `w` is near 0, about 1/V, and float32 keeps `w`'s full resolution
    there (`jax.random.gumbel` draws its uniforms on a 2**-23 grid near 1, where one
    with a 150k vocabulary ties about 1% of flat draws).
    """
    bits = jax.vmap(lambda key: jax.random.bits(key, (v,), jnp.uint32))(keys)
    w = (bits.astype(jnp.float32) + 0.5) * 2.0**-32
    w = jnp.minimum(w, 1.0 - 2.0**-24)  # bits near 2**32 round up to 1 in float32
    return -jnp.log(-jnp.log1p(-w))


def apply_min_p(logits, min_p):
    """Masks tokens whose probability is below `min_p` times the row's most likely one.

    Args:
      logits: [B, V] float (already divided by the temperature).
      min_p: [B] float32 in [0, 1]; `<= 0` keeps every token.

    Returns:
      [B, V] float32: the logits, with excluded tokens set to -inf.
    """
    x = logits.astype(jnp.float32)
    # p_i / p_max = exp(x_i - x_max), so p_i < min_p * p_max <=> x_i < x_max + log(min_p).
    floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    return jnp.where((min_p[:, None] > 0) & (x < floor), _NEG_INF, x)


def apply_top_k_top_p(logits, top_k, top_p):
    """Masks tokens outside each row's top-k, then outside its top-p nucleus.

    Args:
      logits: [B, V] float (already divided by the temperature).
      top_k: [B] int32; `<= 0` or `>= V` keeps every token.
      top_p: [B] float32 in (0, 1]; `>= 1` keeps every token.

    Returns:
      [B, V] float32: the logits, with excluded tokens set to -inf.
    """
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)  # [B, V]
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k).astype(jnp.int32)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    x = jnp.where(x >= kth, x, _NEG_INF)
    desc = jnp.where(desc >= kth, desc, _NEG_INF)
    # Nucleus: keep the sorted prefix up to and including the first token at which
    # the cumulative probability reaches top_p.
    cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)  # [B, V]
    n_keep = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1) + 1, v)  # [B]
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
    pth = jnp.where(top_p[:, None] >= 1.0, _NEG_INF, pth)
    return jnp.where(x >= pth, x, _NEG_INF)


def sample(
    logits,
    temperature,
    top_k,
    top_p,
    seeds,
    steps,
    min_p=None,
    penalties=None,
    extra_ids=None,
    bias=None,
    last_ids=None,
):
    """Draws one token per row.

    Args:
      logits: [B, V] float.
      temperature: [B] float32; `<= 0` is greedy.
      top_k: [B] int32 (see `apply_top_k_top_p`).
      top_p: [B] float32.
      seeds: [B] uint32 per-request seeds.
      steps: [B] int32 index of the token being drawn within its request.
      min_p: [B] float32 in [0, 1] (see `apply_min_p`), or None: off for every row.
      penalties: `Penalties`, or None: off for every row.
      extra_ids: with penalties, [B] int32 one more generated token per row (-1: none).
      bias: `LogitBias`, or None: no bias on any row.
      last_ids: [B] int32 each row's last fed token, for `bias.after`.

    Returns:
      (tokens [B] int32, logprobs [B] float32 of those tokens under the raw logits).
    """
    raw = logits.astype(jnp.float32)
    logits = raw if bias is None else apply_bias(raw, bias, last_ids)
    if penalties is not None:
        logits = apply_penalties(logits, penalties, extra_ids)
    # argmax picks a NaN, and a neighbour's truncation (which masks it) would change the
    # row's draw: a NaN counts as -inf.
    logits = jnp.where(jnp.isnan(logits), _NEG_INF, logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_rows = temperature > 0
    # Shift each row's maximum to 0 before scaling: huge logits or tiny temperatures
    # would otherwise overflow to +inf or reach a float32 ulp that swamps the Gumbel noise.
    top = jnp.max(logits, axis=-1, keepdims=True)
    shifted = logits - jnp.where(jnp.isfinite(top), top, 0.0)
    scaled = shifted / jnp.where(sampled_rows, temperature, 1.0)[:, None]
    # -inf / T is a NaN, which would win the argmax (a banned token drawn), when T is +inf
    # (a huge temperature packed as float32) or above ~8.5e37 (XLA multiplies by 1 / T,
    # flushed to 0); a subnormal T flushed in the division alone would make the top 0 / 0.
    scaled = jnp.where(logits == _NEG_INF, _NEG_INF, jnp.where(shifted == 0, 0.0, scaled))
    # +inf logits take all the mass; the noise cannot break their tie (inf + g = inf).
    scaled = jnp.where(top == jnp.inf, jnp.where(logits == jnp.inf, 0.0, _NEG_INF), scaled)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)

    def truncate(x):
        return apply_top_k_top_p(x, top_k, top_p)

    v = logits.shape[-1]
    # Sorting [B, V] is the expensive part; skip it when no row truncates.
    needs_trunc = jnp.any(sampled_rows & (((top_k > 0) & (top_k < v)) | (top_p < 1.0)))
    scaled = jax.lax.cond(needs_trunc, truncate, lambda x: x, scaled)

    def draw(x):
        gumbel = _gumbel_noise(row_keys(seeds, steps), v)
        return jnp.argmax(x + gumbel, axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampled_rows), draw, lambda x: greedy, scaled)
    tokens = jnp.where(sampled_rows, drawn, greedy)
    logprobs = jax.nn.log_softmax(raw, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def top_logprobs(logits, k: int):
    """The k most likely tokens per row (beam search candidates, requested logprobs).

    Args:
      logits: [B, V] float.
      k: static number of candidates.

    Returns:
      (ids [B, k] int32, logprobs [B, k] float32), most likely first.
    """
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return ids.astype(jnp.int32), lp


def check_params(
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> None:
    """Host-side validation of one request's sampling parameters (ValueError if bad)."""
    t, k, p, s, m = map(_as_real, (temperature, top_k, top_p, seed, min_p))
    if t is None or not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {temperature=}")
    if not is_int(top_k) or not 0 <= k < 2**31:  # (packed as int32)
        raise ValueError(f"top_k must be an int in [0, 2**31) (0: off), got {top_k=}")
    if p is None or not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p=}")
    if not is_int(seed) or not 0 <= s < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed=}")
    if m is None or not 0 <= m <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0: off), got {min_p=}")
    check_penalties(repetition_penalty, presence_penalty, frequency_penalty)


def any_penalty(repetition: float, presence: float, frequency: float) -> bool:
    """Whether any of the three penalties is on (1, 0, 0: all off)."""
    return repetition != 1.0 or presence != 0.0 or frequency != 0.0


def _as_real(value) -> float | None:
    """`value` as a float if it is a real number (not a bool or complex), else None; an
    int too large for a float is +-inf."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_penalties(repetition: float, presence: float, frequency: float) -> None:
    """Host-side validation of penalties (ValueError naming the bad value)."""
    r = _as_real(repetition)
    if r is None or not math.isfinite(r) or r <= 0:
        raise ValueError(
            "repetition_penalty must be finite and > 0 (1: off), got "
            f"repetition_penalty={repetition!r:.80}"
        )
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        v = _as_real(value)
        if v is None or not -MAX_PENALTY <= v <= MAX_PENALTY:
            raise ValueError(
                f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}] (0: off), got "
                f"{name}={value!r:.80}"
            )
