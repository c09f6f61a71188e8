"""`LLM.generate`'s list semantics and output fields against vLLM's `LLM.generate`: outputs
in input order whatever order they finish in, duplicate prompts as separate requests,
completions ordered by index, and the deliberate difference in `cumulative_logprob`
(a float without logprobs, where vLLM v1 gives None). In tests/engine_helpers.py's
geometry."""

import pytest
from engine_helpers import GEOMETRY, check_clean, greedy, random_params

from pagedjax import resources
from pagedjax.engine import LLM
from pagedjax.request import CompletionOutput, Logprob, SamplingParams
from pagedjax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llm():
    byte = resources.byte_tokenizer()
    return LLM(random_params(), tokenizer=Tokenizer(byte.tokenizer, eos_token_ids=[2]), **GEOMETRY)


def test_outputs_follow_the_prompts_whatever_order_they_finish_in(llm):
    """The first prompt runs longest and finishes last; the same prompt twice is two
    requests with their own outputs; n > 1 completions come ordered by index."""
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], "ab"]
    params = [greedy(7), greedy(1), greedy(3), SamplingParams(n=3, max_tokens=2, seed=4)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs[:3]] == [7, 1, 3]
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9], [5, 6, 7], [97, 98]]
    assert [o.prompt for o in outs] == [None, None, None, "ab"]
    assert len({o.request_id for o in outs}) == 4 and all(o.finished for o in outs)
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids[:3]  # greedy
    assert [c.index for c in outs[3].outputs] == [0, 1, 2]
    for o in outs[:3]:
        c = o.outputs[0]
        assert (c.finish_reason, c.stop_reason) == ("length", None)
    check_clean(llm)


def test_list_arguments_of_the_wrong_length_are_refused_before_queueing(llm):
    """vLLM's length checks: sampling params, priorities, LoRA requests per prompt."""
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        llm.generate([[5], [6]], [greedy(1)] * 3)
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate([[5], [6]], greedy(1), priority=[0])
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        llm.generate([[5], [6]], greedy(1), lora_request=[None])
    with pytest.raises(TypeError, match=r"prompt 1: .*\['multi_modal_data'\] are not supported"):
        llm.generate(["a", {"prompt": "b", "multi_modal_data": {"image": 0}}], greedy(1))
    check_clean(llm)


def test_cumulative_logprob_is_a_float_with_or_without_logprobs(llm):
    """Deliberate (request.CompletionOutput): vLLM v1 gives None when logprobs were not
    asked for; the engine gives the same sum either way (the CLIs report it)."""
    sp = dict(temperature=1.0, max_tokens=5, seed=3)
    (asked,) = llm.generate([[5, 6, 7]], SamplingParams(logprobs=0, **sp))
    (plain,) = llm.generate([[5, 6, 7]], SamplingParams(**sp))
    a, p = asked.outputs[0], plain.outputs[0]
    assert p.logprobs is None and p.token_ids == a.token_ids
    total = sum(d[t] for d, t in zip(a.logprobs, a.token_ids, strict=True))
    assert isinstance(p.cumulative_logprob, float)
    assert p.cumulative_logprob == pytest.approx(a.cumulative_logprob) == pytest.approx(total)
    check_clean(llm)


def test_completion_output_fields_are_in_vllms_order():
    """Built positionally as vLLM's (index, text, token_ids, cumulative_logprob, logprobs,
    finish_reason, stop_reason), each value lands in its field: the logprobs were taken
    for the finish reason."""
    entries = [{5: Logprob(-0.5, 1, "a")}]
    c = CompletionOutput(0, "a", [5], -0.5, entries, "stop", 5)
    assert (c.logprobs, c.finish_reason, c.stop_reason) == (entries, "stop", 5)
    assert CompletionOutput(0, "", [], 0.0, None).finish_reason is None  # (vLLM's default)
