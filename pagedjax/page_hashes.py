"""The prefix cache's hash chain: a page's hash chains the parent page's hash and the
page's token ids (int64 little-endian), from a root that hashes the request's salt
(``salt_bytes``), and ``PageHashes`` keeps a token list's full-page hashes so that a
sequence is hashed once (``pagedjax.prefix_cache``'s ``lookup`` walks them, its
``register`` extends a sequence's chain with ``digest``)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import numpy as np

__all__ = ["HashedPrompt", "PageHashes", "digest", "root_hash", "salt_bytes"]


def digest(data: bytes) -> bytes:
    """The prefix-cache hash. Tests patch it here to force collisions
    (``pagedjax.prefix_cache`` looks it up here at each call)."""
    return hashlib.sha256(data).digest()


def root_hash(salt: bytes) -> bytes:
    """The hash every chain with this (encoded) salt starts from."""
    return digest(b"pagedjax.prefix.v1\x00" + salt)


def salt_bytes(cache_salt: str | bytes | None) -> bytes:
    """Encodes a request's ``cache_salt``; str and bytes of equal content stay distinct.

    Raises:
        TypeError: ``cache_salt`` is not str, bytes or None.
    """
    if cache_salt is None:
        return b"\x00"
    if isinstance(cache_salt, str):
        # surrogatepass: a lone surrogate (JSON "\ud800") is a valid str; strict UTF-8
        # refuses it. The encoding stays one-to-one (it decodes back the same way).
        return b"\x01" + cache_salt.encode("utf-8", "surrogatepass")
    if isinstance(cache_salt, bytes):
        return b"\x02" + cache_salt
    raise TypeError(f"cache_salt must be str, bytes or None, got {type(cache_salt).__name__}")


class PageHashes:
    """The chain hashes of a token list's full pages (as ``lookup`` hashes a prompt),
    computed once and kept: the scheduler keeps one on each sequence
    (``Sequence.page_hashes``), so that a prompt waiting for pages at the head of the
    queue, which admission looks up every step and once more when it is admitted, is
    hashed once, as vLLM keeps each request's block hashes. Pages are hashed as lookups
    reach them, doubling the hashed pages each time (a prompt whose first page misses
    hashes one page; any walk at most twice the pages it reaches), and a list that grew
    since (appended tokens) is hashed on from where it stopped.

    It holds while its list only grows by appending: ``kept`` tells whether one still
    fits a list (the same list object, not shorter than what was hashed, the same salt);
    a list replaced (assigned anew: a forked sample's, a beam's) or shortened needs a new
    one. ``BlockManager.admit`` checks the hashed tokens against the prompt it admits, so
    one whose list was edited in place otherwise is refused there, never trusted.

    Args:
        source: the token ids: a list of ints (kept by reference and read as it grows),
            or their int64 little-endian bytes.
        salt: ``salt_bytes(cache_salt)`` of the request.
        page_size: token slots per page.
    """

    __slots__ = ("source", "salt", "page_size", "tokens", "hashes", "_root")

    def __init__(self, source: list[int] | bytes, salt: bytes, page_size: int):
        self.source = source
        self.salt = salt
        self.page_size = page_size
        # The hashed pages' token ids, int64 little-endian (bytes: the source itself).
        self.tokens = source if isinstance(source, (bytes, bytearray)) else bytearray()
        self.hashes: list[bytes] = []  # hashes[i]: the chain hash after page i
        self._root: bytes | None = None

    def kept(self, token_ids: list[int], salt: bytes, page_size: int) -> bool:
        """Whether these hashes still hold for ``token_ids`` (their list, grown or not)."""
        return (
            token_ids is self.source
            and salt == self.salt
            and page_size == self.page_size
            and len(token_ids) >= len(self.hashes) * page_size
        )

    @property
    def num_pages(self) -> int:
        """Full pages of the source (hashed or not)."""
        per = 8 * self.page_size if isinstance(self.source, (bytes, bytearray)) else self.page_size
        return len(self.source) // per

    def root(self) -> bytes:
        """The chain's root hash (``root_hash(salt)``)."""
        if self._root is None:
            self._root = root_hash(self.salt)
        return self._root

    def pages(self, num_pages: int) -> Iterator[tuple[bytes, bytes | bytearray]]:
        """The chain hash and token bytes of each of the first ``num_pages`` full pages (at
        most ``num_pages``), hashing them as they are reached."""
        hashes, tokens, psb = self.hashes, self.tokens, 8 * self.page_size
        for i in range(min(num_pages, self.num_pages)):
            if i >= len(hashes):
                self._hash(max(i + 1, 2 * i))
            yield hashes[i], tokens[i * psb : (i + 1) * psb]

    def _hash(self, num_pages: int) -> None:
        ps, psb, src, hashes = self.page_size, 8 * self.page_size, self.source, self.hashes
        k, num_pages = len(hashes), min(num_pages, self.num_pages)
        if not isinstance(src, (bytes, bytearray)):
            self.tokens += np.array(src[k * ps : num_pages * ps], dtype="<i8").tobytes()
        tokens, h = self.tokens, hashes[-1] if hashes else self.root()  # (extended in place)
        for j in range(k, num_pages):
            h = digest(h + tokens[j * psb : (j + 1) * psb])
            hashes.append(h)

    def prefix(self, num_tokens: int) -> HashedPrompt:
        """The first ``num_tokens`` of the (list) source as a prompt with these hashes."""
        return HashedPrompt(self, num_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class HashedPrompt:
    """A prompt that ``BlockManager.admit`` and ``admit_pages`` take without hashing it
    again: the first ``num_tokens`` token ids of ``hashes.source`` (a list), whose page
    hashes ``hashes`` keeps (``PageHashes.prefix``)."""

    hashes: PageHashes
    num_tokens: int

    def __len__(self) -> int:
        return self.num_tokens
