"""The records a step is planned with: sequences, their groups, a step's rows.

`Sequence` is one token stream (prompt plus generated tokens) and its bookkeeping;
`SequenceGroup` is a request's sequences (one, `n` samples, or a beam search), which
are admitted, preempted and aborted together; a `StepPlan` is what one step runs, one
`ScheduledRow` per sequence. `pagedjax.scheduler` creates and updates them (its module
docstring has the policy); the engine and `pagedjax.outputs` read them. Host state
only: no jax arrays.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable
from typing import Any

import numpy as np

__all__ = ["ScheduledRow", "SeqStatus", "Sequence", "SequenceGroup", "StepPlan"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(slots=True, eq=False)
class Sequence:
    """One token stream: the prompt plus what has been generated for it.

    Attributes:
      seq_id: id in the block manager (unique per engine).
      token_ids: prompt and generated tokens, all known to the host.
      num_prompt_tokens: leading prompt tokens in `token_ids`.
      max_num_tokens: the sequence finishes ("length") at this many tokens.
      index: completion index within its request.
      seed: sampling seed of this completion.
      num_admitted: tokens the block manager holds for it (0 while waiting).
      num_computed: of those, tokens whose K/V is on the device or being written by a
        dispatched step.
      num_cached_tokens: prefix-cache hit of its last admission.
      pending: dispatched steps sampling its next tokens, not yet in `token_ids` (2 when
        an asynchronous commit fed the first of them to the next step).
      logprobs: per generated token, {token id: logprob} (the engine's, when the request
        asked for logprobs; else None).
      page_hashes: the prefix-cache hashes of `token_ids`' full pages
        (`pagedjax.page_hashes.PageHashes`), which the scheduler keeps here while the
        sequence waits and runs, so that they are computed once, not on every step it
        waits for pages nor again when it is admitted (None: none yet). They hold while
        `token_ids` grows by appending; a list assigned anew gets new ones (the scheduler
        sees the new list), and one edited in place otherwise must reset this to None.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_num_tokens: int
    index: int = 0
    seed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_admitted: int = 0
    num_computed: int = 0
    num_cached_tokens: int = 0
    pending: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_pos: int = -1  # where the stop string starts in the text (stop_reason a str)
    detok: Any = None  # the engine's incremental detokenizer, if any
    history: Any = None  # penalised requests: token_ids as numpy (batch.TokenHistory)
    guide_state: int | None = None  # structured outputs: its guide's state after token_ids
    page_hashes: Any = None  # page_hashes.PageHashes of token_ids (the scheduler's)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def _ready(self, in_flight: bool = False) -> bool:
        """Fully computed with one token left to feed: known, or (`in_flight`) being
        sampled by the step on the device."""
        if self.status is not SeqStatus.RUNNING or self.num_computed != self.num_admitted:
            return False
        left = self.num_admitted - len(self.token_ids)
        return left == -1 or (in_flight and left == 0 and self.pending > 0)


@dataclasses.dataclass(slots=True, eq=False)
class SequenceGroup:
    """A request's sequences, admitted, preempted and aborted together.

    Attributes:
      request_id: the request's id.
      seqs: its live (unfinished) sequences.
      num_seats: how many sequences it may run at once (n, or the beam width); counted
        against `max_num_seqs`.
      cache_salt: prefix-cache salt of all its sequences.
      atomic: beam search: all sequences step together, `num_seats` decode rows a step.
      forks: samples still to fork off `seqs[0]` once `prompt[:-1]` is prefilled.
      request: the engine's object for this request (opaque here).
      epoch: bumped on preemption and abort; results of older steps are stale.
      finished: sequences that finished, in finishing order.
      read_prefix_cache: admission reuses prefix-cache pages (False while the engine
        needs logits at every prompt token: prompt logprobs).
      num_cached_tokens: prompt tokens its first admission read from the prefix cache
        (the most of its sequences'); None before it. A readmission after preemption
        reads back the request's own pages, generated tokens too, and does not count.
      priority: under priority scheduling, lower is served first (vLLM's); 0 otherwise.
      arrival: the order `Scheduler.add` queued it in (ties of priority go by it); -1
        before. `admit_order` is the order of its last admission instead.
      lora_id: the LoRA adapter it runs with (`LoRARequest.lora_int_id`; 0: none).
    """

    request_id: Hashable
    seqs: list[Sequence]
    num_seats: int = 1
    cache_salt: str | None = None
    atomic: bool = False
    forks: list[Sequence] = dataclasses.field(default_factory=list)
    request: Any = None
    epoch: int = 0
    status: SeqStatus = SeqStatus.WAITING
    admit_order: int = -1
    num_preemptions: int = 0
    finished: list[Sequence] = dataclasses.field(default_factory=list)
    read_prefix_cache: bool = True
    num_cached_tokens: int | None = None
    priority: int = 0
    arrival: int = -1
    lora_id: int = 0

    @property
    def seats(self) -> int:
        return self.num_seats if self.atomic else len(self.seqs) + len(self.forks)

    @property
    def done(self) -> bool:
        return not self.seqs and not self.forks


@dataclasses.dataclass(slots=True, eq=False)
class ScheduledRow:
    """One sequence's share of a step.

    Prefill rows are complete after `schedule()`; decode rows get their sequence (beam
    rows) and slot in `commit()`, and read their page table from the block manager
    (`page_row` stays None). A decode row left with `seq is None`
    after `commit()` is dead: its sequence finished or was preempted meanwhile; it
    writes nothing (slot -1) and its output is ignored.
    """

    group: SequenceGroup
    seq: Sequence | None
    epoch: int
    start: int  # position of the first token fed
    num_tokens: int
    decode: bool  # one token, appended in commit()
    samples: bool  # the row's output is the sequence's next token (or beam top-k)
    slots: np.ndarray | None = None  # [num_tokens] int32
    page_row: np.ndarray | None = None  # [pages] int32, prefill rows
    feed: bool = False  # its token comes from the previous step's output (in_flight commit)

    @property
    def live(self) -> bool:
        return self.seq is not None and self.group.epoch == self.epoch


@dataclasses.dataclass(slots=True, eq=False)
class StepPlan:
    """What one step runs: rows in order, then (after commit) copy-on-write copies."""

    rows: list[ScheduledRow]
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    num_prefill_tokens: int = 0
    committed: bool = False

    @property
    def decode_rows(self) -> list[ScheduledRow]:
        return [r for r in self.rows if r.decode]
