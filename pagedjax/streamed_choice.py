"""What a stream sent of one completion (`StreamedChoice`), for the HTTP server's streams.

`pagedjax.http_server`'s handler streams each choice of a completions or chat answer in
chunks as its tokens come from the engine thread: a chunk's text is only what no later
token changes, and its tokens' ids and logprobs go with the piece that completes their
text. `StreamedChoice` is that handler's record of one choice; `chunk_context` the ids
its next chunk's tokens are named after (`render_logprobs(context=)`); `stream_chunk`
and `stream_chunks` a choice's chunks as sent, with the request's tool calls
(`pagedjax.openai_api` re-exports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedjax import openai_responses
from pagedjax.tokenizer import CONTEXT_IDS, name_context

if TYPE_CHECKING:
    from pagedjax.openai_api import Job

__all__ = ["StreamedChoice", "chunk_context", "stream_chunk", "stream_chunks"]


class StreamedChoice:
    """What a stream sent of one completion.

    Attributes:
      decoder: its incremental detokenizer (`Tokenizer.stream(context=prompt ids)`, with
        the request's skip_special_tokens, as the engine decodes the final text), None
        without a tokenizer (or without tokens).
      sent: characters of its text streamed.
      pending: (token id, logprobs entry or None, where its text ends in the decoder's
        text) of each token received but not streamed yet (its text held back).
      num_tokens: tokens streamed (their ids and logprobs).
      offset: completions' `text_offset` of the next token whose logprobs are streamed.
      started: a chunk of it went out.
      before: the last ids before its next chunk (the prompt's, then its own), which
        name that chunk's tokens (`render_logprobs(context=)`).
    """

    __slots__ = ("decoder", "sent", "pending", "num_tokens", "offset", "started", "before")

    def __init__(self, tok, prompt_ids, skip_special_tokens: bool = True):
        skip = skip_special_tokens
        self.decoder = (
            None if tok is None else tok.stream(skip_special_tokens=skip, context=prompt_ids)
        )
        self.before = chunk_context(tok, list(prompt_ids), skip)  # the ids before the next chunk's
        self.sent = self.num_tokens = self.offset = 0
        self.pending: list[tuple[int, dict | None, int]] = []
        self.started = False


def chunk_context(tok, ids: list[int], skip: bool) -> list[int]:
    """The tail of `ids` that names the tokens after them as all of `ids` do, with the
    byte-fallback run it ends in, so that the next chunk's ids can be appended
    (`tokenizer.name_context`; its last CONTEXT_IDS ids without a tokenizer)."""
    if tok is None:
        return ids[-CONTEXT_IDS:]
    return name_context(tok, ids, skip_special_tokens=skip, with_run=True)


def stream_chunk(
    job: Job,
    head: dict,
    index: int,
    text: str,
    finish: str | None = None,
    logprobs=None,
    *,
    token_ids=(),
    prompt_token_ids=None,
) -> dict | None:
    """`openai_responses.stream_chunk`, with only what of `text` is surely content where
    the request's tools ask for calls (`ToolStream`), and the calls in the last chunk;
    None where that leaves the chunk nothing to carry (as vLLM, no chunk is sent)."""
    calls = None
    if job.tools is not None and job.tools.parses:
        text, calls, finish = job.tools.stream(index).next(text, finish)
        if not text and finish is None and logprobs is None and not job.token_ids:
            return None
    chunk = openai_responses.stream_chunk(
        job,
        head,
        index,
        text,
        finish,
        logprobs,
        token_ids=token_ids,
        prompt_token_ids=prompt_token_ids,
    )
    if calls:
        chunk["choices"][0]["delta"]["tool_calls"] = calls
    return chunk


def stream_chunks(*args, **kwargs) -> list[dict]:
    """`stream_chunk`'s chunk as it is sent (its arguments): none where it is None, and
    one that carries tool calls and the choice's finish_reason as two, the calls then
    `{"delta": {}, "finish_reason": ...}`, as OpenAI streams them (the openai client's
    stream helper reads a chunk's finish_reason before its calls, so it would never end
    the last call: no `tool_calls.function.arguments.done` event)."""
    chunk = stream_chunk(*args, **kwargs)
    if chunk is None:
        return []
    (choice,) = chunk["choices"]
    if choice["finish_reason"] is None or "tool_calls" not in choice.get("delta", {}):
        return [chunk]
    end = {**choice, "delta": {}, "logprobs": None}
    if "token_ids" in choice:
        end["token_ids"] = []
    choice["finish_reason"] = None
    return [chunk, {**chunk, "choices": [end]}]
