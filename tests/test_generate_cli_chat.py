"""scripts/generate.py --chat: prompts rendered with the checkpoint's chat template (or
--chat-template FILE's), the ids sent and the typed prompt shown, and the chat flags' bad
input refused before the weights load.

The checkpoint with a template is the demo model with one of ours (`chat_ckpt`); the
byte-tokenizer checkpoint without one is tests/generate_cli_helpers.py's `ckpt`.
"""

import json

import generate_cli_helpers
import pytest
from generate_cli_helpers import GEOMETRY, run
from params_helpers import spy_generate

ckpt = generate_cli_helpers.ckpt  # bound here: this module gets its own checkpoint

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|pad|>{{ m['role'] }}\n"
    "{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """The demo model with a chat template of ours (<|pad|> standing in for a header)."""
    from pagedjax.demo import DEMO_MODEL_DIR

    path = tmp_path_factory.mktemp("chat_ckpt")
    for f in DEMO_MODEL_DIR.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def test_chat_sends_the_rendered_ids_and_shows_the_prompt(chat_ckpt, capsys, monkeypatch):
    from pagedjax.tokenizer import Tokenizer

    sent = spy_generate(monkeypatch)
    prompts = ["def fib(n):", "import os"]
    argv = ["--checkpoint", chat_ckpt, "--chat", "--system", "Write Python.", "--max-tokens", "3"]
    argv += [
        "--json",
        "--backend",
        "xla",
        *GEOMETRY,
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
    ]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["settings"]["chat"] is True and obj["settings"]["system"] == "Write Python."
    tok = Tokenizer.from_dir(chat_ckpt)
    want = [
        tok.encode_chat(
            [{"role": "system", "content": "Write Python."}, {"role": "user", "content": p}]
        )
        for p in prompts
    ]
    assert sent == want and all(ids.count(1) == 1 and ids[0] == 1 for ids in want)  # one BOS
    assert [o["prompt"] for o in obj["outputs"]] == prompts  # the text typed, not the ids
    assert [o["prompt_tokens"] for o in obj["outputs"]] == [len(ids) for ids in want]
    assert all(1 <= len(o["completions"][0]["token_ids"]) <= 3 for o in obj["outputs"])

    # Streaming one prompt: the prompt, then the reply on its own line.
    argv = ["--checkpoint", chat_ckpt, "--chat", "--prompt", "x = 1", "--max-tokens", "3"]
    rc, out, err = run([*argv, "--backend", "xla", *GEOMETRY], capsys)
    assert rc == 0, err
    assert out.splitlines()[1] == "x = 1"  # the reply starts on the next line


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--system", "be brief"], "--system needs --chat"),
        # Refused before the prompts are read (stdin was read first, for nothing).
        (["--system", "x", "--prompts-file", "/nonexistent/p.txt"], "--system needs --chat"),
        (["--chat"], "has no chat template"),  # the byte-tokenizer checkpoint
        (["--chat", "--prompt", ""], "prompt 1: prompt is empty"),
    ],
)
def test_chat_bad_input_before_loading_weights(ckpt, chat_ckpt, capsys, monkeypatch, extra, match):
    from pagedjax.engine import LLM

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(LLM, "__init__", no_load)
    path = chat_ckpt if "" in extra else ckpt
    rc, out, err = run(["--checkpoint", path, "--prompt", "hi", *extra], capsys)
    assert rc == 2 and err.startswith("error: ") and match in err and err.count("\n") == 1, err


def test_chat_without_the_demo_template_or_jinja2(chat_ckpt, capsys, monkeypatch):
    from pagedjax.engine import LLM

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    rc, _, err = run(["--chat", "--prompt", "hi"], capsys)  # the demo model has no template
    assert rc == 2 and "has no chat template" in err and "drop --chat" in err, err

    real_import = __import__

    def no_jinja(name, *args, **kwargs):
        if name.startswith("jinja2"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", no_jinja)
    rc, _, err = run(["--checkpoint", chat_ckpt, "--chat", "--prompt", "hi"], capsys)
    assert rc == 2 and "pip install 'jinja2>=3.1'" in err and err.count("\n") == 1, err


def test_chat_template_file_replaces_the_checkpoints(chat_ckpt, tmp_path, capsys, monkeypatch):
    from pagedjax.tokenizer import Tokenizer

    sent = spy_generate(monkeypatch)
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}MARKER {{ m['content'] }}|{% endfor %}")
    argv = ["--checkpoint", chat_ckpt, "--chat", "--chat-template", f, "--prompt", "hi"]
    rc, out, err = run(
        [*argv, "--max-tokens", "2", "--json", "--backend", "xla", *GEOMETRY], capsys
    )
    assert rc == 0, err
    assert [Tokenizer.from_dir(chat_ckpt).decode(ids) for ids in sent] == ["MARKER hi|"]
    settings = json.loads(out)["settings"]
    assert settings["chat_template"] == str(f) and settings["chat"] is True


def test_chat_template_bad_input_before_loading_weights(ckpt, tmp_path, capsys, monkeypatch):
    from pagedjax.engine import LLM

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("ok\n{% for m in messages %}{{ m }")
    for extra, match in (
        (["--chat-template", broken], "--chat-template needs --chat"),
        (["--chat", "--chat-template", tmp_path / "no.jinja"], "no.jinja: no such file"),
        (["--chat", "--chat-template", broken], "broken.jinja) has a syntax error at line 2"),
    ):
        rc, out, err = run(["--checkpoint", ckpt, "--prompt", "hi", *extra], capsys)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert match in err and out == "", err
