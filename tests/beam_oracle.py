"""The beam search the engine documents, over whole vocabularies: the oracle of
tests/test_beam.py (toy models) and tests/test_engine_beam.py (the dense model)."""

import numpy as np


def whole_vocabulary_search(logprobs, width, max_new, stops, length_penalty):
    """Every (beam, token) of the vocabulary ranked each step, HF's selection: a stop
    token ranked below `width` is dropped, a hypothesis scores sum / len ** penalty, and
    the search ends early when the best new beam (never a stop token) cannot beat the
    worst kept hypothesis (transformers >= 4.50).

    Args:
      logprobs: the live prefixes (lists of generated ids) -> [n, V] float64 log-probs.
      width, max_new, stops, length_penalty: the search's.

    Returns:
      The finished hypotheses as (score, tokens, sum, reason), best first (an earlier
      equal score first).
    """
    live = [([], 0.0)]
    hyps = []

    def add(tokens, total, reason):
        hyps.append((total / len(tokens) ** length_penalty, tokens, total, reason))
        hyps.sort(key=lambda h: -h[0])
        del hyps[width:]

    for step in range(max_new):
        rows = np.asarray(logprobs([g for g, _ in live]), np.float64)
        ranked = sorted(  # then beam, likelier, lower id
            (
                (s + float(rows[b, t]), b, -float(rows[b, t]), t)
                for b, (_, s) in enumerate(live)
                for t in range(rows.shape[1])
            ),
            key=lambda c: (-c[0], c[1], c[2], c[3]),
        )
        new = []
        for rank, (total, b, _, t) in enumerate(ranked):
            if t in stops:
                if rank < width:
                    add(live[b][0] + [t], total, "stop")
                continue
            new.append((live[b][0] + [t], total))
            if len(new) == width:
                break
        if step + 1 == max_new:
            for g, total in new:
                add(g, total, "length")
            break
        if not new or (
            len(hyps) == width and hyps[-1][0] >= new[0][1] / (step + 1) ** length_penalty
        ):
            break
        live = new
    return hyps
