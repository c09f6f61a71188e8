"""OpenAI function calling for chat completions (`tools`, `tool_choice`), as vLLM serves it.

`read_tools` turns a request's `tools` (`[{"type": "function", "function": {"name",
"description", "parameters", "strict"}}]`), `tool_choice` and `parallel_tool_calls` into a
`ToolRequest`, or an `ApiError` 400 naming the bad value. The chat template gets the tools
as its `tools` variable in vLLM's form (each `function` with `description` and
`parameters` null where left out, its other keys kept), whatever the `tool_choice` ("none"
too, as vLLM's default). The messages' own calls reach it as vLLM readies them
(`chat.normalize_messages`, which `openai_api.chat_messages` runs): an assistant
message's `tool_calls[].function.arguments`, a JSON string in OpenAI's format, becomes the
value it holds ({} for "" or null), and an empty `tool_calls` is dropped; `role: "tool"`
messages (with their `tool_call_id`) pass as they are.

What the answer is, by `tool_choice` (left out or null: "auto", as OpenAI's and vLLM's):

- "none": the text, as without tools.
- "auto": needs the server's parser (scripts/serve.py's `--enable-auto-tool-choice
  --tool-call-parser NAME`; without one, vLLM's 400). The text is parsed (`PARSERS`): the
  calls found are `message.tool_calls`, with finish_reason "tool_calls"; else the text is
  the content, unchanged.
- `{"type": "function", "function": {"name": F}}`: guided decoding makes the output a JSON
  object of F's `parameters` schema (an empty object's schema without one), answered as
  one call of F with that text as its arguments, content "" and the engine's
  finish_reason (as vLLM's: a named call does not finish with "tool_calls").
- "required": guided by vLLM's schema, a JSON array (at least one item) of `{"name": a
  tool's name, "parameters": its schema}` (anyOf over the tools, their `$defs` and
  `definitions` gathered at its root); each item is a call, content "", finish_reason
  "tool_calls" where the engine's is "stop". A text that is no such array (cut short:
  "length") is answered as the content, without calls (vLLM fails the request).

Named and "required" constrain the output, so other structured outputs or beam search
with them are 400s, and the schemas they use must compile (`pagedjax.guided`'s JSON
schema subset; a 400 naming the tool). Under "auto" and "none" the model only reads the
schemas, so `parameters` need only be a JSON object (of type "object" if it names one).
`parallel_tool_calls: false` keeps the first call only, as vLLM's (true, the default:
all).

Parsers ("auto"), as vLLM's of the same names; a text they cannot parse is the content,
whole (JSON is RFC 8259's: NaN and Infinity, which vLLM's Python json reads and writes
back into arguments no JSON parser takes, make a text no calls, as does a number beyond a
double's range, `1e400`, which it reads as infinity):

- "hermes" (Qwen2.5, Qwen3, Hermes 2 Pro): each `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` (the last may be unclosed) is a call; the content is the text before
  the first `<tool_call>` (null if none), and what follows the calls is dropped, as in
  vLLM. One block that is no such JSON makes the whole text the content.
- "llama3_json" (Llama 3.1, 3.2): a text that is, after an optional `<|python_tag|>`,
  one or more `{"name": ..., "parameters": ...}` objects (or "arguments") separated by
  `;` is calls, with content null. vLLM's non-streamed parser also takes objects from
  inside other text (and drops that text); here, as its streamed parser decides, only a
  text that starts with an object can be calls, so no text is lost.

Names are not checked against the tools, as in vLLM: a call of an unknown function is
answered as the model wrote it, for the client to refuse (but a name with a lone
surrogate escape, `"\\ud800"`, is no text: no call). Each call is `{"id":
"chatcmpl-tool-<32 hex digits>", "type": "function", "function": {"name", "arguments": a
JSON string}}`, the arguments as vLLM writes them (`json.dumps`, non-ASCII kept; a lone
surrogate kept escaped, UTF-8 having none), whatever their JSON type.

Streaming (`ToolStream`, one per choice): under "auto" the text streams as content until
a call could be starting (hermes: up to `<tool_call>`, an end that could begin it held
back; llama3_json: nothing until the text shows whether it starts with a call), and the
rest is held until the choice ends; named and "required" stream no content. The choice's
last piece carries the content not sent yet and the calls whole, each call's arguments
in one piece (not piece by piece as vLLM's parsers stream them), as `delta.tool_calls`
entries `{index, id, type, function: {name, arguments}}`, with the non-streamed answer's
finish_reason (the server sends that in a chunk of its own after the calls', as OpenAI
does: `openai_api.stream_chunks`). So the content pieces add up to the non-streamed
content ("" for null).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Callable
from typing import NamedTuple

from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.openai_fields import ApiError

__all__ = [
    "PARSERS",
    "Parser",
    "ToolRequest",
    "ToolStream",
    "parse_hermes",
    "parse_llama3_json",
    "read_tools",
    "tool_call",
]

CHOICES = ("none", "auto", "required")
HERMES_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
EMPTY_OBJECT = {"type": "object", "properties": {}}  # vLLM's schema of no parameters
_WS = re.compile(r"\s*")
_CHOICE_FORMS = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


def tool_call(name: str, arguments: str) -> dict:
    """A call as OpenAI's answers give it, with a fresh vLLM-style id."""
    return dict(
        id=f"chatcmpl-tool-{uuid.uuid4().hex}",
        type="function",
        function=dict(name=name, arguments=arguments),
    )


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(number: str) -> float:
    """A JSON number with a fraction or exponent as a float, but for one beyond a
    double's range (`1e400`), which Python reads as infinity and writes back as no JSON."""
    value = float(number)
    if math.isinf(value):
        raise ValueError(f"{number} is beyond a double's range")
    return value


# Python's json reads NaN and Infinity, which JSON has not, and makes a number beyond a
# double's range (1e400) infinity: written back, they would make arguments that JSON
# parsers refuse ("Infinity"), so a text that holds them is no call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _loads(text: str):
    """The JSON value of `text`, or None if it is none."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def _dumps(value) -> str:
    """`value` as vLLM writes arguments (json.dumps, non-ASCII kept), but for a lone
    surrogate (the text's `"\\ud800"`), which stays escaped: UTF-8 cannot carry it."""
    text = json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def _is_call(obj, *keys: str) -> bool:
    """`obj` is a parsed call: an object with a string "name" (text, no lone surrogate)
    and one of `keys`."""
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("name"), str)
        and not _SURROGATE.search(obj["name"])
        and any(k in obj for k in keys)
    )


def _call(obj: dict, key: str) -> dict | None:
    """The call of a parsed `_is_call` object with its `key` value as arguments, or None
    when they are nested too deep to write back (deeper than the decoder read them)."""
    try:
        return tool_call(obj["name"], _dumps(obj[key]))
    except RecursionError:
        return None


# ------------------------------------------------------------------------------ parsers


def parse_hermes(text: str) -> tuple[str | None, list[dict]] | None:
    """(content, calls) of a reply with Hermes-style `<tool_call>` blocks, or None when it
    is no calls (no block, or one that is not `{"name", "arguments"}` JSON)."""
    if HERMES_START not in text:
        return None
    calls = []
    for closed, unclosed in _HERMES.findall(text):
        obj = _loads(closed or unclosed)
        if not (_is_call(obj, "arguments") and (call := _call(obj, "arguments"))):
            return None
        calls.append(call)
    return text[: text.find(HERMES_START)] or None, calls


def _hermes_sendable(text: str) -> int:
    """How much of a partial reply is surely content: up to the first `<tool_call>`, less
    an end that could begin one."""
    at = text.find(HERMES_START)
    if at >= 0:
        return at
    held = next(
        (k for k in range(len(HERMES_START) - 1, 0, -1) if text.endswith(HERMES_START[:k])), 0
    )
    return len(text) - held


def _after_python_tag(text: str) -> str:
    s = text.lstrip()
    return s[len(PYTHON_TAG) :].lstrip() if s.startswith(PYTHON_TAG) else s


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]] | None:
    """(None, calls) of a reply that is, after an optional `<|python_tag|>`, JSON calls
    `{"name", "parameters" or "arguments"}` separated by ";", or None when it is not."""
    s = _after_python_tag(text)
    if not s.startswith("{"):
        return None
    calls, i = [], 0
    while i < len(s):
        try:
            obj, i = _DECODER.raw_decode(s, i)
        except (ValueError, RecursionError):
            return None
        if not _is_call(obj, "arguments", "parameters"):
            return None
        if not (call := _call(obj, "arguments" if "arguments" in obj else "parameters")):
            return None
        calls.append(call)
        i = _WS.match(s, i).end()
        if i < len(s):
            if s[i] != ";":
                return None
            i = _WS.match(s, i + 1).end()
    return None, calls


def _llama3_sendable(text: str) -> int:
    """How much of a partial reply is surely content: all of it once it shows that it
    does not start with a call, else nothing."""
    s = text.lstrip()
    if PYTHON_TAG.startswith(s):  # nothing yet, or maybe the tag
        return 0
    s = _after_python_tag(s)
    return 0 if not s or s.startswith("{") else len(text)


class Parser(NamedTuple):
    """A tool-call parser: `parse` (text -> (content, calls), or None for no calls) and
    `sendable` (a partial text -> how much of it is content whatever follows)."""

    parse: Callable[[str], tuple[str | None, list[dict]] | None]
    sendable: Callable[[str], int]


PARSERS = {
    "hermes": Parser(parse_hermes, _hermes_sendable),
    "llama3_json": Parser(parse_llama3_json, _llama3_sendable),
}


# ------------------------------------------------------------------------------ requests


@dataclasses.dataclass
class ToolRequest:
    """A chat request's tools and what its answer does with them (`read_tools`).

    Attributes:
      tools: the tools as the chat template gets them (vLLM's form).
      choice: "none", "auto", "required" or "named".
      name: the function a named tool_choice names, else None.
      parser: the `PARSERS` name that reads the text under "auto", else None.
      parallel: `parallel_tool_calls` (False: the first call only).
      streams: each streamed choice's `ToolStream`, by choice index.
    """

    tools: list[dict]
    choice: str
    name: str | None = None
    parser: str | None = None
    parallel: bool = True
    streams: dict[int, ToolStream] = dataclasses.field(default_factory=dict)

    @property
    def parses(self) -> bool:
        """Whether the answer's text becomes calls (any tool_choice but "none")."""
        return self.choice != "none"

    def structured_outputs(
        self, body: dict, guided: StructuredOutputsParams | None, tokenizer, vocab_size: int
    ) -> StructuredOutputsParams | None:
        """The request's structured outputs: `guided` (its own fields') unless tool_choice
        is named or "required", whose schema (compiled for `tokenizer` here) it then is.

        Raises:
          ApiError: 400 for other structured outputs or beam search with those, or a
            schema that cannot compile (naming the tool).
        """
        if self.choice not in ("named", "required"):
            return guided
        what = f"tool_choice naming {self.name!r}" if self.name else 'tool_choice "required"'
        if guided is not None:
            msg = f"{what} constrains the output to its calls: give no other structured outputs"
            raise ApiError(400, msg, "tool_choice")
        if body.get("use_beam_search"):
            raise ApiError(400, f"{what} is not supported with beam search", "tool_choice")
        functions = [t["function"] for t in self.tools]
        used = [f for f in functions if self.name in (None, f["name"])]
        for f in used:  # each on its own first, so that an error names its tool
            try:
                StructuredOutputsParams(json=f["parameters"] or EMPTY_OBJECT)
            except (ValueError, TypeError) as e:
                msg = f"tools[{functions.index(f)}] (function {f['name']!r}) parameters: {e}"
                raise ApiError(400, msg, "tools") from None
        if self.name:
            schema = used[0]["parameters"] or EMPTY_OBJECT
        else:
            schema = _required_schema(used)
        try:
            if tokenizer is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            spec = StructuredOutputsParams(json=schema)
            compile_guide(spec, tokenizer, vocab_size)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"{what}: {e}", "tool_choice") from None
        return spec

    def reply(self, text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
        """(content, calls, finish_reason) of a choice whose whole text is `text` and
        whose engine finish_reason is `finish_reason` (see the module docstring)."""
        if self.choice == "named":
            return "", [tool_call(self.name, text)], finish_reason
        if self.choice == "required":
            items = _loads(text)
            is_calls = isinstance(items, list) and all(_is_call(x, "parameters") for x in items)
            calls = [_call(x, "parameters") for x in items] if is_calls else []
            if calls and all(calls):
                finish = "tool_calls" if finish_reason == "stop" else finish_reason
                return "", calls if self.parallel else calls[:1], finish
        elif self.choice == "auto" and (parsed := PARSERS[self.parser].parse(text)):
            content, calls = parsed
            return content, calls if self.parallel else calls[:1], "tool_calls"
        return text, [], finish_reason

    def sendable(self, text: str) -> int:
        """How much of a choice's partial text a stream may send as content now."""
        if self.choice == "auto":
            return PARSERS[self.parser].sendable(text)
        return len(text) if self.choice == "none" else 0

    def answer(self, choice: dict) -> None:
        """Rewrites a chat answer's choice (`openai_responses.response_body`'s) in place:
        its message's content and calls (`tool_calls`, when there are some) and its
        finish_reason."""
        message = choice["message"]
        message["content"], calls, choice["finish_reason"] = self.reply(
            message["content"], choice["finish_reason"]
        )
        if calls:
            message["tool_calls"] = calls

    def stream(self, index: int) -> ToolStream:
        """The `ToolStream` of streamed choice `index` (made on first use)."""
        return self.streams.setdefault(index, ToolStream(self))


def _required_schema(functions: list[dict]) -> dict:
    """vLLM's schema of "required": an array of at least one `{"name", "parameters"}`,
    anyOf over the tools, their `$defs` (and `definitions`) gathered at the root, where
    their local `$ref`s now point."""
    branches, defs = [], {}
    for f in functions:
        params = dict(f["parameters"] or EMPTY_OBJECT)
        for key in ("$defs", "definitions"):
            for name, schema in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                    msg = (
                        f'tool_choice "required": tools define {key}/{name} differently '
                        f"(function {f['name']!r} among them); give them one schema"
                    )
                    raise ApiError(400, msg, "tools")
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    return {**schema, **defs}


def read_tools(body: dict, *, parser: str | None) -> ToolRequest | None:
    """The chat request's `ToolRequest`, None when it has no tools.

    Args:
      body: the request's JSON object (`tools`, `tool_choice`, `parallel_tool_calls`).
      parser: the server's tool-call parser (a `PARSERS` name), None when "auto" tool
        choice is not enabled.

    Raises:
      ApiError: 400 naming the bad value: a tool that is no `{"type": "function",
        "function": {"name", ...}}`, a name given twice, parameters that are no object
        schema, a tool_choice of another form, naming no tool or given without tools,
        "auto" without a parser (vLLM's message), a parallel_tool_calls no boolean.
    """
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        msg = f"parallel_tool_calls must be a boolean, got parallel_tool_calls={parallel!r:.80}"
        raise ApiError(400, msg, "parallel_tool_calls")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice is None or choice == "none":
            return None
        msg = f"tool_choice needs tools, got tool_choice={choice!r:.80} and no tools"
        raise ApiError(400, msg, "tool_choice")
    if not isinstance(tools, list) or not tools:
        msg = (
            'tools must be a non-empty list of {"type": "function", "function": {...}}, '
            f"got tools={tools!r:.80}"
        )
        raise ApiError(400, msg, "tools")
    specs, names = [], set()
    for i, tool in enumerate(tools):
        specs.append(_tool(i, tool))
        name = specs[-1]["function"]["name"]
        if name in names:
            raise ApiError(400, f"tools[{i}]: function name {name!r} is given twice", "tools")
        names.add(name)
    mode, name = _tool_choice(choice, names)
    if mode == "auto" and parser is None:
        msg = (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            'be set (tool_choice is "auto" when tools are given without one; ask for "none", '
            '"required" or a named function instead)'
        )
        raise ApiError(400, msg, "tool_choice")
    return ToolRequest(specs, mode, name, parser if mode == "auto" else None, parallel is not False)


def _tool(i: int, tool) -> dict:
    """`tools[i]` checked, in vLLM's form: `{"type": "function", "function": {"name",
    "description", "parameters", ...its other keys}}`."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where} must be an object, got {tool!r:.80}", "tools")
    kind = tool.get("type", "function")
    if kind != "function":
        msg = f'{where}: only type "function" is supported, got type={kind!r:.80}'
        raise ApiError(400, msg, "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(
            400, f"{where} must have a function object, got function={fn!r:.80}", "tools"
        )
    name, desc, params = fn.get("name"), fn.get("description"), fn.get("parameters")
    if not isinstance(name, str) or not name:
        msg = f"{where}: function.name must be a non-empty string, got name={name!r:.80}"
        raise ApiError(400, msg, "tools")
    where = f"{where} (function {name!r})"
    if desc is not None and not isinstance(desc, str):
        msg = f"{where}: description must be a string, got description={desc!r:.80}"
        raise ApiError(400, msg, "tools")
    if params is not None and not (
        isinstance(params, dict) and params.get("type", "object") == "object"
    ):
        msg = f"{where}: parameters must be an object's JSON schema, got parameters={params!r:.80}"
        raise ApiError(400, msg, "tools")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(
            400, f"{where}: strict must be a boolean, got strict={strict!r:.80}", "tools"
        )
    return dict(type="function", function=dict(name=name, description=desc, parameters=params) | fn)


def _tool_choice(choice, names: set[str]) -> tuple[str, str | None]:
    """(mode, named function or None) of a request's tool_choice (None: "auto")."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in CHOICES:
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name or choice.get("type", "function") != "function":
        raise ApiError(
            400,
            f"tool_choice must be {_CHOICE_FORMS}, got tool_choice={choice!r:.100}",
            "tool_choice",
        )
    if name not in names:
        msg = f"tool_choice names function {name!r}, which is not among the tools ({sorted(names)})"
        raise ApiError(400, msg, "tool_choice")
    return "named", name


# ----------------------------------------------------------------------------- streaming


class ToolStream:
    """One streamed choice under a tool request: its text so far and what of it went out
    as content (always a start of the content its whole text is answered with)."""

    __slots__ = ("request", "text", "sent")

    def __init__(self, request: ToolRequest):
        self.request, self.text, self.sent = request, "", 0

    def next(self, piece: str, finish: str | None) -> tuple[str, list[dict] | None, str | None]:
        """(content to send now, the calls as `delta.tool_calls` entries or None, the
        finish_reason) for the choice's next piece of text; `finish`: the engine's
        finish_reason when the piece is its last (None before)."""
        self.text += piece
        if finish is None:
            end = max(self.sent, self.request.sendable(self.text))
            out, self.sent = self.text[self.sent : end], end
            return out, None, None
        content, calls, finish = self.request.reply(self.text, finish)
        # What went out is a start of `content`: the parsers' `sendable` never sends
        # beyond where a call could start, and a text without calls is all content.
        entries = [dict(index=k, **c) for k, c in enumerate(calls)] or None
        return (content or "")[self.sent :], entries, finish
