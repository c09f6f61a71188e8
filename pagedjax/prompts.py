"""Prompts as the engine takes them: text, token ids, or vLLM's prompt dicts
(`unpack_prompt`), encoded and checked on the host (`encode_prompt`), truncated as
`SamplingParams.truncate_prompt_tokens` asks (`check_truncation`), and a request's bad
words as the token sequences they ban (`encode_bad_words`). `pagedjax.request`
re-exports those. Also, moved here from `pagedjax.engine`: a prompt dict's cache salt
set in its request's params (`salted_prompt`), `LLM.generate`'s arguments as a list of
prompts and one of sampling params (`request_lists`), and `LLM.chat`'s conversations
rendered into prompts (`chat_prompts`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedjax.config import is_token_id

if TYPE_CHECKING:
    from pagedjax.request import SamplingParams

__all__ = [
    "Prompt",
    "chat_prompts",
    "check_truncation",
    "encode_bad_words",
    "encode_prompt",
    "prompt_text",
    "request_lists",
    "salted_prompt",
    "unpack_prompt",
]

# A prompt: text, token ids, or vLLM's prompt dicts ({"prompt": ...} or
# {"prompt_token_ids": ...}, `unpack_prompt`).
Prompt = str | Sequence[int] | Mapping


def encode_bad_words(words: Sequence[str], tokenizer, vocab_size: int) -> list[tuple[int, ...]]:
    """The token sequences `SamplingParams.bad_words` ban, as vLLM's
    `update_from_tokenizer`: each word with its leading whitespace stripped, tokenized
    without special tokens, then with one space before it when that encodes to another
    first token and as many tokens (the word inside a text, for tokenizers that fold the
    space into the word's first token). Duplicates are dropped, order kept.

    Raises:
      ValueError: no tokenizer, a word that encodes to no tokens, or to ids outside the
        vocabulary [0, vocab_size).
    """
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; this model has none")
    out = {}
    for word in words:
        ids = tuple(tokenizer.encode(word.lstrip(), add_bos=False))
        if not ids:
            raise ValueError(f"bad_words entry {word!r:.80} encodes to no tokens")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_bos=False))
        for seq in (ids, spaced) if len(spaced) == len(ids) and spaced[0] != ids[0] else (ids,):
            bad = [t for t in seq if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"bad_words entry {word!r:.80} encodes to token ids {bad[:5]} outside "
                    f"the vocabulary [0, {vocab_size})"
                )
            out[seq] = None
    return list(out)


def encode_prompt(
    prompt: Prompt,
    tokenizer,
    vocab_size: int,
    max_model_len: int,
    *,
    truncate_prompt_tokens: int | None = None,
) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text or ids (a sequence of ints, or
    a 1-D integer numpy or JAX array; or as vLLM's prompt dicts, `unpack_prompt`; a
    TokensPrompt's text comes back as given, `prompt_text`), validated.

    `truncate_prompt_tokens` (`SamplingParams`'): keep only the last k ids (-1: the
    last max_model_len; a text's BOS, added by the tokenizer, stays first), before the
    checks below. max_model_len ids leave no room to generate, so -1 (as k =
    max_model_len) passes a shorter prompt whole and refuses a longer one (ValueError).

    Raises:
      ValueError: empty prompt, text without a tokenizer, ids outside the vocabulary,
        no room left to generate under `max_model_len`, or a bad
        `truncate_prompt_tokens` (`check_truncation`).
      TypeError: a prompt neither text nor a sequence of ids (a set included), a
        dict `unpack_prompt` refuses, or ids that are not ints.
    """
    k = check_truncation(truncate_prompt_tokens, max_model_len)
    given_text = None
    if isinstance(prompt, Mapping):  # (read as its keys, it would be ids "prompt", ...)
        given_text = prompt_text(prompt)
        prompt, _ = unpack_prompt(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as token id lists")
        if not prompt:
            raise ValueError("prompt is empty")
        text, ids = prompt, tokenizer.encode(prompt)
    else:
        # bytes would pass as ids (their byte values); an int as a prompt is most likely
        # a flat list of ids given as the list of prompts ([[1, 2, 3]] is one prompt).
        what = f"a prompt must be a str or a list of token ids, got {prompt!r:.80}"
        if isinstance(prompt, (bytes, bytearray, set, frozenset)):  # (a set has no order)
            raise TypeError(what)
        array = _as_array(prompt)  # (a JAX array's ids in one copy, not one slice each)
        try:
            text, ids = None, list(prompt if array is None or array.ndim != 1 else array.tolist())
        except TypeError:
            raise TypeError(what) from None
        if not all(map(is_token_id, ids)):
            raise TypeError(f"token id prompts must be lists of ints, got {prompt!r:.80}")
        ids = [operator.index(i) for i in ids]
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    cut = ""
    if k is not None and len(ids) > k:
        bos = getattr(tokenizer, "bos_token_id", None)
        added = text is not None and getattr(tokenizer, "add_bos", False) and ids[0] == bos
        head = ids[:1] if added else []
        ids = head + ids[len(ids) - k + len(head) :]
        cut = f" after truncate_prompt_tokens={truncate_prompt_tokens}"
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens{cut}; max_model_len={max_model_len} leaves no "
            "room to generate"
        )
    return (text if given_text is None else given_text), ids


# vLLM's TextPrompt / TokensPrompt keys that pagedjax has no use for.
_UNSUPPORTED_PROMPT_KEYS = (
    "multi_modal_data",
    "mm_processor_kwargs",
    "prompt_embeds",
    "token_type_ids",
)


def unpack_prompt(prompt: Mapping) -> tuple[str | Sequence[int], str | None]:
    """(its text or token ids, its cache salt or None) of a prompt given as vLLM's
    `TextPrompt` ({"prompt": str}) or `TokensPrompt` ({"prompt_token_ids": [ids]},
    optionally with the "prompt" text they encode, which the ids win over: they come
    back, and the text is `prompt_text`'s), either with an optional "cache_salt" (a str,
    as `SamplingParams.cache_salt`).

    Raises:
      TypeError: neither "prompt" nor "prompt_token_ids", another key (multi-modal data,
        token type ids and prompt embeddings are not supported; given as None, as vLLM
        takes them, they are left out), a "prompt" that is not a str, or a cache salt
        that is not a str.
    """
    keys = {k for k, v in prompt.items() if v is not None or k not in _UNSUPPORTED_PROMPT_KEYS}
    given = keys & {"prompt", "prompt_token_ids"}
    other = sorted(map(str, keys - given - {"cache_salt"}))
    unsupported = [k for k in other if k in _UNSUPPORTED_PROMPT_KEYS]
    if not given and not unsupported:
        raise TypeError(
            "a prompt dict (vLLM's TextPrompt / TokensPrompt) needs 'prompt' (a str) or "
            f"'prompt_token_ids' (a list of ints), got the keys {sorted(map(str, keys))}"
        )
    if other:  # (an unsupported key named as such: {"prompt_embeds": x} is no missing prompt)
        why = "are not supported" if unsupported else "are not prompt keys"
        raise TypeError(f"a prompt dict's keys {other} {why} (keys: {sorted(map(str, keys))})")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"a prompt dict's cache_salt must be a str, got {salt!r:.80}")
    if "prompt" in given and not isinstance(prompt["prompt"], str):
        raise TypeError(f"a prompt dict's 'prompt' must be a str, got {prompt['prompt']!r:.80}")
    if "prompt_token_ids" not in given:
        return prompt["prompt"], salt
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, (str, Mapping)):
        raise TypeError(
            f"a prompt dict's 'prompt_token_ids' must be a list of ints, got {ids!r:.80}"
        )
    return ids, salt


def prompt_text(prompt: Prompt) -> str | None:
    """The text a prompt gives: itself as a str, a TextPrompt's "prompt", the "prompt" a
    TokensPrompt may carry beside its ids (vLLM's: the text they encode, not checked
    against them; it becomes `RequestOutput.prompt`), else None."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


def salted_prompt(prompt: Prompt, params: SamplingParams) -> tuple[Prompt, SamplingParams]:
    """(`prompt`, `params`) with a prompt dict's cache salt, if any, set in `params` (a
    copy). The dict comes back as it is, checked (`unpack_prompt`): `encode_prompt`
    reads it, a TokensPrompt's text included.

    Raises:
      ValueError: the dict's cache salt differs from one `params` already has.
      TypeError: as `unpack_prompt`.
    """
    if not isinstance(prompt, Mapping):
        return prompt, params
    _, salt = unpack_prompt(prompt)
    if salt is not None and params.cache_salt not in (None, salt):
        raise ValueError(
            f"the prompt dict's cache_salt={salt!r:.40} differs from its sampling "
            f"params' cache_salt={params.cache_salt!r:.40}"
        )
    if salt is not None:
        params = dataclasses.replace(params, cache_salt=salt)
    return prompt, params


def check_truncation(
    truncate_prompt_tokens: int | None, max_model_len: int | None = None
) -> int | None:
    """How many of a prompt's last tokens `truncate_prompt_tokens` keeps: None (all of
    them), k for an int k >= 1, or max_model_len for -1 (vLLM's "the truncation size
    supported by the model"). Without `max_model_len` (`SamplingParams`, which knows no
    model) only the value is checked, and -1 comes back as it is.

    Raises:
      ValueError: 0, a negative other than -1, a bool, a float, or anything else not an
        int; or k > max_model_len (vLLM refuses it too).
    """
    k = truncate_prompt_tokens
    if k is None:
        return None
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or (k < 1 and k != -1):
        raise ValueError(
            "truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1, got "
            f"truncate_prompt_tokens={k!r}"
        )
    k = int(k)
    if max_model_len is None:
        return k
    if k > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens={k} is more than max_model_len={max_model_len}; "
            "select a smaller truncation size"
        )
    return max_model_len if k == -1 else k


def request_lists(
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    default: Callable[[], SamplingParams],
) -> tuple[list[Prompt], list[SamplingParams | None]]:
    """`LLM.generate`'s prompts and sampling params as two lists of one length: one
    prompt (a str, a prompt dict, or token ids: a non-empty sequence of ints or a 1-D
    integer numpy or JAX array, as vLLM's `prompt_to_seq` reads them) is a list of one,
    and one `SamplingParams` (None: `default()`) serves every prompt. The prompts and
    params themselves are checked as each request is encoded.

    Raises:
      TypeError: `prompts` is neither a prompt nor an iterable of prompts (None, a
        number, bytes), or `sampling_params` is neither a SamplingParams nor a list of
        them.
      ValueError: a list of sampling params not as long as the prompts.
    """
    from pagedjax.request import SamplingParams  # (it imports this module)

    if isinstance(prompts, (str, Mapping)) or _token_ids(prompts):  # one prompt
        prompts = [prompts]
    elif isinstance(prompts, (bytes, bytearray)) or not _iterable(prompts):
        raise TypeError(
            "prompts must be a prompt (a str, a list of token ids or a prompt dict) or a "
            f"list of them, got {type(prompts).__name__}: {prompts!r:.80}"
        )
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params or default()] * len(prompts)
    elif isinstance(sampling_params, Mapping) or not isinstance(sampling_params, Iterable):
        # (a dict would be taken as a list of its keys: "got 'max_tokens'")
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them, got "
            f"{type(sampling_params).__name__}: {sampling_params!r:.80}"
        )
    else:
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    return prompts, params


def _as_array(x) -> np.ndarray | None:
    """`x` as a numpy array if it is an array (numpy's, JAX's: anything with `__array__`
    and `ndim`), else None."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__array__") and hasattr(x, "ndim") and not isinstance(x, (str, Mapping)):
        return np.asarray(x)
    return None


def _iterable(x) -> bool:
    """Whether `x` can be iterated (a 0-d array is an Iterable that cannot)."""
    array = _as_array(x)
    if array is not None:
        return array.ndim > 0
    return isinstance(x, Iterable)


def _token_ids(prompts) -> bool:
    """Whether `prompts` is one token-id prompt: a non-empty sequence of ints, or a 1-D
    integer array (numpy's, JAX's): an int is never a prompt, so a list of them cannot
    be a list of prompts."""
    array = _as_array(prompts)
    if array is not None:
        return array.ndim == 1 and array.size > 0 and array.dtype.kind in "iu"
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
        return False
    return len(prompts) > 0 and all(map(is_token_id, prompts))


# vLLM's LLM.chat arguments that `LLM.chat` does not support: refused, since its
# **template_vars would take them as template variables and ignore them silently.
_VLLM_CHAT_ONLY = ("mm_processor_kwargs", "tokenization_kwargs")
# `LLM.generate`'s arguments that `LLM.chat` does not take (nor does vLLM's): refused for
# the same reason (a priority ignored under scheduling_policy="priority").
_GENERATE_ONLY = ("priority", "on_step", "on_token")


def chat_prompts(
    tokenizer,
    messages,
    *,
    add_generation_prompt: bool,
    chat_template: str | None,
    chat_template_kwargs: Mapping | None,
    template_vars: dict,
    chat_template_content_format: str = "auto",
) -> tuple[list[str], list[list[int]]]:
    """(rendered texts, token ids) of `LLM.chat`'s conversations (its arguments, as it
    documents them), rendered by `tokenizer`'s chat template or by `chat_template`.

    Raises:
      ValueError: no tokenizer, a `chat_template_content_format` other than "auto" (the
        format is detected from the template, `pagedjax.chat.content_format`), or as
        `Tokenizer.with_chat_template` and `Tokenizer.encode_conversations` do.
      TypeError: a vLLM argument `LLM.chat` does not support, or one of `LLM.generate`'s
        it does not take (`priority`, `on_step`, `on_token`), among `template_vars`;
        `chat_template` not a str, or `chat_template_kwargs` not a dict.
    """
    for name in _VLLM_CHAT_ONLY:  # a template variable would drop them silently
        if name in template_vars and template_vars[name] is not None:  # (None: vLLM's default)
            raise TypeError(f"chat() does not support vLLM's {name}")
        template_vars.pop(name, None)
    for name in _GENERATE_ONLY:
        if name in template_vars:
            raise TypeError(
                f"chat() takes no {name} (a generate() argument; a template variable of "
                "that name goes in chat_template_kwargs)"
            )
    if chat_template_content_format != "auto":
        raise ValueError(
            f"chat_template_content_format={chat_template_content_format!r:.40} is not "
            "supported: only 'auto' (the format is detected from the chat template)"
        )
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            raise TypeError(
                "chat_template_kwargs must be a dict of template variables, got "
                f"{chat_template_kwargs!r:.80}"
            )
        more = dict(chat_template_kwargs)  # vLLM's: it overrides add_generation_prompt
        add_generation_prompt = more.pop("add_generation_prompt", add_generation_prompt)
        template_vars = {**more, **template_vars}
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template; this model has none")
    if chat_template is not None:
        if not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a str, got {chat_template!r:.80}")
        tokenizer = tokenizer.with_chat_template(chat_template, "LLM.chat(chat_template=...)")
    return tokenizer.encode_conversations(
        messages, add_generation_prompt=add_generation_prompt, **template_vars
    )
