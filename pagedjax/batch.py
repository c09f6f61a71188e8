"""Packing a `StepPlan` into a `decode.StepInput`, in the engine's two phases.

`StepBatch(plan, ...)` runs right after `Scheduler.schedule()`, while the device may
still run the previous step: it sizes the batch (bucketed like
`decode.build_step_input`) and packs every prefill row, every per-row sampling
parameter, and the decode rows' page tables as the block manager holds them now.
`finish(plan)` runs after `Scheduler.commit()`: it fills what the commit decided for
the decode rows (token id, position, slot), whose tokens were not known before (rows
committed while their token is still on the device get `token_src`, the row of the
previous step's output to take it from). The
commit's append changes at most one entry of a decode row's page table, the page that
holds the new token (a new page, or a copy of a shared one), so `finish` writes that
entry from the slot; beam rows, whose sequences are bound in the commit, get whole
tables there. Row i of the batch is `plan.rows[i]`; a dead decode row keeps slot -1
(writes nothing).

No validation here: the engine's rows are valid by construction (prompts are checked
when they are added); `decode.build_step_input` is the validating builder for steps
built by hand.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax import decode
from pagedjax.beam import num_candidates
from pagedjax.blocks import BlockManager
from pagedjax.guided import Guide, compile_guide
from pagedjax.planner import logprob_columns
from pagedjax.request import encode_bad_words
from pagedjax.sequence import StepPlan
from pagedjax.step_input import pack_bias, pack_copies, pack_penalties

__all__ = [
    "Constraints",
    "StepBatch",
    "TokenHistory",
    "bad_word_bans",
    "guide_mask",
    "request_allowed",
    "request_bias",
    "request_constraints",
]

_NO_BIAS = (np.zeros(0, np.int32), np.zeros(0, np.float32))


class TokenHistory:
    """A numpy copy of a sequence's `token_ids` that follows its appends, so that a
    penalised row's history costs one array copy per step, not a list conversion."""

    __slots__ = ("buf", "n")

    def __init__(self):
        self.buf = np.zeros(0, np.int32)
        self.n = 0

    def sync(self, ids: list[int]) -> np.ndarray:
        """`ids` as an int32 array (a view; valid until the next sync)."""
        m = len(ids)
        if m > self.buf.size:
            buf = np.zeros(max(2 * self.buf.size, m, 64), np.int32)
            buf[: self.n] = self.buf[: self.n]
            self.buf = buf
        if m < self.n:  # not an append (not expected): copy it whole
            self.n = 0
        self.buf[self.n : m] = ids[self.n : m]
        self.n = m
        return self.buf[:m]


class StepBatch:
    """A plan's `StepInput` arrays: prefill rows packed now, decode rows in `finish`.

    Args:
      plan: from `Scheduler.schedule()`, not yet committed; at least one row.
      buckets: padding floors.
      page_size: tokens per page.
      vocab_size: caps the top-k candidates per row (beam search, logprobs).
      block_manager: the scheduler's; read for the decode rows' page tables.
      lora_slots: with LoRA enabled, {adapter id: device slot} of the plan's groups
        (`LoRASlots.prepare`): every token gets its group's slot (`StepInput.lora_slots`).
    """

    def __init__(
        self,
        plan: StepPlan,
        buckets: decode.Buckets,
        page_size: int,
        vocab_size: int,
        block_manager: BlockManager,
        lora_slots: dict[int, int] | None = None,
    ):
        rows, bk, ps = plan.rows, buckets, page_size
        self.page_size, self.bm = ps, block_manager
        n = len(rows)
        q_lens = [r.num_tokens for r in rows]
        self.decode = q_lens.count(1) == n
        total = sum(q_lens)
        b = decode.bucket_size(n, bk.min_seqs)
        t = b if self.decode else decode.bucket_size(total, bk.min_tokens)
        width = max(len(r.page_row) if not r.decode else r.start // ps + 1 for r in rows)
        width = decode.bucket_size(width, bk.min_pages)
        self.min_copies, self.min_history = bk.min_copies, bk.min_history
        self.token_ids = np.zeros(t, np.int32)
        self.positions = np.zeros(t, np.int32)
        self.slot_mapping = np.full(t, -1, np.int32)
        self.page_table = np.zeros((b, width), np.int32)
        self.starts = np.zeros(b + 1, np.int32)
        self.context_lens = np.zeros(b, np.int32)
        self.temperature = np.zeros(b, np.float32)
        self.top_k = np.zeros(b, np.int32)
        self.top_p = np.ones(b, np.float32)
        self.min_p = np.zeros(b, np.float32)
        self.seeds = np.zeros(b, np.uint32)
        self.steps = np.zeros(b, np.int32)
        self.top_k_needed = 0
        self.target_ids = None  # [T] int32 once a row wants prompt logprobs
        self.token_src = np.full(t, -1, np.int32)
        self.lora_slots = None
        if lora_slots is not None:
            per_row = [lora_slots[r.group.lora_id] for r in rows]
            self.lora_slots = np.zeros(t, np.int32)
            self.lora_slots[:total] = np.repeat(per_row, q_lens)
        self.prompt_top_k = 0
        self.penalised = []  # rows with penalties, packed in `finish` (histories grow)
        # Rows with a logit bias, min_tokens, allowed_token_ids, bad_words or structured
        # outputs, packed in `finish` (a bad word's ban and a guide's tokens depend on the
        # tokens before).
        self.biased = []
        # Per-row values go through Python lists and one numpy assignment each: a numpy
        # scalar store costs about as much as building the list entry, so at B=256 this
        # halves the packing time.
        starts, ctx, sampled, decoding, decoding_ids = [], [], [], [], []
        values, seeds, steps = [], [], []  # values: (temperature, top_k, top_p, min_p)
        # Per SamplingParams (rows of one request, often of one `generate` call, share
        # it; frozen params): its values, whether it has penalties, and constraints of
        # its own; its logprobs are counted in `top_k_needed` when it is first seen.
        flags: dict[int, tuple[tuple, bool, bool]] = {}
        off = 0
        for i, r in enumerate(rows):
            starts.append(off)
            q = r.num_tokens
            ctx.append(r.start + q)
            g = r.group
            if g.atomic:
                w = g.request.params.beam_width
                k = num_candidates(w, len(g.request.stop_ids))
                self.top_k_needed = max(self.top_k_needed, k, g.request.params.logprobs or 0)
            elif r.samples:
                req = g.request
                params = req.params
                f = flags.get(id(params))
                if f is None:
                    own = params.allowed_token_ids is not None or bool(params.bad_words)
                    f = flags[id(params)] = (
                        (params.temperature, params.top_k, params.top_p, params.min_p),
                        params.penalised,
                        own,
                    )
                    if params.logprobs is not None:  # (logprobs=0: the smallest top-k's
                        # step still computes the token's rank)
                        self.top_k_needed = max(self.top_k_needed, params.logprobs, 1)
                sampled.append(i)
                values.append(f[0])
                if f[1]:
                    self.penalised.append(i)
                if f[2] or req.banned is not None or req.guide is not None:
                    self.biased.append(i)
                seeds.append(r.seq.seed)
                steps.append(r.start + q - r.seq.num_prompt_tokens)
            if r.decode:
                if not g.atomic:
                    decoding.append(i)
                    decoding_ids.append(r.seq.seq_id)
            else:
                self.positions[off : off + q] = np.arange(r.start, r.start + q)
                self.token_ids[off : off + q] = r.seq.token_ids[r.start : r.start + q]
                self.slot_mapping[off : off + q] = r.slots
                self.page_table[i, : len(r.page_row)] = r.page_row
                if r.group.request.prompt_logprobs_missing:
                    self._add_targets(r, off, t)
            off += q
        if decoding:  # tables before this step's append (finish sets the new entry)
            tables = block_manager.page_tables(decoding_ids)
            self.page_table[decoding, : tables.shape[1]] = tables
        self.starts[:n] = starts
        self.starts[n:] = off
        self.context_lens[:n] = ctx
        if sampled:
            sampled = np.array(sampled)  # (once: each store would convert the list again)
            temp, top_k, top_p, min_p = zip(*values, strict=True)  # (columns, at C speed)
            with np.errstate(over="ignore"):  # past float32: +inf (sampling.sample)
                self.temperature[sampled] = temp
            self.top_k[sampled] = top_k
            self.top_p[sampled] = top_p
            self.min_p[sampled] = min_p
            self.seeds[sampled] = seeds
            self.steps[sampled] = steps
        self.logits_indices = np.zeros(b, np.int32)
        self.logits_indices[:n] = self.starts[1 : n + 1] - 1
        self.vocab = vocab_size

    def _add_targets(self, r, off: int, t: int) -> None:
        """Prompt logprobs: each fed position whose next token is a prompt token scores it."""
        end = min(r.start + r.num_tokens, r.seq.num_prompt_tokens - 1)
        if end <= r.start:
            return
        if self.target_ids is None:
            self.target_ids = np.full(t, -1, np.int32)
        self.target_ids[off : off + end - r.start] = r.seq.token_ids[r.start + 1 : end + 1]
        k = r.group.request.params.prompt_logprobs
        self.prompt_top_k = max(self.prompt_top_k, k)

    def finish(
        self, plan: StepPlan, feed=None, prev: StepPlan | None = None
    ) -> tuple[decode.StepInput, int, int]:
        """Fills the committed decode rows; returns the StepInput and the top-k counts of
        the sampled rows and of the prompt-logprob targets.

        Args:
          plan: the plan, committed.
          feed: the previous step's `StepOutput.feed` (or the engine's initial one); None
            builds a StepInput without it.
          prev: the previous step's plan, for rows whose token is still on the device
            (`ScheduledRow.feed`): they take it from `feed` at that step's row.
        """
        idx, toks, pos, slots, sampled, seeds, steps = [], [], [], [], [], [], []
        beam_rows, beam_ids, fed, fed_from = [], [], [], []
        where = None
        for i, r in enumerate(plan.rows):
            if not r.decode or r.seq is None:
                continue
            s = r.seq
            idx.append(i)
            if r.feed:
                if where is None:
                    where = {id(q.seq): j for j, q in enumerate(prev.rows) if q.samples}
                toks.append(0)
                fed.append(i)
                fed_from.append(where[id(s)])
            else:
                toks.append(s.token_ids[r.start])
            pos.append(r.start)
            slots.append(r.slots[0])
            if r.group.atomic:
                beam_rows.append(i)
                beam_ids.append(s.seq_id)
            else:
                sampled.append(i)
                seeds.append(s.seed)
                steps.append(r.start + 1 - s.num_prompt_tokens)  # index of the token drawn
        if beam_rows:  # sequences bound in the commit: whole tables, after the append
            tables = self.bm.page_tables(beam_ids)
            self.page_table[beam_rows] = 0
            self.page_table[beam_rows, : tables.shape[1]] = tables
        if idx:
            idx = np.array(idx)  # (once: each indexing would convert the list again)
            offs = self.starts[idx]
            pos_arr = np.asarray(pos, np.int32)
            slot_arr = np.asarray(slots, np.int32)
            self.token_ids[offs] = toks
            self.positions[offs] = pos_arr
            self.slot_mapping[offs] = slot_arr
            self.context_lens[idx] = pos_arr + 1
            # The page that holds the new token: new, copied, or the same as before.
            self.page_table[idx, pos_arr // self.page_size] = slot_arr // self.page_size
            if sampled:
                sampled = np.array(sampled)
                self.seeds[sampled] = seeds
                self.steps[sampled] = steps
        if fed:
            self.token_src[self.starts[fed]] = fed_from
        k = pk = 0
        if self.top_k_needed:  # (padded as the step reserve counts them)
            k = logprob_columns(self.top_k_needed, self.vocab)
        if self.prompt_top_k:
            pk = logprob_columns(self.prompt_top_k, self.vocab)
        src, dst = pack_copies(plan.copies, decode.bucket_size(len(plan.copies), self.min_copies))
        penalties = self._penalties(plan) if self.penalised else None
        bias = self._bias(plan) if self.biased else None
        inp = decode.StepInput(
            token_ids=self.token_ids,
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            page_table=self.page_table,
            context_lens=self.context_lens,
            query_start_loc=self.starts,
            logits_indices=self.logits_indices,
            copy_src=src,
            copy_dst=dst,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            penalties=penalties,
            logit_bias=bias,
            seeds=self.seeds,
            sample_steps=self.steps,
            target_ids=self.target_ids,
            token_src=None if feed is None else self.token_src,
            feed=feed,
            lora_slots=self.lora_slots,
            decode=self.decode,
            page_size=self.page_size,
            num_pages=self.bm.num_pages,
        )
        return inp, k, pk

    def _penalties(self, plan: StepPlan):
        """The penalised rows' histories as the host knows them after the commit: the
        prompt and the generated tokens, less a decode row's fed token (in flight: the
        step adds it on the device)."""
        rows = []
        for i in self.penalised:
            r = plan.rows[i]
            s = r.seq
            if s is None:
                continue
            p = r.group.request.params
            n = s.num_prompt_tokens
            if s.history is None:
                s.history = TokenHistory()
            ids = s.history.sync(s.token_ids)
            rows.append(
                (i, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, ids[:n], ids[n:])
            )
        return pack_penalties(rows, len(self.temperature), self.min_history)

    def _bias(self, plan: StepPlan):
        """The biased rows' logit bias (with the stop tokens banned for rows that draw one
        of their first min_tokens tokens), the bans of their bad words of several tokens
        (`bad_word_bans`), their allowed tokens and their guides' masks (`guide_mask`)."""
        rows = []
        for i in self.biased:
            r = plan.rows[i]
            s = r.seq
            if s is None:
                continue
            req = r.group.request
            p = req.params
            arrays = req.banned if self.steps[i] < p.min_tokens else req.bias
            ids, values = _NO_BIAS if arrays is None else arrays
            after = None
            if p.bad_words:
                last = r.start + r.num_tokens - 1
                pairs = bad_word_bans(req.bad_words, s.token_ids, last, s.num_prompt_tokens)
                if pairs:
                    prev, banned = np.array(pairs, np.int32).T
                    after = np.concatenate([np.full(len(ids), -1, np.int32), prev])
                    ids = np.concatenate([ids, banned])
                    values = np.concatenate([values, np.full(len(banned), -np.inf, np.float32)])
            allowed = req.allowed if p.allowed_token_ids is not None else None
            mask = None
            if req.guide is not None:  # (the engine runs such a row's step synchronously:
                # the state has every token before it)
                mask = guide_mask(req.guide, s.guide_state, req.stop_ids)
            if len(ids) or allowed is not None or mask is not None:
                rows.append((i, ids, values, after, allowed, mask))
        return pack_bias(rows, len(self.temperature))


def guide_mask(guide, state: int, stop_ids) -> np.ndarray:
    """The bitmask of the tokens a structured output's `guide` (`pagedjax.guided.Guide`)
    allows in `state`: those that keep its match alive, and the stop tokens once the
    text so far is a full match. Before it, no stop token: one whose text could go on
    the match (`stop_token_ids=[id of "q"]`) would end the completion short of it."""
    mask = guide.allowed(state)
    accepting = guide.accepting(state)
    copied = False
    for t in stop_ids:
        if t >= guide.vocab_size:
            continue
        word, bit = t // 32, np.uint32(1 << (t % 32))
        if bool(mask[word] & bit) != accepting:
            if not copied:
                mask, copied = mask.copy(), True
            mask[word] ^= bit
    return mask


def bad_word_bans(
    words: list[tuple[int, ...]], token_ids: list[int], last: int, num_prompt: int
) -> list[tuple[int, int]]:
    """(previous token, banned token) pairs of a sequence's bad words of several tokens
    for the token after position `last`, as vLLM's: a word w bans w[-1] where the
    generated tokens (not the prompt) end with w[:-1].

    The host checks w[:-2] against the tokens before `last`; the device checks w[-2]
    against the token at `last` (`LogitBias.after`), which may still be on the device
    (`token_ids` may end before it).
    """
    generated = last - num_prompt  # generated tokens before `last` (< 0: it is a prompt token)
    out = []
    for w in words:
        k = len(w) - 2
        if k <= generated and (k == 0 or tuple(token_ids[last - k : last]) == w[:-2]):
            out.append((w[-2], w[-1]))
    return out


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What a request's rows are packed with beyond their sampling values (the fields of
    `outputs.Request` of those names): `bias` and `banned` (`request_bias`), `allowed`
    (`request_allowed`), its `bad_words` of several tokens, and its structured outputs'
    `guide`."""

    bias: tuple[np.ndarray, np.ndarray] | None = None
    banned: tuple[np.ndarray, np.ndarray] | None = None
    allowed: np.ndarray | None = None
    bad_words: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    guide: Guide | None = None


def request_constraints(
    params, stop_ids, tokenizer, vocab_size: int, min_tokens_bans=None
) -> Constraints:
    """The `Constraints` of a request of `params` that stops on `stop_ids`, for a model
    of `vocab_size` ids and its `tokenizer` (or None); `min_tokens_bans`: the tokens
    min_tokens keeps from being drawn (None: `stop_ids`; the engine gives EOS with them
    even under ignore_eos, as vLLM's all_stop_token_ids). ValueError naming what cannot
    be enforced: bad words or structured outputs without a tokenizer, ids outside the
    vocabulary, allowed_token_ids that leave nothing to draw, a structured output no
    token of the vocabulary can begin."""
    guide = None
    if params.structured_outputs is not None:
        if tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model has none")
        guide = compile_guide(params.structured_outputs, tokenizer, vocab_size)
        start = guide.initial_state  # (a vocabulary that cannot spell every byte may fail)
        if not guide.can_continue(start) and not (guide.accepting(start) and stop_ids):
            raise ValueError(
                "structured_outputs: no token of this vocabulary can begin a match of "
                f"{guide.pattern!r:.80}"
            )
    words = encode_bad_words(params.bad_words, tokenizer, vocab_size) if params.bad_words else []
    ones = [w[0] for w in words if len(w) == 1]  # banned everywhere: in the bias
    bans = stop_ids if min_tokens_bans is None else min_tokens_bans
    bias, banned = request_bias(params, bans, vocab_size, ones)
    allowed = request_allowed(params, bans, vocab_size, ones)
    return Constraints(bias, banned, allowed, [w for w in words if len(w) > 1], guide)


def request_bias(params, stop_ids, vocab_size: int, bans=()):
    """A request's (bias, banned) arrays (see `outputs.Request`), or (None, None) when
    it has no logit bias, no min_tokens and no `bans` (tokens never drawn: its bad words
    of one token); ValueError for logit bias ids outside the vocabulary."""
    bias = dict(params.logit_bias or {})
    if not bias and not params.min_tokens and not bans:
        return None, None
    bad = [t for t in bias if t >= vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    bias |= dict.fromkeys(bans, float("-inf"))

    def arrays(d):
        if not d:
            return None
        return np.fromiter(d, np.int32, len(d)), np.fromiter(d.values(), np.float32, len(d))

    # A stop id outside the vocabulary is never sampled: nothing to ban (and it may not
    # fit the int32 arrays).
    stops = (t for t in stop_ids if t < vocab_size)
    return arrays(bias), arrays(bias | dict.fromkeys(stops, float("-inf")))


def request_allowed(params, stop_ids, vocab_size: int, bans=()) -> np.ndarray | None:
    """A request's allowed_token_ids as distinct int32 ids, or None without them.

    Raises:
      ValueError: ids outside the vocabulary, or none left to draw once `bans` (its bad
        words of one token) and, with min_tokens, its stop tokens are taken out.
    """
    ids = params.allowed_token_ids
    if ids is None:
        return None
    bad = sorted({t for t in ids if t >= vocab_size})
    if bad:
        raise ValueError(
            f"allowed_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    distinct = set(ids)
    m = params.min_tokens
    if not distinct - set(bans) - (set(stop_ids) if m else set()):
        stops = f" or, before min_tokens={m}, a stop token" if m else ""
        raise ValueError(
            f"allowed_token_ids={sorted(distinct)[:8]} leave no token to draw: each is a "
            f"bad word{stops}"
        )
    return np.array(sorted(distinct), np.int32)
