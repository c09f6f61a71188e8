"""scripts/generate.py's bad input and failures: no traceback, one line on stderr and a
status that says which (2 bad input, 1 out of device memory, 130 interrupted, 141 a
closed pipe); bad input is refused before anything is printed, and before the weights
load where it can be checked without them.

Flags and prompts out of range, prompts files that hold none, broken checkpoints (HF and
orbax), Ctrl-C (also one that Python drops), running out of device memory, stdout closed
early, and a real subprocess. tests/generate_cli_helpers.py has the checkpoint and the
runner; tests/test_generate_cli.py checks what a good run prints.
"""

import contextlib
import io
import subprocess
import sys

import generate_cli_helpers
import pytest
from generate_cli_helpers import GEOMETRY, ROOT, SCRIPT, cli, gen, run

ckpt = generate_cli_helpers.ckpt  # bound here: this module gets its own checkpoint


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "x" * 600], "600 tokens"),
        (["--n", "0"], "n=0"),
        (["--top-p", "0"], "top_p=0.0"),
        (["--top-p", "1.5"], "top_p=1.5"),
        (["--min-p", "1.5"], "min_p must be in [0, 1] (0: off), got min_p=1.5"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--repetition-penalty", "0"], "got repetition_penalty=0.0"),
        (["--presence-penalty", "2.5"], "got presence_penalty=2.5"),
        (["--beam-width", "2", "--frequency-penalty", "1"], "not supported with beam search"),
        (["--min-tokens", "100"], "min_tokens=100, max_tokens=64"),
        (["--kv-cache-dtype", "int8"], "invalid choice: 'int8'"),
        (["--logit-bias", "{x"], "--logit-bias is not JSON"),
        (["--logit-bias", "[1]"], "--logit-bias must be a JSON object"),
        (["--logit-bias", '{"a": 1}'], "--logit-bias keys must be token ids, got 'a'"),
        (["--logit-bias", '{"1": 200}'], "got logit_bias[1]=200"),
        (["--logit-bias", '{"3": 1, "999": 1}'], "--logit-bias token ids [999] are outside"),
        (["--backend", "gpu"], "backend='gpu' needs a GPU"),
        (["--num-pages", "8", "--kv-memory-fraction", "0.5"], "not allowed with"),
        (["--kv-memory-fraction", "0"], "--kv-memory-fraction must be in (0, 1], got 0.0"),
        (["--beam-width", "2", "--temperature", "0.5"], "--temperature 0.5 with --beam-width 2"),
        (["--beam-width", "2", "--top-p", "0.5"], "top_p=0.5"),
        (["--max-tokens", "ten"], "invalid int value"),
        (["--max-model-len", "1"], "--max-model-len must be >= 2, got 1"),
        (["--max-model-len", "600"], "max_model_len must be an int in [2, 512]"),
        (["--max-model-len", "8", "--prompt", "x" * 10], "max_model_len=8"),
    ],
)
def test_bad_input_is_one_line(ckpt, capsys, extra, match):
    """Nothing on stdout: a logit bias past the vocabulary printed the model line first."""
    rc, out, err = run(["--checkpoint", ckpt, *extra], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert out == ""


def test_a_prompt_too_long_is_refused_before_anything_is_printed(ckpt, capsys):
    argv = ["--checkpoint", ckpt, "--prompt", "x" * 600, "--backend", "xla", *GEOMETRY]
    rc, out, err = run(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and "prompt 0: prompt has 600 tokens" in err, err
    assert out == ""  # not the model line and the prompt, as if it streamed


def test_more_sequences_than_the_engine_runs_is_refused_before_loading(ckpt, capsys, monkeypatch):
    """--n or --beam-width past max_num_seqs was refused by LLM.generate: after the weights
    loaded and the model line was printed, in the engine's words ("prompt 0: request ...")."""
    from pagedjax.engine import LLM

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    base = ["--checkpoint", ckpt, "--prompt", "hi", "--backend", "xla", *GEOMETRY]  # 16 seqs
    for extra, match in (
        (["--n", "17", "--temperature", "0.5"], "--n 17: at most 16 sequences"),
        (["--beam-width", "17"], "--beam-width 17: at most 16 sequences"),
    ):
        rc, out, err = run([*base, *extra], capsys)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert match in err and "--max-batch-tokens" in err and out == "", err


def test_kv_memory_fraction_one_is_allowed():
    """(0, 1]: all the free memory is a valid choice, past it is not."""
    parse = gen.build_parser().parse_args
    cli.check_engine_flags(parse(["--kv-memory-fraction", "1"]))
    with pytest.raises(cli.BadInput, match=r"must be in \(0, 1\], got 1.01"):
        cli.check_engine_flags(parse(["--kv-memory-fraction", "1.01"]))


@pytest.mark.parametrize(
    "flag", ["--page-size", "--num-pages", "--max-batch-tokens", "--tensor-parallel"]
)
def test_engine_sizes_below_one_are_refused_before_loading(ckpt, capsys, monkeypatch, flag):
    from pagedjax.engine import LLM

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    rc, out, err = run(["--checkpoint", ckpt, "--prompt", "hi", flag, "0"], capsys)
    assert rc == 2 and err == f"error: {flag} must be >= 1, got 0\n" and out == "", err


def test_prompts_files_without_prompts_or_unreadable_are_bad_input(ckpt, tmp_path, capsys):
    for name, data in (("empty.txt", b""), ("blank.txt", b"\n  \n"), ("latin1.txt", b"caf\xe9\n")):
        f = tmp_path / name
        f.write_bytes(data)
        rc, out, err = run(["--checkpoint", ckpt, "--prompts-file", f], capsys)
        assert rc == 2 and err.count("\n") == 1 and str(f) in err, (name, err)
        assert ("no prompts" in err) == (name != "latin1.txt"), err
        assert "Traceback" not in err + out


def test_bad_checkpoints(ckpt, tmp_path, capsys):
    rc, _, err = run(["--checkpoint", tmp_path / "nope"], capsys)
    assert rc == 2 and "not found" in err and err.count("\n") == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((ckpt / "config.json").read_text())
    (broken / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text())
    rc, _, err = run(["--checkpoint", broken], capsys)
    assert rc == 2 and "safetensors" in err and err.count("\n") == 1, err
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).write_bytes((ckpt / name).read_bytes())
    rc, _, err = run(["--checkpoint", no_tok], capsys)
    assert rc == 2 and "tokenizer.json" in err and err.count("\n") == 1
    # A tokenizer.json the tokenizers library cannot read was a traceback (status 1),
    # after the weights had loaded; it is read first now.
    (no_tok / "tokenizer.json").write_text("{bad")
    rc, out, err = run(["--checkpoint", no_tok, "--prompt", "hi", "--backend", "xla"], capsys)
    assert rc == 2 and "tokenizer.json is not a valid tokenizer file" in err, err
    assert err.count("\n") == 1 and out == ""


@pytest.mark.parametrize(
    "meta, match",
    [
        ("{bad", "pagedjax_checkpoint.json is not valid JSON"),
        ("[1]", "pagedjax_checkpoint.json must hold a JSON object, got a list"),
        ('{"format": "pagedjax.orbax", "version": 1}', 'has no "config" object'),
        (
            '{"format": "pagedjax.orbax", "version": 1, "config": {"num_layers": 1}}',
            "pagedjax_checkpoint.json: bad config: ",
        ),
        ('{"format": "pagedjax.orbax", "version": 2, "config": {}}', "unsupported format"),
        (
            '{"format": "pagedjax.orbax", "version": 1, "config": {"num_layers": 1, "x": 0}}',
            "bad config: unknown ModelConfig fields ['x'] in the stored config",
        ),
    ],
)
def test_a_broken_orbax_checkpoint_file_is_named(ckpt, tmp_path, capsys, meta, match):
    """A pagedjax_checkpoint.json that is not JSON said only "Expecting property name ...",
    and one without a config object (or not an object) ended in a KeyError or
    AttributeError traceback."""
    (tmp_path / "params").mkdir()
    (tmp_path / "pagedjax_checkpoint.json").write_text(meta)
    (tmp_path / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text())
    rc, out, err = run(["--checkpoint", tmp_path, "--prompt", "hi", "--backend", "xla"], capsys)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert match in err and out == "", err


def test_ctrl_c_ends_with_one_line_and_status_130(ckpt, capsys, monkeypatch):
    """A Ctrl-C mid-generation printed a KeyboardInterrupt traceback."""
    from pagedjax.engine import LLM

    def interrupted(self, *args, use_tqdm=False, **kwargs):
        use_tqdm(total=1)  # the requests are queued (the script prints the prompt then)
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "generate", interrupted)
    try:
        rc, out, err = run(["--checkpoint", ckpt, "--prompt", "class A:", *GEOMETRY], capsys)
    except KeyboardInterrupt:  # (caught here, or it would stop the whole test session)
        pytest.fail("main let the KeyboardInterrupt through: a traceback")
    assert rc == 130 and err.strip() == "interrupted", err
    assert out == f"model: checkpoint {ckpt}\nclass A:"  # what streamed before stays


def test_a_ctrl_c_that_python_drops_still_stops_the_run(ckpt, capsys, monkeypatch):
    """Python drops a KeyboardInterrupt raised in a gc callback ("Exception ignored in
    _xla_gc_callback"): a Ctrl-C that landed in jax's went unheeded, the run completed
    with status 0. It is latched and stops the next engine step."""
    import signal

    from pagedjax.engine import LLM

    generate, steps = LLM.generate, []

    def ctrl_c_in_a_gc_callback(self, *args, on_step=None, **kwargs):
        def step(llm):
            steps.append(1)
            if on_step is not None:
                on_step(llm)

        # As Python runs a gc callback: an exception in it is reported and dropped.
        with contextlib.suppress(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        return generate(self, *args, on_step=step, **kwargs)

    monkeypatch.setattr(LLM, "generate", ctrl_c_in_a_gc_callback)
    argv = ["--checkpoint", ckpt, "--prompt", "class A:", "--max-tokens", "8", *GEOMETRY]
    # Python's own handler, as an interactive run has it: a shell starts a background
    # job with SIGINT ignored, and the script then rightly installs none.
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc, out, err = run([*argv, "--backend", "xla"], capsys)
    except KeyboardInterrupt:
        pytest.fail("main let the KeyboardInterrupt through: a traceback")
    finally:
        handler = signal.signal(signal.SIGINT, was)
    assert rc == 130 and err.strip() == "interrupted", err
    assert len(steps) == 1  # stopped at the first step, not at the end
    assert handler is signal.default_int_handler  # restored


def test_running_out_of_device_memory_is_one_line(ckpt, capsys, monkeypatch):
    """A --num-pages too many for the device ended in a JaxRuntimeError traceback
    (RESOURCE_EXHAUSTED: Out of memory allocating ... bytes)."""
    import jax

    from pagedjax import sharding

    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory allocating 204800000000 bytes."
        )

    monkeypatch.setattr(sharding, "create_cache", oom)
    argv = ["--checkpoint", ckpt, "--prompt", "x", "--backend", "xla", *GEOMETRY]
    rc, out, err = run(argv, capsys)
    assert rc == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: out of device memory (RESOURCE_EXHAUSTED: Out of memory ")
    assert "--num-pages" in err


def test_stdout_closed_early_is_no_traceback(ckpt, capsys, monkeypatch):
    """`generate.py ... | head -1`: the BrokenPipeError was a traceback."""

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    argv = ["--checkpoint", ckpt, "--prompt", "x", "--prompt", "y", "--max-tokens", "2"]
    assert gen.main([str(a) for a in argv] + ["--backend", "xla", *GEOMETRY]) == 141


def test_subprocess_exits_with_one_line():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "gpu", "--prompt", "hi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_prompts_file_that_is_not_utf8_names_the_line(ckpt, tmp_path, capsys, monkeypatch):
    """The error said only "'utf-8' codec can't decode byte 0xe9 in position 9": which of
    many lines was not said."""
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"a\nb\ncaf\xe9\n")
    rc, out, err = run(["--checkpoint", ckpt, "--prompts-file", f], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert f"prompts file {f} line 3 is not UTF-8 text" in err and "0xe9" in err, err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\n"), encoding="utf-8"))
    rc, out, err = run(["--checkpoint", ckpt, "--prompts-file", "-"], capsys)
    assert rc == 2 and "prompts file <stdin> line 1 is not UTF-8 text" in err, err


def test_a_request_the_kv_cache_cannot_hold_is_refused_before_anything_is_printed(ckpt, capsys):
    """The engine refuses it as `generate` queues it: the model line (and, for one
    prompt, the streamed prompt) were printed first, the error glued to the prompt on
    the terminal ("hierror: prompt 0: ...")."""
    base = ["--checkpoint", ckpt, "--backend", "xla", *GEOMETRY, "--num-pages", "1"]
    for prompts in (["hi"], ["hi", "ho"]):  # streamed, and a batch
        argv = [*base, *(a for p in prompts for a in ("--prompt", p)), "--max-tokens", "20"]
        rc, out, err = run(argv, capsys)
        assert rc == 2 and out == "", out
        assert err.startswith("error: prompt 0: ") and err.count("\n") == 1, err
        assert "KV pages" in err, err


def test_prompts_from_a_closed_stdin_are_bad_input(ckpt, capsys, monkeypatch):
    """`generate.py --prompts-file - <&-` (stdin closed, as a daemon may run it): Python's
    sys.stdin is None, and reading it was an AttributeError traceback."""
    monkeypatch.setattr("sys.stdin", None)
    rc, out, err = run(["--checkpoint", ckpt, "--prompts-file", "-"], capsys)
    assert rc == 2 and out == "" and err == "error: --prompts-file -: stdin is closed\n", err


def test_a_prompts_file_given_twice_is_bad_input(ckpt, tmp_path, capsys):
    """The second --prompts-file replaced the first: its prompts were dropped unsaid."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x\n")
    b.write_text("y\n")
    rc, out, err = run(["--checkpoint", ckpt, "--prompts-file", a, "--prompts-file", b], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: --prompts-file given twice ({a}, {b})"), err


def test_a_ctrl_c_exits_at_once_with_its_output_flushed(monkeypatch):
    """After a Ctrl-C mid-compile, Python's shutdown crashed now and then (SIGSEGV: status
    139, not 130); the scripts exit without it, stdout and stderr flushed first."""
    calls = []
    monkeypatch.setattr(cli.os, "_exit", lambda rc: calls.append(("exit", rc)))
    monkeypatch.setattr("sys.stdout.flush", lambda: calls.append("stdout"))
    monkeypatch.setattr("sys.stderr.flush", lambda: calls.append("stderr"))
    cli.exit_with(130)
    assert calls == ["stdout", "stderr", ("exit", 130)]
    with pytest.raises(SystemExit) as e:  # any other status: the usual exit
        cli.exit_with(2)
    assert e.value.code == 2 and len(calls) == 3


def test_kv_cache_dtype_takes_vllms_fp8_e4m3():
    """vLLM's spelling of the FP8 cache, which LLM takes, was an invalid choice."""
    args = gen.build_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert cli.engine_kwargs(args)["kv_cache_dtype"] == "fp8_e4m3"
