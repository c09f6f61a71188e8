"""Structured outputs: constrain generation to a regex, a list of choices, a JSON schema or
a grammar.

`StructuredOutputsParams` (as vLLM's) names the constraint and writes it as regex text
(a JSON schema by `pagedjax.json_schema`, a GBNF grammar by `pagedjax.grammar`);
`compile_guide` turns it into a `Guide` for one tokenizer: a byte DFA
(`pagedjax.regex_dfa`, whose docstring gives the size limits; `pagedjax.regex_parse`'s
gives the regex subset) and, per DFA state, the bitmask of the tokens whose bytes keep
the match alive. Everything here runs on the host, in numpy.

Matching is on bytes: the text is the concatenation of the tokens' UTF-8 bytes
(`pagedjax.token_bytes`, which also lays them out for the walks below).

Token masks (`Guide.allowed`): the DFA is a numpy table [S, 256] and the tokens' bytes a
padded matrix; a state's mask walks every token at once, one gather per byte position
over the tokens still alive (the bytes past the 16th in a second pass), and keeps those
that end in a live state: about 8 ms on the CPU for 128k tokens that all survive 16
bytes, well under 1 ms where most die on their first byte. Masks are cached per state.

Viable states (from which tokens can complete a match) are all the live ones where each
byte the DFA reads is a single-byte token; where not, the tokens holding such a byte are
walked from each state left undecided, a cost refused (ValueError) past `MAX_VIABLE_WORK`
token bytes stepped: about 1 s on 2 CPU cores.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json as jsonlib
import reprlib
import threading
import weakref

import numpy as np

from pagedjax import regex_dfa
from pagedjax.grammar import grammar_regex, too_large
from pagedjax.json_schema import (  # noqa: F401  (JSON_DEPTH: re-exported)
    DEFAULT_WHITESPACE,
    JSON_DEPTH,
    MAX_REGEX_CHARS,
    schema_regex,
)
from pagedjax.regex_dfa import (
    DFA,
    check_size,
    compile_dfa,
    escape,
    intersect,
    map_sets,
    nesting,
    parse,
    to_text,
)
from pagedjax.token_bytes import (  # noqa: F401  (token_bytes, _TokenTable, _walk: re-exported)
    _ends,
    _TokenTable,
    _walk,
    token_bytes,
)
from pagedjax.tokenizer import Tokenizer

__all__ = ["Guide", "StructuredOutputsParams", "compile_guide", "token_bytes"]

MASK_CACHE_SIZE = 1024  # masks kept per guide (16 KiB each at a 128k vocabulary)
MAX_VIABLE_WORK = 128_000_000  # token bytes `_viable_states` steps: ~1 s on 2 CPU cores
_JSON_WHITESPACE = ((9, 10), (13, 13), (32, 32))


# ---------------------------------------------------------------------------- the params


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a completion must match, as vLLM's `StructuredOutputsParams`: exactly one of
    `json`, `regex`, `choice`, `grammar` or `json_object=True`.

    Attributes:
      json: a JSON schema, a dict or its JSON text. Supported: type string (enum,
        const, pattern, minLength/maxLength, format date / time / date-time / uuid /
        email / uri), integer and number (minimum, maximum, exclusiveMinimum,
        exclusiveMaximum: exact; a number's bounds whole numbers, written without
        exponent; multipleOf 1 on integers), boolean, null, array (items, prefixItems,
        minItems/maxItems, uniqueItems false), object (properties in declared order,
        `required`; optional ones may be left out; then the required keys properties
        does not list; no other keys are generated; without either, any keys; the
        values of keys outside properties of additionalProperties' schema, none where it
        is false), enum, const, anyOf,
        oneOf (where no value can match two branches: different types, const / enum
        values, or a discriminated union's), allOf (merged: required lists and
        properties joined, the stricter bound; the keywords beside these and beside
        $ref go into each branch), nullable ("or null", beside $ref or allOf too),
        type lists, local $ref (#/$defs/..., #/definitions/...; recursive ones unrolled
        `json_schema.REF_DEPTH` deep) and {} (any value). Annotations (title,
        description, default, discriminator, ...) are ignored; any other keyword
        (multipleOf but 1, uniqueItems true, ...), a bound
        on a number that is not a whole number, a pattern combined with lengths, a
        format with lengths not all its strings fit, an unknown format, keywords to
        merge with different values, or a oneOf whose branches may overlap is a
        ValueError naming it (`pagedjax.json_schema` has the details). A string
        `pattern` matches the whole string's characters as both ECMA-262 and Python's
        `re` read it (those that need a JSON escape written escaped).
      regex: a regex the whole completion matches (the subset in `pagedjax.regex_dfa`).
      choice: the completion is one of these strings (a list is stored as a tuple).
      grammar: a GBNF grammar (llama.cpp's and xgrammar's EBNF: `name ::= ...` rules,
        strings, [classes], `.`, groups, `|`, `* + ? {m,n}`, `#` comments) the whole
        completion is derived from, starting at rule `root`. A recursive rule is unrolled
        `grammar.RULE_DEPTH` (3) deep: the completions are the grammar's strings with a
        parse tree in which no rule nests in itself more than that. Lookahead `(= ...)`
        and other syntax (Lark's) are refused (ValueError naming it and its line:column);
        see `pagedjax.grammar`. A grammar whose regex is too large for the DFA is a
        ValueError with a hint (simplify it or lower its nesting).
      json_object: True: any JSON object, containers nested at most `JSON_DEPTH` deep
        (the object itself counted: {"a": {"b": [1]}} is 3 deep).
      disable_any_whitespace: JSON: no whitespace between tokens.
      whitespace_pattern: JSON: the regex of the whitespace between tokens (default
        `DEFAULT_WHITESPACE`, one optional space); its character sets keep only JSON's
        whitespace (space, \\t, \\n, \\r: `\\s*` is `[\\t\\n\\r ]*`), and one that holds none
        is a ValueError.
      disable_fallback, disable_additional_properties: vLLM's, accepted (bools) and
        without effect here: there is no other backend to fall back to, and no key
        outside a schema's properties is generated where it has some (but a key its
        `required` lists).
      structural_tag: refused (ValueError) when given: structural tags are not supported.

    Construction checks the types and compiles the spec to regex text (`to_regex`),
    parsing it and counting its NFA states, so a bad value fails here; the DFA (which
    may still be too large) and the token masks are built by `compile_guide`. Equal
    specs hash alike (by their regex), as the frozen params holding them do.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    structural_tag: str | None = None

    def __post_init__(self):
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
        for name, allow_none in (
            ("json_object", True),
            ("disable_any_whitespace", False),
            ("disable_fallback", False),
            ("disable_additional_properties", False),
        ):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (allow_none and value is None)):
                raise TypeError(f"{name} must be a bool, got {name}={value!r:.80}")
        schema = self.json
        # A schema nested hundreds of levels deep would raise RecursionError in json or
        # deepcopy (schema_regex refuses past its MAX_DEPTH): a ValueError too.
        shown = f"json={reprlib.repr(schema)}"  # (bounded: not the whole schema's repr)
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except RecursionError:
                raise ValueError(f"{shown} nests too deeply") from None
            except ValueError as e:
                raise ValueError(f"json is not valid JSON ({e}): json={self.json!r:.100}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json must be a JSON schema object, got json={self.json!r:.100}")
        elif isinstance(schema, dict):
            try:
                schema = copy.deepcopy(schema)
            except RecursionError:
                raise ValueError(f"{shown} nests too deeply") from None
            object.__setattr__(self, "json", schema)  # frozen: ours alone
        elif schema is not None:
            raise TypeError(
                f"json must be a dict or its JSON text, got {type(schema).__name__}: "
                f"json={schema!r:.80}"
            )
        choice = self.choice
        if choice is not None:
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
                raise TypeError(f"choice must be a list of str, got choice={choice!r:.100}")
            bad = [c for c in choice if not isinstance(c, str)]
            if bad or not choice:
                raise ValueError(
                    f"choice must be a non-empty list of str, got choice={choice!r:.100}"
                )
            object.__setattr__(self, "choice", tuple(choice))
        if self.structural_tag is not None:
            raise ValueError(
                f"structural_tag is not supported: structural_tag={self.structural_tag!r:.80}"
            )
        given = [
            f"{name}={getattr(self, name)!r:.60}"
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object=True"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar or json_object=True, got "
                + (", ".join(given) or "none")
            )
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError(
                "give disable_any_whitespace=True or whitespace_pattern, not both: "
                f"whitespace_pattern={self.whitespace_pattern!r:.80}"
            )
        if self.regex is not None:
            pattern = self.regex
        elif self.choice is not None:
            pattern = "(?:" + "|".join(map(escape, self.choice)) + ")"
        elif self.grammar is not None:
            pattern = grammar_regex(self.grammar)  # (its errors name the grammar's lines)
        else:
            ws = "" if self.disable_any_whitespace else self.whitespace_pattern
            if ws is None:
                ws = DEFAULT_WHITESPACE
            elif ws:
                ws = f"(?:{_json_whitespace(ws)})"
            with nesting(shown):
                pattern = schema_regex(schema, ws)
        if len(pattern) > MAX_REGEX_CHARS:
            raise ValueError(f"{given[0]}: its regex exceeds {MAX_REGEX_CHARS} characters")
        try:
            check_size(pattern, parse(pattern))
        except ValueError as e:
            if self.grammar is None:
                raise
            raise too_large(self.grammar, e) from None
        object.__setattr__(self, "_pattern", pattern)

    def __hash__(self) -> int:
        return hash(self._pattern)

    def to_regex(self) -> str:
        """The regex (`pagedjax.regex_dfa`'s subset) the whole completion must match:
        `regex` as given, or the one built for `choice` / `json` / `json_object` /
        `grammar`, which Python's `re` reads the same with `re.ASCII`."""
        return self._pattern


def _json_whitespace(pattern: str) -> str:
    """`pattern` (a whitespace_pattern) with its character sets cut to JSON's whitespace
    (\\s's \\v and \\f are none); a ValueError naming a set without any."""
    empty = []

    def cut(ranges):
        kept = intersect(ranges, _JSON_WHITESPACE)
        if ranges and not kept:
            empty.append(ranges)
        return ("set", kept)

    ast = map_sets(parse(pattern), cut)  # (a bad one is named as itself)
    if empty:
        raise ValueError(
            f"whitespace_pattern={pattern!r:.80} matches {to_text(('set', empty[0]))}, which "
            "holds no JSON whitespace (space, \\t, \\n, \\r)"
        )
    return to_text(ast)


# ---------------------------------------------------------------------------- the guide


class Guide:
    """A compiled structured output for one tokenizer and vocabulary size.

    States are ints; `initial_state` starts a completion and `advance` steps it.
    `allowed(state)` is a uint32 bitmask [ceil(vocab_size / 32)] with bit t % 32 of word
    t // 32 set for each token t whose bytes keep the match alive and after which some
    sequence of the vocabulary's tokens completes it (a viable state; see the module's
    docstring); special and added tokens, tokens without bytes and ids past the
    tokenizer's vocabulary never are. So `can_continue(state)` is False only where
    `accepting(state)`: a completion that follows the masks ends on a full match, or is
    cut by something else (max_tokens, a stop string, another constraint). Masks are
    cached per state (the last `MASK_CACHE_SIZE`) and read-only.

    Attributes:
      vocab_size: the mask's number of ids (the model's, possibly padded).
      initial_state: the state of an empty completion.
      num_states: the DFA's states, the dead one included.
      pattern: the regex it matches.
    """

    def __init__(self, dfa: DFA, table: _TokenTable, vocab_size: int, pattern: str = ""):
        self._dfa, self._table, self.vocab_size, self.pattern = dfa, table, vocab_size, pattern
        self._flat = dfa.trans.ravel()  # [S * 256]: next state = flat[state * 256 + byte]
        self.initial_state = dfa.initial
        self.num_states = len(dfa.trans)
        self._masks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._viable = _viable_states(self)  # [S] bool (False for the dead state 0)
        self._all_viable = bool(self._viable[1:].all())

    def _check_state(self, state) -> int:
        if isinstance(state, bool) or not isinstance(state, (int, np.integer)):
            raise TypeError(f"state must be an int, got {type(state).__name__}: {state!r:.40}")
        if not 0 < state < self.num_states:
            raise ValueError(f"state {state} is not a live state of this guide")
        return int(state)

    def allowed(self, state: int) -> np.ndarray:
        """uint32 [ceil(vocab_size / 32)] bitmask of the tokens allowed in `state`."""
        state = self._check_state(state)
        mask = self._masks.get(state)
        if mask is not None:
            self._masks.move_to_end(state)
            return mask
        ends = _ends(self._flat, self._table, state)[: self.vocab_size]
        ok = ends != 0 if self._all_viable else np.take(self._viable, ends)
        words = -(-self.vocab_size // 32)
        bits = np.zeros(words * 32, bool)
        bits[: len(ok)] = ok
        mask = np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)
        mask.flags.writeable = False
        self._masks[state] = mask
        if len(self._masks) > MASK_CACHE_SIZE:
            self._masks.popitem(last=False)
        return mask

    def advance(self, state: int, token_id: int) -> int:
        """The state after `token_id`; ValueError if it is not allowed in `state`."""
        state = self._check_state(state)
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
            raise TypeError(f"token_id must be an int, got {token_id!r:.40}")
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token_id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        data = self._table.bytes[token_id] if token_id < len(self._table.bytes) else None
        if data is None:
            raise ValueError(
                f"token {token_id} has no text (special, added or padding): not allowed"
            )
        nxt = self._dfa.walk(state, data)
        if not self._viable[nxt]:
            why = "" if nxt == 0 else " (no tokens of this vocabulary complete a match after it)"
            raise ValueError(f"token {token_id} ({data!r}) is not allowed in state {state}{why}")
        return nxt

    def accepting(self, state: int) -> bool:
        """Whether the text so far is a full match."""
        return bool(self._dfa.accept[self._check_state(state)])

    def allows(self, state: int, token_id: int) -> bool:
        """Whether `token_id` is allowed in `state` (its bit in `allowed(state)`)."""
        if not 0 <= token_id < self.vocab_size:
            return False
        return bool(int(self.allowed(state)[token_id >> 5]) >> (token_id & 31) & 1)

    def can_continue(self, state: int) -> bool:
        """Whether some token is allowed in `state` (where not, the text is a full match)."""
        return bool(self.allowed(state).any())


def _viable_states(guide: Guide) -> np.ndarray:
    """[S] bool: the states of `guide`'s DFA from which some sequence of tokens (ids
    below its vocab_size, with bytes) reaches acceptance; False for the dead state 0.
    ValueError where walking the tokens takes over `MAX_VIABLE_WORK` steps."""
    trans, accept, tab = guide._dfa.trans, guide._dfa.accept, guide._table
    n = min(len(tab.lens), guide.vocab_size)
    single = np.zeros(256, bool)
    single[tab.head[0, :n][tab.lens[:n] == 1]] = True
    live = np.arange(len(trans)) != 0
    if single[trans.any(axis=0)].all():  # each byte the DFA reads is a token
        return live
    # Backward from acceptance over the single-byte tokens' edges; then also over the
    # edges of the tokens with a byte that is no token, out of the states left
    # undecided (a token of single-byte tokens' bytes adds no path those edges lack).
    src, byte = np.nonzero(trans[:, single])
    dst = trans[src, np.flatnonzero(single)[byte]]
    viable = _reaches(accept & live, src, dst)
    rest = np.flatnonzero(live & ~viable)
    if not len(rest):
        return viable
    sub = tab.spelled.get(n)
    if sub is None:
        sub = tab.spelled[n] = _TokenTable(
            [t for t in tab.bytes[:n] if t and not single[list(t)].all()]
        )
    succ, work = [], 0
    for s in rest:
        ends, steps = _walk(guide._flat, sub, int(s))
        succ.append(np.unique(ends[ends != 0]))
        work += steps
        if work > MAX_VIABLE_WORK:
            missing = [f"{b:#04x}" for b in np.flatnonzero(trans.any(axis=0) & ~single)]
            raise ValueError(
                f"{guide.pattern!r:.80} is too large for this vocabulary: finding which of "
                f"its {len(rest)} DFA states its tokens can complete takes over "
                f"MAX_VIABLE_WORK={MAX_VIABLE_WORK} token bytes stepped (no single-byte "
                f"token holds {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}, "
                "which it reads); lower its repetition counts"
            )
    src = np.concatenate([src, np.repeat(rest, [len(x) for x in succ])])
    return _reaches(viable, src, np.concatenate([dst, *succ]))


def _reaches(start: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """[S] bool: `start` and the states with a path of edges `src[i] -> dst[i]` to it."""
    out = start.copy()
    order = np.argsort(dst, kind="stable")
    src = src[order]
    bounds = np.searchsorted(dst[order], np.arange(len(out) + 1))  # edges into s: [b[s], b[s+1])
    frontier = np.flatnonzero(out)
    while len(frontier):
        lo, hi = bounds[frontier], bounds[frontier + 1]
        idx = np.repeat(hi - np.cumsum(hi - lo), hi - lo) + np.arange((hi - lo).sum())
        preds = np.unique(src[idx])
        frontier = preds[~out[preds]]
        out[frontier] = True
    return out


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> _TokenTable
_DFAS: collections.OrderedDict[str, DFA] = collections.OrderedDict()
_GUIDES: collections.OrderedDict[tuple, Guide] = collections.OrderedDict()
# (key, limits) -> (message, whether the DFA was too large: a grammar's hint added then)
_REFUSED: collections.OrderedDict[tuple, tuple[str, bool]] = collections.OrderedDict()
_LOCK = threading.Lock()
CACHE_SIZE = 16  # guides (and DFAs, and refusals) kept by compile_guide


def _lru(cache: collections.OrderedDict, key, make):
    with _LOCK:
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
            return value
    value = make()  # (outside the lock: compiles can take a while)
    with _LOCK:
        cache[key] = value
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return value


def compile_guide(spec: StructuredOutputsParams, tokenizer: Tokenizer, vocab_size: int) -> Guide:
    """The `Guide` of `spec` for `tokenizer` and a model of `vocab_size` ids (may exceed
    the tokenizer's: padded embeddings). Cached: the last `CACHE_SIZE` guides by the
    spec's regex, the tokenizer object and vocab_size (so masks computed for one request
    serve the next), the last `CACHE_SIZE` refusals alike (a ValueError raised again at
    once: a resent pattern that is too large costs nothing), and each tokenizer's token
    table while the tokenizer lives.

    Raises:
      TypeError: a wrong type of argument.
      ValueError: vocab_size < 1, the pattern's DFA is too large
        (`regex_dfa.MAX_DFA_STATES`; for a grammar, with `grammar.too_large`'s hint), it
        matches nothing, no sequence of the vocabulary's tokens spells a match (a regex
        needing a character no token holds), finding which DFA states the vocabulary's
        tokens can complete takes too long (`MAX_VIABLE_WORK`: a vocabulary without a
        single-byte token for some byte the pattern reads), or the tokenizer's decoder is
        not supported (`token_bytes`).
    """
    if not isinstance(spec, StructuredOutputsParams):
        raise TypeError(f"spec must be a StructuredOutputsParams, got {type(spec).__name__}")
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a pagedjax Tokenizer, got {type(tokenizer).__name__}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r:.40}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size=}")
    pattern = spec.to_regex()

    def make_dfa() -> DFA:
        try:
            return compile_dfa(pattern)
        except ValueError as e:
            if "matches nothing" in str(e):  # (not a size error)
                raise
            raise _TooLarge(str(e)) from None

    def refusal(message: str, too_big: bool) -> ValueError:
        # A size refusal names this spec's grammar, not the one cached with its regex.
        if too_big and spec.grammar is not None:
            return too_large(spec.grammar, message)
        return ValueError(message)

    def make() -> Guide:
        dfa = _lru(_DFAS, pattern, make_dfa)
        with _LOCK:
            table = _TABLES.get(tokenizer)
        if table is None:
            table = _TokenTable(token_bytes(tokenizer))
            with _LOCK:
                _TABLES[tokenizer] = table
        guide = Guide(dfa, table, int(vocab_size), pattern)
        if not guide._viable[guide.initial_state]:
            raise ValueError(
                f"no sequence of this vocabulary's tokens (ids < {vocab_size}) spells a "
                f"match of {pattern!r:.80} (the tokenizer lacks a character, or a byte "
                "sequence, that every match needs)"
            )
        return guide

    # (the limits are in the refusal's key: one refused under other limits may pass)
    limits = (
        regex_dfa.MAX_DFA_STATES,
        regex_dfa.MAX_DFA_WORK,
        regex_dfa.MAX_DFA_HELD,
        MAX_VIABLE_WORK,
    )
    key = (pattern, tokenizer, int(vocab_size))
    with _LOCK:
        refused = _REFUSED.get((key, limits))
        if refused is not None:
            _REFUSED.move_to_end((key, limits))
    if refused is not None:
        raise refusal(*refused)
    try:
        return _lru(_GUIDES, key, make)
    except ValueError as e:
        too_big = isinstance(e, _TooLarge)
        with _LOCK:
            _REFUSED[key, limits] = (str(e), too_big)
            while len(_REFUSED) > CACHE_SIZE:
                _REFUSED.popitem(last=False)
        if not too_big:
            raise
        raise refusal(str(e), too_big) from None


class _TooLarge(ValueError):
    """`compile_guide`'s DFA refused as too large (its message the DFA's, any grammar's
    hint added where it is raised: the refusal is cached by regex, not by grammar)."""
