"""KV memory fragmentation study: contiguous allocation vs paging, replayed over time.

    python scripts/bench_memory.py                     # all workloads, table + plots
    python scripts/bench_memory.py --workload sharegpt --json

A seeded workload (`scripts/workloads.py`) is replayed step by step against a fixed
KV budget of `--budget-tokens` token slots under each allocation policy:

- ``contiguous-maxlen``: every sequence preallocates `max_seq_len` slots (fixed slots,
  internal fragmentation only).
- ``contiguous-firstfit``: every sequence gets exactly prompt + output slots (an oracle
  that knows the output length) carved first-fit from one arena; freed ranges become
  holes that merge with their neighbours (external fragmentation).
- ``paged-S`` / ``paged-S+prefix``: the real `pagedjax.blocks.BlockManager` with page
  size S, prefix caching off / on: `admit` + `mark_computed` for the prompt, one
  `append_tokens` per step for every running sequence, `free` at the end.

(The policies are in `scripts/bench_memory_allocators.py`; this script replays and reports.)

One step: arrivals join a FCFS queue; every running sequence appends one output token;
the queue head is admitted while it fits (no skipping; its prompt is prefilled in that
step); the step is measured; sequences that emitted their last token are freed.
Requests arrive as a Poisson process of `--rate` per step (conversation starts for
``chat``), an offered load far above what any policy serves, so the queue stays long
and memory is what limits the batch. When memory runs out, requests wait in the queue:
no policy preempts.

The paged policies allocate on demand, so admission must leave room for the running
sequences to grow: the head is admitted when the pages free after its prompt cover
`--watermark` of the pool (the BlockManager's `can_admit`, like vLLM) plus a growth
reserve of `--horizon` tokens per running sequence (default 16: about one page each
at page size 16; BENCHMARKS.md shows the sweep). If a step still lacks pages, the
sequences that need one stall for that step (not counted in capacity); only if no
sequence at all can advance is the newest one preempted. Both are counted. A request
that a policy cannot admit, or cannot grow to its full length, even with nothing else
running (`budget // page_size` pages that hold fewer slots than its tokens, or a
`--watermark` or `--horizon` reserve that takes the whole pool) would wait or restart
forever: the run stops with an error naming it.

Metrics, summed over the *saturated* steps (a request is waiting after admission, so
memory is what limits the batch; all busy steps if there are none):

- utilization = sum(live slots) / sum(reserved slots). Live: slots holding a token of
  a running sequence (a page shared through the prefix cache counts once). Reserved:
  slots allocated to running sequences (paged: pages in use x page size; cached pages
  nobody uses are evictable, so they count as free).
- internal waste = 1 - utilization (reserved but empty: the rest of max_seq_len,
  not-yet-generated output, the unfilled tail of the last page).
- external waste = free slots while the queue head would fit in the total free space
  but in no single hole, over the budget (only first-fit can have it).
- capacity = mean number of sequences that decode a token (or prefill) per saturated
  step: the concurrency the policy sustains in the budget (resident sequences that
  stall for lack of a page do not count; `resident` counts them). The headline ratio
  is the capacity of ``paged-16`` over ``contiguous-maxlen`` on the default workload.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from bench_memory_allocators import FirstFit, MaxLen, Paged, Seq  # noqa: E402

PAGE_SIZES = (1, 8, 16, 32, 64, 128)
DEFAULT_PLOT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Unservable(Exception):
    """A request that a policy cannot serve even with nothing else running."""


# ------------------------------------------------------------------ the replay


@dataclasses.dataclass
class Trace:
    """Per-step series for the plots: [steps] arrays."""

    live: list[int] = dataclasses.field(default_factory=list)
    reserved: list[int] = dataclasses.field(default_factory=list)
    running: list[int] = dataclasses.field(default_factory=list)


def replay(requests: list[workloads.Request], alloc, budget: int, trace: Trace | None = None):
    """Replays the workload against one allocator; returns a dict of metrics."""
    by_parent = {r.parent: r for r in requests if r.parent is not None}
    arrivals = collections.deque(
        sorted((r for r in requests if r.parent is None), key=lambda r: (r.arrival, r.rid))
    )
    follow_ups: list[tuple[int, int]] = []  # heap of (arrival step, rid)
    queue: collections.deque[workloads.Request] = collections.deque()
    running: list[Seq] = []
    logical = 0  # tokens of running sequences, shared prefixes counted per sequence
    acc = collections.Counter()
    busy = collections.Counter()
    peak = finished = preemptions = step = 0
    holes = hasattr(alloc, "num_holes")
    while finished < len(requests):
        if not running and not queue:  # idle: jump to the next arrival
            nxt = [arrivals[0].arrival] if arrivals else []
            nxt += [follow_ups[0][0]] if follow_ups else []
            step = max(step, min(nxt))
        while arrivals and arrivals[0].arrival <= step:
            queue.append(arrivals.popleft())
        while follow_ups and follow_ups[0][0] <= step:
            queue.append(requests[heapq.heappop(follow_ups)[1]])

        advanced = alloc.grow(running)
        for s in advanced:
            s.appended += 1
            s.num_tokens += 1
        logical += len(advanced)
        if running and not advanced:  # deadlock: nobody can grow; recompute the newest later
            victim = running.pop()
            if not running:  # alone and stuck: it would restart from its prompt forever
                raise Unservable(
                    f"{alloc.name} cannot hold request {victim.req.rid} "
                    f"({victim.req.total_len} tokens) even alone in a budget of {budget} "
                    f"slots; raise --budget-tokens or lower --max-seq-len"
                )
            alloc.release(victim)
            logical -= victim.num_tokens
            queue.appendleft(victim.req)
            preemptions += 1
        stalled = len(running) - len(advanced)
        while queue:
            seq = Seq(queue[0], queue[0].prompt_len)
            if not alloc.admit(seq, len(running)):
                break
            queue.popleft()
            running.append(seq)
            logical += seq.num_tokens
        if queue and not running:  # nothing will free memory: the head would wait forever
            head = queue[0]
            raise Unservable(
                f"{alloc.name} cannot admit request {head.rid} ({head.prompt_len} prompt + "
                f"{head.output_len} output tokens) even with nothing else running in a budget "
                f"of {budget} slots; raise --budget-tokens or lower --watermark or --horizon"
            )

        reserved = alloc.reserved()
        live = alloc.live(running, logical)
        sample = {
            "steps": 1,
            "live": live,
            "logical": logical,
            "reserved": reserved,
            "running": len(running),
            "decoding": len(running) - stalled,
        }
        if queue:
            sample["fragmented"] = alloc.fragmented_free(queue[0])
            if holes:
                sample["holes"] = alloc.num_holes()
            acc.update(sample)
        if running:
            busy.update(sample)
        peak = max(peak, len(running))
        if trace is not None:
            trace.live.append(live)
            trace.reserved.append(reserved)
            trace.running.append(len(running))

        keep = []
        for s in running:
            if s.appended == s.req.output_len:
                alloc.release(s)
                logical -= s.num_tokens
                finished += 1
                child = by_parent.get(s.req.rid)
                if child is not None:
                    heapq.heappush(follow_ups, (step + 1 + child.think, child.rid))
            else:
                keep.append(s)
        running = keep
        step += 1

    window = "saturated" if acc["steps"] else "busy"
    w = acc if acc["steps"] else busy
    out_tokens = sum(r.output_len for r in requests)
    row = {
        "policy": alloc.name,
        "page_size": alloc.page_size,
        "prefix_caching": alloc.prefix,
        "window": window,
        "window_steps": w["steps"],
        "utilization": w["live"] / w["reserved"] if w["reserved"] else 0.0,
        "external_waste": w["fragmented"] / (budget * w["steps"]),
        "free": 1.0 - w["reserved"] / (budget * w["steps"]),
        "live_over_budget": w["live"] / (budget * w["steps"]),
        "tokens_per_live_slot": w["logical"] / w["live"] if w["live"] else 0.0,
        "capacity": w["decoding"] / w["steps"],
        "resident": w["running"] / w["steps"],
        "peak_running": peak,
        "steps": step,
        "tokens_per_step": out_tokens / step,  # whole run, drain included
        "preemptions": preemptions,
        "stalls": getattr(alloc, "stalls", 0),
    }
    row["internal_waste"] = 1.0 - row["utilization"]
    if holes:
        row["mean_holes"] = w["holes"] / w["steps"]
    if isinstance(alloc, Paged):
        st = alloc.bm.stats()
        row["prefix_hit_rate"] = st.prefix_hit_rate
    return row


def make_allocators(args):
    yield MaxLen(args.budget_tokens, args.max_seq_len)
    yield FirstFit(args.budget_tokens)
    for ps in args.page_sizes:
        for prefix in (False, True):
            yield Paged(
                args.budget_tokens,
                ps,
                prefix,
                watermark=args.watermark,
                horizon=args.horizon,
                max_len=args.max_seq_len,
            )


def run_workload(name: str, args, traces: dict | None) -> dict:
    requests = workloads.make_workload(
        name, args.requests, seed=args.seed, max_seq_len=args.max_seq_len, rate=args.rate
    )
    stats = workloads.describe(requests)
    log(
        f"{name}: {stats['requests']} requests, mean prompt {stats['prompt_mean']:.0f}, "
        f"mean output {stats['output_mean']:.0f}"
    )
    rows = []
    for alloc in make_allocators(args):
        t0 = time.perf_counter()
        trace = Trace() if traces is not None else None
        row = replay(requests, alloc, args.budget_tokens, trace)
        row["elapsed_s"] = time.perf_counter() - t0
        rows.append(row)
        if traces is not None:
            traces[(name, alloc.name)] = trace
        log(f"  {alloc.name:22s} {row['elapsed_s']:.1f}s")
    base = rows[0]["capacity"]
    for row in rows:
        row["capacity_vs_contiguous"] = row["capacity"] / base if base else None
    return {"stats": stats, "policies": rows}


# ------------------------------------------------------------------ output

COLUMNS = (
    ("policy", "policy", "{}"),
    ("utilization", "util", "{:.3f}"),
    ("internal_waste", "int.waste", "{:.3f}"),
    ("external_waste", "ext.waste", "{:.3f}"),
    ("free", "free", "{:.3f}"),
    ("live_over_budget", "live/budget", "{:.3f}"),
    ("capacity", "capacity", "{:.1f}"),
    ("capacity_vs_contiguous", "x maxlen", "{:.2f}"),
    ("peak_running", "peak", "{}"),
    ("prefix_hit_rate", "hit rate", "{:.3f}"),
    ("stalls", "stalls", "{}"),
)


def format_table(rows: list[dict], markdown: bool = False) -> str:
    heads = [h for _, h, _ in COLUMNS]
    cells = [[("-" if r.get(k) is None else f.format(r[k])) for k, _, f in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*heads)] + [fmt.format(*c) for c in cells])


def make_plots(results: dict, traces: dict, out_dir: Path, args) -> list[str]:
    """Writes the PNG plots; returns their paths ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): skipping plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results.items():
        for prefix, style in ((False, "-o"), (True, "--s")):
            rows = [r for r in res["policies"] if r["page_size"] and r["prefix_caching"] == prefix]
            if name != "chat" and prefix:
                continue  # no shared prefixes: the same as without caching
            label = name + (" +prefix" if prefix else "")
            xs = [r["page_size"] for r in rows]
            axes[0].plot(xs, [r["utilization"] for r in rows], style, label=label)
            axes[1].plot(xs, [r["capacity_vs_contiguous"] for r in rows], style, label=label)
        for ax, key in ((axes[0], "utilization"), (axes[1], "capacity_vs_contiguous")):
            r0 = res["policies"][0]
            ax.axhline(r0[key], color="gray", lw=0.8, ls=":")
    axes[0].set(xscale="log", xlabel="page size (tokens)", ylabel="utilization (live / reserved)")
    axes[0].set_title("paged utilization (dotted: contiguous-maxlen)")
    axes[1].set(xscale="log", xlabel="page size (tokens)", ylabel="capacity / contiguous-maxlen")
    axes[1].set_title("sequences sustained in the budget")
    for ax in axes:
        ax.set_xticks(args.page_sizes, [str(p) for p in args.page_sizes])
        ax.minorticks_off()  # the log axis' own labels would overlap the page sizes
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "memory_page_size.png", plt))

    res = results.get(args.headline) or next(iter(results.values()))
    wanted = ["contiguous-maxlen", "contiguous-firstfit", "paged-16"]
    rows = [r for r in res["policies"] if r["policy"] in wanted]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["policy"] for r in rows]
    live = [r["live_over_budget"] for r in rows]
    internal = [r["internal_waste"] * (1 - r["free"]) for r in rows]
    ext = [r["external_waste"] for r in rows]
    free = [r["free"] - r["external_waste"] for r in rows]
    bottom = np.zeros(len(rows))
    for vals, label in (
        (live, "live tokens"),
        (internal, "internal waste"),
        (ext, "external waste (holes)"),
        (free, "other free"),
    ):
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom += np.array(vals)
    ax.set(ylabel="fraction of the KV budget (saturated steps)")
    ax.set_title(f"where the KV budget goes ({args.headline})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "memory_budget.png", plt))

    if traces:
        fig, ax = plt.subplots(figsize=(9, 4))
        for policy in wanted:
            tr = traces.get((args.headline, policy))
            if tr is None:
                continue
            (line,) = ax.plot(np.array(tr.live) / args.budget_tokens, label=f"{policy} live")
            ax.plot(
                np.array(tr.reserved) / args.budget_tokens,
                ls=":",
                color=line.get_color(),
                label=f"{policy} reserved",
            )
        ax.set(xlabel="step", ylabel="fraction of the KV budget", ylim=(0, 1.05))
        ax.set_title(f"live (solid) vs reserved (dotted) slots over time ({args.headline})")
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "memory_timeline.png", plt))
    return paths


def _save(fig, path: Path, plt) -> str:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workload",
        default="all",
        choices=["all", *workloads.WORKLOADS],
        help="which workload to replay (default: all; the headline uses sharegpt)",
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-tokens", type=int, default=65536, help="KV budget in token slots")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument(
        "--page-sizes", default=",".join(map(str, PAGE_SIZES)), help="comma-separated list"
    )
    p.add_argument("--rate", type=float, default=4.0, help="arrivals per step (Poisson)")
    p.add_argument("--watermark", type=float, default=0.01, help="paged admission reserve")
    p.add_argument(
        "--horizon",
        type=int,
        default=16,
        help="paged admission keeps pages free for this many more tokens per running sequence",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot-dir", type=Path, default=DEFAULT_PLOT_DIR)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    try:
        args.page_sizes = [int(x) for x in args.page_sizes.split(",") if x]
    except ValueError:
        p.error(f"--page-sizes must be comma-separated ints, got {args.page_sizes!r}")
    if any(ps < 1 for ps in args.page_sizes):
        p.error(f"--page-sizes must be >= 1, got {args.page_sizes}")
    if 16 not in args.page_sizes:
        p.error(f"--page-sizes must include 16 (the headline), got {args.page_sizes}")
    if args.budget_tokens < args.max_seq_len:
        p.error(f"--budget-tokens {args.budget_tokens} < --max-seq-len {args.max_seq_len}")
    if args.requests < 1:
        p.error(f"--requests must be >= 1, got {args.requests}")
    if args.max_seq_len < 2:  # a prompt and an output token
        p.error(f"--max-seq-len must be >= 2, got {args.max_seq_len}")
    if not (math.isfinite(args.rate) and args.rate > 0):
        p.error(f"--rate must be a finite number > 0, got {args.rate}")
    if not 0 <= args.watermark < 1:
        p.error(f"--watermark must be in [0, 1), got {args.watermark}")
    if args.horizon < 0:
        p.error(f"--horizon must be >= 0, got {args.horizon}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    workloads.make_plot_dir(p, args)
    names = list(workloads.WORKLOADS) if args.workload == "all" else [args.workload]
    args.names = names
    args.headline = "sharegpt" if "sharegpt" in names else names[0]
    return args


def _find(rows, policy):
    return next(r for r in rows if r["policy"] == policy)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    traces = None if args.no_plots else {}
    try:
        results = {name: run_workload(name, args, traces) for name in args.names}
    except Unservable as e:
        print(f"bench_memory.py: error: {e}", file=sys.stderr)
        return 2
    rows = results[args.headline]["policies"]
    maxlen, paged16 = _find(rows, "contiguous-maxlen"), _find(rows, "paged-16")
    out = {
        "headline_workload": args.headline,
        "paged16_utilization": paged16["utilization"],
        "contiguous_maxlen_utilization": maxlen["utilization"],
        "contiguous_firstfit_utilization": _find(rows, "contiguous-firstfit")["utilization"],
        "capacity_ratio_paged16_vs_contiguous": paged16["capacity"] / maxlen["capacity"],
        "paged16_waste": paged16["internal_waste"],
        "contiguous_maxlen_waste": maxlen["internal_waste"],
    }
    if "chat" in results:
        chat = results["chat"]["policies"]
        on, off = _find(chat, "paged-16+prefix"), _find(chat, "paged-16")
        out["chat_capacity_ratio_prefix_vs_no_prefix"] = on["capacity"] / off["capacity"]
        out["chat_capacity_ratio_paged16_prefix_vs_contiguous"] = (
            on["capacity"] / _find(chat, "contiguous-maxlen")["capacity"]
        )
    config = {
        k: getattr(args, k)
        for k in (
            "requests",
            "seed",
            "rate",
            "budget_tokens",
            "max_seq_len",
            "page_sizes",
            "watermark",
            "horizon",
        )
    }
    out["config"] = config
    out["environment"] = workloads.environment()
    out["workloads"] = results
    out["plots"] = [] if args.no_plots else make_plots(results, traces, args.plot_dir, args)
    out["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for name, res in results.items():
        s = res["stats"]
        print(
            f"\n== {name}: {s['requests']} requests ({s['conversations']} conversations), "
            f"mean prompt {s['prompt_mean']:.0f} + output {s['output_mean']:.0f} tokens; "
            f"budget {args.budget_tokens} slots, max_seq_len {args.max_seq_len}"
        )
        print(format_table(res["policies"]))
    print(
        f"\npaged16_utilization {out['paged16_utilization']:.4f} (target >= 0.97)   "
        f"contiguous_maxlen_utilization {out['contiguous_maxlen_utilization']:.4f}   "
        f"capacity_ratio_paged16_vs_contiguous "
        f"{out['capacity_ratio_paged16_vs_contiguous']:.2f} (target >= 2.5)"
    )
    for path in out["plots"]:
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
