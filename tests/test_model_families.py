"""Qwen3 (q/k RMSNorm) and uniform sliding-window attention (Mistral-7B-v0.1): config.json
in and out, the dense forward against plain numpy, the paged step (`decode.generate` and
the engine, chunked prefill and prefix caching) against the dense forward, checkpoints."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from params_helpers import random_params

from pagedjax import decode, model, weights
from pagedjax.config import PRESETS, ModelConfig
from pagedjax.engine import LLM, SamplingParams

# --- config.json -----------------------------------------------------------------------

QWEN3_0_6B = {  # Qwen/Qwen3-0.6B config.json
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1 config.json
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

QWEN2_7B = {  # Qwen/Qwen2-7B-Instruct config.json, sliding window as shipped (off)
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}


def test_qwen3_config_matches_preset():
    cfg = ModelConfig.from_hf(QWEN3_0_6B)
    assert cfg == PRESETS["qwen3-0.6b"]
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.sliding_window is None
    assert cfg.num_heads * cfg.head_dim == 2048 != cfg.hidden_size
    # Qwen3 with biases (q/k/v and o_proj, as Qwen3Attention), and a config known only by
    # its model_type.
    biased = ModelConfig.from_hf(dict(QWEN3_0_6B, attention_bias=True))
    assert biased.qkv_bias and biased.o_bias
    bare = {k: v for k, v in QWEN3_0_6B.items() if k not in ("architectures", "head_dim")}
    assert ModelConfig.from_hf(bare) == cfg  # HF's Qwen3Config: head_dim 128 by default


def test_mistral_v01_config_has_its_window():
    cfg = ModelConfig.from_hf(MISTRAL_7B_V01)
    assert cfg == PRESETS["mistral-7b-v0.1"]
    assert cfg.sliding_window == 4096 and not cfg.qk_norm and not cfg.qkv_bias
    assert ModelConfig.from_hf(dict(MISTRAL_7B_V01, sliding_window=None)).sliding_window is None


@pytest.mark.parametrize("base", [QWEN2_7B, QWEN3_0_6B], ids=["qwen2", "qwen3"])
def test_qwen_windows_every_layer_or_none(base):
    on = dict(base, use_sliding_window=True, sliding_window=4096)
    # A window that is set but switched off (as shipped), or absent, loads without one.
    assert ModelConfig.from_hf(dict(base, sliding_window=4096)).sliding_window is None
    assert ModelConfig.from_hf(dict(on, use_sliding_window=False)).sliding_window is None
    no_flag = {k: v for k, v in on.items() if k != "use_sliding_window"}  # HF default: off
    assert ModelConfig.from_hf(no_flag).sliding_window is None
    # HF slides layers i >= max_window_layers: 0 means all of them, 28 (= L) none.
    assert ModelConfig.from_hf(dict(on, max_window_layers=0)).sliding_window == 4096
    assert ModelConfig.from_hf(dict(on, max_window_layers=28)).sliding_window is None
    # The newer explicit list wins over max_window_layers.
    all_sliding = dict(on, max_window_layers=28, layer_types=["sliding_attention"] * 28)
    assert ModelConfig.from_hf(all_sliding).sliding_window == 4096
    all_full = dict(on, max_window_layers=0, layer_types=["full_attention"] * 28)
    assert ModelConfig.from_hf(all_full).sliding_window is None
    cfg = ModelConfig.from_hf(dict(on, max_window_layers=0))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("base", [QWEN2_7B, QWEN3_0_6B], ids=["qwen2", "qwen3"])
def test_mixed_per_layer_windows_are_refused(base):
    on = dict(base, use_sliding_window=True, sliding_window=4096)
    with pytest.raises(
        ValueError,
        match=r"sliding_window=4096 on only some layers \(max_window_layers=21 with "
        r"num_hidden_layers=28: 7 of 28 slide\) is not supported",
    ):
        ModelConfig.from_hf(dict(on, max_window_layers=21))
    mixed = ["full_attention"] * 27 + ["sliding_attention"]
    with pytest.raises(ValueError, match=r"sliding_window=4096 on only some layers .*1 of 28"):
        ModelConfig.from_hf(dict(on, layer_types=mixed))
    with pytest.raises(ValueError, match=r"for each of the 28 layers, got layer_types=\['chunk"):
        ModelConfig.from_hf(dict(on, layer_types=["chunked_attention"] * 28))
    with pytest.raises(ValueError, match=r"for each of the 28 layers, got layer_types=\["):
        ModelConfig.from_hf(dict(on, layer_types=["sliding_attention"] * 27))


def test_to_hf_round_trips_every_family():
    tiny = PRESETS["tiny"]
    variants = {
        "qwen3": dataclasses.replace(tiny, qk_norm=True, head_dim=32),
        "qwen3_bias_window": dataclasses.replace(
            tiny, qk_norm=True, qkv_bias=True, o_bias=True, sliding_window=8
        ),
        "qwen2_window": dataclasses.replace(tiny, qkv_bias=True, sliding_window=8),
        "mistral": dataclasses.replace(tiny, sliding_window=8),
        "llama": tiny,
        "llama_bias": dataclasses.replace(tiny, qkv_bias=True, o_bias=True),
    }
    archs = {}
    for name, cfg in variants.items():
        hf = cfg.to_hf()
        json.dumps(hf)
        assert ModelConfig.from_hf(hf) == cfg, name
        archs[name] = (
            hf["architectures"],
            hf["model_type"],
            hf.get("sliding_window"),
            hf.get("attention_bias"),
        )
    assert archs == {
        "qwen3": (["Qwen3ForCausalLM"], "qwen3", None, False),
        "qwen3_bias_window": (["Qwen3ForCausalLM"], "qwen3", 8, True),
        "qwen2_window": (["Qwen2ForCausalLM"], "qwen2", 8, None),  # Qwen2 ignores the key
        "mistral": (["MistralForCausalLM"], "mistral", 8, None),  # so does Mistral
        "llama": (["LlamaForCausalLM"], "llama", None, False),
        "llama_bias": (["LlamaForCausalLM"], "llama", None, True),
    }
    # HF's own rule on the Qwen form: every layer i >= max_window_layers slides.
    hf = variants["qwen2_window"].to_hf()
    assert hf["use_sliding_window"] and hf["max_window_layers"] == 0
    assert hf["layer_types"] == ["sliding_attention"] * tiny.num_layers


# --- the dense forward against plain numpy (float64, written from the HF definitions) ----

BASE = ModelConfig(
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,  # H * D = 128 != E = 64
    hidden_size=64,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=128,
    dtype="float32",
    eos_token_ids=(),
)
QWEN3 = dataclasses.replace(BASE, qk_norm=True, tie_embeddings=True)
MISTRAL = dataclasses.replace(BASE, sliding_window=8)
# Qwen3 with attention_bias: q/k/v and o_proj biases.
QWEN3_WINDOW = dataclasses.replace(BASE, qk_norm=True, qkv_bias=True, o_bias=True, sliding_window=5)
VARIANTS = {"qwen3": QWEN3, "mistral_window": MISTRAL, "qwen3_bias_window": QWEN3_WINDOW}


def np_forward(flat, cfg: ModelConfig, tokens, *, qk_norm=None, window="cfg"):
    """Logits [T, V] of one sequence; `qk_norm` / `window` override the config's."""
    qk_norm = cfg.qk_norm if qk_norm is None else qk_norm
    window = cfg.sliding_window if window == "cfg" else window
    f = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    t, h, kh, d = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]  # [T, 1, D]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = (j <= i) & ((j > i - window) if window is not None else True)

    def rms(x, w):
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps)

    def lin(x, name):
        y = x @ f[name + ".kernel"]
        return y + f[name + ".bias"] if name + ".bias" in f else y

    def rope(x):  # HF: x * cos + rotate_half(x) * sin
        rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    x = f["embed_tokens.embedding"][np.asarray(tokens)]
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        a = rms(x, f[p + "input_layernorm.scale"])
        q = lin(a, p + "self_attn.q_proj").reshape(t, h, d)
        k = lin(a, p + "self_attn.k_proj").reshape(t, kh, d)
        v = lin(a, p + "self_attn.v_proj").reshape(t, kh, d)
        if qk_norm:  # Qwen3Attention: q_norm / k_norm on each head, then RoPE
            q = rms(q, f[p + "self_attn.q_norm.scale"])
            k = rms(k, f[p + "self_attn.k_norm.scale"])
        q, k = rope(q), rope(k)
        o = np.zeros((t, h, d))
        for head in range(h):
            kv = head // (h // kh)
            s = np.where(visible, q[:, head] @ k[:, kv].T / math.sqrt(d), -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            o[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + lin(o.reshape(t, h * d), p + "self_attn.o_proj")
        m = rms(x, f[p + "post_attention_layernorm.scale"])
        g = lin(m, p + "mlp.gate_proj")
        x = x + lin(g / (1 + np.exp(-g)) * lin(m, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms(x, f["norm.scale"])
    return x @ (f["embed_tokens.embedding"].T if cfg.tie_embeddings else f["lm_head.kernel"])


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_dense_forward_matches_numpy(name):
    cfg = VARIANTS[name]
    params = random_params(cfg, seed=1)  # every norm scale random, q_norm/k_norm included
    flat = model.params_to_flat(params)
    if cfg.qk_norm:
        assert flat["layers.1.self_attn.q_norm.scale"].shape == (cfg.head_dim,)
        assert float(np.std(flat["layers.1.self_attn.k_norm.scale"])) > 0.1
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 19))
    out = np.asarray(jax.jit(model.forward)(params, jnp.asarray(tokens)))
    for b in range(2):
        ref = np_forward(flat, cfg, tokens[b])
        assert rel_err(out[b], ref) < 1e-5
        # Each feature changes the logits by far more than the 1e-5 above, so the
        # comparison would see it missing (qk_norm: 0.098 with the o_proj biases drawn).
        if cfg.o_bias:
            no_o = {k: v for k, v in flat.items() if not k.endswith("self_attn.o_proj.bias")}
            assert len(no_o) == len(flat) - cfg.num_layers
            assert rel_err(np_forward(no_o, cfg, tokens[b]), ref) > 0.05
        if cfg.qk_norm:
            assert rel_err(np_forward(flat, cfg, tokens[b], qk_norm=False), ref) > 0.05
        if cfg.sliding_window is not None:
            full = np_forward(flat, cfg, tokens[b], window=None)
            w = cfg.sliding_window
            np.testing.assert_allclose(full[:w], ref[:w], rtol=1e-9)  # same until p >= W
            assert rel_err(full[w:], ref[w:]) > 0.1


def test_every_norm_uses_the_configs_eps():
    """Qwen3's q_norm and k_norm take rms_norm_eps like the layer norms: a large eps
    moves every norm's output, so one left at a fixed or zero eps fails the comparison."""
    cfg = dataclasses.replace(QWEN3, norm_eps=0.5)
    params = random_params(cfg, seed=5)
    flat = model.params_to_flat(params)
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, size=(1, 7))
    out = np.asarray(jax.jit(model.forward)(params, jnp.asarray(tokens)))[0]
    ref = np_forward(flat, cfg, tokens[0])
    assert rel_err(out, ref) < 1e-5
    assert rel_err(np_forward(flat, dataclasses.replace(cfg, norm_eps=1e-6), tokens[0]), ref) > 0.05


def test_window_changes_the_models_logits():
    """The same weights with and without the window: equal before position W, not after."""
    params = random_params(MISTRAL, seed=3)
    full_cfg = dataclasses.replace(MISTRAL, sliding_window=None)
    unwindowed = model.params_from_flat(full_cfg, model.params_to_flat(params))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 128, size=(1, 20)))
    forward = jax.jit(model.forward)
    windowed = np.asarray(forward(params, tokens))[0]
    full = np.asarray(forward(unwindowed, tokens))[0]
    w = MISTRAL.sliding_window
    assert rel_err(windowed[:w], full[:w]) < 1e-6
    assert rel_err(windowed[w:], full[w:]) > 0.1


# --- the paged step against the dense forward ---------------------------------------------

WIDTH = 48  # dense buffer width (>= any sequence here), fixed so one program serves all


def dense_greedy(params, prompts, max_tokens):
    """Greedy continuations by the dense forward, recomputed from scratch each token, and
    the logits each token was chosen from ([max_tokens, V] per prompt)."""
    fn = jax.jit(model.forward)
    seqs = [list(p) for p in prompts]
    logits = [[] for _ in prompts]
    for _ in range(max_tokens):
        buf = np.zeros((len(seqs), WIDTH), np.int32)
        for b, s in enumerate(seqs):
            buf[b, : len(s)] = s
        out = np.asarray(fn(params, jnp.asarray(buf)))
        for b, s in enumerate(seqs):
            logits[b].append(out[b, len(s) - 1])
            s.append(int(out[b, len(s) - 1].argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)], [np.stack(x) for x in logits]


def random_prompts(cfg, lens, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lens]


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_bias_window",  # both features; the engine test below shares its programs
        pytest.param("mistral_window", marks=pytest.mark.slow),
        pytest.param("qwen3", marks=pytest.mark.slow),
    ],
)
def test_generate_equals_dense_greedy(name):
    """Page size 4, windows 5 and 8, prompts of 6 to 29 tokens prefilled 5 at a time (at
    most the window, not page aligned): the same tokens, and logits to f32 tolerance."""
    cfg = VARIANTS[name]
    params = random_params(cfg, seed=5)
    prompts = random_prompts(cfg, (22, 29, 6), seed=6)
    want, want_logits = dense_greedy(params, prompts, 8)
    out = decode.generate(
        params,
        prompts,
        max_new_tokens=8,
        page_size=4,
        prefill_chunk=5,
        backend="xla",
        return_logits=True,
    )
    assert out.tokens == want
    for got, ref in zip(out.logits, want_logits, strict=True):
        assert rel_err(got, ref) < 1e-4


def test_engine_with_prefix_caching_and_chunked_prefill_equals_dense_greedy():
    """Qwen3 norms and a window of 5 together, two rounds of prompts sharing 16 tokens
    (the second round hits the prefix cache), 7-token steps."""
    cfg = QWEN3_WINDOW
    params = random_params(cfg, seed=7)
    rng = np.random.default_rng(8)
    shared = rng.integers(0, cfg.vocab_size, size=16).tolist()
    prompts = [shared + p for p in random_prompts(cfg, (7, 11, 2), seed=9)]
    prompts.append(random_prompts(cfg, (9,), seed=10)[0])
    want, _ = dense_greedy(params, prompts, 10)
    llm = LLM(
        params,
        page_size=4,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=7,
        enable_prefix_caching=True,
        backend="xla",
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    for _ in range(2):
        outs = llm.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.num_cached_tokens for o in outs) >= 4 * 16
    llm.block_manager.check_invariants()


# --- checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hf_checkpoint_round_trip(tmp_path, name):
    cfg = VARIANTS[name]
    params = random_params(cfg, seed=11)
    weights.save_hf_checkpoint(params, cfg, tmp_path)
    hf = json.loads((tmp_path / weights.CONFIG_FILE).read_text())
    names = weights._read_header(tmp_path / weights.SAFETENSORS_FILE)
    if cfg.qk_norm:
        assert hf["architectures"] == ["Qwen3ForCausalLM"]
        for norm in ("q_norm", "k_norm"):
            assert names[f"model.layers.1.self_attn.{norm}.weight"].shape == (cfg.head_dim,)
    else:
        assert not any("_norm.weight" in n and "self_attn" in n for n in names)
    assert ("model.layers.1.self_attn.o_proj.bias" in names) == cfg.o_bias
    assert hf.get("sliding_window") == cfg.sliding_window
    cfg2, params2 = weights.load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    flat, flat2 = model.params_to_flat(params), model.params_to_flat(params2)
    assert flat.keys() == flat2.keys()
    for k in flat:
        np.testing.assert_array_equal(np.asarray(flat2[k]), np.asarray(flat[k]), err_msg=k)


def test_checkpoint_q_k_norms_are_checked_by_name(tmp_path):
    """A Qwen3 checkpoint without a k_norm lists it as missing (HF name and shape); read as
    a Llama (no qk_norm), its norms are unexpected rather than taken for projections."""
    from safetensors.numpy import load_file, save_file

    cfg = QWEN3
    weights.save_hf_checkpoint(random_params(cfg, seed=12), cfg, tmp_path)
    file = tmp_path / weights.SAFETENSORS_FILE
    tensors = load_file(str(file))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(file))
    with pytest.raises(weights.CheckpointError) as err:
        weights.load_hf_checkpoint(tmp_path)
    assert err.value.missing == ["model.layers.1.self_attn.k_norm.weight [32]"]
    assert not err.value.unexpected
    hf = dict(cfg.to_hf(), architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / weights.CONFIG_FILE).write_text(json.dumps(hf))
    with pytest.raises(weights.CheckpointError) as err:
        weights.load_hf_checkpoint(tmp_path)
    assert not err.value.missing
    assert err.value.unexpected == [
        "model.layers.0.self_attn.k_norm.weight [32]",
        "model.layers.0.self_attn.q_norm.weight [32]",
        "model.layers.1.self_attn.q_norm.weight [32]",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_generate_with_interpreted_kernels_equals_dense_greedy(backend):
    """The Pallas kernels (interpret mode) with the window, through the model."""
    cfg = QWEN3_WINDOW
    params = random_params(cfg, seed=13)
    prompts = random_prompts(cfg, (13, 4), seed=14)
    want, want_logits = dense_greedy(params, prompts, 4)
    out = decode.generate(
        params,
        prompts,
        max_new_tokens=4,
        page_size=4,
        prefill_chunk=6,
        backend=backend,
        interpret=True,
        return_logits=True,
    )
    assert out.tokens == want
    for got, ref in zip(out.logits, want_logits, strict=True):
        assert rel_err(got, ref) < 1e-4
