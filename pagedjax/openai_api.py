"""OpenAI's completions and chat completions protocol, without the HTTP.

`parse_job` turns a request body (a parsed JSON object) into a `Job`: its prompts as
token ids (chat messages rendered with the tokenizer's chat template) and its
`SamplingParams`, or raises `ApiError` (400 naming the bad field and value; 404 for a
model not served here); `tokenize` and `detokenize` answer vLLM's endpoints of those
names. `ApiError`, the field readers (`bool_field`, `int_field`) and the sampling and
structured-output fields (`sampling_params`, `structured_outputs`) live in
`pagedjax.openai_fields`, re-exported here; `echo` and vLLM's `prompt_logprobs` are read
by `pagedjax.openai_echo` (`Job.echo`, `Job.prompt_logprobs`). The response builders
(`pagedjax.openai_responses`, re-exported here too) turn the engine's `RequestOutput`s
back into OpenAI's shapes: a whole answer (`response_body`), or the chunks of a streamed
one (`role_chunks`, `stream_chunk`, `usage`); `render_logprobs` renders the logprobs of
any run of a completion's tokens (all of them, or a chunk's). Nothing here touches the
engine, so it runs on any thread.

Function calling (chat's `tools`, `tool_choice`, `parallel_tool_calls`) is
`pagedjax.tool_calls`': `parse_job` reads the request's tools (`Job.tools`; "auto" needs
the server's `tool_parser`), renders them into the prompt and makes named and "required"
tool choices structured outputs; `response_body` here and `stream_chunk` /
`stream_chunks` (`pagedjax.streamed_choice`, re-exported) are the builders', with the
answer's text made calls where the request asks for them.

A body's `model` names the served model or one of its LoRA adapters (vLLM's
`--lora-modules`; `parse_job(loras=)`): the job's requests then run with that adapter
(`Job.lora_request`), and its answers echo the name.

A model without a tokenizer (`tokenizer=None`) serves completions of token id prompts:
its texts are "", so every choice carries its generated `token_ids` (a pagedjax
extension; with a tokenizer, only when the request has `return_token_ids: true`, which
also adds `prompt_token_ids` as vLLM does), and logprobs name each token
`"token_id:<id>"` (vLLM's convention) with every `text_offset` 0 (offsets into the
empty text). scripts/serve.py documents the fields and answers as a user sees them.

Where this differs from vLLM on purpose: `stream_options: {}` asks for no usage chunk
(OpenAI's reading; vLLM's `include_usage` defaults to true there); vLLM's
`stream_options.continuous_usage_stats: true` (usage in every chunk) is a 400, not
ignored; completions' `logprobs` must be an int (vLLM's pydantic takes true as 1). A
`seed` is any int64, as both take it, folded modulo 2**32 into the engine's range.
Fields neither reads (`user`, `metadata`, `store`, `service_tier`, ...) are ignored.

Defaults: a sampling field left out (or null) takes the server's `defaults`, the
checkpoint's generation_config.json values (`LLM.sampling_defaults`), as vLLM's
`--generation-config auto` does, else OpenAI's. Its `max_tokens` (the file's
max_new_tokens) caps a left-out max_tokens' default, as vLLM's does (completions: 16,
or the room each prompt leaves for an explicit null, as vLLM's; chat: the room the
prompt leaves); a max_tokens given is never cut (vLLM caps it too).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from pagedjax import openai_echo, openai_responses
from pagedjax.chat import normalize_messages
from pagedjax.openai_fields import (  # re-exported
    SAMPLING_FIELDS,
    ApiError,
    bool_field,
    int_field,
    sampling_params,
    structured_outputs,
)
from pagedjax.openai_responses import (  # re-exported
    chat_logprobs,
    choice_index,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    render_logprobs,
    render_prompt_logprobs,
    response_head,
    role_chunks,
    token_texts,
    usage,
)
from pagedjax.request import (
    MAX_LOGPROBS,
    RequestOutput,
    SamplingParams,
    check_truncation,
    encode_bad_words,
    encode_prompt,
    logprobs_count,
)
from pagedjax.streamed_choice import stream_chunk, stream_chunks  # re-exported
from pagedjax.tool_calls import ToolRequest, read_tools

if TYPE_CHECKING:
    from pagedjax.lora import LoRARequest

__all__ = [
    "SAMPLING_FIELDS",
    "ApiError",
    "Job",
    "chat_logprobs",
    "chat_messages",
    "choice_index",
    "completion_logprobs",
    "bool_field",
    "check_model",
    "chat_prompt",
    "completion_prompts",
    "detokenize",
    "echo_logprobs",
    "int_field",
    "join_logprobs",
    "parse_job",
    "render_logprobs",
    "render_prompt_logprobs",
    "response_body",
    "response_head",
    "role_chunks",
    "sampling_params",
    "stream_chunk",
    "stream_chunks",
    "structured_outputs",
    "token_texts",
    "tokenize",
    "usage",
]


@dataclasses.dataclass
class Job:
    """One API request's work: its engine requests and how to answer.

    Attributes:
      chat: a chat completion (else a completion).
      prompts: each prompt's token ids; each is one engine request.
      params: the sampling parameters of every prompt.
      stream: answer with Server-Sent Events.
      include_usage: streamed answers end with a usage chunk.
      token_ids: each choice (and each streamed chunk) carries its generated token ids
        (asked for with `return_token_ids`, or the model has no tokenizer).
      prompt_token_ids: answers carry the prompts' token ids (`return_token_ids`).
      priority: vLLM's `priority` of its engine requests (lower first; 0 unless the
        server schedules by priority).
      model: the served name the request's `model` gave (None: left out), which its
        answers echo.
      lora_request: the LoRA adapter its requests run with (`model` named one), or None.
      tools: a chat request's tools (`pagedjax.tool_calls.ToolRequest`), or None.
      echo: with `echo: true`, the text each prompt's choices start with
        (`pagedjax.openai_echo`: completions, the prompt's; chat, the last message's
        content or ""); completions' logprobs then cover the prompt's tokens too.
      prompt_logprobs: answers carry vLLM's `prompt_logprobs` (completions: on each
        choice; chat: beside them).
      echo_only: `max_tokens: 0` with echo: the one token generated is dropped (`output`).
      prompt_tokens_details: `usage` carries `prompt_tokens_details: {cached_tokens}`
        (the server's `--enable-prompt-tokens-details`; `openai_responses.usage`).
      id: the response id's suffix; `rids` derive from it.
      created: the Unix time of the request.
    """

    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    token_ids: bool = False
    prompt_token_ids: bool = False
    priority: int = 0
    model: str | None = None
    lora_request: LoRARequest | None = None
    tools: ToolRequest | None = None
    echo: list[str] | None = None
    prompt_logprobs: bool = False
    echo_only: bool = False
    prompt_tokens_details: bool = False
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def rids(self) -> list[str]:
        """The engine request id of each prompt."""
        return [f"{self.id}-{i}" for i in range(len(self.prompts))]

    @property
    def streams_tokens(self) -> bool:
        """A stream sends tokens as they come (`pagedjax.openai_echo.streams_tokens`)."""
        return openai_echo.streams_tokens(self)

    def output(self, out: RequestOutput) -> RequestOutput:
        """A finished output as answered (`echo_only`: the generated token dropped)."""
        return openai_echo.without_generated(out) if self.echo_only else out


def parse_job(
    body: dict,
    *,
    chat: bool,
    model_name: str,
    tokenizer,
    vocab_size: int,
    max_model_len: int,
    defaults: Mapping | None = None,
    scheduling_policy: str = "fcfs",
    max_logprobs: int = MAX_LOGPROBS,
    loras: Mapping[str, LoRARequest] | None = None,
    tool_parser: str | None = None,
    prompt_tokens_details: bool = False,
) -> Job:
    """Validates a request body and tokenizes its prompts (no engine involved).

    Args:
      body: the request's JSON object.
      chat: a chat completions request (`messages`), else a completions one (`prompt`).
      model_name: the served model; a body naming another (not in `loras`) is refused.
      tokenizer: the model's `Tokenizer`, or None (token id prompts only, no chat, no
        stop strings; choices carry their token ids).
      vocab_size: the model's vocabulary size (token ids, logit_bias keys,
        allowed_token_ids, bad_words' tokens).
      max_model_len: the longest sequence; chat's default max_tokens fills it up.
      defaults: SamplingParams fields for those the body leaves out (the generation
        config's, `LLM.sampling_defaults`; see the module docstring), or None.
      scheduling_policy: the engine's (`LLM.scheduling_policy`): vLLM's `priority`
        field (an int, default 0) must be 0 under "fcfs".
      max_logprobs: the engine's (`LLM.max_logprobs`; -1: no cap): the most that
        completions' `logprobs` and chat's `top_logprobs` may be (their -1, vLLM's whole
        vocabulary, counts as `vocab_size` and becomes it in the params).
      loras: the served LoRA adapters by name (vLLM's `--lora-modules`): a body whose
        `model` names one runs with it.
      tool_parser: the server's tool-call parser (`pagedjax.tool_calls.PARSERS`; vLLM's
        `--enable-auto-tool-choice --tool-call-parser`), which `tool_choice: "auto"`
        needs; None: "auto" is a 400.
      prompt_tokens_details: answers' `usage` carries `prompt_tokens_details:
        {cached_tokens}` (vLLM's `--enable-prompt-tokens-details`; `Job`'s).

    Raises:
      ApiError: 400 naming the bad field and value (404 for a model not served here, as
        OpenAI and vLLM answer; 500 if the chat template cannot be rendered for want of
        a package).
    """
    defaults = defaults or {}
    loras = loras or {}
    model = check_model(body, model_name, loras)
    stream = bool_field(body, "stream")
    opts = body.get("stream_options")
    if opts and not stream:  # as OpenAI and vLLM answer (null or {} pass, as in vLLM)
        msg = f"stream_options needs stream=true, got stream_options={opts!r:.80}"
        raise ApiError(400, msg, "stream_options")
    if opts is not None:
        flags = ("include_usage", "continuous_usage_stats")
        if not isinstance(opts, dict) or any(
            not isinstance(opts.get(f), (bool, type(None))) for f in flags
        ):
            msg = f"stream_options must be {{include_usage: bool}}, got stream_options={opts!r:.80}"
            raise ApiError(400, msg, "stream_options")
        if opts.get("continuous_usage_stats"):  # vLLM's usage in every chunk
            msg = (
                "stream_options' continuous_usage_stats is not supported (include_usage "
                f"gives the usage in a last chunk), got stream_options={opts!r:.80}"
            )
            raise ApiError(400, msg, "stream_options")
    include_usage = stream and bool((opts or {}).get("include_usage"))
    priority = _job_priority(body, scheduling_policy)
    want_ids = body.get("return_token_ids")
    if want_ids is not None and not isinstance(want_ids, bool):
        msg = f"return_token_ids must be a boolean, got return_token_ids={want_ids!r}"
        raise ApiError(400, msg, "return_token_ids")
    tok = tokenizer
    tools = read_tools(body, parser=tool_parser) if chat else None
    if chat:
        prompts = [chat_prompt(body, tok, "/v1/completions", tools=tools)]
    elif body.get("tools"):
        msg = f"tools (function calling) need /v1/chat/completions, got tools={body['tools']!r:.80}"
        raise ApiError(400, msg, "tools")
    else:
        prompts = completion_prompts(body.get("prompt"))
    # vLLM's: keep the last k prompt tokens (-1: max_model_len), before the length checks
    # (a text's BOS stays). check_truncation names what it takes (int_field would not).
    trunc = body.get("truncate_prompt_tokens")
    try:
        check_truncation(trunc, max_model_len)
    except ValueError as e:
        raise ApiError(400, str(e), "truncate_prompt_tokens") from None
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(
                encode_prompt(p, tok, vocab_size, max_model_len, truncate_prompt_tokens=trunc)[1]
            )
        except (ValueError, TypeError) as e:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise ApiError(400, f"{where}{e}", "messages" if chat else "prompt") from None
    fill = not chat and "max_tokens" in body and body["max_tokens"] is None  # an explicit null
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):  # 1 == True, but not a boolean
            msg = f"logprobs must be a boolean, got logprobs={want!r}"
            raise ApiError(400, msg, "logprobs")
        k = int_field(body, "top_logprobs", None)
        if k and not want:  # (0 asks for nothing: passes, as in vLLM; -1 does not)
            msg = f"top_logprobs needs logprobs=true, got top_logprobs={k}"
            raise ApiError(400, msg, "top_logprobs")
        k = _logprobs_field("top_logprobs", k, vocab_size, max_logprobs)
        logprobs = (k or 0) if want else None
        default = min(max_model_len - len(ids[0]), defaults.get("max_tokens", max_model_len))
        limit = int_field(body, "max_tokens", default)
        limit = int_field(body, "max_completion_tokens", limit)
    elif fill:  # vLLM's: the room each prompt leaves (capped by the file's max_tokens)
        logprobs, limit = body.get("logprobs"), defaults.get("max_tokens")
    else:
        logprobs = body.get("logprobs")
        limit = int_field(body, "max_tokens", min(16, defaults.get("max_tokens", 16)))
    if not chat and isinstance(logprobs, int) and not isinstance(logprobs, bool):
        logprobs = _logprobs_field("logprobs", logprobs, vocab_size, max_logprobs)
    k = logprobs if isinstance(logprobs, int) and not isinstance(logprobs, bool) else None
    echo, prompt_logprobs = openai_echo.read_echo(
        body, chat=chat, stream=stream, k=k, vocab_size=vocab_size, max_logprobs=max_logprobs
    )
    # The field the limit came from (completions have no max_completion_tokens).
    given = chat and body.get("max_completion_tokens") is not None
    field = "max_completion_tokens" if given else "max_tokens"
    echo_only = echo and not chat and limit == 0  # vLLM's: the prompt alone (one token run)
    if limit is not None and limit < 1 and not echo_only:  # (SamplingParams names max_tokens)
        least = ">= 1" if chat else ">= 1 (0 with echo=true)"
        raise ApiError(400, f"{field} must be an int {least}, got {field}={limit}", field)
    guided = structured_outputs(body, tok, vocab_size)
    if tools is not None:  # named and "required" tool choices are structured outputs
        guided = tools.structured_outputs(body, guided, tok, vocab_size)
    params = sampling_params(
        body,
        max_tokens=1 if echo_only else limit,
        logprobs=logprobs,
        vocab_size=vocab_size,
        defaults=defaults,
        guided=guided,
        prompt_logprobs=prompt_logprobs,
    )
    if tools is not None and tools.parser == "hermes" and params.skip_special_tokens:
        # vLLM's hermes parser (its adjust_request): some models (Hermes 2 Pro) mark
        # <tool_call> a special token, which the text would drop before the parser reads
        # it: no call found. (Stop tokens stay out of the text either way.)
        params = dataclasses.replace(params, skip_special_tokens=False)
    if params.stop and tok is None:
        raise ApiError(400, "stop strings need a tokenizer; this model has none", "stop")
    if params.bad_words:  # (the engine encodes them again; a 400 naming the field here)
        try:
            encode_bad_words(params.bad_words, tok, vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e), "bad_words") from None
    for i, p in enumerate(ids):  # as vLLM: never cut max_tokens short without saying so
        if not fill and len(p) + params.max_tokens > max_model_len:
            where = f"prompt {i}: " if len(ids) > 1 else ""
            raise ApiError(
                400,
                f"{where}the prompt's {len(p)} tokens and {field}={params.max_tokens} are "
                f"more than max_model_len={max_model_len}; lower {field} to at most "
                f"{max_model_len - len(p)}",
                field,
            )
    texts = openai_echo.echo_texts(body, chat, tok, prompts, ids) if echo else None
    return Job(
        chat,
        ids,
        params,
        stream,
        include_usage,
        bool(want_ids) or tok is None,
        bool(want_ids),
        priority,
        model,
        loras.get(model),
        tools,
        texts,
        not stream and params.prompt_logprobs is not None,
        echo_only,
        prompt_tokens_details,
    )


def _logprobs_field(name: str, k: int | None, vocab_size: int, max_logprobs: int) -> int | None:
    """The count of most likely tokens a request's field `name` asks for per token (None
    for none): -1 as `vocab_size`; a 400 naming it over `max_logprobs` (the server's
    --max-logprobs) or the vocabulary (`request.logprobs_count`)."""
    if k is None:
        return None
    try:
        return logprobs_count(name, k, max_logprobs, vocab_size, "the server's --max-logprobs")
    except ValueError as e:
        raise ApiError(400, str(e), name) from None


def _job_priority(body: dict, scheduling_policy: str) -> int:
    """vLLM's `priority` field: an int, lower served first (default 0); anything else
    under `scheduling_policy` "fcfs" is a 400, as vLLM's server answers."""
    priority = int_field(body, "priority", 0)
    if priority != 0 and scheduling_policy != "priority":
        msg = (
            f"got priority={priority} but priority scheduling is not enabled (the server "
            f"schedules {scheduling_policy!r}; --scheduling-policy priority enables it)"
        )
        raise ApiError(400, msg, "priority")
    return priority


def check_model(body: dict, model_name: str, lora_names: Collection[str] = ()) -> str | None:
    """The body's `model` (None if left out or null), which must be `model_name` or one
    of `lora_names` (the served adapters'): a 404 for another name, as OpenAI and vLLM
    answer, naming the served ones; a 400 for a non-string."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):  # (it was a 404, "not served here")
        raise ApiError(400, f"model must be a string, got model={model!r:.80}", "model")
    if model is not None and model != model_name and model not in lora_names:
        names = ", ".join(map(repr, [model_name, *lora_names]))
        msg = f"model {model!r} is not served here; {'they are' if lora_names else 'it is'} {names}"
        raise ApiError(404, msg, "model", "model_not_found")
    return model


# What a request's chat_template_kwargs may not set: the rendering's own arguments (a
# template from a request is vLLM's trust_request_chat_template, which we do not have).
_NOT_TEMPLATE_VARIABLES = frozenset({"messages", "chat_template", "template", "source", "add_bos"})


def chat_prompt(
    body: dict, tok, instead: str, *, add_bos: bool = False, tools: ToolRequest | None = None
) -> list[int]:
    """The token ids of a body's `messages` under the chat template, with vLLM's
    `continue_final_message` and `add_generation_prompt` and its `chat_template_kwargs`
    (more template variables, e.g. Qwen3's `enable_thinking`, which override the
    request's settings, as vLLM merges them); `instead`: the path a model
    that cannot chat should use (named in the 400); `add_bos`: BOS first even where the
    template writes none; `tools`: the request's, the template's `tools` variable. A
    request's own `chat_template` is a 400 (vLLM's without --trust-request-chat-template:
    it was ignored, and the messages rendered with the server's template)."""
    if tok is None or tok.chat_template is None:
        why = "no tokenizer" if tok is None else tok.chat_template_source
        raise ApiError(400, f"this model cannot chat: {why}; use {instead}")
    chat_messages(body.get("messages"))  # (a 400 naming a bad message before anything)
    if body.get("chat_template") is not None:  # vLLM's refusal without --trust-request-...
        msg = (
            "chat_template in a request is not supported (the server renders its own: "
            f"--chat-template FILE), got chat_template={body['chat_template']!r:.80}"
        )
        raise ApiError(400, msg, "chat_template")
    # vLLM's extensions: continue the last (assistant) message instead of opening a
    # new turn; add_generation_prompt then defaults to false (true with it: a 400).
    cont = bool_field(body, "continue_final_message")
    gen = body.get("add_generation_prompt")
    gen = not cont if gen is None else bool_field(body, "add_generation_prompt")
    flags = dict(add_generation_prompt=gen, continue_final_message=cont)
    extra = {} if tools is None else {"tools": tools.tools}
    more = body.get("chat_template_kwargs")  # vLLM's: they override the request's own
    if more is not None:
        if not isinstance(more, dict):
            msg = f"chat_template_kwargs must be an object, got chat_template_kwargs={more!r:.80}"
            raise ApiError(400, msg, "chat_template_kwargs")
        taken = sorted(set(more) & _NOT_TEMPLATE_VARIABLES)
        if taken:
            msg = f"chat_template_kwargs cannot set {', '.join(map(repr, taken))}"
            raise ApiError(400, msg, "chat_template_kwargs")
        for name in flags.keys() & more.keys():
            flags[name] = bool_field(more, name)
        extra |= {k: v for k, v in more.items() if k not in flags}
    try:
        return tok.encode_chat(
            body["messages"],  # as given: a template that loops over parts gets them
            add_bos=add_bos,
            **flags,
            **extra,
        )
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    except ImportError as e:
        raise ApiError(500, str(e)) from None


def tokenize(body: dict, *, model_name: str, tokenizer, max_model_len: int, lora_names=()) -> dict:
    """vLLM's `/tokenize` answer: `{count, max_model_len, tokens, token_strs}` for a body
    with `prompt` (a string; `add_special_tokens`, default true, adds the tokenizer's
    BOS as a completion's prompt gets it) or with `messages` (as a chat request renders
    them, with its `tools`; `add_special_tokens`, default false, adds BOS on top of the
    template's), and `return_token_strs` (each token's vocabulary string, else null).
    Its `model` may name a served LoRA adapter (`lora_names`), whose tokenizer is the
    model's.

    Raises:
      ApiError: 400 naming the bad field (or a model without a tokenizer), 404 for a
        model not served here.
    """
    check_model(body, model_name, lora_names)
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: prompts are token ids already")
    add = body.get("add_special_tokens")
    chat = body.get("messages") is not None
    add = (not chat) if add is None else bool_field(body, "add_special_tokens")
    if chat:
        if body.get("prompt") is not None:
            raise ApiError(400, "give prompt or messages, not both", "prompt")
        # vLLM's: the tools the template renders (as a chat request with them renders
        # them, whatever its tool_choice), so that the count is that request's.
        tools = read_tools({"tools": body.get("tools"), "tool_choice": "none"}, parser=None)
        ids = chat_prompt(body, tokenizer, "a prompt", add_bos=add, tools=tools)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            msg = f"prompt must be a string (or give messages), got prompt={prompt!r:.80}"
            raise ApiError(400, msg, "prompt")
        try:  # (the tokenizer's own BOS rule, as a completion's prompt: none for some)
            ids = tokenizer.encode(prompt, add_bos=None if add else False)
        except ValueError as e:  # a lone surrogate
            raise ApiError(400, f"prompt: {e}", "prompt") from None
    strs = None
    if bool_field(body, "return_token_strs"):
        strs = [tokenizer.tokenizer.id_to_token(i) for i in ids]
    return dict(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(body: dict, *, model_name: str, tokenizer, vocab_size: int, lora_names=()) -> dict:
    """vLLM's `/detokenize` answer: `{prompt}`, the text of the body's `tokens` (a list of
    token ids), special tokens included; `model` as `tokenize`'s.

    Raises:
      ApiError: 400 naming the bad field (or a model without a tokenizer), 404 for a
        model not served here.
    """
    check_model(body, model_name, lora_names)
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: it has no text for token ids")
    ids = body.get("tokens")
    if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
        raise ApiError(400, f"tokens must be a list of token ids, got tokens={ids!r:.80}", "tokens")
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        msg = f"tokens must be in [0, {vocab_size}), got {outside[:5]}"
        raise ApiError(400, msg, "tokens")
    return dict(prompt=tokenizer.decode(ids, skip_special_tokens=False))


def completion_prompts(prompt) -> list:
    """The prompts of a completions request: strings or token id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return [prompt]
        if all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt):
            return prompt
    raise ApiError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of token "
        f"id lists, got prompt={prompt!r:.80}",
        "prompt",
    )


def chat_messages(messages) -> list[dict]:
    """`messages` as the chat template gets them (`chat.normalize_messages`, as
    `LLM.chat` renders them: text parts joined, null content "", assistant tool calls'
    JSON arguments parsed), or a 400 naming the bad message and value."""
    try:
        return normalize_messages(messages)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), "messages") from None


def response_body(job: Job, head: dict, outs: dict, tokenizer) -> dict:
    """`openai_responses.response_body`, its chat choices' texts made calls where the
    request's tools ask for it (`ToolRequest.answer`), then, with echo, their content
    after the echoed one (as vLLM's, null content becomes the echoed text)."""
    body = openai_responses.response_body(job, head, outs, tokenizer)
    if job.tools is not None and job.tools.parses:
        for choice in body["choices"]:
            job.tools.answer(choice)
    if job.chat and job.echo is not None:
        for choice in body["choices"]:
            choice["message"]["content"] = job.echo[0] + (choice["message"]["content"] or "")
    return body
