"""From a step's sampled tokens to finished requests: the engine's host-side results.

`OutputProcessor.apply` takes one step's tokens (or, for beam search, each beam's top
candidates) back from the device and applies them: it appends each sampled token (and,
when asked, its logprobs entry: `pagedjax.output_logprobs`) to its sequence, checks the
stop conditions (stop tokens, stop strings through an incremental detokenizer, length),
runs the beam selection (forking and dropping beams through the scheduler), and builds
the `RequestOutput` of every request that finished (`OutputProcessor.output`, from
`pagedjax.output_builder`); `new_request` builds a request's sequences with the state
that applying needs. The engine (`pagedjax.engine_core`) owns the step loop; this
module owns what a step's results mean.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from time import perf_counter
from typing import Any

import numpy as np

from pagedjax.beam import BeamSearch
from pagedjax.metrics import EngineMetrics
from pagedjax.output_builder import OutputBuilderMixin
from pagedjax.output_logprobs import LogprobsMixin, logprobs_entry
from pagedjax.request import (
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from pagedjax.scheduler import Scheduler
from pagedjax.sequence import SeqStatus, SequenceGroup, StepPlan
from pagedjax.sequence import Sequence as Seq

__all__ = ["OutputProcessor", "Request", "logprobs_entry"]


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """The engine's record of one request (`SequenceGroup.request`)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset
    group: SequenceGroup
    beam: BeamSearch | None
    arrival: float
    first_token: float | None = None
    # With prompt_logprobs: one entry per prompt token (None until computed; the first
    # token never has one), and how many are still to come.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_missing: int = 0
    # logit_bias / min_tokens / bad_words: (ids, values) arrays of its logit bias (bad
    # words of one token at -inf), and of that with every stop token banned (before
    # min_tokens tokens); None: no bias.
    bias: tuple[np.ndarray, np.ndarray] | None = None
    banned: tuple[np.ndarray, np.ndarray] | None = None
    # allowed_token_ids: its distinct ids, int32. bad_words: the token sequences of more
    # than one token (those of one token are banned in `bias` and `banned`).
    allowed: np.ndarray | None = None
    bad_words: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    # structured_outputs: the compiled guide (`pagedjax.guided.Guide`); each sequence
    # holds its state (`Sequence.guide_state`).
    guide: Any = None
    # output_kind DELTA: per completion index, the tokens and text characters returned.
    sent: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # The texts of its finished sequences (by seq_id): partial outputs repeat them.
    texts: dict[int, str] = dataclasses.field(default_factory=dict)
    lora_request: Any = None  # its `pagedjax.lora.LoRARequest`, or None


class OutputProcessor(LogprobsMixin, OutputBuilderMixin):
    """Applies steps' results to the scheduler's sequences and builds request outputs.

    Args:
      scheduler: the engine's; finished, forked and dropped sequences go through it.
      metrics: counts generated tokens and finished requests.
      detokenize: (generated ids, prompt ids, skip_special_tokens) -> the text the ids
        add after the prompt ("" without a tokenizer).
      seq_ids: the engine's sequence id counter (beam forks draw from it).
      tokenizer: names the logprobs entries' tokens (`Logprob.decoded_token`); None:
        no names.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        detokenize: Callable[[list[int], list[int], bool], str],
        seq_ids: itertools.count,
        tokenizer=None,
    ):
        self.scheduler = scheduler
        self.metrics = metrics
        self.detokenize = detokenize
        self.seq_ids = seq_ids
        self.tokenizer = tokenizer
        # Outputs of requests that finished in an `apply` that raised (see there): the
        # engine returns them from its next step.
        self.stranded: list[RequestOutput] = []

    def new_request(
        self,
        request_id: str,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
        stop_ids: frozenset,
        max_len: int,
        seeds: list[int],
        beam: BeamSearch | None,
        guide=None,
        *,
        arrival: float | None = None,
    ) -> Request:
        """The record of a new request, with its `SequenceGroup` (`Request.group`, to
        queue): `params.n` samples of `ids` (`seeds[i]` for sample i; all but the first
        forked off it once `ids[:-1]` is prefilled, when there is such a prefix), or the
        one sequence a `beam` search starts from; each finishes ("length") at `max_len`
        tokens. The sequences carry what applying their tokens needs (a detokenizer for
        stop strings, a logprobs list, the state of the structured outputs' `guide`).
        `arrival`: the `perf_counter()` time it arrived, which its time to first token
        and latency count from (None: now)."""
        p = len(ids)
        streams = params.output_kind != RequestOutputKind.FINAL_ONLY and params.detokenize

        def seq(i: int) -> Seq:
            s = Seq(next(self.seq_ids), list(ids), p, max_len, i, seeds[i])
            if params.stop or (streams and self.tokenizer is not None):
                # Stop strings match its text; partial outputs read it (not a decode of
                # every token each step, which grows with the completion).
                s.detok = self._decoder(params, ids, [])
            if params.logprobs is not None:
                s.logprobs = []
            if guide is not None:
                s.guide_state = guide.initial_state
            return s

        salt = params.cache_salt
        if beam is not None:
            group = SequenceGroup(request_id, [seq(0)], beam.width, salt, atomic=True)
        elif params.n > 1 and p > 1:
            forks = [seq(i) for i in range(1, params.n)]
            group = SequenceGroup(request_id, [seq(0)], params.n, salt, forks=forks)
        else:
            group = SequenceGroup(request_id, [seq(i) for i in range(params.n)], params.n, salt)
        arrival = perf_counter() if arrival is None else arrival
        req = Request(request_id, prompt, ids, params, stop_ids, group, beam, arrival)
        req.guide = guide
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * p
            req.prompt_logprobs_missing = p - 1
            group.read_prefix_cache = p == 1
        group.request = req
        return req

    def apply(self, plan: StepPlan, host, on_token=None) -> list[RequestOutput]:
        """Applies a finished step's tokens (or beam candidates) to its sequences.

        Args:
          plan: the step's plan (committed).
          host: its StepOutput's (tokens [B], logprobs [B], top_ids [B, k], top_logprobs
            [B, k], ranks [B], target_logprobs [T], target_top_ids [T, k'],
            target_top_logprobs [T, k'], target_ranks [T]) as numpy arrays (each but the
            first two None where the step has none; the last five may be left out).
          on_token: `on_token(request_id, completion_index, token_id)` per accepted token.

        Returns:
          The requests that finished in this step, then the partial outputs of those
          still running that got tokens in it and asked for them (`output_kind`).

        Anything that raises once the tokens are set (an on_token callback, a decode, a
        beam selection) propagates after the outputs of the requests that finished in
        this step are kept in `stranded` (`_strand`). A token whose stop checks raised
        (a Ctrl-C or a decode error in the detokenizer) is taken back first, whole
        (`_take_back_token`): a request the engine's recovery keeps samples it again.
        """
        tokens, logprobs, top_ids, top_lps, *rest = host
        ranks, *targets = rest or [None]
        if targets and targets[0] is not None:  # before the tokens: a request may finish
            self._prompt_logprobs(plan, *targets)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()  # Python scalars, at once
        now = perf_counter()
        running, final_only = SeqStatus.RUNNING, RequestOutputKind.FINAL_ONLY
        rows = [  # (`r.live`, inlined)
            i
            for i, r in enumerate(plan.rows)
            if r.samples
            and r.seq is not None
            and r.group.epoch == r.epoch
            and r.seq.status is running
        ]
        # Values of tokens an asynchronous commit already fed on (before any stop frees).
        self.scheduler.set_tokens([plan.rows[i].seq for i in rows], [tokens[i] for i in rows])
        beams: dict[int, list] = {}
        done: list[RequestOutput] = []
        partial: dict[int, tuple[Request, int]] = {}  # output_kind CUMULATIVE or DELTA
        parts: list[tuple[Request, RequestOutput]] = []  # their outputs
        try:
            for i in rows:
                r = plan.rows[i]
                s = r.seq
                if s.status is not running:
                    continue  # an on_token callback aborted the request
                s.pending -= 1
                g = r.group
                req = g.request
                if req.first_token is None:
                    req.first_token = now
                    self.metrics.record_first_token(len(req.prompt_ids), now - req.arrival)
                if req.beam is not None:
                    beam = (s, top_ids[i], top_lps[i])
                    beams.setdefault(id(g), [g, r.epoch]).append(beam)
                    continue
                tok, lp = tokens[i], logprobs[i]
                if s.logprobs is not None:  # (`_token_logprobs` adds nothing otherwise)
                    self._token_logprobs(req, s, tok, lp, top_ids, top_lps, ranks, i)
                self._accept(req, s, tok, lp, on_token)
                if g.done and g.epoch == r.epoch:  # finished, not aborted
                    done.append(self._finish(req, now))
                elif req.params.output_kind != final_only:
                    partial[id(g)] = req, r.epoch
            for g, epoch, *results in beams.values():
                if g.epoch != epoch:  # an on_token callback aborted it: its abort returned
                    continue  # its last output (a selection would fork off freed beams)
                if self._beam_step(g.request, results):
                    done.append(self._finish(g.request, now))
            for req, epoch in partial.values():
                # (not if a later row finished it, or an on_token callback aborted it: its
                # abort returned its last output)
                if not req.group.done and req.group.epoch == epoch:
                    parts.append((req, self.output(req, aborted=False, now=now, running=True)))
        except BaseException as e:
            self._strand(plan, rows, done, parts, now, e)
            raise
        return done + [out for _, out in parts]

    def _strand(
        self,
        plan: StepPlan,
        rows: list[int],
        done: list[RequestOutput],
        parts: list[tuple[Request, RequestOutput]],
        now: float,
        error: BaseException,
    ) -> None:
        """Keeps, in `stranded`, the outputs of the requests that finished in an `apply`
        that raised (`error`: an on_token callback's, a Ctrl-C, a decode error): they have
        left the scheduler, so the engine's recovery would not see them. Those not built
        yet (the one it raised on included) are built now, without text where that
        raises again (noted on `error`). The partial outputs built (`parts`) go unreturned:
        their requests are aborted or recomputed."""
        for req, out in parts:
            self.take_back(req, out)
        told = {o.request_id for o in done}
        textless = []
        for r in (plan.rows[i] for i in rows):
            g = r.group
            if g.done and g.epoch == r.epoch and g.request_id not in told:
                told.add(g.request_id)
                try:
                    done.append(self._finish(g.request, now))
                except BaseException as again:
                    textless.append((g.request_id, again))
                    out = self.output(g.request, aborted=False, now=now, with_text=False)
                    self.metrics.record_request(
                        out.latency_s, [c.finish_reason for c in out.outputs]
                    )  # (as `_finish` would have: it finished)
                    done.append(out)
        self.stranded += done
        if textless:
            ids = [i for i, _ in textless]
            error.add_note(
                f"pagedjax: the outputs of {len(ids)} request(s) {ids[:8]} that finished in "
                f"the failed step have no text (building it raised {textless[0][1]!r})"
            )

    def _accept(self, req: Request, s: Seq, tok: int, lp: float, on_token) -> None:
        guide, state = req.guide, None
        if guide is not None and not (
            tok in req.stop_ids and s.num_generated + 1 >= req.params.min_tokens
        ):
            if not guide.allows(s.guide_state, tok):
                # The row's other constraints (allowed_token_ids, bad_words, min_tokens'
                # ban of a stop token that is text) banned every token the guide allows:
                # the draw fell outside them. The completion ends before it, short of a
                # match: "error", as vLLM's when its grammar cannot take the token.
                if s.logprobs is not None:
                    s.logprobs.pop()
                self.scheduler.finish(req.group, s, "error")
                return
            state = guide.advance(s.guide_state, tok)
        n = len(s.token_ids)
        undo = s.guide_state, s.cumulative_logprob, s.stop_pos, self.metrics.generated_tokens
        try:
            s.token_ids.append(tok)
            if state is not None:
                s.guide_state = state
            s.cumulative_logprob += lp
            self.metrics.generated_tokens += 1
            reason, stop = self._stop(req, s, tok)
        except BaseException as e:
            # (a Ctrl-C or a decode error in the detokenizer, before the stop checks
            # decided): the token is taken back whole, so that a request the recovery
            # keeps samples it again and checks it. (It stayed, unchecked: the request
            # ran past its stop.)
            self._take_back_token(req, s, n, undo, e)
            raise
        try:
            if on_token is not None:
                on_token(req.request_id, s.index, tok)
        finally:
            # After the callback, which may look the sequence up among the running ones
            # (`EngineThread` reads its logprobs entry), and also when it raised: a
            # request the engine's recovery keeps must not run past its stop.
            if reason is not None and s.status is SeqStatus.RUNNING:  # (not aborted by it)
                self.scheduler.finish(req.group, s, reason, stop)

    def _take_back_token(self, req: Request, s: Seq, n: int, undo: tuple, error) -> None:
        """Undoes `_accept`'s token for `s` (`n` tokens before it; `undo`: its guide state,
        cumulative logprob and stop position, and the generated-token count, before it)
        and the logprobs entry of it, and rebuilds its detokenizer, which may hold the
        token or be half updated. What fails here is noted on `error`."""
        del s.token_ids[n:]
        s.page_hashes = None  # (an in-place edit: `Sequence.page_hashes`)
        s.guide_state, s.cumulative_logprob, s.stop_pos, self.metrics.generated_tokens = undo
        if s.logprobs is not None:
            del s.logprobs[s.num_generated :]
        if s.detok is not None:
            try:
                s.detok = self._decoder(
                    req.params, req.prompt_ids, s.token_ids[s.num_prompt_tokens :]
                )
            except BaseException as again:
                error.add_note(
                    f"pagedjax: request {req.request_id!r}'s detokenizer was not rebuilt "
                    f"({again!r}): its text may be wrong if it goes on"
                )

    def _decoder(self, params: SamplingParams, prompt_ids: list[int], generated: list[int]):
        """A sequence's incremental detokenizer, `generated` added (`Tokenizer.stream`)."""
        d = self.tokenizer.stream(
            skip_special_tokens=params.skip_special_tokens, context=prompt_ids
        )
        if generated:
            d.add(generated)
        return d

    def _stop(self, req: Request, s: Seq, tok: int) -> tuple[str | None, int | str | None]:
        """Whether the sequence ends with its new token `tok`: (finish reason, stop reason),
        or (None, None). Feeds the token to its detokenizer, and records where a stop
        string it completed starts (`Sequence.stop_pos`)."""
        stop, m = None, req.params.min_tokens
        if tok in req.stop_ids and s.num_generated >= m:  # (not drawn before token m + 1)
            return "stop", tok
        if s.detok is not None:
            # As vLLM: the first min_tokens tokens' text is not searched, so a stop string
            # ends a completion from its token min_tokens + 1 on, as a stop token does.
            search = req.params.stop and s.num_generated > m
            # (`pending` is read only then: in a byte run it costs a decode of the run)
            old, held = len(s.detok.text), s.detok.pending.rstrip("\ufffd") if search else ""
            s.detok.add(tok)
            if search:
                stop = self._stop_string(req, s, old, held)
        if stop is not None:
            return "stop", stop
        if req.guide is not None and not req.guide.can_continue(s.guide_state):
            return "stop", None  # the match is complete (`Guide`: no token leads nowhere)
        if len(s.token_ids) >= s.max_num_tokens:
            return "length", None
        return None, None

    def _stop_string(self, req: Request, s: Seq, old: int, held: str) -> str | None:
        """The stop string the last token completed, if any (setting `s.stop_pos`), given
        the length of the detokenizer's text before the token and what it held back."""
        # The text if it stopped here (it would): all of decode(ids), the run of byte
        # tokens the decoder holds back too, less an incomplete last character; from
        # `base` on, the part a new occurrence can overlap (not the whole text a token).
        base = max(0, old - max(map(len, req.params.stop)) + 1)
        tail = (s.detok.text[base:] + s.detok.pending).rstrip("\ufffd")
        # Only an occurrence that ends past what this text shares with the previous
        # token's: that was searched already, or min_tokens let its occurrences through.
        old -= base
        if held:
            old += len(os.path.commonprefix([held, tail[old:]]))
        if len(tail) <= old:
            return None
        # Of several, the first completed wins (ending first, then starting first): what
        # a check after every character would stop on, so neither how the text splits
        # into tokens nor the list's order changes the cut.
        hits = []
        for x in req.params.stop:
            i = tail.find(x, max(0, old - len(x) + 1))
            if i >= 0:
                hits.append((i + len(x), i, x))
        if not hits:
            return None
        _, i, stop = min(hits, key=lambda h: h[:2])
        s.stop_pos = base + i
        return stop

    def _beam_step(self, req: Request, results) -> bool:
        """One beam-search selection; forks and frees beams. True when the search ended."""
        g, bs = req.group, req.beam
        seqs = [s for s, _, _ in results]
        p = len(req.prompt_ids)
        self.metrics.generated_tokens += len(seqs)
        top_ids = np.stack([x for _, x, _ in results])
        top_lps = np.stack([x for _, _, x in results])
        k = req.params.logprobs

        # (before the selection appends to the beams)
        names = [] if k is None else [self._names(req, s.token_ids, len(s.token_ids)) for s in seqs]

        def entry(b: int, j: int) -> dict:  # candidate j of beam b: the step's top-k's j-th
            tok, lp = int(top_ids[b, j]), float(top_lps[b, j])
            return logprobs_entry(tok, lp, k, top_ids, top_lps, b, rank=j + 1, names=names[b])

        kept = None if k is None else [s.logprobs for s in seqs]
        new = bs.select(
            [s.token_ids[p:] for s in seqs],
            [s.cumulative_logprob for s in seqs],
            top_ids,
            top_lps,
            kept,
            entry,
        )
        if not new:
            for s in list(g.seqs):
                self.scheduler.drop(g, s)
            return True
        picks: dict[int, list[tuple[int, float, int, int]]] = {}
        for rank, (b, tok, total, j) in enumerate(new):
            picks.setdefault(b, []).append((tok, total, j, rank))
        ranks: dict[int, int] = {}  # id(seq) -> its beam's rank in this selection
        for b, parent in enumerate(seqs):
            for tok, total, j, rank in picks.get(b, [])[1:]:
                child = Seq(
                    next(self.seq_ids),
                    [*parent.token_ids, tok],
                    p,
                    parent.max_num_tokens,
                    0,
                    parent.seed,
                    cumulative_logprob=total,
                    logprobs=None if k is None else [*parent.logprobs, entry(b, j)],
                )
                self.scheduler.fork(g, parent, child)
                ranks[id(child)] = rank
            if b in picks:
                tok, total, j, ranks[id(parent)] = picks[b][0]
                parent.token_ids.append(tok)
                parent.cumulative_logprob = total
                if k is not None:
                    parent.logprobs.append(entry(b, j))
        for b, parent in enumerate(seqs):
            if b not in picks:
                self.scheduler.drop(g, parent)
        # The next step's beam order (the scheduler binds beam rows in the group's order,
        # and ties go to the lower beam index): best first, as the selection ranked them
        # (HF's, the oracle's), not surviving parents first and forks after them.
        g.seqs.sort(key=lambda s: ranks.get(id(s), len(new)))
        return False

    def _finish(self, req: Request, now: float) -> RequestOutput:
        out = self.output(req, aborted=False, now=now)
        self.metrics.record_request(out.latency_s, [c.finish_reason for c in out.outputs])
        return out
