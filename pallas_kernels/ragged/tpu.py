"""Ragged paged attention as a Pallas TPU (Mosaic) kernel: chunked prefill and decode in one batch.

Lowering: Pallas -> Mosaic TPU, the only Pallas path to a TPU. Page table and per-sequence
metadata arrive as scalar prefetch (SMEM); K/V pools stay in HBM (`memory_space=ANY`) and each
needed page is copied to VMEM by async DMA, double-buffered so that the next KV block streams in
while the current one is computed. Softmax runs online in float32 VMEM scratch; float32 q/K/V
matmuls run at HIGHEST precision (multi-pass on the MXU), as the decode kernel's.

Grid: `(K, cdiv(T, block_q))`, both axes "parallel". Step `(h, i)` owns rows
`[i * block_q, (i + 1) * block_q)` of the flattened token axis for kv head `h`, i.e. a
`[G, block_q, D]` tile of queries (all G query heads of kv head `h`), so one `[G * block_q, D] x
[D, block_kv]` dot serves every head of the group and each KV byte is read once per query block.
Why this grid:

* A Pallas grid is static; `query_start_loc` and `context_lens` are runtime values. So the grid
  is sized from shapes only and each step finds its work at run time: the wrapper computes (in
  XLA, inside the same jit) the range of non-empty sequences that overlap each query block,
  and the kernel walks that range and, per sequence, only the KV blocks between the sliding
  window's start and the causal limit of the block's last row. Pages outside that range are
  never DMA'd.
* The alternative `(B, cdiv(T, block_q))` with early exit runs `B * T / block_q` steps, nearly
  all empty (a mixed batch of 128 decode rows and one 512-token chunk: ~1,300 steps instead
  of ~10), each paying the per-step overhead and a pipelined q/out block copy; and its output
  blocks would be revisited by several steps, which "parallel" axes forbid.
* Query rows of one block may belong to several sequences (decode rows, chunk boundaries).
  Rows outside the current sequence get an all-false mask, which leaves their online-softmax
  state exactly unchanged, so no masked stores are needed and every output row is written once
  by the BlockSpec pipeline.
* Each step is self-contained (its first KV DMA is issued at the step's start, not prefetched
  by the previous step), so both grid axes can be "parallel" (megacore sharding). The price is
  one exposed KV DMA latency per grid step.

Mosaic constraints handled here rather than by the caller:

* Block shapes need their last two dims divisible by (8, 128) or equal to the array's, and a
  `[block_q, G, D]` slice of `[T, H, D]` is neither unless 8 divides G or K = 1: the wrapper
  relays q out as `[K, G, T_pad, D]` (T padded to a multiple of `block_q`; a cheap copy of q,
  not of the cache) and the output back. `block_q` is a multiple of 16 (bf16; 8 for f32) so a
  `[G, block_q, D]` tile collapses to `[G * block_q, D]` without splitting a packed tile.
* A DMA copies whole pages (`[S, D]`, full trailing dims), so the VMEM buffer is
  `[pages_per_block, S, D]` and is collapsed to `[block_kv, D]` after loading. For packed dtypes
  with pages shorter than a packed tile (bf16, S=8) the collapse is done in float32 and cast
  back (exact).
* Running max and sum are kept lane-replicated (`[M, 128]`: full-lane loads and stores, no
  `[M, 1]` relayouts);
  `block_kv = pages_per_block * page_size` is a power of two, so it is either below 128 lanes
  or a multiple of 128.
* V rows outside the span a block's rows can see (dead page tails, stale pages of another
  sequence, buffer slots never written) are zeroed before the second dot, and logits outside
  it are replaced before the softmax, so neither uninitialised VMEM nor a recycled page's
  NaN/inf reaches the output; the K/V buffers need no clearing.

Values the host cannot check (a traced page table, `context_lens` or `query_start_loc`
under an outer jit) never move a DMA or an SMEM read outside its array; the output is
then garbage, the memory accesses are not. The wrapper clips `context_lens` to
`[0, max_pages * S]` (an elementwise XLA op on B values), which bounds each sequence's
page walk by its page-table row, and the kernel reads each page id as the XLA reference
does (`int_ops.page_ids`). `query_start_loc` needs no clamp: q and the output move
through BlockSpecs, and the page walk is bounded by the context length alone.

Tuning (keyword-only, defaults per shape from `default_tuning`): `block_q` query tokens per
grid step (~256 dot rows: 128 for G <= 2, 64 for G=4, 32 for G=8, 16 beyond; never more than
T rounded up), `pages_per_block` pages per KV block (`block_kv` ~512 keys, 256 for D=256, at
least 128 keys, at most the page table's capacity), `vmem_limit_bytes`.

FP8 pages (`float8_e4m3fn` or `float8_e5m2`) with a bfloat16 or float32 q, as in
`pallas_kernels.paged_decode.tpu` (whose docstring says why and what is unverified):
DMA'd as fp8, each block converted in VMEM to float32, folded to `[block_kv, D]` and
cast to q's dtype before the dots; `backend="xla"` is the fallback if Mosaic rejects
it on some chip.

Not supported: K/V dtype differing from q other than unscaled fp8 (no int8 or scaled fp8
cache); the page table must fit in SMEM
as scalar prefetch (`B * max_pages` int32 words); page sizes that are not powers of two
(rejected by validation); page sizes below 8 work in interpret mode but are below Mosaic's
sublane tile. Not yet verified on TPU hardware: only interpret mode and lowering
to Mosaic MLIR are tested on CPU (Mosaic's layout passes run only in the TPU compiler).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import int_ops
from pallas_kernels.validation import is_int, static_knobs

_LANES = 128
# Finite "minus infinity": masked logits and the initial running max. Being finite keeps
# exp(m_prev - m_new) well defined (= 1) for rows that have seen nothing yet.
_MASK = -1e30


def _lanes(x, n):
    """Lane-replicated [M, 128] -> [M, n], any n >= 1 (block_kv, or head_dim: e.g. 192)."""
    if n == _LANES:
        return x
    if n < _LANES:
        return x[:, :n]
    x = jnp.concatenate([x] * -(-n // _LANES), axis=1)
    return x if n % _LANES == 0 else x[:, :n]


def _seq_bounds(c, blk_start, *, qs_ref, qe_ref, ctx_ref, block_q, block_kv, window):
    """Rows of compacted sequence `c` in the query block and the KV span they need."""
    qs, qe, ctx = qs_ref[c], qe_ref[c], ctx_ref[c]
    r0 = jnp.maximum(qs, blk_start)
    r1 = jnp.minimum(qe, blk_start + block_q)
    base = ctx - qe  # query row r sits at position base + r
    p_hi = base + r1 - 1  # causal limit of the block's last row
    k_lo = 0 if window is None else jnp.maximum(base + r0 - window + 1, 0)
    return dict(
        r0=r0,
        r1=r1,
        base=base,
        p_hi=p_hi,
        k_lo=k_lo,
        j_lo=int_ops.div(k_lo, block_kv),
        j_hi=int_ops.div(p_hi, block_kv),
    )


def _kernel(
    # scalar prefetch (SMEM)
    seq_ref,  # [B + 1] int32 batch index of the c-th non-empty sequence
    qs_ref,  # [B + 1] int32 first query row of it
    qe_ref,  # [B + 1] int32 one past its last query row
    ctx_ref,  # [B + 1] int32 its context length
    clo_ref,  # [num_q_blocks] int32 first compacted sequence overlapping each q block
    chi_ref,  # [num_q_blocks] int32 one past the last
    pt_ref,  # [B * max_pages] int32 flattened page table
    # inputs
    q_ref,  # [G, bq, D] VMEM block
    k_hbm,  # [K, P, S, D] HBM
    v_hbm,  # [K, P, S, D] HBM
    # output
    o_ref,  # [G, bq, D]
    # scratch
    kbuf,  # [2, ppb, S, D]
    vbuf,  # [2, ppb, S, D]
    sems,  # DMA semaphores [2 (k, v), 2 (slot)]
    m_ref,  # [M, 128] f32 running max, lane-replicated (M = G * bq)
    l_ref,  # [M, 128] f32 running sum
    acc_ref,  # [M, D] f32
    *,
    scale,
    soft_cap,
    window,
    max_pages,
):
    group, block_q, head_dim = q_ref.shape
    _, ppb, page_size, _ = kbuf.shape
    block_kv = ppb * page_size
    rows = group * block_q
    kh = pl.program_id(0)
    qi = pl.program_id(1)
    blk_start = qi * block_q
    c_lo, c_hi = clo_ref[qi], chi_ref[qi]
    bounds = functools.partial(
        _seq_bounds,
        blk_start=blk_start,
        qs_ref=qs_ref,
        qe_ref=qe_ref,
        ctx_ref=ctx_ref,
        block_q=block_q,
        block_kv=block_kv,
        window=window,
    )

    m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def for_each_page(c, j, slot, fn):
        # Pages of KV block j that the rows of sequence c can see; the rest are never copied.
        b = bounds(c)
        first = j * ppb
        i_lo = jnp.maximum(int_ops.div(b["k_lo"], page_size) - first, 0)
        i_hi = jnp.minimum(int_ops.div(b["p_hi"], page_size) - first + 1, ppb)
        row = seq_ref[c] * max_pages + first

        def body(i, carry):
            # Clamped into the pool: a traced table is unchecked (`int_ops.page_ids`).
            page = int_ops.page_ids(pt_ref[row + i], k_hbm.shape[1])
            for pool, buf, which in ((k_hbm, kbuf, 0), (v_hbm, vbuf, 1)):
                fn(pltpu.make_async_copy(pool.at[kh, page], buf.at[slot, i], sems.at[which, slot]))
            return carry

        lax.fori_loop(i_lo, i_hi, body, 0)

    def collapse(buf):
        # [ppb, S, D] -> [block_kv, D] in q's dtype; sub-tile packed pages are collapsed
        # in float32.
        x = buf[...]
        packing = 4 // jnp.dtype(x.dtype).itemsize
        if x.dtype != q_ref.dtype or page_size % (8 * packing):
            # FP8 pages (upcast here in VMEM, so the DMA moved fp8 bytes; Mosaic converts
            # fp8 to and from float32 only) or sub-tile packed pages: collapse in float32.
            return x.astype(jnp.float32).reshape(block_kv, head_dim).astype(q_ref.dtype)
        return x.reshape(block_kv, head_dim)

    # float32 matmuls at HIGHEST precision (multi-pass on the MXU), as the decode kernel's:
    # Mosaic's default may run them as one bf16 pass.
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def compute(c, j, slot):
        b = bounds(c)
        q = q_ref[...].reshape(rows, head_dim)
        k = collapse(kbuf.at[slot])
        v = collapse(vbuf.at[slot])
        # Rows outside [k_lo, p_hi] (dead page tails, pages of other sequences left in
        # the buffer) may hold stale NaN/inf: zero them, as 0 * NaN would leak into pv.
        kpos = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
        live = (kpos >= b["k_lo"]) & (kpos <= b["p_hi"])
        v = jnp.where(live, v.astype(jnp.float32), 0.0).astype(v.dtype)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * scale  # [M, block_kv]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        # delta = query position - key position; rows of other sequences get -1 (= masked).
        t = lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 0) + blk_start
        col = lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 1)
        delta = jnp.where((t >= b["r0"]) & (t < b["r1"]), b["base"] - j * block_kv + t - col, -1)
        if group > 1:
            delta = jnp.broadcast_to(delta[None], (group, block_q, block_kv))
            delta = delta.reshape(rows, block_kv)
        mask = delta >= 0
        if window is not None:
            mask &= delta < window
        s = jnp.where(mask, s, _MASK)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [M, 128]
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - _lanes(m_new, block_kv)), 0.0)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * _lanes(alpha, head_dim) + pv

    @pl.when(c_lo < c_hi)
    def _():
        for_each_page(c_lo, bounds(c_lo)["j_lo"], 0, lambda cp: cp.start())

    def cond(state):
        return state[0] < c_hi

    def body(state):
        c, j, slot = state
        last = j >= bounds(c)["j_hi"]
        nc = jnp.where(last, c + 1, c)
        nj = jnp.where(last, bounds(c + 1)["j_lo"], j + 1)

        @pl.when(nc < c_hi)
        def _():
            for_each_page(nc, nj, 1 - slot, lambda cp: cp.start())

        for_each_page(c, j, slot, lambda cp: cp.wait())
        compute(c, j, slot)
        return nc, nj, 1 - slot

    lax.while_loop(cond, body, (c_lo, bounds(c_lo)["j_lo"], jnp.int32(0)))

    denom = _lanes(l_ref[...], head_dim)
    out = jnp.where(denom > 0, acc_ref[...] / jnp.where(denom > 0, denom, 1.0), 0.0)
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def _pow2_ceil(n):
    return 1 << max(0, int(n) - 1).bit_length()


def default_tuning(num_tokens, num_heads, num_kv_heads, head_dim, page_size, max_pages, dtype):
    """Per-shape defaults: `block_q` and `pages_per_block`.

    `block_q` aims at ~256 rows (G * block_q) per dot: enough to fill the MXU on prefill
    chunks while keeping decode rows (1 useful row of G per sequence) memory-bound.
    `block_kv = pages_per_block * page_size` aims at 512 keys (256 for D > 128), at least 128
    (a full lane width) and no more than the page table can hold.
    """
    group = num_heads // num_kv_heads
    align = _q_align(dtype)
    block_q = max(align, min(128, 256 // group) // align * align)
    block_q = min(block_q, -(-max(num_tokens, 1) // align) * align)
    target_kv = 512 if head_dim <= 128 else 256
    ppb = min(max(1, target_kv // page_size), _pow2_ceil(max_pages))
    ppb = max(ppb, max(1, _LANES // page_size))
    return dict(block_q=block_q, pages_per_block=ppb)


def _q_align(dtype):
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _interpret_params(interpret):
    if interpret is True:
        return pltpu.InterpretParams(detect_races=True)
    if interpret is False or interpret is None:
        return None
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise TypeError(f"interpret must be a bool or pltpu.InterpretParams, got {interpret=}")


def _check_tuning(block_q, pages_per_block, vmem_limit_bytes, dtype):
    """ValueError naming a bad knob: each must be an int (numpy ones are made Python ones by
    `static_knobs` first; a bool is an int, not a count, and a float is refused)."""
    align = _q_align(dtype)
    if not is_int(block_q) or block_q < align or block_q % align:
        raise ValueError(f"block_q must be a positive multiple of {align}, got {block_q=}")
    if not is_int(pages_per_block) or pages_per_block < 1:
        raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block=}")
    if pages_per_block & (pages_per_block - 1):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block=}")
    if vmem_limit_bytes is not None and not (is_int(vmem_limit_bytes) and vmem_limit_bytes > 0):
        raise ValueError(f"vmem_limit_bytes must be a positive int, got {vmem_limit_bytes=}")


def _schedule(context_lens, query_start_loc, num_q_blocks, block_q):
    """Per query block, the range of non-empty sequences overlapping it (traced, in XLA).

    Returns (seq, q_start, q_end, ctx) of the non-empty sequences compacted to the front
    ([B + 1] each, padded with zeros) and (c_lo, c_hi) per query block.
    """
    batch = context_lens.shape[0]
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    nonempty = ends > starts
    order = jnp.argsort(~nonempty, stable=True).astype(jnp.int32)  # non-empty first
    valid = jnp.arange(batch) < jnp.sum(nonempty)
    big = jnp.iinfo(jnp.int32).max
    starts_c = jnp.where(valid, starts[order], big)  # both ascending
    ends_c = jnp.where(valid, ends[order], big)
    blk_start = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    blk_end = jnp.minimum(blk_start + block_q, query_start_loc[batch])
    c_lo = jnp.searchsorted(ends_c, blk_start, side="right").astype(jnp.int32)
    c_hi = jnp.searchsorted(starts_c, blk_end, side="left").astype(jnp.int32)

    def pad(x):
        return jnp.pad(jnp.where(valid, x, 0).astype(jnp.int32), (0, 1))

    return (
        pad(order),
        pad(starts_c),
        pad(ends_c),
        pad(context_lens[order]),
        c_lo,
        c_hi,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "sliding_window",
        "block_q",
        "pages_per_block",
        "vmem_limit_bytes",
        "interpret",
    ),
)
def _ragged_tpu(
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
    block_q,
    pages_per_block,
    vmem_limit_bytes,
    interpret,
):
    t, h, d = q.shape
    kv, _, page_size, _ = k_pages.shape
    group = h // kv
    batch, max_pages = page_table.shape
    t_pad = -(-t // block_q) * block_q
    num_q_blocks = t_pad // block_q
    rows = group * block_q

    q4 = q.reshape(t, kv, group, d).transpose(1, 2, 0, 3)  # [K, G, T, D]
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))
    # A traced context_lens is unchecked: clamped to the page table's capacity, each
    # sequence's page walk stays in its row (and a negative length cannot wrap its
    # causal limit around to int32 max). Valid lengths pass unchanged.
    context_lens = jnp.clip(context_lens.astype(jnp.int32), 0, max_pages * page_size)
    sched = _schedule(context_lens, query_start_loc.astype(jnp.int32), num_q_blocks, block_q)
    prefetch = (*sched, page_table.astype(jnp.int32).reshape(-1))

    q_spec = pl.BlockSpec((pl.Squeezed(), group, block_q, d), lambda hh, i, *_: (hh, 0, i, 0))
    kernel = functools.partial(
        _kernel, scale=scale, soft_cap=soft_cap, window=sliding_window, max_pages=max_pages
    )
    buf = pltpu.VMEM((2, pages_per_block, page_size, d), k_pages.dtype)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(kv, num_q_blocks),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                buf,
                buf,
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((rows, _LANES), jnp.float32),
                pltpu.VMEM((rows, _LANES), jnp.float32),
                pltpu.VMEM((rows, d), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(*prefetch, q4, k_pages, v_pages)
    return out[:, :, :t].transpose(2, 0, 1, 3).reshape(t, h, d)


def ragged_paged_attention_tpu(
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
    interpret: bool | pltpu.InterpretParams = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
):
    """Ragged paged attention on TPU: prefill chunks and decode rows in one batch.

    Semantics are those of `pallas_kernels.reference.ragged_paged_attention_xla`; inputs are
    assumed valid (`pallas_kernels.dispatch.ragged_paged_attention` checks them); the knobs
    are checked here (Python, numpy or concrete jax ints: `validation.static_knobs`).

    Args:
      q: [T, H, D] all sequences' query tokens back to back.
      k_pages: [K, P, S, D] one layer's key pages (HBM), in q's dtype or fp8.
      v_pages: [K, P, S, D] one layer's value pages, same dtype as k_pages.
      page_table: [B, max_pages] int32 physical page ids in logical order.
      context_lens: [B] int32 tokens in the cache per sequence, this step's included.
      query_start_loc: [B + 1] int32; sequence b owns rows [loc[b], loc[b + 1]).
      scale: logit scale, default D ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      sliding_window: if set, a query at position p sees keys p - W < j <= p.
      interpret: True runs the TPU interpreter with race detection on any backend; a
        `pltpu.InterpretParams` is used as given.
      block_q: query rows per grid step (multiple of 16 for bf16, 8 for f32); default
        from `default_tuning`.
      pages_per_block: pages per KV block (power of two); default from `default_tuning`.
      vmem_limit_bytes: Mosaic scoped VMEM limit override.

    Returns:
      [T, H, D] in q's dtype; padding rows (past query_start_loc[B]) are zeros.
    """
    t, h, d = q.shape
    kv, _, page_size, _ = k_pages.shape
    batch, max_pages = page_table.shape
    defaults = default_tuning(max(t, 1), h, kv, d, page_size, max(max_pages, 1), q.dtype)
    knobs = static_knobs(
        block_q=block_q, pages_per_block=pages_per_block, vmem_limit_bytes=vmem_limit_bytes
    )
    block_q, pages_per_block = knobs["block_q"], knobs["pages_per_block"]
    vmem_limit_bytes = knobs["vmem_limit_bytes"]
    block_q = defaults["block_q"] if block_q is None else block_q
    pages_per_block = defaults["pages_per_block"] if pages_per_block is None else pages_per_block
    _check_tuning(block_q, pages_per_block, vmem_limit_bytes, q.dtype)  # (empty calls too)
    if t == 0 or batch == 0 or k_pages.shape[1] == 0:
        return jnp.zeros(q.shape, q.dtype)  # (no pages: every context is empty)
    return _ragged_tpu(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        scale=float(d**-0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        block_q=block_q,
        pages_per_block=pages_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=_interpret_params(interpret),
    )
