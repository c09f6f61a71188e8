"""Tuning sweeps for the GPU kernels: a grid of knobs per shape, timed in one run.

    python scripts/tune_kernels.py --out DIR [--budget-s 150]   # on a CUDA GPU
    python scripts/tune_kernels.py --dry-run                    # the plumbing, on a CPU

`bench_kernels.py` times each kernel at its default knobs and a few one-knob
changes; this script searches the knobs jointly, to choose the defaults
(`default_tuning` in each kernel's module) from measurements. It

1. measures the device's copy and read bandwidth as `bench_kernels.py` does;
2. times our paged decode kernel over a grid of `block_kv x num_splits x
   num_stages x num_warps` for each decode shape (the default timed first and
   again last: the spread of those two is the noise; where the default splits,
   the split merge is also timed alone), then checks the fastest configuration
   against the reference;
3. times the ragged kernel with `prefetch_rows=True`, then over `block_q x
   block_kv x num_warps x num_stages`, for the prefill-chunk shapes.

Timing is `bench_kernels.time_calls` (cold L2: rotating caches; medians).
`--out DIR` streams one JSON line per measurement to DIR/tune.jsonl, so a run cut
short keeps what it measured; the script stops starting new measurements at
`--budget-s`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402 - scripts/ is not a package
import bench_ragged_cases as rc  # noqa: E402

from pallas_kernels import reference  # noqa: E402
from pallas_kernels.paged_decode.gpu import paged_decode_gpu  # noqa: E402
from pallas_kernels.paged_decode.gpu_merge import merge_partials  # noqa: E402
from pallas_kernels.ragged.gpu import ragged_paged_attention_gpu  # noqa: E402

GIB = 2**30


class Run:
    """The run's clock, options and output stream."""

    def __init__(self, args):
        self.args = args
        self.deadline = time.monotonic() + args.budget_s
        self.interpret = args.dry_run
        self.iters = 1 if args.dry_run else args.iters
        self.path = args.out / "tune.jsonl" if args.out else None
        if self.path:
            args.out.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
        self.records: list[dict] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def share(self, weight: float, weights_left: float) -> float:
        """A sweep's own deadline: its weight's share of the time left."""
        return time.monotonic() + max(0.0, self.left()) * weight / weights_left

    def emit(self, **record) -> None:
        self.records.append(record)
        if self.path:
            with self.path.open("a") as f:
                f.write(bk.json_text(record) + "\n")


# ---------------------------------------------------------------- ceilings


def ceilings(run: Run, nbytes: int) -> None:
    """Copy (read + write) and read bandwidth, GB/s, as `bench_kernels.py` measures them."""
    for name, measure in (("copy", bk.measure_copy_gbps), ("read", bk.measure_read_gbps)):
        try:
            gbps = measure(run.iters, nbytes)
        except Exception as e:  # noqa: BLE001 - reported, the sweeps still run
            run.emit(kind="ceiling", name=name, error=bk.short_error(e))
            continue
        run.emit(kind="ceiling", name=name, gbps=gbps)
        bk.log(f"ceiling {name}: {gbps:.0f} GB/s")


# ---------------------------------------------------------------- decode


def decode_cases(dry_run: bool):
    D = bk.DecodeCase
    if dry_run:
        case = D(2, 1024, num_heads=4, num_kv_heads=1, head_dim=32)  # default: 2 splits
        return [(case, [dict(num_splits=1)], 1)]

    def grid(block_kvs, splits, stages=(2, 3, 4), warps=(4,)):
        return [
            dict(block_kv=b, num_splits=s, num_stages=st, num_warps=w)
            for b, s, st, w in itertools.product(block_kvs, splits, stages, warps)
        ]

    return [
        (D(32, 4096), grid((64, 128), (2, 4, 8)) + grid((32,), (4, 8), (3, 5)), 4),
        (D(32, 4096, page_size=64), grid((64, 128), (4,)), 1),
        (D(8, 8192), grid((64, 128), (8, 16, 32), (3, 4)), 1),
        (D(1, 32768), grid((64, 128), (32, 64, 128), (3, 4)), 1),
        (D(128, 2048), grid((64, 128), (1, 2)), 1),
        (D(256, 512), grid((64, 128), (1, 2)), 1),
        (D(32, 4096, kv_dtype="float8_e4m3fn"), grid((128, 256), (2, 4)), 1),
    ]


def time_merge(run: Run, case, splits: int) -> None:
    """The split-K merge alone (the one `paged_decode_gpu` runs after the kernel at this
    many splits), to see its share of a call."""
    sets = bk.random_partials(case, splits, 4)
    merge = partial(
        merge_partials,
        dtype=jnp.dtype(case.dtype),
        group=case.num_heads // case.num_kv_heads,
        block_h=case.tuning()["block_h"],
        interpret=run.interpret,
    )
    t = bk.time_calls(merge, sets, run.iters)
    run.emit(kind="merge", case=case.name, splits=splits, us=t * 1e6)
    bk.log(f"    split merge alone ({splits} splits): {t * 1e6:.1f} us")


def time_grid(run: Run, kind: str, case, kernel, arg_sets, configs, until: float, rate):
    """Times `kernel(*args, **config)` over `arg_sets` at its default knobs, then at each
    config until `until`, then at its default again (the two defaults' spread is the
    noise); emits one `kind` record each (a config that fails is recorded with its error).

    Args:
      rate: seconds -> (record key, value, unit) of the achieved rate.

    Returns:
      [(seconds, config)] of the configurations that ran; config None is the default.
    """
    results = []
    default_run = None  # compiled once, timed first and last
    for config in [None, *configs, None]:
        if config is not None and time.monotonic() > until:
            continue
        name = "default" if config is None else config
        try:
            if config is None and default_run is None:
                default_run = bk.compile_calls(kernel, arg_sets)
            if config is None:
                thunk = default_run
            else:
                thunk = bk.compile_calls(partial(kernel, **config), arg_sets)
            t = bk.time_run(thunk, len(arg_sets), run.iters)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported
            run.emit(kind=kind, case=case.name, config=name, error=bk.short_error(e))
            bk.log(f"    {name} failed: {bk.short_error(e)}")
            continue
        key, value, unit = rate(t)
        results.append((t, config))
        run.emit(kind=kind, case=case.name, config=name, us=t * 1e6, **{key: value})
        bk.log(f"    {name}: {t * 1e6:.1f} us  {value:.1f} {unit}")
    return results


def decode_sweep(run: Run, case, configs, until: float) -> None:
    copies = 2 if run.interpret else bk.rotating_copies(case.kv_bytes)
    calls = copies * math.ceil(
        min(bk.CALLS[1], max(bk.CALLS[0], bk.RUN_BYTES / case.kv_bytes)) / copies
    )
    if run.interpret:
        calls = copies
    inputs = [bk.make_decode_inputs(case, seed) for seed in range(copies)]
    full = jnp.full((case.batch,), case.seq_len, jnp.int32)
    q0 = inputs[0][0]
    qs = [jax.random.normal(jax.random.key(100 + i), q0.shape, q0.dtype) for i in range(calls)]
    sets = [(qs[i], *inputs[i % copies][1:3], full, inputs[i % copies][3]) for i in range(calls)]
    kernel = partial(paged_decode_gpu, interpret=run.interpret)
    default = case.tuning()
    bk.log(f"decode {case.name}: default {default}")
    if default["num_splits"] > 1:
        time_merge(run, case, default["num_splits"])
    rate = lambda t: ("gbps", case.kv_bytes / t / 1e9, "GB/s")  # noqa: E731
    results = time_grid(run, "decode", case, kernel, sets, configs, until, rate)
    if not results:
        return
    t, best = min(results, key=lambda r: r[0])
    # The fastest configuration must still be right: against the reference on ragged lengths.
    q, k, v, pt = inputs[0]
    lengths = bk.ragged_lengths(case, 1)
    rows = np.unique(np.linspace(0, case.batch - 1, min(case.batch, 8)).astype(int))
    f32 = jnp.float32
    ref = jax.jit(reference.paged_attention_xla)(
        q[rows].astype(f32), k.astype(f32), v.astype(f32), lengths[rows], pt[rows]
    )
    out = kernel(q, k, v, lengths, pt, **(best or {}))[rows]
    err = bk.rel_error(out, ref)
    defaults = [r[0] for r in results if r[1] is None]
    run.emit(
        kind="decode_best",
        case=case.name,
        config=best or "default",
        us=t * 1e6,
        gbps=case.kv_bytes / t / 1e9,
        default_us=[d * 1e6 for d in defaults],
        default_tuning=default,
        err=err,
        ok=bool(err <= bk._tolerance(case)),
    )


# ---------------------------------------------------------------- ragged


def ragged_cases(dry_run: bool):
    if dry_run:
        # A fresh prefill, as the real sweep's second case: one q_len, so the reference
        # check is one group (the mixed tiny case's four groups compile ~3x the programs).
        (case,) = [c for c in rc.cases(gpu=False) if c.name == "tiny fresh prefill"]
        return [(case, [dict(block_q=4, block_kv=16)], 1)]
    # The page ids carried one block ahead first (the defaults' knobs; then 64-token KV
    # tiles, which Triton 3.9 builds for sm90 without register spills, at 3 and 4
    # stages), then the grid.
    prefetch = [
        dict(prefetch_rows=True),
        dict(prefetch_rows=True, block_kv=64),
        dict(prefetch_rows=True, block_kv=64, num_stages=4),
    ]
    grid = prefetch + [
        dict(block_q=bq, block_kv=bkv, num_warps=w, num_stages=st)
        for bq, bkv, w, st in itertools.product((16, 32, 8), (64, 128, 32), (8, 4), (2, 3))
    ]
    by_name = {c.name: c for c in rc.cases(gpu=True)}
    return [
        (by_name["chunk 512 over 4096, 8 seqs"], grid, 1.5),
        (by_name["fresh prefill 2048, 4 seqs"], grid, 1.5),
    ]


def ragged_sweep(run: Run, case, configs, until: float) -> None:
    copies = 2 if run.interpret else bk.rotating_copies(case.kv_bytes)
    sets = [rc.make_inputs(case, jax.random.key(seed)) for seed in range(copies)]
    calls = copies if run.interpret else copies * math.ceil(4 / copies)
    arg_sets = [rc.arrays(sets[i % copies]) for i in range(calls)]
    kernel = partial(ragged_paged_attention_gpu, interpret=run.interpret)
    nflops = rc.flops(case)
    bk.log(f"ragged {case.name}")
    rate = lambda t: ("tflops", nflops / t / 1e12, "TFLOP/s")  # noqa: E731
    results = time_grid(run, "ragged", case, kernel, arg_sets, configs, until, rate)
    if not results:
        return
    t, best = min(results, key=lambda r: r[0])
    ref = rc.run_reference(sets[0])
    err = rc.rel_error(kernel(*rc.arrays(sets[0]), **(best or {})), ref)
    run.emit(
        kind="ragged_best",
        case=case.name,
        config=best or "default",
        us=t * 1e6,
        tflops=nflops / t / 1e12,
        default_us=[r[0] * 1e6 for r in results if r[1] is None],
        err=err,
        ok=bool(err <= rc.tolerance(case)),
    )


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write DIR/tune.jsonl")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping after this")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per measurement")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, Pallas interpreter")
    parser.add_argument("--skip-ceilings", action="store_true")
    args = parser.parse_args(argv)
    if not args.dry_run and jax.default_backend() != "gpu":
        parser.error("timing needs a CUDA GPU; use --dry-run to check the plumbing on a CPU")
    run = Run(args)
    device = jax.devices()[0]
    run.emit(kind="meta", jax=jax.__version__, device=getattr(device, "device_kind", "?"))
    if not args.skip_ceilings:
        ceilings(run, 2**20 if args.dry_run else GIB)
    sweeps = [(decode_sweep, *c) for c in decode_cases(args.dry_run)]
    sweeps += [(ragged_sweep, *c) for c in ragged_cases(args.dry_run)]
    weights_left = sum(weight for *_, weight in sweeps)
    for sweep, case, configs, weight in sweeps:
        until = run.share(weight, weights_left)
        weights_left -= weight
        try:
            sweep(run, case, configs, until)
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            run.emit(kind="error", case=case.name, error=bk.short_error(e))
            bk.log(f"{case.name} failed: {bk.short_error(e)}")
    print("\nbest per case (us; default first/last run)")
    ok = True
    for r in run.records:
        if r["kind"] in ("decode_best", "ragged_best"):
            ok &= r["ok"]
            defaults = "/".join(f"{d:.1f}" for d in r["default_us"])
            line = f"{r['us']:8.1f} (default {defaults}) err {r['err']:.1e} {r['config']}"
            print(f"  {r['case']:32} {line}")
        elif r["kind"] == "ceiling" and "gbps" in r:
            print(f"  ceiling {r['name']:24} {r['gbps']:8.0f} GB/s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
