"""The HTTP transport under the server's `Handler` (standard library only).

`HttpIO` (a `BaseHTTPRequestHandler`) is what `pagedjax.http_server.Handler` subclasses
for the wire: it reads a request's body (a `Content-Length` or `Transfer-Encoding:
chunked`, at most `MAX_BODY_BYTES`; the 100 that `Expect: 100-continue` waits for goes
out only once the body is to be read) and parses it as a JSON object; it writes an
answer with its length, OpenAI's JSON error (`ApiError`; http.server's own errors too),
or Server-Sent Events in chunks (to an HTTP/1.0 client, which knows no chunks, as they
are, the connection's end ending them); and it tells whether a client went away
(`_client_gone`; `ClientGone`). A socket silent for `TIMEOUT_S` times out. What a path
means (routes, endpoints, the engine) is the subclass's: `_allowed` is its one hook.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from pagedjax.openai_api import ApiError

__all__ = ["MAX_BODY_BYTES", "TIMEOUT_S", "ClientGone", "HttpIO"]

MAX_BODY_BYTES = 32 * 2**20
# A client silent this long in the middle of a request, between two requests, or not
# reading a stream is let go (a body shorter than its Content-Length held a thread forever).
TIMEOUT_S = 60.0


class ClientGone(Exception):
    """The HTTP client closed its connection."""


class HttpIO(BaseHTTPRequestHandler):
    """Reads request bodies and writes answers on one connection (see the module).

    A subclass resets `_streaming` and `_head` at each request and may override
    `_allowed` (the Allow header of a 405).
    """

    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT_S  # of each read and write on the socket (StreamRequestHandler's)
    _streaming = False  # whether a stream's headers went out
    _head = False  # a HEAD request: a GET's status and headers, no body
    _continue = False  # the client waits for a 100 (Continue) before it sends the body

    def _allowed(self, path: str) -> str:
        """The method that serves `path`, "" if none: a 405's Allow header names it."""
        return ""

    # ----------------------------------------------------------------- reading

    def handle_expect_100(self) -> bool:
        # http.server sent the 100 at once: a client then sent a body over the limit,
        # which the 413 (or the 501 of a Transfer-Encoding) cut with a reset. It goes out
        # once the body is to be read (`_read_body`); a refusal goes out instead.
        self._continue = True
        return True

    def _read_body(self) -> bytes:
        te = self.headers.get_all("Transfer-Encoding", [])
        if te:
            if [c.strip().lower() for c in ",".join(te).split(",")] != ["chunked"]:
                self.close_connection = True  # its body's end cannot be found: unread
                msg = f"Transfer-Encoding {', '.join(te)!r:.80} is not supported; use chunked"
                raise ApiError(501, msg)
            if "Content-Length" in self.headers:  # RFC 9112 6.1: a smuggling attempt, or
                self.close_connection = True  # a proxy's mistake: answered, then closed
            self._send_continue()
            return self._read_chunked()
        # Two different lengths are a 400 (RFC 9112 6.3), as is what int() reads but is no
        # length: "+5", "5_0", "-5", "" (it was read as none).
        lengths = self.headers.get_all("Content-Length")
        n = "0" if lengths is None else ", ".join(sorted({v.strip() for v in lengths}))
        if not (n.isascii() and n.isdigit()):
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {n!r:.80}")
        if len(n.lstrip("0")) > 18 or int(n) > MAX_BODY_BYTES:  # (int() of 4301 digits raises)
            self.close_connection = True
            raise ApiError(413, f"request body of {n:.40} bytes is over {MAX_BODY_BYTES}")
        self._send_continue()
        return self._read_exactly(int(n))

    def _send_continue(self) -> None:
        """The 100 (Continue) that the client waits for, if it does (`handle_expect_100`)."""
        if self._continue:
            self._continue = False
            self.send_response_only(100)
            self.end_headers()

    def _read_exactly(self, n: int) -> bytes:
        """The next `n` bytes of the body; a 400 if the client ended it before them (a
        cut body could still parse, and be answered as if whole)."""
        data = self.rfile.read(n) if n > 0 else b""
        if len(data) < n:
            self.close_connection = True
            raise ApiError(400, f"the request body ended after {len(data)} of {n} bytes")
        return data

    def _read_chunked(self) -> bytes:
        """A body sent with `Transfer-Encoding: chunked` (clients that stream uploads)."""
        data = bytearray()
        while True:
            line = self.rfile.readline(1024)  # (a longer one's rest was read as the data)
            size = line.split(b";")[0].strip()
            hexdigits = b"0123456789abcdefABCDEF"  # int(, 16) reads "0x5" and "+5" too
            if not line.endswith(b"\n") or not size or size.strip(hexdigits):
                self.close_connection = True
                raise ApiError(400, f"bad chunk size {line[:40]!r} in a chunked body")
            size = int(size, 16)
            if size == 0:
                while self.rfile.readline(65536) not in (b"\r\n", b"\n", b""):
                    pass  # trailer fields: none are used
                return bytes(data)
            if len(data) + size > MAX_BODY_BYTES:
                self.close_connection = True
                raise ApiError(413, f"request body is over {MAX_BODY_BYTES} bytes")
            data += self._read_exactly(size)
            end = self.rfile.readline(2)  # its CRLF (what came up to a line end was skipped)
            if end not in (b"\r\n", b"\n"):
                self.close_connection = True
                raise ApiError(400, f"a chunk of {size} bytes ends with {end!r}, not CRLF")

    def _parse(self, raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except ValueError as e:  # bad JSON, UTF-8, or an int of over 4300 digits (was a 500)
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:  # (it was a 500)
            raise ApiError(400, "the body's JSON is nested too deeply to parse") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    # ----------------------------------------------------------------- writing

    def _send(self, status: int, data: bytes, ctype: str, headers=()) -> None:
        self.send_response(status)
        if self.request_version == "HTTP/1.0" and not self.close_connection:
            # Its client asked to keep it (an HTTP/1.0 client that is not told so reads
            # the answer up to the connection's end, which came only after TIMEOUT_S).
            self.send_header("Connection", "keep-alive")
        self.send_header("Content-Type", ctype)
        if status != 204:  # RFC 9110 8.6: a 204 MUST NOT have one
            self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if not self._head:
            self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain=None) -> None:
        """http.server's own errors (a bad request line, too many headers, an unknown
        method, ...) as OpenAI's JSON error, as all others are (they were HTML pages)."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # (http.server's until it read a request line)
            self.request_version = "HTTP/1.0"  # 0.9's answers have no status line, no headers
        reason = self.responses.get(code, ("error",))[0]
        self.log_error("code %d, message %s", code, message)
        data = json.dumps(ApiError(code, message or reason).body()).encode()
        self.send_response(code)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self._send(status, data, "application/json")

    def _error(self, e: ApiError) -> None:
        if self._streaming:  # the stream is open: tell it there, then end it as vLLM does
            with contextlib.suppress(OSError):
                self._chunk(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                self._end_stream()
            self.close_connection = True
            return
        headers = [("Allow", _allow(self._allowed(urlsplit(self.path).path.rstrip("/"))))]
        with contextlib.suppress(OSError):
            data = json.dumps(e.body(), ensure_ascii=False).encode()
            self._send(e.status, data, "application/json", headers if e.status == 405 else ())

    # ------------------------------------------------------- server-sent events

    def _start_stream(self) -> None:
        """A 200 with Server-Sent Events: chunked, or to an HTTP/1.0 client up to the
        connection's end."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self._streaming = True

    def _event(self, obj) -> None:
        self._chunk(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    def _end_stream(self) -> None:
        """OpenAI's last event, then the chunked body's end."""
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        """One chunk of a chunked response (b"": the last); to an HTTP/1.0 client, which
        knows no chunks, `data` as it is (the connection's end ends the response)."""
        if self._chunked:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.wfile.write(data)

    @property
    def _chunked(self) -> bool:
        # RFC 9112 6.1: no Transfer-Encoding in a response to an HTTP/1.0 request.
        return self.request_version not in ("HTTP/0.9", "HTTP/1.0")

    def _client_gone(self) -> bool:
        # poll(), not select(): select refuses a descriptor >= 1024, as a busy server's
        # sockets get, and every request waiting on one failed with a 500. And a poll
        # first: a peek at a socket with a timeout waits that long for a byte.
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        if not poller.poll(0):
            return False  # nothing to read: still connected
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def _allow(method: str) -> str:
    """The Allow header of a path served by `method` (GET paths answer HEAD too)."""
    return f"{method}, HEAD, OPTIONS" if method == "GET" else f"{method}, OPTIONS"
