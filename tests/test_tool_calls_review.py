"""pagedjax/tool_calls.py's parsers and answers on adversarial texts, without an engine:
several calls, text around them, malformed JSON, arguments that are no object, unicode
and escapes, streams split at every character, each tool_choice's finish_reason, and
texts whose calls an HTTP answer could not carry (lone surrogates, deep nesting, NaN).
"""

import json
import re
import sys

import pytest

from pagedjax.tool_calls import ToolRequest

CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
QUOTED = 'say "hi" \\ </b> {x}; café 😀'  # escaped quotes, a backslash, braces, non-ASCII


def hermes(name, args, *, ascii_escapes=False) -> str:
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=ascii_escapes)
    return f"<tool_call>\n{body}\n</tool_call>"


def llama(name, args) -> str:
    return json.dumps({"name": name, "parameters": args})


def auto(parser: str, *, parallel: bool = True) -> ToolRequest:
    return ToolRequest([], "auto", parser=parser, parallel=parallel)


def calls_of(calls: list[dict]) -> list[tuple[str, object]]:
    """(name, parsed arguments) of each call, its id and type checked."""
    assert all(CALL_ID.fullmatch(c["id"]) and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# (parser, text, content, calls or None for none): vLLM's answers to these texts.
CASES = [
    (
        "hermes",
        "Let me check.\n" + hermes("add", {"a": 1}) + "\n" + hermes("f", {}) + "\nDone.",
        "Let me check.\n",  # text between and after the calls dropped, as vLLM
        [("add", {"a": 1}), ("f", {})],
    ),
    ("hermes", hermes("q", {"s": QUOTED}), None, [("q", {"s": QUOTED})]),
    ("hermes", hermes("q", {"s": QUOTED}, ascii_escapes=True), None, [("q", {"s": QUOTED})]),
    ("hermes", hermes("q", {"s": "<tool_call>"}), None, [("q", {"s": "<tool_call>"})]),
    # Arguments that are no object are written back as they are, as vLLM's json.dumps.
    ("hermes", hermes("f", '{"a": 1}'), None, [("f", '{"a": 1}')]),
    ("hermes", hermes("f", [1, "x"]) + hermes("g", None), None, [("f", [1, "x"]), ("g", None)]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),  # unclosed
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {}</tool_call>', None, None),
    ("hermes", hermes("f", {}) + '<tool_call>{"name": "g", "argu', None, None),  # cut
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>', None, None),
    ("hermes", '<tool_call>{"name": "f", "parameters": {}}</tool_call>', None, None),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
        None,
        None,
    ),
    ("hermes", "<tool_call>[" + hermes("f", {})[11:-12] + "]</tool_call>", None, None),
    ("hermes", "plain < text <tool_ca", None, None),
    (
        "llama3_json",
        "<|python_tag|>" + llama("add", {"a": 1}) + "; " + llama("q", {"s": QUOTED}),
        None,
        [("add", {"a": 1}), ("q", {"s": QUOTED})],
    ),
    ("llama3_json", ' {"name": "f", "arguments": [1]}\n', None, [("f", [1])]),
    ("llama3_json", llama("f", "text"), None, [("f", "text")]),
    ("llama3_json", llama("f", {}) + '; {"name": "g", "param', None, None),  # cut
    ("llama3_json", '{"answer": 4}', None, None),  # JSON that is no call
    ("llama3_json", "<|python_tag|>brave_search.call(query='x')", None, None),
    ("llama3_json", 'It is {"name": "f", "parameters": {}}', None, None),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_parsers_answer_as_vllm(parser, text, content, calls):
    for finish in ("stop", "length", "error"):
        got_content, got_calls, got_finish = auto(parser).reply(text, finish)
        if calls is None:  # no calls: the whole text is the content, the engine's finish
            assert (got_content, got_calls, got_finish) == (text, [], finish)
            continue
        assert got_content == content and calls_of(got_calls) == calls
        assert got_finish == "tool_calls"  # vLLM's whenever "auto" found calls
    content_1, calls_1, _ = auto(parser, parallel=False).reply(text, "stop")
    assert content_1 == (text if calls is None else content)
    assert calls_of(calls_1) == (calls or [])[:1]


def streamed(req: ToolRequest, pieces: list[str], finish: str):
    """(content, calls, finish_reason) of a stream of `pieces`, checking that no piece but
    the last carries calls or a finish_reason."""
    s, sent = req.stream(0), ""
    for piece in pieces[:-1]:
        out, calls, end = s.next(piece, None)
        assert calls is None and end is None
        sent += out
    out, calls, end = s.next(pieces[-1], finish)
    calls = calls or []
    assert [c.pop("index") for c in calls] == list(range(len(calls)))
    return sent + out, calls, end


@pytest.mark.parametrize("parser, text", [(p, t) for p, t, _, _ in CASES])
def test_streams_split_anywhere_answer_as_the_whole_text(parser, text):
    """Split at every character boundary, and one character a piece, a stream's content
    adds up to the non-streamed content ("" for null) and its calls are the same."""
    want_content, want_calls, want_finish = auto(parser).reply(text, "length")
    want = (want_content or "", calls_of(want_calls), want_finish)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        content, calls, finish = streamed(auto(parser), pieces, "length")
        assert (content, calls_of(calls), finish) == want, pieces


REQUIRED_F = '{"name": "f", "parameters": {}}'


@pytest.mark.parametrize(
    "choice, text, finish, want_finish, num_calls",
    [
        ("required", f"[{REQUIRED_F}, {REQUIRED_F}]", "stop", "tool_calls", 2),
        ("required", f"[{REQUIRED_F}]", "length", "length", 1),
        ("required", '[{"name": "f", "parameters": {"a": ', "length", "length", 0),
        ("required", '[{"name": "f", "parameters": {"a": ', "error", "error", 0),
        ("named", '{"a": 1}', "stop", "stop", 1),  # vLLM's: a named call keeps "stop"
        ("named", '{"a": ', "length", "length", 1),
        ("named", '{"a": ', "error", "error", 1),
    ],
)
def test_required_and_named_finish_reasons(choice, text, finish, want_finish, num_calls):
    req = ToolRequest([], choice, name="f" if choice == "named" else None)
    content, calls, got_finish = req.reply(text, finish)
    assert got_finish == want_finish and len(calls) == num_calls
    assert content == ("" if num_calls else text)
    if choice == "named":  # its text, whatever it is, is the call's arguments
        assert calls[0]["function"] == {"name": "f", "arguments": text}
    assert streamed(ToolRequest([], choice, name=req.name), list(text), finish)[0] == content


# ----------------------------------------------------------- texts an answer cannot carry


def carried(calls: list[dict]) -> list[tuple[str, object]]:
    """`calls_of` after a trip through the HTTP answer's encoding (http_io's
    `json.dumps(ensure_ascii=False).encode()`), which must not raise."""
    body = json.dumps({"tool_calls": calls}, ensure_ascii=False).encode()
    return calls_of(json.loads(body)["tool_calls"])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_lone_surrogate_escapes_in_arguments_stay_json_utf8_can_carry(parser):
    """A `\\ud83d` escape without its pair is valid JSON but no Unicode text: the
    arguments keep it escaped, so that the answer encodes (it raised
    UnicodeEncodeError, a 500 or a broken stream)."""
    args = {"s": "\ud83d", "t": "é😀"}
    text = hermes("f", args, ascii_escapes=True) if parser == "hermes" else llama("f", args)
    content, calls, finish = auto(parser).reply(text, "stop")
    assert carried(calls) == [("f", args)] and finish == "tool_calls"
    assert "é😀" in calls[0]["function"]["arguments"]  # other text still unescaped
    req = ToolRequest([], "required")
    _, calls, _ = req.reply(json.dumps([{"name": "f", "parameters": args}]), "stop")
    assert carried(calls) == [("f", args)]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_name_that_is_no_text_is_no_call(parser):
    text = hermes("\ud800", {}, ascii_escapes=True) if parser == "hermes" else llama("\ud800", {})
    assert auto(parser).reply(text, "stop") == (text, [], "stop")


@pytest.mark.parametrize("choice", ["hermes", "llama3_json", "required"])
def test_deeply_nested_arguments_never_raise(choice):
    """Arguments nested as deep as the JSON decoder goes either make a call that
    re-reads as them or no call (the text the content); never a RecursionError (writing
    back what the decoder read could go deeper than the decoder had: a 500)."""
    for depth in range(1, sys.getrecursionlimit() + 20):
        args = "[" * depth + "]" * depth
        if choice == "hermes":
            text, req = f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>', auto(choice)
        elif choice == "llama3_json":
            text, req = f'{{"name": "f", "parameters": {args}}}', auto(choice)
        else:
            text, req = f'[{{"name": "f", "parameters": {args}}}]', ToolRequest([], choice)
        content, calls, _ = req.reply(text, "stop")
        if calls:
            assert [c["function"]["arguments"] for c in calls] == [args]
        else:
            assert content == text


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": -Infinity}</tool_call>'),
        ("llama3_json", '{"name": "f", "parameters": {"x": Infinity}}'),
    ],
)
def test_nan_and_infinity_are_no_json(parser, text):
    """Python's json reads NaN and Infinity, which JSON has not: written back, they made
    arguments that JSON parsers refuse (JSON.parse). Such a text is malformed JSON, so
    the content, as any other."""
    assert auto(parser).reply(text, "stop") == (text, [], "stop")
