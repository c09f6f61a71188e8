"""pagedjax/openai_api.py's chat rendering as vLLM's: what a request may not change of
it (its own `chat_template`), and what /tokenize renders of it (the request's `tools`).

No engine and no HTTP: the byte tokenizer (`resources.byte_tokenizer`) with a template
that renders the tools' names, as tests/test_serve_tools.py's does.
"""

import pytest
from openai_api_helpers import MAX_LEN, VOCAB

from pagedjax import openai_api as api
from pagedjax import resources
from pagedjax.tokenizer import Tokenizer

TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOK = Tokenizer(resources.byte_tokenizer().tokenizer, chat_template=TEMPLATE)
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
SIZES = dict(model_name="tiny", tokenizer=TOK, max_model_len=MAX_LEN)


def chat_job(body: dict) -> api.Job:
    return api.parse_job(dict(messages=MESSAGES, **body), chat=True, vocab_size=VOCAB, **SIZES)


def tokenize(body: dict) -> dict:
    return api.tokenize(dict(messages=MESSAGES, **body), **SIZES)


@pytest.mark.parametrize("choice", [None, "none", "required", {"function": {"name": "add"}}])
def test_tokenize_renders_the_tools_as_the_chat_request_does(choice):
    """vLLM's /tokenize takes a chat request's `tools` (the template renders them): they
    were ignored, so a client counting a tool request's prompt got fewer tokens than its
    answer's usage.prompt_tokens (the count of the prompt without them)."""
    body = dict(tools=TOOLS)
    if choice is not None:
        body["tool_choice"] = choice
    want = chat_job({**body, "tool_choice": choice or "none"}).prompts[0]
    got = tokenize(body)  # (its tool_choice, which vLLM's /tokenize has not, changes nothing)
    assert TOK.decode(got["tokens"]) == "<tools>add;</tools>\n<user>hi\n<assistant>"
    assert got["tokens"] == want and got["count"] == len(want)
    assert tokenize({})["tokens"] == chat_job({}).prompts[0]  # (no tools: none rendered)


@pytest.mark.parametrize(
    "tools, words",
    [
        (5, "tools must be a non-empty list"),
        ([{"type": "function", "function": {}}], "tools[0]"),
        ([TOOLS[0], TOOLS[0]], "given twice"),
    ],
)
def test_tokenize_refuses_bad_tools_as_the_chat_request_does(tools, words):
    with pytest.raises(api.ApiError, match=words.replace("[", r"\[")) as e:
        tokenize(dict(tools=tools))
    assert (e.value.status, e.value.param) == (400, "tools")


@pytest.mark.parametrize("render", [chat_job, tokenize])
def test_a_request_chat_template_is_a_400_not_ignored(render):
    """vLLM refuses a request's `chat_template` (without --trust-request-chat-template),
    as this server refuses one in chat_template_kwargs: it was ignored, and the messages
    rendered with the server's template, the answer saying nothing of it."""
    with pytest.raises(api.ApiError, match="chat_template in a request is not supported") as e:
        render(dict(chat_template="{{ messages[0].content }}"))
    assert (e.value.status, e.value.param) == (400, "chat_template")
    assert render(dict(chat_template=None))  # (null: left out)


@pytest.mark.parametrize("call", [{"name": "add"}, "required", "add"])
def test_a_deprecated_function_call_that_forces_a_call_is_a_400(call):
    """OpenAI's deprecated `function_call` naming a function (its `functions` are a 400
    here) was ignored: the answer a text, where the client asked for a call."""
    for chat in (True, False):
        body = dict(function_call=call, max_tokens=2)
        body |= dict(messages=MESSAGES) if chat else dict(prompt="hi")
        with pytest.raises(api.ApiError, match="function_call .* is not supported") as e:
            api.parse_job(body, chat=chat, vocab_size=VOCAB, **SIZES)
        assert (e.value.status, e.value.param) == (400, "function_call")


@pytest.mark.parametrize("call", [None, "none", "auto"])
def test_a_function_call_that_asks_for_no_call_passes(call):
    assert chat_job(dict(function_call=call, max_tokens=2)).params.max_tokens == 2
