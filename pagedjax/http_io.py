"""The HTTP transport under the server's `Handler` (standard library only).

`HttpIO` (a `BaseHTTPRequestHandler`) is what `pagedjax.http_server.Handler` subclasses
for the wire: it skips an empty line before a request line (RFC 9112 2.2), refuses a
header line it cannot read (a 400: http.server dropped it, and the lines after it),
reads a request's body (a `Content-Length` or `Transfer-Encoding: chunked`, at most
`MAX_BODY_BYTES`; the 100 that `Expect: 100-continue` waits for goes out only once the
body is to be read) and parses it as a JSON object; it writes an answer with its length,
OpenAI's JSON error (`ApiError`; http.server's own errors too), or Server-Sent Events in
chunks (to an HTTP/1.0 client, which knows no chunks, as they are, the connection's end
ending them), with TCP_NODELAY (no write waits on Nagle's algorithm); and it tells
whether a client went away (`_client_gone`; `ClientGone`). A socket silent for
`TIMEOUT_S` times out. What a path means (routes, endpoints, the engine) is the
subclass's: `_allowed` is its one hook.

`HttpServer` (a `ThreadingHTTPServer`, a thread per connection) is the server it runs
under: it binds IPv6 literals too, and a slow or abusive client cannot hold its threads:
each request must come whole (request line, headers, body) within `read_timeout`
(`READ_TIMEOUT_S`; a connection that sends nothing, or dribbles its request, is let go),
and connections past `max_connections` (`MAX_CONNECTIONS`) get a 503 and are closed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from pagedjax.openai_api import ApiError

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "READ_TIMEOUT_S",
    "TIMEOUT_S",
    "ClientGone",
    "HttpIO",
    "HttpServer",
    "RequestTimeout",
    "url_host",
]

MAX_BODY_BYTES = 32 * 2**20
# A client silent this long in the middle of a request, between two requests, or not
# reading a stream is let go (a body shorter than its Content-Length held a thread forever).
TIMEOUT_S = 60.0
# A client's time to send a whole request, from when the server waits for it: one that
# sent a byte every TIMEOUT_S held its thread forever. The answer is not counted.
READ_TIMEOUT_S = 60.0
# Connections served at once (a thread each); more get a 503. Above vLLM's default
# max_num_seqs (256), so that a benchmark's concurrent clients queue in the engine.
MAX_CONNECTIONS = 1024
# Linux's poll event for a peer that closed its side (0 elsewhere: a peek finds the end,
# unless bytes it sent first are unread).
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)


class ClientGone(Exception):
    """The HTTP client closed its connection."""


class RequestTimeout(TimeoutError):
    """A request not read whole within the server's `read_timeout`."""


def url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 literal in brackets ("[::1]")."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class HttpServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` that a slow or abusive client cannot exhaust (see the
    module); binds at construction.

    Args:
      address: (host, port); an IPv6 literal host ("::1", "::") binds an IPv6 socket
        (http.server's are IPv4 only); port 0 picks a free one (`server_address`).
      handler: the `HttpIO` subclass that answers each connection.
      read_timeout: seconds a connection has to send each request whole (request line,
        headers and body), from when the server waits for it (None: no limit). One
        that has not is let go: closed, or a 408 if it was in the body. The answer is
        not counted: a long stream goes on.
      max_connections: connections served at once; one more is answered a 503 (JSON,
        `Connection: close`, `Retry-After`) without a thread, and closed.
    """

    daemon_threads = True

    def __init__(
        self,
        address,
        handler,
        *,
        read_timeout: float | None = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ):
        if read_timeout is not None and not (read_timeout > 0 and math.isfinite(read_timeout)):
            raise ValueError(f"read_timeout must be a positive number, got {read_timeout=}")
        if isinstance(max_connections, bool) or not (
            isinstance(max_connections, int) and max_connections >= 1
        ):
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections=}")
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self.num_connections = 0  # served now (each a handler thread)
        self._connections_lock = threading.Lock()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    @property
    def url(self) -> str:
        """http://host:port of the bound address (an IPv6 host in brackets)."""
        host, port = self.server_address[:2]
        return f"http://{url_host(host)}:{port}"

    def process_request(self, request, client_address) -> None:
        with self._connections_lock:
            full = self.num_connections >= self.max_connections
            self.num_connections += not full
        if full:
            return self._refuse(request)
        try:
            super().process_request(request, client_address)  # (starts its thread)
        except BaseException:
            self._connection_closed()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connection_closed()

    def _connection_closed(self) -> None:
        with self._connections_lock:
            self.num_connections -= 1

    def _refuse(self, request) -> None:
        """A 503 to a connection over `max_connections`, on the accepting thread: sent
        without waiting (a fresh socket's buffer holds it), what came of the request
        read without waiting (closing a socket with unread bytes resets it, and the
        client could lose the answer), then closed."""
        n = self.max_connections
        msg = f"the server is serving its limit of {n} connections (max_connections); try again"
        body = json.dumps(ApiError(503, msg).body()).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
        )
        with contextlib.suppress(OSError):  # (BlockingIOError: nothing more to read)
            request.setblocking(False)
            request.sendall(head.encode() + body)
            while request.recv(65536):
                pass
        self.shutdown_request(request)


class _RequestReader(io.RawIOBase):
    """A connection's reads (its unbuffered `makefile`), each timing out at the request's
    deadline (`HttpIO._deadline`) when that comes before the handler's `timeout`: a
    request dribbled a byte at a time is let go too (`RequestTimeout`)."""

    def __init__(self, handler: HttpIO):
        self._raw = handler.connection.makefile("rb", buffering=0)
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int | None:
        h = self._handler
        if h._deadline is None:
            return self._raw.readinto(b)
        left = h._deadline - time.monotonic()
        timeout = h.server.read_timeout
        if left <= 0:
            raise RequestTimeout(f"the request did not come whole within {timeout:g} s")
        if h.timeout is not None and left >= h.timeout:
            return self._raw.readinto(b)
        h.connection.settimeout(left)
        try:
            return self._raw.readinto(b)
        except TimeoutError:
            raise RequestTimeout(f"the request did not come whole within {timeout:g} s") from None
        finally:
            h.connection.settimeout(h.timeout)  # (writes keep theirs)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class HttpIO(BaseHTTPRequestHandler):
    """Reads request bodies and writes answers on one connection (see the module).

    A subclass resets `_streaming` and `_head` at each request and may override
    `_allowed` (the Allow header of a 405).
    """

    server: HttpServer
    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT_S  # of each read and write on the socket (StreamRequestHandler's)
    # TCP_NODELAY (as uvicorn sets it): an answer goes out in two writes (its head, then its
    # body; a stream, a write per chunk), and with Nagle's algorithm the second waited for
    # the client's delayed ACK of the first: ~40 ms a request from the second on a kept-alive
    # connection, and a stream's chunks held back as long.
    disable_nagle_algorithm = True
    _deadline: float | None = None  # (monotonic) when the request being read must be whole
    _streaming = False  # whether a stream's headers went out
    _head = False  # a HEAD request: a GET's status and headers, no body
    _continue = False  # the client waits for a 100 (Continue) before it sends the body

    def _allowed(self, path: str) -> str:
        """The method that serves `path`, "" if none: a 405's Allow header names it."""
        return ""

    # ----------------------------------------------------------------- reading

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # (http.server's: reads go through the request's deadline)
        self.rfile = io.BufferedReader(_RequestReader(self))

    def handle_one_request(self) -> None:
        # The server's read_timeout counts from here (waiting for the request) until its
        # body is read (`_read_body`), not while it is answered.
        t = self.server.read_timeout
        self._deadline = None if t is None else time.monotonic() + t
        super().handle_one_request()

    def parse_request(self) -> bool:
        if self.raw_requestline in (b"\r\n", b"\n"):
            # RFC 9112 2.2: an empty line before a request line is skipped (a client that
            # ends a body with an extra CRLF). It was an empty request: the connection was
            # closed unanswered, and the request after it lost.
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:  # (as http.server answers a first one)
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return False
        # http.server's header parser (email's) ends the headers at a line it cannot read
        # ("Content-Length : 5", a line without a colon) and drops it and every line after
        # it: a Transfer-Encoding or Content-Length hidden so (request smuggling) was
        # read as an empty body, the rest taken for the next request. RFC 9112 5.1: a 400.
        if not super().parse_request():
            return False
        h = self.headers
        bad = h.get_payload() or h.get_unixfrom() or "".join(map(str, h.defects))
        if bad:
            line = bad.partition("\n")[0].rstrip("\r")
            self.send_error(400, f"bad header line {line!r:.80}; header lines are 'Name: value'")
            return False
        return True

    def handle_expect_100(self) -> bool:
        # http.server sent the 100 at once: a client then sent a body over the limit,
        # which the 413 (or the 501 of a Transfer-Encoding) cut with a reset. It goes out
        # once the body is to be read (`_read_body`); a refusal goes out instead.
        self._continue = True
        return True

    def _read_body(self) -> bytes:
        """The request's body (a `RequestTimeout` if it does not come in time); the
        request's deadline ends with it."""
        try:
            return self._read_framed_body()
        finally:
            self._deadline = None

    def _read_framed_body(self) -> bytes:
        te = self.headers.get_all("Transfer-Encoding", [])
        if te:
            if [c.strip().lower() for c in ",".join(te).split(",")] != ["chunked"]:
                self.close_connection = True  # its body's end cannot be found: unread
                msg = f"Transfer-Encoding {', '.join(te)!r:.80} is not supported; use chunked"
                raise ApiError(501, msg)
            # RFC 9112 6.1: with a Content-Length too (a smuggling attempt, or a proxy's
            # mistake), or from an HTTP/1.0 client (which knows no chunks: a proxy on the
            # way may not have read them so), it is answered, then the connection closed.
            if "Content-Length" in self.headers or self.request_version == "HTTP/1.0":
                self.close_connection = True
            self._send_continue()
            return self._read_chunked()
        # Two different lengths are a 400 (RFC 9112 6.3), as is what int() reads but is no
        # length: "+5", "5_0", "-5", "" (it was read as none).
        lengths = self.headers.get_all("Content-Length")
        n = "0" if lengths is None else ", ".join(sorted({v.strip() for v in lengths}))
        if not (n.isascii() and n.isdigit()):
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {n!r:.80}")
        # (int() refuses over 4300 digits, leading zeros counted: "000...5" was a 500)
        size = int(n.lstrip("0")[:19] or "0")
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(
                413, f"request body of {n.lstrip('0'):.40} bytes is over {MAX_BODY_BYTES}"
            )
        self._send_continue()
        return self._read_exactly(size)

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
                return self._skip_trailers(data)
            if len(data) + size > MAX_BODY_BYTES:
                self.close_connection = True
                raise ApiError(413, f"request body is over {MAX_BODY_BYTES} bytes")
            data += self._read_exactly(size)
            end = self.rfile.readline(2)  # its CRLF (what came up to a line end was skipped)
            if end not in (b"\r\n", b"\n"):
                self.close_connection = True
                raise ApiError(400, f"a chunk of {size} bytes ends with {end!r}, not CRLF")

    def _skip_trailers(self, data: bytearray) -> bytes:
        """`data`, once the trailer fields after a chunked body's last chunk are read up
        to their blank line (none is used). A line is read whole, at most 65536 bytes as
        http.server reads a header line (one read in pieces ended the trailers at a
        piece's end, the rest taken for the next request); a longer one is a 400."""
        while (line := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
            if len(line) > 65536:
                self.close_connection = True
                raise ApiError(
                    400, f"a trailer line of the chunked body is over 65536 bytes: {line[:40]!r}"
                )
        return bytes(data)

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
        if self.close_connection:
            # RFC 9112 9.6: a client not told so sent its next request on the connection
            # that was closed after a refusal (a 413, a 501, a 408, ...), and lost it.
            self.send_header("Connection", "close")
        elif self.request_version == "HTTP/1.0":
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
        self._send(status, _dumps(obj), "application/json")

    def _error(self, e: ApiError) -> None:
        if self._streaming:  # the stream is open: tell it there, then end it as vLLM does
            try:
                self._chunk(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                self._end_stream()
            except OSError:
                self.close_connection = True  # (an answer ended whole keeps its connection)
            return
        allow = _allow(self._allowed(urlsplit(self.path).path.rstrip("/")))
        headers = [("Allow", allow)] if e.status == 405 else []
        with contextlib.suppress(OSError):
            self._send(e.status, _dumps(e.body()), "application/json", headers)

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
        self._chunk(b"data: " + _dumps(obj) + b"\n\n")

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
        poller.register(self.connection, select.POLLIN | _POLLRDHUP)
        ready = poller.poll(0)
        if not ready:
            return False  # nothing to read: still connected
        if ready[0][1] & (_POLLRDHUP | select.POLLHUP | select.POLLERR):
            return True  # its end came, even behind bytes it sent first (a pipelined request)
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def _dumps(obj) -> bytes:
    """`obj` as JSON in UTF-8; its text as it is, but a lone surrogate (which a request's
    JSON can hold, "\\ud800", and an error message quote) escaped: UTF-8 has none, and
    encoding one raised out of the handler, which then closed the connection unanswered."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj).encode()


def _allow(method: str) -> str:
    """The Allow header of a path served by `method` (GET paths answer HEAD too)."""
    return f"{method}, HEAD, OPTIONS" if method == "GET" else f"{method}, OPTIONS"
