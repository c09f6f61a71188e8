"""Backend choice for the paged attention entry points.

`backend` is one of:

* `"gpu"`: the Pallas GPU kernel (runs on CUDA, or anywhere with `interpret=True`);
* `"tpu"`: the Pallas TPU kernel (runs on TPU, or anywhere with `interpret=True`);
* `"xla"`: the plain-jnp reference in `pallas_kernels.reference`;
* `"auto"`: the GPU kernel on CUDA, the TPU kernel on TPU, XLA elsewhere; on
  CUDA also XLA for a page pool of more than 2**31 elements, which the GPU kernels'
  int32 offsets cannot address, or a head dim over `validation.GPU_MAX_HEAD_DIM`
  (256), whose tiles overflow their shared memory (`"gpu"` refuses both with a
  ValueError). Any head dim up to it runs on the GPU kernels: one that is not a power
  of two of at least 16 (80, 96) is padded inside them (`validation.gpu_tile_dim`).

Both entry points validate shapes, dtypes and (when concrete) values on the host
before tracing, then call the chosen implementation.

Page pools may be FP8 (`validation.FP8_DTYPES`: `float8_e4m3fn`, `float8_e5m2`,
unscaled) with a bfloat16 or float32 q; every backend upcasts K/V tiles to q's
dtype and returns q's dtype. On CUDA the GPU kernels need sm89+ for e4m3fn; on
TPU, "auto" runs the TPU kernels, which convert fp8 blocks in VMEM (lowered and
interpreted on the CPU, not yet compiled on a TPU: see their module docstrings;
`backend="xla"` is the fallback).

The implementations share one signature, so a second GPU lowering can slot in
behind the same name.
"""

from __future__ import annotations

import jax

from pallas_kernels import reference, validation

BACKENDS = ("auto", "gpu", "tpu", "xla")


def resolve_backend(backend: str = "auto", platform: str | None = None) -> str:
    """Maps `backend` to a concrete one of "gpu", "tpu", "xla".

    Args:
      backend: one of BACKENDS.
      platform: the JAX platform to decide "auto" for (default: the default backend).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend=}")
    if backend != "auto":
        return backend
    platform = platform or jax.default_backend()
    return {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}.get(platform, "xla")


def _kernel_backend(backend: str, pool_shape) -> str:
    """`resolve_backend`, with "auto" on CUDA falling back to XLA for a pool too large for
    the GPU kernels' int32 offsets or a head dim (the pool's last axis) too wide for their
    tiles (an explicit "gpu" raises there instead)."""
    concrete = resolve_backend(backend)
    ok = validation.gpu_pool_ok(pool_shape) and validation.gpu_head_dim_ok(pool_shape[-1])
    if backend == "auto" and concrete == "gpu" and not ok:
        return "xla"
    return concrete


def _no_xla_knobs(backend: str, tuning: dict, pool_shape) -> None:
    """TypeError when knobs reach the XLA path, saying why "auto" chose it."""
    if not tuning:
        return
    why = ""
    if backend == "auto":
        platform = jax.default_backend()
        if resolve_backend("auto", platform) != "gpu":
            reason = f"on platform {platform!r}"
        elif not validation.gpu_head_dim_ok(head_dim := pool_shape[-1]):
            reason = f"for {head_dim=}, wider than the GPU kernels' tiles take"
        else:
            reason = f"for k_pages {list(pool_shape)}, too large for the GPU kernels' offsets"
        why = f" (backend='auto' chose it {reason}; pass knobs with an explicit backend)"
    raise TypeError(f"the xla backend takes no tuning knobs, got {sorted(tuning)}{why}")


def _decode_impl(backend):
    if backend == "gpu":
        from pallas_kernels.paged_decode.gpu import paged_decode_gpu

        return paged_decode_gpu
    if backend == "tpu":
        from pallas_kernels.paged_decode.tpu import paged_decode_tpu

        return paged_decode_tpu
    return None


def _ragged_impl(backend):
    if backend == "gpu":
        from pallas_kernels.ragged.gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu
    if backend == "tpu":
        from pallas_kernels.ragged.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu
    return None


def paged_decode_attention(
    q,
    k_pages,
    v_pages,
    lengths,
    page_table,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
    **tuning,
):
    """Decode attention: one query token per sequence over its paged K/V.

    `scale`, `soft_cap` and `sliding_window` are compile-time constants: Python,
    numpy or concrete jax numbers (not bools, not traced values).

    Args:
      q: [B, H, D] the query of each sequence's newest token (position lengths[b] - 1),
        floating, 16 bits or wider. Every array argument is a jax or numpy array.
      k_pages: [K, P, S, D] one layer's key pages, in q's dtype or fp8
        (`validation.FP8_DTYPES`, then q must be bfloat16 or float32).
      v_pages: [K, P, S, D] one layer's value pages, same dtype as k_pages.
      lengths: [B] int32 tokens in the cache per sequence, this token included
        (0 gives a zero row).
      page_table: [B, max_pages] int32 physical page ids in logical order. Entries no
        query reads (past a sequence's last page, wholly before its sliding window) are
        padding and may hold any id, -1 included; the ids read must be in [0, P).
      scale: logit scale, default D ** -0.5; positive and finite.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap); positive
        and finite. The kernels fold log2(e) into scale and soft_cap and take
        scale / soft_cap as one float32 constant, so each must stay below float32's
        maximum (scale and soft_cap at most about 2.36e38).
      sliding_window: if set, each query sees only its last `sliding_window` keys; an
        int in [1, 2**31).
      backend: "auto" | "gpu" | "tpu" | "xla" (see the module docstring).
      interpret: run a Pallas kernel in interpret mode (CPU testing).
      **tuning: the chosen kernel's knobs (block sizes, split count...), Python, numpy or
        concrete jax ints; defaults are chosen per shape. A knob the kernel does not
        take is a TypeError, as is any knob on the XLA path (also when "auto" picks it).

    Returns:
      [B, H, D] in q's dtype.

    Raises:
      TypeError, ValueError: on the host, naming the bad input (see `validation`).
    """
    validation.check_decode(
        q, k_pages, v_pages, lengths, page_table, scale, soft_cap, sliding_window
    )
    impl = _decode_impl(_kernel_backend(backend, k_pages.shape))
    if impl is None:
        _no_xla_knobs(backend, tuning, k_pages.shape)
        return reference.paged_attention_xla(
            q,
            k_pages,
            v_pages,
            lengths,
            page_table,
            scale=scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
        )
    return impl(
        q,
        k_pages,
        v_pages,
        lengths,
        page_table,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        interpret=interpret,
        **tuning,
    )


def ragged_paged_attention(
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
    backend: str = "auto",
    interpret: bool = False,
    **tuning,
):
    """Ragged paged attention: prefill chunks and decode rows in one batch.

    Sequence `b` owns query rows `query_start_loc[b]:query_start_loc[b + 1]` and has
    `context_lens[b]` tokens in the cache including this step's (their K/V are
    written before the call). Its query `i` attends causally to cache positions
    `<= context_lens[b] - q_len + i`. Rows past `query_start_loc[B]` are padding
    (for bucketed shapes) and return zeros.

    Args:
      q: [T, H, D] all sequences' query tokens back to back.
      k_pages: [K, P, S, D] in q's dtype or fp8 (then q is bfloat16 or float32).
      v_pages: [K, P, S, D] same dtype as k_pages.
      page_table: [B, max_pages] int32; padding as for `paged_decode_attention` (the
        window starts at each sequence's first query).
      context_lens: [B] int32.
      query_start_loc: [B + 1] int32, non-decreasing, from 0 to at most T.
      scale, soft_cap, sliding_window, backend, interpret, **tuning: as for
        `paged_decode_attention`.

    Returns:
      [T, H, D] in q's dtype.
    """
    validation.check_ragged(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        scale,
        soft_cap,
        sliding_window,
    )
    impl = _ragged_impl(_kernel_backend(backend, k_pages.shape))
    if impl is None:
        _no_xla_knobs(backend, tuning, k_pages.shape)
        return reference.ragged_paged_attention_xla(
            q,
            k_pages,
            v_pages,
            page_table,
            context_lens,
            query_start_loc,
            scale=scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
        )
    return impl(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        interpret=interpret,
        **tuning,
    )
