"""pagedjax.decode's steps given a `StepInput` that `build_step_input` did not check: one
changed by hand (`dataclasses.replace`, as research code advances a decode input) or
built for another model. Its shapes, dtypes, page ids, slots and token ids are checked
on the host before tracing, naming the field and the value; out-of-range ids used to
run, clamped or dropped by the gathers and scatters, and bad shapes failed inside
tracing with jax's own message. Also: the steps' bool flags refused when not bools,
penalty errors naming the sequence, and a cache threaded by hand through a
sliding-window model's steps against dense recompute.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import cache as cache_lib
from pagedjax import decode, model
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]
CC = CacheConfig(page_size=4, num_pages=16, dtype="float32")


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


def _inputs():
    prefill = decode.build_step_input(
        [decode.SeqChunk([1, 2, 3], 0, [1]), decode.SeqChunk([4], 0, [2])], TINY, CC
    )
    dec = decode.build_step_input(
        [decode.SeqChunk([1], 3, [1]), decode.SeqChunk([4], 1, [2])], TINY, CC
    )
    return prefill, dec


def _replace(inp, name, fn):
    return dataclasses.replace(inp, **{name: fn(np.asarray(getattr(inp, name)))})


def _bad_cases():
    i32 = np.int32
    return [
        # shapes and dtypes: jax failed inside tracing, naming no field
        ("prefill", "positions", lambda a: a[:3], ValueError, r"StepInput.positions .*\(3,\)"),
        ("prefill", "target_ids", lambda a: np.zeros(3, i32), ValueError, "target_ids"),
        ("prefill", "token_ids", lambda a: a.astype(np.float32), TypeError, "token_ids"),
        ("prefill", "context_lens", lambda a: a[:2], ValueError, "context_lens"),
        ("prefill", "query_start_loc", lambda a: a[:-1], ValueError, "query_start_loc"),
        ("prefill", "copy_dst", lambda a: a[:1], ValueError, "copy_dst"),
        ("decode", "token_ids", lambda a: np.zeros(16, i32), ValueError, "token_ids"),
        # values: these ran, clamped or dropped without a word
        (
            "prefill",
            "page_table",
            lambda a: np.where(a == 1, 99, a).astype(i32),
            ValueError,
            r"page_table holds page id 99, .*\[0, 16\)",
        ),  # fmt: skip
        (
            "decode",
            "slot_mapping",
            lambda a: np.where(a >= 0, a + 1000, a).astype(i32),
            ValueError,
            r"slot_mapping holds slot 1007, .*\[-1, 64\)",
        ),  # fmt: skip
        (
            "prefill",
            "token_ids",
            lambda a: np.where(a == 4, 999, a).astype(i32),
            ValueError,
            r"token_ids holds token id 999, .*\[0, 256\)",
        ),  # fmt: skip
        (
            "prefill",
            "target_ids",
            lambda a: np.full(a.shape, 256, i32),
            ValueError,
            r"target_ids holds token id 256",
        ),  # fmt: skip
        (
            "decode",
            "copy_dst",
            lambda a: np.full(a.shape, 16, i32),
            ValueError,
            r"copy_dst holds page id 16",
        ),  # fmt: skip
        (
            "decode",
            "positions",
            lambda a: np.full(a.shape, 512, i32),
            ValueError,
            r"positions holds position 512, .*max_position_embeddings=512",
        ),  # fmt: skip
    ]


@pytest.mark.parametrize(
    "kind,name,fn,error,match", _bad_cases(), ids=[f"{c[0]}-{c[1]}-{i}" for i, c in
                                                    enumerate(_bad_cases())]
)  # fmt: skip
def test_steps_refuse_a_bad_step_input_before_tracing(params, kind, name, fn, error, match):
    prefill, dec = _inputs()
    inp = prefill if kind == "prefill" else dec
    if name == "target_ids" and inp.target_ids is None:
        inp = dataclasses.replace(inp, target_ids=np.full(inp.token_ids.shape, -1, np.int32))
    bad = _replace(inp, name, fn)
    cache = cache_lib.create(TINY, CC)
    before = decode.compile_counts()
    with pytest.raises(error, match=match):
        decode.step(params, cache, bad, backend="xla")
    assert decode.compile_counts() == before
    assert not cache.k[0].is_deleted()  # refused before the cache was donated


def test_steps_still_take_valid_inputs_as_numpy_or_device_arrays(params):
    prefill, dec = _inputs()
    cache = cache_lib.create(TINY, CC)
    out, cache = decode.prefill_step(params, cache, prefill, backend="xla")
    out2, cache = decode.decode_step(params, cache, jax.device_put(dec), backend="xla")
    assert np.asarray(out2.tokens).shape == (8,)


def test_penalty_errors_name_the_sequence():
    ok = decode.SeqChunk([1], 0, [1])
    bad = decode.SeqChunk([1], 0, [2], repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"^sequence 1: repetition_penalty must be"):
        decode.build_step_input([ok, bad], TINY, CC)


@pytest.mark.parametrize("knob", [dict(interpret="no"), dict(return_logits=None)])
def test_steps_refuse_flags_that_are_not_bools(params, knob):
    """interpret="no" ran in interpret mode (a truthy string) and return_logits=None
    compiled a program of its own: each is a static argument of the jitted step."""
    prefill, _ = _inputs()
    before = decode.compile_counts()
    name, value = next(iter(knob.items()))
    with pytest.raises(
        ValueError, match=rf"{name} must be a bool( \(or .*\))?, got {name}={value!r}"
    ):
        decode.step(params, cache_lib.create(TINY, CC), prefill, backend="xla", **knob)
    assert decode.compile_counts() == before


def test_a_cache_threaded_by_hand_through_a_sliding_window_matches_dense():
    """The functional core by hand with a windowed model: chunked prefills next to decode
    rows, pages that fell out of the window released (their entries the null page 0),
    the cache threaded through `step`; every sampled row's logits are dense recompute's."""
    cfg = dataclasses.replace(TINY, num_layers=1, sliding_window=5)
    params = random_params(cfg, seed=3)
    cc = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    cache = cache_lib.create(cfg, cc)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (11, 2, 7)]
    seqs = [list(p) for p in prompts]
    tables = [list(range(1 + 10 * b, 11 + 10 * b)) for b in range(3)]
    done, got = [0, 0, 0], [[] for _ in prompts]  # got: (length, logits) per sample
    for _ in range(8):
        chunks = []
        for b, p in enumerate(prompts):
            toks = p[done[b] : done[b] + 3] if done[b] < len(p) else seqs[b][-1:]
            out_of_window = max(done[b] - cfg.sliding_window + 1, 0) // cc.page_size
            table = [0] * out_of_window + tables[b][out_of_window:]
            chunks.append(decode.SeqChunk(toks, done[b], table))
        inp = decode.build_step_input(chunks, cfg, cc)
        out, cache = decode.step(params, cache, inp, backend="xla", return_logits=True)
        for b, c in enumerate(chunks):
            done[b] += len(c.token_ids)
            if done[b] >= len(prompts[b]):  # a real sample: the next token
                got[b].append((done[b], np.asarray(out.logits[b])))
                seqs[b].append(int(out.tokens[b]))
    width = max(map(len, seqs))
    batch = np.zeros((3, width), np.int32)
    for b, s in enumerate(seqs):
        batch[b, : len(s)] = s
    dense = np.asarray(model.forward(params, jnp.asarray(batch)))
    for b in range(3):
        assert len(got[b]) >= 4
        for n, logits in got[b]:
            ref = dense[b, n - 1]
            assert np.linalg.norm(logits - ref) / np.linalg.norm(ref) < 1e-5, (b, n)
            assert int(np.argmax(logits)) == seqs[b][n]
