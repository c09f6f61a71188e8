"""/metrics as a scraper reads it: `pagedjax.metrics.prometheus_text` behind
`pagedjax.http_server`."""

import pytest
import serve_helpers
from engine_helpers import GEOMETRY, random_params
from test_metrics_format import check_semantics, parse

from pagedjax.engine import LLM
from pagedjax.metrics import prometheus_text

# A lone surrogate: what Python makes of a non-UTF-8 byte in a path or an argument (a
# checkpoint directory's name is the default model name), and what a JSON "\ud800" is.
SURROGATE = "m\udcff"


@pytest.fixture(scope="module")
def llm():
    return LLM(random_params(0), **GEOMETRY)


def test_a_label_value_utf8_cannot_hold_is_escaped(llm, monkeypatch):
    """`_escape` passed a lone surrogate through: encoding the exposition raised, and
    every /metrics scrape was a 500 (the model's name labels every sample)."""
    text = prometheus_text(llm, SURROGATE)
    fams = parse(text.encode().decode())  # (the encode raised)
    monkeypatch.setattr("test_metrics_format.NAME", "m\\udcff")  # its escape, as text
    check_semantics(fams)


@pytest.mark.parametrize("name", ["café-模型", SURROGATE])
def test_metrics_are_utf8_text_over_http(llm, name):
    """The Content-Type named no charset (prometheus_client's and vLLM's say UTF-8): a
    client that follows HTTP's default read a model name outside ASCII as Latin-1. A
    name UTF-8 cannot hold was a 500."""
    for srv in serve_helpers.serving(llm, name):
        with serve_helpers.urllib.request.urlopen(srv.url + "/metrics", timeout=60) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = r.read().decode(r.headers.get_content_charset())
        # (the surrogate as the text of its escape, which the exposition escapes again)
        want = name.encode("utf-8", "backslashreplace").decode()
        samples = [s for f in parse(text).values() for s in f["samples"]]
        assert samples[0][1] == dict(model_name=want)
