"""The command-line scripts' bad input and interrupts (review 29): a user error is a usage
line and status 2, not a traceback; Ctrl-C while serve.py loads is status 130, one line;
a byte order mark does not reach chat.py's first message.

scripts/bench_guided.py checked none of its flags (`--repeats 0`, `--requests 0` and a
`--vocab` below the synthetic tokenizer's 256 single bytes ended in tracebacks, `--walks
0` measured nothing and reported 0 ms); scripts/bench_lora.py let `--seed -1` through to
the engine's ValueError traceback, after building the model.
"""

import importlib.util
import io
import sys
from pathlib import Path

import pytest
from generate_cli_helpers import load_script
from params_helpers import write_tiny_checkpoint

from pagedjax.engine import LLM
from pagedjax.tokenizer import Tokenizer

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
GEOMETRY = ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]


def load(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"{name}_review29", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec.loader.exec_module(module)
    return module


def usage_error(run, argv, capsys) -> str:
    """Runs a script's parser expected to reject argv; returns its last stderr line."""
    with pytest.raises(SystemExit) as info:
        run(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--walks", "0"], "--walks must be >= 1, got 0"),
        (["--requests", "0"], "--requests must be >= 1, got 0"),
        (["--vocab", "100"], "--vocab must be >= 256 (the single bytes), got 100"),
    ],
)
def test_bench_guided_refuses_bad_flags_before_measuring(argv, words, monkeypatch, capsys):
    guided = load("bench_guided", monkeypatch)
    monkeypatch.setattr(guided, "bench_masks", lambda args: pytest.fail("it ran"))
    err = usage_error(guided.main, argv, capsys)
    assert "error: " in err and words in err, err


def test_bench_lora_refuses_a_negative_seed_before_building_the_model(monkeypatch, capsys):
    bench = load("bench_lora", monkeypatch)
    err = usage_error(bench.parse_args, ["--seed", "-1"], capsys)
    assert "--seed must be >= 0, got -1" in err, err


def test_ctrl_c_while_serve_loads_the_model_is_one_line_and_130(monkeypatch, capsys):
    """A Ctrl-C while the weights load (minutes for a large checkpoint) ended serve.py in
    a KeyboardInterrupt traceback; generate.py and chat.py end with status 130."""
    serve = load_script("serve")

    def loading(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pagedjax.engine.LLM", loading)
    closed, close = [], serve.Server.close

    def closing(srv):
        closed.append(srv)
        close(srv)

    monkeypatch.setattr(serve.Server, "close", closing)
    argv = ["--port", "0", "--quiet", "--backend", "xla", "--compilation-cache", "off"]
    assert serve.main(argv) == 130
    out, err = capsys.readouterr()
    assert err.strip() == "interrupted" and out == "", err
    (srv,) = closed
    assert srv.socket.fileno() == -1  # the socket it had bound is closed


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_chat_ckpt_review29")
    write_tiny_checkpoint(path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return path


def test_a_byte_order_mark_does_not_start_the_first_chat_message(chat_ckpt, monkeypatch, capsys):
    """`chat.py < messages.txt` with a file a Windows editor saved: the BOM (U+FEFF, not
    whitespace to `str.strip`) was sent as the start of the first user message, as
    generate.py's --prompts-file does not do."""
    sent = []
    generate = LLM.generate

    def spy(self, prompts, *args, **kwargs):
        sent.extend(prompts)
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    data = "\ufeffhi\n".encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    chat = load_script("chat")
    argv = ["--checkpoint", chat_ckpt, "--backend", "xla", *GEOMETRY, "--temperature", "0"]
    rc = chat.main([str(a) for a in [*argv, "--max-tokens", "2"]])
    assert rc == 0, capsys.readouterr().err
    tok = Tokenizer.from_dir(chat_ckpt)
    assert sent == [tok.encode_chat([{"role": "user", "content": "hi"}])]
