"""pagedjax.request.Logprob: a float that also carries vLLM's `.logprob`, `.rank` and
`.decoded_token`, and the engine's logprobs entries made of them.

The type first: it must behave as the float it is (code that reads entries as
{token id: float}). Then the engine (the tiny preset with random weights and its byte
tokenizer, in test_engine.py's geometry): each entry's ranks against those of the dense
model's log-softmax (1 + the tokens strictly more likely, within the tolerance the
values are checked to), for greedy, seeded sampling, prompt logprobs, beam search, with
asynchronous scheduling on and off; decoded tokens against the tokenizer.
"""

import copy
import dataclasses
import json
import math
import pickle

import numpy as np
import params_helpers
import pytest

from pagedjax import engine, request
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, Logprob, SamplingParams
from pagedjax.tokenizer import CONTEXT_IDS

TINY = PRESETS["tiny"]
GEOMETRY = dict(page_size=8, num_pages=64, backend="xla", max_num_seqs=8)
TOL = 2e-5  # the engine's logprobs against the dense model's (test_engine's tolerance)


# ------------------------------------------------------------------------ the type


def test_logprob_is_the_float_it_holds():
    x = Logprob(-0.5, rank=3, decoded_token=" a")
    assert isinstance(x, float) and engine.Logprob is request.Logprob
    assert (x.logprob, x.rank, x.decoded_token) == (-0.5, 3, " a")
    assert type(x.logprob) is float
    assert x == -0.5 and -0.5 == x and x != -0.25 and hash(x) == hash(-0.5)  # noqa: SIM300
    assert x + 1 == 0.5 and 2 * x == -1.0 and -x == 0.5 and x < 0 < -x and abs(x) == 0.5
    assert math.isclose(math.exp(x), math.exp(-0.5)) and math.isfinite(x)
    assert {7: x, 9: Logprob(-2.0, 1)} == {7: -0.5, 9: -2.0}  # equality ignores rank/text
    assert sorted([Logprob(-1.0, 1), x, -3.0]) == [-3.0, -1.0, -0.5]
    assert max({4: Logprob(-1.0), 5: x}.items(), key=lambda kv: kv[1])[0] == 5
    assert json.dumps({7: x, 8: Logprob(-1e-3)}) == json.dumps({7: -0.5, 8: -1e-3})
    assert repr(x) == str(x) == f"{x}" == "-0.5" and f"{x:.2f}" == "-0.50"
    assert np.asarray([x]).dtype == np.float64 and np.float32(x) == np.float32(-0.5)
    assert sum({1: x, 2: Logprob(-1.5)}.values()) == -2.0
    inf = Logprob(float("-inf"), rank=256)
    assert math.isinf(inf) and inf < x and json.dumps(inf) == "-Infinity"
    assert Logprob(np.float32(-0.25)) == -0.25 and Logprob(-1).rank is None  # an int value
    assert Logprob(-1.0).decoded_token is None
    for name in ("logprob", "rank", "decoded_token", "other"):
        with pytest.raises(AttributeError):
            setattr(x, name, 1)


def test_logprob_pickles_and_copies_with_its_rank_and_text():
    x = Logprob(-0.75, rank=2, decoded_token="b")
    for y in (pickle.loads(pickle.dumps(x)), pickle.loads(pickle.dumps(x, protocol=2))):
        assert type(y) is Logprob and y == -0.75
        assert (y.logprob, y.rank, y.decoded_token) == (-0.75, 2, "b")
    assert copy.copy(x) is x and copy.deepcopy({1: x})[1] is x  # immutable
    entry = {5: x, 6: Logprob(-1.0, 1)}
    assert pickle.loads(pickle.dumps(entry)) == entry == {5: -0.75, 6: -1.0}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(logprob="-1.0"), "logprob must be a real number, got logprob='-1.0'"),
        (dict(logprob=True), "logprob must be a real number, got logprob=True"),
        (dict(logprob=-1.0, rank=1.5), "rank must be an int or None, got rank=1.5"),
        (dict(logprob=-1.0, decoded_token=7), "decoded_token must be a str or None, got 7"),
    ],
)
def test_logprob_refuses_bad_values(kwargs, match):
    with pytest.raises(TypeError, match=match):
        Logprob(**kwargs)


# ------------------------------------------------------------------ in the engine


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


@pytest.fixture(scope="module")
def dense(params):
    return params_helpers.dense_last_logits(params)


def log_softmax(dense, rows) -> np.ndarray:
    logits = dense(rows)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def check_entry(entry, tok, w, k, tokenizer, context, skip=True) -> int:
    """One entry against the dense log-softmax `w` [V] of its position: `tok` first with
    its vocabulary rank (1 + the tokens strictly more likely, up to TOL), then the k most
    likely ranked 1..k; every value a Logprob named as the tokenizer names it after the
    ids `context`. Returns `tok`'s rank."""
    keys = list(entry)
    top = np.argsort(-w, kind="stable")[:k].tolist()
    assert keys == [tok] + [t for t in top if t != tok]
    assert all(type(v) is Logprob for v in entry.values())
    np.testing.assert_allclose([entry[t].logprob for t in keys], w[keys], atol=TOL)
    rank = entry[tok].rank
    assert 1 + np.sum(w > w[tok] + TOL) <= rank <= np.sum(w > w[tok] - TOL)
    assert [entry[t].rank for t in keys[1:]] == [top.index(t) + 1 for t in keys[1:]]
    if tokenizer is None:
        assert all(v.decoded_token is None for v in entry.values())
    else:
        ctx = context[-CONTEXT_IDS:]
        if skip:
            ctx = [i for i in ctx if i not in tokenizer.special_ids]
        names = tokenizer.decode_each(keys, skip_special_tokens=False, context=ctx)
        assert [entry[t].decoded_token for t in keys] == names
    return rank


def check_completions(dense, tokenizer, prompt, out, k) -> list[int]:
    """Every completion's entries (`check_entry`); the sampled tokens' ranks."""
    ranks = []
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) > 0
        rows = [prompt + c.token_ids[:j] for j in range(len(c.token_ids))]
        lsm = log_softmax(dense, rows)
        for row, tok, entry, w in zip(rows, c.token_ids, c.logprobs, lsm, strict=True):
            ranks.append(check_entry(entry, tok, w, k, tokenizer, row))
    return ranks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_logprobs_ranks_and_decoded_tokens_are_the_dense_models(params, dense, async_scheduling):
    """Greedy (logprobs=0 and 3), seeded sampling (n=2, hot enough to draw unlikely tokens,
    ranked past the top-k) and prompt logprobs of a chunked prompt (budget 16), prefix
    caching off, all in the same steps."""
    llm = LLM(
        params,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
        enable_prefix_caching=False,
        **GEOMETRY,
    )
    tok = llm.tokenizer
    prompts = ["def f(x):", "a = [1, 2]", "import numpy as np\nimport jax.numpy as jnp  # 42"]
    sps = [
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=0),
        SamplingParams(n=2, temperature=2.0, seed=7, max_tokens=8, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2),
    ]
    outs = llm.generate(prompts, sps)
    ids = [o.prompt_token_ids for o in outs]
    greedy = check_completions(dense, tok, ids[0], outs[0], 0)
    greedy += check_completions(dense, tok, ids[2], outs[2], 3)
    assert set(greedy) == {1}
    sampled = check_completions(dense, tok, ids[1], outs[1], 3)
    assert max(sampled) > 3  # drawn outside the top-3: its rank is still its own
    p = ids[2]
    assert len(p) > 16 and outs[2].prompt_logprobs[0] is None
    w = log_softmax(dense, [p[:j] for j in range(1, len(p))])
    ranks = [
        check_entry(e, p[j + 1], w[j], 2, tok, p[: j + 1])
        for j, e in enumerate(outs[2].prompt_logprobs[1:])
    ]
    assert max(ranks) > 2  # prompt tokens the model finds unlikely
    assert llm.block_manager.stats().num_used_pages == 0


def test_beam_search_logprobs_rank_each_beams_tokens(params, dense):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompt = llm.encode("def f(x):")[1]
    sp = SamplingParams(n=3, beam_width=3, max_tokens=5, ignore_eos=True, logprobs=2)
    (out,) = llm.generate([prompt], sp)
    ranks = check_completions(dense, llm.tokenizer, prompt, out, 2)
    assert len(out.outputs) == 3 and max(ranks) > 1  # beams that took a second choice


def test_decoded_tokens_are_none_without_a_tokenizer_ranks_are_not():
    small = dataclasses.replace(TINY, vocab_size=128, num_layers=1)  # no byte tokenizer
    params = params_helpers.random_params(small, 0)
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    assert llm.tokenizer is None
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate([prompt], sp)
    dense = params_helpers.dense_last_logits(params)
    ranks = check_completions(dense, None, prompt, out, 2)
    assert set(ranks) == {1}
    w = log_softmax(dense, [prompt[:j] for j in range(1, len(prompt))])
    for j, e in enumerate(out.prompt_logprobs[1:]):
        check_entry(e, prompt[j + 1], w[j], 1, None, prompt[: j + 1])
