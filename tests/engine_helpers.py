"""What the engine tests share (tests/test_engine.py, tests/test_engine_requests.py,
tests/test_engine_beam.py, and tests/tp_cases.py at tp = 4): one geometry (tiny model,
f32, XLA, page size 8, 64 pages, default buckets), so that the tests share compiled
programs, and the dense no-cache references their outputs are checked against."""

import jax
import jax.numpy as jnp
import numpy as np
import params_helpers
from beam_oracle import whole_vocabulary_search

from pagedjax import decode, model
from pagedjax.config import PRESETS
from pagedjax.engine import SamplingParams

TINY = PRESETS["tiny"]  # float32, vocab 256, EOS 2
PS, PAGES, WIDTH = 8, 64, 64  # page size, pages, dense buffer width (>= any sequence)
GEOMETRY = dict(page_size=PS, num_pages=PAGES, backend="xla", max_num_seqs=8)

# The weight-update tests' prompts (tests/test_weight_sync.py, tests/test_wake_tags.py):
# two full pages in common, so that an update must drop the K/V the prefix cache holds.
_rng = np.random.default_rng(3)
_prefix = _rng.integers(3, 256, size=2 * PS).tolist()
UPDATE_PROMPTS = [_prefix + _rng.integers(3, 256, size=n).tolist() for n in (3, 7)]


def random_params(seed: int = 0) -> model.Params:
    """Weights with clear logit gaps (so greedy argmax is stable across f32 paths)."""
    return params_helpers.random_params(TINY, seed)


class Dense:
    """Dense no-cache logits at the last position of up to 8 sequences per call."""

    def __init__(self, params):
        self.params = params
        self.fn = jax.jit(model.forward)

    def last_logits(self, seqs) -> np.ndarray:
        out = []
        for i in range(0, len(seqs), 8):
            part = seqs[i : i + 8]
            buf = np.zeros((8, WIDTH), np.int32)
            for j, s in enumerate(part):
                buf[j, : len(s)] = s
            logits = np.asarray(self.fn(self.params, jnp.asarray(buf)))
            out += [logits[j, len(s) - 1] for j, s in enumerate(part)]
        return np.stack(out)

    def greedy(self, prompts, max_tokens, stop_ids=(2,)):
        """Dense greedy continuations; `max_tokens`: an int or one per prompt."""
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        outs = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while active:
            logits = self.last_logits([prompts[i] + outs[i] for i in active])
            for i, row in zip(list(active), logits, strict=True):
                tok = int(np.argmax(row))
                outs[i].append(tok)
                if tok in stop_ids or len(outs[i]) >= max_tokens[i]:
                    active.remove(i)
        return outs


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def greedy_ids(llm, prompts=UPDATE_PROMPTS, max_tokens=6) -> list[list[int]]:
    """`llm`'s greedy continuations of `prompts`."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(max_tokens))]


def compiles() -> int:
    """Programs the jitted steps have compiled so far, all kinds (`decode.compile_counts`)."""
    return sum(decode.compile_counts().values())


def check_clean(llm):
    llm.block_manager.check_invariants()
    stats = llm.block_manager.stats()
    assert stats.num_used_pages == 0 and stats.num_seqs == 0
    assert not llm.has_unfinished_requests()


def dense_log_softmax(dense, rows) -> np.ndarray:
    logits = dense.last_logits(rows).astype(np.float64)
    top1 = logits.max(-1, keepdims=True)
    return logits - top1 - np.log(np.exp(logits - top1).sum(-1, keepdims=True))


def dense_beam_search(dense, prompt, width, max_tokens, stop_ids, length_penalty):
    """Exhaustive: every beam's whole-vocabulary log-probabilities, HF-style selection;
    (score, tokens, sum, reason) per hypothesis, best first."""

    def logprobs(prefixes):
        logits = dense.last_logits([prompt + g for g in prefixes]).astype(np.float64)
        m = logits.max(-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))

    return whole_vocabulary_search(logprobs, width, max_tokens, stop_ids, length_penalty)


def dense_rows(params, width: int = WIDTH, dtype=np.float64):
    """`params_helpers.dense_last_logits`, with the batch padded to a multiple of 8 rows:
    one compiled forward serves every batch (a dense greedy loop's shrinking active set
    compiled one program per size), as `Dense` does."""
    fn = jax.jit(model.forward)

    def last_logits(seqs):
        n = -(-len(seqs) // 8) * 8
        buf = np.zeros((n, width), np.int32)
        for j, s in enumerate(seqs):
            buf[j, : len(s)] = s
        logits = np.asarray(fn(params, jnp.asarray(buf)), dtype)
        return np.stack([logits[j, len(s) - 1] for j, s in enumerate(seqs)])

    return last_logits
