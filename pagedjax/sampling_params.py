"""How to generate for one request: `SamplingParams`, and the `RequestOutputKind` it
names for a running request's outputs (both re-exported by `pagedjax.request`).

`SamplingParams` validates itself on construction (ValueError naming the value), so a
bad request fails on the host before anything is queued or compiled; the field checks
it runs are at the end of this module. What only an engine knows (its logprobs cap, the
vocabulary's size, max_model_len) is checked when the request is added, e.g. by
`pagedjax.request.resolve_logprobs`. Kept apart from the outputs (`pagedjax.request`)
as vLLM keeps `vllm.sampling_params`: the params and their checks are most of it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

import numpy as np

from pagedjax import sampling
from pagedjax.config import is_finite_number
from pagedjax.guided import StructuredOutputsParams
from pagedjax.prompts import check_truncation

__all__ = ["RequestOutputKind", "SamplingParams"]


class RequestOutputKind(enum.IntEnum):
    """What `LLM.step` returns of a request that is still running, as vLLM's.

    CUMULATIVE: after each step that gives it tokens, an output with everything so far;
    DELTA: only what is new since its previous output (its final output too: the last
    piece); FINAL_ONLY: nothing until it finishes (pagedjax's default; vLLM's engine
    defaults to CUMULATIVE, its `LLM.generate` to FINAL_ONLY, as `LLM.generate` here
    always returns whole outputs).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request; validated on construction (ValueError). Every field
    but `n` is keyword-only (vLLM's fields come in another order).

    Attributes:
      n: completions per prompt; with beam search, the best n beams (n <= beam_width).
      temperature: 0 is greedy; ignored by beam search. A small one is used as given
        (vLLM raises those in (0, 0.01) to 0.01).
      top_k: keep the k most likely tokens, and those tied with the k-th (0: off; -1,
        vLLM's other "off", is stored as 0).
      top_p: nucleus mass in (0, 1]: keep the most likely tokens up to the one at which
        their mass reaches top_p, and those tied with it (1: off).
      min_p: in [0, 1]: drop tokens less likely than min_p times the most likely one,
        after the temperature and before top-k and top-p (0: off).
        top_k, top_p and min_p are not supported with beam search (ValueError).
      max_tokens: most tokens to generate per completion; None: until the prompt and the
        completion reach the engine's max_model_len (as vLLM's None).
      seed: sampling seed, an int in [0, 2**32); None draws one from the engine's seed
        (-1, vLLM's other None, is stored as None).
      stop_token_ids: extra tokens that end a completion (kept in its token ids).
      stop: strings that end a completion (cut from its text where the string starts,
        or where it ends with include_stop_str_in_output; needs a tokenizer). Of several
        that one token completes, the one that ends first in the text wins, then the one
        that starts first: what a check after every character would stop on, whatever
        the tokens and the list's order.
        Unlike vLLM's, neither takes None (vLLM's default, read as none): ValueError.
      ignore_eos: do not stop on the model's EOS tokens (a bool).
      beam_width: > 1 runs beam search with this many beams.
      length_penalty: beam score = logprob_sum / length ** length_penalty; only with
        beam search (ValueError otherwise, as in vLLM's: sampling would ignore it).
      cache_salt: requests share prefix-cache pages only with equal salts.
      logprobs: None, or return each generated token's log-probability with those of the
        `logprobs` most likely tokens at its position (an int >= 0; 0: the sampled
        token's only; -1: every token of the vocabulary, as vLLM's), in
        `CompletionOutput.logprobs`. At most the engine's `max_logprobs` (20 by default;
        -1 counts as the vocabulary's size), checked when the request is added
        (ValueError): these params alone do not know the engine's cap.
      prompt_logprobs: None, or return each prompt token's log-probability given the
        tokens before it, with those of the `prompt_logprobs` most likely tokens there
        (as `logprobs`: an int >= 0, or -1 for the whole vocabulary, within the engine's
        cap), in `RequestOutput.prompt_logprobs`. Such a request computes its whole
        prompt (no prefix-cache hits) with logits at every prompt token.
      repetition_penalty: > 0; tokens of the prompt or the output so far have their
        logit divided by it when positive, multiplied when not (1: off; > 1
        discourages repeats).
      presence_penalty: in [-2, 2], subtracted from the logit of every token already
        generated (0: off).
      frequency_penalty: in [-2, 2], times how often a token was generated, subtracted
        from its logit (0: off).
        The three penalties apply before the temperature and truncation, greedy
        included; returned logprobs stay the raw distribution's. Not with beam search.
      min_tokens: neither EOS (even with ignore_eos, as vLLM) nor stop_token_ids can be
        drawn before this many tokens (<= max_tokens), and stop strings are searched
        only in the text after the first min_tokens tokens (as vLLM), so either stops
        from token min_tokens + 1 on. A structured output whose match can go no
        further ends the completion even before min_tokens (vLLM's grammar would then
        leave no token drawable). Not with beam search.
      logit_bias: token id -> value in [-100, 100] added to its logit before sampling
        (greedy included; -100 all but bans a token), or None; a value outside is
        refused (vLLM's server clamps it). Not with beam search.
      include_stop_str_in_output: keep the stop string that ended a completion in its
        text (the text after it, in the same token, is still cut), and the text of the
        stop token that ended it (EOS's shows with skip_special_tokens=False only); a
        bool, as vLLM's.
      skip_special_tokens: leave special tokens (BOS, EOS, ...) out of the text (a bool;
        False shows them, and stop strings are matched against that text).
      truncate_prompt_tokens: None, or an int k >= 1: the prompt keeps only its last k
        tokens, before the length checks and the prefix cache (as vLLM's; a text
        prompt's BOS, which the tokenizer adds, stays first: BOS and the last k - 1, as
        HF's left truncation keeps the special tokens it adds). `RequestOutput`'s
        prompt_token_ids are the kept ones. k > max_model_len is refused (ValueError).
        -1 is k = max_model_len (vLLM's "the truncation size supported by the model"),
        and as with that k, a prompt shorter than max_model_len runs whole and a longer
        one, cut to max_model_len tokens, still leaves no room to generate: refused when
        the request is added (ValueError).
      allowed_token_ids: None, or the only tokens that can be drawn (a non-empty list of
        ints >= 0; ids past the vocabulary are refused when the request is added): every
        other logit is -inf before sampling, greedy included, stop tokens too (an EOS
        outside the list never ends a completion), as vLLM's. Not with beam search.
      bad_words: None, or words never generated (needs a tokenizer), as vLLM's: each,
        its leading whitespace stripped, is tokenized without special tokens, and again
        after one space when that gives another first token and as many tokens
        (`encode_bad_words`). A word of one token is never drawn; a longer word's last
        token is not drawn where the tokens generated so far (not the prompt) end with
        the rest of it. Not with beam search.
        Both leave the returned logprobs the raw distribution's. allowed_token_ids all
        banned by one-token bad words (or, before min_tokens, stop tokens) are refused
        when the request is added; longer bad words that ban every allowed token at some
        position leave nothing to draw, and token 0 is drawn there (as in vLLM).
      detokenize: False leaves the completions' text "" and their logprobs'
        decoded_token None (no decoding on the host; stop strings are refused), as vLLM's.
      structured_outputs: None, or a `pagedjax.guided.StructuredOutputsParams` (a regex,
        a list of choices, a JSON schema or a grammar; needs a tokenizer), as vLLM's: each
        completion's bytes are a prefix of a match at every step; the stop tokens (EOS)
        can be drawn only where the text is a full match, and a token only where the
        vocabulary's tokens can still complete the match after it, so a completion no
        token can continue is a full match and ends there ("stop", stop_reason None); a
        spec no sequence of the vocabulary's tokens can spell is refused when the
        request is added. Its steps run with the host in step with the device (as beam
        search's: `LLM(async_scheduling)`). Stop strings, stop tokens that are also
        text and max_tokens can still cut a completion before its match is complete.
        Where allowed_token_ids, bad_words or min_tokens ban every token the guide
        allows, the completion ends there short of a match with finish_reason "error"
        (vLLM's, where its grammar cannot take a token). Not with beam search.
      output_kind: what `LLM.step` returns of the request while it runs
        (`RequestOutputKind`; an int 0-2 is taken as one, a bool is not): FINAL_ONLY
        (the default) nothing until it finishes; CUMULATIVE or DELTA a partial output
        after every step that gives it tokens (`RequestOutput`), the whole text so far or
        only the new part. With stop strings a running completion's text holds back its
        last max(len(stop)) - 1 characters (they may start a stop string, cut later),
        unless include_stop_str_in_output, so no text returned is cut afterwards.
        `LLM.generate` and `LLM.chat` return the whole finished outputs whatever it
        is. Not with beam search.
    """

    n: int = 1
    # The rest by keyword only: vLLM's second field is presence_penalty, not temperature.
    _: dataclasses.KW_ONLY
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    cache_salt: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def clone(self) -> SamplingParams:
        """A copy (vLLM's `clone`; the params are frozen, so `dataclasses.replace` makes
        changed ones)."""
        return dataclasses.replace(self)

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on."""
        return sampling.any_penalty(
            self.repetition_penalty, self.presence_penalty, self.frequency_penalty
        )

    def __post_init__(self):
        # numpy integers are stored as Python ints: fixed-width ones wrap in the engine's
        # arithmetic (len(prompt) + np.int32(2**31 - 1) max_tokens went negative).
        for name in _INT_FIELDS:
            if isinstance(getattr(self, name), np.integer):
                object.__setattr__(self, name, int(getattr(self, name)))
        # vLLM's spellings of "off" and "no seed" (an int -1 only: -1.0 stays an error)
        if type(self.top_k) is int and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if type(self.seed) is int and self.seed == -1:
            object.__setattr__(self, "seed", None)

        def positive_int(name):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={v!r}")

        for name in ("n", "beam_width"):
            positive_int(name)
        v = self.max_tokens
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got max_tokens={v!r}")
        check_truncation(self.truncate_prompt_tokens)  # (-1: the engine's max_model_len)
        t = self.temperature
        if not is_finite_number(t) or t < 0:
            raise ValueError(f"temperature must be finite and >= 0, got temperature={t!r}")
        k = self.top_k
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k < 2**31:
            # (a step packs it as int32; any k >= the vocabulary is off anyway)
            raise ValueError(f"top_k must be an int in [0, 2**31) (0: off), got top_k={k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got top_p={self.top_p!r}")
        m = self.min_p
        if not _is_number(m) or not 0 <= m <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got min_p={m!r}")
        s = self.seed
        is_int = isinstance(s, (int, np.integer)) and not isinstance(s, bool)
        if s is not None and (not is_int or not 0 <= s < 2**32):
            raise ValueError(f"seed must be None or an int in [0, 2**32), got seed={s!r}")
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "detokenize",
        ):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):  # "no" would be truthy
                raise ValueError(f"{name} must be a bool, got {name}={v!r}")
            object.__setattr__(self, name, bool(v))
        stop = self.stop
        stop = (
            (stop,) if isinstance(stop, str) else _as_tuple(stop, "stop", "a str or a list of strs")
        )
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop must be non-empty strings, got stop={self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if stop and not self.detokenize:
            raise ValueError(f"stop strings need detokenize=True, got stop={stop}")
        ids = _as_tuple(self.stop_token_ids, "stop_token_ids", "a list of ints")
        if any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        lp = self.length_penalty
        if not is_finite_number(lp):
            raise ValueError(f"length_penalty must be a finite number, got length_penalty={lp!r}")
        if self.beam_width == 1 and lp != 1:  # sampling has no length normaliser to apply
            raise ValueError(
                f"length_penalty is only used by beam search (beam_width > 1), got "
                f"length_penalty={lp!r} with beam_width=1"
            )
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValueError(
                f"beam search returns at most beam_width outputs, got n={self.n} > "
                f"beam_width={self.beam_width}"
            )
        if self.beam_width > 1 and stop:
            raise ValueError(f"stop strings are not supported with beam search, got stop={stop}")
        if self.beam_width > 1 and (self.top_k or self.top_p < 1 or self.min_p):
            raise ValueError(  # beam search ranks by logprob: it would ignore them
                "top_k, top_p and min_p are not supported with beam search, got "
                f"top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}"
            )
        sampling.check_penalties(
            self.repetition_penalty, self.presence_penalty, self.frequency_penalty
        )
        m = self.min_tokens
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got min_tokens={m!r}")
        if self.max_tokens is not None and m > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={m}, "
                f"max_tokens={self.max_tokens}"
            )
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        if self.beam_width > 1 and (m or self.logit_bias):
            raise ValueError(
                "min_tokens and logit_bias are not supported with beam search, got "
                f"min_tokens={m}, logit_bias={self.logit_bias!r:.60}"
            )
        if self.allowed_token_ids is not None:
            object.__setattr__(
                self, "allowed_token_ids", _check_allowed_ids(self.allowed_token_ids)
            )
        if self.bad_words is not None:
            object.__setattr__(self, "bad_words", _check_bad_words(self.bad_words))
        if self.beam_width > 1 and (self.allowed_token_ids is not None or self.bad_words):
            raise ValueError(
                "allowed_token_ids and bad_words are not supported with beam search, got "
                f"allowed_token_ids={self.allowed_token_ids!r:.60}, "
                f"bad_words={self.bad_words!r:.60}"
            )
        if self.beam_width > 1 and self.penalised:
            raise ValueError(
                "penalties are not supported with beam search, got "
                f"repetition_penalty={self.repetition_penalty}, "
                f"presence_penalty={self.presence_penalty}, "
                f"frequency_penalty={self.frequency_penalty}"
            )
        kind = self.output_kind
        if not isinstance(kind, RequestOutputKind):
            is_int = isinstance(kind, (int, np.integer)) and not isinstance(kind, bool)
            if not is_int or kind not in set(RequestOutputKind):  # (True == 1: DELTA)
                raise ValueError(
                    "output_kind must be a RequestOutputKind (0: CUMULATIVE, 1: DELTA, 2: "
                    f"FINAL_ONLY), got output_kind={kind!r:.40}"
                )
            object.__setattr__(self, "output_kind", RequestOutputKind(int(kind)))
        if self.beam_width > 1 and self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError(
                "beam search returns final outputs only, got "
                f"output_kind={self.output_kind.name} with beam_width={self.beam_width}"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(
                "structured_outputs must be a pagedjax.guided.StructuredOutputsParams or "
                f"None, got {so!r:.80}"
            )
        if so is not None and self.beam_width > 1:
            raise ValueError(
                f"structured_outputs are not supported with beam search, got "
                f"beam_width={self.beam_width}"
            )
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a str or None, got {self.cache_salt!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            is_int = isinstance(k, (int, np.integer)) and not isinstance(k, bool)
            if k is not None and (not is_int or k < -1):  # (the cap is the engine's)
                raise ValueError(
                    f"{name} must be None, an int >= 0 or -1 (the whole vocabulary), got "
                    f"{name}={k!r}"
                )


_INT_FIELDS = (
    "n",
    "max_tokens",
    "beam_width",
    "top_k",
    "seed",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


def _is_number(x) -> bool:
    """A real number, not a bool (JSON's true must not pass as 1)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _as_tuple(value, name: str, what: str) -> tuple:
    """`tuple(value)`; a ValueError naming the field when `value` is not iterable."""
    try:
        return tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be {what}, got {name}={value!r}") from None


def _check_logit_bias(bias) -> dict[int, float]:
    """`logit_bias` as {int: float}, validated (ValueError naming the bad entry)."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping token id -> value, got {bias!r:.60}")
    out = {}
    for tok, value in bias.items():
        if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool) or tok < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
        if (
            not _is_number(value)
            or not -sampling.MAX_LOGIT_BIAS <= value <= sampling.MAX_LOGIT_BIAS
        ):
            raise ValueError(
                f"logit_bias values must be in [-{sampling.MAX_LOGIT_BIAS}, "
                f"{sampling.MAX_LOGIT_BIAS}], got logit_bias[{tok}]={value!r}"
            )
        out[int(tok)] = float(value)
    return out


def _check_allowed_ids(ids) -> tuple[int, ...]:
    """`allowed_token_ids` as a tuple of ints, validated (ValueError naming it)."""
    what = "allowed_token_ids must be a non-empty list of token ids (ints >= 0), got"
    if isinstance(ids, (str, bytes, Mapping)):  # ids as characters, or a dict's keys
        raise ValueError(f"{what} allowed_token_ids={ids!r:.80}")
    out = _as_tuple(ids, "allowed_token_ids", "a non-empty list of token ids (ints >= 0)")
    if not out:
        raise ValueError(f"{what} allowed_token_ids={ids!r:.80}")
    for i in out:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0:
            raise ValueError(f"{what} {i!r:.40} in allowed_token_ids={ids!r:.80}")
    return tuple(int(i) for i in out)


def _check_bad_words(words) -> tuple[str, ...] | None:
    """`bad_words` as a tuple of strs (None for none), validated (ValueError naming the
    bad entry)."""
    if isinstance(words, (str, bytes, Mapping)):  # a str would be one word per character
        raise ValueError(f"bad_words must be a list of strs, got bad_words={words!r:.80}")
    out = _as_tuple(words, "bad_words", "a list of strs")
    for w in out:
        if not isinstance(w, str) or not w.strip():
            raise ValueError(
                f"bad_words must be strings with a non-space character, got {w!r:.80} in "
                f"bad_words={words!r:.80}"
            )
    return out or None
