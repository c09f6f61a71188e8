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


def _temp_bytes(monkeypatch, *, max_loras, rank):
    """XLA:CPU's temporary bytes of a prefill step of 256 tokens in 8 sequences whose
    tokens use LoRA slots 1..max_loras, and the step's padded (T, B)."""
    stub = types.SimpleNamespace(
        paged_decode_attention=_stub_attention, ragged_paged_attention=_stub_attention
    )
    monkeypatch.setattr(model, "pallas_kernels", stub)
    chunks, nxt = [], 1
    for i in range(8):  # 32 tokens, 2 pages of 16, each
        pages = list(range(nxt, nxt + 2))
        chunks.append(decode.SeqChunk(list(range(3, 35)), 0, pages, lora_slot=1 + i % max_loras))
        nxt += 2
    cc = config.CacheConfig(page_size=16, num_pages=nxt, dtype=CFG.dtype)
    inp = decode.build_step_input(chunks, CFG, cc, buckets=Buckets(min_pages=1))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.Llama(CFG, rngs=nnx.Rngs(0))))
    params = model.Params(graphdef=graphdef, state=state, config=CFG)
    cache = jax.eval_shape(lambda: cache_lib.create(CFG, cc))
    weights = jax.eval_shape(lambda: lora.create_lora_weights(CFG, max_loras, rank))
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
            return_logits=False,
        )  # fmt: skip
        .lower()
        .compile()
        .memory_analysis()
    )
    if stats is None:
        pytest.skip("no memory_analysis() on this backend")
    return stats.temp_size_in_bytes, inp.token_ids.shape[0], inp.logits_indices.shape[0]


@pytest.mark.parametrize("max_loras, rank", [(2, 8), (4, 64)])
def test_the_reserve_counts_a_lora_steps_updates(monkeypatch, max_loras, rank):
    # A step with adapters holds each projection's update ([T, F] float32 in the MLP) and
    # the slots' mask beside the base step's buffers: XLA:CPU's temporaries were 1.2x the
    # estimate without them, which has no LoRA term.
    temp, t, b = _temp_bytes(monkeypatch, max_loras=max_loras, rank=rank)
    assert (t, b) == (256, 8)
    assert temp > planner.step_peak_bytes(CFG, t, b)  # (the gap the LoRA term closes)
    assert temp <= planner.step_peak_bytes(CFG, t, b, lora_columns=max_loras * rank)


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
