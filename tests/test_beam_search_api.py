"""`LLM.beam_search` (vLLM's beam-search API, `pagedjax.beam_search`): each prompt's
sequences are an exhaustive dense beam search's best hypotheses (tests/beam_oracle.py),
with the prompt's ids in front and the stop token at the end (as vLLM's), the text of
them (the stop token's only when asked for) and the completion's logprobs; width 1 is
greedy decoding; bad parameters are named. In tests/test_engine.py's geometry
(tests/engine_helpers.py)."""

import dataclasses

import numpy as np
import pytest
from engine_helpers import GEOMETRY, Dense, check_clean, dense_beam_search, random_params

from pagedjax.beam_search import BeamSearchOutput, BeamSearchParams
from pagedjax.engine import LLM, SamplingParams
from pagedjax.lora import LoRARequest

RNG = np.random.default_rng(5)
PROMPTS = [RNG.integers(3, 256, size=n).tolist() for n in (6, 11)]


@pytest.fixture(scope="module")
def dense():
    return Dense(random_params())


@pytest.fixture(scope="module")
def llm(dense):
    """An engine whose EOS is a token the model likes after PROMPTS, so that beams
    also end on it (the byte tokenizer's EOS stays one too)."""
    params = random_params()
    likes = sorted({t for g in dense.greedy(PROMPTS, 4, stop_ids=()) for t in g[1:3]})
    cfg = dataclasses.replace(params.config, eos_token_ids=(likes[0],))
    return LLM(params.replace(config=cfg), max_num_batched_tokens=16, **GEOMETRY)


@pytest.mark.parametrize("keep_stop", [False, True])
@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (3, 0.5)])
def test_sequences_are_an_exhaustive_searchs_best(llm, dense, width, length_penalty, keep_stop):
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=7,
        length_penalty=length_penalty,
        include_stop_str_in_output=keep_stop,
    )
    prompts = [{"prompt_token_ids": PROMPTS[0]}, PROMPTS[1]]
    outs = llm.beam_search(prompts, params)
    assert len(outs) == 2 and all(isinstance(o, BeamSearchOutput) for o in outs)
    reasons = set()
    for p, o in zip(PROMPTS, outs, strict=True):
        want = dense_beam_search(dense, p, width, 7, llm.eos_ids, length_penalty)
        assert len(o.sequences) == width
        for s, (_, gen, total, reason) in zip(o.sequences, want, strict=True):
            # As vLLM's: the stop token in `tokens` (lined up with `logprobs`) whatever
            # include_stop_str_in_output, which decides whether `text` decodes it.
            kept = gen if keep_stop or reason == "length" else gen[:-1]
            assert s.tokens == p + gen and s.finish_reason == reason
            assert len(s.logprobs) == len(s.tokens) - len(p)
            assert s.stop_reason == (gen[-1] if reason == "stop" else None)
            np.testing.assert_allclose(s.cum_logprob, total, rtol=1e-4)
            assert [next(iter(e)) for e in s.logprobs] == gen  # (the stop token's too)
            np.testing.assert_allclose(
                sum(e[t] for e, t in zip(s.logprobs, gen, strict=True)), total, rtol=1e-4
            )
            assert s.text == llm.tokenizer.decode(p + kept, skip_special_tokens=False)
            reasons.add(reason)
    assert reasons == {"stop", "length"}, reasons
    check_clean(llm)


def test_width_one_is_greedy_decoding(llm):
    (out,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=6))
    (want,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6))
    (s,) = out.sequences
    c = want.outputs[0]
    assert s.tokens == PROMPTS[0] + c.token_ids
    assert len(s.logprobs) == len(c.token_ids)
    np.testing.assert_allclose(s.cum_logprob, c.cumulative_logprob, rtol=1e-5)


def generate_calls(monkeypatch) -> list[int]:
    """The number of prompts of each `LLM.generate` call from now on (it still runs)."""
    calls = []
    real = LLM.generate

    def generate(self, prompts, *args, **kw):
        calls.append(len(prompts))
        return real(self, prompts, *args, **kw)

    monkeypatch.setattr(LLM, "generate", generate)
    return calls


def test_concurrency_limit_runs_the_prompts_in_chunks(llm, monkeypatch):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    whole = llm.beam_search(PROMPTS * 2, params)
    calls = generate_calls(monkeypatch)
    chunked = llm.beam_search(PROMPTS * 2, params, concurrency_limit=3)
    assert calls == [3, 1]
    assert [[s.tokens for s in o.sequences] for o in chunked] == [
        [s.tokens for s in o.sequences] for o in whole
    ]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(beam_width=0), "beam_width must be an int >= 1, got beam_width=0"),
        (dict(beam_width=True), "beam_width must be an int >= 1, got beam_width=True"),
        (dict(max_tokens=2.0), "max_tokens must be an int >= 1, got max_tokens=2.0"),
        (dict(ignore_eos=1), "ignore_eos must be a bool, got ignore_eos=1"),
        (dict(temperature=-0.5), "temperature must be a finite number >= 0.0"),
        (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
        # -inf and an int past the float range passed (`-inf <= v < inf`): width 1 kept
        # them, a wider search refused them only when the call built its SamplingParams.
        (dict(length_penalty=float("-inf")), "length_penalty must be a finite number"),
        (dict(length_penalty=10**400), "length_penalty must be a finite number"),
        (dict(beam_width=1, length_penalty=float("-inf")), "length_penalty must be a finite"),
        (dict(temperature=10**400), "temperature must be a finite number >= 0.0"),
    ],
)
def test_bad_params_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**(dict(beam_width=2, max_tokens=4) | kw))


def test_numpy_numbers_are_numbers():
    """As SamplingParams takes them (`config.is_finite_number`)."""
    p = BeamSearchParams(2, 4, temperature=np.float32(0.5), length_penalty=np.float32(0.5))
    assert p.sampling_params().length_penalty == 0.5


def test_numpy_ints_and_bools_are_ints_and_bools():
    """As SamplingParams takes them (beam widths from an np.arange, flags from an array):
    they were refused ("beam_width must be an int >= 1, got beam_width=np.int64(3)"); kept
    as Python's."""
    p = BeamSearchParams(
        np.int64(3), np.int32(8), ignore_eos=np.True_, include_stop_str_in_output=np.False_
    )
    assert (p.beam_width, p.max_tokens, p.ignore_eos, p.include_stop_str_in_output) == (
        3,
        8,
        True,
        False,
    )
    assert [type(getattr(p, f)) for f in ("beam_width", "max_tokens")] == [int, int]
    assert type(p.ignore_eos) is bool and type(p.include_stop_str_in_output) is bool
    sp = p.sampling_params()
    assert (sp.beam_width, sp.n, sp.max_tokens, sp.ignore_eos) == (3, 3, 8, True)
    with pytest.raises(ValueError, match="beam_width must be an int >= 1"):
        BeamSearchParams(np.int64(0), 4)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        BeamSearchParams(2, np.float64(4.0))


def test_bad_calls_are_named(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(TypeError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams(beam_width=2))
    with pytest.raises(ValueError, match="concurrency_limit must be None or an int >= 1"):
        llm.beam_search(PROMPTS, params, concurrency_limit=0)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest, a list of them"):
        llm.beam_search(PROMPTS, params, lora_request=object())
    with pytest.raises(ValueError, match=r"LoRA is not enabled: .*enable_lora=True"):
        llm.beam_search(PROMPTS, params, lora_request=LoRARequest("a", 1, "/nowhere"))
