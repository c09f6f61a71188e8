"""What a request asks for and what it gets back: `SamplingParams` (defined in
`pagedjax.sampling_params`, with `RequestOutputKind`), `RequestOutput` (its
`CompletionOutput`s, their `Logprob`s), and the engine's cap on the logprobs a request
may ask for (`MAX_LOGPROBS`; `logprobs_count` and `resolve_logprobs` check a request's
against it).

`SamplingParams` validates itself on construction (ValueError naming the value), so a
bad request fails on the host before anything is queued or compiled. Prompts are
encoded by `pagedjax.prompts`; their names, `SamplingParams` and `RequestOutputKind`
are re-exported here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.guided import StructuredOutputsParams  # re-exported
from pagedjax.lora import LoRARequest
from pagedjax.prompts import (  # re-exported
    Prompt,
    check_truncation,
    encode_bad_words,
    encode_prompt,
    unpack_prompt,
)
from pagedjax.sampling_params import (  # re-exported (_is_number: Logprob's check)
    RequestOutputKind,
    SamplingParams,
    _is_number,
)

__all__ = [
    "MAX_LOGPROBS",
    "CompletionOutput",
    "Logprob",
    "Prompt",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "check_truncation",
    "encode_bad_words",
    "logprobs_count",
    "resolve_logprobs",
    "encode_prompt",
    "unpack_prompt",
]

# An engine's default cap on the alternatives per token a request may ask for
# (`LLM(max_logprobs=...)`, as vLLM's).
MAX_LOGPROBS = 20


class Logprob(float):
    """A token's log-probability in a logprobs entry: the float itself, with vLLM's
    `Logprob` attributes.

    A float subclass, so code that reads entries as {token id: float} keeps working
    (arithmetic, comparisons, ``==`` and hashing, `json.dumps`, `math`, numpy all see the
    value; equality ignores the rank and the text), and code ported from vLLM reads
    ``entry[tok].logprob``, ``.rank`` and ``.decoded_token``. Immutable: copies are the
    object itself; a pickle keeps the value, the rank and the text.

    Args:
      logprob: the value (a real number).
      rank: the token's 1-based rank in the vocabulary, or None.
      decoded_token: the token's text, or None.

    Raises:
      TypeError: a value of another type (named).

    Attributes:
      logprob: the value, as a plain float.
      rank: in the engine's entries, the token's 1-based rank in the vocabulary under the
        same (raw) distribution: for the sampled or prompt token, the number of tokens
        whose logprob is at least its own, itself included (ties rank last, as vLLM's);
        for each of the k most likely, and for a
        beam search's token, its place among the step's most likely (equal values in the
        order its top-k gave).
      decoded_token: the token's text where it stands: decoded after the ids before it
        (so a SentencePiece token keeps its leading space), special tokens shown, as the
        OpenAI server names it; computed on first access. None without a tokenizer.
    """

    __slots__ = ("_rank", "_text", "_token", "_names")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        if not _is_number(logprob):
            raise TypeError(f"logprob must be a real number, got logprob={logprob!r:.60}")
        if rank is not None and (not isinstance(rank, (int, np.integer)) or isinstance(rank, bool)):
            raise TypeError(f"rank must be an int or None, got rank={rank!r:.60}")
        if decoded_token is not None and not isinstance(decoded_token, str):
            raise TypeError(f"decoded_token must be a str or None, got {decoded_token!r:.60}")
        return cls._make(logprob, None if rank is None else int(rank), decoded_token)

    @classmethod
    def _make(cls, logprob, rank, text=None, token: int = -1, names=None) -> Logprob:
        """Unchecked (the engine's). With `names`, `decoded_token` is `names.text(token)`,
        computed on first access."""
        self = float.__new__(cls, logprob)
        self._rank, self._text, self._token, self._names = rank, text, token, names
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def rank(self) -> int | None:
        return self._rank

    @property
    def decoded_token(self) -> str | None:
        names = self._names
        if names is not None:  # the text first: a reader that then sees None reads it
            self._text = names.text(self._token)
            self._names = None
        return self._text

    def __reduce__(self):
        return Logprob, (float(self), self._rank, self.decoded_token)

    def __copy__(self) -> Logprob:
        return self

    def __deepcopy__(self, memo) -> Logprob:
        return self


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request.

    `text` decodes `token_ids` with special tokens (EOS, ...) skipped (shown with
    `SamplingParams.skip_special_tokens=False`), cut where a stop string starts (the
    stop string and anything after it left out), or with include_stop_str_in_output
    where it ends (only what follows it left out). The stop token that ends a
    completion (EOS, one of stop_token_ids) has its text left out unless
    include_stop_str_in_output, as in vLLM. `token_ids` hold every generated token,
    the stop token and the tokens that completed a stop string included. `stop_reason`
    is the stop string, or the stop token's id, EOS included (vLLM gives None for EOS);
    None when the completion did not stop on one ("length", "abort", "error": a
    structured output whose other constraints left no token the guide allows,
    `SamplingParams.structured_outputs`).

    `logprobs` (with `SamplingParams.logprobs` = k): per generated token a dict {token id:
    `Logprob`}, the sampled token first, then the k most likely in rank order; each a
    float (its log-probability under the model's raw distribution: before temperature,
    penalties, bias, top-k and top-p) with vLLM's `.logprob`, `.rank` and `.decoded_token`.
    `cumulative_logprob` is their sum (the sampled tokens'), a float whether or not
    logprobs were asked for (vLLM v1 gives None without them; the engine computes it
    anyway, and the CLIs report it).
    """

    # In vLLM's order (code that builds one positionally, as vLLM's, fills the same fields).
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float  # sum of the generated tokens' raw-distribution logprobs
    logprobs: list[dict[int, Logprob]] | None = None  # with SamplingParams.logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id (EOS too) or stop string

    def finished(self) -> bool:
        """Whether the completion has ended (it has a finish reason), as vLLM's."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A finished (or aborted) request, or a running request's partial output
    (`SamplingParams.output_kind` CUMULATIVE or DELTA: from `LLM.step`; `on_token`
    streams the tokens of any request).

    `prompt` is None for a prompt given as token ids, unless a TokensPrompt dict carried
    its text as "prompt" (`LLM.chat`: the rendered text);
    `prompt_token_ids` are those the request ran on (truncate_prompt_tokens kept the last).
    `finished` is True for a request's last output: finished, or aborted (`LLM.abort`,
    as vLLM's finish reason "abort": the completions still running then end with
    finish_reason "abort", with what they have), and False for a running request's
    partial output, whose running completions have finish_reason None (a DELTA output
    holds only what is new: token ids, text and logprobs). Times are seconds from the
    request's arrival (its `add_request`, or its `arrival_time` there, or the `generate`
    call).

    `prompt_logprobs` (with `SamplingParams.prompt_logprobs` = k): per prompt token, None
    for the first (and, in an aborted request's output, for those not computed yet),
    else a dict {token id: `Logprob`} holding the prompt token first and the k most
    likely in rank order (raw distribution, given the tokens before it; ranks and
    decoded tokens as in `CompletionOutput.logprobs`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # False: a running request's partial output
    num_cached_tokens: int  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int
    ttft_s: float | None  # arrival to first generated token (None: none yet)
    latency_s: float | None  # arrival to finish (or abort)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (`LLM(enable_lora)`)


def logprobs_count(
    name: str, k, max_logprobs: int, vocab_size: int, cap: str = "the engine's max_logprobs"
) -> int:
    """How many of the most likely tokens a request's `name` (logprobs, prompt_logprobs,
    or an API's field for them) = `k` asks for, under an engine's cap `max_logprobs`:
    `k` itself, or `vocab_size` for -1 (the whole vocabulary, as vLLM's).

    Raises:
      ValueError: `k` is not an int >= -1, or it asks for more than the cap (-1:
        `vocab_size`; named as `cap` says) or than the vocabulary has, naming `k` and
        the bound.
    """
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < -1:
        raise ValueError(
            f"{name} must be an int >= 0 or -1 (the whole vocabulary), got {name}={k!r}"
        )
    n = vocab_size if k == -1 else int(k)
    what = f"{name}={k}" + (f" (the whole vocabulary, {vocab_size} tokens)" if k == -1 else "")
    if max_logprobs != -1 and n > max_logprobs:
        raise ValueError(f"{what} is more than {cap}={max_logprobs}")
    if n > vocab_size:
        raise ValueError(f"{what} is more than the model's vocabulary of {vocab_size} tokens")
    return n


def resolve_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> SamplingParams:
    """`params` as an engine of `vocab_size` tokens and cap `max_logprobs` runs them:
    logprobs and prompt_logprobs checked (`logprobs_count`), -1 replaced by
    `vocab_size` (the step's top-k over the whole vocabulary); `params` itself when
    nothing changes.

    Raises:
      ValueError: naming the field, its value and the bound it passes.
    """
    changes = {}
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None:
            n = logprobs_count(name, k, max_logprobs, vocab_size)
            if k == -1:
                changes[name] = n
    return dataclasses.replace(params, **changes) if changes else params
