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
- ``check_invariants()`` holds after every call;
- a simulated device (each slot: the salt and token prefix whose K/V was written there, by
  ``mark_computed``, the appends and their copies, ``set_tokens``) holds every live
  sequence's computed tokens, so a prefix hit gives pages holding exactly the prompt's.

``WindowChaosMachine`` does the same on a manager that knows a sliding window W, whose
evicted content stays a stub while pages are cached under it: admissions and readmissions
of freed sequences' tokens with ``window=W``, scheduler steps (release below the window,
then a prefill chunk or a token) and ``set_sliding_window`` join the calls, and the stubs
made, taken back (computed again), dropped and hit through are counted.
"""

import collections
import hashlib

import numpy as np
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

from pagedjax import page_hashes
from pagedjax.blocks import BlockManager, BlockManagerError
from pagedjax.prefix_cache import salt_bytes

IDS = st.integers(0, 7)  # picks a live id, or a new one (7: the other kind)
COUNTS = st.integers(-1, 26) | st.sampled_from([True, 2.0])  # max_model_len is <= 24
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # few values: prefix hits
SALTS = st.sampled_from([None, None, "a", b"a"])
SETUP = dict(
    page_size=st.sampled_from([1, 2, 4]),
    num_pages=st.integers(3, 16),
    caching=st.sampled_from([True, True, False]),
    max_model_len=st.sampled_from([None, 13, 24]),
)


class ChaosMachine(RuleBasedStateMachine):
    ok = 0  # calls that went through, per run_chaos subclass
    events = collections.Counter()  # stub events (count_stubs), per run_chaos subclass

    def __init__(self):
        super().__init__()
        self.bm = None

    @initialize(**SETUP)
    def setup(self, page_size, num_pages, caching, max_model_len, window=None):
        self.bm = BlockManager(
            num_pages,
            page_size,
            enable_prefix_caching=caching,
            max_model_len=max_model_len,
            watermark=0,
            sliding_window=window,
        )
        self.ps = page_size
        self.dev: list = [None] * (num_pages * page_size)  # slot -> (salt, token prefix)
        self.seqs: dict = {}  # live id -> (cache_salt, token ids), as the calls gave them
        self.history: list = []  # (cache_salt, token ids) of freed sequences

    def call(self, fn, query=False):
        """Makes a call; returns ``(True, its result)``, or ``(False, None)`` if it raised
        (and then changed nothing)."""
        cache = self.bm._prefix
        before, stubs = snapshot(self.bm), set(cache._stub_node)
        try:
            out = fn()
        except (BlockManagerError, TypeError):
            assert snapshot(self.bm) == before, "a call that raised changed the state"
            self.events["failed with stubs"] += bool(stubs)
            return False, None
        assert not query or snapshot(self.bm) == before, "a query changed the state"
        type(self).ok += 1
        if stubs or cache._stub_node:
            self.count_stubs(stubs)
        return True, out

    def count_stubs(self, before: set) -> None:
        """Counts the stubs a call made, took back (a page computed the content again) and
        dropped (nothing cached under them any more, or uncached)."""
        cache = self.bm._prefix
        now = cache._stub_node.keys()
        gone = before - now
        back = sum(node in cache._node_page for node in gone)
        self.events["stubbed"] += len(now - before)
        self.events["unstubbed"] += back
        self.events["dropped"] += len(gone) - back

    # ------------------------------------------------------------ the device

    def kv(self, sid, start, end) -> list:
        """What slots ``start .. end - 1`` of live ``sid`` must hold."""
        salt, toks = self.seqs[sid]
        key, buf = salt_bytes(salt), np.asarray(toks, "<i8").tobytes()
        return [(key, buf[: 8 * (i + 1)]) for i in range(start, end)]

    def write(self, sid, start, end) -> None:
        slots = self.bm.slot_mapping(sid, start, end)
        for slot, k in zip(slots, self.kv(sid, start, end), strict=True):
            self.dev[slot] = k

    def read(self, sid, start, end) -> list:
        return [self.dev[x] for x in self.bm.slot_mapping(sid, start, end)]

    def first_held(self, sid) -> int:
        """The lowest position whose page ``sid`` still holds (below: released)."""
        return self.bm._seqs[sid].released * self.ps

    def through_stub(self, node: int) -> bool:
        """Whether content ``node`` is chained from a stub (False if it is not cached: an
        admission may evict the hits it released, under full attention)."""
        cache = self.bm._prefix
        while (p := cache._node_page.get(node)) is not None:
            node = cache.entries[p].parent_node
        return node in cache._stub_node

    # ------------------------------------------------------------ ids

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

    # ------------------------------------------------------------ calls with a model

    def admit_as(self, sid, tokens, **kw) -> bool:
        """Admits; a hit's pages must hold the prompt's K/V (those it keeps: a window
        releases the pages below it). Returns whether it went through."""
        ok, cached = self.call(lambda: self.bm.admit(sid, tokens, **kw))
        if not ok:
            return False
        self.seqs[sid] = (kw.get("cache_salt"), list(tokens))
        lo = self.first_held(sid)
        assert self.read(sid, lo, cached) == self.kv(sid, lo, cached), "prefix hit on wrong K/V"
        if cached and self.through_stub(self.bm._seqs[sid].chain.node):
            self.events["hits through stubs"] += 1
        return True

    def mark(self, sid, n) -> None:
        s = self.bm._seqs.get(sid)
        done = s.num_computed if s is not None else 0
        if self.call(lambda: self.bm.mark_computed(sid, n))[0]:
            self.write(sid, done, n)

    def append(self, batch, tokens) -> None:
        """``append_tokens`` (``append_token`` for one): the copies run, then the writes."""
        if len(batch) == 1 and len(tokens) == 1:
            ok, out = self.call(lambda: self.bm.append_token(batch[0], tokens[0]))
            slots, copies = ([out[0]], out[1]) if ok else (None, None)
        else:
            ok, out = self.call(lambda: self.bm.append_tokens(batch, tokens))
            slots, copies = (out[0].tolist(), out[1]) if ok else (None, None)
        if not ok:
            return
        ps = self.ps
        for src, dst in copies:
            self.dev[dst * ps : (dst + 1) * ps] = self.dev[src * ps : (src + 1) * ps]
        for sid, t, slot in zip(batch, tokens, slots, strict=True):
            toks = self.seqs[sid][1]
            toks.append(int(t))
            self.dev[slot] = self.kv(sid, len(toks) - 1, len(toks))[0]

    def free(self, sid) -> None:
        if self.call(lambda: self.bm.free(sid))[0]:
            self.history.append(self.seqs.pop(sid))

    # ------------------------------------------------------------ rules

    @rule(
        sid=IDS,
        tokens=TOKENS,
        salt=SALTS,
        read=st.booleans(),
        peak=st.none() | st.integers(0, 6),
        window=st.none() | st.integers(0, 9),
        last=st.sampled_from([True, True, False, 0]),
    )
    def admit(self, sid, tokens, salt, read, peak, window, last):
        kw = dict(cache_salt=salt, read_cache=read, peak_pages=peak, window=window)
        self.admit_as(self.new(sid), tokens, compute_last=last, **kw)

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
        self.mark(sid, n)

    @precondition(lambda self: self.bm._seqs)
    @rule(ii=st.lists(IDS, max_size=4), tokens=st.lists(st.integers(-2, 2), min_size=5))
    def append_tokens(self, ii, tokens):
        batch = [self.ready(i) for i in ii]
        self.append(batch, tokens[:1] if len(batch) == 1 else tokens[: len(batch) + len(ii) % 2])

    @precondition(lambda self: self.bm._seqs)
    @rule(ii=st.lists(IDS, max_size=3), tokens=st.lists(st.integers(-1, 2), max_size=3))
    def set_tokens(self, ii, tokens):
        batch, values = [self.live(i) for i in ii], tokens[: len(ii)]
        if self.call(lambda: self.bm.set_tokens(batch, values))[0]:
            for sid, t in zip(batch, values, strict=True):  # the device wrote the real token
                toks = self.seqs[sid][1]
                u = toks.index(-1)
                toks[u] = t
                self.write(sid, u, u + 1)

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS, child=IDS)
    def fork(self, i, child):
        parent, child = self.ready(i), self.new(child)
        if self.call(lambda: self.bm.fork(parent, child))[0]:
            salt, toks = self.seqs[parent]
            self.seqs[child] = (salt, list(toks))

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS)
    def free_one(self, i):
        self.free(self.live(i))

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
        if wipe != 0:
            self.call(lambda: self.bm.uncache(pages))
        elif self.call(self.bm.free_all)[0]:
            self.history += self.seqs.values()
            self.seqs.clear()

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
        if self.bm is None:
            return
        bm = self.bm
        bm.check_invariants()
        assert bm._seqs.keys() == self.seqs.keys()
        for sid, (salt, toks) in self.seqs.items():
            s = bm._seqs[sid]
            assert bytes(s.tokens) == np.asarray(toks, "<i8").tobytes()
            assert s.chain.salt == salt_bytes(salt)
            lo = self.first_held(sid)
            assert self.read(sid, lo, s.num_computed) == self.kv(sid, lo, s.num_computed), (
                f"sequence {sid}: computed K/V was overwritten"
            )


# Shared heads whose tokens repeat every 11 positions only: hashes of a page's last token
# (page_only_digest) still cache chains of several pages.
STEMS = [[(k + 5 * j) % 11 for j in range(20)] for k in range(3)]


class WindowChaosMachine(ChaosMachine):
    """The chaos machine on a manager that knows the model's window W (from the start, or
    set after), plus the calls a window model's scheduler makes: admissions of long prompts
    (shared heads, freed sequences' tokens again) with ``window=W`` and mostly a
    reservation, and steps that release below the window, then compute a prefill chunk or
    append a token. The pool is small next to the prompts, so that pages are evicted."""

    @initialize(
        page_size=st.sampled_from([1, 1, 2, 4]),
        num_pages=st.integers(5, 14),
        caching=st.sampled_from([True, True, True, False]),
        max_model_len=st.sampled_from([None, 24]),
        window=st.integers(1, 9),
        late=st.booleans(),
    )
    def setup(self, page_size, num_pages, caching, max_model_len, window, late):
        super().setup(page_size, num_pages, caching, max_model_len, None if late else window)
        if late:
            self.bm.set_sliding_window(window)
        self.window = window

    def w(self) -> int:
        """The window admissions and steps use: the manager's (or the last one it had)."""
        return self.bm.sliding_window or self.window

    def serve(self, sid, tokens, then, chunk, **kw) -> None:
        """Admits with ``window=W``; ``then`` 1: prefills the prompt (releasing below the
        window as it goes), 2: and frees the sequence (finished, its pages cached)."""
        if not self.admit_as(sid, tokens, window=self.w(), **kw) or not then:
            return
        while self.bm.num_computed_tokens(sid) < self.bm.num_tokens(sid):
            if not self.step(sid, chunk, 0):
                break
        if then == 2:
            self.free(sid)

    @rule(
        sid=IDS,
        stem=st.sampled_from(STEMS),
        cut=st.integers(0, 20),
        tokens=st.lists(st.integers(0, 2), max_size=8),
        salt=st.sampled_from([None, None, None, "a"]),
        read=st.sampled_from([True, True, True, False]),
        peak=st.none() | st.integers(1, 4) | st.integers(2, 6),
        last=st.sampled_from([True, True, False]),
        then=st.integers(0, 2),
        chunk=st.integers(1, 8),
    )
    def admit_in_window(self, sid, stem, cut, tokens, salt, read, peak, last, then, chunk):
        kw = dict(cache_salt=salt, read_cache=read, peak_pages=peak, compute_last=last)
        self.serve(self.new(sid), stem[:cut] + tokens or [0], then, chunk, **kw)

    @precondition(lambda self: self.history)
    @rule(
        i=st.integers(0, 3),
        cut=st.integers(6, 24),
        extra=st.lists(st.integers(0, 2), max_size=3),
        read=st.sampled_from([True, True, True, False]),
        peak=st.none() | st.integers(1, 4) | st.integers(2, 6),
        last=st.sampled_from([True, True, False]),
        then=st.integers(0, 2),
        chunk=st.integers(1, 8),
    )
    def readmit_in_window(self, i, cut, extra, read, peak, last, then, chunk):
        """A freed sequence's tokens (a prefix of them) again: its head may be evicted (a
        hit through stubs), or computed again (``read=False``: the stubs are taken back)."""
        salt, toks = self.history[-1 - i % len(self.history)]
        tokens = [max(t, 0) for t in toks[:cut]] + extra or [0]
        kw = dict(cache_salt=salt, read_cache=read, peak_pages=peak, compute_last=last)
        self.serve(self.new(0), tokens, then, chunk, **kw)

    def step(self, sid, chunk, t) -> bool:
        """What the scheduler does for a sequence each step: releases the pages out of its
        window, then grows and computes a prefill chunk, or appends a token. Returns
        whether the sequence got further."""
        bm = self.bm
        s = bm._seqs.get(sid)
        if s is None:
            return self.call(lambda: bm.release_before(sid, 0))[0]
        c, n = s.num_computed, s.num_tokens
        self.call(lambda: bm.release_before(sid, max(c - self.w() + 1, 0)))
        if c < n:
            end = min(c + chunk, n)
            self.call(lambda: bm.grow(sid, end))
            self.mark(sid, end)
        else:
            self.append([sid], [t])
        return s.num_tokens > n or s.num_computed > c

    @precondition(lambda self: self.bm._seqs)
    @rule(i=IDS, chunk=st.integers(1, 8), t=st.integers(0, 2))
    def window_step(self, i, chunk, t):
        self.step(self.live(i), chunk, t)

    @precondition(lambda self: self.bm._seqs)
    @rule(
        chunk=st.integers(1, 8),
        t=st.integers(0, 2),
        finish=st.integers(4, 24),
        rounds=st.integers(1, 4),
    )
    def scheduler_steps(self, chunk, t, finish, rounds):
        """Steps every live sequence ``rounds`` times; frees those with ``finish`` tokens or
        more, and those that cannot go on (out of pages, or past their peak: preempted)."""
        for _ in range(rounds):
            for sid in list(self.seqs):
                if self.bm.num_tokens(sid) >= finish or not self.step(sid, chunk, t):
                    self.free(sid)

    @precondition(lambda self: self.bm._seqs)
    @rule(pages=st.lists(st.integers(-1, 12), max_size=3), wipe=st.integers(0, 19))
    def uncache_or_free_all(self, pages, wipe):
        """As the chaos machine's, but uncaching all (1 in 20) or some pages."""
        super().uncache_or_free_all(None if wipe == 1 else pages, wipe)

    @rule(w=st.sampled_from([None, 0, 2.0]) | st.integers(1, 9) | st.integers(1, 9))
    def set_window(self, w):
        """A window, or none (refused while stubs are registered), or a bad one."""
        if self.call(lambda: self.bm.set_sliding_window(w))[0] and w is not None:
            self.window = w


def run_chaos(base, examples: int, steps: int):
    """Runs a fresh subclass of ``base`` derandomized; returns it (its ``ok``: calls that
    went through; ``events``: its stub events)."""
    machine = type("Machine", (base,), {"ok": 0, "events": collections.Counter()})
    run_state_machine_as_test(machine, settings=stateful_settings(examples, steps))
    return machine


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


DIGESTS = pytest.mark.parametrize("digest", [None, page_only_digest], ids=["sha256", "colliding"])


@DIGESTS
def test_chaos(monkeypatch, digest):
    if digest is not None:
        monkeypatch.setattr(page_hashes, "digest", digest)
    assert run_chaos(ChaosMachine, 60, 80).ok >= 1_500  # went through (2,092), not only raised


@DIGESTS
def test_chaos_knowing_the_window(monkeypatch, digest):
    """Floors against a run that never evicts into a stub (derandomized: 35 and 12 stubs
    made, 162 and 108 calls that raised checked while stubs were registered)."""
    if digest is not None:
        monkeypatch.setattr(page_hashes, "digest", digest)
    machine = run_chaos(WindowChaosMachine, 30, 80)
    assert machine.ok >= 1_500  # ~2,400
    assert machine.events["stubbed"] >= 5 and machine.events["failed with stubs"] >= 50


@pytest.mark.slow
@DIGESTS
def test_chaos_long(monkeypatch, digest):
    if digest is not None:
        monkeypatch.setattr(page_hashes, "digest", digest)
    assert run_chaos(ChaosMachine, 200, 120).ok >= 8_000  # ~10,800


@pytest.mark.slow
@DIGESTS
def test_chaos_knowing_the_window_long(monkeypatch, digest):
    """Every stub event, a few dozen times (derandomized, sha256 / colliding: 706 / 161
    stubs made, 26 / 69 taken back, 379 / 50 dropped, 38 / 34 hits through a stub)."""
    if digest is not None:
        monkeypatch.setattr(page_hashes, "digest", digest)
    events = run_chaos(WindowChaosMachine, 200, 120).events
    assert events["stubbed"] >= 80 and events["unstubbed"] >= 10 and events["dropped"] >= 20
    assert events["hits through stubs"] >= 10 and events["failed with stubs"] >= 500
