"""Continuous batching: which sequences run each step, under a token budget.

Host state only (dataclasses, lists, the `BlockManager`); no jax arrays. The engine
drives one step in two phases so that the host can plan step N+1 while the device
still runs step N:

    plan = scheduler.schedule()   # phase 1: decode candidates, page reservation,
                                  # preemption, prefill chunks, admissions
    ...                           # the engine waits for step N's tokens and applies
                                  # them: finish(), fork(), drop()
    scheduler.commit(plan)        # phase 2: append the decode rows' tokens (slots,
                                  # copy-on-write copies, page tables)

Policy of `schedule()`, in order, with `max_num_batched_tokens` tokens to spend and at
most `max_num_seqs` sequences running:

1. Decode: every running sequence whose next token is known or in flight gets one
   token (a beam group gets `beam_width` rows, bound to its beams in `commit`). The
   pages those appends may need are reserved; while they exceed the free pages (less
   those reserved for window prompts, below), the most recently admitted running group
   (by priority: the worst, below) is preempted by recompute: its pages are freed and
   it goes back to the FRONT of the waiting queue (by priority: to its place), keeping
   its prompt and generated tokens, which are prefilled again on readmission (cheaply
   where the prefix cache still holds their pages). Results of its in-flight step are
   dropped (its `epoch` changes); recomputing them gives the same tokens, since a
   sample depends only on (seed, token index) and the logits.
2. Prefill: running sequences that are part-way through their prompt get the next
   chunk, oldest first.
3. Admission: waiting groups, first come first served (by priority: best first,
   below; a group that does not fit blocks those behind it, so nothing starves), while
   seats, budget and pages allow. A group whose LoRA adapter finds every slot
   (`max_loras`) taken by other adapters keeps its place while the base-model groups
   behind it (no adapter) are admitted: they hold no slot, so it still gets the first
   one freed. (vLLM admits the groups of running adapters too, which can starve it.)
   The groups passed so (it, and every adapter group behind it) block no one on seats
   either: they could not be admitted in this step anyway. Admission keeps the block
   manager's watermark of pages free on top of the decode reservation, and reserves pages
   for each whole prompt (a window model: for the most it holds at once, below), so a
   long prompt prefilled over several steps never runs out mid-prompt; a prefix-cache hit
   counts only while no one holds it, once per group (as vLLM's free-block count: a
   shared system prompt a running request holds is no free page to wait for); a
   sequence that decodes after its prefill also needs the page of its first decode token
   free (`_admit_pages`; a beam group: the pages of its first two decode steps), lest it
   be preempted for it at once.

Priority scheduling (`scheduling_policy="priority"`, vLLM's): each group has a
`priority`, lower served first, and an `arrival`, the order `add` queued it in, which
breaks ties. The waiting queue is kept sorted by (priority, arrival): admission takes
the best waiting group first; preemption (and `commit`'s fallback) takes the running
group with the worst (priority, arrival), not the last admitted; a preempted group
re-enters the queue at its (priority, arrival) place, not at the front. A running group
is never preempted to admit a better waiting one (neither does vLLM v1): a better
request waits for pages and seats as any other does, and is first in line for them.
A group is still never overtaken by a worse one; it waits for as long as better ones
keep coming. Under "fcfs" (the default) every priority is 0, and the order is arrival
but for preempted groups, which go first.

A request is a `SequenceGroup`: one sequence; `n` samples, which fork off the prompt
(`prompt[:-1]` is prefilled once, then every sample shares its pages and feeds the
last prompt token itself, copy-on-write splitting the last partial page); or a beam
search (`atomic`), whose beams always step together. `add` refuses a group that could
not run even alone in the cache, so preemption always makes progress.

A sequence admitted without its last token (the `n` samples' parent, a readmitted
beam: `_admit_len`) may find every page of what it prefills in the prefix cache, since
a decode row computes the token after them (`BlockManager.admit(..., compute_last=False)`).
Then it has nothing to prefill and decodes in its admission step, as a prompt cached all
but its last token samples in its own: the samples fork at once and get decode rows as far
as the budget goes; readmitted beams, when every beam is cached so, get all `beam_width`
rows or none (`_decode_admitted`). Those rows need the pages their appends may take to fit
beside the decode reserve (admission counted them), which then counts them; short of
budget, the group decodes from the next step.

Asynchronous commit: `commit(plan, in_flight=True)` runs before the previous step's
tokens reach the host. A decode row whose sequence's next token is still in flight
(sampled by that step) is bound anyway: its slot is reserved with the value unknown
(`ScheduledRow.feed`: the device takes the token from the previous step's output),
and `set_tokens` gives the value to the block manager once it arrives, before the
engine appends it. A row whose sequence then turns out to have stopped on that token
computes one token for nothing; its output is ignored and its pages are freed with the
sequence (the device runs steps in order, so a later step never sees its writes).
Beam groups need the previous step's selection to bind their rows: plans with beam
rows are committed after it (the default).

Sliding window (`sliding_window=W`): `schedule()` first gives back each running
sequence's pages that hold only positions below `c - W + 1` (`BlockManager.release_before`,
`c` its computed tokens): this step's queries and all later ones sit at `>= c`, and the
page tables this step reads are taken after the release. A step still in flight may name
those pages, but it runs before any step that reuses them. A prompt does not get all its
pages on admission: a sequence holds at most `window_pages` = ceil((max(W, 2) - 2 +
max_num_batched_tokens) / page_size) + 1 pages at once (the W - 1 positions a chunk's
first query sees, then the chunk; W = 1 keeps the last page too), so admission reserves
min(that, the prompt's pages) (`BlockManager.admit(..., peak_pages=, window=W)`: only
the cached pages in the first chunk's window and one more are taken), and each chunk,
after the release, allocates its pages out of that reservation (`BlockManager.grow`).
Decode reserves and later admissions leave the reservations (`num_reserved_pages`) free;
preemption, abort and finish drop them with the sequence, a computed prompt ends its
own. `add` bounds a sequence by `window_pages`, not its length, so a cache of a few
windows serves prompts of any length. The scheduler tells the block manager the window
(`BlockManager.set_sliding_window`), so a prefix hit needs only the cached pages in the
window of the first token to compute, not those below it.

Frees requested between `schedule()` and the end of `commit()` (a sequence that
finishes, an aborted request, a dropped beam) are deferred to the end of `commit()`:
this step may still write K/V into those pages (a prefill chunk already counted as
computed and registered in the prefix cache), so they must not be handed to another
sequence of the same step.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Hashable

from pagedjax.blocks import BlockManager, OutOfPages
from pagedjax.config import is_int
from pagedjax.scheduler_pages import PagesMixin
from pagedjax.scheduler_requests import RequestsMixin
from pagedjax.sequence import ScheduledRow, SeqStatus, Sequence, SequenceGroup, StepPlan

POLICIES = ("fcfs", "priority")  # scheduling_policy's values, as vLLM's

__all__ = [
    "POLICIES",
    "Scheduler",
    "ScheduledRow",
    "SeqStatus",
    "Sequence",
    "SequenceGroup",
    "StepPlan",
]


class Scheduler(RequestsMixin, PagesMixin):
    """Continuous batching over a `BlockManager` (see the module docstring). Its calls on
    requests outside a step (`add`, `abort`, `finish`, `drop`, `fork`, `recover`) and the
    waiting queue's order are `pagedjax.scheduler_requests.RequestsMixin`'s; its page
    arithmetic (`max_pages_needed`, `window_pages`, what admitting a group takes) is
    `pagedjax.scheduler_pages.PagesMixin`'s.

    Args:
      block_manager: owns the pages; the scheduler is its only user.
      max_num_seqs: most sequences running at once (also the most rows a step).
      max_num_batched_tokens: most tokens a step feeds (decode rows plus prefill
        chunks); at least `max_num_seqs`.
      sliding_window: the model's window W (every layer); pages out of every sequence's
        window are released each step, and the block manager learns it (prefix hits).
        None: full attention, every page is kept.
      scheduling_policy: "fcfs" (first come first served) or "priority" (by each
        group's `priority`, then arrival; see the module docstring).
      max_loras: most distinct LoRA adapters (`SequenceGroup.lora_id`) running at once,
        the engine's adapter slots on the device; None: no limit. A waiting group whose
        adapter would be one too many waits in its place, while the base-model groups
        behind it are admitted (module docstring).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        sliding_window: int | None = None,
        scheduling_policy: str = "fcfs",
        max_loras: int | None = None,
    ):
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_loras", 1 if max_loras is None else max_loras),
        ):
            if not is_int(value) or value < 1:  # (numpy's ints too, as LLM's other ints)
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
        w = sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(
                f"sliding_window must be None or a positive int, got sliding_window={w!r}"
            )
        if not isinstance(scheduling_policy, str) or scheduling_policy not in POLICIES:
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy=}"
            )
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs (every running sequence "
                f"decodes each step), got {max_num_batched_tokens=} < {max_num_seqs=}"
            )
        if sliding_window is not None:  # (prefix hits then need only the window's pages)
            block_manager.set_sliding_window(sliding_window)
        self.bm = block_manager
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.sliding_window = sliding_window
        self.scheduling_policy = scheduling_policy
        self.max_loras = max_loras if max_loras is None else int(max_loras)
        # Queue order: by (priority, arrival) under "priority" (`_requeue`).
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: list[SequenceGroup] = []  # admission order
        self.num_preemptions = 0
        self._groups: dict[Hashable, SequenceGroup] = {}
        self._admissions = itertools.count()
        self._arrivals = itertools.count()
        self._open = False  # between schedule() and the end of commit()
        self._deferred: list[int] = []

    # ---------------------------------------------------------------- queries

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def get(self, request_id: Hashable) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def lora_ids(self) -> set[int]:
        """The LoRA adapters of the queued and running groups (0, none, left out)."""
        return {g.lora_id for g in self._groups.values()} - {0}

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.seqs) for g in self.running)

    # ------------------------------------------------------------ phase 1

    def schedule(self) -> StepPlan:
        """Plans the next step (phase 1); see the module docstring for the policy."""
        if self._open:
            raise RuntimeError("schedule() called twice without commit()")
        self._open = True
        bm = self.bm
        if self.sliding_window is not None:
            self._release_out_of_window()
        preempted = set()
        while True:
            cands, reserve = self._decode_candidates()
            if reserve <= bm.num_free_pages - bm.num_reserved_pages or not self.running:
                break
            victim = max(self.running, key=self._victim_rank)
            preempted.add(id(victim))
            self._preempt(victim)
        rows: list[ScheduledRow] = []
        for g, s in cands:
            if g.atomic:
                n = len(g.seqs[0].token_ids) + (1 if g.seqs[0].pending else 0) - 1
                rows += [
                    ScheduledRow(g, None, g.epoch, n, 1, True, True) for _ in range(g.num_seats)
                ]
            else:
                rows.append(ScheduledRow(g, s, g.epoch, s.num_admitted, 1, True, True))
        budget = self.max_num_batched_tokens - len(rows)
        plan = StepPlan(rows)

        # Running sequences mid-prefill, found first: a chunk changes only its own
        # sequence (and forks samples that are not among them).
        chunks = [
            (g, s)
            for g in self.running
            for s in g.seqs
            if s.num_computed < s.num_admitted and s.status is SeqStatus.RUNNING
        ]
        for g, s in chunks:
            if budget == 0:
                break
            budget -= self._prefill_chunk(plan, g, s, budget)

        if not self.waiting or budget <= 0:
            return plan
        seats = sum(g.seats for g in self.running)
        # The adapters running, where their number is limited.
        loras = set() if self.max_loras is None else {g.lora_id for g in self.running} - {0}
        i = 0  # the next waiting group to try: those before it wait for an adapter slot
        while i < len(self.waiting) and budget > 0:
            g = self.waiting[i]
            if id(g) in preempted:
                break  # (readmitting a group just preempted would only thrash)
            full = self.max_loras is not None and len(loras) >= self.max_loras
            if g.lora_id and (i > 0 or (g.lora_id not in loras and full)):
                i += 1  # waits in its place for a slot; behind it, only base-model groups
                continue  # (before the seat check: a group passed blocks no one)
            if seats + g.seats > self.max_num_seqs:
                break
            lens = [self._admit_len(g, s) for s in g.seqs]
            need = self._admit_pages(g, lens)
            if bm.num_free_pages - bm.num_reserved_pages - reserve - need < bm.watermark_pages:
                break
            del self.waiting[i]
            g.status = SeqStatus.RUNNING
            g.admit_order = next(self._admissions)
            self.running.append(g)
            seats += g.seats
            if g.lora_id:
                loras.add(g.lora_id)
            for s, n in zip(g.seqs, lens, strict=True):
                cached = bm.admit(
                    s.seq_id,
                    self._hashed(g, s, n),  # (hashed as it waited: not again)
                    cache_salt=g.cache_salt,
                    read_cache=g.read_prefix_cache,
                    peak_pages=None if self.window_pages is None else self._peak_pages(n),
                    window=self.sliding_window,
                    # A decode row feeds the rest (_admit_len): the admitted tokens may all
                    # be cached.
                    compute_last=n == len(s.token_ids),
                    count_stats=g.num_cached_tokens is None,  # (its first admission)
                    # Readmitted after preemption with its output so far: freeing it keeps
                    # its prompt's window cached, not the readmitted length's (the n
                    # samples' parent holds prompt[:-1]: all of it is prompt).
                    num_prompt_tokens=min(s.num_prompt_tokens, n),
                )
                s.status = SeqStatus.RUNNING
                s.num_admitted, s.num_computed, s.num_cached_tokens = n, cached, cached
            if g.num_cached_tokens is None:
                g.num_cached_tokens = max(s.num_cached_tokens for s in g.seqs)
            if g.forks and g.seqs[0].num_computed == g.seqs[0].num_admitted:
                self._fork_samples(g)  # prompt[:-1] was cached whole: no prefill row
                budget, reserve = self._decode_admitted(plan, g, budget, reserve)
            elif g.atomic and all(_will_decode(s) for s in g.seqs):  # beams cached whole
                budget, reserve = self._decode_admitted(plan, g, budget, reserve)
            for s in list(g.seqs):
                if budget == 0:
                    break
                if s.num_computed < s.num_admitted:
                    budget -= self._prefill_chunk(plan, g, s, budget)
        return plan

    def _release_out_of_window(self) -> None:
        """Gives back pages no query of this step or a later one reads (module docstring)."""
        bm, w = self.bm, self.sliding_window
        for g in self.running:
            for s in g.seqs:
                if s.num_admitted and (c := bm.num_computed_tokens(s.seq_id)) >= w:
                    bm.release_before(s.seq_id, c - w + 1)

    def _decode_candidates(self) -> tuple[list[tuple[SequenceGroup, Sequence | None]], int]:
        cands: list[tuple[SequenceGroup, Sequence | None]] = []
        ids = []
        reserve = 0
        for g in self.running:
            if g.atomic:
                if g.seqs and all(_will_decode(s) for s in g.seqs):
                    cands.append((g, None))
                    reserve += g.num_seats
                continue
            for s in g.seqs:
                if _will_decode(s):
                    cands.append((g, s))
                    ids.append(s.seq_id)
        return cands, reserve + self.bm.num_append_pages(ids)

    def _prefill_chunk(self, plan: StepPlan, g: SequenceGroup, s: Sequence, budget: int) -> int:
        bm = self.bm
        start = s.num_computed
        end = min(s.num_admitted, start + budget)
        bm.grow(s.seq_id, end)  # window models: pages as prefill reaches them
        row = ScheduledRow(g, s, g.epoch, start, end - start, False, False)
        row.slots = bm.slot_mapping(s.seq_id, start, end)
        row.page_row = bm.page_tables([s.seq_id])[0]
        bm.mark_computed(s.seq_id, end)
        s.num_computed = end
        if end == s.num_admitted:
            if end == len(s.token_ids):
                row.samples = True
                s.pending += 1
            elif g.forks and s is g.seqs[0]:
                self._fork_samples(g)
        plan.rows.append(row)
        plan.num_prefill_tokens += end - start
        return end - start

    def _fork_samples(self, g: SequenceGroup) -> None:
        """Forks the samples off the parent, whose `prompt[:-1]` is computed (or being
        computed by this step); each then feeds the last prompt token as a decode row."""
        parent = g.seqs[0]
        for child in g.forks:
            child.token_ids = list(parent.token_ids)
            child.page_hashes = None  # (of a list it no longer has, if any)
            self.fork(g, parent, child)
        g.forks = []

    def _decode_admitted(
        self, plan: StepPlan, g: SequenceGroup, budget: int, reserve: int
    ) -> tuple[int, int]:
        """Decode rows in this step for a group admitted with nothing to prefill: samples
        just forked (as many as the budget allows) or readmitted beams (all `num_seats`
        rows, bound to beams in `commit`, or none), if the pages their appends may take
        fit beside the decode reserve (else they decode from the next step); returns the
        budget and reserve left."""
        if g.atomic:
            if budget < g.num_seats:
                return budget, reserve
            n = g.seqs[0].num_admitted  # the position every beam feeds (equal lengths)
            rows = [ScheduledRow(g, None, g.epoch, n, 1, True, True) for _ in range(g.num_seats)]
            need = g.num_seats  # a page per row, as `_decode_candidates` reserves
        else:
            seqs = g.seqs[:budget]
            rows = [ScheduledRow(g, s, g.epoch, s.num_admitted, 1, True, True) for s in seqs]
            need = self.bm.num_append_pages([s.seq_id for s in seqs])
        if need > self.bm.num_free_pages - self.bm.num_reserved_pages - reserve:
            return budget, reserve
        i = len(plan.decode_rows)  # decode rows come first
        plan.rows[i:i] = rows
        return budget - len(rows), reserve + need

    def _preempt(self, g: SequenceGroup) -> None:
        self.running.remove(g)
        for s in g.seqs:
            self._free_now(s)
            s.status = SeqStatus.WAITING
        g.epoch += 1
        g.num_preemptions += 1
        g.status = SeqStatus.WAITING
        self._requeue(g, front=True)
        self.num_preemptions += 1

    def _free_now(self, s: Sequence) -> None:
        if s.num_admitted:
            self.bm.free(s.seq_id)
        s.num_admitted = s.num_computed = 0
        s.pending = 0

    # ------------------------------------------------------------ phase 2

    def commit(self, plan: StepPlan, *, in_flight: bool = False) -> None:
        """Appends the decode rows' tokens (phase 2), after the engine applied the
        previous step's results; fills their slots and the copies (their page tables are
        the block manager's).

        Rows whose sequence finished or was preempted meanwhile become dead. If the
        appends still run out of pages (not expected: phase 1 reserved them), the
        newest group with only decode rows in this step is preempted and the append
        retried.

        Args:
          plan: from `schedule()`.
          in_flight: the previous step's results are not applied yet (asynchronous
            commit, see the module docstring); the plan must have no beam rows.
        """
        if plan.committed:
            raise RuntimeError("plan committed twice")
        if in_flight and any(r.decode and r.group.atomic for r in plan.rows):
            raise ValueError("a plan with beam rows is committed after the previous step")
        self._bind(plan, in_flight)
        prefilling = {id(r.group) for r in plan.rows if not r.decode}
        while True:
            live = [r for r in plan.rows if r.decode and r.seq is not None]
            seqs = [r.seq for r in live]
            toks = [
                s.token_ids[s.num_admitted] if len(s.token_ids) > s.num_admitted else -1
                for s in seqs
            ]
            try:
                slots, copies = self.bm.append_tokens([s.seq_id for s in seqs], toks)
                break
            except OutOfPages:
                victims = [g for g in self.running if id(g) not in prefilling]
                if not victims:
                    raise
                victim = max(victims, key=self._victim_rank)
                self._preempt(victim)
                for r in plan.rows:
                    if r.group is victim:
                        r.seq = None
        # Each row's slot as a [1] view (iterating the [B, 1] array beats B slicings).
        for r, s, slot, t in zip(live, seqs, list(slots.reshape(-1, 1)), toks, strict=True):
            s.num_admitted += 1
            s.num_computed += 1
            s.pending += 1
            r.start = s.num_admitted - 1
            r.slots = slot
            r.feed = t < 0
        plan.copies = copies
        plan.committed = True
        self._open = False
        for sid in self._deferred:
            self.bm.free(sid)
        self._deferred.clear()

    def set_tokens(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """The previous step's sampled tokens for `seqs`, before the engine appends them
        to `token_ids`: gives the block manager those whose slot an asynchronous commit
        reserved before they were known."""
        ids, vals = [], []
        for s, t in zip(seqs, tokens, strict=True):
            if s.num_admitted == len(s.token_ids) + 1:
                ids.append(s.seq_id)
                vals.append(t)
        if ids:
            self.bm.set_tokens(ids, vals)

    def _bind(self, plan: StepPlan, in_flight: bool = False) -> None:
        """Decides each decode row's sequence now that the previous step's results are in
        (or, `in_flight`, while they are still coming: beam rows excluded)."""
        beams: dict[int, list[Sequence]] = {}
        for r in plan.rows:
            if not r.decode:
                continue
            g = r.group
            if g.epoch != r.epoch or g.status is not SeqStatus.RUNNING:
                r.seq = None
            elif g.atomic:
                todo = beams.setdefault(id(g), [s for s in g.seqs if s._ready()])
                r.seq = todo.pop(0) if todo else None
            elif r.seq is not None and not r.seq._ready(in_flight):
                r.seq = None


def _will_decode(s: Sequence) -> bool:
    """Whether `s` feeds one token next step: its next token is known or in flight."""
    if s.status is not SeqStatus.RUNNING or s.num_computed != s.num_admitted:
        return False
    if s.pending:
        return len(s.token_ids) + 1 < s.max_num_tokens
    return len(s.token_ids) == s.num_admitted + 1
