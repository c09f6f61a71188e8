"""Structured outputs (pagedjax/guided.py): token masks against brute force on small
vocabularies, token bytes by decoder, choices and refusals. The regex DFA's tests are in
test_regex_dfa.py, the JSON schemas' in test_json_schema.py."""

import collections
import itertools
import random
import re

import numpy as np
import pytest
from test_tokenizer import TEXTS, byte_level_bpe, sentencepiece_style
from tokenizers import Regex, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from pagedjax import guided, regex_dfa
from pagedjax.guided import StructuredOutputsParams, compile_guide, token_bytes
from pagedjax.regex_dfa import compile_dfa
from pagedjax.resources import byte_tokenizer
from pagedjax.tokenizer import Tokenizer

BYTES = byte_tokenizer()  # id = byte value
SP = Tokenizer(sentencepiece_style())
BPE = Tokenizer(byte_level_bpe(post_bos=False))
TOKENIZERS = {"bytes": BYTES, "sentencepiece": SP, "bpe": BPE}


def bits(mask: np.ndarray) -> np.ndarray:
    return np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)


def shortest_completion(dfa, state: int) -> bytes:
    """BFS over the DFA: the shortest bytes from `state` to acceptance."""
    prev, queue = {state: None}, collections.deque([state])
    while queue:
        s = queue.popleft()
        if dfa.accept[s]:
            out = []
            while prev[s] is not None:
                s, b = prev[s]
                out.append(b)
            return bytes(reversed(out))
        for b, t in enumerate(dfa.trans[s]):
            if t and int(t) not in prev:
                prev[int(t)] = (s, b)
                queue.append(int(t))
    raise AssertionError("a live state must reach acceptance")


def walk(guide, tok: Tokenizer, rng: random.Random, steps: int = 30) -> bytes:
    """Random allowed tokens, then the shortest byte completion as single-byte tokens."""
    tb = token_bytes(tok)
    single = {b: i for i, b in enumerate(tb) if b is not None and len(b) == 1}
    state, text = guide.initial_state, b""
    for _ in range(steps):
        if guide.accepting(state) and rng.random() < 0.3:
            break
        ids = np.flatnonzero(bits(guide.allowed(state)))
        if not len(ids):
            break
        tid = int(rng.choice(ids))
        state = guide.advance(state, tid)
        text += tb[tid]
    for b in shortest_completion(guide._dfa, state):
        state = guide.advance(state, single[bytes([b])])
        text += bytes([b])
    assert guide.accepting(state)
    return text


# ---------------------------------------------------------------------------- masks


def language(pattern: str, alphabet: str, max_len: int) -> set[bytes]:
    rx = re.compile(pattern, re.ASCII)
    words = ("".join(w) for n in range(max_len + 1) for w in itertools.product(alphabet, repeat=n))
    return {w.encode() for w in words if rx.fullmatch(w)}


FINITE = [  # (spec, its whole language)
    (
        StructuredOutputsParams(regex=r"(ab|c[d-f]é)?x{1,2}"),
        language(r"(ab|c[d-f]é)?x{1,2}", "abcdefxé", 5),
    ),
    (StructuredOutputsParams(regex=r"[€é]{1,2} ?t?"), language(r"[€é]{1,2} ?t?", "€é t", 4)),
    (
        StructuredOutputsParams(choice=["the", "then", " thé", "a b", "<s>", "x.y"]),
        {b"the", b"then", " thé".encode(), b"a b", b"<s>", b"x.y"},
    ),
]


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("case", range(len(FINITE)))
def test_masks_are_exact_on_finite_languages(tok_name, case):
    """From every reachable state, a token is allowed exactly when the text with its
    bytes is a prefix of a match (the language enumerated with `re`)."""
    spec, words = FINITE[case]
    assert words
    tok = TOKENIZERS[tok_name]
    prefixes = {w[:k] for w in words for k in range(len(w) + 1)}
    tb = token_bytes(tok)
    guide = compile_guide(spec, tok, tok.vocab_size)
    seen, queue = set(), [(b"", guide.initial_state)]
    while queue:
        text, state = queue.pop()
        if text in seen:
            continue
        seen.add(text)
        assert guide.accepting(state) == (text in words), text
        ok = bits(guide.allowed(state))[: tok.vocab_size]
        want = np.array([b is not None and text + b in prefixes for b in tb])
        assert (ok == want).all(), (text, np.flatnonzero(ok != want)[:5])
        assert guide.can_continue(state) == bool(want.any())
        assert [guide.allows(state, t) for t in range(tok.vocab_size + 2)] == [
            *want.tolist(),
            False,
            False,
        ]  # (ids past the vocabulary: never)
        for tid in np.flatnonzero(want):
            queue.append((text + tb[tid], guide.advance(state, int(tid))))
        for tid in np.flatnonzero(~want)[:20]:
            with pytest.raises(ValueError, match="not allowed|no text"):
                guide.advance(state, int(tid))
    assert words <= seen  # every match was reached token by token


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("pattern", [r"-?\d+(\.\d+)?", r"[^\n]{3,}é", r"(\w+ ){2}\w*[.!?]"])
def test_walks_produce_full_matches_and_allowed_tokens_stay_alive(tok_name, pattern):
    tok = TOKENIZERS[tok_name]
    guide = compile_guide(StructuredOutputsParams(regex=pattern), tok, tok.vocab_size)
    tb = token_bytes(tok)
    rng = random.Random(1)
    for _ in range(5):
        text = walk(guide, tok, rng)
        assert re.fullmatch(pattern, text.decode(), re.ASCII), text
    state = guide.advance(guide.initial_state, tb.index(b"1" if "d" in pattern else b"a"))
    for tid in np.flatnonzero(bits(guide.allowed(state))[: tok.vocab_size])[:40]:
        nxt = guide.advance(state, int(tid))
        text = (b"1" if "d" in pattern else b"a") + tb[tid]
        text += shortest_completion(guide._dfa, nxt)
        assert re.fullmatch(pattern, text.decode(), re.ASCII), text


@pytest.mark.parametrize("pattern", [r"[^\n]*", r"(ab|é€)*c?", r'\{"k": "[^"]*"\}'])
def test_vectorized_masks_equal_token_by_token_walks(pattern):
    """Tokens past the 16-byte head go through the second pass; all end where a plain
    walk of their bytes ends (allowed where that is a viable state: tested below)."""
    rng = random.Random(4)
    pieces = ["ab", "é€", "c", "\n", '"', "{", '{"k": "', "}", "x" * 20, "ab" * 12 + "c"]
    toks = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(300)]
    toks += ["".join(rng.choices(pieces, k=rng.randrange(1, 8))).encode() for _ in range(700)]
    toks += [None, b""]
    dfa = compile_dfa(pattern)
    guide = guided.Guide(dfa, guided._TokenTable(toks), len(toks) + 5)
    assert max(map(len, filter(None, toks))) > guided._TokenTable.HEAD
    states = {dfa.initial} | {int(s) for s in np.unique(dfa.trans) if s}
    for state in sorted(states)[:30]:
        ok = bits(guide.allowed(state))
        want = [t is not None and t != b"" and guide._viable[dfa.walk(state, t)] for t in toks]
        assert ok[: len(toks)].tolist() == want and not ok[len(toks) :].any()


def viable_by_fixpoint(dfa, toks: list) -> set[int]:
    """The states from which some sequence of `toks` reaches acceptance (brute force)."""
    live = range(1, len(dfa.trans))
    ends = {s: {dfa.walk(s, t) for t in toks if t} - {0} for s in live}
    viable = {s for s in live if dfa.accept[s]}
    while True:
        more = {s for s in live if ends[s] & viable} - viable
        if not more:
            return viable
        viable |= more


@pytest.mark.parametrize("seed", range(4))
def test_tokens_that_lead_where_no_tokens_complete_a_match_are_not_allowed(seed):
    """A vocabulary that cannot spell some of what a pattern reads: a token is allowed
    exactly where it ends in a state from which tokens reach a match, so walks along the
    masks end on full matches (where no token is allowed, the text matches); a token
    into a dead end is refused by `advance`, and a spec no tokens can spell by
    `compile_guide`. With every byte a token (seed 0), every live state is viable."""
    rng = random.Random(seed)
    pieces = ['{"', "k", '": "', "a", "b", "ab", "c", '"}', '"', "}", "x", "xx", "y", 'c"}']
    toks = [p.encode() for p in pieces if rng.random() < 0.7] + [None]
    if seed == 0:
        toks += [bytes([b]) for b in range(256)]
    pattern = r'\{"k": "[a-c]*"\}|x+y|ab'
    dfa = compile_dfa(pattern)
    guide = guided.Guide(dfa, guided._TokenTable(toks), len(toks))
    viable = viable_by_fixpoint(dfa, toks)
    assert set(np.flatnonzero(guide._viable)) == viable
    if seed == 0:
        assert len(viable) == len(dfa.trans) - 1
    for state in viable:
        ok = bits(guide.allowed(state))[: len(toks)]
        want = [bool(t) and dfa.walk(state, t) in viable for t in toks]
        assert ok.tolist() == want, (state, toks)
        assert guide.can_continue(state) or guide.accepting(state)
        for t in np.flatnonzero(~ok):
            if toks[t] and dfa.walk(state, toks[t]):  # alive, but a dead end: refused
                with pytest.raises(ValueError, match="no tokens of this vocabulary complete"):
                    guide.advance(state, int(t))
    for _ in range(20):  # random walks along the masks
        state = guide.initial_state
        while guide.can_continue(state) and not (guide.accepting(state) and rng.random() < 0.3):
            state = guide.advance(state, rng.choice(np.flatnonzero(bits(guide.allowed(state)))))
        assert guide.accepting(state)
    with pytest.raises(ValueError, match="no sequence of this vocabulary's tokens.*'z'"):
        compile_guide(StructuredOutputsParams(regex="z"), BYTES, 100)  # "z" past the ids


def test_special_added_and_padded_ids_are_never_allowed():
    spec = StructuredOutputsParams(regex=r"[</>a-z]*")
    guide = compile_guide(spec, SP, 300)
    ok = bits(guide.allowed(guide.initial_state))
    assert ok.shape == (320,) and guide.allowed(guide.initial_state).dtype == np.uint32
    assert not ok[[0, 1, 2]].any()  # <unk>, <s>, </s>: special
    assert not ok[SP.vocab_size :].any() and ok[SP.tokenizer.token_to_id("a")]
    for tid in (1, 2, SP.vocab_size, 299):
        with pytest.raises(ValueError, match="no text"):
            guide.advance(guide.initial_state, tid)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        guide.advance(guide.initial_state, 300)
    small = compile_guide(spec, BYTES, 100)  # smaller than the tokenizer: the rest cut off
    assert small.allowed(small.initial_state).shape == (4,)
    assert not bits(small.allowed(small.initial_state))[100:].any()
    with pytest.raises(ValueError, match="outside"):
        small.advance(small.initial_state, ord("z"))


# ---------------------------------------------------------------------------- tokens


def test_token_bytes_follow_the_decoder():
    assert token_bytes(BYTES) == [bytes([i]) for i in range(256)]
    sp = token_bytes(SP)
    vocab = SP.tokenizer.get_vocab()
    assert sp[:3] == [None, None, None]  # special
    assert sp[vocab["<0x41>"]] == b"A" and sp[vocab["<0xE2>"]] == b"\xe2"
    assert sp[vocab["▁the"]] == b" the" and sp[vocab["▁"]] == b" "
    bpe = token_bytes(BPE)
    for i, b in enumerate(bpe):
        text = BPE.tokenizer.decode([i])
        if i > 2 and "\ufffd" not in text:
            assert b == text.encode(), i
    for tok, lead in ((SP, b" "), (BPE, b""), (BYTES, b"")):
        tb = token_bytes(tok)
        for text in TEXTS:  # a text's tokens join into its bytes (SentencePiece: after "▁")
            ids = tok.encode(text, add_bos=False)
            assert b"".join(tb[i] for i in ids) == lead + text.encode()


def test_metaspace_and_byte_level_fallbacks():
    hf = HFTokenizer(models.WordLevel({"▁hi": 0, "a▁": 1, "<0x41>": 2}, unk_token="a▁"))
    hf.decoder = decoders.Metaspace()
    assert token_bytes(Tokenizer(hf)) == [b" hi", b"a ", b"<0x41>"]  # no ByteFallback step
    hf = HFTokenizer(models.WordLevel({"aĠb": 0, "Ã©€": 1, "Ã©": 2}, unk_token="aĠb"))
    hf.decoder = decoders.ByteLevel()  # a token with a character outside the alphabet: UTF-8
    assert token_bytes(Tokenizer(hf)) == [b"a b", "Ã©€".encode(), "é".encode()]
    assert [hf.decode([i]) for i in range(3)] == ["a b", "Ã©€", "é"]


def test_unsupported_decoders_are_refused_by_name():
    hf = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="no decoder"):
        token_bytes(Tokenizer(hf))
    hf.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="'WordPiece'"):
        compile_guide(StructuredOutputsParams(regex="a"), Tokenizer(hf), 2)
    hf.decoder = decoders.Sequence([decoders.Strip(" ", 1, 0), decoders.Fuse()])
    with pytest.raises(ValueError, match="'Strip'"):
        token_bytes(Tokenizer(hf))
    hf.decoder = decoders.Replace(Regex("a+"), "b")
    with pytest.raises(ValueError, match="'Replace'"):
        token_bytes(Tokenizer(hf))


# ---------------------------------------------------------------------------- choice


def test_choice():
    spec = StructuredOutputsParams(choice=["yes", "no", "a.b"])
    assert spec.choice == ("yes", "no", "a.b") and hash(spec) == hash(
        StructuredOutputsParams(choice=("yes", "no", "a.b"))
    )
    guide = compile_guide(spec, BYTES, 256)
    assert set(np.flatnonzero(bits(guide.allowed(guide.initial_state)))) == set(b"yna")
    state = guide.initial_state
    for b in b"a.b":
        state = guide.advance(state, b)
    assert guide.accepting(state) and not guide.can_continue(state)
    with pytest.raises(ValueError, match="not allowed"):
        guide.advance(guide.advance(guide.initial_state, ord("a")), ord("x"))  # "." is literal


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({}, ValueError, "got none"),
        ({"regex": "a", "choice": ["a"]}, ValueError, "regex='a', choice=\\('a',\\)"),
        ({"json_object": False}, ValueError, "got none"),
        ({"grammar": "root ::= 'a'"}, ValueError, "grammar at 1:10: single-quoted strings"),
        ({"structural_tag": "{}", "regex": "a"}, ValueError, "structural_tag is not supported"),
        ({"regex": "a", "disable_fallback": "no"}, TypeError, "disable_fallback='no'"),
        ({"regex": 3}, TypeError, "regex must be a str"),
        ({"regex": "(a"}, ValueError, "'\\(a'.*missing \\)"),
        ({"regex": "(?=a)b"}, ValueError, "lookaround"),
        ({"regex": "(?i)a"}, ValueError, "not supported"),
        ({"regex": r"(a)\1"}, ValueError, r"\\1: backreferences"),
        ({"regex": r"a\bc"}, ValueError, "word boundaries"),
        ({"regex": r"\p{L}"}, ValueError, "Unicode properties"),
        ({"regex": "a^b"}, ValueError, "anchor '\\^'"),
        ({"regex": "a**"}, ValueError, "multiple repeat"),
        ({"regex": "a*+"}, ValueError, "possessive"),
        ({"regex": "*a"}, ValueError, "nothing to repeat"),
        ({"regex": "[z-a]"}, ValueError, "bad character range"),
        ({"regex": r"[\d-z]"}, ValueError, "bad character range"),
        ({"regex": "[ab"}, ValueError, "unterminated"),
        ({"regex": "a{3,2}"}, ValueError, "min repeat greater"),
        ({"regex": ".{0,100000}"}, ValueError, "too large"),
        ({"regex": "(" * 500 + ")" * 500}, ValueError, "nests too deeply"),
        (
            {"json": {"properties": {f"p{i}": {"type": "null"} for i in range(400)}}},
            ValueError,
            "too deeply",
        ),
        (
            {"json": {"properties": {f"p{i}": {} for i in range(400)}}},
            ValueError,
            "exceeds 1000000",
        ),
        ({"choice": []}, ValueError, "non-empty list.*choice=\\[\\]"),
        ({"choice": "ab"}, TypeError, "choice='ab'"),
        ({"choice": ["a", 1]}, ValueError, "choice=\\['a', 1\\]"),
        ({"json": "{bad"}, ValueError, "not valid JSON.*{bad"),
        ({"json": "[1]"}, ValueError, "schema object.*\\[1\\]"),
        ({"json": 3}, TypeError, "json=3"),
        ({"json": {"type": "integer", "multipleOf": 3}}, ValueError, "multipleOf 3 is not"),
        (
            {"json": {"properties": {"a": {"type": "date"}}}},
            ValueError,
            "#/properties/a: type 'date'",
        ),
        ({"json": {"type": "string", "format": "ipv4"}}, ValueError, "format 'ipv4'"),
        ({"json": {"type": "string", "pattern": "a", "maxLength": 3}}, ValueError, "pattern with"),
        ({"json": {"type": "string", "pattern": "(?=a)"}}, ValueError, "lookaround"),
        ({"json": {"items": {"uniqueItems": True}}}, ValueError, "#/items: uniqueItems true"),
        ({"json": {"type": "integer", "maximum": 1, "minimum": 2}}, ValueError, "no integer"),
        ({"json": {"$ref": "#/$defs/Missing"}}, ValueError, "points to nothing"),
        ({"json": {"$ref": "http://x/s.json"}}, ValueError, "only local"),
        (
            {"json": {"required": ["b"], "properties": {}, "additionalProperties": False}},
            ValueError,
            "'b'",
        ),
        ({"json": {"type": "array", "minItems": 2, "maxItems": 1}}, ValueError, "maxItems=1"),
        ({"json_object": "yes"}, TypeError, "json_object='yes'"),
        ({"json_object": True, "disable_any_whitespace": 1}, TypeError, "disable_any_whitespace"),
        ({"json_object": True, "whitespace_pattern": "("}, ValueError, "missing \\)"),
        (
            {"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True},
            ValueError,
            "not both",
        ),
    ],
)
def test_bad_specs_are_refused_naming_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**kwargs)


def test_vllms_backend_flags_are_accepted_and_change_nothing():
    plain = StructuredOutputsParams(json={"type": "object"})
    flags = StructuredOutputsParams(
        json={"type": "object"}, disable_fallback=True, disable_additional_properties=True
    )
    assert flags.to_regex() == plain.to_regex() and hash(flags) == hash(plain)


def test_compile_guide_refusals(monkeypatch):
    spec = StructuredOutputsParams(regex="a")
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        compile_guide("a", BYTES, 256)
    with pytest.raises(TypeError, match="pagedjax Tokenizer"):
        compile_guide(spec, BYTES.tokenizer, 256)
    with pytest.raises(ValueError, match="vocab_size=0"):
        compile_guide(spec, BYTES, 0)
    with pytest.raises(ValueError, match="matches nothing"):
        compile_guide(StructuredOutputsParams(regex="[^\\x00-\\U0010ffff]"), BYTES, 256)
    monkeypatch.setattr(regex_dfa, "MAX_DFA_STATES", 100)
    with pytest.raises(ValueError, match="too large: its DFA has over 100 states"):
        compile_guide(StructuredOutputsParams(regex="(a|b)*a(a|b){8}"), BYTES, 256)
    guide = compile_guide(spec, BYTES, 256)
    for state in (0, guide.num_states, -1):
        with pytest.raises(ValueError, match=f"state {state} is not a live state"):
            guide.allowed(state)
