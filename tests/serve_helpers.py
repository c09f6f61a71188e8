"""What tests/test_serve*.py share: a tiny checkpoint, servers over it and HTTP clients.

The checkpoint is the `tiny` preset with random weights, a byte-level tokenizer and a
plain-text chat template (as in tests/test_chat_cli.py), with the CLI tests' geometry.
Every answer is checked against an `LLM` built the same way (`ref`) and the same
SamplingParams. `bare_server` serves a copy of that checkpoint without its tokenizer.json
and chat template (`LLM.tokenizer is None`): the same weights, so the same token ids.

The fixtures are module-scoped: a test module binds those it uses (`server =
serve_helpers.server`, and those they depend on) and gets its own checkpoint and servers.
"""

import importlib.util
import json
import shutil
import socket
import sys
import threading
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from params_helpers import write_tiny_checkpoint

from pagedjax.engine import LLM
from pagedjax.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You write short Python."},
    {"role": "user", "content": "A function that adds two numbers."},
]


def load_script():
    spec = importlib.util.spec_from_file_location("serve_script", ROOT / "scripts" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


serve = load_script()


def make_llm(path, **kw) -> LLM:
    """An engine of the served checkpoint at `path`, in the tests' geometry (`kw`: more
    LLM arguments)."""
    return LLM(
        str(path),
        page_size=8,
        num_pages=64,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        backend="xla",
        **kw,
    )


def capture_start(monkeypatch) -> list:
    """Makes serve.py's `main` start its server without serving; returns the list that
    gets each engine `Server.start` is given."""
    started = []
    start = serve.Server.start
    monkeypatch.setattr(
        serve.Server, "start", lambda srv, llm: started.append(llm) or start(srv, llm)
    )
    monkeypatch.setattr(serve.Server, "serve_forever", lambda srv, *a, **k: None)
    return started


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_serve_ckpt")
    write_tiny_checkpoint(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def ref(ckpt):
    return make_llm(ckpt)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def serving(llm, name: str, *, address=("127.0.0.1", 0), **kw):
    """Yields a `serve.Server` over `llm` at `address` (a free port), serving on a thread
    (`kw`: more Server arguments, e.g. lora_modules)."""
    srv = serve.Server(address, model_name=name, quiet=True, **kw)
    srv.start(llm)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.close()
    thread.join(10)
    assert not thread.is_alive() and not srv.engine.alive


@pytest.fixture(scope="module")
def server(ckpt):
    yield from serving(make_llm(ckpt), "tiny")


@pytest.fixture(scope="module")
def bare_ckpt(ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_serve_bare") / "ckpt"
    shutil.copytree(ckpt, path, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    return path


@pytest.fixture(scope="module")
def bare_server(bare_ckpt):
    llm = make_llm(bare_ckpt)
    assert llm.tokenizer is None
    yield from serving(llm, "bare")


def request(srv, path, body=None, *, method=None, raw=None):
    """(status, parsed JSON or text) of one request."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        srv.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers["Content-Type"]
    return status, json.loads(text) if ctype == "application/json" else text


def ok(srv, path, body):
    status, obj = request(srv, path, body)
    assert status == 200, obj
    return obj


def stream(srv, path, body) -> list[dict]:
    """The chunks of a streamed answer (checking the SSE framing and the final [DONE])."""
    status, text = request(srv, path, {**body, "stream": True})
    assert status == 200, text
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    assert all(e.startswith("data: {") for e in events[:-2])
    return [json.loads(e[len("data: ") :]) for e in events[:-2]]


def exchange(srv, data: bytes, *, shut=False, timeout: float = 60) -> tuple[bytes, bytes]:
    """(status line and headers, body) of what the server answers `data` on a new
    connection (closed for writing after it if `shut`), read until the server closes it."""
    with socket.create_connection(srv.server_address[:2], timeout=timeout) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        reply = s.makefile("rb").read()
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def engine_state(srv):
    """(unfinished requests?, pages in use, tokens generated) read on the engine thread."""
    return srv.engine.call(
        lambda llm: (
            llm.has_unfinished_requests(),
            llm.block_manager.stats().num_used_pages,
            llm.metrics.generated_tokens,
        )
    )


class StreamRecorder(serve.Handler):
    """A handler without a socket: `_stream` run on given events, its chunks recorded."""

    request_version = "HTTP/1.1"

    def __init__(self, tokenizer, stop_ids=lambda sp: frozenset()):  # (no request to handle)
        self.server = types.SimpleNamespace(tokenizer=tokenizer, stop_ids=stop_ids)
        self._streaming, self.sent = False, []

    def send_response(self, status, message=None):
        self.status = status

    def send_header(self, keyword, value):
        pass

    def end_headers(self):
        pass

    def _chunk(self, data: bytes) -> None:
        self.sent.append(data)
