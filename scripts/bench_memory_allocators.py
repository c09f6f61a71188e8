"""The KV allocation policies that scripts/bench_memory.py replays a workload against:
`MaxLen` (contiguous-maxlen), `FirstFit` (contiguous-firstfit) and `Paged` (paged-S and
paged-S+prefix, the real `pagedjax.blocks.BlockManager`), and `Seq`, a running request.

bench_memory.py's docstring says what each policy does and what the replay measures;
this module holds the policies alone because they are the part under study, each a
small state machine behind one interface that the replay calls every step:

- `admit(seq, num_running) -> bool`: take the queue head, if the policy can hold it now;
- `grow(running) -> running`: make room for one more token of each running sequence,
  returning those that advance (the paged policy may stall some);
- `release(seq)`: free a finished (or preempted) sequence;
- `reserved()`, `live(running, logical)`: slots allocated to running sequences, and
  those holding a token;
- `fragmented_free(head)`: free slots the head cannot use for lack of one hole
  (`FirstFit` alone has holes, and `num_holes()`).

bench_memory.py re-exports every name here.
"""

from __future__ import annotations

import bisect
import dataclasses

import workloads

from pagedjax.blocks import BlockManager


@dataclasses.dataclass(slots=True)
class Seq:
    """A running request: its tokens so far and its allocation handle."""

    req: workloads.Request
    num_tokens: int  # prompt + appended outputs
    appended: int = 0  # output tokens appended
    start: int = 0  # first-fit arena offset


class MaxLen:
    """Contiguous preallocation: `max_seq_len` slots per sequence."""

    def __init__(self, budget: int, max_seq_len: int):
        self.name, self.page_size, self.prefix = "contiguous-maxlen", None, False
        self.slots, self.max_seq_len = budget // max_seq_len, max_seq_len
        self.used = 0

    def admit(self, seq: Seq, num_running: int) -> bool:
        if self.used == self.slots:
            return False
        self.used += 1
        return True

    def grow(self, running: list[Seq]) -> list[Seq]:
        return running

    def release(self, seq: Seq) -> None:
        self.used -= 1

    def reserved(self) -> int:
        return self.used * self.max_seq_len

    def live(self, running: list[Seq], logical: int) -> int:
        return logical

    def fragmented_free(self, head: workloads.Request) -> int:
        return 0


class FirstFit:
    """Contiguous exact-size allocation, first-fit in one arena of `budget` slots."""

    def __init__(self, budget: int):
        self.name, self.page_size, self.prefix = "contiguous-firstfit", None, False
        self.budget = budget
        self.starts = [0]  # sorted hole starts
        self.sizes = {0: budget}  # hole start -> size
        self.free = budget

    def admit(self, seq: Seq, num_running: int) -> bool:
        need = seq.req.total_len
        if need > self.free:
            return False
        for s in self.starts:
            size = self.sizes[s]
            if size >= need:
                i = bisect.bisect_left(self.starts, s)
                del self.starts[i], self.sizes[s]
                if size > need:
                    self.starts.insert(i, s + need)
                    self.sizes[s + need] = size - need
                seq.start = s
                self.free -= need
                return True
        return False

    def grow(self, running: list[Seq]) -> list[Seq]:
        return running

    def release(self, seq: Seq) -> None:
        start, size = seq.start, seq.req.total_len
        self.free += size
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.starts) and self.starts[i] == start + size:  # merge the next hole
            size += self.sizes.pop(self.starts.pop(i))
        if i > 0 and self.starts[i - 1] + self.sizes[self.starts[i - 1]] == start:
            self.sizes[self.starts[i - 1]] += size  # merge into the previous hole
        else:
            self.starts.insert(i, start)
            self.sizes[start] = size

    def reserved(self) -> int:
        return self.budget - self.free

    def live(self, running: list[Seq], logical: int) -> int:
        return logical

    def fragmented_free(self, head: workloads.Request) -> int:
        fits_total = head.total_len <= self.free
        fits_hole = any(size >= head.total_len for size in self.sizes.values())
        return self.free if fits_total and not fits_hole else 0

    def num_holes(self) -> int:
        return len(self.starts)


class Paged:
    """The real BlockManager with `budget // page_size` pages."""

    def __init__(
        self,
        budget: int,
        page_size: int,
        prefix: bool,
        *,
        watermark: float,
        horizon: int,
        max_len: int,
    ):
        self.name = f"paged-{page_size}" + ("+prefix" if prefix else "")
        self.page_size, self.prefix = page_size, prefix
        self.horizon = horizon
        self.bm = BlockManager(
            budget // page_size,
            page_size,
            enable_prefix_caching=prefix,
            max_model_len=max_len,
            watermark=watermark,
        )
        self.stalls = 0

    def admit(self, seq: Seq, num_running: int) -> bool:
        req, bm, ps = seq.req, self.bm, self.page_size
        if not bm.can_admit(req.prompt_len):
            return False
        # Growth reserve: the pages the running batch (this request included) needs on
        # average to decode `horizon` more tokens each, beyond the fixed watermark.
        reserve = -(-(num_running + 1) * self.horizon // ps)
        if bm.num_free_pages - -(-req.prompt_len // ps) < bm.watermark_pages + reserve:
            return False
        self.bm.admit(req.rid, req.prompt)
        self.bm.mark_computed(req.rid, req.prompt_len)
        return True

    def grow(self, running: list[Seq]) -> list[Seq]:
        if not running:
            return running
        bm, ps = self.bm, self.page_size
        ids = [s.req.rid for s in running]
        if bm.num_append_pages(ids) > bm.num_free_pages:
            # Not enough pages for everyone: sequences with room in their last page go
            # on, then the oldest of those needing a page while pages last.
            free = bm.num_free_pages
            go = []
            for s in running:
                if s.num_tokens % ps:
                    go.append(s)
                elif free:
                    free -= 1
                    go.append(s)
            self.stalls += len(running) - len(go)
            running = go
            ids = [s.req.rid for s in running]
            if not running:
                return running
        bm.append_tokens(ids, [int(s.req.output[s.appended]) for s in running])
        return running

    def release(self, seq: Seq) -> None:
        self.bm.free(seq.req.rid)

    def reserved(self) -> int:
        return (self.bm.num_pages - self.bm.num_free_pages) * self.page_size

    def live(self, running: list[Seq], logical: int) -> int:
        # Only a sequence's last page can be partly empty, and it is never shared here
        # (prefix hits are full pages; nothing forks), so shared pages are all full.
        ps = self.page_size
        return self.reserved() - sum(-s.num_tokens % ps for s in running)

    def fragmented_free(self, head: workloads.Request) -> int:
        return 0
