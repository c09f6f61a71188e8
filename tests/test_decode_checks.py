"""pagedjax.decode's argument checks: `generate` and the steps refuse bad arguments on the
host, by name, before anything is traced or donated (stop ids, sizes, prompts, knobs, a
cache of another model or geometry, a donated cache, a module for params, an unknown
backend), and take what is valid at the edges (a 2-D array of prompts, a prompt that
fills max_position_embeddings exactly).

The steps' numerics are tested in tests/test_decode.py, `build_step_input`'s checks in
tests/test_step_input.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import cache as cache_lib
from pagedjax import decode
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


def test_generate_checks_stop_ids_and_bans_only_drawable_ones(params):
    """A stop id past the vocabulary (an EOS of a model with a cut vocabulary) is never
    drawn: min_tokens used to fail on it as a 'logit_bias token id'. A float or negative
    stop id was truncated (1.5 banned token 1) or blamed on logit_bias."""
    kw = dict(max_new_tokens=3, backend="xla", page_size=4, min_tokens=2)
    cut = params.replace(config=dataclasses.replace(TINY, eos_token_ids=(128001,)))
    out = decode.generate(cut, [[1, 2]], **kw)
    assert out.tokens == decode.generate(params, [[1, 2]], stop_token_ids=[300], **kw).tokens
    assert len(out.tokens[0]) == 3
    # A bare id or a nested list raised a bare "'int' object is not iterable" or was
    # flattened.
    for bad in ([1.5], [-1], ["2"], "2", 5, np.int64(5), [[1, 2]]):
        with pytest.raises(ValueError, match=r"must be a list of ints >= 0, got stop_token_ids="):
            decode.generate(params, [[1, 2]], stop_token_ids=bad, **kw)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=1.5), "max_new_tokens must be an int >= 1, got max_new_tokens=1.5"),
        (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1"),
        (dict(max_new_tokens=2, page_size=0), "page_size must be a positive int, got page_size=0"),
        (dict(max_new_tokens=2, prefill_chunk=1.5), "prefill_chunk must be an int >= 1"),
        (dict(max_new_tokens=2, prefill_chunk=0), "prefill_chunk must be an int >= 1, got pre"),
    ],
)
def test_generate_rejects_bad_arguments_before_running(params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode.generate(params, [[1, 2]], **kwargs)


def test_generate_names_bad_sampling_arguments_before_running(params):
    """Prompt b samples with seed + b: a seed valid for prompt 0 failed for prompt 1 with
    "got seed=4294967296", a value never passed; seed=True ran as seed 1, temperature
    "0.8" as 0.8, top_k=2.0 as 2; logit_bias=[1, 2] was dict()'s "cannot convert dictionary update
    sequence element", buckets=None an AttributeError after the cache was allocated."""
    prompts, kw = [[1, 2], [3]], dict(max_new_tokens=2, backend="xla")
    before = decode.compile_counts()
    for bad, error, match in [
        (dict(seed=2**32 - 1), ValueError, r"seed must be an int in \[0, 2\*\*32 - 2\] .*"),
        (dict(seed=True), ValueError, "got seed=True"),
        (dict(seed=-1), ValueError, "got seed=-1"),
        (
            dict(temperature="0.8"),
            ValueError,
            "temperature must be a real number, got temperature='0.8'",
        ),
        # A whole float was taken as a count (score and SamplingParams refused it).
        (dict(top_k=2.0), ValueError, r"sequence 0: top_k must be an int, got top_k=2.0"),
        (dict(logit_bias=[1, 2]), TypeError, r"logit_bias must be a mapping .*got \[1, 2\]"),
        (dict(buckets=None), TypeError, "buckets must be a Buckets, got buckets=None"),
    ]:
        with pytest.raises(error, match=match):
            decode.generate(params, prompts, **kw, **bad)
    assert decode.compile_counts() == before
    out = decode.generate(params, prompts[:1], seed=2**32 - 1, temperature=1.0, **kw)
    assert len(out.tokens[0]) == 2  # the largest seed is fine for one prompt


def test_generate_refuses_to_run_under_jit(params, monkeypatch):
    """generate is host-driven: under jit, JAX refused only once a step had been traced
    ("__array__() was called on traced array"), or at the prompts' conversion."""
    monkeypatch.setattr(decode, "_prefill_jit", lambda *a, **k: pytest.fail("traced a step"))
    kw = dict(max_new_tokens=2, backend="xla")
    with pytest.raises(TypeError, match="generate runs on the host.*got traced params"):
        jax.jit(lambda p: decode.generate(p, [[1, 2, 3]], **kw).tokens[0])(params)
    with pytest.raises(TypeError, match="generate runs on the host.*got traced prompts"):
        jax.jit(lambda x: decode.generate(params, x, **kw).tokens[0])(jnp.ones((2, 3), int))


def test_generate_rejects_a_nested_prompt(params):
    # It used to be flattened into one prompt of the nested lists' tokens.
    with pytest.raises(ValueError, match=r"prompt 0 must be a 1-D list of token ids, got shape"):
        decode.generate(params, [[[1, 2], [3, 4]]], max_new_tokens=1)


def test_generate_rejects_bad_prompts_before_running(params):
    before = decode.compile_counts()
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=512"):
        decode.generate(params, [[1] * 510], max_new_tokens=3)
    with pytest.raises(ValueError, match="token id 300 is outside the vocabulary"):
        decode.generate(params, [[1, 2], [3, 300]], max_new_tokens=3)
    with pytest.raises(ValueError, match="prompt 1: token id 18446744073709551616 is outside"):
        decode.generate(params, [[1, 2], [3, 2**64]], max_new_tokens=3)  # was "dtype object"
    with pytest.raises(ValueError, match="non-empty"):
        decode.generate(params, [[1], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="at least one sequence"):
        decode.build_step_input([], TINY, CacheConfig(4, 8))
    assert decode.compile_counts() == before


def test_generate_takes_a_2d_array_and_names_a_flat_prompt(params):
    # A 2-D array was "The truth value of an array ... is ambiguous", a flat list of
    # ints "object of type 'int' has no len()", a Llama module "has no attribute 'config'".
    prompts = [[1, 5, 7, 9], [1, 42, 3, 4]]
    kw = dict(max_new_tokens=2, stop_token_ids=(), backend="xla")
    want = decode.generate(params, prompts, **kw).tokens
    assert decode.generate(params, np.asarray(prompts, np.int64), **kw).tokens == want
    for flat in ([1, 5, 7], np.array([1, 5, 7])):
        with pytest.raises(ValueError, match=r"prompt 0 must be a 1-D .* \(\) \(one prompt\?"):
            decode.generate(params, flat, **kw)
    with pytest.raises(ValueError, match="prompts must be a list of token id lists, got 7"):
        decode.generate(params, 7, **kw)
    with pytest.raises(TypeError, match="params must be a split model.*got Llama"):
        decode.generate(params.merge(), prompts, **kw)


def test_generate_fills_max_position_embeddings_exactly(params):
    short = params.replace(config=dataclasses.replace(TINY, max_position_embeddings=16))
    out = decode.generate(short, [[1] * 13], max_new_tokens=3, page_size=4, backend="xla")
    assert len(out.tokens[0]) == 3  # 13 + 3 = 16 positions: allowed
    with pytest.raises(ValueError, match="prompt 0 has 14 tokens; with max_new_tokens=3"):
        decode.generate(short, [[1] * 14], max_new_tokens=3, page_size=4, backend="xla")


def test_decode_step_rejects_a_prefill_batch(params):
    cache_cfg = CacheConfig(page_size=4, num_pages=8, dtype="float32")
    cache = cache_lib.create(TINY, cache_cfg)
    inp = decode.build_step_input([decode.SeqChunk([1, 2], 0, [1])], TINY, cache_cfg)
    before = decode.compile_counts()
    with pytest.raises(ValueError, match="decode=False"):
        decode.decode_step(params, cache, inp, backend="xla")
    assert decode.compile_counts() == before  # refused on the host, not in a trace


@pytest.mark.parametrize(
    "kwargs,match",
    [
        # These failed inside the trace with jax's own words ("k argument to top_k must
        # be nonnegative", "Shapes must be 1D sequences ...") or blamed target_ids.
        (dict(num_top_logprobs=-1), r"num_top_logprobs must be an int in \[0, 256\].*=-1"),
        (dict(num_top_logprobs=257), r"num_top_logprobs must be .*got num_top_logprobs=257"),
        (dict(num_top_logprobs=1.5), r"num_top_logprobs must be .*got num_top_logprobs=1.5"),
        (dict(num_top_logprobs=True), r"num_top_logprobs must be .*got num_top_logprobs=True"),
        (dict(num_prompt_top_logprobs=-1), r"num_prompt_top_logprobs must be .*=-1"),
    ],
)
def test_steps_check_their_knobs_on_the_host(params, kwargs, match):
    cache_cfg = CacheConfig(page_size=4, num_pages=8, dtype="float32")
    cache = cache_lib.create(TINY, cache_cfg)
    before = decode.compile_counts()
    for tokens in ([1, 2], [1]):
        inp = decode.build_step_input([decode.SeqChunk(tokens, 0, [1])], TINY, cache_cfg)
        with pytest.raises(ValueError, match=match):
            decode.step(params, cache, inp, backend="xla", **kwargs)
    with pytest.raises(TypeError, match="inp must be a StepInput .*, got dict"):
        decode.step(params, cache, {"decode": True}, backend="xla")
    assert decode.compile_counts() == before
    assert not cache.k[0].is_deleted()


@pytest.mark.parametrize(
    "model_changes,cache_cfg,error,match",
    [
        (
            dict(num_layers=1),
            CacheConfig(4, 8, "float32"),
            ValueError,
            r"1 K and 1 V layers; the model has 2",
        ),
        (dict(num_kv_heads=1), CacheConfig(4, 8, "float32"), ValueError, r"K=2 kv heads.*\(1, 8"),
        (dict(head_dim=8), CacheConfig(4, 8, "float32"), ValueError, r"D=16 .*got \(2, 8, 4, 8\)"),
        ({}, CacheConfig(8, 8, "float32"), ValueError, "built for page_size=4, .* page_size=8"),
        ({}, CacheConfig(4, 4, "float32"), ValueError, "built for num_pages=8, .* num_pages=4"),
        ({}, CacheConfig(4, 8, "bfloat16"), TypeError, "a bfloat16 cache for a float32 model"),
    ],
)
def test_steps_refuse_a_cache_of_another_model_or_geometry(
    params, model_changes, cache_cfg, error, match
):
    """A cache made for another model, page size or page count fails on the host, by name,
    and is not donated; before the check, a wrong page size or a short pool ran and wrote
    to the wrong slots (or past the pool)."""
    built_for = CacheConfig(page_size=4, num_pages=8, dtype="float32")
    cache = cache_lib.create(dataclasses.replace(TINY, **model_changes), cache_cfg)
    before = decode.compile_counts()
    for tokens in ([1, 2, 3], [1]):
        inp = decode.build_step_input([decode.SeqChunk(tokens, 0, [7])], TINY, built_for)
        with pytest.raises(error, match=match):
            decode.step(params, cache, inp, backend="xla")
    assert decode.compile_counts() == before
    assert not cache.k[0].is_deleted()


def test_steps_refuse_a_donated_cache_a_module_and_a_bad_backend_on_the_host(params):
    # A donated cache was XLA's "Buffer has been deleted or donated" (prefill) or, after a
    # trace, "Array has been deleted" (decode); a Llama module "has no attribute
    # 'config'"; an unknown backend was refused inside a trace.
    cc = CacheConfig(4, 8, "float32")
    cache = cache_lib.create(TINY, cc)
    first = decode.build_step_input([decode.SeqChunk([1, 2], 0, [7])], TINY, cc)
    _, new = decode.prefill_step(params, cache, first, backend="xla")
    before = decode.compile_counts()
    for tokens in ([1, 2, 3], [1]):
        inp = decode.build_step_input([decode.SeqChunk(tokens, 2, [7, 6])], TINY, cc)
        with pytest.raises(ValueError, match="donated to an earlier step"):
            decode.step(params, cache, inp, backend="xla")
        with pytest.raises(TypeError, match="params must be a split model.*got Llama"):
            decode.step(params.merge(), new, inp, backend="xla")
        with pytest.raises(ValueError, match="backend must be one of .*got backend='cuda'"):
            decode.step(params, new, inp, backend="cuda")
    assert decode.compile_counts() == before
    assert not new.k[0].is_deleted()


def test_steps_refuse_mismatched_k_and_v_pools_and_non_caches(params):
    cc = CacheConfig(4, 8, "float32")
    good = cache_lib.create(TINY, cc)
    inp = decode.build_step_input([decode.SeqChunk([1], 0, [7])], TINY, cc)
    half = cache_lib.create(dataclasses.replace(TINY, num_layers=1), cc)
    bf16 = cache_lib.create(TINY, CacheConfig(4, 8, "bfloat16"))
    wide = cache_lib.create(TINY, CacheConfig(4, 16, "float32"))
    before = decode.compile_counts()
    for cache, error, match in [
        (cache_lib.PagedKVCache(good.k, half.v), ValueError, "2 K and 1 V layers"),
        (cache_lib.PagedKVCache(good.k, bf16.v), ValueError, r"V pools .* bfloat16 differ"),
        (cache_lib.PagedKVCache(good.k, wide.v), ValueError, r"V pools \(2, 16, 4, 16\)"),
        ((good.k, good.v), TypeError, "cache must be a PagedKVCache, got tuple"),
    ]:
        with pytest.raises(error, match=match):
            decode.step(params, cache, inp, backend="xla")
    assert decode.compile_counts() == before
    assert not good.k[0].is_deleted()


def test_a_static_batch_gets_at_most_an_eighth_more_pages_than_it_needs():
    # Its page count was rounded up to a power of two: 256 prompts of 4,096 tokens (65,537
    # pages with the null page) took 131,072 pages, twice the memory they need.
    from pagedjax import static_batch

    for need in [1, 15, 16, 17, 100, 256, 257, 1025, 4097, 65537, 131072, 131073]:
        got = static_batch.round_pages(need)
        assert need <= got < max(need * 9 / 8, need + 16) and got % 16 == 0, (need, got)
    assert static_batch.round_pages(65537) == 65537 + 8191
    assert len({static_batch.round_pages(n) for n in range(1, 4097)}) == 16 + 8 * 4  # few programs
    cfg, tables = static_batch.static_pages(TINY, 3, 40, 8, None)
    assert cfg.num_pages == 16 and tables == [
        [1, 2, 3, 4, 5],
        [6, 7, 8, 9, 10],
        [11, 12, 13, 14, 15],
    ]
