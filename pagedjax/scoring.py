"""Teacher-forced scoring: every token's log-probability under the model, via the paged cache.

`score(params, sequences)` returns, per sequence, log p(tok[i] | tok[:i]) for i >= 1,
each token's vocabulary rank and, with `top_k`, the k most likely tokens at each
position: an RL loop's reference-model log-probs of sampled completions, an eval's
log-likelihoods, a perplexity. It is `decode.generate`'s static batch without the
sampling: the sequences run as prefill steps (`decode.prefill_step` with
`StepInput.target_ids`, the path of the engine's prompt logprobs), so it shares their
compiled programs, their paged attention backends, LoRA and tensor parallelism, and
scores in bounded memory: the LM head runs `planner.SCORE_ROWS` rows at a time, and
`prefill_chunk` bounds a sequence's tokens per step.

Example::

    from pagedjax import config, model, scoring

    params = model.init_params(config.preset("tiny"), seed=0)
    out = scoring.score(params, [[1, 5, 7, 9], [1, 42]], top_k=2)
    out.logprobs[0]         # [3] float32: log p(5 | 1), log p(7 | 1 5), log p(9 | 1 5 7)
    out.ranks[0]            # [3] int32: 1 where the token was the model's first choice
    out.total_logprob(0)    # their sum: log p(5 7 9 | 1)
    out.top_ids[1]          # [1, 2] int32: the two likeliest tokens after [1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from pagedjax import decode, sharding, static_batch
from pagedjax import model as model_lib
from pagedjax.lora import LoRAWeights
from pagedjax.step_checks import _check_params, _check_step, check_lora
from pagedjax.step_input import Buckets, SeqChunk, StepInput, build_step_input, is_int

__all__ = ["ScoreOutput", "score"]


@dataclass
class ScoreOutput:
    """Per sequence b of n tokens, row i - 1 is about its token i (1 <= i < n), predicted
    from the tokens before it. A one-token sequence has empty (0-row) arrays.

    Attributes:
      logprobs: log p(tok[i] | tok[:i]) under the raw distribution (no temperature).
      ranks: tok[i]'s vocabulary rank: how many tokens are at least as likely (1: the
        model's first choice; ties ranked last, as vLLM's logprob ranks).
      top_ids, top_logprobs: with top_k = k > 0, the k likeliest tokens after tok[:i],
        most likely first, and their logprobs; None with top_k = 0.
    """

    logprobs: list[np.ndarray]  # each [n - 1] float32
    ranks: list[np.ndarray]  # each [n - 1] int32
    top_ids: list[np.ndarray] | None = None  # each [n - 1, k] int32
    top_logprobs: list[np.ndarray] | None = None  # each [n - 1, k] float32

    def total_logprob(self, b: int) -> float:
        """Sequence b's log-likelihood given its first token, log p(tok[1:] | tok[0]): the
        sum of its logprobs (in float64)."""
        return float(np.sum(self.logprobs[b], dtype=np.float64))


def score(
    params: model_lib.Params,
    sequences: Sequence[Sequence[int]],
    *,
    top_k: int = 0,
    page_size: int = 16,
    prefill_chunk: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
    buckets: Buckets = Buckets(),
    kv_cache_dtype: str | None = None,
    lora: LoRAWeights | None = None,
    lora_slots: Sequence[int] | None = None,
) -> ScoreOutput:
    """Every token's log-probability given the tokens before it, for a static batch.

    The sequences run together as prefill steps through a cache of their own (sequence
    b gets its own contiguous pages, page 0 a null page, as in `decode.generate`). Each
    fed token scores the next one (`StepInput.target_ids`), so the last token of a
    sequence, which predicts nothing, is never fed: a one-token sequence costs nothing.
    With `prefill_chunk` a sequence runs over several steps, each scoring its chunk's
    tokens (a chunk's last token scores the next chunk's first). It runs on the host, as
    `decode.generate` does (a Python loop over the steps, each step's scores read back),
    so not under an outer `jax.jit`, `vmap` or `grad`.

    Args:
      params: the split model (its config gives the vocabulary and position limit;
        `params.mesh` splits the cache as `generate` does).
      sequences: token id lists, each of 1 to max_position_embeddings tokens (lists,
        numpy or jax arrays, or the rows of a 2-D array).
      top_k: also return the k likeliest tokens at each position (0: none).
      page_size: tokens per page (a power of two, at most max_position_embeddings).
      prefill_chunk: feed each sequence at most this many tokens per step (default: all
        at once). Bounds a step's attention and activations for long sequences; the
        result is the same.
      backend, interpret: attention backend (see `decode.prefill_step`).
      buckets: padding floors for the step shapes.
      kv_cache_dtype: the cache's storage dtype (None or "auto": the model's; "fp8": see
        `pagedjax.cache`; scores then differ from the dense model's by fp8's rounding).
      lora, lora_slots: LoRA adapters on the device (`pagedjax.lora.LoRAWeights`) and
        each sequence's slot among them (0: none; default all 0).

    Returns:
      A `ScoreOutput` of numpy arrays, one entry per sequence, in order.

    Raises:
      TypeError: `params` is not a `Params`, or `params` or `lora` traced (under
        `jax.jit`); token ids that are not ints; `buckets` not a `Buckets`; `lora` not a
        `LoRAWeights`; a kv_cache_dtype the model's attention cannot read (refused once
        the cache is allocated, before any step runs).
      ValueError: an empty list or sequence, a nested one, token ids outside the
        vocabulary, a sequence longer than max_position_embeddings, top_k not an int in
        [0, vocab_size], page_size or prefill_chunk not a positive int (page_size: a
        power of two, at most max_position_embeddings), an unknown backend or
        kv_cache_dtype, interpret not a bool, or lora_slots without lora, not one per
        sequence or outside [0, lora.num_slots] (all before the cache is allocated or
        anything is compiled).
    """
    _check_params(params)
    static_batch.check_untraced(
        "score", params=params, lora=lora, sequences=sequences, lora_slots=lora_slots
    )
    cfg = params.config
    seqs = static_batch.token_lists(sequences, "sequence")
    if not is_int(top_k) or not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(
            f"top_k must be an int in [0, {cfg.vocab_size}] (the vocabulary), got {top_k=}"
        )
    static_batch.check_chunking(page_size, prefill_chunk)
    static_batch.check_lengths(seqs, cfg, "sequence")
    n = len(seqs)
    slots = static_batch.lora_slots(lora, lora_slots, n)
    cache_cfg, pages = static_batch.static_pages(
        cfg, n, max(len(p) for p in seqs), page_size, kv_cache_dtype
    )

    def step_input(starts: Sequence[int], stops: Sequence[int], bs: Sequence[int]) -> StepInput:
        """Sequence bs[j]'s tokens [starts[j], stops[j]), each with the next as target."""
        chunks = [
            SeqChunk(seqs[b][i:j], i, pages[b], lora_slot=slots[b])
            for i, j, b in zip(starts, stops, bs, strict=True)
        ]
        inp = build_step_input(chunks, cfg, cache_cfg, buckets=buckets, decode=False)
        targets = np.full(inp.token_ids.shape, -1, np.int32)  # [T] (-1: no target)
        for row, i, j, b in zip(inp.query_start_loc[: len(bs)], starts, stops, bs, strict=True):
            nxt = seqs[b][i + 1 : j + 1]  # (the last token's target: none)
            targets[row : row + len(nxt)] = nxt
        return dataclasses.replace(inp, target_ids=targets)

    # Every sequence whole, to validate before allocating the cache or compiling anything.
    inp = step_input([0] * n, [len(p) for p in seqs], range(n))
    _check_step(params, inp, False, backend, 0, top_k, interpret=interpret, return_logits=False)
    check_lora(params, inp, lora)

    fed = [len(p) - 1 for p in seqs]  # tokens with a next token to score
    out = ScoreOutput(
        [np.zeros(m, np.float32) for m in fed],
        [np.zeros(m, np.int32) for m in fed],
        [np.zeros((m, top_k), np.int32) for m in fed] if top_k else None,
        [np.zeros((m, top_k), np.float32) for m in fed] if top_k else None,
    )
    if not any(fed):
        return out
    # Split over kv heads with a mesh, else committed where the steps' outputs lie.
    device = sharding.home_device(params)
    cache = sharding.create_cache(cfg, cache_cfg, params.mesh, device=device)
    chunk_len = int(prefill_chunk or max(fed))  # (a narrow numpy int's sums wrapped)
    done = [0] * n
    while active := [b for b in range(n) if done[b] < fed[b]]:
        stops = [min(done[b] + chunk_len, fed[b]) for b in active]
        inp = step_input([done[b] for b in active], stops, active)
        res, cache = decode.prefill_step(
            params,
            cache,
            inp,
            backend=backend,
            interpret=interpret,
            num_prompt_top_logprobs=top_k,
            lora=lora,
        )
        got = jax.device_get(
            (res.target_logprobs, res.target_ranks, res.target_top_ids, res.target_top_logprobs)
        )
        for row, b, stop in zip(inp.query_start_loc[: len(active)], active, stops, strict=True):
            rows, dst = slice(row, row + stop - done[b]), slice(done[b], stop)
            out.logprobs[b][dst], out.ranks[b][dst] = got[0][rows], got[1][rows]
            if top_k:
                out.top_ids[b][dst], out.top_logprobs[b][dst] = got[2][rows], got[3][rows]
            done[b] = stop
    return out
