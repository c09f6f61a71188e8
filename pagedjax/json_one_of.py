"""JSON schemas' oneOf (`pagedjax.json_schema`): accepted where no value matches two branches.

`OneOfMixin.one_of` refuses a oneOf unless no value `json_schema` generates for one
branch is valid for another (the rule and why: `json_schema`'s docstring). To show two
branches apart it reads, without writing a regex, what it can know of the values valid
for a schema (`facts_of`): their kinds, a finite set holding them all, the keys every
valid object has, the schemas a key's value meets; and the kinds of the values
`json_schema` generates for it (`_generated_kinds`). `admits_null` is whether null is
valid for one of the schemas `json_schema` merges (allOf, and beside $ref / anyOf / oneOf).

`OneOfMixin` is a base of `json_schema._Schema` (it calls the schema's `all_of`,
`pointer` and `error`), apart from it because it reasons about the values schemas allow,
where `json_schema` writes regexes. `TYPE_KEYWORDS` (the keywords of each type), by which
both read a schema without type, is here, where `json_schema` imports it from.
"""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["BOUNDS", "TYPE_KEYWORDS", "OneOfMixin", "admits_null", "canon"]

BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
# Keywords of one type: a schema without type is read as the types of those it has.
TYPE_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {*BOUNDS, "multipleOf"},
}

# Keywords of a schema without type that make null invalid (`admits_null`).
_NOT_NULL = frozenset({"anyOf", "oneOf"}).union(*TYPE_KEYWORDS.values())
_KINDS = frozenset(("string", "number", "boolean", "null", "array", "object"))
_FACTS_CALLS = 10_000  # the work `OneOfMixin.one_of` may do for one oneOf
_MAX_PAIRS = 1_000_000  # branches of a oneOf compared pairwise (about 1 s)
_FACTS_DEPTH = 64  # schemas nested in one (allOf, anyOf, $ref): Python's frames are few


def _as_list(x) -> list:
    return x if isinstance(x, list) else [] if x is None else [x]


def _kind(v) -> str:
    """The JSON type of the value `v` (a number's "number")."""
    kinds = {bool: "boolean", type(None): "null", list: "array", dict: "object", str: "string"}
    return kinds.get(type(v), "number")


def canon(v):
    """A hashable key of JSON value `v`, equal for equal values (1 and 1.0, not true)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return (type(v).__name__, v)
    if isinstance(v, (int, float)):
        return ("number", Fraction(v) if math.isfinite(v) else v)
    if isinstance(v, list):
        return ("array", tuple(map(canon, v)))
    if isinstance(v, dict):
        return ("object", frozenset((k, canon(x)) for k, x in v.items()))
    return ("other", repr(v))


def _all_apart(sets: list) -> bool:
    """Whether `sets` are all finite (not None) and no value is in two of them."""
    if any(x is None for x in sets):
        return False
    return sum(map(len, sets)) == len(frozenset().union(*sets))


def _generated_kinds(s, valid: frozenset) -> frozenset:
    """The kinds of the values `json_schema` generates for a merged schema `s` (at
    most `valid`, the kinds of the values valid for it)."""
    if s is True or s == {}:
        return _KINDS
    if not isinstance(s, dict):
        return frozenset()  # (NOTHING: a recursion cut off)
    if s.get("nullable"):
        return _generated_kinds(dict(s, nullable=False), valid) | {"null"}
    if {"type", "const", "enum", "$ref", "anyOf", "oneOf", "allOf"} & set(s):
        return valid
    return frozenset(k for k, keys in TYPE_KEYWORDS.items() if keys & set(s)) or _KINDS


def admits_null(s: dict) -> bool:
    """Whether null is valid for the schema `s` (no $ref or allOf in it; a nullable
    around it not counted) as `json_schema` writes it: nullable, "null" among its
    types, null among its enum / const values (and its types), or no keyword of a type
    (any value). With anyOf or oneOf: False (where a branch allows null, it writes it)."""
    if s.get("nullable") is True:
        return True
    kind = s.get("type")
    if kind is not None and not (kind == "null" or (isinstance(kind, list) and "null" in kind)):
        return False
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        return isinstance(values, list) and any(v is None for v in values)
    return kind is not None or not _NOT_NULL & set(s)


class OneOfMixin:
    """`json_schema._Schema`'s oneOf check (`one_of`) and the facts of a schema it
    reads (`facts_of`); it calls the schema's `all_of`, `pointer` and `error`."""

    def one_of(self, rest: dict, subs: list, paths: list, path: str) -> None:
        """ValueError unless no value we generate for one branch of oneOf (`subs`, each
        with the keywords `rest` beside it) is valid for another: read as anyOf, oneOf
        would let it through, and it is valid for neither reading. Shown apart: branches
        of different types, of different const / enum values, or objects with a required
        property of different const / enum values in each (a discriminated union)."""
        facts = []
        for x, at in zip(subs, paths, strict=True):
            val, values, required, props = self.facts_of({"allOf": [rest, x]})
            merged = self.all_of(rest, [(x, at)], at, finish=lambda m, _: m)
            facts.append((val & _generated_kinds(merged, val), val, values, required, props))

        def apart(a, b) -> bool:  # two finite sets of values, no value in both
            return a is not None and b is not None and not a & b

        prop_values = {}  # (branch, key) -> the values of its property key

        def values_of(i: int, k: str):
            if (i, k) not in prop_values:
                prop_values[i, k] = self.facts_of({"allOf": facts[i][4].get(k, [])})[1]
            return prop_values[i, k]

        # The pairs, below, are quadratic in the branches: first, in linear time, the
        # usual large oneOfs (of const / enum values, or discriminated by one property).
        if _all_apart([f[2] for f in facts]):
            return
        if all(f[0] <= {"object"} for f in facts):  # (so are the kinds of "both")
            for k in sorted(set.intersection(*(f[3] for f in facts))):
                if _all_apart([values_of(i, k) for i in range(len(facts))]):
                    return
        n = len(facts)
        if n * (n - 1) // 2 > _MAX_PAIRS:
            raise self.error(
                path,
                f"oneOf of {n} branches is too large to check pairwise (at most "
                f"{_MAX_PAIRS} pairs, unless all are const / enum values, or objects told "
                "apart by one required property); give anyOf",
            )
        for j, (gen_j, val_j, values_j, required_j, _) in enumerate(facts):
            for i, (gen_i, val_i, values_i, required_i, _) in enumerate(facts[:j]):
                both = (gen_i & val_j) | (gen_j & val_i)  # kinds one makes and both allow
                if not both or apart(values_i, values_j):
                    continue
                if both <= {"object"} and any(
                    apart(values_of(i, k), values_of(j, k)) for k in required_i | required_j
                ):
                    continue
                raise self.error(
                    path,
                    f"oneOf {i} and {j} may both match one value, which oneOf refuses (and "
                    "anyOf allows): oneOf is supported where its branches are of different "
                    "types, different const / enum values, or objects told apart by a "
                    "required property of different const / enum values; else give anyOf",
                )

    def facts_of(self, s):
        """What `one_of` knows of the values valid for schema `s`: their kinds (JSON
        types; integer is number), a finite set holding them all (`canon`; None: none
        known), the keys every valid object has, {key: the schemas its value meets}."""
        self.facts_calls, self.facts_depth, self.facts_refs = 0, 0, []
        return self.facts(s)

    def facts(self, s):
        """`facts_of`'s recursion; past `_FACTS_CALLS` calls (a DAG of $refs) or
        `_FACTS_DEPTH` levels, and of a $ref inside its own expansion, nothing more is
        known."""
        self.facts_calls += 1
        if s is False:
            return frozenset(), frozenset(), set(), {}
        if (
            not isinstance(s, dict)
            or self.facts_calls > _FACTS_CALLS
            or self.facts_depth >= _FACTS_DEPTH
        ):
            return _KINDS, None, set(), {}
        self.facts_depth += 1
        try:
            return self.unchecked_facts(s)
        finally:
            self.facts_depth -= 1

    def unchecked_facts(self, s):
        if s.get("nullable"):
            kinds, values, _, props = self.facts(dict(s, nullable=False))
            values = None if values is None else values | {canon(None)}
            return kinds | {"null"}, values, set(), props
        kinds, values = _KINDS, None
        if "type" in s:
            named = [t for t in _as_list(s["type"]) if isinstance(t, str)]
            kinds = frozenset("number" if t == "integer" else t for t in named)
        if "const" in s or "enum" in s:
            listed = [s["const"]] if "const" in s else _as_list(s["enum"])
            values = frozenset(map(canon, listed))
            kinds &= frozenset(_kind(v) for v in listed)
        required = {k for k in _as_list(s.get("required")) if isinstance(k, str)}
        props = s.get("properties")
        props = {k: [v] for k, v in props.items()} if isinstance(props, dict) else {}
        parts = [*_as_list(s.get("allOf"))]
        ref = s.get("$ref")
        if ref is not None and ref not in self.facts_refs:  # (the refs being expanded)
            self.facts_refs.append(ref)
            try:
                parts.append(self.facts(self.pointer(ref, "#")))
            finally:
                self.facts_refs.pop()
        for key in ("anyOf", "oneOf"):  # one of them holds
            branches = [self.facts(x) for x in _as_list(s.get(key))]
            if branches:
                sets = [b[1] for b in branches]
                either = None if None in sets else frozenset().union(*sets)
                parts.append((frozenset().union(*(b[0] for b in branches)), either, set(), {}))
        for part in parts:  # all of them hold
            more_kinds, more_values, more_required, more_props = (
                part if isinstance(part, tuple) else self.facts(part)
            )
            kinds &= more_kinds
            if more_values is not None:
                values = more_values if values is None else values & more_values
            required |= more_required
            for k, v in more_props.items():
                props[k] = props.get(k, []) + v
        return kinds, values, required, props
