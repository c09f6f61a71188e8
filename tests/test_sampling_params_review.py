"""`SamplingParams` and the OpenAI server's mapping of request fields onto it, against
vLLM's: a field vLLM accepts with some meaning means the same here or is refused by name.

* Every field was positional, in another order than vLLM's: `SamplingParams(1, 0.5)` was
  a temperature of 0.5 here, a presence penalty in vLLM. Only `n` (first in both) is.
* `output_kind=True` was taken as DELTA (True == 1), where every other int field, and
  numpy's True, refuse a bool.
* vLLM request fields the server does not implement were ignored without a word:
  `truncation_side: "right"` (keep the prompt's first tokens; the last were kept),
  `return_tokens_as_token_ids` (logprobs' tokens as "token_id:<id>"),
  `logprob_token_ids`, `thinking_token_budget` and `repetition_detection`. They are 400s
  naming the field; their "off" values (null, false, "left", -1) still pass.
* The server's 400 for a seed outside int64 (or not an int) gave SamplingParams' range,
  [0, 2**32), though the server takes any int64 (-5 runs).

No engine: the params on their own and `openai_fields.sampling_params`.
"""

import pytest

from pagedjax.openai_fields import ApiError, sampling_params
from pagedjax.sampling_params import SamplingParams


def test_only_n_is_positional():
    # vLLM's fields run n, presence_penalty, frequency_penalty, repetition_penalty,
    # temperature: SamplingParams(1, 0.5) was temperature 0.5 here, a presence penalty there.
    assert SamplingParams(2).n == 2
    with pytest.raises(TypeError, match="positional"):
        SamplingParams(1, 0.5)


@pytest.mark.parametrize("bad", [True, False])
def test_output_kind_refuses_a_bool(bad):
    with pytest.raises(ValueError, match=f"output_kind={bad}"):
        SamplingParams(output_kind=bad)


def _params(body):
    return sampling_params(body, max_tokens=16, logprobs=None, vocab_size=100)


@pytest.mark.parametrize(
    "name, value",
    [
        ("truncation_side", "right"),
        ("return_tokens_as_token_ids", True),
        ("logprob_token_ids", [3, 4]),
        ("thinking_token_budget", 10),
        ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}),
    ],
)
def test_unimplemented_vllm_fields_are_refused_by_name(name, value):
    with pytest.raises(ApiError) as info:
        _params({name: value})
    e = info.value
    assert e.status == 400 and e.param == name, (e.param, e.message)
    assert f"{name}={value!r}" in e.message, e.message


@pytest.mark.parametrize(
    "name, value",
    [
        ("truncation_side", None),
        ("truncation_side", "left"),
        ("return_tokens_as_token_ids", None),
        ("return_tokens_as_token_ids", False),
        ("logprob_token_ids", None),
        ("thinking_token_budget", None),
        ("thinking_token_budget", -1),
        ("repetition_detection", None),
    ],
)
def test_their_off_values_pass(name, value):
    assert _params({name: value}) == _params({})


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 1.0, True, "7"])
def test_a_bad_seed_names_the_servers_range(seed):
    # The server takes any int64 (folded into the engine's [0, 2**32)), but its 400 said
    # "seed must be None or an int in [0, 2**32)", SamplingParams' range, which -5 is not.
    with pytest.raises(ApiError) as info:
        _params({"seed": seed})
    e = info.value
    assert e.param == "seed" and f"int64 (-1: none), got seed={seed!r}" in e.message, e.message
    assert _params({"seed": -5}).seed == 2**32 - 5
