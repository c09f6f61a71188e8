"""The HTTP server's streams: what a stream sent of one completion (`StreamedChoice`),
and the handler's streaming of an answer (`StreamingMixin`).

`pagedjax.http_server`'s handler streams each choice of a completions or chat answer in
chunks as its tokens come from the engine thread (`StreamingMixin._stream`, a base of
its `Handler`): a chunk's text is only what no later token changes, and its tokens' ids
and logprobs go with the piece that completes their text. `StreamedChoice` is that
handler's record of one choice; `chunk_context` the ids its next chunk's tokens are
named after (`render_logprobs(context=)`); `stream_chunk` and `stream_chunks` a
choice's chunks as sent, with the request's tool calls (`pagedjax.openai_api`
re-exports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedjax import openai_responses
from pagedjax.tokenizer import CONTEXT_IDS, name_context

if TYPE_CHECKING:
    from pagedjax.openai_api import Job

__all__ = ["StreamedChoice", "StreamingMixin", "chunk_context", "stream_chunk", "stream_chunks"]


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


class StreamingMixin:
    """`http_server.Handler`'s Server-Sent Events answer of a job (`_stream`): it reads
    the handler's `server.tokenizer` and `server.stop_ids`, and writes through `HttpIO`'s
    `_start_stream`, `_event` and `_end_stream` (`pagedjax.http_io`)."""

    def _stream(self, job: Job, head: dict, events) -> None:
        tok, sp = self.server.tokenizer, job.params
        k, skip = sp.logprobs, sp.skip_special_tokens
        # The engine leaves out of the text the stop string and what follows it (what
        # follows it only, with include_stop_str_in_output), and the stop token's own
        # text (kept with include_stop_str_in_output).
        keep = sp.include_stop_str_in_output
        hold = 0 if keep else max(map(len, sp.stop), default=1) - 1
        stop_ids = frozenset() if keep else self.server.stop_ids(sp)
        choices: dict[tuple[str, int], StreamedChoice] = {}  # by (rid, completion index)
        prompts = dict(zip(job.rids, job.prompts, strict=True))
        # Completions' echo: a choice's first chunk starts with its prompt's text (and its
        # logprobs, from the "prompt" event the engine thread sends before its first token).
        echo = None if job.chat or job.echo is None else dict(zip(job.rids, job.echo, strict=True))
        prompt_lps: dict[str, list] = {}  # by rid

        def send(sent: dict) -> None:
            # OpenAI's: with include_usage, every chunk has "usage": null but the last,
            # usage-only one (its `choices` []); without it, no chunk has the field.
            self._event({**sent, "usage": None} if job.include_usage else sent)

        def chunk(rid, i, c: StreamedChoice, text, ids=(), entries=(), finish=None):
            lp = echoed = None
            if echo is not None and not c.started:
                text = echo[rid] + text
                c.offset = len(echo[rid]) if tok is not None else 0
                if k is not None:
                    echoed = openai_responses.echo_logprobs(
                        tok,
                        prompts[rid],
                        prompt_lps[rid],
                        k,
                        skip_special_tokens=skip,
                        text=echo[rid],
                    )
            if k is not None:
                lp = openai_responses.render_logprobs(
                    tok,
                    ids,
                    entries,
                    k,
                    chat=job.chat,
                    offset=c.offset,
                    context=c.before,
                    skip_special_tokens=skip,
                )
                c.offset += 0 if job.chat or tok is None else sum(map(len, lp["tokens"]))
                lp = lp if echoed is None else openai_responses.join_logprobs(echoed, lp)
            c.before = chunk_context(tok, [*c.before, *ids], skip)
            c.num_tokens += len(ids)
            first = job.prompt_token_ids and not job.chat and not c.started
            c.started = True
            index = openai_responses.choice_index(job, rid, i)
            # (none: text a tool call may hold back, and nothing else; two: the calls,
            # then the finish_reason)
            for sent in stream_chunks(
                job,
                head,
                index,
                text,
                finish,
                lp,
                token_ids=ids,
                prompt_token_ids=prompts[rid] if first else None,
            ):
                send(sent)

        outs = []
        for event in events:
            if not self._streaming:
                self._start_stream()
                for role in openai_responses.role_chunks(job, head):
                    send(role)
            if event[0] == "prompt":
                prompt_lps[event[1]] = event[2]
            elif event[0] == "token":
                _, rid, i, token, *entry = event  # the entry: with logprobs only
                c = choices.get((rid, i))
                if c is None:
                    c = choices[rid, i] = StreamedChoice(tok, prompts[rid], skip)
                if c.decoder is None:  # no tokenizer: no text, a chunk per token
                    chunk(rid, i, c, "", [token], entry)
                    continue
                before = len(c.decoder.text)
                c.decoder.add(token)
                text = c.decoder.text
                c.pending.append((token, entry[0] if entry else None, len(text)))
                # With stop strings, or if it may be a stop token, this token's text waits
                # for the next token: the engine may stop on it and cut the text there.
                end = before - hold if sp.stop or token in stop_ids else len(text)
                if end > c.sent or (echo is not None and not c.started):  # (the echo now)
                    end = max(end, c.sent)
                    # A token's id and logprobs go with the piece that completes its text.
                    n = sum(1 for _, _, token_end in c.pending if token_end <= end)
                    done, c.pending = c.pending[:n], c.pending[n:]
                    ids, entries = [t for t, _, _ in done], [e for _, e, _ in done]
                    chunk(rid, i, c, text[c.sent : end], ids, entries)
                    c.sent = end
            else:
                _, rid, out = event
                outs.append(out)
                prompt_lps.setdefault(rid, out.prompt_logprobs)  # (a choice that comes whole)
                for o in out.outputs:
                    # A choice no token streamed (a beam search's: its beams are known
                    # only at the end; one `Job.streams_tokens` holds) goes out whole,
                    # its tokens named after the prompt.
                    c = choices.get((rid, o.index)) or StreamedChoice(tok, prompts[rid], skip)
                    # The rest, from the final output: its text and tokens as not streamed.
                    ids = o.token_ids[c.num_tokens :]
                    entries = o.logprobs[c.num_tokens :] if k is not None else ()
                    finish = o.finish_reason or "stop"
                    chunk(rid, o.index, c, o.text[c.sent :], ids, entries, finish)
        if job.include_usage:
            counts = openai_responses.usage(outs, prompt_tokens_details=job.prompt_tokens_details)
            self._event(dict(**head, choices=[], usage=counts))
        self._end_stream()
