"""Regexes to byte DFAs, for structured outputs (`pagedjax.guided`).

`compile_dfa` compiles a pattern as: regex text -> AST (`parse`, our own subset) ->
Thompson NFA over bytes (character classes become UTF-8 byte-range sequences) -> DFA
by subset construction (at most `MAX_DFA_STATES` states), with the states that cannot
reach acceptance merged into the dead state 0. The DFA reads the matched text's UTF-8
bytes: it accepts exactly the encodings of the strings the pattern fully matches.

Regex subset (full-match semantics): literals; escapes \\d \\w \\s \\D \\W \\S (ASCII
meanings: [0-9], [A-Za-z0-9_], [\\t-\\r ] and the characters outside them), \\n \\t \\r
\\f \\v \\a, \\xhh \\uhhhh \\Uhhhhhhhh, escaped punctuation; `.` (any character but
newline); classes [a-z] [^...]; groups ( ) (?: ) (?P<name> ) (?<name> ); alternation;
quantifiers * + ? {m} {m,} {,n} {m,n} and their lazy forms (the language is the same). ^
at the start and $ at the end are ignored. Refused (ValueError naming the pattern and the
position): backreferences, lookaround, inline flags, possessive quantifiers, \\b \\B \\A
\\Z, \\p{...}, anchors elsewhere (\\b in a class is a backspace), surrogates.

`parse(pattern, ecma=True)` reads a JSON Schema `pattern` (ECMA-262) so that every string
it matches is one both ECMA-262 and Python's `re` (whose \\d \\w \\s are Unicode's) match:
\\d \\w \\s are ASCII's, \\D \\W \\S leave out every character either reads as a digit,
word character or space (in a negated class, the other way round), `.` leaves out \\r
U+2028 U+2029 too, and what they read differently is refused: [] [^] {,n} \\a \\U.

Size: a bounded count repeats its automaton (`"x{0,500}"` is 500 copies), so a pattern
whose NFA would pass `MAX_NFA_STATES` is refused by `check_size` (on the AST, before
building; `StructuredOutputsParams` runs it on construction), and one whose DFA passes
`MAX_DFA_STATES` (a JSON string's maxLength: about 800) or takes over `MAX_DFA_WORK`
steps to build (`(?:a?){0,5000}`: each DFA state holds thousands of NFA states) by
`compile_dfa`. A pattern nested too deeply for the recursion is a ValueError too
(`nesting`).

`escape`, `to_text` and `map_sets` (with `negate` and `intersect` on character sets)
let `pagedjax.json_schema` write and rewrite patterns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import numpy as np

__all__ = [
    "DFA",
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
MAX_NFA_STATES = 200_000  # counted on the AST before building (`_nfa_size`)

_MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)


# ---------------------------------------------------------------------------- char sets


def _norm(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted, merged codepoint ranges, less the surrogates (they have no UTF-8)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, _SURROGATES[0] - 1)), (max(lo, _SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return tuple((a, b) for a, b in out)


def negate(ranges) -> tuple[tuple[int, int], ...]:
    """The codepoints outside `ranges` (less the surrogates)."""
    out, start = [], 0
    for lo, hi in _norm(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CP:
        out.append((start, _MAX_CP))
    return _norm(out)


def intersect(a, b) -> tuple[tuple[int, int], ...]:
    """The codepoints in both `a` and `b`."""
    return negate(negate(a) + negate(b))


_DIGIT = ((48, 57),)
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = ((9, 13), (32, 32))
_CLASS_ESCAPES = {
    "d": _DIGIT,
    "w": _WORD,
    "s": _SPACE,
    "D": negate(_DIGIT),
    "W": negate(_WORD),
    "S": negate(_SPACE),
}
_CHAR_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
_ANY_BUT_NEWLINE = negate(((10, 10),))
# ECMA-262's and Python's spaces (str.isspace) together; ECMA's `.` leaves out its line ends.
_ANY_SPACE = _norm([(9, 13), (28, 32), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680)]
                   + [(0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F)]
                   + [(0x3000, 0x3000), (0xFEFF, 0xFEFF)])  # fmt: skip
_ECMA_DOT = negate(((10, 10), (13, 13), (0x2028, 0x2029)))


@functools.cache
def _unicode_class(kind: str) -> tuple[tuple[int, int], ...]:
    """Python's Unicode \\d ("d": str.isdecimal) or \\w ("w": str.isalnum, "_")."""
    test = str.isdecimal if kind == "d" else lambda c: c.isalnum() or c == "_"
    ranges, start = [], None
    for cp in range(_MAX_CP + 2):
        inside = cp <= _MAX_CP and test(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return _norm(ranges)


def _ecma_class(c: str, wide: bool):
    """\\d \\w \\s \\D \\W \\S (`c`) of a JSON Schema pattern: the characters both ECMA-262
    and Python's `re` read as in it, or (`wide`, in a negated class) as in it by either."""
    if c in "dD":
        narrow, either = _DIGIT, _unicode_class("d")
    elif c in "wW":
        narrow, either = _WORD, _unicode_class("w")
    else:
        narrow, either = _SPACE, _ANY_SPACE
    if c.islower():
        return either if wide else narrow
    return negate(narrow if wide else either)


# ---------------------------------------------------------------------------- regex AST
# Nodes: ("set", ranges) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max).


_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")  # {m} {m,} {,n} {m,n}


def _lit(cp: int):
    return ("set", ((cp, cp),))


class _Parser:
    """Recursive descent over the regex subset in the module docstring."""

    def __init__(self, pattern: str, ecma: bool = False):
        self.p, self.i, self.ecma = pattern, 0, ecma
        self.negated = False  # in a negated class

    def error(self, msg: str) -> ValueError:
        return ValueError(f"regex {self.p!r:.200}: {msg} at position {self.i}")

    def parse(self):
        if self.p.startswith("^"):
            self.i = 1
        node = self.alt()
        if self.i < len(self.p):  # only a stray ")" stops alt() early
            raise self.error("unbalanced parenthesis")
        return node

    def alt(self):
        branches = [self.cat()]
        while self.i < len(self.p) and self.p[self.i] == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def cat(self):
        items = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            if self.p[self.i] == "$" and self.i == len(self.p) - 1:
                self.i += 1  # a final $: full match anyway
                break
            atom = self.atom()
            items.append(self.quantified(atom))
        return items[0] if len(items) == 1 else ("cat", items)

    def quantified(self, atom):
        q = self.quantifier()
        if q is None:
            return atom
        if self.i < len(self.p) and self.p[self.i] == "?":
            self.i += 1  # lazy: the same language
        elif self.i < len(self.p) and self.p[self.i] == "+":
            raise self.error("possessive quantifiers are not supported")
        if self.quantifier(peek=True) is not None:
            raise self.error("multiple repeat")
        return ("rep", atom, *q)

    def quantifier(self, peek: bool = False):
        if self.i >= len(self.p):
            return None
        c = self.p[self.i]
        if c in "*+?":
            if not peek:
                self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        m = _COUNT.match(self.p, self.i)
        if c != "{" or m is None or (m[1] == "" and m[2] == ""):
            return None  # a "{" that is no quantifier is a literal, as in Python
        if self.ecma and m[1] == "":
            raise self.error(f"{m[0]}: ECMA-262 reads it as text, Python as a count")
        lo = int(m[1] or 0)
        hi = lo if not m[2] else (int(m[3]) if m[3] else None)
        if hi is not None and hi < lo:
            raise self.error(f"min repeat greater than max repeat in {m[0]}")
        if not peek:
            self.i = m.end()
        return lo, hi

    def atom(self):
        p, c = self.p, self.p[self.i]
        if c in "*+?" or self.quantifier(peek=True) is not None:
            raise self.error("nothing to repeat")
        self.i += 1
        if c == "(":
            if p.startswith("?:", self.i):
                self.i += 2
            elif p.startswith("?P<", self.i) or (
                p.startswith("?<", self.i) and p[self.i + 2 : self.i + 3] not in ("=", "!")
            ):
                end = p.find(">", self.i)
                if end < 0:
                    raise self.error("unterminated group name")
                self.i = end + 1
            elif p.startswith("?", self.i):
                what = p[self.i : self.i + 3]
                raise self.error(
                    f"(?{what[1:]}... (lookaround, flags, backreferences) is not supported"
                )
            node = self.alt()
            if self.i >= len(p) or p[self.i] != ")":
                raise self.error("missing )")
            self.i += 1
            return node
        if c == ")":
            raise self.error("unbalanced parenthesis")
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", _ECMA_DOT if self.ecma else _ANY_BUT_NEWLINE)
        if c in "^$":
            self.i -= 1
            raise self.error(f"anchor {c!r} is only supported at the pattern's ends")
        if c == "\\":
            esc = self.escape(in_class=False)
            return ("set", esc) if isinstance(esc, tuple) else _lit(esc)
        return _lit(self.char(c))

    def char(self, c: str) -> int:
        """The codepoint of `c`, read at self.i - 1; ValueError for a surrogate."""
        if _SURROGATES[0] <= ord(c) <= _SURROGATES[1]:
            self.i -= 1
            raise self.error(f"U+{ord(c):04X} is a surrogate, not a character")
        return ord(c)

    def escape(self, in_class: bool):
        """After a backslash: a codepoint (int) or a class (ranges)."""
        if self.i >= len(self.p):
            raise self.error("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _ecma_class(c, in_class and self.negated) if self.ecma else _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES and not (self.ecma and c == "a"):
            return _CHAR_ESCAPES[c]
        if c == "b" and in_class:
            return 8
        if c in "xuU" and not (self.ecma and c == "U"):
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits")
            self.i += n
            cp = int(digits, 16)
            if cp > _MAX_CP:
                raise self.error(f"\\{c}{digits} is past U+10FFFF")
            if _SURROGATES[0] <= cp <= _SURROGATES[1]:
                raise self.error(f"\\{c}{digits} is a surrogate, not a character")
            return cp
        if c.isascii() and c.isalnum():
            what = {
                "b": "word boundaries",
                "B": "word boundaries",
                "A": "anchors",
                "Z": "anchors",
                "z": "anchors",
                "G": "anchors",
                "p": "Unicode properties",
                "P": "Unicode properties",
                "k": "backreferences",
            }.get(c, "backreferences" if c.isdigit() else "this escape")
            self.i -= 2
            raise self.error(f"\\{c}: {what} are not supported")
        return self.char(c)

    def char_class(self):
        p, start = self.p, self.i - 1
        negated = self.negated = p.startswith("^", self.i)
        self.i += negated
        if self.ecma and p.startswith("]", self.i):
            raise self.error(f"{p[start : self.i + 1]}: ECMA-262 and Python read it differently")
        ranges, first = [], True
        while True:
            if self.i >= len(p):
                self.i = start
                raise self.error("unterminated character class")
            c = p[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if p.startswith("-", self.i) and self.i + 1 < len(p) and p[self.i + 1] != "]":
                self.i += 1
                hi = self.class_item()
                if isinstance(lo, tuple) or isinstance(hi, tuple) or hi < lo:
                    raise self.error("bad character range")
                ranges.append((lo, hi))
            else:
                ranges.extend(lo if isinstance(lo, tuple) else [(lo, lo)])
        return negate(ranges) if negated else _norm(ranges)

    def class_item(self):
        c = self.p[self.i]
        self.i += 1
        return self.escape(in_class=True) if c == "\\" else self.char(c)


@contextlib.contextmanager
def nesting(what: str):
    """A RecursionError (parsing, compiling or converting something nested hundreds of
    levels deep) as a ValueError naming `what`."""
    try:
        yield
    except RecursionError:
        raise ValueError(f"{what:.200} nests too deeply") from None


def parse(pattern: str, *, ecma: bool = False):
    """The AST of `pattern` (`ecma`: a JSON Schema pattern, read as the module docstring
    says); TypeError for a non-str, ValueError (naming the pattern and the position) for
    one outside the subset."""
    if not isinstance(pattern, str):
        raise TypeError(f"a regex must be a str, got {type(pattern).__name__}: {pattern!r:.80}")
    with nesting(f"regex {pattern!r}"):
        return _Parser(pattern, ecma).parse()


def escape(text: str) -> str:
    """`text` as a regex matching it literally (our parser's escapes)."""
    return "".join("\\" + c if c in "\\.^$*+?{}[]()|-" else c for c in text)


def _class_text(ranges) -> str:
    def one(cp: int) -> str:
        if cp < 128 and chr(cp).isalnum():
            return chr(cp)
        return f"\\x{cp:02x}" if cp < 256 else f"\\u{cp:04x}" if cp < 65536 else f"\\U{cp:08x}"

    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return one(ranges[0][0])
    if not ranges:
        return "[^\\x00-\\U0010ffff]"  # nothing
    return "[" + "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in ranges) + "]"


def to_text(node) -> str:
    """Regex text of an AST (for patterns rewritten by `pagedjax.json_schema`)."""
    kind = node[0]
    if kind == "set":
        return _class_text(node[1])
    if kind == "cat":
        return "".join(to_text(n) for n in node[1])
    if kind == "alt":
        return "(?:" + "|".join(to_text(n) for n in node[1]) + ")"
    lo, hi = node[2], node[3]
    return f"(?:{to_text(node[1])}){{{lo},{'' if hi is None else hi}}}"


def map_sets(node, fn):
    """`node` with each character set replaced by the node `fn(ranges)`."""
    if node[0] == "set":
        return fn(node[1])
    if node[0] == "rep":
        return ("rep", map_sets(node[1], fn), node[2], node[3])
    return (node[0], [map_sets(n, fn) for n in node[1]])


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

    def closure(states: frozenset) -> frozenset:
        nonlocal work
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
