"""pagedjax.batch: a request's logit-bias arrays (`request_bias`); pagedjax.step_input:
the bucketing, bounds and padding rows of `build_step_input`, the packing both share."""

import dataclasses

import numpy as np
import pytest

from pagedjax import decode
from pagedjax.batch import request_bias
from pagedjax.config import PRESETS, CacheConfig
from pagedjax.request import SamplingParams

TINY = PRESETS["tiny"]  # vocab 256, max_position_embeddings 512


def as_dict(arrays):
    ids, values = arrays
    assert ids.dtype == np.int32 and values.dtype == np.float32
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


@pytest.mark.parametrize("seed", range(5))
def test_bias_and_banned_stop_ids(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(50, 5000))
    bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, 6)}
    # Stop ids past the vocabulary (never sampled) are legal: beyond int32 too.
    stop = {int(t) for t in rng.integers(0, vocab, 4)}
    stop |= {vocab + int(rng.integers(0, 100)), 2**31 + int(rng.integers(0, 2**40))}
    sp = SamplingParams(
        logit_bias=bias or None, min_tokens=int(rng.integers(1, 5)), stop_token_ids=sorted(stop)
    )
    got_bias, banned = request_bias(sp, frozenset(stop), vocab)
    assert as_dict(got_bias) == pytest.approx(bias)
    want = bias | {t: float("-inf") for t in stop if t < vocab}
    assert as_dict(banned) == pytest.approx(want)


def test_min_tokens_alone_bans_only_the_stop_ids_in_the_vocabulary():
    rng = np.random.default_rng(9)
    vocab = int(rng.integers(100, 1000))
    stop = frozenset({2, int(rng.integers(3, vocab)), 2**31, 2**63})
    bias, banned = request_bias(SamplingParams(min_tokens=2), stop, vocab)
    assert bias is None
    assert as_dict(banned) == {t: float("-inf") for t in stop if t < vocab}
    assert request_bias(SamplingParams(), stop, vocab) == (None, None)


def test_bias_outside_the_vocabulary_is_a_value_error():
    with pytest.raises(ValueError, match=r"\[300\]"):
        request_bias(SamplingParams(logit_bias={5: 1.0, 300: 2.0}), frozenset(), 300)


def test_bucket_size_is_the_smallest_power_of_two_above_n_and_the_floor():
    for floor in (1, 3, 8, 16):
        for n in range(0, 130):
            want = 1
            while want < max(n, floor):
                want *= 2
            assert decode.bucket_size(n, floor) == want, (n, floor)
    with pytest.raises(ValueError, match="min_tokens must be a positive int, got min_tokens=0"):
        decode.Buckets(min_tokens=0)


def test_build_step_input_takes_the_last_position_and_sample_step():
    cache_cfg = CacheConfig(page_size=64, num_pages=16, dtype="float32")
    pages = list(range(8))  # 512 tokens: max_position_embeddings
    ok = decode.SeqChunk([1, 2], 510, pages, temperature=1.0, sample_step=2**31 - 1)
    inp = decode.build_step_input([ok], TINY, cache_cfg)
    assert inp.context_lens[0] == 512 and inp.sample_steps[0] == 2**31 - 1
    with pytest.raises(ValueError, match=r"positions \[511, 513\) exceed"):
        decode.build_step_input([decode.SeqChunk([1, 2], 511, pages)], TINY, cache_cfg)
    with pytest.raises(ValueError, match=f"sample_step={2**31}"):  # int32 would wrap
        decode.build_step_input([dataclasses.replace(ok, sample_step=2**31)], TINY, cache_cfg)


def test_build_step_input_padding_rows_are_greedy_and_untruncated():
    # Padding rows must not switch on the sampler's Gumbel draw or its sort.
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunk = decode.SeqChunk([5], 3, [1], temperature=0.9, top_k=3, top_p=0.5, min_p=0.1)
    inp = decode.build_step_input([chunk], TINY, cache_cfg)
    assert inp.temperature.shape == (8,)
    assert (inp.temperature[1:] == 0).all() and (inp.top_k[1:] == 0).all()
    assert (inp.top_p[1:] == 1).all() and (inp.min_p[1:] == 0).all()


def test_build_step_input_rejects_a_copy_chain():
    # (3 -> 4, 4 -> 5) depends on the order the device applies the copies in.
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunk = decode.SeqChunk([1], 0, [1])
    with pytest.raises(ValueError, match="distinct and not sources"):
        decode.build_step_input([chunk], TINY, cache_cfg, copies=[(3, 4), (4, 5)])


def test_build_step_input_lets_a_window_drop_the_position_just_below_it():
    # Window 4: sequence 1's query at 12 sees positions 9..12 (p - W < j <= p), so page 5
    # offset 0 (its position 8) may be written by sequence 0 (its position 4).
    cfg = dataclasses.replace(TINY, sliding_window=4)
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunks = [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 12, [0, 0, 5, 6])]
    inp = decode.build_step_input(chunks, cfg, cache_cfg)
    np.testing.assert_array_equal(inp.slot_mapping[:2], [20, 24])
    with pytest.raises(ValueError, match="which sequence 1 reads as its position 8"):
        decode.build_step_input(chunks, dataclasses.replace(cfg, sliding_window=5), cache_cfg)
