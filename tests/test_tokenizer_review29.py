"""Review of prompt encoding and the tokenizer's special ids: prompts given as JAX arrays
(as numpy ones are), and the special ids a `Tokenizer` is built with.

The tokenizer is `test_tokenizer`'s byte-level BPE (<|bos|> 0, <|eos|> 1, <|eot|> 2).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from test_tokenizer import byte_level_bpe, write_dir

from pagedjax.prompts import encode_prompt, request_lists
from pagedjax.tokenizer import Tokenizer

VOCAB, MAX_LEN = 320, 64


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    config = {"bos_token": "<|bos|>", "eos_token": "<|eot|>", "add_bos_token": True}
    d = write_dir(tmp_path_factory.mktemp("bpe"), byte_level_bpe(True), tokenizer_config=config)
    return Tokenizer.from_dir(d)


def test_jax_arrays_are_token_id_prompts_as_numpy_arrays_are(tok):
    """A 1-D integer JAX array is one token-id prompt (as a numpy array is), a 2-D one a
    list of them, and a JAX integer scalar a token id: `generate(jnp.array(ids))` was
    read as a list of prompts, one per id ("prompt 0: a prompt must be a str or a list
    of token ids, got Array(3, dtype=int32)"), and `[jnp.int32(3), 4]` was refused."""
    ids = [3, 4, 5]
    for prompt in (jnp.array(ids), jnp.array(ids, dtype=jnp.uint8), [jnp.int32(3), 4, 5]):
        assert encode_prompt(prompt, tok, VOCAB, MAX_LEN) == (None, ids)
        prompts, params = request_lists(prompt, None, lambda: "default")
        assert len(prompts) == 1 and params == ["default"]
        assert encode_prompt(prompts[0], tok, VOCAB, MAX_LEN) == (None, ids)
    prompts, _ = request_lists(jnp.array([ids, ids]), None, lambda: None)
    assert [encode_prompt(p, tok, VOCAB, MAX_LEN)[1] for p in prompts] == [ids, ids]
    got = encode_prompt(jnp.array(ids), tok, VOCAB, MAX_LEN, truncate_prompt_tokens=2)
    assert got == (None, ids[1:])
    for bad in (jnp.array([3.0, 4.0]), jnp.array([True, False]), [jnp.array(3.5)]):
        with pytest.raises(TypeError, match="token id prompts must be lists of ints, got"):
            encode_prompt(bad, tok, VOCAB, MAX_LEN)
    with pytest.raises(TypeError, match="a prompt must be a str or a list of token ids"):
        encode_prompt(jnp.array(3), tok, VOCAB, MAX_LEN)
    with pytest.raises(TypeError, match="prompts must be a prompt .* or a list of them, got"):
        request_lists(jnp.array(3), None, lambda: None)
    with pytest.raises(ValueError, match=r"prompt token ids \[400\] are outside"):
        encode_prompt(jnp.array([3, 400]), tok, VOCAB, MAX_LEN)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(bos_token_id=1.5), r"bos_token_id must be a token id \(an int\), got 1\.5"),
        (dict(bos_token_id=True), r"bos_token_id must be a token id \(an int\), got True"),
        (dict(eos_token_ids=[2.7]), r"eos_token_ids must be token ids \(ints\), got \[2\.7\]"),
        (dict(eos_token_ids=[True]), r"eos_token_ids must be .*, got \[True\]"),
        (dict(eos_token_ids=["2"]), r"eos_token_ids must be .*, got \['2'\]"),
        (dict(eos_token_ids=[2, [3]]), r"eos_token_ids must be .*, got \[2, \[3\]\]"),
        (dict(eos_token_ids="2"), r"eos_token_ids must be .*, got '2'"),
    ],
)
def test_special_ids_that_are_not_ints_are_named(tok, kw, match):
    """A float or bool special id was taken: BOS 1.5 was prepended to every prompt as
    1.5 (and ran as id 1), EOS 2.7 stopped on 2, and a str failed in Python's words
    ("'<=' not supported between instances of 'int' and 'str')."""
    with pytest.raises(TypeError, match=match):
        Tokenizer(tok.tokenizer, **kw)


def test_special_ids_may_be_numpy_ints_or_one_eos_int(tok):
    """numpy / JAX integers are ids (stored as ints); one EOS id may be given alone, as
    config files give `eos_token_id` (it was "'int' object is not iterable"), and None
    is no EOS id, as for `bos_token_id`."""
    built = Tokenizer(
        tok.tokenizer, bos_token_id=np.int64(0), eos_token_ids=jnp.array([1, 2]), add_bos=True
    )
    assert built.bos_token_id == 0 and type(built.bos_token_id) is int
    assert built.eos_token_ids == {1, 2} and all(type(i) is int for i in built.eos_token_ids)
    assert built.encode("hello") == tok.encode("hello")
    assert Tokenizer(tok.tokenizer, eos_token_ids=2).eos_token_ids == {2}
    assert Tokenizer(tok.tokenizer, eos_token_ids=np.int32(2)).eos_token == "<|eot|>"
    assert Tokenizer(tok.tokenizer, eos_token_ids=None).eos_token_ids == frozenset()
