"""A chaos state machine for pagedjax.blocks: any call, valid or not, in any state.

The machines of tests/block_machine.py and tests/test_window_pages.py drive the block
manager the way an engine does and check every computed slot against a simulated device.
This one checks the contract of every call instead: it makes each mutating call (and the
queries) with arguments drawn at random, whether or not they make sense in the current
state (unknown, freed and duplicate ids, counts out of range, bools and floats, windows and
reservations, uncache and free_all), and requires that

- a call raises only ``BlockManagerError`` or ``TypeError`` (nothing from deeper down);
- a call that raises leaves everything exactly as before (``snapshot``, stats included);
- a query never changes anything;
- ``check_invariants()`` holds after every call.
"""

import hashlib

import pytest
from block_machine import snapshot, stateful_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedjax import prefix_cache
from pagedjax.blocks import BlockManager, BlockManagerError

IDS = st.integers(0, 7)  # picks a live id, or a new one (7: the other kind)
COUNTS = st.integers(-1, 26) | st.sampled_from([True, 2.0])  # max_model_len is <= 24
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # few values: prefix hits


class ChaosMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = None

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(3, 16),
        caching=st.sampled_from([True, True, False]),
        max_model_len=st.sampled_from([None, 13, 24]),
    )
    def setup(self, page_size, num_pages, caching, max_model_len):
        self.bm = BlockManager(
            num_pages,
            page_size,
            enable_prefix_caching=caching,
            max_model_len=max_model_len,
            watermark=0,
        )

    def call(self, fn, query=False):
        before = snapshot(self.bm)
        try:
            fn()
        except (BlockManagerError, TypeError):
            assert snapshot(self.bm) == before, "a call that raised changed the state"
            return
        assert not query or snapshot(self.bm) == before, "a query changed the state"
        type(self).ok += 1

    def live(self, i):
        """A live id, unless ``i`` is 7: then 7 (unknown or freed, or live)."""
        ids = list(self.bm._seqs)
        return ids[i % len(ids)] if ids and i != 7 else i

    def ready(self, i):
        """A live id that can append and fork, if any, unless ``i`` is 7 (as ``live``)."""
        ids = [k for k, s in self.bm._seqs.items() if s.num_computed == s.num_tokens]
        ids = [k for k in ids if self.bm._seqs[k].unknown < 0] or ids
        return ids[i % len(ids)] if ids and i != 7 else self.live(i)

    def new(self, i):
        """An id that is not live, unless ``i`` is 7: then a live one (if any)."""
        return self.live(0) if i == 7 else next(j for j in range(i, 99) if j not in self.bm)

    @rule(
        sid=IDS,
        tokens=TOKENS,
        salt=st.sampled_from([None, None, "a", b"a"]),
        read=st.booleans(),
        peak=st.none() | st.integers(0, 6),
        window=st.none() | st.integers(0, 9),
        last=st.sampled_from([True, True, False, 0]),
    )
    def admit(self, sid, tokens, salt, read, peak, window, last):
        kw = dict(cache_salt=salt, read_cache=read, peak_pages=peak, window=window)
        kw["compute_last"] = last
        self.call(lambda: self.bm.admit(self.new(sid), tokens, **kw))

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS, n=COUNTS)
    def grow(self, i, n):
        self.call(lambda: self.bm.grow(self.live(i), n))

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS, step=st.integers(-1, 6), how=st.sampled_from(["all", "all", "step", "abs"]))
    def mark_computed(self, i, step, how):
        sid = self.live(i)
        s = self.bm._seqs.get(sid)
        n = step if how == "abs" or s is None else s.num_computed + step
        n = s.num_tokens if how == "all" and s is not None else n
        self.call(lambda: self.bm.mark_computed(sid, n))

    @precondition(lambda self: self.bm._seqs)
    @rule(ii=st.lists(IDS, max_size=4), tokens=st.lists(st.integers(-2, 2), min_size=5))
    def append_tokens(self, ii, tokens):
        batch = [self.ready(i) for i in ii]
        if len(batch) == 1 and len(tokens) == 1:
            self.call(lambda: self.bm.append_token(batch[0], tokens[0]))
        else:
            self.call(lambda: self.bm.append_tokens(batch, tokens[: len(batch) + len(ii) % 2]))

    @precondition(lambda self: self.bm._seqs)
    @rule(ii=st.lists(IDS, max_size=3), tokens=st.lists(st.integers(-1, 2), max_size=3))
    def set_tokens(self, ii, tokens):
        batch = [self.live(i) for i in ii]
        self.call(lambda: self.bm.set_tokens(batch, tokens[: len(batch)]))

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS, child=IDS)
    def fork(self, i, child):
        self.call(lambda: self.bm.fork(self.ready(i), self.new(child)))

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS)
    def free(self, i):
        self.call(lambda: self.bm.free(self.live(i)))

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS, back=st.integers(-1, 9))
    def release_before(self, i, back):
        sid = self.live(i)
        s = self.bm._seqs.get(sid)
        pos = back if s is None else max(s.num_computed - back, -(back < 0))
        self.call(lambda: self.bm.release_before(sid, pos))

    @precondition(lambda self: self.bm._seqs)
    @rule(pages=st.none() | st.lists(st.integers(-1, 16), max_size=3), wipe=st.integers(0, 9))
    def uncache_or_free_all(self, pages, wipe):
        if wipe == 0:
            self.call(self.bm.free_all)
        else:
            self.call(lambda: self.bm.uncache(pages))

    @precondition(lambda self: self.bm._seqs)
    @rule(ii=st.lists(IDS, max_size=3), width=st.none() | COUNTS, start=COUNTS, end=COUNTS)
    def queries(self, ii, width, start, end):
        bm, batch = self.bm, [self.live(i) for i in ii]
        self.call(lambda: bm.page_tables(batch, width=width), query=True)
        self.call(lambda: bm.num_append_pages(batch), query=True)
        self.call(lambda: bm.slot_mapping(batch[0] if batch else 0, start, end), query=True)
        self.call(lambda: bm.can_admit(end), query=True)

    @invariant()
    def consistent(self):
        if self.bm is not None:
            self.bm.check_invariants()


def run_chaos(examples: int, steps: int) -> int:
    """Runs a fresh machine derandomized; returns how many calls went through."""
    machine = type("Machine", (ChaosMachine,), {"ok": 0})
    run_state_machine_as_test(machine, settings=stateful_settings(examples, steps))
    return machine.ok


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_token_without_a_value_is_never_cached(page_size):
    """A page holding a token appended without its value (an asynchronous commit) is
    cached only once ``set_tokens`` gives the value, whatever ``mark_computed`` says (the
    chaos machine seldom calls them in that order)."""
    bm = BlockManager(8, page_size, watermark=0)
    prompt = list(range(3, 2 + 2 * page_size))  # one page and all but a token of the next
    bm.admit("a", prompt)
    bm.mark_computed("a", len(prompt))
    bm.append_token("a", -1)  # fills the second page
    bm.mark_computed("a", bm.num_tokens("a"))
    assert bm.stats().num_cached_pages == 1
    bm.check_invariants()
    bm.set_tokens(["a"], [7])
    assert bm.stats().num_cached_pages == 2
    bm.check_invariants()
    bm.free("a")
    assert bm.admit("b", [*prompt, 7, 9]) == 2 * page_size  # the value is what was cached


def page_only_digest(data: bytes) -> bytes:
    return hashlib.sha256(data[-8:]).digest()  # collides across parents, salts and pages


@pytest.mark.parametrize("digest", [None, page_only_digest], ids=["sha256", "colliding"])
def test_chaos(monkeypatch, digest):
    if digest is not None:
        monkeypatch.setattr(prefix_cache, "_digest", digest)
    assert run_chaos(100, 80) >= 2_500  # calls that went through (~3,400), not only raised


@pytest.mark.slow
@pytest.mark.parametrize("digest", [None, page_only_digest], ids=["sha256", "colliding"])
def test_chaos_long(monkeypatch, digest):
    if digest is not None:
        monkeypatch.setattr(prefix_cache, "_digest", digest)
    assert run_chaos(200, 120) >= 8_000  # ~11,000
