"""Trains the embedded demo model: a small Llama on the Python standard library's source.

Everything it needs is on every machine with Python: the corpus is the `.py` files
of the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`,
test packages and site-packages skipped), the tokenizer is a byte-level BPE trained
here with `tokenizers`, and the model is this project's own `pagedjax.model.Llama`
trained with optax (the `train` extra: `pip install -e ".[train]"`).

    python scripts/train_demo.py                      # writes pagedjax/demo_model/
    python scripts/train_demo.py --steps 5 --out /tmp/demo   # a smoke run

Data: files are listed in sorted order, shuffled with `--seed`, and taken until
`--corpus-mb` bytes; every 50th file of that order is held out for validation. Each
file is encoded as `<|bos|> tokens <|eos|>` and the files are concatenated into one
token stream, from which each step samples `--batch` windows of `--seq-len + 1`
tokens at seeded random offsets (one row in eight starts at a file's `<|bos|>`,
as prompts do at generation time).

Given the same `--seed`, flags and standard library (the corpus is whatever
Python runs the script), a run is deterministic on one machine. The result is written
through `pagedjax.weights.save_hf_checkpoint` as an HF-format directory
(config.json, model.safetensors in bfloat16, tokenizer.json, generation_config.json),
so it loads through the same code path as a downloaded checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import model as model_lib
from pagedjax.config import ModelConfig

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")  # ids 0, 1, 2
# Tests, third-party packages, codec tables (encodings/: long runs of near-identical
# lines, which teach a small model to loop) and pydoc's 750 kB of prose (pydoc_data/).
_SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "encodings",
    "pydoc_data",
}
SAMPLE_PROMPTS = ("import os\n", "def __init__(self", "class Config:\n    def __init__(self")
_DEFAULT_OUT = Path(__file__).resolve().parent.parent / "pagedjax" / "demo_model"


def stdlib_files(seed: int, corpus_mb: float) -> tuple[list[Path], Path]:
    """Seeded sample of the standard library's `.py` files, about `corpus_mb` MB in all.

    Returns:
      (files in sampling order, the stdlib root they were found under).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
        and not p.name.startswith("test_")
    )
    if not paths:
        raise ValueError(f"no .py files found under the standard library at {root}")
    random.Random(seed).shuffle(paths)
    budget, picked, total = corpus_mb * 1e6, [], 0
    for p in paths:
        if total >= budget:
            break
        picked.append(p)
        total += p.stat().st_size
    return picked, root


def read_texts(files: list[Path]) -> list[str]:
    """File contents (UTF-8, undecodable bytes replaced; empty files dropped)."""
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    return [t for t in texts if t.strip()]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenization, no normalizer, lossless)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """`<|bos|> file <|eos|>` for every file, back to back: [N] int32."""
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], np.int32))
    return np.concatenate(parts)


def make_config(args, vocab_size: int, dtype: str) -> ModelConfig:
    """The demo model's shape (a Llama 3.2-style small model: GQA, tied embeddings)."""
    return ModelConfig(
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        vocab_size=vocab_size,
        max_position_embeddings=args.seq_len,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        dtype=dtype,
        bos_token_id=SPECIAL_TOKENS.index("<|bos|>"),
        eos_token_ids=(SPECIAL_TOKENS.index("<|eos|>"),),
    )


def make_optimizer(args):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=args.lr,
        warmup_steps=min(args.warmup, max(args.steps - 1, 1)),
        decay_steps=max(args.steps, 2),
        end_value=args.lr * 0.1,
    )
    # No weight decay on RMSNorm scales (the only 1-D parameters).
    decay_mask = lambda state: jax.tree.map(lambda x: x.ndim >= 2, state)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask),
    ), schedule


def make_train_step(graphdef, cfg: ModelConfig, optimizer):
    import optax

    def loss_fn(state, tokens):
        # tokens: [B, T + 1] int32
        logits = model_lib.forward(model_lib.Params(graphdef, state, cfg), tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def train_step(state, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(state, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    eval_loss = jax.jit(loss_fn)
    return train_step, eval_loss


def sample_batch(
    rng: np.random.Generator, stream: np.ndarray, doc_starts: np.ndarray, batch: int, seq_len: int
):
    """[batch, seq_len + 1] int32 windows of the token stream.

    One row in eight (at least one) starts at a file's `<|bos|>`, as a prompt does at
    generation time; the rest start at uniformly random offsets. More file-aligned rows
    would mostly re-teach the same few hundred file headers.
    """
    limit = len(stream) - seq_len - 1
    doc_starts = doc_starts[doc_starts < limit]
    n_doc = max(1, batch // 8) if len(doc_starts) else 0
    starts = np.concatenate(
        [rng.choice(doc_starts, size=n_doc), rng.integers(0, limit, size=batch - n_doc)]
    )
    return stream[starts[:, None] + np.arange(seq_len + 1)]


def greedy(params, prompt_ids: list[int], num_tokens: int, max_len: int) -> list[int]:
    """Greedy decoding by dense recompute on a padded buffer (one compile)."""
    fwd = jax.jit(model_lib.forward)
    buf = np.zeros((1, max_len), np.int32)
    ids = list(prompt_ids)
    buf[0, : len(ids)] = ids
    for _ in range(min(num_tokens, max_len - len(ids))):
        logits = fwd(params, jnp.asarray(buf))
        nxt = int(jnp.argmax(logits[0, len(ids) - 1]))
        buf[0, len(ids)] = nxt
        ids.append(nxt)
    return ids[len(prompt_ids) :]


def write_tokenizer_files(tok, cfg: ModelConfig, out: Path) -> None:
    """tokenizer.json (which prepends <|bos|> like Llama's), tokenizer_config.json and
    generation_config.json, so HF tools and `pagedjax.tokenizer` agree on specials."""
    from tokenizers import processors

    pad, bos, eos = SPECIAL_TOKENS
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, cfg.bos_token_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    gen_cfg = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0],
        "pad_token_id": SPECIAL_TOKENS.index(pad),
        "do_sample": False,
    }
    for name, d in (("tokenizer_config.json", tok_cfg), ("generation_config.json", gen_cfg)):
        (out / name).write_text(json.dumps(d, indent=2) + "\n")


def write_readme(args, cfg: ModelConfig, facts: dict, samples: dict[str, str]) -> None:
    """README.md next to the weights: what this model is and exactly how it was made."""
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.name != "README.md")
    minutes = facts["train_seconds"] / 60
    rows = "\n".join(f"| {k} | {v} |" for k, v in facts.items())
    sample_blocks = "\n\n".join(
        f"Prompt `{p!r}`:\n\n```python\n{text}\n```" for p, text in samples.items()
    )
    shape = (
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size},\n  {cfg.num_heads} query heads / "
        f"{cfg.num_kv_heads} KV heads (GQA) of dim {cfg.head_dim}, SwiGLU "
        f"{cfg.intermediate_size},\n  vocab {cfg.vocab_size}, tied embeddings, RoPE theta "
        f"{cfg.rope_theta:g}, context {cfg.max_position_embeddings}"
    )
    text = f"""# pagedjax demo model

A small Llama-architecture model trained by this project, shipped inside the package
so that the demo runs with no download. It writes Python-flavoured code: it was
trained for {minutes:.0f} minutes on a {facts["cpu_count"]}-core CPU on the Python
standard library's own source, so expect plausible-looking, mostly wrong Python. Its
purpose is to make the system's output readable and its equality tests sharp (a
trained model's logits have clear winners), not to be useful.

- Model: `LlamaForCausalLM`, {shape};
  {facts["parameters"]:,} parameters, stored as bfloat16 (`model.safetensors`);
  {size / 1e6:.1f} MB for the whole directory.
- Tokenizer: byte-level BPE (GPT-2 pre-tokenization, lossless) trained with
  `tokenizers` on the same training files; special tokens `<|pad|>` = 0, `<|bos|>` = 1,
  `<|eos|>` = 2. `tokenizer.json` prepends `<|bos|>`; the model saw every file as
  `<|bos|> source <|eos|>`.
- Corpus: the `.py` files of the training interpreter's standard library
  (`sysconfig.get_paths()["stdlib"]`), skipping `test`/`tests`/`idle_test` packages,
  `test_*.py`, site-packages, `encodings/` (codec tables) and `pydoc_data/` (prose);
  listed sorted, shuffled with the seed, taken up to {args.corpus_mb:g} MB; every 50th
  file held out for the validation loss. A small corpus seen several times over: in
  our runs that gave less loopy greedy text than one pass over 12 MB of the library.
- Training: `pagedjax.model.forward` in float32, AdamW (b1 0.9, b2 0.95, weight decay
  0.1 except norms, global-norm clip 1.0), peak LR {args.lr:g}, {args.warmup} warmup
  steps, cosine decay to 10%; batches of {args.batch} x {args.seq_len} tokens (1/8 of the
  rows start at a file's `<|bos|>`, the rest at random offsets), seeded numpy sampling.
  The same seed, flags and standard library give the same model on the same machine.
- Written by `pagedjax.weights.save_hf_checkpoint`, loaded by
  `pagedjax.weights.load_hf_checkpoint` like any HF checkpoint;
  `pagedjax.demo.DEMO_MODEL_DIR` is this directory.

## How it was made

```bash
pip install -e ".[train]"
{facts["command"]}
```

| fact | value |
|---|---|
{rows}

Losses are mean next-token cross-entropy in nats (train: the last logged steps;
val: {args.eval_batches} fixed batches of held-out files).

## Greedy samples

Each prompt (after `<|bos|>`) continued for 80 tokens, greedily, by the bfloat16
weights (dense recompute). Greedy decoding of a model this small drifts and repeats
itself; it is Python-shaped, not Python.

{sample_blocks}
"""
    (args.out / "README.md").write_text(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256, help="training context (also max positions)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--corpus-mb", type=float, default=3.0, help="MB of stdlib source to use")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=4)
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden must be divisible by --heads, got {args.hidden=} {args.heads=}")
    if args.steps <= 0 or args.batch <= 0 or args.seq_len <= 1:
        p.error(f"--steps, --batch must be > 0 and --seq-len > 1, got {args}")
    return args


def main(argv=None) -> int:
    from pagedjax import weights

    args = parse_args(argv)
    t_start = time.perf_counter()
    files, root = stdlib_files(args.seed, args.corpus_mb)
    val_files, train_files = files[::50], [f for i, f in enumerate(files) if i % 50]
    train_texts, val_texts = read_texts(train_files), read_texts(val_files)
    n_bytes = sum(len(t.encode()) for t in train_texts)
    print(
        f"corpus: {len(train_texts)} train / {len(val_texts)} val files from {root}, "
        f"{n_bytes / 1e6:.1f} MB train",
        flush=True,
    )

    tok = train_tokenizer(train_texts, args.vocab_size)
    bos = tok.token_to_id("<|bos|>")
    train_stream, val_stream = encode_stream(tok, train_texts), encode_stream(tok, val_texts)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_stream):,} train tokens "
        f"({n_bytes / len(train_stream):.2f} bytes/token), {len(val_stream):,} val tokens",
        flush=True,
    )
    if min(len(train_stream), len(val_stream)) <= 2 * (args.seq_len + 1):
        raise ValueError(f"corpus too small for --seq-len {args.seq_len}; raise --corpus-mb")
    train_docs, val_docs = np.flatnonzero(train_stream == bos), np.flatnonzero(val_stream == bos)

    cfg = make_config(args, tok.get_vocab_size(), "float32")  # trained in float32
    params = model_lib.init_params(cfg, seed=args.seed)
    n_params = int(sum(x.size for x in jax.tree.leaves(params.state)))
    print(f"model: {n_params:,} parameters, {cfg}", flush=True)

    optimizer, schedule = make_optimizer(args)
    state, opt_state = params.state, optimizer.init(params.state)
    train_step, eval_loss = make_train_step(params.graphdef, cfg, optimizer)
    data_rng = np.random.default_rng(args.seed)
    val_rng = np.random.default_rng(args.seed + 1)
    val_batches = [
        jnp.asarray(sample_batch(val_rng, val_stream, val_docs, args.batch, args.seq_len))
        for _ in range(args.eval_batches)
    ]

    def val_loss(state) -> float:
        return float(np.mean([eval_loss(state, b) for b in val_batches]))

    t_train, recent, val = time.perf_counter(), [], float("nan")
    for step in range(1, args.steps + 1):
        batch = sample_batch(data_rng, train_stream, train_docs, args.batch, args.seq_len)
        state, opt_state, loss = train_step(state, opt_state, jnp.asarray(batch))
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            loss = float(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"training loss is {loss} at step {step}")
            recent = [*recent[-4:], loss]
            elapsed = time.perf_counter() - t_train
            print(
                f"step {step:5d}/{args.steps}  loss {loss:.4f}  "
                f"lr {float(schedule(step)):.2e}  {elapsed:7.1f}s",
                flush=True,
            )
        if step % args.eval_every == 0 or step == args.steps:
            val = val_loss(state)
            print(f"step {step:5d}  val loss {val:.4f}", flush=True)
    train_seconds = time.perf_counter() - t_train

    # Saved in bfloat16 through the same writer any HF checkpoint would go through.
    out_cfg = dataclasses.replace(cfg, dtype="bfloat16")
    trained = model_lib.Params(params.graphdef, state, cfg)
    out_params = model_lib.params_from_flat(out_cfg, model_lib.params_to_flat(trained))
    args.out.mkdir(parents=True, exist_ok=True)
    weights.save_hf_checkpoint(out_params, out_cfg, args.out)
    write_tokenizer_files(tok, out_cfg, args.out)

    samples = {}
    for prompt in SAMPLE_PROMPTS:
        prompt_ids = [bos, *tok.encode(prompt, add_special_tokens=False).ids]
        samples[prompt] = prompt + tok.decode(greedy(out_params, prompt_ids, 80, args.seq_len))
    facts = {
        "command": " ".join(
            ["python", "scripts/train_demo.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_seen": args.steps * args.batch * args.seq_len,
        "corpus_files": f"{len(train_texts)} train + {len(val_texts)} held out",
        "corpus_tokens": f"{len(train_stream):,} train, {len(val_stream):,} held out",
        "corpus_python": sys.version.split()[0],
        "final_train_loss": round(float(np.mean(recent)), 4),
        "final_val_loss": round(val, 4),
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "parameters": n_params,
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
    }
    write_readme(args, out_cfg, facts, samples)
    print("summary: " + json.dumps(facts), flush=True)
    for prompt, text in samples.items():
        print(f"greedy sample (bf16 weights), prompt {prompt!r}:\n{text}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
