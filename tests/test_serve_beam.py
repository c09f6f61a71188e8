"""scripts/serve.py's beam search (vLLM's `use_beam_search: true`), end to end as in
tests/test_serve.py: a search of width `n` whose `n` best beams are the choices, as
`LLM.generate` gives them with `SamplingParams(beam_width=n, n=n)`, streamed or not;
`length_penalty` is passed on; what beam search cannot do is a 400 naming the field.
tests/serve_helpers.py has the checkpoint, the servers and the clients.
"""

import json

import pytest
import serve_helpers
from serve_helpers import MESSAGES, StreamRecorder, ok, request, stream
from test_tokenizer import sentencepiece_style

from pagedjax import openai_api as api
from pagedjax.engine import SamplingParams
from pagedjax.request import CompletionOutput, RequestOutput
from pagedjax.tokenizer import Tokenizer

# serve_helpers' fixtures, bound here: this module gets its own checkpoint and servers.
ckpt, ref, tok = serve_helpers.ckpt, serve_helpers.ref, serve_helpers.tok
server = serve_helpers.server


@pytest.fixture
def sent(server, monkeypatch):
    """The SamplingParams of each request the server adds to its engine."""
    got = []
    llm = server.engine.llm
    add = llm.add_request
    monkeypatch.setattr(
        llm, "add_request", lambda ids, params, **k: got.append(params) or add(ids, params, **k)
    )
    return got


def test_beam_search_completions_are_the_engines_best_beams(server, ref, tok, sent):
    """Each prompt's n choices are its n best beams in the engine's order (ids, text,
    finish reason, logprobs); the usage counts every beam's tokens."""
    prompts = ["def add(a, b):", "import os\n"]
    body = dict(prompt=prompts, n=3, max_tokens=6, logprobs=2, use_beam_search=True)
    got = ok(server, "/v1/completions", dict(body, return_token_ids=True))
    sp = SamplingParams(n=3, beam_width=3, max_tokens=6, logprobs=2)
    assert sent == [sp, sp]
    want = ref.generate(prompts, sp)
    choices = [
        dict(
            index=3 * i + c.index,
            text=c.text,
            logprobs=api.completion_logprobs(tok, c, 2, o.prompt_token_ids),
            prompt_token_ids=o.prompt_token_ids,
            token_ids=c.token_ids,
            finish_reason=c.finish_reason,
        )
        for i, o in enumerate(want)
        for c in o.outputs
    ]
    assert got["choices"] == choices
    assert len({tuple(c["token_ids"]) for c in choices[:3]}) == 3  # three beams, not one
    n = sum(len(c.token_ids) for o in want for c in o.outputs)
    assert got["usage"]["completion_tokens"] == n


def test_beam_search_chat_passes_length_penalty_on(server, ref, sent):
    body = dict(messages=MESSAGES, n=2, max_tokens=8, use_beam_search=True, logprobs=True)
    body.update(length_penalty=0.5, include_stop_str_in_output=True, temperature=0.7)
    got = ok(server, "/v1/chat/completions", body)
    sp = SamplingParams(
        n=2,
        beam_width=2,
        length_penalty=0.5,
        max_tokens=8,
        include_stop_str_in_output=True,
        temperature=0.7,  # (beam search ignores it, as vLLM's)
        logprobs=0,
    )
    assert sent == [sp]
    (want,) = ref.chat(MESSAGES, sp)
    assert [c["message"]["content"] for c in got["choices"]] == [c.text for c in want.outputs]
    assert [c["finish_reason"] for c in got["choices"]] == [c.finish_reason for c in want.outputs]
    ids = want.prompt_token_ids
    assert [c["logprobs"] for c in got["choices"]] == [
        api.chat_logprobs(ref.tokenizer, c, 0, ids) for c in want.outputs
    ]


def test_beam_search_of_one_beam_is_greedy(server, ref, sent):
    """n = 1 (the default): vLLM's width-1 search, run greedy; length_penalty is moot."""
    body = dict(prompt="class Config:", max_tokens=7, use_beam_search=True, temperature=0.9)
    got = ok(server, "/v1/completions", dict(body, length_penalty=2.0))
    assert sent == [SamplingParams(temperature=0, max_tokens=7)]
    (want,) = ref.generate(["class Config:"], SamplingParams(temperature=0, max_tokens=7))
    assert [c["text"] for c in got["choices"]] == [want.outputs[0].text]


def test_beam_search_takes_none_of_the_checkpoints_sampling_defaults():
    """A generation_config.json's top_k and top_p (a Llama-3.1-Instruct's) fill in a
    sampling request's, but would make every beam request a 400 naming a field it never
    sent; vLLM's beam search takes none of them."""
    defaults = dict(temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.1)
    body = dict(prompt="a", n=2, use_beam_search=True)
    sp = api.sampling_params(body, max_tokens=5, logprobs=None, vocab_size=256, defaults=defaults)
    assert sp == SamplingParams(n=2, beam_width=2, max_tokens=5)
    body.pop("use_beam_search")
    sp = api.sampling_params(body, max_tokens=5, logprobs=None, vocab_size=256, defaults=defaults)
    assert (sp.top_p, sp.top_k, sp.beam_width) == (0.9, 50, 1)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    "path, fields, param, words",
    [
        ("/v1/completions", dict(stop=["\n"]), "stop", "stop strings are not supported"),
        ("/v1/completions", dict(top_k=5), "top_k", "not supported with beam search"),
        ("/v1/completions", dict(top_k=-1, top_p=0.9), "top_p", "top_p=0.9"),
        ("/v1/completions", dict(min_p=0.1), "min_p", "min_p=0.1"),
        ("/v1/completions", dict(min_tokens=2), "min_tokens", "min_tokens=2"),
        ("/v1/completions", dict(logit_bias={"5": 1}), "logit_bias", "logit_bias={5: 1"),
        ("/v1/completions", dict(presence_penalty=0.5), "presence_penalty", "=0.5"),
        ("/v1/completions", dict(allowed_token_ids=[5]), "allowed_token_ids", "(5,)"),
        ("/v1/completions", dict(length_penalty="x"), "length_penalty", "length_penalty='x'"),
        ("/v1/completions", dict(n=0), "n", "n=0"),
        ("/v1/chat/completions", dict(stop="\n"), "stop", "stop strings are not supported"),
        (
            "/v1/chat/completions",
            dict(response_format={"type": "json_object"}),
            "response_format",
            "structured outputs are not supported with beam search",
        ),
    ],
)
def test_what_beam_search_cannot_do_is_a_400_naming_the_field(
    server, n, path, fields, param, words
):
    """Whatever n (a width-1 search runs greedy, which would take them all)."""
    body = {"max_tokens": 4, "use_beam_search": True, "n": n, **fields}
    body.update(dict(prompt="a") if path == "/v1/completions" else dict(messages=MESSAGES))
    status, obj = request(server, path, body)
    assert status == 400, obj
    assert obj["error"]["param"] == param, obj
    assert words in obj["error"]["message"], obj


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(length_penalty=0.5), "length_penalty", "length_penalty=0.5 with beam_width=1"),
        (dict(length_penalty=0.5, n=2), "length_penalty", "only used by beam search"),
        (dict(use_beam_search="yes"), "use_beam_search", "use_beam_search='yes'"),
    ],
)
def test_length_penalty_without_beam_search_is_a_400(server, fields, param, words):
    """length_penalty was ignored: sampling has no lengths to weigh (1 is fine)."""
    status, obj = request(server, "/v1/completions", dict(prompt="a", max_tokens=4, **fields))
    assert status == 400 and obj["error"]["param"] == param, obj
    assert words in obj["error"]["message"], obj
    assert ok(server, "/v1/completions", dict(prompt="a", max_tokens=2, length_penalty=1))


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_beam_search_sends_each_choice_whole_then_usage(server, chat):
    """Beams are known only when the search ends: each choice is one chunk with its whole
    text, token ids and logprobs and its finish reason, as the non-streamed answer has
    them; then the usage."""
    body = dict(n=2, max_tokens=6, use_beam_search=True, return_token_ids=True)
    if chat:
        body.update(messages=MESSAGES, logprobs=True, top_logprobs=2)
        path, text = "/v1/chat/completions", lambda c: c["message"]["content"]
    else:
        body.update(prompt="def add(a, b):", logprobs=2)
        path, text = "/v1/completions", lambda c: c["text"]
    whole = ok(server, path, body)
    chunks = stream(server, path, dict(body, stream_options=dict(include_usage=True)))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    if chat:  # the role chunks first, one per choice
        roles, chunks = chunks[:2], chunks[2:]
        assert [c["choices"][0]["delta"] for c in roles] == [dict(role="assistant", content="")] * 2
    got = [c["choices"][0] for c in chunks[:-1]]
    assert [c["index"] for c in got] == [0, 1]
    for c, w in zip(got, whole["choices"], strict=True):
        assert (c["delta"].get("content", "") if chat else c["text"]) == text(w)
        assert c["token_ids"] == w["token_ids"] and c["logprobs"] == w["logprobs"]
        assert c["finish_reason"] == w["finish_reason"] is not None


def test_a_choice_streamed_whole_names_its_tokens_after_the_prompt():
    """A beam's logprobs, streamed in one chunk, name its tokens as the non-streamed
    answer does: after the prompt (they were named after nothing: SentencePiece's "▁the"
    after "the" read "the", not " the")."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    (the,) = prompt = tok.encode("the", add_bos=False)
    body = dict(prompt=prompt, max_tokens=3, logprobs=1, n=2, use_beam_search=True, stream=True)
    sizes = dict(vocab_size=tok.vocab_size, max_model_len=64)
    job = api.parse_job(body, chat=False, model_name="m", tokenizer=tok, **sizes)
    gen, entries = [the] * 3, [{the: -0.5, 5: -1.0}] * 3
    beams = [
        CompletionOutput(i, tok.decode(gen, context=prompt), gen, -1.5, entries, "length")
        for i in range(2)
    ]
    (rid,) = job.rids
    handler = StreamRecorder(tok)  # beams stream no tokens: the final output only
    handler._stream(job, api.response_head(job, "m"), [("done", rid, _output(rid, prompt, beams))])
    chunks = [json.loads(x[len(b"data: ") :])["choices"][0] for x in handler.sent[:-2]]
    whole = api.completion_logprobs(tok, beams[0], 1, prompt)
    assert whole["tokens"] == [" the"] * 3
    assert [c["logprobs"] for c in chunks] == [whole, whole]


def _output(rid, prompt, comps) -> RequestOutput:
    return RequestOutput(rid, None, prompt, comps, True, 0, 0, None, None)
