"""A static batch of token id lists, each sequence given its own contiguous pages of one
cache: `generate`, static-batch generation with no scheduler (re-exported by
`pagedjax.decode`, whose steps it runs), and the checks and page layout it shares with
`scoring.score`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from pagedjax import decode, sharding
from pagedjax import model as model_lib
from pagedjax.config import CacheConfig, dtype_name
from pagedjax.lora import LoRAWeights
from pagedjax.step_checks import _check_params
from pagedjax.step_input import Buckets, SeqChunk, bucket_size, build_step_input, is_int

__all__ = [
    "GenerateOutput",
    "check_chunking",
    "check_lengths",
    "check_untraced",
    "generate",
    "lora_slots",
    "round_pages",
    "static_pages",
    "token_lists",
]


def check_untraced(fn: str, **trees) -> None:
    """TypeError naming the first of `trees` holding a JAX tracer: `fn` is a host loop
    of jitted steps, each read back, so it cannot run under `jax.jit`, `vmap` or `grad`
    (JAX refused only once a whole step had been traced, and not by name)."""
    for name, tree in trees.items():
        # (an iterator is a leaf, not walked: JAX warns, and that would consume it)
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Iterator))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            raise TypeError(
                f"{fn} runs on the host (a loop of jitted steps, each read back): call it "
                f"outside jax.jit, vmap or grad, got traced {name}"
            )


def lora_slots(lora, given, n: int) -> list[int]:
    """The `lora_slots` argument `given`, checked: one int per prompt (sequence) in [0,
    lora.num_slots]; None: all 0 (no adapter)."""
    if given is None:
        return [0] * n
    if lora is None:
        raise ValueError("lora_slots needs lora (the LoRAWeights the slots index)")
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise ValueError(f"lora_slots must be a list of slots, one per prompt, got {given!r:.80}")
    # A jax array's slots (or jax scalars) as numpy's: one transfer, ints that is_int takes.
    slots = list(np.asarray(given)) if isinstance(given, jax.Array) else list(given)
    slots = [np.asarray(x)[()] if isinstance(x, jax.Array) else x for x in slots]
    if len(slots) != n:
        raise ValueError(f"lora_slots must have one slot per prompt ({n}), got {len(slots)}")
    for i, x in enumerate(slots):
        if not is_int(x) or not 0 <= x <= lora.num_slots:
            raise ValueError(f"lora_slots[{i}] must be an int in [0, {lora.num_slots}], got {x!r}")
    return [int(x) for x in slots]


_lora_slots = lora_slots  # (for `generate`, whose `lora_slots` argument hides the name)


def token_lists(seqs, what: str) -> list[np.ndarray]:
    """A non-empty list of non-empty token id lists (a 2-D array's rows) as arrays."""
    bad = isinstance(seqs, (str, bytes)) or not isinstance(seqs, Iterable)
    if bad or getattr(seqs, "ndim", 1) == 0:  # (a 0-d array is Iterable but not iterable)
        raise ValueError(f"{what}s must be a list of token id lists, got {seqs!r}")
    if isinstance(seqs, jax.Array):  # one transfer, not a device slice per row
        seqs = np.asarray(seqs)
    seqs = list(seqs)
    for i, p in enumerate(seqs):
        try:
            seqs[i] = a = np.asarray(p)
        except ValueError:  # numpy's "inhomogeneous shape"
            raise ValueError(f"{what} {i} must be a 1-D list of token ids, got {p!r:.80}") from None
        if a.dtype == np.uint64:  # as int64 (numpy's float64 for uint64 and int64 rounds)
            if (a >= 2**63).any():
                raise ValueError(
                    f"{what} {i}: token id {a[a >= 2**63][0]} is outside the vocabulary"
                )
            seqs[i] = a.astype(np.int64)
        if a.ndim != 1 or isinstance(p, (np.ndarray, jax.Array)):
            continue
        # A list's ints as numpy reads them: [1, True] as ints (True as token 1), and
        # ints past int64 or a uint64 next to an int ([1, np.uint64(3)]) as floats.
        flag = next((x for x in p if isinstance(x, (bool, np.bool_))), None)
        if flag is not None and a.dtype != bool:  # (bools alone: refused by their dtype)
            raise TypeError(f"{what} {i}: token ids must be ints, got {flag!r}")
        if a.dtype.kind in "fO" and all(map(is_int, p)):
            big = [int(x) for x in p if not -(2**63) <= int(x) < 2**63]
            if big:
                raise ValueError(f"{what} {i}: token id {big[0]} is outside the vocabulary")
            seqs[i] = np.array([int(x) for x in p], np.int64)
    if not seqs or any(p.size == 0 for p in seqs):
        raise ValueError(f"{what}s must be a non-empty list of non-empty token id lists")
    return seqs


def check_lengths(seqs, cfg, what: str, extra: int = 0, why: str = "") -> None:
    """Each of `seqs` 1-D, and with `extra` more tokens within max_position_embeddings."""
    for i, p in enumerate(seqs):
        if p.ndim == 0 and not np.issubdtype(p.dtype, np.number):  # text, None, a generator
            raise ValueError(f"{what} {i} must be a list of token ids, got {p.item()!r:.80}")
        if p.ndim != 1:
            hint = f" (one {what}? pass a list of {what}s: [{what}])" if p.ndim == 0 else ""
            raise ValueError(
                f"{what} {i} must be a 1-D list of token ids, got shape {p.shape}{hint}"
            )
        if len(p) + extra > cfg.max_position_embeddings:
            raise ValueError(
                f"{what} {i} has {len(p)} tokens; {why}it exceeds "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )


def check_chunking(page_size, prefill_chunk) -> None:
    """`page_size` a positive int (`CacheConfig` then wants a power of two) and
    `prefill_chunk` None or a positive int."""
    if prefill_chunk is not None and (not is_int(prefill_chunk) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk=}")
    if not is_int(page_size) or page_size < 1:  # CacheConfig checks it is a power of two
        raise ValueError(f"page_size must be a positive int, got {page_size=}")


def round_pages(need: int) -> int:
    """`need` pages rounded up so that runs with similar batches share compiled programs:
    to a multiple of 16 pages, and past 256 of 1/16 of the next power of two (less than
    1/8 more than needed; the next power of two took up to twice what a large batch
    needs, 256 GB of Llama-3-8B's cache for 128 GB of sequences)."""
    step = max(16, bucket_size(need, 16) // 16)
    return -(-need // step) * step


def static_pages(cfg, n: int, max_len: int, page_size, kv_cache_dtype):
    """Cache config and n page tables: b's own pages for max_len tokens (0: a null page)."""
    if page_size > cfg.max_position_embeddings:  # slots no sequence can reach, 16 pages of them
        raise ValueError(
            f"page_size must be at most max_position_embeddings={cfg.max_position_embeddings} "
            f"(a sequence's longest context), got {page_size=}"
        )
    page_size = int(page_size)  # (in a narrow numpy int, -max_len // page_size overflowed)
    per_seq = -(-max_len // page_size)
    num_pages = round_pages(1 + n * per_seq)
    auto = kv_cache_dtype is None or (isinstance(kv_cache_dtype, str) and kv_cache_dtype == "auto")
    try:
        dtype = cfg.dtype if auto else dtype_name(kv_cache_dtype, kv=True)
    except (ValueError, TypeError):  # (numpy's TypeError for an int)
        raise ValueError(
            "kv_cache_dtype must be None or 'auto' (the model's dtype), 'fp8' (float8_e4m3fn "
            f"pages) or a dtype name, got {kv_cache_dtype=}"
        ) from None
    cache_cfg = CacheConfig(page_size, num_pages, dtype)
    return cache_cfg, [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(n)]


@dataclass
class GenerateOutput:
    """Per prompt: the new tokens, their logprobs, and (optionally) the logits they came from."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    logits: list[np.ndarray] | None = None  # each [num_new_tokens, V] float32


def generate(
    params: model_lib.Params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    page_size: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
    buckets: Buckets = Buckets(),
    return_logits: bool = False,
    kv_cache_dtype: str | None = None,
    lora: LoRAWeights | None = None,
    lora_slots: Sequence[int] | None = None,
) -> GenerateOutput:
    """Static-batch generation with no scheduler (research use).

    Sequence b gets its own contiguous range of pages for its prompt and
    max_new_tokens (page 0 is left unused as a null page; the cache rounds their count
    up by less than 1/8 so that similar batches share programs:
    `round_pages`). Each step carries, for every unfinished sequence,
    either its next prompt chunk or its last sampled token; steps where every sequence
    decodes use `decode_step`.

    Args:
      params: the split model; its config gives the vocabulary, limits and EOS ids.
      prompts: token id lists (non-empty; lists, numpy or jax arrays, or the rows of a
        2-D array).
      max_new_tokens: tokens to generate per prompt (fewer if a stop token comes).
      page_size: tokens per page (a power of two, at most max_position_embeddings).
      temperature, top_k, top_p, min_p: sampling (temperature 0: greedy).
      repetition_penalty, presence_penalty, frequency_penalty: penalties over each
        prompt and its generated tokens (see `pagedjax.sampling`; 1, 0, 0: off).
      logit_bias: token id -> value added to its logit before sampling (-inf bans it).
      min_tokens: the stop tokens cannot be drawn before this many new tokens.
      seed: prompt b samples with seed + b (each a uint32).
      stop_token_ids: default: the config's eos_token_ids. The stop token is kept; ids
        past the vocabulary are allowed (never drawn, so never banned by min_tokens).
      prefill_chunk: prefill prompts at most this many tokens per step (default: all).
      backend, interpret: attention backend (see `prefill_step`).
      buckets: padding floors for the step shapes.
      return_logits: also return the logits of every generated token.
      kv_cache_dtype: the cache's storage dtype (None or "auto": the model's; "fp8": see
        `pagedjax.cache`).
      lora, lora_slots: LoRA adapters on the device (`pagedjax.lora.LoRAWeights`) and
        each prompt's slot among them (0: none; default all 0).

    Raises:
      TypeError: `params` is not a `Params`; params, lora, prompts or lora_slots traced
        (generate is a host loop: not under `jax.jit`); token ids that are not ints; a
        logit_bias that is not a mapping of token ids to numbers; `buckets` not a
        `Buckets`; a kv_cache_dtype the model's attention cannot read (a float16 cache
        for a float32 model; refused on the host once the cache is allocated, before any
        step runs).
      ValueError: empty or nested prompts, token ids outside the vocabulary, a prompt
        plus max_new_tokens longer than max_position_embeddings, stop_token_ids that
        are not a flat list of ints >= 0, a count (max_new_tokens, min_tokens, page_size,
        prefill_chunk) that is not a positive int (min_tokens: >= 0), a page_size that
        is not a power of two or is past max_position_embeddings, an unknown
        kv_cache_dtype, a seed + b past uint32, sampling values that are bad or not
        numbers, or lora_slots without lora, not one per prompt or outside [0,
        lora.num_slots] (before anything runs).
    """
    _check_params(params)
    check_untraced("generate", params=params, lora=lora, prompts=prompts, lora_slots=lora_slots)
    cfg = params.config
    prompts = token_lists(prompts, "prompt")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens=}")
    if not is_int(min_tokens) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens=}")
    check_chunking(page_size, prefill_chunk)
    n = len(prompts)
    if not is_int(seed) or not 0 <= seed <= 2**32 - n:  # prompt b's seed: seed + b
        raise ValueError(
            f"seed must be an int in [0, 2**32 - {n}] (prompt b samples with seed + b, and "
            f"seeds are uint32), got {seed=}"
        )
    # As Python ints: sums in a narrow numpy int's own type (seed + b, a prompt's length +
    # max_new_tokens) wrapped, np.uint8(250) + 6 to seed 0.
    max_new_tokens, min_tokens, seed, page_size = map(
        int, (max_new_tokens, min_tokens, seed, page_size)
    )
    prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
    if logit_bias is not None and not isinstance(logit_bias, Mapping):
        raise TypeError(
            f"logit_bias must be a mapping of token id -> value, got {logit_bias!r:.80}"
        )
    check_lengths(prompts, cfg, "prompt", max_new_tokens, f"with max_new_tokens={max_new_tokens} ")
    ids = cfg.eos_token_ids if stop_token_ids is None else stop_token_ids
    stop = np.asarray(list(ids) if isinstance(ids, Iterable) and not isinstance(ids, str) else ids)
    if stop.ndim != 1 or (
        stop.size and (not np.issubdtype(stop.dtype, np.integer) or stop.min() < 0)
    ):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {stop_token_ids=}")
    stop = set(stop.tolist())
    slots = _lora_slots(lora, lora_slots, len(prompts))
    bias = dict(logit_bias or {})
    # Before min_tokens new tokens; a stop id outside the vocabulary is never drawn.
    banned = bias | dict.fromkeys((t for t in stop if t < cfg.vocab_size), float("-inf"))

    def bias_at(n_new: int) -> dict | None:
        return (banned if n_new < min_tokens else bias) or None

    max_len = max(len(p) for p in prompts) + max_new_tokens
    cache_cfg, pages = static_pages(cfg, len(prompts), max_len, page_size, kv_cache_dtype)
    chunk_len = prefill_chunk or max(len(p) for p in prompts)

    # Validate every prompt before allocating the cache or compiling anything.
    penalties = dict(
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    build_step_input(
        [
            SeqChunk(
                p,
                0,
                pages[i],
                temperature,
                top_k,
                top_p,
                seed + i,
                min_p=min_p,
                logit_bias=bias_at(0),
                lora_slot=slots[i],
                **penalties,
            )
            for i, p in enumerate(prompts)
        ],
        cfg,
        cache_cfg,
        buckets=buckets,
    )
    # Split over kv heads with a mesh, else committed where the steps' outputs lie.
    device = sharding.home_device(params)
    cache = sharding.create_cache(cfg, cache_cfg, params.mesh, device=device)
    cached = [0] * len(prompts)
    out = GenerateOutput([[] for _ in prompts], [[] for _ in prompts], None)
    logits = [[] for _ in prompts]
    done = [False] * len(prompts)
    while not all(done):
        active = [b for b in range(len(prompts)) if not done[b]]
        chunks = []
        for b in active:
            p, pos = prompts[b], cached[b]
            toks = p[pos : pos + chunk_len] if pos < len(p) else out.tokens[b][-1:]
            chunks.append(
                SeqChunk(
                    toks,
                    pos,
                    pages[b],
                    temperature,
                    top_k,
                    top_p,
                    seed + b,
                    len(out.tokens[b]),
                    min_p,
                    **penalties,
                    prompt_ids=p,
                    output_ids=out.tokens[b],
                    logit_bias=bias_at(len(out.tokens[b])),
                    lora_slot=slots[b],
                )
            )
        inp = build_step_input(chunks, cfg, cache_cfg, buckets=buckets)
        res, cache = decode.step(
            params,
            cache,
            inp,
            backend=backend,
            interpret=interpret,
            return_logits=return_logits,
            lora=lora,
        )
        tokens, lps = np.asarray(res.tokens), np.asarray(res.logprobs)
        for j, b in enumerate(active):
            cached[b] += len(chunks[j].token_ids)
            if cached[b] < len(prompts[b]):
                continue  # mid-prompt chunk: its sample is meaningless
            out.tokens[b].append(int(tokens[j]))
            out.logprobs[b].append(float(lps[j]))
            if return_logits:
                logits[b].append(np.asarray(res.logits[j]))
            done[b] = len(out.tokens[b]) >= max_new_tokens or int(tokens[j]) in stop
    if return_logits:
        out.logits = [np.stack(x) for x in logits]
    return out
