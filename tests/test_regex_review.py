"""The regex parser and DFA (pagedjax/regex_parse.py, pagedjax/regex_dfa.py) against
Python's `re` on random patterns built from the whole supported syntax; set operations
as codepoint sets; ECMA mode against both engines; refusals that name pattern and place."""

import re
import warnings

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedjax.regex_dfa import compile_dfa, intersect, negate, parse, to_text

_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))

# Atoms outside a class: literals (multi-byte too), escapes, a "{" that is no count.
_LITERALS = ["a", "b", "-", "é", "€", "😀", " ", "}", "]", "\n", r"\.", r"\-", r"\\", r"\n"]
_LITERALS += [r"\t", r"\x41", r"\u00e9", r"\U0001F600", r"\]", r"\{", r"\|", r"\(", r"\*"]
_LITERALS += [r"\?", r"\+", r"\^", r"\$", r"\ ", r"\/", r"\a", r"\f", r"\v", r"\r", "{a", "{٢}"]
_LITERALS += ["x{1", "{,}a"]
_CLASS_ESCAPES = [r"\d", r"\w", r"\s", r"\D", r"\W", r"\S"]
_CLASS_ITEMS = list("abz09-_^.$|()*+?{}é€😀 ") + [r"\]", r"\\", r"\-", r"\b", r"\n", r"\x00"]
_CLASS_ITEMS += [r"\x7f", r"\u00ff", r"\uffff", r"\U00010000", r"\U0010ffff", r"\^", r"\["]
_CLASS_ITEMS += _CLASS_ESCAPES + ["a-c", "0-9", "à-€", r"\x00-\x7f", r"\x80-\u07ff", r"\t-\r"]
_CLASS_ITEMS += [r"\u0800-\uffff", r"\uffff-\U00010001", " -~", "é-😀", r"\x7f-\x80", r"\--/"]
_QUANTIFIERS = ["*", "+", "?", "{2}", "{0}", "{1,}", "{,2}", "{0,1}", "{1,3}", "{0,0}", "{,}"]
# Strings to match: a bit of everything the atoms above read, and what they leave out.
_CHARS = "ab-.é€😀\n\t A09_{}]\\/\x00\x7f\uffff\U00010000\U0010ffff\x0b\x08\xa0٢\u2028\r[^$|"

_classes = st.builds(
    lambda neg, items, close: "[" + neg + "".join(items) + close + "]",
    st.sampled_from(["", "^"]),
    st.lists(st.sampled_from(_CLASS_ITEMS), min_size=1, max_size=4),
    st.sampled_from(["", "", "-"]),
)
_atoms = st.one_of(st.sampled_from(_LITERALS + _CLASS_ESCAPES + ["."]), _classes)


def _compound(inner):
    group = st.builds(
        lambda kind, body: kind + body + ")",
        st.sampled_from(["(", "(?:", "(?P<g>", "(?<g>"]),
        st.lists(inner, max_size=3).map("".join),
    )
    alt = st.lists(inner, min_size=1, max_size=3).map(lambda b: "(?:" + "|".join(b) + ")")
    quantified = st.builds(
        lambda body, q, lazy: f"(?:{body}){q}{lazy}",
        inner,
        st.sampled_from(_QUANTIFIERS),
        st.sampled_from(["", "?"]),
    )
    return st.one_of(group, alt, quantified, st.lists(inner, min_size=2, max_size=3).map("".join))


def _named(pattern: str) -> str:
    """`pattern` with its groups named g0, g1, ..."""
    parts = pattern.split("<g>")
    return "".join(f"{part}<g{i}>" for i, part in enumerate(parts[:-1])) + parts[-1]


_patterns = st.builds(
    lambda start, body, end: _named(start + body + end),
    st.sampled_from(["", "", "^"]),
    st.lists(st.recursive(_atoms, _compound, max_leaves=8), min_size=1, max_size=3).map("|".join),
    st.sampled_from(["", "", "$", "|"]),
)


def _python(pattern: str) -> re.Pattern | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FutureWarning for "[[" and the like
        try:  # (Python has no "(?<name>")
            return re.compile(pattern.replace("(?<g", "(?P<g"), re.ASCII)
        except re.error:
            return None


def _matches(dfa, data: bytes) -> bool:
    state = dfa.walk(dfa.initial, data)
    return bool(state and dfa.accept[state])


@settings(max_examples=120, **_SETTINGS)
@given(pattern=_patterns, data=st.data())
def test_random_patterns_match_like_python_re(pattern, data):
    """The DFA accepts exactly the UTF-8 of the strings `re.fullmatch` matches (texts from a
    small alphabet, texts drawn from the pattern, raw bytes), and `to_text` keeps the
    language."""
    rx = _python(pattern)
    if rx is None:
        with pytest.raises(ValueError, match=r"regex .* at position \d+"):
            parse(pattern)
        return
    try:
        dfa = compile_dfa(pattern)
    except ValueError as e:
        assume("too large" not in str(e))
        assert "matches nothing" in str(e), e
        assert not any(rx.fullmatch(s) for s in ("", "a", "é"))
        return
    back = re.compile(to_text(parse(pattern)), re.ASCII)
    texts = data.draw(st.lists(st.text(alphabet=_CHARS, max_size=6), max_size=20))
    texts += data.draw(st.lists(st.from_regex(rx, fullmatch=True), max_size=3))
    for text in texts:
        want = bool(rx.fullmatch(text))
        assert _matches(dfa, text.encode()) == want, text
        assert bool(back.fullmatch(text)) == want, text
    for raw in data.draw(st.lists(st.binary(max_size=6), max_size=10)):
        if _matches(dfa, raw):  # accepted bytes are UTF-8 that re matches
            assert rx.fullmatch(raw.decode("utf-8")), raw


@pytest.mark.parametrize("pattern", ["a{٢}", "a{1,٢}", "(?:ab){٣,}", "x{０}"])
def test_counts_are_ascii_digits(pattern):
    """Python reads "{" before non-ASCII digits as a literal; they were read as a count
    ("a{٢}" matched "aa", not "a{٢}")."""
    dfa = compile_dfa(pattern)
    for text in (pattern.replace("(?:ab)", "ab"), "aa", "a", "abababab", "x"):
        assert _matches(dfa, text.encode()) == bool(re.fullmatch(pattern, text)), text


@pytest.mark.parametrize(
    "pattern",
    ["(?<a)b>x)", "(?P<n(?:>1)", "(?P<1>a)", "(?P<>x)", "(?P<a b>x)", "(?P<a>x)(?P<a>y)"],
)
def test_bad_group_names_are_refused(pattern):
    """A group name Python refuses was skipped up to the next ">": "(?<a)b>x)" read as a
    group of "x"."""
    with pytest.raises(ValueError, match=r"group name .* at position \d+"):
        parse(pattern)


def test_group_names_in_ecma_mode():
    assert parse("(?<$a>x)(?<$a>y)", ecma=True) == parse("xy")  # (a repeat: ES2025's rule)
    with pytest.raises(ValueError, match="bad group name"):
        parse("(?<a-b>x)", ecma=True)


@pytest.mark.parametrize("count", ["9" * 5000, "4294967295", "0," + "1" * 4400])
def test_huge_counts_are_refused_by_name(count):
    """A count of thousands of digits was int()'s own ValueError, naming neither pattern
    nor position; one past Python's limit is refused like it."""
    with pytest.raises(ValueError, match=r"regex 'a\{.*: the repetition count is too large"):
        parse("a{" + count + "}")
    assert parse("a{" + "0" * 5000 + "2}") == parse("a{2}")


@pytest.mark.parametrize(
    "pattern",
    [
        r"(a)\1", r"(?P<a>x)(?P=a)", r"\k<a>", r"(?=a)", r"(?!a)", r"(?<=a)b", r"(?<!a)b",
        "(?i)a", "(?i:a)", "(?-i:a)", "(?>a)", "(?#c)", "(a)(?(1)a|b)", "a*+", "a++", "a?+",
        "a{1,2}+", r"\b", r"\B", r"\A", r"\Z", r"\z", r"\pL", r"\p{L}", "a^", "a$b", "(^a)",
        "[\\B]", "\\0", "[\\1]", r"\N{DIGIT ONE}", r"\ud800",
    ],
)  # fmt: skip
def test_unsupported_constructs_are_refused_by_name(pattern):
    with pytest.raises(ValueError, match=r"^regex .* at position \d+$"):
        parse(pattern)


_RANGE = st.tuples(st.integers(0, 0x10FFFF), st.integers(0, 40)).map(
    lambda r: (r[0], min(r[0] + r[1] ** 4, 0x10FFFF))
)
_EDGES = [0, 0x7F, 0x80, 0xD7FF, 0xD800, 0xDFFF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF]


@settings(max_examples=300, **_SETTINGS)
@given(a=st.lists(_RANGE, max_size=4), b=st.lists(_RANGE, max_size=4))
def test_negate_and_intersect_are_codepoint_set_operations(a, b):
    def has(ranges, cp):
        return any(lo <= cp <= hi for lo, hi in ranges)

    probes = {p + d for lo, hi in a + b for p in (lo, hi) for d in (-1, 0, 1)} | set(_EDGES)
    for ranges in (negate(a), intersect(a, b)):  # sorted, disjoint, not adjacent
        assert all(lo <= hi for lo, hi in ranges)
        assert all(hi + 1 < nxt for (_, hi), (nxt, _) in zip(ranges, ranges[1:], strict=False))
    for cp in (p for p in probes if 0 <= p <= 0x10FFFF):
        char = not 0xD800 <= cp <= 0xDFFF
        assert has(negate(a), cp) == (char and not has(a, cp)), hex(cp)
        assert has(intersect(a, b), cp) == (char and has(a, cp) and has(b, cp)), hex(cp)


# ECMA-262 (u flag) read by Python's re: its \d \w \s \D \W \S and `.` spelled out.
_JS_SPACE = "\t\n\v\f\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_JS_LOWER = {"d": "0-9", "w": "A-Za-z0-9_", "s": _JS_SPACE}
_ECMA_ITEMS = ["a", "b", "-", "é", "٢", "_", " ", "0-9", "a-z", r"\u00a0", r"\n", r"\t"]
_ECMA_CHARS = "ab9_٢١é中ǅ \t\n\r\v\x1c\x85\xa0\u2028\u2029\u3000\ufeff\u180e-😀"


def _ecma_class(neg: bool, items: list[str]) -> tuple[str, str]:
    """A class of literals and escapes: its text and its ECMA-262 reading in Python."""
    lits = "".join(i for i in items if not i.startswith("\\") or i[1] not in "dwsDWS")
    lower = "".join(_JS_LOWER[i[1]] for i in items if i[1:] in ("d", "w", "s"))
    upper = [_JS_LOWER[i[1].lower()] for i in items if i[1:] in ("D", "W", "S")]
    text = "[" + "^" * neg + "".join(items) + "]"
    if not neg:
        listed = [f"[{lits}{lower}]"] if lits + lower else []
        return text, "(?:" + "|".join(listed + [f"[^{u}]" for u in upper]) + ")"
    not_listed = f"(?![{lits}{lower}])" if lits + lower else ""
    return text, not_listed + "".join(f"(?=[{u}])" for u in upper) + "[\\s\\S]"


_ecma_atoms = st.one_of(
    st.sampled_from(
        [("a", "a"), ("é", "é"), (r"\-", "-"), (".", "[^\n\r\u2028\u2029]")]
        + [(rf"\{c}", f"[{s}]") for c, s in _JS_LOWER.items()]
        + [(rf"\{c.upper()}", f"[^{s}]") for c, s in _JS_LOWER.items()]
    ),
    st.builds(
        _ecma_class,
        st.booleans(),
        st.lists(st.sampled_from(_ECMA_ITEMS + _CLASS_ESCAPES), min_size=1, max_size=3),
    ),
)
_ecma_patterns = st.recursive(
    _ecma_atoms,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map(
            lambda ps: ("".join(p[0] for p in ps), "".join(p[1] for p in ps))
        ),
        st.lists(inner, min_size=1, max_size=3).map(
            lambda ps: tuple("(?:" + "|".join(p[i] for p in ps) + ")" for i in (0, 1))
        ),
        st.tuples(inner, st.sampled_from(["*", "?", "{1,2}"])).map(
            lambda t: tuple(f"(?:{t[0][i]}){t[1]}" for i in (0, 1))
        ),
    ),
    max_leaves=4,
)


@settings(max_examples=80, **_SETTINGS)
@given(pattern=_ecma_patterns, texts=st.lists(st.text(_ECMA_CHARS, max_size=4), max_size=30))
def test_ecma_mode_matches_only_what_both_engines_match(pattern, texts):
    text, js = pattern
    try:
        dfa = compile_dfa(to_text(parse(text, ecma=True)))
    except ValueError as e:  # a class range made of an escape, or of the items' order
        assume("range" not in str(e) and "matches nothing" not in str(e))
        raise
    python, ecma = re.compile(text), re.compile(js)
    for s in texts:
        if _matches(dfa, s.encode()):
            assert python.fullmatch(s) and ecma.fullmatch(s), s


@pytest.mark.parametrize(
    "pattern, what",
    [
        (r"\0", r"\\0: octal escapes are not supported"),  # (Python: NUL, no group)
        (r"[\1]", r"\\1: octal escapes are not supported"),  # (octal in a class)
        (r"(a)\1", r"\\1: backreferences are not supported"),
        (r"\q", r"\\q: this escape is not supported"),
    ],
)
def test_refused_escapes_are_named_as_python_reads_them(pattern, what):
    with pytest.raises(ValueError, match=what):
        parse(pattern)
