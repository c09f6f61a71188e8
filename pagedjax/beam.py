"""Beam search on the host: the candidate selection of one step, as in HF transformers.

The device returns, for every live beam, its `k` most likely next tokens with their
log-probabilities (`StepOutput.top_ids` / `top_logprobs`). `BeamSearch.select` turns
them into the next beams; the engine keeps beams as block-manager forks (a beam chosen
`c` times is forked `c - 1` times, a beam chosen zero times is freed), so surviving
beams share every page of their common prefix.

One step with beam width `W`, every beam holding `g` generated tokens:

1. Candidates are all (beam, token) pairs, ranked by the new sum of log-probabilities
   (ties: lower beam index, then the more likely token).
2. Walking down that ranking: a stop token (EOS unless ignored, or a
   `stop_token_ids` entry) among the first `W` candidates ends a hypothesis; further
   down it is skipped. Any other candidate becomes a new beam, until `W` beams.
3. A hypothesis scores `logprob_sum / length ** length_penalty`, `length` counting
   the generated tokens including the stop token (HF's `length_penalty`: > 0 favours
   longer outputs, < 0 shorter). The best `W` hypotheses are kept.
4. The search ends when the beams reach `max_new_tokens` (they become hypotheses,
   finish reason "length"), when no beam is left, or, once `W` hypotheses exist,
   when the best new beam (never a stop token: HF's `running_beam_scores[:, :1]`)
   scores `sum / (g + 1) ** length_penalty` no better than the worst kept hypothesis
   (HF's `early_stopping=False` heuristic, `_check_early_stop_heuristic`).

This is transformers' beam search since 4.50 (the vectorised `_beam_search`), sequence
for sequence and score for score: scripts/check_hf_beam_parity.py compares the engine
with `generate(num_beams=...)`. Up to 4.49 (`BeamSearchScorer`) step 4 weighed the
step's best candidate, a stop token too (`next_scores.max()`), so it went on where a
stop token was that candidate and could still win; with `length_penalty > 0` the two
can differ (4.49 may find longer hypotheses), with `<= 0` they cannot. Among
hypotheses of exactly equal score the earlier one ranks first and is kept (4.49 keeps
the later one; 4.50 leaves it to `torch.topk`).

`k = num_candidates(W, num_stop_ids)` candidates per beam are enough for this to
match a search over the whole vocabulary: the walk stops after `W` non-stop candidates,
so it never reaches past any beam's own top `W + (number of stop tokens)`.

`length ** length_penalty` must stay well inside the float range for every length up to
`max_new_tokens` (`|length_penalty| * log10(max_new_tokens) <= 300`): past it a score
cannot be computed (`3 ** 1000.0` raises OverflowError, `10 ** -400.0` is 0.0 and the
division raises ZeroDivisionError, both mid-search), so `BeamSearch` refuses such a
penalty when it is built (ValueError).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

__all__ = ["BeamSearch", "Hypothesis", "num_candidates"]

# Bound on log10(length ** |length_penalty|): scores (sums of logprobs, far below 1e8
# in size) divided by the normaliser stay finite and nonzero.
MAX_LOG10_NORMALISER = 300


def num_candidates(width: int, num_stop_ids: int) -> int:
    """Candidates per beam a step needs (see the module docstring)."""
    return max(2 * width, width + num_stop_ids)


@dataclasses.dataclass(slots=True)
class Hypothesis:
    """A finished beam: generated tokens (stop token included), its score and why it ended."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" | "length"
    logprobs: list[dict[int, float]] | None = None  # per token, when asked for


@dataclasses.dataclass(slots=True)
class BeamSearch:
    """State of one request's beam search between steps.

    Attributes:
      width: beams kept (W).
      length_penalty: exponent of the length normaliser.
      stop_ids: tokens that end a hypothesis.
      max_new_tokens: generated tokens after which every beam ends.
      hyps: the best finished hypotheses so far, best first (at most W).
      done: no further step is needed.
    """

    width: int
    length_penalty: float
    stop_ids: frozenset
    max_new_tokens: int
    hyps: list[Hypothesis] = dataclasses.field(default_factory=list)
    done: bool = False

    def __post_init__(self):
        lp, m = self.length_penalty, self.max_new_tokens
        if not math.isfinite(lp) or abs(lp) * math.log10(max(m, 1)) > MAX_LOG10_NORMALISER:
            raise ValueError(
                f"length_penalty={lp!r} is out of range for max_new_tokens={m}: "
                f"{m} ** {lp!r} leaves the float range (need |length_penalty| * "
                f"log10(max_new_tokens) <= {MAX_LOG10_NORMALISER})"
            )

    def score(self, logprob_sum: float, length: int) -> float:
        return logprob_sum / length**self.length_penalty

    def _add(self, token_ids: list[int], logprob_sum: float, reason: str, logprobs=None) -> None:
        score = self.score(logprob_sum, len(token_ids))
        h = Hypothesis(token_ids, logprob_sum, score, reason, logprobs)
        self.hyps.append(h)
        self.hyps.sort(key=lambda x: -x.score)  # stable: an earlier equal score stays first
        del self.hyps[self.width :]

    def select(
        self,
        generated: list[list[int]],
        sums: list[float],
        top_ids: np.ndarray,
        top_logprobs: np.ndarray,
        logprobs: list[list[dict]] | None = None,
        entry: Callable[[int, int], dict] | None = None,
    ) -> list[tuple[int, int, float, int]]:
        """One step: the next beams as (parent beam index, token, new logprob sum, index
        of the token among the parent's candidates).

        Args:
          generated: each live beam's generated tokens (equal lengths).
          sums: each beam's sum of log-probabilities.
          top_ids: [beams, k] int each beam's most likely next tokens, best first.
          top_logprobs: [beams, k] float their log-probabilities.
          logprobs: each beam's per-token logprobs entries, to extend into the
            hypotheses (with `entry(beam, j)`: the entry of candidate j of that beam).

        Returns:
          The new beams, best first; empty when the search is done. Sets `done`.
        """
        total = np.asarray(sums, np.float64)[:, None] + np.asarray(top_logprobs, np.float64)
        nb, k = total.shape
        order = np.lexsort((np.tile(np.arange(k), nb), np.repeat(np.arange(nb), k), -total.ravel()))
        length = len(generated[0]) + 1
        new: list[tuple[int, int, float, int]] = []
        for rank, flat in enumerate(order.tolist()):
            b, j = divmod(flat, k)
            tok, s = int(top_ids[b, j]), float(total[b, j])
            if tok in self.stop_ids:
                if rank < self.width:
                    self._add([*generated[b], tok], s, "stop", _extend(logprobs, entry, b, j))
                continue
            new.append((b, tok, s, j))
            if len(new) == self.width:
                break
        if length >= self.max_new_tokens:
            for b, tok, s, j in new:
                self._add([*generated[b], tok], s, "length", _extend(logprobs, entry, b, j))
            new = []
        elif (
            new
            and len(self.hyps) >= self.width
            and self.hyps[-1].score >= self.score(new[0][2], length)
        ):
            new = []  # not even the best new beam beats the worst kept hypothesis
        self.done = not new
        return new

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses, best first."""
        return self.hyps[:n]


def _extend(logprobs, entry, b: int, j: int) -> list[dict] | None:
    return None if logprobs is None else [*logprobs[b], entry(b, j)]
