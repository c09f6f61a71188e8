"""Review 29 of the block manager: `admit_pages` counts what `admit` takes out of the
unreserved free pages, reservations (`peak_pages`) included."""

import pytest
from block_machine import snapshot

from pagedjax.blocks import BlockManager, OutOfPages

PS = 4
PROMPT = list(range(100, 112))  # 12 tokens: 3 full pages


def unreserved(bm: BlockManager) -> int:
    return bm.num_free_pages - bm.num_reserved_pages


def test_admit_pages_counts_a_hit_that_only_reserving_sequences_hold():
    """A hit on pages that only a sequence admitted with ``peak_pages`` holds takes them
    out of its reservation: ``admit`` needs a free page for each, as for a new page.
    ``admit_pages`` counted them as free of cost (held: no evictable page taken), so a
    caller that checked it against the unreserved pages (as the scheduler does) got
    ``OutOfPages`` from the admission it had just cleared (1 page counted, 3 taken)."""
    bm = BlockManager(10, PS, watermark=0)
    bm.admit("a", PROMPT)
    bm.mark_computed("a", len(PROMPT))
    bm.free("a")  # 3 cached pages, evictable
    assert bm.admit("b", PROMPT, peak_pages=4) == 8  # holds the 2 hits, reserves 4
    prompt = PROMPT[:8] + [7]  # hits the 2 pages only "b" holds, and 1 new page
    need = bm.admit_pages([(prompt, True), (prompt, True)])
    assert need == 2 + 2  # a new page each, the 2 shared hits once
    before = unreserved(bm)
    bm.admit("c", prompt)
    bm.admit("d", prompt)
    assert before - unreserved(bm) == need
    bm.check_invariants()


def test_admit_pages_fits_exactly_where_admit_does():
    """With the count at the unreserved pages exactly, the admission succeeds; one page
    fewer and it is refused as ``admit_pages`` says (nothing changed)."""
    bm = BlockManager(7, PS, watermark=0)
    bm.admit("a", PROMPT)
    bm.mark_computed("a", len(PROMPT))
    bm.free("a")
    bm.admit("b", PROMPT, peak_pages=4)
    prompt = PROMPT[:8] + [7, 8, 9, 10, 11]  # 2 hits, 2 new pages
    assert bm.admit_pages([(prompt, True)]) == 4 > unreserved(bm) == 3
    before = snapshot(bm)
    with pytest.raises(OutOfPages):
        bm.admit("c", prompt)
    assert snapshot(bm) == before
    bm.free("b")  # its reservation goes: the 2 hits are evictable again
    assert bm.admit_pages([(prompt, True)]) == 4 <= unreserved(bm)
    bm.admit("c", prompt)
    bm.check_invariants()
