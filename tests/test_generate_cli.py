"""scripts/generate.py end to end (in-process `main(argv)`): what it prints and reports.

Streamed and batch output, --json (settings, outputs, metrics), the report, logprobs
listings, prompts from files, stdin and pipes, stop strings, seeds, structured outputs,
the flags' defaults and every flag reaching the engine, and the compilation cache (one
real subprocess). tests/generate_cli_helpers.py has the checkpoint and the runner; bad
input and failures are in tests/test_generate_cli_errors.py, --chat in
tests/test_generate_cli_chat.py.
"""

import io
import json
import os
import re
import subprocess
import sys
import threading
import types

import generate_cli_helpers
import numpy as np
from generate_cli_helpers import GEOMETRY, ROOT, SCRIPT, cli, gen, run
from params_helpers import SAMPLING_ARGV, SAMPLING_FIELDS, capture_engine, spy_generate

from pagedjax.metrics import SUMMARY_KEYS, EngineMetrics
from pagedjax.resources import byte_tokenizer
from pagedjax.tokenizer import Tokenizer

ckpt = generate_cli_helpers.ckpt  # bound here: this module gets its own checkpoint


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
    assert rc == 2 and "--logprobs=21 is more than --max-logprobs=20" in err


def test_json_output_is_strict_json():
    """-inf logprobs (banned tokens among the K most likely) and NaN are null: json.dumps
    wrote -Infinity and NaN, which JSON has not."""
    obj = dict(a=[{"token_id": 3, "logprob": float("-inf")}], b=(1.5, float("nan")), c="x")
    text = gen.json_text(obj)
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == dict(a=[{"token_id": 3, "logprob": None}], b=[1.5, None], c="x")


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


def test_a_default_compilation_cache_that_cannot_be_made_is_skipped(
    ckpt, capsys, monkeypatch, tmp_path
):
    """A home that cannot hold ~/.cache (read-only, in a container) ended every run with
    "error: --compilation-cache ...: cannot create it", status 2, naming a flag not given;
    the cache is an optimisation: without the flag, the run goes on without it."""
    import jax

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    monkeypatch.delenv("PAGEDJAX_COMPILATION_CACHE")
    argv = ["--checkpoint", ckpt, "--prompt", "hi", "--max-tokens", "2", "--json"]
    argv += ["--backend", "xla", *GEOMETRY]
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        rc, out, err = run(argv, capsys)
        assert rc == 0, err
        assert json.loads(out)["settings"]["compilation_cache"] is None
        want = f"note: no compilation cache: {tmp_path / 'file' / 'pagedjax' / 'xla'} cannot"
        assert want in err, err
        assert jax.config.jax_compilation_cache_dir is None
        rc, out, err = run([*argv, "--compilation-cache", tmp_path / "file" / "x"], capsys)
        assert rc == 2 and out == "" and "--compilation-cache " in err, err
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


def test_grammar_flag(ckpt, tmp_path, capsys):
    """--grammar FILE reaches the engine as StructuredOutputsParams(grammar=its text)
    (completions that end on a stop are in its language; --json names it); a file that
    cannot be read, a grammar refused (naming its line:column) and --grammar with
    another spec are one-line errors."""
    grammar = 'root ::= word ("-" word){0,2}  # GBNF\nword ::= "up" | "down" | [0-9]\n'
    (tmp_path / "g.gbnf").write_text(grammar)
    (tmp_path / "bad.gbnf").write_text("root ::= 'up'\n")
    argv = ["--checkpoint", ckpt, "--prompt", "ab", "--max-tokens", "24", "--backend", "xla"]
    argv += ["--temperature", "1", "--n", "3", "--json", *GEOMETRY]
    rc, out, err = run([*argv, "--grammar", tmp_path / "g.gbnf"], capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["settings"]["structured_outputs"] == {"grammar": grammar}
    completions = obj["outputs"][0]["completions"]
    assert any(c["finish_reason"] == "stop" for c in completions)
    for c in completions:
        if c["finish_reason"] == "stop":
            assert matches(r"(?:up|down|[0-9])(?:-(?:up|down|[0-9])){0,2}")(c["text"]), c
    for flags, match in (
        (["--grammar", tmp_path / "none.gbnf"], "--grammar"),
        (["--grammar", tmp_path / "bad.gbnf"], "grammar at 1:10: single-quoted strings"),
        (["--grammar", tmp_path / "g.gbnf", "--regex", "a"], "not allowed with"),
    ):
        rc, out, err = run([*argv, *flags], capsys)
        assert rc == 2 and err.count("\n") == 1 and match in err, err


def test_a_prompts_file_with_a_byte_order_mark_or_crlf_lines(ckpt, tmp_path, capsys):
    """A file saved with a UTF-8 byte order mark (Windows editors) began its first prompt
    with U+FEFF, tokenized as three stray bytes; CRLF line ends are plain line ends."""
    f = tmp_path / "prompts.txt"
    f.write_bytes(b'\xef\xbb\xbfx = 1\r\n\r\n"y"\r\nz\n')
    argv = ["--checkpoint", ckpt, "--prompts-file", f, "--max-tokens", "2", "--json"]
    rc, out, err = run([*argv, "--backend", "xla", *GEOMETRY], capsys)
    assert rc == 0, err
    outputs = json.loads(out)["outputs"]
    assert [o["prompt"] for o in outputs] == ["x = 1", "y", "z"]
    assert outputs[0]["prompt_tokens"] == 5
