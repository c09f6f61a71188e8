"""The steps as a researcher's own loop calls them: a StepInput changed by hand, a cache
assembled by hand, numpy flags and bfloat16 sampling scalars. Each is refused on the
host by name, before anything is traced or donated, or runs as its plain equivalent."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import cache as cache_lib
from pagedjax import decode
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]
CC = CacheConfig(page_size=4, num_pages=16, dtype="float32")


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


def _prefilled(params, prompt, pages):
    cache = cache_lib.create(TINY, CC)
    inp = decode.build_step_input([decode.SeqChunk(prompt, 0, pages)], TINY, CC)
    out, cache = decode.prefill_step(params, cache, inp, backend="xla")
    return int(out.tokens[0]), cache


@pytest.mark.parametrize(
    "name, make",
    [("token_ids", list), ("positions", list), ("temperature", list), ("seeds", tuple)],
)
def test_a_step_input_field_that_is_a_list_is_refused_by_name(params, name, make):
    """A list put into a StepInput by hand failed inside tracing ("'list' object has no
    attribute 'dtype'", "list indices must be integers"), and a tuple of seeds ran as a
    pytree of 8 scalars, in a program of its own."""
    _, cache = _prefilled(params, [1, 5, 7], [1])
    inp = decode.build_step_input([decode.SeqChunk([9], 3, [1])], TINY, CC)
    before = decode.compile_counts()
    bad = dataclasses.replace(inp, **{name: make(getattr(inp, name).tolist())})
    match = rf"StepInput\.{name} must be a numpy or jax array, got {make.__name__}"
    with pytest.raises(TypeError, match=match):
        decode.decode_step(params, cache, bad, backend="xla")
    assert decode.compile_counts() == before
    assert not cache.k[0].is_deleted()


def test_a_penalty_field_that_is_a_list_is_refused_by_name(params):
    _, cache = _prefilled(params, [1, 5, 7], [1])
    chunk = decode.SeqChunk([9], 3, [1], repetition_penalty=1.5, prompt_ids=[1, 5, 7])
    inp = decode.build_step_input([chunk], TINY, CC)
    bad = dataclasses.replace(
        inp, penalties=dataclasses.replace(inp.penalties, ids=inp.penalties.ids.tolist())
    )
    with pytest.raises(TypeError, match=r"StepInput\.penalties\.ids must be a numpy or jax"):
        decode.decode_step(params, cache, bad, backend="xla")


def test_a_numpy_bool_interpret_runs_the_pallas_kernels(params):
    """`interpret=np.True_` passed the step's check (a bool), then the GPU kernel refused
    it inside the trace ("interpret must be a bool, got interpret=np.True_") whenever
    it was the flag the program was first compiled with. (Buckets of their own, so that
    no earlier program with interpret=True answers for it.)"""
    first, cache = _prefilled(params, [1, 5, 7, 9, 11], [1, 2])
    buckets = decode.Buckets(min_seqs=4, min_pages=4, min_tokens=4)
    inp = decode.build_step_input([decode.SeqChunk([first], 5, [1, 2])], TINY, CC, buckets=buckets)
    out, cache = decode.decode_step(
        params, cache, inp, backend="gpu", interpret=np.True_, return_logits=np.True_
    )
    _, ref_cache = _prefilled(params, [1, 5, 7, 9, 11], [1, 2])
    ref, _ = decode.decode_step(params, ref_cache, inp, backend="xla", return_logits=True)
    np.testing.assert_allclose(out.logits[0], ref.logits[0], rtol=1e-5, atol=1e-5)


def test_a_cache_whose_layers_differ_is_refused(params):
    """The steps checked layer 0 alone: a layer 1 of another page count ran (its page ids
    clamped, its writes dropped: another token, without a word), one of another dtype ran
    at that precision, and one array as two pools was XLA's "Attempt to donate the same
    buffer twice", after a whole compile."""
    inp = decode.build_step_input([decode.SeqChunk([1, 5, 7, 9, 11], 0, [9, 10, 15])], TINY, CC)
    good = cache_lib.create(TINY, CC)
    small = cache_lib.create(TINY, CacheConfig(4, 8, "float32"))
    bf16 = cache_lib.create(TINY, CacheConfig(4, 16, "bfloat16"))
    z = jnp.zeros(good.k[0].shape, good.k[0].dtype)
    donated = cache_lib.create(TINY, CC)
    _, _ = decode.prefill_step(params, donated, inp, backend="xla")  # deletes its pools
    before = decode.compile_counts()
    for cache, match in [
        (cache_lib.PagedKVCache(good.k, (good.v[0], small.v[1])), r"V pools .*\(layer 1\)"),
        (cache_lib.PagedKVCache((good.k[0], small.k[1]), good.v), r"K pools .*\(layer 1\)"),
        (cache_lib.PagedKVCache((good.k[0], bf16.k[1]), good.v), r"bfloat16 .*\(layer 1\)"),
        (cache_lib.PagedKVCache((z, z), (good.v[0], good.v[1])), "layer 0 K and layer 1 K"),
        (cache_lib.PagedKVCache(good.k, (good.k[1], good.v[1])), "layer 1 K and layer 0 V"),
        (cache_lib.PagedKVCache(good.k, (good.v[0], donated.v[1])), "donated to an earlier"),
    ]:
        with pytest.raises(ValueError, match=match):
            decode.prefill_step(params, cache, inp, backend="xla")
    assert decode.compile_counts() == before
    assert not any(x.is_deleted() for x in good.k + good.v + (z,))


def test_a_context_longer_than_its_page_table_row_is_refused(params):
    """A decode loop reusing the previous step's page table (8 pages: 32 tokens) for a
    33rd token ran: the kernels' page gather clamped, and that token's keys were read
    from another page (other logits, without a word). So did a negative context and
    row offsets past the step's tokens."""
    buckets = decode.Buckets(min_pages=1, min_seqs=1, min_tokens=1)
    pages = list(range(1, 10))
    cache = cache_lib.create(TINY, CC)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 200, 33)]
    old = decode.build_step_input([decode.SeqChunk(prompt[:32], 0, pages[:8])], TINY, CC)
    _, cache = decode.prefill_step(params, cache, old, backend="xla")
    inp = decode.build_step_input(
        [decode.SeqChunk(prompt[32:], 32, pages)], TINY, CC, buckets=buckets
    )
    pre = decode.build_step_input(
        [decode.SeqChunk(prompt[:3], 0, pages)], TINY, CC, buckets=buckets, decode=False
    )
    for kind, bad, match in [
        ("decode", dict(page_table=old.page_table[:1, :8].copy()), r"context_lens\[0\] is 33"),
        ("decode", dict(context_lens=inp.context_lens - 40), r"context_lens\[0\] is -7"),
        ("prefill", dict(logits_indices=pre.logits_indices + 5), r"logits_indices\[0\] is 7"),
        ("prefill", dict(query_start_loc=pre.query_start_loc + 9), r"query_start_loc\[0\]"),
    ]:
        base = inp if kind == "decode" else pre
        with pytest.raises(ValueError, match=match):
            decode.step(params, cache, dataclasses.replace(base, **bad), backend="xla")
    assert not cache.k[0].is_deleted()
    out, _ = decode.step(params, cache, inp, backend="xla")  # the untouched input runs
    assert out.tokens.shape == (1,)


def test_bfloat16_sampling_scalars_are_real_numbers():
    """A jax bfloat16 scalar (numpy kind "V") was refused as "temperature must be a real
    number"; it packs as its float value, as a float32 one does."""
    bf = jnp.asarray(0.7, jnp.bfloat16)
    chunk = decode.SeqChunk(
        [1, 5], 0, [1], temperature=bf, repetition_penalty=jnp.asarray(1.5, jnp.bfloat16),
        logit_bias={4: jnp.asarray(-2.0, jnp.bfloat16)},
    )  # fmt: skip
    inp = decode.build_step_input([chunk], TINY, CC)
    assert inp.temperature[0] == np.float32(float(bf))
    assert inp.penalties.repetition[0] == 1.5 and inp.logit_bias.values[0, 0] == -2.0
