"""`LLM`'s offline API as code ported from vLLM calls it (`vllm/entrypoints/llm.py`): the
prompt forms `generate` takes, `use_tqdm`, `chat`'s vLLM arguments, and the output
objects' methods. In tests/engine_helpers.py's geometry.
"""

import numpy as np
import pytest
from engine_helpers import GEOMETRY, check_clean, greedy, random_params

from pagedjax import resources
from pagedjax.engine import LLM
from pagedjax.request import CompletionOutput
from pagedjax.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def llm():
    byte = resources.byte_tokenizer()
    tok = Tokenizer(byte.tokenizer, eos_token_ids=[2], chat_template=TEMPLATE)
    return LLM(random_params(), tokenizer=tok, **GEOMETRY)


def test_a_flat_list_of_token_ids_is_one_prompt_as_in_vllm(llm):
    """vLLM's `prompt_to_seq`: a non-empty list of ints is one token-id prompt (a list of
    lists is a list of prompts). It was "prompt 0: a prompt must be a str or a list of
    token ids, got 5"."""
    ids = np.random.default_rng(3).integers(3, 256, size=7).tolist()
    want = llm.generate([ids], greedy(4))[0]
    for prompt in (ids, tuple(ids), np.array(ids)):
        (got,) = llm.generate(prompt, greedy(4))
        assert got.prompt_token_ids == ids and got.prompt is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(llm.generate([ids, ids[:3]], greedy(2))) == 2
    for bad in ([ids[0], ids], [True, 5]):  # an int beside a list, a bool: not one prompt
        with pytest.raises(TypeError, match="prompt 0: a prompt must be a str or a list"):
            llm.generate(bad, greedy(2))
    check_clean(llm)


def test_use_tqdm_takes_a_callable_that_makes_the_bar(llm):
    """vLLM's `use_tqdm` is a bool or a callable making the bar
    (`functools.partial(tqdm, leave=False)`); the callable was ignored for tqdm.auto."""
    made = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.n, self.closed = kw, 0, False
            made.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    outs = llm.generate([[5, 6], [7, 8, 9]], greedy(3), use_tqdm=Bar)
    (bar,) = made
    assert len(outs) == 2 and bar.kw["total"] == 2 and bar.n == 2 and bar.closed
    check_clean(llm)


def test_a_bar_maker_that_raises_leaves_no_request_queued(llm):
    """`use_tqdm`'s bar is made once the requests are queued (scripts/generate.py prints
    then); a maker that raised left them all queued, to run on in later steps."""

    def broken(**kw):
        raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError):
        llm.generate([[5, 6], [7, 8, 9]], greedy(3), use_tqdm=broken)
    assert not llm.has_unfinished_requests()
    check_clean(llm)


def test_completion_output_has_vllms_finished_method():
    """vLLM's `CompletionOutput.finished()`: whether it has a finish reason."""
    out = CompletionOutput(0, "", [5], 0.0, finish_reason="length")
    assert out.finished() is True
    out.finish_reason = None
    assert out.finished() is False


def test_chat_refuses_vllm_arguments_it_would_ignore(llm):
    """`LLM.chat`'s extra keywords are template variables: vLLM's own arguments it does not
    implement were taken as variables and dropped silently (a content format forced to
    "openai" rendered strings; tokenization_kwargs did not reach the tokenizer)."""
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(TypeError, match="chat.. does not support vLLM's tokenization_kwargs"):
        llm.chat(conv, greedy(2), tokenization_kwargs={"truncation": True})
    for fmt in ("openai", "string", None):
        with pytest.raises(ValueError, match=f"chat_template_content_format={fmt!r}"):
            llm.chat(conv, greedy(2), chat_template_content_format=fmt)
    (out,) = llm.chat(conv, greedy(2), chat_template_content_format="auto")
    assert out.prompt == "<user>hi"
    check_clean(llm)


def test_get_default_sampling_params_is_vllms_name(llm):
    """vLLM's `LLM.get_default_sampling_params()` was an AttributeError."""
    assert llm.get_default_sampling_params() == llm.default_sampling_params()
