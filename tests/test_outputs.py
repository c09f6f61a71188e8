"""pagedjax/outputs.py: the logprobs entry of one token (ranks, names decoded on first
use), stop strings against a brute-force oracle on real tokenizers, a step's results
through `apply` (timing, logprobs, prompt logprobs of chunked rows), and beam search
through the processor against the whole-vocabulary oracle (the rest runs in
test_engine.py and test_logprob_objects.py)."""

import dataclasses
import itertools
import os
import pickle
import random

import numpy as np
import pytest
from beam_oracle import whole_vocabulary_search
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_beam import CASES, ToyModel, top_candidates
from test_tokenizer import STREAM_TOKENIZERS, byte_level_bpe, sentencepiece_style

from pagedjax import outputs
from pagedjax.beam import BeamSearch, num_candidates
from pagedjax.metrics import EngineMetrics
from pagedjax.outputs import OutputProcessor, Request, logprobs_entry
from pagedjax.request import Logprob, RequestOutputKind, SamplingParams
from pagedjax.sequence import ScheduledRow, SeqStatus, SequenceGroup, StepPlan
from pagedjax.sequence import Sequence as Seq
from pagedjax.tokenizer import Tokenizer


def test_logprobs_entry_puts_the_sampled_token_first_then_the_top_k_in_rank_order():
    top_ids = np.array([[9, 4, 7, 1], [3, 5, 6, 2]], np.int32)  # the step's k' = 4 >= k
    top_lps = np.array([[-0.1, -1.0, -2.0, -3.0], [-0.2, -0.9, -1.5, -4.0]], np.float32)
    e = logprobs_entry(7, -2.0, 3, top_ids, top_lps, 0, rank=3)  # sampled: rank 3 of row 0
    assert list(e) == [7, 9, 4] and e[9] == np.float32(-0.1) and e[7] == -2.0
    assert [(type(x), x.rank, x.decoded_token) for x in e.values()] == [
        (Logprob, 3, None),
        (Logprob, 1, None),
        (Logprob, 2, None),
    ]
    e = logprobs_entry(8, -5.5, 2, top_ids, top_lps, 1, rank=40)  # outside the top-k
    assert list(e) == [8, 3, 5] and e[5] == np.float32(-0.9)
    assert [x.rank for x in e.values()] == [40, 1, 2]
    assert logprobs_entry(3, -0.2, 0, None, None, 1) == {3: -0.2}  # k = 0: no top-k
    assert logprobs_entry(3, -0.2, 0, None, None, 1)[3].rank is None  # rank not given


class NamingTokenizer:
    """Names a token by the ids it reads after ("5,6|7"; 0 is special) and counts its
    `decode_each` calls."""

    special_ids = frozenset({0})

    def __init__(self):
        self.calls = 0

    def decode_each(self, ids, *, skip_special_tokens=True, context=()):
        assert skip_special_tokens is False  # the candidates' names show special tokens
        self.calls += 1
        return [f"{','.join(map(str, context))}|{i}" for i in ids]


def test_logprobs_entry_names_its_tokens_together_on_first_access():
    """An entry's decoded tokens cost nothing until one is read; then one decode_each
    names the whole position (its token and the alternatives), after the context with
    special tokens left out when the text leaves them out (skip_special_tokens)."""
    top_ids, top_lps = np.array([[9, 7, 0]]), np.array([[-0.1, -2.0, -3.0]])
    tok = NamingTokenizer()
    e = logprobs_entry(7, -2.0, 3, top_ids, top_lps, 0, rank=2, names=(tok, [5, 0, 6], True))
    f = logprobs_entry(0, -3.0, 1, top_ids, top_lps, 0, rank=3, names=(tok, [0, 6], False))
    assert tok.calls == 0
    assert e[9].decoded_token == "5,6|9" and tok.calls == 1
    assert [x.decoded_token for x in e.values()] == ["5,6|7", "5,6|9", "5,6|0"]
    assert [x.decoded_token for x in f.values()] == ["0,6|0", "0,6|9"]
    assert tok.calls == 2
    assert pickle.loads(pickle.dumps(e)) == e  # the names go with it
    assert pickle.loads(pickle.dumps(e))[0].decoded_token == "5,6|0"


# ---------------------------------------------------------------- stop strings


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tok(request):
    if request.param == "byte_level":
        return Tokenizer(byte_level_bpe(False), bos_token_id=0, eos_token_ids=[1])
    return Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])


PROMPT = [5, 6]  # the completions' prompt, which they are decoded after
CUMULATIVE, DELTA = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA


class _Scheduler:
    """What `Scheduler` does to a group when a sequence finishes, forks or is dropped."""

    def finish(self, group, seq, reason, stop_reason=None):
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        group.finished.append(seq)
        self.drop(group, seq)

    def fork(self, group, parent, child):  # the child joins the end of the group
        child.status = SeqStatus.RUNNING
        group.seqs.append(child)

    def drop(self, group, seq):
        group.seqs.remove(seq)
        seq.status = SeqStatus.FINISHED

    def set_tokens(self, seqs, tokens):
        pass


def processor(detokenize=lambda ids, prompt_ids, skip: "", tokenizer=None) -> OutputProcessor:
    """An OutputProcessor over a stand-in scheduler (no text by default)."""
    return OutputProcessor(
        _Scheduler(), EngineMetrics(1), detokenize, itertools.count(1), tokenizer
    )


def accept_all(tok, gen, params):
    """Feeds `gen` one token at a time as the engine does; (ids, text, finish, stop)."""
    prompt = PROMPT
    s = Seq(0, list(prompt), 2, 2 + params.max_tokens, status=SeqStatus.RUNNING)
    skip = params.skip_special_tokens
    s.detok = tok.stream(skip_special_tokens=skip, context=prompt) if params.stop else None
    g = SequenceGroup("r", [s])
    req = Request("r", None, prompt, params, frozenset(params.stop_token_ids), g, None, 0.0)

    def detokenize(ids, prompt_ids, skip):
        return tok.decode(ids, skip_special_tokens=skip, context=prompt_ids)

    proc = processor(detokenize)
    for t in gen:
        proc._accept(req, s, t, -0.5, None)
        if s.status is SeqStatus.FINISHED:
            break
    assert s.status is SeqStatus.FINISHED, "ran out of tokens"
    c = proc.output(req, aborted=False, now=1.0).outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason


def brute_force(tok, gen, params):
    """Stops at the first token that is a stop token (from token min_tokens on) or
    completes a stop string (from token min_tokens + 1 on, as vLLM checks them): an
    occurrence in the text if it stopped there (its decode, less an incomplete last
    character) that ends past what this text shares with the previous token's (earlier
    ones were let through by min_tokens). Of several, the one that ends
    first wins, then the one that starts first; the text is cut where it starts (where
    it ends with include_stop_str_in_output). The text is the decode under
    skip_special_tokens; the stop token's own text is left out unless
    include_stop_str_in_output."""
    skip, include = params.skip_special_tokens, params.include_stop_str_in_output
    before = ""

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=skip, context=PROMPT)

    for n in range(1, len(gen) + 1):
        ids = gen[:n]
        if n >= params.min_tokens and gen[n - 1] in params.stop_token_ids:
            return ids, decode(ids if include else ids[:-1]), "stop", gen[n - 1]
        full = decode(ids)
        text = full.rstrip("\ufffd")  # an incomplete last character is not text yet
        same = len(os.path.commonprefix([before, text]))
        new = [
            (i, x)
            for x in params.stop
            for i in range(len(text))
            if text.startswith(x, i) and i + len(x) > same
        ]
        if n > params.min_tokens and new:
            i, x = min(new, key=lambda h: (h[0] + len(h[1]), h[0]))
            return ids, full[: i + len(x) if include else i], "stop", x
        if n == params.max_tokens:
            return ids, full, "length", None
        before = text
    raise AssertionError("ran out of tokens")


def test_min_tokens_lets_earlier_stop_string_occurrences_through(tok):
    """Only an occurrence that ends in a token's new text stops: one completed before
    min_tokens (within the longest stop string's reach) neither stops nor cuts."""
    a, b, c = (tok.encode(x, add_bos=False)[-1] for x in "abc")
    assert tok.decode([a, b, c]) == "abc"
    params = SamplingParams(max_tokens=3, stop=["b", "abcd"], min_tokens=2)
    assert accept_all(tok, [a, b, c], params) == ([a, b, c], "abc", "length", None)
    params = SamplingParams(max_tokens=5, stop=["b", "abcd"], min_tokens=2)
    assert accept_all(tok, [a, b, b], params) == ([a, b, b], "ab", "stop", "b")
    params = SamplingParams(max_tokens=5, stop=["bc", "ab", "abcd"], min_tokens=2)
    assert accept_all(tok, [a, b, c], params) == ([a, b, c], "a", "stop", "bc")


def test_stop_strings_are_searched_after_the_first_min_tokens_tokens(tok):
    """As vLLM's detokenizer (`len(output_token_ids) > min_tokens`): the text of the
    first min_tokens tokens is not searched, so a stop string stops a completion from
    its token min_tokens + 1 on, as a stop token can end it (drawn) only from there; a
    stop string completed by token min_tokens stopped it there."""
    a, b = (tok.encode(x, add_bos=False)[-1] for x in "ab")
    gen = [a, b, b, a, b]
    params = SamplingParams(max_tokens=5, stop=["b"], min_tokens=3)
    assert accept_all(tok, gen, params) == (gen, "abba", "stop", "b")
    params = SamplingParams(max_tokens=5, stop=["bb"], min_tokens=3)
    assert accept_all(tok, gen, params) == (gen, "abbab", "length", None)
    params = SamplingParams(max_tokens=5, stop=["bb"], min_tokens=2)
    assert accept_all(tok, gen, params) == (gen[:3], "a", "stop", "bb")
    # A stop token is checked from token min_tokens on (the engine draws none before).
    params = SamplingParams(max_tokens=5, stop_token_ids=[b], min_tokens=3)
    assert accept_all(tok, gen, params) == (gen[:3], "ab", "stop", b)


def test_several_stop_strings_in_one_token_the_first_completed_wins():
    """Of the stop strings one token completes, the one that ends first wins (then the
    one that starts first): what a check after every character would stop on, so the
    cut and the reason do not depend on how the text is split into tokens, nor on the
    order or the alphabet of the strings."""
    tok = Tokenizer(byte_level_bpe(False), bos_token_id=0, eos_token_ids=[1])
    whole = tok.encode("hello", add_bos=False)
    assert len(whole) == 1
    chars = [i for c in "hello" for i in tok.encode(c, add_bos=False)]
    for stops, text, reason in [
        (["hello", "el"], "h", "el"),  # ends first, starts later
        (["llo", "ello", "o"], "h", "ello"),  # same end: the longest, cut earliest
        (["ll", "lo", "hel"], "", "hel"),
        (["hell", "hel", "h"], "", "h"),
    ]:
        for order in (stops, stops[::-1], sorted(stops)):
            for gen in (whole, chars):
                params = SamplingParams(max_tokens=8, stop=order)
                got = accept_all(tok, gen + [5, 6], params)[1:]
                assert got == (text, "stop", reason), (order, gen, got)


def test_include_stop_str_in_output_cuts_after_the_stop_string():
    """The text keeps the stop string but not what its last token adds after it; the
    stop token that ends a completion shows only with include_stop_str_in_output (EOS's
    with skip_special_tokens=False only), as in vLLM (a plain one's text was kept)."""
    tok = Tokenizer(byte_level_bpe(False), bos_token_id=0, eos_token_ids=[1])
    whole = tok.encode("hello", add_bos=False)
    chars = [i for c in "hello" for i in tok.encode(c, add_bos=False)]
    for gen in (whole, chars):
        for stops, text in [(["el"], "hel"), (["llo", "ello"], "hello"), (["h"], "h")]:
            params = SamplingParams(max_tokens=8, stop=stops, include_stop_str_in_output=True)
            got = accept_all(tok, gen + [5, 6], params)
            assert got[1] == text and got[0] == gen[: len(got[0])], (stops, gen, got)
    eos = tok.tokenizer.token_to_id("<|eos|>")
    assert eos in tok.special_ids and whole[0] not in tok.special_ids
    for include, skip, text in [
        (False, True, "hello"),
        (True, True, "hello"),
        (False, False, "hello"),
        (True, False, "hello<|eos|>"),
    ]:
        kw = dict(include_stop_str_in_output=include, skip_special_tokens=skip)
        params = SamplingParams(max_tokens=8, stop_token_ids=[eos], **kw)
        assert accept_all(tok, [*whole, eos, 5], params) == ([*whole, eos], text, "stop", eos)
        params = SamplingParams(max_tokens=8, stop_token_ids=[whole[0]], **kw)
        gen = [*chars, *whole]  # ends on the plain stop token "hello"
        want = "hellohello" if include else "hello"
        assert accept_all(tok, gen, params) == (gen, want, "stop", whole[0])


def test_stop_string_in_a_run_of_byte_fallback_tokens():
    """A run of byte tokens decodes all or nothing, so the stream decoder holds it back
    until it ends; the stop check still sees it, as the text would be if it stopped."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    gen = tok.encode("x€☃☃☃ ok", add_bos=False)
    assert len(gen) == 2 + 3 + 9 + 3  # "▁", "x", 12 byte tokens, "▁", "o", "k"
    params = SamplingParams(max_tokens=len(gen), stop=["☃☃"])
    assert accept_all(tok, gen, params) == (gen[:11], "x€", "stop", "☃☃")
    params = SamplingParams(max_tokens=len(gen), stop=["€"], min_tokens=4)
    assert accept_all(tok, gen, params) == (gen[:5], "x", "stop", "€")
    # At the length limit the held-back run is final text, stop strings in it too.
    params = SamplingParams(max_tokens=8, stop=["€☃", "☃☃☃"])
    assert accept_all(tok, gen, params) == (gen[:8], "x", "stop", "€☃")


def test_stop_strings_against_brute_force(tok):
    """Random texts (characters split across tokens, special tokens among them), stop
    sets (spanning tokens, overlapping, prefixes of each other, mid-character),
    min_tokens, stop tokens (special ones too), include_stop_str_in_output and
    skip_special_tokens."""
    rng = random.Random(0)
    pieces = ["a", "b", "ab", "the", " ", "é", "日", "🙂", "\n", "c"]
    specials = sorted(tok.special_ids)
    for _ in range(400):
        text = "".join(rng.choices(pieces, k=rng.randint(1, 10)))
        gen = tok.encode(text, add_bos=False)
        for _ in range(rng.choice([0, 0, 1, 2])):
            gen.insert(rng.randint(0, len(gen)), rng.choice(specials))
        skip, include = rng.random() < 0.5, rng.random() < 0.5
        text = tok.decode(gen, skip_special_tokens=skip)  # what stop strings can match
        stops = []
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text))
            stops.append(text[i : rng.randint(i + 1, min(len(text), i + 4))])
        if rng.random() < 0.3:
            stops.append("".join(rng.choices(pieces, k=2)))
        stop_ids = tuple(rng.sample(gen, 1)) if rng.random() < 0.2 else ()
        mins = rng.choice([0, 0, 1, 2, 3, 5])
        max_tokens = rng.randint(max(1, mins), len(gen)) if mins <= len(gen) else None
        if max_tokens is None:
            continue
        params = SamplingParams(
            max_tokens=max_tokens,
            stop=stops,
            min_tokens=mins,
            stop_token_ids=stop_ids,
            include_stop_str_in_output=include,
            skip_special_tokens=skip,
        )
        want = brute_force(tok, gen, params)
        assert accept_all(tok, gen, params) == want, (text, gen, params)


def byte_tokens(tok, data: bytes) -> list[int]:
    """One token per byte: `<0xNN>` byte-fallback tokens, or the byte-level BPE's byte
    symbols (GPT-2's printable stand-ins for the 256 bytes)."""
    vocab = tok.tokenizer.get_vocab()
    if "<0x41>" in vocab:
        return [vocab[f"<0x{b:02X}>"] for b in data]
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [vocab[symbol[b]] for b in data]


def test_stop_strings_holding_u_fffd_against_brute_force(tok):
    """U+FFFD in a stop string matches a replacement character once it is settled text
    (an invalid byte with text after it), never an incomplete character: its next bytes
    may still complete it ("\\xc3" then "\\xa9" is "é")."""
    x, a = (tok.encode(c, add_bos=False)[-1] for c in "xa")
    split_e = byte_tokens(tok, "é".encode())
    params = SamplingParams(max_tokens=3, stop=["\ufffd"])
    assert accept_all(tok, [*split_e, x], params) == ([*split_e, x], "éx", "length", None)
    lone = byte_tokens(tok, b"\xa9")  # a continuation byte without its lead
    params = SamplingParams(max_tokens=3, stop=["\ufffd"])
    assert accept_all(tok, [*lone, x, a], params) == ([*lone, x], "", "stop", "\ufffd")
    rng = random.Random(1)
    parts = [[x], [a], split_e, byte_tokens(tok, "🙂".encode())]
    parts += [byte_tokens(tok, b) for b in (b"\xa9", b"\xc3", b"\xf0\x9f")]
    stopped = 0
    for _ in range(200):
        gen = [t for p in rng.choices(parts, k=rng.randint(1, 6)) for t in p]
        stops = rng.sample(["\ufffd", "\ufffdx", "a\ufffd", "\ufffd\ufffd", "é", "x", "🙂"], 2)
        mins = rng.choice([0, 0, 1, 3])
        if mins > len(gen):
            continue
        max_tokens = rng.randint(max(1, mins), len(gen))
        params = SamplingParams(max_tokens=max_tokens, stop=stops, min_tokens=mins)
        want = brute_force(tok, gen, params)
        assert accept_all(tok, gen, params) == want, (gen, params)
        stopped += "\ufffd" in (want[3] or "")
    assert stopped > 10


def streamed(tok, prompt, gens, params) -> list:
    """The request's outputs as `apply` returns them, its samples (`gens[i]`: sample
    i's tokens) fed one token per step: a partial output after each step (output_kind
    CUMULATIVE or DELTA) and the final one."""
    stop_ids = frozenset({*tok.eos_token_ids, *params.stop_token_ids})
    proc = processor(lambda ids, p, skip: tok.decode(ids, skip_special_tokens=skip, context=p), tok)
    max_len = len(prompt) + params.max_tokens
    req = proc.new_request(
        "r", None, prompt, params, stop_ids, max_len, list(range(len(gens))), None
    )
    g, outs = req.group, []
    assert not g.forks  # (a one-token prompt: the samples start at once)
    for s in g.seqs:
        s.status = SeqStatus.RUNNING
    for step in itertools.count():
        for s in list(g.seqs):
            proc._accept(req, s, gens[s.index][step], -0.5, None)
        if not g.seqs:
            return [*outs, proc.output(req, aborted=False)]
        if params.output_kind != RequestOutputKind.FINAL_ONLY:
            outs.append(proc.output(req, aborted=False, running=True))


def check_streamed(tok, prompt, gens, **kw):
    """CUMULATIVE texts grow by prefixes and DELTA pieces add up, to the final output
    of FINAL_ONLY (texts and tokens), for every sample."""
    (final,) = streamed(tok, prompt, gens, SamplingParams(**kw))
    want = {c.index: (c.text, c.token_ids) for c in final.outputs}
    cumulative = streamed(tok, prompt, gens, SamplingParams(output_kind=CUMULATIVE, **kw))
    texts = {}
    for o in cumulative:
        for c in o.outputs:
            assert c.text.startswith(texts.get(c.index, "")), (texts, c.text)
            texts[c.index] = c.text
    assert {c.index: (c.text, c.token_ids) for c in cumulative[-1].outputs} == want
    got = {}
    for o in streamed(tok, prompt, gens, SamplingParams(output_kind=DELTA, **kw)):
        for c in o.outputs:
            text, ids = got.get(c.index, ("", []))
            got[c.index] = (text + c.text, ids + c.token_ids)
    assert got == want
    return cumulative


def test_streamed_text_is_never_taken_back():
    """A partial output's text was the decode of its tokens less an incomplete last
    character, which showed a run of byte-fallback tokens that a later byte turns into
    U+FFFD per byte ("x€" then "x\ufffd\ufffd\ufffd\ufffd"): a CUMULATIVE text was
    not a prefix of the next, and DELTA pieces added up to "x€\ufffd\ufffd\ufffdxx",
    not the final text. A run is shown once a token of another kind ends it."""
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])
    x = tok.encode("x", add_bos=False)[-1]
    gen = [x, *byte_tokens(tok, "€".encode()), *byte_tokens(tok, b"\xa9"), x, x]
    outs = check_streamed(tok, [x], [gen], max_tokens=len(gen))
    texts = [o.outputs[0].text for o in outs]
    assert texts == ["x"] * 5 + ["x\ufffd\ufffd\ufffd\ufffdx", "x\ufffd\ufffd\ufffd\ufffdxx"]


def test_a_kept_stop_string_holds_no_text_back(tok):
    """With include_stop_str_in_output, as in vLLM, partial texts are not held back by
    the longest stop string's length less one: the cut comes after the stop string,
    which ends past the text settled before its last token."""
    chars = [tok.encode(c, add_bos=False)[-1] for c in "abcab"]
    for include, held in [(False, 2), (True, 0)]:
        kw = dict(max_tokens=5, stop=["cab", "xyz"], include_stop_str_in_output=include)
        *partial, final = check_streamed(tok, [chars[0]], [chars], **kw)
        want = ["a", "ab", "abc", "abca"]
        assert [o.outputs[0].text for o in partial] == [t[: len(t) - held] for t in want]
        assert final.outputs[0].text == ("abcab" if include else "ab")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(STREAM_TOKENIZERS)), st.data())
def test_streamed_outputs_add_up_to_the_final_one(key, data):
    """Any tokens (byte runs valid or not, special tokens), one or two samples, stop
    strings from their text, min_tokens, include_stop_str_in_output and
    skip_special_tokens: CUMULATIVE texts grow by prefixes, DELTA pieces add up, to the
    final (FINAL_ONLY) output."""
    tok = STREAM_TOKENIZERS[key]
    kinds = [st.integers(0, tok.vocab_size - 1), st.sampled_from(sorted(tok.special_ids))]
    if tok._byte_ids:
        kinds += [st.sampled_from(sorted(tok._byte_ids))] * 2
    m = data.draw(st.integers(1, 12))
    gens = data.draw(
        st.lists(st.lists(st.one_of(*kinds), min_size=m, max_size=m), min_size=1, max_size=2)
    )
    skip = data.draw(st.booleans())
    text = tok.decode(gens[0], skip_special_tokens=skip)
    starts = data.draw(st.lists(st.integers(0, len(text) - 1), max_size=3)) if text else []
    stops = [text[i : i + data.draw(st.integers(1, 4))] for i in starts]
    check_streamed(
        tok,
        [data.draw(st.one_of(*kinds))],
        gens,
        n=len(gens),
        max_tokens=m,
        stop=stops,
        skip_special_tokens=skip,
        include_stop_str_in_output=data.draw(st.booleans()),
        min_tokens=data.draw(st.integers(0, m)),
    )


# ------------------------------------------------------------ a step's results


def test_apply_times_the_first_token_and_keeps_each_tokens_logprobs(monkeypatch):
    """Three steps of a sampled request through `apply`: ttft_s runs from its arrival to
    the step that gave its first token, latency_s to the step that finished it; each
    token is reported, gets its logprobs entry (the token, then the step's top 1) and
    adds its logprob to the sum."""
    prompt = [5, 6]
    params = SamplingParams(max_tokens=3, logprobs=1)
    s = Seq(0, list(prompt), 2, 5, status=SeqStatus.RUNNING, logprobs=[])
    g = SequenceGroup("r", [s])
    g.request = Request("r", None, prompt, params, frozenset(), g, None, 10.0)
    proc = processor(tokenizer=NamingTokenizer())
    clock = iter([11.0, 12.5, 14.0])
    monkeypatch.setattr(outputs, "perf_counter", lambda: next(clock))
    seen = []
    # tok, lp, top-1, the token's rank
    steps = [(7, -0.5, 7, -0.5, 1), (8, -2.0, 9, -0.25, 5), (4, -1.0, 4, -1.0, 1)]
    for tok, lp, top, top_lp, rank in steps:
        s.pending += 1  # as the scheduler's commit
        row = ScheduledRow(g, s, g.epoch, len(s.token_ids) - 1, 1, True, True)
        host = (
            np.array([tok]),
            np.array([lp], np.float32),
            np.array([[top]]),
            np.array([[top_lp]]),
            np.array([rank], np.int32),
        )
        done = proc.apply(StepPlan([row]), host, on_token=lambda *a: seen.append(a))
    (out,) = done
    c = out.outputs[0]
    assert (out.ttft_s, out.latency_s) == (1.0, 4.0)
    assert (c.token_ids, c.finish_reason, c.cumulative_logprob) == ([7, 8, 4], "length", -3.5)
    assert c.logprobs == [{7: -0.5}, {8: -2.0, 9: -0.25}, {4: -1.0}]
    assert [[x.rank for x in e.values()] for e in c.logprobs] == [[1], [5, 1], [1]]
    names = [[x.decoded_token for x in e.values()] for e in c.logprobs]
    assert names == [["5,6|7"], ["5,6,7|8", "5,6,7|9"], ["5,6,7,8|4"]]  # each after its past
    assert seen == [("r", 0, 7), ("r", 0, 8), ("r", 0, 4)]
    assert proc.metrics.generated_tokens == 3


def test_num_cached_tokens_is_the_first_admissions_prefix_cache_hit():
    """A request preempted after its first token and readmitted reads back pages it
    computed itself, generated tokens included; its output reports the prompt tokens
    its first admission read from the cache (it reported the readmission's hit: 48
    "cached" tokens for a 20-token prompt in an engine run under preemption; the scheduler
    keeps the first admission's, test_engine's preemption run checks it end to end)."""
    prompt = [5, 6, 7]
    s = Seq(0, list(prompt), 3, 5, status=SeqStatus.RUNNING, num_cached_tokens=2)  # admitted
    g = SequenceGroup("r", [s], num_cached_tokens=2)  # as the scheduler's admission sets it
    g.request = Request("r", None, prompt, SamplingParams(max_tokens=2), frozenset(), g, None, 0.0)
    proc = processor()

    def step(tok, start, num_tokens):
        s.pending += 1
        row = ScheduledRow(g, s, g.epoch, start, num_tokens, False, True)
        return proc.apply(StepPlan([row]), (np.array([tok]), np.array([-1.0]), None, None))

    assert step(8, 2, 1) == []  # the prompt's last token: the first two were cached
    g.epoch += 1  # preempted; readmitted, its 4 tokens cached (prompt and the 8)
    s.num_cached_tokens = 4
    (out,) = step(9, 3, 1)
    assert (out.outputs[0].token_ids, out.num_cached_tokens) == ([8, 9], 2)


def test_prompt_logprobs_of_chunked_prefill_rows():
    """A prompt prefilled in two chunks, each in a step with another request's decode row
    (before or after it): prompt token j >= 1 gets the entry of position j - 1, the
    row's offset in the step counted over the rows before it; the prompt's last position
    scores no prompt token; prefix-cache reads resume only once every entry is in. Each
    entry has the step's rank of its token and is named after the prompt tokens before
    it."""
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    s = Seq(0, list(prompt), 5, 7, status=SeqStatus.RUNNING)
    g = SequenceGroup("a", [s], read_prefix_cache=False)
    g.request = req = Request("a", None, prompt, params, frozenset(), g, None, 0.0)
    req.prompt_logprobs, req.prompt_logprobs_missing = [None] * 5, 4
    other = Seq(1, [3, 4, 1], 2, 9, status=SeqStatus.RUNNING)
    h = SequenceGroup("b", [other])
    h.request = Request("b", None, [3, 4], SamplingParams(), frozenset(), h, None, 0.0)
    proc = processor(tokenizer=NamingTokenizer())

    def step(rows, lps, tops):
        top_ids = np.array([[t] for t, _ in tops])
        top_lps = np.array([[x] for _, x in tops], np.float32)
        ranks = np.arange(len(lps), dtype=np.int32) + 10  # the step's token i: rank 10 + i
        proc._prompt_logprobs(StepPlan(rows), np.array(lps, np.float32), top_ids, top_lps, ranks)

    decode_b = ScheduledRow(h, other, 0, 2, 1, True, True)
    chunk = ScheduledRow(g, s, 0, 0, 3, False, False)  # positions 0, 1, 2
    step([chunk, decode_b], [-1.0, -2.0, -3.0, -9.0], [(6, -1.0), (3, -0.5), (4, -0.25), (0, 0)])
    assert req.prompt_logprobs == [None, {6: -1.0}, {7: -2.0, 3: -0.5}, {8: -3.0, 4: -0.25}, None]
    assert [[x.rank for x in e.values()] for e in req.prompt_logprobs[1:4]] == [
        [10],
        [11, 1],
        [12, 1],
    ]
    assert (req.prompt_logprobs_missing, g.read_prefix_cache) == (1, False)
    chunk = ScheduledRow(g, s, 0, 3, 2, False, True)  # positions 3 and 4 (it samples)
    step([decode_b, chunk], [-9.0, -4.0, -9.0], [(0, 0), (2, -0.125), (0, 0)])
    assert req.prompt_logprobs[4] == {9: -4.0, 2: -0.125}
    assert [x.rank for x in req.prompt_logprobs[4].values()] == [11, 1]  # the step's token 1
    names = [[x.decoded_token for x in e.values()] for e in req.prompt_logprobs[1:]]
    assert names == [
        ["5|6"],
        ["5,6|7", "5,6|3"],
        ["5,6,7|8", "5,6,7|4"],
        ["5,6,7,8|9", "5,6,7,8|2"],
    ]
    assert (req.prompt_logprobs_missing, g.read_prefix_cache) == (0, True)


# ------------------------------------------------------------------ beam search


def test_beam_hypotheses_report_their_stop_token_as_sampling_does():
    """A hypothesis that ended on a stop token (EOS or a stop_token_ids entry: both are
    in the request's stop ids) reports that token as its stop_reason, as a sampled
    completion does; one that reached the length limit reports None."""
    eos, stop, vocab = 2, 7, 40
    stop_ids = frozenset({eos, stop})
    params = SamplingParams(n=3, beam_width=3, max_tokens=3, stop_token_ids=[stop])
    rng = np.random.default_rng(0)
    prompt = [5, 6]
    s = Seq(0, list(prompt), 2, 2 + params.max_tokens, status=SeqStatus.RUNNING)
    g = SequenceGroup("r", [s], 3, atomic=True)
    beam = BeamSearch(3, 0.0, stop_ids, params.max_tokens)
    req = Request("r", None, prompt, params, stop_ids, g, beam, 0.0)
    no_text = lambda ids, prompt_ids, skip: ""  # noqa: E731
    proc = processor(no_text)

    def step(generated, sums, first):
        """Each beam's candidates, best first: `first` ranked top on beam 0."""
        top_lps = np.sort(rng.uniform(-3.0, -1.0, (len(generated), 6)))[:, ::-1]
        top_ids = np.stack([rng.permutation(np.arange(10, vocab))[:6] for _ in generated])
        top_ids[0, 0], top_lps[0, 0] = first, -0.01
        return beam.select(generated, sums, top_ids, top_lps)

    new = step([[]], [0.0], eos)  # [eos] ends at once
    gen = [[tok] for _, tok, _, _ in new]
    new = step(gen, [total for *_, total, _ in new], stop)  # [gen[0], stop] too
    gen = [[*gen[b], tok] for b, tok, _, _ in new]
    assert step(gen, [total for *_, total, _ in new], 8) == []  # the rest: length
    comps = proc.output(req, aborted=False, now=1.0).outputs
    assert {c.finish_reason for c in comps} == {"stop", "length"}
    assert {c.stop_reason for c in comps} == {eos, stop, None}
    for c in comps:
        assert c.stop_reason == (c.token_ids[-1] if c.finish_reason == "stop" else None)

    def text(ids, prompt_ids, skip):  # special: EOS
        return "".join(f"<{t}>" for t in ids if not (skip and t == eos))

    # The stop token that ends a hypothesis shows only with include_stop_str_in_output
    # (the special EOS with skip_special_tokens=False only), as in sampling.
    texts = OutputProcessor(_Scheduler(), EngineMetrics(1), text, None)
    for skip, include in itertools.product((True, False), repeat=2):
        kw = dict(skip_special_tokens=skip, include_stop_str_in_output=include)
        req.params = dataclasses.replace(params, **kw)
        for c in texts.output(req, aborted=False, now=1.0).outputs:
            ids = c.token_ids if include or c.finish_reason != "stop" else c.token_ids[:-1]
            shown = [t for t in ids if not (skip and t == eos)]
            assert c.text == "".join(f"<{t}>" for t in shown), (kw, c)
    # What the sampling path reports for the same tokens.
    sampled = SamplingParams(max_tokens=3, stop_token_ids=[stop])
    for c in comps:
        s = Seq(1, list(prompt), 2, 2 + sampled.max_tokens, status=SeqStatus.RUNNING)
        g = SequenceGroup("s", [s])
        req = Request("s", None, prompt, sampled, stop_ids, g, None, 0.0)
        for t in c.token_ids:
            proc._accept(req, s, t, -0.5, None)
        got = proc.output(req, aborted=False, now=1.0).outputs[0]
        assert (got.finish_reason, got.stop_reason) == (c.finish_reason, c.stop_reason)


class TwoLevelModel:
    """Every next-token logit is 0 or 1 (random per prefix): sums of different beams tie
    all the time, so which candidate wins is down to the tie-breaks (the lower beam
    index: its rank in the previous selection; then the more likely token)."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed

    def logprobs(self, prefix: list[int]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        x = rng.integers(0, 2, self.vocab).astype(np.float64)
        return x - 1 - np.log(np.exp(x - 1).sum())


def beam_search_through_the_processor(model, width, max_new, stops, length_penalty, k):
    """A beam search as the engine's steps run it: the live beams in the group's order
    (as the scheduler binds beam rows) get their top candidates (as many as `StepBatch`
    asks for) and `_beam_step` forks, extends and drops them (each live beam's token
    counted as generated). Returns the request's completions."""
    prompt = [5, 6]
    params = SamplingParams(
        n=width, beam_width=width, max_tokens=max_new, logprobs=k, length_penalty=length_penalty
    )
    s = Seq(0, list(prompt), 2, 2 + max_new, status=SeqStatus.RUNNING, logprobs=[])
    g = SequenceGroup("r", [s], width, atomic=True)
    beam = BeamSearch(width, length_penalty, frozenset(stops), max_new)
    g.request = req = Request("r", None, prompt, params, frozenset(stops), g, beam, 0.0)
    proc = processor(tokenizer=NamingTokenizer())
    cands = max(min(num_candidates(width, len(stops)), model.vocab), k)
    sampled = 0
    while True:
        rows = [(b, *top_candidates(model.logprobs(b.token_ids[2:]), cands)) for b in g.seqs]
        sampled += len(rows)
        if proc._beam_step(req, rows):
            break
    assert proc.metrics.generated_tokens == sampled  # one token per live beam and step
    return proc.output(req, aborted=False, now=1.0).outputs


def two_level(vocab, width, num_stops, length_penalty):
    return [(TwoLevelModel(vocab, seed), width, num_stops, length_penalty) for seed in range(12)]


@pytest.mark.parametrize(
    "searches",
    [
        two_level(3, 2, 0, 1.0),
        two_level(4, 3, 0, 1.0),
        two_level(5, 3, 1, 0.5),
        two_level(6, 4, 1, 1.0),
        two_level(6, 3, 2, -1.0),
        [(ToyModel(c[1], seed, c[5]), c[0], c[2], c[4]) for c in CASES[:4] for seed in (0, 1)],
    ],
    ids=["2-of-3", "3-of-4", "3-of-5", "4-of-6", "3-of-6", "toy"],
)
def test_beam_search_through_the_processor_equals_the_whole_vocabulary(searches):
    """The hypotheses, their sums, stop reasons and logprobs entries (each token's own
    distribution: the token, then the 2 most likely, ties to the lower id, ranked by
    their place among the candidates, each named after its own beam's tokens) are those
    of a search over the whole vocabulary, exact ties included: the next step's beams
    are in the order the selection ranked them (they were in the group's order:
    surviving parents first, forks after them)."""
    for i, (model, width, num_stops, length_penalty) in enumerate(searches):
        rng = np.random.default_rng(model.seed)
        stops = set(rng.choice(model.vocab, num_stops, replace=False).tolist())
        got = beam_search_through_the_processor(model, width, 5, stops, length_penalty, 2)

        def rows(prefixes, model=model):
            return [model.logprobs(p) for p in prefixes]

        want = whole_vocabulary_search(rows, width, 5, stops, length_penalty)
        assert [(c.token_ids, c.finish_reason) for c in got] == [(h[1], h[3]) for h in want], i
        np.testing.assert_allclose([c.cumulative_logprob for c in got], [h[2] for h in want])
        for c in got:
            assert c.stop_reason == (c.token_ids[-1] if c.finish_reason == "stop" else None)
            assert len(c.logprobs) == len(c.token_ids)
            for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
                row = model.logprobs(c.token_ids[:j])
                order = np.lexsort((np.arange(row.size), -row)).tolist()
                top = order[:2]
                assert list(entry) == [tok] + [t for t in top if t != tok]
                assert entry == pytest.approx({t: row[t] for t in entry})
                assert [x.rank for x in entry.values()] == [order.index(t) + 1 for t in entry]
                past = ([5, 6] + c.token_ids[:j])[-8:]
                before = ",".join(str(t) for t in past if t not in NamingTokenizer.special_ids)
                assert [x.decoded_token for x in entry.values()] == [f"{before}|{t}" for t in entry]
