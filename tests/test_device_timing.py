"""scripts/device_timing.py: the profiler trace parsed on the CPU, and the summary's
arithmetic on hand-built events."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def dt():
    spec = importlib.util.spec_from_file_location(
        "device_timing_under_test", SCRIPTS / "device_timing.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def matmul_run():
    """A compiled run of 2 calls of a random matmul on the CPU."""
    a = jax.random.normal(jax.random.key(0), (192, 192), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (192, 192), jnp.float32)
    run = jax.jit(lambda x, y: [jnp.tanh(x @ y), jnp.tanh(y @ x)])
    return lambda: run(a, b)


def test_trace_events_cpu(dt):
    """The CPU plane holds the XLA ops of the run, sorted, each with a duration."""
    events = dt.trace_events(matmul_run(), 2, plane_prefix="/host:CPU", line_filter="XLA")
    assert events and all(e.duration_ns > 0 for e in events)
    assert all("XLA" in e.line for e in events)
    assert [e.start_ns for e in events] == sorted(e.start_ns for e in events)
    assert any("fusion" in e.name or "dot" in e.name for e in events), {e.name for e in events}
    summary = dt.device_times(matmul_run(), 2, runs=2, plane_prefix="/host:CPU", line_filter="XLA")
    assert summary["busy_us_per_call"] > 0 and summary["events"] >= 2
    # Without a filter the host plane has no "Stream" line: every line counts.
    lines = {e.line for e in dt.trace_events(matmul_run(), 1, plane_prefix="/host:CPU")}
    assert any("XLA" in line for line in lines) and any("XLA" not in line for line in lines)


def test_trace_events_no_plane(dt):
    with pytest.raises(RuntimeError, match=r"plane_prefix='/device:NOPE'.*/host:CPU"):
        dt.trace_events(matmul_run(), 1, plane_prefix="/device:NOPE", warmup=0)
    with pytest.raises(ValueError, match="runs=0"):
        dt.trace_events(matmul_run(), 0)


def test_summarize_synthetic(dt):
    """Two runs of 2 calls: kernel 10 us, gap 1, merge 2, gap 2, kernel 12, gap 1, merge 2;
    a 1 ms host sync; then the same run again, with a copy on a second stream."""
    E = dt.Event

    def run(t0, line="s0"):
        return [
            E("kern", t0, 10e3, line),
            E("merge", t0 + 11e3, 2e3, line),
            E("kern", t0 + 15e3, 12e3, line),
            E("merge", t0 + 28e3, 2e3, line),
        ]

    # The copy overlaps the first kern of run 2 entirely: no idle time, busy counts it.
    events = run(0.0) + run(1_030e3) + [E("copy", 1_031e3, 4e3, "s1")]
    for split in (None, 50.0):
        got = dt.summarize(events[::-1], calls=2, runs=2, gap_split_us=split)
        assert got["events"] == 9 and got["segments"] == 2
        assert list(got["kernels"]) == ["kern", "merge", "copy"]
        assert got["kernels"]["kern"] == dict(count=4, us_per_call=11.0, median_us=11.0)
        assert got["kernels"]["merge"] == dict(count=4, us_per_call=2.0, median_us=2.0)
        assert got["kernels"]["copy"] == dict(count=1, us_per_call=1.0, median_us=4.0)
        assert got["busy_us_per_call"] == pytest.approx((2 * 26 + 4) / 4)
        # Gaps 1 + 2 + 1 per run; the 1,000 us sync is not a gap.
        assert got["gaps_us_per_call"] == pytest.approx(2 * 4 / 4)
        assert got["max_gap_us"] == pytest.approx(2.0)
        assert got["span_us_per_call"] == pytest.approx(2 * 30 / 4)
    # A threshold above the sync: one segment, the sync a gap.
    one = dt.summarize(events, calls=2, runs=2, gap_split_us=2_000)
    assert one["segments"] == 1 and one["gaps_us_per_call"] == pytest.approx((8 + 1000) / 4)
    # A sync shorter than the threshold: the default still splits there, at the longest.
    short = run(0.0) + run(60e3) + run(93e3)  # syncs of 30 and 3 us
    got = dt.summarize(short, calls=2, runs=3)
    assert got["segments"] == 3 and got["gaps_us_per_call"] == pytest.approx(3 * 4 / 6)
    assert got["span_us_per_call"] == pytest.approx(3 * 30 / 6)
    assert dt.summarize(short, calls=2, runs=3, gap_split_us=50)["segments"] == 1
    with pytest.raises(ValueError, match="calls=0"):
        dt.summarize(events, calls=0)
