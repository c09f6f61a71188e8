"""Regexes of JSON strings' text, for JSON schemas' strings (`pagedjax.json_schema`).

A JSON string's text is not its characters: some must be escaped, any may be written as
its escape, and one outside the BMP as a pair of \\u escapes. `STRING_CHAR` is one
character as JSON text, each escape one whole character (a surrogate's \\u escape only
in a pair: `json.loads` makes a lone one an unencodable string); `BMP_CHAR` is the same
without the pairs, for strings of a bounded length, where a pair would count as two
characters. `json_chars` rewrites a character set of a pattern (which matches the
string's characters) as the JSON text of those characters: the ones a JSON string must
escape, as their escapes.

`FORMATS` are the regexes of the string `format`s, `FORMAT_LENGTHS` the fewest and most
characters of their strings: RFC 3339's dates and times (dates that exist, years 0001 to
9999), RFC 4122's uuid, an email of a dot-atom @ host name labels (letters, digits, inner
hyphens; two at least), and RFC 3986's URI in its parts, with "%" escapes (no IP literal
hosts).

Apart from `json_schema`, which reads schemas: these are fixed texts of JSON's and the
RFCs' grammars, built once, that `json_schema` picks among.
"""

from __future__ import annotations

from pagedjax.regex_parse import intersect, negate

__all__ = ["BMP_CHAR", "FORMATS", "FORMAT_LENGTHS", "STRING_CHAR", "json_chars"]

_HEX = "[0-9a-fA-F]"
# One character of a JSON string, no surrogate escaped alone: the pair of one is the
# character (STRING_CHAR); a bounded count of them copies its states per character, so
# there they are left out (BMP_CHAR; the character may be written itself).
_BMP_ESCAPE = rf"(?:[0-9a-cA-Ce-fE-F]{_HEX}|[dD][0-7]){_HEX}{{2}}"
BMP_CHAR = rf'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u{_BMP_ESCAPE}))'
STRING_CHAR = (
    rf'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u(?:{_BMP_ESCAPE}'
    rf"|[dD][89abAB]{_HEX}{{2}}\\u[dD][c-fC-F]{_HEX}{{2}})))"
)
_MUST_ESCAPE = ((0, 0x1F), (34, 34), (92, 92))  # chars a JSON string holds only escaped
_JSON_SAFE = negate(_MUST_ESCAPE)
_SHORT_ESCAPES = {34: '"', 92: "\\", 8: "b", 12: "f", 10: "n", 13: "r", 9: "t"}


def _lits(text: str):
    """The regex AST of `text` (`pagedjax.regex_parse.parse`'s nodes)."""
    return ("cat", [("set", ((ord(c), ord(c)),)) for c in text])


def json_chars(ranges):
    """The AST of one character of `ranges` as JSON string text: itself, or its escapes
    where a JSON string must escape it (a pattern matches the string's characters)."""
    alts = [("set", intersect(ranges, _JSON_SAFE))]
    escaped = [c for lo, hi in intersect(ranges, _MUST_ESCAPE) for c in range(lo, hi + 1)]
    alts += [_lits("\\" + _SHORT_ESCAPES[c]) for c in escaped if c in _SHORT_ESCAPES]
    for high in (0, 1):  # \u00XX, the last digit in either case
        last = {d for c in escaped if c >> 4 == high for d in {f"{c & 15:x}", f"{c & 15:X}"}}
        if last:
            digits = negate(negate([(ord(d), ord(d)) for d in last]))
            alts.append(("cat", [*_lits(f"\\u00{high}")[1], ("set", digits)]))
    alts = [a for a in alts if a != ("set", ())] or alts[:1]
    return alts[0] if len(alts) == 1 else ("alt", alts)


_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001 to 9999
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HM = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]"
_ATOM = r"[A-Za-z0-9_%+\-]+"  # of an email's dot-atom (RFC 5321's, fewer characters)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?"  # of a host name


def _uri_chars(more: str) -> str:
    """One of RFC 3986's unreserved or sub-delims characters, `more`, or a %-escape."""
    return rf"(?:[A-Za-z0-9\-._~!$&'()*+,;={more}]|%{_HEX}{{2}})"


_PCHAR = _uri_chars(":@")
_SEGMENTS = rf"{_PCHAR}+(?:/{_PCHAR}*)*"
_TIME = _HM + r":[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-]" + _HM + ")"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "-".join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12)),
    "email": f"{_ATOM}(?:\\.{_ATOM})*@{_LABEL}(?:\\.{_LABEL})+",
    "uri": (
        rf"[A-Za-z][A-Za-z0-9+.\-]*:(?://(?:{_uri_chars(':')}*@)?{_uri_chars('')}*(?::[0-9]*)?"
        rf"(?:/{_PCHAR}*)*|/(?:{_SEGMENTS})?|{_SEGMENTS})"
        rf"(?:\?{_uri_chars(':@/?')}*)?(?:#{_uri_chars(':@/?')}*)?"
    ),
}
# The fewest and most characters of a format's strings (None: no most).
FORMAT_LENGTHS = {
    "date": (10, 10),
    "time": (9, None),
    "date-time": (20, None),
    "uuid": (36, 36),
    "email": (5, None),
    "uri": (3, None),
}
