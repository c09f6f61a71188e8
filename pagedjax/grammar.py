"""GBNF grammars to regexes, for structured outputs (`pagedjax.guided`).

`grammar_regex` reads a grammar in the GBNF / EBNF dialect of llama.cpp and of vLLM's
default backend (xgrammar) and writes the regex text (the subset `pagedjax.regex_dfa`
compiles) of the strings its rule `root` derives:

    root   ::= answer ("\\n" answer)*      # a comment
    answer ::= "yes" | "no" | [0-9]+ ("." [0-9]+)?

Syntax: rules `name ::= alternatives` (names of [a-zA-Z0-9_-]; a rule runs on over
several lines, until a line that starts `name ::=`); alternation `|` (an empty
alternative is the empty string); concatenation; groups `( )`; quantifiers `*` `+` `?`
`{m}` `{m,}` `{,n}` `{m,n}`; string literals in double quotes; character classes
`[a-z_]`, `[^"\\\\]`; `.` (any character, newline included, unlike a regex's); rule
references; comments `#` to the end of the line. Strings and classes take the escapes
\\n \\t \\r \\xHH \\uHHHH \\UHHHHHHHH, xgrammar's C escapes \\0 \\a \\b \\e \\f \\v (\\b a
backspace, as there) and a backslash before any ASCII punctuation (\\\\ \\" \\] \\- ...)
for that character. Anything else (xgrammar's lookahead `(= ...)`, Lark's `name: ...`
rules, `/regex/` terminals and `%` directives, single-quoted strings, unknown escapes,
a lone surrogate) is a ValueError naming it and its line:column, as are a rule defined
twice, a reference to no rule, no `root` and an empty grammar.

Recursion: a regex (a DFA) cannot count unboundedly, so a rule that derives itself
(directly or through others) is unrolled: it appears at most `RULE_DEPTH` times on any
path of a parse tree (the outermost counted), and deeper, the alternatives that would
recurse again are dropped. The language is the grammar's strings that have a parse tree
of that nesting depth: with `RULE_DEPTH = 3`, `root ::= "(" root ")" | "x"` matches x,
(x) and ((x)). Every rule that derives any string derives one at depth 1, so only a
rule whose every way recurses forever (`r ::= "(" r ")"`) matches nothing; a grammar
whose `root` then matches nothing is a ValueError naming those rules.

Size: each level copies the rule's regex, and rules are inlined where referenced, so a
grammar's regex can be far larger than the grammar: one over `MAX_REGEX_CHARS` is a
ValueError here, and one whose NFA or DFA is too large is refused by `pagedjax.guided`
with `too_large`'s hint (simplify the grammar or lower its nesting). So is, here, a
grammar over `MAX_GRAMMAR_CHARS` characters, and one whose expansion takes over
`MAX_EXPAND_STEPS` steps (mutually recursive rules are expanded once per way their
recursion nests: exponentially often in the rules, though the regex may stay small).
Everything else is linear in the grammar's size.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from pagedjax.json_schema import MAX_REGEX_CHARS
from pagedjax.regex_dfa import negate, nesting, to_text

__all__ = ["MAX_EXPAND_STEPS", "MAX_GRAMMAR_CHARS", "RULE_DEPTH", "grammar_regex", "too_large"]

# A recursive rule appears at most this many times on a path of a parse tree (as
# json_schema's REF_DEPTH for a $ref); each level copies its regex.
RULE_DEPTH = 3
_MAX_WORK = 16 * MAX_REGEX_CHARS  # characters built while expanding (and 8 per rule)
MAX_EXPAND_STEPS = 1_000_000  # grammar nodes expanded (about 1 s), as `_Expander.step` counts
MAX_GRAMMAR_CHARS = MAX_REGEX_CHARS  # the grammar's own text

_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_RULE_HEAD = re.compile(r"([a-zA-Z0-9_-]+)[ \t]*::=")
_COUNT = re.compile(r"\{[ \t]*(\d*)[ \t]*(,?)[ \t]*(\d*)[ \t]*\}")
_LARK_HEAD = re.compile(r"[?!]?[a-zA-Z_][a-zA-Z0-9_.]*[ \t]*:(?!:=)")
# llama.cpp's \n \t \r and xgrammar's C escapes besides (its ParseNextEscaped)
_ESCAPES = {"n": 10, "t": 9, "r": 13, "0": 0, "a": 7, "b": 8, "e": 27, "f": 12, "v": 11}
_ANY = negate(())  # every character
_MAX_CP = 0x10FFFF
_BACKSLASH = "\\"


# ---------------------------------------------------------------------------- the parser
# Grammar nodes: ("lit", str) | ("set", ranges) | ("ref", name, offset) | ("cat", [nodes])
# | ("alt", [nodes]) | ("rep", node, min, max or None).


class _Parser:
    """Recursive descent over the grammar syntax in the module docstring."""

    def __init__(self, text: str):
        self.t, self.i = text, 0

    def where(self, i: int) -> str:
        line_start = self.t.rfind("\n", 0, i) + 1
        return f"{self.t.count(chr(10), 0, i) + 1}:{i - line_start + 1}"

    def error(self, msg: str, i: int | None = None) -> ValueError:
        return ValueError(f"grammar at {self.where(self.i if i is None else i)}: {msg}")

    def skip(self) -> None:
        """Past whitespace (newlines included) and comments."""
        t = self.t
        while self.i < len(t):
            if t[self.i] == "#":
                end = t.find("\n", self.i)
                self.i = len(t) if end < 0 else end
            elif t[self.i].isspace():
                self.i += 1
            else:
                return

    def at_rule_head(self):
        """The `name ::=` match if one starts here at the start of its line."""
        head = _RULE_HEAD.match(self.t, self.i)
        if head is None:  # (first: looking back along a long line each time is quadratic)
            return None
        line_start = self.t.rfind("\n", 0, self.i) + 1
        return None if self.t[line_start : self.i].strip() else head

    def grammar(self) -> dict[str, tuple]:
        """{name: (node, offset of its head)} in order."""
        rules: dict[str, tuple] = {}
        self.skip()
        while self.i < len(self.t):
            head = self.at_rule_head()
            if head is None:
                lark = _LARK_HEAD.match(self.t, self.i)
                raise self.error(
                    "Lark's rule syntax (name: ...) is not supported: write name ::= ..."
                    if lark
                    else f"expected a rule (name ::= ...), got {self.t[self.i : self.i + 20]!r}"
                )
            name = head[1]
            if name in rules:
                first = self.where(rules[name][1])
                raise self.error(f"rule {name!r} is defined twice (first at {first})")
            start, self.i = self.i, head.end()
            rules[name] = (self.alternatives(nested=False), start)
        if not rules:
            raise ValueError("grammar is empty: it has no rules (write root ::= ...)")
        return rules

    def alternatives(self, nested: bool):
        branches = [self.sequence(nested)]
        while self.i < len(self.t) and self.t[self.i] == "|":
            self.i += 1
            branches.append(self.sequence(nested))
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self, nested: bool):
        items = []
        while True:
            self.skip()
            if self.i >= len(self.t) or self.t[self.i] == "|" or self.at_rule_head():
                break
            if self.t[self.i] == ")":
                if nested:
                    break
                raise self.error("unbalanced ')'")
            node = self.atom()
            while True:  # its quantifiers (GBNF lets whitespace come before them)
                self.skip()
                c = self.t[self.i : self.i + 1]
                if c and c in "*+?":
                    self.i += 1
                    node = ("rep", node, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
                elif c == "{":
                    node = ("rep", node, *self.count())
                else:
                    break
            items.append(node)
        return items[0] if len(items) == 1 else ("cat", items)

    def count(self) -> tuple[int, int | None]:
        m = _COUNT.match(self.t, self.i)
        if m is None or (m[1] == "" and m[3] == ""):
            raise self.error("bad repetition count: expected {m}, {m,}, {,n} or {m,n}")
        lo = self.number(m[1] or "0", m[0])
        hi = lo if not m[2] else self.number(m[3], m[0]) if m[3] else None
        if hi is not None and hi < lo:
            raise self.error(f"repetition count {m[0]}: its maximum is below its minimum")
        self.i = m.end()
        return lo, hi

    def number(self, digits: str, text: str) -> int:
        """A repetition count's value (not int() of thousands of digits: Python's own
        ValueError, naming neither the count nor where)."""
        digits = digits.lstrip("0") or "0"
        if len(digits) > 18:  # (far past any count the NFA's size limit lets through)
            raise self.error(f"repetition count {text:.40} is too large")
        return int(digits)

    def atom(self):
        t, start = self.t, self.i
        c = t[start]
        if c == '"':
            return ("lit", self.string())
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            self.i += 1
            return ("set", _ANY)
        if c == "(":
            self.i += 1
            self.skip()
            if t.startswith("=", self.i):
                raise self.error("lookahead assertions (= ...) are not supported", start)
            node = self.alternatives(nested=True)
            if not t.startswith(")", self.i):
                raise self.error("'(' is never closed", start)
            self.i += 1
            return node
        name = _NAME.match(t, start)
        if name is not None:
            self.i = name.end()
            return ("ref", name[0], start)
        raise self.error(self.unexpected())

    def unexpected(self) -> str:
        t, c = self.t[self.i :], self.t[self.i]
        if c in "*+?{":
            return f"{c!r} has nothing to repeat"
        if t.startswith("::="):
            return "'::=' out of place: a rule (name ::= ...) starts its own line"
        if c == ":":
            return "Lark's rule syntax (name: ...) is not supported: write name ::= ..."
        if c == "'":
            return "single-quoted strings are not supported: use double quotes"
        if c == "/":
            return "regex terminals /.../ (Lark) are not supported: use strings and [classes]"
        if c == "%":
            return "directives (%import, %ignore: Lark) are not supported"
        return f"unexpected character {c!r}"

    def escape(self) -> int:
        """The codepoint of the escape at the backslash here."""
        start, c = self.i, self.t[self.i + 1 : self.i + 2]
        self.i += 2
        if c in _ESCAPES:
            return _ESCAPES[c]
        if c and c in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.t[self.i : self.i + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits", start)
            self.i += n
            cp = int(digits, 16)
            if cp > _MAX_CP or 0xD800 <= cp <= 0xDFFF:
                why = "a surrogate" if cp <= _MAX_CP else "past U+10FFFF"
                raise self.error(f"\\{c}{digits} is not a character ({why})", start)
            return cp
        if c and c.isascii() and c.isprintable() and not c.isalnum():
            return ord(c)
        raise self.error(f"unknown escape {_BACKSLASH + c!r}", start)

    def string(self) -> str:
        start, out = self.i, []
        self.i += 1
        while True:
            c = self.t[self.i : self.i + 1]
            if c in ("", "\n"):
                raise self.error("unterminated string (a newline in one is written \\n)", start)
            if c == '"':
                self.i += 1
                return "".join(out)
            out.append(chr(self.escape() if c == "\\" else self.char()))

    def char_class(self):
        start = self.i
        self.i += 1
        negated = self.t.startswith("^", self.i)
        self.i += negated
        ranges = []
        while True:
            c = self.t[self.i : self.i + 1]
            if c in ("", "\n"):
                raise self.error("unterminated character class", start)
            if c == "]":
                self.i += 1
                break
            lo = self.class_char()
            if self.t.startswith("-", self.i) and self.t[self.i + 1 : self.i + 2] not in ("]", ""):
                dash = self.i
                self.i += 1
                hi = self.class_char()
                if hi < lo:
                    raise self.error(f"bad range {chr(lo)!r}-{chr(hi)!r} (end before start)", dash)
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        if not ranges:
            raise self.error("empty character class", start)
        ranges = negate(ranges) if negated else negate(negate(ranges))
        if not ranges:
            raise self.error("the character class matches no character", start)
        return ranges

    def class_char(self) -> int:
        return self.escape() if self.t[self.i] == "\\" else self.char()

    def char(self) -> int:
        """The codepoint of the character here, written as itself: a lone surrogate (a
        str may hold one: JSON's "\\ud800" decodes to it) is no character, as its
        escape is not."""
        cp = ord(self.t[self.i])
        if 0xD800 <= cp <= 0xDFFF:
            raise self.error(f"U+{cp:04X} is a surrogate, not a character")
        self.i += 1
        return cp


# ---------------------------------------------------------------------------- to regex text
# An expression is (text, precedence) or None (it matches nothing).

_ALT, _CAT, _ATOM = 0, 1, 2
_EMPTY = ("", _ATOM)
_SPECIAL = frozenset("\\.^$*+?{}[]()|-")


def _group(e, prec: int) -> str:
    return e[0] if e[1] >= prec else f"(?:{e[0]})"


def _literal(s: str):
    def one(c: str) -> str:
        if c in _SPECIAL:
            return "\\" + c
        if c.isprintable():  # (non-ASCII too: the regex parser reads characters)
            return c
        cp = ord(c)
        return f"\\x{cp:02x}" if cp < 256 else f"\\u{cp:04x}" if cp < 65536 else f"\\U{cp:08x}"

    return ("".join(map(one, s)), _ATOM if len(s) == 1 else _CAT) if s else _EMPTY


def _cat(parts):
    parts = [p for p in parts if p[0]]
    if len(parts) <= 1:
        return parts[0] if parts else _EMPTY
    return "".join(_group(p, _CAT) for p in parts), _CAT


def _alt(branches):
    texts = list(dict.fromkeys(b[0] for b in branches if b is not None))  # deduplicated
    if len(texts) <= 1:
        return next((b for b in branches if b is not None), None)
    return "|".join(texts), _ALT


def _rep(e, lo: int, hi: int | None):
    if e is None:
        return _EMPTY if lo == 0 else None
    if (lo, hi) == (1, 1):
        return e
    if hi == 0 or not e[0]:
        return _EMPTY
    suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
    if suffix is None:
        suffix = f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"
    return _group(e, _ATOM) + suffix, _CAT  # (a quantifier on it wraps it)


class _Expander:
    """Inlines rules from `root`, unrolling recursive ones `depth` deep."""

    def __init__(self, rules: dict[str, tuple], depth: int):
        self.rules, self.depth = rules, depth
        # A recursive rule's SCC: the rules it reaches that reach it back. Its expansion
        # depends on how often they are on the stack (no other rule on it reaches it).
        self.cycle = _recursive_sccs(_references(rules))
        self.productive = _productive(rules)
        self.stack: list[str] = []
        self.memo: dict = {}
        self.work = 0
        self.steps = 0  # nodes expanded and stack entries read: the time it takes

    def charge(self, e, n: int = 0):
        self.work += n + (len(e[0]) if e else 0)
        if (e and len(e[0]) > MAX_REGEX_CHARS) or self.work > _MAX_WORK:
            raise ValueError(
                f"grammar is too large: its regex exceeds {MAX_REGEX_CHARS} characters; "
                f"simplify it or lower its nesting (recursive rules are unrolled {self.depth} "
                "deep)"
            )
        return e

    def step(self, n: int = 1) -> None:
        """Counts `n` steps of expansion; ValueError past `MAX_EXPAND_STEPS` (mutually
        recursive rules are expanded once per count of each on the stack: exponentially
        often, though the regex, deduplicated, stays small)."""
        self.steps += n
        if self.steps > MAX_EXPAND_STEPS:
            raise ValueError(
                f"grammar is too large: expanding it takes over {MAX_EXPAND_STEPS} steps "
                f"(recursive rules are unrolled {self.depth} deep, once for each way their "
                "recursion nests); simplify it or lower its nesting"
            )

    def rule(self, name: str):
        if name not in self.productive:
            return None  # (it derives no string: every way through it recurses forever)
        cycle = self.cycle.get(name)
        if cycle is None:
            key = name
        else:
            self.step(len(self.stack))
            if self.stack.count(name) >= self.depth:
                return None
            key = (name, tuple(sorted(r for r in self.stack if r in cycle)))  # (their counts)
        if key not in self.memo:
            self.stack.append(name)
            self.memo[key] = self.expand(self.rules[name][0])
            self.charge(None, 8)
            self.stack.pop()
        return self.memo[key]

    def expand(self, node):
        self.step()
        kind = node[0]
        if kind == "lit":
            return _literal(node[1])
        if kind == "set":
            return to_text(node), _ATOM
        if kind == "ref":
            return self.rule(node[1])
        if kind == "cat":
            parts = []
            for n in node[1]:
                e = self.expand(n)
                if e is None:
                    return None
                parts.append(e)
            return self.charge(_cat(parts))
        if kind == "alt":
            return self.charge(_alt([self.expand(n) for n in node[1]]))
        return self.charge(_rep(self.expand(node[1]), node[2], node[3]))


def _ref_nodes(node):
    """The ("ref", name, offset) nodes in `node`."""
    kind = node[0]
    if kind == "ref":
        yield node
    elif kind in ("cat", "alt"):
        for n in node[1]:
            yield from _ref_nodes(n)
    elif kind == "rep":
        yield from _ref_nodes(node[1])


def _references(rules: dict[str, tuple]) -> dict[str, set[str]]:
    """{rule: the rules it references}."""
    return {name: {n[1] for n in _ref_nodes(node)} for name, (node, _) in rules.items()}


def _reachable(refs: dict[str, set], name: str) -> set[str]:
    """The rules reachable from `name` in one or more references."""
    seen, stack = set(), list(refs[name])
    while stack:
        r = stack.pop()
        if r not in seen:
            seen.add(r)
            stack.extend(refs[r])
    return seen


def _recursive_sccs(refs: dict[str, set[str]]) -> dict[str, frozenset[str]]:
    """{rule: its strongly connected component} for the rules that reach themselves
    (Tarjan's, iterative: linear in the references, where a reachability search per
    rule is quadratic)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: list[str] = []
    at: dict[str, int] = {}  # rule -> its place in on_stack
    out: dict[str, frozenset[str]] = {}
    work: list[tuple[str, Iterator[str]]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        at[name] = len(on_stack)
        on_stack.append(name)
        work.append((name, iter(refs[name])))

    for root in refs:
        if root in index:
            continue
        visit(root)
        while work:
            name, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    visit(nxt)
                elif nxt not in out:  # (on the stack: in no SCC yet)
                    low[name] = min(low[name], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[name])
            if low[name] == index[name]:
                k = at[name]
                scc = frozenset(on_stack[k:])
                del on_stack[k:]
                if len(scc) > 1 or name in refs[name]:
                    out.update(dict.fromkeys(scc, scc))
                else:
                    out[name] = frozenset()  # (done, not recursive: dropped below)
    return {name: scc for name, scc in out.items() if scc}


def _productive(rules: dict[str, tuple]) -> set[str]:
    """The rules that derive some (finite) string: from the bottom up, a node done when
    its children are (a cat's all, an alt's or a rep's one), linear in the grammar."""
    need: list[int] = []  # per node: the children still to be done
    parent: list[int] = []
    waiting: dict[str, list[int]] = {name: [] for name in rules}  # rule -> its ref nodes
    top: dict[int, str] = {}  # a rule's node -> the rule
    ready: list[int] = []
    for name, (body, _) in rules.items():
        stack = [(body, -1)]
        while stack:
            node, up = stack.pop()
            i = len(need)
            parent.append(up)
            kind = node[0]
            if up < 0:
                top[i] = name
            if kind == "ref":
                need.append(1)
                waiting[node[1]].append(i)
            elif kind == "cat":
                need.append(len(node[1]))
                stack.extend((n, i) for n in node[1])
            elif kind == "alt":
                need.append(1)
                stack.extend((n, i) for n in node[1])
            elif kind == "rep" and node[2] > 0:
                need.append(1)
                stack.append((node[1], i))
            else:  # a literal, a set or an optional repetition
                need.append(0)
            if need[i] == 0:
                ready.append(i)
    done: set[str] = set()
    while ready:
        i = ready.pop()
        if i in top:
            done.add(top[i])
            ready.extend(waiting.pop(top[i]))
        up = parent[i]
        if up >= 0:
            need[up] -= 1
            if need[up] == 0:  # (an alt's later children take it below 0: once only)
                ready.append(up)
    return done


def _check_refs(parser: _Parser, rules: dict[str, tuple]) -> None:
    for name, (node, _) in rules.items():
        for n in _ref_nodes(node):
            if n[1] not in rules:
                raise parser.error(f"rule {n[1]!r} (in rule {name!r}) is not defined", n[2])
    if "root" not in rules:
        raise ValueError(
            f"grammar has no rule 'root' (where it starts); its rules: {', '.join(rules):.200}"
        )


def grammar_regex(grammar: str, *, depth: int = RULE_DEPTH) -> str:
    """The regex text of the strings rule `root` of `grammar` derives with recursive
    rules at most `depth` deep (see the module docstring).

    Raises:
      TypeError: `grammar` is not a str.
      ValueError: a syntax error or an unsupported construct (naming it and its
        line:column), a rule defined twice or referenced but not defined, no `root`, an
        empty grammar, a `root` that matches nothing (naming the rules that never stop
        recursing), a regex over `MAX_REGEX_CHARS`, a grammar over `MAX_GRAMMAR_CHARS`,
        an expansion over `MAX_EXPAND_STEPS` steps, or nesting too deep to parse.
    """
    if not isinstance(grammar, str):
        raise TypeError(f"a grammar must be a str, got {type(grammar).__name__}: {grammar!r:.80}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth=}")
    if len(grammar) > MAX_GRAMMAR_CHARS:  # (parsing takes about 1 s per million)
        raise ValueError(
            f"grammar of {len(grammar)} characters {grammar!r:.80} is too large: the limit "
            f"is {MAX_GRAMMAR_CHARS} characters"
        )
    parser = _Parser(grammar)
    with nesting(f"grammar {grammar!r}"):
        rules = parser.grammar()
        _check_refs(parser, rules)
        expander = _Expander(rules, depth)
        regex = expander.rule("root")
    if regex is None:
        used = _reachable(_references(rules), "root") | {"root"}
        endless = sorted(n for n in used - expander.productive if n in expander.cycle)
        raise ValueError(
            "grammar matches nothing: rule root derives no string, since every way through "
            f"rule(s) {', '.join(endless)} recurses forever (give each recursion an "
            "alternative that ends it)"
        )
    return regex[0]


def too_large(grammar: str, error: Exception) -> ValueError:
    """The ValueError for a grammar whose regex `pagedjax.regex_dfa` refuses as too large
    (`error`), with the hint of what to do."""
    return ValueError(
        f"grammar {grammar!r:.80} is too large for the DFA: simplify it or lower its nesting "
        f"(recursive rules are unrolled {RULE_DEPTH} deep; inlined rules and repetition "
        f"counts copy their regex) ({error})"
    )
