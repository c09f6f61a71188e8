"""JSON schemas' strings, integers and numbers as regexes (`pagedjax.json_schema`).

`ScalarMixin.string` writes a string schema (minLength / maxLength, pattern, format) from
`pagedjax.string_regex`'s texts and a pattern's AST (`pagedjax.regex_parse`), with the
characters a JSON string must escape written as their escapes; `ScalarMixin.numeric`
reads an integer or number schema's bounds (draft 4's boolean exclusive* too) into
`pagedjax.number_regex`'s exact digit ranges; `ScalarMixin.count` reads a length keyword
(json_schema's arrays read minItems / maxItems with it). `SCALARS` are the regexes of
each scalar type without keywords. The rules (what is supported, what a ValueError)
are in `json_schema`'s docstring.

`ScalarMixin` is a base of `json_schema._Schema` (it calls the schema's `error`), apart
from it because a scalar's regex depends on its own keywords alone, where `json_schema`
walks the schemas nested in one (objects, arrays, branches, $refs) and bounds their cost.
"""

from __future__ import annotations

import math

from pagedjax.json_one_of import BOUNDS
from pagedjax.number_regex import integer_regex, number_regex
from pagedjax.regex_parse import map_sets, parse, to_text
from pagedjax.string_regex import BMP_CHAR, FORMAT_LENGTHS, FORMATS, STRING_CHAR, json_chars

__all__ = ["SCALARS", "ScalarMixin"]

# A bound of more digits than this (a float's have 309 at most): refused, as its digit
# ranges (`pagedjax.number_regex`) recurse once per digit.
_MAX_BOUND_DIGITS = 400

_INTEGER = r"-?(?:0|[1-9][0-9]*)"
SCALARS = {
    "string": f'"{STRING_CHAR}*"',
    "integer": _INTEGER,
    "number": _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]{1,2})?",  # (1e999 parses as inf)
    "boolean": "(?:true|false)",
    "null": "null",
}


class ScalarMixin:
    """`json_schema._Schema`'s regexes of string, integer and number schemas."""

    def numeric(self, s: dict, kind: str, path: str) -> str:
        step = s.get("multipleOf")
        if step is not None and not (kind == "integer" and step == 1 and step is not True):
            raise self.error(path, f"multipleOf {step!r:.40} is not supported (only 1 on integers)")
        lo = hi = None
        lo_ex = hi_ex = False
        for key in BOUNDS:
            v = s.get(key)
            upper = "ax" in key
            base = "maximum" if upper else "minimum"
            if v is None or (v is False and key != base):
                continue
            if v is True and key != base:  # draft 4: minimum / maximum is exclusive
                if base not in s:
                    raise self.error(path, f"{key} true needs a number {base}")
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (isinstance(v, float) and not math.isfinite(v))
            ):
                raise self.error(path, f"{key} must be a number, got {v!r:.80}")
            if abs(v) >= 10**_MAX_BOUND_DIGITS:
                raise self.error(
                    path, f"{key} of more than {_MAX_BOUND_DIGITS} digits is not supported"
                )
            ex = key != base or s.get("exclusive" + base.title()) is True
            if kind == "integer":  # the inclusive integer bound
                v = (
                    (math.ceil(v) - 1 if ex else math.floor(v))
                    if upper
                    else (math.floor(v) + 1 if ex else math.ceil(v))
                )
                ex = False
            elif v != int(v):
                raise self.error(
                    path, f"{key} {v!r} on a number is not supported (only whole numbers)"
                )
            v = int(v)
            if upper and (hi is None or v < hi or (v == hi and ex)):
                hi, hi_ex = v, ex
            elif not upper and (lo is None or v > lo or (v == lo and ex)):
                lo, lo_ex = v, ex
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_ex or hi_ex))):
            raise self.error(path, f"no {kind} is within its bounds ({lo=}, {hi=})")
        if lo is None and hi is None:
            return SCALARS[kind]
        return integer_regex(lo, hi) if kind == "integer" else number_regex(lo, lo_ex, hi, hi_ex)

    def string(self, s: dict, path: str) -> str:
        lo, hi = self.count(s, "minLength", 0, path), self.count(s, "maxLength", None, path)
        if hi is not None and hi < lo:
            raise self.error(path, f"maxLength={hi} < minLength={lo}: no string fits")
        lengths = [k for k in ("minLength", "maxLength") if k in s]
        if "pattern" in s and ("format" in s or lengths):
            given = ["pattern", *[k for k in ("format",) if k in s], *lengths]
            raise self.error(path, f"{' with '.join(given)} is not supported")
        if "format" in s:
            fmt = s["format"]
            if not isinstance(fmt, str) or fmt not in FORMATS:
                raise self.error(path, f"format {fmt!r:.80} is not supported")
            shortest, longest = FORMAT_LENGTHS[fmt]
            if (hi is not None and hi < shortest) or (longest is not None and lo > longest):
                raise self.error(path, f"no string of format {fmt!r} fits {lo=}, {hi=}")
            if lo > shortest or (hi is not None and (longest is None or hi < longest)):
                msg = f"format {fmt!r} with {' and '.join(lengths)} {lo=}, {hi=}"
                raise self.error(path, f"{msg} is not supported (only lengths all its strings fit)")
            return f'"{FORMATS[fmt]}"'
        if "pattern" in s:
            pattern = s["pattern"]
            if not isinstance(pattern, str):
                raise self.error(path, f"pattern must be a str, got {pattern!r:.80}")
            try:
                ast = parse(pattern, ecma=True)
            except ValueError as e:  # (it names the pattern and the position, not where)
                raise self.error(path, f"pattern: {e}") from None
            return f'"{to_text(map_sets(ast, json_chars))}"'
        if (lo, hi) == (0, None):
            return SCALARS["string"]
        return f'"{BMP_CHAR}{{{lo},{"" if hi is None else hi}}}"'

    def count(self, s: dict, key: str, default, path: str):
        v = s.get(key, default)
        if v is not default and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise self.error(path, f"{key} must be an int >= 0, got {v!r:.80}")
        return v
