"""Token ids back to text: a `Tokenizer`'s decode side (`DecodeMixin`), the incremental
`StreamDecoder`, and the names of candidate tokens for logprobs.

A completion is decoded after its prompt (`decode(ids, context=prompt_ids)`,
`stream(context=prompt_ids)`), so that it reads as the prompt's continuation:
SentencePiece decoders strip the leading space of a text's first token, which made a
completion "Paris" where prompt + completion reads " Paris". Logprobs name each token
after the ids before it (`token_names`), of which `name_context` keeps the few that count.

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
it reads a finished tokenizer: `DecodeMixin` uses the HF `tokenizer`, `vocab_size`,
`_holes`, `_byte_ids` and `_special_ids` that `Tokenizer.__init__` sets, and this module
imports nothing from `pagedjax.tokenizer` at run time, so that module imports it (and
re-exports `StreamDecoder`, `token_names`, `name_context`, `CONTEXT_IDS` and
`MAX_RUN_IDS`) without a cycle. `_byte_fallback_ids` and `_byte_run` find the
byte-fallback runs.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:
    from pagedjax.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_INT = {int}  # the type of ids `_index_ids` takes as they are
# Prompt ids a completion is decoded after (`Tokenizer.decode(context=...)`): enough for
# a decoder's first-token rules to see a token of text before the completion.
CONTEXT_IDS = 8
# How far back `name_context` follows a run of byte-fallback tokens: a token after a
# longer run (256 four-byte characters and no other token) is named as if it began the
# text, so that naming each token of a long output costs a bounded walk.
MAX_RUN_IDS = 1024


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


class DecodeMixin:
    """`Tokenizer`'s decode side: `decode`, `decode_each`, `stream` and `special_ids`.

    It reads the attributes `Tokenizer.__init__` sets: `tokenizer` (the HF one),
    `vocab_size`, `_holes` (the ids below it that no token has), `_byte_ids`
    (`_byte_fallback_ids`) and `_special_ids` (the added tokens marked special).
    """

    def decode(
        self, ids: Iterable[int], *, skip_special_tokens: bool = True, context: Iterable[int] = ()
    ) -> str:
        """Text of `ids`; special tokens (BOS, EOS, ...) are dropped unless asked for,
        and ids that no token has (a padded embedding's rows past the vocabulary, a hole
        in it) decode to "", as in HF.

        `context`: the ids before them (a completion's prompt). The text is then what the
        ids add after it, `decode(context + ids)` less `decode(context)`, so that a decoder
        that treats a text's first token specially reads them as a continuation:
        SentencePiece's leading-space strip made a completion "Paris" where prompt +
        completion reads " Paris" (as vLLM and HF pipelines return it). Only the last
        `CONTEXT_IDS` ids before a trailing run of byte-fallback tokens count, and only if
        their text is settled (see `_context`).

        The text is the decoder's, as vLLM's completions are: tokenizer_config's
        `clean_up_tokenization_spaces` (HF's decode then reads " ." as ".") is not
        applied. Ids that end inside a character end in U+FFFD, as HF decodes them
        (vLLM's DecodeStream never emits those bytes).
        """
        ids = self._check_ids(ids)
        return self._after(self._context(context, skip_special_tokens), ids, skip_special_tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids `skip_special_tokens=True` drops (the added tokens marked special)."""
        return self._special_ids

    def decode_each(
        self, ids: Iterable[int], *, skip_special_tokens: bool = True, context: Iterable[int] = ()
    ) -> list[str]:
        """Each id's own text after `context`: `[decode([i], context=context) for i in ids]`
        (same arguments), with the context resolved once and each distinct id decoded
        once: naming a position's n candidates for logprobs (the sampled token and its
        alternatives) takes n + 1 tokenizer decodes where decode per id takes 2n.
        """
        ids = self._index_ids(ids)
        ctx = self._context(context, skip_special_tokens)
        texts: dict[int, str] = {}
        for i in ids:
            if i not in texts:  # no token (past the vocabulary, a hole): "", as decode drops it
                known = i < self.vocab_size and i not in self._holes
                texts[i] = self._after(ctx, [i], skip_special_tokens) if known else ""
        return [texts[i] for i in ids]

    def _after(self, ctx: tuple[list[int], str] | None, ids: list[int], skip: bool) -> str:
        """The text `ids` add after a resolved context (`_context`; None: none)."""
        if ctx is not None:
            full = self.tokenizer.decode(ctx[0] + ids, skip_special_tokens=skip)
            if full.startswith(ctx[1]):
                return full[len(ctx[1]) :]
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _context(self, context: Iterable[int], skip: bool) -> tuple[list[int], str] | None:
        """The last `CONTEXT_IDS` ids of `context` before a trailing byte-fallback run,
        and their text; None when the decoder would see none of them (all skipped special
        tokens: it would strip the ids' leading space as if they began the text) or the
        text ends inside a character (U+FFFD), which the ids after it may still change.

        A trailing run of byte-fallback tokens is left out, whole characters or not: the
        ids after it may extend the run, which HF decodes all or nothing, and without it
        the text before the run still shows the decoder that the ids are a continuation
        (a prompt ending in an emoji or a newline, `<0x0A>`, lost the completion's
        leading space). The ids are taken before the run, however long (two emoji are 8
        byte tokens, which left no ids: the completion lost its space again)."""
        context, ids, n = _id_list(context), [], CONTEXT_IDS
        while len(ids) < CONTEXT_IDS:  # a tail twice as long while the run fills it
            tail = self._check_ids(context[-n:])
            ids = tail[: len(tail) - _byte_run(self, tail, skip)]
            if n >= len(context):
                break
            n *= 2
        ids = ids[-CONTEXT_IDS:]
        if not [i for i in ids if not (skip and i in self._special_ids)]:
            return None
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        return None if text.endswith(_REPLACEMENT) else (ids, text)

    def stream(
        self, *, skip_special_tokens: bool = True, context: Iterable[int] = ()
    ) -> StreamDecoder:
        """A fresh incremental decoder for one sequence; with `context` (its prompt's ids),
        its text adds up to `decode(ids, context=context)`."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens, context=context)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as ints, less those that no token has: past the vocabulary, or a hole in it.

        A model's embedding is often padded past its tokenizer's vocabulary (Qwen2.5:
        152064 rows, 151665 tokens) and sampling can pick a padded row; HF decodes such
        an id to "" rather than failing the whole sequence, and so does this. The id of a
        hole is dropped as well, so that the stream's window never slides to a chunk of
        nothing (the next token then decoded as the text's first: "<unk>t" for "<unk> t").
        """
        ids = self._index_ids(ids)
        if not self._holes and (not ids or max(ids) < self.vocab_size):
            return ids  # (all of them: the usual case, without a filter per id)
        return [i for i in ids if i < self.vocab_size and i not in self._holes]

    @staticmethod
    def _index_ids(ids: Iterable[int]) -> list[int]:
        """`ids` as ints, all of them (a new list); raises on a non-int or a negative id."""
        ids = _id_list(ids)
        if {*map(type, ids)} - _INT:  # (plain ints, a sequence's token ids, need no check)
            for i in ids:  # int() would truncate 3.7 and parse "3"
                if isinstance(i, bool) or not hasattr(type(i), "__index__"):
                    raise TypeError(f"token ids must be ints, got {type(i).__name__} {i!r:.40}")
            ids = [operator.index(i) for i in ids]
        if ids and min(ids) < 0:
            bad = [i for i in ids if i < 0]
            raise ValueError(f"token ids must be >= 0, got {bad[:10]}")
        return ids


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

        Ids that no token has (`Tokenizer._check_ids`) are dropped (not kept in `ids`):
        they decode to "".

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
        tok, one = self._tok, token_ids
        if type(one) is int and 0 <= one < tok.vocab_size and one not in tok._holes:
            new = [one]  # the engine's case, one valid id: no batch checks
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


def token_names(
    tok, ids: list[int], *, context: Iterable[int] = (), skip_special_tokens: bool = True
) -> list[str]:
    """The names of one position's candidate tokens `ids` (the sampled one, its
    alternatives), for logprobs: each one's text where it stands, after `context` (the
    ids before it), so that a SentencePiece token keeps the leading space a lone decode
    strips. The candidates are named with their special tokens shown ("</s>"), but the
    context is read as the completion's text reads it (`skip_special_tokens`: its
    request's): without special tokens by default, so after a prompt of special tokens
    only (BOS), the text's first token has no leading space and neither has its name.

    `tok`: a `Tokenizer` (or anything with its `special_ids` and `decode_each`).
    `context`: all the ids before the position, or the few of them `name_context` keeps
    (not the last `CONTEXT_IDS`: after a run of byte-fallback tokens, the run alone).
    """
    if skip_special_tokens:
        context = [i for i in context if i not in tok.special_ids]
    return tok.decode_each(ids, skip_special_tokens=False, context=context)


def name_context(
    tok,
    ids: Sequence[int],
    end: int | None = None,
    *,
    skip_special_tokens: bool = True,
    with_run: bool = False,
) -> list[int]:
    """The few ids of `ids[:end]` that name the tokens at position `end` as all of them
    do (`token_names(context=)`, with the request's `skip_special_tokens`).

    A context is read from the last `CONTEXT_IDS` ids before its trailing run of
    byte-fallback tokens (`Tokenizer._context`), so the last `CONTEXT_IDS` ids are not
    enough: after two emoji (8 byte tokens) they were the run alone, and the token after
    it lost its leading space ("the" where the text reads " the"). These are the
    `CONTEXT_IDS` ids before the run, counted as the context counts them (not the
    skipped special tokens, nor the ids past the vocabulary, which decode drops), found
    by walking back over the run, `MAX_RUN_IDS` ids at most, without decoding.

    Args:
      tok: a `Tokenizer` (or anything with its `special_ids`: no byte-fallback tokens).
      ids: the ids, of which those before `end` (default: all) are the context.
      skip_special_tokens: whether the context leaves special tokens out.
      with_run: keep the run after them too: a tail of `ids[:end]` that the ids after
        `end` can be appended to (a stream's context for its next chunk).
    """
    end = len(ids) if end is None else end
    byte_ids = getattr(tok, "_byte_ids", frozenset())
    vocab = getattr(tok, "vocab_size", None)
    holes = getattr(tok, "_holes", frozenset())
    special = tok.special_ids if skip_special_tokens else frozenset()

    def dropped(i) -> bool:  # not in the context that decode reads
        return i in special or i in holes or (vocab is not None and i >= vocab)

    start, stop = end, max(0, end - MAX_RUN_IDS)
    while start > stop and (ids[start - 1] in byte_ids or dropped(ids[start - 1])):
        start -= 1
    if start and (ids[start - 1] in byte_ids or dropped(ids[start - 1])):  # (too long)
        return list(ids[start:end]) if with_run else []
    run, counted, stop = start, 0, max(0, start - MAX_RUN_IDS)
    while start > stop and counted < CONTEXT_IDS:
        start -= 1
        counted += not dropped(ids[start])
    return list(ids[start : end if with_run else run])


def _id_list(ids: Iterable[int]) -> list:
    try:
        return list(ids)
    except TypeError:  # (Python's "'int' object is not iterable" named nothing)
        raise TypeError(f"token ids must be a list of ints, got {ids!r:.40}") from None
