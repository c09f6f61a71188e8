"""scripts/serve.py's server against slow and abusive clients, and on IPv6
(`pagedjax.http_io.HttpServer`, under `pagedjax.http_server.Server`).

A request must come whole within the server's `read_timeout`, however slowly it is
dribbled, but the answer is not counted (a slow stream completes); connections past
`max_connections` get a 503; an IPv6 host binds an IPv6 socket, and URLs bracket it.
tests/serve_helpers.py has the checkpoint, the servers and the clients.
"""

import json
import socket
import threading
import time

import pytest
import serve_helpers
from serve_helpers import exchange, make_llm, ok, request, serve, serving, stream

from pagedjax.engine import SamplingParams
from pagedjax.http_io import url_host

# serve_helpers' fixtures, bound here: this module gets its own checkpoint.
ckpt, ref = serve_helpers.ckpt, serve_helpers.ref
READ_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def server(ckpt):
    """A server whose clients have `READ_TIMEOUT` seconds to send each request."""
    yield from serving(make_llm(ckpt), "tiny", read_timeout=READ_TIMEOUT)


def closed_by_server(s: socket.socket, deadline: float) -> bool:
    """Whether the server closed `s` before `deadline` (monotonic), `s` polled only."""
    s.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def dribble(s: socket.socket, data: bytes, *, every: float, until: float) -> bytes:
    """Sends `data` a byte every `every` seconds until the server answers or closes, or
    `until` (monotonic); what the server answered (b"" if it closed at once)."""
    s.settimeout(every)
    for byte in data:
        try:
            s.sendall(bytes([byte]))
            reply = s.recv(65536)
        except TimeoutError:
            if time.monotonic() > until:
                return b"(still reading)"
            continue
        except (BrokenPipeError, ConnectionResetError):
            return b""
        s.settimeout(10)
        return reply + s.makefile("rb").read()
    return b"(all sent)"


def test_a_client_that_sends_nothing_is_let_go_at_the_read_timeout(server):
    start = time.monotonic()
    with socket.create_connection(server.server_address[:2]) as s:
        assert closed_by_server(s, start + 10)
    assert time.monotonic() - start < READ_TIMEOUT + 5


def test_a_dribbled_request_is_let_go_at_the_read_timeout(server):
    """A byte every 0.1 s never let the 60 s silence timeout (`Handler.timeout`) strike:
    a client dribbling its headers, or its body, held a thread forever. Headers: the
    connection is closed; a body: a 408 naming the limit."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    start = time.monotonic()
    with socket.create_connection(server.server_address[:2]) as s:
        assert dribble(s, head, every=0.05, until=start + 8) == b""
    assert time.monotonic() - start < READ_TIMEOUT + 5

    body = json.dumps(dict(prompt="def f(x):", max_tokens=2)).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body)
    start = time.monotonic()
    with socket.create_connection(server.server_address[:2]) as s:
        s.sendall(head)
        reply = dribble(s, body, every=0.05, until=start + 8)
    assert time.monotonic() - start < READ_TIMEOUT + 5
    status, _, rest = reply.partition(b"\r\n")
    assert b" 408 " in status, reply[:300]
    err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert err["message"] == f"the request did not come whole within {READ_TIMEOUT:g} s"


def test_the_answer_is_not_counted_a_slow_stream_completes(server, ref, monkeypatch):
    """Generation longer than the read timeout, streamed or not, is answered whole; the
    connection then serves its next request (its deadline starts over)."""
    llm, real_step = server.engine.llm, server.engine.llm.step

    def slow_step(**kwargs):
        time.sleep(0.25)  # 8 steps or more: four times the read timeout
        return real_step(**kwargs)

    monkeypatch.setattr(llm, "step", slow_step)
    body = dict(prompt="def f(x):", temperature=0, max_tokens=8, ignore_eos=True)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (want,) = ref.generate([body["prompt"]], sp)
    start = time.monotonic()
    chunks = stream(server, "/v1/completions", body)
    assert time.monotonic() - start > 3 * READ_TIMEOUT
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.outputs[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert ok(server, "/v1/completions", body)["choices"][0]["text"] == want.outputs[0].text

    # Two requests on one connection, the first answered after the read timeout.
    data = json.dumps(dict(body, max_tokens=6)).encode()
    post = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    get = b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
    with socket.create_connection(server.server_address[:2], timeout=60) as s:
        s.sendall(post)
        f = s.makefile("rb")
        assert b" 200 " in f.readline()
        while (line := f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        assert json.loads(f.read(n))["usage"]["completion_tokens"] == 6
        s.sendall(get)
        assert b" 200 " in f.readline() and f.read().endswith(b"\r\n\r\nok")


def wait_for(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_connections_past_max_connections_get_a_503():
    """Each connection holds a thread until it goes; past the cap, a connection is
    answered a JSON 503 at once and closed (no thread), and once one goes another is
    served. (No engine: OPTIONS needs none.)"""
    srv = serve.Server(("127.0.0.1", 0), model_name="x", quiet=True, max_connections=2)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    idle = [socket.create_connection(srv.server_address[:2], timeout=10) for _ in range(2)]
    try:
        wait_for(lambda: srv.num_connections == 2)
        head, body = exchange(srv, b"OPTIONS /health HTTP/1.1\r\n\r\n", timeout=10)
        assert head.startswith(b"HTTP/1.1 503 "), head
        assert b"Connection: close" in head and b"Retry-After: 1" in head
        err = json.loads(body)["error"]
        assert err["type"] == "server_error" and "limit of 2 connections" in err["message"]
        assert srv.num_connections == 2
        idle.pop().close()
        wait_for(lambda: srv.num_connections == 1)
        head, _ = exchange(srv, b"OPTIONS /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 204 "), head
        wait_for(lambda: srv.num_connections == 1)
    finally:
        for s in idle:
            s.close()
        srv.shutdown()
        srv.close()
        thread.join(10)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(max_connections=0), "max_connections must be an int >= 1"),
        (dict(max_connections=True), "max_connections must be an int >= 1"),
        (dict(read_timeout=0), "read_timeout must be a positive number"),
        (dict(read_timeout=float("nan")), "read_timeout must be a positive number"),
    ],
)
def test_bad_limits_are_value_errors(kw, words):
    with pytest.raises(ValueError, match=words):
        serve.Server(("127.0.0.1", 0), model_name="x", **kw)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--read-timeout", "0"], "--read-timeout must be a positive number, got 0.0"),
        (["--read-timeout", "inf"], "--read-timeout must be a positive number, got inf"),
        (["--max-connections", "0"], "--max-connections"),
    ],
)
def test_bad_limit_flags_are_one_line_and_status_2(argv, words, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


def test_the_limit_flags_reach_the_server(ckpt, monkeypatch, capsys):
    servers = []
    monkeypatch.setattr(serve.Server, "serve_forever", lambda srv, *a, **k: servers.append(srv))
    argv = ["--checkpoint", ckpt, "--port", "0", "--quiet", "--backend", "xla"]
    argv += ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
    argv += ["--compilation-cache", "off", "--read-timeout", "2.5", "--max-connections", "7"]
    assert serve.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    ((srv),) = servers
    assert (srv.read_timeout, srv.max_connections) == (2.5, 7)


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")


def test_url_host_brackets_ipv6():
    hosts = ("127.0.0.1", "localhost", "::1", "::", "[::1]")
    assert [url_host(h) for h in hosts] == ["127.0.0.1", "localhost", "[::1]", "[::]", "[::1]"]


@needs_ipv6
def test_an_ipv6_host_binds_an_ipv6_socket(ckpt, ref):
    """http.server binds IPv4 sockets only: `--host ::1` failed ("Address family for
    hostname not supported"); the URL now brackets the address."""
    gen = serving(make_llm(ckpt), "tiny", address=("::1", 0))
    srv = next(gen)
    try:
        assert srv.socket.family == socket.AF_INET6
        port = srv.server_address[1]
        assert srv.url == f"http://[::1]:{port}"
        assert request(srv, "/health") == (200, "ok")
        body = dict(prompt="def f(x):", temperature=0, max_tokens=4)
        (want,) = ref.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=4))
        assert ok(srv, "/v1/completions", body)["choices"][0]["text"] == want.outputs[0].text
    finally:
        next(gen, None)


@needs_ipv6
def test_the_cli_serves_on_ipv6_and_says_where(ckpt, monkeypatch, capsys):
    servers = []
    monkeypatch.setattr(serve.Server, "serve_forever", lambda srv, *a, **k: servers.append(srv))
    argv = ["--checkpoint", ckpt, "--host", "::1", "--port", "0", "--backend", "xla"]
    argv += ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
    argv += ["--compilation-cache", "off"]
    assert serve.main([str(a) for a in argv]) == 0
    ((srv),) = servers
    port = srv.server_address[1]
    assert f" at http://[::1]:{port}/v1; " in capsys.readouterr().err


@pytest.mark.parametrize("host", ["::1::2", "no-such-host.invalid", "[::1]"])
def test_a_bad_host_is_one_line_before_loading(ckpt, monkeypatch, capsys, host):
    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("pagedjax.engine.LLM", no_loading)
    argv = ["--checkpoint", str(ckpt), "--host", host, "--port", "0", "--backend", "xla"]
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on {url_host(host)}:0: "), err
    assert err.count("\n") == 1
