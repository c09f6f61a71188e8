"""scripts/generate.py end to end (in-process `main(argv)`, plus one real subprocess).

The checkpoint is a tiny random-weight HF directory written here (config.json,
model.safetensors, a byte-level tokenizer.json), served with the geometry of
tests/test_engine.py so that both share compiled programs.
"""

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from params_helpers import (
    SAMPLING_ARGV,
    SAMPLING_FIELDS,
    capture_engine,
    spy_generate,
    write_tiny_checkpoint,
)

from pagedjax.metrics import SUMMARY_KEYS, EngineMetrics
from pagedjax.resources import byte_tokenizer
from pagedjax.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "generate.py"
GEOMETRY = ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]


def load_script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = load_script()
cli = gen.cli  # the scripts' shared module, as they import it


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_ckpt")
    write_tiny_checkpoint(path)
    return path


def run(argv, capsys):
    rc = gen.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def count_encodes(monkeypatch) -> list:
    """Wraps `Tokenizer.encode` to record every text it tokenizes; returns that list."""
    texts = []
    encode = Tokenizer.encode

    def spy(self, text, *args, **kwargs):
        texts.append(text)
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    return texts


def test_json_end_to_end(ckpt, capsys, monkeypatch):
    prompts = ["def add(a, b):\n", "def add(a, b):\n    return", "import os\n"]
    encoded, sent = count_encodes(monkeypatch), spy_generate(monkeypatch)
    argv = ["--checkpoint", ckpt, "--max-tokens", "5", "--n", "2", "--temperature", "0.7"]
    argv += ["--top-k", "50", "--seed", "3", "--backend", "xla", "--json", *GEOMETRY]
    argv += ["--logprobs", "2", "--prompt-logprobs", "1", "--min-p", "0.05"]
    argv += ["--repetition-penalty", "1.2", "--frequency-penalty", "0.5"]
    argv += ["--min-tokens", "2", "--logit-bias", '{"10": 1.5}']
    for p in prompts:
        argv += ["--prompt", p]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    assert encoded == prompts  # each prompt tokenized once, its ids sent on
    monkeypatch.undo()
    tok = Tokenizer.from_dir(ckpt)
    assert sent == [tok.encode(p) for p in prompts]
    obj = json.loads(out)  # stdout is exactly one JSON object
    assert set(obj) == {
        "model",
        "device",
        "backend",
        "resolved_backend",
        "settings",
        "outputs",
        "metrics",
    }
    assert obj["resolved_backend"] == "xla" and str(ckpt) in obj["model"]
    assert tuple(obj["metrics"]) == SUMMARY_KEYS
    m = obj["metrics"]
    assert m["num_requests"] == 3 and m["num_generated_tokens"] <= 3 * 2 * 5
    assert m["kv_pages_total"] == 64 and 0 < m["kv_pages_used"] <= 64
    assert m["peak_device_memory_bytes"] is None  # the CPU has no memory stats
    assert m["ttft_p50_s"] <= m["ttft_p99_s"] and m["preemptions"] == 0
    assert m["kv_bytes_read"] > 0 and m["decode_tokens_per_s"] > 0
    assert obj["settings"]["num_pages"] == 64 and obj["settings"]["page_size"] == 8
    assert obj["settings"]["kv_cache_dtype"] == "float32"  # auto: the model's dtype
    assert obj["settings"]["max_model_len"] == 512  # the model's, by default
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `settings` |"))
    flags = {"n", "beam_width", "max_tokens", "logprobs", "prompt_logprobs"}
    flags |= set(cli.sampling_kwargs(gen.build_parser().parse_args([])))
    documented = [k for k in obj["settings"] if k in row and k in gen.__doc__]
    undocumented = set(obj["settings"]) - flags - set(documented)
    assert not undocumented, (
        f"settings keys missing from the README or the docstring: {undocumented}"
    )
    assert [o["prompt"] for o in obj["outputs"]] == prompts
    for o in obj["outputs"]:
        assert len(o["completions"]) == 2
        for c in o["completions"]:
            assert 1 <= len(c["token_ids"]) <= 5 and c["finish_reason"] in ("stop", "length")
            assert np.isfinite(c["cumulative_logprob"]) and c["cumulative_logprob"] <= 0
            assert len(c["logprobs"]) == len(c["token_ids"])
            for tok, entry in zip(c["token_ids"], c["logprobs"], strict=True):
                assert entry[0]["token_id"] == tok and len(entry) in (2, 3)
                assert all(e["logprob"] <= 0 for e in entry)
            total = sum(e[0]["logprob"] for e in c["logprobs"])
            np.testing.assert_allclose(total, c["cumulative_logprob"], rtol=1e-5)
    assert obj["settings"]["logprobs"] == 2 and obj["settings"]["prompt_logprobs"] == 1
    assert obj["settings"]["async_scheduling"] is True and obj["settings"]["min_p"] == 0.05
    assert obj["settings"]["repetition_penalty"] == 1.2
    assert obj["settings"]["frequency_penalty"] == 0.5
    assert obj["settings"]["presence_penalty"] == 0.0
    assert obj["settings"]["min_tokens"] == 2 and obj["settings"]["logit_bias"] == {"10": 1.5}
    for o in obj["outputs"]:
        plp = o["prompt_logprobs"]
        assert len(plp) == o["prompt_tokens"] and plp[0] is None and o["num_cached_tokens"] == 0
        assert all(1 <= len(e) <= 2 and e[0]["logprob"] <= 0 for e in plp[1:])
    # The first two prompts share a prefix, but prompt logprobs need every prompt token
    # computed: no prefix-cache hits.
    assert m["prefix_cache_hit_rate"] == 0


def test_streams_a_single_prompt_and_reports(ckpt, capsys):
    argv = ["--checkpoint", ckpt, "--prompt", "class A:", "--max-tokens", "6", *GEOMETRY]
    rc, out, err = run([*argv, "--backend", "xla", "--kv-cache-dtype", "fp8"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"model: checkpoint {ckpt}"
    assert "utilization; float8_e4m3fn)" in out  # the FP8 cache, reported
    assert lines[1].startswith("class A:")  # the prompt, then the streamed text
    for key in (
        "load ",
        "TTFT ",
        "throughput ",
        "KV read ",
        "peak memory  n/a",
        "KV pages ",
        "prefix cache ",
        "preemptions ",
        "host ",
    ):
        assert any(line.startswith(key) for line in lines), key
    assert "jit compilations" in out


def test_report_prints_rates_that_are_none_as_na():
    """The summary of an engine that ran nothing has every rate None (output_tokens_per_s
    too since 2b1e57f: the report crashed formatting it); with values, they print."""
    llm = types.SimpleNamespace(
        model_source="stub", backend="xla", cache_config=types.SimpleNamespace(dtype="float32")
    )
    s = EngineMetrics(kv_bytes_per_token=64).summary(
        kv_pages_total=8, prefix_cache_hit_rate=0.0, preemptions=0, peak_device_memory_bytes=None
    )
    assert s["output_tokens_per_s"] is None and s["decode_tokens_per_s"] is None
    lines = gen.report(llm, s, "cpu").splitlines()
    (line,) = [x for x in lines if x.startswith("throughput ")]
    assert line.endswith("decode n/a (device time of those steps); output n/a end to end")
    rng = np.random.default_rng(0)
    rates = {k: float(rng.uniform(1e3, 1e5)) for k in s if k.endswith("_tokens_per_s")}
    text = gen.report(llm, s | rates, "cpu")
    for k, v in rates.items():
        assert f"{v:,.0f} tok/s" in text, k


def test_logprobs_listing(ckpt, capsys):
    argv = ["--checkpoint", ckpt, "--prompt", "x", "--prompt", "yz", "--max-tokens", "3"]
    argv += ["--no-async-scheduling"]  # the synchronous engine, from the CLI
    argv += ["--prompt-logprobs", "0"]
    rc, out, err = run([*argv, "--logprobs", "1", "--backend", "xla", *GEOMETRY], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    at = lines.index("--- prompt logprobs, prompt 1")
    assert lines[at + 1].strip() == repr("y")  # the first prompt token: no logprob
    assert re.fullmatch(r" +'z' +-?\d+\.\d{3}", lines[at + 2])  # K = 0: no alternatives
    for i in (0, 1):
        at = lines.index(f"--- logprobs, prompt {i} completion 0") + 1
        n = 0
        while not lines[at + n].startswith(("---", "model ")):
            assert re.fullmatch(r".+ +-?\d+\.\d{3}(  \| .+ -?\d+\.\d{3})?", lines[at + n])
            n += 1
        assert 1 <= n <= 3
    rc, out, err = run([*argv, "--logprobs", "21", *GEOMETRY], capsys)
    assert rc == 2 and "logprobs must be None or an int in [0, 20], got logprobs=21" in err


def test_format_logprobs():
    ids, entries = [4, 5, 7], [None, {5: -0.1, 9: -2.0}, {7: -1.5}]
    tok = byte_tokenizer()
    want = [
        f"{tok.decode([4])!r:>16}",
        f"{tok.decode([5])!r:>16}   -0.100  | {tok.decode([9])!r} -2.000",
        f"{tok.decode([7])!r:>16}   -1.500",
    ]
    assert gen.format_logprobs(tok, ids, entries).splitlines() == want
    assert gen.format_logprobs(None, ids, entries).splitlines()[2] == f"{'7':>16}   -1.500"


def test_docstring_lists_every_json_key():
    doc = gen.__doc__
    for key in (
        *SUMMARY_KEYS,
        "model",
        "device",
        "backend",
        "resolved_backend",
        "settings",
        "outputs",
        "metrics",
        "completions",
        "finish_reason",
        "cumulative_logprob",
    ):
        assert key in doc, key


def test_default_prompts_share_a_prefix():
    assert len(gen.DEFAULT_PROMPTS) >= 3
    assert all(p.startswith(gen.PREFIX) for p in gen.DEFAULT_PROMPTS)
    assert len(gen.PREFIX) > 100  # several pages of tokens to share


def test_prompts_file(ckpt, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text('x = 1\n\n"def f():\\n    return"\n')
    rc, out, err = run(
        [
            "--checkpoint",
            ckpt,
            "--prompts-file",
            f,
            "--max-tokens",
            "2",
            "--json",
            "--backend",
            "xla",
            *GEOMETRY,
        ],
        capsys,
    )
    assert rc == 0, err
    assert [o["prompt"] for o in json.loads(out)["outputs"]] == ["x = 1", "def f():\n    return"]


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


def test_max_tokens_cut_by_the_models_length_is_said(ckpt, capsys):
    argv = ["--checkpoint", ckpt, "--prompt", "x" * 505, "--max-tokens", "20", "--json"]
    rc, out, err = run([*argv, "--backend", "xla", *GEOMETRY, "--num-pages", "128"], capsys)
    assert rc == 0, err
    (c,) = json.loads(out)["outputs"][0]["completions"]
    assert len(c["token_ids"]) == 512 - 505 or c["finish_reason"] == "stop"  # 7: the room
    assert "leaves less than --max-tokens 20 after prompt 0 (7)" in err, err


def test_prompts_from_stdin_and_pipes(ckpt, tmp_path, capsys, monkeypatch):
    """`--prompts-file -` and a pipe's path (`<(...)`, /dev/stdin) were "not found" (only
    regular files were read); a directory was "not found" too."""
    argv = ["--checkpoint", ckpt, "--max-tokens", "2", "--json", "--backend", "xla", *GEOMETRY]
    want = ["x = 1", "def f():\n    return"]
    data = b'x = 1\n\n"def f():\\n    return"\n'
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    rc, out, err = run([*argv, "--prompts-file", "-"], capsys)
    assert rc == 0, err
    assert [o["prompt"] for o in json.loads(out)["outputs"]] == want
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(data,))
    writer.start()
    try:
        rc, out, err = run([*argv, "--prompts-file", fifo], capsys)
    finally:
        writer.join(timeout=60)
    assert rc == 0, err
    assert [o["prompt"] for o in json.loads(out)["outputs"]] == want
    rc, out, err = run([*argv, "--prompts-file", tmp_path], capsys)
    assert rc == 2 and err == f"error: prompts file {tmp_path} is a directory\n" and out == ""


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


def test_ctrl_c_ends_with_one_line_and_status_130(ckpt, capsys, monkeypatch):
    """A Ctrl-C mid-generation printed a KeyboardInterrupt traceback."""
    from pagedjax.engine import LLM

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "generate", interrupted)
    try:
        rc, out, err = run(["--checkpoint", ckpt, "--prompt", "class A:", *GEOMETRY], capsys)
    except KeyboardInterrupt:  # (caught here, or it would stop the whole test session)
        pytest.fail("main let the KeyboardInterrupt through: a traceback")
    assert rc == 130 and err.strip() == "interrupted", err
    assert out.startswith(f"model: checkpoint {ckpt}")  # what streamed before stays


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
    try:
        rc, out, err = run([*argv, "--backend", "xla"], capsys)
    except KeyboardInterrupt:
        pytest.fail("main let the KeyboardInterrupt through: a traceback")
    assert rc == 130 and err.strip() == "interrupted", err
    assert len(steps) == 1  # stopped at the first step, not at the end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


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


def test_compilation_cache_dir_precedence(monkeypatch, tmp_path):
    """--compilation-cache, then $PAGEDJAX_COMPILATION_CACHE, then jax's own setting, then XDG."""
    import jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PAGEDJAX_COMPILATION_CACHE")
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert cli.compilation_cache_dir(None) == str(tmp_path / "xdg" / "pagedjax" / "xla")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        assert cli.compilation_cache_dir(None) == str(tmp_path / "jax")
        monkeypatch.setenv("PAGEDJAX_COMPILATION_CACHE", str(tmp_path / "env"))
        assert cli.compilation_cache_dir(None) == str(tmp_path / "env")
        assert cli.compilation_cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")
        assert cli.compilation_cache_dir("off") is None
        monkeypatch.setenv("PAGEDJAX_COMPILATION_CACHE", "off")
        assert cli.compilation_cache_dir(None) is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_compilation_cache_is_written_and_reported(tmp_path):
    """A real run fills the directory it names and reports it in --json settings."""
    cache = tmp_path / "xla"
    # jax caches only programs that took >= 1 s to compile (its default); at -O0 on the
    # CPU the demo model's steps take about that, so the test was flaky: cache them all.
    env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--prompt", "def f(x):", "--max-tokens", "2", "--json"]
        + ["--compilation-cache", str(cache)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["settings"]["compilation_cache"] == str(cache)
    assert any(cache.iterdir()), "no compiled program was written to the cache"


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


def test_every_sampling_and_engine_flag_reaches_the_engine(ckpt, capsys, monkeypatch):
    from pagedjax.engine import SamplingParams

    seen = capture_engine(monkeypatch)
    argv = ["--checkpoint", ckpt, "--prompt", "hi", "--backend", "xla", *GEOMETRY]
    argv += [*SAMPLING_ARGV, "--max-tokens", "9", "--n", "2", "--logprobs", "1"]
    argv += ["--prompt-logprobs", "2", "--no-prefix-caching", "--no-async-scheduling"]
    argv += ["--stop", "ab", "--stop", "c", "--stop-token-ids", "3", "4", "--ignore-eos"]
    argv += ["--generation-config", "none"]
    rc, _, err = run(argv, capsys)
    assert rc == 130, err
    assert seen["sp"] == SamplingParams(
        n=2,
        max_tokens=9,
        logprobs=1,
        prompt_logprobs=2,
        stop=("ab", "c"),
        stop_token_ids=(3, 4),
        ignore_eos=True,
        **{**SAMPLING_FIELDS, "seed": None},  # --seed seeds the engine, not each request
    )
    init = seen["init"]
    assert init["enable_prefix_caching"] is False and init["async_scheduling"] is False
    assert init["seed"] == 11 and init["page_size"] == 8 and init["num_pages"] == 64
    assert init["generation_config"] == "none"
    assert init["max_num_batched_tokens"] == 16 and init["max_num_seqs"] == 16


def test_flag_defaults():
    """The defaults the README and --help give: greedy, 64 tokens, pages of 16 tokens, a
    1024-token step budget, 64 sequences, prefix caching and async scheduling on."""
    args = gen.build_parser().parse_args([])
    assert cli.sampling_kwargs(args) == dict(
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        max_tokens=64,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
        logit_bias=None,
        seed=0,
    )
    assert (args.n, args.beam_width, args.generation_config) == (1, 1, "auto")
    assert (args.stop, args.stop_token_ids, args.ignore_eos) == (None, None, False)
    assert not args.no_prefix_caching and not args.no_async_scheduling
    assert cli.engine_kwargs(args) == dict(
        page_size=16,
        num_pages=None,
        kv_memory_fraction=None,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        backend="auto",
        tensor_parallel=1,
        kv_cache_dtype="auto",
        max_model_len=None,
    )


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


def test_the_length_note_starts_where_max_tokens_no_longer_fits(ckpt, capsys, monkeypatch):
    """A prompt of 492 tokens leaves exactly --max-tokens 20 under the model's 512: no
    note; one more token and the completion would be cut, which is said."""
    capture_engine(monkeypatch)
    argv = ["--checkpoint", ckpt, "--max-tokens", "20", "--backend", "xla", *GEOMETRY]
    rc, _, err = run([*argv, "--prompt", "x" * 492], capsys)
    assert rc == 130 and "note:" not in err, err
    rc, _, err = run([*argv, "--prompt", "x" * 493], capsys)
    assert rc == 130 and "leaves less than --max-tokens 20 after prompt 0 (19)" in err, err


def test_streamed_text_is_the_completions_text(ckpt, capsys, monkeypatch):
    """A single prompt streams: the prompt, then the text token by token, with the
    decoder's held-back bytes flushed at the end (token 195 is a UTF-8 lead byte that no
    continuation byte follows here, so all of this text comes from that flush)."""
    outs = spy_generate(monkeypatch, outputs=True)
    argv = ["--checkpoint", ckpt, "--prompt", "def f(x):", "--backend", "xla", *GEOMETRY]
    for extra in ([], ["--logit-bias", '{"195": 100}']):
        outs.clear()
        rc, out, err = run([*argv, "--max-tokens", "4", *extra], capsys)
        assert rc == 0, err
        (c,) = outs[0].outputs
        assert c.text, c
        want = f"model: checkpoint {ckpt}\ndef f(x):{c.text} ({c.finish_reason})\nmodel "
        assert out.startswith(want), out  # the finish reason too, as a batch shows it
    assert c.text == "\ufffd" * 4


def test_batch_output_shows_each_completion(ckpt, capsys, monkeypatch):
    """More than one prompt, or --n > 1, is not streamed: each prompt's completions are
    listed after a header, tagged [index] only when there are several."""
    outs = spy_generate(monkeypatch, outputs=True)
    argv = ["--checkpoint", ckpt, "--max-tokens", "3", "--backend", "xla", *GEOMETRY]
    for prompts, extra in ((["ab", "cd"], []), (["ab"], ["--n", "2", "--temperature", "1"])):
        outs.clear()
        rc, out, err = run([*argv, *extra, *(x for p in prompts for x in ("--prompt", p))], capsys)
        assert rc == 0, err
        want = f"model: checkpoint {ckpt}\n"
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            want += f"--- prompt {i} ({len(o.prompt_token_ids)} tokens)\n"
            for c in o.outputs:
                tag = f" [{c.index}]" if len(o.outputs) > 1 else ""
                want += f"{p}{c.text}{tag} ({c.finish_reason})\n"
        assert out.startswith(want + "model "), out
    assert [c.index for c in outs[0].outputs] == [0, 1]


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


def test_seed_seeds_the_engine_so_prompts_get_their_own_draws(ckpt, capsys):
    """--seed is the engine's (as vLLM's): two prompts, the same here, sample different
    tokens (every request had --seed as its seed, so they drew the same), and a second
    run draws what the first did."""
    argv = ["--checkpoint", ckpt, "--prompt", "hi", "--prompt", "hi", "--temperature", "1"]
    argv += ["--max-tokens", "8", "--seed", "5", "--backend", "xla", "--json", *GEOMETRY]
    runs = []
    for _ in range(2):
        rc, out, err = run(argv, capsys)
        assert rc == 0, err
        runs.append([o["completions"][0]["token_ids"] for o in json.loads(out)["outputs"]])
        assert json.loads(out)["settings"]["seed"] == 5
    assert runs[0][0] != runs[0][1], runs
    assert runs[0] == runs[1]


def test_stop_strings_and_stop_token_ids(ckpt, capsys, monkeypatch):
    """--stop cuts the text where a string starts (finish_reason stop; a single prompt
    is then printed whole, not streamed); --stop-token-ids ends at a token, kept in the
    token ids, not in the text (streamed or not)."""
    outs = spy_generate(monkeypatch, outputs=True)
    argv = ["--checkpoint", ckpt, "--prompt", "ab", "--max-tokens", "10", "--backend", "xla"]
    argv += GEOMETRY
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    (c,) = outs.pop().outputs
    text, ids = c.text, c.token_ids
    k = next(k for k in range(1, len(text) - 1) if text[k : k + 2].isalnum())
    stop = text[k : k + 2]
    rc, out, err = run([*argv, "--stop", "@@@", "--stop", stop], capsys)
    assert rc == 0, err
    (c,) = outs.pop().outputs
    cut = text[: text.index(stop)]
    assert (c.text, c.finish_reason, c.stop_reason) == (cut, "stop", stop)
    assert out.startswith(f"model: checkpoint {ckpt}\n--- prompt 0 (2 tokens)\nab{cut} (stop)\n")
    rc, out, err = run([*argv, "--stop-token-ids", str(ids[2]), "--json"], capsys)
    assert rc == 0, err
    (c,) = json.loads(out)["outputs"][0]["completions"]
    assert c["token_ids"] == ids[: ids.index(ids[2]) + 1] and c["finish_reason"] == "stop"
    assert json.loads(out)["settings"]["stop_token_ids"] == [ids[2]]
    # Streamed, the stop token's text is held back, then left out, as in the text.
    rc, out, err = run([*argv, "--stop-token-ids", str(ids[2])], capsys)
    (c,) = outs.pop().outputs
    assert rc == 0 and c.stop_reason == ids[2] and c.token_ids[-1] == ids[2], err
    assert c.text == text[: len(c.text)] and len(c.text) < len(text)
    assert out.startswith(f"model: checkpoint {ckpt}\nab{c.text} (stop)\nmodel"), out
    rc, out, err = run([*argv, "--stop-token-ids", "256"], capsys)
    assert rc == 2 and "--stop-token-ids [256] are outside the vocabulary [0, 256)" in err
    rc, out, err = run([*argv, "--stop", "x", "--beam-width", "2"], capsys)
    assert rc == 2 and "stop strings are not supported with beam search" in err


def matches(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


def test_structured_output_flags(ckpt, tmp_path, capsys):
    """--regex, --choice, --json-schema FILE and --json-object reach the engine as
    StructuredOutputsParams (completions that end on a stop match them; --json names the
    spec); a schema file that cannot be read, a spec refused and two flags at once are
    one-line errors."""
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    argv = ["--checkpoint", ckpt, "--prompt", "ab", "--max-tokens", "24", "--backend", "xla"]
    argv += ["--temperature", "1", "--n", "3", "--json", *GEOMETRY]
    for flags, spec, ok in (
        (["--regex", "[a-c]{1,4}!"], {"regex": "[a-c]{1,4}!"}, matches(r"[a-c]{1,4}!")),
        (["--choice", "up", "--choice", "down"], {"choice": ["up", "down"]}, matches("up|down")),
        (["--json-schema", tmp_path / "s.json"], {"json": schema},
         lambda t: type(json.loads(t)) is dict and type(json.loads(t)["k"]) is bool),
        (["--json-object"], {"json_object": True}, lambda t: type(json.loads(t)) is dict),
    ):  # fmt: skip
        rc, out, err = run([*argv, *flags], capsys)
        assert rc == 0, err
        obj = json.loads(out)
        assert obj["settings"]["structured_outputs"] == spec
        for c in obj["outputs"][0]["completions"]:
            if c["finish_reason"] == "stop":
                assert ok(c["text"]), (flags, c["text"])
        assert any(c["finish_reason"] == "stop" for c in obj["outputs"][0]["completions"])
    for flags, match in (
        (["--json-schema", tmp_path / "none.json"], "--json-schema"),
        (["--regex", "a(?=b)"], "lookaround"),
        (["--regex", "a", "--json-object"], "not allowed with"),
        (["--regex", "a", "--beam-width", "2"], "beam search"),
    ):
        rc, out, err = run([*argv, *flags], capsys)
        assert rc == 2 and err.count("\n") == 1 and match in err, err
