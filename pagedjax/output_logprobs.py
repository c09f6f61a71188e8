"""The logprobs entries of outputs (`pagedjax.outputs`): a sampled token's and a prompt
token's `{token: Logprob}`, their tokens named lazily.

`logprobs_entry` builds one position's entry from a step's top-k arrays: the token
itself first, then the k most likely; its `Logprob`s' decoded tokens are decoded
together on the first access of one (`_TokenTexts`, `tokenizer.token_names`), named
after the ids before the position (`LogprobsMixin._names`: `tokenizer.name_context`).
`LogprobsMixin._token_logprobs` appends a sampled token's entry to its sequence;
`_prompt_logprobs` records the prompt logprobs a step computed into the requests' lists
(chunked prefill rows included), and lets a request read the prefix cache again once
every entry is in. (Beam search's entries: `outputs.OutputProcessor._beam_step`.)

`LogprobsMixin` is a base of `outputs.OutputProcessor` (it reads the processor's
`tokenizer`), apart from it because logprobs are a record of what the step computed,
where `outputs` applies the sampled tokens (stop checks, beam selection) and builds the
outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedjax.request import Logprob
from pagedjax.sequence import Sequence as Seq
from pagedjax.sequence import StepPlan
from pagedjax.tokenizer import name_context, token_names

if TYPE_CHECKING:
    from pagedjax.outputs import Request

__all__ = ["LogprobsMixin", "logprobs_entry"]


class LogprobsMixin:
    """`outputs.OutputProcessor`'s logprobs: sampled and prompt tokens' entries, named."""

    def _token_logprobs(
        self, req: Request, s: Seq, tok: int, lp: float, top_ids, top_lps, ranks, row: int
    ) -> None:
        """Appends the logprobs entry of `s`'s sampled token `tok` (logprob `lp`; row `row`
        of the step's top-k arrays [B, k'] and ranks [B]), if `s` keeps logprobs."""
        if s.logprobs is not None:
            k = req.params.logprobs
            rank = None if ranks is None else int(ranks[row])
            names = self._names(req, s.token_ids, len(s.token_ids))
            entry = logprobs_entry(tok, lp, k, top_ids, top_lps, row, rank=rank, names=names)
            s.logprobs.append(entry)

    def _prompt_logprobs(self, plan: StepPlan, target_lps, top_ids, top_lps, ranks=None) -> None:
        """Records the prompt logprobs a step computed (`StepBatch` chose the targets):
        per token its target's logprob [T], k most likely [T, k'] and rank [T]."""
        off = 0
        for r in plan.rows:
            req, start, q = r.group.request, r.start, r.num_tokens
            off += q
            if r.decode or not req.prompt_logprobs_missing:
                continue
            seq, entries, k = r.seq, req.prompt_logprobs, req.params.prompt_logprobs
            row = off - q
            for pos in range(start, min(start + q, seq.num_prompt_tokens - 1)):
                if entries[pos + 1] is None:
                    i = row + pos - start
                    tok = seq.token_ids[pos + 1]
                    rank = None if ranks is None else int(ranks[i])
                    names = self._names(req, seq.token_ids, pos + 1)
                    entries[pos + 1] = logprobs_entry(
                        tok, float(target_lps[i]), k, top_ids, top_lps, i, rank=rank, names=names
                    )
                    req.prompt_logprobs_missing -= 1
            if not req.prompt_logprobs_missing:
                r.group.read_prefix_cache = True  # a readmission may hit the cache again

    def _names(self, req: Request, ids: list[int], end: int) -> tuple | None:
        """`logprobs_entry`'s names of the position after `ids[:end]` (None without a
        tokenizer, or with detokenize=False): the few ids before it that name it as all
        of them do (`tokenizer.name_context`: past a run of byte-fallback tokens)."""
        if self.tokenizer is None or not req.params.detokenize:
            return None
        skip = req.params.skip_special_tokens
        return (
            self.tokenizer,
            name_context(self.tokenizer, ids, end, skip_special_tokens=skip),
            skip,
        )


def logprobs_entry(
    tok: int,
    lp: float,
    k: int,
    top_ids,
    top_lps,
    row: int,
    *,
    rank: int | None = None,
    names: tuple | None = None,
) -> dict[int, Logprob]:
    """One token's logprobs: {token: `Logprob`}, the token itself first (its rank
    `rank`), then the k most likely from row `row` of a step's top-k arrays [rows, k']
    (k' >= k), ranked 1 to k in that order.

    `names`: (tokenizer, the ids before the position, the request's skip_special_tokens):
    the entry's decoded tokens, decoded together on the first access of one; None: none.
    """
    pairs = [(tok, lp, rank)]
    if k:
        ids, lps = top_ids[row, :k].tolist(), top_lps[row, :k].tolist()
        pairs += zip(ids, lps, range(1, k + 1), strict=True)
    texts = None if names is None else _TokenTexts(*names, [t for t, _, _ in pairs])
    entry = {}
    for t, x, r in pairs:
        if t not in entry:
            entry[t] = Logprob._make(x, r, token=t, names=texts)
    return entry


class _TokenTexts:
    """The texts of one position's tokens (its own, the alternatives), decoded together
    when one is first asked for (`tokenizer.token_names`, as the OpenAI layer names
    them)."""

    __slots__ = ("tokenizer", "context", "skip", "ids", "texts")

    def __init__(self, tokenizer, context: list[int], skip: bool, ids: list[int]):
        self.tokenizer, self.context, self.skip, self.ids = tokenizer, context, skip, ids
        self.texts: dict[int, str] | None = None

    def text(self, token: int) -> str:
        if self.texts is None:
            kw = dict(context=self.context, skip_special_tokens=self.skip)
            names = token_names(self.tokenizer, self.ids, **kw)
            self.texts = dict(zip(self.ids, names, strict=True))
        return self.texts[token]
