"""Tests for pagedjax.request: SamplingParams validation and normalisation.

Sampling behaviour itself is tested in tests/test_sampling.py; these pin what
SamplingParams accepts, refuses and stores, on random inputs.
"""

import re

import numpy as np
import pytest

from pagedjax.request import MAX_LOGPROBS, SamplingParams, encode_prompt, unpack_prompt

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
    beam = dict(beam_width=2) if name == "length_penalty" else {}
    assert SamplingParams(**{name: 2}, **beam).__getattribute__(name) == 2  # a plain int is fine


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


def test_length_penalty_without_beam_search_is_refused():
    # Sampling has no length normaliser: length_penalty=0.5 without beam_width was
    # silently ignored (vLLM's SamplingParams refuses it too).
    for _ in range(20):
        lp = float(RNG.uniform(-3, 3))
        with pytest.raises(ValueError, match=re.escape(f"length_penalty={lp!r} with beam_width=1")):
            SamplingParams(length_penalty=lp, n=int(RNG.integers(1, 5)))
        assert SamplingParams(length_penalty=lp, beam_width=2).length_penalty == lp
    assert SamplingParams(length_penalty=1).length_penalty == 1  # the default value is fine


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


def test_prompt_dicts_are_read_as_vllm_and_sets_are_refused():
    """vLLM's TokensPrompt {"prompt_token_ids": [...]} was read as its keys ("token id
    prompts must be lists of ints, got {...}"); now it and TextPrompt are prompts. A set
    of ids silently lost their order."""
    ids = [int(i) for i in RNG.choice(np.arange(3, 256), size=6, replace=False)]
    assert encode_prompt({"prompt_token_ids": ids}, None, 256, 64) == (None, ids)
    assert encode_prompt({"prompt_token_ids": ids, "cache_salt": "a"}, None, 256, 64)[1] == ids
    assert unpack_prompt({"prompt": "hi", "cache_salt": "s"}) == ("hi", "s")
    assert unpack_prompt({"prompt_token_ids": ids}) == (ids, None)
    # vLLM's optional keys given as None ask for nothing (they were refused).
    none = {"prompt": "hi", "multi_modal_data": None, "mm_processor_kwargs": None}
    assert unpack_prompt(none) == ("hi", None)
    # A TokensPrompt may carry the text its ids encode (vLLM's): the ids are the prompt.
    both = {"prompt_token_ids": ids, "prompt": "hi", "cache_salt": "s"}
    assert unpack_prompt(both) == (ids, "s")
    assert encode_prompt(both, None, 256, 64) == ("hi", ids)
    assert encode_prompt(both, None, 256, 64, truncate_prompt_tokens=2) == ("hi", ids[-2:])
    for prompt, words in [
        ({}, "needs 'prompt'"),
        ({"prompt": 3, "prompt_token_ids": ids}, "'prompt' must be a str, got 3"),
        ({"prompt_token_ids": ids, "token_type_ids": ids}, r"\['token_type_ids'\] are not sup"),
        ({"prompt": "hi", "multi_modal_data": {}}, r"\['multi_modal_data'\] are not supported"),
        ({"prompt": "hi", "max_tokens": 3}, r"\['max_tokens'\] are not prompt keys"),
        # Named as unsupported, not as a prompt dict without a prompt.
        ({"prompt_embeds": [[0.5]]}, r"\['prompt_embeds'\] are not supported"),
        ({"prompt": ids}, "'prompt' must be a str"),
        ({"prompt_token_ids": "hi"}, "'prompt_token_ids' must be a list of ints"),
        ({"prompt": "hi", "cache_salt": 3}, "cache_salt must be a str, got 3"),
    ]:
        with pytest.raises(TypeError, match=words):
            encode_prompt(prompt, None, 256, 64)
    with pytest.raises(TypeError, match="token id prompts must be lists of ints"):
        encode_prompt({"prompt_token_ids": [1.5]}, None, 256, 64)
    for prompt in [set(ids), frozenset(ids)]:
        with pytest.raises(TypeError, match="a prompt must be a str or a list of token ids"):
            encode_prompt(prompt, None, 256, 64)
    assert encode_prompt(tuple(ids), None, 256, 64) == (None, ids)


# field: (values at its documented ends, values just past them); min_tokens with max_tokens=5
RANGES = {
    "n": ([1], [0, True]),
    "max_tokens": ([1], [0, True]),
    "beam_width": ([1], [0, True]),
    "temperature": ([0.0], [-1e-9]),
    "top_k": ([-1, 0, 2**31 - 1], [-2, 2**31]),  # (-1: vLLM's "off", stored as 0)
    "top_p": ([1e-9, 1.0], [0.0, 1 + 1e-9]),
    "min_p": ([0.0, 1.0], [-1e-9, 1 + 1e-9]),
    "seed": ([-1, 0, 2**32 - 1], [-2, 2**32, True]),  # (-1: vLLM's "no seed", None)
    # (-1: the whole vocabulary; the engine caps them: tests/test_max_logprobs.py)
    "logprobs": ([-1, 0, MAX_LOGPROBS + 1], [-2, True]),
    "prompt_logprobs": ([-1, 0, MAX_LOGPROBS + 1], [-2, True]),
    "min_tokens": ([0, 5], [-1, 6]),
    "stop_token_ids": ([[0]], [[-1], [True]]),
    "stop": (["x", ["x"]], [[""], [5]]),
    "logit_bias": ([{0: -100}, {0: 100.0}], [{0: 100.001}, {-1: 0.0}]),
    "presence_penalty": ([-2.0, 2.0], [-2.001, 2.001]),
    "repetition_penalty": ([1e-9], [0.0]),
    "ignore_eos": ([True], [1]),
    "cache_salt": (["s"], [5]),
    "allowed_token_ids": ([[0]], [[], [-1], [True], [1.0], "ab"]),
    "bad_words": ([["x"], [" x "], []], [[""], [" "], [5], "x"]),
}
EDGES = [
    (k, v, ok) for k, (good, bad) in RANGES.items() for ok, vs in ((1, good), (0, bad)) for v in vs
]


@pytest.mark.parametrize("name,value,ok", EDGES, ids=[f"{k}={v!r}" for k, v, _ in EDGES])
def test_each_range_includes_its_ends_and_nothing_past_them(name, value, ok):
    kwargs = {name: value, **({"max_tokens": 5} if name == "min_tokens" else {})}
    if ok:
        SamplingParams(**kwargs)
    else:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


BEAM_REFUSES = [
    dict(stop=["x"]),
    dict(top_k=5),
    dict(top_p=0.9),
    dict(min_p=0.1),
    dict(min_tokens=1),
    dict(logit_bias={3: 1.0}),
    dict(repetition_penalty=1.1),
    dict(presence_penalty=0.5),
    dict(frequency_penalty=0.5),
    dict(n=3),
    dict(allowed_token_ids=[3]),
    dict(bad_words=["x"]),
]


@pytest.mark.parametrize("kwargs", BEAM_REFUSES, ids=[next(iter(k)) for k in BEAM_REFUSES])
def test_what_beam_search_cannot_honour_is_refused_with_it_only(kwargs):
    """Stop strings, truncation, min_tokens, logit bias and penalties (beam search ranks
    by raw logprob and has no stop-string check) and more outputs than beams: refused
    with beam_width=2, naming the value; the same request samples fine without beams."""
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}="):
        SamplingParams(beam_width=2, **kwargs)
    SamplingParams(**kwargs)


def test_defaults_are_vllms_and_leave_every_option_off():
    """vLLM's (and the OpenAI API's) defaults: one completion of up to 16 tokens, sampled
    at temperature 1 from the whole distribution, nothing stopping it but EOS."""
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.beam_width) == (1, 16, 1.0, 1)
    assert (p.top_k, p.top_p, p.min_p, p.min_tokens) == (0, 1.0, 0.0, 0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.seed) == ((), (), False, None)
    assert (p.logprobs, p.prompt_logprobs, p.logit_bias, p.cache_salt) == (None,) * 4
    assert (p.allowed_token_ids, p.bad_words) == (None, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not p.penalised


def test_list_fields_are_stored_as_tuples_of_plain_values():
    """A single stop string is one stop string (not one per character), lists become
    tuples, numpy token ids Python ints and logit bias values floats."""
    p = SamplingParams(
        stop="ab",
        stop_token_ids=np.array([7, 3], np.int64),
        logit_bias={np.int32(4): np.float32(1.5), 5: 2},
    )
    assert p.stop == ("ab",)
    assert SamplingParams(stop=["ab", "c"]).stop == ("ab", "c")
    assert p.stop_token_ids == (7, 3) and {type(i) for i in p.stop_token_ids} == {int}
    assert p.logit_bias == {4: 1.5, 5: 2.0}
    assert {(type(k), type(v)) for k, v in p.logit_bias.items()} == {(int, float)}
    p = SamplingParams(allowed_token_ids=np.array([7, 3]), bad_words=["ab", "c"])
    assert p.allowed_token_ids == (7, 3) and {type(i) for i in p.allowed_token_ids} == {int}
    assert p.bad_words == ("ab", "c") and SamplingParams(bad_words=[]).bad_words is None


class _BosTokenizer:
    """Text -> its bytes after a BOS (1): an empty text still encodes to one id."""

    def encode(self, text):
        return [1, *text.encode()]


def test_encode_prompt_refuses_empty_out_of_vocabulary_and_too_long_prompts():
    tok = _BosTokenizer()
    assert encode_prompt("ab", tok, 256, 4) == ("ab", [1, 97, 98])
    with pytest.raises(ValueError, match="prompt is empty"):
        encode_prompt("", tok, 256, 64)  # [1] (a BOS alone) is no prompt either
    with pytest.raises(ValueError, match="no tokenizer"):
        encode_prompt("ab", None, 256, 64)
    with pytest.raises(ValueError, match="prompt is empty"):
        encode_prompt([], None, 256, 64)
    assert encode_prompt([0, 255], None, 256, 3) == (None, [0, 255])
    for ids, bad in (([256], 256), ([-1], -1), ([3, 256, 4], 256)):
        with pytest.raises(ValueError, match=re.escape(f"ids [{bad}] are outside")):
            encode_prompt(ids, None, 256, 64)
    with pytest.raises(ValueError, match="max_model_len=3"):
        encode_prompt([5, 6, 7], None, 256, 3)  # no room for a token
    with pytest.raises(TypeError, match="lists of ints"):
        encode_prompt([5, True], None, 256, 64)


class _AddsBos(_BosTokenizer):
    """A tokenizer that adds its BOS (1) to a text, as `Tokenizer.add_bos` does."""

    add_bos, bos_token_id = True, 1


def test_encode_prompt_truncates_before_its_checks():
    ids = RNG.integers(0, 256, size=50).tolist()
    for k in (1, 7, 49, 50, 64):
        assert encode_prompt(ids, None, 256, 64, truncate_prompt_tokens=k) == (None, ids[-k:])
    # Before the length and vocabulary checks: only the kept ids must pass them.
    with pytest.raises(ValueError, match="prompt has 50 tokens; max_model_len=20"):
        encode_prompt(ids, None, 256, 20)
    assert encode_prompt(ids, None, 256, 20, truncate_prompt_tokens=19)[1] == ids[-19:]
    assert encode_prompt([300, 5, 6], None, 256, 64, truncate_prompt_tokens=2)[1] == [5, 6]

    def cut(prompt, tok, k):
        return encode_prompt(prompt, tok, 256, 64, truncate_prompt_tokens=k)

    # A text keeps the BOS its tokenizer adds (HF's left truncation, vLLM's): BOS + k - 1.
    assert cut("abcdef", _AddsBos(), 3) == ("abcdef", [1, 101, 102])
    assert cut("abcdef", _AddsBos(), 1)[1] == [1]
    assert cut("abc", _AddsBos(), 9)[1] == [1, 97, 98, 99]
    # Only a BOS the tokenizer adds (`add_bos`; without it the stand-in's 1 is text), and
    # not one at the head of an id prompt.
    assert cut("abcdef", _BosTokenizer(), 2)[1] == [101, 102]
    assert cut([1, 5, 6, 7], _AddsBos(), 2)[1] == [6, 7]


@pytest.mark.parametrize(
    "k, words",
    [
        (0, "None, -1 (max_model_len) or an int >= 1, got truncate_prompt_tokens=0"),
        (-2, "None, -1 (max_model_len) or an int >= 1, got truncate_prompt_tokens=-2"),
        (np.int64(-65), "None, -1 (max_model_len) or an int >= 1, got truncate_prompt_tokens="),
        (True, "None, -1 (max_model_len) or an int >= 1, got truncate_prompt_tokens=True"),
        (1.5, "None, -1 (max_model_len) or an int >= 1, got truncate_prompt_tokens=1.5"),
        (-1.0, "None, -1 (max_model_len) or an int >= 1, got truncate_prompt_tokens=-1.0"),
        ("3", "truncate_prompt_tokens='3'"),
        (65, "truncate_prompt_tokens=65 is more than max_model_len=64"),
    ],
)
def test_encode_prompt_refuses_bad_truncations(k, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        encode_prompt([5, 6], None, 256, 64, truncate_prompt_tokens=k)


def test_truncate_minus_one_is_k_max_model_len():
    """vLLM's -1 keeps the last max_model_len tokens (n here), a text's BOS first, as k = n
    does. So many leave no room to generate: a longer prompt is refused as with k = n, a
    shorter one is kept whole. An id outside the vocabulary marks a place in the prompt:
    the vocabulary check (before the length check) refuses it only if it was kept."""
    n, vocab = 40, 100

    def refusal(prompt, tok, k) -> str:
        with pytest.raises(ValueError) as e:
            encode_prompt(prompt, tok, vocab, n, truncate_prompt_tokens=k)
        return str(e.value).replace(f"truncate_prompt_tokens={k};", "truncate_prompt_tokens=K;")

    ids = RNG.integers(0, vocab, size=90).tolist()
    text = "".join(chr(c) for c in RNG.integers(97, 100, size=90))  # "a" to "c"
    too_long = f"prompt has {n} tokens after truncate_prompt_tokens=K; max_model_len={n} "
    outside = "prompt token ids [122] are outside the vocabulary [0, 100)"
    for k in (-1, np.int64(-1), n):
        assert (
            encode_prompt(ids[: n - 1], None, vocab, n, truncate_prompt_tokens=k)[1] == ids[: n - 1]
        )
        short = text[: n - 2]  # BOS and n - 2 bytes
        assert encode_prompt(short, _AddsBos(), vocab, n, truncate_prompt_tokens=k) == (
            short,
            [1, *short.encode()],
        )
        # Exactly n tokens: nothing to cut, refused as without truncation.
        assert refusal(ids[:n], None, k) == refusal(ids[:n], None, None)
        # Ids: the last n; a text: its BOS and the last n - 1 ("z" = 122).
        for where, kept in ((-n - 1, False), (-n, True), (-1, True)):
            marked = [*ids[:where], 122, *ids[len(ids) + where + 1 :]]
            assert refusal(marked, None, k).startswith(outside if kept else too_long)
        for where, kept in ((-n, False), (-n + 1, True), (-1, True)):
            marked = text[:where] + "z" + text[len(text) + where + 1 :]
            assert refusal(marked, _AddsBos(), k).startswith(outside if kept else too_long)


def test_vllm_fields_are_validated_and_stored():
    p = SamplingParams()
    assert (p.max_tokens, p.include_stop_str_in_output, p.skip_special_tokens) == (16, False, True)
    assert p.truncate_prompt_tokens is None
    for _ in range(20):
        k, m = (int(x) for x in RNG.integers(1, 10**6, size=2))
        dt = RNG.choice([np.int32, np.int64, np.uint32])
        p = SamplingParams(max_tokens=None, min_tokens=m, truncate_prompt_tokens=dt(k))
        assert p.max_tokens is None and p.min_tokens == m  # no max_tokens to exceed
        assert type(p.truncate_prompt_tokens) is int and p.truncate_prompt_tokens == k
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        for bad in (0, 1, "no", None, 1.0):
            with pytest.raises(ValueError, match=re.escape(f"{name} must be a bool, got {name}=")):
                SamplingParams(**{name: bad})
    for bad in (0, -3, True, 2.0, "4"):
        words = f"max_tokens must be None or an int >= 1, got max_tokens={bad!r}"
        with pytest.raises(ValueError, match=re.escape(words)):
            SamplingParams(max_tokens=bad)
    # truncate_prompt_tokens: -1 too (vLLM's max_model_len), not any other negative.
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    assert type(SamplingParams(truncate_prompt_tokens=np.int8(-1)).truncate_prompt_tokens) is int
    for bad in (0, -2, -3, True, False, 1.5, 2.0, -1.0, "4", "-1"):
        words = "truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1, got "
        with pytest.raises(ValueError, match=re.escape(f"{words}truncate_prompt_tokens={bad!r}")):
            SamplingParams(truncate_prompt_tokens=bad)
    # Beam search: no stop strings, but a stop token's (EOS's) text is still its to keep.
    assert SamplingParams(beam_width=2, include_stop_str_in_output=True).beam_width == 2
