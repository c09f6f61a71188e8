"""Tests for pagedjax.request: SamplingParams validation and normalisation.

Sampling behaviour itself is tested in tests/test_sampling.py; these pin what
SamplingParams accepts, refuses and stores, on random inputs.
"""

import re

import numpy as np
import pytest

from pagedjax.request import MAX_LOGPROBS, SamplingParams, encode_prompt

RNG = np.random.default_rng(0)
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def test_numpy_integers_are_stored_as_python_ints():
    # np.int32 max_tokens stayed np.int32: LLM's `len(prompt) + max_tokens` wrapped
    # negative (max_tokens=np.int32(2**31 - 1) generated 1 token, finish "length").
    for _ in range(200):
        dt = RNG.choice(INT_DTYPES)
        top = min(int(np.iinfo(dt).max), 2**63 - 1)
        mt = int(RNG.integers(1, top, endpoint=True))
        kw = dict(
            n=int(RNG.integers(1, min(top, 8), endpoint=True)),
            max_tokens=mt,
            min_tokens=int(RNG.integers(0, min(mt, 100), endpoint=True)),
            top_k=int(RNG.integers(0, min(top, 2**31 - 1), endpoint=True)),
            seed=int(RNG.integers(0, min(top, 2**32 - 1), endpoint=True)),
            logprobs=int(RNG.integers(0, min(top, MAX_LOGPROBS), endpoint=True)),
            prompt_logprobs=int(RNG.integers(0, min(top, MAX_LOGPROBS), endpoint=True)),
        )
        p = SamplingParams(**{k: dt(v) for k, v in kw.items()})
        for k, v in kw.items():
            got = getattr(p, k)
            assert type(got) is int and got == v, (k, dt, got)
        assert 1000 + p.max_tokens == 1000 + mt  # no fixed-width wraparound
    beam = SamplingParams(beam_width=np.uint8(3), n=np.int64(2))
    assert (type(beam.beam_width), type(beam.n)) == (int, int)
    assert type(SamplingParams(ignore_eos=np.bool_(True)).ignore_eos) is bool


@pytest.mark.parametrize("name", ["temperature", "length_penalty"])
def test_ints_too_big_for_a_float_are_a_value_error(name):
    # math.isfinite(10**400) raises OverflowError, which the OpenAI server (catching
    # ValueError and TypeError) answered as a 500, not a 400 naming the field.
    for _ in range(20):
        v = int(RNG.integers(10, 10**6)) ** int(RNG.integers(310, 400)) * int(RNG.choice([-1, 1]))
        with pytest.raises(ValueError, match=f"^{name} must be"):
            SamplingParams(**{name: v})
    assert SamplingParams(**{name: 2}).__getattribute__(name) == 2  # a plain int is fine


def test_complex_logit_bias_values_are_refused():
    # numpy complex scalars are np.number: they passed, their imaginary part silently
    # dropped by float() (with a ComplexWarning).
    for _ in range(20):
        dt = RNG.choice([np.complex64, np.complex128])
        tok = int(RNG.integers(0, 1000))
        value = dt(complex(RNG.uniform(-100, 100), RNG.uniform(-100, 100)))
        with pytest.raises(ValueError, match=re.escape(f"logit_bias[{tok}]=")):
            SamplingParams(logit_bias={tok: value})
    real = {
        int(t): RNG.choice([np.float32, np.float64, float])(v)
        for t, v in zip(RNG.integers(0, 1000, 5), RNG.uniform(-100, 100, 5), strict=True)
    }
    assert SamplingParams(logit_bias=real).logit_bias == {t: float(v) for t, v in real.items()}


@pytest.mark.parametrize("name", ["stop", "stop_token_ids"])
def test_non_iterable_stop_fields_are_named(name):
    # tuple(5) raised "TypeError: 'int' object is not iterable", naming neither field nor value.
    for value in [None, int(RNG.integers(0, 1000)), float(RNG.uniform(0, 10)), object()]:
        with pytest.raises(ValueError, match=f"^{name} must be .*{re.escape(repr(value))}"):
            SamplingParams(**{name: value})


@pytest.mark.parametrize("prompt", [5, None, 2.5, b"hi", bytearray(b"hi"), np.int64(3)])
def test_a_prompt_neither_text_nor_ids_is_named(prompt):
    # An int (a flat id list passed as the list of prompts) raised "'int' object is not
    # iterable"; bytes passed as their byte values.
    with pytest.raises(TypeError, match="a prompt must be a str or a list of token ids, got"):
        encode_prompt(prompt, None, 256, 64)
    assert encode_prompt(np.array([5, 6]), None, 256, 64) == (None, [5, 6])
