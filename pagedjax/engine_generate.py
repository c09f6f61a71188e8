"""`LLM`'s whole-batch calls: `generate`, `chat` and `beam_search` run a list of prompts
to completion and return their outputs in order.

`LLM` (`pagedjax.engine`) inherits them from `GenerateMixin` here, as it does its calls
on its weights (`pagedjax.weight_sync`) and on LoRA adapters (`pagedjax.lora_engine`).
A `generate` call queues its prompts as `add_request` does (all or none: a refused one
unqueues those before it) and steps the engine until they finish; requests queued with
`add_request` run in the same steps. The call's outputs are kept for it as its requests
finish (`_keep`, the engine core's `on_finish`), those of other requests that finish
during it are kept for the next `step()` (`_claim`), and its wall time counts once in
`metrics.run_time_s`, however calls nest (`_run_clock`, which `step` uses too). `chat`
renders conversations with a chat template (`pagedjax.prompts.chat_prompts`) and
generates; `beam_search` is vLLM's (`pagedjax.beam_search`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter
from typing import Any, Self

from pagedjax import beam_search as beam_api
from pagedjax.beam_search import BeamSearchOutput, BeamSearchParams
from pagedjax.lora import LoRARequest
from pagedjax.prompts import chat_prompts, request_lists
from pagedjax.request import Prompt, RequestOutput, RequestOutputKind, SamplingParams

__all__ = ["GenerateMixin"]


class GenerateMixin:
    """`LLM`'s whole-batch calls (`pagedjax.engine.LLM` inherits them; see the module
    docstring). They work on the engine's `core` (`EngineCore`), `scheduler`, `metrics`
    and request path (`_encode`, `_add`, `abort`), and on the state `_init_generate` sets
    up, which `_add` (request ids in use), `step` and `has_unfinished_requests`
    (`_unclaimed`) read too.
    """

    def _init_generate(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}  # finished, for a running generate()
        self._collect: set[str] = set()  # request ids a generate() call waits for
        # Finished inside a generate() call but not its own (add_request's): step() returns them.
        self._unclaimed: list[RequestOutput] = []
        self._timing = False  # a _run_clock is counting

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = False,
        on_step: Callable[[Self], None] | None = None,
        on_token: Callable[[str, int, int], None] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one `RequestOutput` per prompt, in order.

        Requests queued with `add_request` run alongside; those that finish during the
        call are returned by the next `step()`, and the call returns once its own
        requests finish. (vLLM's `generate` runs until every request has finished and
        returns theirs among its own.)

        Args:
          prompts: strings (needs a tokenizer) or token id lists, or vLLM's prompt
            dicts: {"prompt": str} or {"prompt_token_ids": [ids]} (optionally with the
            "prompt" text the ids encode, which becomes `RequestOutput.prompt`), either
            with an optional "cache_salt" (`request.unpack_prompt`). One prompt alone is
            a list of one: a str, a dict, or a non-empty list of ints (token ids, as vLLM
            reads it; a list of lists is a list of prompts).
          sampling_params: one for all prompts, or one per prompt (None:
            `default_sampling_params()`).
          use_tqdm: show a progress bar over requests (off by default, unlike vLLM's);
            a callable makes the bar, as vLLM's (`functools.partial(tqdm, leave=False)`:
            called with `total`, `desc` and `unit`, then `update(n)` and `close()`).
          on_step: called after every engine step with the engine (tests, monitoring;
            it may call `abort`).
          on_token: called as `on_token(request_id, completion_index, token_id)` for
            each sampled token accepted (not for beam search).
          priority: one int per prompt (lower first; `scheduling_policy="priority"`), or
            None: all 0.
          lora_request: the LoRA adapter of every prompt, or a list of one per prompt
            (None: the base model); needs `enable_lora`.

        Raises:
          ValueError, TypeError: a prompt, its sampling params or its priority are refused
            (named by index), `prompts` is neither a prompt nor a list of them, or
            `priority` is not a list as long as `prompts`; no prompt of the call is
            queued then.
          The exception of a failed step (a compile error, device OOM, an exception in
          `on_token` or `on_step`, KeyboardInterrupt), unchanged, once the engine is
          usable again (see `step`). A KeyboardInterrupt aborts only the requests of this
          call: requests queued with `add_request` wait again (recomputed from their
          prompt and the tokens they had, with the same outputs). Any other exception
          in a step aborts every request (it may be theirs: an OOM from the batch they
          share); one raised between steps (`on_step`) aborts this call's requests.
          RuntimeError: the engine is paused (`pause_generation`), or `on_step` paused
            it (this call's requests are aborted then); called inside a step (from an
            `on_token` callback; nothing is queued then).
        """
        self.core.check_outside_step("generate()")  # (before anything is queued)
        if self.core.paused:
            raise RuntimeError(
                "the engine is paused (pause_generation()): resume_generation() first"
            )
        prompts, params = request_lists(prompts, sampling_params, self.default_sampling_params)
        if priority is None:
            priority = [0] * len(prompts)
        elif isinstance(priority, (str, bytes, Mapping)) or not isinstance(priority, Iterable):
            msg = f"priority must be a list of ints, one per prompt, or None, got {priority!r:.80}"
            raise TypeError(msg)
        priority = list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        loras = self._per_prompt_loras(lora_request, len(prompts))
        try:
            ids = self._queue_all(prompts, params, priority, loras)
        finally:  # (adapters read for the prompts push spare ones out only now)
            if self.lora is not None:
                self.lora.trim()
        self._collect.update(ids)
        bar, mine = None, set(ids)
        try:
            if use_tqdm:  # (made once every request is queued; one that raises aborts them)
                if callable(use_tqdm):
                    make_bar = use_tqdm
                else:
                    from tqdm.auto import tqdm as make_bar
                bar = make_bar(total=len(ids), desc="requests", unit="req")
            with self._run_clock():
                while not mine.issubset(self._outputs) and self.core.busy:
                    done = self._claim(self.core.step(on_token, mine))
                    if bar is not None:
                        bar.update(sum(o.request_id in mine for o in done))
                    if on_step is not None:
                        on_step(self)
                    if self.core.paused:
                        raise RuntimeError(
                            "pause_generation() was called inside generate(): its "
                            "requests are aborted"
                        )
                while self.core.inflight is not None and not self.scheduler.has_unfinished():
                    self._claim(self.core.step(on_token, mine))  # nothing left: the last step
            return [self._outputs.pop(i) for i in ids]
        except BaseException:
            for i in ids:  # a failed step aborted them already; not an on_step error
                if self.scheduler.get(i) is not None:
                    self.abort(i)
            raise
        finally:
            self._collect.difference_update(ids)
            for i in ids:
                self._outputs.pop(i, None)
            if bar is not None:
                bar.close()

    def _queue_all(self, prompts, params, priority, loras) -> list[str]:
        """`generate`'s requests, all validated (named by index), then all queued or
        none; returns their ids."""
        encoded = []
        for i, p in enumerate(prompts):  # validate all before queueing any
            try:
                text, ids, sp = self._encode(p, params[i])
                prio = self.scheduler.check_priority(priority[i])
                self._read_lora(loras[i])  # (spare ones stay until all are queued)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
            if sp.output_kind != RequestOutputKind.FINAL_ONLY:  # (whole outputs, as vLLM's)
                sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
            encoded.append((text, ids, sp, prio, loras[i]))
        ids = []
        rng_state = self._rng.bit_generator.state
        try:  # all or none: a request refused while queueing unqueues the ones before it
            for *req, prio, lr in encoded:
                ids.append(self._add(*req, None, prio, lr))
        except BaseException as e:
            for i in ids:
                self.abort(i)
            self._rng.bit_generator.state = rng_state  # and gives back their seeds
            if isinstance(e, (ValueError, TypeError)):
                raise type(e)(f"prompt {len(ids)}: {e}") from None
            raise
        return ids

    def chat(
        self,
        messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool | Callable[..., Any] = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping | None = None,
        chat_template_content_format: str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **template_vars,
    ) -> list[RequestOutput]:
        """Replies to conversations, rendered with the tokenizer's chat template.

        Args:
          messages: one conversation or a list of them, each a list of messages in
            OpenAI's form, as vLLM's `LLM.chat` and the server take them:
            `{"role": str, "content": str}`, the content also None (rendered as "") or
            a list of `{"type": "text", "text": str}` parts (joined with newlines); an
            assistant's `tool_calls`, whose JSON-string `function.arguments` the
            template gets parsed; `tool` results with their `tool_call_id`
            (`pagedjax.chat.normalize_messages`).
          sampling_params: as for `generate`.
          add_generation_prompt: end each with the header that opens the assistant's turn.
          use_tqdm: as for `generate`.
          chat_template: a Jinja template to use instead of the tokenizer's (as vLLM's).
          chat_template_kwargs: more template variables, as a dict (as vLLM's); merged
            with `template_vars`, which win. Its `add_generation_prompt` overrides the
            argument's, as vLLM's update does.
          chat_template_content_format: only vLLM's default "auto": a message's content
            reaches the template as a string, or as a list of text parts for a template
            that loops over them (`pagedjax.chat.content_format`); "string" or "openai",
            which force one, are refused (ValueError).
          lora_request: as for `generate`.
          **template_vars: more template variables (`tools`, `date_string`,
            `continue_final_message`, ...). vLLM's `mm_processor_kwargs` and
            `tokenization_kwargs` (but at None, their default), and `generate`'s
            `priority`, `on_step` and `on_token`, are refused (TypeError), not taken
            as variables.

        Returns:
          One `RequestOutput` per conversation, in order; its `prompt` is the rendered text.

        Raises:
          ValueError: no tokenizer or no chat template, a content format other than
            "auto", bad messages (naming the conversation and the message: an image or
            other non-text part, tool call arguments that are no JSON, ...), a
            `chat_template` that does not parse, or the template rejected them.
          TypeError: a vLLM argument this engine does not support (see above),
            `chat_template` not a str, `chat_template_kwargs` not a dict, or a message
            or its content of the wrong type.
          ImportError: jinja2 is missing (the `chat` extra).
          Anything `generate` raises (a failed step, KeyboardInterrupt), as it does.
        """
        texts, ids = chat_prompts(
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            template_vars=template_vars,
            chat_template_content_format=chat_template_content_format,
        )
        outs = self.generate(ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [dataclasses.replace(o, prompt=t) for o, t in zip(outs, texts, strict=True)]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (`pagedjax.beam_search`): per prompt, a
        `BeamSearchOutput` of its `params.beam_width` best sequences (prompt ids and
        generated ids, text, cumulative logprob, per-token logprobs), best first, from
        the engine's beam search (`SamplingParams(beam_width=W, n=W)`).

        Args:
          prompts: as for `generate`.
          params: a `BeamSearchParams`.
          use_tqdm: as for `generate`.
          concurrency_limit: run the prompts this many at a time (None: all at once).
          lora_request: as for `generate`.

        Raises:
          TypeError: `params` is not a BeamSearchParams.
          ValueError: a bad `concurrency_limit`; anything `generate` raises, a prompt
            named by its index in `prompts` (in chunks: every prompt is encoded before
            the first chunk runs).
        """
        return beam_api.beam_search(
            self,
            prompts,
            params,
            use_tqdm=use_tqdm,
            concurrency_limit=concurrency_limit,
            lora_request=lora_request,
        )

    @contextlib.contextmanager
    def _run_clock(self):
        """Adds the block's wall time to `metrics.run_time_s`, unless an enclosing block
        (a `generate` whose `on_step` calls `step` or `generate`) already counts it."""
        outer, self._timing = not self._timing, True
        t0 = perf_counter()
        try:
            yield
        finally:
            if outer:
                self._timing = False
                self.metrics.run_time_s += perf_counter() - t0

    def _claim(self, finished: list[RequestOutput]) -> list[RequestOutput]:
        """`finished` (a step's, inside `generate`); keeps those of requests that no
        `generate` call collects for the next `step()`."""
        self._unclaimed += [o for o in finished if o.request_id not in self._collect]
        return finished

    def _keep(self, out: RequestOutput) -> None:
        if out.request_id in self._collect:
            self._outputs[out.request_id] = out
