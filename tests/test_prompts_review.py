"""`LLM.generate`'s and `LLM.chat`'s arguments as code ported from vLLM passes them
(`pagedjax.prompts.request_lists`, `pagedjax.prompts.chat_prompts`): what is neither a
prompt nor a list of them, and arguments `chat` does not take. In
tests/engine_helpers.py's geometry.
"""

import numpy as np
import pytest
from engine_helpers import GEOMETRY, check_clean, greedy, random_params

from pagedjax import resources
from pagedjax.engine import LLM
from pagedjax.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
CONV = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm():
    byte = resources.byte_tokenizer()
    tok = Tokenizer(byte.tokenizer, eos_token_ids=[2], chat_template=TEMPLATE)
    return LLM(random_params(), tokenizer=tok, **GEOMETRY)


@pytest.mark.parametrize("prompts", [None, 5, 2.5, np.array(7), b"hi", bytearray(b"hi")])
def test_what_is_no_prompt_nor_a_list_of_them_is_named(llm, prompts):
    """None, a number or a 0-d array were "'NoneType' object is not iterable" (nothing
    named `prompts`); bytes were read as a list of ints, "prompt 0: ... got 104"."""
    with pytest.raises(TypeError, match="prompts must be a prompt .* or a list of them, got"):
        llm.generate(prompts, greedy(2))
    check_clean(llm)
    assert [o.prompt for o in llm.generate(["hi"], greedy(1))] == ["hi"]


@pytest.mark.parametrize(
    "kw", [dict(priority=[1]), dict(on_step=print), dict(on_token=lambda *a: None)]
)
def test_chat_refuses_generate_arguments_it_does_not_take(llm, kw):
    """`chat`'s extra keywords are template variables: `priority` (vLLM's chat has none)
    was rendered into nothing and the request ran at priority 0, silently."""
    (name,) = kw
    with pytest.raises(TypeError, match=f"chat.. takes no {name} .a generate.. argument"):
        llm.chat(CONV, greedy(2), **kw)
    check_clean(llm)
    # A template variable of that name still reaches the template.
    (out,) = llm.chat(
        CONV, greedy(1), chat_template="p={{ priority }}", chat_template_kwargs={"priority": 3}
    )
    assert out.prompt == "p=3"


def test_a_held_finished_output_is_never_lost_to_a_later_request_of_its_id(llm):
    """An `add_request` that finished inside a `generate` call waits for `step()`; the
    next call's counter picked its id again, and that request's abort (an on_step that
    raised) dropped the held output as its own: `step()` returned nothing. An explicit
    id reused so did the same."""
    llm.add_request([5, 6], greedy(1), request_id="1")
    llm.generate([[7, 8]], greedy(3))  # "1" finishes in it: its output is held

    def boom(_):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        llm.generate([[9, 10]], greedy(50), on_step=boom)  # aborted at its first step
    llm.add_request([11, 12], greedy(50), request_id="1")  # (an explicit id reused)
    llm.abort("1")
    (out,) = llm.step()
    assert out.request_id == "1" and out.prompt_token_ids == [5, 6] and out.finished
    check_clean(llm)


def test_chat_takes_vllms_unsupported_arguments_at_their_default(llm):
    """vLLM's `mm_processor_kwargs` / `tokenization_kwargs` default to None there: None
    asks for nothing (it was refused), a value is still refused by name."""
    (out,) = llm.chat(CONV, greedy(2), mm_processor_kwargs=None, tokenization_kwargs=None)
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(TypeError, match="does not support vLLM's mm_processor_kwargs"):
        llm.chat(CONV, greedy(2), mm_processor_kwargs={"x": 1})
