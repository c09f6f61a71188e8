"""Structured outputs through `LLM`: `SamplingParams(structured_outputs=...)`.

The tiny preset with random weights and the byte tokenizer (one token per byte), in
tests/test_engine.py's geometry. Greedy completions equal a dense no-cache reference
that draws the argmax over the guide's allowed tokens (and the stop tokens where the
text is a full match) at every step; sampled ones are prefixes of matches, full matches
when they end on a stop; async scheduling, preemption and a mixed batch leave outputs
unchanged. A GBNF grammar (choices, repetition, recursion) runs as the others do.
"""

import json
import re

import numpy as np
import pytest
import tokenizers
from engine_helpers import GEOMETRY, TINY, Dense, check_clean, random_params

from pagedjax.engine import LLM, SamplingParams, StructuredOutputsParams
from pagedjax.guided import compile_guide
from pagedjax.tokenizer import Tokenizer

EOS = 2
PROMPTS = [list(b"Answer: "), list(b"x = "), list(b"{{")]
MAX_TOKENS = 48  # with the prompt, within the dense reference's 64 positions
SCHEMA = {  # bounded: at most 43 bytes, escapes included
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
GRAMMAR = r"""
root ::= item ("," item){0,2}   # at most 17 bytes
item ::= "yes" | "no" | [0-9]{1,2}? [a-f]{1,3} | "<" [A-Z] ">"
"""
SPECS = {
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,6}@[0-9]{1,3}\.(com|org)"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
_ITEM = r"(?:yes|no|[0-9]{0,2}[a-f]{1,3}|<[A-Z]>)"
PATTERNS = {
    "regex": r"[a-z]{2,6}@[0-9]{1,3}\.(com|org)",
    "choice": r"yes|no|maybe so",
    "grammar": rf"{_ITEM}(?:,{_ITEM}){{0,2}}",
}


@pytest.fixture(scope="module")
def params():
    return random_params()


@pytest.fixture(scope="module")
def dense(params):
    return Dense(params)


@pytest.fixture(scope="module")
def llm(params):
    return LLM(params, max_num_batched_tokens=32, **GEOMETRY)


def allowed_bits(guide, state, stop_ids) -> np.ndarray:
    """[V] bool: what the reference may draw (the guide's tokens, the stop tokens where
    the text is a full match), unpacked from the guide's bitmask here, not by the engine's
    code."""
    bits = np.unpackbits(guide.allowed(state).view(np.uint8), bitorder="little")
    bits = bits[: TINY.vocab_size].astype(bool)
    bits[list(stop_ids)] = guide.accepting(state)
    return bits


def dense_guided_greedy(dense, guide, prompt, max_tokens, stop_ids=(EOS,)) -> list[int]:
    out, state = [], guide.initial_state
    while len(out) < max_tokens:
        logits = dense.last_logits([prompt + out])[0]
        tok = int(np.argmax(np.where(allowed_bits(guide, state, stop_ids), logits, -np.inf)))
        out.append(tok)
        if tok in stop_ids:
            break
        state = guide.advance(state, tok)
        if not guide.can_continue(state):
            break
    return out


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        name, ok = obj.get("name"), obj.get("ok")
        return type(name) is str and len(name) <= 3 and type(ok) is bool and len(obj) == 2
    return re.fullmatch(PATTERNS[kind], text) is not None


def completed(out) -> str:
    """A finished completion's text without its stop token (the byte tokenizer's EOS,
    id 2, is a byte, kept in the text)."""
    ids = out.token_ids[:-1] if out.token_ids[-1:] == [EOS] else out.token_ids
    return bytes(ids).decode()


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_greedy_equals_the_dense_masked_argmax(llm, dense, kind):
    spec = SPECS[kind]
    guide = compile_guide(spec, llm.tokenizer, TINY.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    outs = llm.generate(PROMPTS, sp)
    for prompt, o in zip(PROMPTS, outs, strict=True):
        c = o.outputs[0]
        assert c.token_ids == dense_guided_greedy(dense, guide, prompt, MAX_TOKENS)
        assert c.finish_reason == "stop", (kind, bytes(c.token_ids))
        assert valid(kind, completed(c)), (kind, bytes(c.token_ids))
    check_clean(llm)


def test_sampled_completions_match_and_async_changes_nothing(params):
    spec = SPECS["regex"]
    sp = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=20, structured_outputs=spec)
    runs = []
    for mode in (True, False):
        llm = LLM(params, max_num_batched_tokens=32, async_scheduling=mode, **GEOMETRY)
        unguided = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
        outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [sp, unguided, sp])
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        for o in (outs[0], outs[2]):
            for c in o.outputs:
                assert c.finish_reason == "stop" and valid("regex", completed(c))
        check_clean(llm)
    assert runs[0] == runs[1]
    alone = LLM(params, max_num_batched_tokens=32, **GEOMETRY)
    unguided = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    assert [alone.generate([PROMPTS[1]], unguided)[0].outputs[0].token_ids] == runs[0][1]


NESTED = r"""
root ::= item ("," item)*
item ::= [a-c] | "[" root "]"   # recursive: unrolled grammar.RULE_DEPTH (3) deep
"""


def nested_regex(depth: int = 3) -> str:
    """NESTED's strings with root at most `depth` deep (brackets nest depth - 1), by hand."""
    item = "[a-c]"
    for _ in range(depth):
        root = rf"{item}(?:,{item})*"
        item = rf"(?:[a-c]|\[{root}\])"
    return root


def test_sampled_completions_of_a_recursive_grammar_are_in_its_language(llm):
    """Every completion that stops is one of the grammar's strings of nesting depth <= 3
    (a hand-written regex); one cut by max_tokens is a prefix of one (each token was
    allowed by the guide)."""
    spec = StructuredOutputsParams(grammar=NESTED)
    guide = compile_guide(spec, llm.tokenizer, TINY.vocab_size)
    sp = SamplingParams(temperature=1.0, n=6, seed=5, max_tokens=24, structured_outputs=spec)
    done = [c for o in llm.generate(PROMPTS[:2], sp) for c in o.outputs]
    for c in done:
        if c.finish_reason == "stop":
            assert re.fullmatch(nested_regex(), completed(c)), bytes(c.token_ids)
        else:
            state = guide.initial_state
            for t in c.token_ids:
                state = guide.advance(state, t)  # (ValueError for a token not allowed)
    assert any(c.finish_reason == "stop" for c in done)
    assert any("[" in completed(c) for c in done)  # (it did nest)
    check_clean(llm)


def test_preemption_keeps_guided_outputs(params):
    spec = SPECS["json"]
    sp = SamplingParams(
        temperature=1.0, n=2, seed=11, max_tokens=MAX_TOKENS, structured_outputs=spec
    )
    roomy = LLM(params, max_num_batched_tokens=32, **GEOMETRY)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS, sp)]
    tight = LLM(params, max_num_batched_tokens=32, **GEOMETRY | dict(num_pages=14))
    got = tight.generate(PROMPTS, sp)
    assert tight.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == want
    check_clean(tight)


def test_the_stop_tokens_are_drawn_only_at_a_full_match(llm):
    """`a+` is complete after every `a`: the completion ends on EOS or at max_tokens;
    with ignore_eos it can only go on with `a`s."""
    spec = StructuredOutputsParams(regex="a+")
    sp = SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=12, structured_outputs=spec)
    for c in llm.generate([PROMPTS[0]], sp)[0].outputs:
        text = completed(c)
        assert re.fullmatch("a+", text) and (c.token_ids[-1] == EOS or len(c.token_ids) == 12)
    sp = SamplingParams(
        temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, structured_outputs=spec
    )
    c = llm.generate([PROMPTS[0]], sp)[0].outputs[0]
    assert c.token_ids == [ord("a")] * 12 and c.finish_reason == "length"
    # A stop token that is text the match could go on with ("q" in [a-z]) is drawn only
    # where the text is a full match, and never as text: it would end the completion.
    spec = StructuredOutputsParams(regex="[a-z]{3,8}x")
    q = ord("q")
    sp = SamplingParams(
        temperature=1.0,
        n=8,
        seed=3,
        max_tokens=12,
        stop_token_ids=[q],
        logit_bias={q: 8.0},  # (q wherever it may come)
        structured_outputs=spec,
    )
    outs = llm.generate([PROMPTS[0]], sp)[0].outputs
    for c in outs:
        stopped = c.finish_reason == "stop" and c.token_ids[-1] == q
        ids = c.token_ids[:-1] if stopped else c.token_ids
        assert q not in ids
        if c.finish_reason == "stop":
            assert re.fullmatch("[a-z]{3,8}x", bytes(ids).decode()), c
    assert any(c.finish_reason == "stop" and c.token_ids[-1] == q for c in outs)


def test_refusals(llm):
    spec = StructuredOutputsParams(choice=["x"])
    with pytest.raises(ValueError, match="beam"):
        SamplingParams(beam_width=2, structured_outputs=spec)
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    llm.tokenizer, tok = None, llm.tokenizer  # (a random-weight model gets the byte one)
    try:
        with pytest.raises(ValueError, match="need a tokenizer"):
            llm.add_request(PROMPTS[0], SamplingParams(structured_outputs=spec))
    finally:
        llm.tokenizer = tok
    assert not llm.has_unfinished_requests()


def test_a_match_the_vocabulary_cannot_spell_is_refused_and_no_dead_end_is_entered(params):
    """A vocabulary of printable ASCII (ByteLevel) cannot spell "é": a spec every match of
    which needs it is refused when added, not a completion that stops short of a match
    ("aé": "a", then nothing). Where only some branches need it, their first tokens are
    never allowed: a bias towards "a" cannot lead "aé|bc" into "a" and a "stop" short."""
    chars = [chr(c) for c in range(33, 127)]
    hf = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(chars)}, []))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    llm = LLM(params, tokenizer=Tokenizer(hf, eos_token_ids=[2]), **GEOMETRY)
    for regex in ("é", "aé"):
        sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=regex))
        with pytest.raises(ValueError, match="no sequence of this vocabulary's tokens"):
            llm.add_request([5], sp)
    a, b, c = (chars.index(x) for x in "abc")
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        logit_bias={a: 100.0},
        structured_outputs=StructuredOutputsParams(regex="aé|bc"),
    )
    (out,) = llm.generate([[5]], sp)[0].outputs
    assert (out.token_ids, out.finish_reason) == ([b, c], "stop")
    check_clean(llm)


def test_a_guide_whose_tokens_are_all_banned_otherwise_ends_the_completion(llm, dense):
    """allowed_token_ids, a bad word, or min_tokens' ban of a stop token that is text can
    ban every token the guide allows (the check on adding sees the guide alone): the
    completion ends there without the draw, short of a match ("error", as vLLM's), and
    the batch goes on."""
    kw = dict(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["ab"]))
    sps = [
        SamplingParams(allowed_token_ids=[ord("a")], logprobs=1, **kw),
        SamplingParams(bad_words=["b"], **kw),
        SamplingParams(min_tokens=3, stop_token_ids=[ord("b")], **kw),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    outs = llm.generate([PROMPTS[0]] * 3 + [PROMPTS[1]], sps)
    for o in outs[:3]:
        (c,) = o.outputs
        assert (c.token_ids, c.finish_reason, c.stop_reason) == ([ord("a")], "error", None)
    assert len(outs[0].outputs[0].logprobs) == 1
    assert outs[3].outputs[0].token_ids == dense.greedy([PROMPTS[1]], 6, stop_ids=())[0]
    check_clean(llm)


def test_a_request_kept_through_ctrl_c_in_on_token_keeps_its_guide_in_step(llm):
    """Ctrl-C in `on_token` on another request's token: generate aborts its own, the
    other is kept and recomputed with its guide's state after that token (not "aab")."""
    spec = StructuredOutputsParams(regex="ab")
    other = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=8, structured_outputs=spec))

    def on_token(request_id, index, token_id):
        if request_id == other:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4), on_token=on_token)
    done = []
    while llm.has_unfinished_requests():
        done += llm.step()
    ((c,),) = [o.outputs for o in done if o.request_id == other]
    assert (c.token_ids, c.finish_reason) == (list(b"ab"), "stop")
    check_clean(llm)
