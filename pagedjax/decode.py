"""The functional decode core: `(params, cache, StepInput) -> (StepOutput, cache)`, jitted.

One engine step is one call of `prefill_step` (any mix of prefill chunks and decode
rows; ragged attention) or `decode_step` (one token per sequence; the decode
kernel). Both are `jax.jit`ted with the cache donated: the page pools are updated in
place and returned. Inside: copy-on-write page copies first, then the model's paged
forward, then sampling on device, so only token ids (and their logprobs) come back.
Before tracing, the host checks the params, the input and the cache
(`pagedjax.step_checks`; `check_cache` is re-exported here).

`build_step_input` (in `pagedjax.step_input`, re-exported here with `SeqChunk`,
`StepInput`, `StepOutput`, `Buckets` and `bucket_size`) turns the host's view of a
step into a `StepInput`, validating everything on the host and padding every
dimension to a power of two above a floor, so a run compiles a handful of programs.
`compile_counts()` reports how many programs each step compiled (a trace, or a
compile without one: the same shapes with inputs placed otherwise); tests assert it
stays within the number of distinct buckets.

The steps are functions of pytrees, so they compose with the caller's own transforms:
`jax.jit` around them, `jax.lax.scan` over decode steps (advance a decode `StepInput`'s
`token_ids`, `positions`, `slot_mapping`, `context_lens` and `sample_steps` on the
device; slots as in `pagedjax.cache`; a step runs its copy pairs every time, so clear a
fork's, `copy_dst` all -1, before advancing its StepInput, or each step copies the page
over the tokens written since; its penalties' history and logit bias stay as built on
the host, without the tokens the scan draws), `jax.vmap` over stacked caches and inputs. Under
an outer trace the host checks see shapes only (token ids, positions, page ids and
slots, and their agreement with the page table and context lengths, are then the
caller's to keep valid, as they are in device arrays, which the checks do not read
back), and `compile_counts` counts the traces made inside it. Under an outer `jit` the
cache is donated only if that `jit` donates it (else the program holds the old pools and
the new at once: twice the cache's memory); under a bare `jax.vmap` the step's own
`jit` runs and donates the stacked cache, as a plain call does (a reuse is jax's
"deleted or donated" error).

`generate` (in `pagedjax.static_batch`, with `GenerateOutput`; both re-exported here)
is a static-batch loop with no scheduler, for research use. The README example::

    from pagedjax import cache as cache_lib, config, decode, model, scoring

    cfg = config.preset("tiny")                 # or ModelConfig.from_hf(...)
    params = model.init_params(cfg, seed=0)     # or pagedjax.weights.load_checkpoint(path)[1]

    # 1. The one-liner: static batch, greedy or sampled.
    out = decode.generate(params, [[1, 5, 7, 9], [1, 42]], max_new_tokens=16)
    print(out.tokens)                           # one list of new token ids per prompt
    # Each token's log-probability given those before it (RL reference log-probs, evals).
    scores = scoring.score(params, [[1, 5, 7, 9], [1, 42]], top_k=2)
    print(scores.logprobs[0], scores.total_logprob(0))   # log p(5 | 1), ...; their sum

    # 2. The pieces underneath.
    cache_cfg = config.CacheConfig(page_size=8, num_pages=32, dtype=cfg.dtype)
    cache = cache_lib.create(cfg, cache_cfg)    # L x [K, P, S, D] K and V pools
    prompt, pages = [1, 5, 7, 9, 11, 13, 17, 19, 23], [3, 4, 5]   # pages: any free ids
    sampling = dict(temperature=0.8, top_p=0.95, seed=1234)
    inp = decode.build_step_input(
        [decode.SeqChunk(prompt, start_pos=0, page_table=pages, **sampling)], cfg, cache_cfg
    )
    out, cache = decode.prefill_step(params, cache, inp)    # cache is donated
    tokens = [int(out.tokens[0])]
    while len(tokens) < 12:
        chunk = decode.SeqChunk(
            [tokens[-1]], start_pos=len(prompt) + len(tokens) - 1, page_table=pages,
            sample_step=len(tokens), **sampling,
        )
        inp = decode.build_step_input([chunk], cfg, cache_cfg)
        out, cache = decode.decode_step(params, cache, inp)
        tokens.append(int(out.tokens[0]))
    print(tokens, decode.compile_counts())
"""

from __future__ import annotations

import collections
import threading
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import cache as cache_lib
from pagedjax import model as model_lib
from pagedjax import planner, sampling
from pagedjax.lora import LoRAWeights
from pagedjax.step_checks import _check_step, check_cache, check_lora
from pagedjax.step_input import (
    Buckets,
    SeqChunk,
    StepInput,
    StepOutput,
    bucket_size,
    build_step_input,
)

if TYPE_CHECKING:  # (imported on first use: `__getattr__`)
    from pagedjax.static_batch import GenerateOutput, generate

__all__ = [
    "Buckets",
    "GenerateOutput",
    "SeqChunk",
    "StepInput",
    "StepOutput",
    "bucket_size",
    "build_step_input",
    "check_cache",
    "compile_counts",
    "decode_step",
    "generate",
    "prefill_step",
    "step",
]

_TRACES: collections.Counter = collections.Counter()
# Backend compiles of a step's program in this thread (`_count_compiles`): a call that
# compiles without tracing (the shapes seen, an input placed otherwise: committed to
# its device, or not) compiles a program that counting traces alone would not see.
_COMPILING = threading.local()
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # (jax's; with fun_name)


def _count_compiles(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE and "_step" in str(kwargs.get("fun_name", "_step")):
        _COMPILING.count = getattr(_COMPILING, "count", 0) + 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_counts() -> dict[str, int]:
    """How many programs each step function has compiled in this process: its traces
    (under an outer trace: those made inside it), and its compiles without a trace
    (inputs of shapes it has seen, placed otherwise: an array committed to its device
    where it was not, which `jax.device_put(x, device)` and a weight update make, or
    the reverse; XLA compiles another program for them)."""
    return dict(_TRACES)


def _run(jitted, name: str, *args, **kwargs):
    """`jitted(*args, **kwargs)`, counting a compile without a trace in `_TRACES[name]`."""
    traces, compiles = _TRACES[name], getattr(_COMPILING, "count", 0)
    out = jitted(*args, **kwargs)
    if _TRACES[name] == traces:
        _TRACES[name] += getattr(_COMPILING, "count", 0) - compiles
    return out


def _step(
    params,
    cache,
    inp,
    lora=None,
    *,
    decode,
    backend,
    interpret,
    num_top_logprobs,
    num_prompt_top_logprobs=0,
    return_logits,
):
    _TRACES["decode_step" if decode else "prefill_step"] += 1  # runs once per trace
    every_token = inp.target_ids is not None
    token_ids = inp.token_ids
    if inp.feed is not None:
        src = inp.token_src
        token_ids = jnp.where(src >= 0, inp.feed[jnp.maximum(src, 0)], token_ids)
    cache = cache_lib.copy_pages(cache, inp.copy_src, inp.copy_dst)
    logits, cache, *hidden = model_lib.forward_paged(
        params,
        cache,
        token_ids,
        inp.positions,
        inp.slot_mapping,
        inp.page_table,
        inp.context_lens,
        inp.query_start_loc,
        inp.logits_indices,
        decode=decode,
        backend=backend,
        interpret=interpret,
        lora=lora,
        lora_slots=_lora_slots(inp) if lora is not None else None,
        return_hidden=every_token,
    )
    extra = {}
    if every_token:  # score every token's target (prompt logprobs)
        extra = _score_targets(params, hidden[0], inp.target_ids, num_prompt_top_logprobs)
    fed = None  # asynchronous steps: each row's fed token, generated but not on the host
    if inp.penalties is not None and inp.feed is not None:
        li = inp.logits_indices
        fed = jnp.where(inp.token_src[li] >= 0, token_ids[li], -1)
    last = None  # conditional biases (bad words): each row's last token, fed ones included
    if inp.logit_bias is not None and inp.logit_bias.after is not None:
        last = token_ids[inp.logits_indices]
    tokens, logprobs = sampling.sample(
        logits,
        inp.temperature,
        inp.top_k,
        inp.top_p,
        inp.seeds,
        inp.sample_steps,
        inp.min_p,
        penalties=inp.penalties,
        extra_ids=fed,
        bias=inp.logit_bias,
        last_ids=last,
    )
    top_ids = top_lp = None
    if num_top_logprobs:  # (requested logprobs: the sampled tokens' ranks too)
        top_ids, top_lp = sampling.top_logprobs(logits, num_top_logprobs)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
        extra["ranks"] = _ranks(lp, jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0])
    if inp.feed is not None:
        extra["feed"] = inp.feed.at[: tokens.shape[0]].set(tokens)
    out = StepOutput(tokens, logprobs, top_ids, top_lp, logits if return_logits else None, **extra)
    return out, cache


def _score_targets(params, hidden, targets, k: int) -> dict:
    """Each token's target logprob and vocabulary rank, 0 where its target is -1 (and
    with k > 0 its k most likely next tokens), from its final hidden state: `hidden` [T,
    E] through the LM head `planner.SCORE_ROWS` rows at a time (`jax.lax.map`), so a
    long prompt's scoring never holds its [T, V] logits at once (`step_peak_bytes`
    counts a chunk's)."""
    t, e = hidden.shape
    rows = min(t, planner.SCORE_ROWS)
    n = -(-t // rows)
    h = jnp.pad(hidden, ((0, n * rows - t), (0, 0))).reshape(n, rows, e)
    tg = jnp.pad(targets, (0, n * rows - t), constant_values=-1).reshape(n, rows)

    def score(chunk):
        h, tg = chunk
        lp = jax.nn.log_softmax(model_lib.head_logits(params, h), axis=-1)  # [rows, V]
        picked = jnp.take_along_axis(lp, jnp.maximum(tg, 0)[:, None], axis=-1)[:, 0]
        out = {
            "target_logprobs": jnp.where(tg >= 0, picked, 0.0),
            "target_ranks": jnp.where(tg >= 0, _ranks(lp, picked), 0),
        }
        if k:
            top_lp, top_ids = jax.lax.top_k(lp, k)
            out["target_top_ids"] = top_ids.astype(jnp.int32)
            out["target_top_logprobs"] = top_lp
        return out

    out = jax.lax.map(score, (h, tg))
    return {name: a.reshape(n * rows, *a.shape[2:])[:t] for name, a in out.items()}


def _lora_slots(inp):
    """Each token's LoRA slot: `inp.lora_slots`, or none (0) for a StepInput without."""
    if inp.lora_slots is not None:
        return inp.lora_slots
    return jnp.zeros(inp.token_ids.shape, jnp.int32)


def _ranks(lp, picked):
    """[N] int32: how many of each row's logprobs `lp` [N, V] are at least its `picked`
    [N]: its vocabulary rank, ties ranked last (vLLM's `batched_count_greater_than`)."""
    return jnp.sum(lp >= picked[:, None], axis=-1, dtype=jnp.int32)


_STATIC = (
    "backend",
    "interpret",
    "num_top_logprobs",
    "num_prompt_top_logprobs",
    "return_logits",
)


def _bool(flag):
    """A numpy bool flag as a Python one (anything else as it is): `_check_step` takes
    both, but the Pallas kernels refused `interpret=np.True_` inside the trace, and only
    when it was the flag the program was first compiled with."""
    return bool(flag) if isinstance(flag, np.bool_) else flag


def _jit_step(decode):
    fn = partial(_step, decode=decode)
    return jax.jit(fn, static_argnames=_STATIC, donate_argnames=("cache",))


_prefill_jit = _jit_step(False)
_decode_jit = _jit_step(True)


def prefill_step(
    params: model_lib.Params,
    cache: cache_lib.PagedKVCache,
    inp: StepInput,
    *,
    backend: str = "auto",
    interpret: bool = False,
    num_top_logprobs: int = 0,
    num_prompt_top_logprobs: int = 0,
    return_logits: bool = False,
    lora: LoRAWeights | None = None,
) -> tuple[StepOutput, cache_lib.PagedKVCache]:
    """One mixed step (prefill chunks and decode rows) with ragged paged attention.

    Jitted; `cache` is donated (do not use it after the call; use the returned one).
    First, on the host: `params`, `inp` and the knobs are checked (TypeError if `params`
    is not a `Params`, `inp` not a StepInput, a field of it not a numpy or jax array (a
    list) or an index field not ints; ValueError naming a bad one: a StepInput built for
    the other step, fields whose shapes do not fit one another, an unknown backend, a
    top-k count outside [0, V], interpret or return_logits not a bool (numpy's run as
    Python's)), then `check_cache` (which also checks the token ids, positions, page
    ids, slots, context lengths and row offsets of `inp`'s numpy arrays against the
    model, the cache and its page table, and that each row's written tokens sit at the
    positions and in the slots of its own pages that its context length says: an input
    changed by hand or built for another model would otherwise run, its ids clamped or
    dropped, or its K/V written over another sequence's).

    Args:
      params: the split model (`pagedjax.model.split_model`).
      cache: the paged KV cache.
      inp: from `build_step_input`.
      backend: attention backend, "auto" | "gpu" | "tpu" | "xla".
      interpret: run Pallas kernels in interpret mode.
      num_top_logprobs: also return each row's k most likely tokens (beam search,
        requested logprobs), and its sampled token's vocabulary rank (`StepOutput.ranks`).
      num_prompt_top_logprobs: with `inp.target_ids`, also return every token's k most
        likely next tokens (`StepOutput.target_top_ids`).
      return_logits: also return the [B, V] float32 logits (tests, debugging).
      lora: LoRA adapters on the device (`pagedjax.lora.LoRAWeights`): each token gets
        the update of its slot in `inp.lora_slots` (`SeqChunk.lora_slot`; none for a
        StepInput without them). None: the base model only.

    With `inp.target_ids` (prompt logprobs) the step also scores every token: the LM
    head over all T tokens, `planner.SCORE_ROWS` rows at a time (its float32 logits and
    their log-softmax are [SCORE_ROWS, V], not [T, V]); a separate compiled program.

    Returns:
      (StepOutput, new cache).
    """
    _check_step(
        params, inp, False, backend, num_top_logprobs, num_prompt_top_logprobs,
        interpret=interpret, return_logits=return_logits,
    )  # fmt: skip
    check_cache(params, cache, inp)
    check_lora(params, inp, lora)
    return _run(
        _prefill_jit,
        "prefill_step",
        params,
        cache,
        inp,
        backend=backend,
        interpret=_bool(interpret),
        num_top_logprobs=num_top_logprobs,
        num_prompt_top_logprobs=num_prompt_top_logprobs,
        return_logits=_bool(return_logits),
        lora=lora,
    )


def decode_step(
    params: model_lib.Params,
    cache: cache_lib.PagedKVCache,
    inp: StepInput,
    *,
    backend: str = "auto",
    interpret: bool = False,
    num_top_logprobs: int = 0,
    num_prompt_top_logprobs: int = 0,
    return_logits: bool = False,
    lora: LoRAWeights | None = None,
) -> tuple[StepOutput, cache_lib.PagedKVCache]:
    """One decode step: one token per sequence, with the paged decode kernel.

    `inp` must come from `build_step_input(..., decode=True)` (the default when every
    chunk has one token). Arguments and result as for `prefill_step`.
    """
    _check_step(
        params, inp, True, backend, num_top_logprobs, num_prompt_top_logprobs,
        interpret=interpret, return_logits=return_logits,
    )  # fmt: skip
    check_cache(params, cache, inp)
    check_lora(params, inp, lora)
    return _run(
        _decode_jit,
        "decode_step",
        params,
        cache,
        inp,
        backend=backend,
        interpret=_bool(interpret),
        num_top_logprobs=num_top_logprobs,
        num_prompt_top_logprobs=num_prompt_top_logprobs,
        return_logits=_bool(return_logits),
        lora=lora,
    )


def step(params, cache, inp: StepInput, **kwargs):
    """`decode_step` for decode batches, `prefill_step` otherwise (same arguments)."""
    kind = decode_step if getattr(inp, "decode", False) else prefill_step  # checks `inp`
    return kind(params, cache, inp, **kwargs)


def __getattr__(name: str):
    """`generate`, `GenerateOutput`: `pagedjax.static_batch`'s; `score`, `ScoreOutput`:
    `pagedjax.scoring`'s; each imported on use (those modules import this one)."""
    if name in ("generate", "GenerateOutput"):
        from pagedjax import static_batch

        return getattr(static_batch, name)
    if name in ("score", "ScoreOutput"):
        from pagedjax import scoring

        return getattr(scoring, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "GenerateOutput", "generate"])
