"""Review of the tokenizer's encode side against HF's AutoTokenizer: which files name the
special tokens (a legacy `special_tokens_map.json`), the added tokens HF registers on
load (named special tokens, `added_tokens_decoder` flags) and a SentencePiece-only
checkpoint's error.

The tokenizers are `test_tokenizer`'s byte-level BPE (<|bos|> 0, <|eos|> 1, <|eot|> 2)
and SentencePiece-style one, edited as the case needs.
"""

import json

import pytest
from test_tokenizer import byte_level_bpe, sentencepiece_style, write_dir
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from pagedjax.tokenizer import Tokenizer

AS_ADDED = dict(lstrip=False, rstrip=False, normalized=False, single_word=False, special=True)


def _dir(tmp_path, tok=None, *, config=None, special_map=None):
    d = write_dir(tmp_path, tok or byte_level_bpe(post_bos=True), tokenizer_config=config)
    if special_map is not None:
        (d / "special_tokens_map.json").write_text(json.dumps(special_map))
    return d


def _unregistered(tok: HFTokenizer, *contents: str) -> HFTokenizer:
    """`tok` with `contents` kept in the vocabulary but no longer added tokens (as a
    tokenizer.json written without them in "added_tokens"): their text is split."""
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in contents]
    out = HFTokenizer.from_str(json.dumps(data))
    for c in contents:
        assert out.token_to_id(c) is not None and len(out.encode(c).ids) > 1
    return out


def test_a_legacy_special_tokens_map_names_the_special_tokens(tmp_path):
    """HF reads special_tokens_map.json when tokenizer_config.json has no
    added_tokens_decoder (older checkpoints), its tokens over the config's: without it
    such a checkpoint had no EOS from the tokenizer (generation ran to max_tokens) and
    no bos_token string for the chat template."""
    eot = {"content": "<|eot|>", **AS_ADDED}
    only_map = _dir(tmp_path / "a", special_map={"bos_token": "<|bos|>", "eos_token": eot})
    tok = Tokenizer.from_dir(only_map)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (0, {2}, True)
    assert (tok.bos_token, tok.eos_token) == ("<|bos|>", "<|eot|>")
    assert tok.special_tokens == {"bos_token": "<|bos|>", "eos_token": "<|eot|>"}
    config = {"eos_token": "<|eos|>", "additional_special_tokens": ["<|eos|>"]}
    special_map = {"eos_token": "<|eot|>", "additional_special_tokens": ["<|eot|>", "<|eos|>"]}
    tok = Tokenizer.from_dir(_dir(tmp_path / "b", config=config, special_map=special_map))
    assert tok.eos_token_ids == {2}  # the map's, over the legacy config's
    assert tok.special_tokens["additional_special_tokens"] == ["<|eos|>", "<|eot|>"]
    modern = {**config, "added_tokens_decoder": {"1": {"content": "<|eos|>", **AS_ADDED}}}
    tok = Tokenizer.from_dir(_dir(tmp_path / "c", config=modern, special_map=special_map))
    assert tok.eos_token_ids == {1}  # a current config: the map is not read


def test_named_special_tokens_encode_as_their_ids(tmp_path):
    """A token that tokenizer_config names (bos_token, additional_special_tokens, ...)
    but that tokenizer.json holds as a plain vocabulary entry is registered by HF as a
    special added token: its text in a prompt encodes as its id (and a prompt starting
    with the BOS text gets no second one). It was split into byte pieces."""
    raw = _unregistered(byte_level_bpe(post_bos=True), "<|bos|>", "<|eot|>")
    config = {"bos_token": "<|bos|>", "additional_special_tokens": ["<|eot|>"]}
    tok = Tokenizer.from_dir(_dir(tmp_path, raw, config=config))
    hello = tok.encode("hello", add_bos=False)
    assert tok.encode("hello<|eot|>", add_bos=False) == [*hello, 2]
    assert tok.encode("<|bos|>hello") == [0, *hello] == tok.encode("hello")
    assert 2 in tok.special_ids and tok.decode([*hello, 2]) == "hello"


def test_config_added_token_flags_override_the_tokenizer_json(tmp_path):
    """HF re-adds an added_tokens_decoder entry whose flags differ from tokenizer.json's
    (here rstrip: the spaces after <|eot|> belong to it), as the checkpoint's config
    says; an entry or a named token that is not in the vocabulary at its id is not
    added (HF's new id would be past the model's embedding)."""
    rstrip = {"content": "<|eot|>", **AS_ADDED, "rstrip": True}
    config = {
        "added_tokens_decoder": {"2": rstrip, "7": {"content": "<|eos|>", **AS_ADDED}},
        "pad_token": "<pad>",
    }
    tok = Tokenizer.from_dir(_dir(tmp_path, config=config))
    want = byte_level_bpe(post_bos=True)
    want.add_special_tokens([AddedToken(**rstrip)])
    text = "hello<|eot|>   world"
    assert tok.encode(text, add_bos=False) == want.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_bos=False) != byte_level_bpe(post_bos=True).encode(text).ids[1:]
    assert tok.vocab_size == want.get_vocab_size() and tok.tokenizer.token_to_id("<pad>") is None
    assert tok.tokenizer.get_added_tokens_decoder()[1].content == "<|eos|>"


def test_add_eos_token_is_not_followed(tmp_path):
    """Documented choice: HF appends EOS to `tokenizer(prompt)` for add_eos_token=true;
    a prompt that ends in EOS asks the model to stop, so encode does not."""
    config = {"bos_token": "<|bos|>", "eos_token": "<|eot|>", "add_eos_token": True}
    tok = Tokenizer.from_dir(_dir(tmp_path, config=config))
    assert tok.encode("hello") == [0, *tok.encode("hello", add_bos=False)]
    assert 2 not in tok.encode("hello")


def test_a_sentencepiece_only_checkpoint_is_named(tmp_path):
    """A checkpoint with tokenizer.model and no tokenizer.json (HF converts it on load)
    is refused with the reason and the way to write a tokenizer.json."""
    d = tmp_path / "spm"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(b"\x0a\x00")
    with pytest.raises(FileNotFoundError, match=r"only a SentencePiece tokenizer.model.*save_"):
        Tokenizer.from_dir(d)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json in \S+; transformers'"):
        Tokenizer.from_dir(tmp_path)
    assert Tokenizer.from_dir(write_dir(tmp_path / "sp", sentencepiece_style())).vocab_size > 256
