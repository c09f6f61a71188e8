"""Host-side packing of one step: `SeqChunk`s in, a bucketed `StepInput` out.

`build_step_input` turns the host's view of a step (per sequence: this step's tokens,
how many of its tokens are already cached, its page table row, its sampling
parameters) into a `StepInput` of numpy arrays, validating everything on the host
(each error names the bad value; the checks are in `pagedjax.step_input_checks`) and
padding every dimension to a power of two above a floor (`Buckets`), so a run compiles
a handful of programs. `StepOutput` is what a step returns. `pagedjax.decode` runs the
steps and re-exports all of these, so research code needs only
`from pagedjax import decode`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np

from pagedjax import sampling
from pagedjax.config import CacheConfig, ModelConfig
from pagedjax.step_input_checks import (
    _all_real,
    _check_copies,
    _check_distinct_slots,
    _check_int_values,
    _check_real_values,
    _check_steps,
    _check_written_slots_unshared,
    _first,
    _int_array,
    _is_real,
    _page_row,
    _scalar,
    is_int,
)

_static = partial(dataclasses.field, metadata=dict(static=True))
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    """Everything one step needs besides params and cache; padded to bucketed shapes.

    Sequence rows past the real batch and token rows past the real tokens are
    padding: slot -1 (nothing written), context length 0, q_len 0.
    """

    token_ids: jax.Array  # [T] int32 all sequences' new tokens back to back
    positions: jax.Array  # [T] int32 absolute position of each token
    slot_mapping: jax.Array  # [T] int32 cache slot of each token (-1: padding)
    page_table: jax.Array  # [B, max_pages] int32
    context_lens: jax.Array  # [B] int32 cached tokens after this step
    query_start_loc: jax.Array  # [B + 1] int32
    logits_indices: jax.Array  # [B] int32 each sequence's last token row
    copy_src: jax.Array  # [C] int32 copy-on-write source pages
    copy_dst: jax.Array  # [C] int32 destinations (-1: padding)
    temperature: jax.Array  # [B] float32 (0: greedy)
    top_k: jax.Array  # [B] int32 (0: off)
    top_p: jax.Array  # [B] float32 (1: off)
    seeds: jax.Array  # [B] uint32
    sample_steps: jax.Array  # [B] int32 index of the token being drawn, per request
    min_p: jax.Array | None = None  # [B] float32 (0: off; None: off for every row)
    penalties: sampling.Penalties | None = None  # None: off for every row
    logit_bias: sampling.LogitBias | None = None  # None: no bias on any row
    # Prompt logprobs: the token after each fed token whose log-probability is wanted
    # (-1: none). None: logits only at `logits_indices` (given: at every token).
    target_ids: jax.Array | None = None  # [T] int32
    # Asynchronous scheduling: token i is feed[token_src[i]] where token_src[i] >= 0 (the
    # previous step's `StepOutput.feed`, on the device), else token_ids[i].
    token_src: jax.Array | None = None  # [T] int32
    feed: jax.Array | None = None  # [F] int32, F >= B
    # LoRA: each token's adapter slot (0: none; `pagedjax.lora`). None: no token has one.
    lora_slots: jax.Array | None = None  # [T] int32
    decode: bool = _static(default=False)  # one token per sequence and T == B
    # The cache geometry the step was built and checked for (0: not recorded); the
    # steps refuse a cache of another page size or page count (`decode.check_cache`).
    page_size: int = _static(default=0)
    num_pages: int = _static(default=0)

    @property
    def bucket(self) -> tuple[int, int, int, int, bool]:
        """(T, B, max_pages, C, decode): the shapes that select a compiled program, with
        the optional fields given (penalties, logit bias and their padded widths,
        target_ids, feed, lora_slots) and the step's static arguments (top-k counts)."""
        b, max_pages = self.page_table.shape
        return (self.token_ids.shape[0], b, max_pages, self.copy_src.shape[0], self.decode)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    """What a step returns besides the cache. Rows past the real batch are padding."""

    tokens: jax.Array  # [B] int32 sampled next tokens
    logprobs: jax.Array  # [B] float32 their log-probabilities (raw distribution)
    top_ids: jax.Array | None = None  # [B, k] int32 when num_top_logprobs = k > 0
    top_logprobs: jax.Array | None = None  # [B, k] float32
    logits: jax.Array | None = None  # [B, V] float32 when return_logits
    # With StepInput.target_ids: each token's target log-probability (0 where the
    # target is -1), and with num_prompt_top_logprobs = k > 0 its k most likely tokens.
    target_logprobs: jax.Array | None = None  # [T] float32
    target_top_ids: jax.Array | None = None  # [T, k] int32
    target_top_logprobs: jax.Array | None = None  # [T, k] float32
    feed: jax.Array | None = None  # [F] int32 with StepInput.feed: `tokens` in its first B
    # Vocabulary ranks under the raw distribution (the number of tokens whose logprob is
    # at least the token's, ties last: `decode._ranks`): of `tokens` when
    # num_top_logprobs > 0, of the targets with StepInput.target_ids (0 where the target
    # is -1).
    ranks: jax.Array | None = None  # [B] int32
    target_ranks: jax.Array | None = None  # [T] int32


@dataclass(slots=True)
class SeqChunk:
    """The host's description of one sequence's share of a step.

    Attributes:
      token_ids: this step's new tokens (a prompt chunk, or the last sampled token).
      start_pos: tokens of this sequence already in the cache (position of token_ids[0]).
      page_table: the sequence's physical pages in logical order, covering at least
        start_pos + len(token_ids) tokens.
      temperature, top_k, top_p, seed, min_p: sampling parameters (see
        pagedjax.sampling).
      sample_step: index of the token this step draws for the request (0 for the
        first generated token); with the seed it fixes the PRNG key.
      repetition_penalty, presence_penalty, frequency_penalty: penalties (see
        pagedjax.sampling; 1, 0, 0: off).
      prompt_ids, output_ids: the tokens the penalties count: the request's prompt
        (repetition penalty only) and the tokens generated so far (all three). The
        caller gives them whole (a chunk holds only part of a prompt); they are read
        only when a penalty is on.
      logit_bias: token id -> value added to its logit before sampling (-inf bans it),
        or None.
      lora_slot: the LoRA adapter slot its tokens use (`pagedjax.lora`; 0: none).
    """

    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    sample_step: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] | None = None
    lora_slot: int = 0

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on."""
        return sampling.any_penalty(
            self.repetition_penalty, self.presence_penalty, self.frequency_penalty
        )


@dataclass(frozen=True)
class Buckets:
    """Floors of the padded sizes; every size is the next power of two above its floor."""

    min_tokens: int = 16
    min_seqs: int = 8
    min_pages: int = 8
    min_copies: int = 4
    min_history: int = 64

    def __post_init__(self):
        for name in ("min_tokens", "min_seqs", "min_pages", "min_copies", "min_history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
            if value > 2**30:  # a larger floor pads to 2**31, past the int32 offsets
                raise ValueError(
                    f"{name} must be at most 2**30 (padded sizes are packed as int32), got "
                    f"{name}={value}"
                )


def bucket_size(n: int, floor: int) -> int:
    """The smallest power of two >= max(n, floor)."""
    return 1 << max(0, math.ceil(math.log2(max(n, floor, 1))))


def build_step_input(
    chunks: Sequence[SeqChunk],
    model_cfg: ModelConfig,
    cache_cfg: CacheConfig,
    *,
    copies: Sequence[tuple[int, int]] = (),
    buckets: Buckets = Buckets(),
    decode: bool | None = None,
) -> StepInput:
    """Validates a step on the host and packs it into a bucketed `StepInput` (numpy arrays).

    The work is vectorised over sequences (no per-token Python); padding rows and
    tokens follow the conventions of `StepInput`.

    Args:
      chunks: one `SeqChunk` per sequence in the step.
      model_cfg: vocabulary and position limits.
      cache_cfg: page size and page count.
      copies: (src_page, dst_page) copy-on-write pairs, applied before the step's writes.
      buckets: padding floors.
      decode: build a decode batch (every chunk one token, T == B). Default: True
        exactly when every chunk has one token.

    What the host cannot see is the caller's to keep true: that `start_pos` is the
    number of tokens of the sequence already written to its pages (a larger one attends
    to whatever those slots hold, a smaller one overwrites them), and that the pages a
    step writes belong to no sequence outside this step.

    Raises:
      ValueError: token ids outside the vocabulary, positions past the model's
        maximum (or int32's), a cache with more slots than int32 slot ids address, a
        page table too short or with bad ids, a page this step writes that
        another page table (or the same one twice) reads in this step, bad sampling
        parameters (or ones that are not numbers: "0.5", True), a logit bias past
        float32's range (a negative one is a ban, as -inf), bad copy pairs, or
        decode=True with a multi-token chunk.
      TypeError: ids or counts that are not ints, a logit bias that is not a mapping
        of ids to numbers; `chunks` not a list of `SeqChunk`s, the configs not a
        `ModelConfig` and a `CacheConfig`, `buckets` not a `Buckets`, `decode` not a
        bool or None.
    """
    if not isinstance(model_cfg, ModelConfig) or not isinstance(cache_cfg, CacheConfig):
        raise TypeError(
            "build_step_input(chunks, model_cfg, cache_cfg) takes a ModelConfig and a "
            f"CacheConfig, got {type(model_cfg).__name__} and {type(cache_cfg).__name__}"
        )
    if isinstance(chunks, SeqChunk) or not isinstance(chunks, Sequence):
        raise TypeError(f"chunks must be a list of SeqChunk (one per sequence), got {chunks!r}")
    for i, c in enumerate(chunks):
        if not isinstance(c, SeqChunk):
            raise TypeError(f"chunk {i} must be a SeqChunk, got {c!r}")
    if not chunks:
        raise ValueError("a step needs at least one sequence, got chunks=[]")
    if not isinstance(buckets, Buckets):
        raise TypeError(f"buckets must be a Buckets, got buckets={buckets!r:.80}")
    if decode is not None and not isinstance(decode, (bool, np.bool_)):
        raise TypeError(f"decode must be a bool or None, got decode={decode!r:.80}")
    n, s = len(chunks), cache_cfg.page_size
    toks = [np.asarray(c.token_ids) for c in chunks]
    q_lens = np.fromiter((t.size for t in toks), np.int64, n)
    start = _int_array([c.start_pos for c in chunks], "start_pos").astype(np.int64)
    rows = [_page_row(c.page_table, i, cache_cfg.num_pages) for i, c in enumerate(chunks)]
    n_pages = np.fromiter((r.size for r in rows), np.int64, n)
    if decode is None:
        decode = bool((q_lens == 1).all())
    elif decode and (q_lens != 1).any():
        i = _first(q_lens != 1)
        raise ValueError(f"decode=True needs one token per sequence; sequence {i} has {q_lens[i]}")

    b = bucket_size(n, buckets.min_seqs)
    total = int(q_lens.sum())
    t = b if decode else bucket_size(total, buckets.min_tokens)
    max_pages = bucket_size(int(n_pages.max()), buckets.min_pages)
    page_table = np.zeros((b, max_pages), np.int64)
    page_table[np.repeat(np.arange(n), n_pages), _ragged_arange(n_pages)] = np.concatenate(rows)
    _check_steps(toks, q_lens, start, n_pages, page_table, model_cfg, cache_cfg)
    steps = _int_array([c.sample_step for c in chunks], "sample_step")
    bad = (steps < 0) | (steps >= 2**31)  # packed as int32: larger ones would wrap
    if bad.any():
        i = _first(bad)
        raise ValueError(
            f"sequence {i}: sample_step must be in [0, 2**31), got sample_step={steps[i]}"
        )
    fields = ("temperature", "top_k", "top_p", "seed", "min_p")
    # numpy would take "0.5", True or [0.5] as numbers below.
    _check_real_values(chunks, fields + _PENALTIES)
    _check_int_values(chunks, ("top_k", "seed"))
    try:
        temperature, top_k, top_p, seeds, min_p = (
            np.array([getattr(c, f) for c in chunks], np.float64) for f in fields
        )
    except OverflowError:  # an int past float: the check names it
        for i in range(n):
            _check_sampling(chunks, i, fields)
        raise
    bad = ~(
        (temperature >= 0) & np.isfinite(temperature) & (top_k >= 0) & (top_k < 2**31)
        & (top_k == np.floor(top_k))
        & (top_p > 0) & (top_p <= 1) & (seeds >= 0) & (seeds < 2**32) & (seeds == np.floor(seeds))
        & (min_p >= 0) & (min_p <= 1)
    )  # fmt: skip
    if bad.any():
        _check_sampling(chunks, _first(bad), fields)
    penalties = _pack_penalties(chunks, b, buckets.min_history, model_cfg.vocab_size)
    bias = [(i, _bias_arrays(c.logit_bias, i, model_cfg.vocab_size)) for i, c in enumerate(chunks)]
    logit_bias = pack_bias([(i, *a, None, None, None) for i, a in bias if a is not None], b)

    starts = np.full(b + 1, total, np.int32)
    starts[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    seq = np.repeat(np.arange(n), q_lens)  # [total] owning sequence of each token
    pos = start[seq] + _ragged_arange(q_lens)
    token_ids = np.zeros(t, np.int32)
    token_ids[:total] = np.concatenate(toks)
    positions = np.zeros(t, np.int32)
    positions[:total] = pos
    slot_mapping = np.full(t, -1, np.int32)
    slot_mapping[:total] = page_table[seq, pos // s] * s + pos % s
    _check_distinct_slots(slot_mapping[:total], seq, pos)
    _check_written_slots_unshared(
        slot_mapping[:total], seq, pos, page_table, start, start + q_lens, s,
        cache_cfg.num_pages, model_cfg.sliding_window,
    )  # fmt: skip
    context_lens = np.zeros(b, np.int32)
    context_lens[:n] = start + q_lens
    logits_indices = np.zeros(b, np.int32)
    logits_indices[:n] = starts[1 : n + 1] - 1

    def per_seq(values, dtype, pad):
        out = np.full(b, pad, dtype)
        with np.errstate(over="ignore"):  # a temperature past float32 is +inf: sampled
            out[:n] = values  # as uniformly as a huge one (sampling.sample)
        return out

    lora = _int_array([c.lora_slot for c in chunks], "lora_slot")
    if (lora < 0).any() or (lora >= 2**31).any():
        i = _first((lora < 0) | (lora >= 2**31))
        raise ValueError(f"sequence {i}: lora_slot must be in [0, 2**31), got lora_slot={lora[i]}")
    lora_slots = None
    if lora.any():
        lora_slots = np.zeros(t, np.int32)
        lora_slots[:total] = lora[seq]
    num_copies = bucket_size(len(copies), buckets.min_copies)
    _check_copies(copies, cache_cfg.num_pages)
    src, dst = pack_copies(copies, num_copies)
    return StepInput(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        page_table=page_table.astype(np.int32),
        context_lens=context_lens,
        query_start_loc=starts,
        logits_indices=logits_indices,
        copy_src=src,
        copy_dst=dst,
        temperature=per_seq(temperature, np.float32, 0.0),
        top_k=per_seq(top_k, np.int32, 0),
        top_p=per_seq(top_p, np.float32, 1.0),
        seeds=per_seq(seeds, np.uint32, 0),
        sample_steps=per_seq(steps, np.int32, 0),
        min_p=per_seq(min_p, np.float32, 0.0),
        penalties=penalties,
        logit_bias=logit_bias,
        lora_slots=lora_slots,
        decode=bool(decode),
        page_size=cache_cfg.page_size,
        num_pages=cache_cfg.num_pages,
    )


def _check_sampling(chunks, i: int, fields) -> None:
    """`sampling.check_params` on chunk i's sampling values, its error naming the sequence."""
    try:
        sampling.check_params(*(_scalar(getattr(chunks[i], f)) for f in fields))
    except ValueError as e:
        raise ValueError(f"sequence {i}: {e}") from None


def pack_bias(rows: Sequence[tuple], b: int) -> sampling.LogitBias | None:
    """Logit-bias arrays for a batch of b rows (see `sampling.LogitBias`); None when
    `rows` is empty.

    Args:
      rows: (row, ids, values, after, allowed, mask) per biased row: `values[j]` is
        added to token `ids[j]` where the row's last token is `after[j]` (-1, or `after`
        None: always); `allowed`: the only tokens the row may draw, or None; `mask`: a
        uint32 bitmask of the tokens it may draw, [ceil(V / 32)], or None. `after`,
        `allowed` and `mask` are packed only when some row has one (`allowed`: bucketed
        widths, floor 8; the rows without a mask: all ones).
      b: rows in the batch.
    """
    if not rows:
        return None
    width = bucket_size(max(len(r[1]) for r in rows), 8)
    ids = np.full((b, width), -1, np.int32)
    values = np.zeros((b, width), np.float32)
    after = allowed = mask = None
    if any(r[3] is not None for r in rows):
        after = np.full((b, width), -1, np.int32)
    listed = [r[4] for r in rows if r[4] is not None]
    if listed:
        allowed = np.full((b, bucket_size(max(map(len, listed)), 8)), -1, np.int32)
    masks = [r[5] for r in rows if r[5] is not None]
    if masks:
        mask = np.full((b, len(masks[0])), 0xFFFFFFFF, np.uint32)
    for i, row_ids, row_values, row_after, row_allowed, row_mask in rows:
        ids[i, : len(row_ids)] = row_ids
        values[i, : len(row_ids)] = row_values
        if row_after is not None:
            after[i, : len(row_after)] = row_after
        if row_allowed is not None:
            allowed[i, : len(row_allowed)] = row_allowed
        if row_mask is not None:
            mask[i] = row_mask
    return sampling.LogitBias(ids, values, after, allowed, mask)


def _bias_arrays(bias, i: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A chunk's logit bias as (ids, values) arrays, validated; None when empty."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise TypeError(
            f"sequence {i}: logit_bias must be a mapping of token id -> value, got {bias!r:.80}"
        )
    if not bias:
        return None
    bad = [t for t in bias if not is_int(t)]
    if bad:  # int() would truncate 3.7 to token 3
        raise TypeError(f"sequence {i}: logit_bias token ids must be ints, got {bad[0]!r}")
    if not _all_real(bias.values()):  # numpy would take "0.5" and True as numbers
        t, v = next((t, v) for t, v in bias.items() if not _is_real(v))
        raise TypeError(
            f"sequence {i}: logit_bias values must be real numbers, got {v!r:.80} for token {t}"
        )
    try:
        ids = np.fromiter((int(t) for t in bias), np.int64, len(bias))
    except OverflowError:  # an id past int64 (numpy's bare "too large to convert")
        ids = np.array([t if -(2**63) <= t < 2**63 else -1 for t in map(int, bias)])
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise ValueError(
            f"sequence {i}: logit_bias token id {int(list(bias)[_first(bad)])} is outside "
            f"the vocabulary [0, {vocab_size})"
        )
    try:
        values = np.fromiter(bias.values(), np.float64, len(bias))
    except OverflowError:  # an int past float64: +-inf, as one past float32 packs
        values = np.array([_float(v) for v in bias.values()])
    with np.errstate(over="ignore"):  # past float32's range: +-inf, refused or a ban
        packed = values.astype(np.float32)
    bad = np.isnan(values) | (packed == np.inf)
    if bad.any():
        t, v = list(bias.items())[_first(bad)]
        # (an int past float's range: its repr may pass Python's limit on int digits)
        big = isinstance(v, int) and math.isinf(_float(v))
        v = "an int past float's range" if big else f"{v!r:.40}"
        raise ValueError(
            f"sequence {i}: logit_bias values must be finite or -inf (as float32: at most "
            f"{float(np.finfo(np.float32).max):.6g}), got {v} for token {t}"
        )
    return ids.astype(np.int32), packed


def _float(v) -> float:
    """A real number as a float; an int past float64's range as +-inf."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def pack_penalties(
    rows: Sequence[tuple[int, float, float, float, Sequence[int], Sequence[int]]],
    b: int,
    min_history: int,
) -> sampling.Penalties | None:
    """Penalty arrays for a batch of b rows; None when `rows` is empty.

    Args:
      rows: (row, repetition, presence, frequency, prompt_ids, output_ids) per
        penalised row; prompt tokens are sent only when the repetition penalty is on.
      b: rows in the batch.
      min_history: floor of the padded history width.
    """
    if not rows:
        return None
    rep = np.ones(b, np.float32)
    presence = np.zeros(b, np.float32)
    frequency = np.zeros(b, np.float32)
    prompt_lens = np.zeros(b, np.int32)
    hist = []
    for i, r, p, f, prompt, out in rows:
        with np.errstate(over="ignore"):  # a repetition penalty past float32 is +inf
            rep[i], presence[i], frequency[i] = r, p, f
        prompt = prompt if r != 1.0 else ()
        prompt_lens[i] = len(prompt)
        hist.append((i, prompt, out))
    width = bucket_size(max(len(p) + len(o) for _, p, o in hist), min_history)
    ids = np.full((b, width), -1, np.int32)
    for i, prompt, out in hist:
        ids[i, : len(prompt)] = prompt
        ids[i, len(prompt) : len(prompt) + len(out)] = out
    return sampling.Penalties(rep, presence, frequency, ids, prompt_lens)


def _pack_penalties(chunks, b, min_history, vocab_size) -> sampling.Penalties | None:
    rows = []
    for i, c in enumerate(chunks):
        if not c.penalised:
            continue
        r, p, f = (_scalar(getattr(c, name)) for name in _PENALTIES)
        try:
            sampling.check_penalties(r, p, f)
        except ValueError as e:
            raise ValueError(f"sequence {i}: {e}") from None
        for name in ("prompt_ids", "output_ids"):
            ids = np.asarray(getattr(c, name)).reshape(-1)
            if ids.size and not np.issubdtype(ids.dtype, np.integer):  # would be truncated
                raise TypeError(
                    f"sequence {i}: {name} must be int token ids, got dtype {ids.dtype}"
                )
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
                raise ValueError(
                    f"sequence {i}: {name} holds token id {bad}, outside the vocabulary "
                    f"[0, {vocab_size})"
                )
        rows.append(
            (
                i,
                r,
                p,
                f,
                np.asarray(c.prompt_ids, np.int32).reshape(-1),
                np.asarray(c.output_ids, np.int32).reshape(-1),
            )
        )
    return pack_penalties(rows, b, min_history)


def _ragged_arange(lens):
    """[0..lens[0]), [0..lens[1]), ... concatenated."""
    ends = np.cumsum(lens)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - lens, lens)


def pack_copies(copies, c: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) [c] int32 page-copy arrays; padding pairs are (0, -1), which copy nothing."""
    src = np.zeros(c, np.int32)
    dst = np.full(c, -1, np.int32)
    if len(copies):
        pairs = np.asarray(copies, np.int32).reshape(-1, 2)
        src[: len(pairs)], dst[: len(pairs)] = pairs[:, 0], pairs[:, 1]
    return src, dst
