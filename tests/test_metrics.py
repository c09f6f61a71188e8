"""pagedjax.metrics: the run summary from random step records, against a hand computation."""

import math
import time

import numpy as np
import pytest

from pagedjax.metrics import SUMMARY_KEYS, EngineMetrics, Histogram, StepRecord, percentile


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
    spans = []  # (record, start, ready, device s) of each completed step
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
            if spans and min(spans[-1][2], t) > max(spans[-1][1], t - rec.dispatch_s):
                assert spans[-1][0].device_s is None  # awaited across this compile
                spans[-1] = None
        ready = t + float(rng.random()) * (2 if rng.random() < 0.5 else 0.1)
        ready = max(ready, last_ready + 1e-3)
        m.complete(rec, ready)
        dev = ready - max(t, last_ready)
        assert rec.device_s == pytest.approx(dev)
        spans.append((rec, max(t, last_ready), ready, dev))
        last_ready = ready
        t += float(rng.random())  # the next dispatch: before or after these tokens arrive
    measured = [x for x in spans if x is not None]
    want_dev = dict(
        pre_s=sum(d for r, _, _, d in measured if r.num_prefill_tokens),
        pre_n=sum(r.num_prefill_tokens for r, *_ in measured),
        dec_s=sum(d for r, _, _, d in measured if not r.num_prefill_tokens),
        dec_n=sum(r.num_decode_tokens for r, *_ in measured if not r.num_prefill_tokens),
        all_s=sum(d for *_, d in measured),
    )
    assert len(measured) < n  # every seed has a step awaited across a compile
    timed_ctx = sum(r.context_tokens for r, *_ in measured)
    ttfts = rng.random(int(rng.integers(1, 30))).tolist()
    lat = [x + float(rng.random()) for x in ttfts]
    for a, b in zip(ttfts, lat, strict=True):
        m.record_first_token(int(rng.integers(1, 100)), a)
        m.record_request(b, ["stop"])
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
    want_kv_rate = timed_ctx * m.kv_bytes_per_token / want_dev["all_s"]
    assert s["kv_bytes_read_per_s"] == pytest.approx(want_kv_rate)
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


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_step_awaited_across_the_next_compile_has_no_device_time(asynchronous):
    # Asynchronous scheduling dispatches step 2 (compiling a 3 s program) before it
    # waits for step 1's tokens: step 1's 3.02 s span was its device time, and the one
    # prefill step's 1000 tokens read 331 tokens/s instead of n/a (and device_time_s
    # 3.03 s, nearly all compile).
    m = EngineMetrics(kv_bytes_per_token=10)
    prefill = StepRecord(1, 1000, 0, False, 1000, 4, True, 0, 0, 0, 2.0, 2.0, 1)
    decode = StepRecord(1, 0, 1, True, 1001, 4, True, 0, 0, 0, 3.0, 5.01, 1)
    m.record(prefill, 1)
    if asynchronous:  # the engine's order: dispatch 2, complete 1, record 2
        m.complete(prefill, 5.02)
        m.record(decode, 1)
    else:  # step 1's tokens arrive before step 2 is dispatched
        m.complete(prefill, 2.01)
        m.record(decode, 1)
    m.complete(decode, 5.03 if asynchronous else 5.02)
    s = summarize(m)
    assert decode.device_s == pytest.approx(0.01)
    assert s["decode_tokens_per_s"] == pytest.approx(100)
    if asynchronous:
        assert prefill.device_s is None and s["prefill_tokens_per_s"] is None
        assert s["device_time_s"] == pytest.approx(0.01)
        assert s["kv_bytes_read_per_s"] == pytest.approx(1001 * 10 / 0.01)
    else:
        assert prefill.device_s == pytest.approx(0.01)
        assert s["prefill_tokens_per_s"] == pytest.approx(1000 / 0.01)
        assert s["kv_bytes_read_per_s"] == pytest.approx(2001 * 10 / 0.02)
    assert s["kv_bytes_read"] == 2001 * 10 and s["compile_time_s"] == 5.0


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


def _step(dispatched_at: float, *, prefill: int = 0, decode: int = 1, compiled: bool = False):
    return StepRecord(
        1, prefill, decode, not prefill, 10, 2, compiled, 0.1, 0.2, 0.3, 0.5, dispatched_at
    )


def test_reset_clears_everything_but_the_load_time():
    m = EngineMetrics(kv_bytes_per_token=8)
    fresh = summarize(m)
    m.load_time_s = 1.5
    for i, compiled in enumerate((True, False, False)):
        rec = _step(float(i), prefill=5 * (i == 0), compiled=compiled)
        m.record(rec, int(compiled))
        m.complete(rec, i + 0.5)  # the last one stays pending until the next record()
    m.record_first_token(3, 0.2)
    m.record_request(0.9, ["length"])
    m.generated_tokens, m.run_time_s = 7, 4.0
    m.reset()
    assert not m.steps and summarize(m) == fresh | dict(load_time_s=1.5)
    assert m.request_success == dict(stop=0, length=0, abort=0, error=0)
    rec = _step(10.0)  # a new run: nothing of the old one's pending step counts
    m.record(rec)
    m.complete(rec, 10.25)
    s = summarize(m)
    assert s["device_time_s"] == pytest.approx(0.25) and s["decode_tokens_per_s"] == 4
    assert s["num_steps"] == 1 and s["kv_bytes_read"] == 80


def test_totals_count_steps_past_max_records():
    m = EngineMetrics(kv_bytes_per_token=8, max_records=2)
    for i in range(5):
        rec = _step(float(i), compiled=i == 0)
        m.record(rec, int(i == 0))
        m.complete(rec, i + 0.5)
    s = summarize(m)
    assert len(m.steps) == 2 and s["num_steps"] == 5 and s["kv_bytes_read"] == 5 * 80
    assert s["device_time_s"] == pytest.approx(2.5) and s["num_compilations"] == 1
    assert s["host_hidden_ms_per_step"] == pytest.approx(100)  # the 4 uncompiled steps


def test_request_timings_are_bounded_and_counts_and_means_exact():
    """A server's requests grew the timing lists without end; the last max_records are
    kept for the percentiles, and every request counts in the counts and means."""
    m = EngineMetrics(kv_bytes_per_token=8, max_records=3)
    for i in range(1, 6):
        m.record_first_token(2, 0.1 * i)
        m.record_request(1.0 * i, ["stop"])
    s = summarize(m)
    assert len(m.ttfts) == len(m.latencies) == 3 and s["num_requests"] == 5
    assert s["ttft_mean_s"] == pytest.approx(0.3) and s["latency_mean_s"] == pytest.approx(3.0)
    assert s["ttft_p50_s"] == pytest.approx(0.4)  # of the last three: 0.3, 0.4, 0.5
    m.reset()
    assert summarize(m)["num_requests"] == 0 and m.ttfts.maxlen == 3


def test_histogram_counts_each_value_in_its_le_bucket():
    h = Histogram((0.1, 1.0, 10.0))
    for x in (0.05, 0.1, 0.5, 1.0, 3.0, 99.0):
        h.add(x)
    assert h.cumulative() == [("0.1", 2), ("1.0", 4), ("10.0", 5), ("+Inf", 6)]
    assert h.count == 6 and h.sum == pytest.approx(103.65) and h.mean == pytest.approx(103.65 / 6)
    assert Histogram((1.0,)).mean is None


def test_latency_counts_finished_requests_and_ttft_first_tokens():
    m = EngineMetrics(kv_bytes_per_token=8)
    m.record_first_token(4, 0.5)
    m.record_request(1.0, ["stop"])
    m.record_request(3.0, ["length"])  # finished without a token
    m.record_first_token(6, 0.25)  # running, or aborted after its first token
    s = summarize(m)
    assert s["num_requests"] == 2 and s["num_prompt_tokens"] == 10
    assert s["ttft_mean_s"] == 0.375 and s["latency_mean_s"] == 2.0


def test_request_success_counts_completions_by_finish_reason():
    """vLLM's `request_success_total{finished_reason}`: every reason from 0, and a
    request of n completions counted n times, each under its own reason (it had no
    label, and counted requests)."""
    from pagedjax.metrics import FINISHED_REASONS

    m = EngineMetrics(kv_bytes_per_token=8)
    assert FINISHED_REASONS == ("stop", "length", "abort", "error")
    assert m.request_success == dict(stop=0, length=0, abort=0, error=0)
    m.record_request(1.0, ["stop"])
    m.record_request(2.0, ["length", "stop", "length"])  # n = 3
    assert m.request_success == dict(stop=2, length=2, abort=0, error=0)
    assert summarize(m)["num_requests"] == 2  # (requests, as before)


def test_a_decode_step_carrying_one_token_prefill_chunks_counts_as_prefill():
    # decode_step runs whenever every row feeds one token, prefill chunks of one included;
    # "decode tokens/s" is over pure decode steps only.
    m = EngineMetrics(kv_bytes_per_token=8)
    mixed = StepRecord(3, 2, 1, True, 30, 2, False, 0, 0, 0, 0.1, 1.0)
    m.record(mixed)
    m.complete(mixed, 1.5)
    s = summarize(m)
    assert s["prefill_tokens_per_s"] == pytest.approx(2 / 0.5)
    assert s["decode_tokens_per_s"] is None


def test_prometheus_label_values_are_escaped():
    """A served model name with a quote, a backslash or a newline stays one label value."""
    from pagedjax.metrics import _escape

    assert _escape('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


def test_prometheus_names_the_running_and_waiting_lora_adapters(tmp_path):
    """vLLM's `lora_requests_info`: with one adapter slot, the second adapter's request
    waits; an engine without LoRA has no such metric."""
    from engine_helpers import GEOMETRY, TINY, greedy, random_params
    from lora_helpers import write_peft

    from pagedjax.engine import LLM
    from pagedjax.lora import LoRARequest
    from pagedjax.metrics import prometheus_text

    params = random_params(0)
    assert "lora" not in prometheus_text(LLM(params, **GEOMETRY), "m")
    reqs = []
    for i, name in enumerate(["sql-lora", 'a"q'], start=1):
        write_peft(tmp_path / str(i), TINY, rank=2, seed=i)
        reqs.append(LoRARequest(name, i, str(tmp_path / str(i))))
    llm = LLM(params, enable_lora=True, max_loras=1, max_lora_rank=2, **GEOMETRY)
    for r in [reqs[0], None, reqs[1], reqs[1]]:
        llm.add_request([5, 6, 7], greedy(4), lora_request=r)
    llm.step()
    lines = [x for x in prometheus_text(llm, "m").splitlines() if "lora_requests_info" in x]
    assert lines[:2] == [
        "# HELP pagedjax:lora_requests_info LoRA adapters of the running and waiting requests.",
        "# TYPE pagedjax:lora_requests_info gauge",
    ]
    labels, value = lines[2].rsplit(" ", 1)
    assert labels == (
        'pagedjax:lora_requests_info{max_lora="1",running_lora_adapters="sql-lora",'
        'waiting_lora_adapters="a\\"q"}'
    )
    assert abs(float(value) - time.time()) < 60
    while llm.has_unfinished_requests():
        llm.step()
    info = [x for x in prometheus_text(llm).splitlines() if x.startswith("pagedjax:lora")]
    assert info[0].startswith(
        'pagedjax:lora_requests_info{max_lora="1",running_lora_adapters="",'
        'waiting_lora_adapters=""}'
    )
