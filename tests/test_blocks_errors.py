"""pagedjax.blocks' errors: a bad config or call raises the error that names it
(`InvalidArgument`, `InvalidState`, `OutOfPages`, `SequenceExists`, `SequenceFreed`,
`UnknownSequence`) and changes nothing (`snapshot` of tests/block_machine.py before and
after); tokens appended before their value is known refuse what needs the value; running
out of pages is all or nothing across a batch and names the reserved pages."""

import numpy as np
import pytest
from block_machine import snapshot
from blocks_helpers import computed, prompt

from pagedjax.blocks import (
    BlockManager,
    BlockManagerError,
    InvalidArgument,
    InvalidState,
    OutOfPages,
    SequenceExists,
    SequenceFreed,
    UnknownSequence,
)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_pages=0, page_size=4), "num_pages=0"),
        (dict(num_pages=8, page_size=0), "page_size=0"),
        (dict(num_pages=-1, page_size=4), "num_pages=-1"),
        (dict(num_pages=8.0, page_size=4), "num_pages=8.0"),
        (dict(num_pages=8, page_size=4, watermark=1.0), "watermark=1.0"),
        (dict(num_pages=8, page_size=4, max_model_len=0), "max_model_len=0"),
        (dict(num_pages=2**30, page_size=4), "overflow"),
        (dict(num_pages=8, page_size=4, max_model_len=True), "max_model_len=True"),
        (dict(num_pages=8, page_size=4, watermark="0.1"), "watermark='0.1'"),
        (dict(num_pages=8, page_size=4, enable_prefix_caching="no"), "caching='no'"),
        (dict(num_pages=np.bool_(True), page_size=4), "num_pages=.*True"),
        # numpy ints become Python ints first: int32 arithmetic would wrap past the check
        (dict(num_pages=np.int32(2**30), page_size=np.int32(4)), "overflow"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        BlockManager(**kwargs)


def test_numpy_integers_are_counts_too():
    # Sizes and admit's peak_pages/window take numpy integers, as every position does.
    bm = BlockManager(np.int64(8), np.int32(4), max_model_len=np.int16(16))
    assert type(bm.num_pages) is int and type(bm.page_size) is int
    bm.admit("a", prompt(6), peak_pages=np.int64(3), window=np.int32(5))
    assert bm.num_free_pages == 7  # one page now, two more promised
    with pytest.raises(OutOfPages):  # 7 free less 2 promised
        bm.admit("c", prompt(6), peak_pages=np.int64(6))
    with pytest.raises(InvalidArgument, match=r"peak_pages=np.int64\(0\)"):
        bm.admit("b", prompt(6), peak_pages=np.int64(0))
    bm.check_invariants()


BIG = (InvalidArgument, r"< 2\*\*63 \(int64\), got (9223372036854775808|1844674407370955161[56])")


def scenario():
    bm = BlockManager(8, 4, max_model_len=12)
    computed(bm, "done", prompt(6))
    bm.free("done")
    computed(bm, "run", prompt(5))
    bm.admit("pre", prompt(7))  # mid-prefill
    bm.mark_computed("pre", 4)
    computed(bm, "full", prompt(12))
    return bm


BAD_CALLS = [
    (lambda bm: bm.free("done"), SequenceFreed, "already freed"),
    (lambda bm: bm.free("nope"), UnknownSequence, "unknown sequence 'nope'"),
    (lambda bm: bm.fork("nope", "x"), UnknownSequence, "nope"),
    (lambda bm: bm.fork("done", "x"), SequenceFreed, "done"),
    (lambda bm: bm.fork("run", "pre"), SequenceExists, "fork into 'pre'"),
    (lambda bm: bm.fork("pre", "x"), InvalidState, "'pre' mid-prefill"),
    (lambda bm: bm.append_token("done", 1), SequenceFreed, "done"),
    (lambda bm: bm.append_token("pre", 1), InvalidState, "'pre' mid-prefill"),
    (lambda bm: bm.append_token("full", 1), InvalidArgument, "'full' is at max_model_len=12"),
    (lambda bm: bm.append_token("run", -2), InvalidArgument, r">= -1 \(not known yet\), got -2"),
    (lambda bm: bm.set_tokens(["run"], [1]), InvalidState, "'run' has no token waiting"),
    (lambda bm: bm.set_tokens(["run"], [-1]), InvalidArgument, ">= 0, got -1"),
    (lambda bm: bm.set_tokens(["run"], [1, 2]), InvalidArgument, "1 seq_ids but 2 token_ids"),
    (lambda bm: bm.append_tokens(["run", "run"], [1, 2]), InvalidArgument, "'run' appears twice"),
    (lambda bm: bm.append_tokens(["run", "done"], [1, 2]), SequenceFreed, "done"),
    (lambda bm: bm.append_tokens(["run"], [1, 2]), InvalidArgument, "1 seq_ids but 2 token_ids"),
    (lambda bm: bm.append_tokens(["run"], [1.5]), InvalidArgument, "integers, got dtype float"),
    (lambda bm: bm.admit("x", []), InvalidArgument, "at least one token, got 0"),
    (lambda bm: bm.admit("x", prompt(13)), InvalidArgument, "13 tokens exceeds max_model_len"),
    (lambda bm: bm.admit("x", [[1, 2]]), InvalidArgument, r"1-D, got shape \(1, 2\)"),
    (lambda bm: bm.admit("x", [1, -2]), InvalidArgument, ">= 0, got -2"),
    (lambda bm: bm.admit("x", [1.0]), InvalidArgument, "integers, got dtype float"),
    (lambda bm: bm.admit("x", [1], cache_salt=3), TypeError, "cache_salt.*got int"),
    (lambda bm: bm.admit("run", [1]), SequenceExists, "'run' is already live"),
    (lambda bm: bm.admit("x", prompt(12)), OutOfPages, "needs 3 pages, only 1 free"),
    (lambda bm: bm.mark_computed("pre", 3), InvalidArgument, "num_computed_tokens=3"),
    (lambda bm: bm.mark_computed("pre", 8), InvalidArgument, "num_computed_tokens=8"),
    (lambda bm: bm.slot_mapping("run", 2, 9), InvalidArgument, r"\[2, 9\)"),
    (lambda bm: bm.can_admit(0), InvalidArgument, "at least one token, got 0"),
    (lambda bm: bm.num_tokens("done"), SequenceFreed, "done"),
    # token ids past int64 used to wrap around: 2**64 - 1 became -1, "not known yet"
    (lambda bm: bm.append_tokens(["run"], np.array([2**64 - 1], np.uint64)), *BIG),
    (lambda bm: bm.append_token("run", 2**63), *BIG),
    (lambda bm: bm.admit("x", [2**63]), *BIG),
    (lambda bm: bm.admit("x", [1, 2**63]), *BIG),  # numpy makes that float64
    (lambda bm: bm.admit("x", [2**64, 1]), *BIG),  # and that object
    (lambda bm: bm.set_tokens(["run"], np.array([2**63], np.uint64)), *BIG),
    # a bool is not a count (it used to be taken as 0 or 1), a float not an int
    (lambda bm: bm.mark_computed("pre", True), TypeError, "num_computed_tokens.*True"),
    (lambda bm: bm.mark_computed("pre", 5.0), TypeError, "num_computed_tokens.*5.0"),
    (lambda bm: bm.release_before("run", True), TypeError, "position.*True"),
    (lambda bm: bm.grow("pre", np.True_), TypeError, "num_tokens.*True"),
    (lambda bm: bm.slot_mapping("run", False, 1), TypeError, "start.*False"),
    (lambda bm: bm.slot_mapping("run", 0, 2.0), TypeError, "end.*2.0"),
    (lambda bm: bm.can_admit(True), TypeError, "num_prompt_tokens.*True"),
    (lambda bm: bm.uncache([True]), TypeError, "pages.*True"),
    (lambda bm: bm.uncache(3), TypeError, "pages.*iterable.*3"),
    (lambda bm: bm.uncache([0, 1, 8]), InvalidArgument, r"pages \[8\] are outside \[0, 8\)"),
    (lambda bm: bm.admit("x", [1], read_cache="no"), InvalidArgument, "read_cache='no'"),
    (lambda bm: bm.admit("x", [1], compute_last=0), InvalidArgument, "compute_last=0"),
    # one id where a batch of ids is expected used to be read as its characters
    (lambda bm: bm.page_tables("run"), InvalidArgument, "seq_ids.*'run'"),
    (lambda bm: bm.append_tokens("run", [1, 2, 3]), InvalidArgument, "seq_ids.*'run'"),
    (lambda bm: bm.set_tokens(b"ab", [1, 2]), InvalidArgument, "seq_ids.*b'ab'"),
    (lambda bm: bm.num_append_pages("run"), InvalidArgument, "seq_ids.*'run'"),
    (lambda bm: bm.page_tables(["run"], width=True), TypeError, "width.*True"),
    (lambda bm: bm.page_tables([], width=-1), InvalidArgument, "width=-1"),
    (lambda bm: bm.page_tables(["run"], width=4, pad=1.5), TypeError, "pad.*1.5"),
    (lambda bm: bm.page_tables(["run"], width=4, pad=2**40), InvalidArgument, "pad=1099511"),
]


@pytest.mark.parametrize("call, exc, match", BAD_CALLS)
def test_bad_calls_raise_and_change_nothing(call, exc, match):
    bm = scenario()
    before = snapshot(bm)
    with pytest.raises(exc, match=match):
        call(bm)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_tokens_appended_before_their_value_is_known():
    """Asynchronous scheduling: a slot is reserved for a token the device has not sampled
    yet; its page is cached only once `set_tokens` gives the value."""
    bm = BlockManager(16, 4)
    toks = prompt(7)
    computed(bm, "a", toks)
    computed(bm, "b", prompt(5))
    slots, copies = bm.append_tokens(["a", "b"], [-1, 6])  # a's position 7 fills page 1
    assert copies == [] and slots[0] == bm.page_table("a")[1] * 4 + 3
    assert bm.stats().num_cached_pages == 2  # a's page 0 and b's page 0, not a's page 1
    bm.check_invariants()
    before = snapshot(bm)
    for call, match in [
        (lambda: bm.append_token("a", 5), "'a': token 7 has no value yet"),
        (lambda: bm.append_tokens(["b", "a"], [5, -1]), "'a': token 7 has no value yet"),
        (lambda: bm.fork("a", "c"), "fork 'a': token 7 has no value yet"),
        (lambda: bm.set_tokens(["a", "b"], [9, 9]), "'b' has no token waiting"),
    ]:
        with pytest.raises(InvalidState, match=match):
            call()
        assert snapshot(bm) == before
    bm.set_tokens(["a"], [9])
    assert bm.stats().num_cached_pages == 3
    bm.check_invariants()
    assert bm.admit("c", toks + [9, 1]) == 8  # the cached page holds the real token
    bm.append_token("a", 3)  # and a can go on
    bm.check_invariants()


def test_out_of_pages_is_all_or_nothing_across_a_batch():
    bm = BlockManager(4, 2)
    for i in range(3):
        computed(bm, i, prompt(2))  # 3 pages used, each full
    before = snapshot(bm)
    with pytest.raises(OutOfPages) as info:
        bm.append_tokens([0, 1, 2], [1, 2, 3])
    assert (info.value.needed, info.value.available) == (3, 1)
    assert isinstance(info.value, BlockManagerError)
    assert snapshot(bm) == before
    bm.append_tokens([0], [1])  # the scheduler preempts and retries a smaller batch
    bm.check_invariants()


def test_out_of_pages_names_the_reserved_pages():
    """Free pages reserved by a prompt admitted with peak_pages are not available; the
    error used to say 'only 1 free or evictable' with 6 free."""
    bm = BlockManager(8, 4, watermark=0)
    bm.admit("r", prompt(20), peak_pages=6)  # holds 1 page, reserves 5 more
    computed(bm, "a", prompt(4))
    assert (bm.num_free_pages, bm.num_reserved_pages) == (6, 5)
    calls = [
        (lambda: bm.admit("x", prompt(8)), 1, "needs 2 pages, only 1 free .*5 more are reserved"),
        (lambda: bm.admit("x", [1], peak_pages=3), 1, "needs 3 pages, only 1 free .*5 more"),
        (lambda: computed(bm, "b", prompt(4)), 0, None),  # takes the last unreserved page
        (lambda: bm.append_tokens(["a"], [1]), 0, "needs 1 pages, only 0 free .*5 more"),
    ]
    for call, available, match in calls:
        before = snapshot(bm)
        if match is None:
            call()
            continue
        with pytest.raises(OutOfPages, match=match) as info:
            call()
        assert (info.value.available, info.value.reserved) == (available, 5)
        assert snapshot(bm) == before
    bm.check_invariants()
