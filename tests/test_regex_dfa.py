"""The regex DFA (pagedjax/regex_dfa.py) against Python's `re`: random texts, texts
drawn from the pattern and random bytes; `.` byte by byte."""

import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedjax import regex_dfa
from pagedjax.regex_dfa import compile_dfa

PATTERNS = [
    r"[a-z]+@[a-z]+\.(com|org)",
    r"-?\d+(\.\d+)?([eE][+-]?\d+)?",
    r"(ab|a)*b?",
    r".{2,4}",
    r"[^a-c\n]*",
    r"[à-€]{1,3}|[\uffff-\U00010001]x?",  # ranges across UTF-8 length boundaries
    r"\w+\s\W?\S*",
    r"(?:x{2}|y+){0,3}z{,2}",
    r"^a|b$",
    r"\u00e9\x41\t+",
    r"[\]\-\\é]+",
    r"(?P<n>ab)+?c*?",
    r"a{|[]x]",
    r"[\d\s]\D",
]
CHARS = "abcxyz019 _-.@eE+\n\t\\]A€éà😀\uffff\U00010000"


def dfa_match(dfa, data: bytes) -> bool:
    state = dfa.walk(dfa.initial, data)
    return bool(state and dfa.accept[state])


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_dfa_matches_like_python_re(pattern, data):
    dfa = compile_dfa(pattern)
    rx = re.compile(pattern, re.ASCII)
    s = data.draw(st.text(alphabet=CHARS, max_size=8))
    assert dfa_match(dfa, s.encode()) == bool(rx.fullmatch(s)), s
    m = data.draw(st.from_regex(rx, fullmatch=True))
    assert dfa_match(dfa, m.encode()), m
    raw = data.draw(st.binary(max_size=6))
    if dfa_match(dfa, raw):  # accepted bytes are valid UTF-8 that re matches
        assert rx.fullmatch(raw.decode("utf-8")), raw


def test_dot_is_exactly_one_utf8_character_but_newline():
    dfa = compile_dfa(".")
    rng = random.Random(0)
    cases = [bytes([a, b]) for a in range(256) for b in range(256)] + [
        bytes([a]) for a in range(256)
    ]
    cases += [
        bytes(rng.randrange(128, 256) for _ in range(n)) for n in (3, 4) for _ in range(20000)
    ]
    cases += ["€".encode(), "😀".encode(), b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\x80"]
    for data in cases:
        try:
            want = len(text := data.decode("utf-8")) == 1 and text != "\n"
        except UnicodeDecodeError:
            want = False
        assert dfa_match(dfa, data) == want, data


def test_dfa_construction_work_is_bounded(monkeypatch):
    """Nested optional repetitions keep thousands of NFA states alive in every DFA state
    ("(?:a?){0,10000}", 15 characters, took a minute): refused as too large once building
    passes MAX_DFA_WORK steps (a few seconds)."""
    assert regex_dfa.MAX_DFA_WORK <= 20_000_000
    assert len(compile_dfa("(?:a|b)*a(?:a|b){13}").accept) == 16385  # (big but cheap: kept)
    monkeypatch.setattr(regex_dfa, "MAX_DFA_WORK", 1_000_000)  # (the same, sooner)
    with pytest.raises(ValueError, match="too large: building its DFA takes over 1000000"):
        compile_dfa("(?:a?){0,3000}")
    assert len(compile_dfa("(?:a?){0,300}").accept) == 302  # (450k steps: kept)


@pytest.mark.parametrize("pattern", [r"\ud800", r"[a\udfff]", "a\udc00", r"\U0000DBFF"])
def test_surrogates_are_refused_by_name(pattern):
    """A surrogate is no character: it has no UTF-8 (not a codec error when building)."""
    with pytest.raises(ValueError, match="is a surrogate, not a character"):
        compile_dfa(pattern)


def test_dfa_state_memory_is_bounded(monkeypatch):
    """`((a{0,20}){0,20}){0,20}` (24 characters) held ~10M NFA states in its DFA's state
    sets, 760 MB, before `MAX_DFA_WORK` refused it after ~2 s; `MAX_DFA_HELD` refuses it
    at ~130 MB. Patterns with large but thin states stay well inside."""
    monkeypatch.setattr(regex_dfa, "MAX_DFA_WORK", 10**12)  # (only the memory bound)
    for pattern in ("((a{0,20}){0,20}){0,20}", "(?:a?){0,3000}"):
        with pytest.raises(ValueError, match="DFA's states hold over 2000000 NFA states"):
            compile_dfa(pattern)
    assert len(compile_dfa("(?:a?){0,900}").accept) == 902  # (0.8M held: kept)
    assert len(compile_dfa('[^"\\\\]{0,800}').accept) > 800  # (a JSON string's maxLength)
