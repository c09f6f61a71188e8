"""Tokenizer wrapper: special tokens from the config files, encode/decode, streaming.

Two tokenizers are built in the test (no downloads): a byte-level BPE trained on a
few sentences (GPT-2 / Llama 3 style) and a SentencePiece-style BPE with byte fallback
and a leading-space-stripping decoder (Llama 2 style).
"""

import json
import random
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

from pagedjax.tokenizer import Tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokens",
    "paged attention keeps the cache in pages",
    "héllo wörld, ça va? naïve café",
]
TEXTS = [
    "hello world",
    "the cache 🙂 keeps 日本語 pages",
    "café naïve 🚀🚀 ok",
    "ünïcödé at the end: 𝄞",
    "  leading spaces and\nnewlines\t",
]


def byte_level_bpe(post_bos: bool) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|bos|>", "<|eos|>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", special_tokens=[("<|bos|>", 0)]
        )
    return tok


def sentencepiece_style() -> HFTokenizer:
    """Llama-2-like: Metaspace via normalizer, BPE with byte fallback, Strip decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "th", "▁th", "he", "▁the", "ll"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("t", "h"), ("▁t", "h"), ("h", "e"), ("▁th", "e"), ("l", "l")]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def write_dir(path, tok: HFTokenizer, tokenizer_config=None, generation_config=None):
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return write_dir(
        tmp_path_factory.mktemp("bpe"),
        byte_level_bpe(post_bos=True),
        tokenizer_config={
            "bos_token": {"content": "<|bos|>", "special": True},
            "eos_token": "<|eot|>",
            "add_bos_token": True,
        },
        generation_config={"bos_token_id": 0, "eos_token_id": [1, 2]},
    )


def test_special_tokens_from_config_files(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == frozenset({1, 2})  # eot (tokenizer_config) + gen config
    assert tok.add_bos and tok.is_eos(2) and not tok.is_eos(0)
    (bpe_dir.parent / "cfg").mkdir()
    d = write_dir(bpe_dir.parent / "cfg", byte_level_bpe(post_bos=False))
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    tok = Tokenizer.from_dir(d)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (0, {1}, False)


@pytest.mark.parametrize("post_bos", [True, False])
def test_add_bos_follows_the_post_processor_when_config_is_silent(tmp_path, post_bos):
    tok = Tokenizer.from_dir(
        write_dir(tmp_path, byte_level_bpe(post_bos), tokenizer_config={"bos_token": "<|bos|>"})
    )
    assert tok.add_bos == post_bos
    assert tok.encode("hello")[:1] == ([0] if post_bos else tok.encode("hello", add_bos=False)[:1])


def test_encode_decode_roundtrip_and_single_bos(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 0 and ids.count(0) == 1  # the post-processor's BOS is not doubled
        assert tok.encode(text, add_bos=False) == ids[1:]
        assert tok.decode(ids) == text
    ids = tok.encode("hello") + [2]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>hello<|eot|>"


def test_text_that_starts_with_bos_gets_no_second_one(bpe_dir):
    """A prompt rendered by a chat template (`<|begin_of_text|>...`) passed as raw text
    got BOS twice: the text's and the one encode prepends."""
    tok = Tokenizer.from_dir(bpe_dir)
    hello = tok.encode("hello", add_bos=False)
    assert tok.encode("<|bos|>hello") == [0, *hello] == tok.encode("hello")
    assert tok.encode("<|bos|>hello", add_bos=False) == [0, *hello]
    assert tok.encode("<|bos|><|bos|>hello") == [0, 0, *hello]  # the text's own are kept
    ids = tok.encode(" <|bos|>hello")  # BOS not first: the text is not a rendered prompt
    assert ids[0] == 0 and ids[1] != 0 and ids.count(0) == 2


def test_bad_input(bpe_dir, tmp_path):
    tok = Tokenizer.from_dir(bpe_dir)
    with pytest.raises(ValueError, match=r"token ids must be >= 0, got \[-1\]"):
        tok.decode([5, -1])
    with pytest.raises(ValueError, match=r"\[-1\]"):
        tok.stream().add(-1)
    with pytest.raises(TypeError, match="must be a str"):
        tok.encode(b"bytes")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = write_dir(tmp_path / "x", byte_level_bpe(False), tokenizer_config={"eos_token": "<nope>"})
    with pytest.raises(ValueError, match="'<nope>' is not in the vocab"):
        Tokenizer.from_dir(d)
    for text in ("{bad", "{}"):  # (the tokenizers library raised a bare Exception)
        (d / "tokenizer.json").write_text(text)
        with pytest.raises(ValueError, match=r"x/tokenizer.json is not a valid tokenizer file"):
            Tokenizer.from_dir(d)
    # A clone without git-lfs has pointers in place of the hub's large files.
    (d / "tokenizer.json").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9085657\n"
    )
    with pytest.raises(ValueError, match=r"tokenizer file: it is a git-lfs pointer: .*lfs pull"):
        Tokenizer.from_dir(d)


def settled(tok: Tokenizer, ids: list[int]) -> str:
    """The text of `ids` that no later id can change: `decode(ids)` without an
    incomplete trailing character, and without a trailing run of byte-fallback tokens
    (with the skipped special tokens and ids past the vocabulary in it), which HF
    decodes all or nothing."""
    special = set(tok.tokenizer.get_added_tokens_decoder())
    skipped = lambda i: i in special or tok.tokenizer.id_to_token(i) is None
    m, run_end = len(ids), len(ids)
    while m and (
        skipped(ids[m - 1]) or re.fullmatch(r"<0x..>", tok.tokenizer.id_to_token(ids[m - 1]))
    ):
        m -= 1
        if not skipped(ids[m]):
            run_end = m
    return tok.decode(ids[:run_end]).rstrip("\ufffd")


def check_stream(tok: Tokenizer, ids: list[int]):
    """Feeds ids one at a time; checks every piece against a full decode."""
    stream = tok.stream()
    pieces = []
    for n, i in enumerate(ids, 1):
        pieces.append(stream.add(i))
        assert "\ufffd" not in pieces[-1], (ids[:n], pieces)
        # Nothing held back that is already settled, nothing early.
        assert stream.text == settled(tok, ids[:n]), (ids[:n], pieces)
        assert stream.text + stream.pending == tok.decode(ids[:n])
        assert tok.decode(ids).startswith(stream.text)
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids)
    return pieces


def test_stream_byte_level_multibyte(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text) + [2]
        check_stream(tok, ids)
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
    assert split_chars > 0  # some characters really were split across tokens


def test_stream_random_unicode(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    rng = random.Random(0)
    alphabet = "abc the ö日🙂𝄞\n"
    for _ in range(30):
        check_stream(tok, tok.encode("".join(rng.choices(alphabet, k=rng.randint(1, 20)))))


def test_stream_sentencepiece_style(tmp_path):
    tok = Tokenizer.from_dir(
        write_dir(
            tmp_path,
            sentencepiece_style(),
            tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
        )
    )
    text = "the hello world €10 ll the ☃ end"
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids) == text
    assert any(tok.tokenizer.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback
    # Decoding tokens one by one loses spaces (the decoder strips a leading one), which
    # is why the stream decodes a window with left context.
    assert "".join(tok.decode([i]) for i in ids) != text
    check_stream(tok, ids + [2])


def test_stream_accepts_several_ids(bpe_dir):
    tok = Tokenizer.from_dir(bpe_dir)
    ids = tok.encode(TEXTS[1], add_bos=False)
    stream = tok.stream()
    out = "".join(stream.add(ids[k : k + 3]) for k in range(0, len(ids), 3)) + stream.flush()
    assert out == TEXTS[1]


def test_stream_keeps_the_space_after_a_skipped_special_token(tmp_path):
    """A window that starts at a skipped special token has no text of its own: the
    decoder would strip the next token's leading space as if it began the text."""
    tok = Tokenizer.from_dir(
        write_dir(
            tmp_path,
            sentencepiece_style(),
            tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
        )
    )
    words = tok.encode("the hello", add_bos=False)
    for special in ([2], [1], [2, 1]):
        ids = [1, *words, *special, *tok.encode(" the ll", add_bos=False), *special, *words]
        assert tok.decode(ids) == "the hello  the ll the hello"
        check_stream(tok, ids)
    rng = random.Random(0)
    for _ in range(20):  # special tokens at random places in random text
        # (a space before each byte-fallback character: HF's ByteFallback decodes a
        # run of byte tokens all or nothing, so "€☃" is "\ufffd" * 4 until complete)
        words = rng.choices(["the", " lo", "h", " €", " ☃"], k=rng.randint(1, 8))
        ids = tok.encode("".join(words))
        for _ in range(rng.randint(1, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice([1, 2]))
        check_stream(tok, ids)


def test_token_ids_must_be_integers(bpe_dir):
    """A float, bool or str id is an error naming it, not silently truncated to an int."""
    tok = Tokenizer.from_dir(bpe_dir)
    a = tok.encode("a", add_bos=False)[0]
    for bad in (a + 0.9, True, str(a), None):
        with pytest.raises(TypeError, match=r"token ids must be ints, got .*" + repr(bad)[:3]):
            tok.decode([a, bad])
        with pytest.raises(TypeError, match="token ids must be ints"):
            tok.stream().add([bad])
    for bad in (a, None):  # not a list: named too ("'int' object is not iterable")
        with pytest.raises(TypeError, match=rf"token ids must be a list of ints, got {bad}$"):
            tok.decode(bad)
        with pytest.raises(TypeError, match="token ids must be a list of ints"):
            tok.decode([a], context=bad)
    assert tok.decode(np.array([a, a])) == tok.decode([a, a]) == "aa"  # numpy ints are fine
    stream = tok.stream()
    assert stream.add(np.int64(a)) + stream.add(np.array([a], np.int32)) == "aa"


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    return write_dir(
        tmp_path_factory.mktemp("sp"),
        sentencepiece_style(),
        tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
    )


@pytest.mark.parametrize("style", ["byte_level", "byte_fallback"])
def test_stream_cut_inside_a_character_matches_decode(bpe_dir, sp_dir, style):
    """Generation can stop after only some bytes of a character: what `add` returned
    plus `flush()` is still exactly `decode(ids)` (HF's U+FFFD for the loose bytes; with
    byte fallback a run of byte tokens that is not valid UTF-8 is one U+FFFD per byte,
    whole characters in the run included)."""
    tok = Tokenizer.from_dir(bpe_dir if style == "byte_level" else sp_dir)
    rng = random.Random(0)
    alphabet = ["a", " the", " ", "é", "€", "日", "本", "🙂", "🚀", "𝄞", "語"]
    cuts_inside = 0
    for _ in range(25):
        ids = tok.encode("".join(rng.choices(alphabet, k=rng.randint(1, 10))))
        for _ in range(3):  # special tokens (skipped) in random places, even mid-character
            ids.insert(rng.randint(0, len(ids)), rng.choice(sorted(tok.eos_token_ids)))
        for n in sorted(rng.sample(range(1, len(ids) + 1), min(len(ids), 6))):
            want = tok.decode(ids[:n])
            cuts_inside += want.endswith("\ufffd")
            stream, pieces = tok.stream(), []
            for k in range(n):
                pieces.append(stream.add(ids[k]))
                assert stream.text + stream.pending == tok.decode(ids[: k + 1])
            pieces.append(stream.flush())
            assert "".join(pieces) == want, (ids[:n], pieces)
            # Several ids at a time, in random groups.
            stream, out, k = tok.stream(), "", 0
            while k < n:
                step = rng.randint(1, 4)
                out, k = out + stream.add(ids[k : min(n, k + step)]), k + step
            assert out + stream.flush() == want, ids[:n]
    assert cuts_inside > 20  # the cuts really fell inside characters


def test_ids_past_the_vocabulary_decode_to_nothing(bpe_dir, sp_dir):
    """A model's embedding is often padded past its tokenizer (Qwen2.5: 152064 rows for
    151665 tokens) and sampling can pick a padded row: HF decodes the id to "", here it
    was a ValueError that failed the whole request."""
    tok = Tokenizer.from_dir(bpe_dir)
    v = tok.vocab_size
    ids = tok.encode("hello world", add_bos=False)
    padded = [*ids[:1], v, *ids[1:], v + 300, 2**40]
    assert tok.decode(padded) == tok.decode(ids) == tok.tokenizer.decode(padded[:-1])
    stream = tok.stream()
    assert "".join(map(stream.add, padded)) + stream.flush() == "hello world"
    # Inside a run of byte-fallback tokens too: the run still decodes as one.
    tok = Tokenizer.from_dir(sp_dir)
    ids = tok.encode("a €", add_bos=False)
    padded = [*ids[:-1], tok.vocab_size, ids[-1]]
    assert tok.decode(padded) == "a €"
    check_stream(tok, padded)


def metaspace_style() -> HFTokenizer:
    """Newer Llama-2/Mistral conversions: the Metaspace pre-tokenizer and decoder
    (prepend "▁" to the first word only) instead of the normalizer and a Strip."""
    tok = sentencepiece_style()
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first", split=False)]
    )
    return tok


def metaspace_always_style() -> HFTokenizer:
    """Older Mistral conversions: Metaspace prepending "▁" to every word (the decoder
    strips the text's first space only)."""
    tok = metaspace_style()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="always", split=False)]
    )
    return tok


def no_strip_style() -> HFTokenizer:
    """Gemma-like: byte fallback, "▁" for spaces, no prefix space and no strip."""
    tok = sentencepiece_style()
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def with_added_tokens(tok: HFTokenizer) -> HFTokenizer:
    """Added tokens of each kind: special or not, stripping, normalized, non-ASCII."""
    tok.add_tokens(
        [
            AddedToken("<tool>", special=False, normalized=False),
            AddedToken(" sp", special=False, lstrip=True, rstrip=True, normalized=True),
            AddedToken("[INST]", special=True, normalized=False),
            AddedToken("日本", special=False, normalized=False),
        ]
    )
    return tok


STREAM_TOKENIZERS = {
    (name, extra): Tokenizer(with_added_tokens(make()) if extra else make())
    for name, make in [
        ("byte_level", lambda: byte_level_bpe(post_bos=False)),
        ("byte_fallback", sentencepiece_style),
        ("metaspace", metaspace_style),
        ("metaspace_always", metaspace_always_style),
        ("no_strip", no_strip_style),
    ]
    for extra in (False, True)
}


@pytest.mark.parametrize("one_int", [False, True])
def test_a_dropped_id_keeps_the_streams_context(one_int):
    """An add whose ids are all dropped (a padded id, past the tokenizer's vocabulary)
    changes nothing: it used to slide the window to an empty one, so the next token was
    decoded as the first (SentencePiece's leading space stripped: "<unk>t" for "<unk> t";
    found by the property test below in CI)."""
    tok = STREAM_TOKENIZERS[("byte_fallback", False)]
    ids = [0, tok.vocab_size, tok.tokenizer.token_to_id("▁t")]
    stream, out = tok.stream(skip_special_tokens=False), ""
    for i in ids:
        out += stream.add(i if one_int else [i])
    assert out + stream.flush() == tok.decode(ids, skip_special_tokens=False) == "<unk> t"
    assert stream.ids == [ids[0], ids[2]]


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(STREAM_TOKENIZERS)), st.booleans(), st.data())
def test_stream_matches_decode_for_any_ids(key, skip, data):
    """Any ids (not only those of real text: loose bytes, specials anywhere, padded ids),
    added in any groups: `text + pending` is decode(ids) after every add, and what add
    and flush return joins to decode(all ids)."""
    tok = STREAM_TOKENIZERS[key]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size), max_size=14))
    stream, out, k = tok.stream(skip_special_tokens=skip), "", 0
    while k < len(ids):
        n = data.draw(st.integers(1, 4))
        out, k = out + stream.add(ids[k : k + n]), k + n
        assert stream.text == out
        assert out + stream.pending == tok.decode(ids[:k], skip_special_tokens=skip)
    assert out + stream.flush() == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(STREAM_TOKENIZERS)), st.booleans(), st.data())
def test_stream_after_a_prompt_matches_decode_in_context(key, skip, data):
    """A completion streamed after its prompt (`stream(context=prompt)`) joins to
    `decode(ids, context=prompt)` after every add, for any prompt and any ids."""
    tok = STREAM_TOKENIZERS[key]
    prompt = data.draw(st.lists(st.integers(0, tok.vocab_size), max_size=12))
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size), max_size=12))
    stream, out, k = tok.stream(skip_special_tokens=skip, context=prompt), "", 0
    while k < len(ids):
        n = data.draw(st.integers(1, 4))
        out, k = out + stream.add(ids[k : k + n]), k + n
        assert stream.ids == ids[:k] or tok.vocab_size in ids[:k]  # the context not in it
        want = tok.decode(ids[:k], skip_special_tokens=skip, context=prompt)
        assert out + stream.pending == want
    assert out + stream.flush() == tok.decode(ids, skip_special_tokens=skip, context=prompt)


@pytest.mark.parametrize("style", ["byte_fallback", "metaspace", "byte_level"])
def test_a_completion_reads_as_the_prompts_continuation(style):
    """SentencePiece decoders strip the first token's leading space: decoded alone, a
    completion lost it ("Paris", where prompt + completion reads " Paris"). After its
    prompt it keeps it, as vLLM and HF pipelines return it; byte-level BPE is unchanged."""
    tok = STREAM_TOKENIZERS[style, False]
    prompt = tok.encode("the hello", add_bos=False)
    full = tok.encode("the hello world end", add_bos=False)
    assert full[: len(prompt)] == prompt
    gen = full[len(prompt) :]
    text = tok.decode(gen, context=prompt)
    assert text == " world end"
    assert tok.decode(prompt) + text == tok.decode(full)
    if style != "byte_level":
        assert tok.decode(gen) == "world end"  # the strip, without the context
    stream = tok.stream(context=prompt)
    assert "".join(stream.add(i) for i in gen) + stream.flush() == text
    assert tok.decode(gen, context=[]) == tok.decode(gen)


# Text pieces whose tokens split every way: byte-fallback runs of every length (emoji,
# CJK, "€", newlines; two emoji fill the context's window), spaces the SentencePiece
# decoders strip, added tokens.
PIECES = ["the", " ", "hello", " ll", "🙂", "🙂🙂", "☃", "€", "\n", "日本", " [INST]", "<tool>"]


def check_completion_in_context(key, skip, data, max_pieces):
    tok = STREAM_TOKENIZERS[key]
    words = data.draw(st.lists(st.sampled_from(PIECES), min_size=2, max_size=max_pieces))
    ids = tok.encode("".join(words))
    specials = sorted(tok.special_ids)
    for _ in range(data.draw(st.integers(0, 2))):  # e.g. a chat prompt's last header
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(specials)))
    cut = data.draw(st.integers(0, len(ids)))
    prompt, gen = ids[:cut], ids[cut:]
    before = tok.tokenizer.decode(prompt, skip_special_tokens=skip)
    full = tok.tokenizer.decode(ids, skip_special_tokens=skip)
    assume(not before.endswith("\ufffd") and full.startswith(before))
    # Not a prompt of a byte-fallback run alone (after skipped special tokens): the run
    # is no context (the completion may extend it), so the completion reads as a start.
    skipped = lambda i: skip and i in tok.special_ids  # noqa: E731
    rest = list(prompt)
    while rest and (rest[-1] in tok._byte_ids or skipped(rest[-1])):
        rest.pop()
    assume(all(map(skipped, prompt)) or not all(map(skipped, rest)))
    want = full[len(before) :]
    assert tok.decode(gen, skip_special_tokens=skip, context=prompt) == want
    stream = tok.stream(skip_special_tokens=skip, context=prompt)
    assert "".join(map(stream.add, gen)) + stream.flush() == want


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(STREAM_TOKENIZERS)), st.booleans(), st.data())
def test_a_completion_decodes_as_hf_decodes_it_after_its_prompt(key, skip, data):
    """Real text cut into a prompt and a completion anywhere (inside byte-fallback runs
    of any length too, special tokens among them): the completion's text, decoded or
    streamed after its prompt, is HF's decode(prompt + completion) less
    decode(prompt), wherever that is defined (the prompt's text settled)."""
    check_completion_in_context(key, skip, data, max_pieces=12)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(STREAM_TOKENIZERS)), st.booleans(), st.data())
def test_a_completion_decodes_as_hf_decodes_it_after_its_prompt_sweep(key, skip, data):
    check_completion_in_context(key, skip, data, max_pieces=30)


def each_by_decode(tok: Tokenizer, ids, skip: bool, context) -> list[str]:
    return [tok.decode([i], skip_special_tokens=skip, context=context) for i in ids]


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(STREAM_TOKENIZERS)), st.booleans(), st.data())
def test_decode_each_is_decode_of_each_id_in_context(key, skip, data):
    """`decode_each` (logprobs' names for a position's candidates, the context resolved
    once) is `decode([i], context=)` for each id: any context, any ids, repeats, specials,
    ids past the vocabulary."""
    tok = STREAM_TOKENIZERS[key]
    context = data.draw(st.lists(st.integers(0, tok.vocab_size + 1), max_size=12))
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size + 1), max_size=8))
    got = tok.decode_each(ids, skip_special_tokens=skip, context=context)
    assert got == each_by_decode(tok, ids, skip, context)


@pytest.mark.parametrize("key", sorted(STREAM_TOKENIZERS))
def test_decode_each_on_unsettled_and_empty_contexts(key):
    """The contexts `decode` does not decode after (empty, all skipped, ending inside a
    character, a byte-fallback run alone) or after less their trailing byte-fallback run
    give `decode_each` the same names as decode."""
    tok = STREAM_TOKENIZERS[key]
    v, special = tok.vocab_size, sorted(tok._special_ids)
    euro = tok.encode("a €", add_bos=False)
    contexts = [[], special, euro, euro[:-1], [*euro[:-1], *special], tok.encode("the hel")]
    contexts.append(euro[-2:])  # byte fallback: a byte run alone, no text before it
    ids = [*tok.encode("x the € 日本 [INST]"), *special, v, v + 5, *euro, *euro[::-1]]
    unsettled = 0
    for skip in (True, False):
        for context in contexts:
            unsettled += tok._context(context, skip) is None
            got = tok.decode_each(ids, skip_special_tokens=skip, context=context)
            assert got == each_by_decode(tok, ids, skip, context), (context, skip)
    assert unsettled >= 4  # the edge cases were there, not only settled contexts
    with pytest.raises(ValueError, match=r"token ids must be >= 0, got \[-1\]"):
        tok.decode_each([5, -1], context=contexts[-1])
    with pytest.raises(TypeError, match="token ids must be ints"):
        tok.decode_each([5, 2.0])


@pytest.mark.parametrize("style", ["byte_fallback", "metaspace"])
def test_a_completion_after_byte_tokens_or_a_bare_space_keeps_its_space(style):
    """A prompt ending in byte-fallback tokens (an emoji, "€", a newline: `<0x0A>` in
    Llama 2 / Mistral vocabularies) or whose last text is a space the decoder strips
    (Mistral's `<s>[INST] [/INST]`, an empty user message) was no context at all: the
    completion was decoded alone and lost its leading space, where HF's
    decode(prompt + completion) less decode(prompt) keeps it; so was a run of byte
    tokens as long as the context's window or longer (two emoji, three snowmen)."""
    tok = STREAM_TOKENIZERS[style, False]
    for text in ["the hello ☃", "the hello\n", "the €", "a ☃☃", "the hello 🙂🙂", "the ☃☃☃"]:
        prompt = tok.encode(text, add_bos=False)
        full = tok.encode(text + " the end", add_bos=False)
        assert full[: len(prompt)] == prompt
        gen = full[len(prompt) :]
        want = tok.decode(full)[len(tok.decode(prompt)) :]
        assert want == " the end"
        for skip in (True, False):
            context = [*prompt, 2] if skip else prompt  # a skipped EOS after the bytes too
            assert tok.decode(gen, skip_special_tokens=skip, context=context) == want, text
            stream = tok.stream(skip_special_tokens=skip, context=context)
            assert "".join(stream.add(i) for i in gen) + stream.flush() == want
            assert tok.decode_each(gen[:1], skip_special_tokens=skip, context=context) == [" the"]
    bare = [1, tok.tokenizer.token_to_id("▁"), 2]  # <s> ▁ </s>: the text is "" once stripped
    the = tok.tokenizer.token_to_id("▁the")
    assert tok.decode(bare) == "" and tok.decode([*bare, the]) == " the"
    assert tok.decode([the], context=bare) == " the"
    assert tok.decode([the], context=[1, 2]) == "the"  # all skipped: no text before, as HF
    stream = tok.stream(context=bare)
    assert stream.add(the) + stream.flush() == " the"


def test_constructor_and_encode_check_the_special_ids(bpe_dir):
    """Special ids outside the vocabulary, add_bos without a BOS id, and encode asked for
    a BOS that the tokenizer lacks are errors naming the value; the EOS string is named
    from a single EOS id only."""
    tok = Tokenizer.from_dir(bpe_dir)
    raw, v = tok.tokenizer, tok.vocab_size
    with pytest.raises(
        ValueError, match=rf"bos_token_id \[{v}\] outside the vocabulary \[0, {v}\)"
    ):
        Tokenizer(raw, bos_token_id=v)
    with pytest.raises(ValueError, match=r"eos_token_ids \[-1\] outside the vocabulary"):
        Tokenizer(raw, eos_token_ids=[2, -1])
    assert Tokenizer(raw, bos_token_id=v - 1, eos_token_ids=[v - 1]).bos_token_id == v - 1
    with pytest.raises(ValueError, match="add_bos=True needs a bos_token_id"):
        Tokenizer(raw, add_bos=True)
    plain = Tokenizer(raw)
    with pytest.raises(ValueError, match="add_bos=True but this tokenizer has no BOS token"):
        plain.encode("hello", add_bos=True)
    assert plain.encode("hello") == tok.encode("hello", add_bos=False)
    assert Tokenizer(raw, eos_token_ids=[2]).eos_token == "<|eot|>"
    assert Tokenizer(raw, eos_token_ids=[1, 2]).eos_token is None  # which one? none


def test_a_lone_surrogate_is_named(bpe_dir):
    """JSON's "\\ud800" escape gives a str with no UTF-8; the tokenizers library's error
    ("TextInputSequence must be str") named neither the text nor the character."""
    tok = Tokenizer.from_dir(bpe_dir)
    with pytest.raises(ValueError, match=r"lone surrogate '\\udc00' at index 3$"):
        tok.encode(json.loads('"abc\\udc00d"'))
    assert tok.encode(json.loads('"\\ud83d\\ude00"')) == tok.encode("\U0001f600")  # a pair


def test_special_token_sources_in_order(tmp_path):
    """BOS id: generation_config's before config.json's; add_bos: tokenizer_config's
    add_bos_token when set, even false over a post-processor that prepends BOS, else
    whether the post-processor prepends it (one that appends the token does not); a
    config file that is not JSON is an error naming it."""
    d = write_dir(
        tmp_path / "a", byte_level_bpe(post_bos=False), generation_config={"bos_token_id": 1}
    )
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0}))
    assert Tokenizer.from_dir(d).bos_token_id == 1
    config = {"bos_token": "<|bos|>", "add_bos_token": False}
    d = write_dir(tmp_path / "b", byte_level_bpe(post_bos=True), tokenizer_config=config)
    tok = Tokenizer.from_dir(d)
    assert not tok.add_bos and tok.encode("hello") == tok.encode("hello", add_bos=False)
    assert tok.encode("hello")[0] != 0
    appends = byte_level_bpe(post_bos=False)
    appends.post_processor = processors.TemplateProcessing(
        single="$A <|bos|>", special_tokens=[("<|bos|>", 0)]
    )
    d = write_dir(tmp_path / "c", appends, tokenizer_config={"bos_token": "<|bos|>"})
    assert appends.encode("hello").ids[-1] == 0 and not Tokenizer.from_dir(d).add_bos
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize(
    "file,config,match",
    [
        ("generation_config", {"eos_token_id": 1.5}, r"eos_token_id must be a token id .* 1\.5"),
        ("generation_config", {"eos_token_id": "2"}, r"eos_token_id must be .*, got '2'"),
        ("generation_config", {"eos_token_id": [1, True]}, r"got \[1, True\]"),
        ("generation_config", {"eos_token_id": [1, None]}, r"got \[1, None\]"),
        ("config", {"bos_token_id": "x"}, r"^config.json bos_token_id must be .*, got 'x'"),
        (
            "config",
            {"eos_token_id": [2, 400]},
            r"^config.json eos_token_id=\[2, 400\]: \[400\] out",
        ),
        ("tokenizer_config", {"bos_token": 5}, "bos_token=5 is not in the vocab"),
    ],
)
def test_bad_special_ids_in_config_files_are_named(tmp_path, file, config, match):
    """A config file's special-token id that is not an id (or a list of them) is an error
    naming the file and the value: int() read a float or a string (1.5 as EOS 1, "2" as
    2, true as 1), and null or a foreign string failed in Python's words."""
    d = write_dir(tmp_path, byte_level_bpe(post_bos=False))
    (d / f"{file}.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(d)


def test_lowercase_byte_tokens_are_a_byte_run():
    """HF's ByteFallback decoder reads `<0xe2>` as a byte as it does `<0xE2>`, and decodes
    a run of either all or nothing: a vocabulary with lowercase byte tokens is streamed
    with its runs held back too (the stream emitted "€" that the next byte turned into
    four U+FFFD)."""
    tok = sentencepiece_style()
    vocab = tok.get_vocab()
    lower = {(t.lower() if re.fullmatch(r"<0x..>", t) else t): i for t, i in vocab.items()}
    model = json.loads(tok.to_str())
    model["model"]["vocab"] = lower
    tok = Tokenizer(HFTokenizer.from_str(json.dumps(model)))
    byte = lambda b: tok.tokenizer.token_to_id(f"<0x{b:02x}>")
    assert byte(0xE2) is not None and tok.tokenizer.token_to_id("<0xE2>") is None
    a = tok.tokenizer.token_to_id("a")
    ids = [a, *map(byte, "€☃".encode()), a]
    assert tok.decode(ids) == "a€☃a" and tok.decode(ids[:5]) == "a" + "\ufffd" * 4
    check_stream(tok, ids)


def test_a_shown_special_token_ends_a_byte_run(sp_dir):
    """With special tokens shown, one after a run of byte tokens ends the run (the
    decoder sees it), so the text up to it is final; skipped, it is invisible and the
    run is held back as it may go on after it."""
    tok = Tokenizer.from_dir(sp_dir)
    ids = [*tok.encode("a €", add_bos=False), 2]
    stream = tok.stream(skip_special_tokens=False)
    assert "".join(map(stream.add, ids)) == "a €</s>" and stream.pending == ""
    stream = tok.stream()
    assert "".join(map(stream.add, ids)) == "a " and stream.pending == "€"
