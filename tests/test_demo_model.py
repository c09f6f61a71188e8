"""The embedded demo model (pagedjax/demo_model/, made by scripts/train_demo.py).

It loads through the HF checkpoint path, its tokenizer round-trips, it is trained
(low loss on Python source, non-degenerate greedy text), and greedy generation through
the paged decode core (`pagedjax.decode.generate`) equals dense no-cache recompute
token for token: with the XLA backend over 200+ tokens, and with the Pallas GPU and
TPU kernels in interpret mode over a shorter run.

Token-for-token equality is checked in float32 (the shipped bf16 weights upcast
exactly): there paged and dense logits differ by at most ~2.5e-5 (logits up to ~20)
while the smallest top-two margin over these 600 greedy steps is ~4e-3, so a
mismatch means a bug, not rounding. In bf16 the two paths round differently (one of
the three prompts forks at a near tie after 16 tokens), so the bf16 test (slow) allows
a divergence only where the dense logits' top two are within bf16 noise.

Dense recompute: with greedy decoding, the dense model's choice at step i is the
argmax of `forward(seq[:i])[-1]`. Because the forward is causal (masked scores
contribute exact zeros), that equals `forward(seq_padded)[i - 1]` for the full
sequence padded to a fixed length, so one jitted forward checks every step; the
slow test also recomputes step by step on a growing (padded) buffer to show it.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import decode, demo, tokenizer, weights
from pagedjax import model as model_lib

PROMPTS = ("def main():\n", "import os\n", "class Config:\n    def __init__(self")
NUM_TOKENS = 200  # greedy tokens per prompt through the paged core (XLA backend)
# Shorter runs for the kernels in interpret mode: (prompts, tokens). The TPU interpreter
# costs about a second per decode step even at batch 1.
KERNEL_RUNS = {"gpu": (2, 20), "tpu": (1, 8)}
LONG_KERNEL_RUNS = {"gpu": (len(PROMPTS), NUM_TOKENS), "tpu": (1, 64)}  # slow tests
# Small padding floors: interpret mode pays for every padded grid cell.
SMALL_BUCKETS = decode.Buckets(min_tokens=8, min_seqs=1, min_pages=1, min_copies=1)

# A piece of ordinary Python, not from the standard library, for the loss check.
PYTHON_SNIPPET = '''import os
import sys


def read_lines(path, encoding="utf-8"):
    """Return the lines of a text file without trailing newlines."""
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self, name):
        self.name = name
        self.count = 0

    def add(self, value=1):
        if value < 0:
            raise ValueError("value must be non-negative")
        self.count += value
        return self.count


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(arg, len(read_lines(arg)))
'''


@pytest.fixture(scope="module")
def model_dir():
    return demo.demo_model_dir()


@pytest.fixture(scope="module")
def tok(model_dir):
    return tokenizer.Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def f32(model_dir):
    """(cfg, params): the shipped bf16 weights upcast to float32 (exact)."""
    return weights.load_hf_checkpoint(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def dense_fn():
    return jax.jit(model_lib.forward)


def dense_argmax(dense_fn, params, seq: list[int]) -> np.ndarray:
    """Argmax of the dense forward at every position of seq (padded to the model's max)."""
    n = params.config.max_position_embeddings
    buf = np.zeros((1, n), np.int32)
    buf[0, : len(seq)] = seq
    return np.asarray(jnp.argmax(dense_fn(params, jnp.asarray(buf))[0], axis=-1))[: len(seq)]


def assert_paged_equals_dense(dense_fn, params, prompts, generated):
    for prompt, gen in zip(prompts, generated, strict=True):
        seq = [*prompt, *gen]
        want = dense_argmax(dense_fn, params, seq)[len(prompt) - 1 : len(seq) - 1]
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(gen, want, strict=True)) if a != b), None
        )
        assert first_diff is None, (
            f"prompt {prompt}: paged and dense greedy tokens differ first at generated token "
            f"{first_diff}: paged {gen[first_diff]}, dense {int(want[first_diff])}"
        )


def assert_not_degenerate(tok, tokens):
    """Not one token repeated, nor a short cycle: a tiny model's greedy text may repeat
    a line now and then (the shipped model gives 24-38 distinct tokens per 200 here,
    its most common token at most 30%), but a random or broken model fails these."""
    counts = collections.Counter(tokens)
    text = tok.decode(tokens)
    assert len(counts) >= 20, f"only {len(counts)} distinct tokens: {text!r}"
    top = counts.most_common(1)[0][1]
    assert top <= 0.35 * len(tokens), f"one token is {top}/{len(tokens)}: {text!r}"
    assert sum(ch.isalpha() for ch in text) >= len(text) // 3, f"not text-like: {text!r}"


def test_demo_model_dir_reports_missing_files(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*tokenizer\.json"):
        demo.demo_model_dir()


def test_loads_as_shipped(model_dir, tok):
    cfg, params = weights.load_hf_checkpoint(model_dir)
    assert cfg.dtype == "bfloat16"
    assert cfg.tie_embeddings and cfg.num_kv_heads < cfg.num_heads  # tied head, GQA
    assert cfg.vocab_size == tok.vocab_size
    assert tok.bos_token_id == cfg.bos_token_id and tok.eos_token_ids == set(cfg.eos_token_ids)
    flat = model_lib.params_to_flat(params)
    n_params = sum(int(x.size) for x in flat.values())
    assert 1_000_000 < n_params < 10_000_000, n_params
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in flat.values())
    size = sum(f.stat().st_size for f in model_dir.iterdir())
    assert size < 20e6, f"demo model directory is {size / 1e6:.1f} MB"
    readme = (model_dir / "README.md").read_text()
    assert "scripts/train_demo.py" in readme and f"{n_params:,}" in readme


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x + 1\n",
        "\tindent\r\n  trailing   \n\n\n",
        "naïve café ✓ 日本語 🐍 \x00",
        PYTHON_SNIPPET,
    ],
)
def test_tokenizer_round_trips(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids) == text
    stream = tok.stream()
    assert "".join(stream.add(i) for i in ids) + stream.flush() == text


def test_is_trained(f32, tok, dense_fn):
    """Mean next-token loss on unseen Python is far below uniform (ln V ~ 8.3 nats)."""
    cfg, params = f32
    ids = tok.encode(PYTHON_SNIPPET)[: cfg.max_position_embeddings]
    buf = np.zeros((1, cfg.max_position_embeddings), np.int32)
    buf[0, : len(ids)] = ids
    logits = dense_fn(params, jnp.asarray(buf))[0, : len(ids) - 1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    loss = -float(jnp.take_along_axis(logp, jnp.asarray(ids[1:])[:, None], axis=-1).mean())
    assert loss < 0.5 * math.log(cfg.vocab_size), f"loss {loss:.3f} nats: not trained?"


@pytest.fixture(scope="module")
def xla_run(f32, prompt_ids):
    _, params = f32
    out = decode.generate(
        params, prompt_ids, max_new_tokens=NUM_TOKENS, stop_token_ids=(), backend="xla"
    )
    return out.tokens


def test_greedy_paged_equals_dense_xla(f32, prompt_ids, xla_run, dense_fn, tok):
    _, params = f32
    assert [len(t) for t in xla_run] == [NUM_TOKENS] * len(PROMPTS)
    assert_paged_equals_dense(dense_fn, params, prompt_ids, xla_run)
    for tokens in xla_run:
        assert_not_degenerate(tok, tokens)


def test_greedy_chunked_prefill_equals_unchunked(f32, prompt_ids, xla_run):
    """Prompts prefilled 3 tokens a step (mixed prefill + decode batches) change nothing."""
    _, params = f32
    out = decode.generate(
        params, prompt_ids, max_new_tokens=40, stop_token_ids=(), prefill_chunk=3, backend="xla"
    )
    assert out.tokens == [t[:40] for t in xla_run]


def _interpret(backend: str):
    """The interpret-mode argument for the backend's kernels.

    The TPU interpreter runs without its race detector here (the kernel's own tests
    run it): with it, a few decode steps take minutes on a CPU.
    """
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams(detect_races=False)
    return True


def greedy_with_kernels(params, prompts, n, backend):
    """n greedy tokens per prompt through the Pallas kernels of `backend`, interpreted."""
    out = decode.generate(
        params,
        prompts,
        max_new_tokens=n,
        stop_token_ids=(),
        backend=backend,
        interpret=_interpret(backend),
        buckets=SMALL_BUCKETS,
    )
    return out.tokens


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_greedy_kernels_interpret_equal_dense(backend, f32, prompt_ids, xla_run, dense_fn):
    _, params = f32
    num_prompts, n = KERNEL_RUNS[backend]
    prompts = prompt_ids[:num_prompts]
    tokens = greedy_with_kernels(params, prompts, n, backend)
    assert tokens == [t[:n] for t in xla_run[:num_prompts]]
    assert_paged_equals_dense(dense_fn, params, prompts, tokens)


@pytest.mark.slow
def test_dense_step_by_step_recompute_equals_one_shot(f32, prompt_ids, xla_run, dense_fn):
    """The literal no-cache loop: one dense forward per generated token."""
    _, params = f32
    prompt, n = prompt_ids[0], params.config.max_position_embeddings
    buf = np.zeros((1, n), np.int32)
    buf[0, : len(prompt)] = prompt
    length, tokens = len(prompt), []
    for _ in range(NUM_TOKENS):
        nxt = int(jnp.argmax(dense_fn(params, jnp.asarray(buf))[0, length - 1]))
        tokens.append(nxt)
        buf[0, length] = nxt
        length += 1
    assert tokens == xla_run[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_greedy_kernels_interpret_long(backend, f32, prompt_ids, xla_run):
    _, params = f32
    num_prompts, n = LONG_KERNEL_RUNS[backend]
    tokens = greedy_with_kernels(params, prompt_ids[:num_prompts], n, backend)
    assert tokens == [t[:n] for t in xla_run[:num_prompts]]


@pytest.mark.slow
def test_greedy_paged_equals_dense_bf16_up_to_ties(model_dir, prompt_ids, dense_fn):
    """As shipped (bf16): equal until the first step whose dense top two are a near tie."""
    _, params = weights.load_hf_checkpoint(model_dir)
    out = decode.generate(
        params, prompt_ids, max_new_tokens=NUM_TOKENS, stop_token_ids=(), backend="xla"
    )
    n = params.config.max_position_embeddings
    for prompt, gen in zip(prompt_ids, out.tokens, strict=True):
        seq = [*prompt, *gen]
        buf = np.zeros((1, n), np.int32)
        buf[0, : len(seq)] = seq
        logits = np.asarray(dense_fn(params, jnp.asarray(buf))[0, len(prompt) - 1 : len(seq) - 1])
        for i, tok_id in enumerate(gen):
            want = int(logits[i].argmax())
            if tok_id != want:
                top2 = np.sort(logits[i])[-2:]
                margin = (top2[1] - top2[0]) / max(1.0, float(np.abs(top2).max()))
                assert margin < 2e-2, (
                    f"bf16 paged token {tok_id} != dense {want} at step {i} with a clear "
                    f"margin {margin:.3g}"
                )
                break  # the sequences legitimately fork at a tie
