"""Parity with HuggingFace transformers itself: tiny random HF models vs pagedjax, and
tokenizers and chat templates in each family's style vs transformers' (the tok-* cases).

    python scripts/check_hf_parity.py                      # every case, two tables
    python scripts/check_hf_parity.py --cases mistral-window,qwen3-yarn --json
    python scripts/check_hf_parity.py --cases tok          # the tok-* cases (seconds)
    OMP_NUM_THREADS=1 python scripts/check_hf_parity.py --threads 1   # on a shared CPU

The test suite compares the model with numpy re-implementations of our own; this
compares it with transformers' modeling code. It needs torch and transformers (the
tok-* cases transformers alone), which are not pagedjax dependencies (a developer
tool), e.g. in a separate venv:

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/hfvenv/bin/pip install transformers safetensors && /tmp/hfvenv/bin/pip install -e .

Each case builds a tiny random float32 HF model (2 layers, GQA, vocab 300; every weight
drawn at random, biases and norm weights included, so none of them is a no-op), saves
it with `save_pretrained` (safetensors), and loads the directory twice: with
transformers (`from_pretrained`, which reads config.json as HF does) and with pagedjax.
Then:

* logits: HF's forward (eager attention) vs `pagedjax.model.forward` on random token
  ids, `--seq-len` long (past the original context of the scaled-RoPE cases and far
  past the sliding windows). Passes when ||ours - HF|| / ||HF|| < LOGITS_RTOL (1e-4,
  DESIGN.md's float32 bound): the two differ only in float32 summation order and in
  RoPE's inverse frequencies (HF computes them in float32, we in float64 then round),
  errors around 1e-6, while a wrong scaling rule, mask or bias is off by 1e-2 or more.
* control: the same forward with the case's feature switched off on our side (no rope
  scaling, no window, zero biases, no q/k norm, a derived yarn attention factor, the
  rope dict's original context instead of the top-level one) must be off by more than
  CONTROL_MIN (1e-2): proof the case exercises that feature.
* greedy: HF `generate(do_sample=False)` (its own KV cache) vs the engine (`LLM`,
  paged cache, backend xla, page size 8, chunked prefill) on `--prompt-lens` prompts
  continued `--max-tokens` tokens, token for token: across pages, past the window and
  past the original context. Passes when all tokens are equal, or where they first
  differ HF's logits of its token and ours are within TIE_ATOL (1e-3, 30x the logit
  errors seen; a near tie that rounding decides either way; the sequences diverge
  after it, so nothing later is compared).
* logprobs: the engine's log-probabilities of the prompt tokens (paged, chunked
  prefill) and of the generated ones (paged decode) vs HF's log-softmax, up to the
  first mismatch. Passes when every difference over the largest |HF logit| at that
  position is below LOGPROB_RTOL (1e-5; float32 rounding gives ~1e-6).

HF's reading of some keys has changed across transformers versions (yarn's `factor`,
a top-level `original_max_position_embeddings`; see `pagedjax.hf_config`): a result
holds for the transformers version printed first. An exception in a case (our loader
or HF refusing its config) fails that case and the run goes on.

The tok-* cases (tokenizers and chat templates in each family's style) live in
`hf_parity_tok.py`; its docstring says what they check.

Exit status: 0 when every case passes, 1 when one fails (or torch / transformers are
missing), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from hf_parity_tok import TOK_CASE_NAMES, TOK_CASES, run_tok_case, tok_table  # noqa: E402

LOGITS_RTOL = 1e-4
TIE_ATOL = 1e-3
LOGPROB_RTOL = 1e-5
CONTROL_MIN = 1e-2
PAGE_SIZE = 8

_COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
    bos_token_id=None,  # no EOS: neither side stops early
    eos_token_id=None,
    pad_token_id=None,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One HF model to compare. `control` switches the case's feature off on our side,
    (ModelConfig, {path: array}) -> the same: our logits must then differ from HF's by
    more than CONTROL_MIN, or the case could not have caught that feature done wrong."""

    name: str
    family: str  # llama | qwen2 | qwen3 | mistral
    config: dict  # HF config kwargs over _COMMON
    what: str
    control: Callable | None = None
    edit: Callable | None = None  # changes the saved config.json dict in place


def _no_rope_scaling(cfg, flat):
    return dataclasses.replace(cfg, rope_scaling=None), flat


# Llama 3.1's scaling with an original context of 64, so that it matters at 2 x 256 tokens.
_LLAMA3_ROPE = dict(
    max_position_embeddings=512,
    rope_parameters=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
        rope_theta=10000.0,
    ),
)


def _no_window(cfg, flat):
    return dataclasses.replace(cfg, sliding_window=None), flat


def _zero_biases(cfg, flat):
    return cfg, {k: v * 0 if k.endswith(".bias") else v for k, v in flat.items()}


def _no_qk_norm(cfg, flat):
    flat = {k: v for k, v in flat.items() if not k.endswith(("q_norm.scale", "k_norm.scale"))}
    return dataclasses.replace(cfg, qk_norm=False), flat


def _rope_dicts_original(cfg, flat):  # what transformers 4.x read
    rs = dataclasses.replace(cfg.rope_scaling, original_max_position_embeddings=64)
    return dataclasses.replace(cfg, rope_scaling=rs), flat


def _top_level_theta(cfg, flat):  # what pagedjax read before it followed HF 5's one dict
    return dataclasses.replace(cfg, rope_theta=10000.0), flat


def _derived_attention_factor(cfg, flat):
    rs = dataclasses.replace(cfg.rope_scaling, attention_factor=None)
    return dataclasses.replace(cfg, rope_scaling=rs), flat


CASES = (
    Case("llama", "llama", {}, "plain Llama, GQA 4/2"),
    Case(
        "llama-bias",
        "llama",
        dict(attention_bias=True),
        "attention_bias: q/k/v/o biases",
        _zero_biases,
    ),
    Case(
        "llama3-rope",
        "llama",
        _LLAMA3_ROPE,
        "rope llama3, original context 64",
        _no_rope_scaling,
    ),
    Case(
        "llama3-top-original",
        "llama",
        _LLAMA3_ROPE,
        "rope llama3, a top-level original context 128 over rope_parameters' 64",
        _rope_dicts_original,
        # Written into config.json: HF 5 prefers it to rope_parameters' (a config built
        # in memory would have rewritten rope_parameters with it before saving).
        edit=lambda c: c.update(original_max_position_embeddings=128),
    ),
    Case(
        "llama-linear",
        "llama",
        dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
        "rope linear, factor 4",
        _no_rope_scaling,
    ),
    Case(
        "llama-nested-theta",
        "llama",
        dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)),
        "rope linear, rope_theta 300 only inside rope_scaling (top level 10000)",
        _top_level_theta,
        # HF 5 reads one dict, rope_scaling over rope_parameters, and its theta wins.
        edit=lambda c: c.update(
            rope_theta=10000.0,
            rope_scaling=dict(rope_type="linear", factor=2.0, rope_theta=300.0),
        ),
    ),
    Case(
        "llama-yarn-mscale",
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=0.5,
                beta_fast=16.0,
                beta_slow=2.0,
                truncate=False,
                rope_theta=10000.0,
            )
        ),
        "rope yarn, mscale/mscale_all_dim, betas, truncate false",
        _no_rope_scaling,
    ),
    Case("qwen2", "qwen2", {}, "Qwen2: q/k/v biases", _zero_biases),
    Case(
        "qwen2-window",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
        "Qwen2, sliding window 16 on every layer",
        _no_window,
    ),
    Case(
        "qwen3-yarn",
        "qwen3",
        dict(
            head_dim=32,  # H * D = 128 != hidden 64, as in Qwen3
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                rope_theta=10000.0,
            ),
        ),
        "Qwen3: q/k norm, tied embeddings, rope yarn factor 4 on 64",
        _no_rope_scaling,
    ),
    Case(
        "qwen3-qk-norm-bias",
        "qwen3",
        dict(attention_bias=True),
        "Qwen3: q/k norm (the control drops it), attention_bias",
        _no_qk_norm,
    ),
    Case(
        "qwen3-yarn-attn-factor",
        "qwen3",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                attention_factor=0.8,
                rope_theta=10000.0,
            ),
        ),
        "Qwen3, rope yarn with an explicit attention_factor",
        _derived_attention_factor,
    ),
    Case(
        "mistral-window",
        "mistral",
        dict(sliding_window=16, head_dim=32, max_position_embeddings=512),
        "Mistral, sliding window 16, H * D != hidden",
        _no_window,
    ),
)
CASE_NAMES = tuple(c.name for c in CASES)


ALL_NAMES = CASE_NAMES + TOK_CASE_NAMES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"cases: {', '.join(ALL_NAMES)}; groups: models, tok",
    )
    p.add_argument(
        "--cases",
        default="models,tok",
        help="comma-separated case names or groups (models: the model cases, tok: tok-*)",
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens of the logits check")
    p.add_argument(
        "--prompt-lens", default="7,37,150", help="comma-separated prompt lengths (greedy)"
    )
    p.add_argument("--max-tokens", type=int, default=80, help="tokens generated per prompt")
    p.add_argument(
        "--seed", type=int, default=0, help="weights, tokens and prompts; tok-* random ids"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    groups = dict(models=CASE_NAMES, tok=TOK_CASE_NAMES)
    names = [n for c in args.cases.split(",") if c for n in groups.get(c, [c])]
    unknown = [c for c in names if c not in ALL_NAMES]
    if unknown or not names:
        p.error(
            f"--cases: unknown {unknown or args.cases!r}; choose from {list(ALL_NAMES)} "
            f"or the groups {list(groups)}"
        )
    args.cases = list(dict.fromkeys(names))
    try:
        args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    except ValueError:
        p.error(f"--prompt-lens must be comma-separated ints, got {args.prompt_lens!r}")
    if not args.prompt_lens or min(args.prompt_lens) < 1:
        p.error(f"--prompt-lens must be >= 1, got {args.prompt_lens}")
    for flag in ("seq_len", "max_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    need, limit = max(args.prompt_lens) + args.max_tokens, _COMMON["max_position_embeddings"]
    if need > limit:  # the fewest positions of any case
        p.error(f"the longest prompt + --max-tokens = {need} exceeds the models' {limit} positions")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def _import_hf(need_torch: bool):
    """(torch or None, transformers), or exits with one line saying what to install."""
    try:
        import transformers

        torch = None
        if need_torch:  # the tok-* cases need transformers alone
            import torch
    except ImportError as e:
        sys.exit(
            f"check_hf_parity.py needs transformers, and torch for the model cases (developer "
            f"tools, not pagedjax dependencies; see this script's docstring): {e}"
        )
    return torch, transformers


def _hf_model(torch, transformers, case: Case, seed: int):
    """A float32 HF model of `case` with every parameter drawn at random."""
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[case.family]
    config = cls[0](**copy.deepcopy({**_COMMON, **case.config}))  # HF may edit it
    torch.manual_seed(seed)
    return randomize(torch, cls[1](config).to(torch.float32).eval(), seed)


def randomize(torch, model, seed: int):
    """`model` (float32) with every parameter drawn at random, in place; returned."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: make them matter
        for name, p in model.named_parameters():  # a tied head is the embedding, once
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # [out, in]: unit-variance outputs for unit-variance inputs
                p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def _hf_greedy(torch, model, prompt: list[int], max_tokens: int):
    """(tokens, logits [N, V] float64) of HF's greedy continuation of `prompt`."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack(out.logits)[:, 0].double().numpy()
    return tokens, logits


def _errors(ours, ref) -> tuple[float, float]:
    """(max |ours - ref|, ||ours - ref|| / ||ref||) as floats."""
    import numpy as np

    diff = ours - ref
    return float(np.abs(diff).max()), float(np.linalg.norm(diff) / np.linalg.norm(ref))


def _logprob_error(ours: float, hf_logits, token: int) -> float:
    """|our logprob of `token` - HF's| over the largest |HF logit| at that position (the
    rounding error of a float32 logit, hence of its log-softmax, grows with its size)."""
    import numpy as np

    x = hf_logits - hf_logits.max()
    hf_lp = x[token] - np.log(np.exp(x).sum())
    return float(abs(ours - hf_lp) / max(1.0, np.abs(hf_logits).max()))


def run_case(case: Case, args, torch, transformers) -> dict:
    import jax
    import numpy as np

    from pagedjax import model as model_lib
    from pagedjax import weights
    from pagedjax.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix=f"hf_parity_{case.name}_") as path:
        _hf_model(torch, transformers, case, args.seed).save_pretrained(path)
        if case.edit is not None:
            config_file = pathlib.Path(path) / "config.json"
            config = json.loads(config_file.read_text())
            case.edit(config)
            config_file.write_text(json.dumps(config))
        # HF's model as HF reads the directory, as we do (config.json's reading included:
        # a config built in memory can differ, e.g. a top-level original context).
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        vocab = hf.config.vocab_size
        cfg, params = weights.load_hf_checkpoint(path, dtype="float32")
        # (a) dense logits on random tokens
        tokens = rng.integers(0, vocab, (2, args.seq_len))
        with torch.no_grad():
            ref = hf(torch.tensor(tokens)).logits.double().numpy()
        ours = np.asarray(jax.jit(model_lib.forward)(params, tokens), np.float64)
        max_abs, rel = _errors(ours, ref)
        control = None
        if case.control is not None:
            off_cfg, off_flat = case.control(cfg, model_lib.params_to_flat(params))
            off = model_lib.forward(model_lib.params_from_flat(off_cfg, off_flat), tokens)
            control = _errors(np.asarray(off, np.float64), ref)[1]
        # (b) greedy through the engine, (c) its logprobs
        prompts = [rng.integers(0, vocab, n).tolist() for n in args.prompt_lens]
        need = max(args.prompt_lens) + args.max_tokens
        pages = len(prompts) * -(-need // PAGE_SIZE) + 8
        llm = LLM(
            path,
            page_size=PAGE_SIZE,
            num_pages=pages,
            max_num_batched_tokens=64,  # the longest prompts prefill in chunks
            max_num_seqs=len(prompts),
            backend="xla",
            dtype="float32",
        )
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0,
        )
        outs = llm.generate(prompts, sp)
    mismatch, tie, lp_err = None, None, 0.0
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        want, logits = _hf_greedy(torch, hf, prompt, args.max_tokens)
        got = out.outputs[0].token_ids
        # The prompt's logprobs, from HF's forward over the whole prompt.
        with torch.no_grad():
            plog = hf(torch.tensor([prompt])).logits[0].double().numpy()
        for j in range(1, len(prompt)):
            ours_lp = out.prompt_logprobs[j][prompt[j]]
            lp_err = max(lp_err, _logprob_error(ours_lp, plog[j - 1], prompt[j]))
        n = min(len(want), len(got))  # fewer tokens from us: a mismatch where ours end
        k = next((j for j in range(n) if want[j] != got[j]), None if len(got) == len(want) else n)
        for j in range(n if k is None else min(k + 1, n)):  # step k: both chose from it
            ours_lp = out.outputs[0].logprobs[j][got[j]]
            lp_err = max(lp_err, _logprob_error(ours_lp, logits[j], got[j]))
        if k is not None:
            gap = float(logits[k, want[k]] - logits[k, got[k]]) if k < n else math.inf
            mismatch = mismatch or (i, k, len(prompt) + k, gap)  # the first prompt's
            tie = gap < TIE_ATOL and tie is not False
    greedy_ok = mismatch is None or tie is True
    control_ok = control is None or control > CONTROL_MIN
    ok = rel < LOGITS_RTOL and greedy_ok and lp_err < LOGPROB_RTOL and control_ok
    return dict(
        case=case.name,
        what=case.what,
        logits_max_abs=max_abs,
        logits_rel=rel,
        control_rel=control,
        greedy_equal=mismatch is None,
        first_mismatch=None
        if mismatch is None
        else dict(prompt=mismatch[0], step=mismatch[1], position=mismatch[2], gap=mismatch[3]),
        near_tie=bool(tie),
        logprob_rel=lp_err,
        ok=ok,
        seconds=round(time.perf_counter() - t0, 1),
    )


def _table(results: list[dict]) -> str:
    head = (
        f"{'case':24} {'logits max abs':>14} {'rel':>8} {'control':>8} {'greedy eq':>9} "
        f"{'first mismatch':>30} {'logprob err':>11}  ok"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:24} FAIL {r['error'].splitlines()[0][:160]}")
            continue
        m = r["first_mismatch"]
        where = (
            "-"
            if m is None
            else f"p{m['prompt']} step {m['step']} (pos {m['position']}) gap {m['gap']:.1e}"
        )
        eq = "y" if r["greedy_equal"] else ("tie" if r["near_tie"] else "n")
        control = "-" if r["control_rel"] is None else f"{r['control_rel']:8.1e}"
        lines.append(
            f"{r['case']:24} {r['logits_max_abs']:14.2e} {r['logits_rel']:8.1e} {control:>8} "
            f"{eq:>9} {where:>30} {r['logprob_rel']:11.2e}  {'PASS' if r['ok'] else 'FAIL'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    need_torch = any(n in CASE_NAMES for n in args.cases)
    torch, transformers = _import_hf(need_torch)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()  # tok cases: no class warnings
    if args.threads is not None and torch is not None:
        torch.set_num_threads(args.threads)
    import jax
    import tokenizers

    versions = dict(
        transformers=transformers.__version__,
        tokenizers=tokenizers.__version__,
        torch=None if torch is None else torch.__version__,
        jax=jax.__version__,
    )
    if not args.json:
        print(", ".join(f"{k} {v}" for k, v in versions.items() if v), flush=True)
    results = []
    for name in args.cases:
        tok_case = name in TOK_CASE_NAMES
        case = TOK_CASES[TOK_CASE_NAMES.index(name)] if tok_case else CASES[CASE_NAMES.index(name)]
        try:
            if tok_case:
                r = run_tok_case(case, args, transformers)
            else:
                r = run_case(case, args, torch, transformers)
        except Exception as e:  # a refusal (ours or HF's) fails this case, not the run
            r = dict(case=name, what=case.what, ok=False, error=f"{type(e).__name__}: {e}")
        results.append(r)
        if not args.json:
            took = f" ({r['seconds']} s)" if "seconds" in r else ""
            print(f"{name}: {'PASS' if r['ok'] else 'FAIL'}{took}", flush=True)
    ok = all(r["ok"] for r in results)
    models = [r for r in results if r["case"] in CASE_NAMES]
    toks = [r for r in results if r["case"] in TOK_CASE_NAMES]
    if args.json:
        tolerances = dict(
            logits_rtol=LOGITS_RTOL,
            tie_atol=TIE_ATOL,
            logprob_rtol=LOGPROB_RTOL,
            control_min=CONTROL_MIN,
        )
        doc = dict(versions=versions, tolerances=tolerances, cases=results, ok=ok)
        print(json.dumps(doc, indent=1, ensure_ascii=False))
    else:
        if models:
            print(_table(models))
            print(
                f"pass: logits rel < {LOGITS_RTOL}; control (the case's feature off on our "
                f"side) rel > {CONTROL_MIN}; greedy equal, or first mismatch a near tie (HF "
                f"logit gap < {TIE_ATOL}); prompt + generated logprobs within {LOGPROB_RTOL} "
                "of the largest |logit|"
            )
        if toks:
            print(tok_table(toks))
            print(
                "pass: every check equal (equal/compared per column), HF's result adjusted "
                "only by the deliberate rules listed"
            )
        print(
            "all cases pass"
            if ok
            else "FAILED: " + ", ".join(r["case"] for r in results if not r["ok"])
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
