"""pagedjax.recovery, reviewed: which prefix-cache pages a failed step's recovery drops,
and a failure while the host builds a step's input.

A decode row's append writes the page holding its position; when that position opens a
new page (the sequence's pages are all full) and the step failed before the append,
the last page holds K/V earlier steps wrote and stays cached. Failures are injected as
tests/test_engine_recovery.py does, in its geometry (shared compiled programs).
"""

import jax
import params_helpers
import pytest
from test_engine_recovery import GEOMETRY, PREFIX, PROMPTS, PS, SPS, TINY, Injected, tokens

from pagedjax import batch
from pagedjax.blocks import BlockManager
from pagedjax.engine import LLM
from pagedjax.recovery import unwritten_pages
from pagedjax.sequence import ScheduledRow, Sequence, StepPlan


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


def decode_row(bm: BlockManager, seq_id: int) -> ScheduledRow:
    """A decode row as `schedule()` makes it: its position is the sequence's length."""
    n = bm.num_tokens(seq_id)
    seq = Sequence(seq_id, list(range(3, 3 + n)), n, 64)
    return ScheduledRow(None, seq, 0, n, 1, True, True)


def test_a_decode_row_not_appended_keeps_its_full_last_page():
    bm = BlockManager(16, 4)
    bm.admit(0, list(range(3, 11)))  # 8 tokens: two full pages, cached once computed
    bm.mark_computed(0, 8)
    bm.admit(1, list(range(20, 26)))  # 6 tokens: a partial last page
    bm.mark_computed(1, 6)
    full, partial = decode_row(bm, 0), decode_row(bm, 1)
    plan = StepPlan([full, partial])
    # Before commit's append: row 0 would open a new page; row 1 writes its last page.
    assert unwritten_pages(plan, bm, 4) == [bm.page_table(1)[-1]]
    bm.append_tokens([0, 1], [11, 26])  # the append, interrupted before the slots
    assert unwritten_pages(plan, bm, 4) == sorted([bm.page_table(0)[-1], bm.page_table(1)[-1]])


def test_a_failed_apply_in_sync_mode_keeps_the_pages_the_prompt_wrote(params):
    """The prompt fills two pages; its first token's `on_token` raises while the next
    step (its decode row, not appended yet) waits: both prompt pages stay cached and
    serve a later prompt, with a fresh engine's tokens. (Recovery used to drop the
    decode row's last page, here the prompt's second.)"""
    llm = LLM(params, async_scheduling=False, **GEOMETRY)

    def on_token(rid, index, tok):
        raise Injected("from on_token")

    with pytest.raises(Injected):
        llm.generate([PREFIX], SPS[0], on_token=on_token)
    bm = llm.block_manager
    bm.check_invariants()
    assert bm.stats().num_used_pages == 0 and bm.stats().num_cached_pages == 2
    later = PREFIX + [5, 6, 7]
    (got,) = llm.generate([later], SPS[0])
    assert got.num_cached_tokens == 2 * PS
    assert tokens([got]) == tokens(LLM(params, **GEOMETRY).generate([later], SPS[0]))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ctrl_c_while_building_a_step_keeps_the_other_requests_whole(params, async_scheduling):
    """A Ctrl-C while the host packs a step's input (`StepBatch.finish`; under async
    scheduling the previous step is in flight, its decode rows committed): generate's
    request is aborted, add_request's are recomputed with a fresh engine's tokens, and
    no page leaks."""
    want = tokens(LLM(params, **GEOMETRY).generate(PROMPTS[1:], SPS[1:]))
    llm = LLM(params, async_scheduling=async_scheduling, **GEOMETRY)
    others = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[1:], SPS[1:], strict=True)]
    real, calls = batch.StepBatch.finish, []

    def finish(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch.StepBatch, "finish", finish)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:1], SPS[:1])
    assert [g.request_id for g in llm.scheduler.waiting] == others
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step())
    assert tokens([done[i] for i in others]) == want
    llm.block_manager.check_invariants()
    st = llm.block_manager.stats()
    assert st.num_used_pages == 0 and st.num_seqs == 0
    assert not any(x.is_deleted() for x in jax.tree.leaves(llm.cache))
