"""pagedjax/detokenizer.py under review: runs of tokens that used to stop the window
from sliding (skipped special tokens, SentencePiece's lone "▁"), so that each step
decoded the whole run, and stop strings across such runs against the brute-force oracle
of test_outputs.py."""

import pytest
from test_outputs import accept_all, brute_force
from test_tokenizer import byte_level_bpe, sentencepiece_style

from pagedjax.request import SamplingParams
from pagedjax.tokenizer import Tokenizer


class CountingDecoder:
    """An HF tokenizer that counts the ids its `decode` is given."""

    def __init__(self, tok):
        self._tok, self.ids = tok, 0

    def decode(self, ids, **kw):
        self.ids += len(ids)
        return self._tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def counted(tok: Tokenizer) -> CountingDecoder:
    tok.tokenizer = counter = CountingDecoder(tok.tokenizer)
    return counter


@pytest.fixture
def sp():
    return Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2])


@pytest.fixture
def bl():
    return Tokenizer(byte_level_bpe(False), bos_token_id=0, eos_token_ids=[1])


N = 1000  # tokens in a run; decoding the whole run each step costs ~N * N / 2 ids


@pytest.mark.parametrize("style", ["sp", "bl"])
def test_a_run_of_skipped_special_tokens_costs_linear_work(style, sp, bl):
    """EOS after EOS (ignore_eos) left the window at the last chunk with text, so each
    step decoded the whole run: a skipped special token now changes nothing at all."""
    tok, eos = (sp, 2) if style == "sp" else (bl, 1)
    prompt, text = tok.encode("the hello", add_bos=False), tok.encode("the", add_bos=False)
    ids = [*text, *[eos] * N, *text]  # (SentencePiece-style: "▁the", " the" after the prompt)
    counter = counted(tok)
    stream = tok.stream(context=prompt)
    out = "".join(map(stream.add, ids)) + stream.flush()
    assert counter.ids < 20 * N, counter.ids
    assert out == tok.decode(ids, context=prompt) == (" the the" if style == "sp" else "thethe")
    assert stream.ids == ids  # the skipped ones still count as added
    stream = tok.stream(skip_special_tokens=False, context=prompt)  # shown: text of its own
    assert "".join(map(stream.add, ids)) + stream.flush() == tok.decode(
        ids, skip_special_tokens=False, context=prompt
    )


def test_a_run_of_lone_space_tokens_costs_linear_work(sp):
    """A lone "▁" decodes to "" on its own (the decoder strips a text's first space),
    which kept the window from sliding past a run of them."""
    space, the, ll = map(sp.tokenizer.token_to_id, ["▁", "▁the", "ll"])
    ids = [the, *[space] * N, ll]
    counter = counted(sp)
    stream = sp.stream(context=sp.encode("hello", add_bos=False))
    pieces = [stream.add(i) for i in ids]
    assert counter.ids < 20 * N, counter.ids
    assert "".join(pieces) + stream.flush() == " the" + " " * N + "ll"
    assert pieces[1 : 1 + N] == [" "] * N  # each space as it comes, none held back


def test_adding_only_skipped_special_tokens_emits_nothing_and_keeps_the_pending_text(sp):
    """Skipped special tokens inside a run of byte tokens neither end it nor emit it."""
    euro = [sp.tokenizer.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    stream = sp.stream()
    assert stream.add([*sp.encode("x", add_bos=False), euro[0]]) == "x"
    assert stream.add([2, 1]) == "" and stream.pending == "\ufffd"
    assert stream.add(euro[1:]) + stream.add(2) == "" and stream.pending == "€"
    a = sp.tokenizer.token_to_id("a")
    assert stream.add(a) == "€a"
    assert stream.ids == [*sp.encode("x", add_bos=False), euro[0], 2, 1, *euro[1:], 2, a]


@pytest.mark.parametrize("skip", [True, False])
def test_stop_strings_across_runs_of_special_and_space_tokens(skip, sp):
    """Stop strings that span skipped (or shown) special tokens and runs of spaces stop
    where the brute-force check after every token stops."""
    space = sp.tokenizer.token_to_id("▁")
    a, b = (sp.encode(c, add_bos=False)[-1] for c in "ab")
    gen = [a, 2, 2, 2, b, space, space, space, a, 2, space, b, space, a, b]
    for stops in (["ab"], ["a</s>"], ["   a"], [" b", "b "], ["  a", " b "], ["a b a"], ["zz"]):
        for include in (False, True):
            for m in (0, 3):
                kw = dict(include_stop_str_in_output=include, skip_special_tokens=skip)
                params = SamplingParams(max_tokens=len(gen), stop=stops, min_tokens=m, **kw)
                assert accept_all(sp, gen, params) == brute_force(sp, gen, params), params


def test_a_run_of_byte_tokens_costs_linear_work_unless_its_pending_text_is_read(sp):
    """A model repeating newlines that are byte tokens (`<0x0A>`, as in Llama 2): the run
    is never final text until it ends, and decoding it for `pending` on every token
    cost ~N * N / 2 ids; it is decoded only when read (stop strings read it)."""
    newline = sp.tokenizer.token_to_id("<0x0A>")
    the = sp.tokenizer.token_to_id("▁the")
    ids = [the, *[newline] * N, the]
    counter = counted(sp)
    stream = sp.stream()
    pieces = [stream.add(i) for i in ids]
    assert counter.ids < 20 * N, counter.ids
    assert "".join(pieces) + stream.flush() == sp.decode(ids) == "the" + "\n" * N + " the"
    stream = sp.stream()
    for i in ids[:-1]:
        stream.add(i)
    assert stream.pending == "\n" * N  # (decoded when read)
