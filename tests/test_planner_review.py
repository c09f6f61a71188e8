"""The step reserve (`planner.step_peak_bytes`) against XLA's own buffer assignment of
the engine's real step, compiled on the CPU (`memory_analysis()`, through
scripts/bench_step_memory.py)."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pagedjax import config, planner

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
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_step_memory.py"


@pytest.fixture
def bench(monkeypatch):
    """scripts/bench_step_memory.py, which compiles the engine's real step."""
    spec = importlib.util.spec_from_file_location("bench_step_memory_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _step_bytes(bench, cfg=CFG, **case):
    """XLA:CPU's temporary and output bytes (but the cache's) of the step of
    `bench.Case(**case)`, and its (T, B)."""
    with bench.stubbed_attention():
        try:
            return bench.step_bytes(cfg, bench.Case("test", **case))
        except RuntimeError as e:  # (a backend without buffer statistics)
            pytest.skip(str(e))


def _temp_bytes(bench, cfg=CFG, **case):
    """XLA:CPU's temporary bytes of the step of `bench.Case(**case)`, and its (T, B)."""
    temp, _, t, b = _step_bytes(bench, cfg, **case)
    return temp, t, b


def _scoring_bytes(cfg, t):
    """The estimate's term for a prompt-logprobs step's scoring of `t` tokens."""
    return planner.SCORE_ROW_COPIES * min(t, planner.SCORE_ROWS) * cfg.vocab_size * 4


@pytest.mark.parametrize("max_loras, rank", [(2, 8), (4, 64)])
def test_the_reserve_counts_a_lora_steps_updates(bench, max_loras, rank):
    # A step with adapters holds each projection's update ([T, F] float32 in the MLP) and
    # the slots' mask beside the base step's buffers: XLA:CPU's temporaries were 1.2x the
    # estimate without them, which has no LoRA term.
    temp, t, b = _temp_bytes(bench, seq_len=32, num_seqs=8, max_loras=max_loras, rank=rank)
    assert (t, b) == (256, 8)
    # (the gap the LoRA term closes; this step scores no prompt logprobs)
    assert temp > planner.step_peak_bytes(CFG, t, b) - _scoring_bytes(CFG, t)
    assert temp <= planner.step_peak_bytes(CFG, t, b, lora_columns=max_loras * rank)


@pytest.mark.parametrize("seq_len, top_k", [(64, 0), (64, 5), (1024, 20)])
def test_the_reserve_counts_a_prompt_logprobs_steps_scoring(bench, seq_len, top_k):
    # A prompt-logprobs step scores every token through the LM head. It held its [T, V]
    # float32 logits and their log-softmax at once: 8.4x the estimate at T = 512 and
    # 16x at T = 8192 (this vocabulary), with no term for them. It scores
    # `planner.SCORE_ROWS` rows at a time now, which the estimate counts.
    cfg = dataclasses.replace(CFG, vocab_size=32000)
    temp, t, b = _temp_bytes(bench, cfg, seq_len=seq_len, num_seqs=8, top_k=top_k)
    assert (t, b) == (8 * seq_len, 8)
    assert temp <= planner.step_peak_bytes(cfg, t, b)
    plain, *_ = _temp_bytes(bench, cfg, seq_len=seq_len, num_seqs=8)
    scoring = temp - plain  # (XLA may reuse the body's buffers for the scoring's)
    assert scoring <= _scoring_bytes(cfg, t)


def test_the_reserve_counts_the_top_logprobs_a_step_returns():
    # 8 bytes (an int32 id, a float32 logprob) per column per token and row, and once more
    # for a scoring chunk's and the rows' while they are computed.
    base = planner.step_peak_bytes(CFG, 1000, 16)
    got = planner.step_peak_bytes(CFG, 1000, 16, logprob_columns=32)
    assert got - base == 8 * 32 * (1000 + planner.SCORE_ROWS + 2 * 16)
    assert planner.logprob_columns(20, 32000) == 32  # padded as a step pads it
    assert planner.logprob_columns(0, 32000) == planner.LOGPROB_COLUMNS_FLOOR
    assert planner.logprob_columns(-1, 32000) == planner.logprob_columns(20_000, 32000) == 32000
    with pytest.raises(ValueError, match="max_logprobs >= -1"):
        planner.logprob_columns(-2, 32000)
    with pytest.raises(ValueError, match="logprob_columns must be >= 0"):
        planner.step_peak_bytes(CFG, 8, 8, logprob_columns=-1)


def test_the_reserve_counts_a_whole_vocabulary_of_prompt_logprobs(bench):
    # `max_logprobs=-1` lets a request ask for every token's logprob at every prompt
    # position: the step returns [T, V] ids and logprobs and keeps a chunk's while
    # scoring, none of it counted before (2.3x the estimate without them, here).
    cfg = dataclasses.replace(CFG, vocab_size=32000)
    temp, outputs, t, b = _step_bytes(bench, cfg, seq_len=64, num_seqs=8, top_k=-1)
    assert (t, b) == (512, 8) and outputs >= 8 * t * cfg.vocab_size
    assert temp + outputs > 2 * planner.step_peak_bytes(cfg, t, b)
    columns = planner.logprob_columns(-1, cfg.vocab_size)
    assert temp + outputs <= planner.step_peak_bytes(cfg, t, b, logprob_columns=columns)


def test_the_benchmark_script_prints_every_case_under_its_estimate(bench, capsys, monkeypatch):
    """`python scripts/bench_step_memory.py --preset tiny --json`: a row per case the
    preset's positions allow, each under the estimate; the same rows as a table."""
    assert bench.main(["--preset", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "tiny" and out["dtype"] == "float32"
    assert [r["case"] for r in out["rows"]] == [
        c.name for c in bench.CASES if c.seq_len <= config.PRESETS["tiny"].max_position_embeddings
    ]
    for r in out["rows"]:
        assert 0 < r["xla_temp_bytes"] + r["xla_output_bytes"] <= r["estimate_bytes"], r
    monkeypatch.setattr(bench, "measure", lambda cfg: out["rows"])  # (compiled above)
    assert bench.main(["--preset", "tiny"]) == 0
    table = capsys.readouterr().out
    assert "estimate MiB" in table and all(r["case"] in table for r in out["rows"])


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


def test_an_engine_sizes_its_reserve_by_its_max_logprobs(monkeypatch):
    """`LLM(max_logprobs=)` passes the top-k columns it allows to `plan_num_pages`: the
    default's 32, the whole vocabulary with -1."""
    from engine_helpers import GEOMETRY, random_params

    from pagedjax import engine, resources

    seen = {}
    real = resources.plan_num_pages

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "plan_num_pages", spy)
    geometry = {k: v for k, v in GEOMETRY.items() if k != "num_pages"}
    llm = engine.LLM(random_params(), **geometry)
    assert seen["logprob_columns"] == 32
    engine.LLM(random_params(), max_logprobs=-1, **geometry)
    assert seen["logprob_columns"] == llm.config.vocab_size
