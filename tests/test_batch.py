"""pagedjax.batch: a request's logit-bias arrays (`request_bias`)."""

import numpy as np
import pytest

from pagedjax.batch import request_bias
from pagedjax.request import SamplingParams


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
