"""The JSON-schema keywords of Pydantic and OpenAI clients (pagedjax/json_schema.py):
integer and number bounds (exact, against Python's arithmetic), prefixItems, allOf,
format uri and lengths, nullable, uniqueItems false, recursive $ref; instances and near
misses, guide walks that json.loads and validate, refusals naming the keyword."""

import json
import math
import random
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_guided import TOKENIZERS, walk
from test_json_schema import walked_json
from test_regex_dfa import dfa_match

from pagedjax import json_schema
from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.regex_dfa import compile_dfa


def matcher(schema):
    """text -> whether the schema's DFA accepts it (checked against Python's `re` too)."""
    regex = StructuredOutputsParams(json=schema).to_regex()
    dfa, rx = compile_dfa(regex), re.compile(regex, re.ASCII)

    def match(text: str) -> bool:
        got = dfa_match(dfa, text.encode())
        assert got == bool(rx.fullmatch(text)), text
        return got

    return match


def check_cases(schema, good, bad):
    match = matcher(schema)
    for text in good:
        assert match(text), text
    for text in bad:
        assert not match(text), text


# ---------------------------------------------------------------------------- numbers

INTEGER_BOUNDS = [  # (keywords, lo, hi): the integers lo..hi (None: unbounded)
    ({"minimum": 0}, 0, None),
    ({"minimum": 1}, 1, None),
    ({"exclusiveMinimum": 0}, 1, None),
    ({"maximum": -3}, None, -3),
    ({"exclusiveMaximum": 100}, None, 99),
    ({"minimum": -15, "maximum": 120}, -15, 120),
    ({"minimum": 1.5, "exclusiveMaximum": 20.5}, 2, 20),
    ({"minimum": 5, "exclusiveMinimum": True, "maximum": 9, "exclusiveMaximum": False}, 6, 9),
    ({"minimum": 3, "exclusiveMinimum": 3, "multipleOf": 1}, 4, None),  # the stricter
    ({"minimum": -(2**63), "maximum": 2**63 - 1}, -(2**63), 2**63 - 1),
    ({"minimum": 0, "maximum": 0}, 0, 0),
]


@pytest.mark.parametrize("case", range(len(INTEGER_BOUNDS)))
def test_integer_bounds_are_exact(case):
    keywords, lo, hi = INTEGER_BOUNDS[case]
    match = matcher({"type": "integer", **keywords})
    values = set(range(-130, 1030)) | {
        b + d for b in (lo, hi) if b is not None for d in (-1001, -100, -11, -1, 0, 1, 10, 999)
    }
    for v in values:
        assert match(str(v)) == ((lo is None or v >= lo) and (hi is None or v <= hi)), v
    for text in ["-0", "01", "-01", "+1", "1.0", "1e2", ""]:
        assert not match(text), text


def number_text_ok(text: str, lo, lo_ex, hi, hi_ex) -> bool:
    """A bounded number's text: JSON without exponent, not -0, within the bounds."""
    if not re.fullmatch(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?", text) or re.fullmatch(
        r"-0(?:\.0+)?", text
    ):
        return False
    v = Fraction(text)
    return (lo is None or (v > lo if lo_ex else v >= lo)) and (
        hi is None or (v < hi if hi_ex else v <= hi)
    )


NUMBER_BOUNDS = [  # (keywords, lo, lo exclusive, hi, hi exclusive)
    ({"minimum": 0}, 0, False, None, False),
    ({"exclusiveMinimum": 0}, 0, True, None, False),
    ({"maximum": 0}, None, False, 0, False),
    ({"exclusiveMaximum": 0}, None, False, 0, True),
    ({"minimum": 0, "maximum": 1}, 0, False, 1, False),
    ({"exclusiveMinimum": -1, "exclusiveMaximum": 1}, -1, True, 1, True),
    ({"minimum": -10.0, "maximum": 2, "exclusiveMaximum": 12}, -10, False, 2, False),
    ({"minimum": 7, "exclusiveMinimum": True}, 7, True, None, False),
    ({"minimum": 1, "maximum": 1}, 1, False, 1, False),
]
NUMBER_TEXTS = [
    f"{sign}{i}{frac}"
    for sign in ("", "-")
    for i in (0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 99, 100)
    for frac in ("", ".0", ".00", ".5", ".05", ".50", ".999")
] + ["1e2", "0e0", "0.", ".5", "01", "-", "1.5e0", "+1"]


@pytest.mark.parametrize("case", range(len(NUMBER_BOUNDS)))
def test_number_bounds_are_exact_without_exponent(case):
    keywords, *bounds = NUMBER_BOUNDS[case]
    match = matcher({"type": "number", **keywords})
    for text in NUMBER_TEXTS:
        assert match(text) == number_text_ok(text, *bounds), text


bound = st.one_of(st.none(), st.integers(-(10**12), 10**12))


@settings(max_examples=300, deadline=None)
@given(lo=bound, lo_ex=st.booleans(), hi=bound, hi_ex=st.booleans(), data=st.data())
def test_bounds_match_like_python_arithmetic(lo, lo_ex, hi, hi_ex, data):
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_ex or hi_ex))):
        return
    keys = {"minimum": (lo, lo_ex), "maximum": (hi, hi_ex)}
    kw = {("exclusive" + k.title() if ex else k): b for k, (b, ex) in keys.items() if b is not None}
    near = st.sampled_from([b for b in (lo, hi, 0) if b is not None])
    ints = st.one_of(
        st.integers(-(10**13), 10**13), st.builds(int.__add__, near, st.integers(-3, 3))
    )
    regex = re.compile(json_schema.schema_regex({"type": "integer", **kw}, ""), re.ASCII)
    v = data.draw(ints)
    want = (lo is None or v > lo - (not lo_ex)) and (hi is None or v < hi + (not hi_ex))
    assert bool(regex.fullmatch(str(v))) == want
    regex = re.compile(json_schema.schema_regex({"type": "number", **kw}, ""), re.ASCII)
    text = f"{v}" + data.draw(st.sampled_from(["", ".0", ".000", ".01", ".5", ".9990"]))
    text = "0" + text[2:] if text.startswith("-0") else text
    bounds = (lo, lo_ex, hi, hi_ex)
    assert bool(regex.fullmatch(text)) == number_text_ok(text, *bounds), text


def test_bounds_belong_to_numbers():
    """minimum on a string does not apply; without type it makes the schema a number's."""
    check_cases({"type": ["string", "null"], "minimum": 3}, ['"a"', "null"], ["1"])
    check_cases({"type": ["integer", "null"], "minimum": 3}, ["3", "null"], ["2", '"a"'])
    check_cases({"minimum": 0}, ["0", "2.5"], ["-1", '"a"', "null"])


# ---------------------------------------------------------------------------- arrays, allOf, ...

CASES = [  # (schema, texts it allows, texts it does not)
    (  # pydantic's tuple[int, str]
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
        | {"minItems": 2, "maxItems": 2},
        ['[1, "a"]', '[-3,""]'],
        ["[]", "[1]", '["a", 1]', '[1, "a", 2]', '[1, "a",]'],
    ),
    (  # tuple[int, *tuple[str, ...]]
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}
        | {"minItems": 1},
        ["[1]", '[1, "a", "b"]'],
        ["[]", '["a"]', "[1, 2]"],
    ),
    (  # without minItems the prefix may stop early; items false: nothing after it
        {"prefixItems": [{"const": "a"}, {"const": "b"}], "items": False},
        ["[]", '["a"]', '["a", "b"]'],
        ['["b"]', '["a", "b", "c"]', '["a", "b", 1]'],
    ),
    (  # items absent: any values after the prefix; maxItems
        {"type": "array", "prefixItems": [{"type": "null"}], "maxItems": 3},
        ["[null]", '[null, {"a": [1]}, "x"]'],
        ["[1]", "[null, 1, 2, 3]"],
    ),
    ({"type": "array", "prefixItems": [{}, {}, {}], "maxItems": 1}, ["[]", "[1]"], ["[1, 2]"]),
    ({"type": "array", "items": False}, ["[]"], ["[1]"]),
    ({"type": "array", "uniqueItems": False, "maxItems": 2}, ["[1, 1]"], ["[1, 1, 1]"]),
    (  # allOf: a $ref and more properties (inheritance), required lists joined
        {
            "allOf": [
                {"$ref": "#/$defs/Base"},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
            ],
            "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "string"}}}},
        },
        ['{"a": "x", "b": 1}', '{"b": 2}'],
        ["{}", '{"a": "x"}', '{"b": 1, "a": "x"}', '{"b": "x"}'],
    ),
    (  # allOf: the stricter bound, the types both allow, one property in both (both hold)
        {
            "allOf": [
                {"type": ["integer", "string"], "minimum": 0, "maximum": 10},
                {"type": "number", "minimum": 5},
            ]
        },
        ["5", "10"],
        ["4", "11", "7.5", '"a"'],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0}},
            "allOf": [{"properties": {"a": {"maximum": 3}}, "required": ["a"]}],
        },
        ['{"a": 0}', '{"a": 3}'],
        ["{}", '{"a": 4}', '{"a": -1}'],
    ),
    (  # keywords beside a $ref hold too
        {"$ref": "#/$defs/N", "maximum": 5, "$defs": {"N": {"type": "integer", "minimum": 1}}},
        ["1", "5"],
        ["0", "6"],
    ),
    (  # (these three were accepted and not enforced before)
        {"$ref": "#/$defs/S", "maxLength": 1, "$defs": {"S": {"type": "string"}}},
        ['"a"'],
        ['"ab"'],
    ),
    ({"minLength": 2}, ['"ab"'], ['"a"', "12", "null"]),  # without type: a string's
    ({"required": ["a"]}, ['{"a": 1}'], ["{}", "1"]),
    (  # OpenAPI's nullable
        {"type": "object", "properties": {"s": {"type": "string", "nullable": True}}}
        | {"required": ["s"]},
        ['{"s": null}', '{"s": "a"}'],
        ['{"s": 1}', "null"],
    ),
    ({"enum": ["a", "b"], "nullable": True}, ['"a"', "null"], ['"c"']),
    ({"nullable": False, "type": "integer"}, ["1"], ["null"]),
    (  # an enum's values of the type
        {"enum": ["a", 1, 2.0, None, True], "type": ["string", "integer"]},
        ['"a"', "1", "2.0"],
        ["null", "true"],
    ),
    (  # format uri: a scheme, ":", then URI characters
        {"type": "string", "format": "uri", "minLength": 1},  # pydantic's AnyUrl
        ['"https://example.com/a?b=1#c"', '"mailto:x@y.z"', '"urn:isbn:0-486-27557-4"'],
        ['"example.com"', '"1http://a"', '"http://a b"', '"http:"', '"http://\\u00e9"'],
    ),
    (  # lengths that all of a format's strings fit
        {"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36},
        ['"123e4567-e89b-12d3-a456-426614174000"'],
        ['"x"'],
    ),
    ({"type": "string", "format": "date", "maxLength": 20}, ['"2024-01-31"'], ['"2024-1-31"']),
    (  # dates that exist: months' lengths, leap years (not 1900, 2100; 2000), no year 0
        {"type": "string", "format": "date"},
        ['"2024-02-29"', '"2000-02-29"', '"0004-02-29"', '"1999-04-30"', '"0001-12-31"'],
        ['"2023-02-29"', '"1900-02-29"', '"2100-02-29"', '"2024-02-30"', '"2024-04-31"']
        + ['"2024-11-31"', '"0000-01-01"', '"2024-00-10"', '"2024-13-01"', '"2024-01-32"'],
    ),
    (
        {"type": "string", "format": "date-time"},
        ['"2024-02-29T23:59:59.5+05:30"', '"2024-12-31T00:00:00Z"'],
        ['"2023-02-29T00:00:00Z"', '"2024-06-31T00:00:00Z"', '"2024-01-01T24:00:00Z"'],
    ),
    (  # email: a dot-atom before the @, labels of letters, digits and inner hyphens
        {"type": "string", "format": "email"},
        ['"a.b+c@x-y.example.com"', '"o_k@a1.io"'],
        ['".a@x.io"', '"a.@x.io"', '"a..b@x.io"', '"a@-x.io"', '"a@x-.io"', '"a@x..io"']
        + ['"a@x.io."', '"a@x"', '"@x.io"'],
    ),
    (  # uri: RFC 3986's characters in their places, "%" only before two hex digits
        {"type": "string", "format": "uri"},
        ['"http://u:p@h.io:8080/a/%C3%A9?q=1&r#f/?"', '"file:///etc/x"', '"a:b"', '"x:/"'],
        ['"a:%"', '"a:%zz"', '"a:%4"', '"a:["', '"a:]"', '"http://h:8x/"', '"a:b#c#d"']
        + ['"a:<b>"', '"a:b c"', '"a:\\\\b"'],
    ),
    (  # oneOf: branches no value can match two of (types, discriminating constants)
        {
            "oneOf": [
                {"type": "string"},
                {"type": ["integer", "null"]},
                {"$ref": "#/$defs/A"},
                {"allOf": [{"$ref": "#/$defs/B"}]},
            ],
            "$defs": {
                "A": {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                "B": {"type": "object", "properties": {"k": {"enum": [2, "1"]}}}
                | {"required": ["k"]},
            },
        },
        ['"a"', "1", "null", '{"k": 1}', '{"k": "1"}'],
        ["1.5", '{"k": 3}', "[]", "true"],
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_keywords_are_enforced(case):
    check_cases(*CASES[case])


# ---------------------------------------------------------------------------- recursion

NODE = {
    "type": "object",
    "properties": {
        "value": {"type": "integer", "minimum": 0},
        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
    },
    "required": ["value", "children"],
}
TREE = {"$ref": "#/$defs/Node", "$defs": {"Node": NODE}}


def tree_depth(x) -> int:
    """The nodes nested in `x`, a valid tree (else an AssertionError)."""
    assert list(x) == ["value", "children"] and isinstance(x["value"], int) and x["value"] >= 0
    return 1 + max(map(tree_depth, x["children"]), default=0)


@pytest.mark.parametrize("tok_name", ["bytes", "sentencepiece"])
def test_recursive_ref_is_unrolled_ref_depth_deep(tok_name):
    tok = TOKENIZERS[tok_name]
    guide = compile_guide(StructuredOutputsParams(json=TREE), tok, tok.vocab_size)
    rng, deepest = random.Random(4), 0
    for _ in range(8):
        deepest = max(deepest, tree_depth(json.loads(walk(guide, tok, rng, steps=80))))
    assert deepest <= json_schema.REF_DEPTH == 3

    def node(*children):
        return {"value": 1, "children": list(children)}

    match = matcher(TREE)
    assert match(json.dumps(node(node(node()), node())))  # 3 deep
    for bad in [node(node(node(node()))), {"value": 1}, {"value": -1, "children": []}]:
        assert not match(json.dumps(bad)), bad


def test_recursive_refs_end_where_the_schema_lets_them():
    linked = {  # a linked list through the root: anyOf's null ends it
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
    }
    check_cases(
        linked,
        ['{"next": null}', '{"next": {"next": {"next": null}}}'],
        ['{"next": {"next": {"next": {"next": null}}}}', "{}"],
    )
    endless = {"$defs": {"A": {"properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}}}
    spec = StructuredOutputsParams(json={"$ref": "#/$defs/A"} | endless)
    with pytest.raises(ValueError, match="matches nothing"):  # no finite instance
        compile_dfa(spec.to_regex())


# ---------------------------------------------------------------------------- all together

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 12},
        "p": {"type": "number", "minimum": 0, "maximum": 1},
        "pair": {
            "type": "array",
            "prefixItems": [{"type": "integer", "exclusiveMaximum": 0}, {"format": "uri"}],
            "items": False,
            "minItems": 2,
        },
        "note": {"type": "string", "maxLength": 3, "nullable": True},
        "both": {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {"type": "boolean"}}}]},
    },
    "required": ["n", "p", "pair", "both"],
    "$defs": {"A": {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}},
}


def check(x):
    assert list(x) == [k for k in SCHEMA["properties"] if k in x]
    assert type(x["n"]) is int and 1 <= x["n"] <= 12 and 0 <= x["p"] <= 1
    (i, uri) = x["pair"]
    assert type(i) is int and i < 0 and re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*:\S+", uri)
    assert x.get("note") is None or len(x["note"]) <= 3
    assert x["both"]["a"] == 1 and set(x["both"]) <= {"a", "b"}


@pytest.mark.parametrize("tok_name", ["bytes", "sentencepiece"])
def test_walks_validate(tok_name):
    for x in walked_json(SCHEMA, tok_name, seed=6):
        check(x)


@pytest.mark.parametrize(
    "schema, match",
    [
        ({"type": "integer", "multipleOf": 3}, "#: multipleOf 3 is not supported"),
        ({"type": "number", "multipleOf": 1}, "multipleOf 1"),
        ({"minimum": 0, "multipleOf": 0.5}, "multipleOf 0.5"),
        ({"type": "number", "minimum": 0.5}, "minimum 0.5 on a number"),
        ({"type": "number", "exclusiveMaximum": 1e-3}, "exclusiveMaximum 0.001"),
        ({"type": "integer", "exclusiveMinimum": True}, "exclusiveMinimum true needs"),
        ({"type": "integer", "minimum": "0"}, "minimum must be a number, got '0'"),
        ({"type": "integer", "minimum": True}, "minimum must be a number, got True"),
        ({"type": "integer", "minimum": False}, "minimum must be a number, got False"),
        ({"allOf": [{"const": 1}, {"type": "string"}]}, "#: no const value is of type 'str"),
        ({"type": "string", "anyOf": [{"const": 1}]}, "#/anyOf/0: no const value"),
        ({"const": 1, "type": "string"}, "no const value is of type"),
        (
            {"additionalProperties": False, "anyOf": [{"properties": {"a": {}}}]},
            "#/anyOf/0: additionalProperties merged with property 'a'",
        ),
        ({"enum": ["a"], "maxLength": 0}, "'maxLength' beside enum"),
        ({"enum": ["a"], "type": "text"}, "type 'text'"),
        ({"type": "integer", "minimum": 2, "maximum": 1.5}, "no integer is within"),
        ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "no number is within"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems true"),
        ({"properties": {"a": {"uniqueItems": 1}}}, "#/properties/a: uniqueItems must be a bool"),
        ({"type": "string", "nullable": "yes"}, "nullable must be a bool"),
        ({"type": "array", "prefixItems": {"type": "string"}}, "prefixItems must be a list"),
        ({"prefixItems": [{}], "items": False, "minItems": 2}, "items false after 1 prefixItems"),
        ({"prefixItems": [{"type": "date"}]}, "#/prefixItems/0: type 'date'"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "#/allOf/1: type 'integer'"),
        ({"allOf": [{"pattern": "a"}, {"pattern": "b"}]}, "'pattern' with two values"),
        (
            {"allOf": [{"additionalProperties": False}, {"properties": {"a": {}}}]},
            "additionalProperties merged with property 'a'",
        ),
        ({"allOf": [{"const": 1}, False]}, "#/allOf/1: a schema must be an object"),
        ({"$ref": "#/$defs/A", "format": "x", "$defs": {"A": {}}}, "#: format 'x'"),
        ({"type": "string", "format": "uri", "maxLength": 2083}, "format 'uri' with maxLength"),
        ({"type": "string", "format": "date", "minLength": 11}, "no string of format 'date'"),
        ({"type": "string", "format": "email", "minLength": 6}, "'email' with minLength"),
        # oneOf: a value valid for two branches is valid for neither reading
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "#: oneOf 0 and 1 may both"),
        ({"oneOf": [{"type": "string"}, {"maxLength": 3}]}, "oneOf 0 and 1 may both"),
        ({"oneOf": [{"const": 1}, {"enum": [2, 1.0]}]}, "oneOf 0 and 1 may both"),
        ({"type": "string", "oneOf": [{}, {"format": "date"}]}, "oneOf 0 and 1 may both"),
        (
            {"oneOf": [{"type": "object", "required": ["k"]}, {"properties": {"k": {}}}]},
            "oneOf 0 and 1 may both",
        ),
        (
            {
                "oneOf": [
                    {"type": "object", "properties": {"k": {"const": 1}}},  # (k not required)
                    {"type": "object", "properties": {"k": {"const": 2}}},
                ]
            },
            "oneOf 0 and 1 may both",
        ),
        ({"properties": {"a": {"oneOf": [True, {"type": "null"}]}}}, "#/properties/a: oneOf"),
        # JSON has no NaN or infinities
        ({"const": math.nan}, "const nan: nan is not a JSON value"),
        ({"enum": [1, [math.inf]]}, "enum .* inf is not a JSON value"),
        (json.loads('{"type": "number", "enum": [-Infinity]}'), "enum .* -inf is not a JSON"),
    ],
)
def test_unenforceable_keywords_are_refused_by_name(schema, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=schema)


def test_typical_schemas_keep_small_dfas():
    """Sizes the module docstring's choices rest on (state counts, live states + dead)."""
    sizes = {
        "integer minimum 0": {"type": "integer", "minimum": 0},
        "int64": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        "number 0..1": {"type": "number", "minimum": 0, "maximum": 1},
        "tree": TREE,
    }
    got = {
        k: compile_dfa(StructuredOutputsParams(json=s).to_regex()).accept.size
        for k, s in sizes.items()
    }
    assert got["integer minimum 0"] <= 5 and got["number 0..1"] <= 10, got
    assert got["int64"] < 500 and got["tree"] < 400, got
