"""Host cost of structured outputs (`pagedjax.guided`), and what they cost the engine.

Measures on this CPU:

- `compile_guide` of each spec for a synthetic ByteLevel vocabulary of `--vocab` tokens
  (random byte strings of 1 to 16 bytes, the lengths of a real BPE vocabulary): the
  token table (once per tokenizer) and the DFA;
- `Guide.allowed` of a state seen for the first time (the vectorized walk of every
  token) and of a cached one, over the states of `--walks` random token-by-token
  walks through the guide;
- the engine (the `tiny` preset, random weights, its byte tokenizer, the XLA backend):
  decode tokens per second of `--requests` requests constrained by a regex, against the
  same requests unconstrained, in one run. A guided row steps with the host in step
  with the device (its mask needs the previous token), so the ratio also counts the
  lost overlap; on the CPU the device step is slow, so the ratio flatters the host
  work relative to a GPU.

Each time is the best mean over `--repeats` rounds. On the CPU, read the ratios; the
absolute figures are this machine's.

    python scripts/bench_guided.py            # table
    python scripts/bench_guided.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import tokenizers

from pagedjax.guided import StructuredOutputsParams, compile_guide
from pagedjax.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
}
# Arithmetic with nested parentheses: a recursive grammar (unrolled `grammar.RULE_DEPTH`
# deep, as every grammar is).
GRAMMAR = """
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
SPECS = {
    "regex": StructuredOutputsParams(regex=r"[a-z]{3,12}@[a-z]{3,8}\.(com|org|net)"),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    "json_schema": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


def synthetic_tokenizer(vocab: int, seed: int = 0) -> Tokenizer:
    """A ByteLevel WordLevel tokenizer of `vocab` distinct random byte strings (the 256
    single bytes first, then lengths 2 to 16, mostly short)."""
    rng = np.random.default_rng(seed)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    pieces = {"".join(char[b] for b in bytes([i])) for i in range(256)}
    words = list(pieces)
    while len(words) < vocab:
        n = int(min(16, 2 + rng.geometric(0.25)))
        text = "".join(char[int(b)] for b in rng.integers(32, 127, n))  # mostly ASCII text
        if text not in pieces:
            pieces.add(text)
            words.append(text)
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])
    hf = tokenizers.Tokenizer(model)
    hf.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(hf)


def best_mean_s(run, repeats: int) -> float:
    """``run()`` returns (seconds, ops); the best per-op mean over rounds."""
    return min(s / max(n, 1) for s, n in (run() for _ in range(repeats)))


def walk_states(guide, rng, walks: int, length: int) -> list[int]:
    """The states of random token-by-token walks (each token drawn among the allowed)."""
    states = []
    for _ in range(walks):
        s = guide.initial_state
        for _ in range(length):
            states.append(s)
            bits = np.unpackbits(guide.allowed(s).view(np.uint8), bitorder="little")
            ok = np.flatnonzero(bits)
            if not ok.size:
                break
            s = guide.advance(s, int(rng.choice(ok)))
    return states


def bench_masks(args) -> dict:
    t0 = time.perf_counter()
    tok = synthetic_tokenizer(args.vocab)
    out = {"tokenizer_build_s": time.perf_counter() - t0}
    rng = np.random.default_rng(1)
    for name, spec in SPECS.items():
        t0 = time.perf_counter()
        guide = compile_guide(spec, tok, args.vocab)
        compile_s = time.perf_counter() - t0
        states = sorted(set(walk_states(guide, rng, args.walks, 48)))

        sizes = iter(range(args.vocab + 1, args.vocab + 1 + args.repeats))

        def fresh(spec=spec, states=states, sizes=sizes):
            # A new guide, none of its masks cached (its DFA and token table are).
            g = compile_guide(spec, tok, next(sizes))
            t = time.perf_counter()
            for s in states:
                g.allowed(s)
            return time.perf_counter() - t, len(states)

        def cached(guide=guide, states=states):
            t = time.perf_counter()
            for s in states:
                guide.allowed(s)
            return time.perf_counter() - t, len(states)

        out[name] = dict(
            compile_s=compile_s,
            dfa_states=guide.num_states,
            states_measured=len(states),
            fresh_mask_ms=best_mean_s(fresh, args.repeats) * 1e3,
            cached_mask_us=best_mean_s(cached, args.repeats) * 1e6,
        )
    return out


def bench_engine(args) -> dict:
    from pagedjax.config import PRESETS
    from pagedjax.engine import LLM, SamplingParams
    from pagedjax.model import init_params

    cfg = PRESETS["tiny"]
    llm = LLM(
        init_params(cfg, seed=0),
        page_size=16,
        num_pages=256,
        backend="xla",
        max_num_seqs=args.requests,
        max_num_batched_tokens=512,
    )
    prompts = [list(b"Contact: %d " % i) for i in range(args.requests)]
    spec = StructuredOutputsParams(regex=r"[a-z ]{24,40}\.")
    runs = {}
    for name, so in (("unguided", None), ("guided", spec), ("unguided_again", None)):
        sp = SamplingParams(
            temperature=1.0, seed=0, max_tokens=32, ignore_eos=True, structured_outputs=so
        )
        llm.generate(prompts, sp)  # compile, warm the mask cache
        best = 0.0
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp)
            n = sum(len(c.token_ids) for o in outs for c in o.outputs)
            best = max(best, n / (time.perf_counter() - t))
        runs[name] = best
    base = max(runs["unguided"], runs["unguided_again"])
    return dict(
        requests=args.requests,
        unguided_tok_s=base,
        guided_tok_s=runs["guided"],
        guided_over_unguided=runs["guided"] / base,
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=128_000, help="synthetic vocabulary size")
    p.add_argument("--walks", type=int, default=8, help="random walks per spec")
    p.add_argument("--requests", type=int, default=16, help="engine requests")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-engine", action="store_true", help="masks only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.vocab < 256:  # the synthetic tokenizer's first 256 tokens are the single bytes
        p.error(f"--vocab must be >= 256 (the single bytes), got {args.vocab}")
    for name in ("walks", "requests", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    res = {"machine": platform.processor() or platform.machine(), "vocab": args.vocab}
    res["masks"] = bench_masks(args)
    if not args.no_engine:
        res["engine"] = bench_engine(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return res
    m = res["masks"]
    print(f"synthetic ByteLevel vocabulary of {args.vocab} tokens: built in "
          f"{m['tokenizer_build_s']:.2f} s")  # fmt: skip
    print(f"{'spec':<12} {'compile s':>10} {'DFA states':>10} {'states':>7} "
          f"{'fresh mask ms':>14} {'cached us':>10}")  # fmt: skip
    for name in SPECS:
        r = m[name]
        print(
            f"{name:<12} {r['compile_s']:>10.3f} {r['dfa_states']:>10} "
            f"{r['states_measured']:>7} {r['fresh_mask_ms']:>14.2f} {r['cached_mask_us']:>10.1f}"
        )
    if "engine" in res:
        e = res["engine"]
        print(
            f"engine, {e['requests']} requests x 32 tokens: guided / unguided decode tokens/s "
            f"= {e['guided_over_unguided']:.2f} (this CPU)"
        )
    return res


if __name__ == "__main__":
    main()
