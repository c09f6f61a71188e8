"""pagedjax.scoring: `score` equals the dense model's log-softmax at every token (logprobs,
ranks, top-k), over ragged lengths, prefill chunks, LM heads scored in row chunks and
LoRA slots; bad arguments refused on the host before the cache is allocated.
"""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_helpers import write_peft
from params_helpers import random_params

from pagedjax import decode, lora, model, planner, scoring, sharding
from pagedjax.config import PRESETS
from pagedjax.scoring import ScoreOutput, score

TINY = PRESETS["tiny"]
WIDTH = 32  # the dense reference runs one sequence at a time, right-padded to this


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)


def _seqs(lens, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, n).tolist() for n in lens]  # (never 0: padding)


_forward = jax.jit(model.forward)


def _dense_logprobs(params, seq):
    """[len(seq) - 1, V] float64: log p(. | seq[:i]) at rows i - 1, from the dense forward."""
    buf = np.zeros((1, WIDTH), np.int32)
    buf[0, : len(seq)] = seq
    logits = np.asarray(_forward(params, jnp.asarray(buf))[0, : len(seq) - 1], np.float64)
    return (
        logits
        - logits.max(-1, keepdims=True)
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    )


def _assert_dense(out, refs, seqs, k, atol=2e-5):
    """`out` against the dense model(s) `refs` (one per sequence)."""
    assert len(out.logprobs) == len(out.ranks) == len(seqs)
    for b, (seq, ref) in enumerate(zip(seqs, refs, strict=True)):
        lp = _dense_logprobs(ref, seq)
        n = len(seq) - 1
        want = lp[np.arange(n), seq[1:]]
        assert out.logprobs[b].shape == (n,) and out.logprobs[b].dtype == np.float32
        assert out.ranks[b].shape == (n,) and out.ranks[b].dtype == np.int32
        np.testing.assert_allclose(out.logprobs[b], want, atol=atol, err_msg=f"{b=}")
        # (no ties in random logits: the rank is exact)
        np.testing.assert_array_equal(out.ranks[b], 1 + (lp > want[:, None]).sum(-1))
        np.testing.assert_allclose(out.total_logprob(b), want.sum(), atol=n * atol)
        if not k:
            assert out.top_ids is None and out.top_logprobs is None
            continue
        assert out.top_ids[b].shape == out.top_logprobs[b].shape == (n, k)
        assert out.top_ids[b].dtype == np.int32 and out.top_logprobs[b].dtype == np.float32
        np.testing.assert_array_equal(out.top_ids[b], np.argsort(-lp, -1, kind="stable")[:, :k])
        np.testing.assert_allclose(out.top_logprobs[b], -np.sort(-lp, -1)[:, :k], atol=atol)


def test_scores_equal_the_dense_forward(params):
    """Ragged lengths (one token, mid-page, on and across page boundaries) in one call."""
    seqs = _seqs((1, 5, 8, 9, 17), seed=1)
    out = score(params, seqs, top_k=3, page_size=4, backend="xla")
    assert isinstance(out, ScoreOutput)
    assert out.logprobs[0].shape == (0,) and out.top_ids[0].shape == (0, 3)
    _assert_dense(out, [params] * len(seqs), seqs, k=3)
    # Without top_k: the same logprobs and ranks; the rows of a 2-D array and jax arrays
    # are sequences too; `decode.score` is this one.
    assert decode.score is score and decode.ScoreOutput is ScoreOutput
    rows = np.array([seqs[2], seqs[2][::-1]])
    plain = decode.score(params, rows, page_size=4, backend="xla")
    _assert_dense(plain, [params] * 2, rows.tolist(), k=0)
    again = score(params, [jnp.asarray(seqs[2])], page_size=4, backend="xla")
    np.testing.assert_array_equal(again.logprobs[0], plain.logprobs[0])
    assert typing.get_type_hints(score) and typing.get_type_hints(ScoreOutput)


def test_one_token_sequences_run_nothing(params, monkeypatch):
    """Nothing to score: empty arrays, and no cache or step at all."""

    def no_cache(*args):
        raise AssertionError("allocated a cache")

    monkeypatch.setattr(sharding, "create_cache", no_cache)
    out = score(params, [[7], [9]], top_k=2)
    assert [x.shape for x in out.logprobs + out.top_logprobs] == [(0,), (0,), (0, 2), (0, 2)]
    assert out.total_logprob(1) == 0.0


def test_prefill_chunks_give_the_same_scores(params):
    """A sequence over several steps: each chunk's last token scores the next chunk's
    first; the result is that of one step."""
    seqs = _seqs((13, 7), seed=2)
    whole = score(params, seqs, top_k=2, page_size=4, backend="xla")
    chunked = score(params, seqs, top_k=2, page_size=4, prefill_chunk=5, backend="xla")
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
        for a, b in zip(getattr(whole, name), getattr(chunked, name), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
    _assert_dense(chunked, [params] * 2, seqs, k=2)


def test_a_step_of_more_tokens_than_score_rows(params, monkeypatch):
    """The LM head scores `planner.SCORE_ROWS` (here 3) rows at a time, the last chunk
    padded; in a jit of its own so no cached trace (of the real SCORE_ROWS) is reused."""
    monkeypatch.setattr(planner, "SCORE_ROWS", 3)
    monkeypatch.setattr(decode, "_prefill_jit", decode._jit_step(False))
    seqs = _seqs((11, 6), seed=3)
    traced = decode.compile_counts().get("prefill_step", 0)
    out = score(params, seqs, top_k=2, page_size=8, backend="xla")
    assert decode.compile_counts()["prefill_step"] == traced + 1  # (with SCORE_ROWS = 3)
    _assert_dense(out, [params] * 2, seqs, k=2)


def test_lora_slots_score_with_their_merged_models(params, tmp_path):
    """Each sequence's scores equal the dense forward of its adapter merged into the
    weights (slot 0: the base model)."""
    adapters = {}
    for name, kw in (("all", {}), ("qv", dict(modules=("q_proj", "v_proj"), rank=2))):
        write_peft(tmp_path / name, TINY, **(dict(rank=4, alpha=8, seed=len(name)) | kw))
        adapters[name] = lora.load_adapter(tmp_path / name, TINY)
    weights = lora.create_lora_weights(TINY, max_loras=2, max_lora_rank=4)
    weights = lora.write_slot(lora.write_slot(weights, 1, adapters["all"]), 2, adapters["qv"])
    seqs = _seqs((6, 9, 4), seed=4)
    out = score(params, seqs, page_size=4, backend="xla", lora=weights, lora_slots=[1, 0, 2])
    refs = [lora.merge_adapter(params, adapters["all"]), params]
    refs.append(lora.merge_adapter(params, adapters["qv"]))
    _assert_dense(out, refs, seqs, k=0, atol=2e-4)
    base = _dense_logprobs(params, seqs[0])[np.arange(5), seqs[0][1:]]
    assert np.abs(out.logprobs[0] - base).max() > 1e-3  # the adapter changes the scores


BAD = [
    (dict(sequences=[]), ValueError, "sequences must be a non-empty list of non-empty"),
    (dict(sequences=[[1, 2], []]), ValueError, "sequences must be a non-empty list of non-empty"),
    (dict(sequences="hello"), ValueError, "sequences must be a list of token id lists, got 'hel"),
    (dict(sequences=[5]), ValueError, r"sequence 0 must be a 1-D .* \(one sequence\? pass a"),
    (dict(sequences=[[1], [[1, 2]]]), ValueError, r"sequence 1 must be a 1-D .* shape \(1, 2\)"),
    (dict(sequences=[[1, 2.5]]), TypeError, "sequence 0: token ids must be ints, got dtype float"),
    (dict(sequences=[[1, 2**63]]), ValueError, "sequence 0: token id 9223372036854775808 is out"),
    (dict(sequences=[[1, -(2**70)]]), ValueError, r"sequence 0: token id -1180591620717411303424 "),
    (dict(sequences=[[1], [3, 256]]), ValueError, r"sequence 1: token id 256 is outside the voc"),
    (dict(sequences=[[1, -1]]), ValueError, r"sequence 0: token id -1 is outside the vocabulary"),
    (dict(sequences=[[1], [1] * 513]), ValueError, "sequence 1 has 513 tokens; it exceeds max_po"),
    (dict(top_k=-1), ValueError, r"top_k must be an int in \[0, 256\] .*got top_k=-1"),
    (dict(top_k=257), ValueError, "got top_k=257"),
    (dict(top_k=2.0), ValueError, "got top_k=2.0"),
    (dict(top_k=True), ValueError, "got top_k=True"),
    (dict(page_size=0), ValueError, "page_size must be a positive int, got page_size=0"),
    (dict(page_size=6), ValueError, "page_size must be a power of two, got page_size=6"),
    (dict(prefill_chunk=0), ValueError, "prefill_chunk must be an int >= 1, got prefill_chunk=0"),
    (dict(prefill_chunk=2.5), ValueError, "got prefill_chunk=2.5"),
    (dict(backend="cuda"), ValueError, "backend must be one of .* got backend='cuda'"),
    (dict(interpret="yes"), ValueError, "interpret must be a bool"),
    (dict(buckets={}), TypeError, "buckets must be a Buckets"),
    (dict(kv_cache_dtype="int3"), ValueError, "int3"),
    # These said "dtype must be one of [...]" (not naming kv_cache_dtype, nor "fp8") and
    # numpy's "Cannot interpret '8' as a data type"; text, a ragged nested list and a
    # generator of generators: "shape () (one sequence? ...)" or numpy's "inhomogeneous".
    (dict(kv_cache_dtype="FP8"), ValueError, r"^kv_cache_dtype must be .*'fp8'.*got kv_cac"),
    (dict(kv_cache_dtype=8), ValueError, r"^kv_cache_dtype must be .*got kv_cache_dtype=8"),
    (dict(sequences=["hello"]), ValueError, "sequence 0 must be a list of token ids, got 'hello'"),
    (dict(sequences=[[1], None]), ValueError, "sequence 1 must be a list of token ids, got None"),
    (dict(sequences=[[1, [2, 3]]]), ValueError, r"sequence 0 must be a 1-D .*got \[1, \[2, 3\]\]"),
    (dict(sequences=[iter([1, 2])]), ValueError, "sequence 0 .* got <list_iterator"),
    (dict(lora_slots=[0, 0]), ValueError, "lora_slots needs lora"),
    (dict(lora="adapter"), TypeError, "lora must be a pagedjax.lora.LoRAWeights"),
    (dict(params={"embed": 0}), TypeError, "params must be a split model.*got dict"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD, ids=lambda x: f"{x!r:.40}")
def test_refuses_bad_arguments_before_allocating(params, monkeypatch, kwargs, error, match):
    def no_cache(*args):
        raise AssertionError("allocated a cache")

    monkeypatch.setattr(sharding, "create_cache", no_cache)
    kwargs = dict(params=params, sequences=[[1, 2, 3], [4, 5]]) | kwargs
    with pytest.raises(error, match=match):
        score(kwargs.pop("params"), kwargs.pop("sequences"), **kwargs)


def test_a_2d_jax_array_is_read_back_at_once(params, monkeypatch):
    """Its rows were taken one by one (a device slice and a transfer each: 1.3 s for 4000
    one-token rows, 10x a numpy array's time); now one transfer."""
    rows = jnp.asarray(_seqs((6,) * 4, seed=5))

    def no_rows(self):
        raise AssertionError("iterated a jax array row by row")

    monkeypatch.setattr(type(rows), "__iter__", no_rows)
    out = score(params, rows, page_size=4, backend="xla")
    _assert_dense(out, [params] * 4, np.asarray(rows).tolist(), k=0)


def test_refuses_to_run_under_jit(params, monkeypatch):
    """score is host-driven: traced params were only refused by JAX's "__array__() was
    called on traced array with shape float32[8]" once a whole step had been traced."""
    monkeypatch.setattr(decode, "_prefill_jit", lambda *a, **k: pytest.fail("traced a step"))
    with pytest.raises(TypeError, match="score runs on the host.*got traced params"):
        jax.jit(lambda p: score(p, [[1, 2, 3]], backend="xla").logprobs[0])(params)
    with pytest.raises(TypeError, match="score runs on the host.*got traced sequences"):
        jax.jit(lambda s: score(params, [s], backend="xla").logprobs[0])(jnp.arange(3))


def test_refuses_bad_lora_slots(params):
    weights = lora.create_lora_weights(TINY, max_loras=2, max_lora_rank=4)
    seqs = [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match=r"one slot per prompt \(2\), got 1"):
        score(params, seqs, lora=weights, lora_slots=[1])
    with pytest.raises(ValueError, match=r"lora_slots\[1\] must be an int in \[0, 2\], got 3"):
        score(params, seqs, lora=weights, lora_slots=[0, 3])


def test_module_docstring_example_runs(params):
    """The module docstring's example (on random weights)."""
    out = scoring.score(params, [[1, 5, 7, 9], [1, 42]], top_k=2, backend="xla")
    assert out.logprobs[0].shape == out.ranks[0].shape == (3,)
    assert out.top_ids[1].shape == (1, 2)
    assert np.isclose(out.total_logprob(0), out.logprobs[0].sum(dtype=np.float64))
