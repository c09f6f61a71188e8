"""One live sequence's pages as the block manager tracks them, and copy-on-write.

Host-side plain Python and numpy, used by ``SeqTables`` (``pagedjax.seq_tables``) and the
``BlockManager`` (``pagedjax.blocks``), which validate every call before it gets here. A
``SeqPages`` record holds a sequence's page table (logical page -> physical page, with an
int32 mirror that ``page_tables`` copies rows from), its token ids (int64 little-endian
bytes, the prefix cache's format), how many of them are computed, its prefix-cache
``Chain``, the one token whose value may not be known yet, the leading pages given back
under a sliding window (-1 in ``pages``, ``PAD_PAGE`` in the mirror) and, until its prompt
is computed, its reservation peak.

Appending a token takes a new page when the last one is full; when the last page is
partial and shared (after a ``fork``), the sequence copies it first (copy-on-write) unless
it is the last holder in the batch to write: ``append_pages_needed`` counts those pages
before ``append`` takes them, so a batch that does not fit changes nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from pagedjax.errors import InvalidArgument, InvalidState
from pagedjax.page_pool import PagePool
from pagedjax.prefix_cache import Chain, PrefixCache, Require

__all__ = ["PAD_PAGE", "SeqPages", "append", "append_pages_needed", "pack_token", "set_values"]

PAD_PAGE = 0  # page-table padding (as in the step inputs), also for released entries
pack_token = struct.Struct("<q").pack  # one token id as stored in SeqPages.tokens

Register = Callable[[Chain, list[int], bytearray, int], None]  # PrefixCache.register


@dataclasses.dataclass(slots=True)
class SeqPages:
    """A live sequence's pages, tokens and progress."""

    pages: list[int]  # logical page -> physical page
    table: np.ndarray  # [capacity] int32, pages mirrored for fast page_tables(); PAD_PAGE after
    tokens: bytearray  # every token id, int64 little-endian
    num_tokens: int
    num_computed: int  # tokens whose K/V is on the device (or written this step)
    chain: Chain  # the prefix cache's position in this sequence (salt included)
    unknown: int = -1  # position of the token whose value is not known yet (-1: none)
    released: int = 0  # leading pages given back (window): -1 in pages, PAD_PAGE in table
    peak: int = 0  # admitted with peak_pages, prompt not computed: most pages held (else 0)
    num_prompt: int = 0  # its request's prompt length, <= admitted tokens (a fork: parent's)

    @classmethod
    def admitted(
        cls,
        pages: list[int],
        released: int,
        capacity: int,
        tokens: bytes,
        num_tokens: int,
        num_computed: int,
        chain: Chain,
        num_prompt: int,
    ) -> SeqPages:
        """A new sequence holding ``pages`` (the first ``released`` of them -1) for its
        prompt, ``num_tokens`` int64 ``tokens``, in a table of ``capacity`` entries; the
        first ``num_prompt`` of them are its request's prompt (a readmitted request's
        output follows)."""
        table = np.full(capacity, PAD_PAGE, np.int32)
        table[released : len(pages)] = pages[released:]
        return cls(
            pages,
            table,
            bytearray(tokens),
            num_tokens,
            num_computed,
            chain,
            released=released,
            num_prompt=num_prompt,
        )

    def forked(self) -> SeqPages:
        """A copy sharing every page (the caller adds the references)."""
        return dataclasses.replace(
            self,
            pages=list(self.pages),
            table=self.table.copy(),
            tokens=self.tokens[:],
            chain=self.chain.copy(),
        )

    def extend(self, new_pages: list[int]) -> None:
        """Appends ``new_pages`` to the table (``grow``)."""
        k, need = len(self.pages), len(new_pages)
        self.pages += new_pages
        if k + need > self.table.shape[0]:
            self.table = np.concatenate([self.table, np.zeros(k + need, np.int32)])
        self.table[k : k + need] = self.pages[k:]

    def release(self, end: int) -> None:
        """Marks the pages before logical page ``end`` released (the caller drops them)."""
        start = self.released
        self.pages[start:end] = [-1] * (end - start)
        self.table[start:end] = PAD_PAGE
        self.released = end

    def slots(self, seq_id: Hashable, start: int, end: int, page_size: int) -> np.ndarray:
        """Device slots of positions ``[start, end)``: ``[end - start]`` int32.

        Raises:
            InvalidArgument: the range leaves the tokens, or reaches released pages or past
                the pages held.
        """
        if not 0 <= start <= end <= self.num_tokens:
            raise InvalidArgument(
                f"slot range [{start}, {end}) of {seq_id!r} is outside [0, {self.num_tokens}]"
            )
        if start < min(end, self.released * page_size):
            raise InvalidArgument(
                f"slot range [{start}, {end}) of {seq_id!r} reaches its released pages "
                f"(positions < {self.released * page_size})"
            )
        if end > len(self.pages) * page_size:
            raise InvalidArgument(
                f"slot range [{start}, {end}) of {seq_id!r} reaches past its pages (positions "
                f"< {len(self.pages) * page_size}); grow it first"
            )
        pos = np.arange(start, end)
        ps = page_size
        return (self.table[pos // ps] * ps + pos % ps).astype(np.int32)

    def check(
        self,
        seq_id: Hashable,
        page_size: int,
        reserving: bool,
        prefix: PrefixCache,
        require: Require,
    ) -> None:
        """Checks the record's own bookkeeping and its cached prefix (``check_invariants``);
        ``reserving``: whether the manager lists it as reserving."""
        s, sid, ps = self, seq_id, page_size
        k, r = len(s.pages), s.released
        held = s.pages[r:]
        require(0 <= r < k and r * ps <= s.num_computed, f"{sid!r}: released {r} of {k}")
        require(s.pages[:r] == [-1] * r and min(held) >= 0, f"{sid!r}: released {s.pages}")
        require(len(set(held)) == len(held), f"{sid!r} holds a page twice: {s.pages}")
        lo = -(-s.num_computed // ps) if s.peak else -(-s.num_tokens // ps)
        require(lo <= k <= -(-s.num_tokens // ps), f"{sid!r}: {k} pages, {s.num_tokens} tokens")
        require(reserving == (s.peak > 0), f"{sid!r}: stale reservation")
        require(not s.peak or s.num_computed < s.num_tokens, f"{sid!r}: reserves, computed")
        require(k - r <= s.peak or not s.peak, f"{sid!r} holds {k - r} > {s.peak} pages")
        table = s.table[:k].tolist()
        require(table == [PAD_PAGE] * r + held, f"{sid!r}: table mirror is stale")
        # (past the pages: PAD_PAGE, which `SeqTables.page_tables` copies as padding)
        require(bool((s.table[k:] == PAD_PAGE).all()), f"{sid!r}: table mirror past its pages")
        require(len(s.tokens) == 8 * s.num_tokens, f"{sid!r}: token buffer length")
        require(0 <= s.num_computed <= s.num_tokens, f"{sid!r}: num_computed out of range")
        require(1 <= s.num_prompt <= s.num_tokens, f"{sid!r}: num_prompt out of range")
        require(-1 <= s.unknown < s.num_tokens, f"{sid!r}: unknown token out of range")
        known = s.num_computed if s.unknown < 0 else min(s.num_computed, s.unknown)
        prefix.check_chain(repr(sid), s.chain, s.pages, s.tokens, known, require)


def append_pages_needed(
    seq_ids: Sequence[Hashable],
    seqs: Sequence[SeqPages],
    page_size: int,
    refcount: list[int],
    max_model_len: int | None,
) -> int:
    """Validates an append batch (``seqs`` are ``seq_ids``' records); returns the pages
    ``append`` will allocate, new ones and copies.

    Raises:
        InvalidState: a sequence is mid-prefill or holds a token without a value.
        InvalidArgument: a sequence is at ``max_model_len``, or appears twice.
    """
    ps, rc, limit = page_size, refcount, max_model_len
    needed = 0
    shared: dict[int, int] = {}  # shared partial last page -> batch members holding it
    for sid, s in zip(seq_ids, seqs, strict=True):
        if s.num_computed != s.num_tokens:
            raise InvalidState(
                f"cannot append to {sid!r} mid-prefill: {s.num_computed} of "
                f"{s.num_tokens} tokens computed"
            )
        if limit is not None and s.num_tokens >= limit:
            raise InvalidArgument(f"sequence {sid!r} is at max_model_len={limit}")
        if s.unknown >= 0:
            raise InvalidState(
                f"cannot append to {sid!r}: token {s.unknown} has no value yet (set_tokens)"
            )
        if s.num_tokens % ps == 0:
            needed += 1
        elif rc[s.pages[-1]] > 1:
            shared[s.pages[-1]] = shared.get(s.pages[-1], 0) + 1
    if len(set(seq_ids)) != len(seq_ids):
        dup = next(k for k, c in collections.Counter(seq_ids).items() if c > 1)
        raise InvalidArgument(f"sequence {dup!r} appears twice in one append batch")
    # The last holder of a shared page to write keeps it; every other one copies.
    for p, c in shared.items():
        needed += c - (c == rc[p])
    return needed


def append(
    seqs: Sequence[SeqPages],
    token_ids: list[int],
    page_size: int,
    pool: PagePool,
    register: Register,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Gives each sequence a slot for one more token (checked by ``append_pages_needed``,
    whose pages the pool must have); pages that fill up with known tokens get cached.

    Returns:
        ``(slots, copies)``: ``[B]`` write slots, and ``(src_page, dst_page)``
        copy-on-write copies to run before the writes.
    """
    ps, rc, alloc, pack = page_size, pool.refcount, pool.alloc, pack_token
    slots: list[int] = []
    copies: list[tuple[int, int]] = []
    for s, t in zip(seqs, token_ids, strict=True):
        n, pages = s.num_tokens, s.pages
        off = n % ps
        if off == 0:
            p = alloc()
            pages.append(p)
            if len(pages) > s.table.shape[0]:
                s.table = np.concatenate([s.table, np.zeros_like(s.table)])
            s.table[len(pages) - 1] = p
        else:
            p = pages[-1]
            if rc[p] > 1:  # shared partial page: copy before writing into it
                rc[p] -= 1
                src, p = p, alloc()
                pages[-1] = p
                s.table[len(pages) - 1] = p
                copies.append((src, p))
        s.tokens += pack(t)
        s.num_tokens = s.num_computed = n + 1
        if t < 0:
            s.unknown = n
        elif off == ps - 1 and s.chain.hash is not None:  # the page is full: cache it
            register(s.chain, pages, s.tokens, len(pages))
        slots.append(p * ps + off)
    return slots, copies


def set_values(
    seqs: Sequence[SeqPages], token_ids: list[int], page_size: int, register: Register
) -> None:
    """Gives the values of the tokens the sequences appended as unknown; full pages get
    cached."""
    ps = page_size
    for s, t in zip(seqs, token_ids, strict=True):
        s.tokens[8 * s.unknown : 8 * s.unknown + 8] = pack_token(t)
        s.unknown = -1
        full = s.num_computed // ps
        if s.chain.hash is not None and s.chain.num_pages < full:  # a page filled up
            register(s.chain, s.pages, s.tokens, full)
