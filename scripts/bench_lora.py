"""LoRA's cost on the decode path: the engine without LoRA vs with it enabled, in one run.

    python scripts/bench_lora.py                       # tiny preset, random weights
    python scripts/bench_lora.py --model llama3-8b --batch 1 32 128 --max-loras 4 --json

Three systems on the same model (a preset with random weights) and workload (B random
`--prompt-len` token prompts, greedy, exactly `--gen-len` tokens, EOS ignored):

- ``base``: `LLM(params)`, no LoRA.
- ``idle``: `LLM(params, enable_lora=True, max_loras=S, max_lora_rank=R)`, requests with
  no adapter: what enabling LoRA costs traffic that does not use it (a step with no
  adapter runs the base model's program, `pagedjax.lora`; its tokens must equal
  base's, `idle_tokens_match`).
- ``mixed``: the same engine, request i with adapter i mod S (random rank-R adapters
  on every target module, written as PEFT directories to a temporary folder): min(B, S)
  adapters in a batch of B.

Rates are measured as scripts/bench_decode.py measures them (its `measure`: warm-up
untimed, the three interleaved `--reps` times, decode tokens/s from the median gap
between whole-batch decode steps; e2e from the best whole run). On a CPU, read the
ratios (`idle_over_base`, `mixed_over_base`), not the rates: the update is two matmuls
over S*R columns per projection, whose share of a step depends on the hardware.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402
import workloads  # noqa: E402

from pagedjax import lora  # noqa: E402
from pagedjax import model as model_lib  # noqa: E402
from pagedjax.config import PRESETS  # noqa: E402
from pagedjax.engine import LLM, SamplingParams  # noqa: E402
from pagedjax.resources import BACKENDS  # noqa: E402


def write_adapter(path: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of `rank` on every target module of every layer."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, block in lora.TARGET_MODULES.items():
            n_in, n_out = lora.module_dims(cfg, module)
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            scale = 1 / np.sqrt(n_in)
            a = rng.standard_normal((rank, n_in), np.float32) * scale
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((n_out, rank), np.float32) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(conf))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="engine attention backend")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4, help="adapters: S slots, S in use")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=3, help="timed runs per point and system")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    if args.prompt_len < 1 or args.gen_len < 3:  # the decode rate needs two decode steps
        p.error(f"need --prompt-len >= 1 and --gen-len >= 3, got {args.prompt_len}, {args.gen_len}")
    for name in ("max_loras", "lora_rank", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batch) < 1:
        p.error(f"--batch sizes must be >= 1, got {args.batch}")
    ps = args.page_size
    if ps < 1 or ps & (ps - 1):
        p.error(f"--page-size must be a power of two, got {ps}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    seq_len = args.prompt_len + args.gen_len
    cfg = workloads.preset_config(args.model, dtype=args.dtype, min_positions=seq_len)
    params = model_lib.init_params(cfg, args.seed)
    top = max(args.batch)
    geometry = dict(
        page_size=args.page_size,
        num_pages=top * -(-seq_len // args.page_size) + 8,
        max_num_seqs=top,
        max_num_batched_tokens=max(1024, top),
        max_model_len=seq_len,
        backend=args.backend,
        seed=args.seed,
    )
    base = LLM(params, **geometry)
    s, r = args.max_loras, args.lora_rank
    with_lora = LLM(params, enable_lora=True, max_loras=s, max_lora_rank=r, **geometry)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reqs = []
        for i in range(s):
            write_adapter(Path(tmp) / f"a{i}", cfg, r, args.seed + i)
            reqs.append(lora.LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        for b in sorted(set(args.batch)):
            rng = np.random.default_rng(args.seed)
            runners = {
                "base": bench_decode.paged_runner(base, b, args, rng),
                "idle": bench_decode.paged_runner(with_lora, b, args, rng),
                "mixed": bench_decode.paged_runner(
                    with_lora, b, args, rng, [reqs[i % s] for i in range(b)]
                ),
            }
            m = bench_decode.measure(runners, dict.fromkeys(runners, b), args.gen_len, args.reps)
            # Without an adapter the LoRA engine computes what the base one does.
            prompts = [p.tolist() for p in m["prompts"]]
            sp = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
            pairs = zip(base.generate(prompts, sp), with_lora.generate(prompts, sp), strict=True)
            match = np.mean([x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in pairs])
            row = {"batch": b, "compiles_during_timing": m["compiles_during_timing"]}
            for k in runners:
                row[f"{k}_tokens_per_s"] = m[k]["tokens_per_s"]
                row[f"{k}_e2e_tokens_per_s"] = m[k]["e2e_tokens_per_s"]
            for k in ("idle", "mixed"):
                row[f"{k}_over_base"] = bench_decode._ratio(
                    row[f"{k}_tokens_per_s"], row["base_tokens_per_s"]
                )
                row[f"e2e_{k}_over_base"] = (
                    row[f"{k}_e2e_tokens_per_s"] / row["base_e2e_tokens_per_s"]
                )
            row["idle_tokens_match"] = float(match)
            rows.append(row)
            bench_decode.log(
                f"batch {b:4d}: base {bench_decode._rate(row['base_tokens_per_s'])} tok/s, "
                f"idle x{row['idle_over_base'] or float('nan'):.3f}, "
                f"mixed x{row['mixed_over_base'] or float('nan'):.3f}"
            )
    out = {
        "model": args.model,
        "dtype": cfg.dtype,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "max_loras": s,
        "lora_rank": r,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"LoRA on the decode path: {args.model} ({cfg.dtype}) on {out['device']}, "
        f"{s} adapters of rank {r}, prompt {args.prompt_len} + {args.gen_len} tokens"
    )
    head = ("batch", "base tok/s", "idle/base", "mixed/base", "e2e mixed/base")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 10, 9, 10, 14), strict=True)))
    for row in rows:
        idle, mixed = row["idle_over_base"], row["mixed_over_base"]
        print(
            f"{row['batch']:5d} {bench_decode._rate(row['base_tokens_per_s']):>10} "
            f"{'n/a' if idle is None else f'{idle:.3f}':>9} "
            f"{'n/a' if mixed is None else f'{mixed:.3f}':>10} "
            f"{row['e2e_mixed_over_base']:14.3f}"
        )
    if jax.devices()[0].platform == "cpu":
        print("(CPU: read the ratios, not the rates)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
