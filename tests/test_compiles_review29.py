"""What the jitted steps compile, and that `decode.compile_counts` sees all of it.

XLA compiles a step's program again, without a trace, for inputs of shapes it has seen
that are placed otherwise: an array committed to its device (`jax.device_put(x,
device)`, a weight update, a wake-up) where the program was compiled for an uncommitted
one, or the reverse. `compile_counts` counted traces only, so such compiles were
invisible to it and to what reads it (`StepRecord.compiled`, `num_compilations`, the
benchmarks' "compiles during timing"). The tiny preset, float32, XLA attention.
"""

import jax
import numpy as np
import pytest
from engine_helpers import GEOMETRY, greedy, random_params
from jax import monitoring

from pagedjax import cache as cache_lib
from pagedjax import decode, sharding
from pagedjax.config import PRESETS, CacheConfig
from pagedjax.engine import LLM, SamplingParams

TINY = PRESETS["tiny"]
CC = CacheConfig(page_size=8, num_pages=16, dtype=TINY.dtype)

_BACKEND = [0]


def _listen(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration" and "_step" in str(
        kwargs.get("fun_name", "")
    ):
        _BACKEND[0] += 1


monitoring.register_event_duration_secs_listener(_listen)


def counts() -> tuple[int, int]:
    """(programs `compile_counts` reports, step programs XLA compiled) so far."""
    return sum(decode.compile_counts().values()), _BACKEND[0]


@pytest.fixture(scope="module")
def params():
    return random_params()


def test_a_compile_without_a_trace_is_counted(params):
    """The same step input and a cache of the same shapes, committed to its device the
    second time: XLA compiles the step again (no trace); `compile_counts` counts it."""
    inp = decode.build_step_input([decode.SeqChunk([3, 4, 5, 6], 0, [1])], TINY, CC)
    cache = cache_lib.create(TINY, CC)  # uncommitted
    assert not jax.tree.leaves(cache)[0].committed
    reported, compiled = counts()
    _, cache = decode.prefill_step(params, cache, inp, backend="xla")
    fresh = jax.device_put(cache_lib.create(TINY, CC), jax.devices()[0])
    assert jax.tree.leaves(fresh)[0].committed
    _, fresh = decode.prefill_step(params, fresh, inp, backend="xla")
    got_reported, got_compiled = counts()
    assert got_compiled - compiled >= 1  # (1 or 2: the first shape may have been seen)
    assert got_reported - reported == got_compiled - compiled
    before = counts()
    _, fresh = decode.prefill_step(params, fresh, inp, backend="xla")  # (committed: seen)
    assert counts() == before


def test_engine_steps_count_every_compile(params):
    """An engine on weights committed to their device (`jax.device_put(params,
    device)`, what a weight update leaves): its first step ran on an uncommitted cache
    and feed, every later one on committed ones (the step's outputs), so the first
    step's bucket compiled twice; `num_compilations` and `compile_counts` now see both
    (they saw one)."""
    llm = LLM(jax.device_put(params, jax.devices()[0]), **GEOMETRY)
    reported, compiled = counts()
    summary0 = llm.summary()["num_compilations"]
    for _ in range(2):
        llm.generate([[3, 4, 5, 6, 7]], greedy(3))
    got_reported, got_compiled = counts()
    assert got_reported - reported == got_compiled - compiled
    assert llm.summary()["num_compilations"] - summary0 == got_compiled - compiled


@pytest.mark.slow  # (~12 s: it compiles some 16 programs first)
def test_a_warm_engine_compiles_nothing_more_for_any_mix_of_requests(params):
    """Once every bucket has been seen (a first pass over a varied workload), a second
    pass with other prompts of the same lengths, other seeds and values compiles
    nothing: no per-request value (temperature, seed, penalty, bias value, logprob
    count within its padding) selects a program."""
    llm = LLM(params, **GEOMETRY, max_num_batched_tokens=32)

    def workload(seed):
        rng = np.random.default_rng(seed)

        def p(n):
            return rng.integers(3, 256, size=n).tolist()

        s = float(rng.uniform(0.3, 1.5))
        return [
            ([p(5), p(12)], greedy(4)),
            ([p(5), p(12)], SamplingParams(temperature=s, seed=seed, top_k=5, max_tokens=4)),
            ([p(9)], SamplingParams(temperature=s, presence_penalty=s / 2, max_tokens=4)),
            ([p(7), p(11)], SamplingParams(logit_bias={seed + 3: s}, min_tokens=2, max_tokens=4)),
            ([p(7), p(11)], SamplingParams(logprobs=1 + seed, max_tokens=3)),
            ([p(7)], greedy(3, prompt_logprobs=1 + seed)),
            ([p(3) for _ in range(6)], SamplingParams(n=2, temperature=s, max_tokens=3)),
            ([p(40)], greedy(3)),  # chunked prefill (budget 32)
            ([p(6)], SamplingParams(n=2, beam_width=2, max_tokens=3)),
        ]

    for prompts, sp in workload(0):
        llm.generate(prompts, sp)
    before = counts()
    for prompts, sp in workload(1):
        llm.generate(prompts, sp)
    assert counts() == before


def test_an_engine_commits_what_its_steps_take_where_they_lie(params):
    """Uncommitted weights (`init_params`', a safetensors load's), cache, feed and LoRA
    slots each compiled every step program a second time: for the committed cache and
    feed the steps return, and for the committed weights the first `update_params` or
    `wake_up` places. The engine commits them all to the model's device, no copy."""
    assert not jax.tree.leaves(params)[0].committed
    llm = LLM(params, **GEOMETRY, enable_lora=True, max_lora_rank=4)
    leaf = jax.tree.leaves(llm.params)[0]
    assert leaf.committed
    assert leaf.unsafe_buffer_pointer() == jax.tree.leaves(params)[0].unsafe_buffer_pointer()
    core = llm.core
    assert all(x.committed for x in jax.tree.leaves(core.cache)) and core._feed.committed
    assert all(x.committed for x in jax.tree.leaves(llm.lora.weights))
    llm.generate([[3, 4, 5, 6, 7]], greedy(3))
    before = counts()
    llm.update_params(random_params(seed=1))  # (uncommitted: placed, so committed)
    llm.sleep(1)
    llm.wake_up()
    llm.generate([[3, 4, 5, 6, 7]], greedy(3))
    assert counts() == before


def test_home_device_and_committed_caches():
    device = jax.devices()[-1]
    on = jax.device_put(np.zeros(3, np.float32), device)
    assert sharding.home_device({"w": on}) == device
    cache = sharding.create_cache(TINY, CC, device=device)
    assert all(x.committed and x.devices() == {device} for x in jax.tree.leaves(cache))
    assert not jax.tree.leaves(sharding.create_cache(TINY, CC))[0].committed
    assert sharding.replicate(np.zeros(2), device=device).committed
