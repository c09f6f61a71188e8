"""pagedjax.metrics at the edges of a run: a reset with a step in flight, and summaries
that JSON must take as they are (no model: step records built by hand)."""

import json

import numpy as np
import pytest

from pagedjax.metrics import SUMMARY_KEYS, EngineMetrics, StepRecord


def decode_step(dispatched_at: float, *, tokens: int, context: int, compiled: bool = False):
    return StepRecord(
        tokens, 0, tokens, True, context, 2, compiled, 0.0, 0.0, 0.0, 0.5, dispatched_at
    )


def summarize(m: EngineMetrics, **kw) -> dict:
    args = dict(kv_pages_total=64, prefix_cache_hit_rate=0.0, preemptions=0)
    return m.summary(**(args | dict(peak_device_memory_bytes=None) | kw))


def test_a_step_in_flight_at_a_reset_counts_in_no_figure_of_the_new_run():
    """`reset()` between a warm-up and the measured run, with a step in flight (the
    asynchronous engine's order: dispatch the next step, then the previous one's tokens
    arrive): the old step's 8 tokens and 2 s counted in the new run's decode tokens/s and
    device time, while its steps and KV bytes did not (kv_bytes_read_per_s times
    device_time_s exceeded kv_bytes_read)."""
    m = EngineMetrics(kv_bytes_per_token=10)
    old = decode_step(0.0, tokens=8, context=800)
    m.record(old)
    m.reset()
    new = decode_step(1.5, tokens=1, context=100)  # dispatched while `old` runs
    m.complete(old, 2.0)
    m.record(new)
    m.complete(new, 2.25)
    s = summarize(m)
    assert s["num_steps"] == 1 and s["kv_bytes_read"] == 100 * 10
    # The device ran `old` until 2.0: `new`'s time starts there, not at its dispatch.
    assert new.device_s == pytest.approx(0.25)
    assert s["device_time_s"] == pytest.approx(0.25)
    assert s["decode_tokens_per_s"] == pytest.approx(1 / 0.25)
    assert s["kv_bytes_read_per_s"] == pytest.approx(100 * 10 / 0.25)


def _runs():
    """(name, metrics) of runs at the edges: nothing ran; only prefill; every step
    compiled, each awaited across the next one's compile (no device time at all)."""
    empty = EngineMetrics(kv_bytes_per_token=64)
    prefill = EngineMetrics(kv_bytes_per_token=64)
    rec = StepRecord(1, 5, 0, False, 5, 1, True, 0.0, 0.0, 0.0, 1.0, 1.0, 1)
    prefill.record(rec, 1)
    prefill.complete(rec, 1.5)
    prefill.record_first_token(5, 1.5)
    prefill.record_request(1.5, ["length"])
    prefill.generated_tokens, prefill.run_time_s = 1, 1.0  # run time == compile time
    compiled = EngineMetrics(kv_bytes_per_token=64)
    prev = None
    for i in range(3):
        rec = decode_step(2.0 * i + 1, tokens=1, context=10, compiled=True)
        if prev is not None:
            compiled.complete(prev, 2.0 * i + 1.5)  # after this step's compile
        compiled.record(rec, 1)
        prev = rec
    return [("empty", empty), ("prefill only", prefill), ("all compiled", compiled)]


@pytest.mark.parametrize("name, m", _runs(), ids=lambda x: x if isinstance(x, str) else "")
def test_summaries_at_the_edges_are_strict_json_of_plain_values(name, m):
    """`LLM(num_pages=np.int64(...))` is accepted (CacheConfig takes numpy integers),
    and its summary's `kv_pages_total` was a numpy int64: `json.dumps` raised TypeError.
    Every value is a Python int, float or None, and no rate divides by zero."""
    s = summarize(m, kv_pages_total=np.int64(64), preemptions=np.int64(0))
    assert tuple(s) == SUMMARY_KEYS
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    assert all(v is None or type(v) in (int, float) for v in s.values()), s
    assert type(s["kv_pages_total"]) is int and s["kv_pages_total"] == 64
    assert type(s["kv_utilization"]) is float
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "output_tokens_per_s"):
        assert s[key] is None or s[key] > 0, (key, s[key])
    if name == "all compiled":
        assert s["device_time_s"] == 0 and s["kv_bytes_read_per_s"] is None
        assert s["host_hidden_ms_per_step"] is None and s["num_compilations"] == 3
    if name == "prefill only":
        assert s["prefill_tokens_per_s"] == pytest.approx(5 / 0.5)
        assert s["decode_tokens_per_s"] is None and s["output_tokens_per_s"] is None
        assert s["ttft_p50_s"] == s["ttft_p99_s"] == 1.5  # one value: every percentile
