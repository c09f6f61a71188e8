"""Chat rendering against transformers' render_jinja_template and vLLM's chat path
(pagedjax/chat.py), found in review: a tool result under a template that loops over
content parts, `tools` and `documents` that are no lists of dicts, a named field to
continue, and special tokens that are no strings."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedjax import chat

ROOT = Path(__file__).resolve().parent.parent

# GLM-5's template, shortened: a user's content may be parts (so vLLM's content format
# is "openai"), and a tool result is a string, else a list of `{"output": ...}` results.
GLM_TOOLS = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if m.content is string %}<tool_response>{{ m.content }}</tool_response>"
    "{% else %}{% for tr in m.content %}"
    "<tool_response>{{ tr.output if tr.output is defined else tr }}</tool_response>"
    "{% endfor %}{% endif %}"
    "{% else %}<{{ m.role }}>"
    "{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
    "{% endif %}{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


TEXT = {"type": "text", "text": "105"}


@pytest.mark.parametrize(
    "content,want",
    [("10525", "10525"), ([TEXT], "105"), ([TEXT, {**TEXT, "text": "25"}], "105\n25"), (None, "")],
)
def test_a_tool_result_reaches_a_parts_template_as_a_string(content, want):
    """vLLM (PR #39899) gives a tool message its text parts joined into one string, even
    for a template that gets content as parts: most read a tool result as a string.
    Here it got `[{"type": "text", ...}]`, which GLM-5's template rendered as the dict."""
    assert chat.content_format(GLM_TOOLS) == "openai"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "user", "content": parts}, {"role": "tool", "content": content}]
    out = chat.render(GLM_TOOLS, msgs, add_generation_prompt=False)
    assert out == f"<user>ab<tool_response>{want}</tool_response>"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(tools={"name": "f"}), r"tools must be a list of dicts, got tools=\{'name': 'f'\}"),
        (dict(tools="f"), "tools must be a list of dicts, got tools='f'"),
        (dict(tools=[{"name": "f"}, "g"]), r"tools\[1\] must be a dict, got 'g'"),
        (dict(tools=[len]), r"tools\[0\] must be a dict \(for a function, pass its JSON schema"),
        (dict(documents=["text"]), r"documents\[0\] must be a dict, got 'text'"),
        (dict(documents={"title": "t"}), "documents must be a list of dicts"),
    ],
)
def test_tools_and_documents_must_be_lists_of_dicts(kw, match):
    """transformers refuses tools that are neither JSON schemas nor functions, and
    documents that are not dicts; a template iterating a dict or a string rendered its
    keys or characters ("[name]" for a tool `{"name": "f"}`). A function, which
    transformers turns into its schema, is refused, not rendered as nothing."""
    template = "{% for t in tools or documents %}[{{ t.name or t }}]{% endfor %}"
    with pytest.raises(TypeError, match=match):
        chat.render(template, MESSAGES, **kw)
    assert chat.render(template, MESSAGES, tools=({"name": "f"},)) == "[f]"
    assert chat.render(template, MESSAGES, documents=[{"title": "t"}]) == "[{'title': 't'}]"


def test_continue_final_message_may_name_the_field_to_continue():
    """transformers 5 takes `continue_final_message="reasoning_content"` (a field name)
    to continue that field; it continued the content, as for True."""
    template = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{{ m.content }}</>{% endfor %}"
    )
    msgs = [*MESSAGES, {"role": "assistant", "content": "", "reasoning": "Let me see. "}]
    kw = dict(add_generation_prompt=False)
    out = chat.render(template, msgs, continue_final_message="reasoning_content", **kw)
    assert out == "<user>hi</><assistant><think>Let me see. "
    assert chat.render(template, msgs, continue_final_message=True, **kw).endswith("</think>")
    with pytest.raises(ValueError, match="the last message has no 'reasoning_content' to"):
        chat.render(template, MESSAGES, continue_final_message="reasoning_content", **kw)
    with pytest.raises(ValueError, match="did not write the last message's thinking 'Let me"):
        chat.render(template, msgs, continue_final_message="thinking", **kw)


@pytest.mark.parametrize("name", ["bos_token", "eos_token"])
def test_special_tokens_must_be_strings(name):
    """An AddedToken dict (tokenizer_config.json's form, which `Tokenizer` unwraps)
    given to `render` as it is was written into the prompt as its repr."""
    token = {"content": "<s>", "special": True}
    with pytest.raises(TypeError, match=rf"{name} must be a str or None, got {name}=\{{'content"):
        chat.render("{{ bos_token }}{{ eos_token }}", MESSAGES, **{name: token})


PARTS_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(
    "part,text",
    [
        ({"type": "refusal", "refusal": "I can't help with that."}, "I can't help with that."),
        ({"type": "input_text", "text": "in"}, "in"),
        ({"type": "output_text", "text": "out"}, "out"),
        ({"type": "thinking", "thinking": "hmm"}, "hmm"),
    ],
)
def test_text_like_parts_are_text_as_vllm_reads_them(part, text):
    """OpenAI's assistant content may hold `{"type": "refusal", "refusal": ...}` parts (a
    client replaying a refused answer sends one back), and vLLM's parse_chat_messages
    also reads the Responses API's `input_text`/`output_text` and its `thinking` parts as
    text. They were refused as "no multimodal input" (a 400 on the server)."""
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, part]},
    ]
    assert chat.normalize_messages(msgs)[1]["content"] == f"a\n{text}"
    out = chat.render(PARTS_TEMPLATE, msgs, add_generation_prompt=False)
    assert out == f"<user>q<assistant>a\n{text}"
    parts = chat.render(GLM_TOOLS, msgs, add_generation_prompt=False)  # "openai" format
    assert parts == f"<user>q<assistant>a{text}"
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[1\] has type='image_url'"):
        chat.normalize_messages([msgs[0], {**msgs[1], "content": [msgs[1]["content"][0], IMAGE]}])
    bad = {**part, **{k: 5 for k in part if k != "type"}}
    with pytest.raises(TypeError, match=r"messages\[1\]\.content\[0\]"):
        chat.normalize_messages([msgs[0], {**msgs[1], "content": [bad]}])


IMAGE = {"type": "image_url", "image_url": {"url": "data:,"}}
NON_ASCII = "<｜User｜>{{ messages[0].content }}<｜Assistant｜>— é"


@pytest.mark.parametrize("where", ["chat_template.jinja", "additional_chat_templates/x.jinja"])
def test_template_files_are_read_as_utf8_whatever_the_locale(tmp_path, where):
    """transformers opens chat_template.jinja as UTF-8; it was read in the locale's
    encoding, so under a C locale (no UTF-8 mode) DeepSeek's `<｜User｜>` template was a
    UnicodeDecodeError, and under cp1252 mojibake that no longer names its special tokens."""
    path = tmp_path / where
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(NON_ASCII.encode("utf-8"))
    name = "None" if where == "chat_template.jinja" else "'x'"
    code = (
        "import sys; from pagedjax import chat; "
        f"t, _ = chat.find_chat_template(sys.argv[1], {{}}, name={name}); "
        "sys.stdout.buffer.write(t.encode('utf-8'))"
    )
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0"}
    env["PYTHONPATH"] = str(ROOT)
    got = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, check=False
    )
    assert got.returncode == 0, got.stderr.decode(errors="replace")[-500:]
    assert got.stdout.decode("utf-8") == NON_ASCII
