"""The functional step API as a JAX researcher composes it, and what its host checks take.

The composition claims of `pagedjax.decode`'s docstring, on the tiny preset: a
`lax.scan` of decode steps (on the Pallas GPU kernel in the interpreter too) equals the
host loop token for token, a `jax.vmap` over two stacked decode caches and inputs equals
two separate calls, and a `jax.jit` around prefill then decode equals the eager calls;
under a bare `vmap` the stacked cache is donated, under an outer `jit` only when it
donates it. And a numpy `StepInput` changed by hand so that a row's tokens are not where
its context says (a slot in a page the row does not own, a context shorter than its
tokens, positions that disagree with it, padding that writes), or with an id that a
gather clamps or a scatter drops, or an int64 value that int32 would wrap, is refused on
the host by name: each ran, writing over another sequence's tokens or attending to the
wrong ones, without a word.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params
from test_decode import _advance

from pagedjax import cache as cache_lib
from pagedjax import decode, sampling
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]
CC = CacheConfig(page_size=4, num_pages=32, dtype="float32")
TABLES = [[1, 2, 3, 4], [6, 7, 8, 9]]
SAMPLING = dict(temperature=1.0, top_k=40)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


def _chunks(toks, pos, step):
    return [
        decode.SeqChunk(t, p, row, seed=b, sample_step=step, **SAMPLING)
        for b, (t, p, row) in enumerate(zip(toks, pos, TABLES, strict=True))
    ]


def _host_loop(params, prompts, steps, **kw):
    """Prefill, then `steps` decode steps each built on the host: (tokens per step,
    the cache after the prefill, the first decode StepInput, the final cache)."""
    prefill = decode.build_step_input(_chunks(prompts, [0] * len(prompts), 0), TINY, CC)
    out, cache = decode.prefill_step(params, cache_lib.create(TINY, CC), prefill, **kw)
    after_prefill = jax.tree.map(jnp.copy, cache)
    toks = [np.asarray(out.tokens)[: len(prompts)].tolist()]
    first = None
    for i in range(1, steps + 1):
        pos = [len(p) + i - 1 for p in prompts]
        inp = decode.build_step_input(_chunks([[t] for t in toks[-1]], pos, i), TINY, CC)
        first = inp if first is None else first
        res, cache = decode.decode_step(params, cache, inp, **kw)
        toks.append(np.asarray(res.tokens)[: len(prompts)].tolist())
    return toks, after_prefill, first, cache


@pytest.mark.parametrize(
    "kw", [dict(backend="xla"), dict(backend="gpu", interpret=True)], ids=["xla", "gpu"]
)
def test_a_scan_of_decode_steps_equals_the_host_loop(params, kw):
    prompts = [[5, 9, 11, 3, 7], [8, 2]]
    toks, cache, first, want_cache = _host_loop(params, prompts, 3, **kw)

    def body(carry, _):
        cache, inp = carry
        res, cache = decode.decode_step(params, cache, inp, **kw)
        return (cache, _advance(inp, res.tokens)), res.tokens

    run = jax.jit(lambda c, i: jax.lax.scan(body, (c, i), length=3), donate_argnums=0)
    (got_cache, _), got = run(cache, jax.tree.map(jnp.asarray, first))
    assert np.asarray(got)[:, :2].tolist() == toks[1:]
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_vmap_over_two_stacked_decode_caches_equals_two_calls(params):
    runs = [[[5, 9, 11, 3, 7], [8, 2]], [[4, 4, 4], [1, 2, 3, 4, 5, 6]]]
    singles, caches, inps = [], [], []
    for prompts in runs:
        toks, cache, inp, _ = _host_loop(params, prompts, 1, backend="xla")
        singles.append(toks[1])
        caches.append(cache)
        inps.append(inp)
    stack = partial(jax.tree.map, lambda *xs: jnp.stack(xs))
    step = jax.vmap(lambda c, x: decode.decode_step(params, c, x, backend="xla"))
    res, _ = step(stack(*caches), stack(*inps))
    assert [np.asarray(res.tokens[r])[:2].tolist() for r in range(2)] == singles


def test_jit_around_prefill_then_decode_equals_the_eager_calls(params):
    prompts = [[5, 9, 11, 3, 7], [8, 2]]
    toks, *_ = _host_loop(params, prompts, 1, backend="xla")
    prefill = decode.build_step_input(_chunks(prompts, [0, 0], 0), TINY, CC)
    second = decode.build_step_input(_chunks([[0], [0]], [5, 2], 1), TINY, CC)

    @jax.jit
    def both(cache, prefill, second):
        out, cache = decode.prefill_step(params, cache, prefill, backend="xla")
        res, cache = decode.decode_step(
            params, cache, dataclasses.replace(second, token_ids=out.tokens), backend="xla"
        )
        return out.tokens, res.tokens

    first, nxt = both(cache_lib.create(TINY, CC), prefill, second)
    assert [np.asarray(first)[:2].tolist(), np.asarray(nxt)[:2].tolist()] == toks


def test_a_bare_vmap_donates_the_stacked_cache_and_an_outer_jit_only_if_it_donates(params):
    """As the module docstring says: under an outer trace the cache is donated as that
    trace donates it. A bare `vmap` runs the step's own jit, which donates; a reuse is
    then jax's "deleted or donated" error, not garbage."""
    inp = decode.build_step_input(_chunks([[5, 9, 11], [8, 2]], [0, 0], 0), TINY, CC)
    stack = partial(jax.tree.map, lambda *xs: jnp.stack(xs))
    stacked, inps = stack(*[cache_lib.create(TINY, CC)] * 2), stack(inp, inp)
    step = jax.vmap(lambda c, x: decode.prefill_step(params, c, x, backend="xla"))
    step(stacked, inps)
    assert stacked.k[0].is_deleted()
    with pytest.raises(ValueError, match="deleted or donated"):
        step(stacked, inps)
    cache = cache_lib.create(TINY, CC)
    jax.jit(partial(decode.prefill_step, backend="xla"))(params, cache, inp)
    assert not cache.k[0].is_deleted()  # the outer jit did not donate it: both live
    decode.prefill_step(params, cache, inp, backend="xla")
    assert cache.k[0].is_deleted()


def _prefill_input():
    """Two prompts (9 and 3 tokens) in pages [1, 2, 3] and [6]; page size 4."""
    chunks = [decode.SeqChunk(list(range(3, 12)), 0, [1, 2, 3]), decode.SeqChunk([5, 6, 7], 0, [6])]
    return decode.build_step_input(chunks, TINY, CC)


def _decode_input():
    chunks = [decode.SeqChunk([5], 9, [1, 2, 3]), decode.SeqChunk([6], 3, [6])]
    return decode.build_step_input(chunks, TINY, CC)


def _set(inp, name, index, value):
    x = getattr(inp, name).copy()
    x[index] = value
    return dataclasses.replace(inp, **{name: x})


@pytest.mark.parametrize(
    "make, match",
    [
        # Token 4 (row 0, position 4) written into page 6, row 1's: its tokens overwritten.
        (lambda: _set(_prefill_input(), "slot_mapping", 4, 6 * 4), r"slot_mapping\[4\] is 24"),
        # Row 0's context shorter than its 9 tokens this step.
        (lambda: _set(_prefill_input(), "context_lens", 0, 5), r"context_lens\[0\] is 5"),
        # Row 0's context one longer: its tokens at cache positions 1..9, not 0..8.
        (lambda: _set(_prefill_input(), "context_lens", 0, 10), r"positions\[0\] is 0"),
        (lambda: _set(_prefill_input(), "positions", 3, 7), r"positions\[3\] is 7"),
        (lambda: _set(_prefill_input(), "query_start_loc", 1, 13), r"query_start_loc"),
        (lambda: _set(_prefill_input(), "query_start_loc", 0, 1), r"query_start_loc"),
        # A padding token that writes a slot (of row 1's page).
        (lambda: _set(_prefill_input(), "slot_mapping", 12, 25), r"slot_mapping\[12\] is 25"),
        (lambda: _set(_decode_input(), "slot_mapping", 0, 5), r"slot_mapping\[0\] is 5"),
        (lambda: _set(_decode_input(), "context_lens", 1, 2), r"positions\[1\] is 3"),
        # A padding row of a decode step (context 0) whose token writes a slot.
        (lambda: _set(_decode_input(), "slot_mapping", 2, 30), r"slot_mapping\[2\] is 30"),
    ],
)
def test_a_row_whose_tokens_are_not_where_its_context_says_is_refused(params, make, match):
    """Each of these ran: the slot written in another row's page, or attention reading
    the row's tokens at cache positions other than those written."""
    inp = make()
    step = decode.decode_step if inp.decode else decode.prefill_step
    with pytest.raises(ValueError, match=match):
        step(params, cache_lib.create(TINY, CC), inp, backend="xla")


def test_consistent_inputs_by_hand_still_run(params):
    """Inputs where every row's tokens are where its context says run; a token may write
    nothing (slot -1: the engine's row of a sequence gone before its step keeps its
    context, position 0); int64 positions and uint8 token ids run as the int32 ones."""

    def tokens(step, inp):
        out, _ = step(params, cache_lib.create(TINY, CC), inp, backend="xla")
        return np.asarray(out.tokens)[:2].tolist()

    want = tokens(decode.prefill_step, _prefill_input())
    inp = _set(_prefill_input(), "slot_mapping", 11, -1)
    tokens(decode.prefill_step, inp)
    inp = _prefill_input()
    inp = dataclasses.replace(
        inp, positions=inp.positions.astype(np.int64), token_ids=inp.token_ids.astype(np.uint8)
    )
    assert tokens(decode.prefill_step, inp) == want
    gone = _set(_set(_decode_input(), "slot_mapping", 1, -1), "positions", 1, 0)
    tokens(decode.decode_step, gone)


def _wide(name, value):
    """A numpy int64 StepInput field whose row 0 holds `value` (jax, without x64, makes it
    int32: a value past it wraps)."""

    def make(inp):
        x = getattr(inp, name).astype(np.int64)
        x[0] = value
        return dataclasses.replace(inp, **{name: x})

    return make


def _penalised(inp):
    ids = np.full((8, 64), -1, np.int32)
    ids[0, :2] = [5, 300]  # 300: past the 256-token vocabulary, dropped by the scatter
    pen = sampling.Penalties(
        np.ones(8, np.float32), np.ones(8, np.float32), np.zeros(8, np.float32), ids,
        np.zeros(8, np.int32),
    )  # fmt: skip
    return dataclasses.replace(inp, penalties=pen)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda inp: dataclasses.replace(
                inp, token_src=np.full(16, 9, np.int32), feed=np.zeros(8, np.int32)
            ),
            r"token_src holds feed index 9",
        ),
        (
            lambda inp: dataclasses.replace(
                inp,
                copy_src=np.array([4, 5, 0, 0], np.int32),
                copy_dst=np.array([7, 7, -1, -1], np.int32),
            ),
            "copy_dst.*distinct",
        ),
        (
            lambda inp: dataclasses.replace(
                inp,
                copy_src=np.array([4, 5, 0, 0], np.int32),
                copy_dst=np.array([5, 8, -1, -1], np.int32),
            ),
            "page 5 is both",
        ),
        (_penalised, r"penalties.ids holds token id 300"),
        (_wide("seeds", 2**32 + 5), r"seeds holds 4294967301"),
        (_wide("sample_steps", 2**32 + 1), r"sample_steps holds 4294967297"),
        (_wide("top_k", -(2**40)), r"top_k holds -1099511627776"),
    ],
)
def test_ids_a_gather_clamps_a_scatter_drops_or_int32_wraps_are_refused(params, make, match):
    """Each ran: token_src past the feed read its last token, a copy pair's outcome
    hung on the order of the copies, a history id past the vocabulary was dropped, and a
    seed past uint32 sampled as another seed."""
    with pytest.raises(ValueError, match=match):
        decode.prefill_step(params, cache_lib.create(TINY, CC), make(_prefill_input()))
