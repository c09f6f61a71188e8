"""The tok-* cases of `check_hf_parity.py`: a tokenizer directory in each family's
style (`TOK_CASES`; `TokCase.write(path)` writes one) for `hf_parity_tok.py` to load
with `Tokenizer.from_dir` and `AutoTokenizer.from_pretrained` and compare.

The fixtures apart from the checks: tokenizers trained here on `TOK_CORPUS` with the
`tokenizers` library (`_byte_level_bpe`, `_sentencepiece_bpe`), chat templates of our
own modeled on each family's, and each family's tokenizer_config.json (`_write_*`).
`hf_parity_tok.py` re-exports `TokCase`, `TOK_CASES` and `TOK_CASE_NAMES`; its
docstring says what each case holds and what is checked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
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
