"""Device-side timings of a compiled run, from JAX's profiler trace.

    import device_timing as dt
    summary = dt.device_times(thunk, calls=8)   # thunk: one run of `calls` calls
    summary["busy_us_per_call"], summary["kernels"]["paged_decode_gpu"]["us_per_call"]

Host timing (`bench_kernels.time_rounds`) sees a run from dispatch to sync: it
cannot tell the kernels of a call from the idle time between them. Here the run
goes under `jax.profiler.trace`, and the trace's device events (one per kernel
launch or memcpy, on a CUDA GPU the planes "/device:GPU:<n>", one line per
stream, "Stream #<id>(...)") give each kernel's own time and the gaps between
launches. Those names are XLA's CUPTI collector's (`GetDeviceXLineName` in
cupti_collector.cc: "Stream #<id>", then the event kinds in parentheses; its own
"CUPTI overhead" line and the lines derived later, e.g. "XLA Ops", have no "Stream"),
read in the source, not yet seen in a trace from a GPU. On a CPU the XLA ops are
events of the "/host:CPU" plane: pass `plane_prefix="/host:CPU"` to exercise the
plumbing there.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
from jax.profiler import ProfileData

STREAM = "Stream"  # CUDA device lines are "Stream #<id>(<kinds>)"; others derive from them


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One traced device activity (a kernel launch, a memcpy, or on a CPU an XLA op)."""

    name: str
    start_ns: float
    duration_ns: float
    line: str


def trace_events(
    thunk,
    runs: int,
    *,
    plane_prefix: str = "/device:GPU",
    line_filter: str | None = None,
    warmup: int = 1,
) -> list[Event]:
    """The events of `runs` runs of `thunk` under the profiler, sorted by start.

    Args:
      thunk: a callable of no arguments that dispatches one run (e.g. from
        `bench_kernels.compile_calls`); its result is passed to `block_until_ready`.
      runs: traced runs, each synced before the next starts.
      plane_prefix: events come from the planes whose name starts with this.
      line_filter: keep the lines whose name contains this; by default the lines
        with "Stream" in their name if a chosen plane has any (the CUDA streams, not
        the lines derived from them, which would count each kernel twice), else all.
      warmup: untraced runs first (compilation, first-touch allocation).

    Returns:
      Every event of nonzero duration on the chosen lines.

    Raises:
      ValueError: `runs` below 1 or `warmup` below 0.
      RuntimeError: no plane matches `plane_prefix`, or its lines hold no events;
        the message names what the trace holds.
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got {runs=}, {warmup=}")
    for _ in range(warmup):
        jax.block_until_ready(thunk())
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python frames: less host overhead, fewer events
    with tempfile.TemporaryDirectory(prefix="device_timing_") as tmp:
        with jax.profiler.trace(tmp, profiler_options=options):
            for _ in range(runs):
                jax.block_until_ready(thunk())
        paths = sorted(Path(tmp).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {tmp}")
        data = ProfileData.from_file(str(paths[-1]))
    planes = [p for p in data.planes if p.name.startswith(plane_prefix)]
    if not planes:
        names = [p.name for p in data.planes]
        raise RuntimeError(f"no profiler plane starts with {plane_prefix=}; planes: {names}")
    events = []
    for plane in planes:
        lines = list(plane.lines)
        if line_filter is not None:
            lines = [ln for ln in lines if line_filter in ln.name]
        elif any(STREAM in ln.name for ln in lines):
            lines = [ln for ln in lines if STREAM in ln.name]
        for ln in lines:
            events += [
                Event(e.name, float(e.start_ns), float(e.duration_ns), ln.name)
                for e in ln.events
                if e.duration_ns > 0
            ]
    if not events:
        found = {p.name: [ln.name for ln in p.lines] for p in planes}
        raise RuntimeError(f"no events of nonzero duration on {line_filter=}; lines: {found}")
    return sorted(events, key=lambda e: (e.start_ns, e.line))


def summarize(
    events: list[Event], calls: int, *, runs: int = 1, gap_split_us: float | None = None
) -> dict:
    """Per-call device figures of `runs` traced runs of `calls` calls each.

    Events are taken in order of start; "idle" is the time from the latest end so
    far to the next start (overlapping events, e.g. on two streams, leave none).
    Each run ends in a host sync, so the trace falls into segments, one per run:
    by default it is split at its `runs - 1` longest idle stretches (a sync is a
    host round trip, longer than any launch gap inside one executable, however
    short it is); with `gap_split_us`, at every idle stretch longer than that.
    The other idle stretches are the gaps within a run.

    Args:
      events: e.g. from `trace_events`, in any order.
      calls: calls per run.
      runs: runs traced; every `*_per_call` figure divides by `calls * runs`.
      gap_split_us: if given, the longest idle stretch counted as a gap.

    Returns:
      A dict of
        kernels: {name: {count, us_per_call, median_us}}, ordered by us_per_call,
          largest first: the events of that name, their total duration per call,
          and the median duration of one event;
        busy_us_per_call: the total duration of all events per call (events that
          overlap count each);
        gaps_us_per_call: the idle stretches within runs per call: launch gaps
          and whatever else keeps the device waiting inside an executable;
        max_gap_us: the longest of those stretches;
        span_us_per_call: the segments' first start to last end, summed, per call
          (busy + gaps when nothing overlaps): the device-side time of a call;
        segments: the number of segments (with `gap_split_us`, more than `runs`
          means idle stretches above it within a run);
        events: the number of events.

    Raises:
      ValueError: no events, or `calls` or `runs` below 1.
    """
    if not events or calls < 1 or runs < 1:
        raise ValueError(
            f"need events, calls >= 1, runs >= 1; got {len(events)=}, {calls=}, {runs=}"
        )
    total = calls * runs
    ordered = sorted(events, key=lambda e: e.start_ns)
    by_name = defaultdict(list)
    for e in ordered:
        by_name[e.name].append(e.duration_ns / 1e3)
    kernels = {
        name: dict(count=len(us), us_per_call=sum(us) / total, median_us=statistics.median(us))
        for name, us in by_name.items()
    }
    kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_call"]))
    idle, end = [0.0], ordered[0].start_ns + ordered[0].duration_ns  # idle[i]: before event i
    for e in ordered[1:]:
        idle.append(max(0.0, e.start_ns - end))
        end = max(end, e.start_ns + e.duration_ns)
    if gap_split_us is None:
        longest = sorted(range(1, len(idle)), key=lambda i: -idle[i])[: runs - 1]
        splits = {i for i in longest if idle[i] > 0}
    else:
        splits = {i for i, t in enumerate(idle) if t > gap_split_us * 1e3}
    gaps = [t for i, t in enumerate(idle) if i not in splits]
    span_ns, first, end = 0.0, ordered[0].start_ns, ordered[0].start_ns
    for i, e in enumerate(ordered):
        if i in splits:
            span_ns += end - first
            first = e.start_ns
        end = max(end, e.start_ns + e.duration_ns)
    span_ns += end - first
    return dict(
        kernels=kernels,
        busy_us_per_call=sum(e.duration_ns for e in ordered) / 1e3 / total,
        gaps_us_per_call=sum(gaps) / 1e3 / total,
        max_gap_us=max(gaps) / 1e3,
        span_us_per_call=span_ns / 1e3 / total,
        segments=len(splits) + 1,
        events=len(ordered),
    )


def device_times(thunk, calls: int, runs: int = 5, *, gap_split_us: float | None = None, **kw):
    """`summarize` of `trace_events`: device figures per call of a run of `calls` calls.

    Args:
      thunk: one run, as for `trace_events`.
      calls: calls per run.
      runs: traced runs.
      gap_split_us: as for `summarize`.
      **kw: `plane_prefix`, `line_filter`, `warmup` of `trace_events`.
    """
    events = trace_events(thunk, runs, **kw)
    return summarize(events, calls, runs=runs, gap_split_us=gap_split_us)
