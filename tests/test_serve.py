"""scripts/serve.py end to end: its endpoints' answers, the fields they refuse, its CLI.

One server in-process on a free port, spoken to with urllib (tests/serve_helpers.py has
the checkpoint, the servers and the clients); every answer is checked against an `LLM`
built the same way (`ref`) and the same SamplingParams. tests/test_serve_stream.py
checks streaming, tests/test_serve_http.py the HTTP plumbing (`pagedjax.http_server`)
and the failures.
"""

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import serve_helpers
from serve_helpers import MESSAGES, ok, request, serve, stream

from pagedjax.engine import SamplingParams, StructuredOutputsParams

# serve_helpers' fixtures, bound here: this module gets its own checkpoint and servers.
ckpt, bare_ckpt, ref, tok = (
    serve_helpers.ckpt,
    serve_helpers.bare_ckpt,
    serve_helpers.ref,
    serve_helpers.tok,
)
server, bare_server = serve_helpers.server, serve_helpers.bare_server


def test_health_and_models(server):
    assert request(server, "/health") == (200, "ok")
    models = ok(server, "/v1/models", None)
    model = dict(id="tiny", object="model", created=0, owned_by="pagedjax", max_model_len=512)
    assert models == dict(object="list", data=[model])
    assert ok(server, "/v1/models/?x=1", None) == models  # a trailing slash, a query
    assert request(server, "/health/") == (200, "ok")
    # OpenAI's models.retrieve: one model's card (it was a 404, "no such path").
    assert ok(server, "/v1/models/tiny", None) == model
    status, err = request(server, "/v1/models/gpt-4%2Fx")
    assert status == 404 and err["error"]["code"] == "model_not_found"
    assert err["error"]["message"] == "model 'gpt-4/x' is not served here; served: 'tiny'"
    status, _ = request(server, "/v1/models/tiny", dict(x=1), method="POST")
    assert status == 405


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
    reason = obj["choices"][0]["finish_reason"]
    success = {k: v for k, v in grew.items() if k.startswith("pagedjax:request_success_total")}
    assert success.pop(f'pagedjax:request_success_total{{finished_reason="{reason}"}}') == 1
    assert set(success.values()) == {0}  # (the other reasons, at 0 from the start)
    assert grew["pagedjax:time_to_first_token_seconds_count"] == 1
    assert grew["pagedjax:prefix_cache_queries_total"] == len(ids)
    assert after["pagedjax:num_requests_running"] == after["pagedjax:num_requests_waiting"] == 0
    assert 0 <= after["pagedjax:kv_cache_usage_perc"] <= 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        counts = [v for k, v in after.items() if k.startswith(f"pagedjax:{name}_bucket")]
        assert counts == sorted(counts) and len(counts) > 10  # cumulative, vLLM's buckets
        assert after[f'pagedjax:{name}_bucket{{le="+Inf"}}'] == after[f"pagedjax:{name}_count"]
        assert grew[f'pagedjax:{name}_bucket{{le="+Inf"}}'] == 1


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


def test_structured_outputs_by_response_format_and_vllms_fields(server, ref):
    """A chat answer constrained by a JSON schema parses and fits it; a streamed
    completion constrained to choices is one of them; both equal the engine's."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    body = dict(messages=MESSAGES, temperature=0, max_tokens=40, response_format=fmt)
    got = ok(server, "/v1/chat/completions", body)
    sp = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    (want,) = ref.chat(MESSAGES, sp)
    (choice,) = got["choices"]
    assert choice["message"]["content"] == want.outputs[0].text
    assert choice["finish_reason"] == "stop"  # (not cut by max_tokens: a whole object)
    obj = json.loads(choice["message"]["content"])
    assert set(obj) == {"name", "n"} and type(obj["n"]) is int
    choices = ["red", "green", "blue"]
    body = dict(prompt="Colour: ", temperature=0.8, seed=5, n=3, guided_choice=choices)
    chunks = stream(server, "/v1/completions", dict(body, stream=True))
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
             for i in range(3)]  # fmt: skip
    sp = SamplingParams(
        temperature=0.8, seed=5, n=3, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    (want,) = ref.generate(["Colour: "], sp)
    assert texts == [c.text for c in want.outputs] and set(texts) <= set(choices)


def test_concurrent_requests_equal_their_sequential_results(server, ref):
    prompts = [f"def f{i}(x):\n    return x {'+-*/%<>&'[i]} " for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=8)
    want = [ref.generate([p], sp)[0].outputs[0].text for p in prompts]

    def one(p):
        return ok(server, "/v1/completions", dict(prompt=p, temperature=0, max_tokens=8))

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    assert [g["choices"][0]["text"] for g in got] == want


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
        ("/v1/completions", dict(prompt="a", echo=1), 400, "echo=1"),
        ("/v1/completions", dict(prompt="a", return_token_ids="y"), 400, "return_token_ids='y'"),
        ("/v1/completions", dict(prompt="a", logprobs=21, stream=True), 400, "logprobs=21"),
        ("/v1/completions", dict(prompt="x" * 600), 400, "max_model_len=512"),
        ("/v1/completions", dict(prompt="x" * 500), 400, "max_tokens=16 are more than"),
        ("/v1/completions", dict(prompt="a", max_tokens=600), 400, "at most 511"),
        ("/v1/completions", dict(prompt="a", stream="yes"), 400, "stream='yes'"),
        ("/v1/completions", dict(prompt="a", use_beam_search=1), 400, "use_beam_search=1"),
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
    started = serve_helpers.capture_start(monkeypatch)
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


def test_sigterm_stops_the_server_as_ctrl_c_does(ckpt, monkeypatch, capsys):
    """SIGTERM (`kill`, `docker stop`, systemd) killed the process at once, its requests in
    flight cut; it now stops the server as Ctrl-C does (`Server.close` answers them)."""
    servers = []

    def serve_forever(srv, *args, **kwargs):
        servers.append(srv)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # (a bound: the signal ends it)

    def not_handled(signum, frame):
        raise AssertionError("serve.py left SIGTERM to the default: the process was killed")

    monkeypatch.setattr(serve.Server, "serve_forever", serve_forever)
    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        argv = ["--checkpoint", ckpt, "--port", "0", "--quiet", "--backend", "xla"]
        argv += ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
        argv += ["--compilation-cache", "off"]
        assert serve.main([str(a) for a in argv]) == 0, capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is not_handled  # restored
    finally:
        signal.signal(signal.SIGTERM, previous)
    (srv,) = servers
    assert not srv.engine.alive and srv.socket.fileno() == -1  # closed
