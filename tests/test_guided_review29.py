"""Structured outputs, second review (pagedjax/json_schema.py, json_scalars.py): schemas
merged by JSON equality (true is not 1), contradictory lengths and malformed keywords as
ValueErrors naming where; property sweeps of random schemas: the texts a schema's DFA
accepts are valid for it (soundness), valid instances in the generated form are accepted
(completeness), also cut into tokens spanning JSON's pieces or half a character, with
the guide accepting only complete instances; number texts against JSON's grammar."""

import json
import math
import random
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_json_schema import random_text
from test_regex_dfa import dfa_match

from pagedjax import guided
from pagedjax.guided import StructuredOutputsParams
from pagedjax.regex_dfa import compile_dfa


def dfa_of(schema, **kwargs):
    return compile_dfa(StructuredOutputsParams(json=schema, **kwargs).to_regex())


# ---------------------------------------------------------------------------- merging


@pytest.mark.parametrize(
    "schema, bad",
    [
        # (true == 1 and false == 0 in Python, not in JSON: each was merged as the first)
        ({"allOf": [{"enum": [1, "x"]}, {"enum": [True, "x"]}]}, ["1", "true"]),
        (  # draft 4's exclusiveMinimum true beside a later draft's exclusiveMinimum 1
            {
                "allOf": [
                    {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
                    {"exclusiveMinimum": 1},
                ]
            },
            ["1"],
        ),
        (  # one property in both, const 0 and const false: both hold (no value does)
            {
                "allOf": [
                    {"properties": {"a": {"const": 0}}},
                    {"properties": {"a": {"const": False}}},
                ]
            },
            ['{"a": 0}', '{"a": false}'],
        ),
    ],
)
def test_schemas_merge_by_json_equality(schema, bad):
    """allOf keeps one of two keyword values only where they are equal as JSON: true and 1
    (equal in Python) are not, so a value valid for one of them only is never generated
    (here: refused, as two different values of one keyword are)."""
    for text in bad:
        assert not valid(json.loads(text), schema), text  # (the cases themselves)
    try:
        dfa = dfa_of(schema)
    except ValueError as e:
        assert "with two values to merge" in str(e) or "no const value" in str(e), e
        return
    for text in bad:
        assert not dfa_match(dfa, text.encode()), text


def test_equal_json_values_still_merge():
    """1 and 1.0 are one JSON value: allOf of both is that value."""
    dfa = dfa_of({"allOf": [{"const": 1}, {"const": 1.0}], "type": "integer"})
    assert dfa_match(dfa, b"1") and not dfa_match(dfa, b"true")
    dfa = dfa_of(
        {"allOf": [{"properties": {"a": {"enum": [2, "x"]}}, "required": ["a"]}]}
        | {"properties": {"a": {"enum": [2.0, "x"]}}}
    )
    assert dfa_match(dfa, b'{"a": "x"}')
    assert dfa_match(dfa, b'{"a": 2}') or dfa_match(dfa, b'{"a": 2.0}')


def test_const_true_and_const_1_do_not_merge():
    with pytest.raises(ValueError, match="'const' with two values to merge"):
        StructuredOutputsParams(json={"allOf": [{"const": 1}, {"const": True}]})
    with pytest.raises(ValueError, match="'enum' with two values to merge"):
        StructuredOutputsParams(json={"allOf": [{"enum": [0, "x"]}, {"enum": [False, "x"]}]})


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "schema, match",
    [
        ({"type": "string", "minLength": 5, "maxLength": 2}, r"at #: maxLength=2 < minLength=5"),
        (
            {"properties": {"a": {"type": "string", "minLength": 1, "maxLength": 0}}},
            r"at #/properties/a: maxLength=0 < minLength=1",
        ),
    ],
)
def test_contradictory_lengths_are_named_by_keyword(schema, match):
    """No string fits: the error names the keywords and where (it was the regex parser's
    "min repeat greater than max repeat" on the schema's whole regex)."""
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=schema)


# ---------------------------------------------------------------------------- a validator


def _canon(v):
    """A key for JSON equality: numbers by value (1 == 1.0), true apart from 1."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return ("n", Fraction(v))
    if isinstance(v, list):
        return ("a", tuple(map(_canon, v)))
    if isinstance(v, dict):
        return ("o", frozenset((k, _canon(x)) for k, x in v.items()))
    return (type(v).__name__, v)


def valid(x, s, root=None) -> bool:
    """JSON Schema's meaning of the keywords the sweeps use, written apart from pagedjax
    (OpenAPI's nullable: null or the rest); $refs point into `root` (default: `s`, with
    `DEFS` as its $defs where it has none)."""
    root = {"$defs": DEFS} | s if root is None and isinstance(s, dict) else root
    if s is True or s == {}:
        return True
    if s is False:
        return False
    if s.get("nullable") and x is None:
        return True
    if "$ref" in s:
        target = root
        for part in s["$ref"].split("/")[1:]:
            target = target[part]
        if not valid(x, target, root):
            return False
    number = isinstance(x, (int, float)) and not isinstance(x, bool)
    kinds = {
        "string": isinstance(x, str),
        "integer": number and float(x).is_integer(),
        "number": number,
        "boolean": isinstance(x, bool),
        "null": x is None,
        "array": isinstance(x, list),
        "object": isinstance(x, dict),
    }
    types = s.get("type", list(kinds))
    if not any(kinds[t] for t in ([types] if isinstance(types, str) else types)):
        return False
    if "const" in s and _canon(x) != _canon(s["const"]):
        return False
    if "enum" in s and _canon(x) not in {_canon(v) for v in s["enum"]}:
        return False
    if "anyOf" in s and not any(valid(x, t, root) for t in s["anyOf"]):
        return False
    if "oneOf" in s and sum(valid(x, t, root) for t in s["oneOf"]) != 1:
        return False
    if not all(valid(x, t, root) for t in s.get("allOf", [])):
        return False
    if number:
        if not math.isfinite(x):
            return False
        v = Fraction(x)
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            b = s.get(key)
            if b is None or isinstance(b, bool):
                continue
            ex = key.startswith("exclusive") or s.get("exclusive" + key.title()) is True
            low = "inimum" in key
            if not ((v > b if ex else v >= b) if low else (v < b if ex else v <= b)):
                return False
    if isinstance(x, str):
        if not s.get("minLength", 0) <= len(x) <= s.get("maxLength", math.inf):
            return False
        if "pattern" in s and not re.search(s["pattern"], x, re.ASCII):
            return False
    if isinstance(x, list):
        if not s.get("minItems", 0) <= len(x) <= s.get("maxItems", math.inf):
            return False
        prefix = s.get("prefixItems", [])
        for i, v in enumerate(x):
            if not valid(v, prefix[i] if i < len(prefix) else s.get("items", True), root):
                return False
    if isinstance(x, dict):
        props = s.get("properties", {})
        if not set(s.get("required", [])) <= set(x):
            return False
        for k, v in x.items():
            if not valid(v, props.get(k, s.get("additionalProperties", True)), root):
                return False
    return True


# ---------------------------------------------------------------------------- random schemas

# Patterns with strings each one matches in full (searched: found by ECMA-262 and `re`).
PATTERNS = {
    r"^[a-c]{1,3}$": ["a", "abc"],
    r"^\d+-\w$": ["1-a", "42-_"],
    r"^(x|yz)*$": ["", "yzx"],
    r'^["\\]+$': ['"', '\\"\\'],
    r"^\S\s$": ["a ", "é\t"],
}
DEFS = {
    "Node": {
        "type": "object",
        "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
        },
        "required": ["v"],
    },
    "Num": {"type": "integer", "minimum": 1, "exclusiveMinimum": True},
}
VALUES = [0, 1, 2.5, "a", "b", None, True, False, [], {"k": 1}, [1, "x"], -0.0]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema of the keywords json_schema supports (some refused: contradictory
    merges, oneOf branches that may overlap)."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "types"]
    if depth < 2:
        kinds += ["array", "object", "object", "anyOf", "oneOf", "allOf", "ref"]
    kind = rng.choice(kinds)
    if kind == "string":
        s = {"type": "string"}
        if rng.random() < 0.4:
            lo = rng.randint(0, 3)
            s |= {"minLength": lo} if rng.random() < 0.5 else {}
            s |= {"maxLength": lo + rng.randint(0, 3)} if rng.random() < 0.6 else {}
        elif rng.random() < 0.5:
            s["pattern"] = rng.choice(list(PATTERNS))
    elif kind in ("integer", "number"):
        s = {"type": kind}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if rng.random() < 0.3:
                b = rng.randint(-20, 20)
                s[key] = rng.choice([b, b + 0.5] if kind == "integer" else [b, float(b)])
        low = [s[k] for k in ("minimum", "exclusiveMinimum") if k in s]
        high = [s[k] for k in ("maximum", "exclusiveMaximum") if k in s]
        if low and high and min(high) - max(low) < 3:
            s = {k: v for k, v in s.items() if "aximum" not in k}
    elif kind in ("boolean", "null"):
        s = {"type": kind}
    elif kind == "enum":
        values = rng.sample(VALUES, rng.randint(1, 3))
        s = {"const": values[0]} if len(values) == 1 else {"enum": values}
    elif kind == "types":
        s = {"type": rng.sample(["string", "integer", "number", "boolean", "null"], 2)}
        s |= {"minimum": 0} if rng.random() < 0.3 else {}
        s |= {"maxLength": 2} if rng.random() < 0.3 else {}
    elif kind == "array":
        s = {"type": "array"}
        if rng.random() < 0.3:
            s["prefixItems"] = [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 2))]
            s["items"] = rng.choice([False, random_schema(rng, depth + 1), {}])
        else:
            s["items"] = random_schema(rng, depth + 1)
        lo = rng.randint(0, 2)
        s |= {"minItems": lo} if rng.random() < 0.4 else {}
        s |= {"maxItems": lo + rng.randint(0, 2)} if rng.random() < 0.4 else {}
        if s["items"] is False:  # (no more items than the prefix)
            s["minItems"] = min(s.get("minItems", 0), len(s["prefixItems"]))
            s["maxItems"] = max(s.get("maxItems", 0), s["minItems"])
    elif kind == "object":
        s = {"type": "object"}
        names = rng.sample(["a", "b", 'd"q', "é"], rng.randint(0, 3))
        if names or rng.random() < 0.5:
            s["properties"] = {k: random_schema(rng, depth + 1) for k in names}
        required = [k for k in names if rng.random() < 0.5]
        extra = rng.random()
        if extra < 0.3:
            s["additionalProperties"] = False
        elif extra < 0.5:
            s["additionalProperties"] = random_schema(rng, depth + 1)
            required += ["x"] if rng.random() < 0.5 else []
        s |= {"required": required} if required else {}
    elif kind in ("anyOf", "oneOf", "allOf"):
        s = {kind: [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    else:
        s = {"$ref": rng.choice(["#/$defs/Node", "#/$defs/Num"])}
        s |= {"maximum": 3} if rng.random() < 0.3 else {}
    if rng.random() < 0.1:
        s["nullable"] = True
    return s


class NoInstance(Exception):
    """random_instance cannot make one (a schema outside its subset)."""


def random_instance(rng: random.Random, s, depth: int = 0):
    """A random instance valid for `s` in the form json_schema generates (an object's
    keys in declared order, then the required keys properties does not list); raises
    NoInstance where it makes none (allOf, $ref, ...)."""
    for _ in range(20):
        x = _instance(rng, s, depth)
        if valid(x, s):
            return x
    raise NoInstance


def _instance(rng: random.Random, s, depth: int):
    if s is True or s == {}:
        return rng.choice([1, "s", None, [2.5], {"k": [True]}] if depth < 2 else [1, "s"])
    if s.get("nullable") and rng.random() < 0.3:
        return None
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return rng.choice(s["enum"])
    if "anyOf" in s or "oneOf" in s:
        return random_instance(rng, rng.choice(s.get("anyOf") or s["oneOf"]), depth + 1)
    kind = s.get("type")
    kind = rng.choice(kind) if isinstance(kind, list) else kind
    if kind == "string":
        if "pattern" in s:
            return rng.choice(PATTERNS[s["pattern"]])
        n = rng.randint(s.get("minLength", 0), s.get("maxLength", s.get("minLength", 0) + 3))
        return "".join(rng.choice('aé😀"\\\n\x01 /\u2028') for _ in range(n))
    if kind in ("integer", "number"):
        frac = rng.choice([0, 0.5, 0.125, -0.75]) if kind == "number" else 0
        return rng.randint(-25, 25) + frac
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        prefix, lo = s.get("prefixItems", []), s.get("minItems", 0)
        hi = s.get("maxItems", lo + 3)
        hi = min(hi, len(prefix)) if s.get("items") is False else hi
        n = rng.randint(lo, hi)
        items = [prefix[i] if i < len(prefix) else s.get("items", True) for i in range(n)]
        return [random_instance(rng, x, depth + 1) for x in items]
    if kind == "object":
        props, required = s.get("properties"), s.get("required", [])
        extra = s.get("additionalProperties", True)
        if props is None and not required:  # any keys
            keys = [] if extra is False else rng.sample(["p", "q"], rng.randint(0, 2))
            return {k: random_instance(rng, extra, depth + 1) for k in keys}
        out = {
            k: random_instance(rng, v, depth + 1)
            for k, v in (props or {}).items()
            if k in required or rng.random() < 0.5
        }
        for k in required:
            if k not in (props or {}):
                out[k] = random_instance(rng, extra, depth + 1)
        return out
    raise NoInstance


def compiled(schema: dict, **kwargs):
    """The DFA of `schema` (with DEFS), or None where it is refused (a ValueError naming
    the schema: never a crash of another kind)."""
    try:
        return dfa_of(schema | {"$defs": DEFS}, **kwargs)
    except ValueError as e:
        assert str(e).startswith("JSON schema at #"), e
        return None


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_texts_random_schemas_allow_are_valid(seed):
    """Soundness: random walks of a random schema's DFA parse as JSON and are valid."""
    rng = random.Random(seed)
    schema = random_schema(rng)
    dfa = compiled(schema)
    if dfa is None:
        return
    for _ in range(12):
        text = random_text(dfa, rng).decode()
        assert valid(json.loads(text), schema), (schema, text)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), compact=st.booleans())
def test_random_schemas_allow_their_instances(seed, compact):
    """Completeness: valid instances, in the form generated, are accepted byte by byte,
    with and without the default whitespace (one optional space) and with none where
    disable_any_whitespace is set."""
    rng = random.Random(seed)
    schema = random_schema(rng)
    dfa = compiled(schema, disable_any_whitespace=compact)
    if dfa is None:
        return
    for _ in range(6):
        try:
            x = random_instance(rng, schema)
        except NoInstance:
            continue
        seps = [(",", ":")] if compact else [(",", ":"), (", ", ": "), (",", ": ")]
        text = json.dumps(x, separators=rng.choice(seps), ensure_ascii=False)
        assert dfa_match(dfa, text.encode()), (schema, text)


# ---------------------------------------------------------------------------- tokens

# Tokens that span JSON's syntax pieces, and UTF-8 characters cut between tokens (é's and
# 😀's bytes apart), beside every single byte.
PIECES = ['":"', '": "', '"},{"', '","', ", ", '{"', '"}', "}]", "[{", '":["', "é", "😀"]
TOKENS = [p.encode() for p in PIECES] + [b"\xc3", b'\xa9"', b"\xf0\x9f", b"\x98\x80"]
TOKENS += [b'a"', b"1,", b"0.", b"e+", b"true}", b"null,", b"-0"] + [bytes([b]) for b in range(256)]


def tokenize(text: bytes, rng: random.Random) -> list[int]:
    """`text` as TOKENS ids: at each place one of the tokens it starts with, at random."""
    ids, i = [], 0
    while i < len(text):
        fits = [t for t, tok in enumerate(TOKENS) if text.startswith(tok, i)]
        t = rng.choice(fits)
        ids.append(t)
        i += len(TOKENS[t])
    return ids


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_instances_cut_into_any_tokens_are_followed_to_the_end(seed):
    """Completeness at token boundaries: a valid instance cut into tokens that span
    several JSON pieces or half a character is allowed token by token and ends in an
    accepting state; and the guide accepts (lets EOS through) only where the text so far
    is a valid instance."""
    rng = random.Random(seed)
    schema = random_schema(rng)
    dfa = compiled(schema)
    if dfa is None:
        return
    guide = guided.Guide(dfa, guided._TokenTable(TOKENS), len(TOKENS))
    for _ in range(4):
        try:
            x = random_instance(rng, schema)
        except NoInstance:
            continue
        text = json.dumps(x, separators=rng.choice([(",", ":"), (", ", ": ")]), ensure_ascii=False)
        state, done = guide.initial_state, b""
        for t in tokenize(text.encode(), rng):
            assert guide.allows(state, t), (schema, text, done, TOKENS[t])
            state = guide.advance(state, t)
            done += TOKENS[t]
            if guide.accepting(state):
                assert valid(json.loads(done), schema), (schema, done)
        assert guide.accepting(state), (schema, text)


# ---------------------------------------------------------------------------- numbers

JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
NUMBER_LIKE = r"[-+]?0?[0-9]{0,3}(\.[0-9]{0,2})?([eE][-+]?[0-9]{0,3})?"  # (near misses too)
NUMBER_DFAS = {}


@settings(max_examples=300, deadline=None)
@given(text=st.from_regex(NUMBER_LIKE, fullmatch=True))
def test_number_texts_follow_the_json_grammar(text):
    """A number or integer is JSON's: no leading zeros, "+", bare "." or "e"; -0 and
    exponents (of at most two digits: 1e999 parses as inf) where unbounded; a number
    with bounds has no exponent and no -0."""
    if not NUMBER_DFAS:
        for kind in ("number", "integer"):
            NUMBER_DFAS[kind] = dfa_of({"type": kind})
            NUMBER_DFAS[kind + " bounded"] = dfa_of({"type": kind, "minimum": -500})
    json_ok = JSON_NUMBER.fullmatch(text) is not None
    if json_ok:
        value = json.loads(text)
        mantissa, _, exponent = text.lower().partition("e")
    for name, dfa in NUMBER_DFAS.items():
        got = dfa_match(dfa, text.encode())
        if not json_ok:
            assert not got, (name, text)
            continue
        want = len(exponent.lstrip("+-")) <= 2
        if name.startswith("integer"):
            want = text == mantissa and "." not in text
        if name.endswith("bounded"):
            zero = re.fullmatch(r"-0(?:\.0*)?", mantissa) is not None
            want = want and not exponent and not zero and value >= -500
        assert got == want, (name, text)


@pytest.mark.parametrize(
    "schema, match",
    [
        ({"type": "string", "format": ["date"]}, r"at #: format \['date'\] is not supported"),
        ({"type": "string", "format": {"a": 1}}, r"at #: format \{'a': 1\} is not supported"),
        ({"properties": {"a": {"pattern": 5}}}, r"at #/properties/a: pattern must be a str, got 5"),
        (
            {"items": {"type": "string", "pattern": "(?=x)"}},
            r"at #/items: pattern: regex '\(\?=x\)': \(\?=x.*lookaround",
        ),
        ({"enum": [1, "a"], "type": 5}, r"at #: type 5 is not supported"),
        ({"enum": [1, "a"], "type": [["x"]]}, r"at #: type \['x'\] is not supported"),
        ({"const": 1, "type": None}, r"at #: type None is not supported"),
    ],
)
def test_malformed_keywords_are_value_errors_naming_where(schema, match):
    """A keyword of the wrong type is a ValueError naming it and its place in the schema
    (these were TypeErrors: "unhashable type: 'list'", "'int' object is not iterable", a
    pattern's without its place)."""
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=schema)
