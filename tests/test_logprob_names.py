"""Logprobs' token names after a run of byte-fallback tokens, as long as the context's
window or longer: the engine's (`RequestOutput` logprobs' and prompt logprobs'
`decoded_token`s) and the OpenAI layer's (chat and completions logprobs, echo).

A token is named after the ids before it (`tokenizer.token_names`). The callers kept
the last `CONTEXT_IDS` of them, which after two emoji (8 byte tokens) were the byte run
alone; the tokenizer leaves a trailing run out of a context, so the next token was
named as if it began the text: "▁the" was "the", where the text reads " the". Now
`tokenizer.name_context` reaches back past the run (not by decoding, and at most
`MAX_RUN_IDS` ids), and a byte-level BPE tokenizer's names are what they were.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_outputs import processor
from test_tokenizer import STREAM_TOKENIZERS, byte_level_bpe, sentencepiece_style

from pagedjax import openai_api as api
from pagedjax.outputs import Request
from pagedjax.request import CompletionOutput, SamplingParams
from pagedjax.sequence import ScheduledRow, SeqStatus, SequenceGroup, StepPlan
from pagedjax.sequence import Sequence as Seq
from pagedjax.tokenizer import CONTEXT_IDS, MAX_RUN_IDS, Tokenizer, name_context, token_names

SP = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
BPE = Tokenizer(byte_level_bpe(post_bos=False), bos_token_id=0, eos_token_ids=[1])
# After "the hello": a space, two emoji (8 byte tokens), then "▁the" and more.
TEXTS = [
    ("the hello", " 🙂🙂 the end"),
    ("the hello", " 日本語 the end"),  # 9 byte tokens
    ("the", " ☃☃☃ hello the"),
    ("the 🙂🙂🙂", " the hello"),  # the prompt ends in the run
]


def split(tok, prompt_text, text):
    prompt = tok.encode(prompt_text, add_bos=False)
    full = tok.encode(prompt_text + text, add_bos=False)
    assert full[: len(prompt)] == prompt
    return prompt, full[len(prompt) :]


def shown(text: str) -> str:
    """What the names of `text`'s tokens join to here: every character not in the
    vocabulary (emoji, CJK) is bytes, a byte token is named U+FFFD, left out."""
    return "".join(c for c in text if c.isascii())


def joined(names) -> str:
    return "".join(names).replace("\ufffd", "")


def full_names(tok, ids, end, candidates, skip=True):
    """The names of `candidates` at position `end` after all of `ids[:end]`."""
    return token_names(tok, candidates, context=ids[:end], skip_special_tokens=skip)


# ------------------------------------------------------------------ the engine


@pytest.mark.parametrize("prompt_text, text", TEXTS)
def test_engine_names_after_a_long_byte_run_keep_their_space(prompt_text, text):
    """Each sampled token's `decoded_token` (and its alternative's) is its name after
    all the ids before it: joined, they are the completion's text (less the bytes'
    characters), and "▁the" after two emoji is " the"."""
    prompt, gen = split(SP, prompt_text, text)
    the = SP.tokenizer.token_to_id("▁the")
    params = SamplingParams(max_tokens=len(gen), logprobs=1)
    s = Seq(0, list(prompt), len(prompt), len(prompt) + len(gen), status=SeqStatus.RUNNING)
    s.logprobs = []
    g = SequenceGroup("r", [s])
    g.request = Request("r", None, prompt, params, frozenset(), g, None, 0.0)
    proc = processor(tokenizer=SP)
    for t in gen:
        s.pending += 1
        row = ScheduledRow(g, s, g.epoch, len(s.token_ids) - 1, 1, True, True)
        host = (np.array([t]), np.array([-0.5]), np.array([[the]]), np.array([[-0.1]]), None)
        done = proc.apply(StepPlan([row]), host)
    (c,) = done[0].outputs
    assert joined(e[t].decoded_token for t, e in zip(gen, c.logprobs, strict=True)) == shown(text)
    for i, e in enumerate(c.logprobs):
        ids = prompt + gen
        want = full_names(SP, ids, len(prompt) + i, list(e))
        assert [x.decoded_token for x in e.values()] == want
        assert e[the].decoded_token == " the"  # (the alternative after the run too)


def test_engine_prompt_logprob_names_after_a_long_byte_run():
    """Prompt logprobs name each prompt token after the prompt tokens before it."""
    prompt, _ = split(SP, "the 🙂🙂 hello the", "")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    s = Seq(0, list(prompt), len(prompt), len(prompt) + 1, status=SeqStatus.RUNNING)
    g = SequenceGroup("a", [s], read_prefix_cache=False)
    g.request = req = Request("a", None, prompt, params, frozenset(), g, None, 0.0)
    req.prompt_logprobs, req.prompt_logprobs_missing = [None] * len(prompt), len(prompt) - 1
    n = len(prompt)
    proc = processor(tokenizer=SP)
    lps = np.full(n, -1.0, np.float32)
    top = np.zeros((n, 1), np.int64), np.zeros((n, 1), np.float32)
    proc._prompt_logprobs(StepPlan([ScheduledRow(g, s, 0, 0, n, False, True)]), lps, *top)
    names = [e[t].decoded_token for t, e in zip(prompt[1:], req.prompt_logprobs[1:], strict=True)]
    assert names[-1] == " the" and names[-2:-5:-1] == ["o", "ll", "he"]
    assert joined(names) == shown(SP.decode(prompt[1:], context=prompt[:1])) == "  hello the"


# ---------------------------------------------------------------- the OpenAI layer


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("prompt_text, text", TEXTS)
def test_openai_logprob_names_after_a_long_byte_run(prompt_text, text, chat):
    """Chat's `token` and `bytes`, completions' `tokens`, `top_logprobs` and offsets."""
    prompt, gen = split(SP, prompt_text, text)
    the = SP.tokenizer.token_to_id("▁the")
    entries = [{t: -0.5, the: -0.25} for t in gen]
    c = CompletionOutput(0, text, gen, -1.0, entries, "length")
    render = api.chat_logprobs if chat else api.completion_logprobs
    got = render(SP, c, 1, prompt)
    at = gen.index(the)
    if chat:
        items = got["content"]
        assert joined(x["token"] for x in items) == shown(text)
        assert items[at]["token"] == " the" and items[at]["bytes"] == list(b" the")
        assert all(x["top_logprobs"][0]["token"] == " the" for x in items)
    else:
        assert joined(got["tokens"]) == shown(text) and got["tokens"][at] == " the"
        assert all(" the" in top for top in got["top_logprobs"])
        assert got["text_offset"][at] == len("".join(got["tokens"][:at]))
    assert api.token_texts(SP, gen, context=prompt) == [
        full_names(SP, prompt + gen, len(prompt) + i, [t])[0] for i, t in enumerate(gen)
    ]


def test_echoed_prompt_names_after_a_long_byte_run():
    """Echo's prompt tokens (`echo_logprobs`) join to the prompt's text, and a completion
    after them continues it."""
    prompt, gen = split(SP, "the 🙂🙂 hello", " 🙂🙂 the")
    entries = [None, *({t: -0.5} for t in prompt[1:])]
    echo = api.echo_logprobs(SP, prompt, entries, 0)
    assert joined(echo["tokens"]) == shown(SP.decode(prompt)) == "the  hello"
    assert echo["tokens"][-4:] == [" ", "he", "ll", "o"]
    c = CompletionOutput(0, " 🙂🙂 the", gen, -1.0, [{t: -0.5} for t in gen], "length")
    both = api.join_logprobs(echo, api.completion_logprobs(SP, c, 0, prompt))
    assert joined(both["tokens"]) == "the  hello  the" and both["tokens"][-1] == " the"


def test_byte_level_names_are_unchanged():
    """A byte-level BPE tokenizer has no byte-fallback runs: each token is named after
    the last `CONTEXT_IDS` ids before it, as before."""
    prompt, gen = split(BPE, "hello world", " 🙂🙂🙂 the 日本語 café")
    ids = prompt + gen
    c = CompletionOutput(0, "", gen, -1.0, [{t: -0.5} for t in gen], "length")
    got = api.completion_logprobs(BPE, c, 0, prompt)["tokens"]
    window = [
        BPE.decode_each([t], skip_special_tokens=False, context=ids[: len(prompt) + i][-8:])[0]
        for i, t in enumerate(gen)
    ]
    assert got == window
    assert shown("".join(got)) == "  the  caf"
    assert name_context(BPE, ids) == ids[-CONTEXT_IDS:]


# ------------------------------------------------------------------ the context


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(STREAM_TOKENIZERS)), st.booleans(), st.data())
def test_name_context_names_as_the_whole_past_does(key, skip, data):
    """For any ids (loose bytes, long byte runs, specials, padded ids), the context
    `name_context` keeps resolves to the one all the ids before the position give."""
    tok = STREAM_TOKENIZERS[key]
    byte_ids = sorted(tok._byte_ids) or [tok.vocab_size - 1]
    any_id = st.integers(0, tok.vocab_size)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(byte_ids)), max_size=40))
    run = data.draw(st.lists(st.sampled_from(byte_ids), max_size=20))
    at = data.draw(st.integers(0, len(ids)))
    ids[at:at] = run  # a long run somewhere
    end = data.draw(st.integers(0, len(ids)))

    def resolved(context):
        if skip:
            context = [i for i in context if i not in tok.special_ids]
        return tok._context(context, skip)

    tail = name_context(tok, ids, end, skip_special_tokens=skip)
    assert resolved(tail) == resolved(ids[:end])
    kept = name_context(tok, ids, end, skip_special_tokens=skip, with_run=True)
    assert ids[:end][len(ids[:end]) - len(kept) :] == kept  # a tail of them
    assert resolved(kept + ids[end:]) == resolved(ids)  # ... the next ids may follow


def test_name_context_is_bounded_and_decodes_nothing():
    """The walk back over a run stops after `MAX_RUN_IDS` ids (the token after a longer
    run is named as if it began the text); the ids kept are `CONTEXT_IDS` at most,
    whatever the run's length, so naming each token of a long output decodes only
    short contexts."""
    b = SP.tokenizer.token_to_id("<0x41>")
    the = SP.tokenizer.token_to_id("▁the")
    prompt = SP.encode("the hello", add_bos=False)
    assert name_context(SP, [*prompt, *[b] * 100]) == prompt
    assert name_context(SP, [*prompt, *[b] * MAX_RUN_IDS]) == prompt
    assert name_context(SP, [*prompt, *[b] * (MAX_RUN_IDS + 1)]) == []
    gen = [b] * 500 + [the]
    lengths = []
    decode = SP.tokenizer.decode

    class Counting:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return decode(ids, **kw)

        def __getattr__(self, name):
            return getattr(SP.tokenizer, name)

    tok = Tokenizer.__new__(Tokenizer)
    tok.__dict__.update(SP.__dict__, tokenizer=Counting())
    c = CompletionOutput(0, "", gen, -1.0, [{t: -0.5} for t in gen], "length")
    got = api.completion_logprobs(tok, c, 0, prompt)["tokens"]
    assert got[-1] == " the" and "".join(got) == "A" * 500 + " the"
    assert max(lengths) <= CONTEXT_IDS + 1


@pytest.mark.parametrize("size", [1, 3, 5])
def test_chunks_named_after_a_kept_tail_are_named_as_the_whole(size):
    """A stream renders its logprobs chunk by chunk, each after the ids before it; with
    `name_context(with_run=True)` of those as the context it carries, the names are the
    whole completion's."""
    prompt, gen = split(SP, "the 🙂🙂", " 日本語 the ☃☃☃ hello 🙂🙂 the")
    entries = [{t: -0.5} for t in gen]
    whole = api.render_logprobs(SP, gen, entries, 0, chat=False, context=prompt)["tokens"]
    before, got = name_context(SP, prompt, with_run=True), []
    for i in range(0, len(gen), size):
        ids = gen[i : i + size]
        lp = api.render_logprobs(SP, ids, entries[i : i + size], 0, chat=False, context=before)
        got += lp["tokens"]
        before = name_context(SP, [*before, *ids], with_run=True)
        assert len(before) <= CONTEXT_IDS + 12  # the ids before a run, and the run
    assert got == whole and whole[-1] == " the"
