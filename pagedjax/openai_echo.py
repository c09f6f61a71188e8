"""Echo and prompt logprobs on OpenAI's endpoints, as vLLM serves them: the request side.

`read_echo` reads a request's `echo` (a boolean) and vLLM's `prompt_logprobs` (an int
k, or -1 for the whole vocabulary, within the server's --max-logprobs) into whether the
answer echoes and how many of each prompt token's most likely tokens the engine
computes (`SamplingParams.prompt_logprobs`), as vLLM's `to_sampling_params` sets it:
the field's value; else, with echo, completions' `logprobs` (the echoed logprobs cover
the prompt) and chat's `top_logprobs` (0 without it: a chat answer with echo carries
`prompt_logprobs`, as vLLM's does). Streamed, `prompt_logprobs` above 0 is a 400, as
vLLM's, and a stream answers `prompt_logprobs` nowhere (as vLLM's), so the prompt's
logprobs are computed only for completions' echo with `logprobs`, which streams them
(each choice's first chunk: its prompt's text and logprobs, then its tokens as they come).

What is echoed (`echo_texts`, `chat_echo_text`):

- completions: each prompt's text before each of its choices' texts: a string prompt as
  given (vLLM's), a token id prompt (or a string truncate_prompt_tokens cut, not one it
  left whole) as the tokenizer decodes its ids, special tokens shown (vLLM's
  `tokenizer.decode`). The echoed logprobs' `text_offset`s index that text, which the
  tokens' names need not spell (`openai_responses.echo_logprobs`). Without a tokenizer
  the text is "".
- chat: the last message's content before each choice's content, when the answer
  continues that message's role (the assistant's with `add_generation_prompt`; the
  last message's own without it, as with `continue_final_message`), else "".

`max_tokens: 0` with echo on /v1/completions (vLLM's: the prompt alone, with its
logprobs) runs the request with max_tokens 1, since the engine generates at least one
token, and `without_generated` drops that token from its output: the choices' texts are
the prompt's, their logprobs the prompt's, `token_ids` [] and `usage.completion_tokens`
0 (vLLM counts the dropped token there), finish_reason "length".

The response builders (`pagedjax.openai_responses`) render the echo and the
`prompt_logprobs`; `pagedjax.openai_api.parse_job` calls these.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pagedjax.chat import normalize_message
from pagedjax.openai_fields import ApiError, bool_field, int_field
from pagedjax.request import RequestOutput, logprobs_count

if TYPE_CHECKING:
    from pagedjax.openai_api import Job

__all__ = ["chat_echo_text", "echo_texts", "read_echo", "streams_tokens", "without_generated"]


def read_echo(
    body: dict,
    *,
    chat: bool,
    stream: bool,
    k: int | None,
    vocab_size: int,
    max_logprobs: int,
) -> tuple[bool, int | None]:
    """(echo, the prompt logprobs count the engine computes, or None) of a request (see
    the module docstring); `k`: its completions' `logprobs` or chat's `top_logprobs`,
    as resolved (-1 made `vocab_size`), or None.

    Raises:
      ApiError: 400 naming `echo` or `prompt_logprobs` (not a boolean, not an int >= -1,
        over `max_logprobs` or the vocabulary, above 0 with stream=true).
    """
    echo = bool_field(body, "echo")
    given = int_field(body, "prompt_logprobs", None)
    if given is not None:
        if stream and (given > 0 or given == -1):  # vLLM's refusal
            msg = f"prompt_logprobs are not available with stream=true, got prompt_logprobs={given}"
            raise ApiError(400, msg, "prompt_logprobs")
        cap = "the server's --max-logprobs"
        try:
            given = logprobs_count("prompt_logprobs", given, max_logprobs, vocab_size, cap)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt_logprobs") from None
    if echo and not chat and k is not None:  # the echoed logprobs' (streamed too)
        return echo, k if given is None else given
    if given is None and echo and chat:
        given = k or 0
    return echo, None if stream else given  # (computed only to be answered)


def echo_texts(body: dict, chat: bool, tok, prompts: list, ids: list[list[int]]):
    """The text echoed before each prompt's choices (see the module docstring) of a
    request whose prompts and messages `openai_api.parse_job` checked: `prompts` as the
    body gave them, `ids` as they run."""
    if chat:
        return [chat_echo_text(body)]
    if tok is None:
        return ["" for _ in ids]
    trunc = body.get("truncate_prompt_tokens") is not None
    return [
        p
        if isinstance(p, str) and not (trunc and x != tok.encode(p))  # (not cut: as given)
        else tok.decode(x, skip_special_tokens=False)
        for p, x in zip(prompts, ids, strict=True)
    ]


def chat_echo_text(body: dict) -> str:
    """The content a chat answer with echo starts with: the last message's (as
    `chat.normalize_message` reads it: text parts joined with newlines) when the answer
    continues its role, else ""."""
    gen = body.get("add_generation_prompt")
    gen = not body.get("continue_final_message") if gen is None else gen
    messages = body["messages"]
    last = normalize_message(len(messages) - 1, messages[-1])
    return last["content"] if last["role"] == ("assistant" if gen else last["role"]) else ""


def streams_tokens(job: Job) -> bool:
    """Whether a `Job`'s stream sends its choices' tokens as they come: not with
    max_tokens 0 (no token to send: each choice goes out whole when it ends). With echo
    and logprobs, the engine thread sends the prompt's logprobs before the first token
    (`pagedjax.serving`'s "prompt" event), which a choice's first chunk carries."""
    return job.stream and not job.echo_only


def without_generated(out: RequestOutput) -> RequestOutput:
    """`out` with its completions' generated tokens dropped (max_tokens 0 with echo):
    no text, tokens or logprobs, finish_reason "length" (unless aborted)."""
    outputs = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            cumulative_logprob=0.0,
            finish_reason="abort" if c.finish_reason == "abort" else "length",
            stop_reason=None,
            logprobs=None if c.logprobs is None else [],
        )
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=outputs)
