"""A tokenizer's tokens as the bytes they add to generated text, and their walks through a
byte DFA: what `pagedjax.guided` builds token masks from.

`token_bytes` reads each id's bytes off the tokenizer's decoder; `_TokenTable` lays them
out for vectorized walks (the first `HEAD` bytes of every token in a padded matrix, the
rest of the longer tokens in another), and `_walk` steps every token from one DFA state
at once, one gather per byte position over the tokens still alive, counting the bytes it
stepped (`guided.MAX_VIABLE_WORK` bounds that work).
"""

from __future__ import annotations

import json as jsonlib
import re

import numpy as np

from pagedjax.tokenizer import Tokenizer

__all__ = ["token_bytes"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character alphabet (ByteLevel pre-tokenizers/decoders):
    printable Latin-1 bytes stand for themselves, the others for chr(256 + k) in order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}


_BYTE_LEVEL = {ord(c): b for b, c in _bytes_to_unicode().items()}  # char -> byte value
_BYTE_LEVEL_CHARS = frozenset(map(chr, _BYTE_LEVEL))
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_steps(tok) -> list[dict]:
    """The decoder's steps, flattened; ValueError for one whose per-token bytes we cannot
    tell."""
    if tok.decoder is None:
        raise ValueError("the tokenizer has no decoder: its tokens' bytes are unknown")
    config = jsonlib.loads(tok.decoder.__getstate__())
    steps = config["decoders"] if config.get("type") == "Sequence" else [config]
    fused = False
    for step in steps:
        kind = step.get("type")
        if kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and not step.get("stop"):
            pass  # strips the text's start: the prompt's, for a completion
        elif kind == "Replace" and set(step.get("pattern", {})) == {"String"}:
            pass
        elif kind not in ("ByteLevel", "ByteFallback", "Metaspace"):
            raise ValueError(f"tokenizer decoder {kind!r} is not supported: {step!r:.120}")
    return steps


def token_bytes(tokenizer: Tokenizer) -> list[bytes | None]:
    """Each id's bytes in generated text (UTF-8), by the tokenizer's decoder: ByteLevel
    (GPT-2's alphabet inverted; a token with other characters is its own UTF-8, as HF
    decodes it), Metaspace / Replace of a string ("▁" is a space; the leading space a
    decoder strips from a text's first token is kept: a completion follows its prompt),
    ByteFallback (`<0xNN>` is the byte NN), Fuse and Strip of the text's start. Added
    and special tokens are None. Another decoder is a ValueError naming it.
    """
    tok = tokenizer.tokenizer
    steps = _decoder_steps(tok)
    added = tok.get_added_tokens_decoder()
    out: list[bytes | None] = []
    for i in range(tokenizer.vocab_size):
        piece = None if i in added else tok.id_to_token(i)
        if piece is None:
            out.append(None)
            continue
        value: str | bytes = piece
        for step in steps:
            kind = step["type"]
            if isinstance(value, bytes):
                break
            if kind == "Replace":
                value = value.replace(step["pattern"]["String"], step["content"])
            elif kind == "Metaspace":
                value = value.replace(step.get("replacement", "▁"), " ")
            elif kind == "ByteFallback":
                m = _BYTE_FALLBACK.fullmatch(value)
                value = bytes([int(m[1], 16)]) if m else value
            elif kind == "ByteLevel" and _BYTE_LEVEL_CHARS.issuperset(value):
                value = value.translate(_BYTE_LEVEL).encode("latin-1")
        out.append(value if isinstance(value, bytes) else value.encode("utf-8"))
    return out


class _TokenTable:
    """Token bytes for vectorized DFA walks: the first `HEAD` bytes of every token in a
    padded matrix, the rest of the longer tokens in another."""

    HEAD = 16

    def __init__(self, toks: list[bytes | None]):
        self.bytes = [t or None for t in toks]
        self.lens = np.array([len(t) if t else 0 for t in toks], np.int32)  # [n]
        self.empty = np.flatnonzero(self.lens == 0)  # ids without bytes
        self.width = max(1, min(self.HEAD, int(self.lens.max(initial=0))))
        self.head = _pad_columns([t[: self.width] if t else b"" for t in toks], self.width)
        self.long_ids = np.flatnonzero(self.lens > self.width)
        self.long_pos = np.full(len(toks), -1, np.int64)  # id -> row of `rest`
        self.long_pos[self.long_ids] = np.arange(len(self.long_ids))
        rest = [self.bytes[i][self.width :] for i in self.long_ids]
        self.rest = _pad_columns(rest, max(map(len, rest), default=0))
        self.spelled: dict[int, _TokenTable] = {}  # `_viable_states`' tables, by n


def _pad_columns(toks: list[bytes], width: int) -> np.ndarray:
    """[width, n] uint8: column k holds token k's bytes, zero-padded (rows contiguous,
    for gathers along the tokens)."""
    lens = np.fromiter(map(len, toks), np.int64, len(toks))
    out = np.zeros((width, len(toks)), np.uint8)
    if lens.sum():
        flat = np.frombuffer(b"".join(toks), np.uint8)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        out[np.arange(len(flat)) - starts, np.repeat(np.arange(len(toks)), lens)] = flat
    return out


def _ends(flat: np.ndarray, tab: _TokenTable, state: int) -> np.ndarray:
    """[n] int32: each token's end state from `state` in the DFA whose transitions are
    `flat` ([S * 256]: next = flat[state * 256 + byte]); 0: dead, or no bytes."""
    return _walk(flat, tab, state)[0]


def _walk(flat: np.ndarray, tab: _TokenTable, state: int) -> tuple[np.ndarray, int]:
    """`_ends` and the token bytes it stepped (its work)."""
    # (np.take, not fancy indexing: 2-4x faster on these 1-D gathers)
    ends = np.take(flat[state * 256 : state * 256 + 256], tab.head[0])
    steps = len(ends)
    idx = np.flatnonzero((ends != 0) & (tab.lens > 1))
    for j in range(1, tab.width):
        if not idx.size:
            break
        steps += idx.size
        e = ends[idx] = np.take(flat, ends[idx] * 256 + tab.head[j, idx])
        idx = idx[(e != 0) & (tab.lens[idx] > j + 1)]
    rows = tab.long_pos[idx]  # the long tokens still alive
    for j in range(tab.rest.shape[0]):
        if not idx.size:
            break
        steps += idx.size
        e = ends[idx] = np.take(flat, ends[idx] * 256 + tab.rest[j, rows])
        keep = (e != 0) & (tab.lens[idx] > tab.width + j + 1)
        idx, rows = idx[keep], rows[keep]
    ends[tab.empty] = 0
    return ends, steps
