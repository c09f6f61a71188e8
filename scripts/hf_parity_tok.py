"""Tokenizer and chat-template parity with transformers: the tok-* cases of
`check_hf_parity.py` (run them with `python scripts/check_hf_parity.py --cases tok`).

Each case (`TOK_CASES`) writes a tokenizer directory in one family's style: a
tokenizer.json built here with the `tokenizers` library (byte-level BPE with Llama 3's
or Qwen2's split regex; SentencePiece-converted BPE with byte fallback, Mistral's
Metaspace or Llama 2's legacy normalizer), a tokenizer_config.json as those
checkpoints have it (bos/eos, add_bos_token, tokenizer_class, chat_template) and chat
templates of our own modeled on Llama 3.1's, Qwen2.5's, Qwen3's, Mistral's, Llama 2's
and a ChatML fine-tune's (a default + tool_use list). `Tokenizer.from_dir` and
`AutoTokenizer.from_pretrained` load it, and every check compares ours with HF's:

* facts: BOS id, HF's EOS among ours.
* chat / chat ids: `apply_chat_template` text and `encode_chat` ids for each of
  `CONVERSATIONS` (system or not, multi-turn, empty, unicode, special-token text in
  content, roles a template refuses, tool calls, reasoning) with and without the
  generation prompt, and continuing a final assistant message, with each of the
  case's template variables (tools, enable_thinking, date_string); a refusal must be
  one on both sides.
* encode: `encode(text)` vs `tokenizer(text)` (with and without BOS) for `TOK_TEXTS`
  and the rendered prompts.
* decode: `decode(ids, skip_special_tokens=)` vs HF's, both ways, for those ids and
  random ones (byte tokens, special tokens anywhere).
* context: a completion's `decode(ids, context=prompt)` and `stream(context=prompt)`
  vs HF's decode(prompt + ids) less decode(prompt), for chat prompts and random ones
  (skipped where the prompt's text ends inside a character, which the completion's
  bytes may complete: what it adds is then moot).

A case passes when every check is equal, HF's result adjusted only by our documented
choices, each counted in the table ("deliberate"): no second BOS for text that starts
with it (`Tokenizer.encode`); a blank final message is not continued (`chat.render`).
Chat ids are HF's exactly: a template that writes no BOS gets none, whether the
tokenizer adds BOS by its config (tok-chatml) or by its post-processor alone
(tok-llama3-chatml), as HF's `apply_chat_template` encodes the text without special
tokens. Llama 2's tokenizer_class `LlamaTokenizer` is not used: transformers 5 rebuilds
that class's own pre-tokenizer (Metaspace) instead of the tokenizer.json's legacy
normalizer, ids that differ (leading spaces, text after special tokens) from the
tokenizer.json we follow.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import tempfile
import time
from collections.abc import Callable

TOK_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I'm fine, thanks.",
    "You are a helpful assistant. Answer the question in one sentence.",
    "What is the capital of France? The capital of France is Paris.",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Paged attention keeps the key value cache in fixed-size pages.",
    "héllo wörld, ça va? naïve café, 日本語のテキスト, emoji 🙂🚀",
    "system user assistant tool reasoning think answer weather",
)
# The pre-tokenizer regexes of Llama 3's and Qwen2's tokenizer.json.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# SentencePiece-style tokenizers learn these characters; the rest is byte fallback.
SP_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?'()-+<>=:;▁"


def _byte_level_bpe(split: str, specials, *, plain=(), nfc=False, bos=None):
    """A byte-level BPE (Llama 3 / Qwen2 style: regex split, then bytes) trained on
    TOK_CORPUS, with `specials` (special) and `plain` (not special) added tokens after
    the vocabulary, and `bos` prepended by the post-processor (Llama 3)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pre
    from tokenizers import processors as post

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC() if nfc else None
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(split), "isolated"),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(list(TOK_CORPUS) * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    processor = post.ByteLevel(trim_offsets=False)
    if bos is not None:
        prepend = post.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
        processor = post.Sequence([processor, prepend])
    tok.post_processor = processor
    return tok


def _sentencepiece_bpe(*, legacy: bool, specials=()):
    """A SentencePiece-converted BPE (<unk> <s> </s>, then the 256 <0xXX> byte tokens,
    then pieces learned from TOK_CORPUS over SP_ALPHABET; byte fallback for the rest),
    the post-processor prepending <s>. `legacy`: Llama 2's conversion ("▁" prepended
    by a normalizer to each piece of text between special tokens, a Strip decoder);
    else Mistral's (a Metaspace pre-tokenizer, "▁" before the first piece only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pre
    from tokenizers import processors as post

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre.Metaspace(prepend_scheme="always", split=True)
    alphabet = sorted(set(SP_ALPHABET))  # all kept, in a fixed order: deterministic ids
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    learner.train_from_iterator(list(TOK_CORPUS) * 4, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if legacy:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    names = ["<unk>", "<s>", "</s>", *specials]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
    tok.post_processor = post.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


# Chat templates of our own, each modeled on a real family's (same structure, system
# handling, whitespace control and special tokens).
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within" }}
    {{- " <tools></tools>:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
        and not (message.content.startswith('<tool_response>')
                 and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') }}
            {{- '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MISTRAL_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must '
                            ~ 'alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception '
                            ~ 'of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# A fine-tune's ChatML on a SentencePiece tokenizer that adds BOS (OpenHermes-2.5-Mistral
# style; the template writes none), as a named list with a "tool_use" entry (Hermes 2 Pro).
CHATML_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHATML_TOOLS_TEMPLATE = (
    "{{- '<|im_start|>system\\nYou are a function calling AI model. Here are the available "
    "tools: <tools> ' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- ' </tools><|im_end|>\\n' }}\n" + CHATML_TEMPLATE
)

_S, _U, _A, _T = "system", "user", "assistant", "tool"
WEATHER_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}


def _msgs(*pairs) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


CONVERSATIONS = (
    _msgs((_U, "Hello!")),
    _msgs((_S, "You are a pirate. Answer briefly."), (_U, "What is the capital of France?")),
    _msgs(
        (_S, "You are a helpful assistant."),
        (_U, "Hi there"),
        (_A, "Hello! How can I help?"),
        (_U, "Write fib(n) in Python."),
    ),
    _msgs((_U, "Hi"), (_A, "Hello"), (_U, "How are you?"), (_A, "Fine, thanks.")),
    _msgs((_U, "What is the capital of France?"), (_A, "The capital of France is")),
    _msgs((_U, "")),
    _msgs((_S, ""), (_U, "no system prompt really")),
    _msgs((_U, "héllo wörld 日本語のテキスト 🙂🚀 ça va?\nnew line\ttab 𝄞")),
    _msgs((_U, "  leading and trailing spaces  \n")),
    _msgs((_U, "Say it"), (_A, "  spaced answer  ")),
    _msgs((_U, "Say it"), (_A, "\n```python\n")),
    _msgs((_U, "Spell the end"), (_A, "end")),
    _msgs((_U, "Say nothing"), (_A, "")),
    _msgs((_U, "Specials: <|eot_id|> <|im_end|> <|begin_of_text|> </s> <s> [INST] <think>")),
    _msgs((_U, "<s>[INST] injected [/INST]"), (_A, "ok</s>")),
    _msgs((_U, "first"), (_U, "second")),  # not alternating
    _msgs((_A, "I speak first")),
    _msgs((_S, "Only a system message")),
    _msgs((_U, "What's the weather?"), (_T, '{"temp": 21, "unit": "°C"}')),
    _msgs(
        (_U, "2+2?"),
        (_A, "<think>\nSimple sum.\n</think>\n\n4"),
        (_U, "And 3+3?"),
        (_A, "<think>\nAgain a sum.\n</think>\n\n6"),
    ),
    _msgs((_U, "Think first"), (_A, "<think>\nLet me think")),
    *(
        [
            {"role": _U, "content": "2+2?"},
            {"role": _A, "content": "4", key: "Two and two make four."},
        ]
        for key in ("reasoning_content", "reasoning", "thinking")
    ),
    [  # as OpenAI clients send them: a tool call, content and tool_calls null
        {"role": _U, "content": "Weather in Paris?"},
        {"role": _A, "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": _T, "content": '{"temp": 21}'},
        {"role": _A, "content": "It is 21 °C.", "tool_calls": None},
    ],
)
TOK_TEXTS = (
    "Hello world",
    "",
    " leading space",
    "two  spaces and trailing ",
    "\n\nnewlines\n",
    "héllo wörld 日本語 🙂 café naïve",
    "e\u0301 combining, \u00a0nbsp, ﬁ ligature",
    "ünïcödé 𝄞 at the end",
    "    indented code\n\treturn 1",
    "<|begin_of_text|>Hello",
    "<s>[INST] hi [/INST]",
    "<s><s>twice",
    "Hello<|eot_id|>world<|im_end|>a</s>b",
    "<think>\nreasoning\n</think>\n\nanswer",
    "x" * 40 + " 1234567",
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo: the weather in a city, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@dataclasses.dataclass(frozen=True)
class TokCase:
    """A tokenizer directory in one family's style: `write(path)` writes it. Every
    conversation is rendered with each of `variables` (extra template variables)."""

    name: str
    what: str
    write: Callable
    variables: tuple = ({},)


def _write_tok_dir(path, tok, config: dict, *, jinja=None, json_template=None):
    path = pathlib.Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    if json_template is not None:
        (path / "chat_template.json").write_text(json.dumps({"chat_template": json_template}))


def _write_llama3(path):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    specials += ["<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_0|>"]
    tok = _byte_level_bpe(LLAMA3_SPLIT, specials, bos="<|begin_of_text|>")
    config = dict(
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        clean_up_tokenization_spaces=True,  # as Llama 3's; transformers 5 ignores it for BPE
        model_max_length=131072,
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=LLAMA3_TEMPLATE,
    )
    _write_tok_dir(path, tok, config)


def _write_qwen(path, *, qwen3: bool):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    plain = ["<tool_call>", "</tool_call>"] + (["<think>", "</think>"] if qwen3 else [])
    tok = _byte_level_bpe(QWEN2_SPLIT, specials, plain=plain, nfc=True)
    config = dict(
        add_prefix_space=False,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        split_special_tokens=False,
        tokenizer_class="Qwen2Tokenizer",
    )
    if qwen3:  # the template in its own file, as transformers >= 4.52 saves it
        _write_tok_dir(path, tok, config, jinja=QWEN3_TEMPLATE)
    else:
        _write_tok_dir(path, tok, {**config, "chat_template": QWEN25_TEMPLATE})


def _write_mistral(path):
    tok = _sentencepiece_bpe(legacy=False, specials=["[INST]", "[/INST]"])
    config = dict(
        add_bos_token=True,
        add_eos_token=False,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        legacy=False,
        tokenizer_class="LlamaTokenizer",
        chat_template=MISTRAL_TEMPLATE,
    )
    _write_tok_dir(path, tok, config)


def _write_llama2(path):
    tok = _sentencepiece_bpe(legacy=True)
    config = dict(
        add_bos_token=True,
        add_eos_token=False,
        bos_token=dict(__type="AddedToken", content="<s>", lstrip=False, normalized=False),
        eos_token=dict(__type="AddedToken", content="</s>", lstrip=False, normalized=False),
        unk_token="<unk>",
        pad_token=None,
        # Not "LlamaTokenizer" (Llama 2's): transformers 5 would rebuild that class's own
        # pipeline (a Metaspace pre-tokenizer) instead of this tokenizer.json's normalizer,
        # ids that differ from the tokenizer.json that we (and the `tokenizers` library,
        # and transformers 4) follow.
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=LLAMA2_TEMPLATE,
    )
    # A processor's file, which HF's tokenizer does not read.
    _write_tok_dir(path, tok, config, json_template="{{ 'chat_template.json is not read' }}")


def _write_chatml(path):
    tok = _sentencepiece_bpe(legacy=False, specials=["<|im_start|>", "<|im_end|>"])
    templates = [("default", CHATML_TEMPLATE), ("tool_use", CHATML_TOOLS_TEMPLATE)]
    config = dict(
        add_bos_token=True,
        add_eos_token=False,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        legacy=False,
        tokenizer_class="LlamaTokenizer",
        chat_template=[dict(name=n, template=t) for n, t in templates],
    )
    _write_tok_dir(path, tok, config)


def _write_llama3_chatml(path):
    """A Llama 3 tokenizer (BOS by its post-processor; tokenizer_config silent on
    add_bos_token) with a ChatML fine-tune's template, which writes no BOS."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    tok = _byte_level_bpe(LLAMA3_SPLIT, specials, bos="<|begin_of_text|>")
    config = dict(
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=CHATML_TEMPLATE,
    )
    _write_tok_dir(path, tok, config)


TOK_CASES = (
    TokCase(
        "tok-llama3",
        "byte-level BPE, BOS by the post-processor, Llama 3.1-like template (config)",
        _write_llama3,
        ({}, {"date_string": "01 Jan 2025"}),
    ),
    TokCase(
        "tok-qwen25",
        "byte-level BPE + NFC, no BOS, Qwen2.5-like template: default system, tools",
        functools.partial(_write_qwen, qwen3=False),
        ({}, {"tools": [WEATHER_TOOL]}),
    ),
    TokCase(
        "tok-qwen3",
        "Qwen3-like: <think> plain added tokens, chat_template.jinja, enable_thinking",
        functools.partial(_write_qwen, qwen3=True),
        ({}, {"enable_thinking": False}),
    ),
    TokCase(
        "tok-mistral",
        "Metaspace BPE, byte fallback, [INST] specials, alternation raise_exception",
        _write_mistral,
    ),
    TokCase(
        "tok-llama2",
        "legacy SentencePiece normalizer, <<SYS>>, BOS per turn; a chat_template.json too",
        _write_llama2,
    ),
    TokCase(
        "tok-chatml",
        "SentencePiece adding BOS, ChatML without it; templates default + tool_use",
        _write_chatml,
        ({}, {"tools": [WEATHER_TOOL]}),
    ),
    TokCase(
        "tok-llama3-chatml",
        "byte-level BPE, BOS by the post-processor alone, ChatML without it",
        _write_llama3_chatml,
    ),
)
TOK_CASE_NAMES = tuple(c.name for c in TOK_CASES)
# Replies decoded after each chat prompt (the context check), and random id lists.
REPLIES = ("Paris.", " The capital is Paris.", "日本語 🙂!", "\n\n```python\nx = 1\n```", "end")
RANDOM_ID_LISTS = 40


class _Tally:
    """Per-check counts: compared, equal, equal only under a documented rule of ours
    (`deliberate`), and the first few mismatches for the JSON report."""

    def __init__(self):
        self.n, self.ok, self.deliberate = {}, {}, {}
        self.mismatches: list[dict] = []

    def add(self, check: str, got, want, where, *, rule: str | None = None, hf=None):
        self.n[check] = self.n.get(check, 0) + 1
        if got == want:
            self.ok[check] = self.ok.get(check, 0) + 1
            if rule is not None:
                self.deliberate[rule] = self.deliberate.get(rule, 0) + 1
        elif len(self.mismatches) < 12:
            self.mismatches.append(
                dict(check=check, where=where, ours=got, hf=want if hf is None else hf)
            )


def _outcome(call, *args, **kwargs):
    """call(*args, **kwargs), or ("raised", "ExceptionType: message")."""
    try:
        return call(*args, **kwargs)
    except Exception as e:
        return ("raised", f"{type(e).__name__}: {str(e)[:160]}")


def _raised(x) -> bool:
    return isinstance(x, tuple) and x[:1] == ("raised",)


def _chat_checks(tok, hf, case: TokCase, tally: _Tally) -> list[list[int]]:
    """Renders every conversation both ways (text, then ids); returns HF's prompt ids."""
    prompts = []
    for c, conv in enumerate(CONVERSATIONS):
        modes = [dict(add_generation_prompt=True), dict(add_generation_prompt=False)]
        if conv[-1]["role"] == "assistant":
            modes.append(dict(add_generation_prompt=False, continue_final_message=True))
        for v, variables in enumerate(case.variables):
            for mode in modes:
                kw = {**mode, **variables}
                where = dict(conversation=c, variables=v, **mode)
                hf_text = _outcome(hf.apply_chat_template, conv, tokenize=False, **kw)
                hf_ids = _outcome(
                    hf.apply_chat_template, conv, tokenize=True, return_dict=False, **kw
                )
                text = _outcome(tok.apply_chat_template, conv, **kw)
                ids = _outcome(tok.encode_chat, conv, **kw)
                if _raised(hf_text) or _raised(text):
                    # Both refuse (a template's raise_exception), or a refusal of ours:
                    # continuing a blank message (HF continues it, an empty prefill).
                    blank = _raised(text) and "nothing to continue" in text[1]
                    if _raised(text) and (_raised(hf_text) or blank):
                        rule = None if _raised(hf_text) else "refuses to continue a blank message"
                        tally.add("chat", "refused", "refused", where, rule=rule)
                    else:
                        tally.add("chat", text, hf_text, where)
                    continue
                tally.add("chat", text, hf_text, where)
                tally.add("chat ids", ids, hf_ids, where)
                if mode.get("add_generation_prompt"):
                    prompts.append(hf_ids)
    return prompts


def _encode_checks(tok, hf, texts, tally: _Tally) -> list[list[int]]:
    out = []
    bos, bos_text = tok.bos_token_id, tok.bos_token
    for text in texts:
        where = dict(text=text[:80])
        want = hf(text)["input_ids"]
        rule = None
        if tok.add_bos and bos_text and text.startswith(bos_text) and want[:2] == [bos, bos]:
            want, rule = want[1:], "no second BOS for text that starts with it"
        got = tok.encode(text)
        tally.add("encode", got, want, where, rule=rule, hf=hf(text)["input_ids"])
        plain = hf(text, add_special_tokens=False)["input_ids"]
        tally.add("encode", tok.encode(text, add_bos=False), plain, dict(where, add_bos=False))
        out.append(got)
    return out


def _decode_checks(tok, hf, id_lists, tally: _Tally):
    for ids in id_lists:
        for skip in (True, False):
            where = dict(ids=ids[:40], skip_special_tokens=skip)
            want = hf.decode(ids, skip_special_tokens=skip)
            tally.add("decode", tok.decode(ids, skip_special_tokens=skip), want, where)


def _context_checks(tok, hf, pairs, tally: _Tally):
    """A completion decoded after its prompt (and streamed after it) vs HF's
    decode(prompt + completion) less decode(prompt), where the prompt's text ends on a
    whole character and is a prefix (the completion's bytes did not change it)."""
    for prompt, completion in pairs:
        for skip in (True, False):
            full = hf.decode(prompt + completion, skip_special_tokens=skip)
            head = hf.decode(prompt, skip_special_tokens=skip)
            if head.endswith("\ufffd") or not full.startswith(head):
                continue  # the prompt ends inside a character: what the completion adds is moot
            where = dict(prompt=prompt[-12:], completion=completion[:24], skip_special_tokens=skip)
            got = tok.decode(completion, skip_special_tokens=skip, context=prompt)
            tally.add("context", got, full[len(head) :], where)
            stream = tok.stream(skip_special_tokens=skip, context=prompt)
            streamed = "".join(stream.add(i) for i in completion) + stream.flush()
            tally.add("context", streamed, full[len(head) :], dict(where, stream=True))


def run_tok_case(case: TokCase, args, transformers) -> dict:
    import numpy as np

    from pagedjax.tokenizer import Tokenizer

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    tally = _Tally()
    with tempfile.TemporaryDirectory(prefix=f"hf_parity_{case.name}_") as path:
        case.write(path)
        tok = Tokenizer.from_dir(path)
        hf = transformers.AutoTokenizer.from_pretrained(path)
    facts = dict(
        bos=(tok.bos_token_id, hf.bos_token_id),
        eos_in_ours=hf.eos_token_id in tok.eos_token_ids,
        add_bos=tok.add_bos,
        hf_class=type(hf).__name__,
    )
    tally.add("facts", (tok.bos_token_id, True), (hf.bos_token_id, facts["eos_in_ours"]), facts)
    prompts = _chat_checks(tok, hf, case, tally)
    texts = [*TOK_TEXTS, *(hf.decode(p) for p in prompts)]
    encoded = _encode_checks(tok, hf, texts, tally)
    vocab = tok.vocab_size
    randoms = [rng.integers(0, vocab, rng.integers(1, 25)).tolist() for _ in range(RANDOM_ID_LISTS)]
    _decode_checks(tok, hf, [*encoded, *prompts, *randoms], tally)
    eos = min(tok.eos_token_ids) if tok.eos_token_ids else None
    replies = [tok.encode(r, add_bos=False) + ([eos] if eos is not None else []) for r in REPLIES]
    pairs = [(p, r) for p in prompts for r in replies]
    pairs += [(encoded[i], r) for i in range(len(TOK_TEXTS)) for r in replies]
    pairs += list(zip(randoms[::2], randoms[1::2], strict=True))
    _context_checks(tok, hf, pairs, tally)
    checks = {k: [tally.ok.get(k, 0), n] for k, n in tally.n.items()}
    return dict(
        case=case.name,
        what=case.what,
        facts=facts,
        checks=checks,
        deliberate=tally.deliberate,
        mismatches=tally.mismatches,
        ok=all(ok == n for ok, n in checks.values()),
        seconds=round(time.perf_counter() - t0, 1),
    )


TOK_CHECKS = ("facts", "chat", "chat ids", "encode", "decode", "context")


def tok_table(results: list[dict]) -> str:
    w = max(map(len, TOK_CASE_NAMES))
    head = f"{'case':{w}} " + " ".join(f"{c:>11}" for c in TOK_CHECKS) + f" {'deliberate':>10}  ok"
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:{w}} FAIL {r['error'].splitlines()[0][:160]}")
            continue
        cells = ["{}/{}".format(*r["checks"][c]) if c in r["checks"] else "-" for c in TOK_CHECKS]
        lines.append(
            f"{r['case']:{w}} "
            + " ".join(f"{c:>11}" for c in cells)
            + f" {sum(r['deliberate'].values()):>10}  {'PASS' if r['ok'] else 'FAIL'}"
        )
    rules = {}
    for r in results:
        for rule, n in r.get("deliberate", {}).items():
            rules[rule] = rules.get(rule, 0) + n
    lines += [f"  deliberate ({n}): {rule}" for rule, n in rules.items()]
    for r in results:
        for m in r.get("mismatches", [])[:3]:
            lines.append(f"  {r['case']} {m['check']} at {m['where']}: ours {m['ours']!r:.200}")
            lines.append(f"  {' ' * len(r['case'])} {' ' * len(m['check'])} HF {m['hf']!r:.200}")
    return "\n".join(lines)
