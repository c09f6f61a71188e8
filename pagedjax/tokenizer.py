"""Tokenizer wrapper over HF `tokenizers` with BOS/EOS handling and streaming decode.

`Tokenizer.from_dir(path)` reads `tokenizer.json` and, when present,
`tokenizer_config.json`, `generation_config.json` and `config.json` for the special
tokens:

* BOS id: tokenizer_config's `bos_token`, else generation_config's / config.json's
  `bos_token_id` (in a converted orbax checkpoint, which has no config.json, its
  stored model config's).
* EOS ids: the union of every source (tokenizer_config's `eos_token`, and the
  `eos_token_id` int or list of generation_config and config.json), so generation stops
  on any of them (Llama 3 instruct ends turns with `<|eot_id|>` but lists
  `<|end_of_text|>` too).
* add_bos: tokenizer_config's `add_bos_token` if set, else whether tokenizer.json's
  own post-processor prepends BOS. `add_eos_token` (and a post-processor that appends
  EOS) is not followed: a prompt that ends in EOS asks the model to stop.

The special tokens are read as HF's AutoTokenizer reads them: a legacy checkpoint's
`special_tokens_map.json` (read when tokenizer_config.json has no `added_tokens_decoder`)
overrides tokenizer_config's, and the named special tokens and `added_tokens_decoder`
entries are registered as added tokens with their flags (`_register_added_tokens`), so
that their text in a prompt encodes as their ids where the tokenizer.json alone left
them plain vocabulary entries (split into pieces).

`encode` never lets the post-processor add tokens: it encodes the raw text and
prepends BOS itself unless the text starts with it, so BOS appears exactly once whatever
the tokenizer.json says.

Chat: `from_dir` also finds the checkpoint's chat template (`pagedjax.chat`, HF's
order of precedence; and a named list's "tool_use" one, which `tools` select) and
keeps the special-token strings the template may refer to (all of tokenizer_config's
named ones, `bos_token` to `additional_special_tokens`, as HF passes them).
`apply_chat_template(messages)` renders the conversation to text and
`encode_chat(messages)` to ids; `with_chat_template(text, source)` is a copy that uses
another template (a `--chat-template FILE` override). Special-token strings in the
rendered text (the template's `{{ bos_token }}`, headers like `<|start_header_id|>`)
encode as their single ids, and nothing is added to it: as in HF's
`apply_chat_template(tokenize=True)` and vLLM's chat, which encode the text without
special tokens, BOS is where the template writes it, and a template that writes none
(ChatML on a tokenizer that adds BOS) gives none, whatever the tokenizer's `add_bos`.

Decoding (`decode`, `decode_each` and `stream`, each after a `context` of prompt ids so
that a completion reads as the prompt's continuation) is `DecodeMixin`'s, with the
incremental `StreamDecoder` and the logprob token names (`token_names`, `name_context`):
`pagedjax.detokenizer`, whose public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import tokenizers

from pagedjax import chat
from pagedjax.config import is_token_id
from pagedjax.detokenizer import (  # noqa: F401  (CONTEXT_IDS to token_names: re-exported)
    CONTEXT_IDS,
    MAX_RUN_IDS,
    DecodeMixin,
    StreamDecoder,
    _byte_fallback_ids,
    name_context,
    token_names,
)
from pagedjax.jsonfile import read_json_object
from pagedjax.safetensors_file import LFS_POINTER
from pagedjax.tokenizer_files import (  # noqa: F401  (SPECIAL_TOKEN_NAMES: re-exported)
    SPECIAL_TOKEN_NAMES,
    _as_ids,
    _config_ids,
    _post_processor_adds,
    _register_added_tokens,
    _special_tokens,
    _token_content,
    _with_special_tokens_map,
)

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(DecodeMixin):
    """A `tokenizers.Tokenizer` plus the special-token facts generation needs; its decode
    side (`decode`, `decode_each`, `stream`) is `DecodeMixin`'s.

    Attributes:
      vocab_size: one past the largest token id (vLLM's `max_token_id` + 1); ids past it,
        and the ids below it that no token has (a vocabulary with holes), decode to "".
      bos_token_id: id prepended by `encode(add_bos=True)`, or None.
      eos_token_ids: frozenset of ids that end a sequence.
      add_bos: `encode`'s default for `add_bos` (not the chat path's: `encode_chat`
        adds nothing to what the template wrote).
      bos_token, eos_token: the special-token strings chat templates refer to, or None.
      special_tokens: every named special token a chat template sees, as HF passes
        them: {"bos_token": str, "pad_token": str, "additional_special_tokens":
        [str, ...], ...}, the unset ones left out.
      chat_template: the Jinja chat template text, or None.
      chat_template_source: where the template came from, or why there is none.
      tool_use_template: the template a list of named templates has for `tools`
        ("tool_use", which HF's apply_chat_template picks when given `tools`), or None.
      tool_use_template_source: where it came from.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] | int | None = (),
        add_bos: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, str | Sequence[str]] | None = None,
        chat_template: str | None = None,
        chat_template_source: str | None = None,
        tool_use_template: str | None = None,
        tool_use_template_source: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size, self._holes = _vocab_ids(tokenizer)
        # For StreamDecoder: which ids HF's decode may merge with the ids after them.
        self._byte_ids = _byte_fallback_ids(tokenizer)
        self._special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )
        bos_ids = _special_ids("bos_token_id", bos_token_id, "a token id (an int)", many=False)
        eos_ids = _special_ids("eos_token_ids", eos_token_ids, "token ids (ints)", many=True)
        for name, ids in (("bos_token_id", bos_ids), ("eos_token_ids", eos_ids)):
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad} outside the vocabulary [0, {self.vocab_size})")
        if add_bos and not bos_ids:
            raise ValueError("add_bos=True needs a bos_token_id")
        self.bos_token_id = bos_ids[0] if bos_ids else None
        self.eos_token_ids = frozenset(eos_ids)
        self.add_bos = bool(add_bos)
        for name, value in (
            ("chat_template", chat_template),
            ("tool_use_template", tool_use_template),
        ):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        # Without the strings, name a special id's own token (never a plain vocab
        # entry: its text would not encode back to the id).
        self.bos_token = bos_token or self._special_token(self.bos_token_id)
        eos_single = next(iter(self.eos_token_ids)) if len(self.eos_token_ids) == 1 else None
        self.eos_token = eos_token or self._special_token(eos_single)
        self.special_tokens = {}
        for name, value in (special_tokens or {}).items():
            ok = isinstance(value, str) or (
                isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
            )
            if not (isinstance(name, str) and ok):
                raise TypeError(
                    f"special_tokens[{name!r}] must be a str or a list of str, got {value!r:.80}"
                )
            self.special_tokens[name] = value if isinstance(value, str) else list(value)
        for name, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)):
            if value:
                self.special_tokens[name] = value
        self.chat_template = chat_template
        self.chat_template_source = chat_template_source or (
            "<given>" if chat_template is not None else "this tokenizer was built without one"
        )
        self.tool_use_template = tool_use_template
        self.tool_use_template_source = tool_use_template_source or "<given>"

    @classmethod
    def from_dir(cls, path, *, chat_template_name: str | None = None) -> Tokenizer:
        """Loads `tokenizer.json`, the special tokens and chat template of a checkpoint.

        Args:
          path: the checkpoint directory.
          chat_template_name: which entry of a list-form chat template to use
            (default: the one named "default", else none).

        Raises:
          FileNotFoundError: no tokenizer.json.
          ValueError: a tokenizer.json the tokenizers library cannot read (named), or a
            bad entry in the JSON files beside it.
        """
        root = Path(path)
        tok_file = root / TOKENIZER_FILE
        if not tok_file.is_file():
            spm = " (only a SentencePiece tokenizer.model, which is not read)"
            spm = spm if (root / "tokenizer.model").is_file() else ""
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {root}{spm}; transformers' "
                "AutoTokenizer.from_pretrained(path).save_pretrained(path) writes one"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # (the tokenizers library raises a bare Exception)
            why = str(e)
            with open(tok_file, "rb") as f:
                if f.read(len(LFS_POINTER)) == LFS_POINTER:  # (a clone without git-lfs)
                    why = "it is a git-lfs pointer: fetch the file with `git lfs pull`"
            raise ValueError(f"{tok_file} is not a valid tokenizer file: {why}") from None
        tcfg = _with_special_tokens_map(
            read_json_object(root / "tokenizer_config.json", missing_ok=True), root
        )
        _register_added_tokens(tok, tcfg)
        gcfg = read_json_object(root / "generation_config.json", missing_ok=True)
        mcfg = read_json_object(root / "config.json", missing_ok=True)
        mcfg_name = "config.json"
        from pagedjax.orbax_checkpoint import ORBAX_META_FILE  # (imports jax: only here)

        if not mcfg and (root / ORBAX_META_FILE).is_file():
            # A converted checkpoint keeps the model's config there, not config.json:
            # its bos_token_id is the HF directory's (its EOS ids the engine adds).
            stored = read_json_object(root / ORBAX_META_FILE).get("config")
            bos_id = stored.get("bos_token_id") if isinstance(stored, dict) else None
            mcfg, mcfg_name = {"bos_token_id": bos_id}, ORBAX_META_FILE

        def token_id(field: str) -> int | None:
            content = _token_content(tcfg.get(field))
            if content is None:
                return None
            tid = tok.token_to_id(content) if isinstance(content, str) else None
            if tid is None:
                raise ValueError(f"tokenizer_config.json {field}={content!r} is not in the vocab")
            return tid

        vocab = _vocab_ids(tok)[0]

        def config_ids(field: str) -> list[int]:  # generation_config's, then config.json's
            files = (("generation_config.json", gcfg), (mcfg_name, mcfg))
            return [i for name, cfg in files for i in _config_ids(cfg, field, name, vocab)]

        bos = token_id("bos_token")
        if bos is None:
            bos_ids = config_ids("bos_token_id")
            bos = bos_ids[0] if bos_ids else None
        eos = set(_as_ids(token_id("eos_token"))) | set(config_ids("eos_token_id"))
        add_bos = tcfg.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and _post_processor_adds(tok, bos)
        template, source = chat.find_chat_template(root, tcfg, name=chat_template_name)
        tool_use = (None, None)
        if chat_template_name is None:  # HF's pick for `tools`, from a list of templates
            with contextlib.suppress(ValueError):  # (none named so)
                tool_use = chat.find_chat_template(root, tcfg, name=chat.TOOL_USE_NAME)
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos=bool(add_bos and bos is not None),
            bos_token=_token_content(tcfg.get("bos_token")),
            eos_token=_token_content(tcfg.get("eos_token")),
            special_tokens=_special_tokens(tcfg),
            chat_template=template,
            chat_template_source=source,
            tool_use_template=tool_use[0],
            tool_use_template_source=tool_use[1],
        )

    def with_chat_template(self, template: str, source: str = "<given>") -> Tokenizer:
        """A copy of this tokenizer that renders chats with `template` instead of its own.

        The template is parsed at once, so a syntax error shows here rather than at the
        first render.

        Args:
          template: the Jinja chat template text.
          source: where it came from (a file path), for messages.

        Raises:
          TypeError: `template` or `source` is not a str.
          ValueError: the template does not parse (the message names `source`).
          ImportError: jinja2 is missing (the `chat` extra).
        """
        for name, value in (("template", template), ("source", source)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
        chat._compile(template, source)  # parse (and cache) it now
        new = copy.copy(self)
        new.chat_template, new.chat_template_source = template, source
        new.tool_use_template = None  # HF uses a given template whatever the tools
        return new

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, with BOS prepended when `add_bos` (default `self.add_bos`)
        and the text does not already start with it (a prompt rendered by a chat
        template, `<|begin_of_text|>...`: a second BOS degrades the model's output).

        Special-token strings in the text encode as their own ids. ValueError for a text
        with a lone surrogate (JSON's "\\ud800" escape), which has no UTF-8.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_token_id is None:
            raise ValueError("add_bos=True but this tokenizer has no BOS token")
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # "TextInputSequence must be str": no UTF-8 for a lone surrogate
            bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if bad is None:
                raise
            raise ValueError(
                f"text is not valid Unicode: a lone surrogate {text[bad]!r} at index {bad}"
            ) from None
        if add_bos and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return list(ids)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra,
    ) -> str:
        """Renders a conversation with this checkpoint's chat template.

        Args:
          messages: a non-empty list of `{"role": str, "content": str}` dicts.
          add_generation_prompt: end with the header that opens the assistant's turn.
          continue_final_message: leave the last message open for the model to continue
            (an assistant reply begun by the caller); needs `add_generation_prompt=False`
            (`chat.render`).
          **extra: more template variables (`tools`, `date_string`, ...); they override
            the special tokens (`special_tokens`), which the template sees too. With
            `tools` (not None), the checkpoint's "tool_use" template is used if its
            templates are a named list that has one, as in HF.

        Raises:
          ValueError: no chat template, bad messages, or the template failed.
          TypeError: messages of the wrong type.
          ImportError: jinja2 is missing (the `chat` extra).
        """
        template, source = self.chat_template, self.chat_template_source
        if extra.get("tools") is not None and self.tool_use_template is not None:
            template, source = self.tool_use_template, self.tool_use_template_source
        if template is None:
            raise ValueError(
                f"no chat template to render messages with: {source}. Pass prompts as raw "
                "text (formatted the way the model expects) instead of chat messages"
            )
        return chat.render(
            template,
            messages,
            source=source,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**self.special_tokens, **extra},
        )

    def encode_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        add_bos: bool = False,
        **extra,
    ) -> list[int]:
        """Token ids of `apply_chat_template(messages)`: the rendered text encoded as
        HF's `apply_chat_template(tokenize=True)` and vLLM's chat encode it, adding no
        special tokens, so BOS is where the template writes it (`{{ bos_token }}`)
        whatever `self.add_bos`. Special-token strings in the text encode as their own
        ids. `add_bos=True` prepends BOS unless the text already starts with it.
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )
        return self.encode_rendered(text, add_bos=add_bos)

    def encode_conversations(
        self, messages, *, add_generation_prompt: bool = True, **extra
    ) -> tuple[list[str], list[list[int]]]:
        """(rendered texts, token ids) of one conversation or a list of them; the ids as
        `encode_chat` gives them (BOS only where the template writes it).

        Args:
          messages: a conversation (a list of `{"role", "content"}` dicts) or a non-empty
            list of conversations.
          add_generation_prompt, **extra: as for `apply_chat_template`.

        Raises:
          ValueError: no chat template, bad messages or a failed render (naming the
            conversation).
          TypeError: `messages` is neither.
        """
        if self.chat_template is None:
            raise ValueError(
                f"chat needs a chat template and the tokenizer has none "
                f"({self.chat_template_source}); use generate() for raw text"
            )
        one = isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)
        convs = [messages] if one else messages
        if isinstance(convs, (str, bytes)) or not isinstance(convs, Sequence) or not convs:
            raise TypeError(
                "messages must be a conversation (a list of {'role', 'content'} dicts) or a "
                f"non-empty list of them, got {messages!r:.80}"
            )
        texts, ids = [], []
        for i, conv in enumerate(convs):
            kw = dict(add_generation_prompt=add_generation_prompt, **extra)
            try:
                texts.append(self.apply_chat_template(conv, **kw))
            except (ValueError, TypeError) as e:
                raise type(e)(f"conversation {i}: {e}") from None
            ids.append(self.encode_rendered(texts[-1]))
        return texts, ids

    def encode_rendered(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of text a chat template rendered (`encode_chat` without the render).

        Special-token strings encode as their own ids and no special token is added (as
        HF's `apply_chat_template` encodes the text, `add_special_tokens=False`);
        `add_bos=True` prepends BOS unless the text already starts with it (`encode`).
        """
        return self.encode(text, add_bos=bool(add_bos))

    def is_eos(self, token_id: int) -> bool:
        return int(token_id) in self.eos_token_ids

    def _special_token(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        added = self.tokenizer.get_added_tokens_decoder().get(int(token_id))
        return added.content if added is not None and added.special else None


def _vocab_ids(tok: tokenizers.Tokenizer) -> tuple[int, frozenset[int]]:
    """(one past the largest id, the ids below it that no token has) of `tok`.

    tokenizers' `get_vocab_size` counts the tokens, which falls short of the largest id
    where the ids have holes (camembert-base has no id 3; gpt-oss's vocabulary has unused
    ids): the tokens past the count were taken for ids past the vocabulary (an EOS there
    refused, a sampled one decoded to ""). vLLM bounds ids by the largest one too.
    """
    ids = set(tok.get_vocab(with_added_tokens=False).values())
    ids.update(tok.get_added_tokens_decoder())
    bound = max(ids, default=-1) + 1
    return bound, frozenset(range(bound)).difference(ids) if len(ids) < bound else frozenset()


def _special_ids(name: str, value, what: str, *, many: bool) -> list[int]:
    """A `Tokenizer` argument's special ids as ints: `bos_token_id` (an id or None) or,
    with `many`, `eos_token_ids` (ids, one id, or None), each an int (numpy's and JAX's
    too); TypeError naming anything else: int() had taken BOS 1.5 (prepended to every
    prompt as it was) and EOS 2.7 (as 2), and a str failed in Python's words."""
    if value is None:
        return []
    one = not many or is_token_id(value)
    items = [value] if one else value
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        items = [None]  # (refused below)
    items = list(items)
    if not all(map(is_token_id, items)):
        raise TypeError(f"{name} must be {what}, got {value!r:.80}")
    return [operator.index(i) for i in items]
