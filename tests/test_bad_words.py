"""SamplingParams.bad_words end to end, against dense greedy decoding with vLLM's bans.

The tiny preset with random weights and the byte tokenizer (one token per byte: a word
of k ASCII characters is k tokens), in test_logit_bias.py's geometry. The reference
bans, at each step, the last token of every bad word whose other tokens end the
generated tokens (vLLM's rule: the prompt does not count), on dense no-cache logits.
The engine checks all but a word's last two tokens on the host and the one before the
last on the device, where an asynchronous step's input token may still be.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
import pytest
import tokenizers

from pagedjax import decode, resources, sampling
from pagedjax.batch import bad_word_bans
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams
from pagedjax.request import encode_bad_words
from pagedjax.tokenizer import Tokenizer

TINY = PRESETS["tiny"]  # float32, vocab 256, EOS 2
GEOMETRY = dict(page_size=8, num_pages=64, backend="xla", max_num_seqs=8)
WIDTH = 64  # dense buffer width (>= any sequence here)


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(TINY, 0)


@pytest.fixture(scope="module")
def dense(params):
    return params_helpers.dense_last_logits(params, WIDTH)


def dense_banned(dense, prompts, max_tokens, words):
    """Greedy continuations (no stop) of dense logits where each token sequence of
    `words[i]` has its last token at -inf wherever prompt i's generated tokens end with
    the rest of it."""
    outs = [[] for _ in prompts]
    for _ in range(max_tokens):
        rows = dense([p + o for p, o in zip(prompts, outs, strict=True)])
        for out, row, ws in zip(outs, rows, words, strict=True):
            row = row.copy()
            for w in ws:
                k = len(w) - 1
                if k <= len(out) and tuple(out[len(out) - k :]) == w[:-1]:
                    row[w[-1]] = -np.inf
            out.append(int(np.argmax(row)))
    return outs


def as_word(tok, ids) -> str:
    """The text the byte tokenizer encodes to exactly `ids`."""
    w = bytes(ids).decode()
    assert w == w.lstrip() and tok.encode(w, add_bos=False) == list(ids), ids
    return w


def occurs(seq, w) -> bool:
    return any(tuple(seq[i : i + len(w)]) == tuple(w) for i in range(len(seq) - len(w) + 1))


def prompts_(seed=4, lens=(3, 9, 17, 24)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lens]


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bad_words_never_appear_and_the_rest_is_greedy(params, dense, async_scheduling):
    """Words of one, two and three tokens that the free greedy run generates: none is
    generated with them banned, and every output is the reference's (chunked prefill)."""
    llm = LLM(params, max_num_batched_tokens=11, async_scheduling=async_scheduling, **GEOMETRY)
    tok, prompts = llm.tokenizer, prompts_()
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())]
    spans = [(1, 3), (8, 11), (0, 1), (4, 6)]  # a word of the free run, per prompt
    ids = [tuple(f[a:b]) for f, (a, b) in zip(free, spans, strict=True)]
    words = [as_word(tok, w) for w in ids]
    outs = llm.generate(prompts, [greedy(bad_words=[w], logprobs=0) for w in words])
    want = dense_banned(dense, prompts, 12, [[w] for w in ids])
    for o, w, f, i in zip(outs, want, free, ids, strict=True):
        c = o.outputs[0]
        assert c.token_ids == w and c.text == tok.decode(w, context=o.prompt_token_ids)
        assert occurs(f, i) and not occurs(w, i) and w != f
    # Logprobs stay the raw distribution's: the banned token is the raw argmax.
    j = free[2].index(ids[2][0])
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(dense([prompts[2] + want[2][:j]]))))[0]
    assert raw.argmax() == ids[2][0] != want[2][j]
    np.testing.assert_allclose(outs[2].outputs[0].logprobs[j][want[2][j]], raw[want[2][j]], 1e-5)


def first_ascii_tokens(llm, stem, letters):
    """Prompts `stem + [c]` for ASCII letters c whose free greedy first token is ASCII
    too (so `chr(c) + chr(token)` is a two-token word)."""
    prompts = [stem + [c] for c in letters]
    firsts = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, greedy(1))]
    return [(p, t) for p, t in zip(prompts, firsts, strict=True) if 33 <= t < 127]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_prompt_does_not_start_a_bad_word(params, dense, async_scheduling):
    """A word whose first token ends the prompt and whose second the model draws next
    is not banned there (vLLM matches the generated tokens only): one sample (the
    prefill row draws it) or n=2 (the samples fork and feed the last prompt token)."""
    llm = LLM(params, max_num_batched_tokens=11, async_scheduling=async_scheduling, **GEOMETRY)
    stem = prompts_()[1][:-1]
    prompt, t = first_ascii_tokens(llm, stem, range(97, 123))[0]
    word = as_word(llm.tokenizer, (prompt[-1], t))
    want = dense_banned(dense, [prompt], 10, [[(prompt[-1], t)]])[0]
    assert want[0] == t
    for n in (1, 2):
        (out,) = llm.generate([prompt], greedy(10, bad_words=[word], n=n))
        assert [c.token_ids for c in out.outputs] == [want] * n


def ascii_pair(ids) -> tuple[int, int]:
    """The first two generated tokens in a row, after the first, that are printable ASCII."""
    i = next(i for i in range(1, len(ids) - 1) if all(33 <= t < 127 for t in ids[i : i + 2]))
    return tuple(ids[i : i + 2])


def test_bad_words_with_preemption_and_samples(params, dense):
    """Greedy requests preempted and recomputed (a prefill row of generated tokens draws
    the next one) equal the reference; n=2 seeded samples are the sampler's draws from
    the dense logits with the bans applied, and differ from the free samples."""
    llm = LLM(params, max_num_batched_tokens=16, **(GEOMETRY | dict(num_pages=16)))
    tok = llm.tokenizer
    prompts = [p[:12] for p in prompts_(seed=7, lens=(14, 15, 16, 17))]
    words = [ascii_pair(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(40))]
    outs = llm.generate(prompts, [greedy(40, bad_words=[as_word(tok, w)]) for w in words])
    assert sum(o.num_preemptions for o in outs) > 0
    want = dense_banned(dense, prompts, 40, [[w] for w in words])
    assert [o.outputs[0].token_ids for o in outs] == want

    sp = dict(n=2, temperature=1.5, seed=3, max_tokens=30, ignore_eos=True)
    (free,) = llm.generate([prompts[0]], SamplingParams(**sp))
    words = [ascii_pair(c.token_ids) for c in free.outputs]
    texts = [as_word(tok, w) for w in words]
    (out,) = llm.generate([prompts[0]], SamplingParams(**sp, bad_words=texts))
    rows, seeds, steps, want = [], [], [], []
    for c in out.outputs:
        assert not any(occurs(c.token_ids, w) for w in words), c.token_ids
        assert c.token_ids != free.outputs[c.index].token_ids
        for j, t in enumerate(c.token_ids):
            logits = dense([prompts[0] + c.token_ids[:j]])[0]
            for w in words:
                if j and c.token_ids[j - 1] == w[0]:
                    logits[w[1]] = -np.inf
            rows.append(logits)
            seeds.append((sp["seed"] + c.index * 0x9E3779B1) % 2**32)
            steps.append(j)
            want.append(t)
    n = len(rows)
    drawn, _ = jax.jit(sampling.sample)(
        jnp.asarray(np.stack(rows), jnp.float32),
        jnp.full(n, sp["temperature"], jnp.float32),
        jnp.zeros(n, jnp.int32),
        jnp.ones(n, jnp.float32),
        jnp.asarray(seeds, jnp.uint32),
        jnp.asarray(steps, jnp.int32),
    )
    assert np.asarray(drawn).tolist() == want


def space_folding_tokenizer(t: int) -> Tokenizer:
    """The byte tokenizer with id t standing for " q" (a BPE merge), as tokenizers fold
    a word's leading space into its first token; byte t itself has no token then."""
    hf = resources.byte_tokenizer().tokenizer
    vocab = {c: i for c, i in hf.get_vocab().items() if i != t} | {"Ġq": t}
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[("Ġ", "q")]))
    bpe.pre_tokenizer, bpe.decoder = hf.pre_tokenizer, hf.decoder
    return Tokenizer(bpe, bos_token_id=1, eos_token_ids=[2])


def test_encode_bad_words_adds_the_leading_space_variant_as_vllm():
    tok = space_folding_tokenizer(200)
    assert tok.encode(" q", add_bos=False) == [200] and tok.encode("q", add_bos=False) == [113]
    enc = encode_bad_words  # leading whitespace is stripped first, then " " added
    assert enc(["q"], tok, 256) == [(113,), (200,)] == enc(["  q"], tok, 256)
    assert enc(["qz"], tok, 256) == [(113, 122), (200, 122)]
    # " ab" and " z" are a token longer than "ab" and "z": no variant; duplicates go.
    assert enc(["ab", "\tz", "z"], tok, 256) == [(97, 98), (122,)]
    assert enc(["q z"], tok, 256) == [(113, 32, 122), (200, 32, 122)]
    with pytest.raises(ValueError, match=r"'q' encodes to token ids \[200\] outside"):
        enc(["q"], tok, 150)


def test_the_leading_space_variant_is_banned_too(params, dense):
    """With a tokenizer whose " q" is one token, bad_words=["q"] bans both "q" and " q"
    (vLLM's variant): the free run's " q" token is never drawn."""
    plain = LLM(params, max_num_batched_tokens=11, **GEOMETRY)
    prompt = prompts_()[3]
    free = plain.generate([prompt], greedy())[0].outputs[0].token_ids
    t = next(t for t in free if t not in (32, 113, 1, 2))
    llm = LLM(params, max_num_batched_tokens=11, tokenizer=space_folding_tokenizer(t), **GEOMETRY)
    out = llm.generate([prompt], greedy(bad_words=["q"]))[0].outputs[0].token_ids
    assert out == dense_banned(dense, [prompt], 12, [[(113,), (t,)]])[0]
    assert t not in out and 113 not in out


def test_bad_word_bans_check_the_generated_tokens_only():
    words = [(5, 6), (7, 5, 6), (9, 9, 9, 4)]
    tokens = [1, 7, 5, 9, 9, 9]  # a prompt of 2, then 4 generated tokens (the last fed)
    assert bad_word_bans(words, tokens, 2, 2) == [(5, 6)]  # nothing generated before 5
    assert bad_word_bans(words, tokens, 2, 1) == [(5, 6), (5, 6)]  # 7 is generated now
    assert bad_word_bans(words, tokens, 5, 2) == [(5, 6), (9, 4)]
    assert bad_word_bans(words, tokens, 5, 4) == [(5, 6)]  # (9, 9) reaches into the prompt
    assert bad_word_bans(words, tokens[:5], 5, 2) == [(5, 6), (9, 4)]  # 5th: in flight
    assert bad_word_bans(words, tokens, 1, 2) == []  # the last token is the prompt's


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bad_words="ab"), "bad_words must be a list of strs, got bad_words='ab'"),
        (dict(bad_words=["ok", 5]), r"got 5 in bad_words=\['ok', 5\]"),
        (dict(bad_words=[""]), r"got '' in bad_words=\[''\]"),
        (dict(bad_words=[" \t"]), r"got ' \\t'"),
        (dict(bad_words=5), "bad_words must be a list of strs, got bad_words=5"),
        (dict(bad_words=["x"], beam_width=2), r"not supported with beam search.*bad_words="),
    ],
)
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_words_need_a_tokenizer_and_the_vocabulary():
    """Refused when the request is added, before anything is queued or compiled."""
    small = dataclasses.replace(TINY, vocab_size=128, num_layers=1)  # no byte tokenizer
    llm = LLM(small, **GEOMETRY)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="bad_words need a tokenizer; this model has none"):
        llm.add_request([5, 6], SamplingParams(bad_words=["x"]))
    llm = LLM(small, tokenizer=resources.byte_tokenizer(), **GEOMETRY)
    before = decode.compile_counts()
    with pytest.raises(ValueError, match=r"'é' encodes to token ids \[195, 169\] outside"):
        llm.add_request([5], SamplingParams(bad_words=["x", "é"]))
    assert not llm.has_unfinished_requests() and decode.compile_counts() == before
    assert SamplingParams(bad_words=[]).bad_words is None  # nothing to ban
