"""pagedjax.beam: `BeamSearch` fed only each beam's top `num_candidates` tokens equals a
search over the whole vocabulary, on random toy models (tied log-probabilities, more stop
tokens than beams, vocabularies smaller than the candidate count, every sign of length
penalty)."""

import numpy as np
import pytest
from beam_oracle import whole_vocabulary_search

from pagedjax.beam import BeamSearch, num_candidates


class ToyModel:
    """Log-probabilities of the next token as a function of the generated prefix: random
    logits rounded to a coarse grid, so that ties within and across beams are common,
    some prefixes nearly flat (the walk then takes many candidates from one beam)."""

    def __init__(self, vocab: int, seed: int, grid: float):
        self.vocab, self.seed, self.grid = vocab, seed, grid

    def logprobs(self, prefix: list[int]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        scale = 0.3 if rng.random() < 0.5 else 3.0
        x = np.round(rng.normal(0, scale, self.vocab) / self.grid) * self.grid
        return x - x.max() - np.log(np.exp(x - x.max()).sum())


def top_candidates(row: np.ndarray, k: int):
    """A beam's k most likely tokens, best first, ties to the lower id (as top_k)."""
    order = np.lexsort((np.arange(row.size), -row))[:k]
    return order, row[order]


def run_beam_search(model, width, max_new, stops, length_penalty):
    bs = BeamSearch(width, length_penalty, frozenset(stops), max_new)
    k = min(num_candidates(width, len(stops)), model.vocab)
    beams = [([], 0.0)]
    steps = 0
    while True:
        cands = [top_candidates(model.logprobs(g), k) for g, _ in beams]
        new = bs.select(
            [g for g, _ in beams],
            [s for _, s in beams],
            np.stack([c[0] for c in cands]),
            np.stack([c[1] for c in cands]),
        )
        steps += 1
        assert bs.done == (not new)
        assert len(new) <= width and [x[2] for x in new] == sorted(
            (x[2] for x in new), reverse=True
        )
        if not new:
            break
        for b, tok, total, j in new:
            assert cands[b][0][j] == tok
            assert total == pytest.approx(beams[b][1] + cands[b][1][j])
        beams = [(beams[b][0] + [tok], total) for b, tok, total, _ in new]
    assert steps <= max_new
    return [(h.token_ids, h.cumulative_logprob, h.finish_reason) for h in bs.hyps], bs


CASES = [
    # width, vocab, number of stop ids, max_new, length_penalty, logit grid
    (2, 40, 1, 6, 1.0, 0.5),
    (3, 20, 5, 7, 0.5, 1.0),  # more stop ids than beams
    (4, 9, 3, 5, -1.0, 1.0),  # vocabulary below the candidate count
    (2, 6, 4, 6, 0.0, 2.0),  # nearly all stop tokens, heavy ties
    (3, 30, 0, 5, 2.0, 0.25),
    (5, 50, 2, 8, 1.0, 1.0),
    (3, 12, 4, 9, 1.0, 0.5),  # early stopping with a length penalty
    (2, 15, 3, 9, 2.0, 1.0),
    (3, 12, 2, 9, 100.0, 0.5),  # extreme penalties, still inside the float range
    (3, 12, 2, 9, -100.0, 0.5),
    (5, 3, 1, 4, 1.0, 1.0),  # more beams than tokens: fewer live beams than the width
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(12))
def test_top_k_candidates_equal_the_whole_vocabulary(case, seed):
    width, vocab, num_stops, max_new, length_penalty, grid = case
    rng = np.random.default_rng(seed)
    model = ToyModel(vocab, seed, grid)
    stops = set(rng.choice(vocab, num_stops, replace=False).tolist())
    got, bs = run_beam_search(model, width, max_new, stops, length_penalty)

    def rows(prefixes):
        return [model.logprobs(g) for g in prefixes]

    want = [h[1:] for h in whole_vocabulary_search(rows, width, max_new, stops, length_penalty)]
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
    np.testing.assert_allclose([s for _, s, _ in got], [s for _, s, _ in want], rtol=1e-12)
    for h in bs.hyps:
        assert h.score == pytest.approx(h.cumulative_logprob / len(h.token_ids) ** length_penalty)
        assert (h.finish_reason == "stop") == (h.token_ids[-1] in stops)
        assert len(h.token_ids) <= max_new
        assert all(t not in stops for t in h.token_ids[:-1])
    scores = [h.score for h in bs.hyps]
    assert scores == sorted(scores, reverse=True) and len(scores) <= width
    assert bs.best(2) == bs.hyps[:2]


@pytest.mark.parametrize("length_penalty,max_new", [(1000.0, 50), (-400.0, 50), (301.0, 10)])
def test_a_length_penalty_past_the_float_range_is_refused_when_built(length_penalty, max_new):
    """max_new ** length_penalty past the float range: the search raised OverflowError
    (3 ** 1000.0) or ZeroDivisionError (10 ** -400.0 == 0.0) mid-search, in the engine's
    step, taking the batch's other requests down with it."""
    with pytest.raises(ValueError, match=rf"length_penalty={length_penalty}.*{max_new}"):
        BeamSearch(2, length_penalty, frozenset({0}), max_new)
    BeamSearch(2, length_penalty, frozenset({0}), 1)  # 1 ** anything is 1
    BeamSearch(2, 300.0, frozenset({0}), 10)  # the bound itself


def test_a_nan_length_penalty_is_refused_when_built():
    """Without its own check nan would pass the range check (nan * log10(max_new) > 300
    is False) and make every score nan: no order among hypotheses, no early stop."""
    with pytest.raises(ValueError, match="length_penalty=nan"):
        BeamSearch(2, float("nan"), frozenset({0}), 50)


def test_early_stop_weighs_the_best_new_beam_never_a_stop_token():
    """transformers >= 4.50 (`_check_early_stop_heuristic` on `running_beam_scores[:, :1]`):
    the search ends once the best new beam cannot beat the worst kept hypothesis, even
    where the step's best candidate, here a stop token that just became the best
    hypothesis, would (-2.1 / 2 < -1.0 < -1.1 / 2). Up to 4.49 (`next_scores.max()`) it
    went on with beams (1, 8) and (0, 7)."""
    search = BeamSearch(2, 1.0, frozenset({0}), max_new_tokens=10)
    search._add([1], -1.0, "stop")
    search._add([2], -2.0, "stop")
    top_ids = np.array([[0, 7, 9, 10], [8, 11, 12, 13]])
    top_logprobs = np.array([[-0.1, -3.0, -3.1, -3.2], [-0.6, -3.0, -3.1, -3.2]])
    new = search.select([[5], [6]], [-1.0, -1.5], top_ids, top_logprobs)
    assert [h.score for h in search.hyps] == pytest.approx([-0.55, -1.0])
    assert new == [] and search.done


def test_the_parity_scripts_control_replays_transformers_older_early_stop():
    """scripts/check_hf_beam_parity.py's control search (HF < 4.50: go on while the
    step's best candidate, a stop token too, beats the worst hypothesis) differs from
    ours where a stop token is that candidate: two stop tokens lead step 0 and, at
    length_penalty 2, a longer beam then wins."""
    import importlib
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "scripts"))
    try:
        parity = importlib.import_module("check_hf_beam_parity")  # (no torch needed)
    finally:
        sys.path.pop(0)

    def logprobs(prefixes):  # tokens 0 and 1 stop; 2 and 3 go on; 4 follows 2 surely
        rows = [
            [3.0, 2.9, 2.8, 0.0, -9.0] if len(p) == 1 else [-9, -9, -9, -9, 9.0] for p in prefixes
        ]
        rows = np.asarray(rows)
        return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))

    ours = parity._replay([7], 2, 2.0, 2, 2, [0, 1], logprobs, older_rule=False)
    older = parity._replay([7], 2, 2.0, 2, 2, [0, 1], logprobs, older_rule=True)
    assert [t for t, _ in ours] == [[0], [1]]
    assert [t for t, _ in older] == [[2, 4], [3, 4]]  # (/ 2 ** 2: both beat the stops)
