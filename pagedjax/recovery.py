"""What the engine checks when a step fails, to make itself usable again.

`EngineCore.step` catches any exception escaping a step (a compile error, device OOM,
KeyboardInterrupt, a callback's), aborts or requeues the requests
(`Scheduler.recover`), and then needs two facts, computed here: whether the KV cache
survived (`cache_lost`: a call that failed may have taken the donated cache with it,
or left an output that fails on the device), and which prefix-cache pages hold no K/V
after all (`unwritten_pages`: `schedule` and `commit` register the pages a step will
write before it is dispatched). `note` is what the engine adds to the exception.
"""

from __future__ import annotations

import jax

from pagedjax.blocks import BlockManager
from pagedjax.sequence import StepPlan

__all__ = ["cache_lost", "note", "unwritten_pages"]


def unwritten_pages(plan: StepPlan | None, bm: BlockManager, page_size: int) -> list[int] | None:
    """The pages an undispatched step was to write K/V into (None: all pages, when
    `schedule()` itself failed): its prefill rows' slots, and the last page of each
    decode row's sequence (`commit` appends there; it may have been interrupted before
    giving the row its slot). Not that page where the append has not happened and
    would open a new page (the row's position `start` is the sequence's length and a
    page boundary): it is full of K/V earlier steps wrote, and stays cached."""
    if plan is None:
        return None
    pages = set()
    for r in plan.rows:
        if r.slots is not None:
            pages.update(int(x) // page_size for x in r.slots if x >= 0)
        if r.decode and r.seq is not None and r.seq.seq_id in bm:
            sid = r.seq.seq_id
            if r.slots is None and r.start % page_size == 0 and bm.num_tokens(sid) == r.start:
                continue
            pages.update(bm.page_table(sid)[-1:])
    return sorted(pages)


def cache_lost(cache) -> bool:
    """Whether the KV cache is unusable: donated to a call that failed (deleted), or the
    output of a step that failed on the device."""
    leaves = jax.tree.leaves(cache)
    if any(x.is_deleted() for x in leaves):
        return True
    try:
        jax.block_until_ready(leaves)
    except Exception:
        return True
    return False


def note(aborted: list[str], waiting: int, lost: bool) -> str:
    """The line added to the exception once the engine recovered."""
    return (
        f"pagedjax: the engine recovered: aborted {len(aborted)} request(s) {aborted[:8]}"
        + ("..." if len(aborted) > 8 else "")
        + (f"; {waiting} other(s) still queued" if waiting else "")
        + ("; the KV cache was re-created and the prefix cache cleared" if lost else "")
    )
