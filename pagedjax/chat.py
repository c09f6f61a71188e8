"""Chat templates: find a checkpoint's Jinja chat template and render messages with it.

Instruct checkpoints ship a Jinja template that turns a list of `{"role", "content"}`
messages into the exact text the model was tuned on (headers, turn separators, the
assistant prompt). `find_chat_template` looks for it where HF transformers' tokenizer
(`AutoTokenizer`, which vLLM uses for text models) does, in this order:

1. `chat_template.jinja` in the checkpoint directory (the raw template, named
   "default") and the named ones in `additional_chat_templates/NAME.jinja` (where
   transformers saves a list-form template's other entries);
2. tokenizer_config.json's `chat_template`: a string, or a list of
   `{"name": ..., "template": ...}` from which the one named "default" is used (or
   the one asked for by name). A list without "default" gives no template rather
   than a guess;
3. only when neither has one, `chat_template.json` (`{"chat_template": "..."}`): a
   processor's file (multimodal checkpoints), which the tokenizer never reads; HF's
   processor would use it.

Messages come in OpenAI's chat form, as vLLM's `LLM.chat` and server take them;
`normalize_messages` makes them what the template gets, as vLLM's `parse_chat_messages`
does (content None as "", text parts joined, assistant tool calls' JSON arguments
parsed), for `LLM.chat`, `Tokenizer.encode_chat` and the server alike. As vLLM does by
default, a template that loops over a message's content (Gemma 3, Llama 4: its
`content_format` is "openai") gets the content as a list of text parts instead, but a
tool result's as a string still (most templates read it as one).

`render` runs the template the way HF does, so a checkpoint's template gives the same
text here as there: a sandboxed, immutable Jinja environment with `trim_blocks` and
`lstrip_blocks`, the loop-control extension (`break`/`continue`), HF's
`{% generation %}` block (rendered as its body), the globals
`raise_exception(msg)` and `strftime_now(fmt)`, and transformers' `tojson` filter
(`json.dumps`, non-ASCII text kept unless `ensure_ascii=True`); `continue_final_message`
cuts the text where the last message's content (or the field it names) ends, as
transformers 5 does, for the model to continue it (an empty content too: an open turn).
`tools` and `documents` must be lists of dicts, as transformers checks them. An error
inside the template names it. jinja2 is an optional dependency (the `chat` extra),
imported on first render; each template is compiled once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from pagedjax.jsonfile import read_json_object

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TEMPLATE_JSON = "chat_template.json"
DEFAULT_NAME = "default"
TOOL_USE_NAME = "tool_use"  # the named template HF's apply_chat_template picks for `tools`
# transformers' marker of the end of the message to continue (render_jinja_template).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The chat extra is jinja2 alone; from a checkout, `pip install -e ".[chat]"` installs it.
INSTALL_HINT = "pip install 'jinja2>=3.1' (the chat extra: pip install -e '.[chat]')"


def jinja_missing() -> str | None:
    """None when chat templates can render, else why not and how to fix it."""
    try:
        _jinja()
    except ImportError as e:
        return str(e)
    return None


def _jinja():
    """The jinja2 modules a render needs, or an ImportError that says how to get them."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:
        raise ImportError(f"chat templates need jinja2 >= 3.1: {INSTALL_HINT} ({e})") from None
    return jinja2


def _pick(value, where: str, name: str | None) -> tuple[str | None, str]:
    """(template or None, source or why there is none) from a `chat_template` field."""
    if isinstance(value, str):
        if name not in (None, DEFAULT_NAME):
            raise ValueError(f"{where} has a single chat template, none named {name!r}")
        return value, where
    if not isinstance(value, list):
        raise ValueError(
            f"{where} chat_template must be a string or a list of {{name, template}}, "
            f"got {type(value).__name__}"
        )
    named = {}
    for i, entry in enumerate(value):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)
        ):
            raise ValueError(
                f"{where} chat_template[{i}] is not a {{name, template}}: {entry!r:.80}"
            )
        named[entry["name"]] = entry["template"]
    want = DEFAULT_NAME if name is None else name
    if want in named:
        return named[want], f"{where} (template {want!r})"
    if name is not None:
        raise ValueError(f"{where} has no chat template named {name!r}; it has {sorted(named)}")
    return None, f"{where} lists chat templates {sorted(named)} but none named {DEFAULT_NAME!r}"


def _read(path: Path) -> str:
    """A template file's text, UTF-8 as transformers opens it (not the locale's encoding:
    DeepSeek's `<｜User｜>` was mojibake under cp1252, an error under a C locale)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from None


def find_chat_template(
    root, tokenizer_config: dict, *, name: str | None = None
) -> tuple[str | None, str]:
    """A checkpoint directory's chat template, by HF's order of precedence (module doc).

    Args:
      root: the checkpoint directory.
      tokenizer_config: its parsed tokenizer_config.json ({} if none).
      name: pick this entry of a list-form template instead of "default".

    Returns:
      (template, source): the template text (None if there is none) and where it came
      from, or why there is none, for messages.

    Raises:
      ValueError: an unreadable source, or `name` not among the templates.
    """
    root = Path(root)
    jinja_file = root / TEMPLATE_FILE
    extra_dir = root / TEMPLATE_DIR
    files = {DEFAULT_NAME: jinja_file} if jinja_file.is_file() else {}
    if extra_dir.is_dir():  # as transformers reads them: NAME.jinja, overriding the default
        files |= {
            f.name[: -len(".jinja")]: f for f in sorted(extra_dir.glob("*.jinja")) if f.is_file()
        }
    if list(files) == [DEFAULT_NAME]:
        return _pick(_read(files[DEFAULT_NAME]), str(files[DEFAULT_NAME]), name)
    if files:
        want = DEFAULT_NAME if name is None else name
        if want in files:
            return _read(files[want]), str(files[want])
        if name is not None:
            raise ValueError(f"{root} has no chat template named {name!r}; it has {sorted(files)}")
        return None, f"{extra_dir} has chat templates {sorted(files)} but none named 'default'"
    value = tokenizer_config.get("chat_template")
    if value is not None:
        return _pick(value, str(root / "tokenizer_config.json"), name)
    json_file = root / TEMPLATE_JSON
    if json_file.is_file():
        obj = read_json_object(json_file)
        if "chat_template" not in obj:
            raise ValueError(f"{json_file} has no 'chat_template' key (keys: {sorted(obj)})")
        return _pick(obj["chat_template"], str(json_file), name)
    if name is not None:
        raise ValueError(f"{root} has no chat template, so none named {name!r}")
    return None, (
        f"{root} has no chat template ({TEMPLATE_FILE}, tokenizer_config.json 'chat_template' "
        f"or {TEMPLATE_JSON})"
    )


def normalize_messages(messages) -> list[dict]:
    """`messages` in OpenAI's chat form as the chat template gets them: what vLLM's
    `parse_chat_messages` makes of them for its `LLM.chat` and its server alike (both
    of ours use this too). Each is a new dict, the caller's left unchanged:

    * `content` None or left out becomes "" (any role, as vLLM's), and a list of text
      parts (`{"type": "text", "text": str}`, and the other `TEXT_PARTS`: an assistant's
      `{"type": "refusal", "refusal": str}`, ...) their texts joined with "\\n"; other
      parts (images, audio, files) are refused: this engine reads text only;
    * an assistant message's `tool_calls` get each `function.arguments`, a JSON string
      in OpenAI's form, parsed into the value it holds ({} for "" or None), the form
      transformers' templates read; an empty `tool_calls` is dropped, so the template
      renders a plain reply;
    * the other keys (`name`, `tool_call_id`, reasoning, ...) pass as they are.

    Raises:
      TypeError: not a list of dicts, or a role, content, part or tool call of the
        wrong type.
      ValueError: an empty list, an empty role, a part that is not text, or tool call
        arguments that are not JSON.
      Each names the message (`messages[i]`, `messages[i].tool_calls[j]`) and the value.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, "
            f"got {type(messages).__name__}: {messages!r:.80}"
        )
    if not messages:
        raise ValueError("messages is empty: a chat needs a non-empty list of messages")
    return [normalize_message(i, m) for i, m in enumerate(messages)]


def normalize_message(index: int, message) -> dict:
    """`messages[index]` as `normalize_messages` makes it (which see); errors name it."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise TypeError(
            f"{where} must be a dict (a JSON object), got {type(message).__name__}: {message!r:.80}"
        )
    role = message.get("role")
    if not isinstance(role, str):
        raise TypeError(f"{where}.role must be a str, got role={role!r:.80}")
    if not role:
        raise ValueError(f"{where}.role is empty")
    out = {**message, "content": _text(where, message.get("content"))}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = _template_calls(f"{where}.tool_calls", message["tool_calls"])
        if calls:
            out["tool_calls"] = calls
        else:
            del out["tool_calls"]
    return out


# The content parts read as text, as vLLM's parse_chat_messages reads them (part type ->
# the key of its text): OpenAI's text and an assistant's refusal, the Responses API's
# input_text and output_text, and vLLM's thinking.
TEXT_PARTS = {
    "text": "text",
    "refusal": "refusal",
    "input_text": "text",
    "output_text": "text",
    "thinking": "thinking",
}


def _text(where: str, content) -> str:
    """A message's content as one string (`normalize_messages`)."""
    return "\n".join(_texts(where, content))


def _texts(where: str, content) -> list[str]:
    """A message's content as the texts of its parts: [] for None, [content] for a str."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, bytes) or not isinstance(content, Sequence):
        raise TypeError(
            f"{where}.content must be a str, a list of text parts or None, "
            f"got content={content!r:.80}"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, Mapping):
            raise TypeError(
                f"{at} must be a text part {{'type': 'text', 'text': ...}}, got {part!r:.80}"
            )
        kind = part.get("type")
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None  # (a list: unhashable)
        if key is None:
            raise ValueError(
                f"{at} has type={part.get('type')!r}: only text content parts are supported "
                f"(no multimodal input), got {part!r:.80}"
            )
        if not isinstance(part.get(key), str):
            raise TypeError(f"{at}: a {part['type']} part's {key} must be a str, got {part!r:.80}")
        texts.append(part[key])
    return texts


def _template_calls(where: str, calls) -> list[dict]:
    """An assistant message's `tool_calls` with their arguments parsed
    (`normalize_messages`); `where`: `messages[i].tool_calls`, for errors."""
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
        raise TypeError(f"{where} must be a list, got {calls!r:.80}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TypeError(
                f'{where}[{j}] must be {{"function": {{"name", "arguments"}}}}, got {call!r:.80}'
            )
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as e:
                raise ValueError(
                    f"{where}[{j}].function.arguments is not JSON ({e}): {fn['arguments']!r:.80}"
                ) from None
        elif not isinstance(args, (Mapping, list)):
            args = {}
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


check_messages = normalize_messages  # its earlier name


# A message's reasoning, by the names transformers 5 reads it under (the first is the one
# templates read: Qwen3's `reasoning_content`; gpt-oss's read `thinking`).
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _as_hf_renders(message: dict) -> dict:
    """`message` as transformers 5 passes it to a template: keys whose value is None left
    out (an OpenAI client's `"tool_calls": null`; Llama 3.1's template tests `'tool_calls'
    in message`), and its reasoning under each name templates read it by."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _check_dicts(name: str, value) -> None:
    """`tools` or `documents` as transformers' render_jinja_template takes them: None or a
    list of dicts (JSON schemas, `{"title", "text"}` documents); a template iterating a
    dict or a string renders its keys or characters. transformers also makes a Python
    function's schema from its signature and docstring; this asks for the schema."""
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of dicts, got {name}={value!r:.80}")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            hint = ""
            if callable(item):
                hint = " (for a function, pass its JSON schema: transformers' get_json_schema)"
            raise TypeError(f"{name}[{i}] must be a dict{hint}, got {item!r:.80}")


def _mark_end(message: dict, field: str, flag: str) -> tuple[dict, str]:
    """(`message` with `CONTINUE_TAG` after the text of its `field`, that text), as
    transformers marks the message to continue: a string, or a list's last text part.
    `flag` names the `continue_final_message` argument in errors."""
    value = message.get(field)
    if isinstance(value, str):
        return {**message, field: value + CONTINUE_TAG}, value
    if value is None:
        raise ValueError(f"{flag} but the last message has no {field!r} to continue")
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{flag} but the last message's {field} is no text to continue: {value!r:.80}"
        )
    for j in reversed(range(len(value))):
        part = value[j]
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            marked = {**part, "text": part["text"] + CONTINUE_TAG}
            return {**message, field: [*value[:j], marked, *value[j + 1 :]]}, part["text"]
    raise ValueError(f"{flag} but the last message has no text to continue in its {field}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text; templates expect
    # plain JSON (Llama 3.1 dumps tool definitions with indent=4). transformers' filter,
    # signature and all: GLM's and MiniCPM's templates pass `ensure_ascii=False`, and a
    # positional argument is ensure_ascii there, not Jinja's indent.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _generation_tag(jinja2):
    """HF's `{% generation %}...{% endgeneration %}` block, which marks the assistant's
    text for training masks: it renders its body unchanged (as a call block, like HF's)."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return Generation


class TemplateRejected(ValueError):
    """A template's `raise_exception(message)`: it refused the messages."""


@functools.lru_cache(maxsize=16)
def _compile(template: str, source: str):
    jinja2 = _jinja()

    def raise_exception(message):
        raise TemplateRejected(f"chat template ({source}) rejected the messages: {message}")

    env = _environment(jinja2)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"chat template ({source}) has a syntax error at line {e.lineno}: {e.message}"
        ) from None


def _environment(jinja2):
    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _generation_tag(jinja2)],
    )


@functools.lru_cache(maxsize=16)
def content_format(template: str) -> str:
    """How `template` reads a message's content, as vLLM detects it (its default "auto"
    `chat_template_content_format`): "openai" when it loops over the content of a message
    of a loop over `messages` (or over a variable set from it: Gemma 3's
    `loop_messages = messages[1:]`), which then gets the content as a list of
    `{"type": "text", "text": ...}` parts; else "string", a string. A template that does
    not parse, or whose loop unpacks a message into a tuple, is "string"."""
    jinja2 = _jinja()
    nodes = jinja2.nodes

    def base(node):  # what a filter, test or slice applies to: `messages[1:] | reverse`
        while (isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        ):
            node = node.node
        return node

    def is_name(node, names) -> bool:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names

    def is_content(node, names) -> bool:  # m.content, m['content']
        node = base(node)
        if isinstance(node, nodes.Getattr):
            key = node.attr
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            key = node.arg.value
        else:
            return False
        return key == "content" and is_name(node.node, names)

    def target(node) -> str:
        if not isinstance(node, nodes.Name):
            raise TypeError(f"a tuple target: {node}")
        return node.name

    try:
        ast = _environment(jinja2).parse(template)
        lists = {"messages"}  # and the variables set from it, to a fixed point
        while new := {
            target(a.target)
            for a in ast.find_all(nodes.Assign)
            if is_name(base(a.node), lists) and target(a.target) not in lists
        }:
            lists |= new
        loops = list(ast.find_all(nodes.For))
        messages = {target(f.target) for f in loops if is_name(base(f.iter), lists)}
        parts = any(is_content(f.iter, messages) for f in loops)
    except (jinja2.TemplateSyntaxError, TypeError):
        return "string"
    return "openai" if parts else "string"


def render(
    template: str,
    messages,
    *,
    source: str = "<string>",
    add_generation_prompt: bool = True,
    continue_final_message: bool | str = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **variables,
) -> str:
    """Renders `messages` with a chat template.

    Args:
      template: the Jinja template text.
      messages: a non-empty list of `{"role": str, "content": str, ...}` dicts in
        OpenAI's form, made what the template gets by `normalize_messages` (content
        None or text parts, assistant tool calls' JSON arguments parsed); other keys
        are passed through to the template, as transformers 5 passes them: those
        whose value is None left out, and the reasoning (`reasoning_content`, else
        `thinking`, else `reasoning`) also as `reasoning_content` and, unless given,
        as `thinking`. A template whose `content_format` is "openai" gets each content
        as a list of `{"type": "text", "text": ...}` parts ([] for None), as vLLM
        passes it.
      source: where the template came from, for error messages.
      add_generation_prompt: end with the header that opens the assistant's turn.
      continue_final_message: end the text with the last message's content, left open
        (no end-of-turn after it) for the model to continue, e.g. an assistant reply
        begun by the caller; needs `add_generation_prompt=False`. As in transformers
        5, the content (a list's last part) is rendered with a marker (`CONTINUE_TAG`)
        after it and the text is cut at the marker's last occurrence, the content's
        whitespace kept unless the template trimmed it (then the text is cut before the
        trimmed whitespace); an empty content leaves the turn open with no text. A
        string names the field to continue instead of "content" (transformers 5's
        form: "reasoning_content" continues the reasoning).
      bos_token, eos_token: the special-token strings; None leaves the variable
        undefined, as HF leaves unset special tokens, so `{{ bos_token }}` renders as
        "" rather than "None".
      **variables: more template variables: the other special tokens (`pad_token`,
        `additional_special_tokens`, ...: `Tokenizer.special_tokens`), `date_string`,
        `tools`, ...; `tools` and `documents` are None unless given, as in HF, else
        lists of dicts (JSON schemas; a Python function is refused, not converted).

    Raises:
      ImportError: jinja2 is not installed (the message says how to install it).
      TypeError, ValueError: bad messages (`normalize_messages`), `tools` or `documents`
        not lists of dicts, special tokens not strings, a template syntax error,
        an error raised by the template (`raise_exception`: `TemplateRejected`) or while
        rendering it (a TypeError stays one); those of the template name its `source`.
    """
    given, messages = messages, normalize_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message=True continues the last message and "
            "add_generation_prompt=True opens a new assistant turn: pass "
            "add_generation_prompt=False"
        )
    for name, value in (("bos_token", bos_token), ("eos_token", eos_token)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, got {name}={value!r:.80}")
    _check_dicts("tools", variables.get("tools"))
    _check_dicts("documents", variables.get("documents"))
    _jinja()  # before the cache, so a missing jinja2 is reported every time
    compiled = _compile(template, source)
    if content_format(template) == "openai":  # vLLM's parts, for a template that loops over them
        for i, m in enumerate(messages):
            if m["role"] == "tool":  # vLLM's PR #39899: a tool result is a string
                continue
            texts = _texts(f"messages[{i}]", given[i].get("content"))
            m["content"] = [{"type": "text", "text": t} for t in texts]
    messages = [_as_hf_renders(m) for m in messages]
    if continue_final_message:  # marks where the content (its last part) ends, as HF does
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        flag = f"continue_final_message={continue_final_message!r}"
        messages[-1], final = _mark_end(messages[-1], field, flag)
    specials = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}
    context = {"tools": None, "documents": None, **specials, **variables}
    try:
        text = compiled.render(
            messages=messages, add_generation_prompt=bool(add_generation_prompt), **context
        )
    except TemplateRejected:
        raise  # raise_exception's message, which names the template
    except Exception as e:  # TemplateError, and what the template's code raised (1/0, ...)
        # TypeError stays one (a bad value, as transformers raises it); all name the template.
        error = TypeError if isinstance(e, TypeError) else ValueError
        raise error(f"chat template ({source}) failed: {type(e).__name__}: {e}") from None
    if continue_final_message:  # HF's cut (render_jinja_template), whitespace rules and all
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0 or final.strip() not in text:
            raise ValueError(
                f"{flag} but the chat template ({source}) did not "
                f"write the last message's {field} {final.strip()!r:.80}"
            )
        text = text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()
    return text
