"""Checkpoint conversion and restore, review 31 (pagedjax.orbax_checkpoint,
scripts/convert_checkpoint.py): what a converted directory serves against its HF
directory, and the errors of the save/restore API for a wrong argument."""

import numpy as np
import pytest
from test_weights import TOKENS, VARIANTS, hf_tensors, load_cli, make_config, write_hf

from pagedjax import model, weights
from pagedjax.config import PRESETS


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(params, an orbax checkpoint of them)."""
    params = model.init_params(PRESETS["tiny"], seed=0)
    path = tmp_path_factory.mktemp("orbax") / "ckpt"
    weights.save_params(params, path)
    return params, path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_converted_checkpoint_computes_what_its_hf_directory_does(tmp_path, variant):
    """Every family the loader reads (biases, Qwen3's norms, a window, llama3 RoPE, tied
    heads), converted in bfloat16 from float32 tensors: the restored model is the HF
    directory's loaded in bfloat16, bit for bit, config and logits."""
    c = make_config(**VARIANTS[variant])
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c))
    out = tmp_path / "out"
    assert load_cli().main([str(hf), str(out), "--dtype", "bfloat16"]) == 0
    cfg_hf, p_hf = weights.load_hf_checkpoint(hf, dtype="bfloat16")
    cfg_out, p_out = weights.load_checkpoint(out)
    assert cfg_out == cfg_hf == weights.read_checkpoint_config(out)
    x = np.asarray(TOKENS)
    np.testing.assert_array_equal(model.forward(p_out, x), model.forward(p_hf, x))


@pytest.mark.parametrize("cfg", ["float32", {"dtype": "float32"}])
def test_restore_names_a_cfg_that_is_no_model_config(saved, cfg):
    """`restore_params(path, "float32")` (the dtype given where cfg goes) raised
    AttributeError: 'str' object has no attribute 'num_layers'."""
    with pytest.raises(TypeError, match=r"cfg must be a ModelConfig or None, got (str|dict)"):
        weights.restore_params(saved[1], cfg)


def test_save_names_params_that_are_not_params(saved, tmp_path):
    """`save_params(load_checkpoint(path), out)` (the (config, params) pair load_checkpoint
    returns) raised AttributeError: 'tuple' object has no attribute 'state'; nothing is
    written."""
    params = saved[0]
    for wrong in ((params.config, params), params.config):
        with pytest.raises(TypeError, match=r"params must be .*Params.*, got (tuple|ModelConfig)"):
            weights.save_params(wrong, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_extra_files_given_as_one_path(saved, tmp_path):
    """A str for extra_files was read as one file per character: "extra_files: ['e', 'k',
    'n', 'o'] named twice"; or, with no repeated character, files named by single letters
    copied from the working directory."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    for wrong in (str(tok), tok):
        with pytest.raises(TypeError, match=r"extra_files must be a list of paths, got"):
            weights.save_params(saved[0], tmp_path / "out", extra_files=wrong)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]


def test_save_names_a_missing_extra_file_before_writing_the_arrays(saved, tmp_path, monkeypatch):
    """A missing extra file was found only after orbax had written every array (minutes
    for a large model), by shutil's copy; it is named before any array is written."""
    import orbax.checkpoint as ocp

    def no_save(*a, **k):
        raise AssertionError("wrote the arrays before checking extra_files")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", no_save)
    gone = tmp_path / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=r"extra_files: no such file.*tokenizer\.json"):
        weights.save_params(saved[0], tmp_path / "out", extra_files=[gone])
    assert list(tmp_path.iterdir()) == []


def test_convert_help_says_what_dtype_a_float16_checkpoint_converts_to(tmp_path, capsys):
    """--help said the default dtype is "config.json's torch_dtype", but a float16
    checkpoint converts to bfloat16 (`hf_config._hf_dtype`), and config.json's `dtype`
    key (transformers 5) is read too."""
    c = make_config(**VARIANTS["llama_tied"], torch_dtype="float16")
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c))
    assert load_cli().main([str(hf), str(tmp_path / "out")]) == 0
    assert "in bfloat16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        load_cli().main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "config.json's torch_dtype)" not in help_text
    assert "float16 and bfloat16 checkpoints: bfloat16" in help_text


def test_convert_names_what_a_killed_conversion_left_beside_out_dir(tmp_path, capsys):
    """A conversion killed (the OOM killer, SIGKILL) mid-write leaves its hidden
    `.OUT.saving-*` directory of arrays beside OUT_DIR, GBs that no later run mentioned;
    a conversion to OUT_DIR names them."""
    c = make_config(**VARIANTS["llama_tied"])
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c))
    stale = tmp_path / ".out.saving-abc123"
    (stale / "params").mkdir(parents=True)
    (stale / "params" / "x").write_bytes(b"0" * 4096)
    (tmp_path / ".other.saving-zzz").mkdir()  # another checkpoint's: not named
    assert load_cli().main([str(hf), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert str(stale) in err and "interrupted" in err and ".other" not in err, err
    assert stale.is_dir()  # named, not removed: it may be a conversion still running
