"""JSON schemas to regexes, for structured outputs (`pagedjax.guided`).

`schema_regex` writes the regex text (the subset `pagedjax.regex_dfa` compiles) of the
JSON texts a schema allows, with the regex `ws` between tokens; no schema (None) is
json_object: any JSON object. A string, integer or number schema's own keywords are
written by `pagedjax.json_scalars`.

Supported: type string (enum, const, pattern, minLength/maxLength, format date / time /
date-time / uuid / email / uri), integer and number (minimum, maximum, exclusiveMinimum,
exclusiveMaximum, also draft 4's boolean exclusive*; multipleOf 1 on integers), boolean,
null, array (items, prefixItems, minItems/maxItems, uniqueItems false), object
(properties, `required`, additionalProperties), enum and const (their values of the
type, if given), anyOf, oneOf (see below), allOf, nullable (OpenAPI: "or null", of all
its schema object says, a $ref or allOf in it too; wider than OpenAPI 3.0.3, where it
adds null to the type beside it alone, and enum [1] or a $ref without type refuses
null), type lists, local $ref ("#" and a JSON pointer after it, percent-decoded;
recursive ones unrolled `REF_DEPTH` deep) and {} (any value). allOf's schemas, and the
keywords beside anyOf / oneOf / allOf / $ref with each branch, are merged into one
schema: required lists and properties joined (a property in both: both its schemas
hold), the types in both, the stricter bound or length; null where each allows it
(nullable, or around a nullable, or null in its type or enum, or no keyword of a type;
with anyOf / oneOf: as its branches say); types with no value in common leave that null
alone, or are a ValueError where one refuses null. Annotations (title, description, default,
discriminator, ...) are ignored. Any other keyword, an unknown type or format, a pattern
with a format or lengths, a format with lengths that not all its strings fit, a
maxLength or maxItems below its minLength or minItems, a number's bound that is not a
whole number, multipleOf but 1 on integers, uniqueItems true, keywords but type beside
enum or const, a NaN or infinity in enum or const, a keyword to merge with two values
that differ as JSON's (true is not 1), additionalProperties to merge with another
schema's properties, a non-local $ref or one that is no JSON pointer (an anchor: #foo),
or a oneOf whose branches we cannot show apart is a ValueError naming it and where it is
(`JSON schema at #/properties/a: ...`).

What is generated: an object's properties in declared order, the optional ones possibly
left out, then the required keys it does not list, with additionalProperties' schema
(any value by default; false: a ValueError, as no object is valid), and no other keys
(without properties or required, any keys with additionalProperties' schema, or none
where it is false); values without a schema ({}, json_object) nest containers at
most `JSON_DEPTH` deep; strings hold JSON escapes, each one character (a surrogate's
\\u escape only in a pair, and none where minLength / maxLength count characters);
numbers without a bound have exponents of at most two digits (1e999 parses as inf; a
number of over 300 digits still would). A string `pattern` matches its characters (not
anchored: a match of the whole string, which the pattern's search finds too), read by
`pagedjax.regex_parse.parse(ecma=True)` so that ECMA-262 and Python's `re` both match
them; those a JSON string must escape are written as their escapes (`\\"`, `\\n`,
`\\u001f`, ...). A schema without type is read as the types its keywords are for
(properties: an object, minimum: a number, ...; none: any value). Bounds are exact (the
classic digit-range construction of `pagedjax.number_regex`; for a number, on its
integer part), and bounded integers and numbers are written without -0, bounded numbers
without exponent. prefixItems may stop early (as minItems allows); items false: nothing
after them. Formats (`pagedjax.string_regex`) are RFC 3339's dates and times (dates
that exist, years 0001 to 9999), RFC 4122's uuid, an email of a dot-atom @ host name
labels (letters, digits, inner hyphens; two at least), and RFC 3986's URI in its parts,
with "%" escapes (no IP literal hosts). A $ref met inside its own expansion `REF_DEPTH`
times (the root counts as "#") matches nothing, so a recursion ends where the schema
lets it (an empty array, an optional property left out, another anyOf branch; a schema
that lets it end nowhere matches nothing).

oneOf: a value valid for two branches is valid for neither reading of oneOf (but for
anyOf's), so oneOf is accepted only where no value we generate for one branch is valid
for another, as shown by `pagedjax.json_one_of`: their types differ (what a schema without
type generates is read as its keywords' types, what it allows as any), their const /
enum values do, or both are objects with a required property whose const / enum values
differ (a discriminated union). Else it is a ValueError: give anyOf.

Costs: compiling takes time about linear in the schema and its regex. A schema nested
more than `MAX_DEPTH` levels (items, a property, a branch, a $ref's target, ...; and a
const / enum value's containers) is a ValueError, as is one whose regex, or a part of it,
would exceed `MAX_REGEX_CHARS` characters (nested arrays double it per level), refused as
soon as a part does; a $ref is written once for each set of refs open around it (memoised),
and a $ref merged into an allOf once (allOf: [A, A] is A).

The regexes read the same in Python's `re` with `re.ASCII`.
"""

from __future__ import annotations

import collections
import json as jsonlib
import math
import urllib.parse

from pagedjax.json_one_of import TYPE_KEYWORDS as _TYPE_KEYWORDS
from pagedjax.json_one_of import OneOfMixin
from pagedjax.json_one_of import admits_null as _admits_null
from pagedjax.json_one_of import canon as _canon
from pagedjax.json_scalars import SCALARS as _SCALARS
from pagedjax.json_scalars import ScalarMixin
from pagedjax.number_regex import NOTHING
from pagedjax.regex_parse import escape

__all__ = [
    "DEFAULT_WHITESPACE",
    "JSON_DEPTH",
    "MAX_DEPTH",
    "MAX_REGEX_CHARS",
    "REF_DEPTH",
    "schema_regex",
]

MAX_REGEX_CHARS = 1_000_000  # regex text of a JSON schema
# The regex text built on the way (each schema's, and so each character once per schema
# around it): past this, a schema is refused before the copies add up to gigabytes.
_MAX_WORK = 32 * MAX_REGEX_CHARS
# Schemas nested in schemas (items, a property, an anyOf branch, a $ref's target, ...,
# and containers in a const or enum value): a few Python frames each, so that a deeper
# one would reach Python's recursion limit (1000) in the middle of a request.
MAX_DEPTH = 64
# Default whitespace between JSON tokens: one optional space. It adds one DFA state per
# separator (a bounded run like [ \n\t]{0,4} adds four) and keeps a model from spending
# its tokens on runs of whitespace; json.dumps's ", " / ": " style fits it.
DEFAULT_WHITESPACE = "[ ]?"
# Containers nested in json_object=True (the outer object counted) and in {} schemas.
JSON_DEPTH = 3
# A recursive $ref is expanded at most this many times inside itself (a tree node's
# children: nodes nested 3 deep); each level copies the schema's regex.
REF_DEPTH = 3

_JSON_TYPES = {  # a value's JSON types
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
# Keywords that do not change the language we generate.
_IGNORED = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "$defs", "definitions", "readOnly", "writeOnly", "deprecated", "discriminator",
}  # fmt: skip
_KEYWORDS = _IGNORED | {
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable", "uniqueItems",
}.union(*_TYPE_KEYWORDS.values())  # fmt: skip
# Merging schemas that must all hold: the larger of these, the smaller of those.
_MAX_OF = {"minimum", "exclusiveMinimum", "minLength", "minItems"}
_MIN_OF = {"maximum", "exclusiveMaximum", "maxLength", "maxItems"}


def _nesting(v) -> int:
    """How deep containers nest in the JSON value `v` (a scalar: 0), without recursion."""
    depth, level = 0, [v]
    while any(isinstance(x, (list, dict)) for x in level):
        depth += 1
        level = [y for x in level if isinstance(x, (list, dict)) for y in _children(x)]
    return depth


def _children(v: list | dict):
    return v.values() if isinstance(v, dict) else v


def _floats(v):
    """The floats in the JSON value `v`."""
    if isinstance(v, float):
        yield v
    elif isinstance(v, (list, dict)):
        for x in v.values() if isinstance(v, dict) else v:
            yield from _floats(x)


# ---------------------------------------------------------------------------- schemas


class _Disjoint(ValueError):
    """Two types merged (allOf) that no value has: null only, where all allow it."""


class _Schema(OneOfMixin, ScalarMixin):
    """JSON schema -> regex text; `ws` is the regex of the whitespace between tokens."""

    def __init__(self, root: dict, ws: str):
        self.root, self.ws, self.refs = root, ws, ["#"]  # (the root counts as "#")
        self.facts_calls = 0
        self.depth = self.deepest = 0  # schemas open around this one; the most yet
        self.work = 0  # characters of the regexes built so far (`_MAX_WORK`)
        self.memo: dict = {}  # (a $ref, the refs open around it) -> (regex, levels below)

    def error(self, path: str, msg: str, kind=ValueError) -> ValueError:
        return kind(f"JSON schema at {path}: {msg}")

    def too_deep(self, path: str) -> ValueError:
        return self.error(path, f"schema nests too deeply: more than {MAX_DEPTH} levels")

    def value(self, s, path: str) -> str:
        """The regex of the schema `s` at `path`, one level deeper than its caller's;
        a ValueError past `MAX_DEPTH` levels, `MAX_REGEX_CHARS` characters or `_MAX_WORK`,
        as soon as it is reached (nested arrays double the regex per level)."""
        if self.depth >= MAX_DEPTH:
            raise self.too_deep(path)
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)
        try:
            out = self.unchecked_value(s, path)
        finally:
            self.depth -= 1
        self.work += len(out)
        if len(out) > MAX_REGEX_CHARS:
            raise self.error(path, f"its regex exceeds {MAX_REGEX_CHARS} characters")
        if self.work > _MAX_WORK:
            raise self.error(
                path,
                f"the schema is too large: building its regex takes over {_MAX_WORK} "
                f"characters (its regex may have {MAX_REGEX_CHARS}); simplify it or lower "
                "its nesting",
            )
        return out

    def unchecked_value(self, s, path: str) -> str:
        if s is True or s == {}:
            return self.any_value(JSON_DEPTH)
        if not isinstance(s, dict):
            raise self.error(path, f"a schema must be an object, got {s!r:.80}")
        unknown = sorted(set(s) - _KEYWORDS)
        if unknown:
            raise self.error(path, f"keyword {unknown[0]!r} is not supported")
        for key in ("nullable", "uniqueItems"):
            if not isinstance(s.get(key, False), bool):
                raise self.error(path, f"{key} must be a bool, got {s[key]!r:.80}")
        if s.get("uniqueItems"):
            raise self.error(path, "uniqueItems true is not supported")
        if s.get("nullable"):
            rest = {k: v for k, v in s.items() if k != "nullable"}
            return f"(?:null|{self.value(rest, path)})"
        if "$ref" in s:
            rest = {k: v for k, v in s.items() if k != "$ref" and k not in _IGNORED}
            if rest:  # beside $ref: both hold
                return self.all_of(rest, [({"$ref": s["$ref"]}, path)], path)
            return self.ref(s["$ref"], path)
        if "const" in s or "enum" in s:
            return self.values(s, path)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in s:
                subs = s[key]
                if not isinstance(subs, list) or not subs:
                    raise self.error(path, f"{key} must be a non-empty list, got {subs!r:.80}")
                rest = {k: v for k, v in s.items() if k != key and k not in _IGNORED}
                paths = [f"{path}/{key}/{i}" for i in range(len(subs))]
                if key == "allOf":
                    return self.all_of(rest, list(zip(subs, paths, strict=True)), path)
                alts = [self.all_of(rest, [(x, at)], at) for x, at in zip(subs, paths, strict=True)]
                if key == "oneOf":
                    self.one_of(rest, subs, paths, path)
                return "(?:" + "|".join(alts) + ")"
        kind = s.get("type")
        if kind is None:
            kind = [k for k, keys in _TYPE_KEYWORDS.items() if keys & set(s)]
            if not kind:
                return self.any_value(JSON_DEPTH)
        if isinstance(kind, list) and kind:
            alts = [self.typed(dict(s, type=k), k, path) for k in kind]
            return "(?:" + "|".join(alts) + ")"
        return self.typed(s, kind, path)

    def values(self, s: dict, path: str) -> str:
        """const or enum: the values of the `type` (if any) among them."""
        key = "const" if "const" in s else "enum"
        values = [s["const"]] if key == "const" else s["enum"]
        if key == "enum" and (not isinstance(values, list) or not values):
            raise self.error(path, f"enum must be a non-empty list, got {values!r:.80}")
        other = sorted(set(s) - _IGNORED - {key, "type"})
        if other:
            raise self.error(path, f"{other[0]!r} beside {key} is not supported")
        if self.depth + _nesting(values) > MAX_DEPTH:  # (`literal` recurses)
            msg = f"{key} value nests too deeply: more than {MAX_DEPTH} levels (schemas counted)"
            raise self.error(path, msg)
        bad = next((x for x in _floats(values) if not math.isfinite(x)), None)
        if bad is not None:
            msg = f"{key} {s[key]!r:.80}: {bad!r} is not a JSON value (JSON has no NaN or inf)"
            raise self.error(path, msg)
        kinds = s.get("type", list(_JSON_TYPES))
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list):
            raise self.error(path, f"type {kinds!r:.80} is not supported")
        for kind in kinds:
            if not isinstance(kind, str) or kind not in _JSON_TYPES:
                raise self.error(path, f"type {kind!r:.80} is not supported")
        kinds = set(kinds)
        values = [v for v in values if any(_JSON_TYPES[k](v) for k in kinds)]
        if not values:
            raise self.error(path, f"no {key} value is of type {s['type']!r:.80}")
        return "(?:" + "|".join(self.literal(v) for v in values) + ")"

    def all_of(self, merged: dict, subs: list, path: str, finish=None) -> str:
        """The schema at `path`: `merged` and all of `subs`, pairs (schema, its path),
        merged into one ($refs resolved, allOfs flattened), as `finish(schema, path)`
        writes it (default `value`). The $refs merged stay open (`refs`) until it is
        written; one merged already, but not around this one, adds nothing (allOf: [A,
        A]: A once, where a DAG of such refs would take time exponential in its depth),
        but where it was merged only inside a nullable $ref / allOf (A's own null, or
        not, then holds). It is nullable where null is valid for each schema merged
        (`json_one_of.admits_null`) or a nullable $ref / allOf around it ((null or A)
        and B: null where B allows it); a $ref cut off (`REF_DEPTH`) inside a nullable
        one, or types no value has (string and integer) in schemas that all allow null,
        leave just that null."""
        todo = [(sub, at, frozenset(), False) for sub, at in reversed(subs)]  # (next: last)
        opened, pushed = {}, 0
        null_ok, cut = _admits_null(merged), False  # null valid for all; "or null" cut off
        disjoint = None  # the first two types merged that no value but null is
        try:
            while todo:
                # inside: the refs it comes from; nulled: inside a nullable $ref / allOf
                sub, at, inside, nulled = todo.pop()
                if sub is True:
                    continue
                if not isinstance(sub, dict):
                    raise self.error(at, f"a schema must be an object, got {sub!r:.80}")
                if "$ref" in sub or isinstance(sub.get("allOf"), list):
                    if not isinstance(sub.get("nullable", False), bool):
                        raise self.error(
                            at, f"nullable must be a bool, got {sub['nullable']!r:.80}"
                        )
                    nulled = nulled or sub.get("nullable", False)  # (null or all of it)
                if "$ref" in sub:
                    ref = sub["$ref"]
                    node = self.pointer(ref, at)
                    rest = {k: v for k, v in sub.items() if k != "$ref"}
                    todo.append((rest, at, inside, nulled))
                    seen = opened.get(ref)  # merged here: True where only in "or null"s
                    if seen is not None and ref not in inside:
                        if seen is False or nulled:
                            continue
                        opened[ref] = False  # again, out of the "or null": its own null
                        todo.append((node, ref, inside | {ref}, nulled))
                        continue
                    if self.refs.count(ref) >= REF_DEPTH:
                        if not nulled:
                            return NOTHING
                        cut = True  # (null or nothing): null, where all the rest allow it
                        continue
                    self.refs.append(ref)
                    opened[ref] = opened.get(ref, True) and nulled
                    pushed += 1
                    todo.append((node, ref, inside | {ref}, nulled))
                elif isinstance(sub.get("allOf"), list):
                    rest = {k: v for k, v in sub.items() if k != "allOf"}
                    todo.append((rest, at, inside, nulled))
                    subs = enumerate(sub["allOf"])
                    todo += reversed([(x, f"{at}/allOf/{j}", inside, nulled) for j, x in subs])
                else:
                    null_ok = null_ok and (nulled or _admits_null(sub))
                    try:
                        merged = self.merge(merged, sub, at)
                    except _Disjoint as e:  # (no value but null, where all allow it)
                        disjoint = disjoint or e
            if disjoint and not null_ok:
                raise disjoint
            if cut or disjoint:
                if not null_ok:
                    return NOTHING
                merged = {"type": "null"}
            elif null_ok and not merged.get("nullable"):
                merged = {**merged, "nullable": True}
            return (finish or self.value)(merged, path)
        finally:
            del self.refs[len(self.refs) - pushed :]

    def merge(self, a: dict, b: dict, path: str) -> dict:
        """One schema for both `a` and `b` (annotations left out), or a ValueError naming
        a keyword with different values in each that does not merge. Values are equal
        as JSON's (`json_one_of.canon`: 1 and 1.0 are, true and 1, equal in Python, not)."""
        out = {k: v for k, v in a.items() if k not in _IGNORED}
        if not out or not b:  # {} holds for any value
            return {k: v for k, v in (b if not out else a).items() if k not in _IGNORED}
        for k, v in b.items():
            if k in _IGNORED or k == "nullable":
                continue
            w = out.setdefault(k, v)
            if w is v or _canon(w) == _canon(v):
                continue
            if k == "required" and isinstance(w, list) and isinstance(v, list):
                out[k] = list(dict.fromkeys(w + v))
            elif k == "properties" and isinstance(w, dict) and isinstance(v, dict):
                out[k] = {
                    **w,
                    **{
                        p: x if p not in w or _canon(w[p]) == _canon(x) else {"allOf": [w[p], x]}
                        for p, x in v.items()
                    },
                }
            elif k == "type" and isinstance(w, (str, list)) and isinstance(v, (str, list)):
                ws, vs = ([t] if isinstance(t, str) else t for t in (w, v))
                both = [t for t in ws if t in vs or (t == "integer" and "number" in vs)]
                both += ["integer"] if "number" in ws and "integer" in vs else []
                if not both:
                    msg = f"type {v!r} and type {w!r}: no value is both"
                    raise self.error(path, msg, _Disjoint)
                out[k] = both
            elif k in _MAX_OF | _MIN_OF and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in (v, w)
            ):
                out[k] = max(v, w) if k in _MAX_OF else min(v, w)
            else:
                raise self.error(
                    path,
                    f"{k!r} with two values to merge ({w!r:.40} and {v!r:.40}) is not supported",
                )
        if a.get("nullable") and b.get("nullable"):  # (null or A) and (null or B)
            out["nullable"] = True
        else:
            out.pop("nullable", None)
        for x, y in ((a, b), (b, a)):  # additionalProperties applies to the others' keys
            if x.get("additionalProperties", True) is not True:
                props, req = y.get("properties"), y.get("required")
                keys = [*(props if isinstance(props, dict) else []), *(req or [])]
                other = [k for k in keys if k not in (x.get("properties") or {})]
                if other:
                    raise self.error(
                        path,
                        f"additionalProperties merged with property {other[0]!r} of another "
                        "schema is not supported",
                    )
        return out

    def typed(self, s: dict, kind, path: str) -> str:
        if kind == "object":
            return self.object(s, path)
        if kind == "array":
            return self.array(s, path)
        if kind == "string":
            return self.string(s, path)
        if kind in ("integer", "number"):
            return self.numeric(s, kind, path)
        if isinstance(kind, str) and kind in _SCALARS:
            return _SCALARS[kind]
        raise self.error(path, f"type {kind!r} is not supported")

    def ref(self, ref, path: str) -> str:
        """The regex of the schema `ref` points to; nothing where `ref` is `REF_DEPTH` deep
        in its own expansion. Memoised on the refs open around it, on which alone its
        regex depends (a ref used many times is written once)."""
        node = self.pointer(ref, path)
        if self.refs.count(ref) >= REF_DEPTH:
            return NOTHING
        key = (ref, frozenset(collections.Counter(self.refs).items()))
        if key in self.memo:
            out, below = self.memo[key]
            if self.depth + below > MAX_DEPTH:
                raise self.too_deep(path)
            self.deepest = max(self.deepest, self.depth + below)
            return out
        self.refs.append(ref)
        deepest, self.deepest = self.deepest, self.depth
        try:
            out = self.value(node, ref)
        finally:
            self.refs.pop()
            below, self.deepest = self.deepest - self.depth, max(deepest, self.deepest)
        self.memo[key] = out, below
        return out

    def pointer(self, ref, path: str):
        """The schema the local $ref `ref` (at `path`) points to: "#" and a JSON pointer
        after it (RFC 6901: percent-decoded, then ~1 and ~0 unescaped). Another fragment
        (an anchor "#foo", "#defs/A") is a ValueError, not the root."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.error(path, f"$ref {ref!r:.80} is not supported (only local refs)")
        if ref != "#" and not ref.startswith("#/"):
            raise self.error(
                path,
                f"$ref {ref!r:.80} is not supported: only a JSON pointer (#/$defs/...) after "
                "the # (not an anchor)",
            )
        node = self.root
        for part in urllib.parse.unquote(ref[1:]).split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise self.error(path, f"$ref {ref!r} points to nothing")
        return node

    def literal(self, v) -> str:
        """A regex matching the JSON text of the value `v` (with whitespace between tokens)."""
        if isinstance(v, dict):
            items = [self.literal(str(k)) + self.colon + self.literal(x) for k, x in v.items()]
            return r"\{" + self.ws + self.comma.join(items) + self.ws + r"\}"
        if isinstance(v, list):
            return r"\[" + self.ws + self.comma.join(map(self.literal, v)) + self.ws + r"\]"
        return escape(jsonlib.dumps(v, ensure_ascii=False))

    @property
    def comma(self) -> str:
        return self.ws + "," + self.ws

    @property
    def colon(self) -> str:
        return self.ws + ":" + self.ws

    def array(self, s: dict, path: str) -> str:
        lo, hi = self.count(s, "minItems", 0, path), self.count(s, "maxItems", None, path)
        prefix, rest = s.get("prefixItems", []), s.get("items", {})
        if not isinstance(prefix, list):
            raise self.error(path, f"prefixItems must be a list of schemas, got {prefix!r:.80}")
        if rest is False:  # no items after prefixItems
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and hi < lo:
            more = f" (items false after {len(prefix)} prefixItems)" if rest is False else ""
            raise self.error(path, f"maxItems={hi} < minItems={lo}{more}")
        firsts = [
            self.value(x, f"{path}/prefixItems/{i}") for i, x in enumerate(prefix[:hi])
        ]  # (prefix[:None] is all of them)
        n = len(firsts)
        if hi is not None and hi <= n:
            body = ""
        else:
            item = self.value(rest, f"{path}/items")
            if not n:
                return r"\[" + self.ws + self.repeat(item, lo, hi) + self.ws + r"\]"
            body = f"(?:{self.comma}{item}){{{max(lo - n, 0)},{'' if hi is None else hi - n}}}"
        for j in reversed(range(n)):  # the j-th, then the rest; optional if j >= minItems
            body = f"(?:{self.comma if j else ''}{firsts[j]}{body}){'?' if j >= lo else ''}"
        return r"\[" + self.ws + body + self.ws + r"\]"

    def repeat(self, item: str, lo: int, hi: int | None) -> str:
        """`lo` to `hi` items separated by commas."""
        if hi == 0:
            return ""
        more = f"(?:{self.comma}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        return f"{item}{more}" if lo else f"(?:{item}{more})?"

    def object(self, s: dict, path: str) -> str:
        props, extra = s.get("properties"), s.get("additionalProperties", True)
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise self.error(path, f"required must be a list of str, got {required!r:.80}")
        if not isinstance(extra, (bool, dict)):
            msg = f"additionalProperties must be a bool or a schema, got {extra!r:.80}"
            raise self.error(path, msg)
        if props is None:  # only the required keys, with additionalProperties' values
            if required or extra is False:
                props = {}
            elif extra is True or extra == {}:
                return self.any_object(JSON_DEPTH)
            else:
                value = self.value(extra, f"{path}/additionalProperties")
                return self.any_object(JSON_DEPTH, value)
        if not isinstance(props, dict):
            raise self.error(path, f"properties must be an object, got {props!r:.80}")
        # A required key properties does not list: valid with additionalProperties' value.
        missing = [k for k in dict.fromkeys(required) if k not in props]
        if missing and extra is False:
            raise self.error(
                path,
                f"required property {missing[0]!r} is not in properties, and "
                "additionalProperties false allows no other: no object is valid",
            )
        at = {k: f"{path}/properties/{k}" for k in props}
        props = {**props, **dict.fromkeys(missing, extra)}
        items = [
            self.literal(k) + self.colon + self.value(v, at.get(k, f"{path}/additionalProperties"))
            for k, v in props.items()
        ]
        required = set(required)  # (a list: quadratic in the properties)
        req = [k in required for k in props]
        # Linear in the properties (one alternative per choice of the first property
        # given would grow the DFA quadratically). With a required one at r: the ones
        # before r are each "item ," or nothing, then ", item" after it.
        if any(req):
            r = req.index(True)
            body = "".join(f"(?:{items[j]}{self.comma})?" for j in range(r)) + items[r]
            body += "".join(
                f"(?:{self.comma}{items[j]}){'' if req[j] else '?'}"
                for j in range(r + 1, len(items))
            )
        elif items:  # Z_j = item_j | (item_j ,)? Z_j+1: a non-empty run from j on
            body = items[-1]
            for item in reversed(items[:-1]):
                body = f"(?:{item}|(?:{item}{self.comma})?{body})"
                if len(body) > MAX_REGEX_CHARS:  # (each step copies it: stop early)
                    raise self.error(path, f"its regex exceeds {MAX_REGEX_CHARS} characters")
            body = f"(?:{body})?"
        else:
            body = ""
        return r"\{" + self.ws + body + self.ws + r"\}"

    def any_value(self, depth: int) -> str:
        alts = list(_SCALARS.values())
        if depth > 0:
            alts += [self.any_object(depth), self.any_array(depth)]
        return "(?:" + "|".join(alts) + ")"

    def any_object(self, depth: int, value: str | None = None) -> str:
        """Objects of any keys, their values `value` (None: any, `depth - 1` deep)."""
        value = self.any_value(depth - 1) if value is None else value
        member = _SCALARS["string"] + self.colon + value
        return r"\{" + self.ws + self.repeat(member, 0, None) + self.ws + r"\}"

    def any_array(self, depth: int) -> str:
        return r"\[" + self.ws + self.repeat(self.any_value(depth - 1), 0, None) + self.ws + r"\]"


def schema_regex(schema: dict | None, ws: str) -> str:
    """The regex text of the JSON texts `schema` allows (None: any object), `ws` the
    regex of the whitespace between tokens.

    Raises:
      ValueError: an unsupported or malformed schema, named with its path; one whose
        regex would exceed `MAX_REGEX_CHARS` (refused as soon as a part of it does, or
        the parts built add up to `_MAX_WORK`); one nested more than `MAX_DEPTH` deep.
    """
    s = _Schema(schema, ws)
    return s.any_object(JSON_DEPTH) if schema is None else s.value(schema, "#")
