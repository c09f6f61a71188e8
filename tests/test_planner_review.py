"""The step reserve (`planner.step_peak_bytes`) against XLA's own buffer assignment of
the engine's real step, compiled on the CPU (`memory_analysis()`)."""

import dataclasses
import types
from functools import partial

import jax
import pytest
from flax import nnx

from pagedjax import cache as cache_lib
from pagedjax import config, decode, lora, model, planner
from pagedjax.step_input import Buckets

CFG = config.ModelConfig(
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    hidden_size=256,
    intermediate_size=1024,
    vocab_size=512,
    dtype="float32",  # (XLA:CPU upcasts bfloat16 weights to float32 copies: not a GPU's)
)


def _stub_attention(q, k_pages, v_pages, *args, **kwargs):
    """The kernel's place: its scratch is on chip, and the estimate leaves it out."""
    return q + (k_pages[0, 0, 0] * 0 + v_pages[0, 0, 0] * 0).astype(q.dtype)


def _temp_bytes(monkeypatch, *, max_loras=0, rank=0, cfg=CFG, seq_len=32, top_k=None):
    """XLA:CPU's temporary bytes of a prefill step of 8 sequences of `seq_len` tokens
    whose tokens use LoRA slots 1..max_loras (0: no LoRA), and the step's padded (T, B).
    `top_k`: the step scores every token's target (prompt logprobs) with its `top_k`
    most likely tokens (None: no prompt logprobs)."""
    stub = types.SimpleNamespace(
        paged_decode_attention=_stub_attention, ragged_paged_attention=_stub_attention
    )
    monkeypatch.setattr(model, "pallas_kernels", stub)
    chunks, nxt, n = [], 1, -(-seq_len // 16)
    for i in range(8):  # `seq_len` tokens, n pages of 16, each
        slot = 1 + i % max_loras if max_loras else 0
        tokens = [3 + j % 7 for j in range(seq_len)]
        chunks.append(decode.SeqChunk(tokens, 0, list(range(nxt, nxt + n)), lora_slot=slot))
        nxt += n
    cc = config.CacheConfig(page_size=16, num_pages=nxt, dtype=cfg.dtype)
    inp = decode.build_step_input(chunks, cfg, cc, buckets=Buckets(min_pages=1))
    if top_k is not None:
        inp = dataclasses.replace(inp, target_ids=jax.numpy.zeros_like(inp.token_ids))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.Llama(cfg, rngs=nnx.Rngs(0))))
    params = model.Params(graphdef=graphdef, state=state, config=cfg)
    cache = jax.eval_shape(lambda: cache_lib.create(cfg, cc))
    weights = None
    if max_loras:
        weights = jax.eval_shape(lambda: lora.create_lora_weights(cfg, max_loras, rank))
    # A jit of its own: the engine's `_prefill_jit` must not cache the stubbed trace.
    step = jax.jit(
        partial(decode._step, decode=False), static_argnames=decode._STATIC, donate_argnames="cache"
    )
    stats = (
        step.trace(
            params,
            cache,
            inp,
            weights,
            backend="xla",
            interpret=False,
            num_top_logprobs=0,
            num_prompt_top_logprobs=top_k or 0,
            return_logits=False,
        )  # fmt: skip
        .lower()
        .compile()
        .memory_analysis()
    )
    if stats is None:
        pytest.skip("no memory_analysis() on this backend")
    return stats.temp_size_in_bytes, inp.token_ids.shape[0], inp.logits_indices.shape[0]


def _scoring_bytes(cfg, t):
    """The estimate's term for a prompt-logprobs step's scoring of `t` tokens."""
    return planner.SCORE_ROW_COPIES * min(t, planner.SCORE_ROWS) * cfg.vocab_size * 4


@pytest.mark.parametrize("max_loras, rank", [(2, 8), (4, 64)])
def test_the_reserve_counts_a_lora_steps_updates(monkeypatch, max_loras, rank):
    # A step with adapters holds each projection's update ([T, F] float32 in the MLP) and
    # the slots' mask beside the base step's buffers: XLA:CPU's temporaries were 1.2x the
    # estimate without them, which has no LoRA term.
    temp, t, b = _temp_bytes(monkeypatch, max_loras=max_loras, rank=rank)
    assert (t, b) == (256, 8)
    # (the gap the LoRA term closes; this step scores no prompt logprobs)
    assert temp > planner.step_peak_bytes(CFG, t, b) - _scoring_bytes(CFG, t)
    assert temp <= planner.step_peak_bytes(CFG, t, b, lora_columns=max_loras * rank)


@pytest.mark.parametrize("seq_len, top_k", [(64, 0), (64, 5), (1024, 20)])
def test_the_reserve_counts_a_prompt_logprobs_steps_scoring(monkeypatch, seq_len, top_k):
    # A prompt-logprobs step scores every token through the LM head. It held its [T, V]
    # float32 logits and their log-softmax at once: 8.4x the estimate at T = 512 and
    # 16x at T = 8192 (this vocabulary), with no term for them. It scores
    # `planner.SCORE_ROWS` rows at a time now, which the estimate counts.
    cfg = dataclasses.replace(CFG, vocab_size=32000)
    temp, t, b = _temp_bytes(monkeypatch, cfg=cfg, seq_len=seq_len, top_k=top_k)
    assert (t, b) == (8 * seq_len, 8)
    assert temp <= planner.step_peak_bytes(cfg, t, b)
    plain, *_ = _temp_bytes(monkeypatch, cfg=cfg, seq_len=seq_len)
    scoring = temp - plain  # (XLA may reuse the body's buffers for the scoring's)
    assert scoring <= _scoring_bytes(cfg, t)


def test_lora_columns_hand_computed():
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    base = planner.step_peak_bytes(cfg, 16, 8)
    # MLP phase: (4 + 2) bytes x F for one update, float32 then bfloat16; 8 x columns for
    # the mask and x @ a, float32.
    assert planner.step_peak_bytes(cfg, 16, 8, lora_columns=32) == base + 16 * (6 * 1024 + 8 * 32)
    assert planner.step_peak_bytes(cfg, 16, 8, lora_columns=0) == base
    with pytest.raises(ValueError, match="lora_columns=-1"):
        planner.step_peak_bytes(cfg, 16, 8, lora_columns=-1)
    with pytest.raises(TypeError, match="lora_columns=1.5"):
        planner.step_peak_bytes(cfg, 16, 8, lora_columns=1.5)


class _Device:
    """A device with memory stats: its bytes in use are read when the cache is sized."""

    def __init__(self, limit, in_use):
        self.limit, self.in_use = limit, in_use

    def memory_stats(self):
        return dict(bytes_limit=self.limit, bytes_in_use=self.in_use())


def test_an_engine_with_lora_sizes_its_cache_with_the_slots_in_place(monkeypatch):
    """`LLM(enable_lora=True)` counts the slots' per-token updates in the step reserve
    (`lora_columns`) and creates the slots' weights before sizing the cache, so that the
    device's bytes in use include them: they were created after, out of the slack."""
    from engine_helpers import GEOMETRY, random_params

    from pagedjax import engine, resources, sharding

    seen = {}
    real = resources.plan_num_pages

    def spy(*args, **kwargs):
        seen.update(kwargs, slots=getattr(llm_box.get("self"), "lora", None))
        return real(*args, **kwargs)

    llm_box = {}
    init = engine.LLM._init_lora

    def init_lora(self, *args):
        llm_box["self"] = self
        return init(self, *args)

    monkeypatch.setattr(engine.LLM, "_init_lora", init_lora)
    monkeypatch.setattr(engine, "plan_num_pages", spy)
    geometry = {k: v for k, v in GEOMETRY.items() if k != "num_pages"}
    args = dict(geometry, enable_lora=True, max_loras=3, max_lora_rank=8)
    llm = engine.LLM(random_params(), **args)
    assert seen["lora_columns"] == 24
    assert seen["slots"] is llm.lora and seen["slots"].weights is not None
    llm = engine.LLM(random_params(), **geometry)
    assert seen["lora_columns"] == 0 and seen["slots"] is None

    # Sizing from device stats: the reserve with the LoRA term is larger, so fewer pages.
    cfg = llm.config
    per_page = 8 * planner.kv_bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    )
    dev = _Device(10**9, lambda: 0)
    monkeypatch.setattr(sharding, "default_device", lambda: dev)
    kw = dict(kv_memory_fraction=1.0, max_num_seqs=8, max_model_len=64)
    kw.update(max_num_batched_tokens=8192)
    plain = real(cfg, 8, **kw)
    with_lora = real(cfg, 8, lora_columns=512, **kw)
    extra = resources.step_reserve_bytes(
        cfg, max_num_batched_tokens=8192, max_num_seqs=8, lora_columns=512
    ) - resources.step_reserve_bytes(cfg, max_num_batched_tokens=8192, max_num_seqs=8)
    assert extra > 0 and plain - with_lora == pytest.approx(extra / per_page, abs=1)
