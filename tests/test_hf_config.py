"""pagedjax.hf_config: HF config.json of each family to a ModelConfig and back.

Each family's keys and defaults, biases, sliding windows, dtypes, and what from_hf
refuses rather than ignore. RoPE (rope_theta, the rope_scaling and rope_parameters
dicts, llama3, linear and yarn scaling) is in tests/test_hf_config_rope.py.
"""

import dataclasses

import pytest
from hf_config_helpers import LLAMA31_8B, QWEN25_7B

from pagedjax.config import PRESETS, ModelConfig


def test_from_hf_classic_keys_matches_preset():
    cfg = ModelConfig.from_hf(LLAMA31_8B)
    assert cfg == PRESETS["llama3-8b"]
    assert cfg.head_dim == 128  # derived: no head_dim key
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_from_hf_qwen2_bias_and_tied():
    d = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "eos_token_id": 151645,
    }
    cfg = ModelConfig.from_hf(d)
    assert cfg.qkv_bias and cfg.tie_embeddings and cfg.head_dim == 64


def test_to_hf_roundtrip():
    for name, cfg in PRESETS.items():
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg, name


def test_unknown_architecture():
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        ModelConfig.from_hf(dict(LLAMA31_8B, architectures=["GPT2LMHeadModel"]))


def test_missing_keys_listed():
    d = {k: v for k, v in LLAMA31_8B.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(ValueError, match="hidden_size.*vocab_size"):
        ModelConfig.from_hf(d)


def test_sliding_window_is_read_or_ignored_as_hf_does():
    """Mistral slides every layer; a window of at least the context, or a Qwen config with
    use_sliding_window false, means none (tests/test_model_families.py covers the rest)."""
    mistral = dict(LLAMA31_8B, architectures=["MistralForCausalLM"], model_type="mistral")
    mistral["sliding_window"] = 4096
    assert ModelConfig.from_hf(mistral).sliding_window == 4096
    assert ModelConfig.from_hf(dict(mistral, sliding_window=None)).sliding_window is None
    assert ModelConfig.from_hf(dict(mistral, sliding_window=131072)).sliding_window is None
    qwen = dict(LLAMA31_8B, sliding_window=4096, use_sliding_window=False)
    assert ModelConfig.from_hf(qwen).sliding_window is None


def test_llama_slides_only_where_layer_types_says():
    """HF's Llama ignores `sliding_window`; vLLM's reads it for the layers `layer_types`
    marks. A stray key (Llama, or no family named at all) is no window."""
    llama = dict(LLAMA31_8B, sliding_window=4096)
    assert ModelConfig.from_hf(llama).sliding_window is None
    bare = {k: v for k, v in llama.items() if k not in ("architectures", "model_type")}
    assert ModelConfig.from_hf(bare).sliding_window is None
    marked = dict(llama, layer_types=["sliding_attention"] * 32)
    assert ModelConfig.from_hf(marked).sliding_window == 4096
    with pytest.raises(ValueError, match="on only some layers"):
        ModelConfig.from_hf(
            dict(marked, layer_types=["full_attention"] + ["sliding_attention"] * 31)
        )
    # A Llama-shaped config with a window and biases is written so that it reads back.
    cfg = dataclasses.replace(PRESETS["tiny"], qkv_bias=True, o_bias=True, sliding_window=8)
    hf = cfg.to_hf()
    assert hf["model_type"] == "llama" and hf["layer_types"] == ["sliding_attention"] * 2
    assert ModelConfig.from_hf(hf) == cfg


def test_from_hf_absent_keys_take_hfs_defaults():
    """Keys a hand-written config.json may leave out mean what HF's config classes say:
    rms_norm_eps 1e-6 (Llama, Qwen2, Qwen3 and Mistral alike), rope_theta 10000, MHA."""
    bare = {k: v for k, v in LLAMA31_8B.items() if k not in ("rms_norm_eps", "rope_theta")}
    del bare["num_key_value_heads"]
    cfg = ModelConfig.from_hf(bare)
    assert cfg.norm_eps == 1e-6 and cfg.rope_theta == 10000.0 and cfg.num_kv_heads == 32


_OPTIONAL = (
    "max_position_embeddings",
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
)


@pytest.mark.parametrize(
    "family, max_pos, intermediate, kv_heads, head_dim, window",
    [  # the defaults of LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config
        ("llama", 2048, 11008, 32, 128, None),
        (None, 2048, 11008, 32, 128, None),  # neither architectures nor model_type
        ("mistral", 131072, 14336, 8, 128, 4096),
        ("qwen2", 32768, 22016, 32, 128, None),  # use_sliding_window defaults to false
        ("qwen3", 32768, 22016, 32, 128, None),
    ],
)
def test_from_hf_absent_keys_take_each_familys_defaults(
    family, max_pos, intermediate, kv_heads, head_dim, window
):
    """An absent key is the family's HF default, not one guess for all (every family
    had 8192 positions, 4 * hidden MLP width, MHA; a Mistral config without
    `sliding_window` ran with no window, where HF slides 4096)."""
    bare = {k: v for k, v in LLAMA31_8B.items() if k not in _OPTIONAL}
    bare = {**bare, "hidden_size": 4096 if family != "qwen3" else 1024, "rope_scaling": None}
    bare.pop("architectures")
    bare.pop("model_type")
    if family is not None:
        bare["architectures"], bare["model_type"] = _FAMILIES[family]
    cfg = ModelConfig.from_hf(bare)
    got = (
        cfg.max_position_embeddings,
        cfg.intermediate_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.sliding_window,
    )
    assert got == (max_pos, intermediate, kv_heads, head_dim, window)
    if family in ("qwen2", "qwen3"):  # their window, once switched on
        on = {**bare, "use_sliding_window": True, "max_window_layers": 0}
        assert ModelConfig.from_hf(on).sliding_window == 4096
    # A null num_key_value_heads is MHA in every family (Mistral's and Qwen's too).
    assert ModelConfig.from_hf({**bare, "num_key_value_heads": None}).num_kv_heads == 32


@pytest.mark.parametrize(
    "key, value",
    [
        ("rope_theta", None),  # a TypeError from float(None) before, not named
        ("rms_norm_eps", "1e-5"),
        ("max_position_embeddings", 8192.5),
        ("num_hidden_layers", True),
        ("intermediate_size", None),
        ("eos_token_id", [128001, None]),
    ],
)
def test_from_hf_names_a_value_of_the_wrong_type(key, value):
    with pytest.raises(ValueError, match=f"config.json: {key} must be"):
        ModelConfig.from_hf({**LLAMA31_8B, key: value})


def test_from_hf_reads_null_as_hf_does_where_hf_does():
    # HF: a null num_key_value_heads means MHA, a null head_dim hidden_size // heads.
    cfg = ModelConfig.from_hf({**LLAMA31_8B, "num_key_value_heads": None, "head_dim": None})
    assert cfg.num_kv_heads == cfg.num_heads == 32 and cfg.head_dim == 128


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("mlp_bias", True, "mlp_bias=True"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
        ("quantization_config", {"quant_method": "gptq", "bits": 4}, "quant_method.*'gptq'"),
        ("architectures", ["MixtralForCausalLM", "LlamaForCausalLM"], "MixtralForCausalLM"),
        ("architectures", ["LlamaForCausalLM", "MixtralForCausalLM"], "MixtralForCausalLM"),
        ("architectures", [], "unsupported model_type 'mixtral'"),  # model_type alone
        ("rope_parameters", {"type": "dynamic", "factor": 2.0}, "rope scaling type 'dynamic'"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "high_freq_factor"),
    ],
)
def test_from_hf_refuses_what_it_would_ignore(key, value, match):
    """Each of these changes the model's math; reading past it would load a model that
    runs and writes garbage, so from_hf names the key and value instead."""
    d = dict(LLAMA31_8B, **{key: value})
    if key == "architectures" and not value:
        d["model_type"] = "mixtral"
    if key == "rope_parameters":  # the newer form, alone as transformers v5 writes it
        del d["rope_scaling"], d["rope_theta"]
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(d)


def test_from_hf_accepts_the_harmless_forms():
    ok = dict(LLAMA31_8B, hidden_act="silu", mlp_bias=False, partial_rotary_factor=1.0)
    assert ModelConfig.from_hf(ok) == ModelConfig.from_hf(LLAMA31_8B)
    assert ModelConfig.from_hf(dict(LLAMA31_8B, hidden_act="swish")) == PRESETS["llama3-8b"]
    d = dict(LLAMA31_8B, rope_scaling=None, rope_parameters={"type": "default"})
    assert ModelConfig.from_hf(d).rope_scaling is None


_FAMILIES = {  # family -> (architectures, model_type)
    "llama": (["LlamaForCausalLM"], "llama"),
    "qwen2": (["Qwen2ForCausalLM"], "qwen2"),
    "qwen3": (["Qwen3ForCausalLM"], "qwen3"),
    "mistral": (["MistralForCausalLM"], "mistral"),
}


@pytest.mark.parametrize(
    "family, attention_bias, qkv_bias, o_bias",
    [
        # LlamaAttention and Qwen3Attention: q/k/v and o_proj all bias=config.attention_bias.
        ("llama", None, False, False),
        ("llama", False, False, False),
        ("llama", True, True, True),
        ("qwen3", False, False, False),
        ("qwen3", True, True, True),
        # Qwen2Attention: q/k/v bias=True and o_proj bias=False, attention_bias unread.
        ("qwen2", None, True, False),
        ("qwen2", True, True, False),
        # MistralAttention: bias=False on all four, attention_bias unread.
        ("mistral", None, False, False),
        ("mistral", True, False, False),
    ],
)
def test_from_hf_attention_bias_per_family(family, attention_bias, qkv_bias, o_bias):
    archs, model_type = _FAMILIES[family]
    d = dict(LLAMA31_8B, architectures=archs, model_type=model_type)
    if attention_bias is not None:
        d["attention_bias"] = attention_bias
    cfg = ModelConfig.from_hf(d)
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv_bias, o_bias)
    # The family comes from architectures, else from model_type alone.
    del d["architectures"]
    assert ModelConfig.from_hf(d) == cfg


def _bias_combos():
    for qkv in (False, True):
        for o in (False, True):
            for qk_norm in (False, True):
                for window in (None, 8):
                    yield qkv, o, qk_norm, window


def test_to_hf_round_trips_every_bias_combination_hf_can_express():
    """from_hf(to_hf(c)) == c for every mix of biases, q/k norms and window that some HF
    family expresses; the rest (o_proj bias alone; Qwen3 with q/k/v biases but none on
    o_proj) are refused when the config is made, so to_hf never writes a different model."""
    tiny = PRESETS["tiny"]
    written = {}
    for qkv, o, qk_norm, window in _bias_combos():
        changes = dict(qkv_bias=qkv, o_bias=o, qk_norm=qk_norm, sliding_window=window)
        if (o and not qkv) or (qk_norm and qkv != o):
            with pytest.raises(ValueError, match=f"qkv_bias={qkv}, o_bias={o}"):
                dataclasses.replace(tiny, **changes)
            continue
        cfg = dataclasses.replace(tiny, **changes)
        hf = cfg.to_hf()
        assert ModelConfig.from_hf(hf) == cfg, changes
        written[qkv, o, qk_norm, window] = (hf["model_type"], hf.get("attention_bias"))
    assert written == {
        (False, False, False, None): ("llama", False),
        (False, False, False, 8): ("mistral", None),
        (False, False, True, None): ("qwen3", False),
        (False, False, True, 8): ("qwen3", False),
        (True, False, False, None): ("qwen2", None),  # HF's Qwen2 never reads it
        (True, False, False, 8): ("qwen2", None),
        (True, True, False, None): ("llama", True),
        (True, True, False, 8): ("llama", True),
        (True, True, True, None): ("qwen3", True),
        (True, True, True, 8): ("qwen3", True),
    }


# --- what transformers 5 reads, checked with transformers 5.24's config classes -----------


def test_from_hf_window_numbers_must_be_ints():
    """HF's config classes refuse a float or bool window; it was truncated (4.5 -> 4) or
    read as 1 (true), and a null max_window_layers was a bare TypeError."""
    mistral = dict(LLAMA31_8B, architectures=["MistralForCausalLM"], model_type="mistral")
    for bad in (4.5, True, "4096"):
        with pytest.raises(
            ValueError, match=f"sliding_window must be an int, got sliding_window={bad!r}"
        ):
            ModelConfig.from_hf(dict(mistral, sliding_window=bad))
    assert ModelConfig.from_hf(dict(mistral, sliding_window=4096.0)).sliding_window == 4096
    for bad in (0, -8):
        with pytest.raises(ValueError, match=f"positive int, got sliding_window={bad}"):
            ModelConfig.from_hf(dict(mistral, sliding_window=bad))
    qwen = dict(mistral, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    qwen.update(use_sliding_window=True, sliding_window=4096)
    for bad in (None, 0.5):
        with pytest.raises(
            ValueError, match=f"max_window_layers must be an int, got max_window_layers={bad}"
        ):
            ModelConfig.from_hf(dict(qwen, max_window_layers=bad))
    # A key HF's Llama never reads is not checked either.
    assert ModelConfig.from_hf(dict(LLAMA31_8B, sliding_window=4.5)).sliding_window is None


def test_from_hf_mistral_slides_every_layer_whatever_layer_types_says():
    """HF's MistralForCausalLM ignores layer_types (it warns and names Ministral) and
    slides every layer; a list marking any layer full attention read as no window (all
    full) where HF slides: it is refused, a list of all sliding layers agrees."""
    mistral = dict(LLAMA31_8B, architectures=["MistralForCausalLM"], model_type="mistral")
    mistral["sliding_window"] = 4096
    marked = dict(mistral, layer_types=["sliding_attention"] * 32)
    assert ModelConfig.from_hf(marked).sliding_window == 4096
    for layer_types in (["full_attention"] * 32, ["full_attention"] + ["sliding_attention"] * 31):
        with pytest.raises(ValueError, match="MistralForCausalLM slides every layer.*HF ignores"):
            ModelConfig.from_hf(dict(mistral, layer_types=layer_types))
    assert (
        ModelConfig.from_hf(
            dict(mistral, layer_types=["full_attention"] * 32, sliding_window=None)
        ).sliding_window
        is None
    )


def test_from_hf_qwen_window_layers_as_hf_derives_them():
    """Qwen without layer_types: layers i >= max_window_layers slide, 28 when absent, so
    a model of at most 28 layers slides none; layer_types must name every layer."""
    qwen = dict(QWEN25_7B, rope_scaling=None, use_sliding_window=True, sliding_window=4096)
    assert ModelConfig.from_hf(qwen).sliding_window is None  # 28 layers, none >= 28
    assert ModelConfig.from_hf(dict(qwen, max_window_layers=0)).sliding_window == 4096
    with pytest.raises(ValueError, match="27 of 28 slide"):
        ModelConfig.from_hf(dict(qwen, max_window_layers=1))
    with pytest.raises(ValueError, match="for each of the 28 layers"):
        ModelConfig.from_hf(dict(qwen, layer_types=["sliding_attention"] * 27))
    with pytest.raises(ValueError, match="for each of the 28 layers"):
        ModelConfig.from_hf(dict(qwen, layer_types=["sliding_attention"] * 27 + ["chunked"]))


def test_from_hf_absent_tie_and_dtype_keys():
    """Every family's HF config defaults tie_word_embeddings to false; transformers 5
    writes `dtype` where 4.x wrote `torch_dtype` (and either may say "torch.float32")."""
    bare = {k: v for k, v in LLAMA31_8B.items() if k not in ("tie_word_embeddings", "torch_dtype")}
    for archs, model_type in _FAMILIES.values():
        cfg = ModelConfig.from_hf(dict(bare, architectures=archs, model_type=model_type))
        assert (cfg.tie_embeddings, cfg.dtype) == (False, "bfloat16")
    for key in ("dtype", "torch_dtype"):
        for name in ("float32", "torch.float32"):
            assert ModelConfig.from_hf(dict(bare, **{key: name})).dtype == "float32"
    assert ModelConfig.from_hf(dict(bare, dtype="float16")).dtype == "bfloat16"
    # Both keys: transformers 5 reads `dtype` (`torch_dtype` won here).
    both = ModelConfig.from_hf(dict(bare, dtype="float32", torch_dtype="bfloat16"))
    assert both.dtype == "float32"
    # The dtype argument overrides the file's; an empty one was taken for none.
    assert ModelConfig.from_hf(bare, dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be one of .*, got ''"):
        ModelConfig.from_hf(bare, dtype="")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("eos_token_id", True, "eos_token_id must be ints, got True"),
        ("eos_token_id", [128001, False], r"eos_token_id must be ints, got \[128001, False\]"),
        ("bos_token_id", "128000", "bos_token_id must be an int, got bos_token_id='128000'"),
        ("num_attention_heads", 0, "num_heads must be a positive int, got num_heads=0"),
    ],
)
def test_from_hf_names_bad_token_ids_and_head_counts(key, value, match):
    """A bool is no token id (JSON's true is 1 to Python); zero heads was a bare
    ZeroDivisionError from hidden_size // num_attention_heads."""
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**LLAMA31_8B, key: value})
    assert ModelConfig.from_hf({**LLAMA31_8B, "bos_token_id": None}).bos_token_id is None
