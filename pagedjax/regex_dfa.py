"""Regexes to byte DFAs, for structured outputs (`pagedjax.guided`).

`compile_dfa` compiles a pattern as: regex text -> AST (`parse`, our own subset: see
`pagedjax.regex_parse`) -> Thompson NFA over bytes (character classes become UTF-8
byte-range sequences) -> DFA by subset construction (at most `MAX_DFA_STATES` states),
with the states that cannot reach acceptance merged into the dead state 0. The DFA reads
the matched text's UTF-8 bytes: it accepts exactly the encodings of the strings the
pattern fully matches.

Size: a bounded count repeats its automaton (`"x{0,500}"` is 500 copies), so a pattern
whose NFA would pass `MAX_NFA_STATES` is refused by `check_size` (on the AST, before
building; `StructuredOutputsParams` runs it on construction), and one whose DFA passes
`MAX_DFA_STATES` (a JSON string's maxLength: about 800), takes over `MAX_DFA_WORK`
steps to build or holds over `MAX_DFA_HELD` NFA states in its state sets (the memory:
`(?:a?){0,5000}`, each DFA state holding thousands of NFA states) by `compile_dfa`. A
pattern nested too deeply for the recursion is a ValueError too (`nesting`).

`parse`, `escape`, `to_text`, `map_sets`, `negate`, `intersect` and `nesting` are
`pagedjax.regex_parse`'s, re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from pagedjax.regex_parse import escape, intersect, map_sets, negate, nesting, parse, to_text

__all__ = [
    "DFA",
    "MAX_DFA_HELD",
    "MAX_DFA_STATES",
    "MAX_DFA_WORK",
    "MAX_NFA_STATES",
    "check_size",
    "compile_dfa",
    "escape",
    "intersect",
    "map_sets",
    "negate",
    "nesting",
    "parse",
    "to_text",
]

MAX_DFA_STATES = 20_000
MAX_DFA_WORK = 20_000_000  # NFA states and edges visited building it: 2-4 s
# NFA states held in the DFA's state sets (and the closures' keys): ~50-70 bytes each, so
# ~130 MB at most. Patterns of a few characters held 10M (760 MB) before `MAX_DFA_WORK`
# stopped them; a JSON string's maxLength 800 holds 31k, `(?:a?){0,900}` 0.8M.
MAX_DFA_HELD = 2_000_000
MAX_NFA_STATES = 200_000  # counted on the AST before building (`_nfa_size`)


# ---------------------------------------------------------------------------- automata


def _utf8_sequences(lo: int, hi: int):
    """The codepoints lo..hi (no surrogates) as sequences of byte ranges [(b0, b1), ...]."""
    for bound in (0x7F, 0x7FF, 0xFFFF):  # split where the encoded length changes
        if lo <= bound < hi:
            yield from _utf8_sequences(lo, bound)
            yield from _utf8_sequences(bound + 1, hi)
            return
    if hi < 0x80:
        yield [(lo, hi)]
        return
    n = 2 if hi <= 0x7FF else 3 if hi <= 0xFFFF else 4
    for k in range(1, n):  # split until lo, hi differ only in whole trailing 6-bit blocks
        m = (1 << (6 * k)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                yield from _utf8_sequences(lo, lo | m)
                yield from _utf8_sequences((lo | m) + 1, hi)
                return
            if hi & m != m:
                yield from _utf8_sequences(lo, (hi & ~m) - 1)
                yield from _utf8_sequences(hi & ~m, hi)
                return
    a, b = chr(lo).encode(), chr(hi).encode()
    yield list(zip(a, b, strict=True))


def _nfa_size(node) -> int:
    """The NFA states `_NFA.build` adds for `node` (at most)."""
    kind = node[0]
    if kind == "set":
        return _set_size(node[1])
    if kind == "cat":
        return sum(_nfa_size(n) for n in node[1])
    if kind == "alt":
        return sum(_nfa_size(n) + 1 for n in node[1]) + 1
    lo, hi = node[2], node[3]
    return (_nfa_size(node[1]) + 1) * (lo + 1 if hi is None else hi) + 1


@functools.lru_cache(maxsize=256)
def _set_size(ranges) -> int:
    """The NFA states `_NFA.build` adds for a character set."""
    return 1 + sum(len(seq) - 1 for lo, hi in ranges for seq in _utf8_sequences(lo, hi))


class _NFA:
    """Thompson NFA over bytes: per state, epsilon targets and (lo, hi, target) edges."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def new(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node, s: int) -> int:
        """Adds `node` starting at state `s`; returns its end state."""
        kind = node[0]
        if kind == "set":
            end = self.new()
            for lo, hi in node[1]:
                for seq in _utf8_sequences(lo, hi):
                    cur = s
                    for k, (a, b) in enumerate(seq):
                        nxt = end if k == len(seq) - 1 else self.new()
                        self.edges[cur].append((a, b, nxt))
                        cur = nxt
            return end
        if kind == "cat":
            for n in node[1]:
                s = self.build(n, s)
            return s
        if kind == "alt":
            end = self.new()
            for n in node[1]:
                start = self.new()
                self.eps[s].append(start)
                self.eps[self.build(n, start)].append(end)
            return end
        inner, lo, hi = node[1], node[2], node[3]
        for _ in range(lo):
            s = self.build(inner, s)
        if hi is None:  # a loop: s -> inner -> s
            loop = self.new()
            self.eps[s].append(loop)
            start = self.new()
            self.eps[loop].append(start)
            self.eps[self.build(inner, start)].append(loop)
            return loop
        end = self.new()
        for _ in range(hi - lo):
            self.eps[s].append(end)
            start = self.new()
            self.eps[s].append(start)
            s = self.build(inner, start)
        self.eps[s].append(end)
        return end


@dataclasses.dataclass(frozen=True, slots=True)
class DFA:
    """A byte DFA. State 0 is dead (absorbing); every other state can reach acceptance."""

    trans: np.ndarray  # [S, 256] int32
    accept: np.ndarray  # [S] bool
    initial: int

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = int(self.trans[state, b])
        return state


def compile_dfa(pattern: str) -> DFA:
    """The DFA of `pattern`, its dead states merged into state 0.

    Raises:
      TypeError: `pattern` is not a str.
      ValueError: it is outside the subset or nests too deeply (`parse`), its NFA or DFA
        is too large (`check_size`, `MAX_DFA_STATES`), or it matches nothing.
    """
    ast = parse(pattern)
    check_size(pattern, ast)
    nfa = _NFA()
    start = nfa.new()
    with nesting(f"regex {pattern!r}"):
        final = nfa.build(ast, start)
    # DFA states are sets of the NFA states that have byte edges (or are final).
    keep = [bool(e) or i == final for i, e in enumerate(nfa.edges)]
    closures: dict[frozenset, frozenset] = {}
    work = 0  # NFA states and edges visited: the time it takes
    held = 0  # NFA states in the sets kept (the closures' keys and values): the memory

    def closure(states: frozenset) -> frozenset:
        nonlocal work, held
        got = closures.get(states)
        if got is None:
            seen, stack = set(states), list(states)
            while stack:
                for t in nfa.eps[stack.pop()]:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            work += len(seen)
            got = closures[states] = frozenset(t for t in seen if keep[t])
            held += len(states) + len(got)
            if held > MAX_DFA_HELD:
                raise ValueError(
                    f"regex of {len(pattern)} characters {pattern!r:.100} is too large: its "
                    f"DFA's states hold over {MAX_DFA_HELD} NFA states (each holds many, as "
                    "nested optional repetitions make them); simplify it"
                )
        return got

    first = closure(frozenset([start]))
    index, sets, rows = {first: 0}, [first], []
    while len(rows) < len(sets):
        edges = [e for q in sets[len(rows)] for e in nfa.edges[q]]
        row = np.full(256, -1, np.int32)
        cuts = sorted({e[0] for e in edges} | {e[1] + 1 for e in edges})
        work += len(edges) * len(cuts)
        if work > MAX_DFA_WORK:
            raise ValueError(
                f"regex of {len(pattern)} characters {pattern!r:.100} is too large: building "
                f"its DFA takes over {MAX_DFA_WORK} steps (its DFA states hold many NFA "
                "states each, as nested optional repetitions make them); simplify it"
            )
        for a, b in zip(cuts, cuts[1:], strict=False):
            targets = frozenset(t for lo, hi, t in edges if lo <= a and b - 1 <= hi)
            if not targets:
                continue
            target = closure(targets)
            if target not in index:
                if len(sets) >= MAX_DFA_STATES:
                    raise ValueError(
                        f"regex of {len(pattern)} characters {pattern!r:.100} is too large: "
                        f"its DFA has over {MAX_DFA_STATES} states"
                    )
                index[target] = len(sets)
                sets.append(target)
            row[a:b] = index[target]
        rows.append(row)
    accept = np.array([final in s for s in sets])
    trans = np.stack(rows)
    # Live states: those that reach acceptance (reverse reachability).
    rev: list[list[int]] = [[] for _ in sets]
    for src, row in enumerate(trans):
        for dst in np.unique(row[row >= 0]):
            rev[dst].append(src)
    live = accept.copy()
    stack = list(np.flatnonzero(accept))
    while stack:
        for src in rev[stack.pop()]:
            if not live[src]:
                live[src] = True
                stack.append(src)
    if not live[0]:
        raise ValueError(f"regex {pattern!r:.200} matches nothing")
    new_id = np.zeros(len(sets) + 1, np.int32)  # old id -> new (0: dead); index -1 too
    new_id[np.flatnonzero(live)] = np.arange(1, live.sum() + 1)
    table = np.zeros((int(live.sum()) + 1, 256), np.int32)
    table[1:] = new_id[trans[live]]
    return DFA(table, np.concatenate([[False], accept[live]]), int(new_id[0]))


def check_size(pattern: str, ast) -> None:
    """ValueError if the NFA of `ast` (parsed from `pattern`) would pass `MAX_NFA_STATES`."""
    with nesting(f"regex {pattern!r}"):
        size = _nfa_size(ast)
    if size > MAX_NFA_STATES:
        raise ValueError(
            f"regex of {len(pattern)} characters {pattern!r:.100} is too large: about "
            f"{size} NFA states (limit {MAX_NFA_STATES}); lower its repetition counts"
        )
