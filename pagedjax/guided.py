"""Structured outputs: constrain generation to a regex, a list of choices or a JSON schema.

`StructuredOutputsParams` (as vLLM's) names the constraint; `compile_guide` turns it into
a `Guide` for one tokenizer: a byte DFA and, per DFA state, the bitmask of the tokens
whose bytes keep the match alive. Everything here runs on the host, in numpy.

Matching is on bytes: the text is the concatenation of the tokens' UTF-8 bytes
(`token_bytes`). A pattern compiles as: regex text -> AST (`_Parser`, our own subset)
-> Thompson NFA over bytes (character classes become UTF-8 byte-range sequences) ->
DFA by subset construction (at most `MAX_DFA_STATES` states), with the states that
cannot reach acceptance merged into the dead state 0.

Regex subset (full-match semantics): literals; escapes \\d \\w \\s \\D \\W \\S (ASCII
meanings, as JSON Schema's ECMA regexes), \\n \\t \\r \\f \\v \\a, \\xhh \\uhhhh
\\Uhhhhhhhh, escaped punctuation; `.` (any character but newline); classes [a-z] [^...];
groups ( ) (?: ) (?P<name> ) (?<name> ); alternation; quantifiers * + ? {m} {m,} {,n}
{m,n} and their lazy forms (the language is the same). ^ at the start and $ at the end
are ignored. Refused: backreferences, lookaround, inline flags, possessive quantifiers,
\\b \\B \\A \\Z, \\p{...}, anchors elsewhere (\\b in a class is a backspace).

Size: a bounded count repeats its automaton (`"x{0,500}"` is 500 copies), so a pattern
whose NFA would pass `MAX_NFA_STATES` is refused on construction, and one whose DFA
passes `MAX_DFA_STATES` by `compile_guide` (a JSON string's maxLength: about 800).

JSON schema subset (`_Schema`): see `StructuredOutputsParams`.

Token masks (`Guide.allowed`): the DFA is a numpy table [S, 256] and the tokens' bytes a
padded matrix; a state's mask walks every token at once, one gather per byte position
over the tokens still alive (the bytes past the 16th in a second pass), and keeps those
that end in a live state: about 8 ms on the CPU for 128k tokens that all survive 16
bytes, well under 1 ms where most die on their first byte. Masks are cached per state.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import json as jsonlib
import re
import threading
import weakref

import numpy as np

from pagedjax.tokenizer import Tokenizer

__all__ = ["Guide", "StructuredOutputsParams", "compile_guide", "token_bytes"]

MAX_DFA_STATES = 20_000
MAX_NFA_STATES = 200_000  # counted on the AST before building (`_nfa_size`)
MAX_REGEX_CHARS = 1_000_000  # regex text of a JSON schema
# Default whitespace between JSON tokens: one optional space. It adds one DFA state per
# separator (a bounded run like [ \n\t]{0,4} adds four) and keeps a model from spending
# its tokens on runs of whitespace; json.dumps's ", " / ": " style fits it.
DEFAULT_WHITESPACE = "[ ]?"
# Containers nested in json_object=True (the outer object counted) and in {} schemas.
JSON_DEPTH = 3
MASK_CACHE_SIZE = 4096  # masks kept per guide (16 KiB each at a 128k vocabulary)

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


def _negate(ranges) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for lo, hi in _norm(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CP:
        out.append((start, _MAX_CP))
    return _norm(out)


def _intersect(a, b) -> tuple[tuple[int, int], ...]:
    return _negate(_negate(a) + _negate(b))


_DIGIT = ((48, 57),)
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = ((9, 13), (32, 32))
_CLASS_ESCAPES = {
    "d": _DIGIT,
    "w": _WORD,
    "s": _SPACE,
    "D": _negate(_DIGIT),
    "W": _negate(_WORD),
    "S": _negate(_SPACE),
}
_CHAR_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
_ANY_BUT_NEWLINE = _negate(((10, 10),))


# ---------------------------------------------------------------------------- regex AST
# Nodes: ("set", ranges) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max).


_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")  # {m} {m,} {,n} {m,n}


def _lit(cp: int):
    return ("set", ((cp, cp),))


class _Parser:
    """Recursive descent over the regex subset in the module docstring."""

    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

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
            return ("set", _ANY_BUT_NEWLINE)
        if c in "^$":
            self.i -= 1
            raise self.error(f"anchor {c!r} is only supported at the pattern's ends")
        if c == "\\":
            esc = self.escape(in_class=False)
            return ("set", esc) if isinstance(esc, tuple) else _lit(esc)
        return _lit(ord(c))

    def escape(self, in_class: bool):
        """After a backslash: a codepoint (int) or a class (ranges)."""
        if self.i >= len(self.p):
            raise self.error("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[c]
        if c == "b" and in_class:
            return 8
        if c in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits")
            self.i += n
            cp = int(digits, 16)
            if cp > _MAX_CP:
                raise self.error(f"\\{c}{digits} is past U+10FFFF")
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
        return ord(c)

    def char_class(self):
        p, start = self.p, self.i - 1
        negated = p.startswith("^", self.i)
        self.i += negated
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
        return _negate(ranges) if negated else _norm(ranges)

    def class_item(self):
        c = self.p[self.i]
        self.i += 1
        return self.escape(in_class=True) if c == "\\" else ord(c)


@contextlib.contextmanager
def _nesting(what: str):
    """A RecursionError (parsing, compiling or converting something nested hundreds of
    levels deep) as a ValueError naming `what`."""
    try:
        yield
    except RecursionError:
        raise ValueError(f"{what:.200} nests too deeply") from None


def _parse(pattern: str):
    if not isinstance(pattern, str):
        raise TypeError(f"a regex must be a str, got {type(pattern).__name__}: {pattern!r:.80}")
    with _nesting(f"regex {pattern!r}"):
        return _Parser(pattern).parse()


def _escape(text: str) -> str:
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


def _to_text(node) -> str:
    """Regex text of an AST (for patterns rewritten by `_Schema`)."""
    kind = node[0]
    if kind == "set":
        return _class_text(node[1])
    if kind == "cat":
        return "".join(_to_text(n) for n in node[1])
    if kind == "alt":
        return "(?:" + "|".join(_to_text(n) for n in node[1]) + ")"
    lo, hi = node[2], node[3]
    return f"(?:{_to_text(node[1])}){{{lo},{'' if hi is None else hi}}}"


def _map_sets(node, fn):
    if node[0] == "set":
        return ("set", fn(node[1]))
    if node[0] == "rep":
        return ("rep", _map_sets(node[1], fn), node[2], node[3])
    return (node[0], [_map_sets(n, fn) for n in node[1]])


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
class _DFA:
    """A byte DFA. State 0 is dead (absorbing); every other state can reach acceptance."""

    trans: np.ndarray  # [S, 256] int32
    accept: np.ndarray  # [S] bool
    initial: int

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = int(self.trans[state, b])
        return state


def _compile_dfa(pattern: str) -> _DFA:
    ast = _parse(pattern)
    _check_size(pattern, ast)
    nfa = _NFA()
    start = nfa.new()
    with _nesting(f"regex {pattern!r}"):
        final = nfa.build(ast, start)
    # DFA states are sets of the NFA states that have byte edges (or are final).
    keep = [bool(e) or i == final for i, e in enumerate(nfa.edges)]
    closures: dict[frozenset, frozenset] = {}

    def closure(states: frozenset) -> frozenset:
        got = closures.get(states)
        if got is None:
            seen, stack = set(states), list(states)
            while stack:
                for t in nfa.eps[stack.pop()]:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            got = closures[states] = frozenset(t for t in seen if keep[t])
        return got

    first = closure(frozenset([start]))
    index, sets, rows = {first: 0}, [first], []
    while len(rows) < len(sets):
        edges = [e for q in sets[len(rows)] for e in nfa.edges[q]]
        row = np.full(256, -1, np.int32)
        cuts = sorted({e[0] for e in edges} | {e[1] + 1 for e in edges})
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
    return _DFA(table, np.concatenate([[False], accept[live]]), int(new_id[0]))


def _check_size(pattern: str, ast) -> None:
    with _nesting(f"regex {pattern!r}"):
        size = _nfa_size(ast)
    if size > MAX_NFA_STATES:
        raise ValueError(
            f"regex of {len(pattern)} characters {pattern!r:.100} is too large: about "
            f"{size} NFA states (limit {MAX_NFA_STATES}); lower its repetition counts"
        )


# ---------------------------------------------------------------------------- JSON schema

_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))'
_JSON_SAFE = _negate([(0, 0x1F), (34, 34), (92, 92)])  # chars a string holds unescaped
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_SCALARS = {
    "string": f'"{_STRING_CHAR}*"',
    "integer": _INTEGER,
    "number": _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?",
    "boolean": "(?:true|false)",
    "null": "null",
}
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_HM = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = _HM + r":[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-]" + _HM + ")"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "-".join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12)),
    "email": r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)+",
}
# Keywords that do not change the language we generate.
_IGNORED = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "additionalProperties", "$defs", "definitions", "readOnly", "writeOnly", "deprecated",
}  # fmt: skip
_KEYWORDS = _IGNORED | {
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required",
    "items", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
}  # fmt: skip


class _Schema:
    """JSON schema -> regex text; `ws` is the regex of the whitespace between tokens."""

    def __init__(self, root: dict, ws: str):
        self.root, self.ws, self.refs = root, ws, []

    def error(self, path: str, msg: str) -> ValueError:
        return ValueError(f"JSON schema at {path}: {msg}")

    def value(self, s, path: str) -> str:
        if s is True or s == {}:
            return self.any_value(JSON_DEPTH)
        if not isinstance(s, dict):
            raise self.error(path, f"a schema must be an object, got {s!r:.80}")
        unknown = sorted(set(s) - _KEYWORDS)
        if unknown:
            raise self.error(path, f"keyword {unknown[0]!r} is not supported")
        if "$ref" in s:
            return self.ref(s["$ref"], path)
        if "const" in s:
            return self.literal(s["const"])
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise self.error(path, f"enum must be a non-empty list, got {s['enum']!r:.80}")
            return "(?:" + "|".join(self.literal(v) for v in s["enum"]) + ")"
        for key in ("anyOf", "oneOf", "allOf"):
            if key in s:
                subs = s[key]
                if not isinstance(subs, list) or not subs:
                    raise self.error(path, f"{key} must be a non-empty list, got {subs!r:.80}")
                if key == "allOf" and len(subs) != 1:
                    raise self.error(path, "allOf is supported with one schema only")
                alts = [self.value(x, f"{path}/{key}/{i}") for i, x in enumerate(subs)]
                return "(?:" + "|".join(alts) + ")"
        kind = s.get("type")
        if kind is None:
            kind = "object" if "properties" in s else "array" if "items" in s else None
            if kind is None:
                return self.any_value(JSON_DEPTH)
        if isinstance(kind, list) and kind:
            alts = [self.typed(dict(s, type=k), k, path) for k in kind]
            return "(?:" + "|".join(alts) + ")"
        return self.typed(s, kind, path)

    def typed(self, s: dict, kind, path: str) -> str:
        if kind == "object":
            return self.object(s, path)
        if kind == "array":
            return self.array(s, path)
        if kind == "string":
            return self.string(s, path)
        if isinstance(kind, str) and kind in _SCALARS:
            return _SCALARS[kind]
        raise self.error(path, f"type {kind!r} is not supported")

    def ref(self, ref, path: str) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.error(path, f"$ref {ref!r:.80} is not supported (only local refs)")
        if ref in self.refs:
            raise self.error(path, f"recursive $ref {ref!r} is not supported")
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise self.error(path, f"$ref {ref!r} points to nothing")
        self.refs.append(ref)
        try:
            return self.value(node, ref)
        finally:
            self.refs.pop()

    def literal(self, v) -> str:
        """A regex matching the JSON text of the value `v` (with whitespace between tokens)."""
        if isinstance(v, dict):
            items = [self.literal(str(k)) + self.colon + self.literal(x) for k, x in v.items()]
            return r"\{" + self.ws + self.comma.join(items) + self.ws + r"\}"
        if isinstance(v, list):
            return r"\[" + self.ws + self.comma.join(map(self.literal, v)) + self.ws + r"\]"
        return _escape(jsonlib.dumps(v, ensure_ascii=False))

    @property
    def comma(self) -> str:
        return self.ws + "," + self.ws

    @property
    def colon(self) -> str:
        return self.ws + ":" + self.ws

    def string(self, s: dict, path: str) -> str:
        lo, hi = self.count(s, "minLength", 0, path), self.count(s, "maxLength", None, path)
        constraints = [k for k in ("pattern", "format") if k in s]
        if len(constraints) > 1 or (constraints and ("minLength" in s or "maxLength" in s)):
            given = constraints + [k for k in ("minLength", "maxLength") if k in s]
            raise self.error(path, f"{' with '.join(given)} is not supported")
        if "format" in s:
            if s["format"] not in _FORMATS:
                raise self.error(path, f"format {s['format']!r:.80} is not supported")
            return f'"{_FORMATS[s["format"]]}"'
        if "pattern" in s:
            # The pattern's characters must stand in a JSON string unescaped.
            ast = _map_sets(_parse(s["pattern"]), lambda r: _intersect(r, _JSON_SAFE))
            return f'"{_to_text(ast)}"'
        if (lo, hi) == (0, None):
            return _SCALARS["string"]
        return f'"{_STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'

    def count(self, s: dict, key: str, default, path: str):
        v = s.get(key, default)
        if v is not default and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise self.error(path, f"{key} must be an int >= 0, got {v!r:.80}")
        return v

    def array(self, s: dict, path: str) -> str:
        lo, hi = self.count(s, "minItems", 0, path), self.count(s, "maxItems", None, path)
        if hi is not None and hi < lo:
            raise self.error(path, f"maxItems={hi} < minItems={lo}")
        item = self.value(s.get("items", {}), f"{path}/items")
        return r"\[" + self.ws + self.repeat(item, lo, hi) + self.ws + r"\]"

    def repeat(self, item: str, lo: int, hi: int | None) -> str:
        """`lo` to `hi` items separated by commas."""
        if hi == 0:
            return ""
        more = f"(?:{self.comma}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        return f"{item}{more}" if lo else f"(?:{item}{more})?"

    def object(self, s: dict, path: str) -> str:
        props = s.get("properties")
        if props is None:
            return self.any_object(JSON_DEPTH)
        if not isinstance(props, dict):
            raise self.error(path, f"properties must be an object, got {props!r:.80}")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise self.error(path, f"required must be a list of str, got {required!r:.80}")
        missing = sorted(set(required) - set(props))
        if missing:
            raise self.error(path, f"required property {missing[0]!r} is not in properties")
        items = [
            self.literal(k) + self.colon + self.value(v, f"{path}/properties/{k}")
            for k, v in props.items()
        ]
        req = [k in required for k in props]
        # Linear in the properties (one alternative per choice of the first property
        # given would grow the DFA quadratically). With a required one at r: the ones
        # before r are each "item ," or nothing, then ", item" after it.
        if any(req):
            r = req.index(True)
            body = "".join(f"(?:{items[j]}{self.comma})?" for j in range(r)) + items[r]
            body += "".join(
                f"(?:{self.comma}{items[j]}){'' if req[j] else '?'}"
                for j in range(r + 1, len(items))
            )
        elif items:  # Z_j = item_j | (item_j ,)? Z_j+1: a non-empty run from j on
            body = items[-1]
            for item in reversed(items[:-1]):
                body = f"(?:{item}|(?:{item}{self.comma})?{body})"
                if len(body) > MAX_REGEX_CHARS:  # (each step copies it: stop early)
                    raise self.error(path, f"its regex exceeds {MAX_REGEX_CHARS} characters")
            body = f"(?:{body})?"
        else:
            body = ""
        return r"\{" + self.ws + body + self.ws + r"\}"

    def any_value(self, depth: int) -> str:
        alts = list(_SCALARS.values())
        if depth > 0:
            alts += [self.any_object(depth), self.any_array(depth)]
        return "(?:" + "|".join(alts) + ")"

    def any_object(self, depth: int) -> str:
        member = _SCALARS["string"] + self.colon + self.any_value(depth - 1)
        return r"\{" + self.ws + self.repeat(member, 0, None) + self.ws + r"\}"

    def any_array(self, depth: int) -> str:
        return r"\[" + self.ws + self.repeat(self.any_value(depth - 1), 0, None) + self.ws + r"\]"


# ---------------------------------------------------------------------------- the params


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a completion must match, as vLLM's `StructuredOutputsParams`: exactly one of
    `json`, `regex`, `choice`, `grammar` (refused) or `json_object=True`.

    Attributes:
      json: a JSON schema, a dict or its JSON text. Supported: type string (enum,
        const, pattern, minLength/maxLength, format date / time / date-time / uuid /
        email), integer, number, boolean, null, array (items, minItems/maxItems),
        object (properties in declared order, `required`; optional ones may be left
        out; no other keys are generated: additionalProperties is ignored; without
        properties, any object), enum, const, anyOf/oneOf, allOf of one schema, type
        lists, local $ref (#/$defs/..., #/definitions/...; not recursive) and {} (any
        value). Annotations (title, description, default, ...) are ignored; any other
        keyword, a pattern combined with lengths, or an unknown format is a ValueError
        naming it. A string `pattern` matches the whole string's characters as written
        unescaped (characters that need a JSON escape are left out of its classes).
      regex: a regex the whole completion matches (the subset in the module docstring).
      choice: the completion is one of these strings (a list is stored as a tuple).
      grammar: refused (ValueError): grammars are not supported.
      json_object: True: any JSON object, containers nested at most `JSON_DEPTH` deep
        (the object itself counted: {"a": {"b": [1]}} is 3 deep).
      disable_any_whitespace: JSON: no whitespace between tokens.
      whitespace_pattern: JSON: the regex of the whitespace between tokens (default
        `DEFAULT_WHITESPACE`, one optional space).

    Construction checks the types and compiles the spec to regex text (`to_regex`),
    parsing it and counting its NFA states, so a bad value fails here; the DFA (which
    may still be too large) and the token masks are built by `compile_guide`. Equal
    specs hash alike (by their regex), as the frozen params holding them do.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
        for name, allow_none in (("json_object", True), ("disable_any_whitespace", False)):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (allow_none and value is None)):
                raise TypeError(f"{name} must be a bool, got {name}={value!r:.80}")
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except ValueError as e:
                raise ValueError(f"json is not valid JSON ({e}): json={self.json!r:.100}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json must be a JSON schema object, got json={self.json!r:.100}")
        elif isinstance(schema, dict):
            object.__setattr__(self, "json", copy.deepcopy(schema))  # frozen: ours alone
        elif schema is not None:
            raise TypeError(
                f"json must be a dict or its JSON text, got {type(schema).__name__}: "
                f"json={schema!r:.80}"
            )
        choice = self.choice
        if choice is not None:
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
                raise TypeError(f"choice must be a list of str, got choice={choice!r:.100}")
            bad = [c for c in choice if not isinstance(c, str)]
            if bad or not choice:
                raise ValueError(
                    f"choice must be a non-empty list of str, got choice={choice!r:.100}"
                )
            object.__setattr__(self, "choice", tuple(choice))
        given = [
            f"{name}={getattr(self, name)!r:.60}"
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object=True"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar or json_object=True, got "
                + (", ".join(given) or "none")
            )
        if self.grammar is not None:
            raise ValueError(
                "grammar is not supported (use json, regex or choice): "
                f"grammar={self.grammar!r:.80}"
            )
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError(
                "give disable_any_whitespace=True or whitespace_pattern, not both: "
                f"whitespace_pattern={self.whitespace_pattern!r:.80}"
            )
        if self.regex is not None:
            pattern = self.regex
        elif self.choice is not None:
            pattern = "(?:" + "|".join(map(_escape, self.choice)) + ")"
        else:
            ws = "" if self.disable_any_whitespace else self.whitespace_pattern
            if ws is None:
                ws = DEFAULT_WHITESPACE
            elif ws:
                _parse(ws)  # a bad one is named as itself
                ws = f"(?:{ws})"
            s = _Schema(schema, ws)
            with _nesting(f"json={self.json!r}"):
                pattern = s.any_object(JSON_DEPTH) if schema is None else s.value(schema, "#")
        if len(pattern) > MAX_REGEX_CHARS:
            raise ValueError(
                f"json={self.json!r:.100}: its regex exceeds {MAX_REGEX_CHARS} characters"
            )
        _check_size(pattern, _parse(pattern))
        object.__setattr__(self, "_pattern", pattern)

    def __hash__(self) -> int:
        return hash(self._pattern)

    def to_regex(self) -> str:
        """The regex (module docstring's subset) the whole completion must match: `regex`
        as given, or the one built for `choice` / `json` / `json_object`, which Python's
        `re` reads the same with `re.ASCII`."""
        return self._pattern


# ---------------------------------------------------------------------------- tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character alphabet (ByteLevel pre-tokenizers/decoders):
    printable Latin-1 bytes stand for themselves, the others for chr(256 + k) in order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}


_BYTE_LEVEL = {ord(c): b for b, c in _bytes_to_unicode().items()}  # char -> byte value
_BYTE_LEVEL_CHARS = frozenset(map(chr, _BYTE_LEVEL))
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_steps(tok) -> list[dict]:
    """The decoder's steps, flattened; ValueError for one whose per-token bytes we cannot
    tell."""
    if tok.decoder is None:
        raise ValueError("the tokenizer has no decoder: its tokens' bytes are unknown")
    config = jsonlib.loads(tok.decoder.__getstate__())
    steps = config["decoders"] if config.get("type") == "Sequence" else [config]
    fused = False
    for step in steps:
        kind = step.get("type")
        if kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and not step.get("stop"):
            pass  # strips the text's start: the prompt's, for a completion
        elif kind == "Replace" and set(step.get("pattern", {})) == {"String"}:
            pass
        elif kind not in ("ByteLevel", "ByteFallback", "Metaspace"):
            raise ValueError(f"tokenizer decoder {kind!r} is not supported: {step!r:.120}")
    return steps


def token_bytes(tokenizer: Tokenizer) -> list[bytes | None]:
    """Each id's bytes in generated text (UTF-8), by the tokenizer's decoder: ByteLevel
    (GPT-2's alphabet inverted; a token with other characters is its own UTF-8, as HF
    decodes it), Metaspace / Replace of a string ("▁" is a space; the leading space a
    decoder strips from a text's first token is kept: a completion follows its prompt),
    ByteFallback (`<0xNN>` is the byte NN), Fuse and Strip of the text's start. Added
    and special tokens are None. Another decoder is a ValueError naming it.
    """
    tok = tokenizer.tokenizer
    steps = _decoder_steps(tok)
    added = tok.get_added_tokens_decoder()
    out: list[bytes | None] = []
    for i in range(tokenizer.vocab_size):
        piece = None if i in added else tok.id_to_token(i)
        if piece is None:
            out.append(None)
            continue
        value: str | bytes = piece
        for step in steps:
            kind = step["type"]
            if isinstance(value, bytes):
                break
            if kind == "Replace":
                value = value.replace(step["pattern"]["String"], step["content"])
            elif kind == "Metaspace":
                value = value.replace(step.get("replacement", "▁"), " ")
            elif kind == "ByteFallback":
                m = _BYTE_FALLBACK.fullmatch(value)
                value = bytes([int(m[1], 16)]) if m else value
            elif kind == "ByteLevel" and _BYTE_LEVEL_CHARS.issuperset(value):
                value = value.translate(_BYTE_LEVEL).encode("latin-1")
        out.append(value if isinstance(value, bytes) else value.encode("utf-8"))
    return out


class _TokenTable:
    """Token bytes for vectorized DFA walks: the first `HEAD` bytes of every token in a
    padded matrix, the rest of the longer tokens in another."""

    HEAD = 16

    def __init__(self, toks: list[bytes | None]):
        self.bytes = [t or None for t in toks]
        self.lens = np.array([len(t) if t else 0 for t in toks], np.int32)  # [n]
        self.width = max(1, min(self.HEAD, int(self.lens.max(initial=0))))
        self.head = _pad_columns([t[: self.width] if t else b"" for t in toks], self.width)
        self.long_ids = np.flatnonzero(self.lens > self.width)
        self.long_pos = np.full(len(toks), -1, np.int64)  # id -> row of `rest`
        self.long_pos[self.long_ids] = np.arange(len(self.long_ids))
        rest = [self.bytes[i][self.width :] for i in self.long_ids]
        self.rest = _pad_columns(rest, max(map(len, rest), default=0))


def _pad_columns(toks: list[bytes], width: int) -> np.ndarray:
    """[width, n] uint8: column k holds token k's bytes, zero-padded (rows contiguous,
    for gathers along the tokens)."""
    lens = np.fromiter(map(len, toks), np.int64, len(toks))
    out = np.zeros((width, len(toks)), np.uint8)
    if lens.sum():
        flat = np.frombuffer(b"".join(toks), np.uint8)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        out[np.arange(len(flat)) - starts, np.repeat(np.arange(len(toks)), lens)] = flat
    return out


# ---------------------------------------------------------------------------- the guide


class Guide:
    """A compiled structured output for one tokenizer and vocabulary size.

    States are ints; `initial_state` starts a completion and `advance` steps it.
    `allowed(state)` is a uint32 bitmask [ceil(vocab_size / 32)] with bit t % 32 of word
    t // 32 set for each token t whose bytes keep the match alive; special and added
    tokens, tokens without bytes and ids past the tokenizer's vocabulary never are.
    Masks are cached per state (the last `MASK_CACHE_SIZE`) and read-only.

    Attributes:
      vocab_size: the mask's number of ids (the model's, possibly padded).
      initial_state: the state of an empty completion.
      num_states: the DFA's states, the dead one included.
      pattern: the regex it matches.
    """

    def __init__(self, dfa: _DFA, table: _TokenTable, vocab_size: int, pattern: str = ""):
        self._dfa, self._table, self.vocab_size, self.pattern = dfa, table, vocab_size, pattern
        self._flat = dfa.trans.ravel()  # [S * 256]: next state = flat[state * 256 + byte]
        self.initial_state = dfa.initial
        self.num_states = len(dfa.trans)
        self._masks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def _check_state(self, state) -> int:
        if isinstance(state, bool) or not isinstance(state, (int, np.integer)):
            raise TypeError(f"state must be an int, got {type(state).__name__}: {state!r:.40}")
        if not 0 < state < self.num_states:
            raise ValueError(f"state {state} is not a live state of this guide")
        return int(state)

    def _ends(self, state: int) -> np.ndarray:
        """[n] int32: each token's end state from `state` (0: dead, or no bytes)."""
        flat, tab = self._flat, self._table
        ends = flat[np.int32(state * 256) + tab.head[0]]
        idx = np.flatnonzero((ends != 0) & (tab.lens > 1))
        for j in range(1, tab.width):
            if not idx.size:
                break
            e = ends[idx] = flat[ends[idx] * 256 + tab.head[j, idx]]
            idx = idx[(e != 0) & (tab.lens[idx] > j + 1)]
        rows = tab.long_pos[idx]  # the long tokens still alive
        for j in range(tab.rest.shape[0]):
            if not idx.size:
                break
            e = ends[idx] = flat[ends[idx] * 256 + tab.rest[j, rows]]
            keep = (e != 0) & (tab.lens[idx] > tab.width + j + 1)
            idx, rows = idx[keep], rows[keep]
        ends[tab.lens == 0] = 0
        return ends

    def allowed(self, state: int) -> np.ndarray:
        """uint32 [ceil(vocab_size / 32)] bitmask of the tokens allowed in `state`."""
        state = self._check_state(state)
        mask = self._masks.get(state)
        if mask is not None:
            self._masks.move_to_end(state)
            return mask
        ok = self._ends(state)[: self.vocab_size] != 0
        words = -(-self.vocab_size // 32)
        bits = np.zeros(words * 32, bool)
        bits[: len(ok)] = ok
        mask = np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)
        mask.flags.writeable = False
        self._masks[state] = mask
        if len(self._masks) > MASK_CACHE_SIZE:
            self._masks.popitem(last=False)
        return mask

    def advance(self, state: int, token_id: int) -> int:
        """The state after `token_id`; ValueError if it is not allowed in `state`."""
        state = self._check_state(state)
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
            raise TypeError(f"token_id must be an int, got {token_id!r:.40}")
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token_id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        data = self._table.bytes[token_id] if token_id < len(self._table.bytes) else None
        if data is None:
            raise ValueError(
                f"token {token_id} has no text (special, added or padding): not allowed"
            )
        nxt = self._dfa.walk(state, data)
        if nxt == 0:
            raise ValueError(f"token {token_id} ({data!r}) is not allowed in state {state}")
        return nxt

    def accepting(self, state: int) -> bool:
        """Whether the text so far is a full match."""
        return bool(self._dfa.accept[self._check_state(state)])

    def can_continue(self, state: int) -> bool:
        """Whether some token is allowed in `state`."""
        return bool(self.allowed(state).any())


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> _TokenTable
_DFAS: collections.OrderedDict[str, _DFA] = collections.OrderedDict()
_GUIDES: collections.OrderedDict[tuple, Guide] = collections.OrderedDict()
_LOCK = threading.Lock()
CACHE_SIZE = 16  # guides (and DFAs) kept by compile_guide


def _lru(cache: collections.OrderedDict, key, make):
    with _LOCK:
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
            return value
    value = make()  # (outside the lock: compiles can take a while)
    with _LOCK:
        cache[key] = value
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return value


def compile_guide(spec: StructuredOutputsParams, tokenizer: Tokenizer, vocab_size: int) -> Guide:
    """The `Guide` of `spec` for `tokenizer` and a model of `vocab_size` ids (may exceed
    the tokenizer's: padded embeddings). Cached: the last `CACHE_SIZE` guides by the
    spec's regex, the tokenizer object and vocab_size (so masks computed for one request
    serve the next), and each tokenizer's token table while the tokenizer lives.

    Raises:
      TypeError: a wrong type of argument.
      ValueError: vocab_size < 1, the pattern's DFA is too large (`MAX_DFA_STATES`), it
        matches nothing, or the tokenizer's decoder is not supported (`token_bytes`).
    """
    if not isinstance(spec, StructuredOutputsParams):
        raise TypeError(f"spec must be a StructuredOutputsParams, got {type(spec).__name__}")
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a pagedjax Tokenizer, got {type(tokenizer).__name__}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r:.40}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size=}")
    pattern = spec.to_regex()

    def make() -> Guide:
        dfa = _lru(_DFAS, pattern, lambda: _compile_dfa(pattern))
        with _LOCK:
            table = _TABLES.get(tokenizer)
        if table is None:
            table = _TokenTable(token_bytes(tokenizer))
            with _LOCK:
                _TABLES[tokenizer] = table
        return Guide(dfa, table, int(vocab_size), pattern)

    return _lru(_GUIDES, (pattern, tokenizer, int(vocab_size)), make)
