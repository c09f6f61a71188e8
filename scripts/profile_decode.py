"""Where the time of one paged-decode shape goes: leave-one-out timings, and `ncu`.

    python scripts/profile_decode.py [--batch 32 --seq-len 4096 --page-size 16]  # GPU
    python scripts/profile_decode.py --out DIR       # also DIR/profile_decode.jsonl
    python scripts/profile_decode.py --dry-run       # tiny shape, Pallas interpreter
    python scripts/profile_decode.py --device-times  # also each kernel's device time
    ncu --clock-control none -k regex:paged_decode_gpu --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight ... python scripts/profile_decode.py --ncu   # one launch

`bench_kernels.py` says how fast our kernel is; this script says where a call's
time goes, without hardware counters, by timing variants that leave one part out
(each at the default knobs of `default_tuning`, cold L2), all compiled first and
then timed in interleaved rounds (`bench_kernels.time_rounds`) together with the
read and copy ceilings, so that drift of the device moves them alike; ratios are
medians of per-round ratios:

  default       the public path: the kernel and, when it splits, the merge
  kernel        the kernel alone (the split partials, no merge)
  merge         the merge alone (`merge_partials`, the one Pallas launch the public
                path runs: `merge_splits_gpu` up to 8 splits, `merge_splits_wide`
                beyond), on random partials of the default's shape
  merge_xla     the same merge as jnp ops (`merge_splits`, several XLA fusions: what
                the public path ran before 2026-11-30)
  one_split     the default's tiles without split-K
  one_buffer    the default at 2 stages: Triton keeps one K/V buffer, so each
                program requests its next tile only after using the current one
  contiguous    the default over an identity page table: each sequence's pages
                adjacent, so default - contiguous is what scattered pages cost
  fixed_cost    every length 1: launch, per-program set-up, q in, out, merge
  dense_xla     XLA's decode attention over contiguous K/V of the same bytes

beside the device's measured read and copy bandwidth. GB/s counts the K/V bytes of
the whole cache for every variant that reads it. `--ncu` instead runs the default
path a few times for Nsight Compute (scripts/device_check.sh's profile stage).

`--device-times` then runs the default, kernel, one_split, one_buffer, dense_xla
and copy runs again under JAX's profiler (`device_timing.device_times`, 5 runs
each) and reports, per call, the device's busy time (the sum of its kernels'
durations), the idle gaps between kernels within a run, the span (busy + gaps:
what a call costs on the device; the host timing above adds dispatch and sync),
and each kernel's share: one "device" record per variant and a table. In a dry
run it reads the events of the "/host:CPU" plane, one run of the two merges: the
plumbing only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402 - scripts/ is not a package
import device_timing as dt  # noqa: E402

from pallas_kernels import reference  # noqa: E402
from pallas_kernels.paged_decode.gpu import (  # noqa: E402
    decode_partials,
    merge_partials,
    merge_splits,
    paged_decode_gpu,
)

NCU_CALLS = 6  # --ncu: launches of the default path (profile one after the warm-ups)
SMALL_CALLS = 32  # calls per timed run of the variants that read little (merge, fixed cost)
DEVICE_VARIANTS = (
    "default",
    "kernel",
    "merge",
    "merge_xla",
    "one_split",
    "one_buffer",
    "dense_xla",
    "copy",
)
DEVICE_RUNS = 5  # --device-times: traced runs per variant
TOP_KERNELS = 3  # --device-times: kernels named per variant in the table


def kernel_args(case: bk.DecodeCase) -> dict:
    """Every static argument of `decode_partials` for the case, at the default knobs."""
    return dict(scale=case.head_dim**-0.5, soft_cap=None, sliding_window=None, **case.tuning())


def variants(case: bk.DecodeCase, interpret: bool, copies: int, calls: int, small: int):
    """(name, fn, arg sets, reads the whole cache) of each variant, built lazily.
    The variants that read little (merge, fixed cost) get `small` calls per run, so a
    run outlasts its launch and sync; every call of a run has distinct inputs."""
    tuning = case.tuning()
    splits = tuning["num_splits"]
    static = kernel_args(case)
    inputs = [bk.make_decode_inputs(case, seed) for seed in range(copies)]
    full = jnp.full((case.batch,), case.seq_len, jnp.int32)
    ones = jnp.ones((case.batch,), jnp.int32)
    identity = jnp.arange(case.batch * case.max_pages, dtype=jnp.int32).reshape(case.batch, -1)
    q0 = inputs[0][0]
    n = max(calls, small)
    qs = [jax.random.normal(jax.random.key(100 + i), q0.shape, q0.dtype) for i in range(n)]

    def sets(lengths, table=None, count=calls):
        out = []
        for i, q in enumerate(qs[:count]):
            _, k, v, pt = inputs[i % copies]
            out.append((q, k, v, lengths, pt if table is None else table))
        return out

    public = partial(paged_decode_gpu, interpret=interpret)
    kernel = partial(decode_partials, interpret=interpret, **static)
    yield "default", public, sets(full), True
    yield "kernel", kernel, sets(full), True
    if splits > 1:
        dtype = jnp.dtype(case.dtype)
        group = case.num_heads // case.num_kv_heads
        partials = bk.random_partials(case, splits, small)
        merge = partial(merge_partials, dtype=dtype, group=group, interpret=interpret)
        yield "merge", partial(merge, block_h=tuning["block_h"]), partials, False
        yield "merge_xla", partial(merge_splits, dtype=dtype), partials, False
        one = partial(paged_decode_gpu, interpret=interpret, **{**tuning, "num_splits": 1})
        yield "one_split", one, sets(full), True
    yield "one_buffer", partial(public, num_stages=2), sets(full), True
    yield "contiguous", public, sets(full, identity), True
    yield "fixed_cost", public, sets(ones, count=small), False
    dense = [(bk.to_dense(k, pt), bk.to_dense(v, pt)) for _, k, v, pt in inputs]
    yield (
        "dense_xla",
        bk.dense_decode,
        [(q, *dense[i % copies], full) for i, q in enumerate(qs[:calls])],
        True,
    )


def check(case: bk.DecodeCase, interpret: bool) -> dict:
    """The default path and the partials + merge vs the float32 reference, on random
    lengths; the identity table too. Returns {name: relative error}."""
    q, k, v, pt = bk.make_decode_inputs(case, 0)
    lengths = bk.ragged_lengths(case, 0)
    identity = jnp.arange(pt.size, dtype=jnp.int32).reshape(pt.shape)
    static = kernel_args(case)
    f32 = jnp.float32
    errors = {}
    for name, table in (("default", pt), ("contiguous", identity)):
        ref = jax.jit(reference.paged_attention_xla)(
            q.astype(f32), k.astype(f32), v.astype(f32), lengths, table
        )
        out = paged_decode_gpu(q, k, v, lengths, table, interpret=interpret)
        errors[name] = bk.rel_error(out, ref)
        if name == "default":
            part = decode_partials(q, k, v, lengths, table, interpret=interpret, **static)
            if static["num_splits"] > 1:  # the merge the public path picks
                group = case.num_heads // case.num_kv_heads
                merge = partial(merge_partials, *part, dtype=q.dtype, group=group)
                part = merge(block_h=static["block_h"], interpret=interpret)
            errors["kernel+merge"] = bk.rel_error(part, ref)
    return errors


def device_records(runs: dict, on_gpu: bool) -> list[dict]:
    """A "device" record (`device_timing.summarize`'s figures) per variant of
    `DEVICE_VARIANTS` in `runs`; on a CPU for two of them (the merges), from the host
    plane's events of one run each. A variant whose trace fails gets its error
    instead; the others still run."""
    names = DEVICE_VARIANTS
    if on_gpu:
        kw = dict(runs=DEVICE_RUNS)
    else:
        # Every line: XLA runs small executables on the caller's thread, whose line
        # also holds the host's own events (nested), so the CPU figures mean nothing;
        # two variants (the merges, the cheapest to trace) check the plumbing.
        kw = dict(runs=1, warmup=0, plane_prefix="/host:CPU")
        names = DEVICE_VARIANTS[2:4]
    records = []
    for name in (n for n in names if n in runs):
        thunk, calls = runs[name]
        try:
            summary = dt.device_times(thunk, calls, **kw)
        except Exception as e:  # noqa: BLE001 - keep the timings already measured
            bk.log(f"  {name}: device times failed: {e!r}")
            records.append(dict(kind="device", name=name, error=repr(e)))
            continue
        records.append(dict(kind="device", name=name, **summary))
    return records


def print_device_table(records: list[dict]) -> None:
    """The "device" records: busy and gap time per call and the top kernels."""
    rows = [r for r in records if r["kind"] == "device"]
    if not rows:
        return
    print("\ndevice time per call (jax.profiler): busy = kernels, gaps = idle within a run")
    print(f"{'variant':12} {'span us':>8} {'busy us':>8} {'gaps us':>8}  top kernels: us per call")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:12} {r['error']}")
            continue
        top = list(r["kernels"].items())[:TOP_KERNELS]
        names = "; ".join(f"{k[:40]} {v['us_per_call']:.1f}" for k, v in top)
        print(
            f"{r['name']:12} {r['span_us_per_call']:8.1f} {r['busy_us_per_call']:8.1f} "
            f"{r['gaps_us_per_call']:8.1f}  {names}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", default=None, help="page dtype, e.g. float8_e4m3fn")
    p.add_argument("--iters", type=int, default=30, help="timed runs per measurement")
    p.add_argument("--out", type=Path, default=None, help="write DIR/profile_decode.jsonl")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--ncu", action="store_true", help=f"run the default {NCU_CALLS} times")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, Pallas interpreter")
    p.add_argument(
        "--device-times", action="store_true", help="per-kernel device times (jax.profiler)"
    )
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not (on_gpu or args.dry_run):
        p.error("timing needs a CUDA GPU; use --dry-run to check the plumbing on a CPU")
    if args.dry_run:
        # Small enough for the interpreter, long enough to split (and merge).
        case = bk.DecodeCase(3, 1024, num_heads=4, num_kv_heads=1, head_dim=16)
        iters, copies, calls, small, nbytes = 1, 2, 2, 2, 2**20
    else:
        case = bk.DecodeCase(args.batch, args.seq_len, args.page_size, kv_dtype=args.kv_dtype)
        iters = args.iters
        copies = bk.rotating_copies(case.kv_bytes)
        calls = copies * max(1, math.ceil(bk.RUN_BYTES / case.kv_bytes / copies))
        small = SMALL_CALLS
        nbytes = bk.GIB
    interpret = not on_gpu
    bk.log(f"{case.name}: tuning {case.tuning()}, {case.kv_bytes / 2**20:.0f} MiB of K/V")

    if args.ncu:
        q, k, v, pt = bk.make_decode_inputs(case, 0)
        full = jnp.full((case.batch,), case.seq_len, jnp.int32)
        for _ in range(NCU_CALLS):
            jax.block_until_ready(paged_decode_gpu(q, k, v, full, pt, interpret=interpret))
        return 0

    records = [dict(kind="meta", case=case.name, jax=jax.__version__, tuning=case.tuning())]
    records[0]["device"] = getattr(jax.devices()[0], "device_kind", "?")
    errors = check(case, interpret)
    ok = all(e <= bk._tolerance(case) for e in errors.values())
    records.append(dict(kind="check", errors=errors, ok=ok))
    runs, whole = {}, {}
    for name, fn, sets, reads_all in variants(case, interpret, copies, calls, small):
        t0 = time.monotonic()
        runs[name] = (bk.compile_calls(fn, sets), len(sets))
        whole[name] = reads_all
        bk.log(f"  {name}: compiled ({time.monotonic() - t0:.0f} s)")
    del sets
    keys = jax.random.split(jax.random.key(8), 4)
    arrays = [(jax.random.normal(k, (nbytes // 4,), jnp.float32),) for k in keys]
    runs["read"] = (bk.compile_calls(jnp.sum, arrays), len(arrays))
    _, (copy_run, copy_calls, copied) = bk.measure_copy(iters, nbytes)
    runs["copy"] = (copy_run, copy_calls)
    times = bk.time_rounds(runs, iters)
    read = nbytes / statistics.median(times["read"]) / 1e9
    copy = copied / statistics.median(times["copy"]) / 1e9
    records.append(dict(kind="ceiling", read_gbps=read, copy_gbps=copy, rounds=iters))
    for name in whole:
        us = statistics.median(times[name]) * 1e6
        rec = dict(kind="variant", name=name, us=us)
        # Ratios are medians of per-round ratios (bk.time_rounds): drift cancels.
        if whole[name]:
            rec["gbps"] = case.kv_bytes / us / 1e3
            rec["frac_read"] = case.kv_bytes / nbytes / bk.paired_ratio(times[name], times["read"])
            rec["frac_copy"] = case.kv_bytes / copied / bk.paired_ratio(times[name], times["copy"])
        rec["of_default"] = bk.paired_ratio(times[name], times["default"])
        records.append(rec)
    if args.device_times:
        records += device_records(runs, on_gpu)

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        lines = "".join(bk.json_text(r) + "\n" for r in records)
        (args.out / "profile_decode.jsonl").write_text(lines)
    if args.json:
        print(bk.json_text(records, indent=1))
        return 0 if ok else 1
    print(f"\n{case.name}, {records[0]['device']}, jax {jax.__version__}")
    print(f"ceilings: read {read:,.0f} GB/s, copy {copy:,.0f} GB/s; checks {errors} ok={ok}")
    print(f"{'variant':12} {'us':>9} {'GB/s':>8} {'of read':>8} {'of copy':>8} {'of default':>10}")
    for r in records:
        if r["kind"] == "variant":
            cells = [f"{r[k]:.2f}" if k in r else "-" for k in ("frac_read", "frac_copy")]
            gbps = f"{r['gbps']:,.0f}" if "gbps" in r else "-"
            print(
                f"{r['name']:12} {r['us']:9.1f} {gbps:>8} {cells[0]:>8} {cells[1]:>8} "
                f"{r['of_default']:10.2f}"
            )
    print_device_table(records)
    if not on_gpu:
        print("(interpreter times on a CPU: the plumbing only, not a measurement)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
