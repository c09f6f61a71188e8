"""An OpenAI-compatible HTTP server over pagedjax's engine (standard library only).

    python scripts/serve.py --checkpoint path/to/Llama-3.2-1B-Instruct --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

Point an OpenAI client at `http://HOST:PORT/v1` (any API key). Endpoints:

    GET  /health               200 "ok"
    GET  /v1/models            the one model: id = --served-model-name, else the
                               checkpoint directory's name ("pagedjax-demo" without one)
    POST /v1/completions       prompt: a string, a list of strings, a list of token ids
                               or a list of such lists
    POST /v1/chat/completions  messages, rendered with the checkpoint's chat template
                               (or --chat-template FILE); content is a string or a list
                               of {"type": "text", "text"} parts

Fields of both POSTs: `model` (optional; another name is a 400), `max_tokens` (default
16 for completions; for chat `max_completion_tokens` or `max_tokens`, default: up to
the model's length), `temperature` (default 1), `top_p`, `n`, `stop` (a string or a
list), `seed`, `presence_penalty`, `frequency_penalty`, `stream`, `stream_options:
{"include_usage"}`, `logit_bias` ({"token id": value in [-100, 100]}), and vLLM's
`top_k` (-1 or 0: off), `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`min_tokens`, `cache_salt`. Logprobs: completions take `logprobs: K` and answer
`{tokens, token_logprobs, top_logprobs, text_offset}` (offsets into the completion
text); chat takes `logprobs: true` with `top_logprobs: K` and answers `{content:
[{token, logprob, bytes, top_logprobs}]}`; K <= 20; all are the model's raw
log-probabilities (before temperature and truncation). Each prompt of a completions
batch is one engine request; choice `i * n + j` is completion j of prompt i.
`finish_reason` is "stop" (EOS, a stop string or a stop token) or "length". Errors are
OpenAI's `{"error": {message, type, param, code}}`: 400 for a bad field (the message
names the value), a prompt too long for `--max-model-len`, an unknown model or bad
JSON; 404 for an unknown path; 405 for a wrong method; 500 when the engine failed.

Not supported (400 when asked for): `echo: true`, `best_of` > 1, `suffix`, tools
and function calling, a `response_format` other than text, beam search, and logprobs
with `stream` (the engine's per-token callback does not carry them). Other unknown
fields are ignored.

Streaming (`stream: true`): Server-Sent Events, one `data: {chunk}` per new piece of
text (`text_completion` chunks, or `chat.completion.chunk` with `delta: {role}` first,
then `delta: {content}`), a last chunk per choice with its `finish_reason`, a usage
chunk when `stream_options.include_usage`, then `data: [DONE]`. Pieces come from an
incremental detokenizer per completion (`Tokenizer.stream()`), so a multi-byte
character is never split. With stop strings, the last `max(len(stop)) - 1` characters
are held back until more text comes or the completion ends: the engine stops on the
token that completes a stop string and cuts the text at it, so no text streamed can
be cut later. (With `min_tokens` too, the engine cuts at a stop string's first
occurrence, which may come before the one it stopped on: such completions stream as
one piece at the end.) The last chunk carries what the engine's final text has beyond
what was streamed, so the pieces always add up to the non-streamed text. The HTTP
status and headers go out with the first event: a step that fails before it is still
a 500; one that fails later ends the stream with an `{"error"}` event.

Threading: one engine thread owns the `LLM` and is the only code that touches it
(JAX and the engine are not thread-safe). It loops `llm.step()` while there is work
and otherwise blocks on a queue of commands (add requests, abort, stop, run a function
on it). Each HTTP connection is a thread (`ThreadingHTTPServer`) that validates and
tokenizes on its own (SamplingParams, prompts, the chat template: the tokenizer is
Rust's `tokenizers` used only through read-only calls, and Jinja templates render
concurrently), so bad requests never reach the engine; it then queues its requests and
waits on its own queue for token events and the final outputs. A client that goes
away (a failed write, or its socket closed while waiting) has its requests aborted.
If a step raises, the engine recovers by itself (`LLM.step`): the requests it held
fail with a 500 and the server goes on.

For trusted networks only: there is no authentication and no rate limit; bind to
127.0.0.1 (the default) unless the network is yours. Flags: `--checkpoint`, `--host`,
`--port`, `--served-model-name`, `--chat-template FILE`, `--max-model-len N`, `--seed`
(for requests without one), scripts/generate.py's engine flags (`--page-size`,
`--num-pages` | `--kv-memory-fraction`, `--max-batch-tokens`, `--backend`,
`--tensor-parallel`, `--compilation-cache`), `--no-prefix-caching`,
`--no-async-scheduling`, `--quiet` (no request log). Bad flags, a checkpoint that
cannot serve text or a port that cannot be bound end with one line on stderr and exit
status 2, before any weights load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import queue
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate as gen  # noqa: E402  (the sibling script: its flags, checks and cache helpers)

from pagedjax.request import SamplingParams, encode_prompt  # noqa: E402

MAX_BODY_BYTES = 32 * 2**20
POLL_S = 0.5  # how often a waiting handler checks that its client is still connected
DEMO_NAME = "pagedjax-demo"
PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Request fields passed as they are to SamplingParams (which validates them).
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "cache_salt",
)


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return dict(error=dict(message=self.message, type=kind, param=self.param, code=self.code))


class ClientGone(Exception):
    """The HTTP client closed its connection."""


# ------------------------------------------------------------------ engine thread


class EngineThread:
    """The one thread that touches the `LLM`: steps it while it has work, else waits
    for commands. Events go to each request's sink (a queue): `("token", rid, index,
    token_id)` (only for sinks that asked for tokens), `("done", rid, RequestOutput)`,
    `("error", rid, status, message)`.

    Attributes:
      num_aborted: requests aborted because their client went away.
      num_failed_steps: engine steps that raised (their requests got a 500).
    """

    def __init__(self, llm):
        self.llm = llm
        self.num_aborted = 0
        self.num_failed_steps = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[queue.SimpleQueue, bool]] = {}  # rid -> (sink, tokens)
        self._lock = threading.Lock()
        self._alive = True
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]], sink, *, tokens: bool):
        """Queues `(request id, prompt ids, params)` requests, all or none (an error event)."""
        self._put(("add", requests, sink, tokens))

    def abort(self, request_ids) -> None:
        """Aborts requests (those already finished are ignored)."""
        self._put(("abort", list(request_ids)))

    def call(self, fn, timeout: float | None = 60.0):
        """`fn(llm)` run on the engine thread between steps; returns its result."""
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._put(("call", fn, box))
        ok, value = box.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def stop(self, timeout: float = 60.0) -> None:
        """Aborts every request (their clients get a 503) and ends the thread."""
        with contextlib.suppress(ApiError):
            self._put(("stop",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._alive

    def _put(self, command) -> None:
        with self._lock:
            if not self._alive:
                raise ApiError(503, "the engine is not running (the server is shutting down)")
            self._commands.put(command)

    def _run(self) -> None:
        try:
            while True:
                commands = [] if self.llm.has_unfinished_requests() else [self._commands.get()]
                with contextlib.suppress(queue.Empty):
                    while True:
                        commands.append(self._commands.get_nowait())
                for command in commands:
                    if command[0] == "stop":
                        return
                    self._handle(command)
                if self.llm.has_unfinished_requests():
                    self._step()
        finally:
            with self._lock:
                self._alive = False
            self._fail_all(503, "the server is shutting down")
            with contextlib.suppress(queue.Empty):
                while True:
                    command = self._commands.get_nowait()
                    if command[0] == "add":
                        command[2].put(("error", None, 503, "the server is shutting down"))
                    elif command[0] == "call":
                        command[2].put((False, ApiError(503, "the engine stopped")))

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, requests, sink, tokens = command
            added = []
            try:
                for rid, ids, params in requests:
                    self.llm.add_request(ids, params, request_id=rid)
                    added.append(rid)
                    self._sinks[rid] = (sink, tokens)
            except Exception as e:  # noqa: BLE001  (answered, and the engine goes on)
                for rid in added:
                    self.llm.abort(rid)
                    self._sinks.pop(rid, None)
                status = 400 if isinstance(e, (ValueError, TypeError)) else 500
                sink.put(("error", None, status, str(e)))
        elif kind == "abort":
            for rid in command[1]:
                if self._sinks.pop(rid, None) is not None:
                    self.llm.abort(rid)
                    self.num_aborted += 1
        elif kind == "call":
            try:
                command[2].put((True, command[1](self.llm)))
            except Exception as e:  # noqa: BLE001  (raised again in the caller)
                command[2].put((False, e))

    def _step(self) -> None:
        try:
            finished = self.llm.step(on_token=self._on_token)
        except Exception as e:  # noqa: BLE001  (LLM.step recovered; its requests fail)
            self.num_failed_steps += 1
            traceback.print_exc(file=sys.stderr)
            self._fail_all(500, f"the engine step failed: {type(e).__name__}: {e}")
            return
        for out in finished:
            entry = self._sinks.pop(out.request_id, None)
            if entry is not None:
                entry[0].put(("done", out.request_id, out))

    def _on_token(self, rid: str, index: int, token: int) -> None:
        entry = self._sinks.get(rid)
        if entry is not None and entry[1]:
            entry[0].put(("token", rid, index, token))

    def _fail_all(self, status: int, message: str) -> None:
        for rid, (sink, _) in list(self._sinks.items()):
            with contextlib.suppress(Exception):
                self.llm.abort(rid)  # a failed step aborted them already; a stop did not
            sink.put(("error", rid, status, message))
        self._sinks.clear()


# ------------------------------------------------------ requests (handler threads)


def _sampling_params(body: dict, *, max_tokens, logprobs, stream: bool, vocab_size: int):
    """The request's SamplingParams (ApiError 400 naming the field and value)."""
    for name, bad, why in (
        ("echo", bool(body.get("echo")), "echo=true is not supported (the prompt is not returned)"),
        ("best_of", body.get("best_of") not in (None, 1), "best_of is not supported"),
        ("suffix", body.get("suffix") is not None, "suffix is not supported"),
        ("tools", bool(body.get("tools")), "tools (function calling) are not supported"),
        ("functions", bool(body.get("functions")), "function calling is not supported"),
        (
            "response_format",
            body.get("response_format") not in (None, {"type": "text"}),
            "response_format other than text is not supported",
        ),
        (
            "logprobs",
            stream and logprobs is not None,
            "logprobs are not supported with stream=true; ask without streaming",
        ),
    ):
        if bad:
            raise ApiError(400, f"{why}, got {name}={body.get(name)!r}", name)
    kw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    if kw.get("top_k") == -1:  # vLLM's "off"
        kw["top_k"] = 0
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, (str, list)):
            raise ApiError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
        kw["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise ApiError(
                400, f"stop_token_ids must be a list of ints, got {ids!r}", "stop_token_ids"
            )
        kw["stop_token_ids"] = ids
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and bias:  # JSON keys are strings; the engine wants ids
        kw["logit_bias"] = {}
        for key, value in bias.items():
            t = int(key) if key.isdigit() else -1
            if not 0 <= t < vocab_size:
                msg = f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}"
                raise ApiError(400, msg, "logit_bias")
            kw["logit_bias"][t] = value
    elif bias not in (None, {}):
        kw["logit_bias"] = bias  # SamplingParams says what is wrong with it
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kw)
    except (ValueError, TypeError) as e:
        name = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), name if name in PARAM_FIELDS else None) from None


def _int_field(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(400, f"{name} must be an int, got {name}={v!r}", name)
    return v


def _completion_prompts(prompt) -> list:
    """The prompts of a completions request: strings or token id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return [prompt]
        if all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt):
            return prompt
    raise ApiError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of token "
        f"id lists, got prompt={prompt!r:.80}",
        "prompt",
    )


def _chat_messages(messages) -> list[dict]:
    """`messages` with list-of-parts contents joined into strings."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages must be a non-empty list, got {messages!r:.80}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object, got {m!r:.80}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not (isinstance(p, dict) and p.get("type") == "text" and "text" in p):
                    raise ApiError(
                        400, f"messages[{i}]: only text content parts are supported, got {p!r:.80}"
                    )
                parts.append(p["text"])
            content = "\n".join(parts)
        out.append({**m, "content": "" if content is None else content})
    return out


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False) if tok is not None else ""


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI's convention


def _top(entry: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely of a logprobs entry (the sampled token first, then the top k)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tok, c, k: int) -> dict:
    """OpenAI completions-style logprobs of one completion."""
    tokens = [_token_text(tok, t) for t in c.token_ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    top = []  # dicts keyed by text: of two tokens with one text, the likelier stays
    for e in c.logprobs:
        top.append({})
        for t, x in _top(e, k):
            top[-1].setdefault(_token_text(tok, t), _lp(x))
    return dict(
        tokens=tokens,
        token_logprobs=[_lp(e[t]) for t, e in zip(c.token_ids, c.logprobs, strict=True)],
        top_logprobs=top,
        text_offset=offsets,
    )


def chat_logprobs(tok, c, k: int) -> dict:
    """OpenAI chat-style logprobs of one completion."""

    def item(t, x):
        s = _token_text(tok, t)
        return dict(token=s, logprob=_lp(x), bytes=list(s.encode()))

    content = []
    for t, e in zip(c.token_ids, c.logprobs, strict=True):
        content.append({**item(t, e[t]), "top_logprobs": [item(*kv) for kv in _top(e, k)]})
    return dict(content=content)


@dataclasses.dataclass
class Job:
    """One HTTP request's work: its engine requests and how to answer."""

    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def rids(self) -> list[str]:
        return [f"{self.id}-{i}" for i in range(len(self.prompts))]


# ---------------------------------------------------------------------------- HTTP


class Server(ThreadingHTTPServer):
    """The HTTP server; binds at construction, serves once `start(llm)` was called.

    Args:
      address: (host, port); port 0 picks a free one (`server_address` says which).
      model_name: the id of the one model.
      quiet: do not log requests to stderr.
    """

    daemon_threads = True

    def __init__(self, address, *, model_name: str, quiet: bool = False):
        self.model_name, self.quiet = model_name, quiet
        self.engine: EngineThread | None = None
        super().__init__(address, Handler)

    def start(self, llm) -> None:
        """Starts the engine thread over `llm` (which nothing else may touch from now on)."""
        self.tokenizer, self.max_model_len = llm.tokenizer, llm.max_model_len
        self.vocab_size = llm.config.vocab_size
        self.engine = EngineThread(llm)

    def close(self) -> None:
        """Stops the engine and closes the socket (after `shutdown()` if serving)."""
        if self.engine is not None:
            self.engine.stop()
        self.server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server
    ROUTES = {
        "/health": "GET",
        "/v1/models": "GET",
        "/v1/completions": "POST",
        "/v1/chat/completions": "POST",
    }

    def log_message(self, format, *args):
        if not self.server.quiet:
            super().log_message(format, *args)

    # ------------------------------------------------------------------- plumbing

    def _dispatch(self, method: str) -> None:
        self._streaming = False  # whether a stream's headers went out
        try:
            raw = self._read_body()
            path = urlsplit(self.path).path.rstrip("/") or "/"
            allowed = self.ROUTES.get(path)
            if allowed is None:
                raise ApiError(404, f"no such path {path!r}; try {', '.join(self.ROUTES)}")
            if method != allowed:
                raise ApiError(405, f"{method} is not allowed on {path}; use {allowed}")
            if path == "/health":
                if self.server.engine is None or not self.server.engine.alive:
                    raise ApiError(503, "the engine is not running")
                return self._send(200, b"ok", "text/plain; charset=utf-8")
            if path == "/v1/models":
                return self._json(200, self._models())
            self._generate(self._job(path, self._parse(raw)))
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            self.close_connection = True
        except ApiError as e:
            self._error(e)
        except Exception as e:  # noqa: BLE001  (a bug here must not kill the connection silently)
            traceback.print_exc(file=sys.stderr)
            self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    def _read_body(self) -> bytes:
        n = self.headers.get("Content-Length")
        try:
            n = int(n or 0)
        except ValueError:
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {n!r}") from None
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"request body of {n} bytes is over {MAX_BODY_BYTES}")
        return self.rfile.read(n) if n > 0 else b""

    def _send(self, status: int, data: bytes, ctype: str, headers=()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self._send(status, data, "application/json")

    def _error(self, e: ApiError) -> None:
        if self._streaming:  # the stream is open: tell it there, then end it
            with contextlib.suppress(OSError):
                self._chunk(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                self._chunk(b"")
            self.close_connection = True
            return
        headers = [("Allow", self.ROUTES.get(urlsplit(self.path).path.rstrip("/"), ""))]
        with contextlib.suppress(OSError):
            data = json.dumps(e.body(), ensure_ascii=False).encode()
            self._send(e.status, data, "application/json", headers if e.status == 405 else ())

    def _chunk(self, data: bytes) -> None:
        """One chunk of a chunked response (b"": the last)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _event(self, obj) -> None:
        self._chunk(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _parse(self, raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    # ---------------------------------------------------------------- endpoints

    def _models(self) -> dict:
        srv = self.server
        model = dict(
            id=srv.model_name,
            object="model",
            created=0,
            owned_by="pagedjax",
            max_model_len=srv.max_model_len,
        )
        return dict(object="list", data=[model])

    def _job(self, path: str, body: dict) -> Job:
        """Validates a request and tokenizes its prompts (no engine involved)."""
        srv, chat = self.server, path == "/v1/chat/completions"
        model = body.get("model")
        if model is not None and model != srv.model_name:
            raise ApiError(
                400,
                f"model {model!r} is not served here; it is {srv.model_name!r}",
                "model",
                "model_not_found",
            )
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") or {}
        include_usage = stream and isinstance(opts, dict) and bool(opts.get("include_usage"))
        tok = srv.tokenizer
        if chat:
            if tok is None or tok.chat_template is None:
                why = "no tokenizer" if tok is None else tok.chat_template_source
                raise ApiError(400, f"this model cannot chat: {why}; use /v1/completions")
            messages = _chat_messages(body.get("messages"))
            try:
                prompts = [tok.encode_chat(messages)]
            except (ValueError, TypeError) as e:
                raise ApiError(400, f"messages: {e}", "messages") from None
            except ImportError as e:
                raise ApiError(500, str(e)) from None
        else:
            prompts = _completion_prompts(body.get("prompt"))
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(encode_prompt(p, tok, srv.vocab_size, srv.max_model_len)[1])
            except (ValueError, TypeError) as e:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise ApiError(400, f"{where}{e}", "messages" if chat else "prompt") from None
        if chat:
            want = body.get("logprobs")
            if want not in (None, True, False):
                msg = f"logprobs must be a boolean, got logprobs={want!r}"
                raise ApiError(400, msg, "logprobs")
            k = _int_field(body, "top_logprobs", None)
            if k is not None and not want:
                raise ApiError(400, f"top_logprobs needs logprobs=true, got top_logprobs={k}")
            logprobs = (k or 0) if want else None
            limit = _int_field(body, "max_tokens", srv.max_model_len - len(ids[0]))
            limit = _int_field(body, "max_completion_tokens", limit)
        else:
            logprobs = body.get("logprobs")
            limit = _int_field(body, "max_tokens", 16)
        params = _sampling_params(
            body, max_tokens=limit, logprobs=logprobs, stream=stream, vocab_size=srv.vocab_size
        )
        if params.stop and tok is None:
            raise ApiError(400, "stop strings need a tokenizer; this model has none", "stop")
        return Job(chat, ids, params, stream, include_usage)

    def _events(self, job: Job):
        """Yields the engine's events for the job's requests until all are done; aborts
        what is left when the caller stops early (a client gone, an error)."""
        engine, sink = self.server.engine, queue.SimpleQueue()
        pending = set(job.rids)
        engine.submit(
            [(rid, ids, job.params) for rid, ids in zip(job.rids, job.prompts, strict=True)],
            sink,
            tokens=job.stream,
        )
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
                yield event
        finally:
            if pending:
                with contextlib.suppress(ApiError):
                    engine.abort(pending)

    def _generate(self, job: Job) -> None:
        if self.server.engine is None:
            raise ApiError(503, "the engine is not started")
        kind = "chat.completion" if job.chat else "text_completion"
        head = dict(
            id=("chatcmpl-" if job.chat else "cmpl-") + job.id,
            object=kind + (".chunk" if job.stream and job.chat else ""),
            created=job.created,
            model=self.server.model_name,
        )
        index = {rid: i for i, rid in enumerate(job.rids)}
        n = job.params.n
        with contextlib.closing(self._events(job)) as events:
            if job.stream:
                return self._stream(job, head, index, events)
            outs = {ev[1]: ev[2] for ev in events if ev[0] == "done"}
        tok, k = self.server.tokenizer, job.params.logprobs
        choices = []
        for rid in job.rids:
            for c in outs[rid].outputs:
                choice = dict(index=index[rid] * n + c.index)
                if job.chat:
                    choice["message"] = dict(role="assistant", content=c.text)
                    choice["logprobs"] = None if k is None else chat_logprobs(tok, c, k)
                else:
                    choice["text"] = c.text
                    choice["logprobs"] = None if k is None else completion_logprobs(tok, c, k)
                choice["finish_reason"] = c.finish_reason
                choices.append(choice)
        self._json(200, dict(**head, choices=choices, usage=self._usage(outs.values())))

    @staticmethod
    def _usage(outs) -> dict:
        p = sum(len(o.prompt_token_ids) for o in outs)
        c = sum(len(x.token_ids) for o in outs for x in o.outputs)
        return dict(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def _stream(self, job: Job, head: dict, index: dict, events) -> None:
        n, tok = job.params.n, self.server.tokenizer
        hold = max(map(len, job.params.stop), default=1) - 1
        if job.params.stop and job.params.min_tokens:
            hold = sys.maxsize  # see the module docstring
        decoders = {}  # (rid, completion index) -> StreamDecoder
        sent = {}  # (rid, completion index) -> characters streamed

        def chunk(rid, i, text, finish=None):
            choice = dict(index=index[rid] * n + i)
            if job.chat:
                choice["delta"] = {"content": text} if text or finish is None else {}
                choice["logprobs"] = None
            else:
                choice.update(text=text, logprobs=None)
            choice["finish_reason"] = finish
            self._event(dict(**head, choices=[choice]))

        outs = []
        for event in events:
            if not self._streaming:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._streaming = True
                if job.chat:
                    for c in range(len(job.rids) * n):
                        delta = dict(role="assistant", content="")
                        choice = dict(index=c, delta=delta, logprobs=None, finish_reason=None)
                        self._event(dict(**head, choices=[choice]))
            if event[0] == "token":
                _, rid, i, token = event
                key = (rid, i)
                if key not in decoders:
                    decoders[key], sent[key] = tok.stream(), 0
                decoders[key].add(token)
                text = decoders[key].text
                end = len(text) - hold
                if end > sent[key]:
                    chunk(rid, i, text[sent[key] : end])
                    sent[key] = end
            else:
                _, rid, out = event
                outs.append(out)
                for c in out.outputs:
                    done = sent.get((rid, c.index), 0)
                    chunk(rid, c.index, c.text[done:], c.finish_reason or "stop")
        if job.include_usage:
            self._event(dict(**head, choices=[], usage=self._usage(outs)))
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")


for _method in ("GET", "POST", "PUT", "DELETE", "PATCH"):  # do_GET ... do_PATCH
    setattr(Handler, f"do_{_method}", lambda self, m=_method: self._dispatch(m))


# ----------------------------------------------------------------------------- CLI


def build_parser() -> gen.Parser:
    p = gen.Parser(prog="scripts/serve.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        help="HF directory or pagedjax orbax checkpoint (default: the embedded demo model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model id (default: dir name)")
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file to use instead of the checkpoint's",
    )
    p.add_argument(
        "--max-model-len", type=int, metavar="N", help="longest sequence (default: the model's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    gen.add_engine_flags(p)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="apply each step's tokens on the host before dispatching the next",
    )
    p.add_argument("--quiet", action="store_true", help="do not log each request")
    return p


def model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    return DEMO_NAME if args.checkpoint is None else Path(args.checkpoint).resolve().name


def run(args) -> int:
    from pagedjax.engine import LLM

    gen.check_engine_flags(args)
    if not 0 <= args.port < 2**16:
        raise gen.BadInput(f"--port must be in [0, 65535], got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise gen.BadInput(f"--max-model-len must be >= 2, got {args.max_model_len}")
    tok = None
    if args.chat_template is not None:
        hint = "give a Jinja chat template file"
        tok = gen.chat_tokenizer(args.checkpoint, args.chat_template, hint)
    try:  # before the weights load: a port in use is a one-line error
        server = Server((args.host, args.port), model_name=model_name(args), quiet=args.quiet)
    except OSError as e:
        raise gen.BadInput(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    try:
        gen.enable_compilation_cache(gen.compilation_cache_dir(args.compilation_cache))
        llm = LLM(
            args.checkpoint,
            page_size=args.page_size,
            num_pages=args.num_pages,
            kv_memory_fraction=args.kv_memory_fraction,
            max_num_seqs=min(64, args.max_batch_tokens),
            max_num_batched_tokens=args.max_batch_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            backend=args.backend,
            seed=args.seed,
            max_model_len=args.max_model_len,
            tokenizer=tok,
            tensor_parallel=args.tensor_parallel,
            async_scheduling=not args.no_async_scheduling,
        )
        server.start(llm)
        print(
            f"serving {server.model_name} ({llm.model_source}) at {server.url}/v1; Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
    finally:
        server.close()
    return 0


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return run(args)
    except (gen.BadInput, ValueError, TypeError, FileNotFoundError, NotADirectoryError) as e:
        msg = " ".join(str(e).split())  # multi-line errors (checkpoint listings) on one line
        print(f"error: {msg[:2000]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
