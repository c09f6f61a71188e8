"""The LLM-style front: `LLM(...).generate(prompts, SamplingParams(...)) -> [RequestOutput]`.

    from pagedjax.engine import LLM, SamplingParams

    llm = LLM()                                   # the demo model (or a checkpoint path,
                                                  # a ModelConfig: random weights)
    outs = llm.generate(["def add(a, b):", "import os\\n"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text, llm.summary())

    # An instruct checkpoint: conversations through its chat template (the chat extra: jinja2).
    chat_llm = LLM("path/to/Llama-3.2-1B-Instruct")
    outs = chat_llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))

Pieces: `EngineCore` (`pagedjax.engine_core`) runs the steps: a `Scheduler`
(continuous batching, chunked prefill, preemption) over a `BlockManager` (pages,
copy-on-write, prefix cache) plans them, `StepBatch` (`pagedjax.batch`) packs them for
the jitted `decode.prefill_step` / `decode.decode_step`, and `OutputProcessor`
(`pagedjax.outputs`) applies their tokens (stop checks, logprobs, host-side beam search
from `pagedjax.beam`), with the host's work overlapping the device's (`async_scheduling`,
see `pagedjax.engine_core`). This module builds the engine, checks and queues requests
(`add_request`) and runs single steps (`step`); `LLM` inherits from mixins the
whole-batch calls `generate`, `chat` and `beam_search`, which collect their requests'
outputs (`pagedjax.engine_generate`), the calls on its weights (`pagedjax.weight_sync`)
and the LoRA calls (`pagedjax.lora_engine`). Also: the constructor's argument checks
(`pagedjax.engine_args`), prompts, `generate`'s and `chat`'s arguments among them
(`pagedjax.prompts`), metrics (`pagedjax.metrics`), request types (`pagedjax.request`),
model loading and KV sizing (`pagedjax.resources`).

Failures: an exception escaping a step (a compile error, device OOM, KeyboardInterrupt,
an `on_token` callback's) aborts the requests (`generate` on Ctrl-C: only its own; the
others are recomputed) and propagates unchanged: the engine stays usable (`LLM.step`).

Sampling: a request's i-th sample uses seed `(seed + i * 0x9E3779B1) mod 2**32` (so
sample 0 uses `seed`), and its j-th token depends only on that seed and j; outputs
are reproducible whatever else runs in the batch and across preemptions.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import time
from time import perf_counter

import jax
import numpy as np

from pagedjax import decode, planner, sharding, weight_sync
from pagedjax.batch import request_constraints
from pagedjax.beam import BeamSearch
from pagedjax.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedjax.blocks import BlockManager
from pagedjax.config import CacheConfig
from pagedjax.engine_args import check_engine_args, model_limits
from pagedjax.engine_core import EngineCore
from pagedjax.engine_generate import GenerateMixin
from pagedjax.lora import LoRARequest
from pagedjax.lora_engine import LoRAMixin, check_lora_args
from pagedjax.metrics import EngineMetrics
from pagedjax.outputs import OutputProcessor
from pagedjax.prompts import _VLLM_CHAT_ONLY as _VLLM_CHAT_ONLY
from pagedjax.prompts import salted_prompt
from pagedjax.request import (
    MAX_LOGPROBS,
    CompletionOutput,
    Logprob,
    Prompt,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    encode_prompt,
    resolve_logprobs,
)
from pagedjax.resources import load_model, peak_device_memory, plan_num_pages
from pagedjax.scheduler import Scheduler
from pagedjax.tokenizer import Tokenizer

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]

_SEED_STRIDE = 0x9E3779B1


class LLM(weight_sync.WeightsMixin, LoRAMixin, GenerateMixin):
    """Continuous-batching generation over a paged KV cache.

    Args:
      checkpoint_or_config: None for the embedded demo model (the `tiny` preset with
        random weights, with a warning, until it is there); a checkpoint directory (HF
        or orbax, `pagedjax.weights.load_checkpoint`); a `ModelConfig` (random weights);
        or `model.Params`. Random-weight models get `resources.byte_tokenizer()` when their
        vocabulary has 256 ids or more.
      page_size: tokens per KV page (a power of two).
      num_pages: KV pages; default from `kv_memory_fraction` (`resources.plan_num_pages`).
      kv_memory_fraction: share of free device memory for the cache (default 0.8), once
        one step's working memory (activations, float32 logits and sampling of
        `max_num_batched_tokens` tokens and `max_num_seqs` rows:
        `resources.step_reserve_bytes`) is set aside; give it or `num_pages`, not both.
        A share too small to hold one sequence of `max_model_len` tokens is a ValueError
        naming both, as in vLLM. Without memory stats (the CPU) it is a share of a 4 GiB
        budget, and nothing is set aside.
      max_num_seqs: most sequences running at once.
      max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
      enable_prefix_caching: reuse cached prompt pages across requests.
      backend: attention backend "auto" | "gpu" | "tpu" | "xla".
      seed: random-weight init, and seeds of requests without one (an int in [0, 2**63));
        a refused request draws no seed.
      dtype: parameter and KV dtype override ("float32", "bfloat16", "float16").
      max_model_len: longest sequence (default the model's max_position_embeddings).
      watermark: fraction of pages admission keeps free for running sequences.
      buckets: padding floors of the step shapes (`decode.Buckets`).
      interpret: run Pallas kernels in interpret mode (testing on the CPU).
      tokenizer: overrides the tokenizer found with the model.
      tensor_parallel: split the model and its KV cache over this many devices (the
        first of `jax.devices()`; `pagedjax.sharding`). 1: `Params` are used as given
        (already sharded ones keep their mesh). ValueError if there are fewer devices,
        if it does not divide the query heads and MLP width, or if it neither divides
        nor is a multiple of the kv heads.
      kv_cache_dtype: "auto" (the model's dtype, also given by name) or "fp8" (vLLM's
        "fp8_e4m3" too: `float8_e4m3fn` pages, twice the tokens in the same memory, half
        the K/V bytes a decode step reads; values rounded to FP8 without scales, see
        `pagedjax.cache`). Another dtype is a ValueError before the cache is allocated.
      async_scheduling: dispatch each step before the previous one's tokens reach the
        host (the device feeds them), so that applying them overlaps the device; a
        sequence that stops computes one more token, discarded. False: the host applies
        each step's tokens before dispatching the next (beam search and structured
        outputs always do).
      generation_config: "auto": the sampling defaults of the checkpoint directory's
        generation_config.json (`resources.generation_config_defaults`; a ModelConfig or
        Params source has none), as vLLM's `--generation-config auto`; "none": no file.
        They make `default_sampling_params()`, which `generate`, `chat` and
        `add_request` use when given no params; `sampling_defaults` holds them (a dict
        of SamplingParams fields, {} for none).
      scheduling_policy: "fcfs" (first come first served) or "priority", as vLLM's: each
        request's `priority` (`add_request`, `generate`; lower first, ties by arrival)
        orders the waiting queue, and preemption takes the running request of the worst
        priority first; a running request is not preempted to admit a better one
        (`pagedjax.scheduler`). Under "fcfs" a priority other than 0 is a ValueError.
      max_logprobs: the most logprobs or prompt_logprobs per token a request may ask
        for (vLLM's; -1: no cap). A request over it (its -1, every token's logprob,
        counted as the vocabulary's size) is refused when added (ValueError). The step
        reserve counts the top-k columns it allows (`planner.logprob_columns`): with -1,
        a step's [T, V] prompt logprobs.
      enable_lora: serve LoRA adapters (`pagedjax.lora`): requests name theirs with a
        `LoRARequest` (`generate`, `add_request`, `chat`, `beam_search`), and rows of
        different adapters share a step. A step with adapters adds their update (two
        small matmuls per projection); a step with none runs as without LoRA.
      max_loras: device slots for adapters: the most distinct adapters running at once
        (requests of another wait for a slot).
      max_lora_rank: the largest adapter rank accepted; every slot is this wide.
      max_cpu_loras: adapters kept on the host beyond those queued or running requests
        use and those `add_lora` pinned (None: `max_loras`).
    """

    def __init__(
        self,
        checkpoint_or_config=None,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_memory_fraction: float | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        enable_prefix_caching: bool = True,
        backend: str = "auto",
        seed: int = 0,
        dtype: str | None = None,
        max_model_len: int | None = None,
        watermark: float = 0.01,
        buckets: decode.Buckets | None = None,
        interpret: bool = False,
        tokenizer: Tokenizer | None = None,
        tensor_parallel: int = 1,
        async_scheduling: bool = True,
        kv_cache_dtype: str = "auto",
        generation_config: str = "auto",
        scheduling_policy: str = "fcfs",
        max_logprobs: int = MAX_LOGPROBS,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
    ):
        t0 = perf_counter()
        # Checked before loading anything: a bad value is named before a checkpoint loads.
        kv_cache_dtype, self.sampling_defaults, mesh = check_engine_args(
            checkpoint_or_config,
            page_size=page_size,
            num_pages=num_pages,
            kv_memory_fraction=kv_memory_fraction,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            backend=backend,
            seed=seed,
            max_model_len=max_model_len,
            watermark=watermark,
            buckets=buckets,
            interpret=interpret,
            tokenizer=tokenizer,
            tensor_parallel=tensor_parallel,
            async_scheduling=async_scheduling,
            kv_cache_dtype=kv_cache_dtype,
            generation_config=generation_config,
            scheduling_policy=scheduling_policy,
            max_logprobs=max_logprobs,
            dtype=dtype,
        )
        check_lora_args(enable_lora, max_loras, max_lora_rank, max_cpu_loras)
        self.backend, self.interpret = backend, bool(interpret)
        self.max_logprobs = int(max_logprobs)  # (-1: no cap)
        with sharding.host_staging() if mesh is not None else contextlib.nullcontext():
            cfg, params, tok, self.model_source = load_model(
                checkpoint_or_config, dtype=dtype, seed=int(seed)
            )
        if mesh is not None:
            params = sharding.shard_params(params, mesh)
        elif params.mesh is None:
            # Committed where they lie (no copy), as a weight update and wake_up place
            # them: XLA compiles another program for committed weights, so the first
            # update recompiled every step program.
            params = jax.tree.map(lambda x: jax.device_put(x, x.sharding), params)
        self.tensor_parallel = sharding.tensor_parallel_size(params.mesh)
        self.config, self.params = cfg, params
        # The device whose memory the cache takes: where the weights lie without a mesh
        # (the cache goes there, `EngineCore`), else one of the mesh's.
        self._memory_device = (
            sharding.home_device(params) if params.mesh is None else params.mesh.devices.flat[0]
        )
        self.tokenizer = tokenizer or tok
        self.max_model_len, kv_dtype = model_limits(cfg, max_model_len, kv_cache_dtype)
        # The LoRA slots go on the device before the cache is sized from what is free.
        self._init_lora(enable_lora, max_loras, max_lora_rank, max_cpu_loras)
        if num_pages is None:
            num_pages = plan_num_pages(
                sharding.device_kv_config(cfg, self.tensor_parallel),  # one device's share
                page_size,
                kv_memory_fraction=0.8 if kv_memory_fraction is None else kv_memory_fraction,
                max_num_seqs=max_num_seqs,
                max_model_len=self.max_model_len,
                kv_dtype=kv_dtype,
                watermark=watermark,
                max_num_batched_tokens=max_num_batched_tokens,  # (the step's reserve too)
                buckets=buckets,  # (the step's padded sizes)
                device=self._memory_device,
                lora_columns=int(max_loras) * int(max_lora_rank) if enable_lora else 0,
                logprob_columns=planner.logprob_columns(self.max_logprobs, cfg.vocab_size),
            )
        self.cache_config = CacheConfig(page_size, num_pages, kv_dtype)
        self.block_manager = BlockManager(
            num_pages,
            page_size,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=self.max_model_len,
            watermark=watermark,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            sliding_window=cfg.sliding_window,  # pages out of the window are given back
            scheduling_policy=scheduling_policy,
            max_loras=max_loras if enable_lora else None,
        )
        self.buckets = buckets or decode.Buckets()
        self.async_scheduling = bool(async_scheduling)
        self.eos_ids = frozenset(cfg.eos_token_ids) | (
            self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        )
        self.metrics = EngineMetrics(
            planner.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        )
        self._rng = np.random.default_rng(int(seed))
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.outputs = OutputProcessor(
            self.scheduler, self.metrics, self._text, self._seq_ids, self.tokenizer
        )
        self.core = EngineCore(
            cfg,
            params,
            self.cache_config,
            self.scheduler,
            self.outputs,
            self.metrics,
            backend=self.backend,
            interpret=self.interpret,
            buckets=self.buckets,
            async_scheduling=self.async_scheduling,
            on_finish=self._keep,
            lora=self.lora,
        )
        self._init_generate()  # (engine_generate.GenerateMixin)
        self._init_weights(params)  # (weight_sync.WeightsMixin)
        jax.block_until_ready(self.cache)
        self.metrics.load_time_s = perf_counter() - t0

    # ----------------------------------------------------------------- requests

    def encode(
        self, prompt: Prompt, *, truncate_prompt_tokens: int | None = None
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, validated (ValueError / TypeError);
        `truncate_prompt_tokens` as `SamplingParams`' (`request.encode_prompt`). Not
        vLLM's `LLM.encode`, which pools hidden states (this engine only generates)."""
        return encode_prompt(
            prompt,
            self.tokenizer,
            self.config.vocab_size,
            self.max_model_len,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )

    def get_tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (vLLM's `LLM.get_tokenizer`; None without one)."""
        return self.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """The `SamplingParams` of a request given none: `sampling_defaults` (the
        checkpoint's generation_config.json, `generation_config="auto"`), else
        SamplingParams' own defaults."""
        return SamplingParams(**self.sampling_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's name for `default_sampling_params()` (frozen params, unlike vLLM's:
        `dataclasses.replace(params, max_tokens=...)` makes a changed copy)."""
        return self.default_sampling_params()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queues one prompt; returns its request id. Raises ValueError if it cannot run or
        `request_id` is in use (queued, running, a running `generate` call's, or with
        partial outputs the next `step()` returns), TypeError if `params` is not a
        `SamplingParams`. An id whose request's last output the next `step()` returns
        (it finished inside a `generate` call, or in a step that failed) may be reused:
        that output (its own prompt and completions) comes first, then the new one's.
        `params` None: `default_sampling_params()`.
        `priority`: an int, lower served first under `scheduling_policy="priority"`
        (ValueError if not 0 under "fcfs"). `lora_request`: the LoRA adapter it runs with
        (`enable_lora`; read now if new: FileNotFoundError / ValueError for a bad one).
        `arrival_time`: when the request arrived, in `time.time()` seconds (vLLM's
        clock), where a front end queued it before the engine could take it (e.g.
        `EngineThread.submit`): its time to first token and latency count from then
        (None: from now; a time in the future counts as now; ValueError if not a finite
        number).

        A completion ends ("length") after `params.max_tokens` tokens (None: no such
        limit) or when prompt and completion reach `max_model_len` tokens, whichever
        comes first.
        """
        arrival = _arrival(arrival_time)  # (before the encoding, which takes time)
        return self._add(*self._encode(prompt, params), request_id, priority, lora_request, arrival)

    def _encode(
        self, prompt: Prompt, params: SamplingParams | None
    ) -> tuple[str | None, list[int], SamplingParams]:
        """(text or None, token ids, params) of a request: `params` resolved (`_params`),
        with a prompt dict's cache salt, and the prompt encoded under them."""
        prompt, params = salted_prompt(prompt, self._params(params))
        k = params.truncate_prompt_tokens
        return *self.encode(prompt, truncate_prompt_tokens=k), params

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a completion of `params`: its stop_token_ids, and the
        model's EOS tokens (`eos_ids`) unless ignore_eos."""
        return frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_ids
        )

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        """`params`, or `default_sampling_params()` for None, with logprobs of -1 as the
        vocabulary's size, within `max_logprobs` (ValueError); TypeError for anything
        but a SamplingParams."""
        params = self.default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {params!r:.80}")
        return resolve_logprobs(params, self.max_logprobs, self.config.vocab_size)

    def _add(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        arrival: float | None = None,
    ) -> str:
        """`add_request` for a prompt `encode` checked (text or None, token ids) and its
        params `_params` resolved; `arrival`: its arrival on the `perf_counter` clock
        (None: now)."""
        self._check_ready()
        priority = self.scheduler.check_priority(priority)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        stop_ids = self.stop_ids(params)
        limits = request_constraints(  # (min_tokens bans EOS even under ignore_eos, as vLLM)
            params,
            stop_ids,
            self.tokenizer,
            self.config.vocab_size,
            min_tokens_bans=frozenset(params.stop_token_ids) | self.eos_ids,
        )
        self.scheduler.check_seats(  # before building n sequences (n=10**9)
            max(params.n, params.beam_width),
            request_id,
            f" (n={params.n}, beam_width={params.beam_width})",
        )
        if request_id is None:  # a counter's id no queued, collected or held request has
            # (held: an output the next step() returns, from a generate() call or a failed
            # step: a generate() taking its id would drop that output as one of its own)
            held = {o.request_id for o in self._unclaimed} | self.core.carried_ids()
            rid = str(next(self._ids))
            while self.scheduler.get(rid) is not None or rid in self._collect or rid in held:
                rid = str(next(self._ids))
        else:
            rid = str(request_id)
            if rid in self._collect:  # its output would replace that call's (both lost)
                raise ValueError(f"request id {rid!r} belongs to a running generate() call")
            if self.scheduler.get(rid) is None and any(
                o.request_id == rid and not o.finished for o in self._unclaimed
            ):
                # (the partial outputs of a request that ended since: `abort` of a new one
                # would take them for its own)
                raise ValueError(
                    f"request id {rid!r} is in use: the next step() returns partial outputs "
                    "of the request of that id; call step() first"
                )
        p = len(ids)
        max_len = self.max_model_len
        if params.max_tokens is not None:
            max_len = min(p + params.max_tokens, max_len)
        beam = None
        if params.beam_width > 1:  # (it may refuse the length penalty: before the rng draw)
            lp = float(params.length_penalty)
            beam = BeamSearch(params.beam_width, lp, stop_ids, max_len - p)
        lora_id = new_lora = 0  # its adapter, read once the request is known good
        if lora_request is not None:  # (others make room for it once it is queued: trim)
            new_lora = self._need_lora().add(lora_request, trim=False)
            lora_id = lora_request.lora_int_id
        rng_state = self._rng.bit_generator.state
        base = int(self._rng.integers(2**32)) if params.seed is None else int(params.seed)
        seeds = [(base + i * _SEED_STRIDE) % 2**32 for i in range(params.n)]
        req = self.outputs.new_request(
            rid, text, ids, params, stop_ids, max_len, seeds, beam, limits.guide, arrival=arrival
        )
        req.bias, req.banned, req.allowed = limits.bias, limits.banned, limits.allowed
        req.bad_words = limits.bad_words
        req.group.priority = priority
        req.lora_request = lora_request
        self._set_lora(req.group, lora_id)
        try:
            self.scheduler.add(req.group)
        except BaseException:  # refused (pages, id): it leaves the next requests' seeds alone
            self._rng.bit_generator.state = rng_state
            if new_lora:  # (and the adapter it read unheld)
                self.lora.remove(lora_id)
            raise
        if new_lora:
            self.lora.trim()
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request wherever it is and frees its pages; returns its last output
        (`finished`, its running completions ending "abort" with what they have), or None
        for an id not queued or running. Ids compare as `add_request` stores them, as
        strings. Partial outputs of it held for the next `step()` (from a `generate`
        call, or `reset_prefix_cache`) are dropped: with output_kind DELTA, what they
        held is in the one returned, which is the request's last."""
        rid = str(request_id)
        g = self.scheduler.abort(rid)
        if g is None:
            return None
        # (its partial outputs: a finished one is an earlier request's of the same id, and
        # `_add` reuses no id that partial outputs of an earlier request hold)
        held = [o for o in self._unclaimed if o.request_id == rid and not o.finished]
        if held:
            self._unclaimed = [o for o in self._unclaimed if not any(o is h for h in held)]
            for out in held:
                self.outputs.take_back(g.request, out)
        return self.core.aborted(g)

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has more to do or return: requests queued or running, a step
        in flight, or outputs of `add_request`'s requests that finished inside a
        `generate` call (the next `step()` returns them)."""
        return self.core.busy or bool(self._unclaimed)

    @property
    def scheduling_policy(self) -> str:
        """The scheduling policy, "fcfs" or "priority" (the scheduler applies it)."""
        return self.scheduler.scheduling_policy

    @property
    def cache(self):
        """The KV cache (`pagedjax.cache.KVCache`): each step replaces it (donated)."""
        return self.core.cache

    def summary(self) -> dict:
        """The run's metrics (`pagedjax.metrics.SUMMARY_KEYS`)."""
        return self.metrics.summary(
            kv_pages_total=self.cache_config.num_pages,
            prefix_cache_hit_rate=self.block_manager.stats().prefix_hit_rate,
            preemptions=self.scheduler.num_preemptions,
            peak_device_memory_bytes=peak_device_memory(self._memory_device),
        )

    # --------------------------------------------------------------------- step

    def step(self, *, on_token=None) -> list[RequestOutput]:
        """One engine step (`pagedjax.engine_core`); returns the requests finished in it
        and the partial outputs of running ones that ask for them
        (`SamplingParams.output_kind` CUMULATIVE or DELTA, as vLLM's `step`; the default
        FINAL_ONLY gives none: `on_token` streams any request's tokens), after those of
        `add_request`'s requests that finished inside a `generate` call since.
        `on_token` runs inside the step: it may add and abort requests, but a call that
        steps or needs an idle engine (`step`, `generate`, `pause_generation`, `sleep`,
        `update_params`, ...) raises RuntimeError there, changing nothing.

        If anything raises in it (a compile error, device OOM, an exception in the jitted
        call or in `on_token`, KeyboardInterrupt), the engine recovers and the exception
        propagates unchanged, with a note: every request is aborted (pages freed, outputs
        lost); a KV cache lost with a failed call (donated, or poisoned by a device error)
        is re-created and the prefix cache cleared, else only the pages the failed step
        was to write leave the prefix cache. Requests that finished in it before applying
        its tokens raised (an `on_token` callback, a decode, a beam selection), or before
        it failed after applying them, are not aborted: the next step returns their
        outputs.

        Its wall time counts in `metrics.run_time_s`, as a `generate` call's does; a
        step called inside a `generate` (from `on_step`) is counted once, as its part.
        """
        with self._run_clock():
            finished = self.core.step(on_token)
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + finished

    def _text(self, ids: list[int], prompt_ids: list[int], skip_special_tokens: bool) -> str:
        """The text of generated `ids`, read after their prompt ("" without a tokenizer)."""
        tok = self.tokenizer
        if tok is None:
            return ""
        return tok.decode(ids, skip_special_tokens=skip_special_tokens, context=prompt_ids)


def _arrival(arrival_time) -> float | None:
    """`add_request`'s `arrival_time` (`time.time()` seconds) on the engine's clock
    (`perf_counter`, which the request timings read), no later than now; None: None."""
    if arrival_time is None:
        return None
    if (
        isinstance(arrival_time, bool)
        or not isinstance(arrival_time, numbers.Real)
        or not math.isfinite(arrival_time)
    ):
        raise ValueError(
            f"arrival_time must be a finite number of time.time() seconds, got {arrival_time!r:.80}"
        )
    now = perf_counter()
    return now - max(0.0, time.time() - float(arrival_time))
