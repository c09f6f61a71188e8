"""pagedjax/openai_responses.py (through pagedjax.openai_api, which re-exports it):
outputs to OpenAI's shapes. Whole answers and streamed chunks, choices ordered prompt by
prompt, token ids, and logprobs with each token named as it reads in the text (after its
prompt, with or without special tokens, without a tokenizer), decoded once per candidate.

No engine and no HTTP: a stand-in byte tokenizer (tests/openai_api_helpers.py's) and
hand-built `RequestOutput`s. tests/test_serve.py checks the same code end to end.
"""

import dataclasses
import math
import random

import pytest
from openai_api_helpers import TOK, job
from test_tokenizer import sentencepiece_style

from pagedjax import openai_api as api
from pagedjax import openai_responses as responses
from pagedjax.request import CompletionOutput, RequestOutput
from pagedjax.tokenizer import CONTEXT_IDS, Tokenizer


def completion(index=0, text="hi", logprobs=None, finish="length"):
    ids = [ord(c) for c in text]
    return CompletionOutput(index, text, ids, -1.0, logprobs, finish)


def output(rid, prompt_ids, comps):
    return RequestOutput(rid, None, prompt_ids, comps, True, 0, 0, None, None)


def test_completion_logprobs():
    lps = [{ord("h"): -0.5, ord("a"): -0.25, ord("b"): -3.0}, {ord("i"): -math.inf, 7: -1.0}]
    got = api.completion_logprobs(TOK, completion(text="hi", logprobs=lps), 2)
    assert got == dict(
        tokens=["h", "i"],
        token_logprobs=[-0.5, -9999.0],  # JSON has no -inf
        top_logprobs=[{"a": -0.25, "h": -0.5}, {"\x07": -1.0, "i": -9999.0}],
        text_offset=[0, 1],
    )


def test_completion_top_logprobs_always_have_the_sampled_token():
    # OpenAI's completions: "up to logprobs+1 elements". The sampled token was left out
    # when it was not among the k most likely (logprobs=0: every top_logprobs was {}).
    lps = [{ord("h"): -2.0, ord("a"): -0.25, ord("b"): -0.5}, {ord("i"): -0.1}]
    c = completion(text="hi", logprobs=lps)
    got = api.completion_logprobs(TOK, c, 1)["top_logprobs"]
    assert got == [{"a": -0.25, "h": -2.0}, {"i": -0.1}]
    assert api.completion_logprobs(TOK, c, 0)["top_logprobs"] == [{"h": -2.0}, {"i": -0.1}]
    # Chat's top_logprobs are the k most likely only, as OpenAI's.
    chat = api.chat_logprobs(TOK, c, 1)["content"][0]
    assert [x["token"] for x in chat["top_logprobs"]] == ["a"]


def test_chat_logprobs():
    lps = [{ord("é"): -0.5, ord("a"): -0.25}]
    got = api.chat_logprobs(TOK, completion(text="é", logprobs=lps), 1)
    item = dict(token="é", logprob=-0.5, bytes=[0xC3, 0xA9])
    assert got == dict(
        content=[{**item, "top_logprobs": [dict(token="a", logprob=-0.25, bytes=[97])]}]
    )


def test_response_body_orders_choices_prompt_by_prompt():
    j = job(dict(prompt=["ab", "c"], n=2))
    outs = {
        j.rids[1]: output(j.rids[1], [99], [completion(1, "w", finish="stop"), completion(0, "z")]),
        j.rids[0]: output(j.rids[0], [97, 98], [completion(0, "x"), completion(1, "yy")]),
    }
    head = api.response_head(j, "tiny")
    assert head == dict(
        id="cmpl-" + j.id, object="text_completion", created=j.created, model="tiny"
    )
    body = api.response_body(j, head, outs, TOK)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "x", "length"),
        (1, "yy", "length"),
        (3, "w", "stop"),  # prompt 1's completion 1
        (2, "z", "length"),
    ]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"] == dict(prompt_tokens=3, completion_tokens=5, total_tokens=8)
    assert api.choice_index(j, j.rids[1], 1) == 3


def test_chat_response_and_chunks():
    j = job(dict(messages=[{"role": "user", "content": "hi"}], n=2, stream=True), chat=True)
    head = api.response_head(j, "tiny")
    assert head["object"] == "chat.completion.chunk" and head["id"] == "chatcmpl-" + j.id
    roles = api.role_chunks(j, head)
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    assert roles[0]["choices"][0]["delta"] == dict(role="assistant", content="")
    assert api.stream_chunk(j, head, 1, "ab")["choices"] == [
        dict(index=1, delta={"content": "ab"}, logprobs=None, finish_reason=None)
    ]
    last = api.stream_chunk(j, head, 0, "", "stop")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"

    j = job(dict(messages=[{"role": "user", "content": "hi"}]), chat=True)
    outs = {j.rids[0]: output(j.rids[0], [1, 2], [completion(0, "ok", finish="stop")])}
    body = api.response_body(j, api.response_head(j, "tiny"), outs, TOK)
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        dict(
            index=0,
            message=dict(role="assistant", content="ok"),
            logprobs=None,
            finish_reason="stop",
        )
    ]


def test_completion_chunks():
    j = job(dict(prompt="a", stream=True))
    head = api.response_head(j, "tiny")
    assert head["object"] == "text_completion" and api.role_chunks(j, head) == []
    assert api.stream_chunk(j, head, 0, "", "length")["choices"] == [
        dict(index=0, text="", logprobs=None, finish_reason="length")
    ]


def test_logprobs_without_a_tokenizer_name_token_ids():
    lps = [{104: -0.5, 97: -0.25, 98: -3.0}, {105: -math.inf, 7: -1.0}]
    c = completion(text="", logprobs=lps)
    c.token_ids = [104, 105]
    assert api.completion_logprobs(None, c, 2) == dict(
        tokens=["token_id:104", "token_id:105"],
        token_logprobs=[-0.5, -9999.0],
        top_logprobs=[
            {"token_id:97": -0.25, "token_id:104": -0.5},
            {"token_id:7": -1.0, "token_id:105": -9999.0},
        ],
        text_offset=[0, 0],  # offsets into the empty text
    )
    run = api.render_logprobs(None, [105], lps[1:], 1, chat=False, offset=0)
    assert run["tokens"] == ["token_id:105"] and run["text_offset"] == [0]


def test_token_ids_in_answers_and_chunks():
    j = job(dict(prompt=[[1, 2], [3]], n=2), tokenizer=None)
    outs = {
        rid: output(rid, p, [completion(0, "", finish="stop"), completion(1, "", finish="length")])
        for rid, p in zip(j.rids, j.prompts, strict=True)
    }
    for o in outs.values():
        o.outputs[0].token_ids, o.outputs[1].token_ids = [5, 6], [7]
    body = api.response_body(j, api.response_head(j, "tiny"), outs, None)
    assert [(c["text"], c["token_ids"]) for c in body["choices"]] == [("", [5, 6]), ("", [7])] * 2
    assert all("prompt_token_ids" not in c for c in body["choices"])
    head = api.response_head(dataclasses.replace(j, stream=True), "tiny")
    assert api.stream_chunk(j, head, 3, "", token_ids=[9])["choices"] == [
        dict(index=3, text="", logprobs=None, token_ids=[9], finish_reason=None)
    ]

    j = job(dict(prompt=["ab", "c"], return_token_ids=True))
    outs = {
        rid: output(rid, p, [completion(0, "x")]) for rid, p in zip(j.rids, j.prompts, strict=True)
    }
    body = api.response_body(j, api.response_head(j, "tiny"), outs, TOK)
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in body["choices"]] == [
        ([97, 98], [120]),
        ([99], [120]),
    ]
    chunk = api.stream_chunk(j, head, 0, "x", token_ids=[120], prompt_token_ids=[97, 98])
    assert chunk["choices"][0]["prompt_token_ids"] == [97, 98]
    assert chunk["choices"][0]["token_ids"] == [120]

    messages = [{"role": "user", "content": "hi"}]
    j = job(dict(messages=messages, return_token_ids=True, stream=True), chat=True)
    head = api.response_head(j, "tiny")
    (role,) = api.role_chunks(j, head)
    assert role["prompt_token_ids"] == j.prompts[0] and role["choices"][0]["token_ids"] == []
    outs = {j.rids[0]: output(j.rids[0], j.prompts[0], [completion(0, "ok")])}
    body = api.response_body(j, head, outs, TOK)
    assert body["prompt_token_ids"] == j.prompts[0]
    assert body["choices"][0]["token_ids"] == [111, 107]
    assert "prompt_token_ids" not in body["choices"][0]


def test_logprobs_name_sentencepiece_tokens_as_they_read_in_the_text():
    """A SentencePiece token decoded alone loses its leading space ("▁w" -> "w"): named
    after the tokens before it (the prompt's, then the completion's), "▁w" is " w" and
    the completions' text_offsets index the completion's text."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    prompt = tok.encode("the hello", add_bos=False)
    gen = tok.encode("the hello world", add_bos=False)[len(prompt) :]
    text = tok.decode(gen, context=prompt)
    assert text == " world" and tok.decode(gen[:1]) != tok.decode(gen[:1], context=prompt)
    entries = [{t: -0.5} for t in gen]
    lp = api.render_logprobs(tok, gen, entries, 0, chat=False, context=prompt)
    assert "".join(lp["tokens"]) == text
    spans = zip(lp["text_offset"], lp["tokens"], strict=True)
    assert [text[o : o + len(s)] for o, s in spans] == lp["tokens"]
    chat = api.render_logprobs(tok, gen, entries, 0, chat=True, context=prompt)
    assert "".join(c["token"] for c in chat["content"]) == text
    # In chunks, each chunk named after the ids before it: the same names.
    head = api.render_logprobs(tok, gen[:2], entries[:2], 0, chat=False, context=prompt)
    tail = api.render_logprobs(tok, gen[2:], entries[2:], 0, chat=False, context=prompt + gen[:2])
    assert head["tokens"] + tail["tokens"] == lp["tokens"]


@pytest.mark.parametrize("chat", [False, True])
def test_logprob_names_read_the_prompt_as_the_text_does(chat):
    """After a prompt of special tokens only ([BOS]), the completion's text starts
    without a space ("the hello"): its first token's name did not (" the"), because the
    names read the context with its special tokens shown, so the names no longer added
    up to the text and completions' text_offsets ran past it. A shown special candidate
    is still named ("</s>")."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    gen = tok.encode("the hello", add_bos=False)
    for prompt in ([1], [1, *tok.encode("the", add_bos=False)]):
        text = tok.decode(gen, context=prompt)
        entries = [{t: -0.5, 2: -3.0} for t in gen]
        lp = api.render_logprobs(tok, gen, entries, 2, chat=chat, context=prompt)
        if chat:
            names = [c["token"] for c in lp["content"]]
            assert all(c["top_logprobs"][1]["token"] == "</s>" for c in lp["content"])
        else:
            names = lp["tokens"]
            spans = zip(lp["text_offset"], names, strict=True)
            assert [text[o : o + len(s)] for o, s in spans] == names
            assert all("</s>" in top for top in lp["top_logprobs"])
        assert "".join(names) == text, (prompt, names, text)
    assert tok.decode(gen, context=[1]) == "the hello"


def test_logprob_names_read_the_prompt_as_the_text_does_with_special_tokens_shown():
    """With skip_special_tokens=False the text shows the prompt's BOS as the context it
    reads after (" the hello" after "<s>"), and so do the logprobs' names."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    gen = tok.encode("the hello", add_bos=False)
    texts = {skip: tok.decode(gen, skip_special_tokens=skip, context=[1]) for skip in (True, False)}
    assert texts == {True: "the hello", False: " the hello"}
    for skip, text in texts.items():
        j = job(dict(prompt=[1], logprobs=0, skip_special_tokens=skip), tokenizer=tok)
        c = completion(text=text, logprobs=[{t: -0.5} for t in gen])
        c.token_ids = gen
        body = api.response_body(
            j, api.response_head(j, "tiny"), {j.rids[0]: output(j.rids[0], [1], [c])}, tok
        )
        assert "".join(body["choices"][0]["logprobs"]["tokens"]) == text


class CountingDecodes:
    """An HF tokenizer that counts its `decode` calls (everything else passes through)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decodes = tokenizer, 0

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_decode_each_candidate_once_after_one_context_decode(chat):
    """Naming a position's sampled token and k alternatives decoded their shared context
    again for each, and the sampled token twice: about 2(k + 2) decodes a token where
    k + 2 do. Now the context once, then each distinct candidate in the vocabulary once;
    the names are still each candidate's `decode([id], context=)`."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    prompt = tok.encode("the hello", add_bos=False)
    gen = tok.encode("the hello world end", add_bos=False)[len(prompt) :]
    rng, k = random.Random(0), 6
    entries = []
    for i, t in enumerate(gen):  # the sampled token among the top k or not, a padded id
        others = rng.sample([u for u in range(tok.vocab_size) if u != t], k + 2)
        others.append(tok.vocab_size)
        entries.append({t: -1.0 if i % 2 else -50.0, **{u: -rng.random() for u in others}})
    tok.tokenizer = CountingDecodes(tok.tokenizer)
    got = api.render_logprobs(tok, gen, entries, k, chat=chat, context=prompt)
    ids = [{t, *(u for u, _ in responses._top(e, k))} for t, e in zip(gen, entries, strict=True)]
    assert tok.tokenizer.decodes == sum(1 + len(c - {tok.vocab_size}) for c in ids)

    def name(u, before):
        return tok.decode([u], skip_special_tokens=False, context=before)

    befores = [(prompt + gen[:i])[-CONTEXT_IDS:] for i in range(len(gen))]
    if chat:
        for t, e, b, c in zip(gen, entries, befores, got["content"], strict=True):
            assert c["token"] == name(t, b)
            assert [x["token"] for x in c["top_logprobs"]] == [
                name(u, b) for u, _ in responses._top(e, k)
            ]
    else:
        assert got["tokens"] == [name(t, b) for t, b in zip(gen, befores, strict=True)]
        for t, e, b, top in zip(gen, entries, befores, got["top_logprobs"], strict=True):
            assert set(top) == {name(u, b) for u, _ in [*responses._top(e, k), (t, e[t])]}


@pytest.mark.parametrize("prompt", ["the hello", "the €é hello"])
@pytest.mark.parametrize("skip", [True, False])
def test_echoed_string_prompt_offsets_index_the_text_the_names_do_not_spell(prompt, skip):
    """A string prompt is echoed as given, without the BOS the tokenizer adds (named
    "<s>") and with whole characters where byte-fallback tokens are named U+FFFD: its
    offsets added the names' lengths up, past the echoed text's end, and the
    completion's, from the text's length, went back. Now each token starts where the
    text shows it (a name it does not show takes no room): the offsets never decrease,
    stay within the text, and point at the tokens it shows."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2], add_bos=True)
    body = dict(prompt=prompt, echo=True, logprobs=0, max_tokens=1, skip_special_tokens=skip)
    j = api.parse_job(
        body, chat=False, model_name="m", tokenizer=tok, vocab_size=tok.vocab_size, max_model_len=64
    )
    (ids,) = j.prompts
    assert ids[0] == 1 and j.echo == [prompt]
    gen = tok.encode("the", add_bos=False)
    c = completion(text=tok.decode(gen, context=ids, skip_special_tokens=skip))
    c.token_ids, c.logprobs = gen, [{t: -0.5} for t in gen]
    pl = [None] + [{t: -1.0} for t in ids[1:]]
    out = RequestOutput(j.rids[0], prompt, ids, [c], True, 0, 0, None, None, pl)
    body = api.response_body(j, api.response_head(j, "m"), {j.rids[0]: out}, tok)
    (choice,) = body["choices"]
    text, lp = choice["text"], choice["logprobs"]
    assert text == prompt + c.text and lp["tokens"][0] == "<s>"
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert offsets[len(ids)] == len(prompt)  # the completion's, after the echoed prompt
    # Past the first word (" the" after "<s>" with skip false): each whole-character
    # token where the text has it.
    pairs = zip(offsets[2:], lp["tokens"][2:], strict=True)
    shown = [(o, s) for o, s in pairs if "\ufffd" not in s]
    assert [text[o : o + len(s)] for o, s in shown] == [s for _, s in shown]


def test_text_offsets_of_names_that_spell_the_text_add_their_lengths_up():
    names = ["<s>", "a", "\ufffd", "\ufffd", " b", "", "c"]
    assert responses._text_offsets("<s>a\ufffd\ufffd bc", names) == [0, 3, 4, 5, 6, 8, 8]
    assert responses._text_offsets("a😀 bc", names) == [0, 0, 1, 1, 2, 4, 4]
    assert responses._text_offsets("", ["token_id:5", "token_id:6"]) == [0, 0]
