"""Host-side cost of serving: the block manager alone, and the engine's whole host path.

Measures microseconds per operation on this CPU:

- admit of a long prompt, cold (nothing cached) and as a prefix hit (all full pages
  cached), then mark_computed of the whole prompt (hashing every page) and free;
- append_token (one sequence), fork and free of a long sequence;
- one decode step for B running sequences: append_tokens for the batch (page allocation,
  copy-on-write, prefix registration of pages that fill up), then page_tables for the
  batch (the [B, max_pages] array the device step needs);
- flattening a model's parameters (`--params-preset`, abstract: nothing allocated), as
  every jitted step does on the host: `model.Params` against its `nnx.State`;
- one call of a jitted `decode.decode_step` (`--dispatch-layers`, `--dispatch-batch`)
  until it returns: the host's share of launching a step;
- one engine decode step for B running sequences (`--engine-batch`): `LLM.step()` with
  the device step replaced by a null one that returns random tokens at once, so every
  microsecond is host work: scheduling and packing, page tables included (`schedule`,
  `pack`: hidden behind the device step in a real run), then applying the previous
  step's tokens, committing the decode rows (`append_tokens`: slots, copy-on-write)
  and filling them in (`apply`, `commit`, `finish`: exposed, the device idles
  meanwhile, with `async_scheduling=False`). The real jitted dispatch, which depends
  on the model, is not included;
- the same engine against a simulated device that takes `--device-ms` per step
  (`overlap_*`): wall time per decode step with synchronous scheduling (about the
  device time plus the exposed host phases) and asynchronous (the engine's default:
  about the larger of the device time and the whole host step).
  `--engine-penalties` gives every request repetition, presence and frequency
  penalties, whose histories `finish` packs (prompt and generated tokens per row);
  `--engine-stop`, a stop string that never matches, so that `apply` runs every token
  through its sequence's incremental detokenizer and the stop-string search.

Each figure is the best (lowest) mean over ``--repeats`` rounds, so that other load on a
shared machine inflates it less; ``--clock cpu`` counts only this process's CPU time.
Target: block-manager decode step <= 1 ms at 256 sequences.

    python scripts/bench_host.py            # table
    python scripts/bench_host.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time

import numpy as np

from pagedjax.blocks import BlockManager
from pagedjax.config import PRESETS


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


class _HostTokens(np.ndarray):
    """A numpy array the engine can treat as a device result (`copy_to_host_async`);
    `ready_at`: when the simulated device has computed it (perf_counter seconds)."""

    ready_at = 0.0

    def copy_to_host_async(self):
        return None


# Engine host phases timed by wrapping (owner, method name): hidden, then exposed.
_PHASES = {
    "schedule": ("scheduler.Scheduler", "schedule"),
    "pack": ("batch.StepBatch", "__init__"),
    "apply": ("outputs.OutputProcessor", "apply"),
    "commit": ("scheduler.Scheduler", "commit"),
    "finish": ("batch.StepBatch", "finish"),
}


@contextlib.contextmanager
def _null_device(rng, vocab: int, timers: dict[str, float], now, device_s: float = 0.0):
    """Replaces the jitted steps with random tokens; times the host phases.

    `device_s` > 0 simulates a device that runs each step for that long, one after the
    other from its dispatch: waiting for a step's tokens (`jax.device_get`) sleeps until
    then. 0: the tokens are ready at once, so every microsecond is host work.
    """
    import jax

    from pagedjax import batch, decode, outputs, scheduler

    mods = {"scheduler": scheduler, "batch": batch, "outputs": outputs}
    saved = [
        (decode, "decode_step", decode.decode_step),
        (decode, "prefill_step", decode.prefill_step),
        (jax, "device_get", jax.device_get),
    ]
    busy_until = [0.0]

    def step(params, cache, inp, **_):
        b = inp.context_lens.shape[0]
        toks = rng.integers(3, vocab, b).astype(np.int32).view(_HostTokens)
        busy_until[0] = max(time.perf_counter(), busy_until[0]) + device_s
        toks.ready_at = busy_until[0]
        out = decode.StepOutput(toks, np.zeros(b, np.float32).view(_HostTokens))
        return out, cache

    def device_get(tree):
        ready = max((getattr(x, "ready_at", 0.0) for x in jax.tree.leaves(tree)), default=0)
        while (left := ready - time.perf_counter()) > 0:
            time.sleep(left)
        return tree

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = now()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += now() - t0

        return wrapper

    for name, (owner, attr) in _PHASES.items():
        mod, cls = owner.split(".")
        target = getattr(mods[mod], cls)
        saved.append((target, attr, getattr(target, attr)))
        setattr(target, attr, timed(name, getattr(target, attr)))
    decode.decode_step = decode.prefill_step = step
    jax.device_get = device_get
    try:
        yield
    finally:
        for target, attr, fn in saved:
            setattr(target, attr, fn)


def _engine(args, batch: int, async_scheduling: bool):
    from pagedjax.engine import LLM

    ps, prompt, gen = args.page_size, args.engine_prompt_len, args.engine_steps
    return LLM(
        page_size=ps,
        num_pages=batch * (-(-(prompt + gen) // ps) + 1) + 8,
        max_num_seqs=batch,
        max_num_batched_tokens=max(batch * prompt, 1024),
        max_model_len=prompt + gen + 1,
        async_scheduling=async_scheduling,
    )


def _penalties(args) -> dict:
    """The engine requests' optional sampling params: `--engine-penalties`, `--engine-stop`."""
    out = {}
    if args.engine_penalties:
        out |= dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2)
    if args.engine_stop:  # (random tokens never spell it: every request runs to max_tokens)
        out |= dict(stop=["<a stop string never generated>"])
    return out


def bench_engine(args, rng, batch: int) -> dict[str, float]:
    """Host microseconds per engine decode step at `batch` running sequences, by phase
    (`async_scheduling=False`, where the phases after the wait are exposed; asynchronous
    scheduling does the same work, all of it while the device computes)."""
    from pagedjax.engine import SamplingParams

    prompt, gen = args.engine_prompt_len, args.engine_steps
    llm = _engine(args, batch, async_scheduling=False)
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=1.0, **_penalties(args))
    timers = dict.fromkeys(_PHASES, 0.0)
    best = dict.fromkeys([*_PHASES, "step"], float("inf"))
    with _null_device(rng, vocab, timers, args.now):
        for _ in range(args.repeats):
            for _ in range(batch):
                llm.add_request(rng.integers(3, vocab, prompt).tolist(), params)
            acc, steps = dict.fromkeys(best, 0.0), 0
            while llm.has_unfinished_requests() or llm.core.inflight is not None:
                # Timed: steps that run all `batch` sequences as decode rows.
                full = not llm.scheduler.waiting and len(llm.scheduler.running) == batch
                full = full and llm.core.inflight is not None
                before = dict(timers)
                t0 = args.now()
                llm.step()
                if full:
                    acc["step"] += args.now() - t0
                    for k in _PHASES:
                        acc[k] += timers[k] - before[k]
                    steps += 1
            if not steps:
                raise RuntimeError(f"no full decode step at batch {batch}; raise --engine-steps")
            for k in best:
                best[k] = min(best[k], acc[k] / steps * 1e6)
    return {f"engine_{k}_b{batch}": v for k, v in best.items()}


def bench_overlap(args, rng, batch: int, device_ms: float) -> dict[str, float]:
    """Wall microseconds per engine decode step at `batch` sequences against a simulated
    device that takes `device_ms` per step, synchronous then asynchronous scheduling:
    about device + exposed host time, against max(device, whole host step)."""
    from pagedjax.engine import SamplingParams

    prompt, gen = args.engine_prompt_len, args.engine_steps
    out = {}
    for mode in ("sync", "async"):
        llm = _engine(args, batch, async_scheduling=mode == "async")
        vocab = llm.config.vocab_size
        params = SamplingParams(
            max_tokens=gen, ignore_eos=True, temperature=1.0, **_penalties(args)
        )
        timers = dict.fromkeys(_PHASES, 0.0)
        best = float("inf")
        with _null_device(rng, vocab, timers, time.perf_counter, device_ms / 1e3):
            for _ in range(args.repeats):
                for _ in range(batch):
                    llm.add_request(rng.integers(3, vocab, prompt).tolist(), params)
                total, steps = 0.0, 0
                while llm.has_unfinished_requests():
                    full = not llm.scheduler.waiting and len(llm.scheduler.running) == batch
                    full = full and llm.core.inflight is not None
                    t0 = time.perf_counter()
                    llm.step()
                    if full:
                        total += time.perf_counter() - t0
                        steps += 1
                best = min(best, total / max(steps, 1) * 1e6)
        out[f"overlap_{mode}_b{batch}_d{device_ms:g}ms"] = best
    return out


def bench_params(args) -> dict[str, float]:
    """Host cost of flattening a model's parameters, which every jitted step pays.

    `Params` keeps its state as a flat tuple of arrays; flattening the `nnx.State`
    itself (what a jitted function of the state would pay) is timed beside it.
    Abstract parameters of the preset's real shape: nothing is allocated.
    """
    import jax
    from flax import nnx

    from pagedjax import config, model

    out = {}
    for name in args.params_preset:
        cfg = config.preset(name)
        graphdef, state = nnx.split(nnx.eval_shape(lambda c=cfg: model.Llama(c, rngs=nnx.Rngs(0))))
        params = model.Params(graphdef, state, cfg)

        def flatten(tree):
            def run():
                t0 = args.now()
                for _ in range(args.iters):
                    jax.tree.flatten(tree)
                return args.now() - t0, args.iters

            return best_mean_us(run, args.repeats)

        out[f"params_flatten_{name}"] = flatten(params)
        out[f"state_flatten_{name}"] = flatten(state)
    return out


def bench_dispatch(args) -> dict[str, float]:
    """Host time of one `decode.decode_step` call (until it returns, not until the device
    finishes): a `tiny`-width model with `--dispatch-layers` layers, as many parameter
    arrays as a real model of that depth, at `--dispatch-batch` sequences, XLA backend.
    The median wall time over calls (each waits for the previous one first); always
    wall time: `--clock cpu` would count the XLA threads' work on the step too."""
    import dataclasses

    import jax

    from pagedjax import cache as cache_lib
    from pagedjax import config, decode, model

    layers, b = args.dispatch_layers, args.dispatch_batch
    cfg = dataclasses.replace(config.preset("tiny"), num_layers=layers)
    params = model.init_params(cfg)
    cc = config.CacheConfig(16, b * 8 + 8, cfg.dtype)
    cache = cache_lib.create(cfg, cc)
    chunks = [decode.SeqChunk([5], 40, list(range(8 * i, 8 * i + 8))) for i in range(b)]
    inp = decode.build_step_input(chunks, cfg, cc)
    out, cache = decode.decode_step(params, cache, inp, backend="xla")  # compile
    times = []
    for _ in range(max(args.iters, 5)):
        jax.block_until_ready((out.tokens, cache))
        t0 = time.perf_counter()
        out, cache = decode.decode_step(params, cache, inp, backend="xla")
        times.append(time.perf_counter() - t0)
    return {f"dispatch_decode_step_l{layers}_b{b}": float(np.median(times)) * 1e6}


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Exits with a usage error naming the first bad flag (nothing is run before)."""
    ps = args.page_size
    if ps < 1 or ps & (ps - 1):
        parser.error(f"--page-size must be a power of two, got {ps}")
    for name in (
        "prompt_len",
        "context_len",
        "steps",
        "dispatch_layers",
        "dispatch_batch",
        "engine_prompt_len",
        "engine_steps",
        "iters",
        "repeats",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("batch", "engine_batch"):
        if any(b < 1 for b in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must all be >= 1, got {getattr(args, name)}")
    if not all(math.isfinite(d) and d >= 0 for d in args.device_ms):
        parser.error(f"--device-ms must all be finite and >= 0, got {args.device_ms}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2000, help="admit/fork/free prompt")
    parser.add_argument("--context-len", type=int, default=1024, help="decode contexts")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=128, help="decode steps per round")
    parser.add_argument(
        "--engine-batch", type=int, nargs="*", default=[64, 256], help="engine step batches"
    )
    parser.add_argument(
        "--params-preset",
        nargs="*",
        choices=sorted(PRESETS),
        default=["llama3-8b", "llama3-70b"],
    )
    parser.add_argument("--dispatch-layers", type=int, default=32)
    parser.add_argument("--dispatch-batch", type=int, default=256)
    parser.add_argument(
        "--device-ms",
        type=float,
        nargs="*",
        default=[2.0, 5.0],
        help="simulated device step times for the sync/async overlap figures",
    )
    parser.add_argument("--engine-prompt-len", type=int, default=64)
    parser.add_argument(
        "--engine-penalties",
        action="store_true",
        help="engine requests with repetition, presence and frequency penalties",
    )
    parser.add_argument(
        "--engine-stop",
        action="store_true",
        help="engine requests with a stop string (never matched): every token detokenized",
    )
    parser.add_argument("--engine-steps", type=int, default=64, help="tokens per request")
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
    check_args(parser, args)
    args.now = time.process_time if args.clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(args.seed)

    us = bench_admit(args, rng) | bench_seq_ops(args, rng)
    for b in args.batch:
        us |= bench_decode(args, rng, b)
    us |= bench_params(args)
    us |= bench_dispatch(args)
    for b in args.engine_batch:
        us |= bench_engine(args, rng, b)
    for b in args.engine_batch:
        for d in args.device_ms:
            us |= bench_overlap(args, rng, b, d)
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
            "params_flatten": "model.Params, as each jitted step flattens it",
            "state_flatten": "the same parameters as an nnx.State",
        }
        engine_notes = {
            "schedule": "LLM.step: Scheduler.schedule (hidden behind the device)",
            "pack": "StepBatch: sizing, prefill rows, params, page tables (hidden)",
            "apply": "previous step's tokens: append, stop checks (exposed if sync)",
            "commit": "Scheduler.commit: append_tokens, slots (exposed if sync)",
            "finish": "StepBatch.finish: decode rows into the StepInput (exposed if sync)",
            "step": "the whole LLM.step with a null device (excl. jit dispatch)",
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
            if k.startswith(("params_flatten", "state_flatten")):
                note = notes[k.rsplit("_", 1)[0]] + f" ({k.rsplit('_', 1)[1]})"
            if k.startswith("dispatch_"):
                note = "decode_step call until it returns (median; XLA backend)"
            if k.startswith("engine_"):
                phase = k.split("_")[1]
                note = engine_notes.get(phase, "")
            if k.startswith("overlap_"):
                mode, _, d = k.split("_")[1:]
                note = f"wall per decode step, {mode} scheduling, device step {d[1:]}"
            print(f"{k:<28} {v:>10.1f}  {note}")
        print(
            f"page_size={args.page_size} context={args.context_len} steps={args.steps} "
            f"repeats={args.repeats} clock={args.clock} (best mean of the rounds); "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        )
    return result


if __name__ == "__main__":
    main()
