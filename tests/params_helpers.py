"""Random model weights for tests, shared by the model, decode, engine, TP and CLI tests."""

from __future__ import annotations

import math

import numpy as np

from pagedjax import model
from pagedjax.config import ModelConfig


def random_params(cfg: ModelConfig, seed: int = 0) -> model.Params:
    """Every parameter random (norm scales near 1, biases nonzero), so nothing is trivial.

    Linear weights are scaled by 1/sqrt(fan-in), which keeps clear logit gaps, so greedy
    argmax is stable across float32 paths.
    """
    rng = np.random.default_rng(seed)
    flat = {}
    for key, sds in model.param_shapes(cfg).items():
        shape = sds.shape
        if key.endswith(".scale"):
            value = 1.0 + 0.2 * rng.normal(size=shape)
        elif key.endswith(".bias"):
            value = 0.3 * rng.normal(size=shape)
        elif key.endswith("embedding"):
            value = rng.normal(size=shape)
        else:
            value = rng.normal(size=shape) / math.sqrt(shape[0])
        flat[key] = value.astype(np.float32)
    return model.params_from_flat(cfg, flat)


def dense_last_logits(params: model.Params, width: int = 64, dtype=np.float64):
    """A reference for engine tests: seqs (lists of token ids, each <= `width` long) ->
    [len(seqs), V] logits at each one's last token, from the dense model (jitted once)."""
    import jax
    import jax.numpy as jnp

    fn = jax.jit(model.forward)

    def last_logits(seqs):
        buf = np.zeros((len(seqs), width), np.int32)
        for j, s in enumerate(seqs):
            buf[j, : len(s)] = s
        logits = np.asarray(fn(params, jnp.asarray(buf)), dtype)
        return np.stack([logits[j, len(s) - 1] for j, s in enumerate(seqs)])

    return last_logits


def write_tiny_checkpoint(path) -> None:
    """An HF checkpoint directory at `path`: the `tiny` preset with random weights
    (`model.init_params`, seed 3) and a byte-level tokenizer.json."""
    from pagedjax import weights
    from pagedjax.config import PRESETS
    from pagedjax.resources import byte_tokenizer

    cfg = PRESETS["tiny"]
    weights.save_hf_checkpoint(model.init_params(cfg, seed=3), cfg, path)
    byte_tokenizer().tokenizer.save(str(path / "tokenizer.json"))


# The sampling flags generate.py and chat.py share, and the SamplingParams fields they set.
SAMPLING_ARGV = [
    *("--temperature", "0.5", "--top-k", "7", "--top-p", "0.9", "--min-p", "0.05"),
    *("--repetition-penalty", "1.1", "--presence-penalty", "0.3"),
    *("--frequency-penalty", "0.2", "--min-tokens", "1", "--logit-bias", '{"5": -2}'),
    *("--seed", "11"),
]
SAMPLING_FIELDS = dict(
    temperature=0.5,
    top_k=7,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    min_tokens=1,
    logit_bias={5: -2},
    seed=11,
)


def spy_generate(monkeypatch, *, outputs: bool = False) -> list:
    """Wraps `LLM.generate` to record every prompt it is sent (`outputs`: every output
    it returns instead); returns that list."""
    from pagedjax.engine import LLM

    sent = []
    generate = LLM.generate

    def spy(self, prompts, *args, **kwargs):
        sent.extend(() if outputs else prompts)  # before the call, which may raise
        outs = generate(self, prompts, *args, **kwargs)
        sent.extend(outs if outputs else ())
        return outs

    monkeypatch.setattr(LLM, "generate", spy)
    return sent


def capture_engine(monkeypatch) -> dict:
    """Records `LLM.__init__`'s keyword arguments ("init") and the `SamplingParams` that
    `LLM.generate` is sent ("sp"), which then stops the run (a Ctrl-C: a script's status
    130); returns that dict."""
    from pagedjax.engine import LLM

    seen = {}
    init = LLM.__init__

    def spy_init(self, *args, **kwargs):
        seen["init"] = kwargs
        init(self, *args, **kwargs)

    def stop(self, prompts, sp, **kwargs):
        seen["sp"] = sp
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "__init__", spy_init)
    monkeypatch.setattr(LLM, "generate", stop)
    return seen
