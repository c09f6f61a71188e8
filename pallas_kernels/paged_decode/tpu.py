"""Paged decode attention for TPU: a Pallas kernel lowered through Mosaic.

One query token per sequence reads that sequence's K/V pages straight out of
the page pools in HBM. Mosaic (Pallas TPU) is the only Pallas lowering for TPU,
so that is the one used here; the same kernel runs on the CPU in the TPU
interpreter (`interpret=True`, with its race detector on).

How it works:

* Grid `(num_cores, steps)`: every step handles one (sequence, kv head) pair,
  with all `G = H // K` query heads of that kv head as the rows of one matrix,
  so each K/V byte is read from HBM once. The leading axis is "parallel" (it
  splits the work over the two TensorCores of a megacore chip), the second one
  "arbitrary" (sequential), because a step prefetches for the next one.
* `lengths` and the (flattened) page table are scalar-prefetched into SMEM. The
  pools stay in HBM (`memory_space=ANY`); pages are copied into a VMEM double
  buffer with `make_async_copy`, `pages_per_block` pages per compute block,
  one DMA semaphore per (K or V, buffer slot). While block `i` is computed,
  block `i + 1` is in flight; the last block of a step prefetches the first
  block of the core's next step, so no step starts with an empty pipe.
* Only pages that hold visible keys are copied: blocks past the length are never
  started, and with a sliding window neither are blocks (or pages) before it.
  Edge blocks (the last one, the first one under a window) mask logits to -inf
  and the unfilled V rows to 0, so stale or uninitialised VMEM never leaks in;
  interior blocks skip the masks.
  Values the host cannot check (a traced table or lengths under an outer jit)
  never move a DMA outside the pools or the page table: a length reads as at most
  `max_pages * S` (a negative one copies nothing), a page id as the XLA reference
  reads it (`int_ops.page_ids`).
* Online softmax in float32: running max and sum in `[Gp, 1]` VMEM scratch, the
  output accumulator in `[Gp, D]` float32 scratch, normalised once at the end.

What Mosaic's tiling forces, and how it is handled (nothing reaches the caller):

* A VMEM tile is 8 sublanes x 128 lanes of 32 bits; 16-bit types pack 16 rows
  per tile. The query/output block `[G, D]` must be tile aligned in its
  second-to-last dim, so G is padded to a multiple of 8 (float32) or 16
  (bfloat16) on the host; padded rows are zeros and are sliced off.
* Folding a block `[pages_per_block, S, D]` into `[pages_per_block * S, D]` for
  the matmuls needs S to be a multiple of the sublane tile. That holds for every
  power-of-two S >= 8 in float32 and S >= 16 in bfloat16. For bfloat16 with
  S = 8 (half a tile per page) the block is folded in float32 and packed back to
  bfloat16: a few extra VPU casts, same bytes from HBM, same bf16 matmuls.
* The logits of a block are `[Gp, pages_per_block * S]` with tokens on the 128
  lanes, so the default block is a multiple of 128 tokens (a short page table
  is rounded up; the extra pages are never copied and are masked).
* D = 64 fills half of the 128 lanes of each row (allowed, half the vreg
  throughput); 128 and 256 are lane aligned.
* Batch and kv heads are flattened into one work list; if `num_cores` does not
  divide it, the batch is padded with length-0 sequences. Any `max_pages` works:
  a block's page range is clipped to the sequence's pages.

FP8 pages (`float8_e4m3fn` or `float8_e5m2`, an FP8 KV cache) with a bfloat16 or
float32 q: pages are DMA'd as fp8 (half the bytes of bf16) into fp8 VMEM buffers,
and each block is converted in VMEM to float32, folded to `[block_kv, D]` there
(which also sidesteps fp8's 32-row packed tiles) and cast to q's dtype before
the dots. Float32 is the route because Mosaic's canonicalisation supports fp8 ->
f32 on every TPU generation, while fp8 -> bf16 is native only on TPU7x (older
chips decompose it through f32 anyway). The CPU lowering for "tpu" accepts this
and the interpreter runs it with race detection; no real TPU has compiled it,
so Mosaic's layout passes (fp8 vectors of S < 32 rows are sub-tile) are
unverified. `backend="auto"` on a TPU with fp8 pages runs this kernel; if Mosaic
rejects it on some chip, `backend="xla"` is the fallback.

Not supported / caveats:

* Page sizes that are not powers of two (the validation layer rejects them);
  int8 or scaled fp8 pools; K/V in a dtype other than q's, except unscaled fp8.
* One DMA per page: pages are scattered, so small pages mean many small DMAs
  (S = 8, D = 64, bf16 is 1 KiB each) and a DMA-issue-bound kernel.
* float32 matmuls run at HIGHEST precision (multi-pass on the MXU). With small
  G the MXU is mostly idle either way; decode is meant to be HBM-bound.
* The whole page table is scalar-prefetched into SMEM, which is small: very
  large `B * max_pages` (hundreds of thousands of entries) will not fit and the
  Mosaic compile fails. Copying page-table rows per step is not implemented.
* The kernel has only been lowered on a CPU machine (`lower(lowering_platforms=
  ("tpu",))`) and run in the interpreter: the final Mosaic compile and all
  timing happen on real TPU hardware, which this project has not had.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import int_ops
from pallas_kernels.validation import static_knobs

# Bytes of K (and again of V) one compute block aims to move.
_TARGET_BLOCK_BYTES = 128 * 1024
_MIN_BLOCK_TOKENS = 128
_MAX_BLOCK_TOKENS = 1024
_LANES = 128
_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T
_NN = (((1,), (0,)), ((), ()))


def _sublane_tile(dtype) -> int:
    """Rows per VMEM tile: 8 for 32-bit types, 16 for 16-bit ones."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _max_useful_pages(page_size: int, max_pages: int) -> int:
    """Pages covering a whole page-table row, rounded up to a multiple of 128 tokens."""
    tokens = -(-max_pages * page_size // _LANES) * _LANES
    return max(1, max_pages, tokens // page_size)


def default_pages_per_block(page_size: int, head_dim: int, dtype, max_pages: int) -> int:
    """Pages per compute block: about 128 KiB of K, 128..1024 tokens (a multiple of 128)."""
    tokens = _TARGET_BLOCK_BYTES // (head_dim * jnp.dtype(dtype).itemsize)
    tokens = min(max(tokens, _MIN_BLOCK_TOKENS), _MAX_BLOCK_TOKENS)
    return max(1, min(_max_useful_pages(page_size, max_pages), tokens // page_size))


def default_num_cores() -> int:
    """TensorCores behind the default device: 2 on megacore chips (v4, v5p), else 1."""
    device = jax.devices()[0]
    if device.platform != "tpu":
        return 1
    return max(1, int(getattr(device, "num_cores", 1)))


def _kernel(
    # Scalar prefetch (SMEM).
    lengths_ref,  # [Bp] int32
    page_table_ref,  # [Bp * max_pages] int32
    # Inputs.
    q_ref,  # [Gp, D] this step's query rows
    k_hbm,  # [K, P, S, D] in HBM
    v_hbm,  # [K, P, S, D] in HBM
    # Output.
    o_ref,  # [Gp, D]
    # Scratch.
    k_buf,  # [2, pages_per_block, S, D] VMEM double buffer
    v_buf,  # [2, pages_per_block, S, D]
    sems,  # DMA semaphores [2 (K, V), 2 (slot)]
    m_ref,  # [Gp, 1] float32 running max
    l_ref,  # [Gp, 1] float32 running sum
    acc_ref,  # [Gp, D] float32 unnormalised output
    state_ref,  # SMEM [2] int32: slot of the next step's first block, whether it is in flight
    *,
    num_kv_heads: int,
    num_cores: int,
    max_pages: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    head_dim = q_ref.shape[1]
    _, pages_per_block, page_size, _ = k_buf.shape
    block_tokens = pages_per_block * page_size
    core, step = pl.program_id(0), pl.program_id(1)
    num_steps = pl.num_programs(1)

    def item(s):
        """(sequence, kv head, length, first visible position) of this core's step s."""
        w = s * num_cores + core
        b, h = int_ops.div(w, num_kv_heads), int_ops.rem(w, num_kv_heads)
        n = jnp.minimum(lengths_ref[b], max_pages * page_size)
        lo = jnp.maximum(n - sliding_window, 0) if sliding_window is not None else n * 0
        return b, h, n, lo

    def block_copies(b, h, n, lo, blk, slot, pools, act):
        """Applies `act` (start or wait) to the DMAs of block `blk` of the given pools."""
        p_lo = jnp.maximum(blk * pages_per_block, int_ops.div(lo, page_size))
        p_hi = jnp.minimum((blk + 1) * pages_per_block, int_ops.div(n + page_size - 1, page_size))

        def one_page(p, carry):
            # Clamped into the pool: a traced table is unchecked (`int_ops.page_ids`).
            page = int_ops.page_ids(page_table_ref[b * max_pages + p], k_hbm.shape[1])
            dst = p - blk * pages_per_block
            for kind, hbm, buf in pools:
                act(pltpu.make_async_copy(hbm.at[h, page], buf.at[slot, dst], sems.at[kind, slot]))
            return carry

        lax.fori_loop(p_lo, p_hi, one_page, 0)

    keys, values = (0, k_hbm, k_buf), (1, v_hbm, v_buf)
    both = (keys, values)

    def start(c):
        c.start()

    def wait(c):
        c.wait()

    b, h, n, lo = item(step)
    first_blk = int_ops.div(lo, block_tokens)
    end_blk = int_ops.div(n + block_tokens - 1, block_tokens)

    @pl.when(step == 0)
    def _():
        state_ref[0] = 0
        state_ref[1] = 0

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((first_blk < end_blk) & (state_ref[1] == 0))
    def _():
        block_copies(b, h, n, lo, first_blk, state_ref[0], both, start)

    def prefetch_next_step(slot):
        nxt = step + 1
        b2, h2, n2, lo2 = item(jnp.minimum(nxt, num_steps - 1))
        go = (nxt < num_steps) & (n2 > 0)

        @pl.when(go)
        def _():
            block_copies(b2, h2, n2, lo2, int_ops.div(lo2, block_tokens), slot, both, start)

        state_ref[1] = go.astype(jnp.int32)

    q = q_ref[...]
    dtype = q.dtype  # of the dots; the buffers hold the pages' dtype (fp8 or the same)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def fold(buf, slot):
        """The block's pages as one [bt, D] matrix in q's dtype."""
        x = buf[slot]  # [pages_per_block, S, D]
        if x.dtype != dtype or page_size % _sublane_tile(dtype):
            # FP8 pages (upcast here in VMEM, so the DMA moved fp8 bytes; Mosaic converts
            # fp8 to and from float32 only) or half-tile pages (bf16, S = 8): fold them
            # in float32, then cast to q's dtype.
            return x.astype(jnp.float32).reshape(block_tokens, head_dim).astype(dtype)
        return x.reshape(block_tokens, head_dim)

    def update(blk, slot, masked):
        # V may still be landing while the logits are computed.
        block_copies(b, h, n, lo, blk, slot, (keys,), wait)
        k = fold(k_buf, slot)  # [bt, D]
        s = lax.dot_general(
            q, k, _NT, precision=precision, preferred_element_type=jnp.float32
        )  # [Gp, bt]
        if soft_cap is None:
            s = s * scale
        else:
            s = soft_cap * jnp.tanh(s * (scale / soft_cap))
        if masked:
            pos = blk * block_tokens + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where((pos >= lo) & (pos < n), s, -jnp.inf)
        block_copies(b, h, n, lo, blk, slot, (values,), wait)
        v = fold(v_buf, slot)
        if masked:
            # Rows of pages that were not copied hold stale or uninitialised VMEM;
            # p is 0 there, but 0 * NaN is not. Select in float32 (no bf16 VPU on
            # older chips, and the mask has a 32-bit layout).
            row = blk * block_tokens + lax.broadcasted_iota(jnp.int32, v.shape, 0)  # [bt, D]
            v = jnp.where((row >= lo) & (row < n), v.astype(jnp.float32), 0.0).astype(v.dtype)
        # Every processed block holds at least one visible key, so m_cur is finite.
        m_prev = m_ref[...]
        m_cur = jnp.max(s, axis=1, keepdims=True)  # [Gp, 1]
        m_next = jnp.maximum(m_prev, m_cur)
        alpha = jnp.exp(m_prev - m_next)  # [Gp, 1]; 0 on the first block
        p = jnp.exp(s - m_next)  # [Gp, bt]; exactly 0 where masked
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        pv = lax.dot_general(
            p.astype(dtype), v, _NN, precision=precision, preferred_element_type=jnp.float32
        )  # [Gp, D]
        acc_ref[...] = alpha * acc_ref[...] + pv

    def body(blk, slot):
        nxt = 1 - slot

        @pl.when(blk + 1 < end_blk)
        def _():
            block_copies(b, h, n, lo, blk + 1, nxt, both, start)

        @pl.when(blk + 1 == end_blk)
        def _():
            prefetch_next_step(nxt)

        edge = (blk * block_tokens < lo) | ((blk + 1) * block_tokens > n)

        @pl.when(edge)
        def _():
            update(blk, slot, masked=True)

        @pl.when(jnp.logical_not(edge))
        def _():
            update(blk, slot, masked=False)

        return nxt

    state_ref[0] = lax.fori_loop(first_blk, end_blk, body, state_ref[0])

    total = l_ref[...]  # [Gp, 1]; 0 only for an empty sequence, whose acc is 0
    inv = 1.0 / jnp.where(total > 0, total, 1.0)
    o_ref[...] = (acc_ref[...] * inv).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "sliding_window",
        "pages_per_block",
        "num_cores",
        "vmem_limit_bytes",
        "interpret",
    ),
)
def _paged_decode(
    q,  # [B, H, D]
    k_pages,  # [K, P, S, D]
    v_pages,  # [K, P, S, D]
    lengths,  # [B] int
    page_table,  # [B, max_pages] int
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    num_cores: int,
    vmem_limit_bytes: int | None,
    interpret,
):
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = num_heads // num_kv_heads
    rows = -(-group // _sublane_tile(q.dtype)) * _sublane_tile(q.dtype)
    # Pad the batch so the (sequence, kv head) work list splits evenly over cores.
    step_batch = num_cores // math.gcd(num_cores, num_kv_heads)
    padded_batch = -(-batch // step_batch) * step_batch
    num_steps = padded_batch * num_kv_heads // num_cores

    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, padded_batch - batch), (0, 0), (0, rows - group), (0, 0)))
    lengths = jnp.pad(lengths.astype(jnp.int32), (0, padded_batch - batch))
    page_table = jnp.pad(page_table.astype(jnp.int32), ((0, padded_batch - batch), (0, 0)))

    def row_block(core, step, *_):
        w = step * num_cores + core
        return int_ops.div(w, num_kv_heads), int_ops.rem(w, num_kv_heads), 0, 0

    row_spec = pl.BlockSpec((None, None, rows, head_dim), row_block)
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    kernel = functools.partial(
        _kernel,
        num_kv_heads=num_kv_heads,
        num_cores=num_cores,
        max_pages=max_pages,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_cores, num_steps),
            in_specs=[
                row_spec,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=row_spec,
            scratch_shapes=[
                buf,
                buf,
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=interpret,
        name="paged_decode_tpu",
    )(lengths, page_table.reshape(-1), q4, k_pages, v_pages)
    return out[:batch, :, :group].reshape(batch, num_heads, head_dim)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return value


def paged_decode_tpu(
    q,
    k_pages,
    v_pages,
    lengths,
    page_table,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    pages_per_block: int | None = None,
    num_cores: int | None = None,
    vmem_limit_bytes: int | None = None,
):
    """Decode attention over paged K/V with the Pallas TPU (Mosaic) kernel.

    Inputs are assumed valid (`pallas_kernels.validation.check_decode`, which
    the dispatcher runs); only the tuning knobs are checked here: Python, numpy or
    concrete jax ints (`validation.static_knobs`).

    Args:
      q: [B, H, D] the query of each sequence's newest token (position lengths[b] - 1).
      k_pages: [K, P, S, D] one layer's key pages, in q's dtype or fp8.
      v_pages: [K, P, S, D] one layer's value pages, same dtype as k_pages.
      lengths: [B] int tokens in the cache per sequence, this token included.
      page_table: [B, max_pages] int physical page ids in logical order.
      scale: logit scale, default D ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      sliding_window: if set, each query sees only its last `sliding_window` keys.
      interpret: True runs the kernel in the TPU interpreter on the CPU with race
        detection on; a `pltpu.InterpretParams` is used as given.
      pages_per_block: pages per compute block (one DMA double-buffer slot).
        Default: about 128 KiB of K per block, in the pages' dtype (see
        `default_pages_per_block`).
        Values beyond a whole page-table row (rounded up to 128 tokens) are
        clipped to it.
      num_cores: TensorCores to split the (sequence, kv head) work over.
        Default: the device's TensorCores (2 on megacore v4/v5p, else 1).
        Any value is correct; cores beyond the chip's just run in sequence.
      vmem_limit_bytes: Mosaic's scoped VMEM limit, default the compiler's.

    Returns:
      [B, H, D] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, _, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    knobs = static_knobs(
        pages_per_block=pages_per_block, num_cores=num_cores, vmem_limit_bytes=vmem_limit_bytes
    )
    pages_per_block, num_cores = knobs["pages_per_block"], knobs["num_cores"]
    vmem_limit_bytes = knobs["vmem_limit_bytes"]
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(page_size, head_dim, k_pages.dtype, max_pages)
    pages_per_block = _positive_int("pages_per_block", pages_per_block)
    pages_per_block = min(pages_per_block, _max_useful_pages(page_size, max_pages))
    num_cores = default_num_cores() if num_cores is None else num_cores
    num_cores = _positive_int("num_cores", num_cores)
    if vmem_limit_bytes is not None:
        _positive_int("vmem_limit_bytes", vmem_limit_bytes)
    if interpret is True:
        interpret = pltpu.InterpretParams(detect_races=True)
    elif interpret is not False and not isinstance(interpret, pltpu.InterpretParams):
        raise TypeError(f"interpret must be a bool or pltpu.InterpretParams, got {interpret!r}")
    if batch == 0 or max_pages == 0 or k_pages.shape[1] == 0:
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
        pages_per_block=pages_per_block,
        num_cores=num_cores,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
    )
