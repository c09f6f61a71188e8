"""The split-K merge of the GPU paged decode kernel: partial softmax states -> output.

With `num_splits > 1` each program of `gpu._decode_kernel` attends to one range of
a sequence's context and writes an unnormalised output `o`, its running maximum
`m` (base 2) and denominator `l`. The output is

    out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s,

with empty splits (`m_s = -inf`) weighted 0 and rows with no key at all 0.

Three implementations of the same function:

* `merge_splits`: a few jnp ops, the reference. XLA runs them as several small
  fusions: on the H200 at (B, S) = (32, 4096), 4 splits, it took 25.6 us per call
  (timed alone, BENCHMARKS.md "Kernels", 2026-11-30) for 2 MiB of partials, about
  a seventh of the whole call: launches and latency, not bytes.
* `merge_splits_gpu`: one Pallas (Triton) launch, one program per (sequence, kv
  head, head block) that walks the splits with an online rescale, reading each
  partial once; the walk is unrolled up to `UNROLLED_SPLITS` splits, so their
  loads can all be in flight at once.
* `merge_splits_wide`: one Pallas launch for many splits (B = 1, S = 32768 splits
  64 ways by default), where the walk above would be a chain of dependent steps
  each waiting for a load: one program per (sequence, query head) loads up to
  `WIDE_TILE` floats of partials, a [splits, D] tile, at once and reduces it along
  the split axis; more splits than fit are walked a tile at a time.

`merge_partials`, the merge `paged_decode_gpu` runs, picks `merge_splits_gpu` up
to `UNROLLED_SPLITS` splits and `merge_splits_wide` beyond. Neither kernel has
been timed on a GPU yet (XLA's fusions merged every split count when the H200
last ran); `scripts/profile_decode.py` times the picked merge against
`merge_splits` in the same rounds, and `scripts/bench_kernels.py` does so per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import int_ops
from pallas_kernels.validation import gpu_tile_dim

UNROLLED_SPLITS = 8  # up to this many splits the merge kernel's loop is unrolled
WIDE_TILE = 8192  # float32 elements of partials per tile of `merge_splits_wide` (32 KiB)


def merge_splits(o, m, denom, dtype):
    """Combines per-split partial softmax states with jnp ops (the reference).

    Args:
      o: [splits, B, H, D] float32 unnormalised outputs.
      m: [splits, B, H] float32 running maxima (base 2), -inf for empty splits.
      denom: [splits, B, H] float32 softmax denominators.
      dtype: the output dtype.

    Returns:
      [B, H, D] in `dtype`; zeros for rows with nothing to attend to.
    """
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp2(m - jnp.where(jnp.isfinite(m_max), m_max, 0.0))  # 0 for empty splits
    total = jnp.sum(weight * denom, axis=0)
    num = jnp.sum(weight[..., None] * o, axis=0)
    return (num / jnp.where(total > 0, total, 1.0)[..., None]).astype(dtype)


def program_heads(group: int, block_h: int, head_blocks: int):
    """This program's query heads, for the decode kernel and the merge alike: grid axis
    1 is (kv head, head block), and the block's heads are the rows of the tile.

    Returns:
      (kv_head, heads [block_h] int32, row_ok [block_h] bool): rows past the group are
      padding.
    """
    kv_head = int_ops.div(pl.program_id(1), head_blocks)
    head_block = int_ops.rem(pl.program_id(1), head_blocks)
    row = head_block * block_h + lax.iota(jnp.int32, block_h)  # [block_h]
    row_ok = row < group
    return kv_head, kv_head * group + row, row_ok


def head_columns(head_dim: int):
    """The column indices of a program's tiles and their mask, for every GPU kernel (the
    decode kernel, its merges, the ragged kernel): `gpu_tile_dim(head_dim)` columns, the
    padding past `head_dim` masked.

    Returns:
      (cols [1, tile_d] int32, col_ok): col_ok is None when nothing is padded (a power of
      two >= 16, whose kernels are then those before padding existed), else
      [1, tile_d] bool.
    """
    tile_d = gpu_tile_dim(head_dim)
    cols = lax.iota(jnp.int32, tile_d)[None, :]
    return cols, None if tile_d == head_dim else cols < head_dim


def with_cols(mask, col_ok):
    """`mask` (broadcasting against [rows, tile_d]) and the column mask, if any."""
    return mask if col_ok is None else mask & col_ok


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, group, block_h, head_blocks, num_splits):
    b = pl.program_id(0)
    _, heads, row_ok = program_heads(group, block_h, head_blocks)  # [block_h]
    cols, col_ok = head_columns(o_ref.shape[-1])  # [1, tile_d]
    tile_ok = with_cols(row_ok[:, None], col_ok)  # [block_h, tile_d]

    def body(s, carry):
        acc, m_run, l_run = carry  # [block_h, D], [block_h], [block_h]
        m_s = plgpu.load(m_ref.at[s, b, heads], mask=row_ok, other=-jnp.inf)
        l_s = plgpu.load(l_ref.at[s, b, heads], mask=row_ok, other=0.0)
        o_s = plgpu.load(o_ref.at[s, b, heads[:, None], cols], mask=tile_ok, other=0.0)
        m_new = jnp.maximum(m_run, m_s)
        # Both -inf (nothing seen yet, or empty rows): shift by 0, so both weights are 0.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_run - shift)
        weight = jnp.exp2(m_s - shift)
        acc = acc * alpha[:, None] + o_s * weight[:, None]
        return acc, m_new, l_run * alpha + l_s * weight

    init = (
        jnp.zeros((block_h, cols.shape[1]), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    if num_splits <= UNROLLED_SPLITS:
        # Unrolled: no split's loads wait for the previous split's arithmetic.
        carry = init
        for s in range(num_splits):
            carry = body(s, carry)
        acc, _, total = carry
    else:
        acc, _, total = lax.fori_loop(0, num_splits, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]
    out_idx = out_ref.at[b, heads[:, None], cols]
    plgpu.store(out_idx, out.astype(out_ref.dtype), mask=tile_ok)


def merge_splits_gpu(o, m, denom, *, dtype, group: int, block_h: int, interpret: bool = False):
    """`merge_splits` as one Pallas (Triton) kernel (not jitted itself: it is traced
    inside the caller's jit, as one more custom call).

    Args:
      o, m, denom: as for `merge_splits`.
      dtype: the output dtype.
      group: query heads per kv head (H // K).
      block_h: query heads per program (a power of two >= 16, as in the decode
        kernel); a group larger than block_h is cut into ceil(group / block_h) programs.
      interpret: run in the Pallas interpreter (CPU testing).

    Returns:
      [B, H, D] in `dtype`.
    """
    num_splits, batch, num_heads, head_dim = o.shape
    head_blocks = -(-group // block_h)
    kernel = functools.partial(
        _merge_kernel,
        group=group,
        block_h=block_h,
        head_blocks=head_blocks,
        num_splits=num_splits,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_heads, head_dim), dtype),
        grid=(batch, (num_heads // group) * head_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_decode_merge",
    )(o, m, denom)


def _wide_merge_kernel(o_ref, m_ref, l_ref, out_ref, *, num_splits, tile):
    b, h = pl.program_id(0), pl.program_id(1)
    cols, col_ok = head_columns(o_ref.shape[-1])  # [1, tile_d]

    def body(t, carry):
        acc, m_run, l_run = carry  # [D], [], []
        split = t * tile + lax.iota(jnp.int32, tile)  # [tile]
        ok = split < num_splits
        m_s = plgpu.load(m_ref.at[split, b, h], mask=ok, other=-jnp.inf)  # [tile]
        l_s = plgpu.load(l_ref.at[split, b, h], mask=ok, other=0.0)
        o_s = plgpu.load(
            o_ref.at[split[:, None], b, h, cols], mask=with_cols(ok[:, None], col_ok), other=0.0
        )
        m_new = jnp.maximum(m_run, jnp.max(m_s))
        # Nothing seen yet (or only empty splits): shift by 0, so every weight is 0.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_run - shift)
        weight = jnp.exp2(m_s - shift)  # [tile]; 0 for empty and padding splits
        acc = acc * alpha + jnp.sum(o_s * weight[:, None], axis=0)
        return acc, m_new, l_run * alpha + jnp.sum(l_s * weight)

    init = (
        jnp.zeros((cols.shape[1],), jnp.float32),
        jnp.float32(-jnp.inf),
        jnp.float32(0.0),
    )
    tiles = -(-num_splits // tile)
    if tiles == 1:
        acc, _, total = body(0, init)
    else:
        acc, _, total = lax.fori_loop(0, tiles, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)
    if col_ok is None:
        plgpu.store(out_ref.at[b, h, cols[0]], out.astype(out_ref.dtype))
    else:
        plgpu.store(out_ref.at[b, h, cols[0]], out.astype(out_ref.dtype), mask=col_ok[0])


def wide_tile(num_splits: int, head_dim: int) -> int:
    """Splits per tile of `merge_splits_wide`: a power of two (Triton's tiles are), at
    most `WIDE_TILE // head_dim` (>= 1) and no more than `num_splits` needs."""
    cap = max(1, WIDE_TILE // head_dim)
    tile = 1
    while tile < num_splits and tile * 2 <= cap:
        tile *= 2
    return tile


def merge_splits_wide(o, m, denom, *, dtype, interpret: bool = False):
    """`merge_splits` as one Pallas (Triton) kernel for many splits: one program per
    (sequence, query head), reducing a [splits, D] tile of partials at once (traced in
    the caller's jit, like `merge_splits_gpu`).

    Args:
      o, m, denom: as for `merge_splits` (any D: tiles pad it, `head_columns`).
      dtype: the output dtype.
      interpret: run in the Pallas interpreter (CPU testing).

    Returns:
      [B, H, D] in `dtype`.
    """
    num_splits, batch, num_heads, head_dim = o.shape
    kernel = functools.partial(
        _wide_merge_kernel,
        num_splits=num_splits,
        tile=wide_tile(num_splits, gpu_tile_dim(head_dim)),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_heads, head_dim), dtype),
        grid=(batch, num_heads),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_decode_merge_wide",
    )(o, m, denom)


def merge_partials(o, m, denom, *, dtype, group: int, block_h: int, interpret: bool = False):
    """The merge `paged_decode_gpu` runs: `merge_splits_gpu` up to `UNROLLED_SPLITS`
    splits, `merge_splits_wide` beyond (arguments as for `merge_splits_gpu`)."""
    if o.shape[0] > UNROLLED_SPLITS:
        return merge_splits_wide(o, m, denom, dtype=dtype, interpret=interpret)
    return merge_splits_gpu(
        o, m, denom, dtype=dtype, group=group, block_h=block_h, interpret=interpret
    )
