"""Review of the tokenizer's vocabulary bound for a vocabulary whose ids have holes.

`Tokenizer.vocab_size` was tokenizers' `get_vocab_size(with_added_tokens=True)`, which
counts the tokens; where the ids are not contiguous (camembert-base lacks id 3, gpt-oss's
o200k vocabulary has unused ids) that count is below the largest id, so the tokens past it
were treated as ids past the vocabulary: an EOS there refused the checkpoint, a sampled one
decoded to "" and guided decoding never allowed one. vLLM bounds ids by the largest one
(`max_token_id`), and HF decodes them. The ids of the holes themselves have no token: HF's
decode drops them, and so must the stream (it read "<unk>t" for "<unk> t", as a padded id
once made it).

The tokenizer is `test_tokenizer`'s SentencePiece-style one (ids 0..291) with holes at
292 and 293, a special `<|eot|>` at 294 and a plain piece "zz" at 295: 294 tokens.
"""

import json

import pytest
from test_tokenizer import check_stream, sentencepiece_style, write_dir
from tokenizers import Tokenizer as HFTokenizer

from pagedjax.guided import compile_guide
from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.token_bytes import token_bytes
from pagedjax.tokenizer import Tokenizer, name_context, token_names

HOLE, EOT, ZZ = 292, 294, 295


def holed() -> HFTokenizer:
    data = json.loads(sentencepiece_style().to_str())
    vocab = data["model"]["vocab"]
    assert max(vocab.values()) == HOLE - 1
    vocab["zz"], vocab["<|eot|>"] = ZZ, EOT
    eot = dict(id=EOT, content="<|eot|>", single_word=False, lstrip=False, rstrip=False)
    data["added_tokens"].append(dict(eot, normalized=False, special=True))
    tok = HFTokenizer.from_str(json.dumps(data))
    assert (tok.id_to_token(HOLE), tok.token_to_id("zz"), tok.token_to_id("<|eot|>")) == (
        None,
        ZZ,
        EOT,
    )
    assert tok.get_vocab_size(with_added_tokens=True) == EOT  # two short of its largest id
    return tok


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(holed())


def test_a_checkpoint_whose_eos_is_past_a_hole_loads(tmp_path):
    """An EOS past the holes was "outside the vocabulary [0, 294)", from tokenizer_config
    and from generation_config alike: the checkpoint did not load."""
    d = write_dir(tmp_path / "a", holed(), tokenizer_config={"eos_token": "<|eot|>"})
    assert Tokenizer.from_dir(d).eos_token_ids == {EOT}
    d = write_dir(tmp_path / "b", holed(), generation_config={"eos_token_id": EOT})
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == {EOT} and tok.vocab_size == ZZ + 1
    with pytest.raises(ValueError, match=r"\[296\] outside the vocabulary \[0, 296\)"):
        Tokenizer(holed(), eos_token_ids=ZZ + 1)


def test_tokens_past_a_hole_decode_as_hf_decodes_them(tok):
    """A sampled token past the hole decoded to "" (dropped as past the vocabulary)."""
    hf = tok.tokenizer
    a = hf.token_to_id("a")
    for ids in ([a, ZZ], [a, ZZ, EOT]):
        for skip in (True, False):
            want = hf.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids, skip_special_tokens=skip) == want
    assert tok.decode([ZZ, EOT], skip_special_tokens=False) == "zz<|eot|>"
    assert tok.decode_each([ZZ, EOT], skip_special_tokens=False) == ["zz", "<|eot|>"]
    assert check_stream(tok, [a, ZZ, EOT]) and tok.stream().add(ZZ) == "zz"


def test_a_hole_decodes_to_nothing_and_keeps_the_streams_context(tok):
    """The hole's id has no token: it decodes to "" and is dropped from the stream, as
    an id past the vocabulary is (it slid the window to a chunk of nothing, so the next
    token was decoded as the text's first: "<unk>t" for "<unk> t")."""
    t = tok.tokenizer.token_to_id("▁t")
    ids = [0, HOLE, t]
    for one_int in (False, True):
        stream, out = tok.stream(skip_special_tokens=False), ""
        for i in ids:
            out += stream.add(i if one_int else [i])
        assert out + stream.flush() == tok.decode(ids, skip_special_tokens=False) == "<unk> t"
        assert stream.ids == [0, t]
    assert tok.decode_each([HOLE]) == [""]
    check_stream(tok, ids)
    # A token after the hole is named as after the ids without it.
    the = tok.tokenizer.token_to_id("▁the")

    def name(ids):
        return token_names(tok, [the], context=name_context(tok, ids))

    assert name([*ids, HOLE]) == name([0, HOLE, HOLE, t]) == name([0, t]) == [" the"]


def test_guided_decoding_allows_a_token_past_a_hole(tok):
    """The guide's token table stopped at the count of tokens: "zz" (id 295) had no
    bytes, so a pattern it spells never allowed it."""
    assert token_bytes(tok)[ZZ] == b"zz" and token_bytes(tok)[HOLE] is None
    guide = compile_guide(StructuredOutputsParams(regex="zz"), tok, ZZ + 1)
    start = guide.initial_state
    assert guide.allows(start, ZZ) and not guide.allows(start, HOLE)
