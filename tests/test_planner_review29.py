"""Review 29 of the capacity planning: `resources.plan_num_pages` on a device without
memory stats (the CPU) sizes a sliding-window model's cache by what its sequences can
hold at once under the window, not by their whole length. Scoring guards (no defect
found): a window model's chunked scores equal the dense forward's, and tied logits rank
last, as vLLM's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import model, planner, resources, scoring
from pagedjax.beam_search import BeamSearchParams
from pagedjax.blocks import BlockManager
from pagedjax.config import PRESETS
from pagedjax.engine import LLM
from pagedjax.request import SamplingParams


class _NoStats:
    """A device without memory stats, as the CPU's."""

    def memory_stats(self):
        return None


def _cpu_pages(cfg, page_size, max_num_seqs, max_model_len, budget, watermark=0.01):
    return resources.plan_num_pages(
        cfg,
        page_size,
        kv_memory_fraction=1.0,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        watermark=watermark,
        device=_NoStats(),
    )


@pytest.mark.parametrize("watermark", [0.01, 0.2])
@pytest.mark.parametrize(
    "window, page_size, max_num_seqs, max_model_len, budget",
    [(8, 16, 4, 512, 32), (100, 8, 3, 4096, 64), (1, 4, 2, 256, 16)],
)
def test_cpu_pages_of_a_window_model_are_what_its_sequences_hold(
    watermark, window, page_size, max_num_seqs, max_model_len, budget
):
    """Was max_num_seqs x ceil(max_model_len / page_size) pages whatever the window:
    W = 8 with 32-token chunks, 4 sequences of 512 tokens, took 129 pages where each
    holds at most `window_pages` = 4 (the scheduler's bound; one more for a beam's
    decode reserve): 6x the cache the docstring's cap allows."""
    cfg = dataclasses.replace(PRESETS["tiny"], sliding_window=window)
    n = _cpu_pages(cfg, page_size, max_num_seqs, max_model_len, budget, watermark)
    held = planner.window_pages(window, page_size, budget)
    assert held + 1 < -(-max_model_len // page_size)  # (the window is what bounds them)
    # Every sequence at its peak, a beam group of max_num_seqs beams too (`Scheduler.
    # max_pages_needed`: held_pages(L - 2) + 1 a beam), beside the watermark ...
    need = max_num_seqs * (held + 1)
    assert n - BlockManager(n, page_size, watermark=watermark).watermark_pages >= need
    # ... and not wastefully more.
    smaller = BlockManager(n - 2, page_size, watermark=watermark)
    assert n - 2 - smaller.watermark_pages < need


def test_a_cpu_window_engine_takes_full_length_requests_and_beams():
    """The smaller cache still admits what it did: max_num_seqs requests of
    max_model_len tokens, and a beam search of max_num_seqs beams of that length (the
    scheduler's `add` check; nothing runs)."""
    cfg = dataclasses.replace(PRESETS["tiny"], sliding_window=8)
    kw = dict(max_num_seqs=4, max_model_len=256, page_size=8, max_num_batched_tokens=16)
    llm = LLM(cfg, **kw)
    held = planner.window_pages(8, 8, 16)
    assert llm.cache_config.num_pages == 4 * (held + 1)  # (was 4 x 32 + 1)
    full = SamplingParams(max_tokens=253, ignore_eos=True)
    for i in range(4):
        llm.add_request([5, 6, 7], full, request_id=str(i))
    beams = BeamSearchParams(beam_width=4, max_tokens=253, ignore_eos=True)
    llm.add_request([5, 6, 7], beams.sampling_params(), request_id="beams")


_forward = jax.jit(model.forward)


def _dense_logprobs(params, seq):
    """[len(seq) - 1, V] float64 log-softmax of the dense (causal) forward's logits, the
    sequence right-padded to 24 tokens so that one program serves every length."""
    buf = np.zeros((1, 24), np.int32)
    buf[0, : len(seq)] = seq
    logits = np.asarray(_forward(params, jnp.asarray(buf))[0, : len(seq) - 1], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_a_window_models_chunked_scores_equal_the_dense_forward():
    """W = 5, prefill chunks of 3 tokens through pages of 8 (a chunk smaller than a page
    that divides neither the page nor the lengths): every logprob and rank is the dense
    windowed forward's."""
    params = random_params(dataclasses.replace(PRESETS["tiny"], sliding_window=5), seed=4)
    rng = np.random.default_rng(4)
    seqs = [rng.integers(1, 256, n).tolist() for n in (2, 9, 17, 23)]
    out = scoring.score(params, seqs, page_size=8, prefill_chunk=3, backend="xla")
    for b, seq in enumerate(seqs):
        lp = _dense_logprobs(params, seq)
        want = lp[np.arange(len(seq) - 1), seq[1:]]
        np.testing.assert_allclose(out.logprobs[b], want, atol=2e-5, err_msg=f"{b=}")
        np.testing.assert_array_equal(out.ranks[b], 1 + (lp > want[:, None]).sum(-1))


def test_tied_logits_rank_last():
    """An LM head of zeros: every token equally likely, so each is ranked V (ties ranked
    last, vLLM's count of logprobs >= the token's), log p = -log V, top ids in id order."""
    cfg = PRESETS["tiny"]
    flat = model.params_to_flat(random_params(cfg, seed=5))
    flat["lm_head.kernel"] = np.zeros_like(flat["lm_head.kernel"])
    out = scoring.score(
        model.params_from_flat(cfg, flat), [[3, 4, 5]], top_k=3, page_size=4, backend="xla"
    )
    np.testing.assert_array_equal(out.ranks[0], [cfg.vocab_size] * 2)
    np.testing.assert_allclose(out.logprobs[0], -np.log(cfg.vocab_size), rtol=1e-6)
    np.testing.assert_array_equal(out.top_ids[0], [[0, 1, 2]] * 2)
