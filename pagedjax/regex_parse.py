"""Regex text to ASTs and back: the regex syntax `pagedjax.regex_dfa` compiles.

`parse` reads a pattern into an AST of character sets (sorted codepoint ranges),
concatenations, alternations and counted repetitions; `to_text` writes an AST back as
regex text, `escape` text as a literal, and `map_sets` (with `negate` and `intersect` on
character sets) rewrites an AST's sets, as `pagedjax.json_schema` does to a pattern. The
syntax is one concern, the automata `regex_dfa` builds from the AST another:
`json_schema` rewrites patterns without building a DFA.

Regex subset (full-match semantics): literals; escapes \\d \\w \\s \\D \\W \\S (ASCII
meanings: [0-9], [A-Za-z0-9_], [\\t-\\r ] and the characters outside them), \\n \\t \\r
\\f \\v \\a, \\xhh \\uhhhh \\Uhhhhhhhh, escaped punctuation; `.` (any character but
newline); classes [a-z] [^...]; groups ( ) (?: ) (?P<name> ) (?<name> ); alternation;
quantifiers * + ? {m} {m,} {,n} {m,n} and their lazy forms (the language is the same). ^
at the start and $ at the end are ignored. Refused (ValueError naming the pattern and the
position): backreferences, lookaround, inline flags, possessive quantifiers, \\b \\B \\A
\\Z, \\p{...}, anchors elsewhere (\\b in a class is a backspace), surrogates; as in Python,
group names that are no identifiers or repeat and counts over 2**32 - 2 (a "{" before
other than ASCII digits is a literal).

`parse(pattern, ecma=True)` reads a JSON Schema `pattern` (ECMA-262) so that every string
it matches is one both ECMA-262 and Python's `re` (whose \\d \\w \\s are Unicode's) match:
\\d \\w \\s are ASCII's, \\D \\W \\S leave out every character either reads as a digit,
word character or space (in a negated class, the other way round), `.` leaves out \\r
U+2028 U+2029 too, and what they read differently is refused: [] [^] {,n} \\a \\U.

A pattern nested too deeply for the recursion is a ValueError (`nesting`, which
`regex_dfa` and `pagedjax.grammar` use around their own recursions too).
"""

from __future__ import annotations

import contextlib
import functools
import re

__all__ = ["escape", "intersect", "map_sets", "negate", "nesting", "parse", "to_text"]

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


# {m} {m,} {,n} {m,n}: ASCII digits only (a "{" before other digits is a literal, as in Python).
_COUNT = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")
_MAX_REPEAT = 2**32 - 2  # Python's largest count (a larger one is its OverflowError)


def _lit(cp: int):
    return ("set", ((cp, cp),))


class _Parser:
    """Recursive descent over the regex subset in the module docstring."""

    def __init__(self, pattern: str, ecma: bool = False):
        self.p, self.i, self.ecma = pattern, 0, ecma
        self.negated = False  # in a negated class
        self.names: set[str] = set()  # group names so far

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
        lo = self.count(m[1] or "0", m[0])
        hi = lo if not m[2] else (self.count(m[3], m[0]) if m[3] else None)
        if hi is not None and hi < lo:
            raise self.error(f"min repeat greater than max repeat in {m[0]}")
        if not peek:
            self.i = m.end()
        return lo, hi

    def count(self, digits: str, text: str) -> int:
        """A repetition count's value (not int() of thousands of digits: its own ValueError)."""
        digits = digits.lstrip("0") or "0"
        if len(digits) > len(str(_MAX_REPEAT)) or int(digits) > _MAX_REPEAT:
            raise self.error(f"{text:.40}: the repetition count is too large")
        return int(digits)

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
                self.group_name()
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

    def group_name(self) -> None:
        """Skips `?P<name>` or `?<name>`. A name is an identifier (`$` too in ECMA mode) and,
        as Python requires, used once: `(?<a)b>x)` is refused, not read as a group of `x`."""
        start = self.p.index("<", self.i) + 1
        end = self.p.find(">", start)
        if end < 0:
            raise self.error("unterminated group name")
        name = self.p[start:end]
        if not (name.replace("$", "_") if self.ecma else name).isidentifier():
            raise self.error(f"bad group name {name!r:.40}")
        if name in self.names and not self.ecma:
            raise self.error(f"group name {name!r:.40} is defined twice")
        self.names.add(name)
        self.i = end + 1

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
            }.get(c, "")
            if c.isdigit():  # (Python: octal in a class or after \0, else a group's number)
                what = "octal escapes" if c == "0" or in_class else "backreferences"
            self.i -= 2
            raise self.error(f"\\{c}: {what + ' are' if what else 'this escape is'} not supported")
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
