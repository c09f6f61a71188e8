"""FP8 KV cache: storage rounding, capacity, and every paged path against the dense model.

The dense oracle is `model.forward(..., kv_dtype=float8_e4m3fn)`: K and V rounded
through FP8 exactly as the cache stores them, so the paged paths must match it to the
float32 tolerance, while the unrounded model differs by more (the test can fail).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
import pytest

from pagedjax import cache as cache_lib
from pagedjax import decode, model, resources
from pagedjax.config import PRESETS, CacheConfig, ModelConfig, dtype_size
from pagedjax.engine import LLM, SamplingParams

TINY = PRESETS["tiny"]  # float32, vocab 256, EOS 2
FP8 = jnp.float8_e4m3fn
GEOMETRY = dict(page_size=8, num_pages=64, backend="xla", max_num_seqs=8)


def test_to_storage_clips_and_rounds():
    x = jnp.asarray([1e4, -1e4, 0.3, 447.0, 500.0, -2.5e-3, 3.0], jnp.float32)
    got = np.asarray(cache_lib.to_storage(x, FP8).astype(jnp.float32))
    assert not np.isnan(got).any()  # a plain cast of 1e4 to e4m3fn is NaN
    np.testing.assert_array_equal(got[[0, 1, 4]], [448.0, -448.0, 448.0])
    inside = np.asarray(x)[[2, 3, 5, 6]]
    np.testing.assert_array_equal(got[[2, 3, 5, 6]], inside.astype(FP8).astype(np.float32))
    assert np.abs(got[2] - 0.3) <= 0.3 * 2**-3  # e4m3: 3 mantissa bits, round to nearest
    bf16 = cache_lib.to_storage(x, jnp.bfloat16)  # other dtypes: a plain cast
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(x.astype(jnp.bfloat16)))


def test_config_names_and_sizes():
    assert CacheConfig(dtype="fp8").dtype == "float8_e4m3fn" and dtype_size("fp8") == 1
    assert CacheConfig(dtype="fp8").jnp_dtype == FP8
    with pytest.raises(ValueError, match="dtype must be one of"):
        dataclasses.replace(TINY, dtype="fp8")  # a cache dtype, not a model dtype
    with pytest.raises(ValueError, match="'int8'"):
        CacheConfig(dtype="int8")


def test_write_layer_stores_rounded_values():
    rng = np.random.default_rng(0)
    k_pages = jnp.zeros((2, 4, 8, 16), FP8)
    v_pages = jnp.zeros((2, 4, 8, 16), FP8)
    k = jnp.asarray(rng.normal(size=(3, 2, 16)) * 300, jnp.float32)  # some beyond 448
    v = jnp.asarray(rng.normal(size=(3, 2, 16)), jnp.float32)
    k_pages, v_pages = cache_lib.write_layer(k_pages, v_pages, k, v, jnp.asarray([0, 9, -1]))
    got = np.asarray(k_pages.astype(jnp.float32)).reshape(2, 32, 16)[:, [0, 9]]
    want = np.asarray(cache_lib.to_storage(k[:2], FP8).astype(jnp.float32)).transpose(1, 0, 2)
    np.testing.assert_array_equal(got, want)
    assert np.abs(np.asarray(k)).max() > 448 and not np.isnan(got).any()


def test_plan_fits_twice_the_pages_of_bf16():
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    kw = dict(kv_memory_fraction=0.5, max_num_seqs=10**6, max_model_len=4096)
    bf16 = resources.plan_num_pages(cfg, 16, **kw)
    fp8 = resources.plan_num_pages(cfg, 16, kv_dtype="float8_e4m3fn", **kw)
    assert fp8 == 2 * bf16


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


@pytest.fixture(scope="module")
def dense(params):
    fn = jax.jit(model.forward, static_argnames="kv_dtype")

    def logits(seqs, kv_dtype=FP8):
        buf = np.zeros((len(seqs), 64), np.int32)
        for j, s in enumerate(seqs):
            buf[j, : len(s)] = s
        out = np.asarray(fn(params, jnp.asarray(buf), kv_dtype=kv_dtype))
        return np.stack([out[j, len(s) - 1] for j, s in enumerate(seqs)])

    return logits


def dense_greedy(dense, prompts, max_tokens, kv_dtype=FP8):
    outs = [[] for _ in prompts]
    for _ in range(max_tokens):
        rows = dense([p + o for p, o in zip(prompts, outs, strict=True)], kv_dtype)
        for o, row in zip(outs, rows, strict=True):
            o.append(int(np.argmax(row)))
    return outs


def prompts_(seed=6, lens=(4, 11, 19, 26)):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 256, 16).tolist()
    return [(shared if n > 16 else [])[: n - 6] + rng.integers(3, 256, 6).tolist() for n in lens]


def test_decode_generate_matches_the_fp8_dense_model(params, dense):
    prompts = prompts_()
    out = decode.generate(
        params,
        prompts,
        max_new_tokens=6,
        prefill_chunk=5,
        stop_token_ids=(),
        kv_cache_dtype="fp8",
        return_logits=True,
    )
    assert out.tokens == dense_greedy(dense, prompts, 6)
    for p, toks, got in zip(prompts, out.tokens, out.logits, strict=True):
        seqs = [p + toks[:j] for j in range(len(toks))]
        want, plain = dense(seqs), dense(seqs, None)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        off = np.linalg.norm(got - plain) / np.linalg.norm(plain)
        assert err < 1e-5 and off > 1e-3, (err, off)  # FP8 rounding shows, and only it
    with pytest.raises(ValueError, match="'int4'"):
        decode.generate(params, prompts, max_new_tokens=2, kv_cache_dtype="int4")
    # "auto" is the model's dtype, as LLM reads it (it was refused as a dtype name).
    auto = decode.generate(params, prompts, max_new_tokens=2, kv_cache_dtype="auto")
    assert auto.tokens == decode.generate(params, prompts, max_new_tokens=2).tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_matches_the_fp8_dense_model(params, dense, async_scheduling):
    llm = LLM(
        params,
        kv_cache_dtype="fp8",
        max_num_batched_tokens=13,
        async_scheduling=async_scheduling,
        **GEOMETRY,
    )
    assert llm.cache.k[0].dtype == FP8 and llm.cache_config.dtype == "float8_e4m3fn"
    prompts = prompts_() * 2  # the second copy reads FP8 pages from the prefix cache
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(dense, prompts, 8)
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.metrics.kv_bytes_per_token == TINY.kv_bytes_per_token // 4  # f32 -> 1 byte


def test_engine_rejects_a_bad_kv_dtype_before_loading(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("loaded the model before checking kv_cache_dtype")

    monkeypatch.setattr("pagedjax.engine.load_model", boom)
    with pytest.raises(ValueError, match="'int8'"):
        LLM(ModelConfig(**dataclasses.asdict(TINY)), kv_cache_dtype="int8")
    monkeypatch.undo()
    f16 = dataclasses.replace(TINY, dtype="float16", num_layers=1)
    with pytest.raises(ValueError, match="needs a bfloat16 or float32 model, got float16"):
        LLM(f16, kv_cache_dtype="fp8", **GEOMETRY)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_engine_interpret_kernels_match_the_fp8_dense_model(params, dense, backend):
    """The Pallas kernels (interpret mode) read the FP8 pages like the XLA path."""
    llm = LLM(
        params,
        kv_cache_dtype="fp8",
        max_num_batched_tokens=16,
        **(GEOMETRY | dict(backend=backend, interpret=True)),
    )
    prompts = prompts_()[:2]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy(dense, prompts, 4)
