"""Dense attention references in plain jnp: the oracle every kernel is checked against.

Everything here accumulates in float32 and returns the query dtype. The paged
variants (`paged_attention_xla`, `ragged_paged_attention_xla`) gather each
sequence's pages through its page table and then run the dense math, so they are
both the XLA backend of `pallas_kernels.dispatch` and the reference for the Pallas
kernels.

Conventions shared by every function (and every kernel):

* Shapes: `B` batch, `T` tokens, `H` query heads, `K` kv heads, `D` head dim,
  `P` pages, `S` page size. Query head `h` reads kv head `h // (H // K)` (GQA;
  `K == 1` is MQA, `K == H` is MHA).
* Page pools are `[K, P, S, D]` (one layer of `PagedKVCache`); a page table row
  lists a sequence's physical pages in logical order; entries past the
  sequence's last page are padding and are never read for their values.
* A query at absolute position `p` sees key positions `j <= p`; with
  `sliding_window=W` only `p - W < j <= p` (W keys, itself included).
* Logits are `scale * q.k` (default `scale = D ** -0.5`), then, with
  `soft_cap=c`, `c * tanh(logits / c)`.
* Rows with nothing to attend to (length 0, or padding query rows) return zeros.
* K/V (dense or paged) may be FP8 (`validation.FP8_DTYPES`, an FP8 KV cache) with
  a bfloat16 or float32 q: they are upcast to q's dtype before any math, as the
  kernels do. The upcast is exact (every e4m3fn/e5m2 value is a bfloat16 value),
  so the result is attention over the fp8-rounded K/V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.validation import FP8_DTYPES

_NEG_INF = float("-inf")


def _upcast(x, dtype):
    """FP8 K/V -> `dtype` (q's); anything else unchanged."""
    return x.astype(dtype) if jnp.dtype(x.dtype) in FP8_DTYPES else x


def _logits(q, k, scale, soft_cap):
    # q: [..., H, Tq, D]  k: [..., H, Tk, D] -> [..., H, Tq, Tk] float32
    s = jnp.einsum("...qd,...kd->...qk", q.astype(jnp.float32), k.astype(jnp.float32))
    return _cap(s * scale, soft_cap)


def _cap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _masked_softmax_pv(s, mask, v):
    # s, mask: [..., Tq, Tk]  v: [..., Tk, D] -> [..., Tq, D] float32
    # Keys no query sees are zeroed, not only weighted by 0: a recycled page's stale
    # tail may hold NaN/inf, and 0 * NaN would leak it into this sequence.
    v = jnp.where(jnp.any(mask, axis=-2)[..., None], v, 0)
    s = jnp.where(mask, s, _NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True, initial=_NEG_INF)  # initial: Tk may be 0
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("...qk,...kd->...qd", p, v.astype(jnp.float32))
    return jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)


def _visible(q_pos, k_pos, k_len, sliding_window):
    # q_pos: [Tq], k_pos: [Tk], k_len: scalar -> [Tq, Tk] bool
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < k_len)
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def _repeat_kv(x, num_heads):
    # x: [..., K, T, D] -> [..., H, T, D]
    group = num_heads // x.shape[-3]
    return jnp.repeat(x, group, axis=-3)


def _default_scale(scale, head_dim):
    return head_dim**-0.5 if scale is None else scale


def _check_heads(num_heads, num_kv_heads):
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"kv heads must divide query heads, got {num_heads=} and {num_kv_heads=}")


def attention_chunk(q, k, v, *, context_len=None, scale=None, soft_cap=None, sliding_window=None):
    """One sequence: a chunk of queries over a cached prefix plus itself, causally.

    Query `i` sits at absolute position `context_len - Tq + i` and sees key
    positions up to it (and within the sliding window).

    Args:
      q: [Tq, H, D] queries of the chunk (the last Tq tokens of the context).
      k: [Tk, K, D] keys of the whole context (cached prefix + this chunk).
      v: [Tk, K, D] values, same layout.
      context_len: number of valid keys (<= Tk); defaults to Tk.
      scale, soft_cap, sliding_window: see the module docstring.

    Returns:
      [Tq, H, D] in q's dtype.
    """
    tq, h, d = q.shape
    tk, kh, _ = k.shape
    _check_heads(h, kh)
    k, v = _upcast(k, q.dtype), _upcast(v, q.dtype)
    context_len = tk if context_len is None else context_len
    q_pos = context_len - tq + jnp.arange(tq)
    mask = _visible(q_pos, jnp.arange(tk), context_len, sliding_window)
    qh = q.transpose(1, 0, 2)  # [H, Tq, D]
    kh_ = _repeat_kv(k.transpose(1, 0, 2), h)  # [H, Tk, D]
    vh = _repeat_kv(v.transpose(1, 0, 2), h)
    s = _logits(qh, kh_, _default_scale(scale, d), soft_cap)
    o = _masked_softmax_pv(s, mask[None], vh)  # [H, Tq, D]
    return o.transpose(1, 0, 2).astype(q.dtype)


def causal_prefill(q, k, v, lengths=None, *, scale=None, soft_cap=None, sliding_window=None):
    """Batched causal self-attention over whole (right-padded) sequences.

    Args:
      q: [B, T, H, D]
      k: [B, T, K, D]
      v: [B, T, K, D]
      lengths: [B] int valid tokens per row (default: all T). Padding rows are zero.

    Returns:
      [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    _check_heads(h, k.shape[2])
    k, v = _upcast(k, q.dtype), _upcast(v, q.dtype)
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths)
    pos = jnp.arange(t)

    def one(qb, kb, vb, n):
        mask = _visible(pos, pos, n, sliding_window) & (pos[:, None] < n)
        kk = _repeat_kv(kb.transpose(1, 0, 2), h)  # [H, T, D]
        s = _logits(qb.transpose(1, 0, 2), kk, _default_scale(scale, d), soft_cap)
        o = _masked_softmax_pv(s, mask[None], _repeat_kv(vb.transpose(1, 0, 2), h))
        return o.transpose(1, 0, 2)

    return jax.vmap(one)(q, k, v, lengths).astype(q.dtype)


def decode(q, k, v, lengths, *, scale=None, soft_cap=None, sliding_window=None):
    """One query token per sequence over dense, right-padded K/V.

    The query sits at position `lengths[b] - 1` (its own K/V is already in k/v).

    Args:
      q: [B, H, D]
      k: [B, T, K, D]
      v: [B, T, K, D]
      lengths: [B] int valid keys per sequence (0 gives a zero row).

    Returns:
      [B, H, D] in q's dtype.
    """
    b, h, d = q.shape
    t, kh = k.shape[1], k.shape[2]
    _check_heads(h, kh)
    k, v = _upcast(k, q.dtype), _upcast(v, q.dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    k_pos = jnp.arange(t)

    def one(qb, kb, vb, n):
        mask = _visible((n - 1)[None], k_pos, n, sliding_window)  # [1, T]
        kk = _repeat_kv(kb.transpose(1, 0, 2), h)  # [H, T, D]
        s = _logits(qb[:, None, :], kk, _default_scale(scale, d), soft_cap)  # [H, 1, T]
        o = _masked_softmax_pv(s, mask[None], _repeat_kv(vb.transpose(1, 0, 2), h))
        return o[:, 0, :]

    return jax.vmap(one)(q, k, v, lengths).astype(q.dtype)


def gather_pages(pages, page_table):
    """Gathers sequences' pages into dense K or V.

    Args:
      pages: [K, P, S, D] one layer's page pool.
      page_table: [B, max_pages] int32 physical page ids.

    Returns:
      [B, max_pages * S, K, D]
    """
    k, _, s, d = pages.shape
    b, max_pages = page_table.shape
    # jnp, even for numpy pools: padding entries may hold any id (-1, or past P), and
    # XLA's gather wraps or clamps them where numpy indexing would raise.
    g = jnp.asarray(pages)[:, jnp.asarray(page_table)]  # [K, B, max_pages, S, D]
    return g.transpose(1, 2, 3, 0, 4).reshape(b, max_pages * s, k, d)


def paged_attention_xla(
    q, k_pages, v_pages, lengths, page_table, *, scale=None, soft_cap=None, sliding_window=None
):
    """Paged decode attention in plain XLA: gather pages, then `decode`.

    Args:
      q: [B, H, D] one query token per sequence (at position lengths[b] - 1).
      k_pages: [K, P, S, D] in q's dtype or fp8.
      v_pages: [K, P, S, D] same dtype as k_pages.
      lengths: [B] int32 tokens in the cache per sequence.
      page_table: [B, max_pages] int32.

    Returns:
      [B, H, D] in q's dtype.
    """
    if k_pages.shape[1] == 0:  # no pages: every length is 0 (nothing to gather from)
        return jnp.zeros(q.shape, q.dtype)
    k = _upcast(gather_pages(k_pages, page_table), q.dtype)  # [B, max_pages * S, K, D]
    v = _upcast(gather_pages(v_pages, page_table), q.dtype)
    return decode(q, k, v, lengths, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)


def ragged_paged_attention_xla(
    q,
    k_pages,
    v_pages,
    page_table,
    context_lens,
    query_start_loc,
    *,
    scale=None,
    soft_cap=None,
    sliding_window=None,
):
    """Ragged paged attention in plain XLA: chunked prefill and decode rows in one batch.

    Sequence `b` owns query rows `query_start_loc[b] : query_start_loc[b + 1]`
    (q_len of them) and has `context_lens[b]` tokens in the cache, this step's
    included; its query `i` sits at position `context_lens[b] - q_len + i`.
    Query rows past `query_start_loc[B]` are padding and return zeros.

    Args:
      q: [T, H, D] all sequences' query tokens back to back.
      k_pages: [K, P, S, D] in q's dtype or fp8.
      v_pages: [K, P, S, D] same dtype as k_pages.
      page_table: [B, max_pages] int32.
      context_lens: [B] int32.
      query_start_loc: [B + 1] int32, non-decreasing, starting at 0.

    Returns:
      [T, H, D] in q's dtype.
    """
    t, h, d = q.shape
    _check_heads(h, k_pages.shape[0])
    b, max_pages = page_table.shape
    s_len = max_pages * k_pages.shape[2]
    if b == 0 or s_len == 0 or k_pages.shape[1] == 0:  # no cached token: all rows padding
        return jnp.zeros(q.shape, q.dtype)
    query_start_loc = jnp.asarray(query_start_loc, jnp.int32)
    context_lens = jnp.asarray(context_lens, jnp.int32)
    # Which sequence each query row belongs to, and its absolute position.
    row = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, row, side="right") - 1, 0, b - 1)
    valid = row < query_start_loc[b]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    q_pos = context_lens[seq] - q_len + (row - query_start_loc[seq])  # [T]

    k = _upcast(gather_pages(k_pages, page_table), q.dtype)  # [B, s_len, K, D]
    v = _upcast(gather_pages(v_pages, page_table), q.dtype)
    k_pos = jnp.arange(s_len)
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < context_lens[seq][:, None])
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    mask &= valid[:, None]  # [T, s_len]

    # Slots no query of their sequence sees are zeroed: a recycled page's stale tail may
    # hold NaN/inf, and so may a page released below the sliding window (the page table
    # then names the padding page there).
    live = k_pos[None, :] < context_lens[:, None]  # [B, s_len]
    if sliding_window is not None:
        seq_q_len = query_start_loc[1:] - query_start_loc[:-1]  # [B]
        first_pos = context_lens - seq_q_len  # of each sequence's first query
        live &= k_pos[None, :] > (first_pos - sliding_window)[:, None]
    live = live[:, :, None, None]  # [B, s_len, 1, 1]
    k = jnp.where(live, k, 0)
    v = jnp.where(live, v, 0)
    kr = _repeat_kv(k.transpose(0, 2, 1, 3), h)  # [B, H, s_len, D]
    vr = _repeat_kv(v.transpose(0, 2, 1, 3), h)
    # Gathering each query row's own keys would cost [T, s_len, K, D]; contracting
    # against every sequence and selecting costs [T, B, H, s_len] logits instead,
    # which is the smaller of the two for the batches this reference is run on.
    # Selecting with `where`, not by multiplying by 0/1, keeps one sequence's
    # non-finite values out of every other sequence's rows.
    own = seq[:, None] == jnp.arange(b)[None, :]  # [T, B]
    s = jnp.einsum("thd,bhkd->tbhk", q.astype(jnp.float32), kr.astype(jnp.float32))
    s = jnp.sum(jnp.where(own[:, :, None, None], s, 0.0), axis=1)  # [T, H, s_len]
    s = _cap(s * _default_scale(scale, d), soft_cap)
    s = jnp.where(mask[:, None, :], s, _NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask[:, None, :], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thk,bhkd->tbhd", p, vr.astype(jnp.float32))
    o = jnp.sum(jnp.where(own[:, :, None, None], o, 0.0), axis=1)  # [T, H, D]
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.astype(q.dtype)
