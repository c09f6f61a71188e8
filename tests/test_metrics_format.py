"""pagedjax.metrics.prometheus_text against Prometheus' text format (version 0.0.4) and
vLLM's meanings, over an engine that ran n > 1 sampling, an abort and preemptions.
"""

import math
import re

import pytest
from engine_helpers import GEOMETRY, greedy, random_params

from pagedjax.engine import LLM, SamplingParams
from pagedjax.metrics import prometheus_text

NAME = 'a"b\\c\nd'  # a served model name that needs every escape
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m[1], m[1]), v)


def parse(text: str) -> dict[str, dict]:
    """Families by name: {"type", "help", "samples": [(name, labels, value)]}, checking
    the 0.0.4 grammar on the way: HELP then TYPE once per family, before its samples;
    every sample in the family just declared; label values escaped; values floats."""
    assert text.endswith("\n") and "\n\n" not in text
    families: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in families, f"second HELP for {name}"
            current = families[name] = dict(help=line.split(" ", 3)[3], type=None, samples=[])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert families[name] is current and current["type"] is None, line
            assert kind in ("counter", "gauge", "histogram"), line
            current["type"] = kind
        else:
            m = _SAMPLE.fullmatch(line)
            assert m, f"not a sample line: {line!r}"
            name, labels, value = m.groups()
            assert current is not None, f"a sample before any HELP: {line!r}"
            family = list(families)[-1]
            suffixes = ("_bucket", "_sum", "_count") if current["type"] == "histogram" else ("",)
            assert any(name == family + s for s in suffixes), f"{name} outside {family}"
            pairs = _LABEL.findall(labels or "")
            assert ",".join(f'{k}="{v}"' for k, v in pairs) == (labels or ""), line
            assert len({k for k, _ in pairs}) == len(pairs), f"a label twice: {line}"
            v = float(value)
            assert not math.isnan(v), f"NaN in {line}"
            current["samples"].append((name, {k: _unescape(x) for k, x in pairs}, v))
    return families


def check_semantics(families: dict[str, dict]) -> None:
    """Counters end in _total and are not negative; histograms' buckets cumulative,
    +Inf last and equal to _count; every sample carries the model name."""
    for name, f in families.items():
        assert f["type"] is not None and f["samples"], name
        if f["type"] == "counter":
            assert name.endswith("_total"), name
            assert all(v >= 0 for *_, v in f["samples"]), name
        if f["type"] == "histogram":
            buckets = [(s[1]["le"], s[2]) for s in f["samples"] if s[0].endswith("_bucket")]
            les = [float(le) for le, _ in buckets]
            assert les == sorted(les) and buckets[-1][0] == "+Inf", name
            counts = [n for _, n in buckets]
            assert counts == sorted(counts), f"{name}: buckets not cumulative"
            (count,) = [v for n, _, v in f["samples"] if n == name + "_count"]
            (total,) = [v for n, _, v in f["samples"] if n == name + "_sum"]
            assert counts[-1] == count and total >= 0, name
        if name != "pagedjax:lora_requests_info":
            assert all(s[1].get("model_name") == NAME for s in f["samples"]), name


def values(llm) -> dict[str, float]:
    """The samples without labels but the model name, by name; and request_success_total
    by finished_reason, as "request_success_total:<reason>"."""
    fams = parse(prometheus_text(llm, NAME))
    check_semantics(fams)
    samples = [s for f in fams.values() for s in f["samples"]]
    out = {n: v for n, labels, v in samples if labels.keys() == {"model_name"}}
    for n, labels, v in samples:
        if n == "pagedjax:request_success_total":
            assert labels.keys() == {"model_name", "finished_reason"}, labels
            out[f"{n}:{labels['finished_reason']}"] = v
    return out


def successes(v: dict[str, float]) -> dict[str, float]:
    """request_success_total by finished_reason, from `values`."""
    p = "pagedjax:request_success_total:"
    return {k.removeprefix(p): x for k, x in v.items() if k.startswith(p)}


@pytest.fixture(scope="module")
def params():
    return random_params(0)


def test_exposition_is_well_formed_through_a_run(params):
    llm = LLM(params, **GEOMETRY)
    v = values(llm)  # a fresh engine: every family, all zero
    assert {k: x for k, x in v.items() if x} == {}
    assert successes(v) == dict(stop=0, length=0, abort=0, error=0)  # vLLM's, from the start
    llm.add_request([5, 6, 7], greedy(4))
    n3 = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    llm.add_request([5, 6, 7, 8], n3)  # three completions, each ending "length"
    llm.add_request([9, 10], greedy(5, stop_token_ids=list(range(256))))  # ends "stop"
    llm.add_request(list(range(3, 20)), greedy(40), request_id="gone")
    finished = llm.step() + llm.step()
    values(llm)  # mid-run
    llm.abort("gone")
    while llm.has_unfinished_requests():
        finished += llm.step()
    v = values(llm)
    p = "pagedjax:"
    assert v[p + "num_requests_running"] == v[p + "num_requests_waiting"] == 0
    assert v[p + "kv_cache_usage_perc"] == 0  # the aborted request's pages came back
    # Per completion, by its finish reason (the n=3 request counts 3); the aborted
    # request is not a success (vLLM counts no client abort), nor timed.
    reasons = [c.finish_reason for o in finished for c in o.outputs]
    assert len(reasons) == 5 and reasons.count("length") >= 3 and "stop" in reasons
    want = dict(stop=reasons.count("stop"), length=reasons.count("length"), abort=0, error=0)
    assert successes(v) == want
    assert v[p + "e2e_request_latency_seconds_count"] == 3
    assert v[p + "generation_tokens_total"] == llm.metrics.generated_tokens > 0


def test_abort_resets_the_gauges_before_the_next_step(params):
    """The server reads /metrics between steps: an abort shows at once."""
    llm = LLM(params, **GEOMETRY)
    llm.add_request(list(range(3, 20)), greedy(30), request_id="a")
    for _ in range(3):
        llm.step()
    assert values(llm)["pagedjax:num_requests_running"] == 1
    llm.abort("a")
    v = values(llm)
    assert v["pagedjax:num_requests_running"] == v["pagedjax:num_requests_waiting"] == 0
    assert v["pagedjax:kv_cache_usage_perc"] == 0


def test_prompt_tokens_and_ttft_count_at_the_first_token(params):
    """They counted at a request's finish: an aborted request's prompt never counted
    (while its generated tokens did), a running one's TTFT was not observed. vLLM counts
    both at the first token."""
    llm = LLM(params, **GEOMETRY)
    llm.add_request(list(range(3, 20)), greedy(30), request_id="a")
    for _ in range(3):
        llm.step()
    assert llm.abort("a").outputs[0].token_ids  # it had generated tokens
    v = values(llm)
    assert v["pagedjax:prompt_tokens_total"] == 17
    assert v["pagedjax:time_to_first_token_seconds_count"] == 1


def test_prefix_cache_queries_count_each_request_once_across_preemptions(params):
    """A preempted request's readmission (its prompt and generated tokens, hits on its
    own pages) counted as queries and hits; vLLM keeps preempted requests out of these
    counters (`PrefixCacheStats.preempted_*`)."""
    llm = LLM(params, **dict(GEOMETRY, num_pages=8))
    prompts = [[3 + i] * 9 for i in range(4)]
    for p in prompts:
        llm.add_request(p, greedy(20))
    while llm.has_unfinished_requests():
        llm.step()
    v = values(llm)
    assert v["pagedjax:num_preemptions_total"] > 0  # the case this test is about
    assert v["pagedjax:prefix_cache_queries_total"] == sum(map(len, prompts))
    assert v["pagedjax:prefix_cache_hits_total"] == 0  # (no two prompts share a page)


@pytest.mark.parametrize("bad", ['a"b', "a\\b", "a\nb"])
def test_the_checker_rejects_an_unescaped_label_value(params, monkeypatch, bad):
    """The grammar check has teeth: without `_escape`, each of the three breaks it."""
    monkeypatch.setattr("pagedjax.metrics._escape", lambda v: v)
    with pytest.raises(AssertionError):
        parse(prometheus_text(LLM(params, **GEOMETRY), bad))
