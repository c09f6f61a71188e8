"""pagedjax.scheduler: admission counts the pages a group's admits really take.

With the simulated device of tests/test_scheduler.py (`Sim`): a request whose prompt
starts with pages another running request holds (a shared system prompt) takes none of
them, and readmitted samples of one request share their cached prompt pages, so neither
waits for free pages it will not take (as beams already did; vLLM counts a hit as a
free block only while no request holds it).
"""

import pytest
from test_scheduler import PS, Sim, reference

from pagedjax.scheduler import SeqStatus

SYSTEM = list(range(3, 3 + 10 * PS))  # 10 full pages


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_a_prompt_hitting_pages_a_running_request_holds_is_admitted_beside_it(in_flight):
    """16 pages: `a` holds the 10 system pages and 1 more, 5 are free; `b` (the system
    prompt and 1 token) takes 1 new page and its first decode token's slot is in it. It
    was counted 11 pages and waited 20 steps for `a` to finish."""
    sim = Sim(num_pages=16, budget=64, in_flight=in_flight)
    sim.add("a", [*SYSTEM, 50], 20)
    sim.step()
    b = sim.add("b", [*SYSTEM, 60], 3)
    plan = sim.step()
    assert b.status is SeqStatus.RUNNING and b.num_cached_tokens == len(SYSTEM)
    assert [(r.group.request_id, r.decode, r.num_tokens) for r in plan.rows] == [
        ("a", True, 1),
        ("b", False, 1),
    ]
    sim.run()
    assert sim.sched.num_preemptions == 0 and sim.bm.stats().num_used_pages == 0
    assert sim.done["a"].finished[0].token_ids == reference([*SYSTEM, 50], 20)
    assert sim.done["b"].finished[0].token_ids == reference([*SYSTEM, 60], 3)


def test_a_prompt_ending_on_a_page_still_counts_its_first_decode_page():
    """`b` is the system prompt and one more page of its own: the page its first decode
    token takes is counted beside that one (2 pages); with 1 free it waits."""
    for num_pages, admitted in ((13, True), (12, False)):
        sim = Sim(num_pages=num_pages, budget=64)
        sim.add("a", [*SYSTEM, 50], 4)  # 11 pages, which all its tokens fit in
        sim.step()
        b = sim.add("b", [*SYSTEM, *range(60, 60 + PS)], 3)
        sim.step()
        assert (b.status is SeqStatus.RUNNING) == admitted, num_pages
        sim.run()
        assert sim.sched.num_preemptions == 0 and set(sim.done) == {"a", "b"}


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
def test_readmitted_samples_take_the_pages_a_running_request_holds_once(in_flight):
    """3 samples of the system prompt beside a request that holds it: preempted by its
    growth, they come back while it runs, their prompt pages taken from it (they were
    counted once per sample, 3 x 8 pages, the whole cache, and waited for it to finish)."""
    system = SYSTEM[: 5 * PS]
    sim = Sim(num_pages=24, max_num_seqs=4, budget=64, in_flight=in_flight)
    sim.add("hog", [*system, *range(60, 90)], 30)  # 13 pages, then up to 20
    sim.step()
    samples = sim.add("n3", [*system, 50], 10, n=3)
    while samples.num_preemptions == 0:
        assert "hog" not in sim.done, "no preemption"
        sim.step()
    sim.step()
    assert samples.status is SeqStatus.RUNNING and "hog" not in sim.done
    sim.run()
    assert sim.bm.stats().num_used_pages == 0
    assert sim.done["hog"].finished[0].token_ids == reference([*system, *range(60, 90)], 30)
    for s in sim.done["n3"].finished:
        assert s.token_ids == reference([*system, 50], 10)
