"""JSON schemas (pagedjax/json_schema.py) through StructuredOutputsParams: random walks
validate, instances and near misses, key orders, string patterns, whitespace options,
json_object's depth."""

import datetime
import itertools
import json
import math
import random
import re
from fractions import Fraction

import numpy as np
import pytest
from test_guided import BYTES, SP, TOKENIZERS, shortest_completion, walk
from test_regex_dfa import dfa_match

from pagedjax import guided
from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.regex_dfa import compile_dfa

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


def walked_json(schema: dict, tok_name: str, seed: int, walks: int = 8) -> list:
    """The JSON values of random token-by-token walks through `schema`'s guide, each
    text checked to fullmatch its regex."""
    tok = TOKENIZERS[tok_name]
    spec = StructuredOutputsParams(json=schema)
    guide = compile_guide(spec, tok, tok.vocab_size)
    rng = random.Random(seed)
    values = []
    for _ in range(walks):
        text = walk(guide, tok, rng, steps=60).decode()
        assert re.fullmatch(spec.to_regex(), text, re.ASCII), text
        values.append(json.loads(text))
    return values


@pytest.mark.parametrize("tok_name", ["bytes", "sentencepiece"])
def test_json_schema_walks_validate(tok_name):
    for x in walked_json(SCHEMA, tok_name, seed=2):
        assert validate(x, SCHEMA), x


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
    dfa = compile_dfa(spec.to_regex())
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
    dfa = compile_dfa(spec.to_regex())
    for keys in itertools.chain.from_iterable(itertools.permutations("abcd", n) for n in range(5)):
        text = json.dumps({k: 1 for k in keys})
        want = set(required) <= set(keys) and list(keys) == sorted(keys)
        assert dfa_match(dfa, text.encode()) == want, text
    for text in ["{,}", '{"a": 1,}', '{, "a": 1}', '{"a": 1 "b": 1}']:
        assert not dfa_match(dfa, text.encode()), text


def test_json_string_patterns_keep_the_string_valid_json():
    """A pattern matches the string's characters; those a JSON string must escape are
    written as their escapes: `.+` lets no raw quote, backslash or control character end
    or break the string, and reads escapes as the characters they stand for (not a
    newline, nor ECMA-262's other line ends)."""
    spec = StructuredOutputsParams(json={"type": "string", "pattern": "^.+$"})
    dfa = compile_dfa(spec.to_regex())
    for text in ['"a é"', '"a\\"b"', '"a\\\\b"', '"a\\tb\\u001F"', '"\\b"']:
        assert dfa_match(dfa, text.encode()), text
    for text in ['""', '"a"b"', '"a\tb"', '"a\nb"', '"a\\nb"', '"a\\rb"', '"\u2028"']:
        assert not dfa_match(dfa, text.encode()), text
    guide = compile_guide(spec, BYTES, 256)
    rng = random.Random(5)
    for _ in range(5):
        assert json.loads(walk(guide, BYTES, rng)) != ""


PATTERN_CASES = [  # (pattern, strings it allows, strings it does not)
    (r'^"[a-z]+"$', ['"ab"'], ["ab", '"A"']),  # a quote, a backslash, a newline: escaped
    (r"^a\\b\n$", ["a\\b\n"], ["ab\n", "a\\b"]),
    (r"^[\x00-\x1f]$", ["\x00", "\x1f", "\n"], [" "]),
    (r"^\S+$", ["aé!", "\x00"], ["a b", "a\xa0", "\u2028", "\ufeff", "\x1c", "\x85"]),
    (r"^\D\W$", ["a-", "é!"], ["1-", "٣-", "a_", "aé"]),  # (Python: ٣ a digit, é a letter)
    (r"^[^\d\s\w]$", ["-", "€"], ["٣", "é", "\xa0", "a", " "]),
    (r"^[^\D\S]\d\w\s$", [], ["11a ", "٣1a ", "11é ", "11a\xa0"]),  # (nothing: 0-9 and \s)
    (r"^\d\w\s$", ["1a "], ["٣a ", "1é ", "1a\xa0"]),
]


@pytest.mark.parametrize("case", range(len(PATTERN_CASES)))
def test_json_string_patterns_match_as_ecma_and_python_both_read_them(case):
    """\\d \\w \\s are ASCII's (ECMA-262's), \\D \\W \\S and negated classes leave out what
    Python's Unicode classes hold too: every string allowed is valid for a validator of
    either reading."""
    pattern, good, bad = PATTERN_CASES[case]
    spec = StructuredOutputsParams(json={"type": "string", "pattern": pattern})
    try:
        dfa = compile_dfa(spec.to_regex())
    except ValueError as e:  # (nothing allowed)
        assert not good and "matches nothing" in str(e)
        return
    for text in good:
        assert reference_valid(text, {"pattern": pattern}), text  # (the cases themselves)
        assert dfa_match(dfa, json.dumps(text, ensure_ascii=False).encode()), text
    for text in bad:
        assert not dfa_match(dfa, json.dumps(text, ensure_ascii=False).encode()), text


@pytest.mark.parametrize(
    "pattern, match",
    [
        ("^[^]$", "ECMA-262 and Python read it differently"),
        ("[]a]", "ECMA-262 and Python read it differently"),
        ("a{,3}", "ECMA-262 reads it as text, Python as a count"),
        (r"\a", r"\\a: this escape"),
        (r"\U0001F600", r"\\U: this escape"),
        (r"\ud800", "surrogate"),
        ("(?i)a", "not supported"),
        (r"(a)\1", "backreferences"),
        ("(?=a)a", "lookaround"),
        ("a|^b", "anchor"),
    ],
)
def test_json_string_patterns_read_differently_are_refused(pattern, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json={"properties": {"p": {"type": "string", "pattern": pattern}}})


def test_json_whitespace_options():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def matches(text, **kw):
        dfa = compile_dfa(StructuredOutputsParams(json=schema, **kw).to_regex())
        return dfa_match(dfa, text.encode())

    assert matches('{"a": 1}') and matches('{ "a" : 1 }') and not matches('{\n"a": 1}')
    assert matches('{"a":1}', disable_any_whitespace=True)
    assert not matches('{"a": 1}', disable_any_whitespace=True)
    pretty = json.dumps({"a": 1}, indent=2)
    assert matches(pretty, whitespace_pattern=r"[ \n]*") and not matches(pretty)
    # Only JSON's whitespace: \s's \v and \f are left out; a pattern of none is refused.
    assert matches('{\t"a":\r\n1}', whitespace_pattern=r"\s*")
    for text in ['{\x0b"a": 1}', '{"a": 1\x0c}', '{"a":\xa01}']:
        assert not matches(text, whitespace_pattern=r"\s*"), text
        assert not matches(text, whitespace_pattern=r"(?:.|\n)*"), text
    for ws in ["x", "[ ]?-?"]:
        with pytest.raises(ValueError, match="whitespace_pattern.*JSON whitespace"):
            StructuredOutputsParams(json=schema, whitespace_pattern=ws)


def test_json_object_depth_and_any_values():
    spec = StructuredOutputsParams(json_object=True)
    dfa = compile_dfa(spec.to_regex())
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


OBJECT_CASES = [  # (schema, texts it allows, texts it does not)
    (  # pydantic's dict[str, int]
        {"type": "object", "additionalProperties": {"type": "integer"}},
        ["{}", '{"a": 1, "b": -2}'],
        ['{"a": "x"}', '{"a": 1, "b": null}'],
    ),
    ({"type": "object", "additionalProperties": False}, ["{}"], ['{"a": 1}']),
    ({"type": "object", "required": ["a"]}, ['{"a": [1]}'], ["{}", '{"b": 1}']),
    (
        {"type": "object", "required": ["a"], "additionalProperties": {"type": "string"}},
        ['{"a": "x"}'],
        ["{}", '{"a": 1}'],
    ),
    (  # keywords beside anyOf hold in each branch
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["b"],
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
        ['{"a": 1, "b": 2}', '{"b": 2}'],
        ["{}", '{"a": 1}', "1", '"x"'],
    ),
    (  # properties beside anyOf and in a branch: both sets (in declared order)
        {
            "properties": {"a": {"type": "integer"}},
            "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}],
        },
        ['{"a": 1, "b": 2}', '{"b": 2}'],
        ["{}", '{"a": 1}', '{"b": 2, "a": 1}'],
    ),
    (  # ... and in a branch that is a $ref
        {
            "type": "string",
            "anyOf": [{"maxLength": 1}, {"$ref": "#/$defs/D"}],
            "$defs": {"D": {"format": "date"}},
        },
        ['"a"', '"2024-01-31"'],
        ['"ab"', "1", "null"],
    ),
    (  # pydantic's discriminated union: the discriminator is an annotation
        {
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            "discriminator": {"propertyName": "pet", "mapping": {"cat": "#/$defs/Cat"}},
            "$defs": {
                k: {"properties": {"pet": {"const": k.lower()}}, "required": ["pet"]}
                for k in ("Cat", "Dog")
            },
        },
        ['{"pet": "cat"}', '{"pet": "dog"}'],
        ["{}", '{"pet": "cow"}'],
    ),
]


@pytest.mark.parametrize("case", range(len(OBJECT_CASES)))
def test_additional_properties_and_keywords_beside_any_of_are_enforced(case):
    schema, good, bad = OBJECT_CASES[case]
    dfa = compile_dfa(StructuredOutputsParams(json=schema).to_regex())
    for text in good:
        assert dfa_match(dfa, text.encode()), text
    for text in bad:
        assert not dfa_match(dfa, text.encode()), text


@pytest.mark.parametrize(
    "schema, match",
    [
        ({"pattern": "a", "anyOf": [{"pattern": "b"}]}, "#/anyOf/0: 'pattern' with two values"),
        ({"type": "object", "additionalProperties": "no"}, "additionalProperties must be"),
        ({"type": "object", "additionalProperties": False, "required": ["a"]}, "'a'"),
    ],
)
def test_unenforceable_object_keywords_are_refused(schema, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=schema)


def test_json_string_escapes_are_whole_characters():
    """A \\u escape is one character: never a lone surrogate (no Unicode text has one;
    json.loads would hand back a str that cannot be encoded); a surrogate pair is one
    character, so where minLength / maxLength count characters there is none (the
    character is written as itself)."""
    cases = [  # (schema, texts it allows, texts it does not)
        (
            {"type": "string"},
            ['"\\ud83d\\ude00"', '"\\u00e9\\uFFFF\\uD7ff\\uE000"', '"😀"'],
            ['"\\ud800"', '"\\udc00"', '"\\ude00\\ud83d"', '"\\ud83d\\u0041"', '"\\uDBFF"'],
        ),
        ({"type": "string", "minLength": 2}, ['"😀a"', '"\\u00e9\\uFFFF"'], ['"\\ud83d\\ude00"']),
        ({"type": "string", "maxLength": 1}, ['"😀"', '"\\uD7FF"'], ['"\\ud83d"', '"😀a"']),
        ({"type": "object"}, ['{"\\ud83d\\ude00": "\\u00e9"}'], ['{"\\udfff": 1}']),
    ]
    for schema, good, bad in cases:
        dfa = compile_dfa(StructuredOutputsParams(json=schema).to_regex())
        for text in good:
            assert dfa_match(dfa, text.encode()), text
            assert reference_valid(json.loads(text), schema), text  # (the cases themselves)
        for text in bad:
            assert not dfa_match(dfa, text.encode()), text


# ---------------------------------------------------------------------------- sweeps
# Soundness against a reference validator: what a schema's DFA accepts (random walks
# through it, and mutants of valid instances) parses as JSON and is valid for the schema.

ECMA_SPACE = "\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
ECMA = {"d": "0-9", "w": "A-Za-z0-9_", "s": ECMA_SPACE}


def ecma_search(pattern: str, text: str) -> bool:
    """ECMA-262's search of `pattern` (without the u flag), by Python's `re` with its
    classes spelled out (\\D \\W \\S only outside classes, as SWEEP uses them)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c, nxt = pattern[i], pattern[i + 1 : i + 2]
        if c == "\\" and nxt.lower() in ECMA:
            chars = ECMA[nxt.lower()]
            out.append(chars if in_class else f"[{'^' if nxt.isupper() else ''}{chars}]")
            i += 2
            continue
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        in_class = (in_class or c == "[") and c != "]"
        out.append("[^\n\r\u2028\u2029]" if c == "." and not in_class else c)
        i += 1
    return re.search("".join(out), text) is not None


def _canon(v) -> str:
    """A key for JSON equality: numbers by value (1 == 1.0), true apart from 1."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"n{Fraction(v)}"
    if isinstance(v, list):
        return "[" + ",".join(map(_canon, v)) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_canon(x)}" for k, x in sorted(v.items()))
    return json.dumps(v)


def _date_ok(s: str) -> bool:
    try:
        return re.fullmatch(r"\d{4}-\d\d-\d\d", s, re.ASCII) and datetime.date.fromisoformat(s)
    except ValueError:
        return False


_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([zZ]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_U, _PCT, _SUB = r"A-Za-z0-9\-._~", r"%[0-9A-Fa-f]{2}", r"!$&'()*+,;="
_PCHAR = rf"([{_U}{_SUB}:@]|{_PCT})"
FORMATS = {  # RFC 3339, 4122, 5321 (dot-atom, LDH labels), 3986
    "date": _date_ok,
    "time": lambda s: re.fullmatch(_TIME, s, re.ASCII),
    "date-time": lambda s: s[10:11] in ("T", "t") and _date_ok(s[:10]) and FORMATS["time"](s[11:]),
    "uuid": lambda s: re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", s),
    "email": lambda s: re.fullmatch(rf"{_ATOM}(\.{_ATOM})*@{_LABEL}(\.{_LABEL})+", s, re.ASCII),
    "uri": lambda s: re.fullmatch(
        rf"[A-Za-z][A-Za-z0-9+.\-]*:(//(([{_U}{_SUB}:]|{_PCT})*@)?([{_U}{_SUB}]|{_PCT})*"
        rf"(:\d*)?(/{_PCHAR}*)*|/({_PCHAR}+(/{_PCHAR}*)*)?|{_PCHAR}+(/{_PCHAR}*)*|)"
        rf"(\?({_PCHAR}|[/?])*)?(#({_PCHAR}|[/?])*)?",
        s,
        re.ASCII,
    ),
}


def reference_valid(x, s, root=None) -> bool:
    """JSON Schema's meaning of the keywords SWEEP uses (a pattern: searched by ECMA-262's
    reading and by Python's `re`; both must find it)."""
    root = s if root is None else root
    if s is True or s == {}:
        return True
    if "$ref" in s:
        target = root
        for part in s["$ref"].split("/")[1:]:
            target = target[part]
        if not reference_valid(x, target, root):
            return False
    if s.get("nullable") and x is None:
        return True
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
    if "enum" in s and _canon(x) not in set(map(_canon, s["enum"])):
        return False
    if "anyOf" in s and not any(reference_valid(x, t, root) for t in s["anyOf"]):
        return False
    if "oneOf" in s and sum(reference_valid(x, t, root) for t in s["oneOf"]) != 1:
        return False
    if not all(reference_valid(x, t, root) for t in s.get("allOf", [])):
        return False
    if number:
        if not math.isfinite(x):
            return False
        v = Fraction(x)
        tests = {
            "minimum": lambda b: v >= b,
            "maximum": lambda b: v <= b,
            "exclusiveMinimum": lambda b: v > b,
            "exclusiveMaximum": lambda b: v < b,
        }
        if not all(test(Fraction(s[k])) for k, test in tests.items() if k in s):
            return False
    if isinstance(x, str):
        if not s.get("minLength", 0) <= len(x) <= s.get("maxLength", math.inf):
            return False
        if "format" in s and not FORMATS[s["format"]](x):
            return False
        if "pattern" in s and not (
            ecma_search(s["pattern"], x) and re.search(s["pattern"], x) is not None
        ):
            return False
    if isinstance(x, list):
        if not s.get("minItems", 0) <= len(x) <= s.get("maxItems", math.inf):
            return False
        prefix = s.get("prefixItems", [])
        for i, v in enumerate(x):
            if not reference_valid(v, prefix[i] if i < len(prefix) else s.get("items", {}), root):
                return False
    if isinstance(x, dict):
        props = s.get("properties", {})
        if not set(s.get("required", [])) <= set(x):
            return False
        for k, v in x.items():
            sub = props.get(k, s.get("additionalProperties", True))
            if sub is False or not reference_valid(v, sub, root):
                return False
    return True


SWEEP = [  # schemas whose DFAs' random walks must all be valid
    {"type": "string"},
    {"type": "string", "minLength": 2, "maxLength": 3},
    *({"type": "string", "format": f} for f in FORMATS),
    {"type": "string", "pattern": r"^\S+$"},
    {"type": "string", "pattern": r"^.{1,3}$"},
    {"type": "string", "pattern": r"^\D\W[^\d\s]$"},
    {"type": "string", "pattern": r'^"\w+\\[^a-z]*"\s$'},
    {"type": ["number", "null"]},
    {"type": "integer", "minimum": -3, "exclusiveMaximum": 1000},
    {"type": "number", "exclusiveMinimum": -1, "maximum": 2},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"const": 1.0}, {"enum": [None, {"a": []}]}], "items": False},
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", 2, True]}, "c": {}},
        "required": ["b"],
    },
    {"type": "object", "additionalProperties": {"type": "string", "maxLength": 1}},
    {"oneOf": [{"type": "string"}, {"type": "integer"}, {"$ref": "#/$defs/P"}]}
    | {"$defs": {"P": {"type": "object", "properties": {"k": {"const": "p"}}, "required": ["k"]}}},
    {},
]


def random_text(dfa, rng: random.Random, max_len: int = 40) -> bytes:
    """A random text the DFA accepts: a walk that picks among the next states (then a
    byte to one), stopping now and then where it accepts, then the shortest completion."""
    state, out = dfa.initial, bytearray()
    while len(out) < max_len and not (dfa.accept[state] and rng.random() < 0.15):
        row = dfa.trans[state]
        if not row.any():
            break
        nxt = rng.choice(sorted(set(row[row != 0].tolist())))
        out.append(rng.choice(np.flatnonzero(row == nxt).tolist()))
        state = nxt
    return bytes(out) + shortest_completion(dfa, state)


def sweep_walks(case: int, walks: int) -> None:
    schema = SWEEP[case]
    dfa = compile_dfa(StructuredOutputsParams(json=schema).to_regex())
    rng = random.Random(case)
    for _ in range(walks):
        text = random_text(dfa, rng).decode()
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode()  # (no lone surrogate)
        assert reference_valid(value, schema), text


@pytest.mark.parametrize("case", range(len(SWEEP)))
def test_random_texts_a_schema_allows_are_valid(case):
    sweep_walks(case, 40)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(SWEEP)))
def test_random_texts_a_schema_allows_are_valid_sweep(case):
    sweep_walks(case, 3000)
