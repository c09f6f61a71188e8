"""Smoke tests of scripts/bench_memory.py, bench_prefix.py, bench_decode.py, bench_lora.py and
bench_guided.py.

Each script's `main()` runs on a tiny configuration with --json; the tests check the
keys and that the numbers are sane (fractions in [0, 1], ratios where the design says
they must be), plus the allocator simulators against hand-worked cases.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def memory(monkeypatch):
    return load("bench_memory", monkeypatch)


@pytest.fixture
def workloads(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return load("workloads", monkeypatch)


# ------------------------------------------------------------------ workloads


def test_workloads_are_seeded_and_bounded(workloads):
    for name in workloads.WORKLOADS:
        a = workloads.make_workload(name, 60, seed=3, max_seq_len=512)
        b = workloads.make_workload(name, 60, seed=3, max_seq_len=512)
        c = workloads.make_workload(name, 60, seed=4, max_seq_len=512)
        assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
        assert any(
            len(x.prompt) != len(y.prompt) or not np.array_equal(x.prompt, y.prompt)
            for x, y in zip(a, c, strict=False)
        )
        assert all(r.output_len >= 1 and r.total_len <= 512 for r in a)
        assert [r.rid for r in a] == list(range(len(a)))


def test_chat_turns_extend_their_history(workloads):
    reqs = workloads.make_workload("chat", 200, seed=0, system_prompt_len=64)
    system = reqs[0].prompt[:64]
    assert all(np.array_equal(r.prompt[:64], system) for r in reqs)
    follow = [r for r in reqs if r.parent is not None]
    assert follow, "the chat workload must have multi-turn conversations"
    for r in follow:
        p = reqs[r.parent]
        history = np.concatenate([p.prompt, p.output])
        assert r.conv == p.conv and np.array_equal(r.prompt[: len(history)], history)


def test_bad_workload_name(workloads):
    with pytest.raises(ValueError, match="nope"):
        workloads.make_workload("nope", 10)


# ------------------------------------------------------------------ bench_memory


def _req(workloads, rid, prompt, output, arrival=0):
    return workloads.Request(
        rid, np.arange(3, 3 + prompt, dtype=np.int32), np.full(output, 7, np.int32), arrival
    )


def test_firstfit_holes_merge(memory):
    ff = memory.FirstFit(100)
    w = memory.workloads
    seqs = [memory.Seq(_req(w, i, 10, 10), 10) for i in range(5)]  # 20 slots each
    assert all(ff.admit(s, 0) for s in seqs) and ff.free == 0
    ff.release(seqs[1])
    ff.release(seqs[3])
    assert ff.num_holes() == 2 and ff.free == 40
    big = _req(w, 9, 20, 10)  # 30 slots: fits the total free space, no single hole
    assert ff.fragmented_free(big) == 40 and not ff.admit(memory.Seq(big, 20), 0)
    ff.release(seqs[2])  # merges both neighbours into one 60-slot hole
    assert ff.num_holes() == 1 and ff.fragmented_free(big) == 0
    assert ff.admit(memory.Seq(big, 20), 0) and ff.reserved() == 70


def test_replay_hand_worked(memory):
    """Two requests, one slot of max_seq_len: the second waits for the first."""
    w = memory.workloads
    reqs = [_req(w, 0, 4, 3), _req(w, 1, 2, 2)]
    row = memory.replay(reqs, memory.MaxLen(16, 16), 16)
    # step 0: r0 admitted (4 live), r1 waits; steps 1-3: r0 grows to 7, freed after 3.
    assert row["window"] == "saturated" and row["window_steps"] == 4
    assert row["utilization"] == pytest.approx((4 + 5 + 6 + 7) / (4 * 16))
    assert row["capacity"] == 1.0 and row["steps"] == 4 + 3
    paged = memory.Paged(16, 4, False, watermark=0.0, horizon=0, max_len=16)
    row = memory.replay(reqs, paged, 16)
    # Both fit at once in 4 pages of 4: no step is saturated, the window is busy steps.
    assert row["window"] == "busy" and row["peak_running"] == 2 and row["steps"] == 4
    live = [4 + 2, 5 + 3, 6 + 4, 7]  # r1 (2 + 2 tokens) is freed after step 2
    reserved = [4 + 4, 8 + 4, 8 + 4, 8]  # pages of 4 slots
    assert row["utilization"] == pytest.approx(sum(live) / sum(reserved))
    assert row["preemptions"] == 0 and row["stalls"] == 0


def test_paged_prefix_sharing_counts_pages_once(memory):
    w = memory.workloads
    shared = np.arange(3, 35, dtype=np.int32)  # two full pages of 16
    reqs = [
        w.Request(i, np.concatenate([shared, [100 + i]]).astype(np.int32), np.full(2, 7), 0)
        for i in range(3)
    ]
    on = memory.replay(
        reqs, memory.Paged(64 * 16, 16, True, watermark=0, horizon=0, max_len=64), 1024
    )
    off = memory.replay(
        reqs, memory.Paged(64 * 16, 16, False, watermark=0, horizon=0, max_len=64), 1024
    )
    assert on["prefix_hit_rate"] == pytest.approx(2 * 32 / (3 * 33))
    assert on["tokens_per_live_slot"] > 2.0 and off["tokens_per_live_slot"] == 1.0
    assert 0 < on["utilization"] <= 1 and 0 < off["utilization"] <= 1


@contextlib.contextmanager
def _deadline(seconds: int):
    """Turns a hang into a failure (the replays below once looped forever)."""

    def fail(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_replay_stops_on_a_request_that_cannot_run_even_alone(memory, capsys):
    w = memory.workloads
    # A growth reserve larger than the pool: the request is never admitted.
    paged = memory.Paged(16, 4, False, watermark=0.0, horizon=100, max_len=16)
    with _deadline(20), pytest.raises(memory.Unservable, match="cannot admit request 0"):
        memory.replay([_req(w, 0, 4, 3)], paged, 16)
    # 15 slots make 3 pages of 4: 12 of the request's 16 tokens; it restarted forever.
    paged = memory.Paged(15, 4, False, watermark=0.0, horizon=0, max_len=16)
    with _deadline(20), pytest.raises(memory.Unservable, match=r"request 0 \(16 tokens\)"):
        memory.replay([_req(w, 0, 4, 12)], paged, 15)
    argv = ["--workload", "sharegpt", "--requests", "2", "--budget-tokens", "2048"]
    argv += ["--max-seq-len", "256", "--page-sizes", "16", "--no-plots", "--horizon", "100000"]
    with _deadline(60):
        assert memory.main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()[-1]
    assert err.startswith("bench_memory.py: error: paged-16 cannot admit request"), err


def test_main_json(memory, capsys, tmp_path):
    argv = ["--requests", "300", "--budget-tokens", "16384", "--max-seq-len", "512"]
    argv += ["--page-sizes", "1,16,64", "--json", "--plot-dir", str(tmp_path)]
    assert memory.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "paged16_utilization",
        "contiguous_maxlen_utilization",
        "capacity_ratio_paged16_vs_contiguous",
        "chat_capacity_ratio_prefix_vs_no_prefix",
    ):
        assert np.isfinite(out[key]), key
    assert 0.9 < out["paged16_utilization"] <= 1.0
    assert 0 < out["contiguous_maxlen_utilization"] < out["paged16_utilization"]
    assert out["capacity_ratio_paged16_vs_contiguous"] > 1.0
    for name, res in out["workloads"].items():
        rows = {r["policy"]: r for r in res["policies"]}
        assert set(rows) >= {"contiguous-maxlen", "contiguous-firstfit", "paged-1+prefix"}
        for r in rows.values():
            for k in ("utilization", "internal_waste", "external_waste", "free"):
                assert 0.0 <= r[k] <= 1.0 + 1e-12, (name, r["policy"], k, r[k])
            assert 0 < r["capacity"] <= r["resident"] + 1e-9 <= r["peak_running"] + 1e-9
        assert rows["paged-1"]["utilization"] == pytest.approx(1.0)
        assert rows["contiguous-maxlen"]["capacity"] == 512 // 16  # budget / max_seq_len
        assert rows["contiguous-maxlen"]["external_waste"] == 0.0
        assert rows["paged-16"]["external_waste"] == 0.0
        shares = rows["paged-16+prefix"]["tokens_per_live_slot"]
        if name == "chat":
            assert rows["paged-16+prefix"]["prefix_hit_rate"] > 0.3 and shares > 1.2
        else:
            assert rows["paged-16+prefix"]["prefix_hit_rate"] < 0.05 and shares < 1.05
    if out["plots"]:
        assert all(Path(p).is_file() and Path(p).parent == tmp_path for p in out["plots"])


def test_main_table_without_matplotlib(memory, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    argv = ["--workload", "sharegpt", "--requests", "30", "--budget-tokens", "2048"]
    argv += ["--max-seq-len", "256", "--page-sizes", "16", "--plot-dir", str(tmp_path)]
    assert memory.main(argv) == 0
    captured = capsys.readouterr()
    assert "paged16_utilization" in captured.out and "contiguous-firstfit" in captured.out
    assert "skipping plots" in captured.err and not list(tmp_path.iterdir())


def _usage_error(parse_args, argv, capsys) -> str:
    """Runs a parser expected to reject argv; returns its one-line error."""
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_arguments(memory, capsys):
    # the headline needs 16
    err = _usage_error(memory.parse_args, ["--page-sizes", "8,32"], capsys)
    assert "--page-sizes must include 16" in err and "[8, 32]" in err, err
    err = _usage_error(memory.parse_args, ["--budget-tokens", "100"], capsys)
    assert "--budget-tokens 100 < --max-seq-len" in err, err


# ------------------------------------------------------------------ bench_prefix


@pytest.fixture
def prefix(monkeypatch):
    return load("bench_prefix", monkeypatch)


def test_prefix_main_json(prefix, capsys, tmp_path):
    argv = ["--plot-dir", str(tmp_path), "--system-tokens", "32", "--message-tokens", "8"]
    argv += ["--reps", "1", "--num-pages", "64", "--max-num-batched-tokens", "64"]
    argv += ["--max-model-len", "256", "--chat-conversations", "2", "--chat-reply-median", "2"]
    argv += ["--chat-max-turns", "2", "--json"]  # seed 0: 2 conversations, 3 requests
    assert prefix.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert np.isfinite(out["ttft_warm_over_cold"]) and out["ttft_warm_over_cold"] > 0
    assert out["hits_as_expected"] is True
    assert out["cold_cached_tokens"] == [0] and out["warm_cached_tokens"] == [32]
    assert out["compiles_during_timing"] == 0
    assert out["ttft_cold_median_s"] > 0 and out["ttft_warm_median_s"] > 0
    # Every request after the first shares at least the 32-token system prompt.
    assert 0.1 < out["chat_hit_rate"] <= out["chat_hit_rate_bound"] + 1e-9 <= 1.0
    assert out["chat_requests"] > out["chat_conversations"] == 2  # some are multi-turn
    assert out["environment"]["jax"]
    assert all(Path(p).is_file() for p in out["plots"])


def test_prefix_chat_that_does_not_fit_ends_before_timing(prefix, monkeypatch, tmp_path):
    """A context no chat conversation fits ended the run after the TTFT runs, their
    figures lost; the chat's requests are built first now."""

    def measure_ttft(llm, args):
        raise AssertionError("the TTFT was measured for a run that ends")

    monkeypatch.setattr(prefix, "measure_ttft", measure_ttft)
    argv = ["--no-plots", "--system-tokens", "250", "--message-tokens", "4", "--reps", "1"]
    argv += ["--num-pages", "64", "--max-num-batched-tokens", "256", "--max-model-len", "256"]
    argv += ["--chat-conversations", "2", "--chat-max-turns", "1"]
    with pytest.raises(SystemExit, match="no chat conversation fits a context of 256"):
        prefix.main(argv)


def test_prefix_bad_arguments(prefix, capsys):
    argv = ["--system-tokens", "3000", "--max-num-batched-tokens", "1024"]
    err = _usage_error(prefix.parse_args, argv, capsys)
    assert "--max-num-batched-tokens 1024 must hold the whole cold prompt" in err, err
    err = _usage_error(prefix.parse_args, ["--reps", "0"], capsys)
    assert "--reps must be >= 1, got 0" in err, err
    err = _usage_error(prefix.parse_args, ["--sliding-window", "-1"], capsys)
    assert "--sliding-window must be >= 0, got -1" in err, err
    err = _usage_error(prefix.parse_args, ["--model", "demo", "--sliding-window", "8"], capsys)
    assert "--sliding-window takes a preset's --model, not demo" in err, err
    # A window bounds the pages a sequence holds: 64 pages of 16 hold no 2,048-token chat
    # turn, but a window of 64 (budget 600) needs at most 43 of them at once.
    argv = ["--system-tokens", "512", "--max-num-batched-tokens", "600", "--num-pages", "64"]
    argv += ["--max-model-len", "2048"]
    err = _usage_error(prefix.parse_args, argv, capsys)
    assert "it needs 128" in err, err
    assert prefix.parse_args([*argv, "--sliding-window", "64", "--no-plots"]).sliding_window == 64


# ------------------------------------------------------------------ bench_decode


@pytest.fixture
def decode_bench(monkeypatch):
    return load("bench_decode", monkeypatch)


def test_decode_main_json(decode_bench, capsys, tmp_path):
    argv = ["--kv-budget-tokens", "32", "--max-seq-len", "32", "--prompt-len", "8"]
    argv += ["--gen-len", "8", "--page-size", "8", "--reps", "1", "--json"]
    argv += ["--plot-dir", str(tmp_path)]
    assert decode_bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_batch_contiguous"] == 32 // 32
    assert out["max_batch_paged"] == 4 // 2  # 4 pages of 8, 2 pages per sequence
    assert out["max_batch_ratio"] == 2.0
    rows = {r["batch"]: r for r in out["rows"]}
    assert sorted(rows) == [1, 2]
    for b, r in rows.items():
        assert r["paged_tokens_per_s"] > 0 and r["paged_preemptions"] == 0
        assert r["compiles_during_timing"] == 0
        assert r["contiguous_fits"] == (b == 1) and r["contiguous_batch"] == 1
        assert r["contiguous_tokens_per_s"] > 0 and r["paged_over_contiguous"] > 0
    assert rows[1]["tokens_match"] > 0.9  # the two systems compute the same greedy tokens
    assert "tokens_match" not in rows[2]  # batch 2 does not fit the contiguous cache
    assert out["throughput_at_max_batch_ratio"] == rows[2]["paged_over_contiguous"]
    if out["plots"]:
        assert Path(out["plots"][0]).is_file()


def test_decode_rate_without_two_whole_batch_steps_is_null(decode_bench):
    """It was NaN (with a RuntimeWarning), which --json printed as `NaN`: not JSON."""
    runners = {
        "paged": lambda: (1.0, [], {"preemptions": 0}),  # no two whole-batch decode steps
        "contiguous": lambda: (2.0, [0.5, 0.5], {}),
    }
    m = decode_bench.measure(runners, {"paged": 2, "contiguous": 2}, gen_len=3, reps=2)
    assert m["paged"]["tokens_per_s"] is None and m["contiguous"]["tokens_per_s"] == 4.0
    assert m["paged"]["e2e_tokens_per_s"] == 2 * 3 / 1.0
    assert decode_bench._ratio(m["paged"]["tokens_per_s"], 4.0) is None
    json.dumps(m, allow_nan=False)


@pytest.mark.slow  # test_decode_main_json already compares the baseline with the engine
def test_contiguous_baseline_matches_dense_forward(decode_bench):
    """The baseline's greedy tokens are the argmax of the dense no-cache forward."""
    import jax.numpy as jnp

    from pagedjax import model as model_lib
    from pagedjax.config import preset

    cfg = preset("tiny")
    params = model_lib.init_params(cfg, 1)
    base = decode_bench.Contiguous(params, 32)
    prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 5), dtype=np.int32)
    toks = base.generate(prompts, 4)
    seq = np.concatenate([prompts, toks], axis=1)  # teacher-forced: one dense forward
    logits = model_lib.forward(params, jnp.asarray(seq))  # [B, T, V]
    np.testing.assert_array_equal(toks, np.asarray(jnp.argmax(logits[:, 4:8], -1)))


def test_guided_main_json_and_table(monkeypatch, capsys):
    """scripts/bench_guided.py on a small vocabulary: every spec measured, fresh masks
    slower than cached ones, and the engine ratio in (0, 1.5]."""
    guided = load("bench_guided", monkeypatch)
    argv = ["--vocab", "3000", "--walks", "2", "--requests", "4", "--repeats", "1"]
    res = guided.main([*argv, "--json"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(res))
    for name in guided.SPECS:
        r = res["masks"][name]
        assert r["dfa_states"] > 1 and r["states_measured"] >= 1
        assert r["fresh_mask_ms"] > 0 and r["cached_mask_us"] > 0
    assert 0 < res["engine"]["guided_over_unguided"] <= 1.5
    guided.main([*argv, "--no-engine"])
    out = capsys.readouterr().out
    assert "json_object" in out and "engine" not in out


# ------------------------------------------------------------------ bench_lora


def test_lora_main_json(monkeypatch, capsys):
    bench = load("bench_lora", monkeypatch)
    argv = ["--batch", "1", "3", "--prompt-len", "5", "--gen-len", "4", "--reps", "1"]
    assert bench.main([*argv, "--max-loras", "2", "--lora-rank", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["max_loras"], out["lora_rank"]) == (2, 4)
    assert [r["batch"] for r in out["rows"]] == [1, 3]
    for r in out["rows"]:
        assert r["compiles_during_timing"] == 0
        assert r["idle_tokens_match"] == 1.0  # no adapter: exactly the base model's tokens
        for k in ("base", "idle", "mixed"):
            assert r[f"{k}_e2e_tokens_per_s"] > 0
        assert r["e2e_mixed_over_base"] > 0 and r["e2e_idle_over_base"] > 0
