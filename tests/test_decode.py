"""pagedjax.decode: paged prefill + decode is exact against dense recompute, on every backend."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import cache as cache_lib
from pagedjax import decode, model
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]
PROMPT_LENS = (1, 3, 4, 5, 9, 17)  # single token, mid-page, on and across page boundaries
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


def _prompts(cfg, lens, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lens]


def _dense_oracle(params, prompts, out):
    """Dense no-cache logits for every generated token, teacher-forced on `out.tokens`.

    Recomputing the whole sequence at every step gives, at step i, the logits at
    position len(prompt) + i - 1 of the full sequence (causality), so one batched
    call over right-padded sequences checks every step at once.
    """
    full = [p + t for p, t in zip(prompts, out.tokens, strict=True)]
    width = max(map(len, full))
    batch = np.zeros((len(full), width), np.int32)
    for b, seq in enumerate(full):
        batch[b, : len(seq)] = seq
    logits = np.asarray(jax.jit(model.forward)(params, jnp.asarray(batch)))
    return [
        logits[b, len(p) - 1 : len(p) - 1 + len(t)]
        for b, (p, t) in enumerate(zip(prompts, out.tokens, strict=True))
    ]


def _assert_matches_dense(params, prompts, out, tol=1e-4):
    for b, ref in enumerate(_dense_oracle(params, prompts, out)):
        got = out.logits[b]
        assert got.shape == ref.shape and np.isfinite(got).all()
        # Greedy tokens equal dense recompute's argmax at every step...
        np.testing.assert_array_equal(np.array(out.tokens[b]), ref.argmax(-1), err_msg=f"{b=}")
        # ...and the logits agree step by step.
        for i in range(len(ref)):
            err = np.linalg.norm(got[i] - ref[i]) / np.linalg.norm(ref[i])
            assert err < tol, f"prompt {b} step {i}: relative error {err}"


def _generate(params, prompts, **kw):
    kw = dict(max_new_tokens=NEW_TOKENS, stop_token_ids=(), backend="xla") | kw
    return decode.generate(params, prompts, return_logits=True, **kw)


@pytest.mark.parametrize("page_size", [4, 8])
def test_greedy_paged_decode_equals_dense_recompute(params, page_size):
    prompts = _prompts(TINY, PROMPT_LENS)
    out = _generate(params, prompts, page_size=page_size)
    assert [len(t) for t in out.tokens] == [NEW_TOKENS] * len(prompts)
    _assert_matches_dense(params, prompts, out)
    # Not a degenerate check: the model does not emit one token forever.
    assert len({t for seq in out.tokens for t in seq}) > 5


def test_chunked_prefill_equals_one_shot_prefill(params):
    prompts = _prompts(TINY, PROMPT_LENS)
    one_shot = _generate(params, prompts, page_size=4)
    chunked = _generate(params, prompts, page_size=4, prefill_chunk=3)
    assert chunked.tokens == one_shot.tokens
    for a, b in zip(chunked.logits, one_shot.logits, strict=True):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5
    _assert_matches_dense(params, prompts, chunked)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_backends_in_interpret_mode_match_dense(backend):
    cfg = dataclasses.replace(TINY, head_dim=64, num_layers=1)  # kernel-friendly shapes
    params = random_params(cfg, seed=2)
    prompts = _prompts(cfg, (11, 3), seed=3)
    # Chunks of 6 over pages of 8: a chunk ending mid-page, then one crossing a page
    # boundary next to a decode row; then decode steps (the decode kernel).
    out = _generate(
        params, prompts, backend=backend, interpret=True, page_size=8, max_new_tokens=3,
        prefill_chunk=6,
    )  # fmt: skip
    _assert_matches_dense(params, prompts, out)


def test_sampling_is_reproducible_per_seed(params):
    prompts = _prompts(TINY, PROMPT_LENS)
    kw = dict(page_size=4, temperature=1.0, top_k=50, top_p=0.95)
    a = _generate(params, prompts, seed=5, **kw)
    b = _generate(params, prompts, seed=5, **kw)
    c = _generate(params, prompts, seed=6, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    greedy = _generate(params, prompts, page_size=4)
    assert a.tokens != greedy.tokens
    # Each sampled token lies in its step's top-50 (the logits are the raw ones).
    for b_, seq in enumerate(a.tokens):
        for i, tok in enumerate(seq):
            assert (a.logits[b_][i] > a.logits[b_][i][tok]).sum() < 50
    # min_p: every draw at least min_p times as likely as the step's top token.
    m = _generate(params, prompts, seed=5, page_size=4, temperature=2.0, min_p=0.2)
    assert m.tokens != a.tokens
    for b_, seq in enumerate(m.tokens):
        for i, tok in enumerate(seq):
            x = m.logits[b_][i] / 2.0
            assert x[tok] >= x.max() + np.log(0.2) - 1e-5


def test_generate_samples_prompt_b_with_seed_plus_b_and_its_token_index(params):
    """generate's draws are the README's hand loop: prompt b's i-th new token sampled
    with seed + b at sample_step i, whatever else is in the batch."""
    prompt = _prompts(TINY, (5,), seed=9)[0]
    kw = dict(page_size=4, temperature=1.0, max_new_tokens=6)
    both = _generate(params, [prompt, prompt], seed=5, **kw)
    assert both.tokens[0] != both.tokens[1]  # one prompt, two seeds
    cc = CacheConfig(page_size=4, num_pages=16, dtype=TINY.dtype)
    for b in range(2):
        cache, toks = cache_lib.create(TINY, cc), []
        while len(toks) < 6:
            fed = toks[-1:] if toks else prompt
            pos = len(prompt) + len(toks) - 1 if toks else 0
            chunk = decode.SeqChunk(
                fed, pos, [1, 2, 3], temperature=1.0, seed=5 + b, sample_step=len(toks)
            )
            inp = decode.build_step_input([chunk], TINY, cc)
            out, cache = decode.step(params, cache, inp, backend="xla")
            toks.append(int(out.tokens[0]))
        assert toks == both.tokens[b], b


def test_min_tokens_bans_stop_tokens_for_exactly_that_many_tokens(params):
    prompt = _prompts(TINY, (5,), seed=9)[0]
    plain = _generate(params, [prompt], page_size=4, max_new_tokens=6).tokens[0]
    # The first token greedy decoding draws only after min_tokens = i others.
    i = next(i for i in range(1, 6) if plain[i] not in plain[:i])
    out = decode.generate(
        params, [prompt], max_new_tokens=6, page_size=4, backend="xla", min_tokens=i,
        stop_token_ids=[plain[i]],
    )  # fmt: skip
    assert out.tokens[0] == plain[: i + 1]  # banned before token i (never drawn), not at i


def test_generation_stops_at_a_stop_token(params):
    prompts = _prompts(TINY, PROMPT_LENS)  # the shapes of the tests above: no new compile
    first = _generate(params, prompts, page_size=4)
    stop = first.tokens[0][2]
    # Every id counts, not only the first (300 is past the vocabulary: never drawn).
    out = _generate(params, prompts, page_size=4, stop_token_ids=(300, stop))
    for b in range(len(prompts)):
        seq = first.tokens[b]
        expected = seq[: seq.index(stop) + 1] if stop in seq else seq
        assert out.tokens[b] == expected
        assert len(out.logprobs[b]) == len(expected)
    assert len(out.tokens[0]) == 3


def test_copy_on_write_is_applied_before_the_step_writes(params):
    """A fork shares the parent's full page and gets a copy of its partial last page."""
    cfg, s = TINY, 4
    # 64 pages and return_logits: the prefill program of the chunked-prefill test.
    cache_cfg = CacheConfig(page_size=s, num_pages=64, dtype="float32")
    cache = cache_lib.create(cfg, cache_cfg)
    prompt = _prompts(cfg, (6,), seed=4)[0]
    inp = decode.build_step_input([decode.SeqChunk(prompt, 0, [5, 9])], cfg, cache_cfg)
    out, cache = decode.prefill_step(params, cache, inp, backend="xla", return_logits=True)
    parent_tok = int(out.tokens[0])
    child_tok = (parent_tok + 1) % cfg.vocab_size  # the child continues differently
    chunks = [
        decode.SeqChunk([parent_tok], 6, [5, 9]),
        decode.SeqChunk([child_tok], 6, [5, 12]),  # page 9 is copied to 12 first
    ]
    inp = decode.build_step_input(chunks, cfg, cache_cfg, copies=[(9, 12)])
    assert inp.decode
    out, cache = decode.decode_step(
        params, cache, inp, backend="xla", num_top_logprobs=3, return_logits=True
    )
    dense = jax.jit(model.forward)(
        params, jnp.asarray([prompt + [parent_tok], prompt + [child_tok]])
    )
    for b in range(2):
        ref = np.asarray(dense[b, -1])
        got = np.asarray(out.logits[b])
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
        np.testing.assert_array_equal(np.asarray(out.top_ids[b]), np.argsort(-ref)[:3])
        lp = ref - np.log(np.exp(ref.astype(np.float64)).sum())
        np.testing.assert_allclose(
            np.asarray(out.top_logprobs[b]), lp[np.argsort(-ref)[:3]], atol=1e-4
        )
        np.testing.assert_allclose(float(out.logprobs[b]), lp[int(out.tokens[b])], atol=1e-4)
    # The parent's page 9 still holds the parent's token, the child's page 12 the child's.
    k_parent, _ = cache_lib.gather_sequence(cache, 1, [5, 9], 7)
    k_child, _ = cache_lib.gather_sequence(cache, 1, [5, 12], 7)
    np.testing.assert_array_equal(np.asarray(k_parent[:6]), np.asarray(k_child[:6]))
    assert float(jnp.abs(k_parent[6] - k_child[6]).max()) > 0


@pytest.mark.parametrize("is_decode", [False, True], ids=["prefill", "decode"])
def test_target_logprobs_score_every_token_against_dense(params, is_decode):
    """With target_ids, every token's target gets its log-probability (and top-k); the
    sampled rows and the cache are what they are without it."""
    cfg, s = TINY, 4
    cache_cfg = CacheConfig(page_size=s, num_pages=64, dtype="float32")
    prompts = _prompts(cfg, (1, 1) if is_decode else (7, 3), seed=6)
    tables = [[3, 8], [5, 6]]
    inp = decode.build_step_input(
        [decode.SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], cfg, cache_cfg
    )
    n_tok = inp.token_ids.shape[0]
    rng = np.random.default_rng(0)
    targets = rng.integers(0, cfg.vocab_size, n_tok).astype(np.int32)
    targets[2::3] = -1  # unwanted rows
    targets[0] = 0  # token id 0 is a target like any other; only -1 is unwanted
    plain, cache = decode.step(params, cache_lib.create(cfg, cache_cfg), inp, backend="xla")
    scored, cache2 = decode.step(
        params,
        cache_lib.create(cfg, cache_cfg),
        dataclasses.replace(inp, target_ids=targets),
        backend="xla",
        num_prompt_top_logprobs=4,
    )
    np.testing.assert_array_equal(np.asarray(scored.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(scored.logprobs), np.asarray(plain.logprobs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache2.k[0]), np.asarray(cache.k[0]), atol=1e-6)
    width = max(len(p) for p in prompts)
    padded = jnp.asarray([p + [0] * (width - len(p)) for p in prompts])
    dense = np.asarray(jax.jit(model.forward)(params, padded))
    starts = np.asarray(inp.query_start_loc)
    got_lp = np.asarray(scored.target_logprobs)
    got_ids, got_top = np.asarray(scored.target_top_ids), np.asarray(scored.target_top_logprobs)
    checked = 0
    for b, p in enumerate(prompts):
        for j in range(len(p)):
            row = starts[b] + j
            ref = dense[b][j].astype(np.float64)
            lp = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
            want = lp[targets[row]] if targets[row] >= 0 else 0.0
            np.testing.assert_allclose(got_lp[row], want, atol=2e-5)
            np.testing.assert_array_equal(got_ids[row], np.argsort(-lp, kind="stable")[:4])
            np.testing.assert_allclose(got_top[row], np.sort(lp)[::-1][:4], atol=2e-5)
            checked += targets[row] >= 0
    assert checked >= 2
    with pytest.raises(ValueError, match="needs a StepInput with target_ids"):
        decode.step(params, cache, inp, backend="xla", num_prompt_top_logprobs=2)


def test_tokens_fed_from_the_previous_step_on_the_device(params):
    """StepInput.feed/token_src: a decode step takes its tokens from the previous step's
    output without a host round trip, and gives the same result as feeding them."""
    cfg, s = TINY, 4
    cache_cfg = CacheConfig(page_size=s, num_pages=64, dtype="float32")
    prompts = _prompts(cfg, (5, 3, 6), seed=8)
    tables = [[1, 2], [3, 4], [5, 6]]
    chunks = [decode.SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    inp = decode.build_step_input(chunks, cfg, cache_cfg)
    feed = np.zeros(16, np.int32)  # F = 16 >= the row bucket
    inp = dataclasses.replace(inp, feed=feed, token_src=np.full(inp.token_ids.shape, -1, np.int32))
    results = []
    for fed in (False, True):
        first, cache = decode.step(params, cache_lib.create(cfg, cache_cfg), inp, backend="xla")
        toks = np.asarray(first.tokens)[:3]
        b = first.tokens.shape[0]  # the row bucket, <= F
        assert np.asarray(first.feed)[:b].tolist() == np.asarray(first.tokens).tolist()
        # Rows in another order than the previous step's: row i feeds sequence order[i].
        order = [2, 0, 1]
        nxt = decode.build_step_input(
            [
                decode.SeqChunk([0 if fed else int(toks[b])], len(prompts[b]), tables[b])
                for b in order
            ],
            cfg,
            cache_cfg,
        )
        src = np.full(nxt.token_ids.shape, -1, np.int32)
        if fed:
            src[:3] = order
        nxt = dataclasses.replace(nxt, feed=first.feed, token_src=src)
        second, cache = decode.step(params, cache, nxt, backend="xla", return_logits=True)
        results.append((np.asarray(second.tokens), np.asarray(second.logits)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)
    dense = np.asarray(jax.jit(model.forward)(params, jnp.asarray([prompts[2] + [int(toks[2])]])))
    np.testing.assert_allclose(results[1][1][0], dense[0, -1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"holds 2 tokens, fewer than the \d+ rows"):
        decode.step(params, cache, dataclasses.replace(nxt, feed=np.zeros(2, np.int32)))
    with pytest.raises(ValueError, match="both or neither"):
        decode.step(params, cache, dataclasses.replace(nxt, feed=None))
    # A feed of exactly one token per row is enough (the same step again: same K/V).
    rows = nxt.context_lens.shape[0]
    exact = dataclasses.replace(nxt, feed=np.asarray(first.feed)[:rows])
    again, cache = decode.step(params, cache, exact, backend="xla")
    np.testing.assert_array_equal(np.asarray(again.tokens), results[1][0])


def test_compile_count_stays_within_the_buckets():
    # A fresh model (no program cached yet); one layer keeps the compiles cheap.
    cfg = dataclasses.replace(TINY, vocab_size=200, num_layers=1)
    params = random_params(cfg, seed=7)
    before = decode.compile_counts()
    runs = [(1, 3), (3, 7), (5, 6), (2, 5), (4, 2)]  # (batch size, prompt length)
    buckets = set()
    for i, (batch, length) in enumerate(runs):
        lens = [max(1, length - j) for j in range(batch)]  # ragged within the batch too
        decode.generate(
            params, _prompts(cfg, lens, seed=i), max_new_tokens=3 + i, page_size=8,
            stop_token_ids=(), backend="xla",
        )  # fmt: skip
        buckets.add(("prefill", decode.bucket_size(sum(lens), decode.Buckets().min_tokens)))
    buckets.add(("decode", decode.Buckets().min_seqs))
    after = decode.compile_counts()
    compiled = sum(after.get(k, 0) - before.get(k, 0) for k in ("prefill_step", "decode_step"))
    assert 0 < compiled <= len(buckets) == 3  # 5 batch shapes, 16 distinct step shapes


@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
def test_steps_update_the_donated_cache_in_place(params, is_decode):
    """Every K/V pool the step returns aliases its donated input, and no pool is copied:
    a missed donation would copy each layer's whole pool on every step."""
    cc = CacheConfig(page_size=8, num_pages=64, dtype=TINY.dtype)
    cache = cache_lib.create(TINY, cc)
    if is_decode:
        chunks = [decode.SeqChunk([5], 10 + i, [2 * i, 2 * i + 1]) for i in range(4)]
        inp = decode.build_step_input(chunks, TINY, cc)
    else:
        chunks = [
            decode.SeqChunk(list(range(3, 20)), 4, [1, 2, 3]),
            decode.SeqChunk([7], 9, [4, 5]),
        ]
        inp = decode.build_step_input(chunks, TINY, cc, copies=[(1, 9)])
    jitted = decode._decode_jit if is_decode else decode._prefill_jit
    text = (
        jitted.lower(params, cache, inp, backend="xla", interpret=False, num_top_logprobs=0,
                     return_logits=False)
        .compile()
        .as_text()
    )  # fmt: skip
    header = text.splitlines()[0]
    aliased = re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", header)
    pools = 2 * TINY.num_layers
    assert len(aliased) == pools, header[:300]
    # Output tuple index -> flat input index: the pools come after params (their leaves).
    n_params = len(jax.tree.leaves(params))
    assert sorted(int(i) for _, i in aliased) == list(range(n_params, n_params + pools))
    pool = f"[{TINY.num_kv_heads},{cc.num_pages},{cc.page_size},{TINY.head_dim}]"
    copies = [ln for ln in text.splitlines() if " copy(" in ln and pool in ln.split("copy(")[0]]
    assert not copies, copies[:3]


def test_step_input_is_padded_to_buckets():
    cfg, cache_cfg = TINY, CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunks = [
        decode.SeqChunk([7, 8, 9], 0, [3], temperature=0.7, top_k=5, top_p=0.9, seed=11),
        decode.SeqChunk([4], 5, [1, 2], sample_step=2),
        decode.SeqChunk(list(range(10)), 4, [6, 7, 8, 9]),
    ]
    inp = decode.build_step_input(chunks, cfg, cache_cfg, copies=[(2, 30)])
    assert inp.bucket == (16, 8, 8, 4, False)
    np.testing.assert_array_equal(inp.query_start_loc, [0, 3, 4, 14, 14, 14, 14, 14, 14])
    np.testing.assert_array_equal(inp.logits_indices[:3], [2, 3, 13])
    np.testing.assert_array_equal(inp.context_lens, [3, 6, 14, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(inp.positions[:4], [0, 1, 2, 5])
    np.testing.assert_array_equal(inp.slot_mapping[:4], [12, 13, 14, 9])
    assert (inp.slot_mapping[14:] == -1).all()
    np.testing.assert_array_equal(
        inp.slot_mapping[4:14], cache_lib.slots_for([6, 7, 8, 9], 4, 14, 4)
    )
    np.testing.assert_array_equal(inp.copy_src, [2, 0, 0, 0])
    np.testing.assert_array_equal(inp.copy_dst, [30, -1, -1, -1])
    np.testing.assert_array_equal(inp.top_k[:4], [5, 0, 0, 0])
    np.testing.assert_array_equal(inp.seeds[:2], [11, 0])
    np.testing.assert_array_equal(inp.sample_steps[:2], [0, 2])
    # Distinct pages per sequence: two tokens of a step may not write one slot.
    dec = decode.build_step_input(
        [decode.SeqChunk([4], 5, [1 + 2 * i, 2 + 2 * i]) for i in range(3)], cfg, cache_cfg
    )
    assert dec.decode and dec.bucket == (8, 8, 8, 4, True)
    big = decode.build_step_input(
        [decode.SeqChunk([1] * 40, 0, list(range(10 * i, 10 * i + 10))) for i in range(9)],
        cfg,
        CacheConfig(page_size=4, num_pages=128, dtype="float32"),
    )
    assert big.bucket == (512, 16, 16, 4, False)


@pytest.mark.parametrize(
    "chunk,kwargs,match",
    [
        (decode.SeqChunk([1, 256], 0, [1]), {}, "token id 256 is outside the vocabulary"),
        (decode.SeqChunk([-1], 0, [1]), {}, "token id -1 is outside the vocabulary"),
        (decode.SeqChunk([1, 2], 511, list(range(1, 32))), {}, "max_position_embeddings"),
        (decode.SeqChunk([1] * 5, 0, [1]), {}, "holds 4 tokens, needs 5"),
        (decode.SeqChunk([1], 0, [32]), {}, "page id 32 is out of range"),
        (decode.SeqChunk([1], 0, [1], temperature=-0.5), {}, "temperature=-0.5"),
        (decode.SeqChunk([1], 0, [1], top_p=0.0), {}, "top_p=0.0"),
        # packed as int32: 2**40 wrapped to a negative top_k (off) with a RuntimeWarning
        (decode.SeqChunk([1], 0, [1], top_k=2**40), {}, r"top_k=1099511627776"),
        (decode.SeqChunk([], 0, [1]), {}, "non-empty"),
        (decode.SeqChunk([1, 2], 0, [1]), {"decode": True}, "one token per sequence"),
        (decode.SeqChunk([1], 0, [1]), {"copies": [(3, 40)]}, r"copy pair \(3, 40\)"),
        (decode.SeqChunk([1], 0, [1]), {"copies": [(3, 4), (5, 4)]}, "distinct"),
    ],
)
def test_build_step_input_rejects_bad_input(chunk, kwargs, match):
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    with pytest.raises(ValueError, match=match):
        decode.build_step_input([chunk], TINY, cache_cfg, **kwargs)


@pytest.mark.parametrize(
    "chunks,kwargs,error,match",
    [
        # Each of these was truncated or flattened without a word.
        ([decode.SeqChunk([1], 2.5, [1])], {}, TypeError, "sequence 0: start_pos must be an int"),
        ([decode.SeqChunk([1], True, [1])], {}, TypeError, "start_pos must be an int"),
        ([decode.SeqChunk([1], 0, [3.7])], {}, TypeError, "sequence 0: page_table must hold"),
        ([decode.SeqChunk([1], 0, [[3]])], {}, ValueError, r"page_table must be 1-D, got shape"),
        ([decode.SeqChunk([1], 0, [1], sample_step=1.5)], {}, TypeError, "sample_step must be"),
        ([decode.SeqChunk([1], 0, [1], sample_step=-1)], {}, ValueError, "sample_step=-1"),
        ([decode.SeqChunk([1], 0, [1])], {"copies": [(1.5, 2)]}, TypeError, "copies must be int"),
        ([decode.SeqChunk([1], 0, [1])], {"copies": [(1, 2, 4)]}, ValueError, "pairs"),
        # Two tokens of one step written to the same cache slot: one overwrites the other.
        (
            [decode.SeqChunk([1, 2], 0, [3]), decode.SeqChunk([4], 1, [3])],
            {},
            ValueError,
            r"sequences 0 and 1 both write cache slot 13 \(positions 1 and 1\)",
        ),
        (
            [decode.SeqChunk([1] * 5, 0, [3, 3])],
            {},
            ValueError,
            r"sequences 0 and 0 both write cache slot 12 \(positions 0 and 4\)",
        ),
        # Packed as int32: sample_step 2**40 wrapped to 0 (step 0's PRNG key again).
        (
            [decode.SeqChunk([1], 0, [1], sample_step=2**40)],
            {},
            ValueError,
            r"sample_step must be in \[0, 2\*\*31\), got sample_step=1099511627776",
        ),
        # Were StopIteration (every value an int, but no int64 array holds them).
        ([decode.SeqChunk([1], 2**70, [1])], {}, ValueError, r"start_pos=1180591620717411303424"),
        # Blamed max_position_embeddings.
        (
            [decode.SeqChunk([1], -1, [1])],
            {},
            ValueError,
            "start_pos must be >= 0, got start_pos=-1",
        ),
        # int() truncated a float token id to another token.
        (
            [decode.SeqChunk([1], 0, [1], logit_bias={3.7: 1.0})],
            {},
            TypeError,
            "logit_bias token ids must be ints, got 3.7",
        ),
        (
            [decode.SeqChunk([1], 0, [1], repetition_penalty=1.2, prompt_ids=[1.5])],
            {},
            TypeError,
            "prompt_ids must be int token ids, got dtype float64",
        ),
        # Was numpy's "could not convert string to float", naming no field.
        (
            [decode.SeqChunk([1], 0, [1], temperature="hot")],
            {},
            ValueError,
            "temperature=.hot.",
        ),
    ],
)
def test_build_step_input_rejects_what_it_used_to_truncate(chunks, kwargs, error, match):
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    with pytest.raises(error, match=match):
        decode.build_step_input(chunks, TINY, cache_cfg, **kwargs)


def test_build_step_input_names_arguments_of_the_wrong_type():
    # Were "object of type 'SeqChunk' has no len()", "'tuple' object has no attribute
    # 'token_ids'" and "'ModelConfig' object has no attribute 'page_size'".
    cc = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunk = decode.SeqChunk([1], 0, [1])
    for args, match in [
        ((chunk, TINY, cc), r"chunks must be a list of SeqChunk .*got SeqChunk\("),
        (([([1], 0, [1])], TINY, cc), r"chunk 0 must be a SeqChunk, got \(\[1\], 0, \[1\]\)"),
        (([chunk], cc, TINY), "a ModelConfig and a CacheConfig, got CacheConfig and ModelConfig"),
    ]:
        with pytest.raises(TypeError, match=match):
            decode.build_step_input(*args)


def test_build_step_input_allows_shared_read_only_pages():
    # A shared prefix page (3) is read by both sequences and written by neither.
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    inp = decode.build_step_input(
        [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 4, [3, 6])], TINY, cache_cfg
    )
    np.testing.assert_array_equal(inp.slot_mapping[:2], [20, 24])


@pytest.mark.parametrize(
    "chunks,window,written,reader",
    [
        # One page twice in a table: position 4 overwrote position 0 (same offset).
        ([decode.SeqChunk([1], 4, [3, 3])], None, (0, 12, 4), (0, 0)),
        # A fork that forgot its copy: both write page 5, each reads the other's slot.
        (
            [decode.SeqChunk([1], 5, [3, 5]), decode.SeqChunk([2], 6, [3, 5])],
            None,
            (0, 21, 5),
            (1, 5),
        ),
        # A page one sequence writes is an earlier page of another.
        (
            [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 8, [5, 3, 6])],
            None,
            (0, 20, 4),
            (1, 0),
        ),
        # Within the window: page 5 holds sequence 1's positions 8..11, all still seen.
        (
            [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 12, [0, 0, 5, 6])],
            8,
            (0, 20, 4),
            (1, 8),
        ),
    ],
)
def test_build_step_input_refuses_to_write_a_page_another_row_reads(
    chunks, window, written, reader
):
    """A page written in a step and read elsewhere in it (another page table, or the same
    one twice) gave the reader the writer's new K/V in place of its own, with no error
    (relative logit error ~0.66 against dense in a two-sequence probe)."""
    cfg = dataclasses.replace(TINY, sliding_window=window)
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    (x, slot, p), (y, q) = written, reader
    match = rf"sequence {x} writes cache slot {slot} \(position {p}\), which sequence {y} reads"
    with pytest.raises(ValueError, match=match + rf" as its position {q}: "):
        decode.build_step_input(chunks, cfg, cache_cfg)


@pytest.mark.parametrize(
    "chunks,window",
    [
        # Page 5 is in sequence 1's table past its length: not read.
        ([decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 4, [3, 6, 5])], None),
        # Window 4: sequence 1 at 12 sees 9..12, not page 5 (4..7) nor the released 0s.
        ([decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 12, [0, 5, 7, 6])], 4),
        ([decode.SeqChunk([1], 0, [0]), decode.SeqChunk([2], 12, [0, 0, 7, 6])], 4),
    ],
)
def test_build_step_input_allows_pages_no_one_reads_where_they_are_written(chunks, window):
    cfg = dataclasses.replace(TINY, sliding_window=window)
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    decode.build_step_input(chunks, cfg, cache_cfg)


def test_build_step_input_takes_numpy_copies_buckets_and_mixed_int_types():
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunks = [decode.SeqChunk([1], 5, [1, 2]), decode.SeqChunk([2], 3, [4])]
    want = decode.build_step_input(chunks, TINY, cache_cfg, copies=[(7, 8)])
    # numpy pairs were "truth value of an array is ambiguous", and numpy ints in Buckets
    # "must be a positive int".
    got = decode.build_step_input(
        chunks, TINY, cache_cfg, copies=np.array([[7, 8]]), buckets=decode.Buckets(np.int64(16))
    )
    for name in ("copy_src", "copy_dst", "positions", "slot_mapping"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert got.bucket == want.bucket
    # uint64 next to a Python int made a float64 array, then a bare StopIteration.
    chunks[0].start_pos = np.uint64(5)
    mixed = decode.build_step_input(chunks, TINY, cache_cfg, copies=np.zeros((0, 2), int))
    np.testing.assert_array_equal(mixed.positions, want.positions)
    np.testing.assert_array_equal(mixed.slot_mapping[:2], [9, 19])


def test_generate_checks_stop_ids_and_bans_only_drawable_ones(params):
    """A stop id past the vocabulary (an EOS of a model with a cut vocabulary) is never
    drawn: min_tokens used to fail on it as a 'logit_bias token id'. A float or negative
    stop id was truncated (1.5 banned token 1) or blamed on logit_bias."""
    kw = dict(max_new_tokens=3, backend="xla", page_size=4, min_tokens=2)
    cut = params.replace(config=dataclasses.replace(TINY, eos_token_ids=(128001,)))
    out = decode.generate(cut, [[1, 2]], **kw)
    assert out.tokens == decode.generate(params, [[1, 2]], stop_token_ids=[300], **kw).tokens
    assert len(out.tokens[0]) == 3
    # A bare id or a nested list raised a bare "'int' object is not iterable" or was
    # flattened.
    for bad in ([1.5], [-1], ["2"], "2", 5, np.int64(5), [[1, 2]]):
        with pytest.raises(ValueError, match=r"must be a list of ints >= 0, got stop_token_ids="):
            decode.generate(params, [[1, 2]], stop_token_ids=bad, **kw)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=1.5), "max_new_tokens must be an int >= 1, got max_new_tokens=1.5"),
        (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1"),
        (dict(max_new_tokens=2, page_size=0), "page_size must be a positive int, got page_size=0"),
        (dict(max_new_tokens=2, prefill_chunk=1.5), "prefill_chunk must be an int >= 1"),
        (dict(max_new_tokens=2, prefill_chunk=0), "prefill_chunk must be an int >= 1, got pre"),
    ],
)
def test_generate_rejects_bad_arguments_before_running(params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode.generate(params, [[1, 2]], **kwargs)


def test_generate_rejects_a_nested_prompt(params):
    # It used to be flattened into one prompt of the nested lists' tokens.
    with pytest.raises(ValueError, match=r"prompt 0 must be a 1-D list of token ids, got shape"):
        decode.generate(params, [[[1, 2], [3, 4]]], max_new_tokens=1)


def test_generate_rejects_bad_prompts_before_running(params):
    before = decode.compile_counts()
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=512"):
        decode.generate(params, [[1] * 510], max_new_tokens=3)
    with pytest.raises(ValueError, match="token id 300 is outside the vocabulary"):
        decode.generate(params, [[1, 2], [3, 300]], max_new_tokens=3)
    with pytest.raises(ValueError, match="non-empty"):
        decode.generate(params, [[1], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="at least one sequence"):
        decode.build_step_input([], TINY, CacheConfig(4, 8))
    assert decode.compile_counts() == before


def test_generate_takes_a_2d_array_and_names_a_flat_prompt(params):
    # A 2-D array was "The truth value of an array ... is ambiguous", a flat list of
    # ints "object of type 'int' has no len()", a Llama module "has no attribute 'config'".
    prompts = [[1, 5, 7, 9], [1, 42, 3, 4]]
    kw = dict(max_new_tokens=2, stop_token_ids=(), backend="xla")
    want = decode.generate(params, prompts, **kw).tokens
    assert decode.generate(params, np.asarray(prompts, np.int64), **kw).tokens == want
    for flat in ([1, 5, 7], np.array([1, 5, 7])):
        with pytest.raises(ValueError, match=r"prompt 0 must be a 1-D .* \(\) \(one prompt\?"):
            decode.generate(params, flat, **kw)
    with pytest.raises(ValueError, match="prompts must be a list of token id lists, got 7"):
        decode.generate(params, 7, **kw)
    with pytest.raises(TypeError, match="params must be a split model.*got Llama"):
        decode.generate(params.merge(), prompts, **kw)


def test_generate_fills_max_position_embeddings_exactly(params):
    short = params.replace(config=dataclasses.replace(TINY, max_position_embeddings=16))
    out = decode.generate(short, [[1] * 13], max_new_tokens=3, page_size=4, backend="xla")
    assert len(out.tokens[0]) == 3  # 13 + 3 = 16 positions: allowed
    with pytest.raises(ValueError, match="prompt 0 has 14 tokens; with max_new_tokens=3"):
        decode.generate(short, [[1] * 14], max_new_tokens=3, page_size=4, backend="xla")


def test_decode_step_rejects_a_prefill_batch(params):
    cache_cfg = CacheConfig(page_size=4, num_pages=8, dtype="float32")
    cache = cache_lib.create(TINY, cache_cfg)
    inp = decode.build_step_input([decode.SeqChunk([1, 2], 0, [1])], TINY, cache_cfg)
    before = decode.compile_counts()
    with pytest.raises(ValueError, match="decode=False"):
        decode.decode_step(params, cache, inp, backend="xla")
    assert decode.compile_counts() == before  # refused on the host, not in a trace


@pytest.mark.parametrize(
    "kwargs,match",
    [
        # These failed inside the trace with jax's own words ("k argument to top_k must
        # be nonnegative", "Shapes must be 1D sequences ...") or blamed target_ids.
        (dict(num_top_logprobs=-1), r"num_top_logprobs must be an int in \[0, 256\].*=-1"),
        (dict(num_top_logprobs=257), r"num_top_logprobs must be .*got num_top_logprobs=257"),
        (dict(num_top_logprobs=1.5), r"num_top_logprobs must be .*got num_top_logprobs=1.5"),
        (dict(num_top_logprobs=True), r"num_top_logprobs must be .*got num_top_logprobs=True"),
        (dict(num_prompt_top_logprobs=-1), r"num_prompt_top_logprobs must be .*=-1"),
    ],
)
def test_steps_check_their_knobs_on_the_host(params, kwargs, match):
    cache_cfg = CacheConfig(page_size=4, num_pages=8, dtype="float32")
    cache = cache_lib.create(TINY, cache_cfg)
    before = decode.compile_counts()
    for tokens in ([1, 2], [1]):
        inp = decode.build_step_input([decode.SeqChunk(tokens, 0, [1])], TINY, cache_cfg)
        with pytest.raises(ValueError, match=match):
            decode.step(params, cache, inp, backend="xla", **kwargs)
    with pytest.raises(TypeError, match="inp must be a StepInput .*, got dict"):
        decode.step(params, cache, {"decode": True}, backend="xla")
    assert decode.compile_counts() == before
    assert not cache.k[0].is_deleted()


@pytest.mark.parametrize(
    "model_changes,cache_cfg,error,match",
    [
        (
            dict(num_layers=1),
            CacheConfig(4, 8, "float32"),
            ValueError,
            r"1 K and 1 V layers; the model has 2",
        ),
        (dict(num_kv_heads=1), CacheConfig(4, 8, "float32"), ValueError, r"K=2 kv heads.*\(1, 8"),
        (dict(head_dim=8), CacheConfig(4, 8, "float32"), ValueError, r"D=16 .*got \(2, 8, 4, 8\)"),
        ({}, CacheConfig(8, 8, "float32"), ValueError, "built for page_size=4, .* page_size=8"),
        ({}, CacheConfig(4, 4, "float32"), ValueError, "built for num_pages=8, .* num_pages=4"),
        ({}, CacheConfig(4, 8, "bfloat16"), TypeError, "a bfloat16 cache for a float32 model"),
    ],
)
def test_steps_refuse_a_cache_of_another_model_or_geometry(
    params, model_changes, cache_cfg, error, match
):
    """A cache made for another model, page size or page count fails on the host, by name,
    and is not donated; before the check, a wrong page size or a short pool ran and wrote
    to the wrong slots (or past the pool)."""
    built_for = CacheConfig(page_size=4, num_pages=8, dtype="float32")
    cache = cache_lib.create(dataclasses.replace(TINY, **model_changes), cache_cfg)
    before = decode.compile_counts()
    for tokens in ([1, 2, 3], [1]):
        inp = decode.build_step_input([decode.SeqChunk(tokens, 0, [7])], TINY, built_for)
        with pytest.raises(error, match=match):
            decode.step(params, cache, inp, backend="xla")
    assert decode.compile_counts() == before
    assert not cache.k[0].is_deleted()


def test_steps_refuse_a_donated_cache_a_module_and_a_bad_backend_on_the_host(params):
    # A donated cache was XLA's "Buffer has been deleted or donated" (prefill) or, after a
    # trace, "Array has been deleted" (decode); a Llama module "has no attribute
    # 'config'"; an unknown backend was refused inside a trace.
    cc = CacheConfig(4, 8, "float32")
    cache = cache_lib.create(TINY, cc)
    first = decode.build_step_input([decode.SeqChunk([1, 2], 0, [7])], TINY, cc)
    _, new = decode.prefill_step(params, cache, first, backend="xla")
    before = decode.compile_counts()
    for tokens in ([1, 2, 3], [1]):
        inp = decode.build_step_input([decode.SeqChunk(tokens, 2, [7, 6])], TINY, cc)
        with pytest.raises(ValueError, match="donated to an earlier step"):
            decode.step(params, cache, inp, backend="xla")
        with pytest.raises(TypeError, match="params must be a split model.*got Llama"):
            decode.step(params.merge(), new, inp, backend="xla")
        with pytest.raises(ValueError, match="backend must be one of .*got backend='cuda'"):
            decode.step(params, new, inp, backend="cuda")
    assert decode.compile_counts() == before
    assert not new.k[0].is_deleted()


def test_steps_refuse_mismatched_k_and_v_pools_and_non_caches(params):
    cc = CacheConfig(4, 8, "float32")
    good = cache_lib.create(TINY, cc)
    inp = decode.build_step_input([decode.SeqChunk([1], 0, [7])], TINY, cc)
    half = cache_lib.create(dataclasses.replace(TINY, num_layers=1), cc)
    bf16 = cache_lib.create(TINY, CacheConfig(4, 8, "bfloat16"))
    wide = cache_lib.create(TINY, CacheConfig(4, 16, "float32"))
    before = decode.compile_counts()
    for cache, error, match in [
        (cache_lib.PagedKVCache(good.k, half.v), ValueError, "2 K and 1 V layers"),
        (cache_lib.PagedKVCache(good.k, bf16.v), ValueError, r"V pools .* bfloat16 differ"),
        (cache_lib.PagedKVCache(good.k, wide.v), ValueError, r"V pools \(2, 16, 4, 16\)"),
        ((good.k, good.v), TypeError, "cache must be a PagedKVCache, got tuple"),
    ]:
        with pytest.raises(error, match=match):
            decode.step(params, cache, inp, backend="xla")
    assert decode.compile_counts() == before
    assert not good.k[0].is_deleted()


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 2, 16, 32])
def test_long_greedy_decode_equals_dense_recompute_sweep(params, page_size):
    prompts = _prompts(TINY, (1, 7, 16, 33, 64), seed=11)
    out = _generate(params, prompts, page_size=page_size, max_new_tokens=40, prefill_chunk=24)
    _assert_matches_dense(params, prompts, out)


@pytest.mark.slow
def test_bf16_paged_decode_tracks_dense():
    cfg = dataclasses.replace(TINY, dtype="bfloat16")
    p32 = random_params(TINY, seed=12)
    p16 = model.params_from_flat(cfg, model.params_to_flat(p32))
    prompts = _prompts(cfg, PROMPT_LENS, seed=13)
    out = _generate(p16, prompts, page_size=8)
    for b, (ref16, ref32) in enumerate(
        zip(_dense_oracle(p16, prompts, out), _dense_oracle(p32, prompts, out), strict=True)
    ):
        got = out.logits[b]
        assert np.isfinite(got).all()
        assert np.linalg.norm(got - ref16) / np.linalg.norm(ref16) < 1e-2
        assert np.linalg.norm(got - ref32) / np.linalg.norm(ref32) < 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_backends_longer_run(backend):
    cfg = dataclasses.replace(TINY, head_dim=64)
    params = random_params(cfg, seed=14)
    prompts = _prompts(cfg, (1, 8, 19, 30), seed=15)
    out = _generate(
        params, prompts, backend=backend, interpret=True, page_size=8, max_new_tokens=12,
        prefill_chunk=10,
    )  # fmt: skip
    _assert_matches_dense(params, prompts, out)
