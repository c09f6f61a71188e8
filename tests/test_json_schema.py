"""JSON schemas (pagedjax/json_schema.py) through StructuredOutputsParams: random walks
validate, instances and near misses, key orders, string patterns, whitespace options,
json_object's depth."""

import itertools
import json
import random
import re

import pytest
from test_guided import BYTES, SP, TOKENIZERS, walk
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
    """A pattern's classes lose the characters a JSON string must escape: `.+` does not
    let a raw quote, backslash or control character end or break the string."""
    spec = StructuredOutputsParams(json={"type": "string", "pattern": "^.+$"})
    dfa = compile_dfa(spec.to_regex())
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
        dfa = compile_dfa(StructuredOutputsParams(json=schema, **kw).to_regex())
        return dfa_match(dfa, text.encode())

    assert matches('{"a": 1}') and matches('{ "a" : 1 }') and not matches('{\n"a": 1}')
    assert matches('{"a":1}', disable_any_whitespace=True)
    assert not matches('{"a": 1}', disable_any_whitespace=True)
    pretty = json.dumps({"a": 1}, indent=2)
    assert matches(pretty, whitespace_pattern=r"[ \n]*") and not matches(pretty)


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
            "oneOf": [{"maxLength": 1}, {"$ref": "#/$defs/D"}],
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
