"""Engine metrics: one record per step, and the run summary `scripts/generate.py` prints.

Host overhead is measured per step in three parts (`StepRecord`):

* `host_hidden_s`: planning step N+1 (scheduling, admissions, prefill rows packed)
  while the device still runs step N: hidden when the device is slower than it.
* `wait_s`: blocked on step N's tokens (the device is busy; on a CPU "device" the
  same cores run both, so this is compute, not idle host).
* `host_exposed_s`: from step N's tokens arriving to step N+1 dispatched (applying
  tokens, stop checks, beam selection, appends, packing decode rows, the dispatch
  call): the device idles for this long between steps.

With asynchronous scheduling (the engine's default), step N+1 is committed and
dispatched before step N's tokens are waited for, and they are applied while N+1
runs: every host phase counts as hidden and `host_exposed_s` is 0. The host then
limits throughput only when its whole step (`host_hidden_s`) outlasts the device's,
which shows as `wait_s` near 0.

Steps that compiled a program are kept out of the host figures (their dispatch is
the compile) and counted in `compile_time_s`.

Device time of a step, `device_s`, is observed on the host: from its dispatch (or the
previous step's tokens arriving, if later) to its own tokens arriving. Throughputs
divide by it: prefill tokens/s over the steps that carried prefill chunks, decode
tokens/s over the pure decode steps, KV bytes/s over all steps. A step whose tokens
were awaited across the next step's compile (asynchronous scheduling dispatches step
N+1, compiling it if its shape is new, before it waits for step N's tokens) has no
measured device time (`device_s` None): it is left out of `device_time_s` and of
every throughput, its tokens and KV bytes as well as its time. `output_tokens_per_s`
is the end-to-end figure: generated tokens over the run time (the wall time of
`LLM.generate` and `LLM.step` calls) less compile time; None when that is not positive
(nothing ran).

TTFT and latency means count every request; their percentiles are over the last
`max_records` requests, so a long-running server's lists stay bounded. Finished
requests also count per completion by finish reason (`request_success`), as vLLM's
`request_success_total{finished_reason=...}`.
`prometheus_text` gives the live figures in Prometheus' format (scripts/serve.py's
`/metrics`).

KV bytes read follow the performance model in DESIGN.md: a step reads every live
K/V byte of its rows' contexts once, `kv_bytes_per_token * sum(context lens)`, at the
cache's storage dtype (1 byte an element for FP8 pages). Under a sliding window of W,
a row's live context is what its chunk's windows cover, `min(start, W - 1) + chunk`
tokens (the engine's `StepRecord.context_tokens`).

`summary()` holds plain Python values (int, float, None; no NaN or infinity), so
`json.dumps(..., allow_nan=False)` takes it as it is.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import time

import numpy as np

__all__ = [
    "FINISHED_REASONS",
    "LATENCY_BUCKETS_S",
    "SUMMARY_KEYS",
    "TTFT_BUCKETS_S",
    "EngineMetrics",
    "Histogram",
    "StepRecord",
    "percentile",
    "lora_info",
    "prometheus_text",
]

SUMMARY_KEYS = (
    "load_time_s",
    "compile_time_s",
    "num_compilations",
    "run_time_s",
    "num_requests",
    "num_steps",
    "num_prompt_tokens",
    "num_prefill_tokens",
    "num_generated_tokens",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "latency_mean_s",
    "device_time_s",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "output_tokens_per_s",
    "kv_bytes_read",
    "kv_bytes_read_per_s",
    "peak_device_memory_bytes",
    "kv_pages_used",
    "kv_pages_total",
    "kv_utilization",
    "prefix_cache_hit_rate",
    "preemptions",
    "host_hidden_ms_per_step",
    "host_exposed_ms_per_step",
    "device_wait_ms_per_step",
)


# Upper bounds of the request-timing histograms' buckets, vLLM's (so dashboards made for
# its /metrics read ours).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS_S += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
LATENCY_BUCKETS_S += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# vLLM's `request_success_total` label values (its FinishReason; it has also added
# "repetition", which pagedjax never gives): each series exists from the start, at 0.
FINISHED_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Counts of values at most each bound (Prometheus' `le`), their count and sum.

    Args:
      bounds: increasing upper bounds; values above the last count in +Inf only.
    """

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.count, self.sum = 0, 0.0

    def add(self, x: float) -> None:
        i = bisect.bisect_left(self.bounds, x)
        if i < len(self.bounds):
            self.counts[i] += 1
        self.count += 1
        self.sum += x

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, values at most le) per bound, then ("+Inf", count)."""
        out = list(zip(map(repr, self.bounds), itertools.accumulate(self.counts), strict=True))
        return [*out, ("+Inf", self.count)]


def percentile(values, q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no values."""
    return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else None


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One engine step."""

    num_rows: int  # live rows (sequences that fed tokens)
    num_prefill_tokens: int
    num_decode_tokens: int
    decode: bool  # ran decode_step (one token per row)
    context_tokens: int  # sum of the rows' context lengths (K/V read)
    kv_used_pages: int
    compiled: bool  # the dispatch traced and compiled a new program
    host_hidden_s: float
    wait_s: float
    host_exposed_s: float
    dispatch_s: float
    dispatched_at: float = 0.0  # perf_counter() when the dispatch returned
    num_compilations: int = 0  # programs the dispatch compiled
    # Set when its tokens arrive (`EngineMetrics.complete`); None again if the host
    # compiled the next step meanwhile (then the device's share is unknown).
    device_s: float | None = None
    run: int = 0  # set by `EngineMetrics.record`: the run (between resets) it belongs to


class EngineMetrics:
    """Accumulates step records and request timings; `summary()` reports them.

    Args:
      kv_bytes_per_token: K and V bytes of one token over all layers.
      max_records: step records kept (the totals count every step), and request
        timings kept for the percentiles (the counts and means count every request:
        a server's lists stay bounded).
    """

    def __init__(self, kv_bytes_per_token: int, *, max_records: int = 100_000):
        self.kv_bytes_per_token = kv_bytes_per_token
        self.max_records = max_records
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=max_records)
        self.load_time_s = 0.0
        self._run = 0
        self.reset()

    def reset(self) -> None:
        """Clears everything but the load time (e.g. between benchmark runs). A step
        recorded before it (one in flight) counts in no figure of the new run."""
        self.steps.clear()
        self.num_steps = 0
        self.compile_time_s = 0.0
        self.num_compilations = 0
        self.run_time_s = 0.0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.generated_tokens = 0  # tokens accepted into outputs (engine-counted)
        self.context_tokens = 0
        self.peak_used_pages = 0
        # The last max_records requests' TTFTs and latencies (for percentiles), and every
        # request's in histograms (counts, sums, buckets).
        self.ttfts: collections.deque[float] = collections.deque(maxlen=self.max_records)
        self.latencies: collections.deque[float] = collections.deque(maxlen=self.max_records)
        self.ttft_hist = Histogram(TTFT_BUCKETS_S)
        self.latency_hist = Histogram(LATENCY_BUCKETS_S)
        self.num_prompt_tokens = 0
        self.request_success = dict.fromkeys(FINISHED_REASONS, 0)  # completions by reason
        self._host = [0.0, 0.0, 0.0, 0]  # hidden, exposed, wait, steps counted
        # prefill s, tokens; decode s, tokens; all s, context tokens (of measured steps)
        self._timed = [0.0, 0, 0.0, 0, 0.0, 0]
        self._last_ready = 0.0
        # Each reset starts a run; a step completed with another run's number was
        # recorded before the reset.
        self._run += 1
        # The last completed step, (record, span start, span end), until the next
        # record() shows whether a compile fell in its span.
        self._pending: tuple[StepRecord, float, float] | None = None

    def record(self, rec: StepRecord, num_compilations: int = 0) -> None:
        rec.run = self._run
        self.steps.append(rec)
        self.num_steps += 1
        self.prefill_tokens += rec.num_prefill_tokens
        self.decode_tokens += rec.num_decode_tokens
        self.context_tokens += rec.context_tokens
        self.peak_used_pages = max(self.peak_used_pages, rec.kv_used_pages)
        if rec.compiled:
            self.compile_time_s += rec.dispatch_s
            self.num_compilations += num_compilations
            if self._pending is not None:
                prev, start, ready = self._pending
                if min(ready, rec.dispatched_at) > max(start, rec.dispatched_at - rec.dispatch_s):
                    prev.device_s = None  # its span holds this compile
                    self._pending = None
        else:
            h = self._host
            h[0] += rec.host_hidden_s
            h[1] += rec.host_exposed_s
            h[2] += rec.wait_s
            h[3] += 1
        self._settle()

    def complete(self, rec: StepRecord, ready_at: float) -> None:
        """Records that `rec`'s tokens arrived on the host at `ready_at`."""
        if rec.run != self._run:  # recorded before a reset: not this run's
            self._last_ready = max(self._last_ready, ready_at)  # (the device was busy)
            return
        self._settle()
        start = max(rec.dispatched_at, self._last_ready)
        rec.device_s = ready_at - start
        self._last_ready = ready_at
        self._pending = (rec, start, ready_at)

    def _settle(self) -> None:
        if self._pending is not None:
            _add_timed(self._timed, self._pending[0])
            self._pending = None

    def record_first_token(self, num_prompt_tokens: int, ttft: float) -> None:
        """A request's first token: its prompt counts as served, and its time to it (as
        vLLM counts both then, so a request aborted later, or still running, shows)."""
        self.num_prompt_tokens += num_prompt_tokens
        self.ttfts.append(ttft)
        self.ttft_hist.add(ttft)

    def record_request(self, latency: float, finish_reasons) -> None:
        """A finished request: its end-to-end latency, and its completions' finish
        reasons (`request_success`).

        As vLLM's `request_success_total`, a request of n completions counts n times
        (vLLM runs each as a child request), each under its own reason; an aborted
        request is not a success (vLLM counts no client abort), so it is not recorded
        here. (Unlike vLLM, completions of an aborted request that had finished
        before the abort do not count either.)
        """
        self.latencies.append(latency)
        self.latency_hist.add(latency)
        for r in finish_reasons:
            self.request_success[r] = self.request_success.get(r, 0) + 1

    def summary(
        self,
        *,
        kv_pages_total: int,
        prefix_cache_hit_rate: float,
        preemptions: int,
        peak_device_memory_bytes: int | None,
    ) -> dict:
        """The run's figures, keyed by `SUMMARY_KEYS` (times in seconds unless `_ms`)."""
        timed = list(self._timed)
        if self._pending is not None:  # the last step, measured unless a compile follows
            _add_timed(timed, self._pending[0])
        pre_s, pre_n, dec_s, dec_n, dev_s, timed_context = timed
        rate = lambda n, t: n / t if t > 0 else None
        hidden, exposed, wait, n = self._host
        per_step = (lambda x: 1e3 * x / n) if n else (lambda x: None)
        kv_bytes = self.context_tokens * self.kv_bytes_per_token
        out = dict(
            load_time_s=self.load_time_s,
            compile_time_s=self.compile_time_s,
            num_compilations=self.num_compilations,
            run_time_s=self.run_time_s,
            num_requests=self.latency_hist.count,
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_prefill_tokens=self.prefill_tokens,
            num_generated_tokens=self.generated_tokens,
            ttft_mean_s=self.ttft_hist.mean,
            ttft_p50_s=percentile(self.ttfts, 50),
            ttft_p99_s=percentile(self.ttfts, 99),
            latency_mean_s=self.latency_hist.mean,
            device_time_s=dev_s,
            prefill_tokens_per_s=rate(pre_n, pre_s),
            decode_tokens_per_s=rate(dec_n, dec_s),
            # None where no run time beyond the compiles was measured (nothing ran).
            output_tokens_per_s=rate(self.generated_tokens, self.run_time_s - self.compile_time_s),
            kv_bytes_read=kv_bytes,
            kv_bytes_read_per_s=rate(timed_context * self.kv_bytes_per_token, dev_s),
            peak_device_memory_bytes=peak_device_memory_bytes,
            kv_pages_used=self.peak_used_pages,
            kv_pages_total=kv_pages_total,
            kv_utilization=self.peak_used_pages / kv_pages_total,
            prefix_cache_hit_rate=prefix_cache_hit_rate,
            preemptions=preemptions,
            host_hidden_ms_per_step=per_step(hidden),
            host_exposed_ms_per_step=per_step(exposed),
            device_wait_ms_per_step=per_step(wait),
        )
        assert tuple(out) == SUMMARY_KEYS
        return {k: _plain(v) for k, v in out.items()}


def _plain(v):
    """A summary value as JSON takes it: numpy scalars (a `num_pages` given as one) as
    Python's, and a non-finite float as None."""
    if v is None:
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    v = float(v)
    return v if math.isfinite(v) else None


def _add_timed(timed: list, rec: StepRecord) -> None:
    """Adds a measured step to `EngineMetrics._timed`-style totals."""
    k = 0 if rec.num_prefill_tokens else 2
    timed[k] += rec.device_s
    timed[k + 1] += rec.num_prefill_tokens or rec.num_decode_tokens
    timed[4] += rec.device_s
    timed[5] += rec.context_tokens


def prometheus_text(llm, model_name: str | None = None) -> str:
    """An `LLM`'s live metrics in Prometheus' text format (version 0.0.4), as vLLM's
    `/metrics` gives them with the prefix "pagedjax:" for "vllm:" (and its `model_name`
    label when given): requests running and waiting, KV cache usage, token, request
    (completions by `finished_reason`, every reason of `FINISHED_REASONS` from 0) and
    preemption counters since the engine started, histograms of the requests' TTFT
    (observed at the first token) and of the finished requests' latency (vLLM's
    buckets), and with LoRA `lora_requests_info` (`lora_info`). Call it where the engine
    is not stepping (`EngineThread.call`)."""
    m, bm = llm.metrics, llm.block_manager.stats()
    label = "" if model_name is None else f'model_name="{_escape(model_name)}"'
    out = []

    def metric(name, kind, help_, samples, model_label=True):
        out.append(f"# HELP pagedjax:{name} {help_}")
        out.append(f"# TYPE pagedjax:{name} {kind}")
        for suffix, extra, value in samples:
            labels = ",".join(x for x in (label if model_label else "", extra) if x)
            labels = f"{{{labels}}}" if labels else ""
            out.append(f"pagedjax:{name}{suffix}{labels} {float(value)!r}")

    def histogram(name, help_, hist: Histogram):
        buckets = [("_bucket", f'le="{le}"', n) for le, n in hist.cumulative()]
        totals = [("_sum", "", hist.sum), ("_count", "", hist.count)]
        metric(name, "histogram", help_, buckets + totals)

    running, waiting = len(llm.scheduler.running), len(llm.scheduler.waiting)
    metric("num_requests_running", "gauge", "Requests running.", [("", "", running)])
    metric("num_requests_waiting", "gauge", "Requests waiting.", [("", "", waiting)])
    metric(
        "kv_cache_usage_perc", "gauge", "KV cache pages in use (1 = all).", [("", "", bm.kv_usage)]
    )
    for name, help_, value in [
        ("prompt_tokens_total", "Prompt tokens of requests given a token.", m.num_prompt_tokens),
        ("generation_tokens_total", "Generated tokens.", m.generated_tokens),
        ("num_preemptions_total", "Preemptions.", llm.scheduler.num_preemptions),
        ("prefix_cache_queries_total", "Prompt tokens admitted.", bm.prefix_queries),
        ("prefix_cache_hits_total", "Prompt tokens read from the prefix cache.", bm.prefix_hits),
    ]:
        metric(name, "counter", help_, [("", "", value)])
    success = [("", f'finished_reason="{_escape(r)}"', n) for r, n in m.request_success.items()]
    metric("request_success_total", "counter", "Finished completions, by finish reason.", success)
    histogram("time_to_first_token_seconds", "Time to the first token.", m.ttft_hist)
    histogram("e2e_request_latency_seconds", "Request latency.", m.latency_hist)
    if llm.scheduler.max_loras is not None:  # (as vLLM's: no model name, the time as value)
        info = ",".join(f'{k}="{_escape(v)}"' for k, v in lora_info(llm).items())
        help_ = "LoRA adapters of the running and waiting requests."
        metric("lora_requests_info", "gauge", help_, [("", info, time.time())], False)
    return "\n".join(out) + "\n"


def lora_info(llm) -> dict[str, str]:
    """vLLM's `lora_requests_info` labels: the slots (`max_lora`) and the names of the
    adapters of the running and the waiting requests, sorted, comma-separated."""

    def names(groups) -> str:
        lr = (g.request.lora_request for g in groups)
        return ",".join(sorted({r.lora_name for r in lr if r is not None}))

    return {
        "max_lora": str(llm.scheduler.max_loras),
        "running_lora_adapters": names(llm.scheduler.running),
        "waiting_lora_adapters": names(llm.scheduler.waiting),
    }


def _escape(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped, and a lone
    surrogate (a name from a non-UTF-8 path or argument, or a JSON "\\ud800") as the
    text of its Python escape: UTF-8 has none, and encoding the exposition raised, so
    every /metrics scrape was a 500."""
    value = value.encode("utf-8", "backslashreplace").decode()
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
