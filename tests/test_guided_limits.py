"""Compile-time limits on untrusted structured-output specs (pagedjax/grammar.py, with
pagedjax/regex_dfa.py and pagedjax/guided.py): a request's grammar or regex compiles in
bounded time or is refused fast with a ValueError naming the limit."""

import itertools
import random
import time

import pytest

from pagedjax import grammar
from pagedjax.grammar import grammar_regex
from pagedjax.guided import StructuredOutputsParams


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def test_a_long_grammar_line_parses_in_linear_time():
    """Looking back to the line's start before each item was quadratic: 80k items on one
    line (880 KB) took 3-8 s."""
    text = "root ::= " + "        ".join(['"a"'] * 80_000)
    regex, took = timed(lambda: grammar_regex(text))
    assert regex == "a" * 80_000 and took < 2.0, took


def test_many_rules_are_analysed_in_linear_time():
    """A reachability search per rule (and a fixed point one rule per pass) was quadratic
    in the rules: a chain of 4000 rules (70 KB) took 6 s to be refused."""
    text = "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(4000))
    text += 'r4000 ::= "y"\n'
    start = time.perf_counter()
    with pytest.raises(ValueError, match="nests too deeply"):
        grammar_regex(text)
    assert time.perf_counter() - start < 1.5


def mutual(k: int) -> str:
    """k rules that all reference each other, their bodies padded with empty strings."""
    refs = " | ".join(f"r{j}" for j in range(k))
    empties = " ".join(['""'] * 50)
    return "root ::= r0\n" + "".join(f'r{i} ::= ({empties} ({refs})) | "x"\n' for i in range(k))


def test_mutually_recursive_rules_expand_in_bounded_steps():
    """Each rule is expanded once per count of each rule on the stack: 7 rules that all
    reference each other (1.4 KB) took 5 s (8: 40 s) though their regex is "x"."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"expanding it takes over {grammar.MAX_EXPAND_STEPS}"):
        StructuredOutputsParams(grammar=mutual(7))
    assert time.perf_counter() - start < 2.0
    assert grammar_regex(mutual(3)) == "x"  # (fewer: kept)


def test_a_grammar_past_the_size_limit_is_refused_before_parsing():
    """Parsing takes about 1 s per million characters; a request body may hold 32 MiB."""
    limit = getattr(grammar, "MAX_GRAMMAR_CHARS", 1_000_000)
    text = 'root ::= "a"\n' + "".join(f'u{i} ::= "b" "c"\n' for i in range(limit // 15))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"is too large: the limit is {limit}"):
        grammar_regex(text)
    assert time.perf_counter() - start < 0.5


def _reach_reference(refs, name):
    seen, stack = set(), list(refs[name])
    while stack:
        r = stack.pop()
        if r not in seen:
            seen.add(r)
            stack.extend(refs[r])
    return seen


@pytest.mark.parametrize("seed", range(40))
def test_sccs_and_productive_rules_equal_the_quadratic_definitions(seed):
    """The linear analyses against their definitions: a recursive rule's SCC is the rules
    it reaches that reach it back; a productive rule's body derives a string given the
    productive rules (a fixed point)."""
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(rng.randint(1, 9))]

    def node(depth):
        kind = rng.choice(["lit", "ref", "ref", "cat", "alt", "rep"] if depth < 3 else ["ref"])
        if kind == "lit":
            return ("lit", "a")
        if kind == "ref":
            return ("ref", rng.choice(names), 0)
        if kind == "rep":
            return ("rep", node(depth + 1), rng.choice([0, 1, 2]), None)
        return (kind, [node(depth + 1) for _ in range(rng.randint(0, 3))])

    rules = {name: (node(0), 0) for name in names}
    refs = grammar._references(rules)
    reach = {name: _reach_reference(refs, name) for name in rules}
    want = {
        name: frozenset(r for r in reach[name] if name in reach[r])
        for name in rules
        if name in reach[name]
    }
    assert grammar._recursive_sccs(refs) == want

    def ok(n, done):
        kind = n[0]
        if kind == "ref":
            return n[1] in done
        if kind == "cat":
            return all(ok(c, done) for c in n[1])
        if kind == "alt":
            return any(ok(c, done) for c in n[1])
        if kind == "rep":
            return n[2] == 0 or ok(n[1], done)
        return True

    done = set()
    for _ in itertools.count():
        more = {name for name, (n, _) in rules.items() if name not in done and ok(n, done)}
        if not more:
            break
        done |= more
    assert grammar._productive(rules) == done
