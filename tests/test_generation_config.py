"""Sampling defaults from a checkpoint's generation_config.json, as vLLM applies them.

The reader (`resources.generation_config_defaults`), `LLM(generation_config=)` and
`default_sampling_params()`, the OpenAI API's fields left out, and the scripts'
flags left out (generate.py, chat.py, serve.py). The checkpoint is the tiny random one
of tests/test_generate_cli.py, with a Llama-3.1-Instruct-like generation_config.json;
nothing here runs an engine step.
"""

import importlib.util
import io
import json
import types
from pathlib import Path

import pytest
from params_helpers import capture_engine, write_tiny_checkpoint

from pagedjax import demo
from pagedjax import openai_api as api
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams
from pagedjax.resources import byte_tokenizer, checkpoint_dir, generation_config_defaults

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
# Llama-3.1-8B-Instruct's generation_config.json, with the tiny model's token ids.
LLAMA31 = dict(bos_token_id=1, do_sample=True, eos_token_id=2, temperature=0.6, top_p=0.9)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"{name}_gc", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen, chat_cli, serve = (load_script(n) for n in ("generate", "chat", "serve"))
cli = gen.cli  # the scripts' shared module, as they import it


def write_generation_config(path: Path, cfg: dict) -> Path:
    (path / "generation_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gc_ckpt")
    write_tiny_checkpoint(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return write_generation_config(path, LLAMA31)


def engine(path, **kwargs):
    return LLM(str(path), page_size=8, num_pages=64, backend="xla", **kwargs)


# ------------------------------------------------------------------------- reader


def test_reads_the_keys_vllm_reads_and_ignores_do_sample(tmp_path):
    assert generation_config_defaults(write_generation_config(tmp_path, LLAMA31)) == dict(
        temperature=0.6, top_p=0.9
    )
    cfg = dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.05)
    cfg |= dict(max_new_tokens=300, do_sample=False, max_length=20, typical_p=0.5)
    got = generation_config_defaults(write_generation_config(tmp_path, cfg))
    assert got == dict(
        temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.05, max_tokens=300
    )
    # -1 is HF's and vLLM's "top_k off"; null is no value
    got = generation_config_defaults(write_generation_config(tmp_path, dict(top_k=-1, top_p=None)))
    assert got == dict(top_k=0)


def test_no_file_no_keys_and_the_demo_model_give_no_defaults(tmp_path):
    assert generation_config_defaults(tmp_path) == {}
    assert generation_config_defaults(write_generation_config(tmp_path, {"do_sample": True})) == {}
    assert checkpoint_dir(None) == demo.demo_model_dir()
    assert generation_config_defaults(demo.demo_model_dir()) == {}  # do_sample false only
    assert checkpoint_dir(PRESETS["tiny"]) is None and checkpoint_dir("x") == Path("x")


@pytest.mark.parametrize(
    "key, value",
    [
        ("temperature", -0.5),
        ("temperature", True),
        ("top_p", 0),
        ("top_k", 2.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("max_new_tokens", 0),
        ("temperature", "0.6"),
    ],
)
def test_a_bad_value_names_the_file_key_and_value(tmp_path, key, value):
    write_generation_config(tmp_path, {key: value})
    with pytest.raises(ValueError) as e:
        generation_config_defaults(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "generation_config.json") in msg and f"{key}={value!r}" in msg, msg


# ------------------------------------------------------------------------- engine


def test_llm_takes_the_checkpoints_defaults(ckpt):
    llm = engine(ckpt)
    assert llm.sampling_defaults == dict(temperature=0.6, top_p=0.9)
    assert llm.default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9)
    assert engine(ckpt, generation_config="none").sampling_defaults == {}
    assert engine(ckpt, generation_config="none").default_sampling_params() == SamplingParams()
    assert LLM(PRESETS["tiny"], num_pages=8, backend="xla").sampling_defaults == {}


def test_llm_refuses_a_bad_choice_or_file_before_loading(ckpt, tmp_path, monkeypatch):
    from pagedjax import engine as engine_mod

    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="generation_config must be 'auto' or 'none'"):
        engine(ckpt, generation_config="vllm")
    write_generation_config(tmp_path, {"top_p": 2})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p=2 "):
        engine(tmp_path)


def test_generate_chat_and_add_request_use_the_defaults_given_no_params(ckpt, monkeypatch):
    """The params each request is queued with (the spy refuses it: nothing runs)."""
    llm = engine(ckpt)
    queued = []

    def refuse(self, text, ids, params, request_id, priority=0, lora_request=None):
        queued.append(params)
        raise ValueError("stop here")

    want = SamplingParams(temperature=0.6, top_p=0.9)
    rid = llm.add_request([1, 5, 7])
    assert llm.scheduler.get(rid).request.params == want
    llm.abort(rid)
    monkeypatch.setattr(LLM, "_add", refuse)
    for call in (
        lambda: llm.generate([[1, 5, 7]]),
        lambda: llm.chat([{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(ValueError, match="stop here"):
            call()
    assert queued == [want, want]
    given = SamplingParams(max_tokens=3)
    with pytest.raises(ValueError):
        llm.generate([[1, 5, 7]], given)
    assert queued[-1] is given  # params given are used as they are


# --------------------------------------------------------------------- OpenAI API


def parse(body, *, chat=False, defaults=None):
    return api.parse_job(
        body,
        chat=chat,
        model_name="m",
        tokenizer=byte_tokenizer().with_chat_template(TEMPLATE, "t") if chat else byte_tokenizer(),
        vocab_size=256,
        max_model_len=64,
        defaults=defaults,
    ).params


def fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "min_p")} | dict(
        repetition_penalty=p.repetition_penalty
    )


def test_api_fields_left_out_take_the_defaults():
    d = dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.1)
    for chat in (False, True):
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        assert fields(parse(body, chat=chat, defaults=d)) == d
        given = dict(temperature=0, top_p=1, top_k=-1, min_p=None, repetition_penalty=1)
        p = parse({**body, **given}, chat=chat, defaults=d)  # null is left out, as in vLLM
        assert fields(p) == dict(temperature=0, top_p=1, top_k=0, min_p=0.1, repetition_penalty=1)
        p = parse(body, chat=chat)  # no defaults: OpenAI's
        assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


def test_api_max_new_tokens_caps_a_left_out_max_tokens_default():
    """As vLLM: completions min(16, max_new_tokens), chat min(room, max_new_tokens); a
    max_tokens given is used as given."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    room = 64 - len(
        byte_tokenizer().with_chat_template(TEMPLATE, "t").encode_chat(chat["messages"])
    )
    assert parse({"prompt": "hi"}, defaults=dict(max_tokens=5)).max_tokens == 5
    assert parse({"prompt": "hi"}, defaults=dict(max_tokens=50)).max_tokens == 16
    assert parse({"prompt": "hi", "max_tokens": 30}, defaults=dict(max_tokens=5)).max_tokens == 30
    assert parse(chat, chat=True, defaults=dict(max_tokens=5)).max_tokens == 5
    assert parse(chat, chat=True, defaults=dict(max_tokens=500)).max_tokens == room
    assert parse(chat, chat=True).max_tokens == room


def test_serve_passes_the_engines_defaults_to_requests(ckpt):
    args = serve.build_parser().parse_args([])
    assert args.generation_config == "auto"
    srv = serve.Server(("127.0.0.1", 0), model_name="m", quiet=True)
    try:
        srv.start(engine(ckpt))
        handler = types.SimpleNamespace(server=srv)
        job = serve.Handler._job(handler, "/v1/completions", {"prompt": "hi"})
        assert (job.params.temperature, job.params.top_p) == (0.6, 0.9)
        job = serve.Handler._job(handler, "/v1/completions", {"prompt": "hi", "temperature": 0})
        assert (job.params.temperature, job.params.top_p) == (0, 0.9)
    finally:
        srv.close()


def test_serve_flag_reaches_the_engine_and_is_said(ckpt, capsys, monkeypatch):
    seen = {}
    init = LLM.__init__

    def spy_init(self, *args, **kwargs):
        seen.update(kwargs)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", spy_init)
    monkeypatch.setattr(serve.Server, "serve_forever", lambda self: None)
    argv = ["--checkpoint", str(ckpt), "--port", "0", "--backend", "xla", *GEOMETRY]
    assert serve.main(argv) == 0
    err = capsys.readouterr().err
    assert seen["generation_config"] == "auto"
    assert "generation_config.json: temperature=0.6, top_p=0.9" in err, err
    assert serve.main([*argv, "--generation-config", "none"]) == 0
    assert seen["generation_config"] == "none"
    assert "sampling defaults" not in capsys.readouterr().err


# ------------------------------------------------------------------------ scripts


def run_generate(argv, capsys):
    rc = gen.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def base(ckpt):
    return ["--checkpoint", ckpt, "--prompt", "hi", "--backend", "xla", *GEOMETRY]


def test_generate_flags_left_out_take_the_generation_config(ckpt, capsys, monkeypatch):
    seen = capture_engine(monkeypatch)
    rc, _, err = run_generate(base(ckpt), capsys)
    assert rc == 130, err
    assert (seen["sp"].temperature, seen["sp"].top_p, seen["sp"].max_tokens) == (0.6, 0.9, 64)
    assert seen["init"]["generation_config"] == "auto"
    note = [line for line in err.splitlines() if "sampling defaults" in line]
    assert note == [
        f"note: sampling defaults from {ckpt / 'generation_config.json'}: temperature=0.6, "
        "top_p=0.9 (flags override them; --generation-config none ignores the file)"
    ]
    rc, _, err = run_generate([*base(ckpt), "--temperature", "0", "--max-tokens", "5"], capsys)
    assert (seen["sp"].temperature, seen["sp"].top_p, seen["sp"].max_tokens) == (0, 0.9, 5)
    assert "sampling defaults from" in err and "temperature" not in err.split("from")[1]
    rc, _, err = run_generate([*base(ckpt), "--generation-config", "none"], capsys)
    assert (seen["sp"].temperature, seen["sp"].top_p) == (0, 1.0)  # generate.py's: greedy
    assert seen["init"]["generation_config"] == "none" and "sampling defaults" not in err


def test_generate_max_new_tokens_is_the_max_tokens_default(ckpt, tmp_path, capsys, monkeypatch):
    write_tiny_checkpoint(tmp_path)
    write_generation_config(tmp_path, dict(max_new_tokens=7, top_k=3))
    seen = capture_engine(monkeypatch)
    rc, _, err = run_generate(base(tmp_path), capsys)
    sp = seen["sp"]
    assert rc == 130 and (sp.max_tokens, sp.top_k, sp.temperature) == (7, 3, 0)
    assert "top_k=3, max_new_tokens=7" in err, err


def test_beam_search_is_not_refused_for_the_files_temperature(ckpt, capsys, monkeypatch):
    seen = capture_engine(monkeypatch)
    rc, _, err = run_generate([*base(ckpt), "--beam-width", "2"], capsys)
    assert rc == 130, err
    sp = seen["sp"]
    assert sp.beam_width == 2 and (sp.temperature, sp.top_p) == (0, 1.0)
    assert "sampling defaults" not in err
    rc, _, err = run_generate([*base(ckpt), "--beam-width", "2", "--temperature", "0.5"], capsys)
    assert rc == 2 and "beam search does not sample" in err  # a flag given still conflicts


def test_a_bad_generation_config_is_bad_input_before_loading(tmp_path, capsys, monkeypatch):
    write_tiny_checkpoint(tmp_path)
    write_generation_config(tmp_path, dict(temperature=-1))

    class Loading(Exception):
        pass

    def load(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(LLM, "__init__", load)
    rc, out, err = run_generate(base(tmp_path), capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "generation_config.json: temperature=-1 is not a valid temperature" in err
    with pytest.raises(Loading):  # with none, the file is not read
        run_generate([*base(tmp_path), "--generation-config", "none"], capsys)


def test_the_demo_model_gives_no_defaults():
    """So the demo's outputs stay greedy."""
    args = gen.build_parser().parse_args([])
    assert cli.generation_defaults(args) == {}
    assert cli.sampling_kwargs(args, cli.generation_defaults(args))["temperature"] == 0.0


def test_chat_flags_left_out_take_the_generation_config(ckpt, capsys, monkeypatch):
    seen = capture_engine(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    argv = ["--checkpoint", str(ckpt), "--backend", "xla", *GEOMETRY]
    assert chat_cli.main(argv) == 0
    err = capsys.readouterr().err
    sp = seen["sp"]
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.seed) == (0.6, 0.9, 256, 0)
    assert seen["init"]["generation_config"] == "auto"
    assert "sampling defaults from" in err and "temperature=0.6, top_p=0.9" in err, err
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert chat_cli.main([*argv, "--generation-config", "none", "--top-p", "0.5"]) == 0
    assert (seen["sp"].temperature, seen["sp"].top_p) == (0.7, 0.5)  # chat.py's own 0.7
    assert "sampling defaults" not in capsys.readouterr().err
