"""Incremental detokenizing and streaming under review (29): a stream's choices against
the whole answer, after prompts that end in long runs of byte-fallback tokens."""

import json
import random

import pytest
from serve_helpers import StreamRecorder
from test_tokenizer import STREAM_TOKENIZERS, sentencepiece_style

from pagedjax import openai_api as api
from pagedjax.request import CompletionOutput, RequestOutput
from pagedjax.tokenizer import CONTEXT_IDS, Tokenizer


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_a_choice_streamed_whole_names_its_tokens_after_a_prompt_ending_in_a_byte_run(chat, skip):
    """A beam's choice goes out whole at the end, its logprobs named after the prompt. They
    were named after the prompt's last `CONTEXT_IDS` ids, as without a tokenizer: after
    two emoji (8 byte-fallback tokens, Llama 2's) those are the run alone, which
    `Tokenizer._context` leaves out, so SentencePiece's "▁the" read "the" where the
    non-streamed answer (and the text) reads " the"."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    tok = tok.with_chat_template("{{ messages[0]['content'] }}")
    body = dict(max_tokens=3, n=2, use_beam_search=True, stream=True, skip_special_tokens=skip)
    if chat:
        body.update(messages=[{"role": "user", "content": "the 🙂🙂"}], logprobs=True)
        body.update(top_logprobs=1)
    else:
        body.update(prompt="the 🙂🙂", logprobs=1)
    sizes = dict(vocab_size=tok.vocab_size, max_model_len=64)
    job = api.parse_job(body, chat=chat, model_name="m", tokenizer=tok, **sizes)
    (rid,), (prompt,) = job.rids, job.prompts
    assert prompt == tok.encode("the 🙂🙂", add_bos=False)
    assert all(i in tok._byte_ids for i in prompt[-CONTEXT_IDS:])
    the = tok.tokenizer.token_to_id("▁the")
    gen, entries = [the] * 3, [{the: -0.5, 5: -1.0}] * 3
    text = tok.decode(gen, context=prompt, skip_special_tokens=skip)
    assert text == " the the the"
    beams = [CompletionOutput(i, text, gen, -1.5, entries, "length") for i in range(2)]
    out = RequestOutput(rid, None, prompt, beams, True, 0, 0, None, None)
    handler = StreamRecorder(tok)  # beams stream no tokens: the final output only
    handler._stream(job, api.response_head(job, "m"), [("done", rid, out)])
    chunks = [json.loads(x[len(b"data: ") :])["choices"][0] for x in handler.sent[:-2]]
    chunks = [c for c in chunks if c.get("logprobs")]  # (chat's role chunks have none)
    render = api.chat_logprobs if chat else api.completion_logprobs
    whole = render(tok, beams[0], 1, prompt, skip_special_tokens=skip)
    names = [x["token"] for x in whole["content"]] if chat else whole["tokens"]
    assert names == [" the"] * 3
    assert [c["logprobs"] for c in chunks] == [whole, whole]


# Prompts and completions of these pieces: runs of byte-fallback tokens of every length
# (emoji, "€", newlines: `<0x0A>` in Llama 2's vocabulary), stripped spaces, added tokens.
PIECES = [
    "the",
    " ",
    "hello",
    " ll",
    "🙂",
    "🙂🙂",
    "☃",
    "€",
    "\n",
    "\n" * 9,
    "日本",
    " [INST]",
    "<tool>",
]


@pytest.mark.parametrize("whole", [False, True])
def test_streamed_choices_add_up_to_the_whole_answer_after_any_prompt(whole):
    """Random prompts (special tokens among them) and completions, on every test
    tokenizer: a choice streamed token by token, or whole at the end (a beam's), has the
    whole answer's text, and its logprobs' names, offsets and alternatives."""
    rng = random.Random(29)
    keys = sorted(STREAM_TOKENIZERS)
    for _ in range(60):
        key = rng.choice(keys)
        tok, skip = STREAM_TOKENIZERS[key], rng.random() < 0.6
        prompt = tok.encode("".join(rng.choices(PIECES, k=rng.randint(1, 6))))
        for _ in range(rng.randint(0, 2)):
            prompt.insert(rng.randint(0, len(prompt)), rng.choice(sorted(tok.special_ids)))
        gen = tok.encode("".join(rng.choices(PIECES, k=rng.randint(1, 5))))
        body = dict(prompt=prompt, max_tokens=len(gen), logprobs=1, stream=True)
        body["skip_special_tokens"] = skip
        sizes = dict(vocab_size=tok.vocab_size, max_model_len=256)
        job = api.parse_job(body, chat=False, model_name="m", tokenizer=tok, **sizes)
        (rid,) = job.rids
        entries = [{t: -0.5, 5: -1.0} for t in gen]
        text = tok.decode(gen, context=prompt, skip_special_tokens=skip)
        c = CompletionOutput(0, text, gen, -1.5, entries, "length")
        events = (
            [] if whole else [("token", rid, 0, t, e) for t, e in zip(gen, entries, strict=True)]
        )
        events.append(("done", rid, RequestOutput(rid, None, prompt, [c], True, 0, 0, None, None)))
        handler = StreamRecorder(tok)
        handler._stream(job, api.response_head(job, "m"), events)
        chunks = [json.loads(x[len(b"data: ") :])["choices"][0] for x in handler.sent[:-2]]
        want = api.completion_logprobs(tok, c, 1, prompt, skip_special_tokens=skip)
        got = {f: [x for ch in chunks for x in ch["logprobs"][f]] for f in want}
        case = (key, skip, prompt, gen)
        assert "".join(ch["text"] for ch in chunks) == text, case
        assert got == want, case


def test_adding_ids_after_a_flush_that_emitted_text_is_refused():
    """flush() emits held-back text (an incomplete character as U+FFFD); ids added after
    it could change that text, so `text` stopped being a prefix of the decode: "x" then
    the first two bytes of "\u20ac", flushed ("x\ufffd"), then the third byte, kept
    "x\ufffd" where the decode reads "x\u20ac"."""
    tok = Tokenizer(sentencepiece_style())
    euro = [tok.tokenizer.token_to_id(f"<0x{b:02X}>") for b in "\u20ac".encode()]
    x = tok.tokenizer.token_to_id("x")
    d = tok.stream()
    d.add([x, *euro[:2]])
    assert d.flush().endswith("\ufffd")
    with pytest.raises(RuntimeError, match=r"add\(\) after flush\(\)"):
        d.add(euro[2])
    quiet = tok.stream()  # a flush with nothing held back ends nothing
    text = quiet.add([x]) + quiet.flush() + quiet.add(euro) + quiet.flush()
    assert text == tok.decode([x, *euro])
