"""Ragged paged attention on GPU: chunked prefill and decode rows in one batch.

Lowering: Pallas's Triton lowering (`jax.experimental.pallas.triton`). It runs on
jax 0.10 and 0.11, it has the public CPU interpreter (`interpret=True`) that CI
uses, and its pointer-based loads express what a paged kernel needs directly: a
gather of KV rows through the page table, with masked lanes never touching
memory. Mosaic GPU (TMA, wgmma) would be faster on Hopper for the prefill part,
but its interpreter is private API and a TMA copy moves one rectangular box, so
small pages mean one copy per page; it can slot in behind the same signature
later. float32 inputs use exact IEEE dots (no TF32, which would miss the 1e-4
tolerance), a correctness path rather than a fast one. Checked against the
reference and timed on an H200 with jax 0.11.2 (`tests/test_gpu_device.py`;
BENCHMARKS.md, "Kernels"): 128 decode rows over 4,096 tokens stream K/V at 0.98 of
the copy bandwidth, prefill chunks reach about 245 TFLOP/s (a third of XLA's
matmul rate). Why, from compile-only evidence (pip Triton 3.9's sm90 build, not
jaxlib's): the dots are Hopper's wgmma, but the K/V loads never overlap them and
the prefill defaults spill registers (see "Load pipelining" below).

Work decomposition. Query rows are cut into *query blocks*: `block_q` consecutive
tokens of one sequence times all `G = H // K` query heads of one kv head, which
the kernel flattens into the M dimension of its dots (`M = block_q * G`, G padded
to a power of two). One program handles one (query block, kv head) pair: it
loads its queries once, then walks the sequence's KV blocks (`block_kv` tokens,
gathered row by row through the page table, so blocks need not align with pages)
from the sliding-window start to the causal limit of the block's last query,
with an online softmax in float32. KV past that limit (and before the window) is
never loaded. The G heads share every KV load, so KV is read once per
(query block, kv head), never per query head.

Grid, independent of values: `(num_q_blocks, K)` with
`num_q_blocks = (T + N * (block_q - 1)) // block_q`, `N = min(B + 1, T)`: an upper
bound on the number of query blocks of any batch of B sequences plus one
"padding segment" for rows past `query_start_loc[B]` (it has no keys, so its
programs store zeros). The wrapper turns the traced `query_start_loc` into a
schedule (program -> segment, block index) with a cumsum and a compare, a few
hundred bytes of XLA work; slots past the real number of blocks exit at once.
Cost for decode-heavy batches: each decode row gets a program of its own whose
dots compute `block_q` tokens of which one is real (with the default M = 64 a
decode row stays bound by its KV loads, so the extra tensor-core work is hidden;
when T <= B the default M drops to 16), and up to `min(B, T)` idle slots are
launched, each reading two scalars. There is no split over the KV axis: a batch of very few
long decode rows occupies only `B * K` programs; the paged decode kernel is the
better choice for pure decode.

Load pipelining and `prefetch_rows` (untimed). Each KV block's rows come through
page ids loaded in the same iteration, and Triton's pipeliner splits its stages
over that chain (page id, then K/V): in the TTGIR that Triton 3.9 makes for sm90
(compiled on a CPU: `scripts/triton_ir.py`), every configuration the defaults
pick waits for all copies in flight at the top of each iteration (`async_wait
num = 0`), so the next tile's K/V loads never overlap this tile's dots.
`prefetch_rows=True` looks the ids up one block ahead and carries them in the loop
state, as the paged decode kernel does: from `num_stages=3` the wait keeps the
next tile's copies in flight (`num = 2`) and the K/V tiles get 3 buffers. At 2
stages nothing changes. It is off by default because it is untimed, and at the
mostly-prefill defaults (M = 128, 128-token KV blocks, 3 stages) those buffers
take 224 KiB of shared memory, 3 KiB under the H200's 227 KiB per program: a
different Triton could miss it and fail to compile; with 64-token KV blocks it
needs 128 KiB and spills no registers (the 128-token default spills a little;
BENCHMARKS.md, "Kernels", has the table). `bench_ragged_cases.py` times both
against the default in the same rounds, `tune_kernels.py` in its ragged grid.
Off, the kernel's Triton IR is unchanged, byte for byte.

FP8 pages (`float8_e4m3fn` or `float8_e5m2`, an FP8 KV cache) with a bfloat16 or
float32 q: each K/V tile is loaded as fp8 (half the bytes of bf16) and converted
to q's dtype right after the load, so the dots are those of the unquantised
kernel and the tuning defaults (register-bound, sized by q's dtype) are unchanged.
Triton converts e4m3fn only on sm89+ (Ada, Hopper: the H100/H200 are fine); on
older GPUs the Triton lowering raises "cannot cast from `float8_e4m3fn`". e5m2
pages are checked in the interpreter and lowered, never run on a GPU.

Values the host cannot check (a traced page table, `context_lens` or
`query_start_loc` under an outer jit) never move a load or store outside the
arrays; the output is then garbage, the memory accesses are not. The wrapper reads
`query_start_loc` as `clip(cummax(loc), 0, T)` and `context_lens` as clipped to
`[0, max_pages * S]` (XLA ops on `B + 1` values, beside the schedule's), and the
kernel reads each page id as the XLA reference does (`int_ops.page_ids`). Valid
inputs pass unchanged.

Supported: everything in `pallas_kernels.reference`'s conventions (GQA/MQA with
any group size, soft cap, sliding window, float32 and bfloat16, any page size,
batch, T and max_pages), and unscaled FP8 pages. Head dims up to
`validation.GPU_MAX_HEAD_DIM` (256): one that is not a power of two of at least 16 is
padded to `validation.gpu_tile_dim` columns, the padding masked on every load and
store; wider ones are refused (their tiles overflow shared memory). Not supported:
scaled (int8 or per-head-scaled fp8) KV pages, a split over the KV axis for few long
sequences.
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
from pallas_kernels.paged_decode.gpu_merge import head_columns, with_cols
from pallas_kernels.validation import (
    check_gpu_head_dim,
    check_gpu_pool,
    gpu_tile_dim,
    is_int,
    is_pow2,
    static_knobs,
)

_NEG = -1e30  # finite "minus infinity": keeps exp2(m_old - m_new) NaN-free
_LOG2E = math.log2(math.e)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(
    sched_ref,  # [2, NQB] int32: segment id (-1 idle), block index in the segment
    qsl_ref,  # [B + 2] int32: query_start_loc, then T (end of the padding segment)
    ctx_ref,  # [B + 1] int32: context_lens, then 0 (the padding segment)
    pt_ref,  # [B * max_pages] int32 flattened page table
    q_ref,  # [T * H, D]
    k_ref,  # [P * S, D] this kv head's key rows
    v_ref,  # [P * S, D]
    o_ref,  # [T * H, D]
    *,
    num_seqs: int,
    num_heads: int,
    group: int,
    group_pad: int,
    max_pages: int,
    page_size: int,
    block_q: int,
    block_kv: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    prefetch_rows: bool,
):
    j = pl.program_id(0)
    kv_head = pl.program_id(1)
    seg = sched_ref[0, j]
    blk = sched_ref[1, j]
    m_rows = block_q * group_pad
    head_dim = q_ref.shape[-1]
    num_pages = k_ref.shape[0] // page_size

    @pl.when(seg >= 0)
    def _():
        q_start = qsl_ref[seg]
        q_len = qsl_ref[seg + 1] - q_start
        ctx = ctx_ref[seg]
        t0 = blk * block_q  # first token of this block, within the sequence's chunk
        row = lax.broadcasted_iota(jnp.int32, (m_rows,), 0)
        tok = t0 + row // group_pad
        g = row % group_pad
        row_ok = (tok < q_len) & (g < group)  # [M]
        q_rows = (q_start + tok) * num_heads + kv_head * group + g  # [M] rows of q and o
        col, col_ok = head_columns(head_dim)  # [1, tile_d]: D padded to a power of two
        q_ok = row_ok & (seg < num_seqs)  # the padding segment reads no queries
        q_idx = jnp.where(q_ok, q_rows, 0)[:, None]
        q = plgpu.load(
            q_ref.at[q_idx, col], mask=with_cols(q_ok[:, None], col_ok), other=0
        )  # [M, tile_d]
        pos = ctx - q_len + tok  # [M] absolute position of each query row

        # KV range of the whole block: [kv_lo, kv_hi).
        first = ctx - q_len + t0
        kv_hi = jnp.maximum(ctx - q_len + jnp.minimum(q_len, t0 + block_q), 0)
        last = kv_hi - 1
        kv_lo = 0 if sliding_window is None else jnp.maximum(first - sliding_window + 1, 0)
        # Blocks [b0, b1) need masks at the window edge, [b1, b2) are fully visible to
        # every row, [b2, b3) need the causal mask (and the length mask).
        b0 = kv_lo // block_kv
        b3 = (kv_hi + block_kv - 1) // block_kv
        full_lo = (
            b0
            if sliding_window is None
            else (jnp.maximum(last - sliding_window + 1, 0) + block_kv - 1) // block_kv
        )
        b1 = jnp.clip(full_lo, b0, b3)
        b2 = jnp.clip((first + 1) // block_kv, b1, b3)

        page_base = jnp.minimum(seg, num_seqs - 1) * max_pages
        dot_precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        # Masked K/V lanes read as 0 in the pages' dtype (Triton cannot cast an int 0 to fp8).
        kv_zero = jnp.zeros((), k_ref.dtype)

        def block(i):
            # Token positions of KV block i and which of them are in [kv_lo, kv_hi).
            kv_pos = i * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
            return kv_pos, (kv_pos >= kv_lo) & (kv_pos < kv_hi)

        def rows_of(kv_pos, kv_ok):
            # K/V rows of those tokens through the page table (0 where masked); the ids
            # are clamped into the pool, a traced table being unchecked (`int_ops.page_ids`).
            page_idx = jnp.where(kv_ok, kv_pos // page_size, 0)
            page = plgpu.load(pt_ref.at[page_base + page_idx], mask=kv_ok, other=0)
            page = int_ops.page_ids(page, num_pages)
            return jnp.where(kv_ok, page * page_size + kv_pos % page_size, 0)

        def body(i, carry, masked):
            acc, m_i, l_i = carry[:3]
            kv_pos, kv_ok = block(i)  # [block_kv]
            if prefetch_rows:
                # The next block's rows are looked up now and carried, so this block's
                # K/V loads depend on the loop state, not on a load of this iteration.
                rows, next_rows = carry[3], rows_of(*block(i + 1))
            else:
                rows = rows_of(kv_pos, kv_ok)
            kv_rows = rows[:, None]
            # FP8 pages are upcast right after the load: the bytes moved stay fp8.
            kv_mask = with_cols(kv_ok[:, None], col_ok)  # [bkv, tile_d]
            k = plgpu.load(k_ref.at[kv_rows, col], mask=kv_mask, other=kv_zero)
            k = k.astype(q.dtype)  # [bkv, tile_d]
            s = lax.dot_general(
                q,
                k,
                (((1,), (1,)), ((), ())),
                precision=dot_precision,
                preferred_element_type=jnp.float32,
            )  # [M, bkv]
            if soft_cap is None:
                s = s * (scale * _LOG2E)
            else:
                s = (soft_cap * _LOG2E) * jnp.tanh(s * (scale / soft_cap))
            if masked:
                visible = (kv_pos[None, :] <= pos[:, None]) & kv_ok[None, :]
                if sliding_window is not None:
                    visible &= kv_pos[None, :] > pos[:, None] - sliding_window
                s = jnp.where(visible, s, _NEG)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - m_new[:, None])
            if masked:
                p = jnp.where(visible, p, 0.0)
            l_new = l_i * alpha + jnp.sum(p, axis=1)
            v = plgpu.load(v_ref.at[kv_rows, col], mask=kv_mask, other=kv_zero)
            v = v.astype(q.dtype)  # [bkv, tile_d]
            pv = lax.dot_general(
                p.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=dot_precision,
                preferred_element_type=jnp.float32,
            )  # [M, tile_d]
            new = (acc * alpha[:, None] + pv, m_new, l_new)
            return (*new, next_rows) if prefetch_rows else new

        carry = (
            jnp.zeros((m_rows, col.shape[1]), jnp.float32),
            jnp.full((m_rows,), _NEG, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32),
        )
        if prefetch_rows:
            # Each loop ends holding the rows of its stop block, the next loop's start.
            carry = (*carry, rows_of(*block(b0)))
        if sliding_window is not None:
            carry = lax.fori_loop(b0, b1, functools.partial(body, masked=True), carry)
        carry = lax.fori_loop(b1, b2, functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(b2, b3, functools.partial(body, masked=True), carry)
        acc, _, l_i = carry[:3]
        # Every real query sees at least itself, so l > 0 except on padding rows.
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        # Masked rows point past the end: the interpreter's scatter drops them, and
        # unlike a clamped index they cannot collide with a real row.
        o_idx = jnp.where(row_ok, q_rows, o_ref.shape[0])[:, None]
        plgpu.store(
            o_ref.at[o_idx, col], out.astype(o_ref.dtype), mask=with_cols(row_ok[:, None], col_ok)
        )


def _schedule(query_start_loc, num_tokens, block_q, num_q_blocks):
    """Maps each program to (segment, block index in the segment), heaviest first.

    Segments are the B sequences plus one padding segment (rows past
    query_start_loc[B]); slots past the last real block get segment -1.

    Returns:
      [2, num_q_blocks] int32.
    """
    seg_end = jnp.concatenate([query_start_loc[1:], jnp.full((1,), num_tokens, jnp.int32)])
    seg_len = seg_end - query_start_loc  # [B + 1]
    blocks_end = jnp.cumsum((seg_len + block_q - 1) // block_q)  # [B + 1]
    slot = jnp.arange(num_q_blocks, dtype=jnp.int32)
    # First segment whose cumulative block count exceeds the slot (skips empty ones).
    seg = jnp.sum(blocks_end[None, :] <= slot[:, None], axis=1, dtype=jnp.int32)
    blocks_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), blocks_end])
    idx = slot - blocks_start[jnp.minimum(seg, seg_len.shape[0])]
    seg = jnp.where(seg < seg_len.shape[0], seg, -1)
    # Reversed: later blocks of a chunk see more keys, so they start first.
    return jnp.stack([seg, idx])[:, ::-1].astype(jnp.int32)


def default_tuning(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, dtype):
    """Per-shape defaults for the tuning knobs (all static), measured on an H200.

    `block_q * G` (the dots' M) is 64 rows: a decode row then does 64x the MMA work
    it needs, which keeps it just under the ridge point the kernel reaches (about
    250 TFLOP/s over 3.5 TB/s: the kernel stays bound by its KV loads), while a
    prefill chunk gets 64-row tiles and re-reads its KV once per 64 query rows.
    When T <= B (a decode batch, padded or not) M drops to 16, the smallest
    tensor-core tile. When the batch is mostly prefill (T >= 128 B: on average 128
    query tokens per sequence, so few decode rows to slow down) M is 128 with
    128-token KV blocks, 8 warps and 3 stages: on the H200 (BENCHMARKS.md,
    "Kernels") 1.3x faster than M = 64 for a 512-token chunk over 4,096 cached
    tokens x 8 (1,193 vs 1,581 us) and 1.25x for a fresh 2,048-token prefill x 4.
    float32 (a correctness path: exact IEEE dots, no tensor cores) and D = 256 use
    smaller KV blocks to keep the tiles in registers, and never M = 128.
    """
    head_dim = gpu_tile_dim(head_dim)  # registers hold the padded tiles
    group_pad = _pow2(num_heads // num_kv_heads)
    wide = head_dim > 128 or (jnp.dtype(dtype) == jnp.float32 and head_dim > 64)
    fast = jnp.dtype(dtype) != jnp.float32 and head_dim <= 128
    if fast and num_tokens >= 128 * num_seqs:
        return dict(block_q=max(1, 128 // group_pad), block_kv=128, num_warps=8, num_stages=3)
    rows = 16 if num_tokens <= num_seqs else 64
    block_q = max(1, rows // group_pad)
    return dict(
        block_q=block_q,
        block_kv=32 if wide else 64,
        num_warps=8 if head_dim > 128 or block_q * group_pad > 64 else 4,
        num_stages=2,
    )


def _check_knobs(block_q, block_kv, num_warps, num_stages, group_pad):
    if not is_pow2(block_q):
        raise ValueError(f"block_q must be a power of two, got {block_q=}")
    if block_q * group_pad < 16:
        raise ValueError(
            f"block_q * G must be >= 16 (smallest dot tile), got {block_q=} with G={group_pad}"
        )
    if not is_pow2(block_kv) or block_kv < 16:
        raise ValueError(f"block_kv must be a power of two >= 16, got {block_kv=}")
    if not is_pow2(num_warps) or num_warps > 32:  # Triton: at most 1,024 threads a program
        raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps=}")
    if not is_int(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages=}")


def ragged_paged_attention_gpu(
    q,
    k_pages,
    v_pages,
    page_table,
    context_lens,
    query_start_loc,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch_rows: bool = False,
):
    """Ragged paged attention with the Pallas Triton kernel.

    Semantics are those of `pallas_kernels.reference.ragged_paged_attention_xla`;
    inputs are assumed valid (`pallas_kernels.dispatch` checks them); the knobs are
    checked here (Python, numpy or concrete jax ints: `validation.static_knobs`).

    Args:
      q: [T, H, D] all sequences' query tokens back to back.
      k_pages: [K, P, S, D] one layer's key pages, in q's dtype or fp8.
      v_pages: [K, P, S, D] one layer's value pages, same dtype as k_pages.
      page_table: [B, max_pages] int32.
      context_lens: [B] int32 tokens in the cache per sequence, this step's included.
      query_start_loc: [B + 1] int32; rows past query_start_loc[B] return zeros.
      scale: logit scale, default D ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      sliding_window: if set, a query at p sees keys p - sliding_window < j <= p.
      interpret: run the kernel in the Pallas interpreter (CPU testing).
      block_q: query tokens per program (power of two; block_q * G >= 16).
      block_kv: KV tokens per inner step (power of two >= 16; need not match pages).
      num_warps, num_stages: Triton launch parameters.
      prefetch_rows: look each KV block's page ids up one iteration ahead and carry
        them in the loop state (an experiment, untimed: see the module docstring).

    Returns:
      [T, H, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    check_gpu_head_dim(head_dim)
    check_gpu_pool(k_pages.shape)
    num_kv_heads = k_pages.shape[0]
    num_seqs = page_table.shape[0]
    defaults = default_tuning(
        num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, jnp.dtype(q.dtype)
    )
    knobs = static_knobs(
        block_q=block_q, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages
    )
    knobs = {name: defaults[name] if val is None else val for name, val in knobs.items()}
    prefetch_rows = static_knobs(prefetch_rows=prefetch_rows)["prefetch_rows"]
    _check_knobs(**knobs, group_pad=_pow2(num_heads // num_kv_heads))
    if not isinstance(prefetch_rows, bool):
        raise ValueError(f"prefetch_rows must be a bool, got {prefetch_rows=}")
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {interpret=}")
    if num_tokens == 0 or num_seqs == 0 or page_table.shape[1] == 0 or k_pages.shape[1] == 0:
        return jnp.zeros_like(q)  # (no pages: every context is empty)
    return _ragged_call(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        scale=float(head_dim**-0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=interpret,
        prefetch_rows=prefetch_rows,
        **knobs,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "block_q",
        "block_kv",
        "num_warps",
        "num_stages",
        "prefetch_rows",
    ),
)
def _ragged_call(
    q,
    k_pages,
    v_pages,
    page_table,
    context_lens,
    query_start_loc,
    *,
    scale,
    soft_cap,
    sliding_window,
    interpret,
    block_q,
    block_kv,
    num_warps,
    num_stages,
    prefetch_rows,
):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, max_pages = page_table.shape
    group = num_heads // num_kv_heads
    # Traced values the host could not check are read within bounds (the module
    # docstring, "Values the host cannot check"): a non-decreasing query_start_loc in
    # [0, T] keeps every program's query rows in q and the output, and context_lens in
    # [0, max_pages * S] keeps its page walk in its page-table row.
    query_start_loc = jnp.clip(lax.cummax(query_start_loc.astype(jnp.int32)), 0, num_tokens)
    context_lens = jnp.clip(context_lens.astype(jnp.int32), 0, max_pages * page_size)
    num_segments = min(num_seqs + 1, num_tokens)
    num_q_blocks = (num_tokens + num_segments * (block_q - 1)) // block_q
    sched = _schedule(query_start_loc, num_tokens, block_q, num_q_blocks)
    qsl = jnp.concatenate([query_start_loc, jnp.full((1,), num_tokens, jnp.int32)])
    ctx = jnp.concatenate([context_lens, jnp.zeros((1,), jnp.int32)])
    kv_rows = num_pages * page_size
    kernel = functools.partial(
        _kernel,
        num_seqs=num_seqs,
        num_heads=num_heads,
        group=group,
        group_pad=_pow2(group),
        max_pages=max_pages,
        page_size=page_size,
        block_q=block_q,
        block_kv=block_kv,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        prefetch_rows=prefetch_rows,
    )
    whole = pl.no_block_spec
    kv_spec = pl.BlockSpec((None, kv_rows, head_dim), lambda j, h: (h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, num_kv_heads),
        in_specs=[whole, whole, whole, whole, whole, kv_spec, kv_spec],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_tokens * num_heads, head_dim), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{block_q}_bkv{block_kv}",
    )(
        sched,
        qsl,
        ctx,
        page_table.astype(jnp.int32).reshape(-1),
        q.reshape(num_tokens * num_heads, head_dim),
        k_pages.reshape(num_kv_heads, kv_rows, head_dim),
        v_pages.reshape(num_kv_heads, kv_rows, head_dim),
    )
    return out.reshape(num_tokens, num_heads, head_dim)
