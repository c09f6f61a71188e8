"""scripts/serve.py end to end: one server in-process on a free port, spoken to with urllib.

The checkpoint is the `tiny` preset with random weights, a byte-level tokenizer and a
plain-text chat template (as in tests/test_chat_cli.py), with the CLI tests' geometry.
Every answer is checked against an `LLM` built the same way (`ref`) and the same
SamplingParams. `bare_server` serves a copy of that checkpoint without its tokenizer.json
and chat template (`LLM.tokenizer is None`): the same weights, so the same token ids.
"""

import dataclasses
import http.client
import importlib.util
import json
import os
import queue
import shutil
import socket
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from params_helpers import write_tiny_checkpoint
from test_tokenizer import sentencepiece_style

from pagedjax import openai_api as api
from pagedjax.engine import LLM, SamplingParams
from pagedjax.request import CompletionOutput, RequestOutput
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


def make_llm(path) -> LLM:
    return LLM(
        str(path),
        page_size=8,
        num_pages=64,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        backend="xla",
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_serve_ckpt")
    write_tiny_checkpoint(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def ref(ckpt):
    return make_llm(ckpt)


def serving(llm, name: str):
    """Yields a `serve.Server` over `llm` on a free port, serving on a thread."""
    srv = serve.Server(("127.0.0.1", 0), model_name=name, quiet=True)
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


def test_health_and_models(server):
    assert request(server, "/health") == (200, "ok")
    models = ok(server, "/v1/models", None)
    model = dict(id="tiny", object="model", created=0, owned_by="pagedjax", max_model_len=512)
    assert models == dict(object="list", data=[model])
    assert ok(server, "/v1/models/?x=1", None) == models  # a trailing slash, a query
    assert request(server, "/health/") == (200, "ok")


def test_tokenize_and_detokenize_as_vllm(server, bare_server, ref):
    """vLLM's /tokenize and /detokenize: a prompt as a completion gets it, or messages as
    a chat request renders them, and back; bad bodies are 400s naming the field."""
    tok, text = ref.tokenizer, "def add(a, b):"
    ids = ref.encode(text)[1]
    got = ok(server, "/tokenize", dict(prompt=text))
    assert got == dict(count=len(ids), max_model_len=512, tokens=ids, token_strs=None)
    bare = ok(server, "/tokenize", dict(prompt=text, add_special_tokens=False))["tokens"]
    assert bare == tok.encode(text, add_bos=False)
    strs = ok(server, "/tokenize", dict(prompt=text, return_token_strs=True))["token_strs"]
    assert strs == [tok.tokenizer.id_to_token(i) for i in ids]
    chat = ok(server, "/tokenize", dict(messages=MESSAGES, model="tiny"))["tokens"]
    assert chat == tok.encode_chat(MESSAGES)
    want = tok.decode(ids, skip_special_tokens=False)
    assert ok(server, "/detokenize", dict(tokens=ids)) == dict(prompt=want)
    assert ok(server, "/detokenize", dict(tokens=chat))["prompt"] == tok.apply_chat_template(
        MESSAGES
    )
    for path, body, status, words in [
        ("/tokenize", dict(prompt=[1, 2]), 400, "prompt must be a string"),
        ("/tokenize", dict(prompt="a", messages=MESSAGES), 400, "not both"),
        ("/tokenize", dict(prompt="a", model="other"), 404, "not served here"),
        ("/tokenize", dict(prompt="a", add_special_tokens="yes"), 400, "add_special_tokens"),
        ("/detokenize", dict(tokens=[1, 256]), 400, "tokens must be in [0, 256), got [256]"),
        ("/detokenize", dict(tokens="hi"), 400, "tokens must be a list of token ids"),
    ]:
        status_, obj = request(server, path, body)
        assert (status_, obj["error"]["type"]) == (status, "invalid_request_error"), obj
        assert words in obj["error"]["message"], obj
    for path in ("/tokenize", "/detokenize"):
        status, obj = request(bare_server, path, dict(prompt="a", tokens=[1]))
        assert status == 400 and "no tokenizer" in obj["error"]["message"], obj
        assert request(server, path)[0] == 405  # a GET


def metrics(srv) -> dict[str, float]:
    """GET /metrics parsed: {name with its labels but model_name: value}, checking each
    sample's TYPE line comes first and that every sample has the model_name label."""
    status, text = request(srv, "/metrics")
    assert status == 200, text
    got, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif not line.startswith("# HELP "):
            name, value = line.rsplit(" ", 1)
            base = name.split("{")[0]
            assert base in typed or base.rsplit("_", 1)[0] in typed, line
            assert 'model_name="tiny"' in name, line
            name = name.replace('{model_name="tiny"}', "").replace('model_name="tiny",', "")
            got[name] = float(value)
    return got


def test_prometheus_metrics_count_what_a_request_did(server, ref):
    """GET /metrics: vLLM's metric names (prefixed "pagedjax:"), counters that grow by
    what one request prompted and generated."""
    before = metrics(server)
    ids = ref.encode("def f(x):")[1]
    obj = ok(server, "/v1/completions", dict(prompt=ids, max_tokens=5, temperature=0))
    n = obj["usage"]["completion_tokens"]
    after = metrics(server)
    grew = {k: after[k] - before[k] for k in before if k in after}
    assert grew["pagedjax:generation_tokens_total"] == n
    assert grew["pagedjax:prompt_tokens_total"] == len(ids)
    assert grew["pagedjax:request_success_total"] == 1
    assert grew["pagedjax:time_to_first_token_seconds_count"] == 1
    assert grew["pagedjax:prefix_cache_queries_total"] == len(ids)
    assert after["pagedjax:num_requests_running"] == after["pagedjax:num_requests_waiting"] == 0
    assert 0 <= after["pagedjax:kv_cache_usage_perc"] <= 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        counts = [v for k, v in after.items() if k.startswith(f"pagedjax:{name}_bucket")]
        assert counts == sorted(counts) and len(counts) > 10  # cumulative, vLLM's buckets
        assert after[f'pagedjax:{name}_bucket{{le="+Inf"}}'] == after[f"pagedjax:{name}_count"]
        assert grew[f'pagedjax:{name}_bucket{{le="+Inf"}}'] == 1


class StuckLLM:
    """What `Server.start` and `EngineThread` use of an `LLM`; no request ever finishes."""

    tokenizer, max_model_len, config = None, 64, types.SimpleNamespace(vocab_size=256)
    sampling_defaults = {}  # (no generation_config.json)

    def __init__(self):
        self.rids = []

    def stop_ids(self, params):
        return frozenset()

    def add_request(self, ids, params, *, request_id):
        self.rids.append(request_id)

    def abort(self, rid):
        self.rids.remove(rid)

    def has_unfinished_requests(self):
        return bool(self.rids)

    def step(self, *, on_token=None):
        time.sleep(0.001)
        return []


def test_a_stopped_engine_is_a_503():
    """A request in flight when the engine stops, /health and requests after it are 503s
    (the engine is not running), not a 500 or an "ok"."""
    gen = serving(StuckLLM(), "stuck")
    srv = next(gen)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(request, srv, "/v1/completions", dict(prompt=[1, 2]))
            deadline = time.monotonic() + 30
            while not srv.engine.call(lambda llm: len(llm.rids)) and time.monotonic() < deadline:
                time.sleep(0.01)
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


@pytest.mark.parametrize(
    "head, status, words",
    [
        (b"Content-Length: -5", b" 400 ", b"bad Content-Length"),
        (b"Content-Length: %d" % (32 * 2**20 + 1), b" 413 ", b"request body of 33554433"),
        (b"Transfer-Encoding: chunked", b" 413 ", b"request body is over 33554432"),
        (b"Content-Length: +2", b" 400 ", b"bad Content-Length '+2'"),
        (b"Content-Length: 2\r\nContent-Length: 5", b" 400 ", b"bad Content-Length '2, 5'"),
        (b"Transfer-Encoding: gzip", b" 501 ", b"Transfer-Encoding 'gzip' is not supported"),
    ],
)
def test_bad_or_too_large_bodies_are_refused_unread(server, head, status, words):
    """A negative Content-Length was read as an empty body (a 400 "not valid JSON", the
    bytes sent then taken for the next request), as was a body in a Transfer-Encoding
    other than chunked; int() read "+2" (or "2_0") as a length, and of two lengths the
    first was taken (RFC 9112 6.3: a 400). Bodies over 32 MiB are a 413."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n")
        if b"chunked" in head:
            s.sendall(b"%x\r\n" % (32 * 2**20 + 1))  # a chunk over the limit, not sent
        s.shutdown(socket.SHUT_WR)  # (a server that read on would see the end, not wait)
        reply = s.makefile("rb").read()
    assert status in reply.split(b"\r\n")[0] and words in reply, reply[:200]


def test_completion_of_a_string_prompt(server, ref):
    prompt = "def add(a, b):"
    got = ok(server, "/v1/completions", dict(model="tiny", prompt=prompt, temperature=0))
    (want,) = ref.generate([prompt], SamplingParams(temperature=0))  # max_tokens 16
    c = want.outputs[0]
    assert got["object"] == "text_completion" and got["model"] == "tiny"
    assert got["id"].startswith("cmpl-") and isinstance(got["created"], int)
    assert got["choices"] == [
        dict(index=0, text=c.text, logprobs=None, finish_reason=c.finish_reason)
    ]
    p, n = len(want.prompt_token_ids), len(c.token_ids)
    assert got["usage"] == dict(prompt_tokens=p, completion_tokens=n, total_tokens=p + n)


def test_token_id_prompts_one_and_a_batch(server, ref):
    a, b = [1, 100, 101, 102, 103], [1, 50, 60]
    body = dict(temperature=0, max_tokens=7, stop_token_ids=[32])
    sp = SamplingParams(temperature=0, max_tokens=7, stop_token_ids=(32,))
    one = ok(server, "/v1/completions", dict(body, prompt=a))
    two = ok(server, "/v1/completions", dict(body, prompt=[a, b]))
    want = ref.generate([a, b], sp)
    assert one["choices"][0]["text"] == want[0].outputs[0].text
    assert [c["text"] for c in two["choices"]] == [o.outputs[0].text for o in want]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["prompt_tokens"] == len(a) + len(b)


def test_batch_of_strings_with_n_2_seeded_sampling(server, ref):
    prompts = ["import os\n", "class Config:"]
    body = dict(prompt=prompts, n=2, seed=7, temperature=0.9, top_p=0.9, top_k=-1, max_tokens=6)
    got = ok(server, "/v1/completions", body)
    want = ref.generate(
        prompts, SamplingParams(n=2, seed=7, temperature=0.9, top_p=0.9, max_tokens=6)
    )
    texts = [c.text for o in want for c in o.outputs]
    assert len(set(texts)) > 1  # sampling, not four copies of one text
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in got["choices"]] == texts
    assert got["usage"]["completion_tokens"] == sum(
        len(c.token_ids) for o in want for c in o.outputs
    )


def test_logit_bias_and_min_tokens(server, ref):
    prompt = "def g():"
    body = dict(prompt=prompt, temperature=0, max_tokens=6, logit_bias={"65": 6.5, "66": -100})
    body.update(min_tokens=3, stop_token_ids=[32])
    got = ok(server, "/v1/completions", body)["choices"][0]
    sp = SamplingParams(
        temperature=0,
        max_tokens=6,
        logit_bias={65: 6.5, 66: -100},
        min_tokens=3,
        stop_token_ids=(32,),
    )
    (want,) = ref.generate([prompt], sp)
    (plain,) = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    assert got["text"] == want.outputs[0].text != plain.outputs[0].text
    assert "A" in got["text"]


def test_completion_logprobs(server, ref, tok):
    prompt = "x = [1, 2"
    got = ok(
        server, "/v1/completions", dict(prompt=prompt, temperature=0, max_tokens=5, logprobs=2)
    )
    (want,) = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=2))
    lp, c = got["choices"][0]["logprobs"], want.outputs[0]
    names = [tok.decode([t], skip_special_tokens=False) for t in c.token_ids]
    assert lp["tokens"] == names
    assert lp["token_logprobs"] == pytest.approx(
        [e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True)], rel=1e-6
    )
    offsets = [sum(map(len, names[:i])) for i in range(len(names))]
    assert lp["text_offset"] == offsets
    for top, entry in zip(lp["top_logprobs"], c.logprobs, strict=True):
        best = {}  # keyed by text: two byte tokens can both show as U+FFFD
        for t, x in sorted(entry.items(), key=lambda kv: -kv[1])[:2]:
            best.setdefault(tok.decode([t], skip_special_tokens=False), x)
        assert top == pytest.approx(best, rel=1e-6)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def test_chat_completion_renders_the_template(server, ref, tok, monkeypatch):
    sent = []
    llm = server.engine.llm
    add = llm.add_request
    monkeypatch.setattr(
        llm, "add_request", lambda ids, *a, **k: sent.append(ids) or add(ids, *a, **k)
    )
    body = dict(
        messages=MESSAGES, temperature=0, max_completion_tokens=8, logprobs=True, top_logprobs=1
    )
    got = ok(server, "/v1/chat/completions", body)
    (want,) = ref.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, logprobs=1))
    assert sent == [tok.encode_chat(MESSAGES)]
    c = want.outputs[0]
    assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
    (choice,) = got["choices"]
    assert choice["message"] == dict(role="assistant", content=c.text)
    assert choice["finish_reason"] == c.finish_reason
    content = choice["logprobs"]["content"]
    assert [x["logprob"] for x in content] == pytest.approx(
        [e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True)], rel=1e-6
    )
    assert all(len(x["top_logprobs"]) == 1 for x in content)
    assert got["usage"]["prompt_tokens"] == len(sent[0])

    parts = [{"type": "text", "text": "A function that adds"}, {"type": "text", "text": "two."}]
    joined = [MESSAGES[0], {"role": "user", "content": "A function that adds\ntwo."}]
    ok(
        server,
        "/v1/chat/completions",
        dict(body, messages=[MESSAGES[0], {**MESSAGES[1], "content": parts}]),
    )
    assert sent[1] == tok.encode_chat(joined)  # text parts joined by newlines


def test_streamed_completion_adds_up_with_and_without_stop_strings(server):
    body = dict(prompt="def parse_line(line):", temperature=0, max_tokens=24)
    plain = ok(server, "/v1/completions", body)["choices"][0]
    chunks = stream(server, "/v1/completions", body)
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == plain["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks) > 3  # streamed piece by piece

    text = plain["text"]
    stop = next(text[i : i + 3] for i in range(6, len(text) - 3) if text[i : i + 3].strip())
    cut = ok(server, "/v1/completions", dict(body, stop=[stop, "\x00never"]))["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.find(stop)]
    chunks = stream(server, "/v1/completions", dict(body, stop=[stop, "\x00never"]))
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("longest", [None, 3, 6])
def test_text_is_streamed_as_soon_as_no_stop_string_can_cut_it(server, tok, longest):
    """Each token's text goes out with it; with stop strings, once the next token came,
    less the last max(len(stop)) - 1 characters (the docstring's rule; nothing later
    cut it). Text held back longer, or streamed a token late, still added up."""
    body = dict(prompt="def parse_line(line):", temperature=0, max_tokens=32)
    plain = ok(server, "/v1/completions", dict(body, return_token_ids=True))["choices"][0]
    if longest is not None:
        _, s = a_stop_string([plain["text"][12:]], 3)  # late: text streams before it
        body["stop"] = [s, "\x00never"[:longest]]  # the longest one sets the hold
        plain = ok(server, "/v1/completions", dict(body, return_token_ids=True))["choices"][0]
        assert plain["finish_reason"] == "stop"
    decoder, ends = tok.stream(context=plain["prompt_token_ids"]), []
    for t in plain["token_ids"]:
        decoder.add(t)
        ends.append(len(decoder.text))
    want, sent = [], 0  # the text streamed after each chunk but the last
    for j in range(len(ends)):
        end = ends[j] if longest is None else (ends[j - 1] if j else 0) - (longest - 1)
        if end > sent:
            want.append(sent := end)
    pieces = [c["choices"][0]["text"] for c in stream(server, "/v1/completions", body)]
    assert "".join(pieces) == plain["text"] and len(want) > 3
    assert [len("".join(pieces[: i + 1])) for i in range(len(pieces) - 1)] == want


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


def test_streamed_logprobs_name_tokens_after_the_completion_so_far():
    """A chunk's tokens are named after the ids before them, the completion's earlier
    ones included, as in the whole answer (they were named after the prompt's alone):
    after a prompt of one byte-fallback token, which gives the decoder no text to
    follow, SentencePiece's "▁the" reads "the" first, then " the"."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    (the,) = tok.encode("the", add_bos=False)
    prompt = [3 + ord("A")]  # <0x41>
    body = dict(prompt=prompt, max_tokens=3, logprobs=1, stream=True)
    sizes = dict(vocab_size=tok.vocab_size, max_model_len=64)
    job = api.parse_job(body, chat=False, model_name="m", tokenizer=tok, **sizes)
    gen, entries = [the] * 3, [{the: -0.5, 5: -1.0}] * 3
    text = tok.decode(gen, context=prompt)
    c = CompletionOutput(0, text, gen, -1.5, "length", logprobs=entries)
    (rid,) = job.rids
    events = [("token", rid, 0, t, e) for t, e in zip(gen, entries, strict=True)]
    events.append(("done", rid, RequestOutput(rid, None, prompt, [c], True, 0, 0, None, None)))
    handler = StreamRecorder(tok)
    handler._stream(job, api.response_head(job, "m"), events)
    assert handler.sent[-2:] == [b"data: [DONE]\n\n", b""]
    chunks = [json.loads(x[len(b"data: ") :])["choices"][0] for x in handler.sent[:-2]]
    whole = api.completion_logprobs(tok, c, 1, prompt)
    names = [
        tok.decode([t], skip_special_tokens=False, context=prompt + gen[:i])
        for i, t in enumerate(gen)
    ]
    assert whole["tokens"] == names  # (["the", " the", " the"])
    assert [t for x in chunks for t in x["logprobs"]["tokens"]] == names
    assert [o for x in chunks for o in x["logprobs"]["text_offset"]] == whole["text_offset"]
    assert "".join(x["text"] for x in chunks) == text and len(chunks) == 4


def test_a_lone_stop_string_is_never_streamed(server):
    body = dict(prompt="def parse_line(line):", temperature=0, max_tokens=24)
    text = ok(server, "/v1/completions", body)["choices"][0]["text"]
    stop = next(text[i : i + 3] for i in range(6, len(text) - 3) if text[i : i + 3].strip())
    body["stop"] = stop  # alone (no longer stop string holds more back)
    cut = ok(server, "/v1/completions", body)["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.find(stop)]
    pieces = [c["choices"][0]["text"] for c in stream(server, "/v1/completions", body)]
    assert "".join(pieces) == cut["text"] and sum(map(bool, pieces[:-1])) > 1


def test_streamed_stop_string_let_through_by_min_tokens(server, ref, tok):
    prompt, sp = "import os\n", SamplingParams(temperature=0, max_tokens=32)
    (full,) = ref.generate([prompt], sp)
    ids, text = full.outputs[0].token_ids, full.outputs[0].text
    stop = next(  # 3 characters that occur twice, apart
        s
        for i in range(len(text) - 3)
        if "\ufffd" not in (s := text[i : i + 3]) and text.find(s) == i and text.find(s, i + 3) > 0
    )
    first = next(n for n in range(len(ids) + 1) if stop in tok.decode(ids[:n]))
    (want,) = ref.generate([prompt], dataclasses.replace(sp, stop=(stop,), min_tokens=first + 1))
    want = want.outputs[0]
    assert want.finish_reason == "stop" and stop in want.text  # cut at a later occurrence
    body = dict(prompt=prompt, temperature=0, max_tokens=32, stop=stop, min_tokens=first + 1)
    plain = ok(server, "/v1/completions", body)["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == (want.text, "stop")
    chunks = stream(server, "/v1/completions", body)
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == want.text
    assert stop in "".join(pieces[:-1])  # the earlier occurrence streamed before the end
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_streamed_chat(server):
    body = dict(messages=MESSAGES, temperature=0, max_tokens=12, n=2)
    plain = ok(server, "/v1/chat/completions", body)
    chunks = stream(
        server, "/v1/chat/completions", dict(body, stream_options={"include_usage": True})
    )
    *chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for i, want in enumerate(plain["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == dict(role="assistant", content="")
        assert "".join(c["delta"].get("content", "") for c in mine) == want["message"]["content"]
        assert [c["finish_reason"] for c in mine][-1] == want["finish_reason"]


def choice_pieces(chunks, index: int, chat: bool) -> list[tuple[str, dict]]:
    """(text, logprobs) of each chunk of choice `index` (not a chat's role chunk)."""
    pieces = []
    for chunk in chunks:
        (c,) = chunk["choices"]
        if c["index"] == index and not (chat and "role" in c["delta"]):
            pieces.append((c["delta"].get("content", "") if chat else c["text"], c["logprobs"]))
    return pieces


def logprob_items(lp: dict, chat: bool) -> list[tuple]:
    """(token, logprob, [(top token, logprob)], text offset or bytes) of each token."""
    if chat:
        return [
            (
                x["token"],
                x["logprob"],
                [(y["token"], y["logprob"]) for y in x["top_logprobs"]],
                x["bytes"],
            )
            for x in lp["content"]
        ]
    fields = (lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"])
    return [(t, x, sorted(top.items()), o) for t, x, top, o in zip(*fields, strict=True)]


def assert_same_logprobs(got: list[tuple], want: list[tuple]) -> None:
    """Same tokens (names, top names, offsets or bytes); logprobs within 1e-6."""

    def names(items):
        return [(t, [n for n, _ in top], extra) for t, _, top, extra in items]

    def values(items):
        return [v for _, x, top, _ in items for v in (x, *(y for _, y in top))]

    assert names(got) == names(want)
    assert values(got) == pytest.approx(values(want), rel=1e-6, abs=1e-6)


def check_streamed_logprobs(chunks, plain: dict, ids: list[list[int]], tok, *, chat: bool):
    """Each choice's streamed pieces add up to its non-streamed text and logprobs, and
    every chunk carries the logprobs of the tokens whose text it completes. With
    `ends[j]` the length of the streamed text once token j is in (what the server's
    incremental decoder shows), after a chunk that brings the text streamed to `sent`
    characters, the tokens whose logprobs were streamed are a prefix that holds every
    token of some text with `ends[j] <= sent` (none late) and none with `ends[j] >
    sent` (none early: not one whose text is held back). A token of no text of its own
    (a byte of an unfinished character) may go with the chunk before it or after it."""
    assert len(ids) == len(plain["choices"])
    for want, token_ids in zip(plain["choices"], ids, strict=True):
        pieces = choice_pieces(chunks, want["index"], chat)
        assert "".join(t for t, _ in pieces) == (
            want["message"]["content"] if chat else want["text"]
        )
        items = [logprob_items(lp, chat) for _, lp in pieces]  # None would raise here
        whole = logprob_items(want["logprobs"], chat)
        assert_same_logprobs([x for chunk in items for x in chunk], whole)
        names = [tok.decode([t], skip_special_tokens=False) for t in token_ids]
        assert [x[0] for x in whole] == names  # `ids` are the answer's tokens
        decoder, ends = tok.stream(), []
        for t in token_ids:
            decoder.add(t)
            ends.append(len(decoder.text))
        starts, sent, count = [0, *ends[:-1]], 0, 0
        for (piece, _), chunk in zip(pieces[:-1], items[:-1], strict=True):
            sent, count = sent + len(piece), count + len(chunk)
            done = [j for j, e in enumerate(ends) if starts[j] < e <= sent]  # of some text
            assert max(done, default=-1) < count <= sum(e <= sent for e in ends)
        assert len(pieces) > 2 and count > 0  # streamed, not all at the end


def a_stop_string(texts: list[str], width: int) -> tuple[int, str]:
    """(j, s): s, `width` whole characters of `texts[j]` first found past its 4th."""
    for j, text in enumerate(texts):
        for i in range(4, len(text) - width):
            s = text[i : i + width]
            if "\ufffd" not in s and text.find(s) == i:
                return j, s
    raise AssertionError(f"no stop string to take from {texts}")


def test_streamed_completion_logprobs_add_up_to_the_answer(server, ref, tok):
    prompts = ["def parse_line(line):", "x = [1, 2"]
    greedy = dict(prompt=prompts[0], temperature=0, max_tokens=16, logprobs=2)
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    plain = ok(server, "/v1/completions", greedy)
    ids = [ref.generate([prompts[0]], sp)[0].outputs[0].token_ids]
    check_streamed_logprobs(stream(server, "/v1/completions", greedy), plain, ids, tok, chat=False)

    # Seeded sampling, n=2, and a stop string that cuts a completion in its middle: the
    # tokens that complete it have logprobs in the answer but no text; the text before
    # it is held back by 2 characters.
    body = dict(prompt=prompts, n=2, seed=3, temperature=0.8, max_tokens=16, logprobs=2)
    sp = dataclasses.replace(sp, n=2, seed=3, temperature=0.8)
    texts = [c["text"] for c in ok(server, "/v1/completions", body)["choices"]]
    j, stop = a_stop_string(texts, 3)
    body, sp = dict(body, stop=stop), dataclasses.replace(sp, stop=(stop,))
    plain = ok(server, "/v1/completions", body)
    cut = plain["choices"][j]
    assert cut["finish_reason"] == "stop" and cut["text"] == texts[j][: texts[j].find(stop)]
    ids = [c.token_ids for o in ref.generate(prompts, sp) for c in o.outputs]
    assert stop in tok.decode(ids[j]) and len(cut["logprobs"]["tokens"]) == len(ids[j])
    check_streamed_logprobs(stream(server, "/v1/completions", body), plain, ids, tok, chat=False)


def test_streamed_chat_logprobs_add_up_to_the_answer(server, ref, tok):
    greedy = dict(messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=1)
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    plain = ok(server, "/v1/chat/completions", greedy)
    ids = [ref.chat(MESSAGES, sp)[0].outputs[0].token_ids]
    check_streamed_logprobs(
        stream(server, "/v1/chat/completions", greedy), plain, ids, tok, chat=True
    )

    body = dict(greedy, n=2, seed=3, temperature=0.8, max_tokens=16)
    sp = dataclasses.replace(sp, n=2, seed=3, temperature=0.8, max_tokens=16)
    texts = [c["message"]["content"] for c in ok(server, "/v1/chat/completions", body)["choices"]]
    j, stop = a_stop_string(texts, 2)
    body, sp = dict(body, stop=stop), dataclasses.replace(sp, stop=(stop,))
    plain = ok(server, "/v1/chat/completions", body)
    assert plain["choices"][j]["finish_reason"] == "stop"
    ids = [c.token_ids for c in ref.chat(MESSAGES, sp)[0].outputs]
    check_streamed_logprobs(
        stream(server, "/v1/chat/completions", body), plain, ids, tok, chat=True
    )


def test_engine_thread_token_events_carry_logprobs_only_when_asked(server):
    sink = queue.SimpleQueue()
    with_lp = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    requests = [("lp-0", [1, 70, 71], with_lp), ("lp-1", [1, 70, 71], SamplingParams(max_tokens=4))]
    server.engine.submit(requests, sink, tokens=True)
    events, done = {"lp-0": [], "lp-1": []}, {}
    while len(done) < 2:
        event = sink.get(timeout=60)
        assert event[0] in ("token", "done"), event
        if event[0] == "done":
            done[event[1]] = event[2].outputs[0]
        else:
            events[event[1]].append(event[2:])
    lp, plain = done["lp-0"], done["lp-1"]
    assert events["lp-0"] == [(0, *e) for e in zip(lp.token_ids, lp.logprobs, strict=True)]
    assert events["lp-1"] == [(0, t) for t in plain.token_ids]  # as before: four elements


def test_concurrent_requests_equal_their_sequential_results(server, ref):
    prompts = [f"def f{i}(x):\n    return x {'+-*/%<>&'[i]} " for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=8)
    want = [ref.generate([p], sp)[0].outputs[0].text for p in prompts]

    def one(p):
        return ok(server, "/v1/completions", dict(prompt=p, temperature=0, max_tokens=8))

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    assert [g["choices"][0]["text"] for g in got] == want


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
    monkeypatch.setattr(serve, "POLL_S", 0.001)  # check the client at every wait
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


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/completions", dict(prompt="a", temperature=-1), 400, "temperature=-1"),
        ("/v1/completions", dict(prompt="a", top_p=1.5), 400, "top_p=1.5"),
        ("/v1/completions", dict(prompt="a", n=0), 400, "n=0"),
        ("/v1/completions", dict(prompt="a", max_tokens="9"), 400, "max_tokens='9'"),
        ("/v1/completions", dict(prompt="a", logprobs=21), 400, "logprobs=21"),
        ("/v1/completions", dict(prompt="a", logit_bias={"x": 1}), 400, "'x'"),
        ("/v1/completions", dict(prompt="a", logit_bias={"256": 1}), 400, "'256'"),
        ("/v1/completions", dict(prompt="a", logit_bias={"5": 101}), 400, "=101"),
        ("/v1/completions", dict(prompt="a", min_tokens=-1), 400, "min_tokens=-1"),
        ("/v1/completions", dict(prompt="a", cache_salt=5), 400, "cache_salt"),
        ("/v1/completions", dict(prompt="a", stop=[""]), 400, "stop=['']"),
        ("/v1/completions", dict(prompt="a", suffix="b"), 400, "suffix"),
        ("/v1/completions", dict(prompt="a", model="gpt-4"), 404, "'gpt-4'"),  # was a 400
        ("/v1/completions", dict(prompt="a", echo=True), 400, "echo=true is not supported"),
        ("/v1/completions", dict(prompt="a", return_token_ids="y"), 400, "return_token_ids='y'"),
        ("/v1/completions", dict(prompt="a", logprobs=21, stream=True), 400, "logprobs=21"),
        ("/v1/completions", dict(prompt="x" * 600), 400, "max_model_len=512"),
        ("/v1/completions", dict(prompt="x" * 500), 400, "max_tokens=16 are more than"),
        ("/v1/completions", dict(prompt="a", max_tokens=600), 400, "at most 511"),
        ("/v1/completions", dict(prompt="a", stream="yes"), 400, "stream='yes'"),
        ("/v1/completions", dict(prompt="a", use_beam_search=True), 400, "beam search"),
        ("/v1/chat/completions", dict(messages=[{"content": "hi"}]), 400, "role=None"),
        ("/v1/completions", dict(prompt=[]), 400, "prompt=[]"),
        ("/v1/completions", dict(prompt=[[1, 2], [3, 999]]), 400, "prompt 1:"),
        ("/v1/chat/completions", dict(messages="hi"), 400, "'hi'"),
        ("/v1/chat/completions", dict(messages=[MESSAGES[1]] * 40), 400, "max_model_len=512"),
        ("/v1/chat/completions", dict(messages=MESSAGES, top_logprobs=2), 400, "logprobs=true"),
        (
            "/v1/chat/completions",
            dict(messages=MESSAGES, top_logprobs=2, stream=True),
            400,
            "logprobs=true",
        ),
        (
            "/v1/chat/completions",
            dict(messages=MESSAGES, logprobs=True, top_logprobs=21, stream=True),
            400,
            "logprobs=21",
        ),
        ("/v1/chat/completions", dict(messages=MESSAGES, tools=[{}]), 400, "tools"),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            400,
            "only text content parts",
        ),
    ],
)
def test_bad_fields_are_4xx_naming_the_value(server, path, body, status, words):
    got, err = request(server, path, body)
    assert got == status and words in err["error"]["message"], err
    assert err["error"]["type"] == "invalid_request_error"
    assert set(err["error"]) == {"message", "type", "param", "code"}


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
    monkeypatch.setattr(serve, "POLL_S", 0.001)  # check the client at every wait
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
    ],
)
def test_the_http_servers_own_errors_are_json(server, data, status, words):
    """http.server's own errors (an unknown method, too many headers, ...) are OpenAI's
    JSON errors, as all others are; they were HTML pages."""
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


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--port", "70000"], "--port"),
        (["--bogus"], "--bogus"),
        (["--page-size", "0"], "--page-size"),
        (["--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    ],
)
def test_bad_flags_are_one_line_and_status_2(argv, words, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err


def test_a_port_in_use_is_one_line_before_loading(ckpt, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("pagedjax.engine.LLM", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--checkpoint", str(ckpt), "--port", str(port), "--backend", "xla"]
        assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


def test_the_cli_serves_a_checkpoint_without_a_tokenizer(bare_ckpt, monkeypatch, capsys):
    """serve.py refused it ("has no tokenizer.json; it is needed to encode prompts"),
    though such a checkpoint serves token id prompts."""
    started = []
    start = serve.Server.start
    monkeypatch.setattr(
        serve.Server, "start", lambda srv, llm: started.append(llm) or start(srv, llm)
    )
    monkeypatch.setattr(serve.Server, "serve_forever", lambda srv, *a, **k: None)
    argv = ["--checkpoint", bare_ckpt, "--port", "0", "--quiet", "--backend", "xla"]
    argv += ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
    argv += ["--compilation-cache", "off"]
    assert serve.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert len(started) == 1 and started[0].tokenizer is None


def run_cli_without_serving(path, monkeypatch, capsys) -> str:
    """serve.py's main on `path`, returning at once instead of serving; its stderr."""
    monkeypatch.setattr(serve.Server, "serve_forever", lambda srv, *a, **k: None)
    argv = ["--checkpoint", path, "--port", "0", "--quiet", "--backend", "xla"]
    argv += ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
    argv += ["--compilation-cache", "off"]
    rc = serve.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 0, err
    return err


def test_a_chat_checkpoint_without_jinja2_is_noted_at_start(ckpt, monkeypatch, capsys):
    """Chat requests fail without jinja2 (a 500 naming the fix); the server says so when
    it starts, not first at a client's request."""
    assert "will fail" not in run_cli_without_serving(ckpt, monkeypatch, capsys)
    monkeypatch.setattr(serve, "jinja_missing", lambda: "chat templates need jinja2")
    err = run_cli_without_serving(ckpt, monkeypatch, capsys)
    assert "note: /v1/chat/completions will fail: chat templates need jinja2" in err, err


# ------------------------------------------------------------------- token ids


def check_token_id_stream(chunks, plain: dict) -> None:
    """A stream without a tokenizer: per choice, one chunk per token (text "", its id,
    its logprobs), then a last one with no token and the finish_reason; the chunks' ids
    and logprobs add up to the non-streamed answer's."""
    assert {c["choices"][0]["index"] for c in chunks} == {c["index"] for c in plain["choices"]}
    for want in plain["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == want["index"]]
        *pieces, last = mine
        assert [len(p["token_ids"]) for p in pieces] == [1] * len(want["token_ids"])
        assert all(p["text"] == "" and p["finish_reason"] is None for p in pieces)
        assert (last["text"], last["token_ids"]) == ("", [])
        assert last["finish_reason"] == want["finish_reason"]
        assert [t for p in mine for t in p["token_ids"]] == want["token_ids"]
        if want["logprobs"] is None:
            assert all(p["logprobs"] is None for p in mine)
            continue
        for p in pieces:  # each chunk's logprobs are its own token's
            assert p["logprobs"]["tokens"] == [f"token_id:{t}" for t in p["token_ids"]]
        items = [x for p in mine for x in logprob_items(p["logprobs"], chat=False)]
        assert_same_logprobs(items, logprob_items(want["logprobs"], chat=False))


def test_without_a_tokenizer_choices_carry_token_ids_streamed_or_not(bare_server, ref):
    prompts = [[1, 100, 101, 102, 103], [1, 50, 60]]
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    body = dict(prompt=prompts, temperature=0, max_tokens=6, logprobs=2)
    plain = ok(bare_server, "/v1/completions", body)
    want = [o.outputs[0] for o in ref.generate(prompts, sp)]
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    for got, c in zip(plain["choices"], want, strict=True):
        assert set(got) == {"index", "text", "logprobs", "token_ids", "finish_reason"}
        assert (got["text"], got["token_ids"]) == ("", c.token_ids)
        assert got["finish_reason"] == c.finish_reason
        lp = got["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c.token_ids]
        assert lp["text_offset"] == [0] * len(c.token_ids)
        assert lp["token_logprobs"] == pytest.approx(
            [e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True)], rel=1e-6
        )
        for top, entry in zip(lp["top_logprobs"], c.logprobs, strict=True):
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:2]
            assert top == pytest.approx({f"token_id:{t}": x for t, x in best}, rel=1e-6)
    check_token_id_stream(stream(bare_server, "/v1/completions", body), plain)

    # Seeded sampling, n=2, with a usage chunk; and without logprobs.
    body = dict(prompt=prompts, n=2, seed=5, temperature=0.8, max_tokens=6, logprobs=1)
    sp = SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=6, logprobs=1)
    plain = ok(bare_server, "/v1/completions", body)
    want = [c.token_ids for o in ref.generate(prompts, sp) for c in o.outputs]
    assert [c["token_ids"] for c in plain["choices"]] == want and len(set(map(tuple, want))) > 1
    *chunks, usage = stream(
        bare_server, "/v1/completions", dict(body, stream_options={"include_usage": True})
    )
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    check_token_id_stream(chunks, plain)
    body.pop("logprobs")
    plain = ok(bare_server, "/v1/completions", body)
    assert [c["token_ids"] for c in plain["choices"]] == want
    check_token_id_stream(stream(bare_server, "/v1/completions", body), plain)


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/v1/completions", dict(prompt="def f():"), "tokenizer"),
        ("/v1/completions", dict(prompt=[1, 2], stop="x"), "stop strings need a tokenizer"),
        ("/v1/completions", dict(prompt=[1, 2], return_token_ids=1), "return_token_ids=1"),
        ("/v1/chat/completions", dict(messages=MESSAGES), "cannot chat: no tokenizer"),
    ],
)
def test_without_a_tokenizer_text_is_a_400(bare_server, path, body, words):
    status, err = request(bare_server, path, body)
    assert status == 400 and words in err["error"]["message"], err


def test_return_token_ids_with_a_tokenizer(server, ref, tok):
    prompt = "def parse_line(line):"
    body = dict(prompt=prompt, temperature=0, max_tokens=16, logprobs=1, return_token_ids=True)
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    (full,) = ref.generate([prompt], sp)
    _, stop = a_stop_string([full.outputs[0].text], 3)
    (want,) = ref.generate([prompt], dataclasses.replace(sp, stop=(stop,)))
    c = want.outputs[0]
    body["stop"] = stop  # a stop string: its tokens are in token_ids, not its text
    (got,) = ok(server, "/v1/completions", body)["choices"]
    assert (got["text"], got["token_ids"], got["finish_reason"]) == (c.text, c.token_ids, "stop")
    assert got["prompt_token_ids"] == want.prompt_token_ids == tok.encode(prompt)
    chunks = [x["choices"][0] for x in stream(server, "/v1/completions", body)]
    assert chunks[0]["prompt_token_ids"] == want.prompt_token_ids
    assert not any("prompt_token_ids" in x for x in chunks[1:])
    assert "".join(x["text"] for x in chunks) == c.text and len(chunks) > 2
    assert [t for x in chunks for t in x["token_ids"]] == c.token_ids
    # A chunk's ids are the tokens of its logprobs (those whose text it completes).
    assert [len(x["token_ids"]) for x in chunks] == [len(x["logprobs"]["tokens"]) for x in chunks]

    body = dict(messages=MESSAGES, temperature=0, max_tokens=8, return_token_ids=True)
    (want,) = ref.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))
    plain = ok(server, "/v1/chat/completions", body)
    assert plain["prompt_token_ids"] == want.prompt_token_ids == tok.encode_chat(MESSAGES)
    assert plain["choices"][0]["token_ids"] == want.outputs[0].token_ids
    role, *chunks = stream(server, "/v1/chat/completions", body)
    assert role["prompt_token_ids"] == want.prompt_token_ids
    assert role["choices"][0]["token_ids"] == []
    assert [t for x in chunks for t in x["choices"][0]["token_ids"]] == want.outputs[0].token_ids
    assert not any("prompt_token_ids" in x for x in chunks)
