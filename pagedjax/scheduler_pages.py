"""The scheduler's page arithmetic: how many KV pages a request may need, and how many
admitting it takes.

`Scheduler` (`pagedjax.scheduler`, whose module docstring has the policy these serve)
inherits them from `PagesMixin`: the bound `add` checks (`max_pages_needed`), the most
pages a sequence holds under a sliding window (`window_pages`, `_peak_pages`), and the
count admission makes of the pages a waiting group takes (`_admit_len`, `_admit_pages`,
`_prefill_pages`). For that count it keeps each sequence's prefix-cache page hashes on
the sequence (`_hashed`), so that a group waiting for pages is hashed once, not on every
step it waits, nor again when it is admitted.
"""

from __future__ import annotations

from pagedjax import planner
from pagedjax.page_hashes import HashedPrompt, PageHashes, salt_bytes
from pagedjax.sequence import Sequence, SequenceGroup

__all__ = ["PagesMixin"]


class PagesMixin:
    """`Scheduler`'s page arithmetic (`pagedjax.scheduler.Scheduler` inherits it; see the
    module docstring), on the state `Scheduler.__init__` sets up: the block manager `bm`,
    `sliding_window` and `max_num_batched_tokens`."""

    def max_pages_needed(self, group: SequenceGroup) -> int:
        """Most pages the group can need at once, with no sharing (what `add` checks).

        A sequence of `max_num_tokens` tokens never feeds its last one: sampling it ends
        the sequence, and no step is planned behind a token in flight that will be the
        last (`_will_decode`; a row after a stop token or string feeds a token before
        the last). So its K/V fills at most `max_num_tokens - 1` slots, which is what a
        readmission prefills at worst, and the decode reserves are the exact pages of
        the appends.

        A beam group is bounded by its decode steps instead: each reserves a page per
        beam row before the rows are bound to beams (the selection forks and drops beams
        after `schedule()`), on top of the beams' pages, which fill at most
        `max_num_tokens - 2` slots then (the fed token's slot is the one appended).
        """
        seqs = group.seqs + group.forks
        longest = max(s.max_num_tokens for s in seqs)
        if group.atomic:
            return group.num_seats * (self._peak_pages(longest - 2) + 1)
        return group.num_seats * self._peak_pages(longest - 1)

    @property
    def window_pages(self) -> int | None:
        """Most pages a sequence holds at once under the sliding window (None: no window):
        the W - 1 positions before a chunk and the chunk, L = W - 1 + budget positions, span
        at most ceil((L - 1) / page_size) + 1 pages (W = 1: L = 1 + budget, the last page
        is kept too; `planner.window_pages`, which the capacity planner reports)."""
        w = self.sliding_window
        if w is None:
            return None
        return planner.window_pages(w, self.bm.page_size, self.max_num_batched_tokens)

    def _peak_pages(self, num_tokens: int) -> int:
        """Most pages a sequence whose K/V fills `num_tokens` slots holds at once (a
        window: at most `window_pages`; `planner.held_pages`)."""
        return planner.held_pages(
            num_tokens,
            self.bm.page_size,
            sliding_window=self.sliding_window,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def _admit_len(self, g: SequenceGroup, s: Sequence) -> int:
        """Tokens to prefill on admission; the rest is fed as a decode row."""
        if g.forks and s is g.seqs[0]:
            return len(s.token_ids) - 1  # the samples fork here and feed the last token
        if g.atomic and s.num_generated > 0:
            return len(s.token_ids) - 1  # beams resynchronise on one decode step
        return len(s.token_ids)

    def _admit_pages(self, g: SequenceGroup, lens: list[int]) -> int:
        """Pages admitting `g` takes: each sequence's prefill (`lens`, `_admit_len`'s) and,
        for one that samples at the end of it and feeds that token next (it is not its
        last), the page of that token's slot: else a prompt that ends on a page boundary
        finds that page missing from the next step's decode reserve, and is preempted
        (under "fcfs" the newest, so it) for its own first token. Within
        `max_pages_needed`: a group alone is always admitted.

        A prefill takes a page for each of its pages that is not a prefix-cache hit, and a
        hit only while no one holds it, once for the group's sequences (`_prefill_pages`):
        a prompt that starts with pages a running request holds (a shared system prompt)
        does not wait for free pages it will not take, nor readmitted samples or beams for
        their shared prompt.

        Samples forked after the prompt (`g.forks`) share its pages, and each one's first
        decode token takes a page: a new one when `prompt[:-1]` ends on a page boundary,
        else a copy of the shared last page for all but one (copy-on-write).

        Beams count their prefills' pages and, when they decode after it, a page per beam
        row, which each decode step reserves whatever the appends take
        (`_decode_candidates`), plus what the first step's appends keep beside the second's
        reserve: a new page per beam where the fed position starts a page, else a copy of
        the prompt's partial page for each of a new group's beams but one (a readmitted
        beam's partial page is its own). Else the group is preempted for its own reserve in
        the step after its first decode."""
        if g.atomic:
            s, n = g.seqs[0], lens[0]  # (the beams have equal lengths)
            need = self._prefill_pages(g, lens)
            if n < len(s.token_ids) or n + 1 < s.max_num_tokens:  # it decodes
                need += g.num_seats
                if n + 2 < s.max_num_tokens:  # twice
                    beams = len(g.seqs) if n < len(s.token_ids) else g.num_seats
                    need += beams - (len(g.seqs) if n % self.bm.page_size else 0)
            return min(need, self.max_pages_needed(g))
        if g.forks:
            (n,) = lens
            k = len(g.seqs) + len(g.forks)
            need = self._prefill_pages(g, lens) + k - (1 if n % self.bm.page_size else 0)
            return min(need, self.max_pages_needed(g))
        if self.sliding_window is not None:
            return sum(
                self._peak_pages(n + 1 if n + 1 < s.max_num_tokens else n)
                for s, n in zip(g.seqs, lens, strict=True)
            )
        # A prompt that ends on a page boundary feeds its first sample from a new page.
        first = sum(
            n % self.bm.page_size == 0 and n + 1 < s.max_num_tokens
            for s, n in zip(g.seqs, lens, strict=True)
        )
        return self._prefill_pages(g, lens) + first

    def _prefill_pages(self, g: SequenceGroup, lens: list[int]) -> int:
        """Free pages the `bm.admit` calls of a group's sequences (`lens` tokens each) take,
        one after another: each page that is not a prefix-cache hit, and each hit nobody
        holds once (`BlockManager.admit_pages`; one a running request holds is no free
        page). A window model reserves each sequence's peak instead
        (`admit(..., peak_pages=)`)."""
        if self.sliding_window is not None:
            return sum(self._peak_pages(n) for n in lens)
        prompts = [
            (self._hashed(g, s, n), n == len(s.token_ids))
            for s, n in zip(g.seqs, lens, strict=True)
        ]
        return self.bm.admit_pages(prompts, g.cache_salt, read_cache=g.read_prefix_cache)

    def _hashed(self, g: SequenceGroup, s: Sequence, n: int) -> HashedPrompt:
        """`s`'s first `n` tokens with its page hashes (`Sequence.page_hashes`), which are
        kept, so that a group waiting for pages is hashed once, not every step, and not
        again when admitted (nor, readmitted, but for the tokens it appended). New ones for
        a list that was replaced (a forked sample's) or shortened, or a new salt."""
        ph, salt = s.page_hashes, salt_bytes(g.cache_salt)
        if ph is None or not ph.kept(s.token_ids, salt, self.bm.page_size):
            ph = s.page_hashes = PageHashes(s.token_ids, salt, self.bm.page_size)
        return ph.prefix(n)
