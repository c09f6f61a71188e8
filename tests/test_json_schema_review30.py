"""OpenAPI's `nullable: true` beside `$ref` or `allOf` (pagedjax/json_schema.py): "or
null" of the whole schema object wherever it is, as at the top level and in a property.

OpenAPI 3.0 generators write an optional reference as `{"allOf": [{"$ref": ...}],
"nullable": true}` or `{"$ref": ..., "nullable": true}`. At the top level, in properties
and items, null was accepted; in an anyOf / oneOf branch, an allOf member or the target
of a $ref merged into one, the nullable was merged away (its keywords beside $ref merged
with the $ref's schema, which is not nullable), so a valid null was refused. Each case
lists texts accepted and refused, matched by the guide's DFA and Python's `re`."""

import pytest
from test_json_schema_keywords import check_cases

from pagedjax.guided import StructuredOutputsParams

X = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
DEFS = {"X": X, "Y": {"allOf": [{"$ref": "#/$defs/X"}], "nullable": True}}
REF = {"$ref": "#/$defs/X"}
NULL_REF = {"$ref": "#/$defs/X", "nullable": True}
NULL_ALL_OF = {"allOf": [REF], "nullable": True}  # (Pydantic v1 / OpenAPI 3.0 style)
OBJ = '{"a": 1}'
NOT_X = ['{"a": "x"}', "{}", '"s"', "1", "[]"]


def schema(s: dict) -> dict:
    return {**s, "$defs": DEFS}


def prop(p: dict, required: bool = True) -> dict:
    return {"type": "object", "properties": {"p": p}, "required": ["p"] if required else []}


CASES = [
    # where null was already accepted (kept so)
    (schema(NULL_REF), ["null", OBJ], NOT_X),
    (schema(NULL_ALL_OF), ["null", OBJ], NOT_X),
    (schema(prop(NULL_REF)), ['{"p": null}', '{"p": {"a": 1}}'], ['{"p": 1}', "null"]),
    (schema(prop(NULL_ALL_OF)), ['{"p": null}', '{"p": {"a": 1}}'], ['{"p": "s"}', "{}"]),
    (schema({"type": "array", "items": NULL_REF}), ["[null]", '[null, {"a": 1}]'], ["[1]"]),
    # an anyOf / oneOf branch (null was refused)
    (schema({"anyOf": [NULL_REF, {"type": "string"}]}), ["null", OBJ, '"s"'], NOT_X[:2]),
    (schema({"anyOf": [NULL_ALL_OF, {"type": "string"}]}), ["null", OBJ, '"s"'], ["1", "{}"]),
    (schema({"oneOf": [NULL_REF, {"type": "string"}]}), ["null", OBJ, '"s"'], ["1", "[]"]),
    (schema({"oneOf": [NULL_ALL_OF, {"type": "integer"}]}), ["null", OBJ, "1"], ['"s"']),
    (  # keywords beside the anyOf hold in the branch (annotations: none)
        schema({"anyOf": [NULL_REF], "title": "t", "description": "d"}),
        ["null", OBJ],
        ["{}", '"s"'],
    ),
    (  # (required without type is read as an object's, as json_schema's docstring says)
        schema({"anyOf": [NULL_REF], "required": ["a"]}),
        [OBJ],
        ["null", "{}"],
    ),
    (  # a $ref to a nullable allOf (OpenAPI's components), in a branch
        schema({"anyOf": [{"$ref": "#/$defs/Y"}, {"type": "string"}]}),
        ["null", OBJ, '"s"'],
        NOT_X[:2],
    ),
    (  # ... and in a property's anyOf
        schema(prop({"anyOf": [{"$ref": "#/$defs/Y"}]})),
        ['{"p": null}', '{"p": {"a": 1}}'],
        ['{"p": 1}'],
    ),
    # allOf members: null where every member allows it
    (schema({"allOf": [NULL_REF]}), ["null", OBJ], NOT_X),
    (schema({"allOf": [NULL_REF, {"type": "object", "nullable": True}]}), ["null", OBJ], NOT_X),
    (schema({"allOf": [NULL_REF, {"type": ["object", "null"]}]}), ["null", OBJ], NOT_X),
    (schema({"allOf": [NULL_REF, {"description": "d"}]}), ["null", OBJ], NOT_X),
    (schema({"allOf": [NULL_ALL_OF, {"required": ["a"]}]}), [OBJ], ["null", "{}"]),
    (schema({"allOf": [NULL_REF, {"type": "object"}]}), [OBJ], ["null"]),
    (schema({"allOf": [NULL_REF, REF]}), [OBJ], ["null"]),  # (X merged twice)
    (schema({"allOf": [REF, NULL_REF]}), [OBJ], ["null"]),
    (schema({"allOf": [{"$ref": "#/$defs/Y"}, {"allOf": [REF]}]}), [OBJ], ["null"]),
    (schema({"allOf": [NULL_REF, NULL_ALL_OF]}), ["null", OBJ], NOT_X),
    (schema({"allOf": [{"allOf": [NULL_REF]}, {"$ref": "#/$defs/Y"}]}), ["null", OBJ], NOT_X),
    # nullable and type lists with "null": null where both allow it (was refused)
    (
        {"allOf": [{"type": "string", "nullable": True}, {"type": ["string", "null"]}]},
        ["null", '"s"'],
        ["1"],
    ),  # fmt: skip
    (
        {"allOf": [{"type": ["string", "null"]}, {"type": ["string", "null"], "maxLength": 1}]},
        ["null", '"s"'],
        ['"ss"'],
    ),  # fmt: skip
    ({"allOf": [{"type": ["string", "null"]}, {"type": "string"}]}, ['"s"'], ["null"]),
    # nullable false: no change; enum / const beside nullable (null added, as before)
    (schema({"anyOf": [{"$ref": "#/$defs/X", "nullable": False}]}), [OBJ], ["null"]),
    (
        {"allOf": [{"type": "string", "nullable": False}, {"type": ["string", "null"]}]},
        ['"s"'],
        ["null"],
    ),  # fmt: skip
    ({"anyOf": [{"enum": ["a", "b"], "nullable": True}]}, ['"a"', "null"], ['"c"']),
    ({"anyOf": [{"const": "a", "nullable": True}]}, ['"a"', "null"], ['"c"']),
    (
        {"allOf": [{"enum": ["a", None]}, {"type": "string", "nullable": True}]},
        ['"a"', "null"],
        ['"b"'],
    ),  # fmt: skip
    ({"allOf": [{"enum": ["a"]}, {"type": "string", "nullable": True}]}, ['"a"'], ["null"]),
]


@pytest.mark.parametrize("s, good, bad", CASES)
def test_nullable_beside_ref_or_all_of(s, good, bad):
    check_cases(s, good, bad)


def test_nullable_ref_in_a_recursion_ends_in_null():
    """A recursive $ref cut off (`REF_DEPTH`) in a nullable branch leaves its null: the
    innermost node's `next` can still be null, so a list of any length up to the depth
    is valid (before: the branch matched nothing at the cut, nor did any list)."""
    node = {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#", "nullable": True}]}},
        "required": ["next"],
    }
    check_cases(
        node,
        ['{"next": null}', '{"next": {"next": null}}', '{"next": {"next": {"next": null}}}'],
        ["{}", "null", '{"next": 1}'],
    )


def test_non_bool_nullable_beside_ref_in_a_branch_is_refused():
    """A nullable that is not a bool, beside $ref in a branch, is a ValueError naming it,
    as elsewhere (before: silently dropped)."""
    s = schema({"anyOf": [{"$ref": "#/$defs/X", "nullable": "yes"}]})
    with pytest.raises(ValueError, match="nullable must be a bool, got 'yes'"):
        StructuredOutputsParams(json=s)


def test_one_of_with_two_nullable_branches_is_refused():
    """null is valid for both branches, so it is valid for neither reading of oneOf: it
    is generated for neither, and a oneOf that would generate it is refused."""
    s = schema({"oneOf": [NULL_REF, {"type": "string", "nullable": True}]})
    with pytest.raises(ValueError, match="oneOf 0 and 1 may both match one value"):
        StructuredOutputsParams(json=s)


@pytest.mark.parametrize(
    "s, good, bad",
    [
        (  # (null or string) and (null or integer): null only
            {
                "allOf": [
                    {"type": "string", "nullable": True},
                    {"type": "integer", "nullable": True},
                ]
            },
            ["null"],
            ['"s"', "1", "{}"],
        ),
        (  # the same with null in a type list, in a property
            prop({"allOf": [{"type": ["string", "null"]}, {"type": "integer", "nullable": True}]}),
            ['{"p": null}'],
            ['{"p": 1}', '{"p": "s"}'],
        ),
        (  # a nullable $ref (an object) and a nullable string
            schema({"allOf": [NULL_REF, {"type": "string", "nullable": True}]}),
            ["null"],
            [OBJ, '"s"'],
        ),
    ],
)
def test_disjoint_types_that_all_allow_null_leave_null(s, good, bad):
    """allOf of types no value has but where each allows null: null (before: refused
    with "no value is both")."""
    check_cases(s, good, bad)


def test_disjoint_types_without_null_are_refused():
    """... and where one does not allow null, still refused, naming the two types."""
    s = {"allOf": [{"type": "string", "nullable": True}, {"type": "integer"}]}
    with pytest.raises(ValueError, match="type 'integer' and type 'string': no value is both"):
        StructuredOutputsParams(json=s)
