"""Checkpoint edge cases: PyTorch-only weights, a tied head that differs from the
embedding (found before the long load), a failed orbax overwrite, a restore in
another dtype, the peak host memory of a load, values float16 cannot hold, quantized
checkpoints, orbax restores checked against their config before the read."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_weights import hf_tensors, make_config, write_hf

from pagedjax import model, orbax_checkpoint, weights
from pagedjax.config import PRESETS


def model_config():
    return dataclasses.replace(PRESETS["tiny"], dtype="float32")


def test_pytorch_bin_only_checkpoint_names_the_files(tmp_path):
    """A repo downloaded without its safetensors (or one that has none) says what it has
    and what to do, instead of 'no weights'."""
    c = make_config()
    (tmp_path / "config.json").write_text(json.dumps(c))
    for name in ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"):
        (tmp_path / name).write_bytes(b"PK\x03\x04")
    (tmp_path / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    for load in (weights.load_checkpoint, weights.load_hf_checkpoint):
        with pytest.raises(
            FileNotFoundError, match=r"pytorch_model-00001-of-00002.bin.*safetensors"
        ):
            load(tmp_path)


@pytest.mark.parametrize("disk_dtype", [np.float32, ml_dtypes.bfloat16])
def test_tied_head_differing_is_refused_before_any_tensor_loads(tmp_path, monkeypatch, disk_dtype):
    """The check reads only the two matrices, a few rows at a time (a difference in the
    last block counts), and runs before pass 2: a 7B load no longer ends in this error."""
    c = make_config(tie_word_embeddings=True)
    t = {k: v.astype(disk_dtype) for k, v in hf_tensors(c).items()}
    head = t["model.embed_tokens.weight"].copy()
    head[-1, -1] += 1  # the last row only: every block must be compared
    write_hf(tmp_path / "diff", c, {**t, "lm_head.weight": head}, num_shards=2)
    same = {**t, "lm_head.weight": t["model.embed_tokens.weight"].copy()}
    write_hf(tmp_path / "same", c, same, num_shards=2)
    # 3 rows a block at f32 (raising=False: the old code had no blocks, and failed later)
    monkeypatch.setattr(weights, "_COMPARE_BYTES", 3 * 32 * 4, raising=False)

    loaded = []
    real = weights._load_shard
    monkeypatch.setattr(weights, "_load_shard", lambda *a: loaded.append(a[0]) or real(*a))
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(weights.CheckpointError, match="lm_head.weight differs"):
            weights.load_hf_checkpoint(tmp_path / "diff", dtype=dtype)
    assert not loaded
    cfg, params = weights.load_hf_checkpoint(tmp_path / "same")
    assert cfg.tie_embeddings and loaded
    assert "lm_head.kernel" not in model.params_to_flat(params)


def test_orbax_extra_files_arrive_with_the_checkpoint_or_not_at_all(tmp_path, monkeypatch):
    """convert_checkpoint.py copied the tokenizer files after the swap: a copy that
    failed left the new weights without them (and the old files gone)."""
    import shutil

    cfg = model_config()
    old_files, new_files = tmp_path / "old", tmp_path / "new"
    for d, text in ((old_files, "old"), (new_files, "new")):
        d.mkdir()
        (d / "tokenizer.json").write_text(text)
        (d / "tokenizer_config.json").write_text(text)
    old = model.init_params(cfg, seed=0)
    ckpt = tmp_path / "ckpt"
    weights.save_params(old, ckpt, extra_files=sorted(old_files.iterdir()))
    assert (ckpt / "tokenizer.json").read_text() == "old"
    copy2 = shutil.copy2

    def full_disk(src, dst, **k):
        if Path(src).name == "tokenizer_config.json":
            raise OSError(28, "No space left on device")
        return copy2(src, dst, **k)

    monkeypatch.setattr(shutil, "copy2", full_disk)
    new = model.init_params(cfg, seed=1)
    with pytest.raises(OSError, match="No space left"):
        weights.save_params(new, ckpt, overwrite=True, extra_files=sorted(new_files.iterdir()))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "new", "old"]
    assert [(ckpt / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json")] == [
        "old",
        "old",
    ]
    _, back = weights.load_checkpoint(ckpt)
    emb = "embed_tokens.embedding"
    np.testing.assert_array_equal(
        np.asarray(model.params_to_flat(back)[emb]), np.asarray(model.params_to_flat(old)[emb])
    )
    for bad in ([new_files / "tokenizer.json", old_files / "tokenizer.json"], [ckpt / "params"]):
        with pytest.raises(ValueError, match="named twice or as the checkpoint's own files"):
            weights.save_params(new, tmp_path / "other", extra_files=bad)
        assert not (tmp_path / "other").exists()


def test_a_failed_orbax_overwrite_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """save_params writes beside the target and swaps it in once complete: a save that
    fails halfway leaves the old checkpoint whole (it was deleted first) and no partial
    directory behind."""
    cfg = model_config()
    old = model.init_params(cfg, seed=0)
    weights.save_params(old, tmp_path / "ckpt")
    new = model.init_params(cfg, seed=1)

    def broken(params):
        raise RuntimeError("disk full")

    monkeypatch.setattr(orbax_checkpoint, "params_to_flat", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        weights.save_params(new, tmp_path / "ckpt", overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _, back = weights.load_checkpoint(tmp_path / "ckpt")
    for k, v in model.params_to_flat(old).items():
        np.testing.assert_array_equal(np.asarray(model.params_to_flat(back)[k]), np.asarray(v))
    weights.save_params(new, tmp_path / "ckpt", overwrite=True)  # and a good one replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _, back = weights.load_checkpoint(tmp_path / "ckpt")
    emb = "embed_tokens.embedding"
    np.testing.assert_array_equal(
        np.asarray(model.params_to_flat(back)[emb]), np.asarray(model.params_to_flat(new)[emb])
    )


def test_orbax_restore_in_another_dtype_casts_as_it_reads(tmp_path):
    """restore_params(dtype=...) asks orbax for that dtype (one copy in memory, not the
    stored arrays and then their cast); the values are the stored ones, cast."""
    cfg = model_config()
    params = model.init_params(cfg, seed=0)
    weights.save_params(params, tmp_path / "ckpt")
    p16 = weights.restore_params(tmp_path / "ckpt", dtype="bfloat16")
    got, want = model.params_to_flat(p16), model.params_to_flat(params)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v.astype(jnp.bfloat16)))


def test_a_tensor_in_two_shards_or_in_another_shard_than_the_index_says(tmp_path):
    """Two shards that both hold a tensor (which copy would load?) and an index that puts
    a tensor in a shard that lacks it, while another shard has it, are both named."""
    c = make_config()
    t = hf_tensors(c)
    ckpt = write_hf(tmp_path / "dup", c, t, num_shards=2)
    weight_map = json.loads((ckpt / weights.INDEX_FILE).read_text())["weight_map"]
    other = ckpt / next(f for f in weight_map.values() if f != weight_map["model.norm.weight"])
    names = list(weights._read_header(other))
    save_file({n: t[n] for n in [*names, "model.norm.weight"]}, str(other))
    with pytest.raises(weights.CheckpointError, match="duplicate tensor model.norm.weight in"):
        weights.load_hf_checkpoint(ckpt)

    ckpt = write_hf(tmp_path / "moved", c, t, num_shards=2)
    index_file = ckpt / weights.INDEX_FILE
    index = json.loads(index_file.read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = next(
        f for f in set(index["weight_map"].values()) if f != index["weight_map"][name]
    )
    index_file.write_text(json.dumps(index))
    with pytest.raises(weights.CheckpointError, match=f"puts {name} in .*which lacks it"):
        weights.load_hf_checkpoint(ckpt)


def test_bytes_after_the_last_tensor_are_named(tmp_path):
    """safetensors refuses a file longer than its header says only when it is opened in
    pass 2; the header check names it first."""
    c = make_config()
    ckpt = write_hf(tmp_path, c, hf_tensors(c))
    with open(ckpt / weights.SAFETENSORS_FILE, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(weights.CheckpointError, match="corrupt: 16 bytes after its last tensor"):
        weights.load_hf_checkpoint(ckpt)


def test_which_weight_files_a_directory_loads(tmp_path):
    """The index when there is one (vLLM's rule; it wins over a model.safetensors beside
    it), else model.safetensors, else every *.safetensors file in the directory."""
    c = make_config()
    t = hf_tensors(c)
    ckpt = write_hf(tmp_path / "both", c, t, num_shards=2)
    stale = {k: v + 1 for k, v in hf_tensors(c, seed=1).items()}
    save_file(stale, str(ckpt / weights.SAFETENSORS_FILE))
    _, params = weights.load_hf_checkpoint(ckpt)
    np.testing.assert_array_equal(
        np.asarray(model.params_to_flat(params)["norm.scale"]), t["model.norm.weight"]
    )

    other = write_hf(tmp_path / "named", c, t, num_shards=2)
    (other / weights.INDEX_FILE).unlink()
    for k, f in enumerate(sorted(other.glob("*.safetensors"))):
        f.rename(other / f"weights-{k}.safetensors")
    _, params = weights.load_hf_checkpoint(other)
    np.testing.assert_array_equal(
        np.asarray(model.params_to_flat(params)["norm.scale"]), t["model.norm.weight"]
    )

    # An index naming its files by path from the directory ("./x", as os.path.join reads
    # it in HF): each tensor was "not in" its shard, since only the file names compared.
    dotted = write_hf(tmp_path / "dotted", c, t, num_shards=2)
    index = json.loads((dotted / weights.INDEX_FILE).read_text())
    index["weight_map"] = {k: f"./{v}" for k, v in index["weight_map"].items()}
    (dotted / weights.INDEX_FILE).write_text(json.dumps(index))
    _, params = weights.load_hf_checkpoint(dotted)
    np.testing.assert_array_equal(
        np.asarray(model.params_to_flat(params)["norm.scale"]), t["model.norm.weight"]
    )


def test_save_shards_hold_something_and_the_size_is_positive(tmp_path):
    """A shard size smaller than every tensor gives each tensor its own file (no empty
    first shard, every file in the index); a size of 0 is refused, not read as none."""
    cfg = model_config()
    params = model.init_params(cfg, seed=0)
    weights.save_hf_checkpoint(params, cfg, tmp_path, shard_size_bytes=1)
    index = json.loads((tmp_path / weights.INDEX_FILE).read_text())["weight_map"]
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == sorted(set(index.values()))
    assert len(files) == len(index) == len(model.params_to_flat(params))
    for bad in (0, -1):
        with pytest.raises(
            ValueError, match=f"shard_size_bytes must be positive, got shard_size_bytes={bad}"
        ):
            weights.save_hf_checkpoint(params, cfg, tmp_path / "x", shard_size_bytes=bad)


_PEAK_RSS_CHILD = """
import sys
from pagedjax import weights

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))

weights.load_hf_checkpoint(sys.argv[1])  # imports and compiles what loading uses
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := the current RSS (Linux 4.0+)
before = rss("VmRSS")
cfg, params = weights.load_hf_checkpoint(sys.argv[2])
print(rss("VmHWM") - before)
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc")
def test_loading_holds_about_one_copy_of_the_weights(tmp_path):
    """In a fresh process, loading a bf16 checkpoint of 85 MB (a 64 MB embedding) peaks
    under 1.5x its bytes above the RSS before (1.18x measured). Reading through
    safetensors took 2.8-3.2x: its mmap kept the shard's pages in RSS, plus its numpy
    copy and jit's copies of the input and output of a no-op cast."""
    small = make_config(torch_dtype="bfloat16")
    write_hf(tmp_path / "small", small, hf_tensors(small))
    c = make_config(
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=16384,
        num_hidden_layers=1,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(c).items()}
    write_hf(tmp_path / "big", c, t)
    nbytes = sum(v.nbytes for v in t.values())
    del t
    root = str(Path(weights.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-c", _PEAK_RSS_CHILD, str(tmp_path / "small"), str(tmp_path / "big")]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    peak = int(run.stdout.split()[-1])
    assert peak < 1.5 * nbytes, f"loading {nbytes} bytes peaked {peak / nbytes:.2f}x above start"


def test_values_beyond_float16_are_named_not_made_inf(tmp_path):
    """bf16 and fp32 hold values that float16 cannot (|x| >= 65520); loading in float16
    names each such tensor instead of serving infs, as a plain cast (and HF) would."""
    c = make_config(torch_dtype="bfloat16")
    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(c).items()}
    t["model.layers.0.mlp.up_proj.weight"][1, 2] = -1e6  # transposed on load
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.float32)  # fp32 in bf16
    t["model.norm.weight"][3] = 7e4
    ckpt = write_hf(tmp_path, c, t, num_shards=2)
    with pytest.raises(weights.CheckpointError, match="does not fit in float16") as info:
        weights.load_hf_checkpoint(ckpt, dtype="float16")
    msg = str(info.value)
    assert "model.layers.0.mlp.up_proj.weight (BF16) has 1 values" in msg
    assert "up to |x| = 9.994e+05" in msg  # -1e6 in bf16: -999424
    assert "model.norm.weight (F32) has 1 values beyond float16's range, up to |x| = 7e+04" in msg
    # The two tensors; the hint follows them, not counted (it was: "3 problems").
    assert len(info.value.problems) == 2 and "(2 problems)" in msg
    assert msg.endswith("load it in bfloat16 or float32 (dtype=...), which hold these values")
    cfg, params = weights.load_hf_checkpoint(ckpt)  # bfloat16 holds them
    assert float(model.params_to_flat(params)["norm.scale"][3]) == 70144.0  # 7e4 in bf16


def test_orbax_restore_refuses_another_models_config_by_name(tmp_path, monkeypatch):
    """restore_params(path, cfg) may change how the stored arrays run (dtype, eos ids), not
    what they are: a cfg of another shape, or of the same shapes read another way (8
    heads of 8 in place of 4 heads of 16: every array fits), is refused by field before
    any array is read (the first was refused after the whole read, the second loaded)."""
    import orbax.checkpoint as ocp

    cfg = model_config()
    weights.save_params(model.init_params(cfg, seed=0), tmp_path / "ckpt")
    regrouped = dataclasses.replace(cfg, num_heads=8, head_dim=8, num_kv_heads=4)
    assert {k: v.shape for k, v in model.param_shapes(regrouped).items()} == {
        k: v.shape for k, v in model.param_shapes(cfg).items()
    }
    restore = ocp.StandardCheckpointer.restore
    read = []
    monkeypatch.setattr(
        ocp.StandardCheckpointer, "restore", lambda *a, **k: read.append(1) or restore(*a, **k)
    )
    for other, match in (
        (regrouped, r"num_heads=8 \(stored 4\), num_kv_heads=4 \(stored 2\), head_dim=8 "),
        (dataclasses.replace(cfg, hidden_size=32), r"hidden_size=32 \(stored 64\)"),
        (dataclasses.replace(cfg, tie_embeddings=True), r"tie_embeddings=True \(stored False\)"),
    ):
        with pytest.raises(ValueError, match=f"ckpt.*was saved for another model.*{match}"):
            weights.restore_params(tmp_path / "ckpt", other)
    assert not read
    runs = dataclasses.replace(cfg, dtype="bfloat16", eos_token_ids=(7,), rope_theta=500.0)
    assert weights.restore_params(tmp_path / "ckpt", runs).config == runs


def test_orbax_arrays_that_do_not_fit_their_stored_config_are_named(tmp_path):
    """A pagedjax_checkpoint.json edited by hand, or a params/ folder copied from another
    checkpoint: each array that differs is named with both shapes (orbax's own error was
    a page of tensorstore spec without the array's name)."""
    cfg = model_config()
    weights.save_params(model.init_params(cfg, seed=0), tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / weights.ORBAX_META_FILE
    meta = json.loads(meta_file.read_text())
    for change, lines in (
        (
            dict(intermediate_size=96),
            [
                "shape mismatch: layers.0.mlp.up_proj.kernel: stored [64, 128], "
                "config expects [64, 96]",
                "shape mismatch: layers.1.mlp.down_proj.kernel: stored [128, 64], "
                "config expects [96, 64]",
            ],
        ),
        (dict(tie_embeddings=True), ["unexpected: lm_head.kernel [64, 256]"]),
        (dict(num_layers=3), ["missing: layers.2.mlp.up_proj.kernel [64, 128]"]),
    ):
        meta_file.write_text(json.dumps({**meta, "config": {**meta["config"], **change}}))
        with pytest.raises(ValueError, match="does not match the config in .*checkpoint.json") as e:
            weights.restore_params(tmp_path / "ckpt")
        for line in lines:
            assert line in str(e.value), (line, str(e.value))
        assert len(str(e.value)) < 4000  # the problems, not a dump


def test_orbax_values_beyond_float16_are_named_not_made_inf(tmp_path):
    """As an HF load does (test_values_beyond_float16_are_named_not_made_inf): a restore
    in float16 of a bfloat16 checkpoint names the arrays float16 cannot hold, where orbax's
    cast made them inf."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16")
    flat = model.params_to_flat(model.init_params(cfg, seed=0))
    flat["norm.scale"] = flat["norm.scale"].at[3].set(1e6).at[5].set(-7e4)
    weights.save_params(model.params_from_flat(cfg, flat), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="does not fit in float16") as e:
        weights.load_checkpoint(tmp_path / "ckpt", dtype="float16")
    assert "norm.scale has 2 values beyond float16's range" in str(e.value)
    assert "embed_tokens" not in str(e.value)
    p16 = weights.restore_params(tmp_path / "ckpt", dtype="bfloat16")
    assert float(model.params_to_flat(p16)["norm.scale"][3]) == 999424.0  # 1e6 in bf16


def test_a_quantized_checkpoint_says_so_before_the_list(tmp_path):
    """GPTQ/AWQ (qweight, qzeros, scales, g_idx) and FP8 (weight_scale) tensors, in a
    checkpoint whose config.json lacks the quantization_config that from_hf refuses
    (AutoGPTQ kept it in quantize_config.json): the first line says what the checkpoint
    is, where it read "does not match its config" above 40 lines of missing weights."""
    c = make_config()
    t = hf_tensors(c)
    for name in [k for k in t if k.endswith("_proj.weight")]:
        base = name.removesuffix(".weight")
        rows, cols = t.pop(name).shape
        t[base + ".qweight"] = np.zeros((cols // 8, rows), np.int32)
        t[base + ".qzeros"] = np.zeros((1, rows // 8), np.int32)
        t[base + ".scales"] = np.ones((1, rows), np.float16)
        t[base + ".g_idx"] = np.zeros(cols, np.int32)
    with pytest.raises(weights.CheckpointError) as e:
        weights.load_hf_checkpoint(write_hf(tmp_path / "gptq", c, t))
    first = str(e.value).splitlines()[0]
    assert "is quantized" in first and "model.layers.0.mlp.down_proj.g_idx" in first, first
    assert "unquantized" in first
    assert "missing: model.layers.0.mlp.down_proj.weight [32, 48]" in e.value.problems

    fp8 = hf_tensors(c)
    up = "model.layers.0.mlp.up_proj.weight"
    fp8[up] = fp8[up].astype(ml_dtypes.float8_e4m3fn)
    fp8[up + "_scale"] = np.ones((), np.float32)
    with pytest.raises(weights.CheckpointError) as e:
        weights.load_hf_checkpoint(write_hf(tmp_path / "fp8", c, fp8))
    first = str(e.value).splitlines()[0]
    assert "is quantized" in first and "up_proj.weight_scale" in first, first
    assert f"unsupported dtype: {up} is F8_E4M3, not ['BF16', 'F16', 'F32', 'F64']" in str(e.value)


@pytest.mark.parametrize("absolute", [False, True])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path, absolute):
    """A weight_map path that leaves the checkpoint directory ("../x", "/x") would load
    some other file as this checkpoint's shard (here the real one, moved out)."""
    c = make_config()
    ckpt = write_hf(tmp_path / "ckpt", c, hf_tensors(c), num_shards=2)
    index = json.loads((ckpt / weights.INDEX_FILE).read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (ckpt / shard).rename(tmp_path / "outside.safetensors")
    where = str(tmp_path / "outside.safetensors") if absolute else "../outside.safetensors"
    index["weight_map"] = {k: where if v == shard else v for k, v in index["weight_map"].items()}
    (ckpt / weights.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"outside the checkpoint directory: '{where}'"):
        weights.load_hf_checkpoint(ckpt)
