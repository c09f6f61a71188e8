"""HF checkpoint edge cases a real download meets: PyTorch-only weights, a tied head
that differs from the embedding (found before the long load)."""

import json

import ml_dtypes
import numpy as np
import pytest
from test_weights import hf_tensors, make_config, write_hf

from pagedjax import model, weights


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
