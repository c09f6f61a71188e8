"""Completion text against the references it follows: `tokenizers`' `DecodeStream` (the
incremental decoder vLLM's FastIncrementalDetokenizer runs after its prompt) and
`tokenizers.Tokenizer.decode` (what HF's `PreTrainedTokenizerFast.decode` calls).

Where the references part, the choice is pinned: a completion cut inside a character
ends in U+FFFD as HF's decode gives it (DecodeStream never emits the bytes, so vLLM's
text drops them; `test_tokenizer.py` checks the stream against decode there), and
tokenizer_config's `clean_up_tokenization_spaces` is not applied (HF's decode applies
it; vLLM's completions, read from DecodeStream, never do).
"""

import pytest
from test_tokenizer import STREAM_TOKENIZERS, TEXTS, byte_level_bpe, write_dir
from tokenizers.decoders import DecodeStream

from pagedjax.tokenizer import Tokenizer

# Added tokens (special "[INST]", plain "<tool>" and "日本" in the tokenizers that have
# them), byte-fallback characters and spaces before and after each.
TEXTS_ADDED = ["call <tool> now [INST] ok 日本 x", "[INST] the € [INST]<tool>\n日本"]


def decode_stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> str:
    """The text DecodeStream gives `ids` after it has read `prompt` (its own text unused)."""
    stream = DecodeStream(skip_special_tokens=skip)
    for i in prompt:
        stream.step(tok.tokenizer, i)
    return "".join(stream.step(tok.tokenizer, i) or "" for i in ids)


@pytest.mark.parametrize("key", sorted(STREAM_TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_a_completion_reads_as_decode_stream_reads_it_after_its_prompt(key, skip):
    """Real text split into prompt and completion at every token that ends a character:
    the streamed pieces, decode(context=prompt) and DecodeStream after the prompt give
    the same text, keeping the completion's leading space (SentencePiece's strip of the
    first token, Metaspace "first" or "always"), with special tokens skipped or shown
    and plain added tokens kept, and with a BOS-only prompt (the text's first token)."""
    tok = STREAM_TOKENIZERS[key]
    bos = [sorted(tok.special_ids)[0]]
    for text in TEXTS + TEXTS_ADDED:
        ids = tok.encode(text, add_bos=False)
        for prompt, gen in [(bos, ids)] + [(ids[:k], ids[k:]) for k in range(1, len(ids))]:
            if tok.tokenizer.decode(prompt).endswith("\ufffd"):
                continue  # (DecodeStream gives the prompt's partial character to the text)
            expected = decode_stream(tok, prompt, gen, skip)
            assert tok.decode(gen, context=prompt, skip_special_tokens=skip) == expected
            stream = tok.stream(context=prompt, skip_special_tokens=skip)
            assert "".join(map(stream.add, gen)) + stream.flush() == expected


def test_clean_up_tokenization_spaces_is_not_applied(tmp_path):
    """HF's decode drops the space before "." "," "n't" ... when tokenizer_config sets
    `clean_up_tokenization_spaces` (Llama 3's does), which changes the text ("x != y"
    read "x!= y"); a completion is the decoder's text, as vLLM's is."""
    tok = Tokenizer.from_dir(
        write_dir(
            tmp_path,
            byte_level_bpe(post_bos=False),
            tokenizer_config={"clean_up_tokenization_spaces": True},
        )
    )
    text = "hello , world . I do n't ! x != y"
    ids = tok.encode(text, add_bos=False)
    assert tok.tokenizer.decode(ids) == text  # (no cleanup in tokenizers itself)
    assert tok.decode(ids) == text
    assert tok.decode(ids[3:], context=ids[:3]) == decode_stream(tok, ids[:3], ids[3:], True)
    stream = tok.stream()
    assert "".join(map(stream.add, ids)) + stream.flush() == text
