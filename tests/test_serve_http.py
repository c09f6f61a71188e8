"""scripts/serve.py's HTTP plumbing (`pagedjax.http_server`), end to end as in
tests/test_serve.py: request bodies (lengths, chunks, bodies cut short or too large),
HTTP/1.0, HEAD and OPTIONS, http.server's own errors as JSON, clients that go silent or
away, and an engine that fails or stops. tests/serve_helpers.py has the checkpoint, the
servers and the clients.
"""

import http.client
import json
import os
import socket
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import serve_helpers
from serve_helpers import engine_state, exchange, ok, request, serve, serving

from pagedjax import http_server
from pagedjax.engine import SamplingParams

# serve_helpers' fixtures, bound here: this module gets its own checkpoint and server.
ckpt, ref, server = serve_helpers.ckpt, serve_helpers.ref, serve_helpers.server
TOKENIZE = b'{"prompt":"a"}'  # a /tokenize body of 14 bytes (0xe)


def test_a_burst_of_connections_is_queued_not_dropped():
    # The listen backlog was socketserver's 5: the 7th of a burst of clients waited for
    # the kernel to retry its connection (1 s, then 3 s, ...), at every request burst.
    srv = serve.Server(("127.0.0.1", 0), model_name="tiny", quiet=True)  # not accepting
    socks = []
    try:
        for _ in range(64):
            socks.append(socket.create_connection(srv.server_address[:2], timeout=2))
    finally:
        for s in socks:
            s.close()
        srv.server_close()


class StuckLLM:
    """What `Server.start` and `EngineThread` use of an `LLM`; no request ever finishes."""

    tokenizer, max_model_len, config = None, 64, types.SimpleNamespace(vocab_size=256)
    sampling_defaults = {}  # (no generation_config.json)
    scheduling_policy = "fcfs"
    max_logprobs = 20

    def __init__(self):
        self.rids = []

    def stop_ids(self, params):
        return frozenset()

    def add_request(self, ids, params, *, request_id, priority=0, arrival_time=None):
        self.rids.append(request_id)

    def abort(self, rid):
        self.rids.remove(rid)

    def has_unfinished_requests(self):
        return bool(self.rids)

    def step(self, *, on_token=None):
        time.sleep(0.001)
        return []


def submit_stuck(pool, srv):
    """A completion request sent from `pool` to a `StuckLLM` server, once the engine holds
    it (its future: the answer never comes while the engine runs)."""
    waiting = pool.submit(request, srv, "/v1/completions", dict(prompt=[1, 2]))
    deadline = time.monotonic() + 30
    while not srv.engine.call(lambda llm: len(llm.rids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return waiting


def test_a_stopped_engine_is_a_503():
    """A request in flight when the engine stops, /health and requests after it are 503s
    (the engine is not running), not a 500 or an "ok"."""
    gen = serving(StuckLLM(), "stuck")
    srv = next(gen)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = submit_stuck(pool, srv)
            srv.engine.stop()
            status, err = waiting.result(timeout=60)
        assert status == 503 and "the engine is stopping" in err["error"]["message"], err
        status, err = request(srv, "/health")
        assert status == 503 and "not running" in err["error"]["message"], err
        status, err = request(srv, "/v1/completions", dict(prompt=[1, 2]))
        assert status == 503 and "shutting down" in err["error"]["message"], err
        assert err["error"]["type"] == "server_error"
    finally:
        next(gen, None)


def test_close_waits_for_the_answers_of_the_requests_in_flight(monkeypatch):
    """`Server.close` stopped the engine and returned: the handlers (daemon threads) had
    yet to write their requests' 503s, and serve.py's process, stopped by Ctrl-C, then
    exited under them (a stream was cut, with no error event and no [DONE])."""
    gen = serving(StuckLLM(), "stuck")
    srv = next(gen)
    answering, release = threading.Event(), threading.Event()
    error = serve.Handler._error

    def held_error(self, e):  # the handler answers once the test releases it
        answering.set()
        release.wait(60)
        error(self, e)

    monkeypatch.setattr(serve.Handler, "_error", held_error)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = submit_stuck(pool, srv)
            srv.shutdown()
            closing = threading.Thread(target=srv.close)
            closing.start()
            assert answering.wait(60)  # the engine stopped: its 503 is being answered
            closing.join(0.5)
            assert closing.is_alive()  # close waits for it
            release.set()
            closing.join(60)
            assert not closing.is_alive()
            status, err = waiting.result(timeout=60)
        assert status == 503 and "the engine is stopping" in err["error"]["message"], err
    finally:
        release.set()
        next(gen, None)


@pytest.mark.parametrize(
    "head, status, words",
    [
        (b"Content-Length: -5", b" 400 ", b"bad Content-Length"),
        (b"Content-Length: %d" % (32 * 2**20 + 1), b" 413 ", b"request body of 33554433"),
        (b"Transfer-Encoding: chunked", b" 413 ", b"request body is over 33554432"),
        (b"Content-Length: +2", b" 400 ", b"bad Content-Length '+2'"),
        (b"Content-Length: 2\r\nContent-Length: 5", b" 400 ", b"bad Content-Length '2, 5'"),
        (b"Content-Length: ", b" 400 ", b"bad Content-Length ''"),  # was read as 0
        (b"Transfer-Encoding: gzip", b" 501 ", b"Transfer-Encoding 'gzip' is not supported"),
    ],
)
def test_bad_or_too_large_bodies_are_refused_unread(server, head, status, words):
    """A negative or empty Content-Length was read as an empty body (a 400 "not valid
    JSON", the bytes sent then taken for the next request), as was a body in a
    Transfer-Encoding other than chunked; int() read "+2" (or "2_0") as a length, and of
    two lengths the first was taken (RFC 9112 6.3: a 400). Bodies over 32 MiB are a 413."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n")
        if b"chunked" in head:
            s.sendall(b"%x\r\n" % (32 * 2**20 + 1))  # a chunk over the limit, not sent
        s.shutdown(socket.SHUT_WR)  # (a server that read on would see the end, not wait)
        reply = s.makefile("rb").read()
    assert status in reply.split(b"\r\n")[0] and words in reply, reply[:200]


def test_a_client_that_disconnects_mid_stream_is_aborted(server):
    before = engine_state(server)
    aborted = server.engine.num_aborted
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    body = dict(prompt="while True:", max_tokens=300, ignore_eos=True, stream=True, temperature=0)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline()  # the first chunk's size line: generation has started
    resp.close()
    conn.close()
    deadline = time.monotonic() + 30
    while (state := engine_state(server))[:2] != (False, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state[:2] == (False, 0)  # no request left, every page free
    assert server.engine.num_aborted == aborted + 1
    assert state[2] - before[2] < 300  # it did not run to the end


def test_clients_on_descriptors_over_1024_are_served_and_watched(server, ref, monkeypatch):
    # _client_gone used select(), which refuses a descriptor >= 1024 (a busy server's):
    # every request that waited on one was a 500.
    monkeypatch.setattr(http_server, "POLL_S", 0.001)  # check the client at every wait
    fds = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while fds[-1] < 1024:  # (the soft limit here is 20000; a low one would fail here)
            fds.append(os.open(os.devnull, os.O_RDONLY))
        body = dict(prompt="def f(x):", temperature=0, max_tokens=8)
        (want,) = ref.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=8))
        assert ok(server, "/v1/completions", body)["choices"][0]["text"] == want.outputs[0].text
        # A client that leaves while waiting for a whole answer is still seen to go.
        aborted = server.engine.num_aborted
        body = dict(prompt="while True:", max_tokens=300, ignore_eos=True)
        with socket.create_connection(server.server_address[:2], timeout=60) as s:
            data = json.dumps(body).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(data))
            s.sendall(data)
            deadline = time.monotonic() + 30
            while not engine_state(server)[0] and time.monotonic() < deadline:
                time.sleep(0.01)  # until it is in the engine
        deadline = time.monotonic() + 30
        while (state := engine_state(server))[:2] != (False, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state[:2] == (False, 0) and server.engine.num_aborted == aborted + 1
    finally:
        for fd in fds:
            os.close(fd)


def test_a_client_that_leaves_after_pipelining_its_next_request_is_aborted(server, monkeypatch):
    """A client was seen to go only by a peek that read its connection's end: one that
    had sent more (its next request, pipelined) before it closed was taken for
    connected, and its request ran to max_tokens, its pages held, for no one."""
    monkeypatch.setattr(http_server, "POLL_S", 0.001)  # check the client at every wait
    before, aborted = engine_state(server), server.engine.num_aborted
    data = json.dumps(dict(prompt="while True:", max_tokens=300, ignore_eos=True)).encode()
    with socket.create_connection(server.server_address[:2], timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(data))
        s.sendall(data)
        deadline = time.monotonic() + 30
        while not engine_state(server)[0] and time.monotonic() < deadline:
            time.sleep(0.01)  # until it is in the engine (its body read)
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")  # unread until the answer: then gone
    deadline = time.monotonic() + 30
    while (state := engine_state(server))[:2] != (False, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state[:2] == (False, 0) and server.engine.num_aborted == aborted + 1
    assert state[2] - before[2] < 300  # it did not run to the end


def fail_at_token(monkeypatch, llm, n: int) -> list:
    """Makes the engine's n-th accepted token from now raise inside the real `LLM.step`
    (so the engine's own recovery runs), once; returns a list that records it."""
    real_step, seen, fired = llm.step, [], []

    def step(*, on_token=None):
        def failing(rid, index, token):
            seen.append(token)
            if len(seen) == n and not fired:
                fired.append(rid)
                raise RuntimeError("injected failure")
            on_token(rid, index, token)

        return real_step(on_token=failing if on_token else None)

    monkeypatch.setattr(llm, "step", step)
    return fired


def test_a_failing_step_is_a_500_and_the_server_goes_on(server, ref, monkeypatch):
    fired = fail_at_token(monkeypatch, server.engine.llm, 1)
    failed = server.engine.num_failed_steps
    body = dict(prompt="def fail():", temperature=0, max_tokens=6)
    status, err = request(server, "/v1/completions", body)
    assert status == 500 and fired
    assert err["error"]["type"] == "server_error" and "injected failure" in err["error"]["message"]
    assert server.engine.num_failed_steps == failed + 1
    (want,) = ref.generate(["def fail():"], SamplingParams(temperature=0, max_tokens=6))
    assert ok(server, "/v1/completions", body)["choices"][0]["text"] == want.outputs[0].text
    assert engine_state(server)[:2] == (False, 0)


def test_a_step_failing_mid_stream_ends_it_with_an_error_event(server, monkeypatch):
    fired = fail_at_token(monkeypatch, server.engine.llm, 3)
    body = dict(prompt="def fail():", temperature=0, max_tokens=8, stream=True)
    status, text = request(server, "/v1/completions", body)
    assert status == 200 and fired  # the stream had started
    *chunks, last, done, end = text.split("\n\n")
    assert (done, end) == ("data: [DONE]", "") and chunks  # then [DONE], as vLLM ends it
    assert "[DONE]" not in "".join(chunks) and "error" not in "".join(chunks)
    err = json.loads(last[len("data: ") :])["error"]
    assert err["type"] == "server_error" and "injected failure" in err["message"]
    assert engine_state(server)[:2] == (False, 0)


def test_a_chunked_request_body_is_read(server, ref):
    # It was read as an empty body (a 400 "not valid JSON"), and its chunks then as the
    # next request on the connection (an HTML 400).
    body = dict(prompt="def f():", temperature=0, max_tokens=3)
    (want,) = ref.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=3))
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    data = json.dumps(body).encode()
    for _ in range(2):  # the connection stays in step
        pieces = iter([data[:5], data[5:]])  # an iterator: http.client sends it chunked
        conn.request("POST", "/v1/completions", body=pieces, headers={"X": "y"})
        r = conn.getresponse()
        got = json.loads(r.read())
        assert r.status == 200, got
        assert got["choices"][0]["text"] == want.outputs[0].text
    conn.close()
    status, err = request(server, "/v1/completions", raw=b"{}", method="POST")
    assert status == 400  # (a plain body still works)


@pytest.mark.parametrize("size", [b"zz", b"-5", b"0x2", b"+2"])  # int(, 16) took the last two
def test_a_bad_chunk_size_is_a_400(server, size):
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + size
            + b"\r\n{}\r\n0\r\n\r\n"
        )
        reply = s.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.0 400") or reply.startswith(b"HTTP/1.1 400"), reply[:80]
    assert b"bad chunk size" in reply


@pytest.mark.parametrize(
    "chunks, words",
    [
        # What followed a chunk's data, up to a line end, was skipped as its CRLF.
        (
            b"e\r\n" + TOKENIZE + b"garbage\r\n0\r\n\r\n",
            "a chunk of 14 bytes ends with b'ga', not CRLF",
        ),
        # A size line was cut at 1024 bytes, its rest read as the chunk's data.
        (b"e;" + b"x" * 1022 + TOKENIZE + b"\r\n0\r\n\r\n", "bad chunk size b'e;xx"),
    ],
)
def test_a_chunk_not_framed_by_line_ends_is_a_400(server, chunks, words):
    """Each was a 200, of a body made of what was not its chunks' data."""
    data = b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks
    head, body = exchange(server, data + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0], (head, body)
    assert b"HTTP/1.1" not in body  # the connection was closed: the rest is not a request
    assert json.loads(body)["error"]["message"].startswith(words)


def test_a_body_framed_by_both_a_length_and_chunks_closes_the_connection(server):
    """RFC 9112 6.1: a request with both Transfer-Encoding and Content-Length (a request
    smuggling attempt, or a proxy's mistake) is answered, then its connection closed
    (the next request on it was served)."""
    data = b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 99\r\n\r\n"
    data += b"e\r\n" + TOKENIZE + b"\r\n0\r\n\r\nGET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
    head, body = exchange(server, data)
    assert b" 200 " in head.split(b"\r\n")[0], (head, body)
    assert b"HTTP/1.1" not in body  # the next request was not served
    assert json.loads(body)["count"] == 1  # (its chunks were read, not 99 bytes)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_cut_short_is_a_400(server, chunked):
    """A body whose client hung up before its Content-Length was answered as if it were
    whole (it parsed); a chunk cut short was a "bad chunk size b''"."""
    body = json.dumps(dict(prompt=[1], max_tokens=1)).encode()
    size, head = len(body) + 9, b"POST /v1/completions HTTP/1.1\r\n"
    if chunked:
        data = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % size + body
    else:
        data = head + b"Content-Length: %d\r\n\r\n" % size + body
    head, text = exchange(server, data, shut=True)
    assert b" 400 " in head.split(b"\r\n")[0], head
    want = f"the request body ended after {len(body)} of {size} bytes"
    assert json.loads(text)["error"]["message"] == want


def test_a_silent_client_is_let_go_and_others_are_still_watched(server, ref, monkeypatch):
    """A body shorter than its Content-Length from a client that waits held a thread (and
    the client) forever; a client silent for `Handler.timeout` is let go, a 408 if it was
    in a body. Waiting for the engine longer than that is no silence (a peek at a socket
    with a timeout waited that long, then took the client for gone)."""
    monkeypatch.setattr(serve.Handler, "timeout", 0.05)
    monkeypatch.setattr(http_server, "POLL_S", 0.001)  # check the client at every wait
    head, body = exchange(
        server, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 9\r\n\r\n{", timeout=10
    )
    assert b" 408 " in head.split(b"\r\n")[0], head
    assert "for 0.05 s" in json.loads(body)["error"]["message"]
    assert exchange(server, b"GET /health HTTP/1.1\r\nX: ", timeout=10) == (b"", b"")
    llm, real_step = server.engine.llm, server.engine.llm.step

    def slow_step(**kwargs):
        time.sleep(0.02)  # 9 steps (a prefill, 8 decodes): longer than the timeout
        return real_step(**kwargs)

    monkeypatch.setattr(llm, "step", slow_step)
    body = dict(prompt="def f(x):", temperature=0, max_tokens=8)
    (want,) = ref.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=8))
    assert ok(server, "/v1/completions", body)["choices"][0]["text"] == want.outputs[0].text


def test_bad_requests(server):
    status, err = request(server, "/v1/completions", raw=b"{nope")
    assert status == 400 and "not valid JSON" in err["error"]["message"]
    status, err = request(server, "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in err["error"]["message"]
    status, err = request(server, "/v1/completions", raw=b"[" * 100_000)  # was a 500
    assert status == 400 and "nested too deeply" in err["error"]["message"]
    status, err = request(server, "/v1/completions", raw=b'{"n": %s}' % (b"9" * 5000))
    assert status == 400 and "4300 digits" in err["error"]["message"]  # int(): was a 500
    status, err = request(server, "/v1/nothing")
    assert status == 404 and "/v1/nothing" in err["error"]["message"]
    status, err = request(server, "/v1/completions")
    assert status == 405 and "GET" in err["error"]["message"]
    status, err = request(server, "/v1/models", dict(x=1))
    assert status == 405 and "POST" in err["error"]["message"]
    status, err = request(server, "/v1/models", method="DELETE")
    assert status == 405


@pytest.mark.parametrize(
    "data, status, words",
    [
        (b"FOO /health HTTP/1.1\r\n\r\n", b" 501 ", "Unsupported method ('FOO')"),
        (b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", b" 431 ", "Too many headers"),
        # A request line it cannot read left HTTP/0.9: the error had no status line.
        (b"GARBAGE\r\n\r\n", b" 400 ", "Bad request syntax ('GARBAGE')"),
        (b"GET /health HTTP/x\r\n\r\n", b" 400 ", "Bad request version ('HTTP/x')"),
    ],
)
def test_the_http_servers_own_errors_are_json(server, data, status, words):
    """http.server's own errors (an unknown method, too many headers, a request line it
    cannot read, ...) are OpenAI's JSON errors, as all others are; they were HTML pages."""
    head, body = exchange(server, data)
    assert status in head.split(b"\r\n")[0] and b"Content-Type: application/json" in head
    err = json.loads(body)["error"]
    assert err["message"] == words and set(err) == {"message", "type", "param", "code"}


def test_a_stream_to_an_http_1_0_client_is_not_chunked(server, ref):
    """RFC 9112 6.1: no Transfer-Encoding in an answer to HTTP/1.0, which knows no chunks
    (their sizes were read as the stream's data); closing the connection ends the stream,
    keep-alive or not."""
    body = dict(prompt="def f():", temperature=0, max_tokens=4, stream=True)
    (want,) = ref.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=4))
    data = json.dumps(body).encode()
    head = b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: %d"
    head, text = exchange(server, head % len(data) + b"\r\n\r\n" + data, timeout=10)
    assert b" 200 " in head.split(b"\r\n")[0] and b"transfer-encoding" not in head.lower()
    *events, done, end = text.decode().split("\n\n")
    assert (done, end) == ("data: [DONE]", "") and all(e.startswith("data: {") for e in events)
    pieces = [json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events]
    assert "".join(pieces) == want.outputs[0].text


def test_an_http_1_0_client_that_asks_to_keep_the_connection_is_told_it_is_kept(server):
    """An HTTP/1.0 client is told that a connection it asked to keep is kept (RFC 9112
    9.3); not told, it read the answer up to the connection's end, which came after
    TIMEOUT_S (60 s)."""
    with socket.create_connection(server.server_address[:2], timeout=60) as s:
        reader = s.makefile("rb")
        for _ in range(2):  # the same connection serves the second
            s.sendall(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            head = reader.readline()
            while (line := reader.readline()) not in (b"\r\n", b""):
                head += line
            assert b" 200 " in head.split(b"\r\n")[0] and b"Connection: keep-alive" in head, head
            assert reader.read(2) == b"ok"


def test_100_continue_is_sent_only_for_a_body_that_is_read(server):
    """http.server sent "100 Continue" as soon as a client asked for it: the client then
    sent a body over the limit, which the 413 cut short (the client saw a reset). The
    refusal goes out instead, and a body that is read gets its 100."""
    data = b"POST /tokenize HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
    head, body = exchange(server, data % (http_server.MAX_BODY_BYTES + 1))
    assert head.split(b"\r\n")[0].startswith(b"HTTP/1.1 413 "), head
    with socket.create_connection(server.server_address[:2], timeout=60) as s:
        s.sendall(data % len(TOKENIZE))
        reader = s.makefile("rb")
        assert reader.readline() == b"HTTP/1.1 100 Continue\r\n" and reader.readline() == b"\r\n"
        s.sendall(TOKENIZE + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        replies = reader.read()
    assert replies.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 100" not in replies, replies
    assert replies.endswith(b"\r\n\r\nok")  # (the next request on it got none either)


def test_a_client_reset_between_requests_is_not_logged(server, capsys):
    """socketserver printed a traceback for each client that reset its connection while
    the server waited for its next request (--quiet or not); other errors still print."""
    for error, logged in [(ConnectionResetError(104, "reset by peer"), False), (KeyError(1), True)]:
        try:
            raise error
        except Exception:  # noqa: BLE001
            server.handle_error(None, ("127.0.0.1", 1))
        assert ("Traceback" in capsys.readouterr().err) == logged


def test_head_and_options(server):
    """HEAD is a GET without its body, OPTIONS names the methods (both were 501s)."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    try:
        for path, allow in [("/health", "GET, HEAD, OPTIONS"), ("/v1/models", "GET, HEAD, OPTIONS"),
                            ("/v1/chat/completions", "POST, OPTIONS")]:  # fmt: skip
            conn.request("OPTIONS", path)
            r = conn.getresponse()
            assert (r.status, r.getheader("Allow"), r.read()) == (204, allow, b"")
            assert r.getheader("Content-Length") is None  # RFC 9110: none on a 204
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        body = r.read()
        conn.request("HEAD", "/v1/models")  # same connection: no body may follow
        h = conn.getresponse()
        assert h.status == 200 and h.getheader("Content-Length") == str(len(body)) != "0"
        assert h.read() == b""
        conn.request("HEAD", "/v1/completions")
        h = conn.getresponse()
        assert (h.status, h.getheader("Allow"), h.read()) == (405, "POST, OPTIONS", b"")
        conn.request("GET", "/health")  # the connection is still in step
        assert conn.getresponse().read() == b"ok"
    finally:
        conn.close()
