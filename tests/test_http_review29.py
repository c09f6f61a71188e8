"""The HTTP wire of scripts/serve.py's server (`pagedjax.http_io`, `pagedjax.http_server`)
over a stand-in engine (no model: fast): latency on a kept-alive connection, the Allow
header of a 405, a connection kept after a stream that ended with an error event, and a
chunked body's trailer lines read whole.
"""

import http.client
import json
import statistics
import threading
import time
import types

import pytest
from serve_helpers import exchange, serve


class StreamingLLM:
    """What `Server.start` and `EngineThread` use of an `LLM`: each step streams token 65
    to every request (none ever finishes); the step after `fail_after` tokens raises."""

    tokenizer, max_model_len, config = None, 64, types.SimpleNamespace(vocab_size=256)
    sampling_defaults = {}  # (no generation_config.json)
    scheduling_policy = "fcfs"
    max_logprobs = 20

    def __init__(self, fail_after: int | None = None):
        self.rids, self.fail_after, self.sent = [], fail_after, 0

    def stop_ids(self, params):
        return frozenset()

    def add_request(self, ids, params, *, request_id, priority=0, arrival_time=None):
        self.rids.append(request_id)

    def abort(self, rid):
        if rid in self.rids:
            self.rids.remove(rid)

    def has_unfinished_requests(self):
        return bool(self.rids)

    def step(self, *, on_token=None):
        time.sleep(0.001)
        if self.fail_after is not None and self.sent >= self.fail_after:
            self.sent, self.rids = 0, []  # (a failed step's requests are gone)
            raise RuntimeError("injected failure")
        for rid in self.rids:
            self.sent += 1
            if on_token is not None:
                on_token(rid, 0, 65)
        return []


@pytest.fixture
def server():
    srv = serve.Server(("127.0.0.1", 0), model_name="m", quiet=True)
    srv.start(StreamingLLM(fail_after=3))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.close()
    thread.join(10)


def test_answers_on_a_kept_alive_connection_are_not_held_by_nagle(server):
    """A response went out in two writes (its head, then its body; a stream, a write per
    chunk) on a socket with Nagle's algorithm on: from the second request on a kept-alive
    connection, the body waited for the client's delayed ACK of the head, ~40 ms a request
    on Linux (a benchmark's clients, the OpenAI SDK's pooled connections), and a stream's
    chunks were held so too. TCP_NODELAY is set, as uvicorn (vLLM's) sets it."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        times = []
        for _ in range(15):
            t = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.read() == b"ok"
            times.append(time.perf_counter() - t)
    finally:
        conn.close()
    assert statistics.median(times) < 0.02, times  # was ~0.044


def test_a_405_on_a_models_card_names_its_methods(server):
    """`GET /v1/models/{id}` is served by GET: a POST there is a 405 whose Allow header
    (RFC 9110 15.5.6: the methods the path serves) was ", OPTIONS"."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        for method in ("POST", "DELETE"):
            conn.request(method, "/v1/models/m", b"{}")
            r = conn.getresponse()
            err = json.loads(r.read())["error"]
            assert (r.status, r.getheader("Allow")) == (405, "GET, HEAD, OPTIONS"), err
            assert "use GET" in err["message"]
    finally:
        conn.close()


def test_a_stream_ended_by_an_error_event_keeps_its_connection(server):
    """A stream that the engine failed mid-way ends whole (an error event, [DONE], the
    last chunk): the connection is in step. It was closed after, its answer not saying so
    (its head had gone out): a keep-alive client's next request on it was lost
    (http.client: RemoteDisconnected), as vLLM's would not be."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        body = dict(prompt=[1, 2], max_tokens=8, stream=True)
        conn.request("POST", "/v1/completions", json.dumps(body))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Connection") is None
        *chunks, last, done, end = r.read().decode().split("\n\n")
        assert (done, end) == ("data: [DONE]", "") and chunks
        assert "injected failure" in json.loads(last[len("data: ") :])["error"]["message"]
        conn.request("GET", "/health")  # on the same connection
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"ok")
    finally:
        conn.close()


@pytest.mark.parametrize("pad", [65533, 65532, 65531, 10])  # 65531: a line of 65536 bytes
def test_a_chunked_bodys_trailer_lines_are_read_whole(server, pad):
    """A trailer line was read 65536 bytes at a time: one whose CRLF came just past that
    ended the trailers there, and what followed (the real end of the trailers) was read
    as the next request: the connection closed unanswered (or, with lines after it,
    they were taken for a request: the framing out of step). A trailer line over 65536
    bytes is a 400, as a header line is a 431; shorter ones are skipped."""
    body = json.dumps(dict(prompt=[1, 2], max_tokens=1, stream=True)).encode()
    trailer = b"X: " + b"a" * pad + b"\r\n"
    data = b"POST /v1/nothing HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    data += b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailer)
    data += b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
    head, text = exchange(server, data, timeout=10)
    if len(trailer) <= 65536:
        assert b" 404 " in head.split(b"\r\n")[0], (head, text)
        assert text.endswith(b"\r\n\r\nok"), text  # the next request was read and served
    else:
        assert b" 400 " in head.split(b"\r\n")[0] and b"Connection: close" in head, head
        assert b"HTTP/1.1" not in text  # the connection was closed: the rest is no request
        assert "trailer line" in json.loads(text)["error"]["message"]


def test_a_content_length_with_thousands_of_leading_zeros_is_read(server):
    """int() refuses over 4300 digits, leading zeros counted: such a Content-Length (a
    header line holds 65536 bytes) was a 500 "internal error: ValueError", its body then
    read as the next request. Its value is read as any other's."""
    length = b"0" * 5000 + b"2"
    data = b"POST /v1/nothing HTTP/1.1\r\nContent-Length: %s\r\n\r\n{}" % length
    head, text = exchange(server, data + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert b" 404 " in head.split(b"\r\n")[0], (head, text)
    assert text.endswith(b"\r\n\r\nok"), text  # the next request was read and served


@pytest.mark.parametrize("before", [b"\r\n", b"\n", b"GET /health HTTP/1.1\r\n\r\n\r\n"])
def test_an_empty_line_before_a_request_line_is_skipped(server, before):
    """RFC 9112 2.2: a server SHOULD skip an empty line before a request line (a client
    that ends a body with an extra CRLF; vLLM's uvicorn does). It was read as an empty
    request: the connection closed unanswered, and the request after it lost."""
    data = before + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
    head, text = exchange(server, data, timeout=10)
    assert b" 200 " in head.split(b"\r\n")[0], (head, text)
    assert text.endswith(b"ok") and text.count(b"HTTP/1.1 200 ") == (b"GET" in before), text


def test_a_server_starts_its_engine_thread_once(server):
    """A second `start` started a second engine thread beside the first, both stepping
    engines (the same one: two threads in its state, with no error)."""
    first = server.engine
    with pytest.raises(RuntimeError, match="started already"):
        server.start(StreamingLLM())
    assert server.engine is first
