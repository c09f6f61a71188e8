"""Structured outputs (pagedjax/guided.py): the regex DFA against Python's `re`, token
masks against brute force on small vocabularies, JSON schemas, choices and refusals."""

import collections
import itertools
import json
import random
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tokenizer import TEXTS, byte_level_bpe, sentencepiece_style
from tokenizers import Regex, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from pagedjax import guided
from pagedjax.guided import StructuredOutputsParams, compile_guide, token_bytes
from pagedjax.resources import byte_tokenizer
from pagedjax.tokenizer import Tokenizer

BYTES = byte_tokenizer()  # id = byte value
SP = Tokenizer(sentencepiece_style())
BPE = Tokenizer(byte_level_bpe(post_bos=False))
TOKENIZERS = {"bytes": BYTES, "sentencepiece": SP, "bpe": BPE}

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


# ---------------------------------------------------------------------------- regex


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_dfa_matches_like_python_re(pattern, data):
    dfa = guided._compile_dfa(pattern)
    rx = re.compile(pattern, re.ASCII)
    s = data.draw(st.text(alphabet=CHARS, max_size=8))
    assert dfa_match(dfa, s.encode()) == bool(rx.fullmatch(s)), s
    m = data.draw(st.from_regex(rx, fullmatch=True))
    assert dfa_match(dfa, m.encode()), m
    raw = data.draw(st.binary(max_size=6))
    if dfa_match(dfa, raw):  # accepted bytes are valid UTF-8 that re matches
        assert rx.fullmatch(raw.decode("utf-8")), raw


def test_dot_is_exactly_one_utf8_character_but_newline():
    dfa = guided._compile_dfa(".")
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
    walk of their bytes ends."""
    rng = random.Random(4)
    pieces = ["ab", "é€", "c", "\n", '"', "{", '{"k": "', "}", "x" * 20, "ab" * 12 + "c"]
    toks = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(300)]
    toks += ["".join(rng.choices(pieces, k=rng.randrange(1, 8))).encode() for _ in range(700)]
    toks += [None, b""]
    dfa = guided._compile_dfa(pattern)
    guide = guided.Guide(dfa, guided._TokenTable(toks), len(toks) + 5)
    assert max(map(len, filter(None, toks))) > guided._TokenTable.HEAD
    states = {dfa.initial} | {int(s) for s in np.unique(dfa.trans) if s}
    for state in sorted(states)[:30]:
        ok = bits(guide.allowed(state))
        want = [t is not None and t != b"" and dfa.walk(state, t) != 0 for t in toks]
        assert ok[: len(toks)].tolist() == want and not ok[len(toks) :].any()


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


# ---------------------------------------------------------------------------- JSON

DEFS = {"Point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 3},
        "kind": {"anyOf": [{"const": "cat"}, {"type": ["null", "boolean"]}]},
        "at": {"$ref": "#/$defs/Point"},
        "id": {"type": "string", "format": "uuid"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d+$"},
        "when": {"type": "string", "format": "date-time"},
    },
    "required": ["age", "at"],
    "$defs": DEFS,
}


def validate(x, s) -> bool:
    """The checks of the subset SCHEMA uses."""
    if "$ref" in s:
        return validate(x, DEFS[s["$ref"].rsplit("/", 1)[1]])
    if "anyOf" in s:
        return any(validate(x, t) for t in s["anyOf"])
    if "enum" in s or "const" in s:
        return any(x == v and type(x) is type(v) for v in s.get("enum", [s.get("const")]))
    t = s["type"]
    if isinstance(t, list):
        return any(validate(x, {**s, "type": u}) for u in t)
    if t == "object":
        keys, props = list(x), list(s["properties"])
        return (
            isinstance(x, dict)
            and set(s["required"]) <= set(keys)
            and keys == [k for k in props if k in x]  # declared order, no extra keys
            and all(validate(x[k], s["properties"][k]) for k in keys)
        )
    if t == "array":
        n = len(x) if isinstance(x, list) else -1
        return s["minItems"] <= n <= s["maxItems"] and all(validate(v, s["items"]) for v in x)
    if t == "string":
        if not isinstance(x, str) or not s.get("minLength", 0) <= len(x) <= s.get("maxLength", 99):
            return False
        pattern = {"uuid": "[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}"}.get(
            s.get("format"), s.get("pattern", "(?s:.*)")
        )
        if s.get("format") == "date-time":
            pattern = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)"
        return bool(re.fullmatch(pattern.strip("^$"), x))
    kinds = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None)}
    return isinstance(x, kinds[t]) and (t == "boolean" or not isinstance(x, bool))


@pytest.mark.parametrize("tok_name", ["bytes", "sentencepiece"])
def test_json_schema_walks_validate(tok_name):
    tok = TOKENIZERS[tok_name]
    spec = StructuredOutputsParams(json=SCHEMA)
    guide = compile_guide(spec, tok, tok.vocab_size)
    rng = random.Random(2)
    for _ in range(8):
        text = walk(guide, tok, rng, steps=60).decode()
        assert validate(json.loads(text), SCHEMA), text
        assert re.fullmatch(spec.to_regex(), text, re.ASCII)


GOOD = [
    '{"age": 3, "at": {"x": -1.5e3}}',
    '{"name": "Zoé", "age": 0, "tags": ["a", 3], "kind": null, "at": {"x": 0}}',
    '{"age": -12, "kind": "cat", "at": {"x": 1}, "code": "AB-42", "when": "2024-02-29T23:59:59Z"}',
    '{"age":1,"at":{"x":2},"id":"123e4567-e89b-12d3-a456-426614174000"}',
]
NEAR_MISSES = [
    '{"at": {"x": 1}}',  # required age missing
    '{"age": 3.5, "at": {"x": 1}}',  # not an integer
    '{"age": 03, "at": {"x": 1}}',  # leading zero
    '{"at": {"x": 1}, "age": 3}',  # out of declared order
    '{"age": 3, "at": {"x": 1}, "extra": 1}',  # extra key
    '{"age": 3, "at": {"x": 1},}',  # trailing comma
    '{"age": 3,  "at": {"x": 1}}',  # two spaces
    '{"name": "", "age": 3, "at": {"x": 1}}',  # minLength
    '{"name": "abcdefg", "age": 3, "at": {"x": 1}}',  # maxLength
    '{"age": 3, "tags": [], "at": {"x": 1}}',  # minItems
    '{"age": 3, "tags": ["a", "a", "a", "a"], "at": {"x": 1}}',  # maxItems
    '{"age": 3, "tags": ["c"], "at": {"x": 1}}',  # enum
    '{"age": 3, "kind": "dog", "at": {"x": 1}}',  # const
    '{"age": 3, "at": {"y": 1}}',  # $ref's required
    '{"age": 3, "at": {"x": 1}, "code": "ab-1"}',  # pattern
    '{"age": 3, "at": {"x": 1}, "when": "2024-13-01T00:00:00Z"}',  # date-time
    '{"name": "a\nb", "age": 3, "at": {"x": 1}}',  # raw control character
    '{"age": 3, "at": {"x": 1}}x',
]


def test_json_schema_accepts_instances_and_refuses_near_misses():
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    dfa = guided._compile_dfa(spec.to_regex())
    for text in GOOD:
        assert validate(json.loads(text), SCHEMA), text  # (the cases themselves)
        assert dfa_match(dfa, text.encode()), text
    for text in NEAR_MISSES:
        assert not dfa_match(dfa, text.encode()), text
    assert compile_guide(spec, BYTES, 256) is compile_guide(
        StructuredOutputsParams(json=SCHEMA), BYTES, 256
    )  # cached by the regex: a dict and its JSON text are one guide


@pytest.mark.parametrize("required", [[], ["b"], ["a", "d"], ["c"], list("abcd")])
def test_json_object_keys_are_any_ordered_subset_with_the_required(required):
    props = {k: {"type": "integer"} for k in "abcd"}
    spec = StructuredOutputsParams(json={"properties": props, "required": required})
    dfa = guided._compile_dfa(spec.to_regex())
    for keys in itertools.chain.from_iterable(itertools.permutations("abcd", n) for n in range(5)):
        text = json.dumps({k: 1 for k in keys})
        want = set(required) <= set(keys) and list(keys) == sorted(keys)
        assert dfa_match(dfa, text.encode()) == want, text
    for text in ["{,}", '{"a": 1,}', '{, "a": 1}', '{"a": 1 "b": 1}']:
        assert not dfa_match(dfa, text.encode()), text


def test_json_string_patterns_keep_the_string_valid_json():
    """A pattern's classes lose the characters a JSON string must escape: `.+` does not
    let a raw quote, backslash or control character end or break the string."""
    spec = StructuredOutputsParams(json={"type": "string", "pattern": "^.+$"})
    dfa = guided._compile_dfa(spec.to_regex())
    assert dfa_match(dfa, '"a é"'.encode())
    for text in ['""', '"a"b"', '"a\\b"', '"a\tb"', '"a\nb"']:
        assert not dfa_match(dfa, text.encode()), text
    guide = compile_guide(spec, BYTES, 256)
    rng = random.Random(5)
    for _ in range(5):
        assert json.loads(walk(guide, BYTES, rng)) != ""


def test_json_whitespace_options():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def matches(text, **kw):
        dfa = guided._compile_dfa(StructuredOutputsParams(json=schema, **kw).to_regex())
        return dfa_match(dfa, text.encode())

    assert matches('{"a": 1}') and matches('{ "a" : 1 }') and not matches('{\n"a": 1}')
    assert matches('{"a":1}', disable_any_whitespace=True)
    assert not matches('{"a": 1}', disable_any_whitespace=True)
    pretty = json.dumps({"a": 1}, indent=2)
    assert matches(pretty, whitespace_pattern=r"[ \n]*") and not matches(pretty)


def test_json_object_depth_and_any_values():
    spec = StructuredOutputsParams(json_object=True)
    dfa = guided._compile_dfa(spec.to_regex())
    assert guided.JSON_DEPTH == 3
    good = ["{}", '{"a": [1, {"b": null}], "c": "é\\n"}', '{"a": {"b": {"c": 1}}}']
    for text in good:  # three containers deep, the outer object counted
        assert dfa_match(dfa, text.encode()), text
    for text in ['{"a": {"b": {"c": []}}}', "[]", '"x"', "{'a': 1}", '{"a": 1,}']:
        assert not dfa_match(dfa, text.encode()), text
    guide = compile_guide(spec, SP, SP.vocab_size)
    rng = random.Random(3)
    for _ in range(5):
        assert isinstance(json.loads(walk(guide, SP, rng, steps=40)), dict)


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
        ({"grammar": "root ::= 'a'"}, ValueError, "grammar is not supported.*root ::="),
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
        ({"json": {"type": "integer", "minimum": 0}}, ValueError, "'minimum' is not supported"),
        (
            {"json": {"properties": {"a": {"type": "date"}}}},
            ValueError,
            "#/properties/a: type 'date'",
        ),
        ({"json": {"type": "string", "format": "ipv4"}}, ValueError, "format 'ipv4'"),
        ({"json": {"type": "string", "pattern": "a", "maxLength": 3}}, ValueError, "pattern with"),
        ({"json": {"type": "string", "pattern": "(?=a)"}}, ValueError, "lookaround"),
        (
            {"json": {"$ref": "#/$defs/N", "$defs": {"N": {"items": {"$ref": "#/$defs/N"}}}}},
            ValueError,
            "recursive \\$ref '#/\\$defs/N'",
        ),
        ({"json": {"$ref": "#/$defs/Missing"}}, ValueError, "points to nothing"),
        ({"json": {"$ref": "http://x/s.json"}}, ValueError, "only local"),
        ({"json": {"type": "object", "required": ["b"], "properties": {}}}, ValueError, "'b'"),
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
    monkeypatch.setattr(guided, "MAX_DFA_STATES", 100)
    with pytest.raises(ValueError, match="too large: its DFA has over 100 states"):
        compile_guide(StructuredOutputsParams(regex="(a|b)*a(a|b){8}"), BYTES, 256)
    guide = compile_guide(spec, BYTES, 256)
    for state in (0, guide.num_states, -1):
        with pytest.raises(ValueError, match=f"state {state} is not a live state"):
            guide.allowed(state)
