"""scripts/generate.py and scripts/chat.py with `--lora PATH`: every prompt runs with the
adapter, as `LLM(enable_lora=True).generate(..., lora_request=...)` runs it (and not as
the base model does); a path that is no directory is refused before the model loads,
an adapter the engine refuses right after it, each as one line and status 2.
"""

import io
import json

import generate_cli_helpers
import numpy as np
import pytest
from generate_cli_helpers import GEOMETRY, run
from lora_helpers import write_peft

from pagedjax import lora
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams

ckpt = generate_cli_helpers.ckpt  # bound here: this module gets its own checkpoint
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


chat_cli = generate_cli_helpers.load_script("chat")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    path = tmp_path_factory.mktemp("adapters") / "sql"
    write_peft(path, PRESETS["tiny"], rank=4, alpha=8, seed=21)
    return path


@pytest.fixture(scope="module")
def ref(ckpt):
    """An engine as the CLI builds it with --lora (so they share compiled programs)."""
    return LLM(
        str(ckpt),
        page_size=8,
        num_pages=64,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        backend="xla",
        enable_lora=True,
    )


def test_every_prompt_runs_with_the_adapter(ckpt, adapter, ref, capsys):
    prompts = ["def f(x):", "import os"]
    argv = ["--checkpoint", ckpt, "--lora", adapter, "--max-tokens", "8", "--json"]
    argv += ["--backend", "xla", *GEOMETRY, "--prompt", prompts[0], "--prompt", prompts[1]]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    assert f"with LoRA adapter {adapter}" in err  # the model line (on stderr with --json)
    obj = json.loads(out)
    assert obj["settings"]["lora"] == str(adapter)
    got = [o["completions"][0]["token_ids"] for o in obj["outputs"]]
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    req = lora.LoRARequest("sql", 1, str(adapter))
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, lora_request=req)]
    base = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    assert got == want and got != base


def test_chat_replies_with_the_adapter(ckpt, adapter, ref, tmp_path, capsys, monkeypatch):
    """chat.py shares the flags; each reply runs with the adapter."""
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    sent = []
    generate = LLM.generate

    def spy(self, prompts, *args, **kwargs):
        sent.append((prompts, kwargs["lora_request"]))
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\n"))
    argv = ["--checkpoint", ckpt, "--chat-template", template, "--lora", adapter]
    argv += ["--temperature", "0", "--max-tokens", "6", "--backend", "xla", *GEOMETRY]
    assert chat_cli.main([str(a) for a in argv]) == 0
    out, err = capsys.readouterr()
    assert f"with LoRA adapter {adapter}" in err
    ((prompts, req),) = sent
    assert req == lora.LoRARequest("sql", 1, str(adapter))
    monkeypatch.undo()
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    (want,) = ref.generate(prompts, sp, lora_request=req)
    assert out == want.outputs[0].text + "\n"


def test_a_missing_adapter_is_refused_before_the_model_loads(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    for extra, words in (
        (["--lora", tmp_path / "nope"], f"--lora {tmp_path / 'nope'}: no such directory"),
        (["--max-lora-rank", "8"], "--max-lora-rank needs --lora"),
        (["--lora", tmp_path, "--max-lora-rank", "0"], "--max-lora-rank: must be >= 1, got 0"),
        (["--lora", tmp_path, "--max-lora-rank", "x"], "invalid int value: 'x'"),
    ):
        rc, out, err = run(["--checkpoint", ckpt, *extra], capsys)
        assert rc == 2 and out == "", err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize(
    "kind, words",
    [
        ("rank", "has rank 4 > max_lora_rank=2"),
        ("shape", "do not fit the model's q_proj"),
        ("dora", "use_dora=True is not supported"),
    ],
)
def test_an_adapter_the_engine_refuses_is_one_line(ckpt, tmp_path, capsys, kind, words):
    cfg, path = PRESETS["tiny"], tmp_path / kind
    if kind == "shape":  # q_proj's A one input short
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        write_peft(path, cfg, tensors={key: np.zeros((4, cfg.hidden_size - 1), np.float32)})
    else:
        write_peft(path, cfg, config={"use_dora": True} if kind == "dora" else None)
    argv = ["--checkpoint", ckpt, "--lora", path, "--max-lora-rank", "2" if kind == "rank" else 8]
    rc, out, err = run([*argv, "--backend", "xla", *GEOMETRY, "--prompt", "hi"], capsys)
    assert rc == 2 and out == "", err
    assert err.startswith("error: --lora: ") and err.count("\n") == 1 and words in err, err
