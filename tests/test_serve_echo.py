"""scripts/serve.py's `echo` and vLLM's `prompt_logprobs`, end to end (`pagedjax.openai_echo`).

A completion with `echo: true` answers its prompt's text then its own, its logprobs
covering the prompt's tokens (the engine's prompt logprobs, the dense model's) then its
own; lm-evaluation-harness's `local-completions` scores loglikelihoods from them as it
does against vLLM (`lm_eval_loglikelihoods` is its `parse_logprobs`). `max_tokens: 0`
answers the prompt alone; streams add up to the whole answer; chat echoes the last
message it continues; bad fields are 400s naming them. tests/serve_helpers.py has the
checkpoint, the servers and the clients.
"""

import numpy as np
import pytest
import serve_helpers
from engine_helpers import Dense, dense_log_softmax
from openai_api_helpers import VOCAB, job
from serve_helpers import ok, request, stream

from pagedjax.engine import SamplingParams
from pagedjax.openai_api import token_texts, usage
from pagedjax.request import CompletionOutput, RequestOutput

# serve_helpers' fixtures, bound here: this module gets its own checkpoint and servers.
ckpt, bare_ckpt, ref, tok = (
    serve_helpers.ckpt,
    serve_helpers.bare_ckpt,
    serve_helpers.ref,
    serve_helpers.tok,
)
server, bare_server = serve_helpers.server, serve_helpers.bare_server

PROMPT = "def add(a, b):"
ECHO = dict(temperature=0, max_tokens=1, logprobs=1, echo=True, seed=1234)  # lm-eval's


@pytest.fixture(scope="module")
def dense(ref):
    return Dense(ref.params)


def lm_eval_loglikelihoods(answer: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's `LocalCompletionsAPI.parse_logprobs` (lm_eval/models/openai_completions.py):
    per choice, by index, the sum of the token logprobs after the context but the last
    (the generated token), and whether each of those was its position's most likely."""
    res = []
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))
        res.append((sum(lps), greedy))
    return res


def dense_loglikelihood(dense, context: list[int], continuation: list[int]):
    """(sum of the continuation's logprobs, all greedy) under the dense model."""
    ids = context + continuation
    rows = dense_log_softmax(dense, [ids[:j] for j in range(len(context), len(ids))])
    pairs = list(zip(rows, continuation, strict=True))
    return sum(row[t] for row, t in pairs), all(int(np.argmax(row)) == t for row, t in pairs)


def close(a, b, tol: float = 1e-5) -> bool:
    """Equal but for float rounding: logprobs of separate runs (prompt logprobs change
    how a prompt is batched) agree to about 1e-6."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(close(a[x], b[x], tol) for x in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b


def check_offsets(logprobs: dict, text: str) -> None:
    """The tokens spell the text and each `text_offset` is where its token starts in it."""
    assert "".join(logprobs["tokens"]) == text
    for token, at in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert text[at : at + len(token)] == token


def test_echo_scores_the_prompt_as_the_engine_and_the_dense_model_do(server, ref, tok, dense):
    """The echoed logprobs are the engine's prompt logprobs (names, ranks and all) then
    the completion's, as the answer without echo has them; the text is the prompt's and
    the completion's, and the offsets point into it."""
    body = dict(prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2)
    plain = ok(server, "/v1/completions", body)["choices"][0]
    got = ok(server, "/v1/completions", dict(body, echo=True, prompt_logprobs=3))
    choice = got["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    ids = tok.encode(PROMPT)
    lp, n = choice["logprobs"], len(ids)
    assert got["usage"]["prompt_tokens"] == n and got["usage"]["completion_tokens"] == 4
    assert len(lp["tokens"]) == n + 4 and lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert close(lp["token_logprobs"][n:], plain["logprobs"]["token_logprobs"])
    assert close(lp["top_logprobs"][n:], plain["logprobs"]["top_logprobs"])
    check_offsets(lp, choice["text"])

    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=3)
    (want,) = ref.generate([ids], sp)
    rows = dense_log_softmax(dense, [ids[:j] for j in range(1, n)])
    pairs = zip(ids[1:], want.prompt_logprobs[1:], rows, strict=True)
    for j, (t, entry, row) in enumerate(pairs, 1):
        assert lp["token_logprobs"][j] == pytest.approx(entry[t], abs=1e-6)
        assert lp["token_logprobs"][j] == pytest.approx(row[t], abs=2e-5)
        # The 2 most likely (logprobs=2, though 3 were computed) and the prompt token.
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:2]
        names = {tok.decode([u]) for u, _ in top} | {tok.decode([t])}
        assert set(lp["top_logprobs"][j]) == names
    # vLLM's prompt_logprobs beside them: the engine's entries, 3 most likely each.
    pl = choice["prompt_logprobs"]
    assert pl[0] is None and len(pl) == n
    for got_entry, entry in zip(pl[1:], want.prompt_logprobs[1:], strict=True):
        assert list(got_entry) == [str(t) for t in entry]
        for t, x in entry.items():
            lp_t = got_entry[str(t)]
            assert lp_t["logprob"] == pytest.approx(x, abs=1e-6)
            assert (lp_t["rank"], lp_t["decoded_token"]) == (x.rank, x.decoded_token)


@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_loglikelihoods_are_the_dense_models(server, tok, dense, tokenized):
    """lm-eval's loglikelihood requests (a batch of token id prompts, or strings with
    tokenized_requests=False), read as lm-eval reads them, score the continuation as the
    dense model does; a greedy continuation is found greedy, another not."""
    context = tok.encode(PROMPT)
    if tokenized:
        body = dict(prompt=context, temperature=0, max_tokens=5, ignore_eos=True)
        body["return_token_ids"] = True
        greedy = ok(server, "/v1/completions", body)["choices"][0]["token_ids"]
        conts = [greedy, tok.encode(" return a + b")]
        prompts = [context + c for c in conts]
    else:  # (texts that encode back to the same ids, as lm-eval assumes)
        conts = [tok.encode(" return a + b"), tok.encode(" pass")]
        prompts = [tok.decode(context + c) for c in conts]
    answer = ok(server, "/v1/completions", dict(ECHO, prompt=prompts, model="tiny"))
    got = lm_eval_loglikelihoods(answer, [len(context)] * 2)
    for (lp, is_greedy), cont in zip(got, conts, strict=True):
        want_lp, want_greedy = dense_loglikelihood(dense, context, cont)
        assert lp == pytest.approx(want_lp, abs=1e-3)
        assert is_greedy == want_greedy
    if tokenized:
        assert [g for _, g in got] == [True, False]


def test_max_tokens_zero_answers_the_prompt_alone(server, tok):
    """vLLM's max_tokens 0 with echo: the prompt's text and logprobs, no token generated
    (usage says none; the engine's one is dropped), streamed or not."""
    body = dict(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, return_token_ids=True)
    got = ok(server, "/v1/completions", body)
    (choice,) = got["choices"]
    ids = tok.encode(PROMPT)
    n = len(ids)
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (PROMPT, [], "length")
    assert len(choice["logprobs"]["tokens"]) == n and choice["prompt_token_ids"] == ids
    check_offsets(choice["logprobs"], PROMPT)
    assert got["usage"] == dict(prompt_tokens=n, completion_tokens=0, total_tokens=n)
    with_one = ok(server, "/v1/completions", dict(body, max_tokens=1))["choices"][0]
    assert close(with_one["logprobs"]["token_logprobs"][:n], choice["logprobs"]["token_logprobs"])
    chunks = stream(server, "/v1/completions", dict(body, stream_options={"include_usage": True}))
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == [PROMPT]
    assert close(chunks[0]["choices"][0]["logprobs"], choice["logprobs"])
    assert chunks[-1]["usage"] == got["usage"]
    without_logprobs = ok(server, "/v1/completions", dict(body, logprobs=None))["choices"][0]
    assert without_logprobs["text"] == PROMPT and without_logprobs["logprobs"] is None


def test_every_choice_echoes_its_prompt(server, tok):
    """n = 2 over two token id prompts: choice i * n + j echoes prompt i (its text as its
    tokens spell it), with the same prompt logprobs, then its own sampled completion."""
    prompts = [tok.encode(PROMPT), tok.encode("class Point:")]
    body = dict(prompt=prompts, n=2, temperature=1.0, seed=7, max_tokens=6, logprobs=0)
    body["ignore_eos"] = True
    plain = ok(server, "/v1/completions", body)["choices"]
    got = ok(server, "/v1/completions", dict(body, echo=True))["choices"]
    assert [c["index"] for c in got] == [0, 1, 2, 3]
    for c, p in zip(got, plain, strict=True):
        prompt_text = PROMPT if c["index"] < 2 else "class Point:"
        n = len(tok.encode(prompt_text))
        assert c["text"] == prompt_text + p["text"]
        assert close(c["logprobs"]["token_logprobs"][n:], p["logprobs"]["token_logprobs"])
        check_offsets(c["logprobs"], c["text"])
    for a, b in (got[:2], got[2:]):
        n = len(a["logprobs"]["tokens"]) - 6
        assert a["logprobs"]["token_logprobs"][:n] == b["logprobs"]["token_logprobs"][:n]


@pytest.mark.parametrize(
    "logprobs, n, prompts",
    [(None, 2, [PROMPT, "x = ["]), (1, 1, [PROMPT]), (1, 2, [PROMPT]), (2, 2, [PROMPT, "x = ["])],
)
def test_streamed_echo_adds_up_to_the_whole_answer(server, tok, logprobs, n, prompts):
    """The prompt comes first, in each choice's first chunk (with logprobs, its tokens'
    logprobs, the first null, as vLLM's), then the tokens stream as without echo: the
    chunks joined are the non-streamed choice, its text and every logprobs list.
    Stop strings hold text back as without echo."""
    body = dict(prompt=prompts, n=n, temperature=0.8, seed=3, max_tokens=12, echo=True)
    body.update(logprobs=logprobs, stop=["\x00never"])
    whole = ok(server, "/v1/completions", body)["choices"]
    chunks = stream(server, "/v1/completions", body)
    assert len(whole) == len(prompts) * n
    for choice in whole:
        prompt = prompts[choice["index"] // n]
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["text"].startswith(prompt)
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert len(mine) > 2 and all(c["finish_reason"] is None for c in mine[:-1])
        if logprobs is None:
            assert all(c["logprobs"] is None for c in mine)
            continue
        first = mine[0]["logprobs"]
        num_prompt = len(tok.encode(prompt))
        assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
        assert None not in first["token_logprobs"][1:num_prompt]
        assert first["text_offset"][0] == 0 and "".join(first["tokens"][:num_prompt]) == prompt
        assert all(None not in c["logprobs"]["token_logprobs"] for c in mine[1:])
        joined = {key: sum((c["logprobs"][key] for c in mine), []) for key in choice["logprobs"]}
        assert set(joined) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert close(joined, choice["logprobs"])


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "ids"])
def test_echoed_offsets_index_the_prompt_text_its_names_do_not_spell(server, tok, as_ids):
    """A prompt with characters of several bytes: its byte tokens are named U+FFFD each,
    which the echoed text does not show; the offsets index the text (never decreasing,
    never past its end, the completion's from its length), streamed as whole. Given as
    token ids, the prompt is echoed as they decode (its names joined garbled it)."""
    prompt = "x €é y"
    assert "".join(token_texts(tok, tok.encode(prompt))) != prompt
    body = dict(temperature=0.8, seed=3, max_tokens=6, echo=True, logprobs=1)
    body["prompt"] = tok.encode(prompt) if as_ids else prompt
    (choice,) = ok(server, "/v1/completions", body)["choices"]
    assert choice["text"].startswith(prompt)
    offsets = choice["logprobs"]["text_offset"]
    num_prompt = len(tok.encode(prompt))
    assert offsets[:num_prompt] == [0, 1, 2, 2, 2, 2, 2, 4, 5]
    assert offsets == sorted(offsets) and offsets[num_prompt] == len(prompt)
    chunks = [c["choices"][0] for c in stream(server, "/v1/completions", body)]
    joined = sum((c["logprobs"]["text_offset"] for c in chunks), [])
    assert joined == offsets


def test_chat_echo_continues_the_last_message(server, ref, tok):
    """Chat's echo, as vLLM's: the last message's content before each choice's, when the
    answer continues its role (continue_final_message); a new assistant turn after a
    user message echoes nothing. The answer carries vLLM's prompt_logprobs."""
    messages = [{"role": "user", "content": "Add."}, {"role": "assistant", "content": "def f("}]
    body = dict(messages=messages, continue_final_message=True, temperature=0, max_tokens=5)
    plain = ok(server, "/v1/chat/completions", body)
    got = ok(server, "/v1/chat/completions", dict(body, echo=True, n=2))
    content = plain["choices"][0]["message"]["content"]
    assert [c["message"]["content"] for c in got["choices"]] == ["def f(" + content] * 2
    ids = tok.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    (want,) = ref.generate([ids], SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=0))
    pl = got["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    assert [list(e) for e in pl[1:]] == [[str(t)] for t in ids[1:]]
    for e, w in zip(pl[1:], want.prompt_logprobs[1:], strict=True):
        ((t, x),) = w.items()
        assert e[str(t)]["logprob"] == pytest.approx(x, abs=1e-6)
    assert "prompt_logprobs" not in plain

    chunks = stream(server, "/v1/chat/completions", dict(body, echo=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[:2] == [dict(role="assistant", content=""), dict(content="def f(")]
    assert "".join(d.get("content", "") for d in deltas) == "def f(" + content
    assert all("prompt_logprobs" not in c for c in chunks)

    new_turn = dict(messages=messages[:1], temperature=0, max_tokens=5)
    echoed = ok(server, "/v1/chat/completions", dict(new_turn, echo=True))["choices"][0]
    plain = ok(server, "/v1/chat/completions", new_turn)["choices"][0]
    assert echoed["message"] == plain["message"]


def test_prompt_logprobs_without_echo(server, ref, tok):
    """vLLM's prompt_logprobs field alone: on each completions choice (the text is not
    echoed), and -1 lists the whole vocabulary when the server's cap allows it."""
    got = ok(server, "/v1/completions", dict(prompt=PROMPT, max_tokens=2, prompt_logprobs=0))
    choice = got["choices"][0]
    assert not choice["text"].startswith(PROMPT) and choice["logprobs"] is None
    ids = tok.encode(PROMPT)
    (want,) = ref.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert [None if e is None else list(e) for e in choice["prompt_logprobs"]] == [None] + [
        [str(t)] for t in ids[1:]
    ]
    for e, w in zip(choice["prompt_logprobs"][1:], want.prompt_logprobs[1:], strict=True):
        ((t, x),) = w.items()
        assert e[str(t)]["logprob"] == pytest.approx(x, abs=1e-6)


def test_echo_without_a_tokenizer(bare_server, server, tok):
    """A model without a tokenizer echoes no text; logprobs name the prompt's tokens
    "token_id:<id>" with every offset 0, and choices carry only generated token_ids."""
    ids = tok.encode(PROMPT)
    body = dict(prompt=ids, temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, echo=True)
    got = ok(bare_server, "/v1/completions", body)["choices"][0]
    full = ok(server, "/v1/completions", body)["choices"][0]
    assert got["text"] == "" and len(got["token_ids"]) == 3
    assert got["logprobs"]["tokens"][: len(ids)] == [f"token_id:{t}" for t in ids]
    assert got["logprobs"]["text_offset"] == [0] * (len(ids) + 3)
    assert close(got["logprobs"]["token_logprobs"], full["logprobs"]["token_logprobs"])


def test_echo_with_beam_search(server, tok):
    """Each beam echoes the prompt, its logprobs the prompt's then its own."""
    body = dict(prompt=PROMPT, use_beam_search=True, n=2, max_tokens=4, logprobs=1)
    plain = ok(server, "/v1/completions", body)["choices"]
    got = ok(server, "/v1/completions", dict(body, echo=True))["choices"]
    n = len(tok.encode(PROMPT))
    for c, p in zip(got, plain, strict=True):
        assert c["text"] == PROMPT + p["text"]
        assert close(c["logprobs"]["token_logprobs"][n:], p["logprobs"]["token_logprobs"])
        check_offsets(c["logprobs"], c["text"])


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/completions", dict(echo="yes"), "echo", "echo='yes'"),
        ("/v1/completions", dict(echo=1), "echo", "echo=1"),
        ("/v1/completions", dict(echo=True, best_of=2), "best_of", "best_of=2"),
        ("/v1/completions", dict(echo=True, logprobs=21), "logprobs", "logprobs=21"),
        ("/v1/completions", dict(prompt_logprobs=21), "prompt_logprobs", "--max-logprobs=20"),
        ("/v1/completions", dict(prompt_logprobs=-2), "prompt_logprobs", "prompt_logprobs=-2"),
        ("/v1/completions", dict(prompt_logprobs="3"), "prompt_logprobs", "prompt_logprobs='3'"),
        ("/v1/completions", dict(prompt_logprobs=2, stream=True), "prompt_logprobs", "stream"),
        ("/v1/completions", dict(prompt_logprobs=-1, stream=True), "prompt_logprobs", "stream"),
        ("/v1/completions", dict(max_tokens=0), "max_tokens", "0 with echo=true"),
        ("/v1/completions", dict(max_tokens=-1, echo=True), "max_tokens", "max_tokens=-1"),
        ("/v1/chat/completions", dict(echo=True, max_tokens=0), "max_tokens", "max_tokens=0"),
        ("/v1/chat/completions", dict(echo="y"), "echo", "echo='y'"),
        ("/v1/chat/completions", dict(prompt_logprobs=21), "prompt_logprobs", "max-logprobs"),
    ],
)
def test_bad_echo_fields_are_400s_naming_them(server, path, body, param, words):
    body = dict(body, **({"prompt": PROMPT} if path == "/v1/completions" else {}))
    if path == "/v1/chat/completions":
        body["messages"] = serve_helpers.MESSAGES
    status, obj = request(server, path, body)
    assert status == 400, obj
    assert obj["error"]["param"] == param and words in obj["error"]["message"], obj


def test_parse_job_reads_echo_and_prompt_logprobs_as_vllm():
    """`parse_job` (no engine): what the engine computes for each way of asking, as
    vLLM's `to_sampling_params` sets it, and what the answers carry."""
    j = job(dict(prompt="ab", echo=True, logprobs=2))
    assert (j.echo, j.params.prompt_logprobs, j.prompt_logprobs) == (["ab"], 2, True)
    j = job(dict(prompt="ab", echo=True, logprobs=2, stream=True))  # in the prompt's chunk
    assert (j.params.prompt_logprobs, j.prompt_logprobs, j.streams_tokens) == (2, False, True)
    j = job(dict(prompt="ab", echo=True, stream=True))
    assert (j.params.prompt_logprobs, j.streams_tokens) == (None, True)
    j = job(dict(prompt=[[97, 98], [99]], echo=True, prompt_logprobs=-1), max_logprobs=-1)
    assert (j.echo, j.params.prompt_logprobs, j.prompt_logprobs) == (["ab", "c"], VOCAB, True)
    j = job(dict(prompt="ab", prompt_logprobs=0, stream=True))  # vLLM streams them nowhere
    assert (j.echo, j.params.prompt_logprobs) == (None, None)
    j = job(dict(prompt="abc", echo=True, truncate_prompt_tokens=2))
    assert j.echo == ["bc"]  # the kept tokens' text

    j = job(dict(prompt="ab", echo=True, max_tokens=0, logprobs=1))
    assert (j.echo_only, j.params.max_tokens, j.streams_tokens) == (True, 1, False)
    generated = CompletionOutput(0, "x", [120], -1.0, [{120: -1.0}], "stop", 120)
    out = j.output(RequestOutput("r", None, [97, 98], [generated], True, 0, 0, None, None))
    (c,) = out.outputs
    assert (c.text, c.token_ids, c.logprobs, c.finish_reason) == ("", [], [], "length")
    assert usage([out]) == dict(prompt_tokens=2, completion_tokens=0, total_tokens=2)

    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    j = job(dict(messages=msgs[:1], echo=True), chat=True)  # the user's: not echoed
    assert (j.echo, j.params.prompt_logprobs, j.prompt_logprobs) == ([""], 0, True)
    j = job(dict(messages=msgs, echo=True), chat=True)  # vLLM's: the answer's role
    assert j.echo == ["a"]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = dict(messages=[msgs[0], {"role": "assistant", "content": parts}], echo=True)
    j = job(dict(body, continue_final_message=True, logprobs=True, top_logprobs=3), chat=True)
    assert (j.echo, j.params.prompt_logprobs) == (["a\nb"], 3)
    j = job(dict(body, add_generation_prompt=False, stream=True), chat=True)
    assert (j.echo, j.params.prompt_logprobs, j.streams_tokens) == (["a\nb"], None, True)
