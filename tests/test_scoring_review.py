"""Review of the static-batch research API (`scoring.score`, `decode.generate` and their
shared checks in `pagedjax.static_batch`): inputs they took silently or refused with
numpy's or JAX's words, or only after compiling and allocating, now refused on the host
by name; valid inputs they refused (uint64 ids, jax lora_slots) now read exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import decode, lora, sharding
from pagedjax.config import PRESETS
from pagedjax.scoring import score

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


@pytest.fixture
def no_cache(monkeypatch):
    def refuse(*args):
        raise AssertionError("allocated a cache")

    monkeypatch.setattr(sharding, "create_cache", refuse)


def _both(params, seqs, **kw):
    """`score` and `generate` on `seqs`, each expected to raise."""
    yield lambda: score(params, seqs, backend="xla", **kw)
    yield lambda: decode.generate(params, seqs, max_new_tokens=1, backend="xla", **kw)


@pytest.mark.parametrize("flag", [True, np.bool_(False)], ids=["bool", "np.bool_"])
def test_a_bool_among_int_token_ids_is_refused(params, no_cache, flag):
    # numpy made [1, True, 2] an int64 array: True ran as token 1 (a list of bools alone
    # was refused, as a bool dtype).
    before = decode.compile_counts()
    for call in _both(params, [[4, 5], [1, flag, 2]]):
        with pytest.raises(
            TypeError, match=r"(sequence|prompt) 1: token ids must be ints, got (True|np\.False_)"
        ):
            call()
    assert decode.compile_counts() == before


@pytest.mark.parametrize("seqs", [np.array(5), jnp.array(5)], ids=["numpy", "jax"])
def test_a_0d_array_is_named(params, no_cache, seqs):
    # It was numpy's "TypeError: iteration over a 0-d array".
    for call in _both(params, seqs):
        with pytest.raises(ValueError, match=r"s must be a list of token id lists, got .*5"):
            call()


def test_uint64_token_ids_are_read_exactly(params):
    """numpy has no int dtype for an int next to a numpy uint64, nor for a uint64 array
    next to an int64 one: [1, np.uint64(3)] was refused as "token ids must be ints, got
    dtype float64", and 2**64 - 1 named as 18446744073709551616 (float64's rounding)."""
    want = score(params, [[1, 3], [1, 2]], backend="xla", page_size=4)
    got = score(
        params, [[1, np.uint64(3)], np.array([1, 2], np.uint64)], backend="xla", page_size=4
    )
    for a, b in zip(want.logprobs, got.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
    for seqs in ([np.array([1, 2**64 - 1], np.uint64), [1, 2]], [[1, np.uint64(2**64 - 1)]]):
        for call in _both(params, seqs):
            with pytest.raises(ValueError, match=r"token id 18446744073709551615 is outside"):
                call()


def test_lora_slots_take_a_jax_array_and_name_a_bare_int(params):
    weights = lora.create_lora_weights(TINY, max_loras=2, max_lora_rank=4)
    seqs, kw = [[1, 2, 3], [4, 5]], dict(backend="xla", page_size=4, lora=weights)
    # A jax array of valid slots was refused as "lora_slots[0] must be an int in [0, 2],
    # got Array(1, dtype=int32)"; an int was Python's "'int' object is not iterable", a
    # string checked letter by letter.
    want = score(params, seqs, lora_slots=[1, 2], **kw).logprobs
    for slots in (jnp.array([1, 2]), [jnp.int32(1), np.int64(2)]):
        got = score(params, seqs, lora_slots=slots, **kw).logprobs
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
    for bad in (1, "12"):
        for call in _both(params, seqs, lora=weights, lora_slots=bad):
            with pytest.raises(ValueError, match="lora_slots must be a list of slots, one per"):
                call()
    with pytest.raises(ValueError, match=r"lora_slots\[0\] must be an int in \[0, 2\], got .*3"):
        score(params, seqs, lora_slots=jnp.array([3, 0]), **kw)
    with pytest.raises(ValueError, match=r"lora_slots\[0\] must be an int .*got np\.False_"):
        score(params, seqs, lora_slots=jnp.array([False, True]), **kw)
    with pytest.raises(TypeError, match="score runs on the host.*got traced lora_slots"):
        jax.jit(lambda s: score(params, seqs, lora_slots=s, **kw).logprobs[0])(jnp.array([1, 2]))


def test_a_page_larger_than_the_model_context_is_refused_before_allocating(params, no_cache):
    # page_size=2**20 (a power of two) allocated 16 pages of 2**20 slots for 5 tokens,
    # compiled a step and failed with XLA's "RESOURCE_EXHAUSTED: Out of memory allocating
    # 53687100480 bytes".
    before = decode.compile_counts()
    for call in _both(params, [[1, 2, 3], [4, 5]], page_size=2**20):
        with pytest.raises(ValueError, match=r"page_size must be at most max_position_embed"):
            call()
    assert decode.compile_counts() == before
