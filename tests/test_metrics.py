"""pagedjax.metrics: the run summary from random step records, against a hand computation."""

import math

import numpy as np
import pytest

from pagedjax.metrics import SUMMARY_KEYS, EngineMetrics, StepRecord, percentile


def summarize(m: EngineMetrics) -> dict:
    return m.summary(
        kv_pages_total=64, prefix_cache_hit_rate=0.25, preemptions=3, peak_device_memory_bytes=None
    )


def interpolated(values, q):
    """The q-th percentile by linear interpolation between closest ranks (numpy's default)."""
    v = sorted(values)
    x = q / 100 * (len(v) - 1)
    lo = math.floor(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (x - lo) * (v[hi] - v[lo])


@pytest.mark.parametrize("seed", range(4))
def test_summary_equals_a_hand_computation(seed):
    rng = np.random.default_rng(seed)
    m = EngineMetrics(kv_bytes_per_token=int(rng.integers(1, 5000)))
    n = int(rng.integers(5, 40))
    t = 100.0 * rng.random()
    last_ready = 0.0
    want_dev = dict(pre_s=0.0, pre_n=0, dec_s=0.0, dec_n=0, all_s=0.0)
    compile_s, compiles, ctx, used = 0.0, 0, 0, []
    for _ in range(n):
        pre = int(rng.integers(0, 50)) * int(rng.random() < 0.4)
        dec = int(rng.integers(0, 9)) if pre else int(rng.integers(1, 9))
        compiled = bool(rng.random() < 0.2)
        rec = StepRecord(
            num_rows=dec + (pre > 0),
            num_prefill_tokens=pre,
            num_decode_tokens=dec,
            decode=not pre,
            context_tokens=int(rng.integers(1, 500)),
            kv_used_pages=int(rng.integers(0, 64)),
            compiled=compiled,
            host_hidden_s=float(rng.random()),
            wait_s=float(rng.random()),
            host_exposed_s=float(rng.random()),
            dispatch_s=float(rng.random()),
            dispatched_at=t,
            num_compilations=int(rng.integers(1, 3)) if compiled else 0,
        )
        m.record(rec, rec.num_compilations)
        ctx += rec.context_tokens
        used.append(rec.kv_used_pages)
        if compiled:
            compile_s += rec.dispatch_s
            compiles += rec.num_compilations
        ready = t + float(rng.random()) * (2 if rng.random() < 0.5 else 0.1)
        ready = max(ready, last_ready + 1e-3)
        m.complete(rec, ready)
        dev = ready - max(t, last_ready)
        assert rec.device_s == pytest.approx(dev)
        want_dev["all_s"] += dev
        if pre:
            want_dev["pre_s"] += dev
            want_dev["pre_n"] += pre
        else:
            want_dev["dec_s"] += dev
            want_dev["dec_n"] += dec
        last_ready = ready
        t += float(rng.random())  # the next dispatch: before or after these tokens arrive
    ttfts = rng.random(int(rng.integers(1, 30))).tolist()
    lat = [x + float(rng.random()) for x in ttfts]
    for a, b in zip(ttfts, lat, strict=True):
        m.record_request(int(rng.integers(1, 100)), a, b)
    m.generated_tokens = int(rng.integers(1, 10_000))
    m.run_time_s = compile_s + 1.0 + 10 * float(rng.random())

    s = summarize(m)
    assert tuple(s) == SUMMARY_KEYS
    host_steps = [r for r in m.steps if not r.compiled]
    assert s["compile_time_s"] == pytest.approx(compile_s)
    assert s["num_compilations"] == compiles and s["num_steps"] == n
    assert s["device_time_s"] == pytest.approx(want_dev["all_s"])
    rate = lambda k, t: None if want_dev[t] == 0 else want_dev[k] / want_dev[t]  # noqa: E731
    assert s["prefill_tokens_per_s"] == pytest.approx(rate("pre_n", "pre_s"))
    assert s["decode_tokens_per_s"] == pytest.approx(rate("dec_n", "dec_s"))
    want_out = m.generated_tokens / (m.run_time_s - compile_s)
    assert s["output_tokens_per_s"] == pytest.approx(want_out)
    assert s["kv_bytes_read"] == ctx * m.kv_bytes_per_token
    assert s["kv_bytes_read_per_s"] == pytest.approx(ctx * m.kv_bytes_per_token / want_dev["all_s"])
    assert s["kv_pages_used"] == max(used) and s["kv_utilization"] == max(used) / 64
    assert s["ttft_mean_s"] == pytest.approx(sum(ttfts) / len(ttfts))
    assert s["ttft_p50_s"] == pytest.approx(interpolated(ttfts, 50))
    assert s["ttft_p99_s"] == pytest.approx(interpolated(ttfts, 99))
    assert s["latency_mean_s"] == pytest.approx(sum(lat) / len(lat))
    assert s["num_requests"] == len(lat)
    k = len(host_steps)
    for key, field in (
        ("host_hidden_ms_per_step", "host_hidden_s"),
        ("host_exposed_ms_per_step", "host_exposed_s"),
        ("device_wait_ms_per_step", "wait_s"),
    ):
        want = 1e3 * sum(getattr(r, field) for r in host_steps) / k if k else None
        assert s[key] == pytest.approx(want)


def test_percentile():
    rng = np.random.default_rng(0)
    v = rng.random(17).tolist()
    for q in (0, 13, 50, 99, 100):
        assert percentile(v, q) == pytest.approx(interpolated(v, q))
    assert percentile([], 50) is None


@pytest.mark.parametrize("run_time_s", [0.0, 0.5])
def test_no_output_rate_without_a_measured_run_time(run_time_s):
    # No run time measured, or less than the compile time (the engine counts both over
    # the same step() and generate() calls, so this is a guard; before LLM.step() counted
    # its time, step() loops left run_time_s at 0). Generated tokens over
    # max(run - compile, 1e-9) s reported 4e9 tokens/s.
    rng = np.random.default_rng(1)
    m = EngineMetrics(kv_bytes_per_token=64)
    rec = StepRecord(1, 7, 0, False, 7, 1, True, 0.0, 0.0, 0.0, 1.0 + float(rng.random()), 1.0)
    m.record(rec, 1)
    m.complete(rec, 2.5)
    m.generated_tokens = int(rng.integers(1, 100))
    m.run_time_s = run_time_s
    s = summarize(m)
    assert s["output_tokens_per_s"] is None, s["output_tokens_per_s"]
    assert s["prefill_tokens_per_s"] == pytest.approx(7 / 1.5)  # measured on the device


def test_empty_summary_has_no_rates():
    s = summarize(EngineMetrics(kv_bytes_per_token=64))
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "kv_bytes_read_per_s"):
        assert s[key] is None
    assert s["ttft_p50_s"] is None and s["host_hidden_ms_per_step"] is None
    assert s["num_steps"] == 0 and s["kv_utilization"] == 0
