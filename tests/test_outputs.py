"""pagedjax/outputs.py: the logprobs entry of one token, stop strings against a
brute-force oracle on real tokenizers, and the stop reason of beam hypotheses (the rest
runs in test_engine.py)."""

import itertools
import os
import random

import numpy as np
import pytest
from test_tokenizer import byte_level_bpe, sentencepiece_style

from pagedjax.beam import BeamSearch
from pagedjax.metrics import EngineMetrics
from pagedjax.outputs import OutputProcessor, Request, logprobs_entry
from pagedjax.request import SamplingParams
from pagedjax.sequence import SeqStatus, SequenceGroup
from pagedjax.sequence import Sequence as Seq
from pagedjax.tokenizer import Tokenizer


def test_logprobs_entry_puts_the_sampled_token_first_then_the_top_k_in_rank_order():
    top_ids = np.array([[9, 4, 7, 1], [3, 5, 6, 2]], np.int32)  # the step's k' = 4 >= k
    top_lps = np.array([[-0.1, -1.0, -2.0, -3.0], [-0.2, -0.9, -1.5, -4.0]], np.float32)
    e = logprobs_entry(7, -2.0, 3, top_ids, top_lps, 0)  # sampled: rank 3 of row 0
    assert list(e) == [7, 9, 4] and e[9] == np.float32(-0.1) and e[7] == -2.0
    e = logprobs_entry(8, -5.5, 2, top_ids, top_lps, 1)  # outside the top-k: k + 1
    assert list(e) == [8, 3, 5] and e[5] == np.float32(-0.9)
    assert logprobs_entry(3, -0.2, 0, None, None, 1) == {3: -0.2}  # k = 0: no top-k


# ---------------------------------------------------------------- stop strings


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tok(request):
    if request.param == "byte_level":
        return Tokenizer(byte_level_bpe(False), bos_token_id=0, eos_token_ids=[1])
    return Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])


PROMPT = [5, 6]  # the completions' prompt, which they are decoded after


class _Scheduler:
    def finish(self, group, seq, reason, stop_reason=None):
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        group.finished.append(seq)
        group.seqs.remove(seq)
        seq.status = SeqStatus.FINISHED


def accept_all(tok, gen, params):
    """Feeds `gen` one token at a time as the engine does; (ids, text, finish, stop)."""
    prompt = PROMPT
    s = Seq(0, list(prompt), 2, 2 + params.max_tokens, status=SeqStatus.RUNNING)
    s.detok = tok.stream(context=prompt) if params.stop else None
    g = SequenceGroup("r", [s])
    req = Request("r", None, prompt, params, frozenset(params.stop_token_ids), g, None, 0.0)
    detokenize = lambda ids, prompt_ids: tok.decode(ids, context=prompt_ids)  # noqa: E731
    proc = OutputProcessor(_Scheduler(), EngineMetrics(1), detokenize, itertools.count(1))
    for t in gen:
        proc._accept(req, s, t, -0.5, None)
        if s.status is SeqStatus.FINISHED:
            break
    assert s.status is SeqStatus.FINISHED, "ran out of tokens"
    c = proc.output(req, aborted=False, now=1.0).outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason


def brute_force(tok, gen, params):
    """Stops at the first token (from min_tokens on) that is a stop token or completes a
    stop string: an occurrence in the text if it stopped there (its decode, less an
    incomplete last character) that ends past what this text shares with the previous
    token's (earlier ones were let through by min_tokens). Of several, the one that ends
    first wins, then the one that starts first; the text is cut where it starts."""
    before, decode = "", lambda ids: tok.decode(ids, context=PROMPT)
    for n in range(1, len(gen) + 1):
        ids, check = gen[:n], n >= params.min_tokens
        if check and gen[n - 1] in params.stop_token_ids:
            return ids, decode(ids), "stop", gen[n - 1]
        full = decode(ids)
        text = full.rstrip("\ufffd")  # an incomplete last character is not text yet
        same = len(os.path.commonprefix([before, text]))
        new = [
            (i, x)
            for x in params.stop
            for i in range(len(text))
            if text.startswith(x, i) and i + len(x) > same
        ]
        if check and new:
            i, x = min(new, key=lambda h: (h[0] + len(h[1]), h[0]))
            return ids, full[:i], "stop", x
        if n == params.max_tokens:
            return ids, full, "length", None
        before = text
    raise AssertionError("ran out of tokens")


def test_min_tokens_lets_earlier_stop_string_occurrences_through(tok):
    """Only an occurrence that ends in a token's new text stops: one completed before
    min_tokens (within the longest stop string's reach) neither stops nor cuts."""
    a, b, c = (tok.encode(x, add_bos=False)[-1] for x in "abc")
    assert tok.decode([a, b, c]) == "abc"
    params = SamplingParams(max_tokens=3, stop=["b", "abcd"], min_tokens=3)
    assert accept_all(tok, [a, b, c], params) == ([a, b, c], "abc", "length", None)
    params = SamplingParams(max_tokens=5, stop=["b", "abcd"], min_tokens=3)
    assert accept_all(tok, [a, b, b], params) == ([a, b, b], "ab", "stop", "b")
    params = SamplingParams(max_tokens=5, stop=["bc", "ab", "abcd"], min_tokens=3)
    assert accept_all(tok, [a, b, c], params) == ([a, b, c], "a", "stop", "bc")


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
    """Random texts (characters split across tokens), stop sets (spanning tokens,
    overlapping, prefixes of each other, mid-character), min_tokens and stop tokens."""
    rng = random.Random(0)
    pieces = ["a", "b", "ab", "the", " ", "é", "日", "🙂", "\n", "c"]
    for _ in range(400):
        text = "".join(rng.choices(pieces, k=rng.randint(1, 10)))
        gen = tok.encode(text, add_bos=False)
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
            max_tokens=max_tokens, stop=stops, min_tokens=mins, stop_token_ids=stop_ids
        )
        want = brute_force(tok, gen, params)
        assert accept_all(tok, gen, params) == want, (text, gen, params)


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
    no_text = lambda ids, prompt_ids: ""  # noqa: E731
    proc = OutputProcessor(_Scheduler(), EngineMetrics(1), no_text, itertools.count(1))

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
