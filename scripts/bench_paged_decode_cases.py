"""Paged decode benchmark cases: the shapes, their inputs, and what ours is timed against.

Building blocks of the "decode" family of `scripts/bench_kernels.py` (which checks and
times them, and re-exports every name here), as `scripts/bench_ragged_cases.py` is of
the "ragged" one; `tune_kernels.py` and `profile_decode.py` use them too:

* `DecodeCase` (Llama-3-8B heads by default: H=32, K=8, D=128, bf16, page 16; an FP8
  KV cache with `kv_dtype`), `GPU_DECODE_CASES` and the small `CPU_DECODE_CASES`;
* `make_decode_inputs(case, seed)`: random pools and a shuffled page table;
  `ragged_lengths` for the checks; `random_partials` for timing a split-K merge alone;
* the dense XLA baseline: `to_dense` (pages to contiguous K/V) and `dense_decode`;
* JAX's bundled Triton kernel: `bundled_kernel()` (or why it won't import),
  `run_bundled`, and the sweep of its knobs (`bundled_configs`, `bundled_sweep`);
* `ours_sweep(case)`: alternatives to our kernel's default tuning;
* `_tolerance(case)`: the relative error a check accepts.

The family's runners (`check_decode_gpu`, `decode_case_gpu`, `decode_cases_cpu`) stay
in bench_kernels.py: tests swap the kernels and these inputs there, on that module.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from bench_harness import short_error

from pallas_kernels.paged_decode.gpu import default_tuning
from pallas_kernels.paged_decode.gpu_merge import UNROLLED_SPLITS


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode shape: every sequence holds `seq_len` tokens (timing)."""

    batch: int
    seq_len: int
    page_size: int = 16
    num_heads: int = 32  # Llama-3-8B: 32 query heads, 8 kv heads, D=128
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"  # of the queries (and of the pages unless kv_dtype is set)
    kv_dtype: str | None = None  # of the pages, e.g. "float8_e4m3fn" (an FP8 KV cache)

    @property
    def page_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def name(self) -> str:
        name = f"B={self.batch} S={self.seq_len} page={self.page_size}"
        if self.page_dtype == self.dtype:
            return name
        return f"{name} {'fp8' if self.page_dtype == 'float8_e4m3fn' else self.page_dtype}"

    @property
    def max_pages(self) -> int:
        return -(-self.seq_len // self.page_size)

    @property
    def kv_bytes(self) -> int:
        itemsize = jnp.dtype(self.page_dtype).itemsize
        return 2 * self.batch * self.seq_len * self.num_kv_heads * self.head_dim * itemsize

    def tuning(self) -> dict:
        """Our kernel's default knobs for this shape."""
        shape = (self.batch, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)
        return default_tuning(*shape, self.max_pages, self.page_dtype)


GPU_DECODE_CASES = [
    DecodeCase(1, 32768),
    DecodeCase(8, 8192),
    DecodeCase(32, 4096),
    DecodeCase(128, 2048),
    DecodeCase(256, 512),
    DecodeCase(32, 4096, page_size=64),
    DecodeCase(32, 4096, kv_dtype="float8_e4m3fn"),  # FP8 KV cache, bf16 queries
]
CPU_DECODE_CASES = [
    DecodeCase(3, 80),
    DecodeCase(3, 80, kv_dtype="float8_e4m3fn"),
    DecodeCase(2, 40, page_size=8, num_heads=8, head_dim=64),
]
QUICK_CPU_CASES = 2  # --quick on the CPU: the first bf16 case and the fp8 one


def make_decode_inputs(case: DecodeCase, seed: int):
    """Random pools with a shuffled page table; returns (q, k_pages, v_pages, page_table).

    FP8 pages are drawn in q's dtype and cast (N(0, 1) values fit e4m3fn's range).
    """
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    num_pages = case.batch * case.max_pages
    dtype = jnp.dtype(case.dtype)
    shape = (case.num_kv_heads, num_pages, case.page_size, case.head_dim)
    q = jax.random.normal(kq, (case.batch, case.num_heads, case.head_dim), dtype)
    k_pages = jax.random.normal(kk, shape, dtype).astype(case.page_dtype)
    v_pages = jax.random.normal(kv, shape, dtype).astype(case.page_dtype)
    perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    page_table = jnp.asarray(perm.reshape(case.batch, case.max_pages))
    return q, k_pages, v_pages, page_table


def ragged_lengths(case: DecodeCase, seed: int) -> jax.Array:
    """Lengths for checks: 1, a page boundary, the maximum, then random."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, case.seq_len + 1, case.batch)
    n[:3] = [1, min(case.page_size, case.seq_len), case.seq_len][: case.batch]
    return jnp.asarray(n, jnp.int32)


def random_partials(case, splits: int, count: int) -> list:
    """`count` distinct random split-K partials `(o, m, l)` of `splits` splits of the
    decode case's shape, for timing a merge alone."""
    shape = (splits, case.batch, case.num_heads)
    out = []
    for i in range(count):
        ko, km, kl = jax.random.split(jax.random.key(50 + i), 3)
        o = jax.random.normal(ko, (*shape, case.head_dim), jnp.float32)
        m = jax.random.normal(km, shape, jnp.float32)
        denom = jax.random.uniform(kl, shape, jnp.float32, 1.0, 2.0)
        out.append((o, m, denom))
    return out


def to_dense(pages, page_table):
    """[K, P, S, D] pages -> [B, K, T, D] contiguous per sequence and head."""
    g = pages[:, page_table]  # [K, B, max_pages, S, D]
    k, b, m, s, d = g.shape
    return g.transpose(1, 0, 2, 3, 4).reshape(b, k, m * s, d)


def dense_decode(q, k, v, lengths):
    """Decode attention over contiguous K/V in plain XLA.

    Args:
      q: [B, H, D]; k, v: [B, K, T, D] (fp8 is upcast to q's dtype); lengths: [B] int32 (>= 1).

    Returns:
      [B, H, D] in q's dtype.
    """
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    b, h, d = q.shape
    kh, t = k.shape[1], k.shape[2]
    qg = q.reshape(b, kh, h // kh, d)
    s = jnp.einsum("bkgd,bktd->bkgt", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    live = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    s = jnp.where(live[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("bkgt,bktd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.sum(p, axis=-1)[..., None]
    return o.reshape(b, h, d).astype(q.dtype)


def bundled_kernel():
    """JAX's bundled Triton paged attention, or None (with the reason) if it won't import."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as mod
        return mod.paged_attention, None
    except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
        return None, short_error(e)


def bundled_configs(case: DecodeCase, splits, blocks) -> list[dict]:
    """Knob settings of the bundled kernel that its divisibility rules accept.

    Args:
      splits: k_splits values to try.
      blocks: compute blocks to try, in tokens (pages_per_compute_block * page_size).
    """
    configs = []
    for tokens in blocks:
        ppcb = max(1, tokens // case.page_size)
        for k_splits in splits:
            per = case.max_pages // k_splits if case.max_pages % k_splits == 0 else 0
            if per and per % min(per, ppcb) == 0:
                configs.append(dict(pages_per_compute_block=ppcb, k_splits=k_splits))
    return configs


def bundled_sweep(case: DecodeCase, stage: int, best: dict | None, quick: bool) -> list[dict]:
    """The bundled kernel's configurations to try at `stage`, around the best so far.

    Stage 0: k_splits at its default compute block of 128 tokens. Stage 1: blocks
    of 64, 256 and 512 tokens at the best k_splits. Stage 2: 4 warps (its default
    is 8) and 3 pipeline stages (default 2) at the best block. --quick: stage 0.
    """
    if stage == 0:
        return bundled_configs(case, [16, 1, 4] if quick else [16, 1, 2, 4, 8, 32], [128])
    if quick or best is None:
        return []
    if stage == 1:
        return bundled_configs(case, [best["k_splits"]], [64, 256, 512])
    return [dict(best, num_warps=4), dict(best, num_stages=3)]


def run_bundled(fn, q, k_pages, v_pages, lengths, page_table, **config):
    """The bundled kernel has no scale argument: the query is pre-scaled."""
    q = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)
    return fn(q, k_pages, v_pages, page_table, lengths, **config)


def ours_sweep(case: DecodeCase) -> list[dict]:
    """A few alternatives to the default tuning, to see whether the defaults are right."""
    base = case.tuning()
    splits, block_kv = base["num_splits"], base["block_kv"]
    # One pipeline buffer (2 stages), and twice the tile in one buffer: the defaults
    # before the page ids were carried across iterations (BENCHMARKS.md, "Kernels").
    alts = [dict(num_stages=2), dict(block_kv=2 * block_kv, num_stages=2)]
    if splits > UNROLLED_SPLITS:
        # First, while the budget lasts: fewer, longer splits (more work per program,
        # fewer programs than SMs at B = 1) and the 8-split merge (B = 1, 8).
        alts.insert(0, dict(num_splits=UNROLLED_SPLITS))
    if splits > 1:  # no merge: 0.93 of the default's time at (32, 4096) once, 1.04 once
        alts.append(dict(num_splits=1))
    alts += [dict(num_stages=4), dict(block_kv=2 * block_kv), dict(num_splits=2 * splits)]
    if splits > 2:
        alts.append(dict(num_splits=splits // 2))
    if block_kv >= 32:
        alts.append(dict(block_kv=block_kv // 2, num_stages=5))
    alts.append(dict(num_warps=8 if base["num_warps"] == 4 else 4))
    return alts


def _tolerance(case: DecodeCase) -> float:
    return 1e-2 if case.dtype == "bfloat16" else 1e-4
