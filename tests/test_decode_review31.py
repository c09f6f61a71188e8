"""pagedjax.decode and static_batch as a JAX researcher calls them: review 31.

`generate`'s counts and seed in a narrow numpy int (np.uint8, np.int8: what an array of
seeds or lengths hands over) are used as the values given: their sums (prompt b's seed +
b, a prompt's length + max_new_tokens) wrapped in the numpy type, so prompt 6 of a batch
seeded np.uint8(250) sampled with seed 0, and a prompt past max_position_embeddings got
past the length check into an error naming a page count the caller never gave;
`static_pages` likewise (`scoring.score(page_size=np.int8(64))` was an OverflowError;
its prefill_chunk np.int8(100) wrapped `done[b] + chunk_len` to -56). A logit
bias whose token id is past int64 or whose value is an int past float is refused by
name (a ValueError, a huge negative value a ban like -inf), not with numpy's bare
OverflowError. A decode `StepInput` built with copy-on-write pairs and advanced on the
device as the module docstring says, its copies cleared first, equals the host loop.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params
from test_decode import _advance

from pagedjax import cache as cache_lib
from pagedjax import decode, scoring
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]
CC = CacheConfig(page_size=4, num_pages=32, dtype="float32")


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


def test_a_narrow_numpy_seed_gives_each_prompt_seed_plus_b_unwrapped(params):
    kw = dict(max_new_tokens=1, temperature=1.0, backend="xla", stop_token_ids=())
    prompts = [[3, 4]] * 8  # prompt b samples with seed + b: 250 ... 257
    want = decode.generate(params, prompts, seed=250, **kw).tokens
    with np.errstate(over="raise"):  # (an overflow in the seed's own type)
        got = decode.generate(params, prompts, seed=np.uint8(250), **kw).tokens
    assert got == want


def test_a_narrow_numpy_max_new_tokens_is_checked_against_max_position_embeddings():
    params = random_params(dataclasses.replace(TINY, max_position_embeddings=128))
    with pytest.raises(ValueError, match="max_new_tokens=100 it exceeds max_position_emb"):
        decode.generate(params, [[1] * 100], max_new_tokens=np.int8(100), backend="xla")


@pytest.mark.parametrize(
    "bias, match",
    [
        ({2**70: 1.0}, "logit_bias token id 1180591620717411303424 is outside"),
        ({np.uint64(2**64 - 1): 1.0}, "logit_bias token id 18446744073709551615 is outside"),
        (
            {3: 2**2000},
            r"values must be finite or -inf .*, got an int past float's range for token 3",
        ),
        (  # (more digits than Python's repr of an int allows)
            {4: 10**5000},
            r"values must be finite or -inf .*, got an int past float's range for token 4",
        ),
        ({5: 1e39}, r"values must be finite or -inf .*, got 1e\+39 for token 5"),
    ],
)
def test_a_logit_bias_past_int64_or_float_is_refused_by_name(params, bias, match):
    chunk = decode.SeqChunk([1, 2], 0, [1], logit_bias=bias)
    with pytest.raises(ValueError, match=match):
        decode.build_step_input([chunk], TINY, CC)
    with pytest.raises(ValueError, match=match):  # before anything runs
        decode.generate(params, [[1, 2]], max_new_tokens=1, logit_bias=bias)


def test_a_logit_bias_of_a_huge_negative_int_is_a_ban():
    def packed(value):
        chunk = decode.SeqChunk([1, 2], 0, [1], logit_bias={3: value, 5: 1})
        bias = decode.build_step_input([chunk], TINY, CC).logit_bias
        return bias.ids, bias.values

    for got, want in zip(packed(-(2**2000)), packed(float("-inf")), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_scan_from_a_fork_steps_input_with_its_copies_cleared_equals_the_host_loop(params):
    """The module docstring's scan recipe from a step that forks (copy-on-write): its
    copies run once, in that step; the StepInput advanced for the next ones carries none
    (each step applies its copy pairs, so a kept pair copied the parent's page over the
    child's at every step)."""
    parent = [5, 9, 11, 3, 7, 8]  # 6 tokens: page 2 of [1, 2] is partial
    prefill = decode.build_step_input([decode.SeqChunk(parent, 0, [1, 2, 3])], TINY, CC)
    out, cache = decode.prefill_step(params, cache_lib.create(TINY, CC), prefill, backend="xla")
    tok = int(out.tokens[0])
    tables = [[1, 2, 3], [1, 5, 6]]  # the child forks: page 2 copied to 5
    samp = dict(temperature=1.0, top_k=40)

    def step_input(toks, pos, i, copies=()):
        chunks = [
            decode.SeqChunk([t], pos, row, seed=b, sample_step=i, **samp)
            for b, (t, row) in enumerate(zip(toks, tables, strict=True))
        ]
        return decode.build_step_input(chunks, TINY, CC, copies=copies)

    fork = step_input([tok, (tok + 1) % TINY.vocab_size], 6, 1, copies=[(2, 5)])
    host, host_cache = [], jax.tree.map(jnp.copy, cache)
    inp = fork
    for i in range(1, 5):  # across the page boundary at position 8
        res, host_cache = decode.decode_step(params, host_cache, inp, backend="xla")
        host.append(np.asarray(res.tokens)[:2].tolist())
        inp = step_input(host[-1], 6 + i, i + 1)

    res, cache = decode.decode_step(params, cache, fork, backend="xla")
    first = np.asarray(res.tokens)[:2].tolist()
    assert first == host[0]
    no_copies = dataclasses.replace(fork, copy_dst=np.full_like(fork.copy_dst, -1))

    def body(carry, _):
        cache, inp = carry
        res, cache = decode.decode_step(params, cache, inp, backend="xla")
        return (cache, _advance(inp, res.tokens)), res.tokens

    start = _advance(jax.tree.map(jnp.asarray, no_copies), res.tokens)
    (cache, _), toks = jax.jit(lambda c, i: jax.lax.scan(body, (c, i), length=3))(cache, start)
    assert np.asarray(toks)[:, :2].tolist() == host[1:]
    for got, want in zip(cache.k + cache.v, host_cache.k + host_cache.v, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_scoring_takes_a_narrow_numpy_page_size(params):
    """`static_pages` (shared with `scoring.score`) computed a sequence's page count in
    the page size's numpy type: -200 // np.int8(64) was numpy's bare OverflowError."""
    seqs = [[1] * 200, [2, 3, 4]]
    want = scoring.score(params, seqs, page_size=64, backend="xla")
    got = scoring.score(params, seqs, page_size=np.int8(64), backend="xla")
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_scoring_takes_a_narrow_numpy_prefill_chunk(params):
    seqs = [[1] * 200, [2, 3, 4]]
    want = scoring.score(params, seqs, prefill_chunk=100, backend="xla")
    got = scoring.score(params, seqs, prefill_chunk=np.int8(100), backend="xla")
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
