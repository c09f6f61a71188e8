"""Decode throughput: the paged engine vs a contiguous-KV baseline, in one KV budget.

    python scripts/bench_decode.py                      # tiny preset, random weights
    python scripts/bench_decode.py --model llama3-8b --kv-budget-tokens 262144 --json

Workload: B requests, each a random `--prompt-len` token prompt, greedy, exactly
`--gen-len` generated tokens (EOS ignored). Both systems run the same model (a
preset with random weights; the values do not change the timing) on JAX's default
device:

- ``paged``: `pagedjax.engine.LLM` as shipped (continuous batching, paged KV cache of
  `--kv-budget-tokens // page_size` pages, attention through `pallas_kernels`'s
  dispatch: the Pallas kernels on a GPU/TPU, the XLA reference on a CPU).
- ``contiguous``: a dense KV cache preallocated at `max_seq_len` per sequence,
  `[L, B, max_seq_len, K, D]` for K and V, built here from `pagedjax.model`'s modules
  (embedding, RMSNorm, QKV + RoPE, SwiGLU, LM head: the same weights and code);
  attention is dense over the whole preallocated length with a causal mask (a static
  KV cache, as in gpt-fast or HF's StaticCache). One jitted step for the whole batch
  with the cache donated; prefill is one call, then one call per token, tokens
  copied to the host every step as a server must (EOS checks, streaming).

Decode tokens/s: after an untimed warm-up run of the same shapes (compile time
excluded; the script checks that nothing was traced while timed), each system runs
the batch `--reps` times, the two alternating so that load from other jobs falls on
both alike. Each run stamps the end of every step in which the whole batch decoded
(the engine: its `on_step` hook after pure decode steps of B rows; the baseline:
when the step's tokens reach the host), and the decode rate is B / median(interval
between stamps): the steady-state rate, robust to the stalls a shared machine
causes (null, "n/a" in the table, where no two consecutive steps decoded the whole
batch: a batch whose prompts take several prefill steps, with a short `--gen-len`;
`--gen-len` must be at least 3). `e2e` is B * gen_len / (best wall time of a whole
`generate`, prefill and ramp-up included).

Capacity: in a KV budget of `--kv-budget-tokens` token slots (bytes: that times the
model's K+V bytes per token), the contiguous cache holds `budget // max_seq_len`
sequences whatever their length; the paged cache holds `(pages - watermark) //
ceil((prompt_len + gen_len) / page_size)` of this workload's sequences, and it is run
at that batch too (its preemption count, 0, shows it really fit). At a batch the
contiguous cache cannot hold, the baseline runs at its largest batch instead,
interleaved with the engine as usual, so `paged_over_contiguous` at the paged
engine's largest batch is the throughput each system gets out of the same KV memory
(`throughput_at_max_batch_ratio`). Greedy tokens of the two systems are compared where
they run the same batch (`tokens_match`, the fraction of equal tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

from pagedjax import decode, planner  # noqa: E402
from pagedjax import model as model_lib  # noqa: E402
from pagedjax.config import PRESETS  # noqa: E402
from pagedjax.engine import LLM, SamplingParams  # noqa: E402
from pagedjax.resources import BACKENDS  # noqa: E402

DEFAULT_PLOT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ contiguous baseline


def _dense_step(params, k_cache, v_cache, tokens, start, *, max_seq_len):
    """One step over a dense cache: every row feeds `T` tokens at positions start + t.

    Args:
      params: the split model.
      k_cache, v_cache: [L, B, M, K, D] (M = max_seq_len), donated.
      tokens: [B, T] int32.
      start: int32 scalar, position of tokens[:, 0] (equal for every row).

    Returns:
      ([B] int32 greedy next tokens, k_cache, v_cache).
    """
    m = params.merge()
    cfg = m.cfg
    inv_freq = model_lib.rope_frequencies(cfg)
    t = tokens.shape[1]
    positions = start + jnp.arange(t, dtype=jnp.int32)  # [T]
    visible = jnp.arange(max_seq_len)[None, :] <= positions[:, None]  # [T, M]
    x = m.embed_tokens(tokens)  # [B, T, E]
    kh, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), positions, inv_freq)  # [B, T, *, D]
        k_cache = k_cache.at[i].set(
            jax.lax.dynamic_update_slice_in_dim(k_cache[i], k.astype(k_cache.dtype), start, 1)
        )
        v_cache = v_cache.at[i].set(
            jax.lax.dynamic_update_slice_in_dim(v_cache[i], v.astype(v_cache.dtype), start, 1)
        )
        b, _, h, d = q.shape
        qg = q.reshape(b, t, kh, g, d).astype(jnp.float32)
        s = jnp.einsum("btkgd,bmkd->bkgtm", qg, k_cache[i].astype(jnp.float32)) * d**-0.5
        p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1)
        o = jnp.einsum("bkgtm,bmkd->btkgd", p, v_cache[i].astype(jnp.float32))
        x = x + attn.out(o.reshape(b, t, h, d).astype(x.dtype))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = m.logits(x[:, -1])  # [B, V] float32
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), k_cache, v_cache


class Contiguous:
    """Static-batch greedy generation over a preallocated dense KV cache."""

    def __init__(self, params: model_lib.Params, max_seq_len: int):
        self.params, self.max_seq_len = params, max_seq_len

        def step(p, k, v, tok, start):
            _BASELINE_TRACES[0] += 1  # runs once per trace (= compile)
            return _dense_step(p, k, v, tok, start, max_seq_len=max_seq_len)

        self.step = jax.jit(step, donate_argnums=(1, 2))

    def cache_bytes(self, batch: int) -> int:
        return batch * self.max_seq_len * self.params.config.kv_bytes_per_token

    def generate(self, prompts: np.ndarray, gen_len: int, stamps: list | None = None):
        """prompts: [B, P] int32 -> [B, gen_len] int32 greedy tokens.

        `stamps` gets the time at the end of every decode step (tokens on the host).
        """
        cfg = self.params.config
        b, p = prompts.shape
        if p + gen_len > self.max_seq_len:
            raise ValueError(f"prompt {p} + gen {gen_len} exceeds max_seq_len {self.max_seq_len}")
        shape = (cfg.num_layers, b, self.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        k = jnp.zeros(shape, cfg.jnp_dtype)
        v = jnp.zeros(shape, cfg.jnp_dtype)
        tok, k, v = self.step(self.params, k, v, jnp.asarray(prompts), jnp.int32(0))
        out = [np.asarray(tok)]
        for j in range(gen_len - 1):
            tok, k, v = self.step(self.params, k, v, tok[:, None], jnp.int32(p + j))
            out.append(np.asarray(tok))  # to the host every step, as a server must
            if stamps is not None:
                stamps.append(time.perf_counter())
        return np.stack(out, axis=1)


# ------------------------------------------------------------------ timing


def _prompts(rng, batch: int, length: int, vocab: int) -> np.ndarray:
    return rng.integers(workloads.FIRST_TOKEN, vocab, (batch, length), dtype=np.int32)


_BASELINE_TRACES = [0]


def _compiles() -> int:
    """Step programs traced so far, engine and baseline."""
    return sum(decode.compile_counts().values()) + _BASELINE_TRACES[0]


def paged_runner(llm: LLM, batch: int, args, rng, lora_request=None):
    """A function that runs one batch through the engine: (total s, step gaps, extras).
    `lora_request`: as `LLM.generate` takes it (scripts/bench_lora.py)."""
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)

    def run() -> tuple[float, list[float], dict]:
        prompts = _prompts(rng, batch, args.prompt_len, vocab)
        stamps: list[float] = []
        seen = [llm.metrics.num_steps]

        def on_step(engine):  # stamps the end of every pure decode step of the whole batch
            if engine.metrics.num_steps != seen[0]:
                seen[0] = engine.metrics.num_steps
                rec = engine.metrics.steps[-1]
                stamps.append(time.perf_counter() if rec.decode and rec.num_rows == batch else 0)

        pre = llm.scheduler.num_preemptions
        t0 = time.perf_counter()
        outs = llm.generate(
            [p.tolist() for p in prompts], params, on_step=on_step, lora_request=lora_request
        )
        total = time.perf_counter() - t0
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if a and b]
        extra = {
            "prompts": prompts,
            "tokens": np.array([o.outputs[0].token_ids for o in outs]),
            "preemptions": llm.scheduler.num_preemptions - pre,
        }
        return total, gaps, extra

    return run


def contiguous_runner(base: Contiguous, batch: int, args, rng, vocab: int):
    """A function that runs one batch through the baseline: (total s, step gaps, {})."""

    def run() -> tuple[float, list[float], dict]:
        stamps: list[float] = []
        t0 = time.perf_counter()
        base.generate(_prompts(rng, batch, args.prompt_len, vocab), args.gen_len, stamps)
        total = time.perf_counter() - t0
        return total, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], {}

    return run


def measure(runners: dict, batches: dict, gen_len: int, reps: int) -> dict:
    """Warms every runner up, then times them in turn `reps` times (interleaved, so
    that load from other jobs falls on all of them alike). `batches`: runner -> B."""
    for run in runners.values():
        run()  # compiles every shape of this batch size
    before = _compiles()
    totals = {k: [] for k in runners}
    gaps = {k: [] for k in runners}
    extras = {}
    for _ in range(reps):
        for key, run in runners.items():
            total, g, extra = run()
            totals[key].append(total)
            gaps[key] += g
            for name, value in extra.items():
                extras[name] = value + extras.get(name, 0) if name == "preemptions" else value
    out = {"compiles_during_timing": _compiles() - before, **extras}
    for key in runners:
        # No gaps: no two consecutive steps decoded the whole batch (its prompts took
        # several prefill steps, which desynchronises the rows, and --gen-len is short).
        g = gaps[key]
        out[key] = {
            "tokens_per_s": batches[key] / float(np.median(g)) if g else None,
            "e2e_tokens_per_s": batches[key] * gen_len / min(totals[key]),
            "decode_steps_timed": len(gaps[key]),
        }
    return out


# ------------------------------------------------------------------ main


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None (JSON null) where `measure` has no rate."""
    return None if a is None or b is None else a / b


def _rate(x: float | None) -> str:
    return f"{'n/a':>9}" if x is None else f"{x:9.1f}"


def batch_sizes(max_paged: int, max_contig: int, limit: int | None) -> list[int]:
    top = max_paged if limit is None else min(limit, max_paged)
    sizes = {1 << i for i in range(top.bit_length()) if 1 << i <= top}
    sizes |= {b for b in (max_contig, top) if 1 <= b <= top}
    return sorted(sizes)


def make_plot(rows: list[dict], out_dir: Path, title: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): skipping plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("paged", "paged engine", "-o"), ("contiguous", "contiguous", "-s")):
        pts = [
            (r["batch"], r[f"{key}_tokens_per_s"])
            for r in rows
            if (key == "paged" or r["contiguous_fits"]) and r[f"{key}_tokens_per_s"] is not None
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)
    ref = next((r["contiguous_tokens_per_s"] for r in rows if r["batch"] == 1), None)
    if ref:
        ax.set_ylabel("decode tokens/s (relative to contiguous at batch 1)")
        for line in ax.get_lines():
            line.set_ydata(np.asarray(line.get_ydata()) / ref)
        ax.relim()
        ax.autoscale_view()
    fits = [r["batch"] for r in rows if r["contiguous_fits"]]
    if fits:
        ax.axvline(max(fits), color="gray", ls=":", label="contiguous: largest batch in budget")
    ax.set(xscale="log", xlabel="batch size")
    ax.set_xticks([r["batch"] for r in rows], [str(r["batch"]) for r in rows])
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "decode_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: the model's",
    )
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="engine attention backend")
    p.add_argument("--max-seq-len", type=int, default=512, help="contiguous preallocation")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-budget-tokens", type=int, default=4096, help="KV budget, token slots")
    p.add_argument("--max-batch", type=int, default=None, help="cap on the batch sizes run")
    p.add_argument("--reps", type=int, default=3, help="timed runs per point and system")
    p.add_argument(
        "--sync",
        action="store_true",
        help="the engine with async_scheduling=False (host applies tokens before each step)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot-dir", type=Path, default=DEFAULT_PLOT_DIR)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.prompt_len < 1 or args.gen_len < 3:  # the decode rate needs two decode steps
        p.error(
            f"need --prompt-len >= 1 and --gen-len >= 3, got {args.prompt_len=} {args.gen_len=}"
        )
    if args.prompt_len + args.gen_len > args.max_seq_len:
        p.error(
            f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} exceeds "
            f"--max-seq-len {args.max_seq_len}"
        )
    if args.kv_budget_tokens < args.max_seq_len:
        p.error(f"--kv-budget-tokens {args.kv_budget_tokens} < --max-seq-len {args.max_seq_len}")
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    ps = args.page_size
    if ps < 1 or ps & (ps - 1):
        p.error(f"--page-size must be a power of two, got {ps}")
    if args.max_batch is not None and args.max_batch < 1:
        p.error(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    workloads.make_plot_dir(p, args)
    num_pages = args.kv_budget_tokens // ps
    usable = num_pages - int(planner.WATERMARK * num_pages)  # the engine keeps it free
    seq_pages = -(-(args.prompt_len + args.gen_len) // ps)
    if usable < seq_pages:
        p.error(
            f"--kv-budget-tokens {args.kv_budget_tokens} gives {usable} usable pages of "
            f"{ps}, fewer than the {seq_pages} one sequence of --prompt-len + --gen-len "
            f"{args.prompt_len + args.gen_len} tokens needs"
        )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    cfg = workloads.preset_config(args.model, dtype=args.dtype, min_positions=args.max_seq_len)
    params = model_lib.init_params(cfg, args.seed)
    ps = args.page_size
    num_pages = args.kv_budget_tokens // ps
    seq_pages = -(-(args.prompt_len + args.gen_len) // ps)
    max_contig = args.kv_budget_tokens // args.max_seq_len
    # The engine's admission keeps its watermark free (default 1% of the pages).
    watermark_pages = int(planner.WATERMARK * num_pages)
    max_paged = (num_pages - watermark_pages) // seq_pages
    sizes = batch_sizes(max_paged, max_contig, args.max_batch)
    llm = LLM(
        params,
        page_size=ps,
        num_pages=num_pages,
        max_num_seqs=max(sizes),
        max_model_len=args.max_seq_len,
        backend=args.backend,
        seed=args.seed,
        async_scheduling=not args.sync,
    )
    base = Contiguous(params, args.max_seq_len)
    rng = np.random.default_rng(args.seed)
    rows = []
    for b in sizes:
        row = {"batch": b, "contiguous_fits": b <= max_contig, "paged_fits": b <= max_paged}
        # The baseline runs at the same batch, or at its largest where B does not fit,
        # interleaved with the engine so that both see the same machine load.
        cb = min(b, max_contig)
        runners = {
            "paged": paged_runner(llm, b, args, rng),
            "contiguous": contiguous_runner(base, cb, args, rng, cfg.vocab_size),
        }
        m = measure(runners, {"paged": b, "contiguous": cb}, args.gen_len, args.reps)
        pg, ct = m["paged"], m["contiguous"]
        row.update(
            paged_tokens_per_s=pg["tokens_per_s"],
            paged_e2e_tokens_per_s=pg["e2e_tokens_per_s"],
            paged_preemptions=m["preemptions"],
            compiles_during_timing=m["compiles_during_timing"],
            contiguous_batch=cb,
            contiguous_tokens_per_s=ct["tokens_per_s"],
            contiguous_e2e_tokens_per_s=ct["e2e_tokens_per_s"],
            paged_over_contiguous=_ratio(pg["tokens_per_s"], ct["tokens_per_s"]),
            e2e_paged_over_contiguous=pg["e2e_tokens_per_s"] / ct["e2e_tokens_per_s"],
        )
        if row["contiguous_fits"]:
            ref = base.generate(m["prompts"], args.gen_len)
            row["tokens_match"] = float(np.mean(ref == m["tokens"]))
        log(
            f"batch {b:4d}: paged {_rate(row['paged_tokens_per_s'])} tok/s, contiguous "
            f"(batch {cb}) {_rate(row['contiguous_tokens_per_s'])} tok/s"
        )
        rows.append(row)
    top = rows[-1]
    kv_per_token = cfg.kv_bytes_per_token
    out = {
        "model": args.model,
        "dtype": cfg.dtype,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "max_seq_len": args.max_seq_len,
        "page_size": ps,
        "kv_budget_tokens": args.kv_budget_tokens,
        "kv_budget_bytes": args.kv_budget_tokens * kv_per_token,
        "max_batch_contiguous": max_contig,
        "max_batch_paged": max_paged,
        "max_batch_ratio": max_paged / max_contig,
        "throughput_at_max_batch_ratio": top["paged_over_contiguous"],
        "e2e_throughput_at_max_batch_ratio": top["e2e_paged_over_contiguous"],
        "rows": rows,
        "environment": workloads.environment(),
    }
    if max(sizes) < max_paged:
        out["note"] = f"batches capped at --max-batch {args.max_batch} < {max_paged}"
    title = (
        f"{args.model} {cfg.dtype}, prompt {args.prompt_len} + gen {args.gen_len}, "
        f"KV budget {args.kv_budget_tokens} tokens ({out['environment']['device']})"
    )
    out["plots"] = [] if args.no_plots else make_plot(rows, args.plot_dir, title)
    out["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(out, indent=1, allow_nan=False))
        return 0
    print(f"decode throughput: {title}")
    ref = rows[0]["contiguous_tokens_per_s"]  # never None: the baseline times every step

    def rel(x: float | None, digits: int) -> str:
        return f"{'n/a':>{digits}}" if x is None else f"{x:{digits}.2f}"

    print("decode rates relative to contiguous at batch 1 (absolute tok/s in --json)")
    print(f"{'batch':>6} {'paged':>8} {'contig (batch)':>15} {'paged/contig':>13} {'match':>6}")
    for r in rows:
        match = f"{r['tokens_match']:6.3f}" if "tokens_match" in r else f"{'-':>6}"
        print(
            f"{r['batch']:6d} {rel(_ratio(r['paged_tokens_per_s'], ref), 8)} "
            f"{r['contiguous_tokens_per_s'] / ref:8.2f} ({r['contiguous_batch']:4d}) "
            f"{rel(r['paged_over_contiguous'], 13)} {match}"
        )
    top_ratio = out["throughput_at_max_batch_ratio"]
    print(
        f"largest batch in the budget: paged {max_paged}, contiguous {max_contig} "
        f"({out['max_batch_ratio']:.2f}x); throughput at each one's largest batch: "
        + ("n/a" if top_ratio is None else f"{top_ratio:.2f}x")
    )
    for path in out["plots"]:
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
