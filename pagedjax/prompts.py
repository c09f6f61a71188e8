"""Prompts as the engine takes them: text, token ids, or vLLM's prompt dicts
(`unpack_prompt`), encoded and checked on the host (`encode_prompt`), truncated as
`SamplingParams.truncate_prompt_tokens` asks (`check_truncation`), and a request's bad
words as the token sequences they ban (`encode_bad_words`). `pagedjax.request`
re-exports all of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["Prompt", "check_truncation", "encode_bad_words", "encode_prompt", "unpack_prompt"]

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
    """(text or None, token ids) of a prompt given as text or ids (or as vLLM's prompt
    dicts, `unpack_prompt`), validated.

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
    if isinstance(prompt, Mapping):  # (read as its keys, it would be ids "prompt", ...)
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
        try:
            text, ids = None, list(prompt)
        except TypeError:
            raise TypeError(what) from None
        if any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) for i in ids):
            raise TypeError(f"token id prompts must be lists of ints, got {prompt!r:.80}")
        ids = [int(i) for i in ids]
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
    return text, ids


# vLLM's TextPrompt / TokensPrompt keys that pagedjax has no use for.
_UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "prompt_embeds")


def unpack_prompt(prompt: Mapping) -> tuple[str | Sequence[int], str | None]:
    """(its text or token ids, its cache salt or None) of a prompt given as vLLM's
    `TextPrompt` ({"prompt": str}) or `TokensPrompt` ({"prompt_token_ids": [ids]}),
    either with an optional "cache_salt" (a str, as `SamplingParams.cache_salt`).

    Raises:
      TypeError: neither or both of "prompt" and "prompt_token_ids", another key
        (multi-modal data and prompt embeddings are not supported), or a cache salt
        that is not a str.
    """
    keys = set(prompt)
    given = keys & {"prompt", "prompt_token_ids"}
    if len(given) != 1:
        raise TypeError(
            "a prompt dict (vLLM's TextPrompt / TokensPrompt) needs either 'prompt' (a str) "
            f"or 'prompt_token_ids' (a list of ints), got the keys {sorted(map(str, keys))}"
        )
    other = sorted(map(str, keys - given - {"cache_salt"}))
    if other:
        unsupported = [k for k in other if k in _UNSUPPORTED_PROMPT_KEYS]
        why = "are not supported" if unsupported else "are not prompt keys"
        raise TypeError(f"a prompt dict's keys {other} {why} (keys: {sorted(keys)})")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"a prompt dict's cache_salt must be a str, got {salt!r:.80}")
    (key,) = given
    if key == "prompt" and not isinstance(prompt[key], str):
        raise TypeError(f"a prompt dict's 'prompt' must be a str, got {prompt[key]!r:.80}")
    if key == "prompt_token_ids" and isinstance(prompt[key], (str, Mapping)):
        raise TypeError(
            f"a prompt dict's 'prompt_token_ids' must be a list of ints, got {prompt[key]!r:.80}"
        )
    return prompt[key], salt


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
