"""Incremental detokenizing: `StreamDecoder`, and the byte-fallback runs it holds back.

`StreamDecoder` (`Tokenizer.stream()`; re-exported by `pagedjax.tokenizer`) turns token
ids arriving one by one into text pieces whose concatenation equals `decode(all ids)`,
wherever the ids stop; with a `context` (the prompt's ids) that is
`Tokenizer.decode(ids, context=prompt_ids)`, the completion read as the prompt's
continuation. A token can end inside a multi-byte UTF-8 character (byte-level BPE,
SentencePiece byte fallback), which decodes as a trailing U+FFFD; text is emitted up to
the last whole character and the rest is held back. With byte fallback, HF decodes a run
of `<0xXX>` tokens all or nothing (one U+FFFD per byte unless the whole run is valid
UTF-8: "€" then the first byte of "☃" is four U+FFFD), so a trailing run of byte tokens
is held back whole until a token of another kind ends it. Each step decodes a short
window that starts one emitted chunk back, so decoders that treat the first token
specially (SentencePiece's leading-space strip) see the same context every time.

It is apart from `pagedjax.tokenizer` (loading, special tokens, encoding, chat) because
it is a state machine over a finished tokenizer's decode: it reads a `Tokenizer`'s HF
`tokenizer`, `vocab_size`, `_context`, `_check_ids`, `_byte_ids` and `_special_ids`, and imports
nothing from that module at run time, so `tokenizer.py` imports it without a cycle.
`_byte_fallback_ids` and `_byte_run` find the byte runs; `Tokenizer._context` uses
`_byte_run` too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:
    from pagedjax.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


def _byte_fallback_ids(tok: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of the `<0xXX>` tokens, when the decoder joins runs of them into bytes."""

    def has_byte_fallback(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteFallback" or any(map(has_byte_fallback, node.values()))
        return isinstance(node, list) and any(map(has_byte_fallback, node))

    if tok.decoder is None or not has_byte_fallback(json.loads(tok.decoder.__getstate__())):
        return frozenset()
    names = (f"<0x{b:02X}>" for b in range(256))
    ids = (tok.token_to_id(x) for name in names for x in (name, name[:3] + name[3:].lower()))
    return frozenset(i for i in ids if i is not None)


class StreamDecoder:
    """Incremental detokenizer: `add(ids)` returns only the newly stable text.

    Invariants: `self.text` (everything returned so far) is a prefix of the decode of
    `ids` and of any ids that may follow them: `decode(ids)` without its trailing
    U+FFFD run (an incomplete character), or, when `ids` end in a run of byte-fallback
    tokens, without the run's text. `self.text + self.pending` is `decode(ids)`, the
    text if the ids ended here, and `flush()` emits `pending`. With a `context` (the
    prompt's ids), `decode(ids)` here means `Tokenizer.decode(ids, context=context)`:
    the context's settled tail is the first chunk, decoded and never emitted. Each call decodes the
    window `ids[prefix:]`, which starts one character-aligned chunk back; `done` counts
    the window's characters already emitted. The window slides to the last chunk
    whenever its text ends on a whole character outside a byte run.

    Skipped special tokens never enter the decoded ids (HF's decode drops them before
    its decoder runs, so they change no text): a window of them alone would let the
    decoder strip the next token's leading space, and a long run of them (EOS after EOS
    with ignore_eos) would keep the window from sliding, each step decoding the whole
    run. A chunk of tokens whose own text is "" (SentencePiece's lone "▁", stripped as
    the first token) still slides the window: the decoder sees it, so the tokens after
    it keep their spaces. Within a run of byte-fallback tokens (a newline is `<0x0A>` in
    Llama 2's vocabulary) the settled text before the run is decoded once, and the run's
    length is counted as ids arrive; the run itself is decoded whole each step, as HF
    decodes it all or nothing.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, context: Iterable[int] = ()
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # The ids decoded: the context's (see Tokenizer._context), then those added, less
        # skipped special tokens.
        self._ids: list[int] = []
        self._added: list[int] = []  # every id added (`ids`)
        self._prefix = 0  # window start
        self._read = 0  # end of the last chunk that ended on a whole character
        self._done = 0  # characters of decode(ids[prefix:]) already emitted
        self._run = 0  # length of the trailing run of byte-fallback ids in `_ids`
        self._before_run: tuple[int, str] | None = None  # (end, its stable text) in a run
        self.text = ""
        self._pending: str | None = ""  # held back (None: not decoded yet; `pending`)
        self._flushed = False  # flush() emitted held-back text: the stream has ended
        ctx = tokenizer._context(context, skip_special_tokens)
        if ctx is not None:  # a first chunk, already emitted
            self._ids, self._read, self._done = list(ctx[0]), len(ctx[0]), len(ctx[1])

    @property
    def ids(self) -> list[int]:
        """The ids added so far (the context's not included)."""
        return self._added

    @property
    def pending(self) -> str:
        """The text held back: what `flush()` would emit now. Within a run of byte-fallback
        tokens it is decoded when asked for (a long run, e.g. a model repeating newlines
        that are `<0x0A>` tokens, would otherwise cost a decode of the run every token)."""
        if self._pending is None:
            self._pending = self._decode(self._ids[self._prefix :])[self._done :]
        return self._pending

    def _decode(self, ids) -> str:
        return self._tok.tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Appends one id or several; returns the new text that is now final ("" if none).

        Ids past the vocabulary are dropped (not kept in `ids`): they decode to "".

        Raises:
          RuntimeError: ids after a `flush()` that emitted held-back text (an incomplete
            character's U+FFFD, a byte run's text), which the ids after it may change:
            `text` would no longer be a prefix of the decode.
        """
        if self._flushed:
            raise RuntimeError(
                "add() after flush() emitted held-back text: flush() ends the stream "
                f"(its text {self.text[-20:]!r} may not be a prefix of the decode with more ids)"
            )
        if type(token_ids) is int and 0 <= token_ids < self._tok.vocab_size:
            new = [token_ids]  # the engine's case, one valid id: no batch checks
        else:
            new = token_ids if isinstance(token_ids, Iterable) else [token_ids]
            new = self._tok._check_ids(new)
        self._added += new
        if self._skip:
            special = self._tok._special_ids
            new = [i for i in new if i not in special]
        if not new:
            # The decode is what it was. (Deciding again would slide the window to an
            # empty one, its first token then decoded without the one before it: a
            # dropped padded id after "<unk>" made "<unk>" + "▁t" read "<unk>t".)
            return ""
        byte_ids = self._tok._byte_ids
        for i in new:
            self._run = self._run + 1 if i in byte_ids else 0
        self._ids += new
        held = min(self._run, len(self._ids) - self._prefix)
        if held:  # the run's text is not final: only what comes before it
            end = len(self._ids) - held
            if self._before_run is None or self._before_run[0] != end:
                stable = self._decode(self._ids[self._prefix : end]).rstrip(_REPLACEMENT)
                self._before_run = end, stable
            stable = self._before_run[1]
            piece = stable[self._done :]
            self._done = max(self._done, len(stable))
            self._pending = None  # (decoded if asked for)
            self.text += piece
            return piece
        self._before_run = None
        text = self._decode(self._ids[self._prefix :])
        stable = text.rstrip(_REPLACEMENT)
        piece = stable[self._done :]
        if len(stable) == len(text):
            self._prefix, self._done = self._read, len(self._decode(self._ids[self._read :]))
            self._read = len(self._ids)
            self._pending = ""
        else:
            self._done = max(self._done, len(stable))
            self._pending = text[self._done :]
        self.text += piece
        return piece

    def flush(self) -> str:
        """Emits whatever is held back (an incomplete character shows as U+FFFD); after
        it emitted text, the stream has ended (`add` raises)."""
        piece, self._pending = self.pending, ""
        self._flushed = bool(piece)
        self._done += len(piece)
        self.text += piece
        return piece


def _byte_run(tok: Tokenizer, ids: list[int], skip: bool) -> int:
    """Length of the trailing run of byte-fallback tokens in `ids` (with the skipped
    special tokens inside or after it, which the decoder never sees), or 0."""
    byte_ids, n, run = tok._byte_ids, 0, 0
    if not byte_ids:
        return 0
    for i in reversed(ids):
        if i in byte_ids:
            n = run = n + 1
        elif skip and i in tok._special_ids:
            n += 1
        else:
            break
    return run
