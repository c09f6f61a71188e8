"""JSON schemas to regexes, for structured outputs (`pagedjax.guided`).

`schema_regex` writes the regex text (the subset `pagedjax.regex_dfa` compiles) of the
JSON texts a schema allows, with the regex `ws` between tokens; no schema (None) is
json_object: any JSON object.

Supported: type string (enum, const, pattern, minLength/maxLength, format date / time /
date-time / uuid / email), integer, number, boolean, null, array (items,
minItems/maxItems), object (properties, `required`, additionalProperties), enum, const,
anyOf/oneOf, allOf of one schema (the keywords beside them go into each branch), type
lists, local $ref (not recursive) and {} (any value). Annotations (title, description,
default, discriminator, ...) are ignored. Any other keyword, an unknown type or format,
a pattern or format with another or with lengths, a keyword both beside anyOf / oneOf /
allOf and in a branch with another value, or a recursive or non-local $ref is a
ValueError naming it and where it is (`JSON schema at #/properties/a: ...`).

What is generated: an object's properties in declared order, the optional ones possibly
left out, no other keys (additionalProperties counts only without properties: then the
keys are the required ones, or without those any keys with additionalProperties' schema,
or none where it is false); values without a schema ({}, json_object) nest containers at
most `JSON_DEPTH` deep; strings hold JSON escapes, and a string `pattern` matches its
characters as written unescaped (its classes lose the characters a JSON string must
escape). oneOf is read as anyOf. The regexes read the same in Python's `re` with
`re.ASCII`.
"""

from __future__ import annotations

import json as jsonlib

from pagedjax.regex_dfa import escape, intersect, map_sets, negate, parse, to_text

__all__ = ["DEFAULT_WHITESPACE", "JSON_DEPTH", "MAX_REGEX_CHARS", "schema_regex"]

MAX_REGEX_CHARS = 1_000_000  # regex text of a JSON schema
# Default whitespace between JSON tokens: one optional space. It adds one DFA state per
# separator (a bounded run like [ \n\t]{0,4} adds four) and keeps a model from spending
# its tokens on runs of whitespace; json.dumps's ", " / ": " style fits it.
DEFAULT_WHITESPACE = "[ ]?"
# Containers nested in json_object=True (the outer object counted) and in {} schemas.
JSON_DEPTH = 3

_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))'
_JSON_SAFE = negate([(0, 0x1F), (34, 34), (92, 92)])  # chars a string holds unescaped
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_SCALARS = {
    "string": f'"{_STRING_CHAR}*"',
    "integer": _INTEGER,
    "number": _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?",
    "boolean": "(?:true|false)",
    "null": "null",
}
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_HM = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = _HM + r":[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-]" + _HM + ")"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "-".join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12)),
    "email": r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)+",
}
# Keywords that do not change the language we generate.
_IGNORED = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "$defs", "definitions", "readOnly", "writeOnly", "deprecated", "discriminator",
}  # fmt: skip
_KEYWORDS = _IGNORED | {
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required",
    "items", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
    "additionalProperties",
}  # fmt: skip


class _Schema:
    """JSON schema -> regex text; `ws` is the regex of the whitespace between tokens."""

    def __init__(self, root: dict, ws: str):
        self.root, self.ws, self.refs = root, ws, []

    def error(self, path: str, msg: str) -> ValueError:
        return ValueError(f"JSON schema at {path}: {msg}")

    def value(self, s, path: str) -> str:
        if s is True or s == {}:
            return self.any_value(JSON_DEPTH)
        if not isinstance(s, dict):
            raise self.error(path, f"a schema must be an object, got {s!r:.80}")
        unknown = sorted(set(s) - _KEYWORDS)
        if unknown:
            raise self.error(path, f"keyword {unknown[0]!r} is not supported")
        if "$ref" in s:
            return self.ref(s["$ref"], path)
        if "const" in s:
            return self.literal(s["const"])
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise self.error(path, f"enum must be a non-empty list, got {s['enum']!r:.80}")
            return "(?:" + "|".join(self.literal(v) for v in s["enum"]) + ")"
        for key in ("anyOf", "oneOf", "allOf"):
            if key in s:
                subs = s[key]
                if not isinstance(subs, list) or not subs:
                    raise self.error(path, f"{key} must be a non-empty list, got {subs!r:.80}")
                if key == "allOf" and len(subs) != 1:
                    raise self.error(path, "allOf is supported with one schema only")
                rest = {k: v for k, v in s.items() if k != key and k not in _IGNORED}
                alts = [self.branch(rest, x, f"{path}/{key}/{i}") for i, x in enumerate(subs)]
                return "(?:" + "|".join(alts) + ")"
        kind = s.get("type")
        if kind is None:
            kind = "object" if "properties" in s else "array" if "items" in s else None
            if kind is None:
                return self.any_value(JSON_DEPTH)
        if isinstance(kind, list) and kind:
            alts = [self.typed(dict(s, type=k), k, path) for k in kind]
            return "(?:" + "|".join(alts) + ")"
        return self.typed(s, kind, path)

    def branch(self, rest: dict, sub, path: str) -> str:
        """Branch `sub` of anyOf / oneOf / allOf, with the keywords `rest` beside it (they
        hold too: each branch gets them)."""
        if not rest:
            return self.value(sub, path)
        if isinstance(sub, dict) and "$ref" in sub:
            return self.ref(sub["$ref"], path, lambda node, at: self.branch(rest, node, at))
        if sub is True or sub == {}:
            return self.value(rest, path)
        if isinstance(sub, dict):
            both = all(isinstance(x.get("required"), list) for x in (rest, sub))
            clash = [k for k in rest if k in sub and sub[k] != rest[k]]
            clash = sorted(set(clash) - ({"required"} if both else set()))
            if clash:
                raise self.error(path, f"{clash[0]!r} both in it and beside it is not supported")
            sub = {**rest, **sub}
            if both:  # both hold: all of them are required
                sub["required"] = list(dict.fromkeys(rest["required"] + sub["required"]))
        return self.value(sub, path)

    def typed(self, s: dict, kind, path: str) -> str:
        if kind == "object":
            return self.object(s, path)
        if kind == "array":
            return self.array(s, path)
        if kind == "string":
            return self.string(s, path)
        if isinstance(kind, str) and kind in _SCALARS:
            return _SCALARS[kind]
        raise self.error(path, f"type {kind!r} is not supported")

    def ref(self, ref, path: str, then=None) -> str:
        """The regex of the schema `ref` points to, as `then(schema, ref)` writes it
        (default `value`)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.error(path, f"$ref {ref!r:.80} is not supported (only local refs)")
        if ref in self.refs:
            raise self.error(path, f"recursive $ref {ref!r} is not supported")
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise self.error(path, f"$ref {ref!r} points to nothing")
        self.refs.append(ref)
        try:
            return (then or self.value)(node, ref)
        finally:
            self.refs.pop()

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

    def string(self, s: dict, path: str) -> str:
        lo, hi = self.count(s, "minLength", 0, path), self.count(s, "maxLength", None, path)
        constraints = [k for k in ("pattern", "format") if k in s]
        if len(constraints) > 1 or (constraints and ("minLength" in s or "maxLength" in s)):
            given = constraints + [k for k in ("minLength", "maxLength") if k in s]
            raise self.error(path, f"{' with '.join(given)} is not supported")
        if "format" in s:
            if s["format"] not in _FORMATS:
                raise self.error(path, f"format {s['format']!r:.80} is not supported")
            return f'"{_FORMATS[s["format"]]}"'
        if "pattern" in s:
            # The pattern's characters must stand in a JSON string unescaped.
            ast = map_sets(parse(s["pattern"]), lambda r: intersect(r, _JSON_SAFE))
            return f'"{to_text(ast)}"'
        if (lo, hi) == (0, None):
            return _SCALARS["string"]
        return f'"{_STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'

    def count(self, s: dict, key: str, default, path: str):
        v = s.get(key, default)
        if v is not default and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise self.error(path, f"{key} must be an int >= 0, got {v!r:.80}")
        return v

    def array(self, s: dict, path: str) -> str:
        lo, hi = self.count(s, "minItems", 0, path), self.count(s, "maxItems", None, path)
        if hi is not None and hi < lo:
            raise self.error(path, f"maxItems={hi} < minItems={lo}")
        item = self.value(s.get("items", {}), f"{path}/items")
        return r"\[" + self.ws + self.repeat(item, lo, hi) + self.ws + r"\]"

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
        if props is None:  # only the required keys, with additionalProperties' values
            if extra is not True and not isinstance(extra, dict):
                if extra is not False:
                    msg = f"additionalProperties must be a bool or a schema, got {extra!r:.80}"
                    raise self.error(path, msg)
                props = {}
            elif required:
                props = {k: extra for k in required}
            elif extra is True or extra == {}:
                return self.any_object(JSON_DEPTH)
            else:
                value = self.value(extra, f"{path}/additionalProperties")
                return self.any_object(JSON_DEPTH, value)
        if not isinstance(props, dict):
            raise self.error(path, f"properties must be an object, got {props!r:.80}")
        missing = sorted(set(required) - set(props))
        if missing:
            raise self.error(path, f"required property {missing[0]!r} is not in properties")
        items = [
            self.literal(k) + self.colon + self.value(v, f"{path}/properties/{k}")
            for k, v in props.items()
        ]
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
      ValueError: an unsupported or malformed schema, named with its path; an object
        whose regex would exceed `MAX_REGEX_CHARS`. (Deep nesting: RecursionError.)
    """
    s = _Schema(schema, ws)
    return s.any_object(JSON_DEPTH) if schema is None else s.value(schema, "#")
