"""A checkpoint's tokenizer files as HF's AutoTokenizer reads them, for
`pagedjax.tokenizer.Tokenizer.from_dir`: the special tokens of tokenizer_config.json
(strings or AddedToken dicts) and a legacy `special_tokens_map.json`, the id fields of
the config files, the added tokens HF registers on load (`_register_added_tokens`), and
whether the tokenizer.json's post-processor adds BOS.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from pagedjax.jsonfile import read_json_object

__all__ = ["SPECIAL_TOKEN_NAMES"]


def _token_content(token) -> str | None:
    """tokenizer_config tokens are a string, an AddedToken dict, or null."""
    return token.get("content") if isinstance(token, dict) else token


# tokenizer_config.json's special-token attributes besides bos/eos; HF's
# apply_chat_template passes them all to the template (`special_tokens_map`).
SPECIAL_TOKEN_NAMES = (
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
)


def _special_tokens(tcfg: dict) -> dict[str, str | list[str]]:
    """The named special tokens of a tokenizer_config besides bos/eos, as strings: the
    standard attributes and the names of a dict-form `extra_special_tokens`."""
    extra = tcfg.get("extra_special_tokens")
    fields = {n: tcfg.get(n) for n in SPECIAL_TOKEN_NAMES}
    fields.update(extra if isinstance(extra, dict) else {})
    out = {}
    for name, value in fields.items():
        if isinstance(value, list):
            value = [c for c in map(_token_content, value) if c]
        else:
            value = _token_content(value)
        if value:  # HF leaves unset (null, empty) ones out
            out[name] = value
    return out


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _config_ids(cfg: dict, field: str, file: str, vocab_size: int) -> list[int]:
    """A config file's id field (an id, a list of ids, or null) as a list of ids.

    Raises:
      ValueError: naming the file, for another value (int() had read "2" and 1.5 as
        EOS 2 and 1, and true as 1) or an id outside the vocabulary.
    """
    value = cfg.get(field)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file} {field} must be a token id or a list of them, got {value!r:.80}")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"{file} {field}={value!r:.80}: {bad} outside the vocabulary [0, {vocab_size})"
        )
    return ids


# tokenizer_config's named special tokens (`SPECIAL_TOKEN_NAMES` and bos/eos), which HF
# registers as special added tokens; and an AddedToken dict's flags.
_NAMED_TOKENS = ("bos_token", "eos_token", *SPECIAL_TOKEN_NAMES, "extra_special_tokens")
_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _with_special_tokens_map(tcfg: dict, root: Path) -> dict:
    """tokenizer_config updated from `special_tokens_map.json` as HF's legacy loading
    does it: only when the config has no `added_tokens_decoder` (older checkpoints),
    each named token of the map overriding the config's, additional_special_tokens
    merged (the config's first). A checkpoint with no tokenizer_config.json, or one
    without its bos/eos, had no BOS or EOS token from the tokenizer."""
    if "added_tokens_decoder" in tcfg:
        return tcfg
    stm = read_json_object(root / "special_tokens_map.json", missing_ok=True)
    out = dict(tcfg)
    for key, value in stm.items():
        if key == "additional_special_tokens" and isinstance(value, list):
            merged = list(tcfg.get(key) or [])
            contents = {_token_content(t) for t in merged}
            value = merged + [t for t in value if _token_content(t) not in contents]
        out[key] = value
    return out


def _added_token(value, *, special: bool) -> tokenizers.AddedToken | None:
    """A tokenizer_config token (a string or an AddedToken dict) as an AddedToken, as HF
    builds it (a named token is special; `normalized` defaults to not special); None
    for anything else."""
    content = _token_content(value)
    if not isinstance(content, str) or not content:
        return None
    flags = {k: bool(value[k]) for k in _TOKEN_FLAGS if isinstance(value, dict) and k in value}
    if special:
        flags["special"] = True
    return tokenizers.AddedToken(content, **flags)


def _register_added_tokens(tok: tokenizers.Tokenizer, tcfg: dict) -> None:
    """Registers in `tok` the added tokens that HF's fast tokenizer registers on load:
    tokenizer_config's `added_tokens_decoder` entries whose flags (lstrip, normalized,
    special, ...) differ from the tokenizer.json's, and the named special tokens
    (bos_token, ..., additional_special_tokens) that are not added tokens there.

    Without this, such a token's text in a prompt was split into vocabulary pieces
    where HF encodes it as its id. Only tokens already in the vocabulary at their id are
    registered: HF gives an absent one a new id past the vocabulary, which the model's
    embedding lacks (an absent bos/eos token stays an error, `from_dir`)."""
    added = tok.get_added_tokens_decoder()
    new: dict[str, tokenizers.AddedToken] = {}
    decoder = tcfg.get("added_tokens_decoder")
    for idx, entry in (decoder if isinstance(decoder, dict) else {}).items():
        token = _added_token(entry, special=False)
        if token is None or not str(idx).isdigit() or tok.token_to_id(token.content) != int(idx):
            continue
        if repr(added.get(int(idx))) != repr(token):  # (AddedToken's repr has every flag)
            new[token.content] = token
    contents = {t.content for t in added.values()}
    for name in _NAMED_TOKENS:
        value = tcfg.get(name)
        if isinstance(value, dict) and name == "extra_special_tokens":
            value = list(value.values())
        for item in value if isinstance(value, list) else [value]:
            token = _added_token(item, special=True)
            if token is None or token.content in contents or token.content in new:
                continue
            if tok.token_to_id(token.content) is not None:
                new[token.content] = token
    if new:
        tok.add_tokens(list(new.values()))


def _post_processor_adds(tok: tokenizers.Tokenizer, bos: int) -> bool:
    with_special = tok.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == bos
