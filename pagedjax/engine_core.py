"""The engine's step loop: plan, pack, dispatch, apply, with the host overlapping the device.

`EngineCore.step` runs one engine step over the `Scheduler`: `StepBatch`
(`pagedjax.batch`) packs its plan for the jitted `decode.prefill_step` /
`decode.decode_step` (KV cache donated), and `OutputProcessor` (`pagedjax.outputs`)
applies the sampled tokens. `pagedjax.engine.LLM` is the front that queues requests
and collects their outputs.

Host overlap. JAX dispatch is asynchronous, so each step runs:

1. `scheduler.schedule()` and the packing of every prefill row (token ids, positions,
   slots, page tables, sampling parameters): planning step N+1 while the device still
   runs step N;
2. `scheduler.commit(in_flight=True)` appends the decode rows' tokens before step N's
   tokens are known (their slots reserved, their values on the device), fills the
   decode rows (position, slot, page table, and `token_src`: the row of step N's
   output each takes its token from) and dispatches step N+1;
3. only then it blocks on step N's sampled tokens and applies them (stop checks,
   logprobs, the block manager's token values), while the device runs step N+1.

So the device runs step after step while the host works (`async_scheduling=True`, the
default). A sequence that stops on step N's token has a row in step N+1 that computes
one token for nothing; its output is ignored. Beam search needs step N's selection to
bind its rows, and a structured output's row needs step N's token for its mask: a plan
with such decode rows, and every step with `async_scheduling=False`, applies step N's
tokens first (3 before 2; the device idles meanwhile), and a decode row whose sequence
finished in them stays in the batch as a dead row (it writes nothing), so phase 1's
layout never has to change. `metrics` times the parts of every step.

Failures: an exception escaping a step (a compile error, device OOM,
KeyboardInterrupt, an `on_token` callback's) aborts the requests (on a
KeyboardInterrupt, those given: the others are recomputed), re-creates the KV cache if
the failed call took the donated one with it, keeps the prefix cache only where its
pages were written, and propagates unchanged: the engine stays usable
(`pagedjax.recovery`). Requests that finished in the failed step before applying its
tokens raised (an `on_token` callback, a decode, a beam selection), or in the tokens it
applied before it failed (in its commit, its dispatch, its bookkeeping), are not lost:
the next step returns their outputs (unless they are among those given, whose caller
gets the exception), without text where building it failed again. The caches are made
consistent before the aborted requests' outputs are built: one that fails to build
goes without text, and nothing it raises stops the recovery (a note says what failed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from time import perf_counter

import jax
import numpy as np

from pagedjax import decode, recovery, sharding
from pagedjax.batch import StepBatch
from pagedjax.cache import PagedKVCache
from pagedjax.config import CacheConfig, ModelConfig
from pagedjax.lora_engine import LoRASlots
from pagedjax.metrics import EngineMetrics, StepRecord
from pagedjax.model import Params
from pagedjax.outputs import OutputProcessor
from pagedjax.request import RequestOutput
from pagedjax.scheduler import Scheduler
from pagedjax.sequence import SequenceGroup, StepPlan

__all__ = ["EngineCore"]


def _sync(row) -> bool:
    """Whether a row needs the previous step's tokens applied before its step is packed:
    a beam's (the selection binds it) or a structured output's decode row (its guide's
    mask follows its last token)."""
    return row.decode and (row.group.atomic or row.group.request.guide is not None)


class EngineCore:
    """Runs engine steps over a scheduler's requests (see the module docstring).

    Args:
      model_config, params: the model (params may be sharded: `params.mesh`).
      cache_config: the KV cache's geometry; the core creates the cache (`cache`) and
        re-creates it when a failed step loses it.
      scheduler: plans the steps; its block manager holds the page tables.
      outputs: applies each step's tokens and builds the outputs.
      metrics: records each step.
      backend, interpret, buckets: as `decode.prefill_step` / `decode.decode_step` and
        `StepBatch` take them.
      async_scheduling: dispatch each step before the previous one's tokens reach the
        host (see the module docstring).
      on_finish: called with the output of every request that finishes or is aborted
        (before `step` or `aborted` returns it).
      lora: the LoRA adapters (`pagedjax.lora_engine.LoRASlots`) with LoRA enabled, else None:
        each step with adapters puts them in device slots and runs with them; a step with
        none runs without LoRA (the base model's program).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        params: Params,
        cache_config: CacheConfig,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        metrics: EngineMetrics,
        *,
        backend: str,
        interpret: bool,
        buckets: decode.Buckets,
        async_scheduling: bool,
        on_finish: Callable[[RequestOutput], None],
        lora: LoRASlots | None = None,
    ):
        self.model_config, self.params, self.cache_config = model_config, params, cache_config
        self.scheduler, self.block_manager = scheduler, scheduler.bm
        self.outputs, self.metrics = outputs, metrics
        self.backend, self.interpret, self.buckets = backend, interpret, buckets
        self.async_scheduling = async_scheduling
        self._on_finish = on_finish
        self.lora = lora
        # Where the cache and the feed are committed without a mesh: the model's device.
        self._device = sharding.home_device(params)
        self.cache = self._new_cache()
        # The previous step's sampled tokens, on the device, for rows that feed them.
        self._feed = self._new_feed()
        # The dispatched step whose tokens are not applied yet: (plan, result arrays, record).
        self.inflight: tuple[StepPlan, tuple, StepRecord] | None = None
        self._idle_steps = 0
        # Outputs of requests that finished in a step that then failed (while applying
        # its tokens: an `on_token` callback, a decode): the next step returns them first.
        self._carried: list[RequestOutput] = []
        # `LLM.pause_generation` until `resume_generation`: steps schedule nothing.
        self.paused = False
        # Inside `step` or `drain`, whose callbacks (`on_token`, `on_finish`) run with the
        # step half applied: another step there is refused (`check_outside_step`).
        self.stepping = False

    @property
    def busy(self) -> bool:
        """Whether `step` has more to do: requests queued or running, a step in flight,
        or outputs carried over from a failed step."""
        return self.scheduler.has_unfinished() or self.inflight is not None or bool(self._carried)

    def carried_ids(self) -> set[str]:
        """The request ids of the outputs carried over from a failed step (the next
        `step` returns them): `LLM.add_request` draws none of them for a new request."""
        return {o.request_id for o in self._carried}

    def aborted(self, g: SequenceGroup) -> RequestOutput:
        """The partial output of a group the scheduler gave up (`Scheduler.abort`; those
        of `recover` go through `_tell_aborted`): every sequence finishes with "abort"."""
        for s in g.seqs + g.forks:
            s.finish_reason = "abort"
        out = self.outputs.output(g.request, aborted=True)
        self._on_finish(out)
        return out

    def drop_cache(self) -> None:
        """Deletes the KV cache (its device memory is freed now) and forgets the prefix
        cache's pages, and the LoRA slots with it (their adapters stay on the host);
        `new_cache` makes another. No request may be unfinished."""
        for x in jax.tree.leaves(self.cache):
            x.delete()
        self.cache = None
        self.block_manager.uncache()
        if self.lora is not None:
            self.lora.reset_device()

    def new_cache(self) -> None:
        """A new, zeroed KV cache (after `drop_cache`), and empty LoRA slots."""
        self.cache = self._new_cache()
        if self.lora is not None:
            self.lora.restore_device()
        jax.block_until_ready(self.cache)

    def check_outside_step(self, what: str) -> None:
        """RuntimeError, naming `what`, if called inside a step (from its `on_token` or
        `on_finish` callback): there a step's plan is scheduled, maybe the next one
        dispatched, and its tokens half applied; a call that runs or completes steps, or
        needs an idle engine, would run a step inside it out of order."""
        if self.stepping:
            raise RuntimeError(
                f"{what} was called inside an engine step (from an on_token or on_finish "
                "callback); call it between steps (after step() returns, or from "
                "generate's on_step)"
            )

    @contextlib.contextmanager
    def _one_step(self, what: str):
        """Marks the block as a step (`stepping`), refusing one inside another."""
        self.check_outside_step(what)
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False

    def step(self, on_token=None, only: set[str] | None = None) -> list[RequestOutput]:
        """One step (see the module docstring); returns the requests finished in it, then
        the partial outputs of running ones that ask for them (`OutputProcessor.apply`).

        If anything raises in it, the engine recovers (`_recover`) and the exception
        propagates unchanged, with a note. On a KeyboardInterrupt, recovery aborts only
        the requests in `only` (None: all) and requeues the others. RuntimeError, before
        anything changes, if called inside a step (`check_outside_step`).
        """
        with self._one_step("step()"):
            return self._step(on_token, only)

    def _step(self, on_token, only: set[str] | None) -> list[RequestOutput]:
        if self.paused:  # (`pause_generation` completed the step in flight)
            return self._with_carried([])
        plan = None
        sent = False  # whether `plan`'s step was dispatched (its K/V writes will happen)
        finished: list[RequestOutput] = []  # what applying the previous step's tokens built
        try:
            t0 = perf_counter()
            plan = self.scheduler.schedule()
            batch = self._batch(plan) if plan.rows else None
            t1 = perf_counter()
            prev, self.inflight = self.inflight, None
            # Asynchronous: commit and dispatch this step before the previous one's tokens
            # arrive (unless a row needs them, `_sync`: then after, as in sync mode).
            early = self.async_scheduling and prev is not None and not any(map(_sync, plan.rows))
            wait = applied = 0.0
            if prev is not None and not early:
                finished, wait, applied = self._complete(prev, on_token)
            t2 = perf_counter()
            self.scheduler.commit(plan, in_flight=early)
            live = [r for r in plan.rows if not r.decode or r.seq is not None]
            rec = None
            if live:
                rec, leaves = self._dispatch(plan, batch, live, prev[0] if early else None)
            sent = True
            if early:
                finished, wait, applied = self._complete(prev, on_token)
            if rec is not None:
                # In flight from here on, inside the `try`: whatever raises in the
                # bookkeeping below (a Ctrl-C) is recovered from, not a dispatched step
                # whose tokens no later step applies (its sequences stuck, pending).
                self.inflight = (plan, leaves, rec)
                self._idle_steps = 0
                rec.wait_s = wait
                if early:  # every host phase ran while the device computed
                    rec.host_hidden_s = (t1 - t0) + (rec.dispatched_at - t2) + applied
                else:
                    rec.host_hidden_s = t1 - t0
                    rec.host_exposed_s = rec.dispatched_at - (t2 - applied)
                self.metrics.record(rec, rec.num_compilations)
        except BaseException as e:
            self._keep_applied(finished)
            self._recover(e, plan, sent, only)
            raise
        if rec is None:
            # Steps in a row that had requests and did nothing. (Not steps with none: a
            # fully cached admission with no row (n samples whose pages, or readmitted
            # beams whose budget or pages, did not fit this step) came after them as the
            # third step "without progress".)
            stalled = prev is None and self.scheduler.has_unfinished()
            self._idle_steps = self._idle_steps + 1 if stalled else 0
            if self._idle_steps > 2:
                raise RuntimeError("scheduler made no progress with requests queued (a bug)")
        return self._with_carried(finished)

    def drain(self, on_token=None) -> list[RequestOutput]:
        """Completes the step in flight, if any, and applies its tokens (`on_token` as
        `step`'s); returns what the next `step` would have returned for it. Afterwards
        no step is open or in flight. RuntimeError, before anything changes, if called
        inside a step (`check_outside_step`)."""
        with self._one_step("completing the step in flight"):
            prev, self.inflight = self.inflight, None
            if prev is None:
                return self._with_carried([])
            try:
                finished, _, _ = self._complete(prev, on_token)
            except BaseException as e:
                self._recover(e, prev[0], True, None)
                raise
            return self._with_carried(finished)

    def drain_orphaned(self) -> None:
        """Completes a step in flight whose requests have all left (aborted since it was
        dispatched): nothing waits for its tokens, so draining it applies nothing, and no
        step is in flight after (`LLM.sleep`, `update_params`). Outputs carried over from
        a failed step stay for the next `step` to return."""
        if self.inflight is not None and not self.scheduler.has_unfinished():
            self._carried = self.drain()  # (the carried ones; this step's would join them)

    def requeue_all(self) -> None:
        """Preempts every running request (`Scheduler.recover` keeping all): the block
        manager holds no sequence, and each request waits to be recomputed from its
        prompt and the tokens it generated. No step may be in flight (`drain`)."""
        if self.inflight is not None:
            raise RuntimeError("requeue_all() with a step in flight: drain() first")
        aborted = self.scheduler.recover(lambda g: True)
        assert not aborted, aborted

    def _keep_applied(self, outs: list[RequestOutput]) -> None:
        """The outputs a failing step built applying the previous step's tokens before it
        failed (in its commit, its dispatch, its bookkeeping): those of finished requests,
        which left the scheduler (the recovery aborts nothing of theirs) and went to
        `on_finish`, are carried to the next step, as a failed apply's are; partial ones
        (output_kind CUMULATIVE or DELTA) are taken back, since their requests are aborted
        or recomputed (a DELTA stream would miss their tokens)."""
        for o in outs:
            if o.finished:
                self._carried.append(o)
            elif (g := self.scheduler.get(o.request_id)) is not None:
                self.outputs.take_back(g.request, o)

    def _with_carried(self, finished: list[RequestOutput]) -> list[RequestOutput]:
        carried, self._carried = self._carried, []
        return carried + finished

    def _recover(self, error: BaseException, plan: StepPlan | None, sent: bool, only) -> None:
        """Makes the engine usable after `error` escaped a step (see `step`).

        The KV cache and the prefix cache are made consistent before any aborted output
        is built (`_tell_aborted`), so that a failure building one (a decode error, an
        `on_finish` that raises) cannot leave them half recovered.

        Args:
          error: the exception; it gets a note saying what recovery did.
          plan: the failed step's plan; None: `schedule()` itself failed.
          sent: whether its step was dispatched. If not, the pages it was to write hold
            no K/V but may be in the prefix cache already (`schedule` and `commit`
            register them): they leave it. Without a plan, every cached page does.
          only: on a KeyboardInterrupt, abort only these request ids (None: all).
        """
        aborted: list[SequenceGroup] = []
        try:
            ps = self.cache_config.page_size
            unwritten = None if sent else recovery.unwritten_pages(plan, self.block_manager, ps)
            self.inflight = None
            self._idle_steps = 0
            keep = None
            if only is not None and isinstance(error, KeyboardInterrupt):
                keep = lambda g: g.request_id not in only  # noqa: E731
            if only is not None:  # (their caller has its outputs, or gave them up)
                self._carried = [o for o in self._carried if o.request_id not in only]
            aborted = self.scheduler.recover(keep)
            lost = recovery.cache_lost(self.cache)
            if lost:
                self.cache = None  # the old buffers go before the new ones are allocated
                self.cache = self._new_cache()
                jax.block_until_ready(self.cache)
                self.block_manager.uncache()
            elif not sent:
                self.block_manager.uncache(unwritten)
            # The failed step may have left its output feed unusable; no row feeds on it now.
            self._feed = self._new_feed()
        except BaseException as again:
            error.add_note(
                f"pagedjax: recovering the engine from this failed too ({again!r}); "
                "it is not usable: create a new LLM"
            )
            self._tell_aborted(aborted, error)
            return
        ids = [g.request_id for g in aborted]
        error.add_note(recovery.note(ids, len(self.scheduler.waiting), lost))
        self._tell_aborted(aborted, error)

    def _tell_aborted(self, groups: list[SequenceGroup], error: BaseException) -> None:
        """`aborted` for each group recovery gave up, without ever raising: an output
        that raises while it is built is built again without text, an `on_finish` that
        raises skips only its own, and what failed is noted on `error` (which
        propagates)."""
        textless, refused = [], []
        for g in groups:
            for s in g.seqs + g.forks:
                s.finish_reason = "abort"
            try:
                try:
                    out = self.outputs.output(g.request, aborted=True)
                except BaseException as again:
                    textless.append((g.request_id, again))
                    out = self.outputs.output(g.request, aborted=True, with_text=False)
                self._on_finish(out)
            except BaseException as again:
                refused.append((g.request_id, again))
        for failed, what in ((textless, "have no text"), (refused, "were not delivered")):
            if failed:
                ids = [i for i, _ in failed]
                error.add_note(
                    f"pagedjax: the aborted outputs of {len(ids)} request(s) {ids[:8]} "
                    f"{what} ({failed[0][1]!r})"
                )

    def _complete(self, inflight, on_token) -> tuple[list[RequestOutput], float, float]:
        """Waits for a dispatched step's results and applies them; returns the requests
        finished, the seconds waited and the seconds applying."""
        plan, leaves, rec = inflight
        t0 = perf_counter()
        host = jax.device_get(leaves)
        t1 = perf_counter()
        self.metrics.complete(rec, t1)
        try:
            finished = self.outputs.apply(plan, host, on_token)
        except BaseException as e:
            stranded, self.outputs.stranded = self.outputs.stranded, []
            self._carried += stranded
            for o in stranded:
                try:
                    self._on_finish(o)
                except BaseException as again:  # (it propagates `e`; the next step returns o)
                    e.add_note(f"pagedjax: on_finish raised on {o.request_id!r}: {again!r}")
            raise
        for o in finished:
            if o.finished:  # (not a running request's partial output)
                self._on_finish(o)
        return finished, t1 - t0, perf_counter() - t1

    def _dispatch(self, plan: StepPlan, batch: StepBatch, live, prev: StepPlan | None):
        """Packs the committed plan and dispatches its step; returns its record (host
        timings filled by `step`) and the result arrays it copies to the host."""
        inp, k, pk = batch.finish(plan, self._feed, prev)
        before = sum(decode.compile_counts().values())
        td = perf_counter()
        fn = decode.decode_step if inp.decode else decode.prefill_step
        out, self.cache = fn(
            self.params,
            self.cache,
            inp,
            backend=self.backend,
            interpret=self.interpret,
            num_top_logprobs=k,
            num_prompt_top_logprobs=pk,
            lora=None if inp.lora_slots is None else self.lora.weights,
        )
        self._feed = out.feed
        leaves = (
            out.tokens,
            out.logprobs,
            out.top_ids,
            out.top_logprobs,
            out.ranks,
            out.target_logprobs,
            out.target_top_ids,
            out.target_top_logprobs,
            out.target_ranks,
        )
        for x in leaves:
            if x is not None:
                x.copy_to_host_async()
        t3 = perf_counter()
        compiles = sum(decode.compile_counts().values()) - before
        rec = StepRecord(
            num_rows=len(live),
            num_prefill_tokens=plan.num_prefill_tokens,
            # (every prefill row has a token: with none, every live row is a decode row)
            num_decode_tokens=(
                len(live) if not plan.num_prefill_tokens else sum(1 for r in live if r.decode)
            ),
            decode=inp.decode,
            context_tokens=self._tokens_read(live, len(plan.rows), batch.context_lens),
            kv_used_pages=self.block_manager.stats().num_used_pages,
            compiled=compiles > 0,
            host_hidden_s=0.0,
            wait_s=0.0,
            host_exposed_s=0.0,
            dispatch_s=t3 - td,
            dispatched_at=t3,
            num_compilations=compiles,
        )
        return rec, leaves

    def _tokens_read(self, live, num_rows: int, context_lens: np.ndarray) -> int:
        """K/V tokens the step's attention reads: each row's context, or under a sliding
        window of W, its chunk's windows' union (W - 1 positions before the chunk).
        `num_rows`: the plan's rows; `context_lens`: the StepBatch's (numpy), row i's
        `start + num_tokens` for each live row i (read at once when every row is live)."""
        w = self.model_config.sliding_window
        if w is None:
            if len(live) == num_rows:
                return int(context_lens[:num_rows].sum(dtype=np.int64))
            return sum(r.start + r.num_tokens for r in live)
        return sum(min(r.start, w - 1) + r.num_tokens for r in live)

    def _new_feed(self) -> jax.Array:
        rows = decode.bucket_size(self.scheduler.max_num_seqs, self.buckets.min_seqs)
        return sharding.replicate(np.zeros(rows, np.int32), self.params.mesh, device=self._device)

    def _new_cache(self) -> PagedKVCache:
        """A zeroed cache, committed where the steps' outputs lie (`sharding.home_device`):
        an uncommitted one compiled each step program again for the committed cache the
        steps return."""
        mesh = self.params.mesh
        return sharding.create_cache(
            self.model_config, self.cache_config, mesh, device=self._device
        )

    def _batch(self, plan: StepPlan) -> StepBatch:
        cc = self.cache_config
        slots = None
        ids = set() if self.lora is None else {r.group.lora_id for r in plan.rows} - {0}
        if ids:  # (a step with no adapter runs the base model's program: no LoRA cost)
            slots = self.lora.prepare(ids)
        return StepBatch(
            plan,
            self.buckets,
            cc.page_size,
            self.model_config.vocab_size,
            self.block_manager,
            slots,
        )
