"""An engine thread: one thread owns an `LLM`, and callers on any thread feed it.

JAX and the engine are not thread-safe, so `EngineThread` is the only code that touches
its `LLM`. It loops `llm.step()` while there is work and otherwise blocks on a queue of
commands (add requests, abort, stop, run a function on it). Callers never wait on the
engine itself: each passes a sink (any object with `put`, e.g. a `queue.SimpleQueue`)
with its requests and reads events from it:

    ("prompt", request_id, prompt_logprobs)              with tokens=True, see below
    ("token", request_id, completion_index, token_id)   only when submitted with tokens=True
    ("done", request_id, RequestOutput)
    ("error", request_id or None, status, message)

A token event of a request whose params ask for logprobs carries a fifth element: the
token's logprobs entry `{token_id: logprob, ...}` (the token first, then the
`params.logprobs` most likely), as its `CompletionOutput.logprobs` will have it. A
request submitted with tokens=True whose params ask for prompt logprobs gets one
"prompt" event just before its first token event (its prefill, which computes them, is
done then): its prompt logprobs as its `RequestOutput.prompt_logprobs` will have them
(None first), so that a stream can send them (completions' echo) before its tokens.

A sink whose `put` raises (its client went away) loses its request alone: the request is
aborted and gets no further events; the other requests and the thread go on.

An error's status follows HTTP's meaning: 400 when the engine refused a request
(`LLM.add_request` raised ValueError or TypeError; `request_id` is None and none of the
batch was added), 500 when a step failed, 503 when the thread stopped. If a step raises,
`LLM.step` recovers the engine by itself: the requests it aborted get a 500, those that
finished in it before it failed their done events (the engine keeps their outputs), and
the thread goes on. Work that a caller does not need the engine for (validating, tokenizing,
rendering chat templates) stays on the caller's thread, so a bad request never reaches
the engine. scripts/serve.py runs one per HTTP server, with a thread per connection.

Usage (from a notebook, or a web framework's handler threads):

    import queue
    from pagedjax.engine import LLM, SamplingParams
    from pagedjax.serving import EngineThread

    engine = EngineThread(LLM("path/to/checkpoint"))
    sink = queue.SimpleQueue()
    ids = engine.call(lambda llm: llm.tokenizer.encode("def add(a, b):"))
    engine.submit([("r0", ids, SamplingParams(max_tokens=32))], sink, tokens=True)
    while (event := sink.get())[0] == "token":
        ...  # stream event[3], the next token id of completion event[2]
    kind, rid, out = event  # ("done", "r0", RequestOutput) or ("error", ...)
    engine.abort(["r1"])  # a request whose caller went away (unknown ids are ignored)
    used = engine.call(lambda llm: llm.block_manager.stats().num_used_pages)
    engine.stop()  # unfinished requests get a 503 error event

A `call`'s function may pause the engine (`LLM.pause_generation`, for new weights in the
middle of requests): the thread then waits for commands instead of stepping, until a
`call` resumes it (`resume_generation`). Requests submitted meanwhile are queued and
start after the resume, as vLLM's AsyncLLM queues them during a pause (an asleep engine
refuses them: a 503 error event with its reason). What the function does to the
thread's requests reaches their sinks as if a step had done it: the tokens it applies
(a pause completes the step in flight) as token events, and the outputs it returns of
those it ends (a pause's "abort" or "wait", `LLM.abort`) as done events; a request it
ends without returning its output gets a 500 error event.

`LoRANames` (`pagedjax.lora_names`, re-exported here) is a server's table of LoRA
adapters by name, which it changes while serving (vLLM's runtime LoRA updating) on the
engine thread, consistently with the requests it queues there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from pagedjax.lora_names import LoRANames  # re-exported: the server's table of adapters
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["EngineStopped", "EngineThread", "LoRANames"]


class EngineStopped(RuntimeError):
    """The engine thread is not running (stopped, or stopping), so it takes no command."""


class EngineThread:
    """The one thread that touches an `LLM`: steps it while it has work, else waits
    for commands. Events go to each request's sink (see the module docstring).

    Args:
      llm: the engine; nothing else may touch it once the thread started (use `call`).

    Attributes:
      llm: the engine (read it only through `call`).
      num_aborted: requests aborted through `abort` (e.g. their client went away).
      num_failed_steps: engine steps that raised (the requests they aborted got a 500).
    """

    def __init__(self, llm):
        self.llm = llm
        self.num_aborted = 0
        self.num_failed_steps = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[Any, bool, bool]] = {}  # rid -> (sink, tokens, logprobs)
        self._prompts_due: set[str] = set()  # token-streamed requests' prompt logprobs not sent
        self._broken: list[str] = []  # requests whose sink raised during the current step
        self._streamed: dict[str, dict[int, int]] = {}  # rid -> {completion index: tokens sent}
        self._lock = threading.Lock()
        self._alive = True
        self._ended = "it was stopped"  # why it takes no commands, once it does not
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        requests: list[tuple],
        sink,
        *,
        tokens: bool,
    ) -> None:
        """Queues requests for the engine, all or none.

        Args:
          requests: `(request id, prompt token ids, params)` triples (params None: the
            engine's `default_sampling_params()`, as `LLM.add_request`), or with a fourth
            element, the request's priority (`LLM.add_request`'s; left out: none given,
            0), and a fifth, its `LoRARequest` (None: the base model; `LLM.add_request`
            gets a `lora_request` only when there is one); the ids must be unique among
            the engine's unfinished requests.
          sink: gets the requests' events (`put(event)`, called on the engine thread: it
            must not block, as a full bounded `queue.Queue` would stall every request).
          tokens: also send a "token" event for each generated token (with its logprobs
            entry when the request's params ask for logprobs), and, when they ask for
            prompt logprobs, a "prompt" event with those before the first one. The
            thread sends no partial output (`output_kind`): a request without token
            events (tokens=False, or a beam search) gets its whole output in its done
            event whatever its output_kind (with DELTA, the done event of a token-streamed
            one holds the last tokens only, after their token events).

        The requests' times to first token and latencies count from this call (their
        `LLM.add_request` `arrival_time`, as vLLM stamps a request where it reaches its
        front end), not from when the engine thread takes them, after the step or compile
        it is running.

        Raises:
          TypeError: `requests` is not a list of 3- to 5-tuples with str ids, or
            `sink` has no `put` (checked here, on the caller's thread).
          EngineStopped: the thread is not running. A request the engine refuses is an
            ("error", None, 400, message) event instead, and none of the batch is added.
        """
        arrival = time.time()
        requests = _check_requests(requests)
        if not callable(getattr(sink, "put", None)):
            raise TypeError(f"sink must have a put(event) method, got {type(sink).__name__}")
        self._put(("add", requests, sink, tokens, arrival))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Aborts requests; they get no further events (finished or unknown ids are ignored).

        Raises:
          TypeError: `request_ids` is a str or not an iterable of str ids.
          EngineStopped: the thread is not running.
        """
        self._put(("abort", _check_ids(request_ids)))

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 60.0):
        """Runs `fn(llm)` on the engine thread between two steps and returns its result.

        Args:
          fn: a function of the `LLM`; what it raises is raised here.
          timeout: seconds to wait for the result (None: no limit).

        Raises:
          EngineStopped: the thread is not running, or stopped before running `fn`.
          queue.Empty: no result within `timeout`.
          RuntimeError: called on the engine thread itself (from a `call`'s function or a
            sink), where waiting for the result would wait forever.
        """
        self._not_on_engine_thread("call")
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._put(("call", fn, box))
        ok, value = box.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def stop(self, timeout: float = 60.0) -> None:
        """Ends the thread once its current step is done; unfinished requests get a 503,
        and the engine is left idle (no step in flight), for whoever uses it next.

        Args:
          timeout: seconds to wait for the thread to end. Stopping twice is harmless.
            On the engine thread itself (a `call`'s function, a sink) it does not wait:
            the thread ends after the current command.
        """
        with contextlib.suppress(EngineStopped):
            self._put(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread takes commands."""
        return self._alive

    def _put(self, command) -> None:
        with self._lock:
            if not self._alive:
                raise EngineStopped(f"the engine is not running ({self._ended})")
            self._commands.put(command)

    def _not_on_engine_thread(self, what: str) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"EngineThread.{what} on the engine thread itself (from a call's function or "
                "a sink) would wait for that thread forever"
            )

    def _run(self) -> None:
        commands: collections.deque = collections.deque()  # read, not yet handled
        try:
            while True:
                if not self._stepping():
                    commands.append(self._commands.get())
                with contextlib.suppress(queue.Empty):
                    while True:
                        commands.append(self._commands.get_nowait())
                while commands:
                    command = commands.popleft()
                    if command[0] == "stop":
                        return
                    self._handle(command)
                if self._stepping():
                    self._step()
        except BaseException as e:
            self._ended = f"its thread died: {type(e).__name__}: {e}"
            raise
        finally:
            with self._lock:
                self._alive = False
            self._fail_all(503, "the engine is stopping")
            # Commands read with the stop (behind it) and those still queued: no caller
            # may wait forever on a sink or a call's result.
            with contextlib.suppress(queue.Empty):
                while True:
                    commands.append(self._commands.get_nowait())
            for command in commands:
                if command[0] == "add":
                    _send(command[2], ("error", None, 503, "the engine is stopping"))
                elif command[0] == "call":
                    command[2].put((False, EngineStopped("the engine stopped")))
            # The step in flight (its requests aborted above) completes, so that the engine
            # is left idle for whoever uses it next (`sleep` and `update_params` refuse
            # an engine with a step in flight).
            with contextlib.suppress(Exception):
                if self.llm.has_unfinished_requests():
                    self.llm.step()

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, requests, sink, tokens, arrival = command
            added = []
            try:
                for rid, ids, params, *more in requests:
                    if params is None:  # (the engine's defaults, as `add_request` takes it;
                        params = self.llm.default_sampling_params()  # its flags read below)
                    # (beam search streams no tokens: its beams are known when it ends)
                    streams = tokens and getattr(params, "beam_width", 1) == 1
                    if not streams:
                        params = _whole(params)
                    p = more[0] if more else 0
                    lora = {} if len(more) < 2 or more[1] is None else {"lora_request": more[1]}
                    self.llm.add_request(
                        ids, params, request_id=rid, priority=p, arrival_time=arrival, **lora
                    )
                    added.append(rid)
                    self._sinks[rid] = (sink, streams, params.logprobs is not None)
                    if streams and params.prompt_logprobs is not None:
                        self._prompts_due.add(rid)
            except Exception as e:  # noqa: BLE001  (answered, and the engine goes on)
                for rid in added:
                    self.llm.abort(rid)
                    self._drop(rid)
                status = 400 if isinstance(e, (ValueError, TypeError)) else 500
                if status == 500 and _ask(self.llm, "is_sleeping"):
                    status = 503  # (the engine refuses requests until wake_up)
                _send(sink, ("error", None, status, str(e)))
        elif kind == "abort":
            for rid in command[1]:
                self._prompts_due.discard(rid)
                self._streamed.pop(rid, None)
                if self._sinks.pop(rid, None) is not None:
                    self.llm.abort(rid)
                    self.num_aborted += 1
        elif kind == "call":
            before, groups = _generated(self.llm), self._groups()
            try:
                answer = (True, command[1](self.llm))
            except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread,
                answer = (False, e)  # SystemExit included: it is the caller's to act on)
            applied = before is None or _generated(self.llm) != before
            try:
                self._settle(answer[1] if answer[0] else None, groups if applied else None)
            finally:  # (a caller never waits forever, even on a thread that dies here)
                command[2].put(answer)

    def _stepping(self) -> bool:
        """Whether the loop steps the engine: it has requests and is not paused (a paused
        engine's `step` does nothing, so the thread waits for a command instead)."""
        return self.llm.has_unfinished_requests() and not _ask(self.llm, "is_paused")

    def _groups(self) -> dict[str, Any]:
        """The engine's sequence groups of the token-streamed requests, taken before a
        `call`: a request its function ends leaves the scheduler, but its group still
        holds every token (an output with output_kind DELTA holds only the last ones)."""
        scheduler = getattr(self.llm, "scheduler", None)
        if scheduler is None:  # (a stand-in engine that shows none of its requests)
            return {}
        groups = (
            (rid, scheduler.get(rid)) for rid, (_, tokens, _) in self._sinks.items() if tokens
        )
        return {rid: g for rid, g in groups if g is not None}

    def _settle(self, result, groups: dict[str, Any] | None = None) -> None:
        """Sends the events of what a `call`'s function did to the thread's requests, as
        if a step had done it: the tokens it applied without `on_token` (a pause
        completing the step in flight, "wait" running steps, `generate`), and the
        outputs of those it finished (a pause's "abort" or "wait", `LLM.abort`), found
        in what it returned (a `RequestOutput` or a list of them). Before the caller
        gets its result, so that both see the same engine.

        Outputs the engine holds for its next step (`reset_prefix_cache` completing the
        step in flight) go out with one step now (a paused engine's step only returns
        them). A request that ended in the call with its output nowhere to be found
        (a function that aborted it and returned something else) gets a 500, so that
        no submitter waits forever. `groups`: `_groups()` before the call if it applied
        tokens, whose tokens are streamed before any output goes out (None: it applied
        none, and no request's tokens are walked)."""
        scheduler = getattr(self.llm, "scheduler", None)
        for rid, group in (groups or {}).items():
            if rid in self._sinks and scheduler is not None:
                group = scheduler.get(rid) or group  # (the same, unless the call ended it)
                seqs = [*getattr(group, "finished", ()), *group.seqs]  # (a stand-in's: none)
                held = [(s.index, s.token_ids[s.num_prompt_tokens :], s.logprobs) for s in seqs]
                self._catch_up(rid, held, lambda rid=rid, g=group: self._prompt_logprobs(rid, g))
        for out in _outputs_in(result):
            if out.finished:
                self._finish(out)
        if scheduler is None:  # (a stand-in engine that shows none of its requests)
            return
        self._abort_broken()
        gone = [rid for rid in self._sinks if scheduler.get(rid) is None]
        if gone and self.llm.has_unfinished_requests():
            self._step()  # (returns outputs held for it; a paused engine's nothing else)
        for rid in gone:
            if rid in self._sinks:
                sink = self._sinks[rid][0]
                self._drop(rid)
                message = "the request ended inside an EngineThread.call that kept its output"
                _send(sink, ("error", rid, 500, message))

    def _step(self) -> None:
        try:
            finished = self.llm.step(on_token=self._on_token)
        except Exception as e:  # noqa: BLE001  (LLM.step recovered; its requests fail)
            self.num_failed_steps += 1
            traceback.print_exc(file=sys.stderr)
            for out in self._kept_outputs():
                if out.finished:
                    self._finish(out)
            self._abort_broken()
            self._fail_all(500, f"the engine step failed: {type(e).__name__}: {e}")
            return
        finally:
            self._abort_broken()  # after the step, not from inside its on_token callback
        for out in finished:
            if out.finished:  # (a partial output (output_kind): "token" events stream)
                self._finish(out)
        self._abort_broken()

    def _kept_outputs(self) -> list:
        """After a failed step: the outputs of the requests that finished in it before it
        failed, which the engine keeps for its next step (`LLM.step`). Its recovery
        aborted every other request, so that step runs nothing but returns them ([] if
        it raises too)."""
        if not self.llm.has_unfinished_requests():
            return []
        try:
            return self.llm.step(on_token=self._on_token)
        except Exception:  # noqa: BLE001  (its requests get the 500 of the first failure)
            traceback.print_exc(file=sys.stderr)
            return []
        finally:
            self._abort_broken()

    def _finish(self, out) -> None:
        """A finished request's "done" event, after any of its tokens not streamed yet."""
        rid = out.request_id
        entry = self._sinks.get(rid)
        if entry is None:
            self._prompts_due.discard(rid)
            return
        if entry[1]:
            done = [(c.index, c.token_ids, c.logprobs) for c in out.outputs]
            if not self._catch_up(rid, done, lambda: out.prompt_logprobs):
                return
        self._drop(rid)
        _send(entry[0], ("done", rid, out))

    def _catch_up(self, rid: str, completions, prompt: Callable[[], list]) -> bool:
        """Streams the tokens of request `rid` that its sink has not had yet, as steps'
        `on_token` would have: `completions` are (index, generated token ids, their
        logprobs entries or None); `prompt()` gives its prompt logprobs. False if its
        sink raised (it is dropped then)."""
        sent = self._streamed.get(rid, {})
        for index, ids, entries in completions:
            for i in range(sent.get(index, 0), len(ids)):
                entry = entries[i] if entries is not None and i < len(entries) else None
                if not self._stream(rid, index, ids[i], entry, prompt):
                    return False
        return True

    def _drop(self, rid: str) -> None:
        """Forgets request `rid`'s sink: it gets no further events."""
        self._sinks.pop(rid, None)
        self._prompts_due.discard(rid)
        self._streamed.pop(rid, None)

    def _abort_broken(self) -> None:
        """Aborts the requests whose sink raised (on the engine, outside its step)."""
        broken, self._broken = self._broken, []
        for rid in broken:
            self.llm.abort(rid)

    def _on_token(self, rid: str, index: int, token: int) -> None:
        entry = self._sinks.get(rid)
        if entry is None or not entry[1]:
            return
        lp = self._logprobs_entry(rid, index) if entry[2] else None
        self._stream(rid, index, token, lp, lambda: self._prompt_logprobs(rid))

    def _stream(self, rid: str, index: int, token: int, logprobs, prompt) -> bool:
        """Sends a "token" event (after the "prompt" event, if due) to the sink of
        token-streamed request `rid`; False if its sink raised: the request is dropped
        and aborted (`_abort_broken`), not the whole step."""
        sink, _, asked = self._sinks[rid]
        events = []
        if rid in self._prompts_due:
            self._prompts_due.discard(rid)
            events.append(("prompt", rid, prompt()))
        if asked:
            events.append(("token", rid, index, token, logprobs))
        else:
            events.append(("token", rid, index, token))
        sent = self._streamed.setdefault(rid, {})
        sent[index] = sent.get(index, 0) + 1
        for event in events:
            if not _send(sink, event):
                self._drop(rid)
                self._broken.append(rid)
                return False
        return True

    def _logprobs_entry(self, rid: str, index: int) -> dict[int, float]:
        """The logprobs entry of the token that `on_token` reports: `LLM.step` appends it
        to its sequence's `logprobs` before the callback (so `on_token` keeps its
        signature)."""
        group = self.llm.scheduler.get(rid)
        for seq in group.seqs if group is not None else ():
            if seq.index == index:
                return seq.logprobs[-1]
        raise RuntimeError(f"no running completion {index} of request {rid!r} (a bug)")

    def _prompt_logprobs(self, rid: str, group=None) -> list:
        """A copy of the prompt logprobs of a request whose first token `on_token`
        reports: `LLM.step` records them from the step that ends its prefill before it
        applies that step's tokens, so none is missing by then. `group`: its sequence
        group, where the scheduler may have let it go (`_settle`)."""
        group = self.llm.scheduler.get(rid) if group is None else group
        entries = None if group is None else group.request.prompt_logprobs
        if entries is None or None in entries[1:]:
            raise RuntimeError(f"request {rid!r}'s prompt logprobs are not all known (a bug)")
        return list(entries)

    def _fail_all(self, status: int, message: str) -> None:
        for rid, (sink, *_) in list(self._sinks.items()):
            with contextlib.suppress(Exception):
                self.llm.abort(rid)  # a failed step aborted them already; a stop did not
            _send(sink, ("error", rid, status, message))
        self._sinks.clear()
        self._prompts_due.clear()
        self._streamed.clear()


def _send(sink, event) -> bool:
    """`sink.put(event)`; False (with the traceback on stderr) if it raised, so that one
    caller's broken sink never fails the engine thread or another request."""
    try:
        sink.put(event)
    except Exception:  # noqa: BLE001
        print(f"pagedjax: a sink's put raised on a {event[0]!r} event:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return False
    return True


def _whole(params):
    """`params` of a request whose sink gets no token events, with output kind
    FINAL_ONLY: the thread sends no partial output, so its done event is all its caller
    gets, and with DELTA it held only the last step's tokens (as `LLM.generate` returns
    whole outputs whatever the kind)."""
    if isinstance(params, SamplingParams) and params.output_kind != RequestOutputKind.FINAL_ONLY:
        return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params


def _ask(llm, method: str) -> bool:
    """`llm.<method>()` of a state the loop adapts to (`is_paused`, `is_sleeping`);
    False for an engine without it (a stand-in)."""
    fn = getattr(llm, method, None)
    return fn is not None and bool(fn())


def _generated(llm) -> int | None:
    """Tokens the engine has applied so far (None for a stand-in without metrics): a
    `call` that changed it applied tokens that `_settle` streams (a /metrics scrape, the
    common call, skips that walk over every request's tokens)."""
    metrics = getattr(llm, "metrics", None)
    return getattr(metrics, "generated_tokens", None)


def _outputs_in(result) -> list:
    """The request outputs in a `call`'s result: the result itself, or the items of a
    list or tuple, that have a `request_id`, `outputs` and a bool `finished` flag
    (`RequestOutput`s; not a `SequenceGroup`, whose `finished` lists its finished
    sequences)."""
    items = result if isinstance(result, (list, tuple)) else [result]
    return [
        o
        for o in items
        if hasattr(o, "request_id")
        and hasattr(o, "outputs")
        and isinstance(getattr(o, "finished", None), bool)
    ]


def _check_ids(request_ids) -> list[str]:
    """`request_ids` as a list, or a TypeError: a str would be taken for its characters."""
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
        raise TypeError(
            f"request_ids must be an iterable of str request ids, got {request_ids!r:.80}"
        )
    ids = list(request_ids)
    for rid in ids:
        if not isinstance(rid, str):
            raise TypeError(f"request_ids must hold str request ids, got {rid!r:.80}")
    return ids


def _check_requests(requests) -> list[tuple]:
    """`requests` as a list of triples (or with a priority, and a LoRA request) with str
    ids (the engine keys a request by `str(id)`: any other id's events would never reach
    its sink)."""
    from pagedjax.lora import LoRARequest

    shape = "(request id, token ids, params[, priority[, lora_request]])"
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise TypeError(f"requests must be a list of {shape}, got {requests!r:.80}")
    out = []
    for i, r in enumerate(requests):
        if not isinstance(r, (tuple, list)) or len(r) not in (3, 4, 5):
            raise TypeError(f"requests[{i}] must be a {shape} tuple, got {r!r:.80}")
        if not isinstance(r[0], str):
            raise TypeError(f"requests[{i}]: the request id must be a str, got {r[0]!r:.80}")
        if len(r) == 5 and r[4] is not None and not isinstance(r[4], LoRARequest):
            raise TypeError(
                f"requests[{i}]: the lora_request must be a LoRARequest or None, got {r[4]!r:.80}"
            )
        out.append(tuple(r))
    return out
