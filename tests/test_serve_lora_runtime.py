"""scripts/serve.py's runtime LoRA updating (vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, `--allow-runtime-lora-updating`): a loaded adapter is listed
and runs the requests naming it, as the engine runs it; bad loads and unloads are
errors that change nothing; an adapter in use cannot be unloaded; an unloaded one is a
404; without the flag the paths are unknown.

One server over tests/serve_helpers.py's checkpoint, started with no adapter; the
reference outputs come from its own engine (`EngineThread.call`), with the adapter
read again under another id.
"""

import queue
import threading
import types

import pytest
import serve_helpers
from lora_helpers import write_peft
from serve_helpers import make_llm, ok, request, serve, serving

from pagedjax.config import PRESETS
from pagedjax.engine import SamplingParams
from pagedjax.lora import LoRARequest

ckpt, tok = serve_helpers.ckpt, serve_helpers.tok  # bound here: this module's own
TINY = PRESETS["tiny"]  # (the checkpoint's config)
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime_adapters")
    write_peft(root / "sql", TINY, rank=4, alpha=8, seed=41)
    write_peft(root / "terse", TINY, rank=2, alpha=4, modules=("q_proj", "down_proj"), seed=42)
    write_peft(root / "wide", TINY, rank=8, modules=("q_proj",), seed=43)  # > max_lora_rank
    return root


@pytest.fixture(scope="module")
def srv(ckpt):
    llm = make_llm(ckpt, enable_lora=True, max_loras=2, max_lora_rank=4)
    yield from serving(llm, "tiny", allow_runtime_lora_updating=True)


def served(srv) -> tuple[list[str], set[int]]:
    """(the ids /v1/models lists, the adapter ids the engine holds)."""
    ids = [m["id"] for m in ok(srv, "/v1/models", None)["data"]]
    return ids, srv.engine.call(lambda llm: llm.list_loras())


def test_a_loaded_adapter_is_listed_and_runs_as_the_engine_runs_it(srv, adapters):
    path = str(adapters / "sql")
    status, text = request(srv, LOAD, dict(lora_name="sql", lora_path=path))
    assert (status, text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    card = dict(object="model", created=0, owned_by="pagedjax", max_model_len=512)
    models = ok(srv, "/v1/models", None)["data"]
    assert models[1:] == [dict(id="sql", **card, parent="tiny", root=path)]

    prompts = ["def add(a, b):", "import os"]
    body = dict(prompt=prompts, temperature=0, max_tokens=8, return_token_ids=True)
    got = {}
    for name in ("tiny", "sql"):
        answer = ok(srv, "/v1/completions", dict(body, model=name))
        assert answer["model"] == name
        got[name] = [c["token_ids"] for c in answer["choices"]]
    sp = SamplingParams(temperature=0, max_tokens=8)
    ref = LoRARequest("sql-ref", 99, path)  # the same adapter, read again
    want = srv.engine.call(lambda llm: llm.generate(prompts, sp, lora_request=ref))
    assert got["sql"] == [o.outputs[0].token_ids for o in want] != got["tiny"]
    assert ok(srv, "/tokenize", dict(prompt="a", model="sql"))["count"] >= 1

    # Unloaded: no longer listed nor held, and naming it is a 404.
    first = srv.loras["sql"].lora_int_id
    assert first in served(srv)[1]
    status, text = request(srv, UNLOAD, dict(lora_name="sql"))
    assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    ids, held = served(srv)
    assert ids == ["tiny"] and srv.loras == {} and first not in held
    status, err = request(srv, "/v1/completions", dict(body, model="sql"))
    assert status == 404 and err["error"]["code"] == "model_not_found", err

    # Loaded again: a new id (prefix-cache pages of the old one are never hit), same text.
    assert request(srv, LOAD, dict(lora_name="sql", lora_path=path))[0] == 200
    assert srv.loras["sql"].lora_int_id > first and srv.loras["sql"].lora_int_id != ref.lora_int_id
    answer = ok(srv, "/v1/completions", dict(body, model="sql"))
    assert [c["token_ids"] for c in answer["choices"]] == got["sql"]
    # ... and unloaded by vLLM's lora_int_id.
    i = srv.loras["sql"].lora_int_id
    assert request(srv, UNLOAD, dict(lora_int_id=i))[0] == 200 and "sql" not in srv.loras


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        (LOAD, dict(lora_name="terse"), 400, "Both 'lora_name' and 'lora_path' must be"),
        (LOAD, dict(lora_name="", lora_path="DIR/terse"), 400, "lora_name=''"),
        (LOAD, dict(lora_name="x", lora_path=3), 400, "lora_path=3"),
        (LOAD, dict(lora_name="tiny", lora_path="DIR/terse"), 400, "'tiny' is the served model"),
        (
            LOAD,
            dict(lora_name="terse", lora_path="DIR"),
            400,
            "no adapter_config.json in LoRA adapter directory DIR",
        ),
        (LOAD, dict(lora_name="x", lora_path="DIR/nope"), 400, "'DIR/nope' does not exist"),
        (LOAD, dict(lora_name="x", lora_path="DIR/wide"), 400, "rank 8 > max_lora_rank=4"),
        (UNLOAD, dict(lora_name="nope"), 404, "The lora adapter 'nope' cannot be found."),
        (UNLOAD, dict(lora_int_id=77), 404, "lora_int_id 77 cannot be found"),
        (UNLOAD, dict(lora_int_id="1"), 400, "lora_int_id must be an int"),
        (UNLOAD, {}, 400, "either 'lora_name' or 'lora_int_id' must be provided"),
    ],
)
def test_a_bad_load_or_unload_changes_nothing(srv, adapters, path, body, status, words):
    assert request(srv, LOAD, dict(lora_name="keep", lora_path=str(adapters / "terse")))[0] == 200
    try:
        before = served(srv)
        body = {
            k: v.replace("DIR", str(adapters)) if isinstance(v, str) else v for k, v in body.items()
        }
        got, err = request(srv, path, body)
        assert got == status and words.replace("DIR", str(adapters)) in str(err), err
        assert served(srv) == before
    finally:
        assert request(srv, UNLOAD, dict(lora_name="keep"))[0] == 200


def test_a_second_load_of_a_name_is_a_400(srv, adapters):
    body = dict(lora_name="terse", lora_path=str(adapters / "terse"))
    assert request(srv, LOAD, body)[0] == 200
    try:
        before = served(srv)
        for other in ("terse", "sql"):  # the same adapter or another
            status, err = request(srv, LOAD, dict(body, lora_path=str(adapters / other)))
            assert status == 400, err
            assert err["error"]["message"] == "The lora adapter 'terse' has already been loaded."
        assert served(srv) == before
        status, err = request(
            srv, UNLOAD, dict(lora_name="sql", lora_int_id=srv.loras["terse"].lora_int_id)
        )
        assert status == 400 and "is the lora adapter 'terse', not lora_name 'sql'" in str(err)
    finally:
        assert request(srv, UNLOAD, dict(lora_name="terse"))[0] == 200


class SlowSink:
    """A sink whose token events each hold the engine thread up to 50 ms until `release`,
    so that its request stays running while a test sends an unload."""

    def __init__(self):
        self.events, self.release = queue.SimpleQueue(), threading.Event()

    def put(self, event):
        self.events.put(event)
        if event[0] == "token":
            self.release.wait(0.05)


def test_an_adapter_in_use_is_not_unloaded(srv, adapters, tok):
    assert request(srv, LOAD, dict(lora_name="busy", lora_path=str(adapters / "sql")))[0] == 200
    sink = SlowSink()
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    ids = tok.encode("def f():")
    srv.lora_names.submit(srv.engine, [("busy-0", ids, sp, 0)], sink, tokens=True, name="busy")
    assert sink.events.get(timeout=60)[0] == "token"  # running
    try:
        status, err = request(srv, UNLOAD, dict(lora_name="busy"))
        assert status == 400, err
        assert "'busy' is in use by a queued or running request" in err["error"]["message"]
        assert "busy" in served(srv)[0]
    finally:
        sink.release.set()
    while (event := sink.events.get(timeout=60))[0] == "token":
        pass
    assert event[0] == "done" and len(event[2].outputs[0].token_ids) == 200
    assert request(srv, UNLOAD, dict(lora_name="busy"))[0] == 200
    with pytest.raises(KeyError):  # a request naming it after the unload (404 from the server)
        srv.lora_names.submit(srv.engine, [("late", ids, sp, 0)], sink, tokens=False, name="busy")


def test_without_the_flag_the_paths_are_unknown(srv):
    assert request(srv, LOAD, None, method="GET")[0] == 405  # (with it: POST only)
    bare = serve.Server(("127.0.0.1", 0), model_name="m", quiet=True)
    thread = threading.Thread(target=bare.serve_forever, daemon=True)
    thread.start()
    try:
        for path in (LOAD, UNLOAD):
            status, err = request(bare, path, dict(lora_name="x", lora_path="/x"))
            assert status == 404 and f"no such path {path!r}" in err["error"]["message"]
            assert "lora_adapter" not in err["error"]["message"].split("; try ")[1]
    finally:
        bare.shutdown()
        bare.close()
        thread.join(10)
    runtime = serve.Server(
        ("127.0.0.1", 0), model_name="m", quiet=True, allow_runtime_lora_updating=True
    )
    with pytest.raises(ValueError, match="runtime LoRA updating needs an engine with LoRA"):
        runtime.start(types.SimpleNamespace(lora=None))
    runtime.close()


class Stop(Exception):
    """Raised in place of loading the weights."""


@pytest.mark.parametrize(
    "flag, env, allowed",
    [
        (True, None, True),
        (False, " True ", True),
        (False, "1", True),
        (False, "0", False),
        (False, "yes", False),  # (vLLM reads only 1 and true)
        (False, None, False),
    ],
)
def test_the_cli_flag_or_vllms_variable_enables_it(ckpt, monkeypatch, flag, env, allowed):
    seen = {}

    class Recording(serve.Server):
        def __init__(self, *a, **k):
            seen["server"] = k
            super().__init__(*a, **k)

    def fake_llm(*a, **k):
        seen["llm"] = k
        raise Stop

    monkeypatch.setattr(serve, "Server", Recording)
    monkeypatch.setattr("pagedjax.engine.LLM", fake_llm)
    if env is None:
        monkeypatch.delenv(serve.RUNTIME_LORA_ENV, raising=False)
    else:
        monkeypatch.setenv(serve.RUNTIME_LORA_ENV, env)
    argv = ["--checkpoint", str(ckpt), "--port", "0", "--quiet", "--compilation-cache", "off"]
    argv += ["--allow-runtime-lora-updating"] * flag
    if allowed:
        argv += ["--max-loras", "2"]  # (without --lora-modules: a bad flag unless allowed)
    with pytest.raises(Stop):
        serve.main(argv)
    assert seen["server"]["allow_runtime_lora_updating"] is allowed
    assert seen["server"]["lora_modules"] == []
    assert seen["llm"]["enable_lora"] is allowed
    if allowed:
        assert seen["llm"]["max_loras"] == 2
