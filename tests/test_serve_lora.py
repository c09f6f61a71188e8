"""scripts/serve.py with LoRA adapters (vLLM's `--lora-modules`): /v1/models lists them, a
request's `model` naming one runs with it (its answer equals the engine's with that
adapter, and echoes the name), an unknown name is a 404 listing the served ones, and
bad flags or adapters fail the start as one line.

One server over tests/serve_helpers.py's checkpoint with two adapters; every answer is
checked against an `LLM` with LoRA enabled, built the same way (`lora_ref`).
"""

import json

import pytest
import serve_helpers
from lora_helpers import write_peft
from serve_helpers import MESSAGES, make_llm, ok, request, serve, serving, stream

from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams
from pagedjax.lora import LoRARequest

ckpt = serve_helpers.ckpt  # bound here: this module gets its own checkpoint
TINY = PRESETS["tiny"]  # (the checkpoint's config)
GEOMETRY = ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_adapters")
    write_peft(root / "sql", TINY, rank=4, alpha=8, seed=31)
    write_peft(root / "terse", TINY, rank=2, alpha=4, modules=("q_proj", "down_proj"), seed=32)
    return [LoRARequest("sql", 1, str(root / "sql")), LoRARequest("terse", 2, str(root / "terse"))]


@pytest.fixture(scope="module")
def lora_ref(ckpt):
    return make_llm(ckpt, enable_lora=True, max_loras=2)


@pytest.fixture(scope="module")
def lora_server(ckpt, adapters):
    yield from serving(make_llm(ckpt, enable_lora=True, max_loras=2), "tiny", lora_modules=adapters)


def test_models_lists_the_adapters_after_the_model(lora_server, adapters):
    card = dict(object="model", created=0, owned_by="pagedjax", max_model_len=512)
    want = [dict(id="tiny", **card)]
    want += [dict(id=r.lora_name, **card, parent="tiny", root=r.lora_path) for r in adapters]
    assert ok(lora_server, "/v1/models", None) == dict(object="list", data=want)


def test_a_request_naming_an_adapter_runs_with_it(lora_server, lora_ref, adapters):
    prompts = ["def add(a, b):", "import os"]
    body = dict(prompt=prompts, temperature=0, max_tokens=8, return_token_ids=True)
    sp = SamplingParams(temperature=0, max_tokens=8)
    got = {}
    for name, req in (("tiny", None), ("sql", adapters[0]), ("terse", adapters[1])):
        answer = ok(lora_server, "/v1/completions", dict(body, model=name))
        assert answer["model"] == name  # the name the request used, echoed
        got[name] = [c["token_ids"] for c in answer["choices"]]
        want = lora_ref.generate(prompts, sp, lora_request=req)
        assert got[name] == [o.outputs[0].token_ids for o in want], name
    assert len({json.dumps(ids) for ids in got.values()}) == 3  # each adapter changes them
    answer = ok(lora_server, "/v1/completions", body)  # no model: the base model
    assert answer["model"] == "tiny" and [c["token_ids"] for c in answer["choices"]] == got["tiny"]

    # A streamed chat: every chunk names the adapter; the text is the engine's.
    chat = dict(messages=MESSAGES, model="sql", temperature=0, max_tokens=6)
    chunks = stream(lora_server, "/v1/chat/completions", chat)
    assert {c["model"] for c in chunks} == {"sql"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    (want,) = lora_ref.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=6), lora_request=adapters[0]
    )
    assert text == want.outputs[0].text


def test_an_unknown_model_is_a_404_naming_the_served_ones(lora_server):
    for path, body in (
        ("/v1/completions", dict(prompt="a")),
        ("/v1/chat/completions", dict(messages=MESSAGES)),
        ("/tokenize", dict(prompt="a")),
        ("/detokenize", dict(tokens=[97])),
    ):
        status, err = request(lora_server, path, dict(body, model="gpt-4"))
        assert status == 404 and err["error"]["code"] == "model_not_found", err
        assert "'gpt-4' is not served here; they are 'tiny', 'sql', 'terse'" in str(err)
    # /tokenize and /detokenize take an adapter's name: the same tokenizer.
    base = ok(lora_server, "/tokenize", dict(prompt="def f():", model="tiny"))
    assert ok(lora_server, "/tokenize", dict(prompt="def f():", model="terse")) == base
    text = ok(lora_server, "/detokenize", dict(tokens=base["tokens"], model="sql"))["prompt"]
    assert text.endswith("def f():")


def _argv(*extra) -> list[str]:
    base = ["--checkpoint", "CKPT", "--port", "0", "--quiet", "--backend", "xla", *GEOMETRY]
    return [*base, "--compilation-cache", "off", *extra]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lora-modules", "sql"], "--lora-modules: expected NAME=PATH or a JSON object"),
        (["--lora-modules", "=DIR"], "expected NAME=PATH or a JSON object, got '=DIR'"),
        (["--lora-modules", "sql="], "expected NAME=PATH"),
        (["--lora-modules", '{"name": "a"'], "is not JSON"),
        (["--lora-modules", '{"name": "a"}'], 'expected {"name": ..., "path": ...'),
        (["--lora-modules", '{"name": "a", "path": "DIR", "x": 1}'], 'expected {"name"'),
        (["--lora-modules", '{"name": "a", "path": 3}'], "expected non-empty strings"),
        (["--lora-modules", "a=DIR/nope"], "--lora-modules a=DIR/nope: no such directory"),
        (["--lora-modules", "a=DIR", "b=DIR", "a=DIR"], "module name 'a' is given twice"),
        (["--served-model-name", "m", "--lora-modules", "m=DIR"], "'m' is the served model's"),
        (
            ["--lora-modules", '{"name": "a", "path": "DIR", "base_model_name": "other"}'],
            "base_model_name 'other' is not the served model",
        ),
        (["--max-loras", "2"], "--max-loras needs --lora-modules"),
        (["--max-lora-rank", "8"], "--max-lora-rank needs --lora-modules"),
        (["--max-cpu-loras", "0"], "--max-cpu-loras needs --lora-modules"),
        (["--lora-modules", "a=DIR", "--max-loras", "0"], "--max-loras: must be >= 1, got 0"),
        (["--lora-modules", "a=DIR", "--max-cpu-loras", "-1"], "must be >= 0, got -1"),
    ],
)
def test_bad_lora_flags_are_one_line_before_loading(
    ckpt, tmp_path, monkeypatch, capsys, extra, words
):
    monkeypatch.setattr("pagedjax.engine.LLM", lambda *a, **k: pytest.fail("weights loaded"))
    argv = [a.replace("CKPT", str(ckpt)).replace("DIR", str(tmp_path)) for a in _argv(*extra)]
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    words = words.replace("DIR", str(tmp_path))
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


def test_the_cli_reads_every_adapter_at_start(ckpt, adapters, monkeypatch, capsys):
    started, seen = serve_helpers.capture_start(monkeypatch), {}
    init = LLM.__init__
    monkeypatch.setattr(LLM, "__init__", lambda llm, *a, **k: seen.update(k) or init(llm, *a, **k))
    sql, terse = adapters
    modules = [f"sql={sql.lora_path}", json.dumps(dict(name="terse", path=terse.lora_path))]
    argv = _argv("--lora-modules", *modules, "--max-loras", "2", "--max-lora-rank", "8")
    argv += ["--max-cpu-loras", "3"]
    assert serve.main([a.replace("CKPT", str(ckpt)) for a in argv]) == 0
    err = capsys.readouterr().err
    assert "LoRA adapters sql, terse" in err, err
    (llm,) = started  # (its engine thread has stopped: main closed the server)
    assert llm.list_loras() == {1, 2} and llm.lora.requests == {1: sql, 2: terse}
    flags = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    assert {k: seen[k] for k in flags} == flags


def test_an_adapter_the_engine_refuses_fails_the_start(ckpt, tmp_path, monkeypatch, capsys):
    serve_helpers.capture_start(monkeypatch)
    write_peft(tmp_path / "wide", TINY, rank=8, modules=("q_proj",))
    argv = _argv("--lora-modules", f"wide={tmp_path / 'wide'}", "--max-lora-rank", "4")
    assert serve.main([a.replace("CKPT", str(ckpt)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: LoRA module 'wide': LoRA adapter ") and err.count("\n") == 1
    assert "has rank 8 > max_lora_rank=4" in err, err
