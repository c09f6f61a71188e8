"""OpenAI request fields: the error a bad one answers, and the sampling ones.

`ApiError` is the answer to a bad request: OpenAI's `{"error": {...}}` with an HTTP
status, naming the bad field and value. `bool_field` and `int_field` read a plain field
(or raise it). `sampling_params` turns a request's sampling fields (`SAMPLING_FIELDS`,
passed as they are; `stop`, `stop_token_ids`, `logit_bias`; vLLM's `use_beam_search`)
into its `SamplingParams`, a field left out taking the server's `defaults`;
`structured_outputs` reads its structured outputs (OpenAI's `response_format`, vLLM's
`structured_outputs` and older `guided_*` fields) and compiles them for the tokenizer,
so that what cannot be compiled is a 400 naming the field. `pagedjax.openai_api`
(`parse_job`) builds on these and re-exports them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.request import SamplingParams

__all__ = [
    "SAMPLING_FIELDS",
    "ApiError",
    "bool_field",
    "int_field",
    "sampling_params",
    "structured_outputs",
]

PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Request fields passed as they are to SamplingParams (which validates them).
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "cache_salt",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "bad_words",
)


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status.

    Args:
      status: the HTTP status (< 500, or 501 for what the server does not implement:
        the client's request at fault, "invalid_request_error"; else "server_error").
      message: says what is wrong, naming the bad value.
      param: the request field at fault, if one is.
      code: OpenAI's error code, if any (e.g. "model_not_found").
    """

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The JSON error object."""
        kind = (
            "invalid_request_error" if self.status < 500 or self.status == 501 else "server_error"
        )
        return dict(error=dict(message=self.message, type=kind, param=self.param, code=self.code))


def bool_field(body: dict, name: str) -> bool:
    """`body[name]` if it is a boolean, False if absent or null (else ApiError 400)."""
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"{name} must be a boolean, got {name}={v!r}", name)
    return bool(v)


def int_field(body: dict, name: str, default):
    """`body[name]` if it is an int, `default` if absent or null (else ApiError 400)."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(400, f"{name} must be an int, got {name}={v!r}", name)
    return v


def sampling_params(
    body: dict,
    *,
    max_tokens,
    logprobs,
    vocab_size: int,
    defaults: Mapping | None = None,
    guided: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's SamplingParams (ApiError 400 naming the field and value); a field of
    `SAMPLING_FIELDS` left out or null takes `defaults`' value, if it has one; `guided`:
    its structured outputs (`structured_outputs`); `prompt_logprobs`: the count of the
    prompt's logprobs to compute (`pagedjax.openai_echo.read_echo`), or None.

    vLLM's `use_beam_search: true` is a beam search of width `n` answering its `n` best
    beams (`beam_width=n`), with vLLM's `length_penalty`; as vLLM's, it takes none of
    `defaults` (a checkpoint's top_p would refuse it) and ignores `temperature`. What
    beam search refuses (stop strings, top_k, top_p, min_p, penalties, logit_bias, ...)
    is a 400 naming the field, whatever `n`. `length_penalty` without it is a 400
    (sampling has nothing to apply it to). A `seed` is any int64, as OpenAI's and vLLM's,
    taken modulo 2**32 (the engine's range), but -1, which vLLM reads as no seed.
    vLLM's fields that the server does not implement (`truncation_side` "right",
    `return_tokens_as_token_ids`, `logprob_token_ids`, `thinking_token_budget`,
    `repetition_detection`) are 400s naming them, not ignored; their "off" values pass.
    So are OpenAI's deprecated `functions` and a `function_call` naming one (its "none"
    and "auto" pass: they ask for no call)."""
    for name, bad, why in (
        ("best_of", body.get("best_of") not in (None, 1), "best_of is not supported"),
        ("suffix", body.get("suffix") is not None, "suffix is not supported"),
        *(
            (name, body.get(name) not in off, why or f"{name} is not supported")
            for name, off, why in _VLLM_UNSUPPORTED
        ),
        # OpenAI's deprecated form of tools (`pagedjax.tool_calls` reads chat's `tools`).
        (
            "functions",
            bool(body.get("functions")),
            "functions (the deprecated function calling) are not supported; use tools",
        ),
        # Its forced call of a function (its "none" and "auto" ask for none, which is
        # what a request without functions gets): it was ignored, the answer a text.
        (
            "function_call",
            body.get("function_call") not in (None, "none", "auto"),
            "function_call (the deprecated function calling) is not supported; use "
            "tools and tool_choice",
        ),
    ):
        if bad:
            raise ApiError(400, f"{why}, got {name}={body.get(name)!r}", name)
    beam = bool_field(body, "use_beam_search")
    kw = {} if beam else {k: v for k, v in (defaults or {}).items() if k in SAMPLING_FIELDS}
    kw.update((k, body[k]) for k in (*SAMPLING_FIELDS, "length_penalty") if body.get(k) is not None)
    if kw.get("top_k") == -1:  # vLLM's "off"
        kw["top_k"] = 0
    seed = kw.get("seed")
    if seed is not None:  # OpenAI's and vLLM's: any int64 (SamplingParams' range is narrower)
        if type(seed) is not int or not -(2**63) <= seed < 2**63:
            msg = f"seed must be an int64 (-1: none), got seed={seed!r:.40}"
            raise ApiError(400, msg, "seed")
        if seed == -1:  # vLLM's SamplingParams: no seed
            kw.pop("seed")
        else:
            kw["seed"] = seed % 2**32  # (the engine's are in [0, 2**32))
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, (str, list)):
            raise ApiError(400, f"stop must be a string or a list of strings, got {stop!r}", "stop")
        kw["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise ApiError(
                400, f"stop_token_ids must be a list of ints, got {ids!r}", "stop_token_ids"
            )
        outside = [t for t in ids if isinstance(t, int) and t >= vocab_size]
        if outside:  # they could never stop anything
            msg = f"stop_token_ids must be in [0, {vocab_size}), got {outside[:5]}"
            raise ApiError(400, msg, "stop_token_ids")
        kw["stop_token_ids"] = ids
    allowed = body.get("allowed_token_ids")
    if isinstance(allowed, list):  # (SamplingParams names what else is wrong with it)
        outside = [t for t in allowed if isinstance(t, int) and t >= vocab_size]
        if outside:
            msg = f"allowed_token_ids must be in [0, {vocab_size}), got {outside[:5]}"
            raise ApiError(400, msg, "allowed_token_ids")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and bias:  # JSON keys are strings; the engine wants ids
        kw["logit_bias"] = {}
        for key, value in bias.items():
            t = int(key) if key.isdecimal() else -1  # isdigit: "²" too, which int() refuses
            if not 0 <= t < vocab_size:
                msg = f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}"
                raise ApiError(400, msg, "logit_bias")
            kw["logit_bias"][t] = value
    elif bias not in (None, {}):
        kw["logit_bias"] = bias  # SamplingParams says what is wrong with it
    if guided is not None:
        if beam:  # (SamplingParams' refusal names neither the field given nor n)
            (name,) = _structured_fields(body)
            msg = f"structured outputs are not supported with beam search, got {name}"
            raise ApiError(400, f"{msg}={body[name]!r:.80}", name)
        kw["structured_outputs"] = guided
    if beam:
        n = kw.get("n", 1)
        # Checked as a search of width >= 2 even for n = 1, so what a search refuses is
        # refused whatever n (an n that is no int >= 1 is named all the same).
        is_int = isinstance(n, int) and not isinstance(n, bool)
        kw["beam_width"] = n if is_int and n > 1 else 2
    try:
        params = SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **kw
        )
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), _field_at_fault(str(e), kw)) from None
    if beam and params.n == 1:
        # vLLM runs a width-1 beam search, which follows the most likely token at every
        # step as greedy decoding does (it differs where a stop token is the most likely:
        # it keeps the runner-up going too, and answers whichever scores better). The
        # engine's searches are of width >= 2, so n = 1 is greedy; length_penalty, which
        # weighs beams of different lengths, is moot.
        params = dataclasses.replace(params, beam_width=1, temperature=0.0, length_penalty=1.0)
    return params


# vLLM's request fields that the server does not implement: name, the values that ask for
# nothing (they pass), and the refusal's words if not "<name> is not supported". Refused
# otherwise, naming the field, where an unknown field is ignored: each changes the answer.
_VLLM_UNSUPPORTED = (
    (
        "truncation_side",
        (None, "left"),
        'truncation_side is "left" only (truncate_prompt_tokens keeps the last tokens)',
    ),
    ("return_tokens_as_token_ids", (None, False), None),
    (
        "logprob_token_ids",
        (None,),
        "logprob_token_ids is not supported (logprobs list the most likely tokens)",
    ),
    ("thinking_token_budget", (None, -1), None),
    ("repetition_detection", (None,), None),
)

_DEFAULT_PARAMS = SamplingParams()


def _field_at_fault(message: str, kw: Mapping) -> str | None:
    """The request field a SamplingParams error is about: of the fields its message names,
    the first the request set to other than its default (beam search's refusals name
    several: "top_k, top_p and min_p are not supported ..."), else the first named."""
    names = [w for w in re.findall(r"\w+", message) if w in PARAM_FIELDS]
    given = [x for x in names if x in kw and kw[x] != getattr(_DEFAULT_PARAMS, x)]
    return (given or names or [None])[0]


# vLLM's older request fields of structured outputs -> StructuredOutputsParams' fields.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _structured_fields(body: dict) -> list[str]:
    """The request's fields that ask for structured outputs (a valid request has one at
    most; a `response_format` of type "text" asks for none, whatever else it holds)."""
    return [
        name
        for name in ("response_format", "structured_outputs", *_GUIDED_FIELDS)
        if body.get(name) is not None
        and not (name == "response_format" and _text_format(body[name]))
    ]


def _text_format(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def structured_outputs(body: dict, tokenizer, vocab_size: int) -> StructuredOutputsParams | None:
    """The request's structured outputs, from OpenAI's `response_format` ({"type":
    "json_schema", "json_schema": {"schema": {...}}} or {"type": "json_object"};
    {"type": "text"}: none), vLLM's `structured_outputs` object (StructuredOutputsParams'
    fields) or its older `guided_json` / `guided_regex` / `guided_choice` fields (with
    `guided_whitespace_pattern`); one of them at most. Compiled for `tokenizer` here
    (the engine's compile of it is then cached), so that a spec too large, or a model
    without a tokenizer, is a 400 naming the field."""
    given = _structured_fields(body)
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(given)}, not several", given[1])
    name, value = given[0], body[given[0]]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        schema = value.get("json_schema") if kind == "json_schema" else None
        if kind == "json_object":
            fields = {"json_object": True}
        elif isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
            fields = {"json": schema["schema"]}
        else:
            msg = (
                'response_format must be {"type": "text"}, {"type": "json_object"} or '
                '{"type": "json_schema", "json_schema": {"schema": {...}}}, got '
                f"response_format={value!r:.100}"
            )
            raise ApiError(400, msg, name)
    elif name == "structured_outputs":
        if not isinstance(value, dict):
            msg = f"structured_outputs must be an object, got structured_outputs={value!r:.80}"
            raise ApiError(400, msg, name)
        fields = value
    else:
        fields = {_GUIDED_FIELDS[name]: value}
        if body.get("guided_whitespace_pattern") is not None:
            fields["whitespace_pattern"] = body["guided_whitespace_pattern"]
    try:
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        spec = StructuredOutputsParams(**fields)
        compile_guide(spec, tokenizer, vocab_size)
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"{name}: {e}", name) from None
    return spec
