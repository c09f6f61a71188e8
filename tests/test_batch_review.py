"""pagedjax.batch against a numpy oracle of vLLM's sampling constraints.

`Sim` (test_scheduler) drives the scheduler as the engine does (chunked prefill, prefix
hits, n samples forking, preemption and recompute, asynchronous feeds); every plan is
packed by `StepBatch` and each sampling row's packed `LogitBias`, applied to logits,
must equal vLLM's processing of the same logits: allowed_token_ids, then bad words
(`update_from_tokenizer`'s encoding, `ops/bad_words.py`'s rule over the generated
tokens), then min_tokens (every stop token and EOS, even under ignore_eos), then the
logit bias. The tokens drawn are the argmax of the constrained logits over a small
alphabet, so that bad words' prefixes occur often.
"""

import types

import numpy as np
import pytest
from test_bad_words import space_folding_tokenizer
from test_scheduler import PS, Sim

from pagedjax import decode, resources
from pagedjax.batch import StepBatch, guide_mask, request_constraints
from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.request import SamplingParams

V = 256  # the tiny preset's vocabulary
EOS = 2
EXACT = decode.Buckets(min_tokens=1, min_seqs=1, min_pages=1, min_copies=1)
ALPHABET = [EOS, 32, 97, 98, 99, 113, 200]  # EOS, " ", "a", "b", "c", "q", (" q")


def vllm_bad_words(words, tok) -> list[list[int]]:
    """vLLM's `SamplingParams.update_from_tokenizer`: each word stripped on the left,
    then with one space before it, kept when that gives another first token and as many
    tokens."""
    out = []
    for word in words:
        plain = tok.encode(word.lstrip(), add_bos=False)
        out.append(plain)
        spaced = tok.encode(" " + word.lstrip(), add_bos=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def vllm_logits(x, sp, words, prompt_len, history):
    """vLLM v1's sampler before the penalties (`Sampler.apply_logits_processors`)."""
    x = x.copy()
    out = history[prompt_len:]
    if sp.allowed_token_ids is not None:
        keep = np.zeros(V, bool)
        keep[list(sp.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for w in words:
        k = len(w) - 1  # (0: out[len(out):] is [] == w[:-1])
        if k <= len(out) and out[len(out) - k :] == w[:-1]:
            x[w[-1]] = -np.inf
    if len(out) < sp.min_tokens:  # all_stop_token_ids: EOS whatever ignore_eos
        x[[EOS, *sp.stop_token_ids]] = -np.inf
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    return x


def packed_logits(x, bias, row, last):
    """`sampling.apply_bias` of one row, in numpy (as its docstring says)."""
    x = x.copy()
    if bias is None:
        return x
    for j, t in enumerate(bias.ids[row]):
        if t >= 0 and (bias.after is None or bias.after[row, j] in (-1, last)):
            x[t] += bias.values[row, j]
    if bias.allowed is not None and (bias.allowed[row] >= 0).any():
        keep = np.zeros(V, bool)
        keep[bias.allowed[row][bias.allowed[row] >= 0]] = True
        x[~keep] = -np.inf
    return x


class ConstraintSim(Sim):
    """Packs each plan as the engine does and checks every sampling row's constrained
    logits against `vllm_logits`; the row's token is their argmax."""

    def __init__(self, tok, **kw):
        super().__init__(**kw)
        self.tok, self.checked, self.banned, self.conditional = tok, 0, 0, 0
        commit = self.sched.commit

        def commit_and_finish(plan, **kw):
            commit(plan, **kw)
            if plan.rows:
                prev, toks = self.inflight if self.inflight else (None, [])
                feed = np.array([0 if t is None else t for t in toks] + [0], np.int32)
                self.inp = self.batch.finish(plan, feed, prev)[0]

        self.sched.commit = commit_and_finish

    def check_plan(self, plan):
        super().check_plan(plan)
        self.batch = plan.rows and StepBatch(plan, EXACT, PS, V, self.bm)

    def write_and_check(self, plan, fed):
        out = super().write_and_check(plan, fed)
        bias = self.inp.logit_bias
        for i, r in enumerate(plan.rows):
            if out[i] is None or not r.samples:
                continue
            s, req = r.seq, r.group.request
            history = s.token_ids[: r.start + r.num_tokens]
            rng = np.random.default_rng(hash(tuple(history)) % 2**32)
            x = np.full(V, -30.0, np.float32)
            x[ALPHABET] = rng.normal(size=len(ALPHABET)) * 3
            want = vllm_logits(x, req.params, req.vllm_words, s.num_prompt_tokens, history)
            got = packed_logits(x, bias, i, history[-1])
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{history=} {req.params}")
            self.checked += 1
            self.banned += int(np.isneginf(want[ALPHABET]).sum())
            self.conditional += (
                bias is not None and bias.after is not None and (bias.after[i] >= 0).any()
            )
            out[i] = int(np.argmax(got))
        return out


def random_params(rng, letters) -> SamplingParams:
    def word():
        w = "".join(rng.choice(letters, int(rng.integers(1, 4))))
        return (" " if rng.random() < 0.3 else "") + w

    kw = dict(temperature=0.0, ignore_eos=bool(rng.random() < 0.5))
    if rng.random() < 0.8:
        kw["bad_words"] = [word() for _ in range(int(rng.integers(1, 5)))]
    if rng.random() < 0.4:
        kw["allowed_token_ids"] = rng.choice(ALPHABET, int(rng.integers(2, 6)), False).tolist()
    if rng.random() < 0.4:
        kw["logit_bias"] = {int(t): float(rng.normal() * 4) for t in rng.choice(ALPHABET, 3)}
    if rng.random() < 0.5:
        kw["min_tokens"] = int(rng.integers(1, 5))
    if rng.random() < 0.4:
        kw["stop_token_ids"] = [int(rng.choice(ALPHABET[1:]))]
    if rng.random() < 0.2:
        kw["n"] = 2
    return SamplingParams(**kw)


def add_request(sim, rid, prompt, max_tokens, sp):
    """A request as the engine records it; False where the engine refuses its params."""
    stops = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else {EOS})
    bans = frozenset(sp.stop_token_ids) | {EOS}
    try:
        c = request_constraints(sp, stops, sim.tok, V, min_tokens_bans=bans)
    except ValueError:
        return False
    g = sim.add(rid, prompt, max_tokens, n=sp.n)
    g.request = types.SimpleNamespace(
        params=sp, stop_ids=stops, bias=c.bias, banned=c.banned, allowed=c.allowed,
        bad_words=c.bad_words, guide=c.guide, prompt_logprobs_missing=0,
        vllm_words=vllm_bad_words(sp.bad_words or (), sim.tok),
    )  # fmt: skip
    return True


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("folding", [False, True], ids=["bytes", "space-folding"])
def test_packed_constraints_equal_vllms(in_flight, folding):
    """Random bad words, allowed_token_ids, logit_bias, min_tokens and stop tokens over
    prompts that share prefixes, preempted and recomputed: every sampling row's logits
    as vLLM's."""
    tok = space_folding_tokenizer(200) if folding else resources.byte_tokenizer()
    letters = list("abcq") if folding else list("abc")
    rng = np.random.default_rng(17 + folding)
    sim = ConstraintSim(tok, num_pages=14, max_num_seqs=5, budget=12, in_flight=in_flight)
    shared = rng.choice(ALPHABET[1:], 6).tolist()
    added = 0
    for i in range(24):
        prompt = (shared if i % 2 else []) + rng.choice(ALPHABET[1:], rng.integers(1, 7)).tolist()
        added += add_request(sim, i, prompt, int(rng.integers(4, 16)), random_params(rng, letters))
    sim.run()
    assert added == 24 and sim.checked > 200 and sim.banned > 400 and sim.conditional > 30
    assert sim.sched.num_preemptions > 0 and sim.bm.stats().prefix_hits > 0


def test_guide_mask_allows_the_stop_tokens_at_a_full_match_only():
    """As xgrammar's bitmask in vLLM: a stop token (EOS, or one that is text: "c") only
    where the text is a full match, every other token as the guide says; the guide's
    own (cached) masks are left as they were."""
    tok = resources.byte_tokenizer()
    guide = compile_guide(StructuredOutputsParams(choice=["ab", "abc", "cab"]), tok, V)
    stops = frozenset({EOS, 99, 300})  # (300: past the vocabulary, never drawn)
    state, seen = guide.initial_state, 0
    for t in [97, 98, 99]:  # "", "a", "ab" (a match that "c" continues), "abc"
        before = guide.allowed(state).copy()
        bits = np.unpackbits(guide_mask(guide, state, stops).view(np.uint8), bitorder="little")
        want = [guide.accepting(state) if u in stops else guide.allows(state, u) for u in range(V)]
        np.testing.assert_array_equal(bits[:V], want)
        np.testing.assert_array_equal(guide.allowed(state), before)
        seen += guide.accepting(state)
        state = guide.advance(state, t)
    assert seen == 1 and guide.accepting(state)
