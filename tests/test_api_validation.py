"""Bad input to the public attention entry points: a clear error on the host, or a right answer.

Found by probing `paged_decode_attention` and `ragged_paged_attention` as a user
would: each case here either crashed deep inside JAX, or was accepted and gave a
wrong (NaN, truncated, meaningless) result. The engine's constructor (`LLM`) likewise:
a bad argument is a ValueError naming it, before a model is loaded where it can be.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
import pytest

import pallas_kernels as pk
from pagedjax import engine
from pagedjax.config import PRESETS
from pallas_kernels import reference as ref


def decode_inputs(seed=0, b=3, h=4, k=2, p=10, s=4, d=16, max_pages=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    kp = rng.standard_normal((k, p, s, d)).astype(np.float32)
    vp = rng.standard_normal((k, p, s, d)).astype(np.float32)
    table = rng.permutation(p)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    lengths = np.array([1, s, max_pages * s][:b], np.int32)
    return q, kp, vp, lengths, table


def ragged_inputs(seed=0):
    q, kp, vp, lengths, table = decode_inputs(seed)
    q = np.random.default_rng(seed + 100).standard_normal((8, 4, 16)).astype(np.float32)
    loc = np.array([0, 1, 3, 7], np.int32)  # q_lens 1, 2, 4 <= context 1, 4, 12
    return q, kp, vp, table, lengths, loc


def decode(*args, **kw):
    return pk.paged_decode_attention(*args, backend="xla", **kw)


def ragged(*args, **kw):
    return pk.ragged_paged_attention(*args, backend="xla", **kw)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_non_float_q_and_pages_are_rejected(dtype):
    q, kp, vp, lengths, table = decode_inputs()
    q, kp, vp = (x.astype(dtype) for x in (q, kp, vp))
    with pytest.raises(TypeError, match=f"q must be a floating array, got dtype {np.dtype(dtype)}"):
        decode(q, kp, vp, lengths, table)
    rq, rkp, rvp, rtable, rlens, loc = ragged_inputs()
    with pytest.raises(TypeError, match="q must be a floating array"):
        ragged(rq.astype(dtype), rkp.astype(dtype), rvp.astype(dtype), rtable, rlens, loc)


def test_one_byte_q_with_same_dtype_pages_is_rejected():
    # fp8 is for the pages (FP8_DTYPES, with a wider q); an fp8 q never is.
    q, kp, vp, lengths, table = decode_inputs()
    fp8 = jnp.float8_e4m3fnuz
    with pytest.raises(TypeError, match="q must be 16-bit or wider"):
        decode(q.astype(fp8), kp.astype(fp8), vp.astype(fp8), lengths, table)


@pytest.mark.parametrize("name", ["q", "k_pages", "lengths", "page_table"])
def test_lists_instead_of_arrays_are_a_type_error(name):
    args = dict(
        zip(["q", "k_pages", "v_pages", "lengths", "page_table"], decode_inputs(), strict=True)
    )
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=f"{name} must be an array .*, got list"):
        decode(*args.values())


def test_ragged_lists_instead_of_arrays_are_a_type_error():
    q, kp, vp, table, lengths, loc = ragged_inputs()
    with pytest.raises(TypeError, match="context_lens must be an array .*, got list"):
        ragged(q, kp, vp, table, lengths.tolist(), loc)
    with pytest.raises(TypeError, match="query_start_loc must be an array .*, got list"):
        ragged(q, kp, vp, table, lengths, loc.tolist())


def test_zero_head_dim_is_rejected():
    q, kp, vp, lengths, table = decode_inputs()
    with pytest.raises(ValueError, match="head_dim must be positive, got head_dim=0"):
        decode(q[..., :0], kp[..., :0], vp[..., :0], lengths, table)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(scale=float("inf")), ValueError, "scale must be positive and finite, got scale=inf"),
        (dict(scale=1e39), ValueError, "scale must be positive and finite"),  # inf in float32
        (dict(soft_cap=float("inf")), ValueError, "soft_cap must be positive and finite"),
        (dict(scale=True), TypeError, "scale must be a real number, got scale=True"),
        (dict(soft_cap=True), TypeError, "soft_cap must be a real number, got soft_cap=True"),
        (dict(scale="0.3"), TypeError, "scale must be a real number, got scale='0.3'"),
        (dict(scale=1j), TypeError, "scale must be a real number"),
        (dict(scale=np.array([0.1, 0.2])), TypeError, "scale must be a real number"),
        (dict(sliding_window=True), TypeError, "sliding_window must be an int"),
        (dict(sliding_window=float("nan")), ValueError, "sliding_window must be a positive int"),
        (dict(sliding_window=float("inf")), ValueError, "sliding_window must be a positive int"),
        (dict(sliding_window=2**31), ValueError, r"sliding_window must be < 2\*\*31"),
        # Python ints past numpy's 64 bits were "must be a real number" (numpy made them
        # object arrays): an int is refused for its value, as a smaller one is.
        (dict(sliding_window=10**30), ValueError, r"sliding_window must be < 2\*\*31"),
        (dict(sliding_window=-(10**30)), ValueError, "sliding_window must be a positive int"),
        (dict(scale=10**39), ValueError, "scale must be positive and finite"),
        (dict(scale=10**400), ValueError, "scale must be positive and finite"),
        (dict(soft_cap=-(10**400)), ValueError, "soft_cap must be positive and finite"),
    ],
)
def test_bad_options_are_rejected_on_the_host(kwargs, error, match):
    q, kp, vp, lengths, table = decode_inputs()
    with pytest.raises(error, match=match):
        decode(q, kp, vp, lengths, table, **kwargs)
    rq, rkp, rvp, rtable, rlens, loc = ragged_inputs()
    with pytest.raises(error, match=match):
        ragged(rq, rkp, rvp, rtable, rlens, loc, **kwargs)


@pytest.mark.parametrize(
    "kwargs,plain",
    [
        (dict(scale=np.float32(0.3)), dict(scale=0.3)),
        (dict(scale=jnp.float32(0.3)), dict(scale=0.3)),
        (dict(soft_cap=np.float64(2.0)), dict(soft_cap=2.0)),
        (dict(sliding_window=np.int64(3)), dict(sliding_window=3)),
        (dict(sliding_window=3.0), dict(sliding_window=3)),
        (dict(sliding_window=2**31 - 1), {}),
    ],
)
def test_numpy_and_jax_scalar_options_match_plain_python(kwargs, plain):
    q, kp, vp, lengths, table = decode_inputs(1)
    want = ref.paged_attention_xla(q, kp, vp, lengths, table, **plain)
    got = decode(q, kp, vp, lengths, table, **kwargs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_traced_options_under_jit_are_a_clear_type_error():
    q, kp, vp, lengths, table = decode_inputs()
    f = jax.jit(lambda q, scale: decode(q, kp, vp, lengths, table, scale=scale))
    with pytest.raises(TypeError, match="scale must be a static number, not a traced array"):
        f(q, 0.25)
    g = jax.jit(lambda q, w: decode(q, kp, vp, lengths, table, sliding_window=w))
    with pytest.raises(TypeError, match="sliding_window must be a static number"):
        g(q, 2)


def test_empty_batch_and_empty_page_table_give_zeros_on_every_path():
    q, kp, vp, lengths, table = decode_inputs(2)
    zero = np.zeros(q.shape, np.float32)
    no_pages = table[:, :0]
    no_lengths = np.zeros_like(lengths)
    for out in (
        decode(q, kp, vp, no_lengths, no_pages),
        ref.paged_attention_xla(q, kp, vp, no_lengths, no_pages),
        decode(q, kp[:, :0], vp[:, :0], no_lengths, no_pages),  # an empty pool too
    ):
        np.testing.assert_array_equal(np.asarray(out), zero)
    assert decode(q[:0], kp, vp, lengths[:0], table[:0]).shape == (0, 4, 16)

    rq, rkp, rvp, rtable, rlens, _ = ragged_inputs(2)
    rzero = np.zeros(rq.shape, np.float32)
    empty_loc = np.zeros(4, np.int32)
    for out in (
        ragged(rq, rkp, rvp, rtable[:, :0], np.zeros_like(rlens), empty_loc),
        ref.ragged_paged_attention_xla(
            rq, rkp, rvp, rtable[:, :0], np.zeros_like(rlens), empty_loc
        ),
        ragged(rq, rkp, rvp, rtable[:0], rlens[:0], empty_loc[:1]),
        ref.ragged_paged_attention_xla(rq, rkp, rvp, rtable[:0], rlens[:0], empty_loc[:1]),
    ):
        np.testing.assert_array_equal(np.asarray(out), rzero)


def test_ragged_gpu_kernel_with_an_empty_page_table_gives_zeros():
    # max_pages == 0: the GPU ragged kernel answers zeros itself (the dispatcher no longer
    # short-cuts it, so its knobs are checked: see the test below).
    rq, rkp, rvp, rtable, rlens, _ = ragged_inputs(3)
    out = pk.ragged_paged_attention(
        rq,
        rkp,
        rvp,
        rtable[:, :0],
        np.zeros_like(rlens),
        np.zeros(4, np.int32),
        backend="gpu",
        interpret=True,
    )
    np.testing.assert_array_equal(np.asarray(out), np.zeros(rq.shape, np.float32))


def test_zero_query_heads_is_rejected():
    # H = 0 passes "kv heads must divide query heads" (0 % K == 0); the GPU kernels then
    # failed in a gather and the TPU kernels with a ZeroDivisionError.
    q, kp, vp, lengths, table = decode_inputs()
    rq, rkp, rvp, rtable, rlens, loc = ragged_inputs()
    for backend in ("xla", "gpu", "tpu"):
        with pytest.raises(ValueError, match="q must have query heads, got num_heads=0"):
            pk.paged_decode_attention(
                q[:, :0], kp, vp, lengths, table, backend=backend, interpret=True
            )
        with pytest.raises(ValueError, match="q must have query heads, got num_heads=0"):
            pk.ragged_paged_attention(
                rq[:, :0], rkp, rvp, rtable, rlens, loc, backend=backend, interpret=True
            )


@pytest.mark.parametrize(
    "op,backend,knobs",
    [
        ("decode", "gpu", dict(block_kv=np.int64(16), num_splits=np.int32(2))),
        ("decode", "tpu", dict(pages_per_block=np.int64(2), num_cores=jnp.int32(2))),
        ("ragged", "gpu", dict(block_q=np.int64(8), block_kv=np.int32(16))),
        ("ragged", "tpu", dict(block_q=np.int64(8), pages_per_block=jnp.int32(2))),
    ],
)
def test_numpy_and_jax_int_knobs_are_taken(op, backend, knobs):
    # The kernels check knobs with isinstance(x, int): a numpy or jax int was refused with
    # "block_kv must be a power of two >= 16, got block_kv=np.int64(16)".
    if op == "decode":
        q, kp, vp, lengths, table = decode_inputs(4)
        got = pk.paged_decode_attention(
            q, kp, vp, lengths, table, backend=backend, interpret=True, **knobs
        )
        want = ref.paged_attention_xla(q, kp, vp, lengths, table)
    else:
        q, kp, vp, table, lengths, loc = ragged_inputs(4)
        got = pk.ragged_paged_attention(
            q, kp, vp, table, lengths, loc, backend=backend, interpret=True, **knobs
        )
        want = ref.ragged_paged_attention_xla(q, kp, vp, table, lengths, loc)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "op,backend,knobs",
    [
        ("decode", "gpu", dict(block_kv=np.int64(16), num_splits=jnp.int32(2))),
        ("decode", "tpu", dict(pages_per_block=np.int64(2), num_cores=jnp.int32(2))),
        ("ragged", "gpu", dict(block_q=np.int64(8), block_kv=jnp.int32(16))),
        ("ragged", "tpu", dict(block_q=np.int64(8), pages_per_block=jnp.int32(2))),
    ],
)
def test_numpy_and_jax_int_knobs_are_taken_by_the_kernels_themselves(op, backend, knobs):
    # The kernels are public entry points too (scripts call them): called directly, the
    # first three refused these with "pages_per_block must be a positive int, got
    # pages_per_block=np.int64(2)"; only the dispatcher converted them.
    if op == "decode":
        from pallas_kernels.paged_decode import gpu, tpu

        kernel = {"gpu": gpu.paged_decode_gpu, "tpu": tpu.paged_decode_tpu}[backend]
        args = decode_inputs(5)
        want = ref.paged_attention_xla(*args)
    else:
        from pallas_kernels.ragged import gpu, tpu

        kernel = {"gpu": gpu.ragged_paged_attention_gpu, "tpu": tpu.ragged_paged_attention_tpu}
        kernel = kernel[backend]
        args = ragged_inputs(5)
        want = ref.ragged_paged_attention_xla(*args)
    got = kernel(*args, interpret=True, **knobs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_ragged_knobs_are_checked_with_an_empty_page_table(backend):
    # The dispatcher answered zeros for a table with no columns before the kernel saw its
    # knobs, so a misspelt or bad knob passed silently there.
    rq, rkp, rvp, rtable, rlens, _ = ragged_inputs(3)
    args = (rq, rkp, rvp, rtable[:, :0], np.zeros_like(rlens), np.zeros(4, np.int32))
    with pytest.raises(TypeError, match="unexpected keyword argument 'blok_q'"):
        pk.ragged_paged_attention(*args, backend=backend, interpret=True, blok_q=8)
    with pytest.raises(ValueError, match="block_q"):
        pk.ragged_paged_attention(*args, backend=backend, interpret=True, block_q=3)
    # No query rows, or no sequences: the TPU kernel answered zeros before its checks.
    empty_q = (rq[:0], rkp, rvp, rtable, rlens, np.zeros(4, np.int32))
    no_seqs = (rq, rkp, rvp, rtable[:0], rlens[:0], np.zeros(1, np.int32))
    for empty in (empty_q, no_seqs):
        with pytest.raises(ValueError, match="block_q"):
            pk.ragged_paged_attention(*empty, backend=backend, interpret=True, block_q=3)
        out = pk.ragged_paged_attention(*empty, backend=backend, interpret=True)
        assert out.shape == empty[0].shape and not np.asarray(out).any()


# ------------------------------------------------------------------ the engine

TINY = PRESETS["tiny"]  # float32, 512 positions
ENGINE = dict(backend="xla", page_size=8, num_pages=64, max_num_seqs=8)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_pages=8, kv_memory_fraction=0.5), ValueError, "not both"),
        # 0 and True were refused only once the model was loaded (by plan_num_pages).
        (dict(num_pages=None, kv_memory_fraction=0), ValueError, "kv_memory_fraction=0$"),
        (dict(num_pages=None, kv_memory_fraction=True), ValueError, "kv_memory_fraction=True"),
        (dict(kv_cache_dtype="fp9"), ValueError, "got 'fp9'"),
        (dict(tensor_parallel=0), ValueError, "got tensor_parallel=0"),
        (dict(tensor_parallel=True), ValueError, "got tensor_parallel=True"),
        (dict(tensor_parallel=1.0), ValueError, "got tensor_parallel=1.0"),  # was taken as 1
        # A string flag was truthy: async_scheduling="no" ran asynchronously.
        (dict(async_scheduling="no"), ValueError, "async_scheduling must be a bool, got .*'no'"),
        (dict(interpret="yes"), ValueError, "interpret must be a bool, got interpret='yes'"),
        # A bad seed failed in numpy after the load ("expected non-negative integer").
        (dict(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*63\), got seed=-1"),
        (dict(seed=1.5), ValueError, "got seed=1.5"),
        (dict(seed=True), ValueError, "got seed=True"),
        (dict(seed=2**63), ValueError, "got seed=9223372036854775808"),
        # An int was an AttributeError ('int' object has no attribute 'min_seqs').
        (dict(buckets=3), TypeError, "buckets must be a decode.Buckets or None, got buckets=3"),
        # A string was an AttributeError after the load ('str' has no 'eos_token_ids').
        (dict(tokenizer="gpt2"), TypeError, "tokenizer must be a .*Tokenizer or None, got 'gpt2'"),
        # The cache geometry and the scheduler's limits were checked after the load.
        (dict(page_size=12), ValueError, "page_size must be a power of two, got page_size=12"),
        (dict(page_size=0), ValueError, "got page_size=0"),
        (dict(num_pages=0), ValueError, "num_pages must be a positive int, got num_pages=0"),
        (dict(num_pages=2**30, page_size=4), ValueError, "num_pages=1073741824 .*int32 slot ids"),
        (dict(num_pages=None, max_num_seqs=0), ValueError, "got max_num_seqs=0"),
        (dict(max_num_batched_tokens=2.5), ValueError, "got max_num_batched_tokens=2.5"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), ValueError, "must be >= max_num_seqs"),
        (dict(watermark=1), ValueError, r"watermark must be in \[0, 1\), got watermark=1"),
        (dict(enable_prefix_caching="no"), ValueError, "enable_prefix_caching='no'"),
        (dict(max_model_len=1.5), ValueError, "got max_model_len=1.5"),
        (dict(max_model_len=0), ValueError, "got max_model_len=0"),
        # Past the model's positions, or 1, they were refused only once the model loaded.
        (dict(max_model_len=513), ValueError, r"\[2, 512\], got max_model_len=513"),
        (dict(max_model_len=1), ValueError, r"\[2, 512\], got max_model_len=1"),
    ],
)
def test_bad_engine_arguments_are_named_before_the_model_loads(kwargs, error, match, monkeypatch):
    def load_model(*args, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(engine, "load_model", load_model)
    with pytest.raises(error, match=match):
        engine.LLM(TINY, **(ENGINE | kwargs))


def test_a_numpy_one_tensor_parallel_is_no_mesh():
    """tensor_parallel=np.int64(1) is 1 (`config.is_int`): no mesh, as for 1 (it built a
    one-device mesh, the tensor-parallel path's programs)."""
    llm = engine.LLM(params_helpers.random_params(TINY, 0), **ENGINE, tensor_parallel=np.int64(1))
    assert llm.params.mesh is None and llm.tensor_parallel == 1


def test_kv_memory_fraction_and_the_limits_reach_the_page_planner(monkeypatch):
    """On the CPU the planner's answer does not depend on the fraction (no memory stats),
    so what it is asked is checked here: the fraction given (default 0.8), the seats,
    the length limit and the watermark."""
    asked = []

    def plan_num_pages(cfg, page_size, **kw):
        asked.append((page_size, kw["kv_memory_fraction"], kw["max_num_seqs"]))
        asked.append((kw["max_model_len"], kw["watermark"], kw["kv_dtype"]))
        return 40

    monkeypatch.setattr(engine, "plan_num_pages", plan_num_pages)
    p = params_helpers.random_params(TINY, 0)
    kw = dict(backend="xla", page_size=8, max_num_seqs=3, max_model_len=64, watermark=0.1)
    llm = engine.LLM(p, kv_memory_fraction=0.3, **kw)
    assert llm.cache_config.num_pages == 40 and llm.block_manager.num_pages == 40
    engine.LLM(p, **kw)
    assert asked == [(8, 0.3, 3), (64, 0.1, "float32"), (8, 0.8, 3), (64, 0.1, "float32")]


def test_a_numpy_kv_memory_fraction_is_taken():
    # np.float32(0.5) was "kv_memory_fraction must be in (0, 1]" (not a Python float).
    p = params_helpers.random_params(TINY, 0)
    kw = dict(backend="xla", page_size=8, max_num_seqs=2, max_model_len=64)
    llm = engine.LLM(p, kv_memory_fraction=np.float32(0.5), **kw)
    assert (
        llm.cache_config.num_pages
        == engine.LLM(p, kv_memory_fraction=0.5, **kw).cache_config.num_pages
    )


def test_engine_seeds_and_flags_of_numpy_types_are_taken():
    p = params_helpers.random_params(TINY, 0)
    llm = engine.LLM(p, seed=np.int64(3), async_scheduling=np.bool_(False), **ENGINE)
    assert llm.async_scheduling is False and llm.interpret is False
    rid = llm.add_request([5, 6], engine.SamplingParams(max_tokens=2))
    want = engine.LLM(p, seed=3, async_scheduling=False, **ENGINE)
    want_rid = want.add_request([5, 6], engine.SamplingParams(max_tokens=2))
    seed = llm.scheduler.get(rid).seqs[0].seed
    assert seed == want.scheduler.get(want_rid).seqs[0].seed


def test_engine_arguments_checked_against_the_model():
    p = params_helpers.random_params(TINY, 0)
    for bad in (1, 513):  # the model has 512 positions
        with pytest.raises(ValueError, match=rf"in \[2, 512\], got max_model_len={bad}$"):
            engine.LLM(p, max_model_len=bad, **ENGINE)
    assert engine.LLM(p, max_model_len=2, **ENGINE).max_model_len == 2
    assert type(engine.LLM(p, max_model_len=np.int64(64), **ENGINE).max_model_len) is int
    assert engine.LLM(p, max_model_len=512, **ENGINE).max_model_len == 512
    f16 = dataclasses.replace(TINY, dtype="float16", num_layers=1)
    with pytest.raises(ValueError, match="fp8 KV cache needs a bfloat16 or float32 model"):
        engine.LLM(f16, kv_cache_dtype="fp8", **ENGINE)
    # A prompt is held to max_model_len, not to the model's positions.
    llm = engine.LLM(p, max_model_len=16, **ENGINE)
    with pytest.raises(ValueError, match="prompt has 16 tokens; max_model_len=16"):
        llm.add_request([5] * 16)
    with pytest.raises(ValueError, match="^2 prompts but 1 sampling params$"):
        llm.generate([[5, 6], [7, 8]], [engine.SamplingParams()])
    # Not a SamplingParams: named (a dict failed with "'dict' object has no attribute").
    with pytest.raises(TypeError, match="prompt 1: sampling params must be a SamplingParams, got"):
        llm.generate([[5, 6], [7, 8]], [None, {"max_tokens": 3}])
    with pytest.raises(TypeError, match="SamplingParams, got {'max_tokens': 3}"):
        llm.add_request([5, 6], {"max_tokens": 3})
    assert not llm.has_unfinished_requests()


def test_generate_names_sampling_params_that_are_neither_one_nor_a_list():
    # A dict was read as the list of its keys ("prompt 0: ... got 'max_tokens'"), an int
    # raised "'int' object is not iterable".
    llm = engine.LLM(params_helpers.random_params(TINY, 0), **ENGINE)
    for bad, shown in [({"max_tokens": 3}, "dict: {'max_tokens': 3}"), (5, "int: 5")]:
        what = f"sampling_params must be a SamplingParams or a list of them, got {shown}"
        with pytest.raises(TypeError, match=f"^{re.escape(what)}$"):
            llm.generate([[5, 6]], bad)
    assert not llm.has_unfinished_requests()
    sp = engine.SamplingParams(max_tokens=1)
    assert len(llm.generate([[5, 6], [7]], (sp for _ in range(2)))) == 2  # any iterable


def test_engine_without_a_tokenizer_refuses_what_needs_one():
    small = dataclasses.replace(TINY, vocab_size=128, num_layers=1)  # no byte tokenizer
    llm = engine.LLM(small, **ENGINE)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="stop strings need a tokenizer; this model has none"):
        llm.add_request([5, 6], engine.SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="prompt 0: this model has no tokenizer"):
        llm.generate(["hi"])
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("op", ["decode", "ragged"])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_the_kernels_trace_under_x64(op, backend):
    # Under jax_enable_x64 a static size (page size, kv heads, tile) is int64 and the
    # kernels' index arrays int32: lax.div refused the mix ("lax.div requires arguments
    # to have the same dtypes, got int32, int64"), so a researcher with x64 on could
    # not call them. The int32/int64 inputs a caller with x64 may pass are taken too.
    with jax.enable_x64(True):
        if op == "decode":
            q, kp, vp, lengths, table = decode_inputs(6)
            args = (q, kp, vp, np.asarray(lengths, np.int64), np.asarray(table, np.int64))
            got = pk.paged_decode_attention(*args, backend=backend, interpret=True)
            want = ref.paged_attention_xla(*args)
        else:
            q, kp, vp, table, lengths, loc = ragged_inputs(6)
            args = (q, kp, vp, np.asarray(table, np.int64), np.asarray(lengths, np.int64), loc)
            got = pk.ragged_paged_attention(*args, backend=backend, interpret=True)
            want = ref.ragged_paged_attention_xla(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
