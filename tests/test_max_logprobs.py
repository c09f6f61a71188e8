"""`LLM(max_logprobs=...)` and `logprobs=-1`, as vLLM's: the engine's cap on the logprobs
and prompt_logprobs a request asks for (-1 counted as the vocabulary's size), checked
when the request is added, and -1 end to end: every token's logprob at every position,
against the dense model's log-softmax (the tiny preset, vocab 256, random weights, in
test_engine.py's geometry). Then the server (`parse_job`, HTTP) and the scripts'
`--max-logprobs`.
"""

import dataclasses
import re
import types

import numpy as np
import params_helpers
import pytest
from engine_helpers import GEOMETRY, check_clean, greedy
from generate_cli_helpers import run
from openai_api_helpers import MAX_LEN, TOK, VOCAB
from serve_helpers import ok, request, serve, serving

import pagedjax.engine
from pagedjax import decode
from pagedjax import openai_api as api
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams
from pagedjax.request import MAX_LOGPROBS

TINY = PRESETS["tiny"]
V = TINY.vocab_size
ENGINE = dict(GEOMETRY, max_num_batched_tokens=16)
TOL = 2e-5  # the engine's logprobs against the dense model's (test_engine's tolerance)


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


@pytest.fixture(scope="module")
def dense(params):
    return params_helpers.dense_last_logits(params)


@pytest.fixture(scope="module")
def capped(params):
    return LLM(params, **ENGINE)  # the default cap


@pytest.fixture(scope="module")
def uncapped(params):
    return LLM(params, max_logprobs=-1, **ENGINE)


def log_softmax(dense, rows) -> np.ndarray:
    logits = dense(rows)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


# ------------------------------------------------------------------- the argument


@pytest.mark.parametrize("bad", [-2, 1.5, True, "20", None])
def test_a_bad_max_logprobs_is_named_before_the_model_loads(bad):
    with pytest.raises(ValueError, match=re.escape(f"max_logprobs={bad!r}")):
        LLM("/nonexistent/checkpoint", max_logprobs=bad, **ENGINE)  # (not read)


def test_max_logprobs_is_exposed(capped, uncapped):
    assert capped.max_logprobs == MAX_LOGPROBS == 20
    assert uncapped.max_logprobs == -1


def test_sampling_params_take_minus_one_and_no_cap():
    """SamplingParams cannot know the engine's cap: any int >= -1 passes there."""
    sp = SamplingParams(logprobs=-1, prompt_logprobs=1000)
    assert (sp.logprobs, sp.prompt_logprobs) == (-1, 1000)
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match=f"got logprobs={bad!r}"):
            SamplingParams(logprobs=bad)


# ------------------------------------------------------------------------ the cap

OVER = [
    (dict(logprobs=21), "logprobs=21 is more than the engine's max_logprobs=20"),
    (dict(prompt_logprobs=21), "prompt_logprobs=21 is more than the engine's max_logprobs=20"),
    (
        dict(logprobs=-1),
        "logprobs=-1 (the whole vocabulary, 256 tokens) is more than the engine's max_logprobs=20",
    ),
    (dict(prompt_logprobs=-1), "prompt_logprobs=-1 (the whole vocabulary, 256 tokens)"),
]


@pytest.mark.parametrize("kwargs, words", OVER, ids=[str(k) for k, _ in OVER])
def test_over_the_cap_is_refused_when_added_and_nothing_is_queued(capped, kwargs, words):
    llm = capped
    sp = SamplingParams(max_tokens=2, **kwargs)  # (no seed: a queued one would draw one)
    rng = llm._rng.bit_generator.state
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.add_request([5, 6, 7], sp)
    with pytest.raises(ValueError, match=re.escape(f"prompt 1: {words}")):
        llm.generate([[5, 6], [7, 8]], [greedy(2), sp])  # the valid one is not queued either
    assert not llm.has_unfinished_requests() and llm._rng.bit_generator.state == rng
    # The cap itself passes, and the engine goes on.
    (out,) = llm.generate([[5, 6, 7]], greedy(2, logprobs=20, prompt_logprobs=20))
    entries = out.outputs[0].logprobs + out.prompt_logprobs[1:]
    assert len(entries) == 4 and all(len(e) in (20, 21) for e in entries)  # (+ the token)
    check_clean(llm)


def test_the_cap_bounds_minus_one_and_the_vocabulary_bounds_any_cap(params):
    llm = LLM(params, max_logprobs=V - 1, **ENGINE)
    with pytest.raises(
        ValueError, match=re.escape("256 tokens) is more than the engine's max_logprobs=255")
    ):
        llm.add_request([5, 6], SamplingParams(logprobs=-1))
    rid = llm.add_request([5, 6], SamplingParams(logprobs=V - 1))
    llm.abort(rid)
    llm = LLM(params, max_logprobs=-1, **ENGINE)
    with pytest.raises(ValueError, match="prompt_logprobs=257 is more than the model's vocabulary"):
        llm.add_request([5, 6], SamplingParams(prompt_logprobs=V + 1))
    assert not llm.has_unfinished_requests()


def test_a_larger_cap_takes_more_than_20(params, dense):
    llm = LLM(params, max_logprobs=30, **ENGINE)
    prompt = [5, 9, 40, 7]
    (out,) = llm.generate([prompt], greedy(3, logprobs=25, prompt_logprobs=30))
    c = out.outputs[0]
    rows = [prompt + c.token_ids[:j] for j in range(len(c.token_ids))]
    for tok, entry, w in zip(c.token_ids, c.logprobs, log_softmax(dense, rows), strict=True):
        assert list(entry)[0] == tok and len(entry) in (25, 26)
        np.testing.assert_allclose([entry[t] for t in entry], w[list(entry)], atol=TOL)
        assert min(entry.values()) >= np.sort(w)[-25] - TOL  # the 25 most likely
    assert all(len(e) in (30, 31) for e in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="logprobs=31 is more than the engine's max_logprobs=30"):
        llm.generate([prompt], greedy(3, logprobs=31))
    check_clean(llm)


# ------------------------------------------------------- -1: the whole vocabulary


def check_whole(entry, tok, w) -> None:
    """A -1 entry: `tok` first, then every token of the vocabulary by rank; values the
    dense log-softmax `w` [V]; probabilities summing to 1."""
    keys = list(entry)
    assert keys[0] == tok and sorted(keys) == list(range(V))
    got = np.array([entry[t] for t in range(V)], np.float64)
    np.testing.assert_allclose(got, w, atol=TOL)
    assert np.exp(got).sum() == pytest.approx(1.0, abs=1e-4)
    rest = [entry[t] for t in keys[1:]]
    assert rest == sorted(rest, reverse=True)  # the top-k order: ranks 1..V, less tok's
    ranks = [entry[t].rank for t in keys[1:]]
    assert ranks == sorted(set(ranks)) and ranks[0] >= 1 and ranks[-1] <= V
    assert 1 + np.sum(w > w[tok] + TOL) <= entry[tok].rank <= np.sum(w > w[tok] - TOL)


def test_minus_one_gives_every_tokens_logprob(uncapped, dense, monkeypatch):
    """Greedy and seeded sampling with logprobs=-1, one with prompt_logprobs=-1 too (a
    prompt over the step budget: chunked): the steps' top-k is the vocabulary's size."""
    ks = []
    for name in ("prefill_step", "decode_step"):
        fn = getattr(decode, name)

        def spy(*a, _fn=fn, **kw):
            ks.append((kw.get("num_top_logprobs", 0), kw.get("num_prompt_top_logprobs", 0)))
            return _fn(*a, **kw)

        monkeypatch.setattr(decode, name, spy)
    llm = uncapped
    prompts = [[5, 9, 40, 7], list(range(30, 50))]
    sps = [
        greedy(3, logprobs=-1),
        SamplingParams(n=2, temperature=1.5, seed=3, max_tokens=3, logprobs=-1, prompt_logprobs=-1),
    ]
    outs = llm.generate(prompts, sps)
    assert {k for k, _ in ks} == {V} and {pk for _, pk in ks} <= {0, V}
    assert V in {pk for _, pk in ks}
    for prompt, out in zip(prompts, outs, strict=True):
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids) == 3
            rows = [prompt + c.token_ids[:j] for j in range(len(c.token_ids))]
            for tok, e, w in zip(c.token_ids, c.logprobs, log_softmax(dense, rows), strict=True):
                check_whole(e, tok, w)
    p = prompts[1]
    entries = outs[1].prompt_logprobs
    assert len(entries) == len(p) and entries[0] is None
    w = log_softmax(dense, [p[:j] for j in range(1, len(p))])
    for j, e in enumerate(entries[1:]):
        check_whole(e, p[j + 1], w[j])
    # The completions are what they are without logprobs.
    plain = llm.generate(prompts, [dataclasses.replace(sp, logprobs=None) for sp in sps])
    assert [c.token_ids for o in plain for c in o.outputs] == [
        c.token_ids for o in outs for c in o.outputs
    ]
    check_clean(llm)


def test_minus_one_with_beam_search(uncapped, dense):
    prompt = [5, 9, 40, 7]
    sp = SamplingParams(n=2, beam_width=2, max_tokens=3, ignore_eos=True, logprobs=-1)
    (out,) = uncapped.generate([prompt], sp)
    assert len(out.outputs) == 2
    for c in out.outputs:
        rows = [prompt + c.token_ids[:j] for j in range(len(c.token_ids))]
        for tok, e, w in zip(c.token_ids, c.logprobs, log_softmax(dense, rows), strict=True):
            check_whole(e, tok, w)
    check_clean(uncapped)


# ------------------------------------------------------------------------ the server


def job(body: dict, *, chat: bool, max_logprobs: int = MAX_LOGPROBS) -> api.Job:
    return api.parse_job(
        body,
        chat=chat,
        model_name="tiny",
        tokenizer=TOK,
        vocab_size=VOCAB,
        max_model_len=MAX_LEN,
        max_logprobs=max_logprobs,
    )


CHAT = dict(messages=[{"role": "user", "content": "hi"}], logprobs=True)


@pytest.mark.parametrize(
    "body, chat, cap, field, words",
    [
        (dict(CHAT, top_logprobs=21), True, 20, "top_logprobs", "top_logprobs=21 is more than"),
        (dict(CHAT, top_logprobs=31), True, 30, "top_logprobs", "the server's --max-logprobs=30"),
        (dict(CHAT, top_logprobs=-1), True, 20, "top_logprobs", "top_logprobs=-1 (the whole"),
        (dict(CHAT, top_logprobs=-2), True, -1, "top_logprobs", "got top_logprobs=-2"),
        (dict(prompt="a", logprobs=31), False, 30, "logprobs", "logprobs=31 is more than the"),
        (dict(prompt="a", logprobs=-1), False, 255, "logprobs", "--max-logprobs=255"),
        (dict(prompt="a", logprobs=-2), False, 20, "logprobs", "got logprobs=-2"),
        (dict(prompt="a", logprobs=257), False, -1, "logprobs", "vocabulary of 256 tokens"),
    ],
)
def test_the_server_answers_400_over_its_cap(body, chat, cap, field, words):
    with pytest.raises(api.ApiError) as info:
        job(body, chat=chat, max_logprobs=cap)
    e = info.value
    assert (e.status, e.param) == (400, field) and words in e.message, e.message


def test_the_server_takes_up_to_its_cap_and_minus_one_as_the_vocabulary():
    assert job(dict(CHAT, top_logprobs=25), chat=True, max_logprobs=30).params.logprobs == 25
    assert job(dict(prompt="a", logprobs=30), chat=False, max_logprobs=30).params.logprobs == 30
    for chat, body in ((True, dict(CHAT, top_logprobs=-1)), (False, dict(prompt="a", logprobs=-1))):
        assert job(body, chat=chat, max_logprobs=-1).params.logprobs == VOCAB
        assert job(body, chat=chat, max_logprobs=VOCAB).params.logprobs == VOCAB


@pytest.fixture(scope="module")
def server30():
    """A model without a tokenizer (vocab 128): its logprobs name tokens by id, so no two
    alternatives share a name (the byte tokenizer's bytes past ASCII do)."""
    small = dataclasses.replace(TINY, vocab_size=128, num_layers=1)
    llm = LLM(params_helpers.random_params(small, 0), max_logprobs=30, **ENGINE)
    assert llm.tokenizer is None
    yield from serving(llm, "tiny")


def test_the_server_uses_its_engines_cap(server30):
    body = dict(prompt=[5, 6], temperature=0, max_tokens=2, logprobs=25)
    lp = ok(server30, "/v1/completions", body)["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 2
    assert all(len(t) in (25, 26) for t in lp["top_logprobs"])  # (and the sampled token)
    status, obj = request(server30, "/v1/completions", dict(body, logprobs=31))
    assert status == 400 and obj["error"]["param"] == "logprobs"
    assert "logprobs=31 is more than the server's --max-logprobs=30" in obj["error"]["message"]


# ----------------------------------------------------------------------- the scripts


class Stop(Exception):
    """Raised by a stand-in LLM: the script got as far as building its engine."""


def fake_llm(monkeypatch, seen: dict, engine=None):
    """Replaces `LLM` (the scripts import it when they run): records its keyword
    arguments, then returns `engine`, or raises Stop without one."""

    def make(*args, **kwargs):
        seen.update(kwargs)
        if engine is None:
            raise Stop
        return engine

    monkeypatch.setattr(pagedjax.engine, "LLM", make)


@pytest.mark.parametrize("flag, want", [([], 20), (["--max-logprobs", "30"], 30)])
def test_serve_passes_max_logprobs(monkeypatch, flag, want):
    seen = {}
    fake_llm(monkeypatch, seen)
    argv = ["--port", "0", "--quiet", "--backend", "xla", "--compilation-cache", "off", *flag]
    with pytest.raises(Stop):
        serve.main(argv)
    assert seen["max_logprobs"] == want


def test_a_bad_max_logprobs_flag_is_bad_input(monkeypatch, capsys):
    seen = {}
    fake_llm(monkeypatch, seen)
    assert serve.main(["--port", "0", "--max-logprobs", "-2"]) == 2
    assert "--max-logprobs: must be >= 0 or -1 (no cap), got -2" in capsys.readouterr().err
    assert not seen


def test_generate_checks_logprobs_against_max_logprobs(monkeypatch, capsys):
    base = ["--prompt", "x", "--backend", "xla", "--compilation-cache", "off"]
    seen = {}
    fake_llm(monkeypatch, seen)
    rc, out, err = run([*base, "--prompt-logprobs", "21"], capsys)  # before the model loads
    assert (rc, out, seen) == (2, "", {})
    assert "--prompt-logprobs=21 is more than --max-logprobs=20" in err
    with pytest.raises(Stop):
        run([*base, "--logprobs", "25", "--max-logprobs", "30"], capsys)
    assert seen["max_logprobs"] == 30
    # -1 counts as the vocabulary's size: checked once the model has loaded, before output.
    loaded = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=V))
    fake_llm(monkeypatch, seen, loaded)
    rc, out, err = run([*base, "--logprobs", "-1"], capsys)
    assert (rc, out) == (2, "")
    assert "--logprobs=-1 (the whole vocabulary, 256 tokens) is more than --max-logprobs=20" in err
