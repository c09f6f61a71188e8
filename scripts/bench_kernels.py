"""Benchmarks the paged attention kernels: correctness on the device, then timing.

    python scripts/bench_kernels.py            # full run (about 5 minutes on an H200)
    python scripts/bench_kernels.py --quick    # fewer iterations, no tuning sweeps
    python scripts/bench_kernels.py --json     # the same results as JSON on stdout
    python scripts/bench_kernels.py --out DIR  # also stream rows to DIR/bench_kernels.jsonl

On a CUDA GPU it

1. measures the device's ceilings in the same run: copy bandwidth (bytes read
   plus written by an elementwise op and an XLA copy over 1 GiB arrays, the
   better of the two), read bandwidth (a reduction) and bf16 matmul throughput;
2. per case, checks every kernel against `pallas_kernels.reference` on the GPU
   (ragged random lengths, shuffled page tables; the reference runs on up to 8
   of the sequences, spread over the batch);
3. times our Pallas kernel (default tuning, plus a small sweep of its knobs),
   JAX's bundled `jax.experimental.pallas.ops.gpu.paged_attention` (its best of a
   sweep of `k_splits` and `pages_per_compute_block`), and a dense XLA decode over
   contiguous K/V of the same bytes. L2 is kept cold by rotating among enough
   copies of the cache to exceed 3x the L2 size, each timed run is one jitted
   executable of several calls (distinct queries, so nothing is deduplicated),
   and a time is the median over `--iters` runs divided by the calls;
4. times ours, the best bundled configuration, dense, the fastest of our sweep,
   ours with one K/V buffer (2 stages) and the copy ceiling once more, in
   `--iters` interleaved rounds (`time_rounds`): these are the reported figures,
   and the ratios (x bundled, paged/dense, of copy) are medians of per-round
   ratios. The device drifts within a run (the same kernel 10% apart minutes
   later on the H200), so only figures from the same rounds are compared.

One decode row has an FP8 KV cache (`float8_e4m3fn` pages, bf16 queries): its
GB/s and fraction of copy bandwidth count the fp8 bytes actually read, its dense
baseline upcasts the fp8 K/V in XLA, and JAX's bundled kernel has no fp8 path
("n/a").

With `--out DIR`, DIR/bench_kernels.jsonl gets a "meta" line (jax version, device,
copy bandwidth, matmul TFLOP/s) before the first case, one "row" line per result
row as soon as it is complete, and an "end" line (ok, wall time), each flushed: a
run killed by a timeout keeps every finished row. A case that raises (compile
error, out of memory) becomes a failed row with the error text, and the run goes
on with the next case.

Without a GPU it runs the correctness part in the Pallas interpreter on small
shapes, fp8 pages included (our kernel, the TPU kernel if
`pallas_kernels.paged_decode.tpu` imports, JAX's bundled kernel unless --quick
or the pages are fp8) and says that timing needs a GPU.

Case families: `main()` runs every `Family` in `FAMILIES`. A family is a name, a
function `run(env) -> Iterable[dict]` of result rows (a generator, so that each row
is streamed to --out when it is complete) and the columns to print; it can
live in another module and reuse `BenchEnv`, `time_calls`, `time_rounds`,
`rel_error` and `rotating_copies` from here.

Modules beside this one, their names re-exported here: `bench_harness.py` (timing,
the device's ceilings, reporting) and `bench_paged_decode_cases.py` (the decode
family's shapes, inputs, baselines and sweeps); this script keeps the decode family's
checks and timings, and `main`.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
import traceback
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference
from pallas_kernels.paged_decode.gpu import paged_decode_gpu
from pallas_kernels.paged_decode.gpu_merge import merge_partials, merge_splits

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this one
# The harness and the decode cases, re-exported: the other scripts and the tests use
# them as bench_kernels.<name> (and the tests patch them there, where the runners below
# look them up).
from bench_harness import (  # noqa: E402, F401
    GIB,
    WARMUP_S,
    BenchEnv,
    Family,
    JsonLines,
    compile_calls,
    json_text,
    log,
    measure_copy,
    measure_copy_gbps,
    measure_matmul_tflops,
    measure_read_gbps,
    paired_ratio,
    print_table,
    rel_error,
    short_error,
    time_calls,
    time_rounds,
    time_run,
)
from bench_paged_decode_cases import (  # noqa: E402, F401
    CPU_DECODE_CASES,
    GPU_DECODE_CASES,
    QUICK_CPU_CASES,
    DecodeCase,
    _tolerance,
    bundled_configs,
    bundled_kernel,
    bundled_sweep,
    dense_decode,
    make_decode_inputs,
    ours_sweep,
    ragged_lengths,
    random_partials,
    run_bundled,
    to_dense,
)

L2_BYTES = 50 * 2**20  # H100/H200 L2; caches rotate over >= 3x this
CALLS = (4, 16)  # kernel calls per timed executable: at least, at most
RUN_BYTES = 4 * GIB  # K/V read per timed executable (within CALLS): launch and sync overhead
#                      is then ~1-2% of a run
MERGE_CALLS = 32  # merges per timed run: a merge alone reads little


def rotating_copies(nbytes: int) -> int:
    """Copies of an `nbytes` working set to rotate among so that L2 stays cold."""
    return max(2, math.ceil(3 * L2_BYTES / max(nbytes, 1)))


# ---------------------------------------------------------------- decode family


def _check(name, fn, ref, rows, tol, errors) -> bool:
    """Runs `fn()`, stores its error vs `ref` (on `rows`) or its failure in `errors[name]`."""
    try:
        err = rel_error(jax.block_until_ready(fn())[rows], ref)
        errors[name] = err
        if not err <= tol:
            log(f"    {name}: relative error {err:.2e} > {tol:g}")
        return err <= tol
    except Exception as e:  # noqa: BLE001 - reported in the row
        errors[name] = short_error(e)
        log(f"    {name} failed: {errors[name]}")
        return False


def check_decode_gpu(case: DecodeCase, inputs, row: dict):
    """(a) Ours and dense vs the reference on the device, with ragged lengths.

    Returns:
      (ok, lengths, rows, ref): the verdict, and what the bundled kernel's check reuses.
    """
    q, k, v, pt = inputs
    lengths = ragged_lengths(case, 0)
    rows = np.unique(np.linspace(0, case.batch - 1, min(case.batch, 8)).astype(int))
    f32 = jnp.float32
    ref = jax.jit(reference.paged_attention_xla)(
        q[rows].astype(f32), k.astype(f32), v.astype(f32), lengths[rows], pt[rows]
    )
    errors = {}
    tol = _tolerance(case)
    ok = _check("ours", partial(paged_decode_gpu, q, k, v, lengths, pt), ref, rows, tol, errors)
    dense = jax.jit(lambda q, k, v, pt, n: dense_decode(q, to_dense(k, pt), to_dense(v, pt), n))
    ok &= _check("dense", partial(dense, q, k, v, pt, lengths), ref, rows, tol, errors)
    row.update({f"err_{name}": err for name, err in errors.items()})
    return ok, lengths, rows, ref


def decode_case_gpu(case: DecodeCase, env: BenchEnv, sweep_until: float) -> dict:
    """One case on the GPU: checks, then timings; sweeps stop at `sweep_until`."""
    row = dict(case=case.name, kv_mb=case.kv_bytes / 2**20, tuning=case.tuning())
    copies = rotating_copies(case.kv_bytes)
    calls = copies * math.ceil(min(CALLS[1], max(CALLS[0], RUN_BYTES / case.kv_bytes)) / copies)
    inputs = [make_decode_inputs(case, seed) for seed in range(copies)]
    row["ok"], lengths, rows, ref = check_decode_gpu(case, inputs[0], row)

    # (c) Timing: full lengths, rotating caches, a distinct query per call.
    full = jnp.full((case.batch,), case.seq_len, jnp.int32)
    q0 = inputs[0][0]
    qs = [jax.random.normal(jax.random.key(100 + i), q0.shape, q0.dtype) for i in range(calls)]
    paged = []  # (q, k_pages, v_pages, lengths, page_table) per call
    for i in range(calls):
        _, k, v, pt = inputs[i % copies]
        paged.append((qs[i], k, v, full, pt))

    runs = {}  # name -> (thunk, calls): the compiled runs the head-to-head compares

    def timed(name, fn, sets, sweep=False, keep=None):
        """Median seconds per call, or None; failures go into the row (a sweep's as notes).
        The compiled run is kept as runs[keep] when `keep` is given."""
        try:
            run = compile_calls(fn, sets)
            t = time_run(run, len(sets), env.iters)
        except Exception as e:  # noqa: BLE001 - reported in the row
            if sweep:  # one configuration of a sweep: not a failure of the kernel
                row.setdefault("failed_configs", []).append(f"{name}: {short_error(e)}")
            else:
                row.setdefault(f"error_{name.split()[0]}", short_error(e))
            log(f"    {name} failed: {short_error(e)}")
            return None
        if keep:
            runs[keep] = (run, len(sets))
        log(f"    {name}: {t * 1e6:.1f} us")
        return t

    t_ours = timed("ours", paged_decode_gpu, paged, keep="ours")
    if t_ours:
        row.update(ours_us=t_ours * 1e6, ours_gbps=case.kv_bytes / t_ours / 1e9)
        if env.copy_gbps:
            row["ours_frac_copy"] = row["ours_gbps"] / env.copy_gbps

    splits = case.tuning()["num_splits"]
    if t_ours and splits > 1 and not env.quick:
        # The merge the default runs after the kernel, and XLA's fusions of the same
        # jnp ops (what ran before 2026-11-30), alone on random partials.
        sets = random_partials(case, splits, MERGE_CALLS)
        group, block_h = case.num_heads // case.num_kv_heads, case.tuning()["block_h"]
        dtype = jnp.dtype(case.dtype)
        picked = partial(merge_partials, dtype=dtype, group=group, block_h=block_h)
        timed("merge", picked, sets, keep="merge")
        timed("merge_xla", partial(merge_splits, dtype=dtype), sets, keep="merge_xla")
        del sets

    dense = [(to_dense(k, pt), to_dense(v, pt)) for _, k, v, pt in inputs]
    dense_sets = [(q, *dense[i % copies], full) for i, q in enumerate(qs)]
    t_dense = timed("dense", dense_decode, dense_sets, keep="dense")
    del dense, dense_sets
    if t_dense:
        row["dense_us"] = t_dense * 1e6
        if t_ours:
            row["paged_over_dense"] = t_ours / t_dense

    fn, why = bundled_kernel()
    if case.page_dtype != case.dtype:
        row["bundled_us"] = "n/a"  # JAX's bundled kernel has no fp8 (mixed-dtype) path
    elif fn is None:
        row["error_bundled"] = f"missing: {why}"
    else:
        best = None
        for stage in range(3):
            for config in bundled_sweep(case, stage, best and best[1], env.quick):
                if best and (time.monotonic() > sweep_until or config == best[1]):
                    continue
                run = partial(run_bundled, fn, **config)
                t = timed(f"bundled {config}", run, paged, sweep=True, keep="candidate")
                if t and (best is None or t < best[0]):
                    best = (t, config)
                    runs["bundled"] = runs["candidate"]
                runs.pop("candidate", None)
        if best is None:
            row["error_bundled"] = "every configuration failed (see failed_configs)"
        else:
            row.update(bundled_us=best[0] * 1e6, bundled_cfg=best[1])
            if t_ours:
                row["speedup_vs_bundled"] = best[0] / t_ours
            q, k, v, pt = inputs[0]
            run = partial(run_bundled, fn, q, k, v, lengths, pt, **best[1])
            errors = {}
            _check("bundled", run, ref, rows, _tolerance(case), errors)
            row["err_bundled"] = errors["bundled"]

    if not env.quick and t_ours:
        best = (t_ours, "default")
        swept = row["ours_sweep_us"] = {}
        for alt in ours_sweep(case):
            if time.monotonic() > sweep_until:
                break
            fn = partial(paged_decode_gpu, **alt)
            t = timed(f"ours {alt}", fn, paged, sweep=True, keep="candidate")
            if t:
                swept[", ".join(f"{k}={v}" for k, v in alt.items())] = t * 1e6
            if t and t < best[0]:
                best = (t, alt)
                runs["ours_alt"] = runs["candidate"]
            if t and alt == dict(num_stages=2):  # one K/V buffer: what carrying the ids gained
                runs["ours_1buf"] = runs["candidate"]
            runs.pop("candidate", None)
        row.update(ours_best_us=best[0] * 1e6, ours_best_cfg=best[1])
    if t_ours and not env.quick:
        head_to_head(case, env, runs, row)
    return row


def head_to_head(case: DecodeCase, env: BenchEnv, runs: dict, row: dict) -> None:
    """Ours, the best bundled configuration, dense, our best alternative, the two
    merges (when the default splits) and the copy ceiling, timed again in interleaved
    rounds (`time_rounds`): the row's reported
    figures. The separate timings above only chose the configurations (they drift
    apart by up to 10% within a run on the H200)."""
    if env.copy_run:
        thunk, calls, moved = env.copy_run
        runs = {**runs, "copy": (thunk, calls)}
    times = time_rounds(runs, env.iters)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    first = row["ours_us"]
    row.update(ours_first_us=first, ours_us=med["ours"] * 1e6, h2h_rounds=env.iters)
    row["ours_gbps"] = case.kv_bytes / med["ours"] / 1e9
    if "copy" in times:
        # Both in the same rounds: the fraction is a paired ratio too.
        row["copy_gbps_h2h"] = moved / med["copy"] / 1e9
        row["ours_frac_copy"] = case.kv_bytes / moved / paired_ratio(times["ours"], times["copy"])
    if "dense" in times:
        row["dense_us"] = med["dense"] * 1e6
        row["paged_over_dense"] = paired_ratio(times["ours"], times["dense"])
    if "bundled" in times:
        row["bundled_us"] = med["bundled"] * 1e6
        row["speedup_vs_bundled"] = paired_ratio(times["bundled"], times["ours"])
    if "ours_alt" in times:
        row["ours_best_us"] = med["ours_alt"] * 1e6
        row["alt_over_default"] = paired_ratio(times["ours_alt"], times["ours"])
    else:
        row["ours_best_us"] = row["ours_us"]
    if "ours_1buf" in times:
        row["one_buffer_over_default"] = paired_ratio(times["ours_1buf"], times["ours"])
    if "merge" in times and "merge_xla" in times:
        row.update(merge_us=med["merge"] * 1e6, merge_xla_us=med["merge_xla"] * 1e6)
        row["merge_over_xla"] = paired_ratio(times["merge"], times["merge_xla"])
    spread = sorted(times["ours"])
    row["ours_iqr_us"] = [spread[len(spread) // 4] * 1e6, spread[(3 * len(spread)) // 4] * 1e6]
    log(
        "    head-to-head: "
        + ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in med.items())
        + f" ({env.iters} rounds)"
    )


def decode_cases_cpu(env: BenchEnv) -> Iterable[dict]:
    """Correctness only, in the Pallas interpreter, on small shapes."""
    kernels = {"ours": lambda *a: paged_decode_gpu(*a, interpret=True)}
    notes = {}
    try:
        tpu = importlib.import_module("pallas_kernels.paged_decode.tpu")
        kernels["tpu"] = lambda *a: tpu.paged_decode_tpu(*a, interpret=True)
    except Exception as e:  # noqa: BLE001 - the TPU kernel is optional here
        notes["err_tpu"] = f"not importable: {short_error(e)}"
    if not env.quick:
        fn, why = bundled_kernel()
        if fn is None:
            notes["error_bundled"] = f"missing: {why}"
        else:
            kernels["bundled"] = lambda *a: run_bundled(
                fn, *a, interpret=True, k_splits=1, pages_per_compute_block=1
            )
    for case in CPU_DECODE_CASES[:QUICK_CPU_CASES] if env.quick else CPU_DECODE_CASES:
        q, k, v, pt = make_decode_inputs(case, 0)
        lengths = ragged_lengths(case, 0)
        f32 = jnp.float32
        ref = jax.jit(reference.paged_attention_xla)(
            q.astype(f32), k.astype(f32), v.astype(f32), lengths, pt
        )
        args = (q, k, v, lengths, pt)
        errors, ok = {}, True
        tol = _tolerance(case)
        for name, kernel in kernels.items():
            if name == "bundled" and case.page_dtype != case.dtype:
                continue  # no fp8 path
            log(f"  {case.name}: {name} (interpret)")
            passed = _check(name, partial(kernel, *args), ref, slice(None), tol, errors)
            ok &= passed or name == "bundled"  # JAX's kernel is reported, not ours to fix
        dense = partial(jax.jit(dense_decode), q, to_dense(k, pt), to_dense(v, pt), lengths)
        ok &= _check("dense", dense, ref, slice(None), tol, errors)
        yield dict(case=case.name, **notes, **{f"err_{n}": e for n, e in errors.items()}, ok=ok)


def run_decode(env: BenchEnv) -> Iterable[dict]:
    if not env.on_gpu:
        yield from decode_cases_cpu(env)
        return
    for i, case in enumerate(GPU_DECODE_CASES):
        log(f"decode {case.name} ({case.kv_bytes / 2**20:.0f} MiB of K/V)")
        # Each case may sweep until its share of the time left is used up.
        sweep_until = time.monotonic() + env.time_left() / (len(GPU_DECODE_CASES) - i)
        try:
            row = decode_case_gpu(case, env, sweep_until)
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            traceback.print_exc(file=sys.stderr)
            row = dict(case=case.name, ok=False, error=short_error(e))
        yield row


DECODE = Family(
    name="decode",
    run=run_decode,
    columns=(
        ("case", "case", ""),
        ("ours_us", "ours us", ".1f"),
        ("ours_gbps", "GB/s", ".0f"),
        ("ours_frac_copy", "of copy", ".2f"),
        ("bundled_us", "bundled us", ".1f"),
        ("speedup_vs_bundled", "x bundled", ".2f"),
        ("dense_us", "dense us", ".1f"),
        ("paged_over_dense", "paged/dense", ".2f"),
        ("ours_best_us", "best us", ".1f"),
        ("one_buffer_over_default", "1buf/def", ".2f"),
        ("merge_us", "merge us", ".1f"),
        ("merge_xla_us", "xla merge us", ".1f"),
        ("err_ours", "err ours", ".1e"),
        ("err_bundled", "err bundled", ".1e"),
        ("err_dense", "err dense", ".1e"),
        ("err_tpu", "err tpu", ".1e"),
        ("ok", "ok", ""),
    ),
    details=("tuning", "ours_best_cfg", "bundled_cfg", "ours_iqr_us", "failed_configs"),
)


def _ragged_family() -> Family:
    # Imported lazily because bench_ragged_cases imports this module back.
    import bench_ragged_cases

    return Family("ragged", bench_ragged_cases.run_family, bench_ragged_cases.COLUMNS)


# Add families here (a family may live in another module: import it and append it).
FAMILIES = [DECODE]


# ---------------------------------------------------------------- main


def ceiling(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def has_gpu() -> bool:
    return jax.default_backend() == "gpu"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--iters", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, no sweeps")
    parser.add_argument(
        "--budget-s", type=float, default=210.0, help="seconds after which tuning sweeps stop"
    )
    parser.add_argument(
        "--interpret", action="store_true", help="run the CPU (interpret-mode) path even on a GPU"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="append each finished row to DIR/bench_kernels.jsonl (meta line first)",
    )
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    return args


def main(argv=None, families=None) -> int:
    args = parse_args(argv)
    families = FAMILIES + [_ragged_family()] if families is None else families
    on_gpu = has_gpu() and not args.interpret
    device = jax.devices()[0]
    env = BenchEnv(
        on_gpu=on_gpu,
        quick=args.quick,
        iters=args.iters or (10 if args.quick else 30),
        deadline=time.monotonic() + args.budget_s,
        device=getattr(device, "device_kind", str(device)),
    )
    t0 = time.monotonic()
    sink = JsonLines(args.out / "bench_kernels.jsonl") if args.out else None
    meta = dict(jax_version=jax.__version__, device=env.device, platform=jax.default_backend())
    if on_gpu:
        ceilings = [
            (("copy_gbps", "copy_run"), measure_copy),
            (("read_gbps",), measure_read_gbps),
            (("matmul_tflops",), measure_matmul_tflops),
        ]
        for names, measure in ceilings:
            try:
                values = measure(env.iters)
                for name, value in zip(names, values if len(names) > 1 else (values,), strict=True):
                    setattr(env, name, value)
            except Exception as e:  # noqa: BLE001 - the cases still run, without ratios
                meta[f"error_{names[0]}"] = short_error(e)
                log(f"measuring {names[0]} failed: {short_error(e)}")
        log(
            f"copy {ceiling(env.copy_gbps)} GB/s, read {ceiling(env.read_gbps)} GB/s, "
            f"bf16 matmul {ceiling(env.matmul_tflops)} TFLOP/s"
        )
    meta.update(
        copy_gbps=env.copy_gbps,
        read_gbps=env.read_gbps,
        matmul_tflops=env.matmul_tflops,
        timed=on_gpu,
    )
    if not on_gpu:
        meta["note"] = "correctness only (Pallas interpreter); timing needs a CUDA GPU"
    if sink:
        sink.write(dict(kind="meta", **meta))
    results = {}
    for family in families:
        rows = results[family.name] = []
        try:
            for row in family.run(env):
                rows.append(row)
                if sink:
                    sink.write(dict(kind="row", family=family.name, **row))
        except Exception as e:  # noqa: BLE001 - a broken family must not hide the others
            traceback.print_exc(file=sys.stderr)
            row = dict(case=f"{family.name} (family)", ok=False, error=short_error(e))
            rows.append(row)
            if sink:
                sink.write(dict(kind="row", family=family.name, **row))
    ok = all(row.get("ok", True) for rows in results.values() for row in rows)
    meta["ok"] = ok
    if sink:
        sink.write(dict(kind="end", ok=ok, wall_s=round(time.monotonic() - t0, 1)))
    if args.json:
        print(json_text(dict(meta, results=results), indent=1))
    else:
        print(f"jax {meta['jax_version']} on {meta['device']} ({meta['platform']})")
        if on_gpu:
            print(
                f"copy bandwidth {ceiling(env.copy_gbps)} GB/s, "
                f"read {ceiling(env.read_gbps)} GB/s, "
                f"bf16 matmul {ceiling(env.matmul_tflops)} TFLOP/s"
            )
        for family in families:
            rows = results[family.name]
            present = [c for c in family.columns if any(c[0] in r for r in rows)]
            print_table(family.name, rows, present)
            for row in rows:
                failures = [k for k in row if k.startswith("err") and isinstance(row[k], str)]
                for key in [*family.details, *sorted(failures)]:
                    if key in row:
                        print(f"  {row['case']}: {key}: {row[key]}")
        if not on_gpu:
            print(f"\n{meta['note']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
