"""vLLM's beam-search API over the engine's beam search: `LLM.beam_search`.

vLLM runs beam search through its own entry point, `LLM.beam_search(prompts,
BeamSearchParams(...))`, which returns a `BeamSearchOutput` per prompt holding the
`beam_width` best `BeamSearchSequence`s. Here the same call runs the engine's beam search
(`SamplingParams(beam_width=W, n=W)`: `pagedjax.beam`, on the host, each beam a
copy-on-write fork of the prompt's pages) and gives its completions vLLM's shape:
`tokens` are the prompt's and the completion's ids, the EOS a beam ended on included (as
vLLM's), `logprobs` one entry per completion token (that EOS's too), `cum_logprob` their
sum, and `text` the decode of `tokens`, special tokens included (as vLLM's
`tokenizer.decode(tokens)`), less the EOS unless `include_stop_str_in_output`.

Where we differ from vLLM on purpose (vLLM's `LLM.beam_search` loop and
`vllm.beam_search.get_beam_search_score`):

- The search is HF transformers' (`pagedjax.beam`), vLLM's a simpler variant of it. vLLM
  ends a beam on every EOS among each beam's top `2 * W` tokens and runs `max_tokens`
  steps; HF keeps an EOS only when it ranks among the step's best `W` candidates and
  stops early once no live beam can beat the worst of `W` finished ones.
- Scores: `logprob_sum / length ** length_penalty` with `length` the generated tokens,
  the EOS included (HF); vLLM counts the prompt's tokens and leaves the EOS out. Where
  `length_penalty` is not 0 the two may rank beams of different lengths differently.
- A beam ends on any of the model's EOS tokens (`LLM.eos_ids`: the config's and the
  tokenizer's, as sampling's); vLLM's on the tokenizer's `eos_token_id` alone.
- `beam_width=1` is greedy decoding; vLLM's is a one-beam search (an EOS ranked first
  ends a hypothesis and the next token carries on).
- `logprobs` hold each token's own logprob (the engine's `logprobs=0`); vLLM's hold the
  `2 * W` candidates of every step.
- `temperature` does not change the search: vLLM scores raw logprobs too, but adds each
  beam's sampled token to its candidates, which with `temperature > 0` may be a random
  one.
- `text` leaves the EOS out unless `include_stop_str_in_output` (vLLM's server does;
  its `LLM.beam_search` keeps it and ignores the flag).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import numpy as np

from pagedjax.config import is_finite_number
from pagedjax.prompts import request_lists
from pagedjax.request import Logprob, SamplingParams

if TYPE_CHECKING:
    from pagedjax.engine import LLM

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence"]

# How `LLM.generate` names a prompt it refuses (`_queue_all`): "prompt <index>: ...".
_PROMPT_INDEX = re.compile(r"prompt (\d+): ")


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`.

    Attributes:
      beam_width: beams kept, and sequences returned per prompt (an int >= 1; 1 is
        greedy decoding).
      max_tokens: most tokens generated per sequence (an int >= 1).
      ignore_eos: EOS does not end a beam.
      temperature: accepted (a finite number >= 0) and without effect (see the module docstring).
      length_penalty: exponent of the length normaliser of a finished beam's score (a
        finite number; see the module docstring).
      include_stop_str_in_output: a beam that ended on EOS keeps it in its text (its
        tokens always do).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        # numpy ints and bools are ints and bools, as SamplingParams takes them (stored
        # as Python's)
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {name}={v!r}")
            object.__setattr__(self, name, bool(v))
        t, lp = self.temperature, self.length_penalty
        if not is_finite_number(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0.0, got temperature={t!r}")
        if not is_finite_number(lp):  # (-inf, and an int past the float range, too)
            raise ValueError(f"length_penalty must be a finite number, got length_penalty={lp!r}")

    def sampling_params(self) -> SamplingParams:
        """The engine request that runs this search: `beam_width` beams, as many
        completions, each token's logprob recorded (`logprobs=0`)."""
        kw = dict(
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=False,
            logprobs=0,
        )
        if self.beam_width == 1:  # one beam is the greedy completion (no normaliser)
            return SamplingParams(temperature=0.0, **kw)
        w = self.beam_width
        return SamplingParams(beam_width=w, n=w, length_penalty=self.length_penalty, **kw)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: `tokens` the prompt's and the generated ids, `logprobs` one
    {token id: `Logprob`} per generated token, `text` the decode of `tokens` (None
    without a tokenizer)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's result: its best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_search(
    llm: LLM,
    prompts,
    params: BeamSearchParams,
    *,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
    lora_request=None,
) -> list[BeamSearchOutput]:
    """`LLM.beam_search`'s body: see there. A prompt `generate` refuses is named by its
    index in `prompts`; in chunks (`concurrency_limit`) every prompt is encoded first, so
    that a bad one is refused before any chunk runs (what only queueing it finds, its
    pages or length penalty, when its chunk comes)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {params!r:.80}")
    c = concurrency_limit
    if c is not None and (type(c) is not int or c < 1):
        raise ValueError(f"concurrency_limit must be None or an int >= 1, got {c!r}")
    sp = params.sampling_params()
    prompts, _ = request_lists(prompts, sp, lambda: sp)  # (as generate takes them)
    step = c or max(1, len(prompts))
    loras = llm._per_prompt_loras(lora_request, len(prompts))
    if step < len(prompts):  # in chunks: a prompt generate would refuse, before any runs
        for i, p in enumerate(prompts):
            try:
                llm._encode(p, sp)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
    outs = []
    for i in range(0, len(prompts), step):
        lr = loras[i : i + step]
        try:
            outs += llm.generate(prompts[i : i + step], sp, use_tqdm=use_tqdm, lora_request=lr)
        except (ValueError, TypeError) as e:
            # generate names a prompt it refuses by its index in the chunk: in `prompts`
            m = _PROMPT_INDEX.match(str(e)) if i else None
            if m is None:
                raise
            raise type(e)(f"prompt {i + int(m[1])}: {str(e)[m.end() :]}") from None
    tok = llm.tokenizer
    results = []
    for o in outs:
        seqs = []
        for comp in o.outputs:
            tokens = list(o.prompt_token_ids) + list(comp.token_ids)
            shown = tokens  # (the text's tokens)
            if comp.finish_reason == "stop" and not params.include_stop_str_in_output:
                shown = tokens[:-1]
            text = None if tok is None else tok.decode(shown, skip_special_tokens=False)
            seqs.append(
                BeamSearchSequence(
                    tokens,
                    list(comp.logprobs or []),
                    comp.cumulative_logprob,
                    text,
                    comp.finish_reason,
                    comp.stop_reason,
                )
            )
        results.append(BeamSearchOutput(seqs))
    return results
