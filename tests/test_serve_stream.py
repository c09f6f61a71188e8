"""scripts/serve.py's streams (`stream: true`), end to end as in tests/test_serve.py.

The chunks add up to the non-streamed answer (text, logprobs, token ids); text is held
back only as long as a stop string could still cut it; a checkpoint without a tokenizer
streams a chunk per token. tests/serve_helpers.py has the checkpoint, the servers and
the clients.
"""

import dataclasses
import json
import queue

import pytest
import serve_helpers
from serve_helpers import MESSAGES, StreamRecorder, ok, request, stream
from test_tokenizer import sentencepiece_style

from pagedjax import openai_api as api
from pagedjax.engine import SamplingParams
from pagedjax.request import CompletionOutput, RequestOutput
from pagedjax.tokenizer import Tokenizer

# serve_helpers' fixtures, bound here: this module gets its own checkpoint and servers.
ckpt, bare_ckpt, ref, tok = (
    serve_helpers.ckpt,
    serve_helpers.bare_ckpt,
    serve_helpers.ref,
    serve_helpers.tok,
)
server, bare_server = serve_helpers.server, serve_helpers.bare_server


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
    c = CompletionOutput(0, text, gen, -1.5, entries, "length")
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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_with_include_usage_every_chunk_but_the_last_has_null_usage(server, path):
    """OpenAI's (and vLLM's) chunks carry `"usage": null` when the request asks for
    include_usage, and the last, usage-only chunk has `choices: []`; without it, no
    chunk has the field. Ours had no `usage` in any chunk but the last."""
    chat = path == "/v1/chat/completions"
    body = dict(temperature=0, max_tokens=6, n=2)
    body.update(messages=MESSAGES, echo=True) if chat else body.update(prompt="def f(x):")
    plain = ok(server, path, body)
    assert all("usage" not in c for c in stream(server, path, body))
    options = [{"include_usage": False}, {"include_usage": None}, {}]
    for opts in options:
        assert all("usage" not in c for c in stream(server, path, dict(body, stream_options=opts)))
    for opts in [{"include_usage": True}, {"include_usage": True, "continuous_usage_stats": False}]:
        *chunks, last = stream(server, path, dict(body, stream_options=opts))
        assert len(chunks) > 4  # (role and echo chunks for chat too)
        assert all("usage" in c and c["usage"] is None for c in chunks), chunks
        assert all(list(c)[-1] == "usage" for c in chunks)  # after choices, as OpenAI's
        assert last["choices"] == [] and last["usage"] == plain["usage"]
        assert {k: last[k] for k in ("id", "object", "model")} == {
            k: chunks[0][k] for k in ("id", "object", "model")
        }
    opts = {"include_usage": True, "continuous_usage_stats": True}  # still refused
    status, err = request(server, path, dict(body, stream=True, stream_options=opts))
    assert status == 400 and "continuous_usage_stats" in err["error"]["message"], err


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
