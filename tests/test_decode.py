"""pagedjax.decode: paged prefill + decode is exact against dense recompute, on every backend.

Also: sampling per seed, stop tokens, copy-on-write, target logprobs, tokens fed on the
device, the steps under the caller's jit, scan and vmap, compiles bounded by the buckets
and the cache donated in place. What
`build_step_input` packs and refuses is in tests/test_step_input.py; what `generate` and
the steps refuse on the host, before tracing, in tests/test_decode_checks.py.
"""

import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import cache as cache_lib
from pagedjax import decode, model, planner
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


# 80: padded to 128 inside the GPU kernels, which run the same calls at 64 (the kernels'
# own tests cover both widths; tests/test_demo_model.py runs them in a model at 32).
@pytest.mark.parametrize("backend, head_dim", [("tpu", 64), ("gpu", 80)])
def test_pallas_backends_in_interpret_mode_match_dense(backend, head_dim):
    cfg = dataclasses.replace(TINY, head_dim=head_dim, num_layers=1)
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


@pytest.mark.parametrize("score_rows", [None, 3], ids=["one-chunk", "3-row-chunks"])
@pytest.mark.parametrize("is_decode", [False, True], ids=["prefill", "decode"])
def test_target_logprobs_score_every_token_against_dense(
    params, is_decode, score_rows, monkeypatch
):
    """With target_ids, every token's target gets its log-probability, rank (and top-k);
    the sampled rows and the cache are what they are without it. `score_rows`: the LM
    head scores 3 rows at a time (`planner.SCORE_ROWS`; the last chunk padded), in a jit
    of its own so the engine's cached trace is not reused."""
    step = decode.step
    if score_rows is not None:
        monkeypatch.setattr(planner, "SCORE_ROWS", score_rows)
        jitted = jax.jit(partial(decode._step, decode=is_decode), static_argnames=decode._STATIC)

        def step(params, cache, inp, **kw):
            kw = dict(interpret=False, num_top_logprobs=0, return_logits=False, **kw)
            return jitted(params, cache, inp, **kw)

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
    plain, cache = step(params, cache_lib.create(cfg, cache_cfg), inp, backend="xla")
    scored, cache2 = step(
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
    got_ranks = np.asarray(scored.target_ranks)
    assert got_lp.shape == got_ranks.shape == (n_tok,) and got_ids.shape == (n_tok, 4)
    checked = 0
    for b, p in enumerate(prompts):
        for j in range(len(p)):
            row = starts[b] + j
            ref = dense[b][j].astype(np.float64)
            lp = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
            want = lp[targets[row]] if targets[row] >= 0 else 0.0
            np.testing.assert_allclose(got_lp[row], want, atol=2e-5)
            if targets[row] >= 0:  # (no ties in random logits: the rank is exact)
                assert got_ranks[row] == 1 + np.sum(lp > lp[targets[row]])
            else:
                assert got_ranks[row] == 0
            np.testing.assert_array_equal(got_ids[row], np.argsort(-lp, kind="stable")[:4])
            np.testing.assert_allclose(got_top[row], np.sort(lp)[::-1][:4], atol=2e-5)
            checked += targets[row] >= 0
    assert checked >= 2
    if score_rows is not None:
        assert n_tok > score_rows and n_tok % score_rows  # several chunks, the last padded
        return
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


def _advance(inp, tokens):
    """The decode `StepInput` of the next step, on the device, as the module docstring
    says: each live row feeds its sampled token at the next position and slot."""
    live = inp.slot_mapping >= 0
    pos = inp.positions + 1
    s = inp.page_size
    page = jnp.take_along_axis(inp.page_table, (pos // s)[:, None], axis=1)[:, 0]
    return dataclasses.replace(
        inp,
        token_ids=jnp.where(live, tokens, 0),
        positions=jnp.where(live, pos, 0),
        slot_mapping=jnp.where(live, page * s + pos % s, -1),
        context_lens=jnp.where(live, inp.context_lens + 1, 0),
        sample_steps=jnp.where(live, inp.sample_steps + 1, 0),
    )


def test_steps_compose_with_jit_scan_and_vmap(params):
    """The module docstring's promise: `jax.jit` around a step (donating the cache), a
    `lax.scan` over decode steps advanced on the device, and `jax.vmap` over stacked
    caches and inputs give the host loop's sampled tokens (seeds and sample steps
    included) and caches."""
    cc = CacheConfig(page_size=4, num_pages=32, dtype=TINY.dtype)
    prompts = _prompts(TINY, (5, 2, 7), seed=21)
    tables = [[1, 2, 3, 4], [6, 7, 8, 9], [11, 12, 13, 14]]
    samp = dict(temperature=1.0, top_k=40)

    def chunks(toks, pos, step):
        return [
            decode.SeqChunk(t, p, row, seed=b, sample_step=step, **samp)
            for b, (t, p, row) in enumerate(zip(toks, pos, tables, strict=True))
        ]

    prefill = decode.build_step_input(chunks(prompts, [0, 0, 0], 0), TINY, cc)
    out, cache = decode.prefill_step(params, cache_lib.create(TINY, cc), prefill, backend="xla")
    first = np.asarray(out.tokens)[:3].tolist()
    host, host_cache = [first], jax.tree.map(jnp.copy, cache)
    for i in range(1, 6):  # the host loop: one build_step_input per decode step
        pos = [len(p) + i - 1 for p in prompts]
        inp = decode.build_step_input(chunks([[t] for t in host[-1]], pos, i), TINY, cc)
        res, host_cache = decode.decode_step(params, host_cache, inp, backend="xla")
        host.append(np.asarray(res.tokens)[:3].tolist())
    assert len({t for row in host for t in row}) > 6  # sampled, not one token forever

    # jax.jit around decode_step, donating the cache: the first decode step.
    second = decode.build_step_input(chunks([[t] for t in first], [5, 2, 7], 1), TINY, cc)
    before = jax.tree.map(jnp.copy, cache)
    jitted = jax.jit(partial(decode.decode_step, backend="xla"), donate_argnums=1)
    res, after = jitted(params, before, second)
    assert np.asarray(res.tokens)[:3].tolist() == host[1]
    assert before.k[0].is_deleted()  # the outer jit's donation; a reuse is refused
    with pytest.raises(ValueError, match="donated to an earlier step"):
        decode.decode_step(params, before, second, backend="xla")

    # lax.scan over the remaining decode steps, advanced on the device.
    def body(carry, _):
        cache, inp = carry
        res, cache = decode.decode_step(params, cache, inp, backend="xla")
        return (cache, _advance(inp, res.tokens)), res.tokens

    scan = jax.jit(lambda c, i: jax.lax.scan(body, (c, i), length=4))
    (scan_cache, _), toks = scan(after, _advance(jax.tree.map(jnp.asarray, second), res.tokens))
    assert np.asarray(toks)[:, :3].tolist() == host[2:]
    for got, want in zip(scan_cache.k + scan_cache.v, host_cache.k + host_cache.v, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)

    # vmap over stacked caches and inputs: two independent runs of the prefill step.
    other = _prompts(TINY, (3, 6, 1), seed=22)
    inps = [prefill, decode.build_step_input(chunks(other, [0, 0, 0], 0), TINY, cc)]
    singles = [
        decode.prefill_step(params, cache_lib.create(TINY, cc), x, backend="xla") for x in inps
    ]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[cache_lib.create(TINY, cc)] * 2)
    step = jax.vmap(lambda c, x: decode.prefill_step(params, c, x, backend="xla"))
    res, caches = step(stacked, jax.tree.map(lambda *xs: jnp.stack(xs), *inps))
    for r, (want, want_cache) in enumerate(singles):
        np.testing.assert_array_equal(np.asarray(res.tokens[r]), np.asarray(want.tokens))
        np.testing.assert_allclose(np.asarray(caches.k[1][r]), want_cache.k[1], atol=1e-6)


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


def test_a_tokens_rank_counts_the_tokens_at_least_as_likely():
    """As vLLM's `batched_count_greater_than`: a token tied with others ranks after
    them all (two tied at the top are both rank 2)."""
    lp = jnp.array([[-1.0, -1.0, -2.0], [-1.0, -0.5, -3.0], [-3.0, -3.0, -3.0]])
    got = decode._ranks(lp, jnp.array([-1.0, -0.5, -3.0]))
    assert got.tolist() == [2, 1, 3]
