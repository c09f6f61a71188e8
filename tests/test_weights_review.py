"""Checkpoint files that lie: safetensors headers whose byte ranges overlap, leave gaps or
point into the header, header fields of the wrong type, a header length past
safetensors' limit, a weights file that is a broken symlink, an orbax params/ folder
without its metadata. Each is a ValueError naming the file (and tensor) before any
tensor is read; none loads as a silently wrong model."""

import dataclasses
import gc
import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_weights import hf_tensors, make_config, write_hf

from pagedjax import model, safetensors_file, weights
from pagedjax.config import PRESETS


def write_raw(path, header, data: bytes):
    """A safetensors file with exactly this header (any JSON) and these data bytes."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def rewrite_header(file, change):
    """Rewrites a safetensors file's header through `change(header)`, data unchanged."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    write_raw(file, header, raw[8 + n :])


def f32(shape, start):
    stop = start + 4 * int(np.prod(shape))
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [start, stop]}


def test_a_tensor_reading_another_tensors_bytes_is_named(tmp_path):
    """model.norm.weight's header range moved onto layer 0's input norm (same shape): the
    sizes all check and the file ends where the last range does, and it loaded that norm
    twice. Overlapping ranges (and the gap left behind) are refused, as safetensors does."""
    c = make_config()
    ckpt = write_hf(tmp_path, c, hf_tensors(c))
    src = "model.layers.0.input_layernorm.weight"

    def move(h):
        h["model.norm.weight"]["data_offsets"] = list(h[src]["data_offsets"])

    rewrite_header(ckpt / weights.SAFETENSORS_FILE, move)
    with pytest.raises(weights.CheckpointError, match="model.safetensors is corrupt") as e:
        weights.load_hf_checkpoint(ckpt)
    assert "model.norm.weight" in str(e.value) and src in str(e.value), str(e.value)
    assert "overlap" in str(e.value)


@pytest.mark.parametrize(
    "header, match",
    [
        # 8 bytes nothing claims before the first tensor: it read the wrong 4 floats
        ({"a": f32([2], 8)}, r"a: .*starts 8 bytes after the header"),
        # a gap between two tensors
        ({"a": f32([1], 0), "b": f32([2], 8)}, r"b: .*starts 4 bytes after a ends"),
        # two names, one range
        ({"a": f32([2], 0), "b": f32([2], 0), "c": f32([2], 8)}, r"b: .*overlaps a.s bytes"),
    ],
)
def test_gaps_and_overlaps_in_the_data_are_named(tmp_path, header, match):
    file = write_raw(tmp_path / "t.safetensors", header, np.arange(4, dtype="<f4").tobytes())
    with pytest.raises(ValueError, match=f"t.safetensors is corrupt: {match}"):
        safetensors_file.read_header(file)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [4.7], "data_offsets": [0, 16]},  # read as 4
        {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 99]},
        {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]},  # into the header
        {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]},  # was a raw TypeError
        {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]},
        "F32",
    ],
)
def test_header_fields_of_the_wrong_type_are_named(tmp_path, entry):
    """safetensors requires non-negative integer dims and exactly two offsets; the hand
    reader truncated a float dim, parsed a string one, and raised a bare TypeError for a
    dtype that was not a string."""
    file = write_raw(tmp_path / "t.safetensors", {"w": entry}, bytes(16))
    with pytest.raises(ValueError, match=r"t.safetensors is not a valid safetensors file.*\bw\b"):
        safetensors_file.read_header(file)


def test_deeply_nested_json_is_a_valueerror(tmp_path):
    text = b"[" * 100_000
    (tmp_path / "t.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(ValueError, match="t.safetensors is not a valid safetensors file"):
        safetensors_file.read_header(tmp_path / "t.safetensors")


def test_a_header_length_past_safetensors_limit_is_refused_unread(tmp_path, monkeypatch):
    """A corrupt length under the file's size (a multi-GB shard) made the reader read and
    parse that many bytes; safetensors refuses a header over 100 MB, and so does this."""
    file = tmp_path / "t.safetensors"
    n = 100_000_001
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n + 16)  # sparse: no disk, no time
    with pytest.raises(ValueError, match="t.safetensors.*header length 100000001 .*100000000"):
        safetensors_file.read_header(file)


def test_valid_files_still_read_exactly(tmp_path):
    """Mixed dtypes (safetensors orders them by alignment, not by name), a zero-size
    tensor and metadata: every range checks, every tensor reads back as written."""
    rng = np.random.default_rng(0)
    t = {
        "z": rng.standard_normal((3, 5)).astype(np.float16),
        "a": rng.standard_normal((2, 7)).astype(np.float64),
        "m": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), np.float32),
        "i": np.arange(5, dtype=np.int64),
    }
    save_file(t, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    infos = safetensors_file.read_header(tmp_path / "t.safetensors")
    assert sorted(infos) == sorted(t)
    with open(tmp_path / "t.safetensors", "rb") as f:
        for name, x in t.items():
            if infos[name].dtype in safetensors_file.DTYPES:
                np.testing.assert_array_equal(safetensors_file.read_tensor(f, infos[name]), x)


def test_a_broken_symlink_is_named_as_one(tmp_path):
    """A hub-cache snapshot whose blob was deleted: the error said the file was missing
    'named in model.safetensors.index.json', in a directory that has no index."""
    c = make_config()
    ckpt = write_hf(tmp_path / "snap", c, hf_tensors(c))
    (ckpt / weights.SAFETENSORS_FILE).unlink()
    (ckpt / weights.SAFETENSORS_FILE).symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(weights.CheckpointError) as e:
        weights.load_hf_checkpoint(ckpt)
    msg = str(e.value)
    assert "model.safetensors is a broken symlink" in msg and "blobs/gone" in msg, msg
    assert weights.INDEX_FILE not in msg, msg


def test_orbax_params_without_metadata_are_named(tmp_path):
    """A params/ folder copied in part (no _METADATA) or emptied: orbax's metadata is
    None, which was a bare TypeError; the error names the folder."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype="float32")
    weights.save_params(model.init_params(cfg, seed=0), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "params" / "_METADATA").unlink()
    with pytest.raises(ValueError, match=r"ckpt/params.*metadata"):
        weights.restore_params(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "params")
    (tmp_path / "ckpt" / "params").mkdir()
    with pytest.raises(ValueError, match=r"ckpt/params.*metadata"):
        weights.load_checkpoint(tmp_path / "ckpt")


# (orbax's failed reads leave coroutines and futures that report their errors when
# collected: collected below, inside the test, and not reported again)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_orbax_array_data_gone_is_named(tmp_path):
    """The array files of params/ emptied (a disk that filled, a partial copy): orbax
    raised a bare Exception holding a page of TensorStore spec; the error names the
    folder and the array that failed, in one paragraph."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype="float32")
    weights.save_params(model.init_params(cfg, seed=0), tmp_path / "ckpt")
    data = [p for p in (tmp_path / "ckpt" / "params").glob("ocdbt.process_*/d/*")]
    assert data
    for p in data:
        p.write_bytes(b"")
    array = r'"[\w.]+\.(kernel|embedding|scale)/'  # which one fails first varies
    with pytest.raises(ValueError, match=f"ckpt/params is damaged: .*{array}") as e:
        weights.restore_params(tmp_path / "ckpt")
    assert len(str(e.value)) < 800
    del e
    gc.collect()  # (here, where the test captures their reports; not at the worker's exit)
