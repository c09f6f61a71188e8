"""The OpenAI-compatible HTTP server over an `LLM` (standard library only).

`Server` (a `ThreadingHTTPServer`) binds at construction and serves once `start(llm)`
hands it the `LLM`, which an `EngineThread` (`pagedjax.serving`) owns from then on.
Each connection is a thread running `Handler`: it routes a request (`ROUTES`),
validates and tokenizes it on its own thread (`pagedjax.openai_api`), submits it to the
engine thread and waits on its own queue for the token events and final outputs, then
answers one JSON body or Server-Sent Events (`pagedjax.streamed_choice`: its
`StreamingMixin` streams them; `StreamedChoice`, re-exported here, is what a stream
sent of one completion). A client that goes away (checked every `POLL_S` while
waiting) has its requests aborted. The wire is
`HttpIO`'s, which `Handler` subclasses (`pagedjax.http_io`; its `MAX_BODY_BYTES`,
`TIMEOUT_S` and `ClientGone` are re-exported here): reading the body (a `Content-Length`
or `Transfer-Encoding: chunked`, at most `MAX_BODY_BYTES`), letting go a client silent
for `TIMEOUT_S`, and writing every error as OpenAI's JSON (`ApiError`), http.server's
own too. `Server` is that module's `HttpServer`: IPv6 hosts
bind, each request must come whole within `read_timeout` (not its answer's time), and
connections past `max_connections` get a 503.

scripts/serve.py is its command line; that script's docstring documents the endpoints,
fields, errors and streaming as a user sees them. Usage:

    server = Server(("127.0.0.1", 0), model_name="m")  # port 0: any free one; "::1" too
    server.start(LLM("path/to/checkpoint"))
    server.serve_forever()  # until server.shutdown() from another thread
    server.close()  # stops the engine, waits for the 503s of the requests in flight

LoRA adapters (vLLM's `--lora-modules`), which a request's `model` selects by name:

    sql = LoRARequest("sql", 1, "path/to/adapter")  # pagedjax.lora's
    server = Server(("127.0.0.1", 0), model_name="m", lora_modules=[sql])
    server.start(LLM("path/to/checkpoint", enable_lora=True))  # reads the adapters

With `allow_runtime_lora_updating=True` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), vLLM's
`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter`
{"lora_name"} change the served adapters while serving (`pagedjax.serving.LoRANames`);
without it those paths are unknown (404), as in vLLM.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

from pagedjax import openai_api as api
from pagedjax.http_io import (
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    READ_TIMEOUT_S,
    TIMEOUT_S,
    ClientGone,
    HttpIO,
    HttpServer,
    RequestTimeout,
    _allow,
)
from pagedjax.lora import LoRARequest
from pagedjax.metrics import prometheus_text
from pagedjax.openai_api import ApiError, Job
from pagedjax.serving import EngineStopped, EngineThread, LoRANames
from pagedjax.streamed_choice import StreamedChoice, StreamingMixin  # (StreamedChoice: re-exported)
from pagedjax.tool_calls import PARSERS

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "CLOSE_TIMEOUT_S",
    "POLL_S",
    "READ_TIMEOUT_S",
    "TIMEOUT_S",
    "LORA_ROUTES",
    "ClientGone",
    "Handler",
    "Server",
    "StreamedChoice",
]

POLL_S = 0.5  # how often a waiting handler checks that its client is still connected
CLOSE_TIMEOUT_S = 10.0  # how long `Server.close` waits for the requests in flight
# vLLM's runtime LoRA updating: paths served only with `allow_runtime_lora_updating`.
LORA_ROUTES = {"/v1/load_lora_adapter": "POST", "/v1/unload_lora_adapter": "POST"}


class Server(HttpServer):
    """The HTTP server; binds at construction, serves once `start(llm)` was called.

    Args:
      address: (host, port); port 0 picks a free one (`server_address` says which); an
        IPv6 literal host ("::1", "::") binds an IPv6 socket.
      model_name: the id of the one model.
      quiet: do not log requests to stderr.
      lora_modules: `LoRARequest`s of the LoRA adapters served beside the model (vLLM's
        `--lora-modules`): a request whose `model` is one's `lora_name` runs with it.
        Their names must differ from each other and from `model_name` (ValueError);
        `start` reads them into the engine.
      allow_runtime_lora_updating: serve vLLM's `/v1/load_lora_adapter` and
        `/v1/unload_lora_adapter` (`LORA_ROUTES`), which change the served adapters
        (`lora_names`); the engine must have LoRA enabled.
      tool_parser: the tool-call parser of chat's `tool_choice: "auto"` (a
        `pagedjax.tool_calls.PARSERS` name: vLLM's `--enable-auto-tool-choice
        --tool-call-parser`); None: "auto" is a 400 (ValueError for an unknown name).
      read_timeout: seconds a client has to send each request whole (line, headers,
        body), from when the server waits for it; else it is let go (a 408 in the
        body). Not the answer's time: a stream runs as long as it runs. None: no limit.
      max_connections: connections served at once (a thread each); one more gets a 503
        and is closed.
      enable_prompt_tokens_details: answers' `usage` (streamed: the usage chunk's) carries
        `prompt_tokens_details: {cached_tokens}`, the prompt tokens read from the prefix
        cache (vLLM's `--enable-prompt-tokens-details`; `openai_responses.usage`).

    Attributes:
      lora_names: the served adapters (`LoRANames`); `loras` is its current
        {name: LoRARequest}, which a handler reads once per request.
    """

    # The listen backlog (socketserver's default is 5): a burst of concurrent clients past
    # it had their connections dropped and retried by the kernel a second or more later.
    request_queue_size = 1024

    def __init__(
        self,
        address,
        *,
        model_name: str,
        quiet: bool = False,
        lora_modules: Sequence[LoRARequest] = (),
        allow_runtime_lora_updating: bool = False,
        tool_parser: str | None = None,
        read_timeout: float | None = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        enable_prompt_tokens_details: bool = False,
    ):
        if tool_parser is not None and tool_parser not in PARSERS:
            raise ValueError(f"tool_parser must be one of {sorted(PARSERS)}, got {tool_parser!r}")
        self.model_name, self.quiet = model_name, quiet
        self.tool_parser = tool_parser
        self.lora_names = LoRANames(model_name, lora_modules)
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.engine: EngineThread | None = None
        self._answering = 0  # requests whose handlers have yet to answer them
        self._answered = threading.Condition()
        super().__init__(
            address, Handler, read_timeout=read_timeout, max_connections=max_connections
        )

    def start(self, llm) -> None:
        """Reads the LoRA adapters into `llm` (`LLM.add_lora`: one that cannot serve is
        a ValueError or FileNotFoundError naming it), then starts the engine thread over
        `llm` (which nothing else may touch from now on). With
        `allow_runtime_lora_updating`, `llm` must have LoRA enabled (ValueError). Once
        only (RuntimeError: a second engine thread, on the same engine, would step it
        from two threads)."""
        if self.engine is not None:
            raise RuntimeError("the server's engine thread is started already (start once)")
        if self.allow_runtime_lora_updating and llm.lora is None:
            raise ValueError(
                "runtime LoRA updating needs an engine with LoRA: LLM(..., enable_lora=True)"
            )
        for name, r in self.loras.items():
            try:
                llm.add_lora(r)
            except (ValueError, FileNotFoundError) as e:
                raise type(e)(f"LoRA module {name!r}: {e}") from None
        self.tokenizer, self.max_model_len = llm.tokenizer, llm.max_model_len
        self.stop_ids = llm.stop_ids  # (reads only llm.eos_ids, which never changes)
        self.vocab_size = llm.config.vocab_size
        self.sampling_defaults = dict(llm.sampling_defaults)  # for request fields left out
        self.scheduling_policy = llm.scheduling_policy
        self.max_logprobs = llm.max_logprobs
        self.engine = EngineThread(llm)

    @property
    def loras(self) -> dict[str, LoRARequest]:
        """{name: LoRARequest} of the adapters served now (a snapshot: never changed in
        place)."""
        return self.lora_names.names

    def handle_error(self, request, client_address) -> None:
        # A client that reset its connection between two requests is not worth a
        # traceback on stderr (one per such client, --quiet or not).
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops the engine, waits up to `timeout` seconds for the requests in flight to be
        answered (a 503; a stream, its error event and [DONE]), and closes the socket
        (after `shutdown()` if serving). Handlers are daemon threads: without the wait, a
        process that exits after `close` cut them off mid-answer."""
        if self.engine is not None:
            self.engine.stop()
        with self._answered:
            self._answered.wait_for(lambda: self._answering == 0, timeout)
        self.server_close()

    @contextlib.contextmanager
    def answering(self):
        """Counts a request in flight from its body's reading to its answer (`close`)."""
        with self._answered:
            self._answering += 1
        try:
            yield
        finally:
            with self._answered:
                self._answering -= 1
                self._answered.notify_all()


_MODEL_PATH = "/v1/models/"  # and a model's id: one model's card


class Handler(StreamingMixin, HttpIO):
    """Answers one connection's requests (a thread each); `ROUTES`: each path's method.

    Its reading and writing on the connection are `HttpIO`'s (`pagedjax.http_io`); its
    streamed answers, `StreamingMixin`'s (`pagedjax.streamed_choice`).
    """

    server: Server
    ROUTES = {
        "/health": "GET",
        "/metrics": "GET",
        "/v1/models": "GET",
        "/v1/completions": "POST",
        "/v1/chat/completions": "POST",
        "/tokenize": "POST",
        "/detokenize": "POST",
        **LORA_ROUTES,
    }

    def log_message(self, format, *args):
        if not self.server.quiet:
            super().log_message(format, *args)

    # ------------------------------------------------------------------- plumbing

    def _dispatch(self, method: str) -> None:
        with self.server.answering():
            self._answer(method)

    def _answer(self, method: str) -> None:
        self._streaming = False  # whether a stream's headers went out
        self._head = method == "HEAD"  # a GET's status and headers, no body
        try:
            try:
                raw = self._read_body()
            except TimeoutError as e:
                self.close_connection = True
                msg = f"no more of the request body came for {self.timeout:g} s"
                raise ApiError(408, str(e) if isinstance(e, RequestTimeout) else msg) from None
            path = urlsplit(self.path).path.rstrip("/") or "/"
            allowed = self._allowed(path)
            if not allowed:
                raise ApiError(404, f"no such path {path!r}; try {', '.join(self._routes())}")
            if method == "OPTIONS":
                return self._send(204, b"", "text/plain", [("Allow", _allow(allowed))])
            if method != allowed and not (self._head and allowed == "GET"):
                raise ApiError(405, f"{method} is not allowed on {path}; use {allowed}")
            if path == "/health":
                if self.server.engine is None or not self.server.engine.alive:
                    raise ApiError(503, "the engine is not running")
                return self._send(200, b"ok", "text/plain; charset=utf-8")
            if path == "/v1/models":
                return self._json(200, self._models())
            if path.startswith(_MODEL_PATH):
                return self._json(200, self._model(unquote(path[len(_MODEL_PATH) :])))
            if path == "/metrics":
                # (the charset prometheus_client's CONTENT_TYPE_LATEST and vLLM's name: a
                # model or adapter name outside ASCII is UTF-8)
                ctype = "text/plain; version=0.0.4; charset=utf-8"
                return self._send(200, self._metrics(), ctype)
            if path in ("/tokenize", "/detokenize"):
                return self._json(200, self._tokens(path, self._parse(raw)))
            if path in LORA_ROUTES:
                message = self._update_loras(path, self._parse(raw))
                return self._send(200, message.encode(), "text/plain; charset=utf-8")
            self._generate(self._job(path, self._parse(raw)))
        except (BrokenPipeError, ConnectionResetError, TimeoutError, ClientGone):
            self.close_connection = True  # (TimeoutError: a client that stopped reading)
        except ApiError as e:
            self._error(e)
        except Exception as e:  # noqa: BLE001  (a bug here must not kill the connection silently)
            traceback.print_exc(file=sys.stderr)
            self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    def _routes(self) -> dict[str, str]:
        """`ROUTES`, less `LORA_ROUTES` unless the server allows runtime LoRA updating."""
        if self.server.allow_runtime_lora_updating:
            return self.ROUTES
        return {p: m for p, m in self.ROUTES.items() if p not in LORA_ROUTES}

    def _allowed(self, path: str) -> str:
        # (also a 405's Allow header, which for a model's card was ", OPTIONS")
        if path.startswith(_MODEL_PATH):
            return "GET"  # a model's card (OpenAI's models.retrieve)
        return self._routes().get(path, "")

    # ---------------------------------------------------------------- endpoints

    def _models(self) -> dict:
        """The model, then each LoRA adapter with vLLM's `parent` (the model) and `root`
        (its directory)."""
        srv = self.server
        card = dict(object="model", created=0, owned_by="pagedjax", max_model_len=srv.max_model_len)
        models = [dict(id=srv.model_name, **card)]
        for name, r in srv.loras.items():
            models.append(dict(id=name, **card, parent=srv.model_name, root=r.lora_path))
        return dict(object="list", data=models)

    def _model(self, model_id: str) -> dict:
        """`_models()`' entry of `model_id` (`GET /v1/models/{id}`, OpenAI's); a 404 naming
        the served ones for another."""
        models = self._models()["data"]
        for m in models:
            if m["id"] == model_id:
                return m
        names = ", ".join(repr(m["id"]) for m in models)
        msg = f"model {model_id!r} is not served here; served: {names}"
        raise ApiError(404, msg, None, "model_not_found")

    def _update_loras(self, path: str, body: dict) -> str:
        """vLLM's /v1/load_lora_adapter or /v1/unload_lora_adapter (`LoRANames.load` and
        `unload`, on the engine thread); its answer's text, as vLLM's."""
        srv = self.server
        if srv.engine is None:
            raise ApiError(503, "the engine is not started")
        name = body.get("lora_name")
        try:
            if path == "/v1/load_lora_adapter":
                lora_path = body.get("lora_path")
                if not all(isinstance(v, str) and v for v in (name, lora_path)):
                    msg = (
                        "Both 'lora_name' and 'lora_path' must be provided (non-empty strings), "
                        f"got lora_name={name!r:.80}, lora_path={lora_path!r:.80}"
                    )
                    bad = "lora_path" if isinstance(name, str) and name else "lora_name"
                    raise ApiError(400, msg, bad)
                srv.lora_names.load(srv.engine, name, lora_path)
                return f"Success: LoRA adapter '{name}' added successfully."
            name = _unload_name(body, srv.loras)
            srv.lora_names.unload(srv.engine, name)
            return f"Success: LoRA adapter '{name}' removed successfully."
        except KeyError:
            raise ApiError(
                404, f"The lora adapter {name!r} cannot be found.", "lora_name"
            ) from None
        except (ValueError, FileNotFoundError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        except EngineStopped:
            raise ApiError(503, "the engine is not running") from None

    def _metrics(self) -> bytes:
        """The engine's metrics in Prometheus' text format, read on its thread."""
        if self.server.engine is None:
            raise ApiError(503, "the engine is not started")
        try:
            name = self.server.model_name
            return self.server.engine.call(lambda llm: prometheus_text(llm, name)).encode()
        except EngineStopped:
            raise ApiError(503, "the engine is not running") from None
        except queue.Empty:  # a step (a compile) outlasting call's 60 s
            raise ApiError(503, "the engine is busy; try again") from None

    def _tokens(self, path: str, body: dict) -> dict:
        """/tokenize's or /detokenize's answer (the tokenizer only: no engine involved)."""
        srv = self.server
        if path == "/tokenize":
            return api.tokenize(
                body,
                model_name=srv.model_name,
                tokenizer=srv.tokenizer,
                max_model_len=srv.max_model_len,
                lora_names=srv.loras,
            )
        return api.detokenize(
            body,
            model_name=srv.model_name,
            tokenizer=srv.tokenizer,
            vocab_size=srv.vocab_size,
            lora_names=srv.loras,
        )

    def _job(self, path: str, body: dict) -> Job:
        """Validates a request and tokenizes its prompts (no engine involved)."""
        srv = self.server
        return api.parse_job(
            body,
            chat=path == "/v1/chat/completions",
            model_name=srv.model_name,
            tokenizer=srv.tokenizer,
            vocab_size=srv.vocab_size,
            max_model_len=srv.max_model_len,
            defaults=srv.sampling_defaults,
            scheduling_policy=srv.scheduling_policy,
            max_logprobs=srv.max_logprobs,
            loras=srv.loras,
            tool_parser=srv.tool_parser,
            prompt_tokens_details=srv.enable_prompt_tokens_details,
        )

    def _events(self, job: Job):
        """Yields the engine's events for the job's requests until all are done; aborts
        what is left when the caller stops early (a client gone, an error)."""
        srv, sink = self.server, queue.SimpleQueue()
        engine, pending = srv.engine, set(job.rids)
        requests = [
            (rid, ids, job.params, job.priority)
            for rid, ids in zip(job.rids, job.prompts, strict=True)
        ]
        try:
            tokens = job.streams_tokens
            if job.lora_request is None:
                engine.submit(requests, sink, tokens=tokens)
            else:  # its adapter as served now: it may have been unloaded since parse_job
                srv.lora_names.submit(engine, requests, sink, tokens=tokens, name=job.model)
        except KeyError:
            msg = f"model {job.model!r} is not served here any more (its LoRA adapter was unloaded)"
            raise ApiError(404, msg, "model", "model_not_found") from None
        except EngineStopped:
            raise ApiError(503, "the engine is not running (the server is shutting down)") from None
        checked = time.monotonic()
        try:
            while pending:
                try:
                    event = sink.get(timeout=POLL_S)
                except queue.Empty:
                    event = None
                if time.monotonic() - checked >= POLL_S:
                    checked = time.monotonic()
                    if self._client_gone():
                        raise ClientGone
                if event is None:
                    continue
                if event[0] == "error":
                    raise ApiError(event[2], event[3])
                if event[0] == "done":
                    pending.discard(event[1])
                    event = ("done", event[1], job.output(event[2]))
                yield event
        finally:
            if pending:
                with contextlib.suppress(EngineStopped):
                    engine.abort(pending)

    def _generate(self, job: Job) -> None:
        if self.server.engine is None:
            raise ApiError(503, "the engine is not started")
        head = api.response_head(job, self.server.model_name)
        with contextlib.closing(self._events(job)) as events:
            if job.stream:
                return self._stream(job, head, events)
            outs = {ev[1]: ev[2] for ev in events if ev[0] == "done"}
        self._json(200, api.response_body(job, head, outs, self.server.tokenizer))


def _unload_name(body: dict, loras: dict) -> str:
    """The adapter an unload body names: its `lora_name`, or the one served with its
    `lora_int_id` (vLLM's; a 404 if none is); both given must agree (a 400)."""
    name, i = body.get("lora_name"), body.get("lora_int_id")
    if name is not None and not (isinstance(name, str) and name):
        raise ApiError(400, f"lora_name must be a non-empty string, got {name=!r:.80}", "lora_name")
    if i is not None and (isinstance(i, bool) or not isinstance(i, int)):
        raise ApiError(400, f"lora_int_id must be an int, got lora_int_id={i!r:.80}", "lora_int_id")
    if name is None and i is None:
        raise ApiError(400, "either 'lora_name' or 'lora_int_id' must be provided", "lora_name")
    if i is None:
        return name
    by_id = next((n for n, r in loras.items() if r.lora_int_id == i), None)
    if by_id is None:
        raise ApiError(
            404, f"The lora adapter with lora_int_id {i} cannot be found.", "lora_int_id"
        )
    if name is not None and name != by_id:
        msg = f"lora_int_id {i} is the lora adapter {by_id!r}, not lora_name {name!r}"
        raise ApiError(400, msg, "lora_int_id")
    return by_id


for _method in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):  # do_GET ...
    setattr(Handler, f"do_{_method}", lambda self, m=_method: self._dispatch(m))
