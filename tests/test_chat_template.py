"""Chat templates (pagedjax/chat.py, Tokenizer.apply_chat_template / encode_chat).

Each test copies the demo model's tokenizer files (special tokens `<|pad|>` = 0,
`<|bos|>` = 1, `<|eos|>` = 2) into a temp directory and writes a small Llama-3-like
template of our own there, through each of the three places a checkpoint keeps one.
"""

import builtins
import json
import shutil

import pytest

from pagedjax import chat, openai_api
from pagedjax.demo import DEMO_MODEL_DIR
from pagedjax.resources import byte_tokenizer
from pagedjax.tokenizer import Tokenizer

# <|pad|> stands in for a header token: a special token the template writes literally.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}\n"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}\n"
    "<|pad|>{{ m['role'] }}\n"
    "{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|pad|>assistant\n"
    "{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Answer in Python."},
    {"role": "user", "content": "def fib(n):"},
]
RENDERED = (
    "<|bos|><|pad|>system\nAnswer in Python.<|eos|>\n"
    "<|pad|>user\ndef fib(n):<|eos|>\n"
    "<|pad|>assistant\n"
)
PAD, BOS, EOS = 0, 1, 2

# A template that renders tool calls (their arguments as JSON) and tool results, as
# tool-use templates do; the conversation is in OpenAI's form, as vLLM's LLM.chat and
# server take it: text parts, null and left-out content, JSON-string arguments.
TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
}
OPENAI_CHAT = [
    {
        "role": "system",
        "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
    },
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            CALL,
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Sunny"}]},
    {"role": "tool", "tool_call_id": "c2"},
    {"role": "assistant", "content": "Sunny.", "tool_calls": []},
    {"role": "user", "content": "And tomorrow?"},
]
OPENAI_RENDERED = (
    "<system>Be brief.\nUse tools.\n"
    "<user>Weather in Oslo?\n"
    '<assistant><call>weather{"city": "Oslo"}</call><call>now{}</call>\n'
    "<tool>Sunny[c1]\n"
    "<tool>[c2]\n"
    "<assistant>Sunny.\n"
    "<user>And tomorrow?\n"
    "<assistant>"
)


def checkpoint(tmp_path, *, name="ckpt", jinja=None, json_file=None, config=None):
    """A tokenizer directory: the demo model's files plus the chat template sources given."""
    d = tmp_path / name
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, d / name)
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    if json_file is not None:
        (d / "chat_template.json").write_text(json.dumps({"chat_template": json_file}))
    if config is not None:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = config
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def tok(tmp_path):
    return Tokenizer.from_dir(checkpoint(tmp_path, jinja=TEMPLATE))


def test_renders_exactly(tok):
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eos|>"
    assert tok.apply_chat_template(MESSAGES) == RENDERED
    without = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert without == RENDERED.removesuffix("<|pad|>assistant\n")


def test_encode_chat_parses_special_tokens_and_has_bos_once(tok):
    assert tok.add_bos  # the demo tokenizer adds BOS, and the template writes it too
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(BOS) == 1 and ids[0] == BOS
    piece = lambda text: tok.encode(text, add_bos=False)
    # Every special-token string in the text became its single id, and the user's text
    # is encoded as it is on its own.
    want = [BOS, PAD, *piece("system\nAnswer in Python."), EOS, *piece("\n")]
    want += [PAD, *piece("user\ndef fib(n):"), EOS, *piece("\n")]
    want += [PAD, *piece("assistant\n")]
    assert ids == want
    assert tok.decode(ids, skip_special_tokens=False) == RENDERED
    user = piece("def fib(n):")
    assert any(ids[i : i + len(user)] == user for i in range(len(ids)))


def test_a_template_without_bos_gets_none(tmp_path):
    """HF's apply_chat_template(tokenize=True) and vLLM's chat encode the rendered text
    without special tokens: a template that writes no BOS (ChatML on a tokenizer that
    adds BOS) gets none. BOS was prepended here whenever the tokenizer adds BOS."""
    tok = Tokenizer.from_dir(checkpoint(tmp_path, jinja=TEMPLATE.replace("{{ bos_token }}", "")))
    assert tok.add_bos  # raw text still gets BOS; the chat path does not
    text = RENDERED.removeprefix("<|bos|>")
    ids = tok.encode_chat(MESSAGES)
    assert ids == tok.encode(text, add_bos=False) and ids[0] == PAD and BOS not in ids
    assert tok.encode_rendered(text) == ids
    assert tok.encode_conversations(MESSAGES) == ([text], [ids])
    assert tok.encode_conversations([MESSAGES, MESSAGES])[1] == [ids, ids]
    assert tok.encode_chat(MESSAGES, add_bos=True) == [BOS, *ids]  # asked for: still once
    assert tok.encode_rendered(text, add_bos=True) == [BOS, *ids]
    # A template that writes BOS: once, asked for or not.
    with_bos = tok.with_chat_template(TEMPLATE)
    assert with_bos.encode_chat(MESSAGES) == with_bos.encode_chat(MESSAGES, add_bos=True)
    assert with_bos.encode_chat(MESSAGES) == [BOS, *ids]
    # A tokenizer that does not add BOS: the same ids.
    built = Tokenizer(
        tok.tokenizer, bos_token_id=BOS, eos_token_ids=[EOS], chat_template=tok.chat_template
    )
    assert not built.add_bos and built.encode_chat(MESSAGES) == ids


def test_added_token_dicts_in_the_config(tmp_path):
    d = checkpoint(tmp_path, jinja=TEMPLATE)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": "<|bos|>", "lstrip": False, "special": True}
    cfg["eos_token"] = {"content": "<|eos|>", "lstrip": False, "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    assert (tok.bos_token, tok.eos_token) == ("<|bos|>", "<|eos|>")
    assert tok.apply_chat_template(MESSAGES) == RENDERED


def test_every_named_special_token_is_a_template_variable(tmp_path):
    """As in HF (its `special_tokens_map`): pad, unk, sep, cls, mask and the additional
    special tokens too, as strings (AddedToken dicts unwrapped); unset ones stay
    undefined; the caller's variables win."""
    names = ["pad", "unk", "sep", "cls", "mask", "bos", "eos"]
    template = "|".join(f"{{{{ {n}_token }}}}" for n in names)
    template += "|{{ additional_special_tokens | join(',') }}|{{ image_token }}"
    d = checkpoint(tmp_path, jinja=template)
    cfg = json.loads((d / "tokenizer_config.json").read_text())  # pad: "<|pad|>" already
    cfg["unk_token"] = {"content": "<unk>", "lstrip": False, "special": True}
    cfg["mask_token"] = None
    cfg["additional_special_tokens"] = ["<a>", {"content": "<b>", "special": True}]
    cfg["extra_special_tokens"] = {"image_token": "<img>"}  # named ones (HF >= 4.48)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    want = "<|pad|>|<unk>||||<|bos|>|<|eos|>|<a>,<b>|<img>"
    assert tok.apply_chat_template(MESSAGES) == want
    assert tok.special_tokens["pad_token"] == "<|pad|>"
    out = tok.apply_chat_template(MESSAGES, pad_token="P", bos_token="B")
    assert out == want.replace("<|pad|>", "P").replace("<|bos|>", "B")
    assert tok.with_chat_template(template).apply_chat_template(MESSAGES) == want
    built = Tokenizer(
        tok.tokenizer,
        eos_token_ids=[EOS],
        chat_template=template,
        special_tokens={"sep_token": "S"},
    )
    assert built.apply_chat_template(MESSAGES) == "||S||||<|eos|>||"  # eos: from its id
    with pytest.raises(TypeError, match=r"special_tokens\['sep_token'\] must be a str"):
        Tokenizer(tok.tokenizer, special_tokens={"sep_token": 3})


def test_constructor_takes_a_template_and_names_special_ids(tok):
    built = Tokenizer(tok.tokenizer, bos_token_id=BOS, eos_token_ids=[EOS], chat_template=TEMPLATE)
    assert (built.bos_token, built.eos_token) == ("<|bos|>", "<|eos|>")  # from the ids
    assert built.apply_chat_template(MESSAGES) == RENDERED
    # A byte tokenizer's BOS id is a plain byte, not a special token: no string for it.
    assert byte_tokenizer().bos_token is None and byte_tokenizer().chat_template is None
    with pytest.raises(TypeError, match="chat_template must be a str"):
        Tokenizer(tok.tokenizer, chat_template=["x"])


@pytest.mark.parametrize(
    "sources,winner",
    [
        (dict(jinja="J", json_file="S", config="C"), "J"),
        (dict(json_file="S", config="C"), "C"),
        (dict(json_file="S"), "S"),
        (dict(config="C"), "C"),
        (
            dict(
                config=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "C"}]
            ),
            "C",
        ),
    ],
)
def test_precedence(tmp_path, sources, winner):
    tok = Tokenizer.from_dir(checkpoint(tmp_path, **sources))
    assert tok.chat_template == winner
    file = {"J": "chat_template.jinja", "S": "chat_template.json", "C": "tokenizer_config.json"}
    assert tok.chat_template_source.startswith(str(tmp_path / "ckpt" / file[winner]))


def test_tokenizer_config_template_beats_chat_template_json(tmp_path):
    """HF's tokenizer reads chat_template.jinja, else tokenizer_config.json's template;
    chat_template.json is a processor's file it never reads. It came before
    tokenizer_config.json here: a checkpoint with both rendered another template."""
    tok = Tokenizer.from_dir(checkpoint(tmp_path, json_file="{{ 'processor' }}", config=TEMPLATE))
    assert tok.chat_template_source == str(tmp_path / "ckpt" / "tokenizer_config.json")
    assert tok.apply_chat_template(MESSAGES) == RENDERED


def test_tools_pick_the_tool_use_template(tmp_path):
    """Given `tools`, HF's apply_chat_template renders a named list's "tool_use" template
    (Hermes 2 Pro's list); it rendered the default one, which ignores the tools."""
    names = "T{% for t in tools %}[{{ t.name }}]{% endfor %}"
    tool_use = TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}" + names)
    listed = lambda text: RENDERED.replace("<|bos|>", "<|bos|>" + text)
    d = checkpoint(
        tmp_path,
        config=[
            {"name": "default", "template": TEMPLATE},
            {"name": "tool_use", "template": tool_use},
        ],
    )
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template(MESSAGES) == RENDERED
    assert tok.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == listed("T[f]")
    assert tok.apply_chat_template(MESSAGES, tools=[]) == listed("T")  # not None: tool_use
    ids = tok.encode_chat(MESSAGES, tools=[{"name": "f"}])
    assert tok.decode(ids, skip_special_tokens=False) == listed("T[f]")
    # A template named or given explicitly is used whatever the tools, as in HF.
    named = Tokenizer.from_dir(d, chat_template_name="default")
    assert named.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == RENDERED
    other = tok.with_chat_template("{{ tools | length }}")
    assert other.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == "1"
    # The files transformers saves a list as: additional_chat_templates/tool_use.jinja.
    d = checkpoint(tmp_path, name="files", jinja=TEMPLATE)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template(MESSAGES, tools=[{"name": "g"}]) == listed("T[g]")
    assert tok.apply_chat_template(MESSAGES) == RENDERED


def test_each_source_renders(tmp_path):
    for i, kw in enumerate([dict(jinja=TEMPLATE), dict(json_file=TEMPLATE), dict(config=TEMPLATE)]):
        tok = Tokenizer.from_dir(checkpoint(tmp_path, name=str(i), **kw))
        assert tok.apply_chat_template(MESSAGES) == RENDERED, kw


def test_list_form_without_default_gives_none_unless_named(tmp_path):
    d = checkpoint(tmp_path, config=[{"name": "tool_use", "template": TEMPLATE}])
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"\['tool_use'\] but none named 'default'"):
        tok.apply_chat_template(MESSAGES)
    named = Tokenizer.from_dir(d, chat_template_name="tool_use")
    assert named.apply_chat_template(MESSAGES) == RENDERED
    with pytest.raises(ValueError, match="no chat template named 'rag'"):
        Tokenizer.from_dir(d, chat_template_name="rag")


def test_no_template(tmp_path):
    tok = Tokenizer.from_dir(checkpoint(tmp_path))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*raw text"):
        tok.encode_chat(MESSAGES)
    assert tok.encode("x") == [BOS, *tok.encode("x", add_bos=False)]  # raw text still works


@pytest.mark.parametrize(
    "messages,exc,match",
    [
        ("hello", TypeError, "must be a list.*got str: 'hello'"),
        (b"hello", TypeError, "must be a list.*got bytes"),
        ({"role": "user", "content": "x"}, TypeError, "must be a list.*got dict"),
        ([], ValueError, "messages is empty"),
        (["hello"], TypeError, r"messages\[0\] must be a dict .a JSON object., got str"),
        (
            [{"role": "user", "content": "a"}, {"content": "b"}],
            TypeError,
            r"messages\[1\].role must be a str, got role=None",
        ),
        (
            [{"role": "user", "content": 3}],
            TypeError,
            r"messages\[0\].content must be a str, a list of text parts or None, got content=3",
        ),
        ([{"role": 5, "content": "x"}], TypeError, r"messages\[0\].role must be a str, got role=5"),
        ([{"role": "", "content": "x"}], ValueError, r"messages\[0\].role is empty"),
        # Multimodal parts are refused by name, and so is a part that is no text part.
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}],
            ValueError,
            r"messages\[0\].content\[1\] has type='image_url': only text content parts",
        ),
        (
            [{"role": "user", "content": [{"text": "a"}]}],
            ValueError,
            r"messages\[0\].content\[0\] has type=None: only text content parts",
        ),
        (
            [{"role": "user", "content": ["a"]}],
            TypeError,
            r"messages\[0\].content\[0\] must be a text part",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": None}]}],
            TypeError,
            r"messages\[0\].content\[0\]: a text part's text must be a str",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": "f()"}],
            TypeError,
            r"messages\[1\].tool_calls must be a list, got 'f\(\)'",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"name": "f"}]}],
            TypeError,
            r"messages\[0\].tool_calls\[0\] must be {\"function\"",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [CALL, {"function": {"name": "f", "arguments": "{"}}],
                }
            ],
            ValueError,
            r"messages\[0\].tool_calls\[1\].function.arguments is not JSON .*: '{'",
        ),
    ],
)
def test_bad_messages(tok, messages, exc, match):
    with pytest.raises(exc, match=match):
        tok.apply_chat_template(messages)


def test_openai_messages_render_as_vllm_makes_them(tok):
    """vLLM's LLM.chat and server both parse messages with parse_chat_messages: content
    None or left out is "", text parts are joined with newlines, an assistant's tool
    calls get their JSON arguments parsed ({} for ""), an empty tool_calls is dropped.
    encode_chat, encode_conversations and the server's path give the same ids."""
    tools = tok.with_chat_template(TOOL_TEMPLATE, "tools")
    before = json.dumps(OPENAI_CHAT)
    assert tools.apply_chat_template(OPENAI_CHAT) == OPENAI_RENDERED
    ids = tools.encode_chat(OPENAI_CHAT)
    assert ids == tools.encode_rendered(OPENAI_RENDERED)
    assert tools.encode_conversations([OPENAI_CHAT, MESSAGES])[1][0] == ids
    server = openai_api.chat_prompt({"messages": OPENAI_CHAT}, tools, "completions")
    assert server == ids
    assert json.dumps(OPENAI_CHAT) == before  # the caller's messages are left unchanged
    normalized = chat.normalize_messages(OPENAI_CHAT)
    assert normalized[0]["content"] == "Be brief.\nUse tools." and normalized[4]["content"] == ""
    assert normalized[2]["tool_calls"][0] == {
        **CALL,
        "function": {"name": "weather", "arguments": {"city": "Oslo"}},
    }
    assert normalized[2]["tool_calls"][1]["function"]["arguments"] == {}
    assert "tool_calls" not in normalized[5]


def test_the_server_gives_a_template_that_loops_over_parts_the_parts(tok):
    """vLLM's "openai" content format on the server too: it rendered the parts joined
    into one ("a \nb" where the template writes "ab")."""
    from test_chat_semantics import PARTS, PARTS_TEMPLATE

    parts = tok.with_chat_template(PARTS_TEMPLATE, "parts")
    ids = openai_api.chat_prompt({"messages": PARTS}, parts, "completions")
    assert ids == parts.encode_chat(PARTS)
    want = "<user>Be brief.\n\nab</><assistant></><user>c</><assistant>"
    assert ids == parts.encode_rendered(want)


def test_bad_messages_are_the_same_400s_on_the_server(tok):
    """The server's 400s carry normalize_messages' words, naming the field "messages"."""
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(ValueError) as direct:  # refused before the template runs
        tok.with_chat_template("{{ raise_exception('rendered') }}").apply_chat_template(bad)
    with pytest.raises(openai_api.ApiError) as served:
        openai_api.chat_prompt({"messages": bad}, tok, "completions")
    assert served.value.status == 400 and served.value.param == "messages"
    assert served.value.message == str(direct.value)
    assert "messages[0].tool_calls[0].function.arguments is not JSON" in served.value.message


def test_template_raise_exception(tok):
    with pytest.raises(
        ValueError, match="chat_template.jinja.*rejected the messages: unknown role: tool"
    ):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


def test_template_syntax_error_names_the_source(tmp_path):
    tok = Tokenizer.from_dir(checkpoint(tmp_path, json_file="ok\n{% for m in messages %}{{ m }"))
    with pytest.raises(ValueError, match=r"chat_template.json\) has a syntax error at line 2: "):
        tok.apply_chat_template(MESSAGES)


def test_variables_filters_and_globals():
    template = (
        "{{ messages | length }} {{ tools | tojson }} {{ date_string }} "
        "{{ {'café': [1, 2]} | tojson(indent=2) }} {{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "|{{ m.content }}{% endfor %}"
        "[{{ bos_token }}]"
    )
    out = chat.render(template, MESSAGES, date_string="26 Jul 2024")
    assert out == '2 null 26 Jul 2024 {\n  "café": [\n    1,\n    2\n  ]\n} 4|Answer in Python.[]'


def test_template_cannot_mutate_its_inputs():
    messages = [dict(m) for m in MESSAGES]
    with pytest.raises(ValueError, match="failed: SecurityError"):
        chat.render("{{ messages.append(1) }}", messages)
    assert messages == MESSAGES


def test_missing_jinja2_says_how_to_install(tok, monkeypatch):
    real_import = builtins.__import__

    def no_jinja(name, *args, **kwargs):
        if name.startswith("jinja2"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    assert chat.jinja_missing() is None
    monkeypatch.setattr(builtins, "__import__", no_jinja)
    with pytest.raises(ImportError, match=r"pip install 'jinja2>=3.1' \(the chat extra"):
        tok.apply_chat_template(MESSAGES)  # compiled earlier in the session or not
    assert "pip install 'jinja2>=3.1'" in chat.jinja_missing()


def test_with_chat_template_replaces_the_template_in_a_copy(tok):
    other = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>"
    new = tok.with_chat_template(other, "my.jinja")
    assert new.apply_chat_template(MESSAGES) == "[system] Answer in Python.\n[user] def fib(n):\n>"
    assert new.chat_template == other and new.chat_template_source == "my.jinja"
    # The rest of the tokenizer is the same (this template writes no BOS: none added).
    assert new.encode_chat(MESSAGES) == tok.encode(new.apply_chat_template(MESSAGES), add_bos=False)
    assert new.encode_chat(MESSAGES, add_bos=True)[0] == BOS
    assert tok.apply_chat_template(MESSAGES) == RENDERED  # the original is unchanged
    none = byte_tokenizer().with_chat_template(other)
    assert none.chat_template_source == "<given>" and none.apply_chat_template(MESSAGES)


def test_with_chat_template_parses_at_once(tok):
    with pytest.raises(ValueError, match=r"\(bad.jinja\) has a syntax error at line 2: "):
        tok.with_chat_template("ok\n{% for m in messages %}{{ m }", "bad.jinja")
    with pytest.raises(TypeError, match="template must be a str, got bytes"):
        tok.with_chat_template(b"{{ messages }}")


def test_generation_blocks_render_their_body():
    """HF's `{% generation %}` marks assistant text for training masks (templates saved
    by SFT runs have it); HF renders its body unchanged, so must we."""
    template = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}!{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [*MESSAGES, {"role": "assistant", "content": "pass"}, MESSAGES[1]]
    out = chat.render(template, messages)
    want = "<system>Answer in Python.<user>def fib(n):<assistant>pass!<user>def fib(n):"
    assert out == want + "<assistant>"
    with pytest.raises(ValueError, match="syntax error"):  # the block must be closed
        chat.render("{% generation %}{{ messages }}", messages, source="open")


@pytest.mark.parametrize(
    "template,match",
    [
        ("{{ (messages | length) / 0 }}", "ZeroDivisionError"),
        ("{% for i in range(10 ** 7) %}{% endfor %}", "OverflowError"),  # the sandbox's cap
        ("{{ messages[0].content | int // 0 }}", "ZeroDivisionError"),
    ],
)
def test_any_error_while_rendering_is_a_value_error(template, match):
    """render promises ValueError/TypeError for an error while rendering (the OpenAI
    server answers those with a 400); ZeroDivisionError and the sandbox's OverflowError
    escaped as themselves."""
    msgs = [{"role": "user", "content": "7"}]
    with pytest.raises(ValueError, match=rf"chat template \(<string>\) failed: {match}"):
        chat.render(template, msgs)


def test_continue_final_message_leaves_the_last_message_open(tok):
    """HF's `continue_final_message`: the text ends with the last message's content (no
    end-of-turn) so that the model continues it; it was passed to the template as an
    unused variable, which closed the turn."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "def fib(n):\n    "}]
    kw = dict(continue_final_message=True, add_generation_prompt=False)
    want = RENDERED + "def fib(n):\n    "  # the template keeps whitespace: so does the cut
    assert tok.apply_chat_template(prefill, **kw) == want
    assert tok.decode(tok.encode_chat(prefill, **kw), skip_special_tokens=False) == want
    # The last occurrence is cut after (the content is also the user's message here).
    trim = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    assert tok.with_chat_template(trim).apply_chat_template(prefill, **kw) == want.rstrip()
    with pytest.raises(ValueError, match="pass add_generation_prompt=False"):
        tok.apply_chat_template(prefill, continue_final_message=True)
    # A blank last message is continued, as HF does: an open turn (test_chat_semantics).
    blank = tok.apply_chat_template([*MESSAGES, {"role": "assistant", "content": " "}], **kw)
    assert blank == RENDERED + " "
    drops = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match=r"\(<string>\) did not write the last message's"):
        chat.render(drops, prefill, **kw)


def test_continue_final_message_cuts_where_the_content_ends(tok):
    """transformers 5 marks the end of the content and cuts there: the content's own
    whitespace is kept (it was dropped when the content began with whitespace), and a
    content that the end-of-turn text contains is not looked for in it (the text was
    cut inside "<|eos|>", "eos<|eos", a broken special token)."""
    kw = dict(continue_final_message=True, add_generation_prompt=False)
    for content in ("  spaced  ", "\n```python\n", "eos", "|>", "s"):
        prefill = [*MESSAGES, {"role": "assistant", "content": content}]
        want = RENDERED + content
        assert tok.apply_chat_template(prefill, **kw) == want, content
        ids = tok.encode_chat(prefill, **kw)
        assert tok.decode(ids, skip_special_tokens=False) == want
    # A template that trims the content: the text ends where the trimmed content does.
    trim = tok.with_chat_template(
        TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    )
    prefill = [*MESSAGES, {"role": "assistant", "content": "  spaced  "}]
    assert trim.apply_chat_template(prefill, **kw) == RENDERED + "spaced"


def test_messages_reach_the_template_as_transformers_passes_them():
    """transformers 5 leaves out a message's keys whose value is None (OpenAI clients
    send `"tool_calls": null`, which Llama 3.1's `'tool_calls' in message` took for a
    tool call and failed on) and passes the reasoning under each name templates read
    (Qwen3's `reasoning_content` from a `reasoning`, gpt-oss's `thinking`)."""
    template = (
        "{% for m in messages %}{{ m.role }}:{{ 'tool_calls' in m }}"
        ":{{ m.reasoning_content }}:{{ m.thinking }}:{{ m.content }}|{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "hi", "tool_calls": None, "name": None},
        {"role": "assistant", "content": "a", "reasoning": "R"},
        {"role": "assistant", "content": "b", "thinking": "T", "reasoning": "R"},
        {"role": "assistant", "content": "c", "reasoning_content": "C", "thinking": "T"},
        {"role": "assistant", "content": "d", "reasoning_content": None, "reasoning": "R"},
    ]
    out = chat.render(template, messages, add_generation_prompt=False)
    want = "user:False:::hi|assistant:False:R:R:a|assistant:False:T:T:b|"
    assert out == want + "assistant:False:C:T:c|assistant:False:R:R:d|"
    assert messages[0]["tool_calls"] is None and "reasoning_content" not in messages[1]


def test_named_templates_in_additional_chat_templates(tmp_path):
    """transformers saves a list-form template as chat_template.jinja (the default) plus
    additional_chat_templates/NAME.jinja; those files win over tokenizer_config.json."""
    d = checkpoint(tmp_path, jinja=TEMPLATE, config="C")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template == TEMPLATE
    assert tok.chat_template_source == str(d / "chat_template.jinja")
    named = Tokenizer.from_dir(d, chat_template_name="tool_use")
    assert named.chat_template == "T"
    assert named.chat_template_source == str(d / "additional_chat_templates" / "tool_use.jinja")
    with pytest.raises(
        ValueError, match=r"no chat template named 'rag'.*\['default', 'tool_use'\]"
    ):
        Tokenizer.from_dir(d, chat_template_name="rag")
    (d / "chat_template.jinja").unlink()  # named ones only: no default, as a list without one
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template is None
    assert tok.chat_template_source.endswith("['tool_use'] but none named 'default'")


def test_encode_conversations_names_the_bad_conversation(tok):
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\].role is empty"):
        tok.encode_conversations([MESSAGES, [{"role": "", "content": "x"}]])
    with pytest.raises(TypeError, match=r"conversation 0: messages\[0\].content must"):
        tok.encode_conversations([[{"role": "user", "content": 1}]])


@pytest.mark.parametrize(
    "sources,name,match",
    [
        (dict(config=TEMPLATE), "rag", "has a single chat template, none named 'rag'"),
        (dict(jinja=TEMPLATE), "rag", "has a single chat template, none named 'rag'"),
        ({}, "rag", "has no chat template, so none named 'rag'"),
        (
            dict(config=[{"name": "default", "template": 3}]),
            None,
            r"chat_template\[0\] is not a \{name, template\}",
        ),
        (dict(config=[{"template": "T"}]), None, r"chat_template\[0\] is not a \{name, template\}"),
        (dict(config={"default": "T"}), None, "must be a string or a list .* got dict"),
    ],
)
def test_bad_template_sources_and_names(tmp_path, sources, name, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(checkpoint(tmp_path, **sources), chat_template_name=name)
    if name is not None and sources:  # "default" names the single template
        tok = Tokenizer.from_dir(
            checkpoint(tmp_path, name="d", **sources), chat_template_name="default"
        )
        assert tok.chat_template == TEMPLATE


@pytest.mark.parametrize(
    "content,match",
    [
        (
            '{"template": "T"}',
            r"chat_template.json has no 'chat_template' key \(keys: \['template'\]\)",
        ),
        ('["T"]', "chat_template.json must hold a JSON object, got a list"),
        ("{nope", "chat_template.json is not valid JSON"),
    ],
)
def test_bad_chat_template_json(tmp_path, content, match):
    d = checkpoint(tmp_path)
    (d / "chat_template.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(d)


def test_jinja_environment_as_transformers():
    """Outputs of transformers 5.24's render_jinja_template: lstrip_blocks (indented
    block tags leave no indent), tools and documents None unless given, tojson's
    sort_keys and separators, and a TypeError in the template raised as itself."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    indented = "A\n    {% for m in messages %}\n    {{ m.role }}\n    {% endfor %}\nB"
    assert chat.render(indented, msgs) == "A\n    user\n    assistant\nB"
    out = chat.render(
        "{{ documents is none }}|{{ tools is none }}|"
        "{{ {'b': 1, 'a': [2, 'é']} | tojson(sort_keys=True, separators=(',', ':')) }}",
        msgs,
    )
    assert out == 'True|True|{"a":[2,"é"],"b":1}'
    # transformers' tojson(x, ensure_ascii=False, indent=None, ...): GLM's and MiniCPM's
    # templates pass ensure_ascii=False (a TypeError here failed every request with
    # tools), and a positional argument is ensure_ascii, not Jinja's indent.
    out = chat.render(
        "{{ tools[0] | tojson(ensure_ascii=False) }}|{{ tools[0] | tojson(ensure_ascii=True) }}"
        "|{{ tools[0] | tojson(2) }}|{{ tools[0] | tojson(False, 1) }}",
        msgs,
        tools=[{"k": "é"}],
    )
    assert out == '{"k": "é"}|{"k": "\\u00e9"}|{"k": "\\u00e9"}|{\n "k": "é"\n}'
    with pytest.raises(TypeError, match="can only concatenate str"):
        chat.render("{{ messages[0].content + 1 }}", msgs)


def test_continue_final_message_as_transformers():
    """transformers 5.24's cut: at the marker's last occurrence (a template that writes
    the last message twice keeps the first copy's marker, as there), and a template
    that does not write the content as given (`| upper`) is an error, not a cut."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    kw = dict(continue_final_message=True, add_generation_prompt=False)
    twice = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "|{{ messages[-1].content }}."
    )
    want = "<user>hi</user><assistant>The answerCONTINUE_FINAL_MESSAGE_TAG </assistant>|The answer"
    assert chat.render(twice, msgs, **kw) == want
    upper = "{% for m in messages %}{{ m.content | upper }}!{% endfor %}"
    with pytest.raises(ValueError, match="did not write the last message's content 'The answer'"):
        chat.render(upper, msgs, **kw)
