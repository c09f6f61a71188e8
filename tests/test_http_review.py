"""The HTTP request handling of `pagedjax.http_io` under scripts/serve.py's server, with
raw sockets: header lines it cannot read, connections it closes after an answer, error
messages that UTF-8 cannot encode, and the connection kept in step after a refusal.
tests/serve_helpers.py has the checkpoint and the server.
"""

import http.client
import json

import pytest
import serve_helpers
from serve_helpers import exchange

from pagedjax import http_io

# serve_helpers' fixtures, bound here: this module gets its own checkpoint and server.
ckpt, server = serve_helpers.ckpt, serve_helpers.server
TOKENIZE = b'{"prompt":"a"}'  # a /tokenize body of 14 bytes (0xe)
HEALTH = b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"


def status_of(head: bytes) -> int | None:
    """The status of an answer's head (None: no answer came)."""
    line = head.split(b"\r\n")[0].split()
    return int(line[1]) if len(line) > 1 else None


@pytest.mark.parametrize(
    "lines, body",
    [
        (b"Content-Length : 14", TOKENIZE),  # RFC 9112 5.1: no space before the colon
        (b"Transfer-Encoding : chunked", b"e\r\n" + TOKENIZE + b"\r\n0\r\n\r\n"),
        (b"X-No-Colon\r\nContent-Length: 14", TOKENIZE),
        (b" X: folded\r\nContent-Length: 14", TOKENIZE),  # a continuation of no line
        (b"From x\r\nContent-Length: 14", TOKENIZE),  # (email's "unix from" line)
    ],
)
def test_a_header_line_that_cannot_be_read_is_a_400(server, lines, body):
    """http.server's parser dropped such a line and (but the last two) every line after
    it: a Content-Length or Transfer-Encoding so hidden (request smuggling) read the body
    as empty (a 400 "not valid JSON", then the body taken for the next request), and
    the others were answered as if the line were not there."""
    data = b"POST /tokenize HTTP/1.1\r\n" + lines + b"\r\n\r\n" + body + HEALTH
    head, text = exchange(server, data, timeout=10)
    assert status_of(head) == 400 and b"Connection: close" in head, (head, text)
    assert b"HTTP/1.1" not in text  # the connection was closed: the rest is no request
    err = json.loads(text)["error"]
    first = lines.split(b"\r\n")[0].decode()
    assert err["message"].startswith(f"bad header line {first!r}"), err


@pytest.mark.parametrize(
    "headers, status",
    [
        ([("Content-Length", str(http_io.MAX_BODY_BYTES + 1))], 413),
        ([("Content-Length", "-5")], 400),
        ([("Transfer-Encoding", "gzip")], 501),
        ([("Transfer-Encoding", "chunked"), ("Content-Length", "99")], 200),
    ],
)
def test_a_connection_closed_after_its_answer_is_said_to_be(server, headers, status):
    """RFC 9112 9.6: the answer says "Connection: close" when the server closes the
    connection after it. Not told, a keep-alive client (http.client here) sent its next
    request on the closed connection and lost it (RemoteDisconnected)."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        conn.putrequest("POST", "/tokenize")
        for k, v in headers:
            conn.putheader(k, v)
        conn.endheaders()
        if status == 200:
            conn.send(b"e\r\n" + TOKENIZE + b"\r\n0\r\n\r\n")
        r = conn.getresponse()
        r.read()
        assert (r.status, r.getheader("Connection")) == (status, "close")
        conn.request("POST", "/tokenize", TOKENIZE)  # reconnects, as it was told to
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["count"] == 1
    finally:
        conn.close()


def test_a_chunked_body_from_an_http_1_0_client_closes_the_connection(server):
    """RFC 9112 6.1: HTTP/1.0 has no chunks (a proxy on the way may not have read them
    as such): its answer is the connection's last, keep-alive or not. The next request
    on it was served."""
    data = b"POST /tokenize HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n"
    data += b"\r\ne\r\n" + TOKENIZE + b"\r\n0\r\n\r\n" + HEALTH
    head, text = exchange(server, data, timeout=10)
    assert status_of(head) == 200 and b"keep-alive" not in head, head
    assert b"HTTP/1.1" not in text and json.loads(text)["count"] == 1, text


def test_an_error_that_utf8_cannot_encode_is_answered(server):
    """A lone surrogate ("\\ud800" in the request's JSON) quoted in an error message
    raised UnicodeEncodeError out of the handler: no answer, the connection closed and a
    traceback on stderr. It is escaped, and the connection goes on."""
    schema = {"type": "object", "properties": {"\ud800": {"type": "bogus"}}}
    body = json.dumps(dict(prompt="a", max_tokens=1, structured_outputs=dict(json=schema)))
    data = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body)
    head, text = exchange(server, data + body.encode() + HEALTH, timeout=10)
    assert status_of(head) == 400, (head, text)
    first, _, rest = text.partition(b"HTTP/1.1 200 ")
    err = json.loads(first)["error"]
    assert "\ud800" in err["message"] and err["param"] == "structured_outputs", err
    assert rest.endswith(b"\r\n\r\nok")  # the next request on the connection was served
    assert json.loads(http_io._dumps({"a": "\ud800é"})) == {"a": "\ud800é"}
    assert http_io._dumps({"a": "é"}) == '{"a": "é"}'.encode()  # (UTF-8 as it was)


@pytest.mark.parametrize(
    "request_line, body, status",
    [
        (b"POST /v1/nothing", b"{}" + b" " * 20, 404),
        (b"POST /v1/models", b'{"x": 1}', 405),
        (b"POST /v1/completions", b"{nope", 400),
        (b"POST /v1/completions", b'{"prompt": "a", "temperature": NaN}', 400),
        (b"POST /tokenize", b'"a string"', 400),
    ],
)
def test_after_a_refused_body_the_next_request_is_read(server, request_line, body, status):
    """A refusal after the body was read keeps the connection, in step: its body is not
    taken for the next request."""
    data = request_line + b" HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    head, text = exchange(server, data + HEALTH, timeout=10)
    assert status_of(head) == status and b"Connection" not in head, head
    first, _, rest = text.partition(b"HTTP/1.1 200 ")
    err = json.loads(first)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert rest.endswith(b"\r\n\r\nok"), text
