"""JSON schemas (pagedjax/json_schema.py, json_one_of.py) that took time or memory
exponential in their nesting, or quadratic in their width, or reached Python's recursion
limit: each compiles or is refused (ValueError) in well under a second.

The slow ones run in a subprocess with a time and memory limit, so that a regression
fails here instead of pinning the CPU or the memory of the test run."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedjax import json_schema
from pagedjax.json_schema import MAX_DEPTH, schema_regex

WS = "[ ]?"
_ROOT = Path(__file__).resolve().parents[1]
_COMPILE = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from pagedjax.json_schema import schema_regex
schema = json.loads(sys.stdin.read())
start = time.perf_counter()
try:
    out = {"size": len(schema_regex(schema, "[ ]?"))}
except Exception as e:  # (a RecursionError or a MemoryError too)
    out = {"error": f"{type(e).__name__}: {e}"[:2000]}
out["seconds"] = time.perf_counter() - start
print(json.dumps(out))
"""


def compile_apart(schema_text: str, timeout: float = 10.0) -> dict:
    """schema_regex of the JSON text `schema_text` in a subprocess (3 GiB, `timeout` s):
    {"size": ...} or {"error": ...}, and "seconds"; a timeout fails the test."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE],
            input=schema_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=_ROOT,  # (this checkout's pagedjax)
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling took over {timeout} s")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def nested(outer: str, inner: str, depth: int) -> str:
    """JSON text of `outer` (a JSON object text ending in `"key": `) nested `depth` deep
    around `inner`, written without recursion."""
    return outer * depth + inner + "}" * depth


ARRAY = '{"type": "array", "items": '


@pytest.mark.parametrize(
    "depth, match",
    [
        (26, r"^ValueError: JSON schema at #(/items){5,}: its regex exceeds 1000000 characters$"),
        (300, rf"^ValueError: JSON schema at #(/items){{{MAX_DEPTH}}}: schema nests too "
         rf"deeply: more than {MAX_DEPTH} levels$"),
        (900, "^ValueError: .*schema nests too deeply"),
    ],
)  # fmt: skip
def test_nested_arrays_are_refused_at_once(depth, match):
    """Each level copied its items' regex twice: 2x the time per level (18 s at 26, a
    MemoryError or minutes at 300), a RecursionError (HTTP 500) at 900."""
    out = compile_apart(nested(ARRAY, '{"type": "integer"}', depth))
    assert re.match(match, out.get("error", "")), out
    assert out["seconds"] < 1.0


def test_nesting_up_to_the_limit_compiles():
    s = json.loads(nested(ARRAY, '{"type": "integer"}', 4))
    for _ in range(MAX_DEPTH - 5):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    regex = schema_regex(s, "")
    assert re.fullmatch(regex, '{"a":' * (MAX_DEPTH - 5) + "[[[[1]]]]" + "}" * (MAX_DEPTH - 5))
    with pytest.raises(ValueError, match=f"nests too deeply: more than {MAX_DEPTH} levels"):
        schema_regex({"type": "array", "items": {"anyOf": [s]}}, "")


def test_a_deep_const_is_refused():
    """literal (and _floats) recursed once per level of a const's value."""
    value = json.loads("[" * 900 + "]" * 900)
    with pytest.raises(ValueError, match=r"^JSON schema at #: const value nests too deeply"):
        schema_regex({"const": value}, WS)
    assert schema_regex({"const": [[[]]]}, "") == r"(?:\[\[\[\]\]\])"


def test_a_bound_of_many_digits_is_refused():
    """math.isfinite of a huge int was an OverflowError (an HTTP 500)."""
    with pytest.raises(ValueError, match="minimum of more than 400 digits is not supported"):
        schema_regex({"type": "integer", "minimum": -(10**2000)}, WS)
    assert re.fullmatch(schema_regex({"type": "integer", "maximum": 10**300}, WS), "7" * 300)


def test_an_allof_of_many_refs_compiles():
    """all_of recursed (three frames) per $ref."""
    defs = {
        f"d{i}": {"properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(600)
    }
    s = {"$defs": defs, "allOf": [{"$ref": f"#/$defs/d{i}"} for i in range(600)]}
    regex = schema_regex(s, "")
    assert re.fullmatch(regex, "{" + ",".join(f'"k{i}":{i}' for i in range(600)) + "}")


def test_an_allof_of_one_ref_twice_is_that_ref():
    """The refs merged stayed open, so the third merge of one ref matched nothing; and a
    chain of allOf: [A, A] took time exponential in its length."""
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}] * 2} for i in range(1, 60)}
    defs["d0"] = {"type": "integer", "minimum": 3}
    regex = schema_regex({"$defs": defs, "$ref": "#/$defs/d59"}, WS)
    assert re.fullmatch(regex, "12") and not re.fullmatch(regex, "2")
    point = {"$ref": "#/$defs/d0"}
    four = schema_regex({"$defs": defs, "allOf": [point] * 4}, WS)
    assert four == schema_regex({"$defs": defs, **point}, WS)


def test_a_recursive_ref_in_a_one_of_is_refused():
    """facts followed a $ref inside itself until the recursion limit."""
    s = {
        "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}]}},
        "oneOf": [{"$ref": "#/$defs/a"}, {"type": "string"}],
    }
    with pytest.raises(ValueError, match="oneOf 0 and 1 may both match one value"):
        schema_regex(s, WS)


def test_a_wide_one_of_is_checked_in_linear_time():
    """Its branches were compared pairwise (and a discriminated union's properties read
    again for each pair): 12 s for 10,000 consts, 3.4 s for 1,000 objects."""
    consts = {"oneOf": [{"const": i} for i in range(12_000)]}
    union = {
        "oneOf": [
            {
                "properties": {"kind": {"const": f"k{i}"}, "v": {"type": "null"}},
                "required": ["kind"],
            }
            for i in range(3000)
        ]
    }
    for s in (consts, union):
        out = compile_apart(json.dumps(s))
        assert "size" in out and out["seconds"] < 1.0, out
    overlapping = {"oneOf": [{"type": "string"}, *consts["oneOf"][:1999]]}
    with pytest.raises(ValueError, match="oneOf of 2000 branches is too large to check"):
        schema_regex(overlapping, WS)


def test_many_required_properties_take_linear_time():
    """`k in required` (a list) for each property: quadratic, 7.5 s for 50,000."""
    keys = [f"p{i}" for i in range(50_000)]
    s = {"properties": {k: {"type": "null"} for k in keys}, "required": keys}
    out = compile_apart(json.dumps(s))
    assert out["seconds"] < 2.0 and "its regex exceeds 1000000" in out["error"], out


def test_a_ref_used_many_times_is_written_once(monkeypatch):
    """A $ref's regex is memoised (on the refs open around it): an expensive one used in
    many places costs once."""
    calls = []
    one_of = json_schema._Schema.one_of
    monkeypatch.setattr(json_schema._Schema, "one_of", lambda *a: calls.append(1) or one_of(*a))
    shape = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    s = {
        "$defs": {"shape": shape, "row": {"type": "array", "items": {"$ref": "#/$defs/shape"}}},
        "properties": {f"p{i}": {"$ref": f"#/$defs/{('shape', 'row')[i % 2]}"} for i in range(50)},
    }  # fmt: skip
    regex = schema_regex(s, "")
    assert len(calls) == 2  # (once with "row" open around it, once without)
    assert re.fullmatch(regex, '{"p0":"a","p1":[1,"b"],"p2":3}')


def test_a_wide_tree_of_refs_is_refused_at_once():
    """Each def holds the one below twice: its regex doubles per def (was refused in
    time too, by $ref's check: a guard)."""
    defs = {
        f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i - 1}"}] * 2}
        for i in range(1, 30)
    }
    defs["d0"] = {"type": "null"}
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^JSON schema at #/\$defs/d.*its regex exceeds 1000000"):
        schema_regex({"$defs": defs, "$ref": "#/$defs/d29"}, WS)
    assert time.perf_counter() - start < 1.0
