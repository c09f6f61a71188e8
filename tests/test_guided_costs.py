"""What one structured-output request can cost to compile (pagedjax/guided.py): the walk
of the tokens from each DFA state of a vocabulary that lacks single-byte tokens is
bounded by the bytes it steps, a refused spec is refused again at once, and a regex too
long names the spec it came from."""

import random

import numpy as np
import pytest
from test_guided import BYTES

from pagedjax import guided, regex_dfa
from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.regex_dfa import compile_dfa


@pytest.fixture(scope="module")
def no_e_bytes():
    """64k tokens: the ASCII bytes (none for é's 0xc3 0xa9) and words of a-z, space and é."""
    rng = random.Random(0)
    toks = [bytes([b]) for b in range(128)]
    words = {
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz é", k=rng.randint(2, 10)))
        for _ in range(70_000)
    }
    toks += sorted(w.encode() for w in words)[: 64_000 - len(toks)]
    return guided._TokenTable(toks)


def guide(table, pattern: str) -> guided.Guide:
    return guided.Guide(compile_dfa(pattern), table, len(table.lens), pattern)


def test_the_walk_from_the_states_tokens_cannot_spell_is_bounded(no_e_bytes, monkeypatch):
    """Where the DFA reads a byte no single token holds, the tokens with such a byte are
    walked from every state left undecided: 1-2.5 ms a state at 128k tokens, 20-50 s at
    the DFA's 20k states. Past MAX_VIABLE_WORK bytes stepped it is refused (~1 s on CI's
    cores, 2.3 s without the limit here); a pattern whose tokens die on their first byte
    passes with far more states. Counted in token bytes stepped (`_walk`'s count), not
    in seconds, so a loaded machine cannot fail it."""
    guide(no_e_bytes, "é")  # (builds the table of the tokens with é, once per vocabulary)
    walks = []
    real = guided._walk

    def counted(*args):
        ends, steps = real(*args)
        walks.append(steps)
        return ends, steps

    monkeypatch.setattr(guided, "_walk", counted)
    pattern = "(?:[a-z ]{0,10}é){0,400}"  # 4802 states
    with pytest.raises(ValueError, match="too large for this vocabulary.*MAX_VIABLE_WORK=") as e:
        guide(no_e_bytes, pattern)
    assert "0xa9, 0xc3" in str(e.value) and pattern in str(e.value)
    # Refused at the first walk past the bound, long before the last state's.
    assert sum(walks[:-1]) <= guided.MAX_VIABLE_WORK < sum(walks)
    assert len(walks) < 4802 // 2, len(walks)
    walks.clear()
    small = guide(no_e_bytes, "(?:[a-z ]{0,10}é){0,3}")
    assert small._viable[small.initial_state] and sum(walks) < guided.MAX_VIABLE_WORK // 10
    walks.clear()
    dies = guide(no_e_bytes, "é{0,2000}")  # 4002 states, 12,766 bytes stepped each
    assert dies._viable[dies.initial_state] and sum(walks) < guided.MAX_VIABLE_WORK // 4


@pytest.mark.parametrize("pattern", ["[a-c]*", "(ab|é€)*c?", "x{3}"])
def test_the_walks_work_is_the_bytes_it_steps(pattern):
    """`_walk` counts a step per token for the first byte, then one per byte a live
    token steps (a brute-force walk's count)."""
    rng = random.Random(1)
    toks = [
        bytes(rng.choice(b"abcx\xc3\xa9") for _ in range(rng.randrange(1, 30))) for _ in range(200)
    ]
    toks += [None, b"", "é€".encode(), b"ab" * 10]
    dfa = compile_dfa(pattern)
    table, flat = guided._TokenTable(toks), dfa.trans.ravel()
    for state in range(1, len(dfa.trans)):
        want = 0
        for t in toks:
            s, n = state, 0
            for b in t or b"\0":
                s, n = int(dfa.trans[s, b]), n + 1
                if not s:
                    break
            want += n
        ends, steps = guided._walk(flat, table, state)
        assert steps == want and np.array_equal(ends, guided._ends(flat, table, state))


def test_refusals_are_cached_and_bounded(monkeypatch):
    """A refused spec is refused again with the same error without compiling (a resent
    pattern too large costed its 1-2 s each time), per tokenizer, vocab_size and limits;
    `CACHE_SIZE` refusals are kept."""
    calls = []
    real = guided.compile_dfa
    monkeypatch.setattr(guided, "compile_dfa", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(regex_dfa, "MAX_DFA_STATES", 100)
    spec = StructuredOutputsParams(regex="(a|b)*a(a|b){9}")
    errors = []
    for _ in range(3):
        with pytest.raises(ValueError, match="its DFA has over 100 states") as e:
            compile_guide(spec, BYTES, 256)
        errors.append(str(e.value))
    assert len(calls) == 1 and errors[0] == errors[1] == errors[2]
    monkeypatch.setattr(regex_dfa, "MAX_DFA_STATES", 20_000)  # other limits: compiled
    assert compile_guide(spec, BYTES, 256).num_states > 100 and len(calls) == 2
    for i in range(guided.CACHE_SIZE + 4):
        with pytest.raises(ValueError, match="matches nothing"):
            compile_guide(StructuredOutputsParams(regex=f"[^\\x00-\\U0010ffff]{i}"), BYTES, 256)
    assert len(guided._REFUSED) <= guided.CACHE_SIZE
    assert all(key[0][0] != spec.to_regex() for key in guided._REFUSED)  # (evicted)


def test_a_regex_too_long_names_the_specs_kind():
    """The error named json=None for a regex, a choice or a grammar."""
    astral = "".join(chr(c) for c in range(0x10000, 0x10000 + 200_010, 2))  # \U... each
    for kwargs, name in [
        ({"regex": "a" * 1_000_001}, "regex='aaa"),
        ({"choice": ["a" * 1000] * 1001}, "choice=\\('aaa"),
        ({"grammar": f"root ::= [{astral}]"}, "grammar='root ::= \\["),
    ]:
        with pytest.raises(ValueError, match=f"^{name}.*: its regex exceeds 1000000 characters"):
            StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "text"])
def test_a_schema_too_deep_for_python_is_a_value_error(as_text):
    """A schema nested ~1000 levels deep raised RecursionError (a 500 on the server) in
    the copy of a dict, or json's parse of its text, before schema_regex's depth limit."""
    if as_text:
        json = '{"type": "array", "items": ' * 3000 + '{"type": "string"}' + "}" * 3000
    else:
        json = {"type": "string"}
        for _ in range(1000):
            json = {"type": "array", "items": json}
    with pytest.raises(ValueError, match="nests too deeply"):
        StructuredOutputsParams(json=json)
