"""OpenAI's completions and chat completions answers, from the engine's outputs.

The builders turn `RequestOutput`s back into OpenAI's shapes for a `Job`
(`pagedjax.openai_api.parse_job`'s): a whole answer (`response_body`), or the chunks of
a streamed one (`role_chunks`, `stream_chunk`, `usage`); `render_logprobs` renders the
logprobs of any run of a completion's tokens (all of them, or a chunk's), each token
named where it stands (`tokenizer.token_names`; vLLM's `"token_id:<id>"` without a
tokenizer, with every `text_offset` 0). Nothing here touches the engine, so it runs on
any thread. `pagedjax.openai_api` re-exports all of it.

Echo (`Job.echo`, `pagedjax.openai_echo`), as vLLM answers it: a completions choice's
text is its prompt's text then its own, and its logprobs cover the prompt's tokens
(`echo_logprobs`: the first has none, so its `token_logprobs` and `top_logprobs` are
null; their `text_offset`s index the echoed text, which a string prompt's names need not
spell) then its own, whose `text_offset`s start at the prompt text's length; a chat
choice's content starts with the last message's (`pagedjax.openai_api.response_body`).
vLLM's `prompt_logprobs` (`Job.prompt_logprobs`) are rendered by
`render_prompt_logprobs`: on each completions choice, beside a chat answer's choices.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pagedjax.tokenizer import name_context, token_names

if TYPE_CHECKING:
    from pagedjax.openai_api import Job

__all__ = [
    "chat_logprobs",
    "choice_index",
    "completion_logprobs",
    "echo_logprobs",
    "join_logprobs",
    "render_logprobs",
    "render_prompt_logprobs",
    "response_body",
    "response_head",
    "role_chunks",
    "stream_chunk",
    "token_texts",
    "usage",
]


def _token_names(tok, context: list[int], token_ids: list[int], skip: bool) -> dict[int, str]:
    """{id: name} of one position's candidate tokens (`tokenizer.token_names`; `skip`:
    the request's skip_special_tokens); vLLM's "token_id:<id>" without a tokenizer."""
    if tok is None:
        return {t: f"token_id:{t}" for t in token_ids}
    names = token_names(tok, token_ids, context=context, skip_special_tokens=skip)
    return dict(zip(token_ids, names, strict=True))


def _contexts(tok, context, token_ids, skip: bool) -> list[list[int]]:
    """The ids each of `token_ids` is named after: of `context` and the tokens before
    it, the few that name it as all of them do (`tokenizer.name_context`: past a run of
    byte-fallback tokens, which the last few alone may be); none without a tokenizer."""
    if tok is None:
        return [[] for _ in token_ids]
    ids = [*context, *token_ids]
    first = len(ids) - len(token_ids)
    return [
        name_context(tok, ids, first + j, skip_special_tokens=skip) for j in range(len(token_ids))
    ]


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI's convention


def _top(entry: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely of a logprobs entry (the sampled token first, then the top k)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tok, c, k: int, prompt_ids=(), *, skip_special_tokens=True) -> dict:
    """OpenAI completions-style logprobs of one completion (a `CompletionOutput`) of the
    prompt `prompt_ids` (`skip_special_tokens`: the request's, see `render_logprobs`)."""
    return render_logprobs(
        tok,
        c.token_ids,
        c.logprobs,
        k,
        chat=False,
        context=prompt_ids,
        skip_special_tokens=skip_special_tokens,
    )


def chat_logprobs(tok, c, k: int, prompt_ids=(), *, skip_special_tokens=True) -> dict:
    """OpenAI chat-style logprobs of one completion (a `CompletionOutput`) of the prompt
    `prompt_ids` (`skip_special_tokens`: the request's, see `render_logprobs`)."""
    return render_logprobs(
        tok,
        c.token_ids,
        c.logprobs,
        k,
        chat=True,
        context=prompt_ids,
        skip_special_tokens=skip_special_tokens,
    )


def render_logprobs(
    tok,
    token_ids: list[int],
    entries: list[dict],
    k: int,
    *,
    chat: bool,
    offset: int = 0,
    context=(),
    skip_special_tokens: bool = True,
) -> dict:
    """OpenAI-style logprobs of a run of a completion's tokens (all, or a stream chunk's).

    Args:
      tok: the tokenizer that names the tokens (None: "token_id:<id>", and every
        text_offset is 0, the length of the empty text).
      token_ids: the run's tokens.
      entries: their logprobs entries ({token id: logprob}, the token first).
      k: how many of the most likely tokens each entry lists (completions' add the
        sampled token when it is not among them, as OpenAI's do).
      chat: chat's `{content: [...]}`, else completions' `{tokens, token_logprobs,
        top_logprobs, text_offset}`.
      offset: completions' text_offset of the run's first token (the lengths of the
        completion's earlier token names), so chunks' offsets continue each other's.
      context: the ids before the run (the prompt's, then the completion's earlier
        ones): each token, and each alternative to it, is named as it reads there.
      skip_special_tokens: the request's: whether the text (and so the context the
        names read after) leaves special tokens out.
    """
    # Per position: its k most likely, and the names of those and the sampled token.
    tops = [_top(e, k) for e in entries]
    names = [
        _token_names(tok, b, [t, *(u for u, _ in top)], skip_special_tokens)
        for t, top, b in zip(
            token_ids, tops, _contexts(tok, context, token_ids, skip_special_tokens), strict=True
        )
    ]
    if chat:

        def item(s, x):
            return dict(token=s, logprob=_lp(x), bytes=list(s.encode()))

        content = [
            {**item(name[t], e[t]), "top_logprobs": [item(name[u], x) for u, x in top]}
            for t, e, top, name in zip(token_ids, entries, tops, names, strict=True)
        ]
        return dict(content=content)
    tokens = [name[t] for t, name in zip(token_ids, names, strict=True)]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s) if tok is not None else 0
    top_logprobs = []  # dicts keyed by text: of two tokens with one text, the likelier stays
    for t, e, top, name in zip(token_ids, entries, tops, names, strict=True):
        # OpenAI's completions: the k most likely and always the sampled token (k + 1 at
        # most; chat's top_logprobs are the k most likely only).
        top_logprobs.append({})
        for u, x in [*top, (t, e[t])]:
            top_logprobs[-1].setdefault(name[u], _lp(x))
    return dict(
        tokens=tokens,
        token_logprobs=[_lp(e[t]) for t, e in zip(token_ids, entries, strict=True)],
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


def token_texts(tok, token_ids, *, context=(), skip_special_tokens: bool = True) -> list[str]:
    """Each token's name where it stands, after `context` and the tokens before it, as
    `render_logprobs` names it (an echoed token id prompt's text is these joined)."""
    pairs = zip(token_ids, _contexts(tok, context, token_ids, skip_special_tokens), strict=True)
    return [_token_names(tok, b, [t], skip_special_tokens)[t] for t, b in pairs]


def echo_logprobs(
    tok, prompt_ids, entries, k: int, *, skip_special_tokens: bool = True, text: str | None = None
) -> dict:
    """Completions-style logprobs of an echoed prompt (`render_logprobs`' format, offsets
    from 0), from its `RequestOutput.prompt_logprobs` `entries` (None first): the first
    token has no logprob, so its `token_logprobs` and `top_logprobs` are None, as vLLM's.

    `text`: the echoed text (`Job.echo`'s), which the offsets index (`_text_offsets`): a
    string prompt is echoed as given, which its tokens' names need not spell (a BOS the
    tokenizer added is named "<s>"), and the completion's offsets start at its length.
    None: the names' lengths added up (they spell a token id prompt's echoed text).
    """
    first = token_texts(tok, prompt_ids[:1], skip_special_tokens=skip_special_tokens)
    head = dict(tokens=first, token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    rest = render_logprobs(
        tok,
        prompt_ids[1:],
        entries[1:],
        k,
        chat=False,
        offset=len(first[0]) if tok is not None else 0,
        context=prompt_ids[:1],
        skip_special_tokens=skip_special_tokens,
    )
    joined = join_logprobs(head, rest)
    if text is not None:
        joined["text_offset"] = _text_offsets(text, joined["tokens"])
    return joined


def _text_offsets(text: str, names: list[str]) -> list[int]:
    """Where each of a run of token names starts in `text`, which they may not spell.

    A name the text does not show where it stands (an added BOS's "<s>", a byte-fallback
    token's U+FFFD) starts there and takes no room; the next name the text shows within
    the length of those skipped starts where the text has it. Names that spell the text
    get their lengths added up, as `render_logprobs` gives them. The offsets never
    decrease and never pass the text's end, where an echoed completion's start.
    """
    offsets, at, skipped = [], 0, 0
    for s in names:
        if skipped and not text.startswith(s, at):
            found = text.find(s, at, at + skipped + len(s))
            at = at if found < 0 else found
        offsets.append(at)
        if text.startswith(s, at):
            at, skipped = at + len(s), 0
        else:
            skipped += len(s)
    return offsets


def join_logprobs(first: dict, then: dict) -> dict:
    """Completions-style logprobs of one run of tokens followed by another's."""
    return {key: first[key] + then[key] for key in first}


def render_prompt_logprobs(entries) -> list | None:
    """vLLM's `prompt_logprobs` field from `RequestOutput.prompt_logprobs`: per prompt
    token None (the first) or {"token id": {logprob, rank, decoded_token}} (the prompt
    token, then the most likely; -inf as -9999.0, as vLLM clamps it)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): dict(
                logprob=_lp(float(x)),
                rank=getattr(x, "rank", None),
                decoded_token=getattr(x, "decoded_token", None),
            )
            for t, x in e.items()
        }
        for e in entries
    ]


def usage(outs, *, prompt_tokens_details: bool = False) -> dict:
    """The token counts of some `RequestOutput`s (a request's, one per prompt).

    `prompt_tokens_details` (the server's `--enable-prompt-tokens-details`) adds
    `prompt_tokens_details: {cached_tokens}`: the prompt tokens read from the prefix
    cache (`RequestOutput.num_cached_tokens`, once per prompt, whatever its `n`), summed
    over the prompts as `prompt_tokens` is. vLLM takes one prompt's count instead (the
    last one's, streamed the first one's) and leaves the field out when it is 0.
    """
    outs = list(outs)
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs)
    counts = dict(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
    if prompt_tokens_details:
        counts["prompt_tokens_details"] = dict(cached_tokens=sum(o.num_cached_tokens for o in outs))
    return counts


def response_head(job: Job, model_name: str) -> dict:
    """The fields every answer (and every chunk) of the job starts with; `model` is the
    name the request gave (a LoRA adapter's, say), else `model_name`, the served model's."""
    kind = "chat.completion" if job.chat else "text_completion"
    return dict(
        id=("chatcmpl-" if job.chat else "cmpl-") + job.id,
        object=kind + (".chunk" if job.stream and job.chat else ""),
        created=job.created,
        model=job.model or model_name,
    )


def choice_index(job: Job, rid: str, completion: int) -> int:
    """The choice index of a prompt's completion: `prompt * n + completion`."""
    return int(rid.rpartition("-")[2]) * job.params.n + completion  # rid: f"{job.id}-{prompt}"


def response_body(job: Job, head: dict, outs: dict, tokenizer) -> dict:
    """The whole (non-streamed) answer, from each request id's `RequestOutput` (as
    `Job.output` made it: with max_tokens 0, without the token the engine generated)."""
    k, choices = job.params.logprobs, []
    skip = job.params.skip_special_tokens
    for p, (rid, prompt) in enumerate(zip(job.rids, job.prompts, strict=True)):
        out = outs[rid]
        echo = None if job.chat or job.echo is None else job.echo[p]
        for c in out.outputs:
            choice = dict(index=choice_index(job, rid, c.index))
            render = chat_logprobs if job.chat else completion_logprobs
            if k is None:
                lp = None
            elif echo is not None:  # the prompt's tokens, then the completion's
                lp = _echoed_logprobs(tokenizer, echo, prompt, out.prompt_logprobs, c, k, skip)
            else:
                lp = render(tokenizer, c, k, prompt, skip_special_tokens=skip)
            if job.chat:
                choice["message"] = dict(role="assistant", content=c.text)
                choice["logprobs"] = lp
            else:
                choice["text"] = c.text if echo is None else echo + c.text
                choice["logprobs"] = lp
                if job.prompt_logprobs:  # vLLM: on each completions choice
                    choice["prompt_logprobs"] = render_prompt_logprobs(out.prompt_logprobs)
                if job.prompt_token_ids:  # vLLM: on each completions choice
                    choice["prompt_token_ids"] = list(prompt)
            if job.token_ids:
                choice["token_ids"] = list(c.token_ids)
            choice["finish_reason"] = c.finish_reason
            choices.append(choice)
    counts = usage(outs.values(), prompt_tokens_details=job.prompt_tokens_details)
    body = dict(**head, choices=choices, usage=counts)
    if job.chat and job.prompt_logprobs:  # vLLM: once, beside the choices
        body["prompt_logprobs"] = render_prompt_logprobs(outs[job.rids[0]].prompt_logprobs)
    if job.chat and job.prompt_token_ids:  # vLLM: once, beside the choices
        body["prompt_token_ids"] = list(job.prompts[0])
    return body


def _echoed_logprobs(tok, echo: str, prompt, entries, c, k: int, skip: bool) -> dict:
    """A completion's logprobs after its echoed prompt's (`echo`: the prompt's text,
    where the completion's offsets start; `entries`: its prompt logprobs)."""
    return join_logprobs(
        echo_logprobs(tok, prompt, entries, k, skip_special_tokens=skip, text=echo),
        render_logprobs(
            tok,
            c.token_ids,
            c.logprobs,
            k,
            chat=False,
            offset=len(echo) if tok is not None else 0,
            context=prompt,
            skip_special_tokens=skip,
        ),
    )


def role_chunks(job: Job, head: dict) -> list[dict]:
    """A chat stream's first chunks: `delta: {role}` for each choice, then, with echo,
    `delta: {content}` with the echoed content for each, as vLLM sends them (none for
    completions)."""
    if not job.chat:
        return []
    chunks = []
    num_choices = len(job.prompts) * job.params.n
    for c in range(num_choices):
        delta = dict(role="assistant", content="")
        choice = dict(index=c, delta=delta, logprobs=None, finish_reason=None)
        if job.token_ids:
            choice["token_ids"] = []
        chunks.append(dict(**head, choices=[choice]))
        if job.prompt_token_ids:
            chunks[-1]["prompt_token_ids"] = list(job.prompts[0])
    if job.echo is not None and job.echo[0]:
        chunks += [stream_chunk(job, head, c, job.echo[0]) for c in range(num_choices)]
    return chunks


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
) -> dict:
    """A stream's chunk: choice `index`'s next piece of text, or its last (`finish`).

    `logprobs` (from `render_logprobs`, or None) are those of the tokens whose text is
    complete with this piece (see scripts/serve.py); so are `token_ids`, in the chunk
    when `job.token_ids`. `prompt_token_ids`: the prompt's, for a completions choice's
    first chunk when `job.prompt_token_ids` (None: none).
    """
    choice = dict(index=index)
    if job.chat:
        choice["delta"] = {"content": text} if text or finish is None else {}
        choice["logprobs"] = logprobs
    else:
        choice.update(text=text, logprobs=logprobs)
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = list(prompt_token_ids)
    if job.token_ids:
        choice["token_ids"] = list(token_ids)
    choice["finish_reason"] = finish
    return dict(**head, choices=[choice])
