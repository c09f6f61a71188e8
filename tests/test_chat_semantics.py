"""Chat rendering semantics against vLLM's chat path and transformers' render_jinja_template
(pagedjax/chat.py): the content format a template gets, continuing a blank message, and
errors raised inside a template naming it."""

import pytest

from pagedjax import chat

# Gemma 3's template, shortened: it loops over a message's content parts (vLLM's "openai"
# content format) and reads a system message's first part only.
PARTS_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "<{{ message['role'] }}>{{ prefix if loop.first else '' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}</>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)
# A template that reads the content as a string (vLLM's "string" content format).
STRING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PARTS = [
    {
        "role": "system",
        "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
    },
    {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": None},
    {"role": "user", "content": "c"},
]


@pytest.mark.parametrize(
    "template,want",
    [
        (STRING_TEMPLATE, "string"),
        (PARTS_TEMPLATE, "openai"),
        (
            "{% for m in messages %}{% for c in m.content | reverse %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set ms = messages %}{% for m in ms %}"
            "{% for c in m['content'] %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for c in messages[0].content %}{% endfor %}", "string"),  # not a loop's message
        ("{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %}", "string"),  # a syntax error: vLLM's default
    ],
)
def test_content_format_is_detected_as_vllm_does(template, want):
    assert chat.content_format(template) == want


def test_a_template_that_loops_over_parts_gets_parts_as_vllm_passes_them():
    """vLLM passes content as text parts to a template that loops over them (Gemma 3,
    Llama 4, Qwen-VL), a string or null content too; the parts were joined with "\\n"
    into a string, which such a template renders differently ("a \\nb" for "ab", both
    system parts where it reads the first)."""
    out = chat.render(PARTS_TEMPLATE, PARTS)
    assert out == "<user>Be brief.\n\nab</><assistant></><user>c</><assistant>"
    # A template that reads strings still gets the parts joined with "\n".
    out = chat.render(STRING_TEMPLATE, PARTS)
    assert out == "<system>Be brief.\nBe kind.</><user>a \nb</><assistant></><user>c</><assistant>"
    assert PARTS[1]["content"][0] == {"type": "text", "text": "a "}  # the caller's, unchanged


def test_continue_final_message_on_parts_continues_the_last_part():
    """transformers continues the last text part of a list content."""
    kw = dict(continue_final_message=True, add_generation_prompt=False)
    loose = PARTS_TEMPLATE.replace("| trim", "")
    msgs = [*PARTS[:2], {"role": "assistant", "content": [{"type": "text", "text": "x "}]}]
    assert chat.render(loose, msgs, **kw) == "<user>Be brief.\n\na b</><assistant>x "
    with pytest.raises(ValueError, match="no text to continue"):
        chat.render(loose, [*PARTS[:2], {"role": "assistant", "content": None}], **kw)


@pytest.mark.parametrize("content", ["", " ", None])
def test_continue_final_message_continues_a_blank_message(content):
    """transformers and vLLM continue an empty (or blank) last message: the text ends
    where its content would be, an open assistant turn; it was refused."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    kw = dict(continue_final_message=True, add_generation_prompt=False)
    loose = STRING_TEMPLATE.replace(" | trim", "")
    assert chat.render(loose, msgs, **kw) == "<user>hi</><assistant>" + (content or "")
    # A template that trims the content: cut before the trimmed whitespace, as HF cuts.
    assert chat.render(STRING_TEMPLATE, msgs, **kw) == "<user>hi</><assistant>"


@pytest.mark.parametrize(
    "template,exc,match",
    [
        ("{{ messages[0].content + 1 }}", TypeError, "can only concatenate str"),
        ("{{ tools | length }}", TypeError, "has no len"),
        ("{{ messages[0].content.index('zz') }}", ValueError, "substring not found"),
    ],
)
def test_an_error_inside_the_template_names_it(template, exc, match):
    """A TypeError or ValueError raised while rendering (a template that expects `tools`
    to be a list) reached the caller, a server's 400, without naming the template."""
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(
        exc, match=rf"^chat template \(tpl.jinja\) failed: {exc.__name__}: .*{match}"
    ):
        chat.render(template, msgs, source="tpl.jinja")
    # raise_exception's message is named once, not wrapped again.
    with pytest.raises(
        ValueError, match=r"^chat template \(tpl.jinja\) rejected the messages: no$"
    ):
        chat.render("{{ raise_exception('no') }}", msgs, source="tpl.jinja")
