"""Ragged paged attention benchmark cases: chunked prefill and mixed prefill+decode batches.

    python scripts/bench_ragged_cases.py          # CPU: a tiny interpret-mode correctness check
    python scripts/bench_ragged_cases.py --quick  # GPU: the ragged family through bench_kernels

Building blocks for `scripts/bench_kernels.py` (which adds a "ragged" family with
`Family("ragged", bench_ragged_cases.run_family, bench_ragged_cases.COLUMNS)`):

* `cases(gpu=True)`: the shapes (Llama-3-8B heads: H=32, K=8, D=128, bf16, page 16);
* `make_inputs(case, key)`: random pools, shuffled page tables, the kernel's arguments;
* `run_ours(inputs, **tuning)`: our Pallas kernel; `run_reference(inputs)`: the XLA
  reference (float32 math, per group of equal q_len, so it fits in memory);
* `run_bundled(inputs)`: JAX's bundled kernel where one computes the whole case,
  else None (`bundled_name(case)` says which): only decode rows -> bundled
  `paged_attention`; a fresh prefill (every q_len == context_len, one length) ->
  bundled `attention.mha` over dense K/V gathered and repeated to H heads outside
  the timing; a chunk over a cached prefix (or a mixed batch) -> none: `mha`'s
  causal mask assumes queries and keys start together;
* `flops(case)` and `bytes(case)`: useful attention FLOPs (QK and PV over the
  visible pairs) and the minimum HBM traffic (each sequence's K/V once, q and out),
  so the harness can report TFLOP/s and GB/s against its measured ceilings.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import traceback
import warnings
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from bench_harness import rel_error  # (scripts/ is on the path: these run from it)

from pallas_kernels import reference
from pallas_kernels.ragged.gpu import default_tuning, ragged_paged_attention_gpu


@dataclasses.dataclass(frozen=True)
class RaggedCase:
    """One batch: sequence b has q_lens[b] new tokens and context_lens[b] tokens in cache."""

    name: str
    q_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int = 32  # Llama-3-8B: 32 query heads, 8 kv heads, D=128
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"
    pad_rows: int = 0  # bucket padding past query_start_loc[B]

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens) + self.pad_rows

    @property
    def max_pages(self) -> int:
        return -(-max(self.context_lens) // self.page_size)

    @property
    def kv_bytes(self) -> int:
        """K and V bytes of every sequence's context."""
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * sum(self.context_lens) * self.num_kv_heads * self.head_dim * itemsize


def cases(gpu: bool = True) -> list[RaggedCase]:
    """The benchmark shapes (gpu=True) or tiny ones for the interpreter."""
    if not gpu:
        small = dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=8)
        return [
            RaggedCase("tiny mixed", (5, 1, 0, 3, 1), (21, 9, 4, 3, 16), pad_rows=2, **small),
            RaggedCase("tiny decode", (1, 1, 1), (17, 32, 5), **small),
            RaggedCase("tiny fresh prefill", (16, 16), (16, 16), **small),
        ]
    return [
        RaggedCase("chunk 512 over 4096, 8 seqs", (512,) * 8, (4608,) * 8),
        RaggedCase("chunk 512 + 128 decode @4096", (512,) + (1,) * 128, (4608,) + (4096,) * 128),
        RaggedCase("decode 128 @4096", (1,) * 128, (4096,) * 128),
        RaggedCase("fresh prefill 2048, 4 seqs", (2048,) * 4, (2048,) * 4),
    ]


def visible_pairs(case: RaggedCase) -> int:
    """(query, key) pairs inside the causal mask, over the batch."""
    return sum(
        n * (c - n) + n * (n + 1) // 2 for n, c in zip(case.q_lens, case.context_lens, strict=True)
    )


def flops(case: RaggedCase) -> float:
    """Useful attention FLOPs: QK^T and PV, 2 * D each per visible pair and head."""
    return 4.0 * case.num_heads * case.head_dim * visible_pairs(case)


def bytes(case: RaggedCase) -> float:  # noqa: A001 - the harness's name for it
    """Minimum HBM traffic: every sequence's K/V once, the queries and the output."""
    itemsize = jnp.dtype(case.dtype).itemsize
    q_and_out = 2 * case.num_tokens * case.num_heads * case.head_dim * itemsize
    meta = 4 * (case.batch * (case.max_pages + 2) + 1)
    return float(case.kv_bytes + q_and_out + meta)


def make_inputs(case: RaggedCase, key) -> dict:
    """Random q and page pools, each sequence's pages shuffled across the pool.

    Returns:
      dict of the kernel's arguments (q, k_pages, v_pages, page_table, context_lens,
      query_start_loc) plus "case" (the static description).
    """
    kq, kk, kv, kp = jax.random.split(key, 4)
    dtype = jnp.dtype(case.dtype)
    pages_per_seq = [-(-c // case.page_size) for c in case.context_lens]
    num_pages = sum(pages_per_seq) + 1
    shape = (case.num_kv_heads, num_pages, case.page_size, case.head_dim)
    perm = np.asarray(jax.random.permutation(kp, num_pages)).astype(np.int32)
    table = np.full((case.batch, case.max_pages), perm[-1], np.int32)  # padding: a spare page
    start = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = perm[start : start + n]
        start += n
    return dict(
        q=jax.random.normal(kq, (case.num_tokens, case.num_heads, case.head_dim), dtype),
        k_pages=jax.random.normal(kk, shape, dtype),
        v_pages=jax.random.normal(kv, shape, dtype),
        page_table=jnp.asarray(table),
        context_lens=jnp.asarray(case.context_lens, jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(case.q_lens)]), jnp.int32),
        case=case,
    )


ARG_NAMES = ("q", "k_pages", "v_pages", "page_table", "context_lens", "query_start_loc")


def arrays(inputs: dict) -> tuple:
    return tuple(inputs[name] for name in ARG_NAMES)


def run_ours(inputs: dict, *, interpret: bool = False, **tuning):
    """Our kernel on `inputs` -> [T, H, D]."""
    return ragged_paged_attention_gpu(*arrays(inputs), interpret=interpret, **tuning)


def run_reference(inputs: dict):
    """XLA reference in float32 -> [T, H, D] float32 (jit-able; the case is static).

    `reference.ragged_paged_attention_xla` contracts every query against every
    sequence ([T, B, H, max_len] logits: 48 GB for the mixed case), so sequences
    of equal q_len are gathered and run together with `reference.attention_chunk`.
    """
    case = inputs["case"]
    q, k_pages, v_pages, table, ctx, loc = arrays(inputs)
    f32 = jnp.float32
    k_pages, v_pages = k_pages.astype(f32), v_pages.astype(f32)
    out = jnp.zeros(q.shape, f32)
    starts = np.concatenate([[0], np.cumsum(case.q_lens)])
    for n in sorted(set(case.q_lens) - {0}):
        seqs = np.array([b for b, m in enumerate(case.q_lens) if m == n])
        rows = starts[seqs][:, None] + np.arange(n)[None, :]  # [G, n]
        k = reference.gather_pages(k_pages, table[seqs])  # [G, max_len, K, D]
        v = reference.gather_pages(v_pages, table[seqs])
        o = jax.vmap(_chunk)(q[rows].astype(f32), k, v, ctx[seqs])  # [G, n, H, D]
        out = out.at[rows.reshape(-1)].set(o.reshape(-1, *q.shape[1:]))
    del loc  # the static case gives the same rows
    return out


def _chunk(q, k, v, context_len):
    return reference.attention_chunk(q, k, v, context_len=context_len)


def bundled_name(case: RaggedCase) -> str | None:
    """Which of JAX's bundled kernels computes the whole case, if any."""
    if case.pad_rows == 0 and set(case.q_lens) == {1}:
        return "pallas.ops.gpu.paged_attention"
    if (
        case.pad_rows == 0
        and len(set(case.q_lens)) == 1
        and tuple(case.q_lens) == tuple(case.context_lens)
    ):
        return "pallas.ops.gpu.attention.mha (dense, heads repeated)"
    return None


def bundled_args(inputs: dict):
    """(fn, args) for JAX's bundled kernel on this case, or None; args built outside timing."""
    case = inputs["case"]
    name = bundled_name(case)
    if name is None:
        return None
    q, k_pages, v_pages, table, ctx, _ = arrays(inputs)
    scale = case.head_dim**-0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.endswith("paged_attention"):
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

            # The bundled kernel has no scale argument: pre-scale the query.
            q = (q.astype(jnp.float32) * scale).astype(q.dtype)
            splits = math.gcd(case.max_pages, 16)
            fn = partial(
                paged_attention,
                k_splits=splits,
                pages_per_compute_block=min(8, case.max_pages // splits),
            )
            return fn, (q, k_pages, v_pages, table, ctx)
        from jax.experimental.pallas.ops.gpu.attention import mha

        n = case.q_lens[0]
        group = case.num_heads // case.num_kv_heads

        def dense(pages):  # [B, n, H, D]
            return jnp.repeat(reference.gather_pages(pages, table)[:, :n], group, axis=2)

        fn = partial(mha, segment_ids=None, sm_scale=scale, causal=True)
        return fn, (q.reshape(case.batch, n, *q.shape[1:]), dense(k_pages), dense(v_pages))


def run_bundled(inputs: dict):
    """JAX's bundled kernel -> [T, H, D], or None where none applies (see bundled_name)."""
    built = bundled_args(inputs)
    if built is None:
        return None
    fn, args = built
    return fn(*args).reshape(inputs["q"].shape)


def tuning_sweep(case: RaggedCase) -> list[dict]:
    """Alternatives to the default tuning, to see whether the defaults are right."""
    base = default_tuning(
        case.num_tokens,
        case.batch,
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        case.dtype,
    )
    return [
        dict(block_q=2 * base["block_q"], num_warps=8),
        dict(block_q=max(1, base["block_q"] // 2)),
        dict(block_kv=2 * base["block_kv"]),
        dict(block_kv=max(16, base["block_kv"] // 2)),
        dict(num_stages=base["num_stages"] + 1),
        dict(num_warps=8 if base["num_warps"] == 4 else 4),
    ]


def tolerance(case: RaggedCase) -> float:
    return 1e-2 if case.dtype == "bfloat16" else 1e-4


# ---------------------------------------------------------------- the "ragged" family

COLUMNS = (
    ("case", "case", ""),
    ("ours_us", "ours us", ".1f"),
    ("ours_tflops", "TFLOP/s", ".1f"),
    ("ours_frac_matmul", "of mm", ".2f"),
    ("ours_gbps", "GB/s", ".0f"),
    ("ours_frac_copy", "of copy", ".2f"),
    ("bundled_us", "bundled us", ".1f"),
    ("speedup_vs_bundled", "x bundled", ".2f"),
    ("xla_us", "xla ref us", ".1f"),
    ("ours_best_us", "best us", ".1f"),
    ("prefetch_over_default", "prefetch/def", ".2f"),
    ("prefetch_kv64_over_default", "pf kv64/def", ".2f"),
    ("err_ours", "err ours", ".1e"),
    ("err_bundled", "err bundled", ".1e"),
    ("ok", "ok", ""),
)


def check_cpu_case(case: RaggedCase, log=print) -> dict:
    """Correctness only, in the Pallas interpreter.

    Also checks `run_reference` against `reference.ragged_paged_attention_xla` and
    JAX's bundled kernel (interpreted) where one applies; the bundled kernel's error
    is reported but does not fail the check.
    """
    inputs = make_inputs(case, jax.random.key(0))
    ref = run_reference(inputs)
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in arrays(inputs)]
    row = dict(case=case.name)
    row["err_reference"] = rel_error(ref, reference.ragged_paged_attention_xla(*f32))
    try:
        row["err_ours"] = rel_error(run_ours(inputs, interpret=True), ref)
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["err_ours"] = f"{type(e).__name__}: {e}"
    bundled = bundled_args(inputs)
    if bundled is not None:
        fn, args = bundled
        try:
            out = fn(*args, interpret=True).reshape(ref.shape)
            row["err_bundled"] = rel_error(out, ref)
        except Exception as e:  # noqa: BLE001 - JAX's kernel is reported, not ours to fix
            row["error_bundled"] = f"{type(e).__name__}: {str(e)[:200]}"
    errs = (row["err_ours"], row["err_reference"])
    row["ok"] = all(isinstance(e, float) and e <= tolerance(case) for e in errs)
    log(f"  {case.name}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "case"))
    return row


def gpu_case(case: RaggedCase, env, bk) -> dict:
    """One case on the GPU: checks on the device, then timings (bk: bench_kernels)."""
    row = dict(
        case=case.name,
        tuning=default_tuning(
            case.num_tokens,
            case.batch,
            case.num_heads,
            case.num_kv_heads,
            case.head_dim,
            case.dtype,
        ),
    )
    nbytes, nflops = bytes(case), flops(case)
    copies = bk.rotating_copies(case.kv_bytes)
    calls = copies * math.ceil(min(16, max(4, 2 * 2**30 / nbytes)) / copies)
    sets = [make_inputs(case, jax.random.key(seed)) for seed in range(copies)]
    ref = jax.block_until_ready(run_reference(sets[0]))
    tol = tolerance(case)
    try:
        row["err_ours"] = rel_error(run_ours(sets[0]), ref)
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["error_ours"] = bk.short_error(e)
    row["ok"] = row.get("err_ours", float("nan")) <= tol
    bundled = bundled_args(sets[0])
    if bundled is not None:
        try:
            fn, args = bundled
            row["err_bundled"] = rel_error(fn(*args).reshape(ref.shape), ref)
        except Exception as e:  # noqa: BLE001 - JAX's kernel is reported, not ours to fix
            row["error_bundled"] = bk.short_error(e)
    del ref

    q0 = sets[0]["q"]
    qs = [jax.random.normal(jax.random.key(100 + i), q0.shape, q0.dtype) for i in range(calls)]
    paged = [(qs[i], *arrays(sets[i % copies])[1:]) for i in range(calls)]

    def timed(name, fn, arg_sets):
        try:
            t = bk.time_calls(fn, arg_sets, env.iters)
        except Exception as e:  # noqa: BLE001 - reported in the row
            row.setdefault(f"error_{name.split()[0]}", bk.short_error(e))
            bk.log(f"    {name} failed: {bk.short_error(e)}")
            return None
        bk.log(f"    {name}: {t * 1e6:.1f} us")
        return t

    t = timed("ours", ragged_paged_attention_gpu, paged)
    if t:
        row.update(ours_us=t * 1e6, ours_tflops=nflops / t / 1e12, ours_gbps=nbytes / t / 1e9)
        if env.copy_gbps:
            row["ours_frac_copy"] = row["ours_gbps"] / env.copy_gbps
        if env.matmul_tflops:
            row["ours_frac_matmul"] = row["ours_tflops"] / env.matmul_tflops
    if bundled is not None:
        built = [bundled_args(dict(sets[i % copies], q=qs[i])) for i in range(calls)]
        tb = timed("bundled", built[0][0], [args for _, args in built])
        del built
        if tb:
            row["bundled_us"] = tb * 1e6
            if t:
                row["speedup_vs_bundled"] = tb / t
    # Where the default already has 3 stages the A/B is the knob alone: run it even
    # past the tuning budget.
    if t and not env.quick and (row["tuning"]["num_stages"] >= 3 or env.time_left() > 0):
        row.update(prefetch_ab(paged, row["tuning"], env, bk))
    if not env.quick:
        ref_fn = lambda *a: run_reference(dict(zip(ARG_NAMES, a, strict=True), case=case))  # noqa: E731
        tx = timed("xla ref", ref_fn, paged[: max(2, copies)])
        if tx:
            row["xla_us"] = tx * 1e6
        if t:
            best = (t, "default")
            for alt in tuning_sweep(case):
                if env.time_left() <= 0:
                    break
                ta = timed(f"ours {alt}", partial(ragged_paged_attention_gpu, **alt), paged)
                if ta and ta < best[0]:
                    best = (ta, alt)
            row.update(ours_best_us=best[0] * 1e6, ours_best_cfg=best[1])
    return row


def prefetch_ab(paged, tuning: dict, env, bk) -> dict:
    """`prefetch_rows=True` against the default in the same interleaved rounds, at 3
    stages or more (where Triton overlaps the loads with the dots): with the default's
    KV tile, and where that is above 64 tokens also with 64 (at the mostly-prefill
    defaults, Triton 3.9's sm90 build then takes 128 KiB of shared memory instead of
    224 and spills no registers, where the 128-token tile spills).

    Returns:
      Row entries: `<name>_over_default` (below 1: faster) and `<name>_cfg` for each
      alternative `name` that ran, `error_<name>` for one that did not.
    """
    stages = max(3, tuning["num_stages"])
    alts = {"prefetch": dict(prefetch_rows=True, num_stages=stages)}
    if tuning["block_kv"] > 64:
        alts["prefetch_kv64"] = dict(prefetch_rows=True, num_stages=stages, block_kv=64)
    out, runs = {}, {}
    for name, kw in {"default": {}, **alts}.items():
        try:
            thunk = bk.compile_calls(partial(ragged_paged_attention_gpu, **kw), paged)
        except Exception as e:  # noqa: BLE001 - reported in the row
            bk.log(f"    {name} failed: {bk.short_error(e)}")
            out[f"error_{name}"] = bk.short_error(e)
            continue
        runs[name] = (thunk, len(paged))
    if "default" not in runs or len(runs) < 2:
        return out
    try:
        times = bk.time_rounds(runs, env.iters)
    except Exception as e:  # noqa: BLE001 - reported in the row
        bk.log(f"    prefetch A/B failed: {bk.short_error(e)}")
        return {**out, "error_prefetch": bk.short_error(e)}
    for name in (name for name in runs if name != "default"):
        ratio = bk.paired_ratio(times[name], times["default"])
        bk.log(f"    {alts[name]} / default, {env.iters} interleaved rounds: {ratio:.3f}")
        out.update({f"{name}_over_default": ratio, f"{name}_cfg": alts[name]})
    return out


def run_family(env) -> Iterator[dict]:
    """The "ragged" family for bench_kernels (`env` is its BenchEnv): rows as they finish.

    A case that raises (compile error, out of memory) yields a failed row with the
    error text, and the next case runs.
    """
    if not env.on_gpu:
        for case in cases(gpu=False):
            try:
                yield check_cpu_case(case, log=_stderr)
            except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                traceback.print_exc(file=sys.stderr)
                yield dict(case=case.name, ok=False, error=f"{type(e).__name__}: {e}"[:300])
        return
    import bench_kernels as bk  # lazy: bench_kernels imports this module

    for case in cases(gpu=True):
        bk.log(f"ragged {case.name} ({case.kv_bytes / 2**20:.0f} MiB of K/V)")
        try:
            row = gpu_case(case, env, bk)
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            traceback.print_exc(file=sys.stderr)
            row = dict(case=case.name, ok=False, error=bk.short_error(e))
        yield row


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    if jax.default_backend() == "gpu":
        import bench_kernels as bk

        return bk.main(argv, families=[bk.Family("ragged", run_family, COLUMNS)])
    print(f"jax {jax.__version__} on {jax.default_backend()}: interpret-mode check only")
    ok = True
    for case in cases(gpu=False):
        row = check_cpu_case(case)
        ok &= row["ok"]
        print(f"{case.name}: flops {flops(case):.3g}, bytes {bytes(case):.3g}, ok={row['ok']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
