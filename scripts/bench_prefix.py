"""Prefix caching: time to first token with a cached vs uncached system prompt, and the
prefix-cache hit rate of a simulated multi-turn chat, on the current device.

    python scripts/bench_prefix.py                    # tiny preset, random weights
    python scripts/bench_prefix.py --model llama3-8b  # on a GPU: an 8B-shaped model
    python scripts/bench_prefix.py --json

TTFT. A request is a `--system-tokens` (2,000) token system prompt followed by a
`--message-tokens` (24) token user message; it generates one token. *Cold*: the
system prompt is not in the prefix cache (each cold request uses a fresh
`cache_salt`, so the same tokens miss). *Warm*: an earlier request with the same salt
left the system prompt's pages in the cache, so only the page-aligned tail (the
message plus the system prompt's last partial page) is prefilled. Both run in one
engine and one process, alternating, `--reps` times each; the figure is
median(warm) / median(cold) of the engine's own TTFT (request arrival to the first
token back on the host, `RequestOutput.ttft_s`).

Compile time is kept out: before timing, one cold and one warm request of the same
shapes run (every program both paths need is traced then: the step shapes are
bucketed, so later requests reuse them), and the script checks that no step
function was traced during the timed requests (`compiles_during_timing` must be 0).

The engine's token budget (`--max-num-batched-tokens`, default 4096) holds the whole
cold prompt, so a cold request is one prefill step, like a warm one: chunking the
cold prompt would add steps to the cold side only and flatter the ratio.

Chat hit rate. `--chat-conversations` conversations from
`workloads.chat_conversations` (the same shared system prompt, Geometric(1/2) turns
capped at `--chat-max-turns`, lognormal message lengths, reply lengths of median
`--chat-reply-median`) run through the engine in rounds: all first turns as one
`generate` call (continuous batching), then all second turns, and so on; each turn's
prompt is the system prompt, the conversation so far (with the model's actual replies)
and a new message. The hit rate is prompt tokens served from the prefix cache over all
prompt tokens; `chat_hit_rate_bound` is what a perfect cache of full pages could serve
(everything an earlier turn or the first request already computed, floored to pages,
leaving at least one token to compute).

Models: `--model` names a preset (`pagedjax.config.PRESETS`) run with random weights
(timing does not depend on the values). Presets shorter than the prompt get their
`max_position_embeddings` raised to `--max-model-len` (RoPE extends to any length;
with random weights nothing is lost). `--model demo` runs `LLM()`'s default model
when its context fits the prompt. `--sliding-window W` gives the preset a window of W
tokens (0: none): a window model's prefix hits need only the cached pages in the
window, so a small `--num-pages` shows what eviction leaves to hit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

from pagedjax import decode, planner  # noqa: E402
from pagedjax.config import PRESETS  # noqa: E402
from pagedjax.engine import LLM, SamplingParams  # noqa: E402
from pagedjax.resources import BACKENDS  # noqa: E402

DEFAULT_PLOT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_llm(args) -> LLM:
    """The engine under test (see the module docstring for the model choice)."""
    need = args.system_tokens + args.message_tokens + 1
    common = dict(
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=True,
        seed=args.seed,
        dtype=args.dtype,
        backend=args.backend,
        buckets=decode.Buckets(min_seqs=args.bucket_min_seqs),
    )
    if args.model == "demo":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the demo model's fallback warns
            llm = LLM(**common)
        if llm.max_model_len < need:
            raise SystemExit(
                f"error: --model demo has a context of {llm.max_model_len} tokens, less than "
                f"the {need} this benchmark needs; use --model tiny (or another preset) or "
                "lower --system-tokens"
            )
        return llm
    max_len = max(args.max_model_len, need)
    cfg = workloads.preset_config(args.model, min_positions=max_len)
    if args.sliding_window is not None:
        cfg = dataclasses.replace(cfg, sliding_window=args.sliding_window or None)
    return LLM(cfg, max_model_len=max_len, **common)


def _tokens(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(workloads.FIRST_TOKEN, vocab, n).tolist()


def measure_ttft(llm: LLM, args) -> dict:
    """Cold and warm TTFT of one request alone in the engine."""
    rng = np.random.default_rng(args.seed)
    vocab = llm.config.vocab_size
    system = _tokens(rng, args.system_tokens, vocab)

    def one(salt: str) -> tuple[float, float, int]:
        prompt = system + _tokens(rng, args.message_tokens, vocab)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_salt=salt)
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], params)
        return out.ttft_s, time.perf_counter() - t0, out.num_cached_tokens

    t0 = time.perf_counter()
    one("warm")  # compiles the cold path; leaves the system prompt cached under "warm"
    one("warm")  # compiles the warm path
    warmup_s = time.perf_counter() - t0
    log(f"warm-up (compiles both paths): {warmup_s:.1f}s")
    before = sum(decode.compile_counts().values())
    cold, warm, cold_wall, warm_wall, cold_hits, warm_hits = [], [], [], [], [], []
    for r in range(args.reps):
        ttft, wall, hit = one(f"cold-{r}")
        cold.append(ttft)
        cold_wall.append(wall)
        cold_hits.append(hit)
        ttft, wall, hit = one("warm")
        warm.append(ttft)
        warm_wall.append(wall)
        warm_hits.append(hit)
        log(f"rep {r}: cold {cold[-1] * 1e3:.1f} ms, warm {warm[-1] * 1e3:.1f} ms")
    compiles = sum(decode.compile_counts().values()) - before
    expected_hit = (args.system_tokens // args.page_size) * args.page_size
    cold_med, warm_med = statistics.median(cold), statistics.median(warm)
    return {
        "ttft_cold_s": cold,
        "ttft_warm_s": warm,
        "ttft_cold_median_s": cold_med,
        "ttft_warm_median_s": warm_med,
        "ttft_warm_over_cold": warm_med / cold_med,
        "wall_warm_over_cold": statistics.median(warm_wall) / statistics.median(cold_wall),
        "cold_cached_tokens": cold_hits,
        "warm_cached_tokens": warm_hits,
        "expected_warm_cached_tokens": expected_hit,
        "hits_as_expected": all(h == 0 for h in cold_hits)
        and all(h == expected_hit for h in warm_hits),
        "compiles_during_timing": compiles,
        "warmup_s": warmup_s,
    }


def _page_keys(tokens: list[int], page_size: int) -> list[int]:
    """One key per full page: a hash chained over the prefix up to that page's end."""
    keys, h = [], 0
    for i in range(len(tokens) // page_size):
        h = hash((h, tuple(tokens[i * page_size : (i + 1) * page_size])))
        keys.append(h)
    return keys


def chat_workload(llm: LLM, args) -> list:
    """The simulated chat's requests (`workloads.chat_conversations`); built before any
    timing, so that a context no conversation fits in ends the run before the TTFT runs
    (whose figures it lost)."""
    rng = np.random.default_rng(args.seed + 1)
    vocab = llm.config.vocab_size
    system = np.asarray(_tokens(rng, args.system_tokens, vocab), np.int32)
    reqs = workloads.chat_conversations(
        rng,
        args.chat_conversations,
        max_seq_len=llm.max_model_len,
        system_prompt=system,
        reply_median=args.chat_reply_median,
        vocab=vocab,
        max_turns=args.chat_max_turns,
    )
    if not reqs:
        raise SystemExit(
            f"error: no chat conversation fits a context of {llm.max_model_len} tokens after "
            f"the {args.system_tokens}-token system prompt; raise --max-model-len"
        )
    return reqs


def chat_hit_rate(llm: LLM, args, reqs: list) -> dict:
    """Runs the simulated chat (`chat_workload`'s requests) through the engine; returns
    hit-rate figures."""
    # Each request: its new message (the prompt past its parent's prompt + reply).
    turns: dict[int, list[tuple[np.ndarray, int]]] = {}
    for r in reqs:
        start = 0 if r.parent is None else reqs[r.parent].total_len
        turns.setdefault(r.conv, []).append((r.prompt[start:], r.output_len))
    history = {c: [] for c in turns}
    seen: set[int] = set()  # keys of the page-aligned prefixes computed so far
    ps = args.page_size
    prompt_tokens = cached = bound = 0
    salt = "chat"  # apart from the TTFT requests' pages
    t0 = time.perf_counter()
    rounds = max(len(t) for t in turns.values())
    for k in range(rounds):
        convs = [c for c, t in turns.items() if len(t) > k]
        prompts, params = [], []
        for c in convs:
            msg, reply_len = turns[c][k]
            prompts.append(history[c] + msg.tolist())
            params.append(
                SamplingParams(
                    max_tokens=reply_len, temperature=0.0, ignore_eos=True, cache_salt=salt
                )
            )
        for p in prompts:  # what an ideal page cache could hold when this round starts
            keys = _page_keys(p[: (len(p) - 1) // ps * ps], ps)
            bound += ps * next((i + 1 for i in range(len(keys) - 1, -1, -1) if keys[i] in seen), 0)
        # Within a round, the first request's system prompt can serve the others.
        if k == 0:
            bound += (len(prompts) - 1) * (min(args.system_tokens, len(prompts[0]) - 1) // ps) * ps
        outs = llm.generate(prompts, params)
        for c, p, out in zip(convs, prompts, outs, strict=True):
            prompt_tokens += len(p)
            cached += out.num_cached_tokens
            history[c] = p + out.outputs[0].token_ids
            seen.update(_page_keys(history[c], ps))
        log(f"chat round {k}: {len(prompts)} requests")
    return {
        "chat_conversations": len(turns),
        "chat_requests": len(reqs),
        "chat_prompt_tokens": prompt_tokens,
        "chat_cached_tokens": cached,
        "chat_hit_rate": cached / prompt_tokens,
        "chat_hit_rate_bound": bound / prompt_tokens,
        "chat_s": time.perf_counter() - t0,
    }


def make_plot(out: dict, out_dir: Path) -> list[str]:
    """Cold vs warm TTFT bars (and the chat hit rate); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): skipping plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    cold, warm = out["ttft_cold_median_s"], out["ttft_warm_median_s"]
    bars = ax.bar(["cold (not cached)", "warm (cached)"], [1.0, warm / cold], color=["C1", "C0"])
    ax.bar_label(bars, labels=["1", f"{warm / cold:.3f}"])
    ax.set(ylabel="TTFT relative to cold", ylim=(0, 1.15))
    title = (
        f"{out['system_tokens']}-token system prompt, {out['model']} {out['dtype']} on "
        f"{out['environment']['device']}"
    )
    if "chat_hit_rate" in out:
        title += (
            f"\nchat hit rate {out['chat_hit_rate']:.2f} (ideal {out['chat_hit_rate_bound']:.2f})"
        )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = out_dir / "prefix_ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="tiny", choices=["demo", *sorted(PRESETS)])
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: the model's",
    )
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--message-tokens", type=int, default=24)
    p.add_argument("--reps", type=int, default=3, help="timed cold and warm requests each")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="the model's sliding window W in tokens (0: none; default: the preset's)",
    )
    p.add_argument(
        "--bucket-min-seqs",
        type=int,
        default=decode.Buckets.min_seqs,
        help="padding floor of the batch dimension (decode.Buckets.min_seqs)",
    )
    p.add_argument("--chat-conversations", type=int, default=8, help="0 skips the chat")
    p.add_argument("--chat-reply-median", type=float, default=32)
    p.add_argument("--chat-max-turns", type=int, default=4, help="cap on turns per conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot-dir", type=Path, default=DEFAULT_PLOT_DIR)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    for name in (
        "system_tokens",
        "message_tokens",
        "reps",
        "num_pages",
        "max_num_seqs",
        "bucket_min_seqs",
        "chat_max_turns",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.chat_conversations < 0:
        p.error(f"--chat-conversations must be >= 0, got {args.chat_conversations}")
    if not (math.isfinite(args.chat_reply_median) and args.chat_reply_median > 0):
        p.error(f"--chat-reply-median must be a finite number > 0, got {args.chat_reply_median}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.sliding_window is not None and args.sliding_window < 0:
        p.error(f"--sliding-window must be >= 0, got {args.sliding_window}")
    if args.sliding_window and args.model == "demo":
        p.error("--sliding-window takes a preset's --model, not demo")
    ps = args.page_size
    if ps < 1 or ps & (ps - 1):
        p.error(f"--page-size must be a power of two, got {ps}")
    workloads.make_plot_dir(p, args)
    # The engine admits a request whose K/V (all its tokens but the last) fits the pages
    # left after its watermark.
    usable = args.num_pages - int(planner.WATERMARK * args.num_pages)
    longest = args.system_tokens + args.message_tokens + 1
    if args.chat_conversations and args.model != "demo":
        longest = max(longest, args.max_model_len)  # a chat turn can grow to the limit
    window = args.sliding_window
    if window is None and args.model != "demo":
        window = PRESETS[args.model].sliding_window
    need = planner.peak_pages(
        longest, ps, sliding_window=window or None,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    if usable < need:
        p.error(
            f"--num-pages {args.num_pages} ({usable} usable) cannot hold a request of "
            f"{longest} tokens in pages of {ps} (it needs {need}; "
            "raise --num-pages, or lower --max-model-len or --system-tokens)"
        )
    if args.max_num_batched_tokens < args.system_tokens + args.message_tokens:
        p.error(
            f"--max-num-batched-tokens {args.max_num_batched_tokens} must hold the whole cold "
            f"prompt ({args.system_tokens + args.message_tokens} tokens)"
        )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    llm = build_llm(args)
    out = {
        "model": args.model,
        "model_source": llm.model_source,
        "dtype": llm.config.dtype,
        "system_tokens": args.system_tokens,
        "message_tokens": args.message_tokens,
        "page_size": args.page_size,
        "reps": args.reps,
    }
    chat = chat_workload(llm, args) if args.chat_conversations else None
    out.update(measure_ttft(llm, args))
    if chat is not None:
        out.update(chat_hit_rate(llm, args, chat))
    out["engine"] = llm.summary()
    out["environment"] = workloads.environment()
    out["plots"] = [] if args.no_plots else make_plot(out, args.plot_dir)
    out["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    env = out["environment"]
    print(
        f"prefix caching, {args.model} ({llm.model_source}), {out['dtype']}, on "
        f"{env['device']} ({env['platform']}), page size {args.page_size}"
    )
    print(
        f"TTFT, {args.system_tokens}-token system prompt + {args.message_tokens}-token "
        f"message, median of {args.reps}:"
    )
    print(
        f"  cold (not cached) {out['ttft_cold_median_s'] * 1e3:9.1f} ms   "
        f"warm (cached {out['expected_warm_cached_tokens']} tokens) "
        f"{out['ttft_warm_median_s'] * 1e3:8.1f} ms"
    )
    print(
        f"  ttft_warm_over_cold {out['ttft_warm_over_cold']:.4f} (target <= 0.10); "
        f"hits as expected: {out['hits_as_expected']}; compiles during timing: "
        f"{out['compiles_during_timing']}"
    )
    if args.chat_conversations:
        print(
            f"chat: {out['chat_conversations']} conversations, {out['chat_requests']} "
            f"requests, hit rate {out['chat_hit_rate']:.3f} "
            f"(ideal page cache {out['chat_hit_rate_bound']:.3f})"
        )
    for path in out["plots"]:
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
