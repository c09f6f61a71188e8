"""Regexes of numeric ranges, for JSON schemas' bounds (`pagedjax.json_schema`).

`integer_regex(lo, hi)` matches exactly the decimal integers from lo to hi (either end
unbounded; no leading zeros, no "-0"), by the classic digit-range construction: a
range of equal-length digit strings splits into O(digits) alternatives, each choosing
at most one digit from the bounds (`_same_length`). `number_regex` does the same for
JSON numbers without exponent between whole-number bounds, inclusive or exclusive: the
integer part's range, then the fraction's (a bound met exactly needs a zero or nonzero
fraction).
"""

from __future__ import annotations

__all__ = ["NOTHING", "integer_regex", "number_regex"]

NOTHING = "[^\\x00-\\U0010ffff]"  # matches nothing


def _alt(alts: list[str]) -> str:
    return NOTHING if not alts else alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def _same_length(x: str, y: str) -> str:
    """The digit strings from `x` to `y` (as many digits each, x <= y): O(digits)
    alternatives, each at most one digit's choice from the bounds."""
    i = 0
    while i < len(x) and x[i] == y[i]:
        i += 1
    head, x, y = x[:i], x[i:], y[i:]
    if not x:
        return head
    k, a, b, alts = len(x) - 1, int(x[0]), int(y[0]), []
    if x[1:] != "0" * k:  # x's first digit, then at least x's rest
        alts.append(x[0] + _same_length(x[1:], "9" * k))
        a += 1
    tail = y[1:] != "9" * k
    b -= tail
    if a <= b:
        alts.append((str(a) if a == b else f"[{a}-{b}]") + (f"[0-9]{{{k}}}" if k else ""))
    if tail:  # y's first digit, then at most y's rest
        alts.append(y[0] + _same_length("0" * k, y[1:]))
    return head + _alt(alts)


def _uint(lo: int, hi: int | None) -> str:
    """The integers lo..hi (None: no most; 0 <= lo) in decimal, no leading zeros."""
    alts = []
    if lo == 0:
        alts.append("0")
        lo = 1
    if hi is not None and lo > hi:
        return _alt(alts)
    p, low = len(str(lo)), str(lo)
    if hi is None:
        if low == "1" + "0" * (p - 1):
            return _alt([*alts, f"[1-9][0-9]{{{p - 1},}}"])
        return _alt([*alts, _same_length(low, "9" * p), f"[1-9][0-9]{{{p},}}"])
    q = len(str(hi))
    if p == q:
        return _alt([*alts, _same_length(low, str(hi))])
    alts.append(_same_length(low, "9" * p))
    if q - p >= 2:
        alts.append(f"[1-9][0-9]{{{p},{q - 2}}}")
    return _alt([*alts, _same_length("1" + "0" * (q - 1), str(hi))])


def integer_regex(lo: int | None, hi: int | None) -> str:
    """The integers lo..hi (None: unbounded), lo <= hi."""
    alts = []
    if lo is None or lo < 0:
        alts.append("-" + _uint(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo))
    if hi is None or hi >= 0:
        alts.append(_uint(max(lo or 0, 0), hi))
    return _alt(alts)


def _unum(lo: int, lo_ex: bool, hi: int | None, hi_ex: bool) -> str:
    """Numbers m without sign and exponent, lo <= m (lo < m where lo_ex) and m <= hi (m <
    hi where hi_ex; None: no most). With i.f = m: lo < m iff lo < i, or lo = i and f != 0;
    m <= hi iff i < hi, or i = hi and f = 0."""
    alts, first, last = [], lo + lo_ex, None if hi is None else hi - 1
    if last is None or first <= last:
        alts.append(_uint(first, last) + r"(?:\.[0-9]+)?")
    if lo_ex and (hi is None or lo < hi):
        alts.append(f"{lo}\\.[0-9]*[1-9][0-9]*")
    if hi is not None and not hi_ex and (hi > lo or not lo_ex):
        alts.append(f"{hi}(?:\\.0+)?")
    return _alt(alts)


def number_regex(lo: int | None, lo_ex: bool, hi: int | None, hi_ex: bool) -> str:
    """The numbers from lo to hi (None: unbounded), without exponent: -m for the
    negative ones (m > 0), m for the others."""
    alts = []
    if lo is None or lo < 0:
        m_lo, m_lo_ex = (0, True) if hi is None or hi >= 0 else (-hi, hi_ex)
        alts.append("-" + _unum(m_lo, m_lo_ex, None if lo is None else -lo, lo_ex))
    if hi is None or hi > 0 or (hi == 0 and not hi_ex):
        alts.append(
            _unum(0, False, hi, hi_ex) if lo is None or lo < 0 else _unum(lo, lo_ex, hi, hi_ex)
        )
    return _alt(alts)
