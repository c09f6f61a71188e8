"""Command-line errors of the CPU-runnable scripts: one line naming the bad flag, exit
status 2 (argparse) or 1, no traceback, and nothing slow run before the check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"{name}_cli_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def usage_error(fn, argv, capsys) -> str:
    """Runs an argument parser expected to reject argv; returns its one-line error."""
    with pytest.raises(SystemExit) as info:
        fn(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ------------------------------------------------------------------ convert_checkpoint


def convert_without_loading(monkeypatch):
    """convert_checkpoint.py with its HF load an AssertionError: OUT_DIR is checked first."""
    cli = load("convert_checkpoint", monkeypatch)
    from pagedjax import weights

    def no_load(*a, **k):
        raise AssertionError("loaded the HF checkpoint before checking OUT_DIR")

    monkeypatch.setattr(weights, "load_hf_checkpoint", no_load)
    return cli


def test_convert_refuses_out_dir_before_loading(tmp_path, capsys, monkeypatch):
    cli = convert_without_loading(monkeypatch)
    hf = tmp_path / "hf"
    hf.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert cli.main([str(hf), str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--overwrite" in err and str(out) in err, err
    assert cli.main([str(hf), str(out), "--overwrite"]) == 2  # not a pagedjax checkpoint
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and str(out) in err, err
    assert (out / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert cli.main([str(hf), str(a_file)]) == 2
    err = capsys.readouterr().err
    assert "not a directory" in err and str(a_file) in err, err
    assert cli.main([str(hf), str(a_file / "out")]) == 2  # under a file: it cannot be made
    err = capsys.readouterr().err
    assert "is not a directory" in err and "Traceback" not in err, err
    # The source inside OUT_DIR (or OUT_DIR itself): --overwrite would delete it.
    for src in (out / "hf", out):
        src.mkdir(exist_ok=True)
        assert cli.main([str(src), str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "must not be HF_DIR or contain it" in err, err
    assert (out / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------ bench_decode


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--max-batch", "-1"], "--max-batch must be >= 1, got -1"),
        (["--page-size", "0"], "--page-size must be a power of two, got 0"),
        (["--page-size", "-8"], "--page-size must be a power of two, got -8"),
        (["--page-size", "3"], "--page-size must be a power of two, got 3"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        # One decode step leaves no interval to time: the rates were NaN (not JSON).
        (["--gen-len", "2"], "need --prompt-len >= 1 and --gen-len >= 3"),
        # 40 // 16 = 2 pages, one 40-token sequence needs 3.
        (
            [
                "--kv-budget-tokens",
                "40",
                "--max-seq-len",
                "40",
                "--prompt-len",
                "8",
                "--gen-len",
                "32",
            ],
            "--kv-budget-tokens 40 gives 2 usable pages of 16, fewer than the 3",
        ),
    ],
)
def test_decode_bad_flags(argv, want, capsys, monkeypatch):
    bench = load("bench_decode", monkeypatch)
    err = usage_error(bench.parse_args, argv, capsys)
    assert want in err, err


@pytest.mark.parametrize("name", ["bench_decode", "bench_memory", "bench_prefix"])
def test_a_plot_dir_that_cannot_be_made_is_refused_before_the_run(
    name, tmp_path, capsys, monkeypatch
):
    """It was found only when the plots were written, after the whole run: a traceback,
    and the results (JSON included) lost."""
    bench = load(name, monkeypatch)
    bad = tmp_path / "a_file" / "plots"
    bad.parent.write_text("")
    err = usage_error(bench.parse_args, ["--plot-dir", str(bad)], capsys)
    assert f"--plot-dir {bad}: cannot create it" in err, err
    bench.parse_args(["--plot-dir", str(bad), "--no-plots"])  # no plots: not needed
    bench.parse_args(["--plot-dir", str(tmp_path / "new" / "plots")])
    assert (tmp_path / "new" / "plots").is_dir()


# ------------------------------------------------------------------ bench_prefix


def test_prefix_help_describes_the_whole_benchmark(capsys, monkeypatch):
    """--help's description stopped mid-sentence ("... system prompt, and the")."""
    bench = load("bench_prefix", monkeypatch)
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "and the prefix-cache hit rate of a simulated multi-turn chat" in out, out


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--page-size", "0"], "--page-size must be a power of two, got 0"),
        (["--page-size", "3"], "--page-size must be a power of two, got 3"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
        (["--bucket-min-seqs", "0"], "--bucket-min-seqs must be >= 1, got 0"),
        (["--chat-max-turns", "0"], "--chat-max-turns must be >= 1, got 0"),
        (["--chat-reply-median", "nan"], "--chat-reply-median must be a finite number > 0"),
        (["--chat-reply-median", "-1"], "--chat-reply-median must be a finite number > 0"),
        (["--chat-reply-median", "inf"], "--chat-reply-median must be a finite number > 0"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
        (["--seed", "-2"], "--seed must be >= 0, got -2"),
        # 2,024 tokens of K/V need 127 pages of 16; 128 pages keep 127 (watermark 1).
        (["--num-pages", "100", "--chat-conversations", "0"], "--num-pages 100 (99 usable)"),
        # A chat turn can reach --max-model-len 4096: 256 pages.
        (["--num-pages", "200"], "cannot hold a request of 4096 tokens"),
    ],
)
def test_prefix_bad_flags(argv, want, capsys, monkeypatch):
    bench = load("bench_prefix", monkeypatch)
    err = usage_error(bench.parse_args, argv, capsys)
    assert want in err, err


def test_prefix_accepts_just_enough_pages(monkeypatch):
    bench = load("bench_prefix", monkeypatch)
    bench.parse_args(["--num-pages", "128", "--chat-conversations", "0"])  # 127 usable
    bench.parse_args(["--num-pages", "259"])  # 257 usable, 256 needed


def test_prefix_chat_that_fits_nothing_is_an_error(monkeypatch):
    bench = load("bench_prefix", monkeypatch)

    class Engine:  # the chat refuses before anything reaches the engine
        max_model_len = 41

        class config:
            vocab_size = 100

    argv = ["--system-tokens", "32", "--message-tokens", "8", "--max-model-len", "8"]
    args = bench.parse_args([*argv, "--max-num-batched-tokens", "64", "--num-pages", "8"])
    with pytest.raises(SystemExit, match="no chat conversation fits a context of 41 tokens"):
        bench.chat_workload(Engine(), args)


# ------------------------------------------------------------------ bench_memory


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--page-sizes", "0,16"], "--page-sizes must be >= 1, got [0, 16]"),
        (["--rate", "0"], "--rate must be a finite number > 0, got 0.0"),
        (["--rate", "-1"], "--rate must be a finite number > 0, got -1.0"),
        (["--rate", "nan"], "--rate must be a finite number > 0, got nan"),
        (["--rate", "inf"], "--rate must be a finite number > 0, got inf"),
        (["--watermark", "nan"], "--watermark must be in [0, 1), got nan"),
        (["--watermark", "1"], "--watermark must be in [0, 1), got 1.0"),
        (["--horizon", "-5"], "--horizon must be >= 0, got -5"),
        (["--max-seq-len", "1", "--budget-tokens", "100"], "--max-seq-len must be >= 2, got 1"),
        (["--max-seq-len", "0"], "--max-seq-len must be >= 2, got 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
    ],
)
def test_memory_bad_flags(argv, want, capsys, monkeypatch):
    bench = load("bench_memory", monkeypatch)
    err = usage_error(bench.parse_args, argv, capsys)
    assert want in err, err


# ------------------------------------------------------------------ bench_host


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--page-size", "0"], "--page-size must be a power of two, got 0"),
        (["--page-size", "3"], "--page-size must be a power of two, got 3"),
        (["--iters", "0"], "--iters must be >= 1, got 0"),
        # --repeats 0 printed Infinity for every figure: not JSON.
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--prompt-len", "0"], "--prompt-len must be >= 1, got 0"),
        (["--batch", "4", "0"], "--batch must all be >= 1, got [4, 0]"),
        (["--engine-batch", "0"], "--engine-batch must all be >= 1, got [0]"),
        (["--device-ms", "nan"], "--device-ms must all be finite and >= 0, got [nan]"),
        (["--device-ms", "-1"], "--device-ms must all be finite and >= 0, got [-1.0]"),
        (["--params-preset", "nope"], "argument --params-preset: invalid choice: 'nope'"),
        (["--dispatch-layers", "0"], "--dispatch-layers must be >= 1, got 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
    ],
)
def test_host_bad_flags(argv, want, capsys, monkeypatch):
    bench = load("bench_host", monkeypatch)
    err = usage_error(bench.main, argv, capsys)  # fails before any benchmark runs
    assert want in err, err


def test_convert_a_failed_write_is_status_1_in_one_line(tmp_path, capsys, monkeypatch):
    """A full disk while orbax writes (its ValueError "RESOURCE_EXHAUSTED ... No space
    left on device") exited 2, as bad input; while copying the tokenizer files after
    it, with a traceback. Either leaves no OUT_DIR."""
    import errno
    import shutil

    from params_helpers import write_tiny_checkpoint

    from pagedjax import weights

    cli = load("convert_checkpoint", monkeypatch)
    hf = tmp_path / "hf"
    hf.mkdir()
    write_tiny_checkpoint(hf)

    def full(*a, **k):
        raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device")

    def full_copy(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    for obj, name, fail in [(weights, "save_params", full), (shutil, "copy2", full_copy)]:
        with monkeypatch.context() as m:
            m.setattr(obj, name, fail)
            assert cli.main([str(hf), str(tmp_path / f"out_{name}")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "No space left on device" in err, err
        assert f"writing {tmp_path / f'out_{name}'} failed" in err, err
        # (the tokenizer files were copied after the weights moved into place, which
        # left a checkpoint without them)
        assert not (tmp_path / f"out_{name}").exists()


def test_convert_a_broken_hf_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """The loader lists every broken file on lines of their own: stderr held two lines
    or more, not the one line of bad input."""
    from params_helpers import write_tiny_checkpoint

    cli = load("convert_checkpoint", monkeypatch)
    hf = tmp_path / "hf"
    hf.mkdir()
    write_tiny_checkpoint(hf)
    (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:100])
    assert cli.main([str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors is not a valid safetensors" in err, err
    assert not (tmp_path / "out").exists()


def test_convert_says_an_orbax_hf_dir_is_converted_already(tmp_path, capsys, monkeypatch):
    """Converting back (orbax HF_DIR) said "is not an HF checkpoint: it has no config.json",
    as if the directory were broken."""
    from pagedjax.orbax_checkpoint import ORBAX_META_FILE

    cli = load("convert_checkpoint", monkeypatch)
    orbax = tmp_path / "orbax"
    orbax.mkdir()
    (orbax / ORBAX_META_FILE).write_text("{}")
    assert cli.main([str(orbax), str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a pagedjax orbax checkpoint already" in err, err
    assert "not supported" in err and not (tmp_path / "back").exists()


def test_convert_round_trip_dtype_overwrite_and_serving(tmp_path, capsys, monkeypatch):
    """OUT_DIR may exist if empty; --dtype sets the stored dtype; --overwrite replaces a
    pagedjax checkpoint; and OUT_DIR alone serves generate.py as HF_DIR does."""
    import json

    import jax.numpy as jnp
    import numpy as np
    from params_helpers import write_tiny_checkpoint

    from pagedjax import model, weights

    cli = load("convert_checkpoint", monkeypatch)
    gen = load("generate", monkeypatch)
    hf, out = tmp_path / "hf", tmp_path / "out"
    hf.mkdir()
    out.mkdir()  # empty: fine
    write_tiny_checkpoint(hf)
    (hf / "generation_config.json").write_text('{"eos_token_id": 2}')
    _, p_hf = weights.load_hf_checkpoint(hf)  # float32, as config.json says

    assert cli.main([str(hf), str(out), "--dtype", "bfloat16"]) == 0, capsys.readouterr().err
    assert "in bfloat16" in capsys.readouterr().out
    assert weights.read_orbax_config(out).dtype == "bfloat16"
    for k, v in model.params_to_flat(weights.restore_params(out)).items():
        want = model.params_to_flat(p_hf)[k].astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(want), err_msg=k)
    assert (out / "generation_config.json").read_text() == '{"eos_token_id": 2}'

    assert cli.main([str(hf), str(out), "--overwrite"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert weights.read_orbax_config(out).dtype == "float32"  # config.json's, replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]  # nothing left over

    argv = ["--prompt", "def f(x):", "--max-tokens", "4", "--json", "--backend", "xla"]
    argv += ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
    texts = []
    for path in (hf, out):
        assert gen.main(["--checkpoint", str(path), *argv]) == 0
        (c,) = json.loads(capsys.readouterr().out)["outputs"][0]["completions"]
        texts.append((c["token_ids"], c["text"]))
    assert texts[0] == texts[1]


def fake_checkpoint(path: Path) -> None:
    """A directory --overwrite accepts as a pagedjax checkpoint, with a file to look for."""
    from pagedjax.orbax_checkpoint import ORBAX_META_FILE

    path.mkdir()
    (path / ORBAX_META_FILE).write_text("{}")
    (path / "old.txt").write_text("the old checkpoint")


def test_convert_ctrl_c_is_one_line_status_130_and_keeps_the_old_checkpoint(
    tmp_path, capsys, monkeypatch
):
    """A Ctrl-C printed a traceback (the old checkpoint survived it)."""
    import shutil

    from params_helpers import write_tiny_checkpoint

    cli = load("convert_checkpoint", monkeypatch)
    hf, out = tmp_path / "hf", tmp_path / "out"
    hf.mkdir()
    write_tiny_checkpoint(hf)
    fake_checkpoint(out)

    def interrupted(*a, **k):  # (while the tokenizer is copied: the arrays are written)
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copy2", interrupted)
    assert cli.main([str(hf), str(out), "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and str(out) in err, err
    assert (out / "old.txt").read_text() == "the old checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


def test_convert_overwrite_through_a_symlink_replaces_its_target_readable_by_all(
    tmp_path, capsys, monkeypatch
):
    """OUT_DIR a symlink to a checkpoint: --overwrite put a new directory in the link's
    place, left the old checkpoint where the link pointed and the link renamed beside it
    (`.link.replaced-...`). And OUT_DIR was made mode 0700 (`tempfile.mkdtemp`'s), so
    that no other user (a server's) could read the checkpoint."""
    import os
    import stat

    from params_helpers import write_tiny_checkpoint

    from pagedjax import weights

    cli = load("convert_checkpoint", monkeypatch)
    hf, real, link = tmp_path / "hf", tmp_path / "real", tmp_path / "link"
    hf.mkdir()
    write_tiny_checkpoint(hf)
    fake_checkpoint(real)
    real.chmod(0o755)
    link.symlink_to(real)
    mask = os.umask(0o022)
    try:
        assert cli.main([str(hf), str(link), "--overwrite"]) == 0, capsys.readouterr().err
    finally:
        os.umask(mask)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert not (real / "old.txt").exists()
    assert weights.read_orbax_config(real).num_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "link", "real"]
    assert stat.S_IMODE(real.stat().st_mode) == 0o755
    new = tmp_path / "new"
    mask = os.umask(0o027)
    try:
        assert cli.main([str(hf), str(new)]) == 0, capsys.readouterr().err
    finally:
        os.umask(mask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o750


def test_convert_refuses_an_unwritable_out_dir_before_loading(tmp_path, capsys, monkeypatch):
    """A directory it may not write in was found after the whole load (many GB)."""
    import os

    cli = convert_without_loading(monkeypatch)
    hf = tmp_path / "hf"
    hf.mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: Path(p) != ro and access(p, mode))
    for out in (ro / "out", ro / "a" / "b"):  # made in ro, or in a folder made in it
        assert cli.main([str(hf), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"cannot write in {ro}" in err, err
    assert list(ro.iterdir()) == []
