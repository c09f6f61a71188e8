"""Beam search parity with HuggingFace transformers: the engine's `SamplingParams(
beam_width=W, n=n, length_penalty=lp, max_tokens=m)` vs HF's `generate(num_beams=W,
do_sample=False, length_penalty=lp, early_stopping=False, num_return_sequences=n,
max_new_tokens=m)` on tiny random models.

    python scripts/check_hf_beam_parity.py                     # the default grid, a table
    python scripts/check_hf_beam_parity.py --widths 2,3 --max-tokens 1,5 --json
    OMP_NUM_THREADS=1 python scripts/check_hf_beam_parity.py --threads 1   # a shared CPU

It needs torch and transformers, as `check_hf_parity.py` does (its docstring has the
venv). Each case builds that script's tiny random float32 Llama (2 layers, GQA, vocab
300, every weight random), with EOS ids and their lm_head rows scaled by `--eos-scale`
(an EOS logit of that many times the others' spread: hypotheses end on EOS at varied
lengths, and EOS is often the step's best candidate); saves it; and loads it with
transformers (eager attention) and with the engine (paged cache, backend xla). Then for
every prompt (`--prompts` random ones, 3 to 20 tokens), beam width (`--widths`), length
penalty (`--length-penalties`) and `--max-tokens` value, with `n` cycling through
1..W, it compares the `n` returned sequences, best first:

* tokens: the generated ids, EOS included (HF's are cut after the first EOS: it pads
  with EOS). Transformers before the beam search rewrite (4.50) writes the first EOS id
  whichever ended a hypothesis, so EOS ids are compared as one.
* score: ours `cumulative_logprob / len ** lp` (len counting the EOS) vs HF's
  `sequences_scores`, within SCORE_RTOL (1e-4) of max(1, |HF's|); and our
  cumulative logprob vs HF's score times len ** lp.

A case passes when both are equal, or the first differing sequence's score is within
TIE_ATOL of HF's (a near tie that float32 rounding decides either way). Cases:

* `beam`: one EOS (id 2).
* `beam-eos2`: two EOS ids (2 and 5): stop tokens count twice in the candidates kept
  per beam (HF: `max(2, 1 + n_eos) * W` overall; ours `max(2W, W + n_stop)` per beam).

HF's early-stop rule (`early_stopping=False`) changed with its beam search rewrite in
4.50: before (`BeamHypotheses.is_done`) the search stopped once `W` hypotheses existed
and the worst scored at least the step's best candidate (an EOS too:
`next_scores.max()`) over `(g + 1) ** lp` (g tokens generated before the step); from
4.50 (`_check_early_stop_heuristic`) the best candidate that continues
(`running_beam_scores[:, :1]`), never an EOS, so where the step's best candidate is an
EOS, HF < 4.50 goes on where HF >= 4.50 stops (the results can then differ only with
lp > 0). `pagedjax.beam` follows the latter. Each case is also searched with the older
rule (our `BeamSearch` over HF's float64 log-softmax, whole vocabulary, going on where
the older rule would): `control` counts the cases where that changes the result (the
grid does tell the rules apart), and a mismatch that this search equals is `rule` (a
pass against transformers < 4.50 only) rather than `differ`.

Exit status: 0 when every case passes, 1 when one fails (or torch / transformers are
missing), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_hf_parity import _COMMON, _import_hf, randomize  # noqa: E402

SCORE_RTOL = 1e-4
TIE_ATOL = 1e-4
PAGE_SIZE = 8
CASES = {"beam": [2], "beam-eos2": [2, 5]}  # name -> EOS ids


def _llama(torch, transformers, eos: list[int], seed: int, eos_scale: float):
    """`check_hf_parity.py`'s tiny random Llama (`randomize`), with EOS ids and their
    lm_head rows scaled by `eos_scale`. (Built here: that script's `_hf_model` names
    model classes that transformers before 4.51 lacks.)"""
    config = transformers.LlamaConfig(**{**_COMMON, "eos_token_id": eos})
    torch.manual_seed(seed)
    model = randomize(torch, transformers.LlamaForCausalLM(config).to(torch.float32).eval(), seed)
    with torch.no_grad():
        for t in eos:
            model.lm_head.weight[t] *= eos_scale
    return model


def _ints(p, flag: str, text: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        p.error(f"--{flag} must be comma-separated ints, got {text!r}")
    if not vals or min(vals) < lo or max(vals) > hi:
        p.error(f"--{flag} must be in [{lo}, {hi}], got {vals}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"cases: {', '.join(CASES)}",
    )
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--widths", default="2,3,4,5,6", help="beam widths (2..16)")
    p.add_argument("--length-penalties", default="-1,0,1,2", help="comma-separated floats")
    p.add_argument("--max-tokens", default="1,2,3,5,8,13,20", help="max_new_tokens values")
    p.add_argument("--prompts", type=int, default=4, help="random prompts per setting")
    p.add_argument("--eos-scale", type=float, default=2.0, help="EOS lm_head rows' scale")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"--cases: unknown {unknown or args.cases!r}; choose from {list(CASES)}")
    args.widths = _ints(p, "widths", args.widths, 2, 16)
    args.max_tokens = _ints(p, "max-tokens", args.max_tokens, 1, 100)
    try:
        args.length_penalties = [float(x) for x in args.length_penalties.split(",") if x]
    except ValueError:
        p.error(f"--length-penalties must be comma-separated floats, got {args.length_penalties!r}")
    if not args.length_penalties or not all(map(math.isfinite, args.length_penalties)):
        p.error(f"--length-penalties must be finite, got {args.length_penalties}")
    if args.prompts < 1:
        p.error(f"--prompts must be >= 1, got {args.prompts}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def _hf_beams(torch, model, prompt, w, lp, m, n, eos):
    """HF's n best: [(generated ids cut after the first EOS, sequences_score)]."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=w,
            do_sample=False,
            length_penalty=lp,
            early_stopping=False,
            num_return_sequences=n,
            max_new_tokens=m,
            eos_token_id=eos,
            pad_token_id=eos[0],
            return_dict_in_generate=True,
            output_scores=True,
        )
    beams = []
    rows = out.sequences[:, len(prompt) :].tolist()
    for row, score in zip(rows, out.sequences_scores.tolist(), strict=True):
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        beams.append((row[:cut], float(score)))
    return beams


def _replay(prompt, w, lp, m, n, eos, logprobs_fn, older_rule: bool):
    """Our BeamSearch over exact whole-vocabulary logprobs (`logprobs_fn(prefixes)` ->
    [beams, V]), optionally with HF < 4.50's early-stop rule (going on while the step's
    best candidate, an EOS too, beats the worst hypothesis): the n best as
    [(tokens, score)]."""
    import numpy as np

    from pagedjax.beam import BeamSearch

    class Beams(BeamSearch):  # the same new beams, never a hypothesis: never an early stop
        def _add(self, *args, **kwargs):
            pass

    bs, beams_only = BeamSearch(w, lp, frozenset(eos), m), Beams(w, lp, frozenset(eos), m)
    beams = [([], 0.0)]
    while True:
        rows = np.asarray(logprobs_fn([prompt + g for g, _ in beams]), np.float64)
        order = np.argsort(-rows, axis=1, kind="stable")  # the whole vocabulary, ranked
        top_lps = np.take_along_axis(rows, order, axis=1)
        generated, sums = [g for g, _ in beams], [s for _, s in beams]
        new = bs.select(generated, sums, order, top_lps)
        g = len(beams[0][0])
        best = max(s + float(r.max()) for s, r in zip(sums, rows, strict=True))
        if (
            older_rule
            and not new
            and g + 1 < m
            and len(bs.hyps) >= w
            and bs.hyps[-1].score < best / (g + 1) ** lp
        ):
            new, bs.done = beams_only.select(generated, sums, order, top_lps), False
        if not new:
            break
        beams = [([*beams[b][0], tok], s) for b, tok, s, _ in new]
    return [(h.token_ids, h.score) for h in bs.best(n)]


def run_case(name: str, args, torch, transformers) -> dict:
    import numpy as np

    from pagedjax.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    eos = CASES[name]
    rng = np.random.default_rng(args.seed)
    settings = []  # (prompt index, width, length penalty, max tokens, n)
    for w in args.widths:
        for lp in args.length_penalties:
            for m in args.max_tokens:
                for i in range(args.prompts):
                    settings.append((i, w, lp, m, 1 + len(settings) % w))
    prompts = [rng.integers(0, 300, rng.integers(3, 21)).tolist() for _ in range(args.prompts)]
    prompts = [[t for t in p if t not in eos] or [1] for p in prompts]
    with tempfile.TemporaryDirectory(prefix=f"hf_beam_{name}_") as path:
        _llama(torch, transformers, eos, args.seed, args.eos_scale).save_pretrained(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        hf = hf.to(torch.float32).eval()
        longest = max(map(len, prompts)) + max(args.max_tokens)
        seqs = 64
        llm = LLM(
            path,
            page_size=PAGE_SIZE,
            num_pages=seqs * -(-longest // PAGE_SIZE) + 8,
            max_num_seqs=seqs,
            max_num_batched_tokens=64,
            backend="xla",
            dtype="float32",
        )
        sps = [
            SamplingParams(n=n, beam_width=w, length_penalty=lp, max_tokens=m)
            for _, w, lp, m, n in settings
        ]
        outs = llm.generate([prompts[i] for i, *_ in settings], sps)

    def same(a, b):  # EOS ids as one (see the docstring)
        return [eos[0] if t in eos else t for t in a] == [eos[0] if t in eos else t for t in b]

    def hf_logprobs(prefixes):  # equal lengths: one batch
        with torch.no_grad():
            logits = hf(torch.tensor(prefixes)).logits[:, -1].double()
        return torch.log_softmax(logits, -1).numpy()

    newer_hf = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 50)
    results = []
    for (i, w, lp, m, n), out in zip(settings, outs, strict=True):
        want = _hf_beams(torch, hf, prompts[i], w, lp, m, n, eos)
        got = [
            (list(c.token_ids), c.cumulative_logprob / len(c.token_ids) ** lp) for c in out.outputs
        ]
        # The control: the search under HF < 4.50's early-stop rule differs from ours.
        older = _replay(prompts[i], w, lp, m, n, eos, hf_logprobs, older_rule=True)
        rule_sensitive = len(older) != len(got) or not all(
            map(same, [t for t, _ in older], [t for t, _ in got])
        )
        k = next(
            (j for j in range(min(len(want), len(got))) if not same(want[j][0], got[j][0])),
            None if len(want) == len(got) else min(len(want), len(got)),
        )
        upto = len(got) if k is None else k
        err = cum_err = 0.0
        for (_, ours), c, (t, theirs) in zip(got[:upto], out.outputs, want, strict=False):
            err = max(err, abs(ours - theirs) / max(1.0, abs(theirs)))
            hf_cum = theirs * len(t) ** lp
            cum_err = max(cum_err, abs(c.cumulative_logprob - hf_cum) / max(1.0, abs(hf_cum)))
        verdict = "equal"
        if k is not None:
            gap = abs(got[k][1] - want[k][1]) if k < min(len(got), len(want)) else math.inf
            if gap < TIE_ATOL:
                verdict = "tie"
            elif len(older) == len(want) and all(
                map(same, [t for t, _ in older], [t for t, _ in want])
            ):
                verdict = "rule"
            else:
                verdict = "differ"
        passed = verdict in ("equal", "tie") or (verdict == "rule" and not newer_hf)
        results.append(
            dict(
                prompt=i,
                width=w,
                length_penalty=lp,
                max_tokens=m,
                n=n,
                verdict=verdict,
                rule_sensitive=rule_sensitive,
                first_mismatch=k,
                score_err=err,
                cum_err=cum_err,
                eos_ended=sum(t[-1] in eos for t, _ in want),
                lengths=[len(t) for t, _ in want],
                hf=None if verdict == "equal" else want,
                ours=None if verdict == "equal" else got,
                ok=passed and err < SCORE_RTOL and cum_err < SCORE_RTOL,
            )
        )
    return dict(
        case=name,
        eos=eos,
        compared=len(results),
        results=results,
        ok=all(r["ok"] for r in results),
        seconds=round(time.perf_counter() - t0, 1),
    )


def _table(r: dict) -> str:
    head = (
        f"{'case':10} {'W':>2} {'lp':>5} {'cases':>5} {'equal':>5} {'tie':>4} {'rule':>4} "
        f"{'differ':>6} {'control':>7} {'score err':>9} {'cum err':>9} {'EOS-ended':>9} "
        f"{'lengths':>8}  ok"
    )
    lines = [head, "-" * len(head)]
    groups: dict = {}
    for x in r["results"]:
        groups.setdefault((x["width"], x["length_penalty"]), []).append(x)
    for (w, lp), xs in groups.items():
        count = {v: sum(x["verdict"] == v for x in xs) for v in ("equal", "tie", "rule", "differ")}
        seqs = sum(len(x["lengths"]) for x in xs)
        lens = [n for x in xs for n in x["lengths"]]
        lines.append(
            f"{r['case']:10} {w:>2} {lp:>5g} {len(xs):>5} {count['equal']:>5} {count['tie']:>4} "
            f"{count['rule']:>4} {count['differ']:>6} {sum(x['rule_sensitive'] for x in xs):>7} "
            f"{max(x['score_err'] for x in xs):9.1e} {max(x['cum_err'] for x in xs):9.1e} "
            f"{sum(x['eos_ended'] for x in xs):>4}/{seqs:<4} {min(lens):>3}-{max(lens):<4} "
            f"{'PASS' if all(x['ok'] for x in xs) else 'FAIL'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch, transformers = _import_hf(True)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import jax

    versions = dict(
        transformers=transformers.__version__, torch=torch.__version__, jax=jax.__version__
    )
    if not args.json:
        print(", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    results = []
    for name in args.cases:
        try:
            r = run_case(name, args, torch, transformers)
        except Exception as e:  # a refusal (ours or HF's) fails this case, not the run
            r = dict(case=name, ok=False, error=f"{type(e).__name__}: {e}")
        results.append(r)
        if not args.json:
            took = f" ({r['seconds']} s)" if "seconds" in r else ""
            print(f"{name}: {'PASS' if r['ok'] else 'FAIL'}{took}", flush=True)
    ok = all(r["ok"] for r in results)
    if args.json:
        tolerances = dict(score_rtol=SCORE_RTOL, tie_atol=TIE_ATOL)
        print(json.dumps(dict(versions=versions, tolerances=tolerances, cases=results, ok=ok)))
        return 0 if ok else 1
    for r in results:
        if "error" in r:
            print(f"{r['case']}: FAIL {r['error'].splitlines()[0][:160]}")
            continue
        print(_table(r))
        for x in [x for x in r["results"] if x["verdict"] != "equal"][:10]:
            print(f"  {x['verdict']}: {json.dumps({k: v for k, v in x.items() if k != 'ok'})}")
    print(
        f"pass: the n sequences equal (EOS ids as one), or the first differing one a near tie "
        f"(score gap < {TIE_ATOL}), or (rule) HF < 4.50's early stop; scores within "
        f"{SCORE_RTOL} of max(1, |HF's|)"
    )
    print(
        "all cases pass"
        if ok
        else "FAILED: " + ", ".join(r["case"] for r in results if not r["ok"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
