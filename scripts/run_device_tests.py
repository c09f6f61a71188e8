"""Runs tests/test_gpu_device.py in parallel pytest processes that share the GPU.

    python scripts/run_device_tests.py [--shards 3] [--log-dir DIR] [-- PYTEST_ARGS]

On the H200 the device tests took ~255 s in one process, almost all of it compiling
(Triton and XLA compile on the host, one kernel at a time), while the machine has 16
cores. This runner collects the test ids, deals them round-robin to `--shards` pytest
processes run at once, each with `XLA_PYTHON_CLIENT_PREALLOCATE=false` so that they
share the device's memory, then runs the tests that size the KV cache from the
device's free memory (`SERIAL`) alone. Each process's output goes to
DIR/pytest_shard<i>.log (and DIR/pytest_serial.log) and is printed when it ends,
followed by one line with the totals, `= 29 passed, 1 skipped in 97 s =`, in pytest's
words. Exit code 0 when every process passed (or had no test to run).

On SIGTERM (`timeout` in scripts/device_check.sh) the running processes are killed and
what finished is still summarised.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = "tests/test_gpu_device.py"
SERIAL = ("test_kv_memory_fraction",)  # read the device's free memory: run alone
VERBOSE = re.compile(r"^\S+::\S+ (PASSED|FAILED|SKIPPED|ERROR)\b", re.M)
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def collect(python: str, pytest_args: list[str]) -> list[str]:
    """Test ids of TESTS, in file order."""
    out = subprocess.run(
        [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TESTS]
        + pytest_args,
        capture_output=True,
        text=True,
        check=False,
    )
    ids = [line for line in out.stdout.splitlines() if line.startswith(TESTS + "::")]
    if not ids and out.returncode not in (0, 5):
        sys.exit(f"collecting {TESTS} failed:\n{out.stdout}\n{out.stderr}")
    return ids


def tally(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line (`= 3 passed, 1 skipped in 2.0s =`), or,
    from a process killed before it, its `-v` lines (`test_x[a] PASSED [ 50%]`)."""
    lines = [line for line in text.splitlines() if COUNT.search(line) and " in " in line]
    if not lines:
        counts: dict[str, int] = {}
        for verdict in VERBOSE.findall(text):
            counts[verdict.lower()] = counts.get(verdict.lower(), 0) + 1
        return counts
    return {
        kind.rstrip("s") if kind.startswith("error") else kind: int(n)
        for n, kind in COUNT.findall(lines[-1])
    }


class Runner:
    """The pytest processes of one run, killed together on SIGTERM."""

    def __init__(self, python: str, log_dir: Path, pytest_args: list[str]):
        self.python, self.log_dir, self.pytest_args = python, log_dir, pytest_args
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.killed = False

    def start(self, name: str, ids: list[str], env: dict) -> None:
        log = self.log_dir / f"pytest_{name}.log"
        cmd = [self.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfEs"]
        cmd += [*self.pytest_args, *ids]
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs.append((name, proc, log))

    def wait(self) -> list[tuple[str, int, str]]:
        """(name, exit code (negative: the signal that killed it), output) of each
        process started."""
        done = []
        for name, proc, log in self.procs:
            rc = proc.wait()
            done.append((name, rc, log.read_text() if log.exists() else ""))
        self.procs = []
        return done

    def kill(self, *_):
        """The SIGTERM handler. It only signals: the interrupted `proc.wait()` in `wait`
        holds the Popen's lock, so waiting here would deadlock; that wait returns."""
        self.killed = True
        for _, proc, _ in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=3, help="pytest processes at once")
    p.add_argument("--log-dir", type=Path, default=Path("."), help="where the logs go")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest")
    args = p.parse_args(argv)
    if args.shards < 1:
        p.error(f"--shards must be >= 1, got {args.shards}")
    python = sys.executable
    t0 = time.monotonic()
    ids = collect(python, args.pytest_args)
    serial = [i for i in ids if any(name in i for name in SERIAL)]
    parallel = [i for i in ids if i not in serial]
    shards = [parallel[k :: args.shards] for k in range(args.shards)]
    print(f"{len(ids)} tests: {len(parallel)} in {args.shards} shards, {len(serial)} alone")
    args.log_dir.mkdir(parents=True, exist_ok=True)

    runner = Runner(python, args.log_dir, args.pytest_args)
    signal.signal(signal.SIGTERM, runner.kill)
    shared = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for k, shard in enumerate(shards):
        if shard:
            runner.start(f"shard{k}", shard, shared)
    results = runner.wait()
    if serial and not runner.killed:
        runner.start("serial", serial, dict(os.environ))
        results += runner.wait()

    totals: dict[str, int] = {}
    ok = not runner.killed
    for name, rc, text in results:
        print(f"===== {name} (exit {rc}) =====\n{text}", flush=True)
        for kind, n in tally(text).items():
            totals[kind] = totals.get(kind, 0) + n
        ok &= rc in (0, 5)
    took = time.monotonic() - t0
    counts = ", ".join(f"{n} {kind}" for kind, n in totals.items()) or "no tests ran"
    cut = " (KILLED: cut short)" if runner.killed else ""
    print(f"= {counts} in {took:.0f} s ({len(shards)} shards + serial){cut} =")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
