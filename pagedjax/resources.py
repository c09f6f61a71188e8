"""What an engine runs on: the model and tokenizer, the attention backend, the KV pages.

* `load_model(source)`: the embedded demo model (None; the `tiny` preset with random
  weights and a warning until the demo model is there), a checkpoint directory (HF or
  orbax), a `ModelConfig` (random weights) or ready `model.Params`.
* `byte_tokenizer()`: id = UTF-8 byte, for random-weight models with >= 256 ids.
* `checkpoint_dir(source)` and `generation_config_defaults(directory)`: the sampling
  defaults a checkpoint's generation_config.json recommends, as vLLM reads them.
* `check_backend`: "gpu"/"tpu" asked for on a machine without one is a ValueError.
* `plan_num_pages`: pages from a fraction of the device's free memory, once one step's
  working memory (`step_reserve_bytes`) is set aside, with the planner's bytes per
  token; `peak_device_memory` for reports.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from pathlib import Path

import jax
import tokenizers

from pagedjax import demo, planner, sharding, weights
from pagedjax import model as model_lib
from pagedjax.config import ModelConfig, preset
from pagedjax.jsonfile import read_json_object
from pagedjax.request import SamplingParams
from pagedjax.step_input import Buckets, bucket_size
from pagedjax.tokenizer import TOKENIZER_FILE, Tokenizer
from pallas_kernels.dispatch import BACKENDS, resolve_backend
from pallas_kernels.validation import GPU_MAX_POOL_ELEMENTS

__all__ = [
    "BACKENDS",
    "GENERATION_CONFIG_KEYS",
    "byte_tokenizer",
    "check_backend",
    "checkpoint_dir",
    "generation_config_defaults",
    "load_model",
    "peak_device_memory",
    "plan_num_pages",
    "step_reserve_bytes",
]

_CPU_KV_BUDGET = 4 * 1024**3  # bytes kv_memory_fraction applies to with no device stats
GENERATION_CONFIG_FILE = "generation_config.json"
# The generation_config.json keys vLLM reads (`ModelConfig.get_diff_sampling_param`), and
# the SamplingParams field each sets.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def byte_tokenizer(bos_token_id: int = 1, eos_token_id: int = 2) -> Tokenizer:
    """A byte-level tokenizer (id = UTF-8 byte value) for random-weight models (vocab >= 256).

    It has no merges and no special tokens of its own: `bos_token_id`/`eos_token_id`
    are plain byte ids (the `tiny` preset's 1 and 2).
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {char[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(tok, bos_token_id=bos_token_id, eos_token_ids=[eos_token_id])


def checkpoint_dir(source) -> Path | None:
    """The directory `load_model(source)` reads: a checkpoint path as given, the demo
    model's for None (None when it is missing: the random fallback), None for a
    `ModelConfig` or `Params`."""
    if source is None:
        try:
            return demo.demo_model_dir()
        except FileNotFoundError:
            return None
    return Path(source) if isinstance(source, (str, Path)) else None


def source_config(source) -> ModelConfig | None:
    """The `ModelConfig` `load_model(source)` loads, read without the weights (None for
    a source it refuses): what `LLM` checks its arguments against before loading."""
    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, model_lib.Params):
        return source.config
    path = checkpoint_dir(source) if source is None or isinstance(source, (str, Path)) else None
    if path is None:
        return preset("tiny") if source is None else None
    return weights.read_checkpoint_config(path)


def generation_config_defaults(directory) -> dict:
    """`SamplingParams` defaults from `directory`'s generation_config.json, as vLLM's
    `--generation-config auto` takes them.

    The keys of `GENERATION_CONFIG_KEYS`: temperature, top_k (-1, vLLM's and HF's "off",
    is 0), top_p, min_p, repetition_penalty, and max_new_tokens as `max_tokens` (vLLM's
    default for a request's length). `do_sample` is ignored, as vLLM ignores it: a file
    with do_sample false and a temperature samples at that temperature. A missing file,
    or a key missing or null, gives no default (so the demo model's, with do_sample false
    and no sampling keys, gives none).

    Raises:
      ValueError: naming the file, key and value, for a value `SamplingParams` refuses
        (or a file that is not a JSON object).
    """
    path = Path(directory) / GENERATION_CONFIG_FILE
    cfg = read_json_object(path, missing_ok=True)
    out = {}
    for key, field in GENERATION_CONFIG_KEYS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if key == "top_k" and value == -1 and type(value) is int:
            value = 0
        try:
            SamplingParams(**{field: value})
        except ValueError as e:
            raise ValueError(f"{path}: {key}={value!r} is not a valid {field}: {e}") from None
        out[field] = value
    return out


def load_model(source, *, dtype=None, seed: int = 0):
    """(config, params, tokenizer or None, description) for `LLM`'s first argument.

    `dtype` (None: the source's) is the parameters' dtype: a checkpoint loads in it, a
    ModelConfig's random weights are drawn in it, given `Params` are cast to it.

    Raises:
      FileNotFoundError, weights.CheckpointError: a bad checkpoint directory.
      ValueError: a checkpoint's tokenizer files do not load (`Tokenizer.from_dir`,
        read before the weights).
      TypeError: any other kind of source.
    """
    if source is None:
        try:
            path = demo.demo_model_dir()
        except FileNotFoundError as e:
            tiny = preset("tiny")
            cfg = tiny if dtype is None else dataclasses.replace(tiny, dtype=dtype)
            msg = f"tiny preset with random weights (no demo model in {demo.DEMO_MODEL_DIR})"
            warnings.warn(f"pagedjax: using the {msg}: {e}", stacklevel=3)
            return cfg, model_lib.init_params(cfg, seed), byte_tokenizer(), msg
        tok = Tokenizer.from_dir(path)
        return *weights.load_checkpoint(path, dtype=dtype), tok, f"demo model {path}"
    if isinstance(source, (str, Path)):
        # The tokenizer first: a broken one fails before the weights take minutes to load.
        tok = Tokenizer.from_dir(source) if (Path(source) / TOKENIZER_FILE).is_file() else None
        return *weights.load_checkpoint(source, dtype=dtype), tok, f"checkpoint {source}"
    if isinstance(source, ModelConfig):
        cfg = source if dtype is None else dataclasses.replace(source, dtype=dtype)
        tok = byte_tokenizer() if cfg.vocab_size >= 256 else None
        return cfg, model_lib.init_params(cfg, seed), tok, "random weights (a ModelConfig)"
    if isinstance(source, model_lib.Params):
        cfg = source.config if dtype is None else dataclasses.replace(source.config, dtype=dtype)
        tok = byte_tokenizer() if cfg.vocab_size >= 256 else None
        if cfg.dtype == source.config.dtype:
            return cfg, source, tok, "given params"
        if source.mesh is not None:
            raise ValueError(
                f"dtype={dtype!r} differs from the given params' {source.config.dtype}, which "
                "are sharded over a mesh; cast them before sharding"
            )
        params = model_lib.params_from_flat(cfg, model_lib.params_to_flat(source))
        return cfg, params, tok, f"given params cast to {cfg.dtype}"
    raise TypeError(
        "LLM's first argument must be None (demo model), a checkpoint path, a ModelConfig "
        f"or model Params, got {type(source).__name__}"
    )


def check_backend(backend: str, interpret: bool = False) -> str:
    """Validates `backend` against the JAX default device; returns it unchanged."""
    resolve_backend(backend)  # a name in BACKENDS, else a ValueError naming it
    platform = jax.default_backend()
    wants = {"gpu": ("gpu", "cuda", "rocm"), "tpu": ("tpu",)}.get(backend)
    if wants and platform not in wants and not interpret:
        raise ValueError(
            f"backend={backend!r} needs a {backend.upper()}, but JAX's default device is "
            f"{platform!r}; use backend='auto' or 'xla'"
        )
    return backend


def step_reserve_bytes(
    cfg: ModelConfig,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    buckets: Buckets | None = None,
    lora_columns: int = 0,
    logprob_columns: int = 0,
) -> int:
    """Bytes one device keeps free for the working memory of the engine's largest step.

    `planner.step_peak_bytes` at the sizes that step is padded to (`buckets`, default
    `Buckets()`): `max_num_batched_tokens` tokens, and min(`max_num_seqs`, tokens)
    sampled rows. `cfg`: the model (one device's share of the kv heads under tensor
    parallelism, as `plan_num_pages` gets it). `lora_columns`: the LoRA slots'
    `max_loras * max_lora_rank` (0: LoRA off), whose per-token updates a step holds too.
    `logprob_columns`: the most top-k logprob columns a step returns
    (`planner.logprob_columns(max_logprobs, vocab_size)`; 0: not counted).
    """
    buckets = buckets or Buckets()
    rows = bucket_size(min(max_num_seqs, max_num_batched_tokens), buckets.min_seqs)
    tokens = max(bucket_size(max_num_batched_tokens, buckets.min_tokens), rows)  # decode: T = B
    return planner.step_peak_bytes(
        cfg, tokens, rows, lora_columns=lora_columns, logprob_columns=logprob_columns
    )


def plan_num_pages(
    cfg: ModelConfig,
    page_size: int,
    *,
    kv_memory_fraction: float,
    max_num_seqs: int,
    max_model_len: int,
    device=None,
    kv_dtype: str | None = None,
    watermark: float = planner.WATERMARK,
    max_num_batched_tokens: int | None = None,
    buckets: Buckets | None = None,
    lora_columns: int = 0,
    logprob_columns: int = 0,
) -> int:
    """Pages that fit in `kv_memory_fraction` of the device's free memory, once one step's
    working memory is set aside.

    Free memory is `bytes_limit - bytes_in_use` from the device's `memory_stats()`
    (call it after the weights are loaded); less `step_reserve_bytes` (the activations,
    float32 logits and sampling temporaries of a step of `max_num_batched_tokens`
    tokens and `max_num_seqs` rows, padded by `buckets`), which the first full step
    would otherwise find taken by the cache (with LoRA slots of `lora_columns` =
    `max_loras * max_lora_rank` columns, their per-token updates too; the slots' weights
    must be on the device already, counted in use; with `logprob_columns`, the top-k
    logprobs a step returns, `step_reserve_bytes`); the fraction applies to the rest, and its
    complement is slack for what the estimate leaves out. Where there are no stats (the
    CPU), the fraction applies to a 4 GiB budget, capped at what `max_num_seqs`
    sequences of `max_model_len` tokens can use on top of the `watermark`
    (`LLM(watermark=)`) of pages admission keeps free (under a sliding window, given
    `max_num_batched_tokens`, the `planner.window_pages` a sequence holds at most, and
    one more a beam's decode reserves); nothing is reserved there.
    `kv_dtype`: the cache's storage dtype (default the model's).
    `max_num_batched_tokens`: the engine's step budget, which bounds what a
    sliding-window sequence holds and sizes the reserve (None: counted as 1, the least
    it can be). A layer's pool (`[K, pages, page_size, D]`, this device's K) stays within
    2**31 elements, which the GPU kernels' int32 offsets address (a small-K model's fp8
    cache on a large GPU could pass it). `device`: the one whose memory the cache takes
    (default `sharding.default_device()`, where a cache without a mesh goes; with a
    mesh, one of its devices).

    Raises:
      ValueError: a bad fraction, watermark or size (named), no page fits (the reserve
        larger than the free memory included), or the pages beside the watermark hold
        less than one sequence of `max_model_len` tokens (`planner.peak_pages`; as vLLM
        refuses such a cache at start, not each request of the default length once it
        has started). The message names the bytes free, the reserve and the sizes.
    """
    f, w = kv_memory_fraction, watermark
    if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 < f <= 1:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction=}")
    if isinstance(w, bool) or not isinstance(w, numbers.Real) or not 0 <= w < 1:
        raise ValueError(f"watermark must be in [0, 1), got {watermark=}")
    budget = 1 if max_num_batched_tokens is None else max_num_batched_tokens
    for name, value in (
        ("page_size", page_size),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", budget),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    per_token = planner.kv_bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype or cfg.dtype
    )
    per_page = per_token * page_size
    device = device or sharding.default_device()
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends do not implement it
        stats = {}
    if "bytes_limit" in stats:
        limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        free = limit - in_use
        reserve = step_reserve_bytes(
            cfg,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            buckets=buckets,
            lora_columns=lora_columns,
            logprob_columns=logprob_columns,
        )
        # (float(): an np.float32 fraction times a large int is exact this way)
        pages = int(float(kv_memory_fraction) * (free - reserve)) // per_page
        where = (
            f"the {free} bytes free on {device} ({in_use} of {limit} in use after the "
            f"weights), less {reserve} for one step's working memory "
            f"(max_num_batched_tokens={budget}, {max_num_seqs=}: "
            "resources.step_reserve_bytes)"
        )
        lower = "max_num_batched_tokens or max_num_seqs"
    else:
        held = -(-max_model_len // page_size)
        if cfg.sliding_window is not None and max_num_batched_tokens is not None:
            # The scheduler's bound (which the step budget sizes), and a beam's decode page.
            held = min(held, planner.window_pages(cfg.sliding_window, page_size, budget) + 1)
        pages = min(
            _pages_beside_watermark(max_num_seqs * held, watermark),
            int(float(kv_memory_fraction) * _CPU_KV_BUDGET) // per_page,
        )
        where = f"the {_CPU_KV_BUDGET} bytes a device without memory stats budgets"
        lower = None
    pages = min(pages, (2**31 - 1) // page_size - 1)
    # (each layer's pool within the GPU kernels' int32 element offsets)
    pages = min(pages, GPU_MAX_POOL_ELEMENTS // (cfg.num_kv_heads * page_size * cfg.head_dim))
    if pages < 1:
        hint = f"; lower {lower}, or raise kv_memory_fraction" if lower else ""
        raise ValueError(
            f"kv_memory_fraction={kv_memory_fraction} of {where} holds no page of "
            f"{per_page} bytes{hint}"
        )
    need = planner.peak_pages(
        max_model_len,
        page_size,
        sliding_window=cfg.sliding_window,
        max_num_batched_tokens=budget,
    )
    kept = int(watermark * pages)  # as BlockManager.watermark_pages
    if pages - kept < need:
        raise ValueError(
            f"max_model_len={max_model_len} needs {need} KV pages ({need * per_page} bytes) "
            f"beside the {kept} the watermark keeps free, but kv_memory_fraction="
            f"{kv_memory_fraction} of {where} holds {pages - kept} pages "
            f"({(pages - kept) * page_size} tokens); lower max_model_len"
            f"{', ' + lower if lower else ''}, or raise kv_memory_fraction"
        )
    return pages


def _pages_beside_watermark(need: int, watermark: float) -> int:
    """Fewest pages N that leave `need` once `BlockManager` keeps int(watermark * N) free
    (`watermark` in [0, 1))."""
    n = math.ceil(need / (1 - watermark))
    while n - int(watermark * n) < need:  # float rounding
        n += 1
    while n > need and n - 1 - int(watermark * (n - 1)) >= need:
        n -= 1
    return n


def peak_device_memory(device=None) -> int | None:
    """Peak bytes in use on `device` (default `sharding.default_device()`, where the model
    and a cache without a mesh go, as `plan_num_pages` reads), None where the backend has
    no memory stats."""
    try:
        stats = (device or sharding.default_device()).memory_stats() or {}
    except Exception:
        return None
    return stats.get("peak_bytes_in_use")
