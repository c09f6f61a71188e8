"""GBNF grammars (pagedjax/grammar.py) to regexes, and `grammar=` through the server.

Each grammar's regex is checked by membership: every string of a few pieces up to a
length is accepted by its DFA (`regex_dfa.compile_dfa`) exactly when a hand-written
Python regex of the grammar's language fullmatches it (and Python's `re` reads the
regex the same). Recursive rules are unrolled `RULE_DEPTH` deep; literals holding every
character special to our regex syntax round-trip; every refusal names the construct and
its line:column; a grammar too large for the DFA is refused with the hint. The server
answers `guided_grammar` and `structured_outputs.grammar` with text in the grammar's
language, and a bad grammar is a 400 naming the field. (The engine's guided runs of a
grammar are in test_structured_outputs.py, the --grammar flag in test_generate_cli.py.)
"""

import itertools
import re

import pytest
import serve_helpers
from serve_helpers import request

from pagedjax.grammar import RULE_DEPTH, grammar_regex
from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.regex_dfa import compile_dfa
from pagedjax.resources import byte_tokenizer

ckpt, server = serve_helpers.ckpt, serve_helpers.server  # this module's own


def accepts(dfa, text: str) -> bool:
    state = dfa.walk(dfa.initial, text.encode())
    return bool(state and dfa.accept[state])


def strings(pieces, max_pieces: int):
    """Every concatenation of at most `max_pieces` of `pieces` (the empty one included)."""
    for n in range(max_pieces + 1):
        for combo in itertools.product(pieces, repeat=n):
            yield "".join(combo)


def check_language(grammar: str, hand: str, pieces, max_pieces: int, **kw) -> None:
    """The grammar's DFA accepts exactly what `hand` fullmatches (and Python's `re`
    reads the grammar's regex the same), over `strings(pieces, max_pieces)`."""
    regex = grammar_regex(grammar, **kw)
    dfa = compile_dfa(regex)
    seen = {True: 0, False: 0}
    for s in set(strings(pieces, max_pieces)):
        want = re.fullmatch(hand, s) is not None
        assert accepts(dfa, s) == want, (s, regex)
        assert (re.fullmatch(regex, s) is not None) == want, (s, regex)
        seen[want] += 1
    assert seen[True] and seen[False]  # (both sides were tried)


ANSWERS = r"""
root   ::= answer ("\n" answer)*
answer ::= "yes" | "no" | number
number ::= [0-9]+ ("." [0-9]+)?
"""
EXPR = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= "(" expr ")" | [a-z]+
"""


def expr_regex(depth: int) -> str:
    """EXPR's language with expr (and term) at most `depth` deep: parens nest depth - 1."""
    term = "[a-z]+"
    for _ in range(depth):
        expr = f"{term}(?:[+-]{term})*"
        term = rf"(?:\({expr}\)|[a-z]+)"
    return expr


@pytest.mark.parametrize(
    "grammar, hand, pieces, max_pieces",
    [
        (
            ANSWERS,
            r"(?:yes|no|[0-9]+(?:\.[0-9]+)?)(?:\n(?:yes|no|[0-9]+(?:\.[0-9]+)?))*",
            ["yes", "no", "7", ".", "\n", "e"],
            5,
        ),
        (EXPR, expr_regex(3), ["(", ")", "a", "+"], 7),
        (  # counts (whitespace may come before a quantifier)
            'root ::= "a"{2} "b"{1,} "c"{0,2} "x"{,1} ("a" | "c") {1,2}',
            "aab+c{0,2}x?[ac]{1,2}",
            "abcx",
            7,
        ),
        (  # comments, rules over several lines, names with - and digits, empty alternative
            """# a greeting
root ::= greet-1   # a comment "not a string" [nor a class
    ( ", " name_2 )?
    ("!" | )
greet-1 ::= "hi" | "hey"
name_2 ::=
    [A-Z] [a-z]*
""",
            "(?:hi|hey)(?:, [A-Z][a-z]*)?!?",
            ["hi", "hey", ", ", "B", "o", "!", "#"],
            4,
        ),
        ('root ::= ("ab"? "c")* "d"+? "e"*', "(?:(?:ab)?c)*(?:d+)?e*", "abcde", 6),
        (  # classes: negated, escaped ] - \ and \n, ranges, a leading -; . is any char
            r"root ::= [^a-c\]\-\n] [\x41-\x43\u00e9] [-z^\\] .",
            r"[^a-c\]\-\n][A-Cé][-z^\\](?s:.)",
            ["a", "d", "]", "-", "\n", "A", "C", "D", "é", "z", "^", "\\", "😀"],
            4,
        ),
        (  # non-recursive rules are inlined however often and deep they are used
            'root ::= a a\na ::= b b\nb ::= c "-"\nc ::= [xy]',
            "(?:[xy]-){4}",
            ["x", "y", "-"],
            8,
        ),
    ],
)
def test_the_regex_has_the_grammars_language(grammar, hand, pieces, max_pieces):
    check_language(grammar, hand, pieces, max_pieces)


def test_non_recursive_rules_ignore_the_depth():
    chain = "".join(f'r{i} ::= r{i + 1} r{i + 1} "|"\n' for i in range(5)) + 'r5 ::= "x"'
    want = "x"
    for _ in range(5):
        want = want + want + "|"
    dfa = compile_dfa(grammar_regex("root ::= r0\n" + chain, depth=1))
    assert accepts(dfa, want) and not accepts(dfa, want + "|")


# ---------------------------------------------------------------------------- recursion


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_recursive_rule_nests_at_most_depth_deep(depth):
    """Its language: x, (x), ((x)), ... with the rule `depth` times on the path."""
    hand = "|".join(re.escape("(" * k + "x" + ")" * k) for k in range(depth))
    check_language('root ::= "(" root ")" | "x"', hand, "()x", 2 * depth + 1, depth=depth)


def test_the_default_depth_is_three_and_the_params_use_it():
    assert RULE_DEPTH == 3
    spec = StructuredOutputsParams(grammar=EXPR)
    assert spec.to_regex() == grammar_regex(EXPR)
    dfa = compile_dfa(spec.to_regex())
    assert accepts(dfa, "((a+b)-c)+d") and accepts(dfa, "(a-(b))")
    assert not accepts(dfa, "(((a)))") and not accepts(dfa, "(a+b")


def test_mutual_recursion_counts_each_rule_and_drops_only_what_recurses():
    """expr and term are one cycle; at the limit `"(" expr ")"` is dropped and the
    other alternative stays. `list ::= "[" list* "]"`: at the limit `list*` is empty."""
    check_language(EXPR, expr_regex(2), ["(", ")", "a", "-"], 7, depth=2)
    r1 = r"\[\]"
    r2 = rf"\[(?:{r1})*\]"
    check_language('root ::= "[" root* "]"', rf"\[(?:{r2})*\]", "[]", 10)


def test_rules_that_never_stop_recursing_match_nothing():
    """A rule whose every alternative recurses derives no string: an alternative using
    it is dropped (exact, not a depth artefact); a root left with nothing is refused
    naming the rules."""
    assert grammar_regex('root ::= "x" | loop\nloop ::= "(" loop ")"') == "x"
    assert grammar_regex('root ::= "x" loop?\nloop ::= "(" loop ")" "y"*') == "x"
    with pytest.raises(ValueError, match=r"matches nothing.*rule\(s\) root recurses forever"):
        grammar_regex('root ::= "(" root ")"')
    with pytest.raises(ValueError, match=r"matches nothing.*rule\(s\) a, b recurses forever"):
        grammar_regex('root ::= a "!"\na ::= "(" b ")" | b b\nb ::= a "x"')


# ---------------------------------------------------------------------------- literals


def gbnf_string(text: str) -> str:
    """`text` as a GBNF string literal (escaping only what must be)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") + '"'


def test_literals_with_every_special_character_round_trip():
    text = "^a\\.^$*+?{}[]()|-\"'#/:= \n\t\r\x00\x7fé中😀{2}{,}$"
    dfa = compile_dfa(regex := grammar_regex(f"root ::= {gbnf_string(text)}"))
    assert accepts(dfa, text) and re.fullmatch(regex, text)
    for i in range(len(text)):  # no character of it is a wildcard or an operator
        assert not accepts(dfa, text[:i] + "x" + text[i + 1 :]), (i, text[i])
        assert not accepts(dfa, text[:i] + text[i + 1 :]), (i, text[i])
    assert not accepts(dfa, text + text[-1]) and not accepts(dfa, text[1:])
    # the anchors our regex parser drops at a pattern's ends are literals here
    for lit in ("^", "$", "^$", "^a$"):
        dfa = compile_dfa(grammar_regex(f"root ::= {gbnf_string(lit)}"))
        assert accepts(dfa, lit) and not accepts(dfa, lit.strip("^$"))


def test_escapes_in_strings_and_classes():
    esc = r'root ::= "\x41\u00e9\U0001F600\\\"\t\n\r\[\]\-\'" [\]\\\-^\[\n\u4e2d]+'
    dfa = compile_dfa(grammar_regex(esc))
    head = "Aé😀\\\"\t\n\r[]-'"
    assert accepts(dfa, head + "]\\-^[\n中")
    assert not accepts(dfa, head) and not accepts(dfa, head + "a")


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "grammar, match",
    [
        ("", "grammar is empty"),
        ("  # only a comment\n\n", "grammar is empty"),
        ('item ::= "a"', "no rule 'root'.*its rules: item"),
        ('root ::= "a"\nroot ::= "b"', r"at 2:1: rule 'root' is defined twice \(first at 1:1\)"),
        ("root ::= item", r"at 1:10: rule 'item' \(in rule 'root'\) is not defined"),
        ('root ::= "a"\n\n  unused ::= "b" bar', r"at 3:18: rule 'bar' \(in rule 'unused'\)"),
        ('root ::= "a" (= "b")', r"at 1:14: lookahead assertions \(= \.\.\.\) are not supported"),
        ('start: "a"', "at 1:1: Lark's rule syntax"),
        ('root ::= "a"\n  | b\nb: "c"', "at 3:2: Lark's rule syntax"),
        ("root ::= 'a'", "at 1:10: single-quoted strings"),
        ("root ::= /[a-z]+/", "at 1:10: regex terminals"),
        ("root ::= %ignore", "at 1:10: directives"),
        ('%import common.WS\nroot ::= "a"', r"at 1:1: expected a rule \(name ::= \.\.\.\)"),
        ('root ::= "a" ~ "b"', "at 1:14: unexpected character '~'"),
        ('root ::= "a" b ::= "c"', "at 1:16: '::=' out of place"),
        ('root ::= "a\\q"', r"at 1:12: unknown escape '\\\\q'"),
        ('root ::= "\\x4"', r"at 1:11: \\x needs 2 hex digits"),
        ('root ::= "\\uD800"', r"at 1:11: \\uD800 is not a character \(a surrogate\)"),
        ('root ::= "\\U00110000"', r"\\U00110000 is not a character \(past U\+10FFFF\)"),
        ('root ::= "abc\nroot2 ::= "x"', "at 1:10: unterminated string"),
        ("root ::= [abc", "at 1:10: unterminated character class"),
        ("root ::= []", "at 1:10: empty character class"),
        ("root ::= [z-a]", "at 1:12: bad range 'z'-'a'"),
        ("root ::= [^\\x00-\\U0010FFFF]", "at 1:10: the character class matches no character"),
        ('root ::= ("a" | "b"', r"at 1:10: '\(' is never closed"),
        ('root ::= "a")', r"at 1:13: unbalanced '\)'"),
        ('root ::= * "a"', r"at 1:10: '\*' has nothing to repeat"),
        ('root ::= "a"{3,2}', r"at 1:13: repetition count \{3,2\}: its maximum is below"),
        ('root ::= "a"{x}', r"at 1:13: bad repetition count"),
        ('root ::= "(" root ")"', "matches nothing"),
    ],
)
def test_refusals_name_the_construct_and_where(grammar, match):
    with pytest.raises(ValueError, match=match):
        grammar_regex(grammar)
    with pytest.raises(ValueError, match=match):  # the params say the same
        StructuredOutputsParams(grammar=grammar)


def test_wrong_types_and_depths():
    with pytest.raises(TypeError, match="grammar must be a str"):
        StructuredOutputsParams(grammar=["root ::= 'a'"])
    with pytest.raises(TypeError, match="a grammar must be a str, got int"):
        grammar_regex(3)
    with pytest.raises(ValueError, match="depth=0"):
        grammar_regex('root ::= "a"', depth=0)
    with pytest.raises(ValueError, match="structural_tag is not supported"):
        StructuredOutputsParams(grammar='root ::= "a"', structural_tag="{}")
    with pytest.raises(ValueError, match="exactly one of.*regex='a', grammar="):
        StructuredOutputsParams(grammar='root ::= "a"', regex="a")


HINT = "too large for the DFA: simplify it or lower its nesting"


def test_a_grammar_too_large_is_refused_with_the_hint():
    """Too many NFA states (on construction), too many DFA states (`compile_guide`), or
    a regex past MAX_REGEX_CHARS (rules that double at each level)."""
    with pytest.raises(ValueError, match=f"{HINT}.*600001 NFA states"):
        StructuredOutputsParams(grammar="root ::= [a-z]{0,300000}")
    spec = StructuredOutputsParams(grammar='root ::= [ab]* "a" [ab]{14}')
    with pytest.raises(ValueError, match=f"{HINT}.*over 20000 states"):
        compile_guide(spec, byte_tokenizer(), 256)
    doubling = "".join(f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(21)) + 'r21 ::= "ab"'
    with pytest.raises(ValueError, match="exceeds 1000000 characters; simplify it or lower"):
        StructuredOutputsParams(grammar="root ::= r0\n" + doubling)


# ---------------------------------------------------------------------------- the server

LIST = r"""
root ::= item (", " item){0,2}
item ::= "yes" | "no" | [0-9]{1,2}
"""
LIST_RE = r"(?:yes|no|[0-9]{1,2})(?:, (?:yes|no|[0-9]{1,2})){0,2}"


def test_the_server_answers_in_the_grammars_language(server):
    body = dict(prompt="List: ", temperature=1.0, seed=3, n=3, max_tokens=24)
    status, got = request(server, "/v1/completions", dict(body, guided_grammar=LIST))
    assert status == 200, got
    for choice in got["choices"]:
        assert choice["finish_reason"] == "stop" and re.fullmatch(LIST_RE, choice["text"])
    chat = dict(messages=serve_helpers.MESSAGES, temperature=0, max_tokens=24)
    status, got = request(
        server, "/v1/chat/completions", dict(chat, structured_outputs={"grammar": LIST})
    )
    assert status == 200, got
    (choice,) = got["choices"]
    assert choice["finish_reason"] == "stop", choice
    assert re.fullmatch(LIST_RE, choice["message"]["content"]), choice


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(guided_grammar="root ::= 'a'"), "guided_grammar", "at 1:10: single-quoted"),
        (dict(structured_outputs={"grammar": 'x ::= "a"'}), "structured_outputs", "no rule"),
        (dict(structured_outputs={"grammar": 'root ::= [ab]* "a" [ab]{14}'}),
         "structured_outputs", HINT),
    ],
)  # fmt: skip
def test_a_bad_grammar_is_a_400_naming_the_field(server, fields, param, words):
    status, err = request(server, "/v1/completions", dict(prompt="a", max_tokens=4, **fields))
    assert status == 400 and err["error"]["param"] == param, err
    assert words in err["error"]["message"], err
