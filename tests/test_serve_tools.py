"""Function calling (`tools`, `tool_choice`): pagedjax/tool_calls.py's parsers and checks
on their own, then scripts/serve.py end to end as in tests/test_serve.py.

The served checkpoint is tests/serve_helpers.py's, with a chat template that renders the
tools' names and the messages' calls (the byte tokenizer makes a tool's whole JSON too
long for the tiny model's 512 positions). Named and "required" answers are guided, so
they parse and fit their schemas; "auto" answers are made known by a `guided_choice`
(structured outputs apply under "auto", as in vLLM) and parsed by the server's parser.
"""

import json
import random

import pytest
import serve_helpers
from serve_helpers import MESSAGES, make_llm, ok, request, serve, serving, stream

from pagedjax import openai_api as api
from pagedjax.tokenizer import Tokenizer
from pagedjax.tool_calls import PARSERS, ToolRequest, parse_hermes, parse_llama3_json

ckpt = serve_helpers.ckpt  # bound here: this module gets its own checkpoint

TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
}
WEATHER_FN = {"name": "get_weather", "description": "Weather", "parameters": WEATHER}
TOOLS = [
    {"type": "function", "function": WEATHER_FN},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# The tools as the template gets them: vLLM's form, fields left out as None.
RENDERED_TOOLS = [
    {"type": "function", "function": WEATHER_FN},
    {"type": "function", "function": {"name": "add", "description": None, "parameters": ADD}},
]
CALL_ID_LEN = len("chatcmpl-tool-") + 32


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt).with_chat_template(TEMPLATE)


@pytest.fixture(scope="module")
def server(ckpt, tok):
    yield from serving(make_llm(ckpt, tokenizer=tok), "tiny", tool_parser="hermes")


def job(body: dict, tok, *, tool_parser="hermes") -> api.Job:
    """The chat request `body` (MESSAGES unless it has messages) as the server parses it
    (without an engine: a max_model_len that any prompt here fits)."""
    return api.parse_job(
        {"messages": MESSAGES, **body},
        chat=True,
        model_name="tiny",
        tokenizer=tok,
        vocab_size=256,
        max_model_len=4096,
        tool_parser=tool_parser,
    )


def fits(value, schema: dict) -> bool:
    """`value` fits `schema` (the keywords of this module's schemas only)."""
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and set(schema.get("required", ())) <= set(value) <= set(props)
            and all(fits(value[k], props[k]) for k in value)
        )
    if kind == "integer":
        lo, hi = schema.get("minimum", -(2**63)), schema.get("maximum", 2**63)
        return type(value) is int and lo <= value <= hi
    if kind == "string":
        return isinstance(value, str) and value in schema.get("enum", [value])
    raise AssertionError(f"unexpected schema {schema}")


def check_call(call: dict) -> tuple[str, dict]:
    """(name, arguments) of an answer's call, checked: its id, type, arguments' schema."""
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == CALL_ID_LEN
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    assert fits(args, SCHEMAS[name]), (name, args)
    return name, args


def streamed(chunks: list[dict], index: int = 0) -> tuple[str, list[dict], str]:
    """(content, calls without ids, finish_reason) of one choice of a streamed answer,
    checking that the calls come alone in the chunk before the last, indexed in order,
    and the finish_reason in the last, `delta: {}` (OpenAI's: the openai client's stream
    helper reads a chunk's finish_reason before its calls, so one chunk of both never
    ends the last call); without calls, the finish_reason in the last chunk; and that
    no chunk between the role's and those is empty (text held back sends none)."""
    mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
    assert mine[0]["delta"] == dict(role="assistant", content="")
    at = [j for j, c in enumerate(mine) if "tool_calls" in c["delta"]]
    assert at in ([], [len(mine) - 2])
    if at:
        assert mine[-1]["delta"] == {} and mine[-1]["logprobs"] is None
    body = mine[1 : at[0] if at else -1]
    assert all(c["delta"].get("content") or c["logprobs"] for c in body)
    assert all(c["finish_reason"] is None for c in mine[:-1])
    calls = mine[at[0]]["delta"]["tool_calls"] if at else []
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert all(len(c["id"]) == CALL_ID_LEN for c in calls)
    content = "".join(c["delta"].get("content", "") for c in mine)
    return content, [without_id(c) for c in calls], mine[-1]["finish_reason"]


def call_of(id_: str, name: str, arguments) -> dict:
    """A call of an assistant message, as a client sends it back."""
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def without_id(call: dict) -> dict:
    return {k: v for k, v in call.items() if k not in ("id", "index")}


# ---------------------------------------------------------------------------- parsers


def hermes(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (hermes("add", {"a": 1}), None, [("add", {"a": 1})]),
        (
            "Let me look.\n" + hermes("add", {"a": 1}) + "\n" + hermes("get_weather", {}),
            "Let me look.\n",
            [("add", {"a": 1}), ("get_weather", {})],
        ),
        ('<tool_call>{"name": "add", "arguments": {"a": "é"}}', None, [("add", {"a": "é"})]),
        (hermes("no_such_tool", {"x": [1]}), None, [("no_such_tool", {"x": [1]})]),  # kept
        ("Just text.", "Just text.", []),
        ("Bad: <tool_call>{oops}</tool_call>", "Bad: <tool_call>{oops}</tool_call>", []),
        (hermes("add", {}) + '<tool_call>{"arguments": {}}</tool_call>', None, None),
        ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    ],
)
def test_hermes_parser(text, content, calls):
    got = parse_hermes(text)
    if not calls:  # no calls: the whole text is the content
        assert got is None
        assert ToolRequest([], "auto", parser="hermes").reply(text, "stop") == (text, [], "stop")
        return
    assert got[0] == content
    # Arguments as vLLM writes them: json.dumps, non-ASCII kept.
    want = [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got[1]] == want


@pytest.mark.parametrize(
    "text, calls",
    [
        ('{"name": "add", "parameters": {"a": 1}}', [("add", {"a": 1})]),
        ('<|python_tag|>{"name": "add", "arguments": {"a": 1}}', [("add", {"a": 1})]),
        (
            ' {"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}',
            [("add", {"a": 1}), ("get_weather", {})],
        ),
        ('{"name": "add", "parameters": {}};', [("add", {})]),
        ('Sure: {"name": "add", "parameters": {}}', None),  # not at the start: text
        ('{"name": "add", "parameters": {}} and more', None),
        ('{"name": "add"}', None),  # no parameters
        ('{"name": "add", "parameters": {', None),  # cut short
        ("The answer is 4.", None),
    ],
)
def test_llama3_json_parser(text, calls):
    got = parse_llama3_json(text)
    if calls is None:
        assert got is None
        return
    assert got[0] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got[1]
    ] == calls


STREAMED_TEXTS = {
    "hermes": [
        "Let me look.\n" + hermes("add", {"a": 1}) + "\n" + hermes("get_weather", {}),
        "A <tool_ca",  # ends with what could begin a call: text all the same
        "Use <b> and <tool_call>{bad}</tool_call> after",
        "No calls at all <tool_call",
        hermes("add", {}),
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "f", "parameters": {}}',
        "  <|python_tag|> plain text after the tag",
        "<|python",
        '{"name": "add" broken',
        "Some words.",
    ],
}


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_a_stream_sends_content_only_while_no_call_can_start_and_adds_up(parser):
    """Streamed in pieces of any size, the content sent adds up to the non-streamed
    content, never sends text of a call, and the calls are the same."""
    rng = random.Random(0)
    for text in STREAMED_TEXTS[parser]:
        req = ToolRequest([], "auto", parser=parser)
        want_content, want_calls, want_finish = req.reply(text, "stop")
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 6)))
            pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            s, sent = ToolRequest([], "auto", parser=parser).stream(0), ""
            for piece in pieces[:-1]:
                out, calls, finish = s.next(piece, None)
                assert calls is None and finish is None
                sent += out
                assert (want_content or "").startswith(sent)
            out, calls, finish = s.next(pieces[-1], "stop")
            assert sent + out == (want_content or "") and finish == want_finish
            assert [without_id(c) for c in calls or []] == [without_id(c) for c in want_calls]
            assert all(c["index"] == k for k, c in enumerate(calls or []))


# ------------------------------------------------------------------------- requests


NOT = {"not": {}}  # a keyword the JSON schema compiler refuses
BAD_ARGUMENTS = {"name": "add", "arguments": "{a"}


@pytest.mark.parametrize(
    "body, param, words",
    [
        (dict(tools="f"), "tools", "tools='f'"),
        (dict(tools=[]), "tools", "tools=[]"),
        (dict(tools=[{"type": "retrieval"}]), "tools", "type='retrieval'"),
        (dict(tools=[{"type": "function"}]), "tools", "tools[0] must have a function"),
        (dict(tools=[{"function": {"description": "x"}}]), "tools", "name=None"),
        (dict(tools=[TOOLS[1], TOOLS[1]]), "tools", "tools[1]: function name 'add' is given twice"),
        (
            dict(tools=[{"function": {"name": "f", "parameters": {"type": "string"}}}]),
            "tools",
            "tools[0] (function 'f'): parameters must be",
        ),
        (dict(tools=[{"function": {"name": "f", "parameters": [1]}}]), "tools", "parameters=[1]"),
        (dict(tools=[{"function": {"name": "f", "description": 5}}]), "tools", "description=5"),
        (dict(tools=[{"function": {"name": "f", "strict": "yes"}}]), "tools", "strict='yes'"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "tool_choice='sometimes'"),
        (dict(tools=TOOLS, tool_choice={"function": {}}), "tool_choice", "{'function': {}}"),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "sub"}}),
            "tool_choice",
            "tool_choice names function 'sub', which is not among the tools",
        ),
        (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
        (dict(tools=TOOLS, parallel_tool_calls="no"), "parallel_tool_calls", "calls='no'"),
        (
            dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
            "give no other structured outputs",
        ),
        (
            dict(tools=TOOLS, tool_choice="required", use_beam_search=True, n=2),
            "tool_choice",
            "beam search",
        ),
        (
            dict(
                tools=[{"function": {"name": "f", "parameters": {"properties": {"a": NOT}}}}],
                tool_choice={"type": "function", "function": {"name": "f"}},
            ),
            "tools",
            "tools[0] (function 'f') parameters: ",
        ),
        (
            dict(
                tools=[
                    {"function": {"name": n, "parameters": {"$defs": {"D": {"type": t}}}}}
                    for n, t in (("f", "string"), ("g", "integer"))
                ],
                tool_choice="required",
            ),
            "tools",
            "tools define $defs/D differently",
        ),
        (
            dict(
                messages=[
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "tool_calls": [{"function": BAD_ARGUMENTS}]},
                ],
            ),
            "messages",
            "messages[1].tool_calls[0].function.arguments is not JSON",
        ),
        (dict(messages=[{"role": "assistant", "tool_calls": [{}]}]), "messages", "calls[0] must"),
    ],
)
def test_bad_tools_are_400s_naming_field_and_value(tok, body, param, words):
    with pytest.raises(api.ApiError) as info:
        job(body, tok)
    e = info.value
    assert e.status == 400 and words in e.message and e.param == param, (e.param, e.message)


def test_auto_needs_a_parser_and_is_the_default_with_tools(tok):
    """As vLLM: tools without tool_choice are "auto", which without the server's
    --enable-auto-tool-choice --tool-call-parser is a 400; "none" is not."""
    for body in (dict(tools=TOOLS), dict(tools=TOOLS, tool_choice="auto")):
        with pytest.raises(api.ApiError) as info:
            job(body, tok, tool_parser=None)
        msg = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
        assert info.value.message.startswith(msg) and info.value.param == "tool_choice"
        assert job(body, tok).tools.choice == "auto"
    assert job(dict(tools=TOOLS, tool_choice="none"), tok, tool_parser=None).tools.choice == "none"
    assert job(dict(tool_choice="none"), tok).tools is None


def test_tools_and_messages_reach_the_template_in_vllms_form(tok):
    """The template gets the tools with description and parameters None where left out,
    and an assistant message's calls with their JSON arguments parsed ({} for "")."""
    full = tok.with_chat_template(
        "{{ tools | tojson }}|{% for m in messages %}{{ m | tojson }}|{% endfor %}"
    )
    calls = [call_of("c1", "get_weather", '{"city": "Oslo"}'), call_of("c2", "add", "")]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},
    ]
    got = job(dict(messages=messages, tools=TOOLS, tool_choice="none"), full).prompts[0]
    parsed = [call_of("c1", "get_weather", {"city": "Oslo"}), call_of("c2", "add", {})]
    want = [
        messages[0],
        {**messages[1], "content": "", "tool_calls": parsed},
        messages[2],
        {"role": "assistant", "content": "Sunny."},  # an empty tool_calls dropped
    ]
    assert got == full.encode_chat(want, tools=RENDERED_TOOLS)
    text = full.decode(got, skip_special_tokens=False)
    assert text.startswith(json.dumps(RENDERED_TOOLS, ensure_ascii=False) + "|")
    assert '"arguments": {"city": "Oslo"}' in text and '"tool_call_id": "c1"' in text
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'  # the request's unchanged


def test_bad_flags_and_parser_names(capsys):
    for argv, words in [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--tool-call-parser", "mistral"], "--tool-call-parser"),
    ]:
        assert serve.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    with pytest.raises(ValueError, match="tool_parser must be one of"):
        serve.Server(("127.0.0.1", 0), model_name="m", tool_parser="mistral")


# ----------------------------------------------------------------------- end to end


def test_named_tool_choice_is_one_call_of_its_schemas_json(server):
    named = {"type": "function", "function": {"name": "add"}}
    body = dict(messages=MESSAGES, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=40)
    (choice,) = ok(server, "/v1/chat/completions", body)["choices"]
    assert choice["finish_reason"] == "stop"  # vLLM's for a named call
    message = choice["message"]
    assert message["content"] == "" and set(message) == {"role", "content", "tool_calls"}
    (call,) = message["tool_calls"]
    assert check_call(call)[0] == "add"
    assert streamed(stream(server, "/v1/chat/completions", body)) == (
        "",
        [without_id(call)],
        "stop",
    )


def test_required_tool_choice_is_calls_of_the_tools(server):
    body = dict(
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=1,
        seed=1,
        max_tokens=120,
    )
    (choice,) = ok(server, "/v1/chat/completions", body)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 2 and len({c["id"] for c in calls}) == 2  # (this seed's: 2 calls)
    assert all(check_call(c)[0] in SCHEMAS for c in calls)
    want = ("", [without_id(c) for c in calls], "tool_calls")
    assert streamed(stream(server, "/v1/chat/completions", body)) == want
    (one,) = ok(server, "/v1/chat/completions", dict(body, parallel_tool_calls=False))["choices"]
    assert [without_id(c) for c in one["message"]["tool_calls"]] == want[1][:1]
    # Cut short, the text is no JSON array: it is the content, without calls.
    (cut,) = ok(server, "/v1/chat/completions", dict(body, max_tokens=10))["choices"]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"].startswith("[") and len(cut["message"]["content"]) == 10


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (
            "hermes",
            "Sure.\n"
            + hermes("add", {"a": 1, "b": 2})
            + "\n"
            + hermes("get_weather", {"city": "Oslo", "days": 2}),
            "Sure.\n",
            [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "days": 2})],
        ),
        (
            "llama3_json",
            '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "nope", "parameters": {}}',
            None,
            [("add", {"a": 1, "b": 2}), ("nope", {})],  # an unknown function is answered too
        ),
        ("hermes", "No tools needed.", "No tools needed.", []),
        ("hermes", "Oops <tool_call>{add}</tool_call>", "Oops <tool_call>{add}</tool_call>", []),
        ("llama3_json", "Text first {}", "Text first {}", []),
    ],
)
def test_auto_tool_choice_parses_the_text(server, monkeypatch, parser, text, content, calls):
    """The server's parser reads the answer (made known by a guided_choice): its calls,
    content and finish_reason; streamed (n=2), each choice's content adds up to it and
    its calls are the same."""
    monkeypatch.setattr(server, "tool_parser", parser)
    hi = [{"role": "user", "content": "Hi"}]  # (two choices of the whole text fit the cache)
    body = dict(messages=hi, tools=TOOLS, max_tokens=len(text) + 1, guided_choice=[text], n=2)
    plain = ok(server, "/v1/chat/completions", body)["choices"]
    want_finish = "tool_calls" if calls else "stop"
    for choice in plain:
        assert choice["finish_reason"] == want_finish
        assert choice["message"]["content"] == content
        got = choice["message"].get("tool_calls", [])
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got
        ] == calls
    chunks = stream(server, "/v1/chat/completions", body)
    for i, choice in enumerate(plain):
        want = [without_id(c) for c in choice["message"].get("tool_calls", [])]
        assert streamed(chunks, i) == (content or "", want, want_finish)
    if content and calls:  # the content streamed piece by piece, before the end
        pieces = [c for c in chunks if c["choices"][0]["delta"].get("content")]
        assert len(pieces) >= 2 * len(content) and chunks[-1] not in pieces


def test_tool_choice_none_renders_the_tools_and_answers_the_text(server, tok, monkeypatch):
    sent = []
    llm = server.engine.llm
    add = llm.add_request
    monkeypatch.setattr(
        llm, "add_request", lambda ids, *a, **k: sent.append(ids) or add(ids, *a, **k)
    )
    text = hermes("add", {"a": 1, "b": 2})
    body = dict(
        messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=80, guided_choice=[text]
    )
    (choice,) = ok(server, "/v1/chat/completions", body)["choices"]
    assert choice["message"] == dict(role="assistant", content=text)  # not parsed
    assert choice["finish_reason"] == "stop"
    assert sent == [tok.encode_chat(MESSAGES, tools=RENDERED_TOOLS)]
    assert tok.decode(sent[0]).startswith("<tools>get_weather;add;</tools>\n")
    assert streamed(stream(server, "/v1/chat/completions", body)) == (text, [], "stop")


def test_a_conversation_with_calls_and_results_over_http(server, tok, monkeypatch):
    sent = []
    llm = server.engine.llm
    add = llm.add_request
    monkeypatch.setattr(
        llm, "add_request", lambda ids, *a, **k: sent.append(ids) or add(ids, *a, **k)
    )
    messages = [
        {"role": "user", "content": "1 + 2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call_of("c1", "add", '{"a": 1, "b": 2}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    body = dict(messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    ok(server, "/v1/chat/completions", body)
    text = tok.decode(sent[0])
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert (
        f"<user>1 + 2?\n<assistant><tool_call>{call}</tool_call>\n<tool>3[c1]\n<assistant>" in text
    )


def test_http_errors_name_the_tool_fields(server, monkeypatch):
    status, err = request(server, "/v1/chat/completions", dict(messages=MESSAGES, tools=[{}]))
    assert status == 400 and "tools[0] must have a function" in err["error"]["message"]
    monkeypatch.setattr(server, "tool_parser", None)
    status, err = request(server, "/v1/chat/completions", dict(messages=MESSAGES, tools=TOOLS))
    assert status == 400 and err["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in err["error"]["message"]
    status, err = request(server, "/v1/completions", dict(prompt="a", tools=TOOLS))
    assert status == 400 and "need /v1/chat/completions" in err["error"]["message"]


def test_streamed_logprobs_add_up_though_text_is_held_back(server):
    """A chunk whose text a call holds back still goes out with its tokens' logprobs
    (content ""), so they add up to the non-streamed answer's."""
    text = "Hm.\n" + hermes("add", {"a": 1, "b": 2})
    hi = [{"role": "user", "content": "Hi"}]
    body = dict(messages=hi, tools=TOOLS, max_tokens=80, guided_choice=[text], logprobs=True)
    (choice,) = ok(server, "/v1/chat/completions", body)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Hm.\n"
    *chunks, end = [c["choices"][0] for c in stream(server, "/v1/chat/completions", body)[1:]]
    assert end["delta"] == {} and end["logprobs"] is None  # (the finish_reason, after the calls)
    tokens = [x["token"] for c in chunks for x in c["logprobs"]["content"]]
    assert tokens == [x["token"] for x in choice["logprobs"]["content"]]
    assert "".join(c["delta"].get("content", "") for c in chunks) == "Hm.\n"
    assert sum(c["delta"].get("content") == "" for c in chunks) > 10  # held back


def test_hermes_auto_keeps_special_tokens_in_the_text_it_parses(tok):
    """vLLM's hermes parser turns skip_special_tokens off for a request it parses: a
    model whose <tool_call> is a special token (Hermes 2 Pro) lost the tags from the text
    before the parser read it, so no call was found. Other choices and parsers keep the
    request's setting."""
    assert not job(dict(tools=TOOLS), tok).params.skip_special_tokens
    assert not job(dict(tools=TOOLS, skip_special_tokens=True), tok).params.skip_special_tokens
    for body, parser in (
        (dict(tools=TOOLS, tool_choice="none"), "hermes"),
        (dict(tools=TOOLS, tool_choice="required"), "hermes"),
        (dict(tools=TOOLS), "llama3_json"),
        (dict(), "hermes"),
    ):
        assert job(body, tok, tool_parser=parser).params.skip_special_tokens, (body, parser)
