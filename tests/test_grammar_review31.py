"""Review 31 of GBNF grammars (pagedjax/grammar.py) and their token masks (guided.py).

A lone surrogate written as itself (a JSON request's "\\ud800" decodes to one) is
refused where it stands, as its \\uD800 escape is, not as a grammar "too large for the
DFA"; a repetition count of thousands of digits is refused naming it and where, not by
Python's int() limit; xgrammar's C escapes (\\0 \\a \\b \\e \\f \\v) read as xgrammar reads
them. Then, against brute force: random grammars (rules, recursion, classes, escapes,
comments, quantifiers) match exactly the strings of their depth-bounded derivations, and
a grammar's token masks over a BPE vocabulary (multi-byte characters split over tokens,
tokens spanning several terminals) allow exactly the tokens that keep a prefix of the
language, with EOS allowed exactly where the text is a sentence of it. A cached refusal
of one grammar (guided.py) quoted it to a later request of the same regex.
"""

import itertools
import random

import numpy as np
import pytest
from test_grammar import accepts
from test_guided import bits
from test_tokenizer import byte_level_bpe

from pagedjax import regex_dfa
from pagedjax.batch import guide_mask
from pagedjax.grammar import grammar_regex
from pagedjax.guided import StructuredOutputsParams, compile_guide, token_bytes
from pagedjax.regex_dfa import compile_dfa
from pagedjax.tokenizer import Tokenizer

# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "grammar, where",
    [
        ('root ::= "a\ud800"', "1:12"),
        ('root ::= "a"\n  | [b\udfff]', "2:7"),
        ("root ::= [a\ud800-\udfff]", "1:12"),
        ("root ::= [^\udc00]", "1:12"),
    ],
)
def test_a_raw_surrogate_is_refused_where_it_stands(grammar, where):
    """As its escape is ("\\uD800 is not a character (a surrogate)"): it was written into
    the regex, whose parser's refusal came back as "too large for the DFA: simplify it",
    or (in a class) dropped without a word."""
    for make in (grammar_regex, lambda g: StructuredOutputsParams(grammar=g)):
        with pytest.raises(ValueError, match=rf"at {where}: U\+D[0-9A-F]{{3}} is a surrogate") as e:
            make(grammar)
        assert "too large" not in str(e.value)


@pytest.mark.parametrize("count", ["{%s}", "{0,%s}", "{%s,}"])
def test_a_count_of_thousands_of_digits_is_refused_naming_it(count):
    """Python's int() refuses over 4300 digits with its own words (set_int_max_str_digits);
    leading zeros are no size."""
    grammar = 'root ::= "a"' + count % ("9" * 5000)
    with pytest.raises(ValueError, match=r"at 1:13: repetition count \{[0,]*9{20}.*is too large"):
        StructuredOutputsParams(grammar=grammar)
    regex = grammar_regex('root ::= "a"' + count % ("0" * 5000 + "2"))
    assert regex in ("a{2}", "a{0,2}", "a{2,}")


def test_xgrammars_c_escapes_read_as_xgrammar_reads_them():
    """xgrammar (vLLM's default backend) reads \\0 \\a \\b \\e \\f \\v in strings and classes
    (its ParseNextEscaped); llama.cpp refuses them, and so did we."""
    dfa = compile_dfa(grammar_regex(r'root ::= "\0\a\b\e\f\v" [\f\v]'))
    assert accepts(dfa, "\x00\x07\x08\x1b\x0c\x0b\x0c") and accepts(dfa, "\0\a\b\x1b\f\v\v")
    assert not accepts(dfa, "0abefv") and not accepts(dfa, "\0\a\b\x1b\f\vf")
    with pytest.raises(ValueError, match=r"at 1:11: unknown escape '\\\\d'"):
        grammar_regex(r"root ::= [\d]")


# ---------------------------------------------------------------------------- brute force

ALPHA = "ab(é"  # ( is special to the regex, é two bytes
MAX_LEN = 5


def random_node(rng: random.Random, names: list[str], depth: int = 0):
    """A grammar node over ALPHA: ("lit", str) | ("set", chars, negated) | ("any",) |
    ("ref", name) | ("cat", nodes) | ("alt", nodes) | ("rep", node, lo, hi or None)."""
    k = rng.random()
    if depth > 2 or k < 0.3:
        c = rng.random()
        if c < 0.45:
            return ("lit", "".join(rng.choices(ALPHA, k=rng.randint(0, 2))))
        if c < 0.65:
            return ("set", frozenset(rng.sample(ALPHA, rng.randint(1, 3))), rng.random() < 0.3)
        return ("any",) if c < 0.7 or not names else ("ref", rng.choice(names))
    if k < 0.55:
        return ("cat", [random_node(rng, names, depth + 1) for _ in range(rng.randint(2, 3))])
    if k < 0.8:
        return ("alt", [random_node(rng, names, depth + 1) for _ in range(rng.randint(2, 3))])
    lo = rng.randint(0, 2)
    return ("rep", random_node(rng, names, depth + 2), lo, rng.choice([None, lo, lo + 1, lo + 2]))


def gbnf_char(c: str, rng: random.Random, in_class: bool) -> str:
    if c in '"\\' or (in_class and c in "]-^["):
        return "\\" + c
    r = rng.random()
    if r < 0.15:
        return f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
    return f"\\u{ord(c):04X}" if r < 0.2 else c


def gbnf(node, rng: random.Random) -> str:
    """`node` as GBNF text, spaced, broken over lines and commented at random."""
    kind = node[0]
    gap = lambda: rng.choice([" ", "  ", "\n  ", " # c ::= x\n ", "\t"])  # noqa: E731
    if kind == "lit":
        return '"' + "".join(gbnf_char(c, rng, False) for c in node[1]) + '"'
    if kind == "set":
        body = "".join(gbnf_char(c, rng, True) for c in sorted(node[1]))
        return ("[^" if node[2] else "[") + body + "]"
    if kind == "any":
        return "."
    if kind == "ref":
        return node[1]
    if kind == "cat":
        return gap().join(grouped(n, rng) for n in node[1])
    if kind == "alt":
        return "(" + (gap() + "|" + gap()).join(gbnf(n, rng) for n in node[1]) + ")"
    lo, hi = node[2], node[3]
    ops = {(0, None): ["*", "{0,}"], (1, None): ["+", "{1,}"], (0, 1): ["?", "{0,1}", "{,1}"]}
    q = rng.choice(ops.get((lo, hi), [f"{{{lo}}}" if lo == hi else f"{{{lo},{hi or ''}}}"]))
    return grouped(node[1], rng) + rng.choice(["", " "]) + q


def grouped(node, rng: random.Random) -> str:
    text = gbnf(node, rng)
    return text if node[0] in ("lit", "set", "any", "ref", "alt") else f"({text})"


def derive(node, rules: dict, counts: dict, depth: int) -> set[str]:
    """The strings over ALPHA of at most MAX_LEN characters `node` derives where no rule
    is entered more than `depth` times on a path (`counts`: those on this one)."""
    kind = node[0]

    def cat(xs, ys):
        return {x + y for x in xs for y in ys if len(x) + len(y) <= MAX_LEN}

    if kind == "lit":
        return {node[1]} if len(node[1]) <= MAX_LEN else set()
    if kind == "set":
        return {c for c in ALPHA if (c in node[1]) != node[2]}
    if kind == "any":
        return set(ALPHA)
    if kind == "ref":
        if counts.get(node[1], 0) >= depth:
            return set()
        inner = dict(counts, **{node[1]: counts.get(node[1], 0) + 1})
        return derive(rules[node[1]], rules, inner, depth)
    if kind == "cat":
        out = {""}
        for n in node[1]:
            out = cat(out, derive(n, rules, counts, depth))
        return out
    if kind == "alt":
        return set().union(*(derive(n, rules, counts, depth) for n in node[1]))
    one, (lo, hi) = derive(node[1], rules, counts, depth), node[2:]
    layer = {""}
    for _ in range(lo):
        layer = cat(layer, one)
    out, n = set(layer), lo
    while layer and (hi is None or n < hi):
        layer, n = cat(layer, one) - out, n + 1  # (new strings only: it ends)
        out |= layer
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_grammars_match_their_depth_bounded_derivations(seed, monkeypatch):
    monkeypatch.setattr(regex_dfa, "MAX_DFA_WORK", 300_000)  # (a DFA too large: skipped, fast)
    rng = random.Random(seed)
    names = ["root", "x", "y-1", "2_z"][: rng.randint(1, 4)]
    # (each rule with an alternative that ends it: fewer grammars that match nothing)
    rules = {n: ("alt", [random_node(rng, names), random_node(rng, [], 3)]) for n in names}
    order = rng.sample(names, len(names))
    grammar = "\n".join(
        f"{n} ::= {gbnf(rules[n], rng)}" + rng.choice(["", " # end"]) for n in order
    )
    depth = 1 + seed % 3
    want = derive(("ref", "root"), rules, {}, depth)
    try:
        regex = grammar_regex(grammar, depth=depth)
        dfa = compile_dfa(regex)
    except ValueError as e:
        if "matches nothing" in str(e) and not want:
            return
        if "too large" in str(e):  # (nested optional repetitions: the DFA's limits)
            return
        raise
    for n in range(MAX_LEN + 1):
        for chars in itertools.product(ALPHA, repeat=n):
            s = "".join(chars)
            assert accepts(dfa, s) == (s in want), (grammar, regex, s)


# ---------------------------------------------------------------------------- token masks

EOS = 0  # the BPE's first token (special: no bytes), a stop id here


def test_grammar_masks_over_bpe_tokens_allow_exactly_the_prefixes():
    """Every prefix of the (finite) language reached by tokens: the allowed tokens are
    exactly those whose bytes extend it to a prefix of a sentence (the byte-level BPE
    spells every byte, so each such prefix completes), and EOS exactly on a sentence."""
    grammar = r"""
root ::= item ("," item){0,2}  # a list
item ::= "é" | [a-c] "ü"? | "(" item ")"
"""
    spec = StructuredOutputsParams(grammar=grammar)
    tok = Tokenizer(byte_level_bpe(post_bos=False))
    table = token_bytes(tok)
    guide = compile_guide(spec, tok, len(table) + 3)  # (padded ids: never allowed)
    dfa = compile_dfa(spec.to_regex())
    sentences = set()
    frontier = {""}
    for _ in range(20):  # the language by breadth: every string of these pieces
        frontier = {s + p for s in frontier for p in ["é", "a", "b", "c", "ü", ",", "(", ")"]}
        frontier = {s for s in frontier if _alive(dfa, s.encode())}
        sentences |= {s.encode() for s in frontier if accepts(dfa, s)}
    assert b"(b\xc3\xbc),\xc3\xa9,a" in sentences and b"(((a)))" not in sentences
    prefixes = {s[:i] for s in sentences for i in range(len(s) + 1)}
    stops = frozenset([EOS])
    rng = random.Random(0)
    for _ in range(60):  # random walks over allowed tokens
        state, text = guide.initial_state, b""
        while True:
            allowed = bits(guide_mask(guide, state, stops))[: guide.vocab_size]
            want = np.zeros(guide.vocab_size, bool)
            for t, data in enumerate(table):
                want[t] = data is not None and text + data in prefixes
            want[EOS] = text in sentences
            assert (allowed == want).all(), (text, np.flatnonzero(allowed != want)[:5])
            ids = np.flatnonzero(allowed)
            t = int(rng.choice(ids))
            if t == EOS:
                break
            state, text = guide.advance(state, t), text + table[t]


def _alive(dfa, data: bytes) -> bool:
    return dfa.walk(dfa.initial, data) != 0


# ---------------------------------------------------------------------------- guided.py


def test_a_cached_refusal_does_not_quote_another_requests_grammar():
    """compile_guide keys refusals by (regex, tokenizer, vocab_size) but stores the message
    `too_large` wrote for the first spec, quoting its grammar: a second request whose
    grammar differs only in a comment, or a plain regex= of the same pattern, is told
    about the first request's grammar text (another user's, on a server)."""
    tok = Tokenizer(byte_level_bpe(post_bos=False))
    first = StructuredOutputsParams(grammar='root ::= [cd]* "c" [cd]{14}  # user one')
    with pytest.raises(ValueError, match="user one.*too large for the DFA"):
        compile_guide(first, tok, 320)
    second = StructuredOutputsParams(grammar='root ::= [cd]* "c" [cd]{14}  # user two')
    with pytest.raises(ValueError, match="too large") as e:
        compile_guide(second, tok, 320)
    assert "user one" not in str(e.value) and "user two" in str(e.value)
    with pytest.raises(ValueError, match="too large") as e:
        compile_guide(StructuredOutputsParams(regex=first.to_regex()), tok, 320)
    assert "grammar" not in str(e.value)
