"""Tokenizer wrapper over HF `tokenizers` with BOS/EOS handling and streaming decode.

`Tokenizer.from_dir(path)` reads `tokenizer.json` and, when present,
`tokenizer_config.json`, `generation_config.json` and `config.json` for the special
tokens:

* BOS id: tokenizer_config's `bos_token`, else generation_config's / config.json's
  `bos_token_id`.
* EOS ids: the union of every source (tokenizer_config's `eos_token`, and the
  `eos_token_id` int or list of generation_config and config.json), so generation stops
  on any of them (Llama 3 instruct ends turns with `<|eot_id|>` but lists
  `<|end_of_text|>` too).
* add_bos: tokenizer_config's `add_bos_token` if set, else whether tokenizer.json's
  own post-processor prepends BOS.

`encode` never lets the post-processor add tokens: it encodes the raw text and
prepends BOS itself, so BOS appears exactly once whatever the tokenizer.json says.

`StreamDecoder` turns token ids arriving one by one into text pieces whose
concatenation equals `decode(all ids)`. A token can end inside a multi-byte UTF-8
character (byte-level BPE, SentencePiece byte fallback), which decodes as a trailing
U+FFFD; text is emitted up to the last whole character and the rest is held back.
Each step decodes a short window that starts one emitted chunk back, so decoders that
treat the first token specially (SentencePiece's leading-space strip) see the same
context every time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _token_content(token) -> str | None:
    """tokenizer_config tokens are a string, an AddedToken dict, or null."""
    return token.get("content") if isinstance(token, dict) else token


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts generation needs.

    Attributes:
      bos_token_id: id prepended by `encode(add_bos=True)`, or None.
      eos_token_ids: frozenset of ids that end a sequence.
      add_bos: `encode`'s default for `add_bos`.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        for name, ids in (
            ("bos_token_id", _as_ids(bos_token_id)),
            ("eos_token_ids", eos_token_ids),
        ):
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"{name} {bad} outside the vocabulary [0, {self.vocab_size})")
        if add_bos and bos_token_id is None:
            raise ValueError("add_bos=True needs a bos_token_id")
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.add_bos = bool(add_bos)

    @classmethod
    def from_dir(cls, path) -> Tokenizer:
        """Loads `tokenizer.json` and the special tokens of a checkpoint directory."""
        root = Path(path)
        tok_file = root / TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {root}")
        tok = tokenizers.Tokenizer.from_file(str(tok_file))
        tcfg = _read_json(root / "tokenizer_config.json")
        gcfg = _read_json(root / "generation_config.json")
        mcfg = _read_json(root / "config.json")

        def token_id(field: str) -> int | None:
            content = _token_content(tcfg.get(field))
            if content is None:
                return None
            tid = tok.token_to_id(content)
            if tid is None:
                raise ValueError(f"tokenizer_config.json {field}={content!r} is not in the vocab")
            return tid

        bos = token_id("bos_token")
        if bos is None:
            bos_ids = _as_ids(gcfg.get("bos_token_id")) + _as_ids(mcfg.get("bos_token_id"))
            bos = bos_ids[0] if bos_ids else None
        eos = set(_as_ids(token_id("eos_token")))
        eos |= set(_as_ids(gcfg.get("eos_token_id"))) | set(_as_ids(mcfg.get("eos_token_id")))
        add_bos = tcfg.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and _post_processor_adds(tok, bos)
        return cls(
            tok, bos_token_id=bos, eos_token_ids=eos, add_bos=bool(add_bos and bos is not None)
        )

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, with BOS prepended when `add_bos` (default `self.add_bos`)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_token_id is None:
            raise ValueError("add_bos=True but this tokenizer has no BOS token")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos else list(ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (BOS, EOS, ...) are dropped unless asked for."""
        ids = self._check_ids(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_eos(self, token_id: int) -> bool:
        return int(token_id) in self.eos_token_ids

    def stream(self, *, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:10]} outside the vocabulary [0, {self.vocab_size})")
        return ids


def _post_processor_adds(tok: tokenizers.Tokenizer, bos: int) -> bool:
    with_special = tok.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == bos


class StreamDecoder:
    """Incremental detokenizer: `add(ids)` returns only the newly stable text.

    Invariants: `self.text` (everything returned so far) is `decode(ids)` without its
    trailing U+FFFD run (an incomplete character), and `self.text + flush()` is
    `decode(ids)`. Each call decodes the window `ids[prefix:]`, which starts one
    character-aligned chunk back; `done` counts the window's characters already
    emitted. The window slides whenever its text ends on a whole character.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # end of the last chunk that ended on a whole character
        self._done = 0  # characters of decode(ids[prefix:]) already emitted
        self.text = ""

    def _decode(self, ids) -> str:
        return self._tok.tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Appends one id or several; returns the new text that is now final ("" if none)."""
        new = token_ids if isinstance(token_ids, Iterable) else [token_ids]
        self.ids.extend(self._tok._check_ids(new))
        text = self._decode(self.ids[self._prefix :])
        stable = text.rstrip(_REPLACEMENT)
        piece = stable[self._done :]
        if len(stable) == len(text):
            self._prefix, self._read = self._read, len(self.ids)
            self._done = len(self._decode(self.ids[self._prefix :]))
        else:
            self._done = max(self._done, len(stable))
        self.text += piece
        return piece

    def flush(self) -> str:
        """Emits whatever is held back (an incomplete character shows as U+FFFD)."""
        piece = self._decode(self.ids[self._prefix :])[self._done :]
        self._done += len(piece)
        self.text += piece
        return piece
