"""The scheduler's request side: what the engine does to a request outside a step's
`schedule()` and `commit()`, and the order of the waiting queue.

`Scheduler` (`pagedjax.scheduler`) inherits these from `RequestsMixin`, and keeps the
step itself (decode reservation, preemption, prefill chunks, admission, binding rows).
Here: queueing a request, after the checks that it could ever run (`add`,
`check_seats`, `check_priority`); removing it (`abort`); ending, dropping or forking
its sequences as the engine applies a step's results (`finish`, `drop`, `fork`); and
starting over after a failed step (`recover`). Frees requested while a step is open
are deferred to the end of its `commit()` (`_free`; the scheduler module's docstring
says why). The queue order under each `scheduling_policy` is here too: where a queued
or preempted group goes (`_requeue`), and which running group is preempted first
(`_victim_rank`).
"""

from __future__ import annotations

import bisect
import collections
import numbers
from collections.abc import Callable, Hashable

from pagedjax.sequence import SeqStatus, Sequence, SequenceGroup

__all__ = ["RequestsMixin"]


class RequestsMixin:
    """`Scheduler`'s calls on requests and its queue order (`pagedjax.scheduler.Scheduler`
    inherits them; see the module docstring). They work on the state `Scheduler.__init__`
    sets up: the block manager `bm`, `waiting`, `running`, `_groups`, the arrival counter,
    the open step (`_open`, `_deferred`), the limits and the policy; and on its
    `max_pages_needed` and `window_pages`.
    """

    def add(self, group: SequenceGroup) -> None:
        """Queues a request; raises ValueError if it could never run (seats or pages)."""
        if group.request_id in self._groups:
            raise ValueError(f"request id {group.request_id!r} is already queued or running")
        if not group.seqs:
            raise ValueError(f"request {group.request_id!r} has no sequences")
        group.priority = self.check_priority(group.priority, group.request_id)
        self.check_seats(max(group.seats, group.num_seats), group.request_id)
        need = self.max_pages_needed(group)
        have = self.bm.num_pages - self.bm.watermark_pages
        if need > have:
            w = self.sliding_window
            held = (
                ""
                if w is None
                else f", each holding at most {self.window_pages} pages under the window of {w} "
                f"tokens prefilled {self.max_num_batched_tokens} a step"
            )
            raise ValueError(
                f"request {group.request_id!r} may need {need} KV pages ({group.num_seats} "
                f"sequences of up to {max(s.max_num_tokens for s in group.seqs)} tokens{held}), "
                f"more than the {have} the cache can give; raise num_pages or lower max_tokens "
                "(max_tokens=None runs each sequence up to max_model_len)"
            )
        group.status = SeqStatus.WAITING
        group.arrival = next(self._arrivals)
        self._requeue(group)
        self._groups[group.request_id] = group

    def check_seats(self, seats: int, request_id: Hashable = None, why: str = "") -> None:
        """Raises ValueError if a request running `seats` sequences at once (`why`: what
        asks for them) could never be scheduled."""
        if seats > self.max_num_seqs:
            name = "request" if request_id is None else f"request {request_id!r}"
            raise ValueError(
                f"{name} runs {seats} sequences at once{why}, more than "
                f"max_num_seqs={self.max_num_seqs}"
            )

    def check_priority(self, priority, request_id: Hashable = None) -> int:
        """`priority` as an int; raises ValueError unless it is one (a bool is not), or
        if it is not 0 under "fcfs" (as vLLM refuses it)."""
        name = "" if request_id is None else f"request {request_id!r}: "
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"{name}priority must be an int, got priority={priority!r:.80}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"{name}got priority={priority} but priority scheduling is not enabled "
                f"(scheduling_policy={self.scheduling_policy!r}; 'priority' enables it)"
            )
        return int(priority)

    def abort(self, request_id: Hashable) -> SequenceGroup | None:
        """Removes a request wherever it is and frees its pages; returns it (or None)."""
        g = self._groups.pop(request_id, None)
        if g is None:
            return None
        if g in self.running:
            self.running.remove(g)
        elif g in self.waiting:
            self.waiting.remove(g)
        for s in g.seqs:
            self._free(s)
            s.status = SeqStatus.FINISHED
        g.epoch += 1
        g.status = SeqStatus.FINISHED
        return g

    def finish(self, group: SequenceGroup, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Ends one sequence (stop or length); the group ends with its last sequence."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        group.finished.append(seq)
        self.drop(group, seq)

    def drop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Removes a sequence from its group without output (a beam that lost)."""
        group.seqs.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        if group.done:
            self._retire(group)

    def fork(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """Adds `child` sharing every page of the running, fully computed `parent`."""
        self.bm.fork(parent.seq_id, child.seq_id)
        child.status = SeqStatus.RUNNING
        child.num_admitted, child.num_computed = parent.num_admitted, parent.num_computed
        group.seqs.append(child)

    def recover(self, keep: Callable[[SequenceGroup], bool] | None = None) -> list[SequenceGroup]:
        """Starts over after a step failed anywhere between `schedule()` and applying its
        results (the engine's recovery): no step is open, the block manager holds no
        sequence (`BlockManager.free_all`), and every request is aborted except those
        `keep` accepts, which wait again (running ones preempted: recomputed on
        readmission; under "fcfs" running ones first, in admission order, then the
        waiting ones in queue order; under "priority" all by (priority, arrival), where
        a preemption puts each).

        Returns:
          The aborted groups (their sequences FINISHED, in their `seqs`, as `abort` leaves
          them).
        """
        self.bm.free_all()
        self._open = False
        self._deferred.clear()
        order = [*self.running, *(g for g in self.waiting if g not in self.running)]
        order += [g for g in self._groups.values() if g not in order]  # none, unless a bug
        was_running = {id(g) for g in self.running}
        self.running, self.waiting = [], collections.deque()
        aborted = []
        for g in order:
            g.epoch += 1
            for s in g.seqs:
                s.num_admitted = s.num_computed = s.pending = 0
            if keep is not None and keep(g):
                for s in g.seqs:
                    s.status = SeqStatus.WAITING
                g.status = SeqStatus.WAITING
                if id(g) in was_running:
                    g.num_preemptions += 1
                    self.num_preemptions += 1
                self._requeue(g)
            else:
                for s in g.seqs:
                    s.status = SeqStatus.FINISHED
                g.status = SeqStatus.FINISHED
                self._groups.pop(g.request_id, None)
                aborted.append(g)
        return aborted

    def _retire(self, group: SequenceGroup) -> None:
        group.status = SeqStatus.FINISHED
        if self._groups.get(group.request_id) is group:  # (not a new request of its id)
            del self._groups[group.request_id]
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)

    def _free(self, seq: Sequence) -> None:
        if seq.num_admitted:
            if self._open:
                self._deferred.append(seq.seq_id)
            else:
                self.bm.free(seq.seq_id)
        seq.num_admitted = seq.num_computed = 0
        seq.pending = False

    # ------------------------------------------------------- queue order

    def _requeue(self, g: SequenceGroup, *, front: bool = False) -> None:
        """Puts `g` in the waiting queue: under "priority" at its (priority, arrival)
        place (after its equals: none has its arrival), else at the back (`front`: at the
        front, a preempted group)."""
        if self.scheduling_policy == "priority":
            i = bisect.bisect_right(self.waiting, _rank(g), key=_rank)
            self.waiting.insert(i, g)
        elif front:
            self.waiting.appendleft(g)
        else:
            self.waiting.append(g)

    def _victim_rank(self, g: SequenceGroup):
        """The running group preempted first has the highest: the last admitted under
        "fcfs", the worst (priority, arrival) under "priority"."""
        return _rank(g) if self.scheduling_policy == "priority" else g.admit_order


def _rank(g: SequenceGroup) -> tuple[int, int]:
    """A group's place under priority scheduling: lower is served first."""
    return g.priority, g.arrival
