"""Paged decode attention on CUDA GPUs: a Pallas kernel with the Triton lowering.

One query token per sequence attends to that sequence's K/V, which live in page
pools `[K, P, S, D]` addressed through a page table. Decode is memory-bound, so
the kernel is built around reading every live K/V byte exactly once:

* One program per (sequence, kv head, head block, split). All `G = H // K`
  query heads that share a kv head sit in one program as the rows of a
  `[block_h, D]` tile (padded up to 16, the smallest tensor-core `dot`), so a
  K/V tile loaded from HBM serves every head of its group. Only groups larger
  than 64 heads are cut into several head blocks (each then reads the K/V).
* The inner loop walks the context `block_kv` tokens at a time. Each token's
  row is found through the page table inside the kernel (`page_id * S + offset`,
  a gathered load), so `block_kv` may span several small pages or part of a
  large one. Every load is masked at token granularity, and the loop bounds
  come from the sequence's length (and sliding window): pages past the length,
  and pages wholly before the window, are never touched; page-table padding is
  never read. Values the host cannot check (a traced table or lengths under an
  outer jit) never move a load outside the arrays: a length reads as at most
  `max_pages * S` (a negative one as 0), a page id as the XLA reference reads it
  (`int_ops.page_ids`); the output is then garbage, the memory accesses are not.
* The page ids of block i + 1 are read in iteration i and carried in the loop
  state, so the K/V loads of an iteration depend on the loop state rather than
  on a load of the same iteration. Triton's pipeliner splits the stages among
  the loads of a dependent chain (page id, then K/V row); for this loop it kept
  one K/V buffer at 2, 3 and 4 stages, so a program requested its next tile only
  after using the current one. With the ids carried, the K/V loads start the
  chain: from `num_stages=3` the TTGIR for sm90 (Triton 3.9, compiled on a CPU)
  has 2 buffers per tile, with the copies of block i + 1 and i + 2 in flight
  while block i is used; at 2 stages it still keeps one.
* Online softmax in float32 (in base 2: `log2(e)` is folded into the scale),
  the second `dot` in q's dtype with float32 accumulation.
* FP8 pages (`float8_e4m3fn` or `float8_e5m2`, an FP8 KV cache) with a bfloat16
  or float32 q: each K/V tile is loaded as fp8 (half the bytes of bf16) and
  converted to q's dtype right after the load, so the dots are those of the
  unquantised kernel. The defaults size block_kv from the pages' itemsize, so
  fp8 gets twice the tokens per tile where the 128-token cap allows.
  On the H200 the fp8 kernel moves half the bytes but is not twice as fast:
  the upcast costs ALU time (BENCHMARKS.md, "Kernels").
  Triton converts e4m3fn only on sm89+ (Ada, Hopper: the H100/H200 are fine);
  on older GPUs the Triton lowering raises "cannot cast from `float8_e4m3fn`".
  e5m2 pages are checked in the interpreter and lowered, never run on a GPU.
* Split-K (flash-decoding): when `B * K` programs cannot fill the GPU, each
  sequence's live blocks are divided into `num_splits` contiguous ranges whose
  partial `(o, m, l)` are merged afterwards by one small Pallas kernel
  (`gpu_merge.py`: one for up to 8 splits, one for more; XLA's fusions of the
  same few jnp ops took a seventh of a call on the H200 at 4 splits). The ranges are
  cut from the actual length at run time, so short sequences in a wide page
  table are not imbalanced.

Why the Triton lowering: it is the Pallas GPU lowering with a public CPU
interpreter (`interpret=True`), so the kernel is tested on CPU-only CI, and it
runs on both jax 0.10 and 0.11 (where it is deprecated but supported). Mosaic
GPU would give TMA and wgmma on Hopper, but its interpreter is private API, and
for a gather-bound decode loop Triton's software pipelining (`num_stages`) of
the gathered loads is what matters. `compiler_params=plgpu.CompilerParams(...)`
pins the Triton lowering even where Mosaic GPU becomes the default. The public
signature does not depend on the lowering, so a Mosaic GPU version can slot in.

Lowering notes (both for Triton and for the interpreter): all loads and stores
index with arrays on every axis (never array + slice, which the interpreter
rejects), so K/V rows are gathered as `k_ref[kh, rows[:, None], cols[None, :]]`;
every value inside the kernel has power-of-two dimensions; integer division uses
`lax.div` / `lax.rem` on non-negative values, the divisor in the dividend's dtype
(`pallas_kernels.int_ops`: under `jax_enable_x64` a Python int is int64).

Head dims: the Triton `dot` needs power-of-two tiles of at least 16, so a head
dim that is not one (80 or 100, as some Llama- and Mistral-architecture checkpoints
have; or one below 16) is padded inside the kernels to `validation.gpu_tile_dim(D)`
columns, the padding masked on every load and store (`gpu_merge.head_columns`): the
K/V bytes moved are those of D, the dots are as wide as the padded tile. For a power
of two >= 16 nothing is masked and the kernel is the one timed. Padded head dims are
checked in the interpreter and lowered, not yet run on a GPU. Head dims over
`validation.GPU_MAX_HEAD_DIM` (256) are refused: wider tiles overflow shared memory.
Page sizes below 8 are untested. float32 inputs use exact (IEEE) dots, which are
correct but do not use tensor cores; bfloat16 is the fast path. No scaled
(per-tensor or per-head) FP8: pages hold the values themselves.

Status: checked in the interpreter and lowered to Triton IR on CPU-only
machines (the test suite), and compiled, checked against the reference and timed
on an H200 with jax 0.11.2 (`tests/test_gpu_device.py`,
`scripts/bench_kernels.py`; figures in BENCHMARKS.md). The defaults were timed
against one-knob alternatives, in interleaved rounds, on that H200 (2026-11-30): at
(B, S) = (32, 4096) the kernel alone streams at 86% of DRAM peak (Nsight Compute) and
a whole call is 1.5x JAX's bundled kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import int_ops
from pallas_kernels.paged_decode.gpu_merge import (
    head_columns,
    merge_partials,
    merge_splits,
    merge_splits_gpu,
    merge_splits_wide,
    program_heads,
    with_cols,
)
from pallas_kernels.validation import (
    check_gpu_head_dim,
    check_gpu_pool,
    gpu_tile_dim,
    is_int,
    is_pow2,
    static_knobs,
)

__all__ = [
    "TUNING_KNOBS",
    "decode_partials",
    "default_tuning",
    "merge_partials",
    "merge_splits",
    "merge_splits_gpu",
    "merge_splits_wide",
    "paged_decode_gpu",
]

# The GPU we tune for by default (H200); the real count is read from the device.
_DEFAULT_NUM_SMS = 132
_MIN_DOT = 16  # smallest tile dimension of a Triton tensor-core dot
_TILE_BYTES = 16384  # default K tile (and V tile) per inner iteration
_MIN_SPLIT_TOKENS = 512  # split-K leaves at least this many tokens to each split
_PROGRAMS_PER_SM = 8  # split-K fills the GPU up to this many programs per SM
_LOG2E = math.log2(math.e)
TUNING_KNOBS = ("block_kv", "block_h", "num_splits", "num_warps", "num_stages")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the first CUDA device (132, an H200's, without one)."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return _DEFAULT_NUM_SMS
    return int(getattr(device, "core_count", 0) or _DEFAULT_NUM_SMS)


def default_tuning(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_pages: int,
    dtype,
    *,
    sms: int | None = None,
    block_kv: int | None = None,
) -> dict:
    """Per-shape defaults of the tuning knobs (BENCHMARKS.md, "Kernels", has the sweeps).

    * `block_kv`: 16 KiB K tiles (and V tiles): 64 tokens at D=128 in bf16, 128 in
      fp8; at most 128 tokens and at least 16 (the smallest dot).
    * `num_stages`: 3, the smallest depth at which Triton double-buffers the K/V
      tiles of this loop (at 2 it keeps one buffer, so a program's next tile is
      requested only after the current one is used; Triton 3.x, checked in its
      TTGIR); 2 for caller-chosen tiles over 32 KiB, 1 over 64 KiB, to bound shared
      memory.
    * `num_splits`: split-K (flash-decoding) when `B * K` programs make fewer than
      about 8 per SM: up to that many programs, each split covering >= 512 tokens
      (at (B, S) = (32, 4096): 4 splits; (8, 8192): 16; (1, 32768): 64).
    * `block_h`: query heads per program; the group G padded to a power of two
      of at least 16, capped at 64 to bound registers.
    * `num_warps`: 4, or 8 for large `block_h * D` accumulators.

    Args:
      batch, num_heads, num_kv_heads, head_dim, page_size, max_pages: the shape.
      dtype: the K/V (pages') dtype, which sizes the tiles moved.
      sms: streaming multiprocessors to fill (default: `num_sms()`).
      block_kv: a caller's block_kv, which the other defaults then fit.

    Returns:
      A dict with the keys of `TUNING_KNOBS`.
    """
    itemsize = jnp.dtype(dtype).itemsize
    tile_d = gpu_tile_dim(head_dim)  # the tiles' width (a padded D is sized as padded)
    group = num_heads // num_kv_heads
    block_h = min(max(_MIN_DOT, _next_pow2(group)), 64)
    head_blocks = -(-group // block_h)
    programs = batch * num_kv_heads * head_blocks
    target = _PROGRAMS_PER_SM * (num_sms() if sms is None else sms)
    if block_kv is None:
        tile_tokens = _TILE_BYTES // (tile_d * itemsize)
        block_kv = max(_MIN_DOT, min(128, 1 << (tile_tokens.bit_length() - 1)))
    num_splits = 1
    if 0 < programs < target:
        num_splits = max(1, min(target // programs, max_pages * page_size // _MIN_SPLIT_TOKENS))
    tile_bytes = block_kv * tile_d * itemsize
    num_stages = 3 if tile_bytes <= 2 * _TILE_BYTES else 2 if tile_bytes <= 4 * _TILE_BYTES else 1
    return dict(
        block_kv=block_kv,
        block_h=block_h,
        num_splits=num_splits,
        num_warps=8 if block_h * tile_d >= 64 * 128 else 4,
        num_stages=num_stages,
    )


def _check_tuning(tuning: dict) -> None:
    for name in ("block_kv", "block_h"):
        value = tuning[name]
        if not is_pow2(value) or value < _MIN_DOT:
            raise ValueError(f"{name} must be a power of two >= {_MIN_DOT}, got {name}={value!r}")
    for name in ("num_splits", "num_stages"):
        value = tuning[name]
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    if not is_pow2(tuning["num_warps"]) or tuning["num_warps"] > 32:
        raise ValueError(f"num_warps must be a power of two <= 32, got {tuning['num_warps']!r}")


def _decode_kernel(
    lengths_ref,  # [B] int32
    page_table_ref,  # [B, max_pages] int32
    q_ref,  # [B, H, D]
    k_ref,  # [K, P * S, D]
    v_ref,  # [K, P * S, D]
    *out_refs,  # o [B, H, D]; or o [splits, B, H, D] f32 and m, l [splits, B, H] f32
    group,
    block_h,
    head_blocks,
    page_size,
    max_pages,
    block_kv,
    num_splits,
    scale,
    soft_cap,
    sliding_window,
):
    b = pl.program_id(0)
    split = pl.program_id(2)
    head_dim = q_ref.shape[-1]
    num_pages = k_ref.shape[1] // page_size

    # Query heads of this program: rows of the tile; rows past the group are padding.
    kv_head, heads, row_ok = program_heads(group, block_h, head_blocks)  # [block_h]
    heads = heads[:, None]  # [block_h, 1]
    cols, col_ok = head_columns(head_dim)  # [1, tile_d]: D padded to a power of two
    tile_ok = with_cols(row_ok[:, None], col_ok)  # [block_h, tile_d]
    q = plgpu.load(q_ref.at[b, heads, cols], mask=tile_ok, other=0)  # [block_h, tile_d]

    # Live tokens [lo, hi); blocks of block_kv tokens aligned to 0; this split's share.
    hi = jnp.minimum(lengths_ref[b], max_pages * page_size)
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(hi - sliding_window, 0)
    first = int_ops.div(lo, block_kv)
    num_blocks = jnp.maximum(int_ops.div(hi + block_kv - 1, block_kv) - first, 0)
    per_split = int_ops.div(num_blocks + num_splits - 1, num_splits)
    start = first + jnp.minimum(split * per_split, num_blocks)
    stop = first + jnp.minimum((split + 1) * per_split, num_blocks)

    exact = q.dtype == jnp.float32
    precision = lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT
    log2_scale = scale if soft_cap is not None else scale * _LOG2E
    # Masked K/V lanes read as 0 in the pages' dtype (Triton cannot cast an int 0 to fp8).
    kv_zero = jnp.zeros((), k_ref.dtype)

    def rows_of(i):
        # K/V rows of block i, through the page table (masked past the live tokens). The
        # ids are clamped into the pool: a traced table is unchecked (`int_ops.page_ids`).
        tok = i * block_kv + lax.iota(jnp.int32, block_kv)
        live = (tok >= lo) & (tok < hi)
        page = plgpu.load(page_table_ref.at[b, int_ops.div(tok, page_size)], mask=live, other=0)
        page = int_ops.page_ids(page, num_pages)
        return page * page_size + int_ops.rem(tok, page_size)

    def body(i, carry):
        o, m, denom, rows = carry  # [block_h, D], [block_h], [block_h] float32; [block_kv]
        tok = i * block_kv + lax.iota(jnp.int32, block_kv)  # [block_kv]
        live = (tok >= lo) & (tok < hi)
        # The next block's rows are looked up now and carried, so the K/V loads below
        # depend on the loop state, not on a load of this iteration.
        next_rows = rows_of(i + 1)
        # FP8 pages are upcast right after the load: the bytes moved stay fp8.
        kv_ok = with_cols(live[:, None], col_ok)  # [block_kv, tile_d]
        k = plgpu.load(k_ref.at[kv_head, rows[:, None], cols], mask=kv_ok, other=kv_zero)
        k = k.astype(q.dtype)  # [block_kv, tile_d]
        v = plgpu.load(v_ref.at[kv_head, rows[:, None], cols], mask=kv_ok, other=kv_zero)
        v = v.astype(q.dtype)
        s = lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [block_h, block_kv]
        s = s * log2_scale
        if soft_cap is not None:
            s = (soft_cap * _LOG2E) * jnp.tanh(s / soft_cap)
        s = jnp.where(live[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: every block has a live token
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        denom = alpha * denom + jnp.sum(p, axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [block_h, tile_d]
        return alpha[:, None] * o + pv, m_new, denom, next_rows

    init = (
        jnp.zeros((block_h, cols.shape[1]), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        rows_of(start),
    )
    o, m, denom, _ = lax.fori_loop(start, stop, body, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        out = o / jnp.where(denom > 0, denom, 1.0)[:, None]
        plgpu.store(o_ref.at[b, heads, cols], out.astype(o_ref.dtype), mask=tile_ok)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[split, b, heads, cols], o, mask=tile_ok)
        plgpu.store(m_ref.at[split, b, heads[:, 0]], m, mask=row_ok)
        plgpu.store(l_ref.at[split, b, heads[:, 0]], denom, mask=row_ok)


_STATIC = (
    "scale",
    "soft_cap",
    "sliding_window",
    "interpret",
    "block_kv",
    "block_h",
    "num_splits",
    "num_warps",
    "num_stages",
)


def _decode_call(
    q,
    k_pages,
    v_pages,
    lengths,
    page_table,
    *,
    scale,
    soft_cap,
    sliding_window,
    interpret,
    block_kv,
    block_h,
    num_splits,
    num_warps,
    num_stages,
):
    """The kernel alone, every knob given (see `paged_decode_gpu`); `decode_partials`
    is it jitted.

    Returns:
      [B, H, D] in q's dtype when `num_splits == 1`; else the split partials
      `(o [splits, B, H, D], m [splits, B, H], l [splits, B, H])` in float32 that
      `merge_partials` (or its reference `merge_splits`) combines.
      (scripts/profile_decode.py times the two apart.)
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = num_heads // num_kv_heads
    head_blocks = -(-group // block_h)
    kernel = functools.partial(
        _decode_kernel,
        group=group,
        block_h=block_h,
        head_blocks=head_blocks,
        page_size=page_size,
        max_pages=max_pages,
        block_kv=block_kv,
        num_splits=num_splits,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        part = (num_splits, batch, num_heads)
        out_shape = (
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        )
    rows = num_pages * page_size
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch, num_kv_heads * head_blocks, num_splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_gpu",
    )(
        lengths.astype(jnp.int32),
        page_table.astype(jnp.int32),
        q,
        k_pages.reshape(num_kv_heads, rows, head_dim),
        v_pages.reshape(num_kv_heads, rows, head_dim),
    )
    return out


# Not called by _paged_decode: a nested jit would be a second function call per layer in
# the lowered step (tests/test_step_lowering.py counts one per layer).
decode_partials = jax.jit(_decode_call, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _paged_decode(q, k_pages, v_pages, lengths, page_table, **static):
    out = _decode_call(q, k_pages, v_pages, lengths, page_table, **static)
    if static["num_splits"] == 1:
        return out
    group = q.shape[1] // k_pages.shape[0]
    return merge_partials(
        *out, dtype=q.dtype, group=group, block_h=static["block_h"], interpret=static["interpret"]
    )


def paged_decode_gpu(
    q,
    k_pages,
    v_pages,
    lengths,
    page_table,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    block_kv: int | None = None,
    block_h: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Paged decode attention with the Pallas GPU (Triton) kernel.

    Inputs are assumed valid (`pallas_kernels.dispatch` checks them); only the
    tuning knobs and the head dim are checked here. Knobs left as None take
    the per-shape values of `default_tuning`; the others are Python, numpy or concrete
    jax ints (`validation.static_knobs`).

    Args:
      q: [B, H, D] one query token per sequence, at position lengths[b] - 1.
      k_pages: [K, P, S, D] one layer's key pages, in q's dtype or fp8.
      v_pages: [K, P, S, D] one layer's value pages, same dtype as k_pages.
      lengths: [B] int32 tokens in the cache per sequence (0 gives a zero row).
      page_table: [B, max_pages] int32 physical page ids in logical order.
      scale: logit scale, default D ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      sliding_window: if set, the query sees only its last `sliding_window` keys.
      interpret: run the kernel in the Pallas interpreter (CPU testing).
      block_kv: tokens per inner iteration (power of two >= 16; may span pages
        or part of one).
      block_h: query heads per program (power of two >= 16; the group is padded).
      num_splits: split-K partitions of each sequence's context.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages.

    Returns:
      [B, H, D] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    given = static_knobs(
        block_kv=block_kv,
        block_h=block_h,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    block_kv = given["block_kv"]
    tuning = default_tuning(
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        page_table.shape[1],
        k_pages.dtype,
        block_kv=block_kv if is_int(block_kv) and block_kv > 0 else None,
    )
    tuning.update({k: v for k, v in given.items() if v is not None})
    _check_tuning(tuning)
    check_gpu_head_dim(head_dim)
    check_gpu_pool(k_pages.shape)
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {interpret=}")
    if batch == 0 or page_table.shape[1] == 0 or k_pages.shape[1] == 0:
        return jnp.zeros(q.shape, q.dtype)  # (no pages: every length is 0)
    return _paged_decode(
        q,
        k_pages,
        v_pages,
        jnp.asarray(lengths),
        jnp.asarray(page_table),
        scale=float(head_dim**-0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=interpret,
        **tuning,
    )
