"""HF checkpoint loading, HF saving, orbax save/restore and the convert CLI.

The checkpoints here are written by hand with HF tensor names (not through
`save_hf_checkpoint`), and the loaded model is checked against a plain-numpy Llama
forward that reads those HF tensors directly, so the name mapping and the model math
are both checked against something independent of pagedjax.
"""

import dataclasses
import importlib.util
import json
import math
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from pagedjax import model, weights
from pagedjax.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
TOKENS = np.array([[3, 17, 41, 5, 9, 60, 22, 1, 33, 12, 7]])  # [B=1, T=11]

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VARIANTS = {
    # head_dim 8: frequencies 1, .1, .01, .001 -> wavelengths 6.3 (medium band), 63, 628,
    # 6283 (all > 16: divided by factor), so every branch of llama3 scaling is used.
    "llama3_untied": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "llama_tied": dict(tie_word_embeddings=True),
    "qwen2_bias": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True
    ),
    # q_norm/k_norm, H * D = 64 != E = 32, and an epsilon and theta far from the
    # defaults, so that reading either key wrongly (or not at all) changes the logits.
    "qwen3_norms": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=16,
        rms_norm_eps=0.1,
        rope_theta=500.0,
        tie_word_embeddings=True,
    ),
    "mistral_window": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4
    ),
    # LlamaAttention: q/k/v and o_proj all take bias=config.attention_bias.
    "llama_attention_bias": dict(attention_bias=True),
}


def make_config(**overrides) -> dict:
    return {**BASE_CONFIG, **overrides}


def hf_tensors(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors under HF names, in HF layout ([out, in] linear weights)."""
    rng = np.random.default_rng(seed)
    e, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    h, k = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or e // h
    # HF: Llama and Qwen3 bias q/k/v and o_proj by attention_bias; Qwen2 always q/k/v
    # and never o_proj; Mistral never (both ignore attention_bias).
    family = c.get("model_type")
    attention_bias = bool(c.get("attention_bias")) and family in ("llama", "qwen3")
    bias = attention_bias or family == "qwen2"

    def mat(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(v, e, scale=1.0)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = 1 + mat(e, scale=0.1)
        for proj, rows in (("q", h * d), ("k", k * d), ("v", k * d)):
            t[p + f"self_attn.{proj}_proj.weight"] = mat(rows, e)
            if bias:
                t[p + f"self_attn.{proj}_proj.bias"] = mat(rows, scale=0.5)
        if c.get("model_type") == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + mat(d, scale=0.3)
            t[p + "self_attn.k_norm.weight"] = 1 + mat(d, scale=0.3)
        t[p + "self_attn.o_proj.weight"] = mat(e, h * d)
        if attention_bias:
            t[p + "self_attn.o_proj.bias"] = mat(e, scale=0.5)
        t[p + "post_attention_layernorm.weight"] = 1 + mat(e, scale=0.1)
        t[p + "mlp.gate_proj.weight"] = mat(i, e)
        t[p + "mlp.up_proj.weight"] = mat(i, e)
        t[p + "mlp.down_proj.weight"] = mat(e, i)
    t["model.norm.weight"] = 1 + mat(e, scale=0.1)
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = mat(v, e)
    return t


def write_hf(path: Path, c: dict, tensors: dict, *, num_shards: int = 1) -> Path:
    """Writes config.json and safetensors; num_shards > 1 writes an index too."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(c))
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = list(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        save_file(part, str(path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


# ----------------------------------------------------------------------------- numpy Llama


def rope_inv_freq(c: dict) -> np.ndarray:
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    inv = 1.0 / c["rope_theta"] ** (np.arange(0, d, 2) / d)
    rs = c.get("rope_scaling")
    if not rs:
        return inv
    old = rs["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / rs["high_freq_factor"]:
            out.append(f)
        elif wavelen > old / rs["low_freq_factor"]:
            out.append(f / rs["factor"])
        else:
            smooth = (old / wavelen - rs["low_freq_factor"]) / (
                rs["high_freq_factor"] - rs["low_freq_factor"]
            )
            out.append((1 - smooth) * f / rs["factor"] + smooth * f)
    return np.array(out)


def numpy_llama(t: dict, c: dict, tokens: np.ndarray) -> np.ndarray:
    """HF Llama/Qwen2/Qwen3/Mistral forward in float64 numpy: tokens [T] -> logits [T, V].

    Qwen3 RMS-normalises each query and key head before RoPE; Mistral's sliding window
    lets position p see keys j with p - W < j <= p.
    """
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    h, kh = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // h
    n = len(tokens)

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c["rms_norm_eps"])

    def linear(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    angles = np.arange(n)[:, None] * rope_inv_freq(c)[None, :]  # [T, D/2]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]  # [T, 1, D]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]

    def rope(x):  # [T, N, D]
        rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    x = t["model.embed_tokens.weight"][tokens]  # [T, E]
    causal = np.tril(np.ones((n, n), bool))
    if c.get("model_type") == "mistral" and c.get("sliding_window"):
        causal &= np.triu(np.ones((n, n), bool), 1 - c["sliding_window"])
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = rms(x, t[p + "input_layernorm.weight"])
        q = linear(a, p + "self_attn.q_proj").reshape(n, h, d)
        k = linear(a, p + "self_attn.k_proj").reshape(n, kh, d)
        if c.get("model_type") == "qwen3":  # per head, over D, before RoPE
            q = rms(q, t[p + "self_attn.q_norm.weight"])
            k = rms(k, t[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        v = linear(a, p + "self_attn.v_proj").reshape(n, kh, d)
        o = np.zeros((n, h, d))
        for head in range(h):
            kv = head // (h // kh)
            s = q[:, head] @ k[:, kv].T / math.sqrt(d)
            s = np.where(causal, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            o[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + linear(o.reshape(n, h * d), p + "self_attn.o_proj")
        m = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = linear(m, p + "mlp.gate_proj")
        x = x + linear(
            gate / (1 + np.exp(-gate)) * linear(m, p + "mlp.up_proj"), p + "mlp.down_proj"
        )
    x = rms(x, t["model.norm.weight"])
    head_w = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head_w.T


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out))
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("num_shards", [1, 3])
def test_load_matches_numpy_llama(tmp_path, variant, num_shards):
    c = make_config(**VARIANTS[variant])
    t = hf_tensors(c)
    write_hf(tmp_path, c, t, num_shards=num_shards)
    if num_shards > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == num_shards
    cfg, params = weights.load_hf_checkpoint(tmp_path)
    assert cfg.tie_embeddings == c["tie_word_embeddings"]
    assert cfg.qkv_bias == (variant in ("qwen2_bias", "llama_attention_bias"))
    assert cfg.o_bias == (variant == "llama_attention_bias")
    assert cfg.qk_norm == (variant == "qwen3_norms")
    assert cfg.sliding_window == c.get("sliding_window")
    assert ("lm_head.kernel" in model.params_to_flat(params)) == (not c["tie_word_embeddings"])
    logits = model.forward(params, jnp.asarray(TOKENS))[0]
    assert rel_err(logits, numpy_llama(t, c, TOKENS[0])) < 1e-4


def test_bf16_checkpoint(tmp_path):
    c = make_config(torch_dtype="bfloat16", tie_word_embeddings=True)
    t16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(c).items()}
    write_hf(tmp_path, c, t16, num_shards=2)
    ref = numpy_llama(t16, c, TOKENS[0])  # of the bf16 values, in float64
    cfg32, p32 = weights.load_hf_checkpoint(tmp_path, dtype="float32")
    assert cfg32.dtype == "float32"
    # bf16 -> f32 is exact, so the float32 model sees exactly the checkpoint's values.
    np.testing.assert_array_equal(
        np.asarray(model.params_to_flat(p32)["layers.1.mlp.up_proj.kernel"]),
        t16["model.layers.1.mlp.up_proj.weight"].astype(np.float32).T,
    )
    assert rel_err(model.forward(p32, jnp.asarray(TOKENS))[0], ref) < 1e-4
    cfg, p = weights.load_hf_checkpoint(tmp_path)
    assert cfg.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in model.params_to_flat(p).values())
    assert rel_err(model.forward(p, jnp.asarray(TOKENS))[0], ref) < 1e-2


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_raw_reader_matches_safetensors(tmp_path, dtype):
    x = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(dtype)
    y = np.arange(4, dtype=np.float32)
    save_file({"a": y, "x": x}, str(tmp_path / "t.safetensors"))
    infos = weights._read_header(tmp_path / "t.safetensors")
    with open(tmp_path / "t.safetensors", "rb") as f:
        raw, a = weights._read_tensor(f, infos["x"]), weights._read_tensor(f, infos["a"])
    with safe_open(str(tmp_path / "t.safetensors"), framework="numpy") as f:
        lib = f.get_tensor("x")
    assert raw.dtype == lib.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(raw, lib)
    np.testing.assert_array_equal(a, y)


def test_missing_keys_are_all_listed(tmp_path):
    c = make_config()
    t = hf_tensors(c)
    gone = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    for name in gone:
        del t[name]
    write_hf(tmp_path, c, t, num_shards=2)
    with pytest.raises(weights.CheckpointError) as info:
        weights.load_hf_checkpoint(tmp_path)
    msg = str(info.value)
    assert sorted(m.split()[0] for m in info.value.missing) == sorted(gone)
    assert "model.layers.1.mlp.up_proj.weight [48, 32]" in msg  # HF layout shape
    assert "tie_word_embeddings" in msg  # the hint for a missing lm_head
    assert not info.value.unexpected


def test_missing_qkv_bias_for_qwen2(tmp_path):
    c = make_config(**VARIANTS["qwen2_bias"])
    t = {k: v for k, v in hf_tensors(c).items() if not k.endswith(".bias")}
    write_hf(tmp_path, c, t)
    with pytest.raises(weights.CheckpointError) as info:
        weights.load_hf_checkpoint(tmp_path)
    assert len(info.value.missing) == 6  # q, k, v biases in each of 2 layers
    assert all(".bias" in m for m in info.value.missing)


def test_missing_o_proj_bias_with_attention_bias_is_named(tmp_path):
    c = make_config(**VARIANTS["llama_attention_bias"])
    t = hf_tensors(c)
    assert sum(k.endswith("o_proj.bias") for k in t) == c["num_hidden_layers"]
    del t["model.layers.1.self_attn.o_proj.bias"]
    write_hf(tmp_path, c, t, num_shards=2)
    with pytest.raises(weights.CheckpointError) as info:
        weights.load_hf_checkpoint(tmp_path)
    assert info.value.missing == ["model.layers.1.self_attn.o_proj.bias [32]"]
    assert not info.value.unexpected
    assert "missing: model.layers.1.self_attn.o_proj.bias [32]" in str(info.value)


def test_qwen2_and_mistral_ignore_attention_bias_as_hf_does(tmp_path):
    """HF's Qwen2Attention and MistralAttention hard-code their biases: attention_bias
    true loads the bias-free (Mistral) or q/k/v-only (Qwen2) checkpoint, and an o_proj
    bias there is refused rather than silently added or dropped."""
    for name in ("mistral_window", "qwen2_bias"):
        c = make_config(**VARIANTS[name], attention_bias=True)
        t = hf_tensors(c)
        assert not any(k.endswith("o_proj.bias") for k in t)
        cfg, _ = weights.load_hf_checkpoint(write_hf(tmp_path / name, c, t))
        assert (cfg.qkv_bias, cfg.o_bias) == (name == "qwen2_bias", False)
        t["model.layers.0.self_attn.o_proj.bias"] = np.ones(32, np.float32)
        write_hf(tmp_path / f"{name}_o", c, t)
        with pytest.raises(weights.CheckpointError) as info:
            weights.load_hf_checkpoint(tmp_path / f"{name}_o")
        assert info.value.unexpected == ["model.layers.0.self_attn.o_proj.bias [32]"]


def test_orbax_config_json_keeps_o_bias():
    c = make_config(**VARIANTS["llama_attention_bias"])
    cfg = weights.config_from_json(weights.config_to_json(ModelConfig.from_hf(c)))
    assert cfg.qkv_bias and cfg.o_bias
    older = weights.config_to_json(ModelConfig.from_hf(make_config()))
    del older["o_bias"]  # written before the field existed: no o_proj bias
    assert not weights.config_from_json(older).o_bias


def test_unexpected_keys_and_ignored_extras(tmp_path):
    c = make_config()
    t = hf_tensors(c)
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    write_hf(tmp_path / "ok", c, t)
    weights.load_hf_checkpoint(tmp_path / "ok")  # inv_freq is a harmless extra
    t["model.layers.0.mlp.extra_proj.weight"] = np.ones((2, 2), np.float32)
    t["model.layers.2.input_layernorm.weight"] = np.ones(32, np.float32)  # only 2 layers
    t["model.layers.0.self_attn.o_proj.bias"] = np.ones(32, np.float32)  # Llama has none
    write_hf(tmp_path / "bad", c, t, num_shards=2)
    with pytest.raises(weights.CheckpointError) as info:
        weights.load_hf_checkpoint(tmp_path / "bad")
    names = sorted(u.split()[0] for u in info.value.unexpected)
    assert names == [
        "model.layers.0.mlp.extra_proj.weight",
        "model.layers.0.self_attn.o_proj.bias",
        "model.layers.2.input_layernorm.weight",
    ]
    assert not info.value.missing


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    c = make_config()
    t = hf_tensors(c)
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].T
    del t["model.norm.weight"]
    t["bogus.weight"] = np.ones(3, np.float32)
    write_hf(tmp_path, c, t)
    with pytest.raises(weights.CheckpointError) as info:
        weights.load_hf_checkpoint(tmp_path)
    msg = str(info.value)
    assert (
        "shape mismatch: model.layers.0.self_attn.k_proj.weight: checkpoint has [32, 16], "
        "config expects [16, 32]" in msg
    )
    assert len(info.value.problems) == 3  # mismatch, missing and unexpected, all at once
    assert "missing: model.norm.weight" in msg and "unexpected: bogus.weight" in msg


def test_unsupported_dtype_and_bad_index(tmp_path):
    c = make_config()
    t = hf_tensors(c)
    t["model.norm.weight"] = np.arange(32, dtype=np.int32)
    write_hf(tmp_path, c, t, num_shards=2)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(weights.CheckpointError) as info:
        weights.load_hf_checkpoint(tmp_path)
    msg = str(info.value)
    assert "unsupported dtype: model.norm.weight is I32" in msg
    assert "puts model.layers.9.mlp.up_proj.weight in model-00001-of-00002" in msg


def test_tied_lm_head_duplicate(tmp_path):
    c = make_config(tie_word_embeddings=True)
    t = hf_tensors(c)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    write_hf(tmp_path / "same", c, t)
    _, params = weights.load_hf_checkpoint(tmp_path / "same")  # an exact copy is accepted
    assert "lm_head.kernel" not in model.params_to_flat(params)
    t["lm_head.weight"] = t["lm_head.weight"] + 1
    write_hf(tmp_path / "diff", c, t)
    with pytest.raises(weights.CheckpointError, match="lm_head.weight differs"):
        weights.load_hf_checkpoint(tmp_path / "diff")


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        weights.load_hf_checkpoint(tmp_path / "nope")
    c = make_config()
    write_hf(tmp_path / "noconf", c, hf_tensors(c))
    (tmp_path / "noconf" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        weights.load_hf_checkpoint(tmp_path / "noconf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        weights.load_checkpoint(tmp_path / "noconf")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(c))
    with pytest.raises(FileNotFoundError, match="no weights"):
        weights.load_hf_checkpoint(tmp_path / "noweights")
    write_hf(tmp_path / "shards", c, hf_tensors(c), num_shards=3)
    (tmp_path / "shards" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(weights.CheckpointError, match="missing shard file: model-00002"):
        weights.load_hf_checkpoint(tmp_path / "shards")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither an HF checkpoint"):
        weights.load_checkpoint(tmp_path / "empty")


def test_broken_weight_files_are_named_not_a_traceback(tmp_path):
    """Real-world broken downloads: a shard cut short, git-lfs pointers instead of the
    weights (a clone without git-lfs), a header whose byte ranges disagree with a shape.
    Each is a CheckpointError (a ValueError the CLIs print as one line) naming the file,
    from the headers alone, where safetensors raised its own error (or MemoryError)
    mid-load."""
    c = make_config()
    t = hf_tensors(c)
    cut = write_hf(tmp_path / "cut", c, t, num_shards=2)
    shard = cut / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(weights.CheckpointError, match=r"model-00002-of-00002.safetensors is tr"):
        weights.load_hf_checkpoint(cut)

    lfs = write_hf(tmp_path / "lfs", c, t, num_shards=2)
    for f in lfs.glob("*.safetensors"):
        f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    with pytest.raises(weights.CheckpointError, match="git-lfs pointer.*git lfs pull") as info:
        weights.load_hf_checkpoint(lfs)
    assert len(info.value.problems) == 2  # both shards

    bad = write_hf(tmp_path / "offsets", c, t)
    f = bad / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    start = header["model.norm.weight"]["data_offsets"][0]
    header["model.norm.weight"]["data_offsets"] = [start, start + 4]  # 4 bytes for [32] f32
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(weights.CheckpointError, match=r"model.norm.weight: .* 4 bytes.*128"):
        weights.load_hf_checkpoint(bad)


def test_malformed_json_files_are_named(tmp_path):
    c = make_config()
    ckpt = write_hf(tmp_path, c, hf_tensors(c), num_shards=2)
    index = ckpt / "model.safetensors.index.json"
    good_index = index.read_text()
    for text, match in (("{bad", "is not valid JSON"), ("[1]", "must hold a JSON object")):
        (ckpt / "config.json").write_text(text)
        with pytest.raises(ValueError, match=f"config.json {match}"):
            weights.load_hf_checkpoint(ckpt)
        index.write_text(text)
        (ckpt / "config.json").write_text(json.dumps(c))
        with pytest.raises(ValueError, match=f"model.safetensors.index.json {match}"):
            weights.load_hf_checkpoint(ckpt)
    weight_map = json.loads(good_index)["weight_map"]
    index.write_text(json.dumps({"weight_map": dict(weight_map, **{"model.norm.weight": 3})}))
    with pytest.raises(ValueError, match="weight_map.*model.norm.weight.*3"):
        weights.load_hf_checkpoint(ckpt)


def test_pointing_at_the_wrong_path_says_where_to_point(tmp_path):
    """A weights file instead of its directory, and the HF hub cache's repo folder
    (blobs/, refs/, snapshots/REV/) instead of the snapshot: each error names the path
    to pass."""
    c = make_config()
    ckpt = write_hf(tmp_path / "ckpt", c, hf_tensors(c))
    for load in (weights.load_checkpoint, weights.load_hf_checkpoint):
        with pytest.raises(FileNotFoundError, match=f"is a file.*directory.*{ckpt}"):
            load(ckpt / "model.safetensors")
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    write_hf(repo / "snapshots" / "abc123", c, hf_tensors(c))
    with pytest.raises(FileNotFoundError, match="hub cache.*snapshots/abc123"):
        weights.load_checkpoint(repo)
    weights.load_checkpoint(repo / "snapshots" / "abc123")


def test_bad_config_json(tmp_path):
    c = make_config(architectures=["GPT2LMHeadModel"])
    write_hf(tmp_path, c, hf_tensors(make_config()))
    with pytest.raises(ValueError, match="unsupported architecture"):
        weights.load_hf_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- saving


def test_save_hf_roundtrip_sharded(tmp_path):
    c = make_config(**VARIANTS["qwen2_bias"])
    cfg, params = weights.load_hf_checkpoint(write_hf(tmp_path / "src", c, hf_tensors(c, 3)))
    tmp_path = tmp_path / "saved"
    weights.save_hf_checkpoint(params, cfg, tmp_path, shard_size_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "model.safetensors.index.json").is_file()
    cfg2, params2 = weights.load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    a, b = model.params_to_flat(params), model.params_to_flat(params2)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    # Saving again unsharded removes the old shards and index.
    weights.save_hf_checkpoint(params, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    weights.load_hf_checkpoint(tmp_path)


def test_a_failed_save_keeps_the_checkpoint_there(tmp_path):
    """The old shards were deleted before the new tensors were read: a save that failed
    on one (a deleted array, a donated buffer) left a directory with no weights."""
    c = make_config(**VARIANTS["qwen2_bias"])
    cfg, params = weights.load_hf_checkpoint(write_hf(tmp_path / "src", c, hf_tensors(c, 3)))
    weights.save_hf_checkpoint(params, cfg, tmp_path / "saved")
    broken = weights.load_hf_checkpoint(tmp_path / "saved")[1]
    next(iter(model.params_to_flat(broken).values())).delete()
    with pytest.raises(RuntimeError, match="deleted"):
        weights.save_hf_checkpoint(broken, cfg, tmp_path / "saved")
    assert weights.load_hf_checkpoint(tmp_path / "saved")[0] == cfg


def test_orbax_roundtrip_identical_logits(tmp_path):
    c = make_config(**VARIANTS["llama3_untied"])
    write_hf(tmp_path / "hf", c, hf_tensors(c), num_shards=2)
    cfg, params = weights.load_hf_checkpoint(tmp_path / "hf")
    weights.save_params(params, tmp_path / "orbax")
    assert weights.checkpoint_format(tmp_path / "orbax") == "orbax"
    assert weights.checkpoint_format(tmp_path / "hf") == "hf"
    cfg2, params2 = weights.load_checkpoint(tmp_path / "orbax")
    assert cfg2 == cfg
    x = jnp.asarray(TOKENS)
    np.testing.assert_array_equal(model.forward(params2, x), model.forward(params, x))

    with pytest.raises(FileExistsError, match="not empty"):
        weights.save_params(params, tmp_path / "orbax")
    with pytest.raises(FileExistsError, match="not a pagedjax checkpoint"):
        weights.save_params(params, tmp_path / "hf", overwrite=True)
    weights.save_params(params2, tmp_path / "orbax", overwrite=True)
    p16 = weights.restore_params(tmp_path / "orbax", dtype="bfloat16")
    assert p16.config.dtype == "bfloat16"
    assert all(v.dtype == jnp.bfloat16 for v in model.params_to_flat(p16).values())

    (tmp_path / "orbax" / weights.ORBAX_META_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="no pagedjax_checkpoint.json"):
        weights.load_checkpoint(tmp_path / "orbax")


def load_cli():
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_convert_cli(tmp_path, capsys):
    cli = load_cli()
    c = make_config(**VARIANTS["llama_tied"])
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c), num_shards=2)
    (hf / "tokenizer.json").write_text("{}")
    (hf / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{% endfor %}")
    assert cli.main([str(hf), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert "converted" in out and err == ""
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_text() == (hf / name).read_text()
    _, p_hf = weights.load_hf_checkpoint(hf, dtype="float32")
    _, p_orbax = weights.load_checkpoint(tmp_path / "out")
    x = jnp.asarray(TOKENS)
    np.testing.assert_array_equal(model.forward(p_orbax, x), model.forward(p_hf, x))

    # User errors: one message on stderr, no traceback, non-zero exit.
    assert cli.main([str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint: error:") and "not empty" in err
    assert "Traceback" not in err
    assert cli.main([str(tmp_path / "missing"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and len(err.strip().splitlines()) == 1


def test_convert_cli_merges_a_lora_adapter(tmp_path, capsys):
    """--merge-lora: the converted model computes what the base one with the adapter
    does; a bad adapter is refused before the model loads."""
    from lora_helpers import write_peft

    from pagedjax import lora

    cli = load_cli()
    c = make_config(**VARIANTS["llama_tied"])
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c), num_shards=1)
    cfg = weights.read_checkpoint_config(hf)
    write_peft(tmp_path / "ad", cfg, rank=2, modules=("q_proj", "down_proj"), seed=4)
    argv = [str(hf), str(tmp_path / "out"), "--dtype", "float32"]
    assert cli.main([*argv, "--merge-lora", str(tmp_path / "ad")]) == 0
    assert "merged LoRA adapter" in capsys.readouterr().out
    _, base = weights.load_hf_checkpoint(hf, dtype="float32")
    _, merged = weights.load_checkpoint(tmp_path / "out")
    want = lora.merge_adapter(base, lora.load_adapter(tmp_path / "ad", cfg))
    x = jnp.asarray(TOKENS)
    np.testing.assert_allclose(model.forward(merged, x), model.forward(want, x), rtol=1e-6)
    assert np.abs(model.forward(merged, x) - model.forward(base, x)).max() > 1e-3
    wide = dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size)
    write_peft(tmp_path / "wide", wide, rank=2, modules=("q_proj",))
    bad = [str(hf), str(tmp_path / "out3"), "--merge-lora", str(tmp_path / "wide")]
    assert cli.main(bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint: error:") and "do not fit the model's q_proj" in err
    assert not (tmp_path / "out3").exists()


def test_convert_cli_notes_a_missing_tokenizer_and_a_failed_write(tmp_path, capsys, monkeypatch):
    """Without tokenizer.json the converted checkpoint serves token ids only: it says so
    (generate.py refused it later). A write that fails (a full disk) is status 1, not
    bad input's 2."""
    cli = load_cli()
    c = make_config(**VARIANTS["llama_tied"])
    hf = write_hf(tmp_path / "hf", c, hf_tensors(c), num_shards=1)
    assert cli.main([str(hf), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "no tokenizer.json" in err and "token-id prompts" in err, err

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "save_params", full_disk)
    assert cli.main([str(hf), str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint: error:") and "No space left" in err, err
