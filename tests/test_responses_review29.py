"""Review 29 of the OpenAI answers: pagedjax/tool_calls.py's parsed calls,
pagedjax/openai_responses.py's builders and pagedjax/openai_echo.py, on the cases
earlier reviews left: texts whose calls hold numbers JSON cannot write back, and the
echo of a string prompt that truncate_prompt_tokens left whole.
"""

import json

import pytest
from openai_api_helpers import CharTokenizer, job

from pagedjax.tool_calls import ToolRequest


def strict_json(text: str):
    """`text` read as a strict JSON parser (JavaScript's JSON.parse) reads it: no NaN,
    Infinity or -Infinity."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "choice, text",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": -2E+308}</tool_call>'),
        ("llama3_json", '{"name": "f", "parameters": {"x": [1.5, -1e999]}}'),
        ("required", '[{"name": "f", "parameters": {"x": 2e308}}]'),
    ],
)
def test_numbers_beyond_a_doubles_range_make_no_arguments_json_cannot_read(choice, text):
    """Python's json reads 1e400 (valid JSON) as infinity and writes it back as
    "Infinity": the call's arguments were no JSON (JSON.parse refuses them), as NaN's were
    before they were made no call. Such a text is now no call either: the content."""
    if choice == "required":
        req = ToolRequest([], "required")
    else:
        req = ToolRequest([], "auto", parser=choice)
    content, calls, finish = req.reply(text, "stop")
    for call in calls:  # (the old code: '{"x": Infinity}')
        strict_json(call["function"]["arguments"])
    assert (content, calls, finish) == (text, [], "stop")


@pytest.mark.parametrize(
    "choice, text, arguments",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1.7e308}}</tool_call>', 1.7e308),
        ("llama3_json", '{"name": "f", "parameters": {"x": 1e-400}}', 0.0),
        ("required", '[{"name": "f", "parameters": {"x": 12345678901234567890123}}]', None),
    ],
)
def test_numbers_within_range_still_make_calls(choice, text, arguments):
    """Large finite floats, underflow to 0.0 and big ints are JSON written back: calls."""
    if choice == "required":
        req = ToolRequest([], "required")
    else:
        req = ToolRequest([], "auto", parser=choice)
    _, calls, finish = req.reply(text, "stop")
    assert finish == "tool_calls" and len(calls) == 1
    x = strict_json(calls[0]["function"]["arguments"])["x"]
    assert x == (12345678901234567890123 if arguments is None else arguments)


# ------------------------------------------------------------------------------- echo


class BosTokenizer(CharTokenizer):
    """`CharTokenizer` that adds a BOS (id 1, "<s>", special) before a text's ids."""

    special_ids = frozenset({1})
    bos_token_id, add_bos = 1, True

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        return ([1] if add_bos is not False else []) + super().encode(text)

    def decode(self, ids, skip_special_tokens: bool = True, context=()) -> str:
        shown = [i for i in ids if not (skip_special_tokens and i == 1)]
        return "".join("<s>" if i == 1 else chr(i) for i in shown)


@pytest.mark.parametrize("trunc", [None, 10, -1])
def test_echo_of_a_string_prompt_truncation_did_not_cut_is_the_prompt_as_given(trunc):
    """openai_echo's docstring: a string prompt is echoed as given (vLLM's), one that
    truncate_prompt_tokens cut as its kept ids decode. A truncate_prompt_tokens that
    cut nothing (10 or -1 for a 4-token prompt) made the echo the decoded ids, the
    tokenizer's BOS shown: "<s>abc" for the prompt "abc"."""
    j = job(
        dict(prompt=["abc", "abcdefghijkl"], echo=True, truncate_prompt_tokens=trunc),
        tokenizer=BosTokenizer(),
    )
    long = "abcdefghijkl" if trunc != 10 else "<s>defghijkl"  # 10: BOS kept, the rest cut
    assert j.echo == ["abc", long]
    assert j.prompts[0] == [1, 97, 98, 99]
