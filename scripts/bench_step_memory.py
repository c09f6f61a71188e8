"""The step reserve against XLA's buffer assignment of the engine's real steps.

    python scripts/bench_step_memory.py                    # Llama-3-8B's shapes, a table
    python scripts/bench_step_memory.py --preset tiny --json

`resources.plan_num_pages` keeps `planner.step_peak_bytes` (one step's working memory:
activations, logits, sampling temporaries, a prompt-logprobs step's scoring, LoRA
updates) out of the KV budget, so a step the estimate undercounts can run out of device
memory under a full cache. This compiles, never runs, the engine's step
(`decode._step`) at the preset's shapes for a few kinds of step and prints XLA's
temporary bytes (`memory_analysis().temp_size_in_bytes`) and its outputs other than the
donated cache (sampled tokens, logprobs: the step holds them until they are read back)
beside the estimate at the step's padded (T, B), for an engine whose `max_logprobs` is
the case's. A ratio at or below 1 is what the reserve needs.

The weights, the cache and the LoRA slots are abstract (`jax.eval_shape`): nothing is
allocated, so an 8B model's shapes compile on a laptop. `--layers` layers (default 1:
each layer's buffers are reused by the next, and the estimate is per layer phase). The
attention kernels are replaced by a stub (their scratch is on chip, which the estimate
leaves out; XLA's reference attention gathers every page). On the CPU the default dtype
is float32: XLA:CPU upcasts bfloat16 matmuls to float32 copies a GPU does not make.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import types
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax import cache as cache_lib
from pagedjax import config, decode, lora, model, planner
from pagedjax.step_input import Buckets

MIB = 2**20
PAGE = 16


@dataclasses.dataclass(frozen=True)
class Case:
    """One kind of step: `num_seqs` sequences of `seq_len` tokens (decode: one token
    each, after `seq_len - 1` cached ones)."""

    name: str
    seq_len: int
    num_seqs: int
    decode: bool = False
    top_k: int | None = None  # prompt logprobs with this many top tokens (None: none; -1: V)
    max_logprobs: int = 20  # the engine's cap, which sizes the reserve (-1: no cap)
    max_loras: int = 0  # LoRA slots 1..max_loras in use (0: no LoRA)
    rank: int = 0


CASES = (
    Case("prefill, the default budget", 128, 8),
    Case("prefill, 8192 tokens", 512, 16),
    Case("decode, 256 rows", 512, 256, decode=True),
    Case("prompt logprobs k=20, 1024 tokens", 128, 8, top_k=20),
    Case("prompt logprobs k=5, 8192 tokens", 8192, 1, top_k=5),
    Case("prompt logprobs k=V, 1024 tokens", 128, 8, top_k=-1, max_logprobs=-1),
    Case("LoRA 4 x rank 16, 1024 tokens", 128, 8, max_loras=4, rank=16),
)


def _stub_attention(q, k_pages, v_pages, *args, **kwargs):
    """The kernel's place: q itself, tied to the pools so that they stay live."""
    return q + (k_pages[0, 0, 0] * 0 + v_pages[0, 0, 0] * 0).astype(q.dtype)


@contextlib.contextmanager
def stubbed_attention():
    """`model`'s attention kernels replaced by `_stub_attention` while inside."""
    real = model.pallas_kernels
    model.pallas_kernels = types.SimpleNamespace(
        paged_decode_attention=_stub_attention, ragged_paged_attention=_stub_attention
    )
    try:
        yield
    finally:
        model.pallas_kernels = real


def step_bytes(cfg: config.ModelConfig, case: Case) -> tuple[int, int, int, int]:
    """(XLA's temporary bytes, its output bytes but the donated cache's, T, B) of the
    compiled step of `case` (attention stubbed: call it inside `stubbed_attention`)."""
    chunks, nxt, n = [], 1, -(-case.seq_len // PAGE)
    for i in range(case.num_seqs):
        slot = 1 + i % case.max_loras if case.max_loras else 0
        pages = list(range(nxt, nxt + n))
        if case.decode:
            chunk = decode.SeqChunk([3 + i % 7], case.seq_len - 1, pages, lora_slot=slot)
        else:
            tokens = [3 + j % 7 for j in range(case.seq_len)]
            chunk = decode.SeqChunk(tokens, 0, pages, lora_slot=slot)
        chunks.append(chunk)
        nxt += n
    cc = config.CacheConfig(page_size=PAGE, num_pages=nxt, dtype=cfg.dtype)
    inp = decode.build_step_input(chunks, cfg, cc, buckets=Buckets(min_pages=1))
    if case.top_k is not None:
        inp = dataclasses.replace(inp, target_ids=jnp.zeros_like(inp.token_ids))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.Llama(cfg, rngs=nnx.Rngs(0))))
    params = model.Params(graphdef=graphdef, state=state, config=cfg)
    cache = jax.eval_shape(lambda: cache_lib.create(cfg, cc))
    weights = None
    if case.max_loras:
        weights = jax.eval_shape(lambda: lora.create_lora_weights(cfg, case.max_loras, case.rank))
    # A jit of its own: the engine's jitted steps must not cache the stubbed trace.
    step = jax.jit(
        partial(decode._step, decode=inp.decode),
        static_argnames=decode._STATIC,
        donate_argnames="cache",
    )
    traced = step.trace(
        params,
        cache,
        inp,
        weights,
        backend="xla",
        interpret=False,
        num_top_logprobs=0,
        num_prompt_top_logprobs=cfg.vocab_size if case.top_k == -1 else case.top_k or 0,
        return_logits=False,
    )
    stats = traced.lower().compile().memory_analysis()
    if stats is None:
        raise RuntimeError(f"no memory_analysis() on the {jax.default_backend()} backend")
    outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
    return stats.temp_size_in_bytes, outputs, inp.token_ids.shape[0], inp.logits_indices.shape[0]


def measure(cfg: config.ModelConfig, cases=CASES) -> list[dict]:
    """One row per case the model's positions allow: XLA's temporary and output bytes, the
    estimate and their ratio."""
    rows = []
    with stubbed_attention():
        for case in cases:
            if case.seq_len > cfg.max_position_embeddings:
                continue  # (a preset of short sequences: `tiny`)
            temp, outputs, t, b = step_bytes(cfg, case)
            est = planner.step_peak_bytes(
                cfg,
                t,
                b,
                lora_columns=case.max_loras * case.rank,
                logprob_columns=planner.logprob_columns(case.max_logprobs, cfg.vocab_size),
            )
            rows.append(
                dict(
                    case=case.name,
                    tokens=t,
                    rows=b,
                    xla_temp_bytes=temp,
                    xla_output_bytes=outputs,
                    estimate_bytes=est,
                    ratio=round((temp + outputs) / est, 3),
                )  # fmt: skip
            )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(config.PRESETS))
    ap.add_argument("--layers", type=int, default=1, help="layers compiled (default 1)")
    ap.add_argument(
        "--dtype",
        default=None,
        help="model dtype (default: float32 on the CPU, the preset's elsewhere)",
    )
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    backend = jax.default_backend()
    cfg = config.PRESETS[args.preset]
    dtype = args.dtype or ("float32" if backend == "cpu" else cfg.dtype)
    try:
        cfg = dataclasses.replace(cfg, num_layers=args.layers, dtype=dtype)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    rows = measure(cfg)
    head = dict(
        backend=backend, device=str(jax.devices()[0].device_kind), jax=jax.__version__,
        preset=args.preset, layers=args.layers, dtype=dtype,
    )  # fmt: skip
    if args.json:
        print(json.dumps(dict(head, rows=rows), indent=1))
        return 0
    print(", ".join(f"{k} {v}" for k, v in head.items()))
    print(
        f"{'case':<36} {'T':>6} {'B':>5} {'temp MiB':>9} {'outputs MiB':>12} "
        f"{'estimate MiB':>13} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['case']:<36} {r['tokens']:>6} {r['rows']:>5} {r['xla_temp_bytes'] / MIB:>9.1f} "
            f"{r['xla_output_bytes'] / MIB:>12.1f} {r['estimate_bytes'] / MIB:>13.1f} "
            f"{r['ratio']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
