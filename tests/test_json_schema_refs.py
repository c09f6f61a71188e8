"""JSON schemas' $ref (pagedjax/json_schema.py): a ref is a JSON pointer (RFC 6901) in a
URI fragment; one that is no pointer (an anchor, "#definitions/A") is refused, not read
as the root."""

import pytest
from test_regex_dfa import dfa_match

from pagedjax.guided import StructuredOutputsParams
from pagedjax.regex_dfa import compile_dfa


@pytest.mark.parametrize("ref", ["#foo", "#definitions/A", "#A"])
def test_a_fragment_that_is_no_pointer_is_refused(ref):
    """`#foo` names an anchor ($anchor, or draft 7's `"$id": "#foo"`), and `#definitions/A`
    misses its first slash: neither points to the root, which they were read as (an
    object of x: {x: ...} generated where x must be an integer)."""
    schema = {
        "definitions": {"A": {"$id": "#foo", "type": "integer"}},
        "type": "object",
        "properties": {"x": {"$ref": ref}},
    }
    with pytest.raises(ValueError, match="is not supported.*JSON pointer"):
        StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match="JSON pointer"):  # (in an allOf, and in a oneOf)
        StructuredOutputsParams(json={"allOf": [{"$ref": ref}], "definitions": {}})
    with pytest.raises(ValueError, match="JSON pointer"):
        StructuredOutputsParams(json={"oneOf": [{"$ref": ref}, {"type": "null"}]})


def test_pointers_are_percent_decoded():
    """A pointer in a URI fragment is percent-encoded (RFC 6901 section 6), as generators
    write names like Map<string,int>; ~0 and ~1 are unescaped after."""
    schema = {
        "$defs": {"Map<a b>": {"type": "integer"}, "x/y~": {"type": "boolean"}},
        "type": "array",
        "prefixItems": [{"$ref": "#/%24defs/Map%3Ca%20b%3E"}, {"$ref": "#/$defs/x~1y~0"}],
        "items": False,
        "minItems": 2,
    }
    dfa = compile_dfa(StructuredOutputsParams(json=schema).to_regex())
    assert dfa_match(dfa, b"[1, true]") and not dfa_match(dfa, b"[true, 1]")


def test_the_root_and_pointers_still_resolve():
    tree = {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
    }
    dfa = compile_dfa(StructuredOutputsParams(json=tree).to_regex())
    assert dfa_match(dfa, b'{"kids": [{"kids": []}]}') and not dfa_match(dfa, b'{"kids": [1]}')


REQUIRED_CASES = [  # (schema, texts it allows, texts it does not)
    (  # a required key not in properties: any value (additionalProperties' default)
        {"properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
        ['{"a": 1, "b": "x"}', '{"a": 1, "b": [null]}'],
        ['{"a": 1}', '{"b": 1}', '{"b": 1, "a": 1}', '{"a": 1, "b": 1, "c": 1}'],
    ),
    (  # ... of additionalProperties' schema
        {
            "properties": {"a": {"type": "integer"}},
            "required": ["b"],
            "additionalProperties": {"type": "boolean"},
        },
        ['{"b": true}', '{"a": 1, "b": false}'],
        ['{"b": 1}', '{"a": 1}'],
    ),
    (  # a required key from another schema of an allOf
        {"allOf": [{"properties": {"a": {"type": "null"}}}, {"required": ["b"]}]},
        ['{"b": 2}', '{"a": null, "b": {}}'],
        ['{"a": null}', "{}"],
    ),
]


@pytest.mark.parametrize("case", range(len(REQUIRED_CASES)))
def test_required_keys_outside_properties_are_generated(case):
    """A required key that properties does not list is valid with additionalProperties'
    schema as its value (any value by default): it was refused."""
    schema, good, bad = REQUIRED_CASES[case]
    dfa = compile_dfa(StructuredOutputsParams(json=schema).to_regex())
    for text in good:
        assert dfa_match(dfa, text.encode()), text
    for text in bad:
        assert not dfa_match(dfa, text.encode()), text


def test_required_keys_that_additional_properties_forbids_are_refused():
    schema = {"properties": {"a": {}}, "required": ["b"], "additionalProperties": False}
    with pytest.raises(
        ValueError,
        match="'b' is not in properties, and additionalProperties false",
    ):
        StructuredOutputsParams(json=schema)
