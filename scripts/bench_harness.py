"""The harness of the kernel benchmarks: how they time a kernel on the device, measure
the device's ceilings, and report.

`scripts/bench_kernels.py` runs its case families (`Family`) on a `BenchEnv`;
`scripts/bench_ragged_cases.py`, `tune_kernels.py` and `profile_decode.py` reuse the
same pieces through `bench_kernels`, which re-exports every name here:

* timing: `compile_calls` (many calls in one executable, compiled now), `time_rounds`
  (interleaved rounds, the figures a report compares), `time_run`, `time_calls`, and
  `paired_ratio` (the median of per-round ratios: the device drifts within a run);
* ceilings: `measure_copy` (copy bandwidth and its run, for the head-to-head),
  `measure_copy_gbps`, `measure_read_gbps`, `measure_matmul_tflops`;
* checks and reports: `rel_error`, `short_error`, `log` (stderr), `json_text` (strict
  JSON: a NaN error is null), `JsonLines` (--out), `print_table`.

It holds what does not depend on a case family. The cache-rotation sizes
(`L2_BYTES`, `rotating_copies`, `CALLS`, `RUN_BYTES`) stay in bench_kernels.py with
the cases they size; tests shrink `L2_BYTES` and `CALLS` there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

GIB = 2**30
WARMUP_S = 0.05  # seconds of warm-up runs before timing


@dataclasses.dataclass
class BenchEnv:
    """What every case family gets: the run's options and the device's ceilings."""

    on_gpu: bool
    quick: bool
    iters: int
    deadline: float  # time.monotonic() after which optional sweeps are skipped
    device: str
    copy_gbps: float | None = None  # measured read+write bandwidth, GB/s
    copy_run: tuple | None = None  # (thunk, calls, bytes per call) of that measurement
    read_gbps: float | None = None  # measured read-only bandwidth, GB/s
    matmul_tflops: float | None = None  # measured bf16 matmul throughput

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of benchmark cases.

    Attributes:
      name: a short name (the JSON key of its rows).
      run: env -> result rows, best yielded one by one (dicts with plain JSON values;
        "case" names the row, "ok" False marks a failed check, keys "err*"/"error*"
        with text are failures).
      columns: (row key, header, format spec) of the table; missing keys print "-".
      details: row keys printed under the table, one line per row (e.g. configs).
    """

    name: str
    run: Callable[[BenchEnv], Iterable[dict]]
    columns: tuple[tuple[str, str, str], ...]
    details: tuple[str, ...] = ()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def json_text(obj, **kwargs) -> str:
    """`obj` as strict JSON (`json.dumps(obj, **kwargs)`): a non-finite float (the NaN
    `rel_error` gives an output with NaNs, an infinite ratio) is null, where `json.dumps`
    writes `NaN`, which JSON has not (jq and JavaScript refuse it); other objects that
    are no JSON (a dtype, a path) are their `str`."""

    def finite(v):
        if isinstance(v, (float, np.floating)):
            return float(v) if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(obj), allow_nan=False, default=str, **kwargs)


class JsonLines:
    """Appends JSON lines to a file, one `write` at a time, flushed (see --out)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self.path = path

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json_text(record) + "\n")
            f.flush()


def short_error(e: BaseException) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {line[:200]}"


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 on the host (NaN if out has NaNs)."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if np.isnan(out).any():
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def compile_calls(fn, arg_sets):
    """A thunk that makes every call `fn(*args)` of `arg_sets` in one executable,
    compiled (and run once) now; callers rotate caches and vary the query so that
    no two calls are identical."""
    run = jax.jit(lambda sets: [fn(*args) for args in sets])
    jax.block_until_ready(run(arg_sets))
    return functools.partial(run, arg_sets)


def time_rounds(runs: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each run, measured in `rounds` interleaved rounds.

    Args:
      runs: name -> (thunk, calls per run), e.g. from `compile_calls`.

    Returns:
      name -> one figure per round: the run's time over its calls. Each round
      runs every entry once (in an order rotated by one each round), bracketed by
      `block_until_ready`, after a warm-up of `WARMUP_S` (so the clocks have left
      idle after the compile). The device's state drifts within a run (the same
      kernel timed 10% apart minutes later on the H200), and drift moves the
      entries of one round alike: compare them by ratios within rounds.
    """
    names = list(runs)
    t0 = time.perf_counter()
    while True:
        for name in names:
            jax.block_until_ready(runs[name][0]())
        if time.perf_counter() - t0 >= WARMUP_S:
            break
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            thunk, calls = runs[name]
            t0 = time.perf_counter()
            jax.block_until_ready(thunk())
            times[name].append((time.perf_counter() - t0) / calls)
    return times


def time_run(thunk, calls: int, iters: int) -> float:
    """Median seconds per call of one compiled run over `iters` runs (`time_rounds`)."""
    return statistics.median(time_rounds({"run": (thunk, calls)}, iters)["run"])


def time_calls(fn, arg_sets, iters: int) -> float:
    """Median seconds per call of `fn(*args)` over `arg_sets`, all calls in one executable
    (`compile_calls`), over `iters` runs (`time_rounds`)."""
    return time_run(compile_calls(fn, arg_sets), len(arg_sets), iters)


def paired_ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of num / den (two entries of one `time_rounds`)."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def measure_copy(iters: int, nbytes: int = GIB):
    """Device copy bandwidth in GB/s (bytes read + written), the best of two ways, and
    that way's run for `time_rounds`: (GB/s, (thunk, calls, bytes moved per call)).

    An elementwise `x + 1` over float32 arrays and an XLA copy of bfloat16 arrays,
    each over 4 distinct arrays of `nbytes`. On the H200 (jax 0.11.2) both gave
    3.5 TB/s, while `x + 1` over bfloat16 gave 2.9 (XLA's bf16 elementwise code is
    slower), below what the decode kernels themselves reached.
    """
    keys = jax.random.split(jax.random.key(7), 4)
    best = (0.0, None)
    for dtype, fn in ((jnp.float32, lambda x: x + 1), (jnp.bfloat16, lambda x: jnp.copy(x) * 1)):
        n = nbytes // jnp.dtype(dtype).itemsize
        arrays = [(jax.random.normal(k, (n,), dtype),) for k in keys]
        run = compile_calls(fn, arrays)
        t = time_run(run, len(arrays), iters)
        if 2 * nbytes / t / 1e9 > best[0]:
            best = (2 * nbytes / t / 1e9, (run, len(arrays), 2 * nbytes))
        del arrays, run
    return best


def measure_copy_gbps(iters: int, nbytes: int = GIB) -> float:
    """`measure_copy`'s GB/s alone."""
    return measure_copy(iters, nbytes)[0]


def measure_read_gbps(iters: int, nbytes: int = GIB) -> float:
    """Device read bandwidth in GB/s: a float32 sum over 4 distinct arrays of `nbytes`."""
    keys = jax.random.split(jax.random.key(8), 4)
    arrays = [(jax.random.normal(k, (nbytes // 4,), jnp.float32),) for k in keys]
    return nbytes / time_calls(jnp.sum, arrays, iters) / 1e9


def measure_matmul_tflops(iters: int, n: int = 8192) -> float:
    """bf16 matmul throughput in TFLOP/s (n x n x n, float32 accumulation)."""
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    t = time_calls(lambda x, y: x @ y, [(a, b), (b, a)], iters)
    return 2 * n**3 / t / 1e12


def print_table(title: str, rows: list[dict], columns) -> None:
    header = [h for _, h, _ in columns]
    body = []
    for row in rows:
        cells = []
        for key, _, spec in columns:
            value = row.get(key)
            if value is None:
                cells.append("-")
            elif isinstance(value, float) and math.isfinite(value) and spec:
                cells.append(format(value, spec))
            elif isinstance(value, str) and len(value) > 24:
                cells.append("see below")
            else:
                cells.append(str(value))
        body.append(cells)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for cells in body:
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
