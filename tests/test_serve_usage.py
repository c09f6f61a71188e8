"""scripts/serve.py's `usage` with `--enable-prompt-tokens-details` (vLLM's flag): its
`prompt_tokens_details.cached_tokens`, the prompt tokens the prefix cache served, on
completions and chat, streamed (the usage chunk) and not; none without the flag.

The tests' pages hold 8 tokens (tests/serve_helpers.py's geometry); the byte tokenizer
makes each character a token, so a prompt of a few dozen characters sent twice hits
the pages of its first run. Each test's prompts are its own: no other test warmed them.
tests/serve_helpers.py has the checkpoint, the server and the clients.
"""

import pytest
import serve_helpers
from serve_helpers import ok, stream

from pagedjax.engine import SamplingParams

ckpt, ref = serve_helpers.ckpt, serve_helpers.ref
serve = serve_helpers.serve
FILLER = " def add(a, b):\n    return a + b\n"  # 34 characters: four pages and some


@pytest.fixture(scope="module")
def server(ckpt):
    llm = serve_helpers.make_llm(ckpt)
    yield from serve_helpers.serving(llm, "tiny", enable_prompt_tokens_details=True)


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def hit(ref, ids: list[int]) -> int:
    """The prefix-cache hit of `ids` run a second time on an engine of the same geometry
    (whole pages: never the prompt's last token, which must be computed)."""
    sp = SamplingParams(max_tokens=1, temperature=0)
    first, second = (ref.generate([{"prompt_token_ids": ids}], sp)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 or first.num_cached_tokens == second.num_cached_tokens
    return second.num_cached_tokens


def test_completions_count_the_prompt_tokens_read_from_the_prefix_cache(server, ref):
    """A prompt's first run reads no page (0, which vLLM leaves out, is answered); the
    same prompt again reads its whole pages, streamed or not."""
    body = dict(prompt="completions:" + FILLER, max_tokens=2, temperature=0)
    first = ok(server, "/v1/completions", body)
    assert cached(first) == 0
    n = first["usage"]["prompt_tokens"]
    want = hit(ref, server.tokenizer.encode(body["prompt"]))
    assert 0 < want < n and want % 8 == 0
    again = ok(server, "/v1/completions", body)
    assert again["usage"] == dict(
        prompt_tokens=n,
        completion_tokens=2,
        total_tokens=n + 2,
        prompt_tokens_details=dict(cached_tokens=want),
    )
    chunks = stream(server, "/v1/completions", dict(body, stream_options={"include_usage": True}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == again["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_counts_them_too(server):
    messages = [{"role": "user", "content": "chat:" + FILLER}]
    body = dict(messages=messages, max_tokens=2, temperature=0)
    assert cached(ok(server, "/v1/chat/completions", body)) == 0
    again = ok(server, "/v1/chat/completions", body)
    n = again["usage"]["prompt_tokens"]
    assert 0 < cached(again) < n and cached(again) % 8 == 0
    chunks = stream(
        server, "/v1/chat/completions", dict(body, stream_options={"include_usage": True})
    )
    assert chunks[-1]["usage"] == again["usage"]


def test_a_batch_sums_its_prompts_hits_and_n_counts_each_prompt_once(server, ref):
    """As `prompt_tokens`: summed over a completions batch's prompts, each once whatever
    its `n` (vLLM answers one prompt's hit)."""
    a, b = "batch a:" + FILLER, "batch b:" + FILLER * 2
    want = {p: hit(ref, server.tokenizer.encode(p)) for p in (a, b)}
    body = dict(prompt=a, max_tokens=2, temperature=0.8, seed=1, n=2)
    assert cached(ok(server, "/v1/completions", body)) == 0  # a's pages now cached
    answer = ok(server, "/v1/completions", dict(body, prompt=[a, b]))
    assert len(answer["choices"]) == 4 and cached(answer) == want[a]  # b's first run
    answer = ok(server, "/v1/completions", dict(body, prompt=[a, b]))
    assert cached(answer) == want[a] + want[b]
    opts = {"include_usage": True}
    chunks = stream(server, "/v1/completions", dict(body, prompt=[a, b], stream_options=opts))
    assert chunks[-1]["usage"]["prompt_tokens_details"] == dict(cached_tokens=want[a] + want[b])


def test_without_the_flag_usage_has_no_details(server, monkeypatch):
    monkeypatch.setattr(server, "enable_prompt_tokens_details", False)
    body = dict(prompt="no details:" + FILLER, max_tokens=2, temperature=0)
    for _ in range(2):
        assert "prompt_tokens_details" not in ok(server, "/v1/completions", body)["usage"]
    messages = [{"role": "user", "content": "no details" + FILLER}]
    chat = dict(messages=messages, max_tokens=2)
    for path, sent in [("/v1/completions", body), ("/v1/chat/completions", chat)]:
        sent = dict(sent, stream_options={"include_usage": True})
        usage = stream(server, path, sent)[-1]["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_the_cli_flag(ckpt, monkeypatch):
    """serve.py's `--enable-prompt-tokens-details` (off by default) reaches the Server."""
    servers = []
    monkeypatch.setattr(serve.Server, "start", lambda srv, llm: servers.append(srv))
    monkeypatch.setattr(serve.Server, "serve_forever", lambda srv, *a, **k: None)
    argv = ["--checkpoint", ckpt, "--port", "0", "--quiet", "--backend", "xla"]
    argv += ["--page-size", "8", "--num-pages", "64", "--compilation-cache", "off"]
    assert serve.main([str(a) for a in argv]) == 0
    assert serve.main([str(a) for a in [*argv, "--enable-prompt-tokens-details"]]) == 0
    assert [s.enable_prompt_tokens_details for s in servers] == [False, True]
