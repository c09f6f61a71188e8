"""`LLM`'s constructor arguments, checked before the model loads (`check_engine_args`)
and against its config once it has (`model_limits`): a bad value is named before a
checkpoint is read (minutes and host memory for a large one), not after. Moved here from
`LLM.__init__` (`pagedjax.engine`), which calls both; the model loading and KV sizing
between them are `pagedjax.resources`'.
"""

from __future__ import annotations

import numbers
from dataclasses import replace

import numpy as np
from jax.sharding import Mesh

from pagedjax import decode, sharding
from pagedjax.blocks import BlockManager
from pagedjax.config import CacheConfig, ModelConfig, dtype_name, dtype_size
from pagedjax.request import MAX_LOGPROBS
from pagedjax.resources import (
    check_backend,
    checkpoint_dir,
    generation_config_defaults,
    source_config,
)
from pagedjax.scheduler import Scheduler
from pagedjax.step_input import is_int
from pagedjax.tokenizer import Tokenizer

__all__ = ["check_engine_args", "model_limits"]


def check_engine_args(
    source,
    *,
    page_size,
    num_pages,
    kv_memory_fraction,
    max_num_seqs,
    max_num_batched_tokens,
    enable_prefix_caching,
    backend,
    seed,
    max_model_len,
    watermark,
    buckets,
    interpret,
    tokenizer,
    tensor_parallel,
    async_scheduling,
    kv_cache_dtype,
    generation_config,
    scheduling_policy="fcfs",
    max_logprobs=MAX_LOGPROBS,
    dtype=None,
) -> tuple[str, dict, Mesh | None]:
    """Checks `LLM(source, ...)`'s arguments (as `LLM` documents them) with no weights
    loaded: the cache geometry and the scheduler's limits and policy by building them
    small, the generation config file, and (from the source's config alone, in `dtype`
    where given) that the model splits `tensor_parallel` ways over that many devices,
    that a `max_model_len` given is within its positions and that its dtype takes the
    KV cache's (`model_limits`).

    Returns:
      (kv_cache_dtype: "auto" or a KV dtype's canonical name, sampling_defaults: the
      checkpoint's generation_config.json defaults ({} for none or "none"), mesh: the
      tensor-parallel mesh, None for 1).

    Raises:
      ValueError, TypeError: naming the bad argument and value.
    """
    # A flag read as truthy ("no") ran the wrong mode.
    for name, flag in (("interpret", interpret), ("async_scheduling", async_scheduling)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"{name} must be a bool, got {name}={flag!r}")
    if not is_int(seed) or not 0 <= seed < 2**63:  # flax's Rngs takes an int64
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed=}")
    if not is_int(max_logprobs) or max_logprobs < -1:
        raise ValueError(
            f"max_logprobs must be an int >= 0 or -1 (no cap: the whole vocabulary), got "
            f"{max_logprobs=}"
        )
    if buckets is not None and not isinstance(buckets, decode.Buckets):
        raise TypeError(f"buckets must be a decode.Buckets or None, got {buckets=}")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer must be a pagedjax.tokenizer.Tokenizer or None, got {tokenizer!r}"
        )
    if generation_config not in ("auto", "none"):
        raise ValueError(f"generation_config must be 'auto' or 'none', got {generation_config=}")
    check_backend(backend, bool(interpret))
    if num_pages is not None and kv_memory_fraction is not None:
        raise ValueError(
            f"give num_pages or kv_memory_fraction, not both ({num_pages=}, {kv_memory_fraction=})"
        )
    if kv_memory_fraction is not None and (
        isinstance(kv_memory_fraction, (bool, np.bool_))
        or not isinstance(kv_memory_fraction, numbers.Real)  # np.float32 too
        or not 0 < kv_memory_fraction <= 1
    ):
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction=}")
    kv_cache_dtype = _kv_cache_dtype(kv_cache_dtype)
    # The cache geometry and the scheduler's limits (the real ones need the model's config).
    pages = 1 if num_pages is None else num_pages
    CacheConfig(page_size, pages)
    bm = BlockManager(
        pages,
        page_size,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=max_model_len,
        watermark=watermark,
    )
    Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduling_policy=scheduling_policy,
    )
    if dtype is not None:
        dtype = dtype_name(dtype)  # (a ValueError naming it, before any weight loads)
    gen_dir = checkpoint_dir(source) if generation_config == "auto" else None
    sampling_defaults = {} if gen_dir is None else generation_config_defaults(gen_dir)
    if (cfg := source_config(source)) is not None:
        model_limits(
            cfg if dtype is None else replace(cfg, dtype=dtype), max_model_len, kv_cache_dtype
        )
    mesh = None  # an int, that many devices, and that the model splits that many ways
    if not is_int(tensor_parallel) or tensor_parallel != 1:  # (1.0 was taken as 1)
        mesh = sharding.make_mesh(tensor_parallel, cfg)
    return kv_cache_dtype, sampling_defaults, mesh


def model_limits(
    cfg: ModelConfig, max_model_len: int | None, kv_cache_dtype: str
) -> tuple[int, str]:
    """(max_model_len, KV dtype) of an engine of the loaded model `cfg`: `max_model_len`
    (an int `check_engine_args` checked) within the model's positions (None: all of
    them), and the cache's dtype ("auto": the model's).

    Raises:
      ValueError: `max_model_len` outside [2, max_position_embeddings], an FP8 cache
        for a float16 model, or a cache of another unquantised dtype than the model's
        (the steps read only the model's dtype or FP8 pages, `step_checks.check_cache`).
    """
    limit = cfg.max_position_embeddings
    if max_model_len is not None:
        _check_max_model_len(max_model_len, limit)
    kv_dtype = cfg.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if dtype_size(kv_dtype) == 1:  # FP8: the kernels upcast its tiles to q's dtype
        if cfg.dtype == "float16":
            raise ValueError(
                f"an fp8 KV cache needs a bfloat16 or float32 model, got {cfg.dtype} "
                "(LLM(dtype='bfloat16') loads it as bfloat16)"
            )
    elif kv_dtype != cfg.dtype:
        raise ValueError(
            f"kv_cache_dtype={kv_dtype!r} for a {cfg.dtype} model: the cache holds the "
            "model's dtype ('auto') or fp8 (LLM(dtype=...) changes the model's)"
        )
    return (limit if max_model_len is None else int(max_model_len)), kv_dtype


def _kv_cache_dtype(value) -> str:
    """`kv_cache_dtype` as "auto" or a KV dtype's canonical name (`CacheConfig`'s).

    vLLM's "fp8" and "fp8_e4m3" are float8_e4m3fn; its "fp8_e5m2", "fp8_inc" and the
    scaled formats have no pages here, and the message names the argument (`LLM` also
    takes `dtype`, the model's).
    """
    if isinstance(value, str) and value == "auto":
        return value
    try:
        return dtype_name(value, kv=True)
    except (ValueError, TypeError):  # (numpy's TypeError for an int)
        raise ValueError(
            "kv_cache_dtype must be 'auto', 'fp8' ('fp8_e4m3': float8_e4m3fn pages) or the "
            f"model's dtype by name, got {value!r}"
        ) from None


def _check_max_model_len(max_model_len: int, limit: int) -> None:
    """ValueError unless 2 <= `max_model_len` <= `limit` (the model's positions): a longer
    sequence would run past the positions the model was trained on."""
    if not 1 < max_model_len <= limit:
        raise ValueError(f"max_model_len must be an int in [2, {limit}], got {max_model_len=}")
