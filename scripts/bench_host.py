"""Host-side cost of the block manager (pagedjax.blocks): no device, no jax.

Measures microseconds per operation on this CPU:

- admit of a long prompt, cold (nothing cached) and as a prefix hit (all full pages
  cached), then mark_computed of the whole prompt (hashing every page) and free;
- append_token (one sequence), fork and free of a long sequence;
- one decode step for B running sequences: append_tokens for the batch (page allocation,
  copy-on-write, prefix registration of pages that fill up), then page_tables for the
  batch (the [B, max_pages] array the device step needs).

Each figure is the best (lowest) mean over ``--repeats`` rounds, so that other load on a
shared machine inflates it less; ``--clock cpu`` counts only this process's CPU time.
Target: decode step <= 1 ms at 256 sequences.

    python scripts/bench_host.py            # table
    python scripts/bench_host.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from pagedjax.blocks import BlockManager


def best_mean_us(run, repeats: int) -> float:
    """``run()`` returns (seconds, ops); the best per-op mean over rounds, in us."""
    best = float("inf")
    for _ in range(repeats):
        seconds, ops = run()
        best = min(best, seconds / ops * 1e6)
    return best


def bench_admit(args, rng) -> dict[str, float]:
    now = args.now
    n, ps, iters = args.prompt_len, args.page_size, args.iters
    pages = -(-n // ps)
    bm = BlockManager(pages * (iters + 2), ps)
    out = {}

    def cold():
        prompts = [rng.integers(0, 32000, n) for _ in range(iters)]
        t_admit = t_mark = t_free = 0.0
        for i, p in enumerate(prompts):
            t0 = now()
            bm.admit(i, p)
            t1 = now()
            bm.mark_computed(i, n)
            t2 = now()
            bm.free(i)
            t3 = now()
            t_admit, t_mark, t_free = t_admit + t1 - t0, t_mark + t2 - t1, t_free + t3 - t2
        out["mark_computed_all"] = min(out.get("mark_computed_all", 1e9), t_mark / iters * 1e6)
        out["free_prompt"] = min(out.get("free_prompt", 1e9), t_free / iters * 1e6)
        return t_admit, iters

    out["admit_cold"] = best_mean_us(cold, args.repeats)
    shared = rng.integers(0, 32000, n)
    bm.admit("warm", shared)
    bm.mark_computed("warm", n)
    bm.free("warm")

    def hit():
        t = 0.0
        for _ in range(iters):
            t0 = now()
            cached = bm.admit("hit", shared)
            t += now() - t0
            bm.free("hit")
        assert cached == (n - 1) // ps * ps, cached
        return t, iters

    out["admit_prefix_hit"] = best_mean_us(hit, args.repeats)
    as_list = shared.tolist()

    def hit_list():
        t0 = now()
        for _ in range(iters):
            bm.admit("hit", as_list)
            bm.free("hit")
        return now() - t0, iters

    out["admit_prefix_hit_list+free"] = best_mean_us(hit_list, args.repeats)
    order = ["admit_cold", "admit_prefix_hit", "admit_prefix_hit_list+free"]
    return {k: out[k] for k in order} | out


def bench_seq_ops(args, rng) -> dict[str, float]:
    now = args.now
    n, ps, iters = args.prompt_len, args.page_size, args.iters
    bm = BlockManager(-(-n // ps) * 4 + 4 * iters, ps)
    bm.admit("s", rng.integers(0, 32000, n))
    bm.mark_computed("s", n)
    out = {}

    def append():
        toks = rng.integers(0, 32000, iters * ps).tolist()
        t0 = now()
        for t in toks:
            bm.append_token("s", t)
        return now() - t0, len(toks)

    out["append_token"] = best_mean_us(append, args.repeats)

    def fork_free():
        t_fork = t_free = 0.0
        for i in range(iters):
            t0 = now()
            bm.fork("s", i)
            t1 = now()
            bm.free(i)
            t_fork, t_free = t_fork + t1 - t0, t_free + now() - t1
        out["free_forked"] = min(out.get("free_forked", 1e9), t_free / iters * 1e6)
        return t_fork, iters

    out["fork"] = best_mean_us(fork_free, args.repeats)
    return out


def bench_decode(args, rng, batch: int) -> dict[str, float]:
    now = args.now
    ps, ctx, steps = args.page_size, args.context_len, args.steps
    per_seq = -(-(ctx + steps * args.repeats) // ps) + 1
    bm = BlockManager(batch * per_seq + 8, ps)
    seqs = list(range(batch))
    for s in seqs:
        bm.admit(s, rng.integers(0, 32000, ctx))
        bm.mark_computed(s, ctx)
    t_append = t_tables = 0.0
    best = {"append": float("inf"), "tables": float("inf"), "step": float("inf")}
    for _ in range(args.repeats):
        toks = rng.integers(0, 32000, (steps, batch))
        t_append = t_tables = 0.0
        for step in range(steps):
            t0 = now()
            bm.append_tokens(seqs, toks[step])
            t1 = now()
            bm.page_tables(seqs)
            t2 = now()
            t_append, t_tables = t_append + t1 - t0, t_tables + t2 - t1
        best["append"] = min(best["append"], t_append / steps * 1e6)
        best["tables"] = min(best["tables"], t_tables / steps * 1e6)
        best["step"] = min(best["step"], (t_append + t_tables) / steps * 1e6)
    bm.check_invariants()
    return {
        f"decode_append_tokens_b{batch}": best["append"],
        f"decode_page_tables_b{batch}": best["tables"],
        f"decode_step_b{batch}": best["step"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2000, help="admit/fork/free prompt")
    parser.add_argument("--context-len", type=int, default=1024, help="decode contexts")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=128, help="decode steps per round")
    parser.add_argument("--iters", type=int, default=50, help="operations per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the best is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: perf_counter; cpu: this process's CPU time (steadier on a busy machine)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.now = time.process_time if args.clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(args.seed)

    us = bench_admit(args, rng) | bench_seq_ops(args, rng)
    for b in args.batch:
        us |= bench_decode(args, rng, b)
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "now")},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "loadavg_1min": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
        "us": {k: round(v, 2) for k, v in us.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        notes = {
            "admit_cold": f"{args.prompt_len}-token prompt, nothing cached",
            "admit_prefix_hit": f"{args.prompt_len}-token prompt, every full page cached",
            "admit_prefix_hit_list+free": "same, prompt as a Python list, plus free",
            "mark_computed_all": "registers every full page (SHA-256 per page)",
            "free_prompt": "cached pages go to the evictable LRU",
            "append_token": "one sequence, page boundaries included",
            "fork": f"{args.prompt_len}-token sequence",
            "free_forked": "drops one reference per page",
        }
        print(f"{'operation':<28} {'us':>10}  notes")
        for k, v in us.items():
            note = notes.get(k, "")
            if k.startswith("decode_append"):
                note = f"B sequences of {args.context_len}+ tokens, one token each"
            if k.startswith("decode_page_tables"):
                note = "[B, max_pages] int32 for the device step"
            if k.startswith("decode_step"):
                note = "append_tokens + page_tables; target <= 1000 us at B=256"
            print(f"{k:<28} {v:>10.1f}  {note}")
        print(
            f"page_size={args.page_size} context={args.context_len} steps={args.steps} "
            f"repeats={args.repeats} clock={args.clock} (best mean of the rounds); "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        )
    return result


if __name__ == "__main__":
    main()
